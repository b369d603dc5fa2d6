/* Attention of a prefill chunk's new tokens over their paged context, for CPUs with AVX512-BF16
 * (compiled where -march=native has it; elsewhere chunk_attention_bf16 returns -1 and the caller
 * keeps torch's fused attention).
 *
 * torch's fused CPU attention runs at about 120 GFLOPS here in float32 or bfloat16; this one
 * multiplies with `vdpbf16ps` (32 bfloat16 products into 16 float32 lanes per instruction). The
 * scores q.k are exact products summed in float32, as torch's are; the softmax runs in float32;
 * only the probabilities are rounded to bfloat16 before they weigh the values (relative error at
 * most 2^-9 per probability), as GPU flash attention does.
 *
 * First each KV head's keys and values are packed from the paged cache into the pair layouts the
 * instruction takes: keys per tile of 16 positions as [head_dim / 2][16 positions][2 dims], so
 * one load is 16 positions' dims 2j, 2j + 1 and a query's pair of dims is broadcast against it;
 * values per pair of positions as [head_dim][2 positions], so one load is 16 dims of two
 * positions and a pair of probabilities is broadcast against it. Then each item, ITEM_ROWS query
 * vectors (token x head of one KV head, a partial last item) walks the context TILE positions at
 * a time: scores, an online softmax, and the values added into ITEM_ROWS x head_dim float32 sums
 * kept in registers. Where the CPU has AMX (and Linux grants the tiles), items are 16 query
 * vectors and both products run on tiles instead (attend_item_amx, below): the same packed
 * layouts and softmax, 4.4x less time for the long workload's chunks on Xeon-AMX.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "kernels.h"
#include "kv_layout.h"
#include "vector_math.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

enum { ITEM_ROWS = 4, TILE = 64, SUB = 16, MAX_DIM_CHUNKS = 8 };

typedef struct {
    const uint16_t *query;
    int64_t query_token_stride, query_head_stride; /* in elements */
    const uint16_t *keys, *values;                  /* packed, per KV head */
    int64_t packed_positions;                       /* the context rounded up to TILE */
    int64_t rows, context;
    int num_heads, num_kv_heads, head_dim, sliding_window;
    float scale;
    uint16_t *out;
} Chunk;

/* The slot of context position p (its block's, from `blocks`, and its place in it). */
static inline int64_t slot_of(const int32_t *blocks, int block_size, int64_t p)
{
    return (int64_t)blocks[p / block_size] * block_size + p % block_size;
}

/* Tile t (positions t SUB .. t SUB + SUB - 1, in one block of the cache) of KV head h: keys as
 * [head_dim / 2][SUB][2], as the cache keeps them (kv_layout.h; SUB is its KEY_TILE), copied;
 * values as [SUB / 2 position pairs][head_dim][2], each pair's rows interleaved; zeros past the
 * context. (Block sizes are multiples of SUB, so a tile's rows lie evenly spaced in one block.)
 * In vectors and split across the threads by tile: packed element by element and a KV head per
 * thread, a 16-token chunk over 400 positions took 127 us a layer, then 67 with the keys
 * transposed in vectors (Xeon-AMX). */
static void pack_tile(const uint16_t *key_cache, const uint16_t *value_cache, const int32_t *blocks, int block_size,
                      int kv_heads, int head_dim, int64_t context, int64_t t, int h, uint16_t *keys, uint16_t *values)
{
    const int64_t first = t * SUB;
    const int valid = context - first < SUB ? (int)(context - first) : SUB; /* < 1: a tile of padding */
    const int64_t slot = valid > 0 ? slot_of(blocks, block_size, first) : 0;
    const uint16_t *value_rows = valid > 0 ? value_cache + slot * kv_heads * head_dim + (int64_t)h * head_dim : NULL;
    const int64_t stride = (int64_t)kv_heads * head_dim;
    if (valid > 0) memcpy(keys, key_cache + key_index(slot, h, 0, kv_heads, head_dim), sizeof(uint16_t) * SUB * head_dim);
    const int from = valid > 0 ? valid : 0; /* the first position past the context */
    for (int j = 0; from < SUB && j < head_dim / 2; j++)
        memset(keys + (j * SUB + from) * 2, 0, sizeof(uint16_t) * 2 * (SUB - from));
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                         39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int pair = 0; pair < SUB / 2; pair++)
        for (int c = 0; c < head_dim / 32; c++) {
            const int p = 2 * pair;
            const __m512i even = p < valid ? _mm512_loadu_si512(value_rows + p * stride + 32 * c) : _mm512_setzero_si512();
            const __m512i odd = p + 1 < valid ? _mm512_loadu_si512(value_rows + (p + 1) * stride + 32 * c)
                                              : _mm512_setzero_si512();
            uint16_t *to = values + pair * 2 * head_dim + 64 * c;
            _mm512_storeu_si512(to, _mm512_permutex2var_epi16(even, low, odd));
            _mm512_storeu_si512(to + 32, _mm512_permutex2var_epi16(even, high, odd));
        }
}

static inline __m512bh pair_of(const uint16_t *p)
{
    int32_t bits;
    memcpy(&bits, p, sizeof bits);
    return (__m512bh)_mm512_set1_epi32(bits);
}

/* One query vector's online softmax over a tile: its scores (TILE / SUB vectors, -inf where it
 * does not see the position) and their lane-by-lane maximum. The terms e^(score - reference)
 * go to `weights` in bfloat16 (zeros while the vector has seen nothing) and are added lane by
 * lane into *denominator. The reference (*running_max) moves up only when a score exceeds it by
 * more than RESCALE_MARGIN; the factor the value sums so far must then be scaled by is returned
 * (1 otherwise), *denominator already scaled. */
static inline __attribute__((always_inline)) float softmax_tile_row(const vfloat tile_scores[TILE / SUB],
                                                                     vfloat lane_max, float *running_max,
                                                                     vfloat *denominator, uint16_t weights[TILE])
{
    float correction = 1.f;
    if (any_lane_above(lane_max, *running_max + RESCALE_MARGIN)) {
        const float tile_max = max_of_lanes(lane_max);
        correction = softmax_rescale(*running_max, tile_max);
        *denominator *= correction;
        *running_max = tile_max;
    }
    if (*running_max == -INFINITY) { /* nothing this vector sees so far, this tile included */
        memset(weights, 0, sizeof(uint16_t) * TILE);
        return correction;
    }
    for (int s = 0; s < TILE / SUB; s++) {
        const vfloat p = exp_lanes(tile_scores[s] - *running_max);
        *denominator += p;
        const __m256bh rounded = _mm512_cvtneps_pbh((__m512)p);
        memcpy(weights + s * SUB, &rounded, sizeof rounded);
    }
    return correction;
}

/* One item: query vectors x0 .. x0 + n - 1 of KV head h (vector x: token x / group, query head
 * h * group + x % group). */
static inline __attribute__((always_inline)) void attend_item(const Chunk *c, int h, int64_t x0, int n,
                                                              const int chunks)
{
    const int head_dim = chunks * LANES, group = c->num_heads / c->num_kv_heads, pairs = head_dim / 2;
    const uint16_t *keys = c->keys + h * c->packed_positions * head_dim;
    const uint16_t *values = c->values + h * c->packed_positions * head_dim;
    const uint16_t *q[ITEM_ROWS];
    int64_t visible[ITEM_ROWS], first[ITEM_ROWS];
    float running_max[ITEM_ROWS];
    vfloat denominator[ITEM_ROWS];
    __m512 acc[ITEM_ROWS][MAX_DIM_CHUNKS];
    for (int r = 0; r < ITEM_ROWS; r++) {
        const int64_t x = x0 + (r < n ? r : n - 1); /* a partial item repeats its last vector */
        const int64_t token = x / group, head = (int64_t)h * group + x % group;
        q[r] = c->query + token * c->query_token_stride + head * c->query_head_stride;
        visible[r] = c->context - c->rows + token + 1;
        first[r] = c->sliding_window && visible[r] > c->sliding_window ? visible[r] - c->sliding_window : 0;
        running_max[r] = -INFINITY;
        denominator[r] = (vfloat){0};
        for (int d = 0; d < chunks; d++) acc[r][d] = _mm512_setzero_ps();
    }
    int64_t start = first[0], end = visible[0];
    for (int r = 1; r < ITEM_ROWS; r++) {
        start = first[r] < start ? first[r] : start;
        end = visible[r] > end ? visible[r] : end;
    }
    for (int64_t tile = start / TILE * TILE; tile < end; tile += TILE) {
        /* A pair of dims at a time for the whole tile: each query pair broadcast once for its
         * TILE / SUB key vectors, and ITEM_ROWS x TILE / SUB sums in flight, where a SUB at a
         * time kept ITEM_ROWS, each waiting on its last product. */
        __m512 scores[ITEM_ROWS][TILE / SUB];
        for (int r = 0; r < ITEM_ROWS; r++)
            for (int s = 0; s < TILE / SUB; s++) scores[r][s] = _mm512_setzero_ps();
        for (int j = 0; j < pairs; j++) {
            __m512bh query_pair[ITEM_ROWS];
            for (int r = 0; r < ITEM_ROWS; r++) query_pair[r] = pair_of(q[r] + 2 * j);
            for (int s = 0; s < TILE / SUB; s++) {
                const __m512bh k = (__m512bh)_mm512_loadu_si512(keys + (tile + s * SUB) * head_dim + j * SUB * 2);
                for (int r = 0; r < ITEM_ROWS; r++) scores[r][s] = _mm512_dpbf16_ps(scores[r][s], k, query_pair[r]);
            }
        }
        uint16_t weights[ITEM_ROWS][TILE] __attribute__((aligned(64)));
        for (int r = 0; r < ITEM_ROWS; r++) {
            vfloat tile_scores[TILE / SUB], lane_max = (vfloat){0} - INFINITY;
            for (int s = 0; s < TILE / SUB; s++) {
                const vint position = LANE_INDEX + (int)(tile + s * SUB);
                const vint seen = (position < (int)visible[r]) & (position >= (int)first[r]);
                tile_scores[s] = select_lanes(seen, (vfloat)scores[r][s] * c->scale, (vfloat){0} - INFINITY);
                lane_max = (vfloat)_mm512_max_ps((__m512)lane_max, (__m512)tile_scores[s]);
            }
            const float correction = softmax_tile_row(tile_scores, lane_max, &running_max[r], &denominator[r],
                                                      weights[r]);
            if (correction != 1.f)
                for (int d = 0; d < chunks; d++) acc[r][d] = _mm512_mul_ps(acc[r][d], _mm512_set1_ps(correction));
        }
        for (int pair = 0; pair < TILE / 2; pair++) {
            const uint16_t *value_pair = values + (tile + 2 * pair) * head_dim;
            for (int d = 0; d < chunks; d++) {
                const __m512bh v = (__m512bh)_mm512_loadu_si512(value_pair + d * LANES * 2);
                for (int r = 0; r < ITEM_ROWS; r++) acc[r][d] = _mm512_dpbf16_ps(acc[r][d], v, pair_of(weights[r] + 2 * pair));
            }
        }
    }
    for (int r = 0; r < n; r++) {
        const int64_t x = x0 + r, token = x / group, head = (int64_t)h * group + x % group;
        const float inverse = 1.f / sum_of_lanes(denominator[r]);
        float result[MAX_DIM_CHUNKS * LANES];
        for (int d = 0; d < chunks; d++) _mm512_storeu_ps(result + d * LANES, _mm512_mul_ps(acc[r][d], _mm512_set1_ps(inverse)));
        store_row(result, DTYPE_BFLOAT16, (char *)(c->out + (token * c->num_heads + head) * head_dim), head_dim);
    }
}

#if defined(AMX_TILES)
/* ---- AMX: items of TILE_ROWS query vectors, each product on tiles ------------------------------
 * The packed keys are already the second operand of q.k on tiles (per SUB positions, pairs of
 * dims by 16 positions), and the packed values that of p.v (per 32 positions, pairs of positions
 * by 16 dims). An item's query vectors are copied to one buffer (tile rows must be evenly
 * spaced), then per TILE positions: the scores in tiles 0-3, the online softmax in vectors over
 * them as the AVX512-BF16 item does it, the probabilities rounded to bfloat16, and p.v in tiles
 * added into float32 sums kept in memory (too many tiles for a head's outputs to stay in them). */
#define QUERY_TILE 4
#define KEY_TILE 5
#define PROBABILITY_TILE 6
#define VALUE_TILE 7

static void attend_item_amx(const Chunk *c, int h, int64_t x0, int n)
{
    const int head_dim = c->head_dim, group = c->num_heads / c->num_kv_heads, dim_chunks = head_dim / 32;
    const uint16_t *keys = c->keys + h * c->packed_positions * head_dim;
    const uint16_t *values = c->values + h * c->packed_positions * head_dim;
    uint16_t queries[TILE_ROWS * 128] __attribute__((aligned(64)));
    uint16_t weights[TILE_ROWS][TILE] __attribute__((aligned(64)));
    float scores[TILE / SUB][TILE_ROWS][SUB] __attribute__((aligned(64)));
    float sums[TILE_ROWS][128] __attribute__((aligned(64)));
    float products[TILE_ROWS][SUB] __attribute__((aligned(64)));
    int64_t visible[TILE_ROWS], first[TILE_ROWS];
    float running_max[TILE_ROWS];
    vfloat denominator[TILE_ROWS];
    int64_t start = INT64_MAX, end = 0, latest_first = 0, earliest_visible = INT64_MAX;
    for (int r = 0; r < TILE_ROWS; r++) {
        const int64_t x = x0 + (r < n ? r : n - 1); /* a partial item repeats its last vector */
        const int64_t token = x / group, head = (int64_t)h * group + x % group;
        memcpy(queries + r * head_dim, c->query + token * c->query_token_stride + head * c->query_head_stride,
               sizeof(uint16_t) * head_dim);
        visible[r] = c->context - c->rows + token + 1;
        first[r] = c->sliding_window && visible[r] > c->sliding_window ? visible[r] - c->sliding_window : 0;
        running_max[r] = -INFINITY;
        denominator[r] = (vfloat){0};
        memset(sums[r], 0, sizeof(float) * head_dim);
        start = first[r] < start ? first[r] : start;
        end = visible[r] > end ? visible[r] : end;
        latest_first = first[r] > latest_first ? first[r] : latest_first;
        earliest_visible = visible[r] < earliest_visible ? visible[r] : earliest_visible;
    }
    for (int64_t tile = start / TILE * TILE; tile < end; tile += TILE) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int d = 0; d < dim_chunks; d++) {
            _tile_loadd(QUERY_TILE, queries + 32 * d, head_dim * 2);
            const uint16_t *key_tiles = keys + tile * head_dim + d * 16 * SUB * 2;
            _tile_loadd(KEY_TILE, key_tiles, 64); _tile_dpbf16ps(0, QUERY_TILE, KEY_TILE);
            _tile_loadd(KEY_TILE, key_tiles + SUB * head_dim, 64); _tile_dpbf16ps(1, QUERY_TILE, KEY_TILE);
            _tile_loadd(KEY_TILE, key_tiles + 2 * SUB * head_dim, 64); _tile_dpbf16ps(2, QUERY_TILE, KEY_TILE);
            _tile_loadd(KEY_TILE, key_tiles + 3 * SUB * head_dim, 64); _tile_dpbf16ps(3, QUERY_TILE, KEY_TILE);
        }
        _tile_stored(0, scores[0], 64);
        _tile_stored(1, scores[1], 64);
        _tile_stored(2, scores[2], 64);
        _tile_stored(3, scores[3], 64);
        /* Most tiles lie wholly inside every row's view: those skip the masks. */
        const int masked = tile < latest_first || tile + TILE > earliest_visible;
        for (int r = 0; r < TILE_ROWS; r++) {
            vfloat tile_scores[TILE / SUB], lane_max = (vfloat){0} - INFINITY;
            for (int s = 0; s < TILE / SUB; s++) {
                vfloat row;
                memcpy(&row, scores[s][r], sizeof row);
                tile_scores[s] = row * c->scale;
                if (masked) {
                    const vint position = LANE_INDEX + (int)(tile + s * SUB);
                    const vint seen = (position < (int)visible[r]) & (position >= (int)first[r]);
                    tile_scores[s] = select_lanes(seen, tile_scores[s], (vfloat){0} - INFINITY);
                }
                lane_max = (vfloat)_mm512_max_ps((__m512)lane_max, (__m512)tile_scores[s]);
            }
            const float correction = softmax_tile_row(tile_scores, lane_max, &running_max[r], &denominator[r],
                                                      weights[r]);
            if (correction != 1.f)
                for (int d = 0; d < head_dim; d += LANES)
                    _mm512_storeu_ps(sums[r] + d, _mm512_mul_ps(_mm512_loadu_ps(sums[r] + d), _mm512_set1_ps(correction)));
        }
        /* p.v, 16 dims at a time: two tiles of 32 positions' probabilities against their values */
        for (int d = 0; d < head_dim; d += SUB) {
            _tile_zero(0);
            for (int half = 0; half < TILE / 32; half++) {
                _tile_loadd(PROBABILITY_TILE, &weights[0][32 * half], TILE * 2);
                _tile_loadd(VALUE_TILE, values + (tile + 32 * half) * head_dim + 2 * d, 4 * head_dim);
                _tile_dpbf16ps(0, PROBABILITY_TILE, VALUE_TILE);
            }
            _tile_stored(0, products, 64);
            for (int r = 0; r < TILE_ROWS; r++)
                _mm512_storeu_ps(sums[r] + d, _mm512_add_ps(_mm512_loadu_ps(sums[r] + d), _mm512_loadu_ps(products[r])));
        }
    }
    for (int r = 0; r < n; r++) {
        const int64_t x = x0 + r, token = x / group, head = (int64_t)h * group + x % group;
        const float inverse = 1.f / sum_of_lanes(denominator[r]);
        for (int d = 0; d < head_dim; d += LANES)
            _mm512_storeu_ps(sums[r] + d, _mm512_mul_ps(_mm512_loadu_ps(sums[r] + d), _mm512_set1_ps(inverse)));
        store_row(sums[r], DTYPE_BFLOAT16, (char *)(c->out + (token * c->num_heads + head) * head_dim), head_dim);
    }
}
#endif

int chunk_attention_bf16_body(void)
{
#if defined(AMX_TILES)
    if (amx_permitted()) return 2;
#endif
    return 1;
}

int chunk_attention_bf16(const uint16_t *query, int64_t query_token_stride, int64_t query_head_stride,
                         const uint16_t *kv_cache, int64_t num_blocks, int block_size, int num_kv_heads,
                         int head_dim, const int32_t *blocks, int64_t rows, int64_t context, int num_heads,
                         int sliding_window, float scale, uint16_t *out, int num_threads)
{
    if ((head_dim != 64 && head_dim != 128) || num_heads % num_kv_heads || rows < 1 || rows > context) return -1;
    const int64_t positions = (context + TILE - 1) / TILE * TILE;
    const size_t bytes = sizeof(uint16_t) * (size_t)(num_kv_heads * positions * head_dim);
    uint16_t *keys = aligned_alloc(64, bytes), *values = aligned_alloc(64, bytes);
    if (!keys || !values) {
        free(keys);
        free(values);
        return -1;
    }
    const uint16_t *value_cache = kv_cache + num_blocks * block_size * num_kv_heads * head_dim;
    const int64_t tiles = positions / SUB;
#pragma omp parallel for num_threads(num_threads)
    for (int64_t i = 0; i < num_kv_heads * tiles; i++) {
        const int h = (int)(i / tiles);
        const int64_t t = i % tiles, offset = (h * positions + t * SUB) * head_dim;
        pack_tile(kv_cache, value_cache, blocks, block_size, num_kv_heads, head_dim, context, t, h, keys + offset,
                  values + offset);
    }
    const Chunk chunk = {
        .query = query, .query_token_stride = query_token_stride, .query_head_stride = query_head_stride,
        .keys = keys, .values = values, .packed_positions = positions, .rows = rows, .context = context,
        .num_heads = num_heads, .num_kv_heads = num_kv_heads, .head_dim = head_dim,
        .sliding_window = sliding_window, .scale = scale, .out = out,
    };
    const int64_t vectors = rows * (num_heads / num_kv_heads);
#if defined(AMX_TILES)
    if (amx_permitted()) {
        const int64_t items = (vectors + TILE_ROWS - 1) / TILE_ROWS;
#pragma omp parallel num_threads(num_threads)
        {
            configure_tiles();
#pragma omp for schedule(dynamic)
            for (int64_t i = 0; i < items * num_kv_heads; i++) {
                const int64_t x0 = i / num_kv_heads * TILE_ROWS;
                attend_item_amx(&chunk, (int)(i % num_kv_heads), x0,
                                vectors - x0 < TILE_ROWS ? (int)(vectors - x0) : TILE_ROWS);
            }
            _tile_release();
        }
        free(keys);
        free(values);
        return 0;
    }
#endif
    const int64_t items = (vectors + ITEM_ROWS - 1) / ITEM_ROWS;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int64_t i = 0; i < items * num_kv_heads; i++) {
        const int h = (int)(i % num_kv_heads);
        const int64_t x0 = i / num_kv_heads * ITEM_ROWS;
        const int n = vectors - x0 < ITEM_ROWS ? (int)(vectors - x0) : ITEM_ROWS;
        if (head_dim == 64) attend_item(&chunk, h, x0, n, 4);
        else attend_item(&chunk, h, x0, n, 8);
    }
    free(keys);
    free(values);
    return 0;
}

#else

int chunk_attention_bf16_body(void) { return 0; }

int chunk_attention_bf16(const uint16_t *query, int64_t query_token_stride, int64_t query_head_stride,
                         const uint16_t *kv_cache, int64_t num_blocks, int block_size, int num_kv_heads,
                         int head_dim, const int32_t *blocks, int64_t rows, int64_t context, int num_heads,
                         int sliding_window, float scale, uint16_t *out, int num_threads)
{
    (void)query, (void)query_token_stride, (void)query_head_stride, (void)kv_cache, (void)num_blocks;
    (void)block_size, (void)num_kv_heads, (void)head_dim, (void)blocks, (void)rows, (void)context;
    (void)num_heads, (void)sliding_window, (void)scale, (void)out, (void)num_threads;
    return -1;
}

#endif

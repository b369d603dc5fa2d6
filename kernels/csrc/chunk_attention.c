/* Attention of a prefill chunk's new tokens over their paged context, in float32, for every CPU
 * (GCC vector extensions: AVX-512 registers where the CPU has them, pairs of AVX2 registers
 * elsewhere) and every cache dtype. chunk_attention_avx512bf16.c takes bfloat16 chunks where the
 * CPU has AVX512-BF16; this one takes the rest.
 *
 * Each KV head's keys and values are first packed from the paged cache as float32: keys per tile
 * of 16 positions as [head_dim][16 positions], so that one query value broadcast against one load
 * gives 16 positions' partial dot products; values as [positions][head_dim]. Then each item,
 * GROUPS row groups of `rows` query vectors (token x query head of one KV head; the queries
 * pre-scaled), walks the context TILE positions at a time. On each tile every group in turn
 * computes its rows x TILE scores, updates its online softmax and adds the values into its
 * rows x head_dim float32 sums, held in registers meanwhile: the tile's keys and values come from
 * memory once per item and from L1 for the other groups. `rows` depends on the vector width
 * (ROWS_*, below; docs/attention.md).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "kv_layout.h"
#include "vector_math.h"

enum { TILE = 64, SUBTILES = TILE / LANES, MAX_DIM = 256, GROUPS = 16 };
/* The query vectors of a row group, by head size. On AVX-512 a group's sums stay in registers
 * whole, 16 of them; AVX2's loops keep one 16-lane slice of every row's sums in registers at a
 * time, so its rows need not shrink as the head grows: 6 rows' slices are 12 of its 16
 * registers, beside the 2 loaded vectors and a broadcast, for 8 loads every 12 FMAs. */
#if defined(VECTORS_ARE_AVX2_PAIRS)
enum { ROWS_64 = 6, ROWS_128 = 6, ROWS_256 = 6, MAX_ROWS = 6 };
#else
enum { ROWS_64 = 4, ROWS_128 = 2, ROWS_256 = 1, MAX_ROWS = 4 };
#endif

typedef struct {
    const char *query;
    int64_t query_token_stride, query_head_stride; /* in elements */
    int dtype; /* the query's and the output's */
    const float *keys, *values; /* packed, per KV head */
    int64_t packed_positions; /* the context rounded up to TILE */
    int64_t rows, context;
    int num_heads, num_kv_heads, head_dim, sliding_window;
    float scale;
    char *out;
} Chunk;

/* Positions [first, end) of head h: keys as [tiles of LANES][head_dim][LANES], values as
 * [positions][head_dim]; zeros past the context. */
static void pack_head(const char *key_cache, const char *value_cache, int cache_dtype, const int32_t *blocks,
                      int block_size, int kv_heads, int head_dim, int64_t context, int64_t first, int64_t end, int h,
                      float *keys, float *values)
{
    float row[MAX_DIM];
    const size_t element = dtype_size(cache_dtype);
    for (int64_t p = first; p < end; p++) {
        float *value_row = values + p * head_dim, *key_tile = keys + (p / LANES) * LANES * head_dim;
        if (p >= context) {
            memset(value_row, 0, sizeof(float) * head_dim);
            for (int d = 0; d < head_dim; d++) key_tile[d * LANES + p % LANES] = 0.f;
            continue;
        }
        const int64_t slot = (int64_t)blocks[p / block_size] * block_size + p % block_size;
        load_row(value_cache + (slot * kv_heads + h) * head_dim * element, cache_dtype, value_row, head_dim);
        for (int d = 0; d < head_dim; d += 2) /* the keys in pairs of dims (kv_layout.h) */
            load_row(key_cache + key_index(slot, h, d, kv_heads, head_dim) * element, cache_dtype, row + d, 2);
        for (int d = 0; d < head_dim; d++) key_tile[d * LANES + p % LANES] = row[d];
    }
}

/* The running state of one query vector: its (pre-scaled) query, the positions it sees, and its
 * online softmax. */
typedef struct {
    float q[MAX_DIM];
    int64_t first, visible;
    float running_max;
    vfloat denominator;
} Query;

/* v's online softmax takes a tile whose maximum `tile_max` exceeds its reference by more than
 * RESCALE_MARGIN: the reference rises to it and the denominator shrinks to match. Returns the
 * factor the value sums so far must be scaled by. */
static inline float raise_reference(Query *v, float tile_max)
{
    const float correction = softmax_rescale(v->running_max, tile_max);
    v->denominator *= correction;
    v->running_max = tile_max;
    return correction;
}

#if defined(VECTORS_ARE_AVX2_PAIRS)
/* AVX2's registers are half a vector wide, and GCC built the portable loops' broadcasts of a
 * query or weight value through the stack one lane at a time, and spilled the rows' sums (about
 * 30x slower). Here each loop keeps one 16-position (or 16-dimension) slice of every row's sums
 * in registers, as pairs of AVX2 vectors, adding in the same order. */

/* GCC folds a loaded vector into each FMA that uses it, loading it again per row: with the
 * row's broadcast that is 1.5 loads an FMA, more than the core issues. An empty asm taking the
 * vectors in registers makes them loaded once. */
#define KEEP_IN_REGISTERS(a, b) __asm__("" : "+x"(a), "+x"(b))

/* scores[r][i]: query vector r's dot products with the tile's positions i * 8 .. i * 8 + 7. */
static inline __attribute__((always_inline)) void avx2_tile_scores(
    const Query *query, const float *key_tile, const int rows, const int head_dim, __m256 scores[MAX_ROWS][TILE / 8])
{
    for (int s = 0; s < SUBTILES; s++) {
        __m256 sum[MAX_ROWS][2];
        for (int r = 0; r < rows; r++) sum[r][0] = sum[r][1] = _mm256_setzero_ps();
        for (int d = 0; d < head_dim; d++) {
            const float *keys = key_tile + (s * head_dim + d) * LANES;
            __m256 low = _mm256_loadu_ps(keys), high = _mm256_loadu_ps(keys + 8);
            KEEP_IN_REGISTERS(low, high);
            for (int r = 0; r < rows; r++) {
                const __m256 q = _mm256_broadcast_ss(&query[r].q[d]);
                sum[r][0] = _mm256_fmadd_ps(q, low, sum[r][0]);
                sum[r][1] = _mm256_fmadd_ps(q, high, sum[r][1]);
            }
        }
        for (int r = 0; r < rows; r++) {
            scores[r][2 * s] = sum[r][0];
            scores[r][2 * s + 1] = sum[r][1];
        }
    }
}

/* softmax_row's work in AVX2's own registers (GCC moved 16-lane values through general
 * registers and the stack), scores as 8-lane halves. */
static inline __attribute__((always_inline)) float avx2_softmax_row(Query *v, __m256 scores[TILE / 8], int64_t tile,
                                                                    int masked, float weights[TILE])
{
    if (masked) {
        const __m256i first = _mm256_set1_epi32((int)v->first), visible = _mm256_set1_epi32((int)v->visible);
        for (int i = 0; i < TILE / 8; i++) {
            const __m256i position = _mm256_add_epi32(_mm256_set1_epi32((int)tile + 8 * i),
                                                      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            const __m256i hidden = _mm256_or_si256(_mm256_cmpgt_epi32(first, position),
                                                   _mm256_cmpgt_epi32(visible, position) ^ _mm256_set1_epi32(-1));
            scores[i] = _mm256_blendv_ps(scores[i], _mm256_set1_ps(-INFINITY), _mm256_castsi256_ps(hidden));
        }
    }
    __m256 lane_max = scores[0];
    for (int i = 1; i < TILE / 8; i++) lane_max = _mm256_max_ps(scores[i], lane_max);
    const __m256 above = _mm256_cmp_ps(lane_max, _mm256_set1_ps(v->running_max + RESCALE_MARGIN), _CMP_GT_OQ);
    const float correction = _mm256_movemask_ps(above) ? raise_reference(v, max_of_8(lane_max)) : 1.f;
    if (v->running_max == -INFINITY) {
        memset(weights, 0, sizeof(float) * TILE);
        return correction;
    }
    const __m256 reference = _mm256_set1_ps(v->running_max);
    __m256 sums[2];
    memcpy(sums, &v->denominator, sizeof sums);
    for (int i = 0; i < TILE / 8; i++) {
        const __m256 p = exp8(_mm256_sub_ps(scores[i], reference));
        sums[i % 2] = _mm256_add_ps(sums[i % 2], p);
        _mm256_store_ps(weights + 8 * i, p);
    }
    memcpy(&v->denominator, sums, sizeof sums);
    return correction;
}

/* acc[r * chunks + d] += the tile's value rows weighted by weights[r], 16 dimensions at a time. */
static inline __attribute__((always_inline)) void avx2_add_tile_values(
    const float weights[MAX_ROWS][TILE], const float *value_tile, const int rows, const int chunks, vfloat *acc)
{
    const int head_dim = chunks * LANES;
    for (int d = 0; d < chunks; d++) {
        __m256 sum[MAX_ROWS][2];
        for (int r = 0; r < rows; r++) {
            const float *row_acc = (const float *)&acc[r * chunks + d];
            sum[r][0] = _mm256_loadu_ps(row_acc);
            sum[r][1] = _mm256_loadu_ps(row_acc + 8);
        }
        for (int p = 0; p < TILE; p++) {
            const float *values = value_tile + p * head_dim + d * LANES;
            __m256 low = _mm256_loadu_ps(values), high = _mm256_loadu_ps(values + 8);
            KEEP_IN_REGISTERS(low, high);
            for (int r = 0; r < rows; r++) {
                const __m256 w = _mm256_broadcast_ss(&weights[r][p]);
                sum[r][0] = _mm256_fmadd_ps(w, low, sum[r][0]);
                sum[r][1] = _mm256_fmadd_ps(w, high, sum[r][1]);
            }
        }
        for (int r = 0; r < rows; r++) {
            _mm256_storeu_ps((float *)&acc[r * chunks + d], sum[r][0]);
            _mm256_storeu_ps((float *)&acc[r * chunks + d] + 8, sum[r][1]);
        }
    }
}
#endif

#if !defined(VECTORS_ARE_AVX2_PAIRS)
/* Query vector v's online softmax over a tile: its scores (-inf set here where it does not see
 * the position, if the tile is `masked`) go to `weights` as e^(score - reference) (zeros while
 * the vector has seen nothing), added lane by lane into its denominator. The reference
 * (running_max) moves up only when a score exceeds it by more than RESCALE_MARGIN, as in the
 * decode kernel: most tiles of a long context then skip finding their maximum. Returns the
 * factor the value sums so far must be scaled by (1 where the reference stayed), the
 * denominator already scaled. */
static inline __attribute__((always_inline)) float softmax_row(Query *v, vfloat scores[SUBTILES], int64_t tile,
                                                               int masked, float weights[TILE])
{
    if (masked)
        for (int s = 0; s < SUBTILES; s++) {
            const vint position = LANE_INDEX + (int)(tile + s * LANES);
            const vint seen = (position < (int)v->visible) & (position >= (int)v->first);
            scores[s] = select_lanes(seen, scores[s], (vfloat){0} - INFINITY);
        }
    vfloat lane_max = scores[0];
    for (int s = 1; s < SUBTILES; s++) lane_max = max_lanes(scores[s], lane_max);
    const float correction =
        any_lane_above(lane_max, v->running_max + RESCALE_MARGIN) ? raise_reference(v, max_of_lanes(lane_max)) : 1.f;
    if (v->running_max == -INFINITY) {
        memset(weights, 0, sizeof(float) * TILE);
        return correction;
    }
    for (int s = 0; s < SUBTILES; s++) {
        const vfloat p = exp_lanes(scores[s] - v->running_max);
        v->denominator += p;
        memcpy(weights + s * LANES, &p, sizeof p);
    }
    return correction;
}
#endif

/* Scores, online softmax and value sums of `rows` query vectors over one tile of TILE positions,
 * with `acc` the rows x chunks sums (chunks = head_dim / LANES). Inlined where rows and chunks are
 * constants and `acc` a local array indexed only by them, so that the sums stay in registers. */
static inline __attribute__((always_inline)) void attend_tile(Query *query, const float *key_tile,
                                                              const float *value_tile, int64_t tile, int masked,
                                                              const int rows, const int chunks, vfloat *acc)
{
    const int head_dim = chunks * LANES;
    float weights[MAX_ROWS][TILE] __attribute__((aligned(64)));
    float correction[MAX_ROWS];
#if defined(VECTORS_ARE_AVX2_PAIRS)
    __m256 scores[MAX_ROWS][TILE / 8];
    avx2_tile_scores(query, key_tile, rows, head_dim, scores);
    for (int r = 0; r < rows; r++) correction[r] = avx2_softmax_row(&query[r], scores[r], tile, masked, weights[r]);
#else
    vfloat scores[MAX_ROWS][SUBTILES];
    for (int r = 0; r < rows; r++)
        for (int s = 0; s < SUBTILES; s++) scores[r][s] = (vfloat){0};
    for (int d = 0; d < head_dim; d++)
        for (int s = 0; s < SUBTILES; s++) {
            vfloat k;
            memcpy(&k, key_tile + (s * head_dim + d) * LANES, sizeof k);
            for (int r = 0; r < rows; r++) scores[r][s] += query[r].q[d] * k;
        }
    for (int r = 0; r < rows; r++) correction[r] = softmax_row(&query[r], scores[r], tile, masked, weights[r]);
#endif
    for (int r = 0; r < rows; r++)
        if (correction[r] != 1.f)
            for (int d = 0; d < chunks; d++) acc[r * chunks + d] *= correction[r];
#if defined(VECTORS_ARE_AVX2_PAIRS)
    avx2_add_tile_values(weights, value_tile, rows, chunks, acc);
#else
    for (int p = 0; p < TILE; p++) {
        const float *value_row = value_tile + p * head_dim;
        for (int d = 0; d < chunks; d++) {
            vfloat v;
            memcpy(&v, value_row + d * LANES, sizeof v);
            for (int r = 0; r < rows; r++) acc[r * chunks + d] += weights[r][p] * v;
        }
    }
#endif
}

/* One item: up to GROUPS x rows query vectors x0 .. x0 + n - 1 of KV head h (vector x: token
 * x / group, query head h * group + x % group), walked over the context together so that each
 * tile of keys and values, read once from memory, serves them all from the cache. */
static inline __attribute__((always_inline)) void attend_item(const Chunk *c, int h, int64_t x0, int n,
                                                              const int rows, const int chunks)
{
    const int head_dim = chunks * LANES, group = c->num_heads / c->num_kv_heads;
    const int used = (n + rows - 1) / rows; /* row groups */
    const float *keys = c->keys + h * c->packed_positions * head_dim;
    const float *values = c->values + h * c->packed_positions * head_dim;
    Query query[GROUPS * MAX_ROWS];
    vfloat sums[GROUPS][MAX_ROWS * MAX_DIM / LANES];
    int64_t start = INT64_MAX, end = 0, unmasked_from = 0, unmasked_to = INT64_MAX;
    for (int r = 0; r < used * rows; r++) {
        const int64_t x = x0 + (r < n ? r : n - 1); /* a partial item repeats its last vector */
        const int64_t token = x / group, head = (int64_t)h * group + x % group;
        Query *v = &query[r];
        load_row(c->query + (token * c->query_token_stride + head * c->query_head_stride) * dtype_size(c->dtype),
                 c->dtype, v->q, head_dim);
        for (int d = 0; d < head_dim; d++) v->q[d] *= c->scale;
        v->visible = c->context - c->rows + token + 1;
        v->first = c->sliding_window && v->visible > c->sliding_window ? v->visible - c->sliding_window : 0;
        v->running_max = -INFINITY;
        v->denominator = (vfloat){0};
        start = v->first < start ? v->first : start;
        end = v->visible > end ? v->visible : end;
        unmasked_from = v->first > unmasked_from ? v->first : unmasked_from;
        unmasked_to = v->visible < unmasked_to ? v->visible : unmasked_to;
    }
    memset(sums, 0, sizeof sums);
    for (int64_t tile = start / TILE * TILE; tile < end; tile += TILE) {
        const int masked = tile < unmasked_from || tile + TILE > unmasked_to;
        for (int g = 0; g < used; g++) {
            vfloat acc[MAX_ROWS * MAX_DIM / LANES];
            memcpy(acc, sums[g], sizeof(vfloat) * rows * chunks);
            attend_tile(query + g * rows, keys + tile * head_dim, values + tile * head_dim, tile, masked, rows,
                        chunks, acc);
            memcpy(sums[g], acc, sizeof(vfloat) * rows * chunks);
        }
    }
    for (int r = 0; r < n; r++) {
        const int64_t x = x0 + r, token = x / group, head = (int64_t)h * group + x % group;
        const float inverse = 1.f / sum_of_lanes(query[r].denominator);
        float result[MAX_DIM];
        for (int d = 0; d < chunks; d++) {
            const vfloat scaled = sums[r / rows][(r % rows) * chunks + d] * inverse;
            memcpy(result + d * LANES, &scaled, sizeof scaled);
        }
        store_row(result, c->dtype, c->out + (token * c->num_heads + head) * head_dim * dtype_size(c->dtype), head_dim);
    }
}

#define ATTEND(ROWS, CHUNKS)                                                           \
    static void attend_##CHUNKS##_chunks(const Chunk *c, int h, int64_t x0, int n)     \
    {                                                                                  \
        attend_item(c, h, x0, n, ROWS, CHUNKS);                                        \
    }
ATTEND(ROWS_64, 4)
ATTEND(ROWS_128, 8)
ATTEND(ROWS_256, 16)

/* Any other head size (a multiple of LANES up to MAX_DIM), one vector per row group. */
static void attend_any(const Chunk *c, int h, int64_t x0, int n) { attend_item(c, h, x0, n, 1, c->head_dim / LANES); }

int chunk_attention(const char *query, int64_t query_token_stride, int64_t query_head_stride, int dtype,
                    const char *kv_cache, int cache_dtype, int64_t num_blocks, int block_size, int num_kv_heads,
                    int head_dim, const int32_t *blocks, int64_t rows, int64_t context, int num_heads,
                    int sliding_window, float scale, char *out, int num_threads)
{
    if (head_dim % LANES || head_dim > MAX_DIM || num_heads % num_kv_heads || rows < 1 || rows > context) return -1;
    const int64_t positions = (context + TILE - 1) / TILE * TILE;
    const size_t bytes = sizeof(float) * (size_t)(num_kv_heads * positions * head_dim);
    float *keys = aligned_alloc(64, bytes), *values = aligned_alloc(64, bytes);
    if (!keys || !values) {
        free(keys);
        free(values);
        return -1;
    }
    const char *value_cache = kv_cache + num_blocks * block_size * num_kv_heads * head_dim * dtype_size(cache_dtype);
    const int64_t tiles = positions / TILE;
#pragma omp parallel for num_threads(num_threads)
    for (int64_t i = 0; i < tiles * num_kv_heads; i++) {
        const int h = (int)(i % num_kv_heads);
        const int64_t tile = i / num_kv_heads * TILE;
        pack_head(kv_cache, value_cache, cache_dtype, blocks, block_size, num_kv_heads, head_dim, context, tile,
                  tile + TILE, h, keys + h * positions * head_dim, values + h * positions * head_dim);
    }
    const Chunk chunk = {
        .query = query, .query_token_stride = query_token_stride, .query_head_stride = query_head_stride,
        .dtype = dtype, .keys = keys, .values = values, .packed_positions = positions, .rows = rows,
        .context = context, .num_heads = num_heads, .num_kv_heads = num_kv_heads, .head_dim = head_dim,
        .sliding_window = sliding_window, .scale = scale, .out = out,
    };
    void (*attend)(const Chunk *, int, int64_t, int) = head_dim == 64    ? attend_4_chunks
                                                       : head_dim == 128 ? attend_8_chunks
                                                       : head_dim == 256 ? attend_16_chunks
                                                                         : attend_any;
    const int item = GROUPS * (head_dim == 64 ? ROWS_64 : head_dim == 128 ? ROWS_128 : head_dim == 256 ? ROWS_256 : 1);
    const int64_t vectors = rows * (num_heads / num_kv_heads), items = (vectors + item - 1) / item;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int64_t i = 0; i < items * num_kv_heads; i++) {
        const int h = (int)(i % num_kv_heads);
        const int64_t x0 = i / num_kv_heads * item;
        attend(&chunk, h, x0, vectors - x0 < item ? (int)(vectors - x0) : item);
    }
    free(keys);
    free(values);
    return 0;
}

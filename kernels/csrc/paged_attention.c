/* Paged attention for a ragged mixed batch on the CPU: the same contract as
 * kernels/reference.py's paged_attention (which it is tested against), computed in float32
 * with an online softmax.
 *
 * A tile of 16 positions at a time. The cache keeps a tile's keys as pairs of dims by position
 * (kv_layout.h), so each load of a KV head's keys is one pair of dims at all 16 positions: a
 * query row's pair of dims, broadcast, scores the whole tile at once (score_keys), with no
 * reduction across lanes. Each value row is converted once and added into every row of its KV
 * head. Work is split into three kinds of items:
 * - Where a batch has at least ROWS_PER_THREAD decode rows (sequences with one new token) per
 *   thread, each decode row walks its context with all its KV heads at once, so that it reads
 *   each block's keys and values whole, front to back: one KV head's rows alone are a quarter to
 *   a half of each position's bytes, and such a strided walk reads at half the bandwidth of a
 *   contiguous one (Xeon-AVX512, 2 threads: 13 against 24-27 GB/s).
 * - With fewer decode rows, each one is split into an item per thread, each a run of whole
 *   SEGMENTs of its context walked the same way and leaving a partial softmax per segment, which
 *   are joined in order once all are done: a single sequence then keeps every thread busy
 *   reading whole blocks (an item per KV head, the strided walk, left one of two threads idle a
 *   third of the time with three KV heads). A run rather than an item per segment: each item
 *   packs its queries again and starts its walk with nothing prefetched (one row over 1,000
 *   positions 17-32% slower so, timed in C alone on Xeon-AMX).
 * - Rows of several new tokens go QUERY_TILE tokens at a time, a KV head per item (several
 *   tokens' rows share each read). Where the next tile's block does not follow this one's in
 *   memory, its rows are prefetched meanwhile.
 * With bfloat16 queries and cache on a CPU with AMX, a tile's q.k products run on AMX tiles
 * instead (amx_score_keys, below). A decode walk (in every build but AVX2's) prefetches each next
 * tile (64 decode rows over 400 positions 13% faster on Xeon-AMX, workload A 6%) and weights its
 * value rows with the sums in registers (add_decode_values).
 * Where the 16-lane vectors are pairs of AVX2 registers, tiles are scored and weighted in AVX2's
 * own registers instead (avx2_score_keys and the functions beside it).
 * Every walk restarts its online softmax at each multiple of SEGMENT positions and joins the
 * segments in order, so a row's arithmetic is the same, in the same order, whichever item
 * computed it: a decode row gets the result a verification of draft tokens computes for the
 * same position (speculative decoding relies on it), whichever items a batch was split into.
 * With a sliding window the walk starts at the first tile any row of the item sees, so
 * positions (and whole blocks) behind every row's window are never read.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "amx_tiles.h"
#include "kernels.h"
#include "kv_layout.h"
#include "vector_math.h"

enum { QUERY_TILE = 8, MAX_GROUP = 16, MAX_CHUNKS = 16 };
enum { ROWS_PER_THREAD = 2, SEGMENT = 64 };

typedef struct {
    const char *query; /* [tokens, heads, head_dim], last dim contiguous */
    int64_t query_token_stride, query_head_stride; /* in elements */
    int query_dtype; /* also the output's */
    const char *keys, *values; /* each [blocks, block_size, kv_heads, head_dim], the keys tiled (kv_layout.h) */
    int cache_dtype;
    int block_size, num_heads, num_kv_heads;
    const int32_t *block_tables;
    int64_t block_table_stride;
    const int32_t *query_start_loc, *seq_lens;
    int sliding_window; /* 0: full causal attention */
    float scale;
    int amx; /* scores on AMX tiles (bfloat16 queries and cache, head_dim a multiple of 32, tiles granted) */
    char *out; /* [tokens, heads, head_dim], contiguous */
} Batch;

/* The first position a query that sees positions [0, visible) attends: its sliding window's
 * start, or 0 with full attention. */
static inline int window_start(const Batch *b, int visible)
{
    return b->sliding_window && visible > b->sliding_window ? visible - b->sliding_window : 0;
}

#if defined(VECTORS_ARE_AVX2_PAIRS)
/* ---- Tiles in AVX2's own registers -----------------------------------------------------------
 * Where the 16-lane vectors are pairs of AVX2 registers, GCC builds their broadcasts and
 * shuffles through the stack a lane at a time, and copied a tile's rows 16 bytes at a time: most
 * of a decode's attention on EPYC-AVX2, where a tile took five times its multiply-adds even from
 * L2. These builds widen value rows into float32 with whole AVX2 registers (avx2_widen_rows) and
 * weight them with the functions below, and score keys in AVX2 registers (avx2_score_rows). */

/* acc (chunks * 16 floats) += the `len` float32 rows from `rows` (`stride` floats apart) weighted
 * by weight[p], position by position. Four chunks' sums stay in registers at a time: eight chains
 * of multiply-adds in flight, where a chunk at a time left two, waiting on each other's latency
 * (the bulk of a decode tile so on EPYC-AVX2). Rows past `len` are skipped (add_values' portable
 * code adds zero weights times zero rows there). */
static inline __attribute__((always_inline)) void avx2_add_weighted_rows(
    const float *rows, int64_t stride, int len, const int chunks, const float weight[LANES], float *acc)
{
    enum { AT_ONCE = 4 };
    for (int from = 0; from < chunks; from += AT_ONCE) {
        const int registers = 2 * (chunks - from < AT_ONCE ? chunks - from : AT_ONCE);
        float *sums_at = acc + from * LANES;
        __m256 sum[2 * AT_ONCE];
        for (int i = 0; i < registers; i++) sum[i] = _mm256_loadu_ps(sums_at + 8 * i);
        for (int p = 0; p < len; p++) {
            const __m256 broadcast = _mm256_broadcast_ss(&weight[p]);
            const float *value = rows + p * stride + from * LANES;
            for (int i = 0; i < registers; i++)
                sum[i] = _mm256_fmadd_ps(broadcast, _mm256_loadu_ps(value + 8 * i), sum[i]);
        }
        for (int i = 0; i < registers; i++) _mm256_storeu_ps(sums_at + 8 * i, sum[i]);
    }
}

/* out = `count` rows of `row_floats` elements of `dtype` (a multiple of 16), each `stride` bytes
 * after the last from `first`, as float32 side by side: whole AVX2 registers at a time (float32
 * rows copied). */
static inline __attribute__((always_inline)) void avx2_widen_rows(
    const char *first, int64_t stride, int count, int64_t row_floats, int dtype, float *out)
{
    const size_t item = dtype_size(dtype);
    for (int r = 0; r < count; r++)
        for (int64_t i = 0; i < row_floats; i += LANES) {
            __m256 halves[2];
            avx2_widen_16(first + r * stride + i * item, dtype, halves);
            _mm256_storeu_ps(out + r * row_floats + i, halves[0]);
            _mm256_storeu_ps(out + r * row_floats + i + 8, halves[1]);
        }
}
#endif

/* tile[p] = the head's row at position p of a tile (`first` + p * `stride` bytes) as float32,
 * for the `len` positions in the context; zero past them. */
static inline __attribute__((always_inline)) void load_tile(
    const char *first, int64_t stride, int len, int dtype, const int chunks, vfloat tile[LANES][chunks])
{
#if defined(VECTORS_ARE_AVX2_PAIRS)
    avx2_widen_rows(first, stride, len, chunks * LANES, dtype, (float *)tile);
    memset(tile[len], 0, sizeof tile[0] * (LANES - len));
#else
    for (int p = 0; p < LANES; p++)
        for (int c = 0; c < chunks; c++)
            tile[p][c] = p < len ? load_lanes(first + p * stride + c * LANES * dtype_size(dtype), dtype) : (vfloat){0};
#endif
}

/* Where the tile from position `start` of KV head `kv_head` of `seq` begins in the cache, in
 * elements from the keys' (or the values') start. */
static inline int64_t tile_offset(const Batch *b, int seq, int kv_head, int start, int head_dim)
{
    const int32_t *blocks = b->block_tables + seq * b->block_table_stride;
    const int64_t position_stride = (int64_t)b->num_kv_heads * head_dim;
    return (int64_t)blocks[start / b->block_size] * b->block_size * position_stride
           + (start % b->block_size) * position_stride + (int64_t)kv_head * head_dim;
}

/* The `bytes` of keys and of values from `at` bytes into the cache, fetched into the caches. */
static inline __attribute__((always_inline)) void prefetch_rows(const Batch *b, int64_t at, int64_t bytes)
{
    for (int64_t line = 0; line < bytes; line += 64) {
        __builtin_prefetch(b->keys + at + line);
        __builtin_prefetch(b->values + at + line);
    }
}

/* ---- Scores ----------------------------------------------------------------------------------
 * One KV head's keys in a tile are [head_dim / 2][16 positions][2 dims] (kv_layout.h). A query
 * row's sums run lane by lane over the positions: for each pair of dims, the tile's 32 values of
 * that pair times the row's pair broadcast. Each row's sums are its own chain, in the same order
 * however many rows share the loads, so a decode row and a verification of draft tokens get the
 * same bits. A row that does not see the tile is scored anyway; softmax_tile skips it. */

#if defined(__AVX512BF16__)
/* scores[r] = the scaled q.k of the n raw bfloat16 queries `raw` with the tile's bfloat16 keys
 * `keys`: one vdpbf16ps per pair of dims and row, the products exact, summed in float32. */
static inline __attribute__((always_inline)) void bf16_score_rows(
    const Batch *b, const char *keys, const int n, const int pairs, const uint16_t *const raw[], vfloat scores[])
{
    __m512 sums[n];
    for (int r = 0; r < n; r++) sums[r] = _mm512_setzero_ps();
    for (int j = 0; j < pairs; j++) {
        const __m512bh pair_at_positions = (__m512bh)_mm512_loadu_si512(keys + j * 2 * KEY_TILE * sizeof(uint16_t));
        for (int r = 0; r < n; r++) {
            uint32_t query_pair;
            memcpy(&query_pair, raw[r] + 2 * j, sizeof query_pair);
            sums[r] = _mm512_dpbf16_ps(sums[r], pair_at_positions, (__m512bh)_mm512_set1_epi32((int)query_pair));
        }
    }
    for (int r = 0; r < n; r++) scores[r] = (vfloat)sums[r] * b->scale;
}
#endif

#if defined(VECTORS_ARE_AVX2_PAIRS)
/* scores[r] = q[r].k with the tile's keys `keys` of `dtype`, in AVX2 registers: each pair of
 * dims' 32 values widened into four registers of 4 positions x 2 dims, multiplied by the row's
 * pair broadcast; the two dims' sums added at the end. */
static inline __attribute__((always_inline)) void avx2_score_rows(
    const char *keys, int dtype, const int n, const int pairs, const float *const q[], vfloat scores[])
{
    const size_t item = dtype_size(dtype);
    __m256 sums[n][4];
    for (int r = 0; r < n; r++)
        for (int i = 0; i < 4; i++) sums[r][i] = _mm256_setzero_ps();
    for (int j = 0; j < pairs; j++) {
        __m256 pair_at_positions[4];
        avx2_widen_16(keys + j * 2 * KEY_TILE * item, dtype, pair_at_positions);
        avx2_widen_16(keys + (j * 2 * KEY_TILE + LANES) * item, dtype, pair_at_positions + 2);
        for (int r = 0; r < n; r++) {
            double query_pair;
            memcpy(&query_pair, q[r] + 2 * j, sizeof query_pair);
            const __m256 broadcast = _mm256_castpd_ps(_mm256_set1_pd(query_pair));
            for (int i = 0; i < 4; i++) sums[r][i] = _mm256_fmadd_ps(pair_at_positions[i], broadcast, sums[r][i]);
        }
    }
    for (int r = 0; r < n; r++) {
        /* hadd leaves positions 0, 1, 4, 5 | 2, 3, 6, 7 (per 128-bit half): put them in order */
        __m256 halves[2];
        for (int h = 0; h < 2; h++)
            halves[h] = _mm256_castpd_ps(
                _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(sums[r][2 * h], sums[r][2 * h + 1])), 0xd8));
        memcpy(&scores[r], halves, sizeof scores[r]);
    }
}
#else
/* scores[r] = q[r].k with the tile's keys `keys` of `dtype`: each pair of dims' 32 values as two
 * vectors of 8 positions x 2 dims, multiplied by the row's pair broadcast; the two dims' sums
 * added at the end. */
static inline __attribute__((always_inline)) void score_rows(
    const char *keys, int dtype, const int n, const int pairs, const float *const q[], vfloat scores[])
{
    const size_t item = dtype_size(dtype);
    vfloat low[n], high[n];
    for (int r = 0; r < n; r++) low[r] = high[r] = (vfloat){0};
    for (int j = 0; j < pairs; j++) {
        const vfloat first = load_lanes(keys + j * 2 * KEY_TILE * item, dtype);
        const vfloat second = load_lanes(keys + (j * 2 * KEY_TILE + LANES) * item, dtype);
        for (int r = 0; r < n; r++) {
            vfloat broadcast;
#if defined(__AVX512F__)
            double query_pair;
            memcpy(&query_pair, q[r] + 2 * j, sizeof query_pair);
            broadcast = (vfloat)_mm512_set1_pd(query_pair);
#else
            for (int i = 0; i < LANES; i++) broadcast[i] = q[r][2 * j + i % 2];
#endif
            low[r] += first * broadcast;
            high[r] += second * broadcast;
        }
    }
    const vint even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    for (int r = 0; r < n; r++)
        scores[r] = __builtin_shuffle(low[r], high[r], even) + __builtin_shuffle(low[r], high[r], even + 1);
}
#endif

/* scores[x] = the q.k of query rows x < n with one KV head's tile of keys at `keys`: q[x], the
 * scaled float32 query, or (bfloat16 queries and cache, a build with AVX512-BF16) raw[x], the
 * bfloat16 query as it is, scaled after. Four rows at a time share each load. */
static inline __attribute__((always_inline)) void score_keys(
    const Batch *b, const char *keys, const int n, const int chunks, const vfloat q[][chunks],
    const uint16_t *const raw[], vfloat scores[])
{
    const int pairs = chunks * LANES / 2;
#if !defined(__AVX512BF16__)
    (void)raw; /* the bfloat16 body's input */
#endif
    for (int x = 0; x < n; x += 4) {
        const int rows = n - x < 4 ? n - x : 4;
#if defined(__AVX512BF16__)
        if (b->cache_dtype == DTYPE_BFLOAT16 && b->query_dtype == DTYPE_BFLOAT16) {
            switch (rows) {
            case 1: bf16_score_rows(b, keys, 1, pairs, raw + x, scores + x); break;
            case 2: bf16_score_rows(b, keys, 2, pairs, raw + x, scores + x); break;
            case 3: bf16_score_rows(b, keys, 3, pairs, raw + x, scores + x); break;
            default: bf16_score_rows(b, keys, 4, pairs, raw + x, scores + x);
            }
            continue;
        }
#endif
        const float *rows_q[4];
        for (int r = 0; r < rows; r++) rows_q[r] = (const float *)q[x + r];
#if defined(VECTORS_ARE_AVX2_PAIRS)
#define SCORE_ROWS(N) avx2_score_rows(keys, b->cache_dtype, N, pairs, rows_q, scores + x)
#else
#define SCORE_ROWS(N) score_rows(keys, b->cache_dtype, N, pairs, rows_q, scores + x)
#endif
        switch (rows) {
        case 1: SCORE_ROWS(1); break;
        case 2: SCORE_ROWS(2); break;
        case 3: SCORE_ROWS(3); break;
        default: SCORE_ROWS(4);
        }
#undef SCORE_ROWS
    }
}

/* Where one KV head's keys of the tile whose first position `start` (a multiple of 16) begins
 * start in the cache, in bytes from the keys' start. */
static inline int64_t key_tile_offset(const Batch *b, int seq, int kv_head, int start, int head_dim)
{
    return tile_offset(b, seq, 0, start, head_dim) * dtype_size(b->cache_dtype)
           + (int64_t)kv_head * KEY_TILE * head_dim * dtype_size(b->cache_dtype);
}

/* Rows x < rows (each seeing positions [first[x], visible[x])) take the scores of the tile of 16
 * positions from `start` into their online softmax: per row a reference maximum (running_max:
 * never more than RESCALE_MARGIN below any score seen), lane by lane the sums of
 * e^(score - that) (lane_sums) and the value rows weighted by those terms (acc, not yet divided;
 * rescaled here, added to in add_values). weights[x]: the tile's terms for row x. */
static inline __attribute__((always_inline)) void softmax_tile(
    int start, const int rows, const int chunks, const int visible[rows], const int first[rows],
    const vfloat tile_scores[rows], float running_max[rows], vfloat lane_sums[rows], vfloat acc[rows][chunks],
    vfloat weights[rows])
{
    for (int x = 0; x < rows; x++) {
        if (start >= visible[x] || start + LANES <= first[x]) continue;
        vfloat scores = tile_scores[x];
        if (start + LANES > visible[x] || start < first[x]) {
            const vint in_view = (LANE_INDEX < (visible[x] - start)) & (LANE_INDEX >= (first[x] - start));
            scores = select_lanes(in_view, scores, (vfloat){0} - INFINITY);
        }
        if (any_lane_above(scores, running_max[x] + RESCALE_MARGIN)) {
            /* The maximum rises to the tile's (above the old one by more than the margin). */
            const float tile_max = max_of_lanes(scores), correction = softmax_rescale(running_max[x], tile_max);
            lane_sums[x] *= correction;
            for (int c = 0; c < chunks; c++) acc[x][c] *= correction;
            running_max[x] = tile_max;
        }
        weights[x] = exp_lanes(scores - running_max[x]);
        lane_sums[x] += weights[x];
    }
}

/* acc[x] += the tile's value rows weighted by weights[x], for the rows score_tile scored. */
static inline __attribute__((always_inline)) void add_values(
    int start, const int rows, const int chunks, const int visible[rows], const int first[rows],
    const vfloat values[LANES][chunks], const vfloat weights[rows], vfloat acc[rows][chunks])
{
    for (int x = 0; x < rows; x++) {
        if (start >= visible[x] || start + LANES <= first[x]) continue;
        float weight[LANES];
        memcpy(weight, &weights[x], sizeof weight);
#if defined(VECTORS_ARE_AVX2_PAIRS)
        avx2_add_weighted_rows((const float *)values, chunks * LANES, LANES, chunks, weight, (float *)acc[x]);
#else
        for (int c = 0; c < chunks; c++) {
            vfloat sum = acc[x][c];
            for (int p = 0; p < LANES; p++) sum += weight[p] * values[p][c];
            acc[x][c] = sum;
        }
#endif
    }
}

/* A softmax over some positions, (max, denominator, acc) as score_tile keeps them, takes in a
 * segment's: both rescaled to the larger maximum. An empty side (maximum -inf) adds nothing and
 * takes nothing away, exactly, so a segment joined to an empty softmax is that segment. Never
 * inlined: every walk joins with the very same instructions. */
static __attribute__((noinline)) void join_segment(
    int chunks, float *max, float *denominator, vfloat acc[chunks], float segment_max, float segment_denominator,
    const vfloat segment_acc[chunks])
{
    const float joined = segment_max > *max ? segment_max : *max;
    const float keep = softmax_rescale(*max, joined), take = softmax_rescale(segment_max, joined);
    *denominator = *denominator * keep + segment_denominator * take;
    for (int c = 0; c < chunks; c++) acc[c] = acc[c] * keep + segment_acc[c] * take;
    *max = joined;
}

/* Rows x < rows: a softmax over no positions yet. */
static inline __attribute__((always_inline)) void empty_softmax(
    const int rows, const int chunks, float max[rows], float denominator[rows], vfloat acc[rows][chunks])
{
    for (int x = 0; x < rows; x++) {
        max[x] = -INFINITY;
        denominator[x] = 0.f;
        for (int c = 0; c < chunks; c++) acc[x][c] = (vfloat){0};
    }
}

/* Rows x < rows: a segment's softmax (as score_tile keeps it) over no positions yet. */
static inline __attribute__((always_inline)) void empty_segment(
    const int rows, const int chunks, float running_max[rows], vfloat lane_sums[rows], vfloat acc[rows][chunks])
{
    for (int x = 0; x < rows; x++) {
        running_max[x] = -INFINITY;
        lane_sums[x] = (vfloat){0};
        for (int c = 0; c < chunks; c++) acc[x][c] = (vfloat){0};
    }
}

/* Rows x < rows join the segment just walked (running_max, lane_sums, acc) into their totals
 * (total_max, total_denominator, total_acc), and start the next one empty. */
static inline __attribute__((always_inline)) void close_segment(
    const int rows, const int chunks, float running_max[rows], vfloat lane_sums[rows], vfloat acc[rows][chunks],
    float total_max[rows], float total_denominator[rows], vfloat total_acc[rows][chunks])
{
    for (int x = 0; x < rows; x++)
        join_segment(chunks, &total_max[x], &total_denominator[x], total_acc[x], running_max[x],
                     sum_of_lanes(lane_sums[x]), acc[x]);
    empty_segment(rows, chunks, running_max, lane_sums, acc);
}

/* q[c] = the 16 values of `head`'s query for `token` from c * 16, scaled. */
static inline __attribute__((always_inline)) void load_query(
    const Batch *b, int64_t token, int head, const int chunks, vfloat q[chunks])
{
    const size_t item = dtype_size(b->query_dtype);
    const char *src = b->query + (token * b->query_token_stride + head * b->query_head_stride) * item;
    for (int c = 0; c < chunks; c++) q[c] = load_lanes(src + c * LANES * item, b->query_dtype) * b->scale;
}

/* `head`'s query for `token` as it is (read only where the queries are bfloat16). */
static inline const uint16_t *raw_query(const Batch *b, int64_t token, int head)
{
    return (const uint16_t *)b->query + token * b->query_token_stride + head * b->query_head_stride;
}

/* out's row for `head` of `token`: acc / denominator. */
static inline __attribute__((always_inline)) void store_head(
    const Batch *b, int64_t token, int head, const int chunks, const vfloat acc[chunks], float denominator)
{
    float result[chunks * LANES];
    for (int c = 0; c < chunks; c++) {
        const vfloat divided = acc[c] * (1.f / denominator);
        memcpy(result + c * LANES, &divided, sizeof divided);
    }
    const int64_t element = (token * b->num_heads + head) * (int64_t)chunks * LANES;
    store_row(result, b->query_dtype, b->out + element * dtype_size(b->query_dtype), chunks * LANES);
}

#if defined(AMX_TILES)
/* ---- Scores on AMX tiles ---------------------------------------------------------------------
 * With bfloat16 queries and cache (and the tiles granted), a tile's q.k products run on AMX. A
 * KV head's keys of a tile, 32 dims at a time, are as the cache keeps them the second operand of
 * tdpbf16ps (16 rows of a pair of dims by 16 positions, 64 bytes apart); the first is up to 16
 * query rows of 32 dims, copied once per item into a buffer (a tile's rows must be evenly
 * spaced, and all 16 are read). The 16 x 16 sums come out a row per query: its 16 scores, scaled
 * after the products (the queries go in as they are). A row's sums do not depend on the other
 * rows of its tile, so a decode row's scores equal those of a verification of draft tokens. */
#define AMX_QUERIES 0 /* tile numbers: the intrinsics paste them into register names */
#define AMX_KEYS 1
#define AMX_SCORES 2
enum { AMX_DIMS = 32 };

/* Row `slot` of a query buffer (TILE_ROWS rows of head_dim bfloat16 values, zeros where unused):
 * the query of `head` for `token`. */
static void pack_query(const Batch *b, uint16_t *queries, int slot, int64_t token, int head, int head_dim)
{
    memcpy(queries + slot * head_dim,
           (const uint16_t *)b->query + token * b->query_token_stride + head * b->query_head_stride,
           sizeof(uint16_t) * head_dim);
}

/* scores[x] = the scaled q.k of the buffer's rows x < n (`queries`, as pack_query fills it) with
 * one KV head's keys of a tile (`keys`). */
static inline void amx_score_keys(const Batch *b, const char *keys, const uint16_t *queries, int n, int head_dim,
                                  vfloat scores[])
{
    _tile_zero(AMX_SCORES);
    for (int k = 0; k < head_dim / AMX_DIMS; k++) {
        _tile_loadd(AMX_QUERIES, queries + k * AMX_DIMS, sizeof(uint16_t) * head_dim);
        _tile_loadd(AMX_KEYS, keys + k * AMX_DIMS * KEY_TILE * sizeof(uint16_t), 2 * KEY_TILE * sizeof(uint16_t));
        _tile_dpbf16ps(AMX_SCORES, AMX_QUERIES, AMX_KEYS);
    }
    float sums[TILE_ROWS][16] __attribute__((aligned(64)));
    _tile_stored(AMX_SCORES, sums, sizeof sums[0]);
    for (int x = 0; x < n; x++) scores[x] = (vfloat)_mm512_load_ps(sums[x]) * b->scale;
}
#endif

/* One item of new tokens: `num_tokens` of `seq` from query row `row` on, KV head `kv_head`.
 * Inlined with a constant chunk count for the common head sizes so the loops unroll. */
static inline __attribute__((always_inline)) void attend_tile(
    const Batch *b, int seq, int64_t row, int num_tokens, int kv_head, const int chunks)
{
    const int group = b->num_heads / b->num_kv_heads, rows = num_tokens * group;
    /* Row x is token x / group and query head kv_head * group + x % group; it sees positions
     * [first[x], visible[x]) (causal: the new tokens are the last ones of the context; a
     * sliding window of w positions ends at the token's own). */
    const int last_visible = b->seq_lens[seq] - (b->query_start_loc[seq + 1] - (int)(row + num_tokens));
    vfloat q[rows][chunks], acc[rows][chunks], total_acc[rows][chunks];
    float running_max[rows], total_max[rows], total_denominator[rows];
    vfloat lane_sums[rows];
    int visible[rows], first[rows];
    const uint16_t *raw[rows];
    for (int x = 0; x < rows; x++) {
        load_query(b, row + x / group, kv_head * group + x % group, chunks, q[x]);
        raw[x] = raw_query(b, row + x / group, kv_head * group + x % group);
        visible[x] = last_visible - (num_tokens - 1 - x / group);
        first[x] = window_start(b, visible[x]);
    }
    empty_segment(rows, chunks, running_max, lane_sums, acc);
    empty_softmax(rows, chunks, total_max, total_denominator, total_acc);
    const int head_dim = chunks * LANES;
    const size_t cache_item = dtype_size(b->cache_dtype);
    const int64_t position_bytes = (int64_t)b->num_kv_heads * head_dim * cache_item;
    const int32_t *blocks = b->block_tables + seq * b->block_table_stride;
    vfloat values[LANES][chunks], weights[rows], scores[rows];
#if defined(AMX_TILES)
    const int query_tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    uint16_t queries[b->amx ? query_tiles * TILE_ROWS * head_dim : 1];
    if (b->amx) {
        memset(queries, 0, sizeof queries);
        for (int x = 0; x < rows; x++)
            pack_query(b, queries, x, row + x / group, kv_head * group + x % group, head_dim);
    }
#endif
    /* Row 0 (the item's first token) has the earliest window; tiles stay LANES-aligned. */
    const int walk_start = first[0] / LANES * LANES;
    for (int start = walk_start; start < last_visible; start += LANES) {
        if (start % SEGMENT == 0 && start != walk_start)
            close_segment(rows, chunks, running_max, lane_sums, acc, total_max, total_denominator, total_acc);
        const int len = last_visible - start < LANES ? last_visible - start : LANES;
        const int64_t offset = tile_offset(b, seq, kv_head, start, head_dim) * cache_item;
        const char *keys = b->keys + key_tile_offset(b, seq, kv_head, start, head_dim);
        /* Where the next tile's block does not follow this one's in memory, its rows are fetched
         * ahead: the hardware prefetchers follow a contiguous walk on their own, and prefetching
         * that too costs more than it saves (11-15% of a decode's attention, on the AMD machine). */
        const int next = start + LANES, next_block = next / b->block_size, this_block = start / b->block_size;
        if (next < last_visible && next_block != this_block && blocks[next_block] != blocks[this_block] + 1) {
            const int64_t next_offset = tile_offset(b, seq, kv_head, next, head_dim) * cache_item;
            const char *next_keys = b->keys + key_tile_offset(b, seq, kv_head, next, head_dim);
            for (int64_t line = 0; line < KEY_TILE * head_dim * (int64_t)cache_item; line += 64)
                __builtin_prefetch(next_keys + line);
            for (int p = 0; p < LANES; p++)
                for (int64_t line = 0; line < head_dim * (int64_t)cache_item; line += 64)
                    __builtin_prefetch(b->values + next_offset + p * position_bytes + line);
        }
#if defined(AMX_TILES)
        if (b->amx) {
            for (int x = 0; x < rows; x += TILE_ROWS)
                amx_score_keys(b, keys, queries + x * head_dim, rows - x < TILE_ROWS ? rows - x : TILE_ROWS,
                               head_dim, scores + x);
        } else
#endif
            score_keys(b, keys, rows, chunks, q, raw, scores);
        softmax_tile(start, rows, chunks, visible, first, scores, running_max, lane_sums, acc, weights);
        load_tile(b->values + offset, position_bytes, len, b->cache_dtype, chunks, values);
        add_values(start, rows, chunks, visible, first, values, weights, acc);
    }
    close_segment(rows, chunks, running_max, lane_sums, acc, total_max, total_denominator, total_acc);
    for (int x = 0; x < rows; x++)
        store_head(b, row + x / group, kv_head * group + x % group, chunks, total_acc[x], total_denominator[x]);
}

#if !defined(VECTORS_ARE_AVX2_PAIRS)
/* acc[x] += the value rows of the `len` positions from `rows` (`position_bytes` apart) weighted
 * by weight[x], for `n` query rows of one KV head: position by position, each value row widened
 * once for all n rows, the n * chunks sums in registers. Each lane takes the same multiply-adds
 * in the same order as add_values, so the bits are the same (positions past `len`, which
 * add_values adds as zero weights times zero rows, are skipped). At each position p, the p-th
 * row-sized run of bytes from `fetch_keys` and from `fetch_values` (NULL: none) is prefetched
 * into L2. */
static inline __attribute__((always_inline)) void add_value_rows(
    const char *rows, int64_t position_bytes, int len, int dtype, const int n, const int chunks,
    const float weight[][LANES], vfloat acc[][chunks], const char *fetch_keys, const char *fetch_values)
{
    const int64_t chunk_bytes = LANES * dtype_size(dtype);
    /* Fixed sizes rather than n x chunks: GCC keeps a variable-length array on the stack even
     * where inlining makes its size a constant. */
    vfloat sum[16], row[MAX_CHUNKS];
    for (int x = 0; x < n; x++)
        for (int c = 0; c < chunks; c++) sum[x * chunks + c] = acc[x][c];
    for (int p = 0; p < len; p++) {
        for (int64_t line = 0; fetch_keys && line < chunks * chunk_bytes; line += 64) {
            __builtin_prefetch(fetch_keys + p * chunks * chunk_bytes + line, 0, 1);
            __builtin_prefetch(fetch_values + p * chunks * chunk_bytes + line, 0, 1);
        }
        for (int c = 0; c < chunks; c++) row[c] = load_lanes(rows + p * position_bytes + c * chunk_bytes, dtype);
        for (int x = 0; x < n; x++)
            for (int c = 0; c < chunks; c++) sum[x * chunks + c] += weight[x][p] * row[c];
    }
    for (int x = 0; x < n; x++)
        for (int c = 0; c < chunks; c++) acc[x][c] = sum[x * chunks + c];
}

/* A decode row's acc[h] += the tile's value rows (from `rows`, `len` positions) weighted by
 * weights[h], for every head h, up to four query rows of a KV head at a time with their sums in
 * registers, where add_values loads and stores each sum at every position (64 decode rows over
 * 352 positions with the cache in L2, Xeon-AMX: 580-620 -> 410-470 us a layer). With `ahead`
 * >= 0 the next tile (`ahead` bytes into the cache) is prefetched into L2, spread over the
 * positions: fetched all at once into L1 (as the walk's key loads once did), the prefetches queue behind
 * each other, few L1 misses being in flight at a time (the same rows from memory: 1,235-1,341 ->
 * 1,166-1,280 us a layer). Each KV head's pass over the values prefetches the next 1/kv_heads
 * of the tile's bytes, so the tile is fetched front to back: fetched a KV head's rows at a time
 * (strided, three passes over the tile) the hardware's own streaming never joined in (64 rows
 * over 336 positions in blocks of 64: 1,031-1,088 -> 961-1,006 us a layer, Xeon-AMX). Every
 * build but AVX2's weighs a decode row's values so, with or without AMX: on EPYC-Zen4
 * (AVX512-BF16, no AMX) 64 rows over 336 positions take 854-870 us a layer against 1,106-1,116
 * with the values widened into a tile and added by add_values (alternated). Without the
 * prefetches it was slower from memory there (1,234-1,262 us), as on Xeon-AMX with AVX512-BF16
 * alone, where the values read a KV head at a time came 7-10% slower than position by position. */
static inline __attribute__((always_inline)) void add_decode_values(
    const Batch *b, const char *rows, int len, int64_t ahead, const int chunks, const vfloat weights[],
    vfloat acc[][chunks])
{
    const int kv_heads = b->num_kv_heads, group = b->num_heads / kv_heads, dtype = b->cache_dtype;
    const int64_t row_bytes = chunks * LANES * dtype_size(dtype), position_bytes = kv_heads * row_bytes;
    float weight[b->num_heads][LANES];
    memcpy(weight, weights, sizeof weight);
    /* At most 16 sums in registers: head_dim 64 four query rows at once, 128 two. */
    const int at_once = chunks <= 4 ? 4 : chunks <= 8 ? 2 : 1;
    for (int kv_head = 0; kv_head < kv_heads; kv_head++) {
        const char *head_rows = rows + kv_head * row_bytes;
        const char *fetch_keys = ahead >= 0 ? b->keys + ahead + kv_head * LANES * row_bytes : NULL;
        const char *fetch_values = ahead >= 0 ? b->values + ahead + kv_head * LANES * row_bytes : NULL;
        for (int x = kv_head * group; x < (kv_head + 1) * group; x += at_once) {
            const int first_rows = x == kv_head * group;
            const int rest = (kv_head + 1) * group - x;
#define ADD_VALUE_ROWS(N)                                                                      \
    add_value_rows(head_rows, position_bytes, len, dtype, N, chunks, weight + x, acc + x, \
                   first_rows ? fetch_keys : NULL, fetch_values)
            switch (rest < at_once ? rest : at_once) {
            case 1: ADD_VALUE_ROWS(1); break;
            case 2: ADD_VALUE_ROWS(2); break;
            case 3: ADD_VALUE_ROWS(3); break;
            default: ADD_VALUE_ROWS(4);
            }
#undef ADD_VALUE_ROWS
        }
    }
}
#endif

#if defined(VECTORS_ARE_AVX2_PAIRS)
/* widened = the 16 positions from `rows`, every KV head's row of each, as float32. */
static inline __attribute__((always_inline)) void avx2_widen_positions(
    const Batch *b, const char *rows, const int chunks, float *widened)
{
    const int64_t position_floats = (int64_t)b->num_kv_heads * chunks * LANES;
    const int dtype = b->cache_dtype;
    avx2_widen_rows(rows, position_floats * dtype_size(dtype), LANES, position_floats, dtype, widened);
}

/* acc[h] += the value rows of the tile from `rows` (`len` positions) weighted by weights[h],
 * for every head h: float32 rows where they lie (copied as the keys are, they read no faster
 * from memory and slower from L3), narrower ones widened into `widened` first. */
static inline __attribute__((always_inline)) void avx2_decode_values(
    const Batch *b, const char *rows, int len, const int chunks, const vfloat weights[], vfloat acc[][chunks],
    float *widened)
{
    const int group = b->num_heads / b->num_kv_heads, head_dim = chunks * LANES;
    const float *tile = (const float *)rows;
    if (b->cache_dtype != DTYPE_FLOAT32) {
        avx2_widen_positions(b, rows, chunks, widened);
        tile = widened;
    }
    for (int h = 0; h < b->num_heads; h++) {
        float weight[LANES];
        memcpy(weight, &weights[h], sizeof weight);
        const float *head_values = tile + h / group * head_dim;
        const int64_t stride = (int64_t)b->num_kv_heads * head_dim;
        /* A whole tile with a constant count, so that its positions' loop unrolls. */
        if (len == LANES)
            avx2_add_weighted_rows(head_values, stride, LANES, chunks, weight, (float *)acc[h]);
        else
            avx2_add_weighted_rows(head_values, stride, len, chunks, weight, (float *)acc[h]);
    }
}
#endif

/* Floats of a decode item's partial softmax: every head's maximum, then every head's
 * denominator, then every head's undivided acc (head_dim floats each). */
static int64_t partial_floats(int heads, int head_dim) { return (int64_t)heads * (head_dim + 2); }

/* Heads' partial softmax (max, denominator, undivided acc) into `partial`, as partial_floats lays
 * it out. */
static inline __attribute__((always_inline)) void store_partial(
    const int heads, const int chunks, const float max[heads], const float denominator[heads],
    const vfloat acc[heads][chunks], float *partial)
{
    memcpy(partial, max, sizeof(float) * heads);
    memcpy(partial + heads, denominator, sizeof(float) * heads);
    memcpy(partial + 2 * heads, acc, sizeof(vfloat) * heads * chunks);
}

/* A decode item: the new token of `seq` (query row `row`) over its context's tiles from `from`
 * (LANES-aligned) up to position `to`, all its heads, the tiles' KV heads one after another,
 * joining segments as it goes. The result goes to the output; or, for an item of a split row,
 * each segment's undivided into `partial` on (partial_floats of them a segment). */
static inline __attribute__((always_inline)) void attend_decode_row(
    const Batch *b, int seq, int64_t row, int from, int to, float *partial, const int chunks)
{
    const int heads = b->num_heads, group = heads / b->num_kv_heads, last_visible = b->seq_lens[seq];
    const int first_visible = window_start(b, last_visible);
    vfloat q[heads][chunks], acc[heads][chunks], total_acc[heads][chunks];
    float running_max[heads], total_max[heads], total_denominator[heads];
    vfloat lane_sums[heads];
    int visible[MAX_GROUP], first[MAX_GROUP];
    for (int x = 0; x < group; x++) {
        visible[x] = last_visible;
        first[x] = first_visible;
    }
    const uint16_t *raw[heads];
    for (int h = 0; h < heads; h++) {
        load_query(b, row, h, chunks, q[h]);
        raw[h] = raw_query(b, row, h);
    }
    empty_segment(heads, chunks, running_max, lane_sums, acc);
    empty_softmax(heads, chunks, total_max, total_denominator, total_acc);
    const int kv_heads = b->num_kv_heads, head_dim = chunks * LANES;
    const size_t cache_item = dtype_size(b->cache_dtype);
    const int32_t *blocks = b->block_tables + seq * b->block_table_stride;
    const int64_t position_bytes = (int64_t)kv_heads * head_dim * cache_item;
    const int64_t key_head_bytes = (int64_t)KEY_TILE * head_dim * cache_item; /* a KV head's keys of a tile */
    vfloat weights[heads], scores[heads];
#if defined(VECTORS_ARE_AVX2_PAIRS)
    float widened[LANES * kv_heads * head_dim];
#endif
#if defined(AMX_TILES)
    /* Each KV head's group of query rows in its own buffer, the first operand of its scores. */
    uint16_t queries[b->amx ? kv_heads * TILE_ROWS * head_dim : 1];
    if (b->amx) {
        memset(queries, 0, sizeof queries);
        for (int h = 0; h < heads; h++) pack_query(b, queries + h / group * TILE_ROWS * head_dim, h % group, row, h, head_dim);
    }
#endif
    for (int tile = from; tile < to; tile += LANES) {
        if (tile % SEGMENT == 0 && tile != from) {
            close_segment(heads, chunks, running_max, lane_sums, acc, total_max, total_denominator, total_acc);
            if (partial) { /* each segment its own partial, joined in order by join_partials */
                store_partial(heads, chunks, total_max, total_denominator, total_acc, partial);
                partial += partial_floats(heads, head_dim);
                empty_softmax(heads, chunks, total_max, total_denominator, total_acc);
            }
        }
        const int len = to - tile < LANES ? to - tile : LANES;
        const int64_t offset = tile_offset(b, seq, 0, tile, head_dim) * cache_item;
        /* Where the next tile's block does not follow this one's, its rows are fetched as this
         * tile's keys are loaded. Outside AVX2 builds every next tile's rows are fetched into L2
         * as this tile's values are loaded (add_decode_values): the walk reads 12-20% faster for
         * it on Xeon-AMX and 22-30% on EPYC-Zen4. AVX2 builds keep to the jumps: their own walk
         * has not been measured with it on an AVX2-only CPU. */
        const int next = tile + LANES, next_block = next / b->block_size, this_block = tile / b->block_size;
        const int jump = next < to && next_block != this_block && blocks[next_block] != blocks[this_block] + 1;
        const int64_t ahead = next < to ? tile_offset(b, seq, 0, next, head_dim) * (int64_t)cache_item : -1;
#if defined(AMX_TILES)
        if (b->amx) {
            /* This tile's values (in L2 by now) into L1 while its scores multiply on tiles: the
             * value rows' loads waited on L2 otherwise (64 x 336 positions: 923-945 -> 875-910 us
             * a layer, 64 x 1,000: 2,453-2,466 -> 2,351-2,378; Xeon-AMX). */
            for (int64_t line = 0; line < len * position_bytes; line += 64)
                _mm_prefetch(b->values + offset + line, _MM_HINT_T0);
            for (int kv_head = 0; kv_head < kv_heads; kv_head++)
                amx_score_keys(b, b->keys + offset + kv_head * key_head_bytes,
                               queries + kv_head * TILE_ROWS * head_dim, group, head_dim, scores + kv_head * group);
        } else
#endif
        {
            for (int p = 0; jump && p < LANES; p++) prefetch_rows(b, ahead + p * position_bytes, position_bytes);
            for (int kv_head = 0; kv_head < kv_heads; kv_head++)
                score_keys(b, b->keys + offset + kv_head * key_head_bytes, group, chunks, q + kv_head * group,
                           raw + kv_head * group, scores + kv_head * group);
        }
        for (int kv_head = 0; kv_head < kv_heads; kv_head++) {
            const int h = kv_head * group;
            softmax_tile(tile, group, chunks, visible, first, scores + h, running_max + h, lane_sums + h, acc + h,
                         weights + h);
        }
#if defined(VECTORS_ARE_AVX2_PAIRS)
        avx2_decode_values(b, b->values + offset, len, chunks, weights, acc, widened);
#else
        add_decode_values(b, b->values + offset, len, ahead, chunks, weights, acc);
#endif
    }
    close_segment(heads, chunks, running_max, lane_sums, acc, total_max, total_denominator, total_acc);
    if (!partial) {
        for (int h = 0; h < heads; h++) store_head(b, row, h, chunks, total_acc[h], total_denominator[h]);
        return;
    }
    store_partial(heads, chunks, total_max, total_denominator, total_acc, partial);
}

/* A split decode row's output (query row `row`): its `segments` partials from `partials` on,
 * joined in order. */
static void join_partials(const Batch *b, int64_t row, const float *partials, int segments, int head_dim)
{
    const int heads = b->num_heads, chunks = head_dim / LANES;
    vfloat acc[heads][chunks], segment_acc[heads][chunks];
    float max[heads], denominator[heads];
    empty_softmax(heads, chunks, max, denominator, acc);
    for (int k = 0; k < segments; k++) {
        const float *partial = partials + k * partial_floats(heads, head_dim);
        memcpy(segment_acc, partial + 2 * heads, sizeof segment_acc);
        for (int h = 0; h < heads; h++)
            join_segment(chunks, &max[h], &denominator[h], acc[h], partial[h], partial[heads + h], segment_acc[h]);
    }
    for (int h = 0; h < heads; h++) store_head(b, row, h, chunks, acc[h], denominator[h]);
}

static void attend_item(const Batch *b, int seq, int64_t row, int num_tokens, int kv_head, int head_dim)
{
    switch (head_dim) {
    case 64: attend_tile(b, seq, row, num_tokens, kv_head, 4); break;
    case 128: attend_tile(b, seq, row, num_tokens, kv_head, 8); break;
    default: attend_tile(b, seq, row, num_tokens, kv_head, head_dim / LANES);
    }
}

static void attend_decode_item(const Batch *b, int seq, int64_t row, int from, int to, float *partial, int head_dim)
{
    switch (head_dim) {
    case 64: attend_decode_row(b, seq, row, from, to, partial, 4); break;
    case 128: attend_decode_row(b, seq, row, from, to, partial, 8); break;
    default: attend_decode_row(b, seq, row, from, to, partial, head_dim / LANES);
    }
}

/* An item of the work list: up to QUERY_TILE new tokens of `seq` from query row `row` (fewer at
 * the sequence's end) with KV head `kv_head`; or (kv_head -1) the decode row `row` of `seq` over
 * positions [from, to), leaving its segments' partial softmaxes from number `partial` on (-1:
 * the output itself). */
struct Item {
    int32_t seq, kv_head, from, to;
    int64_t row, partial;
};

/* A decode row split into items leaving `segments` partials, from number `first_partial` on. */
struct SplitRow {
    int64_t row, first_partial;
    int32_t segments;
};

/* The batch's items and split decode rows, and how many partials those leave. */
struct WorkList {
    struct Item *items;
    struct SplitRow *split_rows;
    int64_t num_items, num_split_rows, num_partials;
};

/* Fills `work`'s arrays, or with them NULL only counts; decode rows whole where `whole_rows`,
 * else each split into up to `num_threads` runs of whole segments. */
static void list_work(const Batch *b, int num_seqs, int long_chunk_tokens, int whole_rows, int num_threads,
                      struct WorkList *work)
{
    work->num_items = work->num_split_rows = work->num_partials = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int tokens = b->query_start_loc[s + 1] - b->query_start_loc[s];
        const int64_t start_row = b->query_start_loc[s];
        if (long_chunk_tokens && tokens >= long_chunk_tokens) continue;
        if (tokens > 1) {
            for (int64_t row = start_row; row < b->query_start_loc[s + 1]; row += QUERY_TILE)
                for (int kv_head = 0; kv_head < b->num_kv_heads; kv_head++, work->num_items++)
                    if (work->items) work->items[work->num_items] = (struct Item){s, kv_head, 0, 0, row, -1};
            continue;
        }
        const int last = b->seq_lens[s], first = window_start(b, last) / LANES * LANES;
        if (whole_rows) {
            if (work->items) work->items[work->num_items] = (struct Item){s, -1, first, last, start_row, -1};
            work->num_items++;
            continue;
        }
        const int64_t first_partial = work->num_partials;
        const int first_segment = first / SEGMENT, segments = (last - 1) / SEGMENT - first_segment + 1;
        for (int t = 0; t < num_threads; t++) {
            const int begin = t * segments / num_threads, end = (t + 1) * segments / num_threads;
            if (begin == end) continue;
            const int from = begin ? (first_segment + begin) * SEGMENT : first;
            const int to = (first_segment + end) * SEGMENT < last ? (first_segment + end) * SEGMENT : last;
            if (work->items) work->items[work->num_items] = (struct Item){s, -1, from, to, start_row, first_partial + begin};
            work->num_items++;
        }
        work->num_partials += segments;
        if (work->split_rows)
            work->split_rows[work->num_split_rows] =
                (struct SplitRow){start_row, first_partial, (int32_t)(work->num_partials - first_partial)};
        work->num_split_rows++;
    }
}

/* Whether paged_attention handles these shapes (kernels/cpu_attention.py's `supports`). */
int paged_attention_supports(int num_heads, int num_kv_heads, int head_dim, int block_size)
{
    return head_dim % LANES == 0 && head_dim <= MAX_CHUNKS * LANES && block_size % LANES == 0
           && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= MAX_GROUP;
}

/* A paged_attention call's batch and work, listed before its threads run it. */
struct AttentionWork {
    Batch batch;
    struct WorkList work;
    float *partials;
    int head_dim;
};

/* The work of paged_attention's call with these arguments (see paged_attention), for
 * attention_in_region; NULL where the shapes are outside what this kernel handles or memory runs
 * out. Free it with attention_work_free. */
struct AttentionWork *attention_work(
    const void *query, int64_t query_token_stride, int64_t query_head_stride, int query_dtype,
    const void *kv_cache, int cache_dtype, int64_t num_blocks, int block_size, int num_kv_heads, int head_dim,
    const int32_t *block_tables, int64_t block_table_stride, const int32_t *query_start_loc,
    const int32_t *seq_lens, int num_seqs, int num_heads, int sliding_window, int long_chunk_tokens, float scale,
    void *out, int num_threads)
{
    if (!paged_attention_supports(num_heads, num_kv_heads, head_dim, block_size)) return NULL;
    struct AttentionWork *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    const size_t cache_bytes = (size_t)num_blocks * block_size * num_kv_heads * head_dim * dtype_size(cache_dtype);
    w->batch = (Batch){
        .query = query, .query_token_stride = query_token_stride, .query_head_stride = query_head_stride,
        .query_dtype = query_dtype, .keys = kv_cache, .values = (const char *)kv_cache + cache_bytes,
        .cache_dtype = cache_dtype, .block_size = block_size, .num_heads = num_heads,
        .num_kv_heads = num_kv_heads, .block_tables = block_tables, .block_table_stride = block_table_stride,
        .query_start_loc = query_start_loc, .seq_lens = seq_lens, .sliding_window = sliding_window,
        .scale = scale, .out = out,
#if defined(AMX_TILES)
        .amx = cache_dtype == DTYPE_BFLOAT16 && query_dtype == DTYPE_BFLOAT16 && head_dim % AMX_DIMS == 0
               && amx_permitted(),
#endif
    };
    w->head_dim = head_dim;
    int decode_rows = 0;
    for (int s = 0; s < num_seqs; s++) decode_rows += query_start_loc[s + 1] - query_start_loc[s] == 1;
    const int whole_rows = decode_rows >= ROWS_PER_THREAD * num_threads;
    list_work(&w->batch, num_seqs, long_chunk_tokens, whole_rows, num_threads, &w->work);
    w->work.items = malloc(sizeof *w->work.items * (w->work.num_items + 1));
    w->work.split_rows = malloc(sizeof *w->work.split_rows * (w->work.num_split_rows + 1));
    w->partials = malloc(sizeof *w->partials * (w->work.num_partials * partial_floats(num_heads, head_dim) + 1));
    if (!w->work.items || !w->work.split_rows || !w->partials) {
        attention_work_free(w);
        return NULL;
    }
    list_work(&w->batch, num_seqs, long_chunk_tokens, whole_rows, num_threads, &w->work);
    return w;
}

void attention_work_free(struct AttentionWork *w)
{
    if (!w) return;
    free(w->work.items);
    free(w->work.split_rows);
    free(w->partials);
    free(w);
}

/* The work's items shared among the threads of the region it is called in, then its split rows
 * joined; returns after its barrier. */
void attention_in_region(const struct AttentionWork *w)
{
    const Batch *batch = &w->batch;
    const int head_dim = w->head_dim, num_heads = batch->num_heads;
#if defined(AMX_TILES)
    if (batch->amx) configure_tiles();
#endif
#pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < w->work.num_items; i++) {
        const struct Item item = w->work.items[i];
        if (item.kv_head >= 0) {
            const int rest = batch->query_start_loc[item.seq + 1] - (int)item.row;
            attend_item(batch, item.seq, item.row, rest < QUERY_TILE ? rest : QUERY_TILE, item.kv_head, head_dim);
            continue;
        }
        float *partial = item.partial < 0 ? NULL : w->partials + item.partial * partial_floats(num_heads, head_dim);
        attend_decode_item(batch, item.seq, item.row, item.from, item.to, partial, head_dim);
    }
    /* The for's barrier: every partial is written before any row joins its own. Without split
     * rows there is nothing to join, and no second barrier to wait at. */
    if (w->work.num_split_rows) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < w->work.num_split_rows; r++) {
            const struct SplitRow split = w->work.split_rows[r];
            join_partials(batch, split.row, w->partials + split.first_partial * partial_floats(num_heads, head_dim),
                          split.segments, head_dim);
        }
    }
#if defined(AMX_TILES)
    if (batch->amx) _tile_release();
#endif
}

/* Attention of the new tokens of every one of the batch's `num_seqs` sequences into `out`, each
 * over its last `sliding_window` positions (0: all of them), except the sequences with at least
 * `long_chunk_tokens` new tokens (0: none), whose rows of `out` are left to the caller: on a long
 * context a GEMM-based attention does those faster. Returns 0, or -1 when the shapes are outside
 * what this kernel handles (head_dim a multiple of 16 up to 256, block_size a multiple of 16,
 * at most 16 query heads per KV head) or memory runs out. */
int paged_attention(
    const void *query, int64_t query_token_stride, int64_t query_head_stride, int query_dtype,
    const void *kv_cache, int cache_dtype, int64_t num_blocks, int block_size, int num_kv_heads, int head_dim,
    const int32_t *block_tables, int64_t block_table_stride, const int32_t *query_start_loc,
    const int32_t *seq_lens, int num_seqs, int num_heads, int sliding_window, int long_chunk_tokens, float scale,
    void *out, int num_threads)
{
    struct AttentionWork *w = attention_work(
        query, query_token_stride, query_head_stride, query_dtype, kv_cache, cache_dtype, num_blocks, block_size,
        num_kv_heads, head_dim, block_tables, block_table_stride, query_start_loc, seq_lens, num_seqs, num_heads,
        sliding_window, long_chunk_tokens, scale, out, num_threads);
    if (!w) return -1;
#pragma omp parallel num_threads(num_threads)
    attention_in_region(w);
    attention_work_free(w);
    return 0;
}

/* Paged attention for a ragged mixed batch on the CPU: the same contract as
 * kernels/reference.py's paged_attention (which it is tested against), computed in float32
 * with an online softmax, one pass over each sequence's paged context.
 *
 * Work is split into items of (sequence, tile of up to QUERY_TILE consecutive new tokens,
 * KV head). An item walks its context 16 positions at a time: the 16 key rows are converted
 * once and shared by every query row of the item (its tokens x the query heads of the KV
 * head), each query row's 16 dot products are summed by a shuffle tree instead of 16
 * horizontal reductions, and each value row is converted once and added into every row. Where
 * the next tile's block does not follow this one's in memory, its rows are prefetched
 * meanwhile: decode attention is bound by these reads. With a sliding window the walk starts
 * at the first tile any row of the item sees, so positions (and whole blocks) behind every
 * row's window are never read.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "vector_math.h"

enum { QUERY_TILE = 8, MAX_GROUP = 16, MAX_CHUNKS = 16 };

typedef struct {
    const char *query; /* [tokens, heads, head_dim], last dim contiguous */
    int64_t query_token_stride, query_head_stride; /* in elements */
    int query_dtype; /* also the output's */
    const char *keys, *values; /* each [blocks, block_size, kv_heads, head_dim] */
    int cache_dtype;
    int block_size, num_heads, num_kv_heads;
    const int32_t *block_tables;
    int64_t block_table_stride;
    const int32_t *query_start_loc, *seq_lens;
    int sliding_window; /* 0: full causal attention */
    float scale;
    char *out; /* [tokens, heads, head_dim], contiguous */
} Batch;

/* Pairwise step of the shuffle tree: `a` and `b` each hold 16 / width groups of `width` lanes,
 * one group per position, whose sum is that position's dot product. Returns groups of half
 * the width with the same sums: a's positions first, then b's. */
static inline vfloat fold(vfloat a, vfloat b, int width)
{
    static const vint low[] = {
        [8] = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
        [4] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
        [2] = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
        [1] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
    };
    const int half = width / 2;
    return __builtin_shuffle(a, b, low[half]) + __builtin_shuffle(a, b, low[half] + half);
}

/* lanes[p] = the sum of the lanes of partial[p], for the 16 positions p. */
static inline vfloat sum_each(vfloat partial[LANES])
{
    for (int width = LANES, count = LANES; width > 1; width /= 2, count /= 2)
        for (int i = 0; i < count / 2; i++) partial[i] = fold(partial[2 * i], partial[2 * i + 1], width);
    return partial[0];
}

/* tile[p] = the head's row at position p of a tile (`first` + p * `stride` bytes) as float32,
 * for the `len` positions in the context; zero past them. */
static inline __attribute__((always_inline)) void load_tile(
    const char *first, int64_t stride, int len, int dtype, const int chunks, vfloat tile[LANES][chunks])
{
    for (int p = 0; p < LANES; p++)
        for (int c = 0; c < chunks; c++)
            tile[p][c] = p < len ? load_lanes(first + p * stride + c * LANES * dtype_size(dtype), dtype) : (vfloat){0};
}

/* One item: `num_tokens` new tokens of `seq` from query row `row` on, KV head `kv_head`.
 * Inlined with a constant chunk count for the common head sizes so the loops unroll. */
static inline __attribute__((always_inline)) void attend_tile(
    const Batch *b, int seq, int64_t row, int num_tokens, int kv_head, const int chunks)
{
    const int head_dim = chunks * LANES, group = b->num_heads / b->num_kv_heads;
    const int rows = num_tokens * group, block_size = b->block_size;
    const int64_t position_stride = (int64_t)b->num_kv_heads * head_dim;
    const int64_t block_stride = block_size * position_stride;
    const size_t cache_item = dtype_size(b->cache_dtype), query_item = dtype_size(b->query_dtype);
    /* Row x is token x / group and query head kv_head * group + x % group; it sees positions
     * [first[x], visible[x]) (causal: the new tokens are the last ones of the context; a
     * sliding window of w positions ends at the token's own). */
    const int last_visible = b->seq_lens[seq] - (b->query_start_loc[seq + 1] - (int)(row + num_tokens));
    const int window = b->sliding_window;
    vfloat q[rows][chunks], acc[rows][chunks], keys[LANES][chunks], values[LANES][chunks], partial[LANES];
    float running_max[rows], denominator[rows];
    vfloat weights[rows];
    int visible[rows], first[rows];
    for (int x = 0; x < rows; x++) {
        const int token = x / group, head = kv_head * group + x % group;
        const char *src = b->query + ((row + token) * b->query_token_stride + head * b->query_head_stride) * query_item;
        for (int c = 0; c < chunks; c++) {
            q[x][c] = load_lanes(src + c * LANES * query_item, b->query_dtype) * b->scale;
            acc[x][c] = (vfloat){0};
        }
        running_max[x] = -INFINITY;
        denominator[x] = 0.f;
        visible[x] = last_visible - (num_tokens - 1 - token);
        first[x] = window && visible[x] > window ? visible[x] - window : 0;
    }
    const int32_t *blocks = b->block_tables + seq * b->block_table_stride;
    /* Row 0 (the item's first token) has the earliest window; tiles stay LANES-aligned. */
    for (int start = first[0] / LANES * LANES; start < last_visible; start += LANES) {
        const int len = last_visible - start < LANES ? last_visible - start : LANES;
        const int64_t offset = (int64_t)blocks[start / block_size] * block_stride
                               + (start % block_size) * position_stride + (int64_t)kv_head * head_dim;
        const int next = start + LANES;
        /* Where the next tile's block does not follow this tile's in memory, its rows are
         * fetched ahead: the hardware prefetchers follow a contiguous walk on their own, and
         * prefetching that too costs more than it saves (11-15% of a decode's attention). */
        const int next_block = next / block_size, this_block = start / block_size;
        if (next < last_visible && next_block != this_block && blocks[next_block] != blocks[this_block] + 1) {
            const int64_t next_offset = (int64_t)blocks[next_block] * block_stride
                                        + (next % block_size) * position_stride + (int64_t)kv_head * head_dim;
            for (int p = 0; p < LANES; p++)
                for (size_t line = 0; line < head_dim * cache_item; line += 64) {
                    __builtin_prefetch(b->keys + (next_offset + p * position_stride) * cache_item + line);
                    __builtin_prefetch(b->values + (next_offset + p * position_stride) * cache_item + line);
                }
        }
        load_tile(b->keys + offset * cache_item, position_stride * cache_item, len, b->cache_dtype, chunks, keys);
        for (int x = 0; x < rows; x++) {
            if (start >= visible[x] || start + LANES <= first[x]) continue;
            for (int p = 0; p < LANES; p++) {
                partial[p] = q[x][0] * keys[p][0];
                for (int c = 1; c < chunks; c++) partial[p] += q[x][c] * keys[p][c];
            }
            const vint in_view = (LANE_INDEX < (visible[x] - start)) & (LANE_INDEX >= (first[x] - start));
            const vfloat scores = select_lanes(in_view, sum_each(partial), (vfloat){0} - INFINITY);
            const float tile_max = max_of_lanes(scores);
            const float new_max = tile_max > running_max[x] ? tile_max : running_max[x];
            const float correction = exp_lanes((vfloat){0} + (running_max[x] - new_max))[0];
            weights[x] = exp_lanes(scores - new_max);
            const float sum = sum_of_lanes(weights[x]);
            denominator[x] = denominator[x] * correction + sum;
            running_max[x] = new_max;
            if (correction != 1.f)
                for (int c = 0; c < chunks; c++) acc[x][c] *= correction;
        }
        load_tile(b->values + offset * cache_item, position_stride * cache_item, len, b->cache_dtype, chunks, values);
        for (int x = 0; x < rows; x++) {
            if (start >= visible[x] || start + LANES <= first[x]) continue;
            for (int c = 0; c < chunks; c++) {
                vfloat sum = acc[x][c];
                for (int p = 0; p < LANES; p++) sum += weights[x][p] * values[p][c];
                acc[x][c] = sum;
            }
        }
    }
    for (int x = 0; x < rows; x++) {
        const int token = x / group, head = kv_head * group + x % group;
        float result[head_dim];
        for (int c = 0; c < chunks; c++) memcpy(result + c * LANES, &acc[x][c], sizeof(vfloat));
        const float inverse = 1.f / denominator[x];
        for (int d = 0; d < head_dim; d++) result[d] *= inverse;
        store_row(result, b->query_dtype, b->out + (((row + token) * b->num_heads + head) * (int64_t)head_dim) * query_item,
                  head_dim);
    }
}

static void attend_item(const Batch *b, int seq, int64_t row, int num_tokens, int kv_head, int head_dim)
{
    switch (head_dim) {
    case 64: attend_tile(b, seq, row, num_tokens, kv_head, 4); break;
    case 128: attend_tile(b, seq, row, num_tokens, kv_head, 8); break;
    default: attend_tile(b, seq, row, num_tokens, kv_head, head_dim / LANES);
    }
}

/* Whether paged_attention handles these shapes (kernels/cpu_attention.py's `supports`). */
int paged_attention_supports(int num_heads, int num_kv_heads, int head_dim, int block_size)
{
    return head_dim % LANES == 0 && head_dim <= MAX_CHUNKS * LANES && block_size % LANES == 0
           && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= MAX_GROUP;
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
    if (!paged_attention_supports(num_heads, num_kv_heads, head_dim, block_size)) return -1;
    int64_t num_tiles = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int tokens = query_start_loc[s + 1] - query_start_loc[s];
        if (!long_chunk_tokens || tokens < long_chunk_tokens) num_tiles += (tokens + QUERY_TILE - 1) / QUERY_TILE;
    }
    /* tile_seq[i], tile_row[i]: the sequence and first query row of tile i. */
    int32_t *tile_seq = malloc(sizeof(int32_t) * (num_tiles + 1));
    int64_t *tile_row = malloc(sizeof(int64_t) * (num_tiles + 1));
    if (!tile_seq || !tile_row) {
        free(tile_seq);
        free(tile_row);
        return -1;
    }
    int64_t n = 0;
    for (int s = 0; s < num_seqs; s++) {
        if (long_chunk_tokens && query_start_loc[s + 1] - query_start_loc[s] >= long_chunk_tokens) continue;
        for (int64_t row = query_start_loc[s]; row < query_start_loc[s + 1]; row += QUERY_TILE) {
            tile_seq[n] = s;
            tile_row[n++] = row;
        }
    }
    const size_t cache_bytes = (size_t)num_blocks * block_size * num_kv_heads * head_dim * dtype_size(cache_dtype);
    const Batch batch = {
        .query = query, .query_token_stride = query_token_stride, .query_head_stride = query_head_stride,
        .query_dtype = query_dtype, .keys = kv_cache, .values = (const char *)kv_cache + cache_bytes,
        .cache_dtype = cache_dtype, .block_size = block_size, .num_heads = num_heads,
        .num_kv_heads = num_kv_heads, .block_tables = block_tables, .block_table_stride = block_table_stride,
        .query_start_loc = query_start_loc, .seq_lens = seq_lens, .sliding_window = sliding_window,
        .scale = scale, .out = out,
    };
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int64_t i = 0; i < num_tiles * num_kv_heads; i++) {
        const int64_t tile = i / num_kv_heads, row = tile_row[tile];
        const int s = tile_seq[tile], end = query_start_loc[s + 1];
        const int tokens = end - row < QUERY_TILE ? (int)(end - row) : QUERY_TILE;
        attend_item(&batch, s, row, tokens, (int)(i % num_kv_heads), head_dim);
    }
    free(tile_seq);
    free(tile_row);
    return 0;
}

/* Writing new keys and values into the paged cache, and copying blocks between caches, on the
 * CPU (kernels/reference.py's write_kv_cache and copy_blocks, tested against them). */
#include <stdint.h>
#include <string.h>

#include "dtypes.h"
#include "kernels.h"
#include "kv_layout.h"

/* Below this many tokens one thread writes them: waking the other cost more than it saved (64
 * tokens 6 -> 12 us; 1,934 tokens 247 -> 117 us on touched pages, 609 -> 320 on fresh ones, whose
 * first-touch faults the threads take in parallel; Xeon-AMX). */
enum { PARALLEL_MIN_TOKENS = 256 };

/* The `pairs` pairs of dims of one key row (`src`, 2 * `item` bytes a pair, side by side) to their
 * places in a tile, each KEY_TILE pairs' bytes after the last (kv_layout.h). A copy of a constant
 * size per pair: a memcpy of a size known only at run time was a call per pair, which made a
 * 2,048-token write 1.8-2.5x slower than whole rows. */
static inline void scatter_pairs(char *dst, const char *src, int pairs, size_t item)
{
    const int64_t stride = 2 * KEY_TILE * (int64_t)item;
    switch (item) {
    case 4:
        for (int j = 0; j < pairs; j++) memcpy(dst + j * stride, src + j * 8, 8);
        break;
    case 2:
        for (int j = 0; j < pairs; j++) memcpy(dst + j * stride, src + j * 4, 4);
        break;
    default:
        for (int j = 0; j < pairs; j++) memcpy(dst + j * stride, src + j * 2, 2);
    }
}

/* Token t's key and value rows into its slot: the value row whole, the key row a pair of dims at
 * a time into its tile (kv_layout.h). */
static inline void write_token(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
                               int dtype, char *keys, char *values, int cache_dtype, int kv_heads, int head_dim,
                               const int64_t *slot_mapping, int64_t t)
{
    const size_t item = dtype_size(dtype), cache_item = dtype_size(cache_dtype);
    const int row_width = kv_heads * head_dim;
    const int64_t slot = slot_mapping[t];
    if (slot == -1) return;
    const char *key_row = key + t * key_stride * item;
    if (dtype == cache_dtype) {
        for (int h = 0; h < kv_heads; h++)
            scatter_pairs(keys + key_index(slot, h, 0, kv_heads, head_dim) * cache_item,
                          key_row + (int64_t)h * head_dim * item, head_dim / 2, item);
        memcpy(values + slot * row_width * cache_item, value + t * value_stride * item, row_width * item);
        return;
    }
    float row[row_width];
    load_row(key_row, dtype, row, row_width);
    char converted[row_width * cache_item];
    store_row(row, cache_dtype, converted, row_width);
    for (int h = 0; h < kv_heads; h++)
        scatter_pairs(keys + key_index(slot, h, 0, kv_heads, head_dim) * cache_item,
                      converted + (int64_t)h * head_dim * cache_item, head_dim / 2, cache_item);
    load_row(value + t * value_stride * item, dtype, row, row_width);
    store_row(row, cache_dtype, values + slot * row_width * cache_item, row_width);
}

/* write_kv_cache's tokens, on slots the caller checked (kv_slots_valid): shared among the threads
 * of the region it is called in (`shared`; all on the caller outside any region), or all on the
 * calling thread (not `shared`). */
void write_kv_rows(const void *key, int64_t key_stride, const void *value, int64_t value_stride, int dtype,
                   void *kv_cache, int64_t num_slots, int cache_dtype, int num_kv_heads, int head_dim,
                   const int64_t *slot_mapping, int64_t num_tokens, int shared)
{
    const int64_t row_width = (int64_t)num_kv_heads * head_dim;
    char *keys = kv_cache, *values = (char *)kv_cache + num_slots * row_width * dtype_size(cache_dtype);
#define WRITE_TOKEN(t)                                                                                          \
    write_token(key, key_stride, value, value_stride, dtype, keys, values, cache_dtype, num_kv_heads, head_dim, \
                slot_mapping, t)
    if (shared) {
#pragma omp for
        for (int64_t t = 0; t < num_tokens; t++) WRITE_TOKEN(t);
    } else {
        for (int64_t t = 0; t < num_tokens; t++) WRITE_TOKEN(t);
    }
#undef WRITE_TOKEN
}

/* Whether write_kv_cache takes these slots and this cache: every slot -1 or inside it, whole
 * tiles of slots, pairs of dims. */
int kv_slots_valid(const int64_t *slot_mapping, int64_t num_tokens, int64_t num_slots, int head_dim)
{
    if (num_slots % KEY_TILE || head_dim % 2) return 0;
    for (int64_t t = 0; t < num_tokens; t++)
        if (slot_mapping[t] < -1 || slot_mapping[t] >= num_slots) return 0;
    return 1;
}

/* Token t's key and value rows (num_kv_heads * head_dim elements of `dtype`, at key +
 * t * key_stride and value + t * value_stride) go to slot slot_mapping[t] of the cache
 * ([2, num_slots, num_kv_heads, head_dim] of `cache_dtype`, the keys tiled as kv_layout.h lays
 * them out; num_slots a multiple of KEY_TILE); slot -1 skips t. Returns 0, or -1 before writing
 * anything where a slot lies outside the cache. */
int write_kv_cache(const void *key, int64_t key_stride, const void *value, int64_t value_stride, int dtype,
                   void *kv_cache, int64_t num_slots, int cache_dtype, int num_kv_heads, int head_dim,
                   const int64_t *slot_mapping, int64_t num_tokens, int num_threads)
{
    if (!kv_slots_valid(slot_mapping, num_tokens, num_slots, head_dim)) return -1;
    /* Few tokens on the calling thread alone, outside any parallel region (layers.c says why). */
    if (num_tokens < PARALLEL_MIN_TOKENS) {
        write_kv_rows(key, key_stride, value, value_stride, dtype, kv_cache, num_slots, cache_dtype, num_kv_heads,
                      head_dim, slot_mapping, num_tokens, 0);
        return 0;
    }
#pragma omp parallel num_threads(num_threads)
    write_kv_rows(key, key_stride, value, value_stride, dtype, kv_cache, num_slots, cache_dtype, num_kv_heads,
                  head_dim, slot_mapping, num_tokens, 1);
    return 0;
}

/* Block src_ids[i] of `src` to block dst_ids[i] of `dst`, keys and values, one thread. Both
 * caches are [2, blocks, block_bytes]; they hold src_blocks and dst_blocks blocks. Returns 0, or
 * -1 (after the copies before it) at an id outside its cache. */
int copy_blocks(const void *src, int64_t src_blocks, void *dst, int64_t dst_blocks, int64_t block_bytes,
                const int64_t *src_ids, const int64_t *dst_ids, int64_t count)
{
    for (int64_t i = 0; i < count; i++) {
        if (src_ids[i] < 0 || src_ids[i] >= src_blocks || dst_ids[i] < 0 || dst_ids[i] >= dst_blocks) return -1;
        for (int part = 0; part < 2; part++)
            memcpy((char *)dst + (part * dst_blocks + dst_ids[i]) * block_bytes,
                   (const char *)src + (part * src_blocks + src_ids[i]) * block_bytes, block_bytes);
    }
    return 0;
}

/* The CPU paged cache's layout, which kv_cache.c writes and the attention kernels read.
 *
 * A cache is [2, slots, kv_heads, head_dim] elements (slot = block * block_size + position):
 * values as that says, a slot's rows of every KV head side by side; keys in tiles of KEY_TILE
 * slots (block sizes are multiples of it, so a block holds whole tiles), each tile holding its
 * KV heads one after another as [head_dim / 2][KEY_TILE slots][2 dims]. A tile's keys thus take
 * the same bytes as its values, but one load of 2 * KEY_TILE elements is a pair of dims at every
 * position of the tile: a query's pair of dims, broadcast, scores all 16 positions at once, with
 * no reduction across lanes (docs/attention.md). */
#pragma once
#include <stdint.h>

enum { KEY_TILE = 16 };

/* The element index, from the keys' start, of dim `dim` of KV head `kv_head`'s key in `slot`. */
static inline int64_t key_index(int64_t slot, int kv_head, int dim, int kv_heads, int head_dim)
{
    return slot / KEY_TILE * KEY_TILE * kv_heads * head_dim + (int64_t)kv_head * KEY_TILE * head_dim
           + (int64_t)(dim / 2) * 2 * KEY_TILE + slot % KEY_TILE * 2 + dim % 2;
}

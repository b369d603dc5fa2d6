/* AMX's tile instructions in plain C, for builds with STRATA_EMULATE_AMX (the tests' only): the
 * AMX bodies of the kernels then run, slowly, on a CPU without AMX, and are checked against the
 * torch reference like every other body. The tile operations follow the Intel SDM's pseudocode
 * for the 16 x 64-byte tiles amx_tiles.h configures; the real instructions are used wherever
 * -march has AMX. Included by amx_tiles.h only. */
#pragma once
#include <immintrin.h> /* first: GCC's may declare the real intrinsics, which the macros below replace */
#include <stdint.h>
#include <string.h>

enum { EMULATED_TILES = 8, EMULATED_TILE_ROWS = 16, EMULATED_TILE_BYTES = 64 };

/* Each thread's own tile registers, as each core has its own. */
static _Thread_local uint8_t emulated_tiles[EMULATED_TILES][EMULATED_TILE_ROWS][EMULATED_TILE_BYTES];

static inline void emulated_tile_loadconfig(const void *config) { (void)config; }
static inline void emulated_tile_release(void) {}

static inline void emulated_tile_zero(int tile) { memset(emulated_tiles[tile], 0, sizeof emulated_tiles[tile]); }

static inline void emulated_tile_loadd(int tile, const void *base, int64_t stride)
{
    for (int r = 0; r < EMULATED_TILE_ROWS; r++)
        memcpy(emulated_tiles[tile][r], (const char *)base + r * stride, EMULATED_TILE_BYTES);
}

static inline void emulated_tile_stored(int tile, void *base, int64_t stride)
{
    for (int r = 0; r < EMULATED_TILE_ROWS; r++)
        memcpy((char *)base + r * stride, emulated_tiles[tile][r], EMULATED_TILE_BYTES);
}

static inline float emulated_bf16(const uint8_t *bytes)
{
    uint16_t half;
    memcpy(&half, bytes, sizeof half);
    const uint32_t bits = (uint32_t)half << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* tdpbf16ps: sums row m of `dst` (16 float32) += row m of `a` (16 pairs of bfloat16) times `b`
 * (row k: for each of 16 columns, the pair of values that meets a's pair k). */
static inline void emulated_tile_dpbf16ps(int dst, int a, int b)
{
    for (int m = 0; m < EMULATED_TILE_ROWS; m++) {
        float sums[16];
        memcpy(sums, emulated_tiles[dst][m], sizeof sums);
        for (int k = 0; k < EMULATED_TILE_ROWS; k++)
            for (int n = 0; n < 16; n++) {
                const uint8_t *left = &emulated_tiles[a][m][4 * k], *right = &emulated_tiles[b][k][4 * n];
                sums[n] += emulated_bf16(left) * emulated_bf16(right);
                sums[n] += emulated_bf16(left + 2) * emulated_bf16(right + 2);
            }
        memcpy(emulated_tiles[dst][m], sums, sizeof sums);
    }
}

#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#define _tile_loadconfig emulated_tile_loadconfig
#define _tile_release emulated_tile_release
#define _tile_zero emulated_tile_zero
#define _tile_loadd emulated_tile_loadd
#define _tile_stored emulated_tile_stored
#define _tile_dpbf16ps emulated_tile_dpbf16ps

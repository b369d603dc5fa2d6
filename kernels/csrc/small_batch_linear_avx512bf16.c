/* small_batch_linear's body for CPUs with AVX512-BF16 (compiled where -march=native has it), for
 * bfloat16 input rows.
 *
 * `vdpbf16ps` multiplies 32 bfloat16 pairs and adds each adjacent pair of products into one of
 * 16 float32 lanes: one instruction dots 32 weights with 32 input values, where the portable body
 * spends a widening per 8 weights and an FMA per 8 products. Input rows are used as they are, with
 * no float32 copy and no deinterleaving. A product of two bfloat16 values is exact in float32, so
 * the sums differ from a float32 GEMM's only in order and in denormals, which the instruction
 * flushes to zero.
 *
 * Threads split the output features in groups of 4; each group's weight rows (a few KB) stay in L1
 * while blocks of up to 4 input rows pass over them: 16 accumulators of the 32 registers.
 */
#include <stdint.h>
#include <string.h>

#include "dtypes.h"
#include "kernels.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

enum { PAIRS = 32, OUTS = 4, ROW_BLOCK = 4, PREFETCH_BYTES = 4096 };

static inline __m512bh load_pairs(const uint16_t *src, __mmask32 mask)
{
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, src);
}

/* sums[r][j] = x[r] . w[j] for r < rows, j < OUTS over `in_features` (a multiple of 16). */
static inline __attribute__((always_inline)) void dot_block(
    const uint16_t *x, int64_t in_features, const uint16_t *const w[OUTS], float sums[ROW_BLOCK][OUTS],
    const int rows)
{
    __m512 acc[ROW_BLOCK][OUTS];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < OUTS; j++) acc[r][j] = _mm512_setzero_ps();
    /* Group weight rows are contiguous: prefetching PREFETCH_BYTES past each keeps a stream a few
     * KB ahead whatever the row length (into every cache level, as small_batch_linear.c says why). */
    for (int64_t k = 0; k < in_features; k += PAIRS) {
        const __mmask32 mask = in_features - k >= PAIRS ? 0xffffffffu : 0xffffu;
        __m512bh weights[OUTS];
        for (int j = 0; j < OUTS; j++) {
            weights[j] = load_pairs(w[j] + k, mask);
            _mm_prefetch((const char *)(w[j] + k) + PREFETCH_BYTES, _MM_HINT_T0);
        }
        for (int r = 0; r < rows; r++) {
            const __m512bh input = load_pairs(x + r * in_features + k, mask);
            for (int j = 0; j < OUTS; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], input, weights[j]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < OUTS; j++) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]);
}

int small_batch_linear_avx512bf16(
    const uint16_t *x, int64_t rows, int64_t in_features, const uint16_t *weight, int64_t out_features,
    const float *bias, void *out, int out_dtype, int num_threads)
{
    if (in_features % 16) return -1;
    const size_t out_item = dtype_size(out_dtype);
    const int64_t groups = (out_features + OUTS - 1) / OUTS;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t group = 0; group < groups; group++) {
        const int64_t n = group * OUTS;
        const int features = out_features - n < OUTS ? (int)(out_features - n) : OUTS;
        const uint16_t *w[OUTS];  /* past the last feature, its row repeats: those sums are dropped */
        for (int j = 0; j < OUTS; j++) w[j] = weight + (n + (j < features ? j : features - 1)) * in_features;
        for (int64_t row = 0; row < rows; row += ROW_BLOCK) {
            float sums[ROW_BLOCK][OUTS];
            const uint16_t *block_x = x + row * in_features;
            switch (rows - row < ROW_BLOCK ? (int)(rows - row) : ROW_BLOCK) {
            case 1: dot_block(block_x, in_features, w, sums, 1); break;
            case 2: dot_block(block_x, in_features, w, sums, 2); break;
            case 3: dot_block(block_x, in_features, w, sums, 3); break;
            default: dot_block(block_x, in_features, w, sums, 4);
            }
            const int count = rows - row < ROW_BLOCK ? (int)(rows - row) : ROW_BLOCK;
            for (int r = 0; r < count; r++)
                for (int j = 0; j < features; j++)
                    store_float((char *)out + ((row + r) * out_features + n + j) * out_item, out_dtype,
                                sums[r][j] + (bias ? bias[n + j] : 0.f));
        }
    }
    return 0;
}
#endif

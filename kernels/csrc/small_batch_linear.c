/* x W^T (+ bias) for the few rows of a decode step, reading bfloat16 or float32 weights once.
 *
 * With a handful of rows a linear layer is a stream over its weights. A GEMM library tuned for
 * large batches reads a float32 copy of W at a fraction of the memory bandwidth there (on an AVX2
 * EPYC: 11 GB/s at 1 row, 5 to 7 GB/s at 2 to 16; 7-14 and 3-4 GB/s against an 18 GB/s plain read
 * on EPYC-AVX2). This kernel reads W as it is held, bfloat16 (half the bytes) or float32, and
 * multiplies it into the rows with float32 FMAs. Threads split the output features; each walks
 * a few weight rows at a time, which stay in L1 while the blocks of input rows pass over them.
 *
 * Widening is two instructions per 16 weights: a 32-bit word holds an even-indexed weight in its
 * low half and the next one in its high half, so `word << 16` is the even weight as a float and
 * `word & 0xffff0000` the odd one. The input rows are copied once, deinterleaved to match: each
 * run of 16 values becomes its 8 even-indexed values, then its 8 odd-indexed ones. (Widening 8
 * weights at a time through a 16-to-32-bit conversion compiled to five instructions and held the
 * kernel to about half the memory bandwidth.)
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "dtypes.h"

/* Weight rows are a few KB each: too short for the hardware prefetcher to ramp up before a block
 * moves on. Each load prefetches the same spot PREFETCH_AHEAD rows further on (on the AVX2 EPYC:
 * 13 GB/s without, 20 GB/s with, of the 23 GB/s a plain read reaches), into every cache level:
 * a non-temporal prefetch, which spares the caller's working set, held [1536, 576] at one row
 * to 15 GB/s on Xeon-AVX512, where T0 reaches 33-36. */
enum { VECTOR = 8, RUN = 2 * VECTOR, MAX_BLOCK = 4, PREFETCH_AHEAD = 8 };

typedef float v8 __attribute__((vector_size(VECTOR * sizeof(float))));
typedef uint32_t v8words __attribute__((vector_size(VECTOR * sizeof(uint32_t))));

static inline v8 as_floats(v8words words)
{
    v8 result;
    memcpy(&result, &words, sizeof result);
    return result;
}

static inline float sum_lanes(v8 v)
{
    float sum = 0.f;
    for (int i = 0; i < VECTOR; i++) sum += v[i];
    return sum;
}

/* Rows [row, row + rows) of the output at the `outs` features whose weight rows are `w` (the
 * last feature's row repeats past the end: those sums are not stored). Each run of 16 weights is
 * taken as two vectors, `even` and `odd`: for bfloat16 weights the even- and odd-indexed ones
 * (x deinterleaved to match), for float32 ones the first 8 and the last 8 (x as it is).
 * Inlined with constant counts so the rows x outs accumulators stay in registers (AVX2 has 16). */
static inline __attribute__((always_inline)) void block(
    const float *x, int64_t row, int64_t in_features, const void *const w[MAX_BLOCK], const int weight_dtype,
    float sums[MAX_BLOCK][MAX_BLOCK], const int rows, const int outs)
{
    v8 acc[MAX_BLOCK][MAX_BLOCK] = {{{0}}};
    for (int64_t k = 0; k < in_features; k += RUN) {
        v8 even[MAX_BLOCK], odd[MAX_BLOCK];
        for (int j = 0; j < outs; j++) {
            if (weight_dtype == DTYPE_FLOAT32) {
                const float *run = (const float *)w[j] + k;
                memcpy(&even[j], run, sizeof even[j]);
                memcpy(&odd[j], run + VECTOR, sizeof odd[j]);
                __builtin_prefetch(run + PREFETCH_AHEAD * in_features, 0, 3);
            } else {
                const uint16_t *run = (const uint16_t *)w[j] + k;
                v8words words;
                memcpy(&words, run, sizeof words);
                __builtin_prefetch(run + PREFETCH_AHEAD * in_features, 0, 3);
                even[j] = as_floats(words << 16);
                odd[j] = as_floats(words & 0xffff0000u);
            }
        }
        for (int r = 0; r < rows; r++) {
            v8 x_even, x_odd;
            memcpy(&x_even, x + (row + r) * in_features + k, sizeof x_even);
            memcpy(&x_odd, x + (row + r) * in_features + k + VECTOR, sizeof x_odd);
            for (int j = 0; j < outs; j++) acc[r][j] += x_even * even[j] + x_odd * odd[j];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < outs; j++) sums[r][j] = sum_lanes(acc[r][j]);
}

/* Row `m` of x as float32, each run of 16 values as its even-indexed values then its odd ones. */
static void load_deinterleaved(const void *x, int dtype, int64_t m, int64_t in_features, float *row32)
{
    float *plain = row32 + in_features;  /* scratch half of the caller's buffer */
    load_row((const char *)x + m * in_features * dtype_size(dtype), dtype, plain, (int)in_features);
    for (int64_t k = 0; k < in_features; k += RUN)
        for (int i = 0; i < VECTOR; i++) {
            row32[k + i] = plain[k + 2 * i];
            row32[k + VECTOR + i] = plain[k + 2 * i + 1];
        }
}

/* Output features n .. n + features (at most `outs`) of every row, from x32 (as `block` takes
 * it); each weight dtype compiles its own copy, so that `block`'s loop has no branch on it. */
static inline __attribute__((always_inline)) void feature_group(
    const float *x32, int64_t rows, int64_t in_features, const void *weight, const int weight_dtype, int64_t n,
    int features, const int outs, const int row_block, int64_t out_features, const float *bias, void *out,
    int out_dtype)
{
    const void *w[MAX_BLOCK];
    for (int j = 0; j < outs; j++)
        w[j] = (const char *)weight + (n + (j < features ? j : features - 1)) * in_features * dtype_size(weight_dtype);
    for (int64_t row = 0; row < rows; row += row_block) {
        float sums[MAX_BLOCK][MAX_BLOCK];
        const int count = rows - row < row_block ? (int)(rows - row) : row_block;
        if (outs == 4) {
            if (count == 1) block(x32, row, in_features, w, weight_dtype, sums, 1, 4);
            else block(x32, row, in_features, w, weight_dtype, sums, 2, 4);
        } else {
            switch (count) {
            case 1: block(x32, row, in_features, w, weight_dtype, sums, 1, 2); break;
            case 2: block(x32, row, in_features, w, weight_dtype, sums, 2, 2); break;
            case 3: block(x32, row, in_features, w, weight_dtype, sums, 3, 2); break;
            default: block(x32, row, in_features, w, weight_dtype, sums, 4, 2);
            }
        }
        for (int r = 0; r < count; r++) {
            for (int j = 0; j < features; j++) {
                const float value = sums[r][j] + (bias ? bias[n + j] : 0.f);
                store_float((char *)out + ((row + r) * out_features + n + j) * dtype_size(out_dtype), out_dtype, value);
            }
        }
    }
}

/* The portable body: float32 FMAs in 8-lane vectors, for any x86-64 (and any input dtype), on
 * bfloat16 or float32 weights (`weight_dtype`). */
int small_batch_linear_portable(
    const void *x, int x_dtype, int64_t rows, int64_t in_features, const void *weight, int weight_dtype,
    int64_t out_features, const float *bias, void *out, int out_dtype, int num_threads)
{
    if (in_features % RUN) return -1;
    /* One extra row: load_deinterleaved's scratch for the last row. */
    float *x32 = malloc(sizeof(float) * (rows + 1) * in_features);
    if (!x32) return -1;
    for (int64_t m = 0; m < rows; m++) {
        if (weight_dtype == DTYPE_FLOAT32)
            load_row((const char *)x + m * in_features * dtype_size(x_dtype), x_dtype, x32 + m * in_features,
                     (int)in_features);
        else
            load_deinterleaved(x, x_dtype, m, in_features, x32 + m * in_features);
    }
    /* One or two rows: 4 weight rows at a time (blocks of 2 rows), more streams in flight; more
     * rows: blocks of 4 rows over 2 weight rows, fewer widenings per FMA. */
    const int outs = rows <= 2 ? 4 : 2;
    const int64_t groups = (out_features + outs - 1) / outs;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t group = 0; group < groups; group++) {
        const int64_t n = group * outs;
        const int features = out_features - n < outs ? (int)(out_features - n) : outs;
#define FEATURE_GROUP(WEIGHT_DTYPE, OUTS, ROW_BLOCK)                                                             \
    feature_group(x32, rows, in_features, weight, WEIGHT_DTYPE, n, features, OUTS, ROW_BLOCK, out_features, bias, \
                  out, out_dtype)
        if (weight_dtype == DTYPE_FLOAT32) {
            if (outs == 4) FEATURE_GROUP(DTYPE_FLOAT32, 4, 2);
            else FEATURE_GROUP(DTYPE_FLOAT32, 2, 4);
        } else {
            if (outs == 4) FEATURE_GROUP(DTYPE_BFLOAT16, 4, 2);
            else FEATURE_GROUP(DTYPE_BFLOAT16, 2, 4);
        }
#undef FEATURE_GROUP
    }
    free(x32);
    return 0;
}

int small_batch_linear_body(void)
{
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* out[m, n] = sum_k x[m, k] weight[n, k] + bias[n] for m < rows, n < out_features: x in
 * `x_dtype`, weight [out_features, in_features] in `weight_dtype` (bfloat16 or float32), bias
 * float32 or NULL, out in `out_dtype`, all contiguous. Returns 0, or -1 when in_features is not a
 * multiple of 16 or memory runs out. Bfloat16 rows on bfloat16 weights take the AVX512-BF16 body
 * where this build has it (small_batch_linear_body). */
int small_batch_linear(
    const void *x, int x_dtype, int64_t rows, int64_t in_features, const void *weight, int weight_dtype,
    int64_t out_features, const float *bias, void *out, int out_dtype, int num_threads)
{
#if defined(__AVX512BF16__)
    if (x_dtype == DTYPE_BFLOAT16 && weight_dtype == DTYPE_BFLOAT16)
        return small_batch_linear_avx512bf16(x, rows, in_features, weight, out_features, bias, out, out_dtype,
                                             num_threads);
#endif
    return small_batch_linear_portable(x, x_dtype, rows, in_features, weight, weight_dtype, out_features, bias, out,
                                       out_dtype, num_threads);
}

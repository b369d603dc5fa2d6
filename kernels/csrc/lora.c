/* LoRA deltas for a batch whose tokens use different adapters: y[t] += x[t] A_s^T B_s^T for each
 * token t whose slot s = token_slots[t] is not -1, part by part of a merged linear, in the slot
 * layout of kernels/lora.py.
 *
 * Each token reads only its own slot's A and B (a few tens of KB per linear, which stay in the
 * cache across the tokens of one slot), so a step costs the adapters' own multiply-adds and
 * nothing for the slots its tokens do not use, where a GEMM against every slot's A at once (the
 * torch path) costs the whole pool per token.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "kernels.h"
#include "vector_math.h"

enum { LORA_OK = 0, LORA_NO_MEMORY = -1, MAX_PARTS = 3, UNROLL = 4 };

/* y[k] += scale * w[k] for w in `dtype`. */
static void axpy(float *y, float scale, const char *w, int dtype, int64_t n)
{
    const size_t item = dtype_size(dtype);
    int64_t k = 0;
    for (; k + LANES <= n; k += LANES) {
        vfloat ys;
        memcpy(&ys, y + k, sizeof ys);
        ys += scale * load_lanes(w + k * item, dtype);
        memcpy(y + k, &ys, sizeof ys);
    }
    for (; k < n; k++) {
        float value;
        load_row(w + k * item, dtype, &value, 1);
        y[k] += scale * value;
    }
}

/* shrunk[p * rank + r] = sum_k x[k] a[k][p][slot][r] for r < rank, a multiple of LANES: the
 * slot's rank values of a row of a are contiguous, one vector per LANES of them, kept in
 * registers for every part across all k (UNROLL independent chains hide the multiply-add's
 * latency). Inlined with constant parts and dtype. */
static inline __attribute__((always_inline)) void shrink_lanes(
    const int parts, const int dtype, const float *x, const char *a, int64_t in, int64_t slots, int64_t slot,
    int64_t rank, float *shrunk)
{
    const size_t item = dtype_size(dtype);
    for (int64_t c = 0; c < rank; c += LANES) {
        vfloat acc[MAX_PARTS][UNROLL] = {{{0}}};
        int64_t k = 0;
        for (; k + UNROLL <= in; k += UNROLL)
            for (int u = 0; u < UNROLL; u++)
                for (int p = 0; p < parts; p++)
                    acc[p][u] += x[k + u] * load_lanes(a + ((((k + u) * parts + p) * slots + slot) * rank + c) * item, dtype);
        for (; k < in; k++)
            for (int p = 0; p < parts; p++)
                acc[p][0] += x[k] * load_lanes(a + (((k * parts + p) * slots + slot) * rank + c) * item, dtype);
        for (int p = 0; p < parts; p++) {
            vfloat sum = {0};
            for (int u = 0; u < UNROLL; u++) sum += acc[p][u];
            memcpy(shrunk + p * rank + c, &sum, sizeof sum);
        }
    }
}

static void shrink(const struct LoraPool *pool, const float *x, int64_t slot, float *shrunk)
{
    const int64_t in = pool->in_features, parts = pool->parts, slots = pool->slots, rank = pool->max_rank;
    if (rank % LANES) { /* a rank-wide multiply-add per input feature and part */
        memset(shrunk, 0, sizeof *shrunk * (size_t)(parts * rank));
        for (int64_t k = 0; k < in; k++)
            for (int64_t p = 0; p < parts; p++)
                axpy(shrunk + p * rank, x[k], (const char *)pool->a + (((k * parts + p) * slots + slot) * rank) * dtype_size(pool->dtype),
                     pool->dtype, rank);
        return;
    }
#define SHRINK(PARTS, DTYPE) shrink_lanes(PARTS, DTYPE, x, pool->a, in, slots, slot, rank, shrunk)
#define BY_DTYPE(PARTS)                                                   \
    switch (pool->dtype) {                                                \
    case DTYPE_FLOAT32: SHRINK(PARTS, DTYPE_FLOAT32); break;              \
    case DTYPE_BFLOAT16: SHRINK(PARTS, DTYPE_BFLOAT16); break;            \
    default: SHRINK(PARTS, DTYPE_FLOAT16);                                \
    }
    switch (parts) {
    case 1: BY_DTYPE(1) break;
    case 2: BY_DTYPE(2) break;
    default: BY_DTYPE(3)
    }
#undef BY_DTYPE
#undef SHRINK
}

/* out[j] += sum_r shrunk[r] b[r][j] for j < n, b's rows `stride` bytes apart: each output vector
 * is read and written once for all ranks. */
static inline __attribute__((always_inline)) void expand_lanes(
    float *out, const float *shrunk, const char *b, int64_t stride, const int dtype, int64_t rank, int64_t n)
{
    const size_t item = dtype_size(dtype);
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) {
        vfloat acc;
        memcpy(&acc, out + j, sizeof acc);
        for (int64_t r = 0; r < rank; r++) acc += shrunk[r] * load_lanes(b + r * stride + j * item, dtype);
        memcpy(out + j, &acc, sizeof acc);
    }
    for (; j < n; j++)
        for (int64_t r = 0; r < rank; r++) {
            float value;
            load_row(b + r * stride + j * item, dtype, &value, 1);
            out[j] += shrunk[r] * value;
        }
}

static void expand(float *out, const float *shrunk, const char *b, int64_t stride, int dtype, int64_t rank, int64_t n)
{
    switch (dtype) {
    case DTYPE_FLOAT32: expand_lanes(out, shrunk, b, stride, DTYPE_FLOAT32, rank, n); break;
    case DTYPE_BFLOAT16: expand_lanes(out, shrunk, b, stride, DTYPE_BFLOAT16, rank, n); break;
    default: expand_lanes(out, shrunk, b, stride, DTYPE_FLOAT16, rank, n);
    }
}

int lora_add(const struct LoraPool *pool, const void *x, int x_dtype, int64_t tokens, const int64_t *token_slots,
             void *y, int y_dtype, int num_threads)
{
    const int64_t in = pool->in_features, parts = pool->parts, rank = pool->max_rank;
    int64_t out_features = 0, widest = in;
    for (int p = 0; p < parts; p++) {
        out_features += pool->rows[p];
        if (pool->rows[p] > widest) widest = pool->rows[p];
    }
    const size_t w_item = dtype_size(pool->dtype), x_item = dtype_size(x_dtype), y_item = dtype_size(y_dtype);
    const char *b = pool->b;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* This thread's token as float32, an output row, its shrunk values per part and rank. */
        float *row = malloc(sizeof *row * (size_t)(in + widest + parts * rank));
        if (!row) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++) {
            const int64_t slot = token_slots[t];
            if (!row || slot < 0) continue;
            float *out = row + in, *shrunk = out + widest;
            load_row((const char *)x + t * in * x_item, x_dtype, row, (int)in);
            shrink(pool, row, slot, shrunk);
            char *y_row = (char *)y + t * out_features * y_item;
            int64_t column = 0;
            for (int p = 0; p < parts; p++) {
                const int64_t rows = pool->rows[p];
                load_row(y_row + column * y_item, y_dtype, out, (int)rows);
                expand(out, shrunk + p * rank, b + (slot * rank * out_features + column) * w_item, out_features * w_item,
                       pool->dtype, rank, rows);
                store_row(out, y_dtype, y_row + column * y_item, (int)rows);
                column += rows;
            }
        }
        free(row);
    }
    return failed ? LORA_NO_MEMORY : LORA_OK;
}

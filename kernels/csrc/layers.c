/* The elementwise parts of a decoder layer on the CPU, fused so each reads and writes its
 * tensors once: RMSNorm with the residual add before it, rotary embedding in place, and the
 * SwiGLU activation. Arithmetic is float32; where the torch code (worker/llama.py) rounds an
 * intermediate to the model dtype, these round it too, so both agree to the last ulp or so. */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "vector_math.h"

/* Below this many elements a call runs on one thread: waking the others costs more. */
enum { PARALLEL_MIN_ELEMENTS = 1 << 16 };

/* For each of `rows` rows of `width`: when `residual` is given, residual = x + residual
 * (rounded to dtype, written in place) and that sum is normalised; out = weight * norm(sum). */
void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int width, int dtype,
              float eps, int num_threads)
{
    const size_t item = dtype_size(dtype);
#pragma omp parallel for num_threads(num_threads) if (rows * width >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float sum[width], w[width];
        load_row((const char *)x + r * width * item, dtype, sum, width);
        if (residual) {
            char *res = (char *)residual + r * width * item;
            float previous[width];
            load_row(res, dtype, previous, width);
            for (int i = 0; i < width; i++) sum[i] += previous[i];
            round_row(sum, dtype, width);
            store_row(sum, dtype, res, width);
        }
        float squares = 0.f;
#pragma omp simd reduction(+ : squares)
        for (int i = 0; i < width; i++) squares += sum[i] * sum[i];
        const float inverse_rms = 1.f / sqrtf(squares / width + eps);
        for (int i = 0; i < width; i++) sum[i] *= inverse_rms;
        round_row(sum, dtype, width);
        load_row(weight, dtype, w, width);
        for (int i = 0; i < width; i++) sum[i] *= w[i];
        store_row(sum, dtype, (char *)out + r * width * item, width);
    }
}

/* Rotates, in place, `heads` consecutive heads of each of `rows` rows (row r starts at
 * x + r * row_stride elements): dimension i pairs with i + head_dim / 2, by the angles whose
 * float32 cosines and sines are cos[r], sin[r] ([rows, head_dim / 2]). */
void rotary_embedding(void *x, int64_t row_stride, int64_t rows, int heads, int head_dim, int dtype,
                      const float *cos, const float *sin, int num_threads)
{
    const size_t item = dtype_size(dtype);
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (rows * heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * half, *s = sin + r * half;
        for (int h = 0; h < heads; h++) {
            char *head = (char *)x + (r * row_stride + (int64_t)h * head_dim) * item;
            float first[half], second[half], rotated_first[half], rotated_second[half];
            load_row(head, dtype, first, half);
            load_row(head + half * item, dtype, second, half);
            for (int i = 0; i < half; i++) {
                rotated_first[i] = first[i] * c[i] - second[i] * s[i];
                rotated_second[i] = second[i] * c[i] + first[i] * s[i];
            }
            store_row(rotated_first, dtype, head, half);
            store_row(rotated_second, dtype, head + half * item, half);
        }
    }
}

/* out[r] = silu(gate) * up for each row r of gate_up = [gate (width) | up (width)]; silu(g) is
 * rounded to dtype before the product, as in the torch code. */
void silu_and_mul(const void *gate_up, void *out, int64_t rows, int width, int dtype, int num_threads)
{
    const size_t item = dtype_size(dtype);
    const int padded = (width + LANES - 1) / LANES * LANES;
#pragma omp parallel for num_threads(num_threads) if (rows * width >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float gate[padded], up[width];
        const char *row = (const char *)gate_up + r * 2 * width * item;
        load_row(row, dtype, gate, width);
        load_row(row + width * item, dtype, up, width);
        for (int i = width; i < padded; i++) gate[i] = 0.f;
        for (int i = 0; i < padded; i += LANES) {
            vfloat g;
            memcpy(&g, gate + i, sizeof g);
            g = g / (1.f + exp_lanes(-g));
            memcpy(gate + i, &g, sizeof g);
        }
        round_row(gate, dtype, width);
        for (int i = 0; i < width; i++) gate[i] *= up[i];
        store_row(gate, dtype, (char *)out + r * width * item, width);
    }
}

/* A conversion streams memory once; below this many elements one thread keeps up with it and
 * waking the others costs more (far more on a machine whose cores are busy). */
enum { CONVERT_PARALLEL_MIN_ELEMENTS = 1 << 20, CONVERT_CHUNK = 4096 };

/* dst[0..n) = src[0..n) converted from `src_dtype` to `dst_dtype`, rounded to nearest even as
 * torch rounds. */
void convert(const void *src, int src_dtype, void *dst, int dst_dtype, int64_t n, int num_threads)
{
    const size_t src_item = dtype_size(src_dtype), dst_item = dtype_size(dst_dtype);
    const int64_t chunks = (n + CONVERT_CHUNK - 1) / CONVERT_CHUNK;
#pragma omp parallel for num_threads(num_threads) if (n >= CONVERT_PARALLEL_MIN_ELEMENTS)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t start = c * CONVERT_CHUNK;
        const int count = (int)(n - start < CONVERT_CHUNK ? n - start : CONVERT_CHUNK);
        float values[CONVERT_CHUNK];
        load_row((const char *)src + start * src_item, src_dtype, values, count);
        store_row(values, dst_dtype, (char *)dst + start * dst_item, count);
    }
}

/* The index of the first largest of `cols` float32 values, a NaN counting as larger than any
 * number (torch's max(dim).indices): each lane keeps its first largest value and where it was,
 * then the lanes holding the largest give the earliest of their positions. */
static int64_t first_largest(const float *row, int64_t cols)
{
    float largest = -INFINITY;
    int64_t at = 0, i = 0;
    vint any_nan = {0};
    if (cols >= LANES) {
        vfloat best = (vfloat){0} - INFINITY;
        vint best_at = LANE_INDEX;
        for (; i + LANES <= cols; i += LANES) {
            vfloat v;
            memcpy(&v, row + i, sizeof v);
            const vint greater = v > best;
            any_nan |= v != v;
            best = select_lanes(greater, v, best);
            best_at = (((int32_t)i + LANE_INDEX) & greater) | (best_at & ~greater);
        }
        largest = max_of_lanes(best);
        at = cols;
        for (int l = 0; l < LANES; l++)
            if (best[l] == largest && best_at[l] < at) at = best_at[l];
    }
    int nan = 0;
    for (int l = 0; l < LANES; l++) nan |= any_nan[l] != 0;
    for (; i < cols; i++) {
        nan |= row[i] != row[i];
        if (row[i] > largest) {
            largest = row[i];
            at = i;
        }
    }
    for (int64_t j = 0; nan && j < cols; j++)
        if (row[j] != row[j]) return j;
    return at;
}

/* out[r] = the index of the first largest value of row r of x (float32 [rows, cols]): greedy
 * sampling's pick, in a few microseconds for a vocabulary's logits where torch's reduction with
 * indices takes tens. */
void argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) out[r] = first_largest(x + r * cols, cols);
}

/* The elementwise parts of a decoder layer on the CPU, fused so each reads and writes its
 * tensors once: RMSNorm with the residual add before it, rotary embedding in place, and the
 * SwiGLU activation. Arithmetic is float32; where the torch code (worker/llama.py) rounds an
 * intermediate to the model dtype, these round it too, so both agree to the last ulp or so. */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "vector_math.h"

/* Below this many elements a call runs on the calling thread alone: waking the others costs
 * more. Each kernel's loop over rows then runs on the calling thread outside any parallel region,
 * not in a region whose `if` clause is false: such a serialized region still sets up a
 * team, 0.7-1.0 us more than the bare loop once a decoder layer's weights have passed through the
 * caches (a one-row norm 1.3 against 0.3 us, EPYC-Zen4), and a one-row decode step of the
 * default model made about 270 such calls (norms, rotary, SwiGLU, KV writes, activations
 * quantized for the GGUF linears). */
enum { PARALLEL_MIN_ELEMENTS = 1 << 16 };

/* Lanes [16 * c, 16 * c + 16) of a row of `width` hold this many of its elements. */
static inline int lanes_in(int c, int width) { return width - c * LANES < LANES ? width - c * LANES : LANES; }

/* Runs `row_call(DTYPE)` with DTYPE the constant equal to `dtype`: each dtype's loop is compiled
 * on its own, without the others' branches in it (64 bfloat16 rows: rms_norm 20.4 -> 19.1 us,
 * silu_and_mul 60.6 -> 58.9, one thread, Xeon-AMX). */
#define FOR_DTYPE(dtype, row_call)                                                                                   \
    do {                                                                                                             \
        if ((dtype) == DTYPE_BFLOAT16)                                                                               \
            row_call(DTYPE_BFLOAT16);                                                                                \
        else if ((dtype) == DTYPE_FLOAT16)                                                                           \
            row_call(DTYPE_FLOAT16);                                                                                 \
        else                                                                                                         \
            row_call(DTYPE_FLOAT32);                                                                                 \
    } while (0)

#if defined(VECTORS_ARE_AVX2_PAIRS)
/* The rows below in AVX2's own registers, for float32: GCC moved the 16-lane vectors of the
 * portable rows through the stack 16 bytes at a time. Each computes the portable row's bits.
 * Lanes [0, n) of 8 (n < 8 on a row's last, partial 8), the others zero. */
static inline __m256i avx2_first_lanes(int n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline __m256 avx2_load_first(const float *src, int n)
{
    return n >= 8 ? _mm256_loadu_ps(src) : _mm256_maskload_ps(src, avx2_first_lanes(n));
}

static inline void avx2_store_first(float *dst, __m256 value, int n)
{
    if (n >= 8)
        _mm256_storeu_ps(dst, value);
    else
        _mm256_maskstore_ps(dst, avx2_first_lanes(n), value);
}

/* rms_norm_row's float32 row: each half of every 16 elements sums its squares in its own lanes,
 * as the 16-lane sum's lanes do, and the lanes are added in sum_of_lanes' order. 64 rows of 576
 * on one thread of EPYC-AVX2: 65-82 -> 26-37 us. */
static inline void avx2_rms_norm_row(
    const float *x, float *residual, const float *w, float *out, int width, float eps)
{
    __m256 squares[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < width; i += 8) {
        __m256 sum = avx2_load_first(x + i, width - i);
        if (residual) {
            sum = _mm256_add_ps(sum, avx2_load_first(residual + i, width - i));
            avx2_store_first(residual + i, sum, width - i);
        }
        squares[i / 8 % 2] = _mm256_fmadd_ps(sum, sum, squares[i / 8 % 2]);
    }
    __m256 total = _mm256_add_ps(squares[0], squares[1]); /* lane i: lanes i and i + 8 */
    total = _mm256_add_ps(total, _mm256_permute2f128_ps(total, total, 1));
    total = _mm256_add_ps(total, _mm256_permute_ps(total, 0x4e));
    total = _mm256_add_ps(total, _mm256_permute_ps(total, 0xb1));
    const __m256 inverse_rms = _mm256_set1_ps(1.f / sqrtf(_mm256_cvtss_f32(total) / width + eps));
    const float *sums = residual ? residual : x;
    for (int i = 0; i < width; i += 8) {
        const __m256 normed = _mm256_mul_ps(avx2_load_first(sums + i, width - i), inverse_rms);
        avx2_store_first(out + i, _mm256_mul_ps(normed, avx2_load_first(w + i, width - i)), width - i);
    }
}
#endif

/* One row of rms_norm: its `chunks` vectors of `width` elements at x, residual (or NULL), out. */
static inline __attribute__((always_inline)) void rms_norm_row(
    const char *x, char *residual, const vfloat w[], char *out, int width, int chunks, float eps, const int dtype)
{
    const size_t item = dtype_size(dtype);
    vfloat sum[chunks], squares = {0};
    for (int c = 0; c < chunks; c++) {
        const int64_t at = c * LANES * item;
        sum[c] = load_first_lanes(x + at, dtype, lanes_in(c, width));
        if (residual) {
            sum[c] = round_lanes(sum[c] + load_first_lanes(residual + at, dtype, lanes_in(c, width)), dtype);
            store_first_lanes(sum[c], dtype, residual + at, lanes_in(c, width));
        }
        squares += sum[c] * sum[c];
    }
    const float inverse_rms = 1.f / sqrtf(sum_of_lanes(squares) / width + eps);
    for (int c = 0; c < chunks; c++)
        store_first_lanes(round_lanes(sum[c] * inverse_rms, dtype) * w[c], dtype, out + c * LANES * item,
                          lanes_in(c, width));
}

/* rms_norm's rows: shared among the threads of the region it is called in (`shared`; all on the
 * caller outside any region), or all on the calling thread (not `shared`). */
void rms_norm_rows(const void *x, void *residual, const void *weight, void *out, int64_t rows, int width,
                   int dtype, float eps, int shared)
{
    const size_t item = dtype_size(dtype);
    const int chunks = (width + LANES - 1) / LANES;
#if defined(VECTORS_ARE_AVX2_PAIRS)
    if (dtype == DTYPE_FLOAT32) { /* its rows read the weight in place */
#define AVX2_RMS_NORM_ROW(r)                                                                                  \
    avx2_rms_norm_row((const float *)x + (r) * width, residual ? (float *)residual + (r) * width : NULL, \
                      (const float *)weight, (float *)out + (r) * width, width, eps)
        if (shared) {
#pragma omp for
            for (int64_t r = 0; r < rows; r++) AVX2_RMS_NORM_ROW(r);
        } else {
            for (int64_t r = 0; r < rows; r++) AVX2_RMS_NORM_ROW(r);
        }
#undef AVX2_RMS_NORM_ROW
        return;
    }
#endif
    vfloat w[chunks];
    for (int c = 0; c < chunks; c++)
        w[c] = load_first_lanes((const char *)weight + c * LANES * item, dtype, lanes_in(c, width));
#define RMS_NORM_ROW(DTYPE)                                                                                        \
    rms_norm_row((const char *)x + row, residual ? (char *)residual + row : NULL, w, (char *)out + row, width, \
                 chunks, eps, DTYPE)
    if (shared) {
#pragma omp for
        for (int64_t r = 0; r < rows; r++) {
            const int64_t row = r * width * item;
            FOR_DTYPE(dtype, RMS_NORM_ROW);
        }
    } else {
        for (int64_t r = 0; r < rows; r++) {
            const int64_t row = r * width * item;
            FOR_DTYPE(dtype, RMS_NORM_ROW);
        }
    }
#undef RMS_NORM_ROW
}

/* For each of `rows` rows of `width`: when `residual` is given, residual = x + residual
 * (rounded to dtype, written in place) and that sum is normalised; out = weight * norm(sum). */
void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int width, int dtype,
              float eps, int num_threads)
{
    if (rows * width < PARALLEL_MIN_ELEMENTS) {
        rms_norm_rows(x, residual, weight, out, rows, width, dtype, eps, 0);
        return;
    }
#pragma omp parallel num_threads(num_threads)
    rms_norm_rows(x, residual, weight, out, rows, width, dtype, eps, 1);
}

/* One row of rotary_embedding: `heads` heads from `row`, by the row's angles (cos, sin: head_dim / 2 each). */
static inline __attribute__((always_inline)) void rotary_row(
    char *row, int heads, int head_dim, const float *cos, const float *sin, const int dtype)
{
    const size_t item = dtype_size(dtype);
    const int half = head_dim / 2, chunks = (half + LANES - 1) / LANES;
    for (int c = 0; c < chunks; c++) {
        const int n = lanes_in(c, half);
        const vfloat cosine = load_first_lanes((const char *)(cos + c * LANES), DTYPE_FLOAT32, n);
        const vfloat sine = load_first_lanes((const char *)(sin + c * LANES), DTYPE_FLOAT32, n);
        for (int h = 0; h < heads; h++) {
            char *first = row + ((int64_t)h * head_dim + c * LANES) * item, *second = first + half * item;
            const vfloat a = load_first_lanes(first, dtype, n), b = load_first_lanes(second, dtype, n);
            store_first_lanes(a * cosine - b * sine, dtype, first, n);
            store_first_lanes(b * cosine + a * sine, dtype, second, n);
        }
    }
}

/* rotary_embedding's rows: shared among the threads of the region it is called in (`shared`; all
 * on the caller outside any region), or all on the calling thread (not `shared`). */
void rotary_rows(void *x, int64_t row_stride, int64_t rows, int heads, int head_dim, int dtype, const float *cos,
                 const float *sin, int shared)
{
    const size_t item = dtype_size(dtype);
    const int half = head_dim / 2;
#define ROTARY_ROW(DTYPE)                                                                                            \
    rotary_row((char *)x + r * row_stride * item, heads, head_dim, cos + r * half, sin + r * half, DTYPE)
    if (shared) {
#pragma omp for
        for (int64_t r = 0; r < rows; r++) FOR_DTYPE(dtype, ROTARY_ROW);
    } else {
        for (int64_t r = 0; r < rows; r++) FOR_DTYPE(dtype, ROTARY_ROW);
    }
#undef ROTARY_ROW
}

/* Rotates, in place, `heads` consecutive heads of each of `rows` rows (row r starts at
 * x + r * row_stride elements): dimension i pairs with i + head_dim / 2, by the angles whose
 * float32 cosines and sines are cos[r], sin[r] ([rows, head_dim / 2]). */
void rotary_embedding(void *x, int64_t row_stride, int64_t rows, int heads, int head_dim, int dtype,
                      const float *cos, const float *sin, int num_threads)
{
    if (rows * heads * head_dim < PARALLEL_MIN_ELEMENTS) {
        rotary_rows(x, row_stride, rows, heads, head_dim, dtype, cos, sin, 0);
        return;
    }
#pragma omp parallel num_threads(num_threads)
    rotary_rows(x, row_stride, rows, heads, head_dim, dtype, cos, sin, 1);
}

/* One row of silu_and_mul: `width` gates at `gate`, as many ups at `up`. */
static inline __attribute__((always_inline)) void silu_and_mul_row(
    const char *gate, const char *up, char *out, int width, const int dtype)
{
    const size_t item = dtype_size(dtype);
    for (int c = 0; c < (width + LANES - 1) / LANES; c++) {
        const int n = lanes_in(c, width);
        const vfloat g = load_first_lanes(gate + c * LANES * item, dtype, n);
        store_first_lanes(swiglu_lanes(g, load_first_lanes(up + c * LANES * item, dtype, n), dtype), dtype,
                          out + c * LANES * item, n);
    }
}

#if defined(VECTORS_ARE_AVX2_PAIRS)
/* silu_and_mul_row's float32 row (64 rows of 1,536 on one thread of EPYC-AVX2: 247 -> 67 us):
 * exp8 is exp_lanes' AVX2 body, and the sum, division and product round as swiglu_lanes' do. */
static inline void avx2_silu_and_mul_row(const float *gate, const float *up, float *out, int width)
{
    for (int i = 0; i < width; i += 8) {
        const __m256 g = avx2_load_first(gate + i, width - i);
        const __m256 negated = _mm256_xor_ps(g, _mm256_set1_ps(-0.f));
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(negated)));
        avx2_store_first(out + i, _mm256_mul_ps(silu, avx2_load_first(up + i, width - i)), width - i);
    }
}
#endif

/* Row r of silu_and_mul, in its dtype's own loop. */
static inline void silu_and_mul_at(const void *gate_up, void *out, int64_t r, int width, int dtype)
{
    const size_t item = dtype_size(dtype);
    const char *gate = (const char *)gate_up + r * 2 * width * item;
#if defined(VECTORS_ARE_AVX2_PAIRS)
    if (dtype == DTYPE_FLOAT32) {
        avx2_silu_and_mul_row((const float *)gate, (const float *)gate + width, (float *)out + r * width, width);
        return;
    }
#endif
#define SILU_AND_MUL_ROW(DTYPE)                                                                                      \
    silu_and_mul_row(gate, gate + width * item, (char *)out + r * width * item, width, DTYPE)
    FOR_DTYPE(dtype, SILU_AND_MUL_ROW);
#undef SILU_AND_MUL_ROW
}

/* silu_and_mul's rows: shared among the threads of the region it is called in (`shared`), or all
 * on the calling thread (not `shared`). */
void silu_and_mul_rows(const void *gate_up, void *out, int64_t rows, int width, int dtype, int shared)
{
    if (shared) {
#pragma omp for
        for (int64_t r = 0; r < rows; r++) silu_and_mul_at(gate_up, out, r, width, dtype);
    } else {
        for (int64_t r = 0; r < rows; r++) silu_and_mul_at(gate_up, out, r, width, dtype);
    }
}

/* out[r] = silu(gate) * up for each row r of gate_up = [gate (width) | up (width)]; silu(g) is
 * rounded to dtype before the product, as in the torch code. */
void silu_and_mul(const void *gate_up, void *out, int64_t rows, int width, int dtype, int num_threads)
{
    if (rows * width < PARALLEL_MIN_ELEMENTS) {
        silu_and_mul_rows(gate_up, out, rows, width, dtype, 0);
        return;
    }
#pragma omp parallel num_threads(num_threads)
    silu_and_mul_rows(gate_up, out, rows, width, dtype, 1);
}

/* A conversion streams memory once; below this many elements one thread keeps up with it and
 * waking the others costs more (far more on a machine whose cores are busy). */
enum { CONVERT_PARALLEL_MIN_ELEMENTS = 1 << 20, CONVERT_CHUNK = 4096 };

/* convert's chunks, shared among the threads of the region it is called in. */
static void convert_chunks(const char *src, int src_dtype, char *dst, int dst_dtype, int64_t n)
{
    const size_t src_item = dtype_size(src_dtype), dst_item = dtype_size(dst_dtype);
    const int64_t chunks = (n + CONVERT_CHUNK - 1) / CONVERT_CHUNK;
#pragma omp for
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t start = c * CONVERT_CHUNK;
        const int count = (int)(n - start < CONVERT_CHUNK ? n - start : CONVERT_CHUNK);
        float values[CONVERT_CHUNK];
        load_row(src + start * src_item, src_dtype, values, count);
        store_row(values, dst_dtype, dst + start * dst_item, count);
    }
}

/* dst[0..n) = src[0..n) converted from `src_dtype` to `dst_dtype`, rounded to nearest even as
 * torch rounds. */
void convert(const void *src, int src_dtype, void *dst, int dst_dtype, int64_t n, int num_threads)
{
    if (n < CONVERT_PARALLEL_MIN_ELEMENTS) {
        convert_chunks(src, src_dtype, dst, dst_dtype, n);
        return;
    }
#pragma omp parallel num_threads(num_threads)
    convert_chunks(src, src_dtype, dst, dst_dtype, n);
}

/* Over the first cols / 16 * 16 of `cols` float32 values taken 16 at a time, lane l's first
 * largest value (best[l]) and where it was (best_at[l]); returns whether any was a NaN. */
static int lane_bests(const float *row, int64_t cols, float best[LANES], int32_t best_at[LANES])
{
#if defined(VECTORS_ARE_AVX2_PAIRS)
    /* In AVX2's own registers: GCC compared and selected the 16-lane vectors below a lane at a
     * time (a 49,152-token vocabulary's pick took 248 us on EPYC-AVX2). */
    __m256 bests[2], nan = _mm256_setzero_ps();
    __m256i at[2], here[2];
    for (int h = 0; h < 2; h++) {
        bests[h] = _mm256_set1_ps(-INFINITY);
        at[h] = here[h] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * h));
    }
    for (int64_t i = 0; i + LANES <= cols; i += LANES)
        for (int h = 0; h < 2; h++) {
            const __m256 v = _mm256_loadu_ps(row + i + 8 * h);
            const __m256 greater = _mm256_cmp_ps(v, bests[h], _CMP_GT_OQ);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            bests[h] = _mm256_blendv_ps(bests[h], v, greater);
            at[h] = _mm256_castps_si256(
                _mm256_blendv_ps(_mm256_castsi256_ps(at[h]), _mm256_castsi256_ps(here[h]), greater));
            here[h] = _mm256_add_epi32(here[h], _mm256_set1_epi32(LANES));
        }
    memcpy(best, bests, sizeof bests);
    memcpy(best_at, at, sizeof at);
    return _mm256_movemask_ps(nan) != 0;
#else
    vfloat lanes_best = (vfloat){0} - INFINITY;
    vint lanes_at = LANE_INDEX, any_nan = {0};
    for (int64_t i = 0; i + LANES <= cols; i += LANES) {
        vfloat v;
        memcpy(&v, row + i, sizeof v);
        const vint greater = v > lanes_best;
        any_nan |= v != v;
        lanes_best = select_lanes(greater, v, lanes_best);
        lanes_at = (((int32_t)i + LANE_INDEX) & greater) | (lanes_at & ~greater);
    }
    memcpy(best, &lanes_best, sizeof lanes_best);
    memcpy(best_at, &lanes_at, sizeof lanes_at);
    int nan = 0;
    for (int l = 0; l < LANES; l++) nan |= any_nan[l] != 0;
    return nan;
#endif
}

/* The index of the first largest of `cols` float32 values, a NaN counting as larger than any
 * number (torch's max(dim).indices): each lane keeps its first largest value and where it was,
 * then the lanes holding the largest give the earliest of their positions. */
static int64_t first_largest(const float *row, int64_t cols)
{
    float largest = -INFINITY;
    int64_t at = 0;
    int nan = 0;
    if (cols >= LANES) {
        float best[LANES];
        int32_t best_at[LANES];
        nan = lane_bests(row, cols, best, best_at);
        for (int l = 0; l < LANES; l++) largest = best[l] > largest ? best[l] : largest;
        at = cols;
        for (int l = 0; l < LANES; l++)
            if (best[l] == largest && best_at[l] < at) at = best_at[l];
    }
    for (int64_t i = cols / LANES * LANES; i < cols; i++) {
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
    if (rows * cols < PARALLEL_MIN_ELEMENTS) {
        for (int64_t r = 0; r < rows; r++) out[r] = first_largest(x + r * cols, cols);
        return;
    }
#pragma omp parallel for num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) out[r] = first_largest(x + r * cols, cols);
}

/* Tensor element types the CPU kernels read and write; arithmetic is always float32. The codes
 * match kernels/native.py's DTYPE_CODES. */
#pragma once
#include <stdint.h>
#include <string.h>

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1, DTYPE_FLOAT16 = 2 };

static inline size_t dtype_size(int dtype) { return dtype == DTYPE_FLOAT32 ? 4 : 2; }

static inline float bfloat16_to_float(uint16_t bits)
{
    uint32_t widened = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &widened, sizeof value);
    return value;
}

/* Round to nearest even, as torch does; NaN stays NaN. Branch-free so that loops vectorise. */
static inline uint16_t float_to_bfloat16(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16, quiet_nan = (bits >> 16) | 0x40u;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/* *out = value rounded to `dtype`. */
static inline void store_float(char *out, int dtype, float value)
{
    if (dtype == DTYPE_FLOAT32) {
        memcpy(out, &value, sizeof value);
    } else if (dtype == DTYPE_BFLOAT16) {
        const uint16_t bits = float_to_bfloat16(value);
        memcpy(out, &bits, sizeof bits);
    } else {
        const _Float16 half = (_Float16)value;
        memcpy(out, &half, sizeof half);
    }
}

/* dst[0..n) = src[0..n) as float32. */
static inline void load_row(const void *src, int dtype, float *dst, int n)
{
    if (dtype == DTYPE_FLOAT32) {
        memcpy(dst, src, n * sizeof(float));
    } else if (dtype == DTYPE_BFLOAT16) {
        const uint16_t *bits = src;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = bfloat16_to_float(bits[i]);
    } else {
        const _Float16 *half = src;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = (float)half[i];
    }
}

/* dst[0..n) = src[0..n) converted to `dtype`. */
static inline void store_row(const float *src, int dtype, void *dst, int n)
{
    if (dtype == DTYPE_FLOAT32) {
        memcpy(dst, src, n * sizeof(float));
    } else if (dtype == DTYPE_BFLOAT16) {
        uint16_t *bits = dst;
#pragma omp simd
        for (int i = 0; i < n; i++) bits[i] = float_to_bfloat16(src[i]);
    } else {
        _Float16 *half = dst;
#pragma omp simd
        for (int i = 0; i < n; i++) half[i] = (_Float16)src[i];
    }
}


/* v[0..n) rounded to `dtype` and back, as storing and reloading it would. */
static inline void round_row(float *v, int dtype, int n)
{
    if (dtype == DTYPE_BFLOAT16) {
#pragma omp simd
        for (int i = 0; i < n; i++) v[i] = bfloat16_to_float(float_to_bfloat16(v[i]));
    } else if (dtype == DTYPE_FLOAT16) {
#pragma omp simd
        for (int i = 0; i < n; i++) v[i] = (float)(_Float16)v[i];
    }
}

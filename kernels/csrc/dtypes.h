/* Tensor element types the CPU kernels read and write; arithmetic is always float32. The codes
 * match kernels/native.py's DTYPE_CODES. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

/* FLOAT8_E4M3 (torch.float8_e4m3fn: 4 exponent bits, 3 mantissa bits, no infinities, 0x7f and
 * 0xff NaN) is a KV-cache dtype only: the kernels never take activations in it. */
enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1, DTYPE_FLOAT16 = 2, DTYPE_FLOAT8_E4M3 = 3 };

static inline size_t dtype_size(int dtype)
{
    return dtype == DTYPE_FLOAT32 ? 4 : dtype == DTYPE_FLOAT8_E4M3 ? 1 : 2;
}

enum { FLOAT8_E4M3_NAN = 0x7f };
#define FLOAT8_E4M3_MAX 448.f

/* An e4m3 code's magnitude bits shifted into a float16's are that float16 scaled by 2^-8 (the
 * two exponent biases differ by 8), subnormals included. */
static inline uint16_t float8_e4m3_as_scaled_half(uint16_t code)
{
    return (uint16_t)((code & 0x7fu) << 7 | (code & 0x80u) << 8);
}

static inline float float8_e4m3_to_float(uint8_t code)
{
    const uint16_t bits = float8_e4m3_as_scaled_half(code);
    _Float16 half;
    memcpy(&half, &bits, sizeof half);
    return (code & 0x7fu) == FLOAT8_E4M3_NAN ? NAN : (float)half * 256.f;
}

/* Round to nearest even and saturate at +-448 (infinities included), as torch does; NaN stays
 * NaN. */
static inline uint8_t float_to_float8_e4m3(float value)
{
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint8_t sign = (uint8_t)(bits >> 24 & 0x80u);
    const uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return sign | FLOAT8_E4M3_NAN;
    const float absolute = fabsf(value);
    if (absolute >= FLOAT8_E4M3_MAX) return sign | (FLOAT8_E4M3_NAN - 1);
    if (absolute < 0x1p-6f) return sign | (uint8_t)nearbyintf(absolute * 512.f); /* multiples of 2^-9 */
    /* Keep 3 of float32's 23 mantissa bits, rounding half to even; a carry moves the exponent. */
    const uint32_t kept = (magnitude + 0x7ffffu + (magnitude >> 20 & 1u)) >> 20;
    const uint32_t code = kept - ((127u - 7u) << 3);
    return sign | (uint8_t)(code < FLOAT8_E4M3_NAN ? code : FLOAT8_E4M3_NAN - 1);
}

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
    } else if (dtype == DTYPE_FLOAT8_E4M3) {
        *(uint8_t *)out = float_to_float8_e4m3(value);
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
    } else if (dtype == DTYPE_FLOAT8_E4M3) {
        const uint8_t *codes = src;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = float8_e4m3_to_float(codes[i]);
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
    } else if (dtype == DTYPE_FLOAT8_E4M3) {
        uint8_t *codes = dst;
        for (int i = 0; i < n; i++) codes[i] = float_to_float8_e4m3(src[i]);
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

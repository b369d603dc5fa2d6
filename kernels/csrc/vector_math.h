/* 16-lane float32 vectors (GCC vector extensions: AVX-512 registers where the CPU has them,
 * pairs of AVX2 registers or scalar code elsewhere) and the lane-wise math the kernels share. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dtypes.h"

enum { LANES = 16 };

typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint16_t vhalfbits __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t vbits __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef _Float16 vhalf __attribute__((vector_size(LANES * sizeof(_Float16))));

/* 16 consecutive elements of `dtype` at `src`, as float32. */
static inline vfloat load_lanes(const char *src, int dtype)
{
    vfloat result;
    if (dtype == DTYPE_FLOAT32) {
        memcpy(&result, src, sizeof result);
    } else if (dtype == DTYPE_BFLOAT16) {
        vhalfbits bits;
        memcpy(&bits, src, sizeof bits);
        vbits widened = __builtin_convertvector(bits, vbits) << 16;
        memcpy(&result, &widened, sizeof result);
    } else {
        vhalf half;
        memcpy(&half, src, sizeof half);
        result = __builtin_convertvector(half, vfloat);
    }
    return result;
}

static const vint LANE_INDEX = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* Lane by lane: `mask` (all ones or zero, as vector comparisons give) ? a : b. */
static inline vfloat select_lanes(vint mask, vfloat a, vfloat b)
{
    vint a_bits, b_bits;
    memcpy(&a_bits, &a, sizeof a);
    memcpy(&b_bits, &b, sizeof b);
    vint chosen = (a_bits & mask) | (b_bits & ~mask);
    vfloat result;
    memcpy(&result, &chosen, sizeof result);
    return result;
}

/* e^x lane by lane to about 2 ulp, 0 below the float range (-inf included); libm's expf
 * would not vectorise without -ffast-math. */
static inline vfloat exp_lanes(vfloat x)
{
    const vfloat low = (vfloat){0} - 87.f, high = (vfloat){0} + 88.f, round = (vfloat){0} + 12582912.f;
    const vint underflow = x < low;
    vfloat clamped = select_lanes(underflow, low, select_lanes(x > high, high, x));
    vfloat n = (clamped * 1.44269504088896341f + round) - round; /* round to nearest: 1.5 * 2^23 trick */
    vfloat r = clamped - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    vfloat poly = (vfloat){0} + 1.f / 5040.f;
    poly = poly * r + 1.f / 720.f;
    poly = poly * r + 1.f / 120.f;
    poly = poly * r + 1.f / 24.f;
    poly = poly * r + 1.f / 6.f;
    poly = poly * r + 0.5f;
    poly = poly * r + 1.f;
    poly = poly * r + 1.f;
    vint scale_bits = (__builtin_convertvector(n, vint) + 127) << 23;
    vfloat scale;
    memcpy(&scale, &scale_bits, sizeof scale);
    return select_lanes(underflow, (vfloat){0}, poly * scale);
}

static inline vfloat swap_halves(vfloat v, int width)
{
    static const vint swapped[] = {
        [8] = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
        [4] = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
        [2] = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
        [1] = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14},
    };
    return __builtin_shuffle(v, swapped[width]);
}

static inline float sum_of_lanes(vfloat v)
{
    for (int width = LANES / 2; width >= 1; width /= 2) v += swap_halves(v, width);
    return v[0];
}

static inline float max_of_lanes(vfloat v)
{
    for (int width = LANES / 2; width >= 1; width /= 2) {
        vfloat other = swap_halves(v, width);
        v = select_lanes(other > v, other, v);
    }
    return v[0];
}


/* 16-lane float32 vectors (GCC vector extensions: AVX-512 registers where the CPU has them,
 * pairs of AVX2 registers or scalar code elsewhere) and the lane-wise math the kernels share. */
#pragma once
#include <math.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
/* Where the 16-lane vectors below are pairs of AVX2 registers: GCC lowers their broadcasts,
 * half-vector shuffles and copies through the stack a lane at a time, so the hot loops that
 * need them have code of their own for such builds. */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define VECTORS_ARE_AVX2_PAIRS 1
#endif
#include <stdint.h>
#include <string.h>

#include "dtypes.h"

enum { LANES = 16 };

typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint16_t vhalfbits __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t vbits __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef _Float16 vhalf __attribute__((vector_size(LANES * sizeof(_Float16))));
typedef uint8_t vcodes __attribute__((vector_size(LANES * sizeof(uint8_t))));

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

#if defined(__AVX2__) && defined(__F16C__)
/* The 16 float8 (e4m3) codes at `src` as float16 bits, each 1/256 of the code's value (float16's
 * exponent bias is 8 more than e4m3's): NaN stays NaN, every other code exact. */
static inline __m256i float8_e4m3_halves(const char *src)
{
    const __m256i wide = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)src));
    const __m256i magnitude = _mm256_and_si256(wide, _mm256_set1_epi16(0x7f));
    const __m256i nan = _mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(FLOAT8_E4M3_NAN));
    return _mm256_or_si256(
        _mm256_or_si256(_mm256_slli_epi16(magnitude, 7), _mm256_slli_epi16(_mm256_xor_si256(wide, magnitude), 8)),
        _mm256_and_si256(nan, _mm256_set1_epi16(0x7e00))); /* a float16 NaN */
}

/* The 16 elements of `dtype` at `src` as float32, in two AVX2 registers: F16C's conversions and
 * whole-register widening, where GCC converts a 16-lane vector of another dtype a lane at a time. */
static inline __attribute__((always_inline)) void avx2_widen_16(const char *src, int dtype, __m256 halves[2])
{
    if (dtype == DTYPE_FLOAT32) {
        halves[0] = _mm256_loadu_ps((const float *)src);
        halves[1] = _mm256_loadu_ps((const float *)src + 8);
    } else if (dtype == DTYPE_FLOAT8_E4M3) {
        const __m256i bits = float8_e4m3_halves(src);
        const __m256 scale = _mm256_set1_ps(256.f);
        halves[0] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(bits)), scale);
        halves[1] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1)), scale);
    } else {
        for (int h = 0; h < 2; h++) {
            const __m128i narrow = _mm_loadu_si128((const __m128i *)(src + 16 * h));
            halves[h] = dtype == DTYPE_FLOAT16
                            ? _mm256_cvtph_ps(narrow)
                            : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(narrow), 16));
        }
    }
}
#endif

/* 16 consecutive elements of `dtype` at `src`, as float32. */
static inline vfloat load_lanes(const char *src, int dtype)
{
    vfloat result;
    if (dtype == DTYPE_FLOAT32) {
        memcpy(&result, src, sizeof result);
        return result;
    }
#if defined(__AVX512F__) && defined(__F16C__)
    if (dtype == DTYPE_BFLOAT16)
        result = (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16);
    else if (dtype == DTYPE_FLOAT8_E4M3) /* float8_e4m3_to_float, 16 codes at once */
        result = (vfloat)_mm512_mul_ps(_mm512_cvtph_ps(float8_e4m3_halves(src)), _mm512_set1_ps(256.f));
    else
        result = (vfloat)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)src));
#elif defined(__AVX2__) && defined(__F16C__)
    __m256 halves[2];
    avx2_widen_16(src, dtype, halves);
    memcpy(&result, halves, sizeof result);
#else
    if (dtype == DTYPE_BFLOAT16) {
        vhalfbits bits;
        memcpy(&bits, src, sizeof bits);
        vbits widened = __builtin_convertvector(bits, vbits) << 16;
        memcpy(&result, &widened, sizeof result);
    } else if (dtype == DTYPE_FLOAT8_E4M3) {
        vcodes codes;
        memcpy(&codes, src, sizeof codes);
        const vhalfbits wide = __builtin_convertvector(codes, vhalfbits);
        const vhalfbits bits = (wide & 0x7f) << 7 | (wide & 0x80) << 8;
        vhalf half;
        memcpy(&half, &bits, sizeof half);
        const vfloat finite = __builtin_convertvector(half, vfloat) * 256.f;
        const vfloat magnitude = select_lanes(finite < 0, -finite, finite);
        result = select_lanes(magnitude == 480.f, (vfloat){0} + NAN, finite);
    } else {
        vhalf half;
        memcpy(&half, src, sizeof half);
        result = __builtin_convertvector(half, vfloat);
    }
#endif
    return result;
}

/* Each lane rounded to bfloat16, to nearest even as torch rounds (a NaN stays a quiet NaN), its
 * bits in the upper half of the word and zeros below. */
static inline vbits bfloat16_words(vfloat value)
{
    vbits bits;
    memcpy(&bits, &value, sizeof bits);
    const vbits rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    const vbits nan = (vbits)((bits & 0x7fffffffu) > 0x7f800000u);
    return (rounded & ~nan) | ((bits | 0x400000u) & 0xffff0000u & nan);
}

#if defined(__AVX512BF16__)
/* bfloat16_words' upper halves, in one conversion instead of about ten integer operations
 * (rms_norm 1.8x faster on Xeon-AMX); the conversion flushes subnormal lanes to zero, so a vector
 * holding one takes the integer operations instead. */
static inline __m256i bfloat16_halves(vfloat value)
{
    enum { SUBNORMAL = 0x20 }; /* vfpclassps's category */
    if (__builtin_expect(!_mm512_fpclass_ps_mask((__m512)value, SUBNORMAL), 1))
        return (__m256i)_mm512_cvtneps_pbh((__m512)value);
    return _mm512_cvtepi32_epi16((__m512i)(bfloat16_words(value) >> 16));
}
#endif

/* `value` rounded to `dtype` (float32, bfloat16 or float16) as float32 lanes, as storing and
 * reloading it would leave it. */
static inline vfloat round_lanes(vfloat value, int dtype)
{
    if (dtype == DTYPE_BFLOAT16) {
#if defined(__AVX512BF16__)
        return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(bfloat16_halves(value)), 16);
#else
        const vbits words = bfloat16_words(value);
        memcpy(&value, &words, sizeof value);
#endif
    } else if (dtype == DTYPE_FLOAT16) {
        value = __builtin_convertvector(__builtin_convertvector(value, vhalf), vfloat);
    }
    return value;
}

/* `value` rounded to `dtype` (float32, bfloat16 or float16) at `out` (16 elements). */
static inline void store_lanes(vfloat value, int dtype, char *out)
{
    if (dtype == DTYPE_FLOAT32) {
        memcpy(out, &value, sizeof value);
    } else if (dtype == DTYPE_BFLOAT16) {
#if defined(__AVX512BF16__)
        _mm256_storeu_si256((__m256i *)out, bfloat16_halves(value));
#else
        const vhalfbits narrowed = __builtin_convertvector(bfloat16_words(value) >> 16, vhalfbits);
        memcpy(out, &narrowed, sizeof narrowed);
#endif
    } else {
        const vhalf narrowed = __builtin_convertvector(value, vhalf);
        memcpy(out, &narrowed, sizeof narrowed);
    }
}

/* dst[0..bytes) = src[0..bytes), bytes < 64, as a masked copy where AVX512BW has one: a call to
 * memcpy anywhere in a loop, even on its last partial vector only, has GCC keep the loop's
 * vectors on the stack through every iteration (rms_norm's running sum of squares went through
 * memory at each step of a row). */
static inline void copy_head(void *dst, const void *src, int bytes)
{
#if defined(__AVX512BW__)
    const __mmask64 mask = (1ull << bytes) - 1;
    _mm512_mask_storeu_epi8(dst, mask, _mm512_maskz_loadu_epi8(mask, src));
#else
    memcpy(dst, src, bytes);
#endif
}

/* The first `n` (<= 16) elements of `dtype` at `src` as float32 lanes, zero past them: the last,
 * partial 16 of a row. */
static inline vfloat load_first_lanes(const char *src, int dtype, int n)
{
    if (n == LANES) return load_lanes(src, dtype);
    char padded[LANES * sizeof(float)] = {0};
    copy_head(padded, src, n * dtype_size(dtype));
    return load_lanes(padded, dtype);
}

/* The first `n` (<= 16) lanes of `value`, rounded to `dtype`, at `out`. */
static inline void store_first_lanes(vfloat value, int dtype, char *out, int n)
{
    if (n == LANES) {
        store_lanes(value, dtype, out);
        return;
    }
    char padded[LANES * sizeof(float)];
    store_lanes(value, dtype, padded);
    copy_head(out, padded, n * dtype_size(dtype));
}

#if defined(__AVX512F__)
/* out[n] = column n of the 16 x 16 float32 matrix whose row i is in[i]. */
static inline void transpose_16x16(const __m512 in[16], vfloat out[16])
{
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = in[i];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = (__m512)_mm512_unpacklo_pd((__m512d)t[i], (__m512d)t[i + 2]);
        r[i + 1] = (__m512)_mm512_unpackhi_pd((__m512d)t[i], (__m512d)t[i + 2]);
        r[i + 2] = (__m512)_mm512_unpacklo_pd((__m512d)t[i + 1], (__m512d)t[i + 3]);
        r[i + 3] = (__m512)_mm512_unpackhi_pd((__m512d)t[i + 1], (__m512d)t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        out[j] = (vfloat)_mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
        out[j + 8] = (vfloat)_mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
    }
}
#endif

/* e^r for |r| <= ln(2) / 2, its Taylor series to r^7. */
static inline vfloat exp_near_zero(vfloat r)
{
    vfloat poly = (vfloat){0} + 1.f / 5040.f;
    poly = poly * r + 1.f / 720.f;
    poly = poly * r + 1.f / 120.f;
    poly = poly * r + 1.f / 24.f;
    poly = poly * r + 1.f / 6.f;
    poly = poly * r + 0.5f;
    poly = poly * r + 1.f;
    return poly * r + 1.f;
}

#if defined(VECTORS_ARE_AVX2_PAIRS)
/* exp_lanes's steps for 8 lanes in one of AVX2's own registers: GCC turned the 16-lane clamps
 * and selects into a compare and a move per lane (the AVX2 build's silu_and_mul 1.3-1.4x faster
 * without them), and its 16-lane values through the stack. exp_near_zero's products and sums
 * are the FMAs GCC contracts them to, so the bits are the same. */
static inline __m256 exp8(__m256 x)
{
    /* max and min return their second operand where either is NaN: a NaN stays a NaN. */
    const __m256 clamped = _mm256_min_ps(_mm256_set1_ps(88.f), _mm256_max_ps(_mm256_set1_ps(-87.f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), clamped));
    static const float taylor[] = {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
    __m256 poly = _mm256_set1_ps(1.f / 5040.f);
    for (int i = 0; i < 7; i++) poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(taylor[i]));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(poly, _mm256_castsi256_ps(scale)));
}

/* The largest of 8 lanes. */
static inline float max_of_8(__m256 v)
{
    __m128 four = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    four = _mm_max_ps(_mm_movehl_ps(four, four), four);
    return _mm_cvtss_f32(_mm_max_ps(_mm_movehdup_ps(four), four));
}
#endif

/* e^x lane by lane to about 2 ulp, 0 below the float range (-inf included): e^x = 2^n e^r with n
 * the nearest integer to x / ln(2). libm's expf would not vectorise without -ffast-math. */
static inline vfloat exp_lanes(vfloat x)
{
#if defined(__AVX512F__)
    /* One instruction each to round (vrndscaleps), to scale by 2^n (vscalefps) and, through its
     * zeroing mask, to clear the lanes below the range: a third fewer operations, the same accuracy. */
    const __mmask16 in_range = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
    const vfloat clamped = (vfloat)_mm512_min_ps((__m512)x, _mm512_set1_ps(88.f));
    const vfloat n = (vfloat)_mm512_roundscale_ps((__m512)(clamped * 1.44269504088896341f), _MM_FROUND_TO_NEAREST_INT);
    const vfloat r = clamped - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    return (vfloat)_mm512_maskz_scalef_ps(in_range, (__m512)exp_near_zero(r), (__m512)n);
#elif defined(VECTORS_ARE_AVX2_PAIRS)
    __m256 halves[2];
    memcpy(halves, &x, sizeof halves);
    for (int h = 0; h < 2; h++) halves[h] = exp8(halves[h]);
    vfloat result;
    memcpy(&result, halves, sizeof result);
    return result;
#else
    const vfloat low = (vfloat){0} - 87.f, high = (vfloat){0} + 88.f, round = (vfloat){0} + 12582912.f;
    const vint underflow = x < low;
    const vfloat clamped = select_lanes(underflow, low, select_lanes(x > high, high, x));
    const vfloat n = (clamped * 1.44269504088896341f + round) - round; /* round to nearest: 1.5 * 2^23 trick */
    const vfloat r = clamped - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    const vint scale_bits = (__builtin_convertvector(n, vint) + 127) << 23;
    vfloat scale;
    memcpy(&scale, &scale_bits, sizeof scale);
    return select_lanes(underflow, (vfloat){0}, exp_near_zero(r) * scale);
#endif
}

/* SwiGLU's silu(gate) * up lane by lane for gate and up already rounded to `dtype` (as a
 * linear's outputs are), silu(gate) rounded before the product as the torch code rounds it; the
 * product is left for the caller's store to round. */
static inline vfloat swiglu_lanes(vfloat gate, vfloat up, int dtype)
{
    return round_lanes(gate / (1.f + exp_lanes(-gate)), dtype) * up;
}

/* How far a score may exceed the running maximum an online softmax exponentiates against
 * before that maximum moves up: e^8 keeps every term and sum far inside float32's range, and
 * tiles whose scores stay under it skip finding their maximum and rescaling. */
#define RESCALE_MARGIN 8.f

/* e^(old_max - new_max), the factor an online softmax's sums shrink by when its running maximum
 * rises from old_max to new_max: 0 where nothing was seen yet (old_max -inf), and 1 without
 * computing it where the maximum stayed, as it does on most tiles of a long context. */
static inline float softmax_rescale(float old_max, float new_max)
{
    if (old_max == -INFINITY) return 0.f;
    if (old_max == new_max) return 1.f;
    return exp_lanes((vfloat){0} + (old_max - new_max))[0];
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

/* Lane by lane: a > b ? a : b. */
static inline vfloat max_lanes(vfloat a, vfloat b)
{
#if defined(__AVX512F__)
    return (vfloat)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(VECTORS_ARE_AVX2_PAIRS)
    __m256 x[2], y[2];
    memcpy(x, &a, sizeof x);
    memcpy(y, &b, sizeof y);
    for (int h = 0; h < 2; h++) x[h] = _mm256_max_ps(x[h], y[h]);
    memcpy(&a, x, sizeof a);
    return a;
#else
    return select_lanes(a > b, a, b);
#endif
}

/* Pairwise step of the shuffle trees below: `a` and `b` each hold 16 / width groups of `width`
 * lanes, one group per vector being reduced. Returns groups of half the width, a's vectors first,
 * then b's, each lane the sum (or with `take_max`, the larger) of two lanes of its group. */
static inline vfloat fold(vfloat a, vfloat b, int width, const int take_max)
{
    static const vint low[] = {
        [8] = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
        [4] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
        [2] = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
        [1] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
    };
    const int half = width / 2;
    const vfloat first = __builtin_shuffle(a, b, low[half]), second = __builtin_shuffle(a, b, low[half] + half);
    return take_max ? max_lanes(first, second) : first + second;
}

/* Lane i = the sum (or with `take_max`, the largest) of the lanes of v[i], for 16 vectors at
 * once: four levels of fold, where reducing each vector alone takes four dependent steps per
 * vector. `v` is overwritten. */
static inline vfloat reduce_each(vfloat v[LANES], const int take_max)
{
    for (int width = LANES, count = LANES; width > 1; width /= 2, count /= 2)
        for (int i = 0; i < count / 2; i++) v[i] = fold(v[2 * i], v[2 * i + 1], width, take_max);
    return v[0];
}

/* lanes[p] = the sum of the lanes of partial[p], for the 16 positions p. */
static inline vfloat sum_each(vfloat partial[LANES]) { return reduce_each(partial, 0); }

static inline float max_of_lanes(vfloat v)
{
#if defined(VECTORS_ARE_AVX2_PAIRS)
    /* GCC's 16-lane shuffles below go through the stack a lane at a time on AVX2. */
    __m256 halves[2];
    memcpy(halves, &v, sizeof halves);
    return max_of_8(_mm256_max_ps(halves[1], halves[0]));
#else
    for (int width = LANES / 2; width >= 1; width /= 2) {
        vfloat other = swap_halves(v, width);
        v = select_lanes(other > v, other, v);
    }
    return v[0];
#endif
}

/* Whether any lane of v is above `bound`. */
static inline int any_lane_above(vfloat v, float bound)
{
#if defined(__AVX512F__)
    return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(bound), _CMP_GT_OQ) != 0;
#elif defined(VECTORS_ARE_AVX2_PAIRS)
    /* The loop below reads the comparison's 16 lanes one at a time on AVX2. */
    __m256 halves[2];
    memcpy(halves, &v, sizeof halves);
    const __m256 limit = _mm256_set1_ps(bound);
    return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(halves[0], limit, _CMP_GT_OQ),
                                           _mm256_cmp_ps(halves[1], limit, _CMP_GT_OQ))) != 0;
#else
    const vint above = v > bound;
    int any = 0;
    for (int i = 0; i < LANES; i++) any |= above[i];
    return any != 0;
#endif
}

/* x W^T for weights kept in the quantized blocks of a GGUF file (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
 * Q4_K, Q5_K, Q6_K), without dequantizing them first.
 *
 * A decode step reads every weight once, so its speed is the bytes of weights per token: a Q4_1
 * weight is 5 bits, a bfloat16 one 16. The activations are quantized per run of 32 values to
 * int16 with a float32 scale, so a run of 32 weights against a run of 32 activations is one
 * integer dot product. Every format decodes a run of 32 weights to unsigned bytes u with a scale
 * a and an offset b per half-run of 16 values, w = a u + b (Q8_0, already signed, to signed
 * bytes with b = 0), so that
 *     sum_i w_i x_i  =  d_x (a sum_i u_i q_i + b sum_i q_i)
 * with the q_i the int16 activations and d_x their scale: one integer dot product per run, plus
 * the activations' sums, computed once when they are quantized.
 *
 * Why int16 and not llama.cpp's int8: int8 activations are off by up to 1/254 of a run's largest
 * value, and through the default model's 30 layers that moved logits by several hundredths,
 * enough to change greedy tokens where HF's top two logits were 0.08 apart; int16 activations
 * are 128 times closer, and their dot product costs the same instructions per run (the weights
 * widened to 16 bits, vpmaddwd) as int8's (the halves joined, vpdpbusd).
 *
 * Q4_0, Q4_1 and Q8_0 linears (the default model's, its tied LM head included) are held in
 * gguf_interleave's layout instead, rows interleaved 16 at a time, which interleaved_matrix
 * multiplies 16 rows per instruction (below).
 *
 * The dot product has four bodies, chosen when the library is built for the CPU: AVX512-VNNI
 * (vpdpwssd adds the second half's products in the same instruction), AVX-512 without VNNI
 * (vpmaddwd, vpaddd on 16 rows at once), AVX2 (the same on 8, in registers of AVX2's width) and
 * portable C.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "amx_tiles.h"
#include "dtypes.h"
#include "kernels.h"
#include "vector_math.h"

/* ggml's type codes (ggml.h), as GGUF files store them. */
enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
       GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 };
enum { RUN = 32, SUPER = 256, MAX_FEATURES = 2, MAX_ROW_GROUP = 4, PREFETCH_AHEAD = 8 };
/* gguf_interleave's layout of Q4_0, Q4_1 and Q8_0 rows, GROUP rows at a time: the type code | INTERLEAVED. */
/* A group's runs are prefetched GROUP_PREFETCH_BYTES ahead, into every cache level (as above). */
enum { INTERLEAVED = 0x100, GROUP = 16, GROUP_PREFETCH_BYTES = 4096 };
/* An interleaved group multiplies activation rows GROUP_ROWS at a time, each of its weights
 * decoded once per GROUP_ROWS rows (AVX-512's 32 registers hold 12 rows' sums and accumulators:
 * 1.15x the rate of 8 at 64-2048 rows on Xeon-AVX512; elsewhere 8, which AVX2's 16 registers
 * take AVX2_ROWS at a time), the last few rows up to TAIL_ROWS at a time; a sum alone in flight
 * is split into up to DOT_CHAINS. */
#if defined(__AVX512F__)
enum { GROUP_ROWS = 12 };
#else
enum { GROUP_ROWS = 8 };
#endif
enum { TAIL_ROWS = 8, DOT_CHAINS = 4 };
enum { PANEL_BYTES = 256 * 1024 };
enum { GGUF_OK = 0, GGUF_NO_MEMORY = -1, GGUF_UNSUPPORTED_TYPE = -2, GGUF_BAD_SHAPE = -3, GGUF_ROW_OUT_OF_RANGE = -4 };

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int8_t i8x32 __attribute__((vector_size(32)));
typedef int16_t i16x16 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x32 __attribute__((vector_size(64)));
typedef int16_t i16x32 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef float f32x16 __attribute__((vector_size(64)));

/* 32 activations quantized: x_i ~= d q_i, with d times the sum of q over each half and over
 * the run (what a run's offsets multiply). */
struct QuantizedRun {
    i16x16 q[2];
    float d, scaled_sum[2], scaled_total;
};

/* 32 weights decoded, as two halves of 16: w_i = scale[h] u[h][i % 16] + offset[h] with
 * h = i / 16 (u read as signed for Q8_0). Formats with a zero point z (u - z, not a float offset)
 * have offset = -z scale, and `zero` z for the dequantization, which rounds as ggml does:
 * scale (u - z) is one rounding, not two. */
struct DecodedRun {
    u8x16 u[2];
    float scale[2], offset[2];
    int zero;
};

static inline float half_at(const uint8_t *p)
{
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

static inline u8x16 load16(const uint8_t *p)
{
    u8x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Low nibbles of 16 bytes, then their high nibbles: ggml's order for 32 4-bit values. */
static inline void nibbles(const uint8_t *p, u8x16 u[2])
{
    const u8x16 q = load16(p);
    u[0] = q & 0xF;
    u[1] = q >> 4;
}

/* 16 in each byte i of half h whose bit 16h + i of the 32-bit little-endian word at p is set. */
static inline u8x16 fifth_bits(const uint8_t *p, int h)
{
    u8x16 bytes = {0};
    memcpy(&bytes, p + 2 * h, 2);
    const u8x16 spread = __builtin_shufflevector(bytes, bytes, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const u8x16 bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    return (u8x16)((spread & bit) != 0) & 16;
}

/* Q4_K and Q5_K: the 6-bit scale and min of sub-run j (0..7), packed into 12 bytes. */
static inline void k_scale_min(const uint8_t *packed, int j, int *scale, int *min)
{
    if (j < 4) {
        *scale = packed[j] & 63;
        *min = packed[j + 4] & 63;
    } else {
        *scale = (packed[j + 4] & 0xF) | ((packed[j - 4] >> 6) << 4);
        *min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
    }
}

static inline void uniform(struct DecodedRun *r, float scale, float offset, int zero)
{
    r->scale[0] = r->scale[1] = scale;
    r->offset[0] = r->offset[1] = offset;
    r->zero = zero;
}

/* Run j of the block at `b` (j = 0 for the 32-value formats, 0..7 for the K formats). */
static inline __attribute__((always_inline)) void decode_run(int type, const uint8_t *b, int j, struct DecodedRun *r)
{
    switch (type) {
    case GGML_Q4_0: /* d, 16 bytes of nibbles; w = d (u - 8) */
        nibbles(b + 2, r->u);
        uniform(r, half_at(b), -8.f * half_at(b), 8);
        break;
    case GGML_Q4_1: /* d, m, nibbles; w = d u + m */
        nibbles(b + 4, r->u);
        uniform(r, half_at(b), half_at(b + 2), 0);
        break;
    case GGML_Q5_0: /* d, 32 fifth bits, nibbles; w = d (u - 16) */
        nibbles(b + 6, r->u);
        r->u[0] |= fifth_bits(b + 2, 0);
        r->u[1] |= fifth_bits(b + 2, 1);
        uniform(r, half_at(b), -16.f * half_at(b), 16);
        break;
    case GGML_Q5_1: /* d, m, fifth bits, nibbles; w = d u + m */
        nibbles(b + 8, r->u);
        r->u[0] |= fifth_bits(b + 4, 0);
        r->u[1] |= fifth_bits(b + 4, 1);
        uniform(r, half_at(b), half_at(b + 2), 0);
        break;
    case GGML_Q8_0: /* d, 32 int8; w = d q */
        r->u[0] = load16(b + 2);
        r->u[1] = load16(b + 18);
        uniform(r, half_at(b), 0.f, 0);
        break;
    case GGML_Q4_K:   /* d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles */
    case GGML_Q5_K: { /* as Q4_K with 32 bytes of fifth bits before the nibbles */
        int scale, min;
        k_scale_min(b + 4, j, &scale, &min);
        const uint8_t *low = b + (type == GGML_Q4_K ? 16 : 48) + 32 * (j / 2);
        for (int h = 0; h < 2; h++) {
            const u8x16 q = load16(low + 16 * h);
            r->u[h] = j % 2 ? q >> 4 : q & 0xF;
            if (type == GGML_Q5_K) r->u[h] |= ((load16(b + 16 + 16 * h) >> j) & 1) << 4;
        }
        uniform(r, half_at(b) * scale, -(half_at(b + 2) * min), 0);
        break;
    }
    case GGML_Q6_K: { /* 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d; w = d s (u - 32) */
        const int half = j / 4, k = j % 4;
        for (int h = 0; h < 2; h++) {
            const u8x16 low = load16(b + 64 * half + 32 * (k % 2) + 16 * h);
            const u8x16 high = load16(b + 128 + 32 * half + 16 * h);
            r->u[h] = (k >= 2 ? low >> 4 : low & 0xF) | (((high >> (2 * k)) & 3) << 4);
        }
        const int8_t *scales = (const int8_t *)(b + 192 + 8 * half + 2 * k);
        const float d = half_at(b + 208);
        r->scale[0] = d * scales[0];
        r->scale[1] = d * scales[1];
        r->offset[0] = -32.f * r->scale[0];
        r->offset[1] = -32.f * r->scale[1];
        r->zero = 32;
        break;
    }
    default: /* callers check the type first (block_values) */
        __builtin_unreachable();
    }
}

/* A decoded half-run as 16-bit lanes. */
static inline i16x16 widen(u8x16 half, int is_signed)
{
#if defined(__AVX2__)
    return (i16x16)(is_signed ? _mm256_cvtepi8_epi16((__m128i)half) : _mm256_cvtepu8_epi16((__m128i)half));
#else
    return is_signed ? __builtin_convertvector((i8x16)half, i16x16) : __builtin_convertvector(half, i16x16);
#endif
}

/* Lane l: w_2l q_2l + w_2l+1 q_2l+1. */
static inline i32x8 multiply_pairs(i16x16 w, i16x16 q)
{
#if defined(__AVX2__)
    return (i32x8)_mm256_madd_epi16((__m256i)w, (__m256i)q);
#else
    i32x8 sums;
    for (int l = 0; l < 8; l++) sums[l] = (int32_t)w[2 * l] * q[2 * l] + (int32_t)w[2 * l + 1] * q[2 * l + 1];
    return sums;
#endif
}

/* Lane l: w_2l q_2l + w_2l+1 q_2l+1, plus `add`'s lane l. */
static inline i32x8 multiply_add_pairs(i16x16 w, i16x16 q, i32x8 add)
{
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (i32x8)_mm256_dpwssd_epi32((__m256i)add, (__m256i)w, (__m256i)q);
#elif defined(__AVX2__)
    return add + (i32x8)_mm256_madd_epi16((__m256i)w, (__m256i)q);
#else
    for (int l = 0; l < 8; l++) add[l] += (int32_t)w[2 * l] * q[2 * l] + (int32_t)w[2 * l + 1] * q[2 * l + 1];
    return add;
#endif
}

int gguf_linear_body(void)
{
#if defined(AMX_TILES) && defined(__AVX512BF16__)
    if (amx_permitted()) return 4;
#endif
#if defined(__AVX512BF16__)
    return 5;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return 2;
#elif defined(__AVX512BW__)
    return 3;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

static int interleavable(int type) { return type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0; }

/* Values per block and bytes per block of `type`, or 0 for a type without a kernel. */
static int64_t block_values(int type)
{
    if (type & INTERLEAVED) return interleavable(type & ~INTERLEAVED) ? RUN : 0;
    return type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K ? SUPER
           : type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q5_0 || type == GGML_Q5_1 || type == GGML_Q8_0
               ? RUN : 0;
}

static int64_t block_bytes(int type)
{
    switch (type & ~INTERLEAVED) {
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q5_0: return 22;
    case GGML_Q5_1: return 24;
    case GGML_Q8_0: return 34;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    default: return 0;
    }
}

static inline float sum_lanes(f32x8 v)
{
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

#if defined(VECTORS_ARE_AVX2_PAIRS)
/* quantize_row's run of 32 float32 activations `v`, the same values, in AVX2's own registers:
 * GCC built the 16-lane conversions to int16 and the sums below a lane at a time. */
static __attribute__((optimize("fp-contract=off"))) void avx2_quantize_run(const float v[RUN], struct QuantizedRun *r)
{
    __m256 eights[4], largest = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        eights[i] = _mm256_loadu_ps(v + 8 * i);
        largest = _mm256_max_ps(largest, _mm256_andnot_ps(_mm256_set1_ps(-0.f), eights[i]));
    }
    const float amax = max_of_8(largest);
    r->d = amax / 32767.f;
    const __m256 inverse = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f), magic = _mm256_set1_ps(12582912.f);
    float sums[2];
    for (int h = 0; h < 2; h++) {
        __m256 rounded[2];
        for (int j = 0; j < 2; j++)
            rounded[j] = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(eights[2 * h + j], inverse), magic), magic);
        /* packs interleaves its inputs' 128-bit halves; the permute puts the 16 back in order */
        const __m256i q = _mm256_permute4x64_epi64(
            _mm256_packs_epi32(_mm256_cvtps_epi32(rounded[0]), _mm256_cvtps_epi32(rounded[1])), 0xd8);
        memcpy(&r->q[h], &q, sizeof q);
        sums[h] = sum_lanes((f32x8)_mm256_add_ps(rounded[0], rounded[1]));
    }
    r->scaled_sum[0] = r->d * sums[0];
    r->scaled_sum[1] = r->d * sums[1];
    r->scaled_total = r->d * (sums[0] + sums[1]);
}
#endif

#if defined(__AVX512F__)
/* quantize_row's runs for AVX-512, `count` (up to 16) runs of the values of `dtype` at `src`:
 * the runs' largest magnitudes and their halves' sums reduced 16 runs at once (reduce_each), where
 * reducing each run's vectors alone, and converting them through the stack, took most of the
 * quantization's time. The same values as quantize_row's portable code, bit for bit. */
static __attribute__((optimize("fp-contract=off"))) void avx512_quantize_runs(
    const char *src, int dtype, int count, struct QuantizedRun *runs)
{
    const size_t half_bytes = LANES * dtype_size(dtype);
    vfloat largest[LANES], sums[2][LANES];
    for (int r = 0; r < LANES; r++) {
        __m512 magnitude = _mm512_setzero_ps();
        for (int h = 0; r < count && h < 2; h++)
            magnitude = _mm512_max_ps(magnitude, _mm512_abs_ps((__m512)load_lanes(src + (2 * r + h) * half_bytes, dtype)));
        largest[r] = (vfloat)magnitude;
    }
    const __m512 amax = (__m512)reduce_each(largest, 1), d = _mm512_div_ps(amax, _mm512_set1_ps(32767.f));
    const __m512 inverse = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ),
                                               _mm512_set1_ps(32767.f), amax);
    const __m512 magic = _mm512_set1_ps(12582912.f);
    for (int r = 0; r < LANES; r++)
        for (int h = 0; h < 2; h++) {
            sums[h][r] = (vfloat){0};
            if (r >= count) continue;
            const __m512 scaled = _mm512_mul_ps((__m512)load_lanes(src + (2 * r + h) * half_bytes, dtype),
                                                _mm512_permutexvar_ps(_mm512_set1_epi32(r), inverse));
            const __m512 rounded = _mm512_sub_ps(_mm512_add_ps(scaled, magic), magic);
            sums[h][r] = (vfloat)rounded;
            const __m256i q = _mm512_cvtepi32_epi16(_mm512_cvttps_epi32(rounded));
            memcpy(&runs[r].q[h], &q, sizeof q);
        }
    float ds[LANES], scaled_sums[2][LANES], scaled_totals[LANES];
    const __m512 first = (__m512)sum_each(sums[0]), second = (__m512)sum_each(sums[1]);
    _mm512_storeu_ps(ds, d);
    _mm512_storeu_ps(scaled_sums[0], _mm512_mul_ps(d, first));
    _mm512_storeu_ps(scaled_sums[1], _mm512_mul_ps(d, second));
    _mm512_storeu_ps(scaled_totals, _mm512_mul_ps(d, _mm512_add_ps(first, second)));
    for (int r = 0; r < count; r++) {
        runs[r].d = ds[r];
        runs[r].scaled_sum[0] = scaled_sums[0][r];
        runs[r].scaled_sum[1] = scaled_sums[1][r];
        runs[r].scaled_total = scaled_totals[r];
    }
}
#endif

/* Row m of x (in_features values of `dtype`) as runs of 32 quantized activations: q = the
 * value times 32767 / the run's largest magnitude, rounded to the nearest integer, ties to even
 * (adding and subtracting 1.5 * 2^23 does that rounding for magnitudes below 2^22, in vectors;
 * the product is rounded first, so no multiply-add may be fused here). */
static __attribute__((optimize("fp-contract=off"))) void quantize_row(
    const void *x, int dtype, int64_t m, int64_t in_features, struct QuantizedRun *runs)
{
    const char *row = (const char *)x + m * in_features * dtype_size(dtype);
#if defined(__AVX512F__)
    for (int64_t k = 0; k < in_features; k += LANES * RUN) {
        const int64_t left = (in_features - k) / RUN;
        avx512_quantize_runs(row + k * dtype_size(dtype), dtype, left < LANES ? (int)left : LANES, &runs[k / RUN]);
    }
#else
    for (int64_t k = 0; k < in_features; k += RUN) {
        f32x16 v[2];
        load_row(row + k * dtype_size(dtype), dtype, (float *)v, RUN);
        struct QuantizedRun *r = &runs[k / RUN];
#if defined(VECTORS_ARE_AVX2_PAIRS)
        avx2_quantize_run((const float *)v, r);
#else
        const f32x16 magic = (f32x16){0} + 12582912.f;
        const f32x16 first = (f32x16)((u32x16)v[0] & 0x7fffffffu), second = (f32x16)((u32x16)v[1] & 0x7fffffffu);
        const float amax = max_of_lanes(select_lanes(first > second, first, second));
        r->d = amax / 32767.f;
        const float inverse = amax > 0.f ? 32767.f / amax : 0.f;
        float sums[2]; /* of integers below 2^19 in magnitude: exact in float32, in any order */
        for (int h = 0; h < 2; h++) {
            const f32x16 scaled = v[h] * inverse, rounded = (scaled + magic) - magic;
            r->q[h] = __builtin_convertvector(__builtin_convertvector(rounded, i32x16), i16x16);
            sums[h] = sum_of_lanes(rounded);
        }
        r->scaled_sum[0] = r->d * sums[0];
        r->scaled_sum[1] = r->d * sums[1];
        r->scaled_total = r->d * (sums[0] + sums[1]);
#endif
    }
#endif
}

/* sums[f][r]: weight rows w[f] (f < features) dotted with activation rows row0 + r (r < rows).
 * Several weight rows at once keep independent accumulators (one row alone waits on its FMA's
 * latency every run) and more weight streams in flight. */
static inline __attribute__((always_inline)) void dots(
    const int type, const uint8_t *const w[MAX_FEATURES], int64_t blocks, const struct QuantizedRun *x,
    int64_t runs_per_row, int64_t row0, const int features, const int rows, float sums[MAX_FEATURES][MAX_ROW_GROUP])
{
    const int runs_per_block = (int)(block_values(type) / RUN);
    const int64_t bytes = block_bytes(type);
    f32x8 acc[MAX_FEATURES][MAX_ROW_GROUP] = {{{0}}};
    float offsets[MAX_FEATURES][MAX_ROW_GROUP] = {{0}};
    for (int64_t b = 0; b < blocks; b++) {
        for (int j = 0; j < runs_per_block; j++) {
            struct DecodedRun run[MAX_FEATURES];
            i16x16 low_half[MAX_FEATURES], high_half[MAX_FEATURES];
            for (int f = 0; f < features; f++) {
                decode_run(type, w[f] + b * bytes, j, &run[f]);
                low_half[f] = widen(run[f].u[0], type == GGML_Q8_0);
                high_half[f] = widen(run[f].u[1], type == GGML_Q8_0);
            }
            for (int r = 0; r < rows; r++) {
                const struct QuantizedRun *a = &x[(row0 + r) * runs_per_row + b * runs_per_block + j];
                for (int f = 0; f < features; f++) {
                    if (type == GGML_Q6_K) { /* a scale per half: the halves' sums stay apart */
                        const i32x8 low = multiply_pairs(low_half[f], a->q[0]);
                        const i32x8 high = multiply_pairs(high_half[f], a->q[1]);
                        acc[f][r] += __builtin_convertvector(low, f32x8) * (run[f].scale[0] * a->d)
                                     + __builtin_convertvector(high, f32x8) * (run[f].scale[1] * a->d);
                    } else {
                        const i32x8 both = multiply_add_pairs(high_half[f], a->q[1], multiply_pairs(low_half[f], a->q[0]));
                        acc[f][r] += __builtin_convertvector(both, f32x8) * (run[f].scale[0] * a->d);
                    }
                    if (type == GGML_Q6_K)
                        offsets[f][r] += run[f].offset[0] * a->scaled_sum[0] + run[f].offset[1] * a->scaled_sum[1];
                    else if (type != GGML_Q8_0) /* one offset for the whole run */
                        offsets[f][r] += run[f].offset[0] * a->scaled_total;
                }
            }
        }
    }
    for (int f = 0; f < features; f++)
        for (int r = 0; r < rows; r++) sums[f][r] = sum_lanes(acc[f][r]) + offsets[f][r];
}

/* Outputs n .. n + features of every activation row: weight rows in groups of up to
 * MAX_FEATURES, activation rows MAX_ROW_GROUP at a time (the weight rows stay in L1 between
 * groups). Inlined with constant counts so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void output_features(
    const int type, const uint8_t *weight, int64_t n, const int features, int64_t blocks, int64_t row_bytes,
    const struct QuantizedRun *x, int64_t runs_per_row, int64_t rows, const float *bias, char *out,
    int64_t out_stride, int out_dtype)
{
    const uint8_t *w[MAX_FEATURES];
    for (int f = 0; f < features; f++) {
        w[f] = weight + (n + f) * row_bytes;
        /* The whole row PREFETCH_AHEAD rows on: rows of a few hundred bytes are too short for
         * the hardware prefetcher to ramp up. Into every cache level (T0): a non-temporal
         * prefetch held the interleaved kernel to 12 GB/s at one row on Xeon-AVX512, T0 to 25. */
        for (int64_t line = 0; line < row_bytes; line += 64)
            __builtin_prefetch(w[f] + PREFETCH_AHEAD * row_bytes + line, 0, 3);
    }
    const size_t item = dtype_size(out_dtype);
    for (int64_t row = 0; row < rows; row += MAX_ROW_GROUP) {
        float sums[MAX_FEATURES][MAX_ROW_GROUP];
        const int count = rows - row < MAX_ROW_GROUP ? (int)(rows - row) : MAX_ROW_GROUP;
#define DOTS(FEATURES, ROWS) dots(type, w, blocks, x, runs_per_row, row, FEATURES, ROWS, sums)
        if (features == MAX_FEATURES) {
            switch (count) {
            case 1: DOTS(MAX_FEATURES, 1); break;
            case 2: DOTS(MAX_FEATURES, 2); break;
            case 3: DOTS(MAX_FEATURES, 3); break;
            default: DOTS(MAX_FEATURES, 4);
            }
        } else {
            switch (count) {
            case 1: DOTS(1, 1); break;
            case 2: DOTS(1, 2); break;
            case 3: DOTS(1, 3); break;
            default: DOTS(1, 4);
            }
        }
#undef DOTS
        for (int f = 0; f < features; f++)
            for (int r = 0; r < count; r++)
                store_float(out + ((row + r) * out_stride + n + f) * item, out_dtype,
                            sums[f][r] + (bias ? bias[n + f] : 0.f));
    }
}

/* One part: out[m, n] for n < out_features, out rows `out_stride` values apart. */
static void linear_part(
    int type, const uint8_t *weight, int64_t out_features, int64_t in_features, const struct QuantizedRun *x,
    int64_t rows, const float *bias, char *out, int64_t out_stride, int out_dtype, int num_threads)
{
    const int64_t blocks = in_features / block_values(type), row_bytes = blocks * block_bytes(type);
    const int64_t runs_per_row = in_features / RUN;
    /* Whole groups of MAX_FEATURES rows, then the rest one by one. */
    const int64_t groups = out_features / MAX_FEATURES;
#define FEATURES(TYPE)                                                                                        \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                                    \
    for (int64_t g = 0; g < groups + out_features % MAX_FEATURES; g++) {                                     \
        if (g < groups)                                                                                       \
            output_features(TYPE, weight, g * MAX_FEATURES, MAX_FEATURES, blocks, row_bytes, x, runs_per_row, \
                            rows, bias, out, out_stride, out_dtype);                                          \
        else                                                                                                  \
            output_features(TYPE, weight, groups * MAX_FEATURES + (g - groups), 1, blocks, row_bytes, x,      \
                            runs_per_row, rows, bias, out, out_stride, out_dtype);                            \
    }
    switch (type) {
    case GGML_Q4_0: FEATURES(GGML_Q4_0) break;
    case GGML_Q4_1: FEATURES(GGML_Q4_1) break;
    case GGML_Q5_0: FEATURES(GGML_Q5_0) break;
    case GGML_Q5_1: FEATURES(GGML_Q5_1) break;
    case GGML_Q8_0: FEATURES(GGML_Q8_0) break;
    case GGML_Q4_K: FEATURES(GGML_Q4_K) break;
    case GGML_Q5_K: FEATURES(GGML_Q5_K) break;
    case GGML_Q6_K: FEATURES(GGML_Q6_K) break;
    }
#undef FEATURES
}

/* ---- Q4_0, Q4_1 and Q8_0 rows interleaved GROUP at a time ----------------------------------
 * One weight row per 32-bit lane. For each run of 32 values a group holds its 16 rows' scales d
 * (float16), their minimums m (Q4_1), then the values, laid out so that 16 vectors P_0 .. P_15
 * come out whose lane l holds row l's values 2p and 2p + 1 as two int16: for Q4, 256 bytes of
 * nibbles, four 64-byte loads each split into the four nibbles of its 16-bit words; for Q8_0,
 * 512 bytes, P_p the 32 signed bytes at 32p widened. One pair-wise dot-product instruction then
 * multiplies all 16 rows by the activations' pair p, broadcast, and no sum across lanes is ever
 * needed: a row costs a sixteenth of the decoding and scaling the row-at-a-time kernel does. */

static int64_t scale_bytes(int base) { return base == GGML_Q4_1 ? 4 * GROUP : 2 * GROUP; }

/* Where value v of row l of a group's run lives: byte (the returned offset into the values) and
 * bit shift (*shift). */
static inline int nibble_at(int l, int v, int *shift)
{
    const int p = v / 2, s = v % 2, c = p / 4, k = p % 4;
    *shift = 4 * (k % 2);
    return 64 * c + 2 * (2 * l + s) + k / 2;
}

/* Where value v of row l of a Q8_0 group's run lives, from the start of its values. */
static inline int byte_at(int l, int v) { return 32 * (v / 2) + 2 * l + v % 2; }

/* out = `rows` rows of `type` blocks (Q4_0, Q4_1 or Q8_0) in the interleaved layout (same size). */
int gguf_interleave(const uint8_t *data, int type, int64_t rows, int64_t cols, uint8_t *out)
{
    if (!interleavable(type)) return GGUF_UNSUPPORTED_TYPE;
    if (cols % RUN || rows % GROUP) return GGUF_BAD_SHAPE;
    const int64_t blocks = cols / RUN, bytes = block_bytes(type), row_bytes = blocks * bytes;
    const int header = type == GGML_Q4_1 ? 4 : 2; /* d (and m) before a block's values */
    memset(out, 0, (size_t)(rows * row_bytes));
    for (int64_t g = 0; g < rows / GROUP; g++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *group = out + g * GROUP * row_bytes + b * GROUP * bytes, *values = group + scale_bytes(type);
            for (int l = 0; l < GROUP; l++) {
                const uint8_t *block = data + (g * GROUP + l) * row_bytes + b * bytes;
                memcpy(group + 2 * l, block, 2);
                if (type == GGML_Q4_1) memcpy(group + 2 * GROUP + 2 * l, block + 2, 2);
                if (type == GGML_Q8_0) {
                    for (int v = 0; v < RUN; v++) values[byte_at(l, v)] = block[header + v];
                    continue;
                }
                for (int v = 0; v < RUN; v++) {
                    int shift;
                    const int u = v < 16 ? block[header + v] & 0xF : block[header + v - 16] >> 4;
                    values[nibble_at(l, v, &shift)] |= (uint8_t)(u << shift);
                }
            }
        }
    return GGUF_OK;
}

/* Row l's run in a group's run of the interleaved layout, decoded (for the dequantization). Q4:
 * lane l of the c-th 64 bytes of nibbles is the 32-bit word holding the row's values 8c .. 8c + 7,
 * value 8c + 2k + s at bit 16s + 4k. */
static void decode_interleaved_run(int base, const uint8_t *group, int l, struct DecodedRun *r)
{
    const uint8_t *values = group + scale_bytes(base);
    if (base == GGML_Q8_0) { /* the byte pairs at 32p + 2l are the row's values 2p, 2p + 1 */
        uint16_t pairs[RUN / 2];
        for (int p = 0; p < RUN / 2; p++) memcpy(&pairs[p], values + byte_at(l, 2 * p), sizeof pairs[p]);
        memcpy(r->u, pairs, sizeof pairs);
        uniform(r, half_at(group + 2 * l), 0.f, 0);
        return;
    }
    const u32x16 shifts = {0, 16, 4, 20, 8, 24, 12, 28, 0, 16, 4, 20, 8, 24, 12, 28};
    for (int h = 0; h < 2; h++) {
        uint32_t first, second;
        memcpy(&first, values + 64 * (2 * h) + 4 * l, sizeof first);
        memcpy(&second, values + 64 * (2 * h + 1) + 4 * l, sizeof second);
        const u32x16 words = {first, first, first, first, first, first, first, first,
                              second, second, second, second, second, second, second, second};
        r->u[h] = __builtin_convertvector((words >> shifts) & 0xF, u8x16);
    }
    const float d = half_at(group + 2 * l);
    if (base == GGML_Q4_1) uniform(r, d, half_at(group + 2 * GROUP + 2 * l), 0);
    else uniform(r, d, -8.f * d, 8);
}

/* Lane l: acc's lane l plus w's 16-bit lanes 2l and 2l + 1 dotted with the two int16 of `pair`. */
static inline i32x16 dot_pair(i32x16 acc, i16x32 w, int32_t pair)
{
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return (i32x16)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(pair));
#elif defined(__AVX512BW__)
    return acc + (i32x16)_mm512_madd_epi16((__m512i)w, _mm512_set1_epi32(pair));
#else /* portable C (AVX2 builds multiply in avx2_group_dots instead) */
    const int16_t a0 = (int16_t)(pair & 0xFFFF), a1 = (int16_t)((uint32_t)pair >> 16);
    for (int l = 0; l < 16; l++) acc[l] += (int32_t)w[2 * l] * a0 + (int32_t)w[2 * l + 1] * a1;
    return acc;
#endif
}

#if defined(VECTORS_ARE_AVX2_PAIRS)
/* group_dots for AVX2, whose registers are half a group wide: each half of the group's rows
 * (8 lanes) in its own register, AVX2_ROWS activation rows at a time. Written with AVX2's own
 * types: GCC took a 64-byte vector's halves in the portable code apart one lane at a time
 * through the stack, and spilled eight rows' sums of two registers each, about 10x slower. */
enum { AVX2_ROWS = 3 };

static inline __attribute__((always_inline)) void avx2_group_dots(
    const int base, const uint8_t *group, int64_t blocks, const struct QuantizedRun *x, int64_t runs_per_row,
    int64_t row0, const int rows, f32x16 acc[AVX2_ROWS])
{
    const int64_t bytes = GROUP * block_bytes(base);
    /* As in group_dots: at least four sums in flight. */
    const int chains = DOT_CHAINS / rows > 1 ? DOT_CHAINS / rows : 1;
    const __m256i low_nibbles = _mm256_set1_epi16(0xF);
    __m256 sums[AVX2_ROWS][2];
    for (int r = 0; r < rows; r++) sums[r][0] = sums[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *run = group + b * bytes, *values = run + scale_bytes(base);
        for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(run + GROUP_PREFETCH_BYTES + line, 0, 3);
        __m256i dot[AVX2_ROWS][DOT_CHAINS][2];
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < chains; j++) dot[r][j][0] = dot[r][j][1] = _mm256_setzero_si256();
        /* Unrolled, so that each pair's sum and shift are constants and the sums stay in registers. */
#pragma GCC unroll 16
        for (int p = 0; p < RUN / 2; p++) {
            __m256i w[2];
            if (base == GGML_Q8_0) {
                for (int h = 0; h < 2; h++)
                    w[h] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(values + 32 * p + 16 * h)));
            } else { /* pair p = 4c + k: the k-th nibble of the 16-bit words of the c-th 64 bytes */
                const __m128i shift = _mm_cvtsi32_si128(4 * (p % 4));
                for (int h = 0; h < 2; h++) {
                    const __m256i words = _mm256_loadu_si256((const __m256i *)(values + 64 * (p / 4) + 32 * h));
                    w[h] = _mm256_and_si256(_mm256_srl_epi16(words, shift), low_nibbles);
                }
            }
            for (int r = 0; r < rows; r++) {
                int32_t pair;
                memcpy(&pair, (const int16_t *)x[(row0 + r) * runs_per_row + b].q + 2 * p, sizeof pair);
                const __m256i broadcast = _mm256_set1_epi32(pair);
                __m256i *chain = dot[r][p % chains];
                for (int h = 0; h < 2; h++) chain[h] = _mm256_add_epi32(chain[h], _mm256_madd_epi16(w[h], broadcast));
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(run + 16 * h)));
            const __m256 m = base == GGML_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(run + 2 * GROUP + 16 * h)))
                                               : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
            for (int r = 0; r < rows; r++) {
                const struct QuantizedRun *a = &x[(row0 + r) * runs_per_row + b];
                __m256i total = dot[r][0][h];
                for (int j = 1; j < chains; j++) total = _mm256_add_epi32(total, dot[r][j][h]);
                sums[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(a->d)), sums[r][h]);
                if (base != GGML_Q8_0) sums[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->scaled_total), sums[r][h]);
            }
        }
    }
    for (int r = 0; r < rows; r++) memcpy(&acc[r], sums[r], sizeof acc[r]);
}
#endif

/* acc[r], lane l: weight row l of `group` dotted with activation row row0 + r (r < rows). */
static inline __attribute__((always_inline)) void group_dots(
    const int base, const uint8_t *group, int64_t blocks, const struct QuantizedRun *x, int64_t runs_per_row,
    int64_t row0, const int rows, f32x16 acc[GROUP_ROWS])
{
#if defined(VECTORS_ARE_AVX2_PAIRS)
    for (int r = 0; r < rows; r += AVX2_ROWS) {
        const int count = rows - r < AVX2_ROWS ? rows - r : AVX2_ROWS;
        switch (count) {
        case 1: avx2_group_dots(base, group, blocks, x, runs_per_row, row0 + r, 1, acc + r); break;
        case 2: avx2_group_dots(base, group, blocks, x, runs_per_row, row0 + r, 2, acc + r); break;
        default: avx2_group_dots(base, group, blocks, x, runs_per_row, row0 + r, AVX2_ROWS, acc + r);
        }
    }
#else
    const int64_t bytes = GROUP * block_bytes(base);
    /* A dot-product instruction waits for the one before on the same sum (about 5 cycles): with
     * fewer than four rows each row's sum is split into `chains` independent ones, alternating by
     * pair, so that at least four are in flight. Integer sums: the split changes no bit. */
    const int chains = rows < DOT_CHAINS ? (DOT_CHAINS + rows - 1) / rows : 1;
    for (int r = 0; r < rows; r++) acc[r] = (f32x16){0};
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *run = group + b * bytes, *values = run + scale_bytes(base);
        for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(run + GROUP_PREFETCH_BYTES + line, 0, 3);
        i32x16 dot[GROUP_ROWS][DOT_CHAINS];
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < chains; j++) dot[r][j] = (i32x16){0};
        for (int p = 0; base == GGML_Q8_0 && p < RUN / 2; p++) {
            i8x32 signed_bytes;
            memcpy(&signed_bytes, values + 32 * p, sizeof signed_bytes);
            const i16x32 w = __builtin_convertvector(signed_bytes, i16x32);
            for (int r = 0; r < rows; r++) {
                int32_t pair;
                memcpy(&pair, (const int16_t *)x[(row0 + r) * runs_per_row + b].q + 2 * p, sizeof pair);
                dot[r][p % chains] = dot_pair(dot[r][p % chains], w, pair);
            }
        }
        for (int c = 0; base != GGML_Q8_0 && c < 4; c++) {
            u16x32 words;
            memcpy(&words, values + 64 * c, sizeof words);
            for (int k = 0; k < 4; k++) {
                const i16x32 w = (i16x32)((words >> (4 * k)) & 0xF);
                for (int r = 0; r < rows; r++) {
                    int32_t pair;
                    memcpy(&pair, (const int16_t *)x[(row0 + r) * runs_per_row + b].q + 2 * (4 * c + k), sizeof pair);
                    dot[r][k % chains] = dot_pair(dot[r][k % chains], w, pair);
                }
            }
        }
        const f32x16 d = load_lanes((const char *)run, DTYPE_FLOAT16);
        const f32x16 m = base == GGML_Q4_1 ? load_lanes((const char *)(run + 2 * GROUP), DTYPE_FLOAT16) : d * -8.f;
        for (int r = 0; r < rows; r++) {
            const struct QuantizedRun *a = &x[(row0 + r) * runs_per_row + b];
            for (int j = 1; j < chains; j++) dot[r][0] += dot[r][j];
            acc[r] += __builtin_convertvector(dot[r][0], f32x16) * (d * a->d);
            if (base != GGML_Q8_0) acc[r] += m * a->scaled_total;
        }
    }
#endif
}

/* Group g's GROUP outputs of every activation row (activation rows GROUP_ROWS at a time):
 * `group` its blocks, `bias` and `out` from its first output column. */
static void interleaved_group(
    int base, const uint8_t *group, int64_t in_features, const struct QuantizedRun *x, int64_t rows,
    const float *bias, char *out, int64_t out_stride, int out_dtype)
{
    const int64_t blocks = in_features / RUN;
    const size_t item = dtype_size(out_dtype);
    for (int64_t row = 0, count; row < rows; row += count) {
        f32x16 acc[GROUP_ROWS];
        count = rows - row >= GROUP_ROWS ? GROUP_ROWS : rows - row > TAIL_ROWS ? TAIL_ROWS : rows - row;
#define GROUP_DOTS(BASE, ROWS) group_dots(BASE, group, blocks, x, blocks, row, ROWS, acc)
#define BY_ROWS(BASE)                          \
    switch (count) {                           \
    case 1: GROUP_DOTS(BASE, 1); break;        \
    case 2: GROUP_DOTS(BASE, 2); break;        \
    case 3: GROUP_DOTS(BASE, 3); break;        \
    case 4: GROUP_DOTS(BASE, 4); break;        \
    case 5: GROUP_DOTS(BASE, 5); break;        \
    case 6: GROUP_DOTS(BASE, 6); break;        \
    case 7: GROUP_DOTS(BASE, 7); break;        \
    case TAIL_ROWS: GROUP_DOTS(BASE, TAIL_ROWS); break; \
    default: GROUP_DOTS(BASE, GROUP_ROWS);     \
    }
        if (base == GGML_Q4_1) {
            BY_ROWS(GGML_Q4_1)
        } else if (base == GGML_Q8_0) {
            BY_ROWS(GGML_Q8_0)
        } else {
            BY_ROWS(GGML_Q4_0)
        }
#undef BY_ROWS
#undef GROUP_DOTS
        /* A row's GROUP outputs in one vector store: stored one float at a time, a long prefill
         * chunk's outputs (a cache line each, rows apart) spent a tenth of the kernel waiting. */
        f32x16 group_bias = {0};
        if (bias) memcpy(&group_bias, bias, sizeof group_bias);
        for (int r = 0; r < count; r++)
            store_lanes((vfloat)(acc[r] + group_bias), out_dtype, out + (row + r) * out_stride * item);
    }
}

/* The groups of the parts of `matrix`, all in the interleaved layout, shared among the threads of
 * the region it is called in (each thread's groups the same in every panel; no barrier after).
 * The activation rows go PANEL_BYTES of them at a time, each thread taking the same groups in
 * every panel: a panel stays in L2 while the thread's groups pass over it, where a long prefill
 * chunk's rows read whole for each group would come from L3 every time. */
static void interleaved_groups(
    const struct QuantizedMatrix *matrix, int64_t in_features, const struct QuantizedRun *x, int64_t rows,
    const float *bias, char *out, int64_t out_features, int out_dtype)
{
    int64_t first_group[4] = {0};
    for (int p = 0; p < matrix->parts; p++) first_group[p + 1] = first_group[p] + matrix->rows[p] / GROUP;
    const size_t item = dtype_size(out_dtype);
    const int64_t runs_per_row = in_features / RUN;
    int64_t panel = PANEL_BYTES / (runs_per_row * (int64_t)sizeof *x) / GROUP_ROWS * GROUP_ROWS;
    if (panel < GROUP_ROWS) panel = GROUP_ROWS;
    for (int64_t row = 0; row < rows; row += panel) {
        const int64_t panel_rows = rows - row < panel ? rows - row : panel;
#pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < first_group[matrix->parts]; g++) {
            int p = 0;
            while (g >= first_group[p + 1]) p++;
            const int base = matrix->types[p] & ~INTERLEAVED;
            const int64_t column = g * GROUP, group_bytes = GROUP * runs_per_row * block_bytes(base);
            interleaved_group(base, matrix->data[p] + (g - first_group[p]) * group_bytes, in_features,
                              x + row * runs_per_row, panel_rows, bias ? bias + column : NULL,
                              out + (row * out_features + column) * item, out_features, out_dtype);
        }
    }
}

/* The parts of `matrix`, all in the interleaved layout, in one parallel region over all their
 * groups: a merged q/k/v or gate/up pays for one fork and join of the threads, not one per part. */
static void interleaved_matrix(
    const struct QuantizedMatrix *matrix, int64_t in_features, const struct QuantizedRun *x, int64_t rows,
    const float *bias, char *out, int64_t out_features, int out_dtype, int num_threads)
{
#pragma omp parallel num_threads(num_threads)
    interleaved_groups(matrix, in_features, x, rows, bias, out, out_features, out_dtype);
}

#if defined(__AVX512BW__)
/* The 16 rows' scales d and offsets m of a group's run (`run`: its scales, then its values),
 * loaded once per run: left to each pair, they were loaded again for every pair, since the run's
 * bytes may alias the caller's stores (16-row steps on AMX 3-6% slower for it). A nibble's value
 * is d u + m: Q4_1 stores m, Q4_0's is -8 d (exact: a power of two times a half). */
struct RunScales {
    __m512 d, m;
};

static inline struct RunScales run_scales(int base, const uint8_t *run)
{
    const __m512 d = (__m512)load_lanes((const char *)run, DTYPE_FLOAT16);
    if (base == GGML_Q4_1) return (struct RunScales){d, (__m512)load_lanes((const char *)(run + 2 * GROUP), DTYPE_FLOAT16)};
    return (struct RunScales){d, base == GGML_Q4_0 ? _mm512_mul_ps(d, _mm512_set1_ps(-8.f)) : _mm512_setzero_ps()};
}

/* Pair p of a group's run for all 16 rows at once: lane l of even and odd holds row l's values 2p
 * and 2p + 1, w = d u (Q8_0), d (u - 8) (Q4_0), d u + m (Q4_1), rounded as half_run_values
 * rounds them (the product is exact, below). Unpacking the nibbles without sign extension and one
 * fused multiply-add for the scale and offset made the default model's 64-row steps' linears
 * 7-11% faster on AMX (session 31). */
static inline __attribute__((always_inline)) void interleaved_pair_values(int base, const uint8_t *run,
                                                                           struct RunScales scales, int p,
                                                                           __m512 *even, __m512 *odd)
{
    enum { ROUNDING = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC };
    const uint8_t *values = run + scale_bytes(base);
    __m512i pairs; /* lane l: row l's values 2p (low 16 bits) and 2p + 1 (high), as int16 */
    if (base == GGML_Q8_0) {
        pairs = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(values + 32 * p)));
    } else {
        const __m512i words = _mm512_loadu_si512(values + 64 * (p / 4));
        pairs = _mm512_and_si512(_mm512_srli_epi16(words, 4 * (p % 4)), _mm512_set1_epi16(0xF));
    }
    __m512 u[2];
    if (base == GGML_Q8_0) {
        u[0] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16));
        u[1] = _mm512_cvtepi32_ps(_mm512_srai_epi32(pairs, 16));
    } else { /* nibbles: no sign to extend */
        u[0] = _mm512_cvtepi32_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(0xFFFF)));
        u[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(pairs, 16));
    }
    /* d u is exact in float32 (an 11-bit half times a 4-bit nibble), so a fused multiply-add
     * rounds once where half_run_values rounds its addition (Q4_1; Q4_0's d (u - 8) is exact) */
    for (int h = 0; h < 2; h++)
        u[h] = base == GGML_Q8_0 ? _mm512_mul_round_ps(scales.d, u[h], ROUNDING) : _mm512_fmadd_ps(scales.d, u[h], scales.m);
    *even = u[0];
    *odd = u[1];
}

/* The `rows` rows of an interleaved Q4_0, Q4_1 or Q8_0 part, row-major in `out_dtype`: each
 * group's run dequantized for its 16 rows at once and transposed, where gathering one row's
 * values from the interleaved bytes took most of a prefill step's dequantization. */
static void dequantize_interleaved(int base, const uint8_t *data, int64_t rows, int64_t cols, char *out,
                                   int out_dtype, int num_threads)
{
    const int64_t runs = cols / RUN, run_bytes = GROUP * block_bytes(base);
    const size_t item = dtype_size(out_dtype);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < rows / GROUP; g++)
        for (int64_t k = 0; k < runs; k++) {
            const uint8_t *run = data + (g * runs + k) * run_bytes;
            const struct RunScales scales = run_scales(base, run);
            __m512 values[RUN]; /* values[v], lane l: row l's value v of the run */
            for (int p = 0; p < RUN / 2; p++)
                interleaved_pair_values(base, run, scales, p, &values[2 * p], &values[2 * p + 1]);
            vfloat row_values[2][GROUP];
            transpose_16x16(values, row_values[0]);
            transpose_16x16(values + LANES, row_values[1]);
            for (int l = 0; l < GROUP; l++)
                for (int h = 0; h < 2; h++) {
                    const int64_t element = (g * GROUP + l) * cols + k * RUN + h * LANES;
                    store_lanes(row_values[h][l], out_dtype, out + element * item);
                }
        }
}
#endif

/* ---- Q4_0, Q4_1 and Q8_0 interleaved rows times bfloat16 activations ------------------------
 * Where the CPU has AVX512-BF16, a step of enough bfloat16 rows multiplies each group's runs
 * dequantized to bfloat16 (exactly gguf_dequantize's values, rounded as torch rounds) straight
 * into the layout both bfloat16 products take their weights in, which is the interleaved
 * layout's own (lane l of pair p: row l's values 2p and 2p + 1). With AMX, tdpbf16ps multiplies
 * 16 activation rows by the group's 16 rows over a run's 32 values in one instruction; without,
 * vdpbf16ps multiplies one activation row's pair of values (broadcast) by the group's 16 rows'
 * pairs. Either sums in float32 and uses the activations as they are, so a step computes what the
 * GEMM on the dequantized bfloat16 weights computes, without a bfloat16 copy of the weights.
 * Where the int16 kernel spends, per run and activation row, a conversion and two multiply-adds
 * beside its products to apply the run's scales, here the scales are applied once per run and
 * group whatever the rows. */
#if defined(__AVX512BF16__)
/* Below this many rows the int16 kernel is faster than tiles: the dequantization is paid per group
 * whatever the rows, and a tile's 16 rows are mostly padding. vdpbf16ps's crossover is the
 * matrix's own (bfloat16_dot_rows): it depends on how fast the CPU issues vdpbf16ps beside the
 * int16 kernel's instructions (EPYC-Zen4, the default model's 30 layers' linears from memory:
 * 0.80-0.96x the int16 kernel's speed at 12-24 rows, 1.02x at 32, 1.14x at 64, 1.30x at 128). */
enum { AMX_MIN_ROWS = 16, BF16_PANEL_BYTES = 1024 * 1024 };

/* 32 bfloat16 of pair p: lanes 2l and 2l + 1 the values of `even` and `odd` at lane l. */
static inline __m512i interleave_bfloat16(__m512 even, __m512 odd)
{
    /* cvtne2ps puts odd's 16 values in lanes 16..31 and even's in 0..15. */
    const __m512i joined = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, joined);
}

/* Run k of a group as bfloat16 (pair p at weights + 32 p). */
static void dequantize_run(int base, const uint8_t *run, uint16_t *weights)
{
    const struct RunScales scales = run_scales(base, run);
    for (int p = 0; p < RUN / 2; p++) {
        __m512 even, odd;
        interleaved_pair_values(base, run, scales, p, &even, &odd);
        _mm512_storeu_si512(weights + p * 32, interleave_bfloat16(even, odd));
    }
}

/* The one or two groups a thread dequantizes next, run by run, while it multiplies the groups
 * before them: the dequantization and the products then overlap, where one after the other they
 * took 9.3 and 6.4 ms of a 64-row step's 16.8 (the default model's 30 layers' linears,
 * Xeon-AMX; overlapped 14.0, and 12.9-14.2 with each run's bytes prefetched GROUP_PREFETCH_BYTES
 * ahead, which made 16 rows 17-19% faster). Group j's run k goes to weights[j] + k RUN GROUP. */
struct PendingGroups {
    const uint8_t *group[2];
    int base[2], count;
    int64_t runs, done; /* runs dequantized so far, over both groups */
    uint16_t *weights[2];
};

/* Groups `first` and `first + apart` (where there is one) of `matrix`, none of them dequantized
 * yet, into `weights`. */
static struct PendingGroups pending_pair(const struct QuantizedMatrix *matrix, const int64_t first_group[],
                                         int64_t groups, int64_t runs, int64_t first, int64_t apart,
                                         uint16_t *const weights[2])
{
    struct PendingGroups pending = {.count = first + apart < groups ? 2 : 1, .runs = runs,
                                    .weights = {weights[0], weights[1]}};
    for (int j = 0; j < pending.count; j++) {
        const int64_t g = first + j * apart;
        int p = 0;
        while (g >= first_group[p + 1]) p++;
        pending.base[j] = matrix->types[p] & ~INTERLEAVED;
        pending.group[j] = matrix->data[p] + (g - first_group[p]) * runs * GROUP * block_bytes(pending.base[j]);
    }
    return pending;
}

/* Dequantizes `pending`'s runs until `target` of its count * runs are done. */
static inline void dequantize_pending(struct PendingGroups *pending, int64_t target)
{
    for (; pending->done < target; pending->done++) {
        const int j = pending->done / pending->runs;
        const int64_t k = pending->done % pending->runs;
        const int base = pending->base[j];
        const uint8_t *run = pending->group[j] + k * GROUP * block_bytes(base);
        for (int line = 0; line < GROUP * block_bytes(base); line += 64)
            __builtin_prefetch(run + GROUP_PREFETCH_BYTES + line);
        dequantize_run(base, run, pending->weights[j] + k * RUN * GROUP);
    }
}

/* The outputs of `count` activation rows from one or two groups (sums[r][j]: row r's 16 sums of
 * group j), each group's plus its `bias` (or none where NULL): a row's 16 outputs of group j go
 * to out + r out_stride + j GROUP; with `swiglu` (a pair: a gate's group and its up's) their
 * silu(gate) * up goes to out + r out_stride instead. */
static void store_group_rows(const float sums[][2][GROUP], int64_t count, int pair, const float *const bias[2],
                             int swiglu, char *out, int64_t out_stride, int out_dtype)
{
    const size_t item = dtype_size(out_dtype);
    vfloat group_bias[2] = {{0}, {0}};
    for (int j = 0; j <= pair; j++)
        if (bias[j]) memcpy(&group_bias[j], bias[j], sizeof group_bias[j]);
    for (int64_t r = 0; r < count; r++) {
        vfloat lanes[2];
        memcpy(lanes, sums[r], sizeof lanes);
        /* The SwiGLU here saves the gate_up output's round trip through memory and a pass over it
         * (2,048 rows: 12.6 MB of bfloat16 written, then read back), rounded as that pass rounds. */
        if (swiglu) {
            const vfloat activated = swiglu_lanes(round_lanes(lanes[0] + group_bias[0], out_dtype),
                                                  round_lanes(lanes[1] + group_bias[1], out_dtype), out_dtype);
            store_lanes(activated, out_dtype, out + r * out_stride * item);
            continue;
        }
        for (int j = 0; j <= pair; j++) {
            char *to = out + (r * out_stride + j * GROUP) * item;
            /* float32 outputs (the LM head's logits: 12.6 MB for 64 rows of SmolLM2) go around
             * the caches: each row gets 64 bytes at a time, too scattered for the write-allocate
             * reads to be hidden (64 rows 5.1-5.5 -> 3.8-4.1 ms, workload A +2%, Xeon-AMX). */
            if (out_dtype == DTYPE_FLOAT32 && ((uintptr_t)to & 63) == 0)
                _mm512_stream_ps((float *)to, (__m512)(lanes[j] + group_bias[j]));
            else
                store_lanes(lanes[j] + group_bias[j], out_dtype, to);
        }
    }
}

#if defined(AMX_TILES)
/* Two groups' outputs for two tiles of activation rows at a time: tile 2s + j sums tile s of the
 * activations (in ACTIVATIONS_s) times group j's weights (in WEIGHTS_j). Each tile loaded serves
 * two multiplies; with one group at a time, every multiply loaded its activations afresh from
 * L2, as fast as L2 delivers them. (Macros, not constants: the intrinsics paste the tile's
 * number into the assembly.) */
#define ACTIVATIONS_0 4
#define ACTIVATIONS_1 5
#define WEIGHTS_0 6
#define WEIGHTS_1 7

/* Outputs of one or two groups (their `runs` runs dequantized at weights[0] and, with `pair`,
 * weights[1]) for activation rows [row, row + rows) of x (bfloat16, `stride` values apart; the
 * tile from `whole_rows` on comes from `tail`, TILE_ROWS rows padded with zeros), stored by
 * store_group_rows. Unless `pending` is NULL, its runs are dequantized meanwhile, spread evenly
 * over the products. */
static void amx_group_rows(uint16_t *const weights[2], int pair, int64_t runs, const uint16_t *x, int64_t stride,
                           int64_t rows, int64_t whole_rows, const uint16_t *tail, const float *const bias[2],
                           int swiglu, char *out, int64_t out_stride, int out_dtype, struct PendingGroups *pending)
{
    const int64_t bytes = stride * 2, steps = (rows + 2 * TILE_ROWS - 1) / (2 * TILE_ROWS) * runs;
    const int64_t pending_runs = pending ? pending->count * pending->runs : 0;
    for (int64_t row = 0; row < rows; row += 2 * TILE_ROWS) {
        const int both = rows - row > TILE_ROWS;
        const uint16_t *a0 = row < whole_rows ? x + row * stride : tail;
        const uint16_t *a1 = row + TILE_ROWS < whole_rows ? x + (row + TILE_ROWS) * stride : tail;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t k = 0; k < runs; k++) {
            const int64_t column = k * RUN;
            _tile_loadd(WEIGHTS_0, weights[0] + column * GROUP, 64);
            _tile_loadd(ACTIVATIONS_0, a0 + column, bytes);
            _tile_dpbf16ps(0, ACTIVATIONS_0, WEIGHTS_0);
            if (pair) {
                _tile_loadd(WEIGHTS_1, weights[1] + column * GROUP, 64);
                _tile_dpbf16ps(1, ACTIVATIONS_0, WEIGHTS_1);
            }
            if (both) {
                _tile_loadd(ACTIVATIONS_1, a1 + column, bytes);
                _tile_dpbf16ps(2, ACTIVATIONS_1, WEIGHTS_0);
                if (pair) _tile_dpbf16ps(3, ACTIVATIONS_1, WEIGHTS_1);
            }
            const int64_t step = row / (2 * TILE_ROWS) * runs + k + 1;
            if (pending) dequantize_pending(pending, step * pending_runs / steps);
        }
        float sums[2 * TILE_ROWS][2][GROUP]; /* [activation row][group] */
        _tile_stored(0, sums[0][0], sizeof sums[0]);
        _tile_stored(1, sums[0][1], sizeof sums[0]);
        _tile_stored(2, sums[TILE_ROWS][0], sizeof sums[0]);
        _tile_stored(3, sums[TILE_ROWS][1], sizeof sums[0]);
        const int64_t count = rows - row < 2 * TILE_ROWS ? rows - row : 2 * TILE_ROWS;
        store_group_rows(sums, count, pair, bias, swiglu, out + row * out_stride * dtype_size(out_dtype), out_stride,
                         out_dtype);
    }
}
#endif

/* vdpbf16ps takes DOT_ROWS activation rows at a time: their sums of two groups are 16 of the 32
 * registers. Twelve rows (24 sums) were 5-8% slower at 32 to 512 rows on EPYC-Zen4 (the default
 * model's 30 layers' linears, alternated), their addresses reloaded from the stack at every pair:
 * the general registers hold eight. */
enum { DOT_ROWS = 8 };

/* sums[r][j] = activation row r's (x + r stride, bfloat16) products with group j's `pairs` pairs
 * of dequantized values (weights[j]), for r < count: per pair, the row's two values broadcast
 * and multiplied by the 16 rows' pairs. */
static inline __attribute__((always_inline)) void dot_rows(const uint16_t *const weights[2], int64_t pairs,
                                                         const uint16_t *x, int64_t stride, const int count,
                                                         float sums[][2][GROUP])
{
    __m512 acc[DOT_ROWS][2];
    for (int r = 0; r < count; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(weights[0] + 32 * p);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(weights[1] + 32 * p);
        for (int r = 0; r < count; r++) {
            int32_t two;
            memcpy(&two, x + r * stride + 2 * p, sizeof two);
            const __m512bh both = (__m512bh)_mm512_set1_epi32(two);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, both);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, both);
        }
    }
    for (int r = 0; r < count; r++) {
        _mm512_storeu_ps(sums[r][0], acc[r][0]);
        _mm512_storeu_ps(sums[r][1], acc[r][1]);
    }
}

/* amx_group_rows by vdpbf16ps, DOT_ROWS activation rows at a time (a lone group multiplied as
 * if paired with itself, its second sums unused). */
static void dot_group_rows(uint16_t *const weights[2], int pair, int64_t runs, const uint16_t *x, int64_t stride,
                           int64_t rows, const float *const bias[2], int swiglu, char *out, int64_t out_stride,
                           int out_dtype, struct PendingGroups *pending)
{
    const uint16_t *const both[2] = {weights[0], weights[pair]};
    const int64_t pairs = runs * RUN / 2, steps = (rows + DOT_ROWS - 1) / DOT_ROWS;
    const int64_t pending_runs = pending ? pending->count * pending->runs : 0;
    for (int64_t row = 0; row < rows; row += DOT_ROWS) {
        const int count = rows - row < DOT_ROWS ? (int)(rows - row) : DOT_ROWS;
        float sums[DOT_ROWS][2][GROUP];
        const uint16_t *rows_x = x + row * stride;
        switch (count) { /* a constant count for each, so that the rows' loop unrolls */
#define DOT_ROWS_CASE(N) \
    case N: dot_rows(both, pairs, rows_x, stride, N, sums); break;
            DOT_ROWS_CASE(1) DOT_ROWS_CASE(2) DOT_ROWS_CASE(3) DOT_ROWS_CASE(4) DOT_ROWS_CASE(5) DOT_ROWS_CASE(6)
            DOT_ROWS_CASE(7)
            default: dot_rows(both, pairs, rows_x, stride, DOT_ROWS, sums);
#undef DOT_ROWS_CASE
        }
        if (pending) dequantize_pending(pending, (row / DOT_ROWS + 1) * pending_runs / steps);
        store_group_rows(sums, count, pair, bias, swiglu, out + row * out_stride * dtype_size(out_dtype), out_stride,
                         out_dtype);
    }
}

/* Whether `rows` bfloat16 rows multiply the interleaved `matrix` by bfloat16 products: on AMX
 * tiles from AMX_MIN_ROWS rows where they are granted, else by vdpbf16ps from its measured
 * bfloat16_dot_rows. */
static int takes_bfloat16_products(const struct QuantizedMatrix *matrix, int64_t rows)
{
#if defined(AMX_TILES)
    const int64_t min_rows = amx_permitted() ? AMX_MIN_ROWS : matrix->bfloat16_dot_rows;
#else
    const int64_t min_rows = matrix->bfloat16_dot_rows;
#endif
    return min_rows && rows >= min_rows;
}

/* interleaved_matrix for bfloat16 activations `x` on AMX tiles where Linux grants them, else by
 * vdpbf16ps; or 0 where the step is too small or the kernel lacks memory (the caller then
 * computes every output with the int16 kernel). Activation rows go BF16_PANEL_BYTES at a time
 * (a panel stays in L2), each thread dequantizing its pairs of groups once per panel. With
 * `swiglu` (quantized_swiglu's), out holds silu(gate) * up, out_features / 2 a row, and group g
 * of the gates pairs with group g of the ups; otherwise groups 2p and 2p + 1. */
static int bfloat16_interleaved_matrix(const struct QuantizedMatrix *matrix, int64_t in_features, const uint16_t *x,
                                       int64_t rows, const float *bias, char *out, int64_t out_features,
                                       int out_dtype, int num_threads, int swiglu)
{
#if defined(AMX_TILES)
    const int amx = amx_permitted();
    enum { ROW_BLOCK = 2 * TILE_ROWS };
#else
    enum { ROW_BLOCK = DOT_ROWS };
#endif
    if (!takes_bfloat16_products(matrix, rows)) return 0;
    int64_t first_group[4] = {0};
    for (int p = 0; p < matrix->parts; p++) first_group[p + 1] = first_group[p] + matrix->rows[p] / GROUP;
    const int64_t groups = first_group[matrix->parts], runs = in_features / RUN;
#if defined(AMX_TILES)
    /* Tiles take 16 rows: the last few come from a copy padded with zeros. */
    const int64_t whole_rows = amx ? rows / TILE_ROWS * TILE_ROWS : rows;
    uint16_t *tail = amx ? calloc((size_t)(TILE_ROWS * in_features), sizeof *tail) : NULL;
    if (amx && !tail) return 0;
    if (amx) memcpy(tail, x + whole_rows * in_features, (size_t)((rows - whole_rows) * in_features) * sizeof *tail);
#endif
    int64_t panel = BF16_PANEL_BYTES / (in_features * 2) / ROW_BLOCK * ROW_BLOCK;
    if (panel < ROW_BLOCK) panel = ROW_BLOCK;
    const size_t item = dtype_size(out_dtype), group_values = (size_t)(runs * RUN * GROUP);
    const int64_t pairs = swiglu ? groups / 2 : (groups + 1) / 2, apart = swiglu ? groups / 2 : 1;
    const int64_t panels = (rows + panel - 1) / panel, out_width = swiglu ? out_features / 2 : out_features;
    /* A single tile of rows multiplies too briefly to hide the next groups' dequantization, and
     * the second set of tiles would push the first out of L1 (16 rows 4-7% slower so). */
    const int overlap = rows > 16;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* Two sets of two groups' weights: the pair multiplied now, and the next, dequantized
         * meanwhile (without the overlap, both sets are the same memory). */
        uint16_t *buffer = aligned_alloc(64, (overlap ? 4 : 2) * group_values * sizeof *buffer);
        uint16_t *const second_set = overlap && buffer ? buffer + 2 * group_values : buffer;
        uint16_t *const weights[2][2] = {{buffer, buffer + group_values}, {second_set, second_set + group_values}};
        failed = buffer == NULL;
        const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
        /* The thread's pairs of groups, the same in every panel; its items are (panel, pair). */
        const int64_t first_pair = thread * pairs / threads, own_pairs = (thread + 1) * pairs / threads - first_pair;
        const int64_t items = failed ? 0 : own_pairs * panels;
#if defined(AMX_TILES)
        if (!failed && amx) configure_tiles();
#endif
        struct PendingGroups next = {0};
        const int64_t pair_stride = swiglu ? 1 : 2; /* from one pair's first group to the next one's */
        if (items) {
            next = pending_pair(matrix, first_group, groups, runs, pair_stride * first_pair, apart, weights[0]);
            dequantize_pending(&next, next.count * runs);
        }
        for (int64_t n = 0; n < items; n++) {
            const int64_t g = pair_stride * (first_pair + n % own_pairs), row = n / own_pairs * panel;
            const int64_t panel_rows = rows - row < panel ? rows - row : panel;
            const struct PendingGroups current = next;
            const int64_t next_first = pair_stride * (first_pair + (n + 1) % own_pairs);
            next = n + 1 < items
                       ? pending_pair(matrix, first_group, groups, runs, next_first, apart, weights[(n + 1) % 2])
                       : (struct PendingGroups){0};
            const int pair = current.count == 2;
            const float *const group_bias[2] = {bias ? bias + g * GROUP : NULL,
                                                bias && pair ? bias + (g + apart) * GROUP : NULL};
            char *group_out = out + (row * out_width + g * GROUP) * item;
#if defined(AMX_TILES)
            if (amx)
                amx_group_rows(current.weights, pair, runs, x + row * in_features, in_features, panel_rows,
                               whole_rows - row, tail, group_bias, swiglu, group_out, out_width, out_dtype,
                               overlap ? &next : NULL);
            else
#endif
                dot_group_rows(current.weights, pair, runs, x + row * in_features, in_features, panel_rows,
                               group_bias, swiglu, group_out, out_width, out_dtype, overlap ? &next : NULL);
            dequantize_pending(&next, next.count * runs);
        }
#if defined(AMX_TILES)
        if (!failed && amx) _tile_release();
#endif
        _mm_sfence(); /* the streamed outputs are visible to every thread before the region ends */
        free(buffer);
    }
#if defined(AMX_TILES)
    free(tail);
#endif
    return !failed;
}
#endif

int gguf_linear_supports(int type, int64_t in_features)
{
    return block_values(type) != 0 && in_features % block_values(type) == 0;
}

/* GGUF_OK where the kernels take `matrix`'s parts for rows of `in_features` values, with its
 * rows in all in `out_features` and whether every part is interleaved in `interleaved`. */
static int check_matrix(const struct QuantizedMatrix *matrix, int64_t in_features, int64_t *out_features,
                        int *interleaved)
{
    *out_features = 0;
    *interleaved = 1;
    for (int p = 0; p < matrix->parts; p++) {
        if (!block_values(matrix->types[p])) return GGUF_UNSUPPORTED_TYPE;
        if (!gguf_linear_supports(matrix->types[p], in_features)) return GGUF_BAD_SHAPE;
        if (matrix->types[p] & INTERLEAVED && matrix->rows[p] % GROUP) return GGUF_BAD_SHAPE;
        *out_features += matrix->rows[p];
        *interleaved &= (matrix->types[p] & INTERLEAVED) != 0;
    }
    return GGUF_OK;
}

/* out[m, :] = x[m, :] W^T + bias for m < rows: W is the parts of `matrix` stacked by rows, x in
 * `x_dtype` [rows, in_features], bias float32 [all parts' rows] or NULL, out [rows, all parts'
 * rows] in `out_dtype`, all contiguous. Returns GGUF_OK, GGUF_UNSUPPORTED_TYPE, GGUF_BAD_SHAPE
 * (in_features is not whole blocks of some part) or GGUF_NO_MEMORY, before writing anything. */
int quantized_linear(const struct QuantizedMatrix *matrix, const void *x, int x_dtype, int64_t rows,
                     int64_t in_features, const float *bias, void *out, int out_dtype, int num_threads)
{
    int64_t out_features;
    int interleaved;
    const int status = check_matrix(matrix, in_features, &out_features, &interleaved);
    if (status != GGUF_OK) return status;
#if defined(__AVX512BF16__)
    if (interleaved && x_dtype == DTYPE_BFLOAT16 &&
        bfloat16_interleaved_matrix(matrix, in_features, x, rows, bias, out, out_features, out_dtype, num_threads, 0))
        return GGUF_OK;
#endif
    const int64_t runs_per_row = in_features / RUN;
    /* Aligned for the vector loads of QuantizedRun.q (malloc guarantees 16 bytes). */
    struct QuantizedRun *quantized = aligned_alloc(_Alignof(struct QuantizedRun),
                                                   sizeof *quantized * (size_t)(rows * runs_per_row));
    if (!quantized) return GGUF_NO_MEMORY;
    if (rows == 1) { /* outside any parallel region: a serialized one still sets up a team (layers.c) */
        quantize_row(x, x_dtype, 0, in_features, quantized);
    } else {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t m = 0; m < rows; m++) quantize_row(x, x_dtype, m, in_features, quantized + m * runs_per_row);
    }
    if (interleaved) {
        interleaved_matrix(matrix, in_features, quantized, rows, bias, out, out_features, out_dtype, num_threads);
        free(quantized);
        return GGUF_OK;
    }
    int64_t column = 0;
    for (int p = 0; p < matrix->parts; p++) {
        const float *part_bias = bias ? bias + column : NULL;
        char *part_out = (char *)out + column * dtype_size(out_dtype);
        if (matrix->types[p] & INTERLEAVED) { /* beside parts of other layouts */
            const struct QuantizedMatrix part = {1, {matrix->types[p]}, {matrix->rows[p]}, {matrix->data[p]},
                                                 matrix->bfloat16_dot_rows};
            interleaved_matrix(&part, in_features, quantized, rows, part_bias, part_out, out_features, out_dtype,
                               num_threads);
        } else {
            linear_part(matrix->types[p], matrix->data[p], matrix->rows[p], in_features, quantized, rows, part_bias,
                        part_out, out_features, out_dtype, num_threads);
        }
        column += matrix->rows[p];
    }
    free(quantized);
    return GGUF_OK;
}

/* out[m, :] = silu(g) * u for m < rows, where [g | u] = x[m, :] W^T + bias is what quantized_linear
 * computes (W's first half of rows the gates', the second the ups'; out has half as many
 * columns), each rounded to `out_dtype` before the SwiGLU as silu_and_mul takes them: the same
 * bits as the two calls. Returns as quantized_linear, GGUF_BAD_SHAPE also for an odd row count. */
int quantized_swiglu(const struct QuantizedMatrix *matrix, const void *x, int x_dtype, int64_t rows,
                     int64_t in_features, const float *bias, void *out, int out_dtype, int num_threads)
{
    int64_t out_features;
    int interleaved;
    const int status = check_matrix(matrix, in_features, &out_features, &interleaved);
    if (status != GGUF_OK) return status;
    if (out_features % 2) return GGUF_BAD_SHAPE;
#if defined(__AVX512BF16__)
    if (interleaved && x_dtype == DTYPE_BFLOAT16 && out_features / 2 % GROUP == 0 &&
        bfloat16_interleaved_matrix(matrix, in_features, x, rows, bias, out, out_features, out_dtype, num_threads, 1))
        return GGUF_OK;
#endif
    char *gate_up = malloc((size_t)(rows * out_features) * dtype_size(out_dtype));
    if (!gate_up) return GGUF_NO_MEMORY;
    const int linear_status = quantized_linear(matrix, x, x_dtype, rows, in_features, bias, gate_up, out_dtype,
                                               num_threads);
    if (linear_status == GGUF_OK) silu_and_mul(gate_up, out, rows, (int)(out_features / 2), out_dtype, num_threads);
    free(gate_up);
    return linear_status;
}

/* ---- Inside a parallel region -----------------------------------------------------------------
 * A decode step's stack of layers runs in one parallel region (decoder_layer.c), through
 * quantized_linear's int16 path in these two parts. */

/* Whether quantized_linear_in_region multiplies `matrix` for `rows` rows of `x_dtype`: every part
 * interleaved, and a step the int16 kernel takes (not the bfloat16 products'). */
int quantized_linear_in_region_supports(const struct QuantizedMatrix *matrix, int x_dtype, int64_t rows)
{
    for (int p = 0; p < matrix->parts; p++)
        if (!(matrix->types[p] & INTERLEAVED)) return 0;
#if defined(__AVX512BF16__)
    if (x_dtype == DTYPE_BFLOAT16 && takes_bfloat16_products(matrix, rows)) return 0;
#else
    (void)x_dtype;
    (void)rows;
#endif
    return 1;
}

/* Bytes of the quantized activations of `rows` rows of `in_features` values. */
size_t quantized_activations_bytes(int64_t rows, int64_t in_features)
{
    return sizeof(struct QuantizedRun) * (size_t)(rows * (in_features / RUN));
}

/* quantized_linear's activations, every row on the calling thread, into `quantized`
 * (quantized_activations_bytes of them, aligned to 64 bytes). */
void quantize_activations(const void *x, int x_dtype, int64_t rows, int64_t in_features, void *quantized)
{
    struct QuantizedRun *runs = quantized;
    for (int64_t m = 0; m < rows; m++) quantize_row(x, x_dtype, m, in_features, runs + m * (in_features / RUN));
}

/* quantized_linear's int16 path on activations quantize_activations quantized (each thread may
 * pass its own copy), for a matrix quantized_linear_in_region_supports: its groups shared among
 * the threads of the region it is called in; returns after their barrier. */
void quantized_linear_in_region(const struct QuantizedMatrix *matrix, const void *quantized, int64_t rows,
                                int64_t in_features, const float *bias, void *out, int out_dtype)
{
    int64_t out_features = 0;
    for (int p = 0; p < matrix->parts; p++) out_features += matrix->rows[p];
    interleaved_groups(matrix, in_features, quantized, rows, bias, out, out_features, out_dtype);
#pragma omp barrier
}

/* The 16 values of a decoded half-run, in float32: exactly ggml's float32 dequantization, one
 * rounding per multiply and per add (so no multiply-add is fused here). */
static inline __attribute__((always_inline, optimize("fp-contract=off"))) vfloat half_run_values(
    int type, const struct DecodedRun *run, int h)
{
#if defined(VECTORS_ARE_AVX2_PAIRS)
    /* In AVX2's own registers: GCC widened the 16 codes to floats one at a time. */
    const __m128i codes = _mm_loadu_si128((const __m128i *)&run->u[h]);
    const __m128i upper = _mm_srli_si128(codes, 8);
    const __m256 scale8 = _mm256_set1_ps(run->scale[h]);
    __m256 values[2];
    for (int i = 0; i < 2; i++) {
        const __m128i eight = i ? upper : codes;
        const __m256i integers = type == GGML_Q8_0 ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
        const __m256 u8 = _mm256_cvtepi32_ps(integers);
        if (type == GGML_Q8_0)
            values[i] = _mm256_mul_ps(scale8, u8);
        else if (run->zero)
            values[i] = _mm256_mul_ps(scale8, _mm256_sub_ps(u8, _mm256_set1_ps((float)run->zero)));
        else
            values[i] = _mm256_add_ps(_mm256_mul_ps(scale8, u8), _mm256_set1_ps(run->offset[h]));
    }
    vfloat result;
    memcpy(&result, values, sizeof result);
    return result;
#else
    const vfloat scale = (vfloat){0} + run->scale[h];
    if (type == GGML_Q8_0) return scale * __builtin_convertvector((i8x16)run->u[h], vfloat);
    const vfloat u = __builtin_convertvector(run->u[h], vfloat);
    if (run->zero) return scale * (u - (float)run->zero);
    return scale * u + run->offset[h];
#endif
}

/* out = the float values of stored row `stored` of `cols` values of `type` blocks (either layout),
 * rounded to `out_dtype`. */
__attribute__((optimize("fp-contract=off"))) static void dequantize_row(const uint8_t *data, int type, int64_t cols,
                                                                     int64_t stored, void *out, int out_dtype)
{
    const int base = type & ~INTERLEAVED;
    const int64_t runs_per_row = cols / RUN, runs_per_block = block_values(type) / RUN;
    const int64_t row_bytes = cols / block_values(type) * block_bytes(type);
    const size_t item = dtype_size(out_dtype);
    for (int64_t k = 0; k < runs_per_row; k++) {
        struct DecodedRun run;
        if (type & INTERLEAVED)
            decode_interleaved_run(base, data + (stored / GROUP * runs_per_row + k) * GROUP * block_bytes(base),
                                   (int)(stored % GROUP), &run);
        else
            decode_run(type, data + stored * row_bytes + k / runs_per_block * block_bytes(type),
                       (int)(k % runs_per_block), &run);
        char *destination = (char *)out + k * RUN * item;
        store_lanes(half_run_values(base, &run, 0), out_dtype, destination);
        store_lanes(half_run_values(base, &run, 1), out_dtype, destination + 16 * item);
    }
}

/* out = the float values of `rows` rows of `cols` values each, stored as `type` blocks, rounded
 * to `out_dtype`: exactly ggml's float32 dequantization (half_run_values). With `ids`, out's row
 * n is stored row ids[n] (an embedding lookup), else stored row n; `stored_rows` rows are
 * stored, and an id outside [0, stored_rows) returns GGUF_ROW_OUT_OF_RANGE before anything is
 * written (checked here: a lookup's few ids cost a torch reduction more than the decode). */
__attribute__((optimize("fp-contract=off"))) int gguf_dequantize(
    const uint8_t *data, int type, int64_t rows, int64_t cols, const int64_t *ids, int64_t stored_rows, void *out,
    int out_dtype, int num_threads)
{
    if (!block_values(type)) return GGUF_UNSUPPORTED_TYPE;
    for (int64_t n = 0; ids && n < rows; n++)
        if (ids[n] < 0 || ids[n] >= stored_rows) return GGUF_ROW_OUT_OF_RANGE;
    if (cols % block_values(type) || (type & INTERLEAVED && !ids && rows % GROUP)) return GGUF_BAD_SHAPE;
#if defined(__AVX512BW__)
    if (type & INTERLEAVED && !ids) {
        dequantize_interleaved(type & ~INTERLEAVED, data, rows, cols, out, out_dtype, num_threads);
        return GGUF_OK;
    }
#endif
    if (rows == 1) { /* a decode step's embedding lookup: outside any parallel region (layers.c) */
        dequantize_row(data, type, cols, ids ? ids[0] : 0, out, out_dtype);
        return GGUF_OK;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < rows; n++)
        dequantize_row(data, type, cols, ids ? ids[n] : n, (char *)out + n * cols * (int64_t)dtype_size(out_dtype),
                       out_dtype);
    return GGUF_OK;
}

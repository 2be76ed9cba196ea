/* e2m1 rounding, the FP4 simulation of the indexer and the Hadamard rotation (fp4.h). */
#include "kernels/fp4.h"
#include "kernels/fp8.h"
#include "kernels/ops.h"

#include <assert.h>
#include <immintrin.h>
#include <math.h>

/* The 8 magnitudes of e2m1 (1 sign, 2 exponent, 1 mantissa bits; bias 1; code 1 the subnormal
 * 0.5), by code. */
static const float e2m1_mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

float pd_e2m1_decode(uint8_t c)
{
    float v = e2m1_mag[c & 7];
    return c & 8 ? -v : v;
}

uint8_t pd_e2m1_encode(float x)
{
    /* midpoints between consecutive magnitudes: above mid[c] the value rounds past code c */
    static const float mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    uint8_t sign = signbit(x) ? 8 : 0;
    float a = fabsf(x);
    if (isnan(x))
        return 0;
    if (a >= PD_E2M1_MAX)
        return sign | 7;
    int c = 0;
    while (c < 7 && a > mid[c])
        c++;
    /* exactly at a midpoint: the even code of the two (codes ascend with magnitude and
     * adjacent codes differ in parity) */
    if (c < 7 && a == mid[c] && c % 2)
        c++;
    return sign | (uint8_t)c;
}

/* The portable block loop of pd_fp4_simulate over x[from, len) of a block with scale s. */
static void fp4_block_ref(float *x, int from, int len, float s)
{
    for (int i = from; i < len; i++)
        x[i] = pd_e2m1_decode(pd_e2m1_encode(x[i] / s)) * s;
}

/* The same 16 values at a time: the same quotient x / s; the code counted as the midpoints
 * below |q| (pd_e2m1_encode's loop stops at the first midpoint >= |q|, so it counts exactly
 * those), plus one at the odd codes' midpoints (the tie to the even code); its magnitude, the
 * sign of q (NaN: +0, as pd_e2m1_encode's code 0), times s: each value the bits of the loop. */
__attribute__((target("avx512f"))) static void fp4_block_avx512(float *x, int len, float s)
{
    static const float mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    const __m512 mag = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512 vs = _mm512_set1_ps(s);
    const __m512i one = _mm512_set1_epi32(1), sign = _mm512_set1_epi32((int)0x80000000u);
    int i = 0;
    for (; i + 16 <= len; i += 16) {
        __m512 q = _mm512_div_ps(_mm512_loadu_ps(x + i), vs);
        __m512 a = _mm512_abs_ps(q);
        __m512i c = _mm512_setzero_si512();
        for (int k = 0; k < 7; k++)
            c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(a, _mm512_set1_ps(mid[k]), _CMP_GT_OQ), c, one);
        __mmask16 tie = _mm512_cmp_ps_mask(a, _mm512_set1_ps(mid[1]), _CMP_EQ_OQ) |
                        _mm512_cmp_ps_mask(a, _mm512_set1_ps(mid[3]), _CMP_EQ_OQ) |
                        _mm512_cmp_ps_mask(a, _mm512_set1_ps(mid[5]), _CMP_EQ_OQ);
        c = _mm512_mask_add_epi32(c, tie, c, one);
        __m512i dec = _mm512_or_si512(_mm512_castps_si512(_mm512_permutexvar_ps(c, mag)),
                                      _mm512_and_si512(_mm512_castps_si512(q), sign));
        dec = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(q, q, _CMP_ORD_Q), dec);
        _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_castsi512_ps(dec), vs));
    }
    fp4_block_ref(x, i, len, s);
}

/* fp4_block_avx512 8 values at a time for CPUs with AVX2 only: the compare masks (all ones) are
 * subtracted to count, the magnitude picked by a lane permute; each value the bits of the loop. */
__attribute__((target("avx2"))) static void fp4_block_avx2(float *x, int len, float s)
{
    static const float mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    const __m256 mag = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const __m256 vs = _mm256_set1_ps(s), abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
    int i = 0;
    for (; i + 8 <= len; i += 8) {
        __m256 q = _mm256_div_ps(_mm256_loadu_ps(x + i), vs);
        __m256 a = _mm256_and_ps(q, abs);
        __m256i c = _mm256_setzero_si256();
        for (int k = 0; k < 7; k++)
            c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(mid[k]), _CMP_GT_OQ)));
        __m256 tie = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(a, _mm256_set1_ps(mid[1]), _CMP_EQ_OQ),
                                               _mm256_cmp_ps(a, _mm256_set1_ps(mid[3]), _CMP_EQ_OQ)),
                                  _mm256_cmp_ps(a, _mm256_set1_ps(mid[5]), _CMP_EQ_OQ));
        c = _mm256_sub_epi32(c, _mm256_castps_si256(tie));
        __m256i dec = _mm256_or_si256(_mm256_castps_si256(_mm256_permutevar8x32_ps(mag, c)),
                                      _mm256_and_si256(_mm256_castps_si256(q), sign));
        dec = _mm256_and_si256(dec, _mm256_castps_si256(_mm256_cmp_ps(q, q, _CMP_ORD_Q)));
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_castsi256_ps(dec), vs));
    }
    fp4_block_ref(x, i, len, s);
}

void pd_fp4_simulate(float *x, int n, int block)
{
    const int avx512 = __builtin_cpu_supports("avx512f"), avx2 = __builtin_cpu_supports("avx2");
    for (int k = 0; k < n; k += block) {
        int len = n - k < block ? n - k : block;
        float amax = 0;
        for (int i = 0; i < len; i++)
            amax = fabsf(x[k + i]) > amax ? fabsf(x[k + i]) : amax;
        float s = pd_ue8m0_value(pd_ue8m0_scale(amax, PD_E2M1_MAX, PD_E2M1_MAX * 0x1p-126f));
        if (avx512)
            fp4_block_avx512(x + k, len, s);
        else if (avx2)
            fp4_block_avx2(x + k, len, s);
        else
            fp4_block_ref(x + k, 0, len, s);
    }
}

void pd_fp4_simulate_ref(float *x, int n, int block)
{
    for (int k = 0; k < n; k += block) {
        int len = n - k < block ? n - k : block;
        float amax = 0;
        for (int i = 0; i < len; i++)
            amax = fabsf(x[k + i]) > amax ? fabsf(x[k + i]) : amax;
        fp4_block_ref(x + k, 0, len, pd_ue8m0_value(pd_ue8m0_scale(amax, PD_E2M1_MAX, PD_E2M1_MAX * 0x1p-126f)));
    }
}

/* pd_hadamard 16 values a vector: stages of h >= 16 between whole vectors, h < 16 inside each
 * (the partner lane j ^ h by a permute; the lower lane of a pair takes self + partner, the upper
 * partner - self: a + b and a - b of the loop, the same additions), then the same scale. */
__attribute__((target("avx512f"))) static void hadamard_avx512(float *x, int n)
{
    for (int h = 1; h < 16; h *= 2) {
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i idx = _mm512_xor_si512(lane, _mm512_set1_epi32(h));
        const __mmask16 hi = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(h));
        for (int i = 0; i < n; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i), p = _mm512_permutexvar_ps(idx, v);
            _mm512_storeu_ps(x + i, _mm512_mask_blend_ps(hi, _mm512_add_ps(v, p), _mm512_sub_ps(p, v)));
        }
    }
    for (int h = 16; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j += 16) {
                __m512 a = _mm512_loadu_ps(x + j), b = _mm512_loadu_ps(x + j + h);
                _mm512_storeu_ps(x + j, _mm512_add_ps(a, b));
                _mm512_storeu_ps(x + j + h, _mm512_sub_ps(a, b));
            }
    const __m512 s = _mm512_set1_ps(1.0f / sqrtf((float)n));
    for (int i = 0; i < n; i += 16)
        _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), s));
}

/* hadamard_avx512 with 8-lane vectors, for CPUs with AVX2 only (the upper lanes of a pair picked
 * by a blend on the lane's bit h). */
__attribute__((target("avx2"))) static void hadamard_avx2(float *x, int n)
{
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int h = 1; h < 8; h *= 2) {
        const __m256i idx = _mm256_xor_si256(lane, _mm256_set1_epi32(h));
        const __m256 hi = _mm256_castsi256_ps(
            _mm256_cmpeq_epi32(_mm256_and_si256(lane, _mm256_set1_epi32(h)), _mm256_set1_epi32(h)));
        for (int i = 0; i < n; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i), p = _mm256_permutevar8x32_ps(v, idx);
            _mm256_storeu_ps(x + i, _mm256_blendv_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), hi));
        }
    }
    for (int h = 8; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j += 8) {
                __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + h);
                _mm256_storeu_ps(x + j, _mm256_add_ps(a, b));
                _mm256_storeu_ps(x + j + h, _mm256_sub_ps(a, b));
            }
    const __m256 s = _mm256_set1_ps(1.0f / sqrtf((float)n));
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), s));
}

void pd_hadamard(float *x, int n)
{
    assert(n > 0 && (n & (n - 1)) == 0);
    if (n >= 16 && __builtin_cpu_supports("avx512f")) {
        hadamard_avx512(x, n);
        return;
    }
    if (n >= 8 && __builtin_cpu_supports("avx2")) {
        hadamard_avx2(x, n);
        return;
    }
    pd_hadamard_ref(x, n);
}

void pd_hadamard_ref(float *x, int n)
{
    assert(n > 0 && (n & (n - 1)) == 0);
    for (int h = 1; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    float s = 1.0f / sqrtf((float)n);
    for (int i = 0; i < n; i++)
        x[i] *= s;
}

/* pd_f32_to_bf16 then back, 16 values a vector: NaN to its quiet NaN (top half | 0x40), others
 * rounded to nearest even by the same integer addition. */
__attribute__((target("avx512f"))) static void bf16_round_avx512(float *x, int n)
{
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u), quiet = _mm512_set1_epi32(0x400000);
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i u = _mm512_loadu_si512(x + i);
        __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs), inf);
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
        r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, quiet));
        _mm512_storeu_si512(x + i, _mm512_and_si512(r, top));
    }
    for (; i < n; i++)
        x[i] = pd_bf16_to_f32(pd_f32_to_bf16(x[i]));
}

/* bf16_round_avx512 8 values at a time, for CPUs with AVX2 only (|u| fits a signed compare). */
__attribute__((target("avx2"))) static void bf16_round_avx2(float *x, int n)
{
    const __m256i abs = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i top = _mm256_set1_epi32((int)0xffff0000u), quiet = _mm256_set1_epi32(0x400000);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i u = _mm256_loadu_si256((const __m256i *)(x + i));
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs), inf);
        __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                         _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
        r = _mm256_blendv_epi8(r, _mm256_or_si256(u, quiet), nan);
        _mm256_storeu_si256((__m256i *)(x + i), _mm256_and_si256(r, top));
    }
    for (; i < n; i++)
        x[i] = pd_bf16_to_f32(pd_f32_to_bf16(x[i]));
}

void pd_bf16_round(float *x, int n)
{
    if (__builtin_cpu_supports("avx512f")) {
        bf16_round_avx512(x, n);
        return;
    }
    if (__builtin_cpu_supports("avx2")) {
        bf16_round_avx2(x, n);
        return;
    }
    for (int i = 0; i < n; i++)
        x[i] = pd_bf16_to_f32(pd_f32_to_bf16(x[i]));
}

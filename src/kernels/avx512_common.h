/* Internal to kernels/: the pieces the AVX-512 VNNI GEMM files share (gemm_avx512.c, the decode
 * GEMV; gemm_avx512_small.c, the inner product for few tokens; gemm_vnni.c): the target attribute,
 * the byte-tail mask, the one-instruction vpdpbusd, the loads and the four-vector reduction. */
#ifndef PD_KERNELS_AVX512_COMMON_H
#define PD_KERNELS_AVX512_COMMON_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define INLINE static inline __attribute__((always_inline))

/* The load mask for the last `rem` (< 64) bytes of a row. */
INLINE AVX512 __mmask64 tail_mask(int rem)
{
    return rem >= 64 ? ~0ULL : (1ULL << rem) - 1;
}

/* c += sum of 4-byte groups of unsigned w times signed a, written as a one-instruction asm
 * statement on named variables: GCC 12 handles the intrinsic's read-modify-write accumulator
 * badly (a register copy, often a spill, per instruction), while "+v" keeps every accumulator in
 * its register (gemm_avx512.c measures it). */
#define DP(c, w, a) __asm__("vpdpbusd %2, %1, %0" : "+v"(c) : "v"(w), "v"(a))
/* Whole and tail (masked, `m` in scope) 64-byte loads. */
#define FULL(p) _mm512_loadu_si512(p)
#define MASKED(p) _mm512_maskz_loadu_epi8(m, p)

/* The 4 x 32-bit sums of 4 vectors: lane r = sum of the 16 lanes of v_r. */
INLINE AVX512 __m128i reduce4(__m512i v0, __m512i v1, __m512i v2, __m512i v3)
{
    /* In each 128-bit chunk: [v0 0+2, v1 0+2, v0 1+3, v1 1+3], likewise for v2, v3. */
    __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(v0, v1), _mm512_unpackhi_epi32(v0, v1));
    __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(v2, v3), _mm512_unpackhi_epi32(v2, v3));
    /* In each chunk: [v0, v1, v2, v3] summed over that chunk; then add the four chunks. */
    __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
    __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* The 4 bytes at p in every 32-bit lane. */
INLINE AVX512 __m512i broadcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* The 8 bytes at p in every 64-bit lane. */
INLINE AVX512 __m512i broadcast8(const int8_t *p)
{
    int64_t v;
    memcpy(&v, p, 8);
    return _mm512_set1_epi64(v);
}

/* Transposes 16 rows of 16 dwords (r[i] = row i) so that r[j] holds dword j of every row (lane i
 * = row i), in three rounds of shuffles: 32-bit, 64-bit, then the 4 x 4 of 128-bit lanes. */
INLINE AVX512 void transpose16(__m512i *r)
{
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);       /* per 128-bit lane l: dwords 4l, 4l+1 */
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);   /* dwords 4l+2, 4l+3 */
    }
    /* u[4g + e]: in 128-bit lane l, dword 4l+e of rows 4g .. 4g+3 */
    for (int g = 0; g < 4; g++) {
        u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    /* dword 4l+e of all rows: 128-bit lane l of u[e], u[4+e], u[8+e], u[12+e], in that order */
    for (int e = 0; e < 4; e++) {
        __m512i x0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44);        /* a0 a1 b0 b1 */
        __m512i x1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xee);        /* a2 a3 b2 b3 */
        __m512i x2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);   /* c0 c1 d0 d1 */
        __m512i x3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xee);   /* c2 c3 d2 d3 */
        r[0 + e] = _mm512_shuffle_i32x4(x0, x2, 0x88);                  /* a0 b0 c0 d0 */
        r[4 + e] = _mm512_shuffle_i32x4(x0, x2, 0xdd);                  /* a1 b1 c1 d1 */
        r[8 + e] = _mm512_shuffle_i32x4(x1, x3, 0x88);
        r[12 + e] = _mm512_shuffle_i32x4(x1, x3, 0xdd);
    }
}

#endif

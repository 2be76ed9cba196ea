/* AVX2 GEMM path (for CPUs without AVX-512 VNNI). Each int8 is sign-extended to int16 and pairs
 * are multiplied and summed by vpmaddwd into int32. This is exact for every int8 value, -128
 * included; the cheaper vpmaddubsw route would saturate its int16 pair sums or need weights
 * restricted to [-127, 127]. Register tile: 4 weight rows x up to 3 tokens (12 accumulators, 3
 * widened activations, 1 widened weight, 1 product: GCC keeps one accumulator on the stack, as
 * fast here as the 4 x 2 tile without a spill, with fewer weight loads per product). Reductions shorter than 16
 * finish in scalar code, so any `in` works. Compiled with target attributes, so the rest of the
 * build stays -march=x86-64-v2; gemm.c calls it only when the CPU has AVX2. */
#include <immintrin.h>

#include "kernels/gemm_impl.h"

#define AVX2 __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))

enum { TILE_R = 4, TILE_U = 3 };

INLINE AVX2 int32_t hsum8(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* acc[u * TILE_R + r] = sum_k wr[r][k] * ar[u][k] for r < 4, u < U (U constant once inlined).
 * Named accumulators rather than an array: GCC 12 turns an array of them into register copies
 * and a spill per step. */
INLINE AVX2 void tile(const int8_t *const *wr, const int8_t *const *ar, int in, int U,
                      int32_t *acc)   // [U, TILE_R]
{
    const __m256i z = _mm256_setzero_si256();
    __m256i c00 = z, c01 = z, c02 = z, c10 = z, c11 = z, c12 = z;
    __m256i c20 = z, c21 = z, c22 = z, c30 = z, c31 = z, c32 = z;
    __m256i a0 = z, a1 = z, a2 = z, w;
#define WIDEN(p) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p)))
#define ROW(r)                                                                                   \
    w = WIDEN(wr[r] + k);                                                                        \
    c##r##0 = _mm256_add_epi32(c##r##0, _mm256_madd_epi16(w, a0));                               \
    if (U > 1) c##r##1 = _mm256_add_epi32(c##r##1, _mm256_madd_epi16(w, a1));                    \
    if (U > 2) c##r##2 = _mm256_add_epi32(c##r##2, _mm256_madd_epi16(w, a2))
    int k = 0;
    for (; k + 16 <= in; k += 16) {
        a0 = WIDEN(ar[0] + k);
        if (U > 1) a1 = WIDEN(ar[1] + k);
        if (U > 2) a2 = WIDEN(ar[2] + k);
        ROW(0);
        ROW(1);
        ROW(2);
        ROW(3);
    }
#undef ROW
#undef WIDEN
    const __m256i c[TILE_R][TILE_U] = {{c00, c01, c02}, {c10, c11, c12}, {c20, c21, c22},
                                       {c30, c31, c32}};
    for (int r = 0; r < TILE_R; r++) {
        for (int u = 0; u < U; u++) {
            int32_t s = hsum8(c[r][u]);
            for (int kk = k; kk < in; kk++)
                s += (int32_t)wr[r][kk] * (int32_t)ar[u][kk];
            acc[u * TILE_R + r] = s;
        }
    }
}

#define INSTANTIATE(U)                                                                           \
    static AVX2 __attribute__((noinline)) void tile_r4u##U(                                      \
        const int8_t *const *wr, const int8_t *const *ar, int in, int32_t *acc)                  \
    {                                                                                            \
        tile(wr, ar, in, U, acc);                                                                \
    }
INSTANTIATE(1)
INSTANTIATE(2)
INSTANTIATE(3)
#undef INSTANTIATE

AVX2 void pd_gemm_rows_avx2(const pd_gemm_job *job, int o0, int o1)
{
    const int in = job->in;
    /* Tokens outer, rows inner: the task's weight rows (sized by gemm.c to fit L2) are swept once
     * per block of 3 tokens while those activation rows stay in L1. */
    for (int i0 = 0; i0 < job->n; i0 += TILE_U) {
        int nu = job->n - i0 < TILE_U ? job->n - i0 : TILE_U;
        const int8_t *ar[TILE_U];
        for (int u = 0; u < TILE_U; u++)
            ar[u] = pd_gemm_job_arow(job, i0 + (u < nu ? u : 0));
        for (int o = o0; o < o1; o += TILE_R) {
            int nr = o1 - o < TILE_R ? o1 - o : TILE_R;
            /* Past the last row the tile re-reads that row; its results are not stored. */
            const int8_t *wr[TILE_R];
            for (int r = 0; r < TILE_R; r++)
                wr[r] = job->w + (int64_t)(o + (r < nr ? r : nr - 1)) * in;
            int32_t acc[TILE_U * TILE_R];
            switch (nu) {
            case 1: tile_r4u1(wr, ar, in, acc); break;
            case 2: tile_r4u2(wr, ar, in, acc); break;
            default: tile_r4u3(wr, ar, in, acc); break;
            }
            pd_gemm_store(job, i0, nu, o, nr, acc, TILE_R);
        }
    }
}

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

/* Decode (at most TILE_U tokens: one sweep of the rows) on rows of at most PF_MAX_IN bytes
 * prefetches the tile about PF_L2_BYTES ahead into L2: a routed expert's matrix is a few pages of
 * short rows, which end before the hardware prefetchers have caught on. Measured on an AVX2-only
 * AMD EPYC host, `pdmoe bench decode --batch 16 --threads 1` (routed experts of one or two tokens),
 * CPU ms per step, busy host, three rounds alternating: no prefetch 54-58; 8 KiB ahead into L1
 * 40-51; 24 KiB ahead into L2 41-44; both 42-49 (as the AVX-512 GEMV does, gemm_avx512.c); L2 12
 * KiB ahead 43-45, 48 KiB 44-47. */
enum { PF_L2_BYTES = 24576, PF_MAX_IN = PD_GEMM_FEW_MAX_IN };

/* Rows to prefetch ahead: about `bytes`, whole tiles. */
static inline int pf_ahead(int in, int bytes)
{
    return (bytes / in + TILE_R - 1) / TILE_R * TILE_R;
}

/* The tile `ahead` rows on from row o, within the matrix or past its end in the next one
 * (job->w_next); NULL when there is nothing more to read. */
static inline const int8_t *pf_at(const pd_gemm_job *job, int o, int ahead)
{
    if (o + ahead + TILE_R <= job->out)
        return job->w + (int64_t)(o + ahead) * job->in;
    int at = o + ahead - job->out;
    return job->w_next && at >= 0 && at + TILE_R <= job->next_out ? job->w_next + (int64_t)at * job->in : NULL;
}

/* The tile at `p` (TILE_R contiguous rows of `in` bytes) into L2. */
static inline void prefetch_l2(const int8_t *p, int in)
{
    for (int k = 0; k < TILE_R * in; k += 64)
        _mm_prefetch((const char *)p + k, _MM_HINT_T1);
}

AVX2 void pd_gemm_rows_avx2(const pd_gemm_job *job, int o0, int o1)
{
    const int in = job->in, pf = job->n <= TILE_U && in <= PF_MAX_IN;
    const int ahead = pf ? pf_ahead(in, PF_L2_BYTES) : 0;
    /* the rows' weight scales first: a routed expert's are cold (gemm_avx512.c) */
    for (int o = o0; pf && o < o1; o += 16)
        _mm_prefetch((const char *)(job->w_scale + o), _MM_HINT_T0);
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
            const int8_t *p = pf ? pf_at(job, o, ahead) : NULL;
            if (p)
                prefetch_l2(p, in);
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

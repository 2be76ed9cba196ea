/* AVX2 GEMM path (for CPUs without AVX-512 VNNI). Each int8 is sign-extended to int16 and pairs
 * are multiplied and summed by vpmaddwd into int32. This is exact for every int8 value, -128
 * included; the cheaper vpmaddubsw route saturates its int16 pair sums unless one side avoids
 * -128, so it serves only one token whose activations hold no -128 (tile_sgn, below: every
 * decode GEMV, as pd_quant_rows never makes -128). Three register tiles:
 *   - one token without -128: tile_sgn, 8 weight rows at 32 bytes an instruction, in 8 streams;
 *   - up to 3 tokens (decode): 4 weight rows x 1-3 tokens, both sides widened in registers (12
 *     accumulators, 3 widened activations, 1 widened weight, 1 product: GCC keeps one accumulator
 *     on the stack), with the decode GEMV's L2 prefetch;
 *   - 4 tokens and more (prefill, routed experts of several tokens): up to 64 tokens at a time,
 *     the reduction outermost in chunks of KC values (block, below); each block of 4 tokens has
 *     its chunk widened once into an int16 buffer on the stack (16 KiB: L1), then 3 weight rows x
 *     4 tokens, each weight vector widened once for the 4 and every product taking its
 *     activations straight from that buffer (12 accumulators, 1 weight, 1 product: no spill).
 *     The product and its add are written in asm: with intrinsics GCC 12 loads the 4 activation
 *     vectors into registers once for the 3 rows and then spills 6 accumulators every step (on
 *     an AVX2-only AMD EPYC, the same loop over data in L2: 97 Gops/s with intrinsics, 150-155
 *     with the asm, against 160-164 by the VPMADDWD + VPADDD probe). The reduction's chunks add
 *     into int32 sums, exact in any order.
 * Reductions shorter than 16 finish in scalar code, so any `in` works. Compiled with target
 * attributes, so the rest of the build stays -march=x86-64-v2; gemm.c calls it only when the CPU
 * has AVX2. */
#include <immintrin.h>
#include <string.h>

#include "kernels/gemm_impl.h"

#define AVX2 __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))

enum { TILE_R = 4, TILE_U = 3 };
_Static_assert(PD_GEMM_AVX2_BLOCK_MIN == TILE_U + 1, "the blocked path takes what the decode tiles do not");

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

/* The tile of `rows` rows `ahead` rows on from row o, within the matrix or past its end in the
 * next one (job->w_next); NULL when there is nothing more to read. */
static inline const int8_t *pf_at(const pd_gemm_job *job, int o, int ahead, int rows)
{
    if (o + ahead + rows <= job->out)
        return job->w + (int64_t)(o + ahead) * job->in;
    int at = o + ahead - job->out;
    return job->w_next && at >= 0 && at + rows <= job->next_out ? job->w_next + (int64_t)at * job->in : NULL;
}

/* The tile at `p` (TILE_R contiguous rows of `in` bytes) into L2. */
static inline void prefetch_l2(const int8_t *p, int in)
{
    for (int k = 0; k < TILE_R * in; k += 64)
        _mm_prefetch((const char *)p + k, _MM_HINT_T1);
}

/* The blocked path for 4 tokens and more: tiles of BLK_R weight rows x BLK_U tokens, the
 * reduction KC values at a time, the widened activations' rows A_LD values apart (padded: rows
 * exactly 4 KiB apart measured a little slower), a call's rows at most BLK_MAX_ROWS (gemm.c's
 * tasks: 64). */
enum { BLK_R = 3, BLK_U = 4, KC = 2048, A_LD = KC + 32, BLK_MAX_ROWS = 64 };

/* c += vpmaddwd(w, *m), *m 16 int16 in memory (see the top of this file for why asm). */
#define MADD_ADD(c, w, m)                                                                        \
    __asm__("vpmaddwd %[mem], %[wv], %[t]\n\tvpaddd %[t], %[acc], %[acc]"                     \
            : [acc] "+x"(c), [t] "=&x"(t)                                                        \
            : [wv] "x"(w), [mem] "m"(*(const __m256i *)(m)))

/* acc[u * BLK_MAX_ROWS + r] += sum_k wr[r][k] * a16[u * A_LD + k] for k < len (a multiple of
 * 16), r < R (a constant once inlined: 1 to BLK_R), u < BLK_U. */
INLINE AVX2 void tile_blk(const int8_t *const *wr, const int16_t *a16, int len, int R, int32_t *acc)
{
    const __m256i z = _mm256_setzero_si256();
    __m256i c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z;
    __m256i c20 = z, c21 = z, c22 = z, c23 = z, w, t;
    const int16_t *a0 = a16, *a1 = a16 + A_LD, *a2 = a16 + 2 * A_LD, *a3 = a16 + 3 * A_LD;
#define ROW(r)                                                                                   \
    w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr[r] + k)));                     \
    MADD_ADD(c##r##0, w, a0 + k);                                                                \
    MADD_ADD(c##r##1, w, a1 + k);                                                                \
    MADD_ADD(c##r##2, w, a2 + k);                                                                \
    MADD_ADD(c##r##3, w, a3 + k)
    for (int k = 0; k < len; k += 16) {
        ROW(0);
        if (R > 1) {
            ROW(1);
        }
        if (R > 2) {
            ROW(2);
        }
    }
#undef ROW
    /* each row's 4 sums at once: 3 horizontal adds and the halves' add, then added into acc */
    const __m256i c[BLK_R][BLK_U] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23}};
    for (int r = 0; r < R; r++) {
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(c[r][0], c[r][1]), _mm256_hadd_epi32(c[r][2], c[r][3]));
        const __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        acc[0 * BLK_MAX_ROWS + r] += _mm_cvtsi128_si32(sum);
        acc[1 * BLK_MAX_ROWS + r] += _mm_extract_epi32(sum, 1);
        acc[2 * BLK_MAX_ROWS + r] += _mm_extract_epi32(sum, 2);
        acc[3 * BLK_MAX_ROWS + r] += _mm_extract_epi32(sum, 3);
    }
}

#define INSTANTIATE(R)                                                                           \
    static AVX2 __attribute__((noinline)) void tile_blk_r##R(const int8_t *const *wr, const int16_t *a16, int len, \
                                                             int32_t *acc)                       \
    {                                                                                            \
        tile_blk(wr, a16, len, R, acc);                                                          \
    }
INSTANTIATE(1)
INSTANTIATE(2)
INSTANTIATE(3)
#undef INSTANTIATE
#undef MADD_ADD

/* Rows o0 .. o1 - 1 (at most BLK_MAX_ROWS) against tokens i0 .. i1 - 1 (whole blocks of BLK_U,
 * at most SB_U of them), the reduction outermost: for each KC-value chunk, every block of BLK_U
 * tokens widens its chunk into a16 once and passes it over the rows' chunk in tiles. So a chunk of
 * the weights (BLK_MAX_ROWS x KC bytes, 128 KiB) stays in L2 while all SB_U tokens pass over it,
 * however long the rows, and the activations are read once per BLK_MAX_ROWS rows; the int32 sums
 * of the SB_U tokens wait in acc (16 KiB). While a block runs, the next one's chunk is prefetched
 * into L1 (the activations are read from L3, token rows `in` bytes apart). Before, each block of
 * 4 tokens took its rows' whole length, and tasks were cut to 16 rows at in = 14,336 to keep
 * their weights in L2, so every 16 rows read all the activations again. Measured on an AVX2-only
 * AMD EPYC (Zen 3), 512 tokens, best of 2-10 calls, rounds alternating: 4096 x 14,336 at 1 thread
 * 100-114 Gops/s before, 117-128 now, at 2 threads 231-233 before, 254-257 now; 2048 x 4096 at 2
 * threads 262-268 before, 259-263 now (1 thread: 119-129 both). Prefetching the rows' next
 * weight chunk into L2 as well measured 3-6% slower (the hardware prefetchers follow the rows);
 * so did padding the 2 or 3 tokens a routed expert has over its blocks of 4 into one more. */
enum { SB_U = 64 };

static AVX2 void block(const pd_gemm_job *job, int i0, int i1, int o0, int o1)
{
    const int in = job->in, in16 = in & ~15, nrows = o1 - o0, nu = i1 - i0;
    int16_t a16[BLK_U * A_LD] __attribute__((aligned(32)));
    int32_t acc[SB_U][BLK_MAX_ROWS];   /* token i0 + u, row o0 + r */
    for (int u = 0; u < nu; u++)
        memset(acc[u], 0, (size_t)nrows * sizeof acc[u][0]);
    for (int k0 = 0; k0 < in16; k0 += KC) {
        const int len = in16 - k0 < KC ? in16 - k0 : KC;
        for (int b = 0; b < nu; b += BLK_U) {
            for (int u = 0; u < BLK_U; u++) {
                const int8_t *ar = pd_gemm_job_arow(job, i0 + b + u) + k0;
                for (int k = 0; k < len; k += 16)
                    _mm256_store_si256((__m256i *)(a16 + u * A_LD + k),
                                       _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(ar + k))));
            }
            /* the next block's activation chunk (the first block's next chunk after the last
             * block) into L1 while this one runs, `per` lines every tile: line `pk` of token pu */
            const int nb = b + BLK_U < nu ? b + BLK_U : 0, nk = nb ? k0 : k0 + KC;
            const int nlen = in16 - nk < KC ? in16 - nk : KC, tiles = (nrows + BLK_R - 1) / BLK_R;
            const int per = nlen > 0 ? (BLK_U * ((nlen + 63) / 64) + tiles - 1) / tiles : 0;
            const char *pfr[BLK_U];
            for (int u = 0; u < BLK_U; u++)
                pfr[u] = (const char *)pd_gemm_job_arow(job, i0 + nb + u) + nk;
            int pu = nlen > 0 ? 0 : BLK_U, pk = 0;
            for (int o = o0; o < o1; o += BLK_R) {
                for (int e = 0; e < per && pu < BLK_U; e++) {
                    _mm_prefetch(pfr[pu] + pk, _MM_HINT_T0);
                    if ((pk += 64) >= nlen) {
                        pk = 0;
                        pu++;
                    }
                }
                const int nr = o1 - o < BLK_R ? o1 - o : BLK_R;
                const int8_t *wr[BLK_R];
                for (int r = 0; r < nr; r++)
                    wr[r] = job->w + (int64_t)(o + r) * in + k0;
                int32_t *at = &acc[b][o - o0];
                if (nr == 3)
                    tile_blk_r3(wr, a16, len, at);
                else if (nr == 2)
                    tile_blk_r2(wr, a16, len, at);
                else
                    tile_blk_r1(wr, a16, len, at);
            }
        }
    }
    /* the reduction's tail of fewer than 16 values */
    for (int u = 0; in16 < in && u < nu; u++) {
        const int8_t *ar = pd_gemm_job_arow(job, i0 + u);
        for (int r = 0; r < nrows; r++) {
            const int8_t *w = job->w + (int64_t)(o0 + r) * in;
            for (int k = in16; k < in; k++)
                acc[u][r] += (int32_t)w[k] * (int32_t)ar[k];
        }
    }
    pd_gemm_store(job, i0, nu, o0, nrows, &acc[0][0], BLK_MAX_ROWS);
}

/* The one-token GEMV when the activations hold no -128 (pd_quant_rows never makes one): 32 weight
 * bytes an instruction instead of 16 widened ones. vpmaddubsw multiplies unsigned bytes by signed
 * ones and adds pairs into int16, saturating; so it takes |w| (0 .. 128, read unsigned) against
 * a * sign(w) (vpsignb: -127 .. 127 when a != -128, 0 where w = 0):
 *   w * a = |w| * (sign(w) * a),   each pair's sum |.| <= 2 * 128 * 127 = 32,512 < 2^15,
 * exact; vpmaddwd by ones then adds the pairs into int32. A tile is SGN_R rows; it prefetches the
 * tile at `pf` into L2 (SGN_R contiguous rows, NULL: none), 4 lines a step between the products,
 * so the prefetches keep pace with the loads. This is the llama.cpp q8 dot's instruction sequence;
 * its products and adds are written in asm (see ROW). On an AVX2-only AMD EPYC (Zen 3), one 256 x
 * 512 matrix in L2 through pd_gemm, 1 thread, alternating: 24-30 GB/s in the 4 x 1 widening tiles
 * (a quarter of it their calls, stores and prefetch loop), 40-41 in these in consecutive rows,
 * 27-34 in rows_sgn's streams; from memory the streams are what counts (rows_sgn). */
enum { SGN_R = 8 };

static AVX2 __attribute__((noinline)) void tile_sgn(const int8_t *const *wr, const int8_t *a, int in,
                                                    const int8_t *pf, int32_t *acc)   // [SGN_R]
{
    const __m256i z = _mm256_setzero_si256(), ones = _mm256_set1_epi16(1);
    __m256i c0 = z, c1 = z, c2 = z, c3 = z, c4 = z, c5 = z, c6 = z, c7 = z, av, w, t;
/* c += vpmaddwd(vpmaddubsw(|w|, sign(av, w)), ones), w the 32 bytes at p; in asm because GCC 12
 * folds the load into both vpabsb and vpsignb and copies every accumulator each step. */
#define ROW(r)                                                                                   \
    __asm__("vmovdqu %[mem], %[w]\n\t"                                                           \
            "vpsignb %[w], %[av], %[t]\n\t"                                                      \
            "vpabsb %[w], %[w]\n\t"                                                              \
            "vpmaddubsw %[t], %[w], %[w]\n\t"                                                    \
            "vpmaddwd %[ones], %[w], %[w]\n\t"                                                   \
            "vpaddd %[w], %[acc], %[acc]"                                                         \
            : [acc] "+x"(c##r), [w] "=&x"(w), [t] "=&x"(t)                                        \
            : [av] "x"(av), [ones] "x"(ones), [mem] "m"(*(const __m256i *)(wr[r] + k)))
    int k = 0;
    for (; k + 32 <= in; k += 32) {
        if (pf) {
            const char *q = (const char *)pf + (int64_t)SGN_R * k;
            _mm_prefetch(q, _MM_HINT_T1);
            _mm_prefetch(q + 64, _MM_HINT_T1);
            _mm_prefetch(q + 128, _MM_HINT_T1);
            _mm_prefetch(q + 192, _MM_HINT_T1);
        }
        av = _mm256_loadu_si256((const __m256i *)(a + k));
        ROW(0);
        ROW(1);
        ROW(2);
        ROW(3);
        ROW(4);
        ROW(5);
        ROW(6);
        ROW(7);
    }
#undef ROW
    /* each half's 4 sums at once, as tile_blk does */
    const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(c0, c1), _mm256_hadd_epi32(c2, c3));
    const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(c4, c5), _mm256_hadd_epi32(c6, c7));
    _mm_storeu_si128((__m128i *)acc, _mm_add_epi32(_mm256_castsi256_si128(h0), _mm256_extracti128_si256(h0, 1)));
    _mm_storeu_si128((__m128i *)(acc + 4),
                     _mm_add_epi32(_mm256_castsi256_si128(h1), _mm256_extracti128_si256(h1, 1)));
    for (int r = 0; k < in && r < SGN_R; r++)
        for (int kk = k; kk < in; kk++)
            acc[r] += (int32_t)wr[r][kk] * (int32_t)a[kk];
}

/* 1 if a[0 .. n-1] holds -128. */
static AVX2 int has_int8_min(const int8_t *a, int n)
{
    const __m256i m = _mm256_set1_epi8(-128);
    __m256i any = _mm256_setzero_si256();
    int k = 0;
    for (; k + 32 <= n; k += 32)
        any = _mm256_or_si256(any, _mm256_cmpeq_epi8(_mm256_loadu_si256((const __m256i *)(a + k)), m));
    int found = _mm256_movemask_epi8(any) != 0;
    for (; k < n; k++)
        found |= a[k] == -128;
    return found;
}

/* One token against rows o0 .. o1 - 1 in tile_sgn's tiles (its activations hold no -128), up to
 * BLK_MAX_ROWS rows (gemm.c's tasks) at a time. Those rows go as SGN_R streams: tile j takes rows
 * j, j + q, .., j + (SGN_R - 1) q of the block (q = its rows / SGN_R), so the block is read at
 * SGN_R places at once, each sequentially, which the hardware prefetchers follow; and tile j
 * prefetches the j-th SGN_R rows of the block after (the next in this matrix or the first of
 * the next group's: pf_at) into L2. The rows left (fewer than SGN_R) go in one tile after. One
 * epilogue call for the block. Measured in one process, the routed experts of decode layers (7
 * of 256 experts x 3 matrices, v4-flash-mini's shapes, 8 layers, pd_gemm_grouped, 1 thread,
 * AVX2-only AMD EPYC, 5 rounds): these streams with the next block's prefetch 16.4-17.6 GB/s,
 * without it 15.5-16.3, consecutive 8-row tiles prefetching 24 KiB ahead 15.2-16.2. */
static void rows_sgn(const pd_gemm_job *job, int i0, int o0, int o1, int pf)
{
    const int in = job->in;
    const int8_t *a = pd_gemm_job_arow(job, i0);
    for (int b0 = o0; b0 < o1; b0 += BLK_MAX_ROWS) {
        const int nrows = o1 - b0 < BLK_MAX_ROWS ? o1 - b0 : BLK_MAX_ROWS, q = nrows / SGN_R;
        const int8_t *next = pf ? pf_at(job, b0, nrows, nrows) : NULL;
        int32_t acc[BLK_MAX_ROWS], t[SGN_R];
        const int8_t *wr[SGN_R];
        for (int j = 0; j < q; j++) {
            for (int r = 0; r < SGN_R; r++)
                wr[r] = job->w + (int64_t)(b0 + j + r * q) * in;
            tile_sgn(wr, a, in, next ? next + (int64_t)j * SGN_R * in : NULL, t);
            for (int r = 0; r < SGN_R; r++)
                acc[j + r * q] = t[r];
        }
        const int left = nrows - q * SGN_R;
        if (left > 0) {
            /* past the last row the tile re-reads that row; its results are not kept */
            for (int r = 0; r < SGN_R; r++)
                wr[r] = job->w + (int64_t)(b0 + q * SGN_R + (r < left ? r : left - 1)) * in;
            tile_sgn(wr, a, in, NULL, t);
            memcpy(acc + q * SGN_R, t, (size_t)left * sizeof *t);
        }
        pd_gemm_store(job, i0, 1, b0, nrows, acc, BLK_MAX_ROWS);
    }
}

AVX2 void pd_gemm_rows_avx2(const pd_gemm_job *job, int o0, int o1)
{
    const int in = job->in, pf = job->n <= TILE_U && in <= PF_MAX_IN;
    const int ahead = pf ? pf_ahead(in, PF_L2_BYTES) : 0;
    /* the rows' weight scales first: a routed expert's are cold (gemm_avx512.c) */
    for (int o = o0; pf && o < o1; o += 16)
        _mm_prefetch((const char *)(job->w_scale + o), _MM_HINT_T0);
    /* Tokens outer, rows inner: for 1 to 3 tokens, the task's weight rows (sized by gemm.c to fit
     * L2) are swept once per group of 3 tokens while those activation rows stay in L1. */
    int i0 = 0;
    /* 4 tokens and more: blocks of BLK_U, SB_U tokens a call (the rest below) */
    if (job->n >= PD_GEMM_AVX2_BLOCK_MIN && o1 - o0 <= BLK_MAX_ROWS)
        for (int whole = job->n / BLK_U * BLK_U, i1; i0 < whole; i0 = i1) {
            i1 = i0 + SB_U < whole ? i0 + SB_U : whole;
            block(job, i0, i1, o0, o1);
        }
    for (; i0 < job->n; i0 += TILE_U) {
        int nu = job->n - i0 < TILE_U ? job->n - i0 : TILE_U;
        if (nu == 1 && !has_int8_min(pd_gemm_job_arow(job, i0), in)) {
            rows_sgn(job, i0, o0, o1, pf);
            continue;
        }
        const int8_t *ar[TILE_U];
        for (int u = 0; u < TILE_U; u++)
            ar[u] = pd_gemm_job_arow(job, i0 + (u < nu ? u : 0));
        for (int o = o0; o < o1; o += TILE_R) {
            int nr = o1 - o < TILE_R ? o1 - o : TILE_R;
            /* Past the last row the tile re-reads that row; its results are not stored. */
            const int8_t *wr[TILE_R];
            for (int r = 0; r < TILE_R; r++)
                wr[r] = job->w + (int64_t)(o + (r < nr ? r : nr - 1)) * in;
            const int8_t *p = pf ? pf_at(job, o, ahead, TILE_R) : NULL;
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

/* AVX-512 VNNI decode GEMV (T = 1, and T = 2 or 3 on rows of at most PD_GEMM_FEW_MAX_IN bytes),
 * built on vpdpbusd, which multiplies UNSIGNED bytes by SIGNED bytes and adds groups of four
 * products into int32 lanes; more tokens go to the GEMMs of gemm_avx512_small.c (up to 24),
 * gemm_vnni_tw.c and gemm_vnni.c.
 *
 * Sign handling: the weights are the unsigned operand, flipped on the fly with w ^ 0x80, which is
 * w + 128 read as a byte in [0, 255]; the activations stay signed. Then
 *     sum_k (w[k] + 128) * a[k] = sum_k w[k] * a[k] + 128 * sum_k a[k]
 * so subtracting 128 * (row sum of the activation) gives the exact product for every int8 value,
 * -128 included. The weights need no preprocessing (they are used straight from the mmapped
 * checkpoint, each byte once per token: a GEMV is a memory stream, and the xor is free beside it).
 * vpdpbusd wraps modulo 2^32 rather than saturating, so the offset intermediate may overflow while
 * the final result, which fits in int32 (PD_GEMM_MAX_IN), is still exact.
 *
 * The tile is 8 rows x 1 token, a memory-bound stream (with software prefetch on short rows: see
 * tile8x1_short). Each vpdpbusd is written as a one-instruction asm statement on named variables:
 * GCC 12 handles the intrinsic's read-modify-write accumulator badly (a register copy, often a
 * spill, per instruction), while "+v" keeps every accumulator in its register. Reduction tails use
 * masked loads: masked bytes read as zero, and (0 ^ 0x80) * 0 adds nothing. */
#include <immintrin.h>
#include <string.h>

#include "kernels/avx512_common.h"
#include "kernels/gemm_impl.h"


enum { GEMV_R = 8, CHUNK = 64 };

/* Decode on rows of at most PF_MAX_IN bytes (tile8x1_short) prefetches about PF_BYTES ahead of
 * the tile computed into L1 (measured on the expert matrices of a 512-wide model: 8 KiB beats 4,
 * 12, 16 and 32), and about PF_L2_BYTES ahead into L2. The L1 prefetches alone are held back by
 * the core's few outstanding L1 misses: seven routed experts of 256 chosen at random per layer, as
 * decode reads them, streamed at 0.59-0.65 of the 8-stream read bandwidth (AMD Zen 4, 1 thread),
 * where the L2's deeper queue, fed 24 KiB ahead, brings them to 0.81-0.87 (16 KiB 0.78-0.84, 48 KiB
 * 0.78-0.89; same run, alternating). Longer rows are long streams that the hardware prefetchers
 * follow by themselves; prefetching them too measured slower (0.73 instead of 0.94 of the
 * bandwidth on a 14336-wide GEMV). On a Zen 5 EPYC (2 vCPUs, 2026-12-07) no other distance stood
 * out: L1 4, 8 or 16 KiB and L2 16, 24, 32 or 48 KiB ahead gave 0.48-0.70 of the bandwidth at 1
 * thread in `bench kernels` case 6, each setting's two passes as far apart as the settings. */
enum { PF_BYTES = 8192, PF_L2_BYTES = 24576, PF_MAX_IN = PD_GEMM_FEW_MAX_IN };


/* The exact products from offset sums: s - 128 * asum, modulo 2^32 (see the top of the file). */
INLINE AVX512 void store_sums(__m128i s, int32_t asum, int32_t *acc)
{
    __m128i corr = _mm_slli_epi32(_mm_set1_epi32(asum), 7);
    _mm_storeu_si128((__m128i *)acc, _mm_sub_epi32(s, corr));
}

/* sum_k a[k] over one activation row (decode), four chains. */
static AVX512 int32_t row_sum(const int8_t *a, int in)
{
    const __m512i ones = _mm512_set1_epi8(1);
    const __m512i z = _mm512_setzero_si512();
    __m512i s0 = z, s1 = z, s2 = z, s3 = z, v;
    int k = 0;
    for (; k + 256 <= in; k += 256) {
        v = FULL(a + k);
        DP(s0, ones, v);
        v = FULL(a + k + 64);
        DP(s1, ones, v);
        v = FULL(a + k + 128);
        DP(s2, ones, v);
        v = FULL(a + k + 192);
        DP(s3, ones, v);
    }
    for (; k + 64 <= in; k += 64) {
        v = FULL(a + k);
        DP(s0, ones, v);
    }
    if (k < in) {
        __mmask64 m = tail_mask(in - k);
        v = MASKED(a + k);
        DP(s0, ones, v);
    }
    return _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(s0, s1),
                                                    _mm512_add_epi32(s2, s3)));
}

/* acc[r] = sum_k wr[r][k] * a[k] for r < 8: the decode GEMV on long rows (more than PF_MAX_IN
 * bytes), 64 bytes of each row in turn: eight streams, which the hardware prefetchers follow. */
static AVX512 __attribute__((noinline)) void tile8x1(const int8_t *const *wr, const int8_t *a,
                                                     int32_t asum, int in,
                                                     int32_t *acc)   // [8]
{
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i z = _mm512_setzero_si512();
    __m512i c0 = z, c1 = z, c2 = z, c3 = z, c4 = z, c5 = z, c6 = z, c7 = z, av, w;
#define ROWS(load)                                                                               \
    av = load(a + k);                                                                            \
    w = _mm512_xor_si512(load(wr[0] + k), flip);                                                 \
    DP(c0, w, av);                                                                               \
    w = _mm512_xor_si512(load(wr[1] + k), flip);                                                 \
    DP(c1, w, av);                                                                               \
    w = _mm512_xor_si512(load(wr[2] + k), flip);                                                 \
    DP(c2, w, av);                                                                               \
    w = _mm512_xor_si512(load(wr[3] + k), flip);                                                 \
    DP(c3, w, av);                                                                               \
    w = _mm512_xor_si512(load(wr[4] + k), flip);                                                 \
    DP(c4, w, av);                                                                               \
    w = _mm512_xor_si512(load(wr[5] + k), flip);                                                 \
    DP(c5, w, av);                                                                               \
    w = _mm512_xor_si512(load(wr[6] + k), flip);                                                 \
    DP(c6, w, av);                                                                               \
    w = _mm512_xor_si512(load(wr[7] + k), flip);                                                 \
    DP(c7, w, av)
    int k = 0;
    for (; k + 64 <= in; k += 64) {
        ROWS(FULL);
    }
    if (k < in) {
        __mmask64 m = tail_mask(in - k);
        ROWS(MASKED);
    }
#undef ROWS
    store_sums(reduce4(c0, c1, c2, c3), asum, acc);
    store_sums(reduce4(c4, c5, c6, c7), asum, acc + 4);
}

/* The same on short rows (a few hundred bytes, as in a 512-wide model), each row read to its end
 * before the next: the tile's rows, contiguous in memory, are one linear stream. Reading them
 * side by side as tile8x1 does measured 23 GB/s on the expert matrices of such a model against
 * 29 in this order (the int32 sums are exact in any order: same results); on 14336-byte rows it
 * is the other way round (0.92 of the bandwidth side by side, 0.8 in turn). `pf` (NULL: none) is
 * the start of the 8 * in bytes that a later tile reads, prefetched in the same order: rows this
 * short end before the hardware prefetchers have caught on, and without it the kernel ran at
 * half the speed. */
static AVX512 __attribute__((noinline)) void tile8x1_short(const int8_t *const *wr, const int8_t *a,
                                                           int32_t asum, int in, const int8_t *pf,
                                                           int32_t *acc)   // [8]
{
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i z = _mm512_setzero_si512();
    __m512i c0 = z, c1 = z, c2 = z, c3 = z, c4 = z, c5 = z, c6 = z, c7 = z, av, w;
    const int kf = in & ~63;
    const __mmask64 m = tail_mask(in - kf);
#define ROW(r)                                                                                   \
    {                                                                                            \
        const int8_t *wp = wr[r];                                                                \
        if (pf)                                                                                  \
            for (int k = 0; k < in; k += 64)                                                     \
                _mm_prefetch((const char *)pf + (r) * in + k, _MM_HINT_T0);                      \
        for (int k = 0; k < kf; k += 64) {                                                       \
            av = FULL(a + k);                                                                    \
            w = _mm512_xor_si512(FULL(wp + k), flip);                                            \
            DP(c##r, w, av);                                                                     \
        }                                                                                        \
        if (kf < in) {                                                                           \
            av = MASKED(a + kf);                                                                 \
            w = _mm512_xor_si512(MASKED(wp + kf), flip);                                         \
            DP(c##r, w, av);                                                                     \
        }                                                                                        \
    }
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7)
#undef ROW
    store_sums(reduce4(c0, c1, c2, c3), asum, acc);
    store_sums(reduce4(c4, c5, c6, c7), asum, acc + 4);
}

/* tile8x1_short for T = 2 or 3 tokens (a routed expert's share of a small decode batch, a batch of
 * 2-3 through a plain matrix): acc[t * CHUNK + r] for r < 8 and t < T, each 64 bytes of weights
 * loaded and flipped once for all T tokens (8 x T accumulators, at most 24 of the 32 registers),
 * the tokens' 64 bytes from L1. The inner-product GEMM for few tokens (gemm_avx512_small.c) has
 * no prefetch, and the packed-token one (gemm_vnni_tw.c) sums every weight row before its tile:
 * at two tokens per expert both ran about 1.9x the one-token GEMV's time on 1.0x its bytes. */
INLINE AVX512 void tile8xT_short(const int8_t *const *wr, const int8_t *const *a, const int32_t *asum, int in,
                                 const int8_t *pf, int T, int32_t *acc)   // [T, CHUNK]
{
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i z = _mm512_setzero_si512();
    __m512i c00 = z, c10 = z, c20 = z, c30 = z, c40 = z, c50 = z, c60 = z, c70 = z;
    __m512i c01 = z, c11 = z, c21 = z, c31 = z, c41 = z, c51 = z, c61 = z, c71 = z;
    __m512i c02 = z, c12 = z, c22 = z, c32 = z, c42 = z, c52 = z, c62 = z, c72 = z;
    __m512i w, av;
    const int8_t *a0 = a[0], *a1 = a[1], *a2 = a[T > 2 ? 2 : 1];
    const int kf = in & ~63;
    const __mmask64 m = tail_mask(in - kf);
#define STEP(r, load, k)                                                                             w = _mm512_xor_si512(load(wp + (k)), flip);                                                      av = load(a0 + (k));                                                                             DP(c##r##0, w, av);                                                                              av = load(a1 + (k));                                                                             DP(c##r##1, w, av);                                                                              if (T > 2) {                                                                                         av = load(a2 + (k));                                                                             DP(c##r##2, w, av);                                                                          }
#define ROW(r)                                                                                       {                                                                                                    const int8_t *wp = wr[r];                                                                        if (pf)                                                                                              for (int k = 0; k < in; k += 64)                                                                     _mm_prefetch((const char *)pf + (r) * in + k, _MM_HINT_T0);                              for (int k = 0; k < kf; k += 64) {                                                                   STEP(r, FULL, k)                                                                             }                                                                                                if (kf < in) {                                                                                       STEP(r, MASKED, kf)                                                                          }                                                                                            }
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7)
#undef ROW
#undef STEP
    store_sums(reduce4(c00, c10, c20, c30), asum[0], acc);
    store_sums(reduce4(c40, c50, c60, c70), asum[0], acc + 4);
    store_sums(reduce4(c01, c11, c21, c31), asum[1], acc + CHUNK);
    store_sums(reduce4(c41, c51, c61, c71), asum[1], acc + CHUNK + 4);
    if (T > 2) {
        store_sums(reduce4(c02, c12, c22, c32), asum[2], acc + 2 * CHUNK);
        store_sums(reduce4(c42, c52, c62, c72), asum[2], acc + 2 * CHUNK + 4);
    }
}

static AVX512 __attribute__((noinline)) void tile8x2_short(const int8_t *const *wr, const int8_t *const *a,
                                                           const int32_t *asum, int in, const int8_t *pf,
                                                           int32_t *acc)
{
    tile8xT_short(wr, a, asum, in, pf, 2, acc);
}

static AVX512 __attribute__((noinline)) void tile8x3_short(const int8_t *const *wr, const int8_t *const *a,
                                                           const int32_t *asum, int in, const int8_t *pf,
                                                           int32_t *acc)
{
    tile8xT_short(wr, a, asum, in, pf, 3, acc);
}
#undef FULL
#undef MASKED

/* Rows to prefetch ahead on short rows (in <= PF_MAX_IN): about `bytes`, whole tiles. */
static inline int pf_ahead(int in, int bytes)
{
    return (bytes / in + GEMV_R - 1) / GEMV_R * GEMV_R;
}

/* The tile at `p` (GEMV_R rows of `in` bytes, contiguous) into L2. */
static inline void prefetch_l2(const int8_t *p, int in)
{
    for (int k = 0; k < GEMV_R * in; k += 64)
        _mm_prefetch((const char *)p + k, _MM_HINT_T1);
}

/* Where tile8x1_short at row o prefetches: a whole tile, `ahead` rows on, within the matrix (its
 * rows are contiguous) or past its end in the next one (job->w_next); NULL when there is nothing
 * more to read. */
static inline const int8_t *pf_at(const pd_gemm_job *job, int o, int ahead)
{
    if (o + ahead + GEMV_R <= job->out)
        return job->w + (int64_t)(o + ahead) * job->in;
    int at = o + ahead - job->out;   /* row of the next matrix */
    return job->w_next && at >= 0 && at + GEMV_R <= job->next_out ? job->w_next + (int64_t)at * job->in : NULL;
}

/* One tile of GEMV_R rows wr[] for T tokens (2 or 3 on short rows only), by the kernel for its
 * shape: sums at acc[t * CHUNK + r]; pf (NULL: none) as tile8x1_short takes it. */
static AVX512 void tile8(const int8_t *const *wr, const int8_t *const *a, const int32_t *asum, int in, int T,
                         const int8_t *pf, int32_t *acc)
{
    if (T == 3)
        tile8x3_short(wr, a, asum, in, pf, acc);
    else if (T == 2)
        tile8x2_short(wr, a, asum, in, pf, acc);
    else if (in > PF_MAX_IN)
        tile8x1(wr, a[0], asum[0], in, acc);
    else
        tile8x1_short(wr, a[0], asum[0], in, pf, acc);
}

/* Rows [o0, o1) of short rows for T = 1 .. PD_GEMM_FEW_MAX tokens as two streams, (o1 - o0) a
 * multiple of 2 * CHUNK: the range's two halves side by side, each tile 4 rows of the first half
 * and the same 4 of the second, one row of each in turn (o, o + half, o + 1, o + half + 1, ...), with
 * no software prefetch. Each row's sums are added in its own order: the one-stream bits.
 * Why: on the AMX Xeon (2 cores, 16.4 GB/s of 8-stream read bandwidth at 1 thread) one stream through
 * a routed expert's 128 KiB matrices read 11-12 GB/s whatever the prefetch distances (L1 0-16 KiB and
 * L2 0-96 KiB ahead: 10.9-12.1 GB/s, within the noise), where a bare loop of loads over the same
 * matrices reads about 7% more as two streams interleaved by 512-1,024 bytes than as one (4 streams,
 * or two by 2-4 KiB, no better). Seven experts of 256 per call at random (as bench kernels' case 6:
 * gate and up, then down), the mean of 2,000 calls, 3 rounds alternating: 1 token 11.3-11.7 ->
 * 12.8-13.1 GB/s, 2 tokens 10.6-11.0 -> 11.7-12.2, 3 tokens 10.3-10.5 -> 10.6-10.8 (the halves of each
 * 64-row chunk instead of the range's: about half the gain; two rows of each stream in turn: none);
 * bench kernels' own median, case 6 at 1 thread, 0.77-0.79 -> 0.81 of the read bandwidth; bench decode
 * at 1 thread, batch 1 262-286 -> 287-294 tokens/s, batch 16 467-492 -> 486-496. Not measured on AMD:
 * the AVX-512 path without AMX keeps the one-stream order and its prefetches (measured on Zen 4). */
static AVX512 void rows_two_streams(const pd_gemm_job *job, const int8_t *const *a, const int32_t *asum, int o0,
                                    int o1)
{
    const int in = job->in, T = job->n, half = (o1 - o0) / 2, pair = GEMV_R / 2;
    for (int c0 = o0; c0 < o0 + half; c0 += CHUNK) {
        int32_t acc[2][PD_GEMM_FEW_MAX * CHUNK];   /* [stream][t * CHUNK + row of the chunk] */
        for (int o = 0; o < CHUNK; o += pair) {
            const int8_t *wr[GEMV_R];
            for (int k = 0; k < pair; k++) {
                wr[2 * k] = job->w + (int64_t)(c0 + o + k) * in;
                wr[2 * k + 1] = job->w + (int64_t)(c0 + half + o + k) * in;
            }
            int32_t sums[PD_GEMM_FEW_MAX * CHUNK];   /* sums[t * CHUNK + r]: tile row r, token t */
            tile8(wr, a, asum, in, T, NULL, sums);
            for (int t = 0; t < T; t++)
                for (int k = 0; k < pair; k++) {
                    acc[0][t * CHUNK + o + k] = sums[t * CHUNK + 2 * k];
                    acc[1][t * CHUNK + o + k] = sums[t * CHUNK + 2 * k + 1];
                }
        }
        pd_gemm_store(job, 0, T, c0, CHUNK, acc[0], CHUNK);
        pd_gemm_store(job, 0, T, c0 + half, CHUNK, acc[1], CHUNK);
    }
}

/* Decode rows [o0, o1): one token (any row length), or 2 .. PD_GEMM_FEW_MAX tokens on rows of at
 * most PD_GEMM_FEW_MAX_IN (= PF_MAX_IN) bytes; two_streams: short rows as rows_two_streams reads
 * them where the range allows. */
static AVX512 void gemv_rows(const pd_gemm_job *job, int o0, int o1, int two_streams)
{
    const int in = job->in, T = job->n, ahead = in <= PF_MAX_IN ? pf_ahead(in, PF_BYTES) : 0;
    const int ahead_l2 = in <= PF_MAX_IN ? pf_ahead(in, PF_L2_BYTES) : 0;
    const int8_t *a[PD_GEMM_FEW_MAX];
    int32_t asum[PD_GEMM_FEW_MAX];
    for (int t = 0; t < T; t++) {
        a[t] = pd_gemm_job_arow(job, t);
        asum[t] = row_sum(a[t], in);
    }
    if (two_streams && in <= PF_MAX_IN && (o1 - o0) % (2 * CHUNK) == 0) {
        rows_two_streams(job, a, asum, o0, o1);
        return;
    }
    for (int c0 = o0; c0 < o1; c0 += CHUNK) {
        int c1 = c0 + CHUNK < o1 ? c0 + CHUNK : o1;
        int32_t acc[PD_GEMM_FEW_MAX * CHUNK];
        for (int o = c0; o < c1; o += GEMV_R) {
            int nr = c1 - o < GEMV_R ? c1 - o : GEMV_R;
            /* Past the last row the tile re-reads that row; its results are not stored. */
            const int8_t *wr[GEMV_R];
            for (int r = 0; r < GEMV_R; r++)
                wr[r] = job->w + (int64_t)(o + (r < nr ? r : nr - 1)) * in;
            const int8_t *pf = ahead ? pf_at(job, o, ahead) : NULL, *pf_l2 = ahead_l2 ? pf_at(job, o, ahead_l2) : NULL;
            if (pf_l2)
                prefetch_l2(pf_l2, in);
            tile8(wr, a, asum, in, T, pf, acc + (o - c0));
        }
        pd_gemm_store(job, 0, T, c0, c1 - c0, acc, CHUNK);
    }
}

/* The AVX-512 kernels by the number of tokens (gemm_impl.h); two_streams: the decode GEMV's short
 * rows as rows_two_streams reads them. */
static AVX512 void rows_avx512(const pd_gemm_job *job, int o0, int o1, int two_streams)
{
    /* The weight scales of the rows are prefetched first: a routed expert's are cold, and the
     * epilogue would otherwise wait a memory latency for them after every chunk (measured: most
     * of the epilogue's time in decode). */
    for (int o = o0; o < o1; o += 16)
        _mm_prefetch((const char *)(job->w_scale + o), _MM_HINT_T0);
    if (job->n == 1 || (job->n <= PD_GEMM_FEW_MAX && job->in <= PD_GEMM_FEW_MAX_IN))
        gemv_rows(job, o0, o1, two_streams);
    else if (job->a_packed)
        pd_gemm_rows_tw(job, o0, o1);
    else if (job->n <= PD_GEMM_SMALL_MAX || job->out < 16)
        pd_gemm_rows_small(job, o0, o1);   /* (under 16 rows a packed vector would be part empty) */
    else
        pd_gemm_rows_vnni(job, o0, o1);
}

AVX512 void pd_gemm_rows_avx512(const pd_gemm_job *job, int o0, int o1)
{
    rows_avx512(job, o0, o1, 0);
}

AVX512 void pd_gemm_rows_avx512_two_streams(const pd_gemm_job *job, int o0, int o1)
{
    rows_avx512(job, o0, o1, 1);
}

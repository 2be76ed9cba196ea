/* AVX-512 VNNI GEMM for 2 to 24 tokens (a decode batch through a plain matrix; 2-3 tokens on rows
 * of at most PD_GEMM_FEW_MAX_IN bytes go to the GEMV's tiles of gemm_avx512.c instead): the inner
 * product form, which reads the weights as stored, 64 bytes of 4 rows at a time, and reduces each
 * output's 16 lanes at the end. With this few tokens per weight it beats both outer-product paths
 * of gemm_vnni.c, whose packing (of the weights, or of the tokens into 16-lane vectors) costs more
 * than it saves (measured, 1 thread, CPU time, 2048 x 4096: 560-720 Gops/s at 4-24 tokens against
 * 150-630 for the packed tokens; from 32 tokens on those lead, 850 against 650).
 *
 * Sign handling as in gemm_avx512.c: the weights flipped on the fly (w ^ 0x80 = w + 128 as an
 * unsigned byte), the activations signed, 128 * (the activation's row sum) subtracted at the end,
 * exact modulo 2^32 for every int8 value.
 *
 * Register tile: 4 weight rows x up to 6 tokens = 24 zmm accumulators, 6 activation vectors, one
 * weight vector and the 0x80 constant: all 32 registers. Each 64-byte weight vector loaded feeds 6
 * tokens, each activation vector 4 rows. Accumulators are reduced four rows at a time to one
 * 128-bit vector of row sums per token. The reduction runs in K blocks of KBLOCK bytes, each block
 * of 6 activation rows first copied into a panel with a row stride of KBLOCK + 64 bytes (rows 4096
 * bytes apart would fall into the same L1 sets), which stays in L1 while the 4-row tiles stream
 * the weights. Reduction tails use masked loads: masked bytes read as zero, and (0 ^ 0x80) * 0 adds
 * nothing. */
#include <immintrin.h>
#include <string.h>

#include "kernels/avx512_common.h"
#include "kernels/gemm_impl.h"


enum { MAX_U = 6, GEMM_R = 4, CHUNK = 64 };

/* K blocks of KBLOCK bytes (a multiple of 64), activation panels with rows PANEL_STRIDE bytes
 * apart (not a multiple of 4 KiB), SUPER tokens at most per block of rows (24 here). */
enum { KBLOCK = 4096, PANEL_STRIDE = KBLOCK + 64, SUPER = 4 * MAX_U };


/* acc[0..3] = s (first) or acc[0..3] + s, modulo 2^32: the raw sums of one K block. */
INLINE AVX512 void add_sums(__m128i s, int first, int32_t *acc)
{
    if (!first)
        s = _mm_add_epi32(s, _mm_loadu_si128((const __m128i *)acc));
    _mm_storeu_si128((__m128i *)acc, s);
}

/* asum[u] = sum_k ar[u][k] for u < 6, exact (vpdpbusd with all-ones unsigned bytes). Six
 * independent chains, so the cost is throughput (and the first touch of these activation rows),
 * not the 4-cycle latency of one chain. */
static AVX512 void row_sums(const int8_t *const *ar, int in,
                            int32_t *asum)   // [6]
{
    const __m512i ones = _mm512_set1_epi8(1);
    const __m512i z = _mm512_setzero_si512();
    __m512i s0 = z, s1 = z, s2 = z, s3 = z, s4 = z, s5 = z, v;
#define SUMS(load)                                                                               \
    v = load(ar[0] + k);                                                                         \
    DP(s0, ones, v);                                                                             \
    v = load(ar[1] + k);                                                                         \
    DP(s1, ones, v);                                                                             \
    v = load(ar[2] + k);                                                                         \
    DP(s2, ones, v);                                                                             \
    v = load(ar[3] + k);                                                                         \
    DP(s3, ones, v);                                                                             \
    v = load(ar[4] + k);                                                                         \
    DP(s4, ones, v);                                                                             \
    v = load(ar[5] + k);                                                                         \
    DP(s5, ones, v)
    int k = 0;
    for (; k + 64 <= in; k += 64) {
        SUMS(FULL);
    }
    if (k < in) {
        __mmask64 m = tail_mask(in - k);
        SUMS(MASKED);
    }
#undef SUMS
    _mm_storeu_si128((__m128i *)asum, reduce4(s0, s1, s2, s3));
    asum[4] = _mm512_reduce_add_epi32(s4);
    asum[5] = _mm512_reduce_add_epi32(s5);
}

/* The offset sums of rows r < 4 and tokens u < U over one K block of `in` bytes starting at
 * byte wk of the weight rows and byte 0 of the activation rows ar (U constant once inlined: the
 * accumulators and instructions of tokens >= U are dead code and vanish):
 *   raw[u][r] = sum_{k < in} (wr[r][wk + k] + 128) * ar[u][k]   (modulo 2^32)
 * stored to acc[u * CHUNK + r] (first) or added to it; the caller subtracts 128 * asum[u] once
 * every block is in (see the top of the file). */
INLINE AVX512 void tile4(const int8_t *const *wr, int wk, const int8_t *const *ar, int in,
                         int first, int U,
                         int32_t *acc)   // [U, CHUNK]
{
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i z = _mm512_setzero_si512();
    __m512i c00 = z, c01 = z, c02 = z, c03 = z, c04 = z, c05 = z;
    __m512i c10 = z, c11 = z, c12 = z, c13 = z, c14 = z, c15 = z;
    __m512i c20 = z, c21 = z, c22 = z, c23 = z, c24 = z, c25 = z;
    __m512i c30 = z, c31 = z, c32 = z, c33 = z, c34 = z, c35 = z;
    __m512i a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, w;
    const int8_t *w0 = wr[0] + wk, *w1 = wr[1] + wk, *w2 = wr[2] + wk, *w3 = wr[3] + wk;

    /* One weight row against the U activation vectors. */
#define ROW(r)                                                                                   \
    DP(c##r##0, w, a0);                                                                          \
    if (U > 1) DP(c##r##1, w, a1);                                                               \
    if (U > 2) DP(c##r##2, w, a2);                                                               \
    if (U > 3) DP(c##r##3, w, a3);                                                               \
    if (U > 4) DP(c##r##4, w, a4);                                                               \
    if (U > 5) DP(c##r##5, w, a5)
#define LOAD_A(load)                                                                             \
    a0 = load(ar[0] + k);                                                                        \
    if (U > 1) a1 = load(ar[1] + k);                                                             \
    if (U > 2) a2 = load(ar[2] + k);                                                             \
    if (U > 3) a3 = load(ar[3] + k);                                                             \
    if (U > 4) a4 = load(ar[4] + k);                                                             \
    if (U > 5) a5 = load(ar[5] + k)

    int k = 0;
    for (; k + 64 <= in; k += 64) {
        LOAD_A(FULL);
        w = _mm512_xor_si512(FULL(w0 + k), flip);
        ROW(0);
        w = _mm512_xor_si512(FULL(w1 + k), flip);
        ROW(1);
        w = _mm512_xor_si512(FULL(w2 + k), flip);
        ROW(2);
        w = _mm512_xor_si512(FULL(w3 + k), flip);
        ROW(3);
    }
    if (k < in) {
        __mmask64 m = tail_mask(in - k);
        LOAD_A(MASKED);
        w = _mm512_xor_si512(MASKED(w0 + k), flip);
        ROW(0);
        w = _mm512_xor_si512(MASKED(w1 + k), flip);
        ROW(1);
        w = _mm512_xor_si512(MASKED(w2 + k), flip);
        ROW(2);
        w = _mm512_xor_si512(MASKED(w3 + k), flip);
        ROW(3);
    }
#undef ROW
#undef LOAD_A

    add_sums(reduce4(c00, c10, c20, c30), first, acc);
    if (U > 1) add_sums(reduce4(c01, c11, c21, c31), first, acc + 1 * CHUNK);
    if (U > 2) add_sums(reduce4(c02, c12, c22, c32), first, acc + 2 * CHUNK);
    if (U > 3) add_sums(reduce4(c03, c13, c23, c33), first, acc + 3 * CHUNK);
    if (U > 4) add_sums(reduce4(c04, c14, c24, c34), first, acc + 4 * CHUNK);
    if (U > 5) add_sums(reduce4(c05, c15, c25, c35), first, acc + 5 * CHUNK);
}

#define INSTANTIATE(U)                                                                           \
    static AVX512 __attribute__((noinline)) void tile4x##U(                                      \
        const int8_t *const *wr, int wk, const int8_t *const *ar, int in, int first,             \
        int32_t *acc)                                                                            \
    {                                                                                            \
        tile4(wr, wk, ar, in, first, U, acc);                                                    \
    }
INSTANTIATE(1)
INSTANTIATE(2)
INSTANTIATE(3)
INSTANTIATE(4)
INSTANTIATE(5)
INSTANTIATE(6)
#undef INSTANTIATE

/* GEMM (T > 1) rows [c0, c1) (at most CHUNK) for the tokens t0 .. t0 + nt - 1 (nt <= SUPER).
 * Blocked for the caches: the reduction runs in K blocks of KBLOCK bytes, so that the
 * task's weights of one block (64 rows x 4 KiB, gemm.c) stay in L2 while every block of 6 tokens
 * passes over them; each block of 6 activation rows is first copied into a panel with a row stride
 * of KBLOCK + 64 bytes, which stays in L1 (24 KiB) while the 4-row tiles stream the weights. The
 * copy matters as much as the blocking: activation rows 4096 (or 14336) bytes apart fall into the
 * same L1 sets (4 KiB aliasing), 6 of them plus 4 weight rows in 12 ways. Unblocked, a 14336-wide
 * reduction re-read all the activations from L3 for every 16 rows and ran at 0.5 of the VNNI peak.
 * The int32 sums of the blocks add up exactly (modulo 2^32, like the offset), so the results are
 * those of the unblocked product. */
static AVX512 void gemm_block(const pd_gemm_job *job, int c0, int c1, int t0, int nt,
                              int8_t *panel,   // [MAX_U, PANEL_STRIDE]
                              int32_t *acc)    // [SUPER / MAX_U, MAX_U, CHUNK]
{
    const int in = job->in;
    int32_t asum[SUPER];
    for (int b = 0; b < nt; b += MAX_U) {
        const int8_t *ar[MAX_U];
        for (int u = 0; u < MAX_U; u++)
            ar[u] = pd_gemm_job_arow(job, t0 + b + (b + u < nt ? u : nt - b - 1));
        row_sums(ar, in, asum + b);
    }
    for (int k0 = 0; k0 < in; k0 += KBLOCK) {
        int kn = in - k0 < KBLOCK ? in - k0 : KBLOCK;
        for (int b = 0; b < nt; b += MAX_U) {
            int nu = nt - b < MAX_U ? nt - b : MAX_U;
            const int8_t *ar[MAX_U];
            for (int u = 0; u < nu; u++) {
                memcpy(panel + u * PANEL_STRIDE, pd_gemm_job_arow(job, t0 + b + u) + k0, (size_t)kn);
                ar[u] = panel + u * PANEL_STRIDE;
            }
            for (int u = nu; u < MAX_U; u++)   /* unused lanes of the narrower tiles */
                ar[u] = ar[nu - 1];
            int32_t *ab = acc + b * CHUNK;   // [MAX_U, CHUNK] this block of tokens
            for (int o = c0; o < c1; o += GEMM_R) {
                int nr = c1 - o < GEMM_R ? c1 - o : GEMM_R;
                /* Past the last row the tile re-reads that row; its results are not stored.
                 * Tiles write all 4 lanes per token; CHUNK is a multiple of 4, so lanes past the
                 * last row stay inside acc and are never stored. */
                const int8_t *wr[GEMM_R];
                for (int r = 0; r < GEMM_R; r++)
                    wr[r] = job->w + (int64_t)(o + (r < nr ? r : nr - 1)) * in;
                int32_t *t = ab + (o - c0);
                switch (nu) {
                case 1: tile4x1(wr, k0, ar, kn, k0 == 0, t); break;
                case 2: tile4x2(wr, k0, ar, kn, k0 == 0, t); break;
                case 3: tile4x3(wr, k0, ar, kn, k0 == 0, t); break;
                case 4: tile4x4(wr, k0, ar, kn, k0 == 0, t); break;
                case 5: tile4x5(wr, k0, ar, kn, k0 == 0, t); break;
                default: tile4x6(wr, k0, ar, kn, k0 == 0, t); break;
                }
            }
        }
    }
    /* The exact products: raw - 128 * asum, modulo 2^32 (see the top of the file). */
    for (int b = 0; b < nt; b += MAX_U) {
        int nu = nt - b < MAX_U ? nt - b : MAX_U;
        int32_t *ab = acc + b * CHUNK;
        for (int u = 0; u < nu; u++)
            for (int r = 0; r < c1 - c0; r++)
                ab[u * CHUNK + r] = (int32_t)((uint32_t)ab[u * CHUNK + r] - ((uint32_t)asum[b + u] << 7));
        pd_gemm_store(job, t0 + b, nu, c0, c1 - c0, ab, CHUNK);
    }
}


AVX512 void pd_gemm_rows_small(const pd_gemm_job *job, int o0, int o1)
{
    _Alignas(64) int8_t panel[MAX_U * PANEL_STRIDE];
    _Alignas(64) int32_t acc[SUPER * CHUNK];
    for (int c0 = o0; c0 < o1; c0 += CHUNK) {
        int c1 = c0 + CHUNK < o1 ? c0 + CHUNK : o1;
        for (int t0 = 0; t0 < job->n; t0 += SUPER)
            gemm_block(job, c0, c1, t0, job->n - t0 < SUPER ? job->n - t0 : SUPER, panel, acc);
    }
}

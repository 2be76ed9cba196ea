/* AVX-512 VNNI GEMM for few tokens (25 .. 96 in the plain form, 2 .. 96 in the grouped one, from 4 on rows of at most PD_GEMM_FEW_MAX_IN bytes: a
 * routed expert's share of a prefill, a decode batch), the outer product with the roles of
 * gemm_vnni.c swapped: the tokens packed, the weights read as stored.
 *
 * Packing weights costs about as much as 20-60 tokens' worth of products, and such weights come
 * from memory once: the roles swap. A vector holds the same 4 reduction bytes of 16 tokens (the
 * activations, packed once per call by pd_gemm_tw_pack and shared by every task, + 128 as
 * unsigned bytes); each weight row's 4 bytes are broadcast straight from the matrix as stored
 * (the signed operand: no packing, each row one linear stream):
 *   c[r][u] = sum_k (a[u][k] + 128) * w[r][k] = sum_k a[u][k] w[r][k] + 128 * wsum[r]
 * with wsum[r] = sum_k w[r][k] computed per row just before (which also brings the rows in).
 * Tile: R rows x V vectors of 16 tokens, R x V <= 24 accumulators, the whole reduction in
 * registers (no K blocks: the activations, at most 96 x in bytes, stream from L2).
 *
 * Tokens past the last whole vector (a routed expert gets 50-80 of a 512-token prefill, rarely a
 * multiple of 16) would leave most lanes of one more vector empty: up to 8 of them go into a tail
 * vector instead, which packs T = 1, 2, 4 or 8 tokens x S = 16 / T steps of 4 bytes (each token's
 * 4 S consecutive bytes side by side) against the weights broadcast 4 S bytes at a time; a token's
 * sum is that of its S lanes. It runs as a second pass over each 64-row chunk (its rows still in
 * L2), in 8-row tiles. Per 64-row chunk, the vectors' sums are corrected and transposed to the
 * epilogue's [token][row] order in 16 x 16 blocks (exact_products). */
#include <immintrin.h>
#include <string.h>

#include "kernels/avx512_common.h"
#include "kernels/gemm_impl.h"

enum { CHUNK = 64 };   /* output rows per block: a pool task's (gemm.c) */
enum { TW_MAX_N = PD_GEMM_TW_MAX, TW_MAX_R = 12, TW_MAX_V = 6 };

/* Rows per tile for V vectors of tokens: 12 x 1, 8 x 2, 8 x 3, 6 x 4, 5 x 5, 4 x 6 (accumulators,
 * the V activation vectors and the broadcast within the 32 registers). */
static const int tw_rows[TW_MAX_V + 1] = {0, 12, 8, 8, 6, 5, 4};

/* Tokens n = nv + nt: the first nv in V vectors of 16 (the last one part empty), the nt left in
 * one tail vector of T = tail_tokens(nt) tokens (the power of two that fits them) x S = 16 / T
 * steps of 4 bytes. A tail costs one broadcast per vpdpbusd (the vectors share each across V), so
 * it runs at about half their rate: it pays where it leaves most lanes empty, up to 8 tokens
 * beside 2 or more vectors, up to 4 beside one, whose 16-row tiles are slow themselves (measured,
 * 1 thread, 2048 x 4096 from L3, CPU time: 65 tokens 0.78 of the 64-token rate in 5 vectors, 0.98
 * as 4 and a tail; 72: 0.89 and 0.97; 56 as 3 and a tail of 8: 1.03x 4 vectors; 24: 0.88x 2;
 * 9-12 beside 3 or 4 vectors in a 16-token tail (S = 1): 0.90-0.95x one more vector). */
static int main_vectors(int n)
{
    const int v = n / 16, nt = n % 16;
    return nt <= (v == 1 ? 4 : 8) ? v : v + 1;
}

static int main_tokens(int n)
{
    return n < 16 * main_vectors(n) ? n : 16 * main_vectors(n);
}

static int tail_tokens(int nt)
{
    return nt <= 1 ? 1 : nt <= 2 ? 2 : nt <= 4 ? 4 : 8;   /* (nt <= 8) */
}

/* The packed bytes: V vectors per 4 reduction bytes, then the tail's 64-byte vectors, each
 * covering 4 S reduction bytes. */
static int64_t main_bytes(int n, int in)
{
    return (int64_t)((in + 3) / 4) * main_vectors(n) * 64;
}

static int64_t tail_bytes(int n, int in)
{
    const int nt = n - main_tokens(n), C = 64 / tail_tokens(nt);
    return nt ? (int64_t)((in + C - 1) / C) * 64 : 0;
}

size_t pd_gemm_tw_bytes(int n, int in, int grouped)
{
    if (n < (grouped ? 2 : PD_GEMM_SMALL_MAX + 1) || n > TW_MAX_N)
        return 0;
    if (n <= PD_GEMM_FEW_MAX && in <= PD_GEMM_FEW_MAX_IN)
        return 0;   /* the GEMV's few-token tiles (gemm_avx512.c) */
    return (size_t)(main_bytes(n, in) + tail_bytes(n, in));
}

/* The tail vector for reduction bytes [C i, C i + C) (C = 4 S), tokens t < nt of rows[t]:
 *   tp[i][C t + b] = rows[t][C i + b] + 128 as an unsigned byte (0 past nt tokens or in bytes) */
static AVX512 void pack_tail(const int8_t *const *rows, int nt, int in, uint8_t *tp)
{
    const int T = tail_tokens(nt), C = 64 / T, nvec = (in + C - 1) / C;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int i = 0; i < nvec; i++) {
        _Alignas(64) int8_t buf[64];
        const int len = in - C * i < C ? in - C * i : C;
        _mm512_store_si512(buf, flip);   /* 0 after the flip */
        for (int t = 0; t < nt; t++) {
            const int8_t *src = rows[t] + (int64_t)C * i;
            int8_t *dst = buf + C * t;
            if (len < C) {
                memcpy(dst, src, (size_t)len);
                continue;
            }
            switch (C) {   /* constant sizes: a move or two, not a call */
            case 4: memcpy(dst, src, 4); break;
            case 8: memcpy(dst, src, 8); break;
            case 16: memcpy(dst, src, 16); break;
            case 32: memcpy(dst, src, 32); break;
            default: memcpy(dst, src, 64); break;
            }
        }
        _mm512_storeu_si512(tp + (int64_t)64 * i, _mm512_xor_si512(_mm512_load_si512(buf), flip));
    }
}

/* The vectors: ap[j][v][i][b] = a[tok(16 v + i)][4 j + b] + 128 as an unsigned byte (0 past nv
 * tokens or in bytes) for v < V; then the tail (pack_tail) of tokens nv .. n - 1. */
AVX512 void pd_gemm_tw_pack(const int8_t *a, int in, const int32_t *tok, int n, uint8_t *ap)
{
    const int V = main_vectors(n), nv = main_tokens(n), nt = n - nv;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int v = 0; v < V; v++)
        for (int kb = 0; kb < in; kb += 64) {
            __mmask64 m = in - kb >= 64 ? ~0ULL : (1ULL << (in - kb)) - 1;
            int nj = (in - kb < 64 ? in - kb + 3 : 64) / 4;
            __m512i r[16];
            /* a where loaded, 0x80 elsewhere: after the flip a + 128 and 0 */
            for (int i = 0; i < 16; i++) {
                int u = 16 * v + i;
                r[i] = u < nv ? _mm512_mask_loadu_epi8(flip, m, a + (int64_t)(tok ? tok[u] : u) * in + kb) : flip;
            }
            transpose16(r);
            for (int j = 0; j < nj; j++)
                _mm512_storeu_si512(ap + ((int64_t)(kb / 4 + j) * V + v) * 64, _mm512_xor_si512(r[j], flip));
        }
    if (nt) {
        const int8_t *rows[16];
        for (int t = 0; t < nt; t++)
            rows[t] = a + (int64_t)(tok ? tok[nv + t] : nv + t) * in;
        pack_tail(rows, nt, in, ap + main_bytes(n, in));
    }
}

/* out[r][16 v + i] = sum_j sum_b ap[j][v][i][b] * wr[r][4 j + b] + (first ? 0 : out[...]) for
 * r < R, v < V, n4 steps, prefetching the n_pf lines from pf (the next rows: weights read once
 * from memory come in while these compute), one per step. R, V constants once inlined. */
INLINE AVX512 void twtile(const uint8_t *ap, int n4, const int8_t *const *wr, int first, const int8_t *pf,
                          int n_pf, int R, int V,
                          int32_t *out)   // [R, TW_MAX_N]
{
    const __m512i z = _mm512_setzero_si512();
    /* c<row><vector>: all 12 x 6 are named for the macros; those past R x V are dead code */
    __m512i c00 = z, c01 = z, c02 = z, c03 = z, c04 = z, c05 = z;
    __m512i c10 = z, c11 = z, c12 = z, c13 = z, c14 = z, c15 = z;
    __m512i c20 = z, c21 = z, c22 = z, c23 = z, c24 = z, c25 = z;
    __m512i c30 = z, c31 = z, c32 = z, c33 = z, c34 = z, c35 = z;
    __m512i c40 = z, c41 = z, c42 = z, c43 = z, c44 = z, c45 = z;
    __m512i c50 = z, c51 = z, c52 = z, c53 = z, c54 = z, c55 = z;
    __m512i c60 = z, c61 = z, c62 = z, c63 = z, c64 = z, c65 = z;
    __m512i c70 = z, c71 = z, c72 = z, c73 = z, c74 = z, c75 = z;
    __m512i c80 = z, c81 = z, c82 = z, c83 = z, c84 = z, c85 = z;
    __m512i c90 = z, c91 = z, c92 = z, c93 = z, c94 = z, c95 = z;
    __m512i c100 = z, c101 = z, c102 = z, c103 = z, c104 = z, c105 = z;
    __m512i c110 = z, c111 = z, c112 = z, c113 = z, c114 = z, c115 = z;
    __m512i a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z;
#define ACC(X)                                                                         \
    X(0, 0) X(0, 1) X(0, 2) X(0, 3) X(0, 4) X(0, 5) X(1, 0) X(1, 1) X(1, 2) X(1, 3) X(1, 4) X(1, 5) \
    X(2, 0) X(2, 1) X(2, 2) X(2, 3) X(2, 4) X(2, 5) X(3, 0) X(3, 1) X(3, 2) X(3, 3) X(3, 4) X(3, 5) \
    X(4, 0) X(4, 1) X(4, 2) X(4, 3) X(4, 4) X(4, 5) X(5, 0) X(5, 1) X(5, 2) X(5, 3) X(5, 4) X(5, 5) \
    X(6, 0) X(6, 1) X(6, 2) X(6, 3) X(6, 4) X(6, 5) X(7, 0) X(7, 1) X(7, 2) X(7, 3) X(7, 4) X(7, 5) \
    X(8, 0) X(8, 1) X(8, 2) X(8, 3) X(8, 4) X(8, 5) X(9, 0) X(9, 1) X(9, 2) X(9, 3) X(9, 4) X(9, 5) \
    X(10, 0) X(10, 1) X(10, 2) X(10, 3) X(10, 4) X(10, 5) X(11, 0) X(11, 1) X(11, 2) X(11, 3) X(11, 4) X(11, 5)
#define LOAD_C(r, v) if (R > r && V > v && !first) c##r##v = _mm512_loadu_si512(out + r * TW_MAX_N + 16 * v);
#define STORE_C(r, v) if (R > r && V > v) _mm512_storeu_si512(out + r * TW_MAX_N + 16 * v, c##r##v);
    ACC(LOAD_C)
#define PTRS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define PTR(r) const int8_t *p##r = wr[R > r ? r : 0];
    PTRS(PTR)
#define ROW(r)                                                                                   \
    if (R > r) {                                                                                 \
        __m512i bc = broadcast4(p##r + 4 * j);                                                   \
        DP(c##r##0, a0, bc);                                                                     \
        if (V > 1) DP(c##r##1, a1, bc);                                                          \
        if (V > 2) DP(c##r##2, a2, bc);                                                          \
        if (V > 3) DP(c##r##3, a3, bc);                                                          \
        if (V > 4) DP(c##r##4, a4, bc);                                                          \
        if (V > 5) DP(c##r##5, a5, bc);                                                          \
    }
    for (int j = 0; j < n4; j++) {
        if (j < n_pf)
            _mm_prefetch((const char *)pf + 64 * (int64_t)j, _MM_HINT_T0);
        const uint8_t *q = ap + (int64_t)j * V * 64;
        a0 = _mm512_loadu_si512(q);
        if (V > 1) a1 = _mm512_loadu_si512(q + 64);
        if (V > 2) a2 = _mm512_loadu_si512(q + 128);
        if (V > 3) a3 = _mm512_loadu_si512(q + 192);
        if (V > 4) a4 = _mm512_loadu_si512(q + 256);
        if (V > 5) a5 = _mm512_loadu_si512(q + 320);
        PTRS(ROW)
    }
    ACC(STORE_C)
#undef ACC
#undef LOAD_C
#undef STORE_C
#undef PTRS
#undef PTR
#undef ROW
}

typedef void (*twtile_fn)(const uint8_t *ap, int n4, const int8_t *const *wr, int first, const int8_t *pf,
                          int n_pf, int32_t *out);
#define TWTILE(R, V)                                                                             \
    static AVX512 __attribute__((noinline)) void twtile##R##x##V(const uint8_t *ap, int n4,      \
                                                                  const int8_t *const *wr,       \
                                                                  int first, const int8_t *pf,   \
                                                                  int n_pf, int32_t *out)        \
    {                                                                                            \
        twtile(ap, n4, wr, first, pf, n_pf, R, V, out);                                          \
    }
#define TWTILES(R) TWTILE(R, 1) TWTILE(R, 2) TWTILE(R, 3) TWTILE(R, 4)
TWTILES(1) TWTILES(2) TWTILES(3) TWTILES(4) TWTILES(5) TWTILES(6)
TWTILE(1, 5) TWTILE(1, 6) TWTILE(2, 5) TWTILE(2, 6) TWTILE(3, 5) TWTILE(3, 6) TWTILE(4, 5) TWTILE(4, 6)
TWTILE(5, 5) TWTILE(7, 1) TWTILE(7, 2) TWTILE(7, 3) TWTILE(8, 1) TWTILE(8, 2) TWTILE(8, 3) TWTILE(9, 1) TWTILE(10, 1) TWTILE(11, 1) TWTILE(12, 1)
#undef TWTILES
#undef TWTILE
/* [R - 1][V - 1] for R <= tw_rows[V] */
static const twtile_fn twtiles[TW_MAX_R][TW_MAX_V] = {
    {twtile1x1, twtile1x2, twtile1x3, twtile1x4, twtile1x5, twtile1x6},
    {twtile2x1, twtile2x2, twtile2x3, twtile2x4, twtile2x5, twtile2x6},
    {twtile3x1, twtile3x2, twtile3x3, twtile3x4, twtile3x5, twtile3x6},
    {twtile4x1, twtile4x2, twtile4x3, twtile4x4, twtile4x5, twtile4x6},
    {twtile5x1, twtile5x2, twtile5x3, twtile5x4, twtile5x5, NULL},
    {twtile6x1, twtile6x2, twtile6x3, twtile6x4, NULL, NULL},
    {twtile7x1, twtile7x2, twtile7x3, NULL, NULL, NULL},
    {twtile8x1, twtile8x2, twtile8x3, NULL, NULL, NULL},
    {twtile9x1, NULL, NULL, NULL, NULL, NULL},
    {twtile10x1, NULL, NULL, NULL, NULL, NULL},
    {twtile11x1, NULL, NULL, NULL, NULL, NULL},
    {twtile12x1, NULL, NULL, NULL, NULL, NULL},
};

/* The tail tile: 16 weight rows wr against the tail vectors tp, n_it of them, each covering
 * C = 4 S reduction bytes of T = 16 / S tokens (a constant once inlined):
 *   out[r][l] = sum_i sum_b tp[i][4 l + b] * wr[r][C i + 4 (l % S) + b] + (first ? 0 : out[r][l])
 * the weights' C bytes broadcast to every group of S lanes (vpbroadcastd, vpbroadcastq,
 * vbroadcasti32x4, vbroadcasti64x4 or a plain load): lane l adds token l / S's products over
 * every S-th group of 4 bytes, so a token's sum is that of its S lanes. */
INLINE AVX512 void tailtile(const uint8_t *tp, int n_it, const int8_t *const *wr, int first, int S,
                            int32_t *out)   // [16, 16]
{
    const __m512i z = _mm512_setzero_si512();
    /* two accumulators per row, even and odd iterations: 16 independent vpdpbusd chains */
    __m512i c0 = z, c1 = z, c2 = z, c3 = z, c4 = z, c5 = z, c6 = z, c7 = z;
    __m512i d0 = z, d1 = z, d2 = z, d3 = z, d4 = z, d5 = z, d6 = z, d7 = z;
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define LOAD_C(r) c##r = _mm512_loadu_si512(out + 16 * r);
#define STORE_C(r) _mm512_storeu_si512(out + 16 * r, _mm512_add_epi32(c##r, d##r));
#define PTR(r) const int8_t *p##r = wr[r];
    if (!first) {
        ROWS(LOAD_C)
    }
    ROWS(PTR)
    const int C = 4 * S;
#define bcast(p)                                                                                 \
    (S == 2 ? broadcast8(p) : S == 4 ? _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p))) \
     : S == 8 ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p))) : _mm512_loadu_si512(p))
#define ROW_C(r) DP(c##r, a, bcast(p##r + (int64_t)C * i));
#define ROW_D(r) DP(d##r, b, bcast(p##r + (int64_t)C * (i + 1)));
    int i = 0;
    for (; i + 2 <= n_it; i += 2) {
        const __m512i a = _mm512_loadu_si512(tp + (int64_t)64 * i), b = _mm512_loadu_si512(tp + (int64_t)64 * (i + 1));
        ROWS(ROW_C)
        ROWS(ROW_D)
    }
    if (i < n_it) {
        const __m512i a = _mm512_loadu_si512(tp + (int64_t)64 * i);
        ROWS(ROW_C)
    }
    ROWS(STORE_C)
#undef bcast
#undef ROWS
#undef LOAD_C
#undef STORE_C
#undef PTR
#undef ROW_C
#undef ROW_D
}

typedef void (*tailtile_fn)(const uint8_t *tp, int n_it, const int8_t *const *wr, int first, int32_t *out);
#define TAILTILE(S)                                                                              \
    static AVX512 __attribute__((noinline)) void tailtile##S(const uint8_t *tp, int n_it,        \
                                                              const int8_t *const *wr, int first, \
                                                              int32_t *out)                      \
    {                                                                                            \
        tailtile(tp, n_it, wr, first, S, out);                                                   \
    }
TAILTILE(2) TAILTILE(4) TAILTILE(8) TAILTILE(16)
#undef TAILTILE

/* The tail's 16 x nt products of the chunk's rows [c0 + g, c0 + g + 16) less 128 times their
 * row sums, into acc[(nv + t) * CHUNK + g + r]; rows past nr repeat the last one (their lanes of
 * acc, inside CHUNK, are not stored). */
static AVX512 void tail_rows(const pd_gemm_job *job, int c0, int g, int nr, const int32_t *wsum,
                             int32_t *acc)   // [TW_MAX_N, CHUNK]
{
    const int in = job->in, n = job->n, nv = main_tokens(n), nt = n - nv, T = tail_tokens(nt), S = 16 / T, C = 4 * S;
    const int n_it = in / C, rem = in % C;
    const uint8_t *tp = job->a_packed + main_bytes(n, in);
    static const tailtile_fn fns[17] = {[2] = tailtile2, [4] = tailtile4, [8] = tailtile8,
                                        [16] = tailtile16};
    const int8_t *wr[8];
    for (int r = 0; r < 8; r++)
        wr[r] = job->w + (int64_t)(c0 + (g + r < nr ? g + r : nr - 1)) * in;
    _Alignas(64) int32_t out[16 * 16];
    fns[S](tp, n_it, wr, 1, out);
    if (rem) {
        /* the last rem < C bytes of each row, zero-padded (the packed tokens are 0 there) */
        _Alignas(64) int8_t last[8][64];
        const int8_t *lp[8];
        for (int r = 0; r < 8; r++) {
            memset(last[r], 0, 64);
            memcpy(last[r], wr[r] + (int64_t)C * n_it, (size_t)rem);
            lp[r] = last[r];
        }
        fns[S](tp + (int64_t)64 * n_it, 1, lp, 0, out);
    }
    for (int r = 0; r < 8 && g + r < nr; r++) {
        const uint32_t corr = (uint32_t)wsum[g + r] << 7;
        for (int t = 0; t < nt; t++) {
            uint32_t sum = 0;
            for (int l = 0; l < S; l++)
                sum += (uint32_t)out[16 * r + S * t + l];
            acc[(nv + t) * CHUNK + g + r] = (int32_t)(sum - corr);
        }
    }
}

/* acc[u][r] = out[r][u] - 128 * wsum[r] (modulo 2^32) for r < nr, u < 16 V: the exact products
 * (see the top of the file), transposed to the epilogue's [token][row] in 16 x 16 blocks. Rows
 * past nr repeat the last (their lanes of acc, inside CHUNK, are not stored). */
static AVX512 void exact_products(const int32_t *out,    // [CHUNK, TW_MAX_N]
                                  const int32_t *wsum, int nr, int V,
                                  int32_t *acc)          // [TW_MAX_N, CHUNK]
{
    for (int rb = 0; rb < nr; rb += 16)
        for (int v = 0; v < V; v++) {
            __m512i x[16];
            for (int i = 0; i < 16; i++) {
                const int r = rb + i < nr ? rb + i : nr - 1;
                x[i] = _mm512_sub_epi32(_mm512_load_si512(out + r * TW_MAX_N + 16 * v),
                                        _mm512_set1_epi32((int32_t)((uint32_t)wsum[r] << 7)));
            }
            transpose16(x);
            for (int i = 0; i < 16; i++)
                _mm512_store_si512(acc + (16 * v + i) * CHUNK + rb, x[i]);
        }
}

AVX512 void pd_gemm_rows_tw(const pd_gemm_job *job, int o0, int o1)
{
    const int in = job->in, n = job->n, V = main_vectors(n), nv = main_tokens(n), full4 = in / 4, rem = in % 4;
    const int RV = tw_rows[V];
    _Alignas(64) int32_t out[CHUNK * TW_MAX_N];   /* the vectors' sums, [row][token] */
    _Alignas(64) int32_t acc[TW_MAX_N * CHUNK];   /* the exact products, [token][row] */
    int32_t wsum[CHUNK];
    for (int c0 = o0; c0 < o1; c0 += CHUNK) {
        const int nr = o1 - c0 < CHUNK ? o1 - c0 : CHUNK;
        if (V == 0)
            pd_gemm_row_sums_vnni(job->w + (int64_t)c0 * in, in, 0, nr, wsum);
        for (int g = 0; V > 0 && g < nr; g += RV) {
            const int R = nr - g < RV ? nr - g : RV;
            const int8_t *wr[TW_MAX_R];
            for (int r = 0; r < R; r++)
                wr[r] = job->w + (int64_t)(c0 + g + r) * in;
            pd_gemm_row_sums_vnni(wr[0], in, 0, R, wsum + g);
            /* the next rows, contiguous after these (past the matrix: the next one's first) */
            const int next = c0 + g + R;
            const int8_t *pf = next < job->out ? job->w + (int64_t)next * in : job->w_next;
            const int pf_rows = next < job->out ? job->out - next : job->w_next ? job->next_out : 0;
            twtiles[R - 1][V - 1](job->a_packed, full4, wr, 1, pf, (pf_rows < RV ? pf_rows : RV) * in / 64,
                                  out + g * TW_MAX_N);
            if (rem) {
                /* the last 1-3 bytes of each row, zero-padded (the packed activations are 0 there) */
                _Alignas(4) int8_t tail[TW_MAX_R][4];
                const int8_t *tq[TW_MAX_R];
                for (int r = 0; r < R; r++) {
                    memset(tail[r], 0, 4);
                    memcpy(tail[r], wr[r] + 4 * full4, (size_t)rem);
                    tq[r] = tail[r];
                }
                twtiles[R - 1][V - 1](job->a_packed + (int64_t)full4 * V * 64, 1, tq, 0, NULL, 0, out + g * TW_MAX_N);
            }
        }
        if (V > 0)
            exact_products(out, wsum, nr, V, acc);
        /* the tail tokens on the same rows, in L2 now */
        for (int g = 0; nv < n && g < nr; g += 8)
            tail_rows(job, c0, g, nr, wsum, acc);
        pd_gemm_store(job, 0, n, c0, nr, acc, CHUNK);
    }
}

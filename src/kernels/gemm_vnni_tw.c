/* AVX-512 VNNI GEMM for few tokens (25 .. 96 in the plain form, 2 .. 96 in the grouped one: a
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
 * registers (no K blocks: the activations, at most 96 x in bytes, stream from L2). */
#include <immintrin.h>
#include <string.h>

#include "kernels/avx512_common.h"
#include "kernels/gemm_impl.h"

enum { CHUNK = 64 };   /* output rows per block: a pool task's (gemm.c) */
enum { TW_MAX_N = PD_GEMM_TW_MAX, TW_MAX_R = 12, TW_MAX_V = 6 };

/* Rows per tile for V vectors of tokens: 12 x 1, 8 x 2, 6 x 3, 6 x 4, 4 x 5, 4 x 6 (accumulators,
 * the V activation vectors and the broadcast within the 32 registers). */
static const int tw_rows[TW_MAX_V + 1] = {0, 12, 8, 6, 6, 4, 4};

size_t pd_gemm_tw_bytes(int n, int in, int grouped)
{
    if (n < (grouped ? 2 : PD_GEMM_SMALL_MAX + 1) || n > TW_MAX_N)
        return 0;
    return (size_t)((in + 3) / 4) * (size_t)((n + 15) / 16) * 64;
}

/* ap[j][v][i][b] = a[tok(16 v + i)][4 j + b] + 128 as an unsigned byte (0 past n tokens or in
 * bytes): V = ceil(n / 16) vectors per step of 4 reduction bytes. */
AVX512 void pd_gemm_tw_pack(const int8_t *a, int in, const int32_t *tok, int n, uint8_t *ap)
{
    const int V = (n + 15) / 16;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int v = 0; v < V; v++)
        for (int kb = 0; kb < in; kb += 64) {
            __mmask64 m = in - kb >= 64 ? ~0ULL : (1ULL << (in - kb)) - 1;
            int nj = (in - kb < 64 ? in - kb + 3 : 64) / 4;
            __m512i r[16];
            /* a where loaded, 0x80 elsewhere: after the flip a + 128 and 0 */
            for (int i = 0; i < 16; i++) {
                int u = 16 * v + i;
                r[i] = u < n ? _mm512_mask_loadu_epi8(flip, m, a + (int64_t)(tok ? tok[u] : u) * in + kb) : flip;
            }
            transpose16(r);
            for (int j = 0; j < nj; j++)
                _mm512_storeu_si512(ap + ((int64_t)(kb / 4 + j) * V + v) * 64, _mm512_xor_si512(r[j], flip));
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
TWTILE(7, 1) TWTILE(7, 2) TWTILE(8, 1) TWTILE(8, 2) TWTILE(9, 1) TWTILE(10, 1) TWTILE(11, 1) TWTILE(12, 1)
#undef TWTILES
#undef TWTILE
/* [R - 1][V - 1] for R <= tw_rows[V] */
static const twtile_fn twtiles[TW_MAX_R][TW_MAX_V] = {
    {twtile1x1, twtile1x2, twtile1x3, twtile1x4, twtile1x5, twtile1x6},
    {twtile2x1, twtile2x2, twtile2x3, twtile2x4, twtile2x5, twtile2x6},
    {twtile3x1, twtile3x2, twtile3x3, twtile3x4, twtile3x5, twtile3x6},
    {twtile4x1, twtile4x2, twtile4x3, twtile4x4, twtile4x5, twtile4x6},
    {twtile5x1, twtile5x2, twtile5x3, twtile5x4, NULL, NULL},
    {twtile6x1, twtile6x2, twtile6x3, twtile6x4, NULL, NULL},
    {twtile7x1, twtile7x2, NULL, NULL, NULL, NULL},
    {twtile8x1, twtile8x2, NULL, NULL, NULL, NULL},
    {twtile9x1, NULL, NULL, NULL, NULL, NULL},
    {twtile10x1, NULL, NULL, NULL, NULL, NULL},
    {twtile11x1, NULL, NULL, NULL, NULL, NULL},
    {twtile12x1, NULL, NULL, NULL, NULL, NULL},
};

AVX512 void pd_gemm_rows_tw(const pd_gemm_job *job, int o0, int o1)
{
    const int in = job->in, n = job->n, V = (n + 15) / 16, full4 = in / 4, rem = in % 4, RV = tw_rows[V];
    _Alignas(64) int32_t out[TW_MAX_R * TW_MAX_N];
    _Alignas(64) int32_t acc[TW_MAX_N * CHUNK];
    int32_t wsum[TW_MAX_R];
    for (int c0 = o0; c0 < o1; c0 += CHUNK) {
        const int nr = o1 - c0 < CHUNK ? o1 - c0 : CHUNK;
        for (int g = 0; g < nr; g += RV) {
            const int R = nr - g < RV ? nr - g : RV;
            const int8_t *wr[TW_MAX_R];
            for (int r = 0; r < R; r++)
                wr[r] = job->w + (int64_t)(c0 + g + r) * in;
            pd_gemm_row_sums_vnni(wr[0], in, 0, R, wsum);
            /* the next rows, contiguous after these (past the matrix: the next one's first) */
            const int next = c0 + g + R;
            const int8_t *pf = next < job->out ? job->w + (int64_t)next * in : job->w_next;
            const int pf_rows = next < job->out ? job->out - next : job->w_next ? job->next_out : 0;
            twtiles[R - 1][V - 1](job->a_packed, full4, wr, 1, pf, (pf_rows < RV ? pf_rows : RV) * in / 64, out);
            if (rem) {
                /* the last 1-3 bytes of each row, zero-padded (the packed activations are 0 there) */
                _Alignas(4) int8_t tail[TW_MAX_R][4];
                const int8_t *tp[TW_MAX_R];
                for (int r = 0; r < R; r++) {
                    memset(tail[r], 0, 4);
                    memcpy(tail[r], wr[r] + 4 * full4, (size_t)rem);
                    tp[r] = tail[r];
                }
                twtiles[R - 1][V - 1](job->a_packed + (int64_t)full4 * V * 64, 1, tp, 0, NULL, 0, out);
            }
            /* the exact products: less 128 times the row sum (modulo 2^32), transposed to [u][r] */
            for (int r = 0; r < R; r++) {
                uint32_t corr = (uint32_t)wsum[r] << 7;
                for (int u = 0; u < n; u++)
                    acc[u * CHUNK + g + r] = (int32_t)((uint32_t)out[r * TW_MAX_N + u] - corr);
            }
        }
        pd_gemm_store(job, 0, n, c0, nr, acc, CHUNK);
    }
}


/* AVX-512 VNNI prefill GEMM (T > 1): the outer-product form, blocked as BLIS and oneDNN block theirs.
 *
 * vpdpbusd multiplies UNSIGNED bytes by SIGNED bytes and adds each group of four products into an
 * int32 lane. Here a lane is one output row: a 64-byte weight vector holds 16 output rows x 4
 * consecutive reduction bytes, and the activation operand is one token's same 4 bytes broadcast to
 * all 16 lanes (vpdpbusd's embedded {1to16} broadcast from memory). No horizontal reduction is ever
 * needed; the accumulators are outputs.
 *
 * Sign handling, off the vpdpbusd ports: the weights are the unsigned operand, offset by +128 once,
 * when a block of them is packed (w ^ 0x80 is w + 128 read as a byte in [0, 255]); the activations
 * stay signed. Then, exactly, for every int8 value, -128 included:
 *     sum_k w[k] * a[k] = sum_k (w[k] + 128) * a[k] - 128 * sum_k a[k]
 * with sum_k a[k] per token computed once per call (pd_gemm_row_sums_vnni, on the pool). vpdpbusd
 * wraps modulo 2^32; the final value fits in int32 (PD_GEMM_MAX_IN), so the wrapped arithmetic is
 * exact.
 *
 * Blocking (per pool task, rows [o0, o1), in chunks of NR = 64 rows):
 *   tokens in super-blocks of SUPER = 516 (their int32 sums, 516 x 64 x 4 bytes = 129 KiB, stay
 *   in L2; a prefill of up to 516 tokens packs each weight once);
 *     the reduction in blocks of KC = 512 bytes: the chunk's 64 rows x KC bytes are packed into
 *     micro-kernel order (32 KiB, stays in L1);
 *       every 6 tokens of the super-block: the 6 x 64 micro-tile, 24 zmm accumulators loaded
 *       from the sums, 64 x KC weight bytes from L1, 6 x KC activation bytes (one vpbroadcastd
 *       per token and 4 bytes), the sums stored back; meanwhile it requests its share of the
 *       next block's raw weights and the next tile's activation lines, spread over its steps
 *       (see tile());
 *     the chunk's exact sums scaled into y, whole lines past the caches for a large output.
 * Per 24 vpdpbusd: 4 weight loads from L1 and 6 broadcasts, no other vector work. (The
 * {1to16} memory-broadcast form of vpdpbusd, 24 broadcast loads per 24, measured 0.46 of the
 * peak against 0.62 for 6 vpbroadcastd before this blocking was complete.) Activations are read
 * in place (token rows of the caller's matrix, gathered or not): each is read once per 64 rows
 * of weights, one byte per vpdpbusd.
 *
 * Each vpdpbusd is a one-instruction asm statement on named variables (GCC 12 otherwise copies
 * or spills the intrinsic's read-modify-write accumulator, which halves the throughput). */
#include <immintrin.h>
#include <string.h>

#include "kernels/avx512_common.h"
#include "kernels/gemm_impl.h"
#include "kernels/gemm_store_avx512.h"


enum {
    MR = 6,                  /* tokens per micro-tile */
    NR = 64,                 /* output rows per micro-tile: 4 vectors of 16 */
    KC = 512,                /* reduction bytes per packed block (a multiple of 64) */
    SUPER = 86 * MR,         /* tokens per super-block (the sums' buffer is on the stack) */
    PACK_STEP = 4 * NR,      /* bytes of packed weights per 4 reduction bytes */
};

/* sums[i] = sum_k a[i][k] over rows [r0, r1) of a [rows, in]: vpdpbusd of all-ones unsigned bytes
 * with the signed row, four chains per row. */
AVX512 void pd_gemm_row_sums_vnni(const int8_t *a, int in, int r0, int r1, int32_t *sums)
{
    const __m512i ones = _mm512_set1_epi8(1);
    for (int i = r0; i < r1; i++) {
        const int8_t *p = a + (int64_t)i * in;
        __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
        int k = 0;
        for (; k + 256 <= in; k += 256) {
            s0 = _mm512_dpbusd_epi32(s0, ones, _mm512_loadu_si512(p + k));
            s1 = _mm512_dpbusd_epi32(s1, ones, _mm512_loadu_si512(p + k + 64));
            s2 = _mm512_dpbusd_epi32(s2, ones, _mm512_loadu_si512(p + k + 128));
            s3 = _mm512_dpbusd_epi32(s3, ones, _mm512_loadu_si512(p + k + 192));
        }
        for (; k < in; k += 64) {
            __mmask64 m = in - k >= 64 ? ~0ULL : (1ULL << (in - k)) - 1;
            s0 = _mm512_dpbusd_epi32(s0, ones, _mm512_maskz_loadu_epi8(m, p + k));
        }
        sums[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(s0, s1), _mm512_add_epi32(s2, s3)));
    }
}

/* Packs rows [0, nr) (nr <= NR) of w (rows `in` bytes apart), reduction bytes [k0, k0 + kn), into
 *   wp[j][v * 64 + 4 i + b] = (w[16 v + i][k0 + 4 j + b] + 128) as an unsigned byte
 * for j < ceil(kn / 4): one 256-byte step of the micro-kernel per 4 reduction bytes. Rows past nr
 * and bytes past kn are 0x80 (weight 0); the micro-kernel reads zero activations there, or does
 * not store those rows. */
static AVX512 void pack(const int8_t *w, int in, int nr, int k0, int kn,
                        uint8_t *wp)   // [ceil(kn / 4), PACK_STEP]
{
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int kb = 0; kb < kn; kb += 64) {
        __mmask64 m = kn - kb >= 64 ? ~0ULL : (1ULL << (kn - kb)) - 1;
        int nj = (kn - kb < 64 ? kn - kb + 3 : 64) / 4;   /* 4-byte steps in this 64-byte block */
        for (int v = 0; v < NR / 16; v++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                int row = 16 * v + i;
                const int8_t *src = w + (int64_t)row * in + k0 + kb;
                /* (a plain load where it can: a masked one that crosses a page is slow) */
                r[i] = row >= nr ? _mm512_setzero_si512() : m == ~0ULL ? _mm512_loadu_si512(src) : _mm512_maskz_loadu_epi8(m, src);
            }
            transpose16(r);
            uint8_t *dst = wp + (int64_t)(kb / 4) * PACK_STEP + v * 64;
            for (int j = 0; j < nj; j++)
                _mm512_storeu_si512(dst + (int64_t)j * PACK_STEP, _mm512_xor_si512(r[j], flip));
        }
    }
}

/* Steps of a tile between two rounds of its requests (tile()). */
enum { PF_GROUP = 8 };

/* Lines a tile requests while it computes, q0 <= q < q1 of a run over rows of KC / 64 lines each:
 * a later block's weights (row r at base + r * stride) or the next tile's activations (row r at
 * ptr[r]). A row shorter than that (the last reduction block's) is requested to its KC bytes all
 * the same: a prefetch never faults. */
typedef struct pf_lines {
    const int8_t *base;
    const int8_t *const *ptr;
    int64_t stride;
    unsigned q0, q1;
} pf_lines;

INLINE const char *pf_weight_line(const pf_lines *pf, unsigned q)
{
    return (const char *)pf->base + (int64_t)(q / (KC / 64)) * pf->stride + 64 * (q % (KC / 64));
}

INLINE const char *pf_act_line(const pf_lines *pf, unsigned q)
{
    return (const char *)pf->ptr[q / (KC / 64)] + 64 * (q % (KC / 64));
}

/* The micro-tile: tokens u < U (ar[u] at the block's first reduction byte) x rows 16 V (V vector
 * lanes of 16 rows), n4 steps of 4 reduction bytes:
 *   c[u][16 v + i] (first ? 0 : c[u][16 v + i]) + sum_j sum_b wp[j][v * 64 + 4 i + b] * ar[u][4 j + b]
 * Meanwhile it requests wpf's lines (a later block's raw weights: they come from memory while this
 * one computes) and apf's (the next tile's activations, 6 short runs that no hardware prefetcher
 * learns before they end), spread over the steps: every PF_GROUP steps it requests its share of
 * both, at least a line of each while any remain, and the steps between run with nothing else in
 * the loop (no request counters to keep in registers). Issued in a burst they fill the core's miss
 * buffers and stall it: weights read from DRAM ran at 0.44 of the VNNI peak in a burst against 0.62
 * spread out (MoE experts), and the activations' burst before each tile took 13% of the 2048 x 4096
 * x 512 GEMM's time on the AMX Xeon (its VNNI path, 1 thread).
 * U and V are constants once inlined: the accumulators and instructions past them vanish. */
INLINE AVX512 void tile(const uint8_t *wp, int n4, const int8_t *const *ar, int first, const pf_lines *wpf,
                        const pf_lines *apf, int U, int V,
                        int32_t *c)   // [U, NR]
{
    const __m512i z = _mm512_setzero_si512();
    __m512i c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z;
    __m512i c20 = z, c21 = z, c22 = z, c23 = z, c30 = z, c31 = z, c32 = z, c33 = z;
    __m512i c40 = z, c41 = z, c42 = z, c43 = z, c50 = z, c51 = z, c52 = z, c53 = z;
    __m512i w0, w1 = z, w2 = z, w3 = z;
#define ACC(X)                                                                                   \
    X(0, 0) X(0, 1) X(0, 2) X(0, 3) X(1, 0) X(1, 1) X(1, 2) X(1, 3) X(2, 0) X(2, 1) X(2, 2) X(2, 3) \
    X(3, 0) X(3, 1) X(3, 2) X(3, 3) X(4, 0) X(4, 1) X(4, 2) X(4, 3) X(5, 0) X(5, 1) X(5, 2) X(5, 3)
#define LOAD_C(u, v)                                                                             \
    if (U > u && V > v) c##u##v = _mm512_loadu_si512(c + u * NR + 16 * v);
#define STORE_C(u, v)                                                                            \
    if (U > u && V > v) _mm512_storeu_si512(c + u * NR + 16 * v, c##u##v);
    if (!first) {
        ACC(LOAD_C)
    }
    const int8_t *a0 = ar[0], *a1 = ar[U > 1 ? 1 : 0], *a2 = ar[U > 2 ? 2 : 0];
    const int8_t *a3 = ar[U > 3 ? 3 : 0], *a4 = ar[U > 4 ? 4 : 0], *a5 = ar[U > 5 ? 5 : 0];
#define TOKEN(u, j)                                                                              \
    if (U > u) {                                                                                 \
        __m512i bc = broadcast4(a##u + 4 * (j));                                                 \
        DP(c##u##0, w0, bc);                                                                     \
        if (V > 1) DP(c##u##1, w1, bc);                                                          \
        if (V > 2) DP(c##u##2, w2, bc);                                                          \
        if (V > 3) DP(c##u##3, w3, bc);                                                          \
    }
#define STEP(j)                                                                                  \
    {                                                                                            \
        const uint8_t *wq = wp + (int64_t)(j) * PACK_STEP;                                       \
        w0 = _mm512_loadu_si512(wq);                                                             \
        if (V > 1) w1 = _mm512_loadu_si512(wq + 64);                                             \
        if (V > 2) w2 = _mm512_loadu_si512(wq + 128);                                            \
        if (V > 3) w3 = _mm512_loadu_si512(wq + 192);                                            \
        TOKEN(0, j) TOKEN(1, j) TOKEN(2, j) TOKEN(3, j) TOKEN(4, j) TOKEN(5, j)                  \
    }
    const unsigned groups = (unsigned)(n4 + PF_GROUP - 1) / PF_GROUP;
    const unsigned w_per = groups ? (wpf->q1 - wpf->q0 + groups - 1) / groups : 0;
    const unsigned a_per = groups ? (apf->q1 - apf->q0 + groups - 1) / groups : 0;
    unsigned wq_ = wpf->q0, aq = apf->q0;
    for (int j0 = 0; j0 < n4; j0 += PF_GROUP) {
        for (unsigned i = 0; i < w_per && wq_ < wpf->q1; i++, wq_++)
            _mm_prefetch(pf_weight_line(wpf, wq_), _MM_HINT_T0);
        for (unsigned i = 0; i < a_per && aq < apf->q1; i++, aq++)
            _mm_prefetch(pf_act_line(apf, aq), _MM_HINT_T0);
        const int j1 = n4 - j0 < PF_GROUP ? n4 : j0 + PF_GROUP;
        for (int j = j0; j < j1; j++)
            STEP(j)
    }
    ACC(STORE_C)
#undef STEP
#undef TOKEN
#undef LOAD_C
#undef STORE_C
#undef ACC
}

typedef void (*tile_fn)(const uint8_t *wp, int n4, const int8_t *const *ar, int first, const pf_lines *wpf,
                        const pf_lines *apf, int32_t *c);

#define TILE(U, V)                                                                               \
    static AVX512 __attribute__((noinline)) void tile##U##x##V(const uint8_t *wp, int n4,        \
                                                                const int8_t *const *ar,         \
                                                                int first, const pf_lines *wpf,  \
                                                                const pf_lines *apf, int32_t *c) \
    {                                                                                            \
        tile(wp, n4, ar, first, wpf, apf, U, V, c);                                              \
    }
#define TILES(U) TILE(U, 1) TILE(U, 2) TILE(U, 3) TILE(U, 4)
TILES(1) TILES(2) TILES(3) TILES(4) TILES(5) TILES(6)
#undef TILES
#undef TILE

static const tile_fn tiles[MR][NR / 16] = {
    {tile1x1, tile1x2, tile1x3, tile1x4}, {tile2x1, tile2x2, tile2x3, tile2x4},
    {tile3x1, tile3x2, tile3x3, tile3x4}, {tile4x1, tile4x2, tile4x3, tile4x4},
    {tile5x1, tile5x2, tile5x3, tile5x4}, {tile6x1, tile6x2, tile6x3, tile6x4},
};

/* The weight block packed after (c0, t0, k0) in the loop order of pd_gemm_rows_vnni: the next K
 * block, else the first of the next super-block or chunk of rows; past the task's rows, the
 * next rows of the matrix (likely the next task) or the start of the next matrix (job->w_next).
 * Returns its first row's first byte and sets *nr, its rows; NULL if there is none. */
static const int8_t *next_block(const pd_gemm_job *job, int c0, int t0, int k0, int *nr)
{
    int nc0 = c0, nk0 = k0 + KC;
    if (nk0 >= job->in) {
        nk0 = 0;
        if (t0 + SUPER >= job->n)
            nc0 = c0 + NR;
    }
    if (nc0 < job->out) {
        *nr = job->out - nc0 < NR ? job->out - nc0 : NR;
        return job->w + (int64_t)nc0 * job->in + nk0;
    }
    *nr = job->w_next ? (job->next_out < NR ? job->next_out : NR) : 0;
    return job->w_next;
}

AVX512 void pd_gemm_rows_vnni(const pd_gemm_job *job, int o0, int o1)
{
    const int in = job->in;
    _Alignas(64) uint8_t wp[KC / 4 * PACK_STEP];
    _Alignas(64) int32_t acc[SUPER * NR];
    for (int c0 = o0; c0 < o1; c0 += NR) {
        const int nr = o1 - c0 < NR ? o1 - c0 : NR, nv = (nr + 15) / 16;
        const int8_t *w = job->w + (int64_t)c0 * in;
        for (int t0 = 0; t0 < job->n; t0 += SUPER) {
            const int nt = job->n - t0 < SUPER ? job->n - t0 : SUPER, n_tiles = (nt + MR - 1) / MR;
            for (int k0 = 0; k0 < in; k0 += KC) {
                const int kn = in - k0 < KC ? in - k0 : KC, full4 = kn / 4;
                pack(w, in, nr, k0, kn, wp);
                int pnr;
                const int8_t *pbase = next_block(job, c0, t0, k0, &pnr);
                const int p_lines = pnr * (KC / 64), p_step = (p_lines + n_tiles - 1) / n_tiles;
                for (int b = 0, tl = 0; b < nt; b += MR, tl++) {
                    const int nu = nt - b < MR ? nt - b : MR;
                    const int8_t *ar[MR];
                    for (int u = 0; u < nu; u++)
                        ar[u] = pd_gemm_job_arow(job, t0 + b + u) + k0;
                    int32_t *c = acc + (int64_t)b * NR;
                    /* the next tile's activation rows */
                    const int8_t *nar[MR];
                    int nnu = 0;
                    for (int u = b + MR; u < b + 2 * MR && u < nt; u++)
                        nar[nnu++] = pd_gemm_job_arow(job, t0 + u) + k0;
                    const pf_lines wpf = {pbase, NULL, in, (unsigned)(tl * p_step < p_lines ? tl * p_step : p_lines),
                                          (unsigned)((tl + 1) * p_step < p_lines ? (tl + 1) * p_step : p_lines)};
                    const pf_lines apf = {NULL, nar, 0, 0, (unsigned)nnu * (KC / 64)};
                    tiles[nu - 1][nv - 1](wp, full4, ar, k0 == 0, &wpf, &apf, c);
                    if (kn % 4) {
                        /* The last 1-3 bytes of the reduction: zero-padded copies of them. */
                        _Alignas(4) int8_t tail[MR][4];
                        const int8_t *tp[MR];
                        for (int u = 0; u < nu; u++) {
                            memset(tail[u], 0, 4);
                            memcpy(tail[u], ar[u] + 4 * full4, (size_t)(kn % 4));
                            tp[u] = tail[u];
                        }
                        const pf_lines none = {NULL, NULL, 0, 0, 0};
                        tiles[nu - 1][nv - 1](wp + (int64_t)full4 * PACK_STEP, 1, tp, k0 == 0 && full4 == 0, &none, &none, c);
                    }
                }
            }
            /* The exact products, offset sums - 128 * the token's activation sum (modulo 2^32),
             * scaled into y (past the caches for a large output: gemm_impl.h). */
            for (int u = 0; u < nt; u++) {
                const __m512i corr = _mm512_set1_epi32((int32_t)((uint32_t)job->a_sum[pd_gemm_job_tok(job, t0 + u)] << 7));
                const int32_t *c = acc + (int64_t)u * NR;
                for (int v = 0; v < nv; v++)
                    pd_gemm_store16(job, t0 + u, c0 + 16 * v, nr - 16 * v < 16 ? nr - 16 * v : 16,
                                    _mm512_sub_epi32(_mm512_load_si512(c + 16 * v), corr));
            }
        }
    }
}

/* pd_dot_gemm: the AVX-512 pd_dot (vec.c's dot_avx512) of every (w row, x row) pair, tiled.
 *
 * dot_avx512's rounding, which each output here repeats exactly: with the row cut into 16-value
 * blocks b = 0 .. n/16 - 1, chain s0 accumulates the even blocks and s1 the odd ones, each by
 * fused multiply-adds in increasing b; then v = s0 + s1 (lane by lane) and its 16 lanes summed
 * as a tree (vec.c's lane_sum: a_k = v[k] + v[k + 8], b_k = a_k + a_{k + 4}, c_k = b_k + b_{k + 2},
 * dot = c_0 + c_1). A tile of 4 w rows x 4 x rows runs the even blocks (16 chains in registers),
 * then the odd ones, so each chain sees its blocks in dot_avx512's order. The lane sums of a
 * tile's 16 outputs are done together, the same pairs added stage by stage across vectors
 * (lane_sums16). (Lanes added one after another, as before, cost a tile 64 shuffles and a chain
 * of 16 dependent additions, which at a head's 128 values took as long as the products: attention
 * scores 74.6 GFLOPS on one core of a Xeon with AMX, 105.5 with the tree.) Rows of w are taken in
 * blocks of about 24 KiB, so a block and the 4 x rows of the current tile stay in L1 while every
 * tile of x passes over it, and the next block is prefetched into L2 meanwhile, a few lines
 * before each tile (from memory, a 64 MiB matrix of 512-value rows times 16 tokens, 1 thread: bf16
 * 38-42 GFLOPS widened into a buffer first, 55-60 widened in registers, 65-72 with the prefetch;
 * fp32 38-41, then 49-55). The small constant loops carry "GCC unroll": GCC -O2 leaves them rolled, and then the arrays of vectors live in
 * memory instead of registers (24 GFLOPS instead of 95-105 for 64 rows x 512 tokens x 512). */
#include "kernels/dot_gemm.h"
#include "kernels/vec.h"

#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f")))
#define INLINE static inline __attribute__((always_inline))

/* The lanes of 16 vectors summed as vec.c's lane_sum sums one vector's (lane k plus k + 8, then
 * k plus k + 4, k plus k + 2, 0 plus 1), all 16 at once: each stage pairs two vectors' halves
 * into one vector of sums, 30 shuffles and 15 additions in all, none waiting on a long chain.
 * Lane 4g + m of the result is the sum of r[4m + g]. */
INLINE AVX512 __m512 lane_sums16(const __m512 *r)
{
    __m512 a[8], b[4], c[2];
    /* a[m]: lanes 0-7 r[2m]'s k + (k + 8), lanes 8-15 r[2m + 1]'s */
    #pragma GCC unroll 8
    for (int m = 0; m < 8; m++)
        a[m] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * m], r[2 * m + 1], 0x44),
                             _mm512_shuffle_f32x4(r[2 * m], r[2 * m + 1], 0xee));
    /* b[p]: 128-bit lane g r[4p + g]'s k + (k + 4), k < 4 */
    #pragma GCC unroll 4
    for (int p = 0; p < 4; p++)
        b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xdd));
    /* c[q]: 128-bit lane g r[8q + g]'s k + (k + 2) at lanes 0, 1, r[8q + 4 + g]'s at 2, 3 */
    #pragma GCC unroll 2
    for (int q = 0; q < 2; q++)
        c[q] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * q], b[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(b[2 * q], b[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* 128-bit lane g: r[g], r[4 + g], r[8 + g], r[12 + g], each 0 + 1 */
    return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* 16 values of w row p from value i: fp32, or bf16 widened in registers (exact: a bf16 value is
 * the top half of its fp32), `bf16` a constant after inlining. */
INLINE AVX512 __m512 w_load(const void *p, int bf16, int i)
{
    if (bf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
    return _mm512_loadu_ps((const float *)p + i);
}

/* One chain's blocks (b = first, first + 2, ...) of 4 w rows against 4 x rows into acc[4 * i + j]. */
INLINE AVX512 void chain(const void *const *w, int bf16, const float *const *x, int first, int nb, __m512 *acc)
{
    for (int b = first; b < nb; b += 2) {
        __m512 xv[4];
        #pragma GCC unroll 16
        for (int j = 0; j < 4; j++)
            xv[j] = _mm512_loadu_ps(x[j] + 16 * b);
        #pragma GCC unroll 16
        for (int i = 0; i < 4; i++) {
            __m512 wv = w_load(w[i], bf16, 16 * b);
            #pragma GCC unroll 16
            for (int j = 0; j < 4; j++)
                acc[4 * i + j] = _mm512_fmadd_ps(wv, xv[j], acc[4 * i + j]);
        }
    }
}

/* The outputs of w rows r0 .. r0+3 (clamped to rows) and x rows t0 .. t0+3 (clamped to T);
 * outputs outside the matrix are computed on a repeated row and not stored. w holds fp32 values,
 * or bf16 ones when `bf16` (ldw in values either way). */
INLINE AVX512 void tile(const void *w, int bf16, size_t ldw, int rows, const float *x, size_t ldx, int T, int n,
                        float *y, size_t ldy, int r0, int t0)
{
    const void *wr[4];
    const float *xr[4];
    #pragma GCC unroll 16
    for (int i = 0; i < 4; i++) {
        const size_t off = (size_t)(r0 + i < rows ? r0 + i : rows - 1) * ldw;
        wr[i] = bf16 ? (const void *)((const uint16_t *)w + off) : (const void *)((const float *)w + off);
        xr[i] = x + (size_t)(t0 + i < T ? t0 + i : T - 1) * ldx;
    }
    const int nb = n / 16;
    __m512 s0[16], s1[16];
    #pragma GCC unroll 16
    for (int k = 0; k < 16; k++)
        s0[k] = s1[k] = _mm512_setzero_ps();
    /* dot_avx512: the odd 16-value block goes to s0 when a lone one ends the row, as b's parity says */
    chain(wr, bf16, xr, 0, nb, s0);
    chain(wr, bf16, xr, 1, nb, s1);
    #pragma GCC unroll 16
    for (int k = 0; k < 16; k++)
        s0[k] = _mm512_add_ps(s0[k], s1[k]);
    /* lanes 4j .. 4j + 3: x row t0 + j's outputs of w rows r0 .. r0 + 3, stored 4 at a time */
    const __m512 sum = lane_sums16(s0);
    if (r0 + 4 <= rows && t0 + 4 <= T) {
        _mm_storeu_ps(y + (size_t)t0 * ldy + r0, _mm512_extractf32x4_ps(sum, 0));
        _mm_storeu_ps(y + (size_t)(t0 + 1) * ldy + r0, _mm512_extractf32x4_ps(sum, 1));
        _mm_storeu_ps(y + (size_t)(t0 + 2) * ldy + r0, _mm512_extractf32x4_ps(sum, 2));
        _mm_storeu_ps(y + (size_t)(t0 + 3) * ldy + r0, _mm512_extractf32x4_ps(sum, 3));
        return;
    }
    float out[16];
    _mm512_storeu_ps(out, sum);
    for (int j = 0; j < 4 && t0 + j < T; j++)
        for (int i = 0; i < 4 && r0 + i < rows; i++)
            y[(size_t)(t0 + j) * ldy + r0 + i] = out[4 * j + i];
}

INLINE AVX512 void tile_f32(const float *w, size_t ldw, int rows, const float *x, size_t ldx, int T, int n, float *y,
                            size_t ldy, int r0, int t0)
{
    tile(w, 0, ldw, rows, x, ldx, T, n, y, ldy, r0, t0);
}

AVX512 static void tile_bf16(const uint16_t *w, size_t ldw, int rows, const float *x, size_t ldx, int T, int n,
                             float *y, size_t ldy, int r0, int t0)
{
    tile(w, 1, ldw, rows, x, ldx, T, n, y, ldy, r0, t0);
}

/* bf16 rows that many tokens meet (a prefill's projections): each block widened once into this
 * thread's fp32 buffer (exact: a bf16 value is the top half of its fp32), then the fp32 tiles over
 * every tile of x, instead of widening every row again for every 4 tokens in registers, where the
 * conversions take the FMA ports' slots. 24 KiB, L1's share of the block. */
enum { WIDE_FLOATS = 6144, WIDE_MIN_T = 32 };
static _Thread_local float wide[WIDE_FLOATS] __attribute__((aligned(64)));

AVX512 static void dot_gemm_wide(const uint16_t *w, size_t ldw, int rows, const float *x, size_t ldx, int T, int n,
                                 float *y, size_t ldy)
{
    const int block = WIDE_FLOATS / n / 4 * 4;   /* the caller keeps 4 * n <= WIDE_FLOATS */
    /* tokens in chunks of about 256 KiB of x, which stay in L2 while every block passes over them
     * (a prefill's 2,048 tokens are 4 MiB of x at 512 values: streamed from L3 once per block) */
    const int chunk = (256 << 10) / (n * 4) / 4 * 4;   /* at least 40: n <= WIDE_FLOATS / 4 */
    for (int c0 = 0; c0 < T; c0 += chunk) {
        const int c1 = c0 + chunk < T ? c0 + chunk : T;
        for (int b0 = 0; b0 < rows; b0 += block) {
            const int b1 = b0 + block < rows ? b0 + block : rows;
            for (int r = b0; r < b1; r++)
                pd_bf16_to_f32_row(w + (size_t)r * ldw, wide + (size_t)(r - b0) * n, n);
            for (int t0 = c0; t0 < c1; t0 += 4)
                for (int r0 = 0; r0 < b1 - b0; r0 += 4)
                    tile_f32(wide, (size_t)n, b1 - b0, x, ldx, T, n, y + b0, ldy, r0, t0);
        }
    }
}

/* Rows of w in blocks of about 24 KiB (es bytes a value), each block's tiles over every tile of x;
 * rows so long that 8 of them pass 24 KiB in blocks of about 256 KiB, kept in L2 while x passes
 * (mHC's mixing, 24 fp32 rows of 2,048 values times 2,048 tokens, 1 thread: 28-32 GFLOPS in
 * blocks of 4 rows, 42 in one block of 24). */
AVX512 static void dot_gemm_avx512(const void *w, int bf16, size_t ldw, int rows, const float *x, size_t ldx, int T,
                                   int n, float *y, size_t ldy)
{
    if (bf16 && T >= WIDE_MIN_T && 4 * n <= WIDE_FLOATS) {
        dot_gemm_wide(w, ldw, rows, x, ldx, T, n, y, ldy);
        return;
    }
    const int es = bf16 ? 2 : 4;
    int block = (24 << 10) / (n * es) / 4 * 4;
    if (block < 8)   /* long rows: 4 x rows fill L1 by themselves; a block of 256 KiB stays in L2 */
        block = (256 << 10) / (n * es) / 4 * 4;
    block = block < 4 ? 4 : block;
    const char *base = w;
    const size_t row_bytes = ldw * (size_t)es;
    for (int b0 = 0; b0 < rows; b0 += block) {
        const int b1 = b0 + block < rows ? b0 + block : rows;
        /* the next block's lines, spread over this block's tiles: fetched while these multiply */
        const int nb1 = b1 + block < rows ? b1 + block : rows;
        const char *pf = base + (size_t)b1 * row_bytes, *pf_end = base + (size_t)nb1 * row_bytes;
        const int tiles = ((T + 3) / 4) * ((b1 - b0 + 3) / 4);
        const size_t per_tile = (size_t)(pf_end - pf) / 64 / (size_t)tiles + 1;
        for (int t0 = 0; t0 < T; t0 += 4)
            for (int r0 = b0; r0 < b1; r0 += 4) {
                for (size_t l = 0; l < per_tile && pf < pf_end; l++, pf += 64)
                    _mm_prefetch(pf, _MM_HINT_T1);
                if (bf16)
                    tile_bf16(w, ldw, b1, x, ldx, T, n, y, ldy, r0, t0);
                else
                    tile_f32(w, ldw, b1, x, ldx, T, n, y, ldy, r0, t0);
            }
    }
}

/* Either product: the tiles where pd_dot is the AVX-512 one (vec.c chooses it exactly where
 * avx512f is) and n is a multiple of 16, else pd_dot_rows_tokens[_bf16] (the same bits; on AVX2
 * CPUs their register tiles, vec_avx2.h). */
static void dot_gemm(const void *w, int bf16, size_t ldw, int rows, const float *x, size_t ldx, int T, int n,
                     float *y, size_t ldy)
{
    if (rows <= 0 || T <= 0)
        return;
    if (n > 0 && n % 16 == 0 && __builtin_cpu_supports("avx512f")) {
        dot_gemm_avx512(w, bf16, ldw, rows, x, ldx, T, n, y, ldy);
        return;
    }
    if (bf16)
        pd_dot_rows_tokens_bf16(w, ldw, x, ldx, T, n, rows, y, ldy);
    else
        pd_dot_rows_tokens(w, ldw, x, ldx, T, n, rows, y, ldy);
}

void pd_dot_gemm(const float *w, size_t ldw, int rows, const float *x, size_t ldx, int T, int n, float *y,
                 size_t ldy)
{
    dot_gemm(w, 0, ldw, rows, x, ldx, T, n, y, ldy);
}

void pd_dot_gemm_bf16(const uint16_t *w, size_t ldw, int rows, const float *x, size_t ldx, int T, int n, float *y,
                      size_t ldy)
{
    dot_gemm(w, 1, ldw, rows, x, ldx, T, n, y, ldy);
}

/* axpy_rows_avx512 (vec.c) per value of y: y = fma(a[k], x[k][i], y) for k = 0 .. rows - 1. Here
 * for 4 rows of y (h0 .. h0+3, clamped to na; a repeated row is not stored) over 64 values from
 * i: 16 chains, x's 4 vectors loaded once per k for all 4 rows. */
AVX512 static void axpy_tile(const float *a, size_t lda, int na, const float *x, size_t ldx, int rows, float *y,
                             size_t ldy, int h0, int i)
{
    const float *ar[4];
    float *yr[4];
    #pragma GCC unroll 4
    for (int h = 0; h < 4; h++) {
        int hh = h0 + h < na ? h0 + h : na - 1;
        ar[h] = a + (size_t)hh * lda;
        yr[h] = y + (size_t)hh * ldy + i;
    }
    __m512 acc[16];
    #pragma GCC unroll 16
    for (int h = 0; h < 4; h++)
        #pragma GCC unroll 4
        for (int v = 0; v < 4; v++)
            acc[4 * h + v] = _mm512_loadu_ps(yr[h] + 16 * v);
    for (int k = 0; k < rows; k++) {
        const float *xk = x + (size_t)k * ldx + i;
        __m512 xv[4];
        #pragma GCC unroll 4
        for (int v = 0; v < 4; v++)
            xv[v] = _mm512_loadu_ps(xk + 16 * v);
        #pragma GCC unroll 4
        for (int h = 0; h < 4; h++) {
            __m512 va = _mm512_set1_ps(ar[h][k]);
            #pragma GCC unroll 4
            for (int v = 0; v < 4; v++)
                acc[4 * h + v] = _mm512_fmadd_ps(va, xv[v], acc[4 * h + v]);
        }
    }
    #pragma GCC unroll 4
    for (int h = 0; h < 4; h++)
        if (h0 + h < na)
            #pragma GCC unroll 4
            for (int v = 0; v < 4; v++)
                _mm512_storeu_ps(yr[h] + 16 * v, acc[4 * h + v]);
}

void pd_axpy_heads(const float *a, size_t lda, int na, const float *x, size_t ldx, int rows, float *y, size_t ldy,
                   int n)
{
    int i = 0;
    /* the AVX-512 axpy is chosen exactly where avx512f is (vec.c); its 16-value blocks are the
     * whole row when n is a multiple of 16 */
    if (n % 16 == 0 && __builtin_cpu_supports("avx512f"))
        for (; i + 64 <= n; i += 64)
            for (int h0 = 0; h0 < na; h0 += 4)
                axpy_tile(a, lda, na, x, ldx, rows, y, ldy, h0, i);
    if (i < n)
        for (int h = 0; h < na; h++)
            pd_axpy_rows(a + (size_t)h * lda, x + i, ldx, rows, y + (size_t)h * ldy + i, n - i);
}

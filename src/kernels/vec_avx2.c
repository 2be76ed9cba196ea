/* The AVX2 + FMA dot products (vec_avx2.h): pd_dot where the CPU has no AVX-512, and the
 * register-tiled products over many rows and tokens that give its bits. Without them a decode
 * step of 16 tokens took every bf16 row through a widened copy in cache and one lone dot product
 * per (row, token), 16 times over (on an AVX2-only AMD EPYC host, batch 16, 1 thread: 44% of the
 * step's samples in those two functions). */
#include "kernels/vec_avx2.h"

#include <immintrin.h>
#include <stdint.h>

#define AVX2 __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))

/* 8 values of row w from i, fp32 or bf16 (a constant after inlining; a bf16 is the top half of
 * its fp32, so widening is exact: vpmovzxwd + vpslld). */
INLINE AVX2 __m256 w_load8(const void *w, int bf16, int i)
{
    if (bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i))), 16));
    return _mm256_loadu_ps((const float *)w + i);
}

/* The end of every dot product here (one function, so every caller rounds alike): the chains
 * added, their 8 lanes summed pairwise as vec_avx2.h states, then the scalar tail from i (a bf16
 * row's tail widened first: the same values). */
INLINE AVX2 float finish(__m256 s0, __m256 s1, const void *w, int bf16, const float *b, int i, int n)
{
    float l[8], wide[16];
    const float *a = (const float *)w;
    if (bf16 && i < n) {
        for (int k = 0; k < n - i; k++) {
            uint32_t u = (uint32_t)((const uint16_t *)w)[i + k] << 16;
            __builtin_memcpy(&wide[k], &u, 4);
        }
        a = wide - i;
    }
    _mm256_storeu_ps(l, _mm256_add_ps(s0, s1));
    float t = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
    for (; i < n; i++)
        t += a[i] * b[i];
    return t;
}

AVX2 float pd_vec_dot_avx2(const float *a, const float *b, int n)
{
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    return finish(s0, s1, a, 0, b, i, n);
}

/* R rows (1 or 2) times U tokens (1 to 3), constants after inlining: R x U dot products side by
 * side, each with pd_vec_dot_avx2's two chains over the same blocks in the same order and its
 * finish, so each its bits. A block's two halves go one after the other, so the 12 accumulators
 * of 2 x 3, the half-block of each row and one token's values fit the 16 registers; each row value
 * is loaded (and widened) once for the U tokens, each token value once for the R rows. */
INLINE AVX2 void tile(const void *w0, const void *w1, int R, int bf16, const float *x, size_t ldx, int U, int n,
                      float *y, size_t ldy)
{
    __m256 acc[2][3][2];
#pragma GCC unroll 2
    for (int r = 0; r < 2; r++)
#pragma GCC unroll 3
        for (int t = 0; t < 3; t++)
            acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256 u0 = w_load8(w0, bf16, i + 8 * h);
            const __m256 u1 = R > 1 ? w_load8(w1, bf16, i + 8 * h) : u0;
#pragma GCC unroll 3
            for (int t = 0; t < 3; t++)
                if (t < U) {
                    const __m256 p = _mm256_loadu_ps(x + t * ldx + i + 8 * h);
                    acc[0][t][h] = _mm256_fmadd_ps(u0, p, acc[0][t][h]);
                    if (R > 1)
                        acc[1][t][h] = _mm256_fmadd_ps(u1, p, acc[1][t][h]);
                }
        }
    }
    for (int t = 0; t < U; t++) {
        y[t * ldy] = finish(acc[0][t][0], acc[0][t][1], w0, bf16, x + t * ldx, i, n);
        if (R > 1)
            y[t * ldy + 1] = finish(acc[1][t][0], acc[1][t][1], w1, bf16, x + t * ldx, i, n);
    }
}

/* 4 rows x 3 tokens (rows lw bytes apart), the same 12 dot products as tile's, in two passes: the
 * first halves of every 16-value block (chain s0 of every output), then the second halves (s1).
 * One accumulator per output and pass instead of two, so 4 rows fit beside 3 tokens in the 16
 * registers: each token vector serves 4 rows, each widened row vector 3 tokens (tile's 2 x 3 loads
 * 5 vectors for 6 products, this 7 for 12). Each chain still takes its blocks in increasing order,
 * so every output is pd_vec_dot_avx2's bits. Rows of at most FOUR_ROWS_MAX_N values: 4 rows and 3
 * tokens of them (28 KiB at most, fp32) stay in L1 between the two passes. Measured in one process
 * against tile (64-row tasks, 1 thread, AVX2-only AMD EPYC, same bits): 512-value rows x 512
 * tokens 43-44 -> 62-63 GFLOPS bf16; an attention head's scores (128-value keys x 8 heads, fp32)
 * 37.7 -> 41.1. Chains carried across chunks of a longer reduction (their sums in memory between
 * chunks) ran at 48-50 on the first shape, so longer rows keep the 2 x 3 tiles. */
enum { FOUR_ROWS_MAX_N = 1024 };

INLINE AVX2 void half_pass(const char *w, size_t lw, int bf16, const float *x, size_t ldx, int nb, int h,
                           __m256 *out)   // [12]
{
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00;
    __m256 c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
    const float *x0 = x + 8 * h, *x1 = x0 + ldx, *x2 = x1 + ldx;
    const char *w0 = w + 8 * h * (bf16 ? 2 : 4), *w1 = w0 + lw, *w2 = w1 + lw, *w3 = w2 + lw;
    for (int b = 0; b < nb; b++) {
        const int i = 16 * b;
        const __m256 a0 = _mm256_loadu_ps(x0 + i), a1 = _mm256_loadu_ps(x1 + i), a2 = _mm256_loadu_ps(x2 + i);
        __m256 u = w_load8(w0, bf16, i);
        c00 = _mm256_fmadd_ps(u, a0, c00);
        c01 = _mm256_fmadd_ps(u, a1, c01);
        c02 = _mm256_fmadd_ps(u, a2, c02);
        u = w_load8(w1, bf16, i);
        c10 = _mm256_fmadd_ps(u, a0, c10);
        c11 = _mm256_fmadd_ps(u, a1, c11);
        c12 = _mm256_fmadd_ps(u, a2, c12);
        u = w_load8(w2, bf16, i);
        c20 = _mm256_fmadd_ps(u, a0, c20);
        c21 = _mm256_fmadd_ps(u, a1, c21);
        c22 = _mm256_fmadd_ps(u, a2, c22);
        u = w_load8(w3, bf16, i);
        c30 = _mm256_fmadd_ps(u, a0, c30);
        c31 = _mm256_fmadd_ps(u, a1, c31);
        c32 = _mm256_fmadd_ps(u, a2, c32);
    }
    out[0] = c00, out[1] = c01, out[2] = c02, out[3] = c10, out[4] = c11, out[5] = c12;
    out[6] = c20, out[7] = c21, out[8] = c22, out[9] = c30, out[10] = c31, out[11] = c32;
}

INLINE AVX2 void tile4x3(const char *w, size_t lw, int bf16, const float *x, size_t ldx, int n, float *y,
                         size_t ldy)
{
    __m256 s0[12], s1[12];
    const int nb = n / 16;
    half_pass(w, lw, bf16, x, ldx, nb, 0, s0);
    half_pass(w, lw, bf16, x, ldx, nb, 1, s1);
    for (int r = 0; r < 4; r++)
        for (int t = 0; t < 3; t++)
            y[t * ldy + r] = finish(s0[3 * r + t], s1[3 * r + t], w + r * lw, bf16, x + t * ldx, 16 * nb, n);
}

/* One token against 4 rows ls bytes apart, outputs y[0], y[ly], y[2 ly], y[3 ly]: each row with
 * pd_vec_dot_avx2's two chains over the same blocks in the same order and its finish, so each its
 * bits; the four rows' 8 chains side by side, where one row alone waits on its two. */
INLINE AVX2 void tile4x1(const char *w, size_t ls, int bf16, const float *x, int n, float *y, size_t ly)
{
    const char *w0 = w, *w1 = w0 + ls, *w2 = w1 + ls, *w3 = w2 + ls;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(w_load8(w0, bf16, i), x0, a0);
        a1 = _mm256_fmadd_ps(w_load8(w0, bf16, i + 8), x1, a1);
        b0 = _mm256_fmadd_ps(w_load8(w1, bf16, i), x0, b0);
        b1 = _mm256_fmadd_ps(w_load8(w1, bf16, i + 8), x1, b1);
        c0 = _mm256_fmadd_ps(w_load8(w2, bf16, i), x0, c0);
        c1 = _mm256_fmadd_ps(w_load8(w2, bf16, i + 8), x1, c1);
        d0 = _mm256_fmadd_ps(w_load8(w3, bf16, i), x0, d0);
        d1 = _mm256_fmadd_ps(w_load8(w3, bf16, i + 8), x1, d1);
    }
    y[0] = finish(a0, a1, w0, bf16, x, i, n);
    y[ly] = finish(b0, b1, w1, bf16, x, i, n);
    y[2 * ly] = finish(c0, c1, w2, bf16, x, i, n);
    y[3 * ly] = finish(d0, d1, w3, bf16, x, i, n);
}

/* R rows against T tokens: the tokens three at a time, then the one or two left. */
INLINE AVX2 void rows_by_tokens(const void *w0, const void *w1, int R, int bf16, const float *x, size_t ldx, int T,
                                int n, float *y, size_t ldy)
{
    int t = 0;
    for (; t + 3 <= T; t += 3)
        tile(w0, w1, R, bf16, x + t * ldx, ldx, 3, n, y + t * ldy, ldy);
    if (T - t == 2)
        tile(w0, w1, R, bf16, x + t * ldx, ldx, 2, n, y + t * ldy, ldy);
    else if (T - t == 1)
        tile(w0, w1, R, bf16, x + t * ldx, ldx, 1, n, y + t * ldy, ldy);
}

/* Rows up to 4 KiB are prefetched about PF_L2_BYTES ahead into L2 (as vec.c's AVX-512 rows are:
 * short rows are too short a stream for the hardware prefetchers); longer ones are left to them. */
enum { PF_L2_BYTES = 16384, PF_MAX_ROW = 4096 };

/* `count` rows of rb bytes, ls bytes apart from `first`, into L2. */
INLINE void prefetch_rows(const char *first, size_t ls, int count, size_t rb)
{
    for (int q = 0; q < count; q++)
        for (size_t b = 0; b < rb; b += 64)
            _mm_prefetch(first + q * ls + b, _MM_HINT_T1);
}

INLINE AVX2 void rows_tokens(const void *w, int bf16, size_t ld, const float *x, size_t ldx, int T, int n, int rows,
                             float *y, size_t ldy)
{
    const size_t es = bf16 ? 2 : 4, rb = (size_t)n * es;
    const char *wb = w;
    int r = 0;
    /* One token: the rows as 4 streams, tile j taking rows j, j + q, j + 2q and j + 3q (q = rows /
     * 4), each stream sequential, which the hardware prefetchers follow without help; the 1-3 rows
     * left one by one. Measured in one process against row by row with an L2 prefetch 16 KiB ahead
     * (one stream), 64-row tasks over 512 bf16 matrices of 256 x 512 evicted from the caches, 1 thread,
     * AVX2-only AMD EPYC, 3 rounds x 2: 18.1-20.1 GB/s against 12.0-13.8; the 4 streams with a
     * prefetch ahead in each 16.2-19.2, with the next task's rows prefetched 15.2-15.5. */
    if (T == 1) {
        const int q = rows / 4;
        for (; r < q; r++)
            tile4x1(wb + r * ld * es, q * ld * es, bf16, x, n, y + r, q);
        for (r = 4 * q; r < rows; r++)
            tile(wb + r * ld * es, NULL, 1, bf16, x, ldx, 1, n, y + r, ldy);
        return;
    }
    const int ahead = rb <= PF_MAX_ROW ? (int)((PF_L2_BYTES + rb - 1) / (rb ? rb : 1)) : 0;
    /* three tokens or more on rows of at most FOUR_ROWS_MAX_N: 4 rows at a time by 4 x 3 tiles, the
     * one or two tokens left by two 2-row tiles; the rows left (1-3) below */
    for (; T >= 3 && n <= FOUR_ROWS_MAX_N && r + 4 <= rows; r += 4) {
        const char *w0 = wb + r * ld * es;
        if (ahead && r + ahead + 3 < rows)
            prefetch_rows(w0 + ahead * ld * es, ld * es, 4, rb);
        int t = 0;
        for (; t + 3 <= T; t += 3)
            tile4x3(w0, ld * es, bf16, x + t * ldx, ldx, n, y + t * ldy + r, ldy);
        if (t < T) {
            rows_by_tokens(w0, w0 + ld * es, 2, bf16, x + t * ldx, ldx, T - t, n, y + t * ldy + r, ldy);
            rows_by_tokens(w0 + 2 * ld * es, w0 + 3 * ld * es, 2, bf16, x + t * ldx, ldx, T - t, n,
                           y + t * ldy + r + 2, ldy);
        }
    }
    for (; r + 2 <= rows; r += 2) {
        const char *w0 = wb + r * ld * es, *w1 = w0 + ld * es;
        if (ahead && r + ahead + 1 < rows)
            prefetch_rows(w0 + ahead * ld * es, ld * es, 2, rb);
        rows_by_tokens(w0, w1, 2, bf16, x, ldx, T, n, y + r, ldy);
    }
    if (r < rows)
        rows_by_tokens(wb + r * ld * es, NULL, 1, bf16, x, ldx, T, n, y + r, ldy);
}

/* Many tokens (a prefill) go in chunks of about 64 KiB of x, so that a chunk stays in L2 while
 * every row passes over it. */
AVX2 void pd_vec_dot_rows_tokens_avx2(const void *w, int bf16, size_t ld, const float *x, size_t ldx, int T, int n,
                                 int rows, float *y, size_t ldy)
{
    int chunk = (int)((64 << 10) / ((size_t)(n > 0 ? n : 1) * 4)) / 3 * 3;
    chunk = chunk < 3 ? 3 : chunk;
    for (int t0 = 0; t0 < T; t0 += chunk) {
        const int c = T - t0 < chunk ? T - t0 : chunk;
        if (bf16)
            rows_tokens(w, 1, ld, x + t0 * ldx, ldx, c, n, rows, y + t0 * ldy, ldy);
        else
            rows_tokens(w, 0, ld, x + t0 * ldx, ldx, c, n, rows, y + t0 * ldy, ldy);
    }
}

/* The tail of an axpy (one function for both callers below, so both round alike). */
INLINE AVX2 void axpy_tail(float a, const float *x, float *y, int i, int n)
{
    for (; i < n; i++)
        y[i] += a * x[i];
}

AVX2 void pd_vec_axpy_avx2(float a, const float *x, float *y, int n)
{
    const __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    axpy_tail(a, x, y, i, n);
}

/* pd_vec_axpy_avx2 row after row, with 64 values of y held in registers across the rows instead
 * of loaded and stored for each (the attention's weighted sums over its keys): per element the
 * same fused multiply-adds in the same order. */
AVX2 void pd_vec_axpy_rows_avx2(const float *a, const float *x, size_t ld, int rows, float *y, int n)
{
    int i = 0;
    for (; i + 64 <= n; i += 64) {
        __m256 v[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            v[j] = _mm256_loadu_ps(y + i + 8 * j);
        for (int k = 0; k < rows; k++) {
            const float *xk = x + k * ld + i;
            const __m256 va = _mm256_set1_ps(a[k]);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++)
                v[j] = _mm256_fmadd_ps(va, _mm256_loadu_ps(xk + 8 * j), v[j]);
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            _mm256_storeu_ps(y + i + 8 * j, v[j]);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(y + i);
        for (int k = 0; k < rows; k++)
            v = _mm256_fmadd_ps(_mm256_set1_ps(a[k]), _mm256_loadu_ps(x + k * ld + i), v);
        _mm256_storeu_ps(y + i, v);
    }
    if (i < n)
        for (int k = 0; k < rows; k++)
            axpy_tail(a[k], x + k * ld, y, i, n);
}

AVX2 void pd_vec_bf16_to_f32_avx2(const uint16_t *src, float *dst, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, w_load8(src, 1, i));
    for (; i < n; i++) {
        uint32_t u = (uint32_t)src[i] << 16;
        __builtin_memcpy(&dst[i], &u, 4);
    }
}

/* The element-wise steps (vec_avx2.h): whole vectors of 8 only; vec.c finishes the values left
 * with its scalar loops. */
AVX2 int pd_vec_scale_max_avx2(float *x, int n, float s, float *m)
{
    int i = 0;
    if (n >= 8) {
        const __m256 vs = _mm256_set1_ps(s);
        __m256 acc = _mm256_set1_ps(*m);
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), vs);
            _mm256_storeu_ps(x + i, v);
            acc = _mm256_max_ps(v, acc);   /* acc where v is NaN or equal: "v > acc ? v : acc" */
        }
        float l[8];
        _mm256_storeu_ps(l, acc);
        for (int k = 0; k < 8; k++)
            *m = l[k] > *m ? l[k] : *m;
    }
    return i;
}

AVX2 int pd_vec_div_d_avx2(float *x, int n, double d)
{
    const __m256d vd = _mm256_set1_pd(d);
    int i = 0;
    for (; i + 4 <= n; i += 4)
        _mm_storeu_ps(x + i, _mm256_cvtpd_ps(_mm256_div_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + i)), vd)));
    return i;
}

AVX2 int pd_vec_scale_axpys_avx2(float a, const float *x, const float *b, const float *z, size_t ldz, int nz, float *y,
                                 int n)
{
    const __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 t = _mm256_mul_ps(va, _mm256_loadu_ps(x + i));
        for (int j = 0; j < nz; j++)
            t = _mm256_fmadd_ps(_mm256_set1_ps(b[j]), _mm256_loadu_ps(z + j * ldz + i), t);
        _mm256_storeu_ps(y + i, t);
    }
    return i;
}

/* fp-contract=off: the product rounded, then the add, as the scalar loop (GCC would fuse them).
 * clang (the fuzz build) has no optimize attribute and needs none: it fuses only within one
 * expression, and the intrinsics are calls (vec.c's NO_FP_CONTRACT). */
#ifdef __clang__
#define NO_FP_CONTRACT
#else
#define NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#endif
AVX2 NO_FP_CONTRACT int pd_vec_weighted_sum_avx2(const float *a, const float *const *x, int rows, const float *z,
                                                 float *y, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 t = _mm256_setzero_ps();
        for (int j = 0; j < rows; j++)
            t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_set1_ps(a[j]), _mm256_loadu_ps(x[j] + i)));
        if (z)
            t = _mm256_add_ps(t, _mm256_loadu_ps(z + i));
        _mm256_storeu_ps(y + i, t);
    }
    return i;
}

AVX2 int pd_vec_scale_mul_avx2(float a, const float *x, const float *w, float *y, int n)
{
    const __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), va);
        _mm256_storeu_ps(y + i, w ? _mm256_mul_ps(v, _mm256_loadu_ps(w + i)) : v);
    }
    return i;
}

/* min_ps(x, L) is "x < L ? x : L" and max_ps(-L, min_ps(L, v)) the clamp of v, NaNs included. */
AVX2 int pd_vec_swiglu_pre_avx2(float *g, float *e, int c, float limit)
{
    const __m256 vl = _mm256_set1_ps(limit), neg = _mm256_set1_ps(-0.0f);
    int i = 0;
    for (; i + 8 <= c; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        if (limit > 0)
            x = _mm256_min_ps(x, vl);
        _mm256_storeu_ps(g + i, x);
        _mm256_storeu_ps(e + i, _mm256_xor_ps(x, neg));
    }
    return i;
}

AVX2 int pd_vec_swiglu_post_avx2(float *g, const float *u, const float *e, int c, float limit)
{
    const __m256 vl = _mm256_set1_ps(limit), vnl = _mm256_set1_ps(-limit), one = _mm256_set1_ps(1.0f);
    int i = 0;
    for (; i + 8 <= c; i += 8) {
        __m256 v = _mm256_loadu_ps(u + i);
        if (limit > 0)
            v = _mm256_max_ps(vnl, _mm256_min_ps(vl, v));
        __m256 q = _mm256_div_ps(_mm256_loadu_ps(g + i), _mm256_add_ps(one, _mm256_loadu_ps(e + i)));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(q, v));
    }
    return i;
}

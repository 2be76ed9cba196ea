/* Dot product and axpy, one row or many, and the bf16 products: portable, AVX2+FMA and AVX-512
 * versions, chosen at first use. The element-wise steps are in vec_elem.c. */
#include "kernels/vec.h"
#include "kernels/vec_avx2.h"

#include <assert.h>
#include <immintrin.h>
#include <pthread.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>

float pd_dot_ref(const float *a, const float *b, int n)
{
    float s[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++)
            s[k] += a[i + k] * b[i + k];
    float t = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
    for (; i < n; i++)
        t += a[i] * b[i];
    return t;
}

void pd_axpy_ref(float a, const float *x, float *y, int n)
{
    for (int i = 0; i < n; i++)
        y[i] += a * x[i];
}

#define AVX512 __attribute__((target("avx512f")))
#define INLINE static inline __attribute__((always_inline))

/* The 16 lanes of v summed as a tree: lane k plus lane k + 8 (k < 8), then those k plus k + 4,
 * k plus k + 2, then 0 plus 1. dot_gemm.c's tiles add the lanes of 16 products in these pairs. */
INLINE AVX512 float lane_sum(__m512 v)
{
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

/* The end of an AVX-512 dot product: the two chains added, their 16 lanes summed (lane_sum), the
 * scalar tail from i. One function for dot_avx512 and dot_rows_avx512, so both round alike. */
INLINE AVX512 float dot_finish(__m512 s0, __m512 s1, const float *a, const float *b, int i, int n)
{
    float t = lane_sum(_mm512_add_ps(s0, s1));
    for (; i < n; i++)
        t += a[i] * b[i];
    return t;
}

/* The main loop's length: chunks of 32, then at most one of 16. */
INLINE int dot_body(int n)
{
    return n / 16 * 16;
}

static void bf16_ref(const uint16_t *src, float *dst, int n)
{
    for (int i = 0; i < n; i++) {
        uint32_t u = (uint32_t)src[i] << 16;
        __builtin_memcpy(&dst[i], &u, 4);
    }
}

/* 16 bf16 values at p widened to fp32 in registers (exact: a bf16 is the top half of its fp32):
 * vpmovzxwd + vpslld, the same values bf16_avx512 stores. */
INLINE AVX512 __m512 bf16_load16(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* dot_finish for a bf16 row: its scalar tail (fewer than 16 values from i) widened, then the same
 * sums in the same order, so the same bits as dot_finish over the widened row. */
INLINE AVX512 float dot_finish_bf16(__m512 s0, __m512 s1, const uint16_t *w, const float *x, int i, int n)
{
    float t[16];
    bf16_ref(w + i, t, n - i);
    return dot_finish(s0, s1, t, x + i, 0, n - i);
}

/* One operand of the token-tile kernels: 16 values of row w at i, fp32 or bf16 (a constant after
 * inlining). */
INLINE AVX512 __m512 w_load16(const void *w, int bf16, int i)
{
    return bf16 ? bf16_load16((const uint16_t *)w + i) : _mm512_loadu_ps((const float *)w + i);
}

INLINE AVX512 float w_finish(__m512 s0, __m512 s1, const void *w, int bf16, const float *x, int i, int n)
{
    return bf16 ? dot_finish_bf16(s0, s1, (const uint16_t *)w, x, i, n) : dot_finish(s0, s1, (const float *)w, x, i, n);
}

/* A dot product over a row of fp32 or bf16 values (bf16 a constant after inlining, each value
 * widened in registers) and x: two chains of fused multiply-adds over chunks of 32, at most one
 * chunk of 16 more, then w_finish. Every kernel below that promises dot_avx512's bits does these
 * operations in this order for each of its rows. */
INLINE AVX512 float dot_w(const void *w, int bf16, const float *x, int n)
{
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm512_fmadd_ps(w_load16(w, bf16, i), _mm512_loadu_ps(x + i), s0);
        s1 = _mm512_fmadd_ps(w_load16(w, bf16, i + 16), _mm512_loadu_ps(x + i + 16), s1);
    }
    for (; i + 16 <= n; i += 16)
        s0 = _mm512_fmadd_ps(w_load16(w, bf16, i), _mm512_loadu_ps(x + i), s0);
    return w_finish(s0, s1, w, bf16, x, i, n);
}

AVX512 static float dot_avx512(const float *a, const float *b, int n)
{
    return dot_w(a, 0, b, n);
}

/* y[r] = dot_w(w + r * ld, x, n), four rows at a time: the same operations per row in the same
 * order (so the same bits), with eight independent chains instead of two. Rows of 256 to 1024
 * values (the router's gate: 2 KiB from memory; the head's and projections' bf16 rows) go one at a
 * time instead, each read to its end (one linear stream, as the int8 decode GEMV reads short
 * rows: four 2 KiB rows side by side are too short for the hardware prefetchers; router share of a
 * v4-flash-mini decode step 9.1% side by side, 7.1% one at a time), prefetching the row about
 * DOT_PF_L2_BYTES ahead into L2. Not into L1: on AMD EPYC the L1 prefetches held the core's few
 * outstanding L1 misses and the stream ran slower with them (1 thread, 256 KiB bf16 matrices of
 * 512-value rows at scattered places in 256 MiB, in 64-row calls, the shape of a decode step's
 * projections; all ways alternating in one process, busy host, medians of 11 passes in four runs:
 * the row 4 ahead into L1, as before, 12.3-13.3 GB/s; that and 24 KiB ahead into L2 12.1-14.2; 12,
 * 16 or 24 KiB ahead into L2 alone 14.7-17.9; an 8-stream read of the same bytes 21-26). Shorter
 * rows are the attention's keys, already in cache; longer ones are followed by the hardware. bf16
 * rows are widened in registers, not through a buffer in cache (which cost a store and a reload
 * per value: 18% of a decode step). */
enum { DOT_PF_L2_BYTES = 16384 };
INLINE AVX512 void dot_rows_w(const void *w, int bf16, size_t ld, const float *x, int n, int rows, float *y)
{
    const size_t es = bf16 ? 2 : 4;
    const char *wb = w;
    int r = 0;
    if (n >= 256 && n <= 1024) {
        const size_t rb = (size_t)n * es;
        const int ahead = (int)((DOT_PF_L2_BYTES + rb - 1) / rb);
        for (; r < rows; r++) {
            if (r + ahead < rows)
                for (size_t b = 0; b < rb; b += 64)
                    _mm_prefetch(wb + ((r + ahead) * ld) * es + b, _MM_HINT_T1);
            y[r] = dot_w(wb + r * ld * es, bf16, x, n);
        }
        return;
    }
    for (; r + 4 <= rows; r += 4) {
        const char *w0 = wb + r * ld * es, *w1 = w0 + ld * es, *w2 = w1 + ld * es, *w3 = w2 + ld * es;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
        int i = 0;
        for (; i + 32 <= n; i += 32) {
            __m512 x0 = _mm512_loadu_ps(x + i), x1 = _mm512_loadu_ps(x + i + 16);
            a0 = _mm512_fmadd_ps(w_load16(w0, bf16, i), x0, a0);
            a1 = _mm512_fmadd_ps(w_load16(w0, bf16, i + 16), x1, a1);
            b0 = _mm512_fmadd_ps(w_load16(w1, bf16, i), x0, b0);
            b1 = _mm512_fmadd_ps(w_load16(w1, bf16, i + 16), x1, b1);
            c0 = _mm512_fmadd_ps(w_load16(w2, bf16, i), x0, c0);
            c1 = _mm512_fmadd_ps(w_load16(w2, bf16, i + 16), x1, c1);
            d0 = _mm512_fmadd_ps(w_load16(w3, bf16, i), x0, d0);
            d1 = _mm512_fmadd_ps(w_load16(w3, bf16, i + 16), x1, d1);
        }
        if (i < dot_body(n)) {
            __m512 x0 = _mm512_loadu_ps(x + i);
            a0 = _mm512_fmadd_ps(w_load16(w0, bf16, i), x0, a0);
            b0 = _mm512_fmadd_ps(w_load16(w1, bf16, i), x0, b0);
            c0 = _mm512_fmadd_ps(w_load16(w2, bf16, i), x0, c0);
            d0 = _mm512_fmadd_ps(w_load16(w3, bf16, i), x0, d0);
            i += 16;
        }
        y[r] = w_finish(a0, a1, w0, bf16, x, i, n);
        y[r + 1] = w_finish(b0, b1, w1, bf16, x, i, n);
        y[r + 2] = w_finish(c0, c1, w2, bf16, x, i, n);
        y[r + 3] = w_finish(d0, d1, w3, bf16, x, i, n);
    }
    for (; r < rows; r++)
        y[r] = dot_w(wb + r * ld * es, bf16, x, n);
}

AVX512 static void dot_rows_avx512(const float *w, size_t ld, const float *x, int n, int rows, float *y)
{
    dot_rows_w(w, 0, ld, x, n, rows, y);
}

AVX512 static void dot_rows_bf16_avx512(const uint16_t *w, size_t ld, const float *x, int n, int rows, float *y)
{
    dot_rows_w(w, 1, ld, x, n, rows, y);
}

/* The tail of an AVX-512 axpy (one function for both callers, as dot_finish). */
INLINE AVX512 void axpy_tail(float a, const float *x, float *y, int i, int n)
{
    for (; i < n; i++)
        y[i] += a * x[i];
}

AVX512 static void axpy_avx512(float a, const float *x, float *y, int n)
{
    __m512 va = _mm512_set1_ps(a);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    axpy_tail(a, x, y, i, n);
}

/* y += a[k] * x[k] for k = 0, 1, ... rows - 1 in order, x[k] = x + k * ld: axpy_avx512 row after
 * row (the same fused multiply-adds in the same order per element), with up to 128 values of y
 * held in registers across the rows instead of loaded and stored for each. */
AVX512 static void axpy_rows_avx512(const float *a, const float *x, size_t ld, int rows, float *y, int n)
{
    int i = 0;
    for (; i + 128 <= n; i += 128) {
        __m512 y0 = _mm512_loadu_ps(y + i), y1 = _mm512_loadu_ps(y + i + 16), y2 = _mm512_loadu_ps(y + i + 32),
               y3 = _mm512_loadu_ps(y + i + 48), y4 = _mm512_loadu_ps(y + i + 64), y5 = _mm512_loadu_ps(y + i + 80),
               y6 = _mm512_loadu_ps(y + i + 96), y7 = _mm512_loadu_ps(y + i + 112);
        for (int k = 0; k < rows; k++) {
            const float *xk = x + k * ld + i;
            __m512 va = _mm512_set1_ps(a[k]);
            y0 = _mm512_fmadd_ps(va, _mm512_loadu_ps(xk), y0);
            y1 = _mm512_fmadd_ps(va, _mm512_loadu_ps(xk + 16), y1);
            y2 = _mm512_fmadd_ps(va, _mm512_loadu_ps(xk + 32), y2);
            y3 = _mm512_fmadd_ps(va, _mm512_loadu_ps(xk + 48), y3);
            y4 = _mm512_fmadd_ps(va, _mm512_loadu_ps(xk + 64), y4);
            y5 = _mm512_fmadd_ps(va, _mm512_loadu_ps(xk + 80), y5);
            y6 = _mm512_fmadd_ps(va, _mm512_loadu_ps(xk + 96), y6);
            y7 = _mm512_fmadd_ps(va, _mm512_loadu_ps(xk + 112), y7);
        }
        _mm512_storeu_ps(y + i, y0);
        _mm512_storeu_ps(y + i + 16, y1);
        _mm512_storeu_ps(y + i + 32, y2);
        _mm512_storeu_ps(y + i + 48, y3);
        _mm512_storeu_ps(y + i + 64, y4);
        _mm512_storeu_ps(y + i + 80, y5);
        _mm512_storeu_ps(y + i + 96, y6);
        _mm512_storeu_ps(y + i + 112, y7);
    }
    for (; i + 16 <= n; i += 16) {
        __m512 y0 = _mm512_loadu_ps(y + i);
        for (int k = 0; k < rows; k++)
            y0 = _mm512_fmadd_ps(_mm512_set1_ps(a[k]), _mm512_loadu_ps(x + k * ld + i), y0);
        _mm512_storeu_ps(y + i, y0);
    }
    if (i < n)
        for (int k = 0; k < rows; k++)
            axpy_tail(a[k], x + k * ld, y, i, n);
}

/* Row-by-row versions for the paths without a multi-row one. */
static void dot_rows_by_one(const float *w, size_t ld, const float *x, int n, int rows, float *y);
static void dot_rows_f32_avx2(const float *w, size_t ld, const float *x, int n, int rows, float *y);
static void axpy_rows_by_one(const float *a, const float *x, size_t ld, int rows, float *y, int n);

struct vec_fns {
    float (*dot)(const float *, const float *, int);
    void (*axpy)(float, const float *, float *, int);
    void (*dot_rows)(const float *, size_t, const float *, int, int, float *);
    void (*axpy_rows)(const float *, const float *, size_t, int, float *, int);
};

static struct vec_fns fns;
/* Set once `fns` is filled: the calls on the decode path (thousands per token) test this flag
 * instead of calling pthread_once through the PLT each time. */
static atomic_int fns_ready;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void choose(void)
{
    if (__builtin_cpu_supports("avx512f"))
        fns = (struct vec_fns){dot_avx512, axpy_avx512, dot_rows_avx512, axpy_rows_avx512};
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        fns = (struct vec_fns){pd_vec_dot_avx2, pd_vec_axpy_avx2, dot_rows_f32_avx2, pd_vec_axpy_rows_avx2};
    else
        fns = (struct vec_fns){pd_dot_ref, pd_axpy_ref, dot_rows_by_one, axpy_rows_by_one};
    atomic_store_explicit(&fns_ready, 1, memory_order_release);
}

static inline const struct vec_fns *vec(void)
{
    if (!atomic_load_explicit(&fns_ready, memory_order_acquire))
        pthread_once(&once, choose);
    return &fns;
}

static void dot_rows_by_one(const float *w, size_t ld, const float *x, int n, int rows, float *y)
{
    for (int r = 0; r < rows; r++)
        y[r] = fns.dot(w + r * ld, x, n);
}

static void axpy_rows_by_one(const float *a, const float *x, size_t ld, int rows, float *y, int n)
{
    for (int k = 0; k < rows; k++)
        fns.axpy(a[k], x + k * ld, y, n);
}

float pd_dot(const float *a, const float *b, int n)
{
    return vec()->dot(a, b, n);
}

void pd_axpy(float a, const float *x, float *y, int n)
{
    vec()->axpy(a, x, y, n);
}

void pd_dot_rows(const float *w, size_t ld, const float *x, int n, int rows, float *y)
{
    vec()->dot_rows(w, ld, x, n, rows, y);
}

void pd_axpy_rows(const float *a, const float *x, size_t ld, int rows, float *y, int n)
{
    vec()->axpy_rows(a, x, ld, rows, y, n);
}

__attribute__((target("avx512f"))) static void bf16_avx512(const uint16_t *src, float *dst, int n)
{
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
    for (; i < n; i++) {
        uint32_t u = (uint32_t)src[i] << 16;
        __builtin_memcpy(&dst[i], &u, 4);
    }
}

/* Two rows times four tokens: eight dot products, each with dot_avx512's two chains over the same
 * chunks in the same order and its finish, so each the bits of dot_avx512; each row's values
 * loaded once for the four tokens (a lone dot is bound by its latency: two chains of 4-cycle
 * FMAs, then sixteen dependent adds; eight side by side fill the pipeline). */
INLINE AVX512 void dot_tile2x4(const void *w0, const void *w1, int bf16, const float *x, size_t ldx, int n,
                               float *y, size_t ldy)
{
    const float *x0 = x, *x1 = x + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
    __m512 a[4][2], b[4][2];
    for (int t = 0; t < 4; t++)
        a[t][0] = a[t][1] = b[t][0] = b[t][1] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 u0 = w_load16(w0, bf16, i), u1 = w_load16(w0, bf16, i + 16);
        __m512 v0 = w_load16(w1, bf16, i), v1 = w_load16(w1, bf16, i + 16);
        __m512 p, q;
        p = _mm512_loadu_ps(x0 + i), q = _mm512_loadu_ps(x0 + i + 16);
        a[0][0] = _mm512_fmadd_ps(u0, p, a[0][0]), a[0][1] = _mm512_fmadd_ps(u1, q, a[0][1]);
        b[0][0] = _mm512_fmadd_ps(v0, p, b[0][0]), b[0][1] = _mm512_fmadd_ps(v1, q, b[0][1]);
        p = _mm512_loadu_ps(x1 + i), q = _mm512_loadu_ps(x1 + i + 16);
        a[1][0] = _mm512_fmadd_ps(u0, p, a[1][0]), a[1][1] = _mm512_fmadd_ps(u1, q, a[1][1]);
        b[1][0] = _mm512_fmadd_ps(v0, p, b[1][0]), b[1][1] = _mm512_fmadd_ps(v1, q, b[1][1]);
        p = _mm512_loadu_ps(x2 + i), q = _mm512_loadu_ps(x2 + i + 16);
        a[2][0] = _mm512_fmadd_ps(u0, p, a[2][0]), a[2][1] = _mm512_fmadd_ps(u1, q, a[2][1]);
        b[2][0] = _mm512_fmadd_ps(v0, p, b[2][0]), b[2][1] = _mm512_fmadd_ps(v1, q, b[2][1]);
        p = _mm512_loadu_ps(x3 + i), q = _mm512_loadu_ps(x3 + i + 16);
        a[3][0] = _mm512_fmadd_ps(u0, p, a[3][0]), a[3][1] = _mm512_fmadd_ps(u1, q, a[3][1]);
        b[3][0] = _mm512_fmadd_ps(v0, p, b[3][0]), b[3][1] = _mm512_fmadd_ps(v1, q, b[3][1]);
    }
    if (i < dot_body(n)) {
        __m512 u0 = w_load16(w0, bf16, i), v0 = w_load16(w1, bf16, i);
        for (int t = 0; t < 4; t++) {
            __m512 p = _mm512_loadu_ps(x + t * ldx + i);
            a[t][0] = _mm512_fmadd_ps(u0, p, a[t][0]);
            b[t][0] = _mm512_fmadd_ps(v0, p, b[t][0]);
        }
        i += 16;
    }
    for (int t = 0; t < 4; t++) {
        y[t * ldy] = w_finish(a[t][0], a[t][1], w0, bf16, x + t * ldx, i, n);
        y[t * ldy + 1] = w_finish(b[t][0], b[t][1], w1, bf16, x + t * ldx, i, n);
    }
}

/* One row times U tokens (1 to 4, a constant after inlining): U dot products side by side, each
 * with dot_avx512's two chains and finish (the same bits), the row's values loaded once for them
 * all and the row streamed to its end as one sequential read. */
INLINE AVX512 void dot_tile1xU(const void *w0, int bf16, const float *x, size_t ldx, int n, int U, float *y,
                               size_t ldy)
{
    __m512 a[4][2];
    for (int t = 0; t < 4; t++)
        a[t][0] = a[t][1] = _mm512_setzero_ps();
    int i = 0;
#define TOK(t)                                                                                   \
    if (U > (t)) {                                                                               \
        const float *xt = x + (t) * ldx;                                                         \
        a[t][0] = _mm512_fmadd_ps(u0, _mm512_loadu_ps(xt + i), a[t][0]);                         \
        a[t][1] = _mm512_fmadd_ps(u1, _mm512_loadu_ps(xt + i + 16), a[t][1]);                    \
    }
    for (; i + 32 <= n; i += 32) {
        __m512 u0 = w_load16(w0, bf16, i), u1 = w_load16(w0, bf16, i + 16);
        TOK(0) TOK(1) TOK(2) TOK(3)
    }
#undef TOK
    if (i < dot_body(n)) {
        __m512 u0 = w_load16(w0, bf16, i);
        for (int t = 0; t < U; t++)
            a[t][0] = _mm512_fmadd_ps(u0, _mm512_loadu_ps(x + t * ldx + i), a[t][0]);
        i += 16;
    }
    for (int t = 0; t < U; t++)
        y[t * ldy] = w_finish(a[t][0], a[t][1], w0, bf16, x + t * ldx, i, n);
}

/* A decode's few tokens (fewer than FEW_TOKENS) go row by row, each row read once from memory as
 * one stream for up to four tokens at a time, the row four ahead prefetched: measured, 1 thread,
 * pd_dot_rows_tokens_bf16 over 48 bf16 matrices of 512 x 512 evicted from the caches, two-row
 * tiles ran at a third of the bandwidth (their two interleaved streams), row by row at about all
 * of it (4 tokens: 5.7-6.2 ms against 2.1-2.5). From FEW_TOKENS on the two-row tiles' reuse of
 * each token's values pays. */
enum { FEW_TOKENS = 12 };

/* y[t * ldy + r] = dot_avx512(row r, token t) for every row and token, in tiles of two rows by four
 * tokens (rows outer: a pair of rows stays in L1 while the tokens pass); what is left over one
 * dot at a time. Many tokens (a prefill) go in chunks of about 64 KiB of x, so that the chunk
 * stays in L2 while every row passes over it. */
INLINE AVX512 void dot_rows_tokens_avx512(const void *w, int bf16, size_t ld, const float *x, size_t ldx, int T,
                                          int n, int rows, float *y, size_t ldy);

INLINE AVX512 void dot_rows_tokens_chunk(const void *w, int bf16, size_t ld, const float *x, size_t ldx, int T,
                                         int n, int rows, float *y, size_t ldy)
{
    const size_t es = bf16 ? 2 : 4;
    const char *wb = w;
    int r = 0;
    if (T < FEW_TOKENS) {
        for (; r < rows; r++) {
            const char *w0 = wb + r * ld * es;
            if (r + 4 < rows)
                for (size_t i = 0; i < (size_t)n * es; i += 64)
                    _mm_prefetch(w0 + 4 * ld * es + i, _MM_HINT_T0);
            int t = 0;
            for (; t + 4 <= T; t += 4)
                dot_tile1xU(w0, bf16, x + t * ldx, ldx, n, 4, y + t * ldy + r, ldy);
            switch (T - t) {
            case 3: dot_tile1xU(w0, bf16, x + t * ldx, ldx, n, 3, y + t * ldy + r, ldy); break;
            case 2: dot_tile1xU(w0, bf16, x + t * ldx, ldx, n, 2, y + t * ldy + r, ldy); break;
            case 1: dot_tile1xU(w0, bf16, x + t * ldx, ldx, n, 1, y + t * ldy + r, ldy); break;
            default: break;
            }
        }
        return;
    }
    for (; r + 2 <= rows; r += 2) {
        const char *w0 = wb + r * ld * es, *w1 = w0 + ld * es;
        int t = 0;
        for (; t + 4 <= T; t += 4)
            dot_tile2x4(w0, w1, bf16, x + t * ldx, ldx, n, y + t * ldy + r, ldy);
        for (; t < T; t++) {
            y[t * ldy + r] = dot_w(w0, bf16, x + t * ldx, n);
            y[t * ldy + r + 1] = dot_w(w1, bf16, x + t * ldx, n);
        }
    }
    for (; r < rows; r++)
        for (int t = 0; t < T; t++)
            y[t * ldy + r] = dot_w(wb + r * ld * es, bf16, x + t * ldx, n);
}

INLINE AVX512 void dot_rows_tokens_avx512(const void *w, int bf16, size_t ld, const float *x, size_t ldx, int T,
                                          int n, int rows, float *y, size_t ldy)
{
    int chunk = (int)((64 << 10) / ((size_t)(n > 0 ? n : 1) * 4)) / 4 * 4;
    chunk = chunk < 4 ? 4 : chunk;
    for (int t0 = 0; t0 < T; t0 += chunk)
        dot_rows_tokens_chunk(w, bf16, ld, x + t0 * ldx, ldx, T - t0 < chunk ? T - t0 : chunk, n, rows, y + t0 * ldy,
                              ldy);
}

AVX512 static void dot_rows_tokens_f32_avx512(const float *w, size_t ld, const float *x, size_t ldx, int T, int n,
                                              int rows, float *y, size_t ldy)
{
    dot_rows_tokens_avx512(w, 0, ld, x, ldx, T, n, rows, y, ldy);
}

AVX512 static void dot_rows_tokens_bf16_avx512(const uint16_t *w, size_t ld, const float *x, size_t ldx, int T, int n,
                                               int rows, float *y, size_t ldy)
{
    dot_rows_tokens_avx512(w, 1, ld, x, ldx, T, n, rows, y, ldy);
}

/* Without AVX-512: each row widened into a buffer, then pd_dot (the same values, so the same bits). */
static void dot_rows_bf16_by_one(const uint16_t *w, size_t ld, const float *x, int n, int rows, float *y)
{
    float wide[PD_DOT_BF16_MAX];
    assert(n <= PD_DOT_BF16_MAX);
    for (int r = 0; r < rows; r++) {
        bf16_ref(w + r * ld, wide, n);
        y[r] = pd_dot(wide, x, n);
    }
}

static void (*dot_rows_bf16_fn)(const uint16_t *, size_t, const float *, int, int, float *);
static void (*dot_rows_tokens_bf16_fn)(const uint16_t *, size_t, const float *, size_t, int, int, int, float *,
                                       size_t);
static void (*dot_rows_tokens_f32_fn)(const float *, size_t, const float *, size_t, int, int, int, float *, size_t);

/* Without AVX-512: token by token over all rows (pd_dot_rows and pd_dot_rows_bf16: the same bits). */
static void dot_rows_tokens_bf16_by_one(const uint16_t *w, size_t ld, const float *x, size_t ldx, int T, int n,
                                        int rows, float *y, size_t ldy)
{
    for (int t = 0; t < T; t++)
        dot_rows_bf16_by_one(w, ld, x + t * ldx, n, rows, y + t * ldy);
}

static void dot_rows_tokens_f32_by_one(const float *w, size_t ld, const float *x, size_t ldx, int T, int n, int rows,
                                       float *y, size_t ldy)
{
    for (int t = 0; t < T; t++)
        pd_dot_rows(w, ld, x + t * ldx, n, rows, y + t * ldy);
}
static void (*bf16_fn)(const uint16_t *, float *, int);
static atomic_int bf16_ready;
static pthread_once_t once_bf16 = PTHREAD_ONCE_INIT;

/* Where pd_dot is pd_vec_dot_avx2 (AVX2 and FMA, no AVX-512), its tiled products (vec_avx2.h). */
static int avx2_dot(void)
{
    return !__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* pd_vec_dot_avx2 over rows, one token through the tiles (vec_avx2.h): the same bits; fp32 here,
 * bf16 in its twin below. */
static void dot_rows_f32_avx2(const float *w, size_t ld, const float *x, int n, int rows, float *y)
{
    pd_vec_dot_rows_tokens_avx2(w, 0, ld, x, 0, 1, n, rows, y, 0);
}

static void dot_rows_bf16_avx2(const uint16_t *w, size_t ld, const float *x, int n, int rows, float *y)
{
    pd_vec_dot_rows_tokens_avx2(w, 1, ld, x, 0, 1, n, rows, y, 0);
}

static void dot_rows_tokens_bf16_avx2(const uint16_t *w, size_t ld, const float *x, size_t ldx, int T, int n,
                                      int rows, float *y, size_t ldy)
{
    pd_vec_dot_rows_tokens_avx2(w, 1, ld, x, ldx, T, n, rows, y, ldy);
}

static void dot_rows_tokens_f32_avx2(const float *w, size_t ld, const float *x, size_t ldx, int T, int n, int rows,
                                     float *y, size_t ldy)
{
    pd_vec_dot_rows_tokens_avx2(w, 0, ld, x, ldx, T, n, rows, y, ldy);
}

static void choose_bf16(void)
{
    const int v512 = __builtin_cpu_supports("avx512f"), v2 = avx2_dot();
    bf16_fn = v512 ? bf16_avx512 : v2 ? pd_vec_bf16_to_f32_avx2 : bf16_ref;
    dot_rows_bf16_fn = v512 ? dot_rows_bf16_avx512 : v2 ? dot_rows_bf16_avx2 : dot_rows_bf16_by_one;
    dot_rows_tokens_bf16_fn = v512 ? dot_rows_tokens_bf16_avx512 : v2 ? dot_rows_tokens_bf16_avx2
                                                                      : dot_rows_tokens_bf16_by_one;
    dot_rows_tokens_f32_fn = v512 ? dot_rows_tokens_f32_avx512 : v2 ? dot_rows_tokens_f32_avx2
                                                                    : dot_rows_tokens_f32_by_one;
    atomic_store_explicit(&bf16_ready, 1, memory_order_release);
}

void pd_bf16_to_f32_row(const uint16_t *src, float *dst, int n)
{
    if (!atomic_load_explicit(&bf16_ready, memory_order_acquire))
        pthread_once(&once_bf16, choose_bf16);
    bf16_fn(src, dst, n);
}

void pd_dot_rows_bf16(const uint16_t *w, size_t ld, const float *x, int n, int rows, float *y)
{
    if (!atomic_load_explicit(&bf16_ready, memory_order_acquire))
        pthread_once(&once_bf16, choose_bf16);
    dot_rows_bf16_fn(w, ld, x, n, rows, y);
}

void pd_dot_rows_tokens(const float *w, size_t ld, const float *x, size_t ldx, int T, int n, int rows, float *y,
                        size_t ldy)
{
    if (!atomic_load_explicit(&bf16_ready, memory_order_acquire))
        pthread_once(&once_bf16, choose_bf16);
    dot_rows_tokens_f32_fn(w, ld, x, ldx, T, n, rows, y, ldy);
}

void pd_dot_rows_tokens_bf16(const uint16_t *w, size_t ld, const float *x, size_t ldx, int T, int n, int rows,
                             float *y, size_t ldy)
{
    if (!atomic_load_explicit(&bf16_ready, memory_order_acquire))
        pthread_once(&once_bf16, choose_bf16);
    dot_rows_tokens_bf16_fn(w, ld, x, ldx, T, n, rows, y, ldy);
}

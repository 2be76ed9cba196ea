/* Per-row symmetric int8 quantisation (see quant.h for the rule): the row maximum, then one
 * divide, round and clamp per element. The division (not a multiply by 1/scale) is part of the
 * rule, so another implementation that wants the same bytes must divide too.
 *
 * The SSE4.1 path (part of the x86-64-v2 baseline, so no run-time check) does four elements at
 * once with the same IEEE operations (max, divide, round-to-nearest-even, min/max clamp), so it
 * gives the same bytes as the scalar loop, which handles the tail and non-x86 builds. It matters:
 * quantising the 512 tokens of a prefill step in scalar code cost ~20% of the GEMM after it. */
#include "kernels/quant.h"

#include <math.h>
#include <stddef.h>
#ifdef __SSE4_1__
#include <smmintrin.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

static float row_absmax(const float *x, int n)
{
    float amax = 0.0f;
    int i = 0;
#ifdef __SSE4_1__
    const __m128 abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
    __m128 m0 = _mm_setzero_ps(), m1 = m0;
    for (; i + 8 <= n; i += 8) {
        m0 = _mm_max_ps(m0, _mm_and_ps(_mm_loadu_ps(x + i), abs_mask));
        m1 = _mm_max_ps(m1, _mm_and_ps(_mm_loadu_ps(x + i + 4), abs_mask));
    }
    m0 = _mm_max_ps(m0, m1);
    m0 = _mm_max_ps(m0, _mm_movehl_ps(m0, m0));
    m0 = _mm_max_ss(m0, _mm_shuffle_ps(m0, m0, 1));
    amax = _mm_cvtss_f32(m0);
#endif
    for (; i < n; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

static void quant_row(const float *x, int n, int8_t *q, float *scale)
{
    float s = row_absmax(x, n) / 127.0f;
    *scale = s;
    if (s == 0.0f) {
        for (int i = 0; i < n; i++)
            q[i] = 0;
        return;
    }
    int i = 0;
#ifdef __SSE4_1__
    const __m128 vs = _mm_set1_ps(s), hi = _mm_set1_ps(127.0f), lo = _mm_set1_ps(-127.0f);
    for (; i + 16 <= n; i += 16) {
        __m128i v[4];
        for (int j = 0; j < 4; j++) {
            __m128 f = _mm_div_ps(_mm_loadu_ps(x + i + 4 * j), vs);
            f = _mm_round_ps(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            f = _mm_max_ps(_mm_min_ps(f, hi), lo);
            v[j] = _mm_cvtps_epi32(f);
        }
        __m128i b = _mm_packs_epi16(_mm_packs_epi32(v[0], v[1]), _mm_packs_epi32(v[2], v[3]));
        _mm_storeu_si128((__m128i *)(q + i), b);
    }
#endif
    for (; i < n; i++) {
        /* x / s can land a hair above 127 (amax / (amax / 127) need not be exactly 127). */
        float v = rintf(x[i] / s);
        v = v > 127.0f ? 127.0f : v;
        v = v < -127.0f ? -127.0f : v;
        q[i] = (int8_t)v;
    }
}

#if defined(__x86_64__)
/* The same rule sixteen values at a time (AVX-512: the same IEEE max, divide, round to nearest
 * even and clamp, so the same bytes), for the CPUs that have it: a decode step quantises ~30k
 * values, ~1% of it with four lanes. */
__attribute__((target("avx512f"))) static void quant_row_avx512(const float *x, int n, int8_t *q, float *scale)
{
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    __m512 m = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16)
        m = _mm512_max_ps(m, _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(x + i), abs_mask)));
    float amax = _mm512_reduce_max_ps(m);
    for (; i < n; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    float s = amax / 127.0f;
    *scale = s;
    if (s == 0.0f) {
        for (i = 0; i < n; i++)
            q[i] = 0;
        return;
    }
    const __m512 vs = _mm512_set1_ps(s), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
    for (i = 0; i + 16 <= n; i += 16) {
        __m512 f = _mm512_div_ps(_mm512_loadu_ps(x + i), vs);
        f = _mm512_roundscale_ps(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        f = _mm512_max_ps(_mm512_min_ps(f, hi), lo);
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(f)));
    }
    for (; i < n; i++) {
        float v = rintf(x[i] / s);
        v = v > 127.0f ? 127.0f : v;
        v = v < -127.0f ? -127.0f : v;
        q[i] = (int8_t)v;
    }
}
#endif

void pd_quant_rows(const float *x, int rows, int cols, int8_t *q, float *scales)
{
#if defined(__x86_64__)
    /* 0 unknown, 1 no, 2 yes (every thread that finds it unknown stores the same answer) */
    static _Atomic int avx512;
    if (!avx512)
        avx512 = __builtin_cpu_supports("avx512f") ? 2 : 1;
    if (avx512 == 2) {
        for (int r = 0; r < rows; r++)
            quant_row_avx512(x + (size_t)r * cols, cols, q + (size_t)r * cols, &scales[r]);
        return;
    }
#endif
    for (int r = 0; r < rows; r++)
        quant_row(x + (size_t)r * cols, cols, q + (size_t)r * cols, &scales[r]);
}

/* Rows per pool task: a block's size depends only on the row length (about 64 KiB of floats). */
static int quant_block_rows(int cols)
{
    int b = 16384 / (cols > 0 ? cols : 1);
    return b < 1 ? 1 : b;
}

struct quant_run {
    const float *x;
    int rows, cols, block;
    int8_t *q;
    float *scales;
};

static void quant_task(void *arg, int task)
{
    const struct quant_run *r = arg;
    int r0 = task * r->block, n = r->rows - r0 < r->block ? r->rows - r0 : r->block;
    pd_quant_rows(r->x + (size_t)r0 * r->cols, n, r->cols, r->q + (size_t)r0 * r->cols, r->scales + r0);
}

void pd_quant_rows_pool(pd_pool *pool, const float *x, int rows, int cols, int8_t *q, float *scales)
{
    if (rows <= 0)
        return;
    if (!pool || (int64_t)rows * cols < PD_QUANT_SERIAL_VALUES) {
        pd_quant_rows(x, rows, cols, q, scales);
        return;
    }
    struct quant_run r = {.x = x, .rows = rows, .cols = cols, .block = quant_block_rows(cols), .q = q,
                          .scales = scales};
    pd_pool_run(pool, (rows + r.block - 1) / r.block, quant_task, &r);
}

void pd_quant_weights(const float *w, int out, int in, int8_t *q, float *scales)
{
    pd_quant_rows(w, out, in, q, scales);
}

void pd_dequant_rows(const int8_t *q, const float *scales, int rows, int cols, float *x)
{
    for (int r = 0; r < rows; r++) {
        const int8_t *qr = q + (size_t)r * cols;
        float *xr = x + (size_t)r * cols;
        for (int i = 0; i < cols; i++)
            xr[i] = (float)qr[i] * scales[r];
    }
}

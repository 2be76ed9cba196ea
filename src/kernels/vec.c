/* Dot product and axpy: portable, AVX2+FMA and AVX-512 versions, chosen at first use. */
#include "kernels/vec.h"

#include <immintrin.h>
#include <pthread.h>

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

__attribute__((target("avx2,fma"))) static float dot_avx2(const float *a, const float *b, int n)
{
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    float l[8];
    _mm256_storeu_ps(l, _mm256_add_ps(s0, s1));
    float t = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
    for (; i < n; i++)
        t += a[i] * b[i];
    return t;
}

__attribute__((target("avx2,fma"))) static void axpy_avx2(float a, const float *x, float *y, int n)
{
    __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++)
        y[i] += a * x[i];
}

__attribute__((target("avx512f"))) static float dot_avx512(const float *a, const float *b, int n)
{
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    }
    for (; i + 16 <= n; i += 16)
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    float l[16];
    _mm512_storeu_ps(l, _mm512_add_ps(s0, s1));
    float t = 0;
    for (int k = 0; k < 16; k++)
        t += l[k];
    for (; i < n; i++)
        t += a[i] * b[i];
    return t;
}

__attribute__((target("avx512f"))) static void axpy_avx512(float a, const float *x, float *y, int n)
{
    __m512 va = _mm512_set1_ps(a);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    for (; i < n; i++)
        y[i] += a * x[i];
}

static float (*dot_fn)(const float *, const float *, int);
static void (*axpy_fn)(float, const float *, float *, int);

static pthread_once_t once = PTHREAD_ONCE_INIT;

static void choose(void)
{
    if (__builtin_cpu_supports("avx512f")) {
        dot_fn = dot_avx512;
        axpy_fn = axpy_avx512;
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        dot_fn = dot_avx2;
        axpy_fn = axpy_avx2;
    } else {
        dot_fn = pd_dot_ref;
        axpy_fn = pd_axpy_ref;
    }
}

float pd_dot(const float *a, const float *b, int n)
{
    pthread_once(&once, choose);
    return dot_fn(a, b, n);
}

void pd_axpy(float a, const float *x, float *y, int n)
{
    pthread_once(&once, choose);
    axpy_fn(a, x, y, n);
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

static void bf16_ref(const uint16_t *src, float *dst, int n)
{
    for (int i = 0; i < n; i++) {
        uint32_t u = (uint32_t)src[i] << 16;
        __builtin_memcpy(&dst[i], &u, 4);
    }
}

static void (*bf16_fn)(const uint16_t *, float *, int);
static pthread_once_t once_bf16 = PTHREAD_ONCE_INIT;

static void choose_bf16(void)
{
    bf16_fn = __builtin_cpu_supports("avx512f") ? bf16_avx512 : bf16_ref;
}

void pd_bf16_to_f32_row(const uint16_t *src, float *dst, int n)
{
    pthread_once(&once_bf16, choose_bf16);
    bf16_fn(src, dst, n);
}

void pd_scale(float a, const float *x, float *y, int n)
{
    for (int i = 0; i < n; i++)
        y[i] = a * x[i];
}

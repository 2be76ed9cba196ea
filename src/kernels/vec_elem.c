/* The element-wise steps of the engine (vec.h): scale-and-max, the double division, scale then
 * axpys, expf over rows, weighted sums, SwiGLU, scale and scale-multiply, the knots' bounds; portable, AVX2 (the
 * whole vectors in vec_avx2.c, the rest by the loops here) and AVX-512 versions, each the bits of
 * its scalar loop, chosen at first use. */
#include "kernels/vec.h"
#include "kernels/vec_avx2.h"

#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#define AVX512 __attribute__((target("avx512f")))

/* x[i] *= s, and the largest of m and the products (x > m picks; a NaN never wins unless m is). */
static float scale_max_ref(float *x, int n, float s, float m)
{
    for (int i = 0; i < n; i++) {
        x[i] *= s;
        m = x[i] > m ? x[i] : m;
    }
    return m;
}

/* max_ps(v, acc) returns acc when v is NaN (or equal): the scalar test's choice lane by lane;
 * which of +0 and -0 is kept may differ, which no caller can see (they subtract it). */
AVX512 static float scale_max_avx512(float *x, int n, float s, float m)
{
    int i = 0;
    if (n >= 16) {
        const __m512 vs = _mm512_set1_ps(s);
        __m512 acc = _mm512_set1_ps(m);
        for (; i + 16 <= n; i += 16) {
            __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), vs);
            _mm512_storeu_ps(x + i, v);
            acc = _mm512_max_ps(v, acc);
        }
        float l[16];
        _mm512_storeu_ps(l, acc);
        for (int k = 0; k < 16; k++)
            m = l[k] > m ? l[k] : m;
    }
    return scale_max_ref(x + i, n - i, s, m);
}

/* x[i] = (float)(x[i] / d) in double precision: IEEE division and rounding, the same bits in
 * every version. */
static void div_d_ref(float *x, int n, double d)
{
    for (int i = 0; i < n; i++)
        x[i] = (float)(x[i] / d);
}

AVX512 static void div_d_avx512(float *x, int n, double d)
{
    const __m512d vd = _mm512_set1_pd(d);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm512_cvtpd_ps(_mm512_div_pd(_mm512_cvtps_pd(_mm256_loadu_ps(x + i)), vd)));
    div_d_ref(x + i, n - i, d);
}

/* The AVX2 versions (vec_avx2.h): their whole vectors, then the scalar loops over the rest. */
static float scale_max_avx2(float *x, int n, float s, float m)
{
    const int i = pd_vec_scale_max_avx2(x, n, s, &m);
    return scale_max_ref(x + i, n - i, s, m);
}

static void div_d_avx2(float *x, int n, double d)
{
    const int i = pd_vec_div_d_avx2(x, n, d);
    div_d_ref(x + i, n - i, d);
}

static void scale_axpys_avx2(float a, const float *x, const float *b, const float *z, size_t ldz, int nz, float *y,
                             int n)
{
    const int i = pd_vec_scale_axpys_avx2(a, x, b, z, ldz, nz, y, n);
    if (i < n) {
        pd_scale(a, x + i, y + i, n - i);
        for (int j = 0; j < nz; j++)
            pd_vec_axpy_avx2(b[j], z + j * ldz + i, y + i, n - i);
    }
}

/* y = a * x, then y += b[j] * z[j] for j < nz in order: pd_scale then pd_axpy row after row,
 * with y in registers (the same multiply, then the same fused multiply-adds, per element). */
AVX512 static void scale_axpys_avx512(float a, const float *x, const float *b, const float *z, size_t ldz, int nz,
                                      float *y, int n)
{
    const __m512 va = _mm512_set1_ps(a);
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 t = _mm512_mul_ps(va, _mm512_loadu_ps(x + i));
        for (int j = 0; j < nz; j++)
            t = _mm512_fmadd_ps(_mm512_set1_ps(b[j]), _mm512_loadu_ps(z + j * ldz + i), t);
        _mm512_storeu_ps(y + i, t);
    }
    if (i < n) {   /* pd_axpy of fewer than 16 values: its scalar tail, as axpy_avx512's */
        pd_scale(a, x + i, y + i, n - i);
        for (int j = 0; j < nz; j++)
            pd_axpy(b[j], z + j * ldz + i, y + i, n - i);
    }
}

/* y[i] = expf(x[i]), eight at a time, by glibc's own algorithm (Arm's optimized-routines expf,
 * which glibc's x86-64 build runs as __expf_fma on CPUs with FMA): x * 32/ln2 = k + r, 2^(k/32)
 * from a table of 32 doubles, a cubic in r, all in double, one rounding to float at the end.
 * Checked against libm over every float in (-103, 88) on this machine: the same bits for all of
 * them. Other inputs (large, NaN) go to expf itself; expf_check below keeps the scalar loop if
 * the C library's expf is not this one. */
static uint64_t exp_tab[32];   /* bits of 2^(i/32) - (i << 47) */
#define EXP_INV (0x1.71547652b82fep+0 * 32)
#define EXP_SHIFT 0x1.8p+52

static void expf_ref(const float *x, float *y, int n)
{
    for (int i = 0; i < n; i++)
        y[i] = expf(x[i]);
}

AVX512 static void expf_avx512(const float *x, float *y, int n)
{
    const __m512d inv = _mm512_set1_pd(EXP_INV), sh = _mm512_set1_pd(EXP_SHIFT), one = _mm512_set1_pd(1.0);
    const __m512d c0 = _mm512_set1_pd(0x1.c6af84b912394p-5 / (32.0 * 32 * 32));
    const __m512d c1 = _mm512_set1_pd(0x1.ebfce50fac4f3p-3 / (32.0 * 32)), c2 = _mm512_set1_pd(0x1.62e42ff0c52d6p-1 / 32);
    const __m512i t0 = _mm512_loadu_si512(exp_tab), t1 = _mm512_loadu_si512(exp_tab + 8);
    const __m512i t2 = _mm512_loadu_si512(exp_tab + 16), t3 = _mm512_loadu_si512(exp_tab + 24);
    const __m256 lo = _mm256_set1_ps(-103.0f), hi = _mm256_set1_ps(88.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 xf = _mm256_loadu_ps(x + i);
        /* not (lo < x < hi): large, tiny or NaN */
        if (_mm256_movemask_ps(_mm256_andnot_ps(_mm256_and_ps(_mm256_cmp_ps(xf, lo, _CMP_GT_OQ),
                                                              _mm256_cmp_ps(xf, hi, _CMP_LT_OQ)),
                                                _mm256_castsi256_ps(_mm256_set1_epi32(-1))))) {
            expf_ref(x + i, y + i, 8);
            continue;
        }
        __m512d xd = _mm512_cvtps_pd(xf);
        __m512d kd = _mm512_add_pd(_mm512_mul_pd(inv, xd), sh);
        __m512i ki = _mm512_castpd_si512(kd);
        kd = _mm512_sub_pd(kd, sh);
        __m512d r = _mm512_fmsub_pd(inv, xd, kd);
        __m512i idx = _mm512_and_si512(ki, _mm512_set1_epi64(31));
        __m512i t = _mm512_mask_blend_epi64(_mm512_test_epi64_mask(idx, _mm512_set1_epi64(16)),
                                            _mm512_permutex2var_epi64(t0, idx, t1),
                                            _mm512_permutex2var_epi64(t2, idx, t3));
        __m512d s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64(ki, 47)));
        __m512d z = _mm512_fmadd_pd(c0, r, c1), r2 = _mm512_mul_pd(r, r);
        __m512d p = _mm512_fmadd_pd(z, r2, _mm512_fmadd_pd(c2, r, one));
        _mm256_storeu_ps(y + i, _mm512_cvtpd_ps(_mm512_mul_pd(p, s)));
    }
    expf_ref(x + i, y + i, n - i);
}

/* The same with AVX2 and FMA, four doubles at a time (the table by a gather). Built without
 * fp-contract, so that kd's product and sum round twice as glibc's do (256-bit intrinsics are
 * plain vector arithmetic to GCC, which it may fuse). Checked against libm on this build over
 * every float in (-103, 88) on an AVX2-only AMD EPYC: the same bits for all 2,239,627,264; 2.5-2.8x
 * faster than libm's expf a value there (2.4 against 6.1-6.8 ns). */
__attribute__((target("avx2,fma"), optimize("fp-contract=off"))) static void expf4_avx2(__m128 xf, float *y)
{
    const __m256d inv = _mm256_set1_pd(EXP_INV), sh = _mm256_set1_pd(EXP_SHIFT), one = _mm256_set1_pd(1.0);
    const __m256d c0 = _mm256_set1_pd(0x1.c6af84b912394p-5 / (32.0 * 32 * 32));
    const __m256d c1 = _mm256_set1_pd(0x1.ebfce50fac4f3p-3 / (32.0 * 32)), c2 = _mm256_set1_pd(0x1.62e42ff0c52d6p-1 / 32);
    __m256d xd = _mm256_cvtps_pd(xf);
    __m256d kd = _mm256_add_pd(_mm256_mul_pd(inv, xd), sh);
    __m256i ki = _mm256_castpd_si256(kd);
    kd = _mm256_sub_pd(kd, sh);
    __m256d r = _mm256_fmsub_pd(inv, xd, kd);
    __m256i t = _mm256_i64gather_epi64((const long long *)exp_tab, _mm256_and_si256(ki, _mm256_set1_epi64x(31)), 8);
    __m256d sc = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64(ki, 47)));
    __m256d z = _mm256_fmadd_pd(c0, r, c1), r2 = _mm256_mul_pd(r, r);
    __m256d p = _mm256_fmadd_pd(z, r2, _mm256_fmadd_pd(c2, r, one));
    _mm_storeu_ps(y, _mm256_cvtpd_ps(_mm256_mul_pd(p, sc)));
}

__attribute__((target("avx2,fma"))) static void expf_avx2(const float *x, float *y, int n)
{
    const __m256 lo = _mm256_set1_ps(-103.0f), hi = _mm256_set1_ps(88.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 xf = _mm256_loadu_ps(x + i);
        /* not (lo < x < hi): large, tiny or NaN */
        if (_mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(xf, lo, _CMP_GT_OQ), _mm256_cmp_ps(xf, hi, _CMP_LT_OQ))) !=
            0xff) {
            expf_ref(x + i, y + i, 8);
            continue;
        }
        expf4_avx2(_mm256_castps256_ps128(xf), y + i);
        expf4_avx2(_mm256_extractf128_ps(xf, 1), y + i + 4);
    }
    expf_ref(x + i, y + i, n - i);
}

/* 1 if f (expf_avx512 or expf_avx2) gives libm's bits on a spread of 2^14 inputs over its range. */
static int expf_check(void (*f)(const float *, float *, int))
{
    float x[256], y[256];
    for (int b = 0; b < 64; b++) {
        for (int i = 0; i < 256; i++)
            x[i] = -103.0f + 191.0f * (float)(b * 256 + i) / (float)(1 << 14);
        f(x, y, 256);
        for (int i = 0; i < 256; i++) {
            float e = expf(x[i]);
            if (memcmp(&e, &y[i], 4))
                return 0;
        }
    }
    return 1;
}

/* y = 0, then y += a[j] * x[j] for j < rows (each product rounded, then added: no fused
 * multiply-add), then y += z when z is not NULL. Row j at x[j] (not one stride apart: expert
 * parallelism leaves received outputs where they landed). */
static void weighted_sum_ref(const float *a, const float *const *x, int rows, const float *z, float *y, int n)
{
    for (int i = 0; i < n; i++)
        y[i] = 0;
    for (int j = 0; j < rows; j++)
        for (int i = 0; i < n; i++)
            y[i] += a[j] * x[j][i];
    if (z)
        for (int i = 0; i < n; i++)
            y[i] += z[i];
}

/* weighted_sum_ref over the values from i on: the vector versions' tails. */
static void weighted_sum_from(const float *a, const float *const *x, int rows, const float *z, float *y, int i, int n)
{
    if (i >= n)
        return;
    const float *xi[rows > 0 ? rows : 1];
    for (int j = 0; j < rows; j++)
        xi[j] = x[j] + i;
    weighted_sum_ref(a, xi, rows, z ? z + i : NULL, y + i, n - i);
}

static void weighted_sum_avx2(const float *a, const float *const *x, int rows, const float *z, float *y, int n)
{
    weighted_sum_from(a, x, rows, z, y, pd_vec_weighted_sum_avx2(a, x, rows, z, y, n), n);
}

/* The same sixteen values at a time, y in registers. fp-contract=off: GCC would otherwise fuse the
 * multiply and the add, which rounds once instead of twice (other bits). clang (the fuzz build) has
 * no optimize attribute and needs none: it fuses only within one expression (its -ffp-contract=on),
 * and the intrinsics are calls. */
#ifdef __clang__
#define NO_FP_CONTRACT
#else
#define NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#endif
AVX512 NO_FP_CONTRACT static void weighted_sum_avx512(const float *a, const float *const *x, int rows, const float *z,
                                                      float *y, int n)
{
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 t = _mm512_setzero_ps();
        for (int j = 0; j < rows; j++)
            t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_set1_ps(a[j]), _mm512_loadu_ps(x[j] + i)));
        if (z)
            t = _mm512_add_ps(t, _mm512_loadu_ps(z + i));
        _mm512_storeu_ps(y + i, t);
    }
    weighted_sum_from(a, x, rows, z, y, i, n);
}


static void scale_axpys_by_one(float a, const float *x, const float *b, const float *z, size_t ldz, int nz, float *y,
                               int n);

/* ---- bounds from a table of knots (vec.h) ---- */

static float knot(const struct pd_knots *t, int i)
{
    return t->x0 + (float)i / t->per;   /* exact: per a power of two */
}

int pd_knot_bounds_ref(const struct pd_knots *t, const float *x, const float *add, int n, float *lo, float *hi)
{
    const float top = knot(t, t->m - 1);
    for (int j = 0; j < n; j++) {
        const float a = add ? add[j] : 0, z = x[j];
        if (z != z || a != a || z > top)
            return 1;
        if (z < t->x0) {
            lo[j] = t->below + a;
            hi[j] = t->val[0] * (1 + t->slack) + a;
            continue;
        }
        int i = (int)((z - t->x0) * t->per);
        i = i < 0 ? 0 : i > t->m - 2 ? t->m - 2 : i;
        while (i > 0 && z < knot(t, i))
            i--;
        while (i < t->m - 2 && z >= knot(t, i + 1))
            i++;
        lo[j] = t->val[i] * (1 - t->slack) + a;
        hi[j] = t->val[i + 1] * (1 + t->slack) + a;
    }
    return 0;
}

/* The reference's operations lane by lane: the same index (its two corrections as masked steps
 * until no lane needs one), the knots' values gathered, the same products and sums. */
AVX512 static int knot_bounds_avx512(const struct pd_knots *t, const float *x, const float *add, int n, float *lo,
                                     float *hi)
{
    const __m512 x0 = _mm512_set1_ps(t->x0), per = _mm512_set1_ps(t->per), top = _mm512_set1_ps(knot(t, t->m - 1));
    const __m512 slo = _mm512_set1_ps(1 - t->slack), shi = _mm512_set1_ps(1 + t->slack);
    const __m512 below = _mm512_set1_ps(t->below), hi0 = _mm512_set1_ps(t->val[0] * (1 + t->slack));
    const __m512i zero = _mm512_setzero_si512(), last = _mm512_set1_epi32(t->m - 2), one = _mm512_set1_epi32(1);
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 z = _mm512_loadu_ps(x + j), a = add ? _mm512_loadu_ps(add + j) : _mm512_setzero_ps();
        if (_mm512_cmp_ps_mask(z, z, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) |
            _mm512_cmp_ps_mask(z, top, _CMP_GT_OQ))
            return 1;
        const __mmask16 in = _mm512_cmp_ps_mask(z, x0, _CMP_GE_OQ);
        __m512i i = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_sub_ps(z, x0), per));
        i = _mm512_min_epi32(_mm512_max_epi32(i, zero), last);
        for (;;) {   /* i > 0 && z < knot(i): i - 1 */
            const __m512 k = _mm512_add_ps(x0, _mm512_div_ps(_mm512_cvtepi32_ps(i), per));
            const __mmask16 m = in & _mm512_cmp_epi32_mask(i, zero, _MM_CMPINT_GT) & _mm512_cmp_ps_mask(z, k, _CMP_LT_OQ);
            if (!m)
                break;
            i = _mm512_mask_sub_epi32(i, m, i, one);
        }
        for (;;) {   /* i < m - 2 && z >= knot(i + 1): i + 1 */
            const __m512 k = _mm512_add_ps(x0, _mm512_div_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i, one)), per));
            const __mmask16 m = in & _mm512_cmp_epi32_mask(i, last, _MM_CMPINT_LT) & _mm512_cmp_ps_mask(z, k, _CMP_GE_OQ);
            if (!m)
                break;
            i = _mm512_mask_add_epi32(i, m, i, one);
        }
        const __m512 l = _mm512_mask_blend_ps(in, below, _mm512_mul_ps(_mm512_i32gather_ps(i, t->val, 4), slo));
        const __m512 h = _mm512_mask_blend_ps(in, hi0, _mm512_mul_ps(_mm512_i32gather_ps(_mm512_add_epi32(i, one), t->val, 4), shi));
        _mm512_storeu_ps(lo + j, _mm512_add_ps(l, a));
        _mm512_storeu_ps(hi + j, _mm512_add_ps(h, a));
    }
    return j < n ? pd_knot_bounds_ref(t, x + j, add ? add + j : NULL, n - j, lo + j, hi + j) : 0;
}

struct elem_fns {
    float (*scale_max)(float *, int, float, float);
    void (*div_d)(float *, int, double);
    void (*scale_axpys)(float, const float *, const float *, const float *, size_t, int, float *, int);
    void (*expf_rows)(const float *, float *, int);
    void (*weighted_sum)(const float *, const float *const *, int, const float *, float *, int);
    int (*knot_bounds)(const struct pd_knots *, const float *, const float *, int, float *, float *);
};

static struct elem_fns fns;
/* Set once `fns` is filled: the calls on the decode path (thousands per token) test this flag
 * instead of calling pthread_once through the PLT each time. */
static atomic_int fns_ready;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void choose(void)
{
    const int e512 = __builtin_cpu_supports("avx512f"), e2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (e512)
        fns = (struct elem_fns){scale_max_avx512, div_d_avx512, scale_axpys_avx512, expf_ref, weighted_sum_avx512,
                                knot_bounds_avx512};
    else if (e2)
        fns = (struct elem_fns){scale_max_avx2, div_d_avx2, scale_axpys_avx2, expf_ref, weighted_sum_avx2,
                                pd_knot_bounds_ref};
    else
        fns = (struct elem_fns){scale_max_ref, div_d_ref, scale_axpys_by_one, expf_ref, weighted_sum_ref,
                                pd_knot_bounds_ref};
    if (e512 || e2) {
        for (int i = 0; i < 32; i++) {
            double v = exp2((double)i / 32);
            memcpy(&exp_tab[i], &v, 8);
            exp_tab[i] -= (uint64_t)i << 47;
        }
        if (e512 && expf_check(expf_avx512))
            fns.expf_rows = expf_avx512;
        else if (!e512 && expf_check(expf_avx2))
            fns.expf_rows = expf_avx2;
    }
    atomic_store_explicit(&fns_ready, 1, memory_order_release);
}

static inline const struct elem_fns *elem(void)
{
    if (!atomic_load_explicit(&fns_ready, memory_order_acquire))
        pthread_once(&once, choose);
    return &fns;
}

static void scale_axpys_by_one(float a, const float *x, const float *b, const float *z, size_t ldz, int nz, float *y,
                               int n)
{
    pd_scale(a, x, y, n);
    for (int j = 0; j < nz; j++)
        pd_axpy(b[j], z + j * ldz, y, n);
}

float pd_scale_max(float *x, int n, float s, float m)
{
    return elem()->scale_max(x, n, s, m);
}

void pd_div_d(float *x, int n, double d)
{
    elem()->div_d(x, n, d);
}

void pd_scale_axpys(float a, const float *x, const float *b, const float *z, size_t ldz, int nz, float *y, int n)
{
    elem()->scale_axpys(a, x, b, z, ldz, nz, y, n);
}

void pd_expf_rows(const float *x, float *y, int n)
{
    elem()->expf_rows(x, y, n);
}

const char *pd_expf_rows_impl(void)
{
    const void *f = (const void *)elem()->expf_rows;
    return f == (const void *)expf_avx512 ? "avx512" : f == (const void *)expf_avx2 ? "avx2" : "libm";
}

void pd_weighted_sum(const float *a, const float *x, size_t ld, int rows, const float *z, float *y, int n)
{
    const float *row[rows > 0 ? rows : 1];
    for (int j = 0; j < rows; j++)
        row[j] = x + (size_t)j * ld;
    elem()->weighted_sum(a, row, rows, z, y, n);
}

void pd_weighted_sum_rows(const float *a, const float *const *x, int rows, const float *z, float *y, int n)
{
    elem()->weighted_sum(a, x, rows, z, y, n);
}

/* SwiGLU's two loops over a chunk of c values from value i on (pd_swiglu_ref's, and the vector
 * versions' tails): g clamped from above and e = -g; then g / (1 + e) times u clamped both ways. */
static void swiglu_pre_from(float *g, float *e, int i, int c, float limit)
{
    for (; i < c; i++) {
        float x = g[i];
        if (limit > 0)
            x = x < limit ? x : limit;
        g[i] = x;
        e[i] = -x;
    }
}

static void swiglu_post_from(float *g, const float *u, const float *e, int i, int c, float limit)
{
    for (; i < c; i++) {
        float v = u[i];
        if (limit > 0)
            v = v < -limit ? -limit : v > limit ? limit : v;
        g[i] = g[i] / (1.0f + e[i]) * v;
    }
}

/* The loops of pd_swiglu_ref over one chunk, 16 values a vector: min_ps(x, L) is
 * "x < L ? x : L" and max_ps(-L, min_ps(L, v)) the clamp of v, NaNs included; the same division
 * and product. */
AVX512 static void swiglu_pre_avx512(float *g, float *e, int c, float limit)
{
    const __m512 vl = _mm512_set1_ps(limit);
    const __m512i neg = _mm512_set1_epi32((int)0x80000000u);
    int i = 0;
    for (; i + 16 <= c; i += 16) {
        __m512 x = _mm512_loadu_ps(g + i);
        if (limit > 0)
            x = _mm512_min_ps(x, vl);
        _mm512_storeu_ps(g + i, x);
        _mm512_storeu_ps(e + i, _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), neg)));
    }
    swiglu_pre_from(g, e, i, c, limit);
}

AVX512 static void swiglu_post_avx512(float *g, const float *u, const float *e, int c, float limit)
{
    const __m512 vl = _mm512_set1_ps(limit), vnl = _mm512_set1_ps(-limit), one = _mm512_set1_ps(1.0f);
    int i = 0;
    for (; i + 16 <= c; i += 16) {
        __m512 v = _mm512_loadu_ps(u + i);
        if (limit > 0)
            v = _mm512_max_ps(vnl, _mm512_min_ps(vl, v));
        __m512 q = _mm512_div_ps(_mm512_loadu_ps(g + i), _mm512_add_ps(one, _mm512_loadu_ps(e + i)));
        _mm512_storeu_ps(g + i, _mm512_mul_ps(q, v));
    }
    swiglu_post_from(g, u, e, i, c, limit);
}

void pd_swiglu_ref(float *g, const float *u, size_t n, float limit)
{
    float e[256];
    for (size_t i0 = 0; i0 < n; i0 += 256) {
        int c = n - i0 < 256 ? (int)(n - i0) : 256;
        swiglu_pre_from(g + i0, e, 0, c, limit);
        pd_expf_rows(e, e, c);
        swiglu_post_from(g + i0, u + i0, e, 0, c, limit);
    }
}

void pd_swiglu(float *g, const float *u, size_t n, float limit)
{
    const int v512 = __builtin_cpu_supports("avx512f"), v2 = __builtin_cpu_supports("avx2");
    if (!v512 && !v2) {
        pd_swiglu_ref(g, u, n, limit);
        return;
    }
    float e[256];
    for (size_t i0 = 0; i0 < n; i0 += 256) {
        int c = n - i0 < 256 ? (int)(n - i0) : 256;
        if (v512)
            swiglu_pre_avx512(g + i0, e, c, limit);
        else
            swiglu_pre_from(g + i0, e, pd_vec_swiglu_pre_avx2(g + i0, e, c, limit), c, limit);
        pd_expf_rows(e, e, c);
        if (v512)
            swiglu_post_avx512(g + i0, u + i0, e, c, limit);
        else
            swiglu_post_from(g + i0, u + i0, e, pd_vec_swiglu_post_avx2(g + i0, u + i0, e, c, limit), c, limit);
    }
}

void pd_scale(float a, const float *x, float *y, int n)
{
    for (int i = 0; i < n; i++)
        y[i] = a * x[i];
}

/* y = (x * a) * w, or x * a without w. */
static void scale_mul_ref(float a, const float *x, const float *w, float *y, int n)
{
    if (w)
        for (int i = 0; i < n; i++)
            y[i] = x[i] * a * w[i];
    else
        for (int i = 0; i < n; i++)
            y[i] = x[i] * a;
}

AVX512 static void scale_mul_avx512(float a, const float *x, const float *w, float *y, int n)
{
    const __m512 va = _mm512_set1_ps(a);
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), va);
        _mm512_storeu_ps(y + i, w ? _mm512_mul_ps(v, _mm512_loadu_ps(w + i)) : v);
    }
    scale_mul_ref(a, x + i, w ? w + i : NULL, y + i, n - i);
}

static void scale_mul_avx2(float a, const float *x, const float *w, float *y, int n)
{
    const int i = pd_vec_scale_mul_avx2(a, x, w, y, n);
    scale_mul_ref(a, x + i, w ? w + i : NULL, y + i, n - i);
}

static void (*scale_mul_fn)(float, const float *, const float *, float *, int);
static atomic_int scale_mul_ready;
static pthread_once_t once_scale_mul = PTHREAD_ONCE_INIT;

static void choose_scale_mul(void)
{
    scale_mul_fn = __builtin_cpu_supports("avx512f") ? scale_mul_avx512
                   : __builtin_cpu_supports("avx2")  ? scale_mul_avx2
                                                     : scale_mul_ref;
    atomic_store_explicit(&scale_mul_ready, 1, memory_order_release);
}

void pd_scale_mul(float a, const float *x, const float *w, float *y, int n)
{
    if (!atomic_load_explicit(&scale_mul_ready, memory_order_acquire))
        pthread_once(&once_scale_mul, choose_scale_mul);
    scale_mul_fn(a, x, w, y, n);
}

int pd_knot_bounds(const struct pd_knots *t, const float *x, const float *add, int n, float *lo, float *hi)
{
    return elem()->knot_bounds(t, x, add, n, lo, hi);
}

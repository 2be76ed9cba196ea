/* Float operations of the V4 block (see ops.h). */
#include "kernels/ops.h"
#include "kernels/vec.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

float pd_bf16_to_f32(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t pd_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000)
        return (uint16_t)((u >> 16) | 0x40);   /* quiet NaN */
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

void pd_bf16_row(const void *src, float *dst, size_t n)
{
    const unsigned char *p = src;
    for (size_t i = 0; i < n; i++) {
        uint16_t b;
        memcpy(&b, p + 2 * i, 2);
        dst[i] = pd_bf16_to_f32(b);
    }
}

void pd_rmsnorm(const float *x, const float *w, float eps, int n, float *y)
{
    float r = (float)(1.0 / sqrt((double)pd_dot(x, x, n) / n + eps));
    /* x * r * 1 is x * r exactly: without a weight the second product is skipped */
    pd_scale_mul(r, x, w, y, n);
}

static double correction_dim(double rot, int dim, double base, int64_t max_len)
{
    return dim * log((double)max_len / (rot * 2 * M_PI)) / (2 * log(base));
}

void pd_rope_init(struct pd_rope *r, int dim, double theta, double yarn_factor, int64_t orig_max,
                  double beta_fast, double beta_slow)
{
    memset(r, 0, sizeof *r);
    r->dim = dim;
    int half = dim / 2;
    double lo = 0, hi = 0;
    if (yarn_factor > 1) {
        lo = floor(correction_dim(beta_fast, dim, theta, orig_max));
        hi = ceil(correction_dim(beta_slow, dim, theta, orig_max));
        if (lo < 0)
            lo = 0;
        if (hi > dim - 1)
            hi = dim - 1;
        if (hi == lo)
            hi += 0.001;
    }
    for (int i = 0; i < half; i++) {
        double f = 1.0 / pow(theta, (2.0 * i) / dim);
        if (yarn_factor > 1) {
            double ramp = (i - lo) / (hi - lo);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            double smooth = 1 - ramp;   /* 1: keep the frequency; 0: interpolate it */
            f = f / yarn_factor * (1 - smooth) + f * smooth;
        }
        r->freq[i] = (float)f;
    }
}

void pd_rope_cs(const struct pd_rope *r, int64_t pos, float *cs)
{
    for (int i = 0; i < r->dim / 2; i++) {
        double a = (double)pos * r->freq[i];
        cs[2 * i] = (float)cos(a);
        cs[2 * i + 1] = (float)sin(a);
    }
}

void pd_rope_apply_cs(const float *cs, int dim, float *x, int inverse)
{
    for (int i = 0; i < dim / 2; i++) {
        float c = cs[2 * i], s = inverse ? -cs[2 * i + 1] : cs[2 * i + 1];
        float x0 = x[2 * i], x1 = x[2 * i + 1];
        x[2 * i] = x0 * c - x1 * s;
        x[2 * i + 1] = x0 * s + x1 * c;
    }
}

void pd_rope_apply(const struct pd_rope *r, float *x, int64_t pos, int inverse)
{
    float cs[512];
    pd_rope_cs(r, pos, cs);
    pd_rope_apply_cs(cs, r->dim, x, inverse);
}

void pd_softmax(float *x, int n)
{
    float m = -INFINITY;
    for (int i = 0; i < n; i++)
        m = x[i] > m ? x[i] : m;
    double s = 0;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - m);
        s += x[i];
    }
    float inv = (float)(1.0 / s);
    for (int i = 0; i < n; i++)
        x[i] *= inv;
}

/* Sinkhorn as DeepSeek's hc_split_sinkhorn computes it (kernel.py):
 *   M = softmax_rows(M) + eps;  M_ij /= (sum_i M_ij + eps)
 *   repeat iters - 1 times:  M_ij /= (sum_j M_ij + eps);  M_ij /= (sum_i M_ij + eps)
 * so iters row normalisations (the softmax the first) and iters column normalisations, the
 * columns last: the columns sum to 1 within eps, the rows to about 1. */
static void sinkhorn_divide(float *m, int n, int cols, float eps)
{
    for (int i = 0; i < n; i++) {
        float s = 0;
        for (int j = 0; j < n; j++)
            s += cols ? m[j * n + i] : m[i * n + j];
        s += eps;
        for (int j = 0; j < n; j++)
            *(cols ? &m[j * n + i] : &m[i * n + j]) /= s;
    }
}

/* sinkhorn_divide's column step on a 4 x 4 matrix held as its rows r[0..3]: each column's sum
 * ((((0 + m0j) + m1j) + m2j) + m3j) + eps in lane j, then every row divided lane by lane by it:
 * the same additions and divisions in the same order as the scalar loops, four at once. */
static inline void sinkhorn4_cols(__m128 *r, __m128 e)
{
    const __m128 t = _mm_add_ps(_mm_add_ps(_mm_add_ps(_mm_add_ps(_mm_add_ps(_mm_setzero_ps(), r[0]), r[1]), r[2]), r[3]), e);
    for (int i = 0; i < 4; i++)
        r[i] = _mm_div_ps(r[i], t);
}

void pd_sinkhorn(float *m, int n, int iters, float eps)
{
    for (int r = 0; r < n; r++) {
        pd_softmax(m + r * n, n);
        for (int c = 0; c < n; c++)
            m[r * n + c] += eps;
    }
    if (n == 4) {
        /* V4's 4 streams in registers: the row step is the column step of the transpose (a row
         * divide took most of a prefill's 20-iteration Sinkhorn in scalar divisions and branches) */
        __m128 r[4] = {_mm_loadu_ps(m), _mm_loadu_ps(m + 4), _mm_loadu_ps(m + 8), _mm_loadu_ps(m + 12)};
        const __m128 e = _mm_set1_ps(eps);
        sinkhorn4_cols(r, e);
        for (int it = 1; it < iters; it++) {
            _MM_TRANSPOSE4_PS(r[0], r[1], r[2], r[3]);
            sinkhorn4_cols(r, e);
            _MM_TRANSPOSE4_PS(r[0], r[1], r[2], r[3]);
            sinkhorn4_cols(r, e);
        }
        for (int i = 0; i < 4; i++)
            _mm_storeu_ps(m + 4 * i, r[i]);
        return;
    }
    sinkhorn_divide(m, n, 1, eps);
    for (int it = 1; it < iters; it++) {
        sinkhorn_divide(m, n, 0, eps);
        sinkhorn_divide(m, n, 1, eps);
    }
}

float pd_softplus(float x)
{
    return x > 20 ? x : log1pf(expf(x));
}

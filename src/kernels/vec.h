/* Float vector primitives for the parts of the forward pass that are not int8 matrix products
 * (mHC mixing, the router, attention scores and sums): a dot product and y += a*x, with AVX-512
 * and AVX2+FMA versions chosen once per process and a portable one beside them. Each version
 * sums in a fixed order, so a result depends only on its inputs and the CPU, never on the batch
 * or the thread count. */
#ifndef PD_KERNELS_VEC_H
#define PD_KERNELS_VEC_H

#include <stddef.h>
#include <stdint.h>

float pd_dot(const float *a, const float *b, int n);
void pd_axpy(float a, const float *x, float *y, int n);   /* y[i] += a * x[i] */

/* y[r] = pd_dot(w + r * ld, x, n) for r < rows, bit for bit, faster (several rows at once). */
void pd_dot_rows(const float *w, size_t ld, const float *x, int n, int rows, float *y);
/* pd_axpy(a[k], x + k * ld, y, n) for k = 0 .. rows - 1 in order, bit for bit, faster. */
void pd_axpy_rows(const float *a, const float *x, size_t ld, int rows, float *y, int n);

/* x[i] *= s for i < n; returns the largest of m and the new x[i] as the loop
 * "m = x[i] > m ? x[i] : m" would (up to the sign of a zero maximum). */
float pd_scale_max(float *x, int n, float s, float m);
/* x[i] = (float)(x[i] / d), the division in double. */
void pd_div_d(float *x, int n, double d);

/* pd_scale(a, x, y, n), then pd_axpy(b[j], z + j * ldz, y, n) for j = 0 .. nz - 1, bit for bit,
 * in one pass over y. */
void pd_scale_axpys(float a, const float *x, const float *b, const float *z, size_t ldz, int nz, float *y, int n);

/* y[i] = expf(x[i]) for i < n, bit for bit (x == y allowed). */
void pd_expf_rows(const float *x, float *y, int n);
/* Which pd_expf_rows runs: "avx512" or "avx2" (glibc's algorithm in vectors, each taken only if
 * it gave libm's bits on a spread of inputs when first called), else "libm" (expf itself). */
const char *pd_expf_rows_impl(void);

/* y[i] = sum over j < rows of a[j] * x[j * ld + i], summed in j order from 0 with each product
 * rounded (no fused multiply-add), plus z[i] last when z is not NULL; the same bits in every
 * version. */
void pd_weighted_sum(const float *a, const float *x, size_t ld, int rows, const float *z, float *y, int n);
/* The same with row j at x[j]: the same bits as pd_weighted_sum on those rows. */
void pd_weighted_sum_rows(const float *a, const float *const *x, int rows, const float *z, float *y, int n);

/* dst[i] = bf16 src[i] widened to fp32 (exact). */
void pd_bf16_to_f32_row(const uint16_t *src, float *dst, int n);
/* y[r] = pd_dot(row r widened to fp32, x, n) for r < rows, bit for bit as pd_dot_rows over
 * pd_bf16_to_f32_row's copy of the rows, without the copy (widened in registers where the CPU
 * has AVX-512). w: bf16 [rows, ld]; n <= PD_DOT_BF16_MAX. */
#define PD_DOT_BF16_MAX 8192
void pd_dot_rows_bf16(const uint16_t *w, size_t ld, const float *x, int n, int rows, float *y);
/* Several tokens at once: y[t * ldy + r] = pd_dot(w + r * ld, x + t * ldx, n) for r < rows, t < T,
 * bit for bit, each row read once for a few tokens and several products side by side (a lone
 * dot product waits on its own adds). The _bf16 version takes bf16 rows as pd_dot_rows_bf16 does. */
void pd_dot_rows_tokens(const float *w, size_t ld, const float *x, size_t ldx, int T, int n, int rows, float *y,
                        size_t ldy);
void pd_dot_rows_tokens_bf16(const uint16_t *w, size_t ld, const float *x, size_t ldx, int T, int n, int rows,
                             float *y, size_t ldy);
/* SwiGLU in place: g[i] = silu(min(g[i], L)) * clamp(u[i], -L, L) for i < n (L = limit, 0: no
 * clamp; silu(x) = x / (1 + exp(-x)), the exponentials by pd_expf_rows 256 at a time). pd_swiglu
 * gives pd_swiglu_ref's bits (16 values a vector where the CPU has AVX-512). */
void pd_swiglu(float *g, const float *u, size_t n, float limit);
void pd_swiglu_ref(float *g, const float *u, size_t n, float limit);
/* y = a * x (n values). */
void pd_scale(float a, const float *x, float *y, int n);
/* y[i] = x[i] * a * w[i] (the first product rounded first), or x[i] * a when w is NULL; y == x
 * allowed. */
void pd_scale_mul(float a, const float *x, const float *w, float *y, int n);

/* Bounds of an increasing function f tabulated at the knots k_i = x0 + i / per, i < m (m >= 2;
 * val[i] = f(k_i); per a power of two, so that every knot is exact): for each x[j] with
 * k_i <= x[j] < k_{i+1} (i clamped to [0, m - 2]),
 *   lo[j] = val[i] * (1 - slack) + add[j],   hi[j] = val[i + 1] * (1 + slack) + add[j],
 * below x0 lo[j] = below + add[j], hi[j] = val[0] * (1 + slack) + add[j] (add NULL: 0). slack
 * widens the knots' values for a computed f that falls a few ulps short of monotonic. Returns 0;
 * 1 when some x[j] is above the last knot or NaN, or some add[j] NaN: there the table says
 * nothing, and lo and hi are left unspecified for the caller's exact path. The same bits in every
 * version (AVX-512 16 values a vector). */
struct pd_knots {
    float x0, per, slack, below;
    int m;
    const float *val;   /* [m] */
};
int pd_knot_bounds(const struct pd_knots *t, const float *x, const float *add, int n, float *lo, float *hi);
int pd_knot_bounds_ref(const struct pd_knots *t, const float *x, const float *add, int n, float *lo, float *hi);

/* Portable versions (the tests' reference). */
float pd_dot_ref(const float *a, const float *b, int n);
void pd_axpy_ref(float a, const float *x, float *y, int n);

#endif

/* Internal to kernels/: the AVX2 + FMA dot products vec.c chooses on CPUs without AVX-512 (the
 * AMD hosts without it among them): pd_dot itself there, and the many-row, many-token products
 * that repeat its bits. */
#ifndef PD_KERNELS_VEC_AVX2_H
#define PD_KERNELS_VEC_AVX2_H

#include <stddef.h>
#include <stdint.h>

/* pd_dot on these CPUs: two chains of 8-lane fused multiply-adds over 16-value blocks (s0 the
 * first 8 values of each block, s1 the last 8), l = s0 + s1, then
 *   dot = ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)),
 * then t += a[i] * b[i] over the tail of fewer than 16 values in order. */
float pd_vec_dot_avx2(const float *a, const float *b, int n);

/* y[t * ldy + r] = pd_vec_dot_avx2(row r, x + t * ldx, n) for r < rows, t < T, bit for bit; rows
 * of w fp32 (bf16 = 0) or bf16 (bf16 = 1, widened in registers as they are loaded: the dot of
 * the widened row); ld in values. */
void pd_vec_dot_rows_tokens_avx2(const void *w, int bf16, size_t ld, const float *x, size_t ldx, int T, int n,
                                 int rows, float *y, size_t ldy);

/* pd_axpy on these CPUs: y[i] = fma(a, x[i], y[i]) 8 values a vector, then y[i] += a * x[i] over
 * the tail of fewer than 8. */
void pd_vec_axpy_avx2(float a, const float *x, float *y, int n);
/* pd_vec_axpy_avx2(a[k], x + k * ld, y, n) for k = 0 .. rows - 1 in order, bit for bit. */
void pd_vec_axpy_rows_avx2(const float *a, const float *x, size_t ld, int rows, float *y, int n);
/* pd_bf16_to_f32_row (exact). */
void pd_vec_bf16_to_f32_avx2(const uint16_t *src, float *dst, int n);

/* The element-wise steps of the engine over the whole vectors of 8 values in x[0, n): each returns
 * how many values it did (n rounded down to 8, or to 4 for div_d); vec.c runs its scalar loop over
 * the rest, and every value gets that loop's bits (the same operations per element in the same
 * order; tests/kernels/test_ops.c compares them):
 *   scale_max     x[i] *= s; *m the largest of *m and the products (NaN handling as pd_scale_max)
 *   div_d         x[i] = (float)(x[i] / d) in double
 *   scale_axpys   y = a * x, then fused y += b[j] * z[j] for j < nz (pd_vec_axpy_avx2's operations)
 *   weighted_sum  y = sum_j a[j] * x[j] (products rounded, then added in order), then + z
 *   scale_mul     y = (x * a) * w, or x * a without w
 *   swiglu_pre    g = min(g, limit) when limit > 0, e = -g
 *   swiglu_post   g = g / (1 + e) * clamp(u, -limit, limit) (no clamp when limit <= 0) */
int pd_vec_scale_max_avx2(float *x, int n, float s, float *m);
int pd_vec_div_d_avx2(float *x, int n, double d);
int pd_vec_scale_axpys_avx2(float a, const float *x, const float *b, const float *z, size_t ldz, int nz, float *y,
                            int n);
int pd_vec_weighted_sum_avx2(const float *a, const float *const *x, int rows, const float *z, float *y, int n);
int pd_vec_scale_mul_avx2(float a, const float *x, const float *w, float *y, int n);
int pd_vec_swiglu_pre_avx2(float *g, float *e, int c, float limit);
int pd_vec_swiglu_post_avx2(float *g, const float *u, const float *e, int c, float limit);

#endif

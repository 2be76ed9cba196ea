/* Many dot products at once: every row of a matrix against every row of another, each result
 * the bits pd_dot (kernels/vec.h) gives that pair, computed as a register-tiled product. For the
 * fp32/bf16 projections of a prefill step (engine/linear.c) and the attention scores of all heads
 * of a token against its keys (engine/attention.c), where one pd_dot per output spent most of its
 * time in the final sum of the 16 lanes. */
#ifndef PD_KERNELS_DOT_GEMM_H
#define PD_KERNELS_DOT_GEMM_H

#include <stddef.h>
#include <stdint.h>

/* y[t * ldy + r] = pd_dot(w + r * ldw, x + t * ldx, n) for r < rows and t < T, bit for bit on
 * every CPU (where pd_dot is not the AVX-512 version, or n is not a multiple of 16, it is
 * computed by pd_dot_rows). */
void pd_dot_gemm(const float *w, size_t ldw, int rows, const float *x, size_t ldx, int T, int n, float *y,
                 size_t ldy);

/* pd_dot_gemm over bf16 rows of w (ldw in values): y[t * ldy + r] = pd_dot_rows_bf16's value of
 * row r against x row t (= pd_dot of the widened row), bit for bit; each value widened in
 * registers as it is loaded, so the matrix streams from memory once, without a widened copy.
 * n <= PD_DOT_BF16_MAX (kernels/vec.h) where this falls back to pd_dot_rows_tokens_bf16. */
void pd_dot_gemm_bf16(const uint16_t *w, size_t ldw, int rows, const float *x, size_t ldx, int T, int n, float *y,
                      size_t ldy);

/* pd_axpy_rows(a + h * lda, x, ldx, rows, y + h * ldy, n) for h < na, bit for bit (each y value
 * gets the same fused multiply-adds in the same k order), with 4 rows of y over 64 values held
 * in registers while x's rows pass once: the weighted sums of several attention heads over one
 * token's keys read the keys once per 4 heads instead of once per head. */
void pd_axpy_heads(const float *a, size_t lda, int na, const float *x, size_t ldx, int rows, float *y, size_t ldy,
                   int n);

#endif

/* Many dot products at once: every row of a matrix against every row of another, each result
 * the bits pd_dot (kernels/vec.h) gives that pair, computed as a register-tiled product. For the
 * fp32/bf16 projections of a prefill step (engine/linear.c) and the attention scores of all heads
 * of a token against its keys (engine/attention.c), where one pd_dot per output spent most of its
 * time in the final sum of the 16 lanes. */
#ifndef PD_KERNELS_DOT_GEMM_H
#define PD_KERNELS_DOT_GEMM_H

#include <stddef.h>

/* y[t * ldy + r] = pd_dot(w + r * ldw, x + t * ldx, n) for r < rows and t < T, bit for bit on
 * every CPU (where pd_dot is not the AVX-512 version, or n is not a multiple of 16, it is
 * computed by pd_dot_rows). */
void pd_dot_gemm(const float *w, size_t ldw, int rows, const float *x, size_t ldx, int T, int n, float *y,
                 size_t ldy);

#endif

/* The indexer's low precision, as DeepSeek-V4's official inference code has it (model.py
 * Indexer.forward and Compressor.forward with rotate=True; kernel.py fp4_quant_kernel):
 *   rotate: x <- H x / sqrt(d), H the d x d Sylvester-ordered Hadamard matrix
 *           (fast_hadamard_transform's hadamard_transform with scale d^-1/2), then bf16;
 *   FP4 simulation, per block of 32 values: amax = max(max |x|, 6 * 2^-126),
 *           s = 2^ceil(log2(amax / 6)) (ue8m0), x <- e2m1(clamp(x / s, -6, 6)) * s,
 *           e2m1 rounding to nearest even;
 * applied to the indexer's queries (after rope) and to its compressed keys (after the
 * compressor's norm and rope). The rotation is orthogonal (q.k unchanged): it spreads outliers
 * across the dimensions before the 4-bit rounding. */
#ifndef PD_KERNELS_FP4_H
#define PD_KERNELS_FP4_H

#include <stdint.h>

#define PD_E2M1_MAX 6.0f
#define PD_FP4_BLOCK 32

/* e2m1: sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6. Round to nearest,
 * ties to the even code; beyond 6 saturates; NaN gives 0 (the format has none; never reached
 * from finite activations). */
uint8_t pd_e2m1_encode(float x);
float pd_e2m1_decode(uint8_t c);

/* In place: x [n] through e2m1 with one ue8m0 scale per `block` values (the last may be shorter). */
void pd_fp4_simulate(float *x, int n, int block);
/* The same, portable (the tests' reference; pd_fp4_simulate gives its bits with AVX-512). */
void pd_fp4_simulate_ref(float *x, int n, int block);

/* In place: x [n] <- H x / sqrt(n), n a power of two. */
void pd_hadamard(float *x, int n);
/* The same, portable (the tests' reference; pd_hadamard gives its bits with AVX-512). */
void pd_hadamard_ref(float *x, int n);

/* In place: x[i] <- x[i] rounded to bf16 (pd_f32_to_bf16, then widened), bit for bit. */
void pd_bf16_round(float *x, int n);

#endif

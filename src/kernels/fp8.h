/* fp8 e4m3 (the "fn" variant: no infinities, S.1111.111 is NaN, largest finite 448) and the
 * power-of-two block scales DeepSeek-V4 quantizes its KV cache with.
 *
 * Semantics, from the official inference code (inference/kernel.py act_quant_kernel and
 * fast_round_scale, called from model.py on kv[..., :-rope] with block 64 and scale_fmt "ue8m0"):
 *   amax = max(max |x| over the block, 1e-4)
 *   s    = 2^ceil(log2(amax * (1/448)))     (ceil from the fp32 bits: exponent, +1 if any
 *                                            mantissa bit is set)
 *   q    = e4m3(clamp(x / s, -448, 448))    (round to nearest even)
 *   read back as q * s (exact: s is a power of two).
 * The scale is a ue8m0 byte, 2^(byte - 127). */
#ifndef PD_KERNELS_FP8_H
#define PD_KERNELS_FP8_H

#include <stdint.h>

#define PD_E4M3_MAX 448.0f

/* Round to nearest even; |x| beyond 448 (and infinities) saturate to +-448; NaN -> 0x7F with
 * x's sign bit. */
uint8_t pd_e4m3_encode(float x);
float pd_e4m3_decode(uint8_t c);

/* The ue8m0 exponent byte of the scale of a block whose largest magnitude is amax, for a format
 * whose largest value is fmax (448 for e4m3, 6 for e2m1): 127 + ceil(log2(max(amax, floor) / fmax)).
 * floor is the official kernel's lower bound on amax (1e-4 for fp8). */
uint8_t pd_ue8m0_scale(float amax, float fmax, float floor);
float pd_ue8m0_value(uint8_t b);   /* 2^(b - 127); 255 is NaN */

/* n values -> n e4m3 codes with one power-of-two scale per `block` values (the last block may be
 * shorter); scales[(n + block - 1) / block] get the ue8m0 bytes. */
void pd_fp8_quant_blocks(const float *x, int n, int block, uint8_t *q, uint8_t *scales);
void pd_fp8_dequant_blocks(const uint8_t *q, const uint8_t *scales, int n, int block, float *y);

#endif

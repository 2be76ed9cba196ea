/* The small float operations of the V4 block: RMSNorm, rotary embedding (plain and YaRN),
 * softmax, the Sinkhorn projection of mHC, activation functions, bf16 conversion. Portable C:
 * these are a small share of the time next to the int8 matrix products. */
#ifndef PD_KERNELS_OPS_H
#define PD_KERNELS_OPS_H

#include <stddef.h>
#include <stdint.h>

/* bf16 <-> fp32 (round to nearest even). Loads go through memcpy: checkpoint tensors need not
 * be aligned. */
float pd_bf16_to_f32(uint16_t b);
uint16_t pd_f32_to_bf16(float f);
void pd_bf16_row(const void *src, float *dst, size_t n);   /* n bf16 values at src -> fp32 */

/* y = x * rsqrt(mean(x^2) + eps) * w  (w may be NULL: no weight). In place allowed. */
void pd_rmsnorm(const float *x, const float *w, float eps, int n, float *y);

/* Rotary embedding of `dim` dimensions (even), pairs (2i, 2i+1) rotated by pos * freq[i]. */
struct pd_rope {
    int dim;             /* rotary dimensions */
    float freq[256];     /* dim / 2 frequencies */
};
/* theta: base; yarn_factor <= 1 disables YaRN; otherwise DeepSeek's YaRN with the original
 * context length and the beta_fast / beta_slow correction range. */
void pd_rope_init(struct pd_rope *r, int dim, double theta, double yarn_factor, int64_t orig_max,
                  double beta_fast, double beta_slow);
/* Rotates x[0 .. dim) by position pos; inverse = 1 rotates by -pos. */
void pd_rope_apply(const struct pd_rope *r, float *x, int64_t pos, int inverse);
/* The same in two halves, for a position whose rotation is applied to many vectors (every head
 * of a token): cs[2i], cs[2i + 1] = cos, sin of pos * freq[i] (dim values), then the rotation.
 * pd_rope_apply_cs(cs, ...) after pd_rope_cs(r, pos, cs) gives pd_rope_apply's bits. */
void pd_rope_cs(const struct pd_rope *r, int64_t pos, float *cs);
void pd_rope_apply_cs(const float *cs, int dim, float *x, int inverse);

/* In-place softmax over n values. */
void pd_softmax(float *x, int n);

/* DeepSeek's mHC combination (hc_split_sinkhorn): m is n x n (row-major) logits -> softmax over
 * each row, + eps, divide by column sums (+ eps), then iters - 1 times by row sums and by column
 * sums (each + eps): iters row and iters column normalisations, the softmax the first row one. */
void pd_sinkhorn(float *m, int n, int iters, float eps);

static inline float pd_sigmoid(float x) { return 1.0f / (1.0f + __builtin_expf(-x)); }
static inline float pd_silu(float x) { return x / (1.0f + __builtin_expf(-x)); }
/* log(1 + e^x) without overflow */
float pd_softplus(float x);

#endif

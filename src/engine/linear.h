/* A linear layer as the engine runs it: W8A8 (int8 weights [out, in] with an fp32 scale per
 * output row, activations quantised per token) when the checkpoint stores int8, or fp32 when it
 * stores bf16/fp32 (converted once at load: the matrices DeepSeek's official code runs in bf16 or
 * fp32, the head, the router, the compressor, the indexer's weights_proj and wo_a, and wq_a and
 * wkv, which a W8A8 deployment runs in bf16).
 * In reference mode (tests) int8 weights are dequantised and multiplied with unquantised float
 * activations: the float reference of the same weights. */
#ifndef PD_ENGINE_LINEAR_H
#define PD_ENGINE_LINEAR_H

#include "core/err.h"
#include "core/threadpool.h"
#include "kernels/gemm.h"
#include "model/safetensors.h"

/* Rows of at most this many values can stay bf16 (struct pd_linear's h; the bound of
 * pd_dot_rows_bf16's portable path, which widens a row into a buffer); longer ones load as fp32. */
#define PD_LINEAR_WIDE_FLOATS 8192

struct pd_linear {
    pd_qmat q;           /* int8 weights (q.q != NULL) ... */
    float *f;            /* ... or fp32 [out, in] ... */
    const uint16_t *h;   /* ... or bf16 [out, in], read in place from the checkpoint and computed exactly
                          * as f would be with the same values (widened to fp32 in registers:
                          * pd_dot_rows_bf16, pd_dot_rows_tokens_bf16): half the bytes of f, the same bits */
    int out, in;
};

struct pd_arena;

/* Loads `name` (+ `name`_scale when int8) from the checkpoint; shapes are checked against
 * [out, in]. A release FP8/FP4 matrix (+ its ".scale", engine/release.h) becomes int8 with one
 * scale per row. Converted copies are allocated from the arena. */
int pd_linear_load(struct pd_linear *l, const struct pd_st_set *st, struct pd_arena *a, const char *name,
                   int out, int in, pd_err *e);
/* The same; with ref = 1 a release FP8/FP4 matrix is kept as its exact fp32 values (l->f): the
 * float reference of the release itself rather than of its int8 conversion. */
int pd_linear_load_ref(struct pd_linear *l, const struct pd_st_set *st, struct pd_arena *a, const char *name,
                       int out, int in, int ref, pd_err *e);

/* 0 when every value of BF16 tensor t (`name`, rows x cols) is finite, else the tensor and the
 * place of the first NaN or infinity named (a table read in place, as the embedding). */
int pd_check_finite_bf16(const struct pd_st_set *st, const struct pd_st_tensor *t, const char *name, pd_err *e);

/* A matrix the engine computes in float whatever it stores (the router's gate): a BF16 tensor of
 * shape [out, in] (in <= PD_LINEAR_WIDE_FLOATS) is read in place (h), any other float dtype
 * (F32, BF16, F16) of out * in values is loaded as fp32 (f); never int8. */
int pd_linear_load_float(struct pd_linear *l, const struct pd_st_set *st, struct pd_arena *a, const char *name,
                         int out, int in, pd_err *e);

/* y[t] = W x[t] for t < T.  x: [T, in], y: [T, out]. `qbuf` must hold T*in bytes and
 * `sbuf` T floats (the quantised activations). ref = 1: float reference. */
int pd_linear_fwd(const struct pd_linear *l, pd_pool *pool, int ref, const float *x, int T, float *y,
                  int8_t *qbuf, float *sbuf, pd_err *e);

/* The same with x already quantised (xq, from pd_quant_rows of x): several matrices applied to one
 * input quantise it once. Uses xq only for int8 weights outside reference mode (where x is used,
 * as by pd_linear_fwd); never touches a quantisation buffer. */
int pd_linear_fwd_q(const struct pd_linear *l, pd_pool *pool, int ref, const float *x, const pd_qmat *xq, int T,
                    float *y, pd_err *e);

/* y[i] = l[i] x for i < n: several layers sharing one input (x, quantised as xq). Outside
 * reference mode the float ones (f, h) run as one pool run (pd_linear_fwd_float_many) and the
 * int8 ones, when T <= 64, as one grouped product, which the kernel streams from one matrix into
 * the next; otherwise as pd_linear_fwd_q each. Same results. */
int pd_linear_fwd_many(const struct pd_linear *const *l, float *const *y, int n, pd_pool *pool, int ref,
                       const float *x, const pd_qmat *xq, int T, pd_err *e);

/* One float product of a fused run: y[t * ldy + o] = sum_i w[o][i] x[t * ldx + i] for o < l->out,
 * t < T (x and y may be columns of wider rows: ldx >= l->in, ldy >= l->out). */
struct pd_linear_io {
    const struct pd_linear *l;   /* f or h */
    const float *x;
    size_t ldx;
    float *y;
    size_t ldy;
};

/* The n (<= 16) float products in one pool run, blocks of rows of all of them spread over the
 * threads (one hand-off instead of n), or from 256 tokens blocks of 64 tokens each through all of
 * them; each value the bits pd_linear_fwd gives. PD_EINVAL for an int8 product or n > 16. */
int pd_linear_fwd_float_many(const struct pd_linear_io *io, int n, pd_pool *pool, int T, pd_err *e);
/* The calling thread's clock of its pd_linear_fwd_float_many calls (every bf16 / fp32 product
 * outside the float reference; core/timing.h), for the step profile, as kernels/gemm.h clocks the
 * int8 ones: off by default. */
struct pd_call_clock *pd_linear_clock(void);

/* Arena: one growing list of aligned allocations freed together (the engine's converted
 * weights); counts its bytes. */
struct pd_arena {
    void **blocks;
    int n, cap;
    size_t bytes;
};
void *pd_arena_alloc(struct pd_arena *a, size_t bytes);
void pd_arena_free(struct pd_arena *a);

/* Loads a vector or matrix of any float dtype (F32, BF16, F16) as fp32 into the arena; checks
 * the element count. Returns NULL and fills e on failure. */
float *pd_load_f32(const struct pd_st_set *st, struct pd_arena *a, const char *name, int64_t numel, pd_err *e);

#endif

/* Shared by the files of the forward pass (engine.c, attention.c, moe.c); not a public API. */
#ifndef PD_ENGINE_INTERNAL_H
#define PD_ENGINE_INTERNAL_H

#include "engine/engine.h"

#include <math.h>

/* One step's tokens and scratch memory. */
struct pd_step {
    struct pd_engine *en;
    struct pd_step_item *items;
    int n_items;
    int T;                 /* tokens in the step */
    int *item_of;          /* [T] which item a token belongs to */
    int64_t *pos;          /* [T] its position */
    int32_t *token;        /* [T] its id */
    float *h;              /* [T, hc, hidden] residual streams */
    float *x;              /* [T, hidden] sublayer input */
    float *out;            /* [T, hidden] sublayer output */
    float *post;           /* [T, hc] */
    float *comb;           /* [T, hc, hc] */
    float *cs_window;      /* [T, rope dim] cos/sin pairs at each token's position (pd_rope_cs) */
    float *cs_compress;    /*   for en->rope_window and rope_compress (rope_index is a copy of it):
                              computed once per step, applied to every head of every layer */
    pd_qmat xq;            /* x quantised per token ([T, hidden] int8, [T] scales): the input of
                              the sublayer's int8 matrices, quantised once for all of them */
    int8_t *qbuf;          /* [T * max_in] quantised activations */
    float *sbuf;           /* [T * o_groups] their scales (attention quantises o_groups rows a token) */
    int max_in;
};

/* The weights of block `layer`: layers[layer], or the MTP layer's block for layer == n_layers
 * (its KV is layer n_layers of the pool). */
static inline const struct pd_layer_w *pd_layer_weights(const struct pd_engine *en, int layer)
{
    return layer < en->model.n_layers ? &en->w.layers[layer] : &en->w.mtp.block;
}

int pd_attention_layer(struct pd_step *st, int layer, pd_err *e);

/* The parts of the block, each testable alone (tests/engine/test_parts.c). */

/* mHC "pre" of one token: h [hc, hidden] -> x [hidden], post [hc], comb [hc, hc] (Sinkhorn). */
void pd_mhc_pre(const struct pd_model *m, const float *h, const float *fn, const float *base, const float *scale,
                float *x, float *post, float *comb);
/* The same in two parts, so that the mixing values can be split over threads: the rows [r0, r1)
 * of the raw mixing values (mix [2*hc + hc*hc], fn . h), then the rest of "pre" from all of them
 * (mix scaled in place). A split at multiples of PD_MHC_MIX_ROWS gives pd_mhc_pre's bits (any
 * split does: pd_dot_rows gives each row pd_dot's bits). 4 rows: v4-flash-mini's 24 rows make 6
 * blocks of 32 KB, an even share at 2 and 3 threads (8 made 3 blocks: 2 for one thread, 1 for
 * the other at batch 1). */
#define PD_MHC_MIX_ROWS 4
void pd_mhc_mix(const struct pd_model *m, const float *h, const float *fn, int r0, int r1, float *mix);
void pd_mhc_pre_mixed(const struct pd_model *m, const float *h, float *mix, const float *base, const float *scale,
                      float *x, float *post, float *comb);
/* mHC "post": h_k = post_k * out + sum_j comb[j][k] * h_j, in place. */
void pd_mhc_post(const struct pd_model *m, float *h, const float *out, const float *post, const float *comb);
/* Compressor: one token's projections into the state; returns 1 and the entry (normed, roped at
 * the block's first position) when the token completes a block. */
int pd_compress_push(const struct pd_compressor_w *c, float *state, const float *kvp, const float *gate, int64_t pos,
                     const struct pd_rope *rope, float eps, float *entry);
/* The indexer's low precision on one query head or key of id values (a power of two): bf16,
 * Hadamard rotation, FP4 simulation (kernels/fp4.h). */
void pd_indexer_lowp(float *x, int id);
/* The indexer's head-weight scale: index_head_dim^-1/2 * index_n_heads^-1/2. */
static inline float pd_indexer_weight_scale(const struct pd_model *m)
{
    return (float)(1.0 / sqrt((double)m->index_head_dim) / sqrt((double)m->index_n_heads));
}
/* Indices of the k best scores (ties to the lower index; -0.0 equals +0.0, NaN ranks below every
 * number), in increasing index order; returns min(k, n). */
int pd_topk(const float *score, int n, int k, int *sel, uint64_t *work /* [n] */);
int pd_moe_layer(struct pd_step *st, int layer, pd_err *e);
/* The router's choice for one token (non-hash layers): id [k] = the top k of sqrt(softplus(z)) +
 * gate_bias (ties to the lower id, in choice order); s [E] gets the scores of at least those. */
void pd_moe_choose(const struct pd_layer_w *L, int E, int k, const float *z, float *s, int32_t *id);

/* Scratch buffer `slot` of the engine (slots: engine.c 1-10 and 44-49 (46: the step's logits), attention.c 11-29, moe.c
 * 30-43, expert parallelism 50-63, the MTP step 64-68, the head's rows 69,
 * mHC's mixing values 70, attention's key counts and o rows 71, its top-k work 72, its indexer scores 73), at least `bytes` long: kept between steps so a decode step
 * allocates nothing; each call site has its own slot. */
void *pd_scratch(struct pd_engine *en, int slot, size_t bytes, pd_err *e);

#endif

/* The weights of a DeepSeek-V4 checkpoint as the engine uses them. int8 matrices point into
 * the memory-mapped safetensors files; everything else is converted to fp32 once. Names and
 * shapes are those of pdmoe's inventory (src/plan/inventory.c), int8 matrices with a
 * `_scale` companion of one fp32 per output row. DeepSeek's released format (FP8 matrices and
 * FP4 routed experts with ue8m0 ".scale" companions, engine/release.h) loads too: those
 * matrices a W8A8 deployment quantises are converted to int8 per output row at load, into the
 * arena, the others (wq_a, wkv, wo_a) to their exact fp32 values (plan/inventory.h,
 * pd_inventory_w8a8_role). loaded_bytes counts
 * the checkpoint's stored bytes (weights and scales) either way. */
#ifndef PD_ENGINE_WEIGHTS_H
#define PD_ENGINE_WEIGHTS_H

#include <stdint.h>

#include "core/err.h"
#include "engine/linear.h"
#include "model/config.h"
#include "model/safetensors.h"

struct pd_compressor_w {
    int ratio, coff, d;          /* d = head_dim (attention) or index_head_dim (indexer) */
    struct pd_linear wkv, wgate; /* [coff*d, hidden] */
    float *ape;                  /* [ratio, coff*d] learned position bias */
    float *norm;                 /* [d] */
};

struct pd_expert_w {
    struct pd_linear w1, w2, w3; /* w1, w3: [inter, hidden]; w2: [hidden, inter] */
};

struct pd_layer_w {
    int ratio;                         /* compress ratio of the layer */
    float *attn_norm, *ffn_norm;       /* [hidden] */
    float *hc_attn_fn, *hc_ffn_fn;     /* [(2+hc)*hc, hc*hidden] */
    float *hc_attn_base, *hc_ffn_base; /* [(2+hc)*hc] */
    float *hc_attn_scale, *hc_ffn_scale; /* [3] */
    struct pd_linear wq_a;             /* [q_lora, hidden] */
    float *q_norm;                     /* [q_lora] */
    struct pd_linear wq_b;             /* [heads*head_dim, q_lora] */
    struct pd_linear wkv;              /* [head_dim, hidden] */
    float *kv_norm;                    /* [head_dim] */
    struct pd_linear wo_a;             /* [o_groups*o_lora, heads*head_dim/o_groups] */
    struct pd_linear wo_b;             /* [hidden, o_groups*o_lora] */
    float *attn_sink;                  /* [heads] */
    struct pd_compressor_w cmp;        /* ratio > 0 */
    struct pd_compressor_w idx_cmp;    /* ratio == 4: the indexer's compressor */
    struct pd_linear idx_wq_b;         /* [index_heads*index_head_dim, q_lora] */
    struct pd_linear idx_weights;      /* [index_heads, hidden] */
    struct pd_linear gate;             /* [experts, hidden] f or h (scores are computed in fp32) */
    float *gate_bias;                  /* [experts], NULL in hash layers */
    int32_t *tid2eid;                  /* [vocab, top_k] in hash layers, else NULL */
    struct pd_expert_w shared;         /* width moe_inter * n_shared */
    struct pd_expert_w *experts;       /* [experts]; an expert not on this rank has w1.out == 0 */
};

/* The MTP layer: a block plus its embedding/hidden projections and its own head mixing. */
struct pd_mtp_w {
    struct pd_linear e_proj, h_proj;   /* [hidden, hidden] */
    float *enorm, *hnorm, *norm;       /* [hidden] */
    float *hc_head_fn, *hc_head_base, *hc_head_scale;
    struct pd_layer_w block;
};

struct pd_weights {
    const struct pd_model *m;
    struct pd_st_set st;               /* the mapped checkpoint */
    struct pd_arena arena;             /* converted tensors */
    const void *embed;                 /* bf16 [vocab, hidden], in the mapping */
    struct pd_linear head;             /* [vocab, hidden] */
    float *norm;                       /* [hidden] */
    float *hc_head_fn, *hc_head_base, *hc_head_scale; /* [hc, hc*hidden], [hc], [1] */
    struct pd_layer_w *layers;         /* [n_layers] */
    struct pd_mtp_w mtp;               /* loaded when the checkpoint has it; not run yet */
    int has_mtp;
    int cur_class;                     /* class of the tensors being loaded: 0 = I, 1 = II */
    int ref;                           /* release matrices kept fp32 (the float reference) */
    int64_t loaded_bytes[2];           /* checkpoint bytes loaded: [0] routed experts, [1] the rest */
    uint64_t fingerprint;              /* which trained weights these are, whatever the checkpoint's
                                          format: FNV-1a of every norm's values (the model's and each
                                          layer's attention, FFN, q and kv norms), which a release and
                                          its W8A8 conversion share and two trainings (or two
                                          synthetic seeds) do not; a PD hand-off checks it */
};

/* Loads the checkpoint directory `dir` for model m. `has_expert` (NULL = all) selects the routed
 * experts this process holds (expert parallelism). */
int pd_weights_load(struct pd_weights *w, const struct pd_model *m, const char *dir,
                    const unsigned char *has_expert, pd_err *e);
/* The same; ref = 1 (the engine's float reference) keeps a release's FP8/FP4 matrices as their
 * exact fp32 values instead of converting them to int8. */
int pd_weights_load_ref(struct pd_weights *w, const struct pd_model *m, const char *dir,
                        const unsigned char *has_expert, int ref, pd_err *e);
void pd_weights_free(struct pd_weights *w);

#endif

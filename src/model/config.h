/* The model description every part of pdmoe shares: a Hugging Face config.json of model_type
 * deepseek_v4 or deepseek_v3 read into struct pd_model, with every field checked.
 *
 * A model is named by a path to a config .json, a checkpoint directory holding config.json,
 * or a preset name ("deepseek-v4-flash", "seed-v4-flash", "v4-flash-mini", "v4-tiny",
 * "deepseek-v3"); presets are compiled into the binary from the models/ folder, so they work from
 * any directory. pdmoe-specific additions live under a "pdmoe" object that Hugging Face
 * tools ignore (see docs/memory-model.md). */
#ifndef PD_MODEL_CONFIG_H
#define PD_MODEL_CONFIG_H

#include <stdint.h>

#include "core/err.h"

#define PD_MAX_LAYERS 256
#define PD_MAX_EXTRA 8

enum pd_arch { PD_ARCH_DEEPSEEK_V3 = 3, PD_ARCH_DEEPSEEK_V4 = 4 };
enum pd_score_func { PD_SCORE_SOFTMAX, PD_SCORE_SIGMOID, PD_SCORE_SQRTSOFTPLUS };

struct pd_rope_scaling {
    int yarn;                            /* rope_scaling.type == "yarn" */
    double factor;
    int64_t original_max_position_embeddings;
    double beta_fast, beta_slow;
    double mscale, mscale_all_dim;
};

/* A tensor the config cannot derive, declared by the preset (pdmoe.extra_layer_tensors):
 * it is added to every layer, e.g. the seed article's wkv_b. */
struct pd_extra_tensor {
    char suffix[64];      /* name after "layers.N." */
    int ndim;
    int64_t shape[2];
    char group[32];       /* inventory group name */
    int quantizable;      /* a weight matrix the quantisation scheme applies to */
};

struct pd_model {
    char name[64];                 /* preset name or file stem */
    char source[256];              /* where it was read from, for messages */
    enum pd_arch arch;
    int64_t vocab_size;
    int64_t hidden_size;
    int n_layers;                  /* num_hidden_layers */
    int n_mtp_layers;              /* num_nextn_predict_layers */
    int tie_word_embeddings;
    double rms_norm_eps;
    int64_t max_position_embeddings;
    int bos_token_id, eos_token_id;   /* -1: not in config.json */

    /* attention, both architectures */
    int n_heads;                   /* num_attention_heads */
    int n_kv_heads;                /* num_key_value_heads */
    int q_lora_rank;               /* 0: query projected directly (V3-Lite) */
    int qk_rope_head_dim;
    double rope_theta;
    struct pd_rope_scaling rope_scaling;

    /* V4: one shared K=V latent of head_dim, grouped low-rank output, window + compression */
    int head_dim;
    int o_groups, o_lora_rank;
    int sliding_window;
    int compress_ratio[PD_MAX_LAYERS];   /* n_layers + n_mtp_layers entries: 0, 4 or 128 */
    int index_n_heads, index_head_dim, index_topk;
    double compress_rope_theta;
    int hc_mult, hc_sinkhorn_iters;
    double hc_eps;
    int num_hash_layers;
    double swiglu_limit;

    /* V3: MLA with a kv_lora_rank latent, dense first layers, grouped routing */
    int kv_lora_rank, qk_nope_head_dim, v_head_dim;
    int first_k_dense_replace;
    int64_t intermediate_size;
    int n_group, topk_group;

    /* MoE */
    int n_routed_experts, n_shared_experts, n_experts_per_tok;
    int64_t moe_intermediate_size;
    enum pd_score_func scoring_func;
    int noaux_tc;                  /* topk_method == "noaux_tc": a bias used only to choose */
    int norm_topk_prob;
    double routed_scaling_factor;

    /* the checkpoint's own quantisation (quantization_config) */
    int ckpt_fp8;                  /* quant_method fp8 */
    int ckpt_scale_ue8m0;          /* scale_fmt ue8m0: 1-byte block scales, else fp32 */
    int ckpt_block[2];             /* weight_block_size */

    /* DSpark (DeepSeek-V4-Flash-0731): block-wise speculative decoding whose draft is
     * n_mtp_layers window-only V4 blocks ("stages", stored as mtp.N and replacing the MTP layer)
     * fed by the hidden states of the target layers dspark_target_layer_ids, with a low-rank
     * Markov head and a confidence head; all 0 without dspark_* fields */
    int dspark;                    /* the config declares a DSpark draft */
    int dspark_n_targets;          /* len(dspark_target_layer_ids) = stages */
    int dspark_target_layer[8];
    int dspark_markov_rank, dspark_block_size;

    /* pdmoe extensions */
    char description[512];
    int64_t kv_bytes_per_token;    /* > 0: a flat figure instead of the architecture's */
    int n_quantize_groups;
    char quantize_groups[8][32];   /* groups the quantisation scheme also covers */
    int n_extra;
    struct pd_extra_tensor extra[PD_MAX_EXTRA];
};

/* Loads a model by preset name, .json path or checkpoint directory. */
int pd_model_load(const char *spec, struct pd_model *m, pd_err *e);
/* The same, errors naming `flag` (e.g. "--preset") instead of --model. */
int pd_model_load_as(const char *flag, const char *spec, struct pd_model *m, pd_err *e);
/* Parses config.json text; `label` names it in errors. */
int pd_model_parse(const char *text, const char *label, struct pd_model *m, pd_err *e);

/* Layer helpers. */
int pd_model_total_layers(const struct pd_model *m);      /* n_layers + n_mtp_layers */
int pd_model_is_moe_layer(const struct pd_model *m, int layer);
const char *pd_model_arch_name(enum pd_arch a);

/* Embedded data files (models/ *.json, hardware/ *.json): text by path, or NULL. */
const char *pd_embedded_find(const char *path);
/* Iterates embedded paths with a prefix ("models/"); returns NULL past the end. */
const char *pd_embedded_path(int i);

#endif

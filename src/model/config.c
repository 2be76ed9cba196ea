/* config.json -> struct pd_model, for deepseek_v4 and deepseek_v3, with every field checked
 * and every error naming the file and the field. Preset lookup over the embedded models/. */
#include "core/text.h"
#include "model/config.h"
#include "core/file.h"
#include "model/jsonf.h"

#include <limits.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

struct pd_embedded_file { const char *path; const char *data; size_t len; };
extern const struct pd_embedded_file pd_embedded_files[];

const char *pd_embedded_find(const char *path)
{
    for (int i = 0; pd_embedded_files[i].path; i++)
        if (strcmp(pd_embedded_files[i].path, path) == 0)
            return pd_embedded_files[i].data;
    return NULL;
}

const char *pd_embedded_path(int i)
{
    for (int k = 0; k <= i; k++)
        if (!pd_embedded_files[k].path)
            return NULL;
    return pd_embedded_files[i].path;
}

const char *pd_model_arch_name(enum pd_arch a)
{
    return a == PD_ARCH_DEEPSEEK_V4 ? "deepseek_v4" : "deepseek_v3";
}

int pd_model_total_layers(const struct pd_model *m)
{
    return m->n_layers + m->n_mtp_layers;
}

int pd_model_is_moe_layer(const struct pd_model *m, int layer)
{
    if (m->arch == PD_ARCH_DEEPSEEK_V3)
        return layer >= m->first_k_dense_replace;
    return 1;
}

#define I32(key, req, dflt, lo, hi, dst) \
    do { if ((rc = pd_json_i32(&src, root, key, req, dflt, lo, hi, dst, e))) goto out; } while (0)
#define I64(key, req, dflt, lo, hi, dst) \
    do { if ((rc = pd_json_int(&src, root, key, req, dflt, lo, hi, dst, e))) goto out; } while (0)
#define NUM(key, req, dflt, lo, hi, dst) \
    do { if ((rc = pd_json_num(&src, root, key, req, dflt, lo, hi, dst, e))) goto out; } while (0)

static int parse_scoring(const struct pd_jsrc *src, json_t *root, struct pd_model *m, pd_err *e)
{
    char s[32];
    const char *dflt = m->arch == PD_ARCH_DEEPSEEK_V4 ? "sqrtsoftplus" : "sigmoid";
    int rc = pd_json_str(src, root, "scoring_func", 0, dflt, s, sizeof s, e);
    if (rc)
        return rc;
    if (strcmp(s, "softmax") == 0)
        m->scoring_func = PD_SCORE_SOFTMAX;
    else if (strcmp(s, "sigmoid") == 0)
        m->scoring_func = PD_SCORE_SIGMOID;
    else if (strcmp(s, "sqrtsoftplus") == 0)
        m->scoring_func = PD_SCORE_SQRTSOFTPLUS;
    else
        return pd_err_set(e, PD_EINVAL,
                          "%s: field \"scoring_func\": unknown value \"%s\" (softmax, sigmoid, sqrtsoftplus)",
                          src->file, s);
    rc = pd_json_str(src, root, "topk_method", 0, "noaux_tc", s, sizeof s, e);
    if (rc)
        return rc;
    /* DeepSeek's three: V2's greedy and group-limited greedy, V3's and V4's auxiliary-loss-free
     * noaux_tc; another name is a typo or a router this program has never seen */
    if (strcmp(s, "noaux_tc") && strcmp(s, "greedy") && strcmp(s, "group_limited_greedy"))
        return pd_err_set(e, PD_EINVAL,
                          "%s: field \"topk_method\": unknown value \"%s\" (noaux_tc, greedy, group_limited_greedy)",
                          src->file, s);
    m->noaux_tc = strcmp(s, "noaux_tc") == 0;
    return 0;
}

static int parse_rope_scaling(const struct pd_jsrc *parent, json_t *root, struct pd_model *m, pd_err *e)
{
    json_t *rs = json_object_get(root, "rope_scaling");
    if (!rs || json_is_null(rs))
        return 0;
    if (!json_is_object(rs))
        return pd_err_set(e, PD_EINVAL, "%s: field \"rope_scaling\": expected an object", parent->file);
    struct pd_jsrc src = {parent->file, "rope_scaling."};
    static const char *const known[] = {"type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast",
                                        "beta_slow", "mscale", "mscale_all_dim", NULL};
    char type[32];
    int rc = pd_json_known(&src, rs, known, e);
    if (rc == 0)
        rc = pd_json_str(&src, rs, "type", 0, "", type, sizeof type, e);
    if (rc == 0 && !type[0])
        rc = pd_json_str(&src, rs, "rope_type", 1, "", type, sizeof type, e);
    if (rc)
        return rc;
    if (strcmp(type, "yarn") != 0)
        return pd_err_set(e, PD_EINVAL, "%s: field \"rope_scaling.type\": unsupported \"%s\" (only yarn)",
                          parent->file, type);
    struct pd_rope_scaling *r = &m->rope_scaling;
    r->yarn = 1;
    if ((rc = pd_json_num(&src, rs, "factor", 1, 1, 1, 1e6, &r->factor, e)) ||
        (rc = pd_json_int(&src, rs, "original_max_position_embeddings", 1, 0, 1, INT64_C(1) << 40,
                          &r->original_max_position_embeddings, e)) ||
        (rc = pd_json_num(&src, rs, "beta_fast", 0, 32, 0, 1e6, &r->beta_fast, e)) ||
        (rc = pd_json_num(&src, rs, "beta_slow", 0, 1, 0, 1e6, &r->beta_slow, e)) ||
        (rc = pd_json_num(&src, rs, "mscale", 0, 1, 0, 1e6, &r->mscale, e)) ||
        (rc = pd_json_num(&src, rs, "mscale_all_dim", 0, 0, 0, 1e6, &r->mscale_all_dim, e)))
        return rc;
    return 0;
}

/* The checkpoint's quantisation, as DeepSeek releases it (V3 and V4 alike): FP8 e4m3 weights in
 * 128 x 128 blocks with dynamic activation scales, V4's scales as ue8m0 exponents. Another method,
 * block or format is refused by field: the engine would read the weights as this one. */
static int parse_quant_config(const char *file, json_t *root, struct pd_model *m, pd_err *e)
{
    json_t *q = json_object_get(root, "quantization_config");
    if (!q || json_is_null(q))
        return 0;
    if (!json_is_object(q))
        return pd_err_set(e, PD_EINVAL, "%s: field \"quantization_config\": expected an object", file);
    static const char *const known[] = {"quant_method", "fmt", "activation_scheme", "scale_fmt", "weight_block_size",
                                        NULL};
    struct pd_jsrc src = {file, "quantization_config."};
    char method[32], fmt[32], act[32], sfmt[32];
    int rc;
    if ((rc = pd_json_str(&src, q, "quant_method", 1, "", method, sizeof method, e)) ||
        (rc = pd_json_str(&src, q, "fmt", 0, "e4m3", fmt, sizeof fmt, e)) ||
        (rc = pd_json_str(&src, q, "activation_scheme", 0, "dynamic", act, sizeof act, e)) ||
        (rc = pd_json_str(&src, q, "scale_fmt", 0, "", sfmt, sizeof sfmt, e)) || (rc = pd_json_known(&src, q, known, e)))
        return rc;
    /* each field's value and the one DeepSeek's checkpoints have (scale_fmt: ue8m0, or none as V3's) */
    const struct { const char *key, *value, *want; } f[] = {
        {"quant_method", method, "fp8"}, {"fmt", fmt, "e4m3"}, {"activation_scheme", act, "dynamic"},
        {"scale_fmt", sfmt, sfmt[0] ? "ue8m0" : ""}};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (strcmp(f[i].value, f[i].want))
            return pd_err_set(e, PD_EINVAL, "%s: field \"quantization_config.%s\": \"%s\" is not supported: pdmoe "
                              "reads DeepSeek's FP8 checkpoints (quant_method fp8, fmt e4m3, activation_scheme dynamic, "
                              "scale_fmt ue8m0 or none)", file, f[i].key, f[i].value);
    m->ckpt_fp8 = 1;
    m->ckpt_scale_ue8m0 = sfmt[0] != 0;
    m->ckpt_block[0] = m->ckpt_block[1] = 128;
    json_t *bs = json_object_get(q, "weight_block_size");
    if (bs && (!json_is_array(bs) || json_array_size(bs) != 2 || !json_is_integer(json_array_get(bs, 0)) ||
               !json_is_integer(json_array_get(bs, 1)) || json_integer_value(json_array_get(bs, 0)) != 128 ||
               json_integer_value(json_array_get(bs, 1)) != 128))
        return pd_err_set(e, PD_EINVAL, "%s: field \"quantization_config.weight_block_size\": expected [128, 128], "
                          "the blocks of DeepSeek's FP8 checkpoints (the only ones pdmoe reads)", file);
    return 0;
}

/* DSpark (config.h): its stages are the compress_ratios entries past num_hidden_layers, one per
 * target layer (the legacy num_nextn_predict_layers, 1 in DeepSeek-V4-Flash-0731, is superseded),
 * each window-only. A config naming only some of the dspark_* fields, or another geometry, is
 * refused by field rather than read as a different draft. */
static int parse_dspark(const struct pd_jsrc *src, json_t *root, struct pd_model *m, pd_err *e)
{
    const char *file = src->file;
    json_t *t = json_object_get(root, "dspark_target_layer_ids");
    int any = t || json_object_get(root, "dspark_markov_rank") || json_object_get(root, "dspark_block_size");
    if (!any)
        return 0;
    int rc;
    if ((rc = pd_json_i32(src, root, "dspark_markov_rank", 1, 0, 1, 1 << 16, &m->dspark_markov_rank, e)) ||
        (rc = pd_json_i32(src, root, "dspark_block_size", 1, 0, 1, 64, &m->dspark_block_size, e)))
        return rc;
    size_t n = json_is_array(t) ? json_array_size(t) : 0;
    if (n < 1 || n > sizeof m->dspark_target_layer / sizeof m->dspark_target_layer[0])
        return pd_err_set(e, PD_EINVAL, "%s: field \"dspark_target_layer_ids\": expected an array of 1 to 8 layer ids",
                          file);
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(t, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= m->n_layers)
            return pd_err_set(e, PD_EINVAL, "%s: field \"dspark_target_layer_ids[%zu]\": expected a layer id in [0, %d)",
                              file, i, m->n_layers);
        m->dspark_target_layer[i] = (int)json_integer_value(v);
    }
    json_t *a = json_object_get(root, "compress_ratios");
    size_t stages = json_is_array(a) && json_array_size(a) > (size_t)m->n_layers ? json_array_size(a) - (size_t)m->n_layers : 0;
    if (stages != n)
        return pd_err_set(e, PD_EINVAL, "%s: field \"compress_ratios\": %zu entries past num_hidden_layers (DSpark stages), "
                          "expected one per dspark_target_layer_ids entry (%zu)", file, stages, n);
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(a, (size_t)m->n_layers + i);
        if (!json_is_integer(v) || json_integer_value(v) != 0)
            return pd_err_set(e, PD_EINVAL, "%s: field \"compress_ratios[%zu]\": a DSpark stage is window-only (0)", file,
                              (size_t)m->n_layers + i);
    }
    m->dspark = 1;
    m->dspark_n_targets = (int)n;
    m->n_mtp_layers = (int)n;
    return 0;
}

static int parse_compress_ratios(const char *file, json_t *root, struct pd_model *m, pd_err *e)
{
    json_t *a = json_object_get(root, "compress_ratios");
    int total = pd_model_total_layers(m);
    if (!a)
        return pd_err_set(e, PD_EINVAL, "%s: missing required field \"compress_ratios\"", file);
    if (!json_is_array(a))
        return pd_err_set(e, PD_EINVAL, "%s: field \"compress_ratios\": expected an array", file);
    size_t n = json_array_size(a);
    /* One entry per layer including the MTP layers; a list without the MTP entries gives
     * the MTP layers a plain window (ratio 0), as the released config does. */
    if (n != (size_t)total && n != (size_t)m->n_layers)
        return pd_err_set(e, PD_EINVAL,
                          "%s: field \"compress_ratios\": %zu entries, expected %d (num_hidden_layers + num_nextn_predict_layers)",
                          file, n, total);
    for (int i = 0; i < total; i++) {
        if ((size_t)i >= n) {
            m->compress_ratio[i] = 0;
            continue;
        }
        json_t *v = json_array_get(a, (size_t)i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 65536 ||
            json_integer_value(v) == 1)
            return pd_err_set(e, PD_EINVAL,
                              "%s: field \"compress_ratios[%d]\": expected 0 (window only) or a ratio >= 2",
                              file, i);
        m->compress_ratio[i] = (int)json_integer_value(v);
    }
    return 0;
}

static int parse_pdmoe(const char *file, json_t *root, struct pd_model *m, pd_err *e)
{
    json_t *x = json_object_get(root, "pdmoe");
    if (!x)
        return 0;
    if (!json_is_object(x))
        return pd_err_set(e, PD_EINVAL, "%s: field \"pdmoe\": expected an object", file);
    struct pd_jsrc src = {file, "pdmoe."};
    static const char *const known[] = {"description", "kv_bytes_per_token", "quantize_groups", "extra_layer_tensors",
                                        NULL};
    int rc;
    if ((rc = pd_json_known(&src, x, known, e)) ||
        (rc = pd_json_str(&src, x, "description", 0, "", m->description, sizeof m->description, e)) ||
        (rc = pd_json_int(&src, x, "kv_bytes_per_token", 0, 0, 0, INT64_C(1) << 40, &m->kv_bytes_per_token, e)))
        return rc;
    json_t *g = json_object_get(x, "quantize_groups");
    if (g) {
        if (!json_is_array(g) || json_array_size(g) > 8)
            return pd_err_set(e, PD_EINVAL, "%s: field \"pdmoe.quantize_groups\": expected an array of at most 8 group names", file);
        for (size_t i = 0; i < json_array_size(g); i++) {
            json_t *s = json_array_get(g, i);
            if (!json_is_string(s) || strlen(json_string_value(s)) >= 32)
                return pd_err_set(e, PD_EINVAL, "%s: field \"pdmoe.quantize_groups[%zu]\": expected a group name", file, i);
            snprintf(m->quantize_groups[i], 32, "%s", json_string_value(s));
        }
        m->n_quantize_groups = (int)json_array_size(g);
    }
    json_t *t = json_object_get(x, "extra_layer_tensors");
    if (t) {
        if (!json_is_array(t) || json_array_size(t) > PD_MAX_EXTRA)
            return pd_err_set(e, PD_EINVAL, "%s: field \"pdmoe.extra_layer_tensors\": expected an array of at most %d tensors",
                              file, PD_MAX_EXTRA);
        for (size_t i = 0; i < json_array_size(t); i++) {
            json_t *o = json_array_get(t, i);
            char pfx[64];
            snprintf(pfx, sizeof pfx, "pdmoe.extra_layer_tensors[%zu].", i);
            struct pd_jsrc ts = {file, pfx};
            struct pd_extra_tensor *xt = &m->extra[i];
            if (!json_is_object(o))
                return pd_err_set(e, PD_EINVAL, "%s: field \"%.*s\": expected an object", file,
                                  (int)strlen(pfx) - 1, pfx);
            if ((rc = pd_json_str(&ts, o, "name", 1, "", xt->suffix, sizeof xt->suffix, e)) ||
                (rc = pd_json_str(&ts, o, "group", 1, "", xt->group, sizeof xt->group, e)) ||
                (rc = pd_json_bool(&ts, o, "quantizable", 0, 1, &xt->quantizable, e)))
                return rc;
            json_t *sh = json_object_get(o, "shape");
            if (!json_is_array(sh) || json_array_size(sh) < 1 || json_array_size(sh) > 2)
                return pd_err_set(e, PD_EINVAL, "%s: field \"%sshape\": expected [rows] or [rows, cols]", file, pfx);
            xt->ndim = (int)json_array_size(sh);
            for (int d = 0; d < xt->ndim; d++) {
                json_t *v = json_array_get(sh, (size_t)d);
                if (!json_is_integer(v) || json_integer_value(v) < 1)
                    return pd_err_set(e, PD_EINVAL, "%s: field \"%sshape[%d]\": expected a positive integer", file, pfx, d);
                xt->shape[d] = json_integer_value(v);
            }
        }
        m->n_extra = (int)json_array_size(t);
    }
    return 0;
}

static int check_v4(const char *f, struct pd_model *m, pd_err *e)
{
    if ((int64_t)m->n_heads * m->head_dim % m->o_groups)
        return pd_err_set(e, PD_EINVAL, "%s: field \"o_groups\": %d does not divide num_attention_heads x head_dim = %lld",
                          f, m->o_groups, (long long)m->n_heads * m->head_dim);
    if (m->qk_rope_head_dim > m->head_dim || m->qk_rope_head_dim % 2)
        return pd_err_set(e, PD_EINVAL, "%s: field \"qk_rope_head_dim\": %d must be even and at most head_dim (%d)",
                          f, m->qk_rope_head_dim, m->head_dim);
    return 0;
}

/* Every field of a config is one pdmoe reads, one that only describes the file (Hugging Face's
 * bookkeeping, training-time settings), or one whose value here is the only one DeepSeek's models
 * have; anything else is refused by name: a misspelt field (compress_rope_thetta) would run the
 * model at its default, a V3 field in a V4 config (first_k_dense_replace) or a setting pdmoe does
 * not implement (attention_bias, another hidden_act) would run a different model than the file's. */
static int check_fields(const struct pd_jsrc *src, json_t *root, const struct pd_model *m, pd_err *e)
{
    static const char *const common[] = {
        "model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_nextn_predict_layers",
        "tie_word_embeddings", "rms_norm_eps", "max_position_embeddings", "bos_token_id", "eos_token_id",
        "num_attention_heads", "num_key_value_heads", "q_lora_rank", "qk_rope_head_dim", "rope_theta", "rope_scaling",
        "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "routed_scaling_factor",
        "norm_topk_prob", "scoring_func", "topk_method", "quantization_config", "pdmoe", "hidden_act", "attention_bias",
        /* describe the file or its training, not the forward pass */
        "torch_dtype", "dtype", "transformers_version", "use_cache", "initializer_range", "attention_dropout",
        "auto_map", "_name_or_path", "pretraining_tp", "aux_loss_alpha", "seq_aux", "ep_size", NULL};
    static const char *const v4[] = {"head_dim", "o_groups", "o_lora_rank", "sliding_window", "compress_ratios",
                                     "index_n_heads", "index_head_dim", "index_topk", "compress_rope_theta", "hc_mult",
                                     "hc_sinkhorn_iters", "hc_eps", "num_hash_layers", "swiglu_limit",
                                     "dspark_target_layer_ids", "dspark_markov_rank", "dspark_block_size",
                                     "dspark_noise_token_id", NULL};
    static const char *const v3[] = {"kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "first_k_dense_replace",
                                     "intermediate_size", "moe_layer_freq", "n_group", "topk_group", NULL};
    const int is_v4 = m->arch == PD_ARCH_DEEPSEEK_V4;
    const char *const *own = is_v4 ? v4 : v3, *const *other = is_v4 ? v3 : v4;
    const char *names[sizeof common / sizeof *common + sizeof v4 / sizeof *v4];
    size_t n = 0;
    for (const char *const *k = common; *k; k++)
        names[n++] = *k;
    for (const char *const *k = own; *k; k++)
        names[n++] = *k;
    names[n] = NULL;
    for (const char *const *k = other; *k; k++)
        if (json_object_get(root, *k))
            return pd_err_set(e, PD_EINVAL, "%s: field \"%s\": a %s field, not part of model_type %s (pdmoe does not "
                              "read it there)", src->file, *k, is_v4 ? "DeepSeek-V3" : "DeepSeek-V4",
                              is_v4 ? "deepseek_v4" : "deepseek_v3");
    int rc = pd_json_known(src, root, names, e);
    if (rc)
        return rc;
    int bias = 0;
    char act[32];
    if ((rc = pd_json_bool(src, root, "attention_bias", 0, 0, &bias, e)) ||
        (rc = pd_json_str(src, root, "hidden_act", 0, "silu", act, sizeof act, e)))
        return rc;
    if (bias)
        return pd_err_set(e, PD_EINVAL, "%s: field \"attention_bias\": true, but DeepSeek's attention projections have "
                          "no biases (pdmoe does not implement them)", src->file);
    if (strcmp(act, "silu"))
        return pd_err_set(e, PD_EINVAL, "%s: field \"hidden_act\": \"%s\", but DeepSeek's experts are SwiGLU (silu), the "
                          "only activation pdmoe implements", src->file, act);
    json_t *a = json_object_get(root, "architectures");
    const char *want = is_v4 ? "DeepseekV4ForCausalLM" : "DeepseekV3ForCausalLM";
    if (a) {
        int found = 0;
        if (!json_is_array(a))
            return pd_err_set(e, PD_EINVAL, "%s: field \"architectures\": expected an array of class names", src->file);
        for (size_t i = 0; i < json_array_size(a); i++)
            found |= json_is_string(json_array_get(a, i)) && !strcmp(json_string_value(json_array_get(a, i)), want);
        if (!found)
            return pd_err_set(e, PD_EINVAL, "%s: field \"architectures\": does not name %s, the class of model_type %s",
                              src->file, want, is_v4 ? "deepseek_v4" : "deepseek_v3");
    }
    return 0;
}

int pd_model_parse(const char *text, const char *label, struct pd_model *m, pd_err *e)
{
    memset(m, 0, sizeof *m);
    pd_text_safe(m->source, sizeof m->source, label);
    json_t *root = pd_json_load_str(text, label, e);
    if (!root)
        return e ? e->code : PD_EFORMAT;
    struct pd_jsrc src = {label, ""};
    int rc;
    char type[32];
    if ((rc = pd_json_str(&src, root, "model_type", 1, "", type, sizeof type, e)))
        goto out;
    if (strcmp(type, "deepseek_v4") == 0) {
        m->arch = PD_ARCH_DEEPSEEK_V4;
    } else if (strcmp(type, "deepseek_v3") == 0) {
        m->arch = PD_ARCH_DEEPSEEK_V3;
    } else {
        rc = pd_err_set(e, PD_EINVAL, "%s: field \"model_type\": unknown model type \"%s\" (pdmoe reads deepseek_v4 and deepseek_v3)",
                        label, type);
        goto out;
    }
    const int64_t BIG = INT64_C(1) << 40;
    I64("vocab_size", 1, 0, 1, BIG, &m->vocab_size);
    I64("hidden_size", 1, 0, 1, 1 << 20, &m->hidden_size);
    I32("num_hidden_layers", 1, 0, 1, PD_MAX_LAYERS - 8, &m->n_layers);
    I32("num_nextn_predict_layers", 0, 0, 0, 8, &m->n_mtp_layers);
    if ((rc = pd_json_bool(&src, root, "tie_word_embeddings", 0, 0, &m->tie_word_embeddings, e)))
        goto out;
    NUM("rms_norm_eps", 0, 1e-6, 0, 1, &m->rms_norm_eps);
    I64("max_position_embeddings", 0, 4096, 1, BIG, &m->max_position_embeddings);
    I32("bos_token_id", 0, -1, 0, 1 << 30, &m->bos_token_id);   /* -1: not given */
    I32("eos_token_id", 0, -1, 0, 1 << 30, &m->eos_token_id);
    I32("num_attention_heads", 1, 0, 1, 4096, &m->n_heads);
    I32("num_key_value_heads", 0, m->arch == PD_ARCH_DEEPSEEK_V4 ? 1 : m->n_heads, 1, 4096, &m->n_kv_heads);
    if (m->arch == PD_ARCH_DEEPSEEK_V4 && m->n_kv_heads != 1) {
        rc = pd_err_set(e, PD_EINVAL, "%s: field \"num_key_value_heads\": %d, but DeepSeek-V4's attention has one KV "
                        "head (one cache entry per token and layer, shared by every query head)", label, m->n_kv_heads);
        goto out;
    }
    I32("q_lora_rank", m->arch == PD_ARCH_DEEPSEEK_V4, 0, m->arch == PD_ARCH_DEEPSEEK_V4 ? 1 : 0, 1 << 20, &m->q_lora_rank);
    I32("qk_rope_head_dim", 1, 0, 0, 4096, &m->qk_rope_head_dim);
    NUM("rope_theta", 0, 10000, 1, 1e12, &m->rope_theta);
    if ((rc = parse_rope_scaling(&src, root, m, e)))
        goto out;

    I32("n_routed_experts", 1, 0, 1, 1 << 16, &m->n_routed_experts);
    I32("n_shared_experts", 0, 0, 0, 64, &m->n_shared_experts);
    I32("num_experts_per_tok", 1, 0, 1, m->n_routed_experts, &m->n_experts_per_tok);
    I64("moe_intermediate_size", 1, 0, 1, 1 << 20, &m->moe_intermediate_size);
    NUM("routed_scaling_factor", 0, 1, 0, 1e6, &m->routed_scaling_factor);
    if ((rc = pd_json_bool(&src, root, "norm_topk_prob", 0, 1, &m->norm_topk_prob, e)) ||
        (rc = parse_scoring(&src, root, m, e)))
        goto out;

    if (m->arch == PD_ARCH_DEEPSEEK_V4) {
        I32("head_dim", 1, 0, 1, 1 << 16, &m->head_dim);
        I32("o_groups", 1, 0, 1, 4096, &m->o_groups);
        I32("o_lora_rank", 1, 0, 1, 1 << 20, &m->o_lora_rank);
        I32("sliding_window", 1, 0, 1, 1 << 20, &m->sliding_window);
        if ((rc = parse_dspark(&src, root, m, e)) || (rc = parse_compress_ratios(label, root, m, e)))
            goto out;
        int need_index = 0;
        for (int i = 0; i < pd_model_total_layers(m); i++)
            need_index |= m->compress_ratio[i] == 4;
        I32("index_n_heads", need_index, 0, need_index, 4096, &m->index_n_heads);
        I32("index_head_dim", need_index, 0, need_index, 1 << 16, &m->index_head_dim);
        I32("index_topk", need_index, 0, need_index, 1 << 24, &m->index_topk);
        NUM("compress_rope_theta", 0, m->rope_theta, 1, 1e12, &m->compress_rope_theta);
        I32("hc_mult", 1, 0, 1, 64, &m->hc_mult);
        I32("hc_sinkhorn_iters", 0, 20, 0, 1000, &m->hc_sinkhorn_iters);
        NUM("hc_eps", 0, 1e-6, 0, 1, &m->hc_eps);
        I32("num_hash_layers", 0, 0, 0, m->n_layers, &m->num_hash_layers);
        NUM("swiglu_limit", 0, 0, 0, 1e9, &m->swiglu_limit);
        if ((rc = check_v4(label, m, e)))
            goto out;
    } else {
        I32("kv_lora_rank", 1, 0, 1, 1 << 20, &m->kv_lora_rank);
        I32("qk_nope_head_dim", 1, 0, 0, 1 << 16, &m->qk_nope_head_dim);
        I32("v_head_dim", 1, 0, 1, 1 << 16, &m->v_head_dim);
        I32("first_k_dense_replace", 0, 0, 0, m->n_layers, &m->first_k_dense_replace);
        /* the dense layers' FFN: a size of 0 would plan them with no weights */
        I64("intermediate_size", m->first_k_dense_replace > 0, 0, m->first_k_dense_replace > 0, 1 << 24,
            &m->intermediate_size);
        int64_t freq;
        I64("moe_layer_freq", 0, 1, 0, 1 << 20, &freq);
        if (freq != 1) {   /* DeepSeek's modelling code: MoE where layer % moe_layer_freq == 0 */
            rc = pd_err_set(e, PD_EINVAL, "%s: field \"moe_layer_freq\": %lld; pdmoe plans every layer from "
                            "first_k_dense_replace on as MoE (moe_layer_freq 1, as DeepSeek-V3 has it)", label,
                            (long long)freq);
            goto out;
        }
        I32("n_group", 0, 1, 1, m->n_routed_experts, &m->n_group);
        I32("topk_group", 0, 1, 1, m->n_group, &m->topk_group);
        m->hc_mult = 1;
        if (m->n_routed_experts % m->n_group) {
            rc = pd_err_set(e, PD_EINVAL, "%s: field \"n_group\": %d does not divide n_routed_experts (%d)",
                            label, m->n_group, m->n_routed_experts);
            goto out;
        }
    }
    if ((rc = parse_quant_config(label, root, m, e)) || (rc = parse_pdmoe(label, root, m, e)) ||
        (rc = check_fields(&src, root, m, e)))
        goto out;
    rc = 0;
out:
    json_decref(root);
    return rc;
}

static int read_file(const char *path, char **text, pd_err *e)
{
    *text = pd_file_read(path, (size_t)1 << 26, NULL, e);
    return *text ? 0 : e->code;
}

static void stem(const char *path, char *out, size_t n)
{
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    pd_text_safe(out, n, b);   /* a file name is any bytes: whole characters, nothing that drives a terminal */
    char *dot = strrchr(out, '.');
    if (dot && strcmp(dot, ".json") == 0)
        *dot = 0;
}

int pd_model_load(const char *spec, struct pd_model *m, pd_err *e)
{
    return pd_model_load_as("--model", spec, m, e);
}

int pd_model_load_as(const char *flag, const char *spec, struct pd_model *m, pd_err *e)
{
    char path[PATH_MAX], name[64];
    struct stat st;
    if (!spec || !*spec)
        return pd_err_set(e, PD_EINVAL, "%s: empty model name", flag);
    if (stat(spec, &st) == 0) {
        if (S_ISDIR(st.st_mode)) {
            if (pd_path_join(path, sizeof path, spec, "config.json", e))
                return e->code;
            stem(spec[strlen(spec) - 1] == '/' ? "model" : spec, name, sizeof name);
        } else {
            snprintf(path, sizeof path, "%s", spec);
            stem(spec, name, sizeof name);
        }
        char *text = NULL;
        int rc = read_file(path, &text, e);
        if (rc)
            return rc;
        rc = pd_model_parse(text, path, m, e);
        free(text);
        if (rc == 0)
            snprintf(m->name, sizeof m->name, "%s", name);
        return rc;
    }
    /* Not on disk: a preset name or the path of an embedded preset. */
    const char *text = pd_embedded_find(spec);
    if (!text) {
        snprintf(path, sizeof path, "models/%s.json", spec);
        text = pd_embedded_find(path);
    } else {
        snprintf(path, sizeof path, "%s", spec);
    }
    if (!text) {
        char list[256] = "";
        for (int i = 0; pd_embedded_path(i); i++) {
            const char *p = pd_embedded_path(i);
            size_t n = strlen(p);
            /* presets are models/NAME.json; models/ also holds data such as the corpus */
            if (strncmp(p, "models/", 7) == 0 && n > 5 && strcmp(p + n - 5, ".json") == 0) {
                char s[64];
                stem(p, s, sizeof s);
                if (strlen(list) + strlen(s) + 3 < sizeof list)
                    strcat(strcat(list, list[0] ? ", " : ""), s);
            }
        }
        return pd_err_set(e, PD_EIO, "%s %s: no such file, directory or preset (presets: %s)", flag, spec, list);
    }
    int rc = pd_model_parse(text, path, m, e);
    if (rc == 0)
        stem(path, m->name, sizeof m->name);
    return rc;
}

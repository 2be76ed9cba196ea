/* Weight inventory from a model description or from safetensors headers. */
#include "core/text.h"
#include "plan/inventory.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct builder {
    const struct pd_model *m;
    const struct pd_quant *q;
    struct pd_inventory *inv;
    unsigned quantize_mask;   /* groups the scheme also covers (the model's quantize_groups) */
    int layer;
    const char *prefix;       /* "layers.3." */
    pd_err *e;
};

static int grow(struct pd_inventory *inv)
{
    if (inv->n < inv->cap)
        return 0;
    int cap = inv->cap ? inv->cap * 2 : 512;
    struct pd_tensor *t = realloc(inv->t, (size_t)cap * sizeof *t);
    if (!t)
        return PD_ENOMEM;
    inv->t = t;
    inv->cap = cap;
    return 0;
}

static int suffix(const char *s, const char *suf)
{
    size_t n = strlen(s), k = strlen(suf);
    return n >= k && strcmp(s + n - k, suf) == 0;
}

/* What a W8A8 deployment of DeepSeek-V4 does with each matrix the release stores in FP8/FP4, as
 * vLLM-Ascend's DeepSeek-V4 quantisation rules (examples/quantization/deepseek_v4/
 * quantize_config*.yaml and quantize.py, the msModelSlim format it loads) write it: every
 * "*attn*" matrix but wq_a, wkv, wo_a and the compressor and indexer projections other than the
 * indexer's wq_b; every "*ffn*" matrix but the gate (routed and shared experts); the MTP
 * projections (e_proj, h_proj; DSpark's main_proj). Anything else it dequantises to bf16
 * ("FLOAT"), except the draft stages' wo_a of a DSpark checkpoint, which it keeps FP8 as released
 * (vLLM-Ascend's DSpark loader dequantises that one itself). */
enum pd_w8a8_role pd_inventory_w8a8_role(const char *name, int dspark)
{
    if (dspark && strncmp(name, "mtp.", 4) == 0 && suffix(name, "attn.wo_a.weight"))
        return PD_W8A8_KEEP;
    static const char *const quant[] = {"attn.wq_b.weight", "attn.wo_b.weight", "attn.indexer.wq_b.weight",
                                        "e_proj.weight", "h_proj.weight", "main_proj.weight"};
    for (size_t i = 0; i < sizeof quant / sizeof quant[0]; i++)
        if (suffix(name, quant[i]))
            return PD_W8A8_QUANT;
    if ((strstr(name, "ffn.experts.") || strstr(name, "ffn.shared_experts.")) && suffix(name, ".weight"))
        return PD_W8A8_QUANT;
    return PD_W8A8_FLOAT;
}

/* The format of tensor `name` (see add() for `linear`). */
static enum pd_fmt choose_fmt(const struct builder *b, enum pd_group g, int ndim, int linear,
                              enum pd_fmt native, const char *name)
{
    if (ndim < 2 || linear < 0)
        return native;
    if (b->q->group_fmt[g] != PD_FMT_NONE)
        return b->q->group_fmt[g];
    if (b->quantize_mask & (1u << g))
        return b->q->linear;
    if (!linear)
        return native;
    if (b->q->w8a8_groups && b->m->arch == PD_ARCH_DEEPSEEK_V4)
        switch (pd_inventory_w8a8_role(name, b->m->dspark)) {
        case PD_W8A8_QUANT: return b->q->linear;
        case PD_W8A8_KEEP: return PD_FMT_FP8;   /* DSpark's draft wo_a, as released */
        case PD_W8A8_FLOAT: return PD_FMT_BF16;
        }
    return b->q->linear;
}

/* Adds t's bytes and parameters to the totals; PD_ERANGE if a total would pass PD_INV_MAX_BYTES
 * (each term is checked first, so no product or sum here can overflow). */
static int account(struct pd_inventory *inv, const struct pd_tensor *t)
{
    int64_t bytes, params;
    if (t->bytes < 0 || t->params < 0 || t->count < 0 || __builtin_mul_overflow(t->bytes, (int64_t)t->count, &bytes) ||
        __builtin_mul_overflow(t->params, (int64_t)t->count, &params) ||
        bytes > PD_INV_MAX_BYTES - inv->class_bytes[t->cls] || params > PD_INV_MAX_BYTES - inv->class_params[t->cls])
        return PD_ERANGE;
    inv->group_bytes[t->group][t->cls] += bytes;
    inv->group_params[t->group][t->cls] += params;
    inv->class_bytes[t->cls] += bytes;
    inv->class_params[t->cls] += params;
    return 0;
}

static int too_large(struct builder *b, const struct pd_tensor *t)
{
    return pd_err_set(b->e, PD_ERANGE, "%s: the model is too large: at tensor %s (%lld x %lld, %d of it) its weights "
                      "pass 2^50 bytes or parameters; check the sizes", b->m->source, t->name, (long long)t->shape[0],
                      (long long)t->shape[1], t->count);
}

/* Adds one tensor (or one per expert when count > 1). `linear`: 1 for a matrix the release
 * stores in FP8/FP4 (the scheme applies to it: under w8a8/w4a8 only where a W8A8 deployment
 * quantises it, choose_fmt), 0 for a matrix the release keeps in bf16 (embedding, head, router,
 * compressor projections, the indexer's weights_proj: only a preset's quantize_groups or an
 * override quantises it), -1 for a parameter that keeps its dtype whatever the scheme (mHC mixing
 * matrices, position biases, the hash-routing table). */
static int add(struct builder *b, enum pd_group g, enum pd_class cls, int count, int linear,
               enum pd_fmt native, int64_t rows, int64_t cols, const char *fmt, ...)
    __attribute__((format(printf, 9, 10)));

static int add(struct builder *b, enum pd_group g, enum pd_class cls, int count, int linear,
               enum pd_fmt native, int64_t rows, int64_t cols, const char *fmt, ...)
{
    if (grow(b->inv))
        return PD_ENOMEM;
    struct pd_tensor *t = &b->inv->t[b->inv->n++];
    memset(t, 0, sizeof *t);
    int k = snprintf(t->name, sizeof t->name, "%s", b->prefix);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->name + k, sizeof t->name - (size_t)k, fmt, ap);
    va_end(ap);
    t->ndim = cols > 0 ? 2 : 1;
    t->shape[0] = rows;
    t->shape[1] = cols > 0 ? cols : 0;
    t->count = count;
    /* the config's fields are each in range, their products need not be: 2^50 parameters at
     * most 8 bytes each keeps pd_fmt_bytes inside int64 */
    if (rows < 0 || __builtin_mul_overflow(rows, cols > 0 ? cols : 1, &t->params) || t->params > PD_INV_MAX_BYTES)
        return too_large(b, t);
    t->fmt = choose_fmt(b, g, t->ndim, linear, native, t->name);
    t->bytes = pd_fmt_bytes(t->fmt, t->ndim, t->shape, b->q);
    t->layer = (int16_t)b->layer;
    t->group = (uint8_t)g;
    t->cls = (uint8_t)cls;
    if (account(b->inv, t))
        return too_large(b, t);
    if (cls == PD_CLASS_I)
        for (int e = 0; e < b->inv->n_experts; e++)
            b->inv->expert_bytes[e] += t->bytes;
    return 0;
}

#define TRY(x) do { int rc_ = (x); if (rc_) return rc_; } while (0)

/* --- DeepSeek-V4 (names as in the released checkpoint) --- */

static int v4_compressor(struct builder *b, enum pd_group gc, const char *who, int ratio, int64_t head)
{
    const struct pd_model *m = b->m;
    int coff = ratio == 4 ? 2 : 1;   /* ratio-4 blocks overlap: two projections per token */
    TRY(add(b, gc, PD_CLASS_II, 1, 0, PD_FMT_BF16, coff * head, m->hidden_size, "%scompressor.wkv.weight", who));
    TRY(add(b, gc, PD_CLASS_II, 1, 0, PD_FMT_BF16, coff * head, m->hidden_size, "%scompressor.wgate.weight", who));
    TRY(add(b, gc, PD_CLASS_II, 1, -1, PD_FMT_F32, ratio, coff * head, "%scompressor.ape", who));
    TRY(add(b, gc, PD_CLASS_II, 1, 0, PD_FMT_BF16, head, 0, "%scompressor.norm.weight", who));
    return 0;
}

static int v4_block(struct builder *b, int layer, int mtp)
{
    const struct pd_model *m = b->m;
    const int64_t H = m->hidden_size, hc = m->hc_mult, mix = (2 + hc) * hc;
    const int ratio = m->compress_ratio[layer];
    enum pd_group gn = mtp ? PD_G_MTP : PD_G_NORMS_MHC;
    enum pd_group ga = mtp ? PD_G_MTP : PD_G_ATTENTION;
    TRY(add(b, gn, PD_CLASS_II, 1, 0, PD_FMT_BF16, H, 0, "attn_norm.weight"));
    TRY(add(b, gn, PD_CLASS_II, 1, 0, PD_FMT_BF16, H, 0, "ffn_norm.weight"));
    static const char *hcn[] = {"attn", "ffn"};
    for (int i = 0; i < 2; i++) {
        TRY(add(b, gn, PD_CLASS_II, 1, -1, PD_FMT_F32, mix, hc * H, "hc_%s_fn", hcn[i]));
        TRY(add(b, gn, PD_CLASS_II, 1, 0, PD_FMT_F32, mix, 0, "hc_%s_base", hcn[i]));
        TRY(add(b, gn, PD_CLASS_II, 1, 0, PD_FMT_F32, 3, 0, "hc_%s_scale", hcn[i]));
    }
    const int64_t qdim = (int64_t)m->n_heads * m->head_dim;
    TRY(add(b, ga, PD_CLASS_II, 1, 1, PD_FMT_BF16, m->q_lora_rank, H, "attn.wq_a.weight"));
    TRY(add(b, ga, PD_CLASS_II, 1, 0, PD_FMT_BF16, m->q_lora_rank, 0, "attn.q_norm.weight"));
    TRY(add(b, ga, PD_CLASS_II, 1, 1, PD_FMT_BF16, qdim, m->q_lora_rank, "attn.wq_b.weight"));
    TRY(add(b, ga, PD_CLASS_II, 1, 1, PD_FMT_BF16, m->head_dim, H, "attn.wkv.weight"));
    TRY(add(b, ga, PD_CLASS_II, 1, 0, PD_FMT_BF16, m->head_dim, 0, "attn.kv_norm.weight"));
    /* wo_a: stored FP8 like the other projections; the official code runs it in bf16 (its
     * convert.py dequantises it, its Attention builds it bf16), and so does a W8A8 deployment */
    TRY(add(b, ga, PD_CLASS_II, 1, 1, PD_FMT_BF16, (int64_t)m->o_groups * m->o_lora_rank, qdim / m->o_groups,
            "attn.wo_a.weight"));
    TRY(add(b, ga, PD_CLASS_II, 1, 1, PD_FMT_BF16, H, (int64_t)m->o_groups * m->o_lora_rank, "attn.wo_b.weight"));
    TRY(add(b, ga, PD_CLASS_II, 1, 0, PD_FMT_F32, m->n_heads, 0, "attn.attn_sink"));
    for (int i = 0; i < m->n_extra; i++) {
        const struct pd_extra_tensor *x = &m->extra[i];
        enum pd_group xg;
        if (pd_group_parse(x->group, &xg))
            xg = ga;
        TRY(add(b, mtp ? PD_G_MTP : xg, PD_CLASS_II, 1, x->quantizable, PD_FMT_BF16, x->shape[0],
                x->ndim > 1 ? x->shape[1] : 0, "%s", x->suffix));
    }
    if (ratio > 0) {
        enum pd_group gc = mtp ? PD_G_MTP : PD_G_COMPRESSOR;
        TRY(v4_compressor(b, gc, "attn.", ratio, m->head_dim));
        if (ratio == 4) {
            TRY(add(b, gc, PD_CLASS_II, 1, 1, PD_FMT_BF16, (int64_t)m->index_n_heads * m->index_head_dim,
                    m->q_lora_rank, "attn.indexer.wq_b.weight"));
            TRY(add(b, gc, PD_CLASS_II, 1, 0, PD_FMT_BF16, m->index_n_heads, H, "attn.indexer.weights_proj.weight"));
            TRY(v4_compressor(b, gc, "attn.indexer.", ratio, m->index_head_dim));
        }
    }
    /* MoE: router, shared expert(s), routed experts */
    enum pd_group gr = mtp ? PD_G_MTP : PD_G_ROUTER;
    enum pd_group gs = mtp ? PD_G_MTP : PD_G_SHARED_EXPERT;
    /* an MTP layer's routed experts are routed experts too: split by EP, same format */
    enum pd_group ge = PD_G_ROUTED_EXPERTS;
    const int64_t E = m->n_routed_experts, I = m->moe_intermediate_size;
    TRY(add(b, gr, PD_CLASS_II, 1, 0, PD_FMT_BF16, E, H, "ffn.gate.weight"));
    if (!mtp && layer < m->num_hash_layers)
        TRY(add(b, gr, PD_CLASS_II, 1, -1, PD_FMT_I64, m->vocab_size, m->n_experts_per_tok, "ffn.gate.tid2eid"));
    else
        TRY(add(b, gr, PD_CLASS_II, 1, 0, PD_FMT_F32, E, 0, "ffn.gate.bias"));
    if (m->n_shared_experts > 0) {
        int64_t Is = I * m->n_shared_experts;
        TRY(add(b, gs, PD_CLASS_II, 1, 1, PD_FMT_BF16, Is, H, "ffn.shared_experts.w1.weight"));
        TRY(add(b, gs, PD_CLASS_II, 1, 1, PD_FMT_BF16, H, Is, "ffn.shared_experts.w2.weight"));
        TRY(add(b, gs, PD_CLASS_II, 1, 1, PD_FMT_BF16, Is, H, "ffn.shared_experts.w3.weight"));
    }
    TRY(add(b, ge, PD_CLASS_I, (int)E, 1, PD_FMT_BF16, I, H, "ffn.experts.{e}.w1.weight"));
    TRY(add(b, ge, PD_CLASS_I, (int)E, 1, PD_FMT_BF16, H, I, "ffn.experts.{e}.w2.weight"));
    TRY(add(b, ge, PD_CLASS_I, (int)E, 1, PD_FMT_BF16, I, H, "ffn.experts.{e}.w3.weight"));
    return 0;
}

/* The DSpark draft (config.h) as DeepSeek-V4-Flash-0731 stores it under mtp.N: each stage a
 * window-only V4 block; stage 0 also the projection of the target layers' hidden states
 * (main_proj [H, H x targets], quantised like the other linear layers, and main_norm); the last
 * stage the output norm and mHC head, the Markov head (markov_w1 and markov_w2, both
 * [vocab, rank]) and the confidence head (proj [1, H + rank]). Names and shapes as vLLM's
 * deepseek_v4/nvidia/dspark.py loads them; the heads' bf16 is what makes the release's
 * "166.9 GB" (fp32 would make it 167.0: tests/plan/test_inventory.c). */
static int v4_dspark(struct builder *b)
{
    const struct pd_model *m = b->m;
    const int64_t H = m->hidden_size, hc = m->hc_mult, r = m->dspark_markov_rank;
    char prefix[32];
    for (int i = 0; i < m->n_mtp_layers; i++) {
        snprintf(prefix, sizeof prefix, "mtp.%d.", i);
        b->prefix = prefix;
        b->layer = m->n_layers + i;
        if (i == 0) {
            TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 1, PD_FMT_BF16, H, H * m->dspark_n_targets, "main_proj.weight"));
            TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 0, PD_FMT_BF16, H, 0, "main_norm.weight"));
        }
        TRY(v4_block(b, m->n_layers + i, 1));
        if (i == m->n_mtp_layers - 1) {
            TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 0, PD_FMT_BF16, H, 0, "norm.weight"));
            TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, -1, PD_FMT_F32, hc, hc * H, "hc_head_fn"));
            TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 0, PD_FMT_F32, hc, 0, "hc_head_base"));
            TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 0, PD_FMT_F32, 1, 0, "hc_head_scale"));
            TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 0, PD_FMT_BF16, m->vocab_size, r, "markov_head.markov_w1.weight"));
            TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 0, PD_FMT_BF16, m->vocab_size, r, "markov_head.markov_w2.weight"));
            TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 0, PD_FMT_BF16, 1, H + r, "confidence_head.proj.weight"));
        }
    }
    return 0;
}

static int build_v4(struct builder *b, int include_mtp)
{
    const struct pd_model *m = b->m;
    const int64_t H = m->hidden_size, hc = m->hc_mult;
    char prefix[32];
    b->prefix = "";
    b->layer = -1;
    TRY(add(b, PD_G_EMBEDDING, PD_CLASS_II, 1, 0, PD_FMT_BF16, m->vocab_size, H, "embed.weight"));
    if (!m->tie_word_embeddings)
        TRY(add(b, PD_G_LM_HEAD, PD_CLASS_II, 1, 0, PD_FMT_BF16, m->vocab_size, H, "head.weight"));
    TRY(add(b, PD_G_NORMS_MHC, PD_CLASS_II, 1, 0, PD_FMT_BF16, H, 0, "norm.weight"));
    TRY(add(b, PD_G_NORMS_MHC, PD_CLASS_II, 1, -1, PD_FMT_F32, hc, hc * H, "hc_head_fn"));
    TRY(add(b, PD_G_NORMS_MHC, PD_CLASS_II, 1, 0, PD_FMT_F32, hc, 0, "hc_head_base"));
    TRY(add(b, PD_G_NORMS_MHC, PD_CLASS_II, 1, 0, PD_FMT_F32, 1, 0, "hc_head_scale"));
    for (int l = 0; l < m->n_layers; l++) {
        snprintf(prefix, sizeof prefix, "layers.%d.", l);
        b->prefix = prefix;
        b->layer = l;
        TRY(v4_block(b, l, 0));
    }
    if (m->dspark)
        return include_mtp ? v4_dspark(b) : 0;
    for (int i = 0; include_mtp && i < m->n_mtp_layers; i++) {
        snprintf(prefix, sizeof prefix, "mtp.%d.", i);
        b->prefix = prefix;
        b->layer = m->n_layers + i;
        TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 1, PD_FMT_BF16, H, H, "e_proj.weight"));
        TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 1, PD_FMT_BF16, H, H, "h_proj.weight"));
        TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 0, PD_FMT_BF16, H, 0, "enorm.weight"));
        TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 0, PD_FMT_BF16, H, 0, "hnorm.weight"));
        TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 0, PD_FMT_BF16, H, 0, "norm.weight"));
        TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, -1, PD_FMT_F32, hc, hc * H, "hc_head_fn"));
        TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 0, PD_FMT_F32, hc, 0, "hc_head_base"));
        TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 0, PD_FMT_F32, 1, 0, "hc_head_scale"));
        TRY(v4_block(b, m->n_layers + i, 1));
    }
    return 0;
}

/* --- DeepSeek-V3 (Hugging Face names) --- */

static int v3_block(struct builder *b, int layer, int mtp)
{
    const struct pd_model *m = b->m;
    const int64_t H = m->hidden_size;
    const int64_t qk = m->qk_nope_head_dim + m->qk_rope_head_dim;
    enum pd_group ga = mtp ? PD_G_MTP : PD_G_ATTENTION, gn = mtp ? PD_G_MTP : PD_G_NORMS_MHC;
    TRY(add(b, gn, PD_CLASS_II, 1, 0, PD_FMT_BF16, H, 0, "input_layernorm.weight"));
    TRY(add(b, gn, PD_CLASS_II, 1, 0, PD_FMT_BF16, H, 0, "post_attention_layernorm.weight"));
    if (m->q_lora_rank > 0) {
        TRY(add(b, ga, PD_CLASS_II, 1, 1, PD_FMT_BF16, m->q_lora_rank, H, "self_attn.q_a_proj.weight"));
        TRY(add(b, ga, PD_CLASS_II, 1, 0, PD_FMT_BF16, m->q_lora_rank, 0, "self_attn.q_a_layernorm.weight"));
        TRY(add(b, ga, PD_CLASS_II, 1, 1, PD_FMT_BF16, m->n_heads * qk, m->q_lora_rank, "self_attn.q_b_proj.weight"));
    } else {
        TRY(add(b, ga, PD_CLASS_II, 1, 1, PD_FMT_BF16, m->n_heads * qk, H, "self_attn.q_proj.weight"));
    }
    TRY(add(b, ga, PD_CLASS_II, 1, 1, PD_FMT_BF16, m->kv_lora_rank + m->qk_rope_head_dim, H,
            "self_attn.kv_a_proj_with_mqa.weight"));
    TRY(add(b, ga, PD_CLASS_II, 1, 0, PD_FMT_BF16, m->kv_lora_rank, 0, "self_attn.kv_a_layernorm.weight"));
    TRY(add(b, ga, PD_CLASS_II, 1, 1, PD_FMT_BF16, (int64_t)m->n_heads * (m->qk_nope_head_dim + m->v_head_dim),
            m->kv_lora_rank, "self_attn.kv_b_proj.weight"));
    TRY(add(b, ga, PD_CLASS_II, 1, 1, PD_FMT_BF16, H, (int64_t)m->n_heads * m->v_head_dim, "self_attn.o_proj.weight"));
    if (!pd_model_is_moe_layer(m, layer)) {
        enum pd_group gd = mtp ? PD_G_MTP : PD_G_DENSE_FFN;
        TRY(add(b, gd, PD_CLASS_II, 1, 1, PD_FMT_BF16, m->intermediate_size, H, "mlp.gate_proj.weight"));
        TRY(add(b, gd, PD_CLASS_II, 1, 1, PD_FMT_BF16, m->intermediate_size, H, "mlp.up_proj.weight"));
        TRY(add(b, gd, PD_CLASS_II, 1, 1, PD_FMT_BF16, H, m->intermediate_size, "mlp.down_proj.weight"));
        return 0;
    }
    enum pd_group gr = mtp ? PD_G_MTP : PD_G_ROUTER, gs = mtp ? PD_G_MTP : PD_G_SHARED_EXPERT;
    enum pd_group ge = PD_G_ROUTED_EXPERTS;
    const int64_t E = m->n_routed_experts, I = m->moe_intermediate_size;
    TRY(add(b, gr, PD_CLASS_II, 1, 0, PD_FMT_BF16, E, H, "mlp.gate.weight"));
    if (m->noaux_tc)
        TRY(add(b, gr, PD_CLASS_II, 1, 0, PD_FMT_F32, E, 0, "mlp.gate.e_score_correction_bias"));
    if (m->n_shared_experts > 0) {
        int64_t Is = I * m->n_shared_experts;
        TRY(add(b, gs, PD_CLASS_II, 1, 1, PD_FMT_BF16, Is, H, "mlp.shared_experts.gate_proj.weight"));
        TRY(add(b, gs, PD_CLASS_II, 1, 1, PD_FMT_BF16, Is, H, "mlp.shared_experts.up_proj.weight"));
        TRY(add(b, gs, PD_CLASS_II, 1, 1, PD_FMT_BF16, H, Is, "mlp.shared_experts.down_proj.weight"));
    }
    TRY(add(b, ge, PD_CLASS_I, (int)E, 1, PD_FMT_BF16, I, H, "mlp.experts.{e}.gate_proj.weight"));
    TRY(add(b, ge, PD_CLASS_I, (int)E, 1, PD_FMT_BF16, I, H, "mlp.experts.{e}.up_proj.weight"));
    TRY(add(b, ge, PD_CLASS_I, (int)E, 1, PD_FMT_BF16, H, I, "mlp.experts.{e}.down_proj.weight"));
    return 0;
}

static int build_v3(struct builder *b, int include_mtp)
{
    const struct pd_model *m = b->m;
    const int64_t H = m->hidden_size;
    char prefix[40];
    b->prefix = "";
    b->layer = -1;
    TRY(add(b, PD_G_EMBEDDING, PD_CLASS_II, 1, 0, PD_FMT_BF16, m->vocab_size, H, "model.embed_tokens.weight"));
    if (!m->tie_word_embeddings)
        TRY(add(b, PD_G_LM_HEAD, PD_CLASS_II, 1, 0, PD_FMT_BF16, m->vocab_size, H, "lm_head.weight"));
    TRY(add(b, PD_G_NORMS_MHC, PD_CLASS_II, 1, 0, PD_FMT_BF16, H, 0, "model.norm.weight"));
    int last = m->n_layers + (include_mtp ? m->n_mtp_layers : 0);
    for (int l = 0; l < last; l++) {
        int mtp = l >= m->n_layers;
        snprintf(prefix, sizeof prefix, "model.layers.%d.", l);
        b->prefix = prefix;
        b->layer = l;
        if (mtp) {
            /* V3's MTP layer carries its own copies of the embedding and the head. */
            TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 0, PD_FMT_BF16, m->vocab_size, H, "embed_tokens.weight"));
            TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 0, PD_FMT_BF16, H, 0, "enorm.weight"));
            TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 0, PD_FMT_BF16, H, 0, "hnorm.weight"));
            TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 1, PD_FMT_BF16, H, 2 * H, "eh_proj.weight"));
            TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 0, PD_FMT_BF16, H, 0, "shared_head.norm.weight"));
            TRY(add(b, PD_G_MTP, PD_CLASS_II, 1, 0, PD_FMT_BF16, m->vocab_size, H, "shared_head.head.weight"));
        }
        TRY(v3_block(b, l, mtp));
    }
    return 0;
}

static int start(const struct pd_model *m, struct pd_inventory *inv)
{
    memset(inv, 0, sizeof *inv);
    inv->n_experts = m->n_routed_experts;
    inv->expert_bytes = calloc((size_t)inv->n_experts, sizeof *inv->expert_bytes);
    return inv->expert_bytes ? 0 : PD_ENOMEM;
}

int pd_inventory_build(const struct pd_model *m, const struct pd_quant *q, int include_mtp,
                       struct pd_inventory *inv, pd_err *e)
{
    if (start(m, inv))
        return pd_err_set(e, PD_ENOMEM, "inventory: out of memory");
    struct builder b = {.m = m, .q = q, .inv = inv, .e = e};
    for (int i = 0; i < m->n_quantize_groups; i++) {
        enum pd_group g;
        if (pd_group_parse(m->quantize_groups[i], &g)) {
            pd_inventory_free(inv);
            return pd_err_set(e, PD_EINVAL, "%s: field \"pdmoe.quantize_groups[%d]\": unknown group \"%s\"",
                              m->source, i, m->quantize_groups[i]);
        }
        b.quantize_mask |= 1u << g;
    }
    for (int i = 0; i < m->n_extra; i++) {
        enum pd_group g;
        if (pd_group_parse(m->extra[i].group, &g)) {
            pd_inventory_free(inv);
            return pd_err_set(e, PD_EINVAL, "%s: field \"pdmoe.extra_layer_tensors[%d].group\": unknown group \"%s\"",
                              m->source, i, m->extra[i].group);
        }
    }
    int rc = m->arch == PD_ARCH_DEEPSEEK_V4 ? build_v4(&b, include_mtp) : build_v3(&b, include_mtp);
    if (rc) {
        pd_inventory_free(inv);
        return rc == PD_ENOMEM ? pd_err_set(e, rc, "inventory: out of memory") : rc;   /* add() said what */
    }
    for (int l = 0; l < m->n_layers + (include_mtp ? m->n_mtp_layers : 0); l++)
        inv->n_moe_layers += pd_model_is_moe_layer(m, l);
    return 0;
}

void pd_inventory_free(struct pd_inventory *inv)
{
    free(inv->t);
    free(inv->expert_bytes);
    memset(inv, 0, sizeof *inv);
}

const char *pd_inventory_expand_name(const struct pd_tensor *t, int i, char *buf, int n)
{
    const char *p = strstr(t->name, "{e}");
    if (!p)
        snprintf(buf, (size_t)n, "%s", t->name);
    else
        snprintf(buf, (size_t)n, "%.*s%d%s", (int)(p - t->name), t->name, i, p + 3);
    return buf;
}

/* --- classing checkpoint tensor names --- */

static int has(const char *s, const char *sub)
{
    return strstr(s, sub) != NULL;
}

int pd_inventory_classify(const struct pd_model *m, const char *name, enum pd_group *g,
                          enum pd_class *c, int *layer, int *expert)
{
    *c = PD_CLASS_II;
    *layer = -1;
    *expert = -1;
    const char *rest = name;
    int mtp = 0, n;
    if (sscanf(name, "model.layers.%d.%n", layer, &n) == 1 || sscanf(name, "layers.%d.%n", layer, &n) == 1) {
        rest = name + n;
        mtp = *layer >= m->n_layers;
    } else if (sscanf(name, "mtp.%d.%n", layer, &n) == 1) {
        rest = name + n;
        *layer += m->n_layers;
        mtp = 1;
    } else {
        static const struct { const char *name; enum pd_group g; } top[] = {
            {"embed.weight", PD_G_EMBEDDING}, {"model.embed_tokens.weight", PD_G_EMBEDDING},
            {"head.weight", PD_G_LM_HEAD}, {"lm_head.weight", PD_G_LM_HEAD},
            {"norm.weight", PD_G_NORMS_MHC}, {"model.norm.weight", PD_G_NORMS_MHC},
        };
        /* a quantised matrix's scale companion ("head.weight_scale", "head.scale") goes with it */
        char base[96];
        snprintf(base, sizeof base, "%s", name);
        size_t bl = strlen(base);
        if (bl > 6 && strcmp(base + bl - 6, "_scale") == 0)
            base[bl - 6] = 0;
        else if (bl > 6 && strcmp(base + bl - 6, ".scale") == 0)
            snprintf(base + bl - 6, sizeof base - (bl - 6), ".weight");
        for (size_t i = 0; i < sizeof top / sizeof top[0]; i++)
            if (strcmp(base, top[i].name) == 0) {
                *g = top[i].g;
                return 0;
            }
        if (strncmp(name, "hc_head_", 8) == 0) {
            *g = PD_G_NORMS_MHC;
            return 0;
        }
        return PD_EINVAL;
    }
    if (*layer < 0 || *layer >= PD_MAX_LAYERS)
        return PD_EINVAL;
    int e;
    if (sscanf(rest, "ffn.experts.%d.%n", &e, &n) == 1 || sscanf(rest, "mlp.experts.%d.%n", &e, &n) == 1) {
        *expert = e;
        if (e < 0 || e >= m->n_routed_experts)
            return e < 0 ? PD_EINVAL : PD_ERANGE;
        *c = PD_CLASS_I;
        *g = PD_G_ROUTED_EXPERTS;
        return 0;
    }
    if (mtp)
        *g = PD_G_MTP;
    else if (has(rest, "compressor.") || has(rest, "indexer."))
        *g = PD_G_COMPRESSOR;
    else if (strncmp(rest, "attn.", 5) == 0 || strncmp(rest, "self_attn.", 10) == 0)
        *g = PD_G_ATTENTION;
    else if (has(rest, "shared_experts."))
        *g = PD_G_SHARED_EXPERT;
    else if (strncmp(rest, "ffn.gate.", 9) == 0 || strncmp(rest, "mlp.gate.", 9) == 0)
        *g = PD_G_ROUTER;
    else if (strncmp(rest, "mlp.", 4) == 0)
        *g = PD_G_DENSE_FFN;
    else if (has(rest, "norm") || strncmp(rest, "hc_", 3) == 0)
        *g = PD_G_NORMS_MHC;
    else
        return PD_EINVAL;
    return 0;
}

int pd_inventory_from_checkpoint(const struct pd_model *m, const struct pd_st_set *s,
                                 struct pd_inventory *inv, pd_err *e)
{
    if (start(m, inv))
        return pd_err_set(e, PD_ENOMEM, "inventory: out of memory");
    inv->from_checkpoint = 1;
    char seen[PD_MAX_LAYERS] = {0};
    for (size_t f = 0; f < s->nfiles; f++) {
        for (size_t i = 0; i < s->files[f].n; i++) {
            const struct pd_st_tensor *st = &s->files[f].tensors[i];
            enum pd_group g;
            enum pd_class c;
            int layer, expert;
            int rc = pd_inventory_classify(m, st->name, &g, &c, &layer, &expert);
            if (rc == PD_ERANGE) {
                /* a routed expert past the config's count: the config under-states the experts,
                 * and every expert's bytes would be planned short */
                pd_inventory_free(inv);
                return pd_err_set(e, PD_EINVAL, "checkpoint: tensor %s is routed expert %d, but config.json's "
                                  "n_routed_experts is %d: the config does not describe these weights", st->name,
                                  expert, m->n_routed_experts);
            }
            if (rc) {
                if (inv->n_unclassed < PD_INV_MAX_UNCLASSED)
                    pd_text_safe(inv->unclassed[inv->n_unclassed], sizeof inv->unclassed[0], st->name);
                inv->n_unclassed++;
                continue;
            }
            if (grow(inv)) {
                pd_inventory_free(inv);
                return pd_err_set(e, PD_ENOMEM, "inventory: out of memory");
            }
            struct pd_tensor *t = &inv->t[inv->n++];
            memset(t, 0, sizeof *t);
            snprintf(t->name, sizeof t->name, "%s", st->name);
            t->ndim = st->ndim > 2 ? 2 : st->ndim;
            t->params = 1;
            for (int d = 0; d < st->ndim; d++)
                t->params *= st->shape[d];
            t->shape[0] = st->ndim > 0 ? st->shape[0] : 1;
            t->shape[1] = st->ndim > 1 && st->shape[0] > 0 ? t->params / st->shape[0] : 0;   /* (an empty tensor has 0 rows) */
            t->fmt = PD_FMT_RAW;
            t->bytes = (int64_t)(st->end - st->begin);
            t->count = 1;
            t->layer = (int16_t)layer;
            t->group = (uint8_t)g;
            t->cls = (uint8_t)c;
            if (account(inv, t)) {
                pd_err_set(e, PD_ERANGE, "checkpoint: too large: at tensor %s its weights pass 2^50 bytes", st->name);
                pd_inventory_free(inv);
                return PD_ERANGE;
            }
            if (c == PD_CLASS_I) {
                inv->expert_bytes[expert] += t->bytes;
                seen[layer] = 1;
            }
        }
    }
    for (int l = 0; l < PD_MAX_LAYERS; l++)
        inv->n_moe_layers += seen[l];
    /* every routed expert the config counts is in the checkpoint: a config that over-states them
     * planned a placement of experts that do not exist */
    for (int x = 0; x < m->n_routed_experts; x++)
        if (inv->expert_bytes[x] == 0) {
            int held = 0;
            for (int y = 0; y < m->n_routed_experts; y++)
                held += inv->expert_bytes[y] > 0;
            pd_inventory_free(inv);
            return pd_err_set(e, PD_EINVAL, "checkpoint: config.json's n_routed_experts is %d, but the tensors hold %d "
                              "routed experts (none for expert %d): the config does not describe these weights",
                              m->n_routed_experts, held, x);
        }
    return 0;
}

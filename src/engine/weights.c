/* Loading a V4 checkpoint into struct pd_weights, checking every shape against the config. */
#include "engine/weights.h"
#include "engine/release.h"
#include "plan/inventory.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TRY(x) do { int rc_ = (x); if (rc_) return rc_; } while (0)
#define F32(dst, name, n) do { if (!((dst) = pd_load_f32(&w->st, &w->arena, name, n, e))) return e->code; } while (0)

/* Counts the stored bytes of a checkpoint tensor this process loads, by class: what the
 * planner's per-card budget must equal. */
static void acct(struct pd_weights *w, const char *name)
{
    const struct pd_st_tensor *t = pd_st_set_find(&w->st, name);
    if (t)
        w->loaded_bytes[w->cur_class] += (int64_t)(t->end - t->begin);
}

static int lin(struct pd_weights *w, struct pd_linear *l, const char *pfx, const char *suffix, int64_t out,
               int64_t in, pd_err *e)
{
    char name[160], sname[170];
    snprintf(name, sizeof name, "%s%s", pfx, suffix);
    /* a release FP8/FP4 matrix a W8A8 deployment does not quantise (wq_a, wkv, wo_a) runs with
     * its exact values, as that deployment and the official code run it in bf16 (plan/inventory.h) */
    int exact = w->ref || pd_inventory_w8a8_role(name, w->m->dspark) != PD_W8A8_QUANT;
    int rc = pd_linear_load_ref(l, &w->st, &w->arena, name, (int)out, (int)in, exact, e);
    if (rc == 0) {
        acct(w, name);
        snprintf(sname, sizeof sname, "%s_scale", name);
        if (l->q.q)
            acct(w, sname);
        acct(w, pd_release_scale_name(name, sname, sizeof sname));   /* the release's FP8/FP4 scale, if any */
    }
    return rc;
}

static int vec(struct pd_weights *w, float **dst, const char *pfx, const char *suffix, int64_t n, pd_err *e)
{
    char name[160];
    snprintf(name, sizeof name, "%s%s", pfx, suffix);
    *dst = pd_load_f32(&w->st, &w->arena, name, n, e);
    if (*dst)
        acct(w, name);
    return *dst ? 0 : e->code;
}

static int compressor(struct pd_weights *w, struct pd_compressor_w *c, const char *pfx, int ratio, int d, pd_err *e)
{
    const int64_t H = w->m->hidden_size;
    c->ratio = ratio;
    c->coff = ratio == 4 ? 2 : 1;
    c->d = d;
    TRY(lin(w, &c->wkv, pfx, "compressor.wkv.weight", (int64_t)c->coff * d, H, e));
    TRY(lin(w, &c->wgate, pfx, "compressor.wgate.weight", (int64_t)c->coff * d, H, e));
    TRY(vec(w, &c->ape, pfx, "compressor.ape", (int64_t)ratio * c->coff * d, e));
    TRY(vec(w, &c->norm, pfx, "compressor.norm.weight", d, e));
    return 0;
}

static int expert(struct pd_weights *w, struct pd_expert_w *x, const char *pfx, int64_t inter, pd_err *e)
{
    const int64_t H = w->m->hidden_size;
    TRY(lin(w, &x->w1, pfx, "w1.weight", inter, H, e));
    TRY(lin(w, &x->w2, pfx, "w2.weight", H, inter, e));
    TRY(lin(w, &x->w3, pfx, "w3.weight", inter, H, e));
    return 0;
}

/* One block: layer l ("layers.l.") or, for l >= n_layers, the MTP layer ("mtp.(l - n_layers)."). */
static int layer(struct pd_weights *w, struct pd_layer_w *L, int l, const unsigned char *has_expert, pd_err *e)
{
    const struct pd_model *m = w->m;
    const int64_t H = m->hidden_size, hc = m->hc_mult, mix = (2 + hc) * hc;
    const int64_t qdim = (int64_t)m->n_heads * m->head_dim;
    char p[64], q[96];
    if (l < m->n_layers)
        snprintf(p, sizeof p, "layers.%d.", l);
    else
        snprintf(p, sizeof p, "mtp.%d.", l - m->n_layers);
    L->ratio = m->compress_ratio[l];
    TRY(vec(w, &L->attn_norm, p, "attn_norm.weight", H, e));
    TRY(vec(w, &L->ffn_norm, p, "ffn_norm.weight", H, e));
    TRY(vec(w, &L->hc_attn_fn, p, "hc_attn_fn", mix * hc * H, e));
    TRY(vec(w, &L->hc_attn_base, p, "hc_attn_base", mix, e));
    TRY(vec(w, &L->hc_attn_scale, p, "hc_attn_scale", 3, e));
    TRY(vec(w, &L->hc_ffn_fn, p, "hc_ffn_fn", mix * hc * H, e));
    TRY(vec(w, &L->hc_ffn_base, p, "hc_ffn_base", mix, e));
    TRY(vec(w, &L->hc_ffn_scale, p, "hc_ffn_scale", 3, e));
    TRY(lin(w, &L->wq_a, p, "attn.wq_a.weight", m->q_lora_rank, H, e));
    TRY(vec(w, &L->q_norm, p, "attn.q_norm.weight", m->q_lora_rank, e));
    TRY(lin(w, &L->wq_b, p, "attn.wq_b.weight", qdim, m->q_lora_rank, e));
    TRY(lin(w, &L->wkv, p, "attn.wkv.weight", m->head_dim, H, e));
    TRY(vec(w, &L->kv_norm, p, "attn.kv_norm.weight", m->head_dim, e));
    TRY(lin(w, &L->wo_a, p, "attn.wo_a.weight", (int64_t)m->o_groups * m->o_lora_rank, qdim / m->o_groups, e));
    TRY(lin(w, &L->wo_b, p, "attn.wo_b.weight", H, (int64_t)m->o_groups * m->o_lora_rank, e));
    TRY(vec(w, &L->attn_sink, p, "attn.attn_sink", m->n_heads, e));
    if (L->ratio > 0) {
        snprintf(q, sizeof q, "%sattn.", p);
        TRY(compressor(w, &L->cmp, q, L->ratio, m->head_dim, e));
        if (L->ratio == 4) {
            snprintf(q, sizeof q, "%sattn.indexer.", p);
            TRY(compressor(w, &L->idx_cmp, q, L->ratio, m->index_head_dim, e));
            TRY(lin(w, &L->idx_wq_b, p, "attn.indexer.wq_b.weight", (int64_t)m->index_n_heads * m->index_head_dim,
                    m->q_lora_rank, e));
            TRY(lin(w, &L->idx_weights, p, "attn.indexer.weights_proj.weight", m->index_n_heads, H, e));
        }
    }
    const int64_t E = m->n_routed_experts, I = m->moe_intermediate_size;
    /* the router scores in fp32, whatever the checkpoint stores (a bf16 gate read in place and
     * widened as it is read: the same values in half the bytes) */
    snprintf(q, sizeof q, "%sffn.gate.weight", p);
    TRY(pd_linear_load_float(&L->gate, &w->st, &w->arena, q, (int)E, (int)H, e));
    acct(w, q);
    if (l < m->num_hash_layers) {
        snprintf(q, sizeof q, "%sffn.gate.tid2eid", p);
        const struct pd_st_tensor *t = pd_st_set_find(&w->st, q);
        if (!t || t->ndim != 2 || t->shape[0] != m->vocab_size || t->shape[1] != m->n_experts_per_tok ||
            (t->dtype != PD_ST_I64 && t->dtype != PD_ST_I32))
            return pd_err_set(e, PD_EFORMAT, "checkpoint: tensor \"%s\" missing or not an integer [%lld, %d] table", q,
                              (long long)m->vocab_size, m->n_experts_per_tok);
        int64_t n = m->vocab_size * m->n_experts_per_tok;
        L->tid2eid = pd_arena_alloc(&w->arena, (size_t)n * sizeof *L->tid2eid);
        if (!L->tid2eid)
            return pd_err_set(e, PD_ENOMEM, "checkpoint: out of memory");
        for (int64_t i = 0; i < n; i++) {
            int64_t v;
            if (t->dtype == PD_ST_I64)
                memcpy(&v, (const char *)t->data + 8 * i, 8);
            else {
                int32_t v32;
                memcpy(&v32, (const char *)t->data + 4 * i, 4);
                v = v32;
            }
            if (v < 0 || v >= E)
                return pd_err_set(e, PD_EFORMAT, "checkpoint: tensor \"%s\" entry %lld is expert %lld, outside [0, %lld)",
                                  q, (long long)i, (long long)v, (long long)E);
            L->tid2eid[i] = (int32_t)v;
        }
        acct(w, q);
    } else {
        TRY(vec(w, &L->gate_bias, p, "ffn.gate.bias", E, e));
    }
    if (m->n_shared_experts > 0) {
        snprintf(q, sizeof q, "%sffn.shared_experts.", p);
        TRY(expert(w, &L->shared, q, I * m->n_shared_experts, e));
    }
    L->experts = pd_arena_alloc(&w->arena, (size_t)E * sizeof *L->experts);
    if (!L->experts)
        return pd_err_set(e, PD_ENOMEM, "checkpoint: out of memory");
    memset(L->experts, 0, (size_t)E * sizeof *L->experts);
    w->cur_class = 0;
    for (int x = 0; x < E; x++) {
        if (has_expert && !has_expert[x])
            continue;
        snprintf(q, sizeof q, "%sffn.experts.%d.", p, x);
        TRY(expert(w, &L->experts[x], q, I, e));
    }
    w->cur_class = 1;
    return 0;
}

int pd_weights_load(struct pd_weights *w, const struct pd_model *m, const char *dir,
                    const unsigned char *has_expert, pd_err *e)
{
    return pd_weights_load_ref(w, m, dir, has_expert, 0, e);
}

/* FNV-1a over n floats' bytes, from h. */
static uint64_t fnv_floats(uint64_t h, const float *v, int64_t n)
{
    const unsigned char *b = (const unsigned char *)v;
    for (int64_t i = 0; v && i < n * (int64_t)sizeof *v; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* weights.h, pd_weights.fingerprint. */
static uint64_t fingerprint(const struct pd_weights *w)
{
    const struct pd_model *m = w->m;
    uint64_t h = fnv_floats(0xcbf29ce484222325ull, w->norm, m->hidden_size);
    for (int l = 0; l < m->n_layers; l++) {
        const struct pd_layer_w *L = &w->layers[l];
        h = fnv_floats(h, L->attn_norm, m->hidden_size);
        h = fnv_floats(h, L->ffn_norm, m->hidden_size);
        h = fnv_floats(h, L->q_norm, m->q_lora_rank);
        h = fnv_floats(h, L->kv_norm, m->head_dim);
    }
    return h;
}

int pd_weights_load_ref(struct pd_weights *w, const struct pd_model *m, const char *dir,
                        const unsigned char *has_expert, int ref, pd_err *e)
{
    memset(w, 0, sizeof *w);
    w->m = m;
    w->ref = ref;
    if (m->arch != PD_ARCH_DEEPSEEK_V4)
        return pd_err_set(e, PD_EINVAL, "%s: the engine runs deepseek_v4 models, this is %s", dir,
                          pd_model_arch_name(m->arch));
    int rc = pd_st_open_dir(dir, 0, &w->st, e);
    if (rc)
        return rc;
    const int64_t H = m->hidden_size, hc = m->hc_mult;
    const struct pd_st_tensor *t = pd_st_set_find(&w->st, "embed.weight");
    if (!t || t->dtype != PD_ST_BF16 || t->ndim != 2 || t->shape[0] != m->vocab_size || t->shape[1] != H) {
        rc = pd_err_set(e, PD_EFORMAT, "%s: tensor \"embed.weight\" missing or not bf16 [%lld, %lld]", dir,
                        (long long)m->vocab_size, (long long)H);
        goto fail;
    }
    if ((rc = pd_check_finite_bf16(&w->st, t, "embed.weight", e)))
        goto fail;   /* (the message names the file) */
    w->embed = t->data;
    w->cur_class = 1;
    acct(w, "embed.weight");
    w->layers = pd_arena_alloc(&w->arena, (size_t)m->n_layers * sizeof *w->layers);
    if (!w->layers) {
        rc = pd_err_set(e, PD_ENOMEM, "out of memory");
        goto fail;
    }
    memset(w->layers, 0, (size_t)m->n_layers * sizeof *w->layers);
    if (m->tie_word_embeddings && pd_st_set_find(&w->st, "head.weight"))
        /* tied, the output head is the embedding: a head of its own would go unread */
        rc = pd_err_set(e, PD_EINVAL, "config.json says tie_word_embeddings true, but the checkpoint has its own "
                        "head.weight, which would go unused: set it false, or drop the tensor");   /* (dir: below) */
    else if (m->tie_word_embeddings)
        rc = pd_linear_load_ref(&w->head, &w->st, &w->arena, "embed.weight", (int)m->vocab_size, (int)H, ref, e);
    else
        rc = lin(w, &w->head, "", "head.weight", m->vocab_size, H, e);
    if (!rc)
        rc = vec(w, &w->norm, "", "norm.weight", H, e);
    if (!rc)
        rc = vec(w, &w->hc_head_fn, "", "hc_head_fn", hc * hc * H, e);
    if (!rc)
        rc = vec(w, &w->hc_head_base, "", "hc_head_base", hc, e);
    if (!rc)
        rc = vec(w, &w->hc_head_scale, "", "hc_head_scale", 1, e);
    for (int l = 0; l < m->n_layers && !rc; l++)
        rc = layer(w, &w->layers[l], l, has_expert, e);
    /* the MTP layer, when the checkpoint has one: loaded (its bytes count) but not run yet */
    if (!rc && m->n_mtp_layers > 0 && pd_st_set_find(&w->st, "mtp.0.e_proj.weight")) {
        struct pd_mtp_w *mt = &w->mtp;
        w->has_mtp = 1;
        if (!(rc = lin(w, &mt->e_proj, "mtp.0.", "e_proj.weight", H, H, e)) &&
            !(rc = lin(w, &mt->h_proj, "mtp.0.", "h_proj.weight", H, H, e)) &&
            !(rc = vec(w, &mt->enorm, "mtp.0.", "enorm.weight", H, e)) && !(rc = vec(w, &mt->hnorm, "mtp.0.", "hnorm.weight", H, e)) &&
            !(rc = vec(w, &mt->norm, "mtp.0.", "norm.weight", H, e)) &&
            !(rc = vec(w, &mt->hc_head_fn, "mtp.0.", "hc_head_fn", hc * hc * H, e)) &&
            !(rc = vec(w, &mt->hc_head_base, "mtp.0.", "hc_head_base", hc, e)) &&
            !(rc = vec(w, &mt->hc_head_scale, "mtp.0.", "hc_head_scale", 1, e)))
            rc = layer(w, &mt->block, m->n_layers, has_expert, e);
    }
    if (rc) {
        pd_err_prefix(e, "%s: ", dir);
        goto fail;
    }
    /* every tensor is one the engine read (an EP rank reads its own experts only): a tensor nobody
     * reads is another model's, a bias or a layer this program does not implement, or a layer past
     * num_hidden_layers, and the model run would not be the file's. The MTP layer is a draft head
     * apart: a config without it (num_nextn_predict_layers 0) leaves its tensors aside, as vLLM's
     * loader skips the speculative layers' weights */
    const char *first, *file;
    size_t unused = has_expert ? 0 : pd_st_set_unused(&w->st, m->n_mtp_layers ? NULL : "mtp.", &first, &file);
    if (unused) {
        rc = pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\" is not one the engine reads for this config.json (%zu "
                        "such tensor%s: another model's, a bias or a layer it does not implement, an expert or a "
                        "layer past the config's counts)", file, first, unused, unused == 1 ? "" : "s");
        goto fail;
    }
    w->fingerprint = fingerprint(w);
    return 0;
fail:
    pd_weights_free(w);
    return rc;
}

void pd_weights_free(struct pd_weights *w)
{
    pd_arena_free(&w->arena);
    pd_st_close_dir(&w->st);
    memset(w, 0, sizeof *w);
}

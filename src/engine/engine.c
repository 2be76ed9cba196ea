/* The V4 forward pass: embedding, mHC around each sublayer, the output head; the step loop.
 * Attention is in attention.c, the MoE in moe.c. Equations: shared/reference/
 * deepseek-v4-architecture.md; every step here names the one it implements. */
#include "engine/internal.h"
#include "kernels/gemm.h"
#include "kernels/quant.h"
#include "kernels/vec.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void *pd_scratch(struct pd_engine *en, int slot, size_t bytes, pd_err *e)
{
    assert(slot > 0 && slot < PD_ENGINE_SCRATCH);
    struct pd_scratch_buf *b = &en->scratch[slot];
    if (!b->p || b->cap < bytes) {
        /* grow by half again: steps of slightly different sizes do not reallocate */
        size_t cap = bytes + bytes / 2 + 64;
        void *p = NULL;
        if (posix_memalign(&p, 64, cap)) {
            pd_err_set(e, PD_ENOMEM, "engine: out of memory for %zu bytes of scratch", bytes);
            return NULL;
        }
        free(b->p);
        b->p = p;
        b->cap = cap;
    }
    return b->p;
}

int pd_engine_open(struct pd_engine *en, const struct pd_engine_opts *o, pd_err *e)
{
    memset(en, 0, sizeof *en);
    en->ref = o->ref;
    int rc = pd_model_load(o->dir, &en->model, e);
    if (rc)
        return rc;
    const struct pd_model *m = &en->model;
    if (m->arch != PD_ARCH_DEEPSEEK_V4)
        return pd_err_set(e, PD_EINVAL, "%s: the engine runs deepseek_v4 models, this is %s", o->dir,
                          pd_model_arch_name(m->arch));
    if (m->qk_rope_head_dim > 512 || (m->index_head_dim && m->qk_rope_head_dim > m->index_head_dim))
        return pd_err_set(e, PD_EINVAL, "%s: qk_rope_head_dim %d must be at most 512 and index_head_dim", o->dir,
                          m->qk_rope_head_dim);
    if (m->index_head_dim > 0 && (m->index_head_dim & (m->index_head_dim - 1)))
        return pd_err_set(e, PD_EINVAL, "%s: index_head_dim %d must be a power of two (the indexer's Hadamard rotation)",
                          o->dir, m->index_head_dim);
    if ((rc = pd_weights_load(&en->w, m, o->dir, o->has_expert, e)))
        return rc;
    int64_t max_len = o->max_model_len > 0 ? o->max_model_len : 4096;
    int max_seqs = o->max_seqs > 0 ? o->max_seqs : 16;
    int block = o->block_entries > 0 ? o->block_entries : 16;
    size_t bytes = (size_t)o->kv_bytes;
    if (!bytes) {
        /* room for every sequence at max_model_len, plus two blocks per layer of slack */
        size_t eb, kb;
        pd_kvpool_entry_bytes(m, o->kv_dtype, &eb, &kb);
        double per_tok = 0;
        for (int l = 0; l < m->n_layers; l++) {
            int r = m->compress_ratio[l];
            if (r)
                per_tok += (double)(eb + (r == 4 ? kb : 0)) / r;
        }
        size_t slot = 0;
        for (int l = 0; l < m->n_layers; l++) {
            int r = m->compress_ratio[l], coff = r == 4 ? 2 : 1;
            slot += (size_t)m->sliding_window * eb;
            if (r)
                slot += 2 * (size_t)coff * r * coff * m->head_dim * 4;
            if (r == 4)
                slot += 2 * (size_t)coff * r * coff * m->index_head_dim * 4;
        }
        /* the pool may round a block up to whole keys: count the slack at twice the blocks asked */
        bytes = (size_t)max_seqs * (slot + (size_t)(per_tok * (double)max_len) +
                                    (size_t)m->n_layers * 2 * (size_t)(2 * block) * eb);
    }
    if ((rc = pd_kvpool_init(&en->kv, m, o->kv_dtype, max_seqs, bytes, block, e)))
        goto fail;
    int threads = o->threads > 0 ? o->threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (threads > 1 && (rc = pd_pool_create(threads, &en->pool, e)))
        goto fail;
    pd_rope_init(&en->rope_window, m->qk_rope_head_dim, m->rope_theta, 1, 0, 0, 0);
    const struct pd_rope_scaling *y = &m->rope_scaling;
    pd_rope_init(&en->rope_compress, m->qk_rope_head_dim, m->compress_rope_theta, y->yarn ? y->factor : 1,
                 y->original_max_position_embeddings, y->beta_fast, y->beta_slow);
    en->rope_index = en->rope_compress;
    en->layer_rms = calloc((size_t)m->n_layers, sizeof *en->layer_rms);
    en->expert_tokens = calloc((size_t)m->n_layers * m->n_routed_experts, sizeof *en->expert_tokens);
    if (!en->layer_rms || !en->expert_tokens) {
        rc = pd_err_set(e, PD_ENOMEM, "engine: out of memory");
        goto fail;
    }
    return 0;
fail:
    pd_engine_close(en);
    return rc;
}

void pd_engine_close(struct pd_engine *en)
{
    pd_pool_destroy(en->pool);
    pd_kvpool_free(&en->kv);
    pd_weights_free(&en->w);
    free(en->layer_rms);
    free(en->expert_tokens);
    for (int i = 0; i < PD_ENGINE_SCRATCH; i++)
        free(en->scratch[i].p);
    memset(en, 0, sizeof *en);
}

int pd_seq_start(struct pd_engine *en, struct pd_seq *s, pd_err *e)
{
    s->pos = 0;
    return pd_kvseq_alloc(&en->kv, &s->kv, e);
}

void pd_seq_end(struct pd_engine *en, struct pd_seq *s)
{
    pd_kvseq_free(&en->kv, &s->kv);
    s->pos = 0;
}

/* mHC "pre": the 2*hc + hc*hc mixing values of one token, then
 *   pre  = sigmoid(mix[0:hc] * scale[0] + base[0:hc]) + hc_eps
 *   post = 2 * sigmoid(mix[hc:2hc] * scale[1] + base[hc:2hc])
 *   comb = Sinkhorn(mix[2hc:] * scale[2] + base[2hc:])          (hc x hc)
 *   x    = sum_j pre_j * h_j                                      */
void pd_mhc_pre(const struct pd_model *m, const float *h, const float *fn, const float *base,
                   const float *scale, float *x, float *post, float *comb)
{
    const int hc = m->hc_mult, H = (int)m->hidden_size, n = hc * H, mixn = (2 + hc) * hc;
    float r = (float)(1.0 / sqrt((double)pd_dot(h, h, n) / n + m->rms_norm_eps));
    float mix[4 * 64 + 64];
    pd_dot_rows(fn, (size_t)n, h, n, mixn, mix);
    for (int k = 0; k < mixn; k++)
        mix[k] *= r;
    float pre[64] = {0};
    for (int j = 0; j < hc; j++) {
        pre[j] = pd_sigmoid(mix[j] * scale[0] + base[j]) + (float)m->hc_eps;
        post[j] = 2 * pd_sigmoid(mix[hc + j] * scale[1] + base[hc + j]);
    }
    for (int k = 0; k < hc * hc; k++)
        comb[k] = mix[2 * hc + k] * scale[2] + base[2 * hc + k];
    pd_sinkhorn(comb, hc, m->hc_sinkhorn_iters, (float)m->hc_eps);
    pd_scale_axpys(pre[0], h, pre + 1, h + H, (size_t)H, hc - 1, x, H);
}

/* mHC "post": h_k = post_k * out + sum_j comb[j][k] * h_j; tmp holds hc * hidden floats */
void pd_mhc_post(const struct pd_model *m, float *h, const float *out, const float *post, const float *comb,
                    float *tmp)
{
    const int hc = m->hc_mult, H = (int)m->hidden_size;
    for (int k = 0; k < hc; k++) {
        float c[64];
        for (int j = 0; j < hc; j++)
            c[j] = comb[j * hc + k];
        pd_scale_axpys(post[k], out, c, h, (size_t)H, hc, tmp + (size_t)k * H, H);
    }
    memcpy(h, tmp, (size_t)hc * H * sizeof(float));
}

/* One sublayer wrapped in mHC, for every token of the step. */
static int sublayer(struct pd_step *st, int layer, int ffn, pd_err *e)
{
    struct pd_engine *en = st->en;
    const struct pd_model *m = &en->model;
    const struct pd_layer_w *L = &en->w.layers[layer];
    const int H = (int)m->hidden_size, hc = m->hc_mult;
    for (int t = 0; t < st->T; t++) {
        float *x = st->x + (size_t)t * H;
        pd_mhc_pre(m, st->h + (size_t)t * hc * H, ffn ? L->hc_ffn_fn : L->hc_attn_fn, ffn ? L->hc_ffn_base : L->hc_attn_base,
               ffn ? L->hc_ffn_scale : L->hc_attn_scale, x, st->post + (size_t)t * hc, st->comb + (size_t)t * hc * hc);
        pd_rmsnorm(x, ffn ? L->ffn_norm : L->attn_norm, (float)m->rms_norm_eps, H, x);
    }
    if (!en->ref)
        pd_quant_rows_pool(en->pool, st->x, st->T, H, (int8_t *)st->xq.q, (float *)st->xq.scale);
    int rc = ffn ? pd_moe_layer(st, layer, e) : pd_attention_layer(st, layer, e);
    if (rc)
        return rc;
    float *tmp = pd_scratch(en, 48, (size_t)hc * H * sizeof(float), e);
    if (!tmp)
        return PD_ENOMEM;
    for (int t = 0; t < st->T; t++)
        pd_mhc_post(m, st->h + (size_t)t * hc * H, st->out + (size_t)t * H, st->post + (size_t)t * hc,
                st->comb + (size_t)t * hc * hc, tmp);
    return 0;
}

/* Output head: mHC pre-weights (sigmoid, no Sinkhorn) sum the streams, then norm, then lm_head. */
static int head(struct pd_step *st, float *x, int t, float *logits, pd_err *e)
{
    struct pd_engine *en = st->en;
    const struct pd_model *m = &en->model;
    const int H = (int)m->hidden_size, hc = m->hc_mult, n = hc * H;
    const float *h = st->h + (size_t)t * n;
    float r = (float)(1.0 / sqrt((double)pd_dot(h, h, n) / n + m->rms_norm_eps)), pre[64], mix[64];
    pd_dot_rows(en->w.hc_head_fn, (size_t)n, h, n, hc, mix);
    for (int j = 0; j < hc; j++)
        pre[j] = pd_sigmoid(mix[j] * r * en->w.hc_head_scale[0] + en->w.hc_head_base[j]) + (float)m->hc_eps;
    pd_weighted_sum(pre, h, (size_t)H, hc, NULL, x, H);
    pd_rmsnorm(x, en->w.norm, (float)m->rms_norm_eps, H, x);
    return pd_linear_fwd(&en->w.head, en->pool, en->ref, x, 1, logits, st->qbuf, st->sbuf, e);
}

static int max_in(const struct pd_model *m)
{
    int64_t v[] = {m->hidden_size, m->q_lora_rank, (int64_t)m->n_heads * m->head_dim / m->o_groups,
                   (int64_t)m->o_groups * m->o_lora_rank, m->moe_intermediate_size * (m->n_shared_experts > 1 ? m->n_shared_experts : 1)};
    int64_t x = 0;
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
        x = v[i] > x ? v[i] : x;
    return (int)x;
}

int pd_engine_step(struct pd_engine *en, struct pd_step_item *items, int n_items, pd_err *e)
{
    const struct pd_model *m = &en->model;
    const int H = (int)m->hidden_size, hc = m->hc_mult;
    struct pd_step st = {.en = en, .items = items, .n_items = n_items};
    for (int i = 0; i < n_items; i++) {
        if (items[i].n < 1)
            return pd_err_set(e, PD_EINVAL, "engine step: item %d has no tokens", i);
        for (int k = 0; k < items[i].n; k++)
            if (items[i].tokens[k] < 0 || items[i].tokens[k] >= m->vocab_size)
                return pd_err_set(e, PD_EINVAL, "engine step: token %d is outside the vocabulary [0, %lld)",
                                  items[i].tokens[k], (long long)m->vocab_size);
        for (int j = 0; j < i; j++)
            if (items[j].seq == items[i].seq)
                return pd_err_set(e, PD_EINVAL, "engine step: a sequence appears twice in one step");
        st.T += items[i].n;
    }
    /* KV for the new tokens first: on failure nothing has advanced */
    for (int i = 0; i < n_items; i++) {
        int rc = pd_kvseq_reserve(&en->kv, &items[i].seq->kv, items[i].seq->pos + items[i].n, e);
        if (rc)
            return rc;
    }
    const int T = st.T;
    st.max_in = max_in(m);
    int rc = PD_ENOMEM;
    st.item_of = pd_scratch(en, 1, (size_t)T * sizeof(int), e);
    st.pos = pd_scratch(en, 2, (size_t)T * sizeof(int64_t), e);
    st.token = pd_scratch(en, 3, (size_t)T * sizeof(int32_t), e);
    st.h = pd_scratch(en, 4, (size_t)T * hc * H * sizeof(float), e);
    st.x = pd_scratch(en, 5, (size_t)T * H * sizeof(float), e);
    st.out = pd_scratch(en, 6, (size_t)T * H * sizeof(float), e);
    st.post = pd_scratch(en, 7, (size_t)T * hc * sizeof(float), e);
    st.comb = pd_scratch(en, 8, (size_t)T * hc * hc * sizeof(float), e);
    st.qbuf = pd_scratch(en, 9, (size_t)T * st.max_in, e);
    st.sbuf = pd_scratch(en, 10, (size_t)T * sizeof(float), e);
    int8_t *xq = pd_scratch(en, 47, (size_t)T * H, e);
    float *xs = pd_scratch(en, 49, (size_t)T * sizeof(float), e);
    st.xq = (pd_qmat){.q = xq, .scale = xs, .rows = T, .cols = H};
    const int rd = m->qk_rope_head_dim;
    st.cs_window = pd_scratch(en, 44, (size_t)T * rd * sizeof(float), e);
    st.cs_compress = pd_scratch(en, 45, (size_t)T * rd * sizeof(float), e);
    if (!st.item_of || !st.pos || !st.token || !st.h || !st.x || !st.out || !st.post || !st.comb || !st.qbuf || !st.sbuf ||
        !st.cs_window || !st.cs_compress || !xq || !xs)
        goto out;
    /* embedding, copied into the hc streams */
    for (int i = 0, t = 0; i < n_items; i++)
        for (int k = 0; k < items[i].n; k++, t++) {
            st.item_of[t] = i;
            st.pos[t] = items[i].seq->pos + k;
            st.token[t] = items[i].tokens[k];
            float *h = st.h + (size_t)t * hc * H;
            pd_bf16_row((const char *)en->w.embed + (size_t)st.token[t] * H * 2, h, (size_t)H);
            for (int j = 1; j < hc; j++)
                memcpy(h + (size_t)j * H, h, (size_t)H * sizeof(float));
            pd_rope_cs(&en->rope_window, st.pos[t], st.cs_window + (size_t)t * rd);
            pd_rope_cs(&en->rope_compress, st.pos[t], st.cs_compress + (size_t)t * rd);
        }
    for (int l = 0; l < m->n_layers; l++) {
        if ((rc = sublayer(&st, l, 0, e)) || (rc = sublayer(&st, l, 1, e)))
            goto out;
        if (en->trace_norms) {
            double ss = 0;
            for (size_t i = 0; i < (size_t)T * hc * H; i++)
                ss += (double)st.h[i] * st.h[i];
            en->layer_rms[l] = sqrt(ss / ((double)T * hc * H));
        }
    }
    for (int i = 0, t = 0; i < n_items; i++) {
        for (int k = 0; k < items[i].n; k++, t++) {
            float *dst = items[i].all_logits ? items[i].all_logits + (size_t)k * m->vocab_size
                         : k == items[i].n - 1 ? items[i].logits : NULL;
            if (!dst)
                continue;
            if ((rc = head(&st, st.x, t, dst, e)))
                goto out;
            if (items[i].logits && items[i].all_logits && k == items[i].n - 1)
                memcpy(items[i].logits, dst, (size_t)m->vocab_size * sizeof(float));
        }
    }
    for (int i = 0; i < n_items; i++) {
        items[i].seq->pos += items[i].n;
        items[i].seq->kv.len = items[i].seq->pos;
    }
    rc = 0;
out:
    return rc;
}

/* The V4 forward pass: embedding, mHC around each sublayer, the output head; the step loop.
 * Attention is in attention.c, the MoE in moe.c. Equations: shared/reference/
 * deepseek-v4-architecture.md; every step here names the one it implements. */
#include "core/mem.h"
#include "core/units.h"
#include "engine/internal.h"
#include "engine/prefix.h"
#include "kernels/dot_gemm.h"
#include "kernels/gemm.h"
#include "kernels/quant.h"
#include "kernels/vec.h"

#include <assert.h>
#include <math.h>
#include <stdio.h>
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

/* The KV pool is allocated untouched and fills as requests come: a pool past the memory left once
 * the weights are in would be taken page by page under load until the kernel's OOM killer ended
 * the process, or swap slowed every step, hours later rather than at start (vLLM refuses a KV
 * cache its device cannot hold at start too). Checked before the allocation, which the kernel
 * may grant anyway (and a sanitizer's allocator aborts on). */
static int pool_fits_memory(size_t bytes, int copies, pd_err *e)
{
    struct pd_mem_short m;
    if (copies < 1 || pd_mem_fits((int64_t)bytes, copies, &m))
        return 0;
    char a[32], each[64] = "";
    pd_units_fmt_g(a, sizeof a, (int64_t)bytes, PD_UNITS_GB, 2);
    if (copies > 1)
        snprintf(each, sizeof each, " in each of the %d processes of this host", copies);
    return pd_err_set(e, PD_EINVAL, "the KV pool of %s%s is more than the %s of memory left with the weights loaded "
                      "(%s): it would fill under load until the OOM killer ended the process; at most %s", a, each,
                      m.left, m.where, m.each_max);
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
    /* the router the engine runs (moe.c) is V4's: sqrt(softplus) scores, the bias used only to
     * choose; a config asking for another one is refused rather than run as V4's */
    if (m->scoring_func != PD_SCORE_SQRTSOFTPLUS || !m->noaux_tc)
        return pd_err_set(e, PD_EINVAL, "%s: config.json: the engine's router is DeepSeek-V4's (scoring_func "
                          "\"sqrtsoftplus\", topk_method \"noaux_tc\"); this model's %s is not implemented", o->dir,
                          m->scoring_func != PD_SCORE_SQRTSOFTPLUS ? "scoring_func" : "topk_method");
    if (m->n_mtp_layers > 1 && !m->dspark)
        return pd_err_set(e, PD_EINVAL, "%s: config.json: num_nextn_predict_layers %d: the engine runs one MTP layer "
                          "(mtp.0), as DeepSeek-V4 has", o->dir, m->n_mtp_layers);
    if (m->qk_rope_head_dim > 512 || (m->index_head_dim && m->qk_rope_head_dim > m->index_head_dim))
        return pd_err_set(e, PD_EINVAL, "%s: qk_rope_head_dim %d must be at most 512 and index_head_dim", o->dir,
                          m->qk_rope_head_dim);
    if (m->index_head_dim > 0 && (m->index_head_dim & (m->index_head_dim - 1)))
        return pd_err_set(e, PD_EINVAL, "%s: index_head_dim %d must be a power of two (the indexer's Hadamard rotation)",
                          o->dir, m->index_head_dim);
    /* sizes the engine's buffers of one token hold: a config past them is refused here rather than
     * run past a buffer's end (the config's own bounds are far wider) */
    const struct {
        const char *field, *why;
        int64_t v, max;
    } lim[] = {
        {"head_dim", "a compressed entry and an fp8 cache entry of one token are quantised in 2,048-value buffers",
         m->head_dim, 2048},
        {"index_head_dim", "an indexer key is widened into a token's head_dim-value key rows, and an fp8 cache's "
         "key quantised in a 1,024-value buffer", m->index_head_dim, m->head_dim < 1024 ? m->head_dim : 1024},
        {"index_n_heads", "the indexer's head weights of a token are a 256-value buffer", m->index_n_heads, 256},
        {"n_routed_experts", "the router's candidates of a token are 4,096-value buffers", m->n_routed_experts, 4096},
    };
    for (size_t i = 0; i < sizeof lim / sizeof lim[0]; i++)
        if (lim[i].v > lim[i].max)
            return pd_err_set(e, PD_EINVAL, "%s: config.json: field \"%s\": %lld; the engine runs at most %lld (%s)",
                              o->dir, lim[i].field, (long long)lim[i].v, (long long)lim[i].max, lim[i].why);
    if ((rc = pd_weights_load_ref(&en->w, m, o->dir, o->has_expert, o->ref, e)))
        return rc;
    if (o->mtp && !en->w.has_mtp) {
        pd_weights_free(&en->w);
        return pd_err_set(e, PD_EINVAL, "%s: MTP asked for, but the checkpoint has no MTP layer (%s)", o->dir,
                          m->dspark ? "its draft is DSpark (dspark_* fields), which the engine does not run"
                          : m->n_mtp_layers ? "no tensor mtp.0.e_proj.weight" : "num_nextn_predict_layers is 0");
    }
    en->mtp = o->mtp;
    const int nl = m->n_layers + (en->mtp ? 1 : 0);   /* KV layers: the MTP layer's is the last */
    int64_t max_len = o->max_model_len > 0 ? o->max_model_len : 4096;
    int max_seqs = o->max_seqs > 0 ? o->max_seqs : 16;
    int block = o->block_entries > 0 ? o->block_entries : PD_KV_BLOCK_ENTRIES;
    size_t bytes = (size_t)o->kv_bytes;
    if (!bytes) {
        /* room for every sequence at max_model_len, plus two blocks per layer of slack */
        size_t eb, kb;
        pd_kvpool_entry_bytes(m, o->kv_dtype, &eb, &kb);
        double per_tok = 0;
        for (int l = 0; l < nl; l++) {
            int r = m->compress_ratio[l];
            if (r)
                per_tok += (double)(eb + (r == 4 ? kb : 0)) / r;
        }
        size_t slot = 0;
        for (int l = 0; l < nl; l++) {
            int r = m->compress_ratio[l], coff = r == 4 ? 2 : 1;
            slot += (size_t)m->sliding_window * eb;
            if (r)
                slot += 2 * (size_t)coff * r * coff * m->head_dim * 4;
            if (r == 4)
                slot += 2 * (size_t)coff * r * coff * m->index_head_dim * 4;
        }
        /* the pool may round a block up to whole keys: count the slack at twice the blocks asked */
        bytes = (size_t)max_seqs * (slot + (size_t)(per_tok * (double)max_len) +
                                    (size_t)nl * 2 * (size_t)(2 * block) * eb);
    }
    if ((rc = pool_fits_memory(bytes, o->pool_copies, e)) ||
        (rc = pd_kvpool_init_layers(&en->kv, m, nl, o->kv_dtype, max_seqs, bytes, block, e))) {
        if (o->pool_source)
            pd_err_prefix(e, "%s: ", o->pool_source);
        goto fail;
    }
    int threads = o->threads > 0 ? o->threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (threads > 1 && (rc = pd_pool_create(threads, &en->pool, e)))
        goto fail;
    pd_rope_init(&en->rope_window, m->qk_rope_head_dim, m->rope_theta, 1, 0, 0, 0);
    const struct pd_rope_scaling *y = &m->rope_scaling;
    pd_rope_init(&en->rope_compress, m->qk_rope_head_dim, m->compress_rope_theta, y->yarn ? y->factor : 1,
                 y->original_max_position_embeddings, y->beta_fast, y->beta_slow);
    en->rope_index = en->rope_compress;
    en->layer_rms = calloc((size_t)m->n_layers, sizeof *en->layer_rms);
    en->expert_tokens = calloc((size_t)nl * m->n_routed_experts, sizeof *en->expert_tokens);
    if (!en->layer_rms || !en->expert_tokens) {
        rc = pd_err_set(e, PD_ENOMEM, "engine: out of memory");
        goto fail;
    }
    return 0;
fail:
    pd_engine_close(en);
    return rc;
}

pd_pool *pd_engine_swap_pool(struct pd_engine *en, pd_pool *pool)
{
    pd_pool *was = en->pool;
    en->pool = pool;
    return was;
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
    s->mtp_pos = 0;
    memset(&s->undo, 0, sizeof s->undo);
    memset(&s->mtp_undo, 0, sizeof s->mtp_undo);
    return pd_kvseq_alloc(&en->kv, &s->kv, e);
}

void pd_seq_end(struct pd_engine *en, struct pd_seq *s)
{
    pd_kvseq_free(&en->kv, &s->kv);
    pd_kvundo_free(&s->undo);
    pd_kvundo_free(&s->mtp_undo);
    s->pos = 0;
    s->mtp_pos = 0;
}

int pd_engine_rollback(struct pd_engine *en, struct pd_seq *s, int64_t len, int64_t mtp_len, pd_err *e)
{
    if (len > s->pos || mtp_len > s->mtp_pos || len < 0 || mtp_len < 0)
        return pd_err_set(e, PD_EINVAL, "engine rollback: to %lld / %lld tokens, the sequence has %lld / %lld",
                          (long long)len, (long long)mtp_len, (long long)s->pos, (long long)s->mtp_pos);
    /* every dropped position must have run with undo on: the logs begin at or before it */
    if ((len < s->pos && (s->undo.n == 0 || s->undo.from > len)) ||
        (mtp_len < s->mtp_pos && (s->mtp_undo.n == 0 || s->mtp_undo.from > mtp_len)))
        return pd_err_set(e, PD_EINVAL, "engine rollback: a dropped token was not run with undo on");
    pd_kvundo_rollback(&s->undo, len);
    pd_kvundo_rollback(&s->mtp_undo, mtp_len);
    s->pos = len;
    s->mtp_pos = mtp_len;
    s->kv.len = len;
    (void)en;
    return 0;
}

/* The mixing values of one token before normalisation, rows [r0, r1) of the 2*hc + hc*hc:
 * mix[k] = fn[k] . h. Rows are computed independently (pd_dot_rows in blocks of 4 from r0), so a
 * split at multiples of PD_MHC_MIX_ROWS gives the same bits as one call over all of them. */
void pd_mhc_mix(const struct pd_model *m, const float *h, const float *fn, int r0, int r1, float *mix)
{
    const size_t n = (size_t)m->hc_mult * m->hidden_size;
    pd_dot_rows(fn + (size_t)r0 * n, n, h, (int)n, r1 - r0, mix + r0);
}

/* mHC "pre" from the raw mixing values (mix [2*hc + hc*hc], pd_mhc_mix; scaled in place):
 *   pre  = sigmoid(mix[0:hc] * r * scale[0] + base[0:hc]) + hc_eps   r = rms(h)^-1
 *   post = 2 * sigmoid(mix[hc:2hc] * r * scale[1] + base[hc:2hc])
 *   comb = Sinkhorn(mix[2hc:] * r * scale[2] + base[2hc:])          (hc x hc)
 *   x    = sum_j pre_j * h_j                                      */
void pd_mhc_pre_mixed(const struct pd_model *m, const float *h, float *mix, const float *base, const float *scale,
                      float *x, float *post, float *comb)
{
    const int hc = m->hc_mult, H = (int)m->hidden_size, n = hc * H, mixn = (2 + hc) * hc;
    float r = (float)(1.0 / sqrt((double)pd_dot(h, h, n) / n + m->rms_norm_eps));
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

void pd_mhc_pre(const struct pd_model *m, const float *h, const float *fn, const float *base,
                   const float *scale, float *x, float *post, float *comb)
{
    float mix[(2 + 64) * 64];   /* hc_mult <= 64 (config.c) */
    pd_mhc_mix(m, h, fn, 0, (2 + m->hc_mult) * m->hc_mult, mix);
    pd_mhc_pre_mixed(m, h, mix, base, scale, x, post, comb);
}

/* mHC "post": h_k = post_k * out + sum_j comb[j][k] * h_j, in place, MHC_POST_COLS columns of
 * every stream at a time (each value its own element-wise sum, so the same bits as whole rows): a
 * prefill's streams (8 KiB a token in v4-flash-mini) are read and written once, in cache, where a
 * scratch of every token's new streams was written (each of its lines first read from memory)
 * then copied back. */
enum { MHC_POST_COLS = 64 };

void pd_mhc_post(const struct pd_model *m, float *h, const float *out, const float *post, const float *comb)
{
    const int hc = m->hc_mult, H = (int)m->hidden_size;
    float c[64][64], chunk[64 * MHC_POST_COLS];   /* hc_mult <= 64 (config.c) */
    for (int k = 0; k < hc; k++)
        for (int j = 0; j < hc; j++)
            c[k][j] = comb[j * hc + k];
    for (int i0 = 0; i0 < H; i0 += MHC_POST_COLS) {
        const int n = H - i0 < MHC_POST_COLS ? H - i0 : MHC_POST_COLS;
        for (int k = 0; k < hc; k++)
            pd_scale_axpys(post[k], out + i0, c[k], h + i0, (size_t)H, hc, chunk + (size_t)k * MHC_POST_COLS, n);
        for (int k = 0; k < hc; k++)
            memcpy(h + (size_t)k * H + i0, chunk + (size_t)k * MHC_POST_COLS, (size_t)n * sizeof(float));
    }
}

/* mHC around a sublayer, over the pool: a token's mixing weights are hc * hidden floats per
 * mixing value (24 x 2048 in v4-flash-mini: 196 KB per sublayer, as much as its matrices), so at
 * decode batch 1 their rows are split (task = a token's block of PD_MHC_MIX_ROWS rows) and the rest
 * of "pre" follows on the caller; with more tokens each task is one token, "pre" or "post" whole.
 * The same arithmetic per token and row either way. */
enum { MHC_TOKENS_T = 4 };

struct mhc_job {
    struct pd_step *st;
    const struct pd_layer_w *L;
    int ffn;
    int split;          /* 1: tasks are (token, row block) of the mixing values only */
    int mixed;          /* 1: the mixing values are computed (mhc_mix_rows_task); "pre" does the rest */
    int blocks;         /* row blocks per token */
    float *mix;         /* [T, mixn] */
};

/* The mixing values of every token for one block of PD_MHC_MIX_ROWS rows of the mixing weights,
 * pd_mhc_mix's bits: pd_dot_rows_tokens (each row read once for four tokens at a time), or from
 * MHC_GEMM_T tokens (prefill) one register-tiled product (kernels/dot_gemm.h). */
enum { MHC_GEMM_T = 8 };

static void mhc_mix_rows_task(void *arg, int task)
{
    const struct mhc_job *j = arg;
    const struct pd_model *m = &j->st->en->model;
    const int n = m->hc_mult * (int)m->hidden_size, mixn = (2 + m->hc_mult) * m->hc_mult;
    const int r0 = task * PD_MHC_MIX_ROWS, r1 = r0 + PD_MHC_MIX_ROWS < mixn ? r0 + PD_MHC_MIX_ROWS : mixn;
    const float *fn = j->ffn ? j->L->hc_ffn_fn : j->L->hc_attn_fn;
    if (j->st->T >= MHC_GEMM_T)
        pd_dot_gemm(fn + (size_t)r0 * n, (size_t)n, r1 - r0, j->st->h, (size_t)n, j->st->T, n, j->mix + r0,
                    (size_t)mixn);
    else
        pd_dot_rows_tokens(fn + (size_t)r0 * n, (size_t)n, j->st->h, (size_t)n, j->st->T, n, r1 - r0, j->mix + r0,
                           (size_t)mixn);
}

/* A prefill's mixing values by blocks of MHC_MIX_TOKENS tokens, every row of the mixing weights
 * for each block (the same dot products as by row blocks, so the same bits): each token's streams
 * (8 KiB in v4-flash-mini) come from memory once, the weights from L2, where row-block tasks read
 * all the tokens' streams once per block of 4 rows (6 times a sublayer). */
enum { MHC_MIX_TOKENS = 16, MHC_BY_TOKENS_T = 64 };

static void mhc_mix_tokens_task(void *arg, int task)
{
    const struct mhc_job *j = arg;
    const struct pd_model *m = &j->st->en->model;
    const int n = m->hc_mult * (int)m->hidden_size, mixn = (2 + m->hc_mult) * m->hc_mult;
    const int t0 = task * MHC_MIX_TOKENS, t1 = t0 + MHC_MIX_TOKENS < j->st->T ? t0 + MHC_MIX_TOKENS : j->st->T;
    pd_dot_gemm(j->ffn ? j->L->hc_ffn_fn : j->L->hc_attn_fn, (size_t)n, mixn, j->st->h + (size_t)t0 * n, (size_t)n,
                t1 - t0, n, j->mix + (size_t)t0 * mixn, (size_t)mixn);
}

static void mhc_pre_task(void *arg, int task)
{
    const struct mhc_job *j = arg;
    const struct pd_model *m = &j->st->en->model;
    const struct pd_layer_w *L = j->L;
    const int H = (int)m->hidden_size, hc = m->hc_mult, mixn = (2 + hc) * hc;
    const int t = j->split ? task / j->blocks : task;
    const float *h = j->st->h + (size_t)t * hc * H, *fn = j->ffn ? L->hc_ffn_fn : L->hc_attn_fn;
    float *mix = j->mix + (size_t)t * mixn;
    if (j->split) {
        int r0 = task % j->blocks * PD_MHC_MIX_ROWS, r1 = r0 + PD_MHC_MIX_ROWS < mixn ? r0 + PD_MHC_MIX_ROWS : mixn;
        pd_mhc_mix(m, h, fn, r0, r1, mix);
        return;
    }
    if (!j->mixed)
        pd_mhc_mix(m, h, fn, 0, mixn, mix);
    float *x = j->st->x + (size_t)t * H;
    pd_mhc_pre_mixed(m, h, mix, j->ffn ? L->hc_ffn_base : L->hc_attn_base, j->ffn ? L->hc_ffn_scale : L->hc_attn_scale,
                     x, j->st->post + (size_t)t * hc, j->st->comb + (size_t)t * hc * hc);
    pd_rmsnorm(x, j->ffn ? L->ffn_norm : L->attn_norm, (float)m->rms_norm_eps, H, x);
}

static void mhc_post_task(void *arg, int t)
{
    const struct mhc_job *j = arg;
    const struct pd_model *m = &j->st->en->model;
    const int H = (int)m->hidden_size, hc = m->hc_mult;
    pd_mhc_post(m, j->st->h + (size_t)t * hc * H, j->st->out + (size_t)t * H, j->st->post + (size_t)t * hc,
                j->st->comb + (size_t)t * hc * hc);
}

/* One sublayer wrapped in mHC, for every token of the step. */
static int sublayer(struct pd_step *st, int layer, int ffn, pd_err *e)
{
    struct pd_engine *en = st->en;
    const struct pd_model *m = &en->model;
    const struct pd_layer_w *L = pd_layer_weights(en, layer);
    const int H = (int)m->hidden_size, hc = m->hc_mult, T = st->T, mixn = (2 + hc) * hc;
    struct mhc_job j = {.st = st, .L = L, .ffn = ffn, .blocks = (mixn + PD_MHC_MIX_ROWS - 1) / PD_MHC_MIX_ROWS};
    j.split = T < pd_pool_nthreads(en->pool);
    j.mix = pd_scratch(en, 70, (size_t)T * mixn * sizeof(float), e);
    if (!j.mix)
        return PD_ENOMEM;
    if (!j.split && T >= MHC_TOKENS_T) {
        /* several tokens: the mixing weights (196 KB a sublayer in v4-flash-mini) read once for
         * four tokens at a time, by row blocks over the pool, then each token's "pre" */
        if (T >= MHC_BY_TOKENS_T)
            pd_pool_run(en->pool, (T + MHC_MIX_TOKENS - 1) / MHC_MIX_TOKENS, mhc_mix_tokens_task, &j);
        else
            pd_pool_run(en->pool, j.blocks, mhc_mix_rows_task, &j);
        j.mixed = 1;
    }
    pd_pool_run(en->pool, j.split ? T * j.blocks : T, mhc_pre_task, &j);
    if (j.split)
        for (int t = 0; t < T; t++) {
            float *x = st->x + (size_t)t * H;
            pd_mhc_pre_mixed(m, st->h + (size_t)t * hc * H, j.mix + (size_t)t * mixn,
                             ffn ? L->hc_ffn_base : L->hc_attn_base, ffn ? L->hc_ffn_scale : L->hc_attn_scale, x,
                             st->post + (size_t)t * hc, st->comb + (size_t)t * hc * hc);
            pd_rmsnorm(x, ffn ? L->ffn_norm : L->attn_norm, (float)m->rms_norm_eps, H, x);
        }
    if (!en->ref)
        pd_quant_rows_pool(en->pool, st->x, T, H, (int8_t *)st->xq.q, (float *)st->xq.scale);
    pd_prof_enter(&en->prof, ffn ? PD_PROF_MOE : PD_PROF_ATTENTION);
    int rc = ffn ? pd_moe_layer(st, layer, e) : pd_attention_layer(st, layer, e);
    pd_prof_leave(&en->prof);
    if (rc)
        return rc;
    /* "post" is hc * hc * hidden multiply-adds per token: on the caller at batch 1 */
    pd_pool_run(T > 1 ? en->pool : NULL, T, mhc_post_task, &j);
    return 0;
}

/* Output head, its input: mHC pre-weights (sigmoid, no Sinkhorn) sum the streams of token t,
 * then norm, into x; lm_head follows (step_outputs). The main model uses its own hc_head_* and
 * norm, the MTP layer its own; both share lm_head. */
static void head_input(struct pd_step *st, int t, const float *fn, const float *base, const float *scale,
                       const float *norm, float *x)
{
    const struct pd_model *m = &st->en->model;
    const int H = (int)m->hidden_size, hc = m->hc_mult, n = hc * H;
    const float *h = st->h + (size_t)t * n;
    float r = (float)(1.0 / sqrt((double)pd_dot(h, h, n) / n + m->rms_norm_eps)), pre[64], mix[64];
    pd_dot_rows(fn, (size_t)n, h, n, hc, mix);
    for (int j = 0; j < hc; j++)
        pre[j] = pd_sigmoid(mix[j] * r * scale[0] + base[j]) + (float)m->hc_eps;
    pd_weighted_sum(pre, h, (size_t)H, hc, NULL, x, H);
    pd_rmsnorm(x, norm, (float)m->rms_norm_eps, H, x);
}

static int max_in(const struct pd_model *m)
{
    int64_t v[] = {m->hidden_size, m->q_lora_rank, (int64_t)m->n_heads * m->head_dim /* o, quantised as o_groups rows per token */,
                   (int64_t)m->o_groups * m->o_lora_rank, m->moe_intermediate_size * (m->n_shared_experts > 1 ? m->n_shared_experts : 1)};
    int64_t x = 0;
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
        x = v[i] > x ? v[i] : x;
    return (int)x;
}

/* Checks the items and reserves KV for their new tokens (positions from seq->pos, or seq->mtp_pos
 * in the MTP step): on failure nothing has advanced. Fills st->T. */
static int step_check(struct pd_engine *en, struct pd_step *st, int mtp, pd_err *e)
{
    const struct pd_model *m = &en->model;
    struct pd_step_item *items = st->items;
    for (int i = 0; i < st->n_items; i++) {
        if (items[i].n < 1)
            return pd_err_set(e, PD_EINVAL, "engine step: item %d has no tokens", i);
        for (int k = 0; k < items[i].n; k++)
            if (items[i].tokens[k] < 0 || items[i].tokens[k] >= m->vocab_size)
                return pd_err_set(e, PD_EINVAL, "engine step: token %d is outside the vocabulary [0, %lld)",
                                  items[i].tokens[k], (long long)m->vocab_size);
        /* a snapshot at B is taken after the token at B - 1 (the MTP layer's at B - 2) */
        int64_t from = mtp ? items[i].seq->mtp_pos + 1 : items[i].seq->pos;
        for (int j = 0; j < items[i].n_snaps; j++)
            if (items[i].snaps[j].pos <= from || items[i].snaps[j].pos > from + items[i].n)
                return pd_err_set(e, PD_EINVAL, "engine step: item %d's snapshot at %lld is outside its tokens (%lld, %lld]",
                                  i, (long long)items[i].snaps[j].pos, (long long)from,
                                  (long long)(from + items[i].n));
        for (int j = 0; j < i; j++)
            if (items[j].seq == items[i].seq)
                return pd_err_set(e, PD_EINVAL, "engine step: a sequence appears twice in one step");
        if (mtp && !items[i].hidden_in)
            return pd_err_set(e, PD_EINVAL, "engine MTP step: item %d has no hidden_in", i);
        st->T += items[i].n;
    }
    for (int i = 0; i < st->n_items; i++) {
        const struct pd_seq *q = items[i].seq;
        int64_t end = mtp ? q->mtp_pos + items[i].n : q->pos + items[i].n;
        if (en->mtp)   /* the pool's layers share one reservation: the longer of the two */
            end = end > (mtp ? q->pos : q->mtp_pos) ? end : (mtp ? q->pos : q->mtp_pos);
        int rc = pd_kvseq_reserve(&en->kv, &items[i].seq->kv, end, e);
        if (rc)
            return rc;
    }
    return 0;
}

/* The step's scratch memory, and each token's item, position and rope. */
static int step_setup(struct pd_engine *en, struct pd_step *st, int mtp, pd_err *e)
{
    const struct pd_model *m = &en->model;
    const int H = (int)m->hidden_size, hc = m->hc_mult, T = st->T;
    st->max_in = max_in(m);
    st->item_of = pd_scratch(en, 1, (size_t)T * sizeof(int), e);
    st->pos = pd_scratch(en, 2, (size_t)T * sizeof(int64_t), e);
    st->token = pd_scratch(en, 3, (size_t)T * sizeof(int32_t), e);
    st->h = pd_scratch(en, 4, (size_t)T * hc * H * sizeof(float), e);
    st->x = pd_scratch(en, 5, (size_t)T * H * sizeof(float), e);
    st->out = pd_scratch(en, 6, (size_t)T * H * sizeof(float), e);
    st->post = pd_scratch(en, 7, (size_t)T * hc * sizeof(float), e);
    st->comb = pd_scratch(en, 8, (size_t)T * hc * hc * sizeof(float), e);
    st->qbuf = pd_scratch(en, 9, (size_t)T * st->max_in, e);
    st->sbuf = pd_scratch(en, 10, (size_t)T * (m->o_groups > 1 ? m->o_groups : 1) * sizeof(float), e);
    int8_t *xq = pd_scratch(en, 47, (size_t)T * H, e);
    float *xs = pd_scratch(en, 49, (size_t)T * sizeof(float), e);
    st->xq = (pd_qmat){.q = xq, .scale = xs, .rows = T, .cols = H};
    const int rd = m->qk_rope_head_dim;
    st->cs_window = pd_scratch(en, 44, (size_t)T * rd * sizeof(float), e);
    st->cs_compress = pd_scratch(en, 45, (size_t)T * rd * sizeof(float), e);
    if (!st->item_of || !st->pos || !st->token || !st->h || !st->x || !st->out || !st->post || !st->comb || !st->qbuf ||
        !st->sbuf || !st->cs_window || !st->cs_compress || !xq || !xs)
        return PD_ENOMEM;
    for (int i = 0, t = 0; i < st->n_items; i++)
        for (int k = 0; k < st->items[i].n; k++, t++) {
            st->item_of[t] = i;
            st->pos[t] = (mtp ? st->items[i].seq->mtp_pos : st->items[i].seq->pos) + k;
            st->token[t] = st->items[i].tokens[k];
            pd_rope_cs(&en->rope_window, st->pos[t], st->cs_window + (size_t)t * rd);
            pd_rope_cs(&en->rope_compress, st->pos[t], st->cs_compress + (size_t)t * rd);
        }
    return 0;
}

/* Hidden states and logits of every item, through the head given: the head's inputs of every
 * token that wants logits gathered into st->x (free once the blocks are done), lm_head on all of
 * them in one product (a row's result does not depend on the rows beside it), then each row
 * copied to where its item wants it. */
static int step_outputs(struct pd_step *st, const float *fn, const float *base, const float *scale, const float *norm,
                        pd_err *e)
{
    struct pd_engine *en = st->en;
    const struct pd_model *m = &en->model;
    const int H = (int)m->hidden_size, V = (int)m->vocab_size;
    const size_t hcH = (size_t)m->hc_mult * H;
    float **dst = pd_scratch(en, 69, (size_t)st->T * sizeof *dst, e);
    if (!dst)
        return PD_ENOMEM;
    int n = 0;
    for (int i = 0, t = 0; i < st->n_items; i++) {
        struct pd_step_item *it = &st->items[i];
        if (it->hidden)
            memcpy(it->hidden, st->h + (size_t)t * hcH, (size_t)it->n * hcH * sizeof(float));
        for (int k = 0; k < it->n; k++, t++) {
            float *d = it->all_logits ? it->all_logits + (size_t)k * V : k == it->n - 1 ? it->logits : NULL;
            if (!d)
                continue;
            head_input(st, t, fn, base, scale, norm, st->x + (size_t)n * H);
            dst[n++] = d;
        }
    }
    if (!n)
        return 0;
    float *lg = pd_scratch(en, 46, (size_t)n * V * sizeof(float), e);
    if (!lg)
        return PD_ENOMEM;
    int rc = pd_linear_fwd(&en->w.head, en->pool, en->ref, st->x, n, lg, st->qbuf, st->sbuf, e);
    if (rc)
        return rc;
    for (int r = 0; r < n; r++)
        memcpy(dst[r], lg + (size_t)r * V, (size_t)V * sizeof(float));
    for (int i = 0; i < st->n_items; i++) {
        struct pd_step_item *it = &st->items[i];
        if (it->logits && it->all_logits)
            memcpy(it->logits, it->all_logits + (size_t)(it->n - 1) * V, (size_t)V * sizeof(float));
    }
    return 0;
}

/* Whether nobody wants any of the step's results any more (pd_engine_step). */
static int step_cancelled(const struct pd_step *st)
{
    for (int i = 0; i < st->n_items; i++)
        if (!st->items[i].cancel || !atomic_load_explicit(st->items[i].cancel, memory_order_relaxed))
            return 0;
    return st->n_items > 0;
}

int pd_engine_step(struct pd_engine *en, struct pd_step_item *items, int n_items, pd_err *e)
{
    const struct pd_model *m = &en->model;
    const int H = (int)m->hidden_size, hc = m->hc_mult;
    struct pd_step st = {.en = en, .items = items, .n_items = n_items};
    pd_prof_step_begin(&en->prof);
    int rc = step_check(en, &st, 0, e);
    if (rc || (rc = step_setup(en, &st, 0, e)))
        return rc;
    const int T = st.T;
    /* embedding, copied into the hc streams */
    for (int t = 0; t < T; t++) {
        float *h = st.h + (size_t)t * hc * H;
        pd_bf16_row((const char *)en->w.embed + (size_t)st.token[t] * H * 2, h, (size_t)H);
        for (int j = 1; j < hc; j++)
            memcpy(h + (size_t)j * H, h, (size_t)H * sizeof(float));
    }
    for (int l = 0; l < m->n_layers; l++) {
        for (int part = 0; part < 2; part++) {   /* attention, then the MoE */
            if (step_cancelled(&st))
                return pd_err_set(e, PD_ECANCELED, "the step was cancelled at layer %d of %d: nobody wants its tokens",
                                  l, m->n_layers);
            if ((rc = sublayer(&st, l, part, e)))
                return rc;
        }
        if (en->trace_norms) {
            double ss = 0;
            for (size_t i = 0; i < (size_t)T * hc * H; i++)
                ss += (double)st.h[i] * st.h[i];
            en->layer_rms[l] = sqrt(ss / ((double)T * hc * H));
        }
    }
    if ((rc = step_outputs(&st, en->w.hc_head_fn, en->w.hc_head_base, en->w.hc_head_scale, en->w.norm, e)))
        return rc;
    for (int i = 0; i < n_items; i++) {
        items[i].seq->pos += items[i].n;
        items[i].seq->kv.len = items[i].seq->pos;
    }
    pd_prof_step_end(&en->prof);
    return 0;
}

/* The MTP draft forward, as DeepSeek-V4's official code defines it (inference/model.py, MTPBlock
 * and Transformer.forward with return_h). At position i, with h_i [hc, hidden] the hidden state
 * after the last block (every stream, before the head) and tok_{i+1} the next token:
 *   e     = enorm(embed(tok_{i+1}))                                  [hidden]
 *   x_j   = hnorm(h_i[j])                  for each stream j         [hc, hidden]
 *   g_j   = e_proj(e) + h_proj(x_j)        (e_proj(e) broadcast over the streams)
 *   g'    = Block_{n_layers}(g)            a whole V4 block (mHC, attention with its own KV and
 *                                          compress_ratio[n_layers], MoE) at position i
 *   logits = head(g'; mtp.hc_head_fn/base/scale, mtp.norm)  the shared lm_head: predicts tok_{i+2}
 * For k > 1 draft tokens the one MTP layer is applied again (as vLLM does for DeepSeek MTP): at
 * position i+1 h is the MTP layer's own output g' at i and the token its own draft. */
int pd_engine_mtp_step(struct pd_engine *en, struct pd_step_item *items, int n_items, pd_err *e)
{
    const struct pd_model *m = &en->model;
    const struct pd_mtp_w *mt = &en->w.mtp;
    const int H = (int)m->hidden_size, hc = m->hc_mult;
    const float eps = (float)m->rms_norm_eps;
    if (!en->mtp)
        return pd_err_set(e, PD_EINVAL, "engine MTP step: the engine was opened without MTP");
    struct pd_step st = {.en = en, .items = items, .n_items = n_items};
    int rc = step_check(en, &st, 1, e);
    if (rc || (rc = step_setup(en, &st, 1, e)))
        return rc;
    const int T = st.T;
    float *ein = pd_scratch(en, 64, (size_t)T * H * sizeof(float), e);
    float *ep = pd_scratch(en, 65, (size_t)T * H * sizeof(float), e);
    float *xn = pd_scratch(en, 66, (size_t)T * hc * H * sizeof(float), e);
    int8_t *qb = pd_scratch(en, 67, (size_t)T * hc * H, e);
    float *sb = pd_scratch(en, 68, (size_t)T * hc * sizeof(float), e);
    if (!ein || !ep || !xn || !qb || !sb)
        return PD_ENOMEM;
    for (int i = 0, t = 0; i < n_items; i++)
        for (int k = 0; k < items[i].n; k++, t++) {
            float *x = ein + (size_t)t * H;
            pd_bf16_row((const char *)en->w.embed + (size_t)st.token[t] * H * 2, x, (size_t)H);
            pd_rmsnorm(x, mt->enorm, eps, H, x);
            const float *h = items[i].hidden_in + (size_t)k * hc * H;
            for (int j = 0; j < hc; j++)
                pd_rmsnorm(h + (size_t)j * H, mt->hnorm, eps, H, xn + ((size_t)t * hc + j) * H);
        }
    if ((rc = pd_linear_fwd(&mt->e_proj, en->pool, en->ref, ein, T, ep, qb, sb, e)) ||
        (rc = pd_linear_fwd(&mt->h_proj, en->pool, en->ref, xn, T * hc, st.h, qb, sb, e)))
        return rc;
    for (int t = 0; t < T; t++)
        for (int j = 0; j < hc; j++)
            pd_axpy(1.0f, ep + (size_t)t * H, st.h + ((size_t)t * hc + j) * H, H);
    if ((rc = sublayer(&st, m->n_layers, 0, e)) || (rc = sublayer(&st, m->n_layers, 1, e)) ||
        (rc = step_outputs(&st, mt->hc_head_fn, mt->hc_head_base, mt->hc_head_scale, mt->norm, e)))
        return rc;
    for (int i = 0; i < n_items; i++)
        items[i].seq->mtp_pos += items[i].n;
    return 0;
}

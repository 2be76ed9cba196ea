/* The performance model (perf.h): a step's cost term by term, then TTFT, TPOT and
 * rate-matched throughput for a workload. docs/perf-model.md derives each formula. */
#include "plan/perf.h"
#include "plan/lockstep.h"

#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *pd_bound_name(enum pd_bound b)
{
    switch (b) {
    case PD_BOUND_COMPUTE: return "compute";
    case PD_BOUND_MEMORY: return "memory bandwidth";
    case PD_BOUND_LINK: return "link";
    case PD_BOUND_OVERHEAD: return "per-step overhead";
    case PD_BOUND_CAPACITY: return "memory capacity";
    }
    return "?";
}

void pd_workload_default(struct pd_workload *w)
{
    memset(w, 0, sizeof *w);
    w->isl = 4096;
    w->osl = 1024;
}

/* Peak arithmetic rate for weights stored in format f: the card's int8, fp8 or bf16 units;
 * formats the card has no units for are dequantised to bf16 (fp4 on fp8 hardware: fp8; w4a8's
 * int4 weights are widened to int8 and multiply int8 activations). */
static double peak_for(const struct pd_hardware *h, enum pd_fmt f)
{
    double bf = h->bf16_flops > 0 ? h->bf16_flops : h->int8_ops;
    switch (f) {
    case PD_FMT_W8A8:
    case PD_FMT_W4A8: return h->int8_ops > 0 ? h->int8_ops : bf;
    case PD_FMT_FP8:
    case PD_FMT_FP4: return h->fp8_flops > 0 ? h->fp8_flops : bf;
    default: return bf;
    }
}

/* The busiest rank's expert load over the mean: lower with redundant experts (EPLB); none
 * when one rank holds every expert. */
static double imbalance(const struct pd_plan *p, enum pd_role r, const struct pd_role_plan *rp)
{
    if (rp->ep <= 1)
        return 1;
    if (rp->imbalance > 0)
        return rp->imbalance;
    return rp->o.redundant > 0 ? p->hw.eff.imbalance_eplb[r] : p->hw.eff.imbalance[r];
}

/* One weight group on the roofline: adds its time to the compute or the memory part. */
static void roofline(const struct pd_plan *p, double flops, double bytes, enum pd_fmt f, struct pd_step *s)
{
    const struct pd_efficiency *x = &p->hw.eff;
    /* FP4 weights on a card that dequantises them in software stream at fp4_memory of the
     * memory factor: t_mem = bytes / (bandwidth x memory x fp4_memory) */
    const double mem = x->memory * (f == PD_FMT_FP4 ? x->fp4_memory : 1);
    double tc = flops / (peak_for(&p->hw, f) * x->gemm), tm = bytes / (p->hw.mem_bw_Bps * mem);
    if (tc >= tm)
        s->gemm_compute_s += tc;
    else
        s->gemm_memory_s += tm;
    s->flops += flops;
    s->bytes += bytes;
}

/* Attention of one layer for one query at 0-based position `pos`: entries attended and
 * arithmetic; `kv` gets the bytes a sequence at that position reads once per step. */
static void attn_token(const struct pd_plan *p, enum pd_role r, int ratio, double pos, double *flops, double *kv)
{
    const struct pd_model *m = &p->model;
    const struct pd_kv_size *k = &p->kv;
    double n = pos + 1;
    if (ratio < 0) {                         /* MLA: decode absorbs W_UK/W_UV, prefill expands */
        *kv = n * (double)k->entry_bytes;
        *flops = r == PD_ROLE_DECODE
                     ? 2.0 * m->n_heads * n * (2.0 * m->kv_lora_rank + m->qk_rope_head_dim)
                     : 2.0 * m->n_heads * n * (m->qk_nope_head_dim + m->qk_rope_head_dim + m->v_head_dim);
        return;
    }
    double win = n < k->window ? n : (double)k->window, att = win, idx = 0;
    double bytes = win * (double)k->entry_bytes;
    if (ratio > 0) {
        double nc = floor(n / ratio);
        double sel = ratio == 4 && m->index_topk > 0 && nc > m->index_topk ? m->index_topk : nc;
        att += sel;
        bytes += sel * (double)k->entry_bytes;
        if (ratio == 4) {
            idx = 2.0 * m->index_n_heads * m->index_head_dim * nc;
            bytes += nc * (double)k->index_key_bytes;
        }
    }
    *kv = bytes;
    *flops = 4.0 * m->n_heads * m->head_dim * att + idx;   /* QK and PV over one K=V latent */
}

/* Which layers a pass runs: [l0, l1) in the KV's layer order (the MTP layers after the main
 * model's), moe of them MoE layers, holding expert_share of the routed experts' weights. */
struct span {
    int l0, l1, moe;
    double expert_share;
};

/* The whole model (a prompt: the MTP layer runs over it too, building its KV), the main model
 * alone (a decode step's verification), or the MTP layers alone (a draft pass). */
enum scope { SCOPE_ALL, SCOPE_MAIN, SCOPE_MTP };

static struct span span_of(const struct pd_plan *p, enum scope sc)
{
    const int L = p->model.n_layers, n = p->kv.n, all = p->inv.n_moe_layers;
    int mtp_moe = 0;
    for (int l = L; l < n; l++)
        mtp_moe += pd_model_is_moe_layer(&p->model, l);
    if (sc == SCOPE_ALL || !p->include_mtp)
        return (struct span){0, n, all, 1};
    double share = all > 0 ? (double)mtp_moe / all : 0;
    return sc == SCOPE_MAIN ? (struct span){0, L, all - mtp_moe, 1 - share} : (struct span){L, n, mtp_moe, share};
}

/* Attention over layers [sp->l0, sp->l1) for `seqs` sequences adding `tokens` each after `ctx`:
 * the positions are sampled at the midpoints of up to 16 equal slices (exact for <= 16 tokens). */
static void attention(const struct pd_plan *p, enum pd_role r, const struct span *sp, int64_t seqs, int64_t tokens,
                      int64_t ctx, int tp, struct pd_step *s)
{
    double flops = 0, kv = 0;
    int slices = tokens < 16 ? (int)tokens : 16;
    for (int l = sp->l0; l < sp->l1; l++) {
        int dup = 0;
        for (int j = sp->l0; j < l && !dup; j++)
            dup = p->kv.ratio[j] == p->kv.ratio[l];
        if (dup)
            continue;
        int same = 0;
        for (int j = l; j < sp->l1; j++)
            same += p->kv.ratio[j] == p->kv.ratio[l];
        double f = 0, b = 0;
        for (int i = 0; i < slices; i++) {
            double pos = ctx + ((double)i + 0.5) * (double)tokens / slices - 0.5, ft, bt;
            attn_token(p, r, p->kv.ratio[l], pos, &ft, &bt);
            f += ft * (double)tokens / slices;
        }
        double ft;
        attn_token(p, r, p->kv.ratio[l], (double)(ctx + tokens - 1), &ft, &b);
        flops += same * f;
        kv += same * b;     /* the cache is read once per step, whatever the tokens */
    }
    flops *= (double)seqs / tp;
    kv *= (double)seqs / tp;
    const struct pd_efficiency *x = &p->hw.eff;
    double tc = flops / (p->hw.bf16_flops * x->attention), tm = kv / (p->hw.mem_bw_Bps * x->memory);
    s->attn_s += tc > tm ? tc : tm;        /* added: a mixed step has a decode and a prefill part */
    s->attn_memory_s += tm >= tc ? tm : 0;
    s->attn_kv_read_s += tm;
    s->flops += flops;
    s->bytes += kv;
}

/* Expert dispatch + combine of one DP rank's tokens, per MoE layer, plus TP all-reduces.
 * Prefill uses node-deduplicated sends (one copy per remote node, forwarded inside it, as
 * DeepEP's normal kernels do); decode sends one copy per destination rank (low-latency
 * kernels). Each token reaches ep * (1 - (1 - 1/ep)^k) distinct ranks on average. */
static double a2a(const struct pd_plan *p, enum pd_role r, const struct pd_role_plan *rp, const struct span *sp,
                  double tokens)
{
    const struct pd_model *m = &p->model;
    const struct pd_efficiency *x = &p->hw.eff;
    const int ep = rp->ep, tp = rp->o.tp, cpn = p->hw.cards_per_node;
    double t = 0, H = (double)m->hidden_size, k = m->n_experts_per_tok;
    /* ring all-reduce of the attention and FFN outputs, bf16, every layer: the main model's
     * layers of a pass that runs them (a prompt's pass counts no more for the MTP layer, as
     * before it was costed on its own), else the MTP layers of a draft pass */
    const int L = m->n_layers, ar_layers = sp->l0 >= L ? sp->l1 - sp->l0 : (sp->l1 < L ? sp->l1 : L) - sp->l0;
    if (tp > 1)
        t += 2.0 * ar_layers * (2.0 * (tp - 1) / tp * tokens * H * 2) / (p->hw.intra.bandwidth_Bps * x->a2a_intra);
    if (ep <= 1 || sp->moe == 0)
        return t;
    enum pd_fmt f = pd_plan_group_fmt(p, PD_G_ROUTED_EXPERTS);
    double disp = f == PD_FMT_BF16 || f == PD_FMT_F32 ? 2 * H : H + 4 * ceil(H / 128);
    double comb = 2 * H, per = disp + comb;
    double tok = tokens / tp;                         /* each TP rank sends its share */
    double ranks = ep * (1 - pow(1 - 1.0 / ep, k));   /* distinct ranks a token reaches */
    double remote = ranks * (ep - 1) / ep;            /* ... other than its own */
    int nodes = (ep + cpn - 1) / cpn;
    double intra = 0, inter = 0;
    if (nodes <= 1) {
        intra = tok * remote * per;
    } else {
        double local_share = (double)(cpn - 1) / (ep - 1);
        if (r == PD_ROLE_PREFILL) {
            /* distinct nodes a token reaches: with group-limited routing (n_group groups spread
             * evenly over the nodes, topk_group chosen) drawn by group, else by expert */
            double dn;
            if (m->topk_group > 0 && m->n_group >= nodes && m->n_group % nodes == 0) {
                int gpn = m->n_group / nodes;
                double none = 1;     /* C(n_group - gpn, topk_group) / C(n_group, topk_group) */
                for (int i = 0; i < m->topk_group; i++)
                    none *= (double)(m->n_group - gpn - i) / (m->n_group - i);
                dn = nodes * (1 - (none > 0 ? none : 0));
            } else {
                dn = nodes * (1 - pow(1 - 1.0 / nodes, k));
            }
            inter = tok * dn * (nodes - 1) / nodes * per;
            intra = tok * remote * per;                /* forwarding inside the node, local sends */
        } else {
            inter = tok * remote * (1 - local_share) * per;
            intra = tok * remote * local_share * per;
        }
    }
    double ti = intra / (p->hw.intra.bandwidth_Bps * x->a2a_intra);
    double te = inter / (p->hw.rdma.bandwidth_Bps * x->a2a_inter);
    double layer = (ti > te ? ti : te) * imbalance(p, r, rp) + 2 * x->a2a_latency_s;
    return t + layer * sp->moe;
}

int64_t pd_perf_decode_tokens(const struct pd_plan *p)
{
    return 1 + p->mtp.k;
}

double pd_perf_tokens_per_step(const struct pd_plan *p)
{
    return pd_mtp_tokens_per_step(&p->mtp);
}

void pd_perf_step(const struct pd_plan *p, enum pd_role r, int64_t seqs, int64_t tokens, int64_t ctx,
                  struct pd_step *s)
{
    struct pd_step_part part = {seqs, tokens, ctx};
    static const struct pd_step_part none;
    pd_perf_step_mixed(p, r, r == PD_ROLE_DECODE ? &part : &none, r == PD_ROLE_PREFILL ? &part : &none, s);
}

/* One forward pass over the layers of sp, adding its terms to s: T tokens through the GEMMs,
 * head_rows of them through the LM head, the decode part's and the prefill part's attention.
 * SCOPE_MAIN leaves out the MTP layer's own weights (group "mtp"), SCOPE_MTP keeps only them,
 * with the embedding gather and the shared LM head. */
static void pass(const struct pd_plan *p, enum pd_role r, enum scope sc, double T, double head_rows,
                 const struct pd_step_part *dec, const struct pd_step_part *pre, struct pd_step *s)
{
    const struct pd_role_plan *rp = &p->role[r];
    const struct pd_inventory *inv = &p->inv;
    const struct pd_efficiency *x = &p->hw.eff;
    const struct span sp = span_of(p, sc);
    const int tp = rp->o.tp;
    /* class II groups: every token through each matrix; the head only for sampled rows */
    for (int g = 0; g < PD_G_COUNT; g++) {
        if (g == PD_G_ROUTED_EXPERTS || (sc == SCOPE_MAIN && g == PD_G_MTP) ||
            (sc == SCOPE_MTP && g != PD_G_MTP && g != PD_G_EMBEDDING && g != PD_G_LM_HEAD))
            continue;
        double params = (double)inv->group_params[g][PD_CLASS_II], bytes = (double)inv->group_bytes[g][PD_CLASS_II];
        if (params <= 0)
            continue;
        double split = pd_group_tp_split((enum pd_group)g) ? tp : 1;
        double rows = g == PD_G_EMBEDDING ? 0 : g == PD_G_LM_HEAD ? head_rows : T;
        if (g == PD_G_EMBEDDING)
            bytes = T * (double)p->model.hidden_size * 2;    /* a gather of T rows */
        roofline(p, 2 * rows * params / split, bytes / split, pd_plan_group_fmt(p, (enum pd_group)g), s);
    }
    /* routed experts on the busiest card of the group: the distinct experts T tokens reach */
    if (inv->n_experts > 0 && inv->class_params[PD_CLASS_I] > 0 && sp.expert_share > 0) {
        double E = inv->n_experts, k = p->model.n_experts_per_tok;
        double per_expert_params = (double)inv->class_params[PD_CLASS_I] / E * sp.expert_share;
        double per_expert_bytes = (double)inv->class_bytes[PD_CLASS_I] / E * sp.expert_share;
        double pairs = T * k / tp * s->imbalance;             /* token-expert pairs on the card */
        double group_tokens = T * rp->o.dp;
        double touched = rp->place.slots * (1 - pow(1 - k / E, group_tokens));
        roofline(p, 2 * pairs * per_expert_params, touched * per_expert_bytes, pd_plan_group_fmt(p, PD_G_ROUTED_EXPERTS), s);
    }
    if (dec->seqs > 0 && dec->tokens > 0)
        attention(p, PD_ROLE_DECODE, &sp, dec->seqs, dec->tokens, dec->ctx, tp, s);
    if (pre->seqs > 0 && pre->tokens > 0)
        attention(p, PD_ROLE_PREFILL, &sp, pre->seqs, pre->tokens, pre->ctx, tp, s);
    s->a2a_s += a2a(p, r, rp, &sp, T);
    /* the non-GEMM kernels per token, and each layer's kernel floor whatever its tokens:
     *   overhead += (token_layer x T + layer) x layers of the pass */
    s->overhead_s += (x->token_layer_s[r] * T + x->layer_s[r]) * (sp.l1 - sp.l0);
}

void pd_perf_step_mixed(const struct pd_plan *p, enum pd_role r, const struct pd_step_part *dec,
                        const struct pd_step_part *pre, struct pd_step *s)
{
    const struct pd_efficiency *x = &p->hw.eff;
    static const struct pd_step_part none;
    memset(s, 0, sizeof *s);
    s->imbalance = imbalance(p, r, &p->role[r]);
    double D = (double)dec->seqs * dec->tokens, P = (double)pre->seqs * pre->tokens;
    s->tokens = dec->seqs * dec->tokens + pre->seqs * pre->tokens;
    /* the LM head runs on every decode token and on the last position of each prompt */
    if (!p->include_mtp || dec->seqs == 0) {
        pass(p, r, SCOPE_ALL, D + P, D + (double)pre->seqs, dec, pre, s);
    } else {
        /* Speculative decoding (mtp.h) with k = dec->tokens - 1 drafts: the main model verifies
         * the dec->tokens of each sequence (and runs the prompt chunk), the MTP layer runs the
         * chunk (its KV) and drafts. Its first draft pass runs the positions the last round
         * accepted, tokens_per_step per sequence on average (the accepted drafts and the verify
         * step's own token), and drafts one token; each later pass runs the draft before it. So
         *   step = main(B x (k + 1) + chunk) + MTP(chunk + B x tokens_per_step) + (k - 1) x MTP(B)
         * with one row per sequence through the LM head in each draft pass; k = 0: main(B + chunk)
         * (the MTP layer loaded, not run). The per-step fixed cost is paid once (one step). */
        const int k = (int)dec->tokens - 1;
        struct pd_mtp m = p->mtp;          /* its first k positions (past them: rejected) */
        m.k = k < PD_MTP_MAX_K ? k : PD_MTP_MAX_K;
        pass(p, r, SCOPE_MAIN, D + P, D + (double)pre->seqs, dec, pre, s);
        if (k > 0 || P > 0) {
            const double B = (double)dec->seqs, tps = k > 0 ? pd_mtp_tokens_per_step(&m) : 0;
            struct pd_step_part first = {k > 0 ? dec->seqs : 0, 1, dec->ctx + dec->tokens - 1};
            pass(p, r, SCOPE_MTP, B * tps + P, B * (k > 0) + (double)pre->seqs, &first, pre, s);
            struct pd_step_part next = {dec->seqs, 1, 0};
            for (int j = 2; j <= k; j++) {
                next.ctx = dec->ctx + dec->tokens - 1 + (j - 1);
                pass(p, r, SCOPE_MTP, B, B, &next, &none, s);
            }
        }
    }
    s->overhead_s += x->step_s[r];
    double compute = s->gemm_compute_s + s->gemm_memory_s + s->attn_s + s->overhead_s;
    double hidden = x->overlap[r] * s->a2a_s;
    s->total_s = compute + s->a2a_s - (hidden < compute ? hidden : compute);
    double c = s->gemm_compute_s + (s->attn_s - s->attn_memory_s), mem = s->gemm_memory_s + s->attn_memory_s;
    s->bound = c >= mem && c >= s->a2a_s && c >= s->overhead_s ? PD_BOUND_COMPUTE
               : mem >= s->a2a_s && mem >= s->overhead_s ? PD_BOUND_MEMORY
               : s->a2a_s >= s->overhead_s ? PD_BOUND_LINK : PD_BOUND_OVERHEAD;
}

/* Erlang C: probability an arrival waits in an M/M/c queue with offered load a = lambda*S. */
/* Erlang C (the chance an arrival waits, c servers, offered load a < c) through Erlang B's
 * recurrence, B(0) = 1, B(i) = a B(i-1) / (i + a B(i-1)), and C = c B / (c - a (1 - B)): the
 * direct sum of a^i / i! overflowed past a few hundred servers (thousands of decode slots). */
static double erlang_c(int c, double a)
{
    double b = 1;
    for (int i = 1; i <= c; i++)
        b = a * b / (i + a * b);
    return c * b / (c - a * (1 - b));
}

/* A request the servers would refuse is no workload to predict: vLLM answers 400 when prompt +
 * max_tokens exceed max_model_len, and no model places tokens past its max_position_embeddings.
 * (Compared as differences: lengths near INT64_MAX must not wrap.) */
static int check_length(const struct pd_plan *p, const struct pd_workload *w, pd_err *e)
{
    const int64_t len = p->o.max_model_len, pos = p->model.max_position_embeddings;
    if (w->isl > len - w->osl)
        return pd_err_set(e, PD_EINVAL, "--isl %lld + --osl %lld: more than --max-model-len %lld tokens%s, a request the "
                          "servers would refuse", (long long)w->isl, (long long)w->osl, (long long)len,
                          p->o.max_model_len_given ? ""
                          : len == pos ? " (not given: the model's max_position_embeddings, below the default)"
                                       : " (not given: the default)");
    if (pos > 0 && w->isl > pos - w->osl)
        return pd_err_set(e, PD_EINVAL, "--isl %lld + --osl %lld: more than the model's max_position_embeddings %lld "
                          "tokens", (long long)w->isl, (long long)w->osl, (long long)pos);
    return 0;
}

static int check_workload(const struct pd_workload *w, pd_err *e)
{
    if (w->isl < 1 || w->osl < 1)
        return pd_err_set(e, PD_EINVAL, "--isl %lld / --osl %lld: both must be at least 1", (long long)w->isl,
                          (long long)w->osl);
    if (!(w->cached >= 0 && w->cached < 1))
        return pd_err_set(e, PD_EINVAL, "prefix cache hit fraction %g: must be in [0, 1)", w->cached);
    if (w->rate < 0 || w->decode_batch < 0 || w->decode_ctx < 0 || w->concurrency < 0)
        return pd_err_set(e, PD_EINVAL, "workload: rate, decode batch, decode context and concurrency must not be negative");
    if (w->rate > 0 && w->concurrency > 0)
        return pd_err_set(e, PD_EINVAL, "--request-rate and --concurrency: an open loop (requests arrive at a rate) or a "
                                        "closed loop (C clients), not both");
    if (w->lockstep && w->concurrency <= 0)
        return pd_err_set(e, PD_EINVAL, "--phase lockstep: a closed loop's phase assumption: needs --concurrency");
    if (!w->lockstep && (w->num_prompts || w->prefill_max_requests || w->prefill_first))
        return pd_err_set(e, PD_EINVAL, "%s: modelled in the lockstep closed loop only (--phase lockstep)",
                          w->num_prompts ? "--num-prompts" : w->prefill_max_requests ? "--prefill-max-requests"
                                                                                    : "--schedule prefill-first");
    if (w->num_prompts < 0 || w->prefill_max_requests < 0)
        return pd_err_set(e, PD_EINVAL, "--num-prompts and --prefill-max-requests must not be negative");
    if (w->num_prompts > 0 && w->num_prompts % w->concurrency)
        return pd_err_set(e, PD_EINVAL, "--num-prompts %lld: a multiple of --concurrency %lld (each client of the lockstep "
                          "sends num-prompts / concurrency requests)", (long long)w->num_prompts,
                          (long long)w->concurrency);
    return 0;
}

void pd_perf_prefill(const struct pd_plan *p, const struct pd_workload *w, struct pd_perf *f)
{
    const struct pd_role_plan *P = &p->role[PD_ROLE_PREFILL];
    /* the computed part of a prompt in chunks of max-num-batched-tokens */
    int64_t C = p->o.max_num_batched_tokens, cached = (int64_t)floor((double)w->isl * w->cached);
    int64_t fresh = w->isl - cached;
    f->prefill_s = 0;
    for (int64_t off = cached; off < w->isl; off += C) {
        struct pd_step s;
        pd_perf_step(p, PD_ROLE_PREFILL, 1, w->isl - off < C ? w->isl - off : C, off, &s);
        f->prefill_s += s.total_s;
    }
    double rank_tok_s;
    if (fresh <= C) {
        /* the prompts one step takes: as many as the chunk holds, but no more than the server
         * admits (max-num-seqs, or those of max-model-len that fit, as --emit writes): vLLM's and
         * SGLang's schedulers run at most that many sequences a step */
        int64_t seqs = C / fresh, admit = pd_plan_admitted_seqs(p, PD_ROLE_PREFILL);
        if (admit >= 1 && seqs > admit)
            seqs = admit;
        pd_perf_step(p, PD_ROLE_PREFILL, seqs, fresh, cached, &f->prefill_step);
        rank_tok_s = (double)seqs * w->isl / f->prefill_step.total_s;
    } else {
        pd_perf_step(p, PD_ROLE_PREFILL, 1, C, cached, &f->prefill_step);
        rank_tok_s = (double)w->isl / f->prefill_s;
    }
    f->prefill_tok_s_card = rank_tok_s / P->o.tp;
    f->prefill_rank_tok_s = rank_tok_s;
    pd_perf_instances(f, PD_ROLE_PREFILL, P->o.dp, P->o.instances, w);
    f->prefill_bound = f->prefill_step.bound;
    f->handoff_s = p->hw.rdma.latency_s + (double)pd_kv_seq_bytes(&p->kv, w->isl) / p->hw.rdma.bandwidth_Bps;
}

void pd_perf_decode(const struct pd_plan *p, const struct pd_workload *w, struct pd_perf *f)
{
    const struct pd_role_plan *D = &p->role[PD_ROLE_DECODE];
    /* the batch the KV pool holds at the final context, capped by the sequences the servers
     * admit (max-num-seqs, or fewer: those of max-model-len that fit, as --emit writes) */
    int64_t seq = pd_kv_seq_bytes(&p->kv, w->isl + w->osl), admit = pd_plan_admitted_seqs(p, PD_ROLE_DECODE);
    const int64_t room = pd_budget_seq_room(&D->b);
    f->batch_cap = room > 0 && seq > 0 ? room / seq : 0;
    f->batch = w->decode_batch > 0 ? w->decode_batch : f->batch_cap < admit ? f->batch_cap : admit;
    int64_t b = f->batch > 0 ? f->batch : 1;
    int64_t ctx = w->decode_ctx > 0 ? w->decode_ctx : w->isl + w->osl / 2;
    pd_perf_step(p, PD_ROLE_DECODE, b, pd_perf_decode_tokens(p), ctx, &f->decode_step);
    f->mtp = p->mtp;
    f->tokens_per_step = pd_perf_tokens_per_step(p);
    f->tpot_s = f->decode_step.total_s / f->tokens_per_step;
    f->user_tok_s = 1 / f->tpot_s;
    f->decode_rank_out_s = (double)b * f->tokens_per_step / f->decode_step.total_s;
    f->decode_tok_s_card = f->decode_rank_out_s / D->o.tp;
    pd_perf_instances(f, PD_ROLE_DECODE, D->o.dp, D->o.instances, w);
    f->decode_bound = f->batch > 0 && f->batch < p->o.max_num_seqs && !w->decode_batch
                          ? PD_BOUND_CAPACITY : f->decode_step.bound;
}

void pd_perf_combine(const struct pd_plan *p, const struct pd_workload *w, struct pd_perf *f)
{
    const struct pd_role_plan *P = &p->role[PD_ROLE_PREFILL], *D = &p->role[PD_ROLE_DECODE];
    f->w = *w;
    f->fits = P->b.fits_weights && D->b.fits_weights && pd_budget_seq_room(&P->b) >= pd_kv_seq_bytes(&p->kv, w->isl) &&
              f->batch >= 1 && f->batch <= f->batch_cap;
    f->request_s = p->hw.eff.request_s;
    struct pd_match m = pd_perf_match(f->request_s, f, f, P->o.dp * P->o.instances, P->cards + D->cards, w);
    f->ttft_s = m.ttft_s;
    f->ttft_rate_s = m.ttft_rate_s;
    f->req_s = m.req_s;
    f->tok_s_card = m.tok_s_card;
}

void pd_perf_instances(struct pd_perf *f, enum pd_role r, int dp, int instances, const struct pd_workload *w)
{
    if (r == PD_ROLE_PREFILL)
        f->prefill_req_s = f->prefill_rank_tok_s * dp * instances / w->isl;
    else
        f->decode_req_s = f->decode_rank_out_s * dp * instances / w->osl;
}

struct pd_match pd_perf_match(double request_s, const struct pd_perf *pre, const struct pd_perf *dec, int servers,
                              int cards, const struct pd_workload *w)
{
    struct pd_match m;
    m.ttft_s = request_s + pre->prefill_s + pre->handoff_s + dec->decode_step.total_s;
    m.req_s = pre->prefill_req_s < dec->decode_req_s ? pre->prefill_req_s : dec->decode_req_s;
    /* past what the deployment sustains (prefill or decode) the queue grows without end */
    /* and below it, the waits for a prefill server and then for a decode slot: the decode side
     * is dec->decode_req_s x (osl x TPOT) slots, each held osl x TPOT (a request near the decode
     * side's capacity waited for a slot the prompt queue alone never showed) */
    const double hold = (double)w->osl * dec->tpot_s;
    const double slots = dec->decode_req_s * hold;
    m.ttft_rate_s = w->rate > m.req_s ? INFINITY
                    : m.ttft_s + pd_perf_queue_wait(servers, pre->prefill_s, w->rate) +
                          (slots >= 1 && slots < INT_MAX ? pd_perf_queue_wait((int)llround(slots), hold, w->rate) : 0);
    m.tok_s_card = cards > 0 ? m.req_s * w->osl / cards : 0;
    return m;
}

double pd_perf_queue_wait(int servers, double service_s, double rate)
{
    /* M/D/c: half the M/M/c wait (Allen-Cunneen with a deterministic service, cs = 0) */
    if (rate <= 0)
        return 0;
    double a = rate * service_s;
    return a >= servers ? INFINITY : 0.5 * erlang_c(servers, a) / (servers / service_s - rate);
}

const char *pd_closed_limit_name(enum pd_closed_limit l)
{
    switch (l) {
    case PD_CLOSED_CLIENTS: return "clients";
    case PD_CLOSED_PREFILL: return "prefill capacity";
    case PD_CLOSED_DECODE_SLOTS: return "decode slots";
    }
    return "?";
}

/* The decode step at a fractional batch: linear between the integer batches around it. */
static double step_at(double b, double (*step)(void *, int64_t), void *ctx)
{
    int64_t lo = (int64_t)floor(b);
    double t = step(ctx, lo);
    return b > (double)lo ? t + (b - (double)lo) * (step(ctx, lo + 1) - t) : t;
}

/* The closed loop's requests/s at batch b, with prefill's queue (below): x, and the time in
 * prefill with its queue (rpre) and in decode (rd). */
struct closed_in {
    double C, S, B, Sp, pre_s, prefill_s, prefill_req_s, tokens_per_step;
    int64_t osl;
    double (*step)(void *, int64_t);
    void *ctx;
};

static double closed_x(const struct closed_in *in, double b, double *rpre, double *rd)
{
    const double st = step_at(b, in->step, in->ctx), s = in->C > 1 ? (in->C - 1) / in->C : 0, P = in->prefill_s;
    *rd = st + (double)(in->osl - 1) * st / in->tokens_per_step;
    const double A = in->pre_s - P + *rd, xd = in->S * in->B / *rd, cap = fmin(in->prefill_req_s, xd);
    /* the clients' loop: u = R_pre solves Sp u^2 + (Sp (A - P) - C P s) u - Sp P A = 0, from
     * u = P (1 + s q), q = x u / Sp, x = C / (A + u) */
    double u = P;
    if (P > 0 && s > 0) {
        double beta = in->Sp * (A - P) - in->C * P * s;
        u = (-beta + sqrt(beta * beta + 4 * in->Sp * in->Sp * P * A)) / (2 * in->Sp);
    }
    double x = in->C / (A + u);
    if (x > cap) {           /* prefill's capacity or the decode slots bind: the queue at that x */
        x = cap;
        double rho = x * P * s / in->Sp;
        u = rho < 1 ? P / (1 - rho) : INFINITY;
    }
    *rpre = u;
    return x;
}

/* The right side of the closed loop's batch equation at batch b (below). */
static double closed_next(const struct closed_in *in, double b)
{
    double rpre, rd, x = closed_x(in, b, &rpre, &rd);
    return fmin(in->B, 1 + (in->C - 1) * rd * x / (in->C * in->S));
}

/* The closed loop. C clients; S_d = decode DP ranks with B slots each (max-num-seqs, capped by
 * the KV pool); S_p prefill DP ranks, each prefilling one prompt in P; R_p = request + P +
 * hand-off (queue-free); X_p = prefill's requests/s; step(b) = the decode step at a mean batch b
 * per rank; tps = tokens per step (MTP).
 *
 *   TPOT(b) = step(b) / tps
 *   R_d(b)  = step(b) + (osl - 1) x TPOT(b)       a request's time in a decode slot: the first
 *                                                 step gives the first token, each later token a TPOT
 *   R_pre   = P x (1 + (C - 1) / C x Q_p)         time in prefill: an arriving prompt waits for
 *                                                 the share of the queue the other C - 1 clients
 *                                                 leave at its prefill rank (mean value analysis,
 *                                                 Schweitzer), Q_p = X x R_pre / S_p per rank
 *   X(b)    = min( C / (R_p - P + R_pre + R_d(b)),  X_p,  S_d x B / R_d(b) )    requests/s
 *   cycle   = C / X(b)                            (Little's law over the whole loop)
 *   wait    = cycle - R_p - R_d(b)                the prefill queue, and where prefill's capacity
 *                                                 or the decode slots bind, the rest of the cycle
 *   limit   = the decode slots if they bind, prefill if X >= 0.99 X_p, else the clients
 *   b       = min( B, 1 + (C - 1) x R_d(b) / (cycle x S_d) )
 *             the request itself plus its rank's share of the other C - 1 clients' time in decode
 *   TTFT    = R_p + wait + step(b),   cycle = TTFT + (osl - 1) x TPOT(b)
 *   output tokens/s = C x osl / cycle,  requests/s = C / cycle
 *
 * For a given b the clients' loop gives R_pre in closed form (a quadratic, closed_x); the fixed
 * point in b is found by bisection on [1, B]: the right side is continuous (step is interpolated
 * between integer batches) and lies in [1, B]. C = 1 gives b = 1, no wait, and the open loop's
 * queue-free TTFT and TPOT. Below prefill's capacity prompts that arrive together wait for each
 * other (the queue a deterministic loop leaves out); at it the cycle stretches to C / X_p.
 * Clients beyond the decode slots (when S_d x B / R_d binds) wait for a slot; the wait is in
 * their TTFT. */
void pd_perf_closed(int64_t clients, int64_t osl, double pre_s, double prefill_s, int prefill_ranks,
                    double prefill_req_s, int ranks, int64_t slots, double tokens_per_step,
                    double (*step)(void *ctx, int64_t b), void *ctx, int cards, struct pd_closed *out)
{
    /* C clients never fill more than C slots of a rank: the batch stays within the step table */
    const double C = (double)clients, S = ranks > 0 ? ranks : 1;
    const double B = slots > clients ? C : slots > 1 ? (double)slots : 1;
    const struct closed_in in = {C, S, B, prefill_ranks > 0 ? prefill_ranks : 1, pre_s, prefill_s, prefill_req_s,
                                 tokens_per_step, osl, step, ctx};
    double lo = 1, hi = B, b;
    if (clients <= 1 || B <= 1) {
        b = 1;
    } else if (closed_next(&in, B) >= B) {
        b = B;                                   /* every slot busy */
    } else {
        for (int it = 0; it < 64 && hi - lo > 1e-9; it++) {
            b = 0.5 * (lo + hi);
            if (closed_next(&in, b) > b)
                lo = b;
            else
                hi = b;
        }
        b = 0.5 * (lo + hi);
    }
    double rpre, rd, x = closed_x(&in, b, &rpre, &rd), st = step_at(b, step, ctx), tpot = st / tokens_per_step;
    const double xd = S * B / rd;
    out->batch = b;
    out->tpot_s = tpot;
    out->cycle_s = C / x;
    /* what sets the cycle: the decode slots when they bind, prefill when its ranks are busy 99% of
     * the time or more (its queue then holds nearly every client that is not decoding: mean value
     * analysis only approaches X_p), else the clients themselves */
    out->limit = xd < prefill_req_s && x >= xd * (1 - 1e-12) ? PD_CLOSED_DECODE_SLOTS
                 : x >= 0.99 * prefill_req_s ? PD_CLOSED_PREFILL : PD_CLOSED_CLIENTS;
    /* (a difference of sums: a residue of rounding, below 1e-12 of the cycle, is no wait) */
    out->wait_s = out->cycle_s - pre_s - rd > 1e-12 * out->cycle_s ? out->cycle_s - pre_s - rd : 0;
    out->ttft_s = pre_s + out->wait_s + st;
    out->req_s = x;
    out->tok_s = x * (double)osl;
    out->slots = slots > 1 ? slots : 1;
    out->tok_s_card = cards > 0 ? out->tok_s / cards : 0;
}

struct decode_ctx {
    const struct pd_plan *p;
    int64_t tokens, ctx;
};

static double decode_step_s(void *ctx, int64_t b)
{
    const struct decode_ctx *d = ctx;
    struct pd_step s;
    pd_perf_step(d->p, PD_ROLE_DECODE, b, d->tokens, d->ctx, &s);
    return s.total_s;
}

int pd_perf_eval(const struct pd_plan *p, const struct pd_workload *w, struct pd_perf *f, pd_err *e)
{
    memset(f, 0, sizeof *f);
    int rc = check_workload(w, e);
    if (rc)
        return rc;
    if ((rc = check_length(p, w, e)))
        return rc;
    if (p->o.aggregated) {
        if (w->lockstep && (rc = pd_perf_lockstep_check(p, w, e)))
            return rc;
        return pd_perf_agg(p, w, f, e);
    }
    if (w->lockstep && w->prefill_first)
        return pd_err_set(e, PD_EINVAL, "--schedule prefill-first: a schedule of aggregated steps (--aggregated); a "
                          "disaggregated plan's prefill and decode run on their own ranks");
    if (w->lockstep && (rc = pd_perf_lockstep_check(p, w, e)))
        return rc;
    pd_perf_prefill(p, w, f);
    pd_perf_decode(p, w, f);
    pd_perf_combine(p, w, f);
    if (w->concurrency > 0 && w->lockstep) {
        return pd_perf_lockstep_pd(p, w, f, &f->closed, e);
    } else if (w->concurrency > 0) {
        const struct pd_role_plan *D = &p->role[PD_ROLE_DECODE];
        struct decode_ctx d = {p, pd_perf_decode_tokens(p), w->decode_ctx > 0 ? w->decode_ctx : w->isl + w->osl / 2};
        pd_perf_closed(w->concurrency, w->osl, f->request_s + f->prefill_s + f->handoff_s, f->prefill_s,
                       p->role[PD_ROLE_PREFILL].o.dp * p->role[PD_ROLE_PREFILL].o.instances, f->prefill_req_s,
                       D->o.dp * D->o.instances, f->batch, f->tokens_per_step, decode_step_s, &d,
                       p->role[PD_ROLE_PREFILL].cards + D->cards, &f->closed);
    }
    return 0;
}

static void closed_text(FILE *o, const struct pd_perf *f);

static void step_text(FILE *o, const char *name, const struct pd_step *s)
{
    fprintf(o, "  %-8s %7lld %10.3f %10.3f %10.3f %10.3f %10.3f %10.3f  %s\n", name, (long long)s->tokens,
            s->gemm_compute_s * 1e3, s->gemm_memory_s * 1e3, s->attn_s * 1e3, s->a2a_s * 1e3, s->overhead_s * 1e3,
            s->total_s * 1e3, pd_bound_name(s->bound));
}

char *pd_perf_text(const struct pd_plan *p, const struct pd_perf *f)
{
    char *buf = NULL;
    size_t n = 0;
    FILE *o = open_memstream(&buf, &n);
    if (!o)
        return NULL;
    const struct pd_role_plan *P = &p->role[PD_ROLE_PREFILL], *D = &p->role[PD_ROLE_DECODE];
    fprintf(o, "Performance (isl %lld, osl %lld tokens%s; efficiency factors from %s, docs/perf-model.md)\n",
            (long long)f->w.isl, (long long)f->w.osl, f->w.cached > 0 ? ", prefix-cached share given" : "",
            p->hw.source);
    fprintf(o, "  one step of one DP rank, ms:\n");
    fprintf(o, "  %-8s %7s %10s %10s %10s %10s %10s %10s  %s\n", "role", "tokens", "gemm-comp", "gemm-mem",
            "attention", "a2a", "overhead", "total", "bound");
    step_text(o, f->aggregated ? "mixed" : "prefill", &f->prefill_step);
    step_text(o, "decode", &f->decode_step);
    for (int r = 0; r < 2; r++) {
        const struct pd_role_plan *rp = &p->role[r];
        fprintf(o, "%s %.2f (%s)", r ? ", decode" : "  MoE load, busiest rank / mean: prefill",
                r ? f->decode_step.imbalance : f->prefill_step.imbalance,
                rp->ep <= 1 ? "one rank" : rp->imbalance > 0 ? "measured on its placement from the expert stats"
                : rp->o.redundant > 0 ? "hardware file, with redundant experts" : "hardware file");
    }
    fputc('\n', o);
    if (f->mtp.k > 0) {
        fprintf(o, "  speculative     %d MTP draft%s per decode step, acceptance per position given the ones before it",
                f->mtp.k, f->mtp.k > 1 ? "s" : "");
        for (int j = 0; j < f->mtp.k; j++)
            fprintf(o, "%s%.3f", j ? " " : " ", f->mtp.a[j]);
        fprintf(o, " (%s): %.3f tokens per step\n", p->mtp_source, f->tokens_per_step);
    }
    if (f->aggregated) {
        pd_perf_agg_text(p, f, o);
        closed_text(o, f);
        fclose(o);
        return buf;
    }
    if (!f->fits) {   /* said first: the figures below are of steps that cannot run */
        char why[160];
        if (!P->b.fits_weights || !D->b.fits_weights)
            snprintf(why, sizeof why, "the %s %s do not fit a card", !P->b.fits_weights ? "prefill" : "decode",
                     pd_budget_overflow(!P->b.fits_weights ? &P->b : &D->b));
        else
            snprintf(why, sizeof why, "%s", pd_budget_seq_room(&P->b) < pd_kv_seq_bytes(&p->kv, f->w.isl)
                                                ? "a prefill card's KV pool cannot hold one prompt"
                                                : "a decode card's KV pool holds no sequence of this workload");
        fprintf(o, "  DOES NOT FIT: %s; the figures below are of steps that cannot run\n", why);
    }
    fprintf(o, "  TTFT            %10.1f ms  = request %.1f ms + prefill %.1f ms + KV hand-off %.1f ms (%s) + first decode "
            "step %.1f ms\n", f->ttft_s * 1e3, f->request_s * 1e3, f->prefill_s * 1e3, f->handoff_s * 1e3,
            p->hw.rdma.name, f->decode_step.total_s * 1e3);
    if (f->w.rate > 0 && !isfinite(f->ttft_rate_s))
        fprintf(o, "  TTFT at %.2f req/s   unbounded: the rate is above the %.2f requests/s this deployment sustains "
                   "(rate-matched below), so the queue grows without end\n", f->w.rate, f->req_s);
    else if (f->w.rate > 0)
        fprintf(o, "  TTFT at %.2f req/s %10.1f ms (queueing for %d prefill DP ranks, then for %.0f decode slots)\n",
                f->w.rate, f->ttft_rate_s * 1e3, P->o.dp * P->o.instances, f->decode_req_s * f->w.osl * f->tpot_s);
    fprintf(o, "  TPOT            %10.2f ms  (%.1f tokens/s per user; batch %lld per DP rank, KV room for %lld; "
               "%.2f tokens per step)\n",
            f->tpot_s * 1e3, f->user_tok_s, (long long)f->batch, (long long)f->batch_cap, f->tokens_per_step);
    if (!f->w.decode_batch && f->batch < f->batch_cap && f->batch < p->o.max_num_seqs)
        fprintf(o, "                  (the batch is --max-num-seqs %lld lowered to the %lld sequences of max-model-len "
                   "%lld a decode rank's KV pool holds, as --emit writes)\n",
                (long long)p->o.max_num_seqs, (long long)f->batch, (long long)p->o.max_model_len);
    fprintf(o, "  prefill         %10.0f input tokens/s per card, %.0f per node; %.2f requests/s in all (%s)\n",
            f->prefill_tok_s_card, f->prefill_tok_s_card * p->hw.cards_per_node, f->prefill_req_s,
            pd_bound_name(f->prefill_bound));
    fprintf(o, "  decode          %10.0f output tokens/s per card, %.0f per node; %.2f requests/s in all (%s)\n",
            f->decode_tok_s_card, f->decode_tok_s_card * p->hw.cards_per_node, f->decode_req_s,
            pd_bound_name(f->decode_bound));
    fprintf(o, "  rate-matched    %10.2f requests/s, %.0f output tokens/s per card over %d cards (%s limits)%s\n",
            f->req_s, f->tok_s_card, P->cards + D->cards, f->prefill_req_s < f->decode_req_s ? "prefill" : "decode",
            f->fits ? "" : "; DOES NOT FIT");
    closed_text(o, f);
    fclose(o);
    return buf;
}

static void closed_text(FILE *o, const struct pd_perf *f)
{
    if (f->w.concurrency > 0) {
        const struct pd_closed *c = &f->closed;
        if (f->w.lockstep)
            fprintf(o, "  closed loop, %lld client%s in lockstep (equal requests, started together; %s):\n",
                    (long long)f->w.concurrency, f->w.concurrency == 1 ? "" : "s",
                    f->w.num_prompts ? "the run's means, throughput over its duration" : "the steady state");
        else
            fprintf(o, "  closed loop, %lld client%s (each sends its next request when its last one finishes; %s limits):\n",
                    (long long)f->w.concurrency, f->w.concurrency == 1 ? "" : "s", pd_closed_limit_name(c->limit));
        fprintf(o, "    TTFT          %10.1f ms  (%.1f ms of it waiting for %s)\n", c->ttft_s * 1e3, c->wait_s * 1e3,
                c->limit == PD_CLOSED_DECODE_SLOTS ? "a decode slot" : "prefill");
        fprintf(o, "    TPOT          %10.2f ms  (batch %.2f per decode DP rank of %lld slots)\n", c->tpot_s * 1e3,
                c->batch, (long long)c->slots);
        fprintf(o, "    cycle         %10.1f ms  = TTFT + (osl - 1) x TPOT\n", c->cycle_s * 1e3);
        fprintf(o, "    throughput    %10.2f requests/s, %.1f output tokens/s (%.1f per card)\n", c->req_s, c->tok_s,
                c->tok_s_card);
    }
}

static json_t *step_json(const struct pd_step *s)
{
    return json_pack("{s:I,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:s}", "tokens", (json_int_t)s->tokens, "gemm_compute_s",
                     s->gemm_compute_s, "gemm_memory_s", s->gemm_memory_s, "attention_s", s->attn_s, "a2a_s", s->a2a_s,
                     "overhead_s", s->overhead_s, "total_s", s->total_s, "flops", s->flops, "bytes", s->bytes,
                     "expert_imbalance", s->imbalance, "bound", pd_bound_name(s->bound));
}

static json_t *closed_json(const struct pd_perf *f)
{
    const struct pd_closed *c = &f->closed;
    if (f->w.concurrency <= 0)
        return json_null();
    if (!isfinite(c->cycle_s))
        return json_pack("{s:I,s:n}", "concurrency", (json_int_t)f->w.concurrency, "cycle_s");
    return json_pack("{s:I,s:s,s:f,s:I,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:s}", "concurrency", (json_int_t)f->w.concurrency,
                     "phase", f->w.lockstep ? "lockstep" : "random",
                     "batch", c->batch, "slots", (json_int_t)c->slots, "wait_s", c->wait_s, "ttft_s", c->ttft_s, "tpot_s", c->tpot_s, "cycle_s",
                     c->cycle_s, "requests_per_s", c->req_s, "output_tokens_per_s", c->tok_s,
                     "output_tokens_per_s_card", c->tok_s_card, "limit", pd_closed_limit_name(c->limit));
}

void *pd_perf_json(const struct pd_perf *f)
{
    json_t *j = json_pack("{s:I,s:I,s:f,s:f,s:o,s:o,s:f,s:f,s:f,s:f,s:o,s:f,s:f,s:I,s:I,s:f,s:f,s:f,s:f,s:f,s:f,s:s,s:s,s:b}",
                     "isl", (json_int_t)f->w.isl, "osl", (json_int_t)f->w.osl, "cached", f->w.cached, "rate", f->w.rate,
                     "prefill_step", step_json(&f->prefill_step), "decode_step", step_json(&f->decode_step),
                     "request_s", f->request_s, "prefill_s", f->prefill_s, "handoff_s", f->handoff_s, "ttft_s", f->ttft_s, "ttft_at_rate_s",
                     /* null: the rate is past what prefill sustains, the queue grows without bound */
                     isfinite(f->ttft_rate_s) ? json_real(f->ttft_rate_s) : json_null(), "prefill_tokens_per_s_card",
                     f->prefill_tok_s_card, "prefill_requests_per_s", f->prefill_req_s, "batch", (json_int_t)f->batch,
                     "batch_cap", (json_int_t)f->batch_cap, "tokens_per_step", f->tokens_per_step, "tpot_s", f->tpot_s,
                     "decode_tokens_per_s_card", f->decode_tok_s_card, "decode_requests_per_s", f->decode_req_s,
                     "requests_per_s", f->req_s, "tokens_per_s_card", f->tok_s_card, "prefill_bound",
                     pd_bound_name(f->prefill_bound), "decode_bound", pd_bound_name(f->decode_bound), "fits", f->fits);
    if (j) {
        json_object_set_new(j, "closed_loop", closed_json(f));
        json_t *a = json_array();
        for (int i = 0; i < f->mtp.k; i++)
            json_array_append_new(a, json_real(f->mtp.a[i]));
        json_object_set_new(j, "num_speculative_tokens", json_integer(f->mtp.k));
        json_object_set_new(j, "mtp_acceptance", a);
    }
    if (j && f->aggregated) {
        const struct pd_agg *a = &f->agg;
        json_object_set_new(j, "aggregated",
                            json_pack("{s:I,s:I,s:I,s:f,s:f,s:f,s:f,s:b}", "batch", (json_int_t)a->batch, "chunk_tokens",
                                      (json_int_t)a->chunk, "chunks_per_prompt", (json_int_t)a->chunks, "mixed_step_s",
                                      a->mixed_step.total_s, "decode_step_s", a->decode_step.total_s, "chunk_share",
                                      a->chunk_share, "mean_step_s", a->step_s, "fed", a->fed));
    } else if (j) {
        json_object_set_new(j, "aggregated", json_null());
    }
    return j;
}

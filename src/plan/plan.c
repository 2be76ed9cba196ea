/* Building a plan: inventory -> placement -> per-card budgets -> KV capacity, scenarios,
 * hand-off times and the EP-size sweep. */
#include "plan/plan.h"
#include "model/jsonf.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *pd_role_name(enum pd_role r)
{
    return r == PD_ROLE_PREFILL ? "prefill" : "decode";
}

const char *pd_verdict_text(enum pd_verdict v)
{
    switch (v) {
    case PD_V_NOT_DIVISIBLE: return "experts do not divide";
    case PD_V_WEIGHTS_DONT_FIT: return "does not fit (weights)";
    case PD_V_KV_SHORT: return "fits, KV short of target";
    case PD_V_FITS: return "fits";
    }
    return "?";
}

void pd_plan_opts_default(struct pd_plan_opts *o)
{
    memset(o, 0, sizeof *o);
    o->model = "deepseek-v4-flash";
    o->hardware = "atlas-800i-a2";
    o->role[PD_ROLE_PREFILL] = (struct pd_role_opts){.dp = 8, .tp = 1, .instances = 4};
    o->role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 32, .tp = 1, .instances = 1};
    o->util = 0.9;
    o->max_num_seqs = 30;
    o->max_model_len = 32768;
    o->max_num_batched_tokens = 4096;
    o->quant = "w8a8";
    o->kv_dtype = PD_KV_AUTO;
    o->mtp = -1;
    o->runtime[0] = o->runtime[1] = -1;
    o->n_handoff = 2;
    o->handoff_tokens[0] = 8000;
    o->handoff_tokens[1] = 131072;
}

int pd_plan_stack_parse(const char *s, enum pd_plan_stack *out, pd_err *e)
{
    if (s && strcmp(s, "vllm") == 0)
        *out = PD_STACK_VLLM;
    else if (s && strcmp(s, "sglang") == 0)
        *out = PD_STACK_SGLANG;
    else
        return pd_err_set(e, PD_EINVAL, "--stack %s: expected vllm or sglang", s ? s : "");
    return 0;
}

const char *pd_plan_stack_name(enum pd_plan_stack s)
{
    return s == PD_STACK_SGLANG ? "sglang" : "vllm";
}

/* The one place that says whose layout the plan counts (kvsize.h): on Ascend cards a bf16 V4 cache
 * is vllm-ascend's block ids or, for SGLang, its NPU pools; a model a layout does not fit keeps
 * pdmoe's, which the plan says. Other cards without FP8 (a CPU file of pdmoe calibrate's, for
 * pdmoe's own engine) keep pdmoe's layout, the engine's pool's; GPUs keep it for either stack. */
static void plan_kv_layout(struct pd_plan *p, enum pd_kv_dtype kvd, int64_t flat)
{
    if (!pd_hardware_is_ascend(&p->hw) || p->model.arch != PD_ARCH_DEEPSEEK_V4 || kvd != PD_KV_BF16 || flat)
        return;
    pd_err ignored = {0};
    struct pd_kv_size k = p->kv;
    int rc = p->o.stack == PD_STACK_SGLANG ? pd_kv_size_sglang_npu(&k, &p->model, p->include_mtp, &ignored)
                                           : pd_kv_size_vllm_ascend(&k, &p->model, &ignored);
    if (rc == 0)
        p->kv = k;
}

/* What the stacks store when their --kv-cache-dtype is left at "auto": for a model with a
 * lightning indexer (DeepSeek-V3.2, V4: config field index_topk), vLLM's own fp8 layout
 * (fp8_ds_mla) on cards with FP8; on Ascend 910B/910C, which have no FP8 type, vllm-ascend sets the
 * cache to the model's dtype, bf16, whatever the flag says (vllm_ascend/platform.py, for any
 * config with index_topk; fp8 only on A5), and SGLang's Ascend runs of V4 use bf16. Other models:
 * the model's dtype, bf16, as auto means in vLLM and SGLang. */
enum pd_kv_dtype pd_plan_kv_dtype_default(const struct pd_model *m, const struct pd_hardware *hw)
{
    return m->index_topk > 0 && hw->fp8_flops > 0 ? PD_KV_FP8 : PD_KV_BF16;
}

static int64_t class_ii_per_card(const struct pd_inventory *inv, int tp)
{
    int64_t b = 0;
    for (int g = 0; g < PD_G_COUNT; g++) {
        int64_t x = inv->group_bytes[g][PD_CLASS_II];
        b += pd_group_tp_split((enum pd_group)g) ? (x + tp - 1) / tp : x;
    }
    return b;
}

/* docs/memory-model.md, "Activations". */
static void activation(const struct pd_plan *p, enum pd_role r, int tp, struct pd_activation *a)
{
    const struct pd_model *m = &p->model;
    const int64_t H = m->hidden_size, hc = m->hc_mult > 0 ? m->hc_mult : 1;
    const int64_t k = m->n_experts_per_tok, I = m->moe_intermediate_size;
    memset(a, 0, sizeof *a);
    /* an aggregated step holds up to max-num-batched-tokens, decode and prefill tokens together; a
     * decode step each sequence's token and, with MTP, its drafts (1 + k tokens, every one of
     * which the verification takes logits of) */
    const int decode = r == PD_ROLE_DECODE && !p->o.aggregated;
    a->tokens = decode ? p->o.max_num_seqs * (1 + p->mtp.k) : p->o.max_num_batched_tokens;
    const int64_t T = a->tokens;
    a->residual = T * 2 * hc * H * 4;          /* mHC streams in and out of a block, fp32 */
    a->working = T * 4 * H * 4;                /* normalised input, sublayer output, 2 temporaries */
    int64_t q = m->arch == PD_ARCH_DEEPSEEK_V4
                    ? 2 * (int64_t)m->n_heads * m->head_dim * 2
                    : (int64_t)m->n_heads * (m->qk_nope_head_dim + m->qk_rope_head_dim + m->v_head_dim) * 2;
    a->attention = T * q / tp;                 /* query and attention output, bf16 */
    a->moe = T * (2 * k * H * 2 + k * 2 * I * 2); /* dispatch send + receive (bf16) and expert gate/up */
    int csa = 0;
    for (int l = 0; l < p->model.n_layers; l++)
        csa |= m->arch == PD_ARCH_DEEPSEEK_V4 && m->compress_ratio[l] == 4;
    if (csa)                                   /* indexer scores of each query vs. all entries, fp32 */
        a->indexer = T * (p->o.max_model_len / 4) * 4;
    int64_t rows = decode ? T : T < p->o.max_num_seqs ? T : p->o.max_num_seqs;
    a->logits = rows * m->vocab_size * 4 / tp;
    a->total = a->residual + a->working + (a->attention > a->moe ? a->attention : a->moe) + a->indexer + a->logits;
}

/* A role's expert counts: [layers][experts] tokens, then their sum per expert; and, since placing
 * each layer's replicas is the costly part of a measured imbalance and depends only on the EP size
 * and the redundant experts, which the search's role layouts share, the imbalances so far. */
struct pd_expert_load {
    char path[512];
    double *tokens;
    int layers, experts;
    int n, cap;
    struct {
        int ep, redundant;
        double imbalance;
    } *memo;
};

static void expert_load_free(struct pd_expert_load *x)
{
    if (!x)
        return;
    free(x->tokens);
    free(x->memo);
    free(x);
}

/* {"tokens_per_expert": [[tokens routed to each expert] per layer]}, as `pdmoe generate
 * --expert-stats` writes it and GET /expert_stats answers it: one row per layer of the model
 * (num_hidden_layers; a dense layer's row is zeros), the model's routed experts in each. Counts
 * from another model are refused by the field that shows it: the row count, "experts" and
 * "model_type" when the file has them. flag names the option in errors. */
static int load_expert_stats(const struct pd_plan *p, const char *flag, const char *path, struct pd_expert_load **out,
                             pd_err *e)
{
    *out = NULL;
    json_t *root = pd_json_load_file(path, e);
    if (!root)
        return e ? e->code : PD_EFORMAT;
    json_t *rows = json_object_get(root, "tokens_per_expert");
    int E = p->inv.n_experts, rc = 0;
    size_t L = json_is_array(rows) ? json_array_size(rows) : 0;
    double total = 0;
    struct pd_expert_load *x = NULL;
    if (E < 1) {
        rc = pd_err_set(e, PD_EINVAL, "%s %s: the model has no routed experts", flag, path);
        goto out;
    }
    if (L == 0 || L > 4096) {
        rc = pd_err_set(e, PD_EINVAL, "%s %s: field \"tokens_per_expert\": expected an array of 1 to 4096 "
                        "layers, each the tokens routed to each expert", flag, path);
        goto out;
    }
    json_t *mt = json_object_get(root, "model_type"), *xe = json_object_get(root, "experts");
    const char *arch = pd_model_arch_name(p->model.arch);
    if (mt && (!json_is_string(mt) || strcmp(json_string_value(mt), arch))) {
        rc = pd_err_set(e, PD_EINVAL, "%s %s: field \"model_type\": %s, but %s is %s: counts from another model",
                        flag, path, json_is_string(mt) ? json_string_value(mt) : "not a string", p->model.name, arch);
        goto out;
    }
    if (xe && (!json_is_integer(xe) || json_integer_value(xe) != E)) {
        rc = pd_err_set(e, PD_EINVAL, "%s %s: field \"experts\": %lld, but %s has %d routed experts: counts from "
                        "another model", flag, path, json_is_integer(xe) ? (long long)json_integer_value(xe) : -1LL,
                        p->model.name, E);
        goto out;
    }
    if (L != (size_t)p->model.n_layers) {
        rc = pd_err_set(e, PD_EINVAL, "%s %s: field \"tokens_per_expert\": %zu layers, but %s has %d "
                        "(num_hidden_layers): counts from another model", flag, path, L, p->model.name,
                        p->model.n_layers);
        goto out;
    }
    x = calloc(1, sizeof *x);
    if (x)
        x->tokens = calloc((L + 1) * (size_t)E, sizeof *x->tokens);
    if (!x || !x->tokens) {
        rc = pd_err_set(e, PD_ENOMEM, "%s %s: out of memory", flag, path);
        goto out;
    }
    snprintf(x->path, sizeof x->path, "%s", path);
    x->layers = (int)L;
    x->experts = E;
    double *sum = x->tokens + L * (size_t)E;
    for (size_t l = 0; l < L && !rc; l++) {
        json_t *row = json_array_get(rows, l);
        if (!json_is_array(row) || json_array_size(row) != (size_t)E) {
            rc = pd_err_set(e, PD_EINVAL, "%s %s: field \"tokens_per_expert[%zu]\": expected %d numbers "
                            "(the model's routed experts)", flag, path, l, E);
            break;
        }
        for (int i = 0; i < E; i++) {
            json_t *v = json_array_get(row, (size_t)i);
            double t = json_is_number(v) ? json_number_value(v) : -1;
            /* at most 2^53 (exact in a double): the sums over experts and layers stay finite */
            if (!(t >= 0) || !(t <= 0x1p53)) {
                rc = pd_err_set(e, PD_EINVAL, "%s %s: field \"tokens_per_expert[%zu][%d]\": expected a "
                                "number in [0, 2^53]", flag, path, l, i);
                break;
            }
            x->tokens[l * (size_t)E + (size_t)i] = t;
            sum[i] += t;
            total += t;
        }
    }
    if (!rc && total <= 0)
        rc = pd_err_set(e, PD_EINVAL, "%s %s: field \"tokens_per_expert\": no token routed in any layer", flag,
                        path);
out:
    json_decref(root);
    if (rc)
        expert_load_free(x);
    else
        *out = x;
    return rc;
}

/* The expert stats of o: one file for both roles, or one per role (which may be the same). */
static int load_role_stats(struct pd_plan *p, const struct pd_plan_opts *o, pd_err *e)
{
    static const char *const flag[2] = {"--expert-stats-prefill", "--expert-stats-decode"};
    for (int r = 0; r < 2; r++) {
        const char *path = o->expert_stats_role[r] ? o->expert_stats_role[r] : o->expert_stats;
        if (!path)
            continue;
        if (r == 1 && p->load[0] && !strcmp(p->load[0]->path, path)) {
            p->load[1] = p->load[0];
            continue;
        }
        int rc = load_expert_stats(p, o->expert_stats_role[r] ? flag[r] : "--expert-stats", path, &p->load[r], e);
        if (rc)
            return rc;
    }
    return 0;
}

/* With redundant experts: each layer's replicas placed for that layer's load, as EPLB places
 * them, and the layers averaged. */
static int layer_imbalance(const struct pd_expert_load *x, struct pd_role_plan *rp, pd_err *e)
{
    int n = 0, rc;
    double sum = 0;
    for (int l = 0; l < x->layers; l++) {
        const double *t = x->tokens + (size_t)l * x->experts;
        struct pd_placement q;
        if ((rc = pd_placement_build(&q, x->experts, rp->ep, rp->o.redundant, t, e)))
            return rc;
        double f = pd_placement_imbalance(&q, t, 1);
        pd_placement_free(&q);
        if (f > 0) {
            sum += f;
            n++;
        }
    }
    rp->imbalance = n ? sum / n : 0;
    return 0;
}

/* The role's MoE imbalance from its expert counts: on its one placement without redundant
 * experts, per layer with them (layer_imbalance); memoised per EP size and redundancy. */
static int measured_imbalance(struct pd_expert_load *x, struct pd_role_plan *rp, pd_err *e)
{
    for (int i = 0; i < x->n; i++)
        if (x->memo[i].ep == rp->ep && x->memo[i].redundant == rp->o.redundant) {
            rp->imbalance = x->memo[i].imbalance;
            return 0;
        }
    if (x->n == x->cap) {
        int cap = x->cap ? 2 * x->cap : 16;
        void *v = realloc(x->memo, (size_t)cap * sizeof *x->memo);
        if (!v)
            return pd_err_set(e, PD_ENOMEM, "--expert-stats: out of memory");
        x->memo = v;
        x->cap = cap;
    }
    int rc = 0;
    if (rp->o.redundant)
        rc = layer_imbalance(x, rp, e);
    else
        rp->imbalance = pd_placement_imbalance(&rp->place, x->tokens, x->layers);
    if (!rc) {
        x->memo[x->n].ep = rp->ep;
        x->memo[x->n].redundant = rp->o.redundant;
        x->memo[x->n++].imbalance = rp->imbalance;
    }
    return rc;
}

int pd_plan_role_eval(const struct pd_plan *p, enum pd_role r, const struct pd_role_opts *o,
                     struct pd_role_plan *rp, pd_err *e)
{
    memset(rp, 0, sizeof *rp);
    rp->role = r;
    rp->o = *o;
    rp->ep = o->dp * o->tp;
    rp->cards = rp->ep * o->instances;
    struct pd_expert_load *x = p->load[r];
    const double *sum = x ? x->tokens + (size_t)x->layers * x->experts : NULL;
    int rc = pd_placement_build(&rp->place, p->inv.n_experts, rp->ep, o->redundant, sum, e);
    if (rc)
        return rc;
    if (x && (rc = measured_imbalance(x, rp, e))) {
        pd_placement_free(&rp->place);
        return rc;
    }
    rp->class_i_min = INT64_MAX;
    for (int k = 0; k < rp->ep; k++) {
        int64_t b = pd_placement_rank_bytes(&rp->place, k, p->inv.expert_bytes);
        if (b > rp->class_i_max)
            rp->class_i_max = b;
        if (b < rp->class_i_min)
            rp->class_i_min = b;
    }
    rp->class_ii_per_card = class_ii_per_card(&p->inv, o->tp);
    activation(p, r, o->tp, &rp->act);
    struct pd_budget *b = &rp->b;
    b->capacity = p->hw.card_memory_bytes;
    b->usable = (int64_t)floor((double)b->capacity * p->o.util);
    b->class_i = rp->class_i_max;
    b->class_ii = rp->class_ii_per_card;
    b->weights = b->class_i + b->class_ii;
    b->activations = rp->act.total;
    b->runtime = p->o.runtime[r] >= 0 ? p->o.runtime[r]
                 : r == PD_ROLE_PREFILL ? p->hw.runtime_prefill_bytes : p->hw.runtime_decode_bytes;
    if (p->o.aggregated) {   /* one card runs both: the larger reserve */
        int64_t other = p->o.runtime[!r] >= 0 ? p->o.runtime[!r]
                        : r == PD_ROLE_PREFILL ? p->hw.runtime_decode_bytes : p->hw.runtime_prefill_bytes;
        if (other > b->runtime)
            b->runtime = other;
    }
    b->kv_pool = b->usable - b->weights - b->activations - b->runtime;
    b->fits_weights = b->kv_pool >= 0;
    /* a chunk's window and state blocks come out of the same pool as the sequences' (kvsize.h);
     * at max-model-len, which for contexts past the in-flight tokens and a window is every one's */
    b->kv_chunks = pd_kv_inflight_bytes(&p->kv, p->o.max_model_len, pd_plan_chunk_inflight_tokens(p, r));
    /* A decoding sequence's own steps in flight (docs/memory-model.md "Decode steps in flight"):
     * vLLM's allocate_slots gives it slots up to computed + (1 + k) + k (its step's token and k
     * drafts, then k lookahead slots) and frees window blocks only below computed - in_flight, the
     * step still unprocessed under async scheduling, so each of its trimmed tables holds up to
     *     cdiv(window - 1 + T, block) + 1 blocks,  T = 2 x (1 + k) + k,
     * where pd_kv_seq_bytes counts T = 1. Each sequence the role admits holds them, so
     *     sequences that fit = (kv_pool - kv_chunks) / (seq + e),  e = kv_decode_seq,
     *     kv_transient      = kv_chunks + min(max-num-seqs, that) x e. */
    b->kv_decode_seq = pd_kv_inflight_bytes(&p->kv, p->o.max_model_len, pd_plan_decode_inflight_tokens(p, r));
    /* SGLang's request tables on an NPU: a fixed amount a rank, beside the sequences as the chunks are
     * (outside SGLang's budget, so they come out of the plan's KV room, not out of its fraction):
     *     sequences that fit = (kv_pool - kv_chunks - kv_tables) / (seq + e),
     *     kv_transient      = kv_chunks + kv_tables + min(max-num-seqs, that) x e. */
    b->kv_tables = pd_plan_sgl_tables(p, r);
    const int64_t room0 = b->kv_pool - b->kv_chunks - b->kv_tables;
    int64_t seq = pd_kv_seq_bytes(&p->kv, p->o.max_model_len), per = seq + b->kv_decode_seq;
    rp->seqs_at_max_len = room0 > 0 && per > 0 ? room0 / per : 0;
    const int64_t admitted = rp->seqs_at_max_len < p->o.max_num_seqs ? rp->seqs_at_max_len : p->o.max_num_seqs;
    b->kv_transient = b->kv_chunks + b->kv_tables + admitted * b->kv_decode_seq;
    /* max-num-seqs is per data-parallel rank (vLLM): each rank holds its own sequences' KV */
    rp->kv_need = seq;
    if (!(r == PD_ROLE_PREFILL && !p->o.aggregated) && __builtin_mul_overflow(p->o.max_num_seqs, per, &rp->kv_need))
        rp->kv_need = INT64_MAX;   /* (at the bounds of check_opts: more than any pool) */
    if (__builtin_add_overflow(rp->kv_need, b->kv_chunks + b->kv_tables, &rp->kv_need))
        rp->kv_need = INT64_MAX;
    int64_t room_ctx = INT64_MIN;   /* max-num-seqs sequences' own blocks, beside their steps in flight */
    if (!__builtin_mul_overflow(p->o.max_num_seqs, b->kv_decode_seq, &room_ctx))
        room_ctx = room0 - room_ctx;
    rp->ctx_at_max_seqs = room_ctx > 0 ? pd_kv_max_context(&p->kv, room_ctx, p->o.max_num_seqs) : 0;
    rp->fits = b->fits_weights && rp->seqs_at_max_len >= 1;
    rp->fits_max_num_seqs = b->fits_weights && rp->seqs_at_max_len >= p->o.max_num_seqs;
    return 0;
}

static void scenarios(struct pd_plan *p)
{
    static const int64_t seed[][2] = {{30, 16384}, {30, 32768}, {30, 65536}, {15, 65536}};
    const struct pd_role_plan *d = &p->role[PD_ROLE_DECODE];
    const struct pd_budget *b = &d->b;
    p->n_scen = 0;
    for (size_t i = 0; i < sizeof seed / sizeof seed[0] + 1; i++) {
        int64_t s = i < 4 ? seed[i][0] : p->o.max_num_seqs, c = i < 4 ? seed[i][1] : p->o.max_model_len;
        int dup = 0;
        for (int j = 0; j < p->n_scen; j++)
            dup |= p->scen[j].seqs == s && p->scen[j].ctx == c;
        if (dup)
            continue;
        struct pd_scenario *sc = &p->scen[p->n_scen++];
        sc->seqs = s;
        sc->ctx = c;
        /* (saturated: seqs x bytes past 2^63 wrapped, a row of 0 GB) */
        /* each sequence with its steps in flight at that context */
        const int64_t per = pd_kv_seq_bytes(&p->kv, c) + pd_kv_inflight_bytes(&p->kv, c, pd_plan_decode_inflight_tokens(p, PD_ROLE_DECODE));
        sc->kv = per > 0 && s > INT64_MAX / per ? INT64_MAX : s * per;
        const int64_t rest = b->weights + b->activations + b->runtime + b->kv_chunks + b->kv_tables;
        sc->total = sc->kv > INT64_MAX - rest ? INT64_MAX : rest + sc->kv;
        sc->fits = sc->total <= b->usable;
    }
}

static void handoff(struct pd_plan *p)
{
    p->n_handoff = p->o.n_handoff;
    for (int i = 0; i < p->n_handoff; i++) {
        struct pd_handoff *h = &p->handoff[i];
        h->tokens = p->o.handoff_tokens[i];
        h->bytes = pd_kv_seq_bytes(&p->kv, h->tokens);
        h->rdma_s = p->hw.rdma.latency_s + (double)h->bytes / p->hw.rdma.bandwidth_Bps;
        h->tcp_s = p->hw.tcp.latency_s + (double)h->bytes / p->hw.tcp.bandwidth_Bps;
    }
}

/* Every EP size that divides the role's cards: experts per card, weights, KV room, verdict.
 * Chosen: for prefill the smallest group that fits (the most independent instances), for
 * decode the smallest group whose KV pool holds max-num-seqs x max-model-len. */
static int sweep(struct pd_plan *p, pd_err *e)
{
    p->n_sweep = 0;
    for (int r = 0; r < 2; r++) {
        const struct pd_role_opts *base = &p->o.role[r];
        int cards = base->dp * base->tp * base->instances, chosen = -1;
        for (int ep = base->tp; ep <= cards && p->n_sweep < 64; ep += base->tp) {
            if (cards % ep)
                continue;
            struct pd_sweep_row *row = &p->sweep[p->n_sweep++];
            memset(row, 0, sizeof *row);
            row->role = (enum pd_role)r;
            row->ep = ep;
            row->dp = ep / base->tp;
            row->instances = cards / ep;
            struct pd_role_opts o = {.dp = row->dp, .tp = base->tp, .instances = row->instances,
                                     .redundant = base->redundant};
            struct pd_role_plan rp;
            pd_err ignore;
            if (pd_plan_role_eval(p, (enum pd_role)r, &o, &rp, &ignore)) {
                row->verdict = PD_V_NOT_DIVISIBLE;
                continue;
            }
            row->experts_per_card = rp.place.slots;
            row->weights = rp.b.weights;
            row->kv_pool = rp.b.kv_pool;
            row->kv_need = rp.kv_need;
            row->verdict = !rp.b.fits_weights ? PD_V_WEIGHTS_DONT_FIT
                           : rp.b.kv_pool < rp.kv_need ? PD_V_KV_SHORT : PD_V_FITS;
            if (row->verdict == PD_V_FITS && chosen < 0) {
                chosen = p->n_sweep - 1;
                row->chosen = 1;
            }
            pd_placement_free(&rp.place);
        }
    }
    (void)e;
    return 0;
}

static int check_opts(const struct pd_plan_opts *o, pd_err *e)
{
    if (!(o->util > 0 && o->util <= 1))
        return pd_err_set(e, PD_EINVAL, "--gpu-memory-utilization %g: must be in (0, 1]", o->util);
    /* bounds far beyond any deployment that keep every size computed from them within 64 bits */
    if (o->max_num_seqs < 1 || o->max_num_seqs > PD_PLAN_MAX_SEQS)
        return pd_err_set(e, PD_EINVAL, "--max-num-seqs %lld: must be at least 1 and at most %d sequences per rank",
                          (long long)o->max_num_seqs, PD_PLAN_MAX_SEQS);
    if (o->max_model_len < 1 || o->max_model_len > PD_PLAN_MAX_LEN)
        return pd_err_set(e, PD_EINVAL, "--max-model-len %lld: must be at least 1 and at most %lld tokens (and the "
                          "model's max_position_embeddings)", (long long)o->max_model_len, (long long)PD_PLAN_MAX_LEN);
    if (o->max_num_batched_tokens < 1 || o->max_num_batched_tokens > PD_PLAN_MAX_BATCHED)
        return pd_err_set(e, PD_EINVAL, "--max-num-batched-tokens %lld: must be at least 1 and at most %d",
                          (long long)o->max_num_batched_tokens, PD_PLAN_MAX_BATCHED);
    if (o->kv_bytes_per_token > PD_PLAN_MAX_KV_TOKEN)
        return pd_err_set(e, PD_EINVAL, "--kv-bytes-per-token %lld: at most %d bytes", (long long)o->kv_bytes_per_token,
                          PD_PLAN_MAX_KV_TOKEN);
    for (int r = 0; r < 2; r++) {
        const struct pd_role_opts *x = &o->role[r];
        if (x->dp < 1 || x->tp < 1 || x->instances < 1 || x->redundant < 0)
            return pd_err_set(e, PD_EINVAL, "--%s dp=%d,tp=%d,instances=%d: dp, tp and instances must be at least 1",
                              pd_role_name((enum pd_role)r), x->dp, x->tp, x->instances);
    }
    /* vLLM's scheduler flag (its engine args' --async-scheduling / --no-async-scheduling): SGLang
     * overlaps its scheduling by another flag (--disable-overlap-schedule), and the plan counts no
     * steps in flight in its pools */
    const int async_bad = pd_plan_check_async(o, e);
    if (async_bad)
        return async_bad;
    for (int i = 0; i < o->n_handoff; i++)
        if (o->handoff_tokens[i] < 1 || o->handoff_tokens[i] > PD_PLAN_MAX_LEN)
            return pd_err_set(e, PD_EINVAL, "--handoff-tokens: %lld must be at least 1 and at most %lld",
                              (long long)o->handoff_tokens[i], (long long)PD_PLAN_MAX_LEN);
    return 0;
}

/* Speculative decoding (mtp.h): k drafts per step and the acceptance of each position, from the
 * measured counters (spec_stats), the --mtp-acceptance list, or the hardware file's one rate. */
static int resolve_mtp(struct pd_plan *p, const struct pd_plan_opts *o, pd_err *e)
{
    struct pd_mtp m = {0};
    int rc, n = 0;
    memset(&p->mtp, 0, sizeof p->mtp);
    if (o->spec_stats && o->mtp_acceptance)
        return pd_err_set(e, PD_EINVAL, "--spec-stats and --mtp-acceptance: the measured acceptance or a given one, "
                          "not both");
    if (o->spec_k < 0 || o->spec_k > PD_MTP_MAX_K)
        return pd_err_set(e, PD_EINVAL, "num_speculative_tokens %d: must be in [1, %d]", o->spec_k, PD_MTP_MAX_K);
    if (!p->include_mtp) {
        const char *flag = o->spec_k ? "--speculative-config" : o->spec_stats ? "--spec-stats"
                           : o->mtp_acceptance ? "--mtp-acceptance" : NULL;
        if (flag)
            return pd_err_set(e, PD_EINVAL, "%s: no MTP layer is loaded (%s)", flag,
                              p->model.n_mtp_layers > 0 ? "--mtp off" : "the model has none");
        snprintf(p->mtp_source, sizeof p->mtp_source, "no MTP layer");
        return 0;
    }
    if (o->spec_stats) {
        if ((rc = pd_mtp_stats_load(o->spec_stats, &m, e)))
            return rc;
        n = m.k;
        snprintf(p->mtp_source, sizeof p->mtp_source, "measured (%.80s)", o->spec_stats);
    } else if (o->mtp_acceptance) {
        if ((rc = pd_mtp_parse_list("--mtp-acceptance", o->mtp_acceptance, &m, e)))
            return rc;
        n = m.k;
        snprintf(p->mtp_source, sizeof p->mtp_source, "--mtp-acceptance");
    } else {
        m.a[0] = p->hw.eff.mtp_acceptance;
        n = 1;
        snprintf(p->mtp_source, sizeof p->mtp_source, "the hardware file's mtp_acceptance");
    }
    int k = o->spec_k > 0 ? o->spec_k : n;
    if (n == 1) {                  /* one rate: every position's */
        for (int j = 1; j < k; j++)
            m.a[j] = m.a[0];
    } else if (k > n) {
        return pd_err_set(e, PD_EINVAL, "%s: acceptance for %d draft positions, but num_speculative_tokens is %d",
                          o->spec_stats ? o->spec_stats : "--mtp-acceptance", n, k);
    } else if (k < n && !o->spec_stats) {
        return pd_err_set(e, PD_EINVAL, "--mtp-acceptance: %d rates for num_speculative_tokens %d (give one rate, or "
                          "one per position)", n, k);
    }
    m.k = k;                       /* a measured longer round: its first k positions */
    p->mtp = m;
    return 0;
}

int pd_plan_build(const struct pd_plan_opts *o, struct pd_plan *p, pd_err *e)
{
    memset(p, 0, sizeof *p);
    p->o = *o;
    int rc = check_opts(o, e);
    if (rc)
        return rc;
    const char *model = o->model ? o->model : o->checkpoint;
    if ((rc = pd_model_load(model, &p->model, e)))
        return rc;
    if (p->o.max_model_len > p->model.max_position_embeddings) {
        if (o->max_model_len_given)
            return pd_err_set(e, PD_EINVAL, "--max-model-len %lld: more than the model's max_position_embeddings %lld",
                              (long long)o->max_model_len, (long long)p->model.max_position_embeddings);
        p->o.max_model_len = p->model.max_position_embeddings;   /* the default: the model's own length */
    }
    /* a hand-off of a prompt no deployment of this model can hold is not a figure to act on */
    int kept = 0;
    for (int i = 0; i < p->o.n_handoff; i++) {
        if (p->o.handoff_tokens[i] <= p->model.max_position_embeddings)
            p->o.handoff_tokens[kept++] = p->o.handoff_tokens[i];
        else if (o->handoff_given)
            return pd_err_set(e, PD_EINVAL, "--handoff-tokens %lld: more than the model's max_position_embeddings %lld",
                              (long long)p->o.handoff_tokens[i], (long long)p->model.max_position_embeddings);
    }
    if (kept == 0 && p->o.n_handoff > 0)   /* a small model: one prompt of its full length */
        p->o.handoff_tokens[kept++] = p->model.max_position_embeddings;
    p->o.n_handoff = kept;
    if (o->hw)
        p->hw = *o->hw;
    else if ((rc = pd_hardware_load(o->hardware, &p->hw, e)))
        return rc;
    if (o->checkpoint && o->checkpoint[0]) {
        struct pd_st_set set;
        if ((rc = pd_st_open_dir(o->checkpoint, PD_ST_HEADER_ONLY, &set, e)))
            return rc;
        rc = pd_inventory_from_checkpoint(&p->model, &set, &p->inv, e);
        pd_st_close_dir(&set);
        if (rc)
            return rc;
        if ((rc = pd_quant_init(&p->quant, "bf16", NULL, 0, e)))
            return rc;
        p->include_mtp = 0;
        for (int i = 0; i < p->inv.n; i++)
            p->include_mtp |= p->inv.t[i].layer >= p->model.n_layers;
    } else {
        if ((rc = pd_quant_init(&p->quant, o->quant, o->quant_override, p->model.ckpt_scale_ue8m0, e)))
            return rc;
        if (o->mtp > 0 && p->model.n_mtp_layers == 0)
            return pd_err_set(e, PD_EINVAL, "--mtp on: the model has no MTP layer (num_nextn_predict_layers 0)");
        p->include_mtp = o->mtp < 0 ? p->model.n_mtp_layers > 0 : o->mtp && p->model.n_mtp_layers > 0;
        if ((rc = pd_inventory_build(&p->model, &p->quant, p->include_mtp, &p->inv, e)))
            return rc;
    }
    int64_t flat = o->kv_bytes_per_token > 0 ? o->kv_bytes_per_token : p->model.kv_bytes_per_token;
    const enum pd_kv_dtype kvd = o->kv_dtype != PD_KV_AUTO ? o->kv_dtype : pd_plan_kv_dtype_default(&p->model, &p->hw);
    if ((rc = pd_kv_size_init(&p->kv, &p->model, kvd, p->include_mtp, flat, e)))
        goto fail;
    plan_kv_layout(p, kvd, flat);
    if ((rc = load_role_stats(p, o, e)) || (rc = resolve_mtp(p, o, e)))
        goto fail;
    p->nodes = o->nodes > 0 ? o->nodes : p->hw.cluster_nodes;
    p->cards_total = p->nodes * p->hw.cards_per_node;
    if (o->aggregated)   /* one set of cards, both roles on it */
        p->o.role[PD_ROLE_PREFILL] = o->role[PD_ROLE_DECODE];
    o = &p->o;
    int64_t need = 0;   /* (in 64 bits: a product of large keys wrapped an int to a layout that fit) */
    for (int r = o->aggregated ? PD_ROLE_DECODE : 0; r < 2; r++)
        need += (int64_t)o->role[r].dp * o->role[r].tp * o->role[r].instances;
    p->cards_used = need > p->cards_total ? p->cards_total + 1 : (int)need;
    if (need > p->cards_total && o->aggregated) {
        rc = pd_err_set(e, PD_EINVAL, "layout needs %lld cards (aggregated %d x %lld) but the cluster has %d (%d nodes x %d cards of %s)",
                        (long long)need, o->role[1].instances, (long long)o->role[1].dp * o->role[1].tp, p->cards_total,
                        p->nodes, p->hw.cards_per_node, p->hw.name);
        goto fail;
    }
    if (need > p->cards_total) {
        rc = pd_err_set(e, PD_EINVAL,
                        "layout needs %lld cards (prefill %d x %lld, decode %d x %lld) but the cluster has %d (%d nodes x %d cards of %s)",
                        (long long)need, o->role[0].instances, (long long)o->role[0].dp * o->role[0].tp, o->role[1].instances,
                        (long long)o->role[1].dp * o->role[1].tp, p->cards_total, p->nodes, p->hw.cards_per_node, p->hw.name);
        goto fail;
    }
    for (int r = 0; r < 2; r++)
        if ((rc = pd_plan_role_eval(p, (enum pd_role)r, &o->role[r], &p->role[r], e))) {
            pd_err_prefix(e, "--%s: ", o->aggregated ? "aggregated" : pd_role_name((enum pd_role)r));
            goto fail;
        }
    p->p_kv_batch = (int64_t)llround(o->max_num_batched_tokens * p->kv.per_token);
    scenarios(p);
    handoff(p);
    if (o->sweep && (rc = sweep(p, e)))
        goto fail;
    return 0;
fail:
    pd_plan_free(p);
    return rc;
}

void pd_plan_free(struct pd_plan *p)
{
    for (int r = 0; r < 2; r++)
        pd_placement_free(&p->role[r].place);
    pd_inventory_free(&p->inv);
    if (p->load[1] != p->load[0])
        expert_load_free(p->load[1]);
    expert_load_free(p->load[0]);
    p->load[0] = p->load[1] = NULL;
}

int pd_plan_check_async(const struct pd_plan_opts *o, pd_err *e)
{
    if (o->no_async_scheduling && o->stack == PD_STACK_SGLANG)
        return pd_err_set(e, PD_EINVAL, "--no-async-scheduling: vLLM's flag; the plan is SGLang's (--stack sglang, "
                          "--emit sglang), whose scheduler has no such flag");
    return 0;
}

int pd_plan_steps_in_flight(const struct pd_plan *p)
{
    return p->o.no_async_scheduling ? 1 : PD_PLAN_STEPS_IN_FLIGHT;
}

int64_t pd_plan_chunk_inflight_tokens(const struct pd_plan *p, enum pd_role r)
{
    if (r == PD_ROLE_DECODE && !p->o.aggregated)
        return 0;
    int64_t t = pd_plan_steps_in_flight(p) * p->o.max_num_batched_tokens;
    return t < p->o.max_model_len ? t : p->o.max_model_len;
}

int64_t pd_plan_decode_inflight_tokens(const struct pd_plan *p, enum pd_role r)
{
    if (r == PD_ROLE_PREFILL && !p->o.aggregated)
        return 0;
    int64_t t = pd_plan_steps_in_flight(p) * (1 + (int64_t)p->mtp.k) + p->mtp.k;
    return t < p->o.max_model_len ? t : p->o.max_model_len;
}

/* SGLang 0a3cd26b, python/sglang/srt/: arg_groups/pd_disaggregation_hook.py (the default of
 * --disaggregation-decode-extra-slots), mem_cache/allocation_sizing.py
 * get_req_to_token_extra_context_len (the row's headroom); docs/memory-model.md. */
int64_t pd_plan_sgl_extra_slots(const struct pd_plan *p, enum pd_role r)
{
    if (r != PD_ROLE_DECODE || p->o.aggregated)
        return 0;
    return p->o.max_num_seqs <= 32 ? 2 * p->o.max_num_seqs : 0;
}

/* SGLang's --page-size: its NPU pools' (kvsize.h); DeepSeek-V4's dsv4 backend on GPUs 256
 * (arg_groups/overrides.py:795-805); else its default, 1 */
static int64_t sgl_page(const struct pd_plan *p)
{
    if (p->kv.layout == PD_KV_LAYOUT_SGLANG_NPU)
        return p->kv.sgl.page;
    return p->model.arch == PD_ARCH_DEEPSEEK_V4 ? 256 : 1;
}

int64_t pd_plan_sgl_row_tokens(const struct pd_plan *p)
{
    const int64_t k = p->mtp.k, page = sgl_page(p), drafts = k > 0 ? k + 1 : 0;
    int64_t extra = 4 + drafts;
    if (k > 0 && page > 1 && 2 * (k + 1) + page - 1 > extra)   /* topk 1: a step allocates max(k, k + 1) */
        extra = 2 * (k + 1) + page - 1;
    return p->o.max_model_len + extra;
}

/* On GPUs SGLang's request table is the stock req_to_token (ReqToTokenPool, a PD decode node's
 * DecodeReqToTokenPool with its pre-allocated slots: disaggregation/decode.py:109-140), int32 rows of
 * the row tokens, made by _init_pools after the budget is resolved (kv_cache_configurator.py:218-233,
 * :614-631): outside --mem-fraction-static, as the NPU tables are. */
int64_t pd_plan_sgl_tables(const struct pd_plan *p, enum pd_role r)
{
    const int64_t slots = p->o.max_num_seqs + pd_plan_sgl_extra_slots(p, r) + 1;
    if (p->kv.layout == PD_KV_LAYOUT_SGLANG_NPU)
        return pd_kv_sgl_tables(slots, pd_plan_sgl_row_tokens(p));
    if (p->o.stack != PD_STACK_SGLANG)
        return 0;
    return slots * 4 * pd_plan_sgl_row_tokens(p);
}

int64_t pd_budget_seq_room(const struct pd_budget *b)
{
    return b->kv_pool - b->kv_transient;
}

int64_t pd_plan_admitted_seqs(const struct pd_plan *p, enum pd_role r)
{
    const struct pd_role_plan *rp = &p->role[r];
    return rp->seqs_at_max_len < p->o.max_num_seqs ? rp->seqs_at_max_len : p->o.max_num_seqs;
}

int pd_plan_prefill_lowered(const struct pd_plan *p)
{
    const struct pd_role_plan *rp = &p->role[PD_ROLE_PREFILL];
    return !p->o.aggregated && rp->fits && !rp->fits_max_num_seqs;
}

int pd_plan_formats_servable(const struct pd_plan *p, pd_err *e)
{
    if (p->hw.fp8_flops > 0 || p->inv.from_checkpoint)
        return 0;
    int low = p->quant.linear == PD_FMT_FP8 || p->quant.linear == PD_FMT_FP4;
    for (int g = 0; g < PD_G_COUNT; g++)
        low |= p->quant.group_fmt[g] == PD_FMT_FP8 || p->quant.group_fmt[g] == PD_FMT_FP4;
    if (!low)
        return 0;
    char q[96];
    return pd_err_set(e, PD_EINVAL, "%s: %s cards have no FP8/FP4 units (hardware file field fp8_flops: 0), so "
                      "they cannot serve %s weights; plan with --quant w8a8", p->hw.name, p->hw.card_name,
                      pd_quant_describe(&p->quant, q, sizeof q));
}

enum pd_fmt pd_plan_group_fmt(const struct pd_plan *p, enum pd_group g)
{
    if (p->inv.from_checkpoint)
        return PD_FMT_BF16;
    if (p->quant.group_fmt[g] != PD_FMT_NONE)
        return p->quant.group_fmt[g];
    switch (g) {
    case PD_G_ATTENTION: case PD_G_SHARED_EXPERT: case PD_G_DENSE_FFN: case PD_G_MTP: case PD_G_ROUTED_EXPERTS:
        return p->quant.linear;
    default:
        return PD_FMT_BF16;
    }
}

const char *pd_budget_overflow(const struct pd_budget *b)
{
    if (b->weights > b->usable)
        return "weights";
    if (b->weights + b->runtime > b->usable)
        return "weights and runtime reserve";
    return "weights and activations";
}

/* Layout search (search.h). Prefill layouts and (decode layout, batch) pairs are costed once
 * each; a deployment pairs one of each within the card budget, so the pairs cost only the
 * rate-matching arithmetic. */
#define _GNU_SOURCE   /* qsort_r */
#include "plan/search.h"
#include "plan/nodes.h"
#include "core/grow.h"
#include "core/units.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const int64_t batches[] = {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024};

void pd_search_opts_default(struct pd_search_opts *o)
{
    memset(o, 0, sizeof *o);
    pd_plan_opts_default(&o->base);
    o->cards = 64;
    pd_workload_default(&o->w);
    o->max_tp = 1;
}

struct cand {                 /* one role layout, costed */
    struct pd_role_opts o;
    int cards, slots;
    int64_t weights, kv_pool, kv_transient;
    int fits;
    int64_t batch;            /* decode */
    struct pd_perf f;         /* the role's fields of the prediction */
    const double *steps;      /* closed loop, decode: the step of one DP rank at batch b (steps[b], b >= 1) */
};

struct cands {
    struct cand *c;
    int n;
    size_t cap;
    double **steps;           /* the closed loop's step tables, one per decode role layout */
    int n_steps;
};

/* A closed loop's decode step at batch b, from its role layout's table. */
static double table_step(void *ctx, int64_t b)
{
    return ((const double *)ctx)[b];
}

static struct cand *cand_push(struct cands *v)
{
    if (PD_GROW(v->c, v->cap, (size_t)v->n + 1))
        return NULL;
    struct cand *c = &v->c[v->n++];
    memset(c, 0, sizeof *c);
    return c;
}

/* EP sizes a role may use: a power of two within a node, or whole nodes; TP must divide it. */
int pd_search_ep_ok(int ep, int tp, int cpn)
{
    if (ep % tp)
        return 0;
    return ep <= cpn ? (cpn % ep == 0 && (ep & (ep - 1)) == 0) : ep % cpn == 0;
}

/* Redundant experts that make an EP size divide the slots (EPLB-style), none if it divides. */
int pd_search_redundant_for(int experts, int ep)
{
    return (ep - experts % ep) % ep;
}

/* Every instance count and (decode) batch of one role layout o. */
static int layout_cands(struct pd_plan *p, const struct pd_search_opts *so, enum pd_role r,
                        const struct pd_role_opts *o, struct cands *v, struct pd_search *s, pd_err *e)
{
    const int ep = o->dp * o->tp;
    struct pd_search_mem *m = s->n_mem < PD_SEARCH_MAX_MEM ? &s->mem[s->n_mem++] : NULL;
    if (m)
        *m = (struct pd_search_mem){.role = r, .o = *o};
    double *steps = NULL;     /* closed loop: the decode step at every batch a pairing may run */
    const int64_t n_steps = so->w.concurrency < batches[sizeof batches / sizeof batches[0] - 1]
                                ? so->w.concurrency : batches[sizeof batches / sizeof batches[0] - 1];
    for (int nb = 0; nb < (r == PD_ROLE_DECODE ? (int)(sizeof batches / sizeof batches[0]) : 1); nb++) {
        int64_t batch = batches[nb];
        p->o.max_num_seqs = r == PD_ROLE_DECODE ? batch : so->base.max_num_seqs;
        struct pd_role_plan rp;
        int rc = pd_plan_role_eval(p, r, o, &rp, e);
        if (rc)
            return rc;
        /* room as the plan's verdicts judge it (plan.h): every sequence a role admits may grow to
         * max-model-len, so a decode batch is the sequences of max-model-len its pool holds (the
         * batch becomes the emitted --max-num-seqs), and a prefill rank holds one such prompt */
        int room = r == PD_ROLE_PREFILL ? rp.fits : rp.fits_max_num_seqs;
        if (m && nb == 0) {
            m->experts_per_card = rp.place.slots;
            m->weights = rp.b.weights;
            m->kv_pool = rp.b.kv_pool;
            m->fits_weights = rp.b.fits_weights;
        }
        if (m && room)   /* room: the verdicts of plan.h, the weights' included */
            m->max_batch = batch;
        if (r == PD_ROLE_DECODE && nb > 0 && !room) {
            pd_placement_free(&rp.place);
            break;                       /* larger batches fit even less */
        }
        /* the step costs do not depend on the instance count, only the requests/s do */
        struct pd_workload w = so->w;
        w.decode_batch = batch;
        struct pd_perf f;
        struct pd_role_plan keep = p->role[r];
        p->role[r] = rp;
        if (r == PD_ROLE_PREFILL)
            pd_perf_prefill(p, &w, &f);
        else
            pd_perf_decode(p, &w, &f);
        if (m && nb == 0)
            m->imbalance = r == PD_ROLE_PREFILL ? f.prefill_step.imbalance : f.decode_step.imbalance;
        if (r == PD_ROLE_DECODE && nb == 0 && n_steps > 0) {
            double **t = realloc(v->steps, (size_t)(v->n_steps + 1) * sizeof *t);
            steps = malloc((size_t)(n_steps + 1) * sizeof *steps);
            if (t)
                v->steps = t;
            if (!t || !steps) {
                free(steps);
                p->role[r] = keep;
                pd_placement_free(&rp.place);
                return pd_err_set(e, PD_ENOMEM, "out of memory");
            }
            v->steps[v->n_steps++] = steps;
            steps[0] = 0;
            for (int64_t b = 1; b <= n_steps; b++) {
                struct pd_step st;
                pd_perf_step(p, PD_ROLE_DECODE, b, pd_perf_decode_tokens(p),
                             w.decode_ctx > 0 ? w.decode_ctx : w.isl + w.osl / 2, &st);
                steps[b] = st.total_s;
            }
        }
        p->role[r] = keep;
        for (int inst = 1; inst * ep < so->cards; inst++) {
            struct cand *c = cand_push(v);
            if (!c) {
                pd_placement_free(&rp.place);
                return pd_err_set(e, PD_ENOMEM, "out of memory");
            }
            c->o = *o;
            c->o.instances = inst;
            c->cards = ep * inst;
            c->slots = rp.place.slots;
            c->weights = rp.b.weights;
            c->kv_pool = rp.b.kv_pool;
            c->kv_transient = rp.b.kv_transient;
            c->fits = room;
            c->batch = batch;
            c->f = f;
            c->steps = steps;
            pd_perf_instances(&c->f, r, o->dp, inst, &w);
        }
        pd_placement_free(&rp.place);
    }
    return 0;
}

/* Every layout of a role: EP sizes by ep_ok, TP sizes up to max_tp, and for each the plain
 * placement (or the fewest redundant slots that make the EP size divide the experts, placed by
 * load as EPLB does) and, where that needs none, EPLB with one replica slot per rank; on
 * hardware whose serving stack has no redundant experts, only EP sizes that divide. */
static int role_cands(struct pd_plan *p, const struct pd_search_opts *so, enum pd_role r, struct cands *v,
                      struct pd_search *s, pd_err *e)
{
    const int cpn = p->hw.cards_per_node, E = p->inv.n_experts > 0 ? p->inv.n_experts : 1;
    for (int tp = 1; tp <= so->max_tp && tp <= cpn; tp *= 2)
        for (int ep = tp; ep < so->cards; ep++) {
            if (!pd_search_ep_ok(ep, tp, cpn))
                continue;
            int need = pd_search_redundant_for(E, ep);
            if (need > 0 && !p->hw.redundant_experts)
                continue;            /* the stack cannot place the slots that would make it divide */
            for (int eplb = 0; eplb < (ep > 1 && need == 0 && p->hw.redundant_experts ? 2 : 1); eplb++) {
                struct pd_role_opts o = {.dp = ep / tp, .tp = tp, .instances = 1, .redundant = eplb ? ep : need};
                int rc = layout_cands(p, so, r, &o, v, s, e);
                if (rc)
                    return rc;
            }
        }
    return 0;
}

#define SEARCH_MAX_LAYOUTS (1 << 25)

static int push_layout(struct pd_search *s, const struct cand *P, const struct cand *D, const struct pd_plan *p)
{
    if (PD_GROW(s->l, s->cap, (size_t)s->n + 1))
        return -1;
    struct pd_layout *l = &s->l[s->n++];
    memset(l, 0, sizeof *l);
    l->role[PD_ROLE_PREFILL] = P->o;
    l->role[PD_ROLE_DECODE] = D->o;
    l->batch = D->batch;
    l->cards = P->cards + D->cards;
    l->experts_per_card[0] = P->slots;
    l->experts_per_card[1] = D->slots;
    l->weights[0] = P->weights;
    l->weights[1] = D->weights;
    l->kv_pool[0] = P->kv_pool;
    l->kv_pool[1] = D->kv_pool;
    l->kv_transient[0] = P->kv_transient;
    l->kv_transient[1] = D->kv_transient;
    const struct pd_workload *w = &s->o.w;
    /* TTFT includes the queue before prefill at the arrival rate */
    struct pd_match m = pd_perf_match(p->hw.eff.request_s, &P->f, &D->f, P->o.dp * P->o.instances, l->cards, w);
    l->ttft_s = m.ttft_rate_s;
    l->tpot_s = D->f.tpot_s;
    l->user_tok_s = D->f.user_tok_s;
    l->prefill_req_s = P->f.prefill_req_s;
    l->decode_req_s = D->f.decode_req_s;
    l->req_s = m.req_s;
    l->tok_s_card = m.tok_s_card;
    l->prefill_bound = P->f.prefill_bound;
    l->decode_bound = D->f.decode_step.bound;
    l->fits = P->fits && D->fits;
    /* at a given arrival rate the deployment must sustain it (TTFT above includes the queue) */
    l->sustains = w->rate <= 0 || l->req_s >= w->rate;
    if (w->concurrency > 0 && D->steps) {
        /* a closed loop of C clients: its TTFT, TPOT and throughput at the batch C implies
         * (pd_perf_closed), D's batch being the slots (max-num-seqs) of each DP rank */
        struct pd_closed c;
        pd_perf_closed(w->concurrency, w->osl, p->hw.eff.request_s + P->f.prefill_s + P->f.handoff_s, P->f.prefill_s,
                       P->o.dp * P->o.instances,
                       P->f.prefill_req_s, D->o.dp * D->o.instances, D->batch, D->f.tokens_per_step, table_step,
                       (void *)D->steps, l->cards, &c);
        l->ttft_s = c.ttft_s;
        l->tpot_s = c.tpot_s;
        l->user_tok_s = 1 / c.tpot_s;
        l->req_s = c.req_s;
        l->tok_s_card = c.tok_s_card;
    }
    l->meets = l->fits && l->sustains && (s->o.ttft_s <= 0 || l->ttft_s <= s->o.ttft_s) && (s->o.tpot_s <= 0 || l->tpot_s <= s->o.tpot_s);
    return 0;
}

static int by_user_desc(const void *a, const void *b, void *ctx)
{
    const struct pd_layout *l = ctx;
    const struct pd_layout *x = &l[*(const int *)a], *y = &l[*(const int *)b];
    if (x->user_tok_s != y->user_tok_s)
        return x->user_tok_s < y->user_tok_s ? 1 : -1;
    return x->tok_s_card < y->tok_s_card ? 1 : x->tok_s_card > y->tok_s_card ? -1 : 0;
}

/* The front among fitting layouts: no other fitting layout is at least as fast per user and
 * strictly better per card. */
static int pareto(struct pd_search *s)
{
    size_t cap = s->n > 0 ? (size_t)s->n : 1;
    int *idx = malloc(cap * sizeof *idx), m = 0;
    if (!idx)
        return -1;
    for (int i = 0; i < s->n; i++)
        if (s->l[i].fits)
            idx[m++] = i;
    qsort_r(idx, (size_t)m, sizeof *idx, by_user_desc, s->l);
    double best = -1;
    s->n_front = 0;
    for (int i = 0; i < m; i++)
        if (s->l[idx[i]].tok_s_card > best) {
            best = s->l[idx[i]].tok_s_card;
            s->l[idx[i]].pareto = 1;
            idx[s->n_front++] = idx[i];
        }
    for (int i = 0, j = s->n_front - 1; i < j; i++, j--) {   /* ascending tokens/s per user */
        int t = idx[i];
        idx[i] = idx[j];
        idx[j] = t;
    }
    s->front = idx;
    return 0;
}

static int better(const struct pd_layout *a, const struct pd_layout *b)
{
    if (a->tok_s_card != b->tok_s_card)
        return a->tok_s_card > b->tok_s_card;
    if (a->user_tok_s != b->user_tok_s)
        return a->user_tok_s > b->user_tok_s;
    return a->cards < b->cards;
}

int pd_search_run(const struct pd_search_opts *o, struct pd_search *s, pd_err *e)
{
    memset(s, 0, sizeof *s);
    s->o = *o;
    s->best = s->best_any = s->best_agg = s->best_agg_any = -1;
    if (o->cards < 2)
        return pd_err_set(e, PD_EINVAL, "--cards %d: a PD deployment needs at least 2 cards", o->cards);
    if (o->max_tp < 1)
        return pd_err_set(e, PD_EINVAL, "--max-tp %d: must be at least 1", o->max_tp);
    if (o->ttft_s < 0 || o->tpot_s < 0)
        return pd_err_set(e, PD_EINVAL, "--ttft-ms / --tpot-ms: must not be negative");
    if (o->w.rate > 0 && o->w.concurrency > 0)
        return pd_err_set(e, PD_EINVAL, "--request-rate and --concurrency: an open loop (requests arrive at a rate) or a "
                                        "closed loop (C clients), not both");
    if (o->w.concurrency < 0)
        return pd_err_set(e, PD_EINVAL, "--concurrency %lld: must be at least 1", (long long)o->w.concurrency);
    int rc;
    /* the model and hardware: a plan of the smallest layout, its roles replaced per candidate */
    struct pd_plan_opts base = o->base;
    base.role[0] = base.role[1] = (struct pd_role_opts){.dp = 1, .tp = 1, .instances = 1};
    base.sweep = 0;
    struct pd_hardware hw;   /* loaded once for every plan built below */
    if (!base.hw) {
        if ((rc = pd_hardware_load(base.hardware, &hw, e)))
            return rc;
        base.hw = &hw;
    }
    base.nodes = (o->cards + base.hw->cards_per_node - 1) / base.hw->cards_per_node;
    struct pd_plan p;
    if ((rc = pd_plan_build(&base, &p, e)))
        return rc;
    if (o->w.isl < 1 || o->w.osl < 1 || o->w.isl > base.max_model_len - o->w.osl) {
        rc = pd_err_set(e, PD_EINVAL, "--isl %lld + --osl %lld: must be at least 1 each and at most --max-model-len %lld",
                        (long long)o->w.isl, (long long)o->w.osl, (long long)base.max_model_len);
        pd_plan_free(&p);
        return rc;
    }
    s->cards_per_node = p.hw.cards_per_node;
    s->nodes = base.nodes;
    struct cands pc = {0}, dc = {0};
    if ((rc = role_cands(&p, o, PD_ROLE_PREFILL, &pc, s, e)) || (rc = role_cands(&p, o, PD_ROLE_DECODE, &dc, s, e)))
        goto out;
    /* every layout is held for the front (160 bytes each): --cards 4096 made 73 million, 3 minutes
     * and about 12 GB, where a 24 GB host could run out; refused at once past 2^25 (5.4 GB), the
     * pairs counted by cards first (a bound: some of them the node map cannot place) */
    int64_t pairs = 0;
    for (int i = 0; i < pc.n; i++)
        for (int j = 0; j < dc.n; j++)
            pairs += pc.c[i].cards + dc.c[j].cards <= o->cards;
    if (pairs > SEARCH_MAX_LAYOUTS) {
        rc = pd_err_set(e, PD_EINVAL, "--cards %d: %lld prefill x decode layouts to hold, more than %d (%.1f GB); "
                        "search fewer cards (a deployment of several identical slices of the cluster), or plan a "
                        "layout of your choosing with pdmoe plan", o->cards, (long long)pairs, SEARCH_MAX_LAYOUTS,
                        (double)SEARCH_MAX_LAYOUTS * sizeof(struct pd_layout) / 1e9);
        goto out;
    }
    for (int i = 0; i < pc.n; i++)
        for (int j = 0; j < dc.n; j++) {
            if (pc.c[i].cards + dc.c[j].cards > o->cards)
                continue;
            /* whole instances on whole nodes, decode apart from prefill: a layout whose cards add up
             * but that the node map (every --emit, up --hosts) cannot place is no candidate */
            const int dp[2] = {pc.c[i].o.dp, dc.c[j].o.dp}, tp[2] = {pc.c[i].o.tp, dc.c[j].o.tp},
                      inst[2] = {pc.c[i].o.instances, dc.c[j].o.instances};
            int need = pd_nodes_needed(p.hw.cards_per_node, dp, tp, inst, 0);
            if (need < 0 || need > base.nodes) {
                s->n_unplaced++;
                continue;
            }
            if (push_layout(s, &pc.c[i], &dc.c[j], &p)) {
                rc = pd_err_set(e, PD_ENOMEM, "out of memory");
                goto out;
            }
        }
    for (int i = 0; i < s->n; i++) {
        const struct pd_layout *l = &s->l[i];
        s->n_fit += l->fits;
        s->n_meet += l->meets;
        if (l->fits && (s->best_any < 0 || better(l, &s->l[s->best_any])))
            s->best_any = i;
        if (l->meets && (s->best < 0 || better(l, &s->l[s->best])))
            s->best = i;
    }
    if (pareto(s)) {
        rc = pd_err_set(e, PD_ENOMEM, "out of memory");
        goto out;
    }
    if ((rc = pd_search_agg(&p, o, s, e)))
        goto out;
    /* the chosen layout as a full plan and prediction, for the report and the launch commands:
     * the winner of aggregated vs disaggregated, or the best of the kind asked for */
    struct pd_search_verdict v = pd_search_compare(s);
    int pick = s->best >= 0 ? s->best : s->best_any;
    int agg_pick = s->best_agg >= 0 ? s->best_agg : s->best_agg_any;
    s->chose_agg = o->pick == PD_PICK_AGGREGATED || (o->pick == PD_PICK_BEST && v.agg_wins);
    if (s->chose_agg && agg_pick >= 0) {
        const struct pd_agg_layout *l = &s->agg[agg_pick];
        struct pd_plan_opts po = base;
        po.aggregated = 1;
        po.role[PD_ROLE_DECODE] = l->o;
        po.max_num_seqs = l->batch;   /* the slots: pd_perf_agg runs the batch its chunks feed */
        if ((rc = pd_plan_build(&po, &s->plan, e)) || (rc = pd_perf_eval(&s->plan, &o->w, &s->perf, e)))
            goto out;
    }
    if (pick >= 0) {
        /* the best disaggregated layout's pools as its plan has them, whichever kind wins (the
         * report and JSON show it either way): the roles were costed at the base --max-num-seqs,
         * the plan (and --emit) give both the batch, and the logits rows of a prefill step follow it */
        const struct pd_layout *l = &s->l[pick];
        struct pd_plan_opts po = base;
        po.role[0] = l->role[0];
        po.role[1] = l->role[1];
        po.max_num_seqs = l->batch;
        struct pd_workload w = o->w;
        w.decode_batch = l->batch;
        struct pd_plan dp;
        struct pd_plan *pp = s->chose_agg ? &dp : &s->plan;
        if ((rc = pd_plan_build(&po, pp, e)))
            goto out;
        for (int r = 0; r < 2; r++) {
            s->l[pick].kv_pool[r] = pp->role[r].b.kv_pool;
            s->l[pick].kv_transient[r] = pp->role[r].b.kv_transient;
        }
        if (s->chose_agg)
            pd_plan_free(&dp);
        else if ((rc = pd_perf_eval(&s->plan, &w, &s->perf, e)))
            goto out;
    }
out:
    free(pc.c);
    free(dc.c);
    for (int i = 0; i < dc.n_steps; i++)
        free(dc.steps[i]);
    free(dc.steps);
    pd_plan_free(&p);
    if (rc)
        pd_search_free(s);
    return rc;
}

void pd_search_free(struct pd_search *s)
{
    pd_plan_free(&s->plan);
    free(s->agg);
    s->agg = NULL;
    s->n_agg = 0;
    free(s->l);
    free(s->front);
    s->l = NULL;
    s->front = NULL;
    s->n = s->n_front = 0;
}

/* "P 3x EP8, D 1x EP32 r32": instances x EP size, " r" redundant expert slots, tp when > 1. */
static const char *layout_str(char *buf, size_t n, const struct pd_layout *l)
{
    char part[2][40];
    for (int r = 0; r < 2; r++) {
        const struct pd_role_opts *x = &l->role[r];
        int k = x->tp > 1 ? snprintf(part[r], sizeof part[r], "%dx dp%d tp%d", x->instances, x->dp, x->tp)
                          : snprintf(part[r], sizeof part[r], "%dx EP%d", x->instances, x->dp);
        if (x->redundant > 0)
            snprintf(part[r] + k, sizeof part[r] - (size_t)k, " r%d", x->redundant);
    }
    snprintf(buf, n, "P %s, D %s", part[0], part[1]);
    return buf;
}

static void row(FILE *f, const struct pd_layout *l, const char *mark)
{
    char b[96];
    fprintf(f, "  %-2s %-30s %5d %6lld %10.0f %9.1f %9.1f %11.0f %9.3f  %s/%s\n", mark, layout_str(b, sizeof b, l),
            l->cards, (long long)l->batch, l->ttft_s * 1e3, l->tpot_s * 1e3, l->user_tok_s, l->tok_s_card, l->req_s,
            pd_bound_name(l->prefill_bound), pd_bound_name(l->decode_bound));
}

/* "A 4x EP8 r8": aggregated instances x EP size, as layout_str. */
static const char *agg_str(char *buf, size_t n, const struct pd_agg_layout *l)
{
    int k = l->o.tp > 1 ? snprintf(buf, n, "A %dx dp%d tp%d", l->o.instances, l->o.dp, l->o.tp)
                        : snprintf(buf, n, "A %dx EP%d", l->o.instances, l->o.dp);
    if (l->o.redundant > 0 && k > 0 && (size_t)k < n)
        snprintf(buf + k, n - (size_t)k, " r%d", l->o.redundant);
    return buf;
}

/* The comparison: the best aggregated and disaggregated layouts and which wins. */
static void compare_text(FILE *f, const struct pd_search *s)
{
    struct pd_search_verdict v = pd_search_compare(s);
    fprintf(f, "Aggregated vs disaggregated (the best of each on %d cards, %s; %d aggregated layouts costed, %d fit, "
               "%d meet)\n", s->o.cards, v.meets || (v.agg < 0) != (v.disagg < 0) ? "targets applied"
               : "none of either kind meets the targets: the best fitting ones", s->n_agg, s->n_agg_fit, s->n_agg_meet);
    fprintf(f, "  %-14s %-30s %5s %6s %10s %9s %9s %11s %9s\n", "", "layout", "cards", "batch", "TTFT ms", "TPOT ms",
            "tok/s/usr", "tok/s/card", "req/s");
    char b[96];
    if (v.agg >= 0) {
        const struct pd_agg_layout *l = &s->agg[v.agg];
        fprintf(f, "  %-14s %-30s %5d %6lld %10.0f %9.1f %9.1f %11.0f %9.3f\n", "aggregated", agg_str(b, sizeof b, l),
                l->cards, (long long)l->batch, l->ttft_s * 1e3, l->tpot_s * 1e3, l->user_tok_s, l->tok_s_card, l->req_s);
    } else {
        fprintf(f, "  %-14s none %s\n", "aggregated", s->n_agg_fit ? "meets the targets" : "fits in memory");
    }
    if (v.disagg >= 0) {
        const struct pd_layout *l = &s->l[v.disagg];
        fprintf(f, "  %-14s %-30s %5d %6lld %10.0f %9.1f %9.1f %11.0f %9.3f\n", "disaggregated",
                layout_str(b, sizeof b, l), l->cards, (long long)l->batch, l->ttft_s * 1e3, l->tpot_s * 1e3,
                l->user_tok_s, l->tok_s_card, l->req_s);
    } else {
        fprintf(f, "  %-14s none %s\n", "disaggregated",
                s->n_fit ? "meets the targets"
                : !s->n && s->n_unplaced ? "placed: whole instances on whole nodes, decode on nodes of its own, need "
                                           "more nodes than the cluster has"
                                         : "fits in memory");
    }
    if (v.agg >= 0 && v.disagg >= 0)
        fprintf(f, "  => %s wins: %.2fx the output tokens/s per card of the best %s layout\n\n",
                v.agg_wins ? "aggregated" : "disaggregated", v.ratio, v.agg_wins ? "disaggregated" : "aggregated");
    else if (v.agg >= 0 || v.disagg >= 0)
        fprintf(f, "  => %s wins: the only kind with a layout that %s\n\n", v.agg_wins ? "aggregated" : "disaggregated",
                v.meets || s->best >= 0 || s->best_agg >= 0 ? "meets the targets" : "fits");
    else
        fprintf(f, "\n");
}

static void header(FILE *f)
{
    fprintf(f, "  %-2s %-30s %5s %6s %10s %9s %9s %11s %9s  %s\n", "", "layout (x EP size, r redundant)", "cards", "batch",
            "TTFT ms", "TPOT ms", "tok/s/usr", "tok/s/card", "req/s", "bound (P/D)");
}

/* The best fitting layout whose TPOT is within `tpot` (and TTFT within the target, if any). */
int pd_search_tpot_targets(const struct pd_search *s, double t[PD_SEARCH_MAX_TPOTS])
{
    static const double common[] = {0.010, 0.020, 0.030, 0.050, 0.100, 0.200};
    int n = 0;
    for (size_t i = 0; i < sizeof common / sizeof common[0]; i++)
        t[n++] = common[i];
    int dup = 0;
    for (int i = 0; i < n; i++)
        dup |= fabs(t[i] - s->o.tpot_s) < 1e-9;
    if (s->o.tpot_s > 0 && !dup)
        t[n++] = s->o.tpot_s;
    for (int i = 1; i < n; i++)   /* insertion sort: a handful of entries */
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            double x = t[j];
            t[j] = t[j - 1];
            t[j - 1] = x;
        }
    return n;
}

int pd_search_best_under(const struct pd_search *s, double tpot)
{
    int b = -1;
    for (int i = 0; i < s->n; i++) {
        const struct pd_layout *l = &s->l[i];
        if (l->fits && l->sustains && l->tpot_s <= tpot && (s->o.ttft_s <= 0 || l->ttft_s <= s->o.ttft_s) &&
            (b < 0 || better(l, &s->l[b])))
            b = i;
    }
    return b;
}

const char *pd_search_load_source(const struct pd_search *s)
{
    return s->plan.load[0] || s->plan.load[1] ? "measured from the expert stats where given" : "the hardware file's";
}

char *pd_search_text(const struct pd_search *s, int units)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f)
        return NULL;
    const struct pd_plan *p = &s->plan;
    /* no layout fits: no plan was built, the card is the hardware file's all the same */
    struct pd_hardware hw;
    pd_err ignored;
    const char *card = p->hw.card_name[0]                                   ? p->hw.card_name
                       : pd_hardware_load(s->o.base.hardware, &hw, &ignored) ? "?"
                                                                               : hw.card_name;
    fprintf(f, "Layout search: %s on %d x %s (%s), isl %lld, osl %lld tokens",
            p->model.name[0] ? p->model.name : s->o.base.model, s->o.cards, card, s->o.base.hardware,
            (long long)s->o.w.isl, (long long)s->o.w.osl);
    if (s->o.ttft_s > 0)
        fprintf(f, ", TTFT <= %.0f ms", s->o.ttft_s * 1e3);
    if (s->o.tpot_s > 0)
        fprintf(f, ", TPOT <= %.1f ms", s->o.tpot_s * 1e3);
    if (s->o.w.rate > 0)
        fprintf(f, ", at %.2f requests/s (TTFT with queueing)", s->o.w.rate);
    if (s->o.w.concurrency > 0)
        fprintf(f, ", closed loop of %lld clients (TTFT, TPOT, tokens/s and requests/s at the batch they imply; "
                   "the batch column: decode slots per DP rank)", (long long)s->o.w.concurrency);
    fprintf(f, "\n  %d layouts costed, %d fit in memory, %d meet the targets, %d on the Pareto front\n", s->n, s->n_fit,
            s->n_meet, s->n_front);
    pd_err fe = {0};
    if (pd_plan_formats_servable(&s->plan, &fe))   /* (every layout: --emit refuses them all) */
        fprintf(f, "  NOT SERVABLE, any of them: %s\n", fe.msg);
    if (s->n_unplaced)
        fprintf(f, "  %d more within the cards left out: whole instances on whole nodes of %d cards, decode on nodes of "
                   "its own, need more nodes than the cluster's %lld (the node map every --emit and pdmoe up --hosts follow)\n",
                s->n_unplaced, s->cards_per_node, (long long)s->nodes);
    fputc('\n', f);
    fprintf(f, "What fits in memory (busiest card; the decode batch is per DP rank, of sequences of max-model-len\n"
               "%lld tokens, as --max-num-seqs admits them; the KV pool is a decode card's at a batch of %lld (the\n"
               "activations of a larger one take from it: a chosen layout's plan shows its own) and a prefill card's\n"
               "at --max-num-seqs %lld; MoE load: busiest rank / mean, %s)\n",
            (long long)s->o.base.max_model_len, (long long)batches[0], (long long)s->o.base.max_num_seqs,
            pd_search_load_source(s));
    fprintf(f, "  %-8s %-18s %13s %12s %12s %9s  %s\n", "role", "layout", "experts/card", "weights", "KV pool",
            "MoE load", "verdict");
    for (int i = 0; i < s->n_mem; i++) {
        const struct pd_search_mem *m = &s->mem[i];
        char lay[40], w[32], kv[32], v[64];
        int k = m->o.tp > 1 ? snprintf(lay, sizeof lay, "dp%d tp%d", m->o.dp, m->o.tp)
                            : snprintf(lay, sizeof lay, "EP%d", m->o.dp);
        if (m->o.redundant > 0)
            snprintf(lay + k, sizeof lay - (size_t)k, " r%d", m->o.redundant);
        if (!m->fits_weights)
            snprintf(v, sizeof v, "does not fit (weights)");
        else if (m->max_batch == 0)
            snprintf(v, sizeof v, "does not fit (KV of one %s)", m->role == PD_ROLE_PREFILL ? "prompt" : "sequence");
        else if (m->role == PD_ROLE_DECODE)
            snprintf(v, sizeof v, "fits, batch up to %lld%s", (long long)m->max_batch,
                     m->max_batch == batches[sizeof batches / sizeof batches[0] - 1] ? " (the most tried)" : "");
        else
            snprintf(v, sizeof v, "fits");
        fprintf(f, "  %-8s %-18s %13d %12s %12s %9.2f  %s\n", pd_role_name(m->role), lay, m->experts_per_card,
                pd_units_fmt_g(w, sizeof w, m->weights, (enum pd_units)units, 2),
                pd_units_fmt_g(kv, sizeof kv, m->kv_pool, (enum pd_units)units, 2), m->imbalance, v);
    }
    fprintf(f, "\n");
    fprintf(f, "Pareto front (output tokens/s per card vs tokens/s per user; * meets the targets, x misses them)\n");
    header(f);
    for (int i = s->n_front - 1; i >= 0; i--) {
        const struct pd_layout *l = &s->l[s->front[i]];
        row(f, l, s->front[i] == s->best ? "=>" : l->meets ? "*" : "x");
    }
    fprintf(f, "\nBest layout per TPOT target (fitting, TTFT target and request rate applied)\n");
    header(f);
    double tpots[PD_SEARCH_MAX_TPOTS];
    int nt = pd_search_tpot_targets(s, tpots);
    for (int i = 0; i < nt; i++) {
        int b = pd_search_best_under(s, tpots[i]);
        fprintf(f, "  TPOT <= %.1f ms:\n", tpots[i] * 1e3);
        if (b >= 0)
            row(f, &s->l[b], "");
        else
            fprintf(f, "     none\n");
    }
    fprintf(f, "\n");
    compare_text(f, s);
    int agg = s->best_agg >= 0 ? s->best_agg : s->best_agg_any, dis = s->best >= 0 ? s->best : s->best_any;
    if (s->chose_agg && agg >= 0) {
        char b[96];
        fprintf(f, "Chosen: %s, batch %lld per DP rank (%s)\n\n", agg_str(b, sizeof b, &s->agg[agg]),
                (long long)s->agg[agg].batch,
                s->best_agg >= 0 ? "the best aggregated layout meeting the targets" : "no aggregated layout meets the "
                "targets; the best fitting one ignoring them");
    } else if (!s->chose_agg && s->best >= 0) {
        char b[96];
        fprintf(f, "Chosen: %s, batch %lld per decode DP rank (best output tokens/s per card meeting the targets)\n\n",
                layout_str(b, sizeof b, &s->l[s->best]), (long long)s->l[s->best].batch);
    } else if (!s->chose_agg && s->best_any >= 0) {
        char b[96];
        fprintf(f, "No layout meets the targets; the best fitting layout ignoring them: %s, batch %lld\n\n",
                layout_str(b, sizeof b, &s->l[s->best_any]), (long long)s->l[s->best_any].batch);
    } else {
        fprintf(f, "No %slayout fits in memory on %d cards.\n", s->chose_agg ? "aggregated " : "disaggregated ", s->o.cards);
    }
    if (s->chose_agg ? agg >= 0 : dis >= 0) {
        char *t = pd_plan_text(p, units), *q = pd_perf_text(p, &s->perf);
        if (t)
            fputs(t, f);
        if (q)
            fputs(q, f);
        free(t);
        free(q);
    }
    fclose(f);
    return buf;
}

/* A number of the JSON, or null where it has none (a TTFT at a rate the layout cannot sustain is
 * infinite: json_pack refused it, the layout fell out of the front and the whole document was
 * reported as out of memory). */
static json_t *num(double x)
{
    return isfinite(x) ? json_real(x) : json_null();
}

static json_t *layout_json(const struct pd_layout *l)
{
    json_t *roles = json_array();
    for (int r = 0; r < 2; r++)
        json_array_append_new(roles, json_pack("{s:s,s:i,s:i,s:i,s:i,s:i,s:I,s:I,s:I}", "role", pd_role_name((enum pd_role)r),
                                               "dp", l->role[r].dp, "tp", l->role[r].tp, "instances", l->role[r].instances,
                                               "redundant", l->role[r].redundant, "experts_per_card",
                                               l->experts_per_card[r], "weights_bytes", (json_int_t)l->weights[r],
                                               "kv_pool_bytes", (json_int_t)l->kv_pool[r], "kv_transient_bytes",
                                               (json_int_t)l->kv_transient[r]));
    return json_pack("{s:o,s:I,s:i,s:o,s:o,s:o,s:o,s:o,s:o,s:o,s:s,s:s,s:b,s:b,s:b}", "roles", roles, "batch",
                     (json_int_t)l->batch, "cards", l->cards, "ttft_s", num(l->ttft_s), "tpot_s", num(l->tpot_s),
                     "tokens_per_s_user", num(l->user_tok_s), "tokens_per_s_card", num(l->tok_s_card), "requests_per_s",
                     num(l->req_s), "prefill_requests_per_s", num(l->prefill_req_s), "decode_requests_per_s",
                     num(l->decode_req_s),
                     "prefill_bound", pd_bound_name(l->prefill_bound), "decode_bound", pd_bound_name(l->decode_bound),
                     "fits", l->fits, "meets", l->meets, "pareto", l->pareto);
}

static json_t *agg_json(const struct pd_agg_layout *l)
{
    return json_pack("{s:i,s:i,s:i,s:i,s:i,s:I,s:I,s:I,s:I,s:i,s:I,s:o,s:o,s:o,s:o,s:o,s:o,s:s,s:b,s:b}", "dp", l->o.dp,
                     "tp", l->o.tp, "instances", l->o.instances, "redundant", l->o.redundant, "experts_per_card",
                     l->experts_per_card, "weights_bytes", (json_int_t)l->weights, "kv_pool_bytes",
                     (json_int_t)l->kv_pool, "kv_transient_bytes", (json_int_t)l->kv_transient, "batch", (json_int_t)l->batch, "cards", l->cards, "chunk_tokens",
                     (json_int_t)l->chunk, "chunk_share", num(l->chunk_share), "ttft_s", num(l->ttft_s), "tpot_s",
                     num(l->tpot_s), "tokens_per_s_user", num(l->user_tok_s), "tokens_per_s_card", num(l->tok_s_card),
                     "requests_per_s", num(l->req_s),
                     "bound", pd_bound_name(l->bound), "fits", l->fits, "meets", l->meets);
}

char *pd_search_json(const struct pd_search *s)
{
    return pd_search_json_ext(s, NULL);
}

char *pd_search_json_ext(const struct pd_search *s, void *validation)
{
    json_t *front = json_array();
    for (int i = 0; i < s->n_front; i++)
        json_array_append_new(front, layout_json(&s->l[s->front[i]]));
    json_t *mem = json_array();
    for (int i = 0; i < s->n_mem; i++) {
        const struct pd_search_mem *m = &s->mem[i];
        json_array_append_new(mem, json_pack("{s:s,s:i,s:i,s:i,s:i,s:I,s:I,s:b,s:I,s:o}", "role", pd_role_name(m->role),
                                             "dp", m->o.dp, "tp", m->o.tp, "redundant", m->o.redundant,
                                             "experts_per_card", m->experts_per_card, "weights_bytes",
                                             (json_int_t)m->weights, "kv_pool_bytes", (json_int_t)m->kv_pool,
                                             "fits_weights", m->fits_weights, "max_batch", (json_int_t)m->max_batch,
                                             "expert_imbalance", num(m->imbalance)));
    }
    int pick = s->best >= 0 ? s->best : s->best_any;
    json_t *root = json_pack("{s:i,s:s,s:s,s:i,s:I,s:I,s:f,s:f,s:i,s:i,s:i,s:o,s:o,s:o}", "search_version", 1,
                             "model", s->o.base.model ? s->o.base.model : "", "hardware", s->o.base.hardware, "cards",
                             s->o.cards, "isl", (json_int_t)s->o.w.isl, "osl", (json_int_t)s->o.w.osl, "ttft_target_s",
                             s->o.ttft_s, "tpot_target_s", s->o.tpot_s, "layouts", s->n, "fit", s->n_fit, "meet",
                             s->n_meet, "front", front, "best", pick >= 0 ? layout_json(&s->l[pick]) : json_null(),
                             "best_meets_targets", json_boolean(s->best >= 0));
    if (root)
        json_object_set_new(root, "memory", mem);
    if (root)
        json_object_set_new(root, "concurrency", s->o.w.concurrency > 0 ? json_integer(s->o.w.concurrency) : json_null());
    int agg = s->best_agg >= 0 ? s->best_agg : s->best_agg_any;
    if (root && (s->chose_agg ? agg : pick) >= 0)
        json_object_set_new(root, "prediction", pd_perf_json(&s->perf));
    if (root) {
        struct pd_search_verdict v = pd_search_compare(s);
        json_object_set_new(root, "aggregated",
                            json_pack("{s:i,s:i,s:i,s:o,s:b}", "layouts", s->n_agg, "fit", s->n_agg_fit, "meet",
                                      s->n_agg_meet, "best", agg >= 0 ? agg_json(&s->agg[agg]) : json_null(),
                                      "best_meets_targets", s->best_agg >= 0));
        json_object_set_new(root, "comparison",
                            json_pack("{s:o,s:o,s:o,s:o,s:b}", "aggregated", v.agg >= 0 ? agg_json(&s->agg[v.agg]) : json_null(),
                                      "disaggregated", v.disagg >= 0 ? layout_json(&s->l[v.disagg]) : json_null(),
                                      "winner", v.agg < 0 && v.disagg < 0 ? json_null()
                                                : json_string(v.agg_wins ? "aggregated" : "disaggregated"),
                                      "ratio", num(v.ratio), "targets_met", v.meets));
        json_object_set_new(root, "chosen", json_string(s->chose_agg ? "aggregated" : "disaggregated"));
    }
    if (root && validation)
        json_object_set_new(root, "validation", validation);   /* (taken: freed if it cannot be set) */
    else
        json_decref(validation);
    char *out = root ? json_dumps(root, JSON_INDENT(2)) : NULL;
    json_decref(root);
    return out;
}

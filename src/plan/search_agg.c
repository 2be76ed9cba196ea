/* The layout search's aggregated layouts (search.h): colocated instances costed by the
 * aggregated model (agg.c) on the same cards, workload and targets as the disaggregated
 * layouts, and the comparison of the best of each. */
#include "plan/search.h"
#include "plan/nodes.h"
#include "core/grow.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Decode batches per DP rank tried, as the disaggregated decode roles'. */
static const int64_t batches[] = {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024};
#define N_BATCHES ((int)(sizeof batches / sizeof batches[0]))

static struct pd_agg_layout *agg_push(struct pd_search *s)
{
    if (PD_GROW(s->agg, s->cap_agg, (size_t)s->n_agg + 1))
        return NULL;
    struct pd_agg_layout *l = &s->agg[s->n_agg++];
    memset(l, 0, sizeof *l);
    return l;
}

/* More output tokens/s per card, then per user, then fewer cards: the disaggregated order. */
static int agg_better(const struct pd_agg_layout *a, const struct pd_agg_layout *b)
{
    if (a->tok_s_card != b->tok_s_card)
        return a->tok_s_card > b->tok_s_card;
    if (a->user_tok_s != b->user_tok_s)
        return a->user_tok_s > b->user_tok_s;
    return a->cards < b->cards;
}

/* One layout o (instances aside): its memory at each batch, its costs, then every instance count.
 * q is p with both roles set to the layout and o.aggregated, as pdmoe plan --aggregated builds it. */
static int agg_layout(struct pd_plan *p, const struct pd_search_opts *so, const struct pd_role_opts *o,
                      struct pd_search *s, pd_err *e)
{
    const int ep = o->dp * o->tp, k = (int)pd_perf_decode_tokens(p);
    const double tps = pd_perf_tokens_per_step(p), req = p->hw.eff.request_s;
    struct pd_agg_curve curve = {0};
    int rc = 0;
    for (int nb = 0; nb < N_BATCHES; nb++) {
        const int64_t batch = batches[nb];
        if (batch * k >= p->o.max_num_batched_tokens)
            break;                        /* no room left for a prompt chunk in a step */
        p->o.aggregated = 1;
        p->o.max_num_seqs = batch;
        struct pd_role_plan rp;
        rc = pd_plan_role_eval(p, PD_ROLE_DECODE, o, &rp, e);
        p->o.aggregated = 0;
        if (rc)
            break;
        /* room as pdmoe plan judges it: max-num-seqs (the batch) sequences of max-model-len */
        int room = rp.fits_max_num_seqs;
        if (!room && nb > 0) {
            pd_placement_free(&rp.place);
            break;                        /* larger batches fit even less */
        }
        struct pd_plan q = *p;
        q.o.aggregated = 1;
        q.o.max_num_seqs = batch;
        q.role[PD_ROLE_PREFILL] = q.role[PD_ROLE_DECODE] = rp;
        q.role[PD_ROLE_PREFILL].role = PD_ROLE_PREFILL;
        /* max-num-seqs is the batch; the rank runs at the largest batch within it that its chunks
         * feed (pd_perf_agg_batch), as pdmoe plan --aggregated --max-num-seqs predicts it */
        struct pd_workload w = so->w;
        w.decode_batch = 0;
        struct pd_agg a;
        pd_perf_agg_at(&q, &w, pd_perf_agg_batch(&q, &w), &a);
        w.decode_batch = batch;
        if (so->w.concurrency > 0) {      /* the closed loop's curve up to this batch (the slots) */
            pd_perf_agg_curve_free(&curve);
            int64_t n = so->w.concurrency < batch ? so->w.concurrency : batch;
            if ((rc = pd_perf_agg_curve(&q, &w, n, &curve))) {
                pd_placement_free(&rp.place);
                rc = pd_err_set(e, PD_ENOMEM, "out of memory");
                break;
            }
        }
        for (int inst = 1; inst * ep <= so->cards; inst++) {
            /* whole instances on whole nodes (the node map every launcher follows) */
            int need = pd_nodes_needed(p->hw.cards_per_node, (const int[2]){0, o->dp}, (const int[2]){1, o->tp},
                                       (const int[2]){0, inst}, 1);
            if (need < 0 || need > p->nodes)
                break;   /* (more instances need at least as many nodes) */
            struct pd_agg_layout *l = agg_push(s);
            if (!l) {
                rc = pd_err_set(e, PD_ENOMEM, "out of memory");
                break;
            }
            const int ranks = o->dp * inst;
            l->o = *o;
            l->o.instances = inst;
            l->batch = batch;
            l->cards = ep * inst;
            l->experts_per_card = rp.place.slots;
            l->weights = rp.b.weights;
            l->kv_pool = rp.b.kv_pool;
            l->kv_transient = rp.b.kv_transient;
            l->chunk = a.chunk;
            l->chunk_share = a.chunk_share;
            l->bound = a.mixed_step.bound;
            l->ttft_s = req + a.prefill_s + pd_perf_queue_wait(ranks, a.prefill_s, so->w.rate);
            l->tpot_s = a.step_s / tps;
            l->user_tok_s = 1 / l->tpot_s;
            l->req_s = a.rank_req_s * ranks;
            l->tok_s_card = l->req_s * (double)so->w.osl / l->cards;
            l->fits = room && a.chunk >= 1 && a.batch_cap >= batch;
            l->run_batch = a.batch;
            l->sustains = so->w.rate <= 0 || l->req_s >= so->w.rate;
            if (so->w.concurrency > 0) {
                struct pd_closed c;
                pd_perf_agg_closed(&curve, so->w.concurrency, so->w.osl, req, ranks, batch, l->cards, &c);
                l->ttft_s = c.ttft_s;
                l->tpot_s = c.tpot_s;
                l->user_tok_s = 1 / c.tpot_s;
                l->req_s = c.req_s;
                l->tok_s_card = c.tok_s_card;
            }
            l->meets = l->fits && l->sustains && (so->ttft_s <= 0 || l->ttft_s <= so->ttft_s) &&
                       (so->tpot_s <= 0 || l->tpot_s <= so->tpot_s);
        }
        pd_placement_free(&rp.place);
        if (rc)
            break;
    }
    pd_perf_agg_curve_free(&curve);
    return rc;
}

int pd_search_agg(struct pd_plan *p, const struct pd_search_opts *so, struct pd_search *s, pd_err *e)
{
    const int cpn = p->hw.cards_per_node, E = p->inv.n_experts > 0 ? p->inv.n_experts : 1;
    const int64_t keep = p->o.max_num_seqs;
    s->best_agg = s->best_agg_any = -1;
    int rc = 0;
    for (int tp = 1; tp <= so->max_tp && tp <= cpn && !rc; tp *= 2)
        for (int ep = tp; ep <= so->cards && !rc; ep++) {
            if (!pd_search_ep_ok(ep, tp, cpn))
                continue;
            int need = pd_search_redundant_for(E, ep);
            if (need > 0 && !p->hw.redundant_experts)
                continue;
            for (int eplb = 0; eplb < (ep > 1 && need == 0 && p->hw.redundant_experts ? 2 : 1) && !rc; eplb++) {
                struct pd_role_opts o = {.dp = ep / tp, .tp = tp, .instances = 1, .redundant = eplb ? ep : need};
                rc = agg_layout(p, so, &o, s, e);
            }
        }
    p->o.max_num_seqs = keep;
    if (rc)
        return rc;
    for (int i = 0; i < s->n_agg; i++) {
        const struct pd_agg_layout *l = &s->agg[i];
        s->n_agg_fit += l->fits;
        s->n_agg_meet += l->meets;
        if (l->fits && (s->best_agg_any < 0 || agg_better(l, &s->agg[s->best_agg_any])))
            s->best_agg_any = i;
        if (l->meets && (s->best_agg < 0 || agg_better(l, &s->agg[s->best_agg])))
            s->best_agg = i;
    }
    return 0;
}

/* i if it indexes one of n layouts, else -1 */
static int valid(int i, int n)
{
    return i >= 0 && i < n ? i : -1;
}

struct pd_search_verdict pd_search_compare(const struct pd_search *s)
{
    struct pd_search_verdict v = {-1, -1, 0, 0, 0};
    const int ba = valid(s->best_agg, s->n_agg), bd = valid(s->best, s->n);
    v.meets = ba >= 0 && bd >= 0;
    if (ba >= 0 || bd >= 0) {        /* both meet the targets, or only one kind does: it wins */
        v.agg = ba;
        v.disagg = bd;
    } else {
        v.agg = valid(s->best_agg_any, s->n_agg);
        v.disagg = valid(s->best_any, s->n);
    }
    double a = v.agg >= 0 ? s->agg[v.agg].tok_s_card : 0, d = v.disagg >= 0 ? s->l[v.disagg].tok_s_card : 0;
    v.agg_wins = v.agg >= 0 && (v.disagg < 0 || a > d);
    v.ratio = a > 0 && d > 0 ? (v.agg_wins ? a / d : d / a) : 0;
    return v;
}

/* Layout search: for a model, hardware and a number of cards, every disaggregated layout (a
 * prefill layout: EP size, TP size, instances; and a decode layout: the same and a batch per DP
 * rank) that divides the experts and the cards, each costed by the performance model and
 * rate-matched (the deployment serves min(prefill requests/s, decode requests/s)); the Pareto
 * front of output tokens/s per card against tokens/s per user; the best layout that fits memory
 * and meets the TTFT and TPOT targets, as aiconfigurator does for Dynamo, with the KV hand-off in
 * TTFT. Besides, every aggregated layout (instances that prefill and decode on the same cards:
 * EP size, TP size, instances, batch per DP rank; search_agg.c) on the same cards and targets,
 * and which of the best of each kind serves more output tokens/s per card. */
#ifndef PD_PLAN_SEARCH_H
#define PD_PLAN_SEARCH_H

#include <stdint.h>

#include "core/err.h"
#include "plan/perf.h"
#include "plan/plan.h"

/* Which layout a search's plan, prediction and --emit take. */
enum pd_search_pick { PD_PICK_BEST, PD_PICK_AGGREGATED, PD_PICK_DISAGGREGATED };

struct pd_search_opts {
    struct pd_plan_opts base;    /* model, hardware, memory options; its layouts are ignored */
    int cards;                   /* cards to spend, P + D <= cards */
    struct pd_workload w;
    double ttft_s, tpot_s;       /* targets; 0: none */
    int max_tp;                  /* largest TP size tried (default 1: EP with DP attention) */
    enum pd_search_pick pick;    /* the layout the plan and prediction are built for: the winner of
                                    aggregated vs disaggregated (default), or the best of one kind */
};

struct pd_layout {
    struct pd_role_opts role[2];
    int64_t batch;               /* decode sequences per DP rank */
    int cards;                   /* P + D cards */
    int experts_per_card[2];
    int64_t weights[2], kv_pool[2];   /* bytes on the busiest card of each role */
    int64_t kv_transient[2];          /* of kv_pool, the chunks in flight's (plan.h pd_budget) */
    double ttft_s, tpot_s, user_tok_s, tok_s_card, req_s;   /* ttft_s with the queueing delay at w.rate */
    double prefill_req_s, decode_req_s;
    enum pd_bound prefill_bound, decode_bound;
    int fits;                    /* weights fit on both roles, the batch fits D's KV pool */
    int sustains;                /* serves the workload's request rate (always, without one) */
    int meets;                   /* fits, sustains the rate, and meets both targets */
    int pareto;                  /* on the front of the layouts that fit */
};

/* What fits, per role layout (instances aside): the verdict the memory plan gives. */
struct pd_search_mem {
    enum pd_role role;
    struct pd_role_opts o;       /* instances = 1 */
    int experts_per_card;
    int64_t weights, kv_pool;    /* bytes on the busiest card, decode at batch 1 */
    int fits_weights;
    int64_t max_batch;           /* decode: the largest batch tried whose KV fits; prefill: 1 if a prompt fits */
    double imbalance;            /* busiest rank's expert load / mean its steps are costed with */
};

/* An aggregated layout: instances of dp x tp cards that each prefill and decode (chunked
 * prefill), at a decode batch per DP rank (the emitted --max-num-seqs). */
struct pd_agg_layout {
    struct pd_role_opts o;
    int64_t batch;               /* max-num-seqs per DP rank: the slots */
    int64_t run_batch;           /* open loop: the batch it runs at, the largest its chunks feed */
    int cards, experts_per_card;
    int64_t weights, kv_pool;    /* bytes on the busiest card */
    int64_t kv_transient;        /* of kv_pool, the chunks in flight's (plan.h pd_budget) */
    int64_t chunk;               /* prompt tokens per mixed step at this batch */
    double ttft_s, tpot_s, user_tok_s, tok_s_card, req_s;   /* as pd_layout's */
    double chunk_share;          /* share of steps carrying a chunk (> 1: prefill limits) */
    enum pd_bound bound;         /* the mixed step's */
    int fits, sustains, meets;
};

#define PD_SEARCH_MAX_MEM 256

struct pd_search {
    struct pd_search_opts o;
    struct pd_plan plan;         /* the model and hardware; its role plans are the best layout's */
    struct pd_perf perf;         /* the best layout's prediction */
    struct pd_layout *l;
    int n;
    size_t cap;
    int best;                    /* index in l of the best layout meeting the targets, or -1 */
    int best_any;                /* the best fitting layout ignoring the targets, or -1 */
    int *front;                  /* indices of the Pareto front, by tokens/s per user ascending */
    int n_front;
    int n_fit, n_meet;
    int n_unplaced;              /* pairs of role layouts within the cards that whole instances on whole
                                  * nodes, decode apart from prefill, cannot place: not costed */
    int cards_per_node, nodes;   /* the cluster the search placed on */
    struct pd_search_mem mem[PD_SEARCH_MAX_MEM];
    int n_mem;
    /* aggregated layouts on the same cards, targets and workload */
    struct pd_agg_layout *agg;
    int n_agg, n_agg_fit, n_agg_meet;
    size_t cap_agg;
    int best_agg;                /* the best aggregated layout meeting the targets, or -1 */
    int best_agg_any;            /* ... ignoring the targets, or -1 */
    int chose_agg;               /* the plan and prediction are the best aggregated layout's */
};

void pd_search_opts_default(struct pd_search_opts *o);
/* The aggregated layouts of a search (search_agg.c), on p (the search's model and hardware):
 * every EP size, TP size and redundancy the disaggregated roles try, every instance count within
 * the cards and every decode batch that fits, costed by pd_perf_agg_at; fills s->agg, best_agg. */
int pd_search_agg(struct pd_plan *p, const struct pd_search_opts *o, struct pd_search *s, pd_err *e);
/* The role layouts both kinds try (search.c): EP size ep with TP size tp on nodes of cpn cards,
 * and the redundant slots that make ep divide the experts. */
int pd_search_ep_ok(int ep, int tp, int cpn);
int pd_search_redundant_for(int experts, int ep);
/* Aggregated vs disaggregated: which of the two best layouts (targets met, else ignoring them)
 * has more output tokens/s per card; ratio = winner's / other's (0 when one kind has none). */
struct pd_search_verdict {
    int agg, disagg;             /* indices in s->agg and s->l, or -1 */
    int meets;                   /* both compared layouts meet the targets (else: ignoring them) */
    int agg_wins;
    double ratio;
};
struct pd_search_verdict pd_search_compare(const struct pd_search *s);
int pd_search_run(const struct pd_search_opts *o, struct pd_search *s, pd_err *e);
void pd_search_free(struct pd_search *s);
/* The layout with the most output tokens/s per card (then per user, then fewest cards) that fits,
 * sustains the request rate, meets the TTFT target and has a TPOT <= tpot; -1 if none. */
int pd_search_best_under(const struct pd_search *s, double tpot);
/* The TPOT targets the "best layout per TPOT target" tables read the front at, in seconds,
 * ascending: 10, 20, 30, 50, 100 and 200 ms and the search's own TPOT target; returns how many
 * (at most PD_SEARCH_MAX_TPOTS). The text and the HTML report list the same. */
#define PD_SEARCH_MAX_TPOTS 8
int pd_search_tpot_targets(const struct pd_search *s, double t[PD_SEARCH_MAX_TPOTS]);
/* Where the memory table's MoE load comes from: the expert stats, or the hardware file. */
const char *pd_search_load_source(const struct pd_search *s);

char *pd_search_text(const struct pd_search *s, int units);   /* malloc'ed */
char *pd_search_json(const struct pd_search *s);              /* malloc'ed */
/* The same with `validation` (a json_t *, taken; NULL for none) as its "validation" member: the
 * published runs of the model on these cards (validate.h pd_validate_vouch). */
char *pd_search_json_ext(const struct pd_search *s, void *validation);

#endif

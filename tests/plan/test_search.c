/* Layout search: the card budget holds, the front is the Pareto front of the fitting layouts,
 * the chosen layout is the best that meets the targets, memory verdicts agree with the planner,
 * and bad options are named. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "plan/nodes.h"
#include "plan/search.h"
#include "../tmpmodel.h"

static void run(struct pd_search_opts *o, struct pd_search *s)
{
    pd_err e = {0};
    cr_assert_eq(pd_search_run(o, s, &e), 0, "%s", e.msg);
}

static void seed_opts(struct pd_search_opts *o)
{
    pd_search_opts_default(o);
    o->cards = 64;
    o->ttft_s = 2.0;
    o->tpot_s = 0.05;
}

Test(search, budget_and_layout_rules)
{
    struct pd_search_opts o;
    struct pd_search s;
    seed_opts(&o);
    o.max_tp = 2;
    run(&o, &s);
    cr_assert_gt(s.n, 1000);
    int tp2 = 0;
    for (int i = 0; i < s.n; i++) {
        const struct pd_layout *l = &s.l[i];
        cr_assert_leq(l->cards, 64);
        for (int r = 0; r < 2; r++) {
            const struct pd_role_opts *x = &l->role[r];
            int ep = x->dp * x->tp;
            cr_assert_eq((256 + x->redundant) % ep, 0, "EP%d with %d redundant", ep, x->redundant);
            cr_assert(ep <= 8 ? 8 % ep == 0 : ep % 8 == 0, "EP%d neither divides a node nor spans whole nodes", ep);
            cr_assert_eq(l->experts_per_card[r], (256 + x->redundant) / ep);
            tp2 |= x->tp == 2;
        }
        cr_assert_eq(l->cards, l->role[0].dp * l->role[0].tp * l->role[0].instances +
                                   l->role[1].dp * l->role[1].tp * l->role[1].instances);
    }
    cr_assert(tp2, "--max-tp 2 tried no tp=2 layout");
    pd_search_free(&s);
}

/* Every layout the search ranks can be placed: the plan of each builds its node map (every
 * --emit and pdmoe up --hosts follow it). The search once ranked layouts whose cards added up but
 * whose instances could not be placed, and --emit then refused the layout it had chosen; on one
 * node of 8 cards (decode never shares the prefill's nodes) it has no disaggregated layout and
 * says how many it left out. */
Test(search, every_ranked_layout_can_be_placed_on_the_nodes)
{
    struct pd_search_opts o;
    struct pd_search s;
    seed_opts(&o);
    o.cards = 24;   /* three nodes of 8 */
    run(&o, &s);
    cr_assert_gt(s.n, 10);
    cr_assert_gt(s.n_unplaced, 0, "24 cards hold layouts that three nodes cannot");
    int step = s.n / 40 > 0 ? s.n / 40 : 1;
    for (int i = 0; i < s.n; i += step) {
        struct pd_plan_opts po = o.base;
        po.nodes = 3;
        po.role[0] = s.l[i].role[0];
        po.role[1] = s.l[i].role[1];
        struct pd_plan p;
        struct pd_node_layout L;
        pd_err e = {0};
        cr_assert_eq(pd_plan_build(&po, &p, &e), 0, "layout %d: %s", i, e.msg);
        cr_assert_eq(pd_nodes_build(&p, &L, &e), 0, "layout %d (P %dx dp%d tp%d, D %dx dp%d tp%d): %s", i,
                     po.role[0].instances, po.role[0].dp, po.role[0].tp, po.role[1].instances, po.role[1].dp,
                     po.role[1].tp, e.msg);
        pd_nodes_free(&L);
        pd_plan_free(&p);
    }
    pd_search_free(&s);
    o.cards = 8;
    run(&o, &s);
    cr_assert_eq(s.n, 0);
    cr_assert_gt(s.n_unplaced, 0);
    char *t = pd_search_text(&s, 0);
    cr_assert(t && strstr(t, "more within the cards left out"), "%s", t);
    free(t);
    pd_search_free(&s);
    /* such a layout asked of plan directly: its report and its JSON say why (the JSON had no node
     * map and no word of it, and up --hosts then blamed the plan's version) */
    struct pd_plan_opts po = o.base;
    po.nodes = 1;
    po.role[0] = po.role[1] = (struct pd_role_opts){.dp = 8, .tp = 1, .instances = 1};
    po.role[0].dp = 4;
    po.role[1].dp = 4;
    struct pd_plan p;
    pd_err e = {0};
    cr_assert_eq(pd_plan_build(&po, &p, &e), 0, "%s", e.msg);
    t = pd_plan_text(&p, 0);
    cr_assert(t && strstr(t, "cannot be placed on the nodes: placing whole instances on nodes of 8 cards needs 2 "
                             "nodes"), "%.600s", t);
    free(t);
    t = pd_plan_json(&p, NULL);
    cr_assert(t && strstr(t, "\"node_map_error\": \"placing whole instances") && !strstr(t, "\"node_map\":"), "%s",
              t ? strstr(t, "\"aggregated\"") : "");
    free(t);
    pd_plan_free(&p);
}

/* As the planner says (docs/seed-reproduction.md): EP4 (64 experts per card) does not hold
 * V4-Flash's weights on a 64 GiB card, EP8 does. */
Test(search, memory_verdicts_match_the_planner)
{
    struct pd_search_opts o;
    struct pd_search s;
    seed_opts(&o);
    run(&o, &s);
    int ep4 = 0, ep8 = 0;
    for (int i = 0; i < s.n; i++) {
        const struct pd_layout *l = &s.l[i];
        int pep = l->role[0].dp * l->role[0].tp;
        if (pep == 4) {
            ep4++;
            cr_assert_not(l->fits);
        }
        if (pep == 8 && l->role[1].dp == 32 && l->batch == 16) {
            ep8++;
            cr_assert(l->fits);
        }
    }
    cr_assert_gt(ep4, 0);
    cr_assert_gt(ep8, 0);
    /* the memory table says the same, per role layout */
    int rows4 = 0, rows8 = 0;
    for (int i = 0; i < s.n_mem; i++) {
        const struct pd_search_mem *m = &s.mem[i];
        if (m->o.dp == 4) {
            rows4++;
            cr_assert_not(m->fits_weights);
            cr_assert_eq(m->max_batch, 0);
        }
        if (m->o.dp == 8 && m->o.redundant == 0) {
            rows8++;
            cr_assert(m->fits_weights);
            cr_assert_eq(m->experts_per_card, 32);
            if (m->role == PD_ROLE_DECODE)   /* 108 sequences of max-model-len fit, as the plan says */
                cr_assert_geq(m->max_batch, 32);
        }
    }
    cr_assert_eq(rows4, 2);    /* EP4 for each role: no redundant slots on A2 (hardware file) */
    cr_assert_eq(rows8, 2);
    for (int i = 0; i < s.n; i++)
        cr_assert_eq(s.l[i].role[0].redundant + s.l[i].role[1].redundant, 0, "A2's stack has no redundant experts");
    pd_search_free(&s);
    /* where the stack has them, every dividing EP size is also tried with EPLB */
    o.base.hardware = "h800";
    o.base.model = "deepseek-v3";
    run(&o, &s);
    int plain = 0, eplb = 0;
    for (int i = 0; i < s.n_mem; i++) {
        plain += s.mem[i].o.dp == 8 && s.mem[i].o.redundant == 0;
        eplb += s.mem[i].o.dp == 8 && s.mem[i].o.redundant == 8;
    }
    cr_assert_eq(plain, 2);
    cr_assert_eq(eplb, 2);
    pd_search_free(&s);
}

Test(search, front_is_the_pareto_front)
{
    struct pd_search_opts o;
    struct pd_search s;
    seed_opts(&o);
    run(&o, &s);
    cr_assert_gt(s.n_front, 2);
    for (int f = 0; f < s.n_front; f++) {
        const struct pd_layout *a = &s.l[s.front[f]];
        cr_assert(a->fits && a->pareto);
        if (f > 0) {   /* ascending per user, so descending per card */
            cr_assert_gt(a->user_tok_s, s.l[s.front[f - 1]].user_tok_s);
            cr_assert_lt(a->tok_s_card, s.l[s.front[f - 1]].tok_s_card);
        }
    }
    for (int i = 0; i < s.n; i++) {
        const struct pd_layout *x = &s.l[i];
        if (!x->fits)
            continue;
        int dominated = 0;
        for (int f = 0; f < s.n_front; f++) {
            const struct pd_layout *a = &s.l[s.front[f]];
            cr_assert_not(x->user_tok_s >= a->user_tok_s && x->tok_s_card > a->tok_s_card,
                          "layout %d dominates front member %d", i, s.front[f]);
            dominated |= a->user_tok_s >= x->user_tok_s && a->tok_s_card >= x->tok_s_card;
        }
        cr_assert(dominated || x->pareto, "layout %d is neither on the front nor dominated by it", i);
    }
    pd_search_free(&s);
}

Test(search, best_meets_targets_and_is_best)
{
    struct pd_search_opts o;
    struct pd_search s;
    seed_opts(&o);
    o.pick = PD_PICK_DISAGGREGATED;   /* the plan below is the disaggregated best's */
    run(&o, &s);
    cr_assert_geq(s.best, 0);
    const struct pd_layout *b = &s.l[s.best];
    cr_assert(b->meets && b->ttft_s <= o.ttft_s && b->tpot_s <= o.tpot_s);
    for (int i = 0; i < s.n; i++)
        if (s.l[i].meets)
            cr_assert_leq(s.l[i].tok_s_card, b->tok_s_card);
    /* the chosen layout's full plan and prediction agree with its row */
    cr_assert_eq(s.plan.role[0].o.dp, b->role[0].dp);
    cr_assert_eq(s.plan.role[1].o.instances, b->role[1].instances);
    cr_assert_float_eq(s.perf.tpot_s, b->tpot_s, 1e-9);
    cr_assert_float_eq(s.perf.ttft_s, b->ttft_s, 1e-9);
    cr_assert_float_eq(s.perf.tok_s_card, b->tok_s_card, 1e-6 * b->tok_s_card);
    /* an impossible target: nothing meets it, the best fitting layout is still reported */
    pd_search_free(&s);
    o.tpot_s = 1e-6;
    run(&o, &s);
    cr_assert_eq(s.best, -1);
    cr_assert_eq(s.n_meet, 0);
    cr_assert_geq(s.best_any, 0);
    pd_search_free(&s);
}

/* At a request rate: TTFT includes the queue before prefill, and a layout that cannot serve the
 * rate never meets the targets. */
Test(search, request_rate)
{
    struct pd_search_opts o;
    struct pd_search s0, s1;
    seed_opts(&o);
    run(&o, &s0);
    o.w.rate = 40;
    run(&o, &s1);
    cr_assert_eq(s0.n, s1.n);
    int queued = 0;
    for (int i = 0; i < s1.n; i++) {
        const struct pd_layout *a = &s0.l[i], *b = &s1.l[i];
        cr_assert_eq(a->cards, b->cards);
        cr_assert_geq(b->ttft_s, a->ttft_s);
        queued += b->ttft_s > a->ttft_s;
        cr_assert_eq(b->sustains, b->req_s >= 40);
        if (b->meets)
            cr_assert(b->sustains && b->ttft_s <= o.ttft_s);
    }
    cr_assert_gt(queued, 0);
    cr_assert_lt(s1.n_meet, s0.n_meet);
    cr_assert_geq(s1.best, 0);
    cr_assert_geq(s1.l[s1.best].req_s, 40);
    pd_search_free(&s0);
    pd_search_free(&s1);
}

Test(search, bad_options)
{
    struct pd_search_opts o;
    struct pd_search s;
    pd_err e = {0};
    seed_opts(&o);
    o.cards = 1;
    cr_assert_neq(pd_search_run(&o, &s, &e), 0);
    cr_assert(strstr(e.msg, "--cards"), "%s", e.msg);
    seed_opts(&o);
    o.w.isl = 200000;
    cr_assert_neq(pd_search_run(&o, &s, &e), 0);
    cr_assert(strstr(e.msg, "--max-model-len"), "%s", e.msg);
    seed_opts(&o);
    o.base.hardware = "no-such-card";
    cr_assert_neq(pd_search_run(&o, &s, &e), 0);
    cr_assert(strstr(e.msg, "no-such-card"), "%s", e.msg);
}

/* With --expert-stats every role layout is costed with the imbalance measured on its placement
 * (reported in the memory table): the seed's search over V4-Flash with expert 0 taking 65 of 320
 * tokens in the one layer given, so an EP size's first rank holds 65 + (256/ep - 1) tokens. */
Test(search, measured_imbalance_per_role_layout)
{
    char path[] = "/tmp/pdmoe-stats-XXXXXX";
    tmp_expert_stats(path, 43, 256, 65);   /* V4-Flash: 43 layers */
    struct pd_search_opts o;
    struct pd_search s;
    seed_opts(&o);
    o.base.expert_stats = path;
    run(&o, &s);
    remove(path);
    int seen = 0;
    for (int i = 0; i < s.n_mem; i++) {
        const struct pd_search_mem *m = &s.mem[i];
        int ep = m->o.dp * m->o.tp;
        if (m->o.redundant == 0) {
            double want = (65.0 + 256 / ep - 1) / (320.0 / ep);
            cr_assert_float_eq(m->imbalance, ep == 1 ? 1.0 : want, 1e-9, "EP%d: %f, want %f", ep, m->imbalance, want);
            seen++;
        } else {
            /* replicas of expert 0 take some of its load */
            cr_assert_lt(m->imbalance, (65.0 + 256 / ep - 1) / (320.0 / ep), "EP%d r%d", ep, m->o.redundant);
        }
    }
    cr_assert_geq(seen, 4);
    pd_search_free(&s);
}

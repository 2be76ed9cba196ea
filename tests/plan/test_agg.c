/* Aggregated instances: the mixed step reads the weights once, each equation of agg.c against
 * its statement, the memory budget of a colocated card, the closed loop's limits, and the
 * search's comparison of the best aggregated and disaggregated layouts. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan/perf.h"
#include "plan/html.h"
#include "plan/search.h"
#include "fixture.h"

/* v4-tiny on the seed's hardware, colocated instances of dp ranks, chunk budget M. */
static void agg_plan(struct pd_plan *p, int dp, int64_t M, int64_t seqs)
{
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.model = "v4-tiny";
    o.max_model_len = 4096;
    o.max_num_batched_tokens = M;
    o.max_num_seqs = seqs;
    o.aggregated = 1;
    o.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = dp, .tp = 1, .instances = 1};
    build(&o, p);
}

static void workload(struct pd_workload *w, int64_t isl, int64_t osl)
{
    pd_workload_default(w);
    w->isl = isl;
    w->osl = osl;
}

/* A mixed step streams the weights once: cheaper than the decode step and the chunk's step
 * apart, dearer than either, its tokens the sum, and with no prompt part it is the decode step. */
Test(agg, mixed_step_reads_the_weights_once)
{
    struct pd_plan p;
    agg_plan(&p, 1, 512, 16);
    struct pd_step_part dec = {16, 2, 700}, pre = {1, 480, 100}, none = {0, 0, 0};
    struct pd_step mix, d, c, d2;
    pd_perf_step_mixed(&p, PD_ROLE_PREFILL, &dec, &pre, &mix);
    pd_perf_step(&p, PD_ROLE_DECODE, 16, 2, 700, &d);
    pd_perf_step(&p, PD_ROLE_PREFILL, 1, 480, 100, &c);
    cr_assert_eq(mix.tokens, 16 * 2 + 480);
    cr_assert_lt(mix.bytes, d.bytes + c.bytes, "the weights are read once: %g vs %g", mix.bytes, d.bytes + c.bytes);
    cr_assert_gt(mix.total_s, c.total_s);
    cr_assert_gt(mix.total_s, d.total_s);
    cr_assert_lt(mix.total_s, d.total_s + c.total_s);
    pd_perf_step_mixed(&p, PD_ROLE_DECODE, &dec, &none, &d2);
    cr_assert_float_eq(d2.total_s, d.total_s, 1e-15);
    cr_assert_float_eq(d2.bytes, d.bytes, 1e-6);
    pd_plan_free(&p);
}

/* Every figure of pd_perf_agg_at against agg.c's equations. */
Test(agg, equations)
{
    struct pd_plan p;
    agg_plan(&p, 2, 512, 64);
    struct pd_workload w;
    workload(&w, 1200, 100);
    const int64_t b = 8, k = 1 + (p.include_mtp ? 1 : 0);
    const double tps = 1 + (p.include_mtp ? 1 : 0) * p.hw.eff.mtp_acceptance;
    struct pd_agg a;
    pd_perf_agg_at(&p, &w, b, &a);
    cr_assert_eq(a.chunk, 512 - b * k);
    cr_assert_eq(a.chunks, (1200 + a.chunk - 1) / a.chunk);
    double phi = (double)b * tps * 1200 / (100.0 * (double)a.chunk);
    cr_assert_float_eq(a.chunk_share, phi, 1e-12);
    cr_assert(a.fed == (phi <= 1));
    double f = phi < 1 ? phi : 1;
    cr_assert_float_eq(a.step_s, f * a.mixed_step.total_s + (1 - f) * a.decode_step.total_s, 1e-15);
    cr_assert_gt(a.step_s, a.decode_step.total_s, "a decoding token waits for the chunks its steps carry");
    /* the prompt's chunks at their offsets, each a mixed step with the batch */
    double pre = 0;
    for (int64_t off = 0; off < 1200; off += a.chunk) {
        struct pd_step_part dec = {b, k, 1200 + 50}, part = {1, 1200 - off < a.chunk ? 1200 - off : a.chunk, off};
        struct pd_step s;
        pd_perf_step_mixed(&p, PD_ROLE_PREFILL, &dec, &part, &s);
        pre += s.total_s;
    }
    cr_assert_float_eq(a.prefill_s, pre, 1e-12);
    double xp = (double)a.chunk / (1200.0 * a.mixed_step.total_s), xd = (double)b * tps / (100.0 * a.step_s);
    cr_assert_float_eq(a.prefill_rank_req_s, xp, 1e-9);
    cr_assert_float_eq(a.rank_req_s, xd < xp ? xd : xp, 1e-9);
    /* the plan's prediction: TTFT = request + the prompt's chunks (no hand-off), TPOT = step / tps,
     * requests/s over both DP ranks, per card over its 2 cards */
    struct pd_perf pf;
    pd_err e = {0};
    w.decode_batch = b;
    cr_assert_eq(pd_perf_eval(&p, &w, &pf, &e), 0, "%s", e.msg);
    cr_assert(pf.aggregated);
    cr_assert_float_eq(pf.ttft_s, p.hw.eff.request_s + a.prefill_s, 1e-12);
    cr_assert_eq(pf.handoff_s, 0);
    cr_assert_float_eq(pf.tpot_s, a.step_s / tps, 1e-15);
    cr_assert_float_eq(pf.req_s, 2 * a.rank_req_s, 1e-9);
    cr_assert_float_eq(pf.tok_s_card, pf.req_s * 100 / 2, 1e-6);
    /* a larger chunk budget makes the mixed step dearer */
    struct pd_plan q;
    agg_plan(&q, 2, 2048, 64);
    struct pd_agg big;
    pd_perf_agg_at(&q, &w, b, &big);
    cr_assert_gt(big.mixed_step.total_s, a.mixed_step.total_s);
    cr_assert_lt(big.chunks, a.chunks);
    pd_plan_free(&q);
    /* the decode tokens fill the budget: no prompt advances, refused as not fitting */
    pd_perf_agg_at(&p, &w, 512 / k, &a);
    cr_assert_eq(a.chunk, 0);
    cr_assert(isinf(a.prefill_s));
    cr_assert_not(a.fed);
    pd_plan_free(&p);
}

/* Without a decode batch the plan runs the largest that fits, leaves a chunk and is fed. */
Test(agg, default_batch_is_the_largest_fed)
{
    struct pd_plan p;
    agg_plan(&p, 1, 512, 256);
    struct pd_workload w;
    workload(&w, 1000, 50);
    struct pd_perf f;
    pd_err e = {0};
    cr_assert_eq(pd_perf_eval(&p, &w, &f, &e), 0, "%s", e.msg);
    struct pd_agg next;
    pd_perf_agg_at(&p, &w, f.batch + 1, &next);
    cr_assert(f.agg.fed);
    cr_assert(!next.fed || f.batch == pd_perf_agg_slots(&p, &w), "batch %lld is not the largest fed one", (long long)f.batch);
    cr_assert_lt(f.batch, 256, "this workload's chunks cannot feed 256 sequences");
    cr_assert(f.fits);
    pd_plan_free(&p);
}

/* One set of cards budgeted for both roles: a full step's activations, the larger runtime
 * reserve, KV for max-num-seqs sequences of max-model-len; the cards counted once. */
Test(agg, memory_budget)
{
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.aggregated = 1;
    o.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 8, .tp = 1, .instances = 2};
    o.runtime[PD_ROLE_PREFILL] = 3000000000;
    o.runtime[PD_ROLE_DECODE] = 1000000000;
    struct pd_plan p, d;
    build(&o, &p);
    cr_assert_eq(p.cards_used, 16);
    struct pd_plan_opts od = o;
    od.aggregated = 0;
    od.role[PD_ROLE_PREFILL] = o.role[PD_ROLE_DECODE];
    build(&od, &d);
    for (int r = 0; r < 2; r++) {
        const struct pd_role_plan *rp = &p.role[r];
        cr_assert_eq(rp->o.dp, 8);
        cr_assert_eq(rp->o.instances, 2);
        cr_assert_eq(rp->act.tokens, o.max_num_batched_tokens);
        cr_assert_eq(rp->b.runtime, 3000000000);
        /* and the window and state blocks of the chunks in flight, which an aggregated card prefills too */
        cr_assert_gt(rp->b.kv_chunks, 0);
        /* and every sequence's own decode steps in flight, which an aggregated card decodes too */
        cr_assert_gt(rp->b.kv_decode_seq, 0);
        cr_assert_eq(rp->kv_need, o.max_num_seqs * (pd_kv_seq_bytes(&p.kv, o.max_model_len) + rp->b.kv_decode_seq) +
                                      rp->b.kv_chunks);
        cr_assert_eq(rp->b.weights, d.role[r].b.weights);
    }
    /* a disaggregated decode card holds activations of max-num-seqs tokens only, and its own reserve */
    cr_assert_lt(d.role[PD_ROLE_DECODE].b.activations, p.role[PD_ROLE_DECODE].b.activations);
    cr_assert_eq(p.role[PD_ROLE_DECODE].b.kv_pool,
                 p.role[PD_ROLE_DECODE].b.usable - p.role[PD_ROLE_DECODE].b.weights -
                     p.role[PD_ROLE_DECODE].b.activations - 3000000000);
    pd_plan_free(&d);
    pd_plan_free(&p);
    /* the cluster's cards: counted once */
    o.role[PD_ROLE_DECODE].instances = 9;
    pd_err e = {0};
    cr_assert_neq(pd_plan_build(&o, &p, &e), 0);
    cr_assert(strstr(e.msg, "layout needs 72 cards (aggregated 9 x 8)"), "%s", e.msg);
    pd_plan_free(&p);
}

/* The closed loop: one client runs alone (TTFT = request + its chunks at batch 1); clients
 * that arrive together queue behind each other's chunks; tokens/s is C x osl / cycle; and a
 * loop past the slots waits for them. */
Test(agg, closed_loop)
{
    struct pd_plan p;
    agg_plan(&p, 1, 512, 64);
    struct pd_workload w;
    workload(&w, 1000, 64);
    struct pd_agg_curve c;
    cr_assert_eq(pd_perf_agg_curve(&p, &w, 64, &c), 0);
    struct pd_agg one;
    pd_perf_agg_at(&p, &w, 1, &one);
    const double req = p.hw.eff.request_s;
    struct pd_closed c1, c4, c64;
    pd_perf_agg_closed(&c, 1, 64, req, 1, 64, 1, &c1);
    cr_assert_float_eq(c1.batch, 1, 1e-9);
    cr_assert_float_eq(c1.ttft_s, req + one.prefill_s, 1e-9);
    cr_assert_float_eq(c1.tpot_s, one.step_s / c.tokens_per_step, 1e-12);
    cr_assert_float_eq(c1.wait_s, 0, 1e-9);
    pd_perf_agg_closed(&c, 4, 64, req, 1, 64, 1, &c4);
    cr_assert_gt(c4.batch, 1);
    cr_assert_gt(c4.wait_s, 0, "four clients' prompts queue behind each other's chunks");
    cr_assert_gt(c4.ttft_s, c1.ttft_s);
    cr_assert_float_eq(c4.tok_s, 4 * 64 / (c4.ttft_s + 63 * c4.tpot_s), 1e-6 * c4.tok_s);
    cr_assert_gt(c4.tok_s, c1.tok_s);
    /* 64 clients on 4 slots: the slots bind, the rest wait before their first token */
    pd_perf_agg_closed(&c, 64, 64, req, 1, 4, 1, &c64);
    cr_assert_leq(c64.batch, 4 + 1e-9);
    cr_assert_neq(c64.limit, PD_CLOSED_CLIENTS);
    cr_assert_float_eq(c64.tok_s, 64 * 64 / (c64.ttft_s + 63 * c64.tpot_s), 1e-6 * c64.tok_s);
    /* two ranks halve each rank's clients */
    struct pd_closed two;
    pd_perf_agg_closed(&c, 8, 64, req, 2, 64, 2, &two);
    pd_perf_agg_closed(&c, 4, 64, req, 1, 64, 1, &c4);
    cr_assert_float_eq(two.tok_s, 2 * c4.tok_s, 1e-9 * two.tok_s);
    cr_assert_float_eq(two.tok_s_card, c4.tok_s_card, 1e-9 * two.tok_s);
    pd_perf_agg_curve_free(&c);
    pd_plan_free(&p);
}

/* The search: every aggregated layout within the cards and on the disaggregated roles' EP
 * rules, the best of each kind is the best of its kind, and the verdict's ratio is theirs. */
Test(agg, search_compares_both)
{
    struct pd_search_opts o;
    pd_search_opts_default(&o);
    o.base.model = "v4-tiny";
    o.base.max_model_len = 4096;
    o.cards = 16;   /* two nodes: a disaggregated layout keeps decode off the prefill's node */
    o.w.isl = 1000;
    o.w.osl = 100;
    o.ttft_s = 0.5;
    o.tpot_s = 0.02;
    struct pd_search s;
    pd_err e = {0};
    cr_assert_eq(pd_search_run(&o, &s, &e), 0, "%s", e.msg);
    cr_assert_gt(s.n_agg, 0);
    cr_assert_gt(s.n_agg_meet, 0);
    for (int i = 0; i < s.n_agg; i++) {
        const struct pd_agg_layout *l = &s.agg[i];
        cr_assert_leq(l->cards, 16);
        cr_assert_eq(l->cards, l->o.dp * l->o.tp * l->o.instances);
        cr_assert(pd_search_ep_ok(l->o.dp * l->o.tp, l->o.tp, 8));
        cr_assert_geq(l->chunk, 1);
        if (l->meets)
            cr_assert_leq(l->tok_s_card, s.agg[s.best_agg].tok_s_card);
    }
    cr_assert(s.agg[s.best_agg].meets);
    struct pd_search_verdict v = pd_search_compare(&s);
    cr_assert(v.meets);
    cr_assert_eq(v.agg, s.best_agg);
    cr_assert_eq(v.disagg, s.best);
    double a = s.agg[v.agg].tok_s_card, d = s.l[v.disagg].tok_s_card;
    cr_assert_eq(v.agg_wins, a > d);
    cr_assert_float_eq(v.ratio, a > d ? a / d : d / a, 1e-12);
    /* the chosen plan is the winner's, and its prediction the winner's figures */
    cr_assert_eq(s.chose_agg, v.agg_wins);
    cr_assert_eq(s.plan.o.aggregated, v.agg_wins);
    double chosen = v.agg_wins ? a : d;
    cr_assert_float_eq(s.perf.tok_s_card, chosen, 1e-9 * chosen);
    char *t = pd_search_text(&s, 0);
    char want[96];
    snprintf(want, sizeof want, "=> %s wins: %.2fx", v.agg_wins ? "aggregated" : "disaggregated", v.ratio);
    cr_assert(t && strstr(t, want), "%s", t);
    free(t);
    pd_search_free(&s);
    /* either kind on demand */
    for (int k = 0; k < 2; k++) {
        o.pick = k ? PD_PICK_AGGREGATED : PD_PICK_DISAGGREGATED;
        cr_assert_eq(pd_search_run(&o, &s, &e), 0, "%s", e.msg);
        cr_assert_eq(s.chose_agg, k);
        cr_assert_eq(s.plan.o.aggregated, k);
        double want_tok = k ? s.agg[s.best_agg].tok_s_card : s.l[s.best].tok_s_card;
        cr_assert_float_eq(s.perf.tok_s_card, want_tok, 1e-9 * want_tok);
        pd_search_free(&s);
    }
}

/* The HTML report says the same as the text: both kinds' best and the winner. */
Test(agg, html_compares_both)
{
    struct pd_search_opts o;
    pd_search_opts_default(&o);
    o.cards = 16;
    o.ttft_s = 2.0;
    o.tpot_s = 0.05;
    struct pd_search s;
    pd_err e = {0};
    cr_assert_eq(pd_search_run(&o, &s, &e), 0, "%s", e.msg);
    struct pd_search_verdict v = pd_search_compare(&s);
    cr_assert(v.agg >= 0 && v.disagg >= 0);
    char *page = pd_report_html(&s.plan, &s.perf, &s, 0, &e);
    cr_assert(page, "%s", e.msg);
    char want[128];
    snprintf(want, sizeof want, "<b>%s wins</b>: %.2f&times;", v.agg_wins ? "Aggregated" : "Disaggregated", v.ratio);
    cr_assert(strstr(page, "<table id=\"compare\">") && strstr(page, want), "no comparison \"%s\"", want);
    free(page);
    pd_search_free(&s);
}

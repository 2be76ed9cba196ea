/* The closed loop in lockstep (lockstep.c): one client's cycle and C clients whose prompts share
 * one step against the steps it is made of, the prefill cap, one wave against its duration, the
 * clients' spread over DP ranks, and the flags it is refused without; the same on a disaggregated
 * plan's prefill and decode ranks. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan/lockstep.h"
#include "plan/perf.h"
#include "fixture.h"

/* v4-tiny colocated on dp ranks, chunk budget M, without MTP unless mtp (one token a step). */
static void lock_plan(struct pd_plan *p, int dp, int64_t M, int mtp)
{
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.model = "v4-tiny";
    o.max_model_len = 4096;
    o.max_num_batched_tokens = M;
    o.max_num_seqs = 64;
    o.mtp = mtp;
    o.aggregated = 1;
    o.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = dp, .tp = 1, .instances = 1};
    build(&o, p);
}

static void lock_workload(struct pd_workload *w, int64_t isl, int64_t osl, int64_t clients)
{
    pd_workload_default(w);
    w->isl = isl;
    w->osl = osl;
    w->concurrency = clients;
    w->lockstep = 1;
}

static double step_s(const struct pd_plan *p, enum pd_role r, struct pd_step_part dec, struct pd_step_part pre)
{
    struct pd_step s;
    pd_perf_step_mixed(p, r, &dec, &pre, &s);
    return s.total_s;
}

/* The decode steps of `seqs` sequences from their first token to their last (osl - 1 steps
 * without MTP), each at its context. */
static double decode_steps(const struct pd_plan *p, int64_t seqs, int64_t isl, int64_t osl)
{
    double t = 0;
    for (int64_t j = 1; j < osl; j++)
        t += step_s(p, PD_ROLE_DECODE, (struct pd_step_part){seqs, 1, isl + j}, (struct pd_step_part){0, 0, 0});
    return t;
}

/* One client: TTFT = request + its prompt's chunks (nothing else in their steps), TPOT = the
 * decode steps of one sequence over osl - 1, requests/s = 1 / (TTFT + (osl - 1) x TPOT). */
Test(lockstep, one_client_is_its_steps)
{
    struct pd_plan p;
    lock_plan(&p, 1, 512, 0);
    struct pd_workload w;
    lock_workload(&w, 1200, 40, 1);
    struct pd_perf f;
    pd_err e = {0};
    cr_assert_eq(pd_perf_eval(&p, &w, &f, &e), 0, "%s", e.msg);
    const double req = p.hw.eff.request_s;
    double pre = 0;
    for (int64_t off = 0; off < 1200; off += 512)
        pre += step_s(&p, PD_ROLE_PREFILL, (struct pd_step_part){0, 0, 0},
                      (struct pd_step_part){1, 1200 - off < 512 ? 1200 - off : 512, off});
    const double dec = decode_steps(&p, 1, 1200, 40);
    const struct pd_closed *c = &f.closed;
    cr_assert_float_eq(c->ttft_s, req + pre, 1e-12);
    cr_assert_float_eq(c->tpot_s, dec / 39, 1e-12);
    cr_assert_float_eq(c->wait_s, 0, 1e-12);
    cr_assert_float_eq(c->batch, 1, 1e-12);
    cr_assert_float_eq(c->req_s, 1 / (req + pre + dec), 1e-9 * c->req_s);
    cr_assert_float_eq(c->tok_s, 40 * c->req_s, 1e-9 * c->tok_s);
    cr_assert_float_eq(c->cycle_s, c->ttft_s + 39 * c->tpot_s, 1e-12);
    pd_plan_free(&p);
}

/* C clients whose prompts fit one step's budget: every cycle they share one prefill step and
 * decode together at batch C; TTFT is that step's (the same for all), TPOT batch C's steps. */
Test(lockstep, clients_share_one_step)
{
    struct pd_plan p;
    lock_plan(&p, 1, 512, 0);
    struct pd_workload w;
    lock_workload(&w, 100, 32, 4);
    struct pd_perf f;
    pd_err e = {0};
    cr_assert_eq(pd_perf_eval(&p, &w, &f, &e), 0, "%s", e.msg);
    const double req = p.hw.eff.request_s;
    const double pre = step_s(&p, PD_ROLE_PREFILL, (struct pd_step_part){0, 0, 0}, (struct pd_step_part){4, 100, 0});
    const double dec = decode_steps(&p, 4, 100, 32);
    const struct pd_closed *c = &f.closed;
    cr_assert_float_eq(c->ttft_s, req + pre, 1e-12);
    cr_assert_float_eq(c->tpot_s, dec / 31, 1e-12);
    cr_assert_float_eq(c->batch, 4, 1e-12);
    cr_assert_float_eq(c->req_s, 4 / (req + pre + dec), 1e-9 * c->req_s);
    pd_plan_free(&p);
}

/* One wave (num_prompts = clients) under a prefill cap of 2: ten prompts take five steps with
 * prompt tokens, the first carrying two whole prompts; throughput = all output over the run. */
Test(lockstep, one_wave_with_a_prefill_cap)
{
    struct pd_plan p;
    lock_plan(&p, 1, 2048, 0);
    struct pd_workload w;
    lock_workload(&w, 500, 20, 10);
    w.num_prompts = 10;
    w.prefill_max_requests = 2;
    struct pd_closed c;
    struct pd_lockstep d;
    cr_assert_eq(pd_perf_lockstep(&p, &w, pd_perf_agg_slots(&p, &w), &c, &d, NULL), 0);
    cr_assert_eq(d.clients, 10);
    cr_assert_eq(d.requests, 1);
    cr_assert_eq(d.mixed_steps, 5);
    cr_assert_eq(d.first_step.tokens, 1000);
    cr_assert_float_eq(d.first_step.total_s,
                       step_s(&p, PD_ROLE_PREFILL, (struct pd_step_part){0, 0, 0}, (struct pd_step_part){2, 500, 0}),
                       1e-12);
    cr_assert_float_eq(c.req_s, 10 / d.duration_s, 1e-9 * c.req_s);
    cr_assert_float_eq(d.duration_s, p.hw.eff.request_s + d.mixed_s + d.decode_s, 1e-9);
    /* without the cap all ten prompts (5,000 tokens) go in as the budget allows: 3 steps */
    w.prefill_max_requests = 0;
    cr_assert_eq(pd_perf_lockstep(&p, &w, pd_perf_agg_slots(&p, &w), &c, &d, NULL), 0);
    cr_assert_eq(d.mixed_steps, 3);
    pd_plan_free(&p);
}

/* Prefill-first (SGLang's schedule): the wave's five rounds of two prompts run before any decode
 * step, so pair j has its first token after j rounds (mean TTFT: request + 3 rounds) and then waits
 * for the 5 - j rounds after it (a benchmark's TPOT counts them: mean (2 rounds + the decode steps
 * of all ten) / 19). The decode-first run of the same wave carries the early pairs' decodes in the
 * later rounds: a higher TTFT (dearer rounds) and a lower TPOT (no round stalls them). */
Test(lockstep, prefill_first_runs_the_rounds_first)
{
    struct pd_plan p;
    lock_plan(&p, 1, 2048, 0);
    struct pd_workload w;
    lock_workload(&w, 500, 20, 10);
    w.num_prompts = 10;
    w.prefill_max_requests = 2;
    w.prefill_first = 1;
    struct pd_closed c, d;
    struct pd_lockstep l;
    cr_assert_eq(pd_perf_lockstep(&p, &w, pd_perf_agg_slots(&p, &w), &c, &l, NULL), 0);
    const double round = step_s(&p, PD_ROLE_PREFILL, (struct pd_step_part){0, 0, 0}, (struct pd_step_part){2, 500, 0});
    cr_assert_eq(l.mixed_steps, 5);
    cr_assert_float_eq(l.mixed_s, 5 * round, 1e-12);
    cr_assert_float_eq(c.ttft_s, p.hw.eff.request_s + 3 * round, 1e-12);
    cr_assert_float_eq(c.tpot_s, (2 * round + decode_steps(&p, 10, 500, 20)) / 19, 1e-12);
    cr_assert_float_eq(c.batch, 10, 1e-12);
    w.prefill_first = 0;
    cr_assert_eq(pd_perf_lockstep(&p, &w, pd_perf_agg_slots(&p, &w), &d, NULL, NULL), 0);
    cr_assert_gt(d.ttft_s, c.ttft_s);
    cr_assert_lt(d.tpot_s, c.tpot_s);
    pd_plan_free(&p);
}

/* With MTP each step accepts 1 + acceptance tokens: a sequence needs ceil((osl - 1) / tps)
 * decode steps, and C clients over DP ranks load the busiest with ceil(C / ranks). */
Test(lockstep, mtp_and_ranks)
{
    struct pd_plan p;
    lock_plan(&p, 2, 2048, 1);
    cr_assert(p.include_mtp);
    const double tps = 1 + p.hw.eff.mtp_acceptance;
    struct pd_workload w;
    lock_workload(&w, 200, 101, 3);
    w.num_prompts = 3;
    struct pd_closed c;
    struct pd_lockstep d;
    cr_assert_eq(pd_perf_lockstep(&p, &w, pd_perf_agg_slots(&p, &w), &c, &d, NULL), 0);
    cr_assert_eq(d.clients, 2, "3 clients over 2 ranks: 2 on the busiest");
    cr_assert_eq(d.mixed_steps, 1);
    cr_assert_eq(d.steps - d.mixed_steps, (int64_t)ceil(100 / tps - 1e-9));
    pd_plan_free(&p);
}

/* Refused by name: lockstep without clients, its parameters in the random-phase loop, a number of
 * prompts the clients cannot share, and the aggregated schedule on a disaggregated layout. */
Test(lockstep, refused_by_name)
{
    struct pd_plan p;
    lock_plan(&p, 1, 512, 0);
    struct pd_workload w;
    struct pd_perf f;
    pd_err e = {0};
    lock_workload(&w, 100, 16, 0);
    cr_assert_neq(pd_perf_eval(&p, &w, &f, &e), 0);
    cr_assert(strstr(e.msg, "--phase lockstep") && strstr(e.msg, "--concurrency"), "%s", e.msg);
    lock_workload(&w, 100, 16, 4);
    w.num_prompts = 10;
    cr_assert_neq(pd_perf_eval(&p, &w, &f, &e), 0);
    cr_assert(strstr(e.msg, "--num-prompts 10") && strstr(e.msg, "multiple"), "%s", e.msg);
    w.lockstep = 0;
    w.num_prompts = 8;
    cr_assert_neq(pd_perf_eval(&p, &w, &f, &e), 0);
    cr_assert(strstr(e.msg, "--num-prompts") && strstr(e.msg, "lockstep"), "%s", e.msg);
    w.num_prompts = 0;
    w.prefill_max_requests = 2;
    cr_assert_neq(pd_perf_eval(&p, &w, &f, &e), 0);
    cr_assert(strstr(e.msg, "--prefill-max-requests"), "%s", e.msg);
    w.prefill_max_requests = 0;
    w.prefill_first = 1;
    cr_assert_neq(pd_perf_eval(&p, &w, &f, &e), 0);
    cr_assert(strstr(e.msg, "--schedule prefill-first") && strstr(e.msg, "lockstep"), "%s", e.msg);
    lock_workload(&w, 100, 16, PD_LOCKSTEP_MAX_CLIENTS + 1);
    cr_assert_neq(pd_perf_eval(&p, &w, &f, &e), 0);
    cr_assert(strstr(e.msg, "--phase lockstep") && strstr(e.msg, "per DP rank") && strstr(e.msg, "--phase random"),
              "%s", e.msg);
    pd_plan_free(&p);
    struct pd_plan q;
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.model = "v4-tiny";
    o.role[PD_ROLE_PREFILL] = o.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 1, .tp = 1, .instances = 1};
    build(&o, &q);
    lock_workload(&w, 100, 16, 4);
    w.prefill_first = 1;
    cr_assert_neq(pd_perf_eval(&q, &w, &f, &e), 0);
    cr_assert(strstr(e.msg, "--schedule prefill-first") && strstr(e.msg, "aggregated"), "%s", e.msg);
    pd_plan_free(&q);
}

/* v4-tiny disaggregated: `pinst` prefill and `dinst` decode instances of dp 1 each, chunk budget M,
 * decode slots `seqs`, without MTP. */
static void pd_lock_plan2(struct pd_plan *p, int pinst, int dinst, int64_t M, int64_t seqs)
{
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.model = "v4-tiny";
    o.max_model_len = 4096;
    o.max_num_batched_tokens = M;
    o.max_num_seqs = seqs;
    o.mtp = 0;
    o.role[PD_ROLE_PREFILL] = (struct pd_role_opts){.dp = 1, .tp = 1, .instances = pinst};
    o.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 1, .tp = 1, .instances = dinst};
    build(&o, p);
}

static void pd_lock_plan(struct pd_plan *p, int inst, int64_t M, int64_t seqs)
{
    pd_lock_plan2(p, inst, inst, M, seqs);
}

static double decode_step(const struct pd_plan *p, int64_t seqs, int64_t ctx)
{
    return step_s(p, PD_ROLE_DECODE, (struct pd_step_part){seqs, 1, ctx}, (struct pd_step_part){0, 0, 0});
}

/* One client of a disaggregated plan: TTFT = request + its prompt's chunks on the prefill rank +
 * the hand-off + the first decode step (at the prompt's length), TPOT = the later decode steps of
 * one sequence over osl - 1, as the random-phase loop counts a request. */
Test(lockstep, disaggregated_one_client_is_its_steps)
{
    struct pd_plan p;
    pd_lock_plan(&p, 1, 512, 64);
    struct pd_workload w;
    lock_workload(&w, 1200, 40, 1);
    struct pd_perf f;
    pd_err e = {0};
    cr_assert_eq(pd_perf_eval(&p, &w, &f, &e), 0, "%s", e.msg);
    const double req = p.hw.eff.request_s, hand = f.handoff_s;
    cr_assert_gt(hand, 0);
    double pre = 0;
    for (int64_t off = 0; off < 1200; off += 512)
        pre += step_s(&p, PD_ROLE_PREFILL, (struct pd_step_part){0, 0, 0},
                      (struct pd_step_part){1, 1200 - off < 512 ? 1200 - off : 512, off});
    const double first = decode_step(&p, 1, 1200), later = decode_steps(&p, 1, 1200, 40);
    const struct pd_closed *c = &f.closed;
    cr_assert_float_eq(c->ttft_s, req + pre + hand + first, 1e-12);
    cr_assert_float_eq(c->tpot_s, later / 39, 1e-12);
    cr_assert_float_eq(c->wait_s, 0, 1e-12);
    cr_assert_float_eq(c->batch, 1, 1e-12);
    cr_assert_float_eq(c->req_s, 1 / (req + pre + hand + first + later), 1e-9 * c->req_s);
    cr_assert_float_eq(c->cycle_s, c->ttft_s + 39 * c->tpot_s, 1e-12);
    pd_plan_free(&p);
}

/* One wave of 3 clients: their prompts arrive together and share one prefill step, are handed off
 * together and decode as one batch of 3 from the same step, so every request has the same TTFT,
 * TPOT and end; the random-phase loop, which spreads the clients, predicts less than this. */
Test(lockstep, disaggregated_wave_shares_the_steps)
{
    struct pd_plan p;
    pd_lock_plan(&p, 1, 512, 64);
    struct pd_workload w;
    lock_workload(&w, 100, 20, 3);
    w.num_prompts = 3;
    struct pd_perf f;
    pd_err e = {0};
    cr_assert_eq(pd_perf_eval(&p, &w, &f, &e), 0, "%s", e.msg);
    const double req = p.hw.eff.request_s, hand = f.handoff_s;
    const double pre = step_s(&p, PD_ROLE_PREFILL, (struct pd_step_part){0, 0, 0}, (struct pd_step_part){3, 100, 0});
    const double ttft = req + pre + hand + decode_step(&p, 3, 100), later = decode_steps(&p, 3, 100, 20);
    const struct pd_closed *c = &f.closed;
    cr_assert_float_eq(c->ttft_s, ttft, 1e-12);
    cr_assert_float_eq(c->tpot_s, later / 19, 1e-12);
    cr_assert_float_eq(c->batch, 3, 1e-12);
    cr_assert_float_eq(c->req_s, 3 / (ttft + later), 1e-9 * c->req_s);
    cr_assert_float_eq(c->tok_s, 20 * c->req_s, 1e-9 * c->tok_s);
    /* the prefill cap: one prompt a step, three steps in turn; the last is handed off last */
    w.prefill_max_requests = 1;
    cr_assert_eq(pd_perf_eval(&p, &w, &f, &e), 0, "%s", e.msg);
    const double one = step_s(&p, PD_ROLE_PREFILL, (struct pd_step_part){0, 0, 0}, (struct pd_step_part){1, 100, 0});
    cr_assert_float_eq(f.closed.wait_s, one, 1e-12, "waits of 0, 1 and 2 steps: %g", f.closed.wait_s);
    pd_plan_free(&p);
}

/* Decode slots bind: 3 clients on 2 slots; the third waits for a slot, so the mean batch stays at
 * most 2 and its TTFT grows by a whole request's decode. */
Test(lockstep, disaggregated_slots_bind)
{
    struct pd_plan p;
    pd_lock_plan(&p, 1, 512, 2);
    struct pd_workload w;
    lock_workload(&w, 100, 20, 3);
    w.num_prompts = 3;
    struct pd_perf f;
    pd_err e = {0};
    cr_assert_eq(pd_perf_eval(&p, &w, &f, &e), 0, "%s", e.msg);
    cr_assert_eq(f.batch, 2);
    cr_assert_leq(f.closed.batch, 2 + 1e-12);
    const double req = p.hw.eff.request_s, hand = f.handoff_s;
    const double pre = step_s(&p, PD_ROLE_PREFILL, (struct pd_step_part){0, 0, 0}, (struct pd_step_part){3, 100, 0});
    const double two = decode_step(&p, 2, 100) + decode_steps(&p, 2, 100, 20);
    /* the third starts when the first two finish: at req + pre + hand + two, alone */
    const double third = req + pre + hand + two + decode_step(&p, 1, 100);
    const double first2 = req + pre + hand + decode_step(&p, 2, 100);
    cr_assert_float_eq(f.closed.ttft_s, (2 * first2 + third) / 3, 1e-12);
    pd_plan_free(&p);
}

/* Instances are independent: 4 clients over 2 prefill and 2 decode instances (a round-robin
 * router) run as two copies of 2 clients on one of each: the same TTFT and TPOT, twice the
 * requests/s. */
Test(lockstep, disaggregated_instances_are_copies)
{
    struct pd_plan p1, p2;
    pd_lock_plan(&p1, 1, 512, 64);
    pd_lock_plan(&p2, 2, 512, 64);
    struct pd_workload w;
    struct pd_perf f1, f2;
    pd_err e = {0};
    lock_workload(&w, 300, 24, 2);
    cr_assert_eq(pd_perf_eval(&p1, &w, &f1, &e), 0, "%s", e.msg);
    lock_workload(&w, 300, 24, 4);
    cr_assert_eq(pd_perf_eval(&p2, &w, &f2, &e), 0, "%s", e.msg);
    cr_assert_float_eq(f2.closed.ttft_s, f1.closed.ttft_s, 1e-12);
    cr_assert_float_eq(f2.closed.tpot_s, f1.closed.tpot_s, 1e-12);
    cr_assert_float_eq(f2.closed.req_s, 2 * f1.closed.req_s, 1e-9 * f2.closed.req_s);
    cr_assert_float_eq(f2.closed.batch, f1.closed.batch, 1e-12);
    pd_plan_free(&p1);
    pd_plan_free(&p2);
}

/* Ranks that share no client never meet: 2 prefill and 4 decode instances (clients i on prefill i
 * mod 2, decode i mod 4) are two copies of 1 prefill and 2 decode instances, with half the
 * clients each; 3 clients over them are one group of 2 and one of 1. */
Test(lockstep, disaggregated_groups_are_copies)
{
    struct pd_plan p1, p2;
    pd_lock_plan2(&p1, 1, 2, 512, 64);
    pd_lock_plan2(&p2, 2, 4, 512, 64);
    struct pd_workload w;
    struct pd_perf f1, f2, g1;
    pd_err e = {0};
    lock_workload(&w, 700, 30, 6);
    cr_assert_eq(pd_perf_eval(&p1, &w, &f1, &e), 0, "%s", e.msg);
    lock_workload(&w, 700, 30, 12);
    cr_assert_eq(pd_perf_eval(&p2, &w, &f2, &e), 0, "%s", e.msg);
    cr_assert_float_eq(f2.closed.ttft_s, f1.closed.ttft_s, 1e-12);
    cr_assert_float_eq(f2.closed.tpot_s, f1.closed.tpot_s, 1e-12);
    cr_assert_float_eq(f2.closed.req_s, 2 * f1.closed.req_s, 1e-9 * f2.closed.req_s);
    /* 3 clients: the group of 2 (clients 0 and 2) and of 1 (client 1), requests weighted alike */
    lock_workload(&w, 700, 30, 2);
    cr_assert_eq(pd_perf_eval(&p1, &w, &f1, &e), 0, "%s", e.msg);
    lock_workload(&w, 700, 30, 1);
    cr_assert_eq(pd_perf_eval(&p1, &w, &g1, &e), 0, "%s", e.msg);
    lock_workload(&w, 700, 30, 3);
    cr_assert_eq(pd_perf_eval(&p2, &w, &f2, &e), 0, "%s", e.msg);
    cr_assert_float_eq(f2.closed.ttft_s, (2 * f1.closed.ttft_s + g1.closed.ttft_s) / 3, 1e-12);
    cr_assert_float_eq(f2.closed.req_s, f1.closed.req_s + g1.closed.req_s, 1e-9 * f2.closed.req_s);
    pd_plan_free(&p1);
    pd_plan_free(&p2);
}

/* Many clients run in the time of their steps, not clients x steps: 32,768 clients over 32
 * prefill and 32 decode instances of 64 slots, 1,000 output tokens each (the loop that visited
 * every client at every event took more than a minute), as 32 copies of 1,024 clients. */
Test(lockstep, disaggregated_many_clients_run_in_their_steps, .timeout = 20)
{
    struct pd_plan p1, p32;
    pd_lock_plan(&p1, 1, 2048, 64);
    pd_lock_plan(&p32, 32, 2048, 64);
    struct pd_workload w;
    struct pd_perf f1, f32;
    pd_err e = {0};
    lock_workload(&w, 1000, 1000, 1024);
    cr_assert_eq(pd_perf_eval(&p1, &w, &f1, &e), 0, "%s", e.msg);
    lock_workload(&w, 1000, 1000, 32768);
    cr_assert_eq(pd_perf_eval(&p32, &w, &f32, &e), 0, "%s", e.msg);
    cr_assert_float_eq(f32.closed.ttft_s, f1.closed.ttft_s, 1e-12);
    cr_assert_float_eq(f32.closed.tpot_s, f1.closed.tpot_s, 1e-12);
    cr_assert_float_eq(f32.closed.batch, f1.closed.batch, 1e-9);
    cr_assert_float_eq(f32.closed.req_s, 32 * f1.closed.req_s, 1e-9 * f32.closed.req_s);
    cr_assert_leq(f1.closed.batch, 64 + 1e-12);
    cr_assert_gt(f1.closed.batch, 63);
    cr_assert_eq(f1.closed.slots, 64);
    pd_plan_free(&p1);
    pd_plan_free(&p32);
}

/* A run longer than PD_LOCKSTEP_MAX_STEPS steps is refused, naming the flags, before it runs when
 * its chunks and full-slot decode steps alone exceed it (aggregated and disaggregated), and when
 * it reaches it otherwise: the seed's model with one prefill rank feeding 32 decode ranks, whose
 * steps are then of about one sequence each, far more than at full slots. */
Test(lockstep, past_the_steps_refused_by_name, .timeout = 60)
{
    struct pd_plan a, d, fan;
    lock_plan(&a, 1, 512, 0);
    pd_lock_plan(&d, 1, 512, 64);
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.nodes = 5;
    o.role[PD_ROLE_PREFILL] = (struct pd_role_opts){.dp = 1, .tp = 1, .instances = 1};
    o.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 32, .tp = 1, .instances = 1};
    build(&o, &fan);
    struct pd_workload w;
    struct pd_perf f;
    pd_err e = {0};
    lock_workload(&w, 100, 1000, 1);
    w.num_prompts = PD_LOCKSTEP_MAX_STEPS / 100;
    cr_assert_eq(pd_perf_eval(&a, &w, &f, &e), PD_EINVAL);
    cr_assert(strstr(e.msg, "--phase lockstep: 1 client on one DP rank") && strstr(e.msg, "--num-prompts") &&
              strstr(e.msg, "--phase random"), "%s", e.msg);
    cr_assert_eq(pd_perf_eval(&d, &w, &f, &e), PD_EINVAL);
    cr_assert(strstr(e.msg, "on 1 prefill and 1 decode DP ranks") && strstr(e.msg, "steps"), "%s", e.msg);
    /* at full slots, 65,536 chunks and 1.2M decode steps; one sequence a step, 38M */
    lock_workload(&w, 4096, 1024, 4096);
    cr_assert_eq(pd_perf_eval(&fan, &w, &f, &e), PD_EINVAL);
    cr_assert(strstr(e.msg, "4096 clients on 1 prefill and 32 decode DP ranks, 16 requests"), "%s", e.msg);
    pd_plan_free(&a);
    pd_plan_free(&d);
    pd_plan_free(&fan);
}

/* The slots a closed loop's batch is quoted against are the loop's own: an aggregated rank's
 * (pd_perf_agg_slots), not the batch its prompts keep fed (long prompts, short outputs: far
 * fewer), which the loop may exceed. */
Test(lockstep, batch_quoted_against_the_loops_slots)
{
    struct pd_plan p;
    lock_plan(&p, 1, 512, 0);
    struct pd_workload w;
    struct pd_perf f;
    pd_err e = {0};
    lock_workload(&w, 4000, 20, 256);
    for (int lock = 0; lock < 2; lock++) {
        w.lockstep = lock;
        cr_assert_eq(pd_perf_eval(&p, &w, &f, &e), 0, "%s", e.msg);
        const int64_t slots = pd_perf_agg_slots(&p, &w);
        cr_assert_eq(f.closed.slots, slots);
        cr_assert_lt(f.batch, slots, "the fed batch %lld is below the slots %lld", (long long)f.batch,
                     (long long)slots);
        cr_assert_leq(f.closed.batch, (double)slots + 1e-9);
        char want[64];
        snprintf(want, sizeof want, "per decode DP rank of %lld slots", (long long)slots);
        char *t = pd_perf_text(&p, &f);
        cr_assert(strstr(t, want), "%s", t);
        free(t);
    }
    pd_plan_free(&p);
}

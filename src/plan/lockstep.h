/* The closed loop in lockstep: C clients whose requests are all alike (one prompt
 * length, one output length, no jitter: vLLM's and SGLang's random dataset at its default range
 * ratio 0, pdmoe bench serve's --input-len/--output-len) and which start together (a benchmark's
 * --max-concurrency at an infinite rate). Nothing is random there, so the loop is run as it
 * happens, step by step, on each aggregated DP rank (or on the prefill and decode ranks of a
 * disaggregated plan, pd_perf_lockstep_pd): the first cycle's C prompts chunked by
 * max-num-batched-tokens (and at most prefill_max_requests prompts a step), the decodes that
 * start as each prompt completes, and every later request sent the moment its client's last one
 * finishes, so the clients stay in the phase the first cycle gave them. The mean value analysis
 * of agg.c (pd_perf_agg_closed) is the same loop with clients at random phases, for workloads
 * whose lengths vary. Equations: lockstep.c and docs/perf-model.md, "Lockstep". */
#ifndef PD_PLAN_LOCKSTEP_H
#define PD_PLAN_LOCKSTEP_H

#include "plan/perf.h"

/* What the busiest DP rank did over the run (for reports that break the time down). */
struct pd_lockstep {
    int64_t clients;             /* clients of the busiest rank */
    int64_t requests;            /* requests each of its clients sent */
    double duration_s;           /* from the first request sent to the last one finished */
    int64_t steps, mixed_steps;  /* steps, and those that carried prompt tokens */
    double mixed_s, decode_s;    /* time in steps with prompt tokens, and in decode-only steps */
    struct pd_step first_step;   /* the run's first step: the first prompts' tokens, no decode */
    struct pd_step decode_step;  /* a decode-only step of all its clients at context isl + osl / 2 */
};

/* The closed loop of w->concurrency lockstep clients over the plan's aggregated DP ranks of
 * `slots` sequences each (pd_perf_agg_slots): the clients spread over the ranks as evenly as
 * they go, each rank run on its own (their steps are costed alike). w->num_prompts > 0 (a
 * multiple of the clients): each client sends num_prompts / C requests, and out holds the run's
 * means, its requests/s being all requests over the run's duration (a benchmark's
 * output_throughput); 0: the steady state, each client's 2nd to 16th request (its first is the
 * ramp: all prompts arriving at once). `detail` may be NULL. */
int pd_perf_lockstep(const struct pd_plan *p, const struct pd_workload *w, int64_t slots, struct pd_closed *out,
                     struct pd_lockstep *detail, pd_err *e);

/* The same for a disaggregated plan (lockstep.c gives the loop): the prompts on the prefill DP
 * ranks, each handed off to a decode DP rank (at most f->batch sequences each), with the
 * per-request cost and the hand-off time of f (pd_perf_prefill and pd_perf_decode filled it);
 * w->num_prompts and w->prefill_max_requests as above. */
int pd_perf_lockstep_pd(const struct pd_plan *p, const struct pd_workload *w, const struct pd_perf *f,
                        struct pd_closed *out, pd_err *e);

/* The run's cost is its steps (each visits the sequences in it, an event costs log(clients)):
 * lockstep is refused past PD_LOCKSTEP_MAX_CLIENTS clients per DP rank before it runs, and a run
 * that would take more than PD_LOCKSTEP_MAX_STEPS steps on one rank (aggregated) or on one group
 * of ranks sharing clients (disaggregated; about 2 s here) stops there, or is refused before it
 * runs when its prompts' chunks and its decode steps at full slots already exceed it; both with an error
 * naming the flags (pd_perf_lockstep and pd_perf_lockstep_pd return it: PD_EINVAL). */
#define PD_LOCKSTEP_MAX_CLIENTS 4096
#define PD_LOCKSTEP_MAX_STEPS (1 << 22)
int pd_perf_lockstep_check(const struct pd_plan *p, const struct pd_workload *w, pd_err *e);

#endif

/* The performance model: how fast a plan's prefill and decode run for a workload.
 *
 * One forward step of one data-parallel rank (tp cards) is costed term by term on the card's
 * roofline, with the hardware file's efficiency factors (struct pd_efficiency):
 *   gemm       each weight group: max(2 x tokens x params / (peak of its dtype x gemm),
 *              weight bytes / (bandwidth x memory)); routed experts with the busiest rank's
 *              load (imbalance) and only the experts the step's tokens reach;
 *   attention  its real KV reads (sliding window, CSA top-k entries + every indexer key,
 *              HCA entries, MLA latents) against its arithmetic (bf16 peak x attention);
 *   a2a        dispatch (dtype of the expert inputs) and combine (bf16) bytes of the distinct
 *              ranks each token reaches, split into intra-node and inter-node traffic, plus a
 *              fixed cost per operation; tensor parallelism adds two all-reduces per layer;
 *   step       the fixed per-step cost and the per-token non-GEMM cost;
 * then step = compute + comm - min(overlap x comm, compute).
 * Per workload (isl prompt tokens, osl output tokens): TTFT = chunked prefill of the prompt
 * + KV hand-off (RDMA) + one decode step; TPOT = decode step / tokens per step (MTP); the
 * binding resource is the largest term. Formulas and sources: docs/perf-model.md. */
#ifndef PD_PLAN_PERF_H
#define PD_PLAN_PERF_H

#include <stdint.h>

#include "core/err.h"
#include "plan/plan.h"

enum pd_bound { PD_BOUND_COMPUTE, PD_BOUND_MEMORY, PD_BOUND_LINK, PD_BOUND_OVERHEAD, PD_BOUND_CAPACITY };

const char *pd_bound_name(enum pd_bound b);

/* The cost of one forward step of one data-parallel rank. */
struct pd_step {
    int64_t tokens;              /* tokens the main model computes in the step (decode: batch x (1 + k)) */
    double gemm_compute_s;       /* arithmetic-bound part of the GEMMs */
    double gemm_memory_s;        /* weight-streaming part the arithmetic does not cover */
    double attn_s;               /* attention (max of KV reads and arithmetic) */
    double attn_memory_s;        /* ... of which KV reads set the time (0 when arithmetic does) */
    double attn_kv_read_s;       /* the KV reads alone: bytes / (bandwidth x memory efficiency) */
    double a2a_s;                /* expert dispatch + combine (+ TP all-reduce) */
    double overhead_s;           /* fixed per step + per token and layer */
    double total_s;
    double flops, bytes;         /* arithmetic and memory traffic of the step */
    double imbalance;            /* busiest rank's expert load / mean applied to the experts and a2a */
    enum pd_bound bound;
};

struct pd_workload {
    int64_t isl, osl;            /* prompt and output tokens per request */
    double cached;               /* fraction of prompt tokens served from a prefix cache, [0, 1) */
    int64_t decode_ctx;          /* mean context of a decoding sequence; 0: isl + osl / 2 */
    int64_t decode_batch;        /* sequences per decode DP rank; 0: as many as fit (max-num-seqs cap) */
    double rate;                 /* requests/s arriving at the whole deployment; 0: none (queue-free) */
    int64_t concurrency;         /* closed loop: clients, each sending its next request when its last one
                                    finishes; 0: open loop (exclusive with rate) */
    int lockstep;                /* closed loop, aggregated: the clients send equal requests and start
                                    together (lockstep.h); 0: at random phases (mean value analysis) */
    int64_t num_prompts;         /* lockstep: requests in all, as a benchmark's --num-prompts counts them
                                    (concurrency of them = one wave); 0: the steady state */
    int64_t prefill_max_requests;   /* lockstep: prompts one step may carry chunks of (SGLang's
                                       --prefill-max-requests); 0: as many as the step's budget holds */
    int prefill_first;           /* lockstep: a step with prompts waiting carries only prompt tokens, the
                                    decodes waiting for it (SGLang's default schedule); 0: decode tokens
                                    first, prompts in the rest of the budget (vLLM's chunked prefill) */
};

/* A closed loop of C clients (pd_perf_closed): the steady state's figures. */
enum pd_closed_limit { PD_CLOSED_CLIENTS, PD_CLOSED_PREFILL, PD_CLOSED_DECODE_SLOTS };
struct pd_closed {
    double batch;                /* mean sequences per decode DP rank a decoding request runs with */
    double wait_s;               /* mean wait before prefill (its queue) or for a decode slot */
    double ttft_s;               /* request + wait + prefill + hand-off + first decode step at batch */
    double tpot_s;               /* at batch */
    double cycle_s;              /* ttft_s + (osl - 1) x tpot_s: one request of one client */
    double req_s;                /* C / cycle_s, the whole deployment */
    double tok_s;                /* C x osl / cycle_s output tokens/s, the whole deployment */
    double tok_s_card;
    enum pd_closed_limit limit;  /* what sets the cycle: the clients alone, prefill's capacity, decode's slots */
    int64_t slots;               /* sequences a decode DP rank holds in the loop (batch is at most this) */
};
const char *pd_closed_limit_name(enum pd_closed_limit l);

/* Aggregated instances (plan o.aggregated; agg.c states the equations): per DP rank at a
 * decode batch, the mixed step, the share of steps that carry a prompt chunk, and the figures. */
struct pd_agg {
    int64_t batch;               /* decoding sequences per DP rank */
    int64_t batch_cap;           /* the most the KV pool and max-num-seqs allow */
    int64_t chunk;               /* prompt tokens a mixed step carries: max-num-batched-tokens - batch x (1 + k) */
    int64_t chunks;              /* mixed steps one prompt needs */
    struct pd_step decode_step;  /* decode alone at batch */
    struct pd_step mixed_step;   /* decode at batch with a full chunk */
    double chunk_share;          /* share of steps that carry a chunk to keep batch sequences fed */
    double step_s;               /* the mean step */
    double prefill_s;            /* one prompt's chunks at batch (its last step gives the first token) */
    double prefill_rank_req_s;   /* prompts/s one rank prefills when every step carries a chunk */
    double rank_req_s;           /* requests/s one DP rank completes at batch */
    int fed;                     /* chunk_share <= 1: the chunks keep the batch fed */
};

struct pd_perf {
    struct pd_workload w;
    int aggregated;                    /* colocated instances: agg holds their model; the prefill fields
                                          hold the prompt's chunks, the decode fields the mean step */
    struct pd_agg agg;
    /* prefill */
    struct pd_step prefill_step;       /* one full chunk of max-num-batched-tokens */
    double prefill_s;                  /* one prompt alone on one DP rank, chunked */
    double handoff_s;                  /* its KV over the inter-node RDMA link */
    double request_s;                  /* the PD path's fixed cost per request (hardware file) */
    double ttft_s;                     /* queue-free */
    double ttft_rate_s;                /* with the queueing delay at w.rate (inf if overloaded) */
    double prefill_tok_s_card;         /* input tokens/s per card at full chunks */
    double prefill_rank_tok_s;         /* prompt tokens (cached included) per second of one prefill DP rank */
    double prefill_req_s;              /* requests/s all prefill instances sustain */
    /* decode */
    int64_t batch;                     /* sequences per decode DP rank */
    int64_t batch_cap;                 /* the most the KV pool (and max-num-seqs) allows */
    struct pd_step decode_step;        /* at the mean context isl + osl/2 */
    struct pd_mtp mtp;                 /* the drafts per step and their acceptance */
    double tokens_per_step;            /* pd_perf_tokens_per_step */
    double tpot_s;
    double user_tok_s;                 /* 1 / tpot */
    double decode_tok_s_card;          /* output tokens/s per card */
    double decode_rank_out_s;          /* output tokens per second of one decode DP rank */
    double decode_req_s;               /* requests/s all decode instances sustain */
    /* the deployment, prefill and decode rate-matched */
    double req_s;                      /* min of the two */
    double tok_s_card;                 /* output tokens/s per card of the whole deployment */
    enum pd_bound prefill_bound, decode_bound;
    int fits;
    struct pd_closed closed;           /* w.concurrency > 0: the closed loop's steady state */
};

void pd_workload_default(struct pd_workload *w);
/* Speculative decoding (mtp.h) as the plan runs it: the tokens each decoding sequence puts
 * through the main model per step (1 + the plan's drafts k), and the tokens a step yields per
 * sequence (pd_mtp_tokens_per_step: 1 + sum_j prod_{i<=j} a_i). Every TPOT divides by the second. */
int64_t pd_perf_decode_tokens(const struct pd_plan *p);
double pd_perf_tokens_per_step(const struct pd_plan *p);
/* One step of role r's DP rank: `tokens` new tokens per sequence, `seqs` sequences, each
 * with `ctx` tokens already cached (decode: tokens = pd_perf_decode_tokens; with the MTP layer
 * loaded the step is the main model's verification of those tokens plus the draft passes of the
 * MTP layer, perf.c). */
void pd_perf_step(const struct pd_plan *p, enum pd_role r, int64_t seqs, int64_t tokens, int64_t ctx,
                  struct pd_step *s);
/* A step that mixes decode sequences (dec) and prompt chunks (pre) in one forward pass, as
 * chunked prefill does on an aggregated instance: the GEMMs, the expert all-to-all and the
 * per-token overhead see every token of both; attention is each part's own (decode's absorbed
 * MLA, prefill's expanded); the LM head runs on the decode tokens and one row per prompt; the
 * per-step costs and overlap are role r's (pd_perf_step is the one-part case). */
struct pd_step_part {
    int64_t seqs, tokens, ctx;   /* sequences, new tokens per sequence, tokens cached before them */
};
void pd_perf_step_mixed(const struct pd_plan *p, enum pd_role r, const struct pd_step_part *dec,
                        const struct pd_step_part *pre, struct pd_step *s);
int pd_perf_eval(const struct pd_plan *p, const struct pd_workload *w, struct pd_perf *out, pd_err *e);
/* The three parts of pd_perf_eval, for the search that pairs many prefill and decode layouts
 * (the workload is not checked): prefill fields, decode fields, then TTFT and rate matching. */
void pd_perf_prefill(const struct pd_plan *p, const struct pd_workload *w, struct pd_perf *f);
void pd_perf_decode(const struct pd_plan *p, const struct pd_workload *w, struct pd_perf *f);
void pd_perf_combine(const struct pd_plan *p, const struct pd_workload *w, struct pd_perf *f);
/* The role's requests/s (prefill_req_s or decode_req_s) of f, from its per-rank rate, for
 * `instances` instances of `dp` DP ranks: the search costs a role layout once for every count. */
void pd_perf_instances(struct pd_perf *f, enum pd_role r, int dp, int instances, const struct pd_workload *w);

/* TTFT and rate matching of a prefill and a decode layout (pd_perf_combine's, and each layout
 * of the search): prefill fields from pre, decode fields from dec, `servers` prefill DP ranks
 * in all, `cards` cards in all. */
struct pd_match {
    double ttft_s;                     /* queue-free */
    double ttft_rate_s;                /* with the queue before prefill at w->rate */
    double req_s, tok_s_card;
};
struct pd_match pd_perf_match(double request_s, const struct pd_perf *pre, const struct pd_perf *dec, int servers,
                              int cards, const struct pd_workload *w);

/* Mean wait before prefill when `rate` requests/s arrive at `servers` prefill DP ranks that
 * each take `service_s` per prompt: M/D/c by Allen-Cunneen (half the Erlang-C wait of M/M/c);
 * infinite at or past their capacity, 0 without a rate. */
double pd_perf_queue_wait(int servers, double service_s, double rate);

/* The closed loop of `clients` clients over a deployment whose requests spend pre_s (request +
 * prefill + hand-off) before decode, of which prefill_s on one of `prefill_ranks` prefill DP ranks
 * (where prompts queue behind each other), whose prefill sustains prefill_req_s requests/s, and
 * whose `ranks` decode DP ranks hold up to `slots` sequences each; step(ctx, b) is the decode step
 * of one rank at an integer batch b, 1 <= b <= min(slots, clients). The equations: perf.c and
 * docs/perf-model.md. */
void pd_perf_closed(int64_t clients, int64_t osl, double pre_s, double prefill_s, int prefill_ranks,
                    double prefill_req_s, int ranks, int64_t slots, double tokens_per_step,
                    double (*step)(void *ctx, int64_t b), void *ctx, int cards, struct pd_closed *out);

/* Aggregated instances (agg.c). pd_perf_agg fills f for a plan whose o.aggregated is set (both
 * roles the colocated layout): the pd_agg at pd_perf_agg_batch, then TTFT,
 * TPOT, requests/s and tokens/s per card in f's shared fields, and the closed loop. */
int pd_perf_agg(const struct pd_plan *p, const struct pd_workload *w, struct pd_perf *f, pd_err *e);
/* The slots of an aggregated DP rank: w->decode_batch, else the sequences its KV pool holds at
 * isl + osl capped by max-num-seqs; at most the batch that leaves a prompt token in a step. */
int64_t pd_perf_agg_slots(const struct pd_plan *p, const struct pd_workload *w);
/* The batch a saturated aggregated rank runs at: the largest within its slots that the chunks
 * keep fed (phi <= 1; past it the batch drains to where prompts completing match prompts
 * prefilled); at least 1. */
int64_t pd_perf_agg_batch(const struct pd_plan *p, const struct pd_workload *w);
/* One rank's aggregated figures at decode batch b (the search costs each layout once). */
void pd_perf_agg_at(const struct pd_plan *p, const struct pd_workload *w, int64_t b, struct pd_agg *a);
/* The aggregated closed loop's inputs, per integer batch b = 1..n of one rank: the mean step,
 * one prompt's prefill time and the rank's prefill capacity (prompts/s). */
struct pd_agg_curve {
    int64_t n;
    double *step_s, *prefill_s, *prefill_req_s;   /* [n + 1], index 0 unused */
    double tokens_per_step;
};
int pd_perf_agg_curve(const struct pd_plan *p, const struct pd_workload *w, int64_t n, struct pd_agg_curve *c);
void pd_perf_agg_curve_free(struct pd_agg_curve *c);
/* The closed loop of `clients` clients over `ranks` aggregated DP ranks of `slots` sequences
 * each (mean value analysis, agg.c). */
void pd_perf_agg_closed(const struct pd_agg_curve *c, int64_t clients, int64_t osl, double request_s, int ranks,
                        int64_t slots, int cards, struct pd_closed *out);

/* The aggregated lines of pd_perf_text (a FILE *). */
void pd_perf_agg_text(const struct pd_plan *p, const struct pd_perf *f, void *file);

/* Reports: text lines appended to the plan's, and a JSON object ("perf"). */
char *pd_perf_text(const struct pd_plan *p, const struct pd_perf *f);   /* malloc'ed */
void *pd_perf_json(const struct pd_perf *f);                            /* a json_t * */

#endif

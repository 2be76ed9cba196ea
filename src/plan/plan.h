/* A deployment plan: for a model, hardware and a prefill/decode layout, which weights sit on
 * which card, each card's memory budget, the KV capacity, the seed's scenarios, the KV hand-off
 * times, and (optionally) the EP-size decision tree of each role. The formulas are in
 * docs/memory-model.md. */
#ifndef PD_PLAN_PLAN_H
#define PD_PLAN_PLAN_H

#include <stdint.h>

#include "core/err.h"
#include "model/config.h"
#include "plan/hardware.h"
#include "plan/inventory.h"
#include "plan/kvsize.h"
#include "plan/mtp.h"
#include "plan/placement.h"
#include "plan/quant.h"

#define PD_PLAN_VERSION 1

/* Bounds of a plan's options, far beyond any deployment, that keep every size computed from them
 * within 64 bits: sequences per rank, a sequence's tokens, tokens in a step, KV bytes per token. */
#define PD_PLAN_MAX_SEQS (1 << 20)
#define PD_PLAN_MAX_LEN (INT64_C(1) << 30)
#define PD_PLAN_MAX_BATCHED (1 << 24)
#define PD_PLAN_MAX_KV_TOKEN (1 << 24)

enum pd_role { PD_ROLE_PREFILL = 0, PD_ROLE_DECODE = 1 };

struct pd_role_opts {
    int dp, tp, instances;
    int redundant;          /* redundant experts per EP group */
};

/* The serving stack whose KV layout the plan counts where it matters (a bf16 DeepSeek-V4 cache on
 * Ascend cards: vllm-ascend's block ids or SGLang's pools, kvsize.h). AUTO is vLLM's (vllm-ascend),
 * but `--emit sglang` plans for SGLang. */
enum pd_plan_stack { PD_STACK_AUTO = 0, PD_STACK_VLLM, PD_STACK_SGLANG };
int pd_plan_stack_parse(const char *s, enum pd_plan_stack *out, pd_err *e);
const char *pd_plan_stack_name(enum pd_plan_stack s);

struct pd_plan_opts {
    const char *model;       /* preset, .json or checkpoint dir */
    const char *hardware;
    const struct pd_hardware *hw;  /* when set, this description instead of loading `hardware` */
    const char *checkpoint;  /* inventory from these safetensors headers */
    struct pd_role_opts role[2];
    int aggregated;              /* colocated instances (each prefills and decodes, chunked prefill
                                    sharing steps with decode) of layout role[PD_ROLE_DECODE]; the
                                    build makes role[PD_ROLE_PREFILL] the same layout, the same cards */
    double util;             /* gpu-memory-utilization, (0, 1] */
    int64_t max_num_seqs;    /* per data-parallel rank, as in vLLM */
    int64_t max_model_len;   /* a default above the model's positions is cut to them */
    int max_model_len_given; /* set by the user: one above the model's positions is refused */
    int64_t max_num_batched_tokens;
    const char *quant;
    const char *quant_override;
    enum pd_kv_dtype kv_dtype;   /* PD_KV_AUTO (the default): pd_plan_kv_dtype_default's */
    enum pd_plan_stack stack;    /* --stack: whose KV layout; PD_STACK_AUTO, vLLM's */
    int no_async_scheduling;     /* vLLM's --no-async-scheduling: one step in flight, not two (vLLM only) */
    int64_t kv_bytes_per_token;  /* > 0 overrides the architecture */
    int mtp;                     /* -1: when the model has MTP layers; 0 or 1 */
    int spec_k;                  /* draft tokens per decode step (--speculative-config); 0: as many as
                                    spec_stats or mtp_acceptance count, else 1 */
    const char *spec_stats;      /* measured acceptance per draft position (mtp.h: pdmoe generate
                                    --spec-stats FILE, or a /metrics scrape) */
    const char *mtp_acceptance;  /* "a1[,a2,...]": per-position acceptance instead of the hardware file's */
    int64_t runtime[2];          /* -1: the hardware file's default */
    int nodes;                   /* 0: the hardware file's cluster_nodes */
    const char *expert_stats;    /* tokens routed per layer and expert (pdmoe generate --expert-stats,
                                    GET /expert_stats): each placement's MoE imbalance measured instead
                                    of assumed, for both roles */
    const char *expert_stats_role[2];   /* the same for one role, in place of expert_stats */
    int sweep;
    int n_handoff;
    int64_t handoff_tokens[8];
    int handoff_given;           /* set by the user: a length past the model's positions is refused
                                    (a default one is left out of the table) */
};

/* Activation memory of one forward step on one card (docs/memory-model.md). */
struct pd_activation {
    int64_t tokens;              /* tokens in one step */
    int64_t residual, working, attention, moe, indexer, logits;
    int64_t total;
};

struct pd_budget {
    int64_t capacity, usable;
    int64_t class_i, class_ii, weights;
    int64_t activations, runtime;
    int64_t kv_pool;             /* what is left for the KV cache (vLLM's pool) */
    int64_t kv_transient;        /* of it, reserved for tokens in flight: the window and state blocks
                                    they hold beyond their sequences' own, kv_chunks + the admitted
                                    sequences' kv_decode_seq (vllm-ascend's layout, else 0); and
                                    kv_tables */
    int64_t kv_chunks;           /* the prefill chunks' (pd_plan_chunk_inflight_tokens; prefill and
                                    aggregated roles) */
    int64_t kv_decode_seq;       /* one decoding sequence's (pd_plan_decode_inflight_tokens; decode and
                                    aggregated roles) */
    int64_t kv_tables;           /* SGLang's request tables (pd_plan_sgl_tables; layout
                                    PD_KV_LAYOUT_SGLANG_NPU, else 0), in kv_transient */
    int fits_weights;            /* weights + activations + runtime <= usable */
};

struct pd_role_plan {
    enum pd_role role;
    struct pd_role_opts o;
    int ep, cards;                      /* ep = dp * tp per instance; cards = ep * instances */
    struct pd_placement place;
    int64_t class_i_min, class_i_max;   /* over the ranks of a group */
    int64_t class_ii_per_card;          /* class II on one card (tp splits some groups) */
    struct pd_activation act;
    struct pd_budget b;                 /* the rank with the most class I bytes */
    int64_t kv_need;                    /* P: one max-model-len prompt; D: max-num-seqs of them;
                                           plus b.kv_transient */
    int64_t seqs_at_max_len;            /* sequences of max-model-len the pool holds */
    int64_t ctx_at_max_seqs;            /* longest context for max-num-seqs sequences */
    /* Three verdicts, each stricter than the one before: the weights fit (b.fits_weights); they
     * do and the pool holds one sequence of max-model-len (fits); they do and it holds
     * max-num-seqs of them, so every sequence the role admits can grow to max-model-len
     * (fits_max_num_seqs). */
    int fits;
    int fits_max_num_seqs;
    /* Aggregated (o.aggregated): both roles are the same cards, budgeted alike: activations of a
     * step of max-num-batched-tokens (decode tokens and a prefill chunk together), the larger of
     * the two runtime reserves, and KV for max-num-seqs sequences of max-model-len. */
    double imbalance;                   /* busiest rank's expert load / mean on this placement,
                                           measured from expert_stats; 0 without them */
};

struct pd_scenario {
    int64_t seqs, ctx;
    int64_t kv, total;
    int fits;
};

struct pd_handoff {
    int64_t tokens, bytes;
    double rdma_s, tcp_s;
};

enum pd_verdict { PD_V_NOT_DIVISIBLE, PD_V_WEIGHTS_DONT_FIT, PD_V_KV_SHORT, PD_V_FITS };

struct pd_sweep_row {
    enum pd_role role;
    int ep, dp, instances, experts_per_card;
    int64_t weights, kv_pool, kv_need;
    enum pd_verdict verdict;
    int chosen;
};

struct pd_plan {
    struct pd_plan_opts o;
    struct pd_model model;
    struct pd_hardware hw;
    struct pd_quant quant;
    struct pd_inventory inv;
    struct pd_kv_size kv;
    int include_mtp;
    struct pd_mtp mtp;             /* speculative decoding: k = 0 without the MTP layer */
    char mtp_source[96];           /* where mtp.a comes from */
    struct pd_expert_load *load[2];   /* each role's counts from the expert stats; NULL: none (the
                                         two may be one) */
    int nodes, cards_total, cards_used;
    struct pd_role_plan role[2];
    int64_t p_kv_batch;            /* max-num-batched-tokens x KV per token: the seed's P peak */
    int n_scen;
    struct pd_scenario scen[8];
    int n_handoff;
    struct pd_handoff handoff[8];
    int n_sweep;
    struct pd_sweep_row sweep[64];
};

/* Steps a vLLM engine has in flight at once (vLLM v0.27.1 VllmConfig.max_concurrent_batches,
 * vllm/config/vllm.py:539-550, pipeline parallel size 1): 2 with async scheduling, vLLM's default
 * where the executor supports it; 1 with --no-async-scheduling. Each up to --max-num-batched-tokens. */
#define PD_PLAN_STEPS_IN_FLIGHT 2
int pd_plan_steps_in_flight(const struct pd_plan *p);
/* PD_EINVAL naming --no-async-scheduling when the options ask for it on an SGLang plan (vLLM's
 * flag: SGLang's scheduler has no such flag); 0 otherwise. pd_plan_build calls it too. */
int pd_plan_check_async(const struct pd_plan_opts *o, pd_err *e);
/* Tokens of one sequence scheduled but not yet processed at most, on a role that prefills in
 * chunks (prefill, aggregated): pd_plan_steps_in_flight x max-num-batched-tokens, at most
 * max-model-len; 0 on a disaggregated decode role. */
int64_t pd_plan_chunk_inflight_tokens(const struct pd_plan *p, enum pd_role r);
/* Tokens of one decoding sequence past its processed ones for which vLLM allocates slots, on a role
 * that decodes (decode, aggregated): pd_plan_steps_in_flight x (1 + k) + k with k MTP drafts a step
 * (each step's token and drafts, and k lookahead slots), at most max-model-len; 0 on a
 * disaggregated prefill role. 1 is the token being written, which pd_kv_seq_bytes counts. */
int64_t pd_plan_decode_inflight_tokens(const struct pd_plan *p, enum pd_role r);
/* SGLang (a plan of --stack sglang: its NPU pools, or on other cards pdmoe's layout), one DP rank of
 * role r:
 * - the request slots a PD decode node pre-allocates for transfers (--disaggregation-decode-extra-
 *   slots, which --emit sglang passes): SGLang's default for --max-num-seqs requests a rank, twice
 *   them when they are 32 or fewer, else 0; 0 on other roles;
 * - the tokens of a request table's row: max-model-len + SGLang's headroom, 4 + the draft tokens, with
 *   EAGLE at a page past 1 at least twice a step's allocation (k + 1 tokens) + page - 1 (the page: the
 *   NPU pools' 128, DeepSeek-V4's 256 on GPUs, else 1);
 * - the tables' bytes for --max-num-seqs requests (the most --emit sglang gives a rank), those slots
 *   and a padding row: on an NPU DeepSeek-V4's six tables (pd_kv_sgl_tables), elsewhere the stock
 *   int32 req_to_token, 4 x row tokens bytes a row; 0 for a plan of vLLM's. */
int64_t pd_plan_sgl_extra_slots(const struct pd_plan *p, enum pd_role r);
int64_t pd_plan_sgl_row_tokens(const struct pd_plan *p);
int64_t pd_plan_sgl_tables(const struct pd_plan *p, enum pd_role r);
/* The KV pool's room for the sequences' own blocks: kv_pool - kv_transient. */
int64_t pd_budget_seq_room(const struct pd_budget *b);

/* The seed's deployment: 8 Atlas 800I A2, P 4 x EP8, D 1 x EP32, W8A8, V4-Flash. */
void pd_plan_opts_default(struct pd_plan_opts *o);

/* The KV cache's dtype when --kv-cache-dtype is not given: the one the serving stacks store for
 * this model on these cards (see plan.c). */
enum pd_kv_dtype pd_plan_kv_dtype_default(const struct pd_model *m, const struct pd_hardware *hw);
int pd_plan_build(const struct pd_plan_opts *o, struct pd_plan *p, pd_err *e);
void pd_plan_free(struct pd_plan *p);
/* One role's placement and budget for layout o on a built plan (its model, hardware, memory
 * options); the caller frees rp->place. */
int pd_plan_role_eval(const struct pd_plan *p, enum pd_role r, const struct pd_role_opts *o,
                      struct pd_role_plan *rp, pd_err *e);

/* What a card of budget b cannot hold when its KV pool is negative (b->kv_pool < 0), for the
 * messages that say so: "weights" (they alone pass the usable memory), "weights and runtime
 * reserve", or "weights and activations" (a step of max-num-seqs / max-num-batched-tokens: the
 * weights themselves fit). */
const char *pd_budget_overflow(const struct pd_budget *b);

/* The sequences a role's servers admit per DP rank: --max-num-seqs, lowered to the sequences of
 * max-model-len its KV pool holds (so that every one it admits can grow to max-model-len). What
 * --emit writes as --max-num-seqs, what search counts as a decode batch, and the decode batch the
 * prediction runs at (perf.c, agg.c). */
int64_t pd_plan_admitted_seqs(const struct pd_plan *p, enum pd_role r);
/* 1 when the prefill role of a disaggregated plan holds one max-model-len sequence but not
 * max-num-seqs of them: its servers are launched with pd_plan_admitted_seqs (it needs room for its
 * steps' prompts and their leases, not for max-num-seqs whole sequences), as search takes it; the
 * reports say "N launched" there rather than "do not fit". */
int pd_plan_prefill_lowered(const struct pd_plan *p);
/* 0 when the cards can serve the plan's weight formats; else PD_EINVAL with why in e: FP8 or FP4
 * weights on cards without FP8/FP4 units (hardware fp8_flops 0, the 910B: its stacks serve W8A8).
 * --emit refuses such a plan; plan and search say it above their figures. */
int pd_plan_formats_servable(const struct pd_plan *p, pd_err *e);
/* The format group g's weight matrices are costed in: the override, else the linear format for the
 * groups a scheme quantises, else bf16 (a checkpoint's tensors: bf16 for the cost model). */
enum pd_fmt pd_plan_group_fmt(const struct pd_plan *p, enum pd_group g);

const char *pd_role_name(enum pd_role r);
const char *pd_verdict_text(enum pd_verdict v);

/* Reports: text tables for a terminal, and the versioned JSON document. */
char *pd_plan_text(const struct pd_plan *p, int units);    /* malloc'ed */
struct pd_perf;
/* With f, the document carries the prediction as "perf". */
char *pd_plan_json(const struct pd_plan *p, const struct pd_perf *f);   /* malloc'ed */
/* The same with `validation` (a json_t *, taken; NULL for none) as the "validation" member of its
 * "perf" object (validate.h pd_validate_vouch: the published runs of this model on these cards). */
char *pd_plan_json_ext(const struct pd_plan *p, const struct pd_perf *f, void *validation);
/* Every tensor of the inventory, one per line (routed experts expanded). */
int pd_plan_print_inventory(const struct pd_plan *p, void *file, int units);

#endif

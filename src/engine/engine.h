/* The DeepSeek-V4 forward pass on CPUs, one batch step at a time.
 *
 * A step takes several sequences, each with one or more new tokens (a prompt chunk in prefill,
 * one token in decode), and returns each sequence's next-token logits. Matrix products run on
 * all the step's tokens together (W8A8 int8 kernels); attention, the compressors and the
 * indexer run per sequence, token by token in position order, so a token computes exactly the
 * same thing whether it arrives in a prefill chunk, alone in decode, or beside other sequences:
 * prefill and decode agree, and results do not depend on batch composition or thread count.
 *
 * The step is split so that expert parallelism can take it apart later: pd_engine_attention_half
 * runs everything a rank does for its own sequences up to the MoE input of a layer, and
 * pd_engine_moe runs routed experts on whatever token rows it is given.
 *
 * The equations are those of DeepSeek's official inference code for V4-Flash (model.py and
 * kernel.py at commit 0825add4 of the Mockingjay1316/deepseek-v4-flash-spark mirror); where the
 * engine differs on purpose (arithmetic, W8A8, KV cache dtype, tie order, ...) is listed in
 * docs/architecture.md, and tests/oracle/run.sh compares it with a float64 port of that code. */
#ifndef PD_ENGINE_ENGINE_H
#define PD_ENGINE_ENGINE_H

#include <stdatomic.h>
#include <stdint.h>

#include "core/err.h"
#include "core/threadpool.h"
#include "engine/kvpool.h"
#include "engine/prof.h"
#include "engine/weights.h"
#include "kernels/ops.h"
#include "model/config.h"

#define PD_ENGINE_SCRATCH 74

struct pd_scratch_buf {
    void *p;
    size_t cap;
};

struct pd_engine;
struct pd_kvsnap;

/* Runs the routed experts of one MoE layer for this process's T tokens: the output of pair
 * p = (token p / top_k, slot p % top_k) is expert ids[p] applied to row p / top_k of `a` (the
 * tokens' quantised activations), at out[p]: the engine points each out[p] at y + p * hidden
 * before the call, and the function may point it elsewhere (expert parallelism: a received
 * output where it landed, instead of copying it into y; it stays there until the function is
 * called again). The engine does it locally; expert parallelism installs a function that sends
 * the rows to the ranks holding the experts and brings the outputs back. Called on every MoE
 * layer of every step, even with T = 0, so all ranks of a group take part in the same
 * exchanges. */
typedef int (*pd_experts_fn)(void *ctx, struct pd_engine *en, int layer,
                             const pd_qmat *a,        /* [T, hidden] */
                             const int32_t *ids,      /* [T, top_k] ascending per token */
                             int T, float *y,         /* [T, top_k, hidden] */
                             const float **out,       /* [T, top_k] where each pair's output is */
                             pd_err *e);

struct pd_engine {
    struct pd_model model;
    struct pd_weights w;
    struct pd_kvpool kv;
    pd_pool *pool;
    int ref;                        /* 1: float reference of the same weights (tests) */
    struct pd_rope rope_window;     /* window-only layers: rope_theta, no YaRN */
    struct pd_rope rope_compress;   /* ratio layers and their compressors: compress_rope_theta + YaRN */
    struct pd_rope rope_index;      /* the indexer's keys and queries */
    int trace_norms;                /* record per-layer hidden-state RMS of the last step */
    double *layer_rms;              /* [n_layers] when trace_norms */
    struct pd_scratch_buf scratch[PD_ENGINE_SCRATCH];
    pd_experts_fn experts_fn;       /* NULL: run the experts here */
    void *experts_ctx;
    int64_t *expert_tokens;         /* [n_layers (+1 with MTP)][experts] tokens this process ran per expert */
    int mtp;                        /* the MTP layer runs (pd_engine_mtp_step); its KV is pool layer n_layers */
    struct pd_prof prof;            /* step profile (engine/prof.h), off unless pd_prof_enable */
};

struct pd_engine_opts {
    const char *dir;                /* checkpoint directory */
    int threads;                    /* 0: one per core */
    int max_seqs;                   /* live sequences at once */
    int64_t kv_bytes;               /* KV pool size; 0: enough for max_seqs x max_model_len */
    int pool_copies;                /* processes of this host holding such a pool (an EP group's
                                     * ranks): the pools must fit the memory left once the weights
                                     * are in, or the open fails (PD_EINVAL, "KV pool ..."); 0: not
                                     * checked */
    const char *pool_source;        /* what sized the pool (a flag), named first in an error of the
                                     * pool's making; NULL: none */
    int64_t max_model_len;          /* 0: 4096 */
    int block_entries;              /* 0: 16 */
    enum pd_kv_dtype kv_dtype;      /* the KV cache's entries: PD_KV_BF16 (0, the default) or PD_KV_FP8 */
    int ref;
    const unsigned char *has_expert;  /* [experts] this process holds, NULL = all; the same ids in every
                                       * MoE layer, the MTP layer's included (expert parallelism) */
    int mtp;                        /* run the checkpoint's MTP layer: its KV is one more pool layer */
};

int pd_engine_open(struct pd_engine *en, const struct pd_engine_opts *o, pd_err *e);
void pd_engine_close(struct pd_engine *en);

/* Between steps: the engine runs its next steps on `pool` (NULL: the calling thread alone);
 * returns the pool it ran on. No task depends on the thread count, so the steps give the same bits
 * on any pool (`pdmoe bench decode` alternates 1 and N threads on the same sequences this way).
 * pd_engine_close destroys en->pool: give the engine back the pool it opened with first. */
pd_pool *pd_engine_swap_pool(struct pd_engine *en, pd_pool *pool);

struct pd_seq {
    struct pd_kvseq kv;
    int64_t pos;                    /* tokens processed */
    int64_t mtp_pos;                /* positions the MTP layer has processed (its KV holds 0 .. mtp_pos-1) */
    struct pd_kvundo undo, mtp_undo;  /* the main layers', the MTP layer's (kvpool.h) */
};

int pd_seq_start(struct pd_engine *en, struct pd_seq *s, pd_err *e);
void pd_seq_end(struct pd_engine *en, struct pd_seq *s);

struct pd_step_item {
    struct pd_seq *seq;
    const int32_t *tokens;          /* [n] new tokens */
    int n;
    float *logits;                  /* [vocab] for the last new token, or NULL */
    float *all_logits;              /* [n, vocab] for every new token, or NULL (tests) */
    float *hidden;                  /* [n, hc, hidden] out: the residual streams after the last block,
                                       before the head (what the MTP layer reads), or NULL */
    const float *hidden_in;         /* pd_engine_mtp_step only: [n, hc, hidden] the hidden state at each
                                       position (the main model's, or the MTP layer's own) */
    int undo;                       /* record what the step overwrites so pd_engine_rollback can drop
                                       its tokens (speculative decoding) */
    struct pd_kvsnap *snaps;        /* [n_snaps] the sequence's KV state to copy at positions in
                                     * (pos, pos + n], each layer's part as soon as the token
                                     * before it is processed there (engine/prefix.h), or NULL */
    int n_snaps;
    const atomic_int *cancel;       /* set (by any thread) once nobody wants the item's result (its
                                     * client left), or NULL: see pd_engine_step */
};

/* Runs one step. On error no sequence advances. Once every item's cancel is set the step stops
 * before its next sublayer (attention or MoE) with PD_ECANCELED: a long prefill whose client left
 * is not run to its end (never set one under expert parallelism, whose ranks run every layer
 * together). n_items may be 0: the process still takes part in every layer's expert exchange
 * (expert parallelism). */
int pd_engine_step(struct pd_engine *en, struct pd_step_item *items, int n_items, pd_err *e);

/* The MTP draft forward (DeepSeek-V4's MTPBlock), for item i at the MTP positions
 * seq->mtp_pos .. +n-1: tokens[j] is the token at position mtp_pos + j + 1 and hidden_in[j] the
 * hidden state at position mtp_pos + j; logits (all_logits) predict the token after tokens[j]
 * (equations in engine.c); hidden gets the MTP block's output streams. Advances seq->mtp_pos.
 * Needs en->mtp. */
int pd_engine_mtp_step(struct pd_engine *en, struct pd_step_item *items, int n_items, pd_err *e);

/* Drops the main model's tokens at positions >= len and the MTP layer's at positions >= mtp_len
 * (each at least where its undo log began: every dropped token ran with undo on), restoring the
 * slot bytes they overwrote (kvpool.h says why that is exact); clears both undo logs, so the
 * tokens kept are final. The blocks stay reserved. PD_EINVAL if a dropped token was not logged. */
int pd_engine_rollback(struct pd_engine *en, struct pd_seq *s, int64_t len, int64_t mtp_len, pd_err *e);

/* Experts `expert[p]` on rows `row[p]` of `a`, for P pairs: the expert output [hidden] of pair p
 * goes to y + p * hidden, or to dst[p] when dst is not NULL (expert parallelism: a rank's own
 * pairs straight into the engine's buffer, the received ones into the combine's send buffer). */
int pd_engine_run_experts(struct pd_engine *en, int layer, const pd_qmat *a, const int32_t *row,
                          const int32_t *expert, int P, float *y, float *const *dst, pd_err *e);

#endif

/* Speculative decoding with DeepSeek-V4's MTP layer (vLLM's method "mtp").
 *
 * A round, for a batch of sequences whose main model has processed positions 0 .. p-1 and whose
 * next token t_p is known (sampled, not yet run):
 *   draft   the MTP layer runs the positions it has not run yet (mtp_pos .. p-1, with the main
 *           model's hidden states and the token after each: the last is t_p) and drafts
 *           d_1 = argmax of its logits at p-1; for k > 1 it runs again on its own output hidden
 *           state and draft (positions p .. p+k-2, recorded for undo) for d_2 .. d_k;
 *   verify  the main model runs [t_p, d_1 .. d_k] in one step with undo on (engine.h), every
 *           token exactly as it would run alone, giving the target logits at p .. p+k;
 *   accept  draft j is accepted while the previous ones were: at temperature 0 while it equals
 *           the main model's greedy token; at temperature > 0 with probability
 *           min(1, p(d_j) / q(d_j)) (p the sampler's distribution from the main logits, q the
 *           draft's: a point mass, the draft being greedy), else the round ends with a token
 *           drawn from normalize(max(0, p - q)); when all k are accepted one more token is drawn
 *           from the main logits at p+k. So a round yields a + 1 tokens for a accepted drafts and
 *           the output is distributed exactly as plain sampling's (bit for bit at temperature 0);
 *   roll back  the main model's tokens after the last accepted draft and the MTP layer's
 *           drafting positions (p ..) are undone (engine.h, kvpool.h); the main model's hidden
 *           states at p .. p+a become the MTP layer's next inputs. */
#ifndef PD_ENGINE_SPEC_H
#define PD_ENGINE_SPEC_H

#include <stdint.h>

#include "engine/engine.h"
#include "engine/sampler.h"

#define PD_SPEC_MAX_K 8

/* Counters as vLLM's spec_decode metrics name them. */
struct pd_spec_stats {
    int64_t drafts;                               /* verify steps that carried drafts (num_drafts) */
    int64_t draft_tokens;                         /* tokens drafted (num_draft_tokens) */
    int64_t drafted_per_pos[PD_SPEC_MAX_K];       /* drafts made at position j of a round */
    int64_t accepted_per_pos[PD_SPEC_MAX_K];      /* of them accepted (num_accepted_tokens_per_pos) */
    int64_t accepted;                             /* accepted drafts in all */
    int64_t emitted;                              /* tokens the verify steps produced */
    int64_t steps;                                /* verify steps */
};

struct pd_spec_seq {
    struct pd_seq *seq;
    struct pd_sampler *smp;        /* the sequence's sampler */
    int k;                         /* drafts in the next round, 0 .. PD_SPEC_MAX_K (0: a plain step) */
    /* the MTP positions not run yet, seq->mtp_pos .. seq->pos - 1: the main model's hidden state
     * at each, and the token after each (the last is the next token to verify, once pushed) */
    float *hid;                    /* [cap, hc, hidden] */
    int32_t *tok;                  /* [cap] */
    int n, n_tok, cap;
    int32_t draft[PD_SPEC_MAX_K];  /* the drafts of the last round (k of them) */
    int32_t out[PD_SPEC_MAX_K + 1];   /* the tokens the last round produced */
    int n_out;
    float *draft_logits;           /* [PD_SPEC_MAX_K, vocab] or NULL: the MTP layer's logits each draft
                                      of the last round was chosen from (tests: a handed-off draft state
                                      drafts exactly as the colocated one) */
    float *out_logits;             /* [PD_SPEC_MAX_K + 1, vocab] or NULL: the main model's logits each
                                      out token was chosen from (what plain decoding samples from) */
    struct pd_kvsnap *snaps;       /* [n_snaps] prefix-cache snapshots the next pd_spec_prefill and
                                      pd_spec_catch_up take (engine/prefix.h), or NULL */
    int n_snaps;
    float *buf;                    /* a round's logits and hidden states, kept between rounds */
    size_t buf_cap;                /* floats */
};

void pd_spec_init(struct pd_spec_seq *ss, struct pd_seq *seq, struct pd_sampler *smp);
void pd_spec_free(struct pd_spec_seq *ss);
/* Runs the prompts (prompt[i], n[i] tokens, as the sequences' first tokens, or after a cached
 * prefix for a sequence resumed by pd_spec_resume) through the main model in one step, keeping
 * their hidden states for the MTP layer; logits[i] get each last position's. */
int pd_spec_prefill(struct pd_engine *en, struct pd_spec_seq **ss, const int32_t *const *prompt, const int *n,
                    float *const *logits, int n_seqs, pd_err *e);
/* The next token of a sequence, sampled from the logits of its last position (after prefill). */
int pd_spec_push(struct pd_spec_seq *ss, int32_t token, pd_err *e);
/* One round (above) for n_seqs sequences together: each one's tokens go to its out[0 .. n_out).
 * Sampling is over the first `vocab` logits (the tokenizer's ids). */
int pd_spec_round(struct pd_engine *en, struct pd_spec_seq **ss, int n_seqs, int vocab, struct pd_spec_stats *st,
                  pd_err *e);

/* pd_spec_round with exactly `draft_steps` MTP steps, at least every sequence's k (steps beyond
 * them run with no item here). Expert parallelism: every rank of a group must take part in the
 * same expert exchanges, so all run the group's largest k of drafting steps and one verify step,
 * whatever sequences (none included) they hold. */
int pd_spec_round_steps(struct pd_engine *en, struct pd_spec_seq **ss, int n_seqs, int vocab, int draft_steps,
                        struct pd_spec_stats *st, pd_err *e);

/* A sequence's state at length n moved elsewhere: handed to another pool (PD) or kept in a
 * prefix cache. Besides the pool's bytes, the draft then needs what its next round reads: the MTP
 * layer's KV of positions 0 .. n-2 (one more layer of the pool, moved or cached with the others)
 * and the main model's hidden state at n-1 (every stream: the row, [hc, hidden] fp32,
 * pd_spec_row_bytes).
 * pd_spec_catch_up, after pd_spec_prefill and before pd_spec_push: the MTP layer runs every
 * pending position but the last (each needs only the prompt), for n_seqs sequences in one step,
 * taking the MTP layer's part of the sequences' snaps; then the last hidden state, the row to
 * send, is ss[i]->hid and the only input pending. (Without it the first round runs them: exact
 * either way, a token computing the same in any chunk.) */
int pd_spec_catch_up(struct pd_engine *en, struct pd_spec_seq **ss, int n_seqs, pd_err *e);
/* seq holds the KV of n tokens (pos n) made elsewhere (a hand-off, a cached prefix): it becomes a
 * speculating sequence whose MTP layer stands at n-1 with input `row` pending, awaiting the token
 * at n (pd_spec_prefill's next prompt token). */
int pd_spec_resume(struct pd_engine *en, struct pd_spec_seq *ss, struct pd_seq *seq, struct pd_sampler *smp,
                   const float *row, pd_err *e);
/* The same with the token at n known (the sender's first token): the next round verifies it. */
int pd_spec_handoff_receive(struct pd_engine *en, struct pd_spec_seq *ss, struct pd_seq *seq, struct pd_sampler *smp,
                            const float *row, int32_t first, pd_err *e);
size_t pd_spec_row_bytes(const struct pd_engine *en);

/* vLLM's --speculative-config JSON: {"method": "mtp", "num_speculative_tokens": k}, k in
 * 1 .. PD_SPEC_MAX_K; any other key or method is refused by name. */
int pd_spec_config_parse(const char *json, int *k, pd_err *e);

/* Rejection sampling of one draft token d drawn from q (q NULL: a point mass on d) against the
 * target distribution p, both over n tokens: accepted with probability min(1, p(d) / q(d));
 * rejected, the result is drawn from normalize(max(0, p - q)) (`resid` holds n floats). */
int32_t pd_spec_verify_token(struct pd_sampler *s, const float *p, const float *q, int n, int32_t d, float *resid,
                             int *accepted);
/* Its two parts, for tests: the acceptance probability, and the normalised residual (all zero
 * when p <= q everywhere, where it is never used: then p == q and d is always accepted). */
double pd_spec_accept_prob(const float *p, const float *q, int32_t d);
void pd_spec_residual(const float *p, const float *q, int n, int32_t d, float *r);

#endif

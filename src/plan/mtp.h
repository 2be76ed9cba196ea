/* Speculative decoding with the MTP layer as the performance model sees it: k draft tokens per
 * decode step, the acceptance of each draft position, the tokens a step yields, and the measured
 * acceptance read back from the engine's own counters.
 *
 * Acceptance here is conditional, per position: a[i] is the probability that draft i + 1 is
 * accepted given that drafts 1 .. i were (the verify step stops at the first rejection). vLLM's
 * and pdmoe's counters are unconditional (num_accepted_tokens_per_pos[j] / num_drafts: the share
 * of rounds whose first j + 1 drafts were all accepted); pd_mtp_stats_load converts them. A
 * single rate (the hardware file's mtp_acceptance) means the same a for every position. */
#ifndef PD_PLAN_MTP_H
#define PD_PLAN_MTP_H

#include "core/err.h"

#define PD_MTP_MAX_K 8   /* as the engine's PD_SPEC_MAX_K */

struct pd_mtp {
    int k;                       /* draft tokens per decode step; 0: the MTP layer does not run */
    double a[PD_MTP_MAX_K];      /* a[i]: draft i + 1 accepted once drafts 1 .. i were */
};

/* The tokens one decode step yields per sequence (below: the equation). */
double pd_mtp_tokens_per_step(const struct pd_mtp *m);

/* "a1[,a2,...]" (--mtp-acceptance): each in [0, 1]; at most PD_MTP_MAX_K. Sets m->k to the count. */
int pd_mtp_parse_list(const char *flag, const char *list, struct pd_mtp *m, pd_err *e);

/* Measured acceptance from FILE: either the JSON `pdmoe generate --spec-stats FILE` writes
 * ({"num_speculative_tokens": k, "num_drafts": n, "num_drafted_tokens_per_pos": [...],
 * "num_accepted_tokens_per_pos": [...], ...}) or a scrape of a server's /metrics in Prometheus
 * text (pdmoe serve's pdmoe_spec_decode_* counters, or vLLM's vllm:spec_decode_*). Sets m->k to the
 * positions counted and m->a to the conditional rates. PD_EINVAL naming FILE and the field when
 * a count is missing, negative, or inconsistent (more accepted than drafted, a later position
 * accepted more often than an earlier one), or when no round was drafted. */
int pd_mtp_stats_load(const char *path, struct pd_mtp *m, pd_err *e);
/* The same from text already read (`label` names it in messages). */
int pd_mtp_stats_parse(const char *text, const char *label, struct pd_mtp *m, pd_err *e);

#endif

/* Validation of the performance model against published deployments
 * (validation/published.json, compiled in): each case's layout and workload as published,
 * the published figure, pdmoe's prediction and the relative error. docs/validation.md is
 * this module's Markdown output (tools/validation.sh regenerates it). */
#ifndef PD_PLAN_VALIDATE_H
#define PD_PLAN_VALIDATE_H

#include "core/err.h"
#include "plan/perf.h"

struct pd_valcase {
    char name[160];
    char source[512];
    char assumed[512];
    char known_miss[512];     /* why a case cannot be met, when the file says so */
    char metric[64];          /* prefill_tokens_per_s_node or decode_tokens_per_s_node */
    double published, predicted, error;   /* error = predicted / published - 1 */
    double imbalance;         /* the case's busiest/mean expert load; 0: the hardware file's */
    double cached;            /* fraction of the prompt served from a prefix cache */
    struct pd_perf perf;
    char layout[128];         /* "P 1 x EP32, D 1 x EP144" */
};

/* Runs every case of a validation file's text; *out is malloc'ed ([*n]). */
int pd_validate_run(const char *text, const char *label, struct pd_valcase **out, int *n, pd_err *e);
char *pd_validate_markdown(const struct pd_valcase *c, int n);   /* malloc'ed */

#endif

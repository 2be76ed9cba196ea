/* Validation of the performance model against published deployments
 * (validation/published.json, compiled in): each case's layout and workload as published,
 * the published figure, pdmoe's prediction and the relative error. docs/validation.md is
 * this module's Markdown output (tools/validation.sh regenerates it).
 *
 * Metrics: input tokens/s per node in prefill, output tokens/s per node in decode (the roles of
 * a disaggregated layout at capacity), output tokens/s of the whole deployment under a closed
 * loop of `concurrency` clients, and output tokens/s of one user. A case whose publication the
 * model cannot express yet says why in "pending" (an aggregated layout, given as "aggregated":
 * {dp, tp, instances}, is only accepted so): its names are checked, nothing is predicted, and it
 * counts neither for nor against the 25% target. */
#ifndef PD_PLAN_VALIDATE_H
#define PD_PLAN_VALIDATE_H

#include "core/err.h"
#include "plan/lockstep.h"
#include "plan/perf.h"

struct pd_valcase {
    char name[160];
    char source[768];
    char assumed[1536];
    char known_miss[512];     /* why a case cannot be met, when the file says so */
    char pending[2048];       /* why the case does not meet the model yet, measured; "" when it does */
    char metric[64];          /* prefill_tokens_per_s_node, decode_tokens_per_s_node,
                                 output_tokens_per_s or user_tokens_per_s */
    double published, predicted, error;   /* error = predicted / published - 1 (NaN when pending) */
    int64_t concurrency;      /* closed-loop clients; 0: open loop */
    double imbalance;         /* the case's busiest/mean expert load; 0: the hardware file's */
    double cached;            /* fraction of the prompt served from a prefix cache */
    struct pd_perf perf;
    struct pd_lockstep lock;  /* an aggregated lockstep case: its busiest rank's run */
    char layout[128];         /* "P 1 x EP32, D 1 x EP144", or "aggregated 1 x DP16 TP16 (EP16)" */
    enum pd_arch arch;        /* the case's model's architecture */
    char family[16];          /* its cards' family (pd_hardware_family), "" for none */
    char kv_layout[96];       /* whose KV layout the plan counted (pd_kv_layout_name; field "stack") */
};

/* Runs every case of a validation file's text; *out is malloc'ed ([*n]). */
int pd_validate_run(const char *text, const char *label, struct pd_valcase **out, int *n, pd_err *e);
char *pd_validate_markdown(const struct pd_valcase *c, int n);   /* malloc'ed */
/* The cases as a JSON array (a json_t *): each case's figures, status (checked, known_miss or
 * pending) and reason, its model terms (pd_perf_json) and, for a lockstep case, its run. */
void *pd_validate_json(const struct pd_valcase *c, int n);

/* How far the published runs vouch for a prediction of plan p: the shipped cases
 * (validation/published.json), run now, of p's architecture on cards of p's family
 * (pd_hardware_family; none for a family no case has), judged as pdmoe validate judges them, as
 * text (*text, malloc'ed, when text: the lines `pdmoe plan --isl/--osl` and `pdmoe search` close
 * with, saying to read the prediction as an upper bound when a run was over 25% slower) and JSON
 * (*json, a json_t *, when json). PD_ENOMEM, or the cases' own error. */
struct pd_plan;
int pd_validate_vouch(const struct pd_plan *p, char **text, void **json, pd_err *e);

#endif

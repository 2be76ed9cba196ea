/* Internal to the launch-script writers (emit.c: vllm-ascend and SGLang; emit_pdmoe.c: pdmoe):
 * the context of one script and the shell pieces every target writes the same way. */
#ifndef PD_PLAN_EMIT_SH_H
#define PD_PLAN_EMIT_SH_H

#include "plan/emit.h"
#include "plan/nodes.h"

#include <stdio.h>

struct pd_emit_ctx {
    const struct pd_plan *p;
    const struct pd_emit_opts *o;
    struct pd_node_layout L;
    const char **host;      /* L.nodes names */
    char (*placeholder)[16];
    const char *model;
    int ascend;
    int w8a8;               /* the plan's linear layers are W8A8: an int8 (msmodelslim) checkpoint */
    int w4a8;               /* ... with int4 routed experts (msmodelslim's W4A8) */
    int model_var;          /* the servers load "$MODEL_PATH", which the script requires */
};

/* c->L from c->p (the node map) and c->host from c->o's --hosts (or node0 ... placeholders):
 * PD_EINVAL for too few, repeated or malformed hosts. pd_emit_ctx_free either way. */
int pd_emit_layout(struct pd_emit_ctx *c, pd_err *e);
void pd_emit_ctx_free(struct pd_emit_ctx *c);

/* s as one shell word (quoted when it must be). */
void pd_emit_sh_word(FILE *f, const char *s);
/* What goes into the script's comments and messages (the model path, the model's and the
 * hardware's names, the command line) holds no control character: else an error naming it. */
int pd_emit_check_text(const struct pd_emit_ctx *c, pd_err *e);

/* #!/bin/sh and what the script launches: engine, model, hardware, layout, model path. */
void pd_emit_header(FILE *f, const struct pd_emit_ctx *c, enum pd_emit_target t);

/* `set -e` and the `sh FILE HOST` dispatch, which refuses a host not in the layout. */
void pd_emit_dispatch(FILE *f, const struct pd_emit_ctx *c);

/* Each role's KV pool holds at least one sequence of max-model-len (and the weights fit). */
int pd_emit_check_fits(const struct pd_plan *p, pd_err *e);
/* A comment line when role r's servers get n < --max-num-seqs sequences (pd_plan_admitted_seqs, or
 * SGLang's from its rounded memory fraction). */
void pd_emit_seqs_note(FILE *f, const struct pd_plan *p, enum pd_role r, int64_t n);

/* The pdmoe script (emit_pdmoe.c), as pd_emit. */
char *pd_emit_pdmoe(const struct pd_plan *p, const struct pd_emit_opts *o, pd_err *e);

#endif

/* Internal to the launch-script writers (emit.c): the context of one script and the shell pieces
 * every target writes the same way. */
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
    int model_var;          /* the servers load "$MODEL_PATH", which the script requires */
};

/* s as one shell word (quoted when it must be). */
void pd_emit_sh_word(FILE *f, const char *s);

/* #!/bin/sh, what the script launches, and the `sh FILE HOST` dispatch that refuses a host not in
 * the layout. */
void pd_emit_header(FILE *f, const struct pd_emit_ctx *c, enum pd_emit_target t);

/* Each role's KV pool holds at least one sequence of max-model-len (and the weights fit). */
int pd_emit_check_fits(const struct pd_plan *p, pd_err *e);

#endif

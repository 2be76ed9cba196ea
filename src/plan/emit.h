/* From a deployment plan to a real cluster: the shell script that starts every prefill and decode
 * instance of the plan's layout with vllm-ascend (KV cache over Mooncake) or SGLang (PD
 * disaggregation over Mooncake), one command per instance and node, and the proxy (router) in
 * front of them; or with pdmoe itself on CPU hosts (target pdmoe): the very command lines
 * `pdmoe up --plan plan.json --hosts ...` runs (plan/launch.h), one per instance on its first
 * host, an EP group spanning hosts being one mpirun. Where each flag comes from, in the plan and
 * in the engines' own documents, and what a user must still fill in: docs/emit.md.
 *
 * Node assignment: prefill instances take the first nodes in order, decode the following ones;
 * an instance smaller than a node shares it with the next instance of the same role (each gets
 * its own cards, ports and kv_port); an instance larger than a node spans cards/cards_per_node
 * whole nodes. */
#ifndef PD_PLAN_EMIT_H
#define PD_PLAN_EMIT_H

#include "core/err.h"
#include "plan/plan.h"

enum pd_emit_target { PD_EMIT_VLLM_ASCEND = 0, PD_EMIT_SGLANG = 1, PD_EMIT_PDMOE = 2 };

struct pd_emit_opts {
    const char *const *hosts;   /* n_hosts node addresses, in node order; NULL: node0 ... nodeN-1 */
    int n_hosts;
    const char *model_path;     /* what every server loads; NULL: pd_emit_model_path(p) (pdmoe: below) */
    int base_port;              /* HTTP port of the first instance on a node (the k-th: + 10 k); not pdmoe's */
    int proxy_port;             /* the proxy's (router's) port; it runs on the first prefill node. pdmoe:
                                 * also the base of every port (pd_launch_ports, as pdmoe up --port) */
    int threads;                /* pdmoe: --threads of every rank (as pdmoe up --threads) */
    const char *command;        /* the pdmoe command named in the script's header; NULL: "pdmoe plan" */
};

/* base_port 8100, proxy_port 8000, threads 1, placeholder hosts, the default model path. */
void pd_emit_opts_default(struct pd_emit_opts *o);

/* "vllm-ascend", "sglang" or "pdmoe"; PD_EINVAL (message naming --emit) for anything else. */
int pd_emit_target_parse(const char *name, enum pd_emit_target *t, pd_err *e);
const char *pd_emit_target_name(enum pd_emit_target t);
/* The stack a script for target `t` launches is the one whose KV layout the plan must count:
 * --emit sglang plans for SGLang, vllm-ascend and pdmoe for vLLM's or pdmoe's own; a --stack that
 * says otherwise is refused. */
int pd_emit_stack(enum pd_emit_target t, enum pd_plan_stack *stack, pd_err *e);

/* --no-async-scheduling where the plan's stack (pd_plan_check_async) or, with --emit (`emit`
 * non-zero), the target `t` has no such flag: pdmoe's servers run one step at a time. PD_EINVAL
 * naming the flag, else 0. pd_emit refuses the same. */
int pd_emit_check_async(const struct pd_plan_opts *o, int emit, enum pd_emit_target t, pd_err *e);

/* The model path the servers load by default: the --checkpoint directory, else the Hugging Face
 * repository of a preset that has one (deepseek-v4-flash and seed-v4-flash:
 * deepseek-ai/DeepSeek-V4-Flash; deepseek-v3: deepseek-ai/DeepSeek-V3), else the --model argument. */
const char *pd_emit_model_path(const struct pd_plan *p);

/* The launch script (#!/bin/sh), malloc'ed; NULL with `e` filled when the layout cannot be
 * emitted (too few --hosts, an uneven split, clashing ports, vllm-ascend on non-Ascend cards;
 * for pdmoe: tp > 1, redundant experts, a preset with no local checkpoint and no model_path).
 *
 * pdmoe's servers load a local checkpoint directory, the same path on every host: model_path,
 * else the plan's --checkpoint, else its --model when that is a directory, else models/mini for
 * the v4-flash-mini preset (where pdmoe up generates it). */
char *pd_emit(const struct pd_plan *p, enum pd_emit_target t, const struct pd_emit_opts *o, pd_err *e);

#endif

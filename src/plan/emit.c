/* Launch scripts from a plan: the node assignment (which instance runs on which cards of which
 * node, with which ports), then one writer per engine (pdmoe's own in emit_pdmoe.c). Every flag
 * name was checked against the engine's own source or documents, cited beside the code that
 * writes it; docs/emit.md lists them with the plan field each value comes from. */
#include "core/text.h"
#include "plan/emit.h"
#include "plan/emit_sh.h"
#include "plan/nodes.h"
#include "core/units.h"

#include <assert.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Ports. Instances sharing a node are `PORT_STEP` apart in every per-node port, so the ports
 * an engine derives from its own (SGLang opens a few above --port) never meet. */
#define PORT_STEP 10
#define VLLM_DP_RPC_PORT 13345   /* vLLM docs/serving/data_parallel_deployment.md */
#define SGL_DIST_INIT_PORT 5000  /* SGLang docs/advanced_features/pd_disaggregation.md */
#define SGL_BOOTSTRAP_PORT 8998  /* SGLang server_args.py: disaggregation_bootstrap_port's default */

void pd_emit_opts_default(struct pd_emit_opts *o)
{
    memset(o, 0, sizeof *o);
    o->base_port = 8100;
    o->proxy_port = 8000;
    o->threads = 1;
}

static const char *const target_names[] = {"vllm-ascend", "sglang", "pdmoe"};   /* by enum pd_emit_target */

/* An fp8 KV cache on cards without FP8 (Ascend 910B/910C) is not what either stack would run:
 * vllm-ascend keeps the cache in bf16 there whatever --kv-cache-dtype says (plan.c,
 * pd_plan_kv_dtype_default), so a script sized on fp8 entries would promise sequences that do
 * not fit. */
static int check_kv_dtype(const struct pd_plan *p, enum pd_emit_target t, pd_err *e)
{
    if (p->kv.dtype != PD_KV_FP8 || p->hw.fp8_flops > 0 || p->kv.flat_per_token > 0)
        return 0;
    return pd_err_set(e, PD_EINVAL, "--emit %s: --kv-cache-dtype fp8 on %s cards, which have no FP8 type: the KV cache "
                      "is bf16 there (vllm-ascend makes it so whatever --kv-cache-dtype says; SGLang's Ascend runs use "
                      "bf16), so pools and batches sized on fp8 entries would not hold; plan with --kv-cache-dtype bf16 "
                      "(the default on these cards)", target_names[t], p->hw.card_name);
}

int pd_emit_target_parse(const char *name, enum pd_emit_target *t, pd_err *e)
{
    for (int i = 0; name && i < 3; i++)
        if (strcmp(name, target_names[i]) == 0) {
            *t = (enum pd_emit_target)i;
            return 0;
        }
    return pd_err_set(e, PD_EINVAL, "--emit %s: expected vllm-ascend, sglang or pdmoe", name ? name : "");
}

const char *pd_emit_target_name(enum pd_emit_target t)
{
    return target_names[t];
}

const char *pd_emit_model_path(const struct pd_plan *p)
{
    static const struct { const char *preset, *repo; } hf[] = {
        {"deepseek-v4-flash", "deepseek-ai/DeepSeek-V4-Flash"},
        {"seed-v4-flash", "deepseek-ai/DeepSeek-V4-Flash"},   /* the article's description of it */
        {"deepseek-v3", "deepseek-ai/DeepSeek-V3"},
    };
    if (p->o.checkpoint)
        return p->o.checkpoint;
    for (size_t i = 0; i < sizeof hf / sizeof hf[0]; i++)
        if (strcmp(p->model.name, hf[i].preset) == 0)
            return hf[i].repo;
    return p->o.model ? p->o.model : p->model.name;
}

/* Ports a part binds on its node: HTTP and the instance's rendezvous port on its first node, the
 * bootstrap server of an SGLang prefill instance, the kv_port range of a vllm-ascend instance. */
struct range {
    int lo, hi;
    const struct pd_node_part *x;
    const char *what;
};

static int part_ranges(const struct pd_emit_ctx *c, enum pd_emit_target t, const struct pd_node_part *x, struct range *out)
{
    int n = 0, s = PORT_STEP * x->slot, head = x->k == 0;
    if (head)
        out[n++] = (struct range){c->o->base_port + s, c->o->base_port + s, x, "HTTP port"};
    if (t == PD_EMIT_VLLM_ASCEND) {
        if (head)
            out[n++] = (struct range){VLLM_DP_RPC_PORT + s, VLLM_DP_RPC_PORT + s, x, "--data-parallel-rpc-port"};
        int kv = c->L.kv_base + c->L.kv_step * x->id;
        out[n++] = (struct range){kv, kv + c->L.kv_step - 1, x, "kv_port range"};
    } else {
        if (head && x->n > 1)
            out[n++] = (struct range){SGL_DIST_INIT_PORT + s, SGL_DIST_INIT_PORT + s, x, "--dist-init-addr port"};
        if (head && x->role == PD_ROLE_PREFILL)
            out[n++] = (struct range){SGL_BOOTSTRAP_PORT + s, SGL_BOOTSTRAP_PORT + s, x, "bootstrap port"};
    }
    return n;
}

static const char *span(int lo, int hi, char *buf)
{
    if (lo == hi)
        snprintf(buf, 32, "%d", lo);
    else
        snprintf(buf, 32, "%d-%d", lo, hi);
    return buf;
}

static int check_ports(const struct pd_emit_ctx *c, enum pd_emit_target t, pd_err *e)
{
    const struct pd_node_layout *L = &c->L;
    struct range *r = malloc(sizeof *r * (size_t)(4 * L->n_parts + 1));
    if (!r)
        return pd_err_set(e, PD_ENOMEM, "out of memory");
    int rc = 0;
    for (int node = 0; node < L->nodes && !rc; node++) {
        int n = 0;
        if (node == 0)
            r[n++] = (struct range){c->o->proxy_port, c->o->proxy_port, NULL, "port"};
        for (int i = 0; i < L->n_parts; i++)
            if (L->parts[i].node == node)
                n += part_ranges(c, t, &L->parts[i], r + n);
        for (int i = 0; i < n && !rc; i++) {
            if (r[i].lo < 1 || r[i].hi > 65535) {
                rc = pd_err_set(e, PD_EINVAL, "%s %s on %s is outside 1-65535 (see --base-port, --proxy-port)",
                                r[i].what, span(r[i].lo, r[i].hi, (char[32]){0}), c->host[node]);
                break;
            }
            for (int j = 0; j < i; j++)
                if (r[i].lo <= r[j].hi && r[j].lo <= r[i].hi) {
                    char a[64] = "the proxy", b[64] = "the proxy";
                    if (r[j].x)
                        snprintf(a, sizeof a, "%s instance %d", pd_role_name(r[j].x->role), r[j].x->inst);
                    if (r[i].x)
                        snprintf(b, sizeof b, "%s instance %d", pd_role_name(r[i].x->role), r[i].x->inst);
                    rc = pd_err_set(e, PD_EINVAL, "ports clash on %s: the %s %s of %s and the %s %s of %s "
                                    "(see --base-port, --proxy-port)", c->host[node], r[j].what,
                                    span(r[j].lo, r[j].hi, (char[32]){0}), a, r[i].what,
                                    span(r[i].lo, r[i].hi, (char[32]){0}), b);
                    break;
                }
        }
    }
    free(r);
    return rc;
}

static int host_ok(const char *h)
{
    size_t n = strlen(h);
    /* (a leading '-' is read as an option by every launcher; dots alone name no host) */
    if (n == 0 || n > 253 || h[0] == '-' || strspn(h, ".") == n)
        return 0;
    for (const char *s = h; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') || *s == '.' ||
              *s == '-' || *s == '_'))
            return 0;
    return 1;
}

static int hosts_build(struct pd_emit_ctx *c, pd_err *e)
{
    const struct pd_node_layout *L = &c->L;
    c->host = calloc((size_t)L->nodes, sizeof *c->host);
    if (!c->host)
        return pd_err_set(e, PD_ENOMEM, "out of memory");
    if (!c->o->hosts) {
        c->placeholder = calloc((size_t)L->nodes, sizeof *c->placeholder);
        if (!c->placeholder)
            return pd_err_set(e, PD_ENOMEM, "out of memory");
        for (int i = 0; i < L->nodes; i++) {
            snprintf(c->placeholder[i], sizeof c->placeholder[i], "node%d", i);
            c->host[i] = c->placeholder[i];
        }
        return 0;
    }
    for (int i = 0; i < c->o->n_hosts; i++)
        if (!c->o->hosts[i] || !host_ok(c->o->hosts[i]))
        {
            char shown[96];
            return pd_err_set(e, PD_EINVAL, "--hosts: host %d \"%s\": expected a name or an IPv4 address "
                              "(letters, digits, '.', '-', '_'; not starting with '-')", i + 1,
                              pd_text_safe(shown, sizeof shown, c->o->hosts[i] ? c->o->hosts[i] : ""));
        }
    if (c->o->n_hosts < L->nodes)
        return pd_err_set(e, PD_EINVAL, "--hosts: %d given but the layout needs %d nodes (prefill on nodes %d-%d, "
                          "decode on nodes %d-%d)", c->o->n_hosts, L->nodes, L->first[0], L->last[0], L->first[1],
                          L->last[1]);
    for (int i = 0; i < L->nodes; i++) {
        for (int j = 0; j < i; j++)
            if (strcmp(c->o->hosts[i], c->o->hosts[j]) == 0)
                return pd_err_set(e, PD_EINVAL, "--hosts: %s is listed twice (hosts %d and %d); each node needs "
                                  "its own", c->o->hosts[i], j + 1, i + 1);
        c->host[i] = c->o->hosts[i];
    }
    return 0;
}

void pd_emit_sh_word(FILE *f, const char *s)
{
    int safe = *s != 0;
    for (const char *q = s; *q; q++)
        if (!strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./:@%+=,-", *q))
            safe = 0;
    if (safe) {
        fputs(s, f);
        return;
    }
    fputc('\'', f);
    for (const char *q = s; *q; q++)
        if (*q == '\'')
            fputs("'\\''", f);
        else
            fputc(*q, f);
    fputc('\'', f);
}

/* The model argument of every server: the path, or "$MODEL_PATH" when the script requires one. */
static void model_word(FILE *f, const struct pd_emit_ctx *c)
{
    if (c->model_var)
        fputs("\"$MODEL_PATH\"", f);
    else
        pd_emit_sh_word(f, c->model);
}

/* One more argument of the command being written: a continuation line. */
static void arg(FILE *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void arg(FILE *f, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs(" \\\n    ", f);
    vfprintf(f, fmt, ap);
    va_end(ap);
}

static void comment(FILE *f, const struct pd_emit_ctx *c, const struct pd_node_part *x, const char *note)
{
    const struct pd_role_plan *rp = &c->p->role[x->role];
    fprintf(f, "# %s instance %d on %s (node %d of %d%s): ", c->p->o.aggregated ? "aggregated" : pd_role_name(x->role),
            x->inst, c->host[x->node],
            x->k + 1, x->n, note);
    if (x->ncards == 1)
        fprintf(f, "card %d, ", x->card0);
    else
        fprintf(f, "cards %d-%d, ", x->card0, x->card0 + x->ncards - 1);
    if (x->dp_local == 1)
        fprintf(f, "dp rank %d of %d", x->dp_start, rp->o.dp);
    else
        fprintf(f, "dp ranks %d-%d of %d", x->dp_start, x->dp_start + x->dp_local - 1, rp->o.dp);
    if (rp->o.tp > 1)
        fprintf(f, " x tp %d", rp->o.tp);
    fputc('\n', f);
}

void pd_emit_header(FILE *f, const struct pd_emit_ctx *c, enum pd_emit_target t)
{
    const struct pd_plan *p = c->p;
    const struct pd_role_opts *P = &p->role[PD_ROLE_PREFILL].o, *D = &p->role[PD_ROLE_DECODE].o;
    fprintf(f, "#!/bin/sh\n");
    fprintf(f, "# %s launch commands from `%s --emit %s`:\n", pd_emit_target_name(t),
            c->o->command ? c->o->command : "pdmoe plan", pd_emit_target_name(t));
    fprintf(f, "# %s on %d nodes of %d %s (%s),\n", p->model.name, c->L.nodes, p->hw.cards_per_node, p->hw.card_name,
            p->hw.name);
    if (p->o.aggregated)
        fprintf(f, "# aggregated %d x (dp %d, tp %d): each instance prefills and decodes; model path ", D->instances,
                D->dp, D->tp);
    else
        fprintf(f, "# prefill %d x (dp %d, tp %d), decode %d x (dp %d, tp %d); model path ", P->instances, P->dp, P->tp,
                D->instances, D->dp, D->tp);
    if (c->model_var)
        fprintf(f, "$MODEL_PATH\n# (a W8A8 conversion of %s)", c->model);
    else
        pd_emit_sh_word(f, c->model);
    fprintf(f, ".\n");
}

void pd_emit_dispatch(FILE *f, const struct pd_emit_ctx *c)
{
    fprintf(f, "set -e\n");
    fprintf(f, "host=${1:?usage: sh FILE HOST (%s ... %s)}\n", c->host[0], c->host[c->L.nodes - 1]);
    fprintf(f, "case \"$host\" in\n");
    for (int i = 0; i < c->L.nodes; i++)
        fprintf(f, "%s%s", i ? "|" : "", c->host[i]);
    fprintf(f, ") ;;\n*) echo \"$0: $host is not a node of this deployment (%s ... %s)\" >&2; exit 2 ;;\nesac\n\n",
            c->host[0], c->host[c->L.nodes - 1]);
}

/* A comment above a role's servers when its --max-num-seqs was lowered. */
/* x in the fewest significant digits that read back as x: the value planned with, not one %g
 * rounded down (0.9068082711657849 went out as 0.906808, and vLLM's pool then held one sequence
 * fewer than the plan's). */
static const char *shortest(char *buf, size_t n, double x)
{
    for (int digits = 1; digits <= 17; digits++) {
        snprintf(buf, n, "%.*g", digits, x);
        if (strtod(buf, NULL) == x)
            break;
    }
    return buf;
}

void pd_emit_seqs_note(FILE *f, const struct pd_plan *p, enum pd_role r, int64_t n)
{
    if (n < p->o.max_num_seqs)
        fprintf(f, "# %lld %s per data-parallel rank, not the plan's --max-num-seqs %lld: %lld of max-model-len\n"
                   "# %lld %s this %s card's KV pool%s (pdmoe plan: \"sequences of max-model-len that fit\")\n",
                (long long)n, n == 1 ? "sequence" : "sequences", (long long)p->o.max_num_seqs, (long long)n,
                (long long)p->o.max_model_len, n == 1 ? "fits" : "fit", pd_role_name(r),
                p->role[r].b.kv_chunks                              ? " beside its chunks in flight"
                : p->role[r].b.kv_transient - p->role[r].b.kv_tables ? " beside its steps in flight"
                : p->role[r].b.kv_tables                             ? " beside SGLang's request tables"
                                                                     : "");
}

/* vllm-ascend: one `vllm serve` per instance and node in vLLM's internal load-balancing mode
 * (vLLM docs/serving/data_parallel_deployment.md: the first node serves HTTP, the others run
 * --headless engines from --data-parallel-start-rank), with vllm-ascend's Mooncake connector. */
static void vllm_env(FILE *f)
{
    fputs("# Environment of vllm-ascend's multi-node PD tutorials (pd_disaggregation_mooncake_multi_node\n"
          "# and DeepSeek-V4-Flash on Atlas 800 A2), on every node.\n"
          ": \"${NIC_NAME:?set NIC_NAME to the network interface that connects the nodes, e.g. enp67s0f0np0}\"\n"
          "local_ip=${LOCAL_IP:-$(hostname -I | awk '{print $1}')}\n"
          "export HCCL_IF_IP=\"$local_ip\"\n"
          "export GLOO_SOCKET_IFNAME=\"$NIC_NAME\" TP_SOCKET_IFNAME=\"$NIC_NAME\" HCCL_SOCKET_IFNAME=\"$NIC_NAME\"\n"
          "export OMP_PROC_BIND=false OMP_NUM_THREADS=10 PYTORCH_NPU_ALLOC_CONF=expandable_segments:True\n"
          "export HCCL_BUFFSIZE=1024 HCCL_OP_EXPANSION_MODE=AIV TASK_QUEUE_ENABLE=1\n"
          "export HCCL_EXEC_TIMEOUT=204 HCCL_CONNECT_TIMEOUT=1200\n"
          "export VLLM_RPC_TIMEOUT=3600000 VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=30000\n\n",
          f);
}

static void vllm_part(FILE *f, const struct pd_emit_ctx *c, const struct pd_node_part *x)
{
    const struct pd_plan *p = c->p;
    const struct pd_role_plan *rp = &p->role[x->role], *P = &p->role[PD_ROLE_PREFILL], *D = &p->role[PD_ROLE_DECODE];
    int head = x->k == 0, s = PORT_STEP * x->slot, v4 = p->model.arch == PD_ARCH_DEEPSEEK_V4;
    comment(f, c, x, head ? "" : ", headless");
    pd_emit_seqs_note(f, p, x->role, pd_plan_admitted_seqs(p, x->role));
    fprintf(f, "if [ \"$host\" = %s ]; then\n  %sASCEND_RT_VISIBLE_DEVICES=", c->host[x->node],
            rp->o.redundant > 0 ? "DYNAMIC_EPLB=true " : "");
    for (int i = 0; i < x->ncards; i++)
        fprintf(f, "%s%d", i ? "," : "", x->card0 + i);
    fputs(" vllm serve ", f);
    model_word(f, c);
    if (head) {
        arg(f, "--host 0.0.0.0");
        arg(f, "--port %d", c->o->base_port + s);
    } else {
        arg(f, "--headless");
    }
    arg(f, "--data-parallel-size %d", rp->o.dp);
    arg(f, "--data-parallel-size-local %d", x->dp_local);
    if (!head)
        arg(f, "--data-parallel-start-rank %d", x->dp_start);
    arg(f, "--data-parallel-address %s", c->host[x->head]);
    arg(f, "--data-parallel-rpc-port %d", VLLM_DP_RPC_PORT + s);
    arg(f, "--tensor-parallel-size %d", rp->o.tp);
    if (rp->ep > 1)
        arg(f, "--enable-expert-parallel");
    if (c->w8a8)   /* vllm-ascend's quantization guide: msmodelslim's W8A8 checkpoints */
        arg(f, "--quantization ascend");
    char util[32];
    arg(f, "--gpu-memory-utilization %s", shortest(util, sizeof util, p->o.util));
    arg(f, "--max-num-seqs %lld", (long long)pd_plan_admitted_seqs(p, x->role));
    /* the plan counts the steps in flight of the scheduling it was given (plan.h
     * pd_plan_steps_in_flight); vLLM's default, async, needs no flag */
    if (p->o.no_async_scheduling)
        arg(f, "--no-async-scheduling");
    arg(f, "--max-model-len %lld", (long long)p->o.max_model_len);
    /* the block size whose layout the plan counts (kvsize.h; vllm-ascend's default, spelt out) */
    if (p->kv.layout == PD_KV_LAYOUT_VLLM_ASCEND)
        arg(f, "--block-size %d", PD_KV_ASCEND_BLOCK_SIZE);
    /* a decode server's step is its sequences' tokens (each 1 + k with MTP), as the plan sizes its
     * activations and as vllm-ascend's DeepSeek-V4-Flash PD tutorial sets it (60 for 30
     * sequences): vLLM profiles its activations with a step of --max-num-batched-tokens, and 4,096
     * there took its KV pool about 1.5 GB below the plan's */
    arg(f, "--max-num-batched-tokens %lld", (long long)(x->role == PD_ROLE_DECODE && !p->o.aggregated
                                                             ? rp->act.tokens : p->o.max_num_batched_tokens));
    /* The seed's roles (../shared/reference/pd-serving-systems.md), as vllm-ascend's
     * DeepSeek-V4-Flash tutorial writes them: eager prefill; decode-only graphs and the
     * recompute scheduler on decode. */
    /* Redundant experts: vllm-ascend's (MRv1) dynamic EPLB, an eplb_config in --additional-config
     * (its EPLB guide; DYNAMIC_EPLB=true is set before the command). */
    char eplb[160] = "";
    if (rp->o.redundant > 0)
        snprintf(eplb, sizeof eplb, "\"eplb_config\":{\"dynamic_eplb\":true,\"eplb_policy_type\":2,"
                 "\"num_redundant_experts\":%d}", rp->o.redundant);
    /* MTP as the plan's TPOT assumes it, on both roles: vllm-ascend's DeepSeek-V4-Flash tutorial
     * (docs/source/tutorials/models/DeepSeek-V4-Flash.md) passes this config to its single-node
     * servers and to both sides of its Mooncake PD deployment, the draft run eagerly. */
    if (p->mtp.k > 0)
        arg(f, "--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":%d,\"enforce_eager\":true}'",
            p->mtp.k);
    if (p->o.aggregated) {
        /* an aggregated server: vLLM's defaults (chunked prefill, graphs), no KV connector */
        if (eplb[0])
            arg(f, "--additional-config '{%s}'", eplb);
        fputs(" &\nfi\n\n", f);
        return;
    }
    if (x->role == PD_ROLE_PREFILL) {
        arg(f, "--enforce-eager");
        if (eplb[0])
            arg(f, "--additional-config '{%s}'", eplb);
    } else {
        arg(f, "--compilation-config '{\"cudagraph_mode\":\"FULL_DECODE_ONLY\"}'");
        arg(f, "--additional-config '{\"recompute_scheduler_enable\":true%s%s}'", eplb[0] ? "," : "", eplb);
    }
    /* V4's window + compressed attention needs vLLM's hybrid KV cache manager, and vllm-ascend's
     * MooncakeHybridConnector (registered in vllm_ascend/distributed/kv_transfer/__init__.py) to
     * move such caches; other models use MooncakeConnectorV1 (the DeepSeek PD tutorial). */
    if (v4)
        arg(f, "--no-disable-hybrid-kv-cache-manager");
    arg(f, "--kv-transfer-config '{\"kv_connector\":\"%s\",\"kv_role\":\"%s\",\"kv_port\":\"%d\",\"engine_id\":\"%d\","
           "\"kv_connector_extra_config\":{\"prefill\":{\"dp_size\":%d,\"tp_size\":%d},"
           "\"decode\":{\"dp_size\":%d,\"tp_size\":%d}}}'",
        v4 ? "MooncakeHybridConnector" : "MooncakeConnectorV1",
        x->role == PD_ROLE_PREFILL ? "kv_producer" : "kv_consumer", c->L.kv_base + c->L.kv_step * x->id, x->id,
        P->o.dp, P->o.tp, D->o.dp, D->o.tp);
    fputs(" &\nfi\n\n", f);
}

/* vllm-ascend's examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py (its
 * parse_args: --host, --port, --prefiller-hosts/-ports, --decoder-hosts/-ports, nargs="+"):
 * one entry per instance, its first node and HTTP port. */
static void vllm_proxy(FILE *f, const struct pd_emit_ctx *c)
{
    if (c->p->o.aggregated) {   /* the PD proxy needs prefillers; aggregated servers take requests themselves */
        fprintf(f, "# No PD proxy: each aggregated instance serves requests on its first node's port (");
        for (int i = 0, n = 0; i < c->L.n_parts; i++)
            if (!c->L.parts[i].k)
                fprintf(f, "%s%s:%d", n++ ? ", " : "", c->host[c->L.parts[i].node], c->o->base_port + PORT_STEP * c->L.parts[i].slot);
        fprintf(f, ");\n# put any HTTP load balancer in front of them to use one address.\n\n");
        return;
    }
    static const char *const flag[2][2] = {{"--prefiller-hosts", "--prefiller-ports"},
                                           {"--decoder-hosts", "--decoder-ports"}};
    fprintf(f, "# proxy on %s: vllm-ascend's examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py\n",
            c->host[0]);
    fprintf(f, "if [ \"$host\" = %s ]; then\n  python3 load_balance_proxy_server_example.py", c->host[0]);
    arg(f, "--host 0.0.0.0");
    arg(f, "--port %d", c->o->proxy_port);
    for (int r = 0; r < 2; r++)
        for (int w = 0; w < 2; w++) {
            fprintf(f, " \\\n    %s", flag[r][w]);
            for (int i = 0; i < c->L.n_parts; i++) {
                const struct pd_node_part *x = &c->L.parts[i];
                if (x->role != (enum pd_role)r || x->k)
                    continue;
                if (w == 0)
                    fprintf(f, " %s", c->host[x->node]);
                else
                    fprintf(f, " %d", c->o->base_port + PORT_STEP * x->slot);
            }
        }
    fputs(" &\nfi\n\n", f);
}

/* SGLang: `python3 -m sglang.launch_server` per instance and node. Flag names from SGLang's
 * python/sglang/srt/server_args.py and docs/advanced_features/pd_disaggregation.md. An instance
 * of dp x tp cards is one SGLang server of --tp-size dp x tp with DP attention over dp and expert
 * parallelism over all its cards, as SGLang's DeepSeek deployments run it. */
int pd_emit_stack(enum pd_emit_target t, enum pd_plan_stack *stack, pd_err *e)
{
    const enum pd_plan_stack want = t == PD_EMIT_SGLANG ? PD_STACK_SGLANG : PD_STACK_VLLM;
    if (*stack != PD_STACK_AUTO && *stack != want)
        return pd_err_set(e, PD_EINVAL, "--stack %s: --emit %s launches %s", pd_plan_stack_name(*stack),
                          pd_emit_target_name(t), t == PD_EMIT_SGLANG ? "SGLang" : t == PD_EMIT_PDMOE ? "pdmoe" : "vLLM");
    if (t != PD_EMIT_PDMOE)
        *stack = want;
    return 0;
}

static void sgl_env(FILE *f, const struct pd_emit_ctx *c)
{
    if (!c->ascend)
        return;
    fputs("# SGLang's PD docs, Ascend section: Mooncake on NPUs needs this (and ASCEND_NPU_PHY_ID in the container).\n"
          "export ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE=true\n\n",
          f);
}

/* SGLang's --mem-fraction-static is "the fraction of the memory used for static allocation
 * (model weights and KV cache memory pool)": its KV budget is that fraction of the card less the
 * weights (kv_cache_configurator.py _profile_available_bytes). The plan's usable memory less
 * activations and runtime, over the card's capacity; with SGLang's NPU pools for V4 (kvsize.h),
 * which allocate more than the budget they are sized from, the budget whose pools fit in the plan's
 * KV pool, with the weights, over the capacity. SGLang sizes those pools from the whole budget and
 * makes its request tables after them, outside it; the plan's room for the pools has the tables set
 * aside (kv_transient), so that on the card
 *     weights + pools(fraction x capacity - weights) + tables + activations + runtime <= usable.
 * Unrounded: sgl_fraction writes it. */
static double sgl_fraction_max(const struct pd_plan *p, const struct pd_role_plan *rp)
{
    const struct pd_budget *b = &rp->b;
    /* (the request tables outside the fraction: on GPUs the stock req_to_token, pd_plan_sgl_tables) */
    double f = (double)(b->usable - b->activations - b->runtime - b->kv_tables) / (double)b->capacity;
    if (p->kv.layout == PD_KV_LAYOUT_SGLANG_NPU) {
        const int64_t budget = pd_kv_sgl_budget(&p->kv, pd_budget_seq_room(b), pd_plan_admitted_seqs(p, rp->role),
                                                pd_plan_sgl_extra_slots(p, rp->role));
        f = budget > 0 ? (double)(b->weights + budget) / (double)b->capacity : 0;
    }
    return f > 0 ? f : 0;
}

/* SGLang's NPU pools at fraction f for `reqs` requests a DP rank (kvsize.h). */
static void sgl_npu_pools_at(const struct pd_plan *p, const struct pd_role_plan *rp, double f, int64_t reqs,
                             struct pd_kv_sgl_pools *q)
{
    const int64_t budget = (int64_t)(f * (double)rp->b.capacity) - rp->b.weights;
    pd_kv_sgl_pools(&p->kv, budget, reqs, pd_plan_sgl_extra_slots(p, rp->role), q);
}

/* The sequences of max-model-len a DP rank holds at fraction f, at most `reqs`: with SGLang's NPU
 * pools sized for `reqs` requests, those whose pages its full-token pool holds, at most the
 * requests it keeps slots for; otherwise the KV pool SGLang makes of f (the fraction less the
 * weights, and the blocks the plan sets aside for the chunks in flight: counted in the plan's
 * layout, docs/memory-model.md) over a sequence's bytes. */
static int64_t sgl_holds(const struct pd_plan *p, const struct pd_role_plan *rp, double f, int64_t reqs)
{
    int64_t n;
    if (p->kv.layout == PD_KV_LAYOUT_SGLANG_NPU) {
        struct pd_kv_sgl_pools q;
        sgl_npu_pools_at(p, rp, f, reqs, &q);
        const int64_t P = p->kv.sgl.page, seq = (p->o.max_model_len + P - 1) / P * P;
        n = q.full / seq < q.reqs ? q.full / seq : q.reqs;
    } else {
        const int64_t pool = (int64_t)(f * (double)rp->b.capacity) - rp->b.weights -
                             (rp->b.kv_transient - rp->b.kv_tables);
        const int64_t seq = pd_kv_seq_bytes(&p->kv, p->o.max_model_len);
        n = pool > 0 && seq > 0 ? pool / seq : 0;
    }
    return n < reqs ? n : reqs;
}

/* The fraction written: sgl_fraction_max rounded down to a hundredth, or to as many more decimals
 * (up to 6) as keep every sequence the plan admits (pd_plan_admitted_seqs). A hundredth of a 64 GB
 * card is 0.69 GB of SGLang's budget: on the seed's prefill cards 0.80 (a budget of 8.72 GB, 874,496
 * full tokens) held 26 sequences of 32,768 where the plan admits 27; 0.8016 holds them. digits: the
 * decimals to print; the value returned is what SGLang parses of them. */
static double sgl_fraction(const struct pd_plan *p, const struct pd_role_plan *rp, int *digits)
{
    const double f = sgl_fraction_max(p, rp);
    const int64_t admitted = pd_plan_admitted_seqs(p, rp->role);
    double x = 0, scale = 10;
    for (int d = 2; d <= 6; d++) {
        char buf[32];
        scale *= 10;
        snprintf(buf, sizeof buf, "%.*f", d, (double)(long long)(f * scale) / scale);
        x = strtod(buf, NULL);
        *digits = d;
        if (sgl_holds(p, rp, x, admitted) >= admitted)
            break;
    }
    return x;
}

/* What a DP rank of a role is launched with: the fraction written (its decimals) and the requests
 * it gets (--max-running-requests / dp): the plan's admitted sequences, unless even the fraction's
 * sixth decimal holds fewer (then those). */
struct sgl_size {
    double fraction;
    int digits;
    int64_t admitted;
};

static void sgl_size(const struct pd_plan *p, const struct pd_role_plan *rp, struct sgl_size *z)
{
    z->fraction = sgl_fraction(p, rp, &z->digits);
    z->admitted = sgl_holds(p, rp, z->fraction, pd_plan_admitted_seqs(p, rp->role));
}

/* What SGLang's NPU pools will be (its "DSV4 pool sizes" log line) and take, said in the script. */
static void sgl_npu_note(FILE *f, const struct pd_emit_ctx *c, const struct pd_role_plan *rp,
                         const struct sgl_size *z)
{
    const struct pd_plan *p = c->p;
    if (p->kv.layout != PD_KV_LAYOUT_SGLANG_NPU)
        return;
    struct pd_kv_sgl_pools q;
    sgl_npu_pools_at(p, rp, z->fraction, z->admitted, &q);
    char a[32], b[32], d[32], t[32];
    const enum pd_units u = PD_UNITS_GB;
    fprintf(f, "# SGLang's DeepSeek-V4 NPU pools at this --mem-fraction-static (a budget of %s): full=%lld swa=%lld\n"
               "# c4=%lld c128=%lld tokens, %lld requests; in bf16 they take %s, and its request tables (%lld slots\n"
               "# of %lld tokens) %s, of the %s the plan leaves for KV\n"
               "# (SGLang sizes them at %.2f B per token, fp8 entries: docs/memory-model.md).\n",
            pd_units_fmt(a, sizeof a, (int64_t)(z->fraction * (double)rp->b.capacity) - rp->b.weights, u),
            (long long)q.full, (long long)q.swa, (long long)q.c4, (long long)q.c128, (long long)q.reqs,
            pd_units_fmt(b, sizeof b, q.bytes, u), (long long)(p->o.max_num_seqs + pd_plan_sgl_extra_slots(p, rp->role) + 1),
            (long long)pd_plan_sgl_row_tokens(p), pd_units_fmt(t, sizeof t, rp->b.kv_tables, u),
            pd_units_fmt(d, sizeof d, rp->b.kv_pool, u), p->kv.sgl.bytes_per_full_token);
}

static void sgl_part(FILE *f, const struct pd_emit_ctx *c, const struct pd_node_part *x)
{
    const struct pd_plan *p = c->p;
    const struct pd_role_plan *rp = &p->role[x->role];
    int s = PORT_STEP * x->slot, cards = rp->o.dp * rp->o.tp, dp = rp->o.dp;
    struct sgl_size z;
    sgl_size(p, rp, &z);
    comment(f, c, x, "");
    pd_emit_seqs_note(f, c->p, x->role, z.admitted);
    sgl_npu_note(f, c, rp, &z);
    fprintf(f, "if [ \"$host\" = %s ]; then\n  python3 -m sglang.launch_server", c->host[x->node]);
    fputs(" \\\n    --model-path ", f);
    model_word(f, c);
    arg(f, "--host 0.0.0.0");
    arg(f, "--port %d", c->o->base_port + s);
    if (!p->o.aggregated) {   /* aggregated: SGLang's default mode, prefill and decode in one server */
        arg(f, "--disaggregation-mode %s", pd_role_name(x->role));
        arg(f, "--disaggregation-transfer-backend mooncake");
    }
    if (!p->o.aggregated && x->role == PD_ROLE_PREFILL)
        arg(f, "--disaggregation-bootstrap-port %d", SGL_BOOTSTRAP_PORT + s);
    /* the slots the plan counts (plan.h pd_plan_sgl_extra_slots): SGLang's default would follow the
     * --max-running-requests written below, which may be lowered */
    if (!p->o.aggregated && x->role == PD_ROLE_DECODE && rp->b.kv_tables > 0)
        arg(f, "--disaggregation-decode-extra-slots %lld", (long long)pd_plan_sgl_extra_slots(p, x->role));
    arg(f, "--nnodes %d", x->n);
    arg(f, "--node-rank %d", x->k);
    if (x->n > 1)
        arg(f, "--dist-init-addr %s:%d", c->host[x->head], SGL_DIST_INIT_PORT + s);
    arg(f, "--tp-size %d", cards);
    if (dp > 1) {
        arg(f, "--dp-size %d", dp);
        arg(f, "--enable-dp-attention");
    }
    if (cards > 1) {
        arg(f, "--ep-size %d", cards);
        arg(f, "--moe-a2a-backend deepep");
    }
    if (rp->o.redundant > 0) {   /* server_args.py: redundant physical experts, rebalanced by EPLB */
        arg(f, "--ep-num-redundant-experts %d", rp->o.redundant);
        arg(f, "--enable-eplb");
    }
    if (x->card0)
        arg(f, "--base-gpu-id %d", x->card0);
    arg(f, "--mem-fraction-static %.*f", z.digits, z.fraction);
    if (p->kv.layout == PD_KV_LAYOUT_SGLANG_NPU)   /* the pools' page, as overrides.py sets it on NPU */
        arg(f, "--page-size %lld", (long long)p->kv.sgl.page);
    /* Both are instance-wide in SGLang and divided by --dp-size under DP attention
     * (server_args.py _handle_data_parallelism; the scheduler's per-worker request limit), while
     * vLLM's --max-num-seqs and --max-num-batched-tokens are per data-parallel rank. */
    arg(f, "--max-running-requests %lld", (long long)z.admitted * dp);
    arg(f, "--context-length %lld", (long long)p->o.max_model_len);
    if (x->role == PD_ROLE_PREFILL || p->o.aggregated)
        arg(f, "--chunked-prefill-size %lld", (long long)p->o.max_num_batched_tokens * dp);
    /* MTP as the plan's TPOT assumes it: SGLang runs DeepSeek's MTP layer as EAGLE, a chain of
     * k steps with top-1 drafts and k + 1 tokens verified (server_args.py; its DeepSeek-V4-Flash
     * Ascend test passes --speculative-num-steps 2 --speculative-num-draft-tokens 3), on both
     * sides of a PD pair as its PD examples do. */
    if (p->mtp.k > 0) {
        arg(f, "--speculative-algorithm EAGLE");
        arg(f, "--speculative-num-steps %d", p->mtp.k);
        arg(f, "--speculative-eagle-topk 1");
        arg(f, "--speculative-num-draft-tokens %d", p->mtp.k + 1);
    }
    if (c->ascend) {
        arg(f, "--device npu");
        if (c->w8a8)   /* SGLang's Ascend examples load msmodelslim checkpoints so */
            arg(f, "--quantization modelslim");
        /* DeepSeek-V4 runs SGLang's dsv4 backend on NPU too (overrides.py; its Ascend V4 test) */
        arg(f, "--attention-backend %s", p->model.arch == PD_ARCH_DEEPSEEK_V4 ? "dsv4" : "ascend");
    }
    fputs(" &\nfi\n\n", f);
}

/* sglang-router (docs/advanced_features/router.md): --prefill URL [BOOTSTRAP_PORT] per prefill
 * instance, --decode URL per decode instance. */
static void sgl_router(FILE *f, const struct pd_emit_ctx *c)
{
    fprintf(f, "# router on %s: sglang-router, each prefill instance with its bootstrap port\n", c->host[0]);
    fprintf(f, "if [ \"$host\" = %s ]; then\n  python3 -m sglang_router.launch_router", c->host[0]);
    if (c->p->o.aggregated) {   /* router.md: --worker-urls, the regular (non-PD) mode */
        fputs(" \\\n    --worker-urls", f);
        for (int i = 0; i < c->L.n_parts; i++)
            if (!c->L.parts[i].k)
                fprintf(f, " http://%s:%d", c->host[c->L.parts[i].node], c->o->base_port + PORT_STEP * c->L.parts[i].slot);
        arg(f, "--host 0.0.0.0");
        arg(f, "--port %d", c->o->proxy_port);
        fputs(" &\nfi\n\n", f);
        return;
    }
    arg(f, "--pd-disaggregation");
    for (int i = 0; i < c->L.n_parts; i++) {
        const struct pd_node_part *x = &c->L.parts[i];
        int s = PORT_STEP * x->slot;
        if (x->k)
            continue;
        if (x->role == PD_ROLE_PREFILL)
            arg(f, "--prefill http://%s:%d %d", c->host[x->node], c->o->base_port + s, SGL_BOOTSTRAP_PORT + s);
        else
            arg(f, "--decode http://%s:%d", c->host[x->node], c->o->base_port + s);
    }
    arg(f, "--host 0.0.0.0");
    arg(f, "--port %d", c->o->proxy_port);
    fputs(" &\nfi\n\n", f);
}

/* A W8A8 (or W4A8) plan on Ascend loads an int8 checkpoint nobody can name for the user: the
 * script requires MODEL_PATH, and says where the known ones come from. */
static void model_env(FILE *f, const struct pd_emit_ctx *c, enum pd_emit_target t)
{
    int v4flash = strstr(c->model, "DeepSeek-V4-Flash") != NULL;
    const char *q = c->w4a8 ? "W4A8" : "W8A8";
    if (c->w4a8)
        fprintf(f, "# The plan is W4A8: the servers load an int8 conversion of %s with int4 routed experts\n"
                   "# (msmodelslim's output%s), with %s.\n", c->model,
                v4flash ? "; ModelScope's DeepSeek-V4-Flash-w4a8-mtp is one" : "",
                t == PD_EMIT_VLLM_ASCEND ? "--quantization ascend" : "--quantization modelslim");
    else
        fprintf(f, "# The plan is W8A8: the servers load an int8 conversion of %s (msmodelslim's\n"
                   "# output%s), with %s.\n", c->model,
                v4flash ? "; vllm-ascend's DeepSeek-V4-Flash tutorial downloads DeepSeek-V4-Flash-w8a8-mtp" : "",
                t == PD_EMIT_VLLM_ASCEND ? "--quantization ascend" : "--quantization modelslim");
    /* the message as one quoted word: the model's name is never expanded by the shell */
    char msg[640];
    snprintf(msg, sizeof msg, "set MODEL_PATH to the %s (msmodelslim) checkpoint of %s%s%s", q, c->model,
             v4flash ? ", e.g. DeepSeek-V4-Flash-" : "", v4flash ? (c->w4a8 ? "w4a8-mtp" : "w8a8-mtp") : "");
    fputs("[ -n \"${MODEL_PATH:-}\" ] || { echo ", f);
    pd_emit_sh_word(f, msg);
    fputs(" >&2; exit 2; }\n\n", f);
}

int pd_emit_check_text(const struct pd_emit_ctx *c, pd_err *e)
{
    const struct pd_plan *p = c->p;
    const struct { const char *text, *what; } t[] = {
        {c->model, c->o->model_path && *c->o->model_path ? "--served-model-path" : p->o.checkpoint ? "--checkpoint"
                                                                                                   : "--model"},
        {p->model.name, "the model's name"},
        {p->hw.name, "the hardware file's name"},
        {p->hw.card_name, "the hardware file's card.name"},
        {c->o->command ? c->o->command : "", "the command line"},
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        for (const char *q = t[i].text; q && *q; q++)
            if ((unsigned char)*q < 0x20 || *q == 0x7f)
                return pd_err_set(e, PD_EINVAL, "%s: has a control character (0x%02X), which would end a comment line "
                                  "of the launch script and run the rest as a command", t[i].what, (unsigned char)*q);
    return 0;
}

/* Cards without FP8 units cannot load FP8 or FP4 weights (the hardware file says which). */
int pd_emit_check_fits(const struct pd_plan *p, pd_err *e)
{
    for (int r = 0; r < 2; r++) {
        const struct pd_role_plan *rp = &p->role[r];
        char over[40];
        if (!rp->b.fits_weights) {
            const char *what = pd_budget_overflow(&rp->b);
            return pd_err_set(e, PD_EINVAL, "%s: the %s do not fit a card (%s over its usable memory)%s; "
                              "nothing to launch", pd_role_name((enum pd_role)r), what,
                              pd_units_fmt(over, sizeof over, -rp->b.kv_pool, PD_UNITS_GB),
                              strcmp(what, "weights and activations") ? ""
                              : ": lower --max-num-seqs or --max-num-batched-tokens");
        }
        if (!rp->fits)
            return pd_err_set(e, PD_EINVAL, "%s: not one sequence of --max-model-len %lld fits a card's KV pool; "
                              "lower --max-model-len", pd_role_name((enum pd_role)r), (long long)p->o.max_model_len);
    }
    return 0;
}

/* Redundant expert slots need a serving stack that holds them (hardware file field). */
static int check_redundant(const struct pd_plan *p, pd_err *e)
{
    for (int r = 0; r < 2; r++)
        if (p->role[r].o.redundant > 0 && !p->hw.redundant_experts)
            return pd_err_set(e, PD_EINVAL, "--%s redundant=%d: %s's serving stack has no redundant experts "
                              "(hardware file field redundant_experts: %s)", pd_role_name((enum pd_role)r),
                              p->role[r].o.redundant, p->hw.name, p->hw.source);
    return 0;
}

int pd_emit_layout(struct pd_emit_ctx *c, pd_err *e)
{
    int rc = pd_nodes_build(c->p, &c->L, e);
    return rc ? rc : hosts_build(c, e);
}

void pd_emit_ctx_free(struct pd_emit_ctx *c)
{
    pd_nodes_free(&c->L);
    free(c->host);
    free(c->placeholder);
}

int pd_emit_check_async(const struct pd_plan_opts *o, int emit, enum pd_emit_target t, pd_err *e)
{
    if (emit && t == PD_EMIT_PDMOE && o->no_async_scheduling)
        return pd_err_set(e, PD_EINVAL, "--no-async-scheduling: vLLM's flag; pdmoe's servers have no such flag "
                          "(their scheduler runs one step at a time)");
    return pd_plan_check_async(o, e);
}

char *pd_emit(const struct pd_plan *p, enum pd_emit_target t, const struct pd_emit_opts *o, pd_err *e)
{
    struct pd_emit_opts defaults;
    if (!o) {
        pd_emit_opts_default(&defaults);
        o = &defaults;
    }
    if (pd_emit_check_async(&p->o, 1, t, e))
        return NULL;
    if (t == PD_EMIT_PDMOE)
        return pd_emit_pdmoe(p, o, e);
    struct pd_emit_ctx c = {.p = p, .o = o};
    c.model = o->model_path && *o->model_path ? o->model_path : pd_emit_model_path(p);
    c.ascend = pd_hardware_is_ascend(&p->hw);
    c.w8a8 = c.ascend && !p->inv.from_checkpoint && p->quant.linear == PD_FMT_W8A8;
    c.w4a8 = c.w8a8 && p->quant.group_fmt[PD_G_ROUTED_EXPERTS] == PD_FMT_W4A8;
    c.model_var = c.w8a8 && !(o->model_path && *o->model_path);
    if (pd_emit_check_text(&c, e))
        return NULL;
    if (t == PD_EMIT_VLLM_ASCEND && !c.ascend) {
        pd_err_set(e, PD_EINVAL, "--emit vllm-ascend: %s has %s cards, not Ascend NPUs (use --emit sglang)",
                   p->hw.name, p->hw.card_name);
        return NULL;
    }
    char *buf = NULL;
    size_t len = 0;
    FILE *f = NULL;
    if (pd_emit_layout(&c, e) || check_ports(&c, t, e) || check_redundant(p, e) || pd_emit_check_fits(p, e) ||
        pd_plan_formats_servable(p, e) || check_kv_dtype(p, t, e))
        goto done;
    /* vllm-ascend's Mooncake connectors (MooncakeConnectorWorker, in mooncake_connector.py and
     * mooncake_hybrid_connector.py) raise at start when the prefill's tensor-parallel size is
     * smaller than the decode's: such a script would never start */
    const int ptp = p->o.role[PD_ROLE_PREFILL].tp, dtp = p->o.role[PD_ROLE_DECODE].tp;
    if (t == PD_EMIT_VLLM_ASCEND && !p->o.aggregated && ptp < dtp) {
        pd_err_set(e, PD_EINVAL, "--emit vllm-ascend: prefill tp=%d is smaller than decode tp=%d, which vllm-ascend's "
                   "Mooncake connectors refuse at start (the prefill's tensor-parallel size must be at least the "
                   "decode's)", ptp, dtp);
        goto done;
    }
    f = open_memstream(&buf, &len);
    if (!f) {
        pd_err_set(e, PD_ENOMEM, "out of memory");
        goto done;
    }
    pd_emit_header(f, &c, t);
    if (p->o.aggregated && t == PD_EMIT_VLLM_ASCEND)
        fprintf(f, "# Copy this file to every node and run `sh FILE HOST` there, HOST being the node's name\n"
                   "# below: it starts that node's servers in the background and waits. Each aggregated instance\n"
                   "# serves requests itself (no proxy). What each flag comes from: pdmoe's docs/emit.md.\n");
    else
        fprintf(f, "# Copy this file to every node and run `sh FILE HOST` there, HOST being the node's name\n"
                   "# below: it starts that node's servers in the background and waits. The %s listens on\n"
                   "# %s:%d. What each flag comes from and what is left to fill in: pdmoe's docs/emit.md.\n",
                t == PD_EMIT_SGLANG ? "router" : "proxy", c.host[0], o->proxy_port);
    pd_emit_dispatch(f, &c);
    if (t == PD_EMIT_VLLM_ASCEND)
        vllm_env(f);
    else
        sgl_env(f, &c);
    if (c.model_var)
        model_env(f, &c, t);
    else if (!c.ascend && !p->inv.from_checkpoint) {
        /* SGLang on GPUs serves the model as released (DeepSeek-V4: FP8, routed experts FP4;
         * DeepSeek-V3: FP8 throughout): the plan must have sized those weights, or its pools and
         * batches are another deployment's */
        const int v4 = p->model.arch == PD_ARCH_DEEPSEEK_V4;
        const enum pd_fmt routed = pd_plan_group_fmt(p, PD_G_ROUTED_EXPERTS);
        if (!(p->quant.linear == PD_FMT_FP8 && routed == (v4 ? PD_FMT_FP4 : PD_FMT_FP8))) {
            char q[96];
            fprintf(f, "# The plan sized %s weights; SGLang loads %s in the formats it was released in\n"
                       "# (%s). Plan with those formats (%s, or --checkpoint DIR of the release) for pools and\n"
                       "# batches sized on what runs; the KV pools here assume --kv-cache-dtype %s.\n\n",
                    pd_quant_describe(&p->quant, q, sizeof q), c.model,
                    v4 ? "DeepSeek-V4: FP8, routed experts FP4" : "DeepSeek-V3: FP8 throughout",
                    v4 ? "--quantization fp8 --quant-override routed_experts=fp4" : "--quantization fp8",
                    pd_kv_dtype_name(p->kv.dtype));
        }
    }
    for (int i = 0; i < c.L.n_parts; i++)
        (t == PD_EMIT_VLLM_ASCEND ? vllm_part : sgl_part)(f, &c, &c.L.parts[i]);
    if (t == PD_EMIT_VLLM_ASCEND)
        vllm_proxy(f, &c);
    else
        sgl_router(f, &c);
    fputs("wait\n", f);
    if (fclose(f)) {
        free(buf);
        buf = NULL;
        pd_err_set(e, PD_ENOMEM, "out of memory");
    }
done:
    pd_emit_ctx_free(&c);
    return buf;
}

/* `pdmoe plan`: argument parsing and output of a deployment plan. */
#include "cli/cli.h"
#include "core/units.h"
#include "plan/emit.h"
#include "plan/html.h"
#include "plan/perf.h"
#include "plan/validate.h"
#include "plan/plan.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *help =
    "usage: pdmoe plan [options]\n"
    "With no options: the seed article's deployment of DeepSeek-V4-Flash on 8 Atlas 800I A2 servers\n"
    "(prefill 4 instances of EP8, decode 1 instance of EP32, W8A8).\n\n"
    "  --model NAME|FILE|DIR        preset (deepseek-v4-flash, deepseek-v4-flash-0731, seed-v4-flash,\n"
    "                               v4-flash-mini, v4-tiny, deepseek-v3), a config .json, or a checkpoint\n"
    "                               directory\n"
    "  --hardware NAME|FILE         atlas-800i-a2 (default), atlas-800i-a3, h800, h100, h200, b200, a .json,\n"
    "                               or NAME for hardware/NAME.json on disk (e.g. from pdmoe calibrate)\n"
    "  --checkpoint DIR             take the weight inventory from DIR's safetensors headers\n"
    "  --prefill dp=N,tp=N,instances=N[,redundant=R]   default dp=8,tp=1,instances=4\n"
    "  --decode  dp=N,tp=N,instances=N[,redundant=R]   default dp=32,tp=1,instances=1\n"
    "  --aggregated dp=N,tp=N,instances=N[,redundant=R]   instead, colocated instances that prefill and decode\n"
    "                               (chunked prefill: a step holds the decode tokens and a prompt chunk, up to\n"
    "                               --max-num-batched-tokens); budgeted for both (docs/perf-model.md, \"Aggregated\")\n"
    "  --nodes N                    cluster size in nodes (default: the hardware file's, 8)\n"
    "  --gpu-memory-utilization F   fraction of each card's memory to use, (0, 1]; default 0.9\n"
    "  --max-num-seqs N             sequences per data-parallel rank; default 30\n"
    "  --max-model-len N            tokens per sequence; default 32768 (k = 1000, K = 1024 allowed)\n"
    "  --max-num-batched-tokens N   tokens in one prefill step; default 4096\n"
    "  --quantization w8a8|w4a8|fp8|fp4|bf16   format of linear-layer weights (vLLM's name; --quant too);\n"
    "                               default w8a8; w4a8: routed experts int4 per channel, the rest w8a8\n"
    "  --quant-override G=F,...     per-group format, e.g. routed_experts=fp4 (groups: embedding, lm_head,\n"
    "                               attention, compressor_indexer, shared_expert, dense_ffn, router, norms_mhc,\n"
    "                               mtp, routed_experts)\n"
    "  --kv-cache-dtype fp8|bf16|auto  default auto: what the stacks store for the model on these cards (a\n"
    "                               model with an indexer, as V4: fp8 on cards with FP8, bf16 on Ascend\n"
    "                               910B/910C, where vllm-ascend keeps it bf16; other models bf16)\n"
    "  --stack vllm|sglang          whose KV layout a bf16 V4 cache on Ascend cards is counted in: vllm-ascend's\n"
    "                               block ids (default) or SGLang's NPU pools (--emit sglang implies it)\n"
    "  --no-async-scheduling        vLLM's: one step in flight at a time, not two (async scheduling, its default):\n"
    "                               the window and state blocks held past a sequence's processed tokens, for the\n"
    "                               chunks of a prompt and the steps of a decode; --emit vllm-ascend passes it;\n"
    "                               refused with SGLang (--stack sglang, --emit sglang) and --emit pdmoe\n"
    "  --kv-bytes-per-token N       a flat KV size instead of the architecture's (the seed uses 44000)\n"
    "  --mtp on|off                 load the MTP layer (default: on when the model has one)\n"
    "  --speculative-config JSON    vLLM's '{\"method\":\"mtp\",\"num_speculative_tokens\":K}': K draft tokens per\n"
    "                               decode step (default 1 with the MTP layer, or as many as the acceptance below)\n"
    "  --mtp-acceptance A1[,A2,...] acceptance of each draft position given the ones before it (one value: every\n"
    "                               position's), instead of the hardware file's mtp_acceptance\n"
    "  --spec-stats FILE            the acceptance measured by the engine: pdmoe generate --spec-stats FILE, or a\n"
    "                               scrape of pdmoe serve's (or vLLM's) /metrics with its spec_decode counters\n"
    "  --expert-stats FILE          tokens routed per layer and expert (pdmoe generate --expert-stats): the\n"
    "                               prediction's MoE imbalance measured on each placement, not the hardware file's\n"
    "  --expert-stats-prefill FILE, --expert-stats-decode FILE   the same for one role (e.g. the proxy's\n"
    "                               GET /expert_stats?role=prefill and ?role=decode)\n"
    "  --runtime-overhead-prefill B, --runtime-overhead-decode B   bytes, e.g. 1.5GB or 2GiB\n"
    "  --handoff-tokens N,N,...     prompt lengths for the KV hand-off table; default 8000,131072\n"
    "  --sweep                      add the EP-size decision tree of each role\n"
    "  --inventory                  list every tensor (name, class, group, format, shape, bytes) and exit\n"
    "  --json                       the plan as JSON (plan_version 1)\n"
    "  --units gb|gib               GB = 10^9 bytes (default) or GiB = 2^30 bytes\n"
    "  --isl N, --osl N             add the performance model's prediction for prompts of N and outputs of M\n"
    "                               tokens: TTFT (prefill + KV hand-off + first step), TPOT, tokens/s per card\n"
    "                               per role, rate-matched throughput, binding resources (docs/perf-model.md);\n"
    "                               N + M at most --max-model-len and the model's max_position_embeddings\n"
    "  --request-rate R             ... and TTFT with the queueing delay at R requests/s\n"
    "  --concurrency C              ... and a closed loop of C clients, each sending its next request when its\n"
    "                               last one finishes (vLLM's --max-concurrency at an infinite rate): TTFT, TPOT\n"
    "                               at the batch C implies, requests and output tokens/s; not with --request-rate\n"
    "  --phase random|lockstep      the closed loop's clients: at random phases (default; mean value analysis,\n"
    "                               for requests of varied lengths) or in lockstep (equal requests started\n"
    "                               together, as a benchmark's fixed --input-len/--output-len sends them: the\n"
    "                               loop run step by step: an aggregated plan's ranks, or the prefill and\n"
    "                               decode ranks of a disaggregated one side by side)\n"
    "  --num-prompts N              lockstep: N requests in all (N / C per client; N = C is one wave), the\n"
    "                               run's means and throughput over its duration; default the steady state\n"
    "  --prefill-max-requests N     lockstep: at most N prompts in a step (SGLang's flag); default no cap\n"
    "  --schedule decode-first|prefill-first   lockstep, aggregated: decode tokens first and prompts in the rest of the\n"
    "                               step (default; vLLM's chunked prefill), or steps of prompts only while one\n"
    "                               waits, the decodes paused (SGLang's default)\n"
    "  --prefix-cache-hit F         ... with a share F of prompt tokens served from a prefix cache\n"
    "  --html FILE                  also write a self-contained HTML report (memory bars, expert map)\n"
    "  --emit vllm-ascend|sglang|pdmoe   instead of the plan, the shell script that launches its layout on a\n"
    "                               real cluster: one server command per instance and node, and the proxy\n"
    "                               (router); pdmoe: on CPU hosts, the command lines pdmoe up --plan --hosts runs,\n"
    "                               one per instance (an EP group across hosts is one mpirun); see docs/emit.md\n"
    "  --hosts H0,H1,...            the nodes' addresses for --emit, in order (default: node0, node1, ...)\n"
    "  --served-model-path PATH     what the servers load (default: the --checkpoint directory, the Hugging Face\n"
    "                               repository of a preset, e.g. deepseek-ai/DeepSeek-V4-Flash, else --model;\n"
    "                               pdmoe: a local directory, --checkpoint, --model DIR, or models/mini for\n"
    "                               v4-flash-mini)\n"
    "  --base-port N                HTTP port of the first instance on each node, the next + 10; default 8100\n"
    "                               (not pdmoe's: its ports follow --proxy-port, as pdmoe up --port)\n"
    "  --proxy-port N               port of the proxy (router), on the first prefill node; default 8000\n"
    "  --threads N                  --emit pdmoe: threads of every rank (pdmoe up --threads); default 1\n";

static int parse_role(const char *flag, const char *s, struct pd_role_opts *r)
{
    static const char *const keys[] = {"dp", "tp", "instances", "redundant"};
    int *const dst[] = {&r->dp, &r->tp, &r->instances, &r->redundant};
    int seen[4] = {0};   /* a key twice is a typo, not the last value */
    char buf[128];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *rest = buf, *tok; (tok = strsep(&rest, ","));) {
        char *eq = strchr(tok, '=');
        int64_t v;
        if (!*tok) {
            fprintf(stderr, "pdmoe: %s %s: an empty key=value pair (a comma too many)\n", flag, s);
            return -1;
        }
        if (!eq) {
            fprintf(stderr, "pdmoe: %s %s: expected key=value pairs (dp, tp, instances, redundant)\n", flag, s);
            return -1;
        }
        *eq = 0;
        int k = 0;
        while (k < 4 && strcmp(tok, keys[k]))
            k++;
        if (k == 4) {
            fprintf(stderr, "pdmoe: %s: unknown key \"%s\" (dp, tp, instances, redundant)\n", flag, tok);
            return -1;
        }
        if (seen[k]++) {
            fprintf(stderr, "pdmoe: %s %s: %s given twice\n", flag, s, tok);
            return -1;
        }
        char name[64];
        snprintf(name, sizeof name, "%s %s=", flag, tok);
        if (pd_cli_int(name, eq + 1, dst[k] == &r->redundant ? 0 : 1, &v))
            return -1;
        if (v > 1 << 20) {
            fprintf(stderr, "pdmoe: %s%s: too large\n", name, eq + 1);
            return -1;
        }
        *dst[k] = (int)v;
    }
    /* the role's cards, dp x tp x instances, counted in int as every layout is: each key under
     * 2^20 let their product wrap (a layout of 2^40 cards planned as 0 and said to fit) */
    int64_t cards = (int64_t)(r->dp > 0 ? r->dp : 1) * (r->tp > 0 ? r->tp : 1) * (r->instances > 0 ? r->instances : 1);
    if (cards > 1 << 20) {
        fprintf(stderr, "pdmoe: %s %s: %lld cards (dp x tp x instances); at most %d\n", flag, s, (long long)cards,
                1 << 20);
        return -1;
    }
    return 0;
}

static int parse_bytes(const char *flag, const char *s, int64_t *out)
{
    if (pd_units_parse(s, out)) {
        fprintf(stderr, "pdmoe: %s %s: expected bytes, e.g. 1500000000, 1.5GB or 2GiB\n", flag, s);
        return -1;
    }
    return 0;
}

enum {
    O_SHARED = 256, O_CKPT, O_PREFILL, O_DECODE, O_AGG, O_NODES, O_RTP, O_RTD, O_HAND, O_SWEEP, O_INV, O_JSON, O_HTML,
    O_EMIT, O_HOSTS, O_MPATH, O_BPORT, O_PPORT, O_THREADS, O_PHASE, O_NPROMPTS, O_PMR, O_SCHED, O_NOASYNC, O_HELP
};

/* --hosts a,b,c: a malloc'ed array of pointers into one malloc'ed copy of the list. */
static int parse_hosts(const char *s, char **copy, const char ***hosts, int *n)
{
    *copy = strdup(s);
    int cap = 1;
    for (const char *q = s; *q; q++)
        cap += *q == ',';
    *hosts = calloc((size_t)cap, sizeof **hosts);
    if (!*copy || !*hosts) {
        fprintf(stderr, "pdmoe plan: out of memory\n");
        return -1;
    }
    *n = 0;
    for (char *t = *copy, *comma;; t = comma + 1) {
        comma = strchr(t, ',');
        if (comma)
            *comma = 0;
        (*hosts)[(*n)++] = t;
        if (!comma)
            break;
    }
    return 0;
}

static int parse_port(const char *flag, const char *s, int *port)
{
    int64_t v;
    if (pd_cli_int(flag, s, 1, &v))
        return -1;
    if (v > 65535) {
        fprintf(stderr, "pdmoe: %s %s: a port is at most 65535\n", flag, s);
        return -1;
    }
    *port = (int)v;
    return 0;
}

int pd_cli_plan(int argc, char **argv)
{
    static const struct option opts[] = {
        {"model", 1, 0, O_SHARED}, {"hardware", 1, 0, O_SHARED}, {"checkpoint", 1, 0, O_CKPT},
        {"prefill", 1, 0, O_PREFILL}, {"decode", 1, 0, O_DECODE}, {"aggregated", 1, 0, O_AGG}, {"nodes", 1, 0, O_NODES},
        {"gpu-memory-utilization", 1, 0, O_SHARED}, {"max-num-seqs", 1, 0, O_SHARED}, {"max-model-len", 1, 0, O_SHARED},
        {"max-num-batched-tokens", 1, 0, O_SHARED}, {"quant", 1, 0, O_SHARED}, {"quantization", 1, 0, O_SHARED},
        {"quant-override", 1, 0, O_SHARED},
        {"kv-cache-dtype", 1, 0, O_SHARED}, {"stack", 1, 0, O_SHARED}, {"kv-bytes-per-token", 1, 0, O_SHARED}, {"mtp", 1, 0, O_SHARED}, {"speculative-config", 1, 0, O_SHARED},
        {"spec-stats", 1, 0, O_SHARED}, {"mtp-acceptance", 1, 0, O_SHARED},
        {"expert-stats", 1, 0, O_SHARED}, {"expert-stats-prefill", 1, 0, O_SHARED},
        {"expert-stats-decode", 1, 0, O_SHARED}, {"isl", 1, 0, O_SHARED}, {"osl", 1, 0, O_SHARED}, {"request-rate", 1, 0, O_SHARED},
        {"concurrency", 1, 0, O_SHARED}, {"prefix-cache-hit", 1, 0, O_SHARED}, {"html", 1, 0, O_HTML}, {"runtime-overhead-prefill", 1, 0, O_RTP}, {"runtime-overhead-decode", 1, 0, O_RTD},
        {"handoff-tokens", 1, 0, O_HAND}, {"sweep", 0, 0, O_SWEEP}, {"inventory", 0, 0, O_INV},
        {"json", 0, 0, O_JSON}, {"units", 1, 0, O_SHARED}, {"emit", 1, 0, O_EMIT}, {"hosts", 1, 0, O_HOSTS},
        {"served-model-path", 1, 0, O_MPATH}, {"base-port", 1, 0, O_BPORT}, {"proxy-port", 1, 0, O_PPORT},
        {"threads", 1, 0, O_THREADS}, {"phase", 1, 0, O_PHASE}, {"num-prompts", 1, 0, O_NPROMPTS},
        {"prefill-max-requests", 1, 0, O_PMR}, {"schedule", 1, 0, O_SCHED},
        {"no-async-scheduling", 0, 0, O_NOASYNC}, {"help", 0, 0, O_HELP}, {0, 0, 0, 0},
    };
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    int json = 0, inventory = 0, units = PD_UNITS_GB, c, idx = 0, perf = 0;
    struct pd_workload w;
    pd_workload_default(&w);
    const char *html = NULL;
    int64_t v;
    struct pd_emit_opts eo;
    pd_emit_opts_default(&eo);
    enum pd_emit_target target = PD_EMIT_VLLM_ASCEND;
    const char *emit = NULL, *emit_only = NULL;   /* emit_only: the first flag that needs --emit */
    const char *base_port = NULL, *threads = NULL;   /* the flags of some targets only */
    const char *role_flag = NULL;                    /* --prefill or --decode, given */
    int model_given = 0;                             /* --model, given: else --checkpoint's config */
    char *hosts_copy = NULL;
    const char **hosts = NULL;
    int rc = 2;
    pd_err e = {0};
    struct pd_cli_seen seen = {0};
    optind = 1;
    opterr = 0;
    while ((c = pd_cli_getopt("plan", argc, argv, opts, &idx, NULL, &seen)) != -1) {
        switch (c) {
        case O_SHARED: {
            const char *name = opts[idx].name;
            model_given |= strcmp(name, "model") == 0;
            int r = pd_cli_model_flag(name, optarg, &o, &units);
            if (r == 0) {
                r = pd_cli_workload_flag(name, optarg, &w);
                perf |= r > 0;
            }
            if (r < 0)
                goto out;
            break;
        }
        case O_HTML: html = optarg; break;
        case O_CKPT: o.checkpoint = optarg; break;
        case O_PREFILL: if (parse_role("--prefill", optarg, &o.role[PD_ROLE_PREFILL])) goto out; role_flag = "--prefill"; break;
        case O_DECODE: if (parse_role("--decode", optarg, &o.role[PD_ROLE_DECODE])) goto out; role_flag = "--decode"; break;
        case O_AGG:
            o.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 1, .tp = 1, .instances = 1};
            if (parse_role("--aggregated", optarg, &o.role[PD_ROLE_DECODE]))
                goto out;
            o.aggregated = 1;
            break;
        case O_NODES:
            if (pd_cli_int("--nodes", optarg, 1, &v))
                goto out;
            if (v > 1 << 20) {   /* as a hardware file's cluster_nodes */
                fprintf(stderr, "pdmoe: --nodes %s: at most %d\n", optarg, 1 << 20);
                goto out;
            }
            o.nodes = (int)v;
            break;
        case O_RTP: if (parse_bytes("--runtime-overhead-prefill", optarg, &o.runtime[0])) goto out; break;
        case O_RTD: if (parse_bytes("--runtime-overhead-decode", optarg, &o.runtime[1])) goto out; break;
        case O_HAND: {
            char buf[256];
            snprintf(buf, sizeof buf, "%s", optarg);
            o.n_handoff = 0;
            o.handoff_given = 1;
            /* every entry a length: "1,,2" once dropped the empty one without a word */
            for (char *rest = buf, *t; (t = strsep(&rest, ",")) != NULL;) {
                if (!*t) {
                    fprintf(stderr, "pdmoe: --handoff-tokens %s: an empty entry (expected N,N,...)\n", optarg);
                    goto out;
                }
                if (o.n_handoff == 8) {
                    fprintf(stderr, "pdmoe: --handoff-tokens: at most 8 lengths\n");
                    goto out;
                }
                if (pd_cli_int("--handoff-tokens", t, 1, &o.handoff_tokens[o.n_handoff++]))
                    goto out;
            }
            break;
        }
        case O_SWEEP: o.sweep = 1; break;
        case O_INV: inventory = 1; break;
        case O_JSON: json = 1; break;
        case O_EMIT:
            if (pd_emit_target_parse(optarg, &target, &e)) {
                fprintf(stderr, "pdmoe plan: %s\n", e.msg);
                goto out;
            }
            emit = optarg;
            break;
        case O_HOSTS:
            free(hosts_copy);
            free(hosts);
            if (parse_hosts(optarg, &hosts_copy, &hosts, &eo.n_hosts))
                goto out;
            eo.hosts = hosts;
            emit_only = emit_only ? emit_only : "--hosts";
            break;
        case O_MPATH: eo.model_path = optarg; emit_only = emit_only ? emit_only : "--served-model-path"; break;
        case O_BPORT:
            if (parse_port("--base-port", optarg, &eo.base_port))
                goto out;
            emit_only = emit_only ? emit_only : "--base-port";
            base_port = optarg;
            break;
        case O_PPORT:
            if (parse_port("--proxy-port", optarg, &eo.proxy_port))
                goto out;
            emit_only = emit_only ? emit_only : "--proxy-port";
            break;
        case O_THREADS:
            if (pd_cli_int("--threads", optarg, 1, &v))
                goto out;
            if (v > 4096) {
                fprintf(stderr, "pdmoe plan: --threads %s: at most 4096\n", optarg);
                goto out;
            }
            eo.threads = (int)v;
            emit_only = emit_only ? emit_only : "--threads";
            threads = optarg;
            break;
        case O_PHASE:
            if (strcmp(optarg, "lockstep") != 0 && strcmp(optarg, "random") != 0) {
                fprintf(stderr, "pdmoe plan: --phase %s: expected lockstep or random\n", optarg);
                goto out;
            }
            w.lockstep = strcmp(optarg, "lockstep") == 0;
            perf = 1;
            break;
        case O_NPROMPTS: if (pd_cli_int("--num-prompts", optarg, 1, &w.num_prompts)) goto out; perf = 1; break;
        case O_PMR: if (pd_cli_int("--prefill-max-requests", optarg, 1, &w.prefill_max_requests)) goto out; perf = 1; break;
        case O_SCHED:
            if (strcmp(optarg, "decode-first") != 0 && strcmp(optarg, "prefill-first") != 0) {
                fprintf(stderr, "pdmoe plan: --schedule %s: expected decode-first or prefill-first\n", optarg);
                goto out;
            }
            w.prefill_first = strcmp(optarg, "prefill-first") == 0;
            perf = 1;
            break;
        case O_NOASYNC: o.no_async_scheduling = 1; break;
        case 'h':
        case O_HELP: fputs(help, stdout); rc = 0; goto out;
        default: rc = pd_cli_bad_flag("plan", c, argc, argv); goto out;
        }
    }
    if (pd_cli_no_args("plan", argc, argv))
        goto out;
    if (o.checkpoint && !model_given)
        o.model = NULL;   /* the checkpoint's own config.json */
    if (o.aggregated && role_flag) {
        fprintf(stderr, "pdmoe plan: --aggregated and %s: a layout is aggregated (one set of instances that prefill and "
                        "decode) or disaggregated (--prefill and --decode), not both\n", role_flag);
        goto out;
    }
    if (emit_only && !emit) {
        fprintf(stderr, "pdmoe plan: %s only applies with --emit %s\n", emit_only,
                strcmp(emit_only, "--threads") ? "vllm-ascend|sglang|pdmoe" : "pdmoe");
        goto out;
    }
    if (emit && target == PD_EMIT_PDMOE && base_port) {
        fprintf(stderr, "pdmoe plan: --base-port %s does not apply to --emit pdmoe: its ports follow --proxy-port "
                        "(the proxy on it, instance n on it + 1 + n, KV from it + 100), as pdmoe up --port\n", base_port);
        goto out;
    }
    if (emit && target != PD_EMIT_PDMOE && threads) {
        fprintf(stderr, "pdmoe plan: --threads %s only applies with --emit pdmoe\n", threads);
        goto out;
    }
    if (emit && (json || inventory)) {
        fprintf(stderr, "pdmoe plan: --emit writes a launch script; it does not combine with %s\n",
                json ? "--json" : "--inventory");
        goto out;
    }
    struct pd_plan p;
    if (emit && pd_emit_stack(target, &o.stack, &e)) {
        fprintf(stderr, "pdmoe plan: %s\n", e.msg);
        goto out;
    }
    /* (pd_plan_build and pd_emit refuse these too; here they are flags that do not go together) */
    if (pd_emit_check_async(&o, emit != NULL, target, &e)) {
        fprintf(stderr, "pdmoe plan: %s\n", e.msg);
        goto out;
    }
    if (pd_plan_build(&o, &p, &e)) {
        fprintf(stderr, "pdmoe plan: %s\n", e.msg);
        rc = 1;
        goto out;
    }
    struct pd_perf f;
    if (perf && pd_perf_eval(&p, &w, &f, &e)) {
        fprintf(stderr, "pdmoe plan: %s\n", e.msg);
        pd_plan_free(&p);
        rc = 2;
        goto out;
    }
    rc = 0;
    if (html) {
        char *page = pd_report_html(&p, perf ? &f : NULL, NULL, units, &e);
        if (!page)
            fprintf(stderr, "pdmoe plan: %s\n", e.msg);
        rc = !page || pd_cli_write_file("plan", "--html", html, page) ? 1 : 0;
        free(page);
    }
    if (emit) {
        char *s = pd_emit(&p, target, &eo, &e);
        if (!s) {
            fprintf(stderr, "pdmoe plan: %s\n", e.msg);
            rc = e.code == PD_EINVAL ? 2 : 1;
        } else {
            fputs(s, stdout);
            free(s);
        }
    } else if (inventory) {
        pd_plan_print_inventory(&p, stdout, units);
    } else {
        /* the published runs of this model on these cards, as pdmoe validate judges them */
        char *vt = NULL;
        void *vj = NULL;
        if (perf && pd_validate_vouch(&p, json ? NULL : &vt, json ? &vj : NULL, &e)) {
            fprintf(stderr, "pdmoe plan: %s\n", e.msg);
            pd_plan_free(&p);
            rc = 1;
            goto out;
        }
        char *s = json ? pd_plan_json_ext(&p, perf ? &f : NULL, vj) : pd_plan_text(&p, units);
        char *t = s && perf && !json ? pd_perf_text(&p, &f) : NULL;
        if (!s || (perf && !json && (!t || !vt))) {
            fprintf(stderr, "pdmoe plan: out of memory\n");
            rc = 1;
        } else {
            fputs(s, stdout);
            if (t)
                fputs(t, stdout);
            if (vt)
                fputs(vt, stdout);
            if (json)
                fputc('\n', stdout);
        }
        free(s);
        free(t);
        free(vt);
    }
    pd_plan_free(&p);
out:
    free(hosts_copy);
    free(hosts);
    return rc;
}

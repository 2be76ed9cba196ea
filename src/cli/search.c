/* `pdmoe search`: layout search for a card budget, its Pareto front, the best layout, and
 * optionally its HTML report and launch commands. */
#define _GNU_SOURCE   /* asprintf */
#include "cli/cli.h"
#include "core/units.h"
#include "plan/emit.h"
#include "plan/html.h"
#include "plan/search.h"
#include "plan/validate.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *help =
    "usage: pdmoe search [options]\n"
    "Enumerates prefill and decode layouts (EP size, TP size, instances, decode batch per DP rank) for a\n"
    "number of cards, predicts each with the performance model (docs/perf-model.md), rate-matches prefill\n"
    "and decode, and prints the Pareto front of output tokens/s per card vs tokens/s per user, the best\n"
    "layout per TPOT target, and the chosen layout's plan and prediction.\n\n"
    "  --cards N                    cards to spend (prefill + decode, or the aggregated instances), default 64;\n"
    "                               a search of more than 2^25 prefill x decode layouts (about 4,000 cards)\n"
    "                               is refused, every layout being held (2,048 cards: 20 s, 3 GB)\n"
    "  --isl N, --osl N             prompt and output tokens per request, default 4096 and 1024\n"
    "  --ttft-ms X, --tpot-ms X     targets; layouts missing them are marked, the chosen one meets them\n"
    "  --max-tp N                   largest tensor-parallel size tried (powers of two), default 1\n"
    "  --prefix-cache-hit F         share of prompt tokens served from a prefix cache, [0, 1)\n"
    "  --request-rate R             requests/s the deployment must sustain; TTFT then includes the queueing\n"
    "                               before prefill (M/D/c), and layouts that cannot sustain R miss the targets\n"
    "  --concurrency C              instead, a closed loop of C clients (each sends its next request when its last\n"
    "                               one finishes): every layout's TTFT, TPOT and throughput at the batch C implies,\n"
    "                               the decode batch being its slots per DP rank (--max-num-seqs); not with --request-rate\n"
    "  --model, --hardware, --gpu-memory-utilization, --max-model-len, --max-num-batched-tokens,\n"
    "  --quantization (--quant), --quant-override, --kv-cache-dtype, --stack, --kv-bytes-per-token, --mtp, --speculative-config,\n"
    "  --mtp-acceptance, --spec-stats, --expert-stats,\n"
    "  --expert-stats-prefill, --expert-stats-decode, --units, --no-async-scheduling\n"
    "                               as for pdmoe plan (see pdmoe plan --help)\n"
    "  --json                       the search as JSON (search_version 1)\n"
    "  --html FILE                  write a self-contained HTML report (memory bars, expert map, Pareto chart)\n"
    "  --emit vllm-ascend|sglang|pdmoe   print the chosen layout's launch commands instead of the tables\n"
    "  --layout best|aggregated|disaggregated   the layout the plan, prediction, --html and --emit are for: the\n"
    "                               winner of aggregated vs disaggregated (default), or the best of one kind\n\n"
    "Besides the disaggregated layouts, every aggregated layout (instances that prefill and decode on the same\n"
    "cards, chunked prefill sharing steps with decode) is costed on the same cards, workload and targets; the\n"
    "output compares the best of each and says which wins and by how much (output tokens/s per card).\n";

enum { O_SHARED = 256, O_CARDS, O_TTFT, O_TPOT, O_MAXTP, O_JSON, O_HTML, O_EMIT, O_LAYOUT, O_NOASYNC, O_HELP };

int pd_cli_search(int argc, char **argv)
{
    static const struct option opts[] = {
        {"model", 1, 0, O_SHARED}, {"hardware", 1, 0, O_SHARED}, {"gpu-memory-utilization", 1, 0, O_SHARED},
        {"max-model-len", 1, 0, O_SHARED}, {"max-num-batched-tokens", 1, 0, O_SHARED}, {"quant", 1, 0, O_SHARED}, {"quantization", 1, 0, O_SHARED},
        {"quant-override", 1, 0, O_SHARED}, {"kv-cache-dtype", 1, 0, O_SHARED}, {"stack", 1, 0, O_SHARED}, {"kv-bytes-per-token", 1, 0, O_SHARED},
        {"mtp", 1, 0, O_SHARED}, {"speculative-config", 1, 0, O_SHARED},
        {"spec-stats", 1, 0, O_SHARED}, {"mtp-acceptance", 1, 0, O_SHARED}, {"expert-stats", 1, 0, O_SHARED}, {"expert-stats-prefill", 1, 0, O_SHARED},
        {"expert-stats-decode", 1, 0, O_SHARED}, {"units", 1, 0, O_SHARED}, {"isl", 1, 0, O_SHARED}, {"osl", 1, 0, O_SHARED},
        {"prefix-cache-hit", 1, 0, O_SHARED}, {"request-rate", 1, 0, O_SHARED}, {"concurrency", 1, 0, O_SHARED}, {"cards", 1, 0, O_CARDS}, {"ttft-ms", 1, 0, O_TTFT},
        {"tpot-ms", 1, 0, O_TPOT}, {"max-tp", 1, 0, O_MAXTP}, {"json", 0, 0, O_JSON}, {"html", 1, 0, O_HTML},
        {"emit", 1, 0, O_EMIT}, {"layout", 1, 0, O_LAYOUT}, {"no-async-scheduling", 0, 0, O_NOASYNC},
        {"help", 0, 0, O_HELP}, {0, 0, 0, 0},
    };
    struct pd_search_opts o;
    pd_search_opts_default(&o);
    int json = 0, units = PD_UNITS_GB, c, idx;
    const char *html = NULL, *emit = NULL;
    int64_t v;
    double ms;
    struct pd_cli_seen seen = {0};
    optind = 1;
    opterr = 0;
    while ((c = pd_cli_getopt("search", argc, argv, opts, &idx, NULL, &seen)) != -1) {
        int r;
        switch (c) {
        case O_SHARED:
            r = pd_cli_model_flag(opts[idx].name, optarg, &o.base, &units);
            if (r == 0)
                r = pd_cli_workload_flag(opts[idx].name, optarg, &o.w);
            if (r < 0)
                return 2;
            break;
        case O_CARDS:
            if (pd_cli_int("--cards", optarg, 2, &v))
                return 2;
            if (v > 4096) {
                fprintf(stderr, "pdmoe: --cards %s: at most 4096\n", optarg);
                return 2;
            }
            o.cards = (int)v;
            break;
        case O_TTFT:
        case O_TPOT:
            if (pd_cli_double(c == O_TTFT ? "--ttft-ms" : "--tpot-ms", optarg, &ms))
                return 2;
            if (ms <= 0) {
                fprintf(stderr, "pdmoe: %s %s: must be positive\n", c == O_TTFT ? "--ttft-ms" : "--tpot-ms", optarg);
                return 2;
            }
            *(c == O_TTFT ? &o.ttft_s : &o.tpot_s) = ms / 1e3;
            break;
        case O_MAXTP:
            if (pd_cli_int_max("--max-tp", optarg, 1, 64, &v))
                return 2;
            if (v & (v - 1)) {   /* the sizes tried are powers of two: 3 would have meant 2 */
                fprintf(stderr, "pdmoe search: --max-tp %s: a power of two (1, 2, 4, ... 64), the sizes tried\n", optarg);
                return 2;
            }
            o.max_tp = (int)v;
            break;
        case O_JSON: json = 1; break;
        case O_HTML: html = optarg; break;
        case O_EMIT: emit = optarg; break;
        case O_NOASYNC: o.base.no_async_scheduling = 1; break;
        case O_LAYOUT:
            if (strcmp(optarg, "best") == 0)
                o.pick = PD_PICK_BEST;
            else if (strcmp(optarg, "aggregated") == 0)
                o.pick = PD_PICK_AGGREGATED;
            else if (strcmp(optarg, "disaggregated") == 0)
                o.pick = PD_PICK_DISAGGREGATED;
            else {
                fprintf(stderr, "pdmoe search: --layout %s: expected best, aggregated or disaggregated\n", optarg);
                return 2;
            }
            break;
        case 'h':
        case O_HELP: fputs(help, stdout); return 0;
        default: return pd_cli_bad_flag("search", c, argc, argv);
        }
    }
    if (pd_cli_no_args("search", argc, argv))
        return 2;
    pd_err e = {0};
    enum pd_emit_target target = PD_EMIT_VLLM_ASCEND;
    if (emit && pd_emit_target_parse(emit, &target, &e)) {
        fprintf(stderr, "pdmoe search: %s\n", e.msg);
        return 2;
    }
    if (emit && pd_emit_stack(target, &o.base.stack, &e)) {
        fprintf(stderr, "pdmoe search: %s\n", e.msg);
        return 2;
    }
    /* (pd_plan_build refuses it for SGLang's plans, pd_emit for pdmoe's: before the search here) */
    if (pd_emit_check_async(&o.base, emit != NULL, target, &e)) {
        fprintf(stderr, "pdmoe search: %s\n", e.msg);
        return 2;
    }
    struct pd_search s;
    if (pd_search_run(&o, &s, &e)) {
        fprintf(stderr, "pdmoe search: %s\n", e.msg);
        return 1;
    }
    int rc = 0, pick = s.chose_agg ? (s.best_agg >= 0 ? s.best_agg : s.best_agg_any) : s.best >= 0 ? s.best : s.best_any;
    if (html) {
        if (pick < 0) {
            fprintf(stderr, "pdmoe search: --html %s: no layout fits in memory, nothing to report\n", html);
            rc = 1;
        } else {
            char *page = pd_report_html(&s.plan, &s.perf, &s, units, &e);
            if (!page) {
                fprintf(stderr, "pdmoe search: %s\n", e.msg);
                rc = 1;
            } else if (pd_cli_write_file("search", "--html", html, page)) {
                rc = 1;
            }
            free(page);
        }
    }
    char *out = NULL;
    if (emit) {
        struct pd_emit_opts eo;
        pd_emit_opts_default(&eo);
        eo.command = "pdmoe search";
        if (pick < 0)
            fprintf(stderr, "pdmoe search: --emit: no layout fits in memory on %d cards%s\n", o.cards,
                    s.n_unplaced ? " and on whole nodes (a disaggregated layout keeps decode off the prefill's nodes)" : "");
        else if (!(out = pd_emit(&s.plan, target, &eo, &e)))
            fprintf(stderr, "pdmoe search: %s\n", e.msg);
        rc |= !out;
        const int meets = s.chose_agg ? s.best_agg >= 0 : s.best >= 0;
        if (out && !meets) {   /* said on stderr, and in the script, which may be read alone */
            static const char note[] = "# NOT MEETING THE TARGETS: no layout on these cards meets the TTFT/TPOT targets "
                                       "(and request rate); this is\n# the best one that fits, ignoring them (see "
                                       "`pdmoe search` without --emit).\n";
            fprintf(stderr, "pdmoe search: --emit: no layout meets the targets; the script launches the best one that "
                            "fits, ignoring them\n");
            char *nl = strchr(out, '\n'), *with;   /* after the #! line */
            if (nl && asprintf(&with, "%.*s%s%s", (int)(nl + 1 - out), out, note, nl + 1) >= 0) {
                free(out);
                out = with;
            }
        }
    } else {
        /* the published runs of the model on these cards, for the prediction of the layout chosen */
        char *vt = NULL;
        void *vj = NULL;
        const int predicted = s.n_fit + s.n_agg_fit > 0;
        if (predicted && pd_validate_vouch(&s.plan, json ? NULL : &vt, json ? &vj : NULL, &e)) {
            fprintf(stderr, "pdmoe search: %s\n", e.msg);
            pd_search_free(&s);
            return 1;
        }
        out = json ? pd_search_json_ext(&s, vj) : pd_search_text(&s, units);
        if (out && vt) {
            char *both = NULL;
            if (asprintf(&both, "%s%s", out, vt) < 0)
                both = NULL;
            free(out);
            out = both;
        }
        free(vt);
        if (!out) {
            fprintf(stderr, "pdmoe search: out of memory\n");
            rc = 1;
        }
    }
    if (out) {
        fputs(out, stdout);
        if (json && !emit)
            fputc('\n', stdout);
    }
    free(out);
    pd_search_free(&s);
    return rc;
}

/* `pdmoe bench search`: a full layout search (every prefill and decode layout and decode batch
 * for the card budget, costed and rate-matched, with its Pareto front) against the 1 s target;
 * aiconfigurator's searches take seconds to tens of seconds. */
#include "bench.h"
#include "core/timing.h"
#include "plan/search.h"

#include <math.h>
#include <stdint.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Expert-load counts for --expert-stats, as a server writes them for DeepSeek-V3: one row per layer
 * (`layers`), the first `dense` (dense FFN layers) empty, the others `experts` counts log-normal
 * (sigma 1) from a fixed seed, the skew of a real router's load; the file's path, or NULL. */
static const char *write_stats(char *path, int layers, int dense, int experts)
{
    int fd = mkstemp(path);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f)
        return NULL;
    uint64_t x = 42;
    fprintf(f, "{\"model_type\": \"deepseek_v3\", \"experts\": %d, \"tokens_per_expert\": [", experts);
    for (int l = 0; l < layers; l++) {
        fprintf(f, "%s[", l ? ", " : "");
        for (int i = 0; i < experts; i++) {
            if (l < dense) {
                fprintf(f, "%s0", i ? "," : "");
                continue;
            }
            double g = -6;
            for (int k = 0; k < 12; k++) {
                x = x * 6364136223846793005ULL + 1442695040888963407ULL;
                g += (double)(x >> 11) / 9007199254740992.0;
            }
            fprintf(f, "%s%.0f", i ? "," : "", 1000 * exp(g));
        }
        fprintf(f, "]");
    }
    fprintf(f, "]}\n");
    return fclose(f) ? NULL : path;
}

int pd_bench_search(int argc, char **argv)
{
    int quick, json;
    if (pd_bench_quick_json("search", argc, argv, &quick, &json))
        return 2;
    int reps = quick ? 1 : 5;
    const double target = 1.0;
    char stats[] = "/tmp/pdmoe-bench-stats-XXXXXX";
    const char *measured = write_stats(stats, 61, 3, 256);   /* V3: 61 layers, the first 3 dense */
    if (!measured) {
        fprintf(stderr, "bench search: cannot write %s\n", stats);
        return 1;
    }
    struct { const char *name, *model, *hw, *stats; int cards, max_tp; } cases[] = {
        {"deepseek-v4-flash, 64 x 910B (the seed's cluster)", "deepseek-v4-flash", "atlas-800i-a2", NULL, 64, 1},
        {"deepseek-v4-flash, 64 x 910B, tp up to 8", "deepseek-v4-flash", "atlas-800i-a2", NULL, 64, 8},
        {"deepseek-v3, 64 x H800", "deepseek-v3", "h800", NULL, 64, 1},
        {"deepseek-v3, 256 x H800", "deepseek-v3", "h800", NULL, 256, 1},
        {"deepseek-v3, 256 x H800, --expert-stats (58 MoE layers)", "deepseek-v3", "h800", measured, 256, 1},
    };
    json_t *doc = json ? json_pack("{s:s,s:i,s:i,s:i,s:f,s:[]}", "benchmark", "search", "searches_per_case", reps,
                                   "isl", 4096, "osl", 1024, "target_s", target, "cases")
                       : NULL;
    if (!json) {
        printf("pdmoe bench search: best of %d searches each; isl 4096, osl 1024; target %.0f s per search\n", reps,
               target);
        printf("  %-50s %9s %9s %11s %11s\n", "case", "layouts", "ms", "us/layout", "of target");
    }
    int ok = 1;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct pd_search_opts o;
        pd_search_opts_default(&o);
        o.base.model = cases[i].model;
        o.base.hardware = cases[i].hw;
        o.base.expert_stats = cases[i].stats;
        o.base.max_model_len = 131072;
        o.cards = cases[i].cards;
        o.max_tp = cases[i].max_tp;
        o.ttft_s = 2.0;
        o.tpot_s = 0.05;
        double best = 1e9;
        int n = 0;
        for (int r = 0; r < reps; r++) {
            struct pd_search s;
            pd_err e;
            double t0 = pd_now_s();
            if (pd_search_run(&o, &s, &e)) {
                fprintf(stderr, "bench search: %s\n", e.msg);
                unlink(stats);
                json_decref(doc);
                return 1;
            }
            double t = pd_now_s() - t0;
            n = s.n;
            pd_search_free(&s);
            if (t < best)
                best = t;
        }
        if (doc)
            json_array_append_new(json_object_get(doc, "cases"),
                                  json_pack("{s:s,s:i,s:f,s:f,s:f}", "case", cases[i].name, "layouts", n, "ms",
                                            best * 1e3, "us_per_layout", best * 1e6 / (n ? n : 1), "of_target",
                                            best / target));
        else
            printf("  %-50s %9d %9.1f %11.3f %10.3fx\n", cases[i].name, n, best * 1e3, best * 1e6 / (n ? n : 1),
                   best / target);
        ok &= best < target;
    }
    unlink(stats);
    pd_bench_verdict(doc, ok, "every search is under the target", "a search is OVER the target");
    return 0;
}

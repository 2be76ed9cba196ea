/* `pdmoe bench search`: a full layout search (every prefill and decode layout and decode batch
 * for the card budget, costed and rate-matched, with its Pareto front) against the 1 s target;
 * aiconfigurator's searches take seconds to tens of seconds. */
#include "bench.h"
#include "core/timing.h"
#include "plan/search.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int pd_bench_search(int argc, char **argv)
{
    int reps = argc > 1 && strcmp(argv[1], "--quick") == 0 ? 1 : 5;
    const double target = 1.0;
    struct { const char *name, *model, *hw; int cards, max_tp; } cases[] = {
        {"deepseek-v4-flash, 64 x 910B (the seed's cluster)", "deepseek-v4-flash", "atlas-800i-a2", 64, 1},
        {"deepseek-v4-flash, 64 x 910B, tp up to 8", "deepseek-v4-flash", "atlas-800i-a2", 64, 8},
        {"deepseek-v3, 64 x H800", "deepseek-v3", "h800", 64, 1},
        {"deepseek-v3, 256 x H800", "deepseek-v3", "h800", 256, 1},
    };
    printf("pdmoe bench search: best of %d searches each; isl 4096, osl 1024; target %.0f s per search\n", reps, target);
    printf("  %-50s %9s %9s %11s %11s\n", "case", "layouts", "ms", "us/layout", "of target");
    int ok = 1;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct pd_search_opts o;
        pd_search_opts_default(&o);
        o.base.model = cases[i].model;
        o.base.hardware = cases[i].hw;
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
                return 1;
            }
            double t = pd_now_s() - t0;
            n = s.n;
            pd_search_free(&s);
            if (t < best)
                best = t;
        }
        printf("  %-50s %9d %9.1f %11.3f %10.3fx\n", cases[i].name, n, best * 1e3, best * 1e6 / (n ? n : 1), best / target);
        ok &= best < target;
    }
    printf("%s\n", ok ? "every search is under the target" : "a search is OVER the target");
    return 0;
}

/* `pdmoe bench plan`: time to plan the seed's deployment, with and without the EP-size
 * sweep, against the 1 ms target that keeps a search over thousands of layouts interactive. */
#include "bench.h"
#include "core/timing.h"
#include "plan/plan.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double time_plans(const struct pd_plan_opts *o, int n, int with_json)
{
    double best = 1e9;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = pd_now_s();
        for (int i = 0; i < n; i++) {
            struct pd_plan p;
            pd_err e;
            if (pd_plan_build(o, &p, &e)) {
                fprintf(stderr, "bench plan: %s\n", e.msg);
                exit(1);
            }
            if (with_json)
                free(pd_plan_json(&p, NULL));
            pd_plan_free(&p);
        }
        double t = (pd_now_s() - t0) / n;
        if (t < best)
            best = t;
    }
    return best;
}

int pd_bench_plan(int argc, char **argv)
{
    int quick, json;
    if (pd_bench_quick_json("plan", argc, argv, &quick, &json))
        return 2;
    int n = quick ? 20 : 200;
    const double target = 1e-3;
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    json_t *doc = json ? json_pack("{s:s,s:i,s:f,s:[]}", "benchmark", "plan", "plans_per_run", n, "target_ms",
                                   target * 1e3, "cases")
                       : NULL;
    if (!json) {
        printf("pdmoe bench plan: best of 5 runs of %d plans each; target %.1f ms per plan\n", n, target * 1e3);
        printf("  %-52s %12s %14s\n", "case", "ms / plan", "of target");
    }
    struct { const char *name, *model; int sweep, json; } cases[] = {
        {"seed deployment, deepseek-v4-flash (default)", "deepseek-v4-flash", 0, 0},
        {"seed deployment, deepseek-v4-flash, + JSON", "deepseek-v4-flash", 0, 1},
        {"seed deployment, seed-v4-flash", "seed-v4-flash", 0, 0},
        {"deepseek-v4-flash with --sweep (12 layouts)", "deepseek-v4-flash", 1, 0},
        {"deepseek-v3, same layout", "deepseek-v3", 0, 0},
    };
    int ok = 1;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        o.model = cases[i].model;
        o.sweep = cases[i].sweep;
        double t = time_plans(&o, n, cases[i].json);
        /* (a sweep plans 12 layouts: not held to one plan's target) */
        if (doc)
            json_array_append_new(json_object_get(doc, "cases"),
                                  json_pack("{s:s,s:f,s:f,s:b}", "case", cases[i].name, "ms_per_plan", t * 1e3,
                                            "of_target", t / target, "held_to_target", !cases[i].sweep));
        else
            printf("  %-52s %12.4f %13.2fx\n", cases[i].name, t * 1e3, t / target);
        ok &= cases[i].sweep || t < target;
    }
    pd_bench_verdict(doc, ok, "every single plan is under the target", "a single plan is OVER the target");
    return 0;
}

/* libFuzzer harness for the --expert-stats file ({"tokens_per_expert": [[tokens per expert] per
 * layer]}, as `pdmoe generate --expert-stats` and GET /expert_stats write it): the input, as a
 * file, either is refused with a one-line message naming it, or plans v4-tiny (16 experts) on
 * P 1 x EP2 and D 1 x EP4 with each role's imbalance measured from it: finite and at least 1
 * (the busiest rank over the mean), and finite positive predictions.
 * Seeds in tests/fuzz/seeds/expert_stats/. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/fuzz/fuzz.h"
#include "plan/perf.h"
#include "plan/plan.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[64];
    snprintf(path, sizeof path, "/tmp/pdmoe-fuzz-stats-%d.json", (int)getpid());
    FILE *f = fopen(path, "wb");
    CHECK(f);
    CHECK(fwrite(data, 1, size, f) == size);
    fclose(f);
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.model = "v4-tiny";
    o.hardware = "h100";
    o.max_model_len = 1024;
    o.role[0] = (struct pd_role_opts){.dp = 2, .tp = 1, .instances = 1};
    o.role[1] = (struct pd_role_opts){.dp = 4, .tp = 1, .instances = 1};
    o.expert_stats = path;
    struct pd_plan p;
    pd_err e = {0};
    int rc = pd_plan_build(&o, &p, &e);
    unlink(path);
    if (rc) {
        CHECK(rc == PD_EINVAL || rc == PD_EFORMAT || rc == PD_ENOMEM);
        CHECK(e.code == rc && strstr(e.msg, path) && !strchr(e.msg, '\n'));
        return 0;
    }
    for (int r = 0; r < 2; r++) {
        CHECK(p.load[r]);
        CHECK(isfinite(p.role[r].imbalance) && p.role[r].imbalance >= 1 - 1e-9);
        CHECK(p.role[r].imbalance <= p.role[r].ep + 1e-9);   /* at most everything on one rank */
    }
    struct pd_workload w;
    pd_workload_default(&w);
    w.isl = 512;   /* within max-model-len and the model's positions, which predictions require */
    w.osl = 128;
    struct pd_perf pf;
    rc = pd_perf_eval(&p, &w, &pf, &e);
    CHECK(rc == 0);
    CHECK(isfinite(pf.ttft_s) && pf.ttft_s > 0);
    CHECK(isfinite(pf.tpot_s) && pf.tpot_s > 0);
    CHECK(isfinite(pf.req_s) && pf.req_s >= 0);
    pd_plan_free(&p);
    return 0;
}

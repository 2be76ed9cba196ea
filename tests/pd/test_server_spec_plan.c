/* A speculative server's /metrics is the planner's input: a scrape of `pdmoe serve
 * --speculative-config` after a few requests, read by pd_mtp_stats_load (plan --spec-stats FILE),
 * gives the per-position acceptance whose tokens per step is 1 + the sum over positions of
 * accepted / drafts, the counters' own figure; a plan of the same checkpoint predicts with it. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../tmpmodel.h"
#include "pd/server.h"
#include "plan/mtp.h"
#include "plan/perf.h"
#include "plan/plan.h"
#include "util.h"

static char dir[64];

static void setup(void)
{
    tmp_model_agree("v4-tiny", 6, 0.7, dir, sizeof dir);
}

static void teardown(void)
{
    rm_model(dir);
}

TestSuite(server_spec_plan, .init = setup, .fini = teardown, .timeout = 120);

Test(server_spec_plan, metrics_scrape_feeds_the_plan)
{
    pd_err e = {0};
    struct pd_server *s;
    struct pd_server_opts o = {.model_dir = dir, .threads = 1, .max_num_seqs = 4, .max_model_len = 512,
                               .served_name = "tiny", .spec_k = 2};
    cr_assert_eq(pd_server_create(&o, &s, &e), 0, "%s", e.msg);
    int port = pd_server_port(s);
    pthread_t loop;
    pthread_create(&loop, NULL, run_server, s);
    char body[256], out[1 << 14];
    for (int i = 0; i < 3; i++) {
        snprintf(body, sizeof body, "{\"model\":\"tiny\",\"prompt\":\"request %d: the sea\",\"max_tokens\":32,"
                 "\"temperature\":0,\"ignore_eos\":true}", i);
        cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    }
    static char metrics[1 << 16];
    cr_assert_eq(curl_port(port, "/metrics", NULL, NULL, metrics, sizeof metrics), 200);
    double drafts = (double)metric_key(port, "pdmoe_spec_decode_num_drafts_total"), tps = 1;
    for (int j = 0; j < 2; j++) {
        char key[128];
        snprintf(key, sizeof key, "pdmoe_spec_decode_num_accepted_tokens_per_pos_total{position=\"%d\"}", j);
        tps += (double)metric_key(port, key) / drafts;
    }
    pd_server_stop(s);
    pthread_join(loop, NULL);
    pd_server_destroy(s);
    cr_assert_gt(drafts, 0);
    cr_assert_gt(tps, 1.5, "agreement 0.7: %g tokens per step", tps);

    char path[] = "/tmp/pdmoe-metrics-XXXXXX";
    tmp_text(path, metrics);
    struct pd_mtp m;
    cr_assert_eq(pd_mtp_stats_load(path, &m, &e), 0, "%s", e.msg);
    cr_assert_eq(m.k, 2);
    cr_assert_float_eq(pd_mtp_tokens_per_step(&m), tps, 1e-12);

    struct pd_plan_opts po;
    pd_plan_opts_default(&po);
    po.model = dir;
    po.hardware = "h100";
    po.nodes = 1;
    po.max_model_len = 512;
    po.role[0] = po.role[1] = (struct pd_role_opts){.dp = 1, .tp = 1, .instances = 1};
    po.spec_stats = path;
    struct pd_plan p;
    cr_assert_eq(pd_plan_build(&po, &p, &e), 0, "%s", e.msg);
    struct pd_workload w;
    pd_workload_default(&w);
    w.isl = 16;
    w.osl = 32;
    struct pd_perf f;
    cr_assert_eq(pd_perf_eval(&p, &w, &f, &e), 0, "%s", e.msg);
    cr_assert_eq(f.mtp.k, 2);
    cr_assert_float_eq(f.tokens_per_step, tps, 1e-12);
    cr_assert_float_eq(f.tpot_s, f.decode_step.total_s / tps, 1e-12);
    pd_plan_free(&p);
    unlink(path);
}

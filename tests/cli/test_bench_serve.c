/* `pdmoe bench serve` against a real server: vLLM's flag names, --max-concurrency holding the
 * requests in flight to C, --json, and an endpoint that cannot be reached named as such instead
 * of tables of nan. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "../tmpmodel.h"
#include "proxy/proxy.h"
#include "pd/server.h"
#include "../pd/util.h"

static char dir[64];
static struct node srv;

static void pd_instance(struct node *n, int role)
{
    node_start(n, &(struct pd_server_opts){.model_dir = dir, .threads = 1, .max_num_seqs = 4, .max_model_len = 1024,
                                           .max_num_batched_tokens = 1024, .served_name = "tiny", .role = role,
                                           .kv_timeout_ms = 3000, .prefix_cache_unit = 64});
}

/* Runs pdmoe with args; its stdout in out, stderr in err; returns the exit status. */
static int run(const char *args, char *out, size_t n_out, char *err, size_t n_err)
{
    const char *bin = getenv("PDMOE_BIN");
    char cmd[1024], fo[] = "/tmp/pdmoe-bs-out-XXXXXX", fe[] = "/tmp/pdmoe-bs-err-XXXXXX";
    int a = mkstemp(fo), b = mkstemp(fe);
    cr_assert(a >= 0 && b >= 0);
    snprintf(cmd, sizeof cmd, "%s %s >%s 2>%s", bin ? bin : "build/pdmoe", args, fo, fe);
    int st = system(cmd);
    FILE *f = fopen(fo, "r");
    out[fread(out, 1, n_out - 1, f)] = 0;
    fclose(f);
    f = fopen(fe, "r");
    err[fread(err, 1, n_err - 1, f)] = 0;
    fclose(f);
    remove(fo);
    remove(fe);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

Test(bench_serve, max_concurrency_and_json, .timeout = 120)
{
    tmp_model("v4-tiny", 5, dir, sizeof dir);
    node_start(&srv, &(struct pd_server_opts){.model_dir = dir, .threads = 1, .max_num_seqs = 8, .max_model_len = 256,
                                              .served_name = "tiny"});
    char args[512], out[8192], err[2048];
    snprintf(args, sizeof args, "bench serve --base-url http://127.0.0.1:%d --model tiny --num-prompts 7 "
             "--max-concurrency 2 --random-input-len 8 --random-output-len 4 --json", srv.port);
    int rc = run(args, out, sizeof out, err, sizeof err);
    /* the prompt tokens the server counted, against the benchmark's account of them */
    char cmd[160], metrics[1 << 15];
    snprintf(cmd, sizeof cmd, "curl -s http://127.0.0.1:%d/metrics", srv.port);
    FILE *mf = popen(cmd, "r");
    size_t mn = fread(metrics, 1, sizeof metrics - 1, mf);
    metrics[mn] = 0;
    pclose(mf);
    const char *pt = strstr(metrics, "\npdmoe_prompt_tokens_total ");
    node_stop(&srv);
    rm_model(dir);
    cr_assert_eq(rc, 0, "%s\n%s", out, err);
    cr_assert_not_null(pt, "%s", metrics);
    json_error_t je;
    json_t *j = json_loads(out, 0, &je);
    cr_assert_not_null(j, "not JSON (%s): %s", je.text, out);
    cr_assert_eq(json_integer_value(json_object_get(j, "completed")), 7);
    cr_assert_eq(json_integer_value(json_object_get(j, "failed")), 0);
    /* seven requests arriving at once, two at a time */
    cr_assert_eq(json_integer_value(json_object_get(j, "peak_in_flight")), 2);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(j, "ttft"), "samples")), 7);
    cr_assert_eq(json_integer_value(json_object_get(j, "random_output_len")), 4);
    /* tokens as the server counted them (its usage: TPOT and throughput were the flag's 4 whatever
     * came), the prompts' tokens the usage's, not the words asked for; the ITL samples are the gaps
     * between events carrying text (at least one token each, the server may send several in one:
     * at most 3 gaps a request), not network reads, which also counted the finish event */
    cr_assert_eq(json_integer_value(json_object_get(j, "completion_tokens")), 28);
    json_int_t gaps = json_integer_value(json_object_get(json_object_get(j, "itl"), "samples"));
    cr_assert_leq(gaps, 21, "%lld ITL samples for 7 requests of 4 tokens", (long long)gaps);
    double mean = json_real_value(json_object_get(j, "prompt_tokens_mean"));
    cr_assert_float_eq(mean, atof(pt + strlen("\npdmoe_prompt_tokens_total ")) / 7, 1e-9, "%g", mean);
    json_decref(j);
}

/* Requests the server refuses: the run fails (exit 1) and says what the server answered the first of
 * them, not only that they failed (prompts past max-model-len here). */
Test(bench_serve, failed_requests_say_what_the_server_said, .timeout = 120)
{
    tmp_model("v4-tiny", 5, dir, sizeof dir);
    node_start(&srv, &(struct pd_server_opts){.model_dir = dir, .threads = 1, .max_num_seqs = 4, .max_model_len = 64,
                                              .served_name = "tiny"});
    char args[512], out[8192], err[2048];
    snprintf(args, sizeof args, "bench serve --base-url http://127.0.0.1:%d --model tiny --num-prompts 3 "
             "--random-input-len 200 --random-output-len 4", srv.port);
    int rc = run(args, out, sizeof out, err, sizeof err);
    node_stop(&srv);
    rm_model(dir);
    cr_assert_eq(rc, 1, "%s\n%s", out, err);
    cr_assert(strstr(err, "3 of 3 requests failed") && strstr(err, "the first: HTTP 400: {"), "%s", err);
    cr_assert(strstr(err, "maximum context length is 64 tokens"), "%s", err);
}

Test(bench_serve, unreachable_url_and_bad_flags)
{
    char out[8192], err[2048];
    cr_assert_eq(run("bench serve --base-url http://127.0.0.1:1 --num-prompts 2", out, sizeof out, err, sizeof err), 1);
    cr_assert(strstr(err, "--base-url http://127.0.0.1:1: cannot connect: Connection refused"), "%s", err);
    cr_assert_null(strstr(out, "nan"), "%s", out);
    cr_assert_eq(run("bench serve --bogus", out, sizeof out, err, sizeof err), 2);
    cr_assert(strstr(err, "unknown option --bogus"), "%s", err);
    cr_assert_eq(run("bench serve --random-output-len 0", out, sizeof out, err, sizeof err), 2);
    cr_assert(strstr(err, "--random-output-len 0: expected a whole number"), "%s", err);
    cr_assert_eq(run("bench serve --help", out, sizeof out, err, sizeof err), 0);
    cr_assert(strstr(out, "usage: pdmoe bench serve"), "%s", out);
}

/* --dataset generated-shared-prefix and multi-turn against a server with 64-token prefix units:
 * every request completes, the warm requests' prompt tokens are partly served from the cache (the
 * hit rate is the server's counters over the run, between 0 and 1 exclusive), and the JSON has
 * cold and warm TTFT and their ratio. */
Test(bench_serve, datasets_report_the_prefix_cache_hit_rate, .timeout = 300)
{
    tmp_model("v4-tiny", 5, dir, sizeof dir);
    node_start(&srv, &(struct pd_server_opts){.model_dir = dir, .threads = 1, .max_num_seqs = 4, .max_model_len = 2048,
                                              .max_num_batched_tokens = 2048, .served_name = "tiny",
                                              .prefix_cache_unit = 64});
    /* the first set twice: the second run's "cold" requests are its own system prompts' first, not
     * the first run's cached ones (they hit them all, and warm / cold read 1.22 for 0.55) */
    const char *sets[] = {"--dataset generated-shared-prefix --gsp-num-groups 2 --gsp-system-prompt-len 60",
                          "--dataset multi-turn --num-turns 3 --gsp-system-prompt-len 30",
                          "--dataset generated-shared-prefix --gsp-num-groups 2 --gsp-system-prompt-len 60"};
    double first_hits = 0;
    for (int k = 0; k < 3; k++) {
        char args[512], out[16384], err[2048];
        snprintf(args, sizeof args, "bench serve --base-url http://127.0.0.1:%d --model tiny --num-prompts 6 "
                 "--max-concurrency 2 --random-input-len 10 --random-output-len 4 %s --json", srv.port, sets[k]);
        int rc = run(args, out, sizeof out, err, sizeof err);
        cr_assert_eq(rc, 0, "%s: %s", sets[k], err);
        json_error_t je;
        json_t *j = json_loads(out, 0, &je);
        cr_assert_not_null(j, "%s", out);
        cr_assert_eq(json_integer_value(json_object_get(j, "completed")), 6);
        double rate = json_real_value(json_object_get(j, "prefix_cache_hit_rate"));
        cr_assert(rate > 0 && rate < 1, "%s: hit rate %f", sets[k], rate);
        double hits = json_real_value(json_object_get(j, "prefix_cache_hits"));
        cr_assert_gt(hits, 0);
        if (k == 0)
            first_hits = hits;
        if (k == 2)   /* (6 of 6 requests hitting where 4 did: 1.5x) */
            cr_assert_lt(hits, 1.25 * first_hits, "a repeated run hit %g tokens, the first %g: its cold requests hit",
                         hits, first_hits);
        cr_assert(json_is_real(json_object_get(j, "ttft_warm_over_cold")), "%s", out);
        cr_assert_not_null(json_object_get(j, "ttft_cold"));
        cr_assert_not_null(json_object_get(j, "ttft_warm"));
        json_decref(j);
    }
    node_stop(&srv);
    rm_model(dir);
}

/* Through a proxy with a prefill and a decode instance: the decode side's pulls (count, bytes, time)
 * over the run, their share of the mean TTFT, and the bound on what pulling only the blocks the
 * decode side lacks could save (the hit rate times that share): one pull per request, bytes and
 * time positive, the bound below the share. */
Test(bench_serve, a_pd_run_reports_the_kv_hand_off, .timeout = 300)
{
    tmp_model("v4-tiny", 5, dir, sizeof dir);
    pthread_t tx;
    struct node P, D;
    pd_instance(&P, PD_ROLE_PRODUCER);
    pd_instance(&D, PD_ROLE_CONSUMER);
    char pa[32], da[32];
    snprintf(pa, sizeof pa, "127.0.0.1:%d", P.port);
    snprintf(da, sizeof da, "127.0.0.1:%d", D.port);
    struct pd_proxy_opts po = {.port = 0, .n_prefill = 1, .n_decode = 1};
    po.prefill[0] = pa;
    po.decode[0] = da;
    struct pd_proxy *X;
    pd_err e = {0};
    cr_assert_eq(pd_proxy_create(&po, &X, &e), 0, "%s", e.msg);
    pthread_create(&tx, NULL, run_proxy, X);
    char args[640], out[16384], err[2048];
    snprintf(args, sizeof args, "bench serve --base-url http://127.0.0.1:%d --model tiny --num-prompts 6 "
             "--max-concurrency 2 --random-input-len 10 --random-output-len 4 --dataset generated-shared-prefix "
             "--gsp-num-groups 2 --gsp-system-prompt-len 60 --metrics-url http://%s,http://%s --json",
             pd_proxy_port(X), pa, da);
    int rc = run(args, out, sizeof out, err, sizeof err);
    proxy_shutdown(&X, tx);
    node_stop(&P);
    node_stop(&D);
    rm_model(dir);
    cr_assert_eq(rc, 0, "%s\n%s", out, err);
    json_error_t je;
    json_t *j = json_loads(out, 0, &je);
    cr_assert_not_null(j, "%s", out);
    cr_assert_eq(json_real_value(json_object_get(j, "kv_pulls")), 6, "%s", out);
    cr_assert_gt(json_real_value(json_object_get(j, "kv_pull_bytes")), 0);
    cr_assert_gt(json_real_value(json_object_get(j, "kv_pull_seconds")), 0);
    double share = json_real_value(json_object_get(j, "kv_pull_over_ttft"));
    double bound = json_real_value(json_object_get(j, "kv_pull_saving_bound_over_ttft"));
    double hit = json_real_value(json_object_get(j, "prefix_cache_hit_rate"));
    cr_assert(share > 0 && hit > 0 && hit < 1, "%s", out);
    cr_assert_float_eq(bound, hit * share, 1e-12, "%s", out);
    json_decref(j);
}

/* Aggregated layouts from the command line: what pdmoe search prints, pdmoe plan --aggregated
 * accepts for the same flags with the same prediction; the launch scripts of an aggregated
 * layout have no KV transfer; bad combinations are refused naming the flags. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../run.h"

static void expect_error(const char *args, const char *needle)
{
    struct run r;
    run(args, &r);
    cr_assert_neq(r.status, 0, "pdmoe %s exited 0", args);
    cr_assert(strstr(r.err, needle), "pdmoe %s: stderr \"%s\" lacks \"%s\"", args, r.err, needle);
}

static double num(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    cr_assert(json_is_number(v), "no number \"%s\"", k);
    return json_number_value(v);
}

/* The search's best aggregated layout, run through pdmoe plan with the same flags: it fits
 * (every verdict, as pdmoe plan judges) and predicts the same TTFT, TPOT and tokens/s per card,
 * open loop and closed loop. */
Test(cli_agg, search_layout_passes_plan)
{
    static const char *const workloads[] = {"--isl 300 --osl 64", "--isl 300 --osl 64 --concurrency 16",
                                            "--isl 2000 --osl 32 --concurrency 3"};
    for (size_t i = 0; i < sizeof workloads / sizeof workloads[0]; i++) {
        const int closed = strstr(workloads[i], "--concurrency") != NULL;
        const char *common = "--model v4-tiny --max-model-len 4096 --max-num-batched-tokens 1024";
        char args[1024];
        struct run r;
        snprintf(args, sizeof args, "search %s --cards 16 %s --ttft-ms 500 --tpot-ms 50 --json", common, workloads[i]);
        run(args, &r);
        cr_assert_eq(r.status, 0, "%s", r.err);
        json_t *doc = json_loads(r.out, 0, NULL);
        cr_assert(doc, "search --json is not JSON");
        json_t *cmp = json_object_get(doc, "comparison"), *a = json_object_get(cmp, "aggregated");
        cr_assert(json_is_object(a), "%s", r.out);
        cr_assert(json_is_true(json_object_get(a, "meets")));
        const char *winner = json_string_value(json_object_get(cmp, "winner"));
        cr_assert(winner && (!strcmp(winner, "aggregated") || !strcmp(winner, "disaggregated")));
        double da = num(a, "tokens_per_s_card"), dd = num(json_object_get(cmp, "disaggregated"), "tokens_per_s_card");
        cr_assert_float_eq(num(cmp, "ratio"), da > dd ? da / dd : dd / da, 1e-9);
        cr_assert_str_eq(winner, da > dd ? "aggregated" : "disaggregated");
        cr_assert_str_eq(json_string_value(json_object_get(doc, "chosen")), winner);
        snprintf(args, sizeof args,
                 "plan %s --nodes 2 --aggregated dp=%d,tp=%d,instances=%d,redundant=%d --max-num-seqs %lld %s --json",
                 common, (int)num(a, "dp"), (int)num(a, "tp"), (int)num(a, "instances"), (int)num(a, "redundant"),
                 (long long)num(a, "batch"), workloads[i]);
        run(args, &r);
        cr_assert_eq(r.status, 0, "%s: %s", args, r.err);
        json_t *plan = json_loads(r.out, 0, NULL);
        cr_assert(plan);
        cr_assert(json_is_true(json_object_get(plan, "aggregated")));
        json_t *budget = json_object_get(json_array_get(json_object_get(plan, "roles"), 1), "budget");
        cr_assert(json_is_true(json_object_get(budget, "fits_max_num_seqs")), "%s", args);
        json_t *perf = json_object_get(plan, "perf");
        cr_assert(json_is_true(json_object_get(perf, "fits")), "%s", args);
        cr_assert(json_is_object(json_object_get(perf, "aggregated")));
        if (closed) {
            json_t *c = json_object_get(perf, "closed_loop");
            cr_assert_float_eq(num(c, "ttft_s"), num(a, "ttft_s"), 1e-9, "%s", args);
            cr_assert_float_eq(num(c, "tpot_s"), num(a, "tpot_s"), 1e-12, "%s", args);
            cr_assert_float_eq(num(c, "output_tokens_per_s_card"), da, 1e-6 * da, "%s", args);
        } else {
            cr_assert_float_eq(num(perf, "ttft_s"), num(a, "ttft_s"), 1e-9, "%s", args);
            cr_assert_float_eq(num(perf, "tpot_s"), num(a, "tpot_s"), 1e-12, "%s", args);
            cr_assert_float_eq(num(perf, "tokens_per_s_card"), da, 1e-6 * da, "%s", args);
        }
        json_decref(plan);
        /* the search's own prediction of its choice is the chosen kind's */
        json_t *pred = json_object_get(doc, "prediction");
        double want = !strcmp(winner, "aggregated") ? da : dd;
        double got = closed ? num(json_object_get(pred, "closed_loop"), "output_tokens_per_s_card")
                            : num(pred, "tokens_per_s_card");
        cr_assert_float_eq(got, want, 1e-6 * want);
        json_decref(doc);
    }
}

/* --emit of an aggregated layout: one server per instance, no KV transfer; SGLang's router in
 * its regular mode; pdmoe's proxy over colocated servers. */
Test(cli_agg, emit_aggregated)
{
    struct run r;
    run("search --cards 16 --ttft-ms 2000 --tpot-ms 50 --layout aggregated --emit vllm-ascend", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "# aggregated instance 0") && strstr(r.out, "vllm serve"), "%s", r.out);
    cr_assert_not(strstr(r.out, "kv-transfer-config"), "%s", r.out);
    cr_assert_not(strstr(r.out, "load_balance_proxy_server_example"), "%s", r.out);
    cr_assert(strstr(r.out, "--max-num-batched-tokens 4096"));
    run("plan --aggregated dp=8,instances=2 --emit sglang", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert_not(strstr(r.out, "--disaggregation-mode"), "%s", r.out);
    cr_assert(strstr(r.out, "--worker-urls http://node0:8100 http://node1:8100"), "%s", r.out);
    cr_assert(strstr(r.out, "--chunked-prefill-size 32768"), "%s", r.out);
    run("plan --model v4-flash-mini --nodes 1 --aggregated dp=2,instances=2 --emit pdmoe --served-model-path /m", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert_not(strstr(r.out, "--kv-transfer-config"), "%s", r.out);
    cr_assert(strstr(r.out, "proxy \\\n    --decode"), "%s", r.out);
    cr_assert_not(strstr(r.out, "--prefill"), "%s", r.out);
    cr_assert(strstr(r.out, "# aggregated instance 1"), "%s", r.out);
}

Test(cli_agg, refused)
{
    expect_error("plan --aggregated dp=8 --prefill dp=8,tp=1,instances=1",
                 "--aggregated and --prefill: a layout is aggregated");
    expect_error("plan --decode dp=8,tp=1,instances=1 --aggregated dp=8", "--aggregated and --decode");
    expect_error("plan --aggregated dp=0", "--aggregated dp=");
    expect_error("plan --aggregated dp=8,instances=9", "layout needs 72 cards (aggregated 9 x 8)");
    expect_error("plan --aggregated ep=8", "--aggregated: unknown key \"ep\"");
    expect_error("search --layout both", "--layout both: expected best, aggregated or disaggregated");
}

/* On one node of 8 cards no disaggregated layout can be placed (decode needs nodes of its own):
 * the comparison said "none fits in memory" above a memory table where they all fit. */
Test(cli_agg, search_says_why_no_disaggregated_layout_is_compared)
{
    struct run r;
    run("search --model models/mini --hardware h100 --cards 8", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "  disaggregated  none placed: whole instances on whole nodes, decode on nodes of its own, "
                            "need more nodes than the cluster has\n"), "%s", r.out);
    cr_assert_null(strstr(r.out, "none fits in memory"), "%s", r.out);
}

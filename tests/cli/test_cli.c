/* The pdmoe program as a user runs it: exit codes and one-line errors naming the flag. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../run.h"
#include "../tmpmodel.h"
#include "model/tokenizer.h"

/* Runs pdmoe with args, expects a one-line error containing needle; returns the exit status. */
static int expect_error(const char *args, const char *needle)
{
    struct run r;
    run(args, &r);
    cr_assert_neq(r.status, 0, "pdmoe %s exited 0", args);
    cr_assert(strstr(r.err, needle), "pdmoe %s: stderr \"%s\" lacks \"%s\"", args, r.err, needle);
    cr_assert_eq(strchr(r.err, '\n'), r.err + strlen(r.err) - 1, "more than one line: %s", r.err);
    return r.status;
}

/* `pdmoe ARGS` that must succeed and print a JSON document: the document. */
Test(cli, plan_default_runs)
{
    struct run r;
    run("plan", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "deepseek-v4-flash"));
    cr_assert(strstr(r.out, "Memory budget per card"));
    cr_assert(strstr(r.out, "rank 31: experts 248-255"));
}

Test(cli, plan_json_parses)
{
    struct run r;
    run("plan --model models/seed-v4-flash.json --json --sweep", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    json_error_t je;
    json_t *j = json_loads(r.out, 0, &je);
    cr_assert_not_null(j, "%s", je.text);
    cr_assert_eq(json_integer_value(json_object_get(j, "plan_version")), 1);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(j, "kv_cache"), "flat_bytes_per_token")), 44000);
    json_decref(j);
}

/* The layout search picks, planned again with its batch as --max-num-seqs, reads as search took it:
 * a disaggregated prefill role where one max-model-len sequence fits is launched with the
 * sequences that fit (the JSON's launched_max_num_seqs, what --emit and up give its servers), not
 * called "DO NOT FIT" beside search's "fits". */
Test(cli, a_prefill_role_lowered_to_its_pool_reads_as_launched)
{
    struct run r;
    run("plan --hardware h200 --isl 2048 --osl 512 --prefill dp=4,tp=1,instances=5,redundant=4 "
        "--decode dp=8,tp=1,instances=1,redundant=8 --max-num-seqs 512 --json", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    json_error_t je;
    json_t *j = json_loads(r.out, 0, &je);
    cr_assert_not_null(j, "%s", je.text);
    json_t *pre = json_array_get(json_object_get(j, "roles"), 0);
    long long fit = (long long)json_integer_value(json_object_get(json_object_get(pre, "budget"), "seqs_at_max_model_len"));
    cr_assert(fit > 0 && fit < 512, "%lld", fit);
    cr_assert_eq(json_integer_value(json_object_get(pre, "launched_max_num_seqs")), fit);
    json_decref(j);
    run("plan --hardware h200 --isl 2048 --osl 512 --prefill dp=4,tp=1,instances=5,redundant=4 "
        "--decode dp=8,tp=1,instances=1,redundant=8 --max-num-seqs 512", &r);
    char want[128];
    snprintf(want, sizeof want, "verdict: 512 of them (max-num-seqs)    %lld launched            fit\n", fit);
    cr_assert(strstr(r.out, want), "no \"%s\" in %s", want, r.out);
}

Test(cli, one_node_is_one_node)
{
    struct run r;
    run("plan --model models/mini --hardware h100 --nodes 1 --aggregated dp=1,instances=1", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "on HGX H100, 1 node x 8 H100") && strstr(r.out, "cards: 1 node x 8)"), "%s", r.out);
}

Test(cli, inventory_lists_every_tensor)
{
    struct run r;
    run("plan --model v4-tiny --prefill dp=4,tp=1,instances=1 --decode dp=8,tp=1,instances=1 --inventory --mtp off | wc -l", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    /* header + every tensor of v4-tiny without MTP: 6 model-level (embed, head, norm, 3 hc_head);
     * per layer 2 norms + 6 mHC + 8 attention + 2 router + 3 shared + 16 x 3 experts = 69;
     * 10 compressor/indexer tensors in each of the 2 CSA layers, 4 in the HCA layer */
    cr_assert_eq(atoi(r.out), 1 + 6 + 4 * 69 + 2 * 10 + 4);
}

Test(cli, bad_flags)
{
    expect_error("plan --gpu-memory-utilization 1.2", "--gpu-memory-utilization 1.2: must be in (0, 1]");
    expect_error("plan --gpu-memory-utilization abc", "--gpu-memory-utilization abc: expected a number");
    expect_error("plan --max-num-seqs 0", "--max-num-seqs 0: must be at least 1");
    expect_error("plan --max-model-len -5", "--max-model-len -5: must be at least 1");
    expect_error("plan --prefill dp=8,tp=1,instances=0", "--prefill instances=0: must be at least 1");
    expect_error("plan --prefill dp=8,pp=2", "--prefill: unknown key \"pp\"");
    expect_error("plan --decode dp=64", "layout needs 96 cards");
    expect_error("plan --nodes 4", "but the cluster has 32");
    expect_error("plan --model llama", "--model llama: no such file, directory or preset");
    expect_error("plan --units tb", "--units tb: expected gb");
    expect_error("plan --kv-cache-dtype fp16", "--kv-cache-dtype fp16");
    expect_error("plan --frobnicate", "unknown option --frobnicate");
    expect_error("plan --runtime-overhead-decode lots", "--runtime-overhead-decode lots: expected bytes");
    expect_error("plan --checkpoint /nonexistent", "/nonexistent");
}

Test(cli, malformed_checkpoint_header)
{
    char dir[] = "/tmp/pdmoe-ckpt-XXXXXX", path[256], args[512], want[300];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *f = fopen(path, "wb");
    /* a header length far beyond the file */
    unsigned char len[8] = {0xff, 0xff, 0, 0, 0, 0, 0, 0};
    fwrite(len, 1, 8, f);
    fputs("{}", f);
    fclose(f);
    snprintf(args, sizeof args, "plan --model v4-tiny --checkpoint %s --prefill dp=4,tp=1,instances=1 "
             "--decode dp=4,tp=1,instances=1", dir);
    snprintf(want, sizeof want, "%s", path);
    expect_error(args, want);
    remove(path);
    rmdir(dir);
}

Test(cli, bad_config_file)
{
    char dir[] = "/tmp/pdmoe-cfg-XXXXXX", path[256], args[512];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    fputs("{\"model_type\": \"deepseek_v4\", \"vocab_size\": 100, \"hidden_size\": -3}", f);
    fclose(f);
    snprintf(args, sizeof args, "plan --model %s", dir);
    char want[300];
    snprintf(want, sizeof want, "%s: field \"hidden_size\": -3 is out of range", path);
    expect_error(args, want);
    remove(path);
    rmdir(dir);
}

/* `pdmoe plan --emit`: the script on stdout, usage errors naming the flag with exit status 2. */
/* A preset that does not exist: the error names the flag the user typed and lists models only
 * (models/ also embeds the calibration corpus, which is no model). */
Test(cli, unknown_preset_names_its_flag)
{
    expect_error("gen-model --preset nosuch --out /tmp/pdmoe-never-written",
                 "--preset nosuch: no such file, directory or preset (presets: deepseek-v3, deepseek-v4-flash-0731, "
                 "deepseek-v4-flash, seed-v4-flash, v4-flash-mini, v4-tiny)");
    expect_error("plan --model nosuch", "--model nosuch: no such file, directory or preset (presets: deepseek-v3,");
    struct run r;
    run("plan --model nosuch", &r);
    cr_assert_null(strstr(r.err, "corpus"), "%s", r.err);
}

/* Every benchmark prints --json (bench plan and bench search had none: "unknown option --json"),
 * and bench plan's document carries each case against its target. */
Test(cli, every_benchmark_prints_json)
{
    static const char *const benches[] = {"plan", "kernels", "decode", "prefill", "ep", "serve", "soak", "transfer",
                                           "convert", "search", "tokenizer"};
    for (size_t i = 0; i < sizeof benches / sizeof benches[0]; i++) {
        char args[64];
        struct run r;
        snprintf(args, sizeof args, "bench %s --help", benches[i]);
        run(args, &r);
        cr_assert_eq(r.status, 0, "%s: %s", args, r.err);
        cr_assert(strstr(r.out, "--json"), "pdmoe %s names no --json: %s", args, r.out);
    }
    struct run r;
    run("bench plan --quick --json", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    json_error_t je;
    json_t *j = json_loads(r.out, 0, &je);
    cr_assert_not_null(j, "%s: %s", je.text, r.out);
    cr_assert_eq(json_array_size(json_object_get(j, "cases")), 5);
    json_t *c = json_array_get(json_object_get(j, "cases"), 0);
    cr_assert_float_eq(json_real_value(json_object_get(c, "of_target")),
                       json_real_value(json_object_get(c, "ms_per_plan")) / json_real_value(json_object_get(j, "target_ms")),
                       1e-9);
    cr_assert(json_is_boolean(json_object_get(j, "met")));
    json_decref(j);
}

/* One CLI: every subcommand answers -h and --help with its usage on stdout and exit 0, names an
 * unknown flag or a flag missing its value with exit 2; pdmoe --version names the build. */
Test(cli, help_and_unknown_flags_everywhere)
{
    static const char *const cmds[] = {"plan",      "gen-model",   "generate",     "search",      "calibrate",
                                       "validate",  "serve",       "up",           "proxy",       "bench plan",
                                       "bench kernels", "bench decode", "bench ep", "bench serve", "bench soak",
                                       "bench transfer", "bench search", "bench tokenizer"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        char args[128], want[64];
        struct run r;
        snprintf(want, sizeof want, "usage: pdmoe %s", cmds[i]);
        for (int h = 0; h < 2; h++) {
            snprintf(args, sizeof args, "%s %s", cmds[i], h ? "--help" : "-h");
            run(args, &r);
            cr_assert_eq(r.status, 0, "pdmoe %s exited %d: %s", args, r.status, r.err);
            cr_assert(strstr(r.out, want), "pdmoe %s: no usage on stdout: %s", args, r.out);
        }
        snprintf(args, sizeof args, "%s --no-such-flag", cmds[i]);
        char msg[128];
        snprintf(msg, sizeof msg, "pdmoe %s: unknown option --no-such-flag (see pdmoe %s --help)", cmds[i], cmds[i]);
        cr_assert_eq(expect_error(args, msg), 2);
    }
    cr_assert_eq(expect_error("plan --model", "pdmoe plan: --model needs a value"), 2);
    cr_assert_eq(expect_error("generate --prompt", "pdmoe generate: --prompt needs a value"), 2);
    cr_assert_eq(expect_error("validate --cases", "pdmoe validate: --cases needs a value"), 2);
    cr_assert_eq(expect_error("serve --port", "pdmoe serve: --port needs a value"), 2);
    cr_assert_eq(expect_error("bench nosuch", "pdmoe bench: unknown benchmark \"nosuch\""), 2);
    {   /* bench transfer's two-process flags: each misuse named */
        static const struct { const char *args, *msg; } bad[] = {
            {"bench transfer --serve nohost", "--serve nohost: expected HOST:PORT"},
            {"bench transfer --peer 127.0.0.1:0", "--peer 127.0.0.1:0: expected HOST:PORT"},
            {"bench transfer --peer :9000", "--peer :9000: expected HOST:PORT"},
            {"bench transfer --serve 127.0.0.1:9000 --peer 127.0.0.1:9001", "--serve and --peer exclude each other"},
            {"bench transfer --tokens 1024", "--tokens applies only with --peer"},
            {"bench transfer --serve 127.0.0.1:9000 --reps 3", "--reps applies only with --peer"},
            {"bench transfer --peer 127.0.0.1:9000 --timeout 3", "--timeout applies only with --serve"},
            {"bench transfer --peer 127.0.0.1:9000 --quick", "--quick applies only to the single-process run"},
            {"bench transfer --peer 127.0.0.1:9000 --tokens 1024,x", "--tokens x"},
            {"bench transfer --peer 127.0.0.1:9000 --reps 65", "--reps 65: at most 64"},
            {"bench transfer --serve", "--serve needs a value"},
        };
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
            cr_assert_eq(expect_error(bad[i].args, bad[i].msg), 2, "%s", bad[i].args);
    }
    {   /* pdmoe bench --help lists every benchmark */
        struct run b;
        run("bench --help", &b);
        cr_assert_eq(b.status, 0);
        static const char *const all[] = {"plan", "kernels", "decode", "ep", "serve", "soak", "transfer", "search",
                                          "tokenizer"};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
            char line[32];
            snprintf(line, sizeof line, "\n  %-9s ", all[i]);
            cr_assert(strstr(b.out, line), "bench --help lacks %s: %s", all[i], b.out);
        }
    }
    struct run r;
    run("--version", &r);
    cr_assert_eq(r.status, 0);
    cr_assert_eq(strncmp(r.out, "pdmoe 0.", 8), 0, "%s", r.out);
    cr_assert(strstr(r.out, "(commit "), "%s", r.out);
}

Test(cli, plan_emit)
{
    struct run r;
    run("plan --emit vllm-ascend", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert_eq(strncmp(r.out, "#!/bin/sh\n", 10), 0);
    cr_assert(strstr(r.out, "vllm serve \"$MODEL_PATH\" \\\n    --host 0.0.0.0"));
    cr_assert(strstr(r.out, "    --quantization ascend \\\n"));
    cr_assert(strstr(r.out, "python3 load_balance_proxy_server_example.py \\\n"));

    run("plan --emit sglang --hosts 10.0.0.1,10.0.0.2,10.0.0.3,10.0.0.4,10.0.0.5,10.0.0.6,10.0.0.7,10.0.0.8 "
        "--served-model-path /models/v4 --base-port 9000 --proxy-port 9100", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "    --model-path /models/v4 \\\n"));
    cr_assert(strstr(r.out, "    --quantization modelslim \\\n"));
    cr_assert_null(strstr(r.out, "MODEL_PATH"), "a path was given: the script needs no MODEL_PATH");
    cr_assert(strstr(r.out, "    --prefill http://10.0.0.1:9000 8998 \\\n"));
    cr_assert(strstr(r.out, "    --decode http://10.0.0.5:9000 \\\n    --host 0.0.0.0 \\\n    --port 9100 &\n"));

    /* pdmoe: 4 prefill EP8 groups on one host each, the EP32 decode group one mpirun over 4 hosts */
    run("plan --model v4-flash-mini --emit pdmoe --hosts h0,h1,h2,h3,h4,h5,h6,h7 --proxy-port 9000 --threads 4", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "if [ \"$host\" = h3 ]; then\n  mpirun \\\n    --host h3:8 \\\n    --bind-to none \\\n    -n 8 pdmoe serve \\\n"
                            "    --model models/mini \\\n    --host h3 \\\n    --port 9004 \\\n    --threads 4 \\\n"),
              "%s", r.out);
    cr_assert(strstr(r.out, "  mpirun \\\n    --host h4:8,h5:8,h6:8,h7:8 \\\n    --bind-to none \\\n    -n 8 pdmoe serve \\\n"), "%s", r.out);
    cr_assert(strstr(r.out, "  pdmoe proxy \\\n    --prefill h0:9001,h1:9002,h2:9003,h3:9004 \\\n    --decode h4:9005 \\\n"
                            "    --port 9000 \\\n    --host h0 &\n"), "%s", r.out);

    static const struct { const char *args, *msg; } bad[] = {
        {"plan --emit vllm", "--emit vllm: expected vllm-ascend, sglang or pdmoe"},
        {"plan --hosts a,b", "--hosts only applies with --emit"},
        {"plan --served-model-path /m", "--served-model-path only applies with --emit"},
        {"plan --emit sglang --hosts a,b,c", "--hosts: 3 given but the layout needs 8 nodes"},
        {"plan --emit sglang --hosts a,,c", "--hosts: host 2 \"\""},
        {"plan --emit sglang --json", "does not combine with --json"},
        {"plan --emit sglang --base-port 70000", "--base-port 70000: a port is at most 65535"},
        {"plan --emit sglang --proxy-port 8100", "ports clash on node0"},
        {"plan --hardware h200 --prefill dp=8,tp=1,instances=2 --decode dp=16,tp=1,instances=1 --nodes 4 "
         "--emit vllm-ascend", "not Ascend NPUs (use --emit sglang)"},
        {"plan --emit pdmoe", "--emit pdmoe: deepseek-v4-flash is a preset, not a checkpoint directory"},
        {"plan --emit pdmoe --served-model-path /m --decode dp=8,tp=4,instances=1",
         "--emit pdmoe: --decode tp=4: pdmoe runs tensor parallel 1 only"},
        {"plan --model v4-flash-mini --emit pdmoe --base-port 9000", "--base-port 9000 does not apply to --emit pdmoe"},
        {"plan --emit sglang --threads 4", "--threads 4 only applies with --emit pdmoe"},
        {"plan --threads 4", "--threads only applies with --emit"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int status = expect_error(bad[i].args, bad[i].msg);
        cr_assert_eq(status, 2, "pdmoe %s: exit %d", bad[i].args, status);
    }
}

/* The decode batch a plan predicts at is the --max-num-seqs its --emit gives the decode servers:
 * where max-model-len sequences do not all fit, emit lowers --max-num-seqs to those that do, and the
 * prediction once ran at the plan's 30 anyway (TPOT and throughput of a batch the emitted servers
 * would never run). Both at the default length (30 fit) and at 512K tokens (fewer; at 1M no prompt
 * fits the prefill card beside its chunks in flight). */
Test(cli, predicted_batch_is_the_emitted_max_num_seqs)
{
    static const char *const lens[] = {"", "--max-model-len 524288 "};
    for (size_t i = 0; i < sizeof lens / sizeof *lens; i++) {
        struct run r;
        char args[256];
        snprintf(args, sizeof args, "plan %s--isl 4096 --osl 1024 --json", lens[i]);
        json_t *j = run_json(args);
        json_int_t batch = json_integer_value(json_object_get(json_object_get(j, "perf"), "batch"));
        /* roles: [prefill, decode] */
        json_int_t at_max = json_integer_value(json_object_get(
            json_object_get(json_array_get(json_object_get(j, "roles"), 1), "budget"), "seqs_at_max_model_len"));
        cr_assert_gt(at_max, 0);
        json_decref(j);
        snprintf(args, sizeof args, "plan %s--emit vllm-ascend", lens[i]);
        run(args, &r);
        cr_assert_eq(r.status, 0, "%s", r.err);
        /* the decode instance is the last vllm serve of the script: its --max-num-seqs */
        const char *d = NULL;
        for (const char *q = strstr(r.out, "--kv-transfer-config"); q; q = strstr(q + 1, "--kv-transfer-config"))
            if (strstr(q, "kv_consumer") && (!d || q > d) && strstr(q, "kv_consumer") - q < 200)
                d = q;
        cr_assert_not_null(d, "no decode server in:\n%s", r.out);
        const char *start = d;
        while (start > r.out && strncmp(start, "vllm serve", 10) != 0)
            start--;
        const char *m = strstr(start, "--max-num-seqs ");
        cr_assert(m && m < d, "no --max-num-seqs before the decode server's kv config");
        long emitted = strtol(m + 15, NULL, 10);
        cr_assert_eq(batch, emitted, "%s: the prediction's batch %lld, the emitted --max-num-seqs %ld", lens[i],
                     (long long)batch, emitted);
        cr_assert_eq(emitted, at_max < 30 ? at_max : 30, "%s", lens[i]);
    }
}

/* The layout search recommends has the KV pools its plan has: the roles were costed at the base
 * --max-num-seqs, the recommended plan at its batch (the prefill pool differed by its logits rows:
 * 12.53 GB against the plan's 12.51 for the same cards). Its best disaggregated layout is shown
 * whichever kind wins; when an aggregated layout won, that layout's pools were the costing's. */
Test(cli, search_best_pools_are_its_plans)
{
    const char *layouts[] = {"disaggregated", "aggregated"};
    for (int i = 0; i < 2; i++) {
        char cmd[256];
        snprintf(cmd, sizeof cmd, "search --cards 64 --isl 4096 --osl 1024 --ttft-ms 2000 --tpot-ms 50 --layout %s --json",
                 layouts[i]);
        json_t *j = run_json(cmd);
        json_t *best = json_object_get(j, "best"), *roles = json_object_get(best, "roles");
        char args[512];
        json_t *rp = json_array_get(roles, 0), *rd = json_array_get(roles, 1);
        snprintf(args, sizeof args, "plan --prefill dp=%lld,tp=%lld,instances=%lld,redundant=%lld --decode "
                 "dp=%lld,tp=%lld,instances=%lld,redundant=%lld --max-num-seqs %lld --json",
                 (long long)json_integer_value(json_object_get(rp, "dp")), (long long)json_integer_value(json_object_get(rp, "tp")),
                 (long long)json_integer_value(json_object_get(rp, "instances")),
                 (long long)json_integer_value(json_object_get(rp, "redundant")),
                 (long long)json_integer_value(json_object_get(rd, "dp")), (long long)json_integer_value(json_object_get(rd, "tp")),
                 (long long)json_integer_value(json_object_get(rd, "instances")),
                 (long long)json_integer_value(json_object_get(rd, "redundant")),
                 (long long)json_integer_value(json_object_get(best, "batch")));
        json_int_t pools[2] = {json_integer_value(json_object_get(rp, "kv_pool_bytes")),
                               json_integer_value(json_object_get(rd, "kv_pool_bytes"))};
        json_decref(j);
        j = run_json(args);
        for (int k = 0; k < 2; k++) {
            json_int_t plan_pool = json_integer_value(json_object_get(
                json_object_get(json_array_get(json_object_get(j, "roles"), (size_t)k), "budget"), "kv_pool_bytes"));
            cr_assert_eq(pools[k], plan_pool, "%s, then %s: role %d, search %lld, plan %lld", cmd, args, k,
                         (long long)pools[k], (long long)plan_pool);
        }
        json_decref(j);
    }
}

/* FP8 weights on cards without FP8 units: plan and search say so before their figures (they
 * predicted them and counted 771 layouts that --emit then refused), the JSON says why. */
Test(cli, formats_the_cards_cannot_serve_are_said_first)
{
    struct run r;
    run("plan --quant fp8", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    const char *ns = strstr(r.out, "  NOT SERVABLE: "), *lay = strstr(r.out, "Weights per card");
    cr_assert(ns && (!lay || ns < lay) && strstr(ns, "no FP8/FP4 units"), "%s", r.out);
    run("plan --quant fp8 --json", &r);
    cr_assert(strstr(r.out, "\"not_servable\": \"Atlas 800I A2:"), "%s", r.out);
    run("plan --json", &r);
    cr_assert(strstr(r.out, "\"not_servable\": null"), "%s", r.out);
    run("search --cards 64 --isl 4096 --osl 1024 --ttft-ms 2000 --tpot-ms 50 --quant fp8", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "  NOT SERVABLE, any of them: "), "%s", r.out);
    expect_error("plan --quant fp8 --emit vllm-ascend", "no FP8/FP4 units");
}

/* An aggregated plan's budget speaks of its own instances: max-num-seqs sequences on both columns,
 * one prompt's KV where it says one prompt, no hand-off table (it said a prompt of max-model-len
 * needs 6.84 GB, 48 prompts' worth, and printed a prefill-to-decode hand-off). */
Test(cli, an_aggregated_plans_budget_is_its_own)
{
    struct run r;
    run("plan --aggregated dp=8,tp=1,instances=1 --max-num-seqs 48", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "KV needed (48 / 48 x 32768 + steps)"), "%s", r.out);
    cr_assert(strstr(r.out, "needs 261.60 MB while it is prefilled in chunks,\n  and its chunks'"), "%s", r.out);
    cr_assert_null(strstr(r.out, "KV hand-off, one prompt"), "%s", r.out);
    run("plan", &r);
    cr_assert(strstr(r.out, "KV needed (1 / 30 x 32768 + steps)") && strstr(r.out, "KV hand-off, one prompt"), "%s", r.out);
}

/* A prediction for a layout that does not fit says so before its figures (it printed TPOT and
 * tokens/s at "batch 0", DOES NOT FIT only at the end of the last line). */
Test(cli, a_layout_that_does_not_fit_says_so_first)
{
    struct run r;
    run("plan --decode dp=4,tp=1,instances=8 --isl 4096 --osl 1024", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    const char *nf = strstr(r.out, "  DOES NOT FIT: the decode weights do not fit a card"), *tpot = strstr(r.out, "  TPOT ");
    cr_assert(nf && tpot && nf < tpot, "%s", r.out);
    run("plan --isl 4096 --osl 1024", &r);
    cr_assert_null(strstr(r.out, "DOES NOT FIT:"), "%s", r.out);
}

/* An override that would change nothing is refused, not shown in the header and ignored. */
Test(cli, quant_overrides_that_change_nothing_are_refused)
{
    expect_error("plan --quant-override norms_mhc=fp4", "--quant-override norms_mhc=fp4: the norms and mHC weights");
    expect_error("plan --quant-override ''", "--quant-override: empty");
}

/* A decode step's activations hold every sequence's drafts too: 256 sequences with 8 MTP drafts
 * are 2,304 tokens, each with its logits (the budget counted 256 tokens whatever the drafts). */
Test(cli, decode_activations_count_the_drafts)
{
    json_t *j = run_json("plan --max-num-seqs 256 --speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":8}' --json");
    json_t *act = json_object_get(json_object_get(json_array_get(json_object_get(j, "roles"), 1), "budget"), "activations");
    json_t *model = json_object_get(j, "model");
    json_int_t vocab = json_integer_value(json_object_get(model, "vocab_size"));
    cr_assert_eq(json_integer_value(json_object_get(act, "tokens")), 256 * 9);
    if (vocab > 0)
        cr_assert_eq(json_integer_value(json_object_get(act, "logits_bytes")), (json_int_t)256 * 9 * vocab * 4);
    json_decref(j);
}

/* SGLang's script says when the plan sized other formats than the release's, by the model's own
 * release: DeepSeek-V3 is FP8 throughout (its FP8 plan was told to use V4-Flash's FP4 experts,
 * which would have sized about half the weights SGLang loads). */
Test(cli, emit_sglang_compares_with_the_models_own_release)
{
    struct run r;
    run("plan --model deepseek-v3 --hardware h200 --quantization fp8 --emit sglang", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert_null(strstr(r.out, "formats it was released in"), "%s", r.out);
    run("plan --model deepseek-v3 --hardware h200 --quantization fp8 --quant-override routed_experts=fp4 --emit sglang", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "(DeepSeek-V3: FP8 throughout). Plan with those formats (--quantization fp8, or"), "%s", r.out);
    run("plan --hardware h200 --prefill dp=8,tp=1,instances=2 --decode dp=16,tp=1,instances=1 --nodes 4 --quantization fp8 "
        "--quant-override routed_experts=fp4 --emit sglang", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert_null(strstr(r.out, "formats it was released in"), "%s", r.out);
}

/* An arrival rate past what the deployment sustains (its decode side, here) has no queueing TTFT:
 * the plan printed 578 ms at 50 requests/s against 18.2 sustained (only a rate past the prefill
 * capacity gave infinity), where search counts such a layout as missing its targets. */
Test(cli, a_rate_past_the_deployment_has_no_finite_ttft)
{
    static const char *const cases[] = {
        "plan --prefill dp=8,tp=1,instances=3 --decode dp=8,tp=1,instances=1 --max-num-seqs 64 --isl 4096 --osl 1024 "
        "--request-rate 50",
        "plan --aggregated dp=8,tp=1,instances=1 --max-num-seqs 48 --isl 4096 --osl 1024 --request-rate 15"};
    for (int i = 0; i < 2; i++) {
        struct run r;
        run(cases[i], &r);
        cr_assert_eq(r.status, 0, "%s", r.err);
        cr_assert(strstr(r.out, "unbounded: the rate is above the"), "%s:\n%s", cases[i], r.out);
        char args[512];
        snprintf(args, sizeof args, "%s --json", cases[i]);
        json_t *j = run_json(args);
        json_t *perf = json_object_get(j, "perf"), *a = json_object_get(perf, "aggregated");
        json_t *t = json_object_get(json_is_object(a) ? a : perf, "ttft_at_rate_s");
        cr_assert(json_is_null(t) || json_object_get(json_is_object(a) ? a : perf, "ttft_at_rate_s") == NULL,
                  "%s: ttft_at_rate_s %g", cases[i], json_number_value(t));
        json_decref(j);
    }
}

/* Near the decode side's capacity the TTFT at a rate grows toward the cut-off instead of staying
 * at the prompt queue's (506.9 ms at 10, 31 and 31.3 requests/s with the decode slots 99.8% busy,
 * then "unbounded" at 31.4): the wait for a decode slot is counted, and rises with the rate. */
Test(cli, the_ttft_at_a_rate_counts_the_wait_for_a_decode_slot)
{
    double t[3];
    static const char *const rates[] = {"10", "31", "31.3"};
    for (int i = 0; i < 3; i++) {
        char args[256];
        snprintf(args, sizeof args, "plan --isl 4096 --osl 1024 --request-rate %s --json", rates[i]);
        json_t *j = run_json(args);
        json_t *perf = json_object_get(j, "perf");
        cr_assert(json_is_number(json_object_get(perf, "ttft_at_rate_s")), "%s", rates[i]);
        t[i] = json_number_value(json_object_get(perf, "ttft_at_rate_s"));
        json_decref(j);
    }
    cr_assert(t[0] < t[1] && t[1] < t[2], "TTFT at 10, 31, 31.3 req/s: %g %g %g s", t[0], t[1], t[2]);
    cr_assert_gt(t[2], 5 * t[0], "99.8%% busy decode slots add no wait: %g s against %g s", t[2], t[0]);
}

/* Issue 6 from the command line: prediction with the plan, the search and its report, the
 * validation's exit status, and errors that name the flag. */
Test(cli, perf_search_validate)
{
    struct run r;
    run("plan --isl 4096 --osl 1024 --json", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    json_t *doc = json_loads(r.out, 0, NULL);
    cr_assert(doc);
    json_t *perf = json_object_get(doc, "perf");
    cr_assert(json_is_object(perf));
    cr_assert_gt(json_number_value(json_object_get(perf, "ttft_s")), 0);
    cr_assert_gt(json_number_value(json_object_get(perf, "tpot_s")), 0);
    json_decref(doc);
    run("plan --isl 4096 --osl 1024", &r);
    cr_assert(strstr(r.out, "TTFT") && strstr(r.out, "KV hand-off"), "%s", r.out);

    char html[] = "/tmp/pdmoe-search-XXXXXX";
    int fd = mkstemp(html);
    cr_assert_geq(fd, 0);
    close(fd);
    char args[256];
    snprintf(args, sizeof args, "search --cards 32 --isl 2048 --osl 256 --ttft-ms 3000 --tpot-ms 40 --json --html %s", html);
    run(args, &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    doc = json_loads(r.out, 0, NULL);
    cr_assert(doc, "search --json is not JSON");
    cr_assert(json_is_true(json_object_get(doc, "best_meets_targets")));
    json_t *best = json_object_get(doc, "best");
    cr_assert_leq(json_integer_value(json_object_get(best, "cards")), 32);
    cr_assert_leq(json_number_value(json_object_get(best, "tpot_s")), 0.040);
    cr_assert_gt(json_array_size(json_object_get(doc, "front")), 1);
    json_decref(doc);
    char page[1 << 16];
    slurp(html, page, sizeof page);
    remove(html);
    cr_assert(strncmp(page, "<!DOCTYPE html>", 15) == 0);

    run("search --cards 32 --layout disaggregated --emit vllm-ascend", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "vllm serve") && strstr(r.out, "kv_producer") && strstr(r.out, "kv_consumer"));

    run("validate", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "| case |"));
    /* --json: every case with its status; the V4-Flash ones pending with a prediction and a reason */
    run("validate --json", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    json_error_t je;
    json_t *cases = json_loads(r.out, 0, &je);
    cr_assert(json_is_array(cases) && json_array_size(cases) >= 12, "%s", je.text);
    size_t i, pending = 0;
    json_t *c;
    json_array_foreach(cases, i, c) {
        const char *st = json_string_value(json_object_get(c, "status"));
        cr_assert(st && json_is_number(json_object_get(c, "predicted")) && json_is_object(json_object_get(c, "perf")));
        if (strcmp(st, "pending") == 0) {
            pending++;
            cr_assert(strstr(json_string_value(json_object_get(c, "name")), "V4-Flash"));
            cr_assert_gt(strlen(json_string_value(json_object_get(c, "reason"))), 100);
            /* the aggregated ones with their busiest rank's run (the 1P1D run's steps are the plan's) */
            if (!strstr(json_string_value(json_object_get(c, "name")), "1P1D"))
                cr_assert(json_is_object(json_object_get(c, "lockstep")), "the V4 cases are lockstep loops");
        }
    }
    cr_assert_eq(pending, 6);   /* the four Ascend runs, Lambda's H100 and B200 runs */
    json_decref(cases);

    expect_error("plan --isl 0", "--isl");
    expect_error("plan --isl 100 --concurrency 4 --phase sync", "--phase sync: expected lockstep or random");
    expect_error("plan --isl 100 --concurrency 4 --phase lockstep --schedule prefill-first",
                 "--schedule prefill-first: a schedule of aggregated steps");
    expect_error("plan --aggregated dp=8,tp=1,instances=1 --isl 100 --concurrency 4 --num-prompts 6 --phase lockstep",
                 "--num-prompts 6: a multiple of --concurrency 4");
    expect_error("plan --aggregated dp=8,tp=1,instances=1 --isl 100 --concurrency 4 --prefill-max-requests 2",
                 "--prefill-max-requests: modelled in the lockstep closed loop only");
    expect_error("search --cards 8 --concurrency 4 --phase lockstep", "--phase");
    expect_error("plan --isl 100 --concurrency 4 --schedule fifo", "--schedule fifo: expected decode-first or prefill-first");
    expect_error("plan --prefix-cache-hit 1.5", "--prefix-cache-hit");
    expect_error("search --cards 1", "--cards");
    expect_error("search --tpot-ms -3", "--tpot-ms");
    expect_error("search --emit slurm", "--emit");
    expect_error("search --isl 100000 --max-model-len 8192", "--max-model-len");
    /* a request the servers would refuse is not predicted: plan ran its prefill to 450 s at --isl
     * 1,000,000 over the default 32,768, and a sum that wrapped past INT64_MAX hung both */
    expect_error("plan --isl 1000000 --osl 16", "--isl 1000000 + --osl 16: more than --max-model-len 32768 tokens");
    expect_error("plan --isl 9223372036854775807 --osl 16", "more than --max-model-len 32768");
    expect_error("search --isl 9223372036854775807 --osl 16", "at most --max-model-len 32768");
    expect_error("plan --max-model-len 2000000 --isl 1048000 --osl 1000",
                 "--max-model-len 2000000: more than the model's max_position_embeddings 1048576");
    expect_error("plan --aggregated dp=8,tp=1,instances=8 --isl 32000 --osl 1000 --concurrency 4",
                 "more than --max-model-len 32768");
    expect_error("search --cards 32 --html /nonexistent-dir/r.html", "--html /nonexistent-dir/r.html: cannot write");
    expect_error("plan --html /nonexistent-dir/r.html", "--html /nonexistent-dir/r.html: cannot write");
    expect_error("plan --expert-stats /nonexistent-dir/s.json", "/nonexistent-dir/s.json");

    /* measured expert load: expert 0 hot in every layer, at the seed's decode EP32 */
    char stats[] = "/tmp/pdmoe-stats-XXXXXX";
    tmp_expert_stats(stats, 43, 256, 65);
    snprintf(args, sizeof args, "plan --isl 1024 --osl 256 --expert-stats %s", stats);
    run(args, &r);
    remove(stats);
    cr_assert_eq(r.status, 0, "%s", r.err);
    /* decode EP32: rank 0 holds experts 0-7, 72 of 320 tokens; the mean is 10 */
    cr_assert(strstr(r.out, "decode 7.20 (measured on its placement from the expert stats)"), "%s", r.out);
    /* models/mini's counts (8 layers of 256 experts) are not V4-Flash's (43 layers) */
    snprintf(stats, sizeof stats, "/tmp/pdmoe-stats-XXXXXX");
    tmp_expert_stats(stats, 8, 256, 65);
    snprintf(args, sizeof args, "plan --isl 1024 --osl 256 --expert-stats %s", stats);
    char want[256];
    snprintf(want, sizeof want, "--expert-stats %s: field \"tokens_per_expert\": 8 layers, but deepseek-v4-flash has 43 "
             "(num_hidden_layers): counts from another model", stats);
    expect_error(args, want);
    remove(stats);
}

Test(cli, tokenize_prints_the_ids_of_the_encoder)
{
    /* pdmoe tokenize's ids are pd_tok_encode's, as text, JSON and JSON lines */
    const char *tok = "models/mini/tokenizer.json", *text = "Hello, world! \xe4\xbd\xa0\xe5\xa5\xbd 12345";
    struct pd_tok *t;
    pd_err e = {0};
    cr_assert_eq(pd_tok_load(tok, &t, &e), 0, "%s", e.msg);
    int32_t *ids;
    size_t n;
    cr_assert_eq(pd_tok_encode(t, text, strlen(text), &ids, &n, &e), 0, "%s", e.msg);
    cr_assert_gt(n, 1);
    char want[4096] = "", want_json[4096] = "[";
    for (size_t i = 0; i < n; i++) {
        snprintf(want + strlen(want), sizeof want - strlen(want), i ? " %d" : "%d", ids[i]);
        snprintf(want_json + strlen(want_json), sizeof want_json - strlen(want_json),
                 i ? ",%d" : "%d", ids[i]);
    }
    strcat(want, "\n");
    strcat(want_json, "]\n");
    struct run r;
    char args[512];
    snprintf(args, sizeof args, "tokenize --tokenizer %s --text '%s'", tok, text);
    run(args, &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert_str_eq(r.out, want);
    snprintf(args, sizeof args, "tokenize --tokenizer %s --json --text '%s'", tok, text);
    run(args, &r);
    cr_assert_str_eq(r.out, want_json);
    char path[] = "/tmp/pdmoe-jsonl-XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fprintf(f, "\"%s\"\n\"\"\n\"%s\"", text, text);   /* the last line without its newline */
    fclose(f);
    snprintf(args, sizeof args, "tokenize --tokenizer %s --jsonl %s", tok, path);
    run(args, &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    char want_lines[2 * sizeof want_json + 8];
    snprintf(want_lines, sizeof want_lines, "%s[]\n%s", want_json, want_json);
    cr_assert_str_eq(r.out, want_lines);
    f = fopen(path, "w");
    fputs("\"ok\"\n42\n", f);
    fclose(f);
    snprintf(args, sizeof args, "tokenize --tokenizer %s --jsonl %s", tok, path);
    char needle[256];
    snprintf(needle, sizeof needle, "--jsonl %s: line 2: expected a JSON string", path);
    cr_assert_eq(expect_error(args, needle), 1);
    /* a raw 0x00 in a line is that line's error: it used to end the file there, silently (exit 0,
     * the lines after it never read) */
    f = fopen(path, "w");
    fwrite("\"ok\"\n\"a\0b\"\n\"c\"\n", 1, 13, f);
    fclose(f);
    snprintf(needle, sizeof needle, "--jsonl %s: line 2: not JSON", path);
    cr_assert_eq(expect_error(args, needle), 1);
    remove(path);
    free(ids);
    pd_tok_free(t);
}

Test(cli, tokenize_bad_flags)
{
    cr_assert_eq(expect_error("tokenize --text hi", "--tokenizer FILE is required"), 2);
    cr_assert_eq(expect_error("tokenize --tokenizer models/mini/tokenizer.json",
                              "give one of --text, --file and --jsonl"), 2);
    cr_assert_eq(expect_error("tokenize --tokenizer models/mini/tokenizer.json --text a --file b",
                              "give one of --text, --file and --jsonl"), 2);
    cr_assert_eq(expect_error("tokenize --tokenizer models/mini/tokenizer.json --text",
                              "--text needs a value"), 2);
    cr_assert_eq(expect_error("tokenize --tokenizer /nonexistent.json --text a",
                              "--tokenizer /nonexistent.json"), 1);
    cr_assert_eq(expect_error("tokenize --tokenizer models/mini/tokenizer.json --file /nonexistent",
                              "--file /nonexistent: cannot read"), 1);
    cr_assert_eq(expect_error("tokenize --tokenize x", "unknown option --tokenize"), 2);
    /* thinking mode is a chat's: without --chat, and an effort no request may send, refused */
    cr_assert_eq(expect_error("tokenize --tokenizer models/mini/tokenizer.json --text a --thinking",
                              "--thinking is a chat's thinking mode: it needs --chat"), 2);
    cr_assert_eq(expect_error("tokenize --tokenizer models/mini/tokenizer.json --text a --reasoning-effort max",
                              "--reasoning-effort is a chat's thinking mode: it needs --chat"), 2);
    cr_assert_eq(expect_error("tokenize --tokenizer models/mini/tokenizer.json --jsonl - --chat models/mini "
                              "--reasoning-effort extreme",
                              "--reasoning-effort extreme: want one of \"none\", \"minimal\", \"low\", \"medium\", "
                              "\"high\" or \"max\""), 2);
}

/* plan --concurrency: the JSON's closed-loop figures satisfy the cycle equation, the text prints
 * the same, search takes the flag, and bad values are refused naming the flag. */
Test(cli, plan_concurrency)
{
    const char *layout = "plan --model v4-tiny --nodes 1 --prefill dp=1,tp=1,instances=1 --decode dp=2,tp=1,instances=1 "
                         "--isl 300 --osl 64";
    char args[512];
    struct run r;
    for (int C = 1; C <= 64; C *= 4) {
        snprintf(args, sizeof args, "%s --concurrency %d --json", layout, C);
        run(args, &r);
        cr_assert_eq(r.status, 0, "%s", r.err);
        json_t *doc = json_loads(r.out, 0, NULL);
        cr_assert(doc);
        json_t *c = json_object_get(json_object_get(doc, "perf"), "closed_loop");
        cr_assert(json_is_object(c), "%s", r.out);
        cr_assert_eq(json_integer_value(json_object_get(c, "concurrency")), C);
        double ttft = json_number_value(json_object_get(c, "ttft_s")), tpot = json_number_value(json_object_get(c, "tpot_s"));
        double tok = json_number_value(json_object_get(c, "output_tokens_per_s"));
        double req = json_number_value(json_object_get(c, "requests_per_s"));
        cr_assert_gt(ttft, 0);
        cr_assert_float_eq(tok, C * 64 / (ttft + 63 * tpot), 1e-9 * tok, "C %d: %g vs %g", C, tok, C * 64 / (ttft + 63 * tpot));
        cr_assert_float_eq(req, C / (ttft + 63 * tpot), 1e-9 * req);
        json_decref(doc);
        snprintf(args, sizeof args, "%s --concurrency %d", layout, C);
        run(args, &r);
        cr_assert_eq(r.status, 0, "%s", r.err);
        char want[64];
        snprintf(want, sizeof want, "closed loop, %d client%s (", C, C == 1 ? "" : "s");
        cr_assert(strstr(r.out, want) && strstr(r.out, "= TTFT + (osl - 1) x TPOT"), "%s", r.out);
    }
    snprintf(args, sizeof args, "%s --json", layout);
    run(args, &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "\"closed_loop\": null"), "%s", r.out);
    run("search --model v4-tiny --cards 16 --isl 300 --osl 64 --concurrency 16 --layout disaggregated --json", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    json_t *doc = json_loads(r.out, 0, NULL);
    cr_assert(doc);
    cr_assert_eq(json_integer_value(json_object_get(doc, "concurrency")), 16);
    json_t *best = json_object_get(doc, "best"), *c = json_object_get(json_object_get(doc, "prediction"), "closed_loop");
    cr_assert(json_is_object(c), "%s", r.out);
    /* the chosen layout's figures are its full prediction's */
    cr_assert_float_eq(json_number_value(json_object_get(best, "ttft_s")), json_number_value(json_object_get(c, "ttft_s")), 1e-9);
    cr_assert_float_eq(json_number_value(json_object_get(best, "tpot_s")), json_number_value(json_object_get(c, "tpot_s")), 1e-12);
    cr_assert_float_eq(json_number_value(json_object_get(best, "tokens_per_s_card")),
                       json_number_value(json_object_get(c, "output_tokens_per_s_card")), 1e-6);
    json_decref(doc);
    expect_error("plan --isl 300 --osl 64 --concurrency 0", "--concurrency 0: must be at least 1");
    expect_error("plan --isl 300 --osl 64 --concurrency many", "--concurrency many: expected an integer");
    expect_error("plan --isl 300 --osl 64 --concurrency 4 --request-rate 2", "--request-rate and --concurrency");
    expect_error("search --concurrency 4 --request-rate 2", "--request-rate and --concurrency");
    expect_error("search --concurrency -1", "--concurrency -1: must be at least 1");
}

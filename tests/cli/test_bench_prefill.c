/* `pdmoe bench prefill`: tokens/s per prompt length and thread count, each part's share of the
 * step from the engine's profile (GEMM, attention, MoE, exchange, other) and three pieces inside
 * them (the experts' products, the float products, the attention's heads), each step against its
 * same-run bound and the GEMM part's int8 ops/s against the int8 peak, --json; bad flags refused
 * by name. The figures' consistency is asserted, not the machine's speed. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../run.h"

/* stdout of `pdmoe args` (malloc'd) and its exit status. */
static double num(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    cr_assert(json_is_number(v), "no number %s", key);
    return json_number_value(v);
}

Test(bench_prefill, json_runs_and_shares)
{
    if (access("models/mini/model.safetensors", R_OK) != 0)
        cr_skip_test("models/mini not generated");
    static struct run cmd;
    run("bench prefill --json --quick --threads 1,2 --tokens 16,40 --reps 1", &cmd);
    const char *out = cmd.out;
    cr_assert_eq(cmd.status, 0, "exit %d: %s %s", cmd.status, out, cmd.err);
    json_error_t je;
    json_t *doc = json_loads(out, 0, &je);
    cr_assert_not_null(doc, "%s: %s", je.text, out);
    json_t *runs = json_object_get(doc, "runs");
    cr_assert_eq(json_array_size(runs), 4);
    json_t *cfg = json_load_file("models/mini/config.json", 0, &je);
    cr_assert_not_null(cfg, "%s", je.text);
    const double top_k = num(cfg, "num_experts_per_tok"), layers = num(cfg, "num_hidden_layers");
    json_decref(cfg);
    cr_assert(num(doc, "load_average_start") >= 0 && num(doc, "load_average_end") >= 0);
    /* this machine has AVX2 at least: the engine's int8 kernel has a probe, named */
    json_t *probe = json_object_get(doc, "int8_probe");
    cr_assert(json_is_string(probe) && strlen(json_string_value(probe)) > 0, "%s", out);
    static const char *const parts[] = {"gemm", "attention", "moe", "exchange", "other"};
    for (size_t i = 0; i < 4; i++) {
        json_t *r = json_array_get(runs, i);
        int threads = (int)json_integer_value(json_object_get(r, "threads"));
        int tokens = (int)json_integer_value(json_object_get(r, "tokens"));
        cr_assert_eq(threads, i < 2 ? 1 : 2, "run %zu", i);
        cr_assert_eq(tokens, i % 2 ? 40 : 16, "run %zu", i);
        double sec = num(r, "seconds");
        cr_assert(sec > 0 && isfinite(sec));
        cr_assert(fabs(num(r, "tokens_per_s") - tokens / sec) <= 1e-4 * tokens / sec);
        if (threads == 1)
            cr_assert_eq(num(r, "vs_1_thread"), 1.0);
        json_t *sh = json_object_get(r, "shares");
        double sum = 0;
        for (int p = 0; p < 5; p++) {
            double s = num(sh, parts[p]);
            cr_assert(s >= 0 && s <= 1, "run %zu: %s share %g", i, parts[p], s);
            sum += s;
        }
        /* each share printed to 6 significant digits */
        cr_assert(fabs(sum - 1) < 1e-5, "run %zu: shares add up to %g", i, sum);
        /* every step runs matrix products, attention and MoE layers; one process, no exchange */
        cr_assert_gt(num(sh, "gemm"), 0, "run %zu", i);
        cr_assert_gt(num(sh, "attention"), 0, "run %zu", i);
        cr_assert_gt(num(sh, "moe"), 0, "run %zu", i);
        cr_assert_eq(num(sh, "exchange"), 0, "run %zu", i);
        /* the pieces inside the parts: the experts' products within GEMM, the heads within
         * attention, the float products (mini's bf16 projections, router, head) within the parts
         * that are not GEMM; each of them present in every step */
        json_t *dt = json_object_get(r, "detail");
        const double ex = num(dt, "gemm_routed_experts"), fl = num(dt, "float_products"), hd = num(dt, "attention_heads");
        cr_assert(ex > 0 && ex <= num(sh, "gemm") * (1 + 1e-5), "run %zu: experts %g, GEMM %g", i, ex, num(sh, "gemm"));
        cr_assert(hd > 0 && hd <= num(sh, "attention") * (1 + 1e-5), "run %zu: heads %g, attention %g", i, hd,
                  num(sh, "attention"));
        cr_assert(fl > 0 && fl <= (1 - num(sh, "gemm")) * (1 + 1e-5), "run %zu: float products %g, GEMM %g", i, fl,
                  num(sh, "gemm"));

        /* the bound: every figure positive; of_bound is bound over step, the bound at least the
         * bandwidth-only one, which is the weights' bytes at the bandwidth (6 significant digits) */
        static const char *const pos[] = {"weight_bytes", "routed_experts", "bandwidth_gb_per_s", "fp32_peak_gflops",
                                          "bandwidth_bound_ms", "bound_ms", "of_bound", "gemm_ms", "gemm_int8_ops",
                                          "gemm_gops", "int8_peak_gops", "gemm_of_int8_peak"};
        for (size_t k = 0; k < sizeof pos / sizeof pos[0]; k++)
            cr_assert(num(r, pos[k]) > 0 && isfinite(num(r, pos[k])), "run %zu: %s %g", i, pos[k], num(r, pos[k]));
        const double bound_ms = num(r, "bound_ms"), bw_ms = num(r, "bandwidth_bound_ms");
        cr_assert(fabs(num(r, "of_bound") - bound_ms / (sec * 1e3)) <= 1e-4 * num(r, "of_bound"), "run %zu: of_bound %g, "
                  "bound %g ms, step %g s", i, num(r, "of_bound"), bound_ms, sec);
        cr_assert_geq(bound_ms, bw_ms * (1 - 1e-5), "run %zu", i);
        cr_assert(fabs(bw_ms - num(r, "weight_bytes") / num(r, "bandwidth_gb_per_s") / 1e6) <= 1e-4 * bw_ms, "run %zu", i);
        /* the routed pairs are the engine's: T x top-k in every layer */
        cr_assert_eq(num(r, "routed_pairs"), tokens * top_k * layers, "run %zu: %g pairs", i, num(r, "routed_pairs"));
        cr_assert_leq(num(r, "routed_experts"), num(r, "routed_pairs"), "run %zu", i);
        /* the GEMM part: its int8 ops over its time, against the peak */
        const double gops = num(r, "gemm_gops");
        cr_assert(fabs(gops - num(r, "gemm_int8_ops") / (num(r, "gemm_ms") * 1e-3) / 1e9) <= 1e-4 * gops, "run %zu", i);
        cr_assert(fabs(num(r, "gemm_of_int8_peak") - gops / num(r, "int8_peak_gops")) <= 1e-4 * num(r, "gemm_of_int8_peak"),
                  "run %zu", i);
        /* one timed step (--reps 1): its GEMM part lies within it */
        cr_assert_leq(num(r, "gemm_ms"), sec * 1e3 * 1.0001, "run %zu: GEMM %g ms in a %g s step", i, num(r, "gemm_ms"),
                      sec);
    }
    /* per thread count one set of ceilings; the work grows with the tokens, and the bound with it */
    for (size_t i = 0; i < 4; i += 2) {
        json_t *a = json_array_get(runs, i), *b = json_array_get(runs, i + 1);
        cr_assert_eq(num(a, "int8_peak_gops"), num(b, "int8_peak_gops"));
        cr_assert_eq(num(a, "bandwidth_gb_per_s"), num(b, "bandwidth_gb_per_s"));
        cr_assert_gt(num(b, "gemm_int8_ops"), num(a, "gemm_int8_ops"));
        cr_assert_geq(num(b, "bound_ms"), num(a, "bound_ms"));
    }
    /* the same prompt at 1 and 2 threads: the same work */
    for (size_t i = 0; i < 2; i++)
        cr_assert_eq(num(json_array_get(runs, i), "gemm_int8_ops"), num(json_array_get(runs, i + 2), "gemm_int8_ops"));
    json_decref(doc);
}

Test(bench_prefill, bad_flags_refused_by_name)
{
    static struct run r;
    run("bench prefill --tokens 0", &r);
    cr_assert_eq(r.status, 2, "exit %d: %s", r.status, r.err);
    cr_assert(strstr(r.err, "bench prefill: --tokens '0': want up to 8 comma-separated integers in [1, 65536]"), "%s", r.err);
    run("bench prefill --threads 1,x", &r);
    cr_assert_eq(r.status, 2, "exit %d: %s", r.status, r.err);
    cr_assert(strstr(r.err, "--threads '1,x'"), "%s", r.err);
    run("bench prefill --reps 0", &r);
    cr_assert_eq(r.status, 2, "exit %d: %s", r.status, r.err);
    cr_assert(strstr(r.err, "--reps '0': want an integer in [1, 100]"), "%s", r.err);
    run("bench prefill --cpu-time --threads 1,2", &r);
    cr_assert_eq(r.status, 2, "exit %d: %s", r.status, r.err);
    cr_assert(strstr(r.err, "bench prefill: --cpu-time times the calling thread only: it needs --threads 1"), "%s", r.err);
    run("bench prefill --frobnicate", &r);
    cr_assert_neq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.err, "frobnicate"), "%s", r.err);
}

/* A step's routing is counted per step: with every rep the same prompt, the routed experts, pairs,
 * bytes and int8 ops of a step do not depend on --reps. Counted once over all reps and divided,
 * the distinct experts of 3 reps read a third of one step's (682.667 of 2,048 at 512 tokens). */
Test(bench_prefill, routing_is_per_step)
{
    if (access("models/mini/model.safetensors", R_OK) != 0)
        cr_skip_test("models/mini not generated");
    static const char *const keys[] = {"routed_experts", "routed_pairs", "weight_bytes", "gemm_int8_ops"};
    double v[2][4];
    for (int i = 0; i < 2; i++) {
        static struct run cmd;
        run(i ? "bench prefill --json --quick --threads 1 --tokens 16 --reps 3"
              : "bench prefill --json --quick --threads 1 --tokens 16 --reps 1", &cmd);
        cr_assert_eq(cmd.status, 0, "exit %d: %s %s", cmd.status, cmd.out, cmd.err);
        json_t *doc = json_loads(cmd.out, 0, NULL);
        cr_assert_not_null(doc, "%s", cmd.out);
        json_t *r = json_array_get(json_object_get(doc, "runs"), 0);
        for (int k = 0; k < 4; k++)
            v[i][k] = num(r, keys[k]);
        json_decref(doc);
    }
    for (int k = 0; k < 4; k++)
        cr_assert(fabs(v[0][k] - v[1][k]) <= 1e-5 * v[0][k], "%s: %g at 1 rep, %g at 3", keys[k], v[0][k], v[1][k]);
}

/* `pdmoe bench prefill`: tokens/s per prompt length and thread count, each part's share of the
 * step from the engine's profile (GEMM, attention, MoE, exchange, other), --json; bad flags
 * refused by name. */
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
    run("bench prefill --json --threads 1,2 --tokens 16,40 --reps 1", &cmd);
    const char *out = cmd.out;
    cr_assert_eq(cmd.status, 0, "exit %d: %s %s", cmd.status, out, cmd.err);
    json_error_t je;
    json_t *doc = json_loads(out, 0, &je);
    cr_assert_not_null(doc, "%s: %s", je.text, out);
    json_t *runs = json_object_get(doc, "runs");
    cr_assert_eq(json_array_size(runs), 4);
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
    }
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

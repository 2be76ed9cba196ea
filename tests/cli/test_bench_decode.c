/* `pdmoe bench decode --json`: the bound with arithmetic in it against the bandwidth roofline:
 * never below the weights' bytes at the bandwidth, equal to it at one token a step (every
 * product streams its weights faster than it multiplies them), above it at 16 where the float
 * matrices cost 32 flops per 2 bytes, wherever the FMA peak is under 16 flops per byte of bandwidth
 * (an instrumented build's bandwidth probe reads slower, so the margin is not fixed); each fraction
 * the bound or roofline over the step's time. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <unistd.h>

#include "../run.h"

static double num(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    cr_assert(json_is_number(v), "no number %s", key);
    return json_number_value(v);
}

/* The one case of `bench decode --quick --json --threads 1 --batch B`. */
static json_t *one_case(int batch, json_t **doc)
{
    char args[96];
    snprintf(args, sizeof args, "bench decode --quick --json --threads 1 --batch %d", batch);
    static struct run cmd;
    run(args, &cmd);
    cr_assert_eq(cmd.status, 0, "exit %d: %s %s", cmd.status, cmd.out, cmd.err);
    json_error_t je;
    *doc = json_loads(cmd.out, 0, &je);
    cr_assert_not_null(*doc, "%s: %s", je.text, cmd.out);
    json_t *cases = json_object_get(*doc, "cases");
    cr_assert_eq(json_array_size(cases), 1);
    json_t *c = json_array_get(cases, 0);
    cr_assert_eq(json_integer_value(json_object_get(c, "batch")), batch);
    return c;
}

Test(bench_decode, bound_against_the_bandwidth_roofline)
{
    if (access("models/mini/model.safetensors", R_OK) != 0)
        cr_skip_test("models/mini not generated");
    for (int batch = 1; batch <= 16; batch *= 16) {
        json_t *doc;
        json_t *c = one_case(batch, &doc);
        const double step = num(c, "step_ms"), bound = num(c, "bound_ms_per_step");
        const double roof = num(c, "weight_bytes_per_step") / num(c, "bandwidth_bytes_per_s") * 1e3;
        cr_assert(roof > 0 && isfinite(bound), "batch %d: roofline %g ms, bound %g ms", batch, roof, bound);
        cr_assert_float_eq(num(c, "of_bandwidth_roofline"), roof / step, 1e-9);
        cr_assert_float_eq(num(c, "of_bandwidth_and_compute_bound"), bound / step, 1e-9);
        cr_assert_geq(bound, roof * (1 - 1e-12), "batch %d: the bound %g ms below the bytes' %g ms", batch, bound,
                      roof);
        if (batch == 1)
            cr_assert_float_eq(bound, roof, 1e-9 * roof, "one token a step streams: %g against %g ms", bound, roof);
        else if (num(c, "fp32_peak_flops") > 0 && num(c, "fp32_peak_flops") < 16 * num(c, "bandwidth_bytes_per_s"))
            /* a bf16 weight read in 2 bytes costs 2 x 16 flops: slower to multiply than to read */
            cr_assert_gt(bound, roof, "16 tokens: the float products bind: %g against %g ms", bound, roof);
        json_decref(doc);
    }
}

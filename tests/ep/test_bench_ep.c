/* `pdmoe bench ep --json` (real processes under mpirun): one document whose groups report, per
 * token count, the exchange's time against a raw MPI_Alltoallv of the same volumes timed in the
 * same run, with the ratios computed from those times, medians inside their interquartile ranges;
 * one rank sends nothing, two do; and `--check`, the exchange's outputs against local ones. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../tmpmodel.h"

static char dir[64];

static void setup(void)
{
    tmp_model("v4-tiny", 3, dir, sizeof dir);
    mpi_test_env();
}

static void teardown(void)
{
    rm_model(dir);
}

TestSuite(bench_ep, .init = setup, .fini = teardown, .timeout = 300);

static double num(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    cr_assert(json_is_number(v), "no number \"%s\"", key);
    return json_number_value(v);
}

/* r = a / b, for a, b and r rounded to 0.001 (twice the worst case of the rounding as margin). */
static int quotient(double r, double a, double b)
{
    double q = a / b;
    return fabs(r - q) <= 2 * (0.0005 + q * (0.0005 / a + 0.0005 / b));
}

Test(bench_ep, json_ratios_of_the_same_run)
{
    const char *bin = getenv("PDMOE_BIN");
    char cmd[512];
    snprintf(cmd, sizeof cmd, "timeout 240 %s bench ep --ranks 1,2 --model %s --quick --json", bin ? bin : "build/pdmoe",
             dir);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    static char out[1 << 16];
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    int st = pclose(p);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: status %d: %s", cmd, st, out);
    json_error_t je;
    json_t *doc = json_loads(out, 0, &je);   /* the whole of stdout is the document */
    cr_assert_not_null(doc, "%s: %s", je.text, out);
    cr_assert_str_eq(json_string_value(json_object_get(doc, "bench")), "ep");
    cr_assert_str_eq(json_string_value(json_object_get(doc, "model")), dir);
    json_t *groups = json_object_get(doc, "groups");
    cr_assert_eq(json_array_size(groups), 2, "%s", out);
    for (size_t g = 0; g < 2; g++) {
        json_t *grp = json_array_get(groups, g);
        cr_assert_eq(json_integer_value(json_object_get(grp, "ranks")), (json_int_t)g + 1);
        cr_assert_gt(num(grp, "decode_tokens_per_s"), 0);
        /* 16 sequences of their own: a step's 16 tokens go to many experts a layer (one prompt for
         * all made 16 copies of one sequence under greedy decoding: exactly top-k experts, 4 of
         * v4-tiny's 16, every step, and a 2-rank group measured slower than 1 rank) */
        const double routed = num(grp, "decode_experts_per_layer");
        cr_assert(routed > 8 && routed <= 16, "%g distinct experts a layer per step: %s", routed, out);
        json_t *cases = json_object_get(grp, "cases");
        cr_assert_eq(json_array_size(cases), 3, "--quick: 1, 4 and 16 tokens per rank");
        for (size_t i = 0; i < 3; i++) {
            json_t *c = json_array_get(cases, i);
            cr_assert_eq(json_integer_value(json_object_get(c, "tokens_per_rank")), 1 << (2 * i));
            double bytes = num(c, "bytes_out_per_rank");
            if (g == 0)
                cr_assert_eq(bytes, 0, "one rank sent %g bytes", bytes);
            else
                cr_assert_gt(bytes, 0, "two ranks exchanged nothing");
            double ex = num(c, "exchange_us"), ex_min = num(c, "exchange_min_us");
            double raw = num(c, "raw_alltoallv_us"), raw_min = num(c, "raw_alltoallv_min_us");
            double peers = num(c, "raw_peers_us"), peers_min = num(c, "raw_peers_min_us");
            cr_assert(ex > 0 && raw > 0 && peers > 0 && ex_min > 0 && raw_min > 0 && peers_min > 0, "%s", out);
            cr_assert(ex_min <= ex && raw_min <= raw && peers_min <= peers, "a minimum above its median: %s", out);
            /* the interquartile ranges bracket the medians, the 10th percentiles between them and
             * the minimums */
            double ex25 = num(c, "exchange_p25_us"), ex75 = num(c, "exchange_p75_us");
            double raw25 = num(c, "raw_alltoallv_p25_us"), raw75 = num(c, "raw_alltoallv_p75_us");
            cr_assert(ex_min <= ex25 && ex25 <= ex && ex <= ex75, "%s", out);
            cr_assert(raw_min <= raw25 && raw25 <= raw && raw <= raw75, "%s", out);
            double ex10 = num(c, "exchange_p10_us"), raw10 = num(c, "raw_alltoallv_p10_us");
            cr_assert(ex_min <= ex10 && ex10 <= ex25 && raw_min <= raw10 && raw10 <= raw25, "%s", out);
            cr_assert(quotient(num(c, "ratio_p10"), ex10, raw10), "%s", out);
            int reps = (int)json_integer_value(json_object_get(c, "reps")), slept = (int)num(c, "reps_with_sleeps");
            cr_assert_eq(reps, 5, "--quick: 5 repetitions");
            cr_assert(slept >= 0 && slept <= reps, "%s", out);
            /* the paired ratio: the median of each repetition's exchange / raw */
            cr_assert(num(c, "ratio_paired") > 0, "%s", out);
            /* each ratio is the quotient of the times printed beside it (to 0.001 us, itself to 0.001) */
            cr_assert(quotient(num(c, "ratio"), ex, raw), "%s", out);
            cr_assert(quotient(num(c, "ratio_min"), ex_min, raw_min), "%s", out);
            cr_assert(quotient(num(c, "ratio_peers"), ex, peers), "%s", out);
            cr_assert(quotient(num(c, "ratio_peers_min"), ex_min, peers_min), "%s", out);
            /* issue 17.6's target, stated for 2 ranks, judges the ratio of the medians as printed */
            json_t *t = json_object_get(c, "target");
            if (g == 0) {
                cr_assert_null(t, "a target at one rank: %s", out);
            } else {
                cr_assert_str_eq(json_string_value(json_object_get(t, "metric")), "ratio");
                cr_assert_float_eq(num(t, "max"), 1.5, 1e-12);
                cr_assert(json_is_boolean(json_object_get(t, "met")) &&
                              json_is_true(json_object_get(t, "met")) == (num(c, "ratio") <= 1.5),
                          "ratio %g judged against 1.5: %s", num(c, "ratio"), out);
            }
        }
    }
    cr_assert(json_is_string(json_object_get(json_object_get(doc, "machine"), "cpu")), "no machine: %s", out);
    json_decref(doc);
}

/* --check: for 1, 2 and 4 ranks the exchange's outputs equal running every pair locally, byte for
 * byte: 0, 1 and 256 tokens per rank, random routing, each rank's tokens to its own experts
 * (every dispatch empty, nothing received), everyone's to rank 0's, odd ranks without tokens.
 * v4-tiny's hidden size of 64 puts more than 7 pairs' records on several rows of a message. */
Test(bench_ep, check_outputs_identical_to_local)
{
    const char *bin = getenv("PDMOE_BIN");
    char cmd[512], err[] = "/tmp/pdmoe-bench-ep-err-XXXXXX";
    int fd = mkstemp(err);
    cr_assert(fd >= 0);
    close(fd);
    snprintf(cmd, sizeof cmd, "timeout 240 %s bench ep --ranks 1,2,4 --model %s --check 2>%s",
             bin ? bin : "build/pdmoe", dir, err);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    static char out[1 << 14];
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    int st = pclose(p);
    char msg[4096] = "";
    FILE *f = fopen(err, "r");
    if (f) {
        msg[fread(msg, 1, sizeof msg - 1, f)] = 0;
        fclose(f);
    }
    remove(err);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: status %d: %s%s", cmd, st, out, msg);
    for (int r = 1; r <= 4; r *= 2) {
        char want[256];
        snprintf(want, sizeof want, "bench ep --check: %d rank%s, 18 exchanges (%s): outputs identical", r,
                 r > 1 ? "s" : "", dir);
        cr_assert(strstr(out, want), "\"%s\" not in: %s", want, out);
    }
}

Test(bench_ep, check_refuses_json)
{
    const char *bin = getenv("PDMOE_BIN");
    char cmd[512];
    snprintf(cmd, sizeof cmd, "%s bench ep --ranks 2 --model %s --check --json 2>&1", bin ? bin : "build/pdmoe", dir);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    char out[1024];
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    int st = pclose(p);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 2, "status %d: %s", st, out);
    cr_assert(strstr(out, "--check") && strstr(out, "--json"), "%s", out);
}

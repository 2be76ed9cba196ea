/* One command's output is another's input: `pdmoe generate --speculative-config ... --spec-stats
 * FILE` writes the engine's acceptance counters, and `pdmoe plan --spec-stats FILE` predicts with
 * them: its tokens per step is 1 + the sum over positions of accepted / drafted, as the equation
 * of plan/mtp.h says, and its TPOT the decode step over that. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../run.h"
#include "../tmpmodel.h"

static char dir[64];

static void make_model(void)
{
    tmp_model_agree("v4-tiny", 5, 0.8, dir, sizeof dir);
}

static void remove_model(void)
{
    rm_model(dir);
}

TestSuite(spec_plan_cli, .init = make_model, .fini = remove_model);

Test(spec_plan_cli, generate_stats_feed_plan)
{
    static struct run r;
    char stats[] = "/tmp/pdmoe-spec-stats-XXXXXX", args[1024];
    int fd = mkstemp(stats);
    cr_assert_geq(fd, 0);
    close(fd);
    snprintf(args, sizeof args,
             "generate --model %s --prompt 'The quick brown fox' --prompt 'a b c d' --max-tokens 40 --threads 1 "
             "--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":3}' --spec-stats %s",
             dir, stats);
    run(args, &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    json_error_t je;
    json_t *s = json_load_file(stats, 0, &je);
    cr_assert(s, "%s: %s", stats, je.text);
    cr_assert_eq(json_integer_value(json_object_get(s, "num_speculative_tokens")), 3);
    cr_assert_eq(json_integer_value(json_object_get(s, "sequences")), 2);
    cr_assert_eq(json_integer_value(json_object_get(s, "decode_tokens")), 2 * 39);
    /* one streamed prompt: its line counts the tokens the decode phase made, as the file does
     * (it said 40 beside the file's 39) */
    {
        static struct run r1;
        snprintf(args, sizeof args,
                 "generate --model %s --prompt 'The quick brown fox' --max-tokens 40 --threads 1 "
                 "--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":3}' --spec-stats %s.1",
                 dir, stats);
        run(args, &r1);
        cr_assert_eq(r1.status, 0, "%s", r1.err);
        char f1[64];
        snprintf(f1, sizeof f1, "%s.1", stats);
        json_t *s1 = json_load_file(f1, 0, &je);
        cr_assert(s1, "%s", je.text);
        char want[96];
        snprintf(want, sizeof want, "decode: %lld tokens after the prompt's first,",
                 (long long)json_integer_value(json_object_get(s1, "decode_tokens")));
        cr_assert(strstr(r1.err, want), "no \"%s\" in %s", want, r1.err);
        json_decref(s1);
        remove(f1);
    }
    json_t *acc = json_object_get(s, "num_accepted_tokens_per_pos"), *dr = json_object_get(s, "num_drafted_tokens_per_pos");
    double tps = 1, sum_acc = 0;
    for (size_t j = 0; j < 3; j++) {
        double a = (double)json_integer_value(json_array_get(acc, j)), d = (double)json_integer_value(json_array_get(dr, j));
        cr_assert_gt(d, 0);
        tps += a / d;
        sum_acc += a;
    }
    cr_assert_eq((double)json_integer_value(json_object_get(s, "num_accepted_tokens")), sum_acc);
    cr_assert_gt(tps, 1.5, "the draft agrees at about 0.8: %g tokens per step", tps);
    json_decref(s);

    snprintf(args, sizeof args,
             "plan --model %s --hardware h100 --nodes 1 --prefill dp=1,tp=1,instances=1 --decode dp=1,tp=1,instances=1 "
             "--max-model-len 1024 --isl 16 --osl 40 --spec-stats %s --json", dir, stats);
    run(args, &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    json_t *p = json_loads(r.out, 0, &je), *perf = json_object_get(p, "perf");
    cr_assert(perf, "%s", je.text);
    cr_assert_eq(json_integer_value(json_object_get(perf, "num_speculative_tokens")), 3);
    cr_assert_float_eq(json_real_value(json_object_get(perf, "tokens_per_step")), tps, 1e-9);
    double step = json_real_value(json_object_get(json_object_get(perf, "decode_step"), "total_s"));
    cr_assert_float_eq(json_real_value(json_object_get(perf, "tpot_s")), step / tps, 1e-12);
    json_decref(p);

    /* the text report names the source */
    snprintf(args, sizeof args, "plan --model %s --hardware h100 --nodes 1 --prefill dp=1,tp=1,instances=1 "
             "--decode dp=1,tp=1,instances=1 --max-model-len 1024 --isl 16 --osl 40 --spec-stats %s", dir, stats);
    run(args, &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "3 MTP drafts per decode step") && strstr(r.out, stats), "%s", r.out);
    unlink(stats);
}

Test(spec_plan_cli, bad_flags_are_refused_by_name)
{
    static struct run r;
    char args[1024];
    snprintf(args, sizeof args, "generate --model %s --prompt hi --max-tokens 2 --spec-stats /tmp/x.json", dir);
    run(args, &r);
    cr_assert_eq(r.status, 2);
    cr_assert(strstr(r.err, "--spec-stats /tmp/x.json: needs --speculative-config"), "%s", r.err);
    run("plan --model v4-tiny --isl 16 --osl 8 --spec-stats /nonexistent/spec.json", &r);
    cr_assert_neq(r.status, 0);
    cr_assert(strstr(r.err, "/nonexistent/spec.json"), "%s", r.err);
    run("plan --model v4-tiny --isl 16 --osl 8 --mtp-acceptance 0.9,1.2", &r);
    cr_assert_neq(r.status, 0);
    cr_assert(strstr(r.err, "--mtp-acceptance 0.9,1.2"), "%s", r.err);
    run("plan --model v4-tiny --isl 16 --osl 8 --speculative-config '{\"method\":\"eagle\",\"num_speculative_tokens\":2}'", &r);
    cr_assert_neq(r.status, 0);
    cr_assert(strstr(r.err, "eagle"), "%s", r.err);
    run("search --model v4-tiny --cards 8 --isl 16 --osl 8 --mtp off --speculative-config "
        "'{\"method\":\"mtp\",\"num_speculative_tokens\":2}'", &r);
    cr_assert_neq(r.status, 0);
    cr_assert(strstr(r.err, "--speculative-config: no MTP layer is loaded (--mtp off)"), "%s", r.err);
}

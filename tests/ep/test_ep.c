/* Expert parallelism across real processes (mpirun): the same tokens and logits for 1, 2, 4 and
 * 8 ranks, whatever the batch composition (ranks without sequences, experts without tokens);
 * each rank loads exactly the bytes the plan gives it; a rank that dies ends the group. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/genmodel.h"
#include "../tmpmodel.h"
#include "plan/plan.h"

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

TestSuite(ep, .init = setup, .fini = teardown, .timeout = 300);

static const char *bin(void)
{
    return getenv("PDMOE_BIN") ? getenv("PDMOE_BIN") : "build/pdmoe";
}

/* Runs a command; returns its exit status and its stdout in out (cap bytes). */
static int run(const char *cmd, char *out, size_t cap, char *err, size_t ecap)
{
    char o[] = "/tmp/pdmoe-ep-out-XXXXXX", x[] = "/tmp/pdmoe-ep-err-XXXXXX", full[4096];
    int fo = mkstemp(o), fx = mkstemp(x);
    cr_assert(fo >= 0 && fx >= 0);
    snprintf(full, sizeof full, "%s >%s 2>%s", cmd, o, x);
    int st = system(full);
    FILE *f = fopen(o, "rb");
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = 0;
    /* generated text may hold NUL bytes: make them visible so string functions see everything */
    for (size_t i = 0; i < n; i++)
        if (!out[i])
            out[i] = 1;
    fclose(f);
    if (err) {
        f = fopen(x, "rb");
        n = fread(err, 1, ecap - 1, f);
        err[n] = 0;
        fclose(f);
    }
    remove(o);
    remove(x);
    close(fo);
    close(fx);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static void generate(int ranks, const char *prompts, char *out, size_t cap)
{
    char cmd[2048], err[8192];
    if (ranks == 0)
        snprintf(cmd, sizeof cmd, "%s generate --model %s %s --max-tokens 12 --print-ids --threads 1", bin(), dir, prompts);
    else
        snprintf(cmd, sizeof cmd,
                 "timeout 120 mpirun -n %d --oversubscribe %s generate --enable-expert-parallel --model %s %s "
                 "--max-tokens 12 --print-ids --threads 1", ranks, bin(), dir, prompts);
    int rc = run(cmd, out, cap, err, sizeof err);
    cr_assert_eq(rc, 0, "%s\nexited %d: %s", cmd, rc, err);
}

static void same_for_all_group_sizes(const char *prompts, int n_prompts)
{
    static char want[1 << 16], got[1 << 16];
    generate(0, prompts, want, sizeof want);
    /* every prompt reported, with its ids and logits digest */
    for (int i = 0; i < n_prompts; i++) {
        char tag[32];
        snprintf(tag, sizeof tag, "[%d] logits-digest ", i);
        cr_assert(strstr(want, tag), "missing %s in %s", tag, want);
    }
    int sizes[] = {1, 2, 4, 8};
    for (int i = 0; i < 4; i++) {
        generate(sizes[i], prompts, got, sizeof got);
        cr_assert_str_eq(got, want, "%d ranks differ from one process", sizes[i]);
    }
}

Test(ep, identical_tokens_and_logits_one_prompt)
{
    /* one sequence: ranks 1..N-1 hold none and still take part in every exchange */
    same_for_all_group_sizes("--prompt 'The quick brown fox jumps over the lazy dog'", 1);
}

Test(ep, identical_tokens_and_logits_several_batches)
{
    same_for_all_group_sizes("--prompt Hello --prompt 'Once upon a time, in a small town by the sea' --prompt x", 3);
    same_for_all_group_sizes("--prompt a --prompt b --prompt 'good morning' --prompt 'Numbers: 1 2 3 4 5 6 7 8 9' "
                             "--prompt 'def add(a, b):' --prompt '{\"model\": \"mini\"}' --prompt 'The end.' "
                             "--prompt 'Why is the sky blue?' --prompt q",
                             9);
}

/* fp8 KV: every rank quantizes its own sequences' cache the same way, so 2 ranks still give one
 * process's tokens and logits; and the flag takes effect (the logits differ from bf16's) */
Test(ep, fp8_kv_identical_for_1_and_2_ranks)
{
    static char bf16[1 << 16], want[1 << 16], got[1 << 16];
    const char *p = "--prompt 'Once upon a time, in a small town by the sea' --prompt x";
    char fp8[256];
    snprintf(fp8, sizeof fp8, "%s --kv-cache-dtype fp8", p);
    generate(0, p, bf16, sizeof bf16);
    generate(0, fp8, want, sizeof want);
    cr_assert_str_neq(want, bf16, "--kv-cache-dtype fp8 changed nothing");
    generate(2, fp8, got, sizeof got);
    cr_assert_str_eq(got, want, "2 ranks differ from one process with fp8 KV");
}

Test(ep, experts_without_tokens_are_covered)
{
    /* a short run leaves some experts of some layers without a token: the exchange must cope */
    char cmd[1024], out[8192], err[4096], stats[96];
    snprintf(stats, sizeof stats, "%s/stats.json", dir);
    snprintf(cmd, sizeof cmd, "timeout 120 mpirun -n 4 --oversubscribe %s generate --enable-expert-parallel --model %s "
             "--prompt hi --max-tokens 2 --threads 1 --expert-stats %s", bin(), dir, stats);
    cr_assert_eq(run(cmd, out, sizeof out, err, sizeof err), 0, "%s", err);
    FILE *f = fopen(stats, "r");
    cr_assert_not_null(f);
    char buf[8192];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    unlink(stats);
    cr_assert(strstr(buf, "\"ranks\": 4"), "%s", buf);
    /* "[0, " or ", 0," appears: an expert with no token */
    cr_assert(strstr(buf, ", 0,") || strstr(buf, "[0,"), "%s", buf);
    /* every token of every layer was run by exactly one expert slot: 3 tokens (BOS, h, i...)
     * x top-4 per layer at least */
    cr_assert(strstr(buf, "tokens_per_expert"));
}

/* The plan of an EP group of `ranks` on the suite's checkpoint (every tensor it holds). */
static void plan_of(int ranks, struct pd_plan *p)
{
    struct pd_plan_opts o;
    pd_err e = {0};
    pd_plan_opts_default(&o);
    o.model = NULL;
    o.checkpoint = dir;
    o.role[0] = (struct pd_role_opts){.dp = ranks, .tp = 1, .instances = 1};
    o.role[1] = (struct pd_role_opts){.dp = ranks, .tp = 1, .instances = 1};
    cr_assert_eq(pd_plan_build(&o, p, &e), 0, "%s", e.msg);
}

/* Each rank loads the routed experts the plan puts on its card, the MTP layer's among them (the
 * same placement rule: expert x of every MoE layer on one rank), with or without speculation. */
Test(ep, rank_weights_equal_the_plan)
{
    const char *spec[2] = {"", "--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":2}'"};
    for (int ranks = 2; ranks <= 4; ranks *= 2)
        for (int sp = 0; sp < 2; sp++) {
            char cmd[1024], out[8192], err[4096];
            snprintf(cmd, sizeof cmd, "timeout 120 mpirun -n %d --oversubscribe %s generate --enable-expert-parallel "
                     "--model %s --prompt hi --max-tokens 3 --threads 1 --report-weights %s", ranks, bin(), dir,
                     spec[sp]);
            cr_assert_eq(run(cmd, out, sizeof out, err, sizeof err), 0, "%s", err);
            struct pd_plan p;
            plan_of(ranks, &p);
            /* the MTP layer's experts are part of the per-card figure */
            cr_assert(p.include_mtp);
            cr_assert_eq(p.inv.n_moe_layers, p.model.n_layers + 1);
            for (int k = 0; k < ranks; k++) {
                char want[160];
                int64_t ci = pd_placement_rank_bytes(&p.role[0].place, k, p.inv.expert_bytes);
                snprintf(want, sizeof want, "rank %d weights: class I %" PRId64 " bytes, class II %" PRId64 " bytes", k,
                         ci, p.role[0].b.class_ii);
                cr_assert(strstr(out, want), "%d ranks%s: \"%s\" not in:\n%s", ranks, sp ? " with MTP" : "", want, out);
            }
            pd_plan_free(&p);
        }
}

Test(ep, a_dead_rank_ends_the_group)
{
    char cmd[1024], out[4096], err[16384];
    snprintf(cmd, sizeof cmd, "PDMOE_FAULT_KILL_RANK=1 PDMOE_FAULT_KILL_STEP=3 timeout 60 mpirun -n 4 --oversubscribe "
             "%s generate --enable-expert-parallel --model %s --prompt a --prompt b --prompt c --prompt d "
             "--max-tokens 20 --threads 1", bin(), dir);
    int rc = run(cmd, out, sizeof out, err, sizeof err);
    cr_assert_neq(rc, 0, "the group finished although rank 1 died");
    cr_assert_neq(rc, 124, "the group hung until the timeout");
    cr_assert(strstr(err, "rank 1") || strstr(err, "signal 9"), "no word of the dead rank: %s", err);
}

Test(ep, mini_identical_for_1_2_4_ranks)
{
    /* v4-flash-mini (256 experts, top-6) when models/mini exists, as in CI */
    if (access("models/mini/model.safetensors", R_OK) != 0)
        cr_skip_test("models/mini not generated (./build/pdmoe gen-model --preset v4-flash-mini --out models/mini)");
    static char want[1 << 16], got[1 << 16];
    char cmd[2048], err[8192];
    const char *p = "--prompt Hello --prompt 'The sea froze over' --prompt 'Numbers: 1 2 3' --max-tokens 8 --print-ids "
                    "--threads 1";
    snprintf(cmd, sizeof cmd, "%s generate --model models/mini %s", bin(), p);
    cr_assert_eq(run(cmd, want, sizeof want, err, sizeof err), 0, "%s", err);
    for (int n = 1; n <= 4; n *= 2) {
        snprintf(cmd, sizeof cmd, "timeout 300 mpirun -n %d --oversubscribe %s generate --enable-expert-parallel "
                 "--model models/mini %s", n, bin(), p);
        cr_assert_eq(run(cmd, got, sizeof got, err, sizeof err), 0, "%s", err);
        cr_assert_str_eq(got, want, "%d ranks differ from one process", n);
    }
}

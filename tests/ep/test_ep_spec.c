/* MTP speculative decoding in an EP group (mpirun, real processes): `generate
 * --enable-expert-parallel --speculative-config` gives plain decoding's ids and logits digests,
 * bit for bit, for k = 1..3, whether both ranks hold sequences or one holds none, and the group's
 * acceptance statistics are printed once, summed over the ranks. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../run.h"
#include "../tmpmodel.h"

static char dir[64];

static void setup(void)
{
    /* a draft that agrees with the main model about 60% of the time: drafts are accepted and
     * rejected, so both the kept and the rolled-back paths run on every rank */
    tmp_model_agree("v4-tiny", 9, 0.6, dir, sizeof dir);
    mpi_test_env();
}

static void teardown(void)
{
    rm_model(dir);
}

TestSuite(ep_spec, .init = setup, .fini = teardown, .timeout = 600);

static const char *bin(void)
{
    return getenv("PDMOE_BIN") ? getenv("PDMOE_BIN") : "build/pdmoe";
}

/* `generate` with `args`: plain in one process (ranks 0), or as an EP group of `ranks` under mpirun. */
static void generate(int ranks, const char *args, struct run *r)
{
    char cmd[2048];
    if (ranks)
        snprintf(cmd, sizeof cmd, "timeout 300 mpirun -n %d --oversubscribe %s generate --enable-expert-parallel "
                 "--model %s %s --print-ids --threads 1", ranks, bin(), dir, args);
    else
        snprintf(cmd, sizeof cmd, "%s generate --model %s %s --print-ids --threads 1", bin(), dir, args);
    run_cmd(cmd, r);
    cr_assert_eq(r->status, 0, "%s\nexited %d: %s", cmd, r->status, r->err);
}

static int count(const char *s, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(s, needle); p; p = strstr(p + 1, needle))
        n++;
    return n;
}

static void same_ids_for_k_1_to_3(const char *prompts, int n_prompts)
{
    static struct run plain, spec;
    char args[1024];
    snprintf(args, sizeof args, "%s --max-tokens 40", prompts);
    generate(0, args, &plain);
    char tag[32];
    snprintf(tag, sizeof tag, "[%d] ids ", n_prompts - 1);
    cr_assert(strstr(plain.out, tag), "%s", plain.out);
    for (int k = 1; k <= 3; k++) {
        snprintf(args, sizeof args, "%s --max-tokens 40 --speculative-config "
                 "'{\"method\":\"mtp\",\"num_speculative_tokens\":%d}'", prompts, k);
        generate(2, args, &spec);
        /* text, ids and logits digests alike */
        cr_assert_str_eq(spec.out, plain.out, "k %d: the EP group's speculative output differs from plain decoding", k);
        /* rank 0 prints the group's statistics once */
        cr_assert_eq(count(spec.err, "acceptance per position"), 1, "k %d: %s", k, spec.err);
        const char *at = strstr(spec.err, "acceptance per position ");
        double first = atof(at + strlen("acceptance per position "));
        cr_assert(first > 0.3 && first < 0.9, "k %d: first-position acceptance %.3f at agreement 0.6: %s", k, first,
                  spec.err);
    }
}

Test(ep_spec, two_ranks_with_sequences_on_both_give_plain_decodings_ids)
{
    /* four prompts of different lengths: two sequences per rank, finishing at different rounds */
    same_ids_for_k_1_to_3("--prompt 'The quick brown fox' --prompt 'Hello world, this is' --prompt 'a b c d e f g' "
                          "--prompt 'Once upon a time, in a small town by the sea'", 4);
}

Test(ep_spec, a_rank_without_sequences_takes_every_drafting_step)
{
    /* one prompt: rank 1 holds nothing and still joins each MTP and verify step's exchanges */
    same_ids_for_k_1_to_3("--prompt 'The quick brown fox jumps over the lazy dog'", 1);
}

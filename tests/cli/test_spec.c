/* `pdmoe generate --speculative-config` as a user runs it: the same ids and logits digests as
 * plain decoding for k = 1, 2, 3 on several prompts, the acceptance statistics printed, and
 * every bad configuration refused by name. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../run.h"
#include "../tmpmodel.h"

static char dir[64];

static void make_model(void)
{
    tmp_model_agree("v4-tiny", 9, 0.6, dir, sizeof dir);
}

static void remove_model(void)
{
    rm_model(dir);
}

TestSuite(spec_cli, .init = make_model, .fini = remove_model);

#define PROMPTS "--prompt 'The quick brown fox' --prompt 'Hello world, this is' --prompt 'a b c d e f g'"

Test(spec_cli, generate_with_mtp_gives_plain_decodings_ids)
{
    static struct run plain, spec;
    char args[1024];
    snprintf(args, sizeof args, "generate --model %s " PROMPTS " --max-tokens 60 --print-ids --threads 1", dir);
    run(args, &plain);
    cr_assert_eq(plain.status, 0, "%s", plain.err);
    cr_assert(strstr(plain.out, "[2] ids "), "%s", plain.out);
    for (int k = 1; k <= 3; k++) {
        snprintf(args, sizeof args,
                 "generate --model %s " PROMPTS " --max-tokens 60 --print-ids --threads 1 "
                 "--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": %d}'",
                 dir, k);
        run(args, &spec);
        cr_assert_eq(spec.status, 0, "k %d: %s", k, spec.err);
        /* ids, text and logits digests alike */
        cr_assert_str_eq(spec.out, plain.out, "k %d", k);
        cr_assert(strstr(spec.err, "acceptance per position"), "%s", spec.err);
        cr_assert(strstr(spec.err, "tokens per step"), "%s", spec.err);
    }
    /* one prompt streams: the same text */
    snprintf(args, sizeof args, "generate --model %s --prompt 'The quick brown fox' --max-tokens 30 --threads 1", dir);
    run(args, &plain);
    snprintf(args, sizeof args,
             "generate --model %s --prompt 'The quick brown fox' --max-tokens 30 --threads 1 "
             "--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":2}'",
             dir);
    run(args, &spec);
    cr_assert_eq(spec.status, 0, "%s", spec.err);
    cr_assert_str_eq(spec.out, plain.out);
}

/* Runs generate with --speculative-config `cfg` and expects exit 2 or 1 and one line naming `needle`. */
static void refused(const char *cfg, const char *extra, const char *model, const char *needle)
{
    struct run r;
    char args[1024];
    snprintf(args, sizeof args, "generate --model %s --prompt hi --max-tokens 2 --speculative-config '%s' %s", model,
             cfg, extra);
    run(args, &r);
    cr_assert_neq(r.status, 0, "%s accepted", cfg);
    cr_assert(strstr(r.err, needle), "%s: stderr \"%s\" lacks \"%s\"", cfg, r.err, needle);
    cr_assert_eq(strchr(r.err, '\n'), r.err + strlen(r.err) - 1, "more than one line: %s", r.err);
}

Test(spec_cli, bad_speculative_configs_are_refused_by_name)
{
    refused("{\"method\":\"mtp\",\"num_speculative_tokens\":2,\"draft_model\":\"x\"}", "", dir, "key \"draft_model\"");
    refused("{\"method\":\"eagle\",\"num_speculative_tokens\":2}", "", dir, "method \"eagle\"");
    refused("{\"method\":\"mtp\",\"num_speculative_tokens\":0}", "", dir, "num_speculative_tokens");
    refused("{\"method\":\"mtp\",\"num_speculative_tokens\":9}", "", dir, "num_speculative_tokens");
    refused("{\"num_speculative_tokens\":1}", "", dir, "method");
    refused("{\"method\":\"mtp\"", "", dir, "--speculative-config");
}

Test(spec_cli, a_checkpoint_without_mtp_weights_is_refused_naming_it)
{
    /* the checkpoint's config without the MTP layer (and its compress ratio) */
    char d2[64], path[160];
    snprintf(d2, sizeof d2, "/tmp/pdmoe-test-XXXXXX");
    cr_assert_not_null(mkdtemp(d2));
    static const char *const files[] = {"model.safetensors", "tokenizer.json"};
    for (int i = 0; i < 2; i++) {
        char src[160];
        snprintf(src, sizeof src, "%s/%s", dir, files[i]);
        snprintf(path, sizeof path, "%s/%s", d2, files[i]);
        cr_assert_eq(symlink(src, path), 0);
    }
    snprintf(path, sizeof path, "%s/config.json", dir);
    static char text[1 << 16];
    slurp(path, text, sizeof text);
    char *at = strstr(text, "\"num_nextn_predict_layers\": 1");
    cr_assert_not_null(at);
    at[strlen("\"num_nextn_predict_layers\": ")] = '0';
    at = strstr(text, "[0, 4, 16, 4, 0]");
    cr_assert_not_null(at);
    memcpy(at, "[0, 4, 16, 4]   ", 16);
    snprintf(path, sizeof path, "%s/config.json", d2);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
    refused("{\"method\":\"mtp\",\"num_speculative_tokens\":1}", "", d2, "no MTP layer");
    refused("{\"method\":\"mtp\",\"num_speculative_tokens\":1}", "", d2, d2);
    rm_model(d2);
}

Test(spec_cli, serve_and_up_check_the_config_and_refuse_what_is_not_supported)
{
    struct run r;
    char args[1024];
    snprintf(args, sizeof args, "serve --model %s --speculative-config '{\"method\":\"ngram\",\"num_speculative_tokens\":2}'",
             dir);
    run(args, &r);
    cr_assert_eq(r.status, 2);
    cr_assert(strstr(r.err, "method \"ngram\""), "%s", r.err);
    /* (PD roles and up run it: tests/pd/test_pd_spec.c, tests/pd/test_up.c) */
    snprintf(args, sizeof args, "up --model %s --speculative-config '{\"method\":\"mtp\",\"extra\":1}'", dir);
    run(args, &r);
    cr_assert_eq(r.status, 2);
    cr_assert(strstr(r.err, "key \"extra\""), "%s", r.err);
}

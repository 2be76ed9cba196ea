/* `pdmoe bench tokenizer [--quick] [--json] [--tokenizer FILE]`: encode speed (MB/s, MB = 10^6
 * bytes) of the tokenizer with its Split regexes on PCRE2 (the default) and on the backtracking
 * reference matcher (the matcher before PCRE2), in the same run on the same text, with the ratio
 * new/old against the 0.90 target, and whether the ids are identical. The pre-tokenizers are
 * GPT-2's (ByteLevel use_regex), cl100k's and DeepSeek-V3's (a Sequence of three Splits) around
 * a BPE trained on the text (1000 ids), or a given tokenizer.json as it is. The text is
 * bench/tokenizer_corpus.h (prose, CJK, code, numbers, emoji, whitespace runs) repeated. */
#include "bench.h"
#include "bench/tokenizer_corpus.h"
#include "core/timing.h"
#include "model/tokenizer.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* GPT-2's pattern is ByteLevel's own (use_regex) */
static const char cl100k_re[] = PD_RE_CL100K;
static const char ds_num_re[] = PD_RE_DS_NUM;
static const char ds_cjk_re[] = PD_RE_DS_CJK;
static const char ds_main_re[] = PD_RE_DS_MAIN;

/* Seconds of encoding text on the reference matcher (ref = 1) or PCRE2; the ids in *ids. */
static double time_encode(struct pd_tok *t, int ref, const char *text, size_t len, int32_t **ids,
                          size_t *n, pd_err *e)
{
    free(*ids);
    *ids = NULL;
    pd_tok_set_reference_matcher(t, ref);
    double t0 = pd_now_s();
    if (pd_tok_encode(t, text, len, ids, n, e))
        return -1;
    return pd_now_s() - t0;
}

int pd_bench_tokenizer(int argc, char **argv)
{
    int quick = 0, as_json = 0;
    const char *file = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) {
            quick = 1;
        } else if (!strcmp(argv[i], "--json")) {
            as_json = 1;
        } else if (!strcmp(argv[i], "--tokenizer") && i + 1 < argc) {
            file = argv[++i];
        } else {
            fprintf(stderr, "pdmoe bench tokenizer: %s %s (see pdmoe bench tokenizer --help)\n",
                    strcmp(argv[i], "--tokenizer") ? "unknown option" : "needs a value:", argv[i]);
            return 2;
        }
    }
    size_t unit = sizeof pd_tok_corpus - 1, copies = quick ? 64 : 512;
    size_t len = unit * copies;
    char *text = malloc(len + 1);
    if (!text) {
        fprintf(stderr, "pdmoe bench tokenizer: out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < copies; i++)
        memcpy(text + i * unit, pd_tok_corpus, unit);
    text[len] = 0;
    int reps = quick ? 5 : 9;

    pd_err e = {0};
    json_t *doc = NULL;
    const char *names[3] = {"gpt2", "cl100k", "deepseek-v3"};
    int n_cases = 3;
    if (file) {
        names[0] = file;
        n_cases = 1;
    } else {
        static const char *const special[] = {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"};
        char *json;
        if (pd_tok_train(pd_tok_corpus, unit, 1000, special, 2, &json, &e)) {
            fprintf(stderr, "pdmoe bench tokenizer: %s\n", e.msg);
            free(text);
            return 1;
        }
        json_error_t je;
        doc = json_loads(json, 0, &je);
        free(json);
        if (!doc) {
            fprintf(stderr, "pdmoe bench tokenizer: the trained tokenizer.json: %s\n", je.text);
            free(text);
            return 1;
        }
    }
    if (!as_json)
        printf("pdmoe bench tokenizer: encode of %.2f MB (the corpus x %zu), best of %d "
               "alternated; target new/old >= 0.90\n  %-24s %12s %12s %9s %8s %10s\n",
               len / 1e6, copies, reps, "pre-tokenizer", "PCRE2 MB/s", "old MB/s", "new/old",
               "ids", "tokens");
    /* --json: one object printed whole at the end, or nothing (a failure half way once left
     * '"results": [' on stdout), every string escaped by jansson (a tokenizer path with a quote) */
    json_t *results = json_array();
    int rc = results ? 0 : PD_ENOMEM;
    for (int c = 0; c < n_cases && !rc; c++) {
        struct pd_tok *t = NULL;
        if (file) {
            rc = pd_tok_load(file, &t, &e);
        } else {
            json_t *pre = c == 0 ? pd_tok_bytelevel_step(0, 1)
                        : c == 1 ? json_pack("{s:s, s:[o,o]}", "type", "Sequence", "pretokenizers",
                                             pd_tok_split_step(cl100k_re), pd_tok_bytelevel_step(0, 0))
                                 : json_pack("{s:s, s:[o,o,o,o]}", "type", "Sequence", "pretokenizers",
                                             pd_tok_split_step(ds_num_re), pd_tok_split_step(ds_cjk_re),
                                             pd_tok_split_step(ds_main_re), pd_tok_bytelevel_step(0, 0));
            json_object_set_new(doc, "pre_tokenizer", pre);
            char *s = json_dumps(doc, 0);
            rc = s ? pd_tok_parse(s, names[c], &t, &e) : pd_err_set(&e, PD_ENOMEM, "out of memory");
            free(s);
        }
        if (rc)
            break;
        int32_t *ids_new = NULL, *ids_old = NULL;
        size_t n_new = 0, n_old = 0;
        /* alternated, best of each: the machine's load falls on both alike */
        double t_new = 1e30, t_old = 1e30;
        for (int r = 0; r < reps && t_new > 0 && t_old > 0; r++) {
            double a = time_encode(t, 0, text, len, &ids_new, &n_new, &e);
            double b = a < 0 ? -1 : time_encode(t, 1, text, len, &ids_old, &n_old, &e);
            t_new = a < t_new ? a : t_new;
            t_old = b < t_old ? b : t_old;
        }
        if (t_new < 0 || t_old < 0) {
            rc = e.code ? e.code : PD_EINVAL;
        } else {
            int same = n_new == n_old && !memcmp(ids_new, ids_old, n_new * sizeof *ids_new);
            double mb_new = len / t_new / 1e6, mb_old = len / t_old / 1e6;
            if (as_json)
                json_array_append_new(results, json_pack("{s:s, s:f, s:f, s:f, s:b, s:I}", "pre_tokenizer", names[c],
                                                         "pcre2_mb_per_s", mb_new, "old_mb_per_s", mb_old, "ratio",
                                                         mb_new / mb_old, "ids_identical", same,
                                                         "tokens", (json_int_t)n_new));
            else
                printf("  %-24s %12.2f %12.2f %8.2fx %8s %10zu\n", names[c], mb_new, mb_old,
                       mb_new / mb_old, same ? "same" : "DIFFER", n_new);
            if (!same)
                rc = PD_EINVAL, pd_err_set(&e, rc, "%s: the ids differ between PCRE2 and the "
                                           "reference matcher", names[c]);
        }
        free(ids_new);
        free(ids_old);
        pd_tok_free(t);
    }
    if (as_json && !rc) {
        json_t *o = json_pack("{s:s, s:I, s:f, s:O}", "bench", "tokenizer", "text_bytes", (json_int_t)len,
                              "target_ratio", 0.9, "results", results);
        char *txt = o ? json_dumps(o, JSON_PRESERVE_ORDER) : NULL;
        if (txt)
            printf("%s\n", txt);
        free(txt);
        json_decref(o);
    }
    json_decref(results);
    json_decref(doc);
    free(text);
    if (rc) {
        fprintf(stderr, "pdmoe bench tokenizer: %s\n", e.msg);
        return 1;
    }
    return 0;
}

/* oracle-dump: the engine's logits at every position of a prompt and of its greedy continuation,
 * for the float64 oracle (tools/oracle/v4_oracle.py) to compare with (tests/oracle/run.sh).
 *
 *   build/oracle-dump --model DIR --ids 5,17,3 [--steps N] [--mode ref|w8a8]
 *                     [--kv-cache-dtype bf16|fp8] [--chunk N] --out FILE
 *
 * The prompt runs in chunks of --chunk tokens (0, the default: all at once, one prefill step),
 * every position's logits kept; then N greedy decode steps (argmax, ties to the lower id), one
 * token per step. FILE gets one line of JSON ({"vocab": V, "n": n, "ids": [...], "prompt": P,
 * "mode": ..., "kv_cache_dtype": ...}: ids are the n tokens run, the prompt's then the generated
 * ones) and then n x V little-endian fp32 logits, row i being the logits after token i.
 * A test program: it prints and exits, unlike library code. */
#include "engine/engine.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int usage(const char *why)
{
    fprintf(stderr, "oracle-dump: %s\nusage: oracle-dump --model DIR --ids A,B,... [--steps N] [--mode ref|w8a8] "
                    "[--kv-cache-dtype bf16|fp8] [--chunk N] --out FILE\n", why);
    return 2;
}

static int parse_int(const char *flag, const char *s, long lo, long hi, long *v)
{
    char *end;
    errno = 0;
    *v = strtol(s, &end, 10);
    if (errno || end == s || *end || *v < lo || *v > hi) {
        fprintf(stderr, "oracle-dump: %s: '%s' is not an integer in [%ld, %ld]\n", flag, s, lo, hi);
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    const char *dir = NULL, *ids_arg = NULL, *out = NULL, *mode = "ref", *kvd = "bf16";
    long steps = 0, chunk = 0;
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i];
        if (i + 1 >= argc)
            return usage("every flag takes a value");
        const char *v = argv[++i];
        if (!strcmp(f, "--model"))
            dir = v;
        else if (!strcmp(f, "--ids"))
            ids_arg = v;
        else if (!strcmp(f, "--out"))
            out = v;
        else if (!strcmp(f, "--mode"))
            mode = v;
        else if (!strcmp(f, "--kv-cache-dtype"))
            kvd = v;
        else if (!strcmp(f, "--steps")) {
            if (parse_int(f, v, 0, 4096, &steps))
                return 2;
        } else if (!strcmp(f, "--chunk")) {
            if (parse_int(f, v, 0, 1 << 20, &chunk))
                return 2;
        } else {
            fprintf(stderr, "oracle-dump: unknown flag %s\n", f);
            return 2;
        }
    }
    if (!dir || !ids_arg || !out)
        return usage("--model, --ids and --out are required");
    if (strcmp(mode, "ref") && strcmp(mode, "w8a8"))
        return usage("--mode is ref (the float reference) or w8a8");
    if (strcmp(kvd, "bf16") && strcmp(kvd, "fp8"))
        return usage("--kv-cache-dtype is bf16 or fp8");
    /* the prompt's ids */
    int cap = 16, P = 0;
    int32_t *ids = malloc((size_t)cap * sizeof *ids);
    for (const char *s = ids_arg; ids && *s;) {
        char *end;
        errno = 0;
        long x = strtol(s, &end, 10);
        if (errno || end == s || x < 0 || x > INT32_MAX || (*end && *end != ',')) {
            fprintf(stderr, "oracle-dump: --ids: '%s' is not a comma-separated list of token ids\n", ids_arg);
            free(ids);
            return 2;
        }
        if (P + (int)steps + 1 >= cap) {
            cap = 2 * (P + (int)steps + 1);
            int32_t *n = realloc(ids, (size_t)cap * sizeof *ids);
            if (!n)
                break;
            ids = n;
        }
        ids[P++] = (int32_t)x;
        s = *end ? end + 1 : end;
    }
    if (!ids || P == 0) {
        free(ids);
        return usage(ids ? "--ids is empty" : "out of memory");
    }
    int32_t *grown = realloc(ids, (size_t)(P + steps + 1) * sizeof *ids);
    if (!grown) {
        free(ids);
        return usage("out of memory");
    }
    ids = grown;
    struct pd_engine en;
    pd_err e = {0};
    struct pd_engine_opts o = {.dir = dir, .threads = 1, .max_seqs = 1, .max_model_len = P + steps + 16,
                               .kv_dtype = strcmp(kvd, "fp8") ? PD_KV_BF16 : PD_KV_FP8, .ref = !strcmp(mode, "ref")};
    if (pd_engine_open(&en, &o, &e)) {
        fprintf(stderr, "oracle-dump: %s\n", e.msg);
        free(ids);
        return 1;
    }
    const int V = (int)en.model.vocab_size, n = P + (int)steps;
    float *logits = malloc((size_t)n * V * sizeof *logits);
    struct pd_seq s;
    int started = 0, rc = 0;
    if (!logits) {
        snprintf(e.msg, sizeof e.msg, "out of memory for %d x %d logits", n, V);
        rc = 1;
    } else if (!(rc = pd_seq_start(&en, &s, &e))) {
        started = 1;
    }
    for (int at = 0; !rc && at < n;) {
        int k = at < P ? (chunk > 0 && chunk < P - at ? (int)chunk : P - at) : 1;
        struct pd_step_item it = {.seq = &s, .tokens = ids + at, .n = k, .all_logits = logits + (size_t)at * V};
        if ((rc = pd_engine_step(&en, &it, 1, &e)))
            break;
        at += k;
        if (at >= P && at < n) {
            /* greedy: the largest logit, ties to the lower id */
            const float *l = logits + (size_t)(at - 1) * V;
            int best = 0;
            for (int v = 1; v < V; v++)
                if (l[v] > l[best])
                    best = v;
            ids[at] = best;
        }
    }
    if (started)
        pd_seq_end(&en, &s);
    pd_engine_close(&en);
    if (rc) {
        fprintf(stderr, "oracle-dump: %s: %s\n", dir, e.msg);
        free(ids);
        free(logits);
        return 1;
    }
    FILE *f = fopen(out, "wb");
    if (!f) {
        fprintf(stderr, "oracle-dump: %s: cannot create: %s\n", out, strerror(errno));
        free(ids);
        free(logits);
        return 1;
    }
    fprintf(f, "{\"vocab\": %d, \"n\": %d, \"prompt\": %d, \"mode\": \"%s\", \"kv_cache_dtype\": \"%s\", \"ids\": [", V,
            n, P, mode, kvd);
    for (int i = 0; i < n; i++)
        fprintf(f, "%s%d", i ? ", " : "", ids[i]);
    fprintf(f, "]}\n");
    int bad = fwrite(logits, sizeof *logits, (size_t)n * V, f) != (size_t)n * V;
    bad |= fclose(f) != 0;
    free(ids);
    free(logits);
    if (bad) {
        fprintf(stderr, "oracle-dump: %s: write failed\n", out);
        return 1;
    }
    return 0;
}

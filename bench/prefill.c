/* `pdmoe bench prefill`: the engine's prefill tokens/s on whole prompts (one step of P tokens on
 * a fresh sequence), at each thread count, with each part's share of the step from the engine's
 * step profile (engine/prof.h: GEMM, attention, MoE, exchange, other), so that the next
 * bottleneck is visible; thread counts above 1 are set against 1 thread measured in the same run.
 * argv follows main(): argv[0] is the command name. */
#include "bench.h"
#include "cli/cli.h"
#include "core/timing.h"
#include "engine/engine.h"

#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { MAX_LIST = 8 };

struct result {
    int threads, tokens;
    double sec;                  /* median step time */
    double share[PD_PROF_N];     /* of the profiled steps' total */
};

/* Parses "a,b,c" into v (n values in [lo, hi]); a message naming the flag otherwise. */
static int parse_list(const char *flag, const char *s, int lo, int hi, int *v, int *n)
{
    *n = 0;
    for (const char *p = s; *p;) {
        char *end;
        long x = strtol(p, &end, 10);
        if (end == p || (*end && *end != ',') || x < lo || x > hi || *n == MAX_LIST) {
            fprintf(stderr, "bench prefill: %s '%s': want up to %d comma-separated integers in [%d, %d]\n", flag, s,
                    MAX_LIST, lo, hi);
            return -1;
        }
        v[(*n)++] = (int)x;
        p = *end ? end + 1 : end;
    }
    if (*n == 0) {
        fprintf(stderr, "bench prefill: %s is empty\n", flag);
        return -1;
    }
    return 0;
}

/* With --cpu-time (1 thread only) steps are timed by the calling thread's CPU time, which leaves
 * out the time slices other jobs on a shared machine take; else wall time. */
static int use_cpu_time;

static double now_s(void)
{
    return use_cpu_time ? pd_thread_cpu_s() : pd_now_s();
}

/* One prefill of ids[0 .. n) on a fresh sequence: *sec its step's time. */
static int prefill_once(struct pd_engine *en, const int32_t *ids, int n, float *logits, double *sec, pd_err *e)
{
    struct pd_seq s;
    int rc = pd_seq_start(en, &s, e);
    if (rc)
        return rc;
    struct pd_step_item it = {.seq = &s, .tokens = ids, .n = n, .logits = logits};
    double t0 = now_s();
    rc = pd_engine_step(en, &it, 1, e);
    *sec = now_s() - t0;
    pd_seq_end(en, &s);
    return rc;
}

/* reps timed prefills of each prompt length after one warm-up, profiled. */
static int measure(const char *dir, int threads, const int *tokens, int n_tokens, int reps, struct result *out,
                   char *model_name, size_t name_cap)
{
    int max_t = 0;
    for (int i = 0; i < n_tokens; i++)
        max_t = tokens[i] > max_t ? tokens[i] : max_t;
    struct pd_engine en;
    struct pd_engine_opts o = {.dir = dir, .threads = threads, .max_seqs = 1, .max_model_len = max_t + 8};
    pd_err e = {0};
    if (pd_engine_open(&en, &o, &e)) {
        fprintf(stderr, "bench prefill: %s\n", e.msg);
        return -1;
    }
    snprintf(model_name, name_cap, "%s", en.model.name);
    const int V = (int)en.model.vocab_size;
    int32_t *ids = malloc((size_t)max_t * sizeof *ids);
    float *logits = malloc((size_t)V * sizeof *logits);
    double *t = malloc((size_t)reps * sizeof *t);
    int rc = -1;
    if (!ids || !logits || !t) {
        fprintf(stderr, "bench prefill: out of memory\n");
        goto out;
    }
    for (int i = 0; i < max_t; i++)
        ids[i] = (int32_t)(((int64_t)i * 131 + 7) % (V > 1000 ? 1000 : V));
    for (int k = 0; k < n_tokens; k++) {
        double warm;
        if (prefill_once(&en, ids, tokens[k], logits, &warm, &e))
            goto fail;
        pd_prof_enable(&en.prof, 1);
        for (int r = 0; r < reps; r++)
            if (prefill_once(&en, ids, tokens[k], logits, &t[r], &e))
                goto fail;
        int64_t total = 0;
        for (int p = 0; p < PD_PROF_N; p++)
            total += en.prof.ns[p];
        struct result *res = &out[k];
        *res = (struct result){.threads = threads, .tokens = tokens[k], .sec = pd_bench_median(t, reps)};
        for (int p = 0; p < PD_PROF_N; p++)
            res->share[p] = total > 0 ? (double)en.prof.ns[p] / (double)total : 0;
        pd_prof_enable(&en.prof, 0);
    }
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "bench prefill: %s\n", e.msg);
out:
    pd_prof_enable(&en.prof, 0);
    free(ids);
    free(logits);
    free(t);
    pd_engine_close(&en);
    return rc;
}

int pd_bench_prefill(int argc, char **argv)
{
    static const struct option opts[] = {
        {"model", 1, 0, 'm'}, {"threads", 1, 0, 'j'}, {"tokens", 1, 0, 't'}, {"reps", 1, 0, 'r'},
        {"quick", 0, 0, 'q'}, {"json", 0, 0, 'J'}, {"cpu-time", 0, 0, 'c'}, {0, 0, 0, 0},
    };
    const char *dir = "models/mini";
    int threads[MAX_LIST] = {1, 2}, n_threads = 2, tokens[MAX_LIST] = {512, 1024, 2048}, n_tokens = 3;
    int reps = 3, quick = 0, json = 0, c, tokens_given = 0, reps_given = 0;
    struct pd_cli_seen seen = {0};
    optind = 1;
    opterr = 0;
    while ((c = pd_cli_getopt("bench prefill", argc, argv, opts, NULL, NULL, &seen)) != -1) {
        if (c == 'm') {
            dir = optarg;
        } else if (c == 'j') {
            if (parse_list("--threads", optarg, 1, PD_POOL_MAX_THREADS, threads, &n_threads))
                return 2;
        } else if (c == 't') {
            if (parse_list("--tokens", optarg, 1, 65536, tokens, &n_tokens))
                return 2;
            tokens_given = 1;
        } else if (c == 'r') {
            char *end;
            long v = strtol(optarg, &end, 10);
            if (*end || v < 1 || v > 100) {
                fprintf(stderr, "bench prefill: --reps '%s': want an integer in [1, 100]\n", optarg);
                return 2;
            }
            reps = (int)v;
            reps_given = 1;
        } else if (c == 'q') {
            quick = 1;
        } else if (c == 'J') {
            json = 1;
        } else if (c == 'c') {
            use_cpu_time = 1;
        } else {
            return pd_cli_bad_flag("bench prefill", c, argc, argv);
        }
    }
    if (optind < argc) {
        fprintf(stderr, "bench prefill: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (use_cpu_time && (n_threads != 1 || threads[0] != 1)) {
        fprintf(stderr, "bench prefill: --cpu-time times the calling thread only: it needs --threads 1\n");
        return 2;
    }
    if (quick) {   /* smaller defaults; what was given explicitly stands */
        n_tokens = tokens_given ? n_tokens : 1;
        reps = reps_given ? reps : 1;
    }
    struct result res[MAX_LIST][MAX_LIST];
    char name[128] = "";
    for (int i = 0; i < n_threads; i++)
        if (measure(dir, threads[i], tokens, n_tokens, reps, res[i], name, sizeof name))
            return 1;
    /* the 1-thread run of the same length, if measured: the same-run reference */
    int one = -1;
    for (int i = 0; i < n_threads; i++)
        if (threads[i] == 1)
            one = i;

    if (json) {
        json_t *runs = json_array();
        for (int i = 0; i < n_threads; i++)
            for (int k = 0; k < n_tokens; k++) {
                const struct result *r = &res[i][k];
                json_t *sh = json_object();
                for (int p = 0; p < PD_PROF_N; p++)
                    json_object_set_new(sh, pd_prof_part_name(p), json_real(r->share[p]));
                json_t *o = json_pack("{s:i, s:i, s:f, s:f, s:o}", "threads", r->threads, "tokens", r->tokens,
                                      "seconds", r->sec, "tokens_per_s", r->tokens / r->sec, "shares", sh);
                if (one >= 0)
                    json_object_set_new(o, "vs_1_thread", json_real(res[one][k].sec / r->sec));
                json_array_append_new(runs, o);
            }
        json_t *doc = json_pack("{s:s, s:s, s:i, s:s, s:o}", "model", dir, "name", name, "reps", reps, "clock",
                                use_cpu_time ? "thread_cpu" : "wall", "runs", runs);
        char *txt = json_dumps(doc, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
        printf("%s\n", txt);
        free(txt);
        json_decref(doc);
        return 0;
    }
    printf("pdmoe bench prefill: %s (%s), whole prompts as one step on a fresh sequence, median of %d after a "
           "warm-up, %s\n", dir, name, reps, use_cpu_time ? "the calling thread's CPU time (--cpu-time)" : "wall time");
    printf("shares: wall time of the step's parts (GEMM = every int8 matrix product; the others without their "
           "GEMMs)\n\n");
    printf("  threads  tokens   step ms   tokens/s  vs 1 thread |   GEMM  attention    MoE  exchange  other\n");
    for (int i = 0; i < n_threads; i++)
        for (int k = 0; k < n_tokens; k++) {
            const struct result *r = &res[i][k];
            printf("  %7d  %6d  %8.1f  %9.1f", r->threads, r->tokens, r->sec * 1e3, r->tokens / r->sec);
            if (one >= 0)
                printf("  %10.2fx", res[one][k].sec / r->sec);
            else
                printf("  %11s", "-");
            printf(" | %5.1f%%  %8.1f%%  %5.1f%%  %7.1f%%  %4.1f%%\n", 100 * r->share[PD_PROF_GEMM],
                   100 * r->share[PD_PROF_ATTENTION], 100 * r->share[PD_PROF_MOE], 100 * r->share[PD_PROF_EXCHANGE],
                   100 * r->share[PD_PROF_OTHER]);
        }
    return 0;
}

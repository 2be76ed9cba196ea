/* `pdmoe bench prefill`: the engine's prefill tokens/s on whole prompts (one step of P tokens on
 * a fresh sequence), at each thread count, with each part's share of the step from the engine's
 * step profile (engine/prof.h: GEMM, attention, MoE, exchange, other), so that the next
 * bottleneck is visible; thread counts above 1 are set against 1 thread measured in the same run.
 * Each step is also set against this machine's ceilings, probed in the same run at the same thread
 * count, before and after its cases (the higher reading kept, as bench decode does):
 *   - the least time the step can take (pd_bench_step_bound, bench/bound.c), T = the prompt's
 *     tokens, one of them through the head, the routed (token, expert) pairs and distinct experts
 *     counted from the engine's own per-expert token counts over the timed steps;
 *   - the GEMM part's int8 ops/s: the step's int8 products (2 x params x rows over every int8
 *     matrix, the routed experts by their pairs) over the GEMM part's time, against the int8 peak
 *     of the instructions the engine's kernel runs (pd_bench_peaks, its probe named).
 * argv follows main(): argv[0] is the command name. */
#include "bench.h"
#include "bench/bound.h"
#include "bench/ceilings.h"
#include "bench/report.h"
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
    double detail[PD_PROF_DETAIL_N];   /* the pieces inside the parts (engine/prof.h), of the same total */
    double gemm_s;               /* the GEMM part's mean seconds per timed step */
    double experts, pairs;       /* distinct routed (layer, expert) a step read, its (token, expert) pairs */
    struct pd_bench_bound bound; /* the least time the step can take, at the ceilings below */
    struct pd_bench_ceilings ceil;   /* this thread count's, the higher of before and after */
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

/* reps timed prefills of each prompt length after one warm-up, profiled, between two probes of
 * the machine's ceilings at this thread count (quick: shorter probes); *int8_probe names the int8
 * peak's instructions. */
static int measure(const char *dir, int threads, const int *tokens, int n_tokens, int reps, int quick,
                   struct result *out, const char **int8_probe, char *model_name, size_t name_cap)
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
    const size_t n_routed = (size_t)en.model.n_layers * en.model.n_routed_experts;
    int32_t *ids = malloc((size_t)max_t * sizeof *ids);
    float *logits = malloc((size_t)V * sizeof *logits);
    double *t = malloc((size_t)reps * sizeof *t);
    int64_t *before = malloc((n_routed ? n_routed : 1) * sizeof *before);
    struct pd_bench_ceilings cl = {0, 0, 0};
    int rc = -1;
    if (!ids || !logits || !t || !before) {
        fprintf(stderr, "bench prefill: out of memory\n");
        goto out;
    }
    for (int i = 0; i < max_t; i++)
        ids[i] = (int32_t)(((int64_t)i * 131 + 7) % (V > 1000 ? 1000 : V));
    pd_bench_ceilings_raise(en.pool, threads, quick, &cl, int8_probe, NULL);
    for (int k = 0; k < n_tokens; k++) {
        double warm;
        if (prefill_once(&en, ids, tokens[k], logits, &warm, &e))
            goto fail;
        pd_prof_enable(&en.prof, 1);
        double experts = 0, pairs = 0;
        for (int r = 0; r < reps; r++) {
            memcpy(before, en.expert_tokens, n_routed * sizeof *before);
            if (prefill_once(&en, ids, tokens[k], logits, &t[r], &e))
                goto fail;
            /* this step's routing: the distinct experts of one step, not of all reps together */
            double x, p;
            pd_bench_routed_since(&en, before, &x, &p);
            experts += x;
            pairs += p;
        }
        int64_t total = 0;
        for (int p = 0; p < PD_PROF_N; p++)
            total += en.prof.ns[p];
        struct result *res = &out[k];
        *res = (struct result){.threads = threads, .tokens = tokens[k], .sec = pd_bench_median(t, reps),
                               .gemm_s = (double)en.prof.ns[PD_PROF_GEMM] * 1e-9 / reps};
        for (int p = 0; p < PD_PROF_N; p++)
            res->share[p] = total > 0 ? (double)en.prof.ns[p] / (double)total : 0;
        for (int d = 0; d < PD_PROF_DETAIL_N; d++)
            res->detail[d] = total > 0 ? (double)en.prof.piece[d].ns / (double)total : 0;
        pd_prof_enable(&en.prof, 0);
        res->experts = experts / reps;
        res->pairs = pairs / reps;
    }
    pd_bench_ceilings_raise(en.pool, threads, quick, &cl, int8_probe, NULL);
    for (int k = 0; k < n_tokens; k++) {
        struct result *res = &out[k];
        res->ceil = cl;
        /* one sequence: its last token alone goes through the head */
        pd_bench_step_bound(&en, res->tokens, 1, res->experts, res->pairs, &cl, &res->bound);
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
    free(before);
    pd_engine_close(&en);
    return rc;
}

/* The GEMM part's achieved int8 Gops/s: the step's int8 products over the GEMM part's time. */
static double gemm_gops(const struct result *r)
{
    return r->gemm_s > 0 ? r->bound.int8_ops / r->gemm_s / 1e9 : 0;
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
    const char *int8_probe = NULL;
    double load[1] = {-1}, load_end[1] = {-1};
    (void)getloadavg(load, 1);
    for (int i = 0; i < n_threads; i++)
        if (measure(dir, threads[i], tokens, n_tokens, reps, quick, res[i], &int8_probe, name, sizeof name))
            return 1;
    (void)getloadavg(load_end, 1);
    const char *fp32_probe = pd_bench_fp32_probe();
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
                json_t *dt = json_object();
                for (int d = 0; d < PD_PROF_DETAIL_N; d++)
                    json_object_set_new(dt, pd_prof_detail_name(d), json_real(r->detail[d]));
                json_t *o = json_pack("{s:i, s:i, s:f, s:f, s:o, s:o}", "threads", r->threads, "tokens", r->tokens,
                                      "seconds", r->sec, "tokens_per_s", r->tokens / r->sec, "shares", sh, "detail", dt);
                if (one >= 0)
                    json_object_set_new(o, "vs_1_thread", json_real(res[one][k].sec / r->sec));
                const struct pd_bench_bound *b = &r->bound;
                json_object_set_new(o, "weight_bytes", json_real(b->bytes));
                json_object_set_new(o, "routed_experts", json_real(r->experts));
                json_object_set_new(o, "routed_pairs", json_real(r->pairs));
                json_object_set_new(o, "bandwidth_gb_per_s", json_real(r->ceil.bw / 1e9));
                json_object_set_new(o, "fp32_peak_gflops", json_real(r->ceil.fp32 / 1e9));
                json_object_set_new(o, "bandwidth_bound_ms", json_real(b->bw_s * 1e3));
                json_object_set_new(o, "bound_ms", json_real(b->bound_s * 1e3));
                json_object_set_new(o, "of_bound", json_real(b->bound_s / r->sec));
                json_object_set_new(o, "gemm_ms", json_real(r->gemm_s * 1e3));
                json_object_set_new(o, "gemm_int8_ops", json_real(b->int8_ops));
                json_object_set_new(o, "gemm_gops", json_real(gemm_gops(r)));
                json_object_set_new(o, "int8_peak_gops", json_real(r->ceil.int8 / 1e9));
                json_object_set_new(o, "gemm_of_int8_peak", json_real(r->ceil.int8 > 0 ? gemm_gops(r) * 1e9 / r->ceil.int8 : 0));
                json_array_append_new(runs, o);
            }
        json_t *doc = json_pack("{s:s, s:s, s:i, s:s, s:f, s:f, s:s, s:o, s:o, s:o}", "model", dir, "name", name, "reps",
                                reps, "clock", use_cpu_time ? "thread_cpu" : "wall", "load_average_start", load[0],
                                "load_average_end", load_end[0], "routed_pairs_from", "engine expert_tokens",
                                "int8_probe", int8_probe ? json_string(int8_probe) : json_null(), "fp32_probe",
                                fp32_probe ? json_string(fp32_probe) : json_null(), "runs", runs);
        json_object_set_new(doc, "bench", json_string("prefill"));
        pd_bench_provenance(doc, argc, argv);
        char *txt = json_dumps(doc, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
        printf("%s\n", txt);
        free(txt);
        json_decref(doc);
        return 0;
    }
    printf("pdmoe bench prefill: %s (%s), whole prompts as one step on a fresh sequence, median of %d after a "
           "warm-up, %s\n", dir, name, reps, use_cpu_time ? "the calling thread's CPU time (--cpu-time)" : "wall time");
    printf("shares: wall time of the step's parts (GEMM = every int8 matrix product; the others without their "
           "GEMMs)\n");
    printf("load average: %.2f at the start, %.2f at the end%s\n", load[0], load_end[0],
           load[0] > 1.2 || load_end[0] > 1.2 ? " (a busy machine: wall-clock figures are noisy)" : "");
    for (int i = 0; i < n_threads; i++) {
        const struct pd_bench_ceilings *cl = &res[i][0].ceil;
        printf("ceilings, %d thread%s, the higher of before and after its cases: read bandwidth %.2f GB/s, fp32 %.1f "
               "GFLOPS (%s), int8 %.1f Gops/s (%s)\n", threads[i], threads[i] > 1 ? "s" : "", cl->bw / 1e9,
               cl->fp32 / 1e9, fp32_probe ? fp32_probe : "no FMA probe: not in the bound", cl->int8 / 1e9,
               int8_probe ? int8_probe : "no int8 probe for this kernel: not in the bound");
    }
    printf("bound: the least time the step can take on those ceilings (bench/bound.c), routed (token, expert) "
           "pairs counted from the engine's routing\n\n");
    printf("  threads  tokens   step ms   tokens/s  vs 1 thread |   GEMM  attention    MoE  exchange  other |"
           "  bound ms  of bound | GEMM Gops/s  int8 peak  of peak\n");
    for (int i = 0; i < n_threads; i++)
        for (int k = 0; k < n_tokens; k++) {
            const struct result *r = &res[i][k];
            printf("  %7d  %6d  %8.1f  %9.1f", r->threads, r->tokens, r->sec * 1e3, r->tokens / r->sec);
            if (one >= 0)
                printf("  %10.2fx", res[one][k].sec / r->sec);
            else
                printf("  %11s", "-");
            printf(" | %5.1f%%  %8.1f%%  %5.1f%%  %7.1f%%  %4.1f%%", 100 * r->share[PD_PROF_GEMM],
                   100 * r->share[PD_PROF_ATTENTION], 100 * r->share[PD_PROF_MOE], 100 * r->share[PD_PROF_EXCHANGE],
                   100 * r->share[PD_PROF_OTHER]);
            printf(" | %9.2f  %8.2f | %11.1f  %9.1f  %7.2f\n", r->bound.bound_s * 1e3, r->bound.bound_s / r->sec,
                   gemm_gops(r), r->ceil.int8 / 1e9, r->ceil.int8 > 0 ? gemm_gops(r) * 1e9 / r->ceil.int8 : 0);
        }
    printf("\ninside those parts, of the step: the experts' int8 products (in GEMM), every bf16/fp32 matrix product "
           "(in attention, MoE, other), the attention's heads with their keys and indexer (in attention)\n");
    printf("  threads  tokens | experts' GEMM  float products  attention heads\n");
    for (int i = 0; i < n_threads; i++)
        for (int k = 0; k < n_tokens; k++) {
            const struct result *r = &res[i][k];
            printf("  %7d  %6d | %12.1f%%  %13.1f%%  %14.1f%%\n", r->threads, r->tokens, 100 * r->detail[PD_PROF_EXPERTS_GEMM],
                   100 * r->detail[PD_PROF_FLOAT], 100 * r->detail[PD_PROF_HEADS]);
        }
    return 0;
}

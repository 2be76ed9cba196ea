/* `pdmoe bench decode --model DIR [--threads N] [--json]`: decode tokens/s at batch 1 and 16, at
 * 1 thread and at N, in one run: their ratio (thread scaling), and each case's fraction of the
 * bandwidth roofline: the weight bytes a step reads (dense matrices and vectors, the routed experts
 * its tokens chose, counted per step, the head) over its time, against this machine's multi-stream
 * read bandwidth at the same thread count (bench kernels' ceiling), measured in the same run, before
 * and after the cases, the higher reading kept (a probe another job disturbed reads low).
 * Beside it the fraction of the roofline with arithmetic in it, the least time a step can take
 * (pd_bench_step_bound, bench/bound.c, where its equation is: per dense matrix max(bytes /
 * bandwidth, 2 T params / peak), plus the routed experts' max(bytes / bandwidth, 2 pairs params /
 * peak)), T = the batch's tokens, every one through the head, with the peaks of the instructions
 * the engine runs here named in the output. At batch 1 it is the bandwidth roofline; at 16 the
 * float matrices cost 32 flops per 2 bytes read, which no CPU here does at its bandwidth.
 * The thread counts run on one engine and the same sequences, taking turns in rounds (ROUNDS,
 * below), so that both meet the same machine. Also per step: the pool's dispatches and wake-ups
 * (what a decode step costs in hand-offs) and
 * the CPU time (the calling thread's at 1 thread, the process's at N: it stays meaningful on a
 * busy machine, where wall-clock scaling does not; the load average is printed beside it); at 1
 * thread the roofline fraction again with the step's and the bandwidth probe's time both taken
 * as CPU time, steady on a shared machine. Each case splits its steps into the engine profile's
 * parts and pieces (engine/prof.h, as bench prefill), and the scaling gives each one's time at 1
 * thread over its time at N: which of them the threads speed up and which stay on the calling
 * thread. */
#include "bench.h"
#include "bench/bound.h"
#include "bench/ceilings.h"
#include "bench/report.h"
#include "cli/cli.h"
#include "core/timing.h"
#include "engine/engine.h"
#include "engine/prof.h"
#include "engine/sampler.h"
#include "model/safetensors.h"

#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

/* CPU seconds used: by the calling thread alone (`alone`: steps without a pool, which run on it
 * alone), else by the process. The process's count, read around a 1-thread round that follows
 * an N-thread one, charged it with time of the pool's helper too: 1.34-1.75x the round's wall-
 * clock time in rounds of one step (`--quick`), where the calling thread's own clock cannot
 * exceed it. */
static double cpu_seconds(int alone)
{
    if (alone) {
        struct timespec t;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
        return (double)t.tv_sec + t.tv_nsec * 1e-9;
    }
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return (double)r.ru_utime.tv_sec + r.ru_utime.tv_usec * 1e-6 + (double)r.ru_stime.tv_sec + r.ru_stime.tv_usec * 1e-6;
}

/* One case's figures, per decode step (means over the timed steps). */
struct decode_case {
    int batch, threads;
    double tok_s, step_s, cpu_s, dispatches, wakeups, bytes;
    double experts, pairs;        /* distinct routed experts, (token, expert) pairs per step */
    struct pd_bench_bound bound;  /* the least time the step can take (bench/bound.c) */
    double share[PD_PROF_N];      /* each part's share of the timed steps (engine/prof.h) */
    double detail[PD_PROF_DETAIL_N];   /* the pieces inside the parts, of the same total */
    double prof_ms;               /* that total per step, in ms: a part's ms is its share of it */
    unsigned long long stalls, backoff_runs;   /* over all timed steps */
    /* the calling thread's step (N threads): its own tasks in pool runs, waiting in them for the
     * helpers' tasks, runs made alone after a stall, and its work outside any run (pd_pool_stats) */
    double own_s, wait_s, alone_s, outside_s;
    /* the time a task took on the calling thread and on the helpers (their mean, us), and the
     * helpers' time in tasks per step */
    double own_task_us, helper_task_us, helper_s;
};

/* What one thread count's timed steps add up to, over the rounds. */
struct tally {
    double wall, cpu, experts, pairs;
    int64_t prof[PD_PROF_N];
    int64_t piece[PD_PROF_DETAIL_N];
    struct pd_pool_stats pool;    /* the deltas of its pool's counters */
};

/* A batch's sequences, decoded greedily one token a step. */
struct batch_run {
    struct pd_engine *en;
    int batch, V;
    struct pd_seq *s;
    float *l;                     // [batch, V] each sequence's logits
    int32_t *ids, *next;          // [batch, prompt], [batch]
    struct pd_step_item *it;      // [batch]
    int64_t *before;              // [layers, experts] the engine's expert counts before a step
    struct pd_sampler sm;
};

static void batch_end(struct batch_run *r)
{
    for (int b = 0; r->s && b < r->batch; b++)
        if (r->s[b].kv.blocks)
            pd_seq_end(r->en, &r->s[b]);
    free(r->s);
    free(r->l);
    free(r->ids);
    free(r->next);
    free(r->it);
    free(r->before);
}

/* Starts `batch` sequences and prefills their prompts (untimed). */
static int batch_start(struct pd_engine *en, int batch, int prompt, struct batch_run *r, pd_err *e)
{
    const int V = (int)en->model.vocab_size;
    *r = (struct batch_run){.en = en, .batch = batch, .V = V};
    r->s = calloc((size_t)batch, sizeof *r->s);
    r->l = malloc((size_t)batch * V * 4);
    r->ids = malloc((size_t)batch * prompt * 4);
    r->next = malloc((size_t)batch * 4);
    r->it = calloc((size_t)batch, sizeof *r->it);
    r->before = malloc((size_t)en->model.n_layers * en->model.n_routed_experts * sizeof *r->before);
    if (!r->s || !r->l || !r->ids || !r->next || !r->it || !r->before)
        return pd_err_set(e, PD_ENOMEM, "out of memory");
    /* a different prompt per sequence: the batch's tokens choose different experts, as a real
     * batch's do */
    for (int b = 0; b < batch; b++)
        for (int i = 0; i < prompt; i++)
            r->ids[(size_t)b * prompt + i] = (i * 131 + 7 + 389 * b) % (V > 1000 ? 1000 : V);
    for (int b = 0; b < batch; b++) {
        if (pd_seq_start(en, &r->s[b], e))
            return e->code;
        r->it[b] = (struct pd_step_item){.seq = &r->s[b], .tokens = r->ids + (size_t)b * prompt, .n = prompt,
                                         .logits = r->l + (size_t)b * V};
    }
    pd_sampler_init(&r->sm, 0, 1, 0);
    return pd_engine_step(en, r->it, batch, e);
}

/* `steps` decode steps on the engine's current pool, added to *t (with t NULL: untimed, the one
 * step on each pool after the prefill, which warms the caches). */
static int batch_steps(struct batch_run *r, int steps, struct tally *t, pd_err *e)
{
    struct pd_engine *en = r->en;
    const int NL = (int)en->model.n_layers, E = (int)en->model.n_routed_experts;
    struct pd_pool_stats p0, p1;
    pd_pool_stats(en->pool, &p0);
    const int alone = en->pool == NULL;
    double t0 = pd_now_s(), cpu0 = cpu_seconds(alone);
    if (t)
        pd_prof_enable(&en->prof, 1);
    int rc = 0;
    for (int k = 0; k < steps && !rc; k++) {
        for (int b = 0; b < r->batch; b++) {
            r->next[b] = pd_sample(&r->sm, r->l + (size_t)b * r->V, r->V, NULL);
            r->it[b] = (struct pd_step_item){.seq = &r->s[b], .tokens = &r->next[b], .n = 1,
                                             .logits = r->l + (size_t)b * r->V};
        }
        memcpy(r->before, en->expert_tokens, (size_t)NL * E * sizeof *r->before);
        if ((rc = pd_engine_step(en, r->it, r->batch, e)))
            break;
        /* the distinct routed experts this step's tokens read, and their (token, expert) pairs */
        if (t) {
            double x, p;
            pd_bench_routed_since(en, r->before, &x, &p);
            t->experts += x;
            t->pairs += p;
        }
    }
    if (!t)
        return rc;
    t->wall += pd_now_s() - t0;
    t->cpu += cpu_seconds(alone) - cpu0;
    for (int p = 0; p < PD_PROF_N; p++)
        t->prof[p] += en->prof.ns[p];
    for (int d = 0; d < PD_PROF_DETAIL_N; d++)
        t->piece[d] += en->prof.piece[d].ns;
    pd_prof_enable(&en->prof, 0);
    pd_pool_stats(en->pool, &p1);
    t->pool.dispatches += p1.dispatches - p0.dispatches;
    t->pool.wakeups += p1.wakeups - p0.wakeups;
    t->pool.stalls += p1.stalls - p0.stalls;
    t->pool.backoff_runs += p1.backoff_runs - p0.backoff_runs;
    t->pool.own_ns += p1.own_ns - p0.own_ns;
    t->pool.wait_ns += p1.wait_ns - p0.wait_ns;
    t->pool.alone_ns += p1.alone_ns - p0.alone_ns;
    t->pool.own_tasks += p1.own_tasks - p0.own_tasks;
    t->pool.helper_ns += p1.helper_ns - p0.helper_ns;
    t->pool.helper_tasks += p1.helper_tasks - p0.helper_tasks;
    return rc;
}

/* Rounds of the timed steps: each thread count's steps come in ROUNDS parts, the counts taking
 * turns (1, N, N, 1, 1, N, ...) on the same sequences, so a change in what else the machine runs
 * meanwhile falls on both alike instead of on whichever ran second. 2 threads over 1, batch 1,
 * 600 steps, runs minutes apart on one AVX2 host: one count's steps after the other's gave 1.02x to
 * 1.61x in seven runs, the turns 1.29x to 1.39x in four. Each sequence decodes the steps of every
 * count, so its context grows to the prompt + n_tc (steps + 1) tokens. */
enum { ROUNDS = 4 };

/* The rounds of `steps` timed steps: ROUNDS, or one a step when there are fewer. */
static int rounds_for(int steps)
{
    return steps < ROUNDS ? steps : ROUNDS;
}

/* One batch at every thread count (pools[i] for tc[i], the engine opened on the last), alternating
 * in rounds; the figures into cases[0 .. n_tc - 1]. */
static int run_batch(struct pd_engine *en, pd_pool *const *pools, const int *tc, int n_tc, int batch, int prompt,
                     int steps, struct decode_case *cases)
{
    struct batch_run r;
    struct tally t[2];
    memset(t, 0, sizeof t);
    pd_err e = {0};
    int rc = batch_start(en, batch, prompt, &r, &e);
    for (int i = 0; i < n_tc && !rc; i++) {
        pd_engine_swap_pool(en, pools[i]);
        rc = batch_steps(&r, 1, NULL, &e);
    }
    const int rounds = rounds_for(steps);
    for (int q = 0; q < rounds && !rc; q++) {
        const int part = steps * (q + 1) / rounds - steps * q / rounds;
        for (int k = 0; k < n_tc && !rc; k++) {
            const int i = (q + k) % 2 == 0 || n_tc == 1 ? 0 : 1;
            pd_engine_swap_pool(en, pools[i]);
            rc = batch_steps(&r, part, &t[i], &e);
        }
    }
    pd_engine_swap_pool(en, pools[n_tc - 1]);
    batch_end(&r);
    if (rc) {
        fprintf(stderr, "bench decode: %s\n", e.msg);
        return rc;
    }
    for (int i = 0; i < n_tc; i++) {
        struct decode_case *c = &cases[i];
        int64_t total = 0;
        for (int p = 0; p < PD_PROF_N; p++)
            total += t[i].prof[p];
        *c = (struct decode_case){.batch = batch, .threads = tc[i]};
        for (int p = 0; p < PD_PROF_N; p++)
            c->share[p] = total > 0 ? (double)t[i].prof[p] / (double)total : 0;
        for (int d = 0; d < PD_PROF_DETAIL_N; d++)
            c->detail[d] = total > 0 ? (double)t[i].piece[d] / (double)total : 0;
        c->prof_ms = (double)total / 1e6 / steps;
        c->step_s = t[i].wall / steps;
        c->tok_s = (double)batch * steps / t[i].wall;
        c->cpu_s = t[i].cpu / steps;
        c->dispatches = (double)t[i].pool.dispatches / steps;
        c->wakeups = (double)t[i].pool.wakeups / steps;
        c->stalls = t[i].pool.stalls;
        c->backoff_runs = t[i].pool.backoff_runs;
        c->own_s = t[i].pool.own_ns / 1e9 / steps;
        c->wait_s = t[i].pool.wait_ns / 1e9 / steps;
        c->alone_s = t[i].pool.alone_ns / 1e9 / steps;
        c->outside_s = c->step_s - c->own_s - c->wait_s - c->alone_s;
        c->helper_s = t[i].pool.helper_ns / 1e9 / steps;
        c->own_task_us = t[i].pool.own_tasks ? t[i].pool.own_ns / 1e3 / t[i].pool.own_tasks : 0;
        c->helper_task_us = t[i].pool.helper_tasks ? t[i].pool.helper_ns / 1e3 / t[i].pool.helper_tasks : 0;
        c->experts = t[i].experts / steps;
        c->pairs = t[i].pairs / steps;
    }
    return 0;
}

/* Each part's and piece's time a step at 1 thread over its time at N (n): what scales with the
 * threads and what does not (a part run on the calling thread alone stays near 1x), printed as a
 * line unless json; null for a part the N-thread steps spent no time in. */
static json_t *part_scaling(const struct decode_case *one, const struct decode_case *n, int json)
{
    json_t *o = json_object();
    if (!json)
        printf("            each part's time a step at 1 thread over %d threads':", n->threads);
    for (int k = 0; k < PD_PROF_N + PD_PROF_DETAIL_N; k++) {
        const int piece = k >= PD_PROF_N;
        const char *name = piece ? pd_prof_detail_name(k - PD_PROF_N) : pd_prof_part_name(k);
        const double a = (piece ? one->detail[k - PD_PROF_N] : one->share[k]) * one->prof_ms;
        const double b = (piece ? n->detail[k - PD_PROF_N] : n->share[k]) * n->prof_ms;
        if (b > 0 && a > 0) {
            json_object_set_new(o, name, json_real(a / b));
            if (!json)
                printf("%s %s %.2fx", k == PD_PROF_N ? "; within them" : "", name, a / b);
        } else {
            json_object_set_new(o, name, json_null());
        }
    }
    if (!json)
        printf("\n");
    return o;
}

int pd_bench_decode(int argc, char **argv)
{
    static const struct option opts[] = {
        {"model", 1, 0, 'm'}, {"threads", 1, 0, 'j'}, {"quick", 0, 0, 'q'}, {"steps", 1, 0, 's'},
        {"batch", 1, 0, 'b'}, {"json", 0, 0, 'J'}, {0, 0, 0, 0},
    };
    const char *dir = "models/mini";
    int threads = (int)sysconf(_SC_NPROCESSORS_ONLN), quick = 0, steps = 32, only = 0, json = 0, c;
    int steps_given = 0;
    int64_t v;
    struct pd_cli_seen seen = {0};
    optind = 1;
    opterr = 0;
    /* numbers whole (pd_cli_int_max: "2x" was read as 2 by atoi) */
    while ((c = pd_cli_getopt("bench decode", argc, argv, opts, NULL, NULL, &seen)) != -1) {
        if (c == 'm') {
            dir = optarg;
        } else if (c == 'j') {
            if (pd_cli_int_max("--threads", optarg, 1, PD_POOL_MAX_THREADS, &v))
                return 2;
            threads = (int)v;
        } else if (c == 'q') {
            quick = 1;
        } else if (c == 'b') {
            if (pd_cli_int_max("--batch", optarg, 1, 16, &v))
                return 2;
            only = (int)v;
            if (only != 1 && only != 16) {
                fprintf(stderr, "pdmoe bench decode: --batch %s: want 1 or 16\n", optarg);
                return 2;
            }
        } else if (c == 's') {
            if (pd_cli_int_max("--steps", optarg, 1, 3999, &v))
                return 2;
            steps = (int)v;
            steps_given = 1;
        } else if (c == 'J') {
            json = 1;
        } else {
            return pd_cli_bad_flag("bench decode", c, argc, argv);
        }
    }
    /* --quick (a smoke test: CI, and the tests under the sanitizers, where the batch-16 prefill of
     * 64-token prompts was nine tenths of a case's time) prefills 16 tokens a sequence; the decode
     * steps it times read the same weights either way */
    const int prompt = quick ? 16 : 64;
    if (quick && steps_given) {   /* one says 4 steps, the other how many: which was meant? */
        fprintf(stderr, "pdmoe bench decode: --quick runs 4 steps; give it or --steps, not both\n");
        return 2;
    }
    if (quick)
        steps = 4;
    /* 1 thread, then the count asked for: the scaling in one run */
    int tc[2] = {1, threads}, n_tc = threads > 1 ? 2 : 1;
    struct decode_case cases[4];
    struct pd_bench_ceilings cl[2] = {{0, 0, 0}, {0, 0, 0}};
    double bw_cpu = 0;
    const char *int8_probe = NULL, *fp32_probe = pd_bench_fp32_probe();
    int n_cases = 0, rc = 0;
    size_t huge = 0, mapped = 0;   /* the checkpoint's bytes in 2 MiB pages, of its mapped bytes */
    double load[1] = {-1};
    (void)getloadavg(load, 1);
    char name[64] = "";
    /* one engine on the most threads; its 1-thread steps run with no pool (pd_engine_swap_pool) */
    struct pd_engine en;
    struct pd_engine_opts eo = {.dir = dir, .threads = tc[n_tc - 1], .max_seqs = 16,
                                .max_model_len = prompt + n_tc * (steps + 1) + 2};
    pd_err e = {0};
    if (pd_engine_open(&en, &eo, &e)) {
        fprintf(stderr, "bench decode: %s\n", e.msg);
        return 1;
    }
    pd_pool *pools[2] = {NULL, en.pool};
    snprintf(name, sizeof name, "%s", en.model.name);
    /* the ceilings before and after the cases, each the higher reading: a probe that ran while
     * another job held a core or the memory bus reads low, and a step would then seem to beat its
     * machine */
    for (int ti = 0; ti < n_tc; ti++)
        pd_bench_ceilings_raise(pools[ti], tc[ti], quick, &cl[ti], &int8_probe, ti == 0 ? &bw_cpu : NULL);
    for (int batch = 1; batch <= 16 && !rc; batch *= 16) {
        if (only && batch != only)
            continue;
        rc = run_batch(&en, pools, tc, n_tc, batch, prompt, steps, &cases[n_cases]);
        n_cases += rc ? 0 : n_tc;
    }
    for (int ti = 0; ti < n_tc && !rc; ti++)
        pd_bench_ceilings_raise(pools[ti], tc[ti], quick, &cl[ti], &int8_probe, ti == 0 ? &bw_cpu : NULL);
    for (int k = 0; k < n_cases; k++) {
        struct decode_case *dc = &cases[k];
        pd_bench_step_bound(&en, dc->batch, dc->batch, dc->experts, dc->pairs, &cl[dc->threads == 1 ? 0 : 1], &dc->bound);
        dc->bytes = dc->bound.bytes;
    }
    /* after the steps: the pages they read are mapped by then */
    huge = pd_st_pmd_mapped_bytes(&en.w.st);
    for (size_t i = 0; i < en.w.st.nfiles; i++)
        mapped += en.w.st.files[i].file_size;
    pd_engine_close(&en);
    if (rc)
        return rc;
    double load_end[1] = {-1};
    (void)getloadavg(load_end, 1);
    const int rounds = rounds_for(steps);
    json_t *doc = json_pack("{s:s, s:s, s:i, s:i, s:i, s:f, s:f, s:[]}", "model", dir, "name", name, "prompt", prompt,
                            "steps", steps, "rounds", rounds, "load_average_start", load[0],
                            "load_average_end", load_end[0], "cases");
    json_object_set_new(doc, "bandwidth_1_thread_by_cpu_time", json_real(bw_cpu));
    json_object_set_new(doc, "checkpoint_bytes", json_integer((json_int_t)mapped));
    json_object_set_new(doc, "checkpoint_bytes_on_2MiB_pages", json_integer((json_int_t)huge));
    if (!json) {
        printf("pdmoe bench decode: %s (%s), %d-token prompts, %d decode steps, 1 and %d threads", dir, name, prompt,
               steps, threads);
        if (n_tc > 1)
            printf(" taking turns on the same sequences in %d round%s", rounds, rounds == 1 ? "" : "s");
        printf("\n");
        printf("  load average: %.2f at the start, %.2f at the end%s\n", load[0], load_end[0],
               load[0] > 1.2 || load_end[0] > 1.2 ? " (a busy machine: wall-clock figures and scaling are noisy)" : "");
        for (int ti = 0; ti < n_tc; ti++)
            printf("  read bandwidth, %d thread%s (8 streams each), the higher of before and after its cases: %.2f GB/s\n", tc[ti],
                   tc[ti] > 1 ? "s" : "", cl[ti].bw / 1e9);
        printf("  read bandwidth, 1 thread, by its CPU time: %.2f GB/s\n", bw_cpu / 1e9);
        /* where the page cache holds the checkpoint in 2 MiB folios the kernel maps them whole (fewer
         * TLB misses on the experts' scattered matrices; model/safetensors.h) */
        printf("  checkpoint mapped in 2 MiB pages: %.1f of its %.1f MB%s\n", huge / 1e6, mapped / 1e6,
               huge ? "" : " (4 KiB pages: its page cache is not in 2 MiB folios, or this kernel or file system "
                           "has none; a cold read of the file, e.g. after it left the cache, makes them where they exist)");
        for (int ti = 0; ti < n_tc; ti++)
            printf("  peaks, %d thread%s, the higher of before and after: fp32 %.1f GFLOPS (%s), int8 %.1f Gops/s (%s)\n",
                   tc[ti], tc[ti] > 1 ? "s" : "", cl[ti].fp32 / 1e9, fp32_probe ? fp32_probe : "no FMA probe: not in the bound",
                   cl[ti].int8 / 1e9, int8_probe ? int8_probe : "no int8 probe for this kernel: not in the bound");
        printf("  batch threads  tokens/s   ms/step  CPU ms/step  dispatches/step  wake-ups/step  weights MB/step  of roofline"
               "  (by CPU time)  bound ms/step  of bound\n");
    }
    for (int i = 0; i < n_cases; i++) {
        const struct decode_case *d = &cases[i];
        double frac = d->bytes / d->step_s / cl[d->threads == 1 ? 0 : 1].bw;
        /* at 1 thread the process's CPU time is the step's time without the other jobs' time
         * slices: steadier on a shared machine (as bench kernels --cpu-time) */
        double frac_cpu = d->bytes / d->cpu_s / bw_cpu;
        if (!json) {
            printf("  %5d %7d %9.1f %9.3f %12.3f %16.1f %14.1f %16.1f %12.2f", d->batch, d->threads, d->tok_s,
                   d->step_s * 1e3, d->cpu_s * 1e3, d->dispatches, d->wakeups, d->bytes / 1e6, frac);
            if (d->threads == 1)
                printf("  %13.2f", frac_cpu);
            else
                printf("  %13s", "");
            printf("  %13.3f %9.2f\n", d->bound.bound_s * 1e3, d->bound.bound_s / d->step_s);
            printf("        shares of the step:");
            for (int p = 0; p < PD_PROF_N; p++)
                printf(" %s %.1f%%", pd_prof_part_name(p), 100 * d->share[p]);
            printf("; within them:");
            for (int k = 0; k < PD_PROF_DETAIL_N; k++)
                printf(" %s %.1f%%", pd_prof_detail_name(k), 100 * d->detail[k]);
            printf("\n");
        }
        json_t *o = json_pack("{s:i, s:i, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f}", "batch", d->batch, "threads",
                              d->threads, "tokens_per_s", d->tok_s, "step_ms", d->step_s * 1e3, "cpu_ms_per_step",
                              d->cpu_s * 1e3, "dispatches_per_step", d->dispatches, "wakeups_per_step", d->wakeups,
                              "weight_bytes_per_step", d->bytes, "bandwidth_bytes_per_s", cl[d->threads == 1 ? 0 : 1].bw,
                              "of_bandwidth_roofline", frac);
        if (d->threads == 1)
            json_object_set_new(o, "of_bandwidth_roofline_by_cpu_time", json_real(frac_cpu));
        json_object_set_new(o, "fp32_peak_flops", json_real(cl[d->threads == 1 ? 0 : 1].fp32));
        json_object_set_new(o, "fp32_peak_probe", fp32_probe ? json_string(fp32_probe) : json_null());
        json_object_set_new(o, "int8_peak_ops", json_real(cl[d->threads == 1 ? 0 : 1].int8));
        json_object_set_new(o, "int8_peak_probe", int8_probe ? json_string(int8_probe) : json_null());
        json_object_set_new(o, "bound_ms_per_step", json_real(d->bound.bound_s * 1e3));
        json_object_set_new(o, "of_bandwidth_and_compute_bound", json_real(d->bound.bound_s / d->step_s));
        json_t *sh = json_object();
        for (int p = 0; p < PD_PROF_N; p++)
            json_object_set_new(sh, pd_prof_part_name(p), json_real(d->share[p]));
        json_object_set_new(o, "shares", sh);
        /* the pieces (engine/prof.h) as shares of the same total, and parts and pieces in ms a step */
        json_t *dt = json_object(), *ms = json_object();
        for (int k = 0; k < PD_PROF_DETAIL_N; k++) {
            json_object_set_new(dt, pd_prof_detail_name(k), json_real(d->detail[k]));
            json_object_set_new(ms, pd_prof_detail_name(k), json_real(d->detail[k] * d->prof_ms));
        }
        for (int p = 0; p < PD_PROF_N; p++)
            json_object_set_new(ms, pd_prof_part_name(p), json_real(d->share[p] * d->prof_ms));
        json_object_set_new(o, "detail", dt);
        json_object_set_new(o, "ms_per_step", ms);
        /* issue 17.5 at 1 thread (the 2-thread cases are judged by their scaling, below) */
        if (d->threads == 1) {
            json_object_set_new(o, "target", pd_bench_target_json(PD_TARGET_DECODE_ROOFLINE, "of_bandwidth_roofline", frac));
            if (!json)
                printf("        %.2f of the bandwidth roofline (target %s: %s)\n", frac,
                       pd_bench_target_text(PD_TARGET_DECODE_ROOFLINE), pd_bench_target_word(PD_TARGET_DECODE_ROOFLINE, frac));
        }
        /* where the calling thread's step went: what keeps N threads from N times the speed is
         * its waiting for the helpers and its work outside the pool's runs */
        if (d->threads > 1) {
            json_object_set_new(o, "caller_ms_per_step",
                                json_pack("{s:f, s:f, s:f, s:f}", "own_tasks", d->own_s * 1e3, "waiting_for_helpers",
                                          d->wait_s * 1e3, "alone_after_stall", d->alone_s * 1e3, "outside_runs",
                                          d->outside_s * 1e3));
            if (!json)
                printf("        the calling thread's step: %.3f ms its own tasks, %.3f ms waiting for the helpers' "
                       "tasks, %.3f ms alone after a stall, %.3f ms outside the pool's runs (%.0f%% of the step)\n",
                       d->own_s * 1e3, d->wait_s * 1e3, d->alone_s * 1e3, d->outside_s * 1e3,
                       100 * d->outside_s / d->step_s);
            /* a helper slower per task than the caller (same tasks, claimed in halves) is the
             * caller's wait */
            json_object_set_new(o, "task_us", json_pack("{s:f, s:f}", "caller", d->own_task_us, "helpers",
                                                         d->helper_task_us));
            json_object_set_new(o, "helpers_ms_per_step", json_real(d->helper_s * 1e3));
            if (!json)
                printf("        a task took %.2f us on the calling thread, %.2f us on the helpers (%.3f ms of "
                       "their tasks a step)\n", d->own_task_us, d->helper_task_us, d->helper_s * 1e3);
        }
        json_object_set_new(o, "stalls", json_integer((json_int_t)d->stalls));
        json_object_set_new(o, "backoff_runs", json_integer((json_int_t)d->backoff_runs));
        /* runs made on the caller alone: after a stall (a helper preempted), in or before the timed
         * steps; a case of N threads whose runs all went so ran on one */
        if (!json && (d->stalls || d->backoff_runs))
            printf("        (%llu stall%s in the timed steps; %llu pool runs made on the caller alone%s)\n", d->stalls,
                   d->stalls == 1 ? "" : "s", d->backoff_runs,
                   d->threads > 1 && d->dispatches == 0 ? ": this case ran on one thread, its scaling is not the pool's"
                                                          : "");
        json_array_append_new(json_object_get(doc, "cases"), o);
    }
    /* the scaling: N threads over 1, per batch */
    json_t *sc = json_array();
    for (int i = 0; i < n_cases; i++)
        for (int j = 0; j < n_cases; j++)
            if (cases[i].threads == 1 && cases[j].threads > 1 && cases[i].batch == cases[j].batch) {
                double r = cases[j].tok_s / cases[i].tok_s;
                /* issue 17's target; a case that ran on the caller alone measured no pool */
                const int alone = cases[j].dispatches == 0 && cases[j].backoff_runs > 0;
                /* beside it, what the machine's read bandwidth itself gains from the extra threads in
                 * this run: a step that only streamed its weights could gain no more (about 1.3x on
                 * some of the AMD hosts, where a 1.7x target is out of reach for a step that is
                 * mostly weight streaming) */
                const double bw_r = cl[1].bw / cl[0].bw;
                const enum pd_bench_target tg = PD_TARGET_DECODE_SCALING;
                if (!json)
                    printf("  batch %2d: %d threads give %.2fx 1 thread's tokens/s (target %s: %s); the read "
                           "bandwidth %.2fx\n",
                           cases[i].batch, cases[j].threads, r, pd_bench_target_text(tg),
                           alone ? "not measured, the case ran on one thread" : pd_bench_target_word(tg, r), bw_r);
                json_t *t = pd_bench_target_json(tg, "tokens_per_s_over_1_thread", r);
                if (alone)
                    json_object_set_new(t, "met", json_null());
                json_t *one = json_pack("{s:i, s:i, s:f, s:o, s:f}", "batch", cases[i].batch, "threads",
                                        cases[j].threads, "tokens_per_s_over_1_thread", r, "target", t,
                                        "bandwidth_over_1_thread", bw_r);
                json_object_set_new(one, "parts_over_1_thread", part_scaling(&cases[i], &cases[j], json));
                json_array_append_new(sc, one);
            }
    json_object_set_new(doc, "scaling", sc);
    json_object_set_new(doc, "bench", json_string("decode"));
    pd_bench_provenance(doc, argc, argv);
    if (json) {
        char *txt = json_dumps(doc, JSON_INDENT(2));
        printf("%s\n", txt);
        free(txt);
    }
    json_decref(doc);
    return 0;
}

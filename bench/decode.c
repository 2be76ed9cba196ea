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
 * Also per step: the pool's dispatches and wake-ups (what a decode step costs in hand-offs) and
 * the process's CPU time (which stays meaningful on a busy machine, where wall-clock scaling does
 * not: the load average is printed beside it); at 1 thread the roofline fraction again with the
 * step's and the bandwidth probe's time both taken as CPU time, steady on a shared machine. */
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
#include <unistd.h>

static double cpu_seconds(void)
{
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return (double)r.ru_utime.tv_sec + r.ru_utime.tv_usec * 1e-6 + (double)r.ru_stime.tv_sec + r.ru_stime.tv_usec * 1e-6;
}

/* One case's figures, per decode step (means over the timed steps). */
struct decode_case {
    int batch, threads;
    double tok_s, step_s, cpu_s, dispatches, wakeups, bytes;
    double experts, pairs;        /* distinct routed experts and (token, expert) pairs a step read */
    struct pd_bench_bound bound;  /* the least time the step can take (bench/bound.c) */
    double share[PD_PROF_N];      /* each part's share of the timed steps (engine/prof.h) */
    unsigned long long stalls, backoff_runs;   /* over all timed steps */
};

static int run(struct pd_engine *en, int batch, int prompt, int steps, struct decode_case *c)
{
    const int V = (int)en->model.vocab_size, E = (int)en->model.n_routed_experts, NL = en->model.n_layers;
    struct pd_seq *s = calloc((size_t)batch, sizeof *s);
    float *l = malloc((size_t)batch * V * 4);
    int32_t *ids = malloc((size_t)batch * prompt * 4), *next = malloc((size_t)batch * 4);
    struct pd_step_item *it = calloc((size_t)batch, sizeof *it);
    int64_t *before = malloc((size_t)NL * E * sizeof *before);
    pd_err e = {0};
    int rc = -1;
    if (!s || !l || !ids || !next || !it || !before) {
        snprintf(e.msg, sizeof e.msg, "out of memory");
        goto out;
    }
    /* a different prompt per sequence: the batch's tokens choose different experts, as a real
     * batch's do */
    for (int b = 0; b < batch; b++)
        for (int i = 0; i < prompt; i++)
            ids[(size_t)b * prompt + i] = (i * 131 + 7 + 389 * b) % (V > 1000 ? 1000 : V);
    for (int b = 0; b < batch; b++) {
        if (pd_seq_start(en, &s[b], &e))
            goto out;
        it[b] = (struct pd_step_item){.seq = &s[b], .tokens = ids + (size_t)b * prompt, .n = prompt,
                                      .logits = l + (size_t)b * V};
    }
    if (pd_engine_step(en, it, batch, &e))
        goto out;
    struct pd_sampler sm;
    pd_sampler_init(&sm, 0, 1, 0);
    double t0 = 0, cpu0 = 0, experts = 0, pairs = 0;
    struct pd_pool_stats p0 = {0}, p1;
    for (int k = 0; k <= steps; k++) {
        if (k == 1) {   /* the first decode step warms the caches */
            t0 = pd_now_s();
            cpu0 = cpu_seconds();
            pd_pool_stats(en->pool, &p0);
            pd_prof_enable(&en->prof, 1);
        }
        for (int b = 0; b < batch; b++) {
            next[b] = pd_sample(&sm, l + (size_t)b * V, V, NULL);
            it[b] = (struct pd_step_item){.seq = &s[b], .tokens = &next[b], .n = 1, .logits = l + (size_t)b * V};
        }
        memcpy(before, en->expert_tokens, (size_t)NL * E * sizeof *before);
        if (pd_engine_step(en, it, batch, &e))
            goto out;
        /* the distinct routed experts this step's tokens read, and their (token, expert) pairs */
        if (k >= 1) {
            double x, p;
            pd_bench_routed_since(en, before, &x, &p);
            experts += x;
            pairs += p;
        }
    }
    double wall = pd_now_s() - t0;
    pd_pool_stats(en->pool, &p1);
    int64_t total = 0;
    for (int p = 0; p < PD_PROF_N; p++)
        total += en->prof.ns[p];
    for (int p = 0; p < PD_PROF_N; p++)
        c->share[p] = total > 0 ? (double)en->prof.ns[p] / (double)total : 0;
    c->batch = batch;
    c->step_s = wall / steps;
    c->tok_s = (double)batch * steps / wall;
    c->cpu_s = (cpu_seconds() - cpu0) / steps;
    c->dispatches = (double)(p1.dispatches - p0.dispatches) / steps;
    c->wakeups = (double)(p1.wakeups - p0.wakeups) / steps;
    c->stalls = p1.stalls - p0.stalls;
    c->backoff_runs = p1.backoff_runs - p0.backoff_runs;
    c->experts = experts / steps;
    c->pairs = pairs / steps;
    rc = 0;
out:
    pd_prof_enable(&en->prof, 0);
    if (rc)
        fprintf(stderr, "bench decode: %s\n", e.msg);
    for (int b = 0; s && b < batch; b++)
        if (s[b].kv.blocks)
            pd_seq_end(en, &s[b]);
    free(s);
    free(l);
    free(ids);
    free(next);
    free(it);
    free(before);
    return rc;
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
    for (int ti = 0; ti < n_tc && !rc; ti++) {
        struct pd_engine en;
        struct pd_engine_opts o = {.dir = dir, .threads = tc[ti], .max_seqs = 16, .max_model_len = prompt + steps + 2};
        pd_err e = {0};
        if (pd_engine_open(&en, &o, &e)) {
            fprintf(stderr, "bench decode: %s\n", e.msg);
            return 1;
        }
        snprintf(name, sizeof name, "%s", en.model.name);
        /* the ceilings before and after this thread count's cases, each the higher reading: a probe
         * that ran while another job held a core or the memory bus reads low, and a step would
         * then seem to beat its machine */
        pd_bench_ceilings_raise(en.pool, tc[ti], quick, &cl[ti], &int8_probe, ti == 0 ? &bw_cpu : NULL);
        const int first = n_cases;
        for (int batch = 1; batch <= 16; batch *= 16) {
            if (only && batch != only)
                continue;
            struct decode_case *dc = &cases[n_cases];
            if (run(&en, batch, prompt, steps, dc)) {
                rc = 1;
                break;
            }
            dc->threads = tc[ti];
            n_cases++;
        }
        pd_bench_ceilings_raise(en.pool, tc[ti], quick, &cl[ti], &int8_probe, ti == 0 ? &bw_cpu : NULL);
        for (int k = first; k < n_cases; k++) {
            struct decode_case *dc = &cases[k];
            pd_bench_step_bound(&en, dc->batch, dc->batch, dc->experts, dc->pairs, &cl[ti], &dc->bound);
            dc->bytes = dc->bound.bytes;
        }
        /* after the steps: the pages they read are mapped by then */
        huge = pd_st_pmd_mapped_bytes(&en.w.st);
        mapped = 0;
        for (size_t i = 0; i < en.w.st.nfiles; i++)
            mapped += en.w.st.files[i].file_size;
        pd_engine_close(&en);
    }
    if (rc)
        return rc;
    double load_end[1] = {-1};
    (void)getloadavg(load_end, 1);
    json_t *doc = json_pack("{s:s, s:s, s:i, s:i, s:f, s:f, s:[]}", "model", dir, "name", name, "prompt", prompt,
                            "steps", steps, "load_average_start", load[0], "load_average_end", load_end[0], "cases");
    json_object_set_new(doc, "bandwidth_1_thread_by_cpu_time", json_real(bw_cpu));
    json_object_set_new(doc, "checkpoint_bytes", json_integer((json_int_t)mapped));
    json_object_set_new(doc, "checkpoint_bytes_on_2MiB_pages", json_integer((json_int_t)huge));
    if (!json) {
        printf("pdmoe bench decode: %s (%s), %d-token prompts, %d decode steps, 1 and %d threads\n", dir, name, prompt,
               steps, threads);
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
        /* issue 17.5 at 1 thread (the 2-thread cases are judged by their scaling, below) */
        if (d->threads == 1) {
            json_object_set_new(o, "target", pd_bench_target_json(PD_TARGET_DECODE_ROOFLINE, "of_bandwidth_roofline", frac));
            if (!json)
                printf("        %.2f of the bandwidth roofline (target %s: %s)\n", frac,
                       pd_bench_target_text(PD_TARGET_DECODE_ROOFLINE), pd_bench_target_word(PD_TARGET_DECODE_ROOFLINE, frac));
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
                json_array_append_new(sc, json_pack("{s:i, s:i, s:f, s:o, s:f}", "batch", cases[i].batch, "threads",
                                                    cases[j].threads, "tokens_per_s_over_1_thread", r, "target", t,
                                                    "bandwidth_over_1_thread", bw_r));
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

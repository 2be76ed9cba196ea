/* `pdmoe bench kernels`: int8 kernel throughput, each figure set against anchors measured in the
 * same run on this machine, nothing compiled in:
 *   1. ceilings: memory read bandwidth with several independent streams per thread (1 and N
 *      threads), the int8 and fp32 FMA peaks from instruction probes of the instructions the kernels
 *      run here: independent vpdpbusd chains (the VNNI peak, with AVX-512 VNNI), vpmaddwd + vpaddd
 *      ymm chains (the AVX2 int8 peak, when the AVX2 kernel runs), vfmadd231ps zmm or ymm chains
 *      (as wide as the float products use), the AMX peak where there is AMX;
 *   2. decode GEMV 4096x14336, DRAM-bound (rotating over >= 256 MiB of weights): GB/s vs bandwidth;
 *   3. prefill GEMM 2048x4096 and 4096x14336, 512 tokens, and 2048x4096 with 128: int8 ops/s vs
 *      the VNNI peak or the AVX2 int8 peak (and the AMX peak, where the CPU has AMX: the tile probe
 *      of gemm_amx.c);
 *   4. MoE grouped GEMM, 64 experts, 8 used per token, 2048x4096 each, 512 tokens;
 *   5. a float product: bf16 weights 4096x4096 times 16 tokens (a decode batch's projection),
 *      DRAM-bound reads, fp32 arithmetic: flops/s vs the fp32 peak;
 * and every int8 case against oneDNN's int8 matmul (bench/onednn.h) at the same shape, threads
 * and data types (s8 x s8, fp32 out with per-channel scales), the float one against oneDNN's fp32
 * matmul on the same values (it takes no bf16 weights with fp32 activations), timed right after
 * pdmoe's.
 * argv follows main(): argv[0] is the command name; options --threads N, --quick, --json,
 * --cpu-time (1 thread, timed by the thread's CPU time). */
#include "bench/bench.h"

#include <immintrin.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "bench/ceilings.h"
#include "bench/onednn.h"
#include "bench/report.h"
#include "core/threadpool.h"
#include "core/timing.h"
#include "engine/linear.h"
#include "kernels/gemm.h"
#include "kernels/ops.h"
#include "kernels/quant.h"


struct opts {
    int threads;
    int quick;
    int json;
    int cpu_time;
};

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* Random int8 over the whole range (touches every page before timing). */
static void fill_weights(int8_t *p, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v = next_rand();
        memcpy(p + i, &v, 8);
    }
    for (; i < n; i++)
        p[i] = (int8_t)next_rand();
}

static void fill_floats(float *p, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++)
        p[i] = lo + (hi - lo) * (float)(next_rand() >> 40) / (float)(1 << 24);
}

static void *xmalloc(size_t n)
{
    return pd_bench_aligned(n);
}

/* ---- timing ----------------------------------------------------------------------------- */

static int report(int rc, const pd_err *e)
{
    if (rc < 0)
        fprintf(stderr, "bench kernels: %s\n", e->msg);
    return rc;
}

#define MAX_REPS 400

/* One timed call: rep counts from 0 (warm-up calls included). 0 or a PD_E* code. */
typedef int (*timed_fn)(void *arg, int rep, pd_err *e);

/* Median seconds of `reps` calls after `warm` warm-up calls. */
static int time_median(timed_fn fn, void *arg, int warm, int reps, double *sec)
{
    pd_err e = {0};
    double t[MAX_REPS];
    if (reps < 1 || reps > MAX_REPS)
        return report(pd_err_set(&e, PD_EINVAL, "bench kernels: %d repetitions, outside [1, %d]", reps, MAX_REPS), &e);
    for (int i = -warm; i < reps; i++) {
        double t0 = pd_bench_now_s();
        int rc = fn(arg, i + warm, &e);
        if (rc < 0)
            return report(rc, &e);
        if (i >= 0)
            t[i] = pd_bench_now_s() - t0;
    }
    *sec = pd_bench_median(t, reps);
    return 0;
}

/* ---- the cases -------------------------------------------------------------------------- */

/* A product of T activation rows by n_mats weight matrices of out x in, used in turn (n_mats > 1:
 * a set larger than the caches, so every call reads its weights from DRAM). */
struct mm_case {
    int out, in, T, n_mats, reps;
    int8_t *w;              // [n_mats, out, in]
    float *ws;              // [n_mats, out]
    float *x;               // [T, in]
    int8_t *xq;             // [T, in]
    float *xs;              // [T]
    float *y;               // [T, out]
    pd_pool *pool;          /* the threads pdmoe runs on */
    pd_onednn_mm **dnn;     // [n_mats] oneDNN's primitives, or NULL
};

static int mm_pdmoe(void *arg, int rep, pd_err *e)
{
    struct mm_case *g = arg;
    int m = rep % g->n_mats;
    pd_qmat W = {g->w + (size_t)m * g->out * g->in, g->ws + (size_t)m * g->out, g->out, g->in};
    pd_qmat X = {g->xq, g->xs, g->T, g->in};
    return pd_gemm(g->pool, &W, &X, g->y, 0, e);
}

static int mm_onednn(void *arg, int rep, pd_err *e)
{
    struct mm_case *g = arg;
    return pd_onednn_mm_run(g->dnn[rep % g->n_mats], g->xq, g->y, e);
}

static int mm_quant(void *arg, int rep, pd_err *e)
{
    struct mm_case *g = arg;
    pd_quant_rows_pool(g->pool, g->x, g->T, g->in, g->xq, g->xs);
    return 0;
}

static int mm_case_alloc(struct mm_case *g)
{
    size_t per = (size_t)g->out * g->in;
    g->w = xmalloc(per * g->n_mats);
    g->ws = xmalloc((size_t)g->out * g->n_mats * sizeof(float));
    g->x = xmalloc((size_t)g->T * g->in * sizeof(float));
    g->xq = xmalloc((size_t)g->T * g->in);
    g->xs = xmalloc((size_t)g->T * sizeof(float));
    g->y = xmalloc((size_t)g->T * g->out * sizeof(float));
    g->dnn = calloc((size_t)g->n_mats, sizeof *g->dnn);
    if (!g->w || !g->ws || !g->x || !g->xq || !g->xs || !g->y || !g->dnn)
        return -1;
    fill_weights(g->w, per * g->n_mats);
    fill_floats(g->ws, (size_t)g->out * g->n_mats, 1e-3f, 2e-3f);
    fill_floats(g->x, (size_t)g->T * g->in, -1.0f, 1.0f);
    pd_quant_rows_pool(g->pool, g->x, g->T, g->in, g->xq, g->xs);
    return 0;
}

/* oneDNN's primitives for every matrix (weights reordered now, outside the timing). */
static int mm_case_onednn(struct mm_case *g)
{
    pd_err e = {0};
    for (int m = 0; m < g->n_mats; m++)
        if (report(pd_onednn_mm_create(g->T, g->out, g->in, g->w + (size_t)m * g->out * g->in,
                                       g->ws + (size_t)m * g->out, PD_ONEDNN_F32, &g->dnn[m], &e),
                   &e) < 0)
            return -1;
    return 0;
}

static void mm_case_free(struct mm_case *g)
{
    for (int m = 0; g->dnn && m < g->n_mats; m++)
        pd_onednn_mm_free(g->dnn[m]);
    free(g->dnn);
    free(g->w);
    free(g->ws);
    free(g->x);
    free(g->xq);
    free(g->xs);
    free(g->y);
}

struct moe_case {
    int E, topk, out, in, T, reps;
    int8_t *w;            // [E, out, in]
    float *ws;            // [E, out]
    float *x;             // [T, in]
    int8_t *xq;           // [T, in]
    float *xs;            // [T]
    int32_t *rows;        // [E, T] tokens routed to each expert
    float *y;             // [T * topk, out] outputs, expert by expert
    pd_gemm_group *g;     // [E]
    pd_pool *pool;
    int8_t *xg;           // [T * topk, in] each expert's tokens gathered, expert by expert (oneDNN)
    pd_onednn_mm **dnn;   // [E] one primitive per expert with tokens, else NULL
};

static int moe_pdmoe(void *arg, int rep, pd_err *e)
{
    struct moe_case *m = arg;
    pd_qmat X = {m->xq, m->xs, m->T, m->in};
    return pd_gemm_grouped(m->pool, &X, m->g, m->E, 0, e);
}

/* oneDNN has no grouped matmul: one call per expert on its gathered tokens (gathered before the
 * timing, which favours oneDNN). */
static int moe_onednn(void *arg, int rep, pd_err *e)
{
    struct moe_case *m = arg;
    size_t off = 0;
    for (int x = 0; x < m->E; x++) {
        if (m->g[x].n == 0)
            continue;
        int rc = pd_onednn_mm_run(m->dnn[x], m->xg + off * m->in, m->g[x].y, e);
        if (rc < 0)
            return rc;
        off += (size_t)m->g[x].n;
    }
    return 0;
}

/* Routes every token to topk distinct experts drawn uniformly (fixed seed). */
static void route(struct moe_case *m)
{
    int *n = calloc((size_t)m->E, sizeof *n);
    for (int t = 0; t < m->T; t++) {
        int chosen[64];
        for (int j = 0; j < m->topk; j++) {
            int e, dup;
            do {
                e = (int)(next_rand() % (uint64_t)m->E);
                dup = 0;
                for (int q = 0; q < j; q++)
                    dup |= chosen[q] == e;
            } while (dup);
            chosen[j] = e;
            m->rows[(size_t)e * m->T + n[e]++] = t;
        }
    }
    size_t off = 0;
    for (int e = 0; e < m->E; e++) {
        m->g[e] = (pd_gemm_group){
            .w = {m->w + (size_t)e * m->out * m->in, m->ws + (size_t)e * m->out, m->out, m->in},
            .rows = m->rows + (size_t)e * m->T,
            .n = n[e],
            .y = m->y + off * m->out,
        };
        for (int j = 0; j < n[e]; j++)
            memcpy(m->xg + (off + j) * m->in, m->xq + (size_t)m->g[e].rows[j] * m->in, (size_t)m->in);
        off += n[e];
    }
    free(n);
}

static int parse_opts(int argc, char **argv, struct opts *o)
{
    o->threads = 2;
    o->quick = 0;
    o->json = 0;
    o->cpu_time = 0;
    int threads_set = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) {
            o->quick = 1;
        } else if (strcmp(argv[i], "--json") == 0) {
            o->json = 1;
        } else if (strcmp(argv[i], "--cpu-time") == 0) {
            o->cpu_time = 1;
        } else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 1 || v > PD_POOL_MAX_THREADS) {
                fprintf(stderr, "bench kernels: --threads wants 1..%d, got '%s'\n",
                        PD_POOL_MAX_THREADS, argv[i]);
                return -1;
            }
            o->threads = (int)v;
            threads_set = 1;
        } else {
            fprintf(stderr, "pdmoe bench kernels: %s %s (see pdmoe bench kernels --help)\n",
                    strcmp(argv[i], "--threads") ? "unknown option" : "needs a value:", argv[i]);
            return -1;
        }
    }
    if (o->cpu_time && threads_set && o->threads != 1) {
        fprintf(stderr, "pdmoe bench kernels: --cpu-time times the calling thread only: it needs "
                "--threads 1, got --threads %d\n", o->threads);
        return -1;
    }
    if (o->cpu_time)
        o->threads = 1;
    return 0;
}

/* What every section needs: the pool, the thread counts measured (1 and N), the ceilings and the
 * JSON document's cases. */
struct ctx {
    struct opts o;
    pd_pool *pool;    /* N threads; NULL when N = 1 */
    pd_kernel k;
    int tcount[2], nt;
    double bw[2];     /* bytes/s per thread count */
    double peak[2];   /* int8 ops/s per thread count */
    double amx[2];    /* the AMX peak, int8 ops/s per thread count, 0 without AMX */
    double avx2[2];   /* the AVX2 int8 peak (vpmaddwd + vpaddd), int8 ops/s per thread count, 0 unless the AVX2 kernel runs */
    double fp32[2];   /* the fp32 FMA peak, flops/s per thread count, 0 without AVX-512 or AVX2 + FMA */
    json_t *ceilings, *cases;
};

static pd_pool *pool_for(const struct ctx *c, int i)
{
    return c->tcount[i] > 1 ? c->pool : NULL;
}

static const char *plural(int n)
{
    return n > 1 ? "s" : " ";
}

/* The human-readable report: on stdout, or nowhere with --json (which prints the document only). */
__attribute__((format(printf, 2, 3))) static void say(const struct ctx *c, const char *fmt, ...)
{
    if (c->o.json)
        return;
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
}

/* The buffer the bandwidth probe sums (*bytes of it, touched), or NULL. */
static int64_t *bw_buffer(const struct ctx *c, size_t *bytes)
{
    *bytes = (size_t)(c->o.quick ? 128 : 512) << 20;
    int64_t *buf = xmalloc(*bytes);
    if (buf)
        memset(buf, 1, *bytes);
    return buf;
}

static int bench_ceilings(struct ctx *c)
{
    size_t bytes;
    int reps = c->o.quick ? 2 : 7;
    int64_t *buf = bw_buffer(c, &bytes);
    if (!buf)
        return -1;
    say(c, "1. Machine ceilings\n");
    for (int i = 0; i < c->nt; i++) {
        c->bw[i] = pd_bench_bandwidth(pool_for(c, i), c->tcount[i], buf, bytes, reps);
        say(c, "   memory read bandwidth, %d thread%s: %7.2f GB/s (%d streams per task, int64 sum "
            "over %zu MiB, %s loads, best of %d)\n", c->tcount[i], plural(c->tcount[i]),
            c->bw[i] / 1e9, PD_BENCH_BW_STREAMS, bytes >> 20, pd_bench_bandwidth_isa(), reps);
    }
    free(buf);

    double hz = pd_bench_nominal_clock_hz();
    for (int i = 0; i < c->nt; i++) {
        if (pd_gemm_kernel_supported(PD_KERNEL_AVX512)) {
            c->peak[i] = pd_bench_vnni_peak(pool_for(c, i), c->tcount[i], c->o.quick);
            say(c, "   VNNI peak, %d thread%s: %7.1f Gops/s (16 independent VPDPBUSD zmm chains per "
                "thread; %.0f int8 ops each)", c->tcount[i], plural(c->tcount[i]), c->peak[i] / 1e9,
                PD_BENCH_OPS_PER_VPDPBUSD);
            if (hz > 0)
                say(c, " = %.2f VPDPBUSD per cycle per core at the nominal %.2f GHz",
                    c->peak[i] / hz / c->tcount[i] / PD_BENCH_OPS_PER_VPDPBUSD, hz / 1e9);
            say(c, "\n");
        } else {
            c->peak[i] = 0;
            if (i == 0)
                say(c, "   no AVX-512 VNNI here: no VNNI peak\n");
        }
        /* the AVX2 kernel's products (gemm_avx2.c), probed when that kernel is the one running */
        c->avx2[i] = c->k == PD_KERNEL_AVX2 ? pd_bench_avx2_int8_peak(pool_for(c, i), c->tcount[i], c->o.quick) : 0;
        if (c->avx2[i] > 0) {
            say(c, "   AVX2 int8 peak (vpmaddwd), %d thread%s: %7.1f Gops/s (12 independent VPMADDWD ymm products, "
                "each added by VPADDD into 6 chains, per thread; %.0f int8 ops each pair)", c->tcount[i],
                plural(c->tcount[i]), c->avx2[i] / 1e9, PD_BENCH_OPS_PER_VPMADDWD);
            if (hz > 0)
                say(c, " = %.2f VPMADDWD per cycle per core at the nominal %.2f GHz",
                    c->avx2[i] / hz / c->tcount[i] / PD_BENCH_OPS_PER_VPMADDWD, hz / 1e9);
            say(c, "\n");
        } else if (c->peak[i] <= 0 && i == 0) {
            say(c, "   no int8 instruction probe for the %s kernel: int8 ratios against oneDNN only\n",
                pd_gemm_kernel_name(c->k));
        }
        double amx = c->amx[i] = pd_bench_amx_peak(pool_for(c, i), c->tcount[i], c->o.quick);
        if (amx > 0)
            say(c, "   AMX peak, %d thread%s: %7.1f Gops/s (4 independent TDPBSSD tile chains per thread; %.0f int8 "
                "ops each); the GEMM cases run the AMX kernel (%s)\n", c->tcount[i], plural(c->tcount[i]), amx / 1e9,
                PD_GEMM_AMX_OPS, pd_gemm_kernel_name(c->k));
        else if (i == 0)
            say(c, "   no AMX-INT8 here (amx_int8 not in /proc/cpuinfo, or Linux refused the tile state): no AMX "
                "peak, the AMX kernel not measured\n");
        c->fp32[i] = pd_bench_fp32_peak(pool_for(c, i), c->tcount[i], c->o.quick);
        const char *fma = pd_bench_fp32_probe();
        if (c->fp32[i] > 0)
            say(c, "   fp32 FMA peak, %d thread%s: %7.1f GFLOPS (independent %s chains per thread)\n",
                c->tcount[i], plural(c->tcount[i]), c->fp32[i] / 1e9, fma);
        else if (i == 0)
            say(c, "   neither AVX-512 nor AVX2 + FMA here: no fp32 FMA peak\n");
        /* a peak not probed is null, named by what it measures: no ratio is against a ceiling
         * this CPU has not got (the VNNI peak read 0 on an AVX2-only host) */
        json_array_append_new(c->ceilings, json_pack("{s:i, s:f, s:o, s:o, s:o, s:o, s:o}", "threads", c->tcount[i],
                                                     "read_GBps", c->bw[i] / 1e9,
                                                     "vnni_peak_gops", c->peak[i] > 0 ? json_real(c->peak[i] / 1e9) : json_null(),
                                                     "avx2_int8_peak_gops",
                                                     c->avx2[i] > 0 ? json_real(c->avx2[i] / 1e9) : json_null(),
                                                     "amx_peak_gops", amx > 0 ? json_real(amx / 1e9) : json_null(),
                                                     "fp32_peak_gflops",
                                                     c->fp32[i] > 0 ? json_real(c->fp32[i] / 1e9) : json_null(),
                                                     "fp32_peak_probe", fma && c->fp32[i] > 0 ? json_string(fma) : json_null()));
    }
    return 0;
}

/* The ceilings again once the cases have run: a core or the memory bus another job held during
 * the first probe reads a ceiling low, and a case then seems to beat its machine (seen on a shared
 * host: the 2-thread fp32 peak read as one core's, and a float product printed at "1.26 of the
 * fp32 peak"). Each ceiling becomes the higher of its two readings; --json's ceilings and every
 * case's fraction of one are against that, and the text names each ceiling that rose by more than
 * 5% with the fractions it changes. */
static int recheck_ceilings(struct ctx *c)
{
    size_t bytes;
    int64_t *buf = bw_buffer(c, &bytes);
    if (!buf)
        return -1;
    int said = 0;
    for (int i = 0; i < c->nt; i++) {
        pd_pool *pool = pool_for(c, i);
        const int t = c->tcount[i];
        struct {
            const char *what, *unit, *ceiling_key, *case_key;
            double *at_start, again;
        } k[] = {
            {"read bandwidth", "GB/s", "read_GBps", "pdmoe_of_bandwidth", &c->bw[i],
             pd_bench_bandwidth(pool, t, buf, bytes, c->o.quick ? 2 : 7)},
            {"VNNI peak", "Gops/s", "vnni_peak_gops", "pdmoe_of_vnni_peak", &c->peak[i],
             c->peak[i] > 0 ? pd_bench_vnni_peak(pool, t, c->o.quick) : 0},
            {"AMX peak", "Gops/s", "amx_peak_gops", "pdmoe_of_amx_peak", &c->amx[i],
             c->amx[i] > 0 ? pd_bench_amx_peak(pool, t, c->o.quick) : 0},
            {"AVX2 int8 peak (vpmaddwd)", "Gops/s", "avx2_int8_peak_gops", "pdmoe_of_avx2_int8_peak", &c->avx2[i],
             c->avx2[i] > 0 ? pd_bench_avx2_int8_peak(pool, t, c->o.quick) : 0},
            {"fp32 FMA peak", "GFLOPS", "fp32_peak_gflops", "pdmoe_of_fp32_peak", &c->fp32[i],
             c->fp32[i] > 0 ? pd_bench_fp32_peak(pool, t, c->o.quick) : 0},
        };
        json_t *ceil = json_array_get(c->ceilings, (size_t)i);
        for (size_t j = 0; j < sizeof k / sizeof *k; j++) {
            const double was = *k[j].at_start;
            if (was <= 0 || k[j].again <= was)
                continue;
            const double r = was / k[j].again;
            const int tell = r < 1 / 1.05;
            *k[j].at_start = k[j].again;
            json_object_set_new(ceil, k[j].ceiling_key, json_real(k[j].again / 1e9));
            if (tell)
                say(c, "%s   %s, %d thread%s: %.2f %s at the start, %.2f now\n",
                    said++ ? "" : "\nCeilings re-measured after the cases, each now the higher of its two readings "
                                  "(the machine was busy during a first probe):\n",
                    k[j].what, t, plural(t), was / 1e9, k[j].unit, k[j].again / 1e9);
            for (size_t n = 0; n < json_array_size(c->cases); n++) {
                json_t *o = json_array_get(c->cases, n), *f = json_object_get(o, k[j].case_key);
                if (json_integer_value(json_object_get(o, "threads")) != t || !json_is_number(f))
                    continue;
                if (tell) {
                    char *sh = json_dumps(json_object_get(o, "shape"), JSON_COMPACT | JSON_PRESERVE_ORDER);
                    say(c, "      %s %s: %.2f of the %s -> %.2f\n", json_string_value(json_object_get(o, "kind")),
                        sh ? sh : "", json_number_value(f), k[j].what, json_number_value(f) * r);
                    free(sh);
                }
                json_object_set_new(o, k[j].case_key, json_real(json_number_value(f) * r));
            }
        }
    }
    free(buf);
    return 0;
}

/* One case's JSON object (GOPS: 10^9 int8 multiply-adds x 2 per second, the "GFLOPS" of int8). */
static void add_case(struct ctx *c, const char *kind, json_t *shape, int i, double pd_ops,
                     double dnn_ops)
{
    json_t *o = json_pack("{s:s, s:o, s:i, s:f, s:f, s:f}", "kind", kind, "shape", shape,
                          "threads", c->tcount[i], "pdmoe_gflops", pd_ops / 1e9,
                          "onednn_gflops", dnn_ops / 1e9, "pdmoe_over_onednn", pd_ops / dnn_ops);
    if (c->peak[i] > 0)
        json_object_set_new(o, "pdmoe_of_vnni_peak", json_real(pd_ops / c->peak[i]));
    if (c->amx[i] > 0)
        json_object_set_new(o, "pdmoe_of_amx_peak", json_real(pd_ops / c->amx[i]));
    if (c->avx2[i] > 0)
        json_object_set_new(o, "pdmoe_of_avx2_int8_peak", json_real(pd_ops / c->avx2[i]));
    json_array_append_new(c->cases, o);
}

static int bench_gemv(struct ctx *c)
{
    struct mm_case g = {.out = 4096, .in = 14336, .T = 1, .reps = c->o.quick ? 8 : 300};
    size_t per = (size_t)g.out * g.in;
    /* Enough matrices that the set is >= 256 MiB (8x L3), so every call reads from DRAM. */
    g.n_mats = c->o.quick ? 2 : (int)((((size_t)256 << 20) + per - 1) / per);
    int rc = -1;
    if (mm_case_alloc(&g) || mm_case_onednn(&g))
        goto done;
    double bytes = (double)per + (double)g.out * sizeof(float), ops = 2.0 * per;
    say(c, "\n2. Decode GEMV, out %d x in %d int8 (%.1f MB), T = 1, rotating over %d matrices "
        "(%.0f MiB)\n", g.out, g.in, bytes / 1e6, g.n_mats, (double)per * g.n_mats / (1 << 20));
    for (int i = 0; i < c->nt; i++) {
        double s, sd;
        g.pool = pool_for(c, i);
        pd_onednn_threads(c->tcount[i]);
        if (time_median(mm_pdmoe, &g, g.n_mats, g.reps, &s) < 0 ||
            time_median(mm_onednn, &g, g.n_mats, g.reps, &sd) < 0)
            goto done;
        double gbs = bytes / s / 1e9;
        say(c, "   %d thread%s: %8.1f us  %6.2f GB/s  = %.2f of the read bandwidth | oneDNN %8.1f us: "
            "pdmoe %.2fx\n", c->tcount[i], plural(c->tcount[i]), s * 1e6, gbs, gbs * 1e9 / c->bw[i],
            sd * 1e6, sd / s);
        json_t *shape = json_pack("{s:i, s:i, s:i}", "out", g.out, "in", g.in, "tokens", 1);
        add_case(c, "gemv", shape, i, ops / s, ops / sd);
        json_object_set_new(json_array_get(c->cases, json_array_size(c->cases) - 1),
                            "pdmoe_of_bandwidth", json_real(bytes / s / c->bw[i]));
    }
    rc = 0;
done:
    mm_case_free(&g);
    return rc;
}

/* The prefill GEMM's tokens, those of issue 17.2's targets and of the MoE case's dense match. */
static int gemm_tokens(const struct ctx *c)
{
    return c->o.quick ? 64 : 512;
}

static int bench_gemm_shape(struct ctx *c, int out, int in, int T)
{
    struct mm_case g = {.out = out, .in = in, .T = T, .n_mats = 1, .reps = c->o.quick ? 3 : 15};
    int rc = -1;
    if (mm_case_alloc(&g) || mm_case_onednn(&g))
        goto done;
    double ops = 2.0 * g.out * g.in * g.T;
    say(c, "\n3. Prefill GEMM, out %d x in %d, %d tokens (%.2f G int8 ops)\n", g.out, g.in, g.T,
        ops / 1e9);
    for (int i = 0; i < c->nt; i++) {
        double s, sd;
        g.pool = pool_for(c, i);
        pd_onednn_threads(c->tcount[i]);
        if (time_median(mm_pdmoe, &g, 1, g.reps, &s) < 0 ||
            time_median(mm_onednn, &g, 1, g.reps, &sd) < 0)
            goto done;
        say(c, "   %d thread%s: %8.2f ms  %7.1f Gops/s", c->tcount[i], plural(c->tcount[i]), s * 1e3,
            ops / s / 1e9);
        if (c->peak[i] > 0)
            say(c, " = %.2f of the VNNI peak", ops / s / c->peak[i]);
        if (c->amx[i] > 0)
            say(c, ", %.2f of the AMX peak", ops / s / c->amx[i]);
        if (c->avx2[i] > 0)
            say(c, " = %.2f of the AVX2 int8 peak (vpmaddwd)", ops / s / c->avx2[i]);
        say(c, " | oneDNN %7.1f Gops/s: pdmoe %.2fx\n", ops / sd / 1e9, sd / s);
        json_t *shape = json_pack("{s:i, s:i, s:i}", "out", g.out, "in", g.in, "tokens", g.T);
        add_case(c, "gemm", shape, i, ops / s, ops / sd);
        double sq;
        if (time_median(mm_quant, &g, 1, g.reps, &sq) < 0)
            goto done;
        say(c, "      activation quantisation (fp32 -> int8 per token, on the same threads, not in the "
            "times above): %.3f ms = %.3f of the GEMM\n", sq * 1e3, sq / s);
        json_object_set_new(json_array_get(c->cases, json_array_size(c->cases) - 1), "quant_ms",
                            json_real(sq * 1e3));
    }
    if (c->k == PD_KERNEL_AVX512 && pd_gemm_kernel_supported(PD_KERNEL_AVX2) && !c->o.quick) {
        /* The path CPUs without VNNI take, for reference. */
        pd_err e = {0};
        double s;
        g.pool = NULL;
        pd_gemm_kernel_set(PD_KERNEL_AVX2, &e);
        int r2 = time_median(mm_pdmoe, &g, 1, 3, &s);
        pd_gemm_kernel_set(c->k, &e);
        if (r2 < 0)
            goto done;
        say(c, "   (avx2 kernel, 1 thread:  %8.2f ms  %7.1f Gops/s)\n", s * 1e3, ops / s / 1e9);
    }
    rc = 0;
done:
    mm_case_free(&g);
    return rc;
}

static int bench_gemm(struct ctx *c)
{
    /* and a short prompt's (or a hot expert's) quarter of the tokens, which the AMX kernel takes
     * with the weights read in place (pd_gemm_amx_in_place) */
    const int T = gemm_tokens(c);
    return bench_gemm_shape(c, 2048, 4096, T) < 0 || bench_gemm_shape(c, 4096, 14336, T) < 0 ||
                   bench_gemm_shape(c, 2048, 4096, T / 4) < 0
               ? -1
               : 0;
}

static int bench_moe(struct ctx *c)
{
    struct moe_case m = {.E = c->o.quick ? 16 : 64, .topk = c->o.quick ? 4 : 8, .out = 2048,
                         .in = 4096, .T = gemm_tokens(c), .reps = c->o.quick ? 1 : 7};
    size_t per = (size_t)m.out * m.in;
    int rc = -1;
    pd_err e = {0};
    m.w = xmalloc(per * m.E);
    m.ws = xmalloc((size_t)m.E * m.out * sizeof(float));
    m.x = xmalloc((size_t)m.T * m.in * sizeof(float));
    m.xq = xmalloc((size_t)m.T * m.in);
    m.xs = xmalloc((size_t)m.T * sizeof(float));
    m.rows = xmalloc((size_t)m.E * m.T * sizeof(int32_t));
    m.y = xmalloc((size_t)m.T * m.topk * m.out * sizeof(float));
    m.g = xmalloc((size_t)m.E * sizeof *m.g);
    m.xg = xmalloc((size_t)m.T * m.topk * m.in);
    m.dnn = calloc((size_t)m.E, sizeof *m.dnn);
    if (!m.w || !m.ws || !m.x || !m.xq || !m.xs || !m.rows || !m.y || !m.g || !m.xg || !m.dnn)
        goto done;
    fill_weights(m.w, per * m.E);
    fill_floats(m.ws, (size_t)m.E * m.out, 1e-3f, 2e-3f);
    fill_floats(m.x, (size_t)m.T * m.in, -1.0f, 1.0f);
    pd_quant_rows(m.x, m.T, m.in, m.xq, m.xs);
    route(&m);
    for (int x = 0; x < m.E; x++)
        if (m.g[x].n > 0 &&
            report(pd_onednn_mm_create(m.g[x].n, m.out, m.in, m.g[x].w.q, m.g[x].w.scale,
                                       PD_ONEDNN_F32, &m.dnn[x], &e), &e) < 0)
            goto done;
    double ops = 2.0 * m.out * m.in * (double)m.T * m.topk, bytes = 0;
    for (int x = 0; x < m.E; x++)   /* every used expert's weights, read once a call from DRAM */
        bytes += m.g[x].n > 0 ? (double)per : 0;
    say(c, "\n4. MoE grouped GEMM, %d experts of out %d x in %d (%.0f MiB), %d used per token, "
        "%d tokens (%.1f G int8 ops); oneDNN: one matmul per expert on its gathered tokens\n", m.E,
        m.out, m.in, (double)per * m.E / (1 << 20), m.topk, m.T, ops / 1e9);
    for (int i = 0; i < c->nt; i++) {
        double s, sd;
        m.pool = pool_for(c, i);
        pd_onednn_threads(c->tcount[i]);
        if (time_median(moe_pdmoe, &m, 1, m.reps, &s) < 0 ||
            time_median(moe_onednn, &m, 1, m.reps, &sd) < 0)
            goto done;
        say(c, "   %d thread%s: %8.2f ms  %7.1f Gops/s", c->tcount[i], plural(c->tcount[i]), s * 1e3,
            ops / s / 1e9);
        if (c->peak[i] > 0)
            say(c, " = %.2f of the VNNI peak", ops / s / c->peak[i]);
        if (c->amx[i] > 0)
            say(c, ", %.2f of the AMX peak", ops / s / c->amx[i]);
        if (c->avx2[i] > 0)
            say(c, " = %.2f of the AVX2 int8 peak (vpmaddwd)", ops / s / c->avx2[i]);
        say(c, " | oneDNN %7.1f Gops/s: pdmoe %.2fx\n", ops / sd / 1e9, sd / s);
        say(c, "      its experts' weights (%.0f MiB, each read once) at %.2f GB/s = %.2f of the read bandwidth\n",
            bytes / (1 << 20), bytes / s / 1e9, bytes / s / c->bw[i]);
        json_t *shape = json_pack("{s:i, s:i, s:i, s:i, s:i}", "out", m.out, "in", m.in,
                                  "tokens", m.T, "experts", m.E, "per_token", m.topk);
        add_case(c, "moe", shape, i, ops / s, ops / sd);
        json_t *mc = json_array_get(c->cases, json_array_size(c->cases) - 1);
        json_object_set_new(mc, "weight_bytes", json_real(bytes));
        json_object_set_new(mc, "pdmoe_of_bandwidth", json_real(bytes / s / c->bw[i]));
    }
    rc = 0;
done:
    for (int x = 0; m.dnn && x < m.E; x++)
        pd_onednn_mm_free(m.dnn[x]);
    free(m.dnn);
    free(m.xg);
    free(m.w);
    free(m.ws);
    free(m.x);
    free(m.xq);
    free(m.xs);
    free(m.rows);
    free(m.y);
    free(m.g);
    return rc;
}

/* ---- decode's routed experts --------------------------------------------------------------- */

/* A batch-1 decode step's routed experts as the engine runs them (engine/moe.c): per layer, `K`
 * of `E` experts chosen at random, each a gate and an up projection [I, H] and a down one [H, I]
 * stored one after the other, through two grouped products (gate and up of every expert, then
 * down); over enough layers (>= 256 MiB) that each call reads its experts from DRAM. Every expert
 * is a few short matrices somewhere in memory, which the hardware prefetchers barely see before
 * it ends: the bytes' rate against the multi-stream read bandwidth shows what that costs, and
 * oneDNN runs the same matrices one matmul each (its primitives made beforehand). */
struct xp_case {
    int E, K, H, I, L, reps, n_draws;
    int8_t *w;              // [L, E, 3, H * I] w1 [I, H], w2 [H, I], w3 [I, H]
    float *ws;              // [L, E, 3, H] scales (first I or H used)
    int8_t *xq, *x2q;       // [H], [K, I]
    float *xs, *x2s;        // [1], [K]
    float *y;               // [K, 2 * I + H]
    int32_t *draw;          // [n_draws, K] the experts of each call, ascending (the engine's order)
    int32_t *krow;          // [K] 0, 1, ...: expert k's down projection reads row k of x2q
    pd_gemm_group *grp;     // [2 * K]
    pd_pool *pool;
    pd_onednn_mm **dnn;     // [L * E * 3]
};

static const int8_t *xp_w(const struct xp_case *x, int l, int e, int j)
{
    return x->w + (((size_t)l * x->E + e) * 3 + j) * x->H * x->I;
}

static const float *xp_s(const struct xp_case *x, int l, int e, int j)
{
    return x->ws + (((size_t)l * x->E + e) * 3 + j) * x->H;
}

static int xp_pdmoe(void *arg, int rep, pd_err *e)
{
    struct xp_case *x = arg;
    const int l = rep % x->L, *ex = x->draw + (size_t)(rep % x->n_draws) * x->K;
    static const int32_t row0 = 0;
    float *g = x->y, *u = g + (size_t)x->K * x->I, *d = u + (size_t)x->K * x->I;
    for (int k = 0; k < x->K; k++) {
        x->grp[2 * k] = (pd_gemm_group){.w = {xp_w(x, l, ex[k], 0), xp_s(x, l, ex[k], 0), x->I, x->H},
                                        .rows = &row0, .n = 1, .y = g + (size_t)k * x->I};
        x->grp[2 * k + 1] = (pd_gemm_group){.w = {xp_w(x, l, ex[k], 2), xp_s(x, l, ex[k], 2), x->I, x->H},
                                            .rows = &row0, .n = 1, .y = u + (size_t)k * x->I};
    }
    pd_qmat a = {x->xq, x->xs, 1, x->H}, a2 = {x->x2q, x->x2s, x->K, x->I};
    if (pd_gemm_grouped(x->pool, &a, x->grp, 2 * x->K, 0, e))
        return -1;
    for (int k = 0; k < x->K; k++)
        x->grp[k] = (pd_gemm_group){.w = {xp_w(x, l, ex[k], 1), xp_s(x, l, ex[k], 1), x->H, x->I},
                                    .rows = x->krow + k, .n = 1, .y = d + (size_t)k * x->H};
    return pd_gemm_grouped(x->pool, &a2, x->grp, x->K, 0, e) ? -1 : 0;
}

static int xp_onednn(void *arg, int rep, pd_err *e)
{
    struct xp_case *x = arg;
    const int l = rep % x->L, *ex = x->draw + (size_t)(rep % x->n_draws) * x->K;
    float *g = x->y, *u = g + (size_t)x->K * x->I, *d = u + (size_t)x->K * x->I;
    for (int k = 0; k < x->K; k++) {
        pd_onednn_mm **m = x->dnn + ((size_t)l * x->E + ex[k]) * 3;
        if (pd_onednn_mm_run(m[0], x->xq, g + (size_t)k * x->I, e) < 0 ||
            pd_onednn_mm_run(m[2], x->xq, u + (size_t)k * x->I, e) < 0)
            return -1;
    }
    for (int k = 0; k < x->K; k++) {
        pd_onednn_mm **m = x->dnn + ((size_t)l * x->E + ex[k]) * 3;
        if (pd_onednn_mm_run(m[1], x->x2q + (size_t)k * x->I, d + (size_t)k * x->H, e) < 0)
            return -1;
    }
    return 0;
}

static int bench_experts(struct ctx *c)
{
    struct xp_case x = {.E = c->o.quick ? 32 : 256, .K = 7, .H = 512, .I = 256, .n_draws = 1024,
                        .reps = c->o.quick ? 30 : MAX_REPS};
    const size_t per_layer = (size_t)x.E * 3 * x.H * x.I;
    x.L = c->o.quick ? 1 : (int)((((size_t)256 << 20) + per_layer - 1) / per_layer);
    const size_t mats = (size_t)x.L * x.E * 3;
    int rc = -1;
    pd_err e = {0};
    x.w = xmalloc(mats * x.H * x.I);
    x.ws = xmalloc(mats * x.H * sizeof(float));
    x.xq = xmalloc((size_t)x.H);
    x.x2q = xmalloc((size_t)x.K * x.I);
    x.xs = xmalloc(sizeof(float));
    x.x2s = xmalloc((size_t)x.K * sizeof(float));
    x.y = xmalloc((size_t)x.K * (2 * x.I + x.H) * sizeof(float));
    x.draw = xmalloc((size_t)x.n_draws * x.K * sizeof(int32_t));
    x.grp = xmalloc((size_t)2 * x.K * sizeof *x.grp);
    x.krow = xmalloc((size_t)x.K * sizeof *x.krow);
    x.dnn = calloc(mats, sizeof *x.dnn);
    if (!x.w || !x.ws || !x.xq || !x.x2q || !x.xs || !x.x2s || !x.y || !x.draw || !x.grp || !x.krow || !x.dnn)
        goto done;
    for (int k = 0; k < x.K; k++)
        x.krow[k] = k;
    fill_weights(x.w, mats * x.H * x.I);
    fill_floats(x.ws, mats * x.H, 1e-3f, 2e-3f);
    /* the activations quantised as the engine's are (pd_quant_rows: never -128, which the AVX2
     * one-token kernel relies on; random bytes would hold -128 and take its slower path) */
    float *xf = xmalloc((size_t)x.K * x.I * sizeof *xf + (size_t)x.H * sizeof *xf);
    if (!xf)
        goto done;
    fill_floats(xf, (size_t)x.K * x.I + (size_t)x.H, -1.0f, 1.0f);
    pd_quant_rows(xf, 1, x.H, x.xq, x.xs);
    pd_quant_rows(xf + x.H, x.K, x.I, x.x2q, x.x2s);
    free(xf);
    for (int d = 0; d < x.n_draws; d++) {
        int32_t *ex = x.draw + (size_t)d * x.K;
        for (int k = 0; k < x.K;) {   /* K distinct experts, in ascending order (insertion) */
            int v = (int)(next_rand() % (uint64_t)x.E), dup = 0, j = k;
            for (int i = 0; i < k; i++)
                dup |= ex[i] == v;
            if (dup)
                continue;
            while (j > 0 && ex[j - 1] > v) {
                ex[j] = ex[j - 1];
                j--;
            }
            ex[j] = v;
            k++;
        }
    }
    for (int l = 0; l < x.L; l++)
        for (int ei = 0; ei < x.E; ei++)
            for (int j = 0; j < 3; j++) {
                int out = j == 1 ? x.H : x.I, in = j == 1 ? x.I : x.H;
                if (report(pd_onednn_mm_create(1, out, in, xp_w(&x, l, ei, j), xp_s(&x, l, ei, j), PD_ONEDNN_F32,
                                               &x.dnn[((size_t)l * x.E + ei) * 3 + j], &e), &e) < 0)
                    goto done;
            }
    /* per call: K experts' three matrices and their scales; 2 ops per weight */
    const double bytes = (double)x.K * (3.0 * x.H * x.I + (2.0 * x.I + x.H) * sizeof(float));
    const double ops = 2.0 * x.K * 3 * x.H * x.I;
    say(c, "\n6. Decode's routed experts, batch 1: %d of %d experts per layer at random, each gate and up %d x %d and "
        "down %d x %d int8 (%.0f KiB), over %d layers (%.0f MiB); oneDNN: one matmul per matrix\n", x.K, x.E, x.I,
        x.H, x.H, x.I, 3.0 * x.H * x.I / 1024, x.L, (double)mats * x.H * x.I / (1 << 20));
    for (int i = 0; i < c->nt; i++) {
        double s, sd;
        x.pool = pool_for(c, i);
        pd_onednn_threads(c->tcount[i]);
        if (time_median(xp_pdmoe, &x, x.L, x.reps, &s) < 0 || time_median(xp_onednn, &x, x.L, x.reps, &sd) < 0)
            goto done;
        /* --quick's one layer (12 MiB) can sit in the caches: its bytes per second are no fraction
         * of the DRAM read bandwidth (it printed 1.25 and 1.65 "of the read bandwidth") */
        const int cached = c->o.quick;
        if (cached)
            say(c, "   %d thread%s: %8.1f us  %6.2f GB/s (cache-resident with --quick: no bandwidth fraction) | "
                "oneDNN %8.1f us: pdmoe %.2fx\n", c->tcount[i], plural(c->tcount[i]), s * 1e6, bytes / s / 1e9,
                sd * 1e6, sd / s);
        else
            say(c, "   %d thread%s: %8.1f us  %6.2f GB/s  = %.2f of the read bandwidth | oneDNN %8.1f us (%.2f): "
                "pdmoe %.2fx\n", c->tcount[i], plural(c->tcount[i]), s * 1e6, bytes / s / 1e9, bytes / s / c->bw[i],
                sd * 1e6, bytes / sd / c->bw[i], sd / s);
        json_t *shape = json_pack("{s:i, s:i, s:i, s:i, s:i, s:i}", "hidden", x.H, "inter", x.I, "experts", x.E,
                                  "per_token", x.K, "layers", x.L, "tokens", 1);
        add_case(c, "experts", shape, i, ops / s, ops / sd);
        json_t *last = json_array_get(c->cases, json_array_size(c->cases) - 1);
        json_object_set_new(last, "pdmoe_of_bandwidth", cached ? json_null() : json_real(bytes / s / c->bw[i]));
        json_object_set_new(last, "cache_resident", json_boolean(cached));
    }
    rc = 0;
done:
    for (size_t m = 0; x.dnn && m < mats; m++)
        pd_onednn_mm_free(x.dnn[m]);
    free(x.dnn);
    free(x.krow);
    free(x.grp);
    free(x.draw);
    free(x.y);
    free(x.x2s);
    free(x.xs);
    free(x.x2q);
    free(x.xq);
    free(x.ws);
    free(x.w);
    return rc;
}

/* ---- float products ---------------------------------------------------------------------- */

/* A decode batch's float projection (the engine keeps bf16 matrices bf16 and multiplies in fp32,
 * engine/linear.c): T tokens by n_mats matrices of out x in used in turn, a set larger than the
 * caches, through pd_linear_fwd as the engine calls it; the same values as fp32 through it too, and
 * through oneDNN's fp32 matmul (which takes no bf16 weights with fp32 activations). */
struct fp_case {
    int out, in, T, n_mats, reps, bf16;
    uint16_t *h;            // [n_mats, out, in]
    float *f;               // [n_mats, out, in] the same values widened
    float *x, *y;           // [T, in], [T, out]
    pd_pool *pool;
    pd_onednn_mm **dnn;     // [n_mats]
};

static int fp_pdmoe(void *arg, int rep, pd_err *e)
{
    struct fp_case *g = arg;
    const size_t at = (size_t)(rep % g->n_mats) * g->out * g->in;
    struct pd_linear l = {.out = g->out, .in = g->in};
    if (g->bf16)
        l.h = g->h + at;
    else
        l.f = g->f + at;
    return pd_linear_fwd(&l, g->pool, 0, g->x, g->T, g->y, NULL, NULL, e) ? -1 : 0;
}

static int fp_onednn(void *arg, int rep, pd_err *e)
{
    struct fp_case *g = arg;
    return pd_onednn_mm_run(g->dnn[rep % g->n_mats], g->x, g->y, e);
}

static int bench_float(struct ctx *c)
{
    struct fp_case g = {.out = 4096, .in = 4096, .T = 16, .reps = c->o.quick ? 3 : 60};
    const size_t per = (size_t)g.out * g.in;
    /* >= 256 MiB of bf16 (8x L3): every call reads its weights from DRAM */
    g.n_mats = c->o.quick ? 2 : (int)((((size_t)256 << 20) + 2 * per - 1) / (2 * per));
    int rc = -1;
    pd_err e = {0};
    g.h = xmalloc(per * g.n_mats * 2);
    g.f = xmalloc(per * g.n_mats * 4);
    g.x = xmalloc((size_t)g.T * g.in * 4);
    g.y = xmalloc((size_t)g.T * g.out * 4);
    g.dnn = calloc((size_t)g.n_mats, sizeof *g.dnn);
    if (!g.h || !g.f || !g.x || !g.y || !g.dnn)
        goto done;
    for (size_t i = 0; i < per * g.n_mats; i++) {
        g.h[i] = pd_f32_to_bf16(((float)(next_rand() >> 40) / (float)(1 << 24) - 0.5f) * 0.1f);
        g.f[i] = pd_bf16_to_f32(g.h[i]);
    }
    fill_floats(g.x, (size_t)g.T * g.in, -1.0f, 1.0f);
    for (int m = 0; m < g.n_mats; m++)
        if (report(pd_onednn_mm_create_f32(g.T, g.out, g.in, g.f + (size_t)m * per, &g.dnn[m], &e), &e) < 0)
            goto done;
    const double ops = 2.0 * per * g.T;
    say(c, "\n5. Float product (a decode batch's projection), out %d x in %d bf16 (%.1f MB), %d tokens, rotating over "
        "%d matrices (%.0f MiB); pdmoe through pd_linear_fwd, oneDNN's fp32 matmul on the same values in fp32\n",
        g.out, g.in, 2.0 * per / 1e6, g.T, g.n_mats, 2.0 * per * g.n_mats / (1 << 20));
    for (int i = 0; i < c->nt; i++) {
        double s, sf, sd;
        g.pool = pool_for(c, i);
        pd_onednn_threads(c->tcount[i]);
        g.bf16 = 1;
        if (time_median(fp_pdmoe, &g, g.n_mats, g.reps, &s) < 0)
            goto done;
        g.bf16 = 0;
        if (time_median(fp_pdmoe, &g, g.n_mats, g.reps, &sf) < 0 ||
            time_median(fp_onednn, &g, g.n_mats, g.reps, &sd) < 0)
            goto done;
        say(c, "   %d thread%s: bf16 %8.1f us  %6.1f GFLOPS", c->tcount[i], plural(c->tcount[i]), s * 1e6,
            ops / s / 1e9);
        if (c->fp32[i] > 0)
            say(c, " = %.2f of the fp32 peak", ops / s / c->fp32[i]);
        say(c, " | fp32 weights %6.1f GFLOPS | oneDNN fp32 %6.1f GFLOPS: pdmoe bf16 %.2fx, fp32 %.2fx\n",
            ops / sf / 1e9, ops / sd / 1e9, sd / s, sd / sf);
        json_t *o = json_pack("{s:s, s:{s:i, s:i, s:i, s:s}, s:i, s:f, s:f, s:f, s:f}", "kind", "float", "shape",
                              "out", g.out, "in", g.in, "tokens", g.T, "weights", "bf16", "threads", c->tcount[i],
                              "pdmoe_gflops", ops / s / 1e9, "onednn_gflops", ops / sd / 1e9, "pdmoe_over_onednn",
                              sd / s, "pdmoe_fp32_weights_gflops", ops / sf / 1e9);
        if (c->fp32[i] > 0)
            json_object_set_new(o, "pdmoe_of_fp32_peak", json_real(ops / s / c->fp32[i]));
        json_array_append_new(c->cases, o);
    }
    rc = 0;
done:
    for (int m = 0; g.dnn && m < g.n_mats; m++)
        pd_onednn_mm_free(g.dnn[m]);
    free(g.dnn);
    free(g.h);
    free(g.f);
    free(g.x);
    free(g.y);
    return rc;
}

/* Issue 17's targets (bench/report.h) on each GEMM and MoE case, once the ceilings are final: on
 * the AMX kernel a GEMM against oneDNN (17.2) and the MoE case against the dense GEMM of its matrix
 * shape at the same threads (17.2), elsewhere each against the int8 peak of the kernel's
 * instructions (17.3). Every MoE case also gets "pdmoe_of_dense_gemm". The portable kernel has no
 * peak and no target. */
static void judge_cases(struct ctx *c)
{
    const int amx = c->k == PD_KERNEL_AMX;
    const char *of_peak = c->k == PD_KERNEL_AVX2 ? "pdmoe_of_avx2_int8_peak" : "pdmoe_of_vnni_peak";
    int said = 0;
    for (size_t n = 0; n < json_array_size(c->cases); n++) {
        json_t *o = json_array_get(c->cases, n);
        const char *kind = json_string_value(json_object_get(o, "kind"));
        const int moe = !strcmp(kind, "moe");
        if (!moe && strcmp(kind, "gemm") != 0)
            continue;
        json_t *shape = json_object_get(o, "shape");
        const json_int_t t = json_integer_value(json_object_get(o, "threads"));
        if (json_integer_value(json_object_get(shape, "tokens")) != gemm_tokens(c))
            continue;   /* the targets are at the prefill GEMM's tokens */
        if (moe)
            for (size_t d = 0; d < json_array_size(c->cases); d++) {
                json_t *g = json_array_get(c->cases, d), *gs = json_object_get(g, "shape");
                if (strcmp(json_string_value(json_object_get(g, "kind")), "gemm") != 0 ||
                    json_integer_value(json_object_get(g, "threads")) != t ||
                    !json_equal(json_object_get(gs, "tokens"), json_object_get(shape, "tokens")) ||
                    !json_equal(json_object_get(gs, "out"), json_object_get(shape, "out")) ||
                    !json_equal(json_object_get(gs, "in"), json_object_get(shape, "in")))
                    continue;
                const double dense = json_number_value(json_object_get(g, "pdmoe_gflops"));
                json_object_set_new(o, "pdmoe_of_dense_gemm",
                                    json_real(json_number_value(json_object_get(o, "pdmoe_gflops")) / dense));
                /* the most the memory allows: every used expert read once at the read bandwidth
                 * (the rate over its fraction of the bandwidth, which recheck_ceilings keeps against
                 * the final ceiling), as a fraction of the dense GEMM's rate */
                const double of_bw = json_number_value(json_object_get(o, "pdmoe_of_bandwidth"));
                if (of_bw > 0)
                    json_object_set_new(o, "bandwidth_bound_of_dense_gemm",
                                        json_real(json_number_value(json_object_get(o, "pdmoe_gflops")) / of_bw / dense));
                break;
            }
        enum pd_bench_target tg = amx ? (moe ? PD_TARGET_AMX_MOE_OF_DENSE : PD_TARGET_AMX_OVER_ONEDNN)
                                      : PD_TARGET_INT8_OF_PEAK;
        const char *metric = amx ? (moe ? "pdmoe_of_dense_gemm" : "pdmoe_over_onednn") : of_peak;
        json_t *v = json_object_get(o, metric);
        if (!json_is_number(v) || c->k == PD_KERNEL_REF || c->k == PD_KERNEL_AMX_EMU)
            continue;
        json_object_set_new(o, "target", pd_bench_target_json(tg, metric, json_number_value(v)));
        char *sh = json_dumps(shape, JSON_COMPACT | JSON_PRESERVE_ORDER);
        say(c, "%s  %s %s, %d thread%s: %s %.2f (target %s: %s)", said++ ? "" : "\nIssue 17's targets:\n", kind,
            sh ? sh : "", (int)t, plural((int)t), metric, json_number_value(v), pd_bench_target_text(tg),
            pd_bench_target_word(tg, json_number_value(v)));
        json_t *bound = json_object_get(o, "bandwidth_bound_of_dense_gemm");
        if (moe && json_is_number(bound))   /* how far the memory lets the ratio go on this machine */
            say(c, "; the read bandwidth allows at most %.2f", json_number_value(bound));
        say(c, "\n");
        free(sh);
    }
}

int pd_bench_kernels(int argc, char **argv)
{
    struct ctx c = {0};
    if (parse_opts(argc, argv, &c.o) < 0)
        return 2;
    pd_err e = {0};
    if (report(pd_gemm_kernel_get(&c.k, &e), &e) < 0)
        return 1;
    pd_bench_set_cpu_time(c.o.cpu_time);
    int N = c.o.threads;
    if (N > 1 && report(pd_pool_create(N, &c.pool, &e), &e) < 0)
        return 1;
    c.tcount[0] = 1;
    c.tcount[1] = N;
    c.nt = N > 1 ? 2 : 1;
    c.ceilings = json_array();
    c.cases = json_array();

    say(&c, "pdmoe bench kernels: kernel %s, threads 1%s%.0d, oneDNN %s as the anchor%s\n",
        pd_gemm_kernel_name(c.k), N > 1 ? " and " : "", N > 1 ? N : 0, pd_onednn_version(),
        c.o.quick ? ", --quick (small sizes: ratios are indicative only)" : "");
    if (c.o.cpu_time)
        say(&c, "Times are the calling thread's CPU time (--cpu-time): other jobs' time slices left out.\n");
    say(&c, "Kernel times are medians over repeated calls on int8 activations quantised beforehand\n"
        "(int8 in, fp32 out with per-channel scales), pdmoe's and oneDNN's alike, one after the other.\n");
    /* (tests/bench/test_onednn.c shows oneDNN's sums off on a CPU without VNNI or AMX) */
    const int onednn_exact = pd_onednn_int8_exact();
    if (!onednn_exact)
        say(&c, "No VNNI here: oneDNN multiplies int8 with vpmaddubsw, whose sums of two products saturate at\n"
            "16 bits, so its int8 results are not exact where pdmoe's are (a cheaper, different product).\n");
    say(&c, "\n");
    double t0 = pd_now_s();
    int rc = bench_ceilings(&c) < 0 || bench_gemv(&c) < 0 || bench_gemm(&c) < 0 ||
             bench_moe(&c) < 0 || bench_float(&c) < 0 || bench_experts(&c) < 0 || recheck_ceilings(&c) < 0;
    if (!rc)
        judge_cases(&c);
    if (!rc && c.o.json) {
        json_t *doc = json_pack("{s:s, s:s, s:s, s:b, s:b, s:b, s:O, s:O}", "bench", "kernels", "kernel",
                                pd_gemm_kernel_name(c.k), "onednn", pd_onednn_version(), "onednn_int8_exact",
                                onednn_exact, "quick", c.o.quick, "cpu_time", c.o.cpu_time, "ceilings", c.ceilings,
                                "cases", c.cases);
        pd_bench_provenance(doc, argc, argv);
        char *txt = json_dumps(doc, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
        printf("%s\n", txt);
        free(txt);
        json_decref(doc);
    }
    say(&c, "\n(%.1f s)\n", pd_now_s() - t0);
    json_decref(c.ceilings);
    json_decref(c.cases);
    pd_pool_destroy(c.pool);
    return rc;
}

int pd_bench_machine_measure(int threads, int quick, struct pd_bench_machine *m)
{
    memset(m, 0, sizeof *m);
    pd_pool *pool = NULL;
    pd_err e = {0};
    if (threads > 1 && report(pd_pool_create(threads, &pool, &e), &e) < 0)
        return -1;
    int rc = -1;
    m->bw_mib = quick ? 128 : 512;
    m->bw_runs = quick ? 2 : 5;
    m->bw = pd_bench_read_bandwidth(pool, threads, (size_t)m->bw_mib << 20, m->bw_runs);
    m->clock_hz = pd_bench_nominal_clock_hz();
    const int vnni = pd_gemm_kernel_supported(PD_KERNEL_AVX512);
    m->vnni_peak = vnni ? pd_bench_vnni_peak(pool, threads, quick) : 0;
    m->fp32_peak = pd_bench_fp32_peak(pool, threads, quick);
    m->fp32_probe = pd_bench_fp32_probe();
    m->amx_peak = pd_bench_amx_peak(pool, threads, quick);
    /* the GEMM's efficiency is against the peak of the instructions it runs: on an AMX host the
     * tile kernel passes the VNNI peak (1.8x here), and calibrate refused its own measurement; the
     * AVX2 kernel's is its vpmaddwd's (an AVX2-only host had a "VPDPBUSD" peak made of its clock) */
    pd_kernel k = PD_KERNEL_REF;
    int got = pd_gemm_kernel_get(&k, &e) == 0;
    int amx = got && k == PD_KERNEL_AMX && m->amx_peak > 0, avx2 = got && k == PD_KERNEL_AVX2;
    if (amx) {
        m->int8_peak = m->amx_peak;
        m->int8_probe = "independent TDPBSSD tile chains (the AMX kernel)";
    } else if (avx2) {
        m->int8_peak = pd_bench_avx2_int8_peak(pool, threads, quick);
        m->int8_probe = "independent VPMADDWD + VPADDD ymm chains (the AVX2 kernel)";
    } else if (vnni) {
        m->int8_peak = m->vnni_peak;
        m->int8_probe = "independent VPDPBUSD chains";
    } else {
        /* the portable kernel: no instruction probe; one 128-op instruction a cycle per thread */
        m->int8_peak = PD_BENCH_OPS_PER_VPDPBUSD * m->clock_hz * threads;
        m->int8_probe = "no probe for the portable kernel: 128 int8 ops per cycle per thread at the nominal clock";
    }
    struct mm_case g = {.out = 4096, .in = 14336, .T = 1, .reps = quick ? 8 : 60, .n_mats = quick ? 2 : 5,
                        .pool = pool};
    m->gemm_tokens = quick ? 64 : 256;
    struct mm_case h = {.out = 2048, .in = 4096, .T = m->gemm_tokens, .reps = quick ? 3 : 10,
                        .n_mats = 1, .pool = pool};
    size_t per = (size_t)g.out * g.in;
    double s;
    if (mm_case_alloc(&g) || mm_case_alloc(&h))
        goto done;
    if (time_median(mm_pdmoe, &g, g.n_mats, g.reps, &s) < 0)
        goto done;
    m->gemv_bw = ((double)per + (double)g.out * sizeof(float)) / s;
    if (time_median(mm_pdmoe, &h, 1, h.reps, &s) < 0)
        goto done;
    m->gemm_ops = 2.0 * h.out * h.in * h.T / s;
    /* no kernel outruns its instructions' peak: a GEMM above it means the probe's runs were all
     * preempted (a busy host), and calibrate would refuse its own efficiency > 1. Probe again,
     * longer, keeping the best */
    const int probed = amx || avx2 || vnni;
    for (int tries = 0; tries < 3 && probed && m->gemm_ops > m->int8_peak; tries++) {
        double again = amx    ? pd_bench_amx_peak(pool, threads, 0)
                       : avx2 ? pd_bench_avx2_int8_peak(pool, threads, 0)
                              : pd_bench_vnni_peak(pool, threads, 0);
        if (again > m->int8_peak)
            m->int8_peak = again;
        if (amx && again > m->amx_peak)
            m->amx_peak = again;
        if (!amx && !avx2 && again > m->vnni_peak)
            m->vnni_peak = again;
    }
    rc = 0;
done:
    mm_case_free(&g);
    mm_case_free(&h);
    pd_pool_destroy(pool);
    return rc;
}

/* `pdmoe bench kernels`: int8 kernel throughput, each figure set against a ceiling measured in the
 * same run on this machine:
 *   1. memory read bandwidth (int64 sum over a buffer far larger than L3) and core clock, and the
 *      VNNI peak (a long run of independent vpdpbusd);
 *   2. decode GEMV 4096x14336, DRAM-bound (rotating over >= 256 MiB of weights): GB/s vs bandwidth;
 *   3. prefill GEMM 2048x4096 x 512 tokens: int8 ops/s vs the VNNI peak;
 *   4. MoE grouped GEMM, 64 experts, 8 used per token, 2048x4096 each, 512 tokens;
 * plus llama.cpp q8_0 figures measured on this machine kind, and our ratio to them.
 * argv follows main(): argv[0] is the command name; options --threads N, --quick. */
#include "bench/bench.h"

#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/threadpool.h"
#include "core/timing.h"
#include "kernels/gemm.h"
#include "kernels/quant.h"

/* llama.cpp q8_0 (test-backend-ops perf) on this machine kind: the baseline to beat. */
#define LLAMA_GEMV_US_1T 3168.0
#define LLAMA_GEMV_US_2T 2255.0
#define LLAMA_GEMM_GOPS_1T 118.0
#define LLAMA_GEMM_GOPS_2T 171.0
#define LLAMA_MOE_GOPS_1T 52.0

/* int8 ops (multiply + add) in one 512-bit vpdpbusd: 16 lanes x 4 byte products. */
#define OPS_PER_VPDPBUSD 128.0

struct opts {
    int threads;
    int quick;
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
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64) != 0) {
        fprintf(stderr, "bench kernels: out of memory (%zu bytes)\n", n);
        return NULL;
    }
    return p;
}

/* ---- clock and VNNI peak ---------------------------------------------------------------- */

/* 10 dependent adds per iteration: 10 cycles per iteration on any core that adds in 1 cycle. */
static void add_chain(uint64_t iters)
{
    uint64_t x = 0;
    __asm__ volatile("1:\n\t"
                     "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                     "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                     "dec %1\n\t"
                     "jnz 1b\n\t"
                     : "+r"(x), "+r"(iters));
}

/* 16 independent vpdpbusd per iteration, more than latency x throughput on any current core. */
__attribute__((target("avx512f,avx512vnni"))) static void vnni_chain(uint64_t iters)
{
    __asm__ volatile(
        "vpternlogd $0xff, %%zmm16, %%zmm16, %%zmm16\n\t"
        "vpternlogd $0xff, %%zmm17, %%zmm17, %%zmm17\n\t"
        "1:\n\t"
        "vpdpbusd %%zmm16, %%zmm17, %%zmm0\n\t"  "vpdpbusd %%zmm16, %%zmm17, %%zmm1\n\t"
        "vpdpbusd %%zmm16, %%zmm17, %%zmm2\n\t"  "vpdpbusd %%zmm16, %%zmm17, %%zmm3\n\t"
        "vpdpbusd %%zmm16, %%zmm17, %%zmm4\n\t"  "vpdpbusd %%zmm16, %%zmm17, %%zmm5\n\t"
        "vpdpbusd %%zmm16, %%zmm17, %%zmm6\n\t"  "vpdpbusd %%zmm16, %%zmm17, %%zmm7\n\t"
        "vpdpbusd %%zmm16, %%zmm17, %%zmm8\n\t"  "vpdpbusd %%zmm16, %%zmm17, %%zmm9\n\t"
        "vpdpbusd %%zmm16, %%zmm17, %%zmm10\n\t" "vpdpbusd %%zmm16, %%zmm17, %%zmm11\n\t"
        "vpdpbusd %%zmm16, %%zmm17, %%zmm12\n\t" "vpdpbusd %%zmm16, %%zmm17, %%zmm13\n\t"
        "vpdpbusd %%zmm16, %%zmm17, %%zmm14\n\t" "vpdpbusd %%zmm16, %%zmm17, %%zmm15\n\t"
        "dec %0\n\t"
        "jnz 1b\n\t"
        "vzeroupper\n\t"
        : "+r"(iters)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
          "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "cc");
}

static double measure_clock_hz(int quick)
{
    uint64_t iters = quick ? 10000000 : 40000000;
    double best = 1e30;
    add_chain(iters / 4);   /* let the core reach its running clock */
    for (int rep = 0; rep < 3; rep++) {
        double t0 = pd_now_s();
        add_chain(iters);
        double dt = pd_now_s() - t0;
        best = dt < best ? dt : best;
    }
    return 10.0 * (double)iters / best;
}

struct vnni_run {
    uint64_t iters;   /* per task */
};

static void vnni_task(void *arg, int task)
{
    vnni_chain(((struct vnni_run *)arg)->iters);
}

/* int8 ops/s from `threads` threads each issuing only vpdpbusd. Tasks are split 8 per thread
 * so that both threads of a pool get work even if one of them wakes late. */
static double measure_vnni_peak(pd_pool *pool, int threads, int quick)
{
    struct vnni_run r = {.iters = quick ? 200000 : 1000000};
    int n_tasks = 8 * threads;
    double best = 1e30;
    vnni_task(&r, 0);
    for (int rep = 0; rep < 5; rep++) {
        double t0 = pd_now_s();
        pd_pool_run(threads > 1 ? pool : NULL, n_tasks, vnni_task, &r);
        double dt = pd_now_s() - t0;
        best = dt < best ? dt : best;
    }
    return (double)n_tasks * (double)r.iters * 16.0 * OPS_PER_VPDPBUSD / best;
}

/* ---- memory bandwidth ------------------------------------------------------------------- */

/* Unsigned sums: the values wrap, and only the loads matter. */
__attribute__((target("avx512f"))) static uint64_t sum_avx512(const int64_t *p, size_t n)
{
    __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm512_add_epi64(s0, _mm512_load_si512(p + i));
        s1 = _mm512_add_epi64(s1, _mm512_load_si512(p + i + 8));
        s2 = _mm512_add_epi64(s2, _mm512_load_si512(p + i + 16));
        s3 = _mm512_add_epi64(s3, _mm512_load_si512(p + i + 24));
    }
    uint64_t lanes[8], s = 0;
    _mm512_storeu_si512(lanes, _mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3)));
    for (int j = 0; j < 8; j++)
        s += lanes[j];
    for (; i < n; i++)
        s += (uint64_t)p[i];
    return s;
}

__attribute__((target("avx2"))) static uint64_t sum_avx2(const int64_t *p, size_t n)
{
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_add_epi64(s0, _mm256_load_si256((const __m256i *)(p + i)));
        s1 = _mm256_add_epi64(s1, _mm256_load_si256((const __m256i *)(p + i + 4)));
        s2 = _mm256_add_epi64(s2, _mm256_load_si256((const __m256i *)(p + i + 8)));
        s3 = _mm256_add_epi64(s3, _mm256_load_si256((const __m256i *)(p + i + 12)));
    }
    uint64_t lanes[4], s = 0;
    _mm256_storeu_si256((__m256i *)lanes,
                        _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3)));
    for (int j = 0; j < 4; j++)
        s += lanes[j];
    for (; i < n; i++)
        s += (uint64_t)p[i];
    return s;
}

static uint64_t sum_scalar(const int64_t *p, size_t n)
{
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += (uint64_t)p[i];
        s1 += (uint64_t)p[i + 1];
        s2 += (uint64_t)p[i + 2];
        s3 += (uint64_t)p[i + 3];
    }
    for (; i < n; i++)
        s0 += (uint64_t)p[i];
    return s0 + s1 + s2 + s3;
}

enum bw_isa { BW_SCALAR, BW_AVX2, BW_AVX512 };

static enum bw_isa bw_isa(void)
{
    return __builtin_cpu_supports("avx512f") ? BW_AVX512
           : __builtin_cpu_supports("avx2")  ? BW_AVX2
                                             : BW_SCALAR;
}

struct bw_run {
    const int64_t *buf;   // [n]
    size_t n, chunk;      /* int64s per task */
    enum bw_isa isa;
    uint64_t sums[64];    // [tasks] kept so the loads cannot be dropped
};

static void bw_task(void *arg, int task)
{
    struct bw_run *r = arg;
    size_t i0 = (size_t)task * r->chunk;
    size_t n = i0 + r->chunk <= r->n ? r->chunk : r->n - i0;
    r->sums[task] = r->isa == BW_AVX512 ? sum_avx512(r->buf + i0, n)
                    : r->isa == BW_AVX2 ? sum_avx2(r->buf + i0, n)
                                        : sum_scalar(r->buf + i0, n);
}

/* Bytes/s reading `bytes` with `threads` threads, best of `reps`. */
static double measure_bandwidth(pd_pool *pool, int threads, const int64_t *buf, size_t bytes,
                                int reps)
{
    struct bw_run r = {.buf = buf, .n = bytes / 8, .isa = bw_isa()};
    r.chunk = (r.n + 63) / 64;
    double best = 1e30;
    for (int rep = 0; rep < reps; rep++) {
        double t0 = pd_now_s();
        pd_pool_run(threads > 1 ? pool : NULL, 64, bw_task, &r);
        double dt = pd_now_s() - t0;
        best = dt < best ? dt : best;
    }
    uint64_t check = 0;
    for (int i = 0; i < 64; i++)
        check += r.sums[i];
    if (check == 42)
        printf("(checksum %llu)\n", (unsigned long long)check);
    return (double)bytes / best;
}

/* ---- the kernels ------------------------------------------------------------------------ */

static int report(int rc, const pd_err *e)
{
    if (rc < 0)
        fprintf(stderr, "bench kernels: %s\n", e->msg);
    return rc;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double pd_bench_median(double *t, int n)
{
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

#define MAX_REPS 400

struct gemv_case {
    int out, in, n_mats, reps;
    int8_t *w;        // [n_mats, out, in]
    float *ws;        // [n_mats, out]
    float *x;         // [in]
    int8_t *xq;       // [in]
    float xs;
    float *y;         // [out]
};

/* Median seconds per GEMV (activation quantisation included), rotating over the matrices. */
static int time_gemv(struct gemv_case *g, pd_pool *pool, double *sec)
{
    pd_err e = {0};
    size_t per = (size_t)g->out * g->in;
    double t[MAX_REPS];
    for (int i = -g->n_mats; i < g->reps; i++) {   /* one warm-up pass over every matrix */
        int m = (i + g->n_mats) % g->n_mats;
        double t0 = pd_now_s();
        pd_quant_rows(g->x, 1, g->in, g->xq, &g->xs);
        pd_qmat W = {g->w + m * per, g->ws + (size_t)m * g->out, g->out, g->in};
        pd_qmat X = {g->xq, &g->xs, 1, g->in};
        int rc = pd_gemm(pool, &W, &X, g->y, 0, &e);
        if (rc < 0)
            return report(rc, &e);
        if (i >= 0)
            t[i] = pd_now_s() - t0;
    }
    *sec = pd_bench_median(t, g->reps);
    return 0;
}

struct gemm_case {
    int out, in, T, reps;
    int8_t *w;     // [out, in]
    float *ws;     // [out]
    float *x;      // [T, in]
    int8_t *xq;    // [T, in]
    float *xs;     // [T]
    float *y;      // [T, out]
};

/* Median seconds per GEMM (activation quantisation included), after one warm-up. */
static int time_gemm(struct gemm_case *g, pd_pool *pool, double *sec)
{
    pd_err e = {0};
    double t[MAX_REPS];
    for (int i = -1; i < g->reps; i++) {
        double t0 = pd_now_s();
        pd_quant_rows(g->x, g->T, g->in, g->xq, g->xs);
        pd_qmat W = {g->w, g->ws, g->out, g->in}, X = {g->xq, g->xs, g->T, g->in};
        int rc = pd_gemm(pool, &W, &X, g->y, 0, &e);
        if (rc < 0)
            return report(rc, &e);
        if (i >= 0)
            t[i] = pd_now_s() - t0;
    }
    *sec = pd_bench_median(t, g->reps);
    return 0;
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
};

/* Median seconds per grouped GEMM (activation quantisation included), after one warm-up. */
static int time_moe(struct moe_case *m, pd_pool *pool, double *sec)
{
    pd_err e = {0};
    double t[MAX_REPS];
    for (int i = -1; i < m->reps; i++) {
        double t0 = pd_now_s();
        pd_quant_rows(m->x, m->T, m->in, m->xq, m->xs);
        pd_qmat X = {m->xq, m->xs, m->T, m->in};
        int rc = pd_gemm_grouped(pool, &X, m->g, m->E, 0, &e);
        if (rc < 0)
            return report(rc, &e);
        if (i >= 0)
            t[i] = pd_now_s() - t0;
    }
    *sec = pd_bench_median(t, m->reps);
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
        off += n[e];
    }
    free(n);
}

static int parse_opts(int argc, char **argv, struct opts *o)
{
    o->threads = 2;
    o->quick = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) {
            o->quick = 1;
        } else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 1 || v > PD_POOL_MAX_THREADS) {
                fprintf(stderr, "bench kernels: --threads wants 1..%d, got '%s'\n",
                        PD_POOL_MAX_THREADS, argv[i]);
                return -1;
            }
            o->threads = (int)v;
        } else {
            fprintf(stderr, "pdmoe bench kernels: %s %s (see pdmoe bench kernels --help)\n",
                    strcmp(argv[i], "--threads") ? "unknown option" : "needs a value:", argv[i]);
            return -1;
        }
    }
    return 0;
}

/* What every section needs: the pool, the thread counts measured (1 and N) and the ceilings. */
struct ctx {
    struct opts o;
    pd_pool *pool;    /* N threads; NULL when N = 1 */
    pd_kernel k;
    int tcount[2], nt;
    double bw[2];     /* bytes/s per thread count */
    double peak[2];   /* int8 ops/s per thread count */
};

static pd_pool *pool_for(const struct ctx *c, int i)
{
    return c->tcount[i] > 1 ? c->pool : NULL;
}

static const char *plural(int n)
{
    return n > 1 ? "s" : " ";
}

static int bench_ceilings(struct ctx *c)
{
    size_t bytes = (size_t)(c->o.quick ? 128 : 512) << 20;
    int reps = c->o.quick ? 2 : 7;
    int64_t *buf = xmalloc(bytes);
    if (!buf)
        return -1;
    memset(buf, 1, bytes);
    printf("1. Machine ceilings\n");
    for (int i = 0; i < c->nt; i++) {
        c->bw[i] = measure_bandwidth(pool_for(c, i), c->tcount[i], buf, bytes, reps);
        printf("   memory read bandwidth, %d thread%s: %7.2f GB/s (int64 sum over %zu MiB, %s "
               "loads, best of %d)\n", c->tcount[i], plural(c->tcount[i]), c->bw[i] / 1e9,
               bytes >> 20, (const char *[]){"scalar", "AVX2", "AVX-512"}[bw_isa()], reps);
    }
    free(buf);

    double hz = measure_clock_hz(c->o.quick);
    printf("   core clock (dependent add chain): %.2f GHz\n", hz / 1e9);
    printf("   assumed VNNI peak: one 512-bit VPDPBUSD per cycle per core = 16 lanes x 4 int8 "
           "MACs x 2 ops = %.0f ops/cycle/core = %.0f Gops/s per core at this clock\n",
           OPS_PER_VPDPBUSD, OPS_PER_VPDPBUSD * hz / 1e9);
    if (!pd_gemm_kernel_supported(PD_KERNEL_AVX512)) {
        for (int i = 0; i < c->nt; i++)
            c->peak[i] = OPS_PER_VPDPBUSD * hz * c->tcount[i];
        printf("   no AVX-512 VNNI here: the ratios below use the assumed peak\n");
        return 0;
    }
    for (int i = 0; i < c->nt; i++) {
        c->peak[i] = measure_vnni_peak(pool_for(c, i), c->tcount[i], c->o.quick);
        printf("   measured VNNI peak, %d thread%s: %7.1f Gops/s = %.0f ops/cycle/core "
               "(%.2f VPDPBUSD zmm per cycle per core)\n", c->tcount[i], plural(c->tcount[i]),
               c->peak[i] / 1e9, c->peak[i] / hz / c->tcount[i],
               c->peak[i] / hz / c->tcount[i] / OPS_PER_VPDPBUSD);
    }
    printf("   the ratios below use the measured peak\n");
    return 0;
}

/* The buffers of a GEMV case (n_mats matrices of out x in, filled) and of a GEMM case; 0 or -1. */
static int gemv_case_alloc(struct gemv_case *g)
{
    size_t per = (size_t)g->out * g->in;
    g->w = xmalloc(per * g->n_mats);
    g->ws = xmalloc((size_t)g->out * g->n_mats * sizeof(float));
    g->x = xmalloc((size_t)g->in * sizeof(float));
    g->xq = xmalloc((size_t)g->in);
    g->y = xmalloc((size_t)g->out * sizeof(float));
    if (!g->w || !g->ws || !g->x || !g->xq || !g->y)
        return -1;
    fill_weights(g->w, per * g->n_mats);
    fill_floats(g->ws, (size_t)g->out * g->n_mats, 1e-3f, 2e-3f);
    fill_floats(g->x, (size_t)g->in, -1.0f, 1.0f);
    return 0;
}

static void gemv_case_free(struct gemv_case *g)
{
    free(g->w);
    free(g->ws);
    free(g->x);
    free(g->xq);
    free(g->y);
}

static int gemm_case_alloc(struct gemm_case *g)
{
    g->w = xmalloc((size_t)g->out * g->in);
    g->ws = xmalloc((size_t)g->out * sizeof(float));
    g->x = xmalloc((size_t)g->T * g->in * sizeof(float));
    g->xq = xmalloc((size_t)g->T * g->in);
    g->xs = xmalloc((size_t)g->T * sizeof(float));
    g->y = xmalloc((size_t)g->T * g->out * sizeof(float));
    if (!g->w || !g->ws || !g->x || !g->xq || !g->xs || !g->y)
        return -1;
    fill_weights(g->w, (size_t)g->out * g->in);
    fill_floats(g->ws, (size_t)g->out, 1e-3f, 2e-3f);
    fill_floats(g->x, (size_t)g->T * g->in, -1.0f, 1.0f);
    return 0;
}

static void gemm_case_free(struct gemm_case *g)
{
    free(g->w);
    free(g->ws);
    free(g->x);
    free(g->xq);
    free(g->xs);
    free(g->y);
}

static int bench_gemv(struct ctx *c)
{
    struct gemv_case g = {.out = 4096, .in = 14336, .reps = c->o.quick ? 8 : 300};
    size_t per = (size_t)g.out * g.in;
    /* Enough matrices that the set is >= 256 MiB (8x L3), so every call reads from DRAM. */
    g.n_mats = c->o.quick ? 2 : (int)((((size_t)256 << 20) + per - 1) / per);
    int rc = -1;
    if (gemv_case_alloc(&g))
        goto done;
    double bytes = (double)per + (double)g.out * sizeof(float);
    printf("\n2. Decode GEMV, out %d x in %d int8 (%.1f MB), T = 1, rotating over %d matrices "
           "(%.0f MiB)\n", g.out, g.in, bytes / 1e6, g.n_mats, (double)per * g.n_mats / (1 << 20));
    for (int i = 0; i < c->nt; i++) {
        double s;
        if (time_gemv(&g, pool_for(c, i), &s) < 0)
            goto done;
        double gbs = bytes / s / 1e9;
        printf("   %d thread%s: %8.1f us  %6.2f GB/s  = %.2f of measured bandwidth (target >= 0.80)",
               c->tcount[i], plural(c->tcount[i]), s * 1e6, gbs, gbs * 1e9 / c->bw[i]);
        if (c->tcount[i] <= 2) {
            double llama = c->tcount[i] == 1 ? LLAMA_GEMV_US_1T : LLAMA_GEMV_US_2T;
            printf("  | llama.cpp q8_0 %.0f us: %.2fx", llama, llama / (s * 1e6));
        }
        printf("\n");
    }
    rc = 0;
done:
    gemv_case_free(&g);
    return rc;
}

static int bench_gemm(struct ctx *c)
{
    struct gemm_case g = {.out = 2048, .in = 4096, .T = c->o.quick ? 64 : 512,
                          .reps = c->o.quick ? 3 : 25};
    int rc = -1;
    if (gemm_case_alloc(&g))
        goto done;
    double ops = 2.0 * g.out * g.in * g.T;
    printf("\n3. Prefill GEMM, out %d x in %d, %d tokens (%.2f G int8 ops)\n", g.out, g.in, g.T,
           ops / 1e9);
    for (int i = 0; i < c->nt; i++) {
        double s;
        if (time_gemm(&g, pool_for(c, i), &s) < 0)
            goto done;
        double gops = ops / s / 1e9;
        printf("   %d thread%s: %8.2f ms  %7.1f Gops/s  = %.2f of VNNI peak (target >= 0.50)",
               c->tcount[i], plural(c->tcount[i]), s * 1e3, gops, gops * 1e9 / c->peak[i]);
        if (c->tcount[i] <= 2) {
            double llama = c->tcount[i] == 1 ? LLAMA_GEMM_GOPS_1T : LLAMA_GEMM_GOPS_2T;
            printf("  | llama.cpp q8_0 %.0f GFLOPS: %.2fx (target >= 1.2x)", llama, gops / llama);
        }
        printf("\n");
    }
    if (c->k == PD_KERNEL_AVX512 && pd_gemm_kernel_supported(PD_KERNEL_AVX2)) {
        /* The path CPUs without VNNI take, for reference. */
        pd_err e = {0};
        double s;
        pd_gemm_kernel_set(PD_KERNEL_AVX2, &e);
        int r2 = time_gemm(&g, NULL, &s);
        pd_gemm_kernel_set(c->k, &e);
        if (r2 < 0)
            goto done;
        printf("   (avx2 kernel, 1 thread:  %8.2f ms  %7.1f Gops/s = %.2fx llama.cpp)\n", s * 1e3,
               ops / s / 1e9, ops / s / 1e9 / LLAMA_GEMM_GOPS_1T);
    }
    rc = 0;
done:
    gemm_case_free(&g);
    return rc;
}

static int bench_moe(struct ctx *c)
{
    struct moe_case m = {.E = c->o.quick ? 16 : 64, .topk = c->o.quick ? 4 : 8, .out = 2048,
                         .in = 4096, .T = c->o.quick ? 64 : 512, .reps = c->o.quick ? 1 : 7};
    size_t per = (size_t)m.out * m.in;
    int rc = -1;
    m.w = xmalloc(per * m.E);
    m.ws = xmalloc((size_t)m.E * m.out * sizeof(float));
    m.x = xmalloc((size_t)m.T * m.in * sizeof(float));
    m.xq = xmalloc((size_t)m.T * m.in);
    m.xs = xmalloc((size_t)m.T * sizeof(float));
    m.rows = xmalloc((size_t)m.E * m.T * sizeof(int32_t));
    m.y = xmalloc((size_t)m.T * m.topk * m.out * sizeof(float));
    m.g = xmalloc((size_t)m.E * sizeof *m.g);
    if (!m.w || !m.ws || !m.x || !m.xq || !m.xs || !m.rows || !m.y || !m.g)
        goto done;
    fill_weights(m.w, per * m.E);
    fill_floats(m.ws, (size_t)m.E * m.out, 1e-3f, 2e-3f);
    fill_floats(m.x, (size_t)m.T * m.in, -1.0f, 1.0f);
    route(&m);
    double ops = 2.0 * m.out * m.in * (double)m.T * m.topk;
    printf("\n4. MoE grouped GEMM, %d experts of out %d x in %d (%.0f MiB), %d used per token, "
           "%d tokens (%.1f G int8 ops)\n", m.E, m.out, m.in, (double)per * m.E / (1 << 20),
           m.topk, m.T, ops / 1e9);
    for (int i = 0; i < c->nt; i++) {
        double s;
        if (time_moe(&m, pool_for(c, i), &s) < 0)
            goto done;
        double gops = ops / s / 1e9;
        printf("   %d thread%s: %8.2f ms  %7.1f Gops/s  = %.2f of VNNI peak", c->tcount[i],
               plural(c->tcount[i]), s * 1e3, gops, gops * 1e9 / c->peak[i]);
        if (c->tcount[i] == 1)
            printf("  | llama.cpp q8_0 %.0f GFLOPS: %.2fx (target >= 2x)", LLAMA_MOE_GOPS_1T,
                   gops / LLAMA_MOE_GOPS_1T);
        printf("\n");
    }
    rc = 0;
done:
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

int pd_bench_kernels(int argc, char **argv)
{
    struct ctx c = {0};
    if (parse_opts(argc, argv, &c.o) < 0)
        return 2;
    pd_err e = {0};
    if (report(pd_gemm_kernel_get(&c.k, &e), &e) < 0)
        return 1;
    int N = c.o.threads;
    if (N > 1 && report(pd_pool_create(N, &c.pool, &e), &e) < 0)
        return 1;
    c.tcount[0] = 1;
    c.tcount[1] = N;
    c.nt = N > 1 ? 2 : 1;

    printf("pdmoe bench kernels: kernel %s, threads 1 and %d%s\n", pd_gemm_kernel_name(c.k), N,
           c.o.quick ? ", --quick (small sizes: ratios are indicative only)" : "");
    printf("Kernel times are medians over repeated calls and include the per-token activation\n"
           "quantisation (fp32 in, fp32 out).\n\n");
    double t0 = pd_now_s();
    int rc = bench_ceilings(&c) < 0 || bench_gemv(&c) < 0 || bench_gemm(&c) < 0 ||
             bench_moe(&c) < 0;
    printf("\n(%.1f s)\n", pd_now_s() - t0);
    pd_pool_destroy(c.pool);
    return rc;
}

double pd_bench_read_bandwidth(pd_pool *pool, int threads, size_t bytes, int reps)
{
    int64_t *buf = xmalloc(bytes);
    if (!buf)
        return 0;
    memset(buf, 1, bytes);
    double bw = measure_bandwidth(pool, threads, buf, bytes, reps);
    free(buf);
    return bw;
}

int pd_bench_machine_measure(int threads, int quick, struct pd_bench_machine *m)
{
    memset(m, 0, sizeof *m);
    pd_pool *pool = NULL;
    pd_err e = {0};
    if (threads > 1 && report(pd_pool_create(threads, &pool, &e), &e) < 0)
        return -1;
    int rc = -1;
    m->bw = pd_bench_read_bandwidth(pool, threads, (size_t)(quick ? 128 : 512) << 20, quick ? 2 : 5);
    m->clock_hz = measure_clock_hz(quick);
    m->vnni_peak = pd_gemm_kernel_supported(PD_KERNEL_AVX512) ? measure_vnni_peak(pool, threads, quick)
                                                               : OPS_PER_VPDPBUSD * m->clock_hz * threads;
    struct gemv_case g = {.out = 4096, .in = 14336, .reps = quick ? 8 : 60, .n_mats = quick ? 2 : 5};
    struct gemm_case h = {.out = 2048, .in = 4096, .T = quick ? 64 : 256, .reps = quick ? 3 : 10};
    size_t per = (size_t)g.out * g.in;
    double s;
    if (gemv_case_alloc(&g) || gemm_case_alloc(&h))
        goto done;
    if (time_gemv(&g, pool, &s) < 0)
        goto done;
    m->gemv_bw = ((double)per + (double)g.out * sizeof(float)) / s;
    if (time_gemm(&h, pool, &s) < 0)
        goto done;
    m->gemm_ops = 2.0 * h.out * h.in * h.T / s;
    rc = 0;
done:
    gemv_case_free(&g);
    gemm_case_free(&h);
    pd_pool_destroy(pool);
    return rc;
}

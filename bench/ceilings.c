/* The machine's ceilings that the benchmarks set their figures against (ceilings.h): the clocks
 * they time with, the instruction-probe peaks (fp32 FMA, VNNI, AVX2 int8, AMX), the multi-stream read
 * bandwidth, and the median of timings. */
#include "bench/ceilings.h"
#include "bench/bench.h"

#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/timing.h"
#include "kernels/gemm.h"

void *pd_bench_aligned(size_t n)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64) != 0) {
        fprintf(stderr, "bench: out of memory (%zu bytes)\n", n);
        return NULL;
    }
    return p;
}

/* ---- clocks ---------------------------------------------------------------------------- */

/* With --cpu-time (one thread only) every interval is the calling thread's CPU time rather than
 * wall time: on a machine shared with other jobs, the time slices others take then drop out of
 * both the kernels and the ceilings. (pdmoe's and oneDNN's 1-thread runs both compute on the
 * calling thread.) */
static int use_cpu_time;

void pd_bench_set_cpu_time(int on)
{
    use_cpu_time = on;
}

double pd_bench_now_s(void)
{
    return use_cpu_time ? pd_thread_cpu_s() : pd_now_s();
}

/* ---- fp32 FMA peak --------------------------------------------------------------------- */

/* 16 independent 512-bit FMAs per iteration on zeros (no denormal assists): the rate of the
 * engine's float products (dot_gemm.c's tiles are FMA chains). */
__attribute__((target("avx512f"))) static void fma_chain(uint64_t iters)
{
    __asm__ volatile(
        "vpxord %%zmm0, %%zmm0, %%zmm0\n\t"  "vpxord %%zmm1, %%zmm1, %%zmm1\n\t"
        "vpxord %%zmm2, %%zmm2, %%zmm2\n\t"  "vpxord %%zmm3, %%zmm3, %%zmm3\n\t"
        "vpxord %%zmm4, %%zmm4, %%zmm4\n\t"  "vpxord %%zmm5, %%zmm5, %%zmm5\n\t"
        "vpxord %%zmm6, %%zmm6, %%zmm6\n\t"  "vpxord %%zmm7, %%zmm7, %%zmm7\n\t"
        "vpxord %%zmm8, %%zmm8, %%zmm8\n\t"  "vpxord %%zmm9, %%zmm9, %%zmm9\n\t"
        "vpxord %%zmm10, %%zmm10, %%zmm10\n\t"  "vpxord %%zmm11, %%zmm11, %%zmm11\n\t"
        "vpxord %%zmm12, %%zmm12, %%zmm12\n\t"  "vpxord %%zmm13, %%zmm13, %%zmm13\n\t"
        "vpxord %%zmm14, %%zmm14, %%zmm14\n\t"  "vpxord %%zmm15, %%zmm15, %%zmm15\n\t"
        "vpxord %%zmm16, %%zmm16, %%zmm16\n\t"  "vpxord %%zmm17, %%zmm17, %%zmm17\n\t"
        "1:\n\t"
        "vfmadd231ps %%zmm16, %%zmm17, %%zmm0\n\t"  "vfmadd231ps %%zmm16, %%zmm17, %%zmm1\n\t"
        "vfmadd231ps %%zmm16, %%zmm17, %%zmm2\n\t"  "vfmadd231ps %%zmm16, %%zmm17, %%zmm3\n\t"
        "vfmadd231ps %%zmm16, %%zmm17, %%zmm4\n\t"  "vfmadd231ps %%zmm16, %%zmm17, %%zmm5\n\t"
        "vfmadd231ps %%zmm16, %%zmm17, %%zmm6\n\t"  "vfmadd231ps %%zmm16, %%zmm17, %%zmm7\n\t"
        "vfmadd231ps %%zmm16, %%zmm17, %%zmm8\n\t"  "vfmadd231ps %%zmm16, %%zmm17, %%zmm9\n\t"
        "vfmadd231ps %%zmm16, %%zmm17, %%zmm10\n\t"  "vfmadd231ps %%zmm16, %%zmm17, %%zmm11\n\t"
        "vfmadd231ps %%zmm16, %%zmm17, %%zmm12\n\t"  "vfmadd231ps %%zmm16, %%zmm17, %%zmm13\n\t"
        "vfmadd231ps %%zmm16, %%zmm17, %%zmm14\n\t"  "vfmadd231ps %%zmm16, %%zmm17, %%zmm15\n\t"
        "dec %0\n\t"
        "jnz 1b\n\t"
        "vzeroupper\n\t"
        : "+r"(iters)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
          "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "cc");
}

/* 12 independent 256-bit FMAs per iteration on zeros: the AVX2 CPUs' float products (vec_avx2.c's
 * tiles are vfmadd231ps ymm chains). 12 chains cover a 2-pipe core's 5-cycle FMA latency (10 in
 * flight) with 2 registers of sources, 14 of the 16 ymm. */
__attribute__((target("avx2,fma"))) static void fma_chain_avx2(uint64_t iters)
{
    __asm__ volatile(
        "vpxor %%ymm0, %%ymm0, %%ymm0\n\t"  "vpxor %%ymm1, %%ymm1, %%ymm1\n\t"
        "vpxor %%ymm2, %%ymm2, %%ymm2\n\t"  "vpxor %%ymm3, %%ymm3, %%ymm3\n\t"
        "vpxor %%ymm4, %%ymm4, %%ymm4\n\t"  "vpxor %%ymm5, %%ymm5, %%ymm5\n\t"
        "vpxor %%ymm6, %%ymm6, %%ymm6\n\t"  "vpxor %%ymm7, %%ymm7, %%ymm7\n\t"
        "vpxor %%ymm8, %%ymm8, %%ymm8\n\t"  "vpxor %%ymm9, %%ymm9, %%ymm9\n\t"
        "vpxor %%ymm10, %%ymm10, %%ymm10\n\t"  "vpxor %%ymm11, %%ymm11, %%ymm11\n\t"
        "vpxor %%ymm14, %%ymm14, %%ymm14\n\t"  "vpxor %%ymm15, %%ymm15, %%ymm15\n\t"
        "1:\n\t"
        "vfmadd231ps %%ymm14, %%ymm15, %%ymm0\n\t"  "vfmadd231ps %%ymm14, %%ymm15, %%ymm1\n\t"
        "vfmadd231ps %%ymm14, %%ymm15, %%ymm2\n\t"  "vfmadd231ps %%ymm14, %%ymm15, %%ymm3\n\t"
        "vfmadd231ps %%ymm14, %%ymm15, %%ymm4\n\t"  "vfmadd231ps %%ymm14, %%ymm15, %%ymm5\n\t"
        "vfmadd231ps %%ymm14, %%ymm15, %%ymm6\n\t"  "vfmadd231ps %%ymm14, %%ymm15, %%ymm7\n\t"
        "vfmadd231ps %%ymm14, %%ymm15, %%ymm8\n\t"  "vfmadd231ps %%ymm14, %%ymm15, %%ymm9\n\t"
        "vfmadd231ps %%ymm14, %%ymm15, %%ymm10\n\t"  "vfmadd231ps %%ymm14, %%ymm15, %%ymm11\n\t"
        "dec %0\n\t"
        "jnz 1b\n\t"
        "vzeroupper\n\t"
        : "+r"(iters)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
          "xmm10", "xmm11", "xmm14", "xmm15", "cc");
}

/* ---- VNNI peak ------------------------------------------------------------------------- */

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

/* ---- AVX2 int8 peak -------------------------------------------------------------------- */

/* The AVX2 kernel's arithmetic (gemm_avx2.c): vpmaddwd of int16 pairs, each product vector added
 * into an int32 accumulator by vpaddd. 12 of each per iteration, the products independent (the
 * same two sources) and the adds in 6 chains, more than latency x throughput on current cores.
 * The kernel's vpmovsxbw widening of every int8 is left out: this is the rate of its products. */
__attribute__((target("avx2"))) static void avx2_int8_chain(uint64_t iters)
{
#define MADD_ADD(p, a) "vpmaddwd %%ymm14, %%ymm15, %%ymm" #p "\n\t" "vpaddd %%ymm" #p ", %%ymm" #a ", %%ymm" #a "\n\t"
    __asm__ volatile(
        "vpcmpeqd %%ymm14, %%ymm14, %%ymm14\n\t"  "vpcmpeqd %%ymm15, %%ymm15, %%ymm15\n\t"
        "vpxor %%ymm6, %%ymm6, %%ymm6\n\t"  "vpxor %%ymm7, %%ymm7, %%ymm7\n\t"
        "vpxor %%ymm8, %%ymm8, %%ymm8\n\t"  "vpxor %%ymm9, %%ymm9, %%ymm9\n\t"
        "vpxor %%ymm10, %%ymm10, %%ymm10\n\t"  "vpxor %%ymm11, %%ymm11, %%ymm11\n\t"
        "1:\n\t"
        MADD_ADD(0, 6) MADD_ADD(1, 7) MADD_ADD(2, 8) MADD_ADD(3, 9) MADD_ADD(4, 10) MADD_ADD(5, 11)
        MADD_ADD(0, 6) MADD_ADD(1, 7) MADD_ADD(2, 8) MADD_ADD(3, 9) MADD_ADD(4, 10) MADD_ADD(5, 11)
        "dec %0\n\t"
        "jnz 1b\n\t"
        "vzeroupper\n\t"
        : "+r"(iters)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
          "xmm10", "xmm11", "xmm14", "xmm15", "cc");
#undef MADD_ADD
}

/* The nominal clock the kernel reports (/proc/cpuinfo "cpu MHz" of the first CPU), in Hz, or 0:
 * for labels only. A timed dependent-add chain is not used: cores that fuse or eliminate adds read
 * it as 19 GHz. */
double pd_bench_nominal_clock_hz(void)
{
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[256];
    double mhz = 0;
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "cpu MHz", 7) == 0 && sscanf(strchr(line, ':') + 1, "%lf", &mhz) == 1)
            break;
    if (f)
        fclose(f);
    return mhz * 1e6;
}

struct vnni_run {
    uint64_t iters;   /* per task */
};

static void amx_task(void *arg, int task)
{
    pd_gemm_amx_probe(((struct vnni_run *)arg)->iters);
}

static void vnni_task(void *arg, int task)
{
    vnni_chain(((struct vnni_run *)arg)->iters);
}

/* The best of 5 timed runs of `task` over 8 tasks per thread (so that both threads of a pool get
 * work even if one of them wakes late), after a warm-up: the seconds of the fastest run. */
static double probe_seconds(pd_pool *pool, int threads, void (*task)(void *, int), struct vnni_run *r)
{
    double best = 1e30;
    task(r, 0);
    for (int rep = 0; rep < 5; rep++) {
        double t0 = pd_bench_now_s();
        pd_pool_run(threads > 1 ? pool : NULL, 8 * threads, task, r);
        double dt = pd_bench_now_s() - t0;
        best = dt < best ? dt : best;
    }
    return best;
}

/* int8 ops/s from `threads` threads each issuing only vpdpbusd (16 chains per task). */
double pd_bench_vnni_peak(pd_pool *pool, int threads, int quick)
{
    struct vnni_run r = {.iters = quick ? 200000 : 1000000};
    return 8.0 * threads * (double)r.iters * 16.0 * PD_BENCH_OPS_PER_VPDPBUSD / probe_seconds(pool, threads, vnni_task, &r);
}

static void avx2_int8_task(void *arg, int task)
{
    avx2_int8_chain(((struct vnni_run *)arg)->iters);
}

/* int8 ops/s from `threads` threads each issuing only vpmaddwd + vpaddd (24 of each per task
 * iteration); 0 without AVX2. */
double pd_bench_avx2_int8_peak(pd_pool *pool, int threads, int quick)
{
    if (!__builtin_cpu_supports("avx2"))
        return 0;
    struct vnni_run r = {.iters = quick ? 200000 : 1000000};
    return 8.0 * threads * (double)r.iters * 12.0 * PD_BENCH_OPS_PER_VPMADDWD /
           probe_seconds(pool, threads, avx2_int8_task, &r);
}

static void fma_task(void *arg, int task)
{
    fma_chain(((struct vnni_run *)arg)->iters);
}

static void fma_avx2_task(void *arg, int task)
{
    fma_chain_avx2(((struct vnni_run *)arg)->iters);
}

/* The engine's float products use 512-bit FMAs exactly where avx512f is (vec.c, dot_gemm.c), else
 * 256-bit ones where AVX2 and FMA are (vec_avx2.c): the probe follows the same choice. */
enum fp32_isa { FP32_NONE, FP32_AVX2, FP32_AVX512 };

static enum fp32_isa fp32_isa(void)
{
    return __builtin_cpu_supports("avx512f")                                       ? FP32_AVX512
           : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? FP32_AVX2
                                                                                   : FP32_NONE;
}

const char *pd_bench_fp32_probe(void)
{
    return (const char *[]){NULL, "VFMADD231PS ymm (AVX2 + FMA)", "VFMADD231PS zmm (AVX-512)"}[fp32_isa()];
}

/* fp32 flops/s from `threads` threads each issuing only FMAs: 16 chains of 512-bit ones (16 lanes
 * x 2 flops) with AVX-512, else 12 chains of 256-bit ones (8 lanes x 2 flops); 0 with neither. */
double pd_bench_fp32_peak(pd_pool *pool, int threads, int quick)
{
    struct vnni_run r = {.iters = quick ? 200000 : 1000000};
    switch (fp32_isa()) {
    case FP32_AVX512:
        return 8.0 * threads * (double)r.iters * 16.0 * 32.0 / probe_seconds(pool, threads, fma_task, &r);
    case FP32_AVX2:
        return 8.0 * threads * (double)r.iters * 12.0 * 16.0 / probe_seconds(pool, threads, fma_avx2_task, &r);
    default:
        return 0;
    }
}

/* int8 ops/s of TDPBSSD alone (4 independent tile accumulators per task); 0 where the CPU (or
 * Linux) has no AMX-INT8. */
double pd_bench_amx_peak(pd_pool *pool, int threads, int quick)
{
    if (!pd_gemm_kernel_supported(PD_KERNEL_AMX))
        return 0;
    struct vnni_run r = {.iters = quick ? 20000 : 100000};
    return 8.0 * threads * (double)r.iters * 4.0 * PD_GEMM_AMX_OPS / probe_seconds(pool, threads, amx_task, &r);
}

const char *pd_bench_int8_probe_name(enum pd_bench_int8_probe p)
{
    return (const char *[]){NULL, "VPMADDWD + VPADDD ymm (AVX2)", "VPDPBUSD zmm (AVX-512 VNNI)",
                            "TDPBSSD tiles (AMX-INT8)"}[p];
}

/* The int8 peak is that of the instructions the engine's kernel runs: the AVX2 probe for the AVX2
 * kernel (the one CPUs without AVX-512 VNNI take), else the faster of VNNI and AMX where there are. */
void pd_bench_peaks(pd_pool *pool, int threads, int quick, double *fp32, double *int8, const char **int8_probe)
{
    *fp32 = pd_bench_fp32_peak(pool, threads, quick);
    pd_kernel k = PD_KERNEL_REF;
    pd_err e = {0};
    if (pd_gemm_kernel_get(&k, &e) == 0 && k == PD_KERNEL_AVX2) {
        *int8 = pd_bench_avx2_int8_peak(pool, threads, quick);
        *int8_probe = pd_bench_int8_probe_name(PD_BENCH_INT8_AVX2);
        return;
    }
    const double vnni = pd_gemm_kernel_supported(PD_KERNEL_AVX512) ? pd_bench_vnni_peak(pool, threads, quick) : 0;
    const double amx = pd_bench_amx_peak(pool, threads, quick);
    *int8 = amx > vnni ? amx : vnni;
    *int8_probe = pd_bench_int8_probe_name(amx > vnni ? PD_BENCH_INT8_AMX : vnni > 0 ? PD_BENCH_INT8_VNNI
                                                                                    : PD_BENCH_INT8_NONE);
}

/* ---- memory bandwidth ------------------------------------------------------------------- */

/* Independent streams per thread: one stream keeps too few lines in flight and read about 25%
 * under what the GEMV itself streams; eight side by side reach the machine's limit. */
enum { BW_STREAMS = PD_BENCH_BW_STREAMS };

/* Unsigned sums (the values wrap; only the loads matter) of BW_STREAMS equal parts of p[0, n),
 * read side by side, 64 bytes of each in turn. The eight accumulators are named variables: as an
 * array GCC kept them on the stack, and the loop measured store forwarding, not memory. */
#define STREAMS8(ADD)                                                                            \
    ADD(s0, q0 + i); ADD(s1, q1 + i); ADD(s2, q2 + i); ADD(s3, q3 + i);                           \
    ADD(s4, q4 + i); ADD(s5, q5 + i); ADD(s6, q6 + i); ADD(s7, q7 + i)
#define STREAM_PTRS                                                                              \
    const int64_t *q0 = p, *q1 = q0 + per, *q2 = q1 + per, *q3 = q2 + per, *q4 = q3 + per,       \
                  *q5 = q4 + per, *q6 = q5 + per, *q7 = q6 + per

__attribute__((target("avx512f"))) static uint64_t sum_avx512(const int64_t *p, size_t n)
{
    size_t per = n / BW_STREAMS & ~(size_t)7;   /* int64s per stream, whole 64-byte vectors */
    STREAM_PTRS;
    __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
#define ADD512(s, q) s = _mm512_add_epi64(s, _mm512_loadu_si512(q))
    for (size_t i = 0; i < per; i += 8) {
        STREAMS8(ADD512);
    }
#undef ADD512
    s0 = _mm512_add_epi64(_mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3)),
                          _mm512_add_epi64(_mm512_add_epi64(s4, s5), _mm512_add_epi64(s6, s7)));
    uint64_t lanes[8], sum = 0;
    _mm512_storeu_si512(lanes, s0);
    for (int j = 0; j < 8; j++)
        sum += lanes[j];
    for (size_t i = BW_STREAMS * per; i < n; i++)
        sum += (uint64_t)p[i];
    return sum;
}

__attribute__((target("avx2"))) static uint64_t sum_avx2(const int64_t *p, size_t n)
{
    size_t per = n / BW_STREAMS & ~(size_t)7;
    STREAM_PTRS;
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
#define ADD256(s, q)                                                                             \
    s = _mm256_add_epi64(s, _mm256_loadu_si256((const __m256i *)(q)));                           \
    s = _mm256_add_epi64(s, _mm256_loadu_si256((const __m256i *)(q) + 1))
    for (size_t i = 0; i < per; i += 8) {
        STREAMS8(ADD256);
    }
#undef ADD256
    s0 = _mm256_add_epi64(_mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3)),
                          _mm256_add_epi64(_mm256_add_epi64(s4, s5), _mm256_add_epi64(s6, s7)));
    uint64_t lanes[4], sum = 0;
    _mm256_storeu_si256((__m256i *)lanes, s0);
    for (int j = 0; j < 4; j++)
        sum += lanes[j];
    for (size_t i = BW_STREAMS * per; i < n; i++)
        sum += (uint64_t)p[i];
    return sum;
}

static uint64_t sum_scalar(const int64_t *p, size_t n)
{
    size_t per = n / BW_STREAMS;
    STREAM_PTRS;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
#define ADD64(s, q) s += (uint64_t)*(q)
    for (size_t i = 0; i < per; i++) {
        STREAMS8(ADD64);
    }
#undef ADD64
    uint64_t sum = s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7;
    for (size_t i = BW_STREAMS * per; i < n; i++)
        sum += (uint64_t)p[i];
    return sum;
}
#undef STREAMS8
#undef STREAM_PTRS

enum bw_isa { BW_SCALAR, BW_AVX2, BW_AVX512 };

static enum bw_isa bw_isa(void)
{
    return __builtin_cpu_supports("avx512f") ? BW_AVX512
           : __builtin_cpu_supports("avx2")  ? BW_AVX2
                                             : BW_SCALAR;
}

const char *pd_bench_bandwidth_isa(void)
{
    return (const char *[]){"scalar", "AVX2", "AVX-512"}[bw_isa()];
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
    size_t n = i0 >= r->n ? 0 : i0 + r->chunk <= r->n ? r->chunk : r->n - i0;
    r->sums[task] = r->isa == BW_AVX512 ? sum_avx512(r->buf + i0, n)
                    : r->isa == BW_AVX2 ? sum_avx2(r->buf + i0, n)
                                        : sum_scalar(r->buf + i0, n);
}

/* Bytes/s reading `bytes` with `threads` threads (64 tasks of BW_STREAMS streams), best of `reps`. */
double pd_bench_bandwidth(pd_pool *pool, int threads, const int64_t *buf, size_t bytes, int reps)
{
    struct bw_run r = {.buf = buf, .n = bytes / 8, .isa = bw_isa()};
    r.chunk = (r.n + 63) / 64;
    double best = 1e30;
    for (int rep = 0; rep < reps; rep++) {
        double t0 = pd_bench_now_s();
        pd_pool_run(threads > 1 ? pool : NULL, 64, bw_task, &r);
        double dt = pd_bench_now_s() - t0;
        best = dt < best ? dt : best;
    }
    uint64_t check = 0;
    for (int i = 0; i < 64; i++)
        check += r.sums[i];
    if (check == 42)
        printf("(checksum %llu)\n", (unsigned long long)check);
    return (double)bytes / best;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int pd_bench_quick_json(const char *name, int argc, char **argv, int *quick, int *json)
{
    *quick = *json = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            *quick = 1;
        else if (!strcmp(argv[i], "--json"))
            *json = 1;
        else {
            fprintf(stderr, "pdmoe bench %s: unknown option %s (see pdmoe bench %s --help)\n", name, argv[i], name);
            return 2;
        }
    }
    return 0;
}

void pd_bench_verdict(json_t *doc, int ok, const char *met, const char *missed)
{
    if (!doc) {
        printf("%s\n", ok ? met : missed);
        return;
    }
    json_object_set_new(doc, "met", json_boolean(ok));
    json_dumpf(doc, stdout, JSON_INDENT(2));
    printf("\n");
    json_decref(doc);
}

double pd_bench_median(double *t, int n)
{
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

double pd_bench_read_bandwidth(pd_pool *pool, int threads, size_t bytes, int reps)
{
    int64_t *buf = pd_bench_aligned(bytes);
    if (!buf)
        return 0;
    memset(buf, 1, bytes);
    double bw = pd_bench_bandwidth(pool, threads, buf, bytes, reps);
    free(buf);
    return bw;
}

double pd_bench_read_bandwidth_cpu_time(size_t bytes, int reps)
{
    int was = use_cpu_time;
    use_cpu_time = 1;
    double bw = pd_bench_read_bandwidth(NULL, 1, bytes, reps);
    use_cpu_time = was;
    return bw;
}


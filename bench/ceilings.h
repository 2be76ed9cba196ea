/* The machine's ceilings the benchmarks share (bench/ceilings.c): every figure a benchmark prints
 * is set against what this machine does in the same run. pd_bench_peaks, pd_bench_read_bandwidth
 * and pd_bench_median are in bench.h, for the other commands; these are the parts `bench kernels`
 * also times and reports one by one. */
#ifndef PD_BENCH_CEILINGS_H
#define PD_BENCH_CEILINGS_H

#include <stddef.h>
#include <stdint.h>

#include "core/threadpool.h"

/* int8 ops (multiply + add) in one 512-bit vpdpbusd: 16 lanes x 4 byte products. */
#define PD_BENCH_OPS_PER_VPDPBUSD 128.0

/* 64-byte aligned memory of n bytes (n 0: 64), or NULL after a line on stderr; free() it. */
void *pd_bench_aligned(size_t n);

/* With on (one thread only), pd_bench_now_s is the calling thread's CPU time, else wall time. */
void pd_bench_set_cpu_time(int on);
double pd_bench_now_s(void);
/* The nominal clock the kernel reports (/proc/cpuinfo), in Hz, or 0: for labels only. */
double pd_bench_nominal_clock_hz(void);
/* Peaks of `threads` threads (pool NULL for one) from instruction probes, ops or flops per second:
 * independent VPDPBUSD chains, 512-bit FMA chains (0 without AVX-512), TDPBSSD tiles (0 without
 * AMX-INT8). quick: shorter probes. */
double pd_bench_vnni_peak(pd_pool *pool, int threads, int quick);
double pd_bench_fp32_peak(pd_pool *pool, int threads, int quick);
double pd_bench_amx_peak(pd_pool *pool, int threads, int quick);
/* Bytes/s reading buf[0, bytes) with `threads` threads, PD_BENCH_BW_STREAMS streams each, best of
 * `reps`; the loads it uses ("AVX-512", "AVX2" or "scalar"). */
#define PD_BENCH_BW_STREAMS 8
const char *pd_bench_bandwidth_isa(void);
double pd_bench_bandwidth(pd_pool *pool, int threads, const int64_t *buf, size_t bytes, int reps);

#endif

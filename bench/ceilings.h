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

/* int8 ops (multiply + add) in one 256-bit vpmaddwd and the vpaddd that accumulates it: 16 int16
 * products, summed in pairs, then added. */
#define PD_BENCH_OPS_PER_VPMADDWD 32.0

/* The int8 instruction probes, by what they run; pd_bench_int8_probe_name: their names for the
 * reports ("VPMADDWD + VPADDD ymm (AVX2)", ...; NULL for NONE). */
enum pd_bench_int8_probe { PD_BENCH_INT8_NONE, PD_BENCH_INT8_AVX2, PD_BENCH_INT8_VNNI, PD_BENCH_INT8_AMX };
const char *pd_bench_int8_probe_name(enum pd_bench_int8_probe p);

/* 64-byte aligned memory of n bytes (n 0: 64), or NULL after a line on stderr; free() it. */
void *pd_bench_aligned(size_t n);

/* With on (one thread only), pd_bench_now_s is the calling thread's CPU time, else wall time. */
void pd_bench_set_cpu_time(int on);
double pd_bench_now_s(void);
/* The nominal clock the kernel reports (/proc/cpuinfo), in Hz, or 0: for labels only. */
double pd_bench_nominal_clock_hz(void);
/* Peaks of `threads` threads (pool NULL for one) from instruction probes, ops or flops per second:
 * independent VPDPBUSD chains (call only with AVX-512 VNNI), VPMADDWD + VPADDD ymm chains (the AVX2
 * kernel's products; 0 without AVX2), FMA chains of the width the engine's float products use (512-bit
 * with AVX-512, else 256-bit with AVX2 + FMA, else 0), TDPBSSD tiles (0 without AMX-INT8). quick:
 * shorter probes. pd_bench_fp32_probe: the FMA probe's instructions ("VFMADD231PS zmm (AVX-512)" or
 * "VFMADD231PS ymm (AVX2 + FMA)"), NULL when there is none. */
double pd_bench_vnni_peak(pd_pool *pool, int threads, int quick);
double pd_bench_avx2_int8_peak(pd_pool *pool, int threads, int quick);
double pd_bench_fp32_peak(pd_pool *pool, int threads, int quick);
const char *pd_bench_fp32_probe(void);
double pd_bench_amx_peak(pd_pool *pool, int threads, int quick);
/* Bytes/s reading buf[0, bytes) with `threads` threads, PD_BENCH_BW_STREAMS streams each, best of
 * `reps`; the loads it uses ("AVX-512", "AVX2" or "scalar"). */
#define PD_BENCH_BW_STREAMS 8
const char *pd_bench_bandwidth_isa(void);
double pd_bench_bandwidth(pd_pool *pool, int threads, const int64_t *buf, size_t bytes, int reps);

#endif

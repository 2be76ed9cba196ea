/* Benchmarks run by `pdmoe bench NAME`. Each prints ratios measured in the same run. */
#ifndef PD_BENCH_BENCH_H
#define PD_BENCH_BENCH_H

int pd_bench_plan(int argc, char **argv);
int pd_bench_kernels(int argc, char **argv);
int pd_bench_decode(int argc, char **argv);
int pd_bench_ep(int argc, char **argv);
int pd_bench_serve(int argc, char **argv);
int pd_bench_transfer(int argc, char **argv);
int pd_bench_search(int argc, char **argv);

#include <stddef.h>

#include "core/threadpool.h"

/* Memory read bandwidth of this machine in bytes/s: `threads` threads summing a buffer of
 * `bytes` (>= 256 MiB to defeat the caches), best of `reps`. */
double pd_bench_read_bandwidth(pd_pool *pool, int threads, size_t bytes, int reps);

#endif

/* Benchmarks run by `pdmoe bench NAME`. Each prints ratios measured in the same run. */
#ifndef PD_BENCH_BENCH_H
#define PD_BENCH_BENCH_H

int pd_bench_plan(int argc, char **argv);
int pd_bench_kernels(int argc, char **argv);

#endif

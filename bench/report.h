/* What issue 17's benchmarks (`pdmoe bench kernels|decode|ep`, and prefill's machine) say in
 * their --json about where they ran and which of the targets they held. The targets are
 * stated here once: each benchmark judges its own cases against them, and tools/perf-table.py,
 * which writes the README's performance table from the stored documents, only prints those
 * verdicts (it judges nothing itself). */
#ifndef PD_BENCH_REPORT_H
#define PD_BENCH_REPORT_H

#include <jansson.h>

enum pd_bench_target {
    PD_TARGET_INT8_OF_PEAK,     /* 17.3: a GEMM or MoE case without AMX, >= 0.75 of the int8 peak of the
                                   instructions the kernel runs (VPDPBUSD or the AVX2 kernel's VPMADDWD) */
    PD_TARGET_AMX_OVER_ONEDNN,  /* 17.2: a GEMM case on the AMX kernel, >= 1.0x oneDNN in the same run */
    PD_TARGET_AMX_MOE_OF_DENSE, /* 17.2: the MoE case on the AMX kernel, >= 0.8 of the dense GEMM of the
                                   same matrix shape at the same threads (equal operations per second) */
    PD_TARGET_DECODE_ROOFLINE,  /* 17.5: decode at 1 thread, batch 1 and 16, >= 0.85 of the bandwidth roofline */
    PD_TARGET_DECODE_SCALING,   /* 17.5: decode at 2 threads >= 1.7x 1 thread's tokens/s */
    PD_TARGET_EP_OVER_RAW,      /* 17.6: the EP exchange at 2 ranks <= 1.5x a raw MPI_Alltoallv of the same
                                   volumes (ratio of medians) */
    PD_TARGET_N
};

/* The bound, and whether it is a floor (>=) or a ceiling (<=). */
double pd_bench_target_bound(enum pd_bench_target t);
int pd_bench_target_is_floor(enum pd_bench_target t);
/* 1 if measured holds t. */
int pd_bench_target_met(enum pd_bench_target t, double measured);
/* {"issue": "17.3", "metric": metric, "min" (floor) or "max" (ceiling): bound, "met": bool}, for
 * the object whose member `metric` holds the measured value. */
json_t *pd_bench_target_json(enum pd_bench_target t, const char *metric, double measured);
/* "met" or "not met", and the bound as text (">= 0.75", "<= 1.5"), for the reports. */
const char *pd_bench_target_word(enum pd_bench_target t, double measured);
const char *pd_bench_target_text(enum pd_bench_target t);

/* Where and how a benchmark ran, for the documents that are kept: sets doc's "command" (
 * "pdmoe bench " and its argv, argv[0] the benchmark's name as pd_cli_bench passes it; an argument
 * holding anything but letters, digits and -_.,/=: in single quotes) and "machine" ({"cpu":
 * /proc/cpuinfo's model name, "family", "model": its cpu family and model numbers (null where it
 * has none), "flags": the ones the kernels choose by (avx2, fma, avx512f, avx512_vnni, amx_int8,
 * ...) that this CPU has, "cores": online, "linux": uname's release, "utc": "2026-12-06T16:40:00Z",
 * "load_average": the 1-minute one at the call}). */
void pd_bench_provenance(json_t *doc, int argc, char **argv);

#endif

/* Benchmarks run by `pdmoe bench NAME`. Each prints ratios measured in the same run. */
#ifndef PD_BENCH_BENCH_H
#define PD_BENCH_BENCH_H

int pd_bench_plan(int argc, char **argv);
int pd_bench_kernels(int argc, char **argv);
int pd_bench_decode(int argc, char **argv);
int pd_bench_prefill(int argc, char **argv);
int pd_bench_ep(int argc, char **argv);
int pd_bench_serve(int argc, char **argv);
int pd_bench_soak(int argc, char **argv);
int pd_bench_transfer(int argc, char **argv);
int pd_bench_search(int argc, char **argv);
int pd_bench_tokenizer(int argc, char **argv);
int pd_bench_convert(int argc, char **argv);

#include <jansson.h>
#include <stddef.h>

#include "core/threadpool.h"
#include "engine/engine.h"

/* Memory read bandwidth of this machine in bytes/s: `threads` threads summing a buffer of
 * `bytes` (>= 256 MiB to defeat the caches), best of `reps`. */
double pd_bench_read_bandwidth(pd_pool *pool, int threads, size_t bytes, int reps);
/* The same at 1 thread timed by the calling thread's CPU time (bench kernels --cpu-time's
 * ceiling): other jobs' time slices left out. */
double pd_bench_read_bandwidth_cpu_time(size_t bytes, int reps);

/* The ceilings and kernel rates `pdmoe calibrate` records for `threads` threads: read
 * bandwidth (bytes/s, several streams per thread), the nominal core clock the kernel reports
 * (Hz, /proc/cpuinfo; 0 if unknown), the VNNI peak (int8 ops/s, an instruction probe; 0 without
 * AVX-512 VNNI), the fp32 FMA peak (flops/s, the probe fp32_probe names; 0, NULL without FMAs), the
 * AMX peak (int8 ops/s, the tile probe; 0 without AMX), the int8 peak of the kernel the engine runs
 * (the AMX peak when it runs the AMX kernel, the VPMADDWD probe's for the AVX2 kernel, else the
 * VNNI peak) and which probe that is, the decode GEMV's effective bandwidth on a 59 MB matrix
 * (bytes/s) and the prefill GEMM's int8 ops/s (both on int8 activations, quantisation excluded). */
struct pd_bench_machine {
    double bw, clock_hz, vnni_peak, fp32_peak, amx_peak, int8_peak, gemv_bw, gemm_ops;
    const char *int8_probe, *fp32_probe;
    int bw_mib, bw_runs, gemm_tokens;   /* how they were measured: the sum's MiB and runs, the GEMM's tokens */
};
int pd_bench_machine_measure(int threads, int quick, struct pd_bench_machine *m);

/* Instruction-probe peaks of `threads` threads (pool: NULL for one): *fp32 the flops/s of
 * independent FMA chains as wide as the engine's float products use (512-bit with AVX-512, else
 * 256-bit with AVX2 + FMA; 0 with neither: pd_bench_fp32_probe in bench/ceilings.h names them),
 * *int8 the int8 ops/s of the instructions the engine's int8 kernel runs: VPMADDWD + VPADDD chains
 * for the AVX2 kernel, else independent VPDPBUSD chains, or AMX tiles where they are faster (0 with
 * neither), and *int8_probe which (NULL: none). For bounds: no kernel of those instructions goes
 * faster. */
void pd_bench_peaks(pd_pool *pool, int threads, int quick, double *fp32, double *int8, const char **int8_probe);

/* Best seconds (*best) of one engine step of `seqs` sequences adding `tokens` each after `ctx`
 * cached tokens, over `reps` repetitions after a warm-up; with steps > 1 the mean of that many
 * consecutive steps (a decode in its steady state). Sequence b reads the token ids of `text`
 * (n_text of them, wrapping) from offset 211 b, or synthetic ids if text is NULL. The context is
 * prefilled once (untimed) and every repetition starts from the KV it left (pd_bench_kv_save). */
/* A copy of a sequence's KV (its pd_kvseq_runs for its s->pos tokens), to put back into the same
 * sequence after it ran further: the same steps again from the same state, bit for bit, without
 * computing the context again. Sequences of an engine without the MTP layer. */
struct pd_bench_kvcopy {
    struct pd_kv_run *runs;
    int n;
    uint8_t *bytes;
    int64_t len;
};
int pd_bench_kv_save(const struct pd_engine *en, const struct pd_seq *s, struct pd_bench_kvcopy *c, pd_err *e);
/* s (the sequence c was saved from) back at c->len tokens, with the KV it had then. */
void pd_bench_kv_restore(struct pd_engine *en, struct pd_seq *s, const struct pd_bench_kvcopy *c);
void pd_bench_kv_free(struct pd_bench_kvcopy *c);
int pd_bench_step_time(struct pd_engine *en, int seqs, int tokens, int ctx, int steps, const int32_t *text,
                       size_t n_text, int reps, double *best, pd_err *e);

/* Best seconds of one contiguous UCX get of `bytes` between two workers of this process
 * (shared memory or loopback, as UCX_TLS allows), over `reps`; -1 if UCX fails. */
double pd_bench_ucx_get_time(size_t bytes, int reps);
/* A benchmark that takes --quick and --json only: sets them from argv; 2 after naming an unknown
 * argument (with `name`, as "pdmoe bench NAME"), else 0. */
int pd_bench_quick_json(const char *name, int argc, char **argv, int *quick, int *json);
/* Ends a benchmark against a target: with doc (--json), its "met" set to ok and the document
 * printed (and freed); else the line met or missed. */
void pd_bench_verdict(json_t *doc, int ok, const char *met, const char *missed);
/* Median of n timings (sorts them): robust to the odd slow run on a shared machine. */
double pd_bench_median(double *t, int n);

#endif

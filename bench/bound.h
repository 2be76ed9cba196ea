/* The least time an engine step can take on this machine (bench/bound.c): the weights it reads
 * against the read bandwidth and the products it runs against the instruction-probe peaks, both
 * measured in the same run. `bench decode` and `bench prefill` set their steps against it. */
#ifndef PD_BENCH_BOUND_H
#define PD_BENCH_BOUND_H

#include <stdint.h>

#include "core/threadpool.h"
#include "engine/engine.h"

/* The machine's ceilings at one thread count: read bandwidth (bytes/s), fp32 FMA and int8 peaks
 * (ops/s; 0: not probed, that arithmetic left out of the bound). */
struct pd_bench_ceilings {
    double bw, fp32, int8;
};

/* Probes the ceilings at `threads` (pool: the engine's, used above 1 thread): the read bandwidth
 * (several streams per thread, 512 MiB, 256 with quick), the fp32 FMA and int8 peaks
 * (pd_bench_peaks; *int8_probe names the int8 one's instructions), and with bw_cpu also the 1-thread
 * bandwidth by CPU time; raises each field to its new reading where that is higher. Called before
 * and after a benchmark's cases: a probe that ran while another job held a core or the memory bus
 * reads low, and a step would then seem to beat its machine. */
void pd_bench_ceilings_raise(pd_pool *pool, int threads, int quick, struct pd_bench_ceilings *c,
                             const char **int8_probe, double *bw_cpu);

/* What a step reads and runs, and the least time that takes (see bench/bound.c's equation). */
struct pd_bench_bound {
    double dense_bytes, dense_s;     /* the dense matrices and vectors: bytes read, least seconds */
    double expert_bytes, expert_s;   /* the routed experts the step read: bytes, least seconds */
    double int8_ops;                 /* int8 ops (multiply + add) of the int8 products: the GEMM part's work */
    double bytes, bw_s, bound_s;     /* all bytes; their time at the bandwidth alone; the bound */
};

/* The bound of one step of `tokens` tokens of which `heads` go through the output head (a decode
 * step's every token; a prefill's last token per sequence), whose routing read `experts` distinct
 * (layer, routed expert) and ran `pairs` (token, expert) pairs, on the ceilings c. */
void pd_bench_step_bound(const struct pd_engine *en, double tokens, double heads, double experts, double pairs,
                         const struct pd_bench_ceilings *c, struct pd_bench_bound *b);

/* The routing of the steps run since `before` was copied from en->expert_tokens ([n_layers x
 * routed experts] counts, the MTP layer left out): *experts the (layer, expert) that ran a token,
 * *pairs the (token, expert) pairs, both counted from the engine's own per-expert token counts. */
void pd_bench_routed_since(const struct pd_engine *en, const int64_t *before, double *experts, double *pairs);

#endif

/* The engine's step profile: wall time of each part of a step, for `pdmoe bench prefill`. Off by
 * default, and then every hook is one test of en->prof.on.
 *
 * Parts are exclusive: a step's time is split between
 *   GEMM      every int8 matrix product (pd_gemm, pd_gemm_grouped: kernels/gemm.h's counter for
 *             the calling thread), wherever it runs: projections, experts, the head;
 *   attention pd_attention_layer without its GEMMs (attention, compressors, indexer, rope, ...);
 *   MoE       pd_moe_layer without its GEMMs and exchange (routing, SwiGLU, weighted sums, ...);
 *   exchange  expert parallelism's dispatch and combine (en->experts_fn) without its GEMMs;
 *   other     the rest of the step (embedding, mHC, norms, quantising the layer input, ...).
 * A hook pair enters and leaves a part; time between transitions is charged to the innermost part
 * entered, less the GEMM time its thread added meanwhile, which goes to GEMM.
 *
 * Inside those parts, three pieces where a prefill's time mostly goes, so that the next bottleneck
 * shows (each within one or more parts, so they are not added to them):
 *   gemm_routed_experts  the experts' int8 products (routed and shared: pd_gemm_grouped in
 *                        moe.c's run_experts), within GEMM;
 *   float_products       every bf16 / fp32 matrix product (engine/linear.h's counter: the
 *                        attention's projections, the router, the head), within attention, MoE
 *                        and other;
 *   attention_heads      the attention's token chunks: their keys gathered, the indexer's scores
 *                        and choice, each head's scores, softmax and values, within attention. */
#ifndef PD_ENGINE_PROF_H
#define PD_ENGINE_PROF_H

#include <stdint.h>

#include "core/timing.h"
#include "engine/linear.h"
#include "kernels/gemm.h"

enum pd_prof_part { PD_PROF_GEMM, PD_PROF_ATTENTION, PD_PROF_MOE, PD_PROF_EXCHANGE, PD_PROF_OTHER, PD_PROF_N };

#define PD_PROF_DEPTH 8

enum pd_prof_detail { PD_PROF_EXPERTS_GEMM, PD_PROF_FLOAT, PD_PROF_HEADS, PD_PROF_DETAIL_N };

/* The pieces' names as the benchmarks print them (JSON keys). */
static inline const char *pd_prof_detail_name(enum pd_prof_detail d)
{
    static const char *const names[PD_PROF_DETAIL_N] = {"gemm_routed_experts", "float_products", "attention_heads"};
    return names[d];
}

/* The parts' names as the benchmarks print them (JSON keys). */
static inline const char *pd_prof_part_name(enum pd_prof_part part)
{
    static const char *const names[PD_PROF_N] = {"gemm", "attention", "moe", "exchange", "other"};
    return names[part];
}

struct pd_prof {
    int on;                      /* set by pd_prof_enable */
    int depth;                   /* parts entered; stack[depth] is charged now */
    int stack[PD_PROF_DEPTH];
    int64_t mark, gemm_mark;     /* time and GEMM counter at the last transition */
    int64_t ns[PD_PROF_N];       /* accumulated since the last pd_prof_enable */
    struct pd_call_clock piece[PD_PROF_DETAIL_N];   /* the pieces, likewise: the experts' products and
                                                       the heads clocked as regions (on while profiling),
                                                       the float products from linear.h's clock */
    int64_t float_mark;          /* linear.h's float clock at the last transition */
    int64_t steps;               /* steps profiled */
};

/* Starts (on = 1, counters zeroed) or stops profiling on the calling thread, the one that runs
 * the engine's steps. */
static inline void pd_prof_enable(struct pd_prof *p, int on)
{
    *p = (struct pd_prof){.on = on};
    for (int d = 0; d < PD_PROF_DETAIL_N; d++)
        p->piece[d].on = on;
    pd_gemm_clock()->on = on;
    pd_linear_clock()->on = on;
}

static inline void pd_prof_charge(struct pd_prof *p)
{
    int64_t t = pd_now_ns(), g = pd_gemm_clock()->ns, f = pd_linear_clock()->ns;
    p->ns[PD_PROF_GEMM] += g - p->gemm_mark;
    p->ns[p->stack[p->depth]] += (t - p->mark) - (g - p->gemm_mark);
    p->piece[PD_PROF_FLOAT].ns += f - p->float_mark;
    p->mark = t;
    p->gemm_mark = g;
    p->float_mark = f;
}

/* A step starts: its time is "other" until a part is entered. */
static inline void pd_prof_step_begin(struct pd_prof *p)
{
    if (!p->on)
        return;
    p->depth = 0;
    p->stack[0] = PD_PROF_OTHER;
    p->mark = pd_now_ns();
    p->gemm_mark = pd_gemm_clock()->ns;
    p->float_mark = pd_linear_clock()->ns;
}

static inline void pd_prof_step_end(struct pd_prof *p)
{
    if (!p->on)
        return;
    pd_prof_charge(p);
    p->steps++;
}

static inline void pd_prof_enter(struct pd_prof *p, enum pd_prof_part part)
{
    if (!p->on || p->depth + 1 >= PD_PROF_DEPTH)
        return;
    pd_prof_charge(p);
    p->stack[++p->depth] = part;
}

static inline void pd_prof_leave(struct pd_prof *p)
{
    if (!p->on || p->depth == 0)
        return;
    pd_prof_charge(p);
    p->depth--;
}

#endif

/* W8A8 int8 matrix products, the engine's only matmul:
 *   y[t][o] = a_scale[t] * w_scale[o] * sum_i a[t][i] * w[o][i]
 * with the sum in exact int32 arithmetic and one fp32 epilogue shared by every implementation, so
 * all of them give bit-identical outputs. T = 1 is the decode GEMV, T > 1 the prefill GEMM, and the
 * grouped form runs the routed experts of a MoE layer on the tokens gathered for each.
 *
 * Implementations (chosen at run time, first use): the portable reference (gemm_ref.c, the tests'
 * oracle), AVX2 (gemm_avx2.c), AVX-512 VNNI (gemm_avx512.c) and AMX-INT8 tiles (gemm_amx.c, where
 * the CPU and the OS allow them), the best one available. amx-emu runs the AMX kernel's loops on a
 * software model of the tiles, for testing it on CPUs without AMX; it is never chosen by itself.
 * PDMOE_KERNEL=ref|avx2|avx512|amx|amx-emu in the environment, or pd_gemm_kernel_set, overrides
 * the choice.
 *
 * Threading: pass a pd_pool (NULL = the calling thread only). Output rows are split into blocks
 * whose size depends only on the shape, so results never depend on the thread count. */
#ifndef PD_KERNELS_GEMM_H
#define PD_KERNELS_GEMM_H

#include <stdint.h>

#include "core/err.h"
#include "core/threadpool.h"
#include "core/timing.h"

/* An int8 matrix with one fp32 scale per row: weights [out, in] (per output channel) or
 * quantised activations [T, in] (per token, from pd_quant_rows). */
typedef struct pd_qmat {
    const int8_t *q;       // [rows, cols], row-major, contiguous
    const float *scale;    // [rows]
    int rows, cols;
} pd_qmat;

/* Largest reduction length: |sum| <= cols * 128 * 128 must fit in int32 (2^30 here; real
 * models stay below 2^15). */
#define PD_GEMM_MAX_IN 65536

enum pd_gemm_flags {
    PD_GEMM_ACCUM = 1,     /* y += result instead of y = result */
};

/* One routed expert of the grouped form: its weights and the activation rows sent to it. */
typedef struct pd_gemm_group {
    pd_qmat w;             // [out, in] the expert's weights (out may differ between groups)
    const int32_t *rows;   // [n] rows of the activation matrix routed to this expert
    int n;                 // may be 0
    float *y;              // [n, w.rows]: y[j] is the output for activation row rows[j]
} pd_gemm_group;

typedef enum pd_kernel {
    PD_KERNEL_REF = 0,     /* portable C */
    PD_KERNEL_AVX2 = 1,    /* AVX2: int8 widened to int16, vpmaddwd */
    PD_KERNEL_AVX512 = 2,  /* AVX-512 VNNI: vpdpbusd */
    PD_KERNEL_AMX = 3,     /* AMX-INT8: tdpbssd on 16 x 64-byte tiles */
    PD_KERNEL_AMX_EMU = 4, /* the AMX kernel on a C model of the tiles (tests; slow) */
    PD_KERNEL_COUNT
} pd_kernel;

/* y = w * a^T as above: y[t][o] for t < a->rows, o < w->rows; needs a->cols == w->cols.
 * Returns 0, PD_EINVAL (shapes, NULL pointers, a bad PDMOE_KERNEL) or PD_ERANGE (cols). */
int pd_gemm(pd_pool *pool,
            const pd_qmat *w,  // [out, in]
            const pd_qmat *a,  // [T, in]
            float *y,          // [T, out]
            int flags, pd_err *err);

/* Every group g: g.y[j] = g.w * a[g.rows[j]] for j < g.n. Work is spread over the pool by
 * (group, block of output rows); each output is computed exactly as pd_gemm would compute it. */
int pd_gemm_grouped(pd_pool *pool,
                    const pd_qmat *a,              // [T, in] all tokens of the layer
                    const pd_gemm_group *groups,   // [n_groups]
                    int n_groups, int flags, pd_err *err);

/* The calling thread's clock of its pd_gemm and pd_gemm_grouped calls (core/timing.h), for the
 * engine's step profile: off by default. */
struct pd_call_clock *pd_gemm_clock(void);

/* The implementation pd_gemm uses now: PDMOE_KERNEL if set (and valid), else the best the CPU
 * supports. Returns 0 or PD_EINVAL when PDMOE_KERNEL names an unknown or unsupported kernel;
 * the CLI calls it once at start-up to report that. */
int pd_gemm_kernel_get(pd_kernel *k, pd_err *err);

/* Forces an implementation for this process (tests, benchmarks); PD_EINVAL if the CPU lacks it. */
int pd_gemm_kernel_set(pd_kernel k, pd_err *err);

/* 1 if this CPU (and OS) can run kernel k. */
int pd_gemm_kernel_supported(pd_kernel k);

/* The AMX peak probe (benchmarks): 4 x iters TDPBSSD on tiles already loaded, each 16 x 16 x 64
 * multiply-adds (PD_GEMM_AMX_OPS int8 ops), on the calling thread. -1 where the AMX kernel is not
 * supported, without running anything. */
#define PD_GEMM_AMX_OPS (2.0 * 16 * 16 * 64)
int pd_gemm_amx_probe(uint64_t iters);

/* "ref", "avx2", "avx512", "amx", "amx-emu". */
const char *pd_gemm_kernel_name(pd_kernel k);

/* Parses a name as above; PD_EINVAL if unknown. */
int pd_gemm_kernel_parse(const char *name, pd_kernel *k, pd_err *err);

#endif

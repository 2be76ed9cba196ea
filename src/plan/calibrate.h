/* Fitting the performance model's CPU overheads to measured engine steps (`pdmoe calibrate`).
 *
 * The GEMM factor comes from a kernel measurement; what a roofline cannot see on a CPU (the
 * per-step cost, the per-token non-GEMM work of each layer: norms, rope, mHC, routing, activation
 * quantisation) is fitted by non-negative least squares per role (prefill and decode steps run
 * different code paths), with one more factor each, where it shows:
 *   prefill  measured_i = G_i + step_s + token_layer_s * T_i * L + A_i / attention
 *   decode   measured_i = C_i + step_s + token_layer_s * T_i * L + W_i / memory
 * G_i is the model's GEMM time of step i, A_i its attention time at factor 1, C_i its GEMM
 * arithmetic and attention (at the prefill's factor), W_i its weight bytes over the bandwidth
 * (the decode's small expert matrices stream slower than one long GEMV), T_i its tokens and L
 * the layers with a KV cache. */
#ifndef PD_PLAN_CALIBRATE_H
#define PD_PLAN_CALIBRATE_H

#include <stdint.h>

#include "core/err.h"
#include "plan/plan.h"

struct pd_calib_point {
    enum pd_role role;
    int64_t seqs, tokens, ctx;   /* as pd_perf_step takes them */
    double measured_s;
    double fitted_s;             /* filled by pd_calib_fit */
};

struct pd_calib_fit {
    double step_s, token_layer_s, attention, memory;
    double rms_rel;              /* root mean square of (fitted - measured) / measured */
};

/* p: a plan of the model on the hardware with the kernel factors set and attention = 1,
 * step and token costs 0. The points are steps of one role. attention == 0: the prefill fit
 * (attention fitted, memory kept from p); attention > 0: the decode fit (attention fixed at
 * that, memory fitted). Needs at least 3 points. */
int pd_calib_fit(const struct pd_plan *p, struct pd_calib_point *pts, int n, double attention,
                 struct pd_calib_fit *f, pd_err *e);

#endif

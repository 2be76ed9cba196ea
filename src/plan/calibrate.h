/* Fitting the performance model's CPU overheads to measured engine steps (`pdmoe calibrate`).
 *
 * The GEMM and memory factors come from kernel measurements; what a roofline cannot see on a
 * CPU (the per-step cost, the per-token non-GEMM work of each layer: norms, rope, mHC, routing,
 * activation quantisation) and the attention factor are fitted by non-negative least squares:
 *   measured_i = G_i + step_s + token_layer_s * T_i * L + A_i / attention
 * (per role: prefill and decode steps run different code paths)
 * where G_i is the model's GEMM time of step i, A_i its attention time at factor 1, T_i its
 * tokens and L the layers with a KV cache. */
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
    double step_s, token_layer_s, attention;
    double rms_rel;              /* root mean square of (fitted - measured) / measured */
};

/* p: a plan of the model on the hardware with the kernel factors set and attention = 1,
 * step and token costs 0. The points are steps of one role (each role has its own step and
 * token costs). attention > 0 fixes that factor (the decode fit takes the prefill's, where
 * attention's arithmetic is visible), 0 fits it too. Needs at least 3 points. */
int pd_calib_fit(const struct pd_plan *p, struct pd_calib_point *pts, int n, double attention,
                 struct pd_calib_fit *f, pd_err *e);

#endif

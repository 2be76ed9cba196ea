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

/* The same points measured in several rounds, t[round * n + point] seconds (a round measures
 * every point once, so a burst of load slows a round, not one point's every sample).
 *   - A round's level is the median over the points of its time over the point's reference,
 *     the point's second-fastest time over the rounds (its fastest with fewer than 3 rounds):
 *     not the fastest, which one lucky round holds for most points (the CPU ran faster once),
 *     and against which every other round of an idle machine read as busy.
 *   - A round whose level exceeds PD_CALIB_BUSY is a busy round, and one below PD_CALIB_FAST a
 *     fast one; both are left out. The fit is made on each point's fastest time over the kept
 *     rounds (load only ever adds time), and again with each kept round left out in turn (a
 *     jackknife: does any one round carry the fit?). A fast round would carry it: left out, the
 *     fit moves by its lead, so the bound on that lead is the one on the fit's spread.
 *   - How well the data determine the model: `spread`, the largest share of a step's measured
 *     time by which those leave-one-out fits disagree on that step's time. Above
 *     PD_CALIB_DETERMINED the fit is undetermined, and bit k of `undetermined` names the factors
 *     whose own range moves some step by more than that (moved[k]; k: 0 per-step cost, 1
 *     per-token cost, 2 the role's factor), all three if none does alone. Factors that trade
 *     against each other while the times they predict agree leave the fit determined.
 * Fewer than 2 kept rounds, or fewer than 2 leave-one-out fits, leave everything
 * undetermined, and so does a fit on the fastest times whose rms error exceeds PD_CALIB_MAX_RMS
 * (the model does not describe those steps). Fills pts[i].measured_s with the fastest time of
 * the kept rounds (of all rounds if none is kept) and pts[i].fitted_s. At most 64 rounds. */
#define PD_CALIB_BUSY 1.15
#define PD_CALIB_FAST (1 / (1 + PD_CALIB_DETERMINED))
#define PD_CALIB_DETERMINED 0.10
#define PD_CALIB_MAX_RMS 0.20
struct pd_calib_rounds {
    struct pd_calib_fit fit;      /* on the fastest times */
    struct pd_calib_fit lo, hi;   /* each factor's range over the leave-one-out fits */
    int rounds, kept, fitted;     /* rounds measured, not busy, and leave-one-out fits made */
    double slowest;               /* the highest level of a kept round, e.g. 1.04 */
    double level[64];             /* each round's level */
    unsigned char keep[64];       /* 1: round k kept */
    double spread;
    double moved[3];
    int undetermined;
};
int pd_calib_fit_rounds(const struct pd_plan *p, struct pd_calib_point *pts, int n, const double *t, int rounds,
                        double attention, struct pd_calib_rounds *r, pd_err *e);

#endif

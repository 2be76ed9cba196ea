/* oneDNN's int8 and fp32 matmuls, the same-run anchors of `pdmoe bench kernels` (linked into the
 * benchmarks and the tests only, never into the engine):
 *   y[t][o] = sum_i a[t][i] * w[o][i]                     (PD_ONEDNN_S32: exact int32)
 *   y[t][o] = w_scale[o] * (float)sum_i a[t][i] * w[o][i] (PD_ONEDNN_F32: oneDNN's own epilogue)
 * with a and w signed int8 in pdmoe's layouts (a [T, in], w [out, in], row-major). The weights are
 * reordered once, at creation, into the layout oneDNN prefers (as a checkpoint converted ahead of
 * time would be), so the timed call is oneDNN's best case. oneDNN 2.6 in Debian runs on OpenMP
 * threads: pd_onednn_threads sets how many. */
#ifndef PD_BENCH_ONEDNN_H
#define PD_BENCH_ONEDNN_H

#include <stdint.h>

#include "core/err.h"

typedef struct pd_onednn_mm pd_onednn_mm;

enum pd_onednn_dst { PD_ONEDNN_S32 = 0, PD_ONEDNN_F32 = 1 };

/* A matmul of T activation rows by the weights w ([out, in], copied: w may be freed after).
 * w_scale ([out]) is needed for PD_ONEDNN_F32 only. Returns 0 or PD_EINVAL / PD_ENOMEM with
 * oneDNN's status named in the message. */
int pd_onednn_mm_create(int T, int out, int in, const int8_t *w, const float *w_scale,
                        enum pd_onednn_dst dst, pd_onednn_mm **mm, pd_err *err);

/* The fp32 matmul y[t][o] = sum_i a[t][i] * w[o][i], all fp32 (the anchor of the engine's float
 * products), weights reordered likewise. */
int pd_onednn_mm_create_f32(int T, int out, int in, const float *w, pd_onednn_mm **mm, pd_err *err);

/* y = the product above for activations a ([T, in], int8 or fp32 as created); y is [T, out]
 * int32 or float. */
int pd_onednn_mm_run(pd_onednn_mm *mm, const void *a, void *y, pd_err *err);

void pd_onednn_mm_free(pd_onednn_mm *mm);

/* OpenMP threads oneDNN uses from now on (in this process). */
void pd_onednn_threads(int n);

/* "2.6.3" or so: the library's run-time version. */
const char *pd_onednn_version(void);
/* Whether oneDNN's int8 products are exact here: with VNNI or AMX. Without them it multiplies with
 * vpmaddubsw, whose sums of two products saturate at 16 bits ("Nuances of int8 computations"). */
int pd_onednn_int8_exact(void);

#endif

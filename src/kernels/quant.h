/* Symmetric per-row int8 quantisation: activations per token at run time, weights per output
 * channel in the checkpoint generator. Both use the same rule, so one function serves both:
 *   scale = max_i |x[i]| / 127,  q[i] = clamp(round(x[i] / scale), -127, 127),  scale 0 -> q = 0
 * round() is round-to-nearest, ties to even (as numpy.round and torch.round), the CPU's default
 * rounding, which keeps the loop vectorisable. -128 is never produced, so a row and its negation
 * quantise symmetrically. Inputs must be finite. */
#ifndef PD_KERNELS_QUANT_H
#define PD_KERNELS_QUANT_H

#include <stdint.h>

#include "core/threadpool.h"

/* Quantises `rows` rows of `cols` floats. */
void pd_quant_rows(const float *x,   // [rows, cols]
                   int rows, int cols,
                   int8_t *q,        // [rows, cols]
                   float *scales);   // [rows]

/* The same, rows split over the pool (NULL: the calling thread) in blocks of a fixed size: each
 * row is quantised exactly as pd_quant_rows does it, so the bytes never depend on the threads.
 * Small inputs (under PD_QUANT_SERIAL_VALUES values) run on the calling thread: a pool run costs
 * more than they do. A prefill step's quantisation was otherwise one thread's work beside a
 * 2-thread GEMM (7% of it). */
#define PD_QUANT_SERIAL_VALUES (1 << 16)
void pd_quant_rows_pool(pd_pool *pool,
                        const float *x,   // [rows, cols]
                        int rows, int cols,
                        int8_t *q,        // [rows, cols]
                        float *scales);   // [rows]

/* The same rule applied to an fp32 weight matrix [out, in], one scale per output row, in the
 * layout pdmoe checkpoints store (int8 `weight` + fp32 `weight_scale`). */
void pd_quant_weights(const float *w, // [out, in]
                      int out, int in,
                      int8_t *q,      // [out, in]
                      float *scales); // [out]

/* x[r][i] = q[r][i] * scales[r]: the inverse, for tests and diagnostics. */
void pd_dequant_rows(const int8_t *q,      // [rows, cols]
                     const float *scales,  // [rows]
                     int rows, int cols,
                     float *x);            // [rows, cols]

#endif

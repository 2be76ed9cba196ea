/* Internal to kernels/: pd_gemm_store's arithmetic on 16 outputs at once, for the AVX-512 kernels
 * whose sums end in registers or whose output is large (the AMX kernels' epilogue, the AVX-512
 * prefill GEMM of gemm_vnni.c). Each output is rounded as pd_gemm_store rounds it (there in lanes
 * of four, here of sixteen): (a_scale * w_scale) first, then times the sum, then added to y when
 * accumulating; the odd-shape tests of the AMX and VNNI kernels compare the two bit for bit. */
#ifndef PD_KERNELS_GEMM_STORE_AVX512_H
#define PD_KERNELS_GEMM_STORE_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#include "kernels/gemm_impl.h"

/* y[t][ob + r] (+)= (a_scale[t] * w_scale[ob + r]) * (float)acc[r] for r < nr (<= 16). With
 * job->y_stream a whole aligned line goes past the caches (a non-temporal store: gemm.c's
 * task_rows fences before the task ends). */
static inline __attribute__((target("avx512f"), always_inline)) void pd_gemm_store16(const pd_gemm_job *job, int t,
                                                                                   int ob, int nr, __m512i acc)
{
    const __mmask16 m = (__mmask16)((1u << nr) - 1);
    float *y = job->y + (int64_t)t * job->out + ob;
    const __m512 as = _mm512_set1_ps(job->a_scale[pd_gemm_job_tok(job, t)]);
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(as, _mm512_maskz_loadu_ps(m, job->w_scale + ob)), _mm512_cvtepi32_ps(acc));
    if (job->accum)
        v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, y), v);
    if (job->y_stream && nr == 16 && !((uintptr_t)y & 63))
        _mm512_stream_ps(y, v);
    else
        _mm512_mask_storeu_ps(y, m, v);
}

#endif

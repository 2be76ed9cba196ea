/* Portable reference GEMM: one int32 dot product per output, nothing clever. It is the oracle the
 * tests hold the SIMD paths to, so it must stay obviously right rather than fast. */
#include <stddef.h>

#include "kernels/gemm_impl.h"

void pd_gemm_rows_ref(const pd_gemm_job *job, int o0, int o1)
{
    for (int i = 0; i < job->n; i++) {
        const int8_t *a = pd_gemm_job_arow(job, i);   // [in]
        for (int o = o0; o < o1; o++) {
            const int8_t *w = job->w + (int64_t)o * job->in;   // [in]
            int32_t acc = 0;
            for (int k = 0; k < job->in; k++)
                acc += (int32_t)w[k] * (int32_t)a[k];
            pd_gemm_store(job, i, 1, o, 1, &acc, 1);
        }
    }
}

/* Internal to kernels/: what gemm.c hands to each implementation. An implementation computes the
 * exact int32 dot products of a rectangle of outputs however it likes and passes each tile to
 * pd_gemm_store, the one fp32 epilogue, compiled once in gemm.c without target flags so that no
 * implementation can fuse or reorder it differently. */
#ifndef PD_KERNELS_GEMM_IMPL_H
#define PD_KERNELS_GEMM_IMPL_H

#include <stdint.h>

/* Reduction bytes per K block of the AVX-512 GEMM (gemm_avx512.c); gemm.c sizes that kernel's
 * row blocks by it. A multiple of 64. */
#ifndef PD_GEMM_KBLOCK
#define PD_GEMM_KBLOCK 4096
#endif

/* One weight matrix applied to a list of activation rows. */
typedef struct pd_gemm_job {
    const int8_t *w;        // [out, in]
    const float *w_scale;   // [out]
    int out, in;
    const int8_t *a;        // [T, in] the whole activation matrix
    const float *a_scale;   // [T]
    const int32_t *tok;     // [n] activation rows used, in order; NULL = rows 0 .. n-1
    int n;
    float *y;               // [n, out]
    int accum;              // 1: y += result
    const int8_t *w_next;   // [next_out, in] the weights read after these (a hint for prefetching), or NULL
    int next_out;
    const int8_t *apack;    // the AMX kernels' packed activations (pd_gemm_amx_pack), else NULL
} pd_gemm_job;

static inline int pd_gemm_job_tok(const pd_gemm_job *j, int i)
{
    return j->tok ? j->tok[i] : i;
}

static inline const int8_t *pd_gemm_job_arow(const pd_gemm_job *j, int i)
{
    return j->a + (int64_t)pd_gemm_job_tok(j, i) * j->in;
}

/* Computes y[i][o] for every i < job->n and o0 <= o < o1. */
typedef void (*pd_gemm_rows_fn)(const pd_gemm_job *job, int o0, int o1);

void pd_gemm_rows_ref(const pd_gemm_job *job, int o0, int o1);
void pd_gemm_rows_avx2(const pd_gemm_job *job, int o0, int o1);
void pd_gemm_rows_avx512(const pd_gemm_job *job, int o0, int o1);
void pd_gemm_rows_amx(const pd_gemm_job *job, int o0, int o1);
void pd_gemm_rows_amx_emu(const pd_gemm_job *job, int o0, int o1);

/* The AMX kernels (gemm_amx.c) read the activations packed into tiles: for a job of at least
 * PD_GEMM_AMX_MIN_TOKENS tokens, gemm.c fills job->apack (pd_gemm_amx_pack_bytes(n, in) bytes, 64-
 * byte aligned) by calling pd_gemm_amx_pack for every block of 16 tokens tb < ceil(n / 16) before
 * any row task runs. Fewer tokens need no packing (the kernels pass them to another path). */
#define PD_GEMM_AMX_MIN_TOKENS 4
size_t pd_gemm_amx_pack_bytes(int n, int in);
void pd_gemm_amx_pack(const pd_gemm_job *job, int tb, int8_t *dst);
/* The amx-emu model of TDPBSSD on full 16 x 64-byte tiles: c [16][16] int32 += a [16][64] . b [16][64]
 * (gemm_amx.c gives the equation). */
void pd_gemm_amx_emu_dpbssd(int32_t *c, const int8_t *a, const int8_t *b);
/* 1 if the CPU has AMX-TILE and AMX-INT8 and the OS granted this process the tile state. */
int pd_gemm_amx_available(void);

/* The epilogue: for u < nu and r < nr,
 *   y[i0 + u][o0 + r] (+)= (a_scale[tok(i0 + u)] * w_scale[o0 + r]) * (float)acc[u * ldacc + r] */
void pd_gemm_store(const pd_gemm_job *job, int i0, int nu, int o0, int nr,
                   const int32_t *acc,  // [nu, ldacc]
                   int ldacc);

#endif

/* Internal to kernels/: what gemm.c hands to each implementation. An implementation computes the
 * exact int32 dot products of a rectangle of outputs however it likes and passes each tile to
 * pd_gemm_store, the one fp32 epilogue, compiled once in gemm.c without target flags so that no
 * implementation can fuse or reorder it differently (the AMX kernels and the AVX-512 prefill GEMM
 * use its 16-lane form, pd_gemm_store16 of gemm_store_avx512.h: the same operations in the same
 * order, as explicit multiplies and adds, which the tests compare bit for bit). */
#ifndef PD_KERNELS_GEMM_IMPL_H
#define PD_KERNELS_GEMM_IMPL_H

#include <stddef.h>
#include <stdint.h>

/* One weight matrix applied to a list of activation rows. */
typedef struct pd_gemm_job {
    const int8_t *w;        // [out, in]
    const float *w_scale;   // [out]
    int out, in;
    const int8_t *a;        // [T, in] the whole activation matrix
    const float *a_scale;   // [T]
    const int32_t *a_sum;   // [T] sum of each activation row (AVX-512 GEMM, n > 1; else NULL)
    const uint8_t *a_packed; // the n rows used, packed by pd_gemm_tw_pack (AVX-512, 24 < n <= 96), or NULL
    const int32_t *tok;     // [n] activation rows used, in order; NULL = rows 0 .. n-1
    int n;
    float *y;               // [n, out]
    int accum;              // 1: y += result
    const int8_t *w_next;   // [next_out, in] the weights read after these (a hint for prefetching), or NULL
    int next_out;
    const int8_t *apack;    // the AMX kernels' packed activations (pd_gemm_amx_pack), else NULL
    int y_stream;           // 1: the AMX kernels and the AVX-512 prefill GEMM (gemm_vnni.c) write
                            // whole aligned 64-byte lines of y with non-temporal stores
                            // (gemm.c: a product's output past PD_GEMM_STREAM_Y_BYTES; its
                            // task_rows fences them when the task ends)
} pd_gemm_job;

/* Outputs of at least this many bytes in one call (a prefill's: 1,024 tokens x 1,024 values are
 * 4 MiB; all the routed experts' gate outputs of a 1,024-token layer 7 MiB) are written past the
 * caches by the AMX kernels: each line of y a plain store writes is first read from memory (its
 * read for ownership), as much traffic as the line itself, while the expert weights' stream is
 * what bounds those products. Measured on a Xeon with AMX (2 cores): experts' shapes (256 x 512,
 * 24 tokens each, weights and outputs from memory) 8.4 -> 9.7 GB/s of weights on one thread;
 * bench prefill of v4-flash-mini, three rounds alternating the two builds, 1 thread 512 / 1,024 /
 * 2,048 tokens 1,838-1,880 / 1,956-1,978 / 1,942-1,988 -> 1,890-1,952 / 2,032-2,160 / 2,063-2,128
 * tokens/s, 2 threads 3,398-3,513 / 3,579-3,743 / 3,606-3,740 -> 3,572-3,685 / 3,745-4,010 /
 * 3,921-4,010. Under it (a decode batch's few rows, a short chunk) the output stays in the caches
 * for its reader, and plain stores keep it there. The AVX-512 prefill GEMM (gemm_vnni.c) streams
 * the same way (its share in the 2048 x 4096 x 512 GEMM on the AMX Xeon's VNNI path: pd_gemm_store's
 * 7% of the time measured); the other kernels ignore job->y_stream. */
#define PD_GEMM_STREAM_Y_BYTES (INT64_C(1) << 20)

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

/* The AVX2 kernel takes this many tokens and more in its blocked path (gemm_avx2.c), which cuts
 * the reduction into chunks itself: gemm.c gives it 64-row tasks then. */
#define PD_GEMM_AVX2_BLOCK_MIN 4

void pd_gemm_rows_ref(const pd_gemm_job *job, int o0, int o1);
void pd_gemm_rows_avx2(const pd_gemm_job *job, int o0, int o1);
void pd_gemm_rows_avx512(const pd_gemm_job *job, int o0, int o1);
/* The same with the decode GEMV's short rows read as two streams (gemm_avx512.c's
 * rows_two_streams: measured on the AMX Xeon, whose kernels pass it their jobs of few tokens). */
void pd_gemm_rows_avx512_two_streams(const pd_gemm_job *job, int o0, int o1);
void pd_gemm_rows_amx(const pd_gemm_job *job, int o0, int o1);
void pd_gemm_rows_amx_emu(const pd_gemm_job *job, int o0, int o1);

/* The AMX kernels (gemm_amx.c) read the activations packed into tiles: for a job of at least
 * PD_GEMM_AMX_MIN_TOKENS tokens, gemm.c fills job->apack (pd_gemm_amx_pack_bytes(n, in) bytes, 64-
 * byte aligned) by calling pd_gemm_amx_pack for every block of 16 tokens tb < ceil(n / 16) before
 * any row task runs. Fewer tokens need no packing (the kernels pass them to another path). */
#define PD_GEMM_AMX_MIN_TOKENS 4
/* Whether the AMX kernels read a product's weights in place, one pass over each block of 16 rows
 * meeting its token blocks 5 at a time (gemm_amx_body.h), rather than copied into tiles by
 * reduction blocks: for at most 5 token blocks (80 tokens: a routed expert's), and for more where
 * the rows are at least 1 KiB and the packed activations, which every block of rows reads again,
 * stay within 1 MiB (in L2). The copies stalled on weights from memory: 64 matrices of 2048 x 4096
 * rotating over 512 MiB, 1 thread, on a Xeon with AMX, 96 / 128 / 160 / 256 tokens each: 856 /
 * 1,044 / 1,152 / 1,500 Gops/s copied, 1,729 / 1,842 / 1,931 / 1,906 in place (at 512 tokens,
 * 2 MiB of activations, 1,690 copied and 1,197 in place); one such matrix in the caches, 1,543 /
 * 1,688 / 1,707 / 1,823 copied and 2,060 / 2,277 / 2,231 / 2,049 in place. With 512-byte rows the
 * copied tiles stay in L1 and win past 128 tokens (512 x 512 x 512 tokens: 1,485 against 1,118),
 * with 14,336-byte rows the activations outgrow L2 (4096 x 14,336 x 128 tokens: 1,466 against
 * 1,197). gemm.c sizes the in-place tasks for it. */
#define PD_GEMM_AMX_GROUP_TB 5
#define PD_GEMM_AMX_IN_PLACE_MIN_IN 1024
#define PD_GEMM_AMX_IN_PLACE_PACK_BYTES ((size_t)1 << 20)
/* The packed activations' bytes: whole 1 KiB tiles, 16 tokens x 64 bytes each. */
static inline size_t pd_gemm_amx_pack_bytes(int n, int in)
{
    return (size_t)((n + 15) / 16) * (size_t)((in + 63) / 64) * 1024;
}
static inline int pd_gemm_amx_in_place(int n, int in)
{
    return (n + 15) / 16 <= PD_GEMM_AMX_GROUP_TB ||
           (in >= PD_GEMM_AMX_IN_PLACE_MIN_IN && pd_gemm_amx_pack_bytes(n, in) <= PD_GEMM_AMX_IN_PLACE_PACK_BYTES);
}
/* The reduction steps (64 bytes, one tile's width) of a panel, 512 bytes of every row: the packed
 * activations are stored panel by panel, in each panel token block by token block, in each token
 * block step by step. Tile (token block tb, step kb) of a job of n tokens and `in` bytes: */
#define PD_GEMM_AMX_KC 8
static inline int64_t pd_gemm_amx_tile_offset(int n, int in, int tb, int kb)
{
    const int ntb = (n + 15) / 16, nkb = (in + 63) / 64, p = kb / PD_GEMM_AMX_KC;
    const int np = nkb - p * PD_GEMM_AMX_KC < PD_GEMM_AMX_KC ? nkb - p * PD_GEMM_AMX_KC : PD_GEMM_AMX_KC;
    return ((int64_t)p * PD_GEMM_AMX_KC * ntb + (int64_t)tb * np + kb % PD_GEMM_AMX_KC) * 1024;
}
void pd_gemm_amx_pack(const pd_gemm_job *job, int tb, int8_t *dst);
/* The amx-emu model of TDPBSSD on full 16 x 64-byte tiles: c [16][16] int32 += a [16][64] . b [16][64]
 * (gemm_amx.c gives the equation). */
void pd_gemm_amx_emu_dpbssd(int32_t *c, const int8_t *a, const int8_t *b);
/* 1 if the CPU has AMX-TILE and AMX-INT8 and the OS granted this process the tile state. */
int pd_gemm_amx_available(void);

/* The AVX-512 kernel by the number of tokens n (pd_gemm_rows_avx512 dispatches): 1 the decode GEMV
 * (gemm_avx512.c), which also takes 2 .. PD_GEMM_FEW_MAX tokens on rows of at most
 * PD_GEMM_FEW_MAX_IN bytes (each weight byte loaded once for them all); up to PD_GEMM_TW_MAX the tokens packed once per call into job->a_packed
 * (pd_gemm_tw_pack) when pd_gemm_tw_bytes says so, pd_gemm_rows_tw (gemm_vnni_tw.c): from 2
 * tokens in the grouped form (routed experts, whose weights come from memory: this path
 * prefetches the next rows and the next expert's), from PD_GEMM_SMALL_MAX + 1 in the plain one;
 * below that, and for matrices of fewer than 16 rows, the inner product (gemm_avx512_small.c);
 * beyond PD_GEMM_TW_MAX the weights packed per task, which needs job->a_sum
 * (pd_gemm_row_sums_vnni: sums[i] = sum_k a[i][k] for r0 <= i < r1) (both gemm_vnni.c). */
#define PD_GEMM_FEW_MAX 3
#define PD_GEMM_FEW_MAX_IN 2048
#define PD_GEMM_SMALL_MAX 24
#define PD_GEMM_TW_MAX 96
void pd_gemm_rows_small(const pd_gemm_job *job, int o0, int o1);
void pd_gemm_rows_tw(const pd_gemm_job *job, int o0, int o1);    /* job->a_packed set */
void pd_gemm_rows_vnni(const pd_gemm_job *job, int o0, int o1);
void pd_gemm_row_sums_vnni(const int8_t *a,   // [rows, in]
                           int in, int r0, int r1,
                           int32_t *sums);    // [rows]

/* Few tokens (gemm_vnni_tw.c): the bytes pd_gemm_tw_pack writes for n rows of `in` bytes, 0 when
 * that path does not apply (see above; grouped: 1 for the grouped form); the pack of rows
 * tok[0 .. n) (NULL: 0 .. n-1) of a. */
size_t pd_gemm_tw_bytes(int n, int in, int grouped);
void pd_gemm_tw_pack(const int8_t *a,     // [rows, in]
                     int in, const int32_t *tok, int n,
                     uint8_t *ap);        // [pd_gemm_tw_bytes(n, in)]

/* The epilogue: for u < nu and r < nr,
 *   y[i0 + u][o0 + r] (+)= (a_scale[tok(i0 + u)] * w_scale[o0 + r]) * (float)acc[u * ldacc + r] */
void pd_gemm_store(const pd_gemm_job *job, int i0, int nu, int o0, int nr,
                   const int32_t *acc,  // [nu, ldacc]
                   int ldacc);

#endif

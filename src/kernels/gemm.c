/* W8A8 GEMM front: argument checks, the run-time choice of implementation, the static split of
 * output rows into pool tasks, the AMX kernels' activation packing, and the shared fp32 epilogue
 * (pd_gemm_store). The arithmetic lives in gemm_ref.c, gemm_avx2.c, gemm_avx512.c and gemm_amx.c. */
#include "kernels/gemm.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "core/timing.h"
#include "kernels/gemm_impl.h"

static const char *const kernel_names[PD_KERNEL_COUNT] = {"ref", "avx2", "avx512", "amx", "amx-emu"};

static const pd_gemm_rows_fn kernel_fns[PD_KERNEL_COUNT] = {
    pd_gemm_rows_ref,
    pd_gemm_rows_avx2,
    pd_gemm_rows_avx512,
    pd_gemm_rows_amx,
    pd_gemm_rows_amx_emu,
};

/* -1 until resolved; then a pd_kernel. Atomic because pd_gemm may be first called from several
 * threads at once; they all resolve to the same value. */
static atomic_int active_kernel = -1;

const char *pd_gemm_kernel_name(pd_kernel k)
{
    return (unsigned)k < PD_KERNEL_COUNT ? kernel_names[k] : "?";
}

int pd_gemm_kernel_parse(const char *name, pd_kernel *k, pd_err *err)
{
    for (int i = 0; i < PD_KERNEL_COUNT; i++) {
        if (name && strcmp(name, kernel_names[i]) == 0) {
            *k = (pd_kernel)i;
            return 0;
        }
    }
    return pd_err_set(err, PD_EINVAL, "unknown kernel '%s' (want ref, avx2, avx512, amx or amx-emu)",
                      name ? name : "(null)");
}

int pd_gemm_kernel_supported(pd_kernel k)
{
    __builtin_cpu_init();
    switch (k) {
    case PD_KERNEL_REF:
        return 1;
    case PD_KERNEL_AVX2:
        return __builtin_cpu_supports("avx2");
    case PD_KERNEL_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    case PD_KERNEL_AMX:
        return pd_gemm_amx_available();
    case PD_KERNEL_AMX_EMU:
        return 1;
    default:
        return 0;
    }
}

int pd_gemm_kernel_set(pd_kernel k, pd_err *err)
{
    if ((unsigned)k >= PD_KERNEL_COUNT)
        return pd_err_set(err, PD_EINVAL, "kernel %d out of range", (int)k);
    if (!pd_gemm_kernel_supported(k))
        return pd_err_set(err, PD_EINVAL, "kernel %s: not supported by this CPU",
                          kernel_names[k]);
    atomic_store(&active_kernel, (int)k);
    return 0;
}

int pd_gemm_kernel_get(pd_kernel *k, pd_err *err)
{
    int cur = atomic_load(&active_kernel);
    if (cur >= 0) {
        *k = (pd_kernel)cur;
        return 0;
    }
    const char *env = getenv("PDMOE_KERNEL");
    pd_kernel pick;
    if (env && *env) {
        /* A bad override is an error every time (never cached), not a silent fallback: a
         * benchmark that asked for avx512 must not quietly measure something else. */
        if (pd_gemm_kernel_parse(env, &pick, err) < 0)
            return pd_err_prefix(err, "PDMOE_KERNEL: ");
        if (!pd_gemm_kernel_supported(pick))
            return pd_err_set(err, PD_EINVAL, "PDMOE_KERNEL=%s: not supported by this CPU", env);
    } else if (pd_gemm_kernel_supported(PD_KERNEL_AMX)) {
        pick = PD_KERNEL_AMX;
    } else if (pd_gemm_kernel_supported(PD_KERNEL_AVX512)) {
        pick = PD_KERNEL_AVX512;
    } else if (pd_gemm_kernel_supported(PD_KERNEL_AVX2)) {
        pick = PD_KERNEL_AVX2;
    } else {
        pick = PD_KERNEL_REF;
    }
    int expected = -1;
    atomic_compare_exchange_strong(&active_kernel, &expected, (int)pick);
    *k = (pd_kernel)atomic_load(&active_kernel);
    return 0;
}

/* Output rows per pool task. It depends on the shape and the kernel only (never on the thread
 * count). AVX-512: 64, the prefill GEMM's micro-tile width (gemm_vnni.c blocks the reduction
 * itself). AMX: whole pairs of its 16-row tiles, 256 for the large matrices (every task reads the
 * packed activations once per reduction block, so fewer, taller tasks read them fewer times;
 * 2048 rows still make 8 tasks), fewer for small ones so that two threads share them, except
 * where the weights are read in place (pd_gemm_amx_in_place: a routed expert's few tokens), whose
 * one pass streams the weights and requests each next block of rows: 256 there, a task's last
 * block of rows ending its stream with an epilogue that nothing overlaps (prefill's experts of
 * v4-flash-mini, 256 x 512 and 512 x 256 with about 12 tokens each, weights from memory, six
 * rounds alternating: 9.33-9.54 GB/s of weights in tasks of 128 rows against 9.61-10.07 in tasks of
 * 256 at 1 thread, medians 18.8 and 19.6 at 2; 128 had been 1.02-1.09x tasks of 32 and 64 rows), 128
 * under PD_GEMM_AMX_MIN_TOKENS tokens (a decode step's GEMVs, which run on the AVX-512 kernel:
 * more tasks to share between threads). AVX2 on
 * PD_GEMM_AVX2_BLOCK_MIN tokens and more (n): 64, its blocked path cuts the reduction into chunks
 * itself. Others: the weight bytes a task reads per pass over the tokens (rows * in) within about
 * 256 KiB, so that they stay in L2 while every block of tokens passes over them. A multiple of 8, the GEMV kernels' row
 * block. */
static int rows_per_task(int out, int in, int n, pd_kernel k)
{
    if (k == PD_KERNEL_AVX512 || (k == PD_KERNEL_AVX2 && n >= PD_GEMM_AVX2_BLOCK_MIN))
        return 64;
    if (k == PD_KERNEL_AMX || k == PD_KERNEL_AMX_EMU) {   /* whole pairs of 16-row tiles (gemm_amx_body.h) */
        if (out >= 2048 || (pd_gemm_amx_in_place(n, in) && n >= PD_GEMM_AMX_MIN_TOKENS))
            return 256;
        return pd_gemm_amx_in_place(n, in) ? 128 : out >= 512 ? 64 : 32;
    }
    int rb = (256 * 1024 / in) & ~7;
    return rb < 8 ? 8 : rb > 64 ? 64 : rb;
}

#ifdef __SSE2__
/* Four outputs: y = (as * ws) * (float)acc, or y + that. */
static inline void store4(__m128 as, const float *ws, const int32_t *acc, float *y, int accum)
{
    __m128 v = _mm_mul_ps(_mm_mul_ps(as, _mm_loadu_ps(ws)),
                          _mm_cvtepi32_ps(_mm_loadu_si128((const __m128i *)acc)));
    if (accum)
        v = _mm_add_ps(_mm_loadu_ps(y), v);
    _mm_storeu_ps(y, v);
}
#endif

void pd_gemm_store(const pd_gemm_job *job, int i0, int nu, int o0, int nr, const int32_t *acc,
                   int ldacc)
{
    const float *ws = job->w_scale + o0;
    for (int u = 0; u < nu; u++) {
        float as = job->a_scale[pd_gemm_job_tok(job, i0 + u)];
        float *yr = job->y + (int64_t)(i0 + u) * job->out + o0;
        const int32_t *ar = acc + (int64_t)u * ldacc;
#ifdef __SSE2__
        /* Every output goes through store4, the tail too (via a padded copy), so that however an
         * implementation cuts its rows into calls, and whatever a compiler with FMA would fuse,
         * each output sees the same instructions. */
        const __m128 vas = _mm_set1_ps(as);
        int r = 0;
        for (; r + 4 <= nr; r += 4)
            store4(vas, ws + r, ar + r, yr + r, job->accum);
        if (r < nr) {
            float w4[4] = {0}, y4[4] = {0};
            int32_t a4[4] = {0};
            memcpy(w4, ws + r, (size_t)(nr - r) * sizeof *w4);
            memcpy(a4, ar + r, (size_t)(nr - r) * sizeof *a4);
            memcpy(y4, yr + r, (size_t)(nr - r) * sizeof *y4);
            store4(vas, w4, a4, y4, job->accum);
            memcpy(yr + r, y4, (size_t)(nr - r) * sizeof *y4);
        }
#else
        for (int r = 0; r < nr; r++) {
            float v = as * ws[r] * (float)ar[r];
            yr[r] = job->accum ? yr[r] + v : v;
        }
#endif
    }
}

static _Thread_local struct pd_call_clock gemm_clock;

struct pd_call_clock *pd_gemm_clock(void)
{
    return &gemm_clock;
}

static int check_qmat(const pd_qmat *m, const char *what, pd_err *err)
{
    if (!m)
        return pd_err_set(err, PD_EINVAL, "gemm: %s is NULL", what);
    if (m->rows < 0 || m->cols < 1)
        return pd_err_set(err, PD_EINVAL, "gemm: %s has shape [%d, %d]", what, m->rows, m->cols);
    if (m->cols > PD_GEMM_MAX_IN)
        return pd_err_set(err, PD_ERANGE, "gemm: %s has %d columns (int32 sums allow %d)", what,
                          m->cols, PD_GEMM_MAX_IN);
    if (m->rows > 0 && (!m->q || !m->scale))
        return pd_err_set(err, PD_EINVAL, "gemm: %s has no data or no scales", what);
    return 0;
}

struct plain_run {
    pd_gemm_job job;
    pd_gemm_rows_fn fn;
    int rb;
};

/* Rows [o0, o1) of a job by the kernel fn, as one pool task. The AMX kernels and the AVX-512
 * prefill GEMM write a large y with non-temporal stores (job->y_stream), which are weakly ordered:
 * fenced here, before the pool marks the task finished and another thread reads y. */
static void task_rows(pd_gemm_rows_fn fn, const pd_gemm_job *job, int o0, int o1)
{
    fn(job, o0, o1);
#ifdef __SSE2__
    if (job->y_stream)
        _mm_sfence();
#endif
}

static void plain_task(void *arg, int task)
{
    const struct plain_run *r = arg;
    int o0 = task * r->rb;
    int o1 = o0 + r->rb < r->job.out ? o0 + r->rb : r->job.out;
    task_rows(r->fn, &r->job, o0, o1);
}

/* A run of the pool costs well under a microsecond of hand-off while its workers are still
 * polling (tens of microseconds when they sleep), but its helpers then read the input from the
 * caller's cache and the caller waits for their last task: a product smaller than this many
 * multiply-adds runs on the calling thread. v4-flash-mini's wo_b at batch 1 (131,072) took 3.6 us
 * a run on one thread and 4.6 us over two (Zen 5 EPYC, `pdmoe generate`, 300 tokens); its wq_b
 * (262,144) and every product of V4-Flash are over. The split into tasks is the same either way,
 * so the result is too. */
#define PD_GEMM_SERIAL_MACS (INT64_C(1) << 18)

static int small_work(int64_t macs)
{
    return macs < PD_GEMM_SERIAL_MACS;
}

/* pd_gemm_job's y_stream for a call writing out_bytes of output (gemm_impl.h) */
static int stream_y(int flags, int64_t out_bytes)
{
    return !(flags & PD_GEMM_ACCUM) && out_bytes >= PD_GEMM_STREAM_Y_BYTES;
}

/* ---- the AMX kernels' packed activations (gemm_impl.h) ---- */

struct amx_pack_run {
    pd_gemm_job *jobs;
    const int *first;   // [n_jobs + 1] first pack task (block of 16 tokens) of each job
    int n_jobs;
};

/* Of n items whose tasks are numbered in order (first[i] the first of item i, nondecreasing), the
 * one that holds `task`: the last i with first[i] <= task (an item with no tasks has first[i] =
 * first[i + 1], so it is never the last such i). */
static int task_owner(const int *first, int n, int task)
{
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (first[mid] <= task)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

static void amx_pack_task(void *arg, int task)
{
    const struct amx_pack_run *r = arg;
    const int j = task_owner(r->first, r->n_jobs, task);
    pd_gemm_amx_pack(&r->jobs[j], task - r->first[j], (int8_t *)r->jobs[j].apack);
}

/* For kernel k, packs the activations of every job that the AMX kernels run on tiles, into one
 * allocation (*buf, NULL when nothing needed packing; the caller frees it), spread over the pool
 * by blocks of 16 tokens, and points each such job's apack at its part. A job reading the same
 * rows as the job before it (a routed expert's gate and up, w1 and w3) shares its part. */
/* Jobs that read the same activation rows: the same matrix, rows list and count. */
static int same_rows(const pd_gemm_job *a, const pd_gemm_job *b)
{
    return a->a == b->a && a->in == b->in && a->n == b->n && a->tok == b->tok;
}

/* A job the AMX kernels run on tiles, which reads packed activations. */
static int amx_packed(const pd_gemm_job *j)
{
    return j->n >= PD_GEMM_AMX_MIN_TOKENS && j->out > 0;
}

static int amx_pack(pd_pool *pool, pd_kernel k, pd_gemm_job *jobs, int n_jobs, void **buf, pd_err *err)
{
    *buf = NULL;
    if (k != PD_KERNEL_AMX && k != PD_KERNEL_AMX_EMU)
        return 0;
    size_t bytes = 0;
    int stack_first[65], *first = n_jobs < 65 ? stack_first : malloc(((size_t)n_jobs + 1) * sizeof *first);
    if (!first)
        return pd_err_set(err, PD_ENOMEM, "gemm: out of memory packing %d groups", n_jobs);
    first[0] = 0;
    for (int j = 0; j < n_jobs; j++) {
        const int own = amx_packed(&jobs[j]) && !(j > 0 && amx_packed(&jobs[j - 1]) && same_rows(&jobs[j], &jobs[j - 1]));
        bytes += own ? pd_gemm_amx_pack_bytes(jobs[j].n, jobs[j].in) : 0;
        first[j + 1] = first[j] + (own ? (jobs[j].n + 15) / 16 : 0);
    }
    int rc = 0;
    if (bytes > 0 && !(*buf = aligned_alloc(64, bytes)))   /* bytes is a multiple of 1 KiB */
        rc = pd_err_set(err, PD_ENOMEM, "gemm: out of memory for %zu bytes of packed activations", bytes);
    if (bytes > 0 && *buf) {
        int8_t *p = *buf;
        for (int j = 0; j < n_jobs; j++) {
            if (first[j + 1] > first[j]) {
                jobs[j].apack = p;
                p += pd_gemm_amx_pack_bytes(jobs[j].n, jobs[j].in);
            } else {
                jobs[j].apack = amx_packed(&jobs[j]) ? jobs[j - 1].apack : NULL;   /* the same rows as job j - 1 */
            }
        }
        struct amx_pack_run r = {jobs, first, n_jobs};
        pd_pool_run(small_work((int64_t)bytes * 64) ? NULL : pool, first[n_jobs], amx_pack_task, &r);
    }
    if (first != stack_first)
        free(first);
    return rc;
}

/* The AVX-512 GEMM's activation row sums (gemm_vnni.c), computed once per call, in blocks of
 * SUMS_ROWS rows over the pool. */
enum { SUMS_ROWS = 64 };

struct sums_run {
    const pd_qmat *a;
    int32_t *sums;
};

static void sums_task(void *arg, int task)
{
    const struct sums_run *r = arg;
    int r0 = task * SUMS_ROWS, r1 = r0 + SUMS_ROWS < r->a->rows ? r0 + SUMS_ROWS : r->a->rows;
    pd_gemm_row_sums_vnni(r->a->q, r->a->cols, r0, r1, r->sums);
}

/* *sums = the row sums of a, malloc'd (the caller frees): the AVX-512 GEMM beyond
 * PD_GEMM_TW_MAX tokens needs them. */
static int row_sums(pd_pool *pool, const pd_qmat *a, int32_t **sums, pd_err *err)
{
    if (!(*sums = malloc((size_t)a->rows * sizeof **sums)))
        return pd_err_set(err, PD_ENOMEM, "gemm: out of memory for %d row sums", a->rows);
    struct sums_run r = {a, *sums};
    pd_pool_run(small_work((int64_t)a->rows * a->cols * 64) ? NULL : pool, (a->rows + SUMS_ROWS - 1) / SUMS_ROWS,
                sums_task, &r);
    return 0;
}

static int gemm_run(pd_pool *pool, const pd_qmat *w, const pd_qmat *a, float *y, int flags, pd_err *err)
{
    int rc;
    if ((rc = check_qmat(w, "weights", err)) < 0 || (rc = check_qmat(a, "activations", err)) < 0)
        return rc;
    if (w->cols != a->cols)
        return pd_err_set(err, PD_EINVAL, "gemm: weights [%d, %d] do not fit activations [%d, %d]",
                          w->rows, w->cols, a->rows, a->cols);
    if (!y && w->rows > 0 && a->rows > 0)
        return pd_err_set(err, PD_EINVAL, "gemm: output is NULL");
    pd_kernel k;
    if ((rc = pd_gemm_kernel_get(&k, err)) < 0)
        return rc;
    if (w->rows == 0 || a->rows == 0)
        return 0;

    /* AVX-512 with 25-96 tokens: them packed once (gemm_vnni.c); more: their row sums */
    int32_t *sums = NULL;
    uint8_t *packed = NULL;
    size_t tw = k == PD_KERNEL_AVX512 ? pd_gemm_tw_bytes(a->rows, a->cols, 0) : 0;
    if (tw) {
        if (!(packed = malloc(tw)))
            return pd_err_set(err, PD_ENOMEM, "gemm: out of memory for %d packed rows", a->rows);
        pd_gemm_tw_pack(a->q, a->cols, NULL, a->rows, packed);
    } else if (k == PD_KERNEL_AVX512 && a->rows > PD_GEMM_TW_MAX && (rc = row_sums(pool, a, &sums, err)) < 0) {
        return rc;
    }
    struct plain_run r = {
        .job = {.w = w->q, .w_scale = w->scale, .out = w->rows, .in = w->cols,
                .a = a->q, .a_scale = a->scale, .a_sum = sums, .a_packed = packed, .tok = NULL, .n = a->rows, .y = y,
                .accum = (flags & PD_GEMM_ACCUM) != 0,
                .y_stream = stream_y(flags, (int64_t)w->rows * a->rows * 4)},
        .fn = kernel_fns[k],
        .rb = rows_per_task(w->rows, w->cols, a->rows, k),
    };
    void *apacked;
    if ((rc = amx_pack(pool, k, &r.job, 1, &apacked, err)) < 0) {
        free(sums);
        free(packed);
        return rc;
    }
    int n_tasks = (w->rows + r.rb - 1) / r.rb;
    pd_pool_run_even(small_work((int64_t)w->rows * w->cols * a->rows) ? NULL : pool, n_tasks, plain_task, &r);
    free(sums);
    free(packed);
    free(apacked);
    return 0;
}

/* The grouped form's packed groups: pk->at[g] = offset of group g's pack in pk->buf, SIZE_MAX
 * for a group that is not packed (then pk->need_sums). */
struct pack_run {
    const pd_qmat *a;
    const pd_gemm_group *groups;
    uint8_t *buf;
    size_t *at;
    int need_sums;
};

static void pack_task(void *arg, int g)
{
    const struct pack_run *p = arg;
    const pd_gemm_group *gr = &p->groups[g];
    if (p->at[g] != SIZE_MAX)
        pd_gemm_tw_pack(p->a->q, p->a->cols, gr->rows, gr->n, p->buf + p->at[g]);
}

static int pack_groups(pd_pool *pool, pd_kernel k, struct pack_run *p, int n_groups, pd_err *err)
{
    if (k != PD_KERNEL_AVX512) {
        p->need_sums = 0;
        return 0;
    }
    if (!(p->at = malloc((size_t)n_groups * sizeof *p->at)))
        return pd_err_set(err, PD_ENOMEM, "gemm: out of memory for %d groups", n_groups);
    size_t total = 0;
    int64_t values = 0;
    for (int g = 0; g < n_groups; g++) {
        const pd_gemm_group *gr = &p->groups[g];
        size_t b = gr->w.rows > 0 ? pd_gemm_tw_bytes(gr->n, gr->w.cols, 1) : 0;
        p->at[g] = b ? total : SIZE_MAX;
        total += b;
        values += b ? (int64_t)gr->n * gr->w.cols : 0;
        if (gr->n > PD_GEMM_TW_MAX && gr->w.rows > 0)
            p->need_sums = 1;
    }
    if (total == 0)
        return 0;
    if (!(p->buf = malloc(total)))
        return pd_err_set(err, PD_ENOMEM, "gemm: out of memory for %zu bytes of packed rows", total);
    pd_pool_run(values < PD_GEMM_SERIAL_MACS / 16 ? NULL : pool, n_groups, pack_task, p);
    return 0;
}

struct grouped_run {
    const pd_qmat *a;
    const int32_t *a_sum;    // [a->rows] or NULL (gemm_impl.h)
    const uint8_t *packed;   // the groups' packed rows (pd_gemm_tw_pack), at packed_at[g]
    const size_t *packed_at; // [n_groups] offset in packed, or SIZE_MAX for a group not packed
    const pd_gemm_group *groups;
    const int *first_task;   // [n_groups + 1] first task of each group; the last = total
    int n_groups;
    int accum;
    int y_stream;            // pd_gemm_job's, for every group (their outputs' total decides)
    pd_kernel k;
    pd_gemm_rows_fn fn;
    const pd_gemm_job *packs;   // [n_groups] the AMX kernels' packed activations (apack), or NULL
    int blocks;              // row blocks (rows_per_task) per task (grouped_blocks)
};

/* Row blocks per task of the grouped form. A thread that runs consecutive blocks of an expert
 * finds each one's weights already coming in (the kernels prefetch the rows after theirs), while
 * one that takes every other block, as two threads claiming tasks in turn do, starts each block
 * on weights in memory; so large calls get tasks of several blocks, as many as leave at least
 * GROUPED_TASKS tasks for the threads to balance (about 256 in a prefill layer's routed experts:
 * 64 x 2048 rows, 8 blocks each). It depends on the shapes only, so the results do not depend
 * on the thread count. AVX-512 only, whose kernels run their rows 64 at a time with every token
 * (the others pass tokens over a task's rows, sized to stay in L2). */
enum { GROUPED_TASKS = 256 };

static int grouped_blocks(int64_t row_blocks)
{
    return row_blocks > 2 * GROUPED_TASKS ? (int)(row_blocks / GROUPED_TASKS) : 1;
}

static void grouped_task(void *arg, int task)
{
    const struct grouped_run *r = arg;
    const int lo = task_owner(r->first_task, r->n_groups, task);   /* the group that holds `task` */
    const pd_gemm_group *g = &r->groups[lo];
    int rb = rows_per_task(g->w.rows, g->w.cols, g->n, r->k) * r->blocks;
    int o0 = (task - r->first_task[lo]) * rb;
    int o1 = o0 + rb < g->w.rows ? o0 + rb : g->w.rows;
    pd_gemm_job job = {
        .w = g->w.q, .w_scale = g->w.scale, .out = g->w.rows, .in = g->w.cols,
        .a = r->a->q, .a_scale = r->a->scale, .a_sum = r->a_sum,
        .a_packed = r->packed_at && r->packed_at[lo] != SIZE_MAX ? r->packed + r->packed_at[lo] : NULL, .tok = g->rows, .n = g->n, .y = g->y,
        .accum = r->accum, .apack = r->packs ? r->packs[lo].apack : NULL, .y_stream = r->y_stream,
    };
    /* the next group's weights, which this thread likely reads next: prefetched past the end */
    if (lo + 1 < r->n_groups && r->groups[lo + 1].w.cols == g->w.cols && r->groups[lo + 1].n > 0) {
        job.w_next = r->groups[lo + 1].w.q;
        job.next_out = r->groups[lo + 1].w.rows;
    }
    task_rows(r->fn, &job, o0, o1);
}

static int grouped_run(pd_pool *pool, const pd_qmat *a, const pd_gemm_group *groups, int n_groups,
                       int flags, pd_err *err)
{
    int rc;
    if ((rc = check_qmat(a, "activations", err)) < 0)
        return rc;
    if (n_groups < 0 || (n_groups > 0 && !groups))
        return pd_err_set(err, PD_EINVAL, "gemm: %d groups", n_groups);
    for (int g = 0; g < n_groups; g++) {
        const pd_gemm_group *gr = &groups[g];
        if ((rc = check_qmat(&gr->w, "expert weights", err)) < 0)
            return pd_err_prefix(err, "group %d: ", g);
        if (gr->w.cols != a->cols)
            return pd_err_set(err, PD_EINVAL, "gemm: group %d: weights [%d, %d] do not fit "
                              "activations [%d, %d]", g, gr->w.rows, gr->w.cols, a->rows, a->cols);
        if (gr->n < 0 || (gr->n > 0 && (!gr->rows || !gr->y)))
            return pd_err_set(err, PD_EINVAL, "gemm: group %d: %d rows, rows or output NULL", g,
                              gr->n);
        for (int j = 0; j < gr->n; j++)
            if (gr->rows[j] < 0 || gr->rows[j] >= a->rows)
                return pd_err_set(err, PD_EINVAL, "gemm: group %d: row %d is %d, outside [0, %d)",
                                  g, j, gr->rows[j], a->rows);
    }
    pd_kernel k;
    if ((rc = pd_gemm_kernel_get(&k, err)) < 0)
        return rc;
    if (n_groups == 0)
        return 0;

    /* Tasks are numbered group by group, each group's row blocks in order: a static split. */
    int stack_first[257];
    int *first = n_groups < 257 ? stack_first : malloc(((size_t)n_groups + 1) * sizeof *first);
    if (!first)
        return pd_err_set(err, PD_ENOMEM, "gemm: out of memory for %d groups", n_groups);
    int64_t total = 0, macs = 0, row_blocks = 0, out_bytes = 0;
    int n_lo = 0, n_hi = 0;   /* the groups' fewest and most tokens: equal, the tasks cost alike */
    for (int g = 0; g < n_groups; g++) {
        const pd_gemm_group *gr = &groups[g];
        if (gr->n > 0 && gr->w.rows > 0) {
            n_lo = n_lo == 0 || gr->n < n_lo ? gr->n : n_lo;
            n_hi = gr->n > n_hi ? gr->n : n_hi;
            int rb = rows_per_task(gr->w.rows, gr->w.cols, gr->n, k);
            row_blocks += (gr->w.rows + rb - 1) / rb;
        }
    }
    const int blocks = k == PD_KERNEL_AVX512 ? grouped_blocks(row_blocks) : 1;
    for (int g = 0; g < n_groups; g++) {
        first[g] = (int)total;
        const pd_gemm_group *gr = &groups[g];
        if (gr->n > 0 && gr->w.rows > 0) {
            int rb = rows_per_task(gr->w.rows, gr->w.cols, gr->n, k) * blocks;
            total += (gr->w.rows + rb - 1) / rb;
            macs += (int64_t)gr->n * gr->w.rows * gr->w.cols;
            out_bytes += (int64_t)gr->n * gr->w.rows * 4;
        }
        if (total > 0x7fffffff) {
            if (first != stack_first)
                free(first);
            return pd_err_set(err, PD_ERANGE, "gemm: more than 2^31 tasks in %d groups",
                              n_groups);
        }
    }
    first[n_groups] = (int)total;

    /* AVX-512: groups of 2-96 tokens packed once (gemm_vnni.c), on the pool; groups of more need
     * the activations' row sums */
    int32_t *sums = NULL;
    struct pack_run pk = {.a = a, .groups = groups};
    if (macs > 0 && (rc = pack_groups(pool, k, &pk, n_groups, err)) == 0 && pk.need_sums)
        rc = row_sums(pool, a, &sums, err);
    if (rc < 0) {
        free(pk.at);
        free(pk.buf);
        if (first != stack_first)
            free(first);
        return rc;
    }
    struct grouped_run r = {
        .a = a, .a_sum = sums, .packed = pk.buf, .packed_at = pk.at, .groups = groups, .first_task = first, .n_groups = n_groups,
        .accum = (flags & PD_GEMM_ACCUM) != 0, .k = k, .fn = kernel_fns[k], .blocks = blocks,
        .y_stream = stream_y(flags, out_bytes),
    };
    pd_gemm_job *packs = NULL;
    void *apacked = NULL;
    if (k == PD_KERNEL_AMX || k == PD_KERNEL_AMX_EMU) {
        if (!(packs = calloc((size_t)n_groups, sizeof *packs)))
            rc = pd_err_set(err, PD_ENOMEM, "gemm: out of memory for %d groups", n_groups);
        for (int g = 0; packs && g < n_groups; g++)
            packs[g] = (pd_gemm_job){.out = groups[g].w.rows, .in = a->cols, .a = a->q, .tok = groups[g].rows,
                                     .n = groups[g].n};
        if (packs && (rc = amx_pack(pool, k, packs, n_groups, &apacked, err)) == 0)
            r.packs = packs;
    }
    /* tasks of one cost (a decode step's experts, a token each) go to each thread in consecutive
     * stretches; experts with different token counts in the finer shares (pd_pool_run) */
    if (rc == 0)
        (n_lo == n_hi ? pd_pool_run_even : pd_pool_run)(small_work(macs) ? NULL : pool, (int)total, grouped_task, &r);
    free(apacked);
    free(packs);
    free(sums);
    free(pk.buf);
    free(pk.at);
    if (first != stack_first)
        free(first);
    return rc;
}

int pd_gemm(pd_pool *pool, const pd_qmat *w, const pd_qmat *a, float *y, int flags, pd_err *err)
{
    int64_t t0 = pd_call_clock_start(&gemm_clock);
    int rc = gemm_run(pool, w, a, y, flags, err);
    pd_call_clock_stop(&gemm_clock, t0);
    return rc;
}

int pd_gemm_grouped(pd_pool *pool, const pd_qmat *a, const pd_gemm_group *groups, int n_groups, int flags,
                    pd_err *err)
{
    int64_t t0 = pd_call_clock_start(&gemm_clock);
    int rc = grouped_run(pool, a, groups, n_groups, flags, err);
    pd_call_clock_stop(&gemm_clock, t0);
    return rc;
}

/* Linear layers (W8A8 or fp32), the engine's weight arena and tensor loading helpers. */
#include "engine/linear.h"
#include "engine/release.h"
#include "kernels/dot_gemm.h"
#include "kernels/ops.h"
#include "kernels/quant.h"
#include "kernels/vec.h"

#include <assert.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

void *pd_arena_alloc(struct pd_arena *a, size_t bytes)
{
    if (a->n == a->cap) {
        int cap = a->cap ? 2 * a->cap : 256;
        void **b = realloc(a->blocks, (size_t)cap * sizeof *b);
        if (!b)
            return NULL;
        a->blocks = b;
        a->cap = cap;
    }
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64))
        return NULL;
    a->blocks[a->n++] = p;
    a->bytes += bytes;
    return p;
}

void pd_arena_free(struct pd_arena *a)
{
    for (int i = 0; i < a->n; i++)
        free(a->blocks[i]);
    free(a->blocks);
    memset(a, 0, sizeof *a);
}

static int64_t numel_of(const struct pd_st_tensor *t)
{
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++)
        n *= t->shape[d];
    return n;
}

float *pd_load_f32(const struct pd_st_set *st, struct pd_arena *a, const char *name, int64_t numel, pd_err *e)
{
    const struct pd_st_tensor *t = pd_st_set_find(st, name);
    if (!t) {
        pd_err_set(e, PD_EFORMAT, "checkpoint: missing tensor \"%s\"", name);
        return NULL;
    }
    if (numel_of(t) != numel) {
        pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\" has %lld values, the config needs %lld", pd_st_set_path_of(st, t), name,
                   (long long)numel_of(t), (long long)numel);
        return NULL;
    }
    float *f = pd_arena_alloc(a, (size_t)numel * sizeof *f);
    if (!f) {
        pd_err_set(e, PD_ENOMEM, "checkpoint: out of memory loading \"%s\"", name);
        return NULL;
    }
    if (t->dtype == PD_ST_F32) {
        memcpy(f, t->data, (size_t)numel * 4);
    } else if (t->dtype == PD_ST_BF16) {
        pd_bf16_row(t->data, f, (size_t)numel);
    } else {
        pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\" is %s, expected F32 or BF16", pd_st_set_path_of(st, t), name,
                   pd_st_dtype_name(t->dtype));
        return NULL;
    }
    return f;
}

/* Maps the pages of n bytes at p (inside the checkpoint's mapping) now rather than at their first
 * read. A decode step touches the weights of the experts its tokens chose, so without this the
 * first tokens of a run fault in each expert's pages as they are first chosen (a minor fault per
 * few pages: +10% tokens/s over the first 32 decode steps of v4-flash-mini); loading costs
 * ~0.07 s more for its 1 GB when the file is in the page cache. Advice only: an older kernel
 * without MADV_POPULATE_READ just faults later. */
static void prefault(const void *p, size_t n)
{
#ifdef MADV_POPULATE_READ
    uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE), a0 = (uintptr_t)p & ~(pg - 1);
    uintptr_t a1 = ((uintptr_t)p + n + pg - 1) & ~(pg - 1);
    (void)madvise((void *)a0, a1 - a0, MADV_POPULATE_READ);
#else
    (void)p;
    (void)n;
#endif
}

int pd_linear_load(struct pd_linear *l, const struct pd_st_set *st, struct pd_arena *a, const char *name,
                   int out, int in, pd_err *e)
{
    return pd_linear_load_ref(l, st, a, name, out, in, 0, e);
}

int pd_linear_load_ref(struct pd_linear *l, const struct pd_st_set *st, struct pd_arena *a, const char *name,
                       int out, int in, int ref, pd_err *e)
{
    memset(l, 0, sizeof *l);
    l->out = out;
    l->in = in;
    const struct pd_st_tensor *t = pd_st_set_find(st, name);
    if (!t)
        return pd_err_set(e, PD_EFORMAT, "checkpoint: missing tensor \"%s\"", name);
    /* DeepSeek's release (FP8 blocks, FP4 experts): converted to int8 per output row here */
    struct pd_release_mat rm;
    int rc = pd_release_find(st, name, out, in, &rm, e);
    if (rc)
        return rc;
    if (rm.fmt != PD_RELEASE_NONE && ref) {
        float *f = pd_arena_alloc(a, (size_t)out * in * sizeof *f);
        if (!f)
            return pd_err_set(e, PD_ENOMEM, "checkpoint: out of memory decoding \"%s\"", name);
        for (int r = 0; r < out; r++)
            pd_release_decode_row(rm.fmt, rm.w->data, rm.s->data, out, in, r, f + (size_t)r * in);
        l->f = f;
        return 0;
    }
    if (rm.fmt != PD_RELEASE_NONE) {
        int8_t *q = pd_arena_alloc(a, (size_t)out * in);
        float *s = pd_arena_alloc(a, (size_t)out * sizeof *s);
        if (!q || !s)
            return pd_err_set(e, PD_ENOMEM, "checkpoint: out of memory converting \"%s\"", name);
        if ((rc = pd_release_to_int8(&rm, q, s, e)))
            return rc;
        l->q = (pd_qmat){.q = q, .scale = s, .rows = out, .cols = in};
        return 0;
    }
    if (t->ndim != 2 || t->shape[0] != out || t->shape[1] != in)
        return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\" has shape [%lld, %lld], the config needs [%d, %d]",
                          pd_st_set_path_of(st, t), name, (long long)t->shape[0], (long long)(t->ndim > 1 ? t->shape[1] : 0), out, in);
    if (t->dtype == PD_ST_BF16 && in <= PD_LINEAR_WIDE_FLOATS && (uintptr_t)t->data % 2 == 0) {
        /* read in place (shape checked above); a row longer than the widening buffer, or data at an
         * odd address, gets an fp32 copy instead */
        l->h = (const uint16_t *)t->data;
        prefault(t->data, (size_t)out * in * 2);
        return 0;
    }
    if (t->dtype != PD_ST_I8) {
        l->f = pd_load_f32(st, a, name, (int64_t)out * in, e);
        return l->f ? 0 : e->code;
    }
    char sname[160];
    snprintf(sname, sizeof sname, "%s_scale", name);
    /* scales are copied: they are small, and the copy is aligned whatever the file's layout */
    float *s = pd_load_f32(st, a, sname, out, e);
    if (!s)
        return e->code;
    l->q = (pd_qmat){.q = t->data, .scale = s, .rows = out, .cols = in};
    prefault(t->data, (size_t)out * in);
    return 0;
}

/* An fp32 or bf16 matrix (the head, wq_a, wkv, wo_a, the compressor's) times T tokens,
 * y[t][o] = pd_dot(w[o], x[t]) (pd_dot_rows, bit for bit): tasks of F32_ROWS output rows over the
 * pool, each block of rows (F32_ROWS x in floats, 128 KiB for in = 512) applied to every token
 * while it is in cache (a token-outer loop read the whole matrix T times on one thread). Each value
 * is the same dot product whatever the thread count. A bf16 matrix is widened to fp32 (exactly: a
 * bf16 value is the top half of its fp32) a few rows at a time into a buffer of at most
 * WIDE_FLOATS, which every token then reads: the same pd_dot_rows on the same values, so the same
 * bits as an fp32 copy of the matrix, from half the bytes. */
enum { F32_ROWS = 64, WIDE_FLOATS = PD_LINEAR_WIDE_FLOATS };

struct f32_job {
    const struct pd_linear *l;
    const float *x;
    int T;
    float *y;
};

/* y[t * out + r] = pd_dot(w[r], x[t]) for nr rows of w [nr, in] and T tokens: from 4 tokens on
 * (prefill) as one tiled product (kernels/dot_gemm.h, the same bits), else row by row per token. */
static void rows_times_tokens(const float *w, int nr, const float *x, int T, int in, float *y, int out)
{
    if (T >= 4) {
        pd_dot_gemm(w, (size_t)in, nr, x, (size_t)in, T, in, y, (size_t)out);
        return;
    }
    for (int t = 0; t < T; t++)
        pd_dot_rows(w, (size_t)in, x + (size_t)t * in, in, nr, y + (size_t)t * out);
}

static void f32_rows(void *arg, int task)
{
    const struct f32_job *j = arg;
    const int in = j->l->in, out = j->l->out, o0 = task * F32_ROWS;
    const int o1 = o0 + F32_ROWS < out ? o0 + F32_ROWS : out;
    if (j->l->f) {
        rows_times_tokens(j->l->f + (size_t)o0 * in, o1 - o0, j->x, j->T, in, j->y + o0, out);
        return;
    }
    _Alignas(64) float wide[WIDE_FLOATS];
    const int step = WIDE_FLOATS / in;   /* >= 1: pd_linear_load keeps longer rows in fp32 */
    for (int r0 = o0; r0 < o1; r0 += step) {
        const int nr = o1 - r0 < step ? o1 - r0 : step;
        pd_bf16_to_f32_row(j->l->h + (size_t)r0 * in, wide, nr * in);
        rows_times_tokens(wide, nr, j->x, j->T, in, j->y + r0, out);
    }
}

int pd_linear_fwd(const struct pd_linear *l, pd_pool *pool, int ref, const float *x, int T, float *y,
                  int8_t *qbuf, float *sbuf, pd_err *e)
{
    if ((l->f || l->h) && !ref) {
        struct f32_job j = {.l = l, .x = x, .T = T, .y = y};
        pd_pool_run(pool, (l->out + F32_ROWS - 1) / F32_ROWS, f32_rows, &j);
        return 0;
    }
    if (ref) {
        /* fp32 path: y[t][o] = sum_i w[o][i] x[t][i], double accumulation for the reference */
        for (int t = 0; t < T; t++)
            for (int o = 0; o < l->out; o++) {
                double acc = 0;
                if (l->f) {
                    const float *w = l->f + (size_t)o * l->in;
                    for (int i = 0; i < l->in; i++)
                        acc += (double)w[i] * x[(size_t)t * l->in + i];
                } else if (l->h) {
                    const uint16_t *w = l->h + (size_t)o * l->in;
                    for (int i = 0; i < l->in; i++)
                        acc += (double)pd_bf16_to_f32(w[i]) * x[(size_t)t * l->in + i];
                } else {
                    const int8_t *w = l->q.q + (size_t)o * l->in;
                    for (int i = 0; i < l->in; i++)
                        acc += (double)w[i] * x[(size_t)t * l->in + i];
                    acc *= l->q.scale[o];
                }
                y[(size_t)t * l->out + o] = (float)acc;
            }
        return 0;
    }
    pd_quant_rows_pool(pool, x, T, l->in, qbuf, sbuf);
    pd_qmat a = {.q = qbuf, .scale = sbuf, .rows = T, .cols = l->in};
    return pd_gemm(pool, &l->q, &a, y, 0, e);
}

int pd_linear_fwd_q(const struct pd_linear *l, pd_pool *pool, int ref, const float *x, const pd_qmat *xq, int T,
                    float *y, pd_err *e)
{
    if (l->f || l->h || ref)
        return pd_linear_fwd(l, pool, ref, x, T, y, NULL, NULL, e);
    assert(xq->rows == T && xq->cols == l->in);
    return pd_gemm(pool, &l->q, xq, y, 0, e);
}

int pd_linear_fwd_many(const struct pd_linear *const *l, float *const *y, int n, pd_pool *pool, int ref,
                       const float *x, const pd_qmat *xq, int T, pd_err *e)
{
    enum { MAX_MANY = 16, MAX_T = 64 };
    int grouped = !ref && n <= MAX_MANY && T <= MAX_T;
    for (int i = 0; i < n && grouped; i++)
        grouped = l[i]->q.q && !l[i]->f;
    if (!grouped) {
        for (int i = 0; i < n; i++) {
            int rc = pd_linear_fwd_q(l[i], pool, ref, x, xq, T, y[i], e);
            if (rc)
                return rc;
        }
        return 0;
    }
    int32_t rows[MAX_T];
    pd_gemm_group g[MAX_MANY];
    for (int t = 0; t < T; t++)
        rows[t] = t;
    for (int i = 0; i < n; i++) {
        assert(xq->rows == T && xq->cols == l[i]->in);
        g[i] = (pd_gemm_group){.w = l[i]->q, .rows = rows, .n = T, .y = y[i]};
    }
    return pd_gemm_grouped(pool, xq, g, n, 0, e);
}

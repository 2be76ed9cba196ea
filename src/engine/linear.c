/* Linear layers (W8A8 or fp32), the engine's weight arena and tensor loading helpers. */
#include "engine/linear.h"
#include "core/timing.h"
#include "engine/release.h"
#include "kernels/dot_gemm.h"
#include "kernels/ops.h"
#include "kernels/quant.h"
#include "kernels/vec.h"

#include <assert.h>
#include <math.h>
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

/* A weight that is NaN or infinite (a corrupt or badly converted checkpoint) makes every logit
 * NaN: the model "runs" and answers token 0 for ever. Found at load instead, naming the tensor and
 * the place: what (f32 values or bf16 bits) of n values, as a rows x cols tensor (cols 0: a
 * vector). */
static int nonfinite(const struct pd_st_set *st, const struct pd_st_tensor *t, const char *name, int64_t i,
                     int64_t cols, int nan, pd_err *e)
{
    char at[64];
    if (cols)
        snprintf(at, sizeof at, "row %lld, column %lld", (long long)(i / cols), (long long)(i % cols));
    else
        snprintf(at, sizeof at, "value %lld", (long long)i);
    return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\" %s is %s", pd_st_set_path_of(st, t), name, at,
                      nan ? "NaN" : "infinite");
}

static int finite_f32(const float *f, int64_t n, const struct pd_st_set *st, const struct pd_st_tensor *t,
                      const char *name, int64_t cols, pd_err *e)
{
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(f[i]))
            return nonfinite(st, t, name, i, cols, isnan(f[i]), e);
    return 0;
}

static int finite_bf16(const uint16_t *h, int64_t n, const struct pd_st_set *st, const struct pd_st_tensor *t,
                       const char *name, int64_t cols, pd_err *e)
{
    for (int64_t i = 0; i < n; i++)
        if ((h[i] & 0x7f80) == 0x7f80)   /* exponent all ones: NaN or infinity */
            return nonfinite(st, t, name, i, cols, (h[i] & 0x7f) != 0, e);
    return 0;
}

int pd_check_finite_bf16(const struct pd_st_set *st, const struct pd_st_tensor *t, const char *name, pd_err *e)
{
    return finite_bf16(t->data, numel_of(t), st, t, name, t->ndim == 2 ? t->shape[1] : 0, e);
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
    return finite_f32(f, numel, st, t, name, 0, e) ? NULL : f;
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

/* t is not the out x in matrix the config needs (a transposed [in, out] of as many values once
 * ran as its transpose): its shape as stored, every dimension of it. */
static int bad_shape(const struct pd_st_set *st, const struct pd_st_tensor *t, const char *name, int out, int in,
                     pd_err *e)
{
    char dims[96] = "";
    size_t at = 0;
    for (int d = 0; d < t->ndim && at < sizeof dims - 24; d++)
        at += (size_t)snprintf(dims + at, sizeof dims - at, "%s%lld", d ? ", " : "", (long long)t->shape[d]);
    return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\" has shape [%s], the config needs [%d, %d]",
                      pd_st_set_path_of(st, t), name, dims, out, in);
}

int pd_linear_load(struct pd_linear *l, const struct pd_st_set *st, struct pd_arena *a, const char *name,
                   int out, int in, pd_err *e)
{
    return pd_linear_load_ref(l, st, a, name, out, in, 0, e);
}

/* l emptied to an out x in matrix; *t the checkpoint's tensor `name`, or PD_EFORMAT naming it. */
static int linear_find(struct pd_linear *l, const struct pd_st_set *st, const char *name, int out, int in,
                       const struct pd_st_tensor **t, pd_err *e)
{
    memset(l, 0, sizeof *l);
    l->out = out;
    l->in = in;
    if (!(*t = pd_st_set_find(st, name)))
        return pd_err_set(e, PD_EFORMAT, "checkpoint: missing tensor \"%s\"", name);
    return 0;
}

int pd_linear_load_ref(struct pd_linear *l, const struct pd_st_set *st, struct pd_arena *a, const char *name,
                       int out, int in, int ref, pd_err *e)
{
    const struct pd_st_tensor *t;
    int rc = linear_find(l, st, name, out, in, &t, e);
    if (rc)
        return rc;
    /* DeepSeek's release (FP8 blocks, FP4 experts): converted to int8 per output row here */
    struct pd_release_mat rm;
    rc = pd_release_find(st, name, out, in, &rm, e);
    if (rc)
        return rc;
    if (rm.fmt != PD_RELEASE_NONE && ref) {
        float *f = pd_arena_alloc(a, (size_t)out * in * sizeof *f);
        if (!f)
            return pd_err_set(e, PD_ENOMEM, "checkpoint: out of memory decoding \"%s\"", name);
        for (int r = 0; r < out; r++)
            pd_release_decode_row(rm.fmt, rm.w->data, rm.s->data, out, in, r, f + (size_t)r * in);
        l->f = f;
        return finite_f32(f, (int64_t)out * in, st, t, name, in, e);
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
        return bad_shape(st, t, name, out, in, e);
    if (t->dtype == PD_ST_BF16 && in <= PD_LINEAR_WIDE_FLOATS && (uintptr_t)t->data % 2 == 0) {
        /* read in place (shape checked above); a row longer than PD_LINEAR_WIDE_FLOATS, or data at
         * an odd address, gets an fp32 copy instead */
        l->h = (const uint16_t *)t->data;
        prefault(t->data, (size_t)out * in * 2);
        return finite_bf16(l->h, (int64_t)out * in, st, t, name, in, e);
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

int pd_linear_load_float(struct pd_linear *l, const struct pd_st_set *st, struct pd_arena *a, const char *name,
                         int out, int in, pd_err *e)
{
    const struct pd_st_tensor *t;
    int rc = linear_find(l, st, name, out, in, &t, e);
    if (rc)
        return rc;
    if (t->ndim != 2 || t->shape[0] != out || t->shape[1] != in)
        return bad_shape(st, t, name, out, in, e);
    if (t->dtype == PD_ST_BF16 && in <= PD_LINEAR_WIDE_FLOATS && (uintptr_t)t->data % 2 == 0) {
        l->h = (const uint16_t *)t->data;
        prefault(t->data, (size_t)out * in * 2);
        return finite_bf16(l->h, (int64_t)out * in, st, t, name, in, e);
    }
    l->f = pd_load_f32(st, a, name, (int64_t)out * in, e);
    return l->f ? 0 : e->code;
}

/* An fp32 or bf16 matrix (the head, wq_a, wkv, wo_a, the compressor's) times T tokens,
 * y[t][o] = pd_dot(w[o], x[t]) bit for bit: tasks of F32_ROWS output rows over the pool, or of
 * token blocks from FLOAT_TOKENS_MIN tokens (each value the same dot product whatever the thread
 * count or the task). One token goes row by row (pd_dot_rows[_bf16]:
 * a bf16 row widened in registers as it streams from memory); fewer than GEMM_T through
 * pd_dot_rows_tokens[_bf16], each row read once for up to four tokens at a time (a token-outer
 * loop read the whole matrix T times); from GEMM_T tokens as one register-tiled product
 * (kernels/dot_gemm.h), bf16 rows widened in its registers. The crossing, measured on 64-row tasks
 * of a 64 MiB bf16 matrix of 512-value rows (from memory), 1 thread, per 512 x 512: 4 tokens 0.055-
 * 0.076 ms row by row against 0.066-0.069 tiled, 6 even (0.09), 8 0.103-0.118 against 0.095-0.110,
 * 16 0.289 against 0.149. Every path gives pd_dot's bits. */
enum { F32_ROWS = 64, DIRECT_T = 1, GEMM_T = 8 };
_Static_assert(PD_LINEAR_WIDE_FLOATS <= PD_DOT_BF16_MAX, "bf16 rows longer than pd_dot_rows_bf16 takes");

/* Rows [o0, o1) of one product y[t * ldy + o] = row o . x[t * ldx ..] for every token. */
static void float_rows(const struct pd_linear_io *io, int T, int o0, int o1)
{
    const struct pd_linear *l = io->l;
    const int in = l->in;
    if (T <= DIRECT_T) {
        for (int t = 0; t < T; t++)
            if (l->h)
                pd_dot_rows_bf16(l->h + (size_t)o0 * in, (size_t)in, io->x + (size_t)t * io->ldx, in, o1 - o0,
                                 io->y + (size_t)t * io->ldy + o0);
            else
                pd_dot_rows(l->f + (size_t)o0 * in, (size_t)in, io->x + (size_t)t * io->ldx, in, o1 - o0,
                            io->y + (size_t)t * io->ldy + o0);
        return;
    }
    if (T < GEMM_T) {
        if (l->h)
            pd_dot_rows_tokens_bf16(l->h + (size_t)o0 * in, (size_t)in, io->x, io->ldx, T, in, o1 - o0, io->y + o0,
                                    io->ldy);
        else
            pd_dot_rows_tokens(l->f + (size_t)o0 * in, (size_t)in, io->x, io->ldx, T, in, o1 - o0, io->y + o0,
                               io->ldy);
        return;
    }
    if (l->f)
        pd_dot_gemm(l->f + (size_t)o0 * in, (size_t)in, o1 - o0, io->x, io->ldx, T, in, io->y + o0, io->ldy);
    else
        pd_dot_gemm_bf16(l->h + (size_t)o0 * in, (size_t)in, o1 - o0, io->x, io->ldx, T, in, io->y + o0, io->ldy);
}

/* Several float products in one pool run: task k is block k of the F32_ROWS-row blocks of all
 * the products in order (first[i] is product i's first task), so every block costs about the same
 * bytes and the threads share the whole group, not each small matrix in turn. */
enum { FLOAT_MANY = 16 };

struct float_job {
    const struct pd_linear_io *io;
    int n, T;
    int first[FLOAT_MANY + 1];
};

static void float_task(void *arg, int task)
{
    const struct float_job *j = arg;
    int i = 0;
    while (task >= j->first[i + 1])
        i++;
    const int out = j->io[i].l->out, o0 = (task - j->first[i]) * F32_ROWS;
    float_rows(&j->io[i], j->T, o0, o0 + F32_ROWS < out ? o0 + F32_ROWS : out);
}

/* From FLOAT_TOKENS_MIN tokens (a prefill) a run's tasks are blocks of FLOAT_TOKENS tokens, each
 * through every row of every product, instead of blocks of rows through every token: a task's
 * tokens (128 KiB of x at 512 values) stay in L2 while the weights pass, and the run reads the
 * weights once per token block where row tasks read all of x once per row block, twice the bytes
 * with bf16 weights and fp32 x at any shape. The same dot products, so the same bits. v4-flash-mini's
 * wq_a, wkv and a compressor's (512 rows of 512 bf16) at 1,024 tokens on one thread 4.27 -> 3.99
 * ms; bench prefill at 1,024 tokens and 2 threads, five rounds alternating, 3,906-4,046 ->
 * 4,013-4,069 tokens/s. */
enum { FLOAT_TOKENS = 64, FLOAT_TOKENS_MIN = 4 * FLOAT_TOKENS };

static void float_tokens_task(void *arg, int task)
{
    const struct float_job *j = arg;
    const int t0 = task * FLOAT_TOKENS, nt = j->T - t0 < FLOAT_TOKENS ? j->T - t0 : FLOAT_TOKENS;
    for (int i = 0; i < j->n; i++) {
        struct pd_linear_io io = j->io[i];
        io.x += (size_t)t0 * io.ldx;
        io.y += (size_t)t0 * io.ldy;
        float_rows(&io, nt, 0, io.l->out);
    }
}

static _Thread_local struct pd_call_clock float_clock;

struct pd_call_clock *pd_linear_clock(void)
{
    return &float_clock;
}

static int float_many(const struct pd_linear_io *io, int n, pd_pool *pool, int T, pd_err *e);

int pd_linear_fwd_float_many(const struct pd_linear_io *io, int n, pd_pool *pool, int T, pd_err *e)
{
    int64_t t0 = pd_call_clock_start(&float_clock);
    int rc = float_many(io, n, pool, T, e);
    pd_call_clock_stop(&float_clock, t0);
    return rc;
}

static int float_many(const struct pd_linear_io *io, int n, pd_pool *pool, int T, pd_err *e)
{
    if (n > FLOAT_MANY)
        return pd_err_set(e, PD_EINVAL, "linear: %d float products in one run (at most %d)", n, FLOAT_MANY);
    struct float_job j = {.io = io, .n = n, .T = T};
    int even = 1;   /* rows of one length and one storage: tasks of one cost */
    for (int i = 0; i < n; i++) {
        if (!io[i].l->f && !io[i].l->h)
            return pd_err_set(e, PD_EINVAL, "linear: product %d of a float run has int8 weights", i);
        j.first[i + 1] = j.first[i] + (io[i].l->out + F32_ROWS - 1) / F32_ROWS;
        even &= io[i].l->in == io[0].l->in && !io[i].l->h == !io[0].l->h;
    }
    if (T >= FLOAT_TOKENS_MIN) {
        pd_pool_run_even(pool, (T + FLOAT_TOKENS - 1) / FLOAT_TOKENS, float_tokens_task, &j);
        return 0;
    }
    (even ? pd_pool_run_even : pd_pool_run)(pool, j.first[n], float_task, &j);
    return 0;
}

int pd_linear_fwd(const struct pd_linear *l, pd_pool *pool, int ref, const float *x, int T, float *y,
                  int8_t *qbuf, float *sbuf, pd_err *e)
{
    if ((l->f || l->h) && !ref) {
        struct pd_linear_io io = {.l = l, .x = x, .ldx = (size_t)l->in, .y = y, .ldy = (size_t)l->out};
        return pd_linear_fwd_float_many(&io, 1, pool, T, e);
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
    if (n > MAX_MANY || ref) {
        for (int i = 0; i < n; i++) {
            int rc = pd_linear_fwd_q(l[i], pool, ref, x, xq, T, y[i], e);
            if (rc)
                return rc;
        }
        return 0;
    }
    /* the float products in one run, the int8 ones in one grouped product (or one by one) */
    struct pd_linear_io io[MAX_MANY];
    int nf = 0, ni = 0, in8[MAX_MANY];
    for (int i = 0; i < n; i++)
        if (l[i]->f || l[i]->h)
            io[nf++] = (struct pd_linear_io){.l = l[i], .x = x, .ldx = (size_t)l[i]->in, .y = y[i], .ldy = (size_t)l[i]->out};
        else
            in8[ni++] = i;
    int rc = nf ? pd_linear_fwd_float_many(io, nf, pool, T, e) : 0;
    if (rc || !ni)
        return rc;
    if (T > MAX_T) {
        for (int k = 0; k < ni; k++)
            if ((rc = pd_linear_fwd_q(l[in8[k]], pool, ref, x, xq, T, y[in8[k]], e)))
                return rc;
        return 0;
    }
    int32_t rows[MAX_T];
    pd_gemm_group g[MAX_MANY];
    for (int t = 0; t < T; t++)
        rows[t] = t;
    for (int k = 0; k < ni; k++) {
        const struct pd_linear *li = l[in8[k]];
        assert(xq->rows == T && xq->cols == li->in);
        g[k] = (pd_gemm_group){.w = li->q, .rows = rows, .n = T, .y = y[in8[k]]};
    }
    return pd_gemm_grouped(pool, xq, g, ni, 0, e);
}

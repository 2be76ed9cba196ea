/* Release (FP8/FP4) -> W8A8 conversion, shard by shard in bounded memory (convert.h). */
#include "engine/convert.h"
#include "engine/release.h"
#include "kernels/ops.h"
#include "kernels/quant.h"
#include "model/safetensors.h"
#include "plan/inventory.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

enum { CHUNK = 4 << 20, DROP_EVERY = 32 << 20 };

/* One output of a shard: a tensor copied, a release matrix a W8A8 deployment quantises converted
 * into two tensors (int8 weight [out, in], then fp32 weight_scale [out]), or one it runs in bf16
 * decoded into one bf16 tensor [out, in] (exact: every FP8/FP4 value times its power-of-two
 * scale is a bf16 value). */
struct item {
    const struct pd_st_tensor *src;
    struct pd_release_mat rm;     /* rm.fmt != NONE: converted */
    int bf16;                     /* converted to bf16 rather than int8 */
    char scale_name[200];
    uint64_t off;                 /* offset of the (first) output tensor in the data section */
};

/* Drops the pages of [p, p + n) of a read-only file mapping from this process: they read again
 * from the file if touched, and stop counting in the resident set meanwhile. */
static void drop(const void *p, size_t n)
{
    uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE), a0 = (uintptr_t)p & ~(pg - 1);
    uintptr_t a1 = ((uintptr_t)p + n + pg - 1) & ~(pg - 1);
    (void)madvise((void *)a0, a1 - a0, MADV_DONTNEED);
}

/* Drops every page of every source shard this process has resident: done after each tensor
 * once enough source bytes have passed, it bounds what the mapping holds whatever the per-range
 * drops miss (the kernel maps pages around each fault, scales are read across rows). */
static void drop_all(const struct pd_st_set *set)
{
    for (size_t i = 0; i < set->nfiles; i++)
        if (set->files[i].map)
            (void)madvise(set->files[i].map, set->files[i].file_size, MADV_DONTNEED);
}

static const char *base_name(const char *path)
{
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

static int ends_with(const char *s, const char *suf)
{
    size_t n = strlen(s), k = strlen(suf);
    return n >= k && strcmp(s + n - k, suf) == 0;
}

/* The outputs of shard f: every tensor but the scales its release matrices consume. */
static int plan_shard(const struct pd_st_set *set, const struct pd_st_file *f, struct item *it, size_t *n, pd_err *e)
{
    *n = 0;
    /* a DSpark checkpoint (its draft's target-state projection): the draft stages' wo_a stays FP8 */
    const int dspark = pd_st_set_find(set, "mtp.0.main_proj.weight") != NULL;
    for (size_t i = 0; i < f->n; i++) {
        const struct pd_st_tensor *t = &f->tensors[i];
        char wn[200];
        if (ends_with(t->name, ".scale")) {
            /* "X.scale" of a release matrix "X.weight" goes with it */
            snprintf(wn, sizeof wn, "%.*s.weight", (int)(strlen(t->name) - 6), t->name);
            const struct pd_st_tensor *w = pd_st_set_find(set, wn);
            if (w && (w->dtype == PD_ST_F8_E4M3 || w->dtype == PD_ST_I8) && pd_inventory_w8a8_role(wn, dspark) != PD_W8A8_KEEP)
                continue;
        }
        struct item *x = &it[(*n)++];
        memset(x, 0, sizeof *x);
        x->src = t;
        int out = 0, in = 0;
        if (t->ndim == 2 && t->shape[0] <= INT_MAX && t->shape[1] <= INT_MAX / 2) {
            out = (int)t->shape[0];
            in = (int)(t->dtype == PD_ST_I8 ? 2 * t->shape[1] : t->shape[1]);
        } else if (t->dtype == PD_ST_F8_E4M3) {
            return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\" is F8_E4M3 but not a matrix", f->path, t->name);
        }
        int rc = pd_release_find(set, t->name, out, in, &x->rm, e);
        if (rc)
            return rc;
        enum pd_w8a8_role role = pd_inventory_w8a8_role(t->name, dspark);
        if (role == PD_W8A8_KEEP)
            x->rm.fmt = PD_RELEASE_NONE;   /* kept as released, with its scale */
        x->bf16 = x->rm.fmt != PD_RELEASE_NONE && role == PD_W8A8_FLOAT;
        if (x->rm.fmt != PD_RELEASE_NONE && !x->bf16)
            snprintf(x->scale_name, sizeof x->scale_name, "%s_scale", t->name);
    }
    return 0;
}

static uint64_t src_bytes(const struct item *x)
{
    uint64_t b = x->src->end - x->src->begin;
    if (x->rm.fmt != PD_RELEASE_NONE)
        b += x->rm.s->end - x->rm.s->begin;
    return b;
}

/* The header of the output shard; fills each item's offset. *len gets its padded length. */
static char *header(struct item *it, size_t n, uint64_t *len, uint64_t *data_bytes)
{
    json_t *root = json_object();
    uint64_t off = 0;
    for (size_t i = 0; i < n && root; i++) {
        struct item *x = &it[i];
        x->off = off;
        json_t *shape = json_array();
        for (int d = 0; d < x->src->ndim; d++)
            json_array_append_new(shape, json_integer(x->src->shape[d]));
        if (x->rm.fmt == PD_RELEASE_NONE) {
            uint64_t b = x->src->end - x->src->begin;
            json_object_set_new(root, x->src->name,
                                json_pack("{s:s, s:o, s:[I, I]}", "dtype", pd_st_dtype_name(x->src->dtype), "shape", shape,
                                          "data_offsets", (json_int_t)off, (json_int_t)(off + b)));
            off += b;
        } else if (x->bf16) {
            uint64_t b = 2 * (uint64_t)x->rm.out * (uint64_t)x->rm.in;
            json_decref(shape);
            json_object_set_new(root, x->src->name,
                                json_pack("{s:s, s:[i, i], s:[I, I]}", "dtype", "BF16", "shape", x->rm.out, x->rm.in,
                                          "data_offsets", (json_int_t)off, (json_int_t)(off + b)));
            off += b;
        } else {
            uint64_t q = (uint64_t)x->rm.out * (uint64_t)x->rm.in, s = 4 * (uint64_t)x->rm.out;
            json_decref(shape);
            json_object_set_new(root, x->src->name,
                                json_pack("{s:s, s:[i, i], s:[I, I]}", "dtype", "I8", "shape", x->rm.out, x->rm.in,
                                          "data_offsets", (json_int_t)off, (json_int_t)(off + q)));
            json_object_set_new(root, x->scale_name,
                                json_pack("{s:s, s:[i], s:[I, I]}", "dtype", "F32", "shape", x->rm.out, "data_offsets",
                                          (json_int_t)(off + q), (json_int_t)(off + q + s)));
            off += q + s;
        }
    }
    if (!root)
        return NULL;
    char *txt = json_dumps(root, JSON_PRESERVE_ORDER | JSON_COMPACT);
    json_decref(root);
    if (!txt)
        return NULL;
    size_t k = strlen(txt), padded = (k + 7) / 8 * 8;
    char *h = realloc(txt, padded + 1);
    if (!h) {
        free(txt);
        return NULL;
    }
    memset(h + k, ' ', padded - k);
    h[padded] = 0;
    *len = padded;
    *data_bytes = off;
    return h;
}

/* A write buffer over fd. */
struct wbuf {
    int fd;
    char *b;
    size_t n;
    int err;
};

static void wflush(struct wbuf *w)
{
    size_t k = 0;
    while (k < w->n && !w->err) {
        ssize_t r = write(w->fd, w->b + k, w->n - k);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            w->err = r < 0 ? errno : EIO;
        else
            k += (size_t)r;
    }
    w->n = 0;
}

static void wput(struct wbuf *w, const void *p, size_t n)
{
    const char *c = p;
    while (n && !w->err) {
        size_t k = CHUNK - w->n < n ? CHUNK - w->n : n;
        memcpy(w->b + w->n, c, k);
        w->n += k;
        c += k;
        n -= k;
        if (w->n == CHUNK)
            wflush(w);
    }
}

static int pread_all(int fd, void *p, size_t n, uint64_t off)
{
    char *c = p;
    while (n) {
        ssize_t r = pread(fd, c, n, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        c += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

/* Rows of a release matrix per page drop: about CHUNK source bytes. */
static int rows_per_drop(const struct pd_release_mat *m)
{
    size_t row = m->fmt == PD_RELEASE_FP8 ? (size_t)m->in : (size_t)m->in / 2;
    size_t r = CHUNK / (row ? row : 1);
    return r < 1 ? 1 : r > (size_t)m->out ? m->out : (int)r;
}

static const uint8_t *src_row(const struct pd_release_mat *m, int r)
{
    size_t row = m->fmt == PD_RELEASE_FP8 ? (size_t)m->in : (size_t)m->in / 2;
    return (const uint8_t *)m->w->data + (size_t)r * row;
}

/* Checks a bf16 item: every value equal to the decoded source value. */
static int verify_bf16(int fd, uint64_t base, const struct item *x, const char *path, float *row, char *chunk,
                       pd_err *e)
{
    const struct pd_release_mat *m = &x->rm;
    const size_t rb = 2 * (size_t)m->in;
    const int blk = CHUNK / rb > 0 ? (int)(CHUNK / rb) : 1, per = rows_per_drop(m);
    for (int r = 0; r < m->out; r++) {
        pd_release_decode_row(m->fmt, m->w->data, m->s->data, m->out, m->in, r, row);
        if (r % blk == 0) {
            int nr = m->out - r < blk ? m->out - r : blk;
            if (pread_all(fd, chunk, (size_t)nr * rb, base + x->off + (uint64_t)r * rb))
                return pd_err_set(e, PD_EIO, "%s: cannot read back tensor \"%s\"", path, x->src->name);
        }
        const uint16_t *br = (const uint16_t *)(chunk + (size_t)(r % blk) * rb);
        for (int c = 0; c < m->in; c++) {
            float v = pd_bf16_to_f32(br[c]);
            if (v != row[c])
                return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\" row %d column %d: bf16 %g, the source %g", path,
                                  x->src->name, r, c, v, row[c]);
        }
        if ((r + 1) % per == 0 || r + 1 == m->out) {
            int r0 = (r / per) * per;
            drop(src_row(m, r0), (size_t)(src_row(m, r + 1) - src_row(m, r0)));
        }
    }
    drop(m->s->data, m->s->end - m->s->begin);
    return 0;
}

/* Checks item x as stored in fd at data offset base + x->off against its source. */
static int verify_item(int fd, uint64_t base, const struct item *x, const char *path, float *row, float *scales,
                       int8_t *qx, char *chunk, double *max_rel, pd_err *e)
{
    if (x->rm.fmt == PD_RELEASE_NONE) {
        uint64_t n = x->src->end - x->src->begin;
        for (uint64_t k = 0; k < n; k += CHUNK) {
            size_t len = n - k < CHUNK ? (size_t)(n - k) : CHUNK;
            if (pread_all(fd, chunk, len, base + x->off + k))
                return pd_err_set(e, PD_EIO, "%s: cannot read back tensor \"%s\"", path, x->src->name);
            if (memcmp(chunk, (const char *)x->src->data + k, len))
                return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\" differs from its source at byte %llu", path,
                                  x->src->name, (unsigned long long)k);
            drop((const char *)x->src->data + k, len);
        }
        return 0;
    }
    const struct pd_release_mat *m = &x->rm;
    if (x->bf16)
        return verify_bf16(fd, base, x, path, row, chunk, e);
    const uint64_t qoff = base + x->off, soff = qoff + (uint64_t)m->out * m->in;
    if (pread_all(fd, scales, (size_t)m->out * 4, soff))
        return pd_err_set(e, PD_EIO, "%s: cannot read back tensor \"%s\"", path, x->scale_name);
    int per = rows_per_drop(m);
    /* the int8 rows come back in blocks of up to CHUNK bytes, one pread each */
    const int blk = CHUNK / m->in > 0 ? CHUNK / m->in : 1;
    for (int r = 0; r < m->out; r++) {
        pd_release_decode_row(m->fmt, m->w->data, m->s->data, m->out, m->in, r, row);
        if (r % blk == 0) {
            int nr = m->out - r < blk ? m->out - r : blk;
            if (pread_all(fd, chunk, (size_t)nr * m->in, qoff + (uint64_t)r * m->in))
                return pd_err_set(e, PD_EIO, "%s: cannot read back tensor \"%s\"", path, x->src->name);
        }
        const int8_t *qr = (const int8_t *)chunk + (size_t)(r % blk) * m->in;
        float s = scales[r], amax = 0, err = 0;
        if (!(s >= 0) || !isfinite(s))
            return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\" row %d has scale %g", path, x->scale_name, r, s);
        const float tol = s * 0.5f * (1 + 1e-5f) + 1e-30f;
        int bad = -1;
        for (int c = 0; c < m->in; c++) {
            float d = fabsf((float)qr[c] * s - row[c]), a = fabsf(row[c]);
            amax = a > amax ? a : amax;
            err = d > err ? d : err;
            bad = bad < 0 && (qr[c] == -128 || !(d <= tol)) ? c : bad;
        }
        if (bad >= 0)
            return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\" row %d column %d: %d x %g does not round %g", path,
                              x->src->name, r, bad, qr[bad], s, row[bad]);
        /* and exactly what this conversion writes: a kept shard whose scale lost a bit (within the
         * rounding tolerance above) was once taken as verified */
        float sx;
        pd_quant_weights(row, 1, m->in, qx, &sx);
        if (memcmp(&sx, &s, sizeof s) || memcmp(qx, qr, (size_t)m->in))
            return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\" row %d is not what the conversion writes (scale %a, "
                              "expected %a)", path, x->src->name, r, s, sx);
        if (amax > 0 && err / amax > *max_rel)
            *max_rel = err / amax;
        if ((r + 1) % per == 0 || r + 1 == m->out) {
            int r0 = (r / per) * per;
            drop(src_row(m, r0), (size_t)(src_row(m, r + 1) - src_row(m, r0)));
        }
    }
    drop(m->s->data, m->s->end - m->s->begin);
    return 0;
}

/* Writes item x at the file's current position. */
static int write_item(struct wbuf *w, const struct item *x, float *row, int8_t *q, float *scales, pd_err *e)
{
    if (x->rm.fmt == PD_RELEASE_NONE) {
        uint64_t n = x->src->end - x->src->begin;
        for (uint64_t k = 0; k < n; k += CHUNK) {
            size_t len = n - k < CHUNK ? (size_t)(n - k) : CHUNK;
            wput(w, (const char *)x->src->data + k, len);
            drop((const char *)x->src->data + k, len);
        }
        return 0;
    }
    const struct pd_release_mat *m = &x->rm;
    int per = rows_per_drop(m);
    for (int r = 0; r < m->out; r++) {
        pd_release_decode_row(m->fmt, m->w->data, m->s->data, m->out, m->in, r, row);
        for (int c = 0; c < m->in; c++)
            if (!isfinite(row[c]))
                return pd_err_set(e, PD_EFORMAT, "tensor \"%s\" row %d column %d is NaN (a NaN code or scale)",
                                  x->src->name, r, c);
        if (x->bf16) {
            uint16_t *b = (uint16_t *)(void *)q;   /* q holds 2 * in bytes */
            for (int c = 0; c < m->in; c++)
                b[c] = pd_f32_to_bf16(row[c]);
            wput(w, b, 2 * (size_t)m->in);
        } else {
            pd_quant_weights(row, 1, m->in, q, scales + r);
            wput(w, q, (size_t)m->in);
        }
        if ((r + 1) % per == 0 || r + 1 == m->out) {
            int r0 = (r / per) * per;
            drop(src_row(m, r0), (size_t)(src_row(m, r + 1) - src_row(m, r0)));
        }
    }
    if (!x->bf16)
        wput(w, scales, (size_t)m->out * 4);
    return 0;
}

/* Whether the existing output `path` holds exactly the planned tensors (names, dtypes, shapes,
 * offsets), before its data is verified. */
static int header_matches(const char *path, const struct item *it, size_t n, uint64_t *data_start)
{
    struct pd_st_file f;
    pd_err e = {0};
    if (pd_st_open(path, PD_ST_HEADER_ONLY, &f, &e))
        return 0;
    size_t want = 0;
    int ok = 1;
    for (size_t i = 0; i < n && ok; i++) {
        const struct item *x = &it[i];
        const struct pd_st_tensor *t = pd_st_find(&f, x->src->name);
        want += x->rm.fmt == PD_RELEASE_NONE || x->bf16 ? 1 : 2;
        if (!t || t->begin != x->off) {
            ok = 0;
        } else if (x->rm.fmt == PD_RELEASE_NONE) {
            ok = t->dtype == x->src->dtype && t->ndim == x->src->ndim &&
                 !memcmp(t->shape, x->src->shape, sizeof t->shape[0] * (size_t)t->ndim);
        } else if (x->bf16) {
            ok = t->dtype == PD_ST_BF16 && t->ndim == 2 && t->shape[0] == x->rm.out && t->shape[1] == x->rm.in;
        } else {
            const struct pd_st_tensor *s = pd_st_find(&f, x->scale_name);
            ok = t->dtype == PD_ST_I8 && t->ndim == 2 && t->shape[0] == x->rm.out && t->shape[1] == x->rm.in && s &&
                 s->dtype == PD_ST_F32 && s->ndim == 1 && s->shape[0] == x->rm.out;
        }
    }
    ok &= f.n == want;
    *data_start = 8 + f.header_len;
    pd_st_close(&f);
    return ok;
}

/* The small files beside the shards are written to NAME.partial and renamed over NAME: a link
 * already at NAME (a directory prepared by linking the checkpoint's files) is replaced, never
 * written through into the checkpoint, and a full disk leaves no half file under the real name. */
static int finish_partial(const char *part, const char *to, int bad, int err, pd_err *e)
{
    if (!bad && rename(part, to) == 0)
        return 0;
    if (!bad)
        err = errno;
    unlink(part);
    return pd_err_set(e, PD_EIO, "%s: cannot write: %s", to, err ? strerror(err) : "I/O error");
}

static int copy_file(const char *from, const char *to, pd_err *e)
{
    FILE *a = fopen(from, "rb");
    if (!a)
        return 0;   /* optional files */
    char part[PATH_MAX + 16];
    snprintf(part, sizeof part, "%s.partial", to);
    FILE *b = fopen(part, "wb");
    if (!b) {
        fclose(a);
        return pd_err_set(e, PD_EIO, "%s: cannot create: %s", part, strerror(errno));
    }
    char buf[65536];
    size_t k;
    int bad = 0, err = 0;
    while (!bad && (k = fread(buf, 1, sizeof buf, a)) > 0)
        if (fwrite(buf, 1, k, b) != k) {
            bad = 1;
            err = errno;
        }
    if (ferror(a)) {
        fclose(a);
        fclose(b);
        unlink(part);
        return pd_err_set(e, PD_EIO, "%s: cannot read", from);
    }
    fclose(a);
    if (fclose(b) != 0 && !bad) {
        bad = 1;
        err = errno;
    }
    return finish_partial(part, to, bad, err, e);
}

static int dump_json(json_t *j, const char *to, size_t flags, pd_err *e)
{
    char part[PATH_MAX + 16];
    snprintf(part, sizeof part, "%s.partial", to);
    errno = 0;
    int bad = json_dump_file(j, part, flags) != 0;
    return finish_partial(part, to, bad, errno, e);
}

/* The checkpoint's config.json, without the release's quantization_config (the output is int8);
 * read before any shard, so that a checkpoint without one fails at once, not after hours. */
static json_t *read_config(const char *in_dir, pd_err *e)
{
    char a[PATH_MAX];
    snprintf(a, sizeof a, "%s/config.json", in_dir);
    json_error_t je;
    json_t *c = json_load_file(a, JSON_PRESERVE_ORDER, &je);
    if (!c || !json_is_object(c)) {
        json_decref(c);
        pd_err_set(e, PD_EFORMAT, "%s: %s", a, c ? "not a JSON object" : je.text);
        return NULL;
    }
    json_object_del(c, "quantization_config");
    return c;
}

/* Whether name is one this conversion writes into the output directory (or its .partial). */
static int ours(const char *name, const struct pd_st_set *set, int has_index)
{
    static const char *const small[] = {"config.json", "tokenizer.json", "tokenizer_config.json",
                                        "generation_config.json", "chat_template.jinja"};
    char base[NAME_MAX + 1];
    snprintf(base, sizeof base, "%s", name);
    size_t n = strlen(base);
    if (n > 8 && !strcmp(base + n - 8, ".partial"))
        base[n - 8] = 0;
    for (size_t i = 0; i < sizeof small / sizeof small[0]; i++)
        if (!strcmp(base, small[i]))
            return 1;
    if (has_index && !strcmp(base, "model.safetensors.index.json"))
        return 1;
    for (size_t k = 0; k < set->nfiles; k++)
        if (!strcmp(base, base_name(set->files[k].path)))
            return 1;
    return 0;
}

/* An output directory holding another model's weights (its index, shards of other names) would
 * be loaded with them: the index wins over a new single file, and the engine ran the old model.
 * Refused naming the first such file; a directory of an earlier run of this conversion passes. */
static int check_out_dir(const char *out_dir, const struct pd_st_set *set, int has_index, pd_err *e)
{
    DIR *d = opendir(out_dir);
    if (!d)
        return pd_err_set(e, PD_EIO, "%s: cannot read the directory: %s", out_dir, strerror(errno));
    int rc = 0;
    for (struct dirent *de; !rc && (de = readdir(d));) {
        const char *n = de->d_name;
        size_t len = strlen(n);
        int weights = (len > 12 && !strcmp(n + len - 12, ".safetensors")) ||
                      (len > 20 && !strcmp(n + len - 20, ".safetensors.partial")) || strstr(n, ".safetensors.index");
        if (weights && !ours(n, set, has_index))
            rc = pd_err_set(e, PD_EINVAL, "--out %s holds %s, which this conversion does not write (another "
                            "model's weights would be loaded with these): remove it, or convert into an empty "
                            "directory", out_dir, n);
    }
    closedir(d);
    return rc;
}

struct bufs {
    float *row, *scales;
    int8_t *q;
    char *chunk;
};

static int convert_shard(const struct pd_convert_opts *o, const struct pd_st_set *set, size_t k, struct item *it,
                         size_t n, struct bufs *bf, struct pd_convert_stats *st, struct pd_convert_progress *pg,
                         pd_err *e)
{
    const struct pd_st_file *f = &set->files[k];
    char path[PATH_MAX], part[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/%s", o->out_dir, base_name(f->path));
    snprintf(part, sizeof part, "%s.partial", path);
    uint64_t hlen, data;
    char *h = header(it, n, &hlen, &data);
    if (!h)
        return pd_err_set(e, PD_ENOMEM, "%s: out of memory", f->path);
    st->out_bytes += data;
    uint64_t base0 = pg->done, start;
    /* restart: a complete shard from an earlier run is verified and kept */
    if (access(path, F_OK) == 0 && header_matches(path, it, n, &start)) {
        int fd = open(path, O_RDONLY);
        int rc = fd < 0;
        double mr = st->max_rel_err;
        uint64_t since = 0;
        for (size_t i = 0; i < n && !rc; i++) {
            pd_err ve = {0};
            rc = verify_item(fd, start, &it[i], path, bf->row, bf->scales, bf->q, bf->chunk, &mr, &ve);
            if ((since += src_bytes(&it[i])) >= DROP_EVERY) {
                drop_all(set);
                since = 0;
            }
        }
        drop_all(set);
        if (fd >= 0)
            close(fd);
        if (!rc) {
            free(h);
            unlink(part);   /* an interrupted later attempt's leftover, if any */
            st->skipped++;
            st->max_rel_err = mr;
            pg->skipped = 1;
            for (size_t i = 0; i < n; i++)
                pg->done += src_bytes(&it[i]);
            if (o->progress)
                o->progress(o->ctx, pg);
            pg->skipped = 0;
            return 0;
        }
    }
    int fd = open(part, O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) {
        free(h);
        return pd_err_set(e, PD_EIO, "%s: cannot create: %s", part, strerror(errno));
    }
    struct wbuf w = {.fd = fd, .b = bf->chunk};
    uint64_t le = hlen;
    unsigned char lenb[8];
    for (int i = 0; i < 8; i++)
        lenb[i] = (unsigned char)(le >> (8 * i));
    wput(&w, lenb, 8);
    wput(&w, h, hlen);
    free(h);
    int rc = 0;
    uint64_t since = 0;
    for (size_t i = 0; i < n && !rc && !w.err; i++) {
        rc = write_item(&w, &it[i], bf->row, bf->q, bf->scales, e);
        if ((since += src_bytes(&it[i])) >= DROP_EVERY) {
            drop_all(set);
            since = 0;
        }
        st->tensors += it[i].rm.fmt == PD_RELEASE_NONE || it[i].bf16 ? 1 : 2;
        st->matrices += it[i].rm.fmt != PD_RELEASE_NONE && !it[i].bf16;
        st->bf16 += it[i].bf16;
        pg->done += src_bytes(&it[i]);
        if (o->progress)
            o->progress(o->ctx, pg);
    }
    if (!rc && !w.err)
        wflush(&w);
    if (!rc && w.err)
        rc = pd_err_set(e, PD_EIO, "%s: write failed: %s", part, strerror(w.err));
    /* every output tensor read back and checked against its source */
    char *vchunk = malloc(CHUNK);
    if (!rc && !vchunk)
        rc = pd_err_set(e, PD_ENOMEM, "%s: out of memory", part);
    drop_all(set);
    since = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        rc = verify_item(fd, 8 + hlen, &it[i], part, bf->row, bf->scales, bf->q, vchunk, &st->max_rel_err, e);
        if ((since += src_bytes(&it[i])) >= DROP_EVERY) {
            drop_all(set);
            since = 0;
        }
    }
    drop_all(set);
    free(vchunk);
    if (!rc && fsync(fd))
        rc = pd_err_set(e, PD_EIO, "%s: fsync: %s", part, strerror(errno));
    if (!rc)
        pd_st_uncache(fd, (size_t)lseek(fd, 0, SEEK_END));
    close(fd);
    if (!rc && rename(part, path))
        rc = pd_err_set(e, PD_EIO, "%s: cannot rename to %s: %s", part, path, strerror(errno));
    if (rc) {
        unlink(part);
        pg->done = base0;
        return rc;
    }
    st->converted++;
    return 0;
}

int pd_convert(const struct pd_convert_opts *o, struct pd_convert_stats *st, pd_err *e)
{
    memset(st, 0, sizeof *st);
    char ra[PATH_MAX], rb[PATH_MAX], a[PATH_MAX], b[PATH_MAX];
    /* the checkpoint first: one without a config.json (or none at all) fails before any shard is
     * converted and before the output directory is made */
    json_t *config = read_config(o->in_dir, e);
    if (!config)
        return e->code;
    snprintf(a, sizeof a, "%s/model.safetensors.index.json", o->in_dir);
    const int has_index = access(a, F_OK) == 0;
    struct pd_st_set set;
    int rc = pd_st_open_dir(o->in_dir, 0, &set, e);
    if (rc) {
        json_decref(config);
        return rc;
    }
    int lfd = -1;
    char lock[PATH_MAX + 32];
    snprintf(lock, sizeof lock, "%s/.pdmoe-convert.lock", o->out_dir);
    if (mkdir(o->out_dir, 0755) && errno != EEXIST)
        rc = pd_err_set(e, PD_EIO, "%s: cannot create the directory: %s", o->out_dir, strerror(errno));
    else if (realpath(o->in_dir, ra) && realpath(o->out_dir, rb) && strcmp(ra, rb) == 0)
        rc = pd_err_set(e, PD_EINVAL, "--out %s is the checkpoint's own directory", o->out_dir);
    /* one conversion at a time into a directory: two shared their .partial files and unlinked
     * each other's */
    else if ((lfd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0644)) < 0)
        rc = pd_err_set(e, PD_EIO, "%s: cannot create: %s", lock, strerror(errno));
    else if (flock(lfd, LOCK_EX | LOCK_NB))
        rc = pd_err_set(e, PD_EINVAL, "--out %s: another pdmoe convert is writing it (%s is locked)", o->out_dir,
                        lock);
    else
        rc = check_out_dir(o->out_dir, &set, has_index, e);
    if (rc) {
        if (lfd >= 0)
            close(lfd);
        pd_st_close_dir(&set);
        json_decref(config);
        return rc;
    }
    size_t maxn = 0;
    int maxin = 1, maxout = 1;
    for (size_t k = 0; k < set.nfiles; k++) {
        maxn = set.files[k].n > maxn ? set.files[k].n : maxn;
        for (size_t i = 0; i < set.files[k].n; i++) {
            const struct pd_st_tensor *t = &set.files[k].tensors[i];
            st->in_bytes += t->end - t->begin;
            if (t->ndim == 2 && t->shape[0] <= INT_MAX && t->shape[1] <= INT_MAX / 2) {
                int in = (int)(2 * t->shape[1]), out = (int)t->shape[0];
                maxin = in > maxin ? in : maxin;
                maxout = out > maxout ? out : maxout;
            }
        }
    }
    struct item *it = calloc(maxn ? maxn : 1, sizeof *it);
    struct bufs bf = {.row = malloc((size_t)maxin * 4), .scales = malloc((size_t)maxout * 4), .q = malloc(2 * (size_t)maxin),
                      .chunk = malloc(CHUNK)};
    json_t *idx = json_object(), *map = json_object();
    if (!it || !bf.row || !bf.scales || !bf.q || !bf.chunk || !idx || !map) {
        rc = pd_err_set(e, PD_ENOMEM, "%s: out of memory", o->in_dir);
        goto out;
    }
    st->shards = (int)set.nfiles;
    struct pd_convert_progress pg = {.nshards = (int)set.nfiles, .total = st->in_bytes};
    for (size_t k = 0; k < set.nfiles && !rc; k++) {
        size_t n;
        pg.shard = (int)k;
        pg.file = base_name(set.files[k].path);
        if (!(rc = plan_shard(&set, &set.files[k], it, &n, e)))
            rc = convert_shard(o, &set, k, it, n, &bf, st, &pg, e);
        for (size_t i = 0; i < n && !rc; i++) {
            json_object_set_new(map, it[i].src->name, json_string(pg.file));
            if (it[i].rm.fmt != PD_RELEASE_NONE && !it[i].bf16)
                json_object_set_new(map, it[i].scale_name, json_string(pg.file));
        }
    }
    if (!rc && has_index) {
        snprintf(b, sizeof b, "%s/model.safetensors.index.json", o->out_dir);
        json_object_set_new(idx, "metadata", json_pack("{s:I}", "total_size", (json_int_t)st->out_bytes));
        json_object_set(idx, "weight_map", map);
        rc = dump_json(idx, b, JSON_INDENT(2) | JSON_SORT_KEYS, e);
    }
    if (!rc) {
        snprintf(b, sizeof b, "%s/config.json", o->out_dir);
        rc = dump_json(config, b, JSON_INDENT(2) | JSON_PRESERVE_ORDER, e);
    }
    /* the tokenizer and the chat template (transformers reads chat_template.jinja first, and so
     * does the engine: without it a converted V3 checkpoint would chat in V4's encoding) */
    static const char *const extra[] = {"tokenizer.json", "tokenizer_config.json", "generation_config.json",
                                        "chat_template.jinja"};
    for (int i = 0; i < (int)(sizeof extra / sizeof extra[0]) && !rc; i++) {
        snprintf(a, sizeof a, "%s/%s", o->in_dir, extra[i]);
        snprintf(b, sizeof b, "%s/%s", o->out_dir, extra[i]);
        rc = copy_file(a, b, e);
    }
out:
    json_decref(config);
    unlink(lock);   /* unlinked while held: a convert that found it locked has stopped */
    close(lfd);
    json_decref(idx);
    json_decref(map);
    free(it);
    free(bf.row);
    free(bf.scales);
    free(bf.q);
    free(bf.chunk);
    pd_st_close_dir(&set);
    return rc;
}

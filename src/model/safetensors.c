/* Safetensors reader and writer: the header's JSON (jansson), its validation against the
 * reference crate's rules, the mmap'ed or header-only open, sharded checkpoint directories
 * (model.safetensors.index.json) and the atomic writer. Every error is one line naming the
 * file and the tensor or field at fault; nothing here prints. */
#include "core/text.h"
#include "model/safetensors.h"
#include "core/file.h"
#include "core/mem.h"
#include "core/units.h"

#include <assert.h>
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static const struct {
    const char *name;
    size_t size;
} dtypes[PD_ST_DTYPE_COUNT] = {
    [PD_ST_BOOL] = {"BOOL", 1},      [PD_ST_U8] = {"U8", 1},
    [PD_ST_I8] = {"I8", 1},          [PD_ST_I16] = {"I16", 2},
    [PD_ST_U16] = {"U16", 2},        [PD_ST_F16] = {"F16", 2},
    [PD_ST_BF16] = {"BF16", 2},      [PD_ST_I32] = {"I32", 4},
    [PD_ST_U32] = {"U32", 4},        [PD_ST_F32] = {"F32", 4},
    [PD_ST_F64] = {"F64", 8},        [PD_ST_I64] = {"I64", 8},
    [PD_ST_U64] = {"U64", 8},        [PD_ST_F8_E4M3] = {"F8_E4M3", 1},
    [PD_ST_F8_E5M2] = {"F8_E5M2", 1}, [PD_ST_F8_E8M0] = {"F8_E8M0", 1},
};

size_t pd_st_dtype_size(enum pd_st_dtype d)
{
    return (unsigned)d < PD_ST_DTYPE_COUNT ? dtypes[d].size : 0;
}

const char *pd_st_dtype_name(enum pd_st_dtype d)
{
    return (unsigned)d < PD_ST_DTYPE_COUNT ? dtypes[d].name : "unknown";
}

int pd_st_dtype_parse(const char *s, enum pd_st_dtype *d)
{
    if (!s)
        return PD_EINVAL;
    for (int i = 0; i < PD_ST_DTYPE_COUNT; i++) {
        if (strcmp(s, dtypes[i].name) == 0) {
            *d = (enum pd_st_dtype)i;
            return 0;
        }
    }
    return PD_EINVAL;
}

/* Names come from untrusted files, and so does jansson's error text, which quotes the input
 * near the error: a printable, bounded copy keeps the message on one line and leaves room for
 * the reason after it. */
#define NAME_SHOWN 128
static const char *shown(char out[NAME_SHOWN + 4], const char *name)
{
    size_t i = 0;
    for (; name[i] && i < NAME_SHOWN; i++) {
        unsigned char c = (unsigned char)name[i];
        out[i] = (c < 0x20 || c == 0x7f) ? '?' : (char)c;
    }
    if (name[i]) {
        memcpy(out + i, "...", 3);
        i += 3;
    }
    out[i] = '\0';
    return out;
}

/* Element count of a shape, left to right as the reference does, so [huge, huge, 0] is an
 * overflow even though its product is 0. Returns false on overflow. */
static bool shape_bytes(const int64_t *shape, int ndim, size_t dsize, uint64_t *bytes)
{
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0 || __builtin_mul_overflow(n, (uint64_t)shape[i], &n))
            return false;
    }
    return !__builtin_mul_overflow(n, (uint64_t)dsize, bytes);
}

static void free_tensors(struct pd_st_file *f)
{
    for (size_t i = 0; i < f->n; i++)
        free(f->tensors[i].name);
    free(f->tensors);
    f->tensors = NULL;
    f->n = 0;
}

/* The files mapped now, for the SIGBUS handler (pd_st_catch_truncation): a read of a page past a
 * mapped file's end, once the file was truncated or rewritten in place, is a SIGBUS, which took
 * the server down as "Bus error" (UCX's backtrace of it under serve) without naming the file. */
#define MAPS_MAX 1024
static struct mapping {
    _Atomic(const char *) base;   /* NULL: a free slot */
    size_t len;
    char path[240];
} maps[MAPS_MAX];
static struct sigaction bus_before;

static void map_note(const void *base, size_t len, const char *path)
{
    for (int i = 0; i < MAPS_MAX; i++)
        if (!atomic_load(&maps[i].base)) {
            maps[i].len = len;
            snprintf(maps[i].path, sizeof maps[i].path, "%s", path);
            atomic_store(&maps[i].base, (const char *)base);
            return;
        }
}

static void map_forget(const void *base)
{
    for (int i = 0; i < MAPS_MAX; i++)
        if (atomic_load(&maps[i].base) == base)
            atomic_store(&maps[i].base, NULL);
}

static void on_bus(int sig, siginfo_t *si, void *ctx)
{
    const char *at = si->si_addr;
    for (int i = 0; i < MAPS_MAX; i++) {
        const char *b = atomic_load(&maps[i].base);
        if (b && at >= b && at < b + maps[i].len) {
            static const char a[] = "pdmoe: ", z[] = ": the file changed while this process had it mapped (truncated, or "
                                     "rewritten in place): a read met its end and the process cannot go on. Replace "
                                     "a checkpoint by writing it elsewhere and restarting on it, not in place.\n";
            ssize_t w = write(2, a, sizeof a - 1);
            w += write(2, maps[i].path, strlen(maps[i].path));
            w += write(2, z, sizeof z - 1);
            (void)w;
            _exit(1);
        }
    }
    /* not a checkpoint's page: whoever handled SIGBUS before (UCX's backtrace, or the default) */
    if ((bus_before.sa_flags & SA_SIGINFO) && bus_before.sa_sigaction) {
        bus_before.sa_sigaction(sig, si, ctx);
        return;
    }
    sigaction(SIGBUS, &bus_before, NULL);   /* the fault comes again, to it */
}

void pd_st_catch_truncation(void)
{
    struct sigaction sa = {.sa_sigaction = on_bus, .sa_flags = SA_SIGINFO};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &bus_before);
}

void pd_st_close(struct pd_st_file *f)
{
    if (!f)
        return;
    free_tensors(f);
    if (f->map)
        map_forget(f->map);
    if (f->map)
        munmap(f->map, f->file_size);
    free(f->path);
    memset(f, 0, sizeof *f);
}

/* The file read-only at an address that is a multiple of 2 MiB, advised MADV_HUGEPAGE, so that
 * where the kernel keeps the file's page cache in 2 MiB folios (file systems with large folios,
 * e.g. ext4 on Linux 6.18; faults under MADV_HUGEPAGE read ahead in such folios) it maps them whole:
 * one TLB entry for 2 MiB of weights instead of 512. A decode step reads a few experts' matrices
 * (128 KiB each in v4-flash-mini) scattered over the file, and each 4 KiB page of them was a TLB
 * miss and a stop for the hardware prefetchers. Measured on an AVX2-only AMD EPYC, 1 thread, in
 * one process alternating the two (6 of 256 experts x 7-8 layers of v4-flash-mini's shapes through
 * pd_gemm_grouped): the checkpoint file in 4 KiB against 2 MiB pages 13.8-14.0 against 14.9-15.3
 * GB/s (1.06-1.09x); anonymous memory 13.6-14.3 against 15.9-16.0 (1.12-1.17x). The experts are
 * about half of a batch-1 decode step, and bench decode did not resolve the 3-4% from that host's
 * noise. Files under 2 MiB, or a kernel that refuses the advice, keep a plain mapping: advice
 * only. pd_st_pmd_mapped_bytes says how much of a mapping the kernel did map so. */
enum { HUGE_PAGE = 2 << 20 };

static void *map_file(int fd, size_t size)
{
    /* a reservation one huge page longer, the file mapped over its first aligned address, the
     * rest of the reservation given back */
    const size_t pg = (size_t)sysconf(_SC_PAGESIZE), len = (size + pg - 1) & ~(pg - 1);
    char *r = size < HUGE_PAGE ? MAP_FAILED
                               : mmap(NULL, len + HUGE_PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r == MAP_FAILED)
        return mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    char *a = (char *)(((uintptr_t)r + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    void *m = mmap(a, size, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd, 0);
    if (m == MAP_FAILED) {
        const int err = errno;
        munmap(r, len + HUGE_PAGE);
        errno = err;
        return MAP_FAILED;
    }
    if (a > r)
        munmap(r, (size_t)(a - r));
    munmap(a + len, (size_t)(r + HUGE_PAGE - a));   /* a < r + HUGE_PAGE: a tail is always left */
#ifdef MADV_HUGEPAGE
    (void)madvise(m, size, MADV_HUGEPAGE);
#endif
    return m;
}

void pd_st_uncache(int fd, size_t size)
{
    if (size >= HUGE_PAGE)
        (void)posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
}

size_t pd_st_pmd_mapped_bytes(const struct pd_st_set *s)
{
    FILE *fp = fopen("/proc/self/smaps", "r");
    if (!fp)
        return 0;
    char line[512];
    size_t total = 0;
    int in = 0;
    while (fgets(line, sizeof line, fp)) {
        unsigned long lo, hi;
        size_t kb;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' ')) {
            in = 0;
            for (size_t i = 0; s && i < s->nfiles; i++) {
                const uintptr_t b = (uintptr_t)s->files[i].map;
                if (b && lo < b + s->files[i].file_size && hi > b)
                    in = 1;
            }
        } else if (in && sscanf(line, "FilePmdMapped: %zu kB", &kb) == 1) {
            total += kb << 10;
        }
    }
    fclose(fp);
    return total;
}

/* A JSON integer that must be >= 0, as the reference's usize fields. */
static bool get_uint(const json_t *v, uint64_t *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < 0)
        return false;
    *out = (uint64_t)json_integer_value(v);
    return true;
}

static int parse_entry(const char *label, const char *name, json_t *v, uint64_t data_len,
                       struct pd_st_tensor *t, pd_err *e)
{
    char nm[NAME_SHOWN + 4];
    shown(nm, name);
    if (!json_is_object(v))
        return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\": entry is not a JSON object", label,
                          nm);

    json_t *dt = json_object_get(v, "dtype");
    if (!json_is_string(dt))
        return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\": \"dtype\" missing or not a string",
                          label, nm);
    if (pd_st_dtype_parse(json_string_value(dt), &t->dtype) != 0) {
        char dn[NAME_SHOWN + 4];
        return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\": unknown dtype \"%s\"", label, nm,
                          shown(dn, json_string_value(dt)));
    }

    json_t *sh = json_object_get(v, "shape");
    if (!json_is_array(sh))
        return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\": \"shape\" missing or not an array",
                          label, nm);
    size_t nd = json_array_size(sh);
    if (nd > PD_ST_MAX_DIMS)
        return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\": shape has %zu dimensions, at most %d",
                          label, nm, nd, PD_ST_MAX_DIMS);
    t->ndim = (int)nd;
    for (size_t i = 0; i < nd; i++) {
        uint64_t d;
        json_t *x = json_array_get(sh, i);
        if (!get_uint(x, &d)) {
            if (json_is_integer(x))
                return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\": shape[%zu] = %lld is negative",
                                  label, nm, i, (long long)json_integer_value(x));
            return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\": shape[%zu] is not an integer",
                              label, nm, i);
        }
        t->shape[i] = (int64_t)d;
    }
    uint64_t bytes;
    if (!shape_bytes(t->shape, t->ndim, pd_st_dtype_size(t->dtype), &bytes))
        return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\": shape product overflows", label, nm);

    json_t *off = json_object_get(v, "data_offsets");
    if (!json_is_array(off) || json_array_size(off) != 2 ||
        !get_uint(json_array_get(off, 0), &t->begin) || !get_uint(json_array_get(off, 1), &t->end))
        return pd_err_set(e, PD_EFORMAT,
                          "%s: tensor \"%s\": \"data_offsets\" must be [begin, end] with two "
                          "non-negative integers",
                          label, nm);
    if (t->begin > t->end)
        return pd_err_set(e, PD_EFORMAT,
                          "%s: tensor \"%s\": data_offsets [%llu, %llu] have begin > end", label,
                          nm,
                          (unsigned long long)t->begin, (unsigned long long)t->end);
    if (t->end - t->begin != bytes) {
        char dims[PD_ST_MAX_DIMS * 21 + 2] = "[";
        for (int i = 0; i < t->ndim; i++)
            snprintf(dims + strlen(dims), sizeof dims - strlen(dims), "%s%lld", i ? ", " : "",
                     (long long)t->shape[i]);
        strcat(dims, "]");
        return pd_err_set(e, PD_EFORMAT,
                          "%s: tensor \"%s\": data_offsets [%llu, %llu] but shape %s x %s needs "
                          "%llu bytes",
                          label, nm, (unsigned long long)t->begin, (unsigned long long)t->end, dims,
                          pd_st_dtype_name(t->dtype), (unsigned long long)bytes);
    }
    if (t->end > data_len)
        return pd_err_set(e, PD_EFORMAT,
                          "%s: tensor \"%s\": data_offsets [%llu, %llu] extend beyond the data "
                          "section (%llu bytes)",
                          label, nm, (unsigned long long)t->begin, (unsigned long long)t->end,
                          (unsigned long long)data_len);
    return 0;
}

static int cmp_offsets(const void *a, const void *b)
{
    const struct pd_st_tensor *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(((const struct pd_st_tensor *)a)->name, ((const struct pd_st_tensor *)b)->name);
}

/* Sorted by (begin, end) the tensors must tile [0, data_len) exactly; zero-sized tensors sort
 * before a tensor starting at the same offset, so they never look like overlaps. */
static int check_layout(const char *label, struct pd_st_file *f, uint64_t data_len, pd_err *e)
{
    char nm[NAME_SHOWN + 4], pn[NAME_SHOWN + 4];
    qsort(f->tensors, f->n, sizeof *f->tensors, cmp_offsets);
    uint64_t cursor = 0;
    for (size_t i = 0; i < f->n; i++) {
        const struct pd_st_tensor *t = &f->tensors[i];
        if (t->begin > cursor) {
            if (i == 0)
                return pd_err_set(e, PD_EFORMAT,
                                  "%s: tensor \"%s\": data_offsets [%llu, %llu] leave a gap: the "
                                  "data section starts at 0",
                                  label, shown(nm, t->name), (unsigned long long)t->begin,
                                  (unsigned long long)t->end);
            return pd_err_set(e, PD_EFORMAT,
                              "%s: tensor \"%s\": data_offsets [%llu, %llu] leave a gap after "
                              "tensor \"%s\" which ends at %llu",
                              label, shown(nm, t->name), (unsigned long long)t->begin,
                              (unsigned long long)t->end, shown(pn, f->tensors[i - 1].name),
                              (unsigned long long)cursor);
        }
        if (t->begin < cursor) {
            const struct pd_st_tensor *p = &f->tensors[i - 1];
            return pd_err_set(e, PD_EFORMAT,
                              "%s: tensor \"%s\": data_offsets [%llu, %llu] overlap tensor \"%s\" "
                              "[%llu, %llu]",
                              label, shown(nm, t->name), (unsigned long long)t->begin,
                              (unsigned long long)t->end, shown(pn, p->name),
                              (unsigned long long)p->begin, (unsigned long long)p->end);
        }
        cursor = t->end;
    }
    /* parse_entry already bounded every end by data_len, so only a shortfall is left. */
    assert(cursor <= data_len);
    if (cursor != data_len) {
        if (f->n == 0)
            return pd_err_set(e, PD_EFORMAT,
                              "%s: no tensors but the data section holds %llu bytes", label,
                              (unsigned long long)data_len);
        return pd_err_set(e, PD_EFORMAT,
                          "%s: %llu trailing bytes after the last tensor \"%s\" (ends at %llu, "
                          "data section is %llu bytes)",
                          label, (unsigned long long)(data_len - cursor),
                          shown(nm, f->tensors[f->n - 1].name), (unsigned long long)cursor,
                          (unsigned long long)data_len);
    }
    return 0;
}

static uint64_t le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

/* The 8-byte length prefix (read only when the file has 8 bytes): bounded first, so 8 + N
 * cannot overflow, then inside the file. */
static int check_header_len(const char *label, const uint8_t *prefix, size_t file_size,
                            uint64_t *hlen, pd_err *e)
{
    if (file_size < 8)
        return pd_err_set(e, PD_EFORMAT,
                          "%s: file is %zu bytes, too short for the 8-byte header length", label,
                          file_size);
    uint64_t n = le64(prefix);
    if (n > PD_ST_MAX_HEADER)
        return pd_err_set(e, PD_EFORMAT, "%s: header length %llu exceeds the limit of %llu bytes",
                          label, (unsigned long long)n, PD_ST_MAX_HEADER);
    if (8 + n > file_size)
        return pd_err_set(e, PD_EFORMAT,
                          "%s: header length %llu but the file holds only %zu bytes after the "
                          "8-byte prefix",
                          label, (unsigned long long)n, file_size - 8);
    *hlen = n;
    return 0;
}

/* jansson reports a duplicate key without naming it; its error position is just past the key's
 * closing quote, so the key is the JSON string that ends there. Returns false if it cannot be
 * recovered (the message then goes without the name). */
static bool duplicate_key(const char *hdr, size_t hlen, size_t pos, char *out, size_t outsz)
{
    if (pos == 0 || pos > hlen || hdr[pos - 1] != '"')
        return false;
    size_t close = pos - 1;
    for (size_t j = close; j-- > 0;) {
        if (hdr[j] != '"')
            continue;
        size_t bs = 0;
        while (bs < j && hdr[j - 1 - bs] == '\\')
            bs++;
        if (bs % 2)
            continue;
        json_t *s = json_loadb(hdr + j, close - j + 1, JSON_DECODE_ANY, NULL);
        bool ok = json_is_string(s);
        if (ok) {
            char tmp[NAME_SHOWN + 4];
            snprintf(out, outsz, "%s", shown(tmp, json_string_value(s)));
        }
        json_decref(s);
        return ok;
    }
    return false;
}

static int load_header_json(const char *label, const char *hdr, size_t hlen, json_t **out,
                            pd_err *e)
{
    json_error_t je;
    json_t *root = json_loadb(hdr, hlen, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        char key[NAME_SHOWN + 4];
        /* (jansson's allocations failing: no text when its first one did; the file is not at fault) */
        if (json_error_code(&je) == json_error_out_of_memory || !je.text[0]) {
            char note[320];
            pd_as_note(note, sizeof note, (int64_t)hlen);
            return pd_err_set(e, *note ? PD_EINVAL : PD_ENOMEM, "%s: out of memory reading its header (%zu bytes)%s%s",
                              label, hlen, *note ? ": " : "", note);
        }
        if (json_error_code(&je) == json_error_duplicate_key &&
            duplicate_key(hdr, hlen, (size_t)je.position, key, sizeof key))
            return pd_err_set(e, PD_EFORMAT,
                              "%s: header JSON: duplicate name \"%s\" (line %d, column %d)", label,
                              key, je.line, je.column);
        return pd_err_set(e, PD_EFORMAT, "%s: header is not valid JSON: %s (line %d, column %d)",
                          label, shown(key, je.text), je.line, je.column);
    }
    if (!json_is_object(root)) {
        json_decref(root);
        return pd_err_set(e, PD_EFORMAT, "%s: header JSON is not an object", label);
    }
    /* The reference rejects leading whitespace so that a header is always recognisable by its
     * first byte. */
    if (hdr[0] != '{') {
        json_decref(root);
        return pd_err_set(e, PD_EFORMAT, "%s: header does not start with '{'", label);
    }
    *out = root;
    return 0;
}

static int check_metadata(const char *label, json_t *md, pd_err *e)
{
    if (!json_is_object(md))
        return pd_err_set(e, PD_EFORMAT, "%s: \"__metadata__\" is not an object", label);
    const char *k;
    json_t *v;
    json_object_foreach(md, k, v) {
        char kn[NAME_SHOWN + 4];
        if (!json_is_string(v))
            return pd_err_set(e, PD_EFORMAT,
                              "%s: \"__metadata__\": value of \"%s\" is not a string", label,
                              shown(kn, k));
    }
    return 0;
}

/* Parses and validates the N header bytes; `data` is the data section when the whole file is
 * in memory, NULL for a header-only open. f->path, file_size and header_len are already set. */
static int parse_header(const char *label, const char *hdr, const uint8_t *data,
                        struct pd_st_file *f, pd_err *e)
{
    uint64_t data_len = f->file_size - 8 - f->header_len;
    json_t *root;
    int rc = load_header_json(label, hdr, f->header_len, &root, e);
    if (rc)
        return rc;

    size_t cap = json_object_size(root);
    json_t *md = json_object_get(root, "__metadata__");
    if (md && (rc = check_metadata(label, md, e)))
        goto out;
    f->tensors = calloc(cap ? cap : 1, sizeof *f->tensors);
    if (!f->tensors) {
        rc = pd_err_set(e, PD_ENOMEM, "%s: out of memory for %zu tensors", label, cap);
        goto out;
    }
    const char *name;
    json_t *v;
    json_object_foreach(root, name, v) {
        if (strcmp(name, "__metadata__") == 0)
            continue;
        if (pd_text_bad_at(name) >= 0) {   /* names reach terminals and reports: no ESC sequences */
            char buf[NAME_SHOWN + 4];
            rc = pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\": a control character in its name", label, shown(buf, name));
            goto out;
        }
        struct pd_st_tensor *t = &f->tensors[f->n];
        if (!(t->name = strdup(name))) {
            rc = pd_err_set(e, PD_ENOMEM, "%s: out of memory", label);
            goto out;
        }
        f->n++;
        if ((rc = parse_entry(label, name, v, data_len, t, e)))
            goto out;
    }
    if ((rc = check_layout(label, f, data_len, e)))
        goto out;
    qsort(f->tensors, f->n, sizeof *f->tensors, cmp_names);
    for (size_t i = 0; i < f->n; i++) {
        assert(i == 0 || strcmp(f->tensors[i - 1].name, f->tensors[i].name) < 0);
        f->tensors[i].data = data ? data + f->tensors[i].begin : NULL;
    }
out:
    json_decref(root);
    return rc;
}

int pd_st_parse(const void *buf, size_t len, const char *label, struct pd_st_file *f, pd_err *e)
{
    memset(f, 0, sizeof *f);
    if (!label)
        label = "<memory>";
    const uint8_t *b = buf;
    if (!(f->path = strdup(label)))
        return pd_err_set(e, PD_ENOMEM, "%s: out of memory", label);
    f->file_size = len;
    int rc = check_header_len(label, b, len, &f->header_len, e);
    if (!rc)
        rc = parse_header(label, (const char *)b + 8, b + 8 + f->header_len, f, e);
    if (rc)
        pd_st_close(f);
    return rc;
}

static int pread_full(int fd, void *buf, size_t len, off_t off)
{
    uint8_t *p = buf;
    while (len) {
        ssize_t r = pread(fd, p, len, off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return r < 0 ? errno : EIO;
        p += r;
        len -= (size_t)r;
        off += r;
    }
    return 0;
}

static int open_fd(const char *path, int fd, int flags, struct pd_st_file *f, pd_err *e)
{
    struct stat st;
    if (fstat(fd, &st) != 0)
        return pd_err_set(e, PD_EIO, "%s: cannot stat: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode))
        return pd_err_set(e, PD_EIO, "%s: not a regular file", path);
    if (!(f->path = strdup(path)))
        return pd_err_set(e, PD_ENOMEM, "%s: out of memory", path);
    f->file_size = (size_t)st.st_size;
    if (f->file_size < 8)
        return check_header_len(path, NULL, f->file_size, &f->header_len, e);

    if (!(flags & PD_ST_HEADER_ONLY)) {
        void *m = map_file(fd, f->file_size);
        if (m == MAP_FAILED) {
            const int err = errno;
            char note[320] = "";
            if (err == ENOMEM)
                pd_as_note(note, sizeof note, (int64_t)f->file_size);
            if (*note) {
                char sz[32];
                return pd_err_set(e, PD_EINVAL, "%s: cannot map its %s: %s", path,
                                  pd_units_fmt(sz, sizeof sz, (int64_t)f->file_size, PD_UNITS_GIB), note);
            }
            return pd_err_set(e, PD_EIO, "%s: cannot map %zu bytes: %s", path, f->file_size,
                              strerror(err));
        }
        f->map = m;
        map_note(m, f->file_size, path);
        int rc = check_header_len(path, m, f->file_size, &f->header_len, e);
        if (rc)
            return rc;
        const uint8_t *b = m;
        return parse_header(path, (const char *)b + 8, b + 8 + f->header_len, f, e);
    }

    uint8_t prefix[8];
    int err = pread_full(fd, prefix, 8, 0);
    if (err)
        return pd_err_set(e, PD_EIO, "%s: cannot read the header length: %s", path, strerror(err));
    int rc = check_header_len(path, prefix, f->file_size, &f->header_len, e);
    if (rc)
        return rc;
    char *hdr = malloc(f->header_len ? f->header_len : 1);
    if (!hdr)
        return pd_err_set(e, PD_ENOMEM, "%s: out of memory for a %llu-byte header", path,
                          (unsigned long long)f->header_len);
    if ((err = pread_full(fd, hdr, f->header_len, 8)))
        rc = pd_err_set(e, PD_EIO, "%s: cannot read the %llu-byte header: %s", path,
                        (unsigned long long)f->header_len, strerror(err));
    else
        rc = parse_header(path, hdr, NULL, f, e);
    free(hdr);
    return rc;
}

int pd_st_open(const char *path, int flags, struct pd_st_file *f, pd_err *e)
{
    memset(f, 0, sizeof *f);
    int fd = pd_file_open(path, e);
    if (fd < 0)
        return fd;
    int rc = open_fd(path, fd, flags, f, e);
    close(fd);
    if (rc)
        pd_st_close(f);
    return rc;
}

const struct pd_st_tensor *pd_st_find(const struct pd_st_file *f, const char *name)
{
    size_t lo = 0, hi = f->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(name, f->tensors[mid].name);
        if (c == 0)
            return &f->tensors[mid];
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

static char *join(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p)
        snprintf(p, n, "%s/%s", dir, name);
    return p;
}

void pd_st_close_dir(struct pd_st_set *s)
{
    if (!s)
        return;
    for (size_t i = 0; i < s->nfiles; i++)
        pd_st_close(&s->files[i]);
    free(s->files);
    memset(s, 0, sizeof *s);
}

const struct pd_st_tensor *pd_st_set_find(const struct pd_st_set *s, const char *name)
{
    for (size_t i = 0; i < s->nfiles; i++) {
        const struct pd_st_tensor *t = pd_st_find(&s->files[i], name);
        if (t) {
            ((struct pd_st_tensor *)t)->used = 1;   /* (the set's own, heap-allocated) */
            return t;
        }
    }
    return NULL;
}

size_t pd_st_set_unused(const struct pd_st_set *s, const char *except, const char **first, const char **file)
{
    size_t n = 0, skip = except ? strlen(except) : 0;
    *first = *file = NULL;
    for (size_t i = 0; i < s->nfiles; i++)
        for (size_t k = 0; k < s->files[i].n; k++)
            if (!s->files[i].tensors[k].used && !(skip && !strncmp(s->files[i].tensors[k].name, except, skip)) &&
                n++ == 0) {
                *first = s->files[i].tensors[k].name;
                *file = s->files[i].path;
            }
    return n;
}

/* A shard name is a plain file name inside the checkpoint directory: an index must not reach
 * outside it. */
static bool shard_name_ok(const char *s)
{
    return s[0] && !strchr(s, '/') && !strstr(s, "..");
}

/* Opens every distinct shard named by the index once, then checks the index against them: each
 * listed tensor is in the shard it names, and no tensor is in two shards. */
static int open_index(const char *dir, const char *idx, int flags, struct pd_st_set *s,
                      pd_err *e)
{
    json_error_t je;
    size_t len;
    char *text = pd_file_read(idx, (size_t)1 << 28, &len, e);
    if (!text)
        return e->code;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    free(text);
    char nm[NAME_SHOWN + 4], sn[NAME_SHOWN + 4];
    if (!root)
        return pd_err_set(e, PD_EFORMAT, "%s: not valid JSON: %s (line %d, column %d)", idx,
                          shown(nm, je.text), je.line, je.column);
    int rc = 0;
    json_t *shard_ix = json_object(); /* shard file name -> index in s->files */
    json_t *wm = json_object_get(root, "weight_map");
    if (!shard_ix) {
        rc = pd_err_set(e, PD_ENOMEM, "%s: out of memory", idx);
        goto out;
    }
    if (!json_is_object(root) || !json_is_object(wm)) {
        rc = pd_err_set(e, PD_EFORMAT, "%s: \"weight_map\" missing or not an object", idx);
        goto out;
    }
    if (json_object_size(wm) == 0) {
        rc = pd_err_set(e, PD_EFORMAT, "%s: \"weight_map\" is empty", idx);
        goto out;
    }
    const char *name;
    json_t *v;
    json_object_foreach(wm, name, v) {
        if (!json_is_string(v)) {
            rc = pd_err_set(e, PD_EFORMAT, "%s: weight_map[\"%s\"] is not a string", idx,
                            shown(nm, name));
            goto out;
        }
        const char *shard = json_string_value(v);
        if (!shard_name_ok(shard)) {
            rc = pd_err_set(e, PD_EFORMAT,
                            "%s: weight_map[\"%s\"] = \"%s\" is not a file name in the directory",
                            idx, shown(nm, name), shown(sn, shard));
            goto out;
        }
        json_int_t next = (json_int_t)json_object_size(shard_ix);
        if (!json_object_get(shard_ix, shard) &&
            json_object_set_new(shard_ix, shard, json_integer(next))) {
            rc = pd_err_set(e, PD_ENOMEM, "%s: out of memory", idx);
            goto out;
        }
    }

    size_t nshards = json_object_size(shard_ix);
    if (!(s->files = calloc(nshards, sizeof *s->files))) {
        rc = pd_err_set(e, PD_ENOMEM, "%s: out of memory", idx);
        goto out;
    }
    json_object_foreach(shard_ix, name, v) {
        char *path = join(dir, name);
        if (!path) {
            rc = pd_err_set(e, PD_ENOMEM, "%s: out of memory", idx);
            goto out;
        }
        assert((size_t)json_integer_value(v) == s->nfiles);
        rc = pd_st_open(path, flags, &s->files[s->nfiles], e);
        free(path);
        if (rc) {
            /* say which tensor needed it: the first the index maps to this shard */
            const char *tn;
            json_t *tv;
            json_object_foreach(wm, tn, tv) {
                if (strcmp(json_string_value(tv), name) == 0) {
                    size_t k = strlen(e->msg);
                    snprintf(e->msg + k, sizeof e->msg - k, " (the shard %s names for tensor \"%s\")", idx, shown(nm, tn));
                    break;
                }
            }
            goto out;
        }
        s->nfiles++;
    }

    json_object_foreach(wm, name, v) {
        const char *shard = json_string_value(v);
        size_t k = (size_t)json_integer_value(json_object_get(shard_ix, shard));
        if (!pd_st_find(&s->files[k], name)) {
            rc = pd_err_set(e, PD_EFORMAT,
                            "%s: tensor \"%s\" is mapped to %s, which has no such tensor", idx,
                            shown(nm, name), s->files[k].path);
            goto out;
        }
    }
    for (size_t i = 0; i < s->nfiles; i++) {
        for (size_t t = 0; t < s->files[i].n; t++) {
            const char *tn = s->files[i].tensors[t].name;
            for (size_t j = i + 1; j < s->nfiles; j++) {
                if (pd_st_find(&s->files[j], tn)) {
                    rc = pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\" is present in both %s and %s",
                                    idx, shown(nm, tn), s->files[i].path, s->files[j].path);
                    goto out;
                }
            }
        }
    }
out:
    json_decref(shard_ix);
    json_decref(root);
    return rc;
}

int pd_st_open_dir(const char *dir, int flags, struct pd_st_set *s, pd_err *e)
{
    memset(s, 0, sizeof *s);
    char *idx = join(dir, "model.safetensors.index.json");
    if (!idx)
        return pd_err_set(e, PD_ENOMEM, "%s: out of memory", dir);
    int rc;
    struct stat st;
    if (stat(idx, &st) == 0) {
        rc = open_index(dir, idx, flags, s, e);
    } else if (errno != ENOENT) {
        rc = pd_err_set(e, PD_EIO, "%s: cannot stat: %s", idx, strerror(errno));
    } else {
        char *one = join(dir, "model.safetensors");
        s->files = calloc(1, sizeof *s->files);
        if (!one || !s->files) {
            rc = pd_err_set(e, PD_ENOMEM, "%s: out of memory", dir);
        } else if (!(rc = pd_st_open(one, flags, &s->files[0], e))) {
            s->nfiles = 1;
        }
        free(one);
    }
    free(idx);
    if (rc)
        pd_st_close_dir(s);
    return rc;
}

static int write_all(int fd, const void *buf, size_t len)
{
    const uint8_t *p = buf;
    while (len) {
        ssize_t w = write(fd, p, len);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return w < 0 ? errno : EIO;
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

/* Builds the header JSON in the caller's order with contiguous offsets. Each entry is checked
 * the way the reader will check it, so a written file always reads back. */
static int build_header(const char *path, const struct pd_st_out *t, size_t n, json_t *root,
                        pd_err *e)
{
    char nm[NAME_SHOWN + 4];
    uint64_t off = 0;
    for (size_t i = 0; i < n; i++) {
        const struct pd_st_out *o = &t[i];
        if (!o->name)
            return pd_err_set(e, PD_EINVAL, "%s: tensor #%zu has no name", path, i);
        shown(nm, o->name);
        if (strcmp(o->name, "__metadata__") == 0 || json_object_get(root, o->name))
            return pd_err_set(e, PD_EINVAL, "%s: tensor \"%s\": name reserved or used twice",
                              path, nm);
        if ((unsigned)o->dtype >= PD_ST_DTYPE_COUNT)
            return pd_err_set(e, PD_EINVAL, "%s: tensor \"%s\": dtype %d out of range", path, nm,
                              (int)o->dtype);
        if (o->ndim < 0 || o->ndim > PD_ST_MAX_DIMS)
            return pd_err_set(e, PD_EINVAL, "%s: tensor \"%s\": %d dimensions, at most %d", path,
                              nm, o->ndim, PD_ST_MAX_DIMS);
        uint64_t bytes, end;
        if (!shape_bytes(o->shape, o->ndim, pd_st_dtype_size(o->dtype), &bytes) ||
            __builtin_add_overflow(off, bytes, &end) || end > INT64_MAX)
            return pd_err_set(e, PD_EINVAL, "%s: tensor \"%s\": negative or overflowing shape",
                              path, nm);
        if (bytes && !o->data)
            return pd_err_set(e, PD_EINVAL, "%s: tensor \"%s\": no data for %llu bytes", path, nm,
                              (unsigned long long)bytes);
        json_t *shape = json_array();
        for (int d = 0; shape && d < o->ndim; d++) {
            if (json_array_append_new(shape, json_integer(o->shape[d]))) {
                json_decref(shape);
                shape = NULL;
            }
        }
        json_t *ent = shape ? json_pack("{s:s, s:o, s:[I, I]}", "dtype",
                                        pd_st_dtype_name(o->dtype), "shape", shape,
                                        "data_offsets", (json_int_t)off, (json_int_t)end)
                            : NULL;
        if (!ent)
            return pd_err_set(e, PD_ENOMEM, "%s: tensor \"%s\": cannot build the header entry",
                              path, nm);
        if (json_object_set_new(root, o->name, ent))
            return pd_err_set(e, PD_EINVAL, "%s: tensor \"%s\": name is not valid UTF-8", path,
                              nm);
        off = end;
    }
    return 0;
}

int pd_st_write(const char *path, const struct pd_st_out *t, size_t n, pd_err *e)
{
    json_t *root = json_object();
    if (!root)
        return pd_err_set(e, PD_ENOMEM, "%s: out of memory", path);
    int rc = build_header(path, t, n, root, e);
    char *js = rc ? NULL : json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    if (rc)
        return rc;
    size_t tl = strlen(path) + 5;
    char *tmp = js ? malloc(tl) : NULL;
    if (!tmp) {
        free(js);
        return pd_err_set(e, PD_ENOMEM, "%s: out of memory", path);
    }
    snprintf(tmp, tl, "%s.tmp", path);

    /* Spaces pad the header so the data section starts 8-byte aligned, as the reference does. */
    size_t jl = strlen(js), pad = (8 - (8 + jl) % 8) % 8;
    uint64_t hlen = jl + pad;
    uint8_t prefix[8];
    for (int i = 0; i < 8; i++)
        prefix[i] = (uint8_t)(hlen >> (8 * i));

    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        rc = pd_err_set(e, PD_EIO, "%s: cannot create: %s", tmp, strerror(errno));
        goto out;
    }
    int err = write_all(fd, prefix, 8);
    if (!err)
        err = write_all(fd, js, jl);
    if (!err)
        err = write_all(fd, "        ", pad);
    uint64_t total = 8 + jl + pad;
    for (size_t i = 0; !err && i < n; i++) {
        uint64_t bytes = 0;
        shape_bytes(t[i].shape, t[i].ndim, pd_st_dtype_size(t[i].dtype), &bytes);
        err = write_all(fd, t[i].data, bytes);
        total += bytes;
    }
    if (!err && fsync(fd) != 0)
        err = errno;
    if (!err)
        pd_st_uncache(fd, (size_t)total);
    if (close(fd) != 0 && !err)
        err = errno;
    if (err) {
        rc = pd_err_set(e, PD_EIO, "%s: write failed: %s", tmp, strerror(err));
        unlink(tmp);
        goto out;
    }
    if (rename(tmp, path) != 0) {
        rc = pd_err_set(e, PD_EIO, "%s: cannot rename to %s: %s", tmp, path, strerror(errno));
        unlink(tmp);
    }
out:
    free(tmp);
    free(js);
    return rc;
}

const char *pd_st_set_path_of(const struct pd_st_set *s, const struct pd_st_tensor *t)
{
    for (size_t i = 0; i < s->nfiles; i++)
        if (t >= s->files[i].tensors && t < s->files[i].tensors + s->files[i].n)
            return s->files[i].path;
    return "checkpoint";
}

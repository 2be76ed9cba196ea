/* Byte-level BPE tokenizer: the tokenizer.json reader, the pre-tokenizer pipeline (its Split
 * regexes run on model/regex.c, its Unicode classes come from model/unicode.c), the encoder and
 * decoder, and the BPE trainer that writes the tokenizer.json of synthetic checkpoints.
 * The supported format and every approximation are described in tokenizer.h. */
#include "model/tokenizer.h"
#include "core/grow.h"

#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/jsonf.h"
#include "model/regex.h"
#include "model/unicode.h"

/* ---------------------------------------------------------------------------------------------
 * The GPT-2 byte map: printable bytes stand for themselves, the 68 others (controls, space,
 * DEL, C1, NBSP, soft hyphen) for U+0100 + n in byte order.
 * ------------------------------------------------------------------------------------------- */

static int byte_printable(unsigned b)
{
    return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
}

uint32_t pd_tok_byte_to_cp(uint8_t b)
{
    if (byte_printable(b))
        return b;
    unsigned n = 0;
    for (unsigned x = 0; x < b; x++)
        n += !byte_printable(x);
    return 256 + n;
}

int pd_tok_cp_to_byte(uint32_t cp)
{
    if (cp < 256)
        return byte_printable(cp) ? (int)cp : -1;
    if (cp >= 256 + 68)
        return -1;
    unsigned n = cp - 256;
    for (unsigned x = 0; x < 256; x++) {
        if (!byte_printable(x) && n-- == 0)
            return (int)x;
    }
    return -1;
}

/* Byte-level spelling of each byte, as UTF-8 (1 or 2 bytes), built once. */
static char bl_str[256][2];
static uint8_t bl_len[256];
static int16_t bl_rev[256 + 68];     /* code point -> byte */
static pthread_once_t bl_once = PTHREAD_ONCE_INIT;

static void bl_init_once(void)
{
    for (unsigned b = 0; b < 256; b++) {
        uint32_t cp = pd_tok_byte_to_cp((uint8_t)b);
        bl_len[b] = (uint8_t)pd_uc_utf8_enc(cp, bl_str[b]);
        bl_rev[cp] = (int16_t)b;
    }
}

static void bl_init(void)
{
    pthread_once(&bl_once, bl_init_once);
}

/* Byte-level string -> bytes. Returns the byte count, or -1 if a character is not one of the
 * 256 stand-ins (the caller then keeps the string's own UTF-8, as HF's decoder does). */
static ptrdiff_t bl_decode(const char *s, size_t n, char *out)
{
    size_t i = 0, k = 0;
    while (i < n) {
        uint32_t cp;
        i += pd_uc_utf8_dec((const uint8_t *)s + i, n - i, &cp);
        if (cp >= 256 + 68)
            return -1;
        int b = cp < 256 ? (byte_printable(cp) ? (int)cp : -1) : bl_rev[cp];
        if (b < 0)
            return -1;
        out[k++] = (char)b;
    }
    return (ptrdiff_t)k;
}

/* ---------------------------------------------------------------------------------------------
 * Growable buffers
 * ------------------------------------------------------------------------------------------- */


struct sbuf {
    char *p;
    size_t n, cap;
};

static int sb_add(struct sbuf *b, const void *s, size_t n)
{
    if (PD_GROW(b->p, b->cap, b->n + n + 1))
        return PD_ENOMEM;
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

static uint64_t hash_bytes(const void *p, size_t n)
{
    const uint8_t *s = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ s[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

static size_t pow2_at_least(size_t n)
{
    size_t c = 16;
    while (c < n)
        c *= 2;
    return c;
}

/* ---------------------------------------------------------------------------------------------
 * Pre-tokenizer pipeline
 * ------------------------------------------------------------------------------------------- */

/* What ByteLevel's use_regex applies, and what pd_tok_train writes into its files. */
static const char gpt2_pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char train_pattern[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}|"
    " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

enum { ST_SPLIT, ST_BYTELEVEL };
enum { B_ISOLATED, B_REMOVED, B_MERGED_PREV, B_MERGED_NEXT, B_CONTIGUOUS };

struct pstep {
    int kind;
    struct pd_rx *rx;           /* ST_SPLIT; ST_BYTELEVEL when use_regex (the GPT-2 pattern) */
    int behavior, invert;    /* ST_SPLIT */
    int add_prefix_space;    /* ST_BYTELEVEL */
};

struct piece {
    size_t a, b;             /* code point indices, [a, b) */
};

struct mark {
    size_t a, b;
    int m;                   /* matched by the pattern (after invert) */
};

/* Scratch of one encode call (or one training run). */
struct work {
    const uint8_t *s;        /* the bytes being pre-tokenized (a segment, or owned nb) */
    size_t len;
    uint32_t *cp;            /* code points of s */
    size_t *off;             /* byte offset of each code point; off[ncp] == len */
    size_t ncp, cpcap, offcap;
    struct piece *p, *q;     /* pieces, and the next step's pieces */
    size_t np, pcap, nq, qcap;
    struct mark *mk;
    size_t nmk, mkcap;
    char *nb;                /* a rebuilt text (ByteLevel add_prefix_space) */
    struct pd_rx_scratch *rs;
    int ref;                 /* Split on the reference matcher (pd_tok_set_reference_matcher) */
    /* BPE */
    struct sym { int32_t id, prev, next; } *sym;
    size_t symcap;
    struct hent { uint32_t rank, pos; int32_t a, b, id; } *heap;
    size_t hn, hcap;
    char *tmp;
    size_t tmpcap;
    int32_t *out;
    size_t nout, outcap;
};

static void work_free(struct work *w)
{
    free(w->cp);
    free(w->off);
    free(w->p);
    free(w->q);
    free(w->mk);
    free(w->nb);
    pd_rx_scratch_free(w->rs);
    free(w->sym);
    free(w->heap);
    free(w->tmp);
    free(w->out);
}

static int work_decode(struct work *w, const uint8_t *s, size_t len)
{
    if (PD_GROW(w->cp, w->cpcap, len + 1) || PD_GROW(w->off, w->offcap, len + 1))
        return PD_ENOMEM;
    size_t i = 0, n = 0;
    while (i < len) {
        w->off[n] = i;
        i += pd_uc_utf8_dec(s + i, len - i, &w->cp[n]);
        n++;
    }
    w->off[n] = len;
    w->ncp = n;
    w->s = s;
    w->len = len;
    return 0;
}

static int push_piece(struct work *w, size_t a, size_t b)
{
    if (a >= b)
        return 0;
    if (PD_GROW(w->q, w->qcap, w->nq + 1))
        return PD_ENOMEM;
    w->q[w->nq++] = (struct piece){a, b};
    return 0;
}

static int push_mark(struct work *w, size_t a, size_t b, int m)
{
    if (PD_GROW(w->mk, w->mkcap, w->nmk + 1))
        return PD_ENOMEM;
    w->mk[w->nmk++] = (struct mark){a, b, m};
    return 0;
}

/* Splits one piece the way HF's Split does: the pattern's matches and the gaps between them,
 * then the behavior decides what becomes a piece. Empty matches are skipped. Errors are
 * PD_ENOMEM (e not set) or the matcher's (e set). */
static int split_piece(struct work *w, const struct pstep *st, size_t a, size_t b, pd_err *e)
{
    w->nmk = 0;
    size_t pos = a, from = a, ms, me;
    int found;
    while (from < b && (found = w->ref ? pd_rx_find_ref(st->rx, w->cp, a, b, from, &ms, &me)
                                       : pd_rx_find(st->rx, &w->rs, w->cp, a, b, from, &ms, &me,
                                                    e))) {
        if (found < 0)
            return found;
        if (me == ms) {
            from = ms + 1;
            continue;
        }
        if ((ms > pos && push_mark(w, pos, ms, 0)) || push_mark(w, ms, me, 1))
            return PD_ENOMEM;
        pos = from = me;
    }
    if (pos < b && push_mark(w, pos, b, 0))
        return PD_ENOMEM;
    for (size_t i = 0; i < w->nmk; i++)
        w->mk[i].m ^= st->invert;

    size_t first = w->nq;   /* pieces of this input piece start here */
    int prev = 0;
    switch (st->behavior) {
    case B_ISOLATED:
        for (size_t i = 0; i < w->nmk; i++) {
            if (push_piece(w, w->mk[i].a, w->mk[i].b))
                return PD_ENOMEM;
        }
        break;
    case B_REMOVED:
        for (size_t i = 0; i < w->nmk; i++) {
            if (!w->mk[i].m && push_piece(w, w->mk[i].a, w->mk[i].b))
                return PD_ENOMEM;
        }
        break;
    case B_MERGED_PREV:
        for (size_t i = 0; i < w->nmk; i++) {
            if (w->mk[i].m && !prev && w->nq > first)
                w->q[w->nq - 1].b = w->mk[i].b;
            else if (push_piece(w, w->mk[i].a, w->mk[i].b))
                return PD_ENOMEM;
            prev = w->mk[i].m;
        }
        break;
    case B_MERGED_NEXT:
        for (size_t i = 0; i < w->nmk; i++) {
            /* a match joins the piece that follows it, unless that one is a match too */
            int join = w->mk[i].m && i + 1 < w->nmk && !w->mk[i + 1].m;
            if (join) {
                if (push_piece(w, w->mk[i].a, w->mk[i + 1].b))
                    return PD_ENOMEM;
                i++;
            } else if (push_piece(w, w->mk[i].a, w->mk[i].b)) {
                return PD_ENOMEM;
            }
        }
        break;
    default: /* B_CONTIGUOUS */
        for (size_t i = 0; i < w->nmk; i++) {
            if (i > 0 && w->mk[i].m == prev && w->nq > first)
                w->q[w->nq - 1].b = w->mk[i].b;
            else if (push_piece(w, w->mk[i].a, w->mk[i].b))
                return PD_ENOMEM;
            prev = w->mk[i].m;
        }
        break;
    }
    return 0;
}

static int split_all(struct work *w, const struct pstep *st, pd_err *e)
{
    w->nq = 0;
    for (size_t i = 0; i < w->np; i++) {
        int rc = split_piece(w, st, w->p[i].a, w->p[i].b, e);
        if (rc)
            return rc;
    }
    struct piece *t = w->p;
    size_t tc = w->pcap;
    w->p = w->q, w->pcap = w->qcap, w->np = w->nq;
    w->q = t, w->qcap = tc, w->nq = 0;
    return 0;
}

/* ByteLevel's add_prefix_space: every piece not starting with a space gets one. The pieces are
 * copied into a new text; each then starts with an ASCII byte, so no code point changes. */
static int prefix_spaces(struct work *w)
{
    size_t need = 0;
    for (size_t i = 0; i < w->np; i++)
        need += 1 + w->off[w->p[i].b] - w->off[w->p[i].a];
    char *nb = malloc(need + 1);
    if (!nb)
        return PD_ENOMEM;
    size_t k = 0;
    w->nq = 0;
    for (size_t i = 0; i < w->np; i++) {
        size_t a = w->off[w->p[i].a], b = w->off[w->p[i].b];
        size_t start = k;
        if (w->s[a] != ' ')
            nb[k++] = ' ';
        memcpy(nb + k, w->s + a, b - a);
        k += b - a;
        if (push_piece(w, start, k)) {   /* byte offsets for now; converted below */
            free(nb);
            return PD_ENOMEM;
        }
    }
    free(w->nb);
    w->nb = nb;
    if (work_decode(w, (const uint8_t *)nb, k))
        return PD_ENOMEM;
    /* byte offsets -> code point indices: walk both in order */
    size_t ci = 0;
    for (size_t i = 0; i < w->nq; i++) {
        while (w->off[ci] < w->q[i].a)
            ci++;
        size_t a = ci;
        while (w->off[ci] < w->q[i].b)
            ci++;
        w->q[i] = (struct piece){a, ci};
    }
    struct piece *t = w->p;
    size_t tc = w->pcap;
    w->p = w->q, w->pcap = w->qcap, w->np = w->nq;
    w->q = t, w->qcap = tc, w->nq = 0;
    return 0;
}

/* Runs the steps over s[0..len): afterwards w->p[0..np) are the pieces, as code point ranges
 * over w->cp/w->off of w->s (which is s, or a rebuilt copy). Errors: PD_ENOMEM with e set to
 * "label: out of memory", or a Split regex's error. */
static int pretokenize(struct work *w, const struct pstep *steps, int n_steps, const uint8_t *s,
                       size_t len, const char *label, pd_err *e)
{
    if (work_decode(w, s, len))
        goto oom;
    w->np = 0;
    if (w->ncp) {
        if (PD_GROW(w->p, w->pcap, 1))
            goto oom;
        w->p[w->np++] = (struct piece){0, w->ncp};
    }
    for (int i = 0; i < n_steps; i++) {
        const struct pstep *st = &steps[i];
        if (st->kind == ST_BYTELEVEL && st->add_prefix_space && prefix_spaces(w))
            goto oom;
        int rc = st->rx ? split_all(w, st, e) : 0;
        if (rc == PD_ENOMEM)
            goto oom;
        if (rc)
            return rc;
    }
    return 0;
oom:
    return pd_err_set(e, PD_ENOMEM, "%s: out of memory pre-tokenizing", label);
}

static void steps_free(struct pstep *st, int n)
{
    for (int i = 0; i < n; i++)
        pd_rx_free(st[i].rx);
    free(st);
}

/* ---------------------------------------------------------------------------------------------
 * The tokenizer
 * ------------------------------------------------------------------------------------------- */

/* Ids index a dense table (20 bytes each), so a file with one huge id must not make us
 * allocate gigabytes; the largest real vocabularies are a few hundred thousand. */
#define PD_TOK_MAX_IDS (1 << 21)

enum { K_VOCAB = 1, K_ADDED = 2 };

struct tokinfo {
    uint32_t off, len;       /* the bytes this id decodes to, in t->bytes */
    uint32_t soff, slen;     /* the vocab string as written in the file, in t->strs */
    uint8_t kind;            /* K_VOCAB | K_ADDED; 0: no token has this id */
    uint8_t special;
};

struct added {
    int32_t id;
    uint32_t off, len;       /* content, in t->bytes */
    uint8_t lstrip, rstrip, single_word;
};

#define MH_EMPTY UINT64_MAX

struct mslot {
    uint64_t key;            /* left id << 32 | right id */
    uint32_t rank;
    int32_t id;              /* the merged token */
};

struct pd_tok {
    struct tokinfo *ti;      /* [n_ids] */
    int32_t n_ids;
    struct sbuf bytes, strs;
    int32_t *shash;          /* vocab string -> id, open addressing, -1 empty */
    size_t smask;
    struct mslot *mhash;     /* (left, right) -> rank, merged id */
    size_t mmask;
    int32_t byte_id[256];    /* id of each single byte's token, -1 if missing */
    int ignore_merges;
    struct added *added;
    int n_added;
    int *aorder;             /* added tokens by first byte, longest first */
    int abucket[257];        /* aorder[abucket[b] .. abucket[b + 1]) start with byte b */
    struct pstep *steps;
    int n_steps;
    int32_t bos, eos;
    size_t max_bytes;
    char label[160];         /* the file, for encode-time errors */
    int use_ref;             /* pd_tok_set_reference_matcher */
};

static int ferr(pd_err *e, int code, const char *label, const char *field, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

static int ferr(pd_err *e, int code, const char *label, const char *field, const char *fmt, ...)
{
    char msg[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return pd_err_set(e, code, "%s: field \"%s\": %s", label, field, msg);
}

static int32_t sh_find(const struct pd_tok *t, const char *s, size_t n)
{
    if (!t->shash)
        return -1;
    for (size_t i = hash_bytes(s, n) & t->smask;; i = (i + 1) & t->smask) {
        int32_t id = t->shash[i];
        if (id < 0)
            return -1;
        const struct tokinfo *ti = &t->ti[id];
        if (ti->slen == n && !memcmp(t->strs.p + ti->soff, s, n))
            return id;
    }
}

static const struct mslot *mh_find(const struct pd_tok *t, int32_t a, int32_t b)
{
    if (!t->mhash)
        return NULL;
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    for (size_t i = hash_u64(key) & t->mmask;; i = (i + 1) & t->mmask) {
        if (t->mhash[i].key == key)
            return &t->mhash[i];
        if (t->mhash[i].key == MH_EMPTY)
            return NULL;
    }
}

static int arena_add(struct sbuf *b, const void *s, size_t n, uint32_t *off)
{
    if (b->n + n >= UINT32_MAX)
        return PD_ERANGE;
    *off = (uint32_t)b->n;
    return sb_add(b, s, n);
}

static int load_vocab(struct pd_tok *t, json_t *model, const char *label, pd_err *e)
{
    json_t *v = json_object_get(model, "vocab");
    if (!json_is_object(v))
        return ferr(e, PD_EFORMAT, label, "model.vocab", "expected an object {token: id}");
    const char *key;
    json_t *val;
    int64_t maxid = -1;
    size_t maxkey = 0;
    json_object_foreach(v, key, val) {
        json_int_t id = json_is_integer(val) ? json_integer_value(val) : -1;
        if (id < 0 || id >= PD_TOK_MAX_IDS) {
            char f[96];
            snprintf(f, sizeof f, "model.vocab[\"%.60s\"]", key);
            return ferr(e, PD_EFORMAT, label, f, "expected an integer id in [0, %d)",
                        PD_TOK_MAX_IDS);
        }
        if (id > maxid)
            maxid = id;
        size_t kl = strlen(key);
        if (kl > maxkey)
            maxkey = kl;
    }
    t->n_ids = (int32_t)(maxid + 1);
    t->ti = calloc((size_t)t->n_ids + 1, sizeof *t->ti);
    char *tmp = malloc(maxkey + 1);
    size_t nv = json_object_size(v);
    size_t cap = pow2_at_least(nv * 2);
    t->shash = malloc(cap * sizeof *t->shash);
    if (!t->ti || !tmp || !t->shash) {
        free(tmp);
        return pd_err_set(e, PD_ENOMEM, "%s: out of memory reading model.vocab", label);
    }
    memset(t->shash, 0xff, cap * sizeof *t->shash);
    t->smask = cap - 1;
    json_object_foreach(v, key, val) {
        int32_t id = (int32_t)json_integer_value(val);
        size_t kl = strlen(key);
        struct tokinfo *ti = &t->ti[id];
        if (ti->kind) {
            char f[96];
            snprintf(f, sizeof f, "model.vocab[\"%.60s\"]", key);
            int rc = ferr(e, PD_EFORMAT, label, f, "id %d is already the id of \"%.*s\"", id,
                          (int)(ti->slen > 60 ? 60 : ti->slen), t->strs.p + ti->soff);
            free(tmp);
            return rc;
        }
        ptrdiff_t nb = bl_decode(key, kl, tmp);
        const char *bytes = nb >= 0 ? tmp : key;
        size_t blen = nb >= 0 ? (size_t)nb : kl;
        if (arena_add(&t->strs, key, kl, &ti->soff) ||
            arena_add(&t->bytes, bytes, blen, &ti->off)) {
            free(tmp);
            return pd_err_set(e, PD_ENOMEM, "%s: out of memory reading model.vocab", label);
        }
        ti->slen = (uint32_t)kl;
        ti->len = (uint32_t)blen;
        ti->kind = K_VOCAB;
        if (blen > t->max_bytes)
            t->max_bytes = blen;
        size_t i = hash_bytes(key, kl) & t->smask;
        while (t->shash[i] >= 0)
            i = (i + 1) & t->smask;
        t->shash[i] = id;
    }
    free(tmp);
    return 0;
}

/* One merge as (left, right) strings: "a b" or ["a", "b"]. */
static int merge_parts(json_t *x, const char **a, size_t *al, const char **b, size_t *bl)
{
    if (json_is_string(x)) {
        const char *s = json_string_value(x);
        size_t n = json_string_length(x);
        const char *sp = memchr(s, ' ', n);
        if (!sp || memchr(sp + 1, ' ', n - (size_t)(sp + 1 - s)))
            return -1;
        *a = s, *al = (size_t)(sp - s);
        *b = sp + 1, *bl = n - *al - 1;
        return 0;
    }
    if (json_is_array(x) && json_array_size(x) == 2 && json_is_string(json_array_get(x, 0)) &&
        json_is_string(json_array_get(x, 1))) {
        *a = json_string_value(json_array_get(x, 0));
        *al = json_string_length(json_array_get(x, 0));
        *b = json_string_value(json_array_get(x, 1));
        *bl = json_string_length(json_array_get(x, 1));
        return 0;
    }
    return -1;
}

static int load_merges(struct pd_tok *t, json_t *model, const char *label, pd_err *e)
{
    json_t *m = json_object_get(model, "merges");
    if (!m || json_is_null(m))
        return 0;
    if (!json_is_array(m))
        return ferr(e, PD_EFORMAT, label, "model.merges", "expected an array");
    size_t n = json_array_size(m);
    if (n >= UINT32_MAX)
        return ferr(e, PD_ERANGE, label, "model.merges", "too many merges");
    size_t cap = pow2_at_least(n * 2);
    t->mhash = malloc(cap * sizeof *t->mhash);
    if (!t->mhash)
        return pd_err_set(e, PD_ENOMEM, "%s: out of memory reading model.merges", label);
    for (size_t i = 0; i < cap; i++)
        t->mhash[i].key = MH_EMPTY;
    t->mmask = cap - 1;
    struct sbuf cat = {0};
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        char f[48];
        snprintf(f, sizeof f, "model.merges[%zu]", i);
        const char *a, *b;
        size_t al, bl;
        if (merge_parts(json_array_get(m, i), &a, &al, &b, &bl)) {
            rc = ferr(e, PD_EFORMAT, label, f, "expected \"left right\" (one space) or "
                      "[\"left\", \"right\"]");
            break;
        }
        int32_t ia = sh_find(t, a, al), ib = sh_find(t, b, bl);
        if (ia < 0 || ib < 0) {
            rc = ferr(e, PD_EFORMAT, label, f, "token \"%.*s\" is not in model.vocab",
                      ia < 0 ? (int)(al > 60 ? 60 : al) : (int)(bl > 60 ? 60 : bl),
                      ia < 0 ? a : b);
            break;
        }
        cat.n = 0;
        if (sb_add(&cat, a, al) || sb_add(&cat, b, bl)) {
            rc = pd_err_set(e, PD_ENOMEM, "%s: out of memory reading model.merges", label);
            break;
        }
        int32_t ic = sh_find(t, cat.p, cat.n);
        if (ic < 0) {
            rc = ferr(e, PD_EFORMAT, label, f, "merged token \"%.60s\" is not in model.vocab",
                      cat.p);
            break;
        }
        /* a pair listed twice keeps its last rank, as HF's map does */
        uint64_t key = (uint64_t)(uint32_t)ia << 32 | (uint32_t)ib;
        size_t j = hash_u64(key) & t->mmask;
        while (t->mhash[j].key != MH_EMPTY && t->mhash[j].key != key)
            j = (j + 1) & t->mmask;
        t->mhash[j] = (struct mslot){key, (uint32_t)i, ic};
    }
    free(cat.p);
    return rc;
}


struct akey {
    int first;
    uint32_t len;
    int idx;
};

static int akey_cmp(const void *x, const void *y)
{
    const struct akey *a = x, *b = y;
    if (a->first != b->first)
        return a->first < b->first ? -1 : 1;
    if (a->len != b->len)
        return a->len > b->len ? -1 : 1;   /* longest first */
    return a->idx < b->idx ? -1 : a->idx > b->idx;
}

static int load_added(struct pd_tok *t, json_t *root, const char *label, pd_err *e)
{
    json_t *arr = json_object_get(root, "added_tokens");
    if (!arr || json_is_null(arr))
        return 0;
    if (!json_is_array(arr))
        return ferr(e, PD_EFORMAT, label, "added_tokens", "expected an array");
    size_t n = json_array_size(arr);
    if (n >= PD_TOK_MAX_IDS)
        return ferr(e, PD_ERANGE, label, "added_tokens", "too many entries");
    t->added = calloc(n + 1, sizeof *t->added);
    if (!t->added)
        return pd_err_set(e, PD_ENOMEM, "%s: out of memory reading added_tokens", label);
    for (size_t i = 0; i < n; i++) {
        char pre[48], f[64];
        snprintf(pre, sizeof pre, "added_tokens[%zu].", i);
        struct pd_jsrc src = {label, pre};
        json_t *o = json_array_get(arr, i);
        if (!json_is_object(o)) {
            snprintf(f, sizeof f, "added_tokens[%zu]", i);
            return ferr(e, PD_EFORMAT, label, f, "expected an object");
        }
        int64_t id;
        int special, lstrip, rstrip, single;
        int rc = pd_json_int(&src, o, "id", 1, 0, 0, PD_TOK_MAX_IDS - 1, &id, e);
        if (!rc)
            rc = pd_json_bool(&src, o, "special", 0, 0, &special, e);
        if (!rc)
            rc = pd_json_bool(&src, o, "lstrip", 0, 0, &lstrip, e);
        if (!rc)
            rc = pd_json_bool(&src, o, "rstrip", 0, 0, &rstrip, e);
        if (!rc)
            rc = pd_json_bool(&src, o, "single_word", 0, 0, &single, e);
        if (rc)
            return rc;
        snprintf(f, sizeof f, "added_tokens[%zu].content", i);
        json_t *c = json_object_get(o, "content");
        if (!json_is_string(c) || json_string_length(c) == 0)
            return ferr(e, PD_EFORMAT, label, f, "expected a non-empty string");
        const char *content = json_string_value(c);
        size_t clen = json_string_length(c);
        if (id >= t->n_ids) {
            struct tokinfo *ti = realloc(t->ti, (size_t)(id + 1) * sizeof *ti);
            if (!ti)
                return pd_err_set(e, PD_ENOMEM, "%s: out of memory reading added_tokens", label);
            memset(ti + t->n_ids, 0, (size_t)(id + 1 - t->n_ids) * sizeof *ti);
            t->ti = ti;
            t->n_ids = (int32_t)(id + 1);
        }
        struct tokinfo *ti = &t->ti[id];
        snprintf(f, sizeof f, "added_tokens[%zu].id", i);
        if (ti->kind & K_ADDED)
            return ferr(e, PD_EFORMAT, label, f, "id %d is already an added token", (int)id);
        if ((ti->kind & K_VOCAB) &&
            (ti->slen != clen || memcmp(t->strs.p + ti->soff, content, clen)))
            return ferr(e, PD_EFORMAT, label, f, "id %d is the vocab token \"%.*s\", not "
                        "\"%.60s\"", (int)id, (int)(ti->slen > 60 ? 60 : ti->slen),
                        t->strs.p + ti->soff, content);
        struct added *a = &t->added[t->n_added++];
        if (arena_add(&t->bytes, content, clen, &a->off))
            return pd_err_set(e, PD_ENOMEM, "%s: out of memory reading added_tokens", label);
        a->id = (int32_t)id;
        a->len = (uint32_t)clen;
        a->lstrip = (uint8_t)lstrip;
        a->rstrip = (uint8_t)rstrip;
        a->single_word = (uint8_t)single;
        ti->off = a->off;
        ti->len = a->len;
        ti->kind |= K_ADDED;
        ti->special = (uint8_t)special;
        if (clen > t->max_bytes)
            t->max_bytes = clen;
    }
    struct akey *k = malloc((n + 1) * sizeof *k);
    t->aorder = malloc((n + 1) * sizeof *t->aorder);
    if (!k || !t->aorder) {
        free(k);
        return pd_err_set(e, PD_ENOMEM, "%s: out of memory reading added_tokens", label);
    }
    for (int i = 0; i < t->n_added; i++)
        k[i] = (struct akey){(uint8_t)t->bytes.p[t->added[i].off], t->added[i].len, i};
    qsort(k, (size_t)t->n_added, sizeof *k, akey_cmp);
    int j = 0;
    for (int b = 0; b < 256; b++) {
        t->abucket[b] = j;
        while (j < t->n_added && k[j].first == b) {
            t->aorder[j] = k[j].idx;
            j++;
        }
    }
    t->abucket[256] = j;
    free(k);
    return 0;
}

static const char *jtype(json_t *o)
{
    json_t *ty = json_object_get(o, "type");
    return json_is_string(ty) ? json_string_value(ty) : NULL;
}

/* NFC is the identity here (see tokenizer.h); every other normalizer would change the text. */
static int check_normalizer(json_t *n, const char *label, const char *field, pd_err *e)
{
    if (!n || json_is_null(n))
        return 0;
    const char *ty = json_is_object(n) ? jtype(n) : NULL;
    char f[128];
    snprintf(f, sizeof f, "%s.type", field);
    if (!ty)
        return ferr(e, PD_EFORMAT, label, f, "expected a normalizer object with a type");
    if (!strcmp(ty, "NFC"))
        return 0;
    if (strcmp(ty, "Sequence"))
        return ferr(e, PD_EFORMAT, label, f, "normalizer \"%s\" is not supported (only NFC, "
                    "applied as the identity)", ty);
    json_t *arr = json_object_get(n, "normalizers");
    snprintf(f, sizeof f, "%s.normalizers", field);
    if (!json_is_array(arr))
        return ferr(e, PD_EFORMAT, label, f, "expected an array");
    for (size_t i = 0; i < json_array_size(arr); i++) {
        snprintf(f, sizeof f, "%s.normalizers[%zu]", field, i);
        int rc = check_normalizer(json_array_get(arr, i), label, f, e);
        if (rc)
            return rc;
    }
    return 0;
}

static int split_behavior(const char *s)
{
    static const char *names[] = {"Isolated", "Removed", "MergedWithPrevious", "MergedWithNext",
                                  "Contiguous"};
    for (int i = 0; i < 5; i++) {
        if (!strcmp(s, names[i]))
            return i;
    }
    return -1;
}

/* A regex matching the literal string s (Split's {"String": ...} pattern). */
static struct pd_rx *rx_literal(const char *s, size_t n, const char *label, const char *field,
                             pd_err *e)
{
    char *pat = malloc(2 * n + 1);
    if (!pat) {
        pd_err_set(e, PD_ENOMEM, "%s: out of memory", label);
        return NULL;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x80 && !((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                          (c >= '0' && c <= '9')))
            pat[k++] = '\\';
        pat[k++] = (char)c;
    }
    struct pd_rx *rx = pd_rx_compile(pat, k, label, field, e);
    free(pat);
    return rx;
}

static int parse_step(json_t *o, struct pstep *st, const char *label, const char *field,
                      pd_err *e)
{
    char f[160];
    const char *ty = json_is_object(o) ? jtype(o) : NULL;
    snprintf(f, sizeof f, "%s.type", field);
    if (!ty)
        return ferr(e, PD_EFORMAT, label, f, "expected a pre-tokenizer object with a type");
    char pre[144];
    snprintf(pre, sizeof pre, "%s.", field);
    struct pd_jsrc src = {label, pre};
    memset(st, 0, sizeof *st);
    int rc;
    if (!strcmp(ty, "ByteLevel")) {
        int use_regex;
        st->kind = ST_BYTELEVEL;
        /* HF's defaults for both */
        rc = pd_json_bool(&src, o, "add_prefix_space", 0, 1, &st->add_prefix_space, e);
        if (!rc)
            rc = pd_json_bool(&src, o, "use_regex", 0, 1, &use_regex, e);
        if (rc)
            return rc;
        if (use_regex) {
            snprintf(f, sizeof f, "%s.use_regex", field);
            st->rx = pd_rx_compile(gpt2_pattern, strlen(gpt2_pattern), label, f, e);
            if (!st->rx)
                return e ? e->code : PD_EFORMAT;
        }
        return 0;
    }
    if (!strcmp(ty, "Digits")) {
        int individual;
        rc = pd_json_bool(&src, o, "individual_digits", 0, 0, &individual, e);
        if (rc)
            return rc;
        st->kind = ST_SPLIT;
        st->behavior = B_ISOLATED;
        const char *pat = individual ? "\\p{N}" : "\\p{N}+";
        st->rx = pd_rx_compile(pat, strlen(pat), label, field, e);
        return st->rx ? 0 : (e ? e->code : PD_EFORMAT);
    }
    if (strcmp(ty, "Split"))
        return ferr(e, PD_EFORMAT, label, f, "pre-tokenizer \"%s\" is not supported (ByteLevel, "
                    "Split, Digits or a Sequence of them)", ty);
    st->kind = ST_SPLIT;
    json_t *b = json_object_get(o, "behavior");
    snprintf(f, sizeof f, "%s.behavior", field);
    if (!json_is_string(b) || (st->behavior = split_behavior(json_string_value(b))) < 0)
        return ferr(e, PD_EFORMAT, label, f, "expected one of Isolated, Removed, "
                    "MergedWithPrevious, MergedWithNext, Contiguous");
    rc = pd_json_bool(&src, o, "invert", 0, 0, &st->invert, e);
    if (rc)
        return rc;
    json_t *pat = json_object_get(o, "pattern");
    json_t *re = json_is_object(pat) ? json_object_get(pat, "Regex") : NULL;
    json_t *str = json_is_object(pat) ? json_object_get(pat, "String") : NULL;
    if (json_is_string(re)) {
        snprintf(f, sizeof f, "%s.pattern.Regex", field);
        st->rx = pd_rx_compile(json_string_value(re), json_string_length(re), label, f, e);
    } else if (json_is_string(str) && json_string_length(str) > 0) {
        snprintf(f, sizeof f, "%s.pattern.String", field);
        st->rx = rx_literal(json_string_value(str), json_string_length(str), label, f, e);
    } else {
        snprintf(f, sizeof f, "%s.pattern", field);
        return ferr(e, PD_EFORMAT, label, f, "expected {\"Regex\": \"...\"} or "
                    "{\"String\": \"...\"}");
    }
    return st->rx ? 0 : (e ? e->code : PD_EFORMAT);
}

static int load_pretok(struct pd_tok *t, json_t *root, const char *label, pd_err *e)
{
    json_t *pt = json_object_get(root, "pre_tokenizer");
    json_t *list = NULL;
    const char *ty = json_is_object(pt) ? jtype(pt) : NULL;
    if (ty && !strcmp(ty, "Sequence")) {
        list = json_object_get(pt, "pretokenizers");
        if (!json_is_array(list))
            return ferr(e, PD_EFORMAT, label, "pre_tokenizer.pretokenizers", "expected an array");
    }
    size_t n = list ? json_array_size(list) : (pt && !json_is_null(pt) ? 1 : 0);
    t->steps = calloc(n + 1, sizeof *t->steps);
    if (!t->steps)
        return pd_err_set(e, PD_ENOMEM, "%s: out of memory", label);
    for (size_t i = 0; i < n; i++) {
        char f[64];
        if (list)
            snprintf(f, sizeof f, "pre_tokenizer.pretokenizers[%zu]", i);
        else
            snprintf(f, sizeof f, "pre_tokenizer");
        int rc = parse_step(list ? json_array_get(list, i) : pt, &t->steps[i], label, f, e);
        t->n_steps = (int)i + 1;   /* so pd_tok_free releases what was compiled */
        if (rc)
            return rc;
        if (t->steps[i].kind == ST_BYTELEVEL && i + 1 != n)
            return ferr(e, PD_EFORMAT, label, f, "ByteLevel must be the last pre-tokenizer "
                        "(later steps would see its byte stand-ins, not the text)");
    }
    if (!n || t->steps[n - 1].kind != ST_BYTELEVEL)
        return ferr(e, PD_EFORMAT, label, "pre_tokenizer", "a ByteLevel step is required (only "
                    "byte-level BPE is supported)");
    return 0;
}

static int check_decoder(json_t *root, const char *label, pd_err *e)
{
    json_t *d = json_object_get(root, "decoder");
    const char *ty = json_is_object(d) ? jtype(d) : NULL;
    if (ty && !strcmp(ty, "ByteLevel"))
        return 0;
    if (ty && !strcmp(ty, "Sequence")) {
        json_t *arr = json_object_get(d, "decoders");
        size_t n = json_is_array(arr) ? json_array_size(arr) : 0;
        size_t ok = 0;
        for (size_t i = 0; i < n; i++) {
            json_t *x = json_array_get(arr, i);
            const char *xt = json_is_object(x) ? jtype(x) : NULL;
            ok += xt && !strcmp(xt, "ByteLevel");
        }
        if (n && ok == n)
            return 0;
        return ferr(e, PD_EFORMAT, label, "decoder.decoders", "only ByteLevel decoders are "
                    "supported");
    }
    return ferr(e, PD_EFORMAT, label, "decoder", "expected {\"type\": \"ByteLevel\"}, got %s",
                ty ? ty : "no decoder type");
}

static int check_model(struct pd_tok *t, json_t *model, const char *label, pd_err *e)
{
    const char *ty = jtype(model);
    if (!ty || strcmp(ty, "BPE"))
        return ferr(e, PD_EFORMAT, label, "model.type", "expected \"BPE\", got %s%s%s",
                    ty ? "\"" : "", ty ? ty : "none", ty ? "\"" : "");
    struct pd_jsrc src = {label, "model."};
    int fb;
    int rc = pd_json_bool(&src, model, "byte_fallback", 0, 0, &fb, e);
    if (!rc)
        rc = pd_json_bool(&src, model, "ignore_merges", 0, 0, &t->ignore_merges, e);
    if (rc)
        return rc;
    if (fb)
        return ferr(e, PD_EFORMAT, label, "model.byte_fallback", "byte_fallback is for "
                    "SentencePiece-style BPE; only byte-level BPE is supported");
    json_t *d = json_object_get(model, "dropout");
    if (d && !json_is_null(d) && !(json_is_number(d) && json_number_value(d) == 0))
        return ferr(e, PD_EFORMAT, label, "model.dropout", "BPE dropout is not supported");
    static const char *affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        json_t *x = json_object_get(model, affixes[i]);
        if (x && !json_is_null(x) && !(json_is_string(x) && json_string_length(x) == 0)) {
            char f[64];
            snprintf(f, sizeof f, "model.%s", affixes[i]);
            return ferr(e, PD_EFORMAT, label, f, "not supported by byte-level BPE");
        }
    }
    return 0;
}

static int32_t find_added_content(const struct pd_tok *t, const char *s)
{
    size_t n = strlen(s);
    for (int i = 0; i < t->n_added; i++) {
        if (t->added[i].len == n && !memcmp(t->bytes.p + t->added[i].off, s, n))
            return t->added[i].id;
    }
    return -1;
}

int32_t pd_tok_id_of(const struct pd_tok *t, const char *token)
{
    int32_t id = find_added_content(t, token);
    return id >= 0 ? id : sh_find(t, token, strlen(token));
}

static int32_t first_present(const struct pd_tok *t, const char *const *names, int n)
{
    for (int i = 0; i < n; i++) {
        int32_t id = pd_tok_id_of(t, names[i]);
        if (id >= 0)
            return id;
    }
    return -1;
}

static void find_bos_eos(struct pd_tok *t, json_t *root)
{
    static const char *const bos[] = {"<｜begin▁of▁sentence｜>", "<|begin_of_text|>", "<s>",
                                      "<|endoftext|>"};
    static const char *const eos[] = {"<｜end▁of▁sentence｜>", "<|end_of_text|>", "</s>",
                                      "<|endoftext|>"};
    t->bos = -1;
    json_t *pp = json_object_get(root, "post_processor");
    const char *ty = json_is_object(pp) ? jtype(pp) : NULL;
    if (ty && !strcmp(ty, "TemplateProcessing")) {
        json_t *first = json_array_get(json_object_get(pp, "single"), 0);
        json_t *id = json_object_get(json_object_get(first, "SpecialToken"), "id");
        if (json_is_string(id))
            t->bos = pd_tok_id_of(t, json_string_value(id));
    }
    if (t->bos < 0)
        t->bos = first_present(t, bos, 4);
    t->eos = first_present(t, eos, 4);
}

static int parse_root(struct pd_tok *t, json_t *root, const char *label, pd_err *e)
{
    bl_init();
    int rc;
    json_t *model = json_object_get(root, "model");
    if (!json_is_object(model))
        return ferr(e, PD_EFORMAT, label, "model", "expected an object");
    if ((rc = check_model(t, model, label, e)) || (rc = load_vocab(t, model, label, e)) ||
        (rc = load_merges(t, model, label, e)) || (rc = load_added(t, root, label, e)) ||
        (rc = check_normalizer(json_object_get(root, "normalizer"), label, "normalizer", e)) ||
        (rc = load_pretok(t, root, label, e)) || (rc = check_decoder(root, label, e)))
        return rc;
    for (int b = 0; b < 256; b++)
        t->byte_id[b] = sh_find(t, bl_str[b], bl_len[b]);
    find_bos_eos(t, root);
    return 0;
}

void pd_tok_free(struct pd_tok *t)
{
    if (!t)
        return;
    free(t->ti);
    free(t->bytes.p);
    free(t->strs.p);
    free(t->shash);
    free(t->mhash);
    free(t->added);
    free(t->aorder);
    steps_free(t->steps, t->n_steps);
    free(t);
}

static int from_json(json_t *root, const char *label, struct pd_tok **out, pd_err *e)
{
    struct pd_tok *t = calloc(1, sizeof *t);
    if (!t) {
        json_decref(root);
        return pd_err_set(e, PD_ENOMEM, "%s: out of memory", label);
    }
    snprintf(t->label, sizeof t->label, "%s", label);
    int rc = parse_root(t, root, label, e);
    json_decref(root);
    if (rc) {
        pd_tok_free(t);
        return rc;
    }
    *out = t;
    return 0;
}

int pd_tok_load(const char *path, struct pd_tok **t, pd_err *e)
{
    *t = NULL;
    json_t *root = pd_json_load_file(path, e);
    if (!root)
        return e ? e->code : PD_EFORMAT;
    return from_json(root, path, t, e);
}

int pd_tok_parse(const char *json_text, const char *label, struct pd_tok **t, pd_err *e)
{
    *t = NULL;
    json_t *root = pd_json_load_str(json_text, label, e);
    if (!root)
        return e ? e->code : PD_EFORMAT;
    return from_json(root, label, t, e);
}

/* ---------------------------------------------------------------------------------------------
 * Encoding
 * ------------------------------------------------------------------------------------------- */

static int out_push(struct work *w, int32_t id)
{
    if (PD_GROW(w->out, w->outcap, w->nout + 1))
        return PD_ENOMEM;
    w->out[w->nout++] = id;
    return 0;
}

static int hless(const struct hent *a, const struct hent *b)
{
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static int heap_push(struct work *w, struct hent h)
{
    if (PD_GROW(w->heap, w->hcap, w->hn + 1))
        return PD_ENOMEM;
    size_t i = w->hn++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!hless(&h, &w->heap[up]))
            break;
        w->heap[i] = w->heap[up];
        i = up;
    }
    w->heap[i] = h;
    return 0;
}

static struct hent heap_pop(struct work *w)
{
    struct hent top = w->heap[0], last = w->heap[--w->hn];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= w->hn)
            break;
        if (c + 1 < w->hn && hless(&w->heap[c + 1], &w->heap[c]))
            c++;
        if (!hless(&w->heap[c], &last))
            break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (w->hn)
        w->heap[i] = last;
    return top;
}

/* Queues the merge of symbol i with its right neighbour, if the pair has one. */
static int bpe_candidate(const struct pd_tok *t, struct work *w, int32_t i)
{
    int32_t j = w->sym[i].next;
    if (j < 0)
        return 0;
    const struct mslot *m = mh_find(t, w->sym[i].id, w->sym[j].id);
    if (!m)
        return 0;
    return heap_push(w, (struct hent){m->rank, (uint32_t)i, w->sym[i].id, w->sym[j].id, m->id});
}

/* BPE of one piece's bytes: the lowest-ranked merge first, leftmost among equal ranks; a queued
 * merge whose pair has changed since is dropped when popped (as in HF's Word::merge_all). */
static int bpe_piece(const struct pd_tok *t, struct work *w, const uint8_t *s, size_t n,
                     pd_err *e)
{
    for (size_t i = 0; i < n; i++) {
        if (t->byte_id[s[i]] < 0)
            return pd_err_set(e, PD_EINVAL, "%s: byte 0x%02x has no token in model.vocab",
                              t->label, s[i]);
    }
    if (n == 1)
        return out_push(w, t->byte_id[s[0]]);
    if (n > INT32_MAX)
        return pd_err_set(e, PD_ERANGE, "%s: a pre-tokenized piece of %zu bytes is too long",
                          t->label, n);
    if (t->ignore_merges) {
        if (PD_GROW(w->tmp, w->tmpcap, 2 * n))
            return PD_ENOMEM;
        size_t k = 0;
        for (size_t i = 0; i < n; i++) {
            memcpy(w->tmp + k, bl_str[s[i]], bl_len[s[i]]);
            k += bl_len[s[i]];
        }
        int32_t id = sh_find(t, w->tmp, k);
        if (id >= 0)
            return out_push(w, id);
    }
    if (PD_GROW(w->sym, w->symcap, n))
        return PD_ENOMEM;
    for (size_t i = 0; i < n; i++)
        w->sym[i] = (struct sym){t->byte_id[s[i]], (int32_t)i - 1, i + 1 < n ? (int32_t)i + 1 : -1};
    w->hn = 0;
    for (size_t i = 0; i + 1 < n; i++) {
        if (bpe_candidate(t, w, (int32_t)i))
            return PD_ENOMEM;
    }
    while (w->hn) {
        struct hent h = heap_pop(w);
        struct sym *a = &w->sym[h.pos];
        if (a->id != h.a || a->next < 0 || w->sym[a->next].id != h.b)
            continue;
        struct sym *b = &w->sym[a->next];
        a->id = h.id;
        a->next = b->next;
        if (b->next >= 0)
            w->sym[b->next].prev = (int32_t)h.pos;
        b->id = -1;
        if ((a->prev >= 0 && bpe_candidate(t, w, a->prev)) ||
            bpe_candidate(t, w, (int32_t)h.pos))
            return PD_ENOMEM;
    }
    for (int32_t i = 0; i >= 0; i = w->sym[i].next) {
        if (out_push(w, w->sym[i].id))
            return PD_ENOMEM;
    }
    return 0;
}

static int encode_segment(const struct pd_tok *t, struct work *w, const uint8_t *s, size_t n,
                          pd_err *e)
{
    int rc = pretokenize(w, t->steps, t->n_steps, s, n, t->label, e);
    if (rc)
        return rc;
    for (size_t i = 0; i < w->np; i++) {
        size_t a = w->off[w->p[i].a], b = w->off[w->p[i].b];
        rc = bpe_piece(t, w, w->s + a, b - a, e);
        if (rc)
            return rc == PD_ENOMEM ? pd_err_set(e, rc, "%s: out of memory encoding", t->label)
                                   : rc;
    }
    return 0;
}

/* The code point that ends at s[i] (i > lo); invalid bytes stand alone. Returns its length. */
static size_t cp_before(const uint8_t *s, size_t lo, size_t i, uint32_t *cp)
{
    for (size_t k = 2; k <= 4 && k <= i - lo; k++) {
        if ((s[i - k] & 0xC0) != 0x80 && pd_uc_utf8_dec(s + i - k, k, cp) == k)
            return k;
    }
    pd_uc_utf8_dec(s + i - 1, 1, cp);
    return 1;
}

static int is_word_at(const uint8_t *s, size_t len, size_t i)
{
    uint32_t cp;
    if (i >= len)
        return 0;
    pd_uc_utf8_dec(s + i, len - i, &cp);
    return (pd_uc_feat(cp) & PD_UC_WORD) != 0;
}

/* The leftmost added token at or after `from` (longest first among those starting at the same
 * byte), widened by its lstrip/rstrip whitespace. */
static int find_added(const struct pd_tok *t, const uint8_t *s, size_t len, size_t from,
                      size_t *ms, size_t *me, int32_t *id)
{
    for (size_t i = from; i < len; i++) {
        for (int k = t->abucket[s[i]]; k < t->abucket[s[i] + 1]; k++) {
            const struct added *a = &t->added[t->aorder[k]];
            if (a->len > len - i || memcmp(s + i, t->bytes.p + a->off, a->len))
                continue;
            size_t st = i, en = i + a->len;
            if (a->single_word) {
                uint32_t before = 0;
                if ((st > 0 && cp_before(s, 0, st, &before) && (pd_uc_feat(before) & PD_UC_WORD)) ||
                    is_word_at(s, len, en))
                    continue;
            }
            while (a->lstrip && st > from) {
                uint32_t c;
                size_t cl = cp_before(s, from, st, &c);
                if (!(pd_uc_feat(c) & PD_UC_SPACE))
                    break;
                st -= cl;
            }
            while (a->rstrip && en < len) {
                uint32_t c;
                size_t cl = pd_uc_utf8_dec(s + en, len - en, &c);
                if (!(pd_uc_feat(c) & PD_UC_SPACE))
                    break;
                en += cl;
            }
            *ms = st, *me = en, *id = a->id;
            return 1;
        }
    }
    return 0;
}

static int encode_work(const struct pd_tok *t, struct work *w, const char *text, size_t len,
                       pd_err *e)
{
    w->ref = t->use_ref;
    const uint8_t *s = (const uint8_t *)text;
    size_t pos = 0;
    while (pos < len) {
        size_t ms = len, me = len;
        int32_t id = -1;
        int found = t->n_added && find_added(t, s, len, pos, &ms, &me, &id);
        if (ms > pos) {
            int rc = encode_segment(t, w, s + pos, ms - pos, e);
            if (rc)
                return rc;
        }
        if (!found)
            break;
        if (out_push(w, id))
            return pd_err_set(e, PD_ENOMEM, "%s: out of memory encoding", t->label);
        pos = me;
    }
    return 0;
}

int pd_tok_encode(const struct pd_tok *t, const char *text, size_t len, int32_t **ids, size_t *n,
                  pd_err *e)
{
    struct work w = {0};
    *ids = NULL;
    *n = 0;
    int rc = encode_work(t, &w, text, len, e);
    if (!rc && !w.out) {
        w.out = malloc(sizeof *w.out);   /* a valid pointer even for no ids */
        if (!w.out)
            rc = pd_err_set(e, PD_ENOMEM, "%s: out of memory encoding", t->label);
    }
    if (!rc) {
        *ids = w.out;
        *n = w.nout;
        w.out = NULL;
    }
    work_free(&w);
    return rc;
}

int pd_tok_encode_into(const struct pd_tok *t, const char *text, size_t len, int32_t *ids,
                       size_t cap, size_t *n, pd_err *e)
{
    struct work w = {0};
    int rc = encode_work(t, &w, text, len, e);
    *n = w.nout;
    if (!rc && w.nout > cap)
        rc = pd_err_set(e, PD_ERANGE, "%s: %zu ids do not fit a buffer of %zu", t->label,
                        w.nout, cap);
    else if (!rc && w.nout)
        memcpy(ids, w.out, w.nout * sizeof *ids);
    work_free(&w);
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * Decoding and lookups
 * ------------------------------------------------------------------------------------------- */

const char *pd_tok_token_bytes(const struct pd_tok *t, int32_t id, size_t *len)
{
    if (id < 0 || id >= t->n_ids || !t->ti[id].kind)
        return NULL;
    *len = t->ti[id].len;
    return t->bytes.p + t->ti[id].off;
}

int pd_tok_decode_one(const struct pd_tok *t, int32_t id, char *buf, size_t cap)
{
    size_t len;
    const char *p = pd_tok_token_bytes(t, id, &len);
    if (!p)
        return PD_EINVAL;
    if (len > cap)
        return PD_ERANGE;
    memcpy(buf, p, len);
    return (int)len;
}

int pd_tok_decode(const struct pd_tok *t, const int32_t *ids, size_t n, char **out, size_t *len)
{
    *out = NULL;
    *len = 0;
    size_t total = 0, l;
    for (size_t i = 0; i < n; i++) {
        if (!pd_tok_token_bytes(t, ids[i], &l))
            return PD_EINVAL;
        total += l;
    }
    char *p = malloc(total + 1);
    if (!p)
        return PD_ENOMEM;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        const char *b = pd_tok_token_bytes(t, ids[i], &l);
        memcpy(p + k, b, l);
        k += l;
    }
    p[k] = 0;
    *out = p;
    *len = k;
    return 0;
}

size_t pd_tok_max_token_bytes(const struct pd_tok *t)
{
    return t->max_bytes;
}

void pd_tok_set_reference_matcher(struct pd_tok *t, int on)
{
    t->use_ref = on != 0;
}

int32_t pd_tok_vocab_size(const struct pd_tok *t)
{
    return t->n_ids;
}

int pd_tok_is_special(const struct pd_tok *t, int32_t id)
{
    return id >= 0 && id < t->n_ids && (t->ti[id].kind & K_ADDED) && t->ti[id].special;
}

int32_t pd_tok_bos(const struct pd_tok *t)
{
    return t->bos;
}

int32_t pd_tok_eos(const struct pd_tok *t)
{
    return t->eos;
}

int pd_tok_regex_split(const char *pattern, const char *label, const char *text, size_t len,
                       size_t **bounds, size_t *n, pd_err *e)
{
    *bounds = NULL;
    *n = 0;
    struct pstep st = {.kind = ST_SPLIT, .behavior = B_ISOLATED};
    st.rx = pd_rx_compile(pattern, strlen(pattern), label, "pattern", e);
    if (!st.rx)
        return e ? e->code : PD_EFORMAT;
    struct work w = {0};
    int rc = pretokenize(&w, &st, 1, (const uint8_t *)text, len, label, e);
    size_t *b = NULL;
    if (!rc && !(b = malloc((w.np + 1) * sizeof *b)))
        rc = pd_err_set(e, PD_ENOMEM, "%s: out of memory", label);
    if (!rc) {
        for (size_t i = 0; i < w.np; i++)
            b[i] = w.off[w.p[i].a];
        b[w.np] = w.np ? w.off[w.p[w.np - 1].b] : 0;
        *bounds = b;
        *n = w.np;
    }
    work_free(&w);
    pd_rx_free(st.rx);
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * Training (pd_tok_train)
 * ------------------------------------------------------------------------------------------- */

struct tword {
    uint32_t off, len;       /* the word's bytes in wbytes */
    int64_t count;
    size_t soff;             /* its symbols in syms */
    uint32_t slen;
};

struct tpair {
    uint64_t key;            /* left << 32 | right; MH_EMPTY when the slot is free */
    int64_t count;           /* occurrences, weighted by word counts */
    int32_t *w;              /* words that contain (or once contained) the pair */
    uint32_t nw, cw;
    uint32_t touch;          /* merge step that last changed count */
    uint8_t done;            /* already recorded as a merge */
};

struct theap {
    int64_t count;
    uint64_t key;
};

struct trainer {
    struct sbuf wbytes;
    struct tword *words;
    size_t nw, wcap;
    int32_t *whash;
    size_t wmask;
    int32_t *syms;
    size_t nsyms;
    struct sbuf tbytes;      /* bytes of every token */
    uint32_t *toff, *tlen;   /* [vocab_size] */
    int32_t ntok;
    int32_t *thash;          /* token bytes -> id (specials excluded) */
    size_t tmask;
    int n_special;
    struct tpair *pairs;
    size_t pmask, npairs;
    struct theap *heap;
    size_t hn, hcap;
    uint64_t *touched;
    size_t ntouched, touchcap;
    uint32_t iter, *stamp;
    int32_t (*merges)[2];
    size_t nmerges, mcap;
};

static void trainer_free(struct trainer *tr)
{
    free(tr->wbytes.p);
    free(tr->words);
    free(tr->whash);
    free(tr->syms);
    free(tr->tbytes.p);
    free(tr->toff);
    free(tr->tlen);
    free(tr->thash);
    if (tr->pairs) {
        for (size_t i = 0; i <= tr->pmask; i++)
            free(tr->pairs[i].w);
    }
    free(tr->pairs);
    free(tr->heap);
    free(tr->touched);
    free(tr->stamp);
    free(tr->merges);
}

static int word_rehash(struct trainer *tr, size_t cap)
{
    int32_t *h = malloc(cap * sizeof *h);
    if (!h)
        return PD_ENOMEM;
    memset(h, 0xff, cap * sizeof *h);
    for (size_t w = 0; w < tr->nw; w++) {
        size_t i = hash_bytes(tr->wbytes.p + tr->words[w].off, tr->words[w].len) & (cap - 1);
        while (h[i] >= 0)
            i = (i + 1) & (cap - 1);
        h[i] = (int32_t)w;
    }
    free(tr->whash);
    tr->whash = h;
    tr->wmask = cap - 1;
    return 0;
}

static int word_add(struct trainer *tr, const uint8_t *s, size_t n)
{
    if ((tr->nw + 1) * 2 > tr->wmask + 1 && word_rehash(tr, (tr->wmask + 1) * 2))
        return PD_ENOMEM;
    size_t i = hash_bytes(s, n) & tr->wmask;
    for (; tr->whash[i] >= 0; i = (i + 1) & tr->wmask) {
        struct tword *w = &tr->words[tr->whash[i]];
        if (w->len == n && !memcmp(tr->wbytes.p + w->off, s, n)) {
            w->count++;
            return 0;
        }
    }
    if (tr->nw >= INT32_MAX || PD_GROW(tr->words, tr->wcap, tr->nw + 1))
        return PD_ENOMEM;
    struct tword *w = &tr->words[tr->nw];
    memset(w, 0, sizeof *w);
    if (arena_add(&tr->wbytes, s, n, &w->off))
        return PD_ENOMEM;
    w->len = (uint32_t)n;
    w->count = 1;
    tr->whash[i] = (int32_t)tr->nw++;
    return 0;
}

/* Slot of a pair, created if absent (create) or -1. Grows at half load. */
static ptrdiff_t pair_slot(struct trainer *tr, uint64_t key, int create)
{
    if (create && (tr->npairs + 1) * 2 > tr->pmask + 1) {
        size_t cap = (tr->pmask + 1) * 2;
        struct tpair *np = malloc(cap * sizeof *np);
        if (!np)
            return -1;
        memset(np, 0, cap * sizeof *np);
        for (size_t i = 0; i < cap; i++)
            np[i].key = MH_EMPTY;
        for (size_t i = 0; i <= tr->pmask; i++) {
            if (tr->pairs[i].key == MH_EMPTY)
                continue;
            size_t j = hash_u64(tr->pairs[i].key) & (cap - 1);
            while (np[j].key != MH_EMPTY)
                j = (j + 1) & (cap - 1);
            np[j] = tr->pairs[i];
        }
        free(tr->pairs);
        tr->pairs = np;
        tr->pmask = cap - 1;
    }
    size_t i = hash_u64(key) & tr->pmask;
    for (; tr->pairs[i].key != MH_EMPTY; i = (i + 1) & tr->pmask) {
        if (tr->pairs[i].key == key)
            return (ptrdiff_t)i;
    }
    if (!create)
        return -1;
    tr->pairs[i].key = key;
    tr->npairs++;
    return (ptrdiff_t)i;
}

static int pair_add(struct trainer *tr, int32_t a, int32_t b, int64_t delta, int32_t w)
{
    ptrdiff_t i = pair_slot(tr, (uint64_t)(uint32_t)a << 32 | (uint32_t)b, 1);
    if (i < 0)
        return PD_ENOMEM;
    struct tpair *p = &tr->pairs[i];
    p->count += delta;
    if (w >= 0 && (p->nw == 0 || p->w[p->nw - 1] != w)) {
        if (p->nw == p->cw) {
            uint32_t c = p->cw ? p->cw * 2 : 4;
            int32_t *nw = realloc(p->w, c * sizeof *nw);
            if (!nw)
                return PD_ENOMEM;
            p->w = nw;
            p->cw = c;
        }
        p->w[p->nw++] = w;
    }
    if (tr->iter && p->touch != tr->iter) {
        p->touch = tr->iter;
        if (PD_GROW(tr->touched, tr->touchcap, tr->ntouched + 1))
            return PD_ENOMEM;
        tr->touched[tr->ntouched++] = p->key;
    }
    return 0;
}

/* Max-heap: highest count first, then the smallest (left, right). */
static int theap_before(const struct theap *x, const struct theap *y)
{
    return x->count != y->count ? x->count > y->count : x->key < y->key;
}

static int theap_push(struct trainer *tr, int64_t count, uint64_t key)
{
    if (PD_GROW(tr->heap, tr->hcap, tr->hn + 1))
        return PD_ENOMEM;
    struct theap h = {count, key};
    size_t i = tr->hn++;
    while (i > 0 && theap_before(&h, &tr->heap[(i - 1) / 2])) {
        tr->heap[i] = tr->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    tr->heap[i] = h;
    return 0;
}

static struct theap theap_pop(struct trainer *tr)
{
    struct theap top = tr->heap[0], last = tr->heap[--tr->hn];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= tr->hn)
            break;
        if (c + 1 < tr->hn && theap_before(&tr->heap[c + 1], &tr->heap[c]))
            c++;
        if (!theap_before(&tr->heap[c], &last))
            break;
        tr->heap[i] = tr->heap[c];
        i = c;
    }
    if (tr->hn)
        tr->heap[i] = last;
    return top;
}

static int32_t tok_find(const struct trainer *tr, const char *s, size_t n)
{
    for (size_t i = hash_bytes(s, n) & tr->tmask; tr->thash[i] >= 0; i = (i + 1) & tr->tmask) {
        int32_t id = tr->thash[i];
        if (tr->tlen[id] == n && !memcmp(tr->tbytes.p + tr->toff[id], s, n))
            return id;
    }
    return -1;
}

static int tok_add(struct trainer *tr, const char *s, size_t n, int hashed)
{
    int32_t id = tr->ntok++;
    if (arena_add(&tr->tbytes, s, n, &tr->toff[id]))
        return PD_ENOMEM;
    tr->tlen[id] = (uint32_t)n;
    if (hashed) {
        size_t i = hash_bytes(s, n) & tr->tmask;
        while (tr->thash[i] >= 0)
            i = (i + 1) & tr->tmask;
        tr->thash[i] = id;
    }
    return 0;
}

/* Replaces every (a, b) in word w by c, left to right, keeping pair counts exact: each
 * replacement retires (prev, a), (a, b), (b, next) and adds (prev, c), (c, next). */
static int word_merge(struct trainer *tr, int32_t w, int32_t a, int32_t b, int32_t c)
{
    struct tword *wd = &tr->words[w];
    int32_t *s = tr->syms + wd->soff;
    int64_t f = wd->count;
    uint32_t n = wd->slen, i = 0, j = 0;
    while (i < n) {
        if (i + 1 < n && s[i] == a && s[i + 1] == b) {
            if (pair_add(tr, a, b, -f, -1))
                return PD_ENOMEM;
            if (j > 0 && (pair_add(tr, s[j - 1], a, -f, -1) || pair_add(tr, s[j - 1], c, f, w)))
                return PD_ENOMEM;
            if (i + 2 < n && (pair_add(tr, b, s[i + 2], -f, -1) || pair_add(tr, c, s[i + 2], f, w)))
                return PD_ENOMEM;
            s[j++] = c;
            i += 2;
        } else {
            s[j++] = s[i++];
        }
    }
    wd->slen = j;
    return 0;
}

/* Pre-tokenizes the training text (specials removed) and counts distinct words. */
static int count_words(struct trainer *tr, struct work *wk, const struct pstep *st,
                       const uint8_t *s, size_t len, const char *const *special, int n_special,
                       const char *label, pd_err *e)
{
    size_t pos = 0;
    while (pos < len) {
        size_t ms = len, me = len;
        for (size_t i = pos; i < len && ms == len; i++) {
            size_t best = 0;
            for (int k = 0; k < n_special; k++) {
                size_t sl = strlen(special[k]);
                if (sl > best && sl <= len - i && !memcmp(s + i, special[k], sl))
                    best = sl;
            }
            if (best)
                ms = i, me = i + best;
        }
        if (ms > pos) {
            int rc = pretokenize(wk, st, 1, s + pos, ms - pos, label, e);
            if (rc)
                return rc;
            for (size_t i = 0; i < wk->np; i++) {
                size_t a = wk->off[wk->p[i].a], b = wk->off[wk->p[i].b];
                if (word_add(tr, wk->s + a, b - a))
                    return PD_ENOMEM;
            }
        }
        pos = me;
    }
    return 0;
}

static int learn(struct trainer *tr, int vocab_size, pd_err *e)
{
    size_t total = 0;
    for (size_t w = 0; w < tr->nw; w++)
        total += tr->words[w].len;
    tr->syms = malloc((total + 1) * sizeof *tr->syms);
    tr->stamp = calloc(tr->nw + 1, sizeof *tr->stamp);
    size_t cap = pow2_at_least(total + 16);
    tr->pairs = malloc(cap * sizeof *tr->pairs);
    if (!tr->syms || !tr->stamp || !tr->pairs)
        return PD_ENOMEM;
    memset(tr->pairs, 0, cap * sizeof *tr->pairs);
    for (size_t i = 0; i < cap; i++)
        tr->pairs[i].key = MH_EMPTY;
    tr->pmask = cap - 1;
    size_t k = 0;
    for (size_t w = 0; w < tr->nw; w++) {
        struct tword *wd = &tr->words[w];
        wd->soff = k;
        wd->slen = wd->len;
        for (uint32_t i = 0; i < wd->len; i++)
            tr->syms[k++] = tr->n_special + (uint8_t)tr->wbytes.p[wd->off + i];
        for (uint32_t i = 0; i + 1 < wd->len; i++) {
            if (pair_add(tr, tr->syms[wd->soff + i], tr->syms[wd->soff + i + 1], wd->count,
                         (int32_t)w))
                return PD_ENOMEM;
        }
    }
    for (size_t i = 0; i <= tr->pmask; i++) {
        if (tr->pairs[i].key != MH_EMPTY && tr->pairs[i].count > 0 &&
            theap_push(tr, tr->pairs[i].count, tr->pairs[i].key))
            return PD_ENOMEM;
    }
    struct sbuf cat = {0};
    int rc = 0;
    while (tr->ntok < vocab_size) {
        ptrdiff_t pi = -1;
        while (tr->hn) {
            struct theap top = theap_pop(tr);
            pi = pair_slot(tr, top.key, 0);
            if (pi >= 0 && top.count > 0 && tr->pairs[pi].count == top.count)
                break;
            pi = -1;
        }
        if (pi < 0) {
            rc = pd_err_set(e, PD_EINVAL, "tokenizer training: the text yields only %d tokens, "
                            "fewer than the vocab_size of %d; give a longer, more varied text",
                            tr->ntok, vocab_size);
            break;
        }
        struct tpair *p = &tr->pairs[pi];
        int32_t a = (int32_t)(p->key >> 32), b = (int32_t)(p->key & 0xffffffffu);
        cat.n = 0;
        if (sb_add(&cat, tr->tbytes.p + tr->toff[a], tr->tlen[a]) ||
            sb_add(&cat, tr->tbytes.p + tr->toff[b], tr->tlen[b])) {
            rc = PD_ENOMEM;
            break;
        }
        int32_t c = tok_find(tr, cat.p, cat.n);
        if (c < 0) {
            c = tr->ntok;
            if (tok_add(tr, cat.p, cat.n, 1)) {
                rc = PD_ENOMEM;
                break;
            }
        }
        if (!p->done) {
            p->done = 1;
            if (PD_GROW(tr->merges, tr->mcap, tr->nmerges + 1)) {
                rc = PD_ENOMEM;
                break;
            }
            tr->merges[tr->nmerges][0] = a;
            tr->merges[tr->nmerges][1] = b;
            tr->nmerges++;
        }
        /* the pair never gains words while it is merged (c differs from a and b), so its
         * word list can be taken out before pair_add may move the table */
        int32_t *list = p->w;
        uint32_t nl = p->nw;
        p->w = NULL;
        p->nw = p->cw = 0;
        tr->iter++;
        tr->ntouched = 0;
        for (uint32_t i = 0; i < nl && !rc; i++) {
            int32_t w = list[i];
            if (tr->stamp[w] == tr->iter)
                continue;
            tr->stamp[w] = tr->iter;
            rc = word_merge(tr, w, a, b, c);
        }
        free(list);
        for (size_t i = 0; i < tr->ntouched && !rc; i++) {
            ptrdiff_t q = pair_slot(tr, tr->touched[i], 0);
            if (q >= 0 && tr->pairs[q].count > 0)
                rc = theap_push(tr, tr->pairs[q].count, tr->touched[i]);
        }
        if (rc)
            break;
    }
    free(cat.p);
    return rc;
}

static json_t *jobj(const char *type)
{
    json_t *o = json_object();
    if (o && type)
        json_object_set_new(o, "type", json_string(type));
    return o;
}

/* Byte-level spelling of bytes, into sb (reset first). */
static int bl_spell(struct sbuf *sb, const char *s, size_t n)
{
    sb->n = 0;
    if (sb_add(sb, "", 0))
        return PD_ENOMEM;
    for (size_t i = 0; i < n; i++) {
        if (sb_add(sb, bl_str[(uint8_t)s[i]], bl_len[(uint8_t)s[i]]))
            return PD_ENOMEM;
    }
    return 0;
}

static int emit_json(const struct trainer *tr, const char *const *special, char **json_out,
                     pd_err *e)
{
    json_t *root = json_object();
    json_t *added = json_array(), *vocab = json_object(), *merges = json_array();
    struct sbuf sa = {0}, sb = {0}, line = {0};
    int rc = 0;
    if (!root || !added || !vocab || !merges)
        rc = PD_ENOMEM;
    for (int i = 0; i < tr->n_special && !rc; i++) {
        json_t *o = json_object();
        json_t *c = json_string(special[i]);
        if (!o || !c) {
            json_decref(o);
            json_decref(c);
            rc = pd_err_set(e, PD_EINVAL, "tokenizer training: special token %d is not valid "
                            "UTF-8", i);
            break;
        }
        json_object_set_new(o, "id", json_integer(i));
        json_object_set_new(o, "content", c);
        json_object_set_new(o, "single_word", json_false());
        json_object_set_new(o, "lstrip", json_false());
        json_object_set_new(o, "rstrip", json_false());
        json_object_set_new(o, "normalized", json_false());
        json_object_set_new(o, "special", json_true());
        json_array_append_new(added, o);
    }
    for (int32_t id = 0; id < tr->ntok && !rc; id++) {
        const char *key;
        if (id < tr->n_special) {
            key = special[id];
        } else {
            if (bl_spell(&sa, tr->tbytes.p + tr->toff[id], tr->tlen[id])) {
                rc = PD_ENOMEM;
                break;
            }
            key = sa.p;
        }
        if (json_object_get(vocab, key)) {
            rc = pd_err_set(e, PD_EINVAL, "tokenizer training: special token \"%.60s\" is "
                            "spelled like another token", key);
            break;
        }
        if (json_object_set_new(vocab, key, json_integer(id)))
            rc = PD_ENOMEM;
    }
    for (size_t m = 0; m < tr->nmerges && !rc; m++) {
        int32_t a = tr->merges[m][0], b = tr->merges[m][1];
        if (bl_spell(&sa, tr->tbytes.p + tr->toff[a], tr->tlen[a]) ||
            bl_spell(&sb, tr->tbytes.p + tr->toff[b], tr->tlen[b])) {
            rc = PD_ENOMEM;
            break;
        }
        line.n = 0;
        if (sb_add(&line, sa.p, sa.n) || sb_add(&line, " ", 1) || sb_add(&line, sb.p, sb.n) ||
            json_array_append_new(merges, json_stringn(line.p, line.n)))
            rc = PD_ENOMEM;
    }
    free(sa.p);
    free(sb.p);
    free(line.p);
    if (rc) {
        json_decref(root);
        json_decref(added);
        json_decref(vocab);
        json_decref(merges);
        return rc == PD_ENOMEM ? pd_err_set(e, rc, "tokenizer training: out of memory") : rc;
    }
    json_t *split = jobj("Split"), *pat = json_object(), *bl = jobj("ByteLevel");
    json_object_set_new(pat, "Regex", json_string(train_pattern));
    json_object_set_new(split, "pattern", pat);
    json_object_set_new(split, "behavior", json_string("Isolated"));
    json_object_set_new(split, "invert", json_false());
    json_object_set_new(bl, "add_prefix_space", json_false());
    json_object_set_new(bl, "trim_offsets", json_true());
    json_object_set_new(bl, "use_regex", json_false());
    json_t *steps = json_array();
    json_array_append_new(steps, split);
    json_array_append_new(steps, bl);
    json_t *pre = jobj("Sequence");
    json_object_set_new(pre, "pretokenizers", steps);
    json_t *dec = jobj("ByteLevel");
    json_object_set_new(dec, "add_prefix_space", json_true());
    json_object_set_new(dec, "trim_offsets", json_true());
    json_object_set_new(dec, "use_regex", json_true());
    json_t *model = jobj("BPE");
    json_object_set_new(model, "dropout", json_null());
    json_object_set_new(model, "unk_token", json_null());
    json_object_set_new(model, "continuing_subword_prefix", json_null());
    json_object_set_new(model, "end_of_word_suffix", json_null());
    json_object_set_new(model, "fuse_unk", json_false());
    json_object_set_new(model, "byte_fallback", json_false());
    json_object_set_new(model, "ignore_merges", json_false());
    json_object_set_new(model, "vocab", vocab);
    json_object_set_new(model, "merges", merges);
    json_object_set_new(root, "version", json_string("1.0"));
    json_object_set_new(root, "truncation", json_null());
    json_object_set_new(root, "padding", json_null());
    json_object_set_new(root, "added_tokens", added);
    json_object_set_new(root, "normalizer", json_null());
    json_object_set_new(root, "pre_tokenizer", pre);
    json_object_set_new(root, "post_processor", json_null());
    json_object_set_new(root, "decoder", dec);
    json_object_set_new(root, "model", model);
    *json_out = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(root);
    if (!*json_out)
        return pd_err_set(e, PD_ENOMEM, "tokenizer training: out of memory writing JSON");
    return 0;
}

int pd_tok_train(const char *text, size_t len, int vocab_size, const char *const *special,
                 int n_special, char **json_out, pd_err *e)
{
    *json_out = NULL;
    const char *label = "tokenizer training";
    if (n_special < 0 || (n_special && !special))
        return pd_err_set(e, PD_EINVAL, "%s: bad special token list", label);
    if (vocab_size < n_special + 256 || vocab_size > PD_TOK_MAX_IDS)
        return pd_err_set(e, PD_EINVAL, "%s: vocab_size %d must be in [%d, %d] (the specials "
                          "plus 256 byte tokens at least)", label, vocab_size, n_special + 256,
                          PD_TOK_MAX_IDS);
    for (int i = 0; i < n_special; i++) {
        if (!special[i] || !special[i][0])
            return pd_err_set(e, PD_EINVAL, "%s: special token %d is empty", label, i);
        for (int j = 0; j < i; j++) {
            if (!strcmp(special[i], special[j]))
                return pd_err_set(e, PD_EINVAL, "%s: special token \"%.60s\" is listed twice",
                                  label, special[i]);
        }
    }
    bl_init();
    struct pstep st = {.kind = ST_SPLIT, .behavior = B_ISOLATED};
    st.rx = pd_rx_compile(train_pattern, strlen(train_pattern), label, "pattern", e);
    if (!st.rx)
        return e ? e->code : PD_EFORMAT;
    struct trainer tr = {0};
    struct work wk = {0};
    tr.n_special = n_special;
    size_t tcap = pow2_at_least((size_t)vocab_size * 2);
    tr.toff = malloc((size_t)vocab_size * sizeof *tr.toff);
    tr.tlen = malloc((size_t)vocab_size * sizeof *tr.tlen);
    tr.thash = malloc(tcap * sizeof *tr.thash);
    int rc = !tr.toff || !tr.tlen || !tr.thash || word_rehash(&tr, 1024) ? PD_ENOMEM : 0;
    if (!rc) {
        memset(tr.thash, 0xff, tcap * sizeof *tr.thash);
        tr.tmask = tcap - 1;
        for (int i = 0; i < n_special && !rc; i++)
            rc = tok_add(&tr, special[i], strlen(special[i]), 0);
        for (int b = 0; b < 256 && !rc; b++) {
            char c = (char)b;
            rc = tok_add(&tr, &c, 1, 1);
        }
    }
    if (!rc)
        rc = count_words(&tr, &wk, &st, (const uint8_t *)text, len, special, n_special, label, e);
    work_free(&wk);
    pd_rx_free(st.rx);
    if (!rc)
        rc = learn(&tr, vocab_size, e);
    if (!rc)
        rc = emit_json(&tr, special, json_out, e);
    trainer_free(&tr);
    if (rc == PD_ENOMEM && (!e || e->code != PD_ENOMEM))
        pd_err_set(e, rc, "%s: out of memory", label);
    return rc;
}

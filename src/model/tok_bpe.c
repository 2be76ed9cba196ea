/* Encoding: added tokens found in the text, the pre-tokenizer's pieces, and byte-level BPE of each
 * piece (the lowest-ranked merge first). */
#include "model/tok_internal.h"

#include <stdlib.h>

#include "model/unicode.h"

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
            memcpy(w->tmp + k, pd_tok_bl_str[s[i]], pd_tok_bl_len[s[i]]);
            k += pd_tok_bl_len[s[i]];
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
    int rc = pd_tok_pretokenize(w, t->steps, t->n_steps, s, n, t->label, e);
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

/* Spans where added tokens are not recognised (pd_tok_encode_plain), sorted and disjoint. */
struct plain {
    const struct pd_tok_span *s;
    size_t n;
};

/* 1 if [lo, hi) overlaps one of p's spans. */
static int overlaps_plain(const struct plain *p, size_t lo, size_t hi)
{
    size_t a = 0, b = p->n;   /* the first span that ends after lo */
    while (a < b) {
        size_t m = a + (b - a) / 2;
        if (p->s[m].off + p->s[m].len <= lo)
            a = m + 1;
        else
            b = m;
    }
    return a < p->n && p->s[a].off < hi;
}

/* The leftmost added token at or after `from` (longest first among those starting at the same
 * byte) that overlaps none of the plain spans, widened by its lstrip/rstrip whitespace. */
static int find_added(const struct pd_tok *t, const struct plain *plain, const uint8_t *s, size_t len, size_t from,
                      size_t *ms, size_t *me, int32_t *id)
{
    for (size_t i = from; i < len; i++) {
        for (int k = t->abucket[s[i]]; k < t->abucket[s[i] + 1]; k++) {
            const struct added *a = &t->added[t->aorder[k]];
            if (a->len > len - i || memcmp(s + i, t->bytes.p + a->off, a->len))
                continue;
            if (plain && overlaps_plain(plain, i, i + a->len))
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
                       const struct plain *plain, pd_err *e)
{
    w->ref = t->use_ref;
    const uint8_t *s = (const uint8_t *)text;
    size_t pos = 0;
    while (pos < len) {
        size_t ms = len, me = len;
        int32_t id = -1;
        int found = t->n_added && find_added(t, plain, s, len, pos, &ms, &me, &id);
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
    return pd_tok_encode_plain(t, text, len, NULL, 0, ids, n, e);
}

int pd_tok_encode_plain(const struct pd_tok *t, const char *text, size_t len, const struct pd_tok_span *plain,
                        size_t n_plain, int32_t **ids, size_t *n, pd_err *e)
{
    struct work w = {0};
    struct plain p = {plain, n_plain};
    *ids = NULL;
    *n = 0;
    int rc = encode_work(t, &w, text, len, n_plain ? &p : NULL, e);
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
    pd_tok_work_free(&w);
    return rc;
}

int pd_tok_encode_into(const struct pd_tok *t, const char *text, size_t len, int32_t *ids,
                       size_t cap, size_t *n, pd_err *e)
{
    struct work w = {0};
    int rc = encode_work(t, &w, text, len, NULL, e);
    *n = w.nout;
    if (!rc && w.nout > cap)
        rc = pd_err_set(e, PD_ERANGE, "%s: %zu ids do not fit a buffer of %zu", t->label,
                        w.nout, cap);
    else if (!rc && w.nout)
        memcpy(ids, w.out, w.nout * sizeof *ids);
    pd_tok_work_free(&w);
    return rc;
}


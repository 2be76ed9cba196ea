/* The GPT-2 byte map and the pre-tokenizer pipeline (tokenizer.json's pre_tokenizer: Split steps run
 * on model/regex.c with Unicode classes from model/unicode.c, ByteLevel); pieces are code point
 * ranges of the text, which tok_bpe.c encodes. */
#include "model/tok_internal.h"

#include <pthread.h>
#include <stdlib.h>

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
char pd_tok_bl_str[256][2];
uint8_t pd_tok_bl_len[256];
static int16_t bl_rev[256 + 68];     /* code point -> byte */
static pthread_once_t bl_once = PTHREAD_ONCE_INIT;

static void bl_init_once(void)
{
    for (unsigned b = 0; b < 256; b++) {
        uint32_t cp = pd_tok_byte_to_cp((uint8_t)b);
        pd_tok_bl_len[b] = (uint8_t)pd_uc_utf8_enc(cp, pd_tok_bl_str[b]);
        bl_rev[cp] = (int16_t)b;
    }
}

void pd_tok_bl_init(void)
{
    pthread_once(&bl_once, bl_init_once);
}

/* Byte-level string -> bytes. Returns the byte count, or -1 if a character is not one of the
 * 256 stand-ins (the caller then keeps the string's own UTF-8, as HF's decoder does). */
ptrdiff_t pd_tok_bl_decode(const char *s, size_t n, char *out)
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
 * Pre-tokenizer pipeline
 * ------------------------------------------------------------------------------------------- */

const char pd_tok_gpt2_pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
const char pd_tok_train_pattern[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}|"
    " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

void pd_tok_work_free(struct work *w)
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
int pd_tok_pretokenize(struct work *w, const struct pstep *steps, int n_steps, const uint8_t *s,
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

void pd_tok_steps_free(struct pstep *st, int n)
{
    for (int i = 0; i < n; i++)
        pd_rx_free(st[i].rx);
    free(st);
}


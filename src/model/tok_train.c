/* The BPE trainer (pd_tok_train): counts the pre-tokenized words of a text, learns merges by
 * highest pair count, and writes the tokenizer.json of synthetic checkpoints. */
#include "model/tok_internal.h"

#include <jansson.h>
#include <stdlib.h>

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
            int rc = pd_tok_pretokenize(wk, st, 1, s + pos, ms - pos, label, e);
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
        if (sb_add(sb, pd_tok_bl_str[(uint8_t)s[i]], pd_tok_bl_len[(uint8_t)s[i]]))
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
    json_object_set_new(pat, "Regex", json_string(pd_tok_train_pattern));
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
    pd_tok_bl_init();
    struct pstep st = {.kind = ST_SPLIT, .behavior = B_ISOLATED};
    st.rx = pd_rx_compile(pd_tok_train_pattern, strlen(pd_tok_train_pattern), label, "pattern", e);
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
    pd_tok_work_free(&wk);
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

/* Byte-level BPE tokenizer: the tokenizer.json reader (vocab, merges, added tokens, normalizer,
 * pre-tokenizer, decoder), decoding and lookups. The pre-tokenizer pipeline is tok_pretok.c, the
 * encoder tok_bpe.c, the trainer tok_train.c; their shared types are in tok_internal.h. The
 * supported format and every approximation are described in tokenizer.h. */
#include "model/tok_internal.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "model/jsonf.h"

/* ---------------------------------------------------------------------------------------------
 * The tokenizer
 * ------------------------------------------------------------------------------------------- */


static int ferr(pd_err *e, int code, const char *label, const char *field, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* The message names the file and the field; token text quoted in it may hold any byte, so
 * control characters are written as escapes (\n, \t, \r, \xHH): one line, whatever the file. */
static int ferr(pd_err *e, int code, const char *label, const char *field, const char *fmt, ...)
{
    char msg[384], line[384 * 4];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    size_t n = 0;
    for (const unsigned char *c = (const unsigned char *)msg; *c; c++) {
        if (*c >= 0x20 && *c != 0x7f)
            line[n++] = (char)*c;
        else if (*c == '\n' || *c == '\t' || *c == '\r')
            n += (size_t)sprintf(line + n, "\\%c", *c == '\n' ? 'n' : *c == '\t' ? 't' : 'r');
        else
            n += (size_t)sprintf(line + n, "\\x%02x", *c);
    }
    line[n] = 0;
    return pd_err_set(e, code, "%s: field \"%s\": %s", label, field, line);
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
        ptrdiff_t nb = pd_tok_bl_decode(key, kl, tmp);
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
            st->rx = pd_rx_compile(pd_tok_gpt2_pattern, strlen(pd_tok_gpt2_pattern), label, f, e);
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

static int find_bos_eos(struct pd_tok *t, json_t *root, const char *label, pd_err *e)
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
        if (json_is_string(id) && (t->bos = pd_tok_id_of(t, json_string_value(id))) < 0)
            /* the prompt's first token as the file says: one it does not hold is no BOS at all */
            return ferr(e, PD_EFORMAT, label, "post_processor.single[0].SpecialToken.id",
                        "\"%s\" is not a token of this tokenizer", json_string_value(id));
    }
    if (t->bos < 0)
        t->bos = first_present(t, bos, 4);
    t->eos = first_present(t, eos, 4);
    return 0;
}

static int parse_root(struct pd_tok *t, json_t *root, const char *label, pd_err *e)
{
    pd_tok_bl_init();
    int rc;
    json_t *model = json_object_get(root, "model");
    if (!json_is_object(model))
        return ferr(e, PD_EFORMAT, label, "model", "expected an object");
    if ((rc = check_model(t, model, label, e)) || (rc = load_vocab(t, model, label, e)) ||
        (rc = load_merges(t, model, label, e)) || (rc = load_added(t, root, label, e)) ||
        (rc = check_normalizer(json_object_get(root, "normalizer"), label, "normalizer", e)) ||
        (rc = load_pretok(t, root, label, e)) || (rc = check_decoder(root, label, e)))
        return rc;
    /* a byte-level vocabulary with no byte's token (empty, or not byte-level) encodes no text:
     * every request was refused as if the client's prompt were at fault */
    int bytes = 0;
    for (int b = 0; b < 256; b++) {
        t->byte_id[b] = sh_find(t, pd_tok_bl_str[b], pd_tok_bl_len[b]);
        bytes += t->byte_id[b] >= 0;
    }
    if (!bytes)
        return ferr(e, PD_EFORMAT, label, "model.vocab",
                    "no byte has a token of its own (a byte-level BPE vocabulary holds the 256 of them): it "
                    "encodes no text");
    return find_bos_eos(t, root, label, e);
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
    pd_tok_steps_free(t->steps, t->n_steps);
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

int pd_tok_check_vocab(const struct pd_tok *t, int64_t vocab, const char *path, pd_err *e)
{
    if (t->n_ids <= vocab)
        return 0;
    return pd_err_set(e, PD_EINVAL, "%s: token ids go up to %d, but the model's vocabulary (config.json vocab_size) "
                      "has %lld rows: ids from %lld on have no embedding or output row (the tokenizer of another "
                      "model?)", path, t->n_ids - 1, (long long)vocab, (long long)vocab);
}

int pd_tok_check_special(const struct pd_tok *t, int bos, int eos, const char *path, pd_err *e)
{
    const struct {
        const char *what, *field;
        int tok, cfg;
    } k[2] = {{"end", "eos_token_id", t->eos, eos}, {"begin", "bos_token_id", t->bos, bos}};
    for (int i = 0; i < 2; i++)
        if (k[i].tok >= 0 && k[i].cfg >= 0 && k[i].tok != k[i].cfg)
            return pd_err_set(e, PD_EINVAL, "%s: the %s-of-sentence token is id %d, but config.json's %s is %d: "
                              "the tokenizer and the config are not one model's", path, k[i].what, k[i].tok,
                              k[i].field, k[i].cfg);
    return 0;
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
    int rc = pd_tok_pretokenize(&w, &st, 1, (const uint8_t *)text, len, label, e);
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
    pd_tok_work_free(&w);
    pd_rx_free(st.rx);
    return rc;
}


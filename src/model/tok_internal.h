/* What the tokenizer's files share (tokenizer.c: the tokenizer.json reader and lookups; tok_pretok.c:
 * the byte map and the pre-tokenizer pipeline; tok_bpe.c: encoding; tok_train.c: the trainer); not a
 * public API: tokenizer.h is the contract. */
#ifndef PD_MODEL_TOK_INTERNAL_H
#define PD_MODEL_TOK_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "core/grow.h"
#include "core/hash.h"
#include "model/regex.h"
#include "model/tokenizer.h"

/* ---------------------------------------------------------------------------------------------
 * Growable buffers and hashes
 * ------------------------------------------------------------------------------------------- */

struct sbuf {
    char *p;
    size_t n, cap;
};

static inline int sb_add(struct sbuf *b, const void *s, size_t n)
{
    if (PD_GROW(b->p, b->cap, b->n + n + 1))
        return PD_ENOMEM;
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

static inline uint64_t hash_bytes(const void *p, size_t n)
{
    uint64_t h = pd_fnv1a64(PD_FNV64_INIT, p, n);
    return h ^ (h >> 29);
}

static inline uint64_t hash_u64(uint64_t x)
{
    return pd_mix64(x);
}

static inline size_t pow2_at_least(size_t n)
{
    size_t c = 16;
    while (c < n)
        c *= 2;
    return c;
}

/* ---------------------------------------------------------------------------------------------
 * The GPT-2 byte map (tok_pretok.c)
 * ------------------------------------------------------------------------------------------- */

/* Byte-level spelling of each byte, as UTF-8 (1 or 2 bytes); valid after pd_tok_bl_init(). */
extern char pd_tok_bl_str[256][2];
extern uint8_t pd_tok_bl_len[256];
void pd_tok_bl_init(void);
/* Byte-level string -> bytes. Returns the byte count, or -1 if a character is not one of the
 * 256 stand-ins (the caller then keeps the string's own UTF-8, as HF's decoder does). */
ptrdiff_t pd_tok_bl_decode(const char *s, size_t n, char *out);

/* ---------------------------------------------------------------------------------------------
 * The pre-tokenizer pipeline (tok_pretok.c)
 * ------------------------------------------------------------------------------------------- */

/* What ByteLevel's use_regex applies, and what pd_tok_train writes into its files. */
extern const char pd_tok_gpt2_pattern[];
extern const char pd_tok_train_pattern[];

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

void pd_tok_work_free(struct work *w);
/* Runs the steps over s[0..len): afterwards w->p[0..np) are the pieces, as code point ranges
 * over w->cp/w->off of w->s (which is s, or a rebuilt copy). Errors: PD_ENOMEM with e set to
 * "label: out of memory", or a Split regex's error. */
int pd_tok_pretokenize(struct work *w, const struct pstep *steps, int n_steps, const uint8_t *s,
                       size_t len, const char *label, pd_err *e);
void pd_tok_steps_free(struct pstep *st, int n);

/* ---------------------------------------------------------------------------------------------
 * The tokenizer (tokenizer.c)
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

static inline int32_t sh_find(const struct pd_tok *t, const char *s, size_t n)
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

static inline const struct mslot *mh_find(const struct pd_tok *t, int32_t a, int32_t b)
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

static inline int arena_add(struct sbuf *b, const void *s, size_t n, uint32_t *off)
{
    if (b->n + n >= UINT32_MAX)
        return PD_ERANGE;
    *off = (uint32_t)b->n;
    return sb_add(b, s, n);
}

#endif

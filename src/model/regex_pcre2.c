/* The regex tree as a PCRE2 pattern, and matching with it (rx_internal.h). */
#include "model/rx_internal.h"
#include "core/grow.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/unicode.h"

/* ---------------------------------------------------------------------------------------------
 * The tree as a PCRE2 pattern. Matching runs on code points (32-bit code units without UTF, so
 * the invalid-byte code points above U+10FFFF are characters too), with PCRE2_UCP. Everything is
 * written out explicitly: literals as \x{..}, every group as (?:..), every class from
 * unicode.h's tables (em_props), line anchors as lookarounds, so no PCRE2 option, default or
 * Unicode version changes what a pattern means.
 * ------------------------------------------------------------------------------------------- */

/* A find gives up past RX_MATCH_LIMIT + RX_STEPS_PER_CHAR backtracking steps per character
 * searched, or past this nesting depth in the interpreter (the JIT is bounded by its 32 KiB
 * stack instead). Tokenizer patterns backtrack at most a few steps per character (\s*[\r\n]+
 * gives back a whole run of spaces once), so long texts stay within; catastrophic patterns hit
 * the limit within ~0.1 s. */
#define RX_MATCH_LIMIT 10000000u
#define RX_STEPS_PER_CHAR 16u
#define RX_DEPTH_LIMIT 10000u
/* PCRE2 caps a counted repeat at this many; longer repeats of a set are written as several. */
#define RX_PCRE2_MAX_REPEAT 65535

struct emit {
    uint32_t *s;
    size_t n, cap;
    int oom;
    int base;   /* PCRE2's tables are unicode.h's base version (pcre2_tables_are_base) */
};

static void em_str(struct emit *m, const char *t)
{
    size_t l = strlen(t);
    if (PD_GROW(m->s, m->cap, m->n + l + 1)) {
        m->oom = 1;
        return;
    }
    for (size_t i = 0; i < l; i++)
        m->s[m->n++] = (unsigned char)t[i];
}

static void em_cp(struct emit *m, uint32_t cp)
{
    char b[24];
    snprintf(b, sizeof b, "\\x{%x}", cp);
    em_str(m, b);
}

/* The code points whose unicode.h bits meet mask (none of them if neg), as class ranges: the
 * classes are unicode.h's (Unicode 16.0.0), not PCRE2's own tables (Debian 12's are Unicode
 * 14). The invalid-byte code points have no bits. */
static void em_feat(struct emit *m, uint16_t mask, int neg)
{
    uint32_t start, next;
    uint16_t f, nf;
    for (size_t i = 0; pd_uc_run(i, &start, &f); i++) {
        if (((f & mask) != 0) == neg)
            continue;
        /* merge the following runs that are in too */
        while (pd_uc_run(i + 1, &next, &nf) && ((nf & mask) != 0) != neg)
            i++;
        uint32_t end = pd_uc_run(i + 1, &next, &nf) ? next - 1 : 0x10FFFF;
        em_cp(m, start);
        if (end != start) {
            em_str(m, "-");
            em_cp(m, end);
        }
    }
    if (neg) {
        em_cp(m, PD_UC_BADCP);
        em_str(m, "-");
        em_cp(m, PD_UC_BADCP + 255);
    }
}

/* PCRE2's Unicode tables are unicode.h's base version (PCRE2 10.42's, Debian 12's, are 14.0.0):
 * then a class is written as PCRE2's \p{..} plus the code points that joined it since, which
 * PCRE2 matches by table lookup plus a few dozen ranges rather than scanning ~700 ranges. */
static int pcre2_tables_are_base(void)
{
    PCRE2_UCHAR v[32];   /* 32-bit code units */
    if (pcre2_config(PCRE2_CONFIG_UNICODE_VERSION, v) <= 0)
        return 0;
    const char *b = pd_uc_gain_base();
    size_t i = 0;
    for (; b[i] && i < 31; i++)
        if (v[i] != (PCRE2_UCHAR)(unsigned char)b[i])
            return 0;
    return v[i] == 0;
}

static int rx_explicit_classes;

void pd_rx_set_explicit_classes(int on)
{
    rx_explicit_classes = on;
}

/* The code points of the plain (not negated) properties mask, for a class. */
static void em_props(struct emit *m, uint16_t mask, int base)
{
    static const struct { uint16_t feat; const char *pcre2; } props[] = {
        {PD_UC_L, "\\p{L}"}, {PD_UC_LU, "\\p{Lu}"}, {PD_UC_LL, "\\p{Ll}"}, {PD_UC_M, "\\p{M}"},
        {PD_UC_N, "\\p{N}"}, {PD_UC_P, "\\p{P}"}, {PD_UC_S, "\\p{S}"}, {PD_UC_Z, "\\p{Z}"},
        {PD_UC_WORD, "\\p{L}\\p{M}\\p{N}\\p{Pc}"},
    };
    if (!base) {
        em_feat(m, mask, 0);
        return;
    }
    uint16_t own = 0;   /* the bits PCRE2's \p{..} stand for */
    for (size_t k = 0; k < sizeof props / sizeof *props; k++) {
        if (mask & props[k].feat) {
            em_str(m, props[k].pcre2);
            own |= props[k].feat;
        }
    }
    uint32_t lo, hi;
    uint16_t bits;
    for (size_t i = 0; pd_uc_gain(i, &lo, &hi, &bits); i++) {
        if (!(bits & own))
            continue;
        em_cp(m, lo);
        if (hi != lo) {
            em_str(m, "-");
            em_cp(m, hi);
        }
    }
    if (mask & ~own)   /* \s and \p{C}: written out */
        em_feat(m, mask & ~own, 0);
}

/* One set as a single-character PCRE2 class: its literal ranges, the code points of its plain
 * properties and of each negated one. */
static void em_set(struct emit *m, const struct rx_set *st)
{
    if (st->icase)
        em_str(m, "(?i:");
    em_str(m, st->neg ? "[^" : "[");
    uint16_t mask = 0;
    for (int i = 0; i < st->n; i++) {
        const struct rx_item *it = &st->it[i];
        if (!it->feat) {
            em_cp(m, it->lo);
            if (it->hi != it->lo) {
                em_str(m, "-");
                em_cp(m, it->hi);
            }
        } else if (it->neg) {
            em_feat(m, it->feat, 1);
        } else {
            mask |= it->feat;
        }
    }
    if (mask)
        em_props(m, mask, m->base);
    em_str(m, "]");
    if (st->icase)
        em_str(m, ")");
}

static void em_count(struct emit *m, int min, int max)
{
    char b[48];
    if (min == 0 && max < 0)
        snprintf(b, sizeof b, "*");
    else if (min == 1 && max < 0)
        snprintf(b, sizeof b, "+");
    else if (max < 0)
        snprintf(b, sizeof b, "{%d,}", min);
    else if (min == max)
        snprintf(b, sizeof b, "{%d}", min);
    else
        snprintf(b, sizeof b, "{%d,%d}", min, max);
    em_str(m, b);
}

static void em_node(struct emit *m, const struct pd_rx *rx, int n)
{
    const struct rx_node *nd = &rx->nodes[n];
    switch (nd->op) {
    case RX_SET:
        em_set(m, &rx->sets[nd->set]);
        break;
    case RX_REPSET: {
        /* a run of one set splits into consecutive greedy runs without changing what it
         * matches or which match is preferred */
        const struct rx_set *st = &rx->sets[nd->set];
        int min = nd->min, max = nd->max, cap = RX_PCRE2_MAX_REPEAT;
        while (min > cap) {
            em_set(m, st);
            em_count(m, cap, cap);
            min -= cap;
            if (max >= 0)
                max -= cap;
        }
        while (max > cap) {
            em_set(m, st);
            em_count(m, min, cap);
            max -= cap;
            min = 0;
        }
        em_set(m, st);
        em_count(m, min, max);
        break;
    }
    case RX_SEQ:
        em_str(m, "(?:");
        for (int j = 0; j < nd->nkid; j++)
            em_node(m, rx, nd->kid[j]);
        em_str(m, ")");
        break;
    case RX_ALT:
        em_str(m, "(?:");
        for (int j = 0; j < nd->nkid; j++) {
            if (j)
                em_str(m, "|");
            em_node(m, rx, nd->kid[j]);
        }
        em_str(m, ")");
        break;
    case RX_REP:
        em_str(m, "(?:");
        em_node(m, rx, nd->kid[0]);
        em_str(m, ")");
        em_count(m, nd->min, nd->max);
        break;
    case RX_LOOK:
        em_str(m, nd->neg ? "(?!" : "(?=");
        em_node(m, rx, nd->kid[0]);
        em_str(m, ")");
        break;
    default:
        em_str(m, nd->as == AS_BOL   ? "(?<![^\\x{a}])"
                  : nd->as == AS_EOL ? "(?![^\\x{a}])"
                  : nd->as == AS_BOS ? "\\A"
                  : nd->as == AS_EOS ? "\\z"
                                     : "(?=\\x{a}?\\z)");
        break;
    }
}

int pd_rx_to_pcre2(struct pd_rx *rx, const char *pat, size_t len, const char *label, const char *field, pd_err *e)
{
    struct emit m = {.base = !rx_explicit_classes && pcre2_tables_are_base()};
    em_node(&m, rx, rx->root);
    rx->label = strdup(label);
    rx->field = strdup(field);
    rx->pattern = malloc(RX_SHOWN);
    if (m.oom || !rx->label || !rx->field || !rx->pattern) {
        free(m.s);
        return pd_err_set(e, PD_ENOMEM, "%s: field \"%s\": out of memory compiling regex", label,
                          field);
    }
    pd_rx_show(pat, len, rx->pattern);
    int code;
    PCRE2_SIZE at;
    rx->re = pcre2_compile((PCRE2_SPTR)m.s, m.n, PCRE2_UCP, &code, &at, NULL);
    free(m.s);
    if (!rx->re) {
        PCRE2_UCHAR msg[160];
        char ascii[160];
        int k = pcre2_get_error_message(code, msg, 160);
        for (int i = 0; i < k && i < 159; i++)
            ascii[i] = (char)msg[i];
        ascii[k > 0 ? (k < 159 ? k : 159) : 0] = 0;
        return pd_err_set(e, PD_EFORMAT, "%s: field \"%s\": regex /%s/ is not accepted by PCRE2: "
                          "%s", label, field, rx->pattern, ascii);
    }
    rx->jit = pcre2_jit_compile(rx->re, PCRE2_JIT_COMPLETE) == 0;
    return 0;
}

struct pd_rx_scratch {
    pcre2_match_data *md;
    pcre2_match_context *mctx;   /* the limits, the match limit set for each find */
};

void pd_rx_scratch_free(struct pd_rx_scratch *s)
{
    if (!s)
        return;
    pcre2_match_data_free(s->md);
    pcre2_match_context_free(s->mctx);
    free(s);
}

int pd_rx_find(const struct pd_rx *rx, struct pd_rx_scratch **scratch, const uint32_t *cp,
               size_t beg, size_t end, size_t from, size_t *ms, size_t *me, pd_err *e)
{
    if (from >= end)
        return 0;
    struct pd_rx_scratch *s = *scratch;
    if (!s) {
        s = calloc(1, sizeof *s);
        if (s) {
            s->md = pcre2_match_data_create(1, NULL);
            s->mctx = pcre2_match_context_create(NULL);
        }
        if (!s || !s->md || !s->mctx) {
            pd_rx_scratch_free(s);
            return pd_err_set(e, PD_ENOMEM, "%s: field \"%s\": out of memory matching regex",
                              rx->label, rx->field);
        }
        pcre2_set_depth_limit(s->mctx, RX_DEPTH_LIMIT);
        *scratch = s;
    }
    size_t steps = RX_MATCH_LIMIT + RX_STEPS_PER_CHAR * (end - from);
    uint32_t limit = steps > UINT32_MAX ? UINT32_MAX : (uint32_t)steps;
    pcre2_set_match_limit(s->mctx, limit);
    int rc = rx->jit ? pcre2_jit_match(rx->re, cp + beg, end - beg, from - beg, 0, s->md,
                                       s->mctx)
                     : pcre2_match(rx->re, cp + beg, end - beg, from - beg, 0, s->md, s->mctx);
    if (rc == PCRE2_ERROR_NOMATCH)
        return 0;
    if (rc < 0) {
        const char *what;
        char lim[64];
        switch (rc) {
        case PCRE2_ERROR_MATCHLIMIT:
            what = "match limit";
            snprintf(lim, sizeof lim, "%u backtracking steps", limit);
            break;
        case PCRE2_ERROR_DEPTHLIMIT:
            what = "depth limit";
            snprintf(lim, sizeof lim, "%u nested backtracking points", RX_DEPTH_LIMIT);
            break;
        case PCRE2_ERROR_JIT_STACKLIMIT:
            what = "JIT stack limit";
            snprintf(lim, sizeof lim, "32 KiB");
            break;
        case PCRE2_ERROR_NOMEMORY:
        case PCRE2_ERROR_HEAPLIMIT:
            what = "heap limit";
            snprintf(lim, sizeof lim, "PCRE2's default");
            break;
        default:
            what = "error";
            snprintf(lim, sizeof lim, "PCRE2 code %d", rc);
            break;
        }
        return pd_err_set(e, PD_EINVAL, "%s: field \"%s\": the regex hit its %s (%s) on a "
                          "%zu-character piece of the text, backtracking catastrophically on "
                          "it: /%s/", rx->label, rx->field, what, lim, end - beg, rx->pattern);
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(s->md);
    if (beg + ov[0] >= end)
        return 0;   /* an empty match at the end, where the reference never looks */
    *ms = beg + ov[0];
    *me = beg + ov[1];
    return 1;
}


/* Regex matcher for the tokenizer's Split patterns: parses a pattern into a node tree (which
 * defines the syntax and its errors, regex.h), writes the tree out as a PCRE2 pattern over code
 * points and matches with PCRE2's JIT under match and depth limits. The tree also drives a
 * backtracking reference matcher (pd_rx_find_ref) that tests and the benchmark compare with. */
#include "model/regex.h"
#include "core/grow.h"

#define PCRE2_CODE_UNIT_WIDTH 32
#include <pcre2.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/unicode.h"


enum { RX_SET, RX_SEQ, RX_ALT, RX_REPSET, RX_REP, RX_LOOK, RX_ASSERT };
enum { AS_BOL, AS_EOL, AS_BOS, AS_EOS, AS_EOSNL };

/* The matcher recurses once per group iteration and per non-trivial sequence element, so
 * patterns are bounded where they are compiled: group nesting, and the worst-case depth
 * (rx_weight) of a match. Tokenizer patterns use a few dozen. */
#define RX_MAX_NESTING 32
#define RX_MAX_WEIGHT 1000

struct rx_item {
    uint32_t lo, hi;     /* a range of code points when feat == 0 */
    uint16_t feat;       /* otherwise a property: any of these U_* bits */
    uint8_t neg;         /* the property negated (\S, \P{L}) */
};

struct rx_set {
    struct rx_item *it;
    int n;
    uint8_t neg, icase;
    uint32_t ascii[4];   /* membership of U+0000..U+007F, precomputed */
};

struct rx_node {
    uint8_t op, neg, as;
    int min, max;        /* RX_REP/RX_REPSET; max < 0: unbounded */
    int set;             /* RX_SET/RX_REPSET */
    int *kid, nkid;      /* RX_SEQ/RX_ALT: children; RX_REP/RX_LOOK: kid[0] */
};

struct pd_rx {
    struct rx_node *nodes;
    size_t nn, ncap;
    struct rx_set *sets;
    size_t ns, scap;
    int root;
    pcre2_code *re;              /* the tree as a PCRE2 pattern (32-bit code units, no UTF) */
    int jit;                     /* re is JIT-compiled */
    char *label, *field;         /* named in a match error */
    char *pattern;               /* the source (truncated), named in a match error */
};

void pd_rx_free(struct pd_rx *rx)
{
    if (!rx)
        return;
    for (size_t i = 0; i < rx->nn; i++)
        free(rx->nodes[i].kid);
    for (size_t i = 0; i < rx->ns; i++)
        free(rx->sets[i].it);
    free(rx->nodes);
    free(rx->sets);
    pcre2_code_free(rx->re);
    free(rx->label);
    free(rx->field);
    free(rx->pattern);
    free(rx);
}

static int items_have(const struct rx_set *s, uint32_t cp)
{
    uint16_t f = 0;
    int have_f = 0;
    for (int i = 0; i < s->n; i++) {
        const struct rx_item *it = &s->it[i];
        if (it->feat) {
            if (!have_f) {
                f = pd_uc_feat(cp);
                have_f = 1;
            }
            if (((f & it->feat) != 0) != it->neg)
                return 1;
        } else if (cp >= it->lo && cp <= it->hi) {
            return 1;
        }
    }
    return 0;
}

static int set_has_slow(const struct rx_set *s, uint32_t cp)
{
    int in = items_have(s, cp);
    if (!in && s->icase && cp < PD_UC_BADCP) {
        /* simple case folding: the lower, upper and lower-of-upper forms (ſ -> S -> s) */
        uint32_t lo = pd_uc_lower(cp), up = pd_uc_upper(cp), lu = pd_uc_lower(up);
        in = (lo != cp && items_have(s, lo)) || (up != cp && items_have(s, up)) ||
             (lu != cp && lu != lo && items_have(s, lu));
    }
    return in != s->neg;
}

static inline int set_has(const struct rx_set *s, uint32_t cp)
{
    if (cp < 128)
        return (s->ascii[cp >> 5] >> (cp & 31)) & 1;
    return set_has_slow(s, cp);
}

struct rxp {
    struct pd_rx *rx;
    const char *s;
    size_t n, i;
    int icase;
    const char *label, *field;
    pd_err *e;
    int rc;
    int nesting;
};

/* The pattern as errors show it: at most 200 bytes of it, control characters as \xHH so that
 * the message stays one line (DeepSeek-V3's patterns hold a literal CR and LF), "..." if cut.
 * out has RX_SHOWN bytes. */
#define RX_SHOWN 208

static void rx_show(const char *s, size_t n, char *out)
{
    size_t k = 0, i = 0;
    for (; i < n && k + 4 <= 200; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c == 0x7F)
            k += (size_t)snprintf(out + k, RX_SHOWN - k, "\\x%02X", c);
        else
            out[k++] = (char)c;
    }
    snprintf(out + k, RX_SHOWN - k, "%s", i < n ? "..." : "");
}

static int rxp_fail(struct rxp *p, size_t at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int rxp_fail(struct rxp *p, size_t at, const char *fmt, ...)
{
    if (p->rc)
        return -1;
    char what[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    char shown[RX_SHOWN], what_shown[RX_SHOWN];
    rx_show(p->s, p->n, shown);
    rx_show(what, strlen(what), what_shown);
    p->rc = pd_err_set(p->e, PD_EFORMAT, "%s: field \"%s\": %s at offset %zu of regex /%s/",
                       p->label, p->field, what_shown, at, shown);
    return -1;
}

static int rxp_oom(struct rxp *p)
{
    if (!p->rc)
        p->rc = pd_err_set(p->e, PD_ENOMEM, "%s: field \"%s\": out of memory compiling regex",
                           p->label, p->field);
    return -1;
}

static int rx_new_node(struct rxp *p, int op)
{
    struct pd_rx *rx = p->rx;
    if (PD_GROW(rx->nodes, rx->ncap, rx->nn + 1))
        return rxp_oom(p);
    memset(&rx->nodes[rx->nn], 0, sizeof rx->nodes[0]);
    rx->nodes[rx->nn].op = (uint8_t)op;
    rx->nodes[rx->nn].set = -1;
    return (int)rx->nn++;
}

static int rx_add_kid(struct rxp *p, int node, int kid)
{
    struct rx_node *nd = &p->rx->nodes[node];
    int *k = realloc(nd->kid, (size_t)(nd->nkid + 1) * sizeof *k);
    if (!k)
        return rxp_oom(p);
    k[nd->nkid++] = kid;
    nd->kid = k;
    return 0;
}

/* A set node from items (taken over: freed on failure). */
static int rx_set_node(struct rxp *p, struct rx_item *it, int n, int neg)
{
    struct pd_rx *rx = p->rx;
    if (PD_GROW(rx->sets, rx->scap, rx->ns + 1)) {
        free(it);
        return rxp_oom(p);
    }
    struct rx_set *s = &rx->sets[rx->ns];
    memset(s, 0, sizeof *s);
    s->it = it;
    s->n = n;
    s->neg = (uint8_t)neg;
    s->icase = (uint8_t)p->icase;
    for (uint32_t cp = 0; cp < 128; cp++) {
        if (set_has_slow(s, cp))
            s->ascii[cp >> 5] |= 1u << (cp & 31);
    }
    int si = (int)rx->ns++;
    int node = rx_new_node(p, RX_SET);
    if (node < 0)
        return -1;
    rx->nodes[node].set = si;
    return node;
}

static int rx_single(struct rxp *p, struct rx_item item, int neg)
{
    struct rx_item *it = malloc(sizeof *it);
    if (!it)
        return rxp_oom(p);
    *it = item;
    return rx_set_node(p, it, 1, neg);
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static int prop_feat(const char *name, size_t n)
{
    static const struct { const char *name; int feat; } props[] = {
        {"L", PD_UC_L}, {"Letter", PD_UC_L}, {"Lu", PD_UC_LU}, {"Uppercase_Letter", PD_UC_LU},
        {"Ll", PD_UC_LL}, {"Lowercase_Letter", PD_UC_LL}, {"M", PD_UC_M}, {"Mark", PD_UC_M},
        {"Combining_Mark", PD_UC_M}, {"N", PD_UC_N}, {"Number", PD_UC_N}, {"P", PD_UC_P},
        {"Punctuation", PD_UC_P}, {"S", PD_UC_S}, {"Symbol", PD_UC_S}, {"Z", PD_UC_Z},
        {"Separator", PD_UC_Z}, {"C", PD_UC_C}, {"Other", PD_UC_C},
    };
    for (size_t i = 0; i < sizeof props / sizeof *props; i++) {
        if (strlen(props[i].name) == n && !memcmp(props[i].name, name, n))
            return props[i].feat;
    }
    return 0;
}

enum { ESC_LIT, ESC_PROP, ESC_ASSERT };

/* Parses the escape after a backslash (p->i is just past it) into a literal code point, a
 * property item, or (outside classes) an assertion. */
static int rxp_escape(struct rxp *p, int in_class, struct rx_item *it, int *as)
{
    size_t at = p->i - 1;
    if (p->i >= p->n)
        return rxp_fail(p, at, "trailing backslash");
    memset(it, 0, sizeof *it);
    char c = p->s[p->i];
    uint32_t cp;
    if ((unsigned char)c >= 0x80) {
        p->i += pd_uc_utf8_dec((const uint8_t *)p->s + p->i, p->n - p->i, &cp);
        it->lo = it->hi = cp;
        return ESC_LIT;
    }
    p->i++;
    switch (c) {
    case 'n': cp = '\n'; break;
    case 'r': cp = '\r'; break;
    case 't': cp = '\t'; break;
    case 'f': cp = '\f'; break;
    case 'v': cp = '\v'; break;
    case 'e': cp = 0x1B; break;
    case 'a': cp = 0x07; break;
    case 's': case 'S': it->feat = PD_UC_SPACE; it->neg = c == 'S'; return ESC_PROP;
    case 'd': case 'D': it->feat = PD_UC_N; it->neg = c == 'D'; return ESC_PROP;
    case 'w': case 'W': it->feat = PD_UC_WORD; it->neg = c == 'W'; return ESC_PROP;
    case 'p': case 'P': {
        if (p->i >= p->n || p->s[p->i] != '{')
            return rxp_fail(p, at, "expected { after \\%c", c);
        size_t b = ++p->i;
        while (p->i < p->n && p->s[p->i] != '}')
            p->i++;
        if (p->i >= p->n)
            return rxp_fail(p, at, "unterminated \\%c{", c);
        int neg = c == 'P';
        if (p->s[b] == '^') {
            neg = !neg;
            b++;
        }
        int f = prop_feat(p->s + b, p->i - b);
        if (!f)
            return rxp_fail(p, at, "unsupported regex construct \"%.*s\" (supported: L Lu Ll "
                            "M N P S Z C)", (int)(p->i + 1 - at), p->s + at);
        p->i++;
        it->feat = (uint16_t)f;
        it->neg = (uint8_t)neg;
        return ESC_PROP;
    }
    case 'x': {
        cp = 0;
        if (p->i < p->n && p->s[p->i] == '{') {
            size_t b = ++p->i;
            while (p->i < p->n && hexval(p->s[p->i]) >= 0 && p->i - b < 8)
                cp = cp * 16 + (uint32_t)hexval(p->s[p->i++]);
            if (p->i == b || p->i >= p->n || p->s[p->i] != '}' || cp > 0x10FFFF)
                return rxp_fail(p, at, "bad \\x{...} escape");
            p->i++;
        } else {
            int k = 0;
            while (k < 2 && p->i < p->n && hexval(p->s[p->i]) >= 0) {
                cp = cp * 16 + (uint32_t)hexval(p->s[p->i++]);
                k++;
            }
            if (!k)
                return rxp_fail(p, at, "bad \\x escape");
        }
        break;
    }
    case 'u': {
        cp = 0;
        for (int k = 0; k < 4; k++) {
            if (p->i >= p->n || hexval(p->s[p->i]) < 0)
                return rxp_fail(p, at, "bad \\u escape (expected 4 hex digits)");
            cp = cp * 16 + (uint32_t)hexval(p->s[p->i++]);
        }
        break;
    }
    case 'A': case 'z': case 'Z':
        if (in_class)
            return rxp_fail(p, at, "unsupported regex construct \"\\%c\" inside a class", c);
        *as = c == 'A' ? AS_BOS : c == 'z' ? AS_EOS : AS_EOSNL;
        return ESC_ASSERT;
    default:
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))
            return rxp_fail(p, at, "unsupported regex construct \"\\%c\"", c);
        cp = (unsigned char)c;   /* an escaped punctuation character or space stands for itself */
        break;
    }
    it->lo = it->hi = cp;
    return ESC_LIT;
}

/* One class item's literal code point (for a range's ends). */
static int rxp_class_char(struct rxp *p, uint32_t *cp, int *is_prop, struct rx_item *it)
{
    *is_prop = 0;
    if (p->s[p->i] == '\\') {
        p->i++;
        int as;
        int k = rxp_escape(p, 1, it, &as);
        if (k < 0)
            return -1;
        if (k == ESC_PROP) {
            *is_prop = 1;
            return 0;
        }
        *cp = it->lo;
        return 0;
    }
    p->i += pd_uc_utf8_dec((const uint8_t *)p->s + p->i, p->n - p->i, cp);
    return 0;
}

static int rxp_class(struct rxp *p)
{
    size_t at = p->i - 1;    /* the '[' */
    int neg = 0;
    if (p->i < p->n && p->s[p->i] == '^') {
        neg = 1;
        p->i++;
    }
    struct rx_item *it = NULL;
    size_t n = 0, cap = 0;
    int first = 1;
    for (;;) {
        if (p->i >= p->n) {
            free(it);
            return rxp_fail(p, at, "unterminated character class");
        }
        char c = p->s[p->i];
        if (c == ']' && !first) {
            p->i++;
            break;
        }
        first = 0;
        if (c == '[' || (c == '&' && p->i + 1 < p->n && p->s[p->i + 1] == '&')) {
            free(it);
            return rxp_fail(p, p->i, "unsupported regex construct \"%.*s\" (nested class, "
                            "POSIX bracket or intersection)", p->i + 1 < p->n ? 2 : 1,
                            p->s + p->i);
        }
        struct rx_item item;
        uint32_t lo;
        int is_prop;
        if (rxp_class_char(p, &lo, &is_prop, &item) < 0) {
            free(it);
            return -1;
        }
        if (!is_prop) {
            item.feat = 0;
            item.neg = 0;
            item.lo = item.hi = lo;
            if (p->i + 1 < p->n && p->s[p->i] == '-' && p->s[p->i + 1] != ']') {
                size_t rat = p->i;
                p->i++;
                uint32_t hi;
                struct rx_item tmp;
                if (rxp_class_char(p, &hi, &is_prop, &tmp) < 0) {
                    free(it);
                    return -1;
                }
                if (is_prop || hi < lo) {
                    free(it);
                    return rxp_fail(p, rat, "bad range in character class");
                }
                item.hi = hi;
            }
        }
        if (PD_GROW(it, cap, n + 1)) {
            free(it);
            return rxp_oom(p);
        }
        it[n++] = item;
    }
    return rx_set_node(p, it, (int)n, neg);
}

static int rxp_alt(struct rxp *p);

static int rxp_group(struct rxp *p)
{
    size_t at = p->i - 1;    /* the '(' */
    int save = p->icase, look = -1;
    if (p->i < p->n && p->s[p->i] == '?') {
        const char *g = p->s + p->i + 1;
        size_t left = p->n - p->i - 1;
        if (left >= 1 && g[0] == ':') {
            p->i += 2;
        } else if (left >= 2 && g[0] == 'i' && g[1] == ':') {
            p->icase = 1;
            p->i += 3;
        } else if (left >= 3 && g[0] == '-' && g[1] == 'i' && g[2] == ':') {
            p->icase = 0;
            p->i += 4;
        } else if (left >= 1 && (g[0] == '=' || g[0] == '!')) {
            look = g[0] == '!';
            p->i += 2;
        } else {
            size_t k = 2;
            while (k < 6 && p->i + k < p->n && p->s[p->i + k] != ')' && p->s[p->i + k] != ':')
                k++;
            return rxp_fail(p, at, "unsupported regex construct \"(%.*s\"", (int)k, p->s + p->i);
        }
    }
    if (++p->nesting > RX_MAX_NESTING)
        return rxp_fail(p, at, "groups nested more than %d deep", RX_MAX_NESTING);
    int inner = rxp_alt(p);
    p->nesting--;
    p->icase = save;
    if (inner < 0)
        return -1;
    if (p->i >= p->n || p->s[p->i] != ')')
        return rxp_fail(p, at, "unbalanced parenthesis");
    p->i++;
    if (look < 0)
        return inner;
    int node = rx_new_node(p, RX_LOOK);
    if (node < 0 || rx_add_kid(p, node, inner) < 0)
        return -1;
    p->rx->nodes[node].neg = (uint8_t)look;
    return node;
}

static int rxp_atom(struct rxp *p)
{
    size_t at = p->i;
    char c = p->s[p->i++];
    struct rx_item it = {0};
    switch (c) {
    case '(':
        return rxp_group(p);
    case '[':
        return rxp_class(p);
    case '.':
        it.lo = it.hi = '\n';
        return rx_single(p, it, 1);
    case '^': case '$': {
        int node = rx_new_node(p, RX_ASSERT);
        if (node >= 0)
            p->rx->nodes[node].as = c == '^' ? AS_BOL : AS_EOL;
        return node;
    }
    case '*': case '+': case '?':
        return rxp_fail(p, at, "quantifier \"%c\" with nothing to repeat", c);
    case ')':
        return rxp_fail(p, at, "unbalanced parenthesis");
    case '\\': {
        int as = 0;
        int k = rxp_escape(p, 0, &it, &as);
        if (k < 0)
            return -1;
        if (k == ESC_ASSERT) {
            int node = rx_new_node(p, RX_ASSERT);
            if (node >= 0)
                p->rx->nodes[node].as = (uint8_t)as;
            return node;
        }
        if (k == ESC_PROP) {
            int neg = it.neg;
            it.neg = 0;
            return rx_single(p, it, neg);
        }
        return rx_single(p, it, 0);
    }
    default: {
        uint32_t cp;
        p->i = at + pd_uc_utf8_dec((const uint8_t *)p->s + at, p->n - at, &cp);
        it.lo = it.hi = cp;
        return rx_single(p, it, 0);
    }
    }
}

/* {m}, {m,}, {m,n} or {,n} at p->i; returns 1 and advances if it is one (Oniguruma reads any
 * other '{' as a literal). */
static int rxp_interval(struct rxp *p, int *min, int *max)
{
    size_t i = p->i + 1;
    long a = -1, b = -1;
    while (i < p->n && p->s[i] >= '0' && p->s[i] <= '9' && a < 100000)
        a = (a < 0 ? 0 : a * 10) + (p->s[i++] - '0');
    if (i < p->n && p->s[i] == '}') {
        if (a < 0)
            return 0;
        b = a;
    } else if (i < p->n && p->s[i] == ',') {
        i++;
        while (i < p->n && p->s[i] >= '0' && p->s[i] <= '9' && b < 100000)
            b = (b < 0 ? 0 : b * 10) + (p->s[i++] - '0');
        if (i >= p->n || p->s[i] != '}' || (a < 0 && b < 0))
            return 0;
        if (a < 0)
            a = 0;
    } else {
        return 0;
    }
    p->i = i + 1;
    *min = (int)a;
    *max = (int)b;
    return 1;
}

static int rxp_quant(struct rxp *p, int atom)
{
    if (p->i >= p->n)
        return atom;
    size_t at = p->i;
    int min, max;
    char c = p->s[p->i];
    if (c == '*') {
        min = 0, max = -1, p->i++;
    } else if (c == '+') {
        min = 1, max = -1, p->i++;
    } else if (c == '?') {
        min = 0, max = 1, p->i++;
    } else if (c == '{' && rxp_interval(p, &min, &max)) {
        if (max >= 0 && max < min)
            return rxp_fail(p, at, "bad interval {%d,%d}", min, max);
    } else {
        return atom;
    }
    if (p->i < p->n && (p->s[p->i] == '?' || p->s[p->i] == '+' || p->s[p->i] == '*' ||
                        p->s[p->i] == '{'))
        return rxp_fail(p, at, "unsupported regex construct \"%.*s\" (lazy, possessive or "
                        "stacked quantifier)", (int)(p->i + 1 - at), p->s + at);
    struct rx_node *a = &p->rx->nodes[atom];
    if (a->op == RX_ASSERT || a->op == RX_LOOK)
        return rxp_fail(p, at, "quantified assertion");
    if (a->op == RX_SET) {
        a->op = RX_REPSET;
        a->min = min;
        a->max = max;
        return atom;
    }
    if (max < 0)
        return rxp_fail(p, at, "unsupported regex construct \"%.*s\" (a group may only be "
                        "repeated a bounded number of times)", (int)(p->i - at), p->s + at);
    int node = rx_new_node(p, RX_REP);
    if (node < 0 || rx_add_kid(p, node, atom) < 0)
        return -1;
    p->rx->nodes[node].min = min;
    p->rx->nodes[node].max = max;
    return node;
}

static int rxp_seq(struct rxp *p)
{
    int node = rx_new_node(p, RX_SEQ);
    if (node < 0)
        return -1;
    while (p->i < p->n && p->s[p->i] != '|' && p->s[p->i] != ')') {
        int a = rxp_atom(p);
        if (a < 0)
            return -1;
        a = rxp_quant(p, a);
        if (a < 0 || rx_add_kid(p, node, a) < 0)
            return -1;
    }
    if (p->rx->nodes[node].nkid == 1)
        return p->rx->nodes[node].kid[0];
    return node;
}

static int rxp_alt(struct rxp *p)
{
    int first = rxp_seq(p);
    if (first < 0 || p->i >= p->n || p->s[p->i] != '|')
        return first;
    int node = rx_new_node(p, RX_ALT);
    if (node < 0 || rx_add_kid(p, node, first) < 0)
        return -1;
    while (p->i < p->n && p->s[p->i] == '|') {
        p->i++;
        int k = rxp_seq(p);
        if (k < 0 || rx_add_kid(p, node, k) < 0)
            return -1;
    }
    return node;
}

/* Worst-case recursion depth of a match: sequence elements other than single characters add up
 * (their continuations stay on the stack), alternatives take the deepest, a repeated group
 * multiplies. Saturates above RX_MAX_WEIGHT. */
static long rx_weight(const struct pd_rx *rx, int n)
{
    const struct rx_node *nd = &rx->nodes[n];
    long w = 1;
    switch (nd->op) {
    case RX_SEQ:
        w = 1;
        for (int j = 0; j < nd->nkid; j++) {
            if (rx->nodes[nd->kid[j]].op != RX_SET)
                w += rx_weight(rx, nd->kid[j]);
        }
        break;
    case RX_ALT:
        for (int j = 0; j < nd->nkid; j++) {
            long k = rx_weight(rx, nd->kid[j]);
            w = k > w ? k : w;
        }
        break;
    case RX_REP:
        w = 1 + (long)nd->max * rx_weight(rx, nd->kid[0]);
        break;
    case RX_LOOK:
        w = 1 + rx_weight(rx, nd->kid[0]);
        break;
    default:
        break;
    }
    return w > RX_MAX_WEIGHT ? RX_MAX_WEIGHT + 1 : w;
}

static int rx_to_pcre2(struct pd_rx *rx, const char *pat, size_t len, const char *label,
                       const char *field, pd_err *e);

struct pd_rx *pd_rx_compile(const char *pat, size_t len, const char *label, const char *field,
                             pd_err *e)
{
    struct rxp p = {.s = pat, .n = len, .label = label, .field = field, .e = e};
    p.rx = calloc(1, sizeof *p.rx);
    if (!p.rx) {
        pd_err_set(e, PD_ENOMEM, "%s: field \"%s\": out of memory", label, field);
        return NULL;
    }
    int root = rxp_alt(&p);
    if (root >= 0 && p.i < p.n)
        rxp_fail(&p, p.i, "unbalanced parenthesis");
    if (!p.rc && rx_weight(p.rx, root) > RX_MAX_WEIGHT)
        rxp_fail(&p, 0, "pattern too complex for the matcher (more than %d nested steps)",
                 RX_MAX_WEIGHT);
    if (p.rc) {
        pd_rx_free(p.rx);
        return NULL;
    }
    p.rx->root = root;
    if (rx_to_pcre2(p.rx, pat, len, label, field, e)) {
        pd_rx_free(p.rx);
        return NULL;
    }
    return p.rx;
}

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

static int rx_to_pcre2(struct pd_rx *rx, const char *pat, size_t len, const char *label,
                       const char *field, pd_err *e)
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
    rx_show(pat, len, rx->pattern);
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

/* ---------------------------------------------------------------------------------------------
 * The reference matcher: backtracking with explicit continuations over the tree.
 * ------------------------------------------------------------------------------------------- */

struct rx_ctx {
    const struct pd_rx *rx;
    const uint32_t *cp;
    size_t beg, end;
};

/* What is left to match after a node: the rest of a sequence (idx = next child) or of a group
 * repetition (idx = iterations done, start = where the current one began), then `up`. */
struct rx_k {
    const struct rx_k *up;
    int node, idx;
    size_t start;
};

static ptrdiff_t rx_node(const struct rx_ctx *c, int n, size_t i, const struct rx_k *k);

static ptrdiff_t rx_rep(const struct rx_ctx *c, int n, size_t i, int count,
                        const struct rx_k *up);

static ptrdiff_t rx_cont(const struct rx_ctx *c, size_t i, const struct rx_k *k)
{
    while (k) {
        const struct rx_node *nd = &c->rx->nodes[k->node];
        if (nd->op == RX_SEQ) {
            /* single characters cannot backtrack: match them in place, recurse for the rest */
            int idx = k->idx;
            while (idx < nd->nkid && c->rx->nodes[nd->kid[idx]].op == RX_SET) {
                const struct rx_node *kn = &c->rx->nodes[nd->kid[idx]];
                if (i >= c->end || !set_has(&c->rx->sets[kn->set], c->cp[i]))
                    return -1;
                i++;
                idx++;
            }
            if (idx == nd->nkid) {
                k = k->up;
                continue;
            }
            struct rx_k k2 = {k->up, k->node, idx + 1, 0};
            return rx_node(c, nd->kid[idx], i, &k2);
        }
        /* RX_REP: an iteration that matched nothing past the minimum would loop forever */
        if (i == k->start && k->idx > nd->min)
            return -1;
        return rx_rep(c, k->node, i, k->idx, k->up);
    }
    return (ptrdiff_t)i;
}

static ptrdiff_t rx_rep(const struct rx_ctx *c, int n, size_t i, int count,
                        const struct rx_k *up)
{
    const struct rx_node *nd = &c->rx->nodes[n];
    if (count < nd->max) {
        struct rx_k k2 = {up, n, count + 1, i};
        ptrdiff_t r = rx_node(c, nd->kid[0], i, &k2);
        if (r >= 0)
            return r;
    }
    return count >= nd->min ? rx_cont(c, i, up) : -1;
}

static int rx_assert(const struct rx_ctx *c, int as, size_t i)
{
    switch (as) {
    case AS_BOL: return i == c->beg || c->cp[i - 1] == '\n';
    case AS_EOL: return i == c->end || c->cp[i] == '\n';
    case AS_BOS: return i == c->beg;
    case AS_EOS: return i == c->end;
    default: return i == c->end || (i + 1 == c->end && c->cp[i] == '\n');
    }
}

static ptrdiff_t rx_node(const struct rx_ctx *c, int n, size_t i, const struct rx_k *k)
{
    const struct rx_node *nd = &c->rx->nodes[n];
    switch (nd->op) {
    case RX_SET:
        if (i < c->end && set_has(&c->rx->sets[nd->set], c->cp[i]))
            return rx_cont(c, i + 1, k);
        return -1;
    case RX_REPSET: {
        const struct rx_set *s = &c->rx->sets[nd->set];
        size_t lim = c->end - i;
        if (nd->max >= 0 && (size_t)nd->max < lim)
            lim = (size_t)nd->max;
        size_t cnt = 0;
        while (cnt < lim && set_has(s, c->cp[i + cnt]))
            cnt++;
        if (cnt < (size_t)nd->min)
            return -1;
        for (;;) {   /* greedy: the longest run first, then give back one at a time */
            ptrdiff_t r = rx_cont(c, i + cnt, k);
            if (r >= 0 || cnt == (size_t)nd->min)
                return r;
            cnt--;
        }
    }
    case RX_SEQ: {
        struct rx_k k2 = {k, n, 0, 0};
        return rx_cont(c, i, &k2);
    }
    case RX_ALT:
        for (int j = 0; j < nd->nkid; j++) {
            ptrdiff_t r = rx_node(c, nd->kid[j], i, k);
            if (r >= 0)
                return r;
        }
        return -1;
    case RX_REP:
        return rx_rep(c, n, i, 0, k);
    case RX_LOOK: {
        int hit = rx_node(c, nd->kid[0], i, NULL) >= 0;
        return hit != nd->neg ? rx_cont(c, i, k) : -1;
    }
    default:
        return rx_assert(c, nd->as, i) ? rx_cont(c, i, k) : -1;
    }
}

/* Leftmost match in cp[beg..end) starting at or after `from`. */
int pd_rx_find_ref(const struct pd_rx *rx, const uint32_t *cp, size_t beg, size_t end,
                   size_t from, size_t *ms, size_t *me)
{
    struct rx_ctx c = {rx, cp, beg, end};
    for (size_t s = from; s < end; s++) {
        ptrdiff_t r = rx_node(&c, rx->root, s, NULL);
        if (r >= 0) {
            *ms = s;
            *me = (size_t)r;
            return 1;
        }
    }
    return 0;
}

/* Regex matcher for the tokenizer's Split patterns: parses a pattern into a node tree (which
 * defines the syntax and its errors, regex.h), writes the tree out as a PCRE2 pattern over code
 * points and matches with PCRE2's JIT under match and depth limits (regex_pcre2.c). The tree also
 * drives a backtracking reference matcher (regex_ref.c) that tests and the benchmark compare with. */
#include "model/rx_internal.h"
#include "core/grow.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/unicode.h"


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

int pd_rx_set_has_slow(const struct rx_set *s, uint32_t cp)
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


void pd_rx_show(const char *s, size_t n, char *out)
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
    pd_rx_show(p->s, p->n, shown);
    pd_rx_show(what, strlen(what), what_shown);
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
        if (pd_rx_set_has_slow(s, cp))
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
    if (pd_rx_to_pcre2(p.rx, pat, len, label, field, e)) {
        pd_rx_free(p.rx);
        return NULL;
    }
    return p.rx;
}


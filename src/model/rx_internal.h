/* The regex matcher's parts (regex.h): the pattern tree they share.
 *   regex.c        the parser (the syntax and its errors), the tree, pd_rx_compile;
 *   regex_pcre2.c  the tree written out as a PCRE2 pattern, and pd_rx_find (PCRE2's JIT);
 *   regex_ref.c    the backtracking reference matcher over the tree (pd_rx_find_ref). */
#ifndef PD_MODEL_RX_INTERNAL_H
#define PD_MODEL_RX_INTERNAL_H

#include "model/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 32
#include <pcre2.h>
#include <stddef.h>
#include <stdint.h>

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

/* cp is in set s (slow path: properties, case folding). */
int pd_rx_set_has_slow(const struct rx_set *s, uint32_t cp);

static inline int pd_rx_set_has(const struct rx_set *s, uint32_t cp)
{
    if (cp < 128)
        return (s->ascii[cp >> 5] >> (cp & 31)) & 1;
    return pd_rx_set_has_slow(s, cp);
}

/* The pattern as errors show it: at most 200 bytes of it, control characters as \xHH so that
 * the message stays one line (DeepSeek-V3's patterns hold a literal CR and LF), "..." if cut.
 * out has RX_SHOWN bytes. */
#define RX_SHOWN 208
void pd_rx_show(const char *s, size_t n, char *out);

/* regex_pcre2.c: rx->re (and rx->label, field, pattern) from the parsed tree; 0 or an error. */
int pd_rx_to_pcre2(struct pd_rx *rx, const char *pat, size_t len, const char *label, const char *field, pd_err *e);

#endif

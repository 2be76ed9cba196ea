/* The regex tree's reference matcher (rx_internal.h), which tests and the benchmark compare
 * PCRE2's matches with. */
#include "model/rx_internal.h"

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
                if (i >= c->end || !pd_rx_set_has(&c->rx->sets[kn->set], c->cp[i]))
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
        if (i < c->end && pd_rx_set_has(&c->rx->sets[nd->set], c->cp[i]))
            return rx_cont(c, i + 1, k);
        return -1;
    case RX_REPSET: {
        const struct rx_set *s = &c->rx->sets[nd->set];
        size_t lim = c->end - i;
        if (nd->max >= 0 && (size_t)nd->max < lim)
            lim = (size_t)nd->max;
        size_t cnt = 0;
        while (cnt < lim && pd_rx_set_has(s, c->cp[i + cnt]))
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

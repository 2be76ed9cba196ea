/* Cache-aware routing (see route.h): per instance an open-addressing table of chained chunk
 * hashes, each with the logical time it was last routed there. */
#include "proxy/route.h"
#include "core/hash.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_MAX_BYTES ((size_t)16 << 20)

struct slot {
    uint64_t h;                    /* 0: empty (pd_route_key_make never makes 0) */
    uint64_t used;                 /* logical time of the last insert */
};

struct table {
    struct slot *s;
    size_t cap, n;                 /* cap a power of two, n <= cap / 2 */
};

struct pd_route {
    struct pd_route_opts o;
    int n;
    size_t max_chunks;
    uint64_t clock;
    struct table t[PD_ROUTE_MAX];
};

const char *pd_route_policy_name(enum pd_route_policy p)
{
    return p == PD_ROUTE_LEAST_LOADED ? "least_loaded" : "cache_aware";
}

const char *pd_route_why_name(enum pd_route_why w)
{
    static const char *names[PD_ROUTE_N_WHY] = {"least_loaded", "balance", "prefix", "room"};
    return w < PD_ROUTE_N_WHY ? names[w] : "?";
}

int pd_route_policy_parse(const char *s, enum pd_route_policy *p)
{
    if (!strcmp(s, "cache_aware"))
        *p = PD_ROUTE_CACHE_AWARE;
    else if (!strcmp(s, "least_loaded"))
        *p = PD_ROUTE_LEAST_LOADED;
    else
        return PD_EINVAL;
    return 0;
}

int pd_route_create(int n_instances, const struct pd_route_opts *o, struct pd_route **out, pd_err *e)
{
    *out = NULL;
    if (n_instances < 0 || n_instances > PD_ROUTE_MAX)
        return pd_err_set(e, PD_EINVAL, "routing: %d instances (at most %d)", n_instances, PD_ROUTE_MAX);
    if (o->cache_threshold < 0 || o->cache_threshold > 1)
        return pd_err_set(e, PD_EINVAL, "--cache-threshold %g: must be in [0, 1]", o->cache_threshold);
    if (o->balance_abs < 0)
        return pd_err_set(e, PD_EINVAL, "--balance-abs-threshold %d: must be >= 0", o->balance_abs);
    if (o->balance_rel < 1)
        return pd_err_set(e, PD_EINVAL, "--balance-rel-threshold %g: must be >= 1", o->balance_rel);
    struct pd_route *r = calloc(1, sizeof *r);
    if (!r)
        return pd_err_set(e, PD_ENOMEM, "routing: out of memory");
    r->o = *o;
    r->n = n_instances;
    size_t max = o->max_bytes ? o->max_bytes : DEFAULT_MAX_BYTES;
    r->max_chunks = max / PD_ROUTE_CHUNK ? max / PD_ROUTE_CHUNK : 1;
    *out = r;
    return 0;
}

void pd_route_free(struct pd_route *r)
{
    if (!r)
        return;
    for (int i = 0; i < r->n; i++)
        free(r->t[i].s);
    free(r);
}

/* h_i = fmix64(h_{i-1} * prime + FNV-1a(chunk i)), never 0. */
int pd_route_key_make(const void *prompt, size_t len, struct pd_route_key *k)
{
    k->n = len / PD_ROUTE_CHUNK;
    k->h = NULL;
    if (!k->n)
        return 0;
    if (!(k->h = malloc(k->n * sizeof *k->h))) {
        k->n = 0;
        return PD_ENOMEM;
    }
    const unsigned char *s = prompt;
    uint64_t prev = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < k->n; i++) {
        uint64_t f = pd_fnv1a64(PD_FNV64_INIT, s + i * PD_ROUTE_CHUNK, PD_ROUTE_CHUNK);
        prev = pd_mix64(prev * 0x100000001b3ull + f) | 1;
        k->h[i] = prev;
    }
    return 0;
}

void pd_route_key_free(struct pd_route_key *k)
{
    free(k->h);
    k->h = NULL;
    k->n = 0;
}

static struct slot *find(const struct table *t, uint64_t h)
{
    if (!t->cap)
        return NULL;
    for (size_t i = pd_mix64(h) & (t->cap - 1);; i = (i + 1) & (t->cap - 1)) {
        if (t->s[i].h == h || !t->s[i].h)
            return &t->s[i];
    }
}

static int put(struct table *t, uint64_t h, uint64_t used)
{
    if (2 * (t->n + 1) > t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 64;
        struct slot *s = calloc(cap, sizeof *s), *old = t->s;
        if (!s)
            return PD_ENOMEM;
        size_t oc = t->cap;
        *t = (struct table){.s = s, .cap = cap, .n = 0};
        for (size_t i = 0; i < oc; i++)
            if (old[i].h)
                *find(t, old[i].h) = old[i], t->n++;
        free(old);
    }
    struct slot *x = find(t, h);
    if (!x->h)
        t->n++;
    *x = (struct slot){h, used};
    return 0;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Keeps the most recently used entries, down to 3/4 of the limit: the chains of the oldest
 * requests go first (a chain's prefix is never older than its later chunks, so a prefix is not
 * dropped while a longer chain through it stays). */
static int evict(struct pd_route *r, struct table *t)
{
    size_t keep = r->max_chunks - r->max_chunks / 4;
    uint64_t *u = malloc(t->n * sizeof *u);
    if (!u)
        return PD_ENOMEM;
    size_t m = 0;
    for (size_t i = 0; i < t->cap; i++)
        if (t->s[i].h)
            u[m++] = t->s[i].used;
    assert(m == t->n);
    qsort(u, m, sizeof *u, cmp_u64);
    uint64_t cutoff = u[m - keep];     /* keep entries used at or after it */
    free(u);
    struct table nt = {0};
    for (size_t i = 0; i < t->cap; i++)
        if (t->s[i].h && t->s[i].used >= cutoff && put(&nt, t->s[i].h, t->s[i].used)) {
            free(nt.s);
            return PD_ENOMEM;
        }
    free(t->s);
    *t = nt;
    return 0;
}

int pd_route_insert(struct pd_route *r, int i, const struct pd_route_key *k)
{
    assert(i >= 0 && i < r->n);
    struct table *t = &r->t[i];
    uint64_t now = ++r->clock;
    size_t n = k->n < r->max_chunks ? k->n : r->max_chunks;   /* one huge prompt: its head */
    for (size_t c = 0; c < n; c++)
        if (put(t, k->h[c], now))
            return PD_ENOMEM;
    return t->n > r->max_chunks ? evict(r, t) : 0;
}

void pd_route_forget(struct pd_route *r, int i)
{
    assert(i >= 0 && i < r->n);
    free(r->t[i].s);
    r->t[i] = (struct table){0};
}

size_t pd_route_size(const struct pd_route *r, int i)
{
    return r->t[i].n;
}

size_t pd_route_match(const struct pd_route *r, int i, const struct pd_route_key *k)
{
    size_t c = 0;
    while (c < k->n) {
        const struct slot *x = find(&r->t[i], k->h[c]);
        if (!x || !x->h)
            break;
        c++;
    }
    return c;
}

int pd_route_pick(struct pd_route *r, const struct pd_route_key *k, const int *load, unsigned eligible,
                  enum pd_route_why *why, size_t *matched)
{
    int lo = -1, hi = -1;
    for (int i = 0; i < r->n; i++) {
        if (!(eligible & (1u << i)))
            continue;
        if (lo < 0 || load[i] < load[lo])
            lo = i;
        if (hi < 0 || load[i] > load[hi])
            hi = i;
    }
    assert(lo >= 0);
    int pick = lo;
    size_t m[PD_ROUTE_MAX];   /* matching chunks per instance, SIZE_MAX until counted */
    for (int i = 0; i < r->n; i++)
        m[i] = SIZE_MAX;
    *why = PD_ROUTE_BY_LOAD;
    if (r->o.policy == PD_ROUTE_CACHE_AWARE) {
        if (load[hi] - load[lo] > r->o.balance_abs && load[hi] > r->o.balance_rel * load[lo]) {
            *why = PD_ROUTE_BY_BALANCE;
        } else {
            int best = -1, room = -1;
            for (int i = 0; i < r->n; i++) {
                if (!(eligible & (1u << i)))
                    continue;
                m[i] = pd_route_match(r, i, k);
                if (best < 0 || m[i] > m[best] || (m[i] == m[best] && load[i] < load[best]))
                    best = i;
                if (room < 0 || r->t[i].n < r->t[room].n || (r->t[i].n == r->t[room].n && load[i] < load[room]))
                    room = i;
            }
            if (k->n && (double)m[best] > r->o.cache_threshold * (double)k->n) {
                pick = best;
                *why = PD_ROUTE_BY_PREFIX;
            } else {
                pick = room;
                *why = PD_ROUTE_BY_ROOM;
            }
        }
    }
    *matched = m[pick] != SIZE_MAX ? m[pick] : pd_route_match(r, pick, k);
    return pick;
}

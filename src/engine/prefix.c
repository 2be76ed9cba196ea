/* Prefix caching: snapshots of a sequence's KV state at unit boundaries, the pool blocks they
 * share, the hash table that finds them and LRU eviction (the contract and why it is exact:
 * prefix.h). */
#include "engine/prefix.h"
#include "core/hash.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

struct pd_prefix_node {
    uint64_t hash;                      /* chained over every token of [0, len) */
    int64_t len;                        /* tokens the node holds the state of (a boundary) */
    struct pd_prefix_node *parent;      /* the node at len - unit, NULL at the first boundary */
    int32_t *tokens;                    /* [unit] tokens [len - unit, len) */
    int children, pins;
    int ready;                          /* in the table (else planned: its step fills it) */
    uint8_t *snap;                      /* [snap_bytes] pd_kvsnap layout at len */
    size_t snap_bytes;
    int *blocks;                        /* [n_blocks] held: per layer, the entry blocks then the
                                         * key blocks that became full in (parent len, len] */
    int n_blocks;
    uint64_t stamp;                     /* last use */
    struct pd_prefix_node *hnext;       /* bucket chain */
    struct pd_prefix_node *prev, *next; /* c->nodes */
};

/* ---- the snapshot layout ---- */

/* Entries of layer l in a snapshot at len (the MTP layer's at len - 1: pd_kvpool_layer_len). */
static int64_t entries_at(const struct pd_kvpool *p, int l, int64_t len)
{
    return p->layer[l].ratio ? pd_kvpool_layer_len(p, l, len) / p->layer[l].ratio : 0;
}

/* Filled bytes of layer l's partial entry block (key = 0) or key block (key = 1) at len. */
static size_t partial_bytes(const struct pd_kvpool *p, int l, int key, int64_t len)
{
    int64_t n = entries_at(p, l, len);
    if (key)
        return p->layer[l].ratio == 4 ? (size_t)(n % p->block_keys) * p->key_bytes : 0;
    return (size_t)(n % p->block_entries) * p->entry_bytes;
}

static size_t state_half(const struct pd_kvpool *p, int l, int indexer)
{
    const struct pd_kvlayer *k = &p->layer[l];
    int d = indexer ? p->index_head_dim : p->head_dim;
    return (size_t)k->coff * k->ratio * (size_t)k->coff * d * sizeof(float);   /* kv rows, or score rows */
}

/* The slot ranges of layer l that a snapshot at pos holds (at most 5): the window ring, then for
 * each compressor (the layer's, a CSA layer's indexer's) its kv and score rows [coff * ratio,
 * coff * d] each, all of them while a block is open at pos (pos % ratio != 0). At a block
 * boundary the current block's rows are dead: pd_compress_push writes row i at the block's i-th
 * token and reads the rows only at its last, so they are all written again before any is read;
 * only ratio 4's previous-block rows (the first `ratio` rows of kv and of score, which the next
 * entry overlaps) are live. */
static int slot_parts(const struct pd_kvpool *p, int l, int64_t pos, size_t off[5], size_t len[5])
{
    const struct pd_kvlayer *k = &p->layer[l];
    pos = pd_kvpool_layer_len(p, l, pos);
    int n = 0;
    off[n] = k->window_off;
    len[n++] = (size_t)p->window * p->entry_bytes;
    for (int ix = 0; ix < 2; ix++) {
        if (!k->ratio || (ix && k->ratio != 4))
            continue;
        size_t base = ix ? k->idx_state_off : k->state_off, half = state_half(p, l, ix);
        if (pos % k->ratio) {
            off[n] = base;
            len[n++] = 2 * half;
        } else if (k->coff == 2) {
            off[n] = base;
            len[n++] = half / 2;
            off[n] = base + half;
            len[n++] = half / 2;
        }
    }
    return n;
}

/* Bytes of layer l's slot ranges at pos. */
static size_t slot_part_bytes(const struct pd_kvpool *p, int l, int64_t pos)
{
    size_t off[5], len[5], b = 0;
    for (int i = 0, n = slot_parts(p, l, pos, off, len); i < n; i++)
        b += len[i];
    return b;
}

/* Offset of layer l's slot ranges in a snapshot at pos (l = n_layers: where the partial blocks
 * start). */
static size_t slot_off(const struct pd_kvpool *p, int l, int64_t pos)
{
    size_t off = 0;
    for (int i = 0; i < l; i++)
        off += slot_part_bytes(p, i, pos);
    return off;
}

/* Offset of layer l's partial entry block (key = 0) or key block (key = 1) in a snapshot. */
static size_t partial_off(const struct pd_kvpool *p, int l, int key, int64_t len)
{
    size_t off = slot_off(p, p->n_layers, len);
    for (int i = 0; i < l; i++)
        off += partial_bytes(p, i, 0, len) + partial_bytes(p, i, 1, len);
    return off + (key ? partial_bytes(p, l, 0, len) : 0);
}

size_t pd_kvsnap_bytes(const struct pd_kvpool *p, int64_t pos)
{
    return partial_off(p, p->n_layers, 0, pos);
}

void pd_kvsnap_take(const struct pd_kvpool *p, const struct pd_kvseq *s, int layer, int64_t pos, uint8_t *buf)
{
    const uint8_t *slot = p->slots + (size_t)s->slot * p->slot_bytes;
    size_t off[5], len[5], at = slot_off(p, layer, pos);
    for (int i = 0, n = slot_parts(p, layer, pos, off, len); i < n; i++) {
        memcpy(buf + at, slot + off[i], len[i]);
        at += len[i];
    }
    int64_t n = entries_at(p, layer, pos);
    size_t eb = partial_bytes(p, layer, 0, pos), kb = partial_bytes(p, layer, 1, pos);
    if (eb)
        memcpy(buf + partial_off(p, layer, 0, pos), pd_kv_entry(p, s, layer, n / p->block_entries * p->block_entries), eb);
    if (kb)
        memcpy(buf + partial_off(p, layer, 1, pos), pd_kv_key(p, s, layer, n / p->block_keys * p->block_keys), kb);
}

/* Full blocks of layer l at len: entries (key = 0) or keys (key = 1). */
static int64_t full_blocks(const struct pd_kvpool *p, int l, int key, int64_t len)
{
    int64_t n = entries_at(p, l, len);
    if (key)
        return p->layer[l].ratio == 4 ? n / p->block_keys : 0;
    return n / p->block_entries;
}

/* ---- the cache ---- */

static uint64_t chain_hash(uint64_t parent, const int32_t *t, int n)
{
    uint64_t h = pd_mix64(parent ^ 0x9e3779b97f4a7c15ull);
    for (int i = 0; i < n; i++)
        h = pd_mix64(h ^ (uint32_t)t[i]);
    return h;
}

#define ROOT_HASH 0x50444d4f45ull   /* "PDMOE": the parent hash of the first boundary */

static uint64_t node_hash(const struct pd_prefix_node *parent)
{
    return parent ? parent->hash : ROOT_HASH;
}

int pd_prefix_init(struct pd_prefix *c, struct pd_kvpool *kv, int unit, size_t max_bytes, pd_err *e)
{
    memset(c, 0, sizeof *c);
    if (unit < 1)
        return pd_err_set(e, PD_EINVAL, "prefix cache: a unit of %d tokens: it must be positive", unit);
    c->kv = kv;
    c->unit = unit;
    c->max_bytes = max_bytes;
    c->n_table = 1024;
    c->table = calloc(c->n_table, sizeof *c->table);
    if (!c->table)
        return pd_err_set(e, PD_ENOMEM, "prefix cache: out of memory");
    return 0;
}

static void node_free(struct pd_prefix_node *x)
{
    if (!x)
        return;
    free(x->tokens);
    free(x->snap);
    free(x->blocks);
    free(x);
}

/* The ready node under `parent` whose unit is tokens[0, unit), or NULL. */
static struct pd_prefix_node *find(struct pd_prefix *c, const struct pd_prefix_node *parent, const int32_t *tokens)
{
    uint64_t h = chain_hash(node_hash(parent), tokens, c->unit);
    for (struct pd_prefix_node *x = c->table[h & (c->n_table - 1)]; x; x = x->hnext)
        if (x->hash == h && x->parent == parent && !memcmp(x->tokens, tokens, (size_t)c->unit * sizeof *tokens))
            return x;
    return NULL;
}

static void grow_table(struct pd_prefix *c)
{
    size_t n = c->n_table * 2;
    struct pd_prefix_node **t = calloc(n, sizeof *t);
    if (!t)
        return;   /* longer chains, still correct */
    for (size_t i = 0; i < c->n_table; i++)
        for (struct pd_prefix_node *x = c->table[i], *nx; x; x = nx) {
            nx = x->hnext;
            x->hnext = t[x->hash & (n - 1)];
            t[x->hash & (n - 1)] = x;
        }
    free(c->table);
    c->table = t;
    c->n_table = n;
}

static void insert(struct pd_prefix *c, struct pd_prefix_node *x)
{
    if (c->n_nodes >= c->n_table)
        grow_table(c);
    struct pd_prefix_node **b = &c->table[x->hash & (c->n_table - 1)];
    x->hnext = *b;
    *b = x;
    x->prev = NULL;
    x->next = c->nodes;
    if (c->nodes)
        c->nodes->prev = x;
    c->nodes = x;
    x->ready = 1;
    c->n_nodes++;
    if (x->parent)
        x->parent->children++;
}

static void evict(struct pd_prefix *c, struct pd_prefix_node *x)
{
    assert(x->ready && x->pins == 0 && x->children == 0);
    struct pd_prefix_node **b = &c->table[x->hash & (c->n_table - 1)];
    while (*b != x)
        b = &(*b)->hnext;
    *b = x->hnext;
    if (x->prev)
        x->prev->next = x->next;
    else
        c->nodes = x->next;
    if (x->next)
        x->next->prev = x->prev;
    c->n_nodes--;
    if (x->parent)
        x->parent->children--;
    /* no sequence lists these blocks (see prefix.h): each goes back to the pool */
    for (int i = 0; i < x->n_blocks; i++) {
        assert(c->kv->block_ref[x->blocks[i]] == 1);
        pd_kvpool_unhold(c->kv, x->blocks[i]);
    }
    c->bytes -= x->snap_bytes;
    c->evictions++;
    node_free(x);
}

static int on_path(const struct pd_prefix_node *keep, const struct pd_prefix_node *x)
{
    for (; keep; keep = keep->parent)
        if (keep == x)
            return 1;
    return 0;
}

/* The least recently used unused node not on keep's path, or NULL. */
static struct pd_prefix_node *lru(struct pd_prefix *c, const struct pd_prefix_node *keep)
{
    struct pd_prefix_node *best = NULL;
    for (struct pd_prefix_node *x = c->nodes; x; x = x->next)
        if (!x->pins && !x->children && (!best || x->stamp < best->stamp) && !on_path(keep, x))
            best = x;
    return best;
}

void pd_prefix_drop(struct pd_prefix *c)
{
    for (struct pd_prefix_node *x; (x = lru(c, NULL));)
        evict(c, x);
}

void pd_prefix_free(struct pd_prefix *c)
{
    if (!c->table)
        return;
    pd_prefix_drop(c);
    /* what a cursor still pins (its sequence outlives the cache): the holds go, the blocks stay
     * with the sequences listing them */
    for (struct pd_prefix_node *x = c->nodes, *nx; x; x = nx) {
        nx = x->next;
        for (int i = 0; i < x->n_blocks; i++)
            pd_kvpool_unhold(c->kv, x->blocks[i]);
        c->bytes -= x->snap_bytes;
        node_free(x);
    }
    assert(c->bytes == 0);
    free(c->table);
    memset(c, 0, sizeof *c);
}

int pd_prefix_make_room(struct pd_prefix *c, int blocks, const struct pd_prefix_node *keep)
{
    while (c->kv->n_blocks_free < blocks) {
        struct pd_prefix_node *x = lru(c, keep);
        if (!x)
            return PD_ENOMEM;
        evict(c, x);
    }
    return 0;
}

struct pd_prefix_node *pd_prefix_lookup(struct pd_prefix *c, const int32_t *tokens, int64_t n)
{
    struct pd_prefix_node *at = NULL;
    for (int64_t b = c->unit; b < n; b += c->unit) {
        struct pd_prefix_node *x = find(c, at, tokens + b - c->unit);
        if (!x)
            break;
        at = x;
    }
    return at;
}

int64_t pd_prefix_node_len(const struct pd_prefix_node *x)
{
    return x ? x->len : 0;
}

const void *pd_prefix_node_extra(const struct pd_prefix *c, const struct pd_prefix_node *x)
{
    return x && c->extra ? x->snap + pd_kvsnap_bytes(c->kv, x->len) : NULL;
}

int pd_prefix_node_blocks(const struct pd_prefix *c, const struct pd_prefix_node *x)
{
    int n = 0;
    for (int l = 0; x && l < c->kv->n_layers; l++)
        n += (int)(full_blocks(c->kv, l, 0, x->len) + full_blocks(c->kv, l, 1, x->len));
    return n;
}

static void stamp_path(struct pd_prefix *c, struct pd_prefix_node *x)
{
    uint64_t t = ++c->clock;
    for (; x; x = x->parent)
        x->stamp = t;
}

static void pin(struct pd_prefix_cursor *cur, struct pd_prefix_node *x)
{
    if (cur->node)
        cur->node->pins--;
    cur->node = x;
    if (x)
        x->pins++;
}

int pd_prefix_attach(struct pd_prefix *c, struct pd_prefix_node *x, struct pd_kvseq *s, struct pd_prefix_cursor *cur,
                     int64_t n, pd_err *e)
{
    struct pd_kvpool *p = c->kv;
    assert(s->slot >= 0 && s->len == 0 && !cur->node && !cur->n_pend);
    if (!x) {
        c->queries += (uint64_t)n;
        return 0;
    }
    assert(x->ready && x->len < n);
    /* the path from the first boundary to x: each node's blocks continue its parent's */
    int depth = (int)(x->len / c->unit);
    struct pd_prefix_node **path = malloc((size_t)depth * sizeof *path);
    if (!path)
        return pd_err_set(e, PD_ENOMEM, "prefix cache: out of memory");
    int k = depth;
    for (struct pd_prefix_node *y = x; y; y = y->parent)
        path[--k] = y;
    assert(k == 0);
    int rc = 0;
    for (int l = 0; l < p->n_layers && !rc; l++)
        for (int key = 0; key < 2 && !rc; key++)
            for (int d = 0; d < depth && !rc; d++) {
                /* node d's blocks of (l, key) sit after those of the layers and kinds before */
                const struct pd_prefix_node *y = path[d];
                int64_t from = y->parent ? y->parent->len : 0, skip = 0;
                for (int i = 0; i <= l; i++)
                    for (int kk = 0; kk < 2 && (i < l || kk < key); kk++)
                        skip += full_blocks(p, i, kk, y->len) - full_blocks(p, i, kk, from);
                int64_t cnt = full_blocks(p, l, key, y->len) - full_blocks(p, l, key, from);
                for (int64_t b = 0; b < cnt && !rc; b++)
                    rc = pd_kvseq_share(p, s, l, key, y->blocks[skip + b]);
            }
    free(path);
    /* fresh blocks for the partial ones, filled from the snapshot; the slot from it too */
    if (rc)
        return pd_err_set(e, PD_ENOMEM, "prefix cache: out of memory");
    if ((rc = pd_kvseq_reserve(p, s, x->len, e)))
        return rc;
    uint8_t *slot = p->slots + (size_t)s->slot * p->slot_bytes;
    for (int l = 0; l < p->n_layers; l++) {
        size_t off[5], len[5], at = slot_off(p, l, x->len);
        for (int i = 0, np = slot_parts(p, l, x->len, off, len); i < np; i++) {
            memcpy(slot + off[i], x->snap + at, len[i]);
            at += len[i];
        }
        int64_t nent = entries_at(p, l, x->len);
        size_t eb = partial_bytes(p, l, 0, x->len), kb = partial_bytes(p, l, 1, x->len);
        if (eb)
            memcpy(pd_kv_entry(p, s, l, nent / p->block_entries * p->block_entries), x->snap + partial_off(p, l, 0, x->len), eb);
        if (kb)
            memcpy(pd_kv_key(p, s, l, nent / p->block_keys * p->block_keys), x->snap + partial_off(p, l, 1, x->len), kb);
    }
    s->len = x->len;
    c->queries += (uint64_t)n;
    c->hits += (uint64_t)x->len;
    stamp_path(c, x);
    pin(cur, x);
    return 0;
}

static void drop_pending(struct pd_prefix *c, struct pd_prefix_cursor *cur)
{
    for (int i = 0; i < cur->n_pend; i++) {
        c->bytes -= cur->pend[i]->snap_bytes;
        node_free(cur->pend[i]);
    }
    cur->n_pend = 0;
}

int pd_prefix_plan(struct pd_prefix *c, struct pd_prefix_cursor *cur, const int32_t *tokens, int64_t pos, int64_t end,
                   struct pd_kvsnap **snaps, int *n_snaps, pd_err *e)
{
    struct pd_kvpool *p = c->kv;
    *snaps = NULL;
    *n_snaps = 0;
    assert(!cur->n_pend && pd_prefix_node_len(cur->node) <= pos);
    /* only a sequence standing on its last boundary extends the tree (one that outgrew the
     * budget, or started mid-unit, has no parent to hang a node on) */
    if (pd_prefix_node_len(cur->node) + c->unit <= pos)
        return 0;
    int64_t b = pd_prefix_node_len(cur->node) + c->unit;
    /* boundaries already cached: step along them */
    for (struct pd_prefix_node *x; b <= end && (x = find(c, cur->node, tokens + b - c->unit)); b += c->unit) {
        stamp_path(c, x);
        pin(cur, x);
    }
    for (; b <= end; b += c->unit) {
        size_t bytes = pd_kvsnap_bytes(p, b) + c->extra;
        /* the budget: unused nodes go first, least recently used first */
        struct pd_prefix_node *v;
        while (c->bytes + bytes > c->max_bytes && (v = lru(c, cur->node)))
            evict(c, v);
        if (c->bytes + bytes > c->max_bytes)
            break;
        if (cur->n_pend == cur->cap_pend) {
            int cap = cur->cap_pend ? 2 * cur->cap_pend : 4;
            struct pd_prefix_node **np = realloc(cur->pend, (size_t)cap * sizeof *np);
            if (np)
                cur->pend = np;
            struct pd_kvsnap *ns = np ? realloc(cur->snaps, (size_t)cap * sizeof *ns) : NULL;
            if (ns)
                cur->snaps = ns;
            if (!np || !ns)
                goto oom;
            cur->cap_pend = cap;
        }
        struct pd_prefix_node *x = calloc(1, sizeof *x);
        if (!x || !(x->tokens = malloc((size_t)c->unit * sizeof *x->tokens)) || !(x->snap = malloc(bytes))) {
            node_free(x);
            goto oom;
        }
        struct pd_prefix_node *parent = cur->n_pend ? cur->pend[cur->n_pend - 1] : cur->node;
        memcpy(x->tokens, tokens + b - c->unit, (size_t)c->unit * sizeof *x->tokens);
        x->len = b;
        x->parent = parent;
        x->hash = chain_hash(node_hash(parent), x->tokens, c->unit);
        x->snap_bytes = bytes;
        c->bytes += bytes;
        cur->snaps[cur->n_pend] = (struct pd_kvsnap){.pos = b, .buf = x->snap};
        cur->pend[cur->n_pend++] = x;
    }
    *snaps = cur->snaps;
    *n_snaps = cur->n_pend;
    return 0;
oom:
    drop_pending(c, cur);
    return pd_err_set(e, PD_ENOMEM, "prefix cache: out of memory");
}

void pd_prefix_commit(struct pd_prefix *c, struct pd_prefix_cursor *cur, const struct pd_kvseq *s, int ok)
{
    struct pd_kvpool *p = c->kv;
    if (!ok) {
        drop_pending(c, cur);
        return;
    }
    for (int i = 0; i < cur->n_pend; i++) {
        struct pd_prefix_node *x = cur->pend[i];
        cur->pend[i] = NULL;
        /* the parent is the node the cursor stands on: the planned one, or the equal node
         * another sequence of the same step put there first */
        x->parent = cur->node;
        struct pd_prefix_node *same = find(c, x->parent, x->tokens);
        if (same) {
            c->bytes -= x->snap_bytes;
            node_free(x);
            stamp_path(c, same);
            pin(cur, same);
            continue;
        }
        int64_t from = x->parent ? x->parent->len : 0;
        int n = 0;
        for (int l = 0; l < p->n_layers; l++)
            n += (int)(full_blocks(p, l, 0, x->len) - full_blocks(p, l, 0, from) + full_blocks(p, l, 1, x->len) -
                       full_blocks(p, l, 1, from));
        x->blocks = n ? malloc((size_t)n * sizeof *x->blocks) : NULL;
        if (n && !x->blocks) {
            /* no memory for the list: this node and the rest stay out of the cache */
            c->bytes -= x->snap_bytes;
            node_free(x);
            for (int j = i + 1; j < cur->n_pend; j++) {
                c->bytes -= cur->pend[j]->snap_bytes;
                node_free(cur->pend[j]);
            }
            break;
        }
        for (int l = 0; l < p->n_layers; l++) {
            for (int64_t b = full_blocks(p, l, 0, from); b < full_blocks(p, l, 0, x->len); b++)
                x->blocks[x->n_blocks++] = s->blocks[l][b];
            for (int64_t b = full_blocks(p, l, 1, from); b < full_blocks(p, l, 1, x->len); b++)
                x->blocks[x->n_blocks++] = s->kblocks[l][b];
        }
        assert(x->n_blocks == n);
        for (int j = 0; j < n; j++)
            pd_kvpool_hold(p, x->blocks[j]);
        x->hash = chain_hash(node_hash(x->parent), x->tokens, c->unit);
        insert(c, x);
        stamp_path(c, x);
        pin(cur, x);
    }
    cur->n_pend = 0;
}

void pd_prefix_release(struct pd_prefix *c, struct pd_prefix_cursor *cur)
{
    drop_pending(c, cur);
    pin(cur, NULL);
    free(cur->pend);
    free(cur->snaps);
    memset(cur, 0, sizeof *cur);
}

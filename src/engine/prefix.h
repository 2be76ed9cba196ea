/* Prefix caching on the paged KV pool: a prompt that starts with tokens an earlier prompt had
 * skips computing them, with bit-identical results.
 *
 * What is reused, and why it is exact. The engine computes a token the same whether it comes in
 * a prefill chunk or alone (engine.h), so the KV state a sequence holds after its first B tokens
 * is a function of those B tokens only. That state is
 *   (a) in the slot: every layer's sliding-window ring and, for ratio layers, the compressor
 *       state (and a CSA layer's indexer compressor state);
 *   (b) in blocks: the compressed entries i < floor(B / ratio) of each ratio layer and the
 *       indexer keys of each CSA layer (an entry is written once, when its block of `ratio`
 *       tokens completes, and never again).
 * A cached prefix is a node at a unit boundary B (a multiple of the cache's `unit` tokens)
 * holding
 *   - a snapshot of (a): the slot's live bytes as they are once the token at B - 1 has been
 *     processed in each layer (the engine copies each layer's part at that moment, inside the
 *     step that computes it, pd_step_item.snaps; the window ring cannot be rebuilt from blocks,
 *     and the compressor state of a block still open at B holds rows of tokens < B). Live: the
 *     whole window ring; a compressor's whole state while a block is open at B; at a block
 *     boundary (B % ratio == 0) only ratio 4's previous-block rows (its next entry overlaps
 *     them), since the current block's rows are all written again before any is read
 *     (pd_compress_push) and a fresh slot's stale bytes there are never seen;
 *   - the full blocks of (b) by reference (a pool hold, engine/kvpool.h): a block all of whose
 *     entries (or keys) are below B is final, so sequences share it read-only;
 *   - a copy of the filled part of each partial block of (b) at B (entries of positions < B in
 *     a block the owner goes on filling): copied into a fresh block of each sequence that
 *     starts from the node, so no shared block is ever written.
 * Restoring these bytes into a fresh sequence gives it, byte for byte, the KV state of a
 * sequence that computed the B tokens; everything after is the same computation on the same
 * bytes, so the logits are bit-identical.
 * A pool with the MTP layer (kvpool.h, lag_from): that layer runs one position behind, so its
 * part of everything above is its state after B - 1 tokens (pd_kvpool_layer_len; the engine takes
 * it when its MTP step processes position B - 2). What else the draft needs at B (the main
 * model's hidden state at B - 1) the caller keeps in the node's `extra` bytes.
 * Cost of a node: its live slot bytes + the filled parts of its partial blocks (at most one
 * entry block per ratio layer and one key block per CSA layer), pd_kvsnap_bytes, in malloc'ed
 * memory counted against the cache's snapshot budget; its full blocks are pool blocks (a block
 * newly full in (parent's B, B] is held by the node that completes it, so each block is held
 * once). With 256-token units (a multiple of every ratio), per node: V4-Flash 4.7 to 4.9 MB in
 * fp8 (6.5 to 6.8 MB in bf16; the whole slot is 15.4 MB, 17.8 MB), mostly the window rings (43
 * layers x 128 entries), against 1.0 MB (1.8 MB) of blocks for its 256 tokens; v4-flash-mini
 * 0.24 MB fp8, 0.31 MB bf16 (slot 0.66, 0.75 MB) against 0.06 MB (0.10 MB). A unit much shorter
 * than the window would cost more in snapshots than the KV it saves: the server's default is 256
 * tokens.
 *
 * Keys. Nodes form a tree (a node's parent is the one at B - unit). A node is found by a 64-bit
 * hash chained from its parent's hash over the unit's token ids (as vLLM hashes block by block);
 * the hash only picks a bucket: a match also compares the parent pointer and every token of the
 * unit, so a collision costs a comparison, never a wrong prefix.
 *
 * Eviction. A node is used while a live sequence's cursor pins it or it has children (a pinned
 * node's ancestors then stay, and a sequence started from a node only shares blocks of the
 * node's ancestors and itself). Only unused nodes are evicted, least recently used first (a
 * lookup hit or an insertion stamps the node), and only when the pool lacks free blocks
 * (pd_prefix_make_room) or the snapshot budget is spent. Every block an evicted node held goes
 * back to the pool then (no sequence lists it). With no live sequence and the cache dropped,
 * every block is free. */
#ifndef PD_ENGINE_PREFIX_H
#define PD_ENGINE_PREFIX_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"
#include "engine/kvpool.h"

/* The state a sequence holds at boundary pos, taken during a step (engine.h). */
struct pd_kvsnap {
    int64_t pos;
    uint8_t *buf;          /* [pd_kvsnap_bytes(p, pos)]: slot bytes, then each layer's partial
                            * entry block and partial key block (filled part only) */
};

size_t pd_kvsnap_bytes(const struct pd_kvpool *p, int64_t pos);
/* Layer `layer`'s part of the snapshot at pos, once s's token at pos - 1 is processed in it. */
void pd_kvsnap_take(const struct pd_kvpool *p, const struct pd_kvseq *s, int layer, int64_t pos, uint8_t *buf);

struct pd_prefix_node;

struct pd_prefix {
    struct pd_kvpool *kv;
    int unit;                       /* tokens between boundaries */
    size_t extra;                   /* bytes each node holds after its pool state, for the caller
                                     * (pd_prefix_node_extra; set after init, before any plan): the
                                     * MTP draft's input at the boundary, say */
    size_t max_bytes, bytes;        /* snapshot memory: budget and use */
    struct pd_prefix_node **table;  /* [n_table] hash buckets */
    size_t n_table, n_nodes;
    struct pd_prefix_node *nodes;   /* every node in the table */
    uint64_t clock;                 /* LRU stamps */
    uint64_t queries, hits;         /* prompt tokens looked up, and found (vLLM's prefix_cache_*) */
    uint64_t evictions;
};

/* A sequence's place in the cache: the node it stands on (pinned) and the nodes its current
 * step is filling. Zeroed before use; pd_prefix_release when the sequence ends. */
struct pd_prefix_cursor {
    struct pd_prefix_node *node;
    struct pd_prefix_node **pend;
    struct pd_kvsnap *snaps;
    int n_pend, cap_pend;
};

/* A cache on pool kv, boundaries every `unit` tokens, snapshots up to max_bytes in all. */
int pd_prefix_init(struct pd_prefix *c, struct pd_kvpool *kv, int unit, size_t max_bytes, pd_err *e);
/* Drops every node and frees the cache: the pool gets back every block no sequence lists. A
 * cursor still pinning a node must not be used after (pd_prefix_release it first). */
void pd_prefix_free(struct pd_prefix *c);
/* Evicts every unused node. */
void pd_prefix_drop(struct pd_prefix *c);

/* The longest cached prefix of tokens[0, n) that leaves at least one token to compute (its
 * length is a multiple of unit and < n), or NULL. Changes nothing. */
struct pd_prefix_node *pd_prefix_lookup(struct pd_prefix *c, const int32_t *tokens, int64_t n);
int64_t pd_prefix_node_len(const struct pd_prefix_node *x);
/* The node's `extra` bytes (NULL with none): written by the caller into a planned snapshot at
 * buf + pd_kvsnap_bytes(kv, pos) before the commit, read back here. */
const void *pd_prefix_node_extra(const struct pd_prefix *c, const struct pd_prefix_node *x);
/* Full blocks a sequence started from x shares (0 for NULL): what its admission needs less. */
int pd_prefix_node_blocks(const struct pd_prefix *c, const struct pd_prefix_node *x);

/* Evicts unused nodes, least recently used first, until `blocks` blocks are free; `keep` (and
 * its ancestors) stay whatever happens. 0 when that many are free, else PD_ENOMEM. */
int pd_prefix_make_room(struct pd_prefix *c, int blocks, const struct pd_prefix_node *keep);

/* Starts s (allocated, empty) from node x: its slot gets the snapshot, its block lists the
 * shared full blocks and fresh copies of the partial ones; the cursor pins x. s then holds the
 * KV of x's pd_prefix_node_len tokens (the caller sets the sequence's position). Counts the
 * query: `n` prompt tokens, x's length of them hits (x may be NULL: a miss, nothing restored).
 * On failure (PD_ENOMEM) s may hold some blocks: the caller frees it. */
int pd_prefix_attach(struct pd_prefix *c, struct pd_prefix_node *x, struct pd_kvseq *s, struct pd_prefix_cursor *cur,
                     int64_t n, pd_err *e);

/* Before a step that computes tokens[pos, end) of a sequence standing on cur->node (whose
 * length is pos, or 0 with no node): the snapshots the step must take (pd_step_item.snaps), one
 * per unit boundary in (pos, end] not already cached, in *snaps and *n_snaps (0 when none, or
 * when the budget holds nothing more). */
int pd_prefix_plan(struct pd_prefix *c, struct pd_prefix_cursor *cur, const int32_t *tokens, int64_t pos, int64_t end,
                   struct pd_kvsnap **snaps, int *n_snaps, pd_err *e);
/* After that step: ok, the planned nodes enter the cache (holding their full blocks of s) and
 * the cursor moves to the last; not ok, they are discarded. */
void pd_prefix_commit(struct pd_prefix *c, struct pd_prefix_cursor *cur, const struct pd_kvseq *s, int ok);
/* The sequence ends (or leaves the cache): its cursor lets go. */
void pd_prefix_release(struct pd_prefix *c, struct pd_prefix_cursor *cur);

#endif

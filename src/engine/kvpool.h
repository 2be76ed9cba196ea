/* The KV cache of DeepSeek-V4 sequences, paged as serving engines do.
 *
 * What a sequence keeps (docs/memory-model.md, "KV cache"), in the planner's
 * `--kv-cache-dtype` (bf16 or fp8):
 *   fixed, one slot per sequence: for every layer the sliding window (a ring of `window`
 *     entries) and, for ratio layers, the compressor state (kv and score
 *     rows, fp32 [coff*ratio, coff*d] each; a CSA layer also the indexer's compressor);
 *   growing, in blocks from a shared pool: the compressed entries of each ratio layer and the
 *     indexer keys of each CSA layer, `block_entries` entries (or keys) per block.
 * An entry (window, CSA, HCA) is head_dim values: bf16, or fp8 as V4 is deployed (the planner's
 * 584 B for V4-Flash): [nope e4m3 codes][rope bf16 values][one ue8m0 scale byte per 64 nope
 * values][zeros up to a multiple of 8], quantized as the official code does (kernels/fp8.h).
 * An indexer key is index_head_dim values: bf16, or fp8 [index_head_dim e4m3 codes][fp32
 * power-of-two scale]. Writers and readers go through pd_kv_put/pd_kv_get.
 * A slot's size and the pool's marginal bytes per token are derived from this layout and equal
 * what `pdmoe plan` computes for the same config and dtype (tests/engine/test_engine.c); so do a
 * sequence's bytes whenever its blocks are full. In fp8 the entries per block are rounded up
 * until a block holds whole indexer keys too (16 -> 17 for the mini model, 33 for V4-Flash), so
 * no key block carries padding the planner does not count. Freeing a
 * sequence returns its slot and drops its reference to every block; a block is free when no
 * sequence lists it and no prefix cache holds it. The pool asserts that it never frees a block
 * twice and that all blocks but the held ones are back when no sequence is live.
 * Blocks are handed out in ascending address order, from the lowest free extent that holds a
 * whole reservation when there is one: a sequence's blocks then lie in one piece in the order
 * pd_kvseq_runs lists them, and a KV hand-off copies them with one get instead of one per block. */
#ifndef PD_ENGINE_KVPOOL_H
#define PD_ENGINE_KVPOOL_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"
#include "model/config.h"
#include "plan/kvsize.h"

struct pd_kvlayer {
    int ratio;                 /* 0: window only; 4: CSA (with indexer); else HCA */
    int coff;                  /* 2 for ratio 4 (overlapping blocks), else 1 */
    size_t window_off;         /* in the slot: ring of `window` entries, bf16 [window, head_dim] */
    size_t state_off;          /* fp32 kv [coff*ratio, coff*head_dim] then score, same shape */
    size_t idx_state_off;      /* CSA: the indexer compressor's, with index_head_dim */
};

struct pd_kvpool {
    int n_layers;
    int lag_from;                       /* the main model's layers: a layer at or past it (the MTP
                                         * layer) runs one position behind them (engine.h, mtp_pos),
                                         * so its state at a sequence's length B is that after B - 1
                                         * tokens (pd_kvpool_layer_len; a prefix snapshot's) */
    int window, head_dim, index_head_dim, rope_dim;
    enum pd_kv_dtype dtype;
    size_t entry_bytes, key_bytes;      /* one entry (head_dim values), one indexer key */
    int block_entries;                  /* entries per block */
    int block_keys;                     /* indexer keys per block (same block size) */
    size_t block_bytes;
    size_t slot_bytes;                  /* fixed part of a sequence */
    struct pd_kvlayer *layer;           /* [n_layers] */
    uint8_t *region;                    /* slots then blocks, one allocation (what KV transfer registers) */
    int region_lent;                    /* the region belongs to someone else (pd_kvpool_move) */
    size_t region_bytes;
    uint8_t *slots;                     /* [n_slots][slot_bytes], at the start of region */
    int n_slots, n_slots_free;
    int *slot_free;                     /* stack of free slots */
    uint8_t *blocks;                    /* [n_blocks][block_bytes], after the slots */
    int n_blocks, n_blocks_free;
    uint64_t *block_used;               /* bitmap [n_blocks]: 1 while referenced (and past the end) */
    int *block_ref;                     /* [n_blocks] references: the sequences listing it, plus holds */
    int held;                           /* holds (pd_kvpool_hold): references no sequence lists */
    int block_low;                      /* no free block below it */
    int live_seqs;
};

struct pd_kvseq {
    int slot;                           /* -1 when not allocated */
    int64_t len;                        /* tokens whose KV is held */
    int **blocks;                       /* [n_layers][...] entry blocks of ratio layers */
    int *n_blocks, *cap_blocks;
    int **kblocks;                      /* [n_layers][...] indexer-key blocks of CSA layers */
    int *n_kblocks, *cap_kblocks;
};

/* The tokens layer l has processed when the main model has processed pos (the MTP layer one fewer). */
static inline int64_t pd_kvpool_layer_len(const struct pd_kvpool *p, int l, int64_t pos)
{
    return l >= p->lag_from && pos > 0 ? pos - 1 : pos;
}

/* A pool for `max_seqs` sequences and `bytes` in all (slots + blocks), entries in `dtype`. */
int pd_kvpool_init(struct pd_kvpool *p, const struct pd_model *m, enum pd_kv_dtype dtype, int max_seqs,
                   size_t bytes, int block_entries, pd_err *e);
/* The same with `n_layers` layers (m->n_layers, or one more for the MTP layer, whose slot and
 * blocks are laid out as a layer's of ratio compress_ratio[m->n_layers]). */
int pd_kvpool_init_layers(struct pd_kvpool *p, const struct pd_model *m, int n_layers, enum pd_kv_dtype dtype,
                          int max_seqs, size_t bytes, int block_entries, pd_err *e);
/* The bytes of one entry and one indexer key of model m in dtype (what the planner counts). */
void pd_kvpool_entry_bytes(const struct pd_model *m, enum pd_kv_dtype dtype, size_t *entry, size_t *key);
void pd_kvpool_free(struct pd_kvpool *p);
/* Moves an empty pool to `region` (region_bytes long, owned by the caller and outliving the
 * pool's use): a KV transfer engine's own memory, which a peer reads directly. */
void pd_kvpool_move(struct pd_kvpool *p, void *region);

/* Geometry: what one sequence costs. */
double pd_kvpool_bytes_per_token(const struct pd_kvpool *p);   /* marginal, long sequences */
size_t pd_kvpool_bytes_per_seq(const struct pd_kvpool *p);     /* the fixed slot */
/* Bytes a sequence holds now (its slot and its blocks). */
size_t pd_kvpool_seq_bytes(const struct pd_kvpool *p, const struct pd_kvseq *s);

int pd_kvseq_alloc(struct pd_kvpool *p, struct pd_kvseq *s, pd_err *e);
/* Makes room for entries and keys up to `len` tokens; PD_ENOMEM "KV pool full" if not (and
 * then nothing is taken). */
int pd_kvseq_reserve(struct pd_kvpool *p, struct pd_kvseq *s, int64_t len, pd_err *e);
/* The same for a request's whole future, `total` tokens, taking the blocks of its first `prompt`
 * tokens first: the part a KV hand-off copies lies in one piece wherever the pool has room for it,
 * the blocks only decoding fills come after it. */
int pd_kvseq_reserve_prompt(struct pd_kvpool *p, struct pd_kvseq *s, int64_t prompt, int64_t total, pd_err *e);
/* Blocks a sequence of `len` tokens holds in all (what admission must find free). */
int pd_kvpool_blocks_for(const struct pd_kvpool *p, int64_t len);
/* Blocks needed to grow s to `len` tokens (admission control). */
int pd_kvseq_blocks_needed(const struct pd_kvpool *p, const struct pd_kvseq *s, int64_t len);
void pd_kvseq_free(struct pd_kvpool *p, struct pd_kvseq *s);

/* Sharing (a prefix cache, engine/prefix.h): a block is free when its last reference goes.
 * A sequence references each block it lists; pd_kvpool_hold adds a reference no sequence lists
 * (at most one per block: with no live sequence, n_blocks_free + held == n_blocks), unhold drops
 * it. pd_kvseq_share appends block b to s's entry (key = 0) or indexer-key (key = 1) blocks of
 * `layer` with a reference of its own: s reads it and must never write it (its entries are all
 * final). PD_ENOMEM (nothing changed) if the list cannot grow. */
void pd_kvpool_hold(struct pd_kvpool *p, int b);
void pd_kvpool_unhold(struct pd_kvpool *p, int b);
int pd_kvseq_share(struct pd_kvpool *p, struct pd_kvseq *s, int layer, int key, int b);

/* A sequence's KV as byte runs of the pool's region, in a fixed order: its slot, then for each
 * layer its entry blocks and its indexer-key blocks (the order reserve takes them in). Two pools of the same model and
 * block size give sequences of the same length runs of the same lengths: what a KV hand-off
 * copies one to one. Returns the number of runs (<= max), or -1 if max is too small. */
struct pd_kv_run {
    uint64_t off, len;
};
/* Only the blocks that hold the first `len` tokens count (a sequence may have reserved more). */
int pd_kvseq_runs(const struct pd_kvpool *p, const struct pd_kvseq *s, int64_t len, struct pd_kv_run *runs, int max);
int pd_kvseq_max_runs(const struct pd_kvpool *p, const struct pd_kvseq *s);
/* The same runs in a malloc'ed array (NULL when out of memory), their count in *n and, if bytes
 * is not NULL, their total length in *bytes. */
struct pd_kv_run *pd_kvseq_runs_alloc(const struct pd_kvpool *p, const struct pd_kvseq *s, int64_t len, int *n,
                                      uint64_t *bytes);

/* Accessors: where an entry (window or compressed) or a key lies, in the pool's format. */
void *pd_kv_window(const struct pd_kvpool *p, const struct pd_kvseq *s, int layer, int64_t pos);
float *pd_kv_state(const struct pd_kvpool *p, const struct pd_kvseq *s, int layer, int indexer);
void *pd_kv_entry(const struct pd_kvpool *p, const struct pd_kvseq *s, int layer, int64_t i);
void *pd_kv_key(const struct pd_kvpool *p, const struct pd_kvseq *s, int layer, int64_t i);

/* An entry of head_dim fp32 values into the pool's format at dst, and back (fp8: quantized as
 * the official code does, the values first rounded to bf16 as its activations are). */
void pd_kv_put_entry(const struct pd_kvpool *p, void *dst, const float *src);
void pd_kv_get_entry(const struct pd_kvpool *p, float *dst, const void *src);
/* The same for an indexer key of index_head_dim values. */
void pd_kv_put_key(const struct pd_kvpool *p, void *dst, const float *src);
void pd_kv_get_key(const struct pd_kvpool *p, float *dst, const void *src);

/* Undo log of a sequence's speculative tokens (MTP verification and drafting).
 *
 * A step run with undo on saves, before every write into the sequence's fixed slot, the bytes it
 * is about to overwrite, tagged with the token position that writes them: the window ring row of
 * the position (one entry) and the compressor state rows the position writes (its kv and score
 * rows; on a ratio-4 block boundary also the whole previous-block half the state shifts into).
 * pd_kvundo_rollback(pos) copies back every record of position >= pos, newest first.
 *
 * Why this is exact: a layer's slot bytes are written only by its own tokens, in position order,
 * so for every byte the oldest record of a rejected position holds the value it had after the
 * last accepted position wrote it; restoring newest first leaves that value. The records of
 * kept positions are dropped (their writes stand). The compressed entries and indexer keys in
 * blocks are not saved: entry b is written by position b*ratio + ratio - 1 before any query
 * reads it and is visible only to queries at that position or later, so after a roll back to
 * length len the entries a rejected position emitted are beyond every later query's count
 * ((pos + 1) / ratio) until the position that rewrites them runs again. Blocks stay reserved
 * (a request reserves its whole future up front anyway). */
struct pd_kvundo_rec {
    void *addr;
    size_t len, off;                    /* off: the saved bytes in data */
    int64_t pos;
};

struct pd_kvundo {
    struct pd_kvundo_rec *rec;
    int n;
    size_t cap;
    uint8_t *data;
    size_t used, dcap;
    int64_t from;                       /* lowest position recorded (valid when n > 0) */
};

/* Saves the len bytes at addr, about to be written by position pos: PD_ENOMEM when out of memory. */
int pd_kvundo_save(struct pd_kvundo *u, int64_t pos, void *addr, size_t len);
/* Restores every byte written by positions >= pos since the log was last cleared, then clears it. */
void pd_kvundo_rollback(struct pd_kvundo *u, int64_t pos);
void pd_kvundo_clear(struct pd_kvundo *u);
void pd_kvundo_free(struct pd_kvundo *u);

#endif

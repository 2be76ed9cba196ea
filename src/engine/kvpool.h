/* The KV cache of DeepSeek-V4 sequences, paged as serving engines do.
 *
 * What a sequence keeps (docs/memory-model.md, "KV cache"), in bf16 like the planner's
 * `--kv-cache-dtype bf16`:
 *   fixed, one slot per sequence: for every layer the sliding window (a ring of `window`
 *     entries of head_dim values) and, for ratio layers, the compressor state (kv and score
 *     rows, fp32 [coff*ratio, coff*d] each; a CSA layer also the indexer's compressor);
 *   growing, in blocks from a shared pool: the compressed entries of each ratio layer and the
 *     indexer keys of each CSA layer, `block_entries` entries (or keys) per block.
 * A slot's size and the pool's marginal bytes per token are derived from this layout and equal
 * what `pdmoe plan` computes for the same config (tests/engine/test_kvpool.c). Freeing a
 * sequence returns its slot and every block; the pool asserts that its free lists never hold
 * a block twice and that all blocks are back when no sequence is live. */
#ifndef PD_ENGINE_KVPOOL_H
#define PD_ENGINE_KVPOOL_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"
#include "model/config.h"

struct pd_kvlayer {
    int ratio;                 /* 0: window only; 4: CSA (with indexer); else HCA */
    int coff;                  /* 2 for ratio 4 (overlapping blocks), else 1 */
    size_t window_off;         /* in the slot: ring of `window` entries, bf16 [window, head_dim] */
    size_t state_off;          /* fp32 kv [coff*ratio, coff*head_dim] then score, same shape */
    size_t idx_state_off;      /* CSA: the indexer compressor's, with index_head_dim */
};

struct pd_kvpool {
    int n_layers;
    int window, head_dim, index_head_dim;
    size_t entry_bytes, key_bytes;      /* bf16 head_dim and index_head_dim values */
    int block_entries;                  /* entries per block */
    int block_keys;                     /* indexer keys per block (same block size) */
    size_t block_bytes;
    size_t slot_bytes;                  /* fixed part of a sequence */
    struct pd_kvlayer *layer;           /* [n_layers] */
    uint8_t *region;                    /* slots then blocks, one allocation (what KV transfer registers) */
    size_t region_bytes;
    uint8_t *slots;                     /* [n_slots][slot_bytes], at the start of region */
    int n_slots, n_slots_free;
    int *slot_free;                     /* stack of free slots */
    uint8_t *blocks;                    /* [n_blocks][block_bytes], after the slots */
    int n_blocks, n_blocks_free;
    int *block_free;                    /* stack of free blocks */
    unsigned char *block_used;          /* [n_blocks] 1 while owned by a sequence */
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

/* A pool for `max_seqs` sequences and `bytes` in all (slots + blocks). */
int pd_kvpool_init(struct pd_kvpool *p, const struct pd_model *m, int max_seqs, size_t bytes,
                   int block_entries, pd_err *e);
void pd_kvpool_free(struct pd_kvpool *p);

/* Geometry: what one sequence costs. */
double pd_kvpool_bytes_per_token(const struct pd_kvpool *p);   /* marginal, long sequences */
size_t pd_kvpool_bytes_per_seq(const struct pd_kvpool *p);     /* the fixed slot */
/* Bytes a sequence holds now (its slot and its blocks). */
size_t pd_kvpool_seq_bytes(const struct pd_kvpool *p, const struct pd_kvseq *s);

int pd_kvseq_alloc(struct pd_kvpool *p, struct pd_kvseq *s, pd_err *e);
/* Makes room for entries and keys up to `len` tokens; PD_ENOMEM "KV pool full" if not. */
int pd_kvseq_reserve(struct pd_kvpool *p, struct pd_kvseq *s, int64_t len, pd_err *e);
/* Blocks a sequence of `len` tokens holds in all (what admission must find free). */
int pd_kvpool_blocks_for(const struct pd_kvpool *p, int64_t len);
/* Blocks needed to grow s to `len` tokens (admission control). */
int pd_kvseq_blocks_needed(const struct pd_kvpool *p, const struct pd_kvseq *s, int64_t len);
void pd_kvseq_free(struct pd_kvpool *p, struct pd_kvseq *s);

/* A sequence's KV as byte runs of the pool's region, in a fixed order: its slot, then each
 * layer's entry blocks, then each layer's indexer-key blocks. Two pools of the same model and
 * block size give sequences of the same length runs of the same lengths: what a KV hand-off
 * copies one to one. Returns the number of runs (<= max), or -1 if max is too small. */
struct pd_kv_run {
    uint64_t off, len;
};
/* Only the blocks that hold the first `len` tokens count (a sequence may have reserved more). */
int pd_kvseq_runs(const struct pd_kvpool *p, const struct pd_kvseq *s, int64_t len, struct pd_kv_run *runs, int max);
int pd_kvseq_max_runs(const struct pd_kvpool *p, const struct pd_kvseq *s);

/* Accessors. */
uint16_t *pd_kv_window(const struct pd_kvpool *p, const struct pd_kvseq *s, int layer, int64_t pos);
float *pd_kv_state(const struct pd_kvpool *p, const struct pd_kvseq *s, int layer, int indexer);
uint16_t *pd_kv_entry(const struct pd_kvpool *p, const struct pd_kvseq *s, int layer, int64_t i);
uint16_t *pd_kv_key(const struct pd_kvpool *p, const struct pd_kvseq *s, int layer, int64_t i);

#endif

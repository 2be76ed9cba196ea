/* `pdmoe convert`: DeepSeek's released checkpoint (FP8/FP4, engine/release.h) to pdmoe's W8A8
 * layout, shard by shard: each FP8/FP4 matrix a W8A8 deployment quantises (plan/inventory.h,
 * pd_inventory_w8a8_role: wq_b, wo_b, the indexer's wq_b, experts, MTP projections) becomes int8
 * "X.weight" + fp32 "X.weight_scale" per output row; the other FP8 matrices (wq_a, wkv, wo_a) become
 * bf16 "X.weight" holding their exact values; every other tensor is copied as it is.
 *
 * Each input shard becomes the output shard of the same name, written to NAME.partial and
 * renamed when complete and verified; model.safetensors.index.json maps every output tensor,
 * config.json is copied without its quantization_config, tokenizer files are copied.
 * Restartable: a shard whose output already exists is verified against its source and skipped
 * when it passes (converted again when it does not).
 * Verification of every output tensor, after writing it, read back from the file: a converted
 * matrix row by row, each int8 value q with the row's scale s against the decoded source value w:
 * |q s - w| <= s / 2 (round to nearest) and |q| <= 127; a bf16 matrix equal to the decoded source
 * value by value; a copied tensor byte for byte.
 * Memory is bounded whatever the checkpoint's size: the source is mapped and its pages dropped
 * (MADV_DONTNEED) as each block of rows is done; the output is written with write() and read back
 * with pread(); buffers hold one row, one tensor's row scales and one 4 MiB copy chunk. */
#ifndef PD_ENGINE_CONVERT_H
#define PD_ENGINE_CONVERT_H

#include <stdint.h>

#include "core/err.h"

struct pd_convert_progress {
    int shard, nshards;           /* the shard being worked on (0-based) and the count */
    const char *file;             /* its file name */
    uint64_t done, total;         /* source bytes done, over all shards */
    int skipped;                  /* 1: this shard was already converted and verified */
};

struct pd_convert_opts {
    const char *in_dir, *out_dir;
    /* called after each tensor and at each shard's end; NULL for none */
    void (*progress)(void *ctx, const struct pd_convert_progress *p);
    void *ctx;
};

struct pd_convert_stats {
    int shards, converted, skipped;     /* skipped: complete from an earlier run, verified */
    int64_t tensors, matrices;          /* output tensors; of them matrices converted to int8 */
    int64_t bf16;                       /* ... and matrices converted to bf16 */
    uint64_t in_bytes, out_bytes;       /* source and output data bytes (all shards) */
    double max_rel_err;                 /* max over converted rows of max |q s - w| / max |w| */
};

int pd_convert(const struct pd_convert_opts *o, struct pd_convert_stats *st, pd_err *e);

#endif

/* Storage formats of weights and their exact byte counts, scales included, and the
 * quantisation scheme that picks a format for each tensor.
 *
 *   w8a8  int8 [out, in] + fp32 scale per output row          out*in + 4*out
 *   fp8   e4m3 [out, in] + one scale per 128x128 block        out*in + s*ceil(out/128)*ceil(in/128)
 *         (s = 1 byte for ue8m0 scales as DeepSeek ships them, else 4 for fp32)
 *   fp4   e2m1, two per byte, + one ue8m0 scale per 32 values out*ceil(in/2) + out*ceil(in/32)
 *   w4a8  int4, two per byte, + fp32 scale per output row   out*ceil(in/2) + 4*out
 *         (msModelSlim's W4A8 per-channel: weights int4, activations int8 per token)
 *   bf16  2 bytes per value
 * A scheme applies its format to the matrices its deployments quantise; everything else keeps the
 * dtype it has in the released checkpoints (embedding/head/norms/router/compressor bf16, mHC and
 * attention sinks fp32), unless a per-group override or a preset's quantize_groups says otherwise.
 * Which matrices those are (plan/inventory.h, pd_inventory_w8a8_role):
 *   fp8, fp4, bf16  what DeepSeek's release stores in FP8: the attention's wq_a, wq_b, wkv, wo_a,
 *                   wo_b, the indexer's wq_b, the experts, the MTP projections;
 *   w8a8, w4a8      what a W8A8 deployment of V4 quantises (vLLM-Ascend's DeepSeek-V4 W8A8/W4A8
 *                   rules, the msModelSlim format): wq_b, wo_b, the indexer's wq_b, the experts
 *                   and the MTP projections; wq_a, wkv and wo_a (FP8 in the release) in bf16.
 *   DeepSeek-V3 keeps one list for every scheme (every linear layer's matrix).
 *
 * The scheme w4a8 is the one Ascend deployments ship (msModelSlim's W4A8 config for V4: the
 * routed experts int4 per output channel, everything else W8A8): linear format w8a8 with the
 * routed experts in w4a8, which a routed_experts override can still change. */
#ifndef PD_PLAN_QUANT_H
#define PD_PLAN_QUANT_H

#include <stdint.h>

#include "core/err.h"
#include "plan/groups.h"

enum pd_fmt {
    PD_FMT_NONE = -1,
    PD_FMT_F32 = 0, PD_FMT_BF16, PD_FMT_F16, PD_FMT_I64, PD_FMT_I32,
    PD_FMT_W8A8, PD_FMT_FP8, PD_FMT_FP4, PD_FMT_W4A8,
    PD_FMT_RAW,           /* a checkpoint tensor counted by its stored bytes */
    PD_FMT_COUNT
};

struct pd_quant {
    enum pd_fmt linear;                 /* format of linear-layer weight matrices */
    enum pd_fmt group_fmt[PD_G_COUNT];  /* per-group override of matrices, or PD_FMT_NONE */
    int fp8_block;                      /* 128 */
    int fp8_scale_bytes;                /* 1 (ue8m0) or 4 (fp32) */
    int w8a8_groups;                    /* 1: quantises what a W8A8 deployment does (w8a8, w4a8) */
};

const char *pd_fmt_name(enum pd_fmt f);
/* Parses an override format name: w8a8, w4a8, fp8, fp4, bf16, fp32. */
int pd_fmt_parse(const char *s, enum pd_fmt *f);

/* Bytes of one tensor of `ndim` dims stored in format f (2-D: shape[0] = out rows). */
int64_t pd_fmt_bytes(enum pd_fmt f, int ndim, const int64_t *shape, const struct pd_quant *q);
int64_t pd_fmt_scale_bytes(enum pd_fmt f, int ndim, const int64_t *shape, const struct pd_quant *q);

/* A scheme by name (w8a8, w4a8, fp8, fp4, bf16), with `overrides` "group=fmt,group=fmt" (NULL for
 * none). */
int pd_quant_init(struct pd_quant *q, const char *scheme, const char *overrides, int ue8m0_scales, pd_err *e);
/* "w8a8" or "fp8 (routed_experts=fp4)" */
const char *pd_quant_describe(const struct pd_quant *q, char *buf, int n);

#endif

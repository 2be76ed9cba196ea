/* The weight inventory: every tensor of a model, its shape, its format under the chosen
 * quantisation scheme, its bytes including scales, its group and its class (I = routed
 * expert, split by expert parallelism; II = replicated on every card).
 *
 * Built either from the model description (names as in the released checkpoints: DeepSeek's
 * own naming for V4, Hugging Face's for V3) or from a checkpoint's safetensors headers. A
 * routed expert's tensors in one layer form one entry with count = n_routed_experts, so the
 * inventory of V4-Flash has about 1,300 entries instead of 35,000 and a plan stays far below
 * a millisecond; pd_inventory_expand_name() gives each instance's real name. */
#ifndef PD_PLAN_INVENTORY_H
#define PD_PLAN_INVENTORY_H

#include <stdint.h>

#include "core/err.h"
#include "model/config.h"
#include "model/safetensors.h"
#include "plan/groups.h"
#include "plan/quant.h"

struct pd_tensor {
    char name[96];         /* routed experts: "layers.5.ffn.experts.{e}.w1.weight" */
    int ndim;
    int64_t shape[2];      /* [out, in] for matrices */
    enum pd_fmt fmt;
    int64_t params;        /* values in one instance */
    int64_t bytes;         /* bytes of one instance, scales included */
    int count;             /* instances: the experts of a layer, or 1 */
    int16_t layer;         /* -1 for model-level tensors; >= n_layers for MTP layers */
    uint8_t group;         /* enum pd_group */
    uint8_t cls;           /* enum pd_class */
};

#define PD_INV_MAX_UNCLASSED 16
/* The most bytes (and parameters) a model description may come to: 2^50 (1.1 PB), hundreds of
 * times the largest released model, so that every total and the planner's products of them stay
 * far inside int64. A config.json within each field's range can still ask for more (65,536
 * experts of 2^20 x 2^20): pd_inventory_build refuses it with PD_ERANGE. */
#define PD_INV_MAX_BYTES (INT64_C(1) << 50)

struct pd_inventory {
    struct pd_tensor *t;
    int n, cap;
    int n_experts;                    /* routed experts per MoE layer */
    int n_moe_layers;                 /* layers holding routed experts, MTP included */
    int64_t *expert_bytes;            /* [n_experts]: one expert id over all MoE layers */
    int64_t group_bytes[PD_G_COUNT][2];   /* [group][class] */
    int64_t group_params[PD_G_COUNT][2];
    int64_t class_bytes[2], class_params[2];
    int from_checkpoint;
    int n_unclassed;                  /* checkpoint tensors no rule could class */
    char unclassed[PD_INV_MAX_UNCLASSED][96];
};

/* From the model description; include_mtp = 0 leaves the MTP layers out. PD_ERANGE, naming the
 * model's file and the tensor, when the sizes add up to more than PD_INV_MAX_BYTES. */
int pd_inventory_build(const struct pd_model *m, const struct pd_quant *q, int include_mtp,
                       struct pd_inventory *inv, pd_err *e);
/* From a checkpoint's headers: each tensor counted by its stored bytes. */
int pd_inventory_from_checkpoint(const struct pd_model *m, const struct pd_st_set *s,
                                 struct pd_inventory *inv, pd_err *e);
void pd_inventory_free(struct pd_inventory *inv);

/* What a W8A8 deployment of DeepSeek-V4 (vLLM-Ascend, msModelSlim's format) does with a matrix
 * the release stores in FP8/FP4, by its name in the release: quantises it to int8 per output row
 * (wq_b, wo_b, the indexer's wq_b, routed and shared experts, the MTP projections), runs it in
 * bf16 (wq_a, wkv, wo_a), or keeps it FP8 as released (the draft stages' wo_a of a DSpark
 * checkpoint, `dspark` 1). The planner's w8a8/w4a8 schemes, gen-model's W8A8 layout,
 * `pdmoe convert` and the engine's load of a release all follow it. */
enum pd_w8a8_role { PD_W8A8_QUANT, PD_W8A8_FLOAT, PD_W8A8_KEEP };
enum pd_w8a8_role pd_inventory_w8a8_role(const char *name, int dspark);

/* Classifies a tensor name (either naming); returns 0, PD_ERANGE for a routed expert at or past
 * m->n_routed_experts (its id in *expert), or PD_EINVAL if no rule applies. */
int pd_inventory_classify(const struct pd_model *m, const char *name, enum pd_group *g,
                          enum pd_class *c, int *layer, int *expert);
/* Name of instance i of an entry ("{e}" replaced by i). */
const char *pd_inventory_expand_name(const struct pd_tensor *t, int i, char *buf, int n);

#endif

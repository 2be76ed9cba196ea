/* Hardware description (hardware/ *.json): the card (memory, bandwidth, compute), the node,
 * the links inside and between nodes, and the runtime overhead per role; every figure has
 * its source in the file's "sources" object. Loaded by path or by preset name. */
#ifndef PD_PLAN_HARDWARE_H
#define PD_PLAN_HARDWARE_H

#include <stdint.h>

#include "core/err.h"

struct pd_link {
    char name[64];
    double bandwidth_Bps;   /* effective bytes per second, one direction, one card */
    double latency_s;       /* fixed cost per transfer */
};

/* Efficiency factors of the performance model (src/plan/perf.h): what fraction of a peak the
 * real kernels reach, and the costs a roofline does not see. Each has its source in the
 * hardware file's "sources.efficiency" object; `pdmoe calibrate` measures them for a CPU. */
struct pd_efficiency {
    double gemm;            /* fraction of the dtype's peak a large GEMM reaches */
    double memory;          /* fraction of memory bandwidth a weight or KV stream reaches */
    double attention;       /* fraction of the bf16 peak attention's arithmetic reaches */
    double a2a_intra;       /* fraction of the intra-node link expert dispatch/combine reaches */
    double a2a_inter;       /* the same over the inter-node RDMA link */
    double a2a_latency_s;   /* fixed cost of one dispatch or one combine */
    double imbalance[2];    /* busiest rank's expert load / mean, prefill and decode, no redundant experts */
    double imbalance_eplb[2];  /* the same with redundant experts placed by load (EPLB) */
    double overlap[2];      /* fraction of communication hidden behind compute, per role */
    double step_s[2];       /* fixed cost of one forward step (scheduling, launches), per role */
    double token_layer_s[2];  /* per token and layer, per role: the non-GEMM kernels (norms, rope, mHC) */
    double layer_s[2];      /* per layer of a forward pass, per role, whatever its tokens: the floor of
                             * that layer's kernels (launch, ramp and tail of each) at a small batch;
                             * optional in the file ("layer_prefill_s", "layer_decode_s"), 0 when absent */
    double fp4_memory;      /* share of the memory factor reached by FP4 weights on a card that
                             * dequantises them in software (W4A16 kernels such as Marlin on
                             * Hopper); optional ("fp4_memory"), 1 when absent */
    double mtp_acceptance;  /* probability the MTP draft token is accepted */
    double request_s;       /* fixed cost of one request on the PD path beyond its steps and hand-off:
                             * the proxy, the HTTP exchanges with prefill and decode, tokenisation,
                             * admission, the transfer's control messages (part of TTFT) */
};

struct pd_hardware {
    char name[64];
    char source[256];
    char card_name[64];
    int cluster_nodes;
    int cards_per_node;
    int64_t card_memory_bytes;
    double mem_bw_Bps, bf16_flops, int8_ops, fp8_flops;
    struct pd_link intra, rdma, tcp;
    int64_t runtime_prefill_bytes, runtime_decode_bytes;
    int redundant_experts;  /* the serving stack can hold redundant expert copies (EPLB); default 1 */
    struct pd_efficiency eff;
};

int pd_hardware_load(const char *spec, struct pd_hardware *h, pd_err *e);
/* Whether the cards are Huawei's Ascend NPUs (by the card's name), whose serving stacks are
 * vllm-ascend's and SGLang's Ascend builds. */
int pd_hardware_is_ascend(const struct pd_hardware *h);
/* The family of the cards, for matching published runs (validate.h): "Ascend", "NVIDIA" (a card
 * or system named as NVIDIA's data-centre parts are: A100, H20, H100, H200, H800, B200, B300, GB200,
 * HGX, DGX), or NULL for anything else (a CPU file of pdmoe calibrate's, a card of another make). */
const char *pd_hardware_family(const struct pd_hardware *h);
int pd_hardware_parse(const char *text, const char *label, struct pd_hardware *h, pd_err *e);

#endif

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
};

int pd_hardware_load(const char *spec, struct pd_hardware *h, pd_err *e);
int pd_hardware_parse(const char *text, const char *label, struct pd_hardware *h, pd_err *e);

#endif

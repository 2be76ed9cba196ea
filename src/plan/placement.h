/* Expert placement in one expert-parallel group of `ep` ranks: without redundancy rank k
 * holds experts [k*E/ep, (k+1)*E/ep); with R redundant experts every rank holds (E+R)/ep
 * slots: its contiguous primaries, then replicas: with a load, of the expert with the most
 * tokens per copy onto the least-loaded rank lacking it (a hot expert may get several), by
 * expert id onto the emptiest rank otherwise; never two copies of one expert on one rank. */
#ifndef PD_PLAN_PLACEMENT_H
#define PD_PLAN_PLACEMENT_H

#include <stdint.h>

#include "core/err.h"

struct pd_placement {
    int ep;            /* ranks */
    int n_experts;     /* E */
    int redundant;     /* R */
    int slots;         /* (E + R) / ep expert slots per rank */
    int *map;          /* [ep][slots]: the expert id held in each slot */
};

/* load: NULL, or [n_experts] relative loads used to choose the replicas. */
int pd_placement_build(struct pd_placement *p, int n_experts, int ep, int redundant,
                       const double *load, pd_err *e);
void pd_placement_free(struct pd_placement *p);
/* Rank holding expert e's primary copy. */
int pd_placement_owner(const struct pd_placement *p, int expert);
/* The busiest rank's expert load over the mean, averaged over layers: load is [n_layers]
 * [n_experts] tokens routed, an expert's replicas share its load evenly; layers without tokens
 * count for nothing. 0 when no layer has any. */
double pd_placement_imbalance(const struct pd_placement *p, const double *load, int n_layers);
/* Bytes of class I weights on a rank: sum of expert_bytes[] over its slots. */
int64_t pd_placement_rank_bytes(const struct pd_placement *p, int rank, const int64_t *expert_bytes);

#endif

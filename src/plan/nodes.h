/* Which instance runs where: a plan's layout on its nodes, the one node map that every launcher
 * follows (`pdmoe plan --emit vllm-ascend|sglang|pdmoe`, `pdmoe up --hosts`, the plan's JSON).
 *
 * Prefill instances take the first nodes in order, decode the following ones (decode never shares
 * a node with prefill); an instance smaller than a node shares it with the next instance of the
 * same role (each gets its own cards, and its own ports: slot); an instance larger than a node
 * spans cards/cards_per_node whole nodes, each holding whole data-parallel ranks. */
#ifndef PD_PLAN_NODES_H
#define PD_PLAN_NODES_H

#include "core/err.h"
#include "plan/plan.h"

#include <jansson.h>

/* One command: an instance's share of one node. */
struct pd_node_part {
    enum pd_role role;
    int inst;               /* index within its role */
    int id;                 /* engine_id: prefill instances first, then decode */
    int node, head;         /* this node, and the instance's first node */
    int k, n;               /* node k of the instance's n nodes */
    int card0, ncards;      /* the cards it uses on this node */
    int slot;               /* instances before it on its node: each per-node port moves up one step per slot */
    int dp_start, dp_local; /* its data-parallel ranks on this node */
};

struct pd_node_layout {
    struct pd_node_part *parts;
    int n_parts, nodes;
    int first[2], last[2];  /* nodes of each role */
    int kv_base, kv_step;   /* vllm-ascend kv_port of instance id: kv_base + kv_step * id */
};

/* The nodes of cpn cards that whole instances take, by pd_nodes_build's own placement: role r has
 * instances[r] instances of dp[r] x tp[r] cards (aggregated: role 1 only); -1 when an instance
 * larger than a node does not split into whole nodes of whole data-parallel ranks. The search
 * keeps only layouts whose count fits the cluster, so that every layout it ranks can be placed. */
int pd_nodes_needed(int cpn, const int dp[2], const int tp[2], const int instances[2], int aggregated);

/* The layout of p on its nodes (L->parts malloc'ed: pd_nodes_free); PD_EINVAL when an instance
 * larger than a node does not split into whole nodes of whole data-parallel ranks, PD_ENOFIT when
 * the layout needs more nodes than the plan's --nodes. */
int pd_nodes_build(const struct pd_plan *p, struct pd_node_layout *L, pd_err *e);
void pd_nodes_free(struct pd_node_layout *L);

/* Nodes the layout occupies. */
int pd_emit_nodes(const struct pd_plan *p, int *nodes, pd_err *e);

/* The node map as the plan's JSON carries it ("node_map"): one entry per instance, {"role",
 * "instance", "nodes": [node...], "ranks": [data-parallel ranks on each node]}; NULL, e saying
 * why, when the layout cannot be placed (the plan's JSON then carries "node_map_error"). */
json_t *pd_nodes_json(const struct pd_plan *p, pd_err *e);

#endif

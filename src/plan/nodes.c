/* The node assignment of a plan's layout (nodes.h). */
#include "plan/nodes.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

/* The walk that places whole instances on nodes of cpn cards, role by role (decode from a node of
 * its own), an instance smaller than a node beside the ones before it, a larger one over whole
 * nodes of whole data-parallel ranks: the nodes it takes, and with L the parts, each role's first
 * and last node. The instances must split (pd_nodes_needed and pd_nodes_build check). */
static int place(int cpn, const int dp[2], const int tp[2], const int instances[2], int aggregated,
                 struct pd_node_layout *L)
{
    int node = 0, off = 0, slot = 0, id = 0;
    if (L) {
        L->first[PD_ROLE_PREFILL] = 0;
        L->last[PD_ROLE_PREFILL] = -1;
    }
    for (int r = aggregated ? PD_ROLE_DECODE : PD_ROLE_PREFILL; r < 2; r++) {
        const int cards = dp[r] * tp[r];
        if (off > 0) {   /* decode starts on a node of its own */
            node++;
            off = slot = 0;
        }
        if (L)
            L->first[r] = node;
        for (int i = 0; i < instances[r]; i++, id++) {
            if (cards <= cpn) {
                if (off + cards > cpn) {
                    node++;
                    off = slot = 0;
                }
                if (L)
                    L->parts[L->n_parts++] = (struct pd_node_part){
                        .role = (enum pd_role)r, .inst = i, .id = id, .node = node, .head = node, .k = 0, .n = 1,
                        .card0 = off, .ncards = cards, .slot = slot, .dp_start = 0, .dp_local = dp[r]};
                off += cards;
                slot++;
                if (off == cpn) {
                    node++;
                    off = slot = 0;
                }
            } else {
                if (off > 0) {
                    node++;
                    off = slot = 0;
                }
                int n = cards / cpn, local = cpn / tp[r];
                for (int k = 0; L && k < n; k++)
                    L->parts[L->n_parts++] = (struct pd_node_part){
                        .role = (enum pd_role)r, .inst = i, .id = id, .node = node + k, .head = node, .k = k, .n = n,
                        .card0 = 0, .ncards = cpn, .slot = 0, .dp_start = k * local, .dp_local = local};
                node += n;
            }
        }
        if (L)
            L->last[r] = off > 0 ? node : node - 1;
    }
    return node + (off > 0);
}

int pd_nodes_needed(int cpn, const int dp[2], const int tp[2], const int instances[2], int aggregated)
{
    for (int r = aggregated ? 1 : 0; r < 2; r++)
        if (dp[r] * tp[r] > cpn && ((dp[r] * tp[r]) % cpn || cpn % tp[r]))
            return -1;
    return place(cpn, dp, tp, instances, aggregated, NULL);
}

int pd_nodes_build(const struct pd_plan *p, struct pd_node_layout *L, pd_err *e)
{
    int cpn = p->hw.cards_per_node, total = 0, max_cards = 1;
    memset(L, 0, sizeof *L);
    const int r0 = p->o.aggregated ? PD_ROLE_DECODE : PD_ROLE_PREFILL;   /* aggregated: one set of instances */
    for (int r = r0; r < 2; r++) {
        const struct pd_role_plan *rp = &p->role[r];
        int cards = rp->o.dp * rp->o.tp;
        if (cards > cpn && cards % cpn)
            return pd_err_set(e, PD_EINVAL, "%s instances of %d cards (dp %d x tp %d) would split unevenly over "
                              "nodes of %d cards: an instance larger than a node must fill whole nodes",
                              pd_role_name((enum pd_role)r), cards, rp->o.dp, rp->o.tp, cpn);
        if (cards > cpn && cpn % rp->o.tp)
            return pd_err_set(e, PD_EINVAL, "%s tp %d does not divide a node's %d cards: a data-parallel rank "
                              "would straddle two nodes", pd_role_name((enum pd_role)r), rp->o.tp, cpn);
        total += rp->o.instances * (cards > cpn ? cards / cpn : 1);
        if (cards > max_cards)
            max_cards = cards;
    }
    L->parts = calloc((size_t)total, sizeof *L->parts);
    if (!L->parts)
        return pd_err_set(e, PD_ENOMEM, "out of memory");
    L->nodes = place(cpn, (const int[2]){p->role[0].o.dp, p->role[1].o.dp},
                     (const int[2]){p->role[0].o.tp, p->role[1].o.tp},
                     (const int[2]){p->role[0].o.instances, p->role[1].o.instances}, p->o.aggregated, L);
    assert(L->n_parts == total);
    /* vllm-ascend's PD guide: AscendDirectTransport takes ports in [20000, 20000 + 1000 x NPUs per
     * node), so kv_port must lie above; each instance listens on kv_port + its ranks. The
     * DeepSeek-V4-Flash tutorial's 30000, 30100, ... satisfies both for 8-card nodes. */
    L->kv_base = 20000 + 1000 * cpn > 30000 ? 20000 + 1000 * cpn : 30000;
    L->kv_step = 100 * ((max_cards + 99) / 100);
    if (L->nodes > p->nodes) {
        pd_nodes_free(L);
        return pd_err_set(e, PD_ENOFIT, "placing whole instances on nodes of %d cards needs %d nodes but the "
                          "cluster has %d (--nodes)", cpn, L->nodes, p->nodes);
    }
    return 0;
}

int pd_emit_nodes(const struct pd_plan *p, int *nodes, pd_err *e)
{
    struct pd_node_layout L;
    int rc = pd_nodes_build(p, &L, e);
    if (rc)
        return rc;
    *nodes = L.nodes;
    free(L.parts);
    return 0;
}


void pd_nodes_free(struct pd_node_layout *L)
{
    free(L->parts);
    L->parts = NULL;
}

json_t *pd_nodes_json(const struct pd_plan *p, pd_err *e)
{
    struct pd_node_layout L;
    if (pd_nodes_build(p, &L, e))
        return NULL;
    json_t *map = json_array();
    json_t *inst = NULL, *nodes = NULL, *ranks = NULL;
    for (int i = 0; map && i < L.n_parts; i++) {
        const struct pd_node_part *x = &L.parts[i];
        if (x->k == 0) {
            nodes = json_array();
            ranks = json_array();
            inst = json_pack("{s:s,s:i,s:o,s:o}", "role", pd_role_name(x->role), "instance", x->inst, "nodes", nodes,
                             "ranks", ranks);
            if (!inst || json_array_append_new(map, inst)) {
                json_decref(map);
                map = NULL;
                break;
            }
        }
        json_array_append_new(nodes, json_integer(x->node));
        json_array_append_new(ranks, json_integer(x->dp_local));
    }
    pd_nodes_free(&L);
    return map;
}

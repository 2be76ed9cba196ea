/* How the planner groups weights, the way the seed article does, and the two classes:
 * class I (routed experts, split across an expert-parallel group) and class II (everything
 * else, a full copy on every card). */
#ifndef PD_PLAN_GROUPS_H
#define PD_PLAN_GROUPS_H

enum pd_group {
    PD_G_EMBEDDING, PD_G_LM_HEAD, PD_G_ATTENTION, PD_G_COMPRESSOR, PD_G_SHARED_EXPERT,
    PD_G_DENSE_FFN, PD_G_ROUTER, PD_G_NORMS_MHC, PD_G_MTP, PD_G_ROUTED_EXPERTS,
    PD_G_COUNT
};

enum pd_class { PD_CLASS_I = 0, PD_CLASS_II = 1 };

const char *pd_group_name(enum pd_group g);    /* "embedding", "routed_experts", ... */
const char *pd_group_title(enum pd_group g);   /* "Embedding", "Routed experts", ... */
int pd_group_parse(const char *s, enum pd_group *g);
/* Groups tensor parallelism splits across the tp ranks of a DP rank (vocabulary-parallel
 * embedding and head, column/row-parallel attention and FFN); the rest is replicated. */
int pd_group_tp_split(enum pd_group g);

#endif

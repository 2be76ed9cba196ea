/* Expert -> rank maps for expert-parallel groups, with optional redundant experts. */
#include "plan/placement.h"

#include <stdlib.h>
#include <string.h>

int pd_placement_owner(const struct pd_placement *p, int expert)
{
    /* primaries are contiguous: rank k starts at floor(k*E/ep) */
    int64_t r = ((int64_t)expert * p->ep + p->ep - 1) / p->n_experts;
    while (r > 0 && (int64_t)r * p->n_experts / p->ep > expert)
        r--;
    while (r + 1 < p->ep && (int64_t)(r + 1) * p->n_experts / p->ep <= expert)
        r++;
    return (int)r;
}

/* Replicas placed by load, as EPLB does within pdmoe's fixed primaries: each goes to the expert
 * with the most tokens per copy that some rank with room lacks (ties: lower id), onto the rank
 * with room that lacks it and carries the fewest tokens (an expert's copies share its tokens;
 * ties: fewer slots used, lower rank). A hot expert may so get several replicas. Every rank with
 * room lacks some expert (slots <= experts), so all R are placed; -1 only without memory. */
static int replicas_by_load(struct pd_placement *p, int *used, const double *load)
{
    int E = p->n_experts, ep = p->ep, S = p->slots;
    int *copies = calloc((size_t)E, sizeof *copies);
    char *holds = calloc((size_t)ep * (size_t)E, 1), *full = calloc((size_t)E, 1);
    double *rank = malloc((size_t)ep * sizeof *rank);
    if (!copies || !holds || !full || !rank) {
        free(copies);
        free(holds);
        free(full);
        free(rank);
        return -1;
    }
    for (int k = 0; k < ep; k++)
        for (int s = 0; s < used[k]; s++) {
            copies[p->map[k * S + s]]++;
            holds[(size_t)k * E + p->map[k * S + s]] = 1;
        }
    for (int placed = 0; placed < p->redundant; placed++) {
        for (int k = 0; k < ep; k++) {
            rank[k] = 0;
            for (int s = 0; s < used[k]; s++)
                rank[k] += load[p->map[k * S + s]] / copies[p->map[k * S + s]];
        }
        /* the expert with the most tokens per copy that a rank with room lacks; an expert every
         * rank with room holds stays so (ranks only fill up) */
        int bx, bk;
        for (;;) {
            bx = -1;
            for (int x = 0; x < E; x++)
                if (!full[x] && (bx < 0 || load[x] / copies[x] > load[bx] / copies[bx]))
                    bx = x;
            bk = -1;
            for (int k = 0; k < ep; k++)
                if (used[k] < S && !holds[(size_t)k * E + bx] &&
                    (bk < 0 || rank[k] < rank[bk] || (rank[k] == rank[bk] && used[k] < used[bk])))
                    bk = k;
            if (bk >= 0)
                break;
            full[bx] = 1;
        }
        p->map[bk * S + used[bk]++] = bx;
        holds[(size_t)bk * E + bx] = 1;
        copies[bx]++;
    }
    free(copies);
    free(holds);
    free(full);
    free(rank);
    return 0;
}

int pd_placement_build(struct pd_placement *p, int n_experts, int ep, int redundant,
                       const double *load, pd_err *e)
{
    memset(p, 0, sizeof *p);
    if (ep < 1 || n_experts < 1 || redundant < 0)
        return pd_err_set(e, PD_EINVAL, "placement: EP size %d, %d experts, %d redundant: all must be positive",
                          ep, n_experts, redundant);
    if ((n_experts + redundant) % ep) {
        if (redundant == 0)
            return pd_err_set(e, PD_EINVAL,
                              "placement: %d routed experts do not divide evenly over an EP group of %d ranks; "
                              "choose an EP size that divides %d, or add redundant experts (redundant=R in --prefill/--decode, "
                              "with %d + R divisible by %d)",
                              n_experts, ep, n_experts, n_experts, ep);
        return pd_err_set(e, PD_EINVAL,
                          "placement: %d experts + %d redundant = %d slots do not divide evenly over %d ranks",
                          n_experts, redundant, n_experts + redundant, ep);
    }
    int slots = (n_experts + redundant) / ep;
    if (redundant > 0 && slots > n_experts)
        return pd_err_set(e, PD_EINVAL, "placement: %d redundant experts leave a rank with more slots (%d) than there are experts (%d)",
                          redundant, slots, n_experts);
    p->ep = ep;
    p->n_experts = n_experts;
    p->redundant = redundant;
    p->slots = slots;
    p->map = malloc((size_t)ep * (size_t)slots * sizeof *p->map);
    int *used = calloc((size_t)ep, sizeof *used);
    if (!p->map || !used) {
        free(used);
        pd_placement_free(p);
        return pd_err_set(e, PD_ENOMEM, "placement: out of memory");
    }
    for (int k = 0; k < ep; k++) {
        int lo = (int)((int64_t)k * n_experts / ep), hi = (int)((int64_t)(k + 1) * n_experts / ep);
        for (int x = lo; x < hi; x++)
            p->map[k * slots + used[k]++] = x;
    }
    if (load) {
        if (replicas_by_load(p, used, load)) {
            free(used);
            pd_placement_free(p);
            return pd_err_set(e, PD_ENOMEM, "placement: out of memory");
        }
    } else {
        /* replicas by expert id, each to the emptiest rank that lacks it */
        int placed = 0;
        for (int i = 0; placed < redundant && i < redundant + 2 * n_experts; i++) {
            int x = i % n_experts, best = -1;
            for (int k = 0; k < ep; k++) {
                if (used[k] >= slots)
                    continue;
                int has = 0;
                for (int s = 0; s < used[k]; s++)
                    has |= p->map[k * slots + s] == x;
                if (!has && (best < 0 || used[k] < used[best]))
                    best = k;
            }
            if (best < 0)
                continue;   /* every rank with room holds x already: try the next expert */
            p->map[best * slots + used[best]++] = x;
            placed++;
        }
    }
    for (int k = 0; k < ep; k++)
        if (used[k] != slots) {
            free(used);
            pd_placement_free(p);
            return pd_err_set(e, PD_EINVAL, "placement: cannot fill %d slots per rank without duplicate experts", slots);
        }
    free(used);
    return 0;
}

void pd_placement_free(struct pd_placement *p)
{
    free(p->map);
    memset(p, 0, sizeof *p);
}

int64_t pd_placement_rank_bytes(const struct pd_placement *p, int rank, const int64_t *expert_bytes)
{
    int64_t b = 0;
    for (int s = 0; s < p->slots; s++)
        b += expert_bytes[p->map[rank * p->slots + s]];
    return b;
}

double pd_placement_imbalance(const struct pd_placement *p, const double *load, int n_layers)
{
    int E = p->n_experts, *copies = calloc((size_t)E, sizeof *copies);
    if (!copies)
        return 0;
    for (int i = 0; i < p->ep * p->slots; i++)
        copies[p->map[i]]++;
    double sum = 0;
    int counted = 0;
    for (int l = 0; l < n_layers; l++) {
        const double *x = load + (size_t)l * E;
        double total = 0, busiest = 0;
        for (int i = 0; i < E; i++)
            total += x[i];
        if (total <= 0)
            continue;
        for (int k = 0; k < p->ep; k++) {
            double r = 0;
            for (int s = 0; s < p->slots; s++) {
                int i = p->map[k * p->slots + s];
                r += x[i] / copies[i];
            }
            busiest = r > busiest ? r : busiest;
        }
        sum += busiest / (total / p->ep);
        counted++;
    }
    free(copies);
    return counted ? sum / counted : 0;
}

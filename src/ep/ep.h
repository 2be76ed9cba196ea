/* Expert parallelism across processes (MPI). An EP group of N ranks: rank k holds routed experts
 * [k*E/N, (k+1)*E/N) of every MoE layer, the MTP layer's included (the planner's placement, the
 * same code) and a full copy of everything else. Each rank runs attention for its own sequences (data-parallel attention); in every MoE
 * layer the ranks exchange, with MPI_Alltoallv:
 *   counts    how many (token, expert) pairs each rank sends each other rank;
 *   dispatch  per pair the expert id and the token's activation row, int8 with its fp32 scale:
 *             exactly what the expert would read locally (activations are quantised once, on
 *             the rank that owns the token), so results are bit-identical to one process;
 *   combine   the expert's fp32 output row, back to the origin rank, which sums its tokens'
 *             expert outputs in increasing expert id order (the engine's fixed order).
 * A rank's pairs for its own experts skip MPI: their rows go straight to the experts' input and
 * their outputs straight back to the pairs.
 * All ranks take every step together; a rank with no tokens still takes part with empty sends.
 * The group's collectives use MPI's default error handler: a rank that dies ends the job with
 * MPI's report of which rank failed, instead of hanging the others. */
#ifndef PD_EP_EP_H
#define PD_EP_EP_H

#include <mpi.h>
#include <stdint.h>

#include "core/err.h"
#include "engine/engine.h"
#include "plan/placement.h"

struct pd_ep {
    MPI_Comm comm;
    int rank, size;
    int n_experts, top_k, hidden;
    struct pd_placement place;     /* expert -> rank */
    int *owner;                    /* [experts] the rank that runs each expert */
    unsigned char *has_expert;     /* [experts] 1 for the experts held here */
    /* exchange buffers, grown as needed */
    char *sbuf, *rbuf;
    size_t scap, rcap;
    float *out, *back;
    size_t ocap, bcap;
    int8_t *rq;                    /* received rows unpacked: int8 [R, hidden] */
    float *rscale;                 /* [R] */
    int32_t *rexpert, *rrow;       /* [R] */
    size_t rqcap, rscap, recap, rrcap;
    int *scnt, *rcnt, *sdsp, *rdsp, *sb, *rb, *sbd, *rbd; /* [size] counts and displacements */
    int *order;                    /* send slot -> pair */
    size_t ordcap;
    /* statistics */
    double t_exchange;             /* seconds inside the three collectives */
    double t_counts, t_pack, t_dispatch, t_combine, t_scatter;   /* its parts (seconds): the counts
                                    * exchange, packing the records, the dispatch exchange, the
                                    * combine exchange, scattering the rows back to their pairs */
    int64_t bytes_sent;            /* dispatch + combine bytes sent to other ranks */
    int64_t exchanges;             /* MoE layers exchanged */
    int sync_before_combine;       /* benchmarks: a barrier (not timed) before the combine, so
                                    * t_exchange leaves out waiting for the slowest rank's experts */
};

/* A group over `comm` for model m (redundant experts: 0 for now). */
int pd_ep_init(struct pd_ep *ep, MPI_Comm comm, const struct pd_model *m, pd_err *e);
/* Waits for a non-blocking MPI operation, sleeping between tests instead of spinning. */
int pd_ep_wait(MPI_Request *req);

/* Routes the engine's routed experts through the group. */
void pd_ep_attach(struct pd_ep *ep, struct pd_engine *en);
void pd_ep_free(struct pd_ep *ep);

#endif

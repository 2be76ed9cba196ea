/* Expert parallelism across processes (MPI). An EP group of N ranks: rank k holds routed experts
 * [k*E/N, (k+1)*E/N) of every MoE layer, the MTP layer's included (the planner's placement, the
 * same code) and a full copy of everything else. Each rank runs attention for its own sequences
 * (data-parallel attention); in every MoE layer the ranks exchange, point to point (MPI_Isend /
 * MPI_Irecv on the group's communicator, tags PD_EP_TAG_*: nothing else in the group uses
 * point-to-point messages):
 *   counts    how many (token, expert) pairs each rank sends each other rank;
 *   dispatch  per pair the expert id and the row's fp32 scale (one message), and the token's
 *             int8 activation row (another, received straight into the matrix the expert GEMM
 *             reads): exactly what the expert would read locally (activations are quantised
 *             once, on the rank that owns the token), so results are bit-identical to one process;
 *   combine   the expert's fp32 output rows, back to the origin rank in the order they came (one
 *             message per peer, sent from where the experts wrote them), copied there to their
 *             (token, slot) rows; the origin sums its tokens' expert outputs in increasing expert
 *             id order (the engine's fixed order).
 * A rank's pairs for its own experts never go through MPI: the experts run on its rows and the
 * received ones in one grouped pass and write its own pairs' outputs where the engine reads them.
 * Receives are posted before sends (the combine's before the experts run); sends complete in the
 * background and are finished at the next exchange, before their buffers are written again.
 * Waits spin while messages move and sleep only after 100 us without progress
 * (pd_ep_waitall).
 * All ranks take every step together; a rank with no tokens still takes part (the counts; no
 * message of zero pairs is sent). The group's communicator keeps MPI's default error handler: a
 * rank that dies ends the job with MPI's report of which rank failed, instead of hanging the
 * others. */
#ifndef PD_EP_EP_H
#define PD_EP_EP_H

#include <mpi.h>
#include <stdint.h>

#include "core/err.h"
#include "engine/engine.h"
#include "plan/placement.h"

/* Message tags of the exchange. */
enum { PD_EP_TAG_COUNT = 0x4550, PD_EP_TAG_META, PD_EP_TAG_ROWS, PD_EP_TAG_OUT };

/* What a dispatched pair carries besides its row. */
struct pd_ep_meta {
    int32_t expert;
    float scale;
};

struct pd_ep {
    MPI_Comm comm;
    int rank, size;
    int n_experts, top_k, hidden;
    struct pd_placement place;     /* expert -> rank */
    int *owner;                    /* [experts] the rank that runs each expert */
    unsigned char *has_expert;     /* [experts] 1 for the experts held here */
    /* one exchange (P = T * top_k pairs: Pl of them for experts here, Ps sent, R received) */
    int *scnt, *rcnt;              /* [size] pairs sent to / received from each rank (self: Pl) */
    int *soff, *roff;              /* [size] each rank's first send slot / first received row */
    int *cursor;                   /* [size] */
    MPI_Request *req;              /* [2 * size] one phase's receives (and the counts' sends) */
    MPI_Request *creq;             /* [size] the combine's receives */
    MPI_Request *pend;             /* [3 * size] sends still completing (npend), from the last exchange */
    int npend;
    char *sarena, *rarena;         /* the buffers below, carved per exchange, grown as needed */
    size_t sacap, racap;
    struct pd_ep_meta *smeta;      /* [Ps] expert id and row scale per send slot, by destination */
    int8_t *srow;                  /* [Ps, hidden] the rows sent, packed by destination */
    MPI_Aint *sdisp;               /* [Ps] byte offset in the engine's output of each slot's pair */
    struct pd_ep_meta *rmeta;      /* [R] as received, by source */
    int8_t *q;                     /* [T + R, hidden] this rank's token rows, then those received */
    float *scale;                  /* [T + R] their scales */
    int32_t *row, *expert;         /* [Pl + R] the pairs run here: rows of q, expert ids */
    float **dst;                   /* [Pl + R] where each pair's output goes */
    float *out;                    /* [R, hidden] the outputs of the received pairs, by source */
    /* statistics */
    double t_exchange;             /* seconds in the exchange: all of it but the experts */
    int64_t bytes_sent;            /* dispatch + combine bytes sent to other ranks */
    int64_t exchanges;             /* MoE layers exchanged */
    int64_t sleeps;                /* waits of the exchange that slept (no progress for EP_SPIN_S) */
    int sync_before_combine;       /* benchmarks: a barrier (not timed) before the combine, so
                                    * t_exchange leaves out waiting for the slowest rank's experts */
};

/* A group over `comm` for model m (redundant experts: 0 for now). */
int pd_ep_init(struct pd_ep *ep, MPI_Comm comm, const struct pd_model *m, pd_err *e);
/* Waits for a non-blocking MPI operation, sleeping between tests instead of spinning (idle
 * ranks between steps). */
int pd_ep_wait(MPI_Request *req);
/* Completes n requests of an exchange: spins on MPI_Testall for up to spin_s seconds, then
 * sleeps between tests as pd_ep_wait does. */
int pd_ep_waitall(int n, MPI_Request *req, double spin_s);

/* Routes the engine's routed experts through the group. */
void pd_ep_attach(struct pd_ep *ep, struct pd_engine *en);
void pd_ep_free(struct pd_ep *ep);

#endif

/* Expert parallelism across processes (MPI). An EP group of N ranks: rank k holds routed experts
 * [k*E/N, (k+1)*E/N) of every MoE layer, the MTP layer's included (the planner's placement, the
 * same code) and a full copy of everything else. Each rank runs attention for its own sequences
 * (data-parallel attention); in every MoE layer the ranks exchange, point to point (MPI_Isend /
 * MPI_Improbe + MPI_Imrecv / MPI_Irecv on the group's communicator, tags PD_EP_TAG_*: nothing
 * else in the group uses point-to-point messages), one message per peer each way:
 *   dispatch  to each peer, a head {pairs, rows, sender}, per pair its expert id and row, per
 *             row the token's fp32 scale, zeros to a whole row, then the tokens' int8 activation
 *             rows, each token's once however many of its experts the peer holds (the head alone
 *             for no pairs). The receiver matches it first (MPI_Improbe: its size says how many
 *             pairs, so no counts message goes ahead of it) and takes it whole into the matrix
 *             the expert GEMM reads, its rows on whole rows of it: exactly what the expert would
 *             read locally (activations are quantised once, on the rank that owns the token), so
 *             results are bit-identical to one process;
 *   combine   the expert's fp32 output rows, back to the origin rank in the order they came (one
 *             message per peer that sent pairs, sent from where the experts wrote them), left
 *             where they land: the engine reads each pair's output through a pointer (experts_fn's
 *             `out`), so a received row is not copied again; the origin sums its tokens' expert
 *             outputs in increasing expert id order (the engine's fixed order).
 * A rank's pairs for its own experts never go through MPI: the experts run on its rows and the
 * received ones in one grouped pass and write its own pairs' outputs where the engine reads them.
 * The combine's receives are posted once the rank's own combine is sent (ep.c says why); sends
 * complete in the background and are finished at the next exchange, before their buffers are
 * written again.
 * Buffers grow and are kept: no allocation per exchange once they fit. Waits spin while
 * messages move and sleep only after 100 us without progress (pd_ep_waitall); a sleep watches a
 * connection when one is set (pd_ep_watch: a rank's to rank 0, whose death MPI does not report).
 * All ranks take every step together; a rank with no tokens still takes part (its dispatch
 * messages carry the head alone). The group's communicator keeps MPI's default error handler: a
 * rank that dies ends the job with MPI's report of which rank failed, instead of hanging the
 * others. */
#ifndef PD_EP_EP_H
#define PD_EP_EP_H

#include <mpi.h>
#include <stdatomic.h>
#include <stdint.h>

#include "core/err.h"
#include "engine/engine.h"
#include "plan/placement.h"

/* Message tags of the exchange. */
enum { PD_EP_TAG_DISPATCH = 0x4551, PD_EP_TAG_OUT };

/* The start of a dispatch message (ep.c: its layout). */
struct pd_ep_head {
    int32_t pairs;   /* (token, expert) pairs it carries */
    int32_t rows;    /* distinct tokens among them: activation rows it carries */
    int32_t rank;    /* the sender */
    int32_t zero;
};

/* A dispatched pair: its expert and which of the message's rows it reads. */
struct pd_ep_meta {
    int32_t expert;
    int32_t row;
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
    int *soff;                     /* [size] each peer's dispatch message in sbuf, in rows of hidden bytes */
    int *roff;                     /* [size] each source's first received pair (packing: scratch) */
    int *cursor;                   /* [size] each destination's first pair in `back` (the combine's receive) */
    int *rbase;                    /* [size] each source's message in q, in rows after this rank's T
                                    * (packing: scratch) */
    int *mbytes;                   /* [size] the bytes of each source's dispatch message */
    int *srows;                    /* [size] distinct tokens sent to each rank */
    int *last;                     /* [size] scratch */
    MPI_Message *msg;              /* [size] each source's dispatch message, matched, not yet received */
    MPI_Request *req;              /* [size] the dispatch's receives */
    MPI_Request *creq;             /* [size] the combine's receives */
    MPI_Request *pend;             /* [3 * size] sends still completing (npend), from the last exchange */
    int npend;
    char *sarena, *rarena, *parena; /* the buffers below, carved per exchange, grown as needed */
    size_t sacap, racap, pacap;
    char *sbuf;                    /* the dispatch messages, by destination (ep.c: their layout) */
    int32_t *spair;                /* [Ps] each pair sent, by destination in send order: its index p */
    int8_t *q;                     /* [T + rows, hidden] this rank's token rows, then the messages received */
    float *scale;                  /* [T + rows] the rows' scales */
    int32_t *row, *expert;         /* [Pl + R] the pairs run here: rows of q, expert ids */
    float **dst;                   /* [Pl + R] where each pair's output goes */
    float *out;                    /* [R, hidden] the outputs of the received pairs, by source */
    /* statistics */
    double t_exchange;             /* seconds in the exchange: all of it but the experts */
    int64_t bytes_sent;            /* dispatch + combine bytes sent to other ranks */
    int64_t exchanges;             /* MoE layers exchanged */
    _Atomic int64_t exchanged_ns;  /* when the last exchange completed (pd_now_ns): another thread
                                    * sees the group's progress (a server's watchdog, /health) */
    int64_t sleeps;                /* waits of the exchange that slept (no progress for EP_SPIN_S) */
    int sync_before_combine;       /* benchmarks: a barrier (not timed) before the combine, so
                                    * t_exchange leaves out waiting for the slowest rank's experts */
};

/* A group over `comm` for model m (redundant experts: 0 for now). */
int pd_ep_init(struct pd_ep *ep, MPI_Comm comm, const struct pd_model *m, pd_err *e);
/* The watch of this process's waits: once set, every wait below that has reached its sleeping
 * phase (never the spin of a fast exchange: no syscall is added to it) sleeps in ppoll() on fd for
 * its end (POLLRDHUP, POLLHUP, POLLERR: the peer's close or a reset; bytes to read do not wake it)
 * instead of nanosleep(), and on that end calls gone(arg) once, which is to end the process (a
 * rank whose rank 0 died: MPI would wait for mpirun's SIGKILL, seconds later). If gone returns,
 * the wait goes on, unwatched. fd -1 clears the watch (before fd is closed, or when the peer's
 * close becomes a normal end). The server sets it (src/pd/server_ep_live.c): the ep layer knows
 * only an fd and a function. */
void pd_ep_watch(int fd, void (*gone)(void *arg), void *arg);
/* Waits for a non-blocking MPI operation, sleeping between tests instead of spinning (idle
 * ranks between steps). */
int pd_ep_wait(MPI_Request *req);
/* Completes n requests of an exchange: spins on MPI_Testall for up to spin_s seconds, then
 * sleeps between tests as pd_ep_wait does. */
int pd_ep_waitall(int n, MPI_Request *req, double spin_s);

/* Routes the engine's routed experts through the group. */
void pd_ep_attach(struct pd_ep *ep, struct pd_engine *en);
void pd_ep_free(struct pd_ep *ep);

/* MPI_Init_thread and MPI_Finalize of a rank. Under AddressSanitizer, LeakSanitizer's check runs
 * in pd_ep_finalize, before MPI_Finalize rather than at exit: a group stopped through its mpirun
 * (Ctrl-C, SIGTERM) never gets out of MPI_Finalize, whose last exchange goes through an mpirun
 * that only waits to SIGKILL its ranks; and Open MPI dlcloses its plugins in there, after which
 * what they still hold is reported in "<unknown module>", which no suppression can name. What Open
 * MPI allocates on this thread inside MPI_Init_thread is left out of the check: it loses a few
 * blocks there (strings asprintf'ed in libc, whose frames lose the stack above them at the default
 * fast unwinding, so no suppression naming Open MPI's files, tests/lsan.supp, matches them). pdmoe
 * allocates nothing in there: it registers no MPI callback (error handler, user op, attribute or
 * generalized request). */
void pd_ep_mpi_init(int *argc, char ***argv, int required, int *provided);
void pd_ep_finalize(void);

#endif

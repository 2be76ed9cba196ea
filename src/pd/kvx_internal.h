/* What the KV transfer engine's files share (not a public API: kvxfer.h is the contract):
 * kvxfer.c: the public API, leases and transfers' bookkeeping; kvx_wire.c: the messages (sending
 * them, handling what arrives: GET_META -> META, the gets, DONE/ABORT -> ACK); kvx_progress.c:
 * UCX's callbacks and the state machine that acts on what they recorded. Everything here runs
 * under the engine's lock (x->mu) unless it says otherwise. */
#ifndef PD_PD_KVX_INTERNAL_H
#define PD_PD_KVX_INTERNAL_H

#include "pd/kvxfer.h"
#include "core/net.h"
#include <assert.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include "core/timing.h"




#define KVX_VERSION 2
#define KVX_DEFAULT_MS 30000
#define KVX_MSG_SMALL 40      /* GET_META, DONE, ABORT */
#define KVX_MSG_ACK 24
#define KVX_META_FIXED 40
#define KVX_MAX_RUNS (1 << 22)
/* How long destroy waits for queued messages (an ABORT, a last ACK) and in-flight gets to
 * drain before it force-closes the endpoints. */
#define KVX_DRAIN_NS 1000000000LL

struct lease {
    struct lease *next;
    struct pd_kvx_key key;
    uint64_t owner;           /* the offerer's number, for its callback */
    int claimed;              /* a GET_META with the key claimed it: only that pull goes on */
    uint64_t claim_tag;       /* the claimant's transfer tag */
    struct pd_kvx_run *runs;  /* merged, in sequence order */
    int n;
    int64_t deadline;         /* ns, pd_now_ns() clock */
    pd_kvx_release_fn cb;
    void *arg;
    enum pd_kvx_release why;  /* set when released */
};

/* A connection: outgoing (we connected to a producer; cached for later pulls) or accepted.
 * An outgoing one has two endpoints to the same producer worker: `ep`, made from the socket
 * address, which needs TCP to connect (UCX 1.13's only connection manager here) and carries the
 * first GET_META; `data`, made from the worker address META brings, which may use every
 * transport both sides have (shared memory on one host, RDMA or TCP between hosts) and carries
 * the gets and every later message. */
struct link {
    struct link *next;
    struct pd_kvx *x;
    ucp_ep_h ep;              /* NULL once closed */
    ucp_ep_h data;            /* outgoing only; NULL until the first META, or once closed */
    int outgoing;
    char host[64];
    int port;
    int failed;               /* the error handler fired */
    ucs_status_t status;
    int refs;                 /* unfinished transfers using it */
    int reused;               /* kept and handed to a later transfer: its producer may have
                                 restarted since it was opened (kvx_xfer_retry) */
    /* the producer's rkey, unpacked once (rkey_get): the link holds a reference while
     * link_rkey_ref, each transfer one from its META until its gets are flushed */
    ucp_rkey_h rkey;
    int rkey_refs, link_rkey_ref;
    uint8_t *rkey_packed;
    size_t rkey_packed_len;
};

struct pd_kvx_xfer {
    struct pd_kvx_xfer *next;
    struct pd_kvx *x;
    struct pd_kvx_key key;
    uint64_t tag;
    struct link *peer;
    char host[64];
    int port;
    struct pd_kvx_run *dst;   /* merged */
    int n_dst;
    enum pd_kvx_state state;
    int meta_ok;              /* META accepted: the producer holds a lease for us */
    int gets_posted, done_sent;
    int outstanding;          /* UCX requests in flight: the flush after the gets */
    ucs_status_t get_status;  /* error of the gets' flush */
    ucp_rkey_h rkey;
    int64_t deadline;
    uint64_t gets;
    int fail_code;            /* != 0: failing; becomes FAILED when nothing is in flight */
    int send_abort;           /* tell the producer to drop the lease when failing */
    int free_when_final;
    int refused;              /* the producer refused the key (unknown or refused) */
    int retried;              /* moved once to a new connection (kvx_xfer_retry) */
    int retry_wanted;         /* its GET_META was not delivered: kvx_xfer_retry at the next
                                 progress, outside UCX's callback */
    char reason[400];
};

/* A received active message, copied out of UCX's buffer. */
struct msg {
    struct msg *next;
    unsigned id;
    ucp_ep_h reply_ep;
    size_t len;
    uint8_t data[];
};

/* A message being sent: the buffer must live until UCX completes the send. */
struct sendop {
    struct pd_kvx *x;
    unsigned id;
    uint64_t tag;
    uint8_t data[];
};

struct closing {
    struct closing *next;
    void *req;
};

struct pd_kvx {
    pthread_mutex_t mu;
    ucp_context_h ctx;
    ucp_worker_h w;
    ucp_listener_h listener;
    ucp_mem_h memh;
    void *rkey_buf;
    size_t rkey_len;
    ucp_address_t *addr;      /* this worker's address, sent in META */
    size_t addr_len;
    int efd;
    uint8_t *base;
    size_t len;
    int port;
    int64_t lease_ns, timeout_ns;
    int kv_dtype;             /* the region's KV format, sent in META (opts.kv_dtype) */
    struct lease *leases, *released;
    struct link *links;
    struct pd_kvx_xfer *xfers;
    struct msg *inbox, **inbox_tail;
    struct closing *closing;
    uint64_t next_tag;
    int sends_pending;
    int sleepers;             /* threads asleep in poll() on efd */
    int destroying;
    int events;               /* bumped by callbacks, read by step() */
    struct pd_kvx_stats st;
};

/* ---------------------------------------------------------------- little-endian packing */

static inline void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static inline void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint32_t get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)p[i] << (8 * i);
    return v;
}

static inline uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}


/* ---------------------------------------------------------------- shared between the files */

/* kvxfer.c */
int kvx_is_final(enum pd_kvx_state s);
/* Merges runs that continue each other (and drops empty ones) so each contiguous piece of the
 * byte stream costs one get. Returns the merged count; out may be `in` (merging in place). */
int kvx_merge_runs(const struct pd_kvx_run *in, int n, struct pd_kvx_run *out);
void kvx_xfer_fail(struct pd_kvx_xfer *t, int code, int send_abort, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
struct pd_kvx_xfer *kvx_find_xfer(struct pd_kvx *x, uint64_t tag);
struct lease *kvx_find_lease(struct pd_kvx *x, const uint8_t id[16]);
/* Moves a held lease to the released list; its callback runs later without the lock. */
void kvx_lease_release(struct pd_kvx *x, struct lease *l, enum pd_kvx_release why);

/* kvxfer.c */
/* The kept connection to host:port, or a new one (status and an unresolvable address in *st and
 * *resolve_failed). NULL only when out of memory. */
struct link *kvx_get_link(struct pd_kvx *x, const char *host, int port, ucs_status_t *st, int *resolve_failed);
/* A transfer whose kept connection failed before its producer answered (the producer restarted
 * since the connection was opened: the first pull after every restart failed on it, "Endpoint
 * timeout"): moved once to a new connection, GET_META sent again under a new tag. 1 if it was
 * moved (or failed moving), 0 if it is not such a transfer (the caller fails it). */
int kvx_xfer_retry(struct pd_kvx *x, struct pd_kvx_xfer *t);
/* Whether t is such a transfer (kvx_xfer_retry would move it). */
int kvx_xfer_may_retry(const struct pd_kvx_xfer *t);

/* kvx_wire.c */
ucs_status_t kvx_send_small(struct pd_kvx *x, ucp_ep_h ep, unsigned id,
                               const struct pd_kvx_key *key, uint64_t tag);
void kvx_rkey_put(struct link *l);
/* A transfer gives its reference back. */
void kvx_xfer_rkey_put(struct pd_kvx_xfer *t);
void kvx_handle_msg(struct pd_kvx *x, struct msg *m, int64_t now);

/* kvx_progress.c */
/* Registers the handlers of the five active messages on x's worker (each records the message). */
ucs_status_t kvx_set_am_handlers(struct pd_kvx *x);
void kvx_on_sent(struct pd_kvx *x, unsigned id, uint64_t tag, ucs_status_t st);
void kvx_send_done(void *req, ucs_status_t st, void *user_data);
/* Completion of the flush that follows a transfer's gets: all of them have landed (or failed). */
void kvx_gets_flushed(void *req, ucs_status_t st, void *user_data);
void kvx_ep_error(void *arg, ucp_ep_h ep, ucs_status_t st);
void kvx_on_conn_request(ucp_conn_request_h cr, void *arg);
int kvx_link_alive(const struct link *l);
/* Messages to a producer go over the data endpoint once there is one: it may be shared memory
 * where the socket-address endpoint is TCP, and the replies come back the same way. */
ucp_ep_h kvx_msg_ep(const struct link *l);
/* Moves a transfer on once nothing of it is in flight. */
void kvx_advance(struct pd_kvx *x, struct pd_kvx_xfer *t);
/* Closes both endpoints of a link, the data one (where the rkeys were unpacked) first. */
void kvx_close_ep(struct pd_kvx *x, struct link *l);
/* Gives back the references of idle transfers on l and the link's own: UCX wants rkeys gone
 * before their endpoint (transfers still flushing give theirs back when the flush completes). */
void kvx_drop_idle_rkeys(struct pd_kvx *x, struct link *l);
int64_t kvx_next_deadline(struct pd_kvx *x);
void kvx_free_xfer(struct pd_kvx_xfer *t);
/* Progresses UCX once, then acts. Lock held. */
int kvx_progress_locked(struct pd_kvx *x);

#endif

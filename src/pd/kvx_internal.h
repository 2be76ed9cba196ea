/* What the KV transfer engine's files share (not a public API: kvxfer.h is the contract):
 * kvxfer.c: the public API, leases and transfers' bookkeeping; kvx_wire.c: the messages (sending
 * them, handling what arrives: GET_META -> META, the gets or READ -> DATA, DONE/ABORT -> ACK); kvx_progress.c:
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




#define KVX_VERSION 3
#define KVX_DEFAULT_MS 30000
#define KVX_MSG_SMALL 40      /* GET_META, DONE, ABORT; READ's fixed part */
#define KVX_DATA_HDR 16       /* DATA's AM header: the transfer's tag, the piece's index */
/* The largest piece a producer pushes in one DATA: UCX assembles each message whole in a buffer
 * of its own before the consumer's handler copies it into place. */
#define KVX_PIECE_MAX (1u << 20)
#define KVX_MSG_ACK 24
#define KVX_META_FIXED 40
#define KVX_MAX_RUNS (1 << 22)
/* How long destroy waits for queued messages (an ABORT, a last ACK) and in-flight gets to
 * drain before it force-closes the endpoints. */
#define KVX_DRAIN_NS 1000000000LL
/* A kept link idle this long is checked (a HELLO again) when a pull reuses it: a producer
 * restarted on its port meanwhile has another worker (kvx_boot.c). Busier links are not: no
 * server restarts within it. */
#define KVX_CHECK_IDLE_NS 100000000LL
/* How often a busy progress loop looks for connections to the KV listener (a sleeping one wakes
 * on them): an accept4() per progress call cost a tight loop a quarter of its hand-off speed. */
#define KVX_ACCEPT_EVERY_NS 1000000LL
/* How long a HELLO may take: a producer answers within milliseconds, from its own progress
 * thread; a connection that stays silent (a host gone dark, a port that is not a KV listener)
 * fails its link and its transfers, which recompute, instead of holding them to their timeout. */
#define KVX_HELLO_NS 5000000000LL
/* How long a META may take after its GET_META went out, for the same reason: the producer answers
 * from its progress thread, whatever its scheduler is doing. A pull whose link was made to a
 * producer that died as the link came up (its HELLO read, the endpoint never wired: UCX's keepalive
 * does not watch it) waited for its whole timeout, kv_timeout_ms (30 s), before its prompt was
 * recomputed: a client's stream held that long (supervise, under AddressSanitizer). */
#define KVX_META_NS 5000000000LL
/* The largest worker address a HELLO carries (kvx_boot.c; UCX's are a few hundred bytes). */
#define KVX_HELLO_ADDR_MAX 4096

struct lease {
    struct lease *next;
    struct pd_kvx_key key;
    uint64_t owner;           /* the offerer's number, for its callback */
    int claimed;              /* a GET_META with the key claimed it: only that pull goes on */
    uint64_t claim_tag;       /* the claimant's transfer tag */
    int pushed;               /* its claimant's READ came: the data went out (once) */
    struct pd_kvx_run *runs;  /* merged, in sequence order */
    int n;
    int64_t deadline;         /* ns, pd_now_ns() clock */
    pd_kvx_release_fn cb;
    void *arg;
    enum pd_kvx_release why;  /* set when released */
};

/* A connection to a producer (cached for later pulls). It has two endpoints to the same producer
 * worker, both made from its worker address: `ep` from the HELLO its KV listener sends
 * (kvx_boot.c), which carries the first GET_META; `data` from the address META brings, which
 * carries the gets and every later message. Until the HELLO is whole, `bfd` is the socket it
 * arrives on and `ep` is NULL. A pull that reuses a link idle for KVX_CHECK_IDLE_NS asks for a
 * HELLO again while its GET_META goes out on `ep` (bfd >= 0 with ep set): another address, or
 * none, means the producer restarted or died, and the link fails (its transfers move to a new
 * one, kvx_xfer_retry). */
struct link {
    struct link *next;
    struct pd_kvx *x;
    ucp_ep_h ep;              /* NULL once closed */
    ucp_ep_h data;            /* NULL until the first META, or once closed */
    int outgoing;
    int bfd;                  /* the HELLO's socket while it arrives, else -1 */
    uint8_t *hello;           /* what has arrived of it (12 + KVX_HELLO_ADDR_MAX bytes) */
    size_t hello_have;
    uint8_t *paddr;           /* the producer's worker address `ep` was made from */
    size_t paddr_len;
    int64_t heard_ns;         /* its last HELLO or META: the producer was there then */
    int64_t hello_by;         /* while bfd >= 0: when a HELLO that has not come fails the link */
    /* transfers that failed before the HELLO came and asked to ABORT: their GET_META and ABORT
     * go out once it has (the producer ends only a lease that a GET_META claimed) */
    struct kvx_deferred {
        struct pd_kvx_key key;
        uint64_t tag;
    } *deferred;
    int n_deferred;
    char host[64];
    int port;
    struct sockaddr_storage addr;   /* an outgoing link's resolved address (another spelling of it,
                                       "127.0.0.01", finds this link: one was kept per spelling) */
    socklen_t addr_len;
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
    int gets_posted, done_sent;   /* gets_posted: the gets or the READ went out */
    int outstanding;          /* UCX requests in flight: the flush after the gets */
    /* Pushed transfers (the producer's region is not mapped here, kvx_wire.c): the pieces the
     * READ asked for, in its order, and how many have not landed. */
    struct kvx_piece {
        uint64_t src, dst, len;
        int landed;
    } *pieces;
    uint64_t n_pieces, pieces_left;
    ucs_status_t get_status;  /* error of the gets' flush */
    ucp_rkey_h rkey;
    int64_t deadline;
    uint64_t gets;
    int fail_code;            /* != 0: failing; becomes FAILED when nothing is in flight */
    int send_abort;           /* tell the producer to drop the lease when failing */
    int free_when_final;
    int refused;              /* the producer refused the key (unknown or refused) */
    int retried;              /* moved once to a new connection (kvx_xfer_retry) */
    int meta_sent;            /* its GET_META went out (0 while its link waits for the HELLO) */
    int64_t meta_by;          /* once it did: when a META that has not come fails it (KVX_META_NS) */
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

/* The DATA a producer sends for one READ: their AM headers live until the last send completes
 * (UCX 1.13 may read a header after ucp_am_send_nbx returns). */
struct push {
    struct push *next;        /* in x->pushes */
    struct pd_kvx *x;
    uint64_t left;            /* sends not completed */
    uint8_t id[16];           /* the lease's, and its claimant's tag */
    uint64_t tag;
    int failed;               /* a send completed in error: the consumer is gone (step() ends the
                                 lease now, not at its expiry) */
    uint8_t hdr[][KVX_DATA_HDR];
};

struct pd_kvx {
    pthread_mutex_t mu;
    ucp_context_h ctx;
    ucp_worker_h w;
    int lfd;                  /* the KV listener's socket (kvx_boot.c), or -1 */
    uint8_t *hello;           /* the HELLO it writes to every connection, hello_len bytes */
    size_t hello_len;
    int64_t accept_at;        /* when step() next looks for connections on it (ns) */
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
    struct push *pushes;      /* producer: every push with a DATA send not completed, and those
                                 completed since step() last ran (it frees them) */
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
/* Registers the handlers of the protocol's active messages on x's worker (each records the
 * message, but DATA, copied into place at once). */
ucs_status_t kvx_set_am_handlers(struct pd_kvx *x);
void kvx_on_sent(struct pd_kvx *x, unsigned id, uint64_t tag, ucs_status_t st);
void kvx_send_done(void *req, ucs_status_t st, void *user_data);
/* Completion of one DATA send (user_data: its struct push). */
void kvx_push_done(void *req, ucs_status_t st, void *user_data);
/* Completion of the flush that follows a transfer's gets: all of them have landed (or failed). */
void kvx_gets_flushed(void *req, ucs_status_t st, void *user_data);
void kvx_ep_error(void *arg, ucp_ep_h ep, ucs_status_t st);
/* host:port as a socket address (passive: to bind); the error names both. */
int kvx_resolve(const char *host, int port, int passive, struct sockaddr_storage *ss, socklen_t *len, pd_err *e);
/* kvx_boot.c: the KV listener's HELLO (producer) and its reading (consumer). */
int kvx_boot_listen(struct pd_kvx *x, const char *host, int port, pd_err *e);
int kvx_boot_serve(struct pd_kvx *x);
int kvx_boot_connect(struct link *l, const struct sockaddr *sa, socklen_t len);
int kvx_boot_progress(struct pd_kvx *x);
void kvx_boot_close(struct link *l);
/* Frees a link that nothing refers to, with its HELLO's state. */
void kvx_link_free(struct link *l);
/* Remembers t's ABORT until its link's HELLO has come (0), or says it cannot (-1: no memory). */
int kvx_boot_defer_abort(struct link *l, const struct pd_kvx_xfer *t);
/* The fds a sleeping thread should also wake for (the listener, HELLOs on their way) into fds,
 * at most max: their number, or -1 when there are more. */
int kvx_boot_fds(struct pd_kvx *x, struct pollfd *fds, int max);
/* Sends t's GET_META on its link's endpoint (t->meta_sent), failing t if it cannot. */
void kvx_xfer_send_get_meta(struct pd_kvx *x, struct pd_kvx_xfer *t);
int kvx_link_alive(const struct link *l);
/* Messages to a producer go over the data endpoint once there is one (the HELLO's endpoint
 * itself, unless META named another worker), and the replies come back the same way. */
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

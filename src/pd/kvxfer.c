/* KV transfer engine on UCX (protocol and message formats in kvxfer.h).
 *
 * Owns: the UCP context, worker, listener and endpoints of one process; the registered KV region
 * and its packed rkey; the producer's leases; the consumer's transfers.
 *
 * UCX calls back (active messages, send/get completions, endpoint errors, connection requests)
 * only from inside ucp_worker_progress(), which runs under the engine's lock. Callbacks record
 * what happened (queue the message, count the completion, flag the endpoint) and step() acts on
 * it after progress returns: replies and gets are never issued from inside a UCX callback, and
 * endpoints are closed only after the messages they delivered have been handled.
 *
 * Invariants (asserted where they must hold):
 *   - a transfer is DONE only when its gets have landed (their flush completed) and it gave back
 *     its reference on the link's rkey; FAILED either the same way, or once its producer's
 *     endpoints are closed, so that nothing still in flight can write into the destination any
 *     more;
 *   - a transfer holds a reference on its outgoing link until it is DONE or FAILED;
 *   - a link's rkey (unpacked once, shared by its transfers) is destroyed when the link and the
 *     last transfer flushing on it have let it go, before the link is freed;
 *   - a lease is in exactly one of x->leases (held) or x->released (callback pending). */
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

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)p[i] << (8 * i);
    return v;
}

static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* ---------------------------------------------------------------- small helpers */

static int is_final(enum pd_kvx_state s)
{
    return s == PD_KVX_FAILED || s == PD_KVX_DONE;
}

const char *pd_kvx_state_name(enum pd_kvx_state s)
{
    switch (s) {
    case PD_KVX_FAILED: return "FAILED";
    case PD_KVX_BOOTSTRAPPING: return "BOOTSTRAPPING";
    case PD_KVX_WAITING: return "WAITING";
    case PD_KVX_TRANSFERRING: return "TRANSFERRING";
    case PD_KVX_DONE: return "DONE";
    }
    return "?";
}

const char *pd_kvx_release_name(enum pd_kvx_release r)
{
    switch (r) {
    case PD_KVX_REL_DONE: return "done";
    case PD_KVX_REL_ABORT: return "abort";
    case PD_KVX_REL_EXPIRED: return "expired";
    case PD_KVX_REL_DESTROY: return "destroy";
    }
    return "?";
}

enum pd_kvx_state pd_kvx_state_min(const enum pd_kvx_state *s, int n)
{
    enum pd_kvx_state m = PD_KVX_DONE;
    for (int i = 0; i < n; i++)
        if (s[i] < m)
            m = s[i];
    return m;
}

/* Merges runs that continue each other (and drops empty ones) so each contiguous piece of the
 * byte stream costs one get. Returns the merged count; out may be `in` (merging in place). */
static int merge_runs(const struct pd_kvx_run *in, int n, struct pd_kvx_run *out)
{
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (in[i].len == 0)
            continue;
        if (m > 0 && out[m - 1].off + out[m - 1].len == in[i].off)
            out[m - 1].len += in[i].len;
        else
            out[m++] = in[i];
    }
    return m;
}

/* Checks runs against a region of `len` bytes; on success sets *total to their byte sum. */
static int check_runs(const struct pd_kvx_run *r, int n, size_t len, uint64_t *total,
                      const char *what, pd_err *e)
{
    if (n <= 0 || n > KVX_MAX_RUNS)
        return pd_err_set(e, PD_EINVAL, "%s: %d runs (want 1..%d)", what, n, KVX_MAX_RUNS);
    uint64_t sum = 0;
    for (int i = 0; i < n; i++) {
        if (r[i].len == 0 || r[i].off > len || r[i].len > len - r[i].off)
            return pd_err_set(e, PD_EINVAL,
                              "%s: run %d (offset %llu, %llu bytes) outside the %zu-byte region",
                              what, i, (unsigned long long)r[i].off,
                              (unsigned long long)r[i].len, len);
        sum += r[i].len;
    }
    *total = sum;
    return 0;
}

static void xfer_fail(struct pd_kvx_xfer *t, int code, int send_abort, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Marks t failing (the first reason wins); it becomes FAILED in advance() once nothing of it
 * is in flight. */
static void xfer_fail(struct pd_kvx_xfer *t, int code, int send_abort, const char *fmt, ...)
{
    if (t->fail_code || is_final(t->state))
        return;
    t->fail_code = code;
    t->send_abort = send_abort;
    /* the id's first 8 digits name the transfer; the rest of the secret stays out of messages */
    char id[PD_KVX_ID_HEX];
    pd_kvx_id_format(&t->key, id);
    int n = snprintf(t->reason, sizeof t->reason, "kvxfer: transfer %.8s... from %s:%d: ", id,
                     t->host, t->port);
    if (n < 0 || (size_t)n >= sizeof t->reason)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->reason + n, sizeof t->reason - (size_t)n, fmt, ap);
    va_end(ap);
}

static struct pd_kvx_xfer *find_xfer(struct pd_kvx *x, uint64_t tag)
{
    for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next)
        if (t->tag == tag)
            return t;
    return NULL;
}

static struct lease *find_lease(struct pd_kvx *x, const uint8_t id[16])
{
    for (struct lease *l = x->leases; l; l = l->next)
        if (memcmp(l->key.id, id, sizeof l->key.id) == 0)
            return l;
    return NULL;
}

/* Moves a held lease to the released list; its callback runs later without the lock. */
static void lease_release(struct pd_kvx *x, struct lease *l, enum pd_kvx_release why)
{
    struct lease **pp = &x->leases;
    while (*pp != l)
        pp = &(*pp)->next;
    *pp = l->next;
    l->why = why;
    l->next = x->released;
    x->released = l;
    x->st.released[why]++;
}

/* Calls pending release callbacks, outside the lock so they may call back into the engine. */
static void run_releases(struct pd_kvx *x)
{
    pthread_mutex_lock(&x->mu);
    struct lease *l = x->released;
    x->released = NULL;
    pthread_mutex_unlock(&x->mu);
    while (l) {
        struct lease *next = l->next;
        if (l->cb)
            l->cb(l->arg, l->owner, l->why);
        free(l->runs);
        free(l);
        l = next;
    }
}

/* ---------------------------------------------------------------- UCX callbacks */

static ucs_status_t am_recv(struct pd_kvx *x, unsigned id, void *data, size_t length,
                            const ucp_am_recv_param_t *param)
{
    /* Every sender forces the eager protocol; a rendezvous message is not ours. */
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)
        return UCS_ERR_UNSUPPORTED;
    struct msg *m = malloc(sizeof *m + length);
    if (!m)
        return UCS_OK;   /* dropped: the peer's timeout or the lease expiry covers it */
    m->next = NULL;
    m->id = id;
    m->reply_ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : NULL;
    m->len = length;
    memcpy(m->data, data, length);
    *x->inbox_tail = m;
    x->inbox_tail = &m->next;
    x->events++;
    return UCS_OK;
}

#define AM_HANDLER(name, ID)                                                                  \
    static ucs_status_t name(void *arg, const void *header, size_t header_length, void *data, \
                             size_t length, const ucp_am_recv_param_t *param)                 \
    {                                                                                         \
        return am_recv(arg, ID, data, length, param);                                         \
    }
AM_HANDLER(am_get_meta, PD_KVX_AM_GET_META)
AM_HANDLER(am_meta, PD_KVX_AM_META)
AM_HANDLER(am_done, PD_KVX_AM_DONE)
AM_HANDLER(am_abort, PD_KVX_AM_ABORT)
AM_HANDLER(am_ack, PD_KVX_AM_ACK)

static void on_sent(struct pd_kvx *x, unsigned id, uint64_t tag, ucs_status_t st)
{
    x->events++;
    if (id != PD_KVX_AM_GET_META)
        return;
    struct pd_kvx_xfer *t = find_xfer(x, tag);
    if (!t || is_final(t->state))
        return;
    if (st != UCS_OK)
        xfer_fail(t, PD_EIO, 0, "GET_META not delivered: %s", ucs_status_string(st));
    else if (t->state == PD_KVX_BOOTSTRAPPING)
        t->state = PD_KVX_WAITING;
}

static void send_done(void *req, ucs_status_t st, void *user_data)
{
    struct sendop *s = user_data;
    s->x->sends_pending--;
    on_sent(s->x, s->id, s->tag, st);
    free(s);
    ucp_request_free(req);
}

/* Completion of the flush that follows a transfer's gets: all of them have landed (or failed). */
static void gets_flushed(void *req, ucs_status_t st, void *user_data)
{
    struct pd_kvx_xfer *t = user_data;
    assert(t->outstanding > 0);
    t->outstanding--;
    if (st != UCS_OK && t->get_status == UCS_OK)
        t->get_status = st;
    ucp_request_free(req);
    t->x->events++;
}

static void ep_error(void *arg, ucp_ep_h ep, ucs_status_t st)
{
    struct link *l = arg;
    if (!l->failed) {
        l->failed = 1;
        l->status = st;
    }
    l->x->events++;
}

static void on_conn_request(ucp_conn_request_h cr, void *arg)
{
    struct pd_kvx *x = arg;
    struct link *l = x->destroying ? NULL : calloc(1, sizeof *l);
    if (!l) {
        ucp_listener_reject(x->listener, cr);
        return;
    }
    l->x = x;
    ucp_ep_params_t p = {
        .field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .conn_request = cr,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = ep_error, .arg = l},
    };
    if (ucp_ep_create(x->w, &p, &l->ep) != UCS_OK) {
        free(l);
        return;
    }
    l->next = x->links;
    x->links = l;
    x->events++;
}

/* ---------------------------------------------------------------- sending */

/* Sends one message (copied); returns 0 or the UCX error. Completion reaches on_sent(). */
static ucs_status_t send_msg(struct pd_kvx *x, ucp_ep_h ep, unsigned id, uint64_t tag,
                             const uint8_t *buf, size_t len)
{
    struct sendop *s = malloc(sizeof *s + len);
    if (!s)
        return UCS_ERR_NO_MEMORY;
    s->x = x;
    s->id = id;
    s->tag = tag;
    memcpy(s->data, buf, len);
    /* Requests ask for the reply endpoint; eager only, so the receiver always gets the bytes
     * in its callback (no rendezvous descriptor to fetch). */
    uint32_t flags = UCP_AM_SEND_FLAG_EAGER;
    if (id == PD_KVX_AM_GET_META || id == PD_KVX_AM_DONE || id == PD_KVX_AM_ABORT)
        flags |= UCP_AM_SEND_FLAG_REPLY;
    ucp_request_param_t p = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS,
        .cb.send = send_done,
        .user_data = s,
        .flags = flags,
    };
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, NULL, 0, s->data, len, &p);
    if (r == NULL) {
        free(s);
        on_sent(x, id, tag, UCS_OK);
        return UCS_OK;
    }
    if (UCS_PTR_IS_ERR(r)) {
        free(s);
        return UCS_PTR_STATUS(r);
    }
    x->sends_pending++;
    return UCS_OK;
}

static ucs_status_t send_small(struct pd_kvx *x, ucp_ep_h ep, unsigned id,
                               const struct pd_kvx_key *key, uint64_t tag)
{
    uint8_t b[KVX_MSG_SMALL];
    put32(b, KVX_VERSION);
    put32(b + 4, 0);
    put64(b + 8, tag);
    memcpy(b + 16, key->id, sizeof key->id);
    put64(b + 32, key->hash);
    return send_msg(x, ep, id, tag, b, sizeof b);
}

static void send_ack(struct pd_kvx *x, ucp_ep_h ep, int status, uint64_t tag, unsigned acked)
{
    uint8_t b[KVX_MSG_ACK];
    put32(b, KVX_VERSION);
    put32(b + 4, (uint32_t)status);
    put64(b + 8, tag);
    put32(b + 16, acked);
    put32(b + 20, 0);
    /* A lost ACK only costs the consumer its timeout; nothing to undo here. */
    send_msg(x, ep, PD_KVX_AM_ACK, 0, b, sizeof b);
}

static void send_meta(struct pd_kvx *x, ucp_ep_h ep, int status, uint64_t tag,
                      const struct lease *l)
{
    uint32_t n = l ? (uint32_t)l->n : 0;
    uint32_t rk = l ? (uint32_t)x->rkey_len : 0;
    uint32_t ad = l ? (uint32_t)x->addr_len : 0;
    size_t len = KVX_META_FIXED + ad + rk + 16 * (size_t)n;
    uint8_t *b = malloc(len);
    if (!b)
        return;
    put32(b, KVX_VERSION);
    put32(b + 4, (uint32_t)status);
    put64(b + 8, tag);
    put64(b + 16, (uint64_t)(uintptr_t)x->base);
    put32(b + 24, rk);
    put32(b + 28, n);
    put32(b + 32, ad);
    put32(b + 36, (uint32_t)x->kv_dtype);
    if (ad)
        memcpy(b + KVX_META_FIXED, x->addr, ad);
    if (rk)
        memcpy(b + KVX_META_FIXED + ad, x->rkey_buf, rk);
    uint8_t *p = b + KVX_META_FIXED + ad + rk;
    for (uint32_t i = 0; i < n; i++, p += 16) {
        put64(p, l->runs[i].off);
        put64(p + 8, l->runs[i].len);
    }
    if (send_msg(x, ep, PD_KVX_AM_META, 0, b, len) == UCS_OK && l)
        x->st.metas_served++;
    free(b);
}

/* ---------------------------------------------------------------- handling messages */

/* The data endpoint of an outgoing link, made on the first META from the producer's worker
 * address (the same for every later META of that producer). */
static ucs_status_t data_ep(struct pd_kvx *x, struct link *l, const uint8_t *addr, size_t len)
{
    if (l->data)
        return UCS_OK;
    /* the address is only read during ucp_ep_create; copy it for alignment */
    ucp_address_t *a = malloc(len);
    if (!a)
        return UCS_ERR_NO_MEMORY;
    memcpy(a, addr, len);
    ucp_ep_params_t p = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .address = a,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = ep_error, .arg = l},
    };
    ucs_status_t st = ucp_ep_create(x->w, &p, &l->data);
    free(a);
    if (st != UCS_OK)
        l->data = NULL;
    return st;
}

/* The producer's rkey for a transfer on l, unpacked on the first META only: unpacking a
 * shared-memory rkey attaches the producer's segment, which per transfer would cost a new
 * mapping and a page fault for every page read. A producer's region and its key never change,
 * so a META whose key differs from the first is refused. */
static ucp_rkey_h rkey_get(struct link *l, const uint8_t *packed, size_t len, ucs_status_t *st)
{
    if (l->rkey && (len != l->rkey_packed_len || memcmp(packed, l->rkey_packed, len) != 0)) {
        *st = UCS_ERR_INVALID_PARAM;
        return NULL;
    }
    if (!l->rkey) {   /* then no reference is left either */
        uint8_t *copy = malloc(len);
        if (!copy) {
            *st = UCS_ERR_NO_MEMORY;
            return NULL;
        }
        if ((*st = ucp_ep_rkey_unpack(l->data, packed, &l->rkey)) != UCS_OK) {
            l->rkey = NULL;
            free(copy);
            return NULL;
        }
        memcpy(copy, packed, len);
        l->x->st.rkeys_unpacked++;
        l->rkey_packed = copy;
        l->rkey_packed_len = len;
        l->rkey_refs = 1;
        l->link_rkey_ref = 1;
    }
    l->rkey_refs++;
    *st = UCS_OK;
    return l->rkey;
}

static void rkey_put(struct link *l)
{
    assert(l->rkey_refs > 0);
    if (--l->rkey_refs == 0) {
        ucp_rkey_destroy(l->rkey);
        l->rkey = NULL;
        free(l->rkey_packed);
        l->rkey_packed = NULL;
        l->rkey_packed_len = 0;
    }
}

/* A transfer gives its reference back. */
static void xfer_rkey_put(struct pd_kvx_xfer *t)
{
    if (t->rkey) {
        rkey_put(t->peer);
        t->rkey = NULL;
    }
}

/* One get per piece of the byte stream that is contiguous on both sides, then one flush: the
 * gets carry no callback (their requests are released at once), so a transfer costs one
 * completion whatever its number of runs. */
static void post_gets(struct pd_kvx *x, struct pd_kvx_xfer *t, uint64_t base,
                      const struct pd_kvx_run *src, int ns)
{
    ucp_ep_h ep = t->peer->data;
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH, .memh = x->memh};
    int i = 0, j = 0;
    uint64_t a = 0, b = 0;
    while (i < ns && j < t->n_dst) {
        uint64_t n = src[i].len - a;
        if (t->dst[j].len - b < n)
            n = t->dst[j].len - b;
        ucs_status_ptr_t r = ucp_get_nbx(ep, x->base + t->dst[j].off + b, n,
                                         base + src[i].off + a, t->rkey, &p);
        if (UCS_PTR_IS_ERR(r)) {
            xfer_fail(t, PD_EIO, 1, "get of %llu bytes failed: %s", (unsigned long long)n,
                      ucs_status_string(UCS_PTR_STATUS(r)));
            break;
        }
        if (r != NULL)
            ucp_request_free(r);
        t->gets++;
        x->st.gets++;
        x->st.get_bytes += n;
        a += n;
        b += n;
        if (a == src[i].len) {
            i++;
            a = 0;
        }
        if (b == t->dst[j].len) {
            j++;
            b = 0;
        }
    }
    t->gets_posted = 1;
    /* even after a failed get: the ones already posted must land before the transfer ends */
    ucp_request_param_t fp = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        .cb.send = gets_flushed,
        .user_data = t,
    };
    ucs_status_ptr_t r = ucp_ep_flush_nbx(ep, &fp);
    if (UCS_PTR_IS_ERR(r))
        t->get_status = UCS_PTR_STATUS(r);
    else if (r != NULL)
        t->outstanding++;
}

static const char *kv_dtype_name(uint32_t d)
{
    return d == 0 ? "bf16" : d == 1 ? "fp8" : "an unknown format";
}

static void handle_meta(struct pd_kvx *x, const uint8_t *d, size_t len)
{
    if (len < KVX_META_FIXED)
        return;
    struct pd_kvx_xfer *t = find_xfer(x, get64(d + 8));
    if (!t || is_final(t->state) || t->fail_code || t->meta_ok)
        return;
    int status = (int)get32(d + 4);
    if (get32(d) != KVX_VERSION) {
        xfer_fail(t, PD_EFORMAT, 1, "META of protocol version %u (want %d)", get32(d),
                  KVX_VERSION);
        return;
    }
    /* Refusals send no ABORT: the lease, if any, is not ours to end. */
    if (status == PD_KVX_ST_UNKNOWN || status == PD_KVX_ST_REFUSED) {
        t->refused = 1;
        xfer_fail(t, PD_EINVAL, 0, "%s", status == PD_KVX_ST_UNKNOWN
                  ? "unknown transfer id at the producer (never offered, already pulled, released or expired)"
                  : "the producer refused the transfer: its prompt differs from this request's, or another pull "
                    "claimed it");
        return;
    }
    if (status != PD_KVX_ST_OK) {
        xfer_fail(t, PD_EFORMAT, 0, "producer rejected GET_META (status %d)", status);
        return;
    }
    uint64_t base = get64(d + 16);
    uint32_t rk = get32(d + 24), n = get32(d + 28), ad = get32(d + 32), dt = get32(d + 36);
    if (dt != (uint32_t)x->kv_dtype) {
        /* the same prompt's KV in another format: nothing to copy; the lease is ours to end */
        t->meta_ok = 1;
        xfer_fail(t, PD_EINVAL, 1, "KV cache dtype mismatch: the producer stores %s, this instance %s "
                  "(--kv-cache-dtype must be the same on both)", kv_dtype_name(dt), kv_dtype_name((uint32_t)x->kv_dtype));
        return;
    }
    if (n == 0 || n > KVX_MAX_RUNS || ad == 0 ||
        len != KVX_META_FIXED + (uint64_t)ad + rk + 16 * (uint64_t)n) {
        xfer_fail(t, PD_EFORMAT, 1, "malformed META (%zu bytes, %u runs, %u-byte rkey)", len, n,
                  rk);
        return;
    }
    const uint8_t *addr = d + KVX_META_FIXED, *rkey = addr + ad;
    struct pd_kvx_run *src = malloc(n * sizeof *src);
    if (!src) {
        xfer_fail(t, PD_ENOMEM, 1, "no memory for %u runs", n);
        return;
    }
    uint64_t total = 0, want = 0;
    const uint8_t *p = rkey + rk;
    int overflow = 0;
    for (uint32_t i = 0; i < n; i++, p += 16) {
        src[i].off = get64(p);
        src[i].len = get64(p + 8);
        overflow |= total + src[i].len < total;
        total += src[i].len;
    }
    for (int j = 0; j < t->n_dst; j++)
        want += t->dst[j].len;
    t->meta_ok = 1;
    if (overflow) {
        xfer_fail(t, PD_EFORMAT, 1, "malformed META (run lengths overflow)");
        free(src);
        return;
    }
    if (total != want) {
        xfer_fail(t, PD_EINVAL, 1,
                  "size mismatch: the producer holds %llu bytes, the destination runs %llu "
                  "(different block sizes?)",
                  (unsigned long long)total, (unsigned long long)want);
        free(src);
        return;
    }
    ucs_status_t st = data_ep(x, t->peer, addr, ad);
    if (st != UCS_OK) {
        xfer_fail(t, PD_EIO, 1, "cannot reach the producer's worker for data: %s",
                  ucs_status_string(st));
        free(src);
        return;
    }
    t->rkey = rkey_get(t->peer, rkey, rk, &st);
    if (!t->rkey) {
        xfer_fail(t, PD_EIO, 1, "cannot use the producer's rkey: %s", st == UCS_ERR_INVALID_PARAM ?
                  "it differs from the one this connection started with" : ucs_status_string(st));
        free(src);
        return;
    }
    t->state = PD_KVX_TRANSFERRING;
    post_gets(x, t, base, src, (int)merge_runs(src, (int)n, src));
    free(src);
}

static void handle_ack(struct pd_kvx *x, const uint8_t *d, size_t len)
{
    if (len < KVX_MSG_ACK)
        return;
    struct pd_kvx_xfer *t = find_xfer(x, get64(d + 8));
    if (!t || is_final(t->state) || t->fail_code || !t->done_sent ||
        get32(d + 16) != PD_KVX_AM_DONE)
        return;
    if ((int)get32(d + 4) != PD_KVX_ST_OK) {
        /* The lease ended before DONE: the blocks may have been reused while we read them. */
        xfer_fail(t, PD_EIO, 0, "the producer no longer held the lease at DONE (expired?)");
        return;
    }
    assert(t->outstanding == 0 && t->rkey == NULL);
    t->state = PD_KVX_DONE;
    x->st.pulls_done++;
    t->peer->refs--;
}

static void handle_msg(struct pd_kvx *x, struct msg *m, int64_t now)
{
    /* A dying engine answers nothing: its leases end with PD_KVX_REL_DESTROY, so a DONE
     * acknowledged now would vouch for blocks the owner is about to reuse. */
    if (x->destroying)
        return;
    const uint8_t *d = m->data;
    switch (m->id) {
    case PD_KVX_AM_META:
        handle_meta(x, d, m->len);
        return;
    case PD_KVX_AM_ACK:
        handle_ack(x, d, m->len);
        return;
    default:
        break;
    }
    /* Producer side: GET_META, DONE, ABORT; all need somewhere to reply. */
    if (!m->reply_ep)
        return;
    if (m->len != KVX_MSG_SMALL || get32(d) != KVX_VERSION) {
        uint64_t tag = m->len >= 16 ? get64(d + 8) : 0;
        if (m->id == PD_KVX_AM_GET_META)
            send_meta(x, m->reply_ep, PD_KVX_ST_MALFORMED, tag, NULL);
        else
            send_ack(x, m->reply_ep, PD_KVX_ST_MALFORMED, tag, m->id);
        return;
    }
    uint64_t tag = get64(d + 8), hash = get64(d + 32);
    struct lease *l = find_lease(x, d + 16);
    /* Only the key's holder, with the prompt the lease was made for, and only one pull: anything
     * else is refused and the lease stays as it was (with its claimant, on its clock). */
    int status = !l ? PD_KVX_ST_UNKNOWN : l->key.hash != hash ? PD_KVX_ST_REFUSED : PD_KVX_ST_OK;
    if (m->id == PD_KVX_AM_GET_META) {
        if (status == PD_KVX_ST_OK && l->claimed)
            status = PD_KVX_ST_REFUSED;
        if (status == PD_KVX_ST_OK) {
            /* the claimed lease gets a fresh term so a slow transfer is not cut off mid-way */
            l->claimed = 1;
            l->claim_tag = tag;
            l->deadline = now + x->lease_ns;
        }
        send_meta(x, m->reply_ep, status, tag, status == PD_KVX_ST_OK ? l : NULL);
        return;
    }
    /* DONE needs the claim; ABORT may come before META (a consumer giving up early) */
    if (status == PD_KVX_ST_OK && (l->claimed ? l->claim_tag != tag : m->id == PD_KVX_AM_DONE))
        status = PD_KVX_ST_REFUSED;
    if (status == PD_KVX_ST_OK)
        lease_release(x, l, m->id == PD_KVX_AM_DONE ? PD_KVX_REL_DONE : PD_KVX_REL_ABORT);
    send_ack(x, m->reply_ep, status, tag, m->id);
}

/* ---------------------------------------------------------------- state machine */

static int link_alive(const struct link *l)
{
    return l && l->ep && !l->failed;
}

/* Messages to a producer go over the data endpoint once there is one: it may be shared memory
 * where the socket-address endpoint is TCP, and the replies come back the same way. */
static ucp_ep_h msg_ep(const struct link *l)
{
    return l->data ? l->data : l->ep;
}

/* Moves a transfer on once nothing of it is in flight. */
static void advance(struct pd_kvx *x, struct pd_kvx_xfer *t)
{
    if (is_final(t->state))
        return;
    if (t->outstanding) {
        /* In flight on a live endpoint: wait. Once the endpoints are closed nothing can land
         * any more, but UCX 1.13 does not always complete such requests (a flush waiting on a
         * peer that died): the transfer ends and its handle stays until they do, or until
         * destroy. */
        if (!t->fail_code || t->peer->ep || t->peer->data)
            return;
    } else {
        xfer_rkey_put(t);
    }
    if (!t->fail_code && t->gets_posted && !t->done_sent) {
        if (!link_alive(t->peer)) {
            xfer_fail(t, PD_EIO, 0, "connection lost before DONE");
        } else if (t->get_status != UCS_OK) {
            xfer_fail(t, PD_EIO, 1, "get failed: %s", ucs_status_string(t->get_status));
        } else {
            ucs_status_t st = send_small(x, msg_ep(t->peer), PD_KVX_AM_DONE, &t->key, t->tag);
            if (st != UCS_OK)
                xfer_fail(t, PD_EIO, 0, "cannot send DONE: %s", ucs_status_string(st));
            t->done_sent = 1;
        }
    }
    if (!t->fail_code)
        return;
    /* ABORT even before META: a producer that is merely slow then frees the blocks now. */
    if (t->send_abort && link_alive(t->peer))
        send_small(x, msg_ep(t->peer), PD_KVX_AM_ABORT, &t->key, t->tag);
    t->state = PD_KVX_FAILED;
    x->st.pulls_failed++;
    if (t->peer)
        t->peer->refs--;
}

static void close_one(struct pd_kvx *x, ucp_ep_h *ep)
{
    if (!*ep)
        return;
    /* Force: a failed peer cannot confirm a flush. In-flight requests are meant to complete
     * with UCS_ERR_CANCELED here; UCX 1.13 leaves some (see advance()). */
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t r = ucp_ep_close_nbx(*ep, &p);
    *ep = NULL;
    if (r && !UCS_PTR_IS_ERR(r)) {
        struct closing *c = malloc(sizeof *c);
        if (c) {
            c->req = r;
            c->next = x->closing;
            x->closing = c;
        } else {
            ucp_request_free(r);
        }
    }
}

/* Closes both endpoints of a link, the data one (where the rkeys were unpacked) first. */
static void close_ep(struct pd_kvx *x, struct link *l)
{
    close_one(x, &l->data);
    close_one(x, &l->ep);
}

/* Gives back the references of idle transfers on l and the link's own: UCX wants rkeys gone
 * before their endpoint (transfers still flushing give theirs back when the flush completes). */
static void drop_idle_rkeys(struct pd_kvx *x, struct link *l)
{
    for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next)
        if (t->peer == l && t->outstanding == 0)
            xfer_rkey_put(t);
    if (l->link_rkey_ref) {
        l->link_rkey_ref = 0;
        rkey_put(l);
    }
}

static int64_t next_deadline(struct pd_kvx *x)
{
    int64_t d = INT64_MAX;
    for (struct lease *l = x->leases; l; l = l->next)
        if (l->deadline < d)
            d = l->deadline;
    for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next)
        if (!is_final(t->state) && t->deadline < d)
            d = t->deadline;
    return d;
}

static void free_xfer(struct pd_kvx_xfer *t)
{
    free(t->dst);
    free(t);
}

/* Acts on everything the callbacks recorded, then on the clocks. Returns the work done. */
static int step(struct pd_kvx *x)
{
    int n = x->events;
    x->events = 0;
    int64_t now = pd_now_ns();

    /* 1. messages, before any endpoint they came on is closed */
    while (x->inbox) {
        struct msg *m = x->inbox;
        x->inbox = m->next;
        if (!x->inbox)
            x->inbox_tail = &x->inbox;
        handle_msg(x, m, now);
        free(m);
        n++;
    }

    /* 2. timeouts: a transfer with gets in flight takes its connection down with it, so that
     * nothing still in flight can land in the destination once it is reported FAILED */
    for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next) {
        if (is_final(t->state) || t->deadline > now)
            continue;
        if (!t->fail_code) {
            xfer_fail(t, PD_EIO, 1, "timed out after %lld ms in state %s",
                      (long long)(x->timeout_ns / 1000000), pd_kvx_state_name(t->state));
            n++;
        }
        if (t->outstanding && t->peer && !t->peer->failed) {
            t->peer->failed = 1;
            t->peer->status = UCS_ERR_TIMED_OUT;
        }
    }

    /* 3. failed endpoints */
    for (struct link *l = x->links; l; l = l->next) {
        if (!l->failed || !l->ep)
            continue;
        if (l->outgoing)
            for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next)
                if (t->peer == l && !is_final(t->state))
                    xfer_fail(t, PD_EIO, 0, "connection failed: %s",
                              ucs_status_string(l->status));
        drop_idle_rkeys(x, l);
        close_ep(x, l);
        n++;
    }

    /* 4. leases past their deadline */
    for (struct lease *l = x->leases, *next; l; l = next) {
        next = l->next;
        if (l->deadline <= now) {
            lease_release(x, l, PD_KVX_REL_EXPIRED);
            n++;
        }
    }

    /* 5. transfers; then handles given up by their owner */
    for (struct pd_kvx_xfer **pp = &x->xfers; *pp;) {
        struct pd_kvx_xfer *t = *pp;
        enum pd_kvx_state before = t->state;
        advance(x, t);
        if (t->state != before)
            n++;
        if (is_final(t->state) && t->outstanding == 0)
            xfer_rkey_put(t);   /* an abandoned flush finally completed */
        if (is_final(t->state) && t->free_when_final && t->outstanding == 0) {
            *pp = t->next;
            free_xfer(t);
        } else {
            pp = &t->next;
        }
    }

    /* 6. closed endpoints nobody refers to */
    for (struct link **pp = &x->links; *pp;) {
        struct link *l = *pp;
        if (!l->ep && l->refs == 0 && l->rkey_refs == 0) {
            *pp = l->next;
            free(l);
        } else {
            pp = &l->next;
        }
    }

    /* 7. finished endpoint closes */
    for (struct closing **pp = &x->closing; *pp;) {
        struct closing *c = *pp;
        if (ucp_request_check_status(c->req) != UCS_INPROGRESS) {
            ucp_request_free(c->req);
            *pp = c->next;
            free(c);
        } else {
            pp = &c->next;
        }
    }
    return n;
}

/* Progresses UCX once, then acts. Lock held. */
static int progress_locked(struct pd_kvx *x)
{
    int n = (int)ucp_worker_progress(x->w);
    n += step(x);
    /* Another thread asleep on the fd may have been waiting for what we just consumed. */
    if (n && x->sleepers)
        ucp_worker_signal(x->w);
    return n;
}

/* ---------------------------------------------------------------- public API */

static int resolve(const char *host, int port, int passive, struct sockaddr_storage *ss,
                   socklen_t *len, pd_err *e)
{
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0)};
    struct addrinfo *ai = NULL;
    int rc = getaddrinfo(host, ps, &hints, &ai);
    if (rc != 0 || !ai)
        return pd_err_set(e, PD_EINVAL, "kvxfer: cannot resolve %s:%d: %s", host, port,
                          gai_strerror(rc));
    memcpy(ss, ai->ai_addr, ai->ai_addrlen);
    *len = ai->ai_addrlen;
    freeaddrinfo(ai);
    return 0;
}

static int ucx_fail(pd_err *e, const char *what, ucs_status_t st)
{
    return pd_err_set(e, PD_EIO, "kvxfer: %s: %s", what, ucs_status_string(st));
}

int pd_kvx_create(const struct pd_kvx_opts *o, struct pd_kvx **out, pd_err *e)
{
    *out = NULL;
    if (o->region_len == 0)
        return pd_err_set(e, PD_EINVAL, "kvxfer: no region to register");
    if (o->listen_port < -1 || o->listen_port > 65535)
        return pd_err_set(e, PD_EINVAL, "kvxfer: listen port %d out of range", o->listen_port);
    struct pd_kvx *x = calloc(1, sizeof *x);
    if (!x)
        return pd_err_set(e, PD_ENOMEM, "kvxfer: no memory");
    pthread_mutex_init(&x->mu, NULL);
    x->base = o->region;
    x->len = o->region_len;
    x->port = -1;
    x->efd = -1;
    x->lease_ns = (int64_t)(o->lease_ms > 0 ? o->lease_ms : KVX_DEFAULT_MS) * 1000000;
    x->kv_dtype = o->kv_dtype;
    x->timeout_ns = (int64_t)(o->timeout_ms > 0 ? o->timeout_ms : KVX_DEFAULT_MS) * 1000000;
    x->inbox_tail = &x->inbox;
    x->next_tag = 1;

    int rc;
    ucs_status_t st;
    ucp_config_t *cfg = NULL;
    if ((st = ucp_config_read(NULL, NULL, &cfg)) != UCS_OK) {
        rc = ucx_fail(e, "reading the UCX configuration", st);
        goto fail;
    }
    /* The listener and socket-address endpoints need UCX's TCP transport (UCX 1.13 has no
     * other connection manager here): a transport list that names neither tcp nor all, nor
     * excludes anything, gets tcp added. The gets still use what the list asked for. */
    const char *tls = getenv("UCX_TLS");
    if (tls && *tls && tls[0] != '^' && !strstr(tls, "tcp") && !strstr(tls, "all")) {
        char more[256];
        snprintf(more, sizeof more, "%s,tcp", tls);
        if ((st = ucp_config_modify(cfg, "TLS", more)) != UCS_OK) {
            ucp_config_release(cfg);
            rc = ucx_fail(e, "adding tcp to UCX_TLS", st);
            goto fail;
        }
    }
    ucp_params_t cp = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED,
        .features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
        .mt_workers_shared = 0,
    };
    /* Every endpoint reports a dead peer (error mode PEER), and UCX 1.13 only offers its
     * shared-memory transports to such endpoints when they expose their (keepalive-based) error
     * handling; without this the gets fall back to TCP on one host. Set only when the
     * transport list may include them: UCX warns about an unused setting otherwise. */
    if (!tls || !*tls || tls[0] == '^' || strstr(tls, "sm") || strstr(tls, "posix") ||
        strstr(tls, "sysv") || strstr(tls, "mm") || strstr(tls, "all")) {
        if ((st = ucp_config_modify(cfg, "MM_ERROR_HANDLING", "y")) != UCS_OK) {
            ucp_config_release(cfg);
            rc = ucx_fail(e, "enabling shared-memory error handling", st);
            goto fail;
        }
    }
    /* A listener whose port a previous process left in TIME_WAIT (it closed its connections
     * first) must still bind there, as a server restarted at once does; UCX_CM_REUSEADDR set by
     * the user wins. */
    if (!getenv("UCX_CM_REUSEADDR") && (st = ucp_config_modify(cfg, "CM_REUSEADDR", "y")) != UCS_OK) {
        ucp_config_release(cfg);
        rc = ucx_fail(e, "letting the listener reuse its port", st);
        goto fail;
    }
    /* UCX's TCP transport listens on every network interface (besides the listener below): keep
     * its network transports to the interface carrying our address, so the process is reachable
     * there only. UCX_NET_DEVICES set by the user wins (to add an RDMA device, say). */
    if (!getenv("UCX_NET_DEVICES")) {
        struct pd_net_iface dev;
        if ((rc = pd_net_iface_of(o->listen_host ? o->listen_host : "127.0.0.1", "kvxfer: listen address", &dev, e))) {
            ucp_config_release(cfg);
            goto fail;
        }
        if (dev.name[0] && (st = ucp_config_modify(cfg, "NET_DEVICES", dev.name)) != UCS_OK) {
            ucp_config_release(cfg);
            rc = ucx_fail(e, "restricting UCX to the listener's interface", st);
            goto fail;
        }
    }
    st = ucp_init(&cp, cfg, &x->ctx);
    ucp_config_release(cfg);
    if (st != UCS_OK) {
        x->ctx = NULL;
        rc = ucx_fail(e, "ucp_init", st);
        goto fail;
    }
    /* Serialized: the engine's lock orders every call, from whichever thread. */
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    if ((st = ucp_worker_create(x->ctx, &wp, &x->w)) != UCS_OK) {
        x->w = NULL;
        rc = ucx_fail(e, "ucp_worker_create", st);
        goto fail;
    }
    if ((st = ucp_worker_get_address(x->w, &x->addr, &x->addr_len)) != UCS_OK) {
        x->addr = NULL;
        rc = ucx_fail(e, "ucp_worker_get_address", st);
        goto fail;
    }
    if ((st = ucp_worker_get_efd(x->w, &x->efd)) != UCS_OK) {
        rc = ucx_fail(e, "ucp_worker_get_efd", st);
        goto fail;
    }
    ucp_am_recv_callback_t cbs[] = {am_get_meta, am_meta, am_done, am_abort, am_ack};
    unsigned ids[] = {PD_KVX_AM_GET_META, PD_KVX_AM_META, PD_KVX_AM_DONE, PD_KVX_AM_ABORT,
                      PD_KVX_AM_ACK};
    for (int i = 0; i < 5; i++) {
        ucp_am_handler_param_t hp = {
            .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                          UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG,
            .id = ids[i],
            .flags = UCP_AM_FLAG_WHOLE_MSG,
            .cb = cbs[i],
            .arg = x,
        };
        if ((st = ucp_worker_set_am_recv_handler(x->w, &hp)) != UCS_OK) {
            rc = ucx_fail(e, "ucp_worker_set_am_recv_handler", st);
            goto fail;
        }
    }
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS,
        .address = o->region,
        .length = o->region_len,
        .flags = o->region ? 0 : UCP_MEM_MAP_ALLOCATE,
    };
    if ((st = ucp_mem_map(x->ctx, &mp, &x->memh)) != UCS_OK) {
        x->memh = NULL;
        rc = ucx_fail(e, o->region ? "registering the KV region" : "allocating the KV region", st);
        goto fail;
    }
    if (!o->region) {
        ucp_mem_attr_t ma = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH};
        if ((st = ucp_mem_query(x->memh, &ma)) != UCS_OK || ma.length < o->region_len) {
            rc = ucx_fail(e, "querying the allocated KV region", st != UCS_OK ? st : UCS_ERR_NO_MEMORY);
            goto fail;
        }
        x->base = ma.address;
    }
    if ((st = ucp_rkey_pack(x->ctx, x->memh, &x->rkey_buf, &x->rkey_len)) != UCS_OK) {
        x->rkey_buf = NULL;
        rc = ucx_fail(e, "packing the region's rkey", st);
        goto fail;
    }
    if (o->listen_port >= 0) {
        const char *host = o->listen_host ? o->listen_host : "127.0.0.1";
        struct sockaddr_storage ss;
        socklen_t sl;
        if ((rc = resolve(host, o->listen_port, 1, &ss, &sl, e)) != 0)
            goto fail;
        ucp_listener_params_t lp = {
            .field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR |
                          UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
            .sockaddr = {.addr = (struct sockaddr *)&ss, .addrlen = sl},
            .conn_handler = {.cb = on_conn_request, .arg = x},
        };
        if ((st = ucp_listener_create(x->w, &lp, &x->listener)) != UCS_OK) {
            x->listener = NULL;
            /* UCX says "Device is busy" for the socket's EADDRINUSE */
            rc = pd_err_set(e, PD_EIO, "kvxfer: cannot listen on %s:%d: %s", host, o->listen_port,
                            st == UCS_ERR_BUSY ? "Address already in use" : ucs_status_string(st));
            goto fail;
        }
        ucp_listener_attr_t la = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
        if ((st = ucp_listener_query(x->listener, &la)) != UCS_OK) {
            rc = ucx_fail(e, "ucp_listener_query", st);
            goto fail;
        }
        if (la.sockaddr.ss_family == AF_INET6)
            x->port = ntohs(((struct sockaddr_in6 *)&la.sockaddr)->sin6_port);
        else
            x->port = ntohs(((struct sockaddr_in *)&la.sockaddr)->sin_port);
    }
    *out = x;
    return 0;
fail:
    pd_kvx_destroy(x);
    return rc;
}

void *pd_kvx_region(const struct pd_kvx *x)
{
    return x->base;
}

int pd_kvx_port(const struct pd_kvx *x)
{
    return x->port;
}

int pd_kvx_key_new(struct pd_kvx_key *k, uint64_t hash, pd_err *e)
{
    /* 16 bytes from the urandom pool: getrandom returns them whole once the pool is up, and
     * blocks (not fails) before that */
    ssize_t n;
    do
        n = getrandom(k->id, sizeof k->id, 0);
    while (n < 0 && errno == EINTR);
    if (n != (ssize_t)sizeof k->id)
        return pd_err_set(e, PD_EIO, "kvxfer: getrandom: %s", n < 0 ? strerror(errno) : "short read");
    k->hash = hash;
    return 0;
}

uint64_t pd_kvx_hash_tokens(const int32_t *ids, int n)
{
    uint64_t h = 14695981039346656037ULL;
    for (int i = 0; i < n; i++)
        for (int b = 0; b < 4; b++) {
            h ^= (uint8_t)((uint32_t)ids[i] >> (8 * b));
            h *= 1099511628211ULL;
        }
    return h;
}

void pd_kvx_id_format(const struct pd_kvx_key *k, char out[PD_KVX_ID_HEX])
{
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0; i < sizeof k->id; i++) {
        out[2 * i] = hex[k->id[i] >> 4];
        out[2 * i + 1] = hex[k->id[i] & 15];
    }
    out[2 * sizeof k->id] = 0;
}

static int hex_digit(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
         : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

int pd_kvx_id_parse(const char *s, struct pd_kvx_key *k)
{
    uint8_t id[sizeof k->id];
    if (!s || strlen(s) != 2 * sizeof id)
        return PD_EINVAL;
    for (size_t i = 0; i < sizeof id; i++) {
        int hi = hex_digit(s[2 * i]), lo = hex_digit(s[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return PD_EINVAL;
        id[i] = (uint8_t)(hi << 4 | lo);
    }
    memcpy(k->id, id, sizeof id);
    return 0;
}

int pd_kvx_offer(struct pd_kvx *x, const struct pd_kvx_key *key, uint64_t owner_id,
                 const struct pd_kvx_run *runs, int n_runs, pd_kvx_release_fn release, void *arg,
                 pd_err *e)
{
    uint64_t total;
    char what[64];
    snprintf(what, sizeof what, "kvxfer: offer of request %llu", (unsigned long long)owner_id);
    if (check_runs(runs, n_runs, x->len, &total, what, e))
        return e ? e->code : PD_EINVAL;
    struct lease *l = calloc(1, sizeof *l);
    struct pd_kvx_run *r = malloc((size_t)n_runs * sizeof *r);
    if (!l || !r) {
        free(l);
        free(r);
        return pd_err_set(e, PD_ENOMEM, "%s: no memory", what);
    }
    l->key = *key;
    l->owner = owner_id;
    l->n = merge_runs(runs, n_runs, r);
    l->runs = r;
    l->cb = release;
    l->arg = arg;
    pthread_mutex_lock(&x->mu);
    if (find_lease(x, key->id)) {
        pthread_mutex_unlock(&x->mu);
        free(r);
        free(l);
        return pd_err_set(e, PD_EINVAL, "%s: already under a lease", what);
    }
    l->deadline = pd_now_ns() + x->lease_ns;
    l->next = x->leases;
    x->leases = l;
    /* a sleeping serve loop must learn the new deadline */
    if (x->sleepers)
        ucp_worker_signal(x->w);
    pthread_mutex_unlock(&x->mu);
    return 0;
}

/* The cached connection to host:port, or a new one. NULL only when out of memory. */
static struct link *get_link(struct pd_kvx *x, const char *host, int port, ucs_status_t *st,
                             int *resolve_failed)
{
    for (struct link *l = x->links; l; l = l->next)
        if (l->outgoing && link_alive(l) && l->port == port && strcmp(l->host, host) == 0)
            return l;
    struct link *l = calloc(1, sizeof *l);
    if (!l)
        return NULL;
    l->x = x;
    l->outgoing = 1;
    l->port = port;
    snprintf(l->host, sizeof l->host, "%s", host);
    l->next = x->links;
    x->links = l;
    struct sockaddr_storage ss;
    socklen_t sl;
    pd_err ignored;
    if (resolve(host, port, 0, &ss, &sl, &ignored) != 0) {
        *resolve_failed = 1;
        l->failed = 1;
        l->status = UCS_ERR_INVALID_ADDR;
        return l;
    }
    ucp_ep_params_t p = {
        .field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
        .sockaddr = {.addr = (struct sockaddr *)&ss, .addrlen = sl},
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = ep_error, .arg = l},
    };
    *st = ucp_ep_create(x->w, &p, &l->ep);
    if (*st != UCS_OK) {
        l->ep = NULL;
        l->failed = 1;
        l->status = *st;
    }
    return l;
}

int pd_kvx_pull(struct pd_kvx *x, const char *host, int port, const struct pd_kvx_key *key,
                const struct pd_kvx_run *dst, int n_dst, struct pd_kvx_xfer **out, pd_err *e)
{
    *out = NULL;
    char what[128], id[PD_KVX_ID_HEX];
    pd_kvx_id_format(key, id);
    snprintf(what, sizeof what, "kvxfer: transfer %.8s... from %s:%d", id, host ? host : "?", port);
    if (!host || strlen(host) >= sizeof ((struct link *)0)->host || port <= 0 || port > 65535)
        return pd_err_set(e, PD_EINVAL, "%s: bad peer address", what);
    uint64_t total;
    if (check_runs(dst, n_dst, x->len, &total, what, e))
        return e ? e->code : PD_EINVAL;
    struct pd_kvx_xfer *t = calloc(1, sizeof *t);
    struct pd_kvx_run *d = malloc((size_t)n_dst * sizeof *d);
    if (!t || !d) {
        free(t);
        free(d);
        return pd_err_set(e, PD_ENOMEM, "%s: no memory", what);
    }
    t->x = x;
    t->key = *key;
    snprintf(t->host, sizeof t->host, "%s", host);
    t->port = port;
    t->dst = d;
    t->n_dst = merge_runs(dst, n_dst, d);
    t->state = PD_KVX_BOOTSTRAPPING;

    pthread_mutex_lock(&x->mu);
    t->tag = x->next_tag++;
    t->deadline = pd_now_ns() + x->timeout_ns;
    t->next = x->xfers;
    x->xfers = t;
    ucs_status_t st = UCS_OK;
    int unresolved = 0;
    struct link *l = get_link(x, host, port, &st, &unresolved);
    if (!l) {
        x->xfers = t->next;
        pthread_mutex_unlock(&x->mu);
        free_xfer(t);
        return pd_err_set(e, PD_ENOMEM, "%s: no memory", what);
    }
    t->peer = l;
    l->refs++;
    if (unresolved)
        xfer_fail(t, PD_EINVAL, 0, "cannot resolve the peer address");
    else if (!l->ep)
        xfer_fail(t, PD_EIO, 0, "cannot connect: %s", ucs_status_string(st));
    else if ((st = send_small(x, msg_ep(l), PD_KVX_AM_GET_META, key, t->tag)) != UCS_OK)
        xfer_fail(t, PD_EIO, 0, "cannot send GET_META: %s", ucs_status_string(st));
    /* a failure here ends the transfer at once, without waiting for a progress call */
    advance(x, t);
    if (x->sleepers)
        ucp_worker_signal(x->w);
    pthread_mutex_unlock(&x->mu);
    *out = t;
    return 0;
}

enum pd_kvx_state pd_kvx_state(struct pd_kvx *x, const struct pd_kvx_xfer *t)
{
    pthread_mutex_lock(&x->mu);
    enum pd_kvx_state s = t->state;
    pthread_mutex_unlock(&x->mu);
    return s;
}

int pd_kvx_result(struct pd_kvx *x, const struct pd_kvx_xfer *t, pd_err *e)
{
    pthread_mutex_lock(&x->mu);
    int rc = 0;
    if (t->state == PD_KVX_FAILED)
        rc = pd_err_set(e, t->fail_code, "%s", t->reason);
    else if (t->state != PD_KVX_DONE)
        rc = pd_err_set(e, PD_EINVAL, "kvxfer: transfer from %s:%d: still %s", t->host, t->port,
                        pd_kvx_state_name(t->state));
    pthread_mutex_unlock(&x->mu);
    return rc;
}

int pd_kvx_refused(struct pd_kvx *x, const struct pd_kvx_xfer *t)
{
    pthread_mutex_lock(&x->mu);
    int r = t->state == PD_KVX_FAILED && t->refused;
    pthread_mutex_unlock(&x->mu);
    return r;
}

uint64_t pd_kvx_xfer_gets(struct pd_kvx *x, const struct pd_kvx_xfer *t)
{
    pthread_mutex_lock(&x->mu);
    uint64_t g = t->gets;
    pthread_mutex_unlock(&x->mu);
    return g;
}

int pd_kvx_progress(struct pd_kvx *x)
{
    pthread_mutex_lock(&x->mu);
    int n = progress_locked(x);
    pthread_mutex_unlock(&x->mu);
    run_releases(x);
    return n;
}

enum pd_kvx_state pd_kvx_wait(struct pd_kvx *x, struct pd_kvx_xfer *t, int timeout_ms)
{
    int64_t end = timeout_ms < 0 ? INT64_MAX : pd_now_ns() + (int64_t)timeout_ms * 1000000;
    int idle_busy = 0;
    pthread_mutex_lock(&x->mu);
    for (;;) {
        int n = progress_locked(x);
        /* what this thread progressed may be what another one sleeps for (the server's idle
         * thread and a pull share the worker): wake them to look */
        if (n > 0 && x->sleepers)
            ucp_worker_signal(x->w);
        if (t ? is_final(t->state) : n > 0)
            break;
        int64_t now = pd_now_ns();
        if (now >= end)
            break;
        ucs_status_t st = ucp_worker_arm(x->w);
        /* BUSY: events to progress. But a shared-memory endpoint whose keepalive cannot be sent
         * (the peer's FIFO full) keeps the worker BUSY without any event: after a run of such
         * rounds, nap 1 ms instead of spinning a core. */
        if (st == UCS_ERR_BUSY && (n > 0 || ++idle_busy < 64))
            continue;
        if (n > 0)
            idle_busy = 0;
        int64_t wake = next_deadline(x);
        if (wake > end)
            wake = end;
        /* round up, and at least 1 ms, so a deadline is never polled for in a busy loop */
        int64_t ms = (wake - now + 999999) / 1000000;
        int timeout = wake == INT64_MAX || ms > 1000000 ? 1000000 : ms < 1 ? 1 : (int)ms;
        if (st != UCS_OK && timeout > 1)
            timeout = 1;   /* cannot arm: fall back to a short nap, never a busy loop */
        x->sleepers++;
        pthread_mutex_unlock(&x->mu);
        run_releases(x);
        struct pollfd pfd = {.fd = x->efd, .events = POLLIN};
        poll(&pfd, 1, timeout);
        pthread_mutex_lock(&x->mu);
        x->sleepers--;
    }
    enum pd_kvx_state s = t ? t->state : PD_KVX_DONE;
    pthread_mutex_unlock(&x->mu);
    run_releases(x);
    return s;
}

void pd_kvx_abort(struct pd_kvx *x, struct pd_kvx_xfer *t)
{
    pthread_mutex_lock(&x->mu);
    xfer_fail(t, PD_EIO, 1, "aborted by the caller");
    advance(x, t);
    if (x->sleepers)
        ucp_worker_signal(x->w);
    pthread_mutex_unlock(&x->mu);
}

void pd_kvx_xfer_free(struct pd_kvx *x, struct pd_kvx_xfer *t)
{
    if (!t)
        return;
    pthread_mutex_lock(&x->mu);
    if (!is_final(t->state)) {
        xfer_fail(t, PD_EIO, 1, "aborted: handle freed");
        advance(x, t);
    }
    if (is_final(t->state) && t->outstanding == 0) {
        struct pd_kvx_xfer **pp = &x->xfers;
        while (*pp != t)
            pp = &(*pp)->next;
        *pp = t->next;
        free_xfer(t);
    } else {
        t->free_when_final = 1;
    }
    pthread_mutex_unlock(&x->mu);
}

void pd_kvx_stats(struct pd_kvx *x, struct pd_kvx_stats *s)
{
    pthread_mutex_lock(&x->mu);
    *s = x->st;
    pthread_mutex_unlock(&x->mu);
}

static int busy(struct pd_kvx *x)
{
    if (x->sends_pending || x->inbox)
        return 1;
    for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next)
        if (t->outstanding && !is_final(t->state))
            return 1;
    return 0;
}

void pd_kvx_destroy(struct pd_kvx *x)
{
    if (!x)
        return;
    pthread_mutex_lock(&x->mu);
    x->destroying = 1;
    if (x->w) {
        /* Unfinished transfers fail now (telling their producers, while the links are up);
         * then a bounded drain lets those ABORTs, last ACKs and in-flight gets complete. */
        for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next)
            if (!is_final(t->state))
                xfer_fail(t, PD_EIO, 1, "the transfer engine was destroyed");
        int64_t end = pd_now_ns() + KVX_DRAIN_NS;
        do
            progress_locked(x);
        while (busy(x) && pd_now_ns() < end);
        if (x->listener)
            ucp_listener_destroy(x->listener);
        x->listener = NULL;
        for (struct link *l = x->links; l; l = l->next) {
            drop_idle_rkeys(x, l);
            close_ep(x, l);
        }
        end = pd_now_ns() + KVX_DRAIN_NS;
        do
            progress_locked(x);
        while (x->closing && pd_now_ns() < end);
    }
    /* rkeys live in the worker: they go before it */
    for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next)
        xfer_rkey_put(t);
    for (struct closing *c = x->closing, *next; c; c = next) {
        next = c->next;
        ucp_request_free(c->req);
        free(c);
    }
    x->closing = NULL;
    for (struct msg *m = x->inbox, *next; m; m = next) {
        next = m->next;
        free(m);
    }
    x->inbox = NULL;
    while (x->leases)
        lease_release(x, x->leases, PD_KVX_REL_DESTROY);
    pthread_mutex_unlock(&x->mu);
    run_releases(x);
    if (x->rkey_buf)
        ucp_rkey_buffer_release(x->rkey_buf);
    if (x->addr)
        ucp_worker_release_address(x->w, x->addr);
    if (x->memh)
        ucp_mem_unmap(x->ctx, x->memh);
    /* Whatever UCX did not finish is released with the worker; callbacks it may still run
     * touch only the engine, its transfers and links, which are freed after it. */
    if (x->w)
        ucp_worker_destroy(x->w);
    if (x->ctx)
        ucp_cleanup(x->ctx);
    for (struct pd_kvx_xfer *t = x->xfers, *next; t; t = next) {
        next = t->next;
        free_xfer(t);
    }
    for (struct link *l = x->links, *next; l; l = next) {
        next = l->next;
        free(l);
    }
    pthread_mutex_destroy(&x->mu);
    free(x);
}

/* KV transfer engine on UCX (protocol and message formats in kvxfer.h).
 *
 * Files: this one, the public API, leases and transfers' bookkeeping; kvx_wire.c, the messages
 * (sent, and handled once taken from the inbox); kvx_progress.c, UCX's callbacks and the state
 * machine (step()); what they share is kvx_internal.h.
 *
 * Owns: the UCP context, worker and endpoints of one process, its KV listener (kvx_boot.c); the registered KV region
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
 *     its reference on the link's rkey, or when every piece the producer pushed has landed; FAILED
 *     either the same way, or once its producer's endpoints are closed, so that nothing still in
 *     flight can write into the destination any more (a pushed piece lands only through the DATA
 *     handler, which drops it once the transfer fails: such a transfer fails at once);
 *   - a transfer holds a reference on its outgoing link until it is DONE or FAILED;
 *   - a link's rkey (unpacked once, shared by its transfers) is destroyed when the link and the
 *     last transfer flushing on it have let it go, before the link is freed;
 *   - a lease is in exactly one of x->leases (held) or x->released (callback pending);
 *   - a push (the DATA answering one READ) is in x->pushes until step() has seen its last send
 *     complete (u->left == 0); step() alone frees it (destroy frees what the worker dropped), so
 *     its AM headers outlive every send that may read them. */
#include "core/mem.h"
#include "pd/kvx_internal.h"

#include <assert.h>
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---------------------------------------------------------------- small helpers */

int kvx_is_final(enum pd_kvx_state s)
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
    case PD_KVX_REL_REVOKED: return "revoked";
    case PD_KVX_REL_N: break;
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
int kvx_merge_runs(const struct pd_kvx_run *in, int n, struct pd_kvx_run *out)
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

/* Marks t failing (the first reason wins); it becomes FAILED in kvx_advance() once nothing of it
 * is in flight. */
void kvx_xfer_fail(struct pd_kvx_xfer *t, int code, int send_abort, const char *fmt, ...)
{
    if (t->fail_code || kvx_is_final(t->state))
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

struct pd_kvx_xfer *kvx_find_xfer(struct pd_kvx *x, uint64_t tag)
{
    for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next)
        if (t->tag == tag)
            return t;
    return NULL;
}

struct lease *kvx_find_lease(struct pd_kvx *x, const uint8_t id[16])
{
    for (struct lease *l = x->leases; l; l = l->next)
        if (memcmp(l->key.id, id, sizeof l->key.id) == 0)
            return l;
    return NULL;
}

/* Moves a held lease to the released list; its callback runs later without the lock. */
void kvx_lease_release(struct pd_kvx *x, struct lease *l, enum pd_kvx_release why)
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


/* ---------------------------------------------------------------- public API */

int kvx_resolve(const char *host, int port, int passive, struct sockaddr_storage *ss, socklen_t *len, pd_err *e)
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

/* A context or worker UCX could not make: with /dev/shm nearly full its shared-memory transport
 * fails them as "Out of memory" (its receive FIFOs live there), which names the wrong thing. */
static int ucx_fail_shm(pd_err *e, const char *what, ucs_status_t st)
{
    char note[400];
    pd_shm_note(note, sizeof note, PD_SHM_UCX_WORKER_BYTES);
    return pd_err_set(e, PD_EIO, "kvxfer: %s: %s%s%s", what, ucs_status_string(st), note[0] ? "; " : "", note);
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
    x->lfd = -1;
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
    /* Peers on other hosts need a network transport, TCP where there is no RDMA: a transport
     * list that names neither tcp nor all, nor excludes anything, gets tcp added. */
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
    /* A peer that dies is known by UCX's keepalive, whose rounds come 20 s apart by default: a
     * pull on the endpoint kept to a SIGKILLed producer (reused within 100 ms, so no HELLO first)
     * waited that long, or the pull's timeout, before its prompt was recomputed. A round every half
     * second: on shared memory a check that the peer's process lives, on a network a small message
     * per endpoint. UCX_KEEPALIVE_INTERVAL set by the user wins. */
    if (!getenv("UCX_KEEPALIVE_INTERVAL") && (st = ucp_config_modify(cfg, "KEEPALIVE_INTERVAL", "500ms")) != UCS_OK) {
        ucp_config_release(cfg);
        rc = ucx_fail(e, "setting UCX's keepalive interval", st);
        goto fail;
    }
    /* UCX's TCP transport listens on every network interface (besides the KV listener): keep
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
        rc = ucx_fail_shm(e, "ucp_init", st);
        goto fail;
    }
    /* Serialized: the engine's lock orders every call, from whichever thread. */
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    if ((st = ucp_worker_create(x->ctx, &wp, &x->w)) != UCS_OK) {
        x->w = NULL;
        rc = ucx_fail_shm(e, "ucp_worker_create", st);
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
    if ((st = kvx_set_am_handlers(x)) != UCS_OK) {
        rc = ucx_fail(e, "ucp_worker_set_am_recv_handler", st);
        goto fail;
    }
    /* peers read the region (their gets), never write it: where the transport enforces the
     * registration's access (RDMA), a consumer holding a lease's rkey cannot rewrite the pool
     * under other requests and the prefix cache. UCX's TCP and shared-memory transports do not
     * enforce it: the KV port is for the cluster's trusted network (README, "Security") */
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS | UCP_MEM_MAP_PARAM_FIELD_PROT,
        .address = o->region,
        .length = o->region_len,
        .flags = o->region ? 0 : UCP_MEM_MAP_ALLOCATE,
        .prot = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE | UCP_MEM_MAP_PROT_REMOTE_READ,
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
    if (x->addr_len > KVX_HELLO_ADDR_MAX) {
        rc = pd_err_set(e, PD_EIO, "kvxfer: the worker address is %zu bytes (a HELLO carries at most %d)",
                        x->addr_len, KVX_HELLO_ADDR_MAX);
        goto fail;
    }
    if (o->listen_port >= 0 &&
        (rc = kvx_boot_listen(x, o->listen_host ? o->listen_host : "127.0.0.1", o->listen_port, e)) != 0)
        goto fail;
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
    l->n = kvx_merge_runs(runs, n_runs, r);
    l->runs = r;
    l->cb = release;
    l->arg = arg;
    pthread_mutex_lock(&x->mu);
    if (kvx_find_lease(x, key->id)) {
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

int pd_kvx_revoke(struct pd_kvx *x, const struct pd_kvx_key *key)
{
    pthread_mutex_lock(&x->mu);
    struct lease *l = kvx_find_lease(x, key->id);
    int revoked = l && !l->claimed;
    if (revoked) {
        kvx_lease_release(x, l, PD_KVX_REL_REVOKED);   /* (not an expiry: counted apart) */
        /* a sleeping serve loop runs the callback */
        if (x->sleepers)
            ucp_worker_signal(x->w);
    }
    pthread_mutex_unlock(&x->mu);
    return revoked;
}

struct link *kvx_get_link(struct pd_kvx *x, const char *host, int port, ucs_status_t *st, int *resolve_failed)
{
    struct sockaddr_storage ss;
    socklen_t sl = 0;
    pd_err ignored;
    for (struct link *l = x->links; l; l = l->next)
        if (l->outgoing && !l->failed && (l->ep || l->bfd >= 0) && l->port == port && strcmp(l->host, host) == 0) {
            if (l->ep) {
                l->reused = 1;
                /* is the same producer still there? (its GET_META goes out meanwhile) Asked at
                 * the address resolved when the link was made: a name was resolved again at every
                 * pull after 100 ms idle, under the scheduler's lock, where a slow DNS server
                 * stalled the whole decode instance at each one */
                if (l->bfd < 0 && pd_now_ns() - l->heard_ns > KVX_CHECK_IDLE_NS && l->addr_len)
                    kvx_boot_connect(l, (struct sockaddr *)&l->addr, l->addr_len);
            }
            return l;
        }
    x->st.resolves++;
    int resolved = kvx_resolve(host, port, 0, &ss, &sl, &ignored) == 0;
    if (resolved)   /* the same producer under another name */
        for (struct link *l = x->links; l; l = l->next)
            if (l->outgoing && !l->failed && (l->ep || l->bfd >= 0) && l->addr_len == sl &&
                memcmp(&l->addr, &ss, sl) == 0) {
                l->reused = l->ep != NULL;
                return l;
            }
    struct link *l = calloc(1, sizeof *l);
    if (!l)
        return NULL;
    l->x = x;
    l->outgoing = 1;
    l->bfd = -1;
    l->port = port;
    snprintf(l->host, sizeof l->host, "%s", host);
    l->next = x->links;
    x->links = l;
    if (!resolved) {
        *resolve_failed = 1;
        l->failed = 1;
        l->status = UCS_ERR_INVALID_ADDR;
        return l;
    }
    memcpy(&l->addr, &ss, sl);
    l->addr_len = sl;
    /* the producer's worker address comes in its KV listener's HELLO (kvx_boot.c) */
    int err = kvx_boot_connect(l, (struct sockaddr *)&ss, sl);
    if (err < 0) {
        l->failed = 1;
        l->status = *st = err == -ENOMEM ? UCS_ERR_NO_MEMORY : UCS_ERR_UNREACHABLE;
    }
    return l;
}

void kvx_xfer_send_get_meta(struct pd_kvx *x, struct pd_kvx_xfer *t)
{
    ucs_status_t st = kvx_send_small(x, kvx_msg_ep(t->peer), PD_KVX_AM_GET_META, &t->key, t->tag);
    t->meta_sent = 1;
    t->meta_by = pd_now_ns() + KVX_META_NS;
    if (st != UCS_OK)
        kvx_xfer_fail(t, PD_EIO, 0, "cannot send GET_META: %s", ucs_status_string(st));
}

int kvx_xfer_may_retry(const struct pd_kvx_xfer *t)
{
    return !t->retried && t->peer && t->peer->reused && !t->meta_ok && !t->outstanding && !kvx_is_final(t->state);
}

int kvx_xfer_retry(struct pd_kvx *x, struct pd_kvx_xfer *t)
{
    if (!kvx_xfer_may_retry(t))
        return 0;
    ucs_status_t st = UCS_OK;
    int unresolved = 0;
    t->retried = 1;
    t->peer->refs--;
    struct link *l = kvx_get_link(x, t->host, t->port, &st, &unresolved);   /* (the failed one is not alive) */
    t->peer = l;
    t->tag = x->next_tag++;   /* the old GET_META's completion, if it comes, finds nothing */
    t->deadline = pd_now_ns() + x->timeout_ns;
    t->state = PD_KVX_BOOTSTRAPPING;
    t->meta_sent = 0;
    if (!l) {
        kvx_xfer_fail(t, PD_ENOMEM, 0, "no memory for a new connection");
        return 1;
    }
    l->refs++;
    if (unresolved)
        kvx_xfer_fail(t, PD_EINVAL, 0, "cannot resolve the peer address");
    else if (l->failed)
        kvx_xfer_fail(t, PD_EIO, 0, "cannot connect again: %s", ucs_status_string(st));
    else if (l->ep)   /* else it goes when the link's HELLO has come (kvx_boot.c) */
        kvx_xfer_send_get_meta(x, t);
    return 1;
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
    t->n_dst = kvx_merge_runs(dst, n_dst, d);
    t->state = PD_KVX_BOOTSTRAPPING;

    pthread_mutex_lock(&x->mu);
    t->tag = x->next_tag++;
    t->deadline = pd_now_ns() + x->timeout_ns;
    t->next = x->xfers;
    x->xfers = t;
    ucs_status_t st = UCS_OK;
    int unresolved = 0;
    struct link *l = kvx_get_link(x, host, port, &st, &unresolved);
    if (!l) {
        x->xfers = t->next;
        pthread_mutex_unlock(&x->mu);
        kvx_free_xfer(t);
        return pd_err_set(e, PD_ENOMEM, "%s: no memory", what);
    }
    t->peer = l;
    l->refs++;
    if (unresolved)
        kvx_xfer_fail(t, PD_EINVAL, 0, "cannot resolve the peer address");
    else if (l->failed)
        kvx_xfer_fail(t, PD_EIO, 0, "cannot connect: %s", ucs_status_string(st));
    else if (l->ep)   /* else it goes when the link's HELLO has come (kvx_boot.c) */
        kvx_xfer_send_get_meta(x, t);
    /* a failure here ends the transfer at once, without waiting for a progress call */
    kvx_advance(x, t);
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

uint64_t pd_kvx_xfer_pieces(struct pd_kvx *x, const struct pd_kvx_xfer *t)
{
    pthread_mutex_lock(&x->mu);
    uint64_t g = t->pieces ? t->n_pieces : t->gets;
    pthread_mutex_unlock(&x->mu);
    return g;
}

int pd_kvx_progress(struct pd_kvx *x)
{
    pthread_mutex_lock(&x->mu);
    int n = kvx_progress_locked(x);
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
        int n = kvx_progress_locked(x);
        /* what this thread progressed may be what another one sleeps for (the server's idle
         * thread and a pull share the worker): wake them to look */
        if (n > 0 && x->sleepers)
            ucp_worker_signal(x->w);
        if (t ? kvx_is_final(t->state) : n > 0)
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
        int64_t wake = kvx_next_deadline(x);
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
        /* the worker's events, and the KV listener's connections and HELLOs on their way
         * (more of those than fit here: look again every millisecond) */
        struct pollfd pfd[17] = {{.fd = x->efd, .events = POLLIN}};
        int nb = kvx_boot_fds(x, pfd + 1, 16);
        if (nb < 0 && timeout > 1)
            timeout = 1;
        poll(pfd, 1 + (nb < 0 ? 16 : nb), timeout);
        if (x->lfd >= 0 && (pfd[1].revents & POLLIN))   /* (the listener comes first) */
            x->accept_at = 0;
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
    kvx_xfer_fail(t, PD_EIO, 1, "aborted by the caller");
    kvx_advance(x, t);
    if (x->sleepers)
        ucp_worker_signal(x->w);
    pthread_mutex_unlock(&x->mu);
}

void pd_kvx_xfer_free(struct pd_kvx *x, struct pd_kvx_xfer *t)
{
    if (!t)
        return;
    pthread_mutex_lock(&x->mu);
    if (!kvx_is_final(t->state)) {
        kvx_xfer_fail(t, PD_EIO, 1, "aborted: handle freed");
        kvx_advance(x, t);
    }
    if (kvx_is_final(t->state) && t->outstanding == 0) {
        struct pd_kvx_xfer **pp = &x->xfers;
        while (*pp != t)
            pp = &(*pp)->next;
        *pp = t->next;
        kvx_free_xfer(t);
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
    /* (right after a step, x->pushes holds only pushes with DATA sends in flight) */
    if (x->sends_pending || x->pushes || x->inbox)
        return 1;
    for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next)
        if (t->outstanding && !kvx_is_final(t->state))
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
         * then a bounded drain lets those ABORTs, last ACKs, in-flight gets and pushed pieces complete. */
        for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next)
            if (!kvx_is_final(t->state))
                kvx_xfer_fail(t, PD_EIO, 1, "the transfer engine was destroyed");
        int64_t end = pd_now_ns() + KVX_DRAIN_NS;
        do
            kvx_progress_locked(x);
        while (busy(x) && pd_now_ns() < end);
        for (struct link *l = x->links; l; l = l->next) {
            kvx_boot_close(l);
            kvx_drop_idle_rkeys(x, l);
            kvx_close_ep(x, l);
        }
        end = pd_now_ns() + KVX_DRAIN_NS;
        do
            kvx_progress_locked(x);
        while (x->closing && pd_now_ns() < end);
    }
    /* rkeys live in the worker: they go before it */
    for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next)
        kvx_xfer_rkey_put(t);
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
        kvx_lease_release(x, x->leases, PD_KVX_REL_DESTROY);
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
        kvx_free_xfer(t);
    }
    for (struct link *l = x->links, *next; l; l = next) {
        next = l->next;
        kvx_link_free(l);
    }
    /* pushes whose sends UCX dropped with the worker without completing them */
    for (struct push *u = x->pushes, *next; u; u = next) {
        next = u->next;
        free(u);
    }
    x->pushes = NULL;
    if (x->lfd >= 0)
        close(x->lfd);
    free(x->hello);
    pthread_mutex_destroy(&x->mu);
    free(x);
}

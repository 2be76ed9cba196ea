/* The proxy's connections to its instances (internal.h): per instance a pool of idle keep-alive
 * connections that completions, fan-outs and /health checks borrow and give back.
 *
 * Why: a connection per request, closed by the proxy first, left a socket in TIME_WAIT on the
 * proxy's host for 60 s each; at ~470 requests/s to one instance the 28K ephemeral ports of
 * Linux's default range ran out, connect() failed with EADDRNOTAVAIL, and the /health checks
 * failing the same way ejected healthy instances.
 *
 * A connection goes back to its pool only after a complete answer that leaves it open (libevent
 * then watches it for the server's close); one whose request failed or was cancelled (a client
 * that left mid-stream: libevent resets it) is freed. At most px->keep idle per instance (the rest
 * are closed; the client connection cap leaves descriptors for them, proxy.c), each for at most
 * KEEPALIVE_IDLE_S: `pdmoe serve` closes a
 * connection idle for --idle-timeout (60 s), and one it closes just as the proxy sends on it fails
 * the request (the caller retries once on a fresh connection when no byte of the answer came, see
 * px_conn_reused). Before lending an idle one the pool looks at its socket: a server that has
 * closed it (its FIN arrived, not yet read by the loop) or sent bytes unasked is not lent. So a
 * server whose --idle-timeout is shorter than KEEPALIVE_IDLE_S costs a new connection, not a request
 * (libevent reads its FIN and resets the connection, the tick's sweep drops it, or the peek finds
 * it: pool/an_instance_idle_timeout_shorter_than_the_pools_loses_no_request); only a close that
 * crosses the request on the wire is left to the resend. */
#include "proxy/internal.h"
#include "core/timing.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>

/* An idle connection is closed after this long unused: well within serve's --idle-timeout (60 s by
 * default), so that the server rarely closes one first. */
#define KEEPALIVE_IDLE_S 20.0

/* While idle, the connection's read timeout (libevent watches an idle connection for the server's
 * close): longer than the idle limit, so that the pool, not libevent, retires it. */
#define IDLE_TIMEOUT_S 3600

struct px_conn {
    struct evhttp_connection *evcon;
    struct instance *in;
    struct px_conn *next, *prev; /* in->idle while idle (next only); in->closing while it waits to be
                                  * freed from the loop */
    double idle_since;
    int uses;                    /* requests lent for, this one included */
    int heard;                   /* bytes of the current request's answer arrived */
    int connected;               /* it was connected once (libevent's close callback came) */
};

/* Any byte that arrives counts, even one of a status line the server did not finish. */
static void on_input(struct evbuffer *b, const struct evbuffer_cb_info *info, void *arg)
{
    if (info->n_added)
        ((struct px_conn *)arg)->heard = 1;
}

/* libevent calls it when it closes a connection that was connected (not one whose connect failed). */
static void on_close(struct evhttp_connection *evcon, void *arg)
{
    ((struct px_conn *)arg)->connected = 1;
}

/* Closed at once, with any request pending on it (whose callback is not called). */
static void conn_free_now(struct px_conn *c)
{
    if (!c)
        return;
    evhttp_connection_free(c->evcon);
    free(c);
}

static void free_later(evutil_socket_t fd, short what, void *arg)
{
    struct px_conn *c = arg;
    *(c->prev ? &c->prev->next : &c->in->closing) = c->next;
    if (c->next)
        c->next->prev = c->prev;
    conn_free_now(c);
}

/* Closes c from the loop rather than from the callback of its request, which libevent is still in
 * (and its free-on-completion misses connections that never connected). Until then it is on
 * in->closing, which px_pool_destroy frees: a loop that ends before its next turn (the graceful
 * stop's last timer in the turn of a /health check's timeout) drops its pending events uncalled,
 * and lost the connection with its libevent state. */
static void conn_free(struct px_conn *c)
{
    struct instance *in = c->in;
    c->prev = NULL;
    c->next = in->closing;
    if (in->closing)
        in->closing->prev = c;
    in->closing = c;
    if (event_base_once(in->px->base, -1, EV_TIMEOUT, free_later, c, &(struct timeval){0, 0}))
        free_later(-1, 0, c);   /* (out of memory for the event: at once, as libevent's callers allow) */
}

/* The socket of an idle connection, as the server left it: open and silent (1), else 0 (closed
 * by either side, or bytes nobody asked for). */
static int still_open(struct px_conn *c)
{
    evutil_socket_t fd = bufferevent_getfd(evhttp_connection_get_bufferevent(c->evcon));
    if (fd < 0)
        return 0;   /* libevent saw the server's close, or a Connection: close answer, and reset it */
    char b;
    ssize_t n = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

static void set_timeout(struct px_conn *c, int timeout_ms)
{
    struct timeval tv = timeout_ms > 0 ? (struct timeval){timeout_ms / 1000, timeout_ms % 1000 * 1000}
                                       : (struct timeval){PX_NO_DEADLINE_S, 0};
    evhttp_connection_set_timeout_tv(c->evcon, &tv);
}

struct px_conn *px_conn_get(struct instance *in, int timeout_ms, int fresh)
{
    struct pd_proxy *px = in->px;
    const double now = pd_now_s();
    while (!fresh && in->idle) {
        struct px_conn *c = in->idle;
        in->idle = c->next;
        in->n_idle--;
        c->next = NULL;
        if (now - c->idle_since < KEEPALIVE_IDLE_S && still_open(c)) {
            c->uses++;
            c->heard = 0;
            in->conns_reused++;
            set_timeout(c, timeout_ms);
            return c;
        }
        conn_free(c);
    }
    struct px_conn *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->in = in;
    c->uses = 1;
    c->evcon = evhttp_connection_base_new(px->base, NULL, in->host, (unsigned short)in->port);
    if (!c->evcon || !evbuffer_add_cb(bufferevent_get_input(evhttp_connection_get_bufferevent(c->evcon)), on_input, c)) {
        if (c->evcon)
            evhttp_connection_free(c->evcon);
        free(c);
        return NULL;
    }
    evhttp_connection_set_closecb(c->evcon, on_close, c);
    in->conns_opened++;
    set_timeout(c, timeout_ms);
    return c;
}

struct evhttp_connection *px_conn_evcon(const struct px_conn *c)
{
    return c->evcon;
}

int px_conn_reused(const struct px_conn *c)
{
    return c->uses > 1;
}

int px_conn_heard(const struct px_conn *c)
{
    return c->heard;
}

void px_conn_put(struct px_conn *c, int answered)
{
    if (!c)
        return;
    struct instance *in = c->in;
    struct pd_proxy *px = in->px;
    if (!answered || px->stopping || in->n_idle >= px->keep ||
        bufferevent_getfd(evhttp_connection_get_bufferevent(c->evcon)) < 0) {
        conn_free(c);
        return;
    }
    set_timeout(c, IDLE_TIMEOUT_S * 1000);
    c->idle_since = pd_now_s();
    c->next = in->idle;
    in->idle = c;
    in->n_idle++;
}

void px_pool_sweep(struct instance *in, double now)
{
    for (struct px_conn **p = &in->idle; *p;) {
        struct px_conn *c = *p;
        if (now - c->idle_since < KEEPALIVE_IDLE_S && bufferevent_getfd(evhttp_connection_get_bufferevent(c->evcon)) >= 0) {
            p = &c->next;
            continue;
        }
        *p = c->next;
        in->n_idle--;
        conn_free(c);
    }
}

void px_pool_free(struct instance *in)
{
    while (in->idle) {
        struct px_conn *c = in->idle;
        in->idle = c->next;
        conn_free_now(c);
    }
    in->n_idle = 0;
}

void px_pool_destroy(struct instance *in)
{
    px_pool_free(in);
    while (in->closing)
        free_later(-1, 0, in->closing);   /* (its event is freed uncalled with the loop's base) */
}

int px_pool_shed(struct pd_proxy *px)
{
    int n = 0;
    for (int k = 0; k < px->np + px->nd; k++) {
        n += nth(px, k)->n_idle;
        px_pool_free(nth(px, k));   /* (now, not from the loop: the descriptors are wanted at once) */
    }
    return n;
}

int px_conn_out_of_fds(const struct px_conn *c, int err)
{
    return !c->connected && !c->heard && c->uses == 1 && (err == EMFILE || err == ENFILE);
}

const char *px_conn_local_failure(const struct px_conn *c, int err)
{
    if (c->connected || c->heard || c->uses > 1)
        return NULL;   /* it reached the instance: whatever failed after that is not the proxy's host */
    switch (err) {
    case EADDRNOTAVAIL:
        return "EADDRNOTAVAIL: no local port is free for it; the proxy host's ephemeral ports "
               "(net.ipv4.ip_local_port_range) are in use or in TIME_WAIT";
    case EMFILE:
        return "EMFILE: the proxy has as many descriptors open as its limit (ulimit -n, LimitNOFILE)";
    case ENFILE:
        return "ENFILE: the proxy host has as many files open as its limit (fs.file-max)";
    case ENOBUFS:
    case ENOMEM:
        return "ENOBUFS/ENOMEM: the proxy host is out of memory for sockets";
    default:
        return NULL;
    }
}

void px_say_local(struct instance *in, const char *local)
{
    const double now = pd_now_s();
    if (in->local_said_at > 0 && now - in->local_said_at < 10)
        return;
    in->local_said_at = now;
    fprintf(stderr, "pdmoe proxy: no connection to the %s instance %s:%d (%s); not counted as the instance's "
            "failure\n", in->role, in->host, in->port, local);
}

/* ---- GET on a pooled connection ------------------------------------------------------------- */

struct px_get {
    struct pd_proxy *px;
    struct instance *in;
    char path[64];
    int timeout_ms;
    void (*cb)(struct evhttp_request *, const char *, void *);
    void *arg;
    struct px_conn *conn;
    int sending;                     /* inside evhttp_make_request (which may fail at once, calling back) */
    int failed_at_once, err;         /* it did, with this errno */
    int closed;                      /* libevent's error for the request was a closed connection */
    int retried;                     /* sent again on a fresh connection once */
    int shed;                        /* sent again once after its connect found no descriptor and the
                                      * idle connections were closed for it */
};

static int get_send(struct px_get *g, int fresh);

static void get_finish(struct px_get *g, struct evhttp_request *r, int err)
{
    const int code = r ? evhttp_request_get_response_code(r) : 0;
    const char *local = code == 0 && g->conn ? px_conn_local_failure(g->conn, err) : NULL;
    px_conn_put(g->conn, code > 0);
    g->cb(r, local, g->arg);
    free(g);
}

/* g's connect failed for want of a descriptor (EMFILE, ENFILE): once, if closing the idle pooled
 * connections freed any, it goes again on a fresh connection (1); else 0. */
static int get_shed_retry(struct px_get *g, struct evhttp_request *r, int err)
{
    if (g->shed || (r && evhttp_request_get_response_code(r) > 0) || !g->conn || !px_conn_out_of_fds(g->conn, err))
        return 0;
    g->shed = 1;
    if (px_pool_shed(g->px) == 0)
        return 0;
    px_conn_put(g->conn, 0);
    g->conn = NULL;
    return get_send(g, 1) == 0;
}

/* A GET that failed inside px_get_from, answered from the loop: its caller has its handle first. */
static void on_failed_at_once(evutil_socket_t fd, short what, void *arg)
{
    struct px_get *g = arg;
    if (get_shed_retry(g, NULL, g->err))
        return;
    get_finish(g, NULL, g->err);
}

static void on_get_error(enum evhttp_request_error e, void *arg)
{
    ((struct px_get *)arg)->closed = e == EVREQ_HTTP_EOF;
}

static void on_get_done(struct evhttp_request *r, void *arg)
{
    const int err = errno;
    struct px_get *g = arg;
    const int code = r ? evhttp_request_get_response_code(r) : 0;
    if (g->sending) {   /* (only a failure comes back at once) */
        g->failed_at_once = 1;
        g->err = err;
        return;
    }
    if (code == 0 && g->closed && !g->retried && px_conn_reused(g->conn) && !px_conn_heard(g->conn)) {
        /* the server closed the kept-alive connection as the request went: once more, on a new one */
        g->retried = 1;
        g->px->stale_retries++;
        px_conn_put(g->conn, 0);
        g->conn = NULL;
        if (get_send(g, 1) == 0)
            return;
    }
    if (get_shed_retry(g, r, err))
        return;
    get_finish(g, r, err);
}

/* Sends g on a connection; 0, or -1 when it could not be sent (g->conn is then given back); a
 * failure at once is left for the loop to answer. */
static int get_send(struct px_get *g, int fresh)
{
    g->closed = 0;
    g->conn = px_conn_get(g->in, g->timeout_ms, fresh);
    struct evhttp_request *r = g->conn ? evhttp_request_new(on_get_done, g) : NULL;
    if (!r || (evhttp_request_set_error_cb(r, on_get_error), 0) ||
        evhttp_add_header(evhttp_request_get_output_headers(r), "Host", g->in->host) ||
        pd_http_add_key(r, px_backend_key(g->px))) {
        if (r)
            evhttp_request_free(r);
        px_conn_put(g->conn, 0);
        g->conn = NULL;
        return -1;
    }
    g->sending = 1;
    g->failed_at_once = 0;
    int rc = evhttp_make_request(px_conn_evcon(g->conn), r, EVHTTP_REQ_GET, g->path);   /* (frees r on failure) */
    g->sending = 0;
    if (rc == 0 && !g->failed_at_once)
        return 0;
    if (rc != 0)
        g->err = errno;
    /* answered from the loop, as a failure (the connection goes with it) */
    if (event_base_once(g->px->base, -1, EV_TIMEOUT, on_failed_at_once, g, &(struct timeval){0, 0}) == 0)
        return 0;
    px_conn_put(g->conn, 0);
    g->conn = NULL;
    return -1;
}

struct px_get *px_get_from(struct pd_proxy *px, struct instance *in, const char *path, int timeout_ms,
                           void (*cb)(struct evhttp_request *, const char *, void *), void *arg)
{
    struct px_get *g = calloc(1, sizeof *g);
    if (!g)
        return NULL;
    *g = (struct px_get){.px = px, .in = in, .timeout_ms = timeout_ms, .cb = cb, .arg = arg};
    snprintf(g->path, sizeof g->path, "%s", path);
    if (get_send(g, 0)) {
        free(g);
        return NULL;
    }
    return g;
}

void px_get_cancel(struct px_get *g)
{
    if (!g)
        return;
    conn_free_now(g->conn);
    free(g);
}

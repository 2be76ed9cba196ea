/* Counted, capped and timed HTTP connections on libevent 2.1 (see front.h).
 *
 * libevent 2.1's evhttp accepts and frees its connections itself and tells nobody; the front
 * learns of each one through evhttp_set_bevcb (it makes the connection's bufferevent), finds its
 * evhttp_connection once evhttp has built it (the bufferevent's callback argument, read in a
 * callback run right after the accept) and holds its close callback. The bufferevent's input
 * buffer shows the request's bytes arriving (the header deadline ends at its first empty line),
 * the routes show it reaching its handler, the request's completion callback its reply ending. */
#define _GNU_SOURCE
#include "http/front.h"
#include "core/timing.h"
#include "http/head.h"
#include "http/http.h"

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/http_struct.h>
#include <event2/keyvalq_struct.h>
#include <event2/listener.h>
#include <event2/util.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

/* at the cap, a connection idle this long may be closed for a new one */
#define EVICT_IDLE_S 1.0
/* refused connections kept open until their client reads the 503 and closes */
#define MAX_LINGER 16
#define LINGER_S 1.0

enum conn_state { WAIT, HEAD, BODY, BUSY };   /* no request; its line and headers; its body; a handler has it */

struct conn {
    struct pd_http_front *f;
    struct bufferevent *bev;
    struct evhttp_connection *evcon;          /* NULL until attached */
    int fd;
    enum conn_state state;
    int line_start;                           /* header scan: the last byte ended a line */
    struct pd_http_field_scan fs;                     /* header scan: the bytes no field may hold */
    int fix_pending, fixed;                   /* libevent's own error page to rewrite */
    int refuse;                               /* the head held a byte no field may hold (on_timer) */
    double since;                             /* when the state began */
    double progress;                          /* BUSY: when the answer last reached the socket */
    struct event *timer, *fix;
    struct evbuffer_cb_entry *in_cb, *out_cb;
    void (*closecb)(struct evhttp_connection *, void *);
    void *closearg;
    struct conn *prev, *next;
    struct conn *fresh_next;
};

struct route {
    struct pd_http_front *f;
    int methods;    /* enum evhttp_cmd_type mask, 0: any */
    void (*cb)(struct evhttp_request *, void *);
    void *arg;
    struct route *next;
};

struct refused {
    int fd;
    double t0;
    struct event *ev;
    struct pd_http_front *f;
    struct refused *prev, *next;
};

struct pd_http_front {
    struct pd_http_limits lim;
    int cap;
    long nofile;                    /* the open-file limit that lowered cap below lim.max_connections, else -1 */
    struct event_base *base;
    struct evhttp *http;
    struct evconnlistener *lev;
    int port;
    struct event *full_ev, *resume_ev, *attach_ev;
    int paused, starved_logged, closing;
    struct conn *conns, *fresh;
    int n_conns;
    struct conn **by_fd;
    int by_fd_cap;
    struct route *routes;
    struct refused *lingers;
    int n_lingers;
    struct pd_http_stats st;
    struct pd_http_front *reg_next;
};

/* The listener's error callback and pd_http_set_closecb get libevent's pointers only. */
static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static struct pd_http_front *reg;

static struct pd_http_front *find_front(const struct evhttp *http, const struct evconnlistener *lev)
{
    pthread_mutex_lock(&reg_mu);
    struct pd_http_front *f = reg;
    while (f && !(http && f->http == http) && !(lev && f->lev == lev))
        f = f->reg_next;
    pthread_mutex_unlock(&reg_mu);
    return f;
}

static struct timeval ms_tv(int ms)
{
    return (struct timeval){ms / 1000, (ms % 1000) * 1000};
}

/* ---- accepting ----------------------------------------------------------------------------- */

/* Below the cap evhttp's listener accepts; at the cap full_ev does (to make room or refuse). */
static void update_accept(struct pd_http_front *f)
{
    if (f->closing || f->paused)
        return;
    if (f->n_conns >= f->cap) {
        evconnlistener_disable(f->lev);
        event_add(f->full_ev, NULL);
    } else {
        event_del(f->full_ev);
        evconnlistener_enable(f->lev);
    }
}

/* Whether accepting failed for want of descriptors that the process then freed (limits.shed): the
 * listener, left enabled, accepts again at the loop's next turn. Only for a connection waiting:
 * Linux's accept() takes the descriptor before it looks at the queue, so the listener's last
 * accept of a turn fails with EMFILE whenever the table is full, a client waiting or not. A shed
 * that freed none pauses. */
static int shed_for_accept(struct pd_http_front *f, int err)
{
    if ((err != EMFILE && err != ENFILE) || !f->lim.shed)
        return 0;
    struct pollfd p = {evconnlistener_get_fd(f->lev), POLLIN, 0};
    return poll(&p, 1, 0) == 1 && (p.revents & POLLIN) && f->lim.shed(f->lim.shed_arg) > 0;
}

static void pause_accept(struct pd_http_front *f, int err)
{
    if (shed_for_accept(f, err)) {
        update_accept(f);
        return;
    }
    evconnlistener_disable(f->lev);
    event_del(f->full_ev);
    f->paused = 1;
    f->st.accept_paused++;
    if (!f->starved_logged && f->lim.log) {
        char line[256];
        snprintf(line, sizeof line, "accept on port %d: %s with %d connections open; accepting again every 100 ms "
                 "until descriptors are free", f->port, strerror(err), f->n_conns);
        f->lim.log(f->lim.log_arg, line);
    }
    f->starved_logged = 1;
    struct timeval tv = ms_tv(100);
    evtimer_add(f->resume_ev, &tv);
}

static void on_resume(evutil_socket_t fd, short what, void *arg)
{
    struct pd_http_front *f = arg;
    f->paused = 0;
    update_accept(f);
}

static int out_of_descriptors(int err)
{
    return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM;
}

static void on_accept_error(struct evconnlistener *lev, void *arg)
{
    int err = EVUTIL_SOCKET_ERROR();
    struct pd_http_front *f = find_front(NULL, lev);
    if (f)
        pause_accept(f, out_of_descriptors(err) ? err : err ? err : EIO);
}

static void linger_end(struct refused *l)
{
    struct pd_http_front *f = l->f;
    event_free(l->ev);
    close(l->fd);
    if (l->prev)
        l->prev->next = l->next;
    else
        f->lingers = l->next;
    if (l->next)
        l->next->prev = l->prev;
    f->n_lingers--;
    free(l);
}

static void on_linger(evutil_socket_t fd, short what, void *arg)
{
    struct refused *l = arg;
    char buf[4096];
    ssize_t r = 1;
    if (what & EV_READ)
        while ((r = recv(fd, buf, sizeof buf, MSG_DONTWAIT)) > 0)
            ;
    if ((what & EV_TIMEOUT) || r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR) || pd_now_s() - l->t0 > LINGER_S)
        linger_end(l);
}

/* A connection over the cap: a 503 with a JSON body, written here (the connection never reaches
 * evhttp), then kept until its client closes so that the answer is not lost to a reset. */
static void refuse(struct pd_http_front *f, int fd)
{
    f->st.rejected++;
    char why[256], msg[900];
    if (f->nofile >= 0)   /* (an operator who set no --max-connections looks for the limit that did) */
        snprintf(why, sizeof why, "the server has %d connections open, its limit (--max-connections %d, lowered to %d "
                 "by the open-file limit, ulimit -n %ld); try again later", f->n_conns, f->lim.max_connections, f->cap,
                 f->nofile);
    else
        snprintf(why, sizeof why, "the server has %d connections open, its limit (--max-connections); try again later",
                 f->n_conns);
    char *body = pd_http_error_body("server_error", NULL, why);
    int n = snprintf(msg, sizeof msg, "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\nRetry-After: 1\r\nConnection: close\r\n\r\n%s",
                     body ? strlen(body) : 0, body ? body : "");
    free(body);
    ssize_t w = send(fd, msg, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)w;   /* a fresh socket's send buffer takes it; if not, the client sees the close */
    shutdown(fd, SHUT_WR);
    struct refused *l = f->n_lingers < MAX_LINGER ? calloc(1, sizeof *l) : NULL;
    if (l)
        l->ev = event_new(f->base, fd, EV_READ | EV_PERSIST, on_linger, l);
    if (!l || !l->ev) {
        free(l);
        close(fd);
        return;
    }
    l->fd = fd;
    l->f = f;
    l->t0 = pd_now_s();
    l->next = f->lingers;
    if (f->lingers)
        f->lingers->prev = l;
    f->lingers = l;
    f->n_lingers++;
    struct timeval tv = ms_tv((int)(LINGER_S * 1000));
    event_add(l->ev, &tv);
}

/* The listening socket is readable at the cap: close the longest-idle connection if it has
 * waited long enough (evhttp's listener then takes the new one), else refuse the new ones. */
static void on_full(evutil_socket_t lfd, short what, void *arg)
{
    struct pd_http_front *f = arg;
    struct conn *old = NULL;
    double now = pd_now_s();
    for (struct conn *c = f->conns; c; c = c->next)
        if (c->state == WAIT && c->evcon && now - c->since >= EVICT_IDLE_S && (!old || c->since < old->since))
            old = c;
    if (old) {
        f->st.evicted++;
        evhttp_connection_free(old->evcon);
        return;
    }
    for (int k = 0; k < 16; k++) {
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
                pause_accept(f, errno);
            return;
        }
        f->starved_logged = 0;
        refuse(f, fd);
    }
}

/* ---- connections --------------------------------------------------------------------------- */

static void arm(struct conn *c, enum conn_state s)
{
    const struct pd_http_limits *l = &c->f->lim;
    c->state = s;
    c->since = pd_now_s();
    c->progress = c->since;
    /* BUSY: a check of the answer's progress every idle timeout */
    int ms = s == HEAD ? l->header_timeout_ms : s == BODY ? l->body_timeout_ms : l->idle_timeout_ms;
    struct timeval tv = ms_tv(ms);
    evtimer_add(c->timer, &tv);
}

/* Request bytes from offset `from`: the first empty line ends the headers (evhttp accepts CRLF
 * and bare LF line ends alike). */
static void scan(struct conn *c, struct evbuffer *b, size_t from)
{
    char buf[4096];
    size_t len = evbuffer_get_length(b);
    struct evbuffer_ptr p;
    while (c->state == HEAD && from < len && evbuffer_ptr_set(b, &p, from, EVBUFFER_PTR_SET) == 0) {
        ev_ssize_t n = evbuffer_copyout_from(b, &p, buf, sizeof buf);
        if (n <= 0)
            return;
        for (ev_ssize_t i = 0; i < n; i++) {
            if (buf[i] == '\n') {
                if (c->line_start) {
                    arm(c, BODY);
                    /* refused as soon as the head is whole, on the loop's next turn (not from inside
                     * libevent's read): libevent 2.1.12-stable-8 read "Transfer-Encoding: chunked\0"
                     * as chunked and waited for chunks until the body's deadline */
                    if (pd_http_field_faulted(&c->fs)) {
                        c->refuse = 1;
                        struct timeval now = {0, 0};
                        evtimer_add(c->timer, &now);
                    }
                    return;
                }
                pd_http_field_line_end(&c->fs);
                c->line_start = 1;
            } else {
                pd_http_field_byte(&c->fs, (unsigned char)buf[i], c->line_start);
                if (buf[i] != '\r')
                    c->line_start = 0;
            }
        }
        from += (size_t)n;
    }
}

static void start_request(struct conn *c, struct evbuffer *in, size_t from)
{
    arm(c, HEAD);
    c->line_start = 0;
    c->refuse = 0;
    memset(&c->fs, 0, sizeof c->fs);
    scan(c, in, from);
}

static void on_input(struct evbuffer *b, const struct evbuffer_cb_info *info, void *arg)
{
    struct conn *c = arg;
    if (!info->n_added || c->state == BUSY || c->state == BODY)
        return;
    size_t len = evbuffer_get_length(b), from = len >= info->n_added ? len - info->n_added : 0;
    if (c->state == WAIT)
        start_request(c, b, from);
    else
        scan(c, b, from);
}

static void on_output(struct evbuffer *b, const struct evbuffer_cb_info *info, void *arg)
{
    struct conn *c = arg;
    if (info->n_deleted)
        c->progress = pd_now_s();
    if (info->n_added && c->state != BUSY && !c->fixed && !c->fix_pending) {
        c->fix_pending = 1;
        event_active(c->fix, EV_TIMEOUT, 0);
    }
}

/* The whole answer to a request refused before any handler saw it: the status, a JSON error body
 * (invalid_request_error) holding msg, and the connection closed. Malloc'ed, its length in *len;
 * NULL when out of memory. */
static char *refusal_page(int code, const char *msg, size_t *len)
{
    char *txt = pd_http_error_body("invalid_request_error", NULL, msg);
    char *page = NULL;
    int n = txt ? asprintf(&page, "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                           "Connection: close\r\n\r\n%s", code, pd_http_reason(code), strlen(txt), txt) : -1;
    free(txt);
    if (n < 0)
        return NULL;
    *len = (size_t)n;
    return page;
}

/* evhttp answered a request no handler saw (it writes the whole page at once; the socket
 * writes it on a later turn of the loop): the same status with a JSON error body. */
static void on_fix(evutil_socket_t fd, short what, void *arg)
{
    struct conn *c = arg;
    c->fix_pending = 0;
    if (c->state == BUSY || c->fixed)
        return;
    struct evbuffer *out = bufferevent_get_output(c->bev);
    char head[32] = {0};
    int code = 0;
    /* a socket bufferevent keeps its output's start frozen except while it writes (libevent 2.1
     * does so on a connection that has answered before): a copy or a drain of it fails, and the
     * HTML page went out as it was, so it is thawed for the rewrite and frozen again */
    ev_ssize_t n = evbuffer_copyout(out, head, sizeof head - 1);
    int thawed = n < 0 && evbuffer_get_length(out) > 0 && evbuffer_unfreeze(out, 1) == 0;
    if (thawed)
        n = evbuffer_copyout(out, head, sizeof head - 1);
    /* the status line echoes the request's version, whatever it was */
    if (n < 12 || sscanf(head, "HTTP/%*d.%*d %d", &code) != 1 || code < 400) {
        if (thawed)
            evbuffer_freeze(out, 1);
        return;   /* 100 Continue */
    }
    const struct pd_http_limits *l = &c->f->lim;
    char msg[256];
    /* a byte no field may hold is named, whatever libevent made of it (a name cut by a NUL has no colon) */
    if (pd_http_field_fault(&c->fs, msg, sizeof msg))
        code = 400;
    else if (code == 413)
        snprintf(msg, sizeof msg, "the request body is over %lld bytes, this server's limit (or its chunked encoding "
                 "is malformed, or has chunk extensions, which this server does not read)", (long long)l->max_body_bytes);
    else if (code == 400)
        snprintf(msg, sizeof msg, "malformed HTTP request: request line, headers (at most %lld bytes) or chunked body",
                 (long long)l->max_header_bytes);
    else if (code == 501)
        snprintf(msg, sizeof msg, "unknown HTTP method: this server answers GET and POST");
    else if (code == 417)
        snprintf(msg, sizeof msg, "Expect: only 100-continue is understood");
    else
        snprintf(msg, sizeof msg, "the request was refused (%d)", code);
    size_t len;
    char *page = refusal_page(code, msg, &len);
    if (page) {
        c->fixed = 1;
        evbuffer_drain(out, evbuffer_get_length(out));
        evbuffer_add(out, page, len);
        free(page);
    }
    if (thawed)
        evbuffer_freeze(out, 1);
}

static void conn_drop(struct conn *c)
{
    struct pd_http_front *f = c->f;
    evbuffer_remove_cb_entry(bufferevent_get_input(c->bev), c->in_cb);
    evbuffer_remove_cb_entry(bufferevent_get_output(c->bev), c->out_cb);
    event_free(c->timer);
    event_free(c->fix);
    if (c->fd >= 0 && c->fd < f->by_fd_cap && f->by_fd[c->fd] == c)
        f->by_fd[c->fd] = NULL;
    if (c->prev)
        c->prev->next = c->next;
    else
        f->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    f->n_conns--;
    free(c);
    update_accept(f);
}

static void on_close(struct evhttp_connection *evcon, void *arg)
{
    struct conn *c = arg;
    if (c->closecb)
        c->closecb(evcon, c->closearg);
    conn_drop(c);
}

/* The socket's send buffer has room (the client reads what it is sent). */
static int writable(int fd)
{
    struct pollfd p = {fd, POLLOUT, 0};
    return poll(&p, 1, 0) == 1 && (p.revents & POLLOUT);
}

/* A deadline: a request not whole in time, an idle connection, or an answer its client has not
 * read for the idle timeout (the send buffer full, nothing written since). A busy loop may have
 * written nothing lately for its own reasons, hence the look at the socket rather than a write
 * timeout on the bufferevent (libevent fires those even when the socket is writable). */
static void on_timer(evutil_socket_t fd, short what, void *arg)
{
    struct conn *c = arg;
    if (!c->evcon)
        return;
    if (c->refuse && c->state == BODY && !c->fixed && !c->fix_pending) {
        /* a head with a byte no field may hold that libevent has not answered yet: the 400 now,
         * written to the socket (a few hundred bytes: its buffer is empty, nothing was answered),
         * and the connection closed, whatever of the request libevent still waits for */
        char msg[256];
        pd_http_field_fault(&c->fs, msg, sizeof msg);
        size_t len;
        char *page = refusal_page(400, msg, &len);
        int sfd = bufferevent_getfd(c->bev);
        if (page && sfd >= 0)
            (void)send(sfd, page, len, MSG_NOSIGNAL | MSG_DONTWAIT);   /* (a client gone: nobody to tell) */
        free(page);
        evhttp_connection_free(c->evcon);   /* on_close drops c */
        return;
    }
    if (c->state == BUSY) {
        const struct pd_http_limits *l = &c->f->lim;
        int stalled = evbuffer_get_length(bufferevent_get_output(c->bev)) > 0 &&
                      pd_now_s() - c->progress >= l->idle_timeout_ms / 1000.0 && !writable(c->fd);
        if (!stalled) {
            struct timeval tv = ms_tv(l->idle_timeout_ms);
            evtimer_add(c->timer, &tv);
            return;
        }
    }
    c->f->st.timed_out++;
    evhttp_connection_free(c->evcon);   /* on_close drops c */
}

/* evhttp makes a connection for an accepted socket: its bufferevent is ours. */
static struct bufferevent *on_bev(struct event_base *base, void *arg)
{
    struct pd_http_front *f = arg;
    f->st.accepted++;
    struct bufferevent *bev = bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE);
    struct conn *c = bev ? calloc(1, sizeof *c) : NULL;
    if (c) {
        c->timer = evtimer_new(base, on_timer, c);
        c->fix = event_new(base, -1, 0, on_fix, c);
    }
    if (!c || !c->timer || !c->fix) {
        /* out of memory: the connection is served, uncounted */
        if (c && c->timer)
            event_free(c->timer);
        free(c);
        return bev;
    }
    c->f = f;
    c->bev = bev;
    c->fd = -1;
    bufferevent_incref(bev);   /* until on_attach has seen evhttp take it */
    c->in_cb = evbuffer_add_cb(bufferevent_get_input(bev), on_input, c);
    c->out_cb = evbuffer_add_cb(bufferevent_get_output(bev), on_output, c);
    c->next = f->conns;
    if (f->conns)
        f->conns->prev = c;
    f->conns = c;
    c->fresh_next = f->fresh;
    f->fresh = c;
    event_active(f->attach_ev, EV_TIMEOUT, 0);
    f->n_conns++;
    f->starved_logged = 0;
    arm(c, WAIT);
    if (f->n_conns >= f->cap)
        update_accept(f);
    return bev;
}

/* Right after the accepts: the evhttp_connection each new bufferevent belongs to (its callback
 * argument), or none if evhttp already dropped it. */
static void on_attach(evutil_socket_t fd, short what, void *arg)
{
    struct pd_http_front *f = arg;
    struct conn *c;
    while ((c = f->fresh)) {
        f->fresh = c->fresh_next;
        struct bufferevent *bev = c->bev;
        bufferevent_data_cb rcb = NULL;
        void *cbarg = NULL;
        bufferevent_getcb(bev, &rcb, NULL, NULL, &cbarg);
        int sfd = rcb ? bufferevent_getfd(bev) : -1;
        if (sfd >= f->by_fd_cap) {
            int cap = sfd * 2 + 64;
            struct conn **t = realloc(f->by_fd, (size_t)cap * sizeof *t);
            if (t) {
                memset(t + f->by_fd_cap, 0, (size_t)(cap - f->by_fd_cap) * sizeof *t);
                f->by_fd = t;
                f->by_fd_cap = cap;
            }
        }
        if (!rcb || sfd < 0 || sfd >= f->by_fd_cap) {
            if (rcb)
                evhttp_connection_free(cbarg);   /* cannot be tracked (out of memory) */
            conn_drop(c);
        } else {
            c->evcon = cbarg;
            c->fd = sfd;
            f->by_fd[sfd] = c;
            evhttp_connection_set_closecb(c->evcon, on_close, c);
        }
        bufferevent_decref(bev);
    }
}

static struct conn *conn_of(struct pd_http_front *f, struct evhttp_connection *evcon)
{
    if (!f || !evcon)
        return NULL;
    int fd = bufferevent_getfd(evhttp_connection_get_bufferevent(evcon));
    struct conn *c = fd >= 0 && fd < f->by_fd_cap ? f->by_fd[fd] : NULL;
    return c && c->evcon == evcon ? c : NULL;
}

static void on_reply_done(struct evhttp_request *h, void *arg)
{
    struct conn *c = arg;
    struct evbuffer *in = bufferevent_get_input(c->bev);
    /* evhttp reads the next request under its own limits (header bytes, body bytes, deadlines) */
    bufferevent_setwatermark(c->bev, EV_READ, 0, 0);
    if (evbuffer_get_length(in))
        start_request(c, in, 0);   /* the next request is already coming */
    else
        arm(c, WAIT);
}

static void on_route(struct evhttp_request *h, void *arg)
{
    struct route *r = arg;
    struct conn *c = conn_of(r->f, evhttp_request_get_connection(h));
    if (c) {
        arm(c, BUSY);
        evhttp_request_set_on_complete_cb(h, on_reply_done, c);
        /* while the request is answered libevent reads the socket on, with no limit (to see a close;
         * so does pd_http_set_closecb): a client writing requests back to back without reading the
         * answers was buffered whole, 2.3 GB in 7 s. At max_header_bytes unread the connection is
         * no longer read (the kernel's buffers then push back on the client) until this answer is
         * written; a client that never reads it is closed by the idle deadline */
        bufferevent_setwatermark(c->bev, EV_READ, 0, (size_t)r->f->lim.max_header_bytes);
    }
    if (h->major != 1 || (h->minor != 0 && h->minor != 1)) {
        /* libevent 2.1 takes HTTP/0.x and HTTP/1.x of any minor, and echoes it in the status line */
        h->major = 1;
        h->minor = 1;
        evhttp_add_header(evhttp_request_get_output_headers(h), "Connection", "close");
        pd_http_error(h, 505, "invalid_request_error", NULL, "HTTP version not supported: HTTP/1.0 or HTTP/1.1 only");
        return;
    }
    char msg[256];
    if (c && pd_http_field_fault(&c->fs, msg, sizeof msg)) {
        evhttp_add_header(evhttp_request_get_output_headers(h), "Connection", "close");
        pd_http_error(h, 400, "invalid_request_error", NULL, "%s", msg);
        return;
    }
    int code;
    const char *framing = pd_http_bad_framing(h, &code, msg, sizeof msg);
    if (framing) {
        /* whatever follows on the connection is unread: it may be the smuggled request */
        evhttp_add_header(evhttp_request_get_output_headers(h), "Connection", "close");
        pd_http_error(h, code, "invalid_request_error", NULL, "%s", framing);
        return;
    }
    /* CORS as vLLM's server answers it by default (every origin, method and header, no
     * credentials: the key is a bearer token, not a cookie): a browser's client (the openai SDK
     * with dangerouslyAllowBrowser, a web chat UI) reads the answers, and its preflight OPTIONS
     * gets the route's methods */
    struct evkeyvalq *hin = evhttp_request_get_input_headers(h), *hout = evhttp_request_get_output_headers(h);
    const char *origin = evhttp_find_header(hin, "Origin");
    if (origin)
        evhttp_add_header(hout, "Access-Control-Allow-Origin", "*");
    if (evhttp_request_get_command(h) == EVHTTP_REQ_OPTIONS && origin &&
        evhttp_find_header(hin, "Access-Control-Request-Method")) {
        const char *asked = evhttp_find_header(hin, "Access-Control-Request-Headers");
        evhttp_add_header(hout, "Access-Control-Allow-Methods",
                          !r->methods ? "GET, HEAD, POST" : r->methods & EVHTTP_REQ_POST ? "POST" : "GET, HEAD");
        if (asked)   /* (evhttp_add_header refuses a value with CR or LF) */
            evhttp_add_header(hout, "Access-Control-Allow-Headers", asked);
        evhttp_add_header(hout, "Access-Control-Max-Age", "600");
        evhttp_add_header(hout, "Content-Length", "0");
        evhttp_send_reply(h, 204, "No Content", NULL);
        return;
    }
    if (r->methods && !(evhttp_request_get_command(h) & r->methods)) {
        const char *allow = r->methods & EVHTTP_REQ_POST ? "POST" : "GET, HEAD";
        r->f->st.wrong_method++;
        evhttp_add_header(evhttp_request_get_output_headers(h), "Allow", allow);
        pd_http_error(h, 405, "invalid_request_error", NULL, "use %s", r->methods & EVHTTP_REQ_POST ? "POST" : "GET");
        return;
    }
    r->cb(h, r->arg);
}

void pd_http_set_closecb(struct evhttp_request *h, void (*cb)(struct evhttp_connection *, void *), void *arg)
{
    struct evhttp_connection *evcon = evhttp_request_get_connection(h);
    if (!evcon)
        return;
    struct conn *c = conn_of(find_front(evhttp_connection_get_server(evcon), NULL), evcon);
    if (c) {
        c->closecb = cb;
        c->closearg = arg;
    } else {
        evhttp_connection_set_closecb(evcon, cb, arg);
    }
    /* libevent stops reading a connection while its request is answered, so a client that leaves
     * would be seen only at the next write (a request waiting upstream or in a queue could wait
     * long for one); reading on lets cb run as soon as the client goes. Without evhttp's read
     * callback, as libevent itself reads while it writes an answer: that callback, run by the bytes
     * of a request pipelined behind this one, ended the process ("evhttp_read_cb: illegal
     * connection state 7"); the bytes wait in the input (bounded, see on_route) for the next turn */
    if (cb) {
        struct bufferevent *bev = evhttp_connection_get_bufferevent(evcon);
        bufferevent_data_cb wcb = NULL;
        bufferevent_event_cb ecb = NULL;
        void *cbarg = NULL;
        bufferevent_getcb(bev, NULL, &wcb, &ecb, &cbarg);
        bufferevent_setcb(bev, NULL, wcb, ecb, cbarg);
        bufferevent_enable(bev, EV_READ);
    }
}

/* ---- the front ----------------------------------------------------------------------------- */

/* Whether `want` (at most 8) more descriptors can be opened now: a new descriptor takes the lowest
 * free number, which must be below the open-file limit (those inherited above it do not count),
 * so the only sure count is to take them. */
static int descriptors_free(int want)
{
    int got[8], n = 0;
    while (n < want && n < 8 && (got[n] = n ? fcntl(got[0], F_DUPFD_CLOEXEC, 0) : open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0)
        n++;
    for (int i = 0; i < n; i++)
        close(got[i]);
    return n == want;
}

long pd_http_open_file_limit(void)
{
    struct rlimit rl;
    return getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY ? (long)rl.rlim_cur : -1;
}

static int no_descriptors(pd_err *e, const char *what)
{
    long lim = pd_http_open_file_limit();
    return pd_err_set(e, PD_EINVAL, "the open-file limit (ulimit -n %ld) leaves no descriptor for %s once this process "
                      "has opened its own; raise it (ulimit -n %d or more)", lim, what, PD_HTTP_FD_RESERVE + 128);
}

/* The event loop takes up to 5 descriptors (epoll, its wake-up pipe, the signals' socket pair), the
 * listener one, a connection one or two: without them libevent exits the process ("[err]
 * evsig_init_: socketpair") or its failure read as out of memory. */
#define LOOP_FDS 8

int pd_http_base_new(struct event_base **out, pd_err *e)
{
    *out = NULL;
    if (!descriptors_free(LOOP_FDS))
        return no_descriptors(e, "the event loop");
    errno = 0;
    *out = event_base_new();
    if (!*out)
        return pd_err_set(e, PD_ENOMEM, "cannot create the event loop: %s", errno ? strerror(errno) : "out of memory");
    return 0;
}

int pd_http_front_new(struct event_base *base, const struct pd_http_limits *lim, const char *host, int port,
                      struct pd_http_front **out, pd_err *e)
{
    struct pd_http_front *f = calloc(1, sizeof *f);
    if (!f)
        return pd_err_set(e, PD_ENOMEM, "out of memory");
    f->lim = *lim;
    struct pd_http_limits *l = &f->lim;
    if (l->max_connections <= 0)
        l->max_connections = 1024;
    if (l->idle_timeout_ms <= 0)
        l->idle_timeout_ms = 60000;
    if (l->header_timeout_ms <= 0)
        l->header_timeout_ms = 30000;
    if (l->body_timeout_ms <= 0)
        l->body_timeout_ms = 30000;
    if (l->max_header_bytes <= 0)
        l->max_header_bytes = 65536;
    if (l->max_body_bytes <= 0)
        l->max_body_bytes = 8 << 20;
    f->cap = l->max_connections;
    /* fds_per_connection descriptors per connection, and the process needs its own: a proxy
     * capped at the limit less the reserve ran out of descriptors for its upstream connections,
     * and took the failures for its instances' (ejecting healthy ones); and those it holds beside
     * them (fds_reserved: the proxy's idle kept-alive connections, which a cap that ignored them
     * left to take the descriptors of the clients it admitted) */
    if (l->fds_per_connection < 1)
        l->fds_per_connection = 1;
    if (l->fds_reserved < 0)
        l->fds_reserved = 0;
    long nofile = pd_http_open_file_limit();
    f->nofile = -1;
    if (nofile >= 0) {
        long room = (nofile - PD_HTTP_FD_RESERVE - l->fds_reserved) / l->fds_per_connection;
        if (f->cap > room) {
            f->cap = room > 1 ? (int)room : 1;
            f->nofile = nofile;
        }
    }
    f->base = base;
    f->http = evhttp_new(base);
    f->full_ev = NULL;
    f->resume_ev = evtimer_new(base, on_resume, f);
    f->attach_ev = event_new(base, -1, 0, on_attach, f);
    if (!f->http || !f->resume_ev || !f->attach_ev) {
        pd_http_front_free(f);
        return pd_err_set(e, PD_ENOMEM, "out of memory");
    }
    evhttp_set_bevcb(f->http, on_bev, f);
    /* libevent's default set (its routes answer a method they do not take with a 405 and Allow),
     * plus OPTIONS for the browsers' CORS preflight */
    evhttp_set_allowed_methods(f->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD | EVHTTP_REQ_PUT |
                                            EVHTTP_REQ_DELETE | EVHTTP_REQ_OPTIONS);
    evhttp_set_max_headers_size(f->http, (ev_ssize_t)l->max_header_bytes);
    evhttp_set_max_body_size(f->http, (ev_ssize_t)l->max_body_bytes);
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct evutil_addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_protocol = IPPROTO_TCP,
                                    .ai_flags = EVUTIL_AI_PASSIVE | EVUTIL_AI_ADDRCONFIG}, *ai = NULL;
    if (evutil_getaddrinfo(host, ps, &hints, &ai) != 0 || !ai) {
        pd_http_front_free(f);
        return pd_err_set(e, PD_EIO, "cannot listen on %s:%d: unknown host", host, port);
    }
    f->lev = evconnlistener_new_bind(base, NULL, NULL, LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC | LEV_OPT_REUSEABLE,
                                     -1, ai->ai_addr, (int)ai->ai_addrlen);
    evutil_freeaddrinfo(ai);
    if (!f->lev) {
        int err = errno;
        pd_http_front_free(f);
        return pd_err_set(e, PD_EIO, "cannot listen on %s:%d: %s", host, port, strerror(err));
    }
    if (!evhttp_bind_listener(f->http, f->lev)) {
        evconnlistener_free(f->lev);
        f->lev = NULL;
        pd_http_front_free(f);
        return pd_err_set(e, PD_ENOMEM, "out of memory");
    }
    evconnlistener_set_error_cb(f->lev, on_accept_error);
    int lfd = evconnlistener_get_fd(f->lev);
    f->full_ev = event_new(base, lfd, EV_READ | EV_PERSIST, on_full, f);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (!f->full_ev || getsockname(lfd, (struct sockaddr *)&ss, &sl)) {
        int err = f->full_ev ? errno : ENOMEM;
        pd_http_front_free(f);
        return pd_err_set(e, PD_EIO, "cannot listen on %s:%d: %s", host, port, strerror(err));
    }
    f->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port);
    /* a limit that the descriptors already open (the listener's last) leave no room under for one
     * connection: every accept would fail with EMFILE, and no connection closing could free one,
     * so clients would wait in the backlog for ever while the server said it waited for descriptors */
    if (!descriptors_free(l->fds_per_connection + 1)) {
        char what[64];
        snprintf(what, sizeof what, "a connection on port %d", f->port);
        pd_http_front_free(f);
        return no_descriptors(e, what);
    }
    pthread_mutex_lock(&reg_mu);
    f->reg_next = reg;
    reg = f;
    pthread_mutex_unlock(&reg_mu);
    *out = f;
    return 0;
}

/* cb answers requests for path (exact match), or every other path when path is NULL, whose
 * method is among `methods` (a mask of enum evhttp_cmd_type; 0: any; GET takes HEAD too). */
static int front_route(struct pd_http_front *f, const char *path, int methods,
                       void (*cb)(struct evhttp_request *, void *), void *arg)
{
    struct route *r = malloc(sizeof *r);
    if (!r)
        return PD_ENOMEM;
    if (methods & EVHTTP_REQ_GET)
        methods |= EVHTTP_REQ_HEAD;
    *r = (struct route){f, methods, cb, arg, f->routes};
    f->routes = r;
    if (!path) {
        evhttp_set_gencb(f->http, on_route, r);
        return 0;
    }
    return evhttp_set_cb(f->http, path, on_route, r) == 0 ? 0 : PD_EINVAL;
}

int pd_http_front_api(struct pd_http_front *f, const struct pd_http_api *api, void *arg)
{
    const struct {
        const char *path;
        int methods;
        void (*cb)(struct evhttp_request *, void *);
    } routes[] = {
        {"/v1/completions", EVHTTP_REQ_POST, api->completions}, {"/v1/chat/completions", EVHTTP_REQ_POST, api->chat},
        {"/v1/models", EVHTTP_REQ_GET, api->models},
        {"/health", EVHTTP_REQ_GET, api->health ? api->health : pd_http_health},
        {"/metrics", EVHTTP_REQ_GET, api->metrics},              {"/expert_stats", EVHTTP_REQ_GET, api->expert_stats},
        {"/readiness", EVHTTP_REQ_GET, api->readiness},          {NULL, 0, api->other},
    };
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++) {
        if (!routes[i].cb)
            continue;
        int rc = front_route(f, routes[i].path, routes[i].methods, routes[i].cb, arg);
        if (rc)
            return rc;
    }
    return 0;
}

int pd_http_front_port(const struct pd_http_front *f)
{
    return f->port;
}


void pd_http_front_metrics(const struct pd_http_front *f, struct evbuffer *b)
{
    evbuffer_add_printf(b,
                        "# TYPE pdmoe_http_connections gauge\npdmoe_http_connections %d\n"
                        "# TYPE pdmoe_http_connections_accepted_total counter\npdmoe_http_connections_accepted_total %llu\n"
                        "# TYPE pdmoe_http_max_connections gauge\npdmoe_http_max_connections %d\n"
                        "# TYPE pdmoe_http_connections_closed_total counter\n"
                        "pdmoe_http_connections_closed_total{why=\"over_limit_503\"} %llu\n"
                        "pdmoe_http_connections_closed_total{why=\"idle_evicted\"} %llu\n"
                        "pdmoe_http_connections_closed_total{why=\"timeout\"} %llu\n"
                        "# TYPE pdmoe_http_accept_paused_total counter\npdmoe_http_accept_paused_total %llu\n"
                        "# TYPE pdmoe_http_method_not_allowed_total counter\npdmoe_http_method_not_allowed_total %llu\n",
                        f->n_conns, (unsigned long long)f->st.accepted, f->cap, (unsigned long long)f->st.rejected, (unsigned long long)f->st.evicted,
                        (unsigned long long)f->st.timed_out, (unsigned long long)f->st.accept_paused,
                        (unsigned long long)f->st.wrong_method);
}

void pd_http_front_free(struct pd_http_front *f)
{
    if (!f)
        return;
    pthread_mutex_lock(&reg_mu);
    for (struct pd_http_front **p = &reg; *p; p = &(*p)->reg_next)
        if (*p == f) {
            *p = f->reg_next;
            break;
        }
    pthread_mutex_unlock(&reg_mu);
    f->closing = 1;
    if (f->full_ev)
        event_free(f->full_ev);   /* before evhttp_free closes the listening socket */
    /* every connection's close callback runs, and drops it */
    if (f->http)
        evhttp_free(f->http);
    else if (f->lev)
        evconnlistener_free(f->lev);
    on_attach(-1, 0, f);   /* the ones accepted on the last turn of the loop */
    while (f->lingers)
        linger_end(f->lingers);
    while (f->routes) {
        struct route *r = f->routes;
        f->routes = r->next;
        free(r);
    }
    if (f->resume_ev)
        event_free(f->resume_ev);
    if (f->attach_ev)
        event_free(f->attach_ev);
    free(f->by_fd);
    free(f);
}

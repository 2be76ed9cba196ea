/* The listening side of an HTTP server (pd/ and proxy/ alike): an evhttp whose connections are
 * counted, capped and timed, so that clients cannot starve it of file descriptors or of its loop.
 *
 * - At most max_connections connections (never more than the open-file limit leaves room for).
 *   At the cap, a connection idle for a second or more is closed to make room; if none is, the
 *   new one gets a 503 with a JSON error body (written here, outside evhttp) and is closed.
 * - A connection with no request in progress is closed after idle_timeout_ms; a request's line
 *   and headers must arrive within header_timeout_ms of its first byte, its body within
 *   body_timeout_ms of the end of its headers. Once a handler has the request no read deadline
 *   applies (a generation may take minutes; a client that leaves is seen by the close callback);
 *   a reply the client does not read for idle_timeout_ms closes the connection.
 * - Requests pipelined on a connection are answered in order, one at a time; while one is
 *   answered at most max_header_bytes more are read from the connection.
 * - accept() failing for lack of descriptors (EMFILE, ENFILE) first asks the process to close what
 *   it can spare (limits.shed) and retries; failing still, it pauses accepting for 100 ms rather
 *   than retrying at once (libevent's listener would spin), logged once per episode.
 * - libevent 2.1 answers malformed, oversized (413) or unsupported requests itself with an HTML
 *   page before any handler runs (2.2's evhttp_set_errorcb is not in Debian 12's 2.1.12): such an
 *   answer is rewritten at the connection's output into the OpenAI-style JSON error body.
 * - A head holding a byte no field may (a NUL, a CR not ending a line, another control character
 *   but HTAB: RFC 9110 5.5), or framing a request could be smuggled through, gets a 400 naming the
 *   header (http/head.h) and the connection is closed.
 *
 * Handlers are registered through the front (it must see each request reach its handler and its
 * reply end), and a handler that wants to hear of its client leaving uses pd_http_set_closecb,
 * never evhttp_connection_set_closecb (the front holds each connection's close callback). */
#ifndef PD_HTTP_FRONT_H
#define PD_HTTP_FRONT_H

#include <event2/event.h>
#include <event2/http.h>
#include <stdint.h>

#include "core/err.h"

/* 0 in any field: its default. */
struct pd_http_limits {
    int max_connections;            /* default 1024 */
    int idle_timeout_ms;            /* default 60000 */
    int header_timeout_ms;          /* default 30000 */
    int body_timeout_ms;            /* default 30000 */
    int64_t max_header_bytes;       /* request line and headers; default 65536 */
    int64_t max_body_bytes;         /* default 8 MiB */
    int fds_per_connection;         /* descriptors a connection may need at once: 1 (a server; the
                                     * default), 2 (the proxy: the client's and its upstream one); the
                                     * cap leaves the open-file limit room for them all */
    int fds_reserved;               /* descriptors the process may hold besides its connections' and
                                     * PD_HTTP_FD_RESERVE (the proxy's idle upstream connections and
                                     * /health checks): the cap leaves room for them too */
    /* accept() found no descriptor (EMFILE, ENFILE): the process closes what it can spare (the
     * proxy's idle upstream connections) and returns how many; accepting is then tried again at
     * once rather than paused. NULL, or 0 closed: paused as below. */
    int (*shed)(void *arg);
    void *shed_arg;
    /* events an operator should see (descriptors exhausted), one line each; NULL: none */
    void (*log)(void *arg, const char *line);
    void *log_arg;
};

/* Descriptors the connection cap leaves to the process itself (model files, the event loop,
 * threads), besides fds_reserved. */
#define PD_HTTP_FD_RESERVE 32

/* The open-file limit (RLIMIT_NOFILE's soft one), or -1 when there is none. */
long pd_http_open_file_limit(void);

/* Counters for /metrics. */
struct pd_http_stats {
    uint64_t accepted;              /* connections accepted (a client's keep-alive connection counts once) */
    uint64_t rejected;              /* 503 at the cap */
    uint64_t evicted;               /* idle connections closed to make room */
    uint64_t timed_out;             /* closed by the idle, header or body deadline */
    uint64_t accept_paused;         /* accept() failed for lack of descriptors */
    uint64_t wrong_method;          /* 405: a method its route does not take */
};

struct pd_http_front;

/* A new event loop (libevent's event_base_new), or the reason there is none: it needs descriptors
 * of its own, and under a low open-file limit their lack was reported as "out of memory". */
int pd_http_base_new(struct event_base **out, pd_err *e);

/* An evhttp on base listening on host:port (port 0: ephemeral). A PD_EINVAL when the open-file
 * limit leaves no descriptor for a connection once the listener is open (no accept could work). */
int pd_http_front_new(struct event_base *base, const struct pd_http_limits *lim, const char *host, int port,
                      struct pd_http_front **out, pd_err *e);
/* The OpenAI-compatible API the server and the proxy both answer, each path with its methods:
 * POST /v1/completions and /v1/chat/completions; GET /v1/models, /health (pd_http_health),
 * /metrics and /expert_stats; `other` for every other path. Each handler gets arg. Another method
 * gets a 405 with an Allow header and a JSON error naming the method taken ("use GET"), counted in
 * wrong_method; the GET routes take HEAD too (the answer without its body). */
struct pd_http_api {
    void (*completions)(struct evhttp_request *, void *);
    void (*chat)(struct evhttp_request *, void *);
    void (*models)(struct evhttp_request *, void *);
    void (*metrics)(struct evhttp_request *, void *);
    void (*expert_stats)(struct evhttp_request *, void *);
    void (*readiness)(struct evhttp_request *, void *);   /* GET /readiness; NULL: none (a 404) */
    void (*health)(struct evhttp_request *, void *);      /* GET /health; NULL: pd_http_health */
    void (*other)(struct evhttp_request *, void *);
};
int pd_http_front_api(struct pd_http_front *f, const struct pd_http_api *api, void *arg);
int pd_http_front_port(const struct pd_http_front *f);
/* The connections open, the cap and the counters above as Prometheus text (pdmoe_http_*), appended to b. */
void pd_http_front_metrics(const struct pd_http_front *f, struct evbuffer *b);
/* Closes every connection (their close callbacks run), the listener and the evhttp. */
void pd_http_front_free(struct pd_http_front *f);
/* Calls cb(connection, arg) as soon as h's connection closes (the connection is read while h is
 * answered, to see the client go), unless cb is replaced first; cb NULL: no call. */
void pd_http_set_closecb(struct evhttp_request *h, void (*cb)(struct evhttp_connection *, void *), void *arg);

#endif

/* The proxy's parts (proxy.h): the state they share and what each offers the others.
 *   proxy.c    create/run/stop/destroy, the drain, and what the parts share;
 *   complete.c completions (prefill, then decode), relayed to the client;
 *   health.c   which instances are up: /health checks, ejection and backoff, GET /readiness;
 *   fanout.c   the GET routes answered from the instances: /v1/models, /expert_stats;
 *   metrics.c  the latency histograms and GET /metrics;
 *   pool.c     the connections to the instances: kept alive, lent to one request at a time.
 * Everything runs on the proxy's one event loop. */
#ifndef PD_PROXY_INTERNAL_H
#define PD_PROXY_INTERNAL_H

#include "http/http.h"
#include "http/prom.h"
#include "proxy/proxy.h"

#include <event2/http.h>
#include <stdint.h>

struct pd_proxy;
struct px_conn;
struct px_get;

struct instance {
    struct pd_proxy *px;
    const char *role;            /* "prefill" or "decode" */
    char host[64];
    int port;
    int load;                    /* requests in flight through this proxy */
    uint64_t failures, ejections;
    int up;                      /* admitted: gets requests while any instance is up; 0 until it first answers */
    int answered;                /* it has answered once since the proxy started */
    int said_waiting;            /* failed checks before its first answer (the first is logged) */
    int strikes;                 /* failures since it was last admitted: the backoff's exponent */
    double probe_at;             /* the next /health check */
    double silent_since;         /* when its /health first failed since it last answered; 0: it answers */
    int failed_checks;           /* /health checks failed in a row (o.health_failures of them take it out) */
    struct px_get *probe;        /* the check in flight, or NULL */
    struct px_conn *idle;        /* its idle keep-alive connections (pool.c), the latest used first */
    int n_idle;
    struct px_conn *closing;     /* connections to be freed on the loop's next turn (pool.c) */
    uint64_t conns_opened, conns_reused;   /* connections opened to it; requests sent on one kept alive */
    double local_said_at;        /* when a failure for the proxy host's lack (pool.c) was last logged */
    double weights_said_at;      /* (prefill) when a decode's refusal of its KV for other weights was last logged */
};

struct job;
struct stats_job;

struct pd_proxy {
    struct pd_proxy_opts o;
    int keep;                        /* idle connections kept per instance (o.upstream_keepalive, or the
                                      * default the open-file limit leaves room for); 0: none */
    struct instance p[PD_PROXY_MAX_INSTANCES], d[PD_PROXY_MAX_INSTANCES];
    int np, nd;
    struct event_base *base;
    struct pd_http_front *front;
    struct event *sigint, *sigterm;
    int port;
    struct event *stop, *tick;       /* pd_proxy_stop's graceful stop, the health checks */
    int stopping;                    /* stopping: new requests get a 503 */
    int draining;                    /* a signal came with shutdown_timeout_s: new requests get a 503 */
    double drain_deadline;
    struct event *drain_tick;
    struct job *jobs;                /* every completion in flight */
    struct stats_job *stats_running; /* the /expert_stats fan-out in flight (one at a time), or NULL */
    struct stats_job *stats_waiting; /* those waiting for it, first come first */
    struct pd_route *route;          /* who prefills: the prefill instances, or the colocated ones */
    /* metrics */
    uint64_t requests, completed, retries, cancelled, bad_requests, prefill_failed, decode_failed;
    uint64_t stale_retries;      /* requests sent again on a fresh connection: a kept-alive one was closed */
    uint64_t local_limit;        /* connects of requests failed for the proxy host's lack (ports, descriptors):
                                  * each instance a request tried so, whether another then took it or not */
    uint64_t queue_full;         /* requests answered 429: every instance of a role had its queue full */
    int64_t body_bytes;          /* the request bodies of the jobs in flight */
    uint64_t body_full;          /* requests answered 503: the bodies in flight were at their cap */
    uint64_t shutting_down;      /* requests answered 503: the proxy was draining or stopping */
    uint64_t routed[PD_ROUTE_N_WHY];                 /* prefill choices, by reason */
    uint64_t route_chunks, route_matched;            /* prompt chunks routed, and matched where they went */
    struct pd_hist ttft, tpot, itl, e2e;
};

/* The k-th of all instances, the prefill ones first (k < np + nd). */
static inline struct instance *nth(struct pd_proxy *px, int k)
{
    return k < px->np ? &px->p[k] : &px->d[k - px->np];
}


#define reply_error(h, code, type, ...) pd_http_error(h, code, type, NULL, __VA_ARGS__)

/* the read and write timeout of a request whose answer has no deadline: none, in effect (30 days) */
#define PX_NO_DEADLINE_S (30 * 86400)
/* idle connections kept per instance without --upstream-keepalive (fewer when the open-file limit
 * is low: see keepalive() in proxy.c) */
#define PX_DEFAULT_KEEPALIVE 16
/* /health checks failed in a row that take an instance out without --health-failures */
#define PX_DEFAULT_HEALTH_FAILURES 3

/* pool.c */
/* A connection to `in` for one request whose answer may take timeout_ms (0: no deadline): an idle
 * one kept alive, if the pool holds one still open and fresh is 0, else a new one. NULL: out of
 * memory. Its request is made on px_conn_evcon(c); px_conn_put gives it back. */
struct px_conn *px_conn_get(struct instance *in, int timeout_ms, int fresh);
struct evhttp_connection *px_conn_evcon(const struct px_conn *c);
/* 1 if it carried an earlier request (the server may have closed it as this one was sent). */
int px_conn_reused(const struct px_conn *c);
/* 1 if any byte of the current request's answer has arrived. */
int px_conn_heard(const struct px_conn *c);
/* Its request is over: with a whole answer (answered 1) it goes back to the pool, if still open and
 * there is room; else it is closed (a failed or cancelled request's). NULL: nothing. */
void px_conn_put(struct px_conn *c, int answered);
/* `in`'s idle connections unused too long, or closed by the server, are freed (from the tick). */
void px_pool_sweep(struct instance *in, double now);
/* Frees `in`'s idle connections at once. */
void px_pool_free(struct instance *in);
/* At the proxy's destroy, before the loop's base is freed: its idle connections and those waiting
 * for the loop's next turn to be freed. */
void px_pool_destroy(struct instance *in);
/* Closes every idle pooled connection (of all instances) at once, for a connect that found no
 * descriptor free; how many were closed. */
int px_pool_shed(struct pd_proxy *px);
/* 1 if c's request failed (err: errno in its callback) because its connect() found no descriptor
 * (EMFILE, ENFILE): the caller sheds the pool and tries once more before answering 503. */
int px_conn_out_of_fds(const struct px_conn *c, int err);
/* When c's request failed (err: errno in its callback) because its connect() found the proxy's
 * host short of a port or a descriptor: what is short, by name (not the instance's failure). */
const char *px_conn_local_failure(const struct px_conn *c, int err);
/* Logs a local failure towards `in` (at most every 10 s per instance). */
void px_say_local(struct instance *in, const char *local);

/* GET `path` from an instance on a pooled connection, within timeout_ms (0: no deadline). cb is
 * called once, later, never from px_get_from: with r NULL or of code 0 when it failed, local then
 * non-NULL when the proxy's host was short (px_conn_local_failure). A kept-alive connection the
 * server closed before a byte of the answer came is retried once on a fresh one. NULL: out of
 * memory (cb is never called). */
struct px_get *px_get_from(struct pd_proxy *px, struct instance *in, const char *path, int timeout_ms,
                           void (*cb)(struct evhttp_request *r, const char *local, void *arg), void *arg);
/* At destroy: the GET dropped, its callback never called. */
void px_get_cancel(struct px_get *g);

/* complete.c */
/* POST /v1/completions, /v1/chat/completions. */
void px_on_completions(struct evhttp_request *h, void *arg);
void px_on_chat(struct evhttp_request *h, void *arg);
/* The requests in flight on `in` of which it has sent nothing for silent_s fail as if its answer had
 * not come (it stopped answering its checks). */
void px_fail_in_flight(struct pd_proxy *px, const struct instance *in, double silent_s);
/* The proxy stops: every completion in flight answered (an error event and [DONE], or a 503), its
 * upstream request cancelled. */
void px_stop_jobs(struct pd_proxy *px);

/* proxy.c */
/* The key the instances want: their own, or the one clients give this proxy. */
const char *px_backend_key(const struct pd_proxy *px);
/* 1 if the client sent the API key, else a 401 is sent and 0 returned. */
int px_authorised(struct pd_proxy *px, struct evhttp_request *h);
/* The least-loaded instance not in `skip`, among those up if any is (else among all). */
int px_pick(struct instance *in, int n, unsigned skip);

/* health.c */
/* A request to `in` failed (by_probe 0) or its /health check did (1): out, next check after a backoff. */
void px_eject(struct instance *in, int by_probe);
/* `in` answered a request or its /health check: up (again). */
void px_admit(struct instance *in);
/* The instances that prefill (route.h indexes them): the prefill ones, or the colocated servers. */
struct instance *px_routed(struct pd_proxy *px, int *n);
/* in's index among the routed instances, or -1. */
int px_routed_index(const struct instance *in);
/* The health-check timer (px->tick, arg px): GET /health of each instance that is due. */
void px_on_tick(evutil_socket_t fd, short what, void *arg);
/* GET /readiness: 200 when a prefill (if any) and a decode instance are up, else 503; a JSON body. */
void px_on_readiness(struct evhttp_request *h, void *arg);

/* fanout.c */
void px_on_models(struct evhttp_request *h, void *arg);
void px_on_expert_stats(struct evhttp_request *h, void *arg);
/* The proxy stops: the /expert_stats requests, the one in flight and those waiting for it, get a 503. */
void px_stop_fanouts(struct pd_proxy *px);
/* pd_proxy_destroy: the fan-out in flight (its GETs cancelled) and any waiting, freed. */
void px_free_fanouts(struct pd_proxy *px);
/* in's /health has been silent silent_s: the fan-out's GET to it fails (a 502 naming it). */
void px_fanout_fail_hung(struct pd_proxy *px, const struct instance *in, double silent_s);

/* metrics.c */
void px_hists_init(struct pd_proxy *px);
void px_on_metrics(struct evhttp_request *h, void *arg);

#endif

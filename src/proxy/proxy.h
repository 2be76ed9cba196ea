/* The PD proxy: the OpenAI-compatible endpoint clients talk to. For each completion it picks the
 * least-loaded prefill instance and sends it the request with max_tokens = 1, stream = false and
 * kv_transfer_params {"do_remote_decode": true}; it retries another prefill instance when one
 * fails (connection refused, 5xx; never on a 4xx, which goes back to the client as it is); then it
 * sends the original request plus the prefill's kv_transfer_params to the least-loaded decode
 * instance and relays its answer, streamed or not. A decode instance's 403 naming
 * kv_transfer_params (the prefill instance no longer holds the KV: it restarted, or the lease
 * expired while the decode queued) is not passed on: the request is prefilled again, within
 * --retries prefills. If the decode instance fails, a streaming
 * client gets an error event and [DONE], a non-streaming one a 502 with a JSON error: never a 200
 * with an empty body. A client that disconnects has its decode request cancelled, which frees the
 * KV on the decode instance (the prefill's lease is released when the decode pulled, or expires).
 * Load of an instance = requests in flight through this proxy. With no prefill instance the proxy
 * balances colocated servers (given as --decode): the baseline disaggregation is measured against.
 * Which instance prefills (a prefill instance, or a colocated server) follows `route`'s policy,
 * by default cache-aware (proxy/route.h: the instance most likely to hold the prompt's prefix in
 * its KV cache, unless the loads are imbalanced); decode instances are chosen least-loaded (they
 * receive the KV, they do not prefill).
 *
 * Connections to the instances are kept alive and reused (proxy/pool.c), at most upstream_keepalive
 * idle per instance: a connection per request left one socket in TIME_WAIT per request on the
 * proxy's host, and at a few hundred requests per second the ephemeral ports ran out. A connect that
 * fails for the proxy host's lack (EADDRNOTAVAIL, EMFILE, ENFILE, ENOBUFS) is not the instance's
 * failure: the request goes to the next instance of its role not tried (ports run out per
 * destination), and gets a 503 naming the lack only when none is left.
 *
 * Dead instances: each one is checked with GET /health (every health_interval_ms, health_timeout_ms
 * to answer). health_failures checks failed in a row (3), or one failed request (no connection, no
 * answer, a 5xx), eject it: it gets no requests while others are up, and is probed again after a
 * backoff (0.5 s doubling to health_interval_ms: never less often than an instance up) until /health
 * answers, which admits it back. An answer has no deadline of its own (a long
 * generation or queue is waited for); once its health checks have failed for 3 s the requests
 * the instance holds fail too, so a host that hangs does not hold its clients (a pause shorter
 * than that, a stopped process resumed, keeps them). A decode instance that fails before the client
 * has received any of the answer is replaced by another decode instance not tried yet (it pulls the
 * prefill's KV if the lease still holds, or recomputes the prompt from its token ids); once the
 * answer has begun, a streaming client gets an error event and [DONE]. pd_proxy_stop (and SIGINT,
 * SIGTERM) ends every stream in flight with an error event and [DONE], answers every other request
 * in flight with a 503, and only then leaves the loop: a client never sees a bare cut. */
#ifndef PD_PROXY_PROXY_H
#define PD_PROXY_PROXY_H

#include "core/err.h"
#include "http/front.h"
#include "proxy/route.h"

#define PD_PROXY_MAX_INSTANCES 32

struct pd_proxy_opts {
    const char *prefill[PD_PROXY_MAX_INSTANCES];   /* "host:port" */
    int n_prefill;
    const char *decode[PD_PROXY_MAX_INSTANCES];
    int n_decode;
    const char *host;                              /* default 127.0.0.1 */
    int port;                                      /* 0: ephemeral */
    const char *api_key;                           /* clients must send it; NULL: none */
    const char *backend_api_key;                   /* sent to the instances; NULL: api_key */
    int retries;                                   /* prefill attempts; 0: 3 */
    int health_interval_ms;                        /* active /health checks; 0: 1000 */
    int health_timeout_ms;                         /* how long a /health check may take; 0: 1000 */
    int health_failures;                           /* /health checks failed in a row that take an instance
                                                      out (a failed request does at once); 0: 3 */
    int upstream_keepalive;                        /* idle connections kept open per instance, for the
                                                      next requests; 0: 16, fewer under a low open-file
                                                      limit, < 0: none (a connection per request); the
                                                      client connection cap leaves descriptors for them */
    const char *metrics_file;                      /* Prometheus text appended to /metrics (pdmoe up's
                                                      restarts), read at each scrape; NULL: none */
    int handle_signals;
    int shutdown_timeout_s;                        /* with handle_signals: the first signal drains (new
                                                      requests a 503, those in flight finish) for at most
                                                      this many seconds, a second stops at once; 0: at once */
    struct pd_http_limits http;                    /* client connections: cap, timeouts, sizes (0: defaults) */
    struct pd_route_opts route;                    /* who prefills; all 0: cache_aware with SGLang's thresholds */
    int64_t max_body_bytes_in_flight;              /* the request bodies held at once (each costs about 4x its
                                                      size parsed and copied): past it a 503 with Retry-After;
                                                      0: 256 MiB */
};

struct pd_proxy;

int pd_proxy_create(const struct pd_proxy_opts *o, struct pd_proxy **out, pd_err *e);
int pd_proxy_port(const struct pd_proxy *p);
/* The idle connections kept per instance: upstream_keepalive, or the default the open-file limit
 * leaves room for (0: none). */
int pd_proxy_keepalive(const struct pd_proxy *p);
int pd_proxy_run(struct pd_proxy *p, pd_err *e);
/* From any thread: the graceful stop above; pd_proxy_run returns once it is done. */
void pd_proxy_stop(struct pd_proxy *p);
void pd_proxy_destroy(struct pd_proxy *p);

#endif

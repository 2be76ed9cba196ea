/* The PD proxy (see proxy.h): its life (create, run, the graceful stop and the drain, destroy) and
 * what its parts share (the instances given, the least-loaded pick, the API keys). The parts:
 * complete.c, health.c, fanout.c, metrics.c, pool.c (internal.h). One event loop runs them all. */
#include "proxy/internal.h"
#include "core/timing.h"
#include "http/front.h"
#include "http/http.h"

#include <event2/event.h>
#include <event2/http.h>
#include <event2/thread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int parse_hostport(const char *s, struct instance *in)
{
    const char *c = strrchr(s, ':');
    if (!c || c == s || (size_t)(c - s) >= sizeof in->host)
        return -1;
    memcpy(in->host, s, (size_t)(c - s));
    in->host[c - s] = 0;
    char *end;
    long p = strtol(c + 1, &end, 10);
    if (*end || p < 1 || p > 65535)
        return -1;
    in->port = (int)p;
    return 0;
}

/* The least-loaded instance not in `skip`, among those up if any is (else among all: one may have
 * come back since its last check). */
int px_pick(struct instance *in, int n, unsigned skip)
{
    int best = -1;
    for (int pass = 0; pass < 2 && best < 0; pass++)
        for (int i = 0; i < n; i++) {
            if ((skip & (1u << i)) || (pass == 0 && !in[i].up))
                continue;
            if (best < 0 || in[i].load < in[best].load)
                best = i;
        }
    return best;
}

/* The key the instances want: their own, or the one clients give this proxy. */
const char *px_backend_key(const struct pd_proxy *px)
{
    return px->o.backend_api_key ? px->o.backend_api_key : px->o.api_key;
}

int px_authorised(struct pd_proxy *px, struct evhttp_request *h)
{
    if (pd_http_authorised(h, px->o.api_key))
        return 1;
    reply_error(h, 401, "invalid_request_error", "missing or wrong API key (Authorization: Bearer ...)");
    return 0;
}

/* The idle connections kept per instance, and the descriptors they, a /health check to each
 * instance and the one /expert_stats fan-out in flight (a connection to each instance: fanout.c runs
 * them one at a time) may hold beside the client connections, which the connection cap then leaves
 * to them: a cap that ignored the pool (up to 16 x 64 instances = 1024 idle) let it take the
 * descriptors of the clients it admitted and of the checks, whose connects failed with EMFILE, and
 * one that ignored the fan-outs let each client take a connection to every instance where two
 * descriptors were counted. The default, 16, is lowered under a low open-file limit so that the
 * idle connections take at most half of what the limit leaves beyond the process's own (none if
 * that is less than one each); a --upstream-keepalive given that leaves no room for one client
 * connection is refused, as is an instance list whose checks and fan-out alone leave none. A
 * connect or accept that still finds no descriptor (the process holding more than its reserve)
 * closes the idle connections and tries once more (pool.c, px_pool_shed). */
#define PX_FDS_PER_INSTANCE 2   /* beside the idle ones: a /health check and a fan-out's connection */

static int keepalive(struct pd_proxy *px, int *reserved, pd_err *e)
{
    const long n = px->np + px->nd, lim = pd_http_open_file_limit(), beyond = lim - PD_HTTP_FD_RESERVE;
    const int given = px->o.upstream_keepalive;
    int keep = given < 0 ? 0 : given ? given : PX_DEFAULT_KEEPALIVE;
    if (lim >= 0 && !given) {
        long fit = beyond / 2 / n - PX_FDS_PER_INSTANCE;
        if (keep > fit)
            keep = fit > 0 ? (int)fit : 0;
    }
    /* a client connection needs 2 descriptors (its own and its request's upstream one) */
    if (lim >= 0 && beyond - (keep + PX_FDS_PER_INSTANCE) * n < 2) {
        if (beyond - PX_FDS_PER_INSTANCE * n < 2)
            return pd_err_set(e, PD_EINVAL, "the open-file limit (ulimit -n %ld) leaves no descriptor for a client "
                              "connection beside a /health check and an /expert_stats fan-out's connection to each "
                              "of the %ld instances (--prefill, --decode) and the process's own %d; raise it "
                              "(ulimit -n %ld or more)", lim, n, PD_HTTP_FD_RESERVE,
                              PD_HTTP_FD_RESERVE + PX_FDS_PER_INSTANCE * n + 128);
        return pd_err_set(e, PD_EINVAL, "--upstream-keepalive %d: %d idle connections to each of the %ld instances "
                          "(and a /health check and an /expert_stats fan-out's connection each) leave no descriptor "
                          "for a client connection under the open-file limit (ulimit -n %ld, of which the process "
                          "keeps %d); at most %ld, or raise the limit (ulimit -n %ld or more)", keep, keep, n, lim,
                          PD_HTTP_FD_RESERVE, (beyond - 2) / n - PX_FDS_PER_INSTANCE,
                          PD_HTTP_FD_RESERVE + (keep + PX_FDS_PER_INSTANCE) * n + 128);
    }
    px->keep = keep;
    *reserved = (int)((keep + PX_FDS_PER_INSTANCE) * n);
    return 0;
}

static int shed_pool(void *arg)
{
    return px_pool_shed(arg);
}

static void on_drained(evutil_socket_t fd, short what, void *arg)
{
    event_base_loopbreak(((struct pd_proxy *)arg)->base);
}

/* The graceful stop: every completion in flight is answered (an error event and [DONE] for a
 * stream, a 503 otherwise) and its upstream request cancelled; the loop goes on a moment so the
 * answers reach their clients, then ends. */
static void on_stop(evutil_socket_t fd, short what, void *arg)
{
    struct pd_proxy *px = arg;
    if (px->stopping)
        return;
    px->stopping = 1;
    if (px->drain_tick)
        event_del(px->drain_tick);
    px_stop_jobs(px);
    px_stop_fanouts(px);
    event_base_once(px->base, -1, EV_TIMEOUT, on_drained, px, &(struct timeval){0, 300000});
}

static void on_other(struct evhttp_request *h, void *arg)
{
    reply_error(h, 404, "invalid_request_error", "no route %s", evhttp_request_get_uri(h));
}

/* Draining: the stop comes once no completion is in flight, or at the deadline. */
static void on_drain_tick(evutil_socket_t fd, short what, void *arg)
{
    struct pd_proxy *px = arg;
    if (!px->jobs || pd_now_s() >= px->drain_deadline)
        on_stop(-1, 0, px);
}

/* SIGINT or SIGTERM: with --shutdown-timeout the first one drains, the next stops at once. */
static void on_signal(evutil_socket_t sig, short what, void *arg)
{
    struct pd_proxy *px = arg;
    if (px->o.shutdown_timeout_s <= 0 || px->draining || !px->drain_tick) {
        on_stop(-1, 0, px);
        return;
    }
    px->draining = 1;
    px->drain_deadline = pd_now_s() + px->o.shutdown_timeout_s;
    fprintf(stderr, "pdmoe proxy: draining: new requests are refused, those in flight finish (at most %d s; "
                    "another signal stops at once)\n", px->o.shutdown_timeout_s);
    event_add(px->drain_tick, &(struct timeval){0, 100000});
    on_drain_tick(-1, 0, px);
}

int pd_proxy_create(const struct pd_proxy_opts *o, struct pd_proxy **out, pd_err *e)
{
    if (o->n_prefill < 0 || o->n_decode < 1 || o->n_prefill > PD_PROXY_MAX_INSTANCES || o->n_decode > PD_PROXY_MAX_INSTANCES)
        return pd_err_set(e, PD_EINVAL, "--decode needs 1 to %d host:port (and --prefill at most as many)",
                          PD_PROXY_MAX_INSTANCES);
    if (o->health_failures < 0)
        return pd_err_set(e, PD_EINVAL, "--health-failures %d: at least 1 (0: the default, 3)", o->health_failures);
    struct pd_proxy *px = calloc(1, sizeof *px);
    if (!px)
        return pd_err_set(e, PD_ENOMEM, "out of memory");
    px->o = *o;
    px_hists_init(px);
    for (int i = 0; i < o->n_prefill; i++)
        if (parse_hostport(o->prefill[i], &px->p[i])) {
            free(px);
            return pd_err_set(e, PD_EINVAL, "--prefill %s: expected host:port", o->prefill[i]);
        }
    for (int i = 0; i < o->n_decode; i++)
        if (parse_hostport(o->decode[i], &px->d[i])) {
            free(px);
            return pd_err_set(e, PD_EINVAL, "--decode %s: expected host:port", o->decode[i]);
        }
    px->np = o->n_prefill;
    px->nd = o->n_decode;
    if (!o->route.balance_rel)   /* unset: SGLang's router's defaults */
        px->o.route = (struct pd_route_opts){.policy = o->route.policy, .cache_threshold = 0.3, .balance_abs = 64,
                                             .balance_rel = 1.5, .max_bytes = o->route.max_bytes};
    int rrc = pd_route_create(px->np ? px->np : px->nd, &px->o.route, &px->route, e);
    if (rrc) {
        free(px);
        return rrc;
    }
    signal(SIGPIPE, SIG_IGN);
    evthread_use_pthreads();   /* pd_proxy_stop may come from another thread */
    int brc = pd_http_base_new(&px->base, e);
    if (brc) {
        pd_proxy_destroy(px);
        return brc;
    }
    const char *host = o->host ? o->host : "127.0.0.1";
    struct pd_http_limits lim = o->http;
    lim.fds_per_connection = 2;   /* a client's connection and its request's upstream one */
    lim.shed = shed_pool;         /* an accept short of descriptors closes the idle upstream ones first */
    lim.shed_arg = px;
    int rc = keepalive(px, &lim.fds_reserved, e);
    if (rc) {
        pd_proxy_destroy(px);
        return rc;
    }
    rc = pd_http_front_new(px->base, &lim, host, o->port, &px->front, e);
    if (rc) {
        pd_proxy_destroy(px);
        return rc;
    }
    px->port = pd_http_front_port(px->front);
    static const struct pd_http_api api = {.completions = px_on_completions, .chat = px_on_chat, .models = px_on_models,
                                           .metrics = px_on_metrics, .expert_stats = px_on_expert_stats,
                                           .readiness = px_on_readiness, .other = on_other};
    if (pd_http_front_api(px->front, &api, px)) {
        pd_proxy_destroy(px);
        return pd_err_set(e, PD_ENOMEM, "out of memory");
    }
    if (o->handle_signals) {
        px->sigint = evsignal_new(px->base, SIGINT, on_signal, px);
        px->sigterm = evsignal_new(px->base, SIGTERM, on_signal, px);
        px->drain_tick = event_new(px->base, -1, EV_PERSIST, on_drain_tick, px);
        event_add(px->sigint, NULL);
        event_add(px->sigterm, NULL);
    }
    /* Every instance is checked at once and counts as up (in /readiness, in pdmoe_proxy_instance_up,
     * for routing) from its first answer: /readiness said ready for the first interval with every
     * instance dead. Until one answers, requests go to any (route_pick's fallback) and the client
     * of one that cannot be reached gets a 503 with a Retry-After. */
    for (int k = 0; k < px->np + px->nd; k++) {
        struct instance *in = nth(px, k);
        in->px = px;
        in->role = k < px->np ? "prefill" : "decode";
        in->probe_at = 0;
    }
    px->stop = event_new(px->base, -1, 0, on_stop, px);
    px->tick = event_new(px->base, -1, EV_PERSIST, px_on_tick, px);
    if (!px->stop || !px->tick || event_add(px->tick, &(struct timeval){0, 100000})) {
        pd_proxy_destroy(px);
        return pd_err_set(e, PD_ENOMEM, "out of memory");
    }
    *out = px;
    return 0;
}

int pd_proxy_port(const struct pd_proxy *px)
{
    return px->port;
}

int pd_proxy_keepalive(const struct pd_proxy *px)
{
    return px->keep;
}

int pd_proxy_run(struct pd_proxy *px, pd_err *e)
{
    return event_base_dispatch(px->base) < 0 ? pd_err_set(e, PD_EIO, "event loop failed") : 0;
}

void pd_proxy_stop(struct pd_proxy *px)
{
    event_active(px->stop, 0, 0);
}

void pd_proxy_destroy(struct pd_proxy *px)
{
    if (!px)
        return;
    px_free_fanouts(px);   /* (before the front: its clients' close callbacks point at the jobs) */
    pd_http_front_free(px->front);
    if (px->sigint)
        event_free(px->sigint);
    if (px->sigterm)
        event_free(px->sigterm);
    if (px->drain_tick)
        event_free(px->drain_tick);
    if (px->stop)
        event_free(px->stop);
    if (px->tick)
        event_free(px->tick);
    for (int k = 0; k < px->np + px->nd; k++) {
        struct instance *in = nth(px, k);
        px_get_cancel(in->probe);   /* its pending request and callback with it */
        px_pool_destroy(in);
    }
    if (px->base)
        event_base_free(px->base);
    pd_route_free(px->route);
    free(px);
}

/* The proxy's view of its instances (internal.h): who is up, the /health checks that find out, the
 * backoff of an instance that failed, GET /readiness. A request's own failure or answer also
 * ejects or admits its instance (proxy.c calls px_eject and px_admit). */
#include "proxy/internal.h"
#include "core/timing.h"
#include "http/http.h"

#include <event2/http.h>
#include <jansson.h>
#include <stdio.h>

/* The first check of an instance taken out comes after BACKOFF_MIN_S, the next ones after twice the
 * last, up to the health-check interval: an instance out is never checked less often than one in.
 * The backoff went on to 30 s: after a run of restarts by `pdmoe up` the proxy checked its instance
 * every 30 s, and said "no decode instance is up" 18 s after the instance was ready again. A dead
 * instance costs no more than a live one, a check per interval (a refused connect, or one that
 * waits --health-timeout-ms), as one still loading does; Envoy checks an unhealthy host at its
 * interval too (unhealthy_interval's default). */
#define BACKOFF_MIN_S 0.5

static double health_interval_s(const struct pd_proxy *px)
{
    return (px->o.health_interval_ms > 0 ? px->o.health_interval_ms : 1000) / 1e3;
}

/* A request to `in` failed, or its /health checks did (health_failures in a row): no requests while
 * others are up, and the next check after a backoff that doubles with each failed check up to the
 * interval (the requests that fail while it is out, when no instance is up, leave its schedule
 * alone). */
void px_eject(struct instance *in, int by_probe)
{
    in->failures++;
    int r = px_routed_index(in);
    if (r >= 0)
        pd_route_forget(in->px->route, r);   /* it may come back restarted, its cache empty */
    if (!in->up && !by_probe)
        return;
    if (in->up) {   /* the operator's line: the instance is out until its /health answers */
        in->ejections++;
        char why[64] = "a request to it failed";
        if (by_probe)
            snprintf(why, sizeof why, "%d /health checks in a row failed", in->failed_checks);
        fprintf(stderr, "pdmoe proxy: %s instance %s:%d is down (%s): no requests while others are up, /health "
                "checked again after a backoff\n", in->role, in->host, in->port, why);
    }
    in->up = 0;
    const double cap = health_interval_s(in->px);
    double b = BACKOFF_MIN_S;
    for (int k = 0; k < in->strikes && b < cap; k++)
        b *= 2;
    in->strikes++;
    in->probe_at = pd_now_s() + (b < cap ? b : cap);
}

/* `in` answered (a request, or its /health check): it is up (again). */
void px_admit(struct instance *in)
{
    in->silent_since = 0;
    if (!in->up)
        fprintf(stderr, "pdmoe proxy: %s instance %s:%d is up%s\n", in->role, in->host, in->port,
                in->answered ? " again" : "");
    in->up = 1;
    in->answered = 1;
    in->strikes = 0;
    in->failed_checks = 0;
}

/* The instances that prefill (route.h indexes them): the prefill ones, or the colocated servers. */
struct instance *px_routed(struct pd_proxy *px, int *n)
{
    *n = px->np ? px->np : px->nd;
    return px->np ? px->p : px->d;
}

/* in's index among the routed instances, or -1. */
int px_routed_index(const struct instance *in)
{
    int n;
    const struct instance *r = px_routed(in->px, &n);
    return in >= r && in < r + n ? (int)(in - r) : -1;
}

/* Active health checks: GET /health of each instance, every health_interval_ms while it is up,
 * at its backoff's end (at most the interval) while it is ejected; health_timeout_ms (1 s) to answer: a link across hosts
 * that is congested at times may need more. An instance up is taken out after health_failures
 * checks failed in a row (3, as Kubernetes' failureThreshold): one lost check (a step that held
 * the loop, a packet dropped) took a healthy instance out. Requests keep going to it meanwhile; one
 * that fails takes it out at once. A check that could not connect for the proxy's own lack (no
 * local port, no descriptor: pool.c) counts neither way.
 *
 * How long an instance's /health may stay unanswered before the requests in flight on it are
 * failed (a 502, or an error event and [DONE]): one check missing its second once failed every
 * stream of an instance stalled for a moment (a pause of the process, a long step), which then
 * resumed to nobody. */
#define HUNG_S 3.0

static int health_failures(const struct pd_proxy *px)
{
    return px->o.health_failures > 0 ? px->o.health_failures : PX_DEFAULT_HEALTH_FAILURES;
}

/* A /health check of `in` failed: out once health_failures have in a row, and once it has been
 * silent HUNG_S, hung. */
static void probe_failed(struct pd_proxy *px, struct instance *in)
{
    double now = pd_now_s();
    if (in->silent_since <= 0)
        in->silent_since = now;
    in->failed_checks++;
    if (in->answered && (!in->up || in->failed_checks >= health_failures(px))) {
        px_eject(in, 1);
    } else if (in->answered) {   /* up still: checked again after the interval */
        in->probe_at = now + health_interval_s(px);
    } else {   /* still starting (a model loading): asked again each interval, no backoff, said once */
        if (!in->said_waiting++)
            fprintf(stderr, "pdmoe proxy: %s instance %s:%d is not up yet (its /health check failed): no requests "
                    "while others are up, /health checked every %g s\n", in->role, in->host, in->port,
                    health_interval_s(px));
        in->probe_at = now + health_interval_s(px);
    }
    if (now - in->silent_since >= HUNG_S) {
        px_fail_in_flight(px, in, HUNG_S);
        px_fanout_fail_hung(px, in, HUNG_S);
    }
}

static void on_probe_done(struct evhttp_request *r, const char *local, void *arg)
{
    struct instance *in = arg;
    struct pd_proxy *px = in->px;
    in->probe = NULL;
    if (r && evhttp_request_get_response_code(r) == 200) {
        px_admit(in);
        in->probe_at = pd_now_s() + health_interval_s(px);
    } else if (local) {   /* the proxy's host is short, not the instance: asked again after the interval */
        px_say_local(in, local);
        in->probe_at = pd_now_s() + health_interval_s(px);
    } else {
        probe_failed(px, in);
    }
}

void px_on_tick(evutil_socket_t fd, short what, void *arg)
{
    struct pd_proxy *px = arg;
    double now = pd_now_s();
    for (int k = 0; k < px->np + px->nd && !px->stopping; k++) {
        struct instance *in = nth(px, k);
        px_pool_sweep(in, now);
        if (in->probe || now < in->probe_at)
            continue;
        if (!(in->probe = px_get_from(px, in, "/health", px->o.health_timeout_ms > 0 ? px->o.health_timeout_ms : 1000,
                                      on_probe_done, in)))
            probe_failed(px, in);   /* (out of memory) */
    }
}

/* GET /readiness (sgl-router's name for it): 200 when a request can be served now, at least one
 * prefill instance (with any) and one decode instance up, else 503; either way a JSON body with
 * each role's instances and how many are up. /health stays the proxy's own liveness, as a
 * restarting supervisor needs it: with every instance down it says ok, and the load balancer in
 * front of several deployments asks /readiness instead. */
static int instances_up(const struct instance *in, int n)
{
    int up = 0;
    for (int i = 0; i < n; i++)
        up += in[i].up;
    return up;
}

void px_on_readiness(struct evhttp_request *h, void *arg)
{
    struct pd_proxy *px = arg;
    const int up[2] = {instances_up(px->p, px->np), instances_up(px->d, px->nd)}, n[2] = {px->np, px->nd};
    const int ready = (px->np == 0 || up[0] > 0) && up[1] > 0 && !px->draining && !px->stopping;
    json_t *j = json_pack("{s:s, s:{s:i, s:i}, s:{s:i, s:i}}", "status", ready ? "ready" : "not ready", "prefill",
                          "instances", n[0], "up", up[0], "decode", "instances", n[1], "up", up[1]);
    if (j && !ready)
        json_object_set_new(j, "reason", json_string(px->draining || px->stopping ? "the proxy is shutting down"
                                                     : px->np && !up[0]                  ? "no prefill instance is up"
                                                                                         : "no decode instance is up"));
    if (!ready)
        evhttp_add_header(evhttp_request_get_output_headers(h), "Retry-After", "1");
    pd_http_json(h, ready ? 200 : 503, j);   /* (takes j) */
}

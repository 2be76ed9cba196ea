/* The proxy's GET routes answered from its instances (internal.h): /v1/models relayed from a decode
 * instance, /expert_stats summed over all of them. */
#include "proxy/internal.h"

#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* /v1/models: relayed from a decode instance (one that is up). */
static void on_models_done(struct evhttp_request *r, const char *local, void *arg)
{
    struct evhttp_request *h = arg;
    if (local) {
        reply_error(h, 503, "server_error", "the proxy could not connect to a decode instance (%s)", local);
        return;
    }
    if (!r || evhttp_request_get_response_code(r) != 200) {
        reply_error(h, 502, "server_error", "the decode instance did not list its models");
        return;
    }
    evhttp_add_header(evhttp_request_get_output_headers(h), "Content-Type", "application/json");
    pd_http_send(h, 200, "OK", evhttp_request_get_input_buffer(r));
}

void px_on_models(struct evhttp_request *h, void *arg)
{
    struct pd_proxy *px = arg;
    if (!px_authorised(px, h))
        return;
    if (!px_get_from(px, &px->d[px_pick(px->d, px->nd, 0)], "/v1/models", 0, on_models_done, h))
        reply_error(h, 503, "server_error", "out of memory");
}

/* GET /expert_stats[?role=prefill|decode]: every instance's expert counts (of the role, or of
 * both), summed: the file `pdmoe plan --expert-stats` reads, for the whole deployment. One such
 * fan-out is in flight at a time, the others waiting in arrival order: each takes a connection to
 * every instance, which the client connection cap counts once (proxy.c's keepalive()), where one
 * per client let concurrent fan-outs take more descriptors than the open-file limit left. */
struct stats_job {
    struct pd_proxy *px;
    struct evhttp_request *client;   /* NULL once the client has gone */
    struct stats_job *next;          /* px->stats_waiting, while it waits */
    const char *role;                /* NULL: both */
    struct stats_call *calls;        /* the GETs in flight */
    int pending, instances, n_layers, experts;
    int64_t *sum;                    /* [n_layers][experts], from the first answer on */
    char why[256];                   /* the first failure */
};

struct stats_call {
    struct stats_job *j;
    struct stats_call *next;         /* j->calls */
    const struct instance *in;
    struct px_get *g;
    char where[128];
};

static void stats_unlink(struct stats_call *c)
{
    for (struct stats_call **p = &c->j->calls; *p; p = &(*p)->next)
        if (*p == c) {
            *p = c->next;
            return;
        }
}

static void stats_fail(struct stats_job *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void stats_fail(struct stats_job *j, const char *fmt, ...)
{
    if (j->why[0])
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(j->why, sizeof j->why, fmt, ap);
    va_end(ap);
}

/* Adds one instance's answer to the sum. */
static void stats_add(struct stats_job *j, const char *where, struct evbuffer *b)
{
    json_t *doc;
    pd_http_read_json(b, 0, &doc, NULL);
    json_t *rows = json_object_get(doc, "tokens_per_expert");
    size_t L = json_is_array(rows) ? json_array_size(rows) : 0;
    json_t *row0 = json_array_get(rows, 0);
    size_t E = json_is_array(row0) ? json_array_size(row0) : 0;
    if (L == 0 || E == 0 || L > 4096 || E > 65536 || (j->sum && (L != (size_t)j->n_layers || E != (size_t)j->experts))) {
        stats_fail(j, "%s answered /expert_stats with %zu layers of %zu experts%s", where, L, E,
                   j->sum ? ", unlike the other instances" : "");
        json_decref(doc);
        return;
    }
    if (!j->sum) {
        j->sum = calloc(L * E, sizeof *j->sum);
        if (!j->sum) {
            stats_fail(j, "out of memory");
            json_decref(doc);
            return;
        }
        j->n_layers = (int)L;
        j->experts = (int)E;
    }
    for (size_t l = 0; l < L; l++) {
        json_t *row = json_array_get(rows, l);
        if (json_array_size(row) != E) {
            stats_fail(j, "%s answered /expert_stats with rows of different lengths", where);
            break;
        }
        for (size_t x = 0; x < E && !j->why[0]; x++) {
            json_t *v = json_array_get(row, x);
            int64_t *t = &j->sum[l * E + x];
            if (!json_is_integer(v) || json_integer_value(v) < 0 || __builtin_add_overflow(*t, json_integer_value(v), t))
                stats_fail(j, "%s answered /expert_stats with tokens_per_expert[%zu][%zu] not a count (an integer >= 0 "
                           "whose sum over the instances fits 64 bits)", where, l, x);
        }
        if (j->why[0])
            break;
    }
    j->instances++;
    json_decref(doc);
}

static void stats_start(struct stats_job *j);

/* The next fan-out waiting, if any, starts (the one in flight has ended). */
static void stats_next(struct pd_proxy *px)
{
    px->stats_running = NULL;
    struct stats_job *j = px->stats_waiting;
    if (!j)
        return;
    px->stats_waiting = j->next;
    j->next = NULL;
    stats_start(j);
}

static void stats_answer(struct stats_job *j)
{
    struct pd_proxy *px = j->px;
    if (!j->client) {
        /* (gone: nobody to answer) */
    } else if (j->why[0]) {
        reply_error(j->client, 502, "server_error", "%s", j->why);
    } else {
        pd_http_json(j->client, 200, json_pack("{s:s,s:i,s:i,s:o}", "role", j->role ? j->role : "prefill+decode",
                                               "instances", j->instances, "experts", j->experts, "tokens_per_expert",
                                               pd_http_json_counts(j->sum, j->n_layers, j->experts)));
    }
    if (j->client)
        pd_http_set_closecb(j->client, NULL, NULL);
    free(j->sum);
    free(j);
    stats_next(px);
}

/* The client of a fan-out left: one waiting is dropped, one in flight finishes unanswered. */
static void on_stats_client_close(struct evhttp_connection *evcon, void *arg)
{
    struct stats_job *j = arg;
    j->client = NULL;
    for (struct stats_job **p = &j->px->stats_waiting; *p; p = &(*p)->next)
        if (*p == j) {
            *p = j->next;
            free(j);
            return;
        }
}

/* The fan-outs waiting, dropped; their clients answered a 503 first when `answer`. */
static void drop_waiting(struct pd_proxy *px, int answer)
{
    while (px->stats_waiting) {
        struct stats_job *j = px->stats_waiting;
        px->stats_waiting = j->next;
        pd_http_set_closecb(j->client, NULL, NULL);
        if (answer)
            reply_error(j->client, 503, "server_error", "the proxy is shutting down");
        free(j);
    }
}

void px_stop_fanouts(struct pd_proxy *px)
{
    struct stats_job *r = px->stats_running;
    if (r && r->client) {   /* (its GETs end with the loop, or px_free_fanouts; an empty reply said nothing) */
        pd_http_set_closecb(r->client, NULL, NULL);
        reply_error(r->client, 503, "server_error", "the proxy is shutting down");
        r->client = NULL;
    }
    drop_waiting(px, 1);
}

void px_free_fanouts(struct pd_proxy *px)
{
    struct stats_job *j = px->stats_running;
    px->stats_running = NULL;
    if (j) {
        for (struct stats_call *c = j->calls, *next; c; c = next) {
            next = c->next;
            px_get_cancel(c->g);   /* (its callback is not called) */
            free(c);
        }
        if (j->client)
            pd_http_set_closecb(j->client, NULL, NULL);
        free(j->sum);
        free(j);
    }
    drop_waiting(px, 0);
}

static void on_stats_done(struct evhttp_request *r, const char *local, void *arg)
{
    struct stats_call *c = arg;
    struct stats_job *j = c->j;
    if (local)
        stats_fail(j, "the proxy could not connect to %s (%s)", c->where, local);
    else if (!r || evhttp_request_get_response_code(r) != 200)
        stats_fail(j, "%s did not answer /expert_stats", c->where);
    else
        stats_add(j, c->where, evhttp_request_get_input_buffer(r));
    stats_unlink(c);
    free(c);
    if (--j->pending == 0)
        stats_answer(j);
}

/* in's /health has been silent silent_s: the fan-out's GET to it fails (the 502 names it), however
 * recent (an answer of a few bytes from an instance silent that long is not coming). It had no
 * deadline: an instance stopped (SIGSTOP) or a host gone without a reset held the fan-out in flight
 * for ever, and every /expert_stats queued behind it. */
void px_fanout_fail_hung(struct pd_proxy *px, const struct instance *in, double silent_s)
{
    struct stats_job *j = px->stats_running;
    if (!j)
        return;
    for (struct stats_call *c = j->calls; c; c = c->next) {
        if (c->in != in)
            continue;
        px_get_cancel(c->g);   /* (its callback is not called) */
        stats_fail(j, "%s did not answer /expert_stats: its /health checks have failed for %g s", c->where, silent_s);
        stats_unlink(c);
        free(c);
        if (--j->pending == 0)
            stats_answer(j);   /* (frees j; the next fan-out waits for its own checks) */
        return;   /* (one GET per instance) */
    }
}

void px_on_expert_stats(struct evhttp_request *h, void *arg)
{
    struct pd_proxy *px = arg;
    if (!px_authorised(px, h))
        return;
    struct evkeyvalq q;
    const char *query = evhttp_uri_get_query(evhttp_request_get_evhttp_uri(h)), *role = NULL;
    if (query && evhttp_parse_query_str(query, &q) == 0) {
        const char *v = evhttp_find_header(&q, "role");
        role = !v ? NULL : !strcmp(v, "prefill") ? "prefill" : !strcmp(v, "decode") ? "decode" : "";
        evhttp_clear_headers(&q);
    }
    if (role && !role[0]) {
        pd_http_error(h, 400, "invalid_request_error", "role", "role: expected prefill or decode");
        return;
    }
    struct stats_job *j = calloc(1, sizeof *j);
    if (!j) {
        reply_error(h, 503, "server_error", "out of memory");
        return;
    }
    *j = (struct stats_job){.px = px, .client = h, .role = role, .pending = 1};
    pd_http_set_closecb(h, on_stats_client_close, j);
    if (!px->stats_running) {
        stats_start(j);
        return;
    }
    struct stats_job **p = &px->stats_waiting;
    while (*p)
        p = &(*p)->next;
    *p = j;
}

static void stats_start(struct stats_job *j)
{
    struct pd_proxy *px = j->px;
    const char *role = j->role;
    px->stats_running = j;
    for (int k = 0; k < px->np + px->nd; k++) {
        struct instance *in = nth(px, k);
        if (role && strcmp(role, in->role))
            continue;
        struct stats_call *c = calloc(1, sizeof *c);
        if (!c) {
            stats_fail(j, "out of memory");
            continue;
        }
        c->j = j;
        c->in = in;
        snprintf(c->where, sizeof c->where, "the %s instance %.63s:%d", in->role, in->host, in->port);
        if (!(c->g = px_get_from(px, in, "/expert_stats", 0, on_stats_done, c))) {
            stats_fail(j, "out of memory");
            free(c);
            continue;
        }
        c->next = j->calls;
        j->calls = c;
        j->pending++;
    }
    if (--j->pending == 0)
        stats_answer(j);
}


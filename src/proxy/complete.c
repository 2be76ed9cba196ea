/* The proxy's completions (internal.h): a request through a prefill instance then a decode one (or a
 * colocated server), each on a connection from the instance's pool (pool.c); the decode's answer
 * relayed to the client, a stream event by event; retries, failures, and the requests in flight
 * failed when their instance hangs or the proxy stops. */
#include "proxy/internal.h"
#include "core/timing.h"
#include "http/http.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct job {
    struct pd_proxy *px;
    struct job *prev, *next;         /* px->jobs */
    struct evhttp_request *client;   /* NULL once answered or gone */
    char path[32];
    json_t *body;
    struct pd_route_key key;         /* the prompt's chunk hashes (route.h) */
    int stream;
    int pi, di;                      /* chosen instances, -1 before */
    unsigned tried, dtried;          /* prefill, decode instances tried (bit masks) */
    int local, dlocal;               /* of those, how many the proxy's host could not connect to (its lack) */
    int attempts;
    int sent_up, dsent_up;           /* prefill, decode attempts sent to an instance then up */
    struct evhttp_request *up;       /* the request in flight upstream, or NULL */
    struct px_conn *conn;            /* its connection (pool.c) */
    int up_closed;                   /* libevent failed it for a closed connection (not a timeout, a cancel) */
    int up_resent;                   /* it went again on a fresh connection, a kept-alive one having been closed */
    int up_shed;                     /* it went again once, its connect having found no descriptor free and the
                                      * idle pooled connections closed for it */
    int up_decode;                   /* it goes to the decode instance */
    int started;                     /* the client's streamed reply has begun */
    struct evbuffer *held;           /* a decode error body while streaming */
    double t0;
    int got_first;
    double t_first, t_last;          /* the first and the latest streamed event carrying tokens */
    double t_heard;                  /* when its request went up, or its instance last sent bytes of it */
    int chunks;                      /* streamed events carrying tokens relayed */
    int stream_failed;               /* the decode instance's stream carried an error event */
    int64_t body_bytes;              /* the client's body, counted in px->body_bytes while the job lives */
    struct evbuffer *sse;            /* a streamed event not yet whole (relayed once it is) */
    int usage_asked;                 /* the proxy asked the decode instance for include_usage itself */
    long long tokens;                /* completion_tokens of the stream's usage event; -1 unknown */
};

/* A job's request to an instance, if one is under way: cancelled, its load and connection given back. */
static void cancel_upstream(struct pd_proxy *px, struct job *j)
{
    if (!j->up)
        return;
    if (j->up_decode)
        px->d[j->di].load--;
    else
        px->p[j->pi].load--;
    evhttp_cancel_request(j->up);   /* (libevent closes its connection: it does not go back to the pool) */
    j->up = NULL;
    px_conn_put(j->conn, 0);
    j->conn = NULL;
}

static void job_free(struct job *j)
{
    if (j->prev)
        j->prev->next = j->next;
    else
        j->px->jobs = j->next;
    if (j->next)
        j->next->prev = j->prev;
    json_decref(j->body);
    j->px->body_bytes -= j->body_bytes;
    pd_route_key_free(&j->key);
    if (j->held)
        evbuffer_free(j->held);
    if (j->sse)
        evbuffer_free(j->sse);
    free(j);
}

/* The client's answer is complete: it no longer needs this job. */
static void client_done(struct job *j)
{
    if (j->client)
        pd_http_set_closecb(j->client, NULL, NULL);
    j->client = NULL;
}

static void send_up(struct job *j, int decode);
static void send_to(struct job *j, int decode, int fresh);

/* The routed instance for j (see route.h), not in `skip`, among those up if any is (else among
 * all, as pick does). */
static int pick_routed(struct job *j, unsigned skip)
{
    int n, load[PD_PROXY_MAX_INSTANCES];
    struct instance *in = px_routed(j->px, &n);
    unsigned up = 0, all = 0;
    for (int i = 0; i < n; i++) {
        load[i] = in[i].load;
        if (!(skip & (1u << i))) {
            all |= 1u << i;
            up |= (unsigned)(in[i].up != 0) << i;
        }
    }
    enum pd_route_why why;
    size_t matched;
    int i = pd_route_pick(j->px->route, &j->key, load, up ? up : all, &why, &matched);
    j->px->routed[why]++;
    j->px->route_chunks += j->key.n;
    j->px->route_matched += matched;
    if (pd_route_insert(j->px->route, i, &j->key))
        pd_route_forget(j->px->route, i);   /* out of memory: predict nothing rather than half */
    return i;
}

/* The client went away: cancel what runs upstream (the decode instance frees the KV when its
 * connection closes), free the job. */
static void on_client_close(struct evhttp_connection *c, void *arg)
{
    struct job *j = arg;
    struct pd_proxy *px = j->px;
    px->cancelled++;
    /* libevent detaches an unanswered request from a connection the client closed and leaves it to
     * us (evhttp_connection_incoming_fail): free it, or every client that hangs up leaks one */
    if (evhttp_request_get_connection(j->client) == NULL)
        evhttp_request_free(j->client);
    j->client = NULL;
    cancel_upstream(px, j);
    job_free(j);
}

/* A streaming client's 200 and headers, once. */
static void stream_start(struct job *j)
{
    if (j->started)
        return;
    pd_http_stream_start(j->client, "text/event-stream");
    j->started = 1;
}

/* Ends a streaming client's answer with an error event and [DONE] (starting it if need be). */
static void stream_error(struct job *j, const char *msg)
{
    stream_start(j);
    struct evbuffer *b = evbuffer_new();
    char *t = pd_http_error_body("server_error", NULL, msg);
    evbuffer_add_printf(b, "data: %s\n\ndata: [DONE]\n\n", t ? t : "{\"error\":{\"message\":\"out of memory\"}}");
    free(t);
    evhttp_send_reply_chunk(j->client, b);
    evbuffer_free(b);
    struct evhttp_request *h = j->client;
    client_done(j);
    evhttp_send_reply_end(h);
}

/* A streamed event carrying tokens was relayed: the first one is the TTFT, the gaps after it
 * inter-token latencies (per event, as `vllm bench serve` measures them per chunk; an event holds
 * several tokens with speculative decoding). */
static void note_chunk(struct job *j)
{
    double now = pd_now_s();
    if (!j->got_first) {
        j->got_first = 1;
        j->t_first = now;
        pd_hist_observe(&j->px->ttft, now - j->t0);
    } else {
        pd_hist_observe(&j->px->itl, now - j->t_last);
    }
    j->t_last = now;
    j->chunks++;
}

/* A request completed: its end-to-end latency and, for a stream of two tokens or more, its time
 * per output token after the first, (end - first token) / (completion tokens - 1) as `vllm bench
 * serve` computes it, the tokens from the stream's usage (events, which hold several tokens each
 * with speculative decoding, counted tokens: TPOT came out up to (k + 1) x too long). */
static void note_done(struct job *j)
{
    struct pd_proxy *px = j->px;
    double now = pd_now_s();
    px->completed++;
    pd_hist_observe(&px->e2e, now - j->t0);
    long long n = j->tokens >= 0 ? j->tokens : j->chunks;
    if (j->got_first && n >= 2)
        pd_hist_observe(&px->tpot, (now - j->t_first) / (double)(n - 1));
}

/* The end of the first whole SSE event in b (after its blank line), or -1. Lines end in \n or
 * \r\n (the SSE format's \r alone is not produced by an OpenAI server). */
static ssize_t sse_event_end(struct evbuffer *b)
{
    struct evbuffer_ptr lf = evbuffer_search(b, "\n\n", 2, NULL);
    /* a \r\n\r\n ending earlier, looked for only before the first \n\n (not over the whole
     * buffer at every event) */
    struct evbuffer_ptr end;
    if (lf.pos >= 0)
        evbuffer_ptr_set(b, &end, (size_t)lf.pos + 2, EVBUFFER_PTR_SET);
    struct evbuffer_ptr crlf = evbuffer_search_range(b, "\r\n\r\n", 4, NULL, lf.pos >= 0 ? &end : NULL);
    if (crlf.pos >= 0)
        return crlf.pos + 4;
    return lf.pos >= 0 ? lf.pos + 2 : -1;
}

/* What a streamed event is to the proxy. */
enum sse_kind { SSE_OTHER, SSE_TOKENS, SSE_USAGE, SSE_ERROR };

/* One whole event (len bytes at ev): an error, a usage event without choices (its
 * completion_tokens in *tokens), one whose choice carries text or a finish reason (tokens), or
 * another (a chat's opening role, [DONE], a comment). */
static enum sse_kind sse_classify(const char *ev, size_t len, long long *tokens)
{
    if (len < 6 || memcmp(ev, "data:", 5))
        return SSE_OTHER;
    size_t at = ev[5] == ' ' ? 6 : 5;
    json_t *d = json_loadb(ev + at, len - at, JSON_DISABLE_EOF_CHECK, NULL);
    enum sse_kind k = SSE_OTHER;
    if (!json_is_object(d)) {
        json_decref(d);
        return k;
    }
    json_t *choices = json_object_get(d, "choices"), *c0 = json_array_get(choices, 0);
    if (json_object_get(d, "error")) {
        k = SSE_ERROR;
    } else if (json_is_array(choices) && !json_array_size(choices) && json_is_object(json_object_get(d, "usage"))) {
        k = SSE_USAGE;
        json_t *n = json_object_get(json_object_get(d, "usage"), "completion_tokens");
        if (json_is_integer(n))
            *tokens = json_integer_value(n);
    } else if (c0) {
        json_t *delta = json_object_get(c0, "delta");
        const char *t = json_string_value(delta ? json_object_get(delta, "content") : json_object_get(c0, "text"));
        /* (a thinking answer's text comes first as "reasoning" deltas: generated text all the same) */
        const char *rt = delta ? json_string_value(json_object_get(delta, "reasoning")) : NULL;
        json_t *fin = json_object_get(c0, "finish_reason");
        if ((t && *t) || (rt && *rt) || (fin && !json_is_null(fin)))
            k = SSE_TOKENS;
    }
    json_decref(d);
    return k;
}

/* Decode answer data as it arrives: relayed to a streaming client. */
static void on_decode_chunk(struct evhttp_request *r, void *arg)
{
    struct job *j = arg;
    struct evbuffer *in = evhttp_request_get_input_buffer(r);
    j->t_heard = pd_now_s();
    if (!j->client) {
        evbuffer_drain(in, evbuffer_get_length(in));
        return;
    }
    int code = evhttp_request_get_response_code(r);
    if (code != 200 || !j->stream) {
        /* a non-streamed body (or an error): keep it for the end */
        if (!j->held)
            j->held = evbuffer_new();
        evbuffer_add_buffer(j->held, in);
        return;
    }
    /* Relayed event by event, whole ones only: an error event (the instance stopping, its engine
     * failing) counts the request as the instance's failure, not a completion; the usage event the
     * proxy asked for itself is read and not relayed; the timings are taken on the events that
     * carry tokens (a chat's first event, the role, goes out before the prompt is computed). */
    stream_start(j);
    if (!j->sse && !(j->sse = evbuffer_new())) {   /* (out of memory: relayed as it comes) */
        evhttp_send_reply_chunk(j->client, in);
        return;
    }
    evbuffer_add_buffer(j->sse, in);
    struct evbuffer *out = evbuffer_new();
    ssize_t end;
    while (out && (end = sse_event_end(j->sse)) > 0) {
        const char *ev = (const char *)evbuffer_pullup(j->sse, end);
        enum sse_kind k = ev ? sse_classify(ev, (size_t)end, &j->tokens) : SSE_OTHER;
        if (k == SSE_ERROR)
            j->stream_failed = 1;
        if (k == SSE_TOKENS)
            note_chunk(j);
        if (k == SSE_USAGE && j->usage_asked)
            evbuffer_drain(j->sse, (size_t)end);
        else
            evbuffer_remove_buffer(j->sse, out, (size_t)end);
    }
    if (out && evbuffer_get_length(out))
        evhttp_send_reply_chunk(j->client, out);
    if (out)
        evbuffer_free(out);
}

/* How many times a request may be prefilled (--retries, default 3). */
static int max_attempts(const struct pd_proxy *px)
{
    return px->o.retries > 0 ? px->o.retries : 3;
}

/* An instance's answer, read once: its body (what it held back while streaming, else the
 * request's) as JSON, returned (the caller's; NULL if it is not a JSON object), and in *a what the
 * proxy makes of it. */
struct answer {
    int broken;      /* not a JSON object (an empty 200, an HTML error page): the instance's failure */
    int kv;          /* an error naming kv_transfer_params, which the proxy writes when it has prefill
                        instances: a 403 is a lost hand-off (the prefill instance restarted, or the
                        lease expired while the decode queued), a 400 an instance of the wrong role */
    int weights;     /* a decode's refusal of KV computed with other weights than its own
                        (kv_transfer_params.model_fingerprint): the pair's mismatch, neither's failure */
    char why[512];   /* what a 502 says: the missing JSON, or that error's message (whole: it names the
                      * setting at fault, as a spec-decode k that differs between the roles) */
};

static json_t *answer_read(struct evbuffer *held, struct evhttp_request *r, int code, struct answer *a)
{
    *a = (struct answer){0};
    struct evbuffer *b = held && evbuffer_get_length(held) ? held : r ? evhttp_request_get_input_buffer(r) : NULL;
    json_t *doc = NULL;
    if (b && pd_http_read_json(b, JSON_ALLOW_NUL, &doc, NULL) == PD_ENOMEM)
        return NULL;   /* (out of memory: not the instance's fault) */
    if (!json_is_object(doc)) {
        json_decref(doc);
        a->broken = 1;
        snprintf(a->why, sizeof a->why, "it answered %d without a JSON body", code);
        return NULL;
    }
    json_t *err = json_object_get(doc, "error");
    const char *param = json_string_value(json_object_get(err, "param"));
    const char *msg = json_string_value(json_object_get(err, "message"));
    a->weights = param && strcmp(param, "kv_transfer_params.model_fingerprint") == 0;
    if (param && (strcmp(param, "kv_transfer_params") == 0 || a->weights)) {
        a->kv = 1;
        snprintf(a->why, sizeof a->why, "%.500s", msg ? msg : "it refused the KV transfer parameters");
    }
    return doc;
}

/* A failed answer's own reason (its JSON error.message, at most cap - 1 bytes) after ": ", from what
 * the proxy held back of it (held, if any) or its body, for the 502 the client gets: "answered 503"
 * alone dropped what the instance said (an EP group's rank that died, a drain). "" when the answer
 * carries none. */
static void instance_reason(struct evbuffer *held, struct evhttp_request *r, char *out, size_t cap)
{
    out[0] = 0;
    struct evbuffer *b = held && evbuffer_get_length(held) ? held : r ? evhttp_request_get_input_buffer(r) : NULL;
    json_t *doc = NULL;
    if (!b || !evbuffer_get_length(b) || pd_http_read_json(b, JSON_ALLOW_NUL, &doc, NULL))
        return;
    const char *msg = json_string_value(json_object_get(json_object_get(doc, "error"), "message"));
    if (msg && *msg)
        snprintf(out, cap, ": %s", msg);
    json_decref(doc);
}

/* A request none of whose attempts at a role found an instance up (each was sent to one still
 * ejected, in case it had come back, and could not reach it): a 503 with a Retry-After of the
 * seconds to that role's next /health check, rather than a 502, which says an instance failed
 * the request. */
static void reply_unavailable(struct job *j, struct instance *in, int n, const char *role, const char *why)
{
    double next = 0, now = pd_now_s();
    for (int i = 0; i < n; i++)
        if (i == 0 || in[i].probe_at < next)
            next = in[i].probe_at;
    int wait = next > now ? (int)ceil(next - now) : 1;
    char s[16];
    snprintf(s, sizeof s, "%d", wait > 0 ? wait : 1);
    evhttp_add_header(evhttp_request_get_output_headers(j->client), "Retry-After", s);
    reply_error(j->client, 503, "server_error", "no %s instance is up (%d configured; the last tried: %s); its "
                "/health is checked again within %s s", role, n, why, s);
}

/* An instance's 429 reaches the client with its Retry-After. */
static void pass_retry_after(struct job *j, struct evhttp_request *r, int code)
{
    const char *ra = code == 429 && r ? evhttp_find_header(evhttp_request_get_input_headers(r), "Retry-After") : NULL;
    if (ra)
        evhttp_add_header(evhttp_request_get_output_headers(j->client), "Retry-After", ra);
}

/* The end of a job's request to an instance, in its callback (err: errno there): its load and
 * connection given back (to the pool after a whole answer). 1 if the request went again instead,
 * on a fresh connection: the kept-alive one it went on was closed by the server as it was sent (no
 * byte of an answer came; not a timeout, not a cancel), once per request; the caller then returns.
 * A stream's decode too: no byte of it reached the client, so the client sees one answer either
 * way, and failing it instead took a healthy instance out for the server's ordinary close of an
 * idle connection. Else 0, with *local naming what the proxy's host lacked when its connect()
 * failed for that (pool.c). */
static int upstream_over(struct job *j, struct evhttp_request *r, int err, const char **local)
{
    struct pd_proxy *px = j->px;
    const int code = r ? evhttp_request_get_response_code(r) : 0, decode = j->up_decode;
    struct px_conn *c = j->conn;
    j->up = NULL;
    j->conn = NULL;
    (decode ? &px->d[j->di] : &px->p[j->pi])->load--;
    *local = NULL;
    if (code == 0 && c && j->client && j->up_closed && !j->up_resent && px_conn_reused(c) && !px_conn_heard(c)) {
        px_conn_put(c, 0);
        px->stale_retries++;
        j->up_resent = 1;
        send_to(j, decode, 1);
        return 1;
    }
    if (code == 0 && c && j->up_closed)
        *local = px_conn_local_failure(c, err);
    if (*local && j->client && !j->up_shed && px_conn_out_of_fds(c, err)) {
        /* no descriptor for the connect: the idle pooled connections hold some, and are only a saving */
        j->up_shed = 1;
        if (px_pool_shed(px) > 0) {
            px_conn_put(c, 0);
            send_to(j, decode, 1);
            return 1;
        }
    }
    px_conn_put(c, code > 0);
    return 0;
}

/* A request's connect to `in` failed for the proxy host's lack (no local port, no descriptor):
 * counted and logged, not the instance's failure. 1 if another instance of the role is to be tried:
 * one not tried yet and up (or any not tried, while none of the role is up, as the picks go), since
 * the lack may be of that destination only (the ephemeral ports are per destination address and
 * port: EADDRNOTAVAIL towards one instance leaves the others reachable). An instance down would
 * fail it for its own reason and hide the limit, so it is not tried. */
static int local_next(struct job *j, struct instance *in, const char *local, struct instance *role, int n,
                      unsigned tried)
{
    j->px->local_limit++;
    px_say_local(in, local);
    unsigned down = 0;
    int any_up = 0;
    for (int i = 0; i < n; i++) {
        if (role[i].up)
            any_up = 1;
        else
            down |= 1u << i;
    }
    return px_pick(role, n, tried | (any_up ? down : 0)) >= 0;
}

/* A request that failed for the proxy host's lack (no local port, no descriptor) on every instance
 * of the role it could go to (`n` tried that way, the last `in`): a 503 naming it, or for a stream
 * begun an error event; not the instances' failure. */
static void reply_local(struct job *j, struct instance *in, const char *local, int n)
{
    char msg[480], others[64] = "";
    if (n > 1)
        snprintf(others, sizeof others, ", nor to %d other %s instance%s", n - 1, in->role, n > 2 ? "s" : "");
    snprintf(msg, sizeof msg, "the proxy could not connect to the %s instance %s:%d%s (%s)", in->role, in->host,
             in->port, others, local);
    if (j->started) {
        stream_error(j, msg);
        return;
    }
    evhttp_add_header(evhttp_request_get_output_headers(j->client), "Retry-After", "1");
    reply_error(j->client, 503, "server_error", "%s", msg);
    client_done(j);
}

static void on_decode_done(struct evhttp_request *r, void *arg)
{
    const int err = errno;
    struct job *j = arg;
    struct pd_proxy *px = j->px;
    const char *local;
    if (upstream_over(j, r, err, &local))
        return;
    int code = r ? evhttp_request_get_response_code(r) : 0;
    if (code > 0 && code < 500 && !j->stream_failed)   /* (a stream ended by an error event takes it out below) */
        px_admit(&px->d[j->di]);
    if (!j->client) {
        job_free(j);
        return;
    }
    if (local) {
        j->dlocal++;
        if (local_next(j, &px->d[j->di], local, px->d, px->nd, j->dtried) && !j->started) {
            px->retries++;
            if (j->held)
                evbuffer_drain(j->held, evbuffer_get_length(j->held));
            send_up(j, 1);
            return;
        }
        reply_local(j, &px->d[j->di], local, j->dlocal);
        job_free(j);
        return;
    }
    struct answer a = {0};
    if (code > 0 && code < 500 && !j->started)   /* (a stream's body has gone to the client) */
        json_decref(answer_read(j->held, r, code, &a));
    if (code == 429 && !j->started && px_pick(px->d, px->nd, j->dtried) >= 0) {
        /* this instance's queue is full (--max-queued-requests): another one, not taken out */
        px->retries++;
        if (j->held)
            evbuffer_drain(j->held, evbuffer_get_length(j->held));
        send_up(j, 1);
        return;
    }
    if (code == 403 && px->np > 0 && !j->started && j->attempts < max_attempts(px) && a.kv) {
        /* the prefill instance no longer holds the request's KV (it restarted, or the lease expired
         * while the decode queued): nothing has reached the client, so the request is prefilled
         * again, on any instance */
        px->retries++;
        if (j->held)
            evbuffer_drain(j->held, evbuffer_get_length(j->held));
        j->tried = j->dtried = 0;
        j->local = j->dlocal = 0;
        send_up(j, 0);
        return;
    }
    if (code == 400 && a.weights && px->np > 0 && !j->started) {
        /* the decode instance holds other weights than the prefill instance that computed the KV (a
         * checkpoint changed on disk and one of them restarted since): neither is taken out, since
         * either may be the one the others agree with (taking the decode out, as for a wrong role,
         * emptied the decode side of a healthy cluster one request at a time). Another decode
         * instance may hold the prefill's weights, else another prefill instance the decode's. */
        struct instance *pi = &px->p[j->pi], *di = &px->d[j->di];
        const double now = pd_now_s();
        if (!pi->weights_said_at || now - pi->weights_said_at >= 10) {
            pi->weights_said_at = now;
            fprintf(stderr, "pdmoe proxy: prefill instance %s:%d and decode instance %s:%d hold different weights "
                    "(%s); every instance must load the same checkpoint: restart the ones that loaded another "
                    "(requests go to other pairs meanwhile; said at most every 10 s)\n", pi->host, pi->port,
                    di->host, di->port, a.why);
        }
        const int other_decode = px_pick(px->d, px->nd, j->dtried) >= 0;
        if (other_decode || (j->attempts < max_attempts(px) && px_pick(px->p, px->np, j->tried) >= 0)) {
            px->retries++;
            if (j->held)
                evbuffer_drain(j->held, evbuffer_get_length(j->held));
            if (!other_decode) {   /* prefilled again on a prefill instance not tried yet */
                j->dtried = 0;
                j->local = j->dlocal = 0;
            }
            send_up(j, other_decode);
            return;
        }
        px->decode_failed++;
        reply_error(j->client, 502, "server_error", "the prefill instance %s:%d and the decode instance %s:%d hold "
                    "different weights (%s); no other pair could take the request", pi->host, pi->port, di->host,
                    di->port, a.why);
        client_done(j);
        job_free(j);
        return;
    }
    if ((code == 0 || code >= 500) && !j->started) {
        /* nothing has reached the client: another decode instance takes the request */
        px_eject(&px->d[j->di], 0);
        if (px_pick(px->d, px->nd, j->dtried) >= 0) {
            px->retries++;
            if (j->held)
                evbuffer_drain(j->held, evbuffer_get_length(j->held));
            send_up(j, 1);
            return;
        }
    }
    if (j->stream && j->started) {
        if (code != 200) {
            px->decode_failed++;
            px_eject(&px->d[j->di], 0);
            stream_error(j, "the decode instance failed during generation");
        } else if (j->stream_failed) {   /* its error event and [DONE] are relayed already */
            px->decode_failed++;
            px_eject(&px->d[j->di], 0);
            struct evhttp_request *h = j->client;
            client_done(j);
            evhttp_send_reply_end(h);
        } else {
            struct evhttp_request *h = j->client;
            if (j->sse && evbuffer_get_length(j->sse))   /* an event the instance left without its end */
                evhttp_send_reply_chunk(h, j->sse);
            client_done(j);
            evhttp_send_reply_end(h);
            note_done(j);
        }
        job_free(j);
        return;
    }
    if (code == 0 || code >= 500 || a.broken || (px->np > 0 && code == 400 && a.kv)) {
        px->decode_failed++;
        px_eject(&px->d[j->di], 0);
        char why[1024], reason[360] = "";
        if (!a.why[0] && code >= 500)
            instance_reason(j->held, r, reason, sizeof reason);
        snprintf(why, sizeof why, "%s:%d, %s%s", px->d[j->di].host, px->d[j->di].port,
                 a.why[0] ? a.why : code ? "server error" : "no answer", reason);
        if (code == 0 && !j->dsent_up)
            reply_unavailable(j, px->d, px->nd, "decode", why);
        else
            reply_error(j->client, 502, "server_error", "the decode instance failed (%s)", why);
    } else {
        struct evbuffer *b = j->held ? j->held : evbuffer_new();
        if (r)
            evbuffer_add_buffer(b, evhttp_request_get_input_buffer(r));
        evhttp_add_header(evhttp_request_get_output_headers(j->client), "Content-Type", "application/json");
        pass_retry_after(j, r, code);
        evhttp_send_reply(j->client, code, pd_http_reason(code), b);
        if (!j->held)
            evbuffer_free(b);
        if (code == 429)   /* every decode instance's queue was full */
            px->queue_full++;
        else if (code >= 400)   /* the decode instance's 4xx, passed on: the client's, as the prefill's are */
            px->bad_requests++;
        if (code == 200)   /* (no TTFT: nothing was streamed, its time is the end-to-end latency's) */
            note_done(j);
    }
    client_done(j);
    job_free(j);
}

static void on_prefill_done(struct evhttp_request *r, void *arg)
{
    const int err = errno;
    struct job *j = arg;
    struct pd_proxy *px = j->px;
    const char *local;
    if (upstream_over(j, r, err, &local))
        return;
    if (!j->client) {
        job_free(j);
        return;
    }
    if (local) {
        j->local++;
        if (local_next(j, &px->p[j->pi], local, px->p, px->np, j->tried)) {
            /* not counted against --retries, which bounds the instances' failures */
            px->retries++;
            j->attempts--;
            send_up(j, 0);
            return;
        }
        reply_local(j, &px->p[j->pi], local, j->local);
        job_free(j);
        return;
    }
    int code = r ? evhttp_request_get_response_code(r) : 0;
    if (code == 0 || code >= 500) {
        px_eject(&px->p[j->pi], 0);
        /* another prefill instance, a few times; never after a 4xx */
        if (j->attempts < max_attempts(px) && px_pick(px->p, px->np, j->tried) >= 0) {
            px->retries++;
            send_up(j, 0);
            return;
        }
        px->prefill_failed++;
        if (code == 0 && !j->sent_up) {
            char why[100];
            snprintf(why, sizeof why, "%s:%d, no answer", px->p[j->pi].host, px->p[j->pi].port);
            reply_unavailable(j, px->p, px->np, "prefill", why);
        } else {
            char how[400] = "no answer", reason[360];
            instance_reason(NULL, r, reason, sizeof reason);
            if (code)
                snprintf(how, sizeof how, "answered %d%s", code, reason);
            reply_error(j->client, 502, "server_error",
                        "no prefill instance could take the request (%d tried; the last, %s:%d: %s)", j->attempts,
                        px->p[j->pi].host, px->p[j->pi].port, how);
        }
        client_done(j);
        job_free(j);
        return;
    }
    struct evbuffer *in = evhttp_request_get_input_buffer(r);
    struct answer a;
    json_t *resp = answer_read(NULL, r, code, &a);   /* (JSON_ALLOW_NUL: a token may carry 0x00, \u0000) */
    if (a.broken || (code == 400 && a.kv)) {   /* the instance's failure (not pdmoe's answer, or the wrong role) */
        json_decref(resp);
        px->prefill_failed++;
        px_eject(&px->p[j->pi], 0);
        reply_error(j->client, 502, "server_error", "the prefill instance %s:%d failed (%s)", px->p[j->pi].host,
                    px->p[j->pi].port, a.why);
        client_done(j);
        job_free(j);
        return;
    }
    px_admit(&px->p[j->pi]);
    if (code == 429 && px_pick(px->p, px->np, j->tried) >= 0) {
        /* this instance's queue is full (--max-queued-requests): another one, not taken out, and
         * not counted against --retries, which bounds failures */
        json_decref(resp);
        px->retries++;
        j->attempts--;
        send_up(j, 0);
        return;
    }
    if (code != 200) {   /* the instance's 4xx, passed on as it is (a 429: every queue was full) */
        json_decref(resp);
        if (code == 429)
            px->queue_full++;
        else
            px->bad_requests++;
        pass_retry_after(j, r, code);
        evhttp_add_header(evhttp_request_get_output_headers(j->client), "Content-Type", "application/json");
        evhttp_send_reply(j->client, code, pd_http_reason(code), in);
        client_done(j);
        job_free(j);
        return;
    }
    if (!resp) {   /* answer_read ran out of memory */
        px->prefill_failed++;
        reply_error(j->client, 503, "server_error", "out of memory for the prefill's answer of %zu bytes",
                    evbuffer_get_length(in));
        client_done(j);
        job_free(j);
        return;
    }
    json_t *kv = json_object_get(json_array_get(json_object_get(resp, "choices"), 0), "kv_transfer_params");
    if (!json_is_object(kv)) {
        json_decref(resp);
        px->prefill_failed++;
        reply_error(j->client, 502, "server_error", "the prefill instance %s:%d answered without kv_transfer_params",
                    px->p[j->pi].host, px->p[j->pi].port);
        client_done(j);
        job_free(j);
        return;
    }
    json_object_set(j->body, "kv_transfer_params", kv);
    json_decref(resp);
    send_up(j, 1);
}

/* A stream's decode request asks for its usage event (OpenAI's stream_options.include_usage),
 * which gives the proxy the count of tokens its TPOT divides by; 1 if the proxy asked and the
 * client did not (the event is then not relayed). A stream_options the client got wrong is left
 * for the instance to refuse. */
static int ask_usage(json_t *b)
{
    json_t *so = json_object_get(b, "stream_options");
    if (!so || json_is_null(so)) {
        json_object_set_new(b, "stream_options", json_pack("{s:b}", "include_usage", 1));
        return 1;
    }
    json_t *iu = json_object_get(so, "include_usage");
    if (!json_is_object(so) || (iu && !json_is_boolean(iu)) || json_is_true(iu))
        return 0;
    json_object_set_new(so, "include_usage", json_true());
    return 1;
}

/* libevent's reason for failing a job's upstream request: a closed connection, or another (a
 * timeout, a cancel). */
static void on_up_error(enum evhttp_request_error e, void *arg)
{
    ((struct job *)arg)->up_closed = e == EVREQ_HTTP_EOF;
}

/* Sends j to the next instance of its leg: prefill (another attempt), or decode. */
static void send_up(struct job *j, int decode)
{
    struct pd_proxy *px = j->px;
    struct instance *in;
    if (decode) {
        j->di = px->np ? px_pick(px->d, px->nd, j->dtried) : pick_routed(j, j->dtried);
        j->dtried |= 1u << j->di;
        in = &px->d[j->di];
        j->dsent_up += in->up != 0;
    } else {
        j->pi = pick_routed(j, j->tried);
        j->tried |= 1u << j->pi;
        j->attempts++;
        in = &px->p[j->pi];
        j->sent_up += in->up != 0;
    }
    j->up_resent = 0;
    send_to(j, decode, 0);
}

/* Sends j's request to the instance chosen (j->di, or j->pi), on a pooled connection or a fresh one. */
static void send_to(struct job *j, int decode, int fresh)
{
    struct pd_proxy *px = j->px;
    struct instance *in = decode ? &px->d[j->di] : &px->p[j->pi];
    json_t *b = json_deep_copy(j->body);
    if (!decode)   /* the client's body as it came: the prefill instance checks every field (a bad
                    * max_tokens was once a 400 only from the decode side, after a whole prefill and
                    * a lease held for nothing), then computes the first token only, answered whole */
        json_object_set_new(b, "kv_transfer_params", json_pack("{s:b}", "do_remote_decode", 1));
    else if (b && j->stream)
        j->usage_asked = ask_usage(b);
    char *txt = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    /* an answer has no deadline of its own (a long generation, a long queue): libevent's 50 s read
     * timeout cut it and took a healthy instance out. A request fails when its instance fails its
     * health checks instead (fail_in_flight). */
    struct px_conn *c = px_conn_get(in, 0, fresh);
    j->conn = c;
    j->up_closed = 0;
    struct evhttp_request *r = c ? evhttp_request_new(decode ? on_decode_done : on_prefill_done, j) : NULL;
    /* a request that cannot be built (out of memory) fails as an instance that refused it */
    int bad = !txt || !r;
    if (r) {
        evhttp_request_set_error_cb(r, on_up_error);
        if (decode)
            evhttp_request_set_chunked_cb(r, on_decode_chunk);
        struct evkeyvalq *hd = evhttp_request_get_output_headers(r);
        char hostport[96];
        snprintf(hostport, sizeof hostport, "%s:%d", in->host, in->port);
        evhttp_add_header(hd, "Host", hostport);
        evhttp_add_header(hd, "Content-Type", "application/json");
        bad = bad || pd_http_add_key(r, px_backend_key(px)) ||
              evbuffer_add(evhttp_request_get_output_buffer(r), txt, strlen(txt));
        if (bad)
            evhttp_request_free(r);
    }
    free(txt);
    in->load++;
    j->up = r;
    j->up_decode = decode;
    j->t_heard = pd_now_s();
    if (bad || evhttp_make_request(px_conn_evcon(c), r, EVHTTP_REQ_POST, j->path) != 0) {
        /* libevent freed r: the instance failed (the handlers take its load back) */
        j->up = NULL;
        if (decode)
            on_decode_done(NULL, j);
        else
            on_prefill_done(NULL, j);
    }
}

/* The bytes routing goes by (route.h): a completion's "prompt" (a string as it is, ids or a list as
 * JSON), a chat's "messages" as JSON, compact, in the client's order (a later turn of a chat
 * repeats the earlier messages, so their text starts it). Requests the servers will refuse are
 * routed on what they have; the servers say what is wrong. */
static int prompt_key(json_t *body, struct pd_route_key *k)
{
    json_t *p = json_object_get(body, "prompt");
    if (json_is_string(p))
        return pd_route_key_make(json_string_value(p), json_string_length(p), k);
    if (!p)
        p = json_object_get(body, "messages");
    char *txt = p ? json_dumps(p, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
    if (p && !txt)
        return PD_ENOMEM;
    int rc = pd_route_key_make(txt ? txt : "", txt ? strlen(txt) : 0, k);
    free(txt);
    return rc;
}

static void on_completion(struct evhttp_request *h, void *arg, const char *path)
{
    struct pd_proxy *px = arg;
    if (!px_authorised(px, h))
        return;
    /* every completion request counts, those the proxy refuses itself too: each error kind below is
     * a part of pdmoe_proxy_requests_total (they were counted in the errors only, so completed +
     * errors could pass the requests) */
    px->requests++;
    if (px->stopping || px->draining) {
        px->shutting_down++;
        reply_error(h, 503, "server_error", "the proxy is shutting down");
        return;
    }
    /* The bodies held at once are bounded: each costs about 4x its size (parsed, then copied for
     * each instance), and 40 clients of 7 MB prompts took the proxy to 1.2 GB, with only the
     * connection cap (1024 x 8 MiB) as a bound. */
    const int64_t n_body = (int64_t)evbuffer_get_length(evhttp_request_get_input_buffer(h));
    const int64_t cap = px->o.max_body_bytes_in_flight > 0 ? px->o.max_body_bytes_in_flight : (int64_t)256 << 20;
    if (px->body_bytes > 0 && px->body_bytes + n_body > cap) {
        px->body_full++;
        evhttp_add_header(evhttp_request_get_output_headers(h), "Retry-After", "1");
        reply_error(h, 503, "server_error", "the proxy holds %lld MiB of requests in flight (at most %lld MiB); this "
                    "one's %lld KiB must wait: retry", (long long)(px->body_bytes >> 20), (long long)(cap >> 20),
                    (long long)(n_body >> 10));
        return;
    }
    json_error_t je;
    json_t *body;
    if (pd_http_read_json(evhttp_request_get_input_buffer(h), JSON_REJECT_DUPLICATES, &body, &je) == PD_ENOMEM) {
        reply_error(h, 503, "server_error", "%s", je.text);
        return;
    }
    json_t *st = body ? json_object_get(body, "stream") : NULL;
    if (json_is_null(st))
        st = NULL;   /* unset, as the servers read it */
    if (!json_is_object(body) || (st && !json_is_boolean(st))) {
        px->bad_requests++;
        pd_http_error(h, 400, "invalid_request_error", json_is_object(body) ? "stream" : NULL, "%s",
                      !body ? je.text : !json_is_object(body) ? "the body must be a JSON object"
                                                              : "\"stream\" must be a boolean");
        json_decref(body);
        return;
    }
    json_t *client_kv = json_object_get(body, "kv_transfer_params");
    if (client_kv && !json_is_null(client_kv)) {
        /* the proxy's own field between its prefill and decode instances: a client's was dropped
         * without a word (its do_remote_prefill, an engine_id of its choosing, a typo...) */
        px->bad_requests++;
        pd_http_error(h, 400, "invalid_request_error", "kv_transfer_params", "kv_transfer_params is set by the proxy "
                      "between its prefill and decode instances; a client does not send it");
        json_decref(body);
        return;
    }
    struct job *j = calloc(1, sizeof *j);
    if (j && prompt_key(body, &j->key)) {
        free(j);
        j = NULL;
    }
    if (!j) {
        json_decref(body);
        reply_error(h, 503, "server_error", "out of memory for the request");
        return;
    }
    j->px = px;
    j->client = h;
    snprintf(j->path, sizeof j->path, "%s", path);
    j->body = body;
    j->body_bytes = n_body;
    px->body_bytes += n_body;
    j->stream = st && json_is_true(st);
    j->tokens = -1;
    j->pi = j->di = -1;
    j->t0 = pd_now_s();
    j->next = px->jobs;
    if (px->jobs)
        px->jobs->prev = j;
    px->jobs = j;
    pd_http_set_closecb(h, on_client_close, j);   /* a client that hangs up cancels the upstream work */
    /* without prefill instances the decode instances are colocated servers: no hand-off */
    send_up(j, px->np == 0);
}

void px_on_completions(struct evhttp_request *h, void *arg)
{
    on_completion(h, arg, "/v1/completions");
}

void px_on_chat(struct evhttp_request *h, void *arg)
{
    on_completion(h, arg, "/v1/chat/completions");
}

/* An instance that failed its health checks fails the requests it holds that it has not sent a
 * byte of for silent_s: each as if its answer had not come (another instance takes it when nothing
 * has reached the client yet, else the client gets its error), rather than waiting on a host that
 * may never answer. A stream still flowing stays: on a congested link the checks (and new
 * connections) fail first, and every stream of a live instance was cut 1.4 s after its last token. */
void px_fail_in_flight(struct pd_proxy *px, const struct instance *in, double silent_s)
{
    const double now = pd_now_s();
    for (struct job *j = px->jobs, *next; j; j = next) {
        next = j->next;
        if (!j->up || (j->up_decode ? &px->d[j->di] : &px->p[j->pi]) != in || now - j->t_heard < silent_s)
            continue;
        evhttp_cancel_request(j->up);   /* (its callback is not called) */
        j->up = NULL;
        if (j->up_decode)
            on_decode_done(NULL, j);
        else
            on_prefill_done(NULL, j);
    }
}

/* The proxy stops: every completion in flight is answered (an error event and [DONE] for a stream,
 * a 503 otherwise) and its upstream request cancelled. */
void px_stop_jobs(struct pd_proxy *px)
{
    while (px->jobs) {
        struct job *j = px->jobs;
        cancel_upstream(px, j);
        if (j->client && j->stream)
            stream_error(j, "the proxy is shutting down");
        else if (j->client) {
            reply_error(j->client, 503, "server_error", "the proxy is shutting down");
            client_done(j);
        }
        job_free(j);
    }
}

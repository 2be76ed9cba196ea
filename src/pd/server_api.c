/* The HTTP side of an inference server (see server.h): requests in (the key, the queue's limit,
 * the hand-over of the body to the tokenizer thread, which reads it with server_req.c, and the
 * queueing of the request it makes), errors, /v1/models and /expert_stats; the answers out are
 * server_answer.c's, /metrics server_metrics.c's. Runs on the event-loop thread. */
#include "pd/server_int.h"

#include <sys/random.h>


/* An OpenAI-style error, counted in the metrics when it is the client's. */
void pd_srv_send_error(struct pd_server *s, struct evhttp_request *h, int code, const char *type, const char *param,
                       const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (code >= 400 && code < 500) {
        pthread_mutex_lock(&s->mu);
        s->n_errors4xx++;
        pthread_mutex_unlock(&s->mu);
    }
    pd_http_error(h, code, type, param, "%s", msg);
}

void pd_srv_count_pull(struct pd_server *s, const char *host, int port, int rank, int64_t bytes, double seconds)
{
    struct kv_peer *p = NULL;
    for (int i = 0; i < s->n_kv_peers && !p; i++)
        if (s->kv_peers[i].port == port && s->kv_peers[i].rank == rank && !strcmp(s->kv_peers[i].host, host))
            p = &s->kv_peers[i];
    if (!p && s->n_kv_peers < PD_KV_PEERS) {
        p = &s->kv_peers[s->n_kv_peers++];
        snprintf(p->host, sizeof p->host, "%s", host);
        p->port = port;
        p->rank = rank;
    }
    if (!p) {
        p = &s->kv_peers[PD_KV_PEERS];
        snprintf(p->host, sizeof p->host, "other");
        p->port = p->rank = -1;
    }
    p->pulls++;
    if (bytes < 0) {
        p->failures++;
        return;
    }
    p->bytes += (uint64_t)bytes;
    p->seconds += seconds;
}

int pd_srv_kv_producer_allowed(const struct pd_server *s, const char *host, int port)
{
    for (int i = 0; i < s->o.n_kv_producers; i++) {
        const struct pd_kv_producer *p = &s->o.kv_producers[i];
        if (!strcmp(p->host, host) && port >= p->port_lo && port <= p->port_hi)
            return 1;
    }
    return 0;
}

const char *pd_srv_kv_host(const struct pd_server *s)
{
    if (s->o.kv_host)
        return s->o.kv_host;
    return strcmp(s->o.host, "0.0.0.0") && strcmp(s->o.host, "::") ? s->o.host : "127.0.0.1";
}

static int authorised(struct pd_server *s, struct evhttp_request *h)
{
    if (pd_http_authorised(h, s->o.api_key))
        return 1;
    pd_srv_send_error(s, h, 401, "invalid_request_error", NULL, "missing or wrong API key (Authorization: Bearer ...)");
    return 0;
}

/* The waiting queue at --max-queued-requests: a 429 (Retry-After 1 s, OpenAI's rate_limit_error,
 * SGLang's answer to a full queue) before the body is read, so a flood costs no more than its
 * bytes; the proxy offers the request to another instance. Prompts being tokenized count as
 * waiting. Only this thread adds to the queue or the tokenizer's, so the count cannot grow
 * between this check and the request's place in it. */
static int queue_full(struct pd_server *s, struct evhttp_request *h)
{
    if (s->o.max_queued_requests <= 0)
        return 0;
    pthread_mutex_lock(&s->mu);
    int full = pd_srv_waiting(s, s->o.max_queued_requests) + s->n_tokenizing >= s->o.max_queued_requests;
    s->n_queue_full += (uint64_t)full;
    pthread_mutex_unlock(&s->mu);
    if (full) {
        evhttp_add_header(evhttp_request_get_output_headers(h), "Retry-After", "1");
        pd_srv_send_error(s, h, 429, "rate_limit_error", NULL, "the waiting queue is full (%d requests, "
                          "--max-queued-requests): try again later", s->o.max_queued_requests);
    }
    return full;
}

/* POST /v1/completions and /v1/chat/completions: what costs nothing whatever the body (the key, a
 * drain, a full queue) is checked here; the body is handed to the tokenizer thread, which parses
 * and checks it (server_req.c) and tokenizes its text, so that no body up to --max-body-bytes
 * holds this loop; pd_srv_admit goes on with the request it makes. */
/* 1 when an EP group's rank has died: h answered a 503 naming it (closing its connection when
 * `close_conn`). */
static int refused_for_dead_rank(struct pd_server *s, struct evhttp_request *h, int close_conn)
{
    if (pd_srv_ep_dead_rank(s) < 0)
        return 0;
    if (close_conn)
        evhttp_add_header(evhttp_request_get_output_headers(h), "Connection", "close");
    pd_srv_send_error(s, h, 503, "server_error", NULL, "%s", s->g->dead_why);
    return 1;
}

static void on_completion(struct evhttp_request *h, void *arg, int chat)
{
    struct pd_server *s = arg;
    if (!authorised(s, h))
        return;
    if (refused_for_dead_rank(s, h, 1))   /* (nothing would step it: the group is being ended) */
        return;
    if (s->draining) {   /* (the load balancer's cue: this one is going; the proxy tries another) */
        evhttp_add_header(evhttp_request_get_output_headers(h), "Connection", "close");
        pd_srv_send_error(s, h, 503, "server_error", NULL, "the server is shutting down (draining the requests "
                          "in flight)");
        return;
    }
    if (queue_full(s, h))
        return;
    struct tok_job *jb = calloc(1, sizeof *jb);
    /* the body's chains moved, not copied, into a buffer of the job's (the request's own is
     * libevent's, freed with the request) */
    if (!jb || !(jb->body = evbuffer_new()) || evbuffer_add_buffer(jb->body, evhttp_request_get_input_buffer(h))) {
        if (jb && jb->body)
            evbuffer_free(jb->body);
        free(jb);
        pd_srv_send_error(s, h, 503, "server_error", NULL, "out of memory for the request");
        return;
    }
    jb->s = s;
    jb->h = h;
    jb->chat = chat;
    pd_srv_tok_submit(s, jb);
}

/* jb is back from the tokenizer thread, its client still there: its refusal sent, or its request
 * queued for the scheduler (and a stream started). */
void pd_srv_admit(struct pd_server *s, struct tok_job *jb)
{
    struct evhttp_request *h = jb->h;
    struct req *r = jb->r;
    if (!r) {
        assert(jb->no.code);
        pd_srv_send_error(s, h, jb->no.code, jb->no.type, jb->no.param[0] ? jb->no.param : NULL, "%s", jb->no.msg);
        return;
    }
    if (refused_for_dead_rank(s, h, 0))   /* (read before the rank died: the job frees r) */
        return;
    jb->r = NULL;
    r->http = h;
    r->t_arrival = pd_now_s();
    r->created = (long)time(NULL);
    pthread_mutex_lock(&s->mu);
    r->id = ++s->next_id;
    /* random, as vLLM's and OpenAI's are: a counter repeated itself across instances and restarts */
    uint64_t rid[2];
    if (getrandom(rid, sizeof rid, 0) != (ssize_t)sizeof rid) {   /* (the clock and the counter then) */
        rid[0] = (uint64_t)pd_now_ns();
        rid[1] = r->id;
    }
    snprintf(r->created_id, sizeof r->created_id, "%s-%016llx%016llx", r->chat ? "chatcmpl" : "cmpl",
             (unsigned long long)rid[0], (unsigned long long)rid[1]);
    r->refs = 2;   /* the scheduler and the HTTP side */
    s->n_requests++;
    s->tokens_in += (uint64_t)r->n_prompt;
    r->live_next = s->live;
    if (s->live)
        s->live->live_prev = r;
    s->live = r;
    if (s->wait_tail)
        s->wait_tail->next = r;
    else
        s->wait_head = r;
    s->wait_tail = r;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pd_http_set_closecb(h, pd_srv_on_close, r);   /* a client that leaves cancels its request */
    /* a stream that pulls KV answers once the pull is through: a refused one gets a 4xx */
    if (r->stream && !r->remote_prefill)
        pd_srv_start_stream(s, r);
}

static void on_completions(struct evhttp_request *h, void *arg)
{
    on_completion(h, arg, 0);
}

static void on_chat(struct evhttp_request *h, void *arg)
{
    on_completion(h, arg, 1);
}

static void on_models(struct evhttp_request *h, void *arg)
{
    struct pd_server *s = arg;
    if (!authorised(s, h))
        return;
    /* OpenAI's Model object (id, object, created, owned_by: clients that type-check it need all
     * four) and vLLM's max_model_len, root and parent */
    pd_http_json(h, 200, json_pack("{s:s,s:[{s:s,s:s,s:I,s:s,s:i,s:s,s:n}]}", "object", "list", "data", "id", s->name,
                                   "object", "model", "created", (json_int_t)s->created, "owned_by", "pdmoe",
                                   "max_model_len", s->o.max_model_len, "root", s->name, "parent"));
}

/* GET /expert_stats: the tokens each routed expert ran in each layer since the server started
 * (every rank of an EP group), as `pdmoe generate --expert-stats` writes them and `pdmoe plan
 * --expert-stats` reads them. The scheduler collects them between steps; on_notify answers. */
static void on_expert_stats(struct evhttp_request *h, void *arg)
{
    struct pd_server *s = arg;
    if (!authorised(s, h))
        return;
    pthread_mutex_lock(&s->mu);
    if (s->n_stats_wait == s->cap_stats_wait) {
        int cap = s->cap_stats_wait ? 2 * s->cap_stats_wait : 8;
        void *w = realloc(s->stats_wait, (size_t)cap * sizeof *s->stats_wait);
        if (!w) {
            pthread_mutex_unlock(&s->mu);
            pd_srv_send_error(s, h, 503, "server_error", NULL, "out of memory");
            return;
        }
        s->stats_wait = w;
        s->cap_stats_wait = cap;
    }
    s->stats_wait[s->n_stats_wait++] = h;
    if (s->stats_state == STATS_NONE)
        s->stats_state = STATS_WANTED;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void on_other(struct evhttp_request *h, void *arg)
{
    pd_srv_send_error(arg, h, 404, "invalid_request_error", NULL, "no route %s", evhttp_request_get_uri(h));
}

/* GET /health: ok, but a 503 naming the rank once an EP group's rank died (the group is being
 * ended), or naming the stall while its round has made no progress for PD_EP_STALL_HEALTH_S (a
 * rank stopped or hung: the proxy then routes around the group and fails what it holds, instead
 * of waiting for its watchdog). */
static void on_health(struct evhttp_request *h, void *arg)
{
    struct pd_server *s = arg;
    if (refused_for_dead_rank(s, h, 0))
        return;
    const int64_t stalled = pd_srv_ep_stalled_ns(s);
    if (stalled < (int64_t)PD_EP_STALL_HEALTH_S * 1000000000) {
        pd_http_health(h, arg);
        return;
    }
    pd_srv_send_error(s, h, 503, "server_error", NULL, "the EP group's round has made no progress for %.0f s (a rank "
                      "stopped or hung); the group ends after %d s (--watchdog-timeout)", stalled / 1e9,
                      s->o.watchdog_s);
}

/* GET /readiness (the proxy's name for it): 200 {"status":"ready"} when a completion can be
 * taken now, else 503 {"status":"not ready","reason"} with Retry-After: draining, an EP group's
 * rank dead (its number in "dead_rank"), or its round stalled as /health says. /health stays
 * the liveness a supervisor asks. */
static void on_readiness(struct evhttp_request *h, void *arg)
{
    struct pd_server *s = arg;
    const int dead = pd_srv_ep_dead_rank(s);
    const int64_t stalled = pd_srv_ep_stalled_ns(s);
    char why[320] = "";
    if (dead >= 0)
        snprintf(why, sizeof why, "%s", s->g->dead_why);
    else if (s->draining)
        snprintf(why, sizeof why, "the server is shutting down (draining the requests in flight)");
    else if (stalled >= (int64_t)PD_EP_STALL_HEALTH_S * 1000000000)
        snprintf(why, sizeof why, "the EP group's round has made no progress for %.0f s (a rank stopped or hung)",
                 stalled / 1e9);
    json_t *j = json_pack("{s:s}", "status", why[0] ? "not ready" : "ready");
    if (j && why[0])
        json_object_set_new(j, "reason", json_string(why));
    if (j && dead >= 0)
        json_object_set_new(j, "dead_rank", json_integer(dead));
    if (why[0])
        evhttp_add_header(evhttp_request_get_output_headers(h), "Retry-After", "1");
    pd_http_json(h, why[0] ? 503 : 200, j);   /* (takes j) */
}

int pd_srv_api_install(struct pd_server *s)
{
    static const struct pd_http_api api = {.completions = on_completions, .chat = on_chat, .models = on_models,
                                           .metrics = pd_srv_on_metrics, .expert_stats = on_expert_stats,
                                           .readiness = on_readiness, .health = on_health, .other = on_other};
    if (pd_http_front_api(s->front, &api, s))
        return -1;
    s->notify = event_new(s->base, -1, 0, pd_srv_on_notify, s);
    return s->notify ? 0 : -1;
}

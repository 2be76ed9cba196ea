/* The answers of an inference server (see server.h): the generated tokens as text (UTF-8 made
 * whole, special tokens left out, stop strings), whole JSON answers and server-sent events, the
 * scheduler's wake-up of the event loop (pd_srv_on_notify) and a client that leaves (pd_srv_on_close).
 * Runs on the event-loop thread. */
#define _GNU_SOURCE   /* memmem */
#include "pd/server_int.h"
#include "core/grow.h"
#include "model/unicode.h"

/* A generated token's bytes in the answer's text: none for a special token (EOS generated past
 * ignore_eos, a chat marker) unless the request set skip_special_tokens false, as vLLM's detokenizer
 * does; NULL when it adds nothing. */
static const char *token_text(const struct pd_server *s, const struct req *r, int32_t id, size_t *len)
{
    /* (a thinking answer's "</think>" is kept whatever its flag: the answer is split there) */
    if (!r->keep_special && pd_tok_is_special(s->tok, id) && !(r->think && id == s->think_end))
        return NULL;
    return pd_tok_token_bytes(s->tok, id, len);
}

/* Appends the bytes of the tokens [tokens_sent, n) to r->text, and moves its longest prefix that
 * is complete UTF-8 onto r->held (which may then hold 0x00: a token's bytes are carried as they
 * are), invalid bytes becoming U+FFFD, keeping an incomplete tail for later unless `final`.
 * PD_ENOMEM if memory runs out. */
static int take_utf8(struct pd_server *s, struct req *r, int n, int final)
{
    for (; r->tokens_sent < n; r->tokens_sent++) {
        size_t tl;
        const char *b = token_text(s, r, r->gen[r->tokens_sent], &tl);
        if (!b)
            continue;
        if (PD_GROW(r->text, r->text_cap, r->text_len + tl))
            return PD_ENOMEM;
        memcpy(r->text + r->text_len, b, tl);
        r->text_len += tl;
    }
    if (r->text_len == 0)   /* nothing yet (the first token sampled may be EOS): r->text is NULL */
        return 0;
    /* each byte becomes at most 3 (U+FFFD) */
    if (PD_GROW(r->held, r->held_cap, r->held_len + r->text_len * 3))
        return PD_ENOMEM;
    size_t i;
    r->held_len += pd_utf8_lossy((const unsigned char *)r->text, r->text_len, final, r->held + r->held_len, &i);
    memmove(r->text, r->text + i, r->text_len - i);
    r->text_len -= i;
    return 0;
}

/* The fewest of the first n tokens whose text (as take_utf8 makes it, an incomplete last character
 * left out) reaches `end` bytes: the token that completed a stop string ending there, and those
 * before it. n if memory runs out. */
static int tokens_to(struct pd_server *s, const struct req *r, int n, size_t end)
{
    size_t *at = malloc(((size_t)n + 1) * sizeof *at), len = 0, cap = 0, used;
    char *raw = NULL;
    int lo = 1, hi = n;
    for (int k = 0; at && k < n; k++) {
        size_t tl;
        const char *b = token_text(s, r, r->gen[k], &tl);
        at[k] = len;
        if (b && PD_GROW(raw, cap, len + tl))
            goto out;
        if (b)
            memcpy(raw + len, b, tl);
        len += b ? tl : 0;
    }
    if (!at)
        return n;
    at[n] = len;
    while (lo < hi) {   /* the text's length grows with the tokens */
        int mid = (lo + hi) / 2;
        if (pd_utf8_lossy((const unsigned char *)raw, at[mid], 0, NULL, &used) >= end)
            hi = mid;
        else
            lo = mid + 1;
    }
out:
    free(raw);
    free(at);
    return lo < hi ? n : lo;
}

static json_t *usage(const struct req *r)
{
    /* a stop token counts as vLLM counts it (not when a stop string cut the text before) */
    const int n = r->n_answered ? r->n_answered : r->n_gen + r->stop_token;
    return json_pack("{s:i,s:i,s:i}", "prompt_tokens", r->n_prompt, "completion_tokens", n, "total_tokens",
                     r->n_prompt + n);
}

/* A streamed chunk carrying len bytes of text (a counted JSON string: a 0x00 byte is sent escaped). */
static json_t *chunk(struct pd_server *s, const struct req *r, const char *text, size_t len, const char *finish)
{
    json_t *choice;
    if (r->chat)
        choice = json_pack("{s:i,s:{s:s%},s:o}", "index", 0, "delta", "content", text, len, "finish_reason",
                           finish ? json_string(finish) : json_null());
    else
        choice = json_pack("{s:i,s:s%,s:o}", "index", 0, "text", text, len, "finish_reason",
                           finish ? json_string(finish) : json_null());
    return json_pack("{s:s,s:s,s:I,s:s,s:[o]}", "id", r->created_id, "object",
                     r->chat ? "chat.completion.chunk" : "text_completion", "created", (json_int_t)r->created, "model",
                     s->name, "choices", choice);
}

/* A thinking answer's streamed text (len bytes, none of which can still begin a "</think>" unless
 * the stream ends): a reasoning delta until "</think>", a delta with both parts where it is, content
 * after, as vLLM's DeepSeek R1/V4 parser streams them (vllm/reasoning/deepseek_r1_reasoning_parser.py
 * 0172203d); NULL when the delta is "</think>" alone (vLLM sends nothing for it). The field is
 * "reasoning", vLLM's DeltaMessage's (vllm/entrypoints/openai/engine/protocol.py). */
static json_t *think_chunk(struct pd_server *s, struct req *r, const char *text, size_t len)
{
    if (r->think_done)
        return chunk(s, r, text, len, NULL);
    /* the reasoning runs from the chunk's start, not from after a "<think>" (ro is not used):
     * mid-stream a "<think>" is reasoning's text, vLLM strips it only from a whole answer */
    size_t ro, rl, co;
    r->think_done = pd_chat_think_split(text, len, &ro, &rl, &co);
    rl = r->think_done ? co - strlen("</think>") : len;
    if (!rl && co == len && r->think_done)
        return NULL;
    json_t *c = chunk(s, r, "", 0, NULL);
    json_t *delta = json_object_get(json_array_get(json_object_get(c, "choices"), 0), "delta");
    if (!delta)
        return c;
    json_object_del(delta, "content");
    if (rl)
        json_object_set_new(delta, "reasoning", json_stringn(text, rl));
    if (r->think_done && co < len)
        json_object_set_new(delta, "content", json_stringn(text + co, len - co));
    return c;
}

/* One SSE event; an event that cannot be built (out of memory) goes as an error event. */
void pd_srv_send_sse(struct evhttp_request *h, json_t *j)
{
    char *txt = j ? json_dumps(j, JSON_COMPACT) : NULL;
    struct evbuffer *b = evbuffer_new();
    if (b) {
        evbuffer_add_printf(b, "data: %s\n\n",
                            txt ? txt : "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\"}}");
        evhttp_send_reply_chunk(h, b);
        evbuffer_free(b);
    }
    free(txt);
    json_decref(j);
}

/* The answer is complete: the connection's close no longer concerns this request, and the HTTP
 * side's reference goes (s->mu is not held). */
void pd_srv_answered(struct pd_server *s, struct req *r)
{
    pd_http_set_closecb(r->http, NULL, NULL);
    pthread_mutex_lock(&s->mu);
    r->http = NULL;
    pd_srv_req_unref(s, r);
    pthread_mutex_unlock(&s->mu);
}

/* The loop (s->mu held): answers the GET /expert_stats requests once the counts are in. */
static void answer_expert_stats(struct pd_server *s)
{
    if (s->stats_state != STATS_READY)
        return;
    const struct pd_model *m = &s->en.model;
    json_t *doc = json_pack("{s:s,s:s,s:i,s:i,s:o}", "model", s->name, "model_type", pd_model_arch_name(m->arch),
                            "ranks", s->g ? s->g->size : 1, "experts",
                            m->n_routed_experts, "tokens_per_expert",
                            pd_http_json_counts(s->stats_sum, m->n_layers, m->n_routed_experts));
    for (int i = 0; i < s->n_stats_wait; i++)
        pd_http_json(s->stats_wait[i], 200, json_incref(doc));
    json_decref(doc);
    s->n_stats_wait = 0;
    s->stats_state = STATS_NONE;
}

/* A stream's 200 and headers, before its first chunk; a chat's first chunk names the role, as
 * OpenAI's and vLLM's do (delta {"role": "assistant", "content": ""}). */
void pd_srv_start_stream(struct pd_server *s, struct req *r)
{
    pd_http_stream_start(r->http, "text/event-stream");
    r->reply_started = 1;
    if (r->chat) {
        json_t *c = chunk(s, r, "", 0, NULL);
        json_t *delta = json_object_get(json_array_get(json_object_get(c, "choices"), 0), "delta");
        if (delta)
            json_object_set_new(delta, "role", json_string("assistant"));
        pd_srv_send_sse(r->http, c);
    }
}

/* The end of a stream: the last chunk with its finish reason (and, with include_usage, a chunk
 * with the usage and no choice), or an error event; then [DONE]. */
static void end_stream(struct pd_server *s, struct req *r, const char *finish, const char *error)
{
    struct evhttp_request *h = r->http;
    if (error) {
        pd_srv_send_sse(h, json_pack("{s:{s:s,s:s}}", "error", "message", error, "type", "server_error"));
    } else {
        pd_srv_send_sse(h, chunk(s, r, "", 0, finish));
        if (r->include_usage)
            pd_srv_send_sse(h, json_pack("{s:s,s:s,s:I,s:s,s:[],s:o}", "id", r->created_id, "object",
                                         r->chat ? "chat.completion.chunk" : "text_completion", "created",
                                         (json_int_t)r->created, "model", s->name, "choices", "usage", usage(r)));
    }
    struct evbuffer *b = evbuffer_new();
    if (b) {
        evbuffer_add_printf(b, "data: [DONE]\n\n");
        evhttp_send_reply_chunk(h, b);
        evbuffer_free(b);
    }
    pd_srv_answered(s, r);
    evhttp_send_reply_end(h);
}

/* Stop strings in the held text: 1 when one is found, *ready then the bytes before the earliest
 * and *stop_end where it ends;
 * else *ready is what may be sent now: everything once the generation is over (or without stop
 * strings), otherwise all but the last stop_max - 1 bytes (a stop string may still start there),
 * cut at a character's start. Text already scanned is scanned again only where a stop string
 * could straddle the new text. */
static int stop_scan(struct req *r, int final, size_t *ready, size_t *stop_end)
{
    size_t from = r->stop_scanned + 1 > r->stop_max ? r->stop_scanned + 1 - r->stop_max : 0, best = SIZE_MAX;
    for (int i = 0; i < r->n_stop; i++) {
        size_t len = strlen(r->stop[i]);
        if (r->held_len < from + len)
            continue;
        const char *at = memmem(r->held + from, r->held_len - from, r->stop[i], len);
        if (at && (size_t)(at - r->held) < best) {
            best = (size_t)(at - r->held);
            *stop_end = best + len;
        }
    }
    r->stop_scanned = r->held_len;
    if (best != SIZE_MAX) {
        *ready = best;
        return 1;
    }
    size_t keep = final || !r->n_stop ? 0 : r->stop_max - 1;
    size_t n = r->held_len > keep ? r->held_len - keep : 0;
    while (n > 0 && n < r->held_len && ((unsigned char)r->held[n] & 0xC0) == 0x80)
        n--;
    *ready = n;
    return 0;
}

/* A whole (non-streamed) answer: the text, its finish reason, the producer's transfer parameters,
 * the token ids when asked for; n tokens were generated. */
static void answer_whole(struct pd_server *s, struct req *r, const char *text, size_t len, const char *finish, int n)
{
    size_t ro = 0, rl = 0, co = 0;
    const int found = r->think && pd_chat_think_split(text ? text : "", len, &ro, &rl, &co);
    json_t *choice = r->think
                         /* vLLM's split (pd_chat_think_split): content null when nothing follows "</think>",
                          * or when it never came */
                         ? json_pack("{s:i,s:{s:s,s:s%,s:o},s:s}", "index", 0, "message", "role", "assistant",
                                     "reasoning", text ? text + ro : "", rl, "content",
                                     found && co < len ? json_stringn(text + co, len - co) : json_null(),
                                     "finish_reason", finish)
                     : r->chat ? json_pack("{s:i,s:{s:s,s:s%},s:s}", "index", 0, "message", "role", "assistant",
                                         "content", text ? text : "", len, "finish_reason", finish)
                             : json_pack("{s:i,s:s%,s:s}", "index", 0, "text", text ? text : "", len, "finish_reason",
                                         finish);
    if (choice && r->remote_decode) {
        char rid[PD_KVX_ID_HEX];
        pd_kvx_id_format(&r->key, rid);
        json_object_set_new(choice, "kv_transfer_params",
                            json_pack("{s:b,s:b,s:s,s:s,s:s,s:i,s:i,s:i,s:i,s:s}", "do_remote_prefill", 1, "do_remote_decode", 0,
                                      "remote_engine_id", s->o.engine_id ? s->o.engine_id : "prefill",
                                      "remote_request_id", rid, "remote_host", s->g ? s->g->kv_hosts[r->owner] : pd_srv_kv_host(s), "remote_port",
                                      s->g ? s->g->kv_ports[r->owner] : pd_kvx_port(s->kvx), "remote_num_tokens",
                                      r->n_prompt, "last_token_id", r->first_sampled >= 0 ? r->first_sampled : n > 0 ? r->gen[0] : s->eos,
                                      /* the decode side must speculate alike (server_spec.c) */
                                      "num_speculative_tokens", s->o.spec_k,
                                      /* and hold the same weights (weights.h) */
                                      "model_fingerprint", s->fingerprint));
    }
    if (choice && r->return_ids) {
        /* vLLM's lists: the generated ids with the stop token that ended them (as many as the
         * usage counts), and the prompt's */
        json_t *ids = json_array(), *pids = json_array();
        for (int i = 0; i < n; i++)
            json_array_append_new(ids, json_integer(r->gen[i]));
        if (r->stop_token && n == r->n_gen && !r->n_answered)
            json_array_append_new(ids, json_integer(r->stop_tok));
        for (int i = 0; i < r->n_prompt; i++)
            json_array_append_new(pids, json_integer(r->prompt[i]));
        json_object_set_new(choice, "token_ids", ids);
        json_object_set_new(choice, "prompt_token_ids", pids);
    }
    pd_http_json(r->http, 200,
                 choice ? json_pack("{s:s,s:s,s:I,s:s,s:[o],s:o}", "id", r->created_id, "object",
                                    r->chat ? "chat.completion" : "text_completion", "created", (json_int_t)r->created,
                                    "model", s->name, "choices", choice, "usage", usage(r))
                        : NULL);
}


/* The loop's side of the outbox: stream new text, or answer finished requests. */
void pd_srv_on_notify(evutil_socket_t fd, short what, void *arg)
{
    struct pd_server *s = arg;
    pthread_mutex_lock(&s->mu);
    answer_expert_stats(s);
    struct req *list = s->outbox;
    s->outbox = NULL;
    /* snapshots under the lock: tokens below n_gen are final. An entry leaves the outbox (queued
     * = 0) only once its link is read: the scheduler may queue it again while the lock is down,
     * and that rewrites r->next. */
    while (list) {
        struct req *r = list;
        list = r->next;
        r->queued = 0;
        int n = r->n_gen, finished = r->finished;
        const char *finish = r->finish;
        if (!r->http) {
            /* its client left. One the scheduler finished (in the step its client left during, or
             * after) is in no queue the scheduler counts cancellations in, and passes here once:
             * counted now, or it would be counted nowhere */
            if (finished && !r->stop_wanted)   /* (a stop string's answer was counted completed) */
                s->n_cancelled++;
            pd_srv_req_unref(s, r);
            continue;
        }
        pthread_mutex_unlock(&s->mu);
        int oom = 0, done = finished;
        if (finished && !strcmp(finish, "refused")) {
            /* only a pull refuses, before any token: a stream's 200 is still deferred */
            assert(!r->reply_started);
            pd_srv_send_error(s, r->http, 403, "invalid_request_error", "kv_transfer_params", REFUSED_MSG);
            pd_srv_answered(s, r);
        } else if (finished && !strcmp(finish, "error")) {
            if (r->stream) {
                if (!r->reply_started)
                    pd_srv_start_stream(s, r);
                end_stream(s, r, NULL, "the engine failed during generation");
            } else {
                pd_srv_send_error(s, r->http, 500, "server_error", NULL, "the engine failed during generation");
                pd_srv_answered(s, r);
            }
        } else {
            /* the new text joins what is held back; a stop string in it ends the answer there */
            oom = take_utf8(s, r, n, finished) != 0;
            size_t ready = 0, stop_end = 0;
            int hit = !oom && stop_scan(r, finished, &ready, &stop_end);
            if (hit) {
                done = 1;
                finish = "stop";
                /* the answer counts the tokens up to the one that completed the stop string */
                n = r->n_answered = tokens_to(s, r, n, r->held_base + stop_end);
            }
            if (r->stream) {
                if (!r->reply_started)
                    pd_srv_start_stream(s, r);
                /* a thinking answer keeps back what may begin its "</think>" */
                if (r->think && !r->think_done && !done && !oom)
                    ready -= pd_chat_think_partial(r->held, ready);
                if (ready && !oom) {
                    json_t *c = r->think ? think_chunk(s, r, r->held, ready) : chunk(s, r, r->held, ready, NULL);
                    if (c)
                        pd_srv_send_sse(r->http, c);
                }
                if (!oom && ready) {   /* (nothing held yet, r->held may be NULL) */
                    memmove(r->held, r->held + ready, r->held_len - ready);
                    r->held_len -= ready;
                    r->held_base += ready;
                    r->stop_scanned = r->stop_scanned > ready ? r->stop_scanned - ready : 0;
                }
                if (done || oom)
                    end_stream(s, r, oom ? NULL : finish, oom ? "out of memory for the generated text" : NULL);
            } else if (done || oom) {
                if (oom)
                    pd_srv_send_error(s, r->http, 503, "server_error", NULL, "out of memory for the generated text");
                else
                    answer_whole(s, r, r->held, ready, finish, n);
                pd_srv_answered(s, r);
            }
            done |= oom;
            if ((hit || oom) && !finished) {   /* the scheduler ends the sequence and frees its KV */
                pthread_mutex_lock(&s->mu);
                r->stop_wanted = 1;
                pthread_cond_signal(&s->cv);
                pthread_mutex_unlock(&s->mu);
            }
        }
        pthread_mutex_lock(&s->mu);
        if (done && (oom || !strcmp(finish, "refused") || !strcmp(finish, "error"))) {
            s->n_failed++;
        } else if (done) {
            s->n_completed++;
            double now = pd_now_s();
            pd_hist_observe(&s->h_e2e, now - r->t_arrival);
            if (r->t_first > 0) {
                pd_hist_observe(&s->h_ttft, r->t_first - r->t_arrival);
                if (n > 1)
                    pd_hist_observe(&s->h_tpot, (now - r->t_first) / (n - 1));
            }
        }
        pd_srv_req_unref(s, r);
    }
    pthread_mutex_unlock(&s->mu);
}

/* A client that goes away before its answer cancels its request; the scheduler frees its KV. */
void pd_srv_on_close(struct evhttp_connection *c, void *arg)
{
    struct req *r = arg;
    struct pd_server *s = r->srv;
    pthread_mutex_lock(&s->mu);
    struct evhttp_request *h = r->http;
    int stream = r->stream;
    if (h) {
        r->http = NULL;
        r->cancelled = 1;
        atomic_store_explicit(&r->gone, 1, memory_order_relaxed);   /* its prefill stops at the next layer */
        /* a prefill leased before its answer went out: nobody learns its key, so nobody will pull
         * it; its KV held blocks and a sequence for kv_lease_ms (30 s) and then counted as an
         * expired hand-off */
        pd_srv_revoke_lease(s, r);
        /* one still waiting leaves the queue now (it counted as waiting, and held a place of
         * --max-queued-requests, until its turn came) */
        if (!r->started && pd_srv_wait_remove(s, r))
            s->n_cancelled++;
        pthread_cond_signal(&s->cv);
        pd_srv_req_unref(s, r);
    }
    pthread_mutex_unlock(&s->mu);
    /* A client that left (EOF) leaves its request to us, detached from the connection: libevent
     * frees it only when the reply ends (while the server is being freed, it frees them itself) */
    if (h && stream && !s->destroying)
        evhttp_send_reply_end(h);
    else if (h && !s->destroying && !evhttp_request_get_connection(h))
        evhttp_send_reply(h, 499, "Client Closed Request", NULL);
}

void pd_srv_answer_ending(struct pd_server *s, struct req *r, const char *why)
{
    if (r->stream && r->reply_started) {
        end_stream(s, r, NULL, why);
    } else {   /* nothing sent yet (a stream waiting for its KV pull has no 200 yet either) */
        pd_srv_send_error(s, r->http, 503, "server_error", NULL, "%s", why);
        pd_srv_answered(s, r);
    }
}

void pd_srv_answer_shutdown(struct pd_server *s, struct req *r)
{
    pd_srv_answer_ending(s, r, "the server is shutting down");
}

/* An inference server: one engine, an OpenAI-compatible HTTP front (libevent) and a scheduler
 * thread doing continuous batching. This is the colocated server (prefill and decode on the
 * same engine); the prefill and decode roles of PD disaggregation build on it.
 *
 * Endpoints: GET /health, GET /v1/models, GET /metrics (Prometheus text), POST /v1/completions
 * and POST /v1/chat/completions, streaming (server-sent events) or not. Requests are validated
 * (JSON, field types, max_tokens within max-model-len) and errors are OpenAI-style JSON with a
 * 4xx code. A client that disconnects cancels its request and frees its KV.
 *
 * Threads: the event loop owns the HTTP side; the scheduler thread owns the engine. They meet
 * under one mutex: a queue of waiting requests one way, a list of requests with new output the
 * other way (the loop is woken with event_active). */
#ifndef PD_PD_SERVER_H
#define PD_PD_SERVER_H

#include <stdint.h>

#include "core/err.h"

struct pd_server_opts {
    const char *model_dir;
    const char *served_name;        /* the model name clients use; default: the directory name */
    const char *host;               /* default 127.0.0.1 */
    int port;                       /* 0: ephemeral (pd_server_port tells) */
    int max_num_seqs;               /* running sequences; default 16 */
    int max_num_batched_tokens;     /* prompt tokens per step; default 512 */
    int max_model_len;              /* default 2048 */
    int threads;                    /* engine threads; 0: all cores */
    const char *api_key;            /* NULL: no key required */
};

struct pd_server;

int pd_server_create(const struct pd_server_opts *o, struct pd_server **out, pd_err *e);
int pd_server_port(const struct pd_server *s);
/* Runs the event loop until pd_server_stop (from a signal handler: it is async-signal-safe). */
int pd_server_run(struct pd_server *s, pd_err *e);
void pd_server_stop(struct pd_server *s);
void pd_server_destroy(struct pd_server *s);

#endif

/* An inference server: one engine, an OpenAI-compatible HTTP front (libevent) and a scheduler
 * thread doing continuous batching. This is the colocated server (prefill and decode on the
 * same engine); the prefill and decode roles of PD disaggregation build on it.
 *
 * PD roles (vLLM's kv_transfer_params): a producer (prefill) instance answers a request carrying
 * {"do_remote_decode": true} with its first token and {"do_remote_prefill": true, "remote_engine_id",
 * "remote_request_id", "remote_host", "remote_port", "remote_num_tokens", "last_token_id", ...},
 * keeping the request's KV under a lease; a consumer (decode) instance given those parameters
 * pulls the KV over UCX (src/pd/kvxfer.h), then decodes from the last token. If the pull fails,
 * the consumer prefills the prompt itself from its token ids (recompute) and continues with the
 * producer's first token: the client sees no duplicated or lost token.
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
    int64_t kv_cache_bytes;         /* KV pool size; 0: max_num_seqs sequences of max_model_len */
    const char *api_key;            /* NULL: no key required */
    /* PD disaggregation (--kv-transfer-config): role, the KV transfer port and this engine's id */
    int role;                       /* PD_ROLE_BOTH (colocated), PD_ROLE_PRODUCER, PD_ROLE_CONSUMER */
    int kv_port;                    /* producer: where decode instances pull from (0: ephemeral) */
    const char *kv_host;            /* producer: the host decode instances should use (127.0.0.1) */
    const char *engine_id;
    int kv_lease_ms, kv_timeout_ms; /* 0: 30000 */
    int handle_signals;             /* SIGINT/SIGTERM stop the loop (the command line's server) */
};

enum { PD_ROLE_BOTH = 0, PD_ROLE_PRODUCER = 1, PD_ROLE_CONSUMER = 2 };

struct pd_server;

int pd_server_create(const struct pd_server_opts *o, struct pd_server **out, pd_err *e);
int pd_server_port(const struct pd_server *s);
/* Runs the event loop until pd_server_stop (from another thread) or, with handle_signals, SIGINT
 * or SIGTERM. */
int pd_server_run(struct pd_server *s, pd_err *e);
void pd_server_stop(struct pd_server *s);
void pd_server_destroy(struct pd_server *s);

#endif

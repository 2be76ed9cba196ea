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
 * producer's first token: the client sees no duplicated or lost token. remote_request_id is the
 * lease's key: 32 hex digits of 128 random bits, good for one pull of the prompt the producer
 * computed (the consumer presents the hash of its own prompt's token ids). A pull the producer
 * refuses (an unknown, expired or already pulled id, another prompt) is not recomputed: the
 * client gets a 403 and the lease stays with its owner.
 *
 * Endpoints: GET /health, GET /readiness (200 when a completion can be taken now, else a 503
 * naming why), GET /v1/models, GET /metrics (Prometheus text), POST /v1/completions
 * and POST /v1/chat/completions, streaming (server-sent events) or not. Requests are validated
 * (JSON, field types, max_tokens within max-model-len) and errors are OpenAI-style JSON with a
 * 4xx code. A client that disconnects cancels its request and frees its KV.
 *
 * Threads: the event loop owns the HTTP side; the scheduler thread owns the engine. They meet
 * under one mutex: a queue of waiting requests one way, a list of requests with new output the
 * other way (the loop is woken with event_active).
 *
 * Expert parallelism (expert_parallel, under mpirun): the instance is one EP group over
 * MPI_COMM_WORLD. Every rank opens the engine with its slice of the routed experts and its own KV
 * pool; rank 0 alone runs the HTTP front and the scheduler. The scheduler gives each new sequence
 * to the least-loaded rank (its owner: the sequence's KV lives there only) and broadcasts every
 * step to the ranks: the sequences to free, then per sequence its owner, its new token ids and,
 * when it starts, its sampling parameters. Each rank steps its own sequences with the experts
 * exchanged over MPI (a rank with none still joins every exchange), samples them with the
 * request's sampler (so the tokens equal one process's), and rank 0 gathers the tokens and each
 * rank's free KV. With a PD role every rank has its own KV transfer engine over its own pool: a
 * producer rank k listens on kv_port + k and leases the KV of the sequences it owns, rank 0
 * answering kv_transfer_params with the owner rank's port (the ranks report released leases in
 * their answers; while leases are out and nothing runs, rank 0 asks every 20 ms); a consumer's
 * owner rank pulls the KV itself, or the prompt is recomputed there from its token ids. With
 * spec_k the hand-off also moves the draft's state between the owner ranks (server_ep_spec.c).
 * Every other rank holds a TCP connection to rank 0 from the group's start, so that rank 0 knows
 * a rank's death at once (server_ep_live.c): its /health and /readiness are 503s naming the rank,
 * its clients are answered so, and it exits 70 for the group to be restarted.
 * Between steps the other ranks sleep in a non-blocking broadcast's test; the
 * MPI calls are made by the scheduler thread (MPI_THREAD_SERIALIZED). Destroying rank 0's server
 * broadcasts the end of the group. The caller initialises MPI before pd_server_create and
 * finalises it after pd_server_destroy; if pd_server_run fails on any rank the group can no
 * longer step together and the caller ends it (MPI_Abort). */
#ifndef PD_PD_SERVER_H
#define PD_PD_SERVER_H

#include <stdint.h>

#include "core/err.h"
#include "http/front.h"
#include "plan/kvsize.h"

#define PD_MAX_KV_PRODUCERS 64

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
    enum pd_kv_dtype kv_dtype;      /* the KV cache's entries (PD_KV_BF16, the default, or PD_KV_FP8);
                                     * a KV hand-off between different dtypes is refused */
    const char *api_key;            /* NULL: no key required */
    /* PD disaggregation (--kv-transfer-config): role, the KV transfer port and this engine's id */
    int role;                       /* PD_ROLE_BOTH (colocated), PD_ROLE_PRODUCER, PD_ROLE_CONSUMER */
    int kv_port;                    /* producer: where decode instances pull from (0: ephemeral);
                                     * EP rank k: kv_port + k */
    const char *kv_host;            /* the address the KV transfer engine binds (and UCX's transports
                                     * keep to), which a producer tells decode instances; NULL: host
                                     * (127.0.0.1 in kv_transfer_params when host is a wildcard) */
    const char *engine_id;
    int kv_lease_ms, kv_timeout_ms; /* 0: 30000 */
    /* consumer: the producers it may pull from (kv_transfer_config "kv_producers": "host:port" or
     * "host:first-last"); a request naming another remote_host:remote_port is refused before any
     * connection (a client reaching the decode instance directly cannot make it connect anywhere).
     * n_kv_producers 0: any (the instance says so at start) */
    struct pd_kv_producer {
        char host[64];
        int port_lo, port_hi;
    } kv_producers[PD_MAX_KV_PRODUCERS];
    int n_kv_producers;
    int handle_signals;             /* SIGINT/SIGTERM stop the loop (the command line's server) */
    int shutdown_timeout_s;         /* with handle_signals: the first signal drains (new requests a 503,
                                     * those in flight, waiting and, on a prefill instance, leased
                                     * finish) for at most this many seconds, a second one stops at
                                     * once (vLLM's --shutdown-timeout); 0: stop at once */
    int expert_parallel;            /* one EP group over MPI_COMM_WORLD (MPI initialised by the caller) */
    int watchdog_s;                 /* an EP group's rank 0 ends the process (mpirun then the group)
                                     * when a round of the group has made no progress (no MoE layer
                                     * exchanged) for this many seconds: a rank stopped or hung
                                     * (SGLang's --watchdog-timeout); 0: 60, < 0: never */
    int prefix_caching;             /* 0 or 1: on, -1: off (--no-enable-prefix-caching); an EP group's
                                     * ranks each cache */
    int prefix_cache_unit;          /* tokens between cached boundaries; 0: 256 */
    struct pd_http_limits http;     /* connections: cap, timeouts, request sizes (0: defaults) */
    int max_queued_requests;        /* requests waiting for a place in the batch beyond which a new one
                                     * is a 429 with Retry-After (SGLang's --max-queued-requests);
                                     * 0: no limit but the connections' */
    int spec_k;                     /* --speculative-config: MTP drafts per decode step (engine/spec.h),
                                     * 0: off; colocated or PD, one process or an EP group (each
                                     * sequence's draft state on its owner rank) */
};

enum { PD_ROLE_BOTH = 0, PD_ROLE_PRODUCER = 1, PD_ROLE_CONSUMER = 2 };

struct pd_server;

int pd_server_create(const struct pd_server_opts *o, struct pd_server **out, pd_err *e);
int pd_server_port(const struct pd_server *s);
/* This process's rank in its EP group (0 without expert parallelism): only rank 0 serves HTTP. */
int pd_server_rank(const struct pd_server *s);
/* Runs the event loop until pd_server_stop (from another thread) or, with handle_signals, SIGINT
 * or SIGTERM. On an EP rank other than 0: takes the steps rank 0 broadcasts until it ends the
 * group (with handle_signals, a SIGINT or SIGTERM here waits for rank 0's end, at most 10 s), or
 * fails at once when rank 0 is gone (its connection closed: pd_server_rank0_gone). On
 * EP rank 0 it then ends the group's rounds; if they cannot end (a rank is gone), it answers every
 * client and ends the process with status 70 instead of returning. */
int pd_server_run(struct pd_server *s, pd_err *e);
/* On an EP rank other than 0, after pd_server_run failed: 1 when it failed because rank 0 is gone
 * (its connection closed while this rank waited for a round). MPI cannot end such a rank in order:
 * MPI_Abort waits for mpirun's own ending of the job (3.7 s measured after a SIGKILL of rank 0). */
int pd_server_rank0_gone(const struct pd_server *s);
void pd_server_stop(struct pd_server *s);
void pd_server_destroy(struct pd_server *s);

#endif

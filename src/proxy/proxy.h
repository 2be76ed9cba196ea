/* The PD proxy: the OpenAI-compatible endpoint clients talk to. For each completion it picks the
 * least-loaded prefill instance and sends it the request with max_tokens = 1, stream = false and
 * kv_transfer_params {"do_remote_decode": true}; it retries another prefill instance when one
 * fails (connection refused, 5xx; never on a 4xx, which goes back to the client as it is); then it
 * sends the original request plus the prefill's kv_transfer_params to the least-loaded decode
 * instance and relays its answer, streamed or not. If the decode instance fails, a streaming
 * client gets an error event and [DONE], a non-streaming one a 502 with a JSON error: never a 200
 * with an empty body. A client that disconnects has its decode request cancelled, which frees the
 * KV on the decode instance (the prefill's lease is released when the decode pulled, or expires).
 * Load of an instance = requests in flight through this proxy. With no prefill instance the proxy
 * balances colocated servers (given as --decode): the baseline disaggregation is measured against. */
#ifndef PD_PROXY_PROXY_H
#define PD_PROXY_PROXY_H

#include "core/err.h"
#include "http/front.h"

#define PD_PROXY_MAX_INSTANCES 32

struct pd_proxy_opts {
    const char *prefill[PD_PROXY_MAX_INSTANCES];   /* "host:port" */
    int n_prefill;
    const char *decode[PD_PROXY_MAX_INSTANCES];
    int n_decode;
    const char *host;                              /* default 127.0.0.1 */
    int port;                                      /* 0: ephemeral */
    const char *api_key;
    int retries;                                   /* prefill attempts; 0: 3 */
    int handle_signals;
    struct pd_http_limits http;                    /* client connections: cap, timeouts, sizes (0: defaults) */
};

struct pd_proxy;

int pd_proxy_create(const struct pd_proxy_opts *o, struct pd_proxy **out, pd_err *e);
int pd_proxy_port(const struct pd_proxy *p);
int pd_proxy_run(struct pd_proxy *p, pd_err *e);
void pd_proxy_stop(struct pd_proxy *p);
void pd_proxy_destroy(struct pd_proxy *p);

#endif

/* Cache-aware routing: which instance of a role most likely holds a request's prefix in its KV
 * cache, balanced against load (the policy of SGLang's router and its gateway, `cache_aware`).
 *
 * The proxy does not tokenize, so the index works on the request's prompt bytes (the "prompt" of a
 * completion, the "messages" of a chat as the client serialised them), cut into 16-byte chunks;
 * chunk i is known by a chained hash h_i = mix(h_{i-1}, hash(chunk i)), so h_i stands for the
 * whole prefix up to and including chunk i, as vLLM's block hashes do for token blocks. A
 * request that turn 2 of a chat sends repeats turn 1's messages, so its chain starts with turn
 * 1's. Per instance the index keeps the chains of the requests routed to it, least recently used
 * first out once it holds more than `max_bytes` of prompt text; an instance that was ejected
 * (it may have restarted with an empty cache) is forgotten. The index predicts, it does not know:
 * a wrong guess costs a recomputed prefix, never a wrong answer.
 *
 * The choice (pd_route_pick), among the eligible instances (up, not yet tried):
 *   least_loaded: the one with the fewest requests in flight (lowest index on ties);
 *   cache_aware:  if the loads are imbalanced (max - min > balance_abs and max > balance_rel *
 *                 min), the least loaded; else the one whose index matches the longest prefix,
 *                 if that match is more than cache_threshold of the request's chunks; else the
 *                 one whose index holds the least text (the most room to cache a new prefix).
 *                 Ties go to the less loaded, then the lower index.
 * SGLang's defaults: cache_threshold 0.3, balance_abs 64, balance_rel 1.5. */
#ifndef PD_PROXY_ROUTE_H
#define PD_PROXY_ROUTE_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"

#define PD_ROUTE_CHUNK 16
#define PD_ROUTE_MAX 32

enum pd_route_policy { PD_ROUTE_CACHE_AWARE, PD_ROUTE_LEAST_LOADED };

/* Why an instance was chosen (counted in the proxy's /metrics). */
enum pd_route_why { PD_ROUTE_BY_LOAD, PD_ROUTE_BY_BALANCE, PD_ROUTE_BY_PREFIX, PD_ROUTE_BY_ROOM, PD_ROUTE_N_WHY };

struct pd_route_opts {
    enum pd_route_policy policy;
    double cache_threshold;        /* 0.3 */
    int balance_abs;               /* 64 */
    double balance_rel;            /* 1.5 */
    size_t max_bytes;              /* prompt text indexed per instance; 0: 16 MiB */
};

/* A request's chained chunk hashes. */
struct pd_route_key {
    uint64_t *h;                   /* [n] */
    size_t n;                      /* full chunks of the prompt */
};

struct pd_route;

const char *pd_route_policy_name(enum pd_route_policy p);
const char *pd_route_why_name(enum pd_route_why w);
int pd_route_policy_parse(const char *s, enum pd_route_policy *p);

int pd_route_create(int n_instances, const struct pd_route_opts *o, struct pd_route **out, pd_err *e);
void pd_route_free(struct pd_route *r);

int pd_route_key_make(const void *prompt, size_t len, struct pd_route_key *k);
void pd_route_key_free(struct pd_route_key *k);

/* The instance for k among those in `eligible` (a bit per instance; at least one), given each
 * instance's load; *matched gets the chosen instance's matching chunks. */
int pd_route_pick(struct pd_route *r, const struct pd_route_key *k, const int *load, unsigned eligible,
                  enum pd_route_why *why, size_t *matched);
/* The request k went to instance i: its chain is now (most recently) there. */
int pd_route_insert(struct pd_route *r, int i, const struct pd_route_key *k);
/* Instance i's cache is gone (ejected: it may come back empty). */
void pd_route_forget(struct pd_route *r, int i);
/* Chunks instance i's index holds, and how many of k's leading chunks it matches. */
size_t pd_route_size(const struct pd_route *r, int i);
size_t pd_route_match(const struct pd_route *r, int i, const struct pd_route_key *k);

#endif

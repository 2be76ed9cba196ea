/* bench transfer's two halves: the single-process hand-off against raw UCX gets (transfer.c) and
 * the two-process one across hosts (transfer_hosts.c), sharing the KV pool put through a history
 * of serving. Internal to bench/. */
#ifndef PD_BENCH_TRANSFER_H
#define PD_BENCH_TRANSFER_H

#include "engine/kvpool.h"
#include "pd/kvxfer.h"

#define POOL_SEQS 64
#define POOL_BYTES ((size_t)256 << 20)
#define DECODE_TOKENS 256   /* what the measured request reserves beyond its prompt */
#define MAX_SIZES 16        /* prompt sizes of one run */

/* A KV pool after a history of serving: requests of random lengths admitted (prompt first, as
 * the servers reserve them) and finished in random order, about 70% of the blocks in use. */
struct pool {
    struct pd_kvpool kv;
    struct pd_kvseq live[POOL_SEQS];
    int n_live;
    unsigned rng;
};

/* `events` admissions and finishes of random requests, the pool kept about 70% full. */
void pd_bxfer_churn(struct pool *p, int events);
/* A pool in memory its transfer engine allocates, as a server's (src/pd/server.c), after a
 * history of serving; host and listen_port as in struct pd_kvx_opts. 0, or -1 with e filled. */
int pd_bxfer_pool_open(struct pool *p, const struct pd_model *m, unsigned seed, const char *host, int listen_port,
                       struct pd_kvx **x, pd_err *e);
void pd_bxfer_pool_close(struct pool *p);
/* The measured request reserved as a server reserves it (prompt and DECODE_TOKENS), finishing
 * others until it fits; its prompt's runs in *r (malloc'ed); their count, or -1. */
int pd_bxfer_reserve(struct pool *p, struct pd_kvseq *s, int64_t tokens, struct pd_kvx_run **r);

/* Across hosts (transfer_hosts.c). "HOST:PORT" into host and port; -1 after printing why, naming
 * flag. */
int pd_bxfer_hostport(const char *flag, const char *s, char *host, size_t cap, int *port);
/* --serve: the producer; --peer: the consumer. Exit codes as the command's. */
int pd_bxfer_serve(const char *host, int port, const struct pd_model *m, int timeout_s, int json);
int pd_bxfer_peer(const char *host, int port, const int64_t *tokens, int n_sizes, int reps, const struct pd_model *m,
                  int json);

#endif

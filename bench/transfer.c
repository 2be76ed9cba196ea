/* `pdmoe bench transfer`: KV hand-off throughput of the transfer engine (src/pd/kvxfer), set
 * against a raw UCX get measured in the same run.
 *
 * For prompts of 1K..32K tokens, one sequence of v4-flash-mini (bf16) is handed off between two
 * real KV pools (engine/kvpool, 16-entry blocks, in memory their transfer engines allocate, as
 * `pdmoe serve` builds them), each first put
 * through its own history of serving: a few thousand requests of random prompt (64..8K tokens)
 * and output (16..1K tokens) lengths admitted and finished in random order, the pool kept about
 * 70% full. Each side then reserves the measured request (the prompt and 256 tokens to decode)
 * as the servers do, and hands its pd_kvseq_runs (one run per block and the slot) to the engine,
 * so the allocator's layout and the engine's merging are both part of what is timed. One hand-off
 * = GET_META + gets + DONE/ACK, producer and consumer in this process, each with its own UCP
 * context, over loopback.
 * Baseline: one ucp_get_nbx of the same total size, contiguous, between two other contexts over
 * an endpoint of the same kind as the engine's data endpoint, in buffers UCX allocated (like
 * ucx_perftest's ucp_get, which allocates them with UCP_MEM_MAP_ALLOCATE); the
 * ratio engine / that is the figure of merit (target >= 0.8). A second baseline issues the
 * engine's own gets (same pieces) by hand with one flush: engine / that isolates the protocol's
 * cost from UCX's cost per get. Both sides are progressed from one thread, for the engine and
 * the baselines alike. MB/s = 10^6 bytes/s, best of the repetitions, for UCX_TLS unset (UCX's
 * choice: shared memory on one host) and UCX_TLS=tcp.
 * The hand-off's share of TTFT: the same prompt's prefill on the engine (--model, default
 * models/mini, one thread, as pdmoe up runs it) measured in the same run, TTFT taken as prefill +
 * hand-off (the first decode step aside); --quick measures the 1K prompt only.
 * Options: --quick (fewer sizes and repetitions, under 10 s), --tls LIST (only that UCX_TLS),
 * --model DIR.
 *
 * Across hosts, two processes (tests/cluster/shaped_link.sh): `--serve HOST:PORT` is the
 * producer, a pool built as above whose sequences it leases on request, answering on a control
 * channel at HOST:PORT (its KV listener on HOST, an ephemeral port); it exits after the
 * consumer's "bye" (0), or when no consumer came or one fell silent for --timeout seconds (1;
 * default 60). `--peer HOST:PORT` is the consumer: for each of --tokens N,N,... (default 1K to
 * 32K) it asks for a lease and pulls it --reps times (default 5) after a warm-up, timing each
 * hand-off, and sets it against the same bytes sent down a plain TCP socket over the same link.
 * The lease's key (its random id and hash) comes over the control channel, as a proxy hands
 * kv_transfer_params from prefill to decode; see "two processes, across hosts" below.
 * --json prints either side's results as JSON. */
#include "bench.h"
#include "cli/cli.h"

#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <jansson.h>

#include <ucp/api/ucp.h>

#include "core/timing.h"
#include "engine/kvpool.h"
#include "plan/kvsize.h"
#include "plan/perf.h"
#include "pd/kvxfer.h"

#define POOL_SEQS 64
#define POOL_BYTES ((size_t)256 << 20)
#define DECODE_TOKENS 256   /* what the measured request reserves beyond its prompt */

/* ------------------------------------------------------------------ raw UCX baseline */

struct piece {
    uint64_t src, dst, len;
};

struct raw_side {
    ucp_context_h ctx;
    ucp_worker_h w;
    ucp_mem_h memh;
    uint8_t *buf;
};

/* A context, a worker and `len` bytes allocated by UCX, as ucx_perftest allocates its buffers
 * (and as the transfer engine allocates a server's KV pool), every page touched. */
static int raw_side_init(struct raw_side *s, size_t len)
{
    memset(s, 0, sizeof *s);
    ucp_config_t *cfg;
    if (ucp_config_read(NULL, NULL, &cfg) != UCS_OK)
        return -1;
    /* the same transport choice as the engine (kvxfer.c): shared memory for error-mode-peer
     * endpoints needs its error handling exposed */
    const char *tls = getenv("UCX_TLS");
    if (!tls || !*tls || tls[0] == '^' || strstr(tls, "sm") || strstr(tls, "posix") ||
        strstr(tls, "sysv") || strstr(tls, "mm") || strstr(tls, "all"))
        ucp_config_modify(cfg, "MM_ERROR_HANDLING", "y");
    ucp_params_t cp = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_RMA};
    ucs_status_t st = ucp_init(&cp, cfg, &s->ctx);
    ucp_config_release(cfg);
    if (st != UCS_OK)
        return -1;
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if (ucp_worker_create(s->ctx, &wp, &s->w) != UCS_OK)
        return -1;
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS,
        .address = NULL,
        .length = len,
        .flags = UCP_MEM_MAP_ALLOCATE,
    };
    if (ucp_mem_map(s->ctx, &mp, &s->memh) != UCS_OK) {
        s->memh = NULL;
        return -1;
    }
    ucp_mem_attr_t ma = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS};
    if (ucp_mem_query(s->memh, &ma) != UCS_OK)
        return -1;
    s->buf = ma.address;
    memset(s->buf, 0x5a, len);
    return 0;
}

static void raw_side_free(struct raw_side *s)
{
    if (s->memh)
        ucp_mem_unmap(s->ctx, s->memh);
    if (s->w)
        ucp_worker_destroy(s->w);
    if (s->ctx)
        ucp_cleanup(s->ctx);
}

static void raw_done(void *req, ucs_status_t st, void *user_data)
{
    *(ucs_status_t *)user_data = st;
}

/* Waits for a request, progressing both workers; returns its status. */
static ucs_status_t raw_wait(struct raw_side *c, struct raw_side *p, ucs_status_ptr_t r,
                             ucs_status_t *st)
{
    if (r == NULL)
        return UCS_OK;
    if (UCS_PTR_IS_ERR(r))
        return UCS_PTR_STATUS(r);
    while (*st == UCS_INPROGRESS) {
        ucp_worker_progress(c->w);
        ucp_worker_progress(p->w);
    }
    ucp_request_free(r);
    return *st;
}

static void raw_close(struct raw_side *c, struct raw_side *p, ucp_ep_h ep)
{
    ucp_request_param_t cp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                              .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &cp);
    if (r && !UCS_PTR_IS_ERR(r)) {
        while (ucp_request_check_status(r) == UCS_INPROGRESS) {
            ucp_worker_progress(c->w);
            ucp_worker_progress(p->w);
        }
        ucp_request_free(r);
    }
}

/* Best bandwidth (bytes/s) of one contiguous get of `bytes`, over `reps` repetitions; with
 * pieces (n > 0) the same bytes as n gets of the given (src offset, dst offset, length). Each
 * side's region is as long as the gets reach. */
static double raw_get_bw(size_t bytes, int reps, const struct piece *pc, int n)
{
    size_t len = bytes;
    for (int j = 0; j < n; j++) {
        uint64_t end = (pc[j].src > pc[j].dst ? pc[j].src : pc[j].dst) + pc[j].len;
        if (end > len)
            len = end;
    }
    struct raw_side p = {0}, c = {0};
    double best = 0;
    ucp_ep_h ep = NULL;
    void *rkbuf = NULL;
    ucp_rkey_h rkey = NULL;
    ucp_address_t *addr = NULL;
    size_t alen, rklen;
    if (raw_side_init(&p, len) || raw_side_init(&c, len))
        goto out;
    if (ucp_worker_get_address(p.w, &addr, &alen) != UCS_OK)
        goto out;
    ucp_ep_params_t ep_p = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .address = addr,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,   /* as the engine's data endpoint */
    };
    if (ucp_ep_create(c.w, &ep_p, &ep) != UCS_OK)
        goto out;
    if (ucp_rkey_pack(p.ctx, p.memh, &rkbuf, &rklen) != UCS_OK ||
        ucp_ep_rkey_unpack(ep, rkbuf, &rkey) != UCS_OK)
        goto out;
    for (int i = 0; i <= reps; i++) {   /* the first one warms up (wireup, page faults) */
        ucs_status_t st = UCS_INPROGRESS;
        ucp_request_param_t rp = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                            UCP_OP_ATTR_FIELD_MEMH,
            .cb.send = raw_done,
            .user_data = &st,
            .memh = c.memh,
        };
        double t0 = pd_now_s();
        if (n > 0) {
            ucp_request_param_t np = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH, .memh = c.memh};
            int bad = 0;
            for (int j = 0; j < n && !bad; j++) {
                uint64_t from = (uint64_t)(uintptr_t)(p.buf + pc[j].src);
                ucs_status_ptr_t g = ucp_get_nbx(ep, c.buf + pc[j].dst, pc[j].len, from, rkey, &np);
                if (UCS_PTR_IS_ERR(g))
                    bad = 1;
                else if (g)
                    ucp_request_free(g);
            }
            ucp_request_param_t fp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                                      UCP_OP_ATTR_FIELD_USER_DATA,
                                      .cb.send = raw_done, .user_data = &st};
            if (bad || raw_wait(&c, &p, ucp_ep_flush_nbx(ep, &fp), &st) != UCS_OK)
                break;
        } else {
            ucs_status_ptr_t r = ucp_get_nbx(ep, c.buf, bytes, (uint64_t)(uintptr_t)p.buf, rkey, &rp);
            if (raw_wait(&c, &p, r, &st) != UCS_OK)
                break;
        }
        double bw = (double)bytes / (pd_now_s() - t0);
        if (i > 0 && bw > best)
            best = bw;
    }
out:
    if (rkey)
        ucp_rkey_destroy(rkey);
    if (rkbuf)
        ucp_rkey_buffer_release(rkbuf);
    if (ep)
        raw_close(&c, &p, ep);
    if (addr)
        ucp_worker_release_address(p.w, addr);
    raw_side_free(&c);
    raw_side_free(&p);
    return best;
}

/* ------------------------------------------------------------------ the engine */

/* A KV pool after a history of serving: requests of random lengths admitted (prompt first, as
 * the servers reserve them) and finished in random order, about 70% of the blocks in use. */
struct pool {
    struct pd_kvpool kv;
    struct pd_kvseq live[POOL_SEQS];
    int n_live;
    unsigned rng;
};

static unsigned next_rand(unsigned *x)
{
    *x = *x * 1103515245u + 12345u;
    return *x >> 8;
}

static void finish_one(struct pool *p)
{
    int k = (int)(next_rand(&p->rng) % (unsigned)p->n_live);
    pd_kvseq_free(&p->kv, &p->live[k]);
    p->live[k] = p->live[--p->n_live];
}

static void churn(struct pool *p, int events)
{
    pd_err e = {0};
    for (int i = 0; i < events; i++) {
        int busy = p->kv.n_blocks - p->kv.n_blocks_free;
        if (p->n_live > 0 && (p->n_live == POOL_SEQS - 1 || busy > p->kv.n_blocks * 7 / 10 || next_rand(&p->rng) % 3 == 0)) {
            finish_one(p);
            continue;
        }
        int64_t prompt = 64 + next_rand(&p->rng) % 8129, out = 16 + next_rand(&p->rng) % 1009;
        struct pd_kvseq *s = &p->live[p->n_live];
        if (pd_kvseq_alloc(&p->kv, s, &e))
            continue;
        if (pd_kvseq_reserve_prompt(&p->kv, s, prompt, prompt + out, &e))
            pd_kvseq_free(&p->kv, s);
        else
            p->n_live++;
    }
}

/* A pool in memory its transfer engine allocates, as a server's (src/pd/server.c); host and
 * listen_port as listen_host and listen_port in struct pd_kvx_opts. */
static int pool_open(struct pool *p, const struct pd_model *m, unsigned seed, const char *host, int listen_port,
                     struct pd_kvx **x, pd_err *e)
{
    memset(p, 0, sizeof *p);
    p->rng = seed;
    if (pd_kvpool_init(&p->kv, m, POOL_SEQS, POOL_BYTES, 16, e))
        return -1;
    struct pd_kvx_opts o = {.listen_host = host, .listen_port = listen_port, .region_len = p->kv.region_bytes};
    if (pd_kvx_create(&o, x, e))
        return -1;
    pd_kvpool_move(&p->kv, pd_kvx_region(*x));
    /* touch every page so neither side measures first-touch faults */
    memset(p->kv.region, 0x5a, p->kv.region_bytes);
    churn(p, 4000);
    return 0;
}

static void pool_close(struct pool *p)
{
    while (p->n_live > 0)
        pd_kvseq_free(&p->kv, &p->live[--p->n_live]);
    pd_kvpool_free(&p->kv);
}

/* The measured request on one side: reserved as a server reserves it, finishing others until
 * it fits; its runs for the prompt go to r (n returned, -1 on failure). */
static int reserve_measured(struct pool *p, struct pd_kvseq *s, int64_t tokens, struct pd_kvx_run **r)
{
    pd_err e = {0};
    while (pd_kvseq_alloc(&p->kv, s, &e) == 0) {
        if (pd_kvseq_reserve_prompt(&p->kv, s, tokens, tokens + DECODE_TOKENS, &e) == 0)
            break;
        pd_kvseq_free(&p->kv, s);
        if (p->n_live == 0)
            return -1;
        finish_one(p);
    }
    if (s->slot < 0)
        return -1;
    int n;
    /* struct pd_kv_run and struct pd_kvx_run are the same (offset, length) pairs */
    *r = (struct pd_kvx_run *)pd_kvseq_runs_alloc(&p->kv, s, tokens, &n, NULL);
    return *r ? n : -1;
}

/* The pieces contiguous on both sides, as the engine cuts the byte stream. */
static int both_sides(const struct pd_kvx_run *sr, int ns, const struct pd_kvx_run *dr, int nd, struct piece *pc)
{
    int np = 0, i = 0, j = 0;
    uint64_t si = 0, dj = 0;   /* bytes of the current runs already covered */
    while (i < ns && j < nd) {
        uint64_t len = sr[i].len - si < dr[j].len - dj ? sr[i].len - si : dr[j].len - dj;
        uint64_t from = sr[i].off + si, to = dr[j].off + dj;
        if (np && pc[np - 1].src + pc[np - 1].len == from && pc[np - 1].dst + pc[np - 1].len == to)
            pc[np - 1].len += len;
        else
            pc[np++] = (struct piece){from, to, len};
        if ((si += len) == sr[i].len)
            i++, si = 0;
        if ((dj += len) == dr[j].len)
            j++, dj = 0;
    }
    return np;
}

struct result {
    double bw;       /* bytes/s, best of the repetitions */
    uint64_t gets;   /* per hand-off */
    int ok;
};

static struct result engine_bw(struct pd_kvx *p, struct pd_kvx *c, uint64_t *req, const struct pd_kvx_run *src,
                               int ns, const struct pd_kvx_run *dst, int nd, uint64_t bytes, int reps)
{
    struct result res = {0};
    pd_err e = {0};
    for (int i = 0; i <= reps; i++) {   /* the first one connects and warms up */
        uint64_t id = (*req)++;
        struct pd_kvx_key key;
        struct pd_kvx_xfer *t = NULL;
        double t0 = pd_now_s();
        if (pd_kvx_key_new(&key, id, &e) || pd_kvx_offer(p, &key, id, src, ns, NULL, NULL, &e) ||
            pd_kvx_pull(c, "127.0.0.1", pd_kvx_port(p), &key, dst, nd, &t, &e)) {
            fprintf(stderr, "bench transfer: %s\n", e.msg);
            return res;
        }
        enum pd_kvx_state s;
        do {
            pd_kvx_progress(c);
            pd_kvx_progress(p);
            s = pd_kvx_state(c, t);
        } while (s != PD_KVX_DONE && s != PD_KVX_FAILED);
        double dt = pd_now_s() - t0;
        if (s == PD_KVX_FAILED) {
            pd_kvx_result(c, t, &e);
            fprintf(stderr, "bench transfer: %s\n", e.msg);
            pd_kvx_xfer_free(c, t);
            return res;
        }
        res.gets = pd_kvx_xfer_gets(c, t);
        pd_kvx_xfer_free(c, t);
        double bw = (double)bytes / dt;
        if (i > 0 && bw > res.bw)
            res.bw = bw;
    }
    res.ok = 1;
    return res;
}

/* One UCX_TLS setting's table; with `out` (--json) its rows go there instead of stdout. */
static int run_tls(const char *tls, const int64_t *tokens, int n_sizes, const struct pd_model *m, int reps,
                   const double *prefill_s, json_t *out)
{
    if (tls)
        setenv("UCX_TLS", tls, 1);
    else
        unsetenv("UCX_TLS");
    struct pool P = {0}, D = {0};
    struct pd_kvx *p = NULL, *c = NULL;
    json_t *rows = NULL;
    int rc = 1;
    pd_err e = {0};
    if (pool_open(&P, m, 1, NULL, 0, &p, &e) || pool_open(&D, m, 2, NULL, -1, &c, &e)) {
        fprintf(stderr, "bench transfer: %s\n", e.msg);
        goto out;
    }
    rows = out ? json_array() : NULL;
    if (!out) {
        printf("\nUCX_TLS=%s\n", tls ? tls : "(unset: UCX's choice)");
        printf("%8s %8s %7s %6s %12s %12s %7s %12s %7s %11s %11s %8s\n", "tokens", "KV MiB", "runs", "gets",
               "engine MB/s", "1-get MB/s", "ratio", "same-gets", "ratio", "hand-off ms", "prefill ms", "of TTFT");
    }
    uint64_t req = 1;
    double worst = 1e9;
    for (int i = 0; i < n_sizes; i++) {
        struct pd_kvseq ps, ds;
        struct pd_kvx_run *sr = NULL, *dr = NULL;
        struct piece *pc = NULL;
        int ns = reserve_measured(&P, &ps, tokens[i], &sr), nd = reserve_measured(&D, &ds, tokens[i], &dr);
        uint64_t bytes = 0;
        for (int k = 0; k < ns; k++)
            bytes += sr[k].len;
        struct result r = {0};
        double raw = 0, same = 0;
        /* small hand-offs last tens of microseconds: more repetitions, so that the best of
         * them is as steady as for the large ones (up to 10x, about 13 MB per repetition) */
        int rr = reps * (bytes >= 13000000 ? 1 : bytes < 1300000 ? 10 : (int)(13000000 / bytes));
        if (ns > 0 && nd == ns && (pc = malloc((size_t)(ns + nd) * sizeof *pc))) {
            r = engine_bw(p, c, &req, sr, ns, dr, nd, bytes, rr);
            raw = raw_get_bw(bytes, rr, NULL, 0);
            /* the engine's gets, issued by hand: what UCX itself costs per piece */
            same = raw_get_bw(bytes, rr, pc, both_sides(sr, ns, dr, nd, pc));
        }
        free(sr);
        free(dr);
        free(pc);
        if (ps.slot >= 0)
            pd_kvseq_free(&P.kv, &ps);
        if (ds.slot >= 0)
            pd_kvseq_free(&D.kv, &ds);
        if (!r.ok || raw <= 0 || same <= 0) {
            fprintf(stderr, "bench transfer: the %lld-token hand-off or the raw UCX get failed (UCX_TLS=%s)\n",
                    (long long)tokens[i], tls ? tls : "unset");
            goto out;
        }
        double ratio = r.bw / raw;
        if (ratio < worst)
            worst = ratio;
        double hand = (double)bytes / r.bw;
        if (out) {
            json_array_append_new(rows, json_pack("{s:I, s:I, s:i, s:I, s:f, s:f, s:f, s:f, s:f, s:f, s:o, s:o}",
                                                  "tokens", (json_int_t)tokens[i], "bytes", (json_int_t)bytes,
                                                  "runs", ns, "gets", (json_int_t)r.gets, "engine_MBps", r.bw / 1e6,
                                                  "one_get_MBps", raw / 1e6, "ratio", ratio, "same_gets_MBps",
                                                  same / 1e6, "same_gets_ratio", r.bw / same, "handoff_s", hand,
                                                  "prefill_s", prefill_s[i] > 0 ? json_real(prefill_s[i]) : json_null(),
                                                  "share_of_ttft", prefill_s[i] > 0
                                                      ? json_real(hand / (prefill_s[i] + hand)) : json_null()));
        } else {
            printf("%8lld %8.1f %7d %6llu %12.0f %12.0f %7.2f %12.0f %7.2f %11.2f", (long long)tokens[i],
                   (double)bytes / (1 << 20), ns, (unsigned long long)r.gets, r.bw / 1e6, raw / 1e6, ratio,
                   same / 1e6, r.bw / same, hand * 1e3);
            if (prefill_s[i] > 0)
                printf(" %11.0f %7.2f%%\n", prefill_s[i] * 1e3, 100 * hand / (prefill_s[i] + hand));
            else
                printf(" %11s %8s\n", "-", "-");
            fflush(stdout);
        }
        churn(&P, 200);
        churn(&D, 200);
    }
    if (out)
        json_array_append_new(out, json_pack("{s:s, s:o, s:f, s:f}", "ucx_tls", tls ? tls : "", "rows", rows,
                                             "lowest_ratio", worst, "target_ratio", 0.8));
    else
        printf("lowest ratio %.2f (target >= 0.80)\n", worst);
    rows = NULL;
    rc = 0;
out:
    json_decref(rows);
    /* the pools first: their memory is the engines' */
    pool_close(&P);
    pool_close(&D);
    pd_kvx_destroy(c);
    pd_kvx_destroy(p);
    return rc;
}

/* The same prompt lengths on the seed's deployment (V4-Flash, 910B, RoCE), by the performance
 * model: where the hand-off's share of TTFT matters is at scale, not on one CPU. */
static int seed_share(const int64_t *tokens, int n, json_t *out)
{
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.max_model_len = 131072;
    struct pd_plan p;
    pd_err e = {0};
    if (pd_plan_build(&o, &p, &e)) {
        fprintf(stderr, "bench transfer: %s\n", e.msg);
        return 1;
    }
    json_t *rows = out ? json_array() : NULL;
    if (!out) {
        printf("\nPredicted for the seed's deployment (deepseek-v4-flash, fp8 KV, P 4 x EP8 on 910B, %s at %.0f GB/s; "
               "pdmoe plan --isl N):\n", p.hw.rdma.name, p.hw.rdma.bandwidth_Bps / 1e9);
        printf("%8s %10s %12s %12s %10s %8s\n", "tokens", "KV MB", "hand-off ms", "prefill ms", "TTFT ms", "of TTFT");
    }
    for (int i = 0; i < n; i++) {
        struct pd_workload w;
        pd_workload_default(&w);
        w.isl = tokens[i];
        struct pd_perf f;
        if (pd_perf_eval(&p, &w, &f, &e)) {
            fprintf(stderr, "bench transfer: %s\n", e.msg);
            pd_plan_free(&p);
            json_decref(rows);
            return 1;
        }
        if (rows) {
            json_array_append_new(rows, json_pack("{s:I, s:I, s:f, s:f, s:f, s:f}", "tokens", (json_int_t)tokens[i],
                                                  "bytes", (json_int_t)pd_kv_seq_bytes(&p.kv, tokens[i]), "handoff_s",
                                                  f.handoff_s, "prefill_s", f.prefill_s, "ttft_s", f.ttft_s,
                                                  "share_of_ttft", f.handoff_s / f.ttft_s));
            continue;
        }
        printf("%8lld %10.1f %12.2f %12.1f %10.1f %7.2f%%\n", (long long)tokens[i],
               (double)pd_kv_seq_bytes(&p.kv, tokens[i]) / 1e6, f.handoff_s * 1e3, f.prefill_s * 1e3, f.ttft_s * 1e3,
               100 * f.handoff_s / f.ttft_s);
    }
    if (rows)
        json_object_set_new(out, "seed_predicted", json_pack("{s:s, s:f, s:o}", "link", p.hw.rdma.name,
                                                             "bandwidth_Bps", p.hw.rdma.bandwidth_Bps, "rows", rows));
    pd_plan_free(&p);
    return 0;
}

/* ------------------------------------------------------------------ two processes, across hosts */

/* The producer (--serve) and the consumer (--peer) are two processes, on two hosts, and the
 * hand-off crosses the network between them. What a proxy does between a prefill and a decode
 * server (hand the lease's key from one to the other) a plain TCP connection does here, the
 * control channel on the --serve address, one text line per message:
 *   p->c  "pdmoe-bench-transfer 1 kv_port N"   on connect: the producer's KV listener
 *   c->p  "ping"              p->c "pong"      the channel's round trip (the link's, measured)
 *   c->p  "lease T"           p->c "key ID HASH BYTES RUNS" or "error WHY": a sequence of T
 *                                              tokens reserved and offered under a fresh key
 *                                              (128 random bits, pd_kvx_key_new), released on DONE
 *   c->p  "stream N"          p->c N bytes     the baseline: the same bytes over a plain socket
 *   c->p  "bye"               p->c "bye ..."   the producer's lease counts; it then exits
 * Nothing on the channel is timed except the stream baseline; the hand-off is timed from
 * pd_kvx_pull to DONE acknowledged. */

#define CTL_VERSION 1
#define MAX_SIZES 16
#define MAX_LEASES 8

/* "HOST:PORT" (the last colon splits) into host and port; -1 after printing why. */
static int parse_hostport(const char *flag, const char *s, char *host, size_t cap, int *port)
{
    const char *c = strrchr(s, ':');
    char *end;
    long v = c ? strtol(c + 1, &end, 10) : 0;
    if (!c || c == s || (size_t)(c - s) >= cap || !c[1] || *end || v < 1 || v > 65535) {
        fprintf(stderr, "pdmoe bench transfer: %s %s: expected HOST:PORT (an address of this network and a port "
                "of 1 to 65535)\n", flag, s);
        return -1;
    }
    memcpy(host, s, (size_t)(c - s));
    host[c - s] = 0;
    *port = (int)v;
    return 0;
}

struct ctl {
    int fd;
    size_t have;
    char buf[4096];
};

static int ctl_write(int fd, const void *p, size_t n)
{
    const char *b = p;
    while (n > 0) {
        ssize_t w = write(fd, b, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

static int ctl_send(struct ctl *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int ctl_send(struct ctl *c, const char *fmt, ...)
{
    char line[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n < 0 || n >= (int)sizeof line - 1)
        return -1;
    line[n++] = '\n';
    return ctl_write(c->fd, line, (size_t)n);
}

/* One line without its newline; -1 on end of stream, error or the socket's receive timeout. */
static int ctl_line(struct ctl *c, char *out, size_t cap)
{
    for (;;) {
        char *nl = memchr(c->buf, '\n', c->have);
        if (nl) {
            size_t n = (size_t)(nl - c->buf);
            if (n >= cap)
                return -1;
            memcpy(out, c->buf, n);
            out[n] = 0;
            c->have -= n + 1;
            memmove(c->buf, nl + 1, c->have);
            return 0;
        }
        if (c->have == sizeof c->buf)
            return -1;
        ssize_t r = read(c->fd, c->buf + c->have, sizeof c->buf - c->have);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        c->have += (size_t)r;
    }
}

/* Reads and drops n bytes (what is already buffered first). */
static int ctl_skip(struct ctl *c, uint64_t n)
{
    size_t k = c->have < n ? c->have : (size_t)n;
    memmove(c->buf, c->buf + k, c->have - k);
    c->have -= k;
    n -= k;
    static char sink[1 << 16];
    while (n > 0) {
        ssize_t r = read(c->fd, sink, n < sizeof sink ? (size_t)n : sizeof sink);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        n -= (uint64_t)r;
    }
    return 0;
}

/* Small messages go at once (the ping measures the round trip, not Nagle's delay); a silent
 * peer ends a read after `timeout_s`. */
static void ctl_tune(int fd, int timeout_s)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct timeval tv = {timeout_s, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

/* A TCP socket bound (listen) or connected to host:port; -1 with the reason in e. */
static int ctl_socket(const char *host, int port, int listen_too, pd_err *e)
{
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV | (listen_too ? AI_PASSIVE : 0)};
    struct addrinfo *ai = NULL;
    int rc = getaddrinfo(host, ps, &hints, &ai);
    if (rc != 0 || !ai) {
        pd_err_set(e, PD_EINVAL, "cannot resolve %s:%d: %s", host, port, gai_strerror(rc));
        return -1;
    }
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
    if (fd >= 0 && listen_too) {
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        rc = bind(fd, ai->ai_addr, ai->ai_addrlen) || listen(fd, 4);
    } else if (fd >= 0) {
        rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
    }
    if (fd < 0 || rc) {
        pd_err_set(e, PD_EIO, "cannot %s %s:%d: %s", listen_too ? "listen on" : "connect to", host, port,
                   strerror(errno));
        if (fd >= 0)
            close(fd);
        fd = -1;
    }
    freeaddrinfo(ai);
    return fd;
}

/* The producer: a pool as the single-process bench builds it, leases handed out on request.
 * Two threads: this one answers the control channel (reserving and offering sequences), a
 * second progresses the engine, asleep on its event fd like a server's idle thread; the release
 * callbacks run there, so the pool is shared under `mu`. */
struct producer {
    pthread_mutex_t mu;
    struct pool P;
    struct pd_kvx *x;
    struct {
        struct pd_kvseq seq;
        int used;
    } lease[MAX_LEASES];
    uint64_t released[4];
    int leases;
    int closing;             /* the leases' sequences are freed by the teardown, not on release */
    atomic_int stop;
};

static void producer_release(void *arg, uint64_t owner, enum pd_kvx_release why)
{
    struct producer *s = arg;
    pthread_mutex_lock(&s->mu);
    if (!s->closing && s->lease[owner].used) {
        pd_kvseq_free(&s->P.kv, &s->lease[owner].seq);
        s->lease[owner].used = 0;
    }
    s->released[why]++;
    pthread_mutex_unlock(&s->mu);
}

static void *producer_progress(void *arg)
{
    struct producer *s = arg;
    while (!atomic_load(&s->stop))
        pd_kvx_wait(s->x, NULL, 100);
    return NULL;
}

/* "lease T": reserve a sequence of T tokens as a server does after prefill, offer it. */
static void producer_lease(struct producer *s, struct ctl *c, long long tokens)
{
    pd_err e = {0};
    struct pd_kvx_run *runs = NULL;
    int k, n = -1;
    uint64_t bytes = 0;
    pthread_mutex_lock(&s->mu);
    for (k = 0; k < MAX_LEASES && s->lease[k].used; k++)
        ;
    if (k < MAX_LEASES) {
        churn(&s->P, 200);
        n = reserve_measured(&s->P, &s->lease[k].seq, tokens, &runs);
        if (n > 0)
            s->lease[k].used = 1;
        else if (s->lease[k].seq.slot >= 0)
            pd_kvseq_free(&s->P.kv, &s->lease[k].seq);
    }
    pthread_mutex_unlock(&s->mu);
    if (k == MAX_LEASES) {
        ctl_send(c, "error %d leases held already: pull or let them expire first", MAX_LEASES);
        return;
    }
    if (n <= 0) {
        free(runs);
        ctl_send(c, "error no room for %lld tokens in a KV pool of %zu bytes", tokens, s->P.kv.region_bytes);
        return;
    }
    for (int i = 0; i < n; i++)
        bytes += runs[i].len;
    struct pd_kvx_key key;
    char id[PD_KVX_ID_HEX];
    int rc = pd_kvx_key_new(&key, (uint64_t)++s->leases, &e);
    if (!rc)
        rc = pd_kvx_offer(s->x, &key, (uint64_t)k, runs, n, producer_release, s, &e);
    free(runs);
    if (rc) {
        pthread_mutex_lock(&s->mu);
        pd_kvseq_free(&s->P.kv, &s->lease[k].seq);
        s->lease[k].used = 0;
        pthread_mutex_unlock(&s->mu);
        ctl_send(c, "error %s", e.msg);
        return;
    }
    pd_kvx_id_format(&key, id);
    ctl_send(c, "key %s %016llx %llu %d", id, (unsigned long long)key.hash, (unsigned long long)bytes, n);
}

/* "stream N": N bytes down the control channel, the baseline's payload. */
static int producer_stream(struct ctl *c, uint64_t n)
{
    static char junk[1 << 16];
    while (n > 0) {
        size_t k = n < sizeof junk ? (size_t)n : sizeof junk;
        if (ctl_write(c->fd, junk, k))
            return -1;
        n -= k;
    }
    return 0;
}

static int serve_side(const char *host, int port, const struct pd_model *m, int timeout_s, int json)
{
    static struct producer s;
    pd_err e = {0};
    int rc = 1, lfd = -1, started = 0, said_bye = 0;
    struct ctl c = {.fd = -1};
    pthread_t th;
    pthread_mutex_init(&s.mu, NULL);
    if (pool_open(&s.P, m, 1, host, 0, &s.x, &e)) {
        fprintf(stderr, "pdmoe bench transfer: --serve %s:%d: %s\n", host, port, e.msg);
        goto out;
    }
    if ((lfd = ctl_socket(host, port, 1, &e)) < 0) {
        fprintf(stderr, "pdmoe bench transfer: --serve %s:%d: %s\n", host, port, e.msg);
        goto out;
    }
    if (pthread_create(&th, NULL, producer_progress, &s) != 0) {
        fprintf(stderr, "pdmoe bench transfer: cannot start a thread\n");
        goto out;
    }
    started = 1;
    /* the ready line, on stderr so that stdout is only the results (--json) */
    fprintf(stderr, "pdmoe bench transfer: ready: control %s:%d, KV listener port %d; waiting up to %d s\n", host,
            port, pd_kvx_port(s.x), timeout_s);
    struct pollfd pf = {.fd = lfd, .events = POLLIN};
    if (poll(&pf, 1, timeout_s * 1000) != 1 || (c.fd = accept(lfd, NULL, NULL)) < 0) {
        fprintf(stderr, "pdmoe bench transfer: no consumer connected to %s:%d within %d s (--timeout)\n", host,
                port, timeout_s);
        goto out;
    }
    ctl_tune(c.fd, timeout_s);
    ctl_send(&c, "pdmoe-bench-transfer %d kv_port %d", CTL_VERSION, pd_kvx_port(s.x));
    char line[256];
    while (!said_bye && ctl_line(&c, line, sizeof line) == 0) {
        long long v;
        char extra;
        if (!strcmp(line, "ping")) {
            ctl_send(&c, "pong");
        } else if (sscanf(line, "lease %lld %c", &v, &extra) == 1 && v >= 1 && v <= (1 << 22)) {
            producer_lease(&s, &c, v);
        } else if (sscanf(line, "stream %lld %c", &v, &extra) == 1 && v >= 0 && v <= (1LL << 32)) {
            if (producer_stream(&c, (uint64_t)v))
                break;
        } else if (!strcmp(line, "bye")) {
            said_bye = 1;
        } else {
            ctl_send(&c, "error unknown request \"%.64s\"", line);
        }
    }
    pthread_mutex_lock(&s.mu);
    uint64_t done = s.released[PD_KVX_REL_DONE], aborted = s.released[PD_KVX_REL_ABORT],
             expired = s.released[PD_KVX_REL_EXPIRED];
    pthread_mutex_unlock(&s.mu);
    if (said_bye)
        ctl_send(&c, "bye leases %d done %llu aborted %llu expired %llu", s.leases, (unsigned long long)done,
                 (unsigned long long)aborted, (unsigned long long)expired);
    if (!said_bye) {
        fprintf(stderr, "pdmoe bench transfer: the consumer left or was silent for %d s before saying bye\n",
                timeout_s);
        goto out;
    }
    if (json)
        printf("{\"mode\": \"serve\", \"control\": \"%s:%d\", \"kv_port\": %d, \"leases\": %d, \"released\": "
               "{\"done\": %llu, \"aborted\": %llu, \"expired\": %llu}}\n", host, port, pd_kvx_port(s.x),
               s.leases, (unsigned long long)done, (unsigned long long)aborted, (unsigned long long)expired);
    else
        printf("served %d leases to the consumer: %llu pulled (DONE), %llu aborted, %llu expired\n", s.leases,
               (unsigned long long)done, (unsigned long long)aborted, (unsigned long long)expired);
    rc = 0;
out:
    if (started) {
        atomic_store(&s.stop, 1);
        pthread_join(th, NULL);
    }
    if (c.fd >= 0)
        close(c.fd);
    if (lfd >= 0)
        close(lfd);
    /* leases still held: their sequences go back to the pool here, the leases with the engine */
    pthread_mutex_lock(&s.mu);
    s.closing = 1;
    for (int k = 0; k < MAX_LEASES; k++)
        if (s.lease[k].used)
            pd_kvseq_free(&s.P.kv, &s.lease[k].seq);
    pthread_mutex_unlock(&s.mu);
    pool_close(&s.P);
    if (s.x)
        pd_kvx_destroy(s.x);
    return rc;
}

struct size_row {
    int64_t tokens;
    uint64_t bytes, gets;
    int runs;
    double median, min, max, stream;   /* seconds: hand-off (median, min, max), TCP stream (median) */
    double t[64];                      /* each hand-off after the warm-up */
};

/* One request on the control channel and its one-line answer. */
static int ctl_ask(struct ctl *c, char *line, size_t cap, const char *fmt, long long v)
{
    char q[64];
    snprintf(q, sizeof q, fmt, v);
    return ctl_send(c, "%s", q) || ctl_line(c, line, cap) ? -1 : 0;
}

static int peer_side(const char *host, int port, const int64_t *tokens, int n_sizes, int reps,
                     const struct pd_model *m, int json)
{
    pd_err e = {0};
    struct ctl c = {.fd = ctl_socket(host, port, 0, &e)};
    struct pool D = {0};
    struct pd_kvx *x = NULL;
    struct size_row *rows = calloc((size_t)n_sizes, sizeof *rows);
    int rc = 1, kv_port = 0, version = 0;
    double rtt = 0, first = 0;
    char line[256], me[INET6_ADDRSTRLEN] = "";
    if (c.fd < 0) {
        fprintf(stderr, "pdmoe bench transfer: --peer %s:%d: %s (is pdmoe bench transfer --serve running there?)\n",
                host, port, e.msg);
        goto out;
    }
    ctl_tune(c.fd, 60);
    if (!rows || ctl_line(&c, line, sizeof line) ||
        sscanf(line, "pdmoe-bench-transfer %d kv_port %d", &version, &kv_port) != 2 || version != CTL_VERSION) {
        fprintf(stderr, "pdmoe bench transfer: --peer %s:%d: not a pdmoe bench transfer --serve of control version "
                "%d\n", host, port, CTL_VERSION);
        goto out;
    }
    /* this host's address on the way to the producer: where UCX's TCP transport is kept */
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(c.fd, (struct sockaddr *)&ss, &sl) == 0)
        getnameinfo((struct sockaddr *)&ss, sl, me, sizeof me, NULL, 0, NI_NUMERICHOST);
    /* the link's round trip, as a small message and its answer see it: 1 + 20 pings, median of 20 */
    double pings[20];
    for (int i = 0; i <= 20; i++) {
        double t0 = pd_now_s();
        if (ctl_send(&c, "ping") || ctl_line(&c, line, sizeof line) || strcmp(line, "pong")) {
            fprintf(stderr, "pdmoe bench transfer: the producer did not answer ping\n");
            goto out;
        }
        if (i > 0)
            pings[i - 1] = pd_now_s() - t0;
    }
    rtt = pd_bench_median(pings, 20);
    if (pool_open(&D, m, 2, me[0] ? me : NULL, -1, &x, &e)) {
        fprintf(stderr, "pdmoe bench transfer: %s\n", e.msg);
        goto out;
    }
    for (int i = 0; i < n_sizes; i++) {
        struct size_row *r = &rows[i];
        struct pd_kvseq ds;
        struct pd_kvx_run *dr = NULL;
        double streams[64];
        r->tokens = tokens[i];
        r->runs = reserve_measured(&D, &ds, tokens[i], &dr);
        for (int k = 0; k < r->runs; k++)
            r->bytes += dr[k].len;
        for (int j = 0; r->runs > 0 && j <= reps; j++) {   /* j = 0 warms up (the first one connects) */
            struct pd_kvx_key key;
            char id[PD_KVX_ID_HEX];
            unsigned long long hash, bytes;
            int runs;
            if (ctl_ask(&c, line, sizeof line, "lease %lld", (long long)tokens[i]) ||
                sscanf(line, "key %32s %llx %llu %d", id, &hash, &bytes, &runs) != 4 || pd_kvx_id_parse(id, &key)) {
                fprintf(stderr, "pdmoe bench transfer: lease of %lld tokens: %s\n", (long long)tokens[i],
                        strncmp(line, "error ", 6) ? "no answer from the producer" : line + 6);
                goto fail_size;
            }
            key.hash = hash;
            if (bytes != r->bytes) {
                fprintf(stderr, "pdmoe bench transfer: %lld tokens are %llu bytes of KV at the producer, %llu here: "
                        "not the same model or block size\n", (long long)tokens[i], bytes,
                        (unsigned long long)r->bytes);
                goto fail_size;
            }
            struct pd_kvx_xfer *t = NULL;
            double t0 = pd_now_s();
            if (pd_kvx_pull(x, host, kv_port, &key, dr, r->runs, &t, &e)) {
                fprintf(stderr, "pdmoe bench transfer: %s\n", e.msg);
                goto fail_size;
            }
            enum pd_kvx_state st = pd_kvx_wait(x, t, -1);
            double dt = pd_now_s() - t0;
            if (st != PD_KVX_DONE) {
                pd_kvx_result(x, t, &e);
                fprintf(stderr, "pdmoe bench transfer: the hand-off of %lld tokens failed: %s\n",
                        (long long)tokens[i], e.msg);
                pd_kvx_xfer_free(x, t);
                goto fail_size;
            }
            r->gets = pd_kvx_xfer_gets(x, t);
            pd_kvx_xfer_free(x, t);
            t0 = pd_now_s();
            if (ctl_send(&c, "stream %llu", (unsigned long long)r->bytes) || ctl_skip(&c, r->bytes)) {
                fprintf(stderr, "pdmoe bench transfer: the producer's stream of %llu bytes broke off\n",
                        (unsigned long long)r->bytes);
                goto fail_size;
            }
            if (j == 0) {
                if (i == 0)
                    first = dt;
                continue;
            }
            r->t[j - 1] = dt;
            streams[j - 1] = pd_now_s() - t0;
        }
        if (r->runs <= 0) {
            fprintf(stderr, "pdmoe bench transfer: no room for %lld tokens in this KV pool (%zu bytes)\n",
                    (long long)tokens[i], D.kv.region_bytes);
            goto fail_size;
        }
        double sorted[64];
        memcpy(sorted, r->t, (size_t)reps * sizeof *sorted);
        r->median = pd_bench_median(sorted, reps);
        r->min = sorted[0];
        r->max = sorted[reps - 1];
        r->stream = pd_bench_median(streams, reps);
        free(dr);
        pd_kvseq_free(&D.kv, &ds);
        churn(&D, 200);
        continue;
    fail_size:
        free(dr);
        if (ds.slot >= 0)
            pd_kvseq_free(&D.kv, &ds);
        goto out;
    }
    if (ctl_send(&c, "bye") || ctl_line(&c, line, sizeof line) || strncmp(line, "bye ", 4)) {
        fprintf(stderr, "pdmoe bench transfer: the producer did not answer bye\n");
        goto out;
    }
    const char *tls = getenv("UCX_TLS");
    if (json) {
        json_t *doc = json_pack("{s:s, s:s, s:i, s:s, s:s, s:i, s:f, s:f, s:s}", "mode", "peer", "producer", host,
                                "control_port", port, "consumer", me, "ucx_tls", tls ? tls : "", "reps", reps,
                                "control_rtt_s", rtt, "first_handoff_s", first, "producer_says", line + 4);
        json_t *arr = json_array();
        for (int i = 0; i < n_sizes; i++) {
            const struct size_row *r = &rows[i];
            json_t *all = json_array();
            for (int j = 0; j < reps; j++)
                json_array_append_new(all, json_real(r->t[j]));
            json_array_append_new(arr, json_pack("{s:I, s:I, s:i, s:I, s:f, s:f, s:f, s:o, s:f, s:f, s:f}",
                                                 "tokens", (json_int_t)r->tokens, "bytes", (json_int_t)r->bytes,
                                                 "runs", r->runs, "gets", (json_int_t)r->gets, "handoff_s_median",
                                                 r->median, "handoff_s_min", r->min, "handoff_s_max", r->max,
                                                 "handoff_s", all, "MBps", r->bytes / r->median / 1e6,
                                                 "tcp_stream_s_median", r->stream, "ratio", r->stream / r->median));
        }
        json_object_set_new(doc, "rows", arr);
        char *out = json_dumps(doc, JSON_INDENT(2));
        puts(out);
        free(out);
        json_decref(doc);
    } else {
        printf("KV hand-off across hosts, v4-flash-mini bf16, 16-entry blocks of two KV pools ~70%% full after a "
               "history of requests: this process (%s) pulling from %s:%d (KV listener port %d), UCX_TLS=%s; median "
               "of %d after a warm-up; MB = 10^6 bytes; TCP stream = the same bytes asked for and sent back on a "
               "plain socket over the same link; ratio = TCP stream / hand-off (1 = the link's own speed)\n",
               me, host, port, kv_port, tls ? tls : "(unset)", reps);
        printf("control round trip %.3f ms (median of 20 pings); first hand-off (connect and wire-up) %.2f ms\n",
               rtt * 1e3, first * 1e3);
        printf("%8s %10s %5s %5s %12s %10s %10s %9s %10s %7s\n", "tokens", "KV MB", "runs", "gets", "hand-off ms",
               "min ms", "max ms", "MB/s", "TCP ms", "ratio");
        for (int i = 0; i < n_sizes; i++) {
            const struct size_row *r = &rows[i];
            printf("%8lld %10.3f %5d %5llu %12.2f %10.2f %10.2f %9.1f %10.2f %7.2f\n", (long long)r->tokens,
                   r->bytes / 1e6, r->runs, (unsigned long long)r->gets, r->median * 1e3, r->min * 1e3,
                   r->max * 1e3, r->bytes / r->median / 1e6, r->stream * 1e3, r->stream / r->median);
        }
        printf("producer: %s\n", line + 4);
    }
    rc = 0;
out:
    if (c.fd >= 0)
        close(c.fd);
    pool_close(&D);
    if (x)
        pd_kvx_destroy(x);
    free(rows);
    return rc;
}

int pd_bench_transfer(int argc, char **argv)
{
    enum { O_SERVE = 256, O_PEER, O_TOKENS, O_REPS, O_TIMEOUT, O_JSON };
    static const struct option opts[] = {
        {"quick", 0, 0, 'q'},        {"tls", 1, 0, 't'},       {"model", 1, 0, 'm'},
        {"serve", 1, 0, O_SERVE},    {"peer", 1, 0, O_PEER},   {"tokens", 1, 0, O_TOKENS},
        {"reps", 1, 0, O_REPS},      {"timeout", 1, 0, O_TIMEOUT}, {"json", 0, 0, O_JSON},
        {0, 0, 0, 0},
    };
    int quick = 0, c, json = 0, port = 0;
    const char *only = NULL, *dir = "models/mini", *serve = NULL, *peer = NULL, *single_flag = NULL;
    const char *peer_flag = NULL, *serve_flag = NULL;
    char host[256];
    int64_t sizes[MAX_SIZES] = {1024, 2048, 4096, 8192, 16384, 32768}, pull_reps = 5, timeout_s = 60;
    int n_sizes = 6;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":", opts, NULL)) != -1) {
        switch (c) {
        case 'q': quick = 1; single_flag = "--quick"; break;
        case 't': only = optarg; break;
        case 'm': dir = optarg; single_flag = "--model"; break;
        case O_SERVE: serve = optarg; break;
        case O_PEER: peer = optarg; break;
        case O_JSON: json = 1; break;
        case O_TOKENS: {
            peer_flag = "--tokens";
            n_sizes = 0;
            char buf[512];
            snprintf(buf, sizeof buf, "%s", optarg);
            for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                if (n_sizes == MAX_SIZES) {
                    fprintf(stderr, "pdmoe bench transfer: --tokens: at most %d sizes\n", MAX_SIZES);
                    return 2;
                }
                if (pd_cli_int("--tokens", t, 1, &sizes[n_sizes]))
                    return 2;
                if (sizes[n_sizes] > 1 << 20) {
                    fprintf(stderr, "pdmoe bench transfer: --tokens %s: at most 1048576 tokens\n", t);
                    return 2;
                }
                n_sizes++;
            }
            if (n_sizes == 0) {
                fprintf(stderr, "pdmoe bench transfer: --tokens \"%s\": expected N,N,... (prompt lengths)\n", optarg);
                return 2;
            }
            break;
        }
        case O_REPS:
            peer_flag = "--reps";
            if (pd_cli_int("--reps", optarg, 1, &pull_reps))
                return 2;
            if (pull_reps > 64) {
                fprintf(stderr, "pdmoe bench transfer: --reps %s: at most 64\n", optarg);
                return 2;
            }
            break;
        case O_TIMEOUT:
            serve_flag = "--timeout";
            if (pd_cli_int("--timeout", optarg, 1, &timeout_s))
                return 2;
            if (timeout_s > 86400) {
                fprintf(stderr, "pdmoe bench transfer: --timeout %s: at most 86400 seconds\n", optarg);
                return 2;
            }
            break;
        default:
            return pd_cli_bad_flag("bench transfer", c, argc, argv);
        }
    }
    if (optind < argc) {
        fprintf(stderr, "pdmoe bench transfer: unexpected argument \"%s\" (see pdmoe bench transfer --help)\n",
                argv[optind]);
        return 2;
    }
    if (serve && peer) {
        fprintf(stderr, "pdmoe bench transfer: --serve and --peer exclude each other (one process serves the KV, "
                "the other pulls it)\n");
        return 2;
    }
    if ((serve || peer) && single_flag) {
        fprintf(stderr, "pdmoe bench transfer: %s applies only to the single-process run (without --serve or "
                "--peer)\n", single_flag);
        return 2;
    }
    if (!peer && peer_flag) {
        fprintf(stderr, "pdmoe bench transfer: %s applies only with --peer (the consumer chooses the sizes)\n",
                peer_flag);
        return 2;
    }
    if (!serve && serve_flag) {
        fprintf(stderr, "pdmoe bench transfer: %s applies only with --serve\n", serve_flag);
        return 2;
    }
    if ((serve && parse_hostport("--serve", serve, host, sizeof host, &port)) ||
        (peer && parse_hostport("--peer", peer, host, sizeof host, &port)))
        return 2;
    struct pd_model m;
    pd_err e = {0};
    if (pd_model_load("v4-flash-mini", &m, &e)) {
        fprintf(stderr, "bench transfer: %s\n", e.msg);
        return 1;
    }
    if (serve || peer) {
        if (only)
            setenv("UCX_TLS", only, 1);
        return serve ? serve_side(host, port, &m, (int)timeout_s, json)
                     : peer_side(host, port, sizes, n_sizes, (int)pull_reps, &m, json);
    }
    static const int64_t all[] = {1024, 2048, 4096, 8192, 16384, 32768};
    static const int64_t few[] = {1024, 8192, 32768};
    const int64_t *tokens = quick ? few : all;
    int n = quick ? 3 : 6, reps = quick ? 5 : 20;
    /* the same prompts' prefill on the engine, for the hand-off's share of TTFT */
    double prefill[6] = {0};
    struct pd_engine en;
    struct pd_engine_opts eo = {.dir = dir, .threads = 1, .max_seqs = 1, .max_model_len = tokens[n - 1] + 16};
    if (pd_engine_open(&en, &eo, &e)) {
        fprintf(stderr, "bench transfer: %s (the share of TTFT needs the model: pdmoe gen-model --preset "
                "v4-flash-mini --out models/mini)\n", e.msg);
        return 1;
    }
    for (int i = 0; i < (quick ? 1 : n); i++)
        if (pd_bench_step_time(&en, 1, (int)tokens[i], 0, 1, NULL, 0, 1, &prefill[i], &e)) {
            fprintf(stderr, "bench transfer: %s\n", e.msg);
            pd_engine_close(&en);
            return 1;
        }
    pd_engine_close(&en);
    json_t *doc = json ? json_pack("{s:s, s:s, s:i, s:i, s:s, s:o}", "mode", "single-process", "model",
                                   "v4-flash-mini", "reps_min", reps, "reps_max", 10 * reps, "prefill_model", dir,
                                   "runs", json_array()) : NULL;
    if (!doc)
        printf("KV hand-off, v4-flash-mini bf16, 16-entry blocks of two KV pools ~70%% full after a history of "
               "requests, loopback, best of %d to %d (small hand-offs more); runs = the sequence's slot and blocks; share of TTFT = hand-off / "
               "(prefill of the prompt on %s, 1 thread, + hand-off)\n",
               reps, 10 * reps, dir);
    json_t *runs = doc ? json_object_get(doc, "runs") : NULL;
    int rc = only ? run_tls(only, tokens, n, &m, reps, prefill, runs) : run_tls(NULL, tokens, n, &m, reps, prefill, runs);
    if (!rc && !only)
        rc = run_tls("tcp", tokens, n, &m, reps, prefill, runs);
    if (!rc)
        rc = seed_share(tokens, n, doc);
    if (doc && !rc) {
        char *text = json_dumps(doc, JSON_INDENT(2));
        puts(text);
        free(text);
    }
    json_decref(doc);
    return rc;
}

double pd_bench_ucx_get_time(size_t bytes, int reps)
{
    double bw = raw_get_bw(bytes, reps, NULL, 0);
    return bw > 0 ? (double)bytes / bw : -1;
}

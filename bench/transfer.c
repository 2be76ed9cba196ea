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
 * = GET_META + gets (or READ + pushed DATA over TCP) + DONE/ACK, producer and consumer in this process, each with its own UCP
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
#include "bench/transfer.h"
#include "cli/cli.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include <ucp/api/ucp.h>

#include "core/timing.h"
#include "engine/kvpool.h"
#include "plan/kvsize.h"
#include "plan/perf.h"
#include "pd/kvxfer.h"


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

void pd_bxfer_churn(struct pool *p, int events)
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
int pd_bxfer_pool_open(struct pool *p, const struct pd_model *m, unsigned seed, const char *host, int listen_port,
                     struct pd_kvx **x, pd_err *e)
{
    memset(p, 0, sizeof *p);
    p->rng = seed;
    if (pd_kvpool_init(&p->kv, m, PD_KV_BF16, POOL_SEQS, POOL_BYTES, 16, e))
        return -1;
    struct pd_kvx_opts o = {.listen_host = host, .listen_port = listen_port, .region_len = p->kv.region_bytes};
    if (pd_kvx_create(&o, x, e))
        return -1;
    pd_kvpool_move(&p->kv, pd_kvx_region(*x));
    /* touch every page so neither side measures first-touch faults */
    memset(p->kv.region, 0x5a, p->kv.region_bytes);
    pd_bxfer_churn(p, 4000);
    return 0;
}

void pd_bxfer_pool_close(struct pool *p)
{
    while (p->n_live > 0)
        pd_kvseq_free(&p->kv, &p->live[--p->n_live]);
    pd_kvpool_free(&p->kv);
}

/* The measured request on one side: reserved as a server reserves it, finishing others until
 * it fits; its runs for the prompt go to r (n returned, -1 on failure). */
int pd_bxfer_reserve(struct pool *p, struct pd_kvseq *s, int64_t tokens, struct pd_kvx_run **r)
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
    uint64_t pieces;   /* per hand-off: gets or pushed pieces */
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
        res.pieces = pd_kvx_xfer_pieces(c, t);
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
    if (pd_bxfer_pool_open(&P, m, 1, NULL, 0, &p, &e) || pd_bxfer_pool_open(&D, m, 2, NULL, -1, &c, &e)) {
        fprintf(stderr, "bench transfer: %s\n", e.msg);
        goto out;
    }
    rows = out ? json_array() : NULL;
    if (!out) {
        printf("\nUCX_TLS=%s\n", tls ? tls : "(unset: UCX's choice)");
        printf("%8s %8s %7s %6s %12s %12s %7s %12s %7s %11s %11s %8s\n", "tokens", "KV MiB", "runs", "pieces",
               "engine MB/s", "1-get MB/s", "ratio", "same-gets", "ratio", "hand-off ms", "prefill ms", "of TTFT");
    }
    uint64_t req = 1;
    double worst = 1e9;
    for (int i = 0; i < n_sizes; i++) {
        struct pd_kvseq ps, ds;
        struct pd_kvx_run *sr = NULL, *dr = NULL;
        struct piece *pc = NULL;
        int ns = pd_bxfer_reserve(&P, &ps, tokens[i], &sr), nd = pd_bxfer_reserve(&D, &ds, tokens[i], &dr);
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
                                                  "runs", ns, "pieces", (json_int_t)r.pieces, "engine_MBps", r.bw / 1e6,
                                                  "one_get_MBps", raw / 1e6, "ratio", ratio, "same_gets_MBps",
                                                  same / 1e6, "same_gets_ratio", r.bw / same, "handoff_s", hand,
                                                  "prefill_s", prefill_s[i] > 0 ? json_real(prefill_s[i]) : json_null(),
                                                  "share_of_ttft", prefill_s[i] > 0
                                                      ? json_real(hand / (prefill_s[i] + hand)) : json_null()));
        } else {
            printf("%8lld %8.1f %7d %6llu %12.0f %12.0f %7.2f %12.0f %7.2f %11.2f", (long long)tokens[i],
                   (double)bytes / (1 << 20), ns, (unsigned long long)r.pieces, r.bw / 1e6, raw / 1e6, ratio,
                   same / 1e6, r.bw / same, hand * 1e3);
            if (prefill_s[i] > 0)
                printf(" %11.0f %7.2f%%\n", prefill_s[i] * 1e3, 100 * hand / (prefill_s[i] + hand));
            else
                printf(" %11s %8s\n", "-", "-");
            fflush(stdout);
        }
        pd_bxfer_churn(&P, 200);
        pd_bxfer_churn(&D, 200);
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
    pd_bxfer_pool_close(&P);
    pd_bxfer_pool_close(&D);
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
    if ((serve && pd_bxfer_hostport("--serve", serve, host, sizeof host, &port)) ||
        (peer && pd_bxfer_hostport("--peer", peer, host, sizeof host, &port)))
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
        return serve ? pd_bxfer_serve(host, port, &m, (int)timeout_s, json)
                     : pd_bxfer_peer(host, port, sizes, n_sizes, (int)pull_reps, &m, json);
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

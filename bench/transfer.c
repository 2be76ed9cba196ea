/* `pdmoe bench transfer`: KV hand-off throughput of the transfer engine (src/pd/kvxfer), set
 * against a raw UCX get measured in the same run.
 *
 * For prompts of 1K..32K tokens, the KV bytes of one sequence of v4-flash-mini (bf16, from the
 * planner: plan/kvsize.h) are laid out as 4096-byte blocks (16 entries x 2 x head_dim 128 bytes)
 * the way a block pool scatters them: on the producer every 5th slot is taken by someone else
 * (runs of 4 blocks), on the consumer every 9th (runs of 8). Each block is offered as its own run,
 * so the engine's merging is part of what is timed. One hand-off = GET_META + gets + DONE/ACK,
 * producer and consumer in this process, each with its own UCP context, over loopback.
 * Baseline: one ucp_get_nbx of the same total size, contiguous, between two other contexts over
 * an endpoint of the same kind as the engine's data endpoint (like ucx_perftest's ucp_get); the
 * ratio engine / that is the figure of merit (target >= 0.8). A second baseline issues the
 * engine's own gets (same pieces) by hand with one flush: engine / that isolates the protocol's
 * cost from UCX's cost per get. Both sides are progressed from one thread, for the engine and
 * the baselines alike. MB/s = 10^6 bytes/s, best of the repetitions, for UCX_TLS unset (UCX's
 * choice: shared memory on one host) and UCX_TLS=tcp.
 * The hand-off's share of TTFT: the same prompt's prefill on the engine (--model, default
 * models/mini, one thread, as pdmoe up runs it) measured in the same run, TTFT taken as prefill +
 * hand-off (the first decode step aside); --quick measures the 1K prompt only.
 * Options: --quick (fewer sizes and repetitions, under 10 s), --tls LIST (only that UCX_TLS),
 * --model DIR. */
#include "bench.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ucp/api/ucp.h>

#include "core/timing.h"
#include "plan/kvsize.h"
#include "plan/perf.h"
#include "pd/kvxfer.h"

#define BLOCK 4096
#define P_STRIDE 5   /* producer: 4 blocks then a slot used by another sequence */
#define D_STRIDE 9   /* consumer: 8 blocks then a foreign slot */

/* ------------------------------------------------------------------ raw UCX baseline */

struct piece {
    uint64_t src, dst, len;
};

struct raw_side {
    ucp_context_h ctx;
    ucp_worker_h w;
    ucp_mem_h memh;
};

static int raw_side_init(struct raw_side *s, void *buf, size_t len)
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
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
        .address = buf,
        .length = len,
    };
    return ucp_mem_map(s->ctx, &mp, &s->memh) == UCS_OK ? 0 : -1;
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
 * pieces (n > 0) the same bytes as n gets of the given (src offset, dst offset, length). */
static double raw_get_bw(uint8_t *src, uint8_t *dst, size_t len, size_t bytes, int reps,
                         const struct piece *pc, int n)
{
    struct raw_side p, c;
    double best = 0;
    ucp_ep_h ep = NULL;
    void *rkbuf = NULL;
    ucp_rkey_h rkey = NULL;
    ucp_address_t *addr = NULL;
    size_t alen, rklen;
    if (raw_side_init(&p, src, len) || raw_side_init(&c, dst, len))
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
                uint64_t from = (uint64_t)(uintptr_t)(src + pc[j].src);
                ucs_status_ptr_t g = ucp_get_nbx(ep, dst + pc[j].dst, pc[j].len, from, rkey, &np);
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
            ucs_status_ptr_t r = ucp_get_nbx(ep, dst, bytes, (uint64_t)(uintptr_t)src, rkey, &rp);
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

/* Block i of a sequence sits at slot i + i / (stride - 1): runs of stride-1 blocks. */
static void layout(struct pd_kvx_run *r, int64_t blocks, int stride)
{
    for (int64_t i = 0; i < blocks; i++)
        r[i] = (struct pd_kvx_run){(uint64_t)(i + i / (stride - 1)) * BLOCK, BLOCK};
}

struct result {
    double bw;       /* bytes/s, best of the repetitions */
    uint64_t gets;   /* per hand-off */
    int ok;
};

static struct result engine_bw(struct pd_kvx *p, struct pd_kvx *c, uint64_t *req,
                               const struct pd_kvx_run *src, const struct pd_kvx_run *dst,
                               int64_t blocks, int reps)
{
    struct result res = {0};
    pd_err e = {0};
    for (int i = 0; i <= reps; i++) {   /* the first one connects and warms up */
        uint64_t id = (*req)++;
        struct pd_kvx_xfer *t = NULL;
        double t0 = pd_now_s();
        if (pd_kvx_offer(p, id, src, (int)blocks, NULL, NULL, &e) ||
            pd_kvx_pull(c, "127.0.0.1", pd_kvx_port(p), id, dst, (int)blocks, &t, &e)) {
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
        double bw = (double)blocks * BLOCK / dt;
        if (i > 0 && bw > res.bw)
            res.bw = bw;
    }
    res.ok = 1;
    return res;
}

static int run_tls(const char *tls, const int64_t *tokens, int n_sizes,
                   const struct pd_kv_size *k, int reps, const double *prefill_s)
{
    if (tls)
        setenv("UCX_TLS", tls, 1);
    else
        unsetenv("UCX_TLS");
    int64_t max_blocks = 0;
    for (int i = 0; i < n_sizes; i++) {
        int64_t b = (pd_kv_seq_bytes(k, tokens[i]) + BLOCK - 1) / BLOCK;
        if (b > max_blocks)
            max_blocks = b;
    }
    size_t len = (size_t)(max_blocks + max_blocks / (P_STRIDE - 1) + 1) * BLOCK;
    uint8_t *src = malloc(len), *dst = malloc(len);
    struct pd_kvx_run *sr = malloc((size_t)max_blocks * sizeof *sr);
    struct pd_kvx_run *dr = malloc((size_t)max_blocks * sizeof *dr);
    struct piece *pc = malloc((size_t)max_blocks * sizeof *pc);
    struct pd_kvx *p = NULL, *c = NULL;
    int rc = 1;
    pd_err e = {0};
    if (!src || !dst || !sr || !dr || !pc) {
        fprintf(stderr, "bench transfer: no memory for %zu-byte regions\n", len);
        goto out;
    }
    /* touch every page so neither side measures first-touch faults */
    memset(src, 0x5a, len);
    memset(dst, 0, len);
    struct pd_kvx_opts po = {.listen_port = 0, .region = src, .region_len = len};
    struct pd_kvx_opts co = {.listen_port = -1, .region = dst, .region_len = len};
    if (pd_kvx_create(&po, &p, &e) || pd_kvx_create(&co, &c, &e)) {
        fprintf(stderr, "bench transfer: %s\n", e.msg);
        goto out;
    }
    printf("\nUCX_TLS=%s\n", tls ? tls : "(unset: UCX's choice)");
    printf("%8s %8s %7s %6s %12s %12s %7s %12s %7s %11s %11s %8s\n", "tokens", "KV MiB", "blocks", "gets",
           "engine MB/s", "1-get MB/s", "ratio", "same-gets", "ratio", "hand-off ms", "prefill ms", "of TTFT");
    uint64_t req = 1;
    double worst = 1e9;
    for (int i = 0; i < n_sizes; i++) {
        int64_t bytes = pd_kv_seq_bytes(k, tokens[i]);
        int64_t blocks = (bytes + BLOCK - 1) / BLOCK;
        layout(sr, blocks, P_STRIDE);
        layout(dr, blocks, D_STRIDE);
        struct result r = engine_bw(p, c, &req, sr, dr, blocks, reps);
        if (!r.ok)
            goto out;
        double raw = raw_get_bw(src, dst, len, (size_t)blocks * BLOCK, reps, NULL, 0);
        /* the engine's gets, issued by hand: what UCX itself costs per piece */
        int np = 0;
        for (int64_t b = 0; b < blocks; b++) {
            if (np && pc[np - 1].src + pc[np - 1].len == sr[b].off &&
                pc[np - 1].dst + pc[np - 1].len == dr[b].off)
                pc[np - 1].len += BLOCK;
            else
                pc[np++] = (struct piece){sr[b].off, dr[b].off, BLOCK};
        }
        double same = raw_get_bw(src, dst, len, (size_t)blocks * BLOCK, reps, pc, np);
        if (raw <= 0 || same <= 0) {
            fprintf(stderr, "bench transfer: the raw UCX get failed (UCX_TLS=%s)\n",
                    tls ? tls : "unset");
            goto out;
        }
        double ratio = r.bw / raw;
        if (ratio < worst)
            worst = ratio;
        double hand = (double)blocks * BLOCK / r.bw;
        printf("%8lld %8.1f %7lld %6llu %12.0f %12.0f %7.2f %12.0f %7.2f %11.2f", (long long)tokens[i],
               (double)blocks * BLOCK / (1 << 20), (long long)blocks,
               (unsigned long long)r.gets, r.bw / 1e6, raw / 1e6, ratio, same / 1e6, r.bw / same, hand * 1e3);
        if (prefill_s[i] > 0)
            printf(" %11.0f %7.2f%%\n", prefill_s[i] * 1e3, 100 * hand / (prefill_s[i] + hand));
        else
            printf(" %11s %8s\n", "-", "-");
        fflush(stdout);
    }
    printf("lowest ratio %.2f (target >= 0.80)\n", worst);
    rc = 0;
out:
    pd_kvx_destroy(c);
    pd_kvx_destroy(p);
    free(sr);
    free(dr);
    free(pc);
    free(src);
    free(dst);
    return rc;
}

/* The same prompt lengths on the seed's deployment (V4-Flash, 910B, RoCE), by the performance
 * model: where the hand-off's share of TTFT matters is at scale, not on one CPU. */
static int seed_share(const int64_t *tokens, int n)
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
    printf("\nPredicted for the seed's deployment (deepseek-v4-flash, fp8 KV, P 4 x EP8 on 910B, %s at %.0f GB/s; "
           "pdmoe plan --isl N):\n", p.hw.rdma.name, p.hw.rdma.bandwidth_Bps / 1e9);
    printf("%8s %10s %12s %12s %10s %8s\n", "tokens", "KV MB", "hand-off ms", "prefill ms", "TTFT ms", "of TTFT");
    for (int i = 0; i < n; i++) {
        struct pd_workload w;
        pd_workload_default(&w);
        w.isl = tokens[i];
        struct pd_perf f;
        if (pd_perf_eval(&p, &w, &f, &e)) {
            fprintf(stderr, "bench transfer: %s\n", e.msg);
            pd_plan_free(&p);
            return 1;
        }
        printf("%8lld %10.1f %12.2f %12.1f %10.1f %7.2f%%\n", (long long)tokens[i],
               (double)pd_kv_seq_bytes(&p.kv, tokens[i]) / 1e6, f.handoff_s * 1e3, f.prefill_s * 1e3, f.ttft_s * 1e3,
               100 * f.handoff_s / f.ttft_s);
    }
    pd_plan_free(&p);
    return 0;
}

int pd_bench_transfer(int argc, char **argv)
{
    static const struct option opts[] = {
        {"quick", 0, 0, 'q'}, {"tls", 1, 0, 't'}, {"model", 1, 0, 'm'}, {0, 0, 0, 0},
    };
    int quick = 0, c;
    const char *only = NULL, *dir = "models/mini";
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (c == 'q')
            quick = 1;
        else if (c == 't')
            only = optarg;
        else if (c == 'm')
            dir = optarg;
        else {
            fprintf(stderr, "usage: pdmoe bench transfer [--quick] [--tls LIST] [--model DIR]\n");
            return 2;
        }
    }
    struct pd_model m;
    struct pd_kv_size k;
    pd_err e = {0};
    if (pd_model_load("v4-flash-mini", &m, &e) || pd_kv_size_init(&k, &m, PD_KV_BF16, 0, 0, &e)) {
        fprintf(stderr, "bench transfer: %s\n", e.msg);
        return 1;
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
    printf("KV hand-off, v4-flash-mini bf16, %d-byte blocks (producer runs of %d, consumer runs "
           "of %d), loopback, best of %d; share of TTFT = hand-off / (prefill of the prompt on %s, 1 thread, "
           "+ hand-off)\n",
           BLOCK, P_STRIDE - 1, D_STRIDE - 1, reps, dir);
    int rc = only ? run_tls(only, tokens, n, &k, reps, prefill) : run_tls(NULL, tokens, n, &k, reps, prefill);
    if (!rc && !only)
        rc = run_tls("tcp", tokens, n, &k, reps, prefill);
    return rc ? rc : seed_share(tokens, n);
}

double pd_bench_ucx_get_time(size_t bytes, int reps)
{
    uint8_t *src = malloc(bytes), *dst = malloc(bytes);
    double bw = 0;
    if (src && dst) {
        memset(src, 7, bytes);
        memset(dst, 0, bytes);
        bw = raw_get_bw(src, dst, bytes, bytes, reps, NULL, 0);
    }
    free(src);
    free(dst);
    return bw > 0 ? (double)bytes / bw : -1;
}

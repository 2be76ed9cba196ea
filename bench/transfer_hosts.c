/* `pdmoe bench transfer --serve HOST:PORT` and `--peer HOST:PORT`: the KV hand-off between two
 * processes on two hosts (bench/transfer.h; the command's options in transfer.c's header). */
#include "bench.h"
#include "bench/transfer.h"
#include "cli/cli.h"

#include <arpa/inet.h>
#include <errno.h>
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

#include "core/timing.h"

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
#define MAX_LEASES 8

/* "HOST:PORT" (the last colon splits) into host and port; -1 after printing why. */
int pd_bxfer_hostport(const char *flag, const char *s, char *host, size_t cap, int *port)
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
    uint64_t released[PD_KVX_REL_N];
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
        pd_bxfer_churn(&s->P, 200);
        n = pd_bxfer_reserve(&s->P, &s->lease[k].seq, tokens, &runs);
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

int pd_bxfer_serve(const char *host, int port, const struct pd_model *m, int timeout_s, int json)
{
    static struct producer s;
    pd_err e = {0};
    int rc = 1, lfd = -1, started = 0, said_bye = 0;
    struct ctl c = {.fd = -1};
    pthread_t th;
    pthread_mutex_init(&s.mu, NULL);
    if (pd_bxfer_pool_open(&s.P, m, 1, host, 0, &s.x, &e)) {
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
    /* The KV engine calls a lease's release back after it has ACKed the DONE, so the consumer's
     * bye can come first: give the progress thread up to 2 s to report every lease it settled. */
    for (int i = 0; said_bye && i < 200; i++) {
        pthread_mutex_lock(&s.mu);
        uint64_t settled = 0;
        for (int w = 0; w < PD_KVX_REL_N; w++)
            settled += s.released[w];
        pthread_mutex_unlock(&s.mu);
        if (settled >= (uint64_t)s.leases)
            break;
        usleep(10000);
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
    pd_bxfer_pool_close(&s.P);
    if (s.x)
        pd_kvx_destroy(s.x);
    return rc;
}

struct size_row {
    int64_t tokens;
    uint64_t bytes, pieces;
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

int pd_bxfer_peer(const char *host, int port, const int64_t *tokens, int n_sizes, int reps,
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
    if (pd_bxfer_pool_open(&D, m, 2, me[0] ? me : NULL, -1, &x, &e)) {
        fprintf(stderr, "pdmoe bench transfer: %s\n", e.msg);
        goto out;
    }
    for (int i = 0; i < n_sizes; i++) {
        struct size_row *r = &rows[i];
        struct pd_kvseq ds;
        struct pd_kvx_run *dr = NULL;
        double streams[64];
        r->tokens = tokens[i];
        r->runs = pd_bxfer_reserve(&D, &ds, tokens[i], &dr);
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
            r->pieces = pd_kvx_xfer_pieces(x, t);
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
        pd_bxfer_churn(&D, 200);
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
                                                 "runs", r->runs, "pieces", (json_int_t)r->pieces, "handoff_s_median",
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
        printf("%8s %10s %5s %5s %12s %10s %10s %9s %10s %7s\n", "tokens", "KV MB", "runs", "pieces", "hand-off ms",
               "min ms", "max ms", "MB/s", "TCP ms", "ratio");
        for (int i = 0; i < n_sizes; i++) {
            const struct size_row *r = &rows[i];
            printf("%8lld %10.3f %5d %5llu %12.2f %10.2f %10.2f %9.1f %10.2f %7.2f\n", (long long)r->tokens,
                   r->bytes / 1e6, r->runs, (unsigned long long)r->pieces, r->median * 1e3, r->min * 1e3,
                   r->max * 1e3, r->bytes / r->median / 1e6, r->stream * 1e3, r->stream / r->median);
        }
        printf("producer: %s\n", line + 4);
    }
    rc = 0;
out:
    if (c.fd >= 0)
        close(c.fd);
    pd_bxfer_pool_close(&D);
    if (x)
        pd_kvx_destroy(x);
    free(rows);
    return rc;
}


/* The proxy's connections to its instances (src/proxy/pool.c) and its /health hysteresis: many
 * requests go over a handful of kept-alive connections (a connection per request left one socket in
 * TIME_WAIT each, and the ephemeral ports ran out); a kept-alive connection the instance closed is
 * retried on a fresh one for a non-streamed request; one failed /health check does not take an
 * instance out, three in a row do; a connect() that fails for the proxy host's lack of ports is
 * named, and not held against the instance. */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <errno.h>
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../tmpmodel.h"
#include "core/timing.h"
#include "pd/server.h"
#include "proxy/proxy.h"
#include "util.h"

/* ---- a fake instance: answers /health and completions, keeps connections alive, misbehaves on cue ---- */

#define FAKE_MAX_CONNS 64

struct fake {
    int fd, port;
    pthread_t t;
    atomic_int stop;
    atomic_int accepted;        /* connections accepted */
    atomic_int health_fail;     /* the next N /health checks are answered 503 */
    atomic_int health_503, health_200;
    atomic_int drop_reused;     /* the next N requests that come on a connection that carried one before are
                                 * not answered: the connection is closed (a server's idle timer firing
                                 * as the request arrives) */
    atomic_int dropped;
    atomic_int close_each;      /* every answer says Connection: close, and the connection is closed */
    atomic_int completions;     /* completion requests answered */
};

struct fconn {
    int fd, served;
    char buf[1 << 16];
    size_t n;
};

static void fake_answer(struct fake *f, struct fconn *c, const char *req)
{
    char out[1024];
    const char *body = "{\"id\":\"x\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"ok\","
                       "\"finish_reason\":\"stop\"}]}";
    int code = 200;
    if (strstr(req, "\"do_remote_decode\":true"))   /* a prefill: the parameters its decode pulls with */
        body = "{\"id\":\"x\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"o\","
               "\"finish_reason\":\"length\",\"kv_transfer_params\":{\"remote_request_id\":\"x\"}}]}";
    if (!strncmp(req, "POST ", 5))
        atomic_fetch_add(&f->completions, 1);
    if (!strncmp(req, "GET /expert_stats", 17))
        body = "{\"tokens_per_expert\":[[1,2]]}";
    if (!strncmp(req, "GET /health", 11)) {
        int fail = atomic_load(&f->health_fail) > 0;
        if (fail)
            atomic_fetch_sub(&f->health_fail, 1);
        atomic_fetch_add(fail ? &f->health_503 : &f->health_200, 1);
        code = fail ? 503 : 200;
        body = fail ? "{\"error\":{\"message\":\"not now\"}}" : "{}";
    }
    int n = snprintf(out, sizeof out, "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n%s\r\n%s",
                     code, code == 200 ? "OK" : "Service Unavailable", strlen(body),
                     atomic_load(&f->close_each) ? "Connection: close\r\n" : "", body);
    cr_assert_eq(write(c->fd, out, (size_t)n), n);
}

/* Serves the whole requests in c's buffer; 0 once c is to be closed. */
static int fake_serve(struct fake *f, struct fconn *c)
{
    for (;;) {
        c->buf[c->n] = 0;
        char *end = strstr(c->buf, "\r\n\r\n");
        if (!end)
            return 1;
        size_t head = (size_t)(end + 4 - c->buf), body = 0;
        const char *cl = strcasestr(c->buf, "\r\nContent-Length:");
        if (cl && cl < end)
            body = (size_t)atol(cl + 17);
        if (c->n < head + body)
            return 1;
        if (c->served > 0 && atomic_load(&f->drop_reused) > 0) {
            atomic_fetch_sub(&f->drop_reused, 1);
            atomic_fetch_add(&f->dropped, 1);
            return 0;
        }
        fake_answer(f, c, c->buf);
        c->served++;
        memmove(c->buf, c->buf + head + body, c->n - head - body);
        c->n -= head + body;
        if (atomic_load(&f->close_each))
            return 0;
    }
}

static void *fake_loop(void *arg)
{
    struct fake *f = arg;
    struct fconn *conns = calloc(FAKE_MAX_CONNS, sizeof *conns);
    cr_assert_not_null(conns);
    int n = 0;
    while (!atomic_load(&f->stop)) {
        struct pollfd p[FAKE_MAX_CONNS + 1] = {{.fd = f->fd, .events = POLLIN}};
        for (int i = 0; i < n; i++)
            p[i + 1] = (struct pollfd){.fd = conns[i].fd, .events = POLLIN};
        if (poll(p, (nfds_t)n + 1, 20) <= 0)
            continue;
        if ((p[0].revents & POLLIN) && n < FAKE_MAX_CONNS) {
            int fd = accept4(f->fd, NULL, NULL, SOCK_CLOEXEC);   /* (not held open by the tests' curl) */
            if (fd >= 0) {
                conns[n] = (struct fconn){.fd = fd};
                n++;
                atomic_fetch_add(&f->accepted, 1);
            }
        }
        for (int i = n - 1; i >= 0; i--) {
            if (!(p[i + 1].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            ssize_t got = read(conns[i].fd, conns[i].buf + conns[i].n, sizeof conns[i].buf - 1 - conns[i].n);
            if (got > 0)
                conns[i].n += (size_t)got;
            if (got <= 0 || !fake_serve(f, &conns[i])) {
                shutdown(conns[i].fd, SHUT_RDWR);
                close(conns[i].fd);
                conns[i] = conns[--n];
            }
        }
    }
    for (int i = 0; i < n; i++)
        close(conns[i].fd);
    free(conns);
    return NULL;
}

/* Listens on `port` (0: an ephemeral one); a restarted instance's port may still hold its old
 * connections in TIME_WAIT, hence SO_REUSEADDR, as a server's listener has. */
static void fake_start_on(struct fake *f, int port)
{
    memset(f, 0, sizeof *f);
    f->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    cr_assert_eq(setsockopt(f->fd, SOL_SOCKET, SO_REUSEADDR, &(int){1}, sizeof(int)), 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    cr_assert_eq(bind(f->fd, (struct sockaddr *)&a, sizeof a), 0, "bind to port %d: %s", port, strerror(errno));
    cr_assert_eq(listen(f->fd, 64), 0);
    cr_assert_eq(getsockname(f->fd, (struct sockaddr *)&a, &len), 0);
    f->port = ntohs(a.sin_port);
    pthread_create(&f->t, NULL, fake_loop, f);
}

static void fake_start(struct fake *f)
{
    fake_start_on(f, 0);
}

static void fake_stop(struct fake *f)
{
    if (!f->fd)
        return;
    atomic_store(&f->stop, 1);
    pthread_join(f->t, NULL);
    close(f->fd);
    f->fd = 0;
}

/* ---- the proxy in this process ---- */

static struct pd_proxy *X;
static pthread_t tx;
static struct fake F;
static struct fake G[3];          /* more instances: a second prefill, two decodes */
static pid_t child;               /* a `pdmoe proxy` process, killed at the end whatever happened */
static char noport_file[64];
static char noport_log[64];     /* the shimmed proxy's stderr */
static struct node C;             /* a real server (a colocated instance) */
static char dir[64];              /* its model */

static void fini(void)
{
    proxy_shutdown(&X, tx);
    node_stop(&C);
    if (dir[0])
        rm_model(dir);
    fake_stop(&F);
    for (int i = 0; i < 3; i++)
        fake_stop(&G[i]);
    if (child > 0) {
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        child = 0;
    }
    if (noport_file[0])
        unlink(noport_file);
    if (noport_log[0])
        unlink(noport_log);   /* (a test that failed before reading it) */
}

TestSuite(pool, .fini = fini, .timeout = 120);

static void start_proxy(struct pd_proxy_opts *o)
{
    pd_err e = {0};
    cr_assert_eq(pd_proxy_create(o, &X, &e), 0, "%s", e.msg);
    pthread_create(&tx, NULL, run_proxy, X);
}

/* A per-instance metric of the proxy (pdmoe_proxy_instance_NAME) for the instance host:port. */
static int64_t instance_metric(const char *name, const char *where)
{
    char key[256];
    snprintf(key, sizeof key, "pdmoe_proxy_instance_%s{role=\"decode\",instance=\"%s\"}", name, where);
    return metric_key(pd_proxy_port(X), key);
}

/* Sockets in TIME_WAIT towards port `port` on this host: the ends that closed first of connections
 * to it (the proxy's, when it closes its connection to an instance). */
static int time_wait_towards(int port)
{
    FILE *f = fopen("/proc/net/tcp", "r");
    cr_assert_not_null(f);
    char line[512];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned rport, st;
        if (sscanf(line, " %*d: %*x:%*x %*x:%x %x", &rport, &st) == 2 && st == 0x06 && (int)rport == port)
            n++;
    }
    fclose(f);
    return n;
}

/* Sequential requests through the proxy to a real server open a handful of connections to it, not
 * one each: counted by the server (connections it accepted) and on this host (sockets left in
 * TIME_WAIT towards its port, 60 s each: at ~470 requests/s they took every ephemeral port). */
Test(pool, sequential_requests_reuse_a_few_connections)
{
    tmp_model("v4-tiny", 11, dir, sizeof dir);
    pd_err e = {0};
    struct pd_server_opts so = {.model_dir = dir, .threads = 1, .max_num_seqs = 8, .max_model_len = 256,
                                .served_name = "tiny", .role = PD_ROLE_BOTH};
    cr_assert_eq(pd_server_create(&so, &C.s, &e), 0, "%s", e.msg);
    pthread_create(&C.loop, NULL, run_server, C.s);
    C.port = pd_server_port(C.s);
    char where[32];
    snprintf(where, sizeof where, "127.0.0.1:%d", C.port);
    struct pd_proxy_opts o = {.n_decode = 1, .health_interval_ms = 100};
    o.decode[0] = where;
    start_proxy(&o);
    for (int i = 0; i < 250 && instance_metric("up", where) != 1; i++)
        usleep(20000);
    const int N = 500;
    const int tw0 = time_wait_towards(C.port);
    const int64_t acc0 = metric_key(C.port, "pdmoe_http_connections_accepted_total");
    /* one curl, one connection to the proxy, N requests one after the other */
    char cfg[] = "/tmp/pdmoe-pool-XXXXXX", cmd[512];
    int fd = mkstemp(cfg);
    FILE *c = fdopen(fd, "w");
    for (int i = 0; i < N; i++)
        fprintf(c, "url = \"http://127.0.0.1:%d/v1/completions\"\noutput = \"/dev/null\"\n", pd_proxy_port(X));
    fclose(c);
    snprintf(cmd, sizeof cmd, "curl -s -K %s -H 'Content-Type: application/json' "
             "-d '{\"prompt\":\"hi\",\"max_tokens\":1}' -w '%%{http_code}\\n'", cfg);
    const int ok = count_200(cmd);
    unlink(cfg);
    const int tw = time_wait_towards(C.port) - tw0;
    cr_assert_eq(ok, N, "%d of %d requests answered 200", ok, N);
    cr_assert_leq(tw, 4, "%d requests left %d sockets in TIME_WAIT towards the instance", N, tw);
    /* (the two scrapes of the server's /metrics are connections of their own) */
    const int64_t accepted = metric_key(C.port, "pdmoe_http_connections_accepted_total") - acc0 - 1;
    cr_assert_leq(accepted, 4, "%d requests (and /health checks) took %lld connections to the instance", N,
                  (long long)accepted);
    const int64_t opened = instance_metric("connections_opened_total", where);
    const int64_t reused = instance_metric("connections_reused_total", where);
    cr_assert_leq(opened, 4, "the proxy opened %lld connections to the instance", (long long)opened);
    cr_assert_geq(reused, N, "only %lld requests went on a kept-alive connection", (long long)reused);
}

/* The pool retires an idle connection after a fixed 20 s, while serve's --idle-timeout may be shorter:
 * an instance that closes its idle connections after 1 s, asked every 1.6 s, has closed the one the
 * pool holds before each request; the pool sees the close (libevent reads the FIN and resets the
 * connection, or recv(MSG_PEEK) finds it) and opens a new one rather than sending on the closed
 * one: every request answered, none sent twice (the resend after a close is for the race when the
 * server closes as the request goes), the instance never taken out. */
Test(pool, an_instance_idle_timeout_shorter_than_the_pools_loses_no_request, .timeout = 120)
{
    tmp_model("v4-tiny", 11, dir, sizeof dir);
    pd_err e = {0};
    struct pd_server_opts so = {.model_dir = dir, .threads = 1, .max_num_seqs = 8, .max_model_len = 256,
                                .served_name = "tiny", .role = PD_ROLE_BOTH, .http = {.idle_timeout_ms = 1000}};
    cr_assert_eq(pd_server_create(&so, &C.s, &e), 0, "%s", e.msg);
    pthread_create(&C.loop, NULL, run_server, C.s);
    C.port = pd_server_port(C.s);
    char where[32], out[4096];
    snprintf(where, sizeof where, "127.0.0.1:%d", C.port);
    /* (checks a minute apart: the requests alone use the pool) */
    struct pd_proxy_opts o = {.n_decode = 1, .health_interval_ms = 60000};
    o.decode[0] = where;
    start_proxy(&o);
    for (int i = 0; i < 250 && instance_metric("up", where) != 1; i++)
        usleep(20000);
    const int N = 4;
    for (int i = 0; i < N; i++) {
        usleep(1600000);
        int code = curl_port(pd_proxy_port(X), "/v1/completions", "{\"prompt\":\"hi\",\"max_tokens\":1}", NULL, out,
                             sizeof out);
        cr_assert_eq(code, 200, "request %d, 1.6 s after the last: %s", i, out);
    }
    const int64_t opened = instance_metric("connections_opened_total", where);
    cr_assert_geq(opened, N, "%lld connections opened for %d requests 1.6 s apart: the instance kept them past its 1 s "
                  "idle timeout, or the pool lent ones it had closed", (long long)opened, N);
    cr_assert_eq(metric_key(pd_proxy_port(X), "pdmoe_proxy_upstream_resent_total"), 0,
                 "a request went on a connection the instance had closed a second before");
    cr_assert_eq(instance_metric("ejections_total", where), 0);
}

/* A kept-alive connection the instance closes as a request arrives on it (its idle timer firing)
 * fails that request before a byte of answer: a non-streamed one goes again on a fresh connection,
 * unseen by the client and not held against the instance; a stream is not retried silently. */
Test(pool, a_kept_alive_connection_closed_by_the_instance_is_retried_once)
{
    fake_start(&F);
    char where[32], out[4096];
    snprintf(where, sizeof where, "127.0.0.1:%d", F.port);
    struct pd_proxy_opts o = {.n_decode = 1, .health_interval_ms = 60000};
    o.decode[0] = where;
    start_proxy(&o);
    for (int i = 0; i < 250 && instance_metric("up", where) != 1; i++)
        usleep(20000);
    const char *body = "{\"prompt\":\"hi\",\"max_tokens\":1}";
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    atomic_store(&F.drop_reused, 1);
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    cr_assert(strstr(out, "\"ok\""), "%s", out);
    cr_assert_eq(atomic_load(&F.dropped), 1, "the request did not go on a kept-alive connection (%d dropped)",
                 atomic_load(&F.dropped));
    cr_assert_eq(metric_key(pd_proxy_port(X), "pdmoe_proxy_upstream_resent_total"), 1);
    cr_assert_eq(instance_metric("ejections_total", where), 0);
    cr_assert_eq(instance_metric("up", where), 1);
    /* a stream likewise: nothing of the first attempt reached its client, which gets the answer once */
    atomic_store(&F.drop_reused, 1);
    int code = curl_port(pd_proxy_port(X), "/v1/completions", "{\"prompt\":\"hi\",\"max_tokens\":1,\"stream\":true}",
                         NULL, out, sizeof out);
    cr_assert_eq(atomic_load(&F.dropped), 2, "the stream did not go on a kept-alive connection");
    cr_assert(code == 200 && !strstr(out, "\"error\""), "%d %s", code, out);
    cr_assert_eq(metric_key(pd_proxy_port(X), "pdmoe_proxy_upstream_resent_total"), 2);
    cr_assert_eq(instance_metric("ejections_total", where), 0, "the server's close of an idle connection took it out");
}

/* Waits up to 5 s for *counter to reach n. */
static void wait_count(atomic_int *counter, int n, const char *what)
{
    for (int i = 0; i < 500 && atomic_load(counter) < n; i++)
        usleep(10000);
    cr_assert_geq(atomic_load(counter), n, "%s: %d, not %d, after 5 s", what, atomic_load(counter), n);
}

/* One failed /health check leaves an instance in; three in a row take it out (--health-failures),
 * and the next success takes it back. */
Test(pool, one_failed_health_check_does_not_eject_three_do)
{
    fake_start(&F);
    char where[32];
    snprintf(where, sizeof where, "127.0.0.1:%d", F.port);
    struct pd_proxy_opts o = {.n_decode = 1, .health_interval_ms = 50};
    o.decode[0] = where;
    start_proxy(&o);
    wait_count(&F.health_200, 1, "checks answered");
    for (int i = 0; i < 100 && instance_metric("up", where) != 1; i++)
        usleep(20000);
    cr_assert_eq(instance_metric("up", where), 1);
    /* one failure: still in, before and after the next success */
    atomic_store(&F.health_fail, 1);
    wait_count(&F.health_503, 1, "checks answered 503");
    int up_meanwhile = (int)instance_metric("up", where);
    int ok = atomic_load(&F.health_200);
    wait_count(&F.health_200, ok + 2, "checks answered after the failure");
    cr_assert_eq(up_meanwhile, 1, "one failed check took the instance out");
    cr_assert_eq(instance_metric("ejections_total", where), 0, "one failed check took the instance out");
    cr_assert_eq(instance_metric("failed_checks", where), 0);
    /* three in a row: out */
    atomic_store(&F.health_fail, 3);
    wait_count(&F.health_503, 4, "checks answered 503");
    int ejected = 0;
    for (int i = 0; i < 100 && !ejected; i++) {
        ejected = instance_metric("ejections_total", where) == 1;
        if (!ejected)
            usleep(10000);
    }
    cr_assert(ejected, "three failed checks in a row did not take the instance out");
    /* and back at the next success (after the backoff, 0.5 s) */
    int back = 0;
    for (int i = 0; i < 200 && !back; i++) {
        back = instance_metric("up", where) == 1;
        if (!back)
            usleep(20000);
    }
    cr_assert(back, "the instance answers again, yet it is not taken back");
    cr_assert_eq(instance_metric("ejections_total", where), 1);
    /* a threshold below 1 is refused, by its flag's name */
    proxy_shutdown(&X, tx);
    const char *bin = pdmoe_bin();
    char cmd[512], out[4096];
    snprintf(cmd, sizeof cmd, "%s proxy --decode %s --health-failures 0 2>&1", bin, where);
    FILE *p = popen(cmd, "r");
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    int st = pclose(p);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) != 0, "status %d: %s", st, out);
    cr_assert(strstr(out, "--health-failures"), "%s", out);
}

/* An instance that was taken out and stayed dead long enough for its checks' backoff to grow (as
 * through a run of `pdmoe up`'s restarts), then comes back on its port, is in rotation within a
 * health-check interval or two: /readiness 200 and a completion answered. The backoff doubled from
 * 0.5 s to 30 s: /readiness said "no decode instance is up" 18 s after the restarted instance was
 * ready. It now stops at --health-interval-ms (here 50 ms, so the checks come with the 100 ms tick),
 * and a dead instance is still checked no more often than that. The instance here stays dead 4 s
 * after it is out, when the old backoff's next check was 3.5 s away (at 7.5 s). */
Test(pool, an_instance_back_after_a_long_death_is_in_rotation_within_an_interval)
{
    const int fport = test_ports() + 10;
    fake_start_on(&F, fport);
    char where[32], out[8192];
    snprintf(where, sizeof where, "127.0.0.1:%d", fport);
    struct pd_proxy_opts o = {.n_decode = 1, .health_interval_ms = 50};
    o.decode[0] = where;
    start_proxy(&o);
    const int port = pd_proxy_port(X);
    for (int i = 0; i < 250 && instance_metric("up", where) != 1; i++)
        usleep(20000);
    cr_assert_eq(instance_metric("up", where), 1);
    fake_stop(&F);   /* killed: its connections closed, nothing listens on its port */
    int out_of_it = 0;
    for (int i = 0; i < 100 && !out_of_it; i++) {
        out_of_it = instance_metric("ejections_total", where) == 1;
        if (!out_of_it)
            usleep(20000);
    }
    cr_assert(out_of_it, "nothing listens on %s, yet it is not taken out after 2 s", where);
    const double dead_s = 4.0;
    usleep((useconds_t)(dead_s * 1e6));
    const int64_t checks = instance_metric("failed_checks", where);
    cr_assert_leq(checks, (int64_t)(dead_s / 0.05) + 3 + 5, "%lld checks of a dead instance in %.1f s, at an interval "
                  "of 50 ms", (long long)checks, dead_s);
    cr_assert_eq(curl_port(port, "/readiness", NULL, NULL, out, sizeof out), 503, "%s", out);
    fake_start_on(&F, fport);   /* `pdmoe up` started it again, on the same port */
    const double t0 = pd_now_s(), bound_s = 2.0;
    int code = 0;
    while (code != 200 && pd_now_s() - t0 < bound_s) {
        code = curl_port(port, "/readiness", NULL, NULL, out, sizeof out);
        if (code != 200)
            usleep(20000);
    }
    const double took = pd_now_s() - t0;
    cr_assert_eq(code, 200, "the instance answers /health again, yet the proxy is not ready %.1f s later "
                 "(%lld checks failed while it was dead): %s", took, (long long)checks, out);
    code = curl_port(port, "/v1/completions", "{\"prompt\":\"hi\",\"max_tokens\":1}", NULL, out, sizeof out);
    cr_assert(code == 200 && strstr(out, "\"ok\""), "%d %s", code, out);
    cr_log_info("back in rotation %.2f s after the instance came back, after %.1f s dead (%lld failed checks)",
                took, dead_s, (long long)checks);
}

/* `pdmoe proxy ARGS... --port port --health-interval-ms 50` in a child process (child) under the
 * LD_PRELOAD shim build/libnoport.so: while noport_file exists, its connects to the port `blocked`
 * (0: none) or to the ports the file lists fail with EADDRNOTAVAIL. Its stderr goes to `log`; it
 * returns once the proxy is ready. */
static void start_shimmed(const char *const *args, int port, int blocked, const char *log)
{
    const char *bin = pdmoe_bin();
    char shim[PATH_MAX];
    test_shim("libnoport.so", shim);
    snprintf(noport_file, sizeof noport_file, "/tmp/pdmoe-noport-%d", (int)getpid());
    unlink(noport_file);
    snprintf(noport_log, sizeof noport_log, "%s", log);
    char portarg[16], bport[48], nfile[sizeof noport_file + 32];
    snprintf(portarg, sizeof portarg, "%d", port);
    snprintf(bport, sizeof bport, "PDMOE_TEST_NOPORT_PORT=%d", blocked);
    snprintf(nfile, sizeof nfile, "PDMOE_TEST_NOPORT_FILE=%s", noport_file);
    child = fork_pdmoe_shimmed(shim, (const char *const[]){nfile, blocked ? bport : NULL, NULL});
    if (child == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 2);
        const char *argv[32] = {bin};
        int n = 1;
        for (; args[n - 1]; n++)
            argv[n] = args[n - 1];
        const char *tail[] = {"--port", portarg, "--health-interval-ms", "50", NULL};
        for (int i = 0; i < 5; i++)
            argv[n++] = tail[i];
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    char out[8192];
    int ready = 0;
    for (int i = 0; i < 500 && !ready; i++) {
        ready = curl_port(port, "/readiness", NULL, NULL, out, sizeof out) == 200;
        if (!ready)
            usleep(20000);
    }
    cr_assert(ready, "the proxy is not ready: %s", out);
}

/* The child's stderr (log, then removed) once it is stopped. */
static void stop_shimmed(const char *log, char *out, size_t cap)
{
    int st = 0;
    pid_t p = child;
    kill(child, SIGTERM);
    int ended = reap_within(child, 0, &st);
    child = 0;
    FILE *f = fopen(log, "r");
    size_t n = f ? fread(out, 1, cap - 1, f) : 0;
    out[n] = 0;
    if (f)
        fclose(f);
    unlink(log);
    cr_assert(ended, "the proxy did not exit within 60 s of SIGTERM: %s", out);
    child_exited_cleanly(p, st, "pdmoe proxy under libnoport.so");
}

/* Makes noport_file list `ports` (NULL: the file gone, every connect through). */
static void short_of_ports(const char *ports)
{
    if (!ports) {
        unlink(noport_file);
        return;
    }
    FILE *f = fopen(noport_file, "w");
    cr_assert_not_null(f);
    fputs(ports, f);
    fclose(f);
}

/* A connection to the proxy at port. */
static int dial(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0, "connect: %s", strerror(errno));
    return fd;
}

/* The descriptors a process has open (/proc/PID/fd). */
static int fds_of(pid_t pid)
{
    char cmd[64];
    snprintf(cmd, sizeof cmd, "ls /proc/%d/fd | wc -l", (int)pid);
    FILE *p = popen(cmd, "r");
    int n = -1;
    cr_assert_eq(fscanf(p, "%d", &n), 1);
    pclose(p);
    return n;
}

/* Waits (at most 3 s) until process pid has n descriptors open; the count then. */
static int fds_reach(pid_t pid, int n)
{
    int have = fds_of(pid);
    for (int i = 0; i < 150 && have != n; i++) {
        usleep(20000);
        have = fds_of(pid);
    }
    return have;
}

/* Sends req on fd and reads the answer (headers and a Content-Length body, within 3 s): its status,
 * 0 if none came; the answer in out. */
static int ask_on(int fd, const char *req, char *out, size_t cap)
{
    cr_assert_eq(write(fd, req, strlen(req)), (ssize_t)strlen(req));
    size_t n = 0;
    out[0] = 0;
    for (double t0 = pd_now_s(); pd_now_s() - t0 < 3 && n < cap - 1;) {
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, 50) <= 0)
            continue;
        ssize_t r = read(fd, out + n, cap - 1 - n);
        if (r <= 0)
            break;
        n += (size_t)r;
        out[n] = 0;
        const char *end = strstr(out, "\r\n\r\n"), *cl = strcasestr(out, "\r\nContent-Length:");
        if (end && cl && cl < end && n >= (size_t)(end + 4 - out) + (size_t)atol(cl + 17))
            break;
    }
    int code = 0;
    sscanf(out, "HTTP/1.1 %d", &code);
    return code;
}

/* A connect or an accept of the proxy that finds no descriptor free (EMFILE: here the proxy holds
 * descriptors beyond its reserve, 96 inherited from its parent, and client connections fill the rest
 * of ulimit -n 128) closes its idle pooled connections and tries once more: an /expert_stats
 * fan-out, a completion and a new client are each answered. The connect failed at once, a 502 or
 * 503 naming EMFILE, and the accept waited every 100 ms for a descriptor that only the pool's idle
 * timeout (20 s) would free. The prefill instance closes each connection (none is kept); the decode
 * instance's is kept, the one idle connection to close. */
Test(pool, a_connect_or_accept_short_of_descriptors_closes_idle_connections_and_tries_again)
{
    struct fake *pf = &F, *df = &G[0];
    fake_start(pf);
    atomic_store(&pf->close_each, 1);
    fake_start(df);
    const int port = test_ports(), L = 128, spare = 96;
    char prefill[32], decode[32], sport[16], log[64], out[8192];
    snprintf(prefill, sizeof prefill, "127.0.0.1:%d", pf->port);
    snprintf(decode, sizeof decode, "127.0.0.1:%d", df->port);
    snprintf(sport, sizeof sport, "%d", port);
    snprintf(log, sizeof log, "/tmp/pdmoe-emfile-%d.log", (int)getpid());
    snprintf(noport_log, sizeof noport_log, "%s", log);   /* (removed by fini if the test fails) */
    const char *bin = pdmoe_bin();
    child = fork_pdmoe();
    if (child == 0) {
        int lfd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644), nul = open("/dev/null", O_RDWR);
        dup2(lfd, 2);
        for (int fd = 3; fd < 3 + spare; fd++)
            if (fd != nul && fd != lfd)
                dup2(nul, fd);
        for (int fd = 3 + spare; fd < 4096; fd++)
            close(fd);
        if (nul >= 3 + spare)
            dup2(nul, 3 + spare - 1);
        struct rlimit rl = {(rlim_t)L, (rlim_t)L};
        setrlimit(RLIMIT_NOFILE, &rl);
        execl(bin, bin, "proxy", "--prefill", prefill, "--decode", decode, "--port", sport, "--health-interval-ms",
              "60000", (char *)NULL);
        _exit(127);
    }
    int ready = 0;
    for (int i = 0; i < 250 && !ready; i++) {
        ready = curl_port(port, "/readiness", NULL, NULL, out, sizeof out) == 200;
        if (!ready)
            usleep(20000);
    }
    cr_assert(ready, "the proxy is not ready: %s", out);
    usleep(200000);   /* (curl's connections closed) */
    const int cap = metric_port(port, "pdmoe_http_max_connections");
    usleep(200000);
    int have = fds_of(child);
    cr_assert(have < L && L - have < cap - 2, "the proxy has %d descriptors open of %d, its cap %d clients", have, L,
              cap);
    /* clients take every descriptor left */
    int clients[128], nc = 0;
    while (nc < L - have)
        clients[nc++] = dial(port);
    int got = fds_reach(child, L);
    cr_assert_eq(got, L, "the proxy has %d descriptors open of %d after %d clients (%d before them)", got, L, nc, have);
    const char *stats = "GET /expert_stats?role=prefill HTTP/1.1\r\nHost: x\r\n\r\n";
    int code = ask_on(clients[0], stats, out, sizeof out);
    cr_assert(code == 200 && strstr(out, "\"instances\":1"), "/expert_stats with no descriptor free: %d %s", code, out);
    /* a connection kept to the decode instance again (/v1/models), every descriptor taken again */
    code = ask_on(clients[1], "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", out, sizeof out);
    cr_assert_eq(code, 200, "%s", out);
    cr_assert_eq(fds_reach(child, L), L, "the proxy's descriptors after /v1/models");
    const char *comp = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       "Content-Length: 30\r\n\r\n{\"prompt\":\"hi\",\"max_tokens\":1}";
    code = ask_on(clients[2], comp, out, sizeof out);
    cr_assert(code == 200 && strstr(out, "\"ok\""), "a completion with no descriptor free: %d %s", code, out);
    /* its prefill took the decode's idle connection's descriptor, its decode the prefill's: every
     * descriptor taken still, the decode's connection kept */
    cr_assert_eq(fds_reach(child, L), L, "the proxy's descriptors after the completion");
    code = curl_port(port, "/health", NULL, "-m 3", out, sizeof out);
    cr_assert_eq(code, 200, "a new client with no descriptor free: %d %s", code, out);
    for (int i = 0; i < nc; i++)
        close(clients[i]);
    char said[8192];
    stop_shimmed(log, said, sizeof said);
    noport_log[0] = 0;
    cr_assert(!strstr(said, "is down"), "an instance was taken out: %s", said);
}

/* A connect() that fails with EADDRNOTAVAIL (every ephemeral port of the proxy's host towards the
 * instance in use or in TIME_WAIT; here an LD_PRELOAD shim, build/libnoport.so) is named in the
 * client's error and the proxy's log, and is not the instance's failure: it stays in, its checks
 * failing the same way do not take it out. */
Test(pool, no_local_port_is_named_and_not_held_against_the_instance)
{
    fake_start(&F);
    atomic_store(&F.close_each, 1);   /* no connection kept alive: each request and check connects */
    const int port = test_ports();
    char where[32], log[64];
    snprintf(where, sizeof where, "127.0.0.1:%d", F.port);
    snprintf(log, sizeof log, "/tmp/pdmoe-noport-%d.log", (int)getpid());
    const char *args[] = {"proxy", "--decode", where, NULL};
    start_shimmed(args, port, F.port, log);
    char out[8192];
    const char *body = "{\"prompt\":\"hi\",\"max_tokens\":1}";
    cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    short_of_ports("");
    int code = curl_port(port, "/v1/completions", body, NULL, out, sizeof out);
    cr_assert_eq(code, 503, "%s", out);
    cr_assert(strstr(out, "EADDRNOTAVAIL") && strstr(out, "ip_local_port_range") && strstr(out, where),
              "the error does not name the lack of local ports and the instance: %s", out);
    /* its checks fail the same way for a while: it stays in */
    int checks = atomic_load(&F.health_200);
    usleep(500000);
    cr_assert_eq(atomic_load(&F.health_200), checks, "the shim let checks through");
    cr_assert_eq(proxy_instance_metric(port, "up", "decode", where), 1, "no local port was held against the instance");
    cr_assert_eq(proxy_instance_metric(port, "ejections_total", "decode", where), 0,
                 "no local port was held against the instance");
    cr_assert_geq(metric_key(port, "pdmoe_proxy_errors_total{kind=\"local_limit\"}"), 1);
    short_of_ports(NULL);
    cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    stop_shimmed(log, out, sizeof out);
    cr_assert(strstr(out, "EADDRNOTAVAIL") && strstr(out, where), "the log does not name it: %s", out);
    cr_assert(!strstr(out, "is down"), "the instance was taken out: %s", out);
}

/* Ports run out per destination (address and port): a prefill whose connect fails with
 * EADDRNOTAVAIL goes to the next prefill instance the routing picks, and a decode not yet begun to
 * the next decode instance, each at most once per instance and without taking anyone out; only
 * when every instance of the role failed so does the client get the 503 naming the limit. The first
 * prefill instance (least_loaded picks it first at equal loads) and the first decode one are short
 * of ports: each request succeeds through the second of each, errors_total{kind="local_limit"}
 * counting the two failures. The 503 came at once, at the first instance. */
Test(pool, a_connect_short_of_local_ports_goes_to_the_next_instance_of_its_role)
{
    struct fake *p1 = &F, *p2 = &G[0], *d1 = &G[1], *d2 = &G[2];
    struct fake *all[] = {p1, p2, d1, d2};
    char where[4][32];
    for (int i = 0; i < 4; i++) {
        fake_start(all[i]);
        atomic_store(&all[i]->close_each, 1);   /* each request connects */
        snprintf(where[i], sizeof where[i], "127.0.0.1:%d", all[i]->port);
    }
    const int port = test_ports();
    char log[64], prefill[80], decode[80], out[8192], ports[64];
    snprintf(log, sizeof log, "/tmp/pdmoe-noport-%d.log", (int)getpid());
    snprintf(prefill, sizeof prefill, "%s,%s", where[0], where[1]);
    snprintf(decode, sizeof decode, "%s,%s", where[2], where[3]);
    const char *args[] = {"proxy", "--prefill", prefill, "--decode", decode, "--policy", "least_loaded", NULL};
    start_shimmed(args, port, 0, log);
    snprintf(ports, sizeof ports, "%d %d", p1->port, d1->port);
    short_of_ports(ports);
    const char *body[] = {"{\"prompt\":\"hi\",\"max_tokens\":1}", "{\"prompt\":\"hi\",\"max_tokens\":1,\"stream\":true}"};
    for (int k = 0; k < 2; k++) {
        int code = curl_port(port, "/v1/completions", body[k], NULL, out, sizeof out);
        cr_assert(code == 200 && strstr(out, "\"ok\"") && !strstr(out, "\"error\""), "%s: %d %s", body[k], code, out);
    }
    cr_assert_eq(atomic_load(&p1->completions) + atomic_load(&d1->completions), 0, "the shim let a request through");
    cr_assert_eq(atomic_load(&p2->completions), 2);
    cr_assert_eq(atomic_load(&d2->completions), 2);
    cr_assert_eq(metric_key(port, "pdmoe_proxy_errors_total{kind=\"local_limit\"}"), 4,
                 "two requests, each short of ports towards one prefill and one decode instance");
    for (int i = 0; i < 4; i++) {
        const char *role = i < 2 ? "prefill" : "decode";
        cr_assert_eq(proxy_instance_metric(port, "ejections_total", role, where[i]), 0, "%s was taken out", where[i]);
        cr_assert_eq(proxy_instance_metric(port, "up", role, where[i]), 1, "%s is not up", where[i]);
    }
    /* both prefill instances short: the 503 names the limit and both, each tried once */
    snprintf(ports, sizeof ports, "%d %d", p1->port, p2->port);
    short_of_ports(ports);
    int code = curl_port(port, "/v1/completions", body[0], NULL, out, sizeof out);
    cr_assert_eq(code, 503, "%s", out);
    cr_assert(strstr(out, "EADDRNOTAVAIL") && strstr(out, "nor to 1 other prefill instance"), "%s", out);
    cr_assert_eq(metric_key(port, "pdmoe_proxy_errors_total{kind=\"local_limit\"}"), 6);
    short_of_ports(NULL);
    stop_shimmed(log, out, sizeof out);
    cr_assert(!strstr(out, "is down"), "an instance was taken out: %s", out);
}

/* An /expert_stats fan-out to an instance that takes the connection but never answers (stopped
 * with SIGSTOP, a host gone without a reset) ends with a 502 naming it once its /health has been
 * silent for the proxy's 3 s, and the fan-out queued behind it is answered too. The fan-out's GETs
 * had no deadline: it waited for ever, and every /expert_stats queued behind it with it. */
Test(pool, an_expert_stats_fan_out_to_a_hung_instance_ends_and_frees_the_queue, .timeout = 30)
{
    fake_start(&F);
    int hung = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);   /* listens, never accepts: no answer */
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    cr_assert_eq(bind(hung, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(listen(hung, 64), 0);
    cr_assert_eq(getsockname(hung, (struct sockaddr *)&a, &len), 0);
    char w0[32], w1[32];
    snprintf(w0, sizeof w0, "127.0.0.1:%d", F.port);
    snprintf(w1, sizeof w1, "127.0.0.1:%d", ntohs(a.sin_port));
    struct pd_proxy_opts o = {.n_decode = 2, .health_interval_ms = 100, .health_timeout_ms = 200};
    o.decode[0] = w0;
    o.decode[1] = w1;
    start_proxy(&o);
    wait_count(&F.health_200, 1, "checks answered");
    const char *fmt = "curl -s -m 12 -o /dev/null -w '%%{http_code}' http://127.0.0.1:%d/expert_stats";
    char cmd[256];
    snprintf(cmd, sizeof cmd, fmt, pd_proxy_port(X));
    FILE *queued = popen(cmd, "r");   /* a second fan-out, waiting for the first */
    cr_assert_not_null(queued);
    char out[4096];
    const double t0 = pd_now_s();
    int code = curl_port(pd_proxy_port(X), "/expert_stats", NULL, "-m 12", out, sizeof out);
    const double took = pd_now_s() - t0;
    char qcode[16] = {0};
    size_t got = fread(qcode, 1, sizeof qcode - 1, queued);
    qcode[got] = 0;
    pclose(queued);
    close(hung);
    cr_assert_eq(code, 502, "/expert_stats with an instance that never answers: %d after %.1f s: %s", code, took, out);
    cr_assert(strstr(out, w1), "the 502 does not name the instance %s: %s", w1, out);
    cr_assert(took < 8, "the fan-out took %.1f s", took);
    cr_assert_eq(atoi(qcode), 502, "the fan-out queued behind it: %s", qcode);
}

/* The proxy stopping with an /expert_stats fan-out in flight (an instance slow to answer) and one
 * queued answers both clients with a 503 saying why; the one in flight got an empty reply. */
Test(pool, a_proxy_stopping_answers_the_expert_stats_fan_out_in_flight, .timeout = 30)
{
    fake_start(&F);
    int hung = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);   /* listens, never accepts: no answer */
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    cr_assert_eq(bind(hung, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(listen(hung, 64), 0);
    cr_assert_eq(getsockname(hung, (struct sockaddr *)&a, &len), 0);
    char w0[32], w1[32];
    snprintf(w0, sizeof w0, "127.0.0.1:%d", F.port);
    snprintf(w1, sizeof w1, "127.0.0.1:%d", ntohs(a.sin_port));
    struct pd_proxy_opts o = {.n_decode = 2};
    o.decode[0] = w0;
    o.decode[1] = w1;
    start_proxy(&o);
    wait_count(&F.health_200, 1, "checks answered");
    char cmd[256];
    snprintf(cmd, sizeof cmd, "curl -s -m 10 -w ' %%{http_code}' http://127.0.0.1:%d/expert_stats", pd_proxy_port(X));
    FILE *c[2];
    for (int i = 0; i < 2; i++) {
        cr_assert_not_null(c[i] = popen(cmd, "r"));
        usleep(300000);   /* the first in flight, the second queued behind it */
    }
    proxy_shutdown(&X, tx);
    close(hung);
    for (int i = 0; i < 2; i++) {
        char out[1024] = {0};
        size_t got = fread(out, 1, sizeof out - 1, c[i]);
        out[got] = 0;
        pclose(c[i]);
        cr_assert(strstr(out, " 503") && strstr(out, "shutting down"), "client %d of /expert_stats at the stop: %s", i,
                  out);
    }
}

/* Connections cannot starve the server or the proxy: idle connections beyond the open-file limit
 * leave /health answering and the process idle; half-sent headers and bodies, idle keep-alives
 * and a slowloris are closed at their deadlines while others are served; over the connection cap
 * a 503 with a JSON body; libevent's own 400/413 answers carry JSON bodies; ambiguous framing (two
 * Content-Lengths, a coding besides chunked) is refused and the connection closed; HEAD answers carry
 * no body; a stream or a long generation outlives every timeout; requests pipelined behind a
 * generation or sent without reading the answers are answered in order, in bounded memory; a
 * stream to an HTTP/1.0 client ends with its connection, as its headers say. */
#define _GNU_SOURCE   /* strcasestr */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../tmpmodel.h"
#include "core/timing.h"
#include "pd/server.h"
#include "proxy/proxy.h"
#include "util.h"

static char dir[64];
static struct pd_server *srv;
static struct pd_proxy *px;
static pthread_t t_srv, t_px;
static pid_t child = -1;

static void setup(void)
{
    tmp_model("v4-tiny", 7, dir, sizeof dir);
}

static void teardown(void)
{
    proxy_shutdown(&px, t_px);
    if (srv) {
        pd_server_stop(srv);
        pthread_join(t_srv, NULL);
        pd_server_destroy(srv);
        srv = NULL;
    }
    if (child > 0) {
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        child = -1;
    }
    rm_model(dir);
}

TestSuite(conn, .init = setup, .fini = teardown, .timeout = 120);

/* timeouts small enough for a test: idle 0.6 s, header and body 0.3 s */
static const struct pd_http_limits quick = {.idle_timeout_ms = 600, .header_timeout_ms = 300, .body_timeout_ms = 300};

static int start_server(const struct pd_http_limits *lim)
{
    pd_err e = {0};
    struct pd_server_opts o = {.model_dir = dir, .threads = 1, .max_num_seqs = 4, .max_model_len = 4096,
                               .served_name = "tiny", .http = *lim};
    cr_assert_eq(pd_server_create(&o, &srv, &e), 0, "%s", e.msg);
    pthread_create(&t_srv, NULL, run_server, srv);
    return pd_server_port(srv);
}

/* A proxy with the server as its colocated (decode) instance. */
static int start_proxy(const struct pd_http_limits *lim, int server_port)
{
    static char d[32];
    snprintf(d, sizeof d, "127.0.0.1:%d", server_port);
    pd_err e = {0};
    struct pd_proxy_opts o = {.decode = {d}, .n_decode = 1, .http = *lim};
    cr_assert_eq(pd_proxy_create(&o, &px, &e), 0, "%s", e.msg);
    pthread_create(&t_px, NULL, run_proxy, px);
    return pd_proxy_port(px);
}

static int dial(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0, "socket: %s", strerror(errno));
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0, "connect: %s", strerror(errno));
    return fd;
}

static void say(int fd, const char *s)
{
    cr_assert_eq(send(fd, s, strlen(s), MSG_NOSIGNAL), (ssize_t)strlen(s));
}

/* Reads until the peer closes or `limit` seconds pass; returns the seconds waited (the limit if
 * the connection is still open), the bytes read in out. */
static double read_until_close(int fd, double limit, char *out, size_t cap)
{
    double t0 = pd_now_s();
    size_t n = 0;
    out[0] = 0;
    for (;;) {
        double left = limit - (pd_now_s() - t0);
        if (left <= 0)
            return limit;
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, (int)(left * 1000) + 1) <= 0)
            continue;
        char buf[4096];
        ssize_t r = recv(fd, buf, sizeof buf, 0);
        if (r <= 0)
            break;
        size_t k = (size_t)r < cap - 1 - n ? (size_t)r : cap - 1 - n;
        memcpy(out + n, buf, k);
        n += k;
        out[n] = 0;
    }
    out[n] = 0;
    return pd_now_s() - t0;
}

/* One request on a fresh connection: the status, the body (after the blank line) in body. */
static int raw_request(int port, const char *req, char *body, size_t cap)
{
    return http_exchange(port, req, strlen(req), 10, body, cap);
}

/* The body is an OpenAI-style error whose message contains `want`. */
static void assert_json_error(const char *body, const char *want)
{
    json_t *j = parse(body);
    const char *msg = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    cr_assert_not_null(msg, "no error.message in %s", body);
    cr_assert(strstr(msg, want), "error \"%s\" does not say \"%s\"", msg, want);
    json_decref(j);
}

/* utime + stime of a process from its open /proc/PID/stat, in clock ticks */
static long cpu_ticks_fd(int fd)
{
    char buf[2048];
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    cr_assert_gt(n, 0);
    buf[n] = 0;
    char *p = strrchr(buf, ')');   /* the command name may hold spaces */
    long ut = 0, st = 0;
    cr_assert_eq(sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %ld %ld", &ut, &st), 2);
    return ut + st;
}

static int stat_fd(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY);
    cr_assert_geq(fd, 0);
    return fd;
}

static long cpu_ticks(pid_t pid)
{
    int fd = stat_fd(pid);
    long t = cpu_ticks_fd(fd);
    close(fd);
    return t;
}

/* `pdmoe ARGS... --port 0` under an open-file limit of nofile; the port it prints. */
static int spawn_limited(int nofile, const char *const *args)
{
    int pfd[2];
    cr_assert_eq(pipe(pfd), 0);
    const char *bin = pdmoe_bin();
    child = fork_pdmoe();
    cr_assert_geq(child, 0);
    if (child == 0) {
        struct rlimit rl = {(rlim_t)nofile, (rlim_t)nofile};
        setrlimit(RLIMIT_NOFILE, &rl);
        dup2(pfd[1], 2);
        close(pfd[0]);
        close(pfd[1]);
        const char *argv[32] = {bin};
        int n = 1;
        for (; args[n - 1]; n++)
            argv[n] = args[n - 1];
        argv[n++] = "--port";
        argv[n++] = "0";
        argv[n] = NULL;
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    close(pfd[1]);
    char log[4096] = "";
    size_t n = 0;
    const char *at = NULL;
    double t0 = pd_now_s();
    while (!(at = strstr(log, "http://127.0.0.1:")) || !strchr(at, '\n')) {
        struct pollfd p = {pfd[0], POLLIN, 0};
        cr_assert(pd_now_s() - t0 < 30, "no address printed: %s", log);
        if (poll(&p, 1, 1000) <= 0)
            continue;
        ssize_t r = read(pfd[0], log + n, sizeof log - 1 - n);
        cr_assert_gt(r, 0, "the process ended: %s", log);
        n += (size_t)r;
        log[n] = 0;
    }
    close(pfd[0]);
    return atoi(at + strlen("http://127.0.0.1:"));
}

/* 150 idle connections to a process allowed 128 descriptors (the case): /health answers
 * at once (200, or a 503 with a JSON error), the process stays idle rather than spinning on
 * accept(), and once the idle ones have waited a second /health gets a 200. */
static void idle_flood(int port)
{
    int fds[150];
    for (int i = 0; i < 150; i++)
        fds[i] = dial(port);
    usleep(300000);
    char body[4096];
    int code = raw_request(port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", body, sizeof body);
    cr_assert(code == 200 || code == 503, "/health with 150 idle connections: %d", code);
    if (code == 503)
        assert_json_error(body, "connections open");
    long t0 = cpu_ticks(child);
    usleep(1000000);
    long used = cpu_ticks(child) - t0;
    cr_assert_leq(used, sysconf(_SC_CLK_TCK) / 10, "%ld ticks of CPU in one idle second (%ld a second)", used,
                  sysconf(_SC_CLK_TCK));
    usleep(300000);
    code = raw_request(port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", body, sizeof body);
    cr_assert_eq(code, 200, "/health after the idle connections waited: %d %s", code, body);
    for (int i = 0; i < 150; i++)
        close(fds[i]);
}

Test(conn, serve_idle_connections_over_the_fd_limit_leave_health_answering)
{
    const char *args[] = {"serve", "--model", dir, "--threads", "1", NULL};
    idle_flood(spawn_limited(128, args));
}

Test(conn, proxy_idle_connections_over_the_fd_limit_leave_health_answering)
{
    const char *args[] = {"proxy", "--decode", "127.0.0.1:1", NULL};
    idle_flood(spawn_limited(128, args));
}

/* Half a header, half a body, an idle keep-alive and a slowloris trickling its headers are each
 * closed at their deadline; meanwhile requests on other connections are answered at once. */
static void deadlines(int port)
{
    char out[4096];
    int half_header = dial(port), half_body = dial(port), idle = dial(port), loris = dial(port);
    say(half_header, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: applic");
    say(half_body, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\":");
    double t0 = pd_now_s();
    /* the slowloris sends a byte every 50 ms: never silent, but its headers never end */
    const char *drip = "GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    double loris_closed = 0;
    for (const char *p = drip; *p && !loris_closed; p++) {
        if (send(loris, p, 1, MSG_NOSIGNAL) != 1 || read_until_close(loris, 0.05, out, sizeof out) < 0.05)
            loris_closed = pd_now_s() - t0;
        if (p - drip == 10) {
            /* others are served while it drips */
            double t = pd_now_s();
            cr_assert_eq(curl_port(port, "/health", NULL, "-m 2", out, sizeof out), 200);
            cr_assert_lt(pd_now_s() - t, 1.0);
        }
    }
    cr_assert(loris_closed > 0.2 && loris_closed < 1.5, "slowloris closed after %.2f s (header deadline 0.3 s)",
              loris_closed);
    read_until_close(half_header, 3, out, sizeof out);
    double h = pd_now_s() - t0;
    read_until_close(half_body, 3, out, sizeof out);
    double b = pd_now_s() - t0;
    read_until_close(idle, 3, out, sizeof out);
    double i = pd_now_s() - t0;
    cr_assert(h < 1.5 && b < 1.5, "half header closed after %.2f s, half body after %.2f s (deadlines 0.3 s)", h, b);
    cr_assert(i > 0.5 && i < 2, "the idle connection closed after %.2f s (idle timeout 0.6 s)", i);
    close(half_header);
    close(half_body);
    close(idle);
    close(loris);
}

Test(conn, serve_closes_half_requests_idle_connections_and_a_slowloris)
{
    deadlines(start_server(&quick));
}

Test(conn, proxy_closes_half_requests_idle_connections_and_a_slowloris)
{
    struct pd_http_limits slow = {0};
    deadlines(start_proxy(&quick, start_server(&slow)));
}

/* A keep-alive connection goes back to the idle deadline after its answer. */
Test(conn, keep_alive_connection_is_closed_after_the_idle_timeout)
{
    int port = start_server(&quick);
    int fd = dial(port);
    say(fd, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    char out[4096];
    double t = read_until_close(fd, 3, out, sizeof out);
    cr_assert(strstr(out, "200 OK") && strstr(out, "ok"), "%s", out);
    cr_assert(t > 0.5 && t < 2, "the idle keep-alive closed after %.2f s (idle timeout 0.6 s)", t);
    close(fd);
}

/* A request pipelined behind a completion still being generated, on one keep-alive connection:
 * both are answered in order. The handler reads the connection to see its client leave, and
 * libevent's read callback, run by the second request's bytes, ended the whole process
 * ("evhttp_read_cb: illegal connection state 7"). */
static void pipelined_behind_a_generation(int port)
{
    int fd = dial(port);
    const char *body = "{\"prompt\":\"x\",\"max_tokens\":2000,\"ignore_eos\":true,\"temperature\":0}";
    char req[512];
    snprintf(req, sizeof req, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             "Content-Length: %zu\r\n\r\n%s", strlen(body), body);
    say(fd, req);
    usleep(100000);
    say(fd, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    static char out[1 << 20];
    read_until_close(fd, 60, out, sizeof out);
    close(fd);
    cr_assert(strncmp(out, "HTTP/1.1 200", 12) == 0, "the completion: %.300s", out);
    cr_assert(strstr(out, "\"completion_tokens\":2000"), "the completion is not whole: %.300s", out);
    const char *second = strstr(out + 1, "HTTP/1.1 ");
    cr_assert(second && strncmp(second, "HTTP/1.1 200", 12) == 0 && strstr(second, "\r\n\r\nok"),
              "no /health answer after the completion: %.300s", second ? second : out);
    /* and the process still serves */
    char b[256];
    cr_assert_eq(curl_port(port, "/health", NULL, NULL, b, sizeof b), 200);
}

Test(conn, serve_answers_a_request_pipelined_behind_a_generation)
{
    pipelined_behind_a_generation(start_server(&(struct pd_http_limits){0}));
}

Test(conn, proxy_answers_a_request_pipelined_behind_a_generation)
{
    struct pd_http_limits open = {0};
    pipelined_behind_a_generation(start_proxy(&open, start_server(&open)));
}

/* A stream to an HTTP/1.0 client that asked for keep-alive: HTTP/1.0 has no chunked coding, so the
 * stream's end is the connection's close, and the answer says so. libevent answered such a
 * request "Connection: keep-alive" and "Content-Length: 0" and then wrote the events: a client
 * read an empty answer, took the events for the next one, and waited on a connection that never
 * closed. */
static void http10_keep_alive_stream(int port)
{
    int fd = dial(port);
    const char *body = "{\"prompt\":\"x\",\"max_tokens\":3,\"stream\":true}";
    char req[512];
    snprintf(req, sizeof req, "POST /v1/completions HTTP/1.0\r\nConnection: keep-alive\r\n"
             "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s", strlen(body), body);
    say(fd, req);
    static char out[1 << 16];
    double waited = read_until_close(fd, 20, out, sizeof out);
    close(fd);
    cr_assert(strncmp(out, "HTTP/1.0 200", 12) == 0, "the answer: %.300s", out);
    char *end = strstr(out, "\r\n\r\n");
    cr_assert(end, "no end of headers: %.300s", out);
    *end = 0;
    cr_assert(!strcasestr(out, "Content-Length"), "a stream's answer with a Content-Length:\n%s", out);
    cr_assert(!strcasestr(out, "keep-alive"), "a stream to HTTP/1.0 cannot keep the connection:\n%s", out);
    cr_assert(strcasestr(out, "Connection: close"), "the answer does not say the connection closes:\n%s", out);
    cr_assert(strstr(end + 4, "data: [DONE]"), "the events: %.300s", end + 4);
    cr_assert_lt(waited, 20, "the connection stayed open after the stream");
}

Test(conn, serve_ends_a_stream_to_an_http10_keep_alive_client_by_closing)
{
    http10_keep_alive_stream(start_server(&(struct pd_http_limits){0}));
}

Test(conn, proxy_ends_a_stream_to_an_http10_keep_alive_client_by_closing)
{
    struct pd_http_limits open = {0};
    http10_keep_alive_stream(start_proxy(&open, start_server(&open)));
}

/* Counts the answers' status lines in a stream read in pieces (a line may straddle two). */
struct answers {
    size_t n;
    char carry[32];
    size_t carried;
};

static void count_answers(struct answers *a, const char *data, size_t len)
{
    static const char mark[] = "HTTP/1.1 200 OK\r\n";
    const size_t keep = sizeof mark - 2;   /* too short to hold a whole line */
    char *buf = malloc(a->carried + len + 1);
    memcpy(buf, a->carry, a->carried);
    memcpy(buf + a->carried, data, len);
    size_t n = a->carried + len;
    buf[n] = 0;
    for (const char *q = buf; (q = strstr(q, mark)); q += sizeof mark - 1)   /* (the answers hold no NUL) */
        a->n++;
    a->carried = n < keep ? n : keep;
    memcpy(a->carry, buf + n - a->carried, a->carried);
    free(buf);
}

/* A client writing GET /health back to back on one connection and reading the answers slowly (4 KB
 * every 50 ms): the server reads no further ahead than max_header_bytes once the answer it writes
 * waits (it buffered every byte: 2.3 GB in 7 s), others are served meanwhile, and once the client
 * reads, every request it sent is answered, in order. */
Test(conn, a_client_that_pipelines_and_reads_slowly_is_not_buffered_without_bound)
{
    int port = start_server(&(struct pd_http_limits){0});
    int fd = dial(port);
    fcntl(fd, F_SETFL, O_NONBLOCK);
    static const char one[] = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    const size_t len = sizeof one - 1, span = len * 1000;
    char *many = malloc(span);
    for (size_t i = 0; i < 1000; i++)
        memcpy(many + i * len, one, len);
    struct answers got = {0};
    char buf[65536];
    size_t sent = 0;
    double t0 = pd_now_s(), read_at = t0;
    while (pd_now_s() - t0 < 1.5 && sent < (size_t)1 << 30) {
        ssize_t w = send(fd, many + sent % span, span - sent % span, MSG_NOSIGNAL);
        if (w > 0)
            sent += (size_t)w;
        else
            cr_assert(errno == EAGAIN || errno == EWOULDBLOCK, "send: %s", strerror(errno));
        if (pd_now_s() - read_at >= 0.05) {
            ssize_t r = recv(fd, buf, 4096, 0);
            if (r > 0)
                count_answers(&got, buf, (size_t)r);
            read_at = pd_now_s();
        }
        if (w <= 0)
            usleep(1000);
    }
    free(many);
    cr_assert_lt(sent, (size_t)64 << 20, "the server took %zu MB of requests in 1.5 s, %zu answers read", sent >> 20,
                 got.n);
    char b[256];
    cr_assert_eq(curl_port(port, "/health", NULL, NULL, b, sizeof b), 200, "another client meanwhile");
    /* the rest of a request cut in two, then one that ends the connection; every answer read */
    size_t part = sent % len, want = sent / len + (part ? 1 : 0) + 1;
    char tail[256];
    snprintf(tail, sizeof tail, "%sGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", part ? one + part : "");
    size_t tail_sent = 0, tail_len = strlen(tail);
    t0 = pd_now_s();
    for (;;) {
        cr_assert_lt(pd_now_s() - t0, 60, "%zu answers of %zu after 60 s", got.n, want);
        struct pollfd p = {fd, POLLIN | (tail_sent < tail_len ? POLLOUT : 0), 0};
        if (poll(&p, 1, 1000) <= 0)
            continue;
        if ((p.revents & POLLOUT) && tail_sent < tail_len) {
            ssize_t w = send(fd, tail + tail_sent, tail_len - tail_sent, MSG_NOSIGNAL);
            if (w > 0)
                tail_sent += (size_t)w;
        }
        if (!(p.revents & (POLLIN | POLLHUP)))
            continue;
        ssize_t r = recv(fd, buf, sizeof buf, 0);
        if (r <= 0)
            break;
        count_answers(&got, buf, (size_t)r);
    }
    close(fd);
    cr_assert_eq(got.n, want, "%zu answers to %zu requests", got.n, want);
}

/* Streamed and not, a generation lasting several times every timeout is delivered whole,
 * directly and through the proxy. */
static void long_answers(int port)
{
    static char out[1 << 22];
    const char *stream = "{\"prompt\":\"x\",\"max_tokens\":4000,\"ignore_eos\":true,\"stream\":true,\"temperature\":0}";
    const char *plain = "{\"prompt\":\"x\",\"max_tokens\":4000,\"ignore_eos\":true,\"temperature\":0}";
    double t0 = pd_now_s();
    cr_assert_eq(curl_port(port, "/v1/completions", stream, NULL, out, sizeof out), 200);
    double ts = pd_now_s() - t0;
    int chunks = 0;
    for (const char *p = out; (p = strstr(p, "data: {")); p++)
        chunks++;
    cr_assert(strstr(out, "data: [DONE]"), "the stream was cut after %d chunks, %.2f s", chunks, ts);
    cr_assert(strstr(out, "\"finish_reason\":\"length\""), "no finish_reason length in the stream's end");
    t0 = pd_now_s();
    cr_assert_eq(curl_port(port, "/v1/completions", plain, NULL, out, sizeof out), 200, "%.300s", out);
    double tp = pd_now_s() - t0;
    json_t *j = parse(out);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")), 4000);
    json_decref(j);
    /* the property is only shown if the answers outlast the timeouts */
    cr_assert(ts > 0.15 && tp > 0.15, "answers took %.2f s and %.2f s, not 3 times the 50 ms timeouts", ts, tp);
}

static const struct pd_http_limits quicker = {.idle_timeout_ms = 50, .header_timeout_ms = 50, .body_timeout_ms = 50};

Test(conn, a_long_stream_and_a_long_generation_outlive_the_timeouts)
{
    long_answers(start_server(&quicker));
}

Test(conn, through_the_proxy_a_long_stream_and_generation_outlive_the_timeouts)
{
    long_answers(start_proxy(&quicker, start_server(&quicker)));
}

/* Three connections allowed: a fourth (the others fresh) gets a 503 with a JSON error; once they
 * have been idle a second, one is closed to make room. */
static void cap(int port)
{
    int fds[3];
    for (int i = 0; i < 3; i++)
        fds[i] = dial(port);
    usleep(100000);
    char body[4096];
    int code = raw_request(port, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n", body, sizeof body);
    cr_assert_eq(code, 503, "%d %s", code, body);
    assert_json_error(body, "3 connections open");
    usleep(1200000);
    code = raw_request(port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", body, sizeof body);
    cr_assert_eq(code, 200, "%d %s", code, body);
    int closed = 0;
    for (int i = 0; i < 3; i++) {
        char out[64];
        closed += read_until_close(fds[i], 0.01, out, sizeof out) < 0.01;
        close(fds[i]);
    }
    cr_assert_eq(closed, 1, "%d idle connections closed for the new one", closed);
}

Test(conn, serve_over_the_connection_cap_answers_503_json_then_evicts_an_idle_one)
{
    struct pd_http_limits l = {.max_connections = 3};
    cap(start_server(&l));
}

Test(conn, proxy_over_the_connection_cap_answers_503_json_then_evicts_an_idle_one)
{
    struct pd_http_limits l = {.max_connections = 3}, open = {0};
    cap(start_proxy(&l, start_server(&open)));
}

/* What libevent refuses before any handler runs comes back as a JSON error too. */
static void refusals(int port)
{
    char body[4096], big[8192];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = 0;
    char *req = malloc(sizeof big + 256);
    snprintf(req, sizeof big + 256, "{\"prompt\":\"%s\"}", big);
    cr_assert_eq(curl_port(port, "/v1/completions", req, NULL, body, sizeof body), 413, "%s", body);
    assert_json_error(body, "over 4096 bytes");
    snprintf(req, sizeof big + 256, "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: %s\r\n\r\n", big);
    cr_assert_eq(raw_request(port, req, body, sizeof body), 400);
    assert_json_error(body, "at most 2048 bytes");
    free(req);
    /* a body that is not JSON is named as such (the proxy passed on jansson's words alone:
     * "unexpected token near end of file") */
    cr_assert_eq(curl_port(port, "/v1/completions", "{\"prompt\":", NULL, body, sizeof body), 400, "%s", body);
    assert_json_error(body, "the body is not valid JSON: ");
    cr_assert_eq(curl_port(port, "/v1/completions", "{\"prompt\":\"a\\u0000\"}", NULL, body, sizeof body), 400, "%s", body);
    assert_json_error(body, "the body's JSON holds \\u0000");
    cr_assert_eq(raw_request(port, "NONSENSE\r\n\r\n", body, sizeof body), 400);
    assert_json_error(body, "malformed");
    cr_assert_eq(raw_request(port, "BREW /health HTTP/1.1\r\nHost: x\r\n\r\n", body, sizeof body), 501);
    assert_json_error(body, "method");
    cr_assert_eq(raw_request(port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                             body, sizeof body), 413);
    assert_json_error(body, "chunked");
    /* Content-Length beyond the limit is refused before any body byte */
    cr_assert_eq(raw_request(port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n",
                             body, sizeof body), 413);
    assert_json_error(body, "over 4096 bytes");
    /* versions libevent parses but HTTP/1.x does not know */
    cr_assert_eq(raw_request(port, "GET /health HTTP/0.1\r\nHost: x\r\n\r\n", body, sizeof body), 505);
    assert_json_error(body, "HTTP/1.0 or HTTP/1.1 only");
    cr_assert_eq(raw_request(port, "GET /health HTTP/1.7\r\nHost: x\r\n\r\n", body, sizeof body), 505);
    /* a path that is not UTF-8, quoted in the error */
    cr_assert_eq(raw_request(port, "GET /nowher\x9b\xc9x=%zz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", body, sizeof body), 404);
    assert_json_error(body, "no route /nowher??x=%zz");
    /* framing a front may read otherwise than this one, which a request could be smuggled through
     * (RFC 9112 6.3): two Content-Lengths that differ, a coding besides chunked; one JSON error, then
     * the connection closes unread (the GET after the first body is never answered) */
    char out[1 << 14];
    int fd = dial(port);
    say(fd, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 39\r\n\r\n"
            "{}GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    read_until_close(fd, 10, out, sizeof out);
    close(fd);
    cr_assert(strncmp(out, "HTTP/1.1 400", 12) == 0, "%s", out);
    cr_assert_null(strstr(out + 1, "HTTP/1."), "a second answer: %s", out);
    assert_json_error(strstr(out, "\r\n\r\n") + 4, "Content-Length");
    cr_assert_eq(raw_request(port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
                             "2\r\n{}\r\n0\r\n\r\n", body, sizeof body), 501);
    assert_json_error(body, "Transfer-Encoding");
    /* a space before the colon: "Content-Length :" is no length to libevent, whose body was then
     * answered as a request of its own (RFC 9112 5.1: MUST be refused); a control character in a
     * value, a length that is not digits, an HTTP/1.1 request without Host (RFC 9112 3.2) */
    fd = dial(port);
    say(fd, "POST /health HTTP/1.1\r\nHost: x\r\nContent-Length : 36\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n");
    read_until_close(fd, 10, out, sizeof out);
    close(fd);
    cr_assert(strncmp(out, "HTTP/1.1 400", 12) == 0, "%s", out);
    cr_assert_null(strstr(out + 1, "HTTP/1."), "the body was answered as a request: %s", out);
    assert_json_error(strstr(out, "\r\n\r\n") + 4, "header \"Content-Length \": its name holds a character a name cannot");
    cr_assert_eq(raw_request(port, "GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x01z\r\n\r\n", body, sizeof body), 400);
    assert_json_error(body, "header X-A: its value holds the control character 0x01");
    cr_assert_eq(raw_request(port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: +2\r\n\r\n{}", body,
                             sizeof body), 400);
    assert_json_error(body, "Content-Length: not a number of bytes");
    cr_assert_eq(raw_request(port, "GET /health HTTP/1.1\r\n\r\n", body, sizeof body), 400);
    assert_json_error(body, "without a Host header");
    cr_assert_eq(raw_request(port, "GET /health HTTP/1.0\r\n\r\n", body, sizeof body), 200, "HTTP/1.0 needs no Host");
    /* two Host lines: a front that routes by the last and this server by the first would disagree
     * on the request's target (RFC 9112 3.2: MUST be a 400); this server answered the first */
    cr_assert_eq(raw_request(port, "GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", body, sizeof body), 400,
                 "%s", body);
    assert_json_error(body, "two Host headers");
    cr_assert_eq(raw_request(port, "GET /health HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n", body, sizeof body), 400,
                 "%s", body);
    /* chunks in HTTP/1.0, which has none: a 1.0 hop in front reads them as the next request
     * (RFC 9112 6.1); they were decoded and the connection kept */
    cr_assert_eq(raw_request(port, "POST /v1/completions HTTP/1.0\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked"
                             "\r\n\r\n2\r\n{}\r\n0\r\n\r\n", body, sizeof body), 400, "%s", body);
    assert_json_error(body, "Transfer-Encoding in an HTTP/1.0 request");
    /* a malformed request on a connection that has answered one: libevent's HTML page went out
     * (the output's start is frozen between writes), not the JSON error */
    static const char *const second[] = {"NONSENSE\r\n\r\n", "BREW /health HTTP/1.1\r\nHost: x\r\n\r\n"};
    for (int k = 0; k < 2; k++) {
        fd = dial(port);
        say(fd, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
        usleep(200000);
        say(fd, second[k]);
        read_until_close(fd, 10, out, sizeof out);
        close(fd);
        char *next = strstr(out + 1, "HTTP/1.1 ");
        cr_assert(next && (strncmp(next, "HTTP/1.1 400", 12) == 0 || strncmp(next, "HTTP/1.1 501", 12) == 0), "%s", out);
        cr_assert(strstr(next, "Content-Type: application/json"), "not JSON after a first answer: %s", next);
        assert_json_error(strstr(next, "\r\n\r\n") + 4, k ? "method" : "malformed");
    }
    /* HEAD: a GET's status and headers, Content-Length included, and no body (a body would be read
     * as the start of the next answer on this connection) */
    fd = dial(port);
    say(fd, "HEAD /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    read_until_close(fd, 10, out, sizeof out);
    close(fd);
    char *end = strstr(out, "\r\n\r\n"), *cl = strstr(out, "Content-Length: ");
    cr_assert(strncmp(out, "HTTP/1.1 200", 12) == 0 && end && cl && cl < end, "%s", out);
    cr_assert(strncmp(end + 4, "HTTP/1.1 200", 12) == 0, "the HEAD answer has a body: %s", out);
    const char *get_body = strstr(end + 4, "\r\n\r\n");
    cr_assert_not_null(get_body, "%s", out);
    cr_assert_eq(atoi(cl + 16), (int)strlen(get_body + 4), "HEAD's Content-Length is not GET's: %s", out);
    /* and the server still answers */
    cr_assert_eq(curl_port(port, "/health", NULL, NULL, body, sizeof body), 200);
}

Test(conn, serve_oversized_and_malformed_requests_get_json_errors)
{
    struct pd_http_limits l = {.max_body_bytes = 4096, .max_header_bytes = 2048};
    refusals(start_server(&l));
}

Test(conn, proxy_oversized_and_malformed_requests_get_json_errors)
{
    struct pd_http_limits l = {.max_body_bytes = 4096, .max_header_bytes = 2048}, open = {0};
    refusals(start_proxy(&l, start_server(&open)));
}

static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static int log_lines;
static char last_log[512];

static void count_log(void *arg, const char *line)
{
    pthread_mutex_lock(&log_mu);
    log_lines++;
    snprintf(last_log, sizeof last_log, "%s", line);
    pthread_mutex_unlock(&log_mu);
}

static int open_fds(void)
{
    FILE *p = popen("ls /proc/self/fd | wc -l", "r");
    int n = 0;
    cr_assert(p && fscanf(p, "%d", &n) == 1);
    pclose(p);
    return n;
}

/* Descriptors run out below the connection cap (the cap was set under a higher limit): accept()
 * fails with EMFILE and the server pauses instead of retrying at once (libevent's listener alone
 * spins at 100% CPU), says so once, and serves again once descriptors are free. */
Test(conn, out_of_descriptors_pauses_accept_without_spinning_and_logs_once)
{
    struct pd_http_limits l = {.max_connections = 900, .log = count_log};
    int port = start_server(&l);
    int self = stat_fd(getpid());
    struct rlimit rl;
    getrlimit(RLIMIT_NOFILE, &rl);
    rl.rlim_cur = (rlim_t)open_fds() + 24;
    cr_assert_eq(setrlimit(RLIMIT_NOFILE, &rl), 0);
    int fds[64], n = 0;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    /* clients until this process has no descriptor left; the last ones wait in the backlog */
    while (n < 64) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0)
            break;
        cr_assert_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
        fds[n++] = fd;
        usleep(5000);
    }
    cr_assert_lt(n, 64, "the descriptor limit was never reached");
    usleep(300000);
    long t0 = cpu_ticks_fd(self);
    usleep(1000000);
    long used = cpu_ticks_fd(self) - t0;
    cr_assert_leq(used, sysconf(_SC_CLK_TCK) / 10, "%ld ticks of CPU in one second out of descriptors", used);
    pthread_mutex_lock(&log_mu);
    int lines = log_lines;
    pthread_mutex_unlock(&log_mu);
    cr_assert_eq(lines, 1, "%d log lines for one episode (%s)", lines, last_log);
    cr_assert(strstr(last_log, "Too many open files"), "%s", last_log);
    for (int i = 0; i < n; i++)
        close(fds[i]);
    close(self);
    char body[4096];
    cr_assert_eq(raw_request(port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", body, sizeof body), 200);
}

/* The proxy needs two descriptors for a request (its client's and its upstream connection): its
 * cap leaves the open-file limit room for both. Capped like a server (the limit less the reserve),
 * it ran out of descriptors for upstream connections under load and took each failure for its
 * instances', ejecting healthy ones. It also leaves room for its idle kept-alive connections (16 to
 * its one instance), the instance's /health check and an /expert_stats fan-out's connection to it
 * (one fan-out runs at a time; the cap counted none, and each client's fan-out took a connection to
 * every instance where two descriptors were counted): (255 - 32 - 18) / 2. */
Test(conn, the_proxys_cap_leaves_descriptors_for_its_upstream_connections)
{
    const char *bin = pdmoe_bin();
    int port = free_port();
    char cmd[512];
    snprintf(cmd, sizeof cmd, "ulimit -n 255 && exec %s proxy --decode 127.0.0.1:1 --port %d 2>/dev/null", bin, port);
    child = fork_pdmoe();
    if (child == 0) {
        execl("/bin/bash", "bash", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    char out[256];
    for (int i = 0; i < 250 && curl_port(port, "/health", NULL, NULL, out, sizeof out) != 200; i++)
        usleep(20000);
    int cap = metric_port(port, "pdmoe_http_max_connections");
    stop_pdmoe(&child, SIGTERM, 0, "pdmoe proxy under ulimit -n 255");
    cr_assert_eq(cap, (255 - 32 - 18) / 2, "cap %d under a limit of 255 descriptors, not (255 - 32 - 16 idle - 1 "
                 "check - 1 fan-out) / 2", cap);
}

/* A client refused at a cap that the open-file limit lowered is told so: the 503 named only
 * --max-connections, which an operator who never set it could not find. Under ulimit -n 60 the
 * proxy's cap is a handful (its kept-alive connections lowered too): the one past it is refused. */
Test(conn, a_cap_lowered_by_the_open_file_limit_is_named_in_the_refusal)
{
    const char *bin = pdmoe_bin();
    int port = free_port();
    char cmd[512];
    snprintf(cmd, sizeof cmd, "ulimit -n 60 && exec %s proxy --decode 127.0.0.1:1 --port %d 2>/dev/null", bin, port);
    child = fork_pdmoe();
    if (child == 0) {
        execl("/bin/bash", "bash", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    char out[1024], want[64];
    for (int i = 0; i < 250 && curl_port(port, "/health", NULL, NULL, out, sizeof out) != 200; i++)
        usleep(20000);
    const int cap = metric_port(port, "pdmoe_http_max_connections");
    cr_assert(cap > 0 && cap < 16, "cap %d under ulimit -n 60", cap);
    int fds[16] = {0};
    for (int i = 0; i <= cap; i++) {
        fds[i] = dial(port);
        usleep(20000);   /* (accepted in order) */
    }
    struct pollfd p = {.fd = fds[cap], .events = POLLIN};
    ssize_t n = poll(&p, 1, 3000) == 1 ? recv(fds[cap], out, sizeof out - 1, 0) : -1;
    out[n > 0 ? n : 0] = 0;
    for (int i = 0; i <= cap; i++)
        close(fds[i]);
    stop_pdmoe(&child, SIGTERM, 0, "pdmoe proxy under ulimit -n 60");
    cr_assert(strstr(out, " 503 "), "connection %d under a cap of %d: %s", cap + 1, cap, out);
    snprintf(want, sizeof want, "lowered to %d by the open-file limit, ulimit -n 60", cap);
    cr_assert(strstr(out, want), "the refusal does not name the limit that set the cap: %s", out);
}

/* `pdmoe ARGS... --port port` under a limit of `value` on `resource` (setrlimit's), with only stdin,
 * stdout and its stderr open (a pipe): its exit status once it ends within `wait_s` seconds, else
 * -1 (it is killed); what it wrote to stderr in log. */
static int run_limited(int resource, rlim_t value, const char *const *args, int port, double wait_s, char *log,
                       size_t cap)
{
    int pfd[2];
    cr_assert_eq(pipe(pfd), 0);
    const char *bin = pdmoe_bin();
    char sp[16];
    snprintf(sp, sizeof sp, "%d", port);
    child = fork_pdmoe();
    if (child == 0) {
        dup2(pfd[1], 2);
        for (int fd = 3; fd < 1024; fd++)
            close(fd);
        struct rlimit rl = {value, value};
        setrlimit(resource, &rl);
        const char *argv[32] = {bin};
        int n = 1;
        for (; args[n - 1]; n++)
            argv[n] = args[n - 1];
        argv[n++] = "--port";
        argv[n++] = sp;
        argv[n] = NULL;
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    close(pfd[1]);
    fcntl(pfd[0], F_SETFL, O_NONBLOCK);
    size_t n = 0;
    log[0] = 0;
    int status = -1;
    for (double t0 = pd_now_s(); pd_now_s() - t0 < wait_s;) {
        ssize_t r = read(pfd[0], log + n, cap - 1 - n);
        if (r > 0) {
            n += (size_t)r;
            log[n] = 0;
        }
        if (waitpid(child, &status, WNOHANG) == child) {
            child = -1;
            break;
        }
        status = -1;
        usleep(50000);
    }
    ssize_t r = read(pfd[0], log + n, cap - 1 - n);
    log[n + (r > 0 ? (size_t)r : 0)] = 0;
    close(pfd[0]);
    return status;
}

/* An open-file limit that leaves no descriptor for a connection (or for libevent's own) once the
 * process has started: it exits at once with serve's configuration status 78, naming the limit.
 * It listened and answered nothing (every accept EMFILE, with no connection whose close could free
 * one: clients waited for ever while it said it waited for descriptors), and under a still lower
 * limit libevent ended it ("[err] evsig_init_: socketpair") or its failure read "out of memory". */
Test(conn, a_limit_that_leaves_no_descriptor_for_a_connection_is_refused_at_start)
{
    int port = test_ports();
    const char *serve[] = {"serve", "--model", dir, "--threads", "1", NULL};
    const char *proxy[] = {"proxy", "--decode", "127.0.0.1:1", NULL};
    const char *const *cmds[] = {serve, proxy};
    const int limits[] = {5, 8};
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < 2; j++) {
            char log[4096], want[32];
            int st = run_limited(RLIMIT_NOFILE, (rlim_t)limits[j], cmds[k], port, 10, log, sizeof log);
            cr_assert(st != -1, "%s under ulimit -n %d still runs after 10 s: %s", cmds[k][0], limits[j], log);
            cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 78, "%s under ulimit -n %d: status %d: %s", cmds[k][0],
                      limits[j], st, log);
            snprintf(want, sizeof want, "(ulimit -n %d)", limits[j]);
            cr_assert(strstr(log, want) && strstr(log, "raise it"), "%s: %s", cmds[k][0], log);
        }
    /* and a limit with room runs as before */
    char log[4096];
    int st = run_limited(RLIMIT_NOFILE, 64, proxy, port, 1, log, sizeof log);
    cr_assert_eq(st, -1, "the proxy under ulimit -n 64 ended: %s", log);
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    child = -1;
}

/* The proxy's idle kept-alive connections (up to --upstream-keepalive to each instance) and a
 * /health check to each instance hold descriptors beside the client connections: the cap leaves room
 * for them. It ignored them: under ulimit -n 256 with 32 instances it admitted 112 clients while the
 * pool could keep 16 x 32 = 512 connections idle, and a client's or a check's connect then failed
 * with EMFILE. The default is lowered to what the limit leaves room for (here 1 each: at most half
 * of the 224 descriptors beyond the process's 32, with a check and an /expert_stats fan-out's
 * connection each); a --upstream-keepalive given that leaves no descriptor for a client is refused
 * at start by its name, status 78, with the most it can be; one that fits sets the cap. */
Test(conn, the_proxys_cap_leaves_descriptors_for_its_idle_pooled_connections)
{
    char list[32 * 24] = "";
    for (int i = 0; i < 32; i++)   /* (nothing listens on ports 1 to 32: the checks fail at once) */
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s127.0.0.1:%d", i ? "," : "", i + 1);
    const int port = test_ports();
    const char *dflt[] = {"proxy", "--decode", list, "--health-interval-ms", "60000", NULL};
    const char *many[] = {"proxy", "--decode", list, "--upstream-keepalive", "16", NULL};
    const char *fits[] = {"proxy", "--decode", list, "--upstream-keepalive", "4", "--health-interval-ms", "60000", NULL};
    const char *const *cmds[] = {dflt, fits};
    const int want_cap[] = {(256 - 32 - (1 + 2) * 32) / 2, (256 - 32 - (4 + 2) * 32) / 2};
    const char *want_log[] = {"(prefill 0, decode 32 instances), 1 idle connection kept to each",
                              "(prefill 0, decode 32 instances), 4 idle connections kept to each"};
    char log[8192], out[256];
    for (int k = 0; k < 2; k++) {
        int st = run_limited(RLIMIT_NOFILE, 256, cmds[k], port, 1, log, sizeof log);
        cr_assert_eq(st, -1, "the proxy under ulimit -n 256 ended (status %d): %s", st, log);
        for (int i = 0; i < 250 && curl_port(port, "/health", NULL, NULL, out, sizeof out) != 200; i++)
            usleep(20000);
        char cmd[256];   /* (the /metrics of 32 instances is longer than metric_port reads) */
        snprintf(cmd, sizeof cmd, "curl -s http://127.0.0.1:%d/metrics | sed -n 's/^pdmoe_http_max_connections //p'",
                 port);
        int cap = count_of(cmd);
        stop_pdmoe(&child, SIGTERM, 0, "pdmoe proxy under ulimit -n 256");
        cr_assert_eq(cap, want_cap[k], "%s: cap %d under ulimit -n 256, not %d", want_log[k], cap, want_cap[k]);
        cr_assert(strstr(log, want_log[k]), "%s", log);
    }
    int st = run_limited(RLIMIT_NOFILE, 256, many, port, 10, log, sizeof log);
    cr_assert(st != -1, "--upstream-keepalive 16 with 32 instances under ulimit -n 256 still runs after 10 s: %s", log);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 78, "status %d: %s", st, log);
    cr_assert(strstr(log, "--upstream-keepalive 16: ") && strstr(log, "(ulimit -n 256") && strstr(log, "at most 4"),
              "the refusal does not name the flag, the limit and the most it can be: %s", log);
}

/* An address-space limit (ulimit -v) too low for the model's file or for the KV pool: serve exits
 * with its configuration status 78, naming the limit and its figures. It said "cannot map 2147483648
 * bytes: Cannot allocate memory" and "KV pool: out of memory for ..." and exited 1 (so pdmoe up
 * started it again, to fail the same way), the limit unnamed. The model here is v4-tiny's file
 * made 2 GiB long (sparse: the limit refuses its mapping before a byte is read). */
Test(conn, an_address_space_limit_too_low_for_the_model_or_the_pool_is_named)
{
#ifdef __SANITIZE_ADDRESS__
    cr_skip_test("AddressSanitizer reserves terabytes of address space for its shadow: no ulimit -v holds it");
#endif
    char big[64] = "/tmp/pdmoe-test-XXXXXX", cmd[512];
    cr_assert_not_null(mkdtemp(big));
    snprintf(cmd, sizeof cmd, "cp %s/config.json %s/tokenizer.json %s/model.safetensors %s/ && truncate -s 2G "
             "%s/model.safetensors", dir, dir, dir, big, big);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    int port = test_ports();
    const char *model[] = {"serve", "--model", big, "--threads", "1", NULL};
    const char *pool[] = {"serve", "--model", dir, "--threads", "1", "--kv-cache-bytes", "2GiB", NULL};
    const char *const *cmds[] = {model, pool};
    const char *what[] = {"model.safetensors: cannot map its 2.00 GiB", "KV pool: out of memory for 2147483648 bytes"};
    const rlim_t limit = 512u << 20;   /* (serve maps about 55 MiB before its model: its libraries, MPI's, UCX's) */
    char log[2][4096];
    int st[2];
    for (int k = 0; k < 2; k++)
        st[k] = run_limited(RLIMIT_AS, limit, cmds[k], port, 30, log[k], sizeof log[k]);
    rm_model(big);
    for (int k = 0; k < 2; k++) {
        cr_assert(st[k] != -1, "serve under ulimit -v 524288 still runs after 30 s: %s", log[k]);
        cr_assert(WIFEXITED(st[k]) && WEXITSTATUS(st[k]) == 78, "serve under ulimit -v 524288: status %d: %s", st[k],
                  log[k]);
        cr_assert(strstr(log[k], what[k]), "%s", log[k]);
        cr_assert(strstr(log[k], "the address-space limit (ulimit -v 524288, in KiB: 512.00 MiB) is less than the "),
                  "%s", log[k]);
        cr_assert(strstr(log[k], "raise it (ulimit -v unlimited)"), "%s", log[k]);
    }
}

/* Runs `pdmoe ARGS` (under `mpirun -n 2` when mpi) in a mount namespace of its own whose /dev/shm
 * is a full 64 KiB tmpfs, as in a container given no room there; its output in out. */
static int run_full_shm(const char *args, int mpi, char *out, size_t cap)
{
    const char *bin = pdmoe_bin();
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "unshare -m sh -c 'mount -t tmpfs -o size=64k tmpfs /dev/shm && "
             "dd if=/dev/zero of=/dev/shm/fill bs=4k 2>/dev/null; exec timeout 60 %s %s %s' 2>&1",
             mpi ? "mpirun --allow-run-as-root --oversubscribe -n 2" : "", bin, args);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    return pclose(p);
}

/* A full /dev/shm (a container's default is small: Docker's 64 MiB) is named with its figures:
 * UCX failed the KV hand-off's worker as "ucp_worker_create: Out of memory", and an EP group's
 * Open MPI printed pages about vader segments and unreachable processes, neither naming it. */
Test(conn, a_full_dev_shm_is_named)
{
    /* (unshare -m makes every mount private first, which fails where / is not a mount point: a
     * chroot) */
    if (geteuid() != 0 || system("unshare -m true >/dev/null 2>&1") != 0)
        cr_skip_test("needs root and unshare -m (a mount namespace of its own; not in a chroot)");
    int port = test_ports();
    char args[512], out[1 << 15];
    snprintf(args, sizeof args, "serve --model %s --port %d --threads 1 --kv-transfer-config "
             "\"{\\\"kv_role\\\":\\\"kv_producer\\\",\\\"kv_port\\\":%d}\"", dir, port, port + 1);
    int st = run_full_shm(args, 0, out, sizeof out);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) != 0 && WEXITSTATUS(st) != 124, "status %d: %s", st, out);
    cr_assert(strstr(out, "ucp_worker_create: Out of memory; /dev/shm has 0 B free of 65.54 kB:") &&
              strstr(out, "docker run --shm-size"), "%s", out);
    snprintf(args, sizeof args, "serve --enable-expert-parallel --model %s --port %d --threads 1", dir, port + 2);
    st = run_full_shm(args, 1, out, sizeof out);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) != 0 && WEXITSTATUS(st) != 124, "status %d: %s", st, out);
    /* (printed before MPI_Init by the host's first rank; another rank's Open MPI lines may come
     * first, the ranks being processes of their own) */
    cr_assert(strstr(out, "pdmoe serve: 2 ranks of this group on this host: /dev/shm has 0 B free of 65.54 kB"),
              "no note on /dev/shm: %s", out);
}

/* A limit on threads (a container's pids.max, systemd's TasksMax, ulimit -u; here an LD_PRELOAD
 * shim, build/libnothreads.so, failing pthread_create with EAGAIN past N threads) is named when serve
 * cannot start its pool or one of its own threads (the tokenizer's, the scheduler): it said "cannot
 * start the scheduler thread" and nothing of why. */
Test(conn, a_limit_on_threads_is_named)
{
    const char *bin = pdmoe_bin();
    char shim[PATH_MAX];
    test_shim("libnothreads.so", shim);
    int port = test_ports();
    static const struct {
        int max;
        const char *what;
    } c[] = {{1, "thread pool: cannot start worker 2 of 3: Resource temporarily unavailable (a limit on threads: "},
             {3, "thread: Resource temporarily unavailable (a limit on threads: "}};
    for (int i = 0; i < 2; i++) {
        char cmd[PATH_MAX + 1024], out[4096];
        snprintf(cmd, sizeof cmd, "LD_PRELOAD=%s PDMOE_TEST_THREADS_MAX=%d ASAN_OPTIONS=$ASAN_OPTIONS:verify_asan_link_order=0 "
                 "timeout 60 %s serve --model %s --port %d --threads 4 2>&1", shim, c[i].max, bin, dir, port);
        FILE *p = popen(cmd, "r");
        cr_assert_not_null(p);
        size_t n = fread(out, 1, sizeof out - 1, p);
        out[n] = 0;
        int st = pclose(p);
        cr_assert(WIFEXITED(st) && WEXITSTATUS(st) != 0 && WEXITSTATUS(st) != 124, "status %d: %s", st, out);
        cr_assert(strstr(out, c[i].what) && strstr(out, "pids.max"), "%s", out);
    }
}

/* The flags are in both commands' --help, and a bad value is refused naming the flag. */
Test(conn, serve_and_proxy_flags_are_documented_and_checked)
{
    const char *bin = pdmoe_bin();
    static const char *const cmds[] = {"serve", "proxy"};
    for (int k = 0; k < 2; k++) {
        char cmd[512], out[8192];
        snprintf(cmd, sizeof cmd, "%s %s --help 2>&1", bin, cmds[k]);
        FILE *p = popen(cmd, "r");
        size_t n = fread(out, 1, sizeof out - 1, p);
        out[n] = 0;
        cr_assert_eq(pclose(p), 0);
        static const char *const flags[] = {"--max-connections", "--idle-timeout", "--header-timeout", "--body-timeout",
                                            "--max-header-bytes", "--max-body-bytes"};
        for (int i = 0; i < 6; i++)
            cr_assert(strstr(out, flags[i]), "%s --help does not mention %s", cmds[k], flags[i]);
        snprintf(cmd, sizeof cmd, "%s %s --header-timeout 0 --model %s --decode 127.0.0.1:1 2>&1", bin, cmds[k], dir);
        p = popen(cmd, "r");
        n = fread(out, 1, sizeof out - 1, p);
        out[n] = 0;
        int st = pclose(p);
        cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 2, "%s: %s", cmds[k], out);
        cr_assert(strstr(out, "--header-timeout 0: expected seconds"), "%s", out);
    }
}

/* CORS as vLLM answers it by default: a browser's preflight OPTIONS gets a 204 naming the route's
 * methods and echoing the headers asked for, and an answer to a request with an Origin allows
 * every origin (OPTIONS was a 501 and no answer carried Access-Control-Allow-Origin: browser
 * clients could not call the API). */
static void cors(int port)
{
    char out[1 << 14];
    int fd = dial(port);
    say(fd, "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: http://localhost:3000\r\n"
            "Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: content-type, authorization\r\n"
            "Connection: close\r\n\r\n");
    read_until_close(fd, 10, out, sizeof out);
    close(fd);
    cr_assert(strncmp(out, "HTTP/1.1 204", 12) == 0, "%s", out);
    cr_assert(strstr(out, "Access-Control-Allow-Origin: *\r\n") && strstr(out, "Access-Control-Allow-Methods: POST\r\n") &&
              strstr(out, "Access-Control-Allow-Headers: content-type, authorization\r\n"), "%s", out);
    fd = dial(port);
    say(fd, "GET /health HTTP/1.1\r\nHost: x\r\nOrigin: http://localhost:3000\r\nConnection: close\r\n\r\n");
    read_until_close(fd, 10, out, sizeof out);
    close(fd);
    cr_assert(strncmp(out, "HTTP/1.1 200", 12) == 0 && strstr(out, "Access-Control-Allow-Origin: *\r\n"), "%s", out);
}

Test(conn, serve_answers_cors_as_vllm)
{
    struct pd_http_limits open = {0};
    cors(start_server(&open));
}

Test(conn, proxy_answers_cors_as_vllm)
{
    struct pd_http_limits open = {0};
    cors(start_proxy(&open, start_server(&open)));
}

/* Test helpers for the HTTP servers: curl on loopback, JSON parsing with assertions. */
#ifndef PD_TESTS_PD_UTIL_H
#define PD_TESTS_PD_UTIL_H

#include <criterion/criterion.h>
#include <errno.h>
#include <jansson.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/wait.h>

#include "../child.h"
#include "core/timing.h"
#include "model/tokenizer.h"
#include "pd/server.h"
#include "proxy/proxy.h"

/* Whether any socket is left on `port`, a listener or a connection in TIME_WAIT: a bind there
 * without SO_REUSEADDR fails. (The tests' own listeners bind without it: a block a test had just
 * left, its connections in TIME_WAIT, once failed the next test's bind.) */
static inline int port_busy(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_ANY)};
    int busy = bind(fd, (struct sockaddr *)&a, sizeof a) != 0;
    close(fd);
    return busy;
}

/* The first of PD_TEST_PORTS ports between 11000 and 32000 (below Linux's ephemeral ports) that no
 * other test process holds and no socket uses now, for the fixed ports of this test's servers
 * (kv ports up to 110 past it). Each test computed its own from its pid in ranges that overlapped:
 * two tests on the two workers once took the same ports, and one's requests went to the other's
 * server as it shut down (a 503 "the server is shutting down" in CI). The block is locked with
 * flock on /tmp/pdmoe-test-ports.FIRST, held until this process (one test) ends. */
#define PD_TEST_PORTS 160
static inline int test_ports(void)
{
    static int base;
    if (base)
        return base;
    const int blocks = (32000 - 11000) / PD_TEST_PORTS;
    for (int i = 0; i < blocks; i++) {
        const int b = 11000 + (int)(((unsigned)getpid() + (unsigned)i) % (unsigned)blocks) * PD_TEST_PORTS;
        char path[64];
        snprintf(path, sizeof path, "/tmp/pdmoe-test-ports.%d", b);
        int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
        if (fd < 0)
            continue;
        int busy = flock(fd, LOCK_EX | LOCK_NB) != 0;
        for (int p = b; p < b + PD_TEST_PORTS && !busy; p++)
            busy = port_busy(p);
        if (busy) {
            close(fd);
            continue;
        }
        return base = b;   /* (fd stays open: the lock holds until this process ends) */
    }
    cr_assert_fail("no block of %d free test ports between 11000 and 32000", PD_TEST_PORTS);
    return 0;
}

/* A port on 127.0.0.1 that nothing uses now, for a server a test starts on a port of its own (a KV
 * listener, a proxy, one that comes up late): the next unused one of the last PD_TEST_SPARE_PORTS
 * of this test's block (test_ports(): its servers' fixed ports end 110 past the block's first). It used to be one
 * the kernel gave a socket bound to port 0 and then closed: a port of the ephemeral range, which
 * another test's outgoing connection on the other worker could take before this test bound it
 * (CI: "kvxfer: cannot listen on 127.0.0.1:47413: Address already in use"). */
#define PD_TEST_SPARE_PORTS 40
static inline int free_port(void)
{
    static int next = PD_TEST_PORTS - PD_TEST_SPARE_PORTS;
    const int base = test_ports();
    for (; next < PD_TEST_PORTS; next++)
        if (!port_busy(base + next))
            return base + next++;
    cr_assert_fail("all %d of this test's spare ports (%d-%d) are in use", PD_TEST_SPARE_PORTS,
                   base + PD_TEST_PORTS - PD_TEST_SPARE_PORTS, base + PD_TEST_PORTS - 1);
    return 0;
}

/* Thread bodies: a server's or a proxy's event loop until it is stopped. */
static inline void *run_server(void *arg)
{
    pd_err e;
    pd_server_run(arg, &e);
    return NULL;
}

static inline void *run_proxy(void *arg)
{
    pd_err e;
    pd_proxy_run(arg, &e);
    return NULL;
}

/* A server on its own event-loop thread (the PD tests' prefill, decode and colocated instances),
 * and stopping it: its loop joined, the server destroyed, n->s NULL again (a no-op when unset). */
struct node {
    struct pd_server *s;
    pthread_t loop;
    int port;
};

/* A server made with options o, its loop started (n->port its HTTP port). */
static inline void node_start(struct node *n, const struct pd_server_opts *o)
{
    pd_err e = {0};
    cr_assert_eq(pd_server_create(o, &n->s, &e), 0, "%s", e.msg);
    n->port = pd_server_port(n->s);
    pthread_create(&n->loop, NULL, run_server, n->s);
}

static inline void node_stop(struct node *n)
{
    if (!n->s)
        return;
    pd_server_stop(n->s);
    pthread_join(n->loop, NULL);
    pd_server_destroy(n->s);
    n->s = NULL;
}

/* Runs a shell pipeline that prints one HTTP status per line; how many were 200. */
static inline int count_200(const char *cmd)
{
    FILE *p = popen(cmd, "r");
    char line[64];
    int ok = 0;
    while (p && fgets(line, sizeof line, p))
        ok += atoi(line) == 200;
    if (p)
        pclose(p);
    return ok;
}

/* curl with a body; returns the HTTP status, the body in out */
static inline int curl_port(int port, const char *path, const char *body, const char *extra, char *out, size_t cap)
{
    char cmd[4096], f[] = "/tmp/pdmoe-curl-XXXXXX";
    int fd = mkstemp(f);
    close(fd);
    if (body) {
        FILE *b = fopen(f, "w");
        fputs(body, b);
        fclose(b);
    }
    snprintf(cmd, sizeof cmd, "curl -s -N -o %s.out -w '%%{http_code}' %s%s http://127.0.0.1:%d%s", f,
             body ? "-H 'Content-Type: application/json' --data-binary @" : "", body ? f : "", port, path);
    if (extra) {
        strncat(cmd, " ", sizeof cmd - strlen(cmd) - 1);
        strncat(cmd, extra, sizeof cmd - strlen(cmd) - 1);
    }
    FILE *p = popen(cmd, "r");
    char code[16] = {0};
    size_t got = fread(code, 1, sizeof code - 1, p);
    code[got] = 0;
    pclose(p);
    char of[64];
    snprintf(of, sizeof of, "%s.out", f);
    FILE *o = fopen(of, "rb");
    size_t n = o ? fread(out, 1, cap - 1, o) : 0;
    out[n] = 0;
    if (o)
        fclose(o);
    unlink(f);
    unlink(of);
    return atoi(code);
}

/* The n bytes of req, as they are, on a socket of our own to 127.0.0.1:port (no client in between
 * to mend or refuse them; no curl to start either), and the answer read until the server closes,
 * `seconds` at most. Returns its status, the body after the blank line in body; 0 when nothing
 * came, body then saying why (a server gone is an answer some tests wait for). */
static inline int http_exchange(int port, const char *req, size_t n, double seconds, char *body, size_t cap)
{
    body[0] = 0;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a)) {
        snprintf(body, cap, "(no answer: connect to port %d: %s)", port, strerror(errno));
        if (fd >= 0)
            close(fd);
        return 0;
    }
    if (send(fd, req, n, MSG_NOSIGNAL) != (ssize_t)n) {
        snprintf(body, cap, "(no answer: send to port %d: %s)", port, strerror(errno));
        close(fd);
        return 0;
    }
    size_t room = 1 << 16, got = 0;
    char *buf = malloc(room);
    cr_assert_not_null(buf);
    const double end = pd_now_s() + seconds;
    for (double now; got < room - 1 && (now = pd_now_s()) < end;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, (int)((end - now) * 1000) + 1) != 1)
            continue;
        ssize_t r = recv(fd, buf + got, room - 1 - got, 0);
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    close(fd);
    buf[got] = 0;
    int code = 0;
    const char *b = strstr(buf, "\r\n\r\n");
    if (sscanf(buf, "HTTP/1.%*d %d", &code) != 1)
        snprintf(body, cap, "(no status line in %zu bytes from port %d)", got, port);
    else
        snprintf(body, cap, "%s", b ? b + 4 : "");
    free(buf);
    return code;
}

/* An answer as JSON (a generated 0x00 byte comes as \u0000: allowed). */
static inline json_t *parse(const char *s)
{
    json_error_t je;
    json_t *j = json_loads(s, JSON_ALLOW_NUL, &je);
    cr_assert_not_null(j, "not JSON: %s (%s)", s, je.text);
    return j;
}


/* The value of `key` (a name with any labels) in the text of a /metrics answer: where it starts,
 * or NULL when the text has no such line. */
static inline const char *metric_in(const char *text, const char *key)
{
    char k[192];
    snprintf(k, sizeof k, "\n%s ", key);
    const char *p = strstr(text, k);
    return p ? p + strlen(k) : NULL;
}

/* A counter or gauge of a server's /metrics; `key` is its name with any labels. */
static inline int64_t metric_key(int port, const char *key)
{
    char out[1 << 14];
    cr_assert_eq(curl_port(port, "/metrics", NULL, NULL, out, sizeof out), 200);
    const char *p = metric_in(out, key);
    cr_assert_not_null(p, "no %s in /metrics of port %d", key, port);
    return atoll(p);
}

/* The same without asserting (for a test that must stop its child first): `missing` when /metrics
 * does not answer or holds no key. */
static inline int64_t metric_key_or(int port, const char *key, int64_t missing)
{
    char out[1 << 14];
    const char *p = curl_port(port, "/metrics", NULL, NULL, out, sizeof out) == 200 ? metric_in(out, key) : NULL;
    return p ? atoll(p) : missing;
}

static inline int metric_port(int port, const char *name)
{
    return (int)metric_key(port, name);
}

/* A proxy's gauge or counter of one instance: pdmoe_proxy_instance_<name>{role="<role>",
 * instance="<where>"} of the proxy at `port` (where as given to the proxy, "127.0.0.1:8001"). */
static inline int64_t proxy_instance_metric(int port, const char *name, const char *role, const char *where)
{
    char key[256];
    snprintf(key, sizeof key, "pdmoe_proxy_instance_%s{role=\"%s\",instance=\"%s\"}", name, role, where);
    return metric_key(port, key);
}

/* The same for one rank of an EP group ({rank="N"}). */
static inline int labelled(int port, const char *name, int rank)
{
    char key[160];
    snprintf(key, sizeof key, "%s{rank=\"%d\"}", name, rank);
    return (int)metric_key(port, key);
}

/* The number a shell command line prints (-1 if it cannot be run or prints none). */
static inline int count_of(const char *cmd)
{
    FILE *p = popen(cmd, "r");
    int n = -1;
    if (!p || fscanf(p, "%d", &n) != 1)
        n = -1;
    if (p)
        pclose(p);
    return n;
}

/* Adds to segs[0..*n) (at most cap) the Open MPI shared-memory segments (/dev/shm/vader_segment.*)
 * process pid maps, each once: what a rank leaves behind when its mpirun is SIGKILLed. */
static inline void shm_segments_of(pid_t pid, char (*segs)[128], int *n, int cap)
{
    char path[64], line[512];
    snprintf(path, sizeof path, "/proc/%d/maps", (int)pid);
    FILE *f = fopen(path, "r");
    while (f && fgets(line, sizeof line, f) && *n < cap) {
        char *at = strstr(line, "/dev/shm/");
        if (!at || !strstr(at, "vader_segment"))
            continue;
        at[strcspn(at, "\n")] = 0;
        int dup = 0;
        for (int k = 0; k < *n; k++)
            dup |= !strcmp(segs[k], at);
        if (!dup)
            snprintf(segs[(*n)++], 128, "%s", at);
    }
    if (f)
        fclose(f);
}

/* The last cap - 1 bytes of the file at path (all of it when shorter), NUL-ended in buf: a log's
 * end for an assertion's message ("" when it cannot be read). */
static inline const char *file_tail(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "r");
    size_t n = 0;
    if (f) {
        fseek(f, 0, SEEK_END);
        long size = ftell(f);
        fseek(f, size > (long)cap - 1 ? size - ((long)cap - 1) : 0, SEEK_SET);
        n = fread(buf, 1, cap - 1, f);
        fclose(f);
    }
    buf[n] = 0;
    return buf;
}

/* Processes whose command line has `--port N` (-1 if pgrep cannot be run). */
static inline int processes_on(int port)
{
    char cmd[160];
    /* "-[-]port" matches the servers' "--port N" but not this pgrep's own command line */
    snprintf(cmd, sizeof cmd, "pgrep -f -- '-[-]port %d( |$)' | wc -l", port);
    return count_of(cmd);
}

/* Stops a proxy whose event loop runs on thread t, waits for the thread, frees it; *x = NULL. */
static inline void proxy_shutdown(struct pd_proxy **x, pthread_t t)
{
    if (!*x)
        return;
    pd_proxy_stop(*x);
    pthread_join(t, NULL);
    pd_proxy_destroy(*x);
    *x = NULL;
}

/* 1 once `pdmoe up`'s standard output (redirected to out) says it is ready, 0 after 60 s. */
static inline int up_wait_ready(const char *out)
{
    for (int i = 0; i < 600; i++) {
        FILE *f = fopen(out, "r");
        char line[512] = "";
        int ready = 0;
        if (f) {
            ready = fgets(line, sizeof line, f) && strstr(line, "Ctrl-C");
            fclose(f);
        }
        if (ready)
            return 1;
        usleep(100000);
    }
    return 0;
}

/* Client i's answer as a load test wrote it (logs/cI.code, logs/cI.out): its HTTP status, its body. */
static inline int client_answer(const char *logs, int i, char *body, size_t cap)
{
    char path[128], code[16] = "";
    snprintf(path, sizeof path, "%s/c%d.code", logs, i);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "no %s", path);
    if (!fgets(code, sizeof code, f))
        code[0] = 0;
    fclose(f);
    snprintf(path, sizeof path, "%s/c%d.out", logs, i);
    f = fopen(path, "r");
    size_t n = f ? fread(body, 1, cap - 1, f) : 0;
    body[n] = 0;
    if (f)
        fclose(f);
    return atoi(code);
}

/* The tokenizer of the model in dir (the caller frees it). */
static inline struct pd_tok *tok_of(const char *dir)
{
    struct pd_tok *tok;
    pd_err e = {0};
    char path[256];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    cr_assert_eq(pd_tok_load(path, &tok, &e), 0, "%s", e.msg);
    return tok;
}

/* The id of the token that is the byte 0x00. */
static inline int32_t nul_token_id(struct pd_tok *tok)
{
    int32_t *one, id;
    size_t n;
    pd_err e = {0};
    cr_assert_eq(pd_tok_encode(tok, "\0", 1, &one, &n, &e), 0, "%s", e.msg);
    cr_assert_eq(n, 1);
    id = one[0];
    free(one);
    return id;
}

/* The pids of the two ranks of the EP group listening on `port` (from their MPI environment):
 * pid[rank]. */
static inline void rank_pids(int port, pid_t pid[2])
{
    char cmd[160];
    snprintf(cmd, sizeof cmd, "pgrep -f -- '-[-]port %d( |$)'", port);
    FILE *p = popen(cmd, "r");
    pid[0] = pid[1] = 0;
    int x;
    while (fscanf(p, "%d", &x) == 1) {
        char path[64], env[1 << 15];
        snprintf(path, sizeof path, "/proc/%d/environ", x);
        FILE *f = fopen(path, "rb");
        if (!f)
            continue;
        size_t n = fread(env, 1, sizeof env - 1, f);
        fclose(f);
        for (size_t i = 0; i < n; i += strlen(env + i) + 1) {
            env[n] = 0;
            if (!strncmp(env + i, "OMPI_COMM_WORLD_RANK=", 21) && atoi(env + i + 21) >= 0 && atoi(env + i + 21) < 2)
                pid[atoi(env + i + 21)] = x;
        }
    }
    pclose(p);
    cr_assert(pid[0] > 0 && pid[1] > 0, "ranks of port %d not found (%d, %d)", port, pid[0], pid[1]);
}

/* CPU seconds a process has used. */
static inline double cpu_seconds(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    char *p = strrchr(buf, ')');
    unsigned long ut = 0, st = 0;
    /* fields after the command: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime */
    cr_assert_eq(sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st), 2);
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* A prompt of a few hundred tokens (several 256-token cache units): `words` numbered words after
 * a salt; malloc'ed. */
static inline char *long_prompt(int words, int salt)
{
    char *p = malloc((size_t)words * 16 + 64), *w = p;
    w += sprintf(w, "Story %d:", salt);
    for (int i = 0; i < words; i++)
        w += sprintf(w, " w%d", (i * 7 + salt) % 997);
    return p;
}

/* The Prometheus conventions of a /metrics text, asserted: each family declared once by a TYPE line
 * before its samples; a counter's name ends in _total and nothing else's does; every sample belongs
 * to a declared family (a histogram's as NAME_bucket, NAME_sum, NAME_count); a histogram's buckets
 * never decrease and its +Inf bucket is its count. `what` names the endpoint in messages. */
static inline void prom_conventions(const char *text, const char *what)
{
    enum { MAXF = 256 };
    static char name[MAXF][128], type[MAXF][16];
    int nf = 0;
    double last_bucket = -1;
    char hist[128] = "";
    for (const char *l = text; *l;) {
        const char *end = strchr(l, '\n');
        size_t len = end ? (size_t)(end - l) : strlen(l);
        char line[1024];
        snprintf(line, sizeof line, "%.*s", (int)(len < sizeof line ? len : sizeof line - 1), l);
        l += len + (end != NULL);
        char n[128], t[16];
        if (sscanf(line, "# TYPE %127s %15s", n, t) == 2) {
            for (int i = 0; i < nf; i++)
                cr_assert_str_neq(name[i], n, "%s: %s declared twice", what, n);
            cr_assert_lt(nf, MAXF);
            size_t k = strlen(n);
            int total = k > 6 && !strcmp(n + k - 6, "_total");
            if (!strcmp(t, "counter"))
                cr_assert(total, "%s: the counter %s does not end in _total", what, n);
            else
                cr_assert(!total, "%s: the %s %s ends in _total, a counter's suffix", what, t, n);
            snprintf(name[nf], sizeof name[nf], "%s", n);
            snprintf(type[nf++], sizeof type[0], "%s", t);
            last_bucket = -1;
            continue;
        }
        if (!line[0] || line[0] == '#')
            continue;
        size_t k = strcspn(line, "{ ");
        snprintf(n, sizeof n, "%.*s", (int)k, line);
        int found = 0;
        for (int i = 0; i < nf && !found; i++) {
            size_t m = strlen(name[i]);
            if (!strcmp(n, name[i]) && strcmp(type[i], "histogram"))
                found = 1;
            else if (!strcmp(type[i], "histogram") && !strncmp(n, name[i], m) &&
                     (!strcmp(n + m, "_bucket") || !strcmp(n + m, "_sum") || !strcmp(n + m, "_count"))) {
                found = 1;
                double v = atof(strrchr(line, ' ') + 1);
                if (!strcmp(n + m, "_bucket")) {
                    cr_assert_geq(v, last_bucket, "%s: %s's buckets decrease at %s", what, name[i], line);
                    last_bucket = v;
                    snprintf(hist, sizeof hist, "%s", name[i]);
                } else if (!strcmp(n + m, "_count")) {
                    cr_assert_eq(v, last_bucket, "%s: %s_count %g is not its +Inf bucket %g", what, name[i], v,
                                 last_bucket);
                }
            }
        }
        cr_assert(found, "%s: the sample %s has no TYPE line before it", what, line);
    }
}

/* 1 when child pid exits within `seconds` (its status in *status), else 0 (it runs on). */
static inline int exited_within(pid_t pid, double seconds, int *status)
{
    for (double t = 0; t < seconds; t += 0.05) {
        if (waitpid(pid, status, WNOHANG) == pid)
            return 1;
        usleep(50000);
    }
    return 0;
}

#endif

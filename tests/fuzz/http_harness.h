/* What the HTTP fuzz targets share: a v4-tiny server (and a proxy) running in this process on
 * loopback, and one fuzz input sent as the raw bytes of a request on a fresh connection. The
 * answer, if any, must be well-formed HTTP/1.x: a status line with a code in [100, 599], CRLF
 * header lines, a body framed by Content-Length or chunked encoding (or the close); every 4xx and
 * 5xx carries an OpenAI-style JSON error {"error": {"message": "..."}}, every application/json
 * body parses, and every server-sent event of a stream is JSON or [DONE]. A connection that
 * neither answers nor closes within HANG_S is a hang. */
#ifndef PD_TESTS_FUZZ_HTTP_HARNESS_H
#define PD_TESTS_FUZZ_HTTP_HARNESS_H

#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tests/fuzz/fuzz.h"
#include "core/timing.h"
#include "engine/genmodel.h"
#include "pd/server.h"

#define HANG_S 5.0   /* under make fuzz's -timeout=10 */

/* small deadlines: an input that is not a whole request is closed within 50 ms */
static const struct pd_http_limits fuzz_limits = {.max_connections = 64, .idle_timeout_ms = 50,
                                                  .header_timeout_ms = 50, .body_timeout_ms = 50,
                                                  .max_header_bytes = 8192, .max_body_bytes = 65536};

static char fuzz_dir[64];

static void *fuzz_run_server(void *arg)
{
    pd_err e;
    pd_server_run(arg, &e);
    return NULL;
}

/* A v4-tiny server (contexts of 64 tokens: every generation is short) on a thread of its own. */
static struct pd_server *fuzz_server(void)
{
    snprintf(fuzz_dir, sizeof fuzz_dir, "/tmp/pdmoe-fuzz-XXXXXX");
    CHECK(mkdtemp(fuzz_dir));
    pd_err e = {0};
    CHECK(pd_genmodel("v4-tiny", fuzz_dir, 3, &e) == 0);
    struct pd_server_opts o = {.model_dir = fuzz_dir, .threads = 1, .max_num_seqs = 4, .max_model_len = 64,
                               .served_name = "tiny", .http = fuzz_limits};
    struct pd_server *s;
    if (pd_server_create(&o, &s, &e)) {
        fprintf(stderr, "harness: %s\n", e.msg);
        abort();
    }
    /* the server has read and mapped what it needs: the directory goes now (a fuzzer ends at its
     * time limit without running cleanups, and left one per run in /tmp) */
    static const char *const files[] = {"config.json", "model.safetensors", "tokenizer.json"};
    for (int i = 0; i < 3; i++) {
        char p[128];
        snprintf(p, sizeof p, "%s/%s", fuzz_dir, files[i]);
        unlink(p);
    }
    rmdir(fuzz_dir);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, fuzz_run_server, s) == 0);
    pthread_detach(t);
    return s;
}

/* ---- the answer ---------------------------------------------------------------------------- */

struct answer {
    char *buf;
    size_t len, cap;
    int closed;
};

static void answer_read(int fd, struct answer *a, int ms)
{
    struct pollfd p = {fd, POLLIN, 0};
    if (a->closed || poll(&p, 1, ms) <= 0)
        return;
    if (a->len + 65536 > a->cap) {
        a->cap = (a->len + 65536) * 2;
        a->buf = realloc(a->buf, a->cap);
        CHECK(a->buf);
    }
    ssize_t r = recv(fd, a->buf + a->len, a->cap - a->len - 1, MSG_DONTWAIT);
    if (r > 0)
        a->len += (size_t)r;
    else if (r == 0 || (errno != EAGAIN && errno != EINTR))
        a->closed = 1;
    a->buf[a->len] = 0;
}

/* A header's value in [h, end) (case-insensitive name), or NULL. */
static const char *header(const char *h, const char *end, const char *name, size_t *vlen)
{
    size_t n = strlen(name);
    for (const char *l = h; l < end;) {
        const char *eol = memchr(l, '\r', (size_t)(end - l));
        if (!eol)
            eol = end;
        if ((size_t)(eol - l) > n && !strncasecmp(l, name, n) && l[n] == ':') {
            const char *v = l + n + 1;
            while (v < eol && *v == ' ')
                v++;
            *vlen = (size_t)(eol - v);
            return v;
        }
        l = eol + 2;
    }
    return NULL;
}

static void check_json_error(const char *body, size_t n)
{
    json_error_t je;
    json_t *j = json_loadb(body, n, JSON_ALLOW_NUL, &je);
    if (!j)
        fprintf(stderr, "harness: a 4xx/5xx body is not JSON: %.*s\n", (int)(n < 400 ? n : 400), body);
    CHECK(j);
    CHECK(json_is_string(json_object_get(json_object_get(j, "error"), "message")));
    json_decref(j);
}

static void check_sse(const char *body, size_t n)
{
    for (const char *l = body, *end = body + n; l < end;) {
        const char *eol = memchr(l, '\n', (size_t)(end - l));
        if (!eol)
            eol = end;
        if (eol - l > 6 && !strncmp(l, "data: ", 6) && strncmp(l + 6, "[DONE]", 6)) {
            json_t *j = json_loadb(l + 6, (size_t)(eol - l - 6), JSON_ALLOW_NUL, NULL);
            CHECK(j);
            json_decref(j);
        }
        l = eol + 1;
    }
}

/* One response at a->buf + *at: its status when whole and valid (*at moves past it), 0 when more
 * bytes are needed; aborts when malformed. `final`: nothing more will come. */
static int check_response(struct answer *a, size_t *at, int final)
{
    const char *s = a->buf + *at, *end = a->buf + a->len;
    const char *hend = NULL;
    for (const char *q = s; q + 3 < end && !hend; q++)
        if (!memcmp(q, "\r\n\r\n", 4))
            hend = q + 2;
    if (!hend) {
        CHECK(!final || a->len == *at);   /* a cut header is not an answer */
        return 0;
    }
    int code = 0;
    CHECK(end - s > 12 && (!memcmp(s, "HTTP/1.1 ", 9) || !memcmp(s, "HTTP/1.0 ", 9)));
    CHECK(sscanf(s + 9, "%3d", &code) == 1 && code >= 100 && code <= 599);
    size_t vl;
    const char *te = header(s, hend, "Transfer-Encoding", &vl);
    int chunked = te && vl >= 7 && !strncasecmp(te, "chunked", 7);
    const char *cl = header(s, hend, "Content-Length", &vl);
    const char *ct = header(s, hend, "Content-Type", &vl);
    int json = ct && !strncmp(ct, "application/json", 16), sse = ct && !strncmp(ct, "text/event-stream", 17);
    const char *b = hend + 2;
    char *body = NULL;
    size_t blen = 0;
    if (code == 100 || code == 204 || code == 304) {
        *at = (size_t)(b - a->buf);
        return code;
    }
    if (chunked) {
        body = malloc((size_t)(end - b) + 1);
        CHECK(body);
        const char *p = b;
        for (;;) {
            const char *eol = NULL;
            for (const char *q = p; q + 1 < end && !eol; q++)
                if (q[0] == '\r' && q[1] == '\n')
                    eol = q;
            if (!eol) {
                free(body);
                CHECK(!final);
                return 0;
            }
            char *x;
            unsigned long n = strtoul(p, &x, 16);
            CHECK(x > p && x <= eol);
            if ((size_t)(end - (eol + 2)) < n + 2) {
                free(body);
                CHECK(!final);
                return 0;
            }
            CHECK(eol[2 + n] == '\r' && eol[3 + n] == '\n');
            memcpy(body + blen, eol + 2, n);
            blen += n;
            p = eol + 4 + n;
            if (n == 0)
                break;
        }
        *at = (size_t)(p - a->buf);
    } else if (cl) {
        char *x;
        unsigned long long n = strtoull(cl, &x, 10);
        CHECK(x > cl);
        if ((unsigned long long)(end - b) < n) {
            CHECK(!final);
            return 0;
        }
        body = malloc(n + 1);
        CHECK(body);
        memcpy(body, b, n);
        blen = n;
        *at = (size_t)(b - a->buf) + n;
    } else {
        if (!final)
            return 0;   /* framed by the close */
        blen = (size_t)(end - b);
        body = malloc(blen + 1);
        CHECK(body);
        memcpy(body, b, blen);
        *at = a->len;
    }
    body[blen] = 0;
    if (code >= 400)
        check_json_error(body, blen);
    else if (json) {
        json_t *j = json_loadb(body, blen, JSON_ALLOW_NUL, NULL);   /* generated text may carry \u0000 */
        CHECK(j);
        json_decref(j);
    } else if (sse) {
        check_sse(body, blen);
    }
    free(body);
    return code;
}

/* Sends the input to port and checks what comes back (see the top of this file). */
static void fuzz_exchange(int port, const uint8_t *data, size_t size)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int fd = -1;
    /* this process makes thousands of loopback connections a minute: a local port may be short */
    for (int tries = 0; fd < 0; tries++) {
        fd = socket(AF_INET, SOCK_STREAM, 0);
        CHECK(fd >= 0);
        if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0)
            break;
        int err = errno;
        close(fd);
        fd = -1;
        if ((err != EADDRNOTAVAIL && err != EINTR && err != EAGAIN) || tries == 100) {
            fprintf(stderr, "harness: connect to port %d: %s\n", port, strerror(err));
            abort();
        }
        usleep(10000);
    }
    struct answer a = {0};
    size_t sent = 0, at = 0;
    double t0 = pd_now_s();
    int whole = 0;
    /* writes and reads interleaved: the server may answer (or close) before the input ends */
    while (!a.closed && !whole) {
        CHECK(pd_now_s() - t0 < HANG_S);
        if (sent < size) {
            ssize_t w = send(fd, data + sent, size - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (w > 0)
                sent += (size_t)w;
            else if (w < 0 && errno != EAGAIN && errno != EINTR)
                sent = size;   /* the server closed its side */
        }
        answer_read(fd, &a, sent < size ? 1 : 20);
        /* one whole answer (after any 100 Continue) is enough: the connection may stay open */
        int code;
        while (!whole && a.len > at && (code = check_response(&a, &at, 0)))
            whole = code != 100;
    }
    if (!whole && a.len > at)
        check_response(&a, &at, 1);
    free(a.buf);
    close(fd);
}

#endif

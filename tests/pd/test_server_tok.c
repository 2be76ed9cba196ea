/* The event loop answers while a long text prompt is tokenized (src/pd/server_tok.c): a prompt at
 * the byte limit, tokenized on the loop, held /health for 4.6 s and the proxy took the instance
 * out (a health timeout of 1 s). The prompt here is spaces, one piece of the pre-tokenizer that BPE
 * merges in O(n log n), made larger until its request takes 1.5 s or more on this machine; every
 * /health and /metrics asked meanwhile must answer within 400 ms (the loop still reads and parses
 * the body: 70 ms for 4 MiB, 220 ms for 16 MiB on a 2-core machine under load). On the loop the
 * first /health waited for the whole tokenization. A client that leaves during the tokenization, and a server
 * that stops during it, are handled: no request is admitted for nobody, the stop answers 503. */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "core/timing.h"
#include "../tmpmodel.h"
#include "pd/server.h"
#include "util.h"

static char dir[64];
static struct node srv;
static size_t limit;   /* the most bytes of text the server tokenizes (its check before: server_api.c) */

#define MAX_MODEL_LEN (1 << 18)

static void setup(void)
{
    tmp_model("v4-tiny", 7, dir, sizeof dir);
    tmp_model_positions(dir, MAX_MODEL_LEN);
    struct pd_tok *tok = tok_of(dir);
    limit = (size_t)MAX_MODEL_LEN * (pd_tok_max_token_bytes(tok) * 4 + 4) - 1;
    pd_tok_free(tok);
    pd_err e = {0};
    struct pd_server_opts o = {.model_dir = dir, .port = test_ports(), .threads = 1, .max_num_seqs = 1,
                               .max_model_len = MAX_MODEL_LEN, .kv_cache_bytes = 64 << 20, .served_name = "tiny",
                               .http = {.max_body_bytes = 64 << 20}};
    cr_assert_eq(pd_server_create(&o, &srv.s, &e), 0, "%s", e.msg);
    srv.port = pd_server_port(srv.s);
    pthread_create(&srv.loop, NULL, run_server, srv.s);
}

static void teardown(void)
{
    node_stop(&srv);
    rm_model(dir);
}

TestSuite(server_tok, .init = setup, .fini = teardown, .timeout = 600);

static int connect_port(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    struct timeval tv = {120, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

static void write_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        cr_assert_gt(w, 0, "write: %s", strerror(errno));
        p += w;
        n -= (size_t)w;
    }
}

/* Reads the answer to its end (the server closes: Connection: close); its status, and up to cap
 * bytes of it in out. */
static int read_answer(int fd, char *out, size_t cap)
{
    size_t len = 0;
    char buf[4096];
    ssize_t got;
    while ((got = read(fd, buf, sizeof buf)) > 0) {
        size_t k = (size_t)got < cap - 1 - len ? (size_t)got : cap - 1 - len;
        memcpy(out + len, buf, k);
        len += k;
    }
    out[len] = 0;
    int code = 0;
    sscanf(out, "HTTP/1.1 %d", &code);
    return code;
}

/* A completion whose body is pre, n copies of unit, then post, written whole on a new connection
 * (its fd). */
static int send_body(const char *pre, const char *unit, size_t n, const char *post)
{
    const size_t lp = strlen(pre), lu = strlen(unit), lq = strlen(post), body = lp + n * lu + lq;
    char *b = malloc(body + 256);
    cr_assert_not_null(b);
    int h = sprintf(b, "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                       "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s", body, pre);
    char *p = b + h;
    for (size_t i = 0; i < n; i++, p += lu)
        memcpy(p, unit, lu);
    memcpy(p, post, lq);
    int fd = connect_port(srv.port);
    write_all(fd, b, (size_t)h + n * lu + lq);
    free(b);
    return fd;
}

/* A completion whose prompt is n spaces. */
static int send_spaces(size_t n)
{
    return send_body("{\"prompt\":\"", " ", n, "\",\"max_tokens\":1}");
}

/* GET path; its status, the seconds it took in *secs. */
static int get(const char *path, double *secs)
{
    const double t0 = pd_now_s();
    int fd = connect_port(srv.port);
    char req[128], out[1 << 16];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", path);
    write_all(fd, req, (size_t)n);
    int code = read_answer(fd, out, sizeof out);
    close(fd);
    *secs = pd_now_s() - t0;
    return code;
}

/* A request sent on a thread of its own while the test probes the server: its body (send_body's
 * arguments), and once done its status, answer and seconds. */
struct big {
    const char *pre, *unit, *post;
    size_t n;
    double secs;
    int code;
    char answer[1024];
    atomic_int done;
};

static void *big_request(void *arg)
{
    struct big *b = arg;
    const double t0 = pd_now_s();
    int fd = b->pre ? send_body(b->pre, b->unit, b->n, b->post) : send_spaces(b->n);
    b->code = read_answer(fd, b->answer, sizeof b->answer);
    close(fd);
    b->secs = pd_now_s() - t0;
    atomic_store(&b->done, 1);
    return NULL;
}

static const char *const probed[2] = {"/health", "/metrics"};

/* Sends b and, until it is answered, asks /health and /metrics every 20 ms, each of which must
 * answer 200: the slowest answer of each in worst[], how many rounds of probes were made. */
static int probe_during(struct big *b, double worst[2])
{
    pthread_t t;
    pthread_create(&t, NULL, big_request, b);
    int probes = 0;
    worst[0] = worst[1] = 0;
    while (!atomic_load(&b->done)) {
        for (int k = 0; k < 2; k++) {
            double secs;
            cr_assert_eq(get(probed[k], &secs), 200, "%s", probed[k]);
            if (secs > worst[k])
                worst[k] = secs;
        }
        probes++;
        usleep(20000);
    }
    pthread_join(t, NULL);
    return probes;
}

Test(server_tok, health_and_metrics_answer_while_a_long_prompt_is_tokenized)
{
    int long_enough = 0;
    for (size_t n = 4u << 20; !long_enough && n <= limit && n <= (48u << 20); n *= 2) {
        struct big b = {.n = n};
        double worst[2];
        int probes = probe_during(&b, worst);
        /* tokenized whole: its token count, past the context, is the refusal's */
        cr_assert_eq(b.code, 400, "%s", b.answer);
        cr_assert(strstr(b.answer, "the prompt has"), "%s", b.answer);
        long_enough = b.secs >= 1.5;
        cr_log_info("%zu spaces: %.2f s; %d probes, the slowest /health %.0f ms, /metrics %.0f ms", n, b.secs, probes,
                    worst[0] * 1e3, worst[1] * 1e3);
        if (long_enough)
            for (int k = 0; k < 2; k++)
                cr_assert_lt(worst[k], 0.4, "%s took %.0f ms while a prompt of %zu bytes was tokenized (%.2f s)",
                             probed[k], worst[k] * 1e3, n, b.secs);
    }
    cr_assert(long_enough, "no prompt up to the limit took 1.5 s to tokenize: the test shows nothing here");
}

/* A body of --max-body-bytes' default (8 MiB) that is a prompt of token ids, 4 M of them ("1,"):
 * its parse (jansson makes a value of each), the ids' checks and its free took 0.4-0.5 s on the
 * event loop, which answered nothing meanwhile. Off the loop, /health and /metrics answer within
 * 200 ms while it is parsed. Larger bodies (this server takes 64 MiB) until the request takes
 * 0.8 s, four times that, so that a loop held by it could not hide between two probes. (Within
 * 100 ms of a 0.4 s request was too tight under the sanitizers beside another test on 2 cores:
 * /metrics once took 104 ms, the parse off the loop, while a request of 2.06 s was read.) */
Test(server_tok, health_and_metrics_answer_while_a_body_of_token_ids_is_parsed)
{
    static const char pre[] = "{\"prompt\":[", post[] = "1],\"max_tokens\":1}";
    int long_enough = 0;
    for (size_t bytes = 8u << 20; !long_enough && bytes <= (64u << 20); bytes *= 2) {
        struct big b = {.pre = pre, .unit = "1,", .post = post, .n = (bytes - strlen(pre) - strlen(post)) / 2};
        double worst[2];
        int probes = probe_during(&b, worst);
        /* read whole: its token count, past the context, is the refusal's */
        cr_assert_eq(b.code, 400, "%s", b.answer);
        cr_assert(strstr(b.answer, "the prompt has"), "%s", b.answer);
        long_enough = b.secs >= 0.8;
        cr_log_info("%zu token ids (%zu bytes): %.2f s; %d probes, the slowest /health %.0f ms, /metrics %.0f ms",
                    b.n + 1, bytes, b.secs, probes, worst[0] * 1e3, worst[1] * 1e3);
        if (long_enough)
            for (int k = 0; k < 2; k++)
                cr_assert_lt(worst[k], 0.2, "%s took %.0f ms while a body of %zu token ids (%zu bytes) was read "
                             "(%.2f s)", probed[k], worst[k] * 1e3, b.n + 1, bytes, b.secs);
    }
    cr_assert(long_enough, "no body up to 64 MiB took 0.8 s to read: the test shows nothing here");
}

/* Waits until the server says `n` prompts are being tokenized (at most 60 s). */
static void wait_tokenizing(int n)
{
    for (int i = 0; i < 3000 && metric_port(srv.port, "pdmoe_num_requests_tokenizing") != n; i++)
        usleep(20000);
    cr_assert_eq(metric_port(srv.port, "pdmoe_num_requests_tokenizing"), n);
}

/* A client that leaves while its prompt is tokenized: nothing is admitted for it, and the server
 * goes on (the job freed once back: the sanitizer build checks that). */
Test(server_tok, a_client_that_leaves_during_tokenization_is_dropped)
{
    int fd = send_spaces(limit < (8u << 20) ? limit : (8u << 20));
    wait_tokenizing(1);
    close(fd);
    wait_tokenizing(0);
    double secs;
    cr_assert_eq(get("/health", &secs), 200);
    cr_assert_eq(metric_port(srv.port, "pdmoe_requests_total"), 0);
    /* and the next prompt is tokenized as before */
    struct big b = {.n = 1u << 20};
    big_request(&b);
    cr_assert_eq(b.code, 400, "%s", b.answer);
    cr_assert(strstr(b.answer, "the prompt has"), "%s", b.answer);
}

/* A server stopped while a prompt is tokenized answers that request's client with a 503. */
Test(server_tok, a_stop_during_tokenization_answers_503)
{
    int fd = send_spaces(limit < (8u << 20) ? limit : (8u << 20));
    wait_tokenizing(1);
    node_stop(&srv);
    char out[4096];
    int code = read_answer(fd, out, sizeof out);
    close(fd);
    cr_assert_eq(code, 503, "%s", out);
    cr_assert(strstr(out, "shutting down"), "%s", out);
}

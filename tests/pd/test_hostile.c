/* The server under hostile or unlucky requests: numbers that would overflow what they size are
 * refused with a 400 naming the field and the server goes on serving; a first sampled token that
 * is EOS gives an empty "stop" answer (it once called memmove(NULL, ..., 0), which UBSan aborts);
 * a token whose bytes hold 0x00 reaches the client byte for byte, in the plain answer, in the
 * streamed chunks and in return_token_ids alike (the text was once cut at the NUL); a chat's
 * "developer" message is prompted as its system message is (it was refused). */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <jansson.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/timing.h"
#include "engine/genmodel.h"
#include "model/tokenizer.h"
#include "../run.h"
#include "../tmpmodel.h"
#include "pd/server.h"
#include "util.h"

static char dir[64];
static struct pd_server *srv;
static pthread_t loop;
static int port;

static void *run_loop(void *arg)
{
    pd_err e;
    pd_server_run(srv, &e);
    return NULL;
}

static void setup(void)
{
    tmp_model("v4-tiny", 7, dir, sizeof dir);
    pd_err e = {0};
    struct pd_server_opts o = {.model_dir = dir, .port = 0, .threads = 1, .max_num_seqs = 4,
                               .max_model_len = 512, .served_name = "tiny"};
    cr_assert_eq(pd_server_create(&o, &srv, &e), 0, "%s", e.msg);
    port = pd_server_port(srv);
    pthread_create(&loop, NULL, run_loop, NULL);
}

static void teardown(void)
{
    pd_server_stop(srv);
    pthread_join(loop, NULL);
    pd_server_destroy(srv);
    rm_model(dir);
}

TestSuite(hostile, .init = setup, .fini = teardown, .timeout = 240);

/* POST body to path over a plain socket (many requests per test: no process per request); the
 * status, and the answer's body (malloc'ed, NUL-terminated) in *out. */
static int post(const char *path, const char *body, char **out)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    char head[256];
    int n = snprintf(head, sizeof head,
                     "POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\n\r\n", path, strlen(body));
    cr_assert_eq(write(fd, head, (size_t)n), n);
    cr_assert_eq(write(fd, body, strlen(body)), (ssize_t)strlen(body));
    size_t len = 0, cap = 1 << 14;
    char *buf = malloc(cap);
    ssize_t got;
    while ((got = read(fd, buf + len, cap - len - 1)) > 0) {
        len += (size_t)got;
        if (cap - len < 4096)
            buf = realloc(buf, cap *= 2);
    }
    close(fd);
    buf[len] = 0;
    int code = 0;
    cr_assert_eq(sscanf(buf, "HTTP/1.1 %d", &code), 1, "no status line: %s", buf);
    char *b = strstr(buf, "\r\n\r\n");
    cr_assert_not_null(b);
    *out = strdup(b + 4);
    free(buf);
    return code;
}

static void refused(const char *body, const char *param)
{
    char *out;
    int code = post(strstr(body, "\"messages\"") ? "/v1/chat/completions" : "/v1/completions", body, &out);
    cr_assert_eq(code, 400, "%s: %d %s", body, code, out);
    json_t *j = parse(out);
    json_t *err = json_object_get(j, "error");
    cr_assert(json_is_string(json_object_get(err, "message")), "%s", out);
    cr_assert_str_eq(json_string_value(json_object_get(err, "param")), param, "%s: %s", body, out);
    json_decref(j);
    free(out);
}

Test(hostile, numbers_that_would_overflow_are_refused_and_the_server_lives)
{
    refused("{\"prompt\":\"x\",\"max_tokens\":9223372036854775807}", "max_tokens");
    refused("{\"prompt\":\"x\",\"max_tokens\":9223372036854775806}", "max_tokens");
    refused("{\"prompt\":\"x\",\"max_tokens\":2147483647}", "max_tokens");
    refused("{\"prompt\":\"x\",\"max_tokens\":4294967297}", "max_tokens");
    refused("{\"prompt\":\"x\",\"max_tokens\":-9223372036854775807}", "max_tokens");
    refused("{\"prompt\":\"x\",\"max_completion_tokens\":9223372036854775807}", "max_completion_tokens");
    refused("{\"prompt\":\"x\",\"max_completion_tokens\":0}", "max_completion_tokens");
    refused("{\"prompt\":\"x\",\"max_tokens\":4,\"max_completion_tokens\":9223372036854775807}", "max_completion_tokens");
    refused("{\"prompt\":\"x\",\"temperature\":-0.5}", "temperature");
    refused("{\"prompt\":\"x\",\"temperature\":1e308}", "temperature");
    refused("{\"prompt\":\"x\",\"top_p\":0}", "top_p");
    refused("{\"prompt\":\"x\",\"top_p\":1.0000001}", "top_p");
    refused("{\"prompt\":\"x\",\"seed\":1.5}", "seed");
    refused("{\"prompt\":\"x\",\"seed\":\"7\"}", "seed");
    refused("{\"prompt\":\"x\",\"ignore_eos\":\"yes\"}", "ignore_eos");
    refused("{\"prompt\":\"x\",\"return_token_ids\":1}", "return_token_ids");
    refused("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":9223372036854775807}", "max_tokens");
    /* the server is alive and the extreme seeds are just seeds; null is an option left unset */
    char *out;
    const char *ok[] = {"{\"prompt\":\"x\",\"max_tokens\":3,\"seed\":-9223372036854775807}",
                        "{\"prompt\":\"x\",\"max_tokens\":3,\"seed\":9223372036854775807}",
                        "{\"prompt\":\"x\",\"max_tokens\":3,\"max_completion_tokens\":3,\"seed\":null,\"top_p\":null}",
                        "{\"prompt\":\"x\",\"max_tokens\":null,\"max_completion_tokens\":200,\"temperature\":0}"};
    for (int i = 0; i < 4; i++) {
        int code = post("/v1/completions", ok[i], &out);
        cr_assert_eq(code, 200, "%s: %d %s", ok[i], code, out);
        free(out);
    }
}

/* The seed in [0, limit) whose completion of `body_fmt` (one %d for the seed) first satisfies
 * want(answer), or -1; the answer stays in *out. */
static int find_seed(const char *body_fmt, int limit, int (*want)(json_t *), json_t **out)
{
    char body[512];
    for (int seed = 0; seed < limit; seed++) {
        snprintf(body, sizeof body, body_fmt, seed);
        char *txt;
        int code = post("/v1/completions", body, &txt);
        cr_assert_eq(code, 200, "%s: %d %s", body, code, txt);
        json_error_t je;
        json_t *j = json_loads(txt, JSON_ALLOW_NUL, &je);
        cr_assert_not_null(j, "not JSON: %s (%s)", txt, je.text);
        free(txt);
        if (want(j)) {
            *out = j;
            return seed;
        }
        json_decref(j);
    }
    return -1;
}

static json_t *choice(json_t *j)
{
    return json_array_get(json_object_get(j, "choices"), 0);
}

/* EOS first: "stop" at once, the EOS counted in the usage (as vLLM counts it) but not in the text */
static int stopped_at_once(json_t *j)
{
    const char *f = json_string_value(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "finish_reason"));
    return f && strcmp(f, "stop") == 0 &&
           json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")) == 1;
}

Test(hostile, a_first_token_that_is_eos_is_an_empty_stop)
{
    json_t *j;
    int seed = find_seed("{\"prompt\":\"x\",\"max_tokens\":1,\"temperature\":2,\"seed\":%d}", 20000, stopped_at_once, &j);
    cr_assert_geq(seed, 0, "no seed below 20000 samples EOS first");
    cr_assert_str_eq(json_string_value(json_object_get(choice(j), "text")), "");
    cr_assert_str_eq(json_string_value(json_object_get(choice(j), "finish_reason")), "stop");
    json_decref(j);
    /* streamed: a final chunk, [DONE], no text */
    char body[256], out[8192];
    snprintf(body, sizeof body, "{\"prompt\":\"x\",\"max_tokens\":1,\"temperature\":2,\"seed\":%d,\"stream\":true}", seed);
    cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    cr_assert(strstr(out, "\"finish_reason\":\"stop\""), "%s", out);
    cr_assert(strstr(out, "data: [DONE]"), "%s", out);
    cr_assert_null(strstr(out, "\"text\":\"x"), "%s", out);
}

/* EOS generated past ignore_eos (or any special token) adds no text, as vLLM's default
 * skip_special_tokens gives it; skip_special_tokens false keeps it. Its text "<｜end▁of▁sentence｜>"
 * used to be in every such answer, and the parameter was refused. */
Test(hostile, special_tokens_are_left_out_of_the_text_unless_asked_for)
{
    json_t *j;
    int seed = find_seed("{\"prompt\":\"x\",\"max_tokens\":1,\"temperature\":2,\"seed\":%d}", 20000, stopped_at_once, &j);
    cr_assert_geq(seed, 0, "no seed below 20000 samples EOS first");
    json_decref(j);
    char body[256], *txt;
    static const char *const keep[] = {"", ",\"skip_special_tokens\":true", ",\"skip_special_tokens\":false"};
    for (int k = 0; k < 3; k++) {
        snprintf(body, sizeof body, "{\"prompt\":\"x\",\"max_tokens\":1,\"temperature\":2,\"seed\":%d,"
                 "\"ignore_eos\":true,\"return_token_ids\":true%s}", seed, keep[k]);
        cr_assert_eq(post("/v1/completions", body, &txt), 200, "%s", txt);
        j = json_loads(txt, 0, NULL);
        cr_assert_not_null(j, "%s", txt);
        json_t *ids = json_object_get(choice(j), "token_ids");
        cr_assert_eq(json_array_size(ids), 1, "%s", txt);
        cr_assert_eq(json_integer_value(json_array_get(ids, 0)), 1, "not EOS: %s", txt);   /* v4-tiny's EOS */
        cr_assert_str_eq(json_string_value(json_object_get(choice(j), "text")), k == 2 ? "<｜end▁of▁sentence｜>" : "",
                         "%s", body);
        json_decref(j);
        free(txt);
    }
    cr_assert_eq(post("/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":1,\"skip_special_tokens\":1}", &txt), 400);
    cr_assert(strstr(txt, "must be a boolean") && strstr(txt, "\"param\":\"skip_special_tokens\""), "%s", txt);
    free(txt);
}

static int32_t nul_id;

static int has_nul_token(json_t *j)
{
    json_t *ids = json_object_get(choice(j), "token_ids");
    for (size_t i = 0; i < json_array_size(ids); i++)
        if (json_integer_value(json_array_get(ids, i)) == nul_id)
            return 1;
    return 0;
}

/* The text a client gets for generated bytes b[0..n): each well-formed UTF-8 sequence as it is,
 * each maximal subpart of an ill-formed one as one U+FFFD (Unicode's table of well-formed byte
 * sequences, 3-7). */
static size_t as_utf8(const unsigned char *b, size_t n, char *out)
{
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        unsigned c = b[i];
        size_t len = c <= 0x7f ? 1 : c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
        unsigned lo = c == 0xe0 ? 0xa0 : c == 0xf0 ? 0x90 : 0x80, hi = c == 0xed ? 0x9f : c == 0xf4 ? 0x8f : 0xbf;
        size_t k = 1;   /* the sequence's bytes valid so far: an invalid one is one U+FFFD for them all */
        while (len > 1 && k < len && i + k < n &&
               (k == 1 ? b[i + 1] >= lo && b[i + 1] <= hi : b[i + k] >= 0x80 && b[i + k] <= 0xbf))
            k++;
        if (len > 0 && k == len) {
            memcpy(out + o, b + i, len);
            o += len;
        } else {
            memcpy(out + o, "\xef\xbf\xbd", 3);
            o += 3;
        }
        i += k;
    }
    return o;
}

Test(hostile, a_token_with_a_nul_byte_is_carried_byte_for_byte)
{
    struct pd_tok *tok = tok_of(dir);
    nul_id = nul_token_id(tok);
    /* (special tokens' text kept, as pd_tok_decode gives it) */
    const char *fmt = "{\"prompt\":\"x\",\"max_tokens\":48,\"temperature\":2,\"ignore_eos\":true,"
                      "\"skip_special_tokens\":false,\"return_token_ids\":true,\"seed\":%d}";
    json_t *j;
    int seed = find_seed(fmt, 2000, has_nul_token, &j);
    cr_assert_geq(seed, 0, "no seed below 2000 samples token %d (byte 0x00)", nul_id);
    /* the ids' bytes, and the text they make */
    json_t *ids = json_object_get(choice(j), "token_ids");
    int32_t id[48];
    size_t n = json_array_size(ids);
    for (size_t i = 0; i < n; i++)
        id[i] = (int32_t)json_integer_value(json_array_get(ids, i));
    char *bytes, want[48 * 64 * 3];
    size_t nbytes;
    cr_assert_eq(pd_tok_decode(tok, id, n, &bytes, &nbytes), 0);
    size_t nwant = as_utf8((const unsigned char *)bytes, nbytes, want);
    cr_assert_not_null(memchr(want, 0, nwant));
    free(bytes);
    /* the plain answer: all of it, the 0x00 included */
    json_t *text = json_object_get(choice(j), "text");
    cr_assert_eq(json_string_length(text), nwant, "text of %zu bytes, the ids make %zu", json_string_length(text), nwant);
    cr_assert(memcmp(json_string_value(text), want, nwant) == 0);
    json_decref(j);
    /* as it is on the wire: \u0000 */
    char body[512], *raw;
    snprintf(body, sizeof body, fmt, seed);
    cr_assert_eq(post("/v1/completions", body, &raw), 200);
    cr_assert(strstr(raw, "\\u0000"), "%s", raw);
    free(raw);
    /* streamed with the same seed: the chunks add up to the same bytes */
    snprintf(body, sizeof body,
             "{\"prompt\":\"x\",\"max_tokens\":48,\"temperature\":2,\"ignore_eos\":true,\"skip_special_tokens\":false,"
             "\"seed\":%d,\"stream\":true}", seed);
    static char out[1 << 18];
    cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    char got[sizeof want];
    size_t ngot = 0;
    int done = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
        cr_assert(strncmp(line, "data: ", 6) == 0, "not an SSE data line: %s", line);
        if (!strcmp(line + 6, "[DONE]")) {
            done = 1;
            continue;
        }
        json_error_t je;
        json_t *c = json_loads(line + 6, JSON_ALLOW_NUL, &je);
        cr_assert_not_null(c, "%s: %s", line, je.text);
        json_t *t = json_object_get(choice(c), "text");
        cr_assert(json_is_string(t), "%s", line);
        cr_assert_leq(ngot + json_string_length(t), sizeof got);
        memcpy(got + ngot, json_string_value(t), json_string_length(t));
        ngot += json_string_length(t);
        json_decref(c);
    }
    cr_assert(done);
    cr_assert_eq(ngot, nwant, "streamed %zu bytes, the ids make %zu", ngot, nwant);
    cr_assert(memcmp(got, want, nwant) == 0);
    pd_tok_free(tok);
}

/* A fake instance: answers every request on its port with `body` (200, JSON) until stopped, each
 * connection on its own thread; a POST's answer after post_delay_ms; with `hang`, from the first
 * POST on nothing is answered any more (a host that hung). */
struct fake {
    int fd, port, post_delay_ms, hang;
    int status;                      /* the answers' status: 0 is 200 */
    const char *type;                /* their Content-Type: NULL is application/json */
    const char *header;              /* one more header line of theirs ("Name: value\r\n"), or NULL */
    volatile int stop, posted;
    const char *body;
    pthread_t t;
};

struct fake_conn {
    struct fake *f;
    int c;
};

static void *fake_serve(void *arg)
{
    struct fake_conn *fc = arg;
    struct fake *f = fc->f;
    int c = fc->c;
    free(fc);
    char req[8192];
    size_t n = 0;
    ssize_t got;
    char *end = NULL;
    while (n < sizeof req - 1 && (got = read(c, req + n, sizeof req - 1 - n)) > 0) {
        n += (size_t)got;
        req[n] = 0;
        if ((end = strstr(req, "\r\n\r\n")))
            break;
    }
    int post = strncmp(req, "POST", 4) == 0;
    if (post) {   /* its body, read whole: a close with unread bytes would be a reset */
        const char *cl = strstr(req, "Content-Length: ");
        size_t want = cl ? strtoul(cl + 16, NULL, 10) : 0, have = end ? n - (size_t)(end + 4 - req) : 0;
        char sink[4096];
        while (have < want && (got = read(c, sink, sizeof sink)) > 0)
            have += (size_t)got;
    }
    if (f->hang && (post || f->posted)) {
        f->posted = 1;
        while (!f->stop)
            usleep(20000);
        close(c);
        return NULL;
    }
    for (int i = 0; post && i < f->post_delay_ms / 10 && !f->stop; i++)
        usleep(10000);
    char head[256];
    const int status = post && f->status ? f->status : 200;   /* (/health: 200) */
    const char *type = post && f->type ? f->type : "application/json";
    if (!strcmp(type, "text/event-stream")) {   /* a stream, chunked as pdmoe serve sends it */
        int k = snprintf(head, sizeof head, "HTTP/1.1 %d OK\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n"
                         "Connection: close\r\n\r\n%zx\r\n", status, type, strlen(f->body));
        if (write(c, head, (size_t)k) != k || write(c, f->body, strlen(f->body)) < 0 || write(c, "\r\n0\r\n\r\n", 7) < 0)
            k = 0;
        close(c);
        return NULL;
    }
    int k = snprintf(head, sizeof head, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                     "%sConnection: close\r\n\r\n", status, status == 200 ? "OK" : "Error", type, strlen(f->body),
                     post && f->header ? f->header : "");
    if (write(c, head, (size_t)k) == k && write(c, f->body, strlen(f->body)) < 0)
        k = 0;
    close(c);
    return NULL;
}

static void *fake_loop(void *arg)
{
    struct fake *f = arg;
    for (;;) {
        int c = accept(f->fd, NULL, NULL);
        if (c < 0 || f->stop) {
            if (c >= 0)
                close(c);
            return NULL;
        }
        struct fake_conn *fc = malloc(sizeof *fc);
        *fc = (struct fake_conn){f, c};
        pthread_t t;
        pthread_create(&t, NULL, fake_serve, fc);
        pthread_detach(t);
    }
}

static void fake_start(struct fake *f, const char *body)
{
    f->fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t n = sizeof a;
    cr_assert_eq(bind(f->fd, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(listen(f->fd, 16), 0);
    getsockname(f->fd, (struct sockaddr *)&a, &n);
    f->port = ntohs(a.sin_port);
    f->body = body;
    f->stop = 0;
    f->posted = 0;
    pthread_create(&f->t, NULL, fake_loop, f);
}

static void fake_stop(struct fake *f)
{
    f->stop = 1;
    shutdown(f->fd, SHUT_RDWR);
    pthread_join(f->t, NULL);
    close(f->fd);
    usleep(100000);   /* its connections' threads see stop and close */
}

/* The proxy sums the instances' /expert_stats: counts that are not counts (negative, not
 * integers) or whose sum passes 64 bits are a 502 naming the cell, not a wrapped negative total. */
Test(hostile, expert_counts_from_instances_are_checked_before_they_are_summed)
{
    const char *bodies[] = {"{\"tokens_per_expert\":[[9223372036854775807,1]]}", "{\"tokens_per_expert\":[[5,-3]]}",
                            "{\"tokens_per_expert\":[[5,2.5]]}", "{\"tokens_per_expert\":[[5,\"7\"]]}"};
    const char *cell[] = {"tokens_per_expert[0][0]", "tokens_per_expert[0][1]", "tokens_per_expert[0][1]",
                          "tokens_per_expert[0][1]"};
    for (int i = 0; i < 4; i++) {
        struct fake f = {0};
        fake_start(&f, bodies[i]);
        static char a[32];
        snprintf(a, sizeof a, "127.0.0.1:%d", f.port);
        /* the same fake as a prefill and a decode instance: its counts are summed twice */
        struct pd_proxy_opts o = {.port = 0, .n_prefill = 1, .n_decode = 1};
        o.prefill[0] = a;
        o.decode[0] = a;
        struct pd_proxy *x;
        pd_err e = {0};
        cr_assert_eq(pd_proxy_create(&o, &x, &e), 0, "%s", e.msg);
        pthread_t t;
        pthread_create(&t, NULL, run_proxy, x);
        char out[4096];
        int code = curl_port(pd_proxy_port(x), "/expert_stats", NULL, NULL, out, sizeof out);
        proxy_shutdown(&x, t);
        fake_stop(&f);
        cr_assert_eq(code, 502, "%s: %d %s", bodies[i], code, out);
        cr_assert(strstr(out, cell[i]) && strstr(out, "not a count"), "%s: %s", bodies[i], out);
    }
}

/* A proxy in front of one colocated fake instance (health checks every health_ms), and a
 * completion through it: the status, the seconds it took, the answer in out, the instance's
 * ejections. */
static int through_proxy_as(struct fake *f, int as_prefill, const char *body, int health_ms, char *out, size_t cap,
                            double *seconds, int *ejections, int64_t *failed, int64_t *completed)
{
    static char a[32];
    snprintf(a, sizeof a, "127.0.0.1:%d", f->port);
    struct pd_proxy_opts o = {.port = 0, .n_decode = 1, .health_interval_ms = health_ms};
    o.decode[0] = a;
    if (as_prefill) {   /* the fake prefills; a decode instance that is never reached */
        o.n_prefill = 1;
        o.prefill[0] = a;
        o.decode[0] = "127.0.0.1:1";
    }
    struct pd_proxy *x;
    pd_err e = {0};
    cr_assert_eq(pd_proxy_create(&o, &x, &e), 0, "%s", e.msg);
    pthread_t t;
    pthread_create(&t, NULL, run_proxy, x);
    /* the fake in service first: the proxy counts an instance up from its first answer */
    int in = 0;
    for (int i = 0; i < 250 && !in; i++) {
        char r[1024];
        curl_port(pd_proxy_port(x), "/readiness", NULL, NULL, r, sizeof r);
        json_t *j = json_loads(r, 0, NULL);
        in = json_integer_value(json_object_get(json_object_get(j, as_prefill ? "prefill" : "decode"), "up")) == 1;
        json_decref(j);
        if (!in)
            usleep(20000);
    }
    cr_assert(in, "the fake instance on %s was not taken in within 5 s", a);
    double t0 = pd_now_s();
    int code = curl_port(pd_proxy_port(x), "/v1/completions", body, NULL, out, cap);
    *seconds = pd_now_s() - t0;
    char key[96];
    snprintf(key, sizeof key, "pdmoe_proxy_instance_ejections_total{role=\"%s\",instance=\"%s\"}",
             as_prefill ? "prefill" : "decode", a);
    *ejections = (int)metric_key(pd_proxy_port(x), key);
    *failed = metric_key(pd_proxy_port(x), as_prefill ? "pdmoe_proxy_errors_total{kind=\"prefill_failed\"}"
                                                      : "pdmoe_proxy_errors_total{kind=\"decode_failed\"}");
    *completed = metric_key(pd_proxy_port(x), "pdmoe_proxy_completed_total");
    proxy_shutdown(&x, t);
    return code;
}

static int through_proxy(struct fake *f, int health_ms, char *out, size_t cap, double *seconds, int *ejections)
{
    int64_t failed, completed;
    return through_proxy_as(f, 0, "{\"prompt\":\"x\",\"max_tokens\":2}", health_ms, out, cap, seconds, ejections,
                            &failed, &completed);
}

static const char answer_body[] = "{\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,"
                                  "\"model\":\"tiny\",\"choices\":[{\"index\":0,\"text\":\"ok\","
                                  "\"finish_reason\":\"length\"}],\"usage\":{\"prompt_tokens\":1,"
                                  "\"completion_tokens\":2,\"total_tokens\":3}}";

/* An answer has no deadline of its own: an instance that takes 60 s (past libevent's default read
 * timeout of 50 s, which once cut it into a 502 and took the healthy instance out) is waited for
 * while it answers /health. The proxy runs in a child process under build/libtimewarp.so at 10
 * times real time (its clocks and its timers, libevent's among them): its 60 s are the test's 6 s
 * (it waited 52 s of real time). Its health checks every 500 ms of its time, each given 10 s of it
 * (1 s of the test's, against a loaded machine). */
Test(hostile, a_slow_answer_is_waited_for, .timeout = 120)
{
    const int rate = 10;
    struct fake slow = {.post_delay_ms = 60000 / rate};
    fake_start(&slow, answer_body);
    char shim[PATH_MAX], instance[32], portarg[16], logp[] = "/tmp/pdmoe-hostile-XXXXXX";
    test_shim("libtimewarp.so", shim);
    snprintf(instance, sizeof instance, "127.0.0.1:%d", slow.port);
    const int proxy_port = test_ports();
    snprintf(portarg, sizeof portarg, "%d", proxy_port);
    int logfd = mkstemp(logp);
    cr_assert_geq(logfd, 0);
    char rates[32];
    snprintf(rates, sizeof rates, "PDMOE_TEST_TIME_RATE=%d", rate);
    pid_t child = fork_pdmoe_shimmed(shim, (const char *const[]){rates, NULL});
    if (child == 0) {
        dup2(logfd, 2);
        execl(pdmoe_bin(), pdmoe_bin(), "proxy", "--decode", instance, "--port", portarg, "--health-interval-ms", "500",
              "--health-timeout-ms", "10000", (char *)NULL);
        _exit(127);
    }
    close(logfd);
    /* in service once its first check came back (nothing asserted until the child is stopped) */
    char key[160], out[4096] = "";
    snprintf(key, sizeof key, "pdmoe_proxy_instance_up{role=\"decode\",instance=\"%s\"}", instance);
    for (int i = 0; i < 1000 && metric_key_or(proxy_port, key, 0) != 1; i++)
        usleep(20000);
    const int up = metric_key_or(proxy_port, key, 0) == 1;
    const double t0 = pd_now_s();
    int code = up ? curl_port(proxy_port, "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":2}", NULL, out, sizeof out) : 0;
    const double took = pd_now_s() - t0;
    snprintf(key, sizeof key, "pdmoe_proxy_instance_ejections_total{role=\"decode\",instance=\"%s\"}", instance);
    const int64_t ejections = metric_key_or(proxy_port, key, -1);
    kill(child, SIGTERM);
    int st;
    const int ended = reap_within(child, 0, &st);
    fake_stop(&slow);
    char log[8192];
    FILE *f = fopen(logp, "r");
    log[f ? fread(log, 1, sizeof log - 1, f) : 0] = 0;
    if (f)
        fclose(f);
    unlink(logp);
    cr_assert(up, "the proxy never took the instance in:\n%s", log);
    cr_assert_eq(code, 200, "after %.1f s (%.0f s of the proxy's): %d %s\n%s", took, took * rate, code, out, log);
    cr_assert_str_eq(out, answer_body);
    cr_assert_geq(took * rate, 60, "the answer came after %.1f s of the proxy's", took * rate);
    cr_assert_eq(ejections, 0, "a slow instance was taken out:\n%s", log);
    cr_assert(ended, "the proxy did not exit within 60 s of SIGTERM:\n%s", log);
    child_exited_cleanly(child, st, "pdmoe proxy under libtimewarp.so");
}

/* One that hangs (its /health unanswered too) fails its requests at its health check, within
 * seconds, with a 502 naming it. */
Test(hostile, a_hung_instance_fails_its_requests, .timeout = 60)
{
    char out[4096];
    double took;
    int ej;
    struct fake hung = {.hang = 1};
    fake_start(&hung, answer_body);
    int code = through_proxy(&hung, 200, out, sizeof out, &took, &ej);
    fake_stop(&hung);
    cr_assert_eq(code, 502, "after %.1f s: %d %s", took, code, out);
    cr_assert_lt(took, 10, "the hung instance held the request %.1f s", took);
    char where[16];
    snprintf(where, sizeof where, ":%d", hung.port);
    cr_assert(strstr(out, where), "the error does not name the instance: %s", out);
}

/* A stream its decode instance ends with an error event (an EP group's rank died under it) takes
 * the instance out and does not first take it back: the proxy logged "is up again" and "is down"
 * at once for every such stream, and the admission reset the instance's check backoff. */
Test(hostile, a_failed_stream_does_not_take_its_instance_back_first)
{
    struct fake f = {.type = "text/event-stream"};
    fake_start(&f, "data: {\"error\":{\"message\":\"EP rank 1 died\",\"type\":\"server_error\"}}\n\n"
                   "data: [DONE]\n\n");
    char where[32], logp[] = "/tmp/pdmoe-hostile-XXXXXX", out[4096];
    snprintf(where, sizeof where, "127.0.0.1:%d", f.port);
    int logfd = mkstemp(logp);
    cr_assert_geq(logfd, 0);
    unlink(logp);
    fflush(stderr);
    int saved = dup(2);
    dup2(logfd, 2);   /* the proxy's log lines */
    struct pd_proxy_opts o = {.port = 0, .n_decode = 1, .health_interval_ms = 60000};
    o.decode[0] = where;
    struct pd_proxy *x;
    pd_err e = {0};
    cr_assert_eq(pd_proxy_create(&o, &x, &e), 0, "%s", e.msg);
    pthread_t t;
    pthread_create(&t, NULL, run_proxy, x);
    for (int i = 0; i < 250 && proxy_instance_metric(pd_proxy_port(x), "up", "decode", where) != 1; i++)
        usleep(20000);   /* (in service from its first check) */
    const char *body = "{\"prompt\":\"x\",\"max_tokens\":2,\"stream\":true}";
    for (int i = 0; i < 3; i++) {   /* (the one instance gets them though it is out: no other is up) */
        int code = curl_port(pd_proxy_port(x), "/v1/completions", body, NULL, out, sizeof out);
        cr_assert(code == 200 && strstr(out, "EP rank 1 died") && strstr(out, "[DONE]"), "%d %s", code, out);
    }
    proxy_shutdown(&x, t);
    fake_stop(&f);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    char log[8192];
    ssize_t n = pread(logfd, log, sizeof log - 1, 0);
    close(logfd);
    log[n > 0 ? n : 0] = 0;
    cr_assert(strstr(log, "is down"), "the failed stream did not take the instance out: %s", log);
    cr_assert_null(strstr(log, "is up again"), "a failed stream took the instance back first: %s", log);
}

/* An instance's 5xx says why (an EP group's rank died, a drain): the client's 502 carries it, for
 * a prefill instance and a decode instance alike; it said "answered 503" and "server error". */
Test(hostile, an_instances_5xx_reason_reaches_the_client)
{
    static const char why[] = "{\"error\":{\"message\":\"EP rank 1 (pid 7 on h) died: the group cannot step\","
                              "\"type\":\"server_error\"}}";
    char out[4096];
    double took;
    int ej;
    int64_t failed, completed;
    for (int as_prefill = 0; as_prefill < 2; as_prefill++) {
        struct fake f = {.status = 503};
        fake_start(&f, why);
        int code = through_proxy_as(&f, as_prefill, "{\"prompt\":\"x\",\"max_tokens\":2}", 60000, out, sizeof out,
                                    &took, &ej, &failed, &completed);
        fake_stop(&f);
        cr_assert_eq(code, 502, "%s", out);
        cr_assert(strstr(out, "EP rank 1 (pid 7 on h) died"), "the %s instance's reason is not in the 502: %s",
                  as_prefill ? "prefill" : "decode", out);
    }
}

/* What an instance answers is checked before it reaches the client: a stream its decode instance
 * ended with an error event is a decode failure, not a completion; a 200 without a JSON body, or
 * an error that is not JSON, is a 502 naming the instance (never an empty 200, never HTML relayed
 * as JSON); a 400 about kv_transfer_params, which the proxy wrote and the client never sent, is the
 * deployment's fault (an instance of the wrong role): a 502 naming the instance, not the client's
 * 400. */
Test(hostile, an_instances_broken_answer_is_the_instances_failure)
{
    char out[4096];
    double took;
    int ej;
    int64_t failed, completed;
    struct fake f = {.type = "text/event-stream"};
    fake_start(&f, "data: {\"error\":{\"message\":\"the server is shutting down\",\"type\":\"server_error\"}}\n\n"
                   "data: [DONE]\n\n");
    int code = through_proxy_as(&f, 0, "{\"prompt\":\"x\",\"max_tokens\":2,\"stream\":true}", 60000, out, sizeof out,
                                &took, &ej, &failed, &completed);
    fake_stop(&f);
    cr_assert_eq(code, 200, "%s", out);
    cr_assert(strstr(out, "shutting down") && strstr(out, "[DONE]"), "%s", out);
    cr_assert_eq(failed, 1, "a stream the decode instance ended with an error counted as completed: %lld %lld %s", (long long)failed, (long long)completed, out);
    cr_assert_eq(completed, 0);

    static const struct { int status; const char *type, *body, *want; } bad[] = {
        {200, NULL, "", "without a JSON body"},
        {404, "text/html", "<html>Not Found</html>", "404 without a JSON body"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct fake g = {.status = bad[i].status, .type = bad[i].type};
        fake_start(&g, bad[i].body);
        code = through_proxy_as(&g, 0, "{\"prompt\":\"x\",\"max_tokens\":2}", 60000, out, sizeof out, &took, &ej,
                                &failed, &completed);
        fake_stop(&g);
        char where[16];
        snprintf(where, sizeof where, ":%d", g.port);
        cr_assert_eq(code, 502, "%s: %d %s", bad[i].want, code, out);
        cr_assert(strstr(out, bad[i].want) && strstr(out, where), "%s", out);
        cr_assert_eq(failed, 1);
    }

    struct fake p = {.status = 400};
    fake_start(&p, "{\"error\":{\"message\":\"do_remote_decode asks a prefill (kv_producer) instance; this one is not\","
                   "\"type\":\"invalid_request_error\",\"param\":\"kv_transfer_params\",\"code\":null}}");
    code = through_proxy_as(&p, 1, "{\"prompt\":\"x\",\"max_tokens\":2}", 60000, out, sizeof out, &took, &ej, &failed,
                            &completed);
    fake_stop(&p);
    char where[16];
    snprintf(where, sizeof where, ":%d", p.port);
    cr_assert_eq(code, 502, "%d %s", code, out);
    cr_assert(strstr(out, where) && strstr(out, "kv_producer"), "%s", out);
    cr_assert_eq(failed, 1);
}

/* The operator is told, on the proxy's stderr, when an instance does not answer (the proxy once
 * said nothing after dozens of ejections): once while it has never answered (a model loading, a
 * wrong address), not at every check. */
Test(hostile, the_proxy_logs_an_instance_that_does_not_answer)
{
    const char *bin = pdmoe_bin();
    char cmd[512];
    snprintf(cmd, sizeof cmd, "timeout -s INT 1.5 %s proxy --decode 127.0.0.1:1 --port 0 --health-interval-ms 100", bin);
    static struct run r;   /* (its stdout buffer is large) */
    run_cmd(cmd, &r);
    const char *said = "decode instance 127.0.0.1:1 is not up yet (its /health check failed)";
    const char *at = strstr(r.err, said);
    cr_assert(at, "%s", r.err);
    cr_assert_null(strstr(at + 1, said), "said at every check: %s", r.err);
}

/* Stray signals an operator or a log rotation sends (SIGHUP, SIGUSR1, SIGUSR2) leave the proxy
 * running and answering: USR1 and USR2 killed it without a word, and SIGHUP put UCX in its debug
 * mode (a DEBUG line per request in serve). pdmoe serve and up take the same helper. */
Test(hostile, stray_signals_do_not_stop_the_proxy)
{
    const char *bin = pdmoe_bin();
    int proxy_port = free_port();
    char sp[16];
    snprintf(sp, sizeof sp, "%d", proxy_port);
    pid_t pid = fork_pdmoe();
    if (pid == 0) {
        freopen("/dev/null", "w", stderr);
        execl(bin, bin, "proxy", "--decode", "127.0.0.1:1", "--port", sp, (char *)NULL);
        _exit(127);
    }
    char out[256];
    int up = 0;
    for (int i = 0; i < 100 && !up; i++) {
        usleep(50000);
        up = curl_port(proxy_port, "/health", NULL, NULL, out, sizeof out) == 200;
    }
    cr_assert(up, "the proxy did not start");
    const int sig[] = {SIGHUP, SIGUSR1, SIGUSR2};
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(kill(pid, sig[i]), 0);
        usleep(200000);
        int st;
        cr_assert_eq(waitpid(pid, &st, WNOHANG), 0, "signal %d ended the proxy (status %d)", sig[i], st);
        cr_assert_eq(curl_port(proxy_port, "/health", NULL, NULL, out, sizeof out), 200, "after signal %d", sig[i]);
    }
    stop_pdmoe(&pid, SIGTERM, 0, "pdmoe proxy after SIGHUP, SIGUSR1, SIGUSR2");
}

/* A prompt too long for the context however it is tokenized is refused before it is tokenized:
 * an 8 MiB prompt once held the event loop, which serves every client, for a second. */
Test(hostile, a_prompt_past_the_context_in_bytes_is_refused_untokenized)
{
    size_t n = 4u << 20;
    char *body = malloc(n + 64);
    cr_assert_not_null(body);
    size_t at = (size_t)sprintf(body, "{\"prompt\":\"");
    for (; at < n; at += 3)
        memcpy(body + at, "ab ", 3);
    sprintf(body + at, "\",\"max_tokens\":1}");
    char *raw;
    int code = post("/v1/completions", body, &raw);
    free(body);
    cr_assert_eq(code, 400, "%s", raw);
    cr_assert(strstr(raw, "bytes make more than") && strstr(raw, "\"prompt\""), "%s", raw);
    free(raw);
}

/* An instance whose waiting queue is full answers 429 (pdmoe serve --max-queued-requests): the
 * proxy offers the request to another instance of the role, without taking the full one out, and
 * passes the 429 on, with its Retry-After, only when every instance's queue is full (colocated
 * instances, then prefill instances). */
Test(hostile, a_full_queue_sends_the_request_to_another_instance)
{
    static const char ok[] = "{\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"tiny\","
                             "\"choices\":[{\"index\":0,\"text\":\"ok\",\"finish_reason\":\"length\"}],"
                             "\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2,\"total_tokens\":3}}";
    static const char full[] = "{\"error\":{\"message\":\"the waiting queue is full (1 requests, "
                               "--max-queued-requests): try again later\",\"type\":\"rate_limit_error\","
                               "\"param\":null,\"code\":null}}";
    for (int prefill = 0; prefill < 2; prefill++)
        for (int both_full = 0; both_full < 2; both_full++) {
            struct fake a = {.status = 429, .header = "Retry-After: 1\r\n"}, b = {0};
            if (both_full)
                b = a;
            fake_start(&a, full);
            fake_start(&b, both_full ? full : ok);
            static char an[32], bn[32];
            snprintf(an, sizeof an, "127.0.0.1:%d", a.port);
            snprintf(bn, sizeof bn, "127.0.0.1:%d", b.port);
            /* least loaded, equal loads: the first instance (the full one) is tried first */
            struct pd_proxy_opts o = {.port = 0, .n_decode = 2, .route = {.policy = PD_ROUTE_LEAST_LOADED}};
            o.decode[0] = an;
            o.decode[1] = bn;
            if (prefill) {   /* as prefill instances; the decode instance is never reached */
                o.n_prefill = 2;
                o.prefill[0] = an;
                o.prefill[1] = bn;
                o.n_decode = 1;
                o.decode[0] = "127.0.0.1:1";
            }
            struct pd_proxy *x;
            pd_err e = {0};
            cr_assert_eq(pd_proxy_create(&o, &x, &e), 0, "%s", e.msg);
            pthread_t t;
            pthread_create(&t, NULL, run_proxy, x);
            char out[4096];
            int code = curl_port(pd_proxy_port(x), "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":2}", "-i", out,
                                 sizeof out);
            int64_t retries = metric_key(pd_proxy_port(x), "pdmoe_proxy_retries_total"),
                    fulls = metric_key(pd_proxy_port(x), "pdmoe_proxy_errors_total{kind=\"queue_full\"}"),
                    bad = metric_key(pd_proxy_port(x), "pdmoe_proxy_errors_total{kind=\"bad_request\"}");
            char key[96];
            snprintf(key, sizeof key, "pdmoe_proxy_instance_ejections_total{role=\"%s\",instance=\"%s\"}",
                     prefill ? "prefill" : "decode", an);
            int64_t ejected = metric_key(pd_proxy_port(x), key);
            proxy_shutdown(&x, t);
            fake_stop(&a);
            fake_stop(&b);
            cr_assert_eq(retries, 1, "prefill %d, both full %d: %lld retries", prefill, both_full, (long long)retries);
            cr_assert_eq(ejected, 0, "the full instance was taken out");
            cr_assert_eq(bad, 0, "a full queue counted as the client's bad request");
            if (both_full) {
                cr_assert_eq(code, 429, "prefill %d: %d %s", prefill, code, out);
                cr_assert(strstr(out, "Retry-After: 1\r\n"), "%s", out);
                cr_assert(strstr(out, "\"type\":\"rate_limit_error\""), "%s", out);
                cr_assert_eq(fulls, 1);
            } else if (prefill) {   /* the second prefill instance answered (without KV: its 502 names it) */
                cr_assert_eq(code, 502, "%d %s", code, out);
                cr_assert(strstr(out, bn) && strstr(out, "without kv_transfer_params"), "%s", out);
            } else {
                cr_assert_eq(code, 200, "%d %s", code, out);
                cr_assert_str_eq(strstr(out, "{"), ok);
                cr_assert_eq(fulls, 0);
            }
        }
}

/* `body` through a proxy in front of a fresh fake instance that answers a completion: the status,
 * the answer in out, the proxy's completions in *completed. */
static int through_a_fake(const char *body, char *out, size_t cap, int64_t *completed)
{
    struct fake f = {0};
    fake_start(&f, "{\"choices\":[{\"text\":\"ok\"}]}");
    double s;
    int ej;
    int64_t failed;
    int code = through_proxy_as(&f, 0, body, 0, out, cap, &s, &ej, &failed, completed);
    fake_stop(&f);
    return code;
}

/* A client's kv_transfer_params (do_remote_prefill, an engine_id of its own, a typo) went through
 * the proxy as if never sent (it deleted them and answered 200); the proxy's 400 for a stream that
 * is not a boolean named no field. Both are refused naming the field, before any instance is
 * asked. */
Test(hostile, the_proxy_refuses_what_a_client_may_not_set_by_name)
{
    static const struct {
        const char *body, *param, *want;
    } cases[] = {
        {"{\"prompt\":\"x\",\"max_tokens\":2,\"kv_transfer_params\":{\"bogus\":1}}", "\"param\":\"kv_transfer_params\"",
         "kv_transfer_params is set by the proxy"},
        {"{\"prompt\":\"x\",\"max_tokens\":2,\"kv_transfer_params\":{\"do_remote_prefill\":true}}",
         "\"param\":\"kv_transfer_params\"", "a client does not send it"},
        {"{\"prompt\":\"x\",\"stream\":\"yes\"}", "\"param\":\"stream\"", "must be a boolean"},
    };
    char out[4096];
    int64_t completed;
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        int code = through_a_fake(cases[k].body, out, sizeof out, &completed);
        cr_assert_eq(code, 400, "%s: %d %s", cases[k].body, code, out);
        cr_assert(strstr(out, cases[k].param) && strstr(out, cases[k].want), "%s: %s", cases[k].body, out);
        cr_assert_eq(completed, 0, "%s: the instance was asked", cases[k].body);
    }
    /* null is unset, as the servers read it (the proxy refused it while a server took it) */
    int code = through_a_fake("{\"prompt\":\"x\",\"max_tokens\":2,\"kv_transfer_params\":null}", out, sizeof out,
                              &completed);
    cr_assert_eq(code, 200, "%d %s", code, out);
    cr_assert_eq(completed, 1);
}

/* An instance named with a quote or a backslash (as given on the command line) is a label value
 * escaped as Prometheus' text format wants: it broke the proxy's whole scrape. */
Test(hostile, the_proxys_instance_labels_are_escaped)
{
    struct pd_proxy_opts o = {.port = 0, .n_prefill = 1, .n_decode = 1};
    o.prefill[0] = "a\"b\\c:1";
    o.decode[0] = "127.0.0.1:1";
    struct pd_proxy *x;
    pd_err e = {0};
    cr_assert_eq(pd_proxy_create(&o, &x, &e), 0, "%s", e.msg);
    pthread_t t;
    pthread_create(&t, NULL, run_proxy, x);
    char out[16384];
    int code = curl_port(pd_proxy_port(x), "/metrics", NULL, NULL, out, sizeof out);
    proxy_shutdown(&x, t);
    cr_assert_eq(code, 200, "%s", out);
    cr_assert(strstr(out, "pdmoe_proxy_instance_up{role=\"prefill\",instance=\"a\\\"b\\\\c:1\"}"), "%s", out);
    cr_assert_null(strstr(out, "instance=\"a\"b"), "an unescaped label: %s", out);
}

/* A chat's "developer" message (OpenAI's newer name for the system message, which its API takes as
 * one) is answered as the system message is: the same prompt token ids, where it was a 400. */
Test(hostile, a_developer_message_is_prompted_as_a_system_message)
{
    json_t *ids[2];
    for (int dev = 0; dev < 2; dev++) {
        char body[512], *out;
        const char *role = dev ? "developer" : "system";
        snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"%s\",\"content\":\"Be brief.\"},{\"role\":\"user\","
                 "\"content\":\"Hi\"}],\"max_tokens\":1,\"return_token_ids\":true}", role);
        int code = post("/v1/chat/completions", body, &out);
        cr_assert_eq(code, 200, "%s: %d %s", role, code, out);
        json_t *j = parse(out);
        ids[dev] = json_incref(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "prompt_token_ids"));
        cr_assert_gt(json_array_size(ids[dev]), 4, "%s: %s", role, out);
        json_decref(j);
        free(out);
    }
    char *a = json_dumps(ids[0], JSON_COMPACT), *b = json_dumps(ids[1], JSON_COMPACT);
    cr_expect_str_eq(b, a, "developer's prompt ids differ from system's");
    free(a);
    free(b);
    json_decref(ids[0]);
    json_decref(ids[1]);
}

/* Bytes a header field may not hold (RFC 9110 5.5: no NUL, CR, LF or other control character but
 * HTAB, in names or values) are refused with a 400 whose JSON error names the header and the byte,
 * by the server and the proxy alike, in every header: those the server reads (Host, Authorization,
 * Content-Type, Content-Length, Connection, Transfer-Encoding, Expect) and those it does not. A NUL
 * once passed: libevent reads a line as a C string, so the bytes from the NUL on were dropped
 * unseen ("Connection: clo\0se" was read as "clo"). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "../pd/util.h"
#include "../tmpmodel.h"

static char dir[64];
static struct node srv;
static struct pd_proxy *px;
static pthread_t t_px;

static void setup(void)
{
    tmp_model("v4-tiny", 7, dir, sizeof dir);
    node_start(&srv, &(struct pd_server_opts){.model_dir = dir, .threads = 1, .max_num_seqs = 4, .max_model_len = 512,
                                              .served_name = "tiny"});
}

static void teardown(void)
{
    proxy_shutdown(&px, t_px);
    node_stop(&srv);
    rm_model(dir);
}

TestSuite(field_bytes, .init = setup, .fini = teardown, .timeout = 120);

static int start_proxy(void)
{
    static char d[32];
    snprintf(d, sizeof d, "127.0.0.1:%d", srv.port);
    pd_err e = {0};
    struct pd_proxy_opts o = {.decode = {d}, .n_decode = 1};
    cr_assert_eq(pd_proxy_create(&o, &px, &e), 0, "%s", e.msg);
    pthread_create(&t_px, NULL, run_proxy, px);
    return pd_proxy_port(px);
}

/* The answer to the n bytes of req on a fresh connection (10 s at most): its status, its body. */
static int exchange(int port, const char *req, size_t n, char *body, size_t cap)
{
    return http_exchange(port, req, n, 10, body, cap);
}

#define BODY "{\"prompt\":\"a\",\"max_tokens\":1}"

/* A completion request whose header `name` has the value `value` (nv bytes, NULs included) in
 * place of its own; the other headers make a valid request, answered 200 when nothing is wrong. */
static size_t request(char *out, size_t cap, const char *name, size_t nn, const char *value, size_t nv)
{
    static const char *const std[][2] = {{"Host", "x"}, {"Content-Type", "application/json"},
                                         {"Connection", "close"}, {"Content-Length", NULL}};
    char len[16];
    snprintf(len, sizeof len, "%zu", strlen(BODY));
    size_t n = (size_t)snprintf(out, cap, "POST /v1/completions HTTP/1.1\r\n");
    for (size_t i = 0; i < sizeof std / sizeof *std; i++) {
        if (nn == strlen(std[i][0]) && !memcmp(name, std[i][0], nn)) {
            continue;
        }
        n += (size_t)snprintf(out + n, cap - n, "%s: %s\r\n", std[i][0], std[i][1] ? std[i][1] : len);
    }
    cr_assert_lt(n + nn + nv + 8 + strlen(BODY), cap);
    memcpy(out + n, name, nn);
    n += nn;
    memcpy(out + n, ": ", 2);
    n += 2;
    memcpy(out + n, value, nv);
    n += nv;
    n += (size_t)snprintf(out + n, cap - n, "\r\n\r\n%s", BODY);
    return n;
}

/* The answer is a 400 whose JSON error names the header (as `shown`) and the byte b. */
static void refused(int port, const char *req, size_t n, const char *shown, unsigned char b, const char *what)
{
    char body[4096], hex[8];
    int code = exchange(port, req, n, body, sizeof body);
    cr_assert_eq(code, 400, "%s: %d %s", what, code, body);
    json_t *j = parse(body);
    const char *msg = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    cr_assert_not_null(msg, "%s: no error.message in %s", what, body);
    cr_assert(strstr(msg, shown), "%s: the error \"%s\" does not name header %s", what, msg, shown);
    snprintf(hex, sizeof hex, "0x%02x", b);
    cr_assert(strstr(msg, hex), "%s: the error \"%s\" does not name the byte %s", what, msg, hex);
    json_decref(j);
}

static void probe(int port)
{
    static const char *const headers[] = {"Host", "Authorization", "Content-Type", "Content-Length", "Connection",
                                          "Transfer-Encoding", "Expect", "X-Custom", "User-Agent"};
    /* a valid value for each, the bad byte set inside it */
    static const char *const values[] = {"x", "Bearer k", "application/json", "29", "close", "chunked",
                                         "100-continue", "abc", "curl/8"};
    static const unsigned char bytes[] = {0x00, '\r', 0x01, 0x0b, 0x1b, 0x1f, 0x7f};
    char req[2048], what[128];
    /* the request itself is sound */
    size_t n = request(req, sizeof req, "X-Custom", 8, "abc", 3);
    char body[4096];
    cr_assert_eq(exchange(port, req, n, body, sizeof body), 200, "%s", body);
    for (size_t h = 0; h < sizeof headers / sizeof *headers; h++) {
        for (size_t k = 0; k < sizeof bytes; k++) {
            /* in the value: in the middle, and last */
            for (int last = 0; last < 2; last++) {
                char v[64];
                size_t lv = strlen(values[h]), at = last ? lv : lv / 2;
                memcpy(v, values[h], at);
                v[at] = (char)bytes[k];
                memcpy(v + at + 1, values[h] + at, lv - at);
                n = request(req, sizeof req, headers[h], strlen(headers[h]), v, lv + 1);
                snprintf(what, sizeof what, "%s with 0x%02x %s its value", headers[h], bytes[k], last ? "ending" : "in");
                refused(port, req, n, headers[h], bytes[k], what);
            }
            /* in the name: "X-Cu\x00stom" */
            char name[64], shown[80];
            size_t ln = strlen(headers[h]), at = ln / 2;
            memcpy(name, headers[h], at);
            name[at] = (char)bytes[k];
            memcpy(name + at + 1, headers[h] + at, ln - at);
            snprintf(shown, sizeof shown, "%.*s\\x%02x%s", (int)at, headers[h], bytes[k], headers[h] + at);
            n = request(req, sizeof req, name, ln + 1, values[h], strlen(values[h]));
            snprintf(what, sizeof what, "%s with 0x%02x in its name", headers[h], bytes[k]);
            refused(port, req, n, shown, bytes[k], what);
        }
    }
    /* a NUL in the request line (libevent read "GET /health" and no version) */
    static const char line[] = "GET /health\0x HTTP/1.1\r\nHost: x\r\n\r\n";
    cr_assert_eq(exchange(port, line, sizeof line - 1, body, sizeof body), 400, "%s", body);
    json_t *j = parse(body);
    const char *msg = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    cr_assert(msg && strstr(msg, "the request line holds a NUL byte (0x00)"), "%s", body);
    json_decref(j);
    /* HTAB is allowed inside a value; and the server still answers */
    n = request(req, sizeof req, "X-Custom", 8, "a\tb", 3);
    cr_assert_eq(exchange(port, req, n, body, sizeof body), 200, "%s", body);
}

Test(field_bytes, serve_refuses_control_bytes_in_any_header_by_name)
{
    probe(srv.port);
}

Test(field_bytes, proxy_refuses_control_bytes_in_any_header_by_name)
{
    probe(start_proxy());
}

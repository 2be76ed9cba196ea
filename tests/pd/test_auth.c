/* API keys: a server and the proxy accept only the whole key (a 400-character key's first 292
 * characters were once enough), /health and /metrics stay open, and a proxy whose instances want
 * a key sends it to them, so a deployment with keys on every process still answers. */
#define _GNU_SOURCE   /* strcasestr */
#include <criterion/criterion.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include "engine/genmodel.h"
#include "../tmpmodel.h"
#include "pd/server.h"
#include "proxy/proxy.h"
#include "util.h"

static char dir[64];
static struct pd_server *P, *D;
static struct pd_proxy *X;
static pthread_t tp, td, tx;
static char long_key[401];

static struct pd_server *server(int role, const char *key, pthread_t *t)
{
    struct pd_server *s;
    pd_err e = {0};
    struct pd_server_opts o = {.model_dir = dir, .threads = 1, .max_num_seqs = 4, .max_model_len = 256,
                               .served_name = "tiny", .role = role, .kv_timeout_ms = 3000, .api_key = key};
    cr_assert_eq(pd_server_create(&o, &s, &e), 0, "%s", e.msg);
    pthread_create(t, NULL, run_server, s);
    return s;
}

/* A proxy in front of P and D (prefill and decode), or of D alone as a colocated server. */
static void start_proxy(const char *key, const char *backend_key, int pd)
{
    static char p1[32], d1[32];
    snprintf(p1, sizeof p1, "127.0.0.1:%d", pd ? pd_server_port(P) : 1);
    snprintf(d1, sizeof d1, "127.0.0.1:%d", pd_server_port(D));
    struct pd_proxy_opts o = {.port = 0, .n_prefill = pd, .n_decode = 1, .api_key = key,
                              .backend_api_key = backend_key};
    o.prefill[0] = p1;
    o.decode[0] = d1;
    pd_err e = {0};
    cr_assert_eq(pd_proxy_create(&o, &X, &e), 0, "%s", e.msg);
    pthread_create(&tx, NULL, run_proxy, X);
}

static void setup(void)
{
    for (int i = 0; i < 400; i++)
        long_key[i] = "abcdefghijklmnopqrstuvwxyz0123456789"[i % 36];
    long_key[400] = 0;
    tmp_model("v4-tiny", 3, dir, sizeof dir);
}

static void teardown(void)
{
    proxy_shutdown(&X, tx);
    struct pd_server *s[2] = {P, D};
    pthread_t t[2] = {tp, td};
    for (int i = 0; i < 2; i++)
        if (s[i]) {
            pd_server_stop(s[i]);
            pthread_join(t[i], NULL);
            pd_server_destroy(s[i]);
        }
    P = D = NULL;
    rm_model(dir);
}

TestSuite(auth, .init = setup, .fini = teardown, .timeout = 120);

static const char body[] = "{\"prompt\":\"The sea froze\",\"max_tokens\":3,\"temperature\":0}";

/* The status of a completion sent to port with "Authorization: Bearer <key>" (key NULL: none). */
static int with_key(int port, const char *path, const char *key, char *out, size_t cap)
{
    static char hdr[600];
    snprintf(hdr, sizeof hdr, "-H 'Authorization: Bearer %s'", key ? key : "");
    return curl_port(port, path, strcmp(path, "/v1/completions") ? NULL : body, key ? hdr : NULL, out, cap);
}

/* Only the whole key opens port's completions; a prefix, a longer key and none get a 401 whose
 * body is an OpenAI error; /health and /metrics answer without a key. */
static void only_the_whole_key(int port)
{
    char out[8192], part[401];
    snprintf(part, sizeof part, "%.*s", 292, long_key);
    const char *wrong[] = {NULL, "", part, "x", NULL};
    char longer[402];
    snprintf(longer, sizeof longer, "%sx", long_key);
    wrong[4] = longer;
    for (int i = 0; i < 5; i++) {
        int code = with_key(port, "/v1/completions", wrong[i], out, sizeof out);
        cr_assert_eq(code, 401, "key of %zu characters: %d %s", wrong[i] ? strlen(wrong[i]) : 0, code, out);
        json_t *j = parse(out);
        cr_assert(json_is_string(json_object_get(json_object_get(j, "error"), "message")), "%s", out);
        json_decref(j);
    }
    cr_assert_eq(with_key(port, "/v1/completions", long_key, out, sizeof out), 200, "%s", out);
    cr_assert_eq(with_key(port, "/v1/models", long_key, out, sizeof out), 200, "%s", out);
    /* the scheme's name in any case, more than one space after it (RFC 9110 11.4); a 401 says the
     * scheme it wants (RFC 9110 11.6.1), an answer that opened does not */
    char hdr[600], heads[] = "/tmp/pdmoe-auth-heads-XXXXXX", got[4096];
    close(mkstemp(heads));
    snprintf(hdr, sizeof hdr, "-D %s -H 'Authorization: bEARER   %s'", heads, long_key);
    cr_assert_eq(curl_port(port, "/v1/models", NULL, hdr, out, sizeof out), 200, "%s", out);
    FILE *f = fopen(heads, "r");
    size_t n = f ? fread(got, 1, sizeof got - 1, f) : 0;
    got[n] = 0;
    if (f)
        fclose(f);
    cr_assert_null(strcasestr(got, "WWW-Authenticate"), "%s", got);
    for (int i = 0; i < 2; i++) {
        snprintf(hdr, sizeof hdr, "-D %s -H 'Authorization: %s %s'", heads, i ? "Bearer" : "Basic", i ? "x" : long_key);
        cr_assert_eq(curl_port(port, "/v1/models", NULL, hdr, out, sizeof out), 401, "%s", out);
        f = fopen(heads, "r");
        n = f ? fread(got, 1, sizeof got - 1, f) : 0;
        got[n] = 0;
        if (f)
            fclose(f);
        cr_assert_not_null(strcasestr(got, "\r\nWWW-Authenticate: Bearer\r\n"), "%s", got);
    }
    remove(heads);
    cr_assert_eq(with_key(port, "/v1/models", part, out, sizeof out), 401, "%s", out);
    cr_assert_eq(curl_port(port, "/health", NULL, NULL, out, sizeof out), 200, "%s", out);
    cr_assert_eq(curl_port(port, "/metrics", NULL, NULL, out, sizeof out), 200, "%s", out);
}

Test(auth, a_server_takes_only_the_whole_key)
{
    D = server(PD_ROLE_BOTH, long_key, &td);
    only_the_whole_key(pd_server_port(D));
}

Test(auth, a_proxy_takes_only_the_whole_key_and_passes_it_on)
{
    D = server(PD_ROLE_BOTH, long_key, &td);
    start_proxy(long_key, NULL, 0);
    only_the_whole_key(pd_proxy_port(X));
}

/* Prefill and decode instances with their own key behind a proxy with another: the proxy sends
 * the instances' key on completions, /v1/models and /expert_stats, and takes only its own. */
Test(auth, a_pd_deployment_with_keys_everywhere_answers)
{
    P = server(PD_ROLE_PRODUCER, "backend-key", &tp);
    D = server(PD_ROLE_CONSUMER, "backend-key", &td);
    start_proxy("front-key", "backend-key", 1);
    int port = pd_proxy_port(X);
    char out[1 << 16];
    cr_assert_eq(with_key(port, "/v1/completions", "front-key", out, sizeof out), 200, "%s", out);
    json_t *j = parse(out);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")), 3, "%s", out);
    json_decref(j);
    cr_assert_eq(with_key(port, "/v1/models", "front-key", out, sizeof out), 200, "%s", out);
    cr_assert_eq(with_key(port, "/expert_stats", "front-key", out, sizeof out), 200, "%s", out);
    cr_assert_eq(with_key(port, "/v1/completions", "backend-key", out, sizeof out), 401, "%s", out);
    /* the instances still refuse a client without their key */
    cr_assert_eq(with_key(pd_server_port(D), "/v1/completions", "front-key", out, sizeof out), 401, "%s", out);
}

static pid_t spawn(char *const argv[])
{
    pid_t pid = fork_pdmoe();
    if (pid == 0) {
        freopen("/dev/null", "w", stderr);
        execv(argv[0], argv);
        _exit(127);
    }
    return pid;
}

static void wait_health(int port)
{
    char out[256];
    for (int i = 0; i < 300 && curl_port(port, "/health", NULL, NULL, out, sizeof out) != 200; i++)
        usleep(50000);
    cr_assert_eq(curl_port(port, "/health", NULL, NULL, out, sizeof out), 200, "nothing answers on port %d", port);
}

/* The programs as `pdmoe up --api-key K` starts them: `pdmoe serve --api-key K` behind `pdmoe
 * proxy --api-key K`, which sends K on to the server. */
Test(auth, pdmoe_serve_and_proxy_with_one_key)
{
    const char *bin = pdmoe_bin();
    char sp[16], pp[16], dec[32];
    snprintf(sp, sizeof sp, "%d", free_port());
    snprintf(pp, sizeof pp, "%d", free_port());
    snprintf(dec, sizeof dec, "127.0.0.1:%s", sp);
    char *serve[] = {(char *)bin, "serve", "--model", dir, "--port", sp, "--threads", "1", "--max-model-len", "256",
                     "--served-model-name", "tiny", "--api-key", long_key, NULL};
    char *proxy[] = {(char *)bin, "proxy", "--decode", dec, "--port", pp, "--api-key", long_key, NULL};
    pid_t s = spawn(serve), x = spawn(proxy);
    wait_health(atoi(sp));
    wait_health(atoi(pp));
    char out[8192], part[300];
    snprintf(part, sizeof part, "%.*s", 292, long_key);
    int ok = with_key(atoi(pp), "/v1/completions", long_key, out, sizeof out);
    int no = with_key(atoi(pp), "/v1/completions", part, out, sizeof out);
    int direct = with_key(atoi(sp), "/v1/completions", NULL, out, sizeof out);
    int sx, ss;
    kill(x, SIGTERM);
    kill(s, SIGTERM);
    int ended = reap_within(x, 0, &sx) & reap_within(s, 0, &ss);
    cr_assert(ended, "pdmoe proxy or serve did not exit within 60 s of SIGTERM");
    child_exited_cleanly(x, sx, "pdmoe proxy --api-key");
    child_exited_cleanly(s, ss, "pdmoe serve --api-key");
    cr_assert_eq(ok, 200);
    cr_assert_eq(no, 401);
    cr_assert_eq(direct, 401);
}

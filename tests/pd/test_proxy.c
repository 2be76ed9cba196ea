/* The PD proxy in front of prefill and decode servers on loopback: the same tokens as a colocated
 * server, streamed and not; a dead prefill instance is retried elsewhere; a dead decode instance
 * gives a 502 with a JSON error, never a 200 with an empty body; 4xx from an instance reach the
 * client unchanged and are not retried; an instance that does not answer /health is taken out and
 * back in once it does. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#ifdef __SANITIZE_ADDRESS__
#include <sanitizer/lsan_interface.h>
#endif

#include "engine/genmodel.h"
#include "../tmpmodel.h"
#include "core/timing.h"
#include "pd/server.h"
#include "model/tokenizer.h"
#include "proxy/proxy.h"
#include "proxy/internal.h"
#include "util.h"

static char dir[64];
static struct pd_server *P, *D, *C;
static struct pd_proxy *X;
static pthread_t tp, td, tc, tx;

static struct pd_server *server(int role, pthread_t *t)
{
    struct pd_server *s;
    pd_err e = {0};
    struct pd_server_opts o = {.model_dir = dir, .threads = 1, .max_num_seqs = 8, .max_model_len = 512,
                               .served_name = "tiny", .role = role, .kv_timeout_ms = 3000};
    cr_assert_eq(pd_server_create(&o, &s, &e), 0, "%s", e.msg);
    pthread_create(t, NULL, run_server, s);
    return s;
}

static void setup(void)
{
    tmp_model("v4-tiny", 11, dir, sizeof dir);
    P = server(PD_ROLE_PRODUCER, &tp);
    D = server(PD_ROLE_CONSUMER, &td);
    C = server(PD_ROLE_BOTH, &tc);
}

/* The proxy X in front of P and D (dead_decode: of a decode instance where nobody listens, port 1);
 * first_prefill: the port of another prefill instance, listed before P (0: none). */
static void start_proxy(int first_prefill, int dead_decode)
{
    static char p1[32], p2[32], d1[32];
    snprintf(p1, sizeof p1, "127.0.0.1:%d", first_prefill);
    snprintf(p2, sizeof p2, "127.0.0.1:%d", pd_server_port(P));
    snprintf(d1, sizeof d1, "127.0.0.1:%d", dead_decode ? 1 : pd_server_port(D));
    struct pd_proxy_opts o = {.port = 0, .n_prefill = first_prefill ? 2 : 1, .n_decode = 1};
    o.prefill[0] = first_prefill ? p1 : p2;
    o.prefill[1] = p2;
    o.decode[0] = d1;
    pd_err e = {0};
    cr_assert_eq(pd_proxy_create(&o, &X, &e), 0, "%s", e.msg);
    pthread_create(&tx, NULL, run_proxy, X);
}

/* Waits up to 5 s for the proxy's /readiness to count `np` prefill and `nd` decode instances up
 * (each counts from its first answer to the proxy's checks). */
static void wait_up(int port, int np, int nd)
{
    char out[8192];
    int got[2] = {-1, -1};
    for (int i = 0; i < 250; i++) {
        curl_port(port, "/readiness", NULL, NULL, out, sizeof out);
        json_t *j = json_loads(out, 0, NULL);
        got[0] = (int)json_integer_value(json_object_get(json_object_get(j, "prefill"), "up"));
        got[1] = (int)json_integer_value(json_object_get(json_object_get(j, "decode"), "up"));
        json_decref(j);
        if (got[0] == np && got[1] == nd)
            return;
        usleep(20000);
    }
    cr_assert_fail("after 5 s, %d prefill and %d decode instances up, not %d and %d: %s", got[0], got[1], np, nd, out);
}

static void teardown(void)
{
    proxy_shutdown(&X, tx);
    struct pd_server *s[3] = {P, D, C};
    pthread_t t[3] = {tp, td, tc};
    for (int i = 0; i < 3; i++) {
        pd_server_stop(s[i]);
        pthread_join(t[i], NULL);
        pd_server_destroy(s[i]);
    }
    rm_model(dir);
}

TestSuite(proxy, .init = setup, .fini = teardown, .timeout = 120);

static char *field(const char *json, const char *what)
{
    json_t *j = parse(json);
    json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
    char *s = json_dumps(json_object_get(ch, what), JSON_COMPACT | JSON_ENCODE_ANY);
    json_decref(j);
    return s;
}

static void same_as_colocated(void)
{
    const char *body = "{\"model\":\"tiny\",\"prompt\":\"Good morning, good afternoon and good night\","
                       "\"max_tokens\":16,\"temperature\":0,\"return_token_ids\":true}";
    char a[8192], b[8192];
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/completions", body, NULL, a, sizeof a), 200, "%s", a);
    cr_assert_eq(curl_port(pd_server_port(C), "/v1/completions", body, NULL, b, sizeof b), 200, "%s", b);
    char *x = field(a, "token_ids"), *y = field(b, "token_ids");
    cr_assert_str_eq(x, y);
    free(x);
    free(y);
    /* streamed chat through the proxy adds up to the colocated plain answer */
    const char *chat = "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"Why is the sky blue?\"}],"
                       "\"max_tokens\":16,\"temperature\":0%s}";
    char c1[512], c2[512];
    snprintf(c1, sizeof c1, chat, "");
    snprintf(c2, sizeof c2, chat, ",\"stream\":true");
    cr_assert_eq(curl_port(pd_server_port(C), "/v1/chat/completions", c1, NULL, b, sizeof b), 200);
    json_t *j = parse(b);
    const char *want = json_string_value(
        json_object_get(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message"), "content"));
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/chat/completions", c2, NULL, a, sizeof a), 200, "%s", a);
    char got[8192] = "";
    int done = 0;
    for (char *line = strtok(a, "\n"); line; line = strtok(NULL, "\n")) {
        if (!strcmp(line, "data: [DONE]")) {
            done = 1;
            continue;
        }
        json_t *c = parse(line + 6);
        strcat(got, json_string_value(json_object_get(json_object_get(json_array_get(json_object_get(c, "choices"), 0),
                                                                       "delta"), "content")));
        json_decref(c);
    }
    cr_assert(done);
    cr_assert_str_eq(got, want);
    json_decref(j);
}

Test(proxy, same_tokens_as_colocated)
{
    start_proxy(0, 0);
    same_as_colocated();
}

/* The tokens_per_expert rows of a GET /expert_stats answer, compact. */
static char *stats_rows(int port, const char *path)
{
    static char out[1 << 16];
    cr_assert_eq(curl_port(port, path, NULL, NULL, out, sizeof out), 200, "%s: %s", path, out);
    json_t *j = parse(out);
    char *rows = json_dumps(json_object_get(j, "tokens_per_expert"), JSON_COMPACT);
    json_decref(j);
    return rows;
}

/* GET /expert_stats through the proxy: a role's instances or both, summed; a bad role is a 400
 * naming it, a dead instance a 502 naming it. */
Test(proxy, expert_stats_of_the_deployment)
{
    start_proxy(0, 0);
    same_as_colocated();
    int x = pd_proxy_port(X);
    char *pre = stats_rows(pd_server_port(P), "/expert_stats"), *dec = stats_rows(pd_server_port(D), "/expert_stats");
    char *xp = stats_rows(x, "/expert_stats?role=prefill"), *xd = stats_rows(x, "/expert_stats?role=decode"),
         *xb = stats_rows(x, "/expert_stats");
    cr_assert_str_eq(xp, pre);
    cr_assert_str_eq(xd, dec);
    cr_assert_str_neq(pre, dec, "prefill and decode ran the same tokens?");
    json_t *a = json_loads(pre, 0, NULL), *b = json_loads(dec, 0, NULL), *both = json_loads(xb, 0, NULL);
    for (size_t l = 0; l < json_array_size(a); l++)
        for (size_t e = 0; e < json_array_size(json_array_get(a, l)); e++)
            cr_assert_eq(json_integer_value(json_array_get(json_array_get(both, l), e)),
                         json_integer_value(json_array_get(json_array_get(a, l), e)) +
                             json_integer_value(json_array_get(json_array_get(b, l), e)),
                         "layer %zu expert %zu", l, e);
    json_decref(a);
    json_decref(b);
    json_decref(both);
    free(pre);
    free(dec);
    free(xp);
    free(xd);
    free(xb);
    char out[8192];
    cr_assert_eq(curl_port(x, "/expert_stats?role=both", NULL, NULL, out, sizeof out), 400, "%s", out);
    cr_assert(strstr(out, "\"param\":\"role\""), "%s", out);
    cr_assert_eq(curl_port(x, "/expert_stats", "{}", NULL, out, sizeof out), 405, "%s", out);
    /* the proxy's routes take their own methods only, as the servers' do */
    cr_assert_eq(curl_port(x, "/v1/models", NULL, "-X DELETE -i", out, sizeof out), 405, "%s", out);
    cr_assert(strstr(out, "Allow: GET, HEAD\r\n") && strstr(out, "\"message\":\"use GET\""), "%s", out);
    cr_assert_eq(curl_port(x, "/v1/completions", NULL, "-X PUT", out, sizeof out), 405, "%s", out);
}

Test(proxy, expert_stats_name_a_dead_instance)
{
    start_proxy(0, 1);
    char out[8192];
    cr_assert_eq(curl_port(pd_proxy_port(X), "/expert_stats", NULL, NULL, out, sizeof out), 502, "%s", out);
    cr_assert(strstr(out, "the decode instance 127.0.0.1:1 did not answer"), "%s", out);
    cr_assert_eq(curl_port(pd_proxy_port(X), "/expert_stats?role=prefill", NULL, NULL, out, sizeof out), 200, "%s",
                 out);
}

/* The proxy's /metrics and its instances' keep Prometheus' conventions (util.h). */
Test(proxy, metrics_follow_prometheus_conventions)
{
    start_proxy(0, 0);
    same_as_colocated();
    static char out[1 << 17];
    const int ports[3] = {pd_proxy_port(X), pd_server_port(P), pd_server_port(D)};
    const char *what[3] = {"proxy /metrics", "prefill /metrics", "decode /metrics"};
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(curl_port(ports[i], "/metrics", NULL, NULL, out, sizeof out), 200);
        prom_conventions(out, what[i]);
    }
}

/* A dead decode instance: the request that finds it out is a 502 naming it (unless its /health
 * check found it first), never an empty 200; once it is known to be down, requests are a 503 with a
 * Retry-After and a message saying that no decode instance is up (the client's cue to retry,
 * where a 502 says an instance failed its request), streaming or not. */
Test(proxy, dead_decode_instance_is_a_502_then_a_503_with_retry_after)
{
    start_proxy(0, 1);
    char out[8192];
    int code = curl_port(pd_proxy_port(X), "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":4}", NULL, out,
                         sizeof out);
    cr_assert(code == 502 || code == 503, "%d %s", code, out);
    json_t *j = parse(out);
    cr_assert(json_is_string(json_object_get(json_object_get(j, "error"), "message")), "%s", out);
    json_decref(j);
    static const char *const bodies[] = {"{\"prompt\":\"x\",\"max_tokens\":4}",
                                         "{\"prompt\":\"x\",\"max_tokens\":4,\"stream\":true}"};
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/completions", bodies[i], "-i", out, sizeof out), 503, "%s: %s",
                     bodies[i], out);
        cr_assert(strstr(out, "Retry-After: "), "%s", out);
        cr_assert(strstr(out, "no decode instance is up (1 configured; the last tried: 127.0.0.1:1, no answer)"),
                  "%s", out);
        j = parse(strstr(out, "{"));
        cr_assert_str_eq(json_string_value(json_object_get(json_object_get(j, "error"), "type")), "server_error");
        json_decref(j);
    }
}

/* Likewise with no prefill instance up: once its one instance is known down, a 503 naming the role. */
Test(proxy, no_prefill_instance_up_is_a_503_with_retry_after)
{
    static char d1[32];
    snprintf(d1, sizeof d1, "127.0.0.1:%d", pd_server_port(D));
    struct pd_proxy_opts o = {.port = 0, .n_prefill = 1, .n_decode = 1};
    o.prefill[0] = "127.0.0.1:1";
    o.decode[0] = d1;
    pd_err e = {0};
    cr_assert_eq(pd_proxy_create(&o, &X, &e), 0, "%s", e.msg);
    pthread_create(&tx, NULL, run_proxy, X);
    char out[8192];
    int code = curl_port(pd_proxy_port(X), "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":4}", NULL, out,
                         sizeof out);
    cr_assert(code == 502 || code == 503, "%d %s", code, out);
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":4}", "-i", out,
                           sizeof out), 503, "%s", out);
    cr_assert(strstr(out, "Retry-After: "), "%s", out);
    cr_assert(strstr(out, "no prefill instance is up (1 configured; the last tried: 127.0.0.1:1, no answer)"), "%s",
              out);
}

Test(proxy, client_errors_pass_through_unretried)
{
    start_proxy(0, 0);
    char out[8192];
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/completions", "{\"prompt\": 3}", NULL, out, sizeof out), 400);
    cr_assert(strstr(out, "\"param\":\"prompt\""), "%s", out);
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/completions", "not json", NULL, out, sizeof out), 400);
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":99999}", NULL, out,
                           sizeof out), 400, "%s", out);
    cr_assert_eq(curl_port(pd_proxy_port(X), "/metrics", NULL, NULL, out, sizeof out), 200);
    cr_assert(strstr(out, "pdmoe_proxy_retries_total 0\n"), "%s", out);
    /* each counted once as the client's: the third is the decode instance's 400 (max_tokens past its
     * context), which was counted nowhere and left the proxy's counters short of its requests */
    cr_assert(strstr(out, "pdmoe_proxy_errors_total{kind=\"bad_request\"} 3\n"), "%s", out);
    /* and each is one of the requests: the one the proxy refused itself ("not json") was an error
     * without being a request, so errors could pass the requests */
    cr_assert(strstr(out, "pdmoe_proxy_requests_total 3\n"), "%s", out);
    /* a whole (not streamed) answer has no first token the proxy sees: its time went into the TTFT
     * histogram as the end-to-end latency */
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":4}", NULL, out,
                           sizeof out), 200, "%s", out);
    cr_assert_eq(metric_port(pd_proxy_port(X), "pdmoe_proxy_e2e_request_latency_seconds_count"), 1);
    cr_assert_eq(metric_port(pd_proxy_port(X), "pdmoe_proxy_time_to_first_token_seconds_count"), 0);
    cr_assert_eq(metric_port(pd_proxy_port(X), "pdmoe_proxy_requests_total"), 4);
}

static int metric(int port, const char *name)
{
    return metric_port(port, name);
}

/* A request the decode instance would refuse is refused before any prefill: the proxy once set
 * max_tokens to 1 for the prefill instance, so each of these was prefilled, held a lease and a
 * sequence there (30 s, or until revoked), and only then met its 400. The prefill instance now
 * gets the body as it came and checks it all; then a streamed request still goes through. */
Test(proxy, bad_requests_are_refused_before_the_prefill)
{
    start_proxy(0, 0);
    const int pp = pd_server_port(P);
    char out[8192], prompt[4096];
    int at = snprintf(prompt, sizeof prompt, "[");
    for (int i = 0; i < 500; i++)
        at += snprintf(prompt + at, sizeof prompt - (size_t)at, "%s%d", i ? "," : "", 10 + i % 50);
    snprintf(prompt + at, sizeof prompt - (size_t)at, "]");
    char over[4200];
    snprintf(over, sizeof over, "{\"prompt\":%s,\"max_tokens\":100}", prompt);
    static const struct { const char *body, *param; } bad[] = {
        {"{\"prompt\":\"Hello\",\"max_tokens\":0}", "max_tokens"},
        {"{\"prompt\":\"Hello\",\"max_tokens\":\"5\"}", "max_tokens"},
        {"{\"prompt\":\"Hello\",\"max_tokens\":5,\"max_completion_tokens\":6}", "max_completion_tokens"},
        {"{\"prompt\":\"Hello\",\"max_tokens\":5,\"stream_options\":{\"include_usage\":true}}", "stream_options"},
        {NULL, "max_tokens"},   /* 500 prompt tokens and 100 more: past the 512-token context */
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        const char *b = bad[i].body ? bad[i].body : over;
        cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/completions", b, NULL, out, sizeof out), 400, "%s: %s", b, out);
        char want[64];
        snprintf(want, sizeof want, "\"param\":\"%s\"", bad[i].param);
        cr_assert(strstr(out, want), "%s: %s", b, out);
    }
    cr_assert_eq(metric(pp, "pdmoe_requests_total"), 0, "the prefill instance accepted a request it should refuse");
    cr_assert_eq(metric(pp, "pdmoe_kv_leases"), 0);
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/completions",
                           "{\"prompt\":\"Hello\",\"max_tokens\":4,\"stream\":true,\"stream_options\":{\"include_usage\":true}}",
                           NULL, out, sizeof out), 200, "%s", out);
    cr_assert(strstr(out, "data: [DONE]") && strstr(out, "\"usage\""), "%s", out);
    cr_assert_eq(metric(pp, "pdmoe_requests_total"), 1);
}

/* A histogram of the proxy's /metrics is well formed (cumulative buckets, +Inf == count); returns
 * its count. */
static int histogram(const char *name)
{
    char out[1 << 14], key[160];
    cr_assert_eq(curl_port(pd_proxy_port(X), "/metrics", NULL, NULL, out, sizeof out), 200);
    snprintf(key, sizeof key, "# TYPE %s histogram\n", name);
    char *p = strstr(out, key);
    cr_assert_not_null(p, "no histogram %s in /metrics", name);
    long prev = 0, v = 0;
    for (p = strstr(p, "_bucket{le=\""); p && strncmp(p, "_bucket", 7) == 0; p = strstr(p, "\n") + 1 + strlen(name)) {
        v = atol(strchr(p, '}') + 1);
        cr_assert_geq(v, prev, "%s: buckets not cumulative", name);
        prev = v;
    }
    snprintf(key, sizeof key, "%s_count", name);
    int count = metric_port(pd_proxy_port(X), key);
    cr_assert_eq(v, count, "%s: +Inf bucket %ld, count %d", name, v, count);
    return count;
}

Test(proxy, sixty_four_concurrent_streams)
{
    start_proxy(0, 0);
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "seq 64 | xargs -P 64 -I{} curl -s -N -o /dev/null -w '%%{http_code}\\n' http://127.0.0.1:%d/v1/completions "
             "-d '{\"prompt\":\"client {} says hello\",\"max_tokens\":16,\"stream\":true,\"temperature\":0.7,\"seed\":{}}'",
             pd_proxy_port(X));
    int ok = count_200(cmd);
    cr_assert_eq(ok, 64);
    /* every KV block back on the decode instance; the prefill's leases all released */
    for (int i = 0; i < 100 && metric(pd_server_port(P), "pdmoe_kv_leases") > 0; i++)
        usleep(20000);
    cr_assert_eq(metric(pd_server_port(P), "pdmoe_kv_leases"), 0);
    cr_assert_eq(metric(pd_server_port(P), "pdmoe_kv_blocks_free"), metric(pd_server_port(P), "pdmoe_kv_blocks_capacity"));
    cr_assert_eq(metric(pd_server_port(D), "pdmoe_kv_blocks_free"), metric(pd_server_port(D), "pdmoe_kv_blocks_capacity"));
    cr_assert_eq(metric(pd_server_port(D), "pdmoe_kv_transfers_total"), 64);
    cr_assert_eq(metric(pd_server_port(D), "pdmoe_kv_recomputes_total"), 0);
    /* the latency histograms saw every request; TPOT needs two chunks, ITL one per later chunk */
    cr_assert_eq(histogram("pdmoe_proxy_time_to_first_token_seconds"), 64);
    cr_assert_eq(histogram("pdmoe_proxy_e2e_request_latency_seconds"), 64);
    int tpot = histogram("pdmoe_proxy_time_per_output_token_seconds");
    cr_assert(tpot > 0 && tpot <= 64, "%d requests with a TPOT", tpot);
    cr_assert_geq(histogram("pdmoe_proxy_inter_token_latency_seconds"), tpot);
}

Test(proxy, a_full_decode_pool_queues_requests_with_correct_tokens)
{
    /* a decode instance whose KV pool holds about one request at a time: the others wait in its
     * queue (admission against prompt + max_tokens) and every answer is still the colocated one */
    pd_server_stop(D);
    pthread_join(td, NULL);
    pd_server_destroy(D);
    pd_err e = {0};
    struct pd_server_opts o = {.model_dir = dir, .threads = 1, .max_num_seqs = 8, .max_model_len = 512,
                               .served_name = "tiny", .role = PD_ROLE_CONSUMER, .kv_timeout_ms = 3000,
                               .kv_cache_bytes = 8 * 18432 + 16 * 1024};   /* 8 slots, 16 blocks */
    cr_assert_eq(pd_server_create(&o, &D, &e), 0, "%s", e.msg);
    pthread_create(&td, NULL, run_server, D);
    start_proxy(0, 0);
    char cmd[2048], want[6][8192];
    for (int i = 0; i < 6; i++) {
        char body[512];
        snprintf(body, sizeof body, "{\"model\":\"tiny\",\"prompt\":\"request %d wants a long answer\",\"max_tokens\":150,"
                 "\"temperature\":0,\"ignore_eos\":true,\"return_token_ids\":true}", i);
        cr_assert_eq(curl_port(pd_server_port(C), "/v1/completions", body, NULL, want[i], sizeof want[i]), 200);
    }
    snprintf(cmd, sizeof cmd,
             "seq 0 5 | xargs -P 6 -I{} sh -c \"curl -s -o %s/out.{} http://127.0.0.1:%d/v1/completions -d "
             "'{\\\"model\\\":\\\"tiny\\\",\\\"prompt\\\":\\\"request {} wants a long answer\\\",\\\"max_tokens\\\":150,"
             "\\\"temperature\\\":0,\\\"ignore_eos\\\":true,\\\"return_token_ids\\\":true}'\"",
             dir, pd_proxy_port(X));
    cr_assert_eq(system(cmd), 0);
    for (int i = 0; i < 6; i++) {
        char path[128], got[8192];
        snprintf(path, sizeof path, "%s/out.%d", dir, i);
        FILE *f = fopen(path, "r");
        cr_assert_not_null(f);
        size_t n = fread(got, 1, sizeof got - 1, f);
        got[n] = 0;
        fclose(f);
        unlink(path);
        char *x = field(got, "token_ids"), *y = field(want[i], "token_ids");
        cr_assert_str_eq(x, y, "request %d", i);
        free(x);
        free(y);
    }
    cr_assert_eq(metric(pd_server_port(D), "pdmoe_kv_blocks_free"), metric(pd_server_port(D), "pdmoe_kv_blocks_capacity"));
    cr_assert_eq(metric(pd_server_port(D), "pdmoe_kv_blocks_capacity"), 16);
    /* one that could never fit is refused, not left waiting */
    char out[4096];
    cr_assert_eq(curl_port(pd_server_port(D), "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":400}", NULL, out,
                           sizeof out), 400, "%s", out);
    cr_assert(strstr(out, "KV blocks"), "%s", out);
}

Test(proxy, an_instance_is_taken_out_while_its_health_fails_and_back_once_it_answers)
{
    int late = free_port();
    char p1[32], d1[32], d2[32], key[128], out[8192];
    snprintf(p1, sizeof p1, "127.0.0.1:%d", pd_server_port(P));
    snprintf(d1, sizeof d1, "127.0.0.1:%d", late);
    snprintf(d2, sizeof d2, "127.0.0.1:%d", pd_server_port(D));
    struct pd_proxy_opts o = {.port = 0, .n_prefill = 1, .n_decode = 2, .health_interval_ms = 50};
    o.prefill[0] = p1;
    o.decode[0] = d1;
    o.decode[1] = d2;
    pd_err e = {0};
    cr_assert_eq(pd_proxy_create(&o, &X, &e), 0, "%s", e.msg);
    pthread_create(&tx, NULL, run_proxy, X);
    snprintf(key, sizeof key, "pdmoe_proxy_instance_up{role=\"decode\",instance=\"%s\"}", d1);
    int out_of_it = 0;
    for (int i = 0; i < 100 && !out_of_it; i++) {
        out_of_it = metric_key(pd_proxy_port(X), key) == 0;
        if (!out_of_it)
            usleep(20000);
    }
    cr_assert(out_of_it, "nothing listens on %s, yet it is still up after 2 s", d1);
    wait_up(pd_proxy_port(X), 1, 1);
    /* no request goes to it meanwhile: every one is a 200 at once, none retried */
    for (int i = 0; i < 3; i++)
        cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":2}", NULL, out,
                               sizeof out), 200, "%s", out);
    cr_assert_eq(metric_key(pd_proxy_port(X), "pdmoe_proxy_retries_total"), 0);
    /* it comes to life: the next check (backoff 0.5 s doubling) takes it back */
    struct pd_server *L;
    pthread_t tl;
    struct pd_server_opts so = {.model_dir = dir, .threads = 1, .max_num_seqs = 4, .max_model_len = 512,
                                .served_name = "tiny", .role = PD_ROLE_CONSUMER, .port = late};
    cr_assert_eq(pd_server_create(&so, &L, &e), 0, "%s", e.msg);
    pthread_create(&tl, NULL, run_server, L);
    int back = 0;
    for (int i = 0; i < 500 && !back; i++) {
        back = metric_key(pd_proxy_port(X), key) == 1;
        if (!back)
            usleep(20000);
    }
    char ej[160];
    snprintf(ej, sizeof ej, "pdmoe_proxy_instance_ejections_total{role=\"decode\",instance=\"%s\"}", d1);
    int ejections = (int)metric_key(pd_proxy_port(X), ej);
    proxy_shutdown(&X, tx);
    pd_server_stop(L);
    pthread_join(tl, NULL);
    pd_server_destroy(L);
    cr_assert(back, "%s answers /health, yet it is not taken back in 10 s", d1);
    cr_assert_eq(ejections, 0, "an instance that never answered was never in, so never taken out");
}

/* Clients that hang up before their answer (in the prefill, or mid-stream) cost the proxy nothing:
 * under the sanitizers, a request libevent left to the proxy and never freed is a leak at exit. */
Test(proxy, clients_that_hang_up_leave_nothing_behind)
{
    start_proxy(0, 0);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "seq 12 | xargs -P 12 -I{} curl -s -N -m 0.%%d -o /dev/null http://127.0.0.1:%d/v1/completions "
             "-d '{\"prompt\":\"hang up {}\",\"max_tokens\":400,\"ignore_eos\":true,\"stream\":true}'", pd_proxy_port(X));
    for (int t = 1; t <= 3; t++) {
        char c[600];
        snprintf(c, sizeof c, cmd, t);
        cr_assert_neq(system(c), -1);
    }
    /* every request the proxy received ends: completed, or an error of some kind (most of them the
     * client's hang-up; a curl whose 0.1 s ran out before it connected never reached the proxy) */
    static const char *const kinds[] = {"bad_request", "prefill_failed", "decode_failed", "client_cancelled"};
    const char *cancelled = "pdmoe_proxy_errors_total{kind=\"client_cancelled\"}";
    int px = pd_proxy_port(X), settled = 0, received = 0, ended = 0;
    for (int i = 0; i < 500 && !settled; i++) {   /* 10 s: a prefill may still be running on a loaded machine */
        received = (int)metric_key(px, "pdmoe_proxy_requests_total");
        ended = (int)metric_key(px, "pdmoe_proxy_completed_total");
        for (int k = 0; k < 4; k++) {
            char key[96];
            snprintf(key, sizeof key, "pdmoe_proxy_errors_total{kind=\"%s\"}", kinds[k]);
            ended += (int)metric_key(px, key);
        }
        settled = received > 0 && ended == received;
        if (!settled)
            usleep(20000);
    }
    if (!settled) {   /* what the proxy says of them, for the failure's message */
        char m[1 << 14];
        curl_port(px, "/metrics", NULL, NULL, m, sizeof m);
        cr_assert(settled, "of %d requests received, %d ended:\n%s", received, ended, m);
    }
    cr_assert_gt(metric_key(px, cancelled), 0, "no client hung up before its answer ended");
    char out[8192];
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":2}", NULL, out,
                           sizeof out), 200, "%s", out);
#ifdef __SANITIZE_ADDRESS__
    proxy_shutdown(&X, tx);
    cr_assert_eq(__lsan_do_recoverable_leak_check(), 0, "the proxy leaked (LeakSanitizer's report above)");
#endif
}

/* A prefill whose first token carries a 0x00 byte answers with "\u0000" in its text: the proxy
 * must still read its kv_transfer_params (it parsed the answer without JSON_ALLOW_NUL and gave a
 * 502 "answered without kv_transfer_params"). The seed is found on the colocated server, whose
 * first token equals the prefill's for the same request. */
Test(proxy, a_first_token_with_a_nul_byte_goes_through)
{
    start_proxy(0, 0);
    struct pd_tok *tok = tok_of(dir);
    int32_t nul = nul_token_id(tok);
    pd_tok_free(tok);
    const char *fmt = "{\"prompt\":\"x\",\"max_tokens\":%d,\"temperature\":2,\"return_token_ids\":true,\"seed\":%d}";
    char body[256], out[8192];
    int seed = -1;
    for (int s = 0; s < 6000 && seed < 0; s++) {
        snprintf(body, sizeof body, fmt, 1, s);
        cr_assert_eq(curl_port(pd_server_port(C), "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
        json_t *j = parse(out);
        json_t *ids = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids");
        if (json_integer_value(json_array_get(ids, 0)) == nul)
            seed = s;
        json_decref(j);
    }
    cr_assert_geq(seed, 0, "no seed below 6000 samples token %d (byte 0x00) first", nul);
    snprintf(body, sizeof body, fmt, 3, seed);
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    cr_assert(strstr(out, "\\u0000"), "%s", out);
}

/* The prefill instance lost the KV it leased (here: the lease expired while the only decode slot
 * was busy; in the field: the instance restarted) and the decode instance's pull is refused with
 * a 403 naming kv_transfer_params. Nothing has reached the client and the proxy wrote those
 * parameters itself: it prefills the request again rather than pass the 403 on. */
Test(proxy, a_lost_kv_handoff_is_prefilled_again)
{
    enum { BUSY = 6 };
    struct pd_server *s[2] = {P, D};
    pthread_t t[2] = {tp, td};
    for (int i = 0; i < 2; i++) {
        pd_server_stop(s[i]);
        pthread_join(t[i], NULL);
        pd_server_destroy(s[i]);
    }
    pd_err e = {0};
    struct pd_server_opts o = {.model_dir = dir, .threads = 1, .max_num_seqs = 8, .max_model_len = 2048,
                               .served_name = "tiny", .role = PD_ROLE_PRODUCER, .kv_timeout_ms = 3000,
                               .kv_lease_ms = 500};
    cr_assert_eq(pd_server_create(&o, &P, &e), 0, "%s", e.msg);
    pthread_create(&tp, NULL, run_server, P);
    o.role = PD_ROLE_CONSUMER;
    o.max_num_seqs = 1;   /* one sequence at a time: the proxy's request waits behind the busy one */
    cr_assert_eq(pd_server_create(&o, &D, &e), 0, "%s", e.msg);
    pthread_create(&td, NULL, run_server, D);
    start_proxy(0, 0);
    const char *body = "{\"model\":\"tiny\",\"prompt\":\"a handoff that is lost once\",\"max_tokens\":8,"
                       "\"temperature\":0,\"return_token_ids\":true}";
    char want[8192], got[8192], cmd[1024];
    cr_assert_eq(curl_port(pd_server_port(C), "/v1/completions", body, NULL, want, sizeof want), 200, "%s", want);
    /* the decode instance's only slot busy for well over the lease: 6 requests of 2000 tokens, one
     * running and BUSY - 1 queued, about 0.4 s each here without sanitizers (2 s with them), 4 times
     * the lease at least (16 took 12 s a test, 63 s under the sanitizers); the metrics asserted below
     * fail the test if the busy slot ever came free within the lease */
    snprintf(cmd, sizeof cmd, "seq %d | xargs -P %d -I{} curl -s -o /dev/null http://127.0.0.1:%d/v1/completions "
             "-d '{\"prompt\":\"busy {}\",\"max_tokens\":2000,\"ignore_eos\":true}' &", BUSY, BUSY,
             pd_server_port(D));
    cr_assert_eq(system(cmd), 0);
    double t0 = pd_now_s();
    int64_t waiting = 0;   /* the count that ended the wait: a second read may come after the first finished */
    while ((waiting = metric_key(pd_server_port(D), "pdmoe_num_requests_waiting")) < BUSY - 1 && pd_now_s() - t0 < 10)
        usleep(10000);
    cr_assert_geq(waiting, BUSY - 1, "%lld requests waited at the decode instance after %.1f s", (long long)waiting,
                  pd_now_s() - t0);
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/completions", body, NULL, got, sizeof got), 200, "%s", got);
    char *x = field(got, "token_ids"), *y = field(want, "token_ids");
    cr_assert_str_eq(x, y);
    free(x);
    free(y);
    /* the scenario happened: the decode instance refused one pull, and the request was prefilled twice */
    cr_assert_geq(metric_key(pd_server_port(D), "pdmoe_errors_total{kind=\"4xx\"}"), 1);
    cr_assert_geq(metric_key(pd_server_port(P), "pdmoe_requests_total"), 2);
    /* the same for a client that streams: the refusal comes before anything was sent, so the proxy
     * prefills again and the stream carries the whole answer, with no error event */
    int64_t refused = metric_key(pd_server_port(D), "pdmoe_errors_total{kind=\"4xx\"}");
    cr_assert_eq(system(cmd), 0);   /* the decode slot busy again */
    t0 = pd_now_s();
    while (metric_key(pd_server_port(D), "pdmoe_num_requests_waiting") < BUSY - 1 && pd_now_s() - t0 < 10)
        usleep(10000);
    cr_assert_geq(metric_key(pd_server_port(D), "pdmoe_num_requests_waiting"), BUSY - 1);
    const char *sbody = "{\"model\":\"tiny\",\"prompt\":\"a handoff that is lost once\",\"max_tokens\":8,"
                        "\"temperature\":0,\"stream\":true}";
    char sse[16384], text[4096] = "";
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/completions", sbody, NULL, sse, sizeof sse), 200, "%s", sse);
    cr_assert_null(strstr(sse, "\"error\""), "%s", sse);
    int done = 0;
    for (char *line = strtok(sse, "\n"); line; line = strtok(NULL, "\n")) {
        if (!strcmp(line, "data: [DONE]")) {
            done = 1;
            continue;
        }
        json_t *c = parse(line + 6);
        strcat(text, json_string_value(json_object_get(json_array_get(json_object_get(c, "choices"), 0), "text")));
        json_decref(c);
    }
    cr_assert(done);
    json_t *w = parse(want);
    cr_assert_str_eq(text, json_string_value(json_object_get(json_array_get(json_object_get(w, "choices"), 0), "text")));
    json_decref(w);
    cr_assert_gt(metric_key(pd_server_port(D), "pdmoe_errors_total{kind=\"4xx\"}"), refused,
                 "the streamed request's hand-off was not lost: the scenario did not happen");
}

/* Routing through a proxy over two colocated servers: with cache_aware, every request of a shared
 * system prompt goes to one server and the two prompts to different ones; with least_loaded (one
 * request at a time: equal loads) every request goes to the first server. The proxy's metrics
 * count the choices by reason and the matched bytes. */
static void route_run(enum pd_route_policy policy, int *home, int64_t counts[2][2])
{
    pthread_t t2;
    struct pd_server *C2 = server(PD_ROLE_BOTH, &t2);
    static char c1[32], c2[32];
    snprintf(c1, sizeof c1, "127.0.0.1:%d", pd_server_port(C));
    snprintf(c2, sizeof c2, "127.0.0.1:%d", pd_server_port(C2));
    struct pd_proxy_opts o = {.port = 0, .n_decode = 2, .route = {.policy = policy}};
    o.decode[0] = c1;
    o.decode[1] = c2;
    pd_err e = {0};
    cr_assert_eq(pd_proxy_create(&o, &X, &e), 0, "%s", e.msg);
    pthread_create(&tx, NULL, run_proxy, X);
    int port = pd_proxy_port(X), ports[2] = {pd_server_port(C), pd_server_port(C2)};
    wait_up(port, 0, 2);
    const char *sys[2] = {"You are a careful assistant who answers in French, briefly, with sources. ",
                          "Tu es un assistant qui repond en anglais, longuement, sans jamais citer. "};
    for (int r = 0; r < 4; r++)
        for (int s = 0; s < 2; s++) {
            int64_t before[2];
            for (int i = 0; i < 2; i++)
                before[i] = metric_key(ports[i], "pdmoe_requests_total");
            char body[512], out[4096];
            snprintf(body, sizeof body, "{\"prompt\":\"%s%s question %d\",\"max_tokens\":2}", sys[s], sys[s], r);
            cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
            for (int i = 0; i < 2; i++)
                counts[s][i] += metric_key(ports[i], "pdmoe_requests_total") - before[i];
            if (r == 0)
                home[s] = metric_key(ports[0], "pdmoe_requests_total") > before[0] ? 0 : 1;
        }
    char key[160];
    snprintf(key, sizeof key, "pdmoe_proxy_routed_total{policy=\"%s\",reason=\"%s\"}", pd_route_policy_name(policy),
             policy == PD_ROUTE_CACHE_AWARE ? "prefix" : "least_loaded");
    cr_expect_eq(metric_key(port, key), policy == PD_ROUTE_CACHE_AWARE ? 6 : 8, "%s", key);
    int64_t matched = metric_key(port, "pdmoe_proxy_route_matched_bytes_total");
    if (policy == PD_ROUTE_CACHE_AWARE)
        cr_expect_geq(matched, 6 * 2 * 64, "matched %lld bytes: each repeat matches its two system prompts",
                      (long long)matched);
    proxy_shutdown(&X, tx);
    pd_server_stop(C2);
    pthread_join(t2, NULL);
    pd_server_destroy(C2);
}

Test(proxy, cache_aware_routing_keeps_a_shared_prefix_on_one_instance)
{
    int home[2];
    int64_t counts[2][2] = {{0}};
    route_run(PD_ROUTE_CACHE_AWARE, home, counts);
    cr_expect_neq(home[0], home[1], "the two system prompts went to the same server");
    for (int s = 0; s < 2; s++)
        cr_expect_eq(counts[s][home[s]], 4, "system prompt %d: %lld of 4 requests on its server", s,
                     (long long)counts[s][home[s]]);
}

Test(proxy, least_loaded_routing_ignores_the_prefix)
{
    int home[2];
    int64_t counts[2][2] = {{0}};
    route_run(PD_ROUTE_LEAST_LOADED, home, counts);
    cr_expect_eq(counts[0][0] + counts[1][0], 8, "one request at a time, equal loads: the first server each time");
}

/* GET /readiness: 200 while a request can be served, 503 (Retry-After, a JSON body naming the role
 * without an instance) when it cannot; /health stays the proxy's liveness and says ok either way. */
Test(proxy, readiness_says_whether_a_request_can_be_served)
{
    start_proxy(0, 0);
    char out[8192];
    int code = 0;
    for (int i = 0; i < 250 && code != 200; i++) {   /* from the instances' first answers to its checks */
        code = curl_port(pd_proxy_port(X), "/readiness", NULL, NULL, out, sizeof out);
        if (code != 200)
            usleep(20000);
    }
    cr_assert_eq(code, 200, "still %d after 5 s: %s", code, out);
    json_t *j = parse(out);
    cr_assert_str_eq(json_string_value(json_object_get(j, "status")), "ready");
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(j, "decode"), "up")), 1, "%s", out);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(j, "prefill"), "instances")), 1, "%s", out);
    json_decref(j);
    proxy_shutdown(&X, tx);
    start_proxy(0, 1);   /* its one decode instance is dead */
    /* at once, before any check of it has failed: an instance counts as up from its first answer
     * (the proxy said ready, and pdmoe_proxy_instance_up 1, for the first second) */
    code = curl_port(pd_proxy_port(X), "/readiness", NULL, "-i", out, sizeof out);
    cr_assert_eq(code, 503, "%s", out);
    char m[16384], key[96];
    cr_assert_eq(curl_port(pd_proxy_port(X), "/metrics", NULL, NULL, m, sizeof m), 200);
    snprintf(key, sizeof key, "pdmoe_proxy_instance_up{role=\"decode\",instance=\"127.0.0.1:1\"} 0\n");
    cr_assert(strstr(m, key), "%s in %s", key, m);
    cr_assert(strstr(out, "Retry-After: 1"), "%s", out);
    wait_up(pd_proxy_port(X), 1, 0);
    cr_assert_eq(curl_port(pd_proxy_port(X), "/readiness", NULL, "-i", out, sizeof out), 503, "%s", out);
    j = parse(strstr(out, "{"));
    cr_assert_str_eq(json_string_value(json_object_get(j, "reason")), "no decode instance is up", "%s", out);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(j, "decode"), "up")), 0, "%s", out);
    json_decref(j);
    cr_assert_eq(curl_port(pd_proxy_port(X), "/health", NULL, NULL, out, sizeof out), 200, "%s", out);
}

/* A fake colocated instance that streams a chat answer as a server with speculative decoding does:
 * the role event at once, the first text ("ab", two tokens) after 0.4 s, then "cd" after 0.1 s, the
 * finish, the usage event when the request asks for it, [DONE]. Its error mode splits an error
 * event across two writes. It answers GET /health 200 and keeps each POST's body. */
struct sse_fake {
    int fd, port, error_mode;
    int long_mode;   /* 50 more text events, 0.1 s apart: 5 s during which its /health waits */
    int health_ms;   /* how long it takes to answer GET /health */
    int drop_posts;  /* closes a POST's connection unanswered, as a process that dies with the request */
    int dropped;     /* (how many it closed so) */
    volatile int stop;
    char body[4][2048];
    int n_bodies;
    pthread_t t;
};

static void fake_write(int c, const char *s)
{
    char head[32];
    int k = snprintf(head, sizeof head, "%zx\r\n", strlen(s));
    if (write(c, head, (size_t)k) != k || write(c, s, strlen(s)) < 0 || write(c, "\r\n", 2) != 2)
        return;
}

static void *sse_fake_run(void *arg)
{
    struct sse_fake *f = arg;
    while (!f->stop) {
        int c = accept(f->fd, NULL, NULL);
        if (c < 0)
            continue;
        char req[8192];
        size_t n = 0;
        ssize_t got;
        char *end = NULL;
        while (n < sizeof req - 1 && (got = read(c, req + n, sizeof req - 1 - n)) > 0) {
            req[n += (size_t)got] = 0;
            if ((end = strstr(req, "\r\n\r\n"))) {
                const char *cl = strstr(req, "Content-Length: ");
                size_t want = cl ? strtoul(cl + 16, NULL, 10) : 0;
                if (n - (size_t)(end + 4 - req) >= want)
                    break;
            }
        }
        if (strncmp(req, "POST", 4)) {
            usleep((useconds_t)f->health_ms * 1000);
            const char ok[] = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n"
                              "Connection: close\r\n\r\n{\"status\":\"ok\"}";
            if (write(c, ok, sizeof ok - 1) < 0)
                n = 0;
            close(c);
            continue;
        }
        if (f->drop_posts) {
            f->dropped++;
            close(c);
            continue;
        }
        if (end && f->n_bodies < 4)
            snprintf(f->body[f->n_bodies++], sizeof f->body[0], "%s", end + 4);
        const char head[] = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                            "Connection: close\r\n\r\n";
        const char *ev = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"tiny\","
                         "\"choices\":[{\"index\":0,\"delta\":{\"%s\":\"%s\"},\"finish_reason\":%s}]}\n\n";
        char e[512];
        if (write(c, head, sizeof head - 1) < 0)
            n = 0;
        snprintf(e, sizeof e, ev, "role", "assistant", "null");
        fake_write(c, e);
        usleep(400000);
        if (f->error_mode) {
            fake_write(c, "data: {\"err");
            usleep(50000);
            fake_write(c, "or\":{\"message\":\"the engine failed\",\"type\":\"server_error\"}}\n\ndata: [DONE]\n\n");
        } else {
            snprintf(e, sizeof e, ev, "content", "ab", "null");
            fake_write(c, e);
            usleep(100000);
            snprintf(e, sizeof e, ev, "content", "cd", "null");
            fake_write(c, e);
            for (int k = 0; f->long_mode && k < 50; k++) {
                usleep(100000);
                snprintf(e, sizeof e, ev, "content", "x", "null");
                fake_write(c, e);
            }
            snprintf(e, sizeof e, ev, "content", "", "\"length\"");
            fake_write(c, e);
            if (strstr(f->body[f->n_bodies - 1], "\"include_usage\":true"))
                fake_write(c, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"tiny\","
                              "\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4,\"total_tokens\":7}}\n\n");
            fake_write(c, "data: [DONE]\n\n");
        }
        if (write(c, "0\r\n\r\n", 5) < 0)
            n = 0;
        close(c);
    }
    return NULL;
}

static void sse_fake_start(struct sse_fake *f)
{
    f->fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(bind(f->fd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t len = sizeof a;
    getsockname(f->fd, (struct sockaddr *)&a, &len);
    f->port = ntohs(a.sin_port);
    cr_assert_eq(listen(f->fd, 16), 0);
    struct timeval tv = {0, 100000};   /* accept wakes to see stop */
    setsockopt(f->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    pthread_create(&f->t, NULL, sse_fake_run, f);
}

static void sse_fake_stop(struct sse_fake *f)
{
    f->stop = 1;
    pthread_join(f->t, NULL);
    close(f->fd);
}

/* Starts fake f and the proxy X in front of it (its only, colocated instance; health checks every
 * 0.1 s; max_body: the cap on bodies in flight, 0 for the default), once it counts f up. */
static void proxy_before_fake(struct sse_fake *f, int64_t max_body)
{
    sse_fake_start(f);
    static char c1[32];
    snprintf(c1, sizeof c1, "127.0.0.1:%d", f->port);
    struct pd_proxy_opts o = {.port = 0, .n_decode = 1, .health_interval_ms = 100, .max_body_bytes_in_flight = max_body};
    o.decode[0] = c1;
    pd_err e = {0};
    cr_assert_eq(pd_proxy_create(&o, &X, &e), 0, "%s", e.msg);
    pthread_create(&tx, NULL, run_proxy, X);
    wait_up(pd_proxy_port(X), 0, 1);
}

/* A prefill instance that answers its /health checks and dies with each request (the connection
 * closed, no answer): the request is prefilled again on the other one, and the answers are the
 * colocated server's. Both are up first, so that the dying one, listed first, is the one the first
 * request goes to (with a dead port instead, the test depended on the request going out before the
 * proxy's first check found that port closed, which a loaded machine's curl missed). */
Test(proxy, dead_prefill_instance_is_retried)
{
    struct sse_fake f = {.drop_posts = 1};
    sse_fake_start(&f);
    start_proxy(f.port, 0);
    wait_up(pd_proxy_port(X), 2, 1);
    same_as_colocated();
    int retries = (int)metric_key(pd_proxy_port(X), "pdmoe_proxy_retries_total");
    int resent = (int)metric_key(pd_proxy_port(X), "pdmoe_proxy_upstream_resent_total");
    proxy_shutdown(&X, tx);
    sse_fake_stop(&f);
    cr_assert_geq(f.dropped, 1, "no request went to the dying prefill instance");
    cr_assert_eq(retries + resent, f.dropped, "%d requests died on the prefill instance; %d retried, %d resent",
                 f.dropped, retries, resent);
}

/* A histogram's _sum in the proxy's /metrics. */
static double hist_sum(const char *name)
{
    char out[1 << 14], key[160];
    cr_assert_eq(curl_port(pd_proxy_port(X), "/metrics", NULL, NULL, out, sizeof out), 200);
    snprintf(key, sizeof key, "\n%s_sum ", name);
    const char *p = strstr(out, key);
    cr_assert_not_null(p, "no %s_sum in %s", name, out);
    return atof(p + strlen(key));
}

/* The proxy's latencies are the tokens' and whole events go to the client: TTFT from the first
 * event carrying text (a chat's role event goes out before the prompt is computed: TTFT was its
 * queueing time), TPOT over the usage's completion tokens (events of two tokens made it twice as
 * long), the usage event the proxy asked for itself not relayed, the one the client asked for
 * relayed once; an error event split across two reads is still the instance's failure. */
Test(proxy, stream_latencies_count_tokens_and_events_go_out_whole)
{
    struct sse_fake f = {0};
    proxy_before_fake(&f, 0);
    char out[8192];
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/chat/completions",
                           "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":4,\"stream\":true}", NULL,
                           out, sizeof out), 200, "%s", out);
    cr_assert_null(strstr(out, "\"usage\""), "a usage event the client did not ask for: %s", out);
    cr_assert(strstr(out, "\"ab\"") && strstr(out, "\"cd\"") && strstr(out, "data: [DONE]"), "%s", out);
    cr_assert(strstr(f.body[0], "\"include_usage\":true"), "the proxy did not ask for the usage: %s", f.body[0]);
    double ttft = hist_sum("pdmoe_proxy_time_to_first_token_seconds");
    double tpot = hist_sum("pdmoe_proxy_time_per_output_token_seconds");
    cr_assert_geq(ttft, 0.38, "TTFT %.3f s: the role event's time, not the first text's (0.4 s)", ttft);
    cr_assert(tpot > 0.02 && tpot < 0.07, "TPOT %.3f s: 0.1 s over 3 tokens after the first", tpot);
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/chat/completions",
                           "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":4,\"stream\":true,"
                           "\"stream_options\":{\"include_usage\":true}}", NULL, out, sizeof out), 200, "%s", out);
    const char *u = strstr(out, "\"usage\"");
    cr_assert(u && !strstr(u + 1, "\"usage\""), "the client's usage event, once: %s", out);
    cr_assert_eq(metric_key(pd_proxy_port(X), "pdmoe_proxy_completed_total"), 2);
    f.error_mode = 1;
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/chat/completions",
                           "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":4,\"stream\":true}", NULL,
                           out, sizeof out), 200, "%s", out);
    cr_assert(strstr(out, "data: {\"error\":{\"message\":\"the engine failed\""), "%s", out);
    cr_assert_eq(metric_key(pd_proxy_port(X), "pdmoe_proxy_completed_total"), 2, "the failed stream counted completed");
    cr_assert_eq(metric_key(pd_proxy_port(X), "pdmoe_proxy_errors_total{kind=\"decode_failed\"}"), 1);
    proxy_shutdown(&X, tx);
    sse_fake_stop(&f);
}

/* An instance whose /health checks fail while it streams (the fake answers one connection at a time,
 * as a congested link delays the checks and new connections first) keeps the streams that flow:
 * each was failed once the checks had failed for 3 s, 1.4 s after its last token. */
Test(proxy, a_stream_that_flows_outlives_failed_health_checks)
{
    struct sse_fake f = {.long_mode = 1};
    proxy_before_fake(&f, 0);
    char out[16384];
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/chat/completions",
                           "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":60,\"stream\":true}",
                           NULL, out, sizeof out), 200, "%s", out);
    cr_assert_null(strstr(out, "\"error\""), "a flowing stream was failed: %s", out);
    int xs = 0;
    for (const char *p = out; (p = strstr(p, "\"content\":\"x\"")); p++)
        xs++;
    cr_assert_eq(xs, 50, "%d of the 50 text events relayed: %s", xs, out);
    cr_assert(strstr(out, "data: [DONE]"), "%s", out);
    cr_assert_eq(metric_key(pd_proxy_port(X), "pdmoe_proxy_completed_total"), 1);
    proxy_shutdown(&X, tx);
    sse_fake_stop(&f);
}

/* Up: /readiness counts the fake instance up. */
static int fake_up(void)
{
    char out[1024];
    curl_port(pd_proxy_port(X), "/readiness", NULL, NULL, out, sizeof out);
    json_t *j = json_loads(out, 0, NULL);
    int up = (int)json_integer_value(json_object_get(json_object_get(j, "decode"), "up"));
    json_decref(j);
    return up;
}

/* --health-timeout-ms: an instance whose /health takes 1.5 s (a congested link between hosts) is
 * never up with the 1 s default, and stays up with 3 s. */
Test(proxy, the_health_check_timeout_is_the_operators)
{
    for (int timeout = 0; timeout <= 3000; timeout += 3000) {
        /* (a fake each: it answers one check at a time, and the first proxy's would queue) */
        struct sse_fake f = {.health_ms = 1500};
        sse_fake_start(&f);
        static char c1[32];
        snprintf(c1, sizeof c1, "127.0.0.1:%d", f.port);
        struct pd_proxy_opts o = {.port = 0, .n_decode = 1, .health_interval_ms = 100, .health_timeout_ms = timeout};
        o.decode[0] = c1;
        pd_err e = {0};
        cr_assert_eq(pd_proxy_create(&o, &X, &e), 0, "%s", e.msg);
        pthread_create(&tx, NULL, run_proxy, X);
        int ups = 0;
        for (int i = 0; i < 40; i++) {   /* 4 s: at least two checks */
            ups += fake_up();
            usleep(100000);
        }
        proxy_shutdown(&X, tx);
        sse_fake_stop(&f);
        if (timeout)
            cr_assert_geq(ups, 20, "with a 3 s timeout the instance was up %d times of 40", ups);
        else
            cr_assert_eq(ups, 0, "with the 1 s default the instance was up %d times of 40", ups);
    }
}

/* pool.c closes a connection from the loop's next turn, not from its request's callback; when the
 * loop ended before that turn (the graceful stop's last timer fired in the turn of a /health
 * check's timeout), the connection and its libevent state were lost: LeakSanitizer reported them
 * once in the_health_check_timeout_is_the_operators. pd_proxy_destroy frees such a connection. */
Test(proxy, a_connection_closed_as_the_loop_ends_is_freed_with_the_proxy)
{
    struct pd_proxy_opts o = {.port = 0, .n_decode = 1};
    o.decode[0] = "127.0.0.1:9";
    pd_err e = {0};
    cr_assert_eq(pd_proxy_create(&o, &X, &e), 0, "%s", e.msg);
    struct px_conn *c = px_conn_get(&X->d[0], 1000, 1);
    cr_assert_not_null(c);
    px_conn_put(c, 0);   /* not answered: closed on the loop's next turn, which never comes */
    pd_proxy_destroy(X);
    X = NULL;
#ifdef __SANITIZE_ADDRESS__
    cr_assert_eq(__lsan_do_recoverable_leak_check(), 0, "the proxy leaked (LeakSanitizer's report above)");
#endif
}

/* The request bodies the proxy holds at once are bounded (each costs about 4x its size: 40 clients
 * of 7 MB prompts took it to 1.2 GB): past the cap a 503 with Retry-After naming it, nothing sent
 * upstream; the gauge back to 0 once the bodies are answered; one body alone always goes. */
Test(proxy, request_bodies_in_flight_are_bounded)
{
    struct sse_fake f = {0};
    proxy_before_fake(&f, 6000);
    char body[4200], cmd[4600], out[8192];
    int at = snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"");
    memset(body + at, 'a', 4000);
    snprintf(body + at + 4000, sizeof body - at - 4000, "\"}],\"max_tokens\":4,\"stream\":true}");
    snprintf(cmd, sizeof cmd, "curl -s -o /dev/null -w '%%{http_code}' http://127.0.0.1:%d/v1/chat/completions -d '%s'",
             pd_proxy_port(X), body);
    FILE *first = popen(cmd, "r");   /* held 0.5 s by the fake */
    for (int i = 0; i < 100 && metric_key(pd_proxy_port(X), "pdmoe_proxy_body_bytes_in_flight") == 0; i++)
        usleep(10000);
    cr_assert_gt(metric_key(pd_proxy_port(X), "pdmoe_proxy_body_bytes_in_flight"), 4000);
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/chat/completions", body, "-i", out, sizeof out), 503, "%s", out);
    cr_assert(strstr(out, "Retry-After: 1") && strstr(out, "requests in flight"), "%s", out);
    char code[8] = {0};
    cr_assert_gt(fread(code, 1, sizeof code - 1, first), 0);
    pclose(first);
    cr_assert_str_eq(code, "200");
    cr_assert_eq(f.n_bodies, 1, "the refused body went upstream");
    cr_assert_eq(metric_key(pd_proxy_port(X), "pdmoe_proxy_body_bytes_in_flight"), 0);
    cr_assert_eq(metric_key(pd_proxy_port(X), "pdmoe_proxy_errors_total{kind=\"bodies_in_flight_full\"}"), 1);
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/chat/completions", body, NULL, out, sizeof out), 200, "%s", out);
    proxy_shutdown(&X, tx);
    sse_fake_stop(&f);
}

/* A checkpoint changed on disk under a running cluster and one prefill instance restarted on it:
 * its KV is refused by the decode instance (kv_transfer_params.model_fingerprint, "other
 * weights"). That is the pair's mismatch, not the decode instance's failure: the proxy once took
 * the decode out as an instance of the wrong role, so every request after the first that met the
 * new prefill was a 503 "no decode instance is up" while a prefill instance with the decode's
 * weights stood idle. Now the request is prefilled again on the other prefill instance, every
 * request is answered with the colocated tokens, and the decode instance stays up. */
Test(proxy, a_prefill_instance_with_other_weights_does_not_take_the_decode_out)
{
    char other[64], keep[64];
    tmp_model("v4-tiny", 10, other, sizeof other);
    snprintf(keep, sizeof keep, "%s", dir);
    snprintf(dir, sizeof dir, "%s", other);
    pthread_t to;
    struct pd_server *O = server(PD_ROLE_PRODUCER, &to);
    snprintf(dir, sizeof dir, "%s", keep);
    static char p0[32], p1[32], d0[32];
    snprintf(p0, sizeof p0, "127.0.0.1:%d", pd_server_port(O));
    snprintf(p1, sizeof p1, "127.0.0.1:%d", pd_server_port(P));
    snprintf(d0, sizeof d0, "127.0.0.1:%d", pd_server_port(D));
    struct pd_proxy_opts o = {.port = 0, .n_prefill = 2, .n_decode = 1, .route = {.policy = PD_ROUTE_LEAST_LOADED}};
    o.prefill[0] = p0;
    o.prefill[1] = p1;
    o.decode[0] = d0;
    pd_err e = {0};
    cr_assert_eq(pd_proxy_create(&o, &X, &e), 0, "%s", e.msg);
    pthread_create(&tx, NULL, run_proxy, X);
    const int port = pd_proxy_port(X);
    wait_up(port, 2, 1);
    char a[8192], b[8192], body[256];
    for (int i = 0; i < 6; i++) {
        snprintf(body, sizeof body, "{\"model\":\"tiny\",\"prompt\":\"request %d of six, one after another\","
                 "\"max_tokens\":8,\"temperature\":0,\"return_token_ids\":true}", i);
        int code = curl_port(port, "/v1/completions", body, NULL, a, sizeof a);
        cr_assert_eq(code, 200, "request %d: %d %s", i, code, a);
        cr_assert_eq(curl_port(pd_server_port(C), "/v1/completions", body, NULL, b, sizeof b), 200, "%s", b);
        char *x = field(a, "token_ids"), *y = field(b, "token_ids");
        cr_assert_str_eq(x, y, "request %d", i);
        free(x);
        free(y);
    }
    cr_assert_geq(metric(pd_server_port(O), "pdmoe_requests_total"), 1, "no request met the other weights");
    cr_assert_geq(metric(port, "pdmoe_proxy_retries_total"), 1);
    cr_assert_eq(curl_port(port, "/readiness", NULL, NULL, a, sizeof a), 200, "%s", a);
    proxy_shutdown(&X, tx);
    pd_server_stop(O);
    pthread_join(to, NULL);
    pd_server_destroy(O);
    rm_model(other);
}

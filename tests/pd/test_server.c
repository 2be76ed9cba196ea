/* The OpenAI-compatible server, driven by curl on loopback: the same greedy tokens as
 * `pdmoe generate`, streaming that adds up to the non-streamed answer, 4xx with OpenAI-style
 * errors for bad requests, 32 concurrent streams that all complete with every KV block back,
 * and a client that disconnects cancelling its request. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/genmodel.h"
#include "model/chat.h"
#include "model/config.h"
#include "model/tokenizer.h"
#include "plan/plan.h"
#include "../run.h"
#include "../tmpmodel.h"
#include "pd/server.h"
#include "util.h"

static char dir[64];
static struct pd_server *srv;
static pthread_t loop;
static int port;

static int curl(const char *path, const char *body, const char *extra, char *out, size_t cap)
{
    return curl_port(port, path, body, extra, out, cap);
}

static void *run_loop(void *arg)
{
    pd_err e;
    pd_server_run(srv, &e);
    return NULL;
}

static int max_queued;   /* --max-queued-requests of the next start (0: none) */

static void start_seqs(const char *api_key, const char *model_dir, int max_len, int max_seqs)
{
    pd_err e = {0};
    struct pd_server_opts o = {.model_dir = model_dir, .port = 0, .threads = 1, .max_num_seqs = max_seqs,
                               .max_model_len = max_len, .api_key = api_key, .served_name = "tiny",
                               .max_queued_requests = max_queued};
    cr_assert_eq(pd_server_create(&o, &srv, &e), 0, "%s", e.msg);
    port = pd_server_port(srv);
    cr_assert_gt(port, 0);
    pthread_create(&loop, NULL, run_loop, NULL);
}

static void start(const char *api_key, const char *model_dir, int max_len)
{
    start_seqs(api_key, model_dir, max_len, 8);
}

static void setup(void)
{
    tmp_model("v4-tiny", 5, dir, sizeof dir);
}

static void teardown(void)
{
    if (srv) {
        pd_server_stop(srv);
        pthread_join(loop, NULL);
        pd_server_destroy(srv);
        srv = NULL;
    }
    rm_model(dir);
}

TestSuite(server, .init = setup, .fini = teardown, .timeout = 120);

Test(server, health_models_and_greedy_tokens_equal_generate)
{
    start(NULL, dir, 1024);
    char out[1 << 16];
    cr_assert_eq(curl("/health", NULL, NULL, out, sizeof out), 200);
    cr_assert_eq(curl("/v1/models", NULL, NULL, out, sizeof out), 200);
    json_t *m = parse(out);
    cr_assert_str_eq(json_string_value(json_object_get(json_array_get(json_object_get(m, "data"), 0), "id")), "tiny");
    json_decref(m);
    cr_assert_eq(curl("/v1/completions",
                      "{\"model\":\"tiny\",\"prompt\":\"The sea froze\",\"max_tokens\":12,\"temperature\":0,"
                      "\"return_token_ids\":true}", NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out);
    json_t *ids = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids");
    cr_assert_eq(json_array_size(ids), 12);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")), 12);
    /* the same request through pdmoe generate */
    char cmd[512], gen[8192];
    snprintf(cmd, sizeof cmd, "%s generate --model %s --prompt 'The sea froze' --max-tokens 12 --print-ids --threads 1",
             pdmoe_bin(), dir);
    FILE *p = popen(cmd, "r");
    size_t n = fread(gen, 1, sizeof gen - 1, p);
    gen[n] = 0;
    pclose(p);
    char want[1024] = "[0] ids", *w = want + strlen(want);
    for (size_t i = 0; i < json_array_size(ids); i++)
        w += sprintf(w, " %lld", (long long)json_integer_value(json_array_get(ids, i)));
    cr_assert(strstr(gen, want), "server ids \"%s\" not in generate's output:\n%s", want, gen);
    json_decref(j);
    /* the scheduler's steps: the prompt's (its first token), then 11 decode steps of one sequence */
    cr_assert_eq(metric_key(port, "pdmoe_engine_steps_total{kind=\"prompt\"}"), 1);
    cr_assert_eq(metric_key(port, "pdmoe_engine_step_sequences_total{kind=\"prompt\"}"), 1);
    cr_assert_eq(metric_key(port, "pdmoe_engine_steps_total{kind=\"decode\"}"), 11);
    cr_assert_eq(metric_key(port, "pdmoe_engine_step_sequences_total{kind=\"decode\"}"), 11);
    cr_assert_eq(curl("/metrics", NULL, NULL, out, sizeof out), 200);
    const char *sec = strstr(out, "\npdmoe_engine_step_seconds_total{kind=\"decode\"} ");
    cr_assert_not_null(sec);
    double t = strtod(strchr(sec, '}') + 2, NULL);
    cr_assert(t > 0 && t < 60, "decode steps' time %g s", t);
}

Test(server, streaming_adds_up_to_the_plain_answer)
{
    start(NULL, dir, 1024);
    char out[1 << 16], plain[1 << 16];
    const char *body = "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello there\"}],"
                       "\"max_tokens\":20,\"temperature\":0%s}";
    char b1[512], b2[512];
    snprintf(b1, sizeof b1, body, "");
    snprintf(b2, sizeof b2, body, ",\"stream\":true");
    cr_assert_eq(curl("/v1/chat/completions", b1, NULL, plain, sizeof plain), 200, "%s", plain);
    json_t *j = parse(plain);
    const char *want = json_string_value(
        json_object_get(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message"), "content"));
    cr_assert_eq(curl("/v1/chat/completions", b2, NULL, out, sizeof out), 200);
    /* concatenate the deltas */
    char got[1 << 14] = "";
    int chunks = 0, done = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
        cr_assert(strncmp(line, "data: ", 6) == 0, "not an SSE data line: %s", line);
        if (!strcmp(line + 6, "[DONE]")) {
            done = 1;
            continue;
        }
        json_t *c = parse(line + 6);
        json_t *ch = json_array_get(json_object_get(c, "choices"), 0);
        strcat(got, json_string_value(json_object_get(json_object_get(ch, "delta"), "content")));
        chunks++;
        json_decref(c);
    }
    cr_assert(done, "no [DONE]");
    cr_assert_geq(chunks, 2);
    cr_assert_str_eq(got, want);
    json_decref(j);
}

static void expect(int code, const char *path, const char *body, const char *extra, const char *param)
{
    char out[8192];
    int got = curl(path, body, extra, out, sizeof out);
    cr_assert_eq(got, code, "%s %s: %d %s", path, body ? body : "", got, out);
    json_t *j = parse(out);
    json_t *err = json_object_get(j, "error");
    cr_assert(json_is_string(json_object_get(err, "message")), "%s", out);
    cr_assert(json_is_string(json_object_get(err, "type")), "%s", out);
    if (param)
        cr_assert_str_eq(json_string_value(json_object_get(err, "param")), param);
    json_decref(j);
}

Test(server, bad_requests_get_4xx_json)
{
    start(NULL, dir, 256);
    expect(400, "/v1/completions", "{\"prompt\": \"x\",", NULL, NULL);
    expect(400, "/v1/completions", "[1, 2]", NULL, NULL);
    expect(400, "/v1/completions", "{\"prompt\": 3}", NULL, "prompt");
    expect(400, "/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": \"ten\"}", NULL, "max_tokens");
    expect(400, "/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 0}", NULL, "max_tokens");
    expect(400, "/v1/completions", "{\"prompt\": \"x\", \"temperature\": 7}", NULL, "temperature");
    expect(400, "/v1/completions", "{\"prompt\": \"x\", \"stream\": \"yes\"}", NULL, "stream");
    expect(400, "/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 300}", NULL, "max_tokens");
    {   /* a prompt longer than the context is the prompt's fault, not max_tokens' */
        char body[1200];
        int at = snprintf(body, sizeof body, "{\"prompt\": [");
        for (int i = 0; i < 256; i++)
            at += snprintf(body + at, sizeof body - (size_t)at, "%s3", i ? "," : "");
        snprintf(body + at, sizeof body - (size_t)at, "], \"max_tokens\": 1}");
        expect(400, "/v1/completions", body, NULL, "prompt");
    }
    expect(400, "/v1/completions", "{\"prompt\": \"x\", \"stream\": true, \"stream_options\": {\"include_usage\": 1}}",
           NULL, "stream_options");
    expect(400, "/v1/chat/completions", "{\"messages\": []}", NULL, "messages");
    expect(400, "/v1/chat/completions", "{\"messages\": [{\"role\": \"robot\", \"content\": \"x\"}]}", NULL, "messages");
    expect(404, "/v1/completions", "{\"model\": \"gpt-9\", \"prompt\": \"x\"}", NULL, "model");
    expect(404, "/v2/everything", NULL, NULL, NULL);
    expect(405, "/v1/completions", NULL, NULL, NULL);
    /* a content part pdmoe does not run is refused by its place */
    expect(400, "/v1/chat/completions",
           "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\", \"image_url\": {}}]}]}", NULL,
           "messages");
    /* a route's other methods: a 405 naming the one it takes, with Allow (GET routes take HEAD) */
    static const struct {
        const char *path, *method, *allow;
    } wrong[] = {
        {"/v1/models", "DELETE", "GET, HEAD"}, {"/health", "PUT", "GET, HEAD"},
        {"/metrics", "POST", "GET, HEAD"},     {"/v1/chat/completions", "PUT", "POST"},
    };
    for (size_t i = 0; i < sizeof wrong / sizeof *wrong; i++) {
        char extra[64], out[8192];
        snprintf(extra, sizeof extra, "-X %s -i", wrong[i].method);
        cr_assert_eq(curl(wrong[i].path, NULL, extra, out, sizeof out), 405, "%s %s: %s", wrong[i].method,
                     wrong[i].path, out);
        char allow[64];
        snprintf(allow, sizeof allow, "Allow: %s\r\n", wrong[i].allow);
        cr_expect(strstr(out, allow), "%s %s: no %s in %s", wrong[i].method, wrong[i].path, wrong[i].allow, out);
        const char *body = strstr(out, "\r\n\r\n");
        cr_assert_not_null(body);
        json_t *j = parse(body + 4);
        char use[16];
        snprintf(use, sizeof use, "use %s", wrong[i].allow[0] == 'G' ? "GET" : "POST");
        cr_expect_str_eq(json_string_value(json_object_get(json_object_get(j, "error"), "message")), use);
        json_decref(j);
    }
    char out[256];
    cr_assert_eq(curl("/health", NULL, "-I", out, sizeof out), 200, "HEAD /health: %s", out);
    /* the four above and the GET of /v1/completions */
    cr_assert_eq(metric_port(port, "pdmoe_http_method_not_allowed_total"), 5);
}

/* A chat's content as the API's text parts is their texts joined by "\n": the same prompt, the
 * same greedy tokens as that string. */
Test(server, a_contents_text_parts_are_its_string)
{
    start(NULL, dir, 256);
    char a[8192], b[8192];
    cr_assert_eq(curl("/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\","
                      "\"text\":\"Hi\"},{\"type\":\"text\",\"text\":\"there\"}]}],\"max_tokens\":4,\"temperature\":0}",
                      NULL, a, sizeof a), 200, "%s", a);
    cr_assert_eq(curl("/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\\nthere\"}],"
                      "\"max_tokens\":4,\"temperature\":0}", NULL, b, sizeof b), 200, "%s", b);
    json_t *ja = parse(a), *jb = parse(b);
    json_t *ua = json_object_get(ja, "usage"), *ub = json_object_get(jb, "usage");
    cr_expect(json_equal(json_object_get(ua, "prompt_tokens"), json_object_get(ub, "prompt_tokens")), "%s | %s", a, b);
    const char *ta = json_string_value(json_object_get(json_object_get(json_array_get(json_object_get(ja, "choices"), 0),
                                                                       "message"), "content"));
    const char *tb = json_string_value(json_object_get(json_object_get(json_array_get(json_object_get(jb, "choices"), 0),
                                                                       "message"), "content"));
    cr_assert(ta && tb);
    cr_expect_str_eq(ta, tb);
    json_decref(ja);
    json_decref(jb);
}

Test(server, api_key)
{
    start("s3cret", dir, 256);
    char out[8192];
    expect(401, "/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 2}", NULL, NULL);
    cr_assert_eq(curl("/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 2}", "-H 'Authorization: Bearer s3cret'",
                      out, sizeof out), 200, "%s", out);
}

static int metric(const char *name)
{
    return metric_port(port, name);
}

Test(server, concurrent_streams_complete_and_free_every_block)
{
    start(NULL, dir, 1024);
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "seq 32 | xargs -P 32 -I{} curl -s -N -o /dev/null -w '%%{http_code}\\n' http://127.0.0.1:%d/v1/completions "
             "-d '{\"prompt\":\"request {} says hello\",\"max_tokens\":24,\"stream\":true,\"temperature\":0.8,\"seed\":{}}'",
             port);
    int ok = count_200(cmd);
    cr_assert_eq(ok, 32);
    cr_assert_eq(metric("pdmoe_requests_completed_total"), 32);
    cr_assert_eq(metric("pdmoe_kv_blocks_free"), metric("pdmoe_kv_blocks_capacity"));
    cr_assert_eq(metric("pdmoe_num_requests_running"), 0);
}

Test(server, a_client_that_leaves_cancels_its_request)
{
    start(NULL, dir, 4096);
    char out[8192];
    /* a long generation; the client gives up after 0.2 s */
    curl("/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":4000,\"stream\":true,\"ignore_eos\":true}", "--max-time 0.1",
         out, sizeof out);
    for (int i = 0; i < 100 && metric("pdmoe_requests_cancelled_total") < 1; i++)
        usleep(20000);
    cr_assert_eq(metric("pdmoe_requests_cancelled_total"), 1, "cancelled %d, completed %d, tokens %d",
                 metric("pdmoe_requests_cancelled_total"), metric("pdmoe_requests_completed_total"),
                 metric("pdmoe_generation_tokens_total"));
    cr_assert_eq(metric("pdmoe_kv_blocks_free"), metric("pdmoe_kv_blocks_capacity"));
    cr_assert_eq(metric("pdmoe_kv_slots_free"), 8);
}

/* Clients that leave at every moment of their requests (queued, running, answered but not yet
 * sent): each request is counted once, completed or cancelled. One the scheduler had finished
 * whose client left before the answer went out was counted as neither (7 of 160 in a run). */
Test(server, every_request_is_counted_once_however_its_client_leaves)
{
    start(NULL, dir, 1024);
    char cmd[1024];
    for (int round = 0; round < 3; round++) {
        snprintf(cmd, sizeof cmd,
                 "seq 80 | xargs -P 16 -I{} bash -c 'curl -s -o /dev/null --max-time 0.$(printf %%03d $((RANDOM %% 100 + 5))) "
                 "http://127.0.0.1:%d/v1/completions -d \"{\\\"prompt\\\":\\\"client {} leaves\\\",\\\"max_tokens\\\":%d%s}\"'; true",
                 port, 4 + 8 * round, round == 1 ? ",\\\"stream\\\":true" : "");
        cr_assert_eq(system(cmd), 0, "%s", cmd);
    }
    for (int i = 0; i < 250 && (metric("pdmoe_num_requests_running") || metric("pdmoe_num_requests_waiting")); i++)
        usleep(20000);
    int total = metric("pdmoe_requests_total"), done = metric("pdmoe_requests_completed_total"),
        cancelled = metric("pdmoe_requests_cancelled_total");
    cr_assert_gt(total, 120, "%d of 240 requests arrived", total);   /* (a client may leave before it sent one) */
    cr_assert_eq(done + cancelled, total, "%d requests: %d completed, %d cancelled", total, done, cancelled);
    cr_assert_eq(metric("pdmoe_kv_blocks_free"), metric("pdmoe_kv_blocks_capacity"));
}

/* A server stopped mid-stream ends the stream with an error event and [DONE], never a bare cut. */
struct stopped_stream {
    char out[4 << 20];   /* all 4000 chunks, however late the stop comes */
    int rc;
};

static void *stream_long(void *arg)
{
    struct stopped_stream *x = arg;
    x->rc = curl("/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":4000,\"stream\":true,\"ignore_eos\":true}",
                 "--max-time 30", x->out, sizeof x->out);
    return NULL;
}

Test(server, a_stream_the_server_stops_ends_with_an_error_and_done)
{
    start(NULL, dir, 4096);
    static struct stopped_stream x;
    pthread_t t;
    pthread_create(&t, NULL, stream_long, &x);
    for (int i = 0; i < 250 && metric("pdmoe_generation_tokens_total") < 5; i++)
        usleep(20000);
    cr_assert_geq(metric("pdmoe_generation_tokens_total"), 5, "the stream never started");
    pd_server_stop(srv);
    pthread_join(loop, NULL);
    pd_server_destroy(srv);
    srv = NULL;
    pthread_join(t, NULL);
    cr_assert_eq(x.rc, 200, "%s", x.out);
    const char *err = strstr(x.out, "the server is shutting down");
    cr_assert_not_null(err, "no error event: %.300s", x.out + (strlen(x.out) > 300 ? strlen(x.out) - 300 : 0));
    const char *done = strstr(err, "data: [DONE]");
    cr_assert_not_null(done, "no [DONE] after the error event: %s", err);
}

/* A request that holds a server's only slot (16,000 tokens of v4-tiny) until release_the_slot makes
 * its client leave; returned once it runs. (Its client used to leave by curl's --max-time, counted
 * from its start: on a loaded CI host under the sanitizers the request took most of that time to
 * start running, and left before the test had looked at the queue behind it.) */
static pid_t hold_the_slot(void)
{
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1/completions", port);
    pid_t pid = fork();
    cr_assert_geq(pid, 0, "fork");
    if (pid == 0) {
        execlp("curl", "curl", "-s", "-o", "/dev/null", "--max-time", "120", url, "-d",
               "{\"prompt\":\"x\",\"max_tokens\":16000,\"ignore_eos\":true}", (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 1000 && metric("pdmoe_num_requests_running") < 1; i++)
        usleep(10000);
    cr_assert_eq(metric("pdmoe_num_requests_running"), 1);
    return pid;
}

/* The holding client leaves (its request is cancelled), and is reaped. */
static void release_the_slot(pid_t pid)
{
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
}

/* A request that leaves while it waits for a slot is dropped from the queue, and the queue behind
 * it still works: a later request is answered (it was once appended to the freed one). */
Test(server, a_request_cancelled_while_waiting_leaves_the_queue_working)
{
    tmp_model_positions(dir, 16384);
    start_seqs(NULL, dir, 16384, 1);
    char out[8192];
    pid_t a = hold_the_slot();   /* leaves too, below */
    /* waits behind it, gives up after 0.1 s: out of the queue (it stayed there, counted as waiting,
     * until its turn came) */
    curl("/v1/completions", "{\"prompt\":\"y\",\"max_tokens\":4}", "--max-time 0.1", out, sizeof out);
    for (int i = 0; i < 200 && metric("pdmoe_num_requests_waiting") > 0; i++)
        usleep(10000);
    cr_assert_eq(metric("pdmoe_num_requests_waiting"), 0);
    cr_assert_eq(metric("pdmoe_num_requests_running"), 1, "the slot's holder ended before the check");
    release_the_slot(a);
    cr_assert_eq(curl("/v1/completions", "{\"prompt\":\"z\",\"max_tokens\":4}", "--max-time 20", out, sizeof out), 200,
                 "%s", out);
    cr_assert_eq(metric("pdmoe_requests_cancelled_total"), 2);
    cr_assert_eq(metric("pdmoe_requests_completed_total"), 1);
    cr_assert_eq(metric("pdmoe_kv_blocks_free"), metric("pdmoe_kv_blocks_capacity"));
}

/* --max-queued-requests 1 with one running sequence: the request that would wait second is a 429
 * (Retry-After, OpenAI's rate_limit_error, naming the flag), a stream's too, before any 200; the
 * one waiting is answered once the slot frees, and so is a request after it. */
Test(server, a_full_waiting_queue_is_a_429_with_retry_after)
{
    tmp_model_positions(dir, 16384);
    max_queued = 1;
    start_seqs(NULL, dir, 16384, 1);
    max_queued = 0;
    char cmd[512], out[8192];
    pid_t a = hold_the_slot();
    snprintf(cmd, sizeof cmd,
             "curl -s -o /dev/null -w '%%{http_code}' --max-time 60 http://127.0.0.1:%d/v1/completions "
             "-d '{\"prompt\":\"y\",\"max_tokens\":4}'", port);
    FILE *b = popen(cmd, "r");
    for (int i = 0; i < 200 && metric("pdmoe_num_requests_waiting") < 1; i++)
        usleep(10000);
    cr_assert_eq(metric("pdmoe_num_requests_waiting"), 1);
    const char *bodies[] = {"{\"prompt\":\"z\",\"max_tokens\":4}", "{\"prompt\":\"z\",\"max_tokens\":4,\"stream\":true}"};
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(curl("/v1/completions", bodies[i], "-i", out, sizeof out), 429, "%s: %s", bodies[i], out);
        cr_assert(strstr(out, "Retry-After: 1\r\n"), "%s", out);
        cr_assert(strstr(out, "HTTP/1.1 429 Too Many Requests\r\n"), "its reason phrase (it was \"Error\"): %s", out);
        cr_assert(!strstr(out, "text/event-stream"), "%s", out);
        json_t *j = parse(strstr(out, "{"));
        json_t *err = json_object_get(j, "error");
        cr_assert_str_eq(json_string_value(json_object_get(err, "type")), "rate_limit_error", "%s", out);
        cr_assert(strstr(json_string_value(json_object_get(err, "message")), "--max-queued-requests"), "%s", out);
        json_decref(j);
    }
    cr_assert_eq(metric("pdmoe_requests_queue_full_total"), 2);
    release_the_slot(a);
    char code[8] = "";
    cr_assert_not_null(fgets(code, sizeof code, b));
    pclose(b);
    cr_assert_str_eq(code, "200", "the waiting request");
    cr_assert_eq(curl("/v1/completions", bodies[0], NULL, out, sizeof out), 200, "%s", out);
    cr_assert_eq(metric("pdmoe_requests_total"), 3, "the refused requests were counted as accepted");
    cr_assert_eq(metric("pdmoe_kv_blocks_free"), metric("pdmoe_kv_blocks_capacity"));
}

/* /metrics keeps Prometheus' conventions (counters end in _total, nothing else does, every sample's
 * family declared, histograms whole), its latency histograms count each completed request once,
 * and the requests add up: accepted = completed + cancelled + failed once none runs or waits. */
Test(server, metrics_follow_prometheus_conventions_and_add_up)
{
    start(NULL, dir, 1024);
    static char out[1 << 17];
    cr_assert_eq(curl("/metrics", NULL, NULL, out, sizeof out), 200);
    prom_conventions(out, "serve /metrics, idle");
    /* (ignore_eos: unseeded sampling could end one at its first token, leaving it no TPOT) */
    const char *bodies[] = {"{\"prompt\":\"a\",\"max_tokens\":3,\"ignore_eos\":true}",
                            "{\"prompt\":\"b\",\"max_tokens\":5,\"stream\":true,\"ignore_eos\":true}",
                            "{\"messages\":[{\"role\":\"user\",\"content\":\"c\"}],\"max_tokens\":2,\"ignore_eos\":true}"};
    for (int i = 0; i < 3; i++)
        cr_assert_eq(curl(i == 2 ? "/v1/chat/completions" : "/v1/completions", bodies[i], NULL, out, sizeof out), 200,
                     "%s", out);
    cr_assert_eq(curl("/v1/completions", "{\"prompt\":\"d\",\"max_tokens\":-1}", NULL, out, sizeof out), 400, "%s", out);
    for (int i = 0; i < 250 && metric("pdmoe_requests_completed_total") < 3; i++)
        usleep(20000);
    cr_assert_eq(curl("/metrics", NULL, NULL, out, sizeof out), 200);
    prom_conventions(out, "serve /metrics");
    cr_assert_eq(metric("pdmoe_time_to_first_token_seconds_count"), 3, "%s", out);
    cr_assert_eq(metric("pdmoe_e2e_request_latency_seconds_count"), 3);
    cr_assert_eq(metric("pdmoe_time_per_output_token_seconds_count"), 3, "each had more than one token");
    cr_assert(strstr(out, "pdmoe_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3\n"), "%s", out);
    cr_assert_eq(metric("pdmoe_requests_total"), metric("pdmoe_requests_completed_total") +
                                                     metric("pdmoe_requests_cancelled_total") +
                                                     metric("pdmoe_requests_failed_total"));
    cr_assert_eq(metric("pdmoe_requests_failed_total"), 0);
}

/* GET /expert_stats: every token through every MoE layer counted top-k times, in the format
 * `pdmoe plan --expert-stats` reads; GET only; parallel readers all answered. */
Test(server, expert_stats_count_every_token_and_feed_the_planner)
{
    start(NULL, dir, 1024);
    struct pd_model m;
    pd_err e = {0};
    cr_assert_eq(pd_model_load(dir, &m, &e), 0, "%s", e.msg);
    static char out[1 << 16];
    cr_assert_eq(curl("/expert_stats", NULL, NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out);
    json_t *rows = json_object_get(j, "tokens_per_expert");
    cr_assert_eq(json_array_size(rows), (size_t)m.n_layers);
    cr_assert_eq(json_integer_value(json_object_get(j, "experts")), m.n_routed_experts);
    for (int l = 0; l < m.n_layers; l++)
        for (int x = 0; x < m.n_routed_experts; x++)
            cr_assert_eq(json_integer_value(json_array_get(json_array_get(rows, (size_t)l), (size_t)x)), 0);
    json_decref(j);
    /* two requests: their prompts and all generated tokens but the last go through the model */
    const char *body[2] = {"{\"prompt\":\"The sea froze over\",\"max_tokens\":7,\"ignore_eos\":true}",
                           "{\"prompt\":\"and the children skated\",\"max_tokens\":3,\"ignore_eos\":true}"};
    long long through = 0;
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(curl("/v1/completions", body[i], NULL, out, sizeof out), 200, "%s", out);
        j = parse(out);
        json_t *u = json_object_get(j, "usage");
        through += json_integer_value(json_object_get(u, "prompt_tokens")) +
                   json_integer_value(json_object_get(u, "completion_tokens")) - 1;
        json_decref(j);
    }
    cr_assert_eq(curl("/expert_stats", NULL, NULL, out, sizeof out), 200, "%s", out);
    j = parse(out);
    rows = json_object_get(j, "tokens_per_expert");
    for (int l = 0; l < m.n_layers; l++) {
        long long sum = 0;
        for (int x = 0; x < m.n_routed_experts; x++)
            sum += json_integer_value(json_array_get(json_array_get(rows, (size_t)l), (size_t)x));
        cr_assert_eq(sum, through * m.n_experts_per_tok, "layer %d: %lld token-expert pairs, want %lld", l, sum,
                     through * m.n_experts_per_tok);
    }
    json_decref(j);
    /* the planner takes the answer as it is */
    char stats[] = "/tmp/pdmoe-stats-XXXXXX";
    tmp_text(stats, out);
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.model = dir;
    o.hardware = "h100";
    o.max_model_len = 1024;
    o.role[0] = (struct pd_role_opts){.dp = 2, .tp = 1, .instances = 1};
    o.role[1] = (struct pd_role_opts){.dp = 4, .tp = 1, .instances = 1};
    o.expert_stats = stats;
    struct pd_plan p;
    int rc = pd_plan_build(&o, &p, &e);
    remove(stats);
    cr_assert_eq(rc, 0, "%s", e.msg);
    cr_assert_geq(p.role[1].imbalance, 1.0);
    pd_plan_free(&p);
    /* GET only; eight readers at once all get the counts */
    expect(405, "/expert_stats", "{}", NULL, NULL);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "seq 8 | xargs -P 8 -I{} curl -s -o /dev/null -w '%%{http_code}\\n' "
             "http://127.0.0.1:%d/expert_stats", port);
    int ok = count_200(cmd);
    cr_assert_eq(ok, 8);
}

/* The SSE events of a stream: the deltas' text concatenated (both APIs), the last choice's
 * finish_reason, whether [DONE] came last, and the last event as JSON (the caller frees it). */
struct sse {
    char text[1 << 14];
    char finish[16];
    int done, events, role_first;
    json_t *last;
};

static void read_sse(char *out, struct sse *x)
{
    memset(x, 0, sizeof *x);
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
        cr_assert(strncmp(line, "data: ", 6) == 0, "not an SSE data line: %s", line);
        cr_assert_not(x->done, "an event after [DONE]: %s", line);
        if (!strcmp(line + 6, "[DONE]")) {
            x->done = 1;
            continue;
        }
        json_t *c = parse(line + 6);
        json_t *ch = json_array_get(json_object_get(c, "choices"), 0), *d = json_object_get(ch, "delta");
        if (x->events++ == 0)
            x->role_first = json_is_string(json_object_get(d, "role"));
        const char *t = json_string_value(d ? json_object_get(d, "content") : json_object_get(ch, "text"));
        if (t)
            strcat(x->text, t);
        if (json_is_string(json_object_get(ch, "finish_reason")))
            snprintf(x->finish, sizeof x->finish, "%s", json_string_value(json_object_get(ch, "finish_reason")));
        json_decref(x->last);
        x->last = c;
    }
}

/* A stop string of 2 to 3 whole characters from the middle of `full` (stop[64]), and the same as a
 * JSON string (esc[256]). */
static void stop_from_middle(const char *full, char *stop, char *esc)
{
    size_t fl = strlen(full), a = fl / 2;
    while (a > 0 && ((unsigned char)full[a] & 0xC0) == 0x80)
        a--;
    size_t b = a + 1;
    for (int chars = 0; b < fl && chars < 2; b++)
        if (((unsigned char)full[b] & 0xC0) != 0x80)
            chars++;
    while (b < fl && ((unsigned char)full[b] & 0xC0) == 0x80)
        b++;
    snprintf(stop, 64, "%.*s", (int)(b - a), full + a);
    json_t *js = json_string(stop);
    char *dumped = json_dumps(js, JSON_ENCODE_ANY);
    snprintf(esc, 256, "%s", dumped);
    free(dumped);
    json_decref(js);
}

/* OpenAI's stop: the text ends before the first stop string, streamed or not, with finish_reason
 * "stop", the generation stops there and its KV comes back; vLLM's stop_token_ids end it at the
 * token; stream_options.include_usage adds a usage chunk before [DONE]; a chat stream names the
 * role first. Checked against a plain greedy run of the same prompt. */
Test(server, stop_strings_stop_token_ids_and_usage_in_the_stream)
{
    start(NULL, dir, 1024);
    char out[1 << 16];
    cr_assert_eq(curl("/v1/completions", "{\"prompt\":\"The sea and the river\",\"max_tokens\":40,\"temperature\":0,"
                      "\"ignore_eos\":true,\"return_token_ids\":true}", NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out);
    json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
    const char *full = json_string_value(json_object_get(ch, "text"));
    size_t fl = strlen(full);
    cr_assert_gt(fl, 12, "%s", full);
    char stop[64], esc[256];
    stop_from_middle(full, stop, esc);
    size_t want_len = (size_t)(strstr(full, stop) - full);
    char body[1024];
    for (int stream = 0; stream < 2; stream++) {
        /* max_tokens far beyond the stop: the generation must end at the stop, not run on */
        snprintf(body, sizeof body, "{\"prompt\":\"The sea and the river\",\"max_tokens\":900,\"temperature\":0,"
                 "\"ignore_eos\":true,\"stop\":[\"never-in-this-text\",%s]%s}", esc,
                 stream ? ",\"stream\":true,\"stream_options\":{\"include_usage\":true}" : "");
        cr_assert_eq(curl("/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
        if (!stream) {
            json_t *k = parse(out);
            json_t *c = json_array_get(json_object_get(k, "choices"), 0);
            cr_assert_str_eq(json_string_value(json_object_get(c, "finish_reason")), "stop");
            const char *t = json_string_value(json_object_get(c, "text"));
            cr_assert_eq(strlen(t), want_len, "stop %s: \"%s\" of \"%s\"", esc, t, full);
            cr_assert_eq(strncmp(t, full, want_len), 0);
            json_decref(k);
        } else {
            struct sse x;
            read_sse(out, &x);
            cr_assert(x.done, "no [DONE]");
            cr_assert_str_eq(x.finish, "stop");
            cr_assert_eq(strlen(x.text), want_len, "stop %s: \"%s\" of \"%s\"", esc, x.text, full);
            cr_assert_eq(strncmp(x.text, full, want_len), 0);
            /* the usage chunk, last: no choice, the tokens counted */
            cr_assert_eq(json_array_size(json_object_get(x.last, "choices")), 0);
            json_t *u = json_object_get(x.last, "usage");
            cr_assert_gt(json_integer_value(json_object_get(u, "completion_tokens")), 0);
            cr_assert_lt(json_integer_value(json_object_get(u, "completion_tokens")), 900, "the generation went on");
            json_decref(x.last);
        }
    }
    for (int i = 0; i < 100 && metric("pdmoe_kv_blocks_free") != metric("pdmoe_kv_blocks_capacity"); i++)
        usleep(20000);
    cr_assert_eq(metric("pdmoe_kv_blocks_free"), metric("pdmoe_kv_blocks_capacity"));
    cr_assert_eq(metric("pdmoe_requests_cancelled_total"), 0, "a stop string counted as a cancellation");

    /* stop_token_ids: the third token ends the generation, which keeps the two before it in the
     * text; its token_ids list the stop token too, as vLLM's do (as many as the usage counts) */
    json_t *ids = json_object_get(ch, "token_ids");
    long long third = json_integer_value(json_array_get(ids, 2));
    int first = 0;   /* the first position that token holds */
    while (json_integer_value(json_array_get(ids, (size_t)first)) != third)
        first++;
    snprintf(body, sizeof body, "{\"prompt\":\"The sea and the river\",\"max_tokens\":40,\"temperature\":0,"
             "\"ignore_eos\":true,\"return_token_ids\":true,\"stop_token_ids\":[%lld]}", third);
    cr_assert_eq(curl("/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    json_t *k = parse(out);
    json_t *c = json_array_get(json_object_get(k, "choices"), 0);
    cr_assert_str_eq(json_string_value(json_object_get(c, "finish_reason")), "stop");
    cr_assert_eq(json_array_size(json_object_get(c, "token_ids")), (size_t)first + 1);
    cr_assert_eq(json_integer_value(json_array_get(json_object_get(c, "token_ids"), (size_t)first)), third);
    json_decref(k);
    json_decref(j);

    /* a chat stream names the role in its first chunk */
    cr_assert_eq(curl("/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":3,"
                      "\"stream\":true}", NULL, out, sizeof out), 200, "%s", out);
    struct sse x;
    read_sse(out, &x);
    cr_assert(x.role_first, "the first chunk has no role");
    cr_assert(x.done);
    json_decref(x.last);
}

/* The parameters pdmoe does not implement are refused by name, never accepted and dropped. */
Test(server, unimplemented_parameters_are_refused_by_name)
{
    start(NULL, dir, 256);
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"n\":2}", NULL, "n");
    /* a message's fields other than role and content: tool calls, names (empty ones, as OpenAI's
     * SDK writes them out, are taken: chat/an_answer_sent_back_with_its_reasoning_is_taken) */
    char msg[8192];
    cr_assert_eq(curl("/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":"
                      "\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\"}]}]}", NULL, msg,
                      sizeof msg), 400, "%s", msg);
    cr_expect(strstr(msg, "messages[1]") && strstr(msg, "tool_calls"), "%s", msg);
    expect(400, "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"name\":\"bob\"}]}", NULL,
           "messages");
    /* chat_template_kwargs: thinking, enable_thinking, drop_thinking (booleans), nothing else */
    expect(400, "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
           "\"chat_template_kwargs\":{\"thinking_mode\":\"thinking\"}}", NULL, "chat_template_kwargs.thinking_mode");
    expect(400, "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
           "\"chat_template_kwargs\":{\"thinking\":\"yes\"}}", NULL, "chat_template_kwargs.thinking");
    expect(400, "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
           "\"chat_template_kwargs\":[1]}", NULL, "chat_template_kwargs");
    expect(400, "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
           "\"reasoning_effort\":\"extreme\"}", NULL, "reasoning_effort");
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"reasoning_effort\":\"max\"}", NULL, "reasoning_effort");
    expect(400, "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true}", NULL,
           "logprobs");
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"logprobs\":0}", NULL, "logprobs");
    expect(400, "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":3}",
           NULL, "top_logprobs");
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"presence_penalty\":0.5}", NULL, "presence_penalty");
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"frequency_penalty\":-1}", NULL, "frequency_penalty");
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"logit_bias\":{\"5\":10}}", NULL, "logit_bias");
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"echo\":true}", NULL, "echo");
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}", NULL, "stream_options");
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"stream\":true,\"stream_options\":{\"continuous\":true}}", NULL,
           "stream_options");
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"stop\":[\"\"]}", NULL, "stop");
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"stop\":7}", NULL, "stop");
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"stop_token_ids\":[-1]}", NULL, "stop_token_ids");
    /* the other route's prompt, a key of kv_transfer_params pdmoe does not know, token ids in a stream */
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"messages\":12}", NULL, "messages");
    expect(400, "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"prompt\":[1,2]}",
           NULL, "prompt");
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"kv_transfer_params\":{\"bogus\":1}}", NULL,
           "kv_transfer_params.bogus");
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"kv_transfer_params\":{\"do_remote_decode\":\"yes\"}}", NULL,
           "kv_transfer_params.do_remote_decode");
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"stream\":true,\"return_token_ids\":true}", NULL,
           "return_token_ids");
    /* their neutral values are accepted */
    char out[8192];
    cr_assert_eq(curl("/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":2,\"n\":1,\"presence_penalty\":0,"
                      "\"frequency_penalty\":0,\"user\":\"u\",\"logprobs\":null}", NULL, out, sizeof out), 200, "%s", out);
    /* and the unimplemented fields' values that ask for nothing, as clients writing out every default
     * send them (OpenAI and vLLM take them; they were refused as unsupported, null included) */
    cr_assert_eq(curl("/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":2,\"echo\":false,\"best_of\":1,"
                      "\"logit_bias\":{},\"suffix\":null,\"store\":false,\"metadata\":null}", NULL, out, sizeof out), 200,
                 "%s", out);
    /* best_of 1.0 is best_of 1, as every integer field's whole-number float is (it was refused) */
    cr_assert_eq(curl("/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":2,\"best_of\":1.0}", NULL, out, sizeof out),
                 200, "%s", out);
    cr_assert_eq(curl("/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":2,"
                      "\"tools\":[],\"tool_choice\":\"none\",\"parallel_tool_calls\":false,\"response_format\":{\"type\":"
                      "\"text\"},\"logit_bias\":null,\"service_tier\":null}", NULL, out, sizeof out), 200, "%s", out);
    /* a NUL in a string is refused in the client's terms, not jansson's (JSON_ALLOW_NUL) */
    cr_assert_eq(curl("/v1/completions", "{\"prompt\":\"a\\u0000b\"}", NULL, out, sizeof out), 400, "%s", out);
    cr_assert(strstr(out, "NUL character") && !strstr(out, "JSON_ALLOW_NUL") && !strstr(out, "not a JSON object"), "%s",
              out);
    /* answers' ids are random, as vLLM's: a counter repeated them across instances and restarts */
    char out2[8192];
    cr_assert_eq(curl("/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":1}", NULL, out, sizeof out), 200, "%s", out);
    cr_assert_eq(curl("/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":1}", NULL, out2, sizeof out2), 200, "%s", out2);
    const char *i1 = strstr(out, "\"id\":\"cmpl-"), *i2 = strstr(out2, "\"id\":\"cmpl-");
    cr_assert(i1 && i2, "%s / %s", out, out2);
    cr_assert_eq(strspn(i1 + 11, "0123456789abcdef"), 32, "%s", out);
    cr_assert_neq(strncmp(i1, i2, 43), 0, "two answers share an id: %s", out);
    /* any other value of theirs is still refused by name */
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"best_of\":2}", NULL, "best_of");
    expect(400, "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":"
           "{\"type\":\"json_object\"}}", NULL, "response_format");
    expect(400, "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":\"auto\"}",
           NULL, "tool_choice");
}

/* A chat's prompt is the checkpoint's format: a synthetic V4 checkpoint has no chat_template, so
 * DeepSeek-V4's encoding (model/chat.h): BOS + system + <｜User｜>...<｜Assistant｜></think>, the
 * earlier assistant turn closed with EOS; its prompt_tokens count that text's ids. */
Test(server, a_chats_prompt_is_deepseek_v4s_encoding)
{
    start(NULL, dir, 256);
    char out[8192];
    cr_assert_eq(curl("/v1/chat/completions", "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
                      "{\"role\":\"user\",\"content\":\"Hi\"},{\"role\":\"assistant\",\"content\":\"Hello.\"},"
                      "{\"role\":\"user\",\"content\":\"Bye\"}],\"max_tokens\":1}", NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out);
    int64_t got = json_integer_value(json_object_get(json_object_get(j, "usage"), "prompt_tokens"));
    json_decref(j);
    struct pd_tok *t = tok_of(dir);
    const char *want = "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>Hello.<｜end▁of▁sentence｜>"
                       "<｜User｜>Bye<｜Assistant｜></think>";
    int32_t *ids;
    size_t n;
    pd_err e = {0};
    cr_assert_eq(pd_tok_encode(t, want, strlen(want), &ids, &n, &e), 0, "%s", e.msg);
    cr_expect_eq(ids[0], pd_tok_bos(t), "the BOS text is the BOS token");
    cr_expect_eq(got, (int64_t)n, "prompt_tokens %lld, the V4 encoding's text has %zu ids", (long long)got, n);
    free(ids);
    pd_tok_free(t);
}

/* The ids of chat `msgs` (a JSON array) that `pdmoe tokenize --chat` prints with `flags`: how many. */
static size_t tokenize_chat(const char *msgs, const char *flags)
{
    char path[] = "/tmp/pdmoe-chat-XXXXXX", args[1024];
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    cr_assert_eq(write(fd, msgs, strlen(msgs)), (ssize_t)strlen(msgs));
    close(fd);
    snprintf(args, sizeof args, "tokenize --tokenizer %s/tokenizer.json --chat %s --jsonl %s %s", dir, dir, path, flags);
    static struct run r;
    run(args, &r);
    remove(path);
    cr_assert_eq(r.status, 0, "pdmoe %s: %s", args, r.err);
    json_t *j = json_loads(r.out, 0, NULL);
    cr_assert(json_is_array(json_object_get(j, "ids")), "pdmoe %s: %s", args, r.out);
    const size_t k = json_array_size(json_object_get(j, "ids"));
    json_decref(j);
    return k;
}

/* `pdmoe tokenize --chat` with a request's thinking fields as flags counts the prompt the server
 * does: a chat whose earlier answer carries its reasoning, in chat mode, thinking mode, thinking
 * with the earlier reasoning kept, and with reasoning_effort "max" (four different prompts). */
Test(server, tokenize_chat_takes_the_requests_thinking_fields)
{
    start(NULL, dir, 512);
    const char *msgs = "[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Hi\"},"
                       "{\"role\":\"assistant\",\"content\":\"Hello!\",\"reasoning\":\"A greeting: answer it.\"},"
                       "{\"role\":\"user\",\"content\":\"And then?\"}]";
    const struct {
        const char *fields, *flags;
    } c[] = {
        {"", ""},
        {",\"chat_template_kwargs\":{\"thinking\":true}", "--thinking"},
        {",\"chat_template_kwargs\":{\"thinking\":true,\"drop_thinking\":false}", "--thinking --no-drop-thinking"},
        {",\"chat_template_kwargs\":{\"enable_thinking\":true},\"reasoning_effort\":\"max\"",
         "--thinking --reasoning-effort max"},
        {",\"chat_template_kwargs\":{\"thinking\":true},\"reasoning_effort\":\"none\"", "--thinking --reasoning-effort none"},
    };
    size_t seen[5];
    for (size_t i = 0; i < sizeof c / sizeof *c; i++) {
        char body[1024], out[16384];
        snprintf(body, sizeof body, "{\"messages\":%s,\"max_tokens\":1%s}", msgs, c[i].fields);
        cr_assert_eq(curl("/v1/chat/completions", body, NULL, out, sizeof out), 200, "%s", out);
        json_t *j = parse(out);
        const json_int_t want = json_integer_value(json_object_get(json_object_get(j, "usage"), "prompt_tokens"));
        json_decref(j);
        seen[i] = tokenize_chat(msgs, c[i].flags);
        cr_expect_eq((json_int_t)seen[i], want, "tokenize %s: %zu ids, the server's prompt_tokens %lld", c[i].flags,
                     seen[i], (long long)want);
    }
    /* the modes do render differently (chat, thinking, kept reasoning, max effort); "none" is chat mode */
    cr_expect(seen[0] != seen[1] && seen[1] != seen[2] && seen[1] != seen[3] && seen[2] != seen[3],
              "%zu %zu %zu %zu", seen[0], seen[1], seen[2], seen[3]);
    cr_expect_eq(seen[4], seen[0]);
}

/* Thinking mode (chat_template_kwargs {"thinking": true}, as vLLM takes it for V4): the prompt
 * ends "<｜Assistant｜><think>" (prompt_tokens count that text's ids), and the answer is split as
 * vLLM's reasoning parser splits it: the same greedy text the raw prompt gets from /v1/completions,
 * its reasoning before "</think>" and content after (null when it never came: the random mini
 * model's answer is all reasoning), the streamed "reasoning" deltas adding up to it; usage as for
 * any answer. "enable_thinking" is the same switch; reasoning_effort "none" is chat mode. */
Test(server, a_thinking_chat_opens_think_and_splits_the_answer)
{
    start(NULL, dir, 256);
    char out[16384], raw[16384], st[65536];
    const char *msgs = "\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":6,\"temperature\":0";
    char body[512];
    snprintf(body, sizeof body, "{%s,\"chat_template_kwargs\":{\"thinking\":true}}", msgs);
    cr_assert_eq(curl("/v1/chat/completions", body, NULL, out, sizeof out), 200, "%s", out);
    const char *prompt = "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>";
    char rbody[512];
    snprintf(rbody, sizeof rbody, "{\"prompt\":\"%s\",\"max_tokens\":6,\"temperature\":0}", prompt + strlen("<｜begin▁of▁sentence｜>"));
    cr_assert_eq(curl("/v1/completions", rbody, NULL, raw, sizeof raw), 200, "%s", raw);
    json_t *j = parse(out), *jr = parse(raw);
    json_t *msg = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message");
    const char *text = json_string_value(json_object_get(json_array_get(json_object_get(jr, "choices"), 0), "text"));
    cr_assert(text, "%s", raw);
    size_t ro, rl, co, tl = strlen(text);
    int found = pd_chat_think_split(text, tl, &ro, &rl, &co);
    cr_expect(json_is_string(json_object_get(msg, "reasoning")), "%s", out);
    cr_expect_eq(json_string_length(json_object_get(msg, "reasoning")), rl, "%s | %s", out, raw);
    cr_expect_eq(memcmp(json_string_value(json_object_get(msg, "reasoning")), text + ro, rl), 0, "%s | %s", out, raw);
    if (found && co < tl)
        cr_expect_str_eq(json_string_value(json_object_get(msg, "content")), text + co);
    else
        cr_expect(json_is_null(json_object_get(msg, "content")), "%s", out);
    /* the prompt: the raw completion's prompt_tokens, BOS and all */
    struct pd_tok *t = tok_of(dir);
    int32_t *ids;
    size_t n;
    pd_err e = {0};
    cr_assert_eq(pd_tok_encode(t, prompt, strlen(prompt), &ids, &n, &e), 0, "%s", e.msg);
    cr_expect_eq(json_integer_value(json_object_get(json_object_get(j, "usage"), "prompt_tokens")), (json_int_t)n, "%s", out);
    cr_expect(json_equal(json_object_get(json_object_get(j, "usage"), "completion_tokens"),
                         json_object_get(json_object_get(jr, "usage"), "completion_tokens")), "%s | %s", out, raw);
    free(ids);
    pd_tok_free(t);
    /* streamed: "reasoning" deltas, then "content" ones, adding up to the whole answer */
    snprintf(body, sizeof body, "{%s,\"stream\":true,\"chat_template_kwargs\":{\"enable_thinking\":true}}", msgs);
    cr_assert_eq(curl("/v1/chat/completions", body, NULL, st, sizeof st), 200, "%s", st);
    char reasoning[4096] = "", content[4096] = "";
    for (char *line = strtok(st, "\n"); line; line = strtok(NULL, "\n")) {
        if (strncmp(line, "data: {", 7))
            continue;
        json_t *c = parse(line + 6);
        json_t *d = json_object_get(json_array_get(json_object_get(c, "choices"), 0), "delta");
        if (json_is_string(json_object_get(d, "reasoning")))
            strncat(reasoning, json_string_value(json_object_get(d, "reasoning")), sizeof reasoning - strlen(reasoning) - 1);
        if (json_is_string(json_object_get(d, "content")))
            strncat(content, json_string_value(json_object_get(d, "content")), sizeof content - strlen(content) - 1);
        json_decref(c);
    }
    cr_expect_str_eq(reasoning, json_string_value(json_object_get(msg, "reasoning")));
    cr_expect_str_eq(content, json_is_string(json_object_get(msg, "content")) ? json_string_value(json_object_get(msg, "content")) : "");
    json_decref(j);
    json_decref(jr);
    /* reasoning_effort "none" turns it off: a chat answer, "content" only */
    snprintf(body, sizeof body, "{%s,\"chat_template_kwargs\":{\"thinking\":true},\"reasoning_effort\":\"none\"}", msgs);
    cr_assert_eq(curl("/v1/chat/completions", body, NULL, out, sizeof out), 200, "%s", out);
    cr_expect(!strstr(out, "\"reasoning\"") && strstr(out, "\"content\""), "%s", out);
    /* the answer's message sent back whole, as a client appends it (with the fields OpenAI's SDK
     * writes out empty): taken, its reasoning dropped from the earlier turn (drop_thinking), so the
     * prompt is the one of the same chat without it */
    static char turn2[8192];
    snprintf(turn2, sizeof turn2, "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"},{\"role\":\"assistant\","
             "\"content\":\"Hello\",\"reasoning\":\"be brief\",\"refusal\":null,\"tool_calls\":null,"
             "\"annotations\":[]},{\"role\":\"user\",\"content\":\"More\"}],\"max_tokens\":1,"
             "\"chat_template_kwargs\":{\"thinking\":true}}");
    cr_assert_eq(curl("/v1/chat/completions", turn2, NULL, out, sizeof out), 200, "%s", out);
    json_t *a = parse(out);
    snprintf(turn2, sizeof turn2, "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"},{\"role\":\"assistant\","
             "\"content\":\"Hello\"},{\"role\":\"user\",\"content\":\"More\"}],\"max_tokens\":1,"
             "\"chat_template_kwargs\":{\"thinking\":true}}");
    cr_assert_eq(curl("/v1/chat/completions", turn2, NULL, out, sizeof out), 200, "%s", out);
    json_t *b = parse(out);
    cr_expect(json_equal(json_object_get(json_object_get(a, "usage"), "prompt_tokens"),
                         json_object_get(json_object_get(b, "usage"), "prompt_tokens")));
    json_decref(a);
    json_decref(b);
}

/* Two answers whose first choices carry the same token_ids. */
static void expect_same_token_ids(const char *a, const char *b)
{
    json_t *ja = parse(a), *jb = parse(b);
    cr_expect(json_equal(json_object_get(json_array_get(json_object_get(ja, "choices"), 0), "token_ids"),
                         json_object_get(json_array_get(json_object_get(jb, "choices"), 0), "token_ids")),
              "%s | %s", a, b);
    json_decref(ja);
    json_decref(jb);
}

/* A completion's prompt as token ids is taken as given (no BOS added, as vLLM takes it): BOS + the
 * text's ids give the text's answer, tokens and usage; an empty array, a batch, an id out of the
 * vocabulary are 400s naming "prompt". */
Test(server, a_prompt_of_token_ids_is_taken_as_given)
{
    start(NULL, dir, 256);
    struct pd_tok *t = tok_of(dir);
    int32_t *ids;
    size_t n;
    pd_err e = {0};
    cr_assert_eq(pd_tok_encode(t, "Hello there", 11, &ids, &n, &e), 0, "%s", e.msg);
    char body[1024];
    int at = snprintf(body, sizeof body, "{\"prompt\":[%d", pd_tok_bos(t));
    for (size_t i = 0; i < n; i++)
        at += snprintf(body + at, sizeof body - (size_t)at, ",%d", ids[i]);
    snprintf(body + at, sizeof body - (size_t)at, "],\"max_tokens\":5,\"temperature\":0,\"return_token_ids\":true}");
    char a[8192], b[8192];
    cr_assert_eq(curl("/v1/completions", body, NULL, a, sizeof a), 200, "%s", a);
    cr_assert_eq(curl("/v1/completions", "{\"prompt\":\"Hello there\",\"max_tokens\":5,\"temperature\":0,"
                      "\"return_token_ids\":true}", NULL, b, sizeof b), 200, "%s", b);
    json_t *ja = parse(a), *jb = parse(b);
    cr_expect(json_equal(json_object_get(ja, "usage"), json_object_get(jb, "usage")), "%s | %s", a, b);
    cr_expect_eq(json_integer_value(json_object_get(json_object_get(ja, "usage"), "prompt_tokens")), (json_int_t)n + 1);
    json_decref(ja);
    json_decref(jb);
    expect_same_token_ids(a, b);
    free(ids);
    pd_tok_free(t);
    /* a batch of one is its prompt (lm-eval sends ["text"]): the same answer */
    char c1[8192];
    cr_assert_eq(curl("/v1/completions", "{\"prompt\":[\"Hello there\"],\"max_tokens\":5,\"temperature\":0,"
                      "\"return_token_ids\":true}", NULL, c1, sizeof c1), 200, "%s", c1);
    expect_same_token_ids(c1, b);
    char one[1100];   /* {"prompt":[[bos, ...]], ...}: a batch of one prompt of token ids */
    snprintf(one, sizeof one, "{\"prompt\":[%s", body + strlen("{\"prompt\":"));
    char *close = strstr(one, "],");
    cr_assert_not_null(close);
    memmove(close + 1, close, strlen(close) + 1);
    cr_assert_eq(curl("/v1/completions", one, NULL, c1, sizeof c1), 200, "%s: %s", one, c1);
    expect_same_token_ids(c1, b);
    expect(400, "/v1/completions", "{\"prompt\": []}", NULL, "prompt");
    expect(400, "/v1/completions", "{\"prompt\": [[]]}", NULL, "prompt");
    expect(400, "/v1/completions", "{\"prompt\": [\"a\", \"b\"]}", NULL, "prompt");
    expect(400, "/v1/completions", "{\"prompt\": [[1], [2]]}", NULL, "prompt");
    expect(400, "/v1/completions", "{\"prompt\": [1, -1]}", NULL, "prompt");
    expect(400, "/v1/completions", "{\"prompt\": [1, 1.5]}", NULL, "prompt");
    expect(400, "/v1/completions", "{\"prompt\": [1, 100000000]}", NULL, "prompt");
}

/* max_tokens left out: 16 for a completion, as OpenAI and vLLM default it; for a chat the rest of the
 * context, as vLLM defaults it (ignore_eos: the whole of it is generated); a chat whose prompt
 * leaves no room is a 400 naming messages. */
Test(server, an_unset_max_tokens_is_vllms_default)
{
    start(NULL, dir, 96);
    char out[1 << 16];
    cr_assert_eq(curl("/v1/completions", "{\"prompt\":\"Hi\",\"ignore_eos\":true}", NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out), *u = json_object_get(j, "usage");
    cr_expect_eq(json_integer_value(json_object_get(u, "completion_tokens")), 16, "%s", out);
    json_decref(j);
    cr_assert_eq(curl("/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"ignore_eos\":true}",
                      NULL, out, sizeof out), 200, "%s", out);
    j = parse(out);
    u = json_object_get(j, "usage");
    cr_expect_eq(json_integer_value(json_object_get(u, "total_tokens")), 96, "%s", out);
    cr_expect_gt(json_integer_value(json_object_get(u, "completion_tokens")), 16, "%s", out);
    cr_expect_str_eq(json_string_value(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "finish_reason")),
                     "length");
    json_decref(j);
    char body[4096];
    int at = snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"");
    for (int i = 0; i < 200; i++)
        at += snprintf(body + at, sizeof body - (size_t)at, "word%d ", i);
    snprintf(body + at, sizeof body - (size_t)at, "\"}]}");
    expect(400, "/v1/chat/completions", body, NULL, "messages");
}

/* The greedy answer of "The sea and the river" in `max` tokens: its text (json_t owned by *doc). */
static const char *greedy_text(int max, json_t **doc)
{
    char body[256], out[1 << 16];
    snprintf(body, sizeof body, "{\"prompt\":\"The sea and the river\",\"max_tokens\":%d,\"temperature\":0,"
             "\"ignore_eos\":true,\"return_token_ids\":true}", max);
    cr_assert_eq(curl("/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    *doc = parse(out);
    return json_string_value(json_object_get(json_array_get(json_object_get(*doc, "choices"), 0), "text"));
}

/* An answer ended by a stop string counts the tokens up to the one that completed it, as vLLM does
 * (completion_tokens, token_ids, the stream's usage), however far the scheduler ran past it before
 * the stop was seen: it once counted those too, a different number each time. */
Test(server, a_stop_strings_answer_counts_the_tokens_up_to_the_stop)
{
    start(NULL, dir, 1024);
    json_t *all;
    const char *full = greedy_text(40, &all);
    char stop[64], esc[256];
    stop_from_middle(full, stop, esc);
    json_t *ids = json_object_get(json_array_get(json_object_get(all, "choices"), 0), "token_ids");
    /* k: the fewest greedy tokens whose text holds the stop string */
    int lo = 1, hi = 40;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        json_t *d;
        int has = strstr(greedy_text(mid, &d), stop) != NULL;
        json_decref(d);
        if (has)
            hi = mid;
        else
            lo = mid + 1;
    }
    const int k = lo;
    char body[1024], out[1 << 16];
    for (int rep = 0; rep < 6; rep++)
        for (int stream = 0; stream < 2; stream++) {
            snprintf(body, sizeof body, "{\"prompt\":\"The sea and the river\",\"max_tokens\":600,\"temperature\":0,"
                     "\"ignore_eos\":true,\"stop\":%s%s}", esc,
                     stream ? ",\"stream\":true,\"stream_options\":{\"include_usage\":true}" : ",\"return_token_ids\":true");
            cr_assert_eq(curl("/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
            json_t *u;
            struct sse x = {0};
            json_t *doc = NULL;
            if (stream) {
                read_sse(out, &x);
                u = json_object_get(x.last, "usage");
            } else {
                doc = parse(out);
                u = json_object_get(doc, "usage");
                json_t *got = json_object_get(json_array_get(json_object_get(doc, "choices"), 0), "token_ids");
                cr_assert_eq(json_array_size(got), (size_t)k, "stop %s: %s", esc, out);
                for (int i = 0; i < k; i++)
                    cr_assert(json_equal(json_array_get(got, (size_t)i), json_array_get(ids, (size_t)i)));
            }
            cr_assert_eq(json_integer_value(json_object_get(u, "completion_tokens")), k, "stop %s (rep %d, %s): %s", esc,
                         rep, stream ? "stream" : "whole", stream ? json_dumps(x.last, 0) : out);
            json_decref(doc);
            json_decref(x.last);
        }
    json_decref(all);
}

/* Without a seed, every sample is its own (vLLM's): requests in the same second once shared one,
 * the arrival second; with a seed, the same sample again. */
Test(server, unseeded_samples_differ_and_a_seed_repeats)
{
    start(NULL, dir, 256);
    char out[4][8192];
    for (int i = 0; i < 4; i++)
        cr_assert_eq(curl("/v1/completions", "{\"prompt\":\"hi\",\"max_tokens\":12,\"temperature\":1,\"ignore_eos\":true,"
                          "\"return_token_ids\":true}", NULL, out[i], sizeof out[i]), 200, "%s", out[i]);
    int distinct = 0;
    for (int i = 0; i < 4; i++) {
        int seen = 0;
        json_t *a = parse(out[i]);
        for (int j = 0; j < i && !seen; j++) {
            json_t *b = parse(out[j]);
            seen = json_equal(json_object_get(json_array_get(json_object_get(a, "choices"), 0), "token_ids"),
                              json_object_get(json_array_get(json_object_get(b, "choices"), 0), "token_ids"));
            json_decref(b);
        }
        json_decref(a);
        distinct += !seen;
    }
    cr_expect_geq(distinct, 3, "4 unseeded samples, %d distinct", distinct);
    for (int i = 0; i < 2; i++)
        cr_assert_eq(curl("/v1/completions", "{\"prompt\":\"hi\",\"max_tokens\":12,\"temperature\":1,\"ignore_eos\":true,"
                          "\"return_token_ids\":true,\"seed\":7}", NULL, out[i], sizeof out[i]), 200, "%s", out[i]);
    expect_same_token_ids(out[0], out[1]);
}

/* top_p is a number in (0, 1]: one below the smallest float (1e-320) is the narrowest nucleus, the
 * best token alone, as 1e-30 is, the greedy tokens. Cast to a float it was 0, which the sampler
 * reads as "unset", 1: the request sampled the whole vocabulary. */
Test(server, a_top_p_below_the_smallest_float_is_the_best_token)
{
    start(NULL, dir, 256);
    char greedy[8192], out[8192];
    cr_assert_eq(curl("/v1/completions", "{\"prompt\":\"hi\",\"max_tokens\":12,\"temperature\":0,\"ignore_eos\":true,"
                      "\"return_token_ids\":true}", NULL, greedy, sizeof greedy), 200, "%s", greedy);
    static const char *const tiny[] = {"1e-30", "1e-320", "4.9e-324"};
    for (int i = 0; i < 3; i++) {
        char body[256];
        snprintf(body, sizeof body, "{\"prompt\":\"hi\",\"max_tokens\":12,\"temperature\":1,\"top_p\":%s,"
                 "\"seed\":7,\"ignore_eos\":true,\"return_token_ids\":true}", tiny[i]);
        cr_assert_eq(curl("/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
        expect_same_token_ids(greedy, out);
    }
}

/* What vLLM's clients send as they send it: `vllm bench serve` puts "repetition_penalty": 1.0 in
 * every completions request (and --top-k/--min-p send top_k -1, min_p 0), which were refused as
 * unsupported, failing the whole benchmark; whole-number floats for integers (max_tokens 2.0) as
 * pydantic takes them; /v1/models with OpenAI's "created"; return_token_ids listing the stop token
 * that ended the answer (as many ids as the usage counts) and the prompt's ids, as vLLM does. */
Test(server, what_vllms_clients_send_and_read)
{
    start(NULL, dir, 256);
    char out[16384];
    cr_assert_eq(curl("/v1/completions", "{\"prompt\":\"Hello world\",\"repetition_penalty\":1.0,\"max_tokens\":2,"
                      "\"logprobs\":null,\"top_k\":-1,\"min_p\":0.0,\"stream\":true,\"stream_options\":"
                      "{\"include_usage\":true}}", NULL, out, sizeof out), 200, "%s", out);
    cr_assert(strstr(out, "data: [DONE]"), "%s", out);
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"repetition_penalty\":1.1}", NULL, "repetition_penalty");
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"top_k\":5}", NULL, "top_k");
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"min_p\":0.1}", NULL, "min_p");
    cr_assert_eq(curl("/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":2.0,\"seed\":1e1}", NULL, out, sizeof out), 200,
                 "%s", out);
    expect(400, "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":2.5}", NULL, "max_tokens");

    cr_assert_eq(curl("/v1/models", NULL, NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out), *m = json_array_get(json_object_get(j, "data"), 0);
    cr_assert(json_is_integer(json_object_get(m, "created")) && json_integer_value(json_object_get(m, "created")) > 1700000000,
              "%s", out);
    cr_assert_str_eq(json_string_value(json_object_get(m, "owned_by")), "pdmoe");
    json_decref(j);

    /* the greedy continuation's second token made a stop token: the answer ends on it */
    cr_assert_eq(curl("/v1/completions", "{\"prompt\":\"Hello\",\"max_tokens\":4,\"temperature\":0,\"ignore_eos\":true,"
                      "\"return_token_ids\":true}", NULL, out, sizeof out), 200, "%s", out);
    j = parse(out);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0), *ids = json_object_get(c, "token_ids");
    cr_assert(json_array_size(ids) == 4, "%s", out);
    int64_t second = json_integer_value(json_array_get(ids, 1)), first = json_integer_value(json_array_get(ids, 0));
    cr_assert_gt(json_array_size(json_object_get(c, "prompt_token_ids")), 0, "no prompt_token_ids: %s", out);
    json_decref(j);
    if (second == first)
        return;   /* (a stop token equal to the first would end the answer there) */
    char body[256];
    snprintf(body, sizeof body, "{\"prompt\":\"Hello\",\"max_tokens\":4,\"temperature\":0,\"ignore_eos\":true,"
             "\"return_token_ids\":true,\"stop_token_ids\":[%lld]}", (long long)second);
    cr_assert_eq(curl("/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    j = parse(out);
    c = json_array_get(json_object_get(j, "choices"), 0);
    ids = json_object_get(c, "token_ids");
    cr_assert_str_eq(json_string_value(json_object_get(c, "finish_reason")), "stop", "%s", out);
    cr_assert_eq(json_array_size(ids), 2, "the stop token is not listed: %s", out);
    cr_assert_eq(json_integer_value(json_array_get(ids, 1)), second);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")), 2, "%s", out);
    json_decref(j);
}

/* A request that leaves while it waits gives up its place: the waiting gauge falls and the only
 * place of --max-queued-requests 1 takes the next client, while the running request goes on. */
Test(server, a_waiting_client_that_leaves_frees_its_place_at_once)
{
    tmp_model_positions(dir, 16384);
    max_queued = 1;
    start_seqs(NULL, dir, 16384, 1);
    max_queued = 0;
    pid_t a = hold_the_slot();
    char cmd[512];
    snprintf(cmd, sizeof cmd, "curl -s -o /dev/null --max-time 0.5 http://127.0.0.1:%d/v1/completions "
             "-d '{\"prompt\":\"y\",\"max_tokens\":4}'", port);
    cr_assert_neq(system(cmd), 0, "the waiting request was answered");   /* it gave up after 0.5 s */
    int waiting = 1;
    for (int i = 0; i < 200 && waiting; i++) {
        waiting = metric("pdmoe_num_requests_waiting");
        if (waiting)
            usleep(10000);
    }
    cr_assert_eq(waiting, 0, "a client that left still counts as waiting");
    snprintf(cmd, sizeof cmd, "curl -s -o /dev/null -w '%%{http_code}' --max-time 0.5 "
             "http://127.0.0.1:%d/v1/completions -d '{\"prompt\":\"z\",\"max_tokens\":4}'", port);
    FILE *c = popen(cmd, "r");
    char code[8] = "";
    cr_assert_not_null(fgets(code, sizeof code, c));
    pclose(c);
    cr_assert_neq(strcmp(code, "429"), 0, "a place was still held by the client that left");
    cr_assert_eq(metric("pdmoe_requests_queue_full_total"), 0);
    release_the_slot(a);
}

/* A stop string completing a request one token before max_tokens: counted completed, and not
 * also cancelled (the scheduler's next step ended it at max_tokens after its answer had gone, and
 * the answer loop took it for a client that left), so accepted = completed + cancelled + failed. */
Test(server, a_stop_string_answer_is_counted_once)
{
    start(NULL, dir, 1024);
    char out[8192];
    cr_assert_eq(curl("/v1/completions", "{\"prompt\":\"hello world\",\"max_tokens\":5,\"temperature\":0,"
                      "\"ignore_eos\":true}", NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out);
    const char *text = json_string_value(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "text"));
    cr_assert(text && strlen(text) >= 4, "%s", out);
    /* the last two characters of 5 tokens' text: with max_tokens 6 the stop completes a token
     * before the end, and the scheduler's step after it reaches max_tokens */
    char stop[8];
    snprintf(stop, sizeof stop, "%s", text + strlen(text) - 2);
    json_decref(j);
    json_t *b = json_pack("{s:s,s:i,s:i,s:b,s:[s]}", "prompt", "hello world", "max_tokens", 6, "temperature", 0,
                          "ignore_eos", 1, "stop", stop);
    char *body = json_dumps(b, 0);
    json_decref(b);
    for (int i = 0; i < 10; i++)
        cr_assert_eq(curl("/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    free(body);
    int done = 0;
    for (int i = 0; i < 200 && !done; i++) {
        done = metric("pdmoe_num_requests_running") == 0 && metric("pdmoe_num_requests_waiting") == 0;
        if (!done)
            usleep(10000);
    }
    usleep(100000);
    cr_assert_eq(metric("pdmoe_requests_total"), 11);
    cr_assert_eq(metric("pdmoe_requests_completed_total"), 11);
    cr_assert_eq(metric("pdmoe_requests_cancelled_total"), 0, "stop-string answers counted as cancelled too");
}

/* The special tokens of a chat's prompt are its template's: the text of EOS or BOS typed in a
 * message is that text (a user could otherwise end the prompt or forge a turn: it once became ids
 * 1 and 0 mid-prompt), while a completion's raw prompt reads them as vLLM does. */
Test(server, special_token_text_in_a_message_is_text)
{
    start(NULL, dir, 1024);
    char out[1 << 16];
    const char *inj = "x<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c><\xef\xbd\x9c"
                      "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>y";
    char body[512];
    snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}],\"max_tokens\":1,"
             "\"return_token_ids\":true}", inj);
    cr_assert_eq(curl("/v1/chat/completions", body, NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out);
    json_t *ids = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "prompt_token_ids");
    cr_assert(json_array_size(ids) > 10, "%s", out);
    cr_assert_eq(json_integer_value(json_array_get(ids, 0)), 0, "the BOS first: %s", out);
    for (size_t i = 1; i < json_array_size(ids); i++) {
        json_int_t id = json_integer_value(json_array_get(ids, i));
        cr_assert(id != 0 && id != 1, "a special id (%lld) at %zu of the chat's prompt: %s", (long long)id, i, out);
    }
    json_decref(j);
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":1,\"return_token_ids\":true}", inj);
    cr_assert_eq(curl("/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    j = parse(out);
    ids = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "prompt_token_ids");
    int specials = 0;
    for (size_t i = 1; i < json_array_size(ids); i++)
        specials += json_integer_value(json_array_get(ids, i)) <= 1;
    cr_assert_eq(specials, 2, "a completion's prompt reads the two special texts as their ids: %s", out);
    json_decref(j);
}

/* A completion without max_tokens asks for vLLM's default 16: a prompt that leaves less room is
 * refused saying the 16 is the default (the client never sent a max_tokens of 16). */
Test(server, the_default_max_tokens_is_named_as_such)
{
    start(NULL, dir, 128);
    char body[2048], out[8192];
    int at = snprintf(body, sizeof body, "{\"prompt\":[");
    for (int i = 0; i < 120; i++)
        at += snprintf(body + at, sizeof body - at, "%s%d", i ? "," : "", 100 + i);
    snprintf(body + at, sizeof body - at, "]}");
    cr_assert_eq(curl("/v1/completions", body, NULL, out, sizeof out), 400, "%s", out);
    cr_assert(strstr(out, "max_tokens asks for 16 (its default: the request does not set it)"), "%s", out);
}

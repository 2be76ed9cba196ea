/* Prefill-decode disaggregation on loopback: a producer (prefill) and a consumer (decode) server,
 * the KV handed over with UCX, give the same tokens as one colocated server; a failed transfer
 * falls back to recomputing the prompt from its token ids with no token lost or repeated; a lease
 * nobody claims expires and frees the producer's blocks; misdirected requests get a 400. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/timing.h"
#include "engine/genmodel.h"
#include "../tmpmodel.h"
#include "pd/server.h"
#include "sockets.h"
#include "util.h"

static char dir[64];

static struct node P, D, C;

static void *run_loop(void *arg)
{
    pd_err e;
    pd_server_run(((struct node *)arg)->s, &e);
    return NULL;
}

/* the last pull failure a consumer logged */
static char logged[512];

static void log_line(void *arg, const char *line)
{
    (void)arg;
    snprintf(logged, sizeof logged, "%s", line);
}

static int kv_port;   /* the producer's KV port; 0: any */

static struct pd_kv_producer producer_only;   /* a consumer's one allowed producer (port 0: any) */

static void start_kv(struct node *n, int role, int lease_ms, enum pd_kv_dtype kv)
{
    pd_err e = {0};
    struct pd_server_opts o = {.model_dir = dir, .port = 0, .threads = 1, .max_num_seqs = 8, .max_model_len = 512,
                               .served_name = "tiny", .role = role, .kv_port = role == PD_ROLE_PRODUCER ? kv_port : 0,
                               .engine_id = "t",
                               .kv_lease_ms = lease_ms, .kv_timeout_ms = 3000, .kv_dtype = kv,
                               .http = {.log = log_line}};
    if (role == PD_ROLE_CONSUMER && producer_only.port_lo) {
        o.kv_producers[0] = producer_only;
        o.n_kv_producers = 1;
    }
    cr_assert_eq(pd_server_create(&o, &n->s, &e), 0, "%s", e.msg);
    n->port = pd_server_port(n->s);
    pthread_create(&n->loop, NULL, run_loop, n);
}

static void start(struct node *n, int role, int lease_ms)
{
    start_kv(n, role, lease_ms, PD_KV_BF16);
}

static void setup(void)
{
    tmp_model("v4-tiny", 9, dir, sizeof dir);
}

static void teardown(void)
{
    node_stop(&P);
    node_stop(&D);
    node_stop(&C);
    rm_model(dir);
}

TestSuite(pd, .init = setup, .fini = teardown, .timeout = 120);

static char *ids_of(const char *json)
{
    json_t *j = parse(json);
    json_t *ids = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids");
    char *s = json_dumps(ids, JSON_COMPACT);
    json_decref(j);
    return s;
}

static int metric(int port, const char *name)
{
    return metric_port(port, name);
}

/* A prompt as it goes into a body: a JSON array of token ids as it is, a text quoted. */
static const char *q(const char *prompt)
{
    return prompt[0] == '[' ? "" : "\"";
}

/* P then D as the proxy does; returns D's answer. `break_port` sends D to a dead port. */
static void pd_request(const char *prompt, int max_tokens, int break_port, char *out, size_t cap)
{
    char body[2048], pout[8192];
    snprintf(body, sizeof body,
             "{\"prompt\":%s%s%s,\"max_tokens\":1,\"temperature\":0,\"kv_transfer_params\":{\"do_remote_decode\":true}}",
             q(prompt), prompt, q(prompt));
    cr_assert_eq(curl_port(P.port, "/v1/completions", body, NULL, pout, sizeof pout), 200, "%s", pout);
    json_t *j = parse(pout);
    json_t *kv = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "kv_transfer_params");
    cr_assert(json_is_true(json_object_get(kv, "do_remote_prefill")), "%s", pout);
    if (break_port)
        json_object_set_new(kv, "remote_port", json_integer(1));
    char *kvs = json_dumps(kv, JSON_COMPACT);
    snprintf(body, sizeof body,
             "{\"prompt\":%s%s%s,\"max_tokens\":%d,\"temperature\":0,\"return_token_ids\":true,\"kv_transfer_params\":%s}",
             q(prompt), prompt, q(prompt), max_tokens, kvs);
    free(kvs);
    json_decref(j);
    cr_assert_eq(curl_port(D.port, "/v1/completions", body, NULL, out, cap), 200, "%s", out);
}

static void colocated(const char *prompt, int max_tokens, char *out, size_t cap)
{
    char body[1024];
    snprintf(body, sizeof body, "{\"prompt\":%s%s%s,\"max_tokens\":%d,\"temperature\":0,\"return_token_ids\":true}",
             q(prompt), prompt, q(prompt), max_tokens);
    cr_assert_eq(curl_port(C.port, "/v1/completions", body, NULL, out, cap), 200, "%s", out);
}

/* Each prompt through P and D gives the ids C gives (16 tokens, greedy). */
static void pd_equals_colocated(const char *const *prompts, int n)
{
    char a[8192], b[8192];
    for (int i = 0; i < n; i++) {
        pd_request(prompts[i], 16, 0, a, sizeof a);
        colocated(prompts[i], 16, b, sizeof b);
        char *x = ids_of(a), *y = ids_of(b);
        cr_assert_str_eq(x, y, "prompt %d: PD %s, colocated %s", i, x, y);
        free(x);
        free(y);
    }
}

Test(pd, same_tokens_as_colocated)
{
    start(&P, PD_ROLE_PRODUCER, 0);
    start(&D, PD_ROLE_CONSUMER, 0);
    start(&C, PD_ROLE_BOTH, 0);
    /* a prompt of token ids (no BOS: taken as given) too */
    const char *prompts[] = {"Hello", "The sea froze over and the children skated until the sun went down",
                             "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25",
                             "[5,17,200,33,41,8,150,77,91,12]"};
    pd_equals_colocated(prompts, 4);
    cr_assert_eq(metric(D.port, "pdmoe_kv_transfers_total"), 4);
    cr_assert_eq(metric(D.port, "pdmoe_kv_recomputes_total"), 0);
    cr_assert_gt(metric(D.port, "pdmoe_kv_transfer_bytes_total"), 0);
    /* the producer freed every lease once the consumer said DONE */
    for (int i = 0; i < 100 && metric(P.port, "pdmoe_kv_leases") > 0; i++)
        usleep(20000);
    cr_assert_eq(metric(P.port, "pdmoe_kv_leases"), 0);
    cr_assert_eq(metric(P.port, "pdmoe_kv_blocks_free"), metric(P.port, "pdmoe_kv_blocks_capacity"));
    cr_assert_eq(metric(D.port, "pdmoe_kv_blocks_free"), metric(D.port, "pdmoe_kv_blocks_capacity"));
}

/* The answer to `fields` (a body's members after the prompt: sampling, stop tokens) through P
 * then D as the proxy sends them, and from C, as {text, finish_reason, completion_tokens, ids}. */
static json_t *answer_of(int port, const char *body)
{
    char out[8192];
    cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out), *c = json_array_get(json_object_get(j, "choices"), 0);
    json_t *ids = json_object_get(c, "token_ids");
    json_t *a = json_pack("{s:O,s:O,s:O,s:O}", "text", json_object_get(c, "text"), "finish_reason",
                          json_object_get(c, "finish_reason"), "completion_tokens",
                          json_object_get(json_object_get(j, "usage"), "completion_tokens"), "ids",
                          ids ? ids : json_null());
    cr_assert_not_null(a, "%s", out);
    json_decref(j);
    return a;
}

static void pd_same_answer(const char *prompt, const char *fields, int max_tokens)
{
    char body[2048], pout[8192];
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",%s,\"max_tokens\":1,\"kv_transfer_params\":{\"do_remote_decode\":true}}",
             prompt, fields);
    cr_assert_eq(curl_port(P.port, "/v1/completions", body, NULL, pout, sizeof pout), 200, "%s", pout);
    json_t *j = parse(pout);
    char *kvs = json_dumps(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "kv_transfer_params"),
                           JSON_COMPACT);
    json_decref(j);
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",%s,\"max_tokens\":%d,\"return_token_ids\":true,\"kv_transfer_params\":%s}",
             prompt, fields, max_tokens, kvs);
    free(kvs);
    json_t *pd = answer_of(D.port, body);
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",%s,\"max_tokens\":%d,\"return_token_ids\":true}", prompt, fields,
             max_tokens);
    json_t *co = answer_of(C.port, body);
    char *x = json_dumps(pd, JSON_SORT_KEYS), *y = json_dumps(co, JSON_SORT_KEYS);
    cr_assert_str_eq(x, y, "%s: PD %s, colocated %s", fields, x, y);
    free(x);
    free(y);
    json_decref(pd);
    json_decref(co);
}

/* What the proxy's path gives is what one instance gives: a first token that is one of the
 * request's stop_token_ids (through P and D it was taken as text and decoding went on past it, and
 * the producer reported EOS in its place), a seeded sample (D went on from the seed's first draw,
 * which P had spent on the first token), both at once; a stop token counts in the usage as vLLM
 * counts it. */
Test(pd, the_proxys_path_answers_as_one_instance)
{
    start(&P, PD_ROLE_PRODUCER, 0);
    start(&D, PD_ROLE_CONSUMER, 0);
    start(&C, PD_ROLE_BOTH, 0);
    char out[8192], fields[160];
    colocated("Hi there", 1, out, sizeof out);
    json_t *j = parse(out);
    json_int_t first = json_integer_value(json_array_get(
        json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids"), 0));
    json_decref(j);
    snprintf(fields, sizeof fields, "\"temperature\":0,\"stop_token_ids\":[%lld]", (long long)first);
    pd_same_answer("Hi there", fields, 3);
    char body[256];
    snprintf(body, sizeof body, "{\"prompt\":\"Hi there\",%s,\"max_tokens\":3}", fields);
    json_t *a = answer_of(C.port, body);
    cr_assert_str_eq(json_string_value(json_object_get(a, "finish_reason")), "stop");
    cr_assert_str_eq(json_string_value(json_object_get(a, "text")), "");
    cr_assert_eq(json_integer_value(json_object_get(a, "completion_tokens")), 1, "the stop token counts");
    json_decref(a);
    for (int seed = 1; seed <= 4; seed++) {
        snprintf(fields, sizeof fields, "\"temperature\":1,\"seed\":%d", seed);
        pd_same_answer("Hi", fields, 8);
    }
    /* a seeded first token that stops */
    snprintf(body, sizeof body, "{\"prompt\":\"Hi\",\"temperature\":1,\"seed\":3,\"max_tokens\":1,\"return_token_ids\":true}");
    a = answer_of(C.port, body);
    first = json_integer_value(json_array_get(json_object_get(a, "ids"), 0));
    json_decref(a);
    snprintf(fields, sizeof fields, "\"temperature\":1,\"seed\":3,\"stop_token_ids\":[%lld]", (long long)first);
    pd_same_answer("Hi", fields, 8);
}

Test(pd, failed_transfer_recomputes_from_token_ids)
{
    start(&P, PD_ROLE_PRODUCER, 500);
    start(&D, PD_ROLE_CONSUMER, 0);
    start(&C, PD_ROLE_BOTH, 0);
    char a[8192], b[8192];
    const char *prompt = "Once upon a time, in a small town by the sea, there lived an old clockmaker";
    pd_request(prompt, 20, 1, a, sizeof a);
    colocated(prompt, 20, b, sizeof b);
    char *x = ids_of(a), *y = ids_of(b);
    cr_assert_str_eq(x, y, "after a failed transfer: %s vs %s", x, y);
    free(x);
    free(y);
    cr_assert_eq(metric(D.port, "pdmoe_kv_recomputes_total"), 1);
    cr_assert_eq(metric(D.port, "pdmoe_errors_total{kind=\"kv_transfer\"}"), 1);
    /* nobody pulled the producer's KV: its lease expires (500 ms) and the blocks come back */
    for (int i = 0; i < 200 && metric(P.port, "pdmoe_kv_leases") > 0; i++)
        usleep(20000);
    cr_assert_eq(metric(P.port, "pdmoe_kv_leases"), 0);
    cr_assert_eq(metric(P.port, "pdmoe_kv_blocks_free"), metric(P.port, "pdmoe_kv_blocks_capacity"));
}

/* fp8 KV on both sides: the hand-off moves the quantized entries as they are, so decode gives
 * what one fp8 process gives */
Test(pd, fp8_same_tokens_as_colocated_fp8)
{
    start_kv(&P, PD_ROLE_PRODUCER, 0, PD_KV_FP8);
    start_kv(&D, PD_ROLE_CONSUMER, 0, PD_KV_FP8);
    start_kv(&C, PD_ROLE_BOTH, 0, PD_KV_FP8);
    const char *prompts[] = {"The sea froze over and the children skated until the sun went down",
                             "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25"};
    pd_equals_colocated(prompts, 2);
    cr_assert_eq(metric(D.port, "pdmoe_kv_transfers_total"), 2);
    cr_assert_eq(metric(D.port, "pdmoe_kv_recomputes_total"), 0);
}

/* A bf16 producer and an fp8 consumer: the pull fails naming both dtypes (nothing is copied),
 * and the consumer recomputes the prompt in its own dtype as after any failed pull */
Test(pd, a_kv_dtype_mismatch_is_refused_by_name)
{
    start_kv(&P, PD_ROLE_PRODUCER, 0, PD_KV_BF16);
    start_kv(&D, PD_ROLE_CONSUMER, 0, PD_KV_FP8);
    logged[0] = 0;
    char a[8192];
    pd_request("Hello there, general", 4, 0, a, sizeof a);
    cr_assert_eq(metric(D.port, "pdmoe_kv_recomputes_total"), 1);
    cr_assert_eq(metric(D.port, "pdmoe_errors_total{kind=\"kv_transfer\"}"), 1);
    cr_assert(strstr(logged, "KV cache dtype mismatch: the producer stores bf16, this instance fp8"), "logged: %s",
              logged);
    /* the consumer told the producer, which freed the blocks */
    for (int i = 0; i < 200 && metric(P.port, "pdmoe_kv_leases") > 0; i++)
        usleep(20000);
    cr_assert_eq(metric(P.port, "pdmoe_kv_leases"), 0);
}

static int prompt_tokens(const char *prompt)
{
    char body[1024], out[4096];
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":1}", prompt);
    cr_assert_eq(curl_port(C.port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out);
    int n = (int)json_integer_value(json_object_get(json_object_get(j, "usage"), "prompt_tokens"));
    json_decref(j);
    return n;
}

/* D's answer (status, body in out) to `prompt` with the transfer parameters kv, `stream` or not. */
/* prompt prefilled on P for a decode instance: the kv_transfer_params P answers (the caller's). */
static json_t *prefill_kv(const char *prompt)
{
    char body[1024], out[8192];
    snprintf(body, sizeof body,
             "{\"prompt\":\"%s\",\"max_tokens\":1,\"temperature\":0,\"kv_transfer_params\":{\"do_remote_decode\":true}}",
             prompt);
    cr_assert_eq(curl_port(P.port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out);
    json_t *kv = json_incref(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "kv_transfer_params"));
    json_decref(j);
    return kv;
}

/* A lease no decode instance pulls expires after kv_lease_ms: its blocks come back and it is
 * counted (a prefill thrown away was counted nowhere). */
Test(pd, an_unpulled_lease_expires_and_is_counted)
{
    start(&P, PD_ROLE_PRODUCER, 300);
    json_decref(prefill_kv("nobody pulls this one"));
    cr_assert_eq(metric(P.port, "pdmoe_kv_leases"), 1);
    for (int i = 0; i < 200 && metric(P.port, "pdmoe_kv_leases") > 0; i++)
        usleep(20000);
    cr_assert_eq(metric(P.port, "pdmoe_kv_leases"), 0);
    cr_assert_eq(metric(P.port, "pdmoe_kv_leases_expired_total"), 1);
    cr_assert_eq(metric(P.port, "pdmoe_kv_blocks_free"), metric(P.port, "pdmoe_kv_blocks_capacity"));
}

static int decode_with(const char *prompt, json_t *kv, int stream, char *out, size_t cap)
{
    char body[2048];
    char *kvs = json_dumps(kv, JSON_COMPACT);
    snprintf(body, sizeof body,
             "{\"prompt\":\"%s\",\"max_tokens\":12,\"temperature\":0,%s\"kv_transfer_params\":%s}",
             prompt, stream ? "\"stream\":true," : "\"return_token_ids\":true,", kvs);
    free(kvs);
    return curl_port(D.port, "/v1/completions", body, NULL, out, cap);
}

/* The attack of issue 12: another client sends D the victim's transfer parameters (or guesses
 * them: request ids were sequential) with a prompt of the same length, to be handed the victim's
 * KV. It gets a 4xx, streaming or not, nobody's KV moves, and the victim's own decode still pulls
 * its KV and gives the colocated tokens. */
Test(pd, another_clients_transfer_params_are_refused)
{
    start(&P, PD_ROLE_PRODUCER, 0);
    start(&D, PD_ROLE_CONSUMER, 0);
    start(&C, PD_ROLE_BOTH, 0);
    const char *victim = "one two three four five six seven eight", *thief = NULL;
    const char *others[] = {"eight seven six five four three two one", "one two three four five six seven nine",
                            "one two three four five six seven eighs", "two one three four five six seven eight",
                            "one two three four five six seven eigh", "one two three four five six sevens eight",
                            "one two three four five six seven eightt", "one two three four five six seven eigth"};
    int n_victim = prompt_tokens(victim);
    for (size_t i = 0; i < sizeof others / sizeof *others && !thief; i++)
        if (prompt_tokens(others[i]) == n_victim)
            thief = others[i];
    cr_assert(thief, "the test needs another prompt of %d tokens", n_victim);
    char body[1024], out[8192], want[8192];
    json_t *kv = prefill_kv(victim);
    json_t *rid = json_object_get(kv, "remote_request_id");

    /* the victim's parameters, verbatim, with the thief's prompt */
    for (int stream = 0; stream < 2; stream++) {
        int code = decode_with(thief, kv, stream, out, sizeof out);
        cr_assert(code >= 400 && code < 500, "stream %d: %d %s", stream, code, out);
        cr_assert(strstr(out, "kv_transfer_params"), "%s", out);
    }
    /* a guessed id: the next one of a sequence, or one digit off a random one */
    json_t *guess = json_deep_copy(kv);
    if (json_is_integer(rid)) {
        json_object_set_new(guess, "remote_request_id", json_integer(json_integer_value(rid)));
    } else {
        char g[64];
        snprintf(g, sizeof g, "%s", json_string_value(rid));
        g[0] = g[0] == '0' ? '1' : '0';
        json_object_set_new(guess, "remote_request_id", json_string(g));
    }
    int code = decode_with(victim, guess, 0, out, sizeof out);
    cr_assert(code >= 400 && code < 500, "guessed id: %d %s", code, out);
    json_decref(guess);
    cr_assert_eq(metric(D.port, "pdmoe_kv_transfer_bytes_total"), 0, "a refused pull moved bytes");
    cr_assert_eq(metric(P.port, "pdmoe_kv_leases"), 1, "the lease must stay with its owner");

    /* the victim decodes from its own KV: the colocated tokens */
    cr_assert_eq(decode_with(victim, kv, 0, out, sizeof out), 200, "%s", out);
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":12,\"temperature\":0,\"return_token_ids\":true}",
             victim);
    cr_assert_eq(curl_port(C.port, "/v1/completions", body, NULL, want, sizeof want), 200, "%s", want);
    char *x = ids_of(out), *y = ids_of(want);
    cr_assert_str_eq(x, y, "victim after the attack: %s, colocated %s", x, y);
    free(x);
    free(y);
    cr_assert_gt(metric(D.port, "pdmoe_kv_transfer_bytes_total"), 0);
    cr_assert_eq(metric(D.port, "pdmoe_kv_recomputes_total"), 0);
    /* pulled once: the id is dead now */
    code = decode_with(victim, kv, 0, out, sizeof out);
    cr_assert(code >= 400 && code < 500, "second pull: %d %s", code, out);
    json_decref(kv);
    for (int i = 0; i < 100 && metric(D.port, "pdmoe_kv_blocks_free") != metric(D.port, "pdmoe_kv_blocks_capacity"); i++)
        usleep(20000);
    cr_assert_eq(metric(D.port, "pdmoe_kv_blocks_free"), metric(D.port, "pdmoe_kv_blocks_capacity"));
}

/* Item 7 of issue 12: a producer and a consumer bound to 127.0.0.1 listen there only: HTTP, the
 * KV listener and UCX's own transport listeners (which opened one on every interface). */
Test(pd, every_listener_is_on_the_configured_address)
{
    start(&P, PD_ROLE_PRODUCER, 0);
    start(&D, PD_ROLE_CONSUMER, 0);
    char out[8192];
    pd_request("Hello", 4, 0, out, sizeof out);   /* the consumer's UCX is up and connected */
    char list[4096], want[64];
    int elsewhere;
    int n = sock_listening(getpid(), "127.0.0.1", list, sizeof list, &elsewhere);
    cr_assert_eq(elsewhere, 0, "listening elsewhere than 127.0.0.1:\n%s", list);
    int ports[] = {P.port, D.port};
    for (int i = 0; i < 2; i++) {
        snprintf(want, sizeof want, "tcp 127.0.0.1:%d\n", ports[i]);
        cr_assert(strstr(list, want), "no HTTP listener on port %d:\n%s", ports[i], list);
    }
    cr_assert_geq(n, 3, "HTTP twice and the KV listener at least:\n%s", list);
}

Test(pd, misdirected_requests)
{
    start(&P, PD_ROLE_PRODUCER, 0);
    start(&D, PD_ROLE_CONSUMER, 0);
    char out[4096];
    cr_assert_eq(curl_port(D.port, "/v1/completions", "{\"prompt\":\"x\",\"kv_transfer_params\":{\"do_remote_decode\":true}}",
                           NULL, out, sizeof out), 400, "%s", out);
    cr_assert(strstr(out, "kv_producer"), "%s", out);
    cr_assert_eq(curl_port(P.port, "/v1/completions",
                           "{\"prompt\":\"x\",\"kv_transfer_params\":{\"do_remote_prefill\":true,\"remote_host\":\"127.0.0.1\"}}",
                           NULL, out, sizeof out), 400, "%s", out);
    cr_assert_eq(curl_port(D.port, "/v1/completions",
                           "{\"prompt\":\"x\",\"kv_transfer_params\":{\"do_remote_prefill\":true,\"remote_host\":\"127.0.0.1\"}}",
                           NULL, out, sizeof out), 400, "%s", out);
    cr_assert(strstr(out, "remote_port"), "%s", out);
    /* the old form of the id, a small integer anyone could guess, is refused by name */
    cr_assert_eq(curl_port(D.port, "/v1/completions",
                           "{\"prompt\":\"x\",\"kv_transfer_params\":{\"do_remote_prefill\":true,\"remote_host\":\"127.0.0.1\","
                           "\"remote_port\":9,\"remote_request_id\":3,\"remote_num_tokens\":2,\"last_token_id\":1}}",
                           NULL, out, sizeof out), 400, "%s", out);
    cr_assert(strstr(out, "remote_request_id must be the 32-hex-digit string"), "%s", out);
    cr_assert_eq(curl_port(D.port, "/v1/completions", "{\"prompt\":\"x\",\"kv_transfer_params\":7}", NULL, out, sizeof out),
                 400, "%s", out);
}

/* The prefill side reuses its prefix cache: the same prompt twice through P and D gives C's ids
 * both times, P counts the second's cached tokens (D pulls the whole KV and caches nothing), and
 * once D's DONE ends the leases P's blocks are free or held by its cache alone. */
Test(pd, the_prefill_side_reuses_its_prefix_cache)
{
    pd_err e = {0};
    struct pd_server_opts o = {.model_dir = dir, .port = 0, .threads = 1, .max_num_seqs = 8, .max_model_len = 512,
                               .served_name = "tiny", .role = PD_ROLE_PRODUCER, .engine_id = "t",
                               .kv_timeout_ms = 3000, .prefix_cache_unit = 64, .http = {.log = log_line}};
    cr_assert_eq(pd_server_create(&o, &P.s, &e), 0, "%s", e.msg);
    P.port = pd_server_port(P.s);
    pthread_create(&P.loop, NULL, run_loop, &P);
    start(&D, PD_ROLE_CONSUMER, 0);
    start(&C, PD_ROLE_BOTH, 0);
    char prompt[1024], *w = prompt;
    for (int i = 0; i < 60; i++)
        w += sprintf(w, "%sw%d", i ? " " : "", (i * 7 + 3) % 997);
    const char *prompts[] = {prompt, prompt};
    pd_equals_colocated(prompts, 2);
    int n = metric(P.port, "pdmoe_prefix_cache_queries_total") / 2;
    cr_assert_gt(n, 128, "the prompt is %d tokens", n);
    cr_assert_eq(metric(P.port, "pdmoe_prefix_cache_hits_total"), (n - 1) / 64 * 64);
    cr_assert_eq(metric(D.port, "pdmoe_prefix_cache_queries_total"), 0);
    cr_assert_eq(metric(D.port, "pdmoe_kv_recomputes_total"), 0);
    for (int i = 0; i < 100 && metric(P.port, "pdmoe_kv_leases") > 0; i++)
        usleep(20000);
    cr_assert_eq(metric(P.port, "pdmoe_kv_leases"), 0);
    cr_assert_gt(metric(P.port, "pdmoe_prefix_cache_blocks"), 0);
    cr_assert_eq(metric(P.port, "pdmoe_kv_blocks_free") + metric(P.port, "pdmoe_prefix_cache_blocks"),
                 metric(P.port, "pdmoe_kv_blocks_capacity"));
    cr_assert_eq(metric(D.port, "pdmoe_kv_blocks_free"), metric(D.port, "pdmoe_kv_blocks_capacity"));
}

/* A decode instance whose weights are not the prefill instance's (a rolling upgrade half done,
 * another seed under the same served name) refuses the hand-off by name, rather than decoding the
 * other weights' KV into text of neither model; the same weights pass (the fingerprint travels in
 * the prefill's kv_transfer_params). */
Test(pd, a_hand_off_between_other_weights_is_refused)
{
    char other[64], keep[64];
    tmp_model("v4-tiny", 10, other, sizeof other);
    start(&P, PD_ROLE_PRODUCER, 0);
    snprintf(keep, sizeof keep, "%s", dir);
    snprintf(dir, sizeof dir, "%s", other);
    start(&D, PD_ROLE_CONSUMER, 0);
    snprintf(dir, sizeof dir, "%s", keep);
    const char *prompt = "one two three four";
    char out[8192];
    json_t *kv = prefill_kv(prompt);
    cr_assert(json_is_string(json_object_get(kv, "model_fingerprint")), "no fingerprint in the hand-off");
    int code = decode_with(prompt, kv, 0, out, sizeof out);
    cr_assert_eq(code, 400, "%d %s", code, out);
    cr_assert(strstr(out, "other weights") && strstr(out, "kv_transfer_params"), "%s", out);
    cr_assert_eq(metric(D.port, "pdmoe_kv_transfer_bytes_total"), 0, "the other weights' KV moved");
    json_decref(kv);
    node_stop(&D);
    rm_model(other);
}

/* A prefill instance restarted on the same KV port: the decode instance's next pull gets the KV
 * (it once failed on the connection it had kept to the dead process, "Endpoint timeout", and
 * recomputed the prompt after every restart). */
Test(pd, a_pull_after_the_prefill_restarts_gets_the_kv)
{
    kv_port = free_port();
    start(&P, PD_ROLE_PRODUCER, 0);
    start(&D, PD_ROLE_CONSUMER, 0);
    char out[8192];
    pd_request("one two three four", 4, 0, out, sizeof out);
    cr_assert_eq(metric(D.port, "pdmoe_kv_transfers_total"), 1);
    node_stop(&P);
    start(&P, PD_ROLE_PRODUCER, 0);
    pd_request("five six seven eight", 4, 0, out, sizeof out);
    cr_assert_eq(metric(D.port, "pdmoe_kv_recomputes_total"), 0, "the pull after the restart failed: %s", logged);
    cr_assert_eq(metric(D.port, "pdmoe_kv_transfers_total"), 2);
    kv_port = 0;
}

/* A decode request refused (max_tokens past its context) or cancelled before it pulls leaves its
 * prefill's lease unclaimed, holding a sequence and its blocks until the lease expires: sixteen such
 * requests held a 16-sequence prefill for the whole lease (30 s), every request behind them
 * waiting. Now a waiting request takes back the oldest lease left unclaimed for a second; its pull,
 * if one still comes, is refused as expired (the proxy prefills again), while the other leases
 * still hand their KV over. */
Test(pd, unclaimed_leases_yield_to_a_waiting_request, .timeout = 120)
{
    start(&P, PD_ROLE_PRODUCER, 30000);   /* 8 sequences */
    start(&D, PD_ROLE_CONSUMER, 0);
    char prompt[64], out[8192];
    json_t *kv[8];
    /* the oldest lease begins after this instant: the ninth answer cannot come within a second
     * of it (measured from the ninth request instead, it once failed under sanitizers, the eight
     * prefills having taken half a second of the oldest lease's second) */
    double t_first = pd_now_s();
    for (int i = 0; i < 8; i++) {
        snprintf(prompt, sizeof prompt, "lease number %d of eight", i);
        kv[i] = prefill_kv(prompt);
    }
    cr_assert_eq(metric(P.port, "pdmoe_kv_leases"), 8);
    cr_assert_eq(metric(P.port, "pdmoe_kv_slots_free"), 0, "the leases hold every sequence");
    double t0 = pd_now_s();
    json_t *ninth = prefill_kv("the ninth request, which waits");
    double t1 = pd_now_s(), waited = t1 - t0;
    cr_assert_lt(waited, 10.0, "the ninth prefill waited %.1f s (the lease is 30 s)", waited);
    cr_assert_geq(t1 - t_first, 1.0, "answered %.2f s after the oldest lease began: it went before its second",
                  t1 - t_first);
    cr_assert_eq(metric(P.port, "pdmoe_kv_leases_revoked_total"), 1);
    /* given up, not expired: it was counted in both (an expiry is a hand-off lost) */
    cr_assert_eq(metric(P.port, "pdmoe_kv_leases_expired_total"), 0);
    /* the oldest lease is gone: its decode is refused it, as for an expired one */
    snprintf(prompt, sizeof prompt, "lease number %d of eight", 0);
    cr_assert_eq(decode_with(prompt, kv[0], 0, out, sizeof out), 403, "%s", out);
    cr_assert_eq(metric(D.port, "pdmoe_requests_failed_total"), 1, "the refused pull is counted nowhere");
    /* a later one still hands its KV over: the same tokens as colocated */
    snprintf(prompt, sizeof prompt, "lease number %d of eight", 7);
    cr_assert_eq(decode_with(prompt, kv[7], 0, out, sizeof out), 200, "%s", out);
    cr_assert_eq(metric(D.port, "pdmoe_kv_recomputes_total"), 0, "the pull of lease 7 failed");
    for (int i = 0; i < 8; i++)
        json_decref(kv[i]);
    json_decref(ninth);
}

/* A decode instance told its producers (kv_transfer_config kv_producers) pulls from them and from
 * no address a request names: a client reaching it directly once made it connect anywhere (and a
 * listener answering garbage aborted it inside UCX). Numbers past their ranges and a fingerprint
 * that is not a string are refused, not cast or skipped; and the host a request names reaches
 * /metrics escaped, never as forged samples. */
Test(pd, a_decode_instance_pulls_only_from_its_producers_and_checks_the_rest)
{
    kv_port = free_port();
    start(&P, PD_ROLE_PRODUCER, 0);
    snprintf(producer_only.host, sizeof producer_only.host, "127.0.0.1");
    producer_only.port_lo = producer_only.port_hi = kv_port;
    start(&D, PD_ROLE_CONSUMER, 0);
    memset(&producer_only, 0, sizeof producer_only);
    char out[8192];
    const char *prompt = "one two three four";
    json_t *kv = prefill_kv(prompt);
    cr_assert_eq(json_integer_value(json_object_get(kv, "remote_port")), kv_port);
    json_t *forged = json_deep_copy(kv);
    json_object_set_new(forged, "remote_port", json_integer(kv_port + 1));
    cr_assert_eq(decode_with(prompt, forged, 0, out, sizeof out), 403, "%s", out);
    cr_assert(strstr(out, "kv_producers"), "%s", out);
    json_object_set_new(forged, "remote_port", json_integer(kv_port));
    json_object_set_new(forged, "remote_host", json_string("localhost"));
    cr_assert_eq(decode_with(prompt, forged, 0, out, sizeof out), 403, "%s", out);
    json_decref(forged);
    cr_assert_eq(metric(D.port, "pdmoe_kv_recomputes_total"), 0, "a refused request was computed");
    cr_assert_eq(decode_with(prompt, kv, 0, out, sizeof out), 200, "%s", out);   /* its own producer */
    cr_assert_eq(metric(D.port, "pdmoe_kv_transfers_total"), 1);
    /* past their ranges, or of the wrong type */
    const char *bad[][2] = {{"remote_port", "4294990398"}, {"remote_num_tokens", "4294967302"},
                            {"remote_port", "0"}, {"model_fingerprint", "5"}, {"remote_host", "\"\""},
                            {"last_token_id", "-1"}, {"remote_num_tokens", "\"5\""}};
    for (int i = 0; i < 7; i++) {
        json_t *b = json_deep_copy(kv);
        json_object_set_new(b, bad[i][0], json_loads(bad[i][1], JSON_DECODE_ANY, NULL));
        cr_assert_eq(decode_with(prompt, b, 0, out, sizeof out), 400, "%s %s: %s", bad[i][0], bad[i][1], out);
        /* the field at fault named (one message named them all; an empty host was taken) */
        char want[64];
        snprintf(want, sizeof want, "kv_transfer_params.%s", bad[i][0]);
        cr_assert(strstr(out, want), "%s %s: %s", bad[i][0], bad[i][1], out);
        json_decref(b);
    }
    json_decref(kv);
    node_stop(&D);
    /* without kv_producers: a host that would forge /metrics lines is escaped in its label */
    start(&D, PD_ROLE_CONSUMER, 0);
    kv = prefill_kv(prompt);
    json_object_set_new(kv, "remote_host", json_string("x\"} 1\npdmoe_forged 1\npdmoe_kv_peer_x{a=\""));
    json_object_set_new(kv, "remote_port", json_integer(1));
    cr_assert_eq(decode_with(prompt, kv, 0, out, sizeof out), 200, "%s", out);   /* recomputed */
    json_decref(kv);
    static char m[1 << 17];
    cr_assert_eq(curl_port(D.port, "/metrics", NULL, NULL, m, sizeof m), 200);
    cr_assert(strstr(m, "pdmoe_kv_peer_transfers_total{peer=\"x\\\"} 1\\npdmoe_forged"), "%s", strstr(m, "kv_peer"));
    prom_conventions(m, "the decode's /metrics after a forged host");
    kv_port = 0;
}

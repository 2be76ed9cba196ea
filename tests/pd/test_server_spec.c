/* The server with --speculative-config: concurrent greedy requests (verify items of k+1 tokens
 * batched) answer the ids a plain server does, /metrics counts drafts and accepted tokens per
 * position, and every block comes back. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/genmodel.h"
#include "../tmpmodel.h"
#include "pd/server.h"
#include "util.h"

static char dir[64];

static void setup(void)
{
    tmp_model_agree("v4-tiny", 4, 0.7, dir, sizeof dir);
}

static void teardown(void)
{
    rm_model(dir);
}

TestSuite(server_spec, .init = setup, .fini = teardown, .timeout = 120);

struct srv {
    struct pd_server *s;
    pthread_t loop;
    int port;
};

static void start(struct srv *x, int k)
{
    pd_err e = {0};
    struct pd_server_opts o = {.model_dir = dir, .threads = 1, .max_num_seqs = 8, .max_model_len = 512,
                               .served_name = "tiny", .spec_k = k};
    cr_assert_eq(pd_server_create(&o, &x->s, &e), 0, "%s", e.msg);
    x->port = pd_server_port(x->s);
    pthread_create(&x->loop, NULL, run_server, x->s);
}

static void stop(struct srv *x)
{
    pd_server_stop(x->s);
    pthread_join(x->loop, NULL);
    pd_server_destroy(x->s);
}

struct call {
    int port, i, code;
    char out[1 << 14];
};

static void body(int i, char *b, size_t n)
{
    snprintf(b, n, "{\"model\":\"tiny\",\"prompt\":\"request %d: the sea %s\",\"max_tokens\":%d,\"temperature\":0,"
             "\"return_token_ids\":true,\"ignore_eos\":true}", i, i % 2 ? "froze" : "was calm", 30 + 3 * i);
}

static void *one(void *arg)
{
    struct call *c = arg;
    char b[512];
    body(c->i, b, sizeof b);
    c->code = curl_port(c->port, "/v1/completions", b, NULL, c->out, sizeof c->out);
    return NULL;
}

static json_t *ids_of(const char *out)
{
    json_t *j = parse(out);
    json_t *ids = json_incref(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids"));
    json_decref(j);
    return ids;
}

Test(server_spec, concurrent_greedy_requests_equal_a_plain_servers)
{
    enum { N = 6 };
    static struct call plain[N], spec[N];
    struct srv a, b;
    start(&a, 0);
    for (int i = 0; i < N; i++) {
        plain[i] = (struct call){.port = a.port, .i = i};
        one(&plain[i]);
        cr_assert_eq(plain[i].code, 200, "%s", plain[i].out);
    }
    stop(&a);
    start(&b, 3);
    pthread_t t[N];
    for (int i = 0; i < N; i++) {
        spec[i] = (struct call){.port = b.port, .i = i};
        pthread_create(&t[i], NULL, one, &spec[i]);
    }
    for (int i = 0; i < N; i++)
        pthread_join(t[i], NULL);
    for (int i = 0; i < N; i++) {
        cr_assert_eq(spec[i].code, 200, "%s", spec[i].out);
        json_t *x = ids_of(plain[i].out), *y = ids_of(spec[i].out);
        cr_assert_eq(json_array_size(y), (size_t)(30 + 3 * i));
        cr_assert(json_equal(x, y), "request %d: speculative ids differ from plain ones", i);
        json_decref(x);
        json_decref(y);
    }
    int drafts = metric_port(b.port, "pdmoe_spec_decode_num_drafts_total");
    int accepted = metric_port(b.port, "pdmoe_spec_decode_num_accepted_tokens_total");
    cr_assert_gt(drafts, 0);
    cr_assert_gt(accepted, drafts / 2, "%d accepted of %d drafts at agreement 0.7", accepted, drafts);
    cr_assert_eq(metric_port(b.port, "pdmoe_spec_decode_num_draft_tokens_total") >= drafts, 1);
    int per_pos = 0;
    char name[128];
    for (int j = 0; j < 3; j++) {
        snprintf(name, sizeof name, "pdmoe_spec_decode_num_accepted_tokens_per_pos_total{position=\"%d\"}", j);
        per_pos += metric_port(b.port, name);
    }
    cr_assert_eq(per_pos, accepted);
    cr_assert_eq(metric_port(b.port, "pdmoe_kv_blocks_free"), metric_port(b.port, "pdmoe_kv_blocks_capacity"));
    cr_assert_eq(metric_port(b.port, "pdmoe_generation_tokens_total"), N * 30 + 3 * (N * (N - 1) / 2));
    stop(&b);
}

Test(server_spec, sampling_with_speculation_completes_and_frees_every_block)
{
    struct srv a;
    start(&a, 2);
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "seq 8 | xargs -P 8 -I{} curl -s -N -o /dev/null -w '%%{http_code}\\n' http://127.0.0.1:%d/v1/completions "
             "-d '{\"prompt\":\"request {} says hello\",\"max_tokens\":24,\"stream\":true,\"temperature\":0.8,\"seed\":{}}'",
             a.port);
    cr_assert_eq(count_200(cmd), 8);
    cr_assert_eq(metric_port(a.port, "pdmoe_requests_completed_total"), 8);
    cr_assert_eq(metric_port(a.port, "pdmoe_kv_blocks_free"), metric_port(a.port, "pdmoe_kv_blocks_capacity"));
    cr_assert_eq(metric_port(a.port, "pdmoe_kv_slots_free"), 8);
    stop(&a);
}

/* (PD roles with speculation in one process: tests/pd/test_pd_spec.c; in EP groups:
 * tests/pd/test_ep_spec_pd.c) */

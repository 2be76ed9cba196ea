/* Prefix caching through the server (on by default): the same long prompt twice gives the same
 * greedy completion as a server without the cache, the second request's cached tokens are
 * counted (pdmoe_prefix_cache_queries/hits_total, in tokens, as vLLM's), its TTFT is measured
 * (not asserted: the machine is shared); a pool too small for a request and the cache's blocks
 * together evicts the cache instead of refusing the request; every block is back or cached. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/timing.h"
#include "engine/kvpool.h"
#include "model/config.h"
#include "../tmpmodel.h"
#include "pd/server.h"
#include "util.h"

static char dir[64];
static struct pd_server *srv;
static pthread_t loop;
static int port;

static void start(int prefix_caching, int max_seqs, int64_t kv_bytes)
{
    pd_err e = {0};
    struct pd_server_opts o = {.model_dir = dir, .port = 0, .threads = 1, .max_num_seqs = max_seqs,
                               .max_model_len = 2048, .max_num_batched_tokens = 2048, .served_name = "tiny",
                               .prefix_caching = prefix_caching, .prefix_cache_unit = 64, .kv_cache_bytes = kv_bytes};
    cr_assert_eq(pd_server_create(&o, &srv, &e), 0, "%s", e.msg);
    port = pd_server_port(srv);
    pthread_create(&loop, NULL, run_server, srv);
}

static void stop(void)
{
    if (srv) {
        pd_server_stop(srv);
        pthread_join(loop, NULL);
        pd_server_destroy(srv);
        srv = NULL;
    }
}

static void setup(void)
{
    tmp_model("v4-tiny", 5, dir, sizeof dir);
}

static void teardown(void)
{
    stop();
    rm_model(dir);
}

TestSuite(server_prefix, .init = setup, .fini = teardown, .timeout = 300);

/* A greedy completion of `prompt`: its token ids (comma-joined into ids), its prompt length;
 * the seconds it took in *secs. */
static int complete(const char *prompt, int max_tokens, char *ids, size_t cap, double *secs)
{
    char *body = malloc(strlen(prompt) + 256), *out = malloc(1 << 16);
    sprintf(body, "{\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,\"return_token_ids\":true}",
            prompt, max_tokens);
    double t0 = pd_now_s();
    cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, out, 1 << 16), 200, "%s", out);
    if (secs)
        *secs = pd_now_s() - t0;
    json_t *j = parse(out);
    json_t *t = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids");
    cr_assert_eq((int)json_array_size(t), max_tokens);
    size_t n = 0;
    ids[0] = 0;
    for (size_t i = 0; i < json_array_size(t); i++)
        n += (size_t)snprintf(ids + n, cap - n, "%s%lld", i ? "," : "", (long long)json_integer_value(json_array_get(t, i)));
    int np = (int)json_integer_value(json_object_get(json_object_get(j, "usage"), "prompt_tokens"));
    json_decref(j);
    free(body);
    free(out);
    return np;
}

Test(server_prefix, the_same_prompt_twice_hits_and_completes_the_same)
{
    char *p = long_prompt(150, 1);
    char uncached[4096], first[4096], second[4096];
    double t_miss, t_hit;
    /* the reference: no cache */
    start(-1, 4, 0);
    int n = complete(p, 8, uncached, sizeof uncached, NULL);
    cr_assert_gt(n, 300, "the prompt is %d tokens", n);
    cr_assert_lt(n, 15 * 64, "the prompt is %d tokens: more boundaries than the snapshot budget holds", n);
    cr_assert_eq(metric_port(port, "pdmoe_prefix_cache_queries_total"), 0, "off means no lookups");
    stop();
    /* on, by default */
    start(0, 4, 0);
    cr_assert_eq(complete(p, 8, first, sizeof first, &t_miss), n);
    cr_assert_eq(metric_port(port, "pdmoe_prefix_cache_queries_total"), n);
    cr_assert_eq(metric_port(port, "pdmoe_prefix_cache_hits_total"), 0);
    cr_assert_eq(complete(p, 8, second, sizeof second, &t_hit), n);
    cr_assert_str_eq(first, uncached, "a cold cache changes the completion");
    cr_assert_str_eq(second, uncached, "a cached prefix changes the completion");
    /* every 64-token boundary below the last token is reused */
    int hit = (n - 1) / 64 * 64;
    cr_assert_eq(metric_port(port, "pdmoe_prefix_cache_queries_total"), 2 * n);
    cr_assert_eq(metric_port(port, "pdmoe_prefix_cache_hits_total"), hit, "%d hits of %d tokens, want %d",
                 metric_port(port, "pdmoe_prefix_cache_hits_total"), n, hit);
    cr_log_info("prompt %d tokens, %d cached: first request %.1f ms, second %.1f ms (ratio %.2f; shared machine)", n,
                hit, t_miss * 1e3, t_hit * 1e3, t_hit / t_miss);
    /* idle: every block is free or held by the cache alone */
    cr_assert_gt(metric_port(port, "pdmoe_prefix_cache_blocks"), 0);
    cr_assert_eq(metric_port(port, "pdmoe_kv_blocks_free") + metric_port(port, "pdmoe_prefix_cache_blocks"),
                 metric_port(port, "pdmoe_kv_blocks_capacity"));
    free(p);
}

/* A pool that holds one request: the second prompt (another one) fits only once the first's
 * cached blocks are evicted; it must be served, not kept waiting. */
Test(server_prefix, a_request_that_fits_evicts_the_cache_first)
{
    struct pd_model m;
    pd_err e = {0};
    cr_assert_eq(pd_model_load(dir, &m, &e), 0, "%s", e.msg);
    struct pd_kvpool probe;
    cr_assert_eq(pd_kvpool_init(&probe, &m, PD_KV_BF16, 1, 1 << 24, 16, &e), 0, "%s", e.msg);
    char *a = long_prompt(300, 2), *b = long_prompt(300, 3), ids[4096];
    /* the first request's blocks, a few spare: not enough for the second beside the cache */
    start(0, 1, 0);
    int n = complete(a, 8, ids, sizeof ids, NULL);
    stop();
    int need = pd_kvpool_blocks_for(&probe, n + 8 + 64);
    int64_t bytes = (int64_t)probe.slot_bytes + (int64_t)(need + 2) * (int64_t)probe.block_bytes;
    pd_kvpool_free(&probe);
    start(0, 1, bytes);
    complete(a, 8, ids, sizeof ids, NULL);
    int cached = metric_port(port, "pdmoe_prefix_cache_blocks");
    cr_assert_gt(cached, 2, "the first prompt's blocks are cached");
    cr_assert_lt(metric_port(port, "pdmoe_kv_blocks_free"), need, "the second prompt does not fit beside them");
    complete(b, 8, ids, sizeof ids, NULL);
    cr_assert_gt(metric_port(port, "pdmoe_prefix_cache_evictions_total"), 0);
    cr_assert_eq(metric_port(port, "pdmoe_requests_completed_total"), 2);
    cr_assert_eq(metric_port(port, "pdmoe_kv_blocks_free") + metric_port(port, "pdmoe_prefix_cache_blocks"),
                 metric_port(port, "pdmoe_kv_blocks_capacity"));
    free(a);
    free(b);
}


/* MTP speculative decoding across a PD hand-off (pd/server_spec.c): a prefill and a decode instance
 * that both run --speculative-config give, at temperature 0, the ids a plain colocated server gives,
 * for k = 1..3 and prompts short, ending mid-block and past the window, with the KV pulled (never
 * recomputed) and the drafts counted in the decode instance's /metrics; instances with different
 * speculation settings are refused by name; a failed pull recomputes and continues from the
 * producer's token; every block comes back on both sides; with the prefix cache, colocated and on
 * the prefill side, cached prefixes give the same ids. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/genmodel.h"
#include "../tmpmodel.h"
#include "pd/server.h"
#include "proxy/proxy.h"
#include "util.h"

static char dir[64];

static struct node P, D, C;

static void setup(void)
{
    /* a draft that agrees with the greedy next token about 70% of the time: rounds accept some
     * drafts and reject others */
    tmp_model_agree("v4-tiny", 4, 0.7, dir, sizeof dir);
}

static void teardown(void)
{
    node_stop(&P);
    node_stop(&D);
    node_stop(&C);
    rm_model(dir);
}

TestSuite(pd_spec, .init = setup, .fini = teardown, .timeout = 240);

static int unit;   /* the prefix cache's (0: the server's default, 256 tokens) */

static void start(struct node *n, int role, int k, int lease_ms)
{
    pd_err e = {0};
    struct pd_server_opts o = {.model_dir = dir, .threads = 1, .max_num_seqs = 4, .max_model_len = 512,
                               .served_name = "tiny", .role = role, .engine_id = "t", .kv_lease_ms = lease_ms,
                               .kv_timeout_ms = 3000, .spec_k = k, .prefix_cache_unit = unit,
                               .max_num_batched_tokens = 512};
    cr_assert_eq(pd_server_create(&o, &n->s, &e), 0, "%s", e.msg);
    n->port = pd_server_port(n->s);
    pthread_create(&n->loop, NULL, run_server, n->s);
}

static json_t *choice_of(const char *out)
{
    json_t *j = parse(out);
    json_t *c = json_incref(json_array_get(json_object_get(j, "choices"), 0));
    json_decref(j);
    return c;
}

/* P's transfer parameters for `prompt` (greedy unless temperature > 0). */
static json_t *prefill(const char *prompt, double temperature)
{
    char body[4096], out[8192];
    snprintf(body, sizeof body,
             "{\"prompt\":\"%s\",\"max_tokens\":1,\"temperature\":%g,\"seed\":7,"
             "\"kv_transfer_params\":{\"do_remote_decode\":true}}", prompt, temperature);
    cr_assert_eq(curl_port(P.port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    json_t *c = choice_of(out);
    json_t *kv = json_incref(json_object_get(c, "kv_transfer_params"));
    json_decref(c);
    cr_assert(json_is_true(json_object_get(kv, "do_remote_prefill")), "%s", out);
    return kv;
}

/* D's status for `prompt` with the parameters kv; its answer in out. */
static int decode(const char *prompt, json_t *kv, int max_tokens, double temperature, char *out, size_t cap)
{
    char body[4096];
    char *kvs = json_dumps(kv, JSON_COMPACT);
    snprintf(body, sizeof body,
             "{\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":%g,\"seed\":7,\"ignore_eos\":true,"
             "\"return_token_ids\":true,\"kv_transfer_params\":%s}", prompt, max_tokens, temperature, kvs);
    free(kvs);
    return curl_port(D.port, "/v1/completions", body, NULL, out, cap);
}

static char *ids_of(const char *out)
{
    json_t *c = choice_of(out);
    char *s = json_dumps(json_object_get(c, "token_ids"), JSON_COMPACT);
    json_decref(c);
    return s;
}

static int prompt_tokens(int port, const char *prompt)
{
    char body[4096], out[4096];
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":1}", prompt);
    cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out);
    int n = (int)json_integer_value(json_object_get(json_object_get(j, "usage"), "prompt_tokens"));
    json_decref(j);
    return n;
}

static int blocks_all_free(int port)
{
    return metric_port(port, "pdmoe_kv_blocks_free") == metric_port(port, "pdmoe_kv_blocks_capacity");
}

/* Leases end on the decode side's DONE (or expire): wait until none is left on P. */
static void leases_gone(void)
{
    for (int i = 0; i < 300 && metric_port(P.port, "pdmoe_kv_leases") > 0; i++)
        usleep(20000);
    cr_assert_eq(metric_port(P.port, "pdmoe_kv_leases"), 0);
}

Test(pd_spec, prefill_and_decode_with_mtp_equal_plain_decoding_for_k_1_to_3)
{
    /* v4-tiny: a window of 8, ratio-4 and ratio-16 compressors, 16 entries a block (64 tokens of a
     * ratio-4 layer): a prompt of a few tokens, ones ending mid-block and mid-window, and one past
     * a whole block */
    static const char *prompts[] = {
        "Hi",
        "The quick brown fox jumps over the lazy dog",
        "request 3: the sea froze over the harbour while the gulls kept circling the masts of the boats",
        "Once upon a time, in a kingdom by the sea, there lived a princess who counted the waves every "
        "morning and every evening; the king, her father, kept a ledger of the tides, and the queen kept "
        "the keys of the lighthouse, which nobody had climbed for a hundred years",
    };
    enum { NP = sizeof prompts / sizeof prompts[0], MAXT = 24 };
    start(&C, PD_ROLE_BOTH, 0, 0);
    char want[NP][4096], out[8192];
    int len[NP];
    for (int i = 0; i < NP; i++) {
        char body[4096];
        snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,"
                 "\"return_token_ids\":true}", prompts[i], MAXT);
        cr_assert_eq(curl_port(C.port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
        char *ids = ids_of(out);
        snprintf(want[i], sizeof want[i], "%s", ids);
        free(ids);
        len[i] = prompt_tokens(C.port, prompts[i]);
    }
    node_stop(&C);
    /* the prompts cover what the hand-off must get right */
    cr_assert_leq(len[0], 4);
    cr_assert_gt(len[3], 64 + 8, "%d tokens", len[3]);
    int mid = 0;
    for (int i = 0; i < NP; i++)
        mid += len[i] % 16 != 0 && len[i] > 8;
    cr_assert_geq(mid, 2);
    char name[128];
    for (int k = 1; k <= 3; k++) {
        /* a colocated server speculating with the same k: the draft's counters to match */
        start(&C, PD_ROLE_BOTH, k, 0);
        for (int i = 0; i < NP; i++) {
            char body[4096];
            snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,"
                     "\"return_token_ids\":true}", prompts[i], MAXT);
            cr_assert_eq(curl_port(C.port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
            char *ids = ids_of(out);
            cr_assert_str_eq(ids, want[i]);
            free(ids);
        }
        int c_drafts = metric_port(C.port, "pdmoe_spec_decode_num_drafts_total"), c_pos[3] = {0};
        for (int j = 0; j < k; j++) {
            snprintf(name, sizeof name, "pdmoe_spec_decode_num_accepted_tokens_per_pos_total{position=\"%d\"}", j);
            c_pos[j] = metric_port(C.port, name);
        }
        node_stop(&C);
        start(&P, PD_ROLE_PRODUCER, k, 0);
        start(&D, PD_ROLE_CONSUMER, k, 0);
        for (int i = 0; i < NP; i++) {
            json_t *kv = prefill(prompts[i], 0);
            cr_assert_eq(json_integer_value(json_object_get(kv, "num_speculative_tokens")), k);
            cr_assert_eq(decode(prompts[i], kv, MAXT, 0, out, sizeof out), 200, "%s", out);
            json_decref(kv);
            char *got = ids_of(out);
            cr_assert_str_eq(got, want[i], "k %d, prompt %d (%d tokens): PD with MTP %s, plain %s", k, i, len[i], got,
                             want[i]);
            free(got);
        }
        /* every prompt's KV was pulled, none recomputed; the drafts ran on D */
        cr_assert_eq(metric_port(D.port, "pdmoe_kv_transfers_total"), NP);
        cr_assert_eq(metric_port(D.port, "pdmoe_kv_recomputes_total"), 0);
        int drafts = metric_port(D.port, "pdmoe_spec_decode_num_drafts_total");
        int accepted = metric_port(D.port, "pdmoe_spec_decode_num_accepted_tokens_total");
        cr_assert_gt(drafts, 0);
        cr_assert_gt(accepted, 0, "k %d: no draft accepted of %d", k, drafts);
        int per_pos = 0;
        for (int j = 0; j < k; j++) {
            snprintf(name, sizeof name, "pdmoe_spec_decode_num_accepted_tokens_per_pos_total{position=\"%d\"}", j);
            int n = metric_port(D.port, name);
            /* the draft's state came over whole: it proposes what the colocated draft proposes,
             * so the same drafts are accepted at every position (a wrong hidden state or MTP KV
             * would leave the ids equal, verification being exact, but not these) */
            cr_assert_eq(n, c_pos[j], "k %d, position %d: %d accepted after the hand-off, %d colocated", k, j, n,
                         c_pos[j]);
            per_pos += n;
        }
        cr_assert_eq(per_pos, accepted);
        cr_assert_eq(drafts, c_drafts);
        /* the prefill side drafts nothing: its MTP layer only fills the KV it hands off */
        cr_assert_eq(metric_port(P.port, "pdmoe_spec_decode_num_drafts_total"), 0);
        leases_gone();
        cr_assert(blocks_all_free(P.port));
        cr_assert(blocks_all_free(D.port));
        node_stop(&P);
        node_stop(&D);
    }
}

/* The decode side refuses parameters from a producer that speculates otherwise, naming both. */
Test(pd_spec, different_speculation_settings_are_refused_by_name)
{
    static const struct {
        int p, d;
        const char *a, *b;
    } cases[] = {
        {2, 1, "num_speculative_tokens is 2", "runs num_speculative_tokens 1"},
        {0, 2, "is 0: the prefill instance runs without speculation", "runs num_speculative_tokens 2"},
        {2, 0, "num_speculative_tokens is 2", "runs without speculation"},
    };
    const char *prompt = "The quick brown fox jumps over the lazy dog";
    char out[8192];
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        start(&P, PD_ROLE_PRODUCER, cases[c].p, 300);
        start(&D, PD_ROLE_CONSUMER, cases[c].d, 0);
        json_t *kv = prefill(prompt, 0);
        cr_assert_eq(decode(prompt, kv, 8, 0, out, sizeof out), 400, "case %zu: %s", c, out);
        cr_assert(strstr(out, cases[c].a) && strstr(out, cases[c].b) && strstr(out, "--speculative-config"),
                  "case %zu: %s", c, out);
        if (c == 0) {   /* behind the proxy: a 502 carrying the decode instance's whole message (it was cut
                         * at 150 bytes, before the setting to fix) */
            static char pa[32], da[32];
            snprintf(pa, sizeof pa, "127.0.0.1:%d", P.port);
            snprintf(da, sizeof da, "127.0.0.1:%d", D.port);
            struct pd_proxy_opts po = {.port = 0, .n_prefill = 1, .n_decode = 1};
            po.prefill[0] = pa;
            po.decode[0] = da;
            struct pd_proxy *X;
            pthread_t tx;
            pd_err pe = {0};
            cr_assert_eq(pd_proxy_create(&po, &X, &pe), 0, "%s", pe.msg);
            pthread_create(&tx, NULL, run_proxy, X);
            char body[256], pout[8192];
            snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":4}", prompt);
            cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/completions", body, NULL, pout, sizeof pout), 502, "%s",
                         pout);
            cr_assert(strstr(pout, cases[c].a) && strstr(pout, "must use the same --speculative-config"), "%s", pout);
            proxy_shutdown(&X, tx);
        }
        cr_assert(strstr(out, "\"param\": \"kv_transfer_params\"") || strstr(out, "\"param\":\"kv_transfer_params\""),
                  "case %zu: %s", c, out);
        /* parameters without the field: a producer that does not speculate */
        json_object_del(kv, "num_speculative_tokens");
        int code = decode(prompt, kv, 8, 0, out, sizeof out);
        if (cases[c].d) {
            cr_assert_eq(code, 400, "case %zu: %s", c, out);
            cr_assert(strstr(out, "has no num_speculative_tokens"), "case %zu: %s", c, out);
        }
        json_decref(kv);
        if (cases[c].p == 0) {
            /* parameters altered to match: the pools' layouts differ (no MTP layer, no draft row on
             * the producer), so the pull fails on its byte count and the decode side recomputes */
            kv = prefill(prompt, 0);
            json_object_set_new(kv, "num_speculative_tokens", json_integer(cases[c].d));
            cr_assert_eq(decode(prompt, kv, 8, 0, out, sizeof out), 200, "case %zu: %s", c, out);
            json_decref(kv);
            cr_assert_eq(metric_port(D.port, "pdmoe_kv_recomputes_total"), 1);
            cr_assert_eq(metric_port(D.port, "pdmoe_errors_total{kind=\"kv_transfer\"}"), 1);
        }
        /* nothing pulled the KV: the lease expires and the producer's blocks come back */
        leases_gone();
        cr_assert(blocks_all_free(P.port));
        cr_assert(blocks_all_free(D.port));
        node_stop(&P);
        node_stop(&D);
    }
}

/* A pull that fails (a dead producer port) recomputes the prompt on the decode side, speculation
 * included, and continues from the producer's token, whatever the decode side would sample. */
Test(pd_spec, a_failed_pull_recomputes_and_continues_from_the_producers_token)
{
    start(&P, PD_ROLE_PRODUCER, 2, 300);
    start(&D, PD_ROLE_CONSUMER, 2, 0);
    start(&C, PD_ROLE_BOTH, 0, 0);
    const char *prompt = "The quick brown fox jumps over the lazy dog";
    char out[8192], want[8192];
    json_t *kv = prefill(prompt, 0);
    json_object_set_new(kv, "remote_port", json_integer(1));
    cr_assert_eq(decode(prompt, kv, 16, 0, out, sizeof out), 200, "%s", out);
    char body[1024];
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":16,\"temperature\":0,\"ignore_eos\":true,"
             "\"return_token_ids\":true}", prompt);
    cr_assert_eq(curl_port(C.port, "/v1/completions", body, NULL, want, sizeof want), 200, "%s", want);
    char *a = ids_of(out), *b = ids_of(want);
    cr_assert_str_eq(a, b);
    free(a);
    free(b);
    cr_assert_eq(metric_port(D.port, "pdmoe_kv_recomputes_total"), 1);
    /* sampled: the first token is the producer's (here one it could not have sampled greedily) */
    json_t *kv2 = prefill(prompt, 1.0);
    json_object_set_new(kv2, "remote_port", json_integer(1));
    json_object_set_new(kv2, "last_token_id", json_integer(5));
    cr_assert_eq(decode(prompt, kv2, 6, 1.0, out, sizeof out), 200, "%s", out);
    json_t *c = choice_of(out);
    json_t *ids = json_object_get(c, "token_ids");
    cr_assert_eq(json_array_size(ids), 6, "%s", out);
    cr_assert_eq(json_integer_value(json_array_get(ids, 0)), 5, "%s", out);
    json_decref(c);
    json_decref(kv);
    json_decref(kv2);
    cr_assert_eq(metric_port(D.port, "pdmoe_kv_recomputes_total"), 2);
    leases_gone();
    cr_assert(blocks_all_free(P.port));
    cr_assert(blocks_all_free(D.port));
}

/* The prefix cache with speculation (on by default, as without): requests sharing a long prefix
 * start from the cached boundaries (the MTP layer's state and the draft's input restored there)
 * and give the ids of a plain server without cache or speculation, colocated and on a prefill
 * instance handing off to a decode instance; the drafts run as from a recomputed prompt (their
 * acceptance per position equals that of the same server with the cache off). */
Test(pd_spec, a_cached_prefix_with_speculation_gives_plain_decodings_ids)
{
    unit = 64;
    char shared[2048] = "", prompts[4][2600];
    for (int i = 0; i < 12; i++)
        strcat(shared, "the tide came in over the stones and the gulls rose from the harbour wall; ");
    for (int i = 0; i < 4; i++)
        snprintf(prompts[i], sizeof prompts[i], "%srequest %d asks about %s", shared, i,
                 i % 2 ? "the lighthouse keeper" : "the boats that never came back");
    enum { MAXT = 20 };
    char want[4][4096], out[8192], body[16384];
    start(&C, PD_ROLE_BOTH, 0, 0);
    int n0 = prompt_tokens(C.port, prompts[0]);
    cr_assert_gt(n0, 3 * 64, "%d tokens", n0);
    for (int i = 0; i < 4; i++) {
        snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,"
                 "\"return_token_ids\":true}", prompts[i], MAXT);
        cr_assert_eq(curl_port(C.port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
        char *ids = ids_of(out);
        snprintf(want[i], sizeof want[i], "%s", ids);
        free(ids);
    }
    node_stop(&C);
    /* colocated, cache on, then the same server with the cache off: the drafts' counters */
    int acc[2][3] = {{0}};
    for (int cached = 1; cached >= 0; cached--) {
        pd_err e = {0};
        struct pd_server_opts o = {.model_dir = dir, .threads = 1, .max_num_seqs = 4, .max_model_len = 512,
                                   .served_name = "tiny", .spec_k = 3, .prefix_cache_unit = unit,
                                   .max_num_batched_tokens = 512, .prefix_caching = cached ? 1 : -1};
        cr_assert_eq(pd_server_create(&o, &C.s, &e), 0, "%s", e.msg);
        C.port = pd_server_port(C.s);
        pthread_create(&C.loop, NULL, run_server, C.s);
        for (int i = 0; i < 4; i++) {
            snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,"
                     "\"return_token_ids\":true}", prompts[i], MAXT);
            cr_assert_eq(curl_port(C.port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
            char *ids = ids_of(out);
            cr_assert_str_eq(ids, want[i], "colocated, cache %s, prompt %d", cached ? "on" : "off", i);
            free(ids);
        }
        char name[128];
        for (int j = 0; j < 3; j++) {
            snprintf(name, sizeof name, "pdmoe_spec_decode_num_accepted_tokens_per_pos_total{position=\"%d\"}", j);
            acc[cached][j] = metric_port(C.port, name);
        }
        if (cached) {
            /* every request after the first starts from the shared prefix's boundaries */
            cr_assert_geq(metric_port(C.port, "pdmoe_prefix_cache_hits_total"), 3 * 3 * 64);
            cr_assert_eq(metric_port(C.port, "pdmoe_kv_blocks_free") + metric_port(C.port, "pdmoe_prefix_cache_blocks"),
                         metric_port(C.port, "pdmoe_kv_blocks_capacity"));
        } else {
            cr_assert_eq(metric_port(C.port, "pdmoe_prefix_cache_queries_total"), 0);
        }
        node_stop(&C);
    }
    for (int j = 0; j < 3; j++)
        cr_assert_eq(acc[1][j], acc[0][j], "position %d: %d accepted from cached prefixes, %d recomputed", j,
                     acc[1][j], acc[0][j]);
    /* PD: the prefill instance caches, the decode instance drafts after the hand-off */
    start(&P, PD_ROLE_PRODUCER, 2, 0);
    start(&D, PD_ROLE_CONSUMER, 2, 0);
    for (int i = 0; i < 4; i++) {
        json_t *kv = prefill(prompts[i], 0);
        cr_assert_eq(decode(prompts[i], kv, MAXT, 0, out, sizeof out), 200, "%s", out);
        json_decref(kv);
        char *got = ids_of(out);
        cr_assert_str_eq(got, want[i], "PD, prompt %d", i);
        free(got);
    }
    cr_assert_geq(metric_port(P.port, "pdmoe_prefix_cache_hits_total"), 3 * 3 * 64);
    cr_assert_eq(metric_port(D.port, "pdmoe_kv_recomputes_total"), 0);
    cr_assert_gt(metric_port(D.port, "pdmoe_spec_decode_num_drafts_total"), 0);
    leases_gone();
    cr_assert_eq(metric_port(P.port, "pdmoe_kv_blocks_free") + metric_port(P.port, "pdmoe_prefix_cache_blocks"),
                 metric_port(P.port, "pdmoe_kv_blocks_capacity"));
    cr_assert(blocks_all_free(D.port));
    unit = 0;
}

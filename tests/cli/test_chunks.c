/* A prefill chunk's window and state blocks, as plan, search and the launch scripts count them.
 *
 * vllm-ascend keeps V4's sliding windows and compressor states in block tables that vLLM's
 * SlidingWindowManager trims only on the processed-token basis, after a step: while its two steps
 * (async scheduling) of max-num-batched-tokens are in flight, a prompt holds blocks for all of them.
 * The figures below are computed here from vLLM's own per-request bound for such a table,
 * SlidingWindowSpec.max_admission_blocks_per_request, cdiv(window - 1 + in_flight, block) + 1, not
 * from the planner's code (docs/memory-model.md, "KV cache"). */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../run.h"

/* vllm-ascend's layout of DeepSeek-V4-Flash with its MTP layer, --block-size 128: one block id is
 * a page in each of 23 x 2 tensors, an indexer-key page (128 x (128 + 2)) and an entry page
 * (128 x 1,024). */
#define ID_BYTES (INT64_C(23) * (128 * 130 + 128 * 1024))
#define MAX_MODEL_LEN 32768
#define BATCHED 4096
#define IN_FLIGHT (2 * BATCHED)   /* vLLM's max_in_flight_tokens: 2 steps with async scheduling */

static int64_t cdiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

/* ids one window or state table holds for `in_flight` unprocessed tokens */
static int64_t held(int64_t window, int64_t block, int64_t in_flight)
{
    return cdiv(window - 1 + in_flight, block) + 1;
}

/* the four kinds of table that trim: 2 window tables (window 128, blocks of 128 tokens), CSA
 * states (window 8, blocks of 8), HCA states (window 128, blocks of 32) */
static int64_t trimmed_ids(int64_t in_flight)
{
    return 2 * held(128, 128, in_flight) + held(8, 8, in_flight) + held(128, 32, in_flight);
}

/* one sequence of max-model-len as it decodes: a block of 512 tokens (CSA entries and keys) and one
 * of 16,384 (HCA entries), and the trimmed tables with one token in flight */
static int64_t seq_bytes(void)
{
    return (cdiv(MAX_MODEL_LEN, 512) + cdiv(MAX_MODEL_LEN, 16384) + trimmed_ids(1)) * ID_BYTES;
}

/* what the chunks in flight hold beyond the sequence's own */
static int64_t transient_bytes(void)
{
    return (trimmed_ids(IN_FLIGHT) - trimmed_ids(1)) * ID_BYTES;
}

/* A decoding sequence with k MTP drafts: each step schedules its token and k drafts (1 + k), and
 * allocate_slots adds k lookahead slots (the scheduler's num_lookahead_tokens for MTP); with async
 * scheduling the step before is still unprocessed, so the window and state tables keep blocks for
 * 2 x (1 + k) + k tokens beyond the processed ones (5 for the seed's k = 1), where the planner's
 * sequence counts 1. */
#define MTP_K 1
#define DECODE_IN_FLIGHT (2 * (1 + MTP_K) + MTP_K)

static int64_t decode_extra_bytes(void)
{
    return (trimmed_ids(DECODE_IN_FLIGHT) - trimmed_ids(1)) * ID_BYTES;
}

static json_int_t get_int(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    cr_assert(json_is_integer(v), "no integer \"%s\"", key);
    return json_integer_value(v);
}

static json_t *role_budget(json_t *plan, int r)
{
    return json_object_get(json_array_get(json_object_get(plan, "roles"), (size_t)r), "budget");
}

/* The seed's deployment (pdmoe plan with no arguments): its prefill cards set aside 1,408 ids,
 * 4,783,505,408 B, for the chunks in flight, and hold 29 prompts of 32,768 tokens beside them
 * (47 before); its decode cards nothing. Text and JSON alike. */
Test(chunks, seed_plan_reserves_the_chunks_blocks)
{
    const int64_t seq = seq_bytes(), tr = transient_bytes();
    cr_assert_eq(seq, 77 * ID_BYTES);
    cr_assert_eq(tr, 1408 * ID_BYTES);
    json_t *j = run_json("plan --json");
    json_t *P = role_budget(j, 0);
    cr_assert_eq(get_int(P, "kv_transient_bytes"), tr);
    cr_assert_eq(get_int(P, "kv_inflight_tokens"), IN_FLIGHT);
    cr_assert_eq(get_int(P, "kv_need_bytes"), seq + tr);
    const int64_t fit = (get_int(P, "kv_pool_bytes") - tr) / seq;
    cr_assert_eq(fit, 29);
    cr_assert_eq(get_int(P, "seqs_at_max_model_len"), fit);
    cr_assert(json_is_false(json_object_get(P, "fits_max_num_seqs")));
    cr_assert_eq(get_int(json_array_get(json_object_get(j, "roles"), 0), "launched_max_num_seqs"), fit);
    json_decref(j);
    struct run r;
    run("plan", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "  of it, chunks in flight (8192 tokens)        4.78 GB        0.00 GB\n"), "%s", r.out);
    cr_assert(strstr(r.out, "  KV needed (1 / 30 x 32768 + steps)          5.05 GB        8.26 GB\n"), "%s", r.out);
    cr_assert(strstr(r.out, "  sequences of max-model-len that fit              29            145\n"), "%s", r.out);
    cr_assert(strstr(r.out, "  verdict: 30 of them (max-num-seqs)      29 launched            fit\n"), "%s", r.out);
}

/* The seed's decode cards: every one of the 30 sequences a rank admits holds 4 ids more while its
 * steps are in flight (15 trimmed ids against 11), 13,589,504 B, 407.7 MB for 30; the sequences of
 * max-model-len that fit are counted with them (145, 153 before), and the emitted --max-num-seqs of
 * the decode servers, with those blocks, fits the pool its --gpu-memory-utilization leaves. */
Test(chunks, seed_decode_reserves_its_steps_in_flight)
{
    const int64_t seq = seq_bytes(), e = decode_extra_bytes();
    cr_assert_eq(e, 4 * ID_BYTES);
    json_t *j = run_json("plan --json");
    json_t *D = role_budget(j, 1);
    const int64_t pool = get_int(D, "kv_pool_bytes"), fit = pool / (seq + e);
    cr_assert_eq(fit, 145);
    cr_assert_eq(get_int(D, "kv_decode_inflight_tokens"), DECODE_IN_FLIGHT);
    cr_assert_eq(get_int(D, "kv_transient_bytes"), 30 * e);
    cr_assert_eq(get_int(D, "kv_need_bytes"), 30 * (seq + e));
    cr_assert_eq(get_int(D, "seqs_at_max_model_len"), fit);
    json_decref(j);
    struct run r;
    run("plan --emit vllm-ascend", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    int servers = 0;
    for (const char *c = strstr(r.out, "vllm serve "); c; c = strstr(c + 1, "vllm serve ")) {
        const char *end = strstr(c, "&\n"), *role = strstr(c, "\"kv_role\":\"kv_consumer");
        if (!role || role > end)
            continue;
        const char *q = strstr(c, "--max-num-seqs ");
        cr_assert(q && q < end);
        const long long s = atoll(q + 15);
        cr_assert_eq(s, 30);
        cr_assert_leq(s * (seq + e), pool, "--max-num-seqs %lld with their steps in flight: %lld B in %lld B", s,
                      (long long)(s * (seq + e)), (long long)pool);
        servers++;
    }
    cr_assert_eq(servers, 4, "not the 4 decode servers (one a node) of the seed's layout:\n%s", r.out);
    run("plan", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "  of it, decodes in flight (5 tokens)         0.00 GB        0.41 GB\n"), "%s", r.out);
    cr_assert(strstr(r.out, "  sequences of max-model-len that fit              29            145\n"), "%s", r.out);
}

/* search's best layout is the plan of that layout: the same pools and the same chunks' blocks,
 * which are the figure above (its prefill instances are the seed's, 8 cards each). */
static void search_best_is_the_plan(const char *flag)
{
    char sargs[512];
    snprintf(sargs, sizeof sargs, "search --cards 64 --isl 4096 --osl 1024 --ttft-ms 2000 --tpot-ms 50 --layout "
             "disaggregated%s --json", flag);
    json_t *j = run_json(sargs);
    json_t *best = json_object_get(j, "best"), *roles = json_object_get(best, "roles");
    json_t *rp = json_array_get(roles, 0), *rd = json_array_get(roles, 1);
    if (!*flag) {
        cr_assert_eq(get_int(rp, "kv_transient_bytes"), transient_bytes());
        cr_assert_eq(get_int(rd, "kv_transient_bytes"), get_int(best, "batch") * decode_extra_bytes());
    }
    char args[512];
    snprintf(args, sizeof args, "plan --prefill dp=%lld,tp=%lld,instances=%lld,redundant=%lld --decode "
             "dp=%lld,tp=%lld,instances=%lld,redundant=%lld --max-num-seqs %lld%s --json",
             (long long)get_int(rp, "dp"), (long long)get_int(rp, "tp"), (long long)get_int(rp, "instances"),
             (long long)get_int(rp, "redundant"), (long long)get_int(rd, "dp"), (long long)get_int(rd, "tp"),
             (long long)get_int(rd, "instances"), (long long)get_int(rd, "redundant"), (long long)get_int(best, "batch"),
             flag);
    json_t *p = run_json(args);
    for (int r = 0; r < 2; r++) {
        json_t *s = json_array_get(roles, (size_t)r), *b = role_budget(p, r);
        cr_assert_eq(get_int(s, "kv_pool_bytes"), get_int(b, "kv_pool_bytes"), "%s: role %d", args, r);
        cr_assert_eq(get_int(s, "kv_transient_bytes"), get_int(b, "kv_transient_bytes"), "%s: role %d", args, r);
    }
    json_decref(p);
    json_decref(j);
}

Test(chunks, search_best_is_the_plan_of_its_layout)
{
    search_best_is_the_plan("");
}

/* search takes vLLM's --no-async-scheduling as plan does: its best layout's pools and chunks are
 * that plan's (one chunk in flight: the prefill's transient half the default's), its script passes
 * the flag, and it is refused where plan refuses it. */
Test(chunks, search_takes_no_async_scheduling_as_plan_does)
{
    search_best_is_the_plan(" --no-async-scheduling");
    json_t *j = run_json("search --cards 64 --isl 4096 --osl 1024 --ttft-ms 2000 --tpot-ms 50 --layout disaggregated "
                         "--no-async-scheduling --json");
    json_t *rp = json_array_get(json_object_get(json_object_get(j, "best"), "roles"), 0);
    cr_assert_eq(get_int(rp, "kv_transient_bytes"), (trimmed_ids(BATCHED) - trimmed_ids(1)) * ID_BYTES);
    json_decref(j);
    struct run r;
    run("search --cards 64 --isl 4096 --osl 1024 --ttft-ms 2000 --tpot-ms 50 --layout disaggregated "
        "--no-async-scheduling --emit vllm-ascend", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    int servers = 0, flagged = 0;
    for (const char *c = strstr(r.out, "vllm serve "); c; c = strstr(c + 1, "vllm serve ")) {
        const char *end = strstr(c, "&\n"), *q = strstr(c, "\n    --no-async-scheduling \\");
        servers++;
        flagged += q && q < end;
    }
    cr_assert(servers > 0 && flagged == servers, "%d of %d servers pass --no-async-scheduling", flagged, servers);
    run("search --cards 16 --no-async-scheduling --emit sglang", &r);
    cr_assert_eq(r.status, 2, "%s", r.out);
    cr_assert(strstr(r.err, "--no-async-scheduling: vLLM's flag"), "%s", r.err);
    run("search --cards 16 --model v4-flash-mini --hardware h100 --no-async-scheduling --emit pdmoe", &r);
    cr_assert_eq(r.status, 2, "%s", r.out);
    cr_assert(strstr(r.err, "--no-async-scheduling: vLLM's flag"), "%s", r.err);
}

/* The value after `flag ` in the command starting at s. */
static long long flag_in(const char *s, const char *end, const char *flag)
{
    const char *q = strstr(s, flag);
    cr_assert(q && q < end, "no %s in the command:\n%.400s", flag, s);
    return atoll(q + strlen(flag) + 1);
}

/* The seed's vllm-ascend script: every prefill server's --max-num-seqs prompts of --max-model-len
 * and the chunks of its --max-num-batched-tokens fit the pool its --gpu-memory-utilization leaves
 * (the plan's, counted here), and planned again from those flags, each role passes its checks. */
Test(chunks, emitted_flags_hold_in_the_plans_pool)
{
    struct run r;
    run("plan --emit vllm-ascend", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    json_t *j = run_json("plan --json");
    const int64_t pool = get_int(role_budget(j, 0), "kv_pool_bytes");
    json_decref(j);
    long long seqs[2] = {0, 0}, batched[2] = {0, 0};
    int servers = 0;
    for (const char *c = strstr(r.out, "vllm serve "); c; c = strstr(c + 1, "vllm serve ")) {
        const char *end = strstr(c, "&\n"), *role = strstr(c, "\"kv_role\":\"kv_");
        cr_assert(end && role && role < end);
        int k = strncmp(role + 14, "producer", 8) == 0 ? 0 : 1;
        const char *util = strstr(c, "--gpu-memory-utilization ");
        cr_assert(util && util < end && atof(util + 25) == 0.9);
        cr_assert_eq(flag_in(c, end, "--max-model-len"), MAX_MODEL_LEN);
        seqs[k] = flag_in(c, end, "--max-num-seqs");
        batched[k] = flag_in(c, end, "--max-num-batched-tokens");
        if (k == 0) {
            cr_assert_eq(batched[0], BATCHED);
            cr_assert_leq(seqs[0] * seq_bytes() + transient_bytes(), pool,
                          "--max-num-seqs %lld: %lld B of prompts and %lld B of chunks in a pool of %lld B", seqs[0],
                          (long long)(seqs[0] * seq_bytes()), (long long)transient_bytes(), (long long)pool);
            servers++;
        }
    }
    cr_assert_eq(servers, 4, "not the 4 prefill servers of the seed's layout:\n%s", r.out);
    for (int k = 0; k < 2; k++) {
        char args[256];
        snprintf(args, sizeof args, "plan --max-num-seqs %lld --max-num-batched-tokens %lld --json", seqs[k],
                 batched[k]);
        json_t *p = run_json(args);
        json_t *b = role_budget(p, k);
        cr_assert(json_is_true(json_object_get(b, "fits_max_num_seqs")), "%s: the %s role's %lld do not fit", args,
                  k ? "decode" : "prefill", seqs[k]);
        json_decref(p);
    }
}

/* --no-async-scheduling (vLLM's flag): vLLM's max_concurrent_batches is 2 with async scheduling and
 * pipeline parallel size 1, else the pipeline parallel size, 1 (vllm/config/vllm.py:539-550 in
 * v0.27.1), and max_in_flight_tokens that times max-num-batched-tokens (:553-561); a decoding step
 * is processed before the next is scheduled, so a sequence's slots past its processed tokens are its
 * step's 1 + k and k lookahead, T = (1 + k) + k, not 2 x (1 + k) + k. */
#define SYNC_IN_FLIGHT BATCHED

/* The seed's prefill cards: one step of 4,096 tokens in flight, 704 ids (2.39 GB) where two held
 * 1,408 (4.78 GB); the prompts of 32,768 tokens that fit beside them, 38 where 29 did, and the
 * launch script passes the flag and those --max-num-seqs (30, all the plan's, now fit). */
Test(chunks, no_async_scheduling_reserves_one_chunk)
{
    const int64_t seq = seq_bytes(), tr = (trimmed_ids(SYNC_IN_FLIGHT) - trimmed_ids(1)) * ID_BYTES;
    cr_assert_eq(tr, 704 * ID_BYTES);
    json_t *j = run_json("plan --no-async-scheduling --json");
    json_t *P = role_budget(j, 0);
    cr_assert_eq(get_int(P, "kv_inflight_tokens"), SYNC_IN_FLIGHT);
    cr_assert_eq(get_int(P, "kv_transient_bytes"), tr);
    cr_assert_eq(get_int(P, "kv_need_bytes"), seq + tr);
    const int64_t fit = (get_int(P, "kv_pool_bytes") - tr) / seq;
    cr_assert_eq(get_int(P, "seqs_at_max_model_len"), fit);
    cr_assert_eq(fit, 38);
    cr_assert(json_is_false(json_object_get(json_object_get(j, "options"), "async_scheduling")));
    json_decref(j);
    j = run_json("plan --json");
    cr_assert(json_is_true(json_object_get(json_object_get(j, "options"), "async_scheduling")));
    json_decref(j);
    struct run r;
    run("plan --no-async-scheduling", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "  of it, chunks in flight (4096 tokens)        2.39 GB        0.00 GB\n"), "%s", r.out);
    cr_assert(strstr(r.out, "while 4096 tokens are in flight (1 step of\n"), "%s", r.out);
    run("plan --no-async-scheduling --emit vllm-ascend", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    int servers = 0;
    for (const char *c = strstr(r.out, "vllm serve "); c; c = strstr(c + 1, "vllm serve ")) {
        const char *end = strstr(c, "&\n"), *q = strstr(c, "\n    --no-async-scheduling \\");
        cr_assert(q && q < end, "a server without --no-async-scheduling:\n%.1500s", c);
        servers++;
    }
    cr_assert_eq(servers, 8);
    run("plan --emit vllm-ascend", &r);
    cr_assert(!strstr(r.out, "async-scheduling"), "the default (async) is vLLM's: no flag");
}

/* A decoding sequence with k = 3 drafts a step: T = 2 x 4 + 3 = 11 with async scheduling, 4 + 3 = 7
 * without; the CSA state table (window 8, blocks of 8) holds cdiv(7 + 11, 8) + 1 = 4 ids against
 * cdiv(7 + 7, 8) + 1 = 3, the windows and HCA states the same: 5 ids past the sequence's own, or 4.
 * (k = 1, the seed's: T = 5 or 3, 4 ids either way.) */
Test(chunks, no_async_scheduling_decode_steps)
{
    const int64_t T[2] = {2 * 4 + 3, 4 + 3}, want[2] = {5, 4};
    static const char *const flag[2] = {"", " --no-async-scheduling"};
    for (int s = 0; s < 2; s++) {
        const int64_t e = (trimmed_ids(T[s]) - trimmed_ids(1)) * ID_BYTES;
        cr_assert_eq(e, want[s] * ID_BYTES);
        char args[256];
        snprintf(args, sizeof args, "plan --speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":3}'%s "
                 "--json", flag[s]);
        json_t *j = run_json(args);
        json_t *D = role_budget(j, 1);
        cr_assert_eq(get_int(D, "kv_decode_inflight_tokens"), T[s], "%s", args);
        cr_assert_eq(get_int(D, "kv_transient_bytes"), 30 * e, "%s", args);
        cr_assert_eq(get_int(D, "seqs_at_max_model_len"), get_int(D, "kv_pool_bytes") / (seq_bytes() + e), "%s", args);
        json_decref(j);
    }
    for (int s = 0; s < 2; s++) {   /* k = 1 */
        const int64_t t = s ? 3 : 5;
        cr_assert_eq(trimmed_ids(t) - trimmed_ids(1), 4);
    }
}

/* It is vLLM's: refused where the plan is SGLang's or pdmoe's (whose schedulers have no such flag
 * and for which the plan counts no steps in flight). */
Test(chunks, no_async_scheduling_is_vllms)
{
    struct run r;
    run("plan --no-async-scheduling --stack sglang", &r);
    cr_assert_eq(r.status, 2, "%s", r.out);
    cr_assert(strstr(r.err, "--no-async-scheduling: vLLM's flag"), "%s", r.err);
    run("plan --no-async-scheduling --emit sglang", &r);
    cr_assert_eq(r.status, 2);
    cr_assert(strstr(r.err, "--no-async-scheduling: vLLM's flag"), "%s", r.err);
    run("plan --model v4-flash-mini --hardware h100 --no-async-scheduling --emit pdmoe", &r);
    cr_assert_eq(r.status, 2, "%s", r.out);
    cr_assert(strstr(r.err, "--no-async-scheduling: vLLM's flag"), "%s", r.err);
}

/* SGLang on Ascend cards: the plan counts SGLang's own DeepSeek-V4 pools (kvsize.h), and the
 * flags --emit sglang writes hold in them.
 *
 * SGLang (0a3cd26b, docs/memory-model.md "KV cache") sizes its pools from a budget, --mem-fraction-
 * static x the card less the weights: F full tokens = (budget - fixed c128 state bytes) / its
 * coefficient (9,259.90 B for V4-Flash with EAGLE), a window pool of int(0.1 F), F / 4 CSA entries,
 * F / 128 HCA entries, (F / 128) x 32 indexer keys; its NPU pools then store those in bf16, the keys
 * twice, and compressor states in pages per request; and beside the pools, on every DP rank, six
 * int32 tables a request slot (DSV4NPUReqToTokenPool: req_to_token, swa, c4_state and c128_state of
 * a row's tokens, c4 of a quarter, c128 of 1/128), rows of max-model-len + SGLang's headroom. The
 * figures below are worked here from those formulas, not from the planner's code. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../run.h"

/* SGLang's CI case of validation/published.json: V4-Flash W8A8 on one Atlas 800I A3, DP16
 * attention, 10 requests per die of 9,000 tokens, EAGLE (the MTP layer) */
#define LAYOUT "--hardware atlas-800i-a3 --quant w8a8 --aggregated dp=16,tp=1 --max-model-len 9000 " \
               "--max-num-batched-tokens 16000"
#define CASE LAYOUT " --max-num-seqs 10"
#define PAGE 128
#define MAX_MODEL_LEN 9000

struct pools {
    int64_t full, reqs, bytes;
};

static int64_t pages(int64_t size, int64_t page)   /* SGLang's (size + page + 1) // page */
{
    return (size + page + 1) / page;
}

/* SGLang's pools for a budget, requests per DP rank and request slots (req_to_token's rows: the
 * requests, a PD decode node's pre-allocated slots, a padding row): 43 layers (21 CSA, 20 HCA), the
 * draft's window-only layer, head 512 (448 + 64 rope), indexer head 128, EAGLE rings 16 and 256 */
static struct pools sglang_slots(int64_t budget, int64_t reqs, int64_t slots)
{
    const double bpft = (0.1 * 584 * 43 + 0.25 * 584 * 21 + 1.0 / 128 * 584 * 20 + 0.25 * 132 * 21 +
                         0.1 * (16.0 / 128) * 8192 * 21 + 0.1 * (16.0 / 128) * 2048 * 21) * (44.0 / 43);
    const int64_t c128_rows = (slots * 256 + 256 + 1 + 127) / 128 * 128, fixed = c128_rows * 4096 * 20;
    struct pools q;
    q.full = (int64_t)((double)(budget > fixed ? budget - fixed : 0) / bpft) / PAGE * PAGE;
    q.reqs = reqs < q.full / 2 ? reqs : q.full / 2;
    const int64_t swa = (int64_t)((double)q.full * 0.1) / PAGE * PAGE, keys = q.full / 128 * 32;
    const int64_t s128 = 3 * q.reqs * PAGE > slots * 256 ? 3 * q.reqs * PAGE : slots * 256;
    q.bytes = pages(swa, PAGE) * PAGE * 1024 * 44 + pages(q.full / 4, PAGE) * PAGE * 1024 * 21 +
              pages(q.full / 128, PAGE) * PAGE * 1024 * 20 +
              (pages(keys, PAGE / 4) * (PAGE / 4) * 132 + pages(keys, PAGE) * PAGE * 130) * 21 +
              (2 * q.reqs + 1) * PAGE * (8192 + 2048) * 21 + ((s128 + PAGE - 1) / PAGE + 1) * PAGE * 4096 * 20;
    return q;
}

static struct pools sglang(int64_t budget, int64_t reqs)
{
    return sglang_slots(budget, reqs, reqs + 1);
}

/* SGLang's request tables on one DP rank: `slots` rows of six int32 tables of a row of `tokens` */
static int64_t tables(int64_t slots, int64_t tokens)
{
    return slots * 4 * (5 * tokens + tokens / 4 + tokens / 128);
}

static json_int_t get_int(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    cr_assert(json_is_integer(v), "no integer \"%s\"", key);
    return json_integer_value(v);
}

/* the value of a flag on a command line of the script (not in its comments) */
static const char *after(const char *s, const char *flag)
{
    char line[96];
    snprintf(line, sizeof line, "\n    %s ", flag);
    const char *q = strstr(s, line);
    cr_assert(q, "no %s in the script:\n%.2000s", flag, s);
    return q + strlen(line);
}

/* The plan counts SGLang's pools: 11,417.1 B a token as they allocate it and 86.5 MB of
 * compressor-state pages a request; a 9,000-token sequence 190,266,125 B (vllm-ascend's block ids:
 * 30 x 3,397,376 B). */
Test(sglang, plan_counts_sglangs_npu_pools)
{
    json_t *j = run_json("plan " CASE " --stack sglang --json");
    json_t *kv = json_object_get(j, "kv_cache");
    cr_assert(strstr(json_string_value(json_object_get(kv, "layout")), "SGLang NPU pools"));
    json_t *b = json_object_get(json_array_get(json_object_get(j, "roles"), 1), "budget");
    const int64_t seq = (9088 * INT64_C(114171) + 9) / 10 + 21 * 2 * 128 * (8192 + 2048) + 20 * 3 * 128 * 4096;
    cr_assert_eq(seq, 190266125);
    /* and beside them SGLang's request tables: 10 requests and a padding row of 9,000 + 131 tokens
     * (aggregated: no pre-allocated slots; EAGLE at page 128) */
    const int64_t tab = tables(11, MAX_MODEL_LEN + 131);
    cr_assert_eq(get_int(b, "kv_request_tables_bytes"), tab);
    cr_assert_eq(get_int(b, "kv_need_bytes"), 10 * seq + tab);
    cr_assert_eq(get_int(b, "seqs_at_max_model_len"), (get_int(b, "kv_pool_bytes") - tab) / seq);
    json_decref(j);
    j = run_json("plan " CASE " --json");   /* vLLM's (vllm-ascend) by default */
    b = json_object_get(json_array_get(json_object_get(j, "roles"), 1), "budget");
    cr_assert_eq(get_int(b, "kv_need_bytes"), 10 * 30 * INT64_C(3397376) + get_int(b, "kv_transient_bytes"));
    json_decref(j);
}

/* --emit sglang on the A3: the budget its --mem-fraction-static gives SGLang makes pools that take
 * no more than the plan's KV pool on the NPU, each of its --max-running-requests has the full-pool
 * pages of a max-model-len sequence, and planned again with those requests the plan's checks pass. */
Test(sglang, emitted_flags_hold_in_sglangs_pools)
{
    struct run r;
    run("plan " CASE " --emit sglang", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    const double f = atof(after(r.out, "--mem-fraction-static"));
    const long long running = atoll(after(r.out, "--max-running-requests")), dp = atoll(after(r.out, "--dp-size"));
    cr_assert_eq(atoll(after(r.out, "--context-length")), MAX_MODEL_LEN);
    cr_assert_eq(dp, 16);
    json_t *j = run_json("plan " CASE " --json");   /* the card's figures, whichever stack */
    json_t *b = json_object_get(json_array_get(json_object_get(j, "roles"), 1), "budget");
    const int64_t cap = get_int(b, "capacity_bytes"), weights = get_int(b, "weights_bytes"),
                  kv_pool = get_int(b, "kv_pool_bytes");
    json_decref(j);
    const int64_t reqs = running / dp, budget = (int64_t)(f * (double)cap) - weights;
    cr_assert_eq(reqs, 10);
    const struct pools q = sglang(budget, reqs);
    cr_assert_leq(q.bytes, kv_pool, "--mem-fraction-static %.2f: SGLang's pools take %lld B, the plan leaves %lld B", f,
                  (long long)q.bytes, (long long)kv_pool);
    /* the next hundredth would not fit: the fraction is the largest that does */
    cr_assert_gt(sglang((int64_t)((f + 0.01) * (double)cap) - weights, reqs).bytes, kv_pool);
    cr_assert_leq(reqs, q.reqs);
    cr_assert_leq(reqs * ((MAX_MODEL_LEN + PAGE - 1) / PAGE * PAGE), q.full);
    /* the pools' page and SGLang's V4 backend, as its Ascend V4 test passes them */
    cr_assert_eq(atoll(after(r.out, "--page-size")), PAGE);
    cr_assert(strncmp(after(r.out, "--attention-backend"), "dsv4", 4) == 0);
    char args[512];
    snprintf(args, sizeof args, "plan " LAYOUT " --stack sglang --max-num-seqs %lld --json", (long long)reqs);
    j = run_json(args);
    b = json_object_get(json_array_get(json_object_get(j, "roles"), 1), "budget");
    cr_assert(json_is_true(json_object_get(b, "fits_max_num_seqs")), "%s: %lld requests do not fit", args,
              (long long)reqs);
    json_decref(j);
}

/* --stack names one of the two stacks, and agrees with --emit */
Test(sglang, stack_is_refused_by_name_or_against_emit)
{
    struct run r;
    run("plan --stack tgi", &r);
    cr_assert_eq(r.status, 2);
    cr_assert(strstr(r.err, "--stack tgi: expected vllm or sglang"), "%s", r.err);
    run("plan " CASE " --stack vllm --emit sglang", &r);
    cr_assert_eq(r.status, 2);
    cr_assert(strstr(r.err, "--stack vllm: --emit sglang launches SGLang"), "%s", r.err);
    run("plan " CASE " --stack sglang --emit vllm-ascend", &r);
    cr_assert_eq(r.status, 2);
    cr_assert(strstr(r.err, "--stack sglang: --emit vllm-ascend launches vLLM"), "%s", r.err);
}

/* SGLang's CI cases in validation/published.json are planned in SGLang's layout, vLLM-Ascend's
 * nightly case on the same cards in vllm-ascend's */
Test(sglang, validation_case_counts_sglangs_pools)
{
    json_t *j = run_json("validate --json");
    int sgl = 0, vllm = 0;
    for (size_t i = 0; i < json_array_size(j); i++) {
        json_t *c = json_array_get(j, i);
        const char *name = json_string_value(json_object_get(c, "name")),
                   *layout = json_string_value(json_object_get(c, "kv_layout"));
        cr_assert(name && layout);
        if (strstr(name, "SGLang CI") && strstr(name, "A3")) {
            cr_assert(strstr(layout, "SGLang NPU pools"), "%s: %s", name, layout);
            sgl++;
        } else if (strstr(name, "vLLM-Ascend") && strstr(name, "A3")) {
            cr_assert(strstr(layout, "vllm-ascend"), "%s: %s", name, layout);
            vllm++;
        }
    }
    cr_assert_eq(sgl, 3, "SGLang's A3 CI runs: 8K, 32K, 1P1D");
    cr_assert_eq(vllm, 1);
    json_decref(j);
}

/* The seed (pdmoe plan's defaults: V4-Flash W8A8 on 8 Atlas 800I A2, prefill 4 x dp 8, decode dp 32,
 * 30 requests of 32,768 tokens a DP rank, the MTP layer as EAGLE with 1 step and 2 draft tokens).
 * SGLang (0a3cd26b) gives each DP rank a request table of max_running_requests + 1 rows
 * (memory_pool.py ReqToTokenPool: a padding row), on a PD decode node of
 * --disaggregation-decode-extra-slots more (disaggregation/decode.py DecodeReqToTokenPool), whose
 * default is twice the requests a rank when they are 32 or fewer (pd_disaggregation_hook.py). A row
 * is the context length + max(4 + draft tokens, 2 x max(steps x topk, draft tokens) + page - 1)
 * tokens (allocation_sizing.py get_req_to_token_extra_context_len): 32,768 + max(6, 4 + 127). */
#define SEED_LEN 32768
#define SEED_ROW (SEED_LEN + 131)
#define SEED_SEQS 30
#define SEED_EXTRA (2 * SEED_SEQS)

/* the plan counts them: 31 rows on a prefill rank, 30 + 60 + 1 on a decode rank, of 691,904 B */
Test(sglang, plan_counts_sglangs_request_tables)
{
    cr_assert_eq(tables(1, SEED_ROW), 4 * (5 * 32899 + 8224 + 257));
    json_t *j = run_json("plan --stack sglang --json");
    const int64_t want[2] = {tables(SEED_SEQS + 1, SEED_ROW), tables(SEED_SEQS + SEED_EXTRA + 1, SEED_ROW)};
    cr_assert_eq(want[1], 62963264);
    const int64_t seq = 374115533 + 21 * 2 * 128 * (8192 + 2048) + 20 * 3 * 128 * 4096;   /* 32,768 x 11,417.1 B, state pages */
    for (int r = 0; r < 2; r++) {
        json_t *b = json_object_get(json_array_get(json_object_get(j, "roles"), (size_t)r), "budget");
        cr_assert_eq(get_int(b, "kv_request_tables_bytes"), want[r], "role %d: %lld, SGLang's %lld", r,
                     (long long)get_int(b, "kv_request_tables_bytes"), (long long)want[r]);
        /* drawn from the KV pool beside the sequences: the sequences that fit leave room for them */
        cr_assert_geq(get_int(b, "kv_transient_bytes"), want[r]);
        cr_assert_eq(get_int(b, "seqs_at_max_model_len"),
                     (get_int(b, "kv_pool_bytes") - get_int(b, "kv_transient_bytes")) / seq);
        if (r == 1)
            cr_assert_eq(get_int(b, "kv_need_bytes"), SEED_SEQS * seq + want[1]);
    }
    json_decref(j);
    struct run t;
    run("plan --stack sglang", &t);
    cr_assert_eq(t.status, 0, "%s", t.err);
    cr_assert(strstr(t.out, "of it, SGLang's request tables"), "%.3000s", t.out);
}

/* the value of a flag on a command line of the script after `from` */
static const char *after_in(const char *s, const char *from, const char *flag)
{
    const char *q = strstr(s, from);
    cr_assert(q, "no %s in the script", from);
    return after(q, flag);
}

/* --emit sglang on the seed: on each server, the weights, the pools SGLang makes of the emitted
 * --mem-fraction-static, its request tables, activations and runtime fit the card's usable memory;
 * the decode servers pass the pre-allocated slots the plan counts, and their fraction is the largest
 * that leaves room for it all. */
Test(sglang, emitted_fraction_leaves_room_for_request_tables)
{
    struct run r;
    run("plan --emit sglang", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    json_t *j = run_json("plan --stack sglang --json");
    static const char *mode[2] = {"--disaggregation-mode prefill", "--disaggregation-mode decode"};
    for (int role = 0; role < 2; role++) {
        json_t *b = json_object_get(json_array_get(json_object_get(j, "roles"), (size_t)role), "budget");
        const int64_t cap = get_int(b, "capacity_bytes"), usable = get_int(b, "usable_bytes"),
                      rest = get_int(b, "weights_bytes") + get_int(json_object_get(b, "activations"), "total_bytes") +
                                    get_int(b, "runtime_bytes");
        const double f = atof(after_in(r.out, mode[role], "--mem-fraction-static"));
        const long long n = atoll(after_in(r.out, mode[role], "--max-running-requests")) /
                            atoll(after_in(r.out, mode[role], "--dp-size"));
        cr_assert_eq(atoll(after_in(r.out, mode[role], "--context-length")), SEED_LEN);
        cr_assert_eq(atoll(after_in(r.out, mode[role], "--speculative-num-draft-tokens")), 2);
        long long extra = 0;
        if (role == 1) {
            extra = atoll(after_in(r.out, mode[role], "--disaggregation-decode-extra-slots"));
            cr_assert_eq(extra, SEED_EXTRA);
            cr_assert_eq(n, SEED_SEQS);
        }
        const int64_t slots = n + extra + 1, tab = tables(slots, SEED_ROW);
        const struct pools q = sglang_slots((int64_t)(f * (double)cap) - get_int(b, "weights_bytes"), n, slots);
        cr_assert_leq(rest + q.bytes + tab, usable,
                      "%s --mem-fraction-static %.2f: weights, activations and runtime %lld B, pools %lld B, request "
                      "tables %lld B, over the usable %lld B",
                      mode[role], f, (long long)rest, (long long)q.bytes, (long long)tab, (long long)usable);
        cr_assert_geq(q.reqs, n);
        cr_assert_leq(n * ((SEED_LEN + PAGE - 1) / PAGE * PAGE), q.full);
        if (role == 1) {
            const struct pools q1 = sglang_slots((int64_t)((f + 0.01) * (double)cap) - get_int(b, "weights_bytes"), n, slots);
            cr_assert_gt(rest + q1.bytes + tab, usable, "--mem-fraction-static %.2f would fit too", f + 0.01);
        }
    }
    json_decref(j);
}

/* The requests --emit sglang gives each DP rank are the plan's own (its "launched" sequences,
 * launched_max_num_seqs in --json): SGLang makes --max-running-requests // --dp-size the requests
 * of a DP rank (kv_cache_configurator.py resolve_max_num_reqs, 0a3cd26b2), so the flag is that
 * count x dp, and on NPUs the pools the script describes are sized for that many. The fraction was
 * rounded down to a hundredth, which on the seed's prefill cards took SGLang's budget from 8.83 GB
 * to 8.72 GB: 874,496 full tokens, 26 sequences of 32,768 where the plan counts 27 (and on H100 at
 * 131,072 tokens 86 and 105 for the plan's 87 and 106). */
Test(sglang, emitted_requests_are_the_plans)
{
    static const char *const layouts[] = {
        "",   /* the seed */
        CASE,
        "--hardware h100 --quant fp8 --quant-override routed_experts=fp4 --prefill dp=8,tp=1,instances=2 "
        "--decode dp=16,tp=1,instances=1 --nodes 4 --max-model-len 131072 --max-num-seqs 400",
        "--hardware h100 --quant fp8 --quant-override routed_experts=fp4 --prefill dp=8,tp=1,instances=2 "
        "--decode dp=16,tp=1,instances=1 --nodes 4 --max-model-len 400000 --max-num-seqs 400",
    };
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
        char args[1024];
        snprintf(args, sizeof args, "plan %s --stack sglang --json", layouts[i]);
        json_t *j = run_json(args);
        const int agg = strstr(layouts[i], "--aggregated") != NULL;
        snprintf(args, sizeof args, "plan %s --emit sglang", layouts[i]);
        struct run r;
        run(args, &r);
        cr_assert_eq(r.status, 0, "%s: %s", args, r.err);
        for (int role = agg ? 1 : 0; role < 2; role++) {
            const json_int_t want = get_int(json_array_get(json_object_get(j, "roles"), (size_t)role),
                                            "launched_max_num_seqs");
            const char *block = strstr(r.out, agg ? "# aggregated instance 0" : role ? "# decode instance 0"
                                                                                     : "# prefill instance 0");
            cr_assert(block, "%s: no server of role %d", args, role);
            const long long n = atoll(after(block, "--max-running-requests")) / atoll(after(block, "--dp-size"));
            cr_assert_eq(n, want, "%s, role %d: --max-running-requests gives %lld requests a DP rank, the plan %lld",
                         args, role, n, (long long)want);
            const char *pools = strstr(block, "tokens, "), *server = strstr(block, "sglang.launch_server");
            if (pools && pools < server)   /* the NPU pools' note: sized for the same requests */
                cr_assert_eq(atoll(pools + strlen("tokens, ")), want, "%s, role %d: %.200s", args, role, pools);
        }
        json_decref(j);
    }
}

/* SGLang on GPUs (0a3cd26b2): DeepSeek-V4 runs at --page-size 256 (arg_groups/overrides.py:795-805),
 * and each DP rank's request table is the stock int32 req_to_token, ReqToTokenPool's size + 1 rows
 * (mem_cache/memory_pool.py), on a PD decode node DecodeReqToTokenPool's size + pre_alloc_size + 1
 * (disaggregation/decode.py:109-140), the pre-allocated slots --disaggregation-decode-extra-slots,
 * 2 x the requests a rank when 32 or fewer (pd_disaggregation_hook.py:60-72). It is built by
 * _init_pools after the budget is resolved (mem_cache/kv_cache_configurator.py:218-233, :343-347,
 * :614-631), so outside --mem-fraction-static, as on NPUs. A row is the context length + max(4 +
 * draft tokens, 2 x draft tokens + page - 1) with EAGLE (allocation_sizing.py): 32,768 + 259. */
#define GPU_LAYOUT "--hardware h200 --quant fp8 --quant-override routed_experts=fp4 --prefill dp=8,tp=1,instances=2 " \
                   "--decode dp=16,tp=1,instances=1 --nodes 4"
#define GPU_ROW (SEED_LEN + 2 * 2 + 256 - 1)

Test(sglang, gpu_plan_counts_req_to_token_rows)
{
    const int64_t row = 4 * (int64_t)GPU_ROW;
    const int64_t want[2] = {(SEED_SEQS + 1) * row, (SEED_SEQS + SEED_EXTRA + 1) * row};
    cr_assert_eq(want[1], 12021828);
    json_t *j = run_json("plan " GPU_LAYOUT " --stack sglang --json");
    const int64_t seq = get_int(json_object_get(j, "kv_cache"), "max_model_len_seq_bytes");
    for (int r = 0; r < 2; r++) {
        json_t *b = json_object_get(json_array_get(json_object_get(j, "roles"), (size_t)r), "budget");
        cr_assert_eq(get_int(b, "kv_request_tables_bytes"), want[r], "role %d: %lld, SGLang's %lld", r,
                     (long long)get_int(b, "kv_request_tables_bytes"), (long long)want[r]);
        cr_assert_eq(get_int(b, "seqs_at_max_model_len"),
                     (get_int(b, "kv_pool_bytes") - get_int(b, "kv_transient_bytes")) / seq);
    }
    json_decref(j);
    j = run_json("plan " GPU_LAYOUT " --json");   /* vLLM's: no such table */
    for (int r = 0; r < 2; r++)
        cr_assert_eq(get_int(json_object_get(json_array_get(json_object_get(j, "roles"), (size_t)r), "budget"),
                             "kv_request_tables_bytes"), 0);
    json_decref(j);
    /* the decode servers get the slots the plan counts */
    struct run t;
    run("plan " GPU_LAYOUT " --emit sglang", &t);
    cr_assert_eq(t.status, 0, "%s", t.err);
    cr_assert_eq(atoll(after_in(t.out, "--disaggregation-mode decode", "--disaggregation-decode-extra-slots")),
                 SEED_EXTRA);
}

/* Thread counts change nothing: v4-flash-mini's logits, bit for bit, at 1, 2 and 3 threads, for
 * a batch-16 prefill and decode and a batch-1 prefill and decode (every split the engine makes
 * over the pool: the mHC mixing rows at batch 1, attention heads, the router, the grouped GEMMs,
 * the output groups of attention), and the pool really is used at 2 threads, in fused runs
 * (a bounded number a layer). */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"
#include "../tmpmodel.h"

enum { B = 16, DECODE = 5, SOLO_PROMPT = 150, SOLO_DECODE = 8 };

/* All logits of one run: batch-16 prefill and DECODE steps, then one sequence alone. */
struct run {
    float *l;                      /* [(1 + DECODE) * B + 1 + SOLO_DECODE, V] */
    unsigned long long solo_dispatches;   /* pool runs during the batch-1 decode steps */
};

static void run_at(int threads, struct run *out)
{
    struct pd_engine en;
    pd_err e = {0};
    struct pd_engine_opts o = {.dir = "models/mini", .threads = threads, .max_seqs = B, .max_model_len = 256};
    cr_assert_eq(pd_engine_open(&en, &o, &e), 0, "%s", e.msg);
    const int V = (int)en.model.vocab_size;
    const size_t rows = (size_t)(1 + DECODE) * B + 1 + SOLO_DECODE;
    out->l = malloc(rows * V * sizeof(float));
    cr_assert_not_null(out->l);
    float *l = out->l;
    static int32_t ids[B][200];
    for (int b = 0; b < B; b++)
        for (int i = 0; i < 200; i++)
            ids[b][i] = (int32_t)((i * 37 + b * 101 + 11) % 1000);
    struct pd_seq s[B];
    struct pd_step_item it[B];
    int32_t next[B];
    for (int b = 0; b < B; b++) {
        cr_assert_eq(pd_seq_start(&en, &s[b], &e), 0, "%s", e.msg);
        /* prompts of different lengths (every residue mod 4, the CSA layers' ratio), up to the window
         * (128: one HCA block) and past it, 932 tokens in all (short ones 3-58 tokens, not 20-119:
         * the three runs' prefill took most of the test, 69 s of it under the sanitizers) */
        const int n = b < 12 ? 3 + 5 * b : 20 + 9 * b;
        it[b] = (struct pd_step_item){.seq = &s[b], .tokens = ids[b], .n = n, .logits = l + (size_t)b * V};
    }
    cr_assert_eq(pd_engine_step(&en, it, B, &e), 0, "%s", e.msg);
    for (int k = 1; k <= DECODE; k++) {
        for (int b = 0; b < B; b++) {
            next[b] = (int32_t)((k * 13 + b * 7) % 1000);
            it[b] = (struct pd_step_item){.seq = &s[b], .tokens = &next[b], .n = 1, .logits = l + ((size_t)k * B + b) * V};
        }
        cr_assert_eq(pd_engine_step(&en, it, B, &e), 0, "%s", e.msg);
    }
    for (int b = 0; b < B; b++)
        pd_seq_end(&en, &s[b]);
    /* one sequence alone: prefill, then batch-1 decode */
    float *solo = l + (size_t)(1 + DECODE) * B * V;
    cr_assert_eq(pd_seq_start(&en, &s[0], &e), 0, "%s", e.msg);
    it[0] = (struct pd_step_item){.seq = &s[0], .tokens = ids[3], .n = SOLO_PROMPT, .logits = solo};
    cr_assert_eq(pd_engine_step(&en, it, 1, &e), 0, "%s", e.msg);
    struct pd_pool_stats p0, p1;
    pd_pool_stats(en.pool, &p0);
    for (int k = 1; k <= SOLO_DECODE; k++) {
        next[0] = (int32_t)((k * 29 + 5) % 1000);
        it[0] = (struct pd_step_item){.seq = &s[0], .tokens = &next[0], .n = 1, .logits = solo + (size_t)k * V};
        cr_assert_eq(pd_engine_step(&en, it, 1, &e), 0, "%s", e.msg);
    }
    pd_pool_stats(en.pool, &p1);
    /* the runs the engine made, whoever ran their tasks: after a stalled helper the pool runs them on
     * the caller alone for a while (backoff_runs), which a loaded machine (CI under sanitizers) causes */
    out->solo_dispatches = p1.dispatches + p1.backoff_runs - p0.dispatches - p0.backoff_runs;
    pd_seq_end(&en, &s[0]);
    pd_engine_close(&en);
}

Test(threads, mini_logits_identical_at_1_2_and_3_threads, .timeout = 900)
{
    if (access("models/mini/model.safetensors", R_OK) != 0)
        cr_skip_test("models/mini not generated (make models/mini/model.safetensors)");
    struct run r[3];
    for (int i = 0; i < 3; i++)
        run_at(i + 1, &r[i]);
    cr_assert_eq(r[0].solo_dispatches, 0, "a 1-thread engine has no pool");
    /* at 2 threads a batch-1 decode step must share its work: several runs per layer */
    cr_assert_geq(r[1].solo_dispatches, 8ull * 8 * SOLO_DECODE, "%llu pool runs in %d batch-1 steps",
                  r[1].solo_dispatches, SOLO_DECODE);
    /* ... in fused runs, not one per small product: attention's float projections in one run, its
     * wo_a groups in one, the shared expert inside the routed experts' grouped products, the
     * heads' and activations' few microseconds on the caller (19 runs a layer before, 10 now) */
    cr_assert_leq(r[1].solo_dispatches, 11ull * 8 * SOLO_DECODE, "%llu pool runs in %d batch-1 steps",
                  r[1].solo_dispatches, SOLO_DECODE);
    const int V = 8192;
    const size_t rows = (size_t)(1 + DECODE) * B + 1 + SOLO_DECODE;
    for (int i = 1; i < 3; i++)
        for (size_t row = 0; row < rows; row++)
            cr_assert_eq(memcmp(r[0].l + row * V, r[i].l + row * V, (size_t)V * sizeof(float)), 0,
                         "%d threads: logits row %zu (%s) differ from 1 thread's", i + 1, row,
                         row < (size_t)B ? "batch-16 prefill" : row < (size_t)(1 + DECODE) * B ? "batch-16 decode"
                         : row == (size_t)(1 + DECODE) * B ? "batch-1 prefill" : "batch-1 decode");
    for (int i = 0; i < 3; i++)
        free(r[i].l);
}

/* pd_engine_swap_pool between steps (bench decode alternates 1 and N threads on the same
 * sequences): a sequence whose steps switch between the engine's 2-thread pool and none gives the
 * logits of one that keeps the pool, bit for bit, and the steps without a pool make no pool run. */
Test(threads, swapping_the_pool_between_steps_changes_no_logit, .timeout = 300)
{
    if (access("models/mini/model.safetensors", R_OK) != 0)
        cr_skip_test("models/mini not generated (make models/mini/model.safetensors)");
    enum { PROMPT = 40, STEPS = 6 };
    struct pd_engine en;
    pd_err e = {0};
    struct pd_engine_opts o = {.dir = "models/mini", .threads = 2, .max_seqs = 2, .max_model_len = 128};
    cr_assert_eq(pd_engine_open(&en, &o, &e), 0, "%s", e.msg);
    const int V = (int)en.model.vocab_size;
    pd_pool *own = en.pool;
    cr_assert_not_null(own, "a 2-thread engine without a pool");
    float *l = malloc((size_t)2 * (1 + STEPS) * V * sizeof(float));
    cr_assert_not_null(l);
    int32_t ids[PROMPT];
    for (int i = 0; i < PROMPT; i++)
        ids[i] = (int32_t)((i * 53 + 17) % 1000);
    for (int swap = 0; swap < 2; swap++) {
        float *out = l + (size_t)swap * (1 + STEPS) * V;
        struct pd_seq s;
        cr_assert_eq(pd_seq_start(&en, &s, &e), 0, "%s", e.msg);
        struct pd_step_item it = {.seq = &s, .tokens = ids, .n = PROMPT, .logits = out};
        cr_assert_eq(pd_engine_step(&en, &it, 1, &e), 0, "%s", e.msg);
        for (int k = 1; k <= STEPS; k++) {
            /* with swap, the odd steps on the calling thread alone */
            const int alone = swap && k % 2;
            cr_assert_eq(pd_engine_swap_pool(&en, alone ? NULL : own), own);
            struct pd_pool_stats p0, p1;
            pd_pool_stats(own, &p0);
            int32_t next = (int32_t)((k * 71 + 3) % 1000);
            it = (struct pd_step_item){.seq = &s, .tokens = &next, .n = 1, .logits = out + (size_t)k * V};
            cr_assert_eq(pd_engine_step(&en, &it, 1, &e), 0, "%s", e.msg);
            pd_pool_stats(own, &p1);
            const unsigned long long runs = p1.dispatches + p1.backoff_runs - p0.dispatches - p0.backoff_runs;
            if (alone)
                cr_assert_eq(runs, 0, "step %d without a pool made %llu pool runs", k, runs);
            else
                cr_assert_gt(runs, 0, "step %d on the pool made no pool run", k);
            cr_assert_eq(pd_engine_swap_pool(&en, own), alone ? NULL : own);
        }
        pd_seq_end(&en, &s);
    }
    for (int k = 0; k <= STEPS; k++)
        cr_assert_eq(memcmp(l + (size_t)k * V, l + (size_t)(1 + STEPS + k) * V, (size_t)V * sizeof(float)), 0,
                     "step %d: the logits differ when the pool is swapped", k);
    free(l);
    pd_engine_close(&en);
}

/* A decode step at a long context: each CSA layer's indexer scores every compressed entry, and
 * those scores run over the pool by blocks of entries (one more run in each of v4-flash-mini's 4
 * CSA layers, where they ran on the caller alone), with the logits of one thread bit for bit. A
 * step at a short context (fewer entries than two blocks) makes no such run. */
/* 600 tokens: 150 entries in a CSA layer, three blocks of 64 (2,100 tokens took 48 s under the
 * sanitizers with the blocks of 256 entries before) */
enum { LONG_PROMPT = 600, SHORT_PROMPT = 40, LONG_STEPS = 3 };

static void long_context_at(int threads, float *l, unsigned long long runs[2])
{
    struct pd_engine en;
    pd_err e = {0};
    struct pd_engine_opts o = {.dir = "models/mini", .threads = threads, .max_seqs = 2, .max_model_len = 768};
    cr_assert_eq(pd_engine_open(&en, &o, &e), 0, "%s", e.msg);
    const int V = (int)en.model.vocab_size;
    static int32_t ids[LONG_PROMPT];
    for (int i = 0; i < LONG_PROMPT; i++)
        ids[i] = (int32_t)((i * 37 + 11) % 1000);
    for (int longer = 1; longer >= 0; longer--) {
        struct pd_seq s;
        cr_assert_eq(pd_seq_start(&en, &s, &e), 0, "%s", e.msg);
        struct pd_step_item it = {.seq = &s, .tokens = ids, .n = longer ? LONG_PROMPT : SHORT_PROMPT, .logits = l};
        cr_assert_eq(pd_engine_step(&en, &it, 1, &e), 0, "%s", e.msg);
        struct pd_pool_stats p0, p1;   /* (all 0 for no pool) */
        pd_pool_stats(en.pool, &p0);
        for (int k = 1; k <= LONG_STEPS; k++) {
            int32_t next = (int32_t)((k * 29 + 5) % 1000);
            it = (struct pd_step_item){.seq = &s, .tokens = &next, .n = 1, .logits = l + (size_t)k * V};
            cr_assert_eq(pd_engine_step(&en, &it, 1, &e), 0, "%s", e.msg);
        }
        pd_pool_stats(en.pool, &p1);
        runs[longer] = p1.dispatches + p1.backoff_runs - p0.dispatches - p0.backoff_runs;
        pd_seq_end(&en, &s);
        l += (size_t)(1 + LONG_STEPS) * V;
    }
    pd_engine_close(&en);
}

Test(threads, a_long_contexts_indexer_runs_over_the_pool_with_the_same_logits, .timeout = 600)
{
    if (access("models/mini/model.safetensors", R_OK) != 0)
        cr_skip_test("models/mini not generated (make models/mini/model.safetensors)");
    const int V = 8192;
    const size_t n = (size_t)2 * (1 + LONG_STEPS) * V;
    float *l[2] = {malloc(n * sizeof(float)), malloc(n * sizeof(float))};
    cr_assert(l[0] && l[1]);
    unsigned long long runs[2][2];
    for (int i = 0; i < 2; i++)
        long_context_at(i + 1, l[i], runs[i]);
    cr_assert_eq(runs[1][1] - runs[1][0], 4ull * LONG_STEPS,
                 "%llu pool runs in %d steps at %d tokens, %llu at %d: not one more in each of the 4 CSA layers",
                 runs[1][1], LONG_STEPS, LONG_PROMPT, runs[1][0], SHORT_PROMPT);
    for (size_t row = 0; row < n / V; row++)
        cr_assert_eq(memcmp(l[0] + row * V, l[1] + row * V, (size_t)V * sizeof(float)), 0,
                     "2 threads: logits row %zu (%s context, %s) differ from 1 thread's", row,
                     row < (size_t)(1 + LONG_STEPS) ? "long" : "short", row % (1 + LONG_STEPS) ? "decode" : "prefill");
    free(l[0]);
    free(l[1]);
}

/* Decode heads two ways, the same bits: with few multiply-adds (or one thread) a token's heads run
 * on the caller in one tiled pass over its keys (pd_dot_gemm, pd_axpy_heads); with many and a
 * second thread, one pool task per head (pd_dot_rows, pd_axpy_rows). v4-tiny with 64 heads of 512
 * (V4-Flash's shape) puts every decode step over the pool's threshold: 1 thread runs the one pass,
 * 2 threads the tasks per head. A sum taken in another order in either fails the comparison. */
static void wide_heads_decode(const char *dir, int threads, float *l, int steps)
{
    struct pd_engine en;
    pd_err e = {0};
    struct pd_engine_opts o = {.dir = dir, .threads = threads, .max_seqs = 1, .max_model_len = 128};
    cr_assert_eq(pd_engine_open(&en, &o, &e), 0, "%s", e.msg);
    const int V = (int)en.model.vocab_size;
    int32_t ids[40], next;
    for (int i = 0; i < 40; i++)
        ids[i] = (int32_t)((i * 53 + 3) % V);
    struct pd_seq s;
    cr_assert_eq(pd_seq_start(&en, &s, &e), 0, "%s", e.msg);
    struct pd_step_item it = {.seq = &s, .tokens = ids, .n = 40, .logits = l};
    cr_assert_eq(pd_engine_step(&en, &it, 1, &e), 0, "%s", e.msg);
    for (int k = 1; k <= steps; k++) {
        next = (int32_t)((k * 31 + 7) % V);
        it = (struct pd_step_item){.seq = &s, .tokens = &next, .n = 1, .logits = l + (size_t)k * V};
        cr_assert_eq(pd_engine_step(&en, &it, 1, &e), 0, "%s", e.msg);
    }
    pd_seq_end(&en, &s);
    pd_engine_close(&en);
}

Test(threads, decode_heads_in_one_pass_equal_them_head_by_head, .timeout = 300)
{
    char preset[] = "/tmp/pdmoe-wide-heads-XXXXXX", dir[64];
    FILE *f = fopen("models/v4-tiny.json", "r");
    cr_assert_not_null(f, "models/v4-tiny.json");
    char text[8192];
    size_t len = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[len] = 0;
    json_error_t je;
    json_t *c = json_loads(text, 0, &je);
    cr_assert_not_null(c, "%s", je.text);
    json_object_set_new(c, "num_attention_heads", json_integer(64));
    json_object_set_new(c, "head_dim", json_integer(512));
    char *out = json_dumps(c, 0);
    json_decref(c);
    tmp_text(preset, out);
    free(out);
    tmp_model(preset, 5, dir, sizeof dir);
    enum { STEPS = 6, V = 512 };
    float *l[2] = {malloc((1 + STEPS) * V * sizeof(float)), malloc((1 + STEPS) * V * sizeof(float))};
    cr_assert(l[0] && l[1]);
    for (int i = 0; i < 2; i++)
        wide_heads_decode(dir, i + 1, l[i], STEPS);
    for (int k = 0; k <= STEPS; k++)
        cr_assert_eq(memcmp(l[0] + (size_t)k * V, l[1] + (size_t)k * V, V * sizeof(float)), 0,
                     "%s %d: 2 threads' logits (heads over the pool, one per task) differ from 1 thread's "
                     "(every head in one pass)", k ? "decode step" : "prefill", k);
    free(l[0]);
    free(l[1]);
    unlink(preset);
    rm_model(dir);
}

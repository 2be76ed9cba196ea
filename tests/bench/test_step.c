/* The engine steps `pdmoe calibrate` times (bench/step.c): a decode point computes its context
 * once and runs every repetition from a copy of that KV, so the copy put back must leave the
 * sequence exactly as the prefill did. On v4-tiny (window 8, CSA ratio 4 with indexer keys, HCA
 * ratio 16, 16 entries per block): after other tokens ran past the context (writing the window
 * ring, the compressor states and entries and keys in blocks past it), decoding from the restored
 * copy gives logits bit-identical (memcmp) to a sequence that prefilled the context itself, for
 * contexts inside a compression block, at a block boundary and past a full HCA block. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench.h"
#include "../tmpmodel.h"

static char dir[64];

static void make_tiny(void)
{
    tmp_model("v4-tiny", 7, dir, sizeof dir);
}

static void remove_tiny(void)
{
    rm_model(dir);
}

TestSuite(bench_step, .init = make_tiny, .fini = remove_tiny);

#define SEQS 2
#define STEPS 24   /* past a CSA block (4 entries) and a new entry block (64 tokens at ratio 4) */

static void open_engine(struct pd_engine *en)
{
    struct pd_engine_opts o = {.dir = dir, .threads = 2, .max_seqs = 2 * SEQS, .max_model_len = 512};
    pd_err e = {0};
    cr_assert_eq(pd_engine_open(en, &o, &e), 0, "%s", e.msg);
}

/* Decodes STEPS tokens of ids (per sequence, after ctx) in SEQS sequences together; the logits of
 * every step in out[step][seq][vocab]. */
static void decode(struct pd_engine *en, struct pd_seq *s, const int32_t *ids, int len, int ctx, float *out)
{
    const int V = (int)en->model.vocab_size;
    pd_err e = {0};
    for (int k = 0; k < STEPS; k++) {
        struct pd_step_item it[SEQS];
        for (int b = 0; b < SEQS; b++)
            it[b] = (struct pd_step_item){.seq = &s[b], .tokens = ids + (size_t)b * len + ctx + k, .n = 1,
                                          .logits = out + ((size_t)k * SEQS + b) * V};
        cr_assert_eq(pd_engine_step(en, it, SEQS, &e), 0, "%s", e.msg);
    }
}

static void prefill(struct pd_engine *en, struct pd_seq *s, const int32_t *ids, int len, int ctx)
{
    pd_err e = {0};
    struct pd_step_item it[SEQS];
    for (int b = 0; b < SEQS; b++) {
        cr_assert_eq(pd_seq_start(en, &s[b], &e), 0, "%s", e.msg);
        it[b] = (struct pd_step_item){.seq = &s[b], .tokens = ids + (size_t)b * len, .n = ctx};
    }
    cr_assert_eq(pd_engine_step(en, it, SEQS, &e), 0, "%s", e.msg);
}

static void restored_copy_decodes_as_a_fresh_prefill(int ctx)
{
    struct pd_engine en;
    open_engine(&en);
    const int V = (int)en.model.vocab_size, len = ctx + STEPS;
    int32_t *ids = malloc((size_t)SEQS * len * sizeof *ids), *junk = malloc((size_t)SEQS * len * sizeof *junk);
    float *ref = malloc((size_t)STEPS * SEQS * V * sizeof(float)), *got = malloc((size_t)STEPS * SEQS * V * sizeof(float));
    cr_assert(ids && junk && ref && got);
    for (int i = 0; i < SEQS * len; i++) {
        ids[i] = (int32_t)((i * 37 + 11) % 500);
        junk[i] = (int32_t)((i * 53 + 7) % 500);
    }
    memcpy(junk, ids, sizeof *ids * (size_t)ctx);   /* the same context, other tokens after it */
    memcpy(junk + len, ids + len, sizeof *ids * (size_t)ctx);
    struct pd_seq f[SEQS], s[SEQS];
    prefill(&en, f, ids, len, ctx);
    decode(&en, f, ids, len, ctx, ref);
    for (int b = 0; b < SEQS; b++)
        pd_seq_end(&en, &f[b]);
    /* the sequences bench/step.c times: the context once, other tokens past it, then the copy */
    pd_err e = {0};
    struct pd_bench_kvcopy c[SEQS];
    prefill(&en, s, ids, len, ctx);
    for (int b = 0; b < SEQS; b++)
        cr_assert_eq(pd_bench_kv_save(&en, &s[b], &c[b], &e), 0, "%s", e.msg);
    decode(&en, s, junk, len, ctx, got);
    cr_assert_neq(memcmp(got, ref, (size_t)STEPS * SEQS * V * sizeof(float)), 0, "the other tokens changed nothing");
    for (int round = 0; round < 2; round++) {
        for (int b = 0; b < SEQS; b++) {
            pd_bench_kv_restore(&en, &s[b], &c[b]);
            cr_assert_eq(s[b].pos, ctx);
        }
        decode(&en, s, ids, len, ctx, got);
        for (int k = 0; k < STEPS; k++)
            for (int b = 0; b < SEQS; b++)
                cr_assert_eq(memcmp(got + ((size_t)k * SEQS + b) * V, ref + ((size_t)k * SEQS + b) * V, (size_t)V * sizeof(float)),
                             0, "context %d, round %d: sequence %d's step %d differs from a fresh prefill's", ctx, round, b, k);
    }
    for (int b = 0; b < SEQS; b++) {
        pd_bench_kv_free(&c[b]);
        pd_seq_end(&en, &s[b]);
    }
    cr_assert_eq(en.kv.n_blocks_free, en.kv.n_blocks);
    free(ids);
    free(junk);
    free(ref);
    free(got);
    pd_engine_close(&en);
}

Test(bench_step, a_restored_context_decodes_as_a_fresh_prefill)
{
    restored_copy_decodes_as_a_fresh_prefill(61);    /* inside a CSA block, past the window */
    restored_copy_decodes_as_a_fresh_prefill(64);    /* at a CSA entry block's boundary */
    restored_copy_decodes_as_a_fresh_prefill(300);   /* past a full HCA block */
}

/* The timing itself: a time per step, and every sequence and block back in the pool, for a
 * decode point and a prefill point. */
Test(bench_step, step_time_leaves_the_pool_empty)
{
    struct pd_engine en;
    open_engine(&en);
    pd_err e = {0};
    double t = 0;
    cr_assert_eq(pd_bench_step_time(&en, SEQS, 1, 100, 4, NULL, 0, 2, &t, &e), 0, "%s", e.msg);
    cr_assert(t > 0 && t < 10, "decode step %g s", t);
    cr_assert_eq(en.kv.live_seqs, 0);
    cr_assert_eq(en.kv.n_blocks_free, en.kv.n_blocks);
    cr_assert_eq(pd_bench_step_time(&en, 1, 32, 0, 1, NULL, 0, 2, &t, &e), 0, "%s", e.msg);
    cr_assert(t > 0 && t < 10, "prefill step %g s", t);
    cr_assert_eq(en.kv.live_seqs, 0);
    cr_assert_eq(en.kv.n_blocks_free, en.kv.n_blocks);
    pd_engine_close(&en);
}

/* The step bound `bench decode` and `bench prefill` share (bench/bound.c): its parts agree with
 * each other on ceilings given here (no probe, nothing timed), and the routing it is fed is the
 * engine's: a prefill of T tokens on models/mini runs T x top-k pairs in every layer. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/bound.h"
#include "engine/engine.h"

static struct pd_engine en;
static int opened;

static void open_mini(void)
{
    if (access("models/mini/model.safetensors", R_OK) != 0)
        cr_skip_test("models/mini not generated");
    struct pd_engine_opts o = {.dir = "models/mini", .threads = 1, .max_seqs = 1, .max_model_len = 64};
    pd_err e = {0};
    cr_assert_eq(pd_engine_open(&en, &o, &e), 0, "%s", e.msg);
    opened = 1;
}

static void close_mini(void)
{
    if (opened)
        pd_engine_close(&en);
    opened = 0;
}

static int near(double a, double b)
{
    return fabs(a - b) <= 1e-9 * fmax(fabs(a), fabs(b));
}

Test(bench_bound, its_parts_agree, .init = open_mini, .fini = close_mini)
{
    const double T = 40, heads = 1, experts = 200, pairs = 40 * 6 * 8;
    struct pd_bench_bound b, bw_only, ops_only, twice, none;
    const struct pd_bench_ceilings c = {20e9, 100e9, 150e9};
    pd_bench_step_bound(&en, T, heads, experts, pairs, &c, &b);
    cr_assert_gt(b.dense_bytes, 0);
    cr_assert_gt(b.expert_bytes, 0);
    cr_assert_gt(b.int8_ops, 0);
    cr_assert(near(b.bytes, b.dense_bytes + b.expert_bytes));
    cr_assert(near(b.bw_s, b.bytes / c.bw));
    cr_assert(near(b.bound_s, b.dense_s + b.expert_s));
    /* without peaks, arithmetic is left out: the bandwidth roofline exactly */
    pd_bench_step_bound(&en, T, heads, experts, pairs, &(struct pd_bench_ceilings){c.bw, 0, 0}, &bw_only);
    cr_assert(near(bw_only.bound_s, b.bw_s), "%g s against %g s", bw_only.bound_s, b.bw_s);
    cr_assert(near(bw_only.int8_ops, b.int8_ops), "the work does not depend on the ceilings");
    /* with memory free and no float peak, the int8 products alone: int8_ops at the int8 peak */
    pd_bench_step_bound(&en, T, heads, experts, pairs, &(struct pd_bench_ceilings){1e300, 0, c.int8}, &ops_only);
    cr_assert(near(ops_only.bound_s, b.int8_ops / c.int8), "%g s against %g s", ops_only.bound_s, b.int8_ops / c.int8);
    /* each matrix its own max(memory, arithmetic): at least either alone, at most both */
    cr_assert_geq(b.bound_s, b.bw_s);
    cr_assert_geq(b.bound_s, ops_only.bound_s);
    struct pd_bench_bound all_ops;
    pd_bench_step_bound(&en, T, heads, experts, pairs, &(struct pd_bench_ceilings){1e300, c.fp32, c.int8}, &all_ops);
    cr_assert_leq(b.bound_s, b.bw_s + all_ops.bound_s * (1 + 1e-12));
    /* and not their sum: memory and arithmetic overlap within a matrix (every matrix has both
     * here), in the dense part and in the routed experts' */
    cr_assert_lt(b.dense_s, bw_only.dense_s + all_ops.dense_s - 1e-9 * b.dense_s, "%g s: the sum of %g and %g s", b.dense_s,
                 bw_only.dense_s, all_ops.dense_s);
    cr_assert_lt(b.expert_s, bw_only.expert_s + all_ops.expert_s - 1e-9 * b.expert_s, "%g s: the sum of %g and %g s",
                 b.expert_s, bw_only.expert_s, all_ops.expert_s);
    /* the routed experts' products: 2 ops per parameter per (token, expert) pair */
    const struct pd_expert_w *x = &en.w.layers[0].experts[0];
    const double xp = (double)x->w1.out * x->w1.in + (double)x->w2.out * x->w2.in + (double)x->w3.out * x->w3.in;
    cr_assert(x->w1.q.q && x->w2.q.q && x->w3.q.q, "models/mini's routed experts are int8");
    struct pd_bench_bound no_pairs;
    pd_bench_step_bound(&en, T, heads, experts, 0, &c, &no_pairs);
    cr_assert(near(b.int8_ops - no_pairs.int8_ops, 2 * pairs * xp), "%g ops for %g pairs of %g parameters",
              b.int8_ops - no_pairs.int8_ops, pairs, xp);
    /* the work is linear in the rows: twice the tokens, heads and pairs, twice the ops */
    pd_bench_step_bound(&en, 2 * T, 2 * heads, experts, 2 * pairs, &c, &twice);
    cr_assert(near(twice.int8_ops, 2 * b.int8_ops), "%g against 2 x %g", twice.int8_ops, b.int8_ops);
    cr_assert(near(twice.bytes, b.bytes), "the bytes read do not depend on the tokens");
    pd_bench_step_bound(&en, 0, 0, 0, 0, &c, &none);
    cr_assert_eq(none.int8_ops, 0);
    cr_assert_eq(none.expert_bytes, 0);
    /* a prefill's head runs one row, a decode step's every token: 40 rows through lm_head (the
     * largest matrix of the mini model, bf16 or int8) cost more than its bytes' read time */
    struct pd_bench_bound all_heads;
    pd_bench_step_bound(&en, T, T, experts, pairs, &c, &all_heads);
    cr_assert_geq(all_heads.int8_ops, b.int8_ops);
    cr_assert_gt(all_heads.bound_s, b.bound_s);
}

Test(bench_bound, routing_is_the_engines, .init = open_mini, .fini = close_mini)
{
    const int T = 24, L = en.model.n_layers, E = (int)en.model.n_routed_experts, K = en.model.n_experts_per_tok;
    int64_t *before = malloc((size_t)L * E * sizeof *before);
    int32_t ids[24];
    float *logits = malloc((size_t)en.model.vocab_size * sizeof *logits);
    cr_assert(before && logits);
    for (int i = 0; i < T; i++)
        ids[i] = (i * 131 + 7) % 1000;
    memcpy(before, en.expert_tokens, (size_t)L * E * sizeof *before);
    struct pd_seq s;
    pd_err e = {0};
    cr_assert_eq(pd_seq_start(&en, &s, &e), 0, "%s", e.msg);
    struct pd_step_item it = {.seq = &s, .tokens = ids, .n = T, .logits = logits};
    cr_assert_eq(pd_engine_step(&en, &it, 1, &e), 0, "%s", e.msg);
    pd_seq_end(&en, &s);
    double experts, pairs;
    pd_bench_routed_since(&en, before, &experts, &pairs);
    cr_assert_eq(pairs, (double)T * K * L, "%g pairs, not %d x %d x %d", pairs, T, K, L);
    /* every layer reads at least top-k experts, at most one per pair or all it has */
    cr_assert(experts >= (double)K * L && experts <= fmin(pairs, (double)E * L), "%g experts", experts);
    free(before);
    free(logits);
}

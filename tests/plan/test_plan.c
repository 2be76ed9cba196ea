/* Whole plans: the default (the seed's deployment on the real V4-Flash config), budgets that
 * add up, the JSON document, and bad layouts. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan/plan.h"
#include "fixture.h"


Test(plan, default_is_the_seed_layout)
{
    struct pd_plan_opts o;
    struct pd_plan p;
    pd_plan_opts_default(&o);
    build(&o, &p);
    cr_assert_str_eq(p.model.name, "deepseek-v4-flash");
    cr_assert_eq(p.cards_total, 64);
    cr_assert_eq(p.cards_used, 64);
    const struct pd_role_plan *P = &p.role[PD_ROLE_PREFILL], *D = &p.role[PD_ROLE_DECODE];
    cr_assert_eq(P->ep, 8);
    cr_assert_eq(P->place.slots, 32);
    cr_assert_eq(D->ep, 32);
    cr_assert_eq(D->place.slots, 8);
    /* 64 GiB x 0.9 */
    cr_assert_eq(P->b.usable, (int64_t)(68719476736.0 * 0.9));
    /* class I: 32 (8) experts x 44 MoE layers (MTP included) x one expert's w8a8 bytes */
    int64_t one = 3 * 2048 * 4096 + 4 * (2048 + 2048 + 4096);
    cr_assert_eq(P->b.class_i, 32 * 44 * one);
    cr_assert_eq(D->b.class_i, 8 * 44 * one);
    cr_assert_eq(P->b.class_ii, p.inv.class_bytes[PD_CLASS_II]);
    for (int r = 0; r < 2; r++) {
        const struct pd_budget *b = &p.role[r].b;
        cr_assert_eq(b->weights + b->activations + b->runtime + b->kv_pool, b->usable);
        cr_assert(p.role[r].fits);
    }
    /* each with its steps in flight: 2 x (1 + 1) + 1 tokens, 4 block ids more than one (tests/cli/test_chunks.c) */
    cr_assert_eq(D->b.kv_decode_seq, 4 * p.kv.block_id_bytes);
    cr_assert_eq(D->kv_need, 30 * (pd_kv_seq_bytes(&p.kv, 32768) + 4 * p.kv.block_id_bytes));
    cr_assert_geq(D->seqs_at_max_len, 30);
    pd_plan_free(&p);
}

Test(plan, json_document)
{
    struct pd_plan_opts o;
    struct pd_plan p;
    pd_plan_opts_default(&o);
    o.sweep = 1;
    build(&o, &p);
    char *s = pd_plan_json(&p, NULL);
    cr_assert_not_null(s);
    json_error_t je;
    json_t *root = json_loads(s, 0, &je);
    cr_assert_not_null(root, "%s", je.text);
    cr_assert_eq(json_integer_value(json_object_get(root, "plan_version")), 1);
    json_t *roles = json_object_get(root, "roles");
    cr_assert_eq(json_array_size(roles), 2);
    json_t *dec = json_array_get(roles, 1);
    cr_assert_str_eq(json_string_value(json_object_get(dec, "role")), "decode");
    cr_assert_eq(json_integer_value(json_object_get(dec, "experts_per_card")), 8);
    json_t *last = json_array_get(json_object_get(dec, "expert_placement"), 31);
    cr_assert_eq(json_array_size(last), 8);
    for (int i = 0; i < 8; i++)
        cr_assert_eq(json_integer_value(json_array_get(last, (size_t)i)), 248 + i);
    json_t *budget = json_object_get(dec, "budget");
    cr_assert_eq(json_integer_value(json_object_get(budget, "class_i_bytes")), p.role[1].b.class_i);
    cr_assert_eq(json_integer_value(json_object_get(budget, "kv_pool_bytes")), p.role[1].b.kv_pool);
    cr_assert(json_is_true(json_object_get(budget, "fits")));
    cr_assert_eq(json_array_size(json_object_get(root, "sweep")), (size_t)p.n_sweep);
    cr_assert_eq(json_array_size(json_object_get(root, "handoff")), 2);
    json_decref(root);
    free(s);
    pd_plan_free(&p);
}

static void expect_fail(struct pd_plan_opts *o, const char *needle)
{
    struct pd_plan p;
    pd_err e = {0};
    cr_assert_neq(pd_plan_build(o, &p, &e), 0, "accepted a bad plan (wanted \"%s\")", needle);
    cr_assert(strstr(e.msg, needle), "message \"%s\" lacks \"%s\"", e.msg, needle);
}

Test(plan, bad_layouts)
{
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.role[PD_ROLE_DECODE].instances = 2;
    expect_fail(&o, "layout needs 96 cards (prefill 4 x 8, decode 2 x 32) but the cluster has 64 (8 nodes x 8 cards");
    pd_plan_opts_default(&o);
    o.util = 0;
    expect_fail(&o, "--gpu-memory-utilization 0: must be in (0, 1]");
    o.util = 1.5;
    expect_fail(&o, "--gpu-memory-utilization 1.5");
    pd_plan_opts_default(&o);
    o.role[PD_ROLE_PREFILL].dp = 0;
    expect_fail(&o, "--prefill dp=0");
    pd_plan_opts_default(&o);
    o.role[PD_ROLE_PREFILL].dp = 6;
    o.role[PD_ROLE_PREFILL].instances = 5;
    expect_fail(&o, "--prefill: placement: 256 routed experts do not divide evenly over an EP group of 6 ranks");
    pd_plan_opts_default(&o);
    o.max_model_len = 0;
    expect_fail(&o, "--max-model-len 0");
    pd_plan_opts_default(&o);
    o.model = "models/nope.json";
    expect_fail(&o, "models/nope.json");
    pd_plan_opts_default(&o);
    o.hardware = "tpu-v9";
    expect_fail(&o, "--hardware tpu-v9: no such file or preset");
    pd_plan_opts_default(&o);
    o.quant = "int2";
    expect_fail(&o, "--quant int2");
}

Test(plan, redundancy_and_tp)
{
    struct pd_plan_opts o;
    struct pd_plan p;
    pd_plan_opts_default(&o);
    o.role[PD_ROLE_PREFILL] = (struct pd_role_opts){.dp = 6, .tp = 1, .instances = 5, .redundant = 2};
    o.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 16, .tp = 2, .instances = 1};
    build(&o, &p);
    cr_assert_eq(p.role[0].place.slots, 43);
    cr_assert_eq(p.role[1].ep, 32);
    cr_assert_eq(p.role[1].cards, 32);
    /* tp = 2 halves the attention, shared expert, embedding and head on a card */
    cr_assert_lt(p.role[1].b.class_ii, p.inv.class_bytes[PD_CLASS_II]);
    cr_assert_gt(p.role[1].b.class_ii, p.inv.class_bytes[PD_CLASS_II] / 2);
    pd_plan_free(&p);
}

Test(plan, units_in_text)
{
    struct pd_plan_opts o;
    struct pd_plan p;
    pd_plan_opts_default(&o);
    build(&o, &p);
    char *gb = pd_plan_text(&p, 0), *gib = pd_plan_text(&p, 1);
    cr_assert(strstr(gb, "GB = 10^9 bytes"));
    cr_assert(strstr(gb, "68.72 GB x 0.90 = 61.85 GB usable"), "%s", gb);
    cr_assert(strstr(gib, "GiB = 2^30 bytes"));
    cr_assert(strstr(gib, "64.00 GiB x 0.90 = 57.60 GiB usable"), "%s", gib);
    free(gb);
    free(gib);
    pd_plan_free(&p);
}

/* V4-Flash W4A8 runs on one node of 8 x Ascend 910B4 32 GB (Alauda AI's inference guide: one
 * instance, TP8 + expert parallelism, vLLM-Ascend): the planner agrees that its weights fit eight
 * 32 GiB cards with room for KV, and that W8A8's do not. */
Test(plan, w4a8_fits_eight_910b4)
{
    struct pd_hardware hw;
    pd_err e = {0};
    cr_assert_eq(pd_hardware_load("atlas-800i-a2", &hw, &e), 0, "%s", e.msg);
    snprintf(hw.card_name, sizeof hw.card_name, "Ascend 910B4 32 GB");
    hw.card_memory_bytes = INT64_C(32) << 30;   /* npu-smi: 32768 MB */
    const char *quant[2] = {"w4a8", "w8a8"};
    for (int i = 0; i < 2; i++) {
        struct pd_plan_opts o;
        struct pd_plan p;
        pd_plan_opts_default(&o);
        o.hw = &hw;
        o.nodes = 2;
        o.quant = quant[i];
        o.max_model_len = 32768;
        o.max_num_seqs = 4;
        o.role[PD_ROLE_PREFILL] = (struct pd_role_opts){.dp = 1, .tp = 8, .instances = 1};
        o.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 1, .tp = 8, .instances = 1};
        build(&o, &p);
        const struct pd_role_plan *d = &p.role[PD_ROLE_DECODE];
        if (i == 0) {
            cr_assert(d->b.fits_weights && d->fits, "w4a8: weights %lld, usable %lld", (long long)d->b.weights,
                      (long long)d->b.usable);
            cr_assert_gt(d->b.kv_pool, 0);
        } else {
            cr_assert_not(d->b.fits_weights, "w8a8: weights %lld, usable %lld", (long long)d->b.weights,
                          (long long)d->b.usable);
        }
        pd_plan_free(&p);
    }
}

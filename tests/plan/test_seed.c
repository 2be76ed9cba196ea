/* Pins every pdmoe value that docs/seed-reproduction.md quotes: if one changes, the document
 * must change with it. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "core/units.h"
#include "plan/plan.h"

static const char *gb(int64_t bytes)
{
    static char buf[8][32];
    static int i;
    i = (i + 1) % 8;
    return pd_units_fmt_g(buf[i], sizeof buf[i], bytes, PD_UNITS_GB, 2);
}

static void plan(const char *model, int sweep, struct pd_plan *p)
{
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.model = model;
    o.sweep = sweep;
    pd_err e = {0};
    cr_assert_eq(pd_plan_build(&o, p, &e), 0, "%s", e.msg);
}

static const struct pd_sweep_row *row(const struct pd_plan *p, enum pd_role r, int dp)
{
    for (int i = 0; i < p->n_sweep; i++)
        if (p->sweep[i].role == r && p->sweep[i].dp == dp)
            return &p->sweep[i];
    cr_assert_fail("no sweep row %d", dp);
    return NULL;
}

Test(seed, article_model_weights)
{
    struct pd_plan p;
    plan("seed-v4-flash", 1, &p);
    const struct pd_inventory *v = &p.inv;
    cr_assert_eq(v->class_params[PD_CLASS_I], INT64_C(277025390592));
    cr_assert_str_eq(gb(v->group_bytes[PD_G_ROUTED_EXPERTS][PD_CLASS_I]), "277.39 GB");
    cr_assert_eq(v->group_params[PD_G_ATTENTION][PD_CLASS_II] / 43, 73664064);
    cr_assert_str_eq(gb(v->group_bytes[PD_G_ATTENTION][PD_CLASS_II]), "3.18 GB");
    cr_assert_str_eq(gb(v->group_bytes[PD_G_EMBEDDING][PD_CLASS_II]), "0.53 GB");
    cr_assert_str_eq(gb(v->group_bytes[PD_G_LM_HEAD][PD_CLASS_II]), "0.53 GB");
    cr_assert_str_eq(gb(v->group_bytes[PD_G_SHARED_EXPERT][PD_CLASS_II]), "1.08 GB");
    cr_assert_str_eq(gb(v->group_bytes[PD_G_ROUTER][PD_CLASS_II]), "0.05 GB");
    cr_assert_str_eq(gb(v->group_bytes[PD_G_NORMS_MHC][PD_CLASS_II]), "0.14 GB");
    cr_assert_str_eq(gb(v->class_bytes[PD_CLASS_II]), "5.50 GB");
    cr_assert_str_eq(gb(v->class_bytes[0] + v->class_bytes[1]), "282.89 GB");
    cr_assert_eq(v->class_params[0] + v->class_params[1], INT64_C(282413478103));
    /* the "why" column: scales add 0.36 GB to the experts; the router's bias is 44 kB; mHC's
     * mixing matrices alone are 33.8 M parameters */
    cr_assert_str_eq(gb(v->group_bytes[PD_G_ROUTED_EXPERTS][PD_CLASS_I] - v->class_params[PD_CLASS_I]), "0.36 GB");
    cr_assert_eq(43 * 256 * 4, 44032);
    cr_assert_eq(v->group_bytes[PD_G_ROUTER][PD_CLASS_II] - 43 * (256 * 4096 + 4 * 256), 43 * 256 * 4);
    int64_t fn = 0;
    for (int i = 0; i < v->n; i++)
        if (strstr(v->t[i].name, "hc_attn_fn") || strstr(v->t[i].name, "hc_ffn_fn"))
            fn += v->t[i].params;
    cr_assert_eq(fn, INT64_C(43) * 2 * 24 * 16384);
    char m[16];
    snprintf(m, sizeof m, "%.1f", fn / 1e6);
    cr_assert_str_eq(m, "33.8");
    pd_plan_free(&p);
}

Test(seed, article_model_cards_and_budgets)
{
    struct pd_plan p;
    plan("seed-v4-flash", 1, &p);
    const struct pd_role_plan *P = &p.role[PD_ROLE_PREFILL], *D = &p.role[PD_ROLE_DECODE];
    cr_assert_eq(P->place.slots, 32);
    cr_assert_eq(D->place.slots, 8);
    cr_assert_str_eq(gb(P->b.class_i), "34.67 GB");
    cr_assert_str_eq(gb(D->b.class_i), "8.67 GB");
    cr_assert_str_eq(gb(P->b.weights), "40.17 GB");
    cr_assert_str_eq(gb(D->b.weights), "14.17 GB");
    char r[16];
    snprintf(r, sizeof r, "%.2f", (double)P->b.weights / (double)D->b.weights);
    cr_assert_str_eq(r, "2.84");
    cr_assert_str_eq(gb(P->b.usable), "61.85 GB");
    cr_assert_str_eq(pd_units_fmt_g(r, sizeof r, P->b.usable, PD_UNITS_GIB, 2), "57.60 GiB");
    cr_assert_str_eq(gb(P->b.usable - P->b.weights), "21.67 GB");
    cr_assert_str_eq(gb(D->b.usable - D->b.weights), "47.68 GB");
    cr_assert_eq(p.p_kv_batch, 180224000);
    cr_assert_str_eq(gb(P->b.activations), "1.42 GB");
    int64_t p_total = P->b.weights + p.p_kv_batch + P->b.activations + P->b.runtime;
    cr_assert_str_eq(gb(p_total), "43.28 GB");
    cr_assert_str_eq(gb(P->b.usable - p_total), "18.57 GB");
    cr_assert_str_eq(gb(D->b.activations), "0.03 GB");
    cr_assert_str_eq(gb(P->kv_need), "1.44 GB");
    cr_assert_eq(P->seqs_at_max_len, 13);
    cr_assert_eq(D->seqs_at_max_len, 31);
    cr_assert_eq(D->ctx_at_max_seqs, 34585);
    /* decode scenarios: 30 x 16K, 30 x 32K, 30 x 64K, 15 x 64K */
    const char *kv[] = {"21.63 GB", "43.25 GB", "86.51 GB", "43.25 GB"};
    const int fits[] = {1, 1, 0, 1};
    for (int i = 0; i < 4; i++) {
        cr_assert_str_eq(gb(p.scen[i].kv), kv[i]);
        cr_assert_eq(p.scen[i].fits, fits[i]);
    }
    cr_assert_str_eq(gb(p.scen[0].total), "37.82 GB");
    cr_assert_str_eq(gb(p.scen[1].total), "59.45 GB");
    cr_assert_eq((int)(100.0 * (double)p.scen[0].total / (double)D->b.usable + 0.5), 61);
    cr_assert_eq((int)(100.0 * (double)p.scen[1].total / (double)D->b.usable + 0.5), 96);
    /* hand-off */
    cr_assert_eq(p.handoff[0].bytes, 352000000);
    cr_assert_float_eq(p.handoff[0].rdma_s * 1e3, 20.6, 0.05);
    cr_assert_str_eq(gb(p.handoff[1].bytes), "5.77 GB");
    cr_assert_float_eq(p.handoff[1].rdma_s * 1e3, 321.4, 0.05);
    /* decision tree */
    cr_assert_str_eq(gb(row(&p, PD_ROLE_PREFILL, 4)->weights), "74.85 GB");
    cr_assert_eq(row(&p, PD_ROLE_PREFILL, 4)->verdict, PD_V_WEIGHTS_DONT_FIT);
    cr_assert(row(&p, PD_ROLE_PREFILL, 8)->chosen);
    cr_assert_str_eq(gb(row(&p, PD_ROLE_PREFILL, 16)->weights), "22.84 GB");
    cr_assert_eq(row(&p, PD_ROLE_PREFILL, 16)->instances, 2);
    cr_assert_str_eq(gb(row(&p, PD_ROLE_DECODE, 16)->kv_pool), "36.98 GB");
    cr_assert_eq(row(&p, PD_ROLE_DECODE, 16)->verdict, PD_V_KV_SHORT);
    cr_assert(row(&p, PD_ROLE_DECODE, 32)->chosen);
    cr_assert_str_eq(gb(row(&p, PD_ROLE_DECODE, 32)->kv_pool), "45.65 GB");
    pd_plan_free(&p);
}

Test(seed, released_model)
{
    struct pd_plan p;
    plan("deepseek-v4-flash", 1, &p);
    const struct pd_role_plan *P = &p.role[PD_ROLE_PREFILL], *D = &p.role[PD_ROLE_DECODE];
    cr_assert_str_eq(gb(p.inv.class_bytes[PD_CLASS_II]), "10.78 GB");
    cr_assert_str_eq(gb(p.inv.group_bytes[PD_G_ATTENTION][PD_CLASS_II]), "6.32 GB");
    cr_assert_str_eq(gb(p.inv.group_bytes[PD_G_COMPRESSOR][PD_CLASS_II]), "0.80 GB");
    cr_assert_str_eq(gb(p.inv.group_bytes[PD_G_MTP][PD_CLASS_II]), "0.21 GB");
    cr_assert_str_eq(gb(p.inv.group_bytes[PD_G_EMBEDDING][PD_CLASS_II] + p.inv.group_bytes[PD_G_LM_HEAD][PD_CLASS_II]),
                     "2.12 GB");
    cr_assert_eq(p.kv.dtype, PD_KV_BF16);   /* as vllm-ascend stores V4's cache on 910B */
    cr_assert_eq(p.kv.layout, PD_KV_LAYOUT_VLLM_ASCEND);   /* and lays it out (kvsize.h) */
    /* a block id: 23 layer tuples x (16,640 + 131,072) = 3,397,376 B; per 512 tokens (CSA) and per
     * 16,384 (HCA) */
    cr_assert_float_eq(p.kv.per_token_kind[PD_KV_CSA], 3397376 / 512.0, 1e-9);
    cr_assert_float_eq(p.kv.per_token_kind[PD_KV_HCA], 3397376 / 16384.0, 1e-9);
    cr_assert_str_eq(gb(P->b.class_i), "35.48 GB");
    cr_assert_str_eq(gb(P->b.weights), "46.26 GB");
    cr_assert_str_eq(gb(D->b.weights), "19.65 GB");
    cr_assert_float_eq(p.kv.per_token, 6842.859375, 1e-9);
    cr_assert_str_eq(pd_units_fmt(( char[32]){0}, 32, p.kv.per_seq_fixed, PD_UNITS_GB), "37.37 MB");
    /* one prompt, 77 blocks, and the window and state blocks of its chunks in flight (test_plan.c,
     * plan/seed_prefill_reserves_chunks_in_flight: 1,408 more) */
    cr_assert_eq(pd_kv_seq_bytes(&p.kv, 32768), 77 * INT64_C(3397376));
    cr_assert_str_eq(pd_units_fmt(( char[32]){0}, 32, pd_kv_seq_bytes(&p.kv, 32768), PD_UNITS_GB), "261.60 MB");
    cr_assert_eq(P->kv_need, (77 + 1408) * INT64_C(3397376));
    cr_assert_str_eq(gb(P->kv_need), "5.05 GB");
    cr_assert_eq(P->seqs_at_max_len, 29);
    /* 30 decoding sequences, each with 4 ids more for its steps in flight (MTP draft, lookahead,
     * async scheduling: tests/cli/test_chunks.c) */
    cr_assert_eq(D->kv_need, 30 * (77 + 4) * INT64_C(3397376));
    cr_assert_str_eq(gb(D->kv_need), "8.26 GB");
    cr_assert_eq(D->seqs_at_max_len, 145);
    cr_assert_eq(D->ctx_at_max_seqs, 187392);
    cr_assert_str_eq(pd_units_fmt(( char[32]){0}, 32, p.handoff[0].bytes, PD_UNITS_GB), "95.13 MB");
    cr_assert_float_eq(p.handoff[0].rdma_s * 1e3, 6.3, 0.05);
    cr_assert_str_eq(pd_units_fmt(( char[32]){0}, 32, p.handoff[1].bytes, PD_UNITS_GB), "934.28 MB");
    cr_assert_float_eq(p.handoff[1].rdma_s * 1e3, 52.9, 0.05);
    cr_assert(row(&p, PD_ROLE_DECODE, 8)->chosen);
    cr_assert_str_eq(gb(row(&p, PD_ROLE_DECODE, 8)->kv_pool), "13.54 GB");
    pd_plan_free(&p);
    /* the released formats: fp8 with fp4 routed experts */
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.quant = "fp8";
    o.quant_override = "routed_experts=fp4";
    pd_err e = {0};
    cr_assert_eq(pd_plan_build(&o, &p, &e), 0, "%s", e.msg);
    cr_assert_str_eq(gb(p.inv.class_bytes[0] + p.inv.class_bytes[1]), "159.61 GB");
    pd_plan_free(&p);
}

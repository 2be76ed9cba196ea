/* The weight inventory against figures checked by hand and against the released checkpoint's
 * own tensor census. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "plan/inventory.h"

static void build(const char *model, const char *scheme, const char *ovr, int mtp, struct pd_model *m,
                  struct pd_inventory *inv)
{
    struct pd_quant q;
    pd_err e = {0};
    cr_assert_eq(pd_model_load(model, m, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_quant_init(&q, scheme, ovr, m->ckpt_scale_ue8m0, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_inventory_build(m, &q, mtp, inv, &e), 0, "%s", e.msg);
}

Test(inventory, v4_flash_parameter_counts)
{
    struct pd_model m;
    struct pd_inventory inv;
    build("deepseek-v4-flash", "w8a8", NULL, 0, &m, &inv);
    /* 256 experts x 43 layers x 3 x 2048 x 4096 */
    cr_assert_eq(inv.class_params[PD_CLASS_I], INT64_C(277025390592));
    /* everything else, computed independently from the config (hand-checked): 7,309,176,919;
     * total 284.3 B, the published "284B" */
    cr_assert_eq(inv.class_params[PD_CLASS_II], INT64_C(7309176919));
    cr_assert_eq(inv.n_moe_layers, 43);
    /* one expert in one layer under w8a8: 3 matrices + per-row fp32 scales */
    int64_t one = 3 * 2048 * 4096 + 4 * (2048 + 2048 + 4096);
    cr_assert_eq(inv.expert_bytes[0], 43 * one);
    cr_assert_eq(inv.expert_bytes[255], 43 * one);
    /* W8A8 keeps the embedding and head in bf16 */
    cr_assert_eq(inv.group_bytes[PD_G_EMBEDDING][PD_CLASS_II], INT64_C(2) * 129280 * 4096);
    pd_inventory_free(&inv);
}

Test(inventory, mtp_layer_matches_the_released_shard)
{
    /* The released MTP shard holds 1,575 tensors: 797 weights and 778 scales (every FP8/FP4
     * matrix has a .scale). Under the released formats (fp8, routed experts fp4) the inventory
     * of the MTP layer must have the same census and the same shapes. */
    struct pd_model m;
    struct pd_inventory inv;
    build("deepseek-v4-flash", "fp8", "routed_experts=fp4", 1, &m, &inv);
    int weights = 0, scaled = 0;
    int64_t e_w2 = -1, wq_b = -1;
    for (int i = 0; i < inv.n; i++) {
        const struct pd_tensor *t = &inv.t[i];
        if (t->layer != 43)
            continue;
        weights += t->count;
        if (t->fmt == PD_FMT_FP8 || t->fmt == PD_FMT_FP4)
            scaled += t->count;
        if (strcmp(t->name, "mtp.0.ffn.experts.{e}.w2.weight") == 0) {
            cr_assert_eq(t->shape[0], 4096);
            cr_assert_eq(t->shape[1], 2048);
            e_w2 = t->bytes;
        }
        if (strcmp(t->name, "mtp.0.attn.wq_b.weight") == 0)
            wq_b = t->bytes;
    }
    cr_assert_eq(weights, 797);
    cr_assert_eq(scaled, 778);
    cr_assert_eq(weights + scaled, 1575);
    /* I8 [4096, 1024] + F8_E8M0 [4096, 64] */
    cr_assert_eq(e_w2, 4096 * 1024 + 4096 * 64);
    /* F8_E4M3 [32768, 1024] + F8_E8M0 [256, 8] */
    cr_assert_eq(wq_b, 32768 * 1024 + 256 * 8);
    pd_inventory_free(&inv);
}

Test(inventory, expand_and_classify_names)
{
    struct pd_model m;
    struct pd_inventory inv;
    build("v4-tiny", "w8a8", NULL, 1, &m, &inv);
    char buf[128];
    int found = 0;
    for (int i = 0; i < inv.n; i++) {
        const struct pd_tensor *t = &inv.t[i];
        for (int k = 0; k < t->count; k++) {
            enum pd_group g;
            enum pd_class c;
            int layer, expert;
            pd_inventory_expand_name(t, k, buf, sizeof buf);
            /* the classifier of checkpoint names agrees with the builder on every tensor */
            cr_assert_eq(pd_inventory_classify(&m, buf, &g, &c, &layer, &expert), 0, "%s", buf);
            cr_assert_eq(g, t->group, "%s: group %d vs %d", buf, g, t->group);
            cr_assert_eq(c, t->cls, "%s", buf);
            cr_assert_eq(layer, t->layer, "%s", buf);
            if (c == PD_CLASS_I)
                cr_assert_eq(expert, k, "%s", buf);
            found += strcmp(buf, "layers.2.ffn.experts.15.w3.weight") == 0;
        }
    }
    cr_assert_eq(found, 1);
    enum pd_group g;
    enum pd_class c;
    int layer, expert;
    cr_assert_neq(pd_inventory_classify(&m, "layers.1.ffn.experts.16.w1.weight", &g, &c, &layer, &expert), 0);
    cr_assert_neq(pd_inventory_classify(&m, "vision_tower.weight", &g, &c, &layer, &expert), 0);
    cr_assert_neq(pd_inventory_classify(&m, "layers.0.mystery", &g, &c, &layer, &expert), 0);
    pd_inventory_free(&inv);
}

Test(inventory, v3_counts)
{
    struct pd_model m;
    struct pd_inventory inv;
    build("deepseek-v3", "fp8", NULL, 0, &m, &inv);
    /* 58 MoE layers x 256 experts x 3 x 2048 x 7168 */
    cr_assert_eq(inv.class_params[PD_CLASS_I], INT64_C(58) * 256 * 3 * 2048 * 7168);
    cr_assert_eq(inv.n_moe_layers, 58);
    /* DeepSeek-V3: 671 B parameters without the MTP module */
    int64_t total = inv.class_params[0] + inv.class_params[1];
    cr_assert(total > INT64_C(670000000000) && total < INT64_C(672000000000), "%lld", (long long)total);
    pd_inventory_free(&inv);
}

Test(inventory, from_checkpoint_headers)
{
    /* A bf16 checkpoint of v4-tiny written with the inventory's own names: the inventory read
     * back from its headers has the same bytes per group and class, and an extra tensor no
     * rule covers is reported, not counted. */
    struct pd_model m;
    struct pd_inventory inv;
    build("v4-tiny", "bf16", NULL, 0, &m, &inv);
    int n = 0;
    for (int i = 0; i < inv.n; i++)
        n += inv.t[i].count;
    struct pd_st_out *outs = calloc((size_t)n + 1, sizeof *outs);
    char (*names)[128] = calloc((size_t)n + 1, 128);
    static char zeros[1 << 20];
    int k = 0;
    for (int i = 0; i < inv.n; i++)
        for (int x = 0; x < inv.t[i].count; x++, k++) {
            const struct pd_tensor *t = &inv.t[i];
            pd_inventory_expand_name(t, x, names[k], 128);
            outs[k].name = names[k];
            outs[k].dtype = t->fmt == PD_FMT_F32 ? PD_ST_F32 : t->fmt == PD_FMT_I64 ? PD_ST_I64 : PD_ST_BF16;
            outs[k].ndim = t->ndim;
            outs[k].shape[0] = t->shape[0];
            outs[k].shape[1] = t->shape[1];
            cr_assert_lt(t->bytes, (int64_t)sizeof zeros);
            outs[k].data = zeros;
        }
    outs[k] = (struct pd_st_out){.name = "vision_tower.weight", .dtype = PD_ST_F32, .ndim = 1, .shape = {4}, .data = zeros};
    char dir[] = "/tmp/pdmoe-inv-XXXXXX", path[256];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    pd_err e = {0};
    cr_assert_eq(pd_st_write(path, outs, (size_t)n + 1, &e), 0, "%s", e.msg);
    struct pd_st_set set;
    cr_assert_eq(pd_st_open_dir(dir, PD_ST_HEADER_ONLY, &set, &e), 0, "%s", e.msg);
    struct pd_inventory ck;
    cr_assert_eq(pd_inventory_from_checkpoint(&m, &set, &ck, &e), 0, "%s", e.msg);
    for (int g = 0; g < PD_G_COUNT; g++)
        for (int c = 0; c < 2; c++)
            cr_assert_eq(ck.group_bytes[g][c], inv.group_bytes[g][c], "group %s class %d", pd_group_name(g), c);
    for (int x = 0; x < m.n_routed_experts; x++)
        cr_assert_eq(ck.expert_bytes[x], inv.expert_bytes[x]);
    cr_assert_eq(ck.n_moe_layers, inv.n_moe_layers);
    cr_assert_eq(ck.n_unclassed, 1);
    cr_assert_str_eq(ck.unclassed[0], "vision_tower.weight");
    pd_inventory_free(&ck);
    pd_st_close_dir(&set);
    unlink(path);
    rmdir(dir);
    free(outs);
    free(names);
    pd_inventory_free(&inv);
}

/* W4A8 (msModelSlim's per-channel int4 routed experts, the rest W8A8) of V4-Flash with its MTP
 * layer, as vLLM-Ascend's W4A8 rules for V4 write it (quantize_config_pro_w4a8.yaml: the same
 * attention rule as W8A8): every expert matrix is int4 packed two per byte with one fp32 scale per
 * output row, everything else is byte for byte the W8A8 inventory (wq_a, wkv and wo_a bf16), and
 * the whole comes to 152.88 GB. The "about 151 GB" Alauda AI's guide gives for gdydems'
 * DeepSeek-V4-Flash-w4a8-mtp is 1.2% less, which is what quantising wq_a, wkv and wo_a too would
 * make (151.13 GB); that checkpoint's own rules are not published. */
Test(inventory, v4_flash_w4a8_bytes)
{
    struct pd_model m;
    struct pd_inventory w4, w8;
    build("deepseek-v4-flash", "w4a8", NULL, 1, &m, &w4);
    build("deepseek-v4-flash", "w8a8", NULL, 1, &m, &w8);
    /* w1, w3 [2048, 4096]: 2048 x 2048 + 4 x 2048; w2 [4096, 2048]: 4096 x 1024 + 4 x 4096 */
    int64_t one = 2 * (2048 * 2048 + 4 * 2048) + (4096 * 1024 + 4 * 4096);
    cr_assert_eq(w4.n_moe_layers, 44);
    cr_assert_eq(w4.expert_bytes[0], 44 * one);
    cr_assert_eq(w4.class_bytes[PD_CLASS_I], INT64_C(256) * 44 * one);
    cr_assert_eq(w4.class_bytes[PD_CLASS_II], w8.class_bytes[PD_CLASS_II]);
    for (int i = 0; i < w4.n; i++)
        if (w4.t[i].cls == PD_CLASS_I)
            cr_assert_eq(w4.t[i].fmt, PD_FMT_W4A8, "%s", w4.t[i].name);
        else if (w4.t[i].ndim == 2 && w4.t[i].group == PD_G_ATTENTION)
            cr_assert_eq(w4.t[i].fmt, w8.t[i].fmt, "%s", w4.t[i].name);
    int64_t total = w4.class_bytes[PD_CLASS_I] + w4.class_bytes[PD_CLASS_II];
    cr_assert(total > INT64_C(152850000000) && total < INT64_C(152900000000), "%lld bytes", (long long)total);
    pd_inventory_free(&w4);
    pd_inventory_free(&w8);
}

/* DeepSeek-V4-Flash-0731: the V4-Flash layers plus a DSpark draft of three window-only stages
 * (mtp.0-2) with the target-state projection on the first and the Markov and confidence heads on
 * the last, in place of the MTP layer. In the released formats it comes to the "about 166.9 GB"
 * and "304B" parameters of the release: here, part by part against V4-Flash's own inventory. */
Test(inventory, v4_flash_0731_dspark)
{
    struct pd_model m, m0;
    struct pd_inventory d, f;
    build("deepseek-v4-flash-0731", "fp8", "routed_experts=fp4", 1, &m, &d);
    build("deepseek-v4-flash", "fp8", "routed_experts=fp4", 1, &m0, &f);
    cr_assert(m.dspark);
    cr_assert_eq(m.n_mtp_layers, 3);
    cr_assert_eq(m.dspark_markov_rank, 256);
    cr_assert_eq(d.n_moe_layers, 46);
    /* one V4-Flash MTP stage's block: the MTP layer without its e/h projections, norms and head */
    int64_t block = 0, mtp_extra = 0, main_proj = -1, w1 = -1, w2 = -1, conf = -1;
    for (int i = 0; i < f.n; i++) {
        const struct pd_tensor *t = &f.t[i];
        if (t->layer != 43)
            continue;
        int head = strstr(t->name, "e_proj") || strstr(t->name, "h_proj") || strstr(t->name, "enorm") ||
                   strstr(t->name, "hnorm") || strcmp(t->name, "mtp.0.norm.weight") == 0 || strstr(t->name, "hc_head");
        if (head)
            mtp_extra += t->bytes * t->count;
        else
            block += t->bytes * t->count;
    }
    int stages[3] = {0};
    for (int i = 0; i < d.n; i++) {
        const struct pd_tensor *t = &d.t[i];
        cr_assert_null(strstr(t->name, "e_proj"), "%s", t->name);
        if (t->layer >= 43) {
            stages[t->layer - 43]++;
            cr_assert_eq(t->group == PD_G_MTP || t->group == PD_G_ROUTED_EXPERTS, 1, "%s", t->name);
            cr_assert_null(strstr(t->name, "compressor"), "%s: a stage is window-only", t->name);
        }
        if (strcmp(t->name, "mtp.0.main_proj.weight") == 0) {
            cr_assert_eq(t->shape[0], 4096);
            cr_assert_eq(t->shape[1], 3 * 4096);
            main_proj = t->bytes;
        }
        if (strcmp(t->name, "mtp.2.markov_head.markov_w1.weight") == 0)
            w1 = t->bytes;
        if (strcmp(t->name, "mtp.2.markov_head.markov_w2.weight") == 0)
            w2 = t->bytes;
        if (strcmp(t->name, "mtp.2.confidence_head.proj.weight") == 0)
            conf = t->bytes;
    }
    cr_assert(stages[0] > 0 && stages[1] > 0 && stages[2] > 0);
    /* fp8 with one ue8m0 scale per 128 x 128 block */
    cr_assert_eq(main_proj, 4096 * 12288 + 32 * 96);
    cr_assert_eq(w1, INT64_C(2) * 129280 * 256);
    cr_assert_eq(w2, INT64_C(2) * 129280 * 256);
    cr_assert_eq(conf, 2 * (4096 + 256));
    int64_t td = d.class_bytes[0] + d.class_bytes[1], tf = f.class_bytes[0] + f.class_bytes[1];
    /* three blocks for one; main_proj and main_norm; the last stage's norm and hc head are the
     * MTP layer's, which also had e/h projections and norms (2 x fp8 [4096, 4096], 2 x bf16
     * [4096]) the draft has not */
    int64_t eh = 2 * (INT64_C(4096) * 4096 + 32 * 32) + 2 * 2 * 4096;
    cr_assert_gt(mtp_extra, eh);
    cr_assert_eq(td, tf + 2 * block + main_proj + 2 * 4096 - eh + w1 + w2 + conf);
    cr_assert(td > INT64_C(166850000000) && td < INT64_C(166950000000), "%lld bytes", (long long)td);
    int64_t params = d.class_params[0] + d.class_params[1];
    cr_assert(params > INT64_C(303500000000) && params < INT64_C(304500000000), "%lld parameters", (long long)params);
    pd_inventory_free(&d);
    pd_inventory_free(&f);
}

/* The suffix of a V4 tensor name after its "layers.N." / "mtp.N." prefix, or the name. */
static const char *v4_suffix(const char *name)
{
    int n = 0, l;
    if (sscanf(name, "layers.%d.%n", &l, &n) == 1 || sscanf(name, "mtp.%d.%n", &l, &n) == 1)
        return name + n;
    return name;
}

/* Per-tensor formats of V4-Flash (issue 19, point 4). The release (fp8, experts fp4) stores wq_a,
 * wq_b, wkv, wo_a, wo_b, the indexer's wq_b, the shared experts and the MTP projections FP8 (the
 * census of the released MTP shard above; the official convert.py dequantises wo_a to bf16 to run
 * it); the head, router, compressor and the indexer's weights_proj bf16. W8A8 quantises exactly
 * what vLLM-Ascend's DeepSeek-V4 rules do (examples/quantization/deepseek_v4: "*attn*" but wq_a,
 * wkv, wo_a, compressor, indexer projections other than wq_b; "*ffn*" but the gate; e_proj,
 * h_proj): the rest of the release's FP8 matrices become bf16. */
Test(inventory, v4_flash_formats_as_released_and_as_w8a8_deployed)
{
    static const char *const int8[] = {"attn.wq_b.weight", "attn.wo_b.weight", "attn.indexer.wq_b.weight",
                                       "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
                                       "ffn.shared_experts.w3.weight", "ffn.experts.{e}.w1.weight",
                                       "ffn.experts.{e}.w2.weight", "ffn.experts.{e}.w3.weight", "e_proj.weight",
                                       "h_proj.weight"};
    static const char *const fp8_bf16[] = {"attn.wq_a.weight", "attn.wkv.weight", "attn.wo_a.weight"};
    static const char *const bf16[] = {"head.weight", "embed.weight", "ffn.gate.weight", "attn.compressor.wkv.weight",
                                       "attn.compressor.wgate.weight", "attn.indexer.compressor.wkv.weight",
                                       "attn.indexer.compressor.wgate.weight", "attn.indexer.weights_proj.weight"};
    struct pd_model m;
    struct pd_inventory w8, rel;
    build("deepseek-v4-flash", "w8a8", NULL, 1, &m, &w8);
    build("deepseek-v4-flash", "fp8", "routed_experts=fp4", 1, &m, &rel);
    cr_assert_eq(w8.n, rel.n);
    int seen[3] = {0};
    for (int i = 0; i < w8.n; i++) {
        const char *s = v4_suffix(w8.t[i].name);
        if (w8.t[i].ndim != 2)
            continue;
        int kind = -1;
        for (size_t k = 0; k < sizeof int8 / sizeof int8[0]; k++)
            kind = strcmp(s, int8[k]) == 0 ? 0 : kind;
        for (size_t k = 0; k < sizeof fp8_bf16 / sizeof fp8_bf16[0]; k++)
            kind = strcmp(s, fp8_bf16[k]) == 0 ? 1 : kind;
        for (size_t k = 0; k < sizeof bf16 / sizeof bf16[0]; k++)
            kind = strcmp(s, bf16[k]) == 0 ? 2 : kind;
        if (kind < 0)
            continue;   /* mHC, tid2eid, ape: their own dtypes whatever the scheme */
        seen[kind]++;
        enum pd_fmt want_w8 = kind == 0 ? PD_FMT_W8A8 : PD_FMT_BF16;
        enum pd_fmt want_rel = kind == 2 ? PD_FMT_BF16 : w8.t[i].cls == PD_CLASS_I ? PD_FMT_FP4 : PD_FMT_FP8;
        cr_assert_eq(w8.t[i].fmt, want_w8, "%s: w8a8 %s", w8.t[i].name, pd_fmt_name(w8.t[i].fmt));
        cr_assert_eq(rel.t[i].fmt, want_rel, "%s: released %s", rel.t[i].name, pd_fmt_name(rel.t[i].fmt));
    }
    /* 44 blocks (43 layers and the MTP layer) */
    cr_assert_eq(seen[1], 44 * 3);
    cr_assert_gt(seen[0], 44 * 6);
    cr_assert_gt(seen[2], 44);
    pd_inventory_free(&w8);
    pd_inventory_free(&rel);
}

/* DeepSeek-V4-Flash-0731 (DSpark) under W8A8: the draft stages' wo_a stays FP8 as released (vLLM-
 * Ascend's DSpark path keeps it), the main layers' wo_a is bf16, main_proj int8. */
Test(inventory, v4_flash_0731_w8a8_keeps_the_drafts_wo_a)
{
    struct pd_model m;
    struct pd_inventory inv;
    build("deepseek-v4-flash-0731", "w8a8", NULL, 1, &m, &inv);
    int drafts = 0;
    for (int i = 0; i < inv.n; i++) {
        const struct pd_tensor *t = &inv.t[i];
        if (strstr(t->name, "attn.wo_a.weight")) {
            int draft = strncmp(t->name, "mtp.", 4) == 0;
            drafts += draft;
            cr_assert_eq(t->fmt, draft ? PD_FMT_FP8 : PD_FMT_BF16, "%s: %s", t->name, pd_fmt_name(t->fmt));
        }
        if (strcmp(t->name, "mtp.0.main_proj.weight") == 0)
            cr_assert_eq(t->fmt, PD_FMT_W8A8);
    }
    cr_assert_eq(drafts, 3);
    pd_inventory_free(&inv);
}

/* Per-tensor precision as released (issue 19, point 4): the matrices DeepSeek's official code runs in
 * bf16/fp32 (wo_a, the head, the router, the compressor, the indexer's weights_proj) and those a
 * W8A8 deployment runs in bf16 (wq_a, wkv: FP8 in the release) are fp32 in the loaded engine, and
 * exactly the matrices a W8A8 deployment quantises (wq_b, wo_b, the indexer's wq_b, shared and
 * routed experts, the MTP projections) are int8: for gen-model's presets, for the release's layout
 * loaded directly, and for `pdmoe convert`'s output (plan/inventory.h, pd_inventory_w8a8_role). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "../tmpmodel.h"
#include "engine/convert.h"
#include "engine/engine.h"
#include "engine/genmodel.h"
#include "model/safetensors.h"
#include "plan/inventory.h"

static void open_dir(struct pd_engine *en, const char *d)
{
    struct pd_engine_opts o = {.dir = d, .threads = 1, .max_seqs = 1, .max_model_len = 64};
    pd_err e = {0};
    cr_assert_eq(pd_engine_open(en, &o, &e), 0, "%s: %s", d, e.msg);
}

static void is_f32(const struct pd_linear *l, const char *what, int layer)
{
    cr_assert((l->f || l->h) && !l->q.q, "layer %d: %s is not fp32 or bf16", layer, what);
}

static void is_int8(const struct pd_linear *l, const char *what, int layer)
{
    cr_assert(l->q.q && !l->f && !l->h, "layer %d: %s is not int8", layer, what);
}

static void compressor_f32(const struct pd_compressor_w *c, const char *who, int layer)
{
    char b[64];
    snprintf(b, sizeof b, "%scompressor.wkv", who);
    is_f32(&c->wkv, b, layer);
    snprintf(b, sizeof b, "%scompressor.wgate", who);
    is_f32(&c->wgate, b, layer);
}

/* Every matrix of block L (layer `layer`) in the format the release's code and a W8A8 deployment
 * run it in. */
static void block_formats(const struct pd_model *m, const struct pd_layer_w *L, int layer)
{
    is_f32(&L->wq_a, "attn.wq_a", layer);
    is_f32(&L->wkv, "attn.wkv", layer);
    is_f32(&L->wo_a, "attn.wo_a", layer);
    is_f32(&L->gate, "ffn.gate", layer);
    is_int8(&L->wq_b, "attn.wq_b", layer);
    is_int8(&L->wo_b, "attn.wo_b", layer);
    if (L->ratio > 0)
        compressor_f32(&L->cmp, "attn.", layer);
    if (L->ratio == 4) {
        compressor_f32(&L->idx_cmp, "attn.indexer.", layer);
        is_f32(&L->idx_weights, "attn.indexer.weights_proj", layer);
        is_int8(&L->idx_wq_b, "attn.indexer.wq_b", layer);
    }
    is_int8(&L->shared.w1, "ffn.shared_experts.w1", layer);
    is_int8(&L->shared.w2, "ffn.shared_experts.w2", layer);
    is_int8(&L->shared.w3, "ffn.shared_experts.w3", layer);
    for (int x = 0; x < m->n_routed_experts; x++) {
        is_int8(&L->experts[x].w1, "an expert's w1", layer);
        is_int8(&L->experts[x].w2, "an expert's w2", layer);
        is_int8(&L->experts[x].w3, "an expert's w3", layer);
    }
}

static void engine_formats(const char *dir)
{
    struct pd_engine en;
    open_dir(&en, dir);
    const struct pd_model *m = &en.model;
    int ratios[3] = {0};
    is_f32(&en.w.head, "head", -1);
    for (int l = 0; l < m->n_layers; l++) {
        block_formats(m, &en.w.layers[l], l);
        ratios[en.w.layers[l].ratio == 0 ? 0 : en.w.layers[l].ratio == 4 ? 1 : 2]++;
    }
    cr_assert(ratios[0] && ratios[1] && ratios[2], "%s: window, CSA and HCA layers all checked", dir);
    cr_assert(en.w.has_mtp, "%s: the MTP layer is loaded", dir);
    is_int8(&en.w.mtp.e_proj, "mtp.0.e_proj", m->n_layers);
    is_int8(&en.w.mtp.h_proj, "mtp.0.h_proj", m->n_layers);
    block_formats(m, &en.w.mtp.block, m->n_layers);
    pd_engine_close(&en);
}

Test(precision, presets_load_as_released, .timeout = 600)
{
    char d[64];
    tmp_model("v4-tiny", 3, d, sizeof d);
    engine_formats(d);
    rm_model(d);
    /* v4-flash-mini: models/mini when it exists (make test generates it), else a fresh copy */
    struct stat st;
    if (stat("models/mini/model.safetensors", &st) == 0) {
        engine_formats("models/mini");
    } else {
        tmp_model("v4-flash-mini", 1, d, sizeof d);
        engine_formats(d);
        rm_model(d);
    }
}

Test(precision, release_loads_as_a_w8a8_deployment_runs_it)
{
    /* the release stores wq_a, wkv and wo_a FP8: the engine runs their exact values in fp32 */
    char d[64];
    snprintf(d, sizeof d, "/tmp/pdmoe-release-XXXXXX");
    cr_assert_not_null(mkdtemp(d));
    pd_err e = {0};
    cr_assert_eq(pd_genmodel_fmt("v4-tiny", d, 7, PD_GEN_RELEASE, &e), 0, "%s", e.msg);
    struct pd_st_set s;
    cr_assert_eq(pd_st_open_dir(d, PD_ST_HEADER_ONLY, &s, &e), 0, "%s", e.msg);
    static const char *const fp8[] = {"layers.1.attn.wq_a.weight", "layers.1.attn.wkv.weight", "layers.1.attn.wo_a.weight",
                                      "layers.1.attn.wq_b.weight"};
    static const char *const bf16[] = {"head.weight", "layers.1.ffn.gate.weight", "layers.1.attn.compressor.wkv.weight",
                                       "layers.1.attn.indexer.weights_proj.weight"};
    for (size_t i = 0; i < 4; i++) {
        const struct pd_st_tensor *t = pd_st_set_find(&s, fp8[i]);
        cr_assert(t && t->dtype == PD_ST_F8_E4M3, "%s: not FP8 in the release", fp8[i]);
        t = pd_st_set_find(&s, bf16[i]);
        cr_assert(t && t->dtype == PD_ST_BF16, "%s: not bf16 in the release", bf16[i]);
    }
    pd_st_close_dir(&s);
    engine_formats(d);
    rm_model(d);
}

Test(precision, convert_quantises_exactly_the_w8a8_groups)
{
    /* every FP8/FP4 matrix of the release: int8 + a row scale when a W8A8 deployment quantises it,
     * else bf16; everything else copied with its dtype. The bf16 matrices hold the release's
     * values exactly: byte for byte the release-w8a8 layout of the same model. */
    char rel[64], def[64], out[64];
    pd_err e = {0};
    snprintf(rel, sizeof rel, "/tmp/pdmoe-release-XXXXXX");
    snprintf(def, sizeof def, "/tmp/pdmoe-release-w8a8-XXXXXX");
    snprintf(out, sizeof out, "/tmp/pdmoe-converted-XXXXXX");
    cr_assert(mkdtemp(rel) && mkdtemp(def) && mkdtemp(out));
    cr_assert_eq(pd_genmodel_fmt("v4-tiny", rel, 7, PD_GEN_RELEASE, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_genmodel_fmt("v4-tiny", def, 7, PD_GEN_RELEASE_W8A8, &e), 0, "%s", e.msg);
    struct pd_convert_opts o = {.in_dir = rel, .out_dir = out};
    struct pd_convert_stats st;
    cr_assert_eq(pd_convert(&o, &st, &e), 0, "%s", e.msg);
    struct pd_st_set r, c, w;
    cr_assert_eq(pd_st_open_dir(rel, PD_ST_HEADER_ONLY, &r, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_st_open_dir(out, 0, &c, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_st_open_dir(def, 0, &w, &e), 0, "%s", e.msg);
    int quant = 0, flt = 0, q_layer1 = 0, f_layer1 = 0;
    for (size_t f = 0; f < r.nfiles; f++)
        for (size_t i = 0; i < r.files[f].n; i++) {
            const struct pd_st_tensor *t = &r.files[f].tensors[i];
            const size_t n = strlen(t->name);
            if (n > 6 && strcmp(t->name + n - 6, ".scale") == 0)
                continue;
            const struct pd_st_tensor *ct = pd_st_set_find(&c, t->name), *wt = pd_st_set_find(&w, t->name);
            cr_assert(ct && wt, "%s: missing from the output", t->name);
            cr_assert_eq(ct->dtype, wt->dtype, "%s: %s, the W8A8 layout has %s", t->name, pd_st_dtype_name(ct->dtype),
                         pd_st_dtype_name(wt->dtype));
            char sname[160];
            snprintf(sname, sizeof sname, "%s_scale", t->name);
            if (t->dtype != PD_ST_F8_E4M3 && !(t->dtype == PD_ST_I8 && strstr(t->name, ".experts."))) {
                cr_assert_eq(ct->dtype, t->dtype, "%s: copied", t->name);
                continue;
            }
            int l1 = strncmp(t->name, "layers.1.", 9) == 0;
            if (pd_inventory_w8a8_role(t->name, 0) == PD_W8A8_QUANT) {
                cr_assert_eq(ct->dtype, PD_ST_I8, "%s: a W8A8 deployment quantises it", t->name);
                cr_assert_not_null(pd_st_set_find(&c, sname), "%s: no row scales", t->name);
                quant++;
                q_layer1 += l1;
            } else {
                cr_assert_eq(ct->dtype, PD_ST_BF16, "%s: a W8A8 deployment runs it in bf16", t->name);
                cr_assert_null(pd_st_set_find(&c, sname), "%s: a bf16 matrix has no scale", t->name);
                cr_assert_eq(ct->end - ct->begin, wt->end - wt->begin);
                cr_assert_eq(memcmp(ct->data, wt->data, ct->end - ct->begin), 0, "%s: not the release's values", t->name);
                flt++;
                f_layer1 += l1;
            }
        }
    /* layer 1 (CSA): wq_b, wo_b, indexer wq_b, 3 shared, 16 x 3 experts; wq_a, wkv, wo_a */
    cr_assert_eq(q_layer1, 3 + 3 + 16 * 3);
    cr_assert_eq(f_layer1, 3);
    cr_assert_eq(st.matrices, quant);
    cr_assert_eq(st.bf16, flt);
    pd_st_close_dir(&r);
    pd_st_close_dir(&c);
    pd_st_close_dir(&w);
    rm_model(rel);
    rm_model(def);
    rm_model(out);
}

Test(precision, convert_keeps_a_dspark_drafts_wo_a)
{
    /* A DSpark checkpoint (it has mtp.0.main_proj): the draft stages' wo_a stays FP8 with its scale,
     * as vLLM-Ascend's W8A8 conversion keeps it; the main layers' wo_a becomes bf16, main_proj int8. */
    enum { N = 128 };
    static uint8_t fp8[3][N * N];
    const uint8_t one = 127;   /* ue8m0 2^0 */
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < N * N; i++)
            fp8[k][i] = (uint8_t)((i * 7 + k * 13) % 0x7E);
    const struct pd_st_out t[6] = {
        {"layers.0.attn.wo_a.weight", PD_ST_F8_E4M3, 2, {N, N}, fp8[0]},
        {"layers.0.attn.wo_a.scale", PD_ST_F8_E8M0, 2, {1, 1}, &one},
        {"mtp.0.attn.wo_a.weight", PD_ST_F8_E4M3, 2, {N, N}, fp8[1]},
        {"mtp.0.attn.wo_a.scale", PD_ST_F8_E8M0, 2, {1, 1}, &one},
        {"mtp.0.main_proj.weight", PD_ST_F8_E4M3, 2, {N, N}, fp8[2]},
        {"mtp.0.main_proj.scale", PD_ST_F8_E8M0, 2, {1, 1}, &one},
    };
    char in[64], out[64], path[128];
    snprintf(in, sizeof in, "/tmp/pdmoe-dspark-XXXXXX");
    snprintf(out, sizeof out, "/tmp/pdmoe-dspark-w8a8-XXXXXX");
    cr_assert(mkdtemp(in) && mkdtemp(out));
    pd_err e = {0};
    snprintf(path, sizeof path, "%s/model.safetensors", in);
    cr_assert_eq(pd_st_write(path, t, 6, &e), 0, "%s", e.msg);
    snprintf(path, sizeof path, "%s/config.json", in);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("{\"quantization_config\": {\"quant_method\": \"fp8\"}}\n", f);
    cr_assert_eq(fclose(f), 0);
    struct pd_convert_opts o = {.in_dir = in, .out_dir = out};
    struct pd_convert_stats st;
    cr_assert_eq(pd_convert(&o, &st, &e), 0, "%s", e.msg);
    struct pd_st_set c;
    cr_assert_eq(pd_st_open_dir(out, 0, &c, &e), 0, "%s", e.msg);
    const struct pd_st_tensor *w = pd_st_set_find(&c, "mtp.0.attn.wo_a.weight");
    const struct pd_st_tensor *s = pd_st_set_find(&c, "mtp.0.attn.wo_a.scale");
    cr_assert(w && s && w->dtype == PD_ST_F8_E4M3 && s->dtype == PD_ST_F8_E8M0, "the draft's wo_a is kept");
    cr_assert_eq(memcmp(w->data, fp8[1], N * N), 0);
    w = pd_st_set_find(&c, "layers.0.attn.wo_a.weight");
    cr_assert(w && w->dtype == PD_ST_BF16, "the main layer's wo_a is bf16");
    cr_assert_null(pd_st_set_find(&c, "layers.0.attn.wo_a.scale"));
    w = pd_st_set_find(&c, "mtp.0.main_proj.weight");
    cr_assert(w && w->dtype == PD_ST_I8 && pd_st_set_find(&c, "mtp.0.main_proj.weight_scale"), "main_proj is int8");
    cr_assert_eq(st.matrices, 1);
    cr_assert_eq(st.bf16, 1);
    pd_st_close_dir(&c);
    rm_model(in);
    rm_model(out);
}

/* DeepSeek's released checkpoint format (engine/release.h): gen-model --format release writes it
 * with the release's names, dtypes, scale shapes, FP4 packing and shards; the engine serves it
 * directly, with the same tokens as the default format of the same model; the planner counts
 * exactly the bytes the engine loads; bad inputs are refused naming the file and the tensor. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../tmpmodel.h"
#include "engine/convert.h"
#include "engine/engine.h"
#include "engine/genmodel.h"
#include "kernels/quant.h"
#include "model/safetensors.h"
#include "plan/inventory.h"
#include "plan/plan.h"

static char rel[64], def[64];

static void make_pair(void)
{
    /* one model (v4-tiny, seed 5) in the release's layout and in the default one */
    pd_err e = {0};
    snprintf(def, sizeof def, "/tmp/pdmoe-release-w8a8-XXXXXX");
    cr_assert_not_null(mkdtemp(def));
    cr_assert_eq(pd_genmodel_fmt("v4-tiny", def, 5, PD_GEN_RELEASE_W8A8, &e), 0, "%s", e.msg);
    snprintf(rel, sizeof rel, "/tmp/pdmoe-release-XXXXXX");
    cr_assert_not_null(mkdtemp(rel));
    cr_assert_eq(pd_genmodel_fmt("v4-tiny", rel, 5, PD_GEN_RELEASE, &e), 0, "%s", e.msg);
}

static void remove_pair(void)
{
    rm_model(def);
    rm_model(rel);
}

TestSuite(release, .init = make_pair, .fini = remove_pair);

/* e2m1 by its definition (bias 1, one mantissa bit), ue8m0 as 2^(b - 127): the test's own decoding */
static double e2m1(int c)
{
    int ef = (c >> 1) & 3, mf = c & 1;
    double v = ef == 0 ? 0.5 * mf : (1.0 + 0.5 * mf) * ldexp(1.0, ef - 1);
    return c & 8 ? -v : v;
}

Test(release, layout_is_the_releases)
{
    /* shards and index */
    char path[256];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", rel);
    json_error_t je;
    json_t *idx = json_load_file(path, 0, &je);
    cr_assert_not_null(idx, "%s: %s", path, je.text);
    json_t *wm = json_object_get(idx, "weight_map");
    cr_assert(json_is_object(wm));
    snprintf(path, sizeof path, "%s/model.safetensors", rel);
    cr_assert_neq(access(path, F_OK), 0, "the release is sharded, no single model.safetensors");
    struct pd_st_set st;
    pd_err e = {0};
    cr_assert_eq(pd_st_open_dir(rel, 0, &st, &e), 0, "%s", e.msg);
    cr_assert_geq(st.nfiles, 2, "%zu shards", st.nfiles);
    size_t total = 0;
    for (size_t f = 0; f < st.nfiles; f++) {
        cr_assert(strstr(st.files[f].path, "-of-0000"), "%s", st.files[f].path);
        total += st.files[f].n;
    }
    cr_assert_eq(total, json_object_size(wm), "the index maps every tensor once");

    /* names, dtypes and shapes: v4-tiny (hidden 64, experts of width 32, q_lora 32) */
    struct { const char *name; enum pd_st_dtype dt; int64_t r, c; } want[] = {
        {"embed.weight", PD_ST_BF16, 512, 64},
        {"layers.1.attn.wq_a.weight", PD_ST_F8_E4M3, 32, 64},
        {"layers.1.attn.wq_a.scale", PD_ST_F8_E8M0, 1, 1},
        {"layers.1.attn.wq_b.weight", PD_ST_F8_E4M3, 128, 32},
        {"layers.1.attn.wq_b.scale", PD_ST_F8_E8M0, 1, 1},
        {"layers.1.ffn.shared_experts.w2.weight", PD_ST_F8_E4M3, 64, 32},
        {"layers.1.ffn.shared_experts.w2.scale", PD_ST_F8_E8M0, 1, 1},
        {"layers.1.ffn.experts.3.w1.weight", PD_ST_I8, 32, 32},    /* FP4 [32, 64] two per byte */
        {"layers.1.ffn.experts.3.w1.scale", PD_ST_F8_E8M0, 32, 2}, /* one per 1 x 32 */
        {"layers.1.ffn.experts.3.w2.weight", PD_ST_I8, 64, 16},
        {"layers.1.ffn.experts.3.w2.scale", PD_ST_F8_E8M0, 64, 1},
        {"layers.1.attn_norm.weight", PD_ST_BF16, 64, 0},
        {"layers.1.attn.attn_sink", PD_ST_F32, 4, 0},
        {"layers.1.hc_attn_base", PD_ST_F32, 24, 0},
        {"layers.1.ffn.gate.weight", PD_ST_BF16, 16, 64},
        {"layers.1.ffn.gate.bias", PD_ST_F32, 16, 0},
        {"layers.0.ffn.gate.tid2eid", PD_ST_I64, 512, 4},
        {"mtp.0.e_proj.weight", PD_ST_F8_E4M3, 64, 64},
        {"mtp.0.e_proj.scale", PD_ST_F8_E8M0, 1, 1},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const struct pd_st_tensor *t = pd_st_set_find(&st, want[i].name);
        cr_assert_not_null(t, "%s missing", want[i].name);
        cr_assert_eq(t->dtype, want[i].dt, "%s is %s", want[i].name, pd_st_dtype_name(t->dtype));
        cr_assert_eq(t->ndim, want[i].c ? 2 : 1, "%s", want[i].name);
        cr_assert_eq(t->shape[0], want[i].r, "%s", want[i].name);
        if (want[i].c)
            cr_assert_eq(t->shape[1], want[i].c, "%s", want[i].name);
    }
    cr_assert_null(pd_st_set_find(&st, "layers.1.attn.wq_a.weight_scale"), "no W8A8 scale in the release");

    /* config.json as released: the quantization_config the engine and planner read */
    snprintf(path, sizeof path, "%s/config.json", rel);
    json_t *cfg = json_load_file(path, 0, &je);
    cr_assert_not_null(cfg, "%s", je.text);
    json_t *qc = json_object_get(cfg, "quantization_config");
    cr_assert_str_eq(json_string_value(json_object_get(qc, "quant_method")), "fp8");
    cr_assert_str_eq(json_string_value(json_object_get(qc, "scale_fmt")), "ue8m0");
    cr_assert_eq(json_integer_value(json_array_get(json_object_get(qc, "weight_block_size"), 1)), 128);
    json_decref(cfg);
    json_decref(idx);

    /* FP4 packing, low nibble first: decoding the release's expert with the test's own e2m1 and
     * quantizing it per row gives the default format's int8 weights and scales bit for bit */
    struct pd_st_set sd;
    cr_assert_eq(pd_st_open_dir(def, 0, &sd, &e), 0, "%s", e.msg);
    const char *names[] = {"layers.2.ffn.experts.9.w2.weight", "layers.1.ffn.experts.0.w1.weight"};
    for (int k = 0; k < 2; k++) {
        char sn[128], dn[128];
        snprintf(sn, sizeof sn, "%.*s.scale", (int)(strlen(names[k]) - 7), names[k]);
        snprintf(dn, sizeof dn, "%s_scale", names[k]);
        const struct pd_st_tensor *w = pd_st_set_find(&st, names[k]), *s = pd_st_set_find(&st, sn);
        const struct pd_st_tensor *dw = pd_st_set_find(&sd, names[k]), *ds = pd_st_set_find(&sd, dn);
        cr_assert(w && s && dw && ds, "%s", names[k]);
        int out = (int)dw->shape[0], in = (int)dw->shape[1];
        cr_assert_eq(w->shape[1] * 2, in);
        float *row = malloc((size_t)in * sizeof *row);
        int8_t *q = malloc((size_t)in);
        for (int r = 0; r < out; r++) {
            const uint8_t *b = (const uint8_t *)w->data + (size_t)r * (in / 2);
            const uint8_t *sc = (const uint8_t *)s->data + (size_t)r * s->shape[1];
            for (int c = 0; c < in; c++) {
                int nib = c % 2 ? b[c / 2] >> 4 : b[c / 2] & 15;
                row[c] = (float)(e2m1(nib) * ldexp(1.0, sc[c / 32] - 127));
            }
            float scale;
            pd_quant_weights(row, 1, in, q, &scale);
            cr_assert_eq(memcmp(q, (const int8_t *)dw->data + (size_t)r * in, (size_t)in), 0, "%s row %d", names[k], r);
            float dscale;
            memcpy(&dscale, (const char *)ds->data + 4 * (size_t)r, 4);
            cr_assert_eq(scale, dscale, "%s row %d scale", names[k], r);
        }
        free(row);
        free(q);
    }
    pd_st_close_dir(&sd);
    pd_st_close_dir(&st);
}

static void open_dir(struct pd_engine *en, const char *d, int ref)
{
    struct pd_engine_opts o = {.dir = d, .threads = 1, .max_seqs = 4, .max_model_len = 256, .ref = ref};
    pd_err e = {0};
    cr_assert_eq(pd_engine_open(en, &o, &e), 0, "%s", e.msg);
}

/* Greedy ids of `gen` tokens after prompt ids[n]; logits of every step into lg [gen, V] if given. */
static void greedy(struct pd_engine *en, const int32_t *ids, int n, int gen, int32_t *out, float *lg)
{
    const int V = (int)en->model.vocab_size;
    float *l = malloc((size_t)V * sizeof *l);
    struct pd_seq s;
    pd_err e = {0};
    cr_assert_eq(pd_seq_start(en, &s, &e), 0, "%s", e.msg);
    struct pd_step_item it = {.seq = &s, .tokens = ids, .n = n, .logits = l};
    for (int g = 0; g < gen; g++) {
        cr_assert_eq(pd_engine_step(en, &it, 1, &e), 0, "%s", e.msg);
        int best = 0;
        for (int v = 1; v < V; v++)
            best = l[v] > l[best] ? v : best;
        out[g] = best;
        if (lg)
            memcpy(lg + (size_t)g * V, l, (size_t)V * sizeof *l);
        it.tokens = &out[g];
        it.n = 1;
    }
    pd_seq_end(en, &s);
    free(l);
}

Test(release, serves_the_same_tokens_as_the_default_format)
{
    /* The release and the default layout of one model give the engine the same int8 weights
     * (gen-model draws the matrices onto the release's grid), so greedy decoding agrees on
     * every token of each prompt; and the int8 run on the release stays within 0.99 logits
     * cosine of the float reference forward pass of the release (engine opts ref: its FP8/FP4
     * matrices decoded to their exact fp32 values, activations unquantized). */
    struct pd_engine r, d, f;
    open_dir(&r, rel, 0);
    open_dir(&d, def, 0);
    open_dir(&f, rel, 1);
    cr_assert_not_null(f.w.layers[1].wq_a.f, "the reference keeps the release's FP8 matrix in fp32");
    cr_assert_not_null(f.w.layers[1].experts[3].w2.f, "and its FP4 experts");
    cr_assert_null(r.w.layers[1].experts[3].w2.f, "the int8 engine converts them");
    cr_assert_not_null(r.w.layers[1].experts[3].w2.q.q);
    const int G = 16, V = (int)r.model.vocab_size;
    float *lr = malloc((size_t)G * V * sizeof *lr), *lf = malloc((size_t)G * V * sizeof *lf);
    double worst = 1;
    int steps = 0;
    for (int p = 0; p < 3; p++) {
        int32_t ids[40], a[16], b[16], c[16];
        int n = 12 + 9 * p;
        for (int i = 0; i < n; i++)
            ids[i] = (int32_t)((i * 53 + p * 97 + 5) % 500);
        greedy(&r, ids, n, G, a, lr);
        greedy(&d, ids, n, G, b, NULL);
        for (int g = 0; g < G; g++)
            cr_assert_eq(a[g], b[g], "prompt %d token %d: release %d, default %d", p, g, a[g], b[g]);
        /* the reference decodes its own tokens; compare logits where both took the same path */
        greedy(&f, ids, n, G, c, lf);
        int g = 0;
        for (; g < G && (g == 0 || c[g - 1] == a[g - 1]); g++) {
            double cs = cosine(lr + (size_t)g * V, lf + (size_t)g * V, V);
            worst = cs < worst ? cs : worst;
            cr_assert_geq(cs, 0.99, "prompt %d step %d: cosine %f against the float reference", p, g, cs);
        }
        steps += g;
        cr_assert_eq(c[0], a[0], "prompt %d: the float reference chose another first token", p);
    }
    cr_log_info("release v4-tiny: int8 vs float reference, %d steps on the same path: min logits cosine %.5f", steps,
                worst);
    free(lr);
    free(lf);
    pd_engine_close(&r);
    pd_engine_close(&d);
    pd_engine_close(&f);
}

Test(release, planner_counts_what_the_engine_loads)
{
    /* plan --checkpoint on the release counts its stored bytes (FP8/FP4 with their scales); the
     * engine loads exactly those; and they equal the preset's plan under the release's scheme */
    struct pd_plan a, b;
    struct pd_plan_opts o;
    pd_err e = {0};
    pd_plan_opts_default(&o);
    o.model = rel;   /* its config.json: v4-tiny with the release's quantization_config (ue8m0 scales) */
    o.quant = "fp8";
    o.quant_override = "routed_experts=fp4";
    o.role[0] = (struct pd_role_opts){.dp = 4, .tp = 1, .instances = 1};
    o.role[1] = (struct pd_role_opts){.dp = 4, .tp = 1, .instances = 1};
    cr_assert_eq(pd_plan_build(&o, &a, &e), 0, "%s", e.msg);
    pd_plan_opts_default(&o);
    o.model = NULL;   /* the checkpoint's own config.json, as plan --checkpoint reads it */
    o.checkpoint = rel;
    o.role[0] = (struct pd_role_opts){.dp = 4, .tp = 1, .instances = 1};
    o.role[1] = (struct pd_role_opts){.dp = 4, .tp = 1, .instances = 1};
    cr_assert_eq(pd_plan_build(&o, &b, &e), 0, "%s", e.msg);
    cr_assert_eq(b.inv.n_unclassed, 0, "%s", b.inv.unclassed[0]);
    for (int g = 0; g < PD_G_COUNT; g++)
        for (int c = 0; c < 2; c++)
            cr_assert_eq(a.inv.group_bytes[g][c], b.inv.group_bytes[g][c], "group %s class %d: preset %lld, checkpoint %lld",
                         pd_group_name(g), c, (long long)a.inv.group_bytes[g][c], (long long)b.inv.group_bytes[g][c]);
    struct pd_engine en;
    open_dir(&en, rel, 0);
    cr_assert_eq(en.w.loaded_bytes[0], b.inv.class_bytes[PD_CLASS_I]);
    cr_assert_eq(en.w.loaded_bytes[1], b.inv.class_bytes[PD_CLASS_II]);
    pd_engine_close(&en);
    pd_plan_free(&a);
    pd_plan_free(&b);
}

/* A copy of the release in a new directory, with tensor `drop` left out of its shard (and of the
 * index), or `retype` rewritten with dtype dt and shape [r, c] (its bytes cut or padded). */
static void mutated_copy(char *out, size_t n, const char *drop, const char *retype, enum pd_st_dtype dt, int64_t r,
                         int64_t c)
{
    snprintf(out, n, "/tmp/pdmoe-release-bad-XXXXXX");
    cr_assert_not_null(mkdtemp(out));
    struct pd_st_set st;
    pd_err e = {0};
    cr_assert_eq(pd_st_open_dir(rel, 0, &st, &e), 0, "%s", e.msg);
    void *pad = calloc((size_t)(r * c * 4 + 8), 1);
    for (size_t f = 0; f < st.nfiles; f++) {
        struct pd_st_out *t = calloc(st.files[f].n, sizeof *t);
        size_t k = 0;
        for (size_t i = 0; i < st.files[f].n; i++) {
            const struct pd_st_tensor *x = &st.files[f].tensors[i];
            if (drop && strcmp(x->name, drop) == 0)
                continue;
            t[k] = (struct pd_st_out){.name = x->name, .dtype = x->dtype, .ndim = x->ndim, .data = x->data};
            memcpy(t[k].shape, x->shape, sizeof x->shape);
            if (retype && strcmp(x->name, retype) == 0) {
                t[k].dtype = dt;
                t[k].ndim = 2;
                t[k].shape[0] = r;
                t[k].shape[1] = c;
                t[k].data = pad;
            }
            k++;
        }
        char path[256];
        snprintf(path, sizeof path, "%s/%s", out, strrchr(st.files[f].path, '/') + 1);
        cr_assert_eq(pd_st_write(path, t, k, &e), 0, "%s", e.msg);
        free(t);
    }
    free(pad);
    pd_st_close_dir(&st);
    char src[256], dst[256];
    snprintf(src, sizeof src, "%s/model.safetensors.index.json", rel);
    snprintf(dst, sizeof dst, "%s/model.safetensors.index.json", out);
    json_error_t je;
    json_t *idx = json_load_file(src, 0, &je);
    cr_assert_not_null(idx);
    if (drop)
        json_object_del(json_object_get(idx, "weight_map"), drop);
    cr_assert_eq(json_dump_file(idx, dst, 0), 0);
    json_decref(idx);
    const char *files[] = {"config.json", "tokenizer.json"};
    for (int i = 0; i < 2; i++) {
        snprintf(src, sizeof src, "cp %s/%s %s/", rel, files[i], out);
        cr_assert_eq(system(src), 0);
    }
}

static void refused(const char *d, const char *want1, const char *want2)
{
    struct pd_engine en;
    struct pd_engine_opts o = {.dir = d, .threads = 1, .max_seqs = 1, .max_model_len = 64};
    pd_err e = {0};
    cr_assert_neq(pd_engine_open(&en, &o, &e), 0, "%s loaded", d);
    cr_assert(strstr(e.msg, want1), "\"%s\" does not name %s", e.msg, want1);
    cr_assert(strstr(e.msg, want2), "\"%s\" does not name %s", e.msg, want2);
}

Test(release, bad_inputs_name_the_file_and_the_tensor)
{
    char d[64], path[256];
    /* a scale tensor missing */
    mutated_copy(d, sizeof d, "layers.1.attn.wq_b.scale", NULL, PD_ST_F32, 0, 0);
    refused(d, "layers.1.attn.wq_b.scale", "-of-0000");
    rm_model(d);
    /* a scale of the wrong dtype, of the wrong shape */
    mutated_copy(d, sizeof d, NULL, "layers.2.ffn.experts.4.w2.scale", PD_ST_F32, 64, 1);
    refused(d, "layers.2.ffn.experts.4.w2.scale", "is F32, expected F8_E8M0");
    rm_model(d);
    mutated_copy(d, sizeof d, NULL, "layers.1.attn.wkv.scale", PD_ST_F8_E8M0, 2, 1);
    refused(d, "layers.1.attn.wkv.scale", "has shape [2, 1]");
    rm_model(d);
    /* a weight of the wrong shape */
    mutated_copy(d, sizeof d, NULL, "layers.3.ffn.experts.1.w1.weight", PD_ST_I8, 32, 64);
    refused(d, "layers.3.ffn.experts.1.w1.weight", "the config needs [32, 32]");
    rm_model(d);
    /* a norm of the wrong dtype (an F8 gain where the release has bf16) */
    mutated_copy(d, sizeof d, NULL, "layers.1.attn_norm.weight", PD_ST_F8_E4M3, 64, 1);
    refused(d, "layers.1.attn_norm.weight\" is F8_E4M3, expected F32 or BF16", "-of-0000");
    rm_model(d);
    /* a shard named by the index missing */
    mutated_copy(d, sizeof d, NULL, NULL, PD_ST_F32, 0, 0);
    snprintf(path, sizeof path, "%s/model-00003-of-00004.safetensors", d);
    cr_assert_eq(unlink(path), 0);
    refused(d, "model-00003-of-00004.safetensors", "for tensor \"");
    rm_model(d);
}

/* --- pdmoe convert: release -> W8A8 --- */

static void convert_to(char *out, size_t n, struct pd_convert_stats *st)
{
    snprintf(out, n, "/tmp/pdmoe-converted-XXXXXX");
    cr_assert_not_null(mkdtemp(out));
    struct pd_convert_opts o = {.in_dir = rel, .out_dir = out};
    pd_err e = {0};
    cr_assert_eq(pd_convert(&o, st, &e), 0, "%s", e.msg);
}

Test(release, converted_gives_the_releases_tokens_and_bytes)
{
    /* convert writes the int8 the engine makes of the release at load: the same logits to the
     * bit, so the same tokens; and plan --checkpoint on it counts what the engine loads */
    char out[64];
    struct pd_convert_stats st;
    convert_to(out, sizeof out, &st);
    cr_assert_eq(st.shards, 4);
    cr_assert_eq(st.converted, 4);
    cr_assert_eq(st.skipped, 0);
    cr_assert_gt(st.matrices, 0);
    cr_assert_lt(st.max_rel_err, 0.5 / 127 * 1.0001, "an int8 row rounds within half a step of its max: %g",
                 st.max_rel_err);
    struct pd_st_set s;
    pd_err e = {0};
    cr_assert_eq(pd_st_open_dir(out, 0, &s, &e), 0, "%s", e.msg);
    const struct pd_st_tensor *w = pd_st_set_find(&s, "layers.1.ffn.experts.3.w1.weight");
    const struct pd_st_tensor *sc = pd_st_set_find(&s, "layers.1.ffn.experts.3.w1.weight_scale");
    cr_assert(w && sc);
    cr_assert_eq(w->dtype, PD_ST_I8);
    cr_assert_eq(w->shape[1], 64, "unpacked to [32, 64]");
    cr_assert_eq(sc->dtype, PD_ST_F32);
    cr_assert_null(pd_st_set_find(&s, "layers.1.ffn.experts.3.w1.scale"));
    pd_st_close_dir(&s);

    struct pd_engine r, c;
    open_dir(&r, rel, 0);
    open_dir(&c, out, 0);
    const int G = 12, V = (int)r.model.vocab_size;
    float *lr = malloc((size_t)G * V * 4), *lc = malloc((size_t)G * V * 4);
    int32_t ids[20], a[12], b[12];
    for (int i = 0; i < 20; i++)
        ids[i] = (int32_t)((i * 71 + 3) % 500);
    greedy(&r, ids, 20, G, a, lr);
    greedy(&c, ids, 20, G, b, lc);
    cr_assert_eq(memcmp(a, b, sizeof a), 0, "the converted checkpoint chose other tokens");
    cr_assert_eq(memcmp(lr, lc, (size_t)G * V * 4), 0, "the converted checkpoint's logits differ");
    free(lr);
    free(lc);
    pd_engine_close(&r);

    struct pd_plan p;
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.model = NULL;   /* the checkpoint's own config.json, as plan --checkpoint reads it */
    o.checkpoint = out;
    o.role[0] = (struct pd_role_opts){.dp = 4, .tp = 1, .instances = 1};
    o.role[1] = (struct pd_role_opts){.dp = 4, .tp = 1, .instances = 1};
    cr_assert_eq(pd_plan_build(&o, &p, &e), 0, "%s", e.msg);
    cr_assert_eq(p.inv.n_unclassed, 0, "%s", p.inv.unclassed[0]);
    cr_assert_eq(c.w.loaded_bytes[0], p.inv.class_bytes[PD_CLASS_I]);
    cr_assert_eq(c.w.loaded_bytes[1], p.inv.class_bytes[PD_CLASS_II]);
    pd_plan_free(&p);
    pd_engine_close(&c);
    rm_model(out);
}

Test(release, convert_restarts_per_shard)
{
    /* a second run verifies and keeps every shard; a damaged shard (one int8 byte changed) fails
     * its verification and is converted again; a leftover .partial is replaced */
    char out[64], path[256];
    struct pd_convert_stats st;
    convert_to(out, sizeof out, &st);
    struct pd_convert_opts o = {.in_dir = rel, .out_dir = out};
    pd_err e = {0};
    cr_assert_eq(pd_convert(&o, &st, &e), 0, "%s", e.msg);
    cr_assert_eq(st.skipped, 4);
    cr_assert_eq(st.converted, 0);

    snprintf(path, sizeof path, "%s/model-00002-of-00004.safetensors", out);
    struct pd_st_file f;
    cr_assert_eq(pd_st_open(path, PD_ST_HEADER_ONLY, &f, &e), 0, "%s", e.msg);
    uint64_t at = 0;
    for (size_t i = 0; i < f.n && !at; i++)
        if (f.tensors[i].dtype == PD_ST_I8)
            at = 8 + f.header_len + f.tensors[i].begin + 5;
    pd_st_close(&f);
    cr_assert_neq(at, 0);
    FILE *fp = fopen(path, "r+b");
    cr_assert_not_null(fp);
    fseek(fp, (long)at, SEEK_SET);
    int ch = fgetc(fp);
    fseek(fp, (long)at, SEEK_SET);
    fputc((ch + 64) & 255, fp);
    fclose(fp);
    snprintf(path, sizeof path, "%s/model-00003-of-00004.safetensors.partial", out);
    fp = fopen(path, "wb");
    fputs("interrupted", fp);
    fclose(fp);

    cr_assert_eq(pd_convert(&o, &st, &e), 0, "%s", e.msg);
    cr_assert_eq(st.converted, 1, "the damaged shard is converted again");
    cr_assert_eq(st.skipped, 3);
    cr_assert_neq(access(path, F_OK), 0, "no .partial left");
    cr_assert_eq(pd_convert(&o, &st, &e), 0, "%s", e.msg);
    cr_assert_eq(st.skipped, 4, "the reconverted shard verifies");
    rm_model(out);
}

Test(release, convert_refuses_bad_inputs_by_file_and_tensor)
{
    char d[64], out[64];
    struct pd_convert_stats st;
    pd_err e = {0};
    mutated_copy(d, sizeof d, "layers.2.attn.wo_a.scale", NULL, PD_ST_F32, 0, 0);
    snprintf(out, sizeof out, "/tmp/pdmoe-converted-XXXXXX");
    cr_assert_not_null(mkdtemp(out));
    struct pd_convert_opts o = {.in_dir = d, .out_dir = out};
    cr_assert_neq(pd_convert(&o, &st, &e), 0);
    cr_assert(strstr(e.msg, "layers.2.attn.wo_a.scale") && strstr(e.msg, "-of-0000"), "%s", e.msg);
    rm_model(d);
    /* NaN scales (e8m0 byte 255) in one expert */
    mutated_copy(d, sizeof d, NULL, NULL, PD_ST_F32, 0, 0);
    o.in_dir = d;
    struct pd_st_set s;
    cr_assert_eq(pd_st_open_dir(d, 0, &s, &e), 0, "%s", e.msg);
    const char *victim = "layers.3.ffn.experts.2.w3.scale";
    char fpath[256] = "";
    uint64_t at = 0;
    for (size_t i = 0; i < s.nfiles; i++) {
        const struct pd_st_tensor *t = pd_st_find(&s.files[i], victim);
        if (t) {
            snprintf(fpath, sizeof fpath, "%s", s.files[i].path);
            at = 8 + s.files[i].header_len + t->begin;
        }
    }
    pd_st_close_dir(&s);
    FILE *fp = fopen(fpath, "r+b");
    cr_assert_not_null(fp, "%s", victim);
    fseek(fp, (long)at, SEEK_SET);
    for (int i = 0; i < 64; i++)
        fputc(255, fp);
    fclose(fp);
    cr_assert_neq(pd_convert(&o, &st, &e), 0);
    cr_assert(strstr(e.msg, "layers.3.ffn.experts.2.w3.weight") && strstr(e.msg, "NaN"), "%s", e.msg);
    rm_model(d);
    rm_model(out);
    /* a quantization other than w8a8 is refused by the CLI (tests/cli) */
}

Test(release, convert_cli_refuses_what_it_does_not_do)
{
    /* the command line: an unimplemented --quantization is refused by name, flags are required */
    const char *bin = getenv("PDMOE_BIN") ? getenv("PDMOE_BIN") : "build/pdmoe";
    char cmd[512], buf[512];
    struct { const char *args, *want; } c[] = {
        {"--checkpoint %s --quantization int4 --out /tmp/pdmoe-never", "--quantization \"int4\""},
        {"--checkpoint %s --out /tmp/pdmoe-never", "--quantization w8a8"},
        {"--checkpoint %s --quantization w8a8 --out %s", "checkpoint's own directory"},
    };
    /* gen-model's --format: a layout it does not write is refused by name */
    snprintf(cmd, sizeof cmd, "%s gen-model --preset v4-tiny --format fp16 --out /tmp/pdmoe-never 2>&1", bin);
    FILE *g = popen(cmd, "r");
    cr_assert_not_null(g);
    size_t gn = fread(buf, 1, sizeof buf - 1, g);
    buf[gn] = 0;
    cr_assert_neq(pclose(g), 0, "%s succeeded", cmd);
    cr_assert(strstr(buf, "--format \"fp16\": expected w8a8, release or release-w8a8"), "%s", buf);
    cr_assert_neq(access("/tmp/pdmoe-never", F_OK), 0, "nothing written");
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        char args[256];
        snprintf(args, sizeof args, c[i].args, rel, rel);
        snprintf(cmd, sizeof cmd, "%s convert %s 2>&1", bin, args);
        FILE *p = popen(cmd, "r");
        cr_assert_not_null(p);
        size_t n = fread(buf, 1, sizeof buf - 1, p);
        buf[n] = 0;
        int st = pclose(p);
        cr_assert_neq(st, 0, "%s succeeded", cmd);
        cr_assert(strstr(buf, c[i].want), "%s: \"%s\" lacks %s", cmd, buf, c[i].want);
    }
}

Test(release, convert_memory_does_not_grow_with_the_checkpoint, .timeout = 300)
{
    /* A 544 MiB checkpoint (a 512 MiB bf16 tensor to copy, a 32 MiB FP8 matrix to convert, named
     * as one a W8A8 deployment quantises; the
     * data sparse, so writing it costs nothing): `pdmoe convert` peaks at a quarter of it at most
     * (it reports its VmHWM; about 35 MiB measured without sanitizers). */
    char d[64], out[64], path[256];
    snprintf(d, sizeof d, "/tmp/pdmoe-big-release-XXXXXX");
    cr_assert_not_null(mkdtemp(d));
    const int64_t R = 2048, C = 16384, BR = 16384, BC = 16384;   /* FP8 [R, C]; bf16 [BR, BC] */
    const uint64_t nscale = (uint64_t)(R / 128) * (C / 128), nfp8 = (uint64_t)R * C, nbf = (uint64_t)BR * BC * 2;
    char hdr[1024];
    int hl = snprintf(hdr, sizeof hdr,
                      "{\"layers.0.attn.wq_b.scale\":{\"dtype\":\"F8_E8M0\",\"shape\":[%lld,%lld],\"data_offsets\":[0,%llu]},"
                      "\"layers.0.attn.wq_b.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[%lld,%lld],\"data_offsets\":[%llu,%llu]},"
                      "\"emb.weight\":{\"dtype\":\"BF16\",\"shape\":[%lld,%lld],\"data_offsets\":[%llu,%llu]}}",
                      (long long)(R / 128), (long long)(C / 128), (unsigned long long)nscale, (long long)R, (long long)C,
                      (unsigned long long)nscale, (unsigned long long)(nscale + nfp8), (long long)BR, (long long)BC,
                      (unsigned long long)(nscale + nfp8), (unsigned long long)(nscale + nfp8 + nbf));
    while (hl % 8)
        hdr[hl++] = ' ';
    snprintf(path, sizeof path, "%s/model.safetensors", d);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    uint64_t le = (uint64_t)hl;
    cr_assert_eq(fwrite(&le, 8, 1, f), 1);
    cr_assert_eq(fwrite(hdr, 1, (size_t)hl, f), (size_t)hl);
    for (uint64_t i = 0; i < nscale; i++)
        fputc(127 - 8, f);   /* scale 2^-8 */
    /* the FP8 values: one row of nonzero codes per 64, the rest (and the bf16 tensor) sparse zeros */
    for (int64_t r = 0; r < R; r += 64) {
        fseek(f, (long)(8 + hl + nscale + (uint64_t)r * C), SEEK_SET);
        for (int64_t c = 0; c < C; c++)
            fputc((int)((r + c * 7) % 0x7E), f);
    }
    cr_assert_eq(fclose(f), 0);
    cr_assert_eq(truncate(path, (off_t)(8 + hl + nscale + nfp8 + nbf)), 0);
    snprintf(path, sizeof path, "%s/config.json", d);
    f = fopen(path, "w");
    fputs("{\"quantization_config\": {\"quant_method\": \"fp8\"}}\n", f);
    fclose(f);

    snprintf(out, sizeof out, "/tmp/pdmoe-big-converted-XXXXXX");
    cr_assert_not_null(mkdtemp(out));
    const char *bin = getenv("PDMOE_BIN") ? getenv("PDMOE_BIN") : "build/pdmoe";
    char cmd[512], line[1024];
    snprintf(cmd, sizeof cmd, "%s convert --checkpoint %s --quantization w8a8 --out %s 2>&1", bin, d, out);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    double rss = -1;
    while (fgets(line, sizeof line, p)) {
        const char *k = strstr(line, "peak RSS ");
        if (k)
            rss = atof(k + 9);
    }
    cr_assert_eq(pclose(p), 0, "%s failed", cmd);
    double total_mib = (double)(8 + hl + nscale + nfp8 + nbf) / 1048576.0;
    cr_log_info("convert of a %.0f MiB checkpoint: peak RSS %.1f MiB", total_mib, rss);
    cr_assert_gt(rss, 0, "no peak RSS reported");
    cr_assert_lt(rss, total_mib / 4, "peak RSS %.1f MiB for a %.0f MiB checkpoint", rss, total_mib);
    /* and it converted: the matrix is int8 with a scale per row */
    struct pd_st_set s;
    pd_err e = {0};
    cr_assert_eq(pd_st_open_dir(out, PD_ST_HEADER_ONLY, &s, &e), 0, "%s", e.msg);
    const struct pd_st_tensor *w = pd_st_set_find(&s, "layers.0.attn.wq_b.weight");
    const struct pd_st_tensor *sc = pd_st_set_find(&s, "layers.0.attn.wq_b.weight_scale");
    cr_assert(w && sc && w->dtype == PD_ST_I8 && sc->shape[0] == R);
    cr_assert_null(pd_st_set_find(&s, "layers.0.attn.wq_b.scale"));
    pd_st_close_dir(&s);
    rm_model(d);
    rm_model(out);
}

/* A kept shard is the conversion's own to the bit: a scale one step off (within the rounding
 * tolerance, so it once verified and was kept) is converted again. */
Test(release, a_kept_shard_is_exactly_the_conversions)
{
    char out[64], path[256];
    struct pd_convert_stats st;
    convert_to(out, sizeof out, &st);
    snprintf(path, sizeof path, "%s/model-00002-of-00004.safetensors", out);
    struct pd_st_file f;
    pd_err e = {0};
    cr_assert_eq(pd_st_open(path, PD_ST_HEADER_ONLY, &f, &e), 0, "%s", e.msg);
    uint64_t at = 0, first = UINT64_MAX;   /* the scale stored first in the file */
    for (size_t i = 0; i < f.n; i++)
        if (f.tensors[i].dtype == PD_ST_F32 && strstr(f.tensors[i].name, "weight_scale") && f.tensors[i].begin < first)
            first = f.tensors[i].begin;
    if (first != UINT64_MAX)
        at = 8 + f.header_len + first;
    pd_st_close(&f);
    cr_assert_neq(at, 0);
    /* one step down: every value still rounds within half a step of the source (its ties were
     * rounded away from zero), so a tolerance check passes it */
    FILE *fp = fopen(path, "r+b");
    cr_assert_not_null(fp);
    float sc;
    fseek(fp, (long)at, SEEK_SET);
    cr_assert_eq(fread(&sc, 4, 1, fp), 1);
    sc = nextafterf(sc, 0);
    fseek(fp, (long)at, SEEK_SET);
    cr_assert_eq(fwrite(&sc, 4, 1, fp), 1);
    fclose(fp);
    struct pd_convert_opts o = {.in_dir = rel, .out_dir = out};
    cr_assert_eq(pd_convert(&o, &st, &e), 0, "%s", e.msg);
    cr_assert_eq(st.converted, 1, "a scale one step off was kept");
    rm_model(out);
}

/* The output directory: another model's index or shards there are refused by name (the index
 * won over the new weights and the engine ran the old model); links to the checkpoint's own files
 * are replaced, never written through; the chat template is copied; a second convert into a
 * directory being written is refused; a checkpoint without config.json fails before the output
 * directory is even made. */
Test(release, the_output_directory_is_the_conversions_alone)
{
    char out[64], path[512], cmd[1024];
    snprintf(out, sizeof out, "/tmp/pdmoe-converted-XXXXXX");
    cr_assert_not_null(mkdtemp(out));
    snprintf(path, sizeof path, "%s/model-00001-of-00002.safetensors", out);
    FILE *fp = fopen(path, "wb");
    fputs("another model", fp);
    fclose(fp);
    struct pd_convert_opts o = {.in_dir = rel, .out_dir = out};
    struct pd_convert_stats st;
    pd_err e = {0};
    cr_assert_neq(pd_convert(&o, &st, &e), 0);
    cr_assert(strstr(e.msg, "holds model-00001-of-00002.safetensors, which this conversion does not write"), "%s",
              e.msg);
    unlink(path);

    /* links in the output to the checkpoint's small files, and a chat template in the checkpoint */
    char tok_before[64], tok_after[64];
    snprintf(cmd, sizeof cmd, "sha256sum < %s/tokenizer.json", rel);
    FILE *p = popen(cmd, "r");
    cr_assert(fgets(tok_before, sizeof tok_before, p));
    pclose(p);
    snprintf(cmd, sizeof cmd, "ln -s %s/tokenizer.json %s/tokenizer.json && ln -s %s/config.json %s/config.json && "
             "printf 'TEMPLATE' > %s/chat_template.jinja", rel, out, rel, out, rel);
    cr_assert_eq(system(cmd), 0);
    cr_assert_eq(pd_convert(&o, &st, &e), 0, "%s", e.msg);
    snprintf(cmd, sizeof cmd, "sha256sum < %s/tokenizer.json", rel);
    p = popen(cmd, "r");
    cr_assert(fgets(tok_after, sizeof tok_after, p));
    pclose(p);
    cr_assert_str_eq(tok_before, tok_after, "the checkpoint's tokenizer.json was written through a link");
    snprintf(path, sizeof path, "%s/config.json", rel);
    json_error_t je;
    json_t *c = json_load_file(path, 0, &je);
    cr_assert_not_null(c, "the checkpoint's config.json: %s", je.text);
    cr_assert_not_null(json_object_get(c, "quantization_config"), "the checkpoint's config.json was rewritten");
    json_decref(c);
    struct stat sb;
    snprintf(path, sizeof path, "%s/config.json", out);
    cr_assert(lstat(path, &sb) == 0 && S_ISREG(sb.st_mode), "the output's config.json is not a file of its own");
    snprintf(path, sizeof path, "%s/chat_template.jinja", out);
    char buf[32] = {0};
    fp = fopen(path, "r");
    cr_assert_not_null(fp, "no chat template in the output");
    cr_assert(fgets(buf, sizeof buf, fp));
    fclose(fp);
    cr_assert_str_eq(buf, "TEMPLATE");
    snprintf(path, sizeof path, "%s/chat_template.jinja", rel);
    unlink(path);

    /* a convert holding the directory */
    snprintf(path, sizeof path, "%s/.pdmoe-convert.lock", out);
    int lfd = open(path, O_RDWR | O_CREAT, 0644);
    cr_assert_geq(lfd, 0);
    cr_assert_eq(flock(lfd, LOCK_EX), 0);
    cr_assert_neq(pd_convert(&o, &st, &e), 0);
    cr_assert(strstr(e.msg, "another pdmoe convert is writing it"), "%s", e.msg);
    close(lfd);
    unlink(path);
    rm_model(out);

    /* no config.json: nothing converted, no directory made */
    char bare[64];
    snprintf(bare, sizeof bare, "/tmp/pdmoe-bare-XXXXXX");
    cr_assert_not_null(mkdtemp(bare));
    snprintf(cmd, sizeof cmd, "cp %s/*.safetensors* %s/", rel, bare);
    cr_assert_eq(system(cmd), 0);
    snprintf(path, sizeof path, "%s/never-made", bare);
    struct pd_convert_opts ob = {.in_dir = bare, .out_dir = path};
    cr_assert_neq(pd_convert(&ob, &st, &e), 0);
    cr_assert(strstr(e.msg, "config.json"), "%s", e.msg);
    cr_assert_neq(access(path, F_OK), 0, "the output directory was made");
    rm_model(bare);
}

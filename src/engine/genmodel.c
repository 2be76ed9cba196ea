/* Synthetic checkpoints: every tensor of the inventory, generated from a seeded stream per name. */
#include "core/file.h"
#include "engine/genmodel.h"
#include "core/hash.h"
#include "engine/release.h"
#include "kernels/ops.h"
#include "kernels/quant.h"
#include "model/config.h"
#include "model/safetensors.h"
#include "model/tokenizer.h"
#include "plan/inventory.h"

#include <limits.h>
#include <assert.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t fnv1a(const char *s)
{
    return pd_fnv1a64(PD_FNV64_INIT, s, strlen(s));
}

/* Approximately standard normal: the sum of four 16-bit uniforms, centred and scaled (Irwin-Hall):
 * cheap, and the weights are quantised to int8 anyway. */
static float normal(uint64_t *s)
{
    uint64_t r = splitmix(s);
    double u = (double)(r & 0xffff) + (double)((r >> 16) & 0xffff) + (double)((r >> 32) & 0xffff) + (double)(r >> 48);
    return (float)((u - 4 * 32767.5) / (65536.0 * sqrt(4.0 / 12.0)));
}

static int ends(const char *s, const char *suf)
{
    size_t n = strlen(s), k = strlen(suf);
    return n >= k && strcmp(s + n - k, suf) == 0;
}

static float clampf(float x, float lo, float hi)
{
    return x < lo ? lo : x > hi ? hi : x;
}

/* Values of one float tensor, by what the tensor is.
 *
 * Norm gains, attention sinks and mHC scales are not their neutral values (1, 0, 1): with those
 * every test would pass whether or not the engine applies them. What the released V4-Flash
 * holds in them is not in shared/reference (it gives only their dtypes: norms bf16, sinks and mHC
 * parameters fp32), so the ranges below are pdmoe's choice, not measured on the release: shaped
 * like trained weights (gains spread around 1, sinks a few units either side of 0) and kept where
 * the activations stay well scaled (N is normal() below, which stays within +-3.47):
 *   RMSNorm gains (every "*norm.weight": attn/ffn, q/kv, compressor and indexer, final, MTP):
 *     1 + 0.25 N clamped to [0.2, 3], so within [0.2, 1.87] (then rounded to bf16);
 *   attention sinks (one logit per head, beside scores of about unit size): 2 N clamped to
 *     [-6, 6]: from a sink that takes most of a head's weight to one that takes almost none;
 *   mHC scales (hc_attn/ffn_scale [3], hc_head_scale [1]): exp(0.4 N), within [0.25, 4], median 1
 *     (alpha of the mHC paper, arXiv 2512.24880, which says only that training starts them small;
 *     only their product with hc_fn acts, and hc_fn is already small here). */
static void fill(const struct pd_model *m, const char *name, const struct pd_tensor *t, float *v, int64_t n,
                 uint64_t *rng)
{
    const int hc = m->hc_mult;
    const int64_t in = t->ndim == 2 ? t->shape[1] : t->shape[0];
    if (ends(name, "norm.weight")) {
        for (int64_t i = 0; i < n; i++)
            v[i] = clampf(1.0f + 0.25f * normal(rng), 0.2f, 3.0f);
    } else if (ends(name, "attn_sink")) {
        for (int64_t i = 0; i < n; i++)
            v[i] = clampf(2.0f * normal(rng), -6.0f, 6.0f);
    } else if (ends(name, "_fn")) {
        /* mixing logits of about 0.1 for a unit-RMS input */
        float sd = 0.1f / sqrtf((float)in);
        for (int64_t i = 0; i < n; i++)
            v[i] = sd * normal(rng);
    } else if (ends(name, "_scale") && strstr(name, "hc_")) {
        for (int64_t i = 0; i < n; i++)
            v[i] = expf(0.4f * normal(rng));
    } else if (ends(name, "_base")) {
        /* pre ~ 1/hc (a convex combination of the streams), post ~ 1, comb ~ uniform + noise */
        float pre = -logf((float)(hc > 1 ? hc - 1 : 1));
        for (int64_t i = 0; i < n; i++)
            v[i] = i < hc ? pre + 0.2f * normal(rng) : i < 2 * hc ? 0.2f * normal(rng) : 0.5f * normal(rng);
    } else if (ends(name, "compressor.ape")) {
        for (int64_t i = 0; i < n; i++)
            v[i] = 0.1f * normal(rng);
    } else if (ends(name, "gate.bias")) {
        for (int64_t i = 0; i < n; i++)
            v[i] = 0.01f * normal(rng);
    } else if (strcmp(name, "embed.weight") == 0) {
        for (int64_t i = 0; i < n; i++)
            v[i] = normal(rng);
    } else {
        /* a weight matrix [out, in]: N(0, 1/in); output projections scaled down by the depth so
         * the residual streams grow slowly */
        float sd = 1.0f / sqrtf((float)in);
        if (ends(name, "wo_b.weight") || ends(name, "w2.weight"))
            sd /= sqrtf(2.0f * (float)m->n_layers);
        for (int64_t i = 0; i < n; i++)
            v[i] = sd * normal(rng);
    }
}

struct out_list {
    struct pd_st_out *t;
    char **names;
    void **bufs;
    size_t n, cap;
};

static int push(struct out_list *o, const char *name, enum pd_st_dtype dt, const struct pd_tensor *t, int64_t rows,
                void *data)
{
    if (o->n == o->cap) {
        size_t cap = o->cap ? 2 * o->cap : 1024;
        struct pd_st_out *x = realloc(o->t, cap * sizeof *x);
        char **nm = realloc(o->names, cap * sizeof *nm);
        void **b = realloc(o->bufs, cap * sizeof *b);
        if (x)
            o->t = x;
        if (nm)
            o->names = nm;
        if (b)
            o->bufs = b;
        if (!x || !nm || !b)
            return PD_ENOMEM;
        o->cap = cap;
    }
    o->names[o->n] = strdup(name);
    if (!o->names[o->n])
        return PD_ENOMEM;
    struct pd_st_out *x = &o->t[o->n];
    memset(x, 0, sizeof *x);
    x->name = o->names[o->n];
    x->dtype = dt;
    if (rows >= 0) {
        x->ndim = 1;
        x->shape[0] = rows;
    } else {
        x->ndim = t->ndim;
        x->shape[0] = t->shape[0];
        x->shape[1] = t->shape[1];
    }
    x->data = data;
    o->bufs[o->n++] = data;
    return 0;
}

static void out_free(struct out_list *o)
{
    for (size_t i = 0; i < o->n; i++) {
        free(o->names[i]);
        free(o->bufs[i]);
    }
    free(o->t);
    free(o->names);
    free(o->bufs);
}

/* A draft that agrees with the main model at a chosen rate (--mtp-agreement R), by construction.
 * Over the tokenizer's ids [2, Vs) (past BOS and EOS) f is one seeded cycle through all of them
 * (Sattolo's shuffle: greedy decoding visits every id before it repeats), and a set S of tokens
 * is drawn with probability R each. With x_v the embedding of
 * v in its first hidden - 1 dims (N(0, 1) each) and its last dim a flag (4 for v outside S, else 0):
 *   main model:  head row f(v) = x_v / sqrt(hidden) (flag dim 0), rows of other ids small; the
 *                blocks' output projections (wo_b, w2) scaled by 1/20, so the hidden state after
 *                the last block stays close to the embedding and the greedy next token of v is
 *                f(v) (x_v . x_v ~ hidden beats x_w . x_v ~ sqrt(hidden) for every other w);
 *   MTP layer:   e_proj = identity on the first hidden - 1 dims plus the flag dim mapped onto
 *                x_{f^-1(2)} (the direction of head row 2); h_proj scaled by 1/100. At position i
 *                the draft reads e = enorm(embed(tok_{i+1})): for tok_{i+1} in S it is x_{tok_{i+1}}
 *                and the draft is f(tok_{i+1}), the main model's next greedy token; outside S the
 *                flag (4 x hidden against hidden) makes it token 2, wrong unless f(tok_{i+1}) = 2.
 * So the first draft is accepted at about rate R (the fraction of the tokens visited that lie in
 * S), the j-th about R^j. The rest of the checkpoint is the seeded synthetic one. */
struct agree {
    double rate;                 /* R; < 0: off */
    uint64_t seed;
    int vs;                      /* the tokenizer's ids */
    int32_t *finv;               /* [vs] f^-1 over [2, vs) */
};

static int agree_in_s(const struct agree *a, int32_t v)
{
    uint64_t st = a->seed ^ (0x5bd1e995ull * (uint64_t)(v + 1));
    return (double)(splitmix(&st) >> 11) / 9007199254740992.0 < a->rate;
}

/* x_v: hidden - 1 normal values from the token's own stream, then the flag. */
static void agree_row(const struct agree *a, int32_t v, float *x, int H)
{
    uint64_t st = a->seed ^ fnv1a("embed.weight") ^ (0x9e3779b97f4a7c15ull * (uint64_t)(v + 1));
    for (int i = 0; i < H - 1; i++)
        x[i] = normal(&st);
    x[H - 1] = v >= 2 && v < a->vs && !agree_in_s(a, v) ? 4.0f : 0.0f;
}

/* The tensors the construction sets (the others as fill made them). */
static void agree_fill(const struct agree *a, const struct pd_model *m, const char *name, float *v, int64_t n)
{
    const int H = (int)m->hidden_size;
    if (strcmp(name, "embed.weight") == 0) {
        for (int64_t r = 0; r < m->vocab_size; r++)
            agree_row(a, (int32_t)r, v + r * H, H);
    } else if (strcmp(name, "head.weight") == 0) {
        const float c = 1.0f / sqrtf((float)H);
        for (int64_t r = 0; r < m->vocab_size; r++) {
            float *row = v + r * H;
            if (r >= 2 && r < a->vs) {
                agree_row(a, a->finv[r], row, H);
                for (int i = 0; i < H - 1; i++)
                    row[i] *= c;
            } else {
                for (int i = 0; i < H - 1; i++)
                    row[i] *= 0.1f;
            }
            row[H - 1] = 0;
        }
    } else if (strstr(name, "e_proj.weight")) {
        float *x = malloc((size_t)H * sizeof *x);
        if (!x)
            return;   /* keeps fill's values: the acceptance measured shows it */
        agree_row(a, a->finv[2], x, H);
        memset(v, 0, (size_t)n * sizeof *v);
        for (int i = 0; i < H - 1; i++) {
            v[(int64_t)i * H + i] = 1;
            v[(int64_t)i * H + H - 1] = x[i];
        }
        free(x);
    } else if (strstr(name, "h_proj.weight")) {
        for (int64_t i = 0; i < n; i++)
            v[i] *= 0.01f;
    } else if (ends(name, "wo_b.weight") || ends(name, "w2.weight")) {
        for (int64_t i = 0; i < n; i++)
            v[i] *= 0.05f;
    }
}

/* rel: the tensor's format in the release (FP8, FP4 or a float dtype) */
static int gen_tensor(const struct pd_model *m, const struct pd_tensor *t, enum pd_fmt rel, const char *name,
                      uint64_t seed, const struct agree *ag, enum pd_gen_format gfmt, struct out_list *o, pd_err *e)
{
    uint64_t rng = seed ^ fnv1a(name);
    const int64_t n = t->params;
    if (t->fmt == PD_FMT_I64) {
        /* tid2eid [vocab, k]: k distinct experts per token */
        int64_t *v = malloc((size_t)n * 8);
        if (!v)
            return pd_err_set(e, PD_ENOMEM, "out of memory");
        const int k = (int)t->shape[1], E = m->n_routed_experts;
        for (int64_t r = 0; r < t->shape[0]; r++)
            for (int j = 0; j < k; j++) {
                int64_t x;
                int dup;
                do {
                    x = (int64_t)(splitmix(&rng) % (uint64_t)E);
                    dup = 0;
                    for (int q = 0; q < j; q++)
                        dup |= v[r * k + q] == x;
                } while (dup);
                v[r * k + j] = x;
            }
        return push(o, name, PD_ST_I64, t, -1, v) ? pd_err_set(e, PD_ENOMEM, "out of memory") : 0;
    }
    float *f = malloc((size_t)n * sizeof *f);
    if (!f)
        return pd_err_set(e, PD_ENOMEM, "out of memory for %s", name);
    fill(m, name, t, f, n, &rng);
    if (ag)
        agree_fill(ag, m, name, f, n);
    int rc = 0;
    /* The release and release-w8a8 layouts: a matrix the release stores in FP8 (FP4 for routed
     * experts) is drawn onto that format's grid, so both hold the same model and loading either
     * gives the engine the same weights (int8 where a W8A8 deployment quantises, the FP8 values
     * in bf16 where it does not: wq_a, wkv, wo_a). (The default layout keeps the draws as they are.) */
    if (gfmt != PD_GEN_W8A8 && (rel == PD_FMT_FP8 || rel == PD_FMT_FP4)) {
        enum pd_release_fmt rf = rel == PD_FMT_FP4 ? PD_RELEASE_FP4 : PD_RELEASE_FP8;
        if ((rc = pd_release_round(rf, f, (int)t->shape[0], (int)t->shape[1]))) {
            free(f);
            return rc == PD_ENOMEM ? pd_err_set(e, rc, "out of memory for %s", name)
                                   : pd_err_set(e, rc, "%s: %lld columns cannot be packed two per byte", name,
                                                (long long)t->shape[1]);
        }
    }
    if (t->fmt == PD_FMT_W8A8) {
        int rows = (int)t->shape[0], cols = (int)t->shape[1];
        int8_t *q = malloc((size_t)n);
        float *s = malloc((size_t)rows * sizeof *s);
        if (!q || !s) {
            free(q);
            free(s);
            free(f);
            return pd_err_set(e, PD_ENOMEM, "out of memory for %s", name);
        }
        pd_quant_weights(f, rows, cols, q, s);
        free(f);
        char sname[160];
        snprintf(sname, sizeof sname, "%s_scale", name);
        rc = push(o, name, PD_ST_I8, t, -1, q);
        if (!rc)
            rc = push(o, sname, PD_ST_F32, t, rows, s);
        else
            free(s);
    } else if (t->fmt == PD_FMT_FP8 || t->fmt == PD_FMT_FP4) {
        /* the release's formats: e4m3 with ue8m0 [128, 128] block scales, or e2m1 two per byte
         * with a ue8m0 scale per 1 x 32 (engine/release.h) */
        enum pd_release_fmt rf = t->fmt == PD_FMT_FP8 ? PD_RELEASE_FP8 : PD_RELEASE_FP4;
        int rows = (int)t->shape[0], cols = (int)t->shape[1];
        int64_t sr, sc;
        pd_release_scale_shape(rf, rows, cols, &sr, &sc);
        if (rf == PD_RELEASE_FP4 && cols % 2) {
            free(f);
            return pd_err_set(e, PD_EINVAL, "%s: %d columns cannot be packed two per byte", name, cols);
        }
        size_t qbytes = rf == PD_RELEASE_FP8 ? (size_t)n : (size_t)rows * (size_t)(cols / 2);
        uint8_t *q = malloc(qbytes), *sb = malloc((size_t)(sr * sc));
        if (!q || !sb) {
            free(q);
            free(sb);
            free(f);
            return pd_err_set(e, PD_ENOMEM, "out of memory for %s", name);
        }
        if (rf == PD_RELEASE_FP8)
            pd_release_fp8_encode(f, rows, cols, q, sb);
        else
            pd_release_fp4_encode(f, rows, cols, q, sb);
        free(f);
        char sname[160];
        pd_release_scale_name(name, sname, sizeof sname);
        struct pd_tensor qt = *t, st = *t;
        if (rf == PD_RELEASE_FP4)
            qt.shape[1] = cols / 2;
        st.shape[0] = sr;
        st.shape[1] = sc;
        rc = push(o, name, rf == PD_RELEASE_FP8 ? PD_ST_F8_E4M3 : PD_ST_I8, &qt, -1, q);
        if (!rc)
            rc = push(o, sname, PD_ST_F8_E8M0, &st, -1, sb);
        else
            free(sb);
    } else if (t->fmt == PD_FMT_BF16) {
        uint16_t *b = malloc((size_t)n * 2);
        if (!b) {
            free(f);
            return pd_err_set(e, PD_ENOMEM, "out of memory for %s", name);
        }
        for (int64_t i = 0; i < n; i++)
            b[i] = pd_f32_to_bf16(f[i]);
        free(f);
        rc = push(o, name, PD_ST_BF16, t, -1, b);
    } else if (t->fmt == PD_FMT_F32) {
        rc = push(o, name, PD_ST_F32, t, -1, f);
    } else {
        free(f);
        return pd_err_set(e, PD_EINVAL, "%s: format %s is not generated", name, pd_fmt_name(t->fmt));
    }
    return rc ? pd_err_set(e, PD_ENOMEM, "out of memory") : 0;
}

static int write_text(const char *path, const char *text, pd_err *e)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return pd_err_set(e, PD_EIO, "%s: cannot create: %s", path, strerror(errno));
    size_t n = strlen(text);
    int bad = fwrite(text, 1, n, f) != n;
    bad |= fclose(f) != 0;
    return bad ? pd_err_set(e, PD_EIO, "%s: write failed", path) : 0;
}

static uint64_t out_bytes(const struct pd_st_out *t)
{
    uint64_t n = pd_st_dtype_size(t->dtype);
    for (int d = 0; d < t->ndim; d++)
        n *= (uint64_t)t->shape[d];
    return n;
}

/* The release's shards: about 4 files of similar size, cut at tensor boundaries and named as
 * Hugging Face names them, with model.safetensors.index.json mapping every tensor to its file. */
static int write_shards(const char *dir, const struct out_list *o, pd_err *e)
{
    enum { SHARDS = 4 };
    uint64_t total = 0;
    for (size_t i = 0; i < o->n; i++)
        total += out_bytes(&o->t[i]);
    json_t *root = json_object(), *map = json_object(), *meta = json_object();
    if (!root || !map || !meta) {
        json_decref(root);
        json_decref(map);
        json_decref(meta);
        return pd_err_set(e, PD_ENOMEM, "out of memory");
    }
    json_object_set_new(meta, "total_size", json_integer((json_int_t)total));
    json_object_set_new(root, "metadata", meta);
    json_object_set_new(root, "weight_map", map);
    /* the cut points first, so every name carries the count of files */
    size_t cut[SHARDS + 1] = {0};
    int nshards = 0;
    uint64_t acc = 0;
    for (size_t i = 0; i < o->n; i++) {
        acc += out_bytes(&o->t[i]);
        if (acc * SHARDS >= total * (uint64_t)(nshards + 1) && nshards < SHARDS - 1 && i + 1 < o->n)
            cut[++nshards] = i + 1;
    }
    cut[++nshards] = o->n;
    int rc = 0;
    char file[64], path[PATH_MAX];
    for (int k = 0; k < nshards && !rc; k++) {
        snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", k + 1, nshards);
        if ((rc = pd_path_join(path, sizeof path, dir, file, e)))
            break;
        for (size_t i = cut[k]; i < cut[k + 1]; i++)
            json_object_set_new(map, o->t[i].name, json_string(file));
        rc = pd_st_write(path, o->t + cut[k], cut[k + 1] - cut[k], e);
    }
    if (!rc)
        rc = pd_path_join(path, sizeof path, dir, "model.safetensors.index.json", e);
    if (!rc && json_dump_file(root, path, JSON_INDENT(2) | JSON_SORT_KEYS))
        rc = pd_err_set(e, PD_EIO, "%s: cannot write", path);
    json_decref(root);
    return rc;
}

/* The preset's config.json as the release ships it: with its quantization_config (FP8 e4m3,
 * ue8m0 scales, [128, 128] blocks) added when the preset has none. */
static char *release_config(const char *text)
{
    if (strstr(text, "\"quantization_config\""))
        return strdup(text);
    static const char qc[] = "\n  \"quantization_config\": {\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\", "
                             "\"quant_method\": \"fp8\", \"scale_fmt\": \"ue8m0\", \"weight_block_size\": [128, 128]},";
    const char *brace = strchr(text, '{');
    if (!brace)
        return NULL;
    size_t head = (size_t)(brace + 1 - text), n = strlen(text);
    char *out = malloc(n + sizeof qc);
    if (!out)
        return NULL;
    memcpy(out, text, head);
    memcpy(out + head, qc, sizeof qc - 1);
    memcpy(out + head + sizeof qc - 1, text + head, n - head + 1);
    return out;
}

int pd_genmodel(const char *preset, const char *out_dir, uint64_t seed, pd_err *e)
{
    return pd_genmodel_opts(preset, out_dir, seed, PD_GEN_W8A8, -1, e);
}

int pd_genmodel_agree(const char *preset, const char *out_dir, uint64_t seed, double mtp_agreement, pd_err *e)
{
    return pd_genmodel_opts(preset, out_dir, seed, PD_GEN_W8A8, mtp_agreement, e);
}

int pd_genmodel_fmt(const char *preset, const char *out_dir, uint64_t seed, enum pd_gen_format fmt, pd_err *e)
{
    return pd_genmodel_opts(preset, out_dir, seed, fmt, -1, e);
}

int pd_genmodel_opts(const char *preset, const char *out_dir, uint64_t seed, enum pd_gen_format fmt,
                     double mtp_agreement, pd_err *e)
{
    struct pd_model m;
    int rc = pd_model_load_as("--preset", preset, &m, e);
    if (rc)
        return rc;
    struct agree ag = {.rate = mtp_agreement, .seed = seed, .vs = m.vocab_size < 1024 ? (int)m.vocab_size : 1024};
    if (mtp_agreement >= 0) {
        if (mtp_agreement > 1)
            return pd_err_set(e, PD_EINVAL, "--mtp-agreement %g: a rate in [0, 1]", mtp_agreement);
        if (m.n_mtp_layers < 1 || m.tie_word_embeddings || ag.vs < 8 || m.hidden_size < 16)
            return pd_err_set(e, PD_EINVAL, "--mtp-agreement: preset %s needs an MTP layer, an untied head, at least 8 "
                              "token ids and 16 hidden dims", preset);
    }
    if (m.arch != PD_ARCH_DEEPSEEK_V4)
        return pd_err_set(e, PD_EINVAL, "%s is %s; the engine runs deepseek_v4 models", preset,
                          pd_model_arch_name(m.arch));
    struct pd_quant q, qr;
    struct pd_inventory inv, rel;
    /* the release: FP8 matrices, FP4 routed experts (inventory.c says which); the W8A8 layout:
     * int8 where a W8A8 deployment quantises. The two inventories list the same tensors in the
     * same order. */
    if ((rc = pd_quant_init(&qr, "fp8", "routed_experts=fp4", 1, e)) ||
        (rc = pd_quant_init(&q, "w8a8", NULL, m.ckpt_scale_ue8m0, e)))
        return rc;
    if ((rc = pd_inventory_build(&m, &qr, 1, &rel, e)))
        return rc;
    if ((rc = pd_inventory_build(&m, fmt == PD_GEN_RELEASE ? &qr : &q, 1, &inv, e))) {
        pd_inventory_free(&rel);
        return rc;
    }
    assert(inv.n == rel.n);
    /* every tensor is built in memory before the file is written: a checkpoint that would not
     * fit is refused now, rather than growing until the kernel kills the process */
    int64_t total = 0;
    for (int i = 0; i < inv.n; i++)
        total += inv.t[i].bytes * inv.t[i].count;
    long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    double avail = pages > 0 && page > 0 ? (double)pages * (double)page : 0;
    if (avail > 0 && (double)total > 0.8 * avail) {
        rc = pd_err_set(e, PD_EINVAL, "--preset %s: its checkpoint is %.2f GB (10^9 bytes), which gen-model builds in "
                        "memory before writing it, and this machine has %.2f GB free: a synthetic checkpoint is for "
                        "the smaller presets (v4-tiny, v4-flash-mini)", preset, total / 1e9, avail / 1e9);
    } else if (mkdir(out_dir, 0755) && errno != EEXIST) {
        rc = pd_err_set(e, PD_EIO, "%s: cannot create the directory: %s", out_dir, strerror(errno));
    }
    if (rc) {
        pd_inventory_free(&inv);
        pd_inventory_free(&rel);
        return rc;
    }
    struct out_list o = {0};
    char path[PATH_MAX], name[128];
    int32_t *cyc = NULL;
    if (mtp_agreement >= 0) {
        /* f: the cycle cyc[0] -> cyc[1] -> ... -> cyc[N-1] -> cyc[0] over [2, vs) */
        const int N = ag.vs - 2;
        ag.finv = malloc((size_t)ag.vs * sizeof *ag.finv);
        cyc = malloc((size_t)N * sizeof *cyc);
        if (!ag.finv || !cyc)
            rc = pd_err_set(e, PD_ENOMEM, "out of memory");
        uint64_t st = seed ^ 0x243f6a8885a308d3ull;
        for (int i = 0; !rc && i < N; i++)
            cyc[i] = 2 + i;
        for (int i = N - 1; !rc && i > 0; i--) {
            int j = (int)(splitmix(&st) % (uint64_t)i);   /* Sattolo: j < i, one cycle */
            int32_t t = cyc[i];
            cyc[i] = cyc[j];
            cyc[j] = t;
        }
        for (int i = 0; !rc && i < N; i++)
            ag.finv[cyc[(i + 1) % N]] = cyc[i];
    }
    for (int i = 0; i < inv.n && !rc; i++)
        for (int k = 0; k < inv.t[i].count && !rc; k++)
            rc = gen_tensor(&m, &inv.t[i], rel.t[i].fmt, pd_inventory_expand_name(&inv.t[i], k, name, sizeof name),
                            seed, ag.finv ? &ag : NULL, fmt, &o, e);
    free(ag.finv);
    free(cyc);
    if (!rc && fmt == PD_GEN_RELEASE) {
        rc = write_shards(out_dir, &o, e);
    } else if (!rc) {
        rc = pd_path_join(path, sizeof path, out_dir, "model.safetensors", e);
        if (!rc)
            rc = pd_st_write(path, o.t, o.n, e);
    }
    out_free(&o);
    pd_inventory_free(&inv);
    pd_inventory_free(&rel);
    if (rc)
        return rc;
    /* config.json: the preset as it is, so the planner and the engine read the same config */
    char *text = NULL;
    const char *embedded = pd_embedded_find(m.source);
    if (!embedded) {
        FILE *f = fopen(m.source, "rb");
        if (!f)
            return pd_err_set(e, PD_EIO, "%s: cannot read", m.source);
        fseek(f, 0, SEEK_END);
        long n = ftell(f);
        fseek(f, 0, SEEK_SET);
        text = calloc((size_t)n + 1, 1);
        if (!text || fread(text, 1, (size_t)n, f) != (size_t)n) {
            fclose(f);
            free(text);
            return pd_err_set(e, PD_EIO, "%s: cannot read", m.source);
        }
        fclose(f);
    }
    if ((rc = pd_path_join(path, sizeof path, out_dir, "config.json", e))) {
        free(text);
        return rc;
    }
    if (fmt == PD_GEN_RELEASE) {
        char *rtext = release_config(embedded ? embedded : text);
        free(text);
        if (!rtext)
            return pd_err_set(e, PD_EFORMAT, "%s: cannot add quantization_config", m.source);
        text = rtext;
        embedded = NULL;
    }
    rc = write_text(path, embedded ? embedded : text, e);
    free(text);
    if (rc)
        return rc;
    /* tokenizer.json: byte-level BPE learnt from the embedded corpus, DeepSeek's special tokens */
    const char *corpus = pd_embedded_find("models/corpus.txt");
    static const char *const special[] = {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"};
    char *json = NULL;
    /* the corpus supports about a thousand merges; the model may have more rows than tokens */
    int vocab = m.vocab_size < 1024 ? (int)m.vocab_size : 1024;
    if ((rc = pd_tok_train(corpus, strlen(corpus), vocab, special, 2, &json, e)))
        return rc;
    if (!(rc = pd_path_join(path, sizeof path, out_dir, "tokenizer.json", e)))
        rc = write_text(path, json, e);
    free(json);
    return rc;
}

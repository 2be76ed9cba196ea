/* Weight formats, their exact byte counts, and quantisation schemes with per-group overrides. */
#include "plan/quant.h"

#include <stdio.h>
#include <string.h>

static const struct { enum pd_group g; const char *name, *title; } groups[] = {
    {PD_G_EMBEDDING, "embedding", "Embedding"},
    {PD_G_LM_HEAD, "lm_head", "LM head"},
    {PD_G_ATTENTION, "attention", "Attention"},
    {PD_G_COMPRESSOR, "compressor_indexer", "Compressor + indexer"},
    {PD_G_SHARED_EXPERT, "shared_expert", "Shared expert"},
    {PD_G_DENSE_FFN, "dense_ffn", "Dense FFN"},
    {PD_G_ROUTER, "router", "Router"},
    {PD_G_NORMS_MHC, "norms_mhc", "Norms + mHC"},
    {PD_G_MTP, "mtp", "MTP layer"},
    {PD_G_ROUTED_EXPERTS, "routed_experts", "Routed experts"},
};

const char *pd_group_name(enum pd_group g)
{
    return (unsigned)g < PD_G_COUNT ? groups[g].name : "?";
}

const char *pd_group_title(enum pd_group g)
{
    return (unsigned)g < PD_G_COUNT ? groups[g].title : "?";
}

int pd_group_parse(const char *s, enum pd_group *g)
{
    for (int i = 0; i < PD_G_COUNT; i++)
        if (strcmp(s, groups[i].name) == 0) {
            *g = groups[i].g;
            return 0;
        }
    return PD_EINVAL;
}

int pd_group_tp_split(enum pd_group g)
{
    return g == PD_G_EMBEDDING || g == PD_G_LM_HEAD || g == PD_G_ATTENTION || g == PD_G_SHARED_EXPERT ||
           g == PD_G_DENSE_FFN || g == PD_G_COMPRESSOR || g == PD_G_MTP;
}

static const char *fmt_names[PD_FMT_COUNT] = {"fp32", "bf16", "fp16", "int64", "int32",
                                              "w8a8", "fp8", "fp4", "w4a8", "raw"};

const char *pd_fmt_name(enum pd_fmt f)
{
    return f >= 0 && f < PD_FMT_COUNT ? fmt_names[f] : "none";
}

int pd_fmt_parse(const char *s, enum pd_fmt *f)
{
    static const enum pd_fmt ok[] = {PD_FMT_W8A8, PD_FMT_W4A8, PD_FMT_FP8, PD_FMT_FP4, PD_FMT_BF16, PD_FMT_F32};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        if (strcmp(s, fmt_names[ok[i]]) == 0) {
            *f = ok[i];
            return 0;
        }
    return PD_EINVAL;
}

static int64_t cdiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

int64_t pd_fmt_scale_bytes(enum pd_fmt f, int ndim, const int64_t *shape, const struct pd_quant *q)
{
    int64_t rows = ndim >= 2 ? shape[0] : 1, cols = ndim >= 2 ? shape[1] : shape[0];
    switch (f) {
    case PD_FMT_W8A8: case PD_FMT_W4A8: return 4 * rows;
    case PD_FMT_FP8: return (int64_t)q->fp8_scale_bytes * cdiv(rows, q->fp8_block) * cdiv(cols, q->fp8_block);
    case PD_FMT_FP4: return rows * cdiv(cols, 32);
    default: return 0;
    }
}

int64_t pd_fmt_bytes(enum pd_fmt f, int ndim, const int64_t *shape, const struct pd_quant *q)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    int64_t rows = ndim >= 2 ? shape[0] : 1, cols = ndim >= 2 ? shape[1] : shape[0];
    switch (f) {
    case PD_FMT_F32: case PD_FMT_I32: return 4 * n;
    case PD_FMT_BF16: case PD_FMT_F16: return 2 * n;
    case PD_FMT_I64: return 8 * n;
    case PD_FMT_W8A8: case PD_FMT_FP8: return n + pd_fmt_scale_bytes(f, ndim, shape, q);
    case PD_FMT_FP4: case PD_FMT_W4A8: return rows * cdiv(cols, 2) + pd_fmt_scale_bytes(f, ndim, shape, q);
    default: return 0;
    }
}

int pd_quant_init(struct pd_quant *q, const char *scheme, const char *overrides, int ue8m0_scales, pd_err *e)
{
    memset(q, 0, sizeof *q);
    for (int g = 0; g < PD_G_COUNT; g++)
        q->group_fmt[g] = PD_FMT_NONE;
    q->fp8_block = 128;
    q->fp8_scale_bytes = ue8m0_scales ? 1 : 4;
    if (pd_fmt_parse(scheme, &q->linear) || q->linear == PD_FMT_F32)
        return pd_err_set(e, PD_EINVAL, "--quant %s: unknown scheme (w8a8, w4a8, fp8, fp4, bf16)", scheme);
    q->w8a8_groups = q->linear == PD_FMT_W8A8 || q->linear == PD_FMT_W4A8;
    if (q->linear == PD_FMT_W4A8) {      /* routed experts int4, the rest W8A8 (quant.h) */
        q->linear = PD_FMT_W8A8;
        q->group_fmt[PD_G_ROUTED_EXPERTS] = PD_FMT_W4A8;
    }
    if (!overrides)
        return 0;
    if (!*overrides)
        return pd_err_set(e, PD_EINVAL, "--quant-override: empty (GROUP=FORMAT[,GROUP=FORMAT...])");
    char buf[256];
    snprintf(buf, sizeof buf, "%s", overrides);
    int given[PD_G_COUNT] = {0};
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(tok, '=');
        enum pd_group g;
        enum pd_fmt f;
        if (!eq)
            return pd_err_set(e, PD_EINVAL, "--quant-override %s: expected GROUP=FORMAT", tok);
        *eq = 0;
        if (pd_group_parse(tok, &g))
            return pd_err_set(e, PD_EINVAL,
                              "--quant-override: unknown group \"%s\" (embedding, lm_head, attention, compressor_indexer, shared_expert, dense_ffn, router, norms_mhc, mtp, routed_experts)",
                              tok);
        if (pd_fmt_parse(eq + 1, &f))
            return pd_err_set(e, PD_EINVAL, "--quant-override %s: unknown format \"%s\" (w8a8, w4a8, fp8, fp4, bf16, fp32)",
                              tok, eq + 1);
        if (g == PD_G_NORMS_MHC)   /* (accepted and shown in the header, it once changed nothing) */
            return pd_err_set(e, PD_EINVAL, "--quant-override %s=%s: the norms and mHC weights are vectors and small "
                              "fp32 mixing matrices that keep their own formats; no format applies to them", tok, eq + 1);
        if (given[g]++)   /* routed_experts=fp4,routed_experts=bf16 once kept the last without a word */
            return pd_err_set(e, PD_EINVAL, "--quant-override: the group %s is given twice", tok);
        q->group_fmt[g] = f;
    }
    return 0;
}

const char *pd_quant_describe(const struct pd_quant *q, char *buf, int n)
{
    int k = snprintf(buf, (size_t)n, "%s", pd_fmt_name(q->linear));
    int first = 1;
    for (int g = 0; g < PD_G_COUNT && k < n; g++) {
        if (q->group_fmt[g] == PD_FMT_NONE)
            continue;
        k += snprintf(buf + k, (size_t)(n - k), "%s%s=%s", first ? " (" : ", ", pd_group_name(g),
                      pd_fmt_name(q->group_fmt[g]));
        first = 0;
    }
    if (!first && k < n)
        snprintf(buf + k, (size_t)(n - k), ")");
    return buf;
}

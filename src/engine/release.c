/* The release's FP8/FP4 matrices: encoding, decoding and conversion to int8 (release.h). */
#include "engine/release.h"
#include "kernels/fp4.h"
#include "kernels/fp8.h"
#include "kernels/quant.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *pd_release_scale_name(const char *weight, char *buf, size_t n)
{
    size_t k = strlen(weight);
    if (k > 7 && strcmp(weight + k - 7, ".weight") == 0)
        snprintf(buf, n, "%.*s.scale", (int)(k - 7), weight);
    else
        snprintf(buf, n, "%s.scale", weight);
    return buf;
}

void pd_release_scale_shape(enum pd_release_fmt f, int64_t out, int64_t in, int64_t *rows, int64_t *cols)
{
    const int64_t B = PD_RELEASE_FP8_BLOCK, G = PD_RELEASE_FP4_BLOCK;
    if (f == PD_RELEASE_FP8) {
        *rows = (out + B - 1) / B;
        *cols = (in + B - 1) / B;
    } else {
        *rows = out;
        *cols = (in + G - 1) / G;
    }
}

void pd_release_fp8_encode(const float *w, int out, int in, uint8_t *q, uint8_t *s)
{
    const int B = PD_RELEASE_FP8_BLOCK, sc = (in + B - 1) / B;
    for (int r0 = 0; r0 < out; r0 += B)
        for (int c0 = 0; c0 < in; c0 += B) {
            int r1 = r0 + B < out ? r0 + B : out, c1 = c0 + B < in ? c0 + B : in;
            float amax = 0;
            for (int r = r0; r < r1; r++)
                for (int c = c0; c < c1; c++)
                    amax = fmaxf(amax, fabsf(w[(size_t)r * in + c]));
            uint8_t b = pd_ue8m0_scale(amax, PD_E4M3_MAX, 1e-4f);
            s[(r0 / B) * sc + c0 / B] = b;
            float inv = 1.0f / pd_ue8m0_value(b);   /* exact: a power of two */
            for (int r = r0; r < r1; r++)
                for (int c = c0; c < c1; c++)
                    q[(size_t)r * in + c] = pd_e4m3_encode(w[(size_t)r * in + c] * inv);
        }
}

void pd_release_fp4_encode(const float *w, int out, int in, uint8_t *q, uint8_t *s)
{
    const int G = PD_RELEASE_FP4_BLOCK, sc = (in + G - 1) / G;
    for (int r = 0; r < out; r++) {
        const float *row = w + (size_t)r * in;
        uint8_t *qr = q + (size_t)r * (in / 2);
        for (int c0 = 0, j = 0; c0 < in; c0 += G, j++) {
            int c1 = c0 + G < in ? c0 + G : in;
            float amax = 0;
            for (int c = c0; c < c1; c++)
                amax = fmaxf(amax, fabsf(row[c]));
            uint8_t b = pd_ue8m0_scale(amax, PD_E2M1_MAX, PD_E2M1_MAX * 0x1p-126f);
            s[(size_t)r * sc + j] = b;
            float inv = 1.0f / pd_ue8m0_value(b);
            for (int c = c0; c < c1; c += 2) {
                uint8_t lo = pd_e2m1_encode(row[c] * inv), hi = pd_e2m1_encode(row[c + 1] * inv);
                qr[c / 2] = (uint8_t)(lo | hi << 4);
            }
        }
    }
}

/* The decoders' values by code, filled once from pd_e4m3_decode and pd_e2m1_decode (the one
 * decoder of each format): a table lookup per value in the loops below. */
static float e4m3_tab[256], e2m1_tab[16];
static pthread_once_t tab_once = PTHREAD_ONCE_INIT;

static void tab_init(void)
{
    for (int c = 0; c < 256; c++)
        e4m3_tab[c] = pd_e4m3_decode((uint8_t)c);
    for (int c = 0; c < 16; c++)
        e2m1_tab[c] = pd_e2m1_decode((uint8_t)c);
}

void pd_release_decode_row(enum pd_release_fmt f, const uint8_t *q, const uint8_t *s, int out, int in, int r,
                           float *row)
{
    (void)out;
    pthread_once(&tab_once, tab_init);
    if (f == PD_RELEASE_FP8) {
        const int B = PD_RELEASE_FP8_BLOCK, sc = (in + B - 1) / B;
        const uint8_t *qr = q + (size_t)r * in, *sr = s + (size_t)(r / B) * sc;
        for (int c0 = 0; c0 < in; c0 += B) {
            float sv = pd_ue8m0_value(sr[c0 / B]);
            int c1 = c0 + B < in ? c0 + B : in;
            for (int c = c0; c < c1; c++)
                row[c] = e4m3_tab[qr[c]] * sv;
        }
    } else {
        const int G = PD_RELEASE_FP4_BLOCK, sc = (in + G - 1) / G;
        const uint8_t *qr = q + (size_t)r * (in / 2), *sr = s + (size_t)r * sc;
        for (int c0 = 0; c0 < in; c0 += G) {
            float sv = pd_ue8m0_value(sr[c0 / G]);
            int c1 = c0 + G < in ? c0 + G : in;
            /* byte j holds column 2j in its low nibble, 2j + 1 in its high one */
            for (int c = c0; c < c1; c += 2) {
                row[c] = e2m1_tab[qr[c / 2] & 15] * sv;
                row[c + 1] = e2m1_tab[qr[c / 2] >> 4] * sv;
            }
        }
    }
}

static int shape_is(const struct pd_st_tensor *t, int64_t a, int64_t b)
{
    return t->ndim == 2 && t->shape[0] == a && t->shape[1] == b;
}

int pd_release_find(const struct pd_st_set *st, const char *name, int out, int in, struct pd_release_mat *m,
                    pd_err *e)
{
    memset(m, 0, sizeof *m);
    const struct pd_st_tensor *w = pd_st_set_find(st, name);
    if (!w)
        return 0;
    char sname[192];
    pd_release_scale_name(name, sname, sizeof sname);
    const struct pd_st_tensor *s = pd_st_set_find(st, sname);
    if (w->dtype == PD_ST_F8_E4M3)
        m->fmt = PD_RELEASE_FP8;
    else if (w->dtype == PD_ST_I8 && s)   /* pdmoe's own int8 has "X.weight_scale" instead */
        m->fmt = PD_RELEASE_FP4;
    else
        return 0;
    m->w = w;
    m->s = s;
    m->out = out;
    m->in = in;
    const char *wf = pd_st_set_path_of(st, w);
    if (m->fmt == PD_RELEASE_FP8 && !shape_is(w, out, in))
        return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\" (F8_E4M3) has shape [%lld, %lld], the config needs [%d, %d]",
                          wf, name, (long long)w->shape[0], (long long)(w->ndim > 1 ? w->shape[1] : 0), out, in);
    if (m->fmt == PD_RELEASE_FP4 && (in % 2 || !shape_is(w, out, in / 2)))
        return pd_err_set(e, PD_EFORMAT,
                          "%s: tensor \"%s\" (FP4, two per byte in I8) has shape [%lld, %lld], the config needs [%d, %d]",
                          wf, name, (long long)w->shape[0], (long long)(w->ndim > 1 ? w->shape[1] : 0), out, in / 2);
    if (!s)
        return pd_err_set(e, PD_EFORMAT, "%s: tensor \"%s\" is F8_E4M3 but its scale tensor \"%s\" is missing", wf, name,
                          sname);
    int64_t sr, sc;
    pd_release_scale_shape(m->fmt, out, in, &sr, &sc);
    if (s->dtype != PD_ST_F8_E8M0)
        return pd_err_set(e, PD_EFORMAT, "%s: scale tensor \"%s\" is %s, expected F8_E8M0", pd_st_set_path_of(st, s), sname,
                          pd_st_dtype_name(s->dtype));
    if (!shape_is(s, sr, sc))
        return pd_err_set(e, PD_EFORMAT, "%s: scale tensor \"%s\" has shape [%lld, %lld], %s [%d, %d] needs [%lld, %lld]",
                          pd_st_set_path_of(st, s), sname, (long long)s->shape[0], (long long)(s->ndim > 1 ? s->shape[1] : 0),
                          name, out, in, (long long)sr, (long long)sc);
    return 0;
}

int pd_release_to_int8(const struct pd_release_mat *m, int8_t *q, float *scales, pd_err *e)
{
    float *row = malloc((size_t)m->in * sizeof *row);
    if (!row)
        return pd_err_set(e, PD_ENOMEM, "out of memory converting \"%s\"", m->w->name);
    for (int r = 0; r < m->out; r++) {
        pd_release_decode_row(m->fmt, m->w->data, m->s->data, m->out, m->in, r, row);
        for (int c = 0; c < m->in; c++)
            if (!isfinite(row[c])) {
                free(row);
                return pd_err_set(e, PD_EFORMAT, "tensor \"%s\" row %d column %d is NaN (a NaN code or scale)",
                                  m->w->name, r, c);
            }
        pd_quant_weights(row, 1, m->in, q + (size_t)r * m->in, scales + r);
    }
    free(row);
    return 0;
}

int pd_release_round(enum pd_release_fmt f, float *w, int out, int in)
{
    int64_t sr, sc;
    pd_release_scale_shape(f, out, in, &sr, &sc);
    if (f == PD_RELEASE_FP4 && in % 2)
        return PD_EINVAL;
    size_t qbytes = f == PD_RELEASE_FP8 ? (size_t)out * in : (size_t)out * (size_t)(in / 2);
    uint8_t *q = malloc(qbytes), *s = malloc((size_t)(sr * sc));
    if (!q || !s) {
        free(q);
        free(s);
        return PD_ENOMEM;
    }
    if (f == PD_RELEASE_FP8)
        pd_release_fp8_encode(w, out, in, q, s);
    else
        pd_release_fp4_encode(w, out, in, q, s);
    for (int r = 0; r < out; r++)
        pd_release_decode_row(f, q, s, out, in, r, w + (size_t)r * in);
    free(q);
    free(s);
    return 0;
}

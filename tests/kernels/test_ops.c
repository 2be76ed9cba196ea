/* The small float operations: Sinkhorn gives a doubly stochastic matrix, rope and its inverse
 * cancel, YaRN keeps high frequencies and divides low ones by the factor, bf16 rounds to
 * nearest even; the multi-row dot and axpy and the two-part rope give the bits of the one-row
 * and one-part versions that they replace on the decode path, and the bf16 rows widened in
 * registers those of the rows widened first. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "engine/sampler.h"
#include "kernels/ops.h"
#include "kernels/vec.h"

static float wave(int i)
{
    return sinf((float)i * 0.7f) * (1.0f + (float)(i % 13));
}

Test(ops, dot_rows_same_bits_as_dot)
{
    /* odd and even lengths around the 16- and 32-wide chunks, row counts around the 4-row block,
     * a leading dimension larger than the length */
    static float w[37 * 301], x[301], y[37];
    for (int i = 0; i < 37 * 301; i++)
        w[i] = wave(i);
    for (int i = 0; i < 301; i++)
        x[i] = wave(3 * i + 1);
    const int ns[] = {1, 15, 16, 17, 31, 32, 33, 48, 64, 128, 200, 301};
    for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
        for (int rows = 0; rows <= 37; rows += rows < 9 ? 1 : 7) {
            pd_dot_rows(w, 301, x, ns[a], rows, y);
            for (int r = 0; r < rows; r++) {
                float d = pd_dot(w + (size_t)r * 301, x, ns[a]);
                cr_assert(memcmp(&d, &y[r], 4) == 0, "n %d row %d of %d: %a vs %a", ns[a], r, rows, y[r], d);
            }
        }
}

Test(ops, dot_rows_bf16_same_bits_as_widened_dot_rows)
{
    /* bf16 rows widened in registers give the bits of pd_dot_rows over the widened copy: lengths
     * around the 16- and 32-wide chunks, on both sides of the one-row-at-a-time range (256 to 1024
     * values), row counts around the 4-row block, a leading dimension larger than the length */
    enum { LD = 1301, ROWS = 13 };
    static uint16_t h[ROWS * LD];
    static float f[ROWS * LD], x[LD], yh[ROWS], yf[ROWS];
    for (int i = 0; i < ROWS * LD; i++)
        h[i] = pd_f32_to_bf16(wave(i) / 7);
    pd_bf16_to_f32_row(h, f, ROWS * LD);
    for (int i = 0; i < LD; i++)
        x[i] = wave(3 * i + 1);
    const int ns[] = {1, 15, 16, 17, 31, 32, 33, 48, 255, 256, 257, 300, 1023, 1024, 1025, 1301};
    for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
        for (int rows = 0; rows <= ROWS; rows++) {
            memset(yh, 0xff, sizeof yh);
            pd_dot_rows_bf16(h, LD, x, ns[a], rows, yh);
            pd_dot_rows(f, LD, x, ns[a], rows, yf);
            for (int r = 0; r < rows; r++)
                cr_assert(memcmp(&yf[r], &yh[r], 4) == 0, "n %d row %d of %d: %a vs %a", ns[a], r, rows, yh[r], yf[r]);
        }
}

Test(ops, dot_rows_tokens_same_bits_as_dot)
{
    /* rows x tokens at once, fp32 and bf16 rows: every (row, token) the bits of pd_dot over the
     * (widened) row; lengths around the chunks, row counts around the 2-row tile, token counts
     * around the 4-token tiles and the switch from row-by-row (fewer than 12 tokens) to two-row
     * tiles, leading dimensions larger than the lengths */
    enum { LD = 533, ROWS = 7, TOK = 14, LDY = 9 };
    static uint16_t h[ROWS * LD];
    static float f[ROWS * LD], x[TOK * LD], y[TOK * LDY], yb[TOK * LDY];
    for (int i = 0; i < ROWS * LD; i++)
        h[i] = pd_f32_to_bf16(wave(i) / 5);
    pd_bf16_to_f32_row(h, f, ROWS * LD);
    for (int i = 0; i < TOK * LD; i++)
        x[i] = wave(5 * i + 2);
    const int ns[] = {1, 15, 16, 17, 31, 32, 33, 47, 64, 255, 512, 533};
    for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
        for (int rows = 0; rows <= ROWS; rows++)
            for (int T = 0; T <= TOK; T++) {
                memset(y, 0xff, sizeof y);
                memset(yb, 0xff, sizeof yb);
                pd_dot_rows_tokens(f, LD, x, LD, T, ns[a], rows, y, LDY);
                pd_dot_rows_tokens_bf16(h, LD, x, LD, T, ns[a], rows, yb, LDY);
                for (int t = 0; t < T; t++)
                    for (int r = 0; r < rows; r++) {
                        float d = pd_dot(f + (size_t)r * LD, x + (size_t)t * LD, ns[a]);
                        cr_assert(memcmp(&d, &y[t * LDY + r], 4) == 0 && memcmp(&d, &yb[t * LDY + r], 4) == 0,
                                  "n %d, %d rows, %d tokens: row %d token %d: %a, bf16 %a vs %a", ns[a], rows, T, r, t,
                                  y[t * LDY + r], yb[t * LDY + r], d);
                    }
                /* nothing outside the rows and tokens asked is written */
                for (int t = 0; t < TOK; t++)
                    for (int r = t < T ? rows : 0; r < LDY; r++)
                        cr_assert(isnan(y[t * LDY + r]) && isnan(yb[t * LDY + r]), "n %d: wrote (%d, %d)", ns[a], t, r);
            }
}

/* One token goes as 4 streams of rows (tile j: rows j, j + q, j + 2q, j + 3q, q = rows / 4) and the
 * 1-3 rows left one by one: through pd_dot_rows, pd_dot_rows_bf16 and pd_dot_rows_tokens[_bf16]
 * with one token, every row pd_dot's bits at its own place, row counts past several blocks of 4,
 * nothing written past them. */
Test(ops, dot_rows_one_token_in_row_streams_same_bits_as_dot)
{
    enum { LD = 530, ROWS = 71 };
    static uint16_t h[ROWS * LD];
    static float f[ROWS * LD], x[LD], y[4][ROWS + 1];
    for (int i = 0; i < ROWS * LD; i++)
        h[i] = pd_f32_to_bf16(wave(7 * i + 3) / 3);
    pd_bf16_to_f32_row(h, f, ROWS * LD);
    for (int i = 0; i < LD; i++)
        x[i] = wave(11 * i + 5);
    const int ns[] = {1, 16, 33, 512};
    for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
        for (int rows = 0; rows <= ROWS; rows++) {
            memset(y, 0xff, sizeof y);
            pd_dot_rows(f, LD, x, ns[a], rows, y[0]);
            pd_dot_rows_bf16(h, LD, x, ns[a], rows, y[1]);
            pd_dot_rows_tokens(f, LD, x, LD, 1, ns[a], rows, y[2], ROWS + 1);
            pd_dot_rows_tokens_bf16(h, LD, x, LD, 1, ns[a], rows, y[3], ROWS + 1);
            for (int r = 0; r < rows; r++) {
                float d = pd_dot(f + (size_t)r * LD, x, ns[a]);
                for (int k = 0; k < 4; k++)
                    cr_assert(memcmp(&d, &y[k][r], 4) == 0, "n %d, %d rows, entry %d: row %d: %a vs %a", ns[a],
                              rows, k, r, y[k][r], d);
            }
            for (int k = 0; k < 4; k++)
                cr_assert(isnan(y[k][rows]), "n %d, %d rows, entry %d: wrote past the rows", ns[a], rows, k);
        }
}

Test(ops, dot_rows_tokens_long_rows_in_token_chunks)
{
    /* rows of 4113 values: the kernel takes the tokens in chunks of 4 (64 KiB of x each), here
     * 4 + 4 + 1; every (row, token) still pd_dot's bits */
    enum { N = 4113, ROWS = 3, TOK = 9 };
    static uint16_t h[ROWS * N];
    static float f[ROWS * N], x[TOK * N], y[TOK * ROWS], yb[TOK * ROWS];
    for (int i = 0; i < ROWS * N; i++)
        h[i] = pd_f32_to_bf16(wave(i) / 3);
    pd_bf16_to_f32_row(h, f, ROWS * N);
    for (int i = 0; i < TOK * N; i++)
        x[i] = wave(7 * i + 3);
    pd_dot_rows_tokens(f, N, x, N, TOK, N, ROWS, y, ROWS);
    pd_dot_rows_tokens_bf16(h, N, x, N, TOK, N, ROWS, yb, ROWS);
    for (int t = 0; t < TOK; t++)
        for (int r = 0; r < ROWS; r++) {
            float d = pd_dot(f + (size_t)r * N, x + (size_t)t * N, N);
            cr_assert(memcmp(&d, &y[t * ROWS + r], 4) == 0 && memcmp(&d, &yb[t * ROWS + r], 4) == 0,
                      "row %d token %d: %a, bf16 %a vs %a", r, t, y[t * ROWS + r], yb[t * ROWS + r], d);
        }
}

Test(ops, swiglu_same_bits_as_the_loop)
{
    /* pd_swiglu 16 values a vector against the portable loops: lengths around the vector and the
     * 256-value exponential chunks, no limit and two limits, values beyond the limits, +-0,
     * +-inf and NaNs of both signs in g and in u */
    enum { N = 700 };
    static float g[N], u[N], a[N], b[N];
    static const uint32_t special[] = {0x7fc00000u, 0xffc00000u, 0x7f800000u, 0xff800000u, 0x00000000u, 0x80000000u};
    for (int i = 0; i < N; i++) {
        g[i] = wave(i) * 2.5f;
        u[i] = wave(3 * i + 5) * 4.0f;
        if (i % 7 == 3)
            memcpy(&g[i], &special[i % 6], 4);
        if (i % 11 == 5)
            memcpy(&u[i], &special[(i + 1) % 6], 4);
    }
    const int ns[] = {1, 15, 16, 17, 255, 256, 257, 700};
    const float limits[] = {0.0f, 10.0f, 0.5f};
    for (size_t k = 0; k < sizeof ns / sizeof *ns; k++)
        for (size_t l = 0; l < sizeof limits / sizeof *limits; l++) {
            memcpy(a, g, sizeof g);
            memcpy(b, g, sizeof g);
            pd_swiglu(a, u, (size_t)ns[k], limits[l]);
            pd_swiglu_ref(b, u, (size_t)ns[k], limits[l]);
            cr_assert(memcmp(a, b, sizeof a) == 0, "%d values, limit %g", ns[k], limits[l]);
        }
}

/* The knots' bounds 16 values a vector against the portable loop: logits spread over the table,
 * below it, exactly on knots and a hair either side, -inf, with and without an addend (a bias),
 * lengths around the vector; both refuse the same inputs (a value above the last knot, a NaN in
 * x or the addend). And the bounds hold: lo <= f <= hi for f the tabulated function here. */
static float knot_f(float x)
{
    return sqrtf(pd_softplus(x));
}

Test(ops, knot_bounds_same_bits_as_the_loop)
{
    enum { N = 300, M = 36 * 32 + 1 };
    static float val[M], x[N], add[N], lo1[N], hi1[N], lo2[N], hi2[N];
    const struct pd_knots t = {.x0 = -16, .per = 32, .slack = 1e-5f, .below = 0, .m = M, .val = val};
    for (int i = 0; i < M; i++)
        val[i] = knot_f(-16 + (float)i / 32);
    for (int i = 0; i < N; i++) {
        const float k = -16 + (float)((i * 37) % M) / 32;   /* a knot */
        x[i] = i % 5 == 0 ? k : i % 5 == 1 ? nextafterf(k, -INFINITY) : i % 5 == 2 ? nextafterf(k, INFINITY)
             : i % 5 == 3 ? wave(i) * 9 : -17 - wave(i) * wave(i);
        if (x[i] > 20)
            x[i] = 20;
        add[i] = 0.01f * (float)(i % 7);
    }
    x[7] = -INFINITY;
    const int ns[] = {1, 15, 16, 17, 255, 256, 300};
    for (size_t k = 0; k < sizeof ns / sizeof *ns; k++)
        for (int with_add = 0; with_add < 2; with_add++) {
            const float *a = with_add ? add : NULL;
            cr_assert_eq(pd_knot_bounds(&t, x, a, ns[k], lo1, hi1), 0);
            cr_assert_eq(pd_knot_bounds_ref(&t, x, a, ns[k], lo2, hi2), 0);
            cr_assert(memcmp(lo1, lo2, (size_t)ns[k] * 4) == 0 && memcmp(hi1, hi2, (size_t)ns[k] * 4) == 0, "%d values",
                      ns[k]);
            for (int i = 0; i < ns[k]; i++) {
                const float f = knot_f(x[i]) + (a ? a[i] : 0);
                cr_assert(lo1[i] <= f && f <= hi1[i], "x %a: %a not in [%a, %a]", x[i], f, lo1[i], hi1[i]);
            }
        }
    /* refused where the table says nothing, the same way by both, wherever the value sits */
    for (int at = 0; at < 40; at += 13) {
        const float bad[] = {20.5f, NAN};
        for (int b = 0; b < 2; b++) {
            const float keep = x[at];
            x[at] = bad[b];
            cr_assert_eq(pd_knot_bounds(&t, x, add, 40, lo1, hi1), 1, "x[%d] = %g", at, bad[b]);
            cr_assert_eq(pd_knot_bounds_ref(&t, x, add, 40, lo2, hi2), 1);
            x[at] = keep;
        }
        const float keep = add[at];
        add[at] = NAN;
        cr_assert_eq(pd_knot_bounds(&t, x, add, 40, lo1, hi1), 1, "add[%d] NaN", at);
        cr_assert_eq(pd_knot_bounds_ref(&t, x, add, 40, lo2, hi2), 1);
        add[at] = keep;
    }
}

Test(ops, axpy_rows_same_bits_as_axpy)
{
    static float x[23 * 290], a[23], y1[290], y2[290];
    for (int i = 0; i < 23 * 290; i++)
        x[i] = wave(i);
    for (int k = 0; k < 23; k++)
        a[k] = wave(7 * k + 2) / 9;
    const int ns[] = {1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 72, 100, 127, 128, 129, 256, 290};
    for (size_t c = 0; c < sizeof ns / sizeof ns[0]; c++)
        for (int rows = 0; rows <= 23; rows += 5) {
            for (int i = 0; i < 290; i++)
                y1[i] = y2[i] = wave(i + 5);
            pd_axpy_rows(a, x, 290, rows, y1, ns[c]);
            for (int k = 0; k < rows; k++)
                pd_axpy(a[k], x + (size_t)k * 290, y2, ns[c]);
            cr_assert(memcmp(y1, y2, sizeof y1) == 0, "n %d, %d rows", ns[c], rows);
        }
}

Test(ops, scale_axpys_same_bits_as_scale_then_axpy)
{
    static float x[300], z[5 * 300], y1[300], y2[300];
    float b[5] = {0.3f, -1.25f, 2.5e-3f, 7.0f, -0.001f};
    for (int i = 0; i < 5 * 300; i++)
        z[i] = wave(i);
    for (int i = 0; i < 300; i++)
        x[i] = wave(11 * i + 3);
    for (int n = 1; n <= 300; n += n < 40 ? 1 : 29)
        for (int nz = 0; nz <= 5; nz++) {
            pd_scale(0.77f, x, y1, n);
            for (int j = 0; j < nz; j++)
                pd_axpy(b[j], z + (size_t)j * 300, y1, n);
            pd_scale_axpys(0.77f, x, b, z, 300, nz, y2, n);
            cr_assert(memcmp(y1, y2, (size_t)n * 4) == 0, "n %d, %d rows", n, nz);
        }
}

Test(ops, expf_rows_same_bits_as_expf)
{
    static float x[4099], y[4099];
    uint32_t r = 7;
    for (int i = 0; i < 4099; i++) {
        r = r * 1664525u + 1013904223u;
        x[i] = i % 3 == 0 ? (float)(r >> 8) / (float)(1 << 24) * 200 - 110   /* spans both ends */
               : i % 3 == 1 ? -(float)(r >> 8) / (float)(1 << 24) * 30 : (float)(r >> 8) / (float)(1 << 24) - 0.5f;
    }
    const float special[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 88.0f, 88.7f, 89.0f, -103.0f, -103.5f, -104.0f,
                             -150.0f, 1e-30f, -1e-30f, 0x1.04845ep+5f};
    for (size_t i = 0; i < sizeof special / sizeof special[0]; i++)
        x[100 + 9 * i] = special[i];
    pd_expf_rows(x, y, 4099);
    for (int i = 0; i < 4099; i++) {
        float e = expf(x[i]);
        cr_assert(memcmp(&e, &y[i], 4) == 0 || (isnan(e) && isnan(y[i])), "expf(%a): %a vs %a", x[i], y[i], e);
    }
    pd_expf_rows(x, x, 4099);   /* in place */
    cr_assert(memcmp(x, y, sizeof x) == 0);
}

/* The vector expf is the one in use where the CPU has it: a version whose bits differ from libm's
 * is dropped at its first call for expf itself, which the test above would not notice. */
Test(ops, expf_rows_runs_in_vectors_where_the_cpu_can)
{
    const char *impl = pd_expf_rows_impl();
    if (__builtin_cpu_supports("avx512f"))
        cr_assert_str_eq(impl, "avx512");
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        cr_assert_str_eq(impl, "avx2");
    else
        cr_assert_str_eq(impl, "libm");
    cr_log_info("pd_expf_rows: %s", impl);
}

Test(ops, weighted_sum_same_bits_as_scalar_loop)
{
    static float x[7 * 301], y1[301], y2[301], z[301];
    float a[7];
    for (int i = 0; i < 7 * 301; i++)
        x[i] = wave(i) * 1e-3f;
    for (int i = 0; i < 301; i++)
        z[i] = wave(13 * i);
    for (int j = 0; j < 7; j++)
        a[j] = wave(j + 40) / 5;
    for (int n = 1; n <= 301; n += n < 40 ? 1 : 31)
        for (int rows = 0; rows <= 7; rows++)
            for (int withz = 0; withz < 2; withz++) {
                for (int i = 0; i < n; i++) {
                    /* volatile: the products rounded before the sum, as the engine's loop was */
                    volatile float acc = 0;
                    for (int j = 0; j < rows; j++) {
                        volatile float p = a[j] * x[j * 301 + i];
                        acc = acc + p;
                    }
                    if (withz)
                        acc = acc + z[i];
                    y1[i] = acc;
                }
                pd_weighted_sum(a, x, 301, rows, withz ? z : NULL, y2, n);
                cr_assert(memcmp(y1, y2, (size_t)n * 4) == 0, "n %d, %d rows, z %d", n, rows, withz);
                /* rows by pointer, in another order in memory (expert parallelism's received ones) */
                const float *row[7];
                for (int j = 0; j < rows; j++)
                    row[j] = x + (size_t)(rows - 1 - j) * 301;
                float ar[7];
                for (int j = 0; j < rows; j++)
                    ar[j] = a[rows - 1 - j];
                for (int i = 0; i < n; i++) {
                    volatile float acc = 0;
                    for (int j = 0; j < rows; j++) {
                        volatile float p = ar[j] * row[j][i];
                        acc = acc + p;
                    }
                    if (withz)
                        acc = acc + z[i];
                    y1[i] = acc;
                }
                pd_weighted_sum_rows(ar, row, rows, withz ? z : NULL, y2, n);
                cr_assert(memcmp(y1, y2, (size_t)n * 4) == 0, "rows: n %d, %d rows, z %d", n, rows, withz);
            }
}

Test(ops, scale_mul_same_bits_as_scalar_loop)
{
    static float x[301], w[301], y[301];
    for (int i = 0; i < 301; i++) {
        x[i] = wave(i);
        w[i] = wave(3 * i + 7) / 3;
    }
    for (int n = 1; n <= 301; n += n < 40 ? 1 : 31)
        for (int withw = 0; withw < 2; withw++) {
            pd_scale_mul(0.377f, x, withw ? w : NULL, y, n);
            for (int i = 0; i < n; i++) {
                volatile float p = x[i] * 0.377f;
                float want = withw ? p * w[i] : p;
                cr_assert(memcmp(&want, &y[i], 4) == 0, "n %d, i %d, w %d", n, i, withw);
            }
        }
}

Test(ops, softmax_steps_same_bits_as_scalar_loops)
{
    static float x[300], y[300];
    for (int n = 0; n <= 300; n += n < 40 ? 1 : 37) {
        for (int i = 0; i < n; i++)
            x[i] = y[i] = wave(5 * i + n) * 3;
        float m = -2.5f, s = 0.088388f;
        for (int i = 0; i < n; i++) {
            x[i] *= s;
            m = x[i] > m ? x[i] : m;
        }
        float m2 = pd_scale_max(y, n, s, -2.5f);
        cr_assert(memcmp(x, y, (size_t)n * 4) == 0 && m == m2, "scale_max n %d: %a vs %a", n, m2, m);
        double d = 7.123456789;
        for (int i = 0; i < n; i++)
            x[i] = (float)(x[i] / d);
        pd_div_d(y, n, d);
        cr_assert(memcmp(x, y, (size_t)n * 4) == 0, "div_d n %d", n);
    }
    /* a NaN never wins; a NaN start is kept */
    float v[20];
    for (int i = 0; i < 20; i++)
        v[i] = (float)i;
    v[19] = NAN;
    cr_assert_eq(pd_scale_max(v, 20, 1, 0), 18.0f);
    cr_assert(isnan(pd_scale_max(v, 19, 1, NAN)));
}

Test(ops, rope_in_two_parts_same_bits)
{
    struct pd_rope r;
    pd_rope_init(&r, 64, 160000, 4, 16384, 32, 1);
    float cs[64], x[64], y[64];
    for (int64_t pos = 0; pos < 5000; pos += 377)
        for (int inv = 0; inv < 2; inv++) {
            for (int i = 0; i < 64; i++)
                x[i] = y[i] = wave(i + (int)pos);
            pd_rope_apply(&r, x, pos, inv);
            pd_rope_cs(&r, pos, cs);
            pd_rope_apply_cs(cs, 64, y, inv);
            cr_assert(memcmp(x, y, sizeof x) == 0, "pos %lld inverse %d", (long long)pos, inv);
        }
}

Test(ops, sinkhorn_doubly_stochastic)
{
    float m[16];
    for (int i = 0; i < 16; i++)
        m[i] = (float)((i * 7) % 5) - 2.0f;
    pd_sinkhorn(m, 4, 20, 1e-6f);
    for (int i = 0; i < 4; i++) {
        float r = 0, c = 0;
        for (int j = 0; j < 4; j++) {
            r += m[i * 4 + j];
            c += m[j * 4 + i];
            cr_assert_gt(m[i * 4 + j], 0);
        }
        cr_assert_float_eq(r, 1.0f, 1e-3);
        cr_assert_float_eq(c, 1.0f, 1e-5);
    }
}

/* DeepSeek's hc_split_sinkhorn (kernel.py): softmax over rows + eps, divide by column sums + eps,
 * then iters - 1 times rows then columns. Values worked by hand on a 2 x 2 whose softmax rows are
 * [1/4 3/4] and [1/2 1/2]: one column normalisation gives [1/3 3/5; 2/3 2/5]; a row then a column
 * normalisation more gives [4/11 12/19; 7/11 7/19]. */
Test(ops, sinkhorn_follows_the_official_order_and_count)
{
    const float ln3 = logf(3.0f);
    float one[4] = {0, ln3, 0, 0}, two[4] = {0, ln3, 0, 0};
    pd_sinkhorn(one, 2, 1, 0.0f);
    const float want1[4] = {1.0f / 3, 3.0f / 5, 2.0f / 3, 2.0f / 5};
    pd_sinkhorn(two, 2, 2, 0.0f);
    const float want2[4] = {4.0f / 11, 12.0f / 19, 7.0f / 11, 7.0f / 19};
    for (int i = 0; i < 4; i++) {
        cr_assert_float_eq(one[i], want1[i], 1e-6, "iters 1, entry %d: %g, want %g", i, one[i], want1[i]);
        cr_assert_float_eq(two[i], want2[i], 1e-6, "iters 2, entry %d: %g, want %g", i, two[i], want2[i]);
    }
    /* eps: added after the softmax, and to each sum it divides by: zeros with eps 0.5 give
     * softmax 1/2 + 0.5 = 1, then 1 / (2 + 0.5) */
    float z[4] = {0, 0, 0, 0};
    pd_sinkhorn(z, 2, 1, 0.5f);
    for (int i = 0; i < 4; i++)
        cr_assert_float_eq(z[i], 0.4f, 1e-7, "entry %d: %g", i, z[i]);
}

/* The scalar definition of pd_sinkhorn's steps after the softmax: sums from 0 in index order, + eps,
 * then each entry divided by its sum. */
static void sinkhorn_by_definition(float *m, int n, int iters, float eps)
{
    for (int it = 0; it < iters; it++)
        for (int pass = it == 0; pass < 2; pass++)   /* the first iteration has only its columns */
            for (int i = 0; i < n; i++) {
                float s = 0;
                for (int j = 0; j < n; j++)
                    s += pass ? m[j * n + i] : m[i * n + j];
                s += eps;
                for (int j = 0; j < n; j++)
                    *(pass ? &m[j * n + i] : &m[i * n + j]) /= s;
            }
}

/* The 4 x 4 Sinkhorn (V4's hc_mult) runs in registers: the bits of the scalar steps, on matrices of
 * logits over a wide range, every iteration count up to 20 and three epsilons. */
Test(ops, sinkhorn_of_four_streams_equals_the_scalar_steps)
{
    uint64_t s = 3;
    static const float eps[] = {0.0f, 1e-6f, 0.25f};
    for (int round = 0; round < 40; round++)
        for (int iters = 1; iters <= 20; iters++)
            for (size_t k = 0; k < sizeof eps / sizeof *eps; k++) {
                float a[16], b[16];
                for (int i = 0; i < 16; i++) {
                    s = s * 6364136223846793005ull + 1442695040888963407ull;
                    a[i] = ((float)(s >> 40) / (float)(1 << 24) - 0.5f) * (float)(1 + round % 8) * 6.0f;
                }
                memcpy(b, a, sizeof a);
                pd_sinkhorn(a, 4, iters, eps[k]);
                for (int r = 0; r < 4; r++) {   /* the softmax rows + eps, as pd_sinkhorn starts */
                    pd_softmax(b + 4 * r, 4);
                    for (int c = 0; c < 4; c++)
                        b[4 * r + c] += eps[k];
                }
                sinkhorn_by_definition(b, 4, iters, eps[k]);
                cr_assert(memcmp(a, b, sizeof a) == 0, "round %d, %d iterations, eps %g", round, iters, eps[k]);
            }
}

Test(ops, rope_inverse_and_yarn)
{
    struct pd_rope r;
    pd_rope_init(&r, 64, 10000, 1, 0, 0, 0);
    float x[64], y[64];
    for (int i = 0; i < 64; i++)
        x[i] = y[i] = sinf((float)i);
    pd_rope_apply(&r, y, 1234, 0);
    pd_rope_apply(&r, y, 1234, 1);
    for (int i = 0; i < 64; i++)
        cr_assert_float_eq(x[i], y[i], 1e-4);
    cr_assert_float_eq(r.freq[0], 1.0f, 1e-7);
    cr_assert_float_eq(r.freq[1], powf(10000, -2.0f / 64), 1e-7);
    struct pd_rope yr;
    pd_rope_init(&yr, 64, 160000, 16, 65536, 32, 1);
    /* the fastest frequencies are kept, the slowest divided by the factor */
    cr_assert_float_eq(yr.freq[0], 1.0f, 1e-7);
    double slow = 1.0 / pow(160000, 62.0 / 64);
    cr_assert_float_eq(yr.freq[31], slow / 16, slow * 1e-4);
}

Test(ops, bf16_round_trip)
{
    cr_assert_eq(pd_f32_to_bf16(1.0f), 0x3f80);
    cr_assert_float_eq(pd_bf16_to_f32(0x3f80), 1.0f, 0);
    /* 1 + 2^-8 is halfway between two bf16 values: ties to even gives 1.0 */
    cr_assert_eq(pd_f32_to_bf16(1.00390625f), 0x3f80);
    cr_assert_eq(pd_f32_to_bf16(1.01171875f), 0x3f82);
    float x[4] = {0}, r;
    pd_rmsnorm((float[]){3, 4, 0, 0}, NULL, 0, 4, x);
    r = sqrtf(x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3]);
    cr_assert_float_eq(r, 2.0f, 1e-5);   /* unit RMS over 4 values */
}

Test(ops, sampler)
{
    float l[6] = {0.5f, 2.0f, 2.0f, -1.0f, 1.9f, 0};
    float scratch[12];
    struct pd_sampler g;
    pd_sampler_init(&g, 0, 1, 0);
    cr_assert_eq(pd_sample(&g, l, 6, scratch), 1);   /* ties go to the lower id */
    /* long enough for the vector pass: the first of equal maxima, NaN never wins except at 0 */
    float v[19];
    for (int i = 0; i < 19; i++)
        v[i] = (float)(i % 7);
    cr_assert_eq(pd_sample(&g, v, 19, NULL), 6);
    v[2] = NAN;
    v[17] = 9;
    cr_assert_eq(pd_sample(&g, v, 19, NULL), 17);
    v[18] = 9;
    cr_assert_eq(pd_sample(&g, v, 19, NULL), 17);
    v[0] = NAN;
    cr_assert_eq(pd_sample(&g, v, 19, NULL), 0);
    for (int i = 0; i < 19; i++)
        v[i] = -INFINITY;
    v[11] = -0.0f;
    v[13] = 0.0f;
    cr_assert_eq(pd_sample(&g, v, 19, NULL), 11);
    struct pd_sampler a, b;
    pd_sampler_init(&a, 1.0f, 1.0f, 42);
    pd_sampler_init(&b, 1.0f, 1.0f, 42);
    int seen[6] = {0};
    for (int i = 0; i < 200; i++) {
        int x = pd_sample(&a, l, 6, scratch);
        cr_assert_eq(x, pd_sample(&b, l, 6, scratch));
        seen[x]++;
    }
    cr_assert_gt(seen[4], 0);   /* temperature 1 samples more than the argmax */
    struct pd_sampler n;
    pd_sampler_init(&n, 1.0f, 0.01f, 3);
    for (int i = 0; i < 50; i++) {
        int x = pd_sample(&n, l, 6, scratch);
        cr_assert(x == 1 || x == 2, "top-p 0.01 keeps only the most likely token, got %d", x);
    }
}

/* Tests for kernels/ (quantisation, GEMV/GEMM, grouped MoE form) and core/threadpool: every
 * implementation the CPU supports is held to the portable reference bit for bit, on shapes that
 * are not multiples of any vector width. */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "core/threadpool.h"
#include "kernels/gemm.h"
#include "kernels/quant.h"

static uint64_t rng_state;

static uint32_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}

static float rnd_float(void)
{
    return (float)((double)rnd() / 2147483648.0 - 1.0);
}

/* int8 values over the whole range, -128 included: the kernels must be exact for all of them. */
static void fill_i8(int8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (int8_t)(rnd() & 0xff);
}

static void fill_scales(float *s, int n)
{
    for (int i = 0; i < n; i++)
        s[i] = 1e-3f + (float)(rnd() % 1000) * 1e-5f;
}

/* A weight or activation matrix owning its storage. */
struct mat {
    int8_t *q;
    float *s;
    pd_qmat m;
};

static struct mat mat_new(int rows, int cols)
{
    struct mat x;
    x.q = malloc((size_t)rows * cols + 1);
    x.s = malloc(((size_t)rows + 1) * sizeof(float));
    cr_assert(x.q && x.s);
    fill_i8(x.q, (size_t)rows * cols);
    fill_scales(x.s, rows);
    x.m = (pd_qmat){.q = x.q, .scale = x.s, .rows = rows, .cols = cols};
    return x;
}

static void mat_free(struct mat *x)
{
    free(x->q);
    free(x->s);
}

static void use_kernel(pd_kernel k)
{
    pd_err e = {0};
    cr_assert_eq(pd_gemm_kernel_set(k, &e), 0, "%s", e.msg);
}

static void gemm_ok(pd_pool *pool, const pd_qmat *w, const pd_qmat *a, float *y, int flags)
{
    pd_err e = {0};
    cr_assert_eq(pd_gemm(pool, w, a, y, flags, &e), 0, "%s", e.msg);
}

/* The definition written out by hand, with the epilogue in the documented order. */
static void gemm_naive(const pd_qmat *w, const pd_qmat *a, float *y, int accum)
{
    for (int t = 0; t < a->rows; t++)
        for (int o = 0; o < w->rows; o++) {
            int32_t s = 0;
            for (int i = 0; i < w->cols; i++)
                s += (int32_t)w->q[(size_t)o * w->cols + i] * a->q[(size_t)t * a->cols + i];
            float v = a->scale[t] * w->scale[o] * (float)s;
            float *yo = &y[(size_t)t * w->rows + o];
            *yo = accum ? *yo + v : v;
        }
}

static const int shapes[][2] = {   /* {out, in} */
    {37, 77}, {129, 1000}, {70, 4096 + 13}, {16, 64}, {9, 1}, {5, 63}, {67, 65}, {300, 128},
};
static const int token_counts[] = {1, 2, 3, 4, 5, 6, 7, 13, 17, 64};

#define N_SHAPES ((int)(sizeof shapes / sizeof shapes[0]))
#define N_TOKENS ((int)(sizeof token_counts / sizeof token_counts[0]))

Test(kernels, reference_matches_definition)
{
    rng_state = 1;
    use_kernel(PD_KERNEL_REF);
    for (int s = 0; s < N_SHAPES; s++)
        for (int ti = 0; ti < N_TOKENS; ti++) {
            int out = shapes[s][0], in = shapes[s][1], T = token_counts[ti];
            struct mat w = mat_new(out, in), a = mat_new(T, in);
            float *y = malloc((size_t)T * out * sizeof *y), *z = malloc((size_t)T * out * sizeof *z);
            gemm_ok(NULL, &w.m, &a.m, y, 0);
            gemm_naive(&w.m, &a.m, z, 0);
            cr_assert(memcmp(y, z, (size_t)T * out * sizeof *y) == 0, "out=%d in=%d T=%d", out,
                      in, T);
            free(y);
            free(z);
            mat_free(&w);
            mat_free(&a);
        }
}

/* Every supported implementation equals the reference exactly, with and without accumulation. */
Test(kernels, all_kernels_equal_reference)
{
    rng_state = 2;
    for (int k = 0; k < PD_KERNEL_COUNT; k++) {
        if (!pd_gemm_kernel_supported((pd_kernel)k)) {
            cr_log_info("kernel %s not supported here: skipped", pd_gemm_kernel_name(k));
            continue;
        }
        for (int s = 0; s < N_SHAPES; s++)
            for (int ti = 0; ti < N_TOKENS; ti++) {
                int out = shapes[s][0], in = shapes[s][1], T = token_counts[ti];
                size_t ny = (size_t)T * out;
                struct mat w = mat_new(out, in), a = mat_new(T, in);
                float *ref = malloc(ny * sizeof *ref), *y = malloc(ny * sizeof *y);
                for (size_t i = 0; i < ny; i++)
                    ref[i] = y[i] = rnd_float();
                for (int flags = 0; flags <= PD_GEMM_ACCUM; flags += PD_GEMM_ACCUM) {
                    use_kernel(PD_KERNEL_REF);
                    gemm_ok(NULL, &w.m, &a.m, ref, flags);
                    use_kernel((pd_kernel)k);
                    gemm_ok(NULL, &w.m, &a.m, y, flags);
                    cr_assert(memcmp(ref, y, ny * sizeof *y) == 0,
                              "kernel %s out=%d in=%d T=%d flags=%d", pd_gemm_kernel_name(k), out,
                              in, T, flags);
                }
                free(ref);
                free(y);
                mat_free(&w);
                mat_free(&a);
            }
    }
}

/* One token whose activations hold no -128 (pd_quant_rows never makes one) takes the AVX2 path's
 * sign trick, |w| times a * sign(w) (gemm_avx2.c), in 8 row streams per block and a block of rows
 * left over; with a -128 among them it takes the widening tiles, where the trick would go wrong
 * (-128 * sign(w) does not fit a byte). Weights over the whole range, -128 included (|-128| is
 * 128 read unsigned), extreme rows, rows ending inside a block of 8 and past a task of 64,
 * reductions that end inside a 32-byte step; the plain and the grouped form (whose next group is
 * prefetched), each against the reference. */
Test(kernels, one_token_with_and_without_int8_min_equals_reference)
{
    rng_state = 9;
    static const int outs[] = {1, 7, 8, 9, 63, 64, 65, 130, 256}, ins[] = {1, 31, 32, 33, 100, 512};
    for (int k = 1; k < PD_KERNEL_COUNT; k++) {
        if (!pd_gemm_kernel_supported((pd_kernel)k) || k == PD_KERNEL_AMX_EMU)
            continue;
        for (size_t oi = 0; oi < sizeof outs / sizeof outs[0]; oi++)
            for (size_t ii = 0; ii < sizeof ins / sizeof ins[0]; ii++)
                for (int with_min = 0; with_min <= 1; with_min++) {
                    const int out = outs[oi], in = ins[ii];
                    struct mat w = mat_new(out, in), w2 = mat_new(out, in), a = mat_new(1, in);
                    for (int i = 0; i < in; i++)
                        if (a.q[i] == -128)
                            a.q[i] = (int8_t)(rnd() % 255 - 127);
                    if (with_min)
                        a.q[rnd() % (unsigned)in] = -128;
                    /* row 0 all -128 against the largest activations, the last row all 127 */
                    for (int i = 0; i < in; i++) {
                        w.q[i] = -128;
                        w.q[(size_t)(out - 1) * in + i] = out > 1 ? 127 : -128;
                        if (!with_min && i % 2)
                            a.q[i] = (int8_t)(i % 4 == 1 ? -127 : 127);
                    }
                    float *ref = malloc((size_t)2 * out * sizeof *ref), *y = malloc((size_t)2 * out * sizeof *y);
                    int32_t row0 = 0;
                    pd_gemm_group g[2] = {{w.m, &row0, 1, y}, {w2.m, &row0, 1, y + out}};
                    use_kernel(PD_KERNEL_REF);
                    gemm_ok(NULL, &w.m, &a.m, ref, 0);
                    gemm_ok(NULL, &w2.m, &a.m, ref + out, 0);
                    use_kernel((pd_kernel)k);
                    gemm_ok(NULL, &w.m, &a.m, y, 0);
                    cr_assert(memcmp(ref, y, (size_t)out * sizeof *y) == 0, "kernel %s out=%d in=%d -128 %d",
                              pd_gemm_kernel_name(k), out, in, with_min);
                    memset(y, 0, (size_t)2 * out * sizeof *y);
                    pd_err e = {0};
                    cr_assert_eq(pd_gemm_grouped(NULL, &a.m, g, 2, 0, &e), 0, "%s", e.msg);
                    cr_assert(memcmp(ref, y, (size_t)2 * out * sizeof *y) == 0,
                              "kernel %s grouped out=%d in=%d -128 %d", pd_gemm_kernel_name(k), out, in, with_min);
                    free(ref);
                    free(y);
                    mat_free(&w);
                    mat_free(&w2);
                    mat_free(&a);
                }
    }
}

/* The extremes of int8: all -128 (the largest positive product) and 127 x -128 mixes, over a
 * long reduction, where an offset or sign trick would go wrong first. */
Test(kernels, extreme_values_exact)
{
    const int out = 13, in = 4096 + 13, T = 5;
    struct mat w = mat_new(out, in), a = mat_new(T, in);
    for (size_t i = 0; i < (size_t)out * in; i++)
        w.q[i] = (int8_t)(i % 3 == 0 ? 127 : -128);
    memset(a.q, 0x80, (size_t)T * in);
    memset(w.q, 0x80, (size_t)in); /* row 0 all -128 */
    float *ref = malloc((size_t)T * out * sizeof *ref), *y = malloc((size_t)T * out * sizeof *y);
    use_kernel(PD_KERNEL_REF);
    gemm_ok(NULL, &w.m, &a.m, ref, 0);
    cr_assert_eq(ref[0], a.s[0] * w.s[0] * (float)(16384 * in));
    for (int k = 1; k < PD_KERNEL_COUNT; k++) {
        if (!pd_gemm_kernel_supported((pd_kernel)k))
            continue;
        use_kernel((pd_kernel)k);
        gemm_ok(NULL, &w.m, &a.m, y, 0);
        cr_assert(memcmp(ref, y, (size_t)T * out * sizeof *y) == 0, "kernel %s",
                  pd_gemm_kernel_name(k));
    }
    free(ref);
    free(y);
    mat_free(&w);
    mat_free(&a);
}

Test(kernels, same_result_with_1_2_3_threads)
{
    rng_state = 3;
    const int out = 600, in = 1000 + 7, T = 19;
    struct mat w = mat_new(out, in), a = mat_new(T, in);
    size_t ny = (size_t)T * out;
    float *y1 = malloc(ny * sizeof *y1), *yn = malloc(ny * sizeof *yn);
    for (int k = 0; k < PD_KERNEL_COUNT; k++) {
        if (!pd_gemm_kernel_supported((pd_kernel)k))
            continue;
        use_kernel((pd_kernel)k);
        gemm_ok(NULL, &w.m, &a.m, y1, 0);
        for (int nt = 1; nt <= 3; nt++) {
            pd_pool *pool;
            pd_err e = {0};
            cr_assert_eq(pd_pool_create(nt, &pool, &e), 0, "%s", e.msg);
            memset(yn, 0, ny * sizeof *yn);
            gemm_ok(pool, &w.m, &a.m, yn, 0);
            cr_assert(memcmp(y1, yn, ny * sizeof *y1) == 0, "kernel %s threads %d",
                      pd_gemm_kernel_name(k), nt);
            pd_pool_destroy(pool);
        }
    }
    free(y1);
    free(yn);
    mat_free(&w);
    mat_free(&a);
}

/* Routes T tokens to top-k of E experts, runs the grouped form and compares it with a plain GEMM
 * per expert on the gathered rows. */
static void check_grouped(pd_kernel k, pd_pool *pool, int E, int topk, int T, int out, int in,
                          int flags)
{
    struct mat a = mat_new(T, in);
    struct mat *w = malloc((size_t)E * sizeof *w);
    pd_gemm_group *g = calloc((size_t)E, sizeof *g);
    int32_t *rows = malloc((size_t)E * T * sizeof *rows);
    int *n = calloc((size_t)E, sizeof *n);
    for (int e = 0; e < E; e++)
        w[e] = mat_new(out + e % 3, in);   /* experts need not share `out` */
    for (int t = 0; t < T; t++) {
        int first = (int)(rnd() % E);
        for (int j = 0; j < topk; j++) {
            int e = (first + j * 7) % E;
            rows[(size_t)e * T + n[e]++] = t;
        }
    }
    for (int e = 0; e < E; e++) {
        g[e].w = w[e].m;
        g[e].rows = &rows[(size_t)e * T];
        g[e].n = n[e];
        g[e].y = malloc(((size_t)n[e] * w[e].m.rows + 1) * sizeof(float));
        for (int i = 0; i < n[e] * w[e].m.rows; i++)
            g[e].y[i] = (float)i;   /* what PD_GEMM_ACCUM adds to */
    }
    use_kernel(k);
    pd_err err = {0};
    cr_assert_eq(pd_gemm_grouped(pool, &a.m, g, E, flags, &err), 0, "%s", err.msg);

    for (int e = 0; e < E; e++) {
        int ne = n[e], oe = w[e].m.rows;
        int8_t *gq = malloc((size_t)ne * in + 1);
        float *gs = malloc(((size_t)ne + 1) * sizeof *gs);
        float *y = malloc(((size_t)ne * oe + 1) * sizeof *y);
        for (int j = 0; j < ne; j++) {
            memcpy(gq + (size_t)j * in, a.q + (size_t)g[e].rows[j] * in, (size_t)in);
            gs[j] = a.s[g[e].rows[j]];
        }
        pd_qmat ga = {.q = gq, .scale = gs, .rows = ne, .cols = in};
        for (int i = 0; i < ne * oe; i++)
            y[i] = (float)i;
        gemm_ok(NULL, &w[e].m, &ga, y, flags);
        cr_assert(memcmp(y, g[e].y, (size_t)ne * oe * sizeof *y) == 0,
                  "kernel %s expert %d (%d tokens)", pd_gemm_kernel_name(k), e, ne);
        free(gq);
        free(gs);
        free(y);
        free(g[e].y);
        mat_free(&w[e]);
    }
    free(w);
    free(g);
    free(rows);
    free(n);
    mat_free(&a);
}

Test(kernels, grouped_equals_per_expert_gemm)
{
    rng_state = 4;
    for (int k = 0; k < PD_KERNEL_COUNT; k++) {
        if (!pd_gemm_kernel_supported((pd_kernel)k))
            continue;
        check_grouped((pd_kernel)k, NULL, 8, 2, 37, 70, 77, 0);
        check_grouped((pd_kernel)k, NULL, 8, 2, 37, 70, 77, PD_GEMM_ACCUM);
        check_grouped((pd_kernel)k, NULL, 16, 4, 9, 33, 300, 0);   /* several experts get nobody */
        for (int nt = 2; nt <= 3; nt++) {
            pd_pool *pool;
            pd_err e = {0};
            cr_assert_eq(pd_pool_create(nt, &pool, &e), 0, "%s", e.msg);
            check_grouped((pd_kernel)k, pool, 12, 3, 50, 130, 1000 + 5, 0);
            pd_pool_destroy(pool);
        }
    }
}

Test(kernels, empty_inputs_are_no_ops)
{
    struct mat a = mat_new(3, 40), w = mat_new(5, 40);
    float y[15] = {0};
    pd_err e = {0};
    pd_qmat none = a.m;
    none.rows = 0;
    cr_assert_eq(pd_gemm(NULL, &w.m, &none, NULL, 0, &e), 0, "%s", e.msg);
    pd_gemm_group g[2] = {{.w = w.m, .rows = NULL, .n = 0, .y = NULL},
                          {.w = w.m, .rows = NULL, .n = 0, .y = y}};
    cr_assert_eq(pd_gemm_grouped(NULL, &a.m, g, 2, 0, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_gemm_grouped(NULL, &a.m, NULL, 0, 0, &e), 0, "%s", e.msg);
    for (int i = 0; i < 15; i++)
        cr_assert_eq(y[i], 0.0f);
    mat_free(&a);
    mat_free(&w);
}

Test(kernels, grouped_rejects_bad_rows)
{
    struct mat a = mat_new(4, 32), w = mat_new(8, 32);
    int32_t rows[2] = {1, 4};
    float y[16];
    pd_gemm_group g = {.w = w.m, .rows = rows, .n = 2, .y = y};
    pd_err e = {0};
    cr_assert_eq(pd_gemm_grouped(NULL, &a.m, &g, 1, 0, &e), PD_EINVAL);
    cr_assert(strstr(e.msg, "outside") != NULL, "%s", e.msg);
    mat_free(&a);
    mat_free(&w);
}

Test(kernels, gemm_rejects_bad_shapes)
{
    struct mat a = mat_new(3, 32), w = mat_new(8, 33);
    float y[24];
    pd_err e = {0};
    cr_assert_eq(pd_gemm(NULL, &w.m, &a.m, y, 0, &e), PD_EINVAL);
    cr_assert(strstr(e.msg, "do not fit") != NULL, "%s", e.msg);
    pd_qmat big = {.q = a.q, .scale = a.s, .rows = 1, .cols = PD_GEMM_MAX_IN + 1};
    cr_assert_eq(pd_gemm(NULL, &big, &big, y, 0, &e), PD_ERANGE);
    mat_free(&a);
    mat_free(&w);
}

Test(kernels, kernel_names_and_env_override)
{
    pd_kernel k;
    pd_err e = {0};
    cr_assert_eq(pd_gemm_kernel_parse("avx2", &k, &e), 0);
    cr_assert_eq(k, PD_KERNEL_AVX2);
    cr_assert_eq(pd_gemm_kernel_parse("sse", &k, &e), PD_EINVAL);
    cr_assert_str_eq(pd_gemm_kernel_name(PD_KERNEL_AVX512), "avx512");
    /* Criterion runs each test in a fresh process, so the first lookup here reads the env. */
    setenv("PDMOE_KERNEL", "ref", 1);
    cr_assert_eq(pd_gemm_kernel_get(&k, &e), 0, "%s", e.msg);
    cr_assert_eq(k, PD_KERNEL_REF);
}

Test(kernels, bad_env_kernel_is_an_error)
{
    setenv("PDMOE_KERNEL", "neon", 1);
    pd_kernel k;
    pd_err e = {0};
    cr_assert_eq(pd_gemm_kernel_get(&k, &e), PD_EINVAL);
    cr_assert(strstr(e.msg, "PDMOE_KERNEL") != NULL, "%s", e.msg);
    struct mat a = mat_new(1, 8), w = mat_new(2, 8);
    float y[2];
    cr_assert_eq(pd_gemm(NULL, &w.m, &a.m, y, 0, &e), PD_EINVAL);
    mat_free(&a);
    mat_free(&w);
}

Test(kernels, quant_round_trip_error_within_half_step)
{
    rng_state = 5;
    const int rows = 50, cols = 333;
    float *x = malloc((size_t)rows * cols * sizeof *x), *d = malloc((size_t)rows * cols * sizeof *d);
    int8_t *q = malloc((size_t)rows * cols);
    float s[50];
    for (int r = 0; r < rows; r++) {
        float mag = powf(10.0f, (float)(r % 9) - 4.0f);   /* 1e-4 .. 1e4 */
        for (int i = 0; i < cols; i++)
            x[(size_t)r * cols + i] = rnd_float() * mag;
    }
    pd_quant_rows(x, rows, cols, q, s);
    pd_dequant_rows(q, s, rows, cols, d);
    for (int r = 0; r < rows; r++) {
        int maxq = 0;
        for (int i = 0; i < cols; i++) {
            size_t j = (size_t)r * cols + i;
            cr_assert(q[j] >= -127 && q[j] <= 127);
            maxq = abs(q[j]) > maxq ? abs(q[j]) : maxq;
            /* Half a step, plus float rounding in x / s and q * s. */
            cr_assert_leq(fabsf(d[j] - x[j]), s[r] * 0.5f * (1.0f + 1e-5f) + fabsf(x[j]) * 1e-6f,
                          "row %d col %d: x %g q %d scale %g", r, i, x[j], q[j], s[r]);
        }
        cr_assert_eq(maxq, 127, "row %d: the largest |x| must map to 127", r);
    }
    free(x);
    free(d);
    free(q);
}

/* The rule written out in scalar code (quant.h): the vectorised path must give the same bytes for
 * every length, tails included. */
Test(kernels, quant_matches_scalar_rule)
{
    rng_state = 8;
    float x[300], s;
    int8_t q[300];
    for (int n = 1; n <= 300; n += (n < 40 ? 1 : 37)) {
        for (int i = 0; i < n; i++)
            x[i] = rnd_float() * 7.0f;
        x[n / 2] = 3.5f * (x[0] < 0 ? -1.0f : 1.0f); /* some exact halves after division */
        pd_quant_rows(x, 1, n, q, &s);
        float amax = 0.0f;
        for (int i = 0; i < n; i++)
            amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        cr_assert_eq(s, amax / 127.0f, "n %d", n);
        for (int i = 0; i < n; i++) {
            float v = rintf(x[i] / s);
            v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
            cr_assert_eq(q[i], (int8_t)v, "n %d i %d: x %g", n, i, x[i]);
        }
    }
}

Test(kernels, quant_zero_and_constant_rows)
{
    float x[3][10];
    int8_t q[3][10];
    float s[3];
    for (int i = 0; i < 10; i++) {
        x[0][i] = 0.0f;
        x[1][i] = 2.5f;
        x[2][i] = -0.75f;
    }
    pd_quant_rows(&x[0][0], 3, 10, &q[0][0], s);
    cr_assert_eq(s[0], 0.0f);
    cr_assert_float_eq(s[1], 2.5f / 127.0f, 1e-9f);
    for (int i = 0; i < 10; i++) {
        cr_assert_eq(q[0][i], 0);
        cr_assert_eq(q[1][i], 127);
        cr_assert_eq(q[2][i], -127);
    }
}

Test(kernels, quant_weights_same_rule_as_rows)
{
    rng_state = 6;
    float w[7 * 45];
    int8_t q1[7 * 45], q2[7 * 45];
    float s1[7], s2[7];
    for (int i = 0; i < 7 * 45; i++)
        w[i] = rnd_float() * 3.0f;
    pd_quant_rows(w, 7, 45, q1, s1);
    pd_quant_weights(w, 7, 45, q2, s2);
    cr_assert(memcmp(q1, q2, sizeof q1) == 0 && memcmp(s1, s2, sizeof s1) == 0);
}

/* Quantising activations and running the GEMM approximates the fp32 product: a sanity check of
 * the whole W8A8 chain (per-row int8 error is about 1% of the row's largest value). */
Test(kernels, w8a8_close_to_fp32)
{
    rng_state = 7;
    const int out = 31, in = 515, T = 6;
    float *wf = malloc((size_t)out * in * sizeof *wf), *xf = malloc((size_t)T * in * sizeof *xf);
    for (int i = 0; i < out * in; i++)
        wf[i] = rnd_float();
    for (int i = 0; i < T * in; i++)
        xf[i] = rnd_float() * 4.0f;
    int8_t *wq = malloc((size_t)out * in), *xq = malloc((size_t)T * in);
    float ws[31], xs[6], y[6 * 31];
    pd_quant_weights(wf, out, in, wq, ws);
    pd_quant_rows(xf, T, in, xq, xs);
    pd_qmat W = {wq, ws, out, in}, X = {xq, xs, T, in};
    gemm_ok(NULL, &W, &X, y, 0);
    for (int t = 0; t < T; t++)
        for (int o = 0; o < out; o++) {
            double ref = 0;
            for (int i = 0; i < in; i++)
                ref += (double)wf[(size_t)o * in + i] * xf[(size_t)t * in + i];
            cr_assert(fabs(y[t * out + o] - ref) < 0.5, "t %d o %d: %g vs %g", t, o,
                      y[t * out + o], ref);
        }
    free(wf);
    free(xf);
    free(wq);
    free(xq);
}

struct count_arg {
    atomic_int *hits;   // [n_tasks]
};

static void count_task(void *arg, int task)
{
    struct count_arg *c = arg;
    atomic_fetch_add(&c->hits[task], 1);
}

Test(kernels, pool_runs_every_task_exactly_once)
{
    static const int task_counts[] = {0, 1, 2, 3, 5, 64, 1000};
    for (int nt = 1; nt <= 4; nt++) {
        pd_pool *pool;
        pd_err e = {0};
        cr_assert_eq(pd_pool_create(nt, &pool, &e), 0, "%s", e.msg);
        cr_assert_eq(pd_pool_nthreads(pool), nt);
        atomic_int *hits = calloc(1000, sizeof *hits);
        for (int call = 0; call < 300; call++) {
            int n = task_counts[call % 7];
            for (int i = 0; i < n; i++)
                atomic_store(&hits[i], 0);
            struct count_arg c = {hits};
            pd_pool_run(pool, n, count_task, &c);
            for (int i = 0; i < n; i++)
                cr_assert_eq(atomic_load(&hits[i]), 1, "threads %d call %d task %d of %d", nt,
                             call, i, n);
        }
        free(hits);
        pd_pool_destroy(pool);
    }
    pd_pool_destroy(NULL);
    cr_assert_eq(pd_pool_nthreads(NULL), 1);
}

/* The lock-free hand-off under churn: thousands of back-to-back runs of a few tasks (the workers
 * polling), with pauses longer than the workers' poll every 500 runs (so they fall asleep and the
 * next run must wake them: a lost wake-up hangs this test). Every task runs exactly once, and the
 * pool counts each run it handed out, and the wake-ups. */
Test(kernels, pool_back_to_back_runs_and_wakeups, .timeout = 60)
{
    for (int nt = 2; nt <= 3; nt++) {
        pd_pool *pool;
        pd_err e = {0};
        cr_assert_eq(pd_pool_create(nt, &pool, &e), 0, "%s", e.msg);
        atomic_int hits[4];
        int runs = 0, pauses = 0;
        for (int call = 0; call < 6000; call++) {
            int n = 2 + call % 3;
            for (int i = 0; i < n; i++)
                atomic_store(&hits[i], 0);
            struct count_arg c = {hits};
            pd_pool_run(pool, n, count_task, &c);
            runs++;
            for (int i = 0; i < n; i++)
                cr_assert_eq(atomic_load(&hits[i]), 1, "threads %d call %d task %d of %d", nt, call, i, n);
            if (call % 500 == 499) {
                struct timespec nap = {0, 2 * 1000 * 1000};   /* 2 ms: 40 times the poll */
                nanosleep(&nap, NULL);
                pauses++;
            }
        }
        pd_pool_run(NULL, 1, count_task, &(struct count_arg){hits});   /* not counted: no pool */
        struct pd_pool_stats st;
        pd_pool_stats(pool, &st);
        /* helpers preempted again and again (a busy machine: CI's sanitizer suite at -j3) send the next
         * runs to the caller alone, counted as backoff_runs, not dispatches */
        cr_assert_eq(st.dispatches + st.backoff_runs, (unsigned long long)runs, "%llu dispatches, %llu runs on the "
                     "caller alone after %llu stalls, of %d runs", st.dispatches, st.backoff_runs, st.stalls, runs);
        if (!st.stalls)
            cr_assert_geq(st.wakeups, 1, "no run woke a sleeping worker after %d pauses", pauses);
        cr_assert_leq(st.wakeups, (unsigned long long)runs);
        pd_pool_destroy(pool);
    }
}

/* A helper preempted mid-task (here: sleeping 5 ms in the task it claimed) stalls the caller. A
 * stall alone (a kernel thread's moment on the helper's core) changes nothing; stalls that repeat
 * send the next runs to the caller alone for a while (the same tasks: every one still runs exactly
 * once), and the counters say so. */
struct stall_arg {
    pthread_t caller;
    atomic_int hits[2];
};

/* ns of work on this thread (polling the clock, not sleeping) */
static void busy(long ns)
{
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do
        clock_gettime(CLOCK_MONOTONIC, &t1);
    while ((t1.tv_sec - t0.tv_sec) * 1000000000L + (t1.tv_nsec - t0.tv_nsec) < ns);
}

static void stall_task(void *arg, int task)
{
    struct stall_arg *a = arg;
    atomic_fetch_add(&a->hits[task], 1);
    if (pthread_equal(pthread_self(), a->caller)) {
        busy(50000);   /* 50 us: long enough for the polling worker to claim the other task */
    } else {
        struct timespec t = {0, 5 * 1000 * 1000};
        nanosleep(&t, NULL);
    }
}

/* One run of stall_task's pair, each task once. */
static void stall_pair(pd_pool *pool, struct stall_arg *a)
{
    atomic_store(&a->hits[0], 0);
    atomic_store(&a->hits[1], 0);
    pd_pool_run(pool, 2, stall_task, a);
    cr_assert(atomic_load(&a->hits[0]) == 1 && atomic_load(&a->hits[1]) == 1);
}

/* Runs stall_task's pairs on `pool` until a run goes to the caller alone, at most `most` runs;
 * *before and *after are the counters around that run (0: none did). The run right after a stall
 * that followed no other within 50 ms (the pool's first, or one after `quiet`) must have been handed
 * out: a stall alone starts no back-off. */
static int until_alone(pd_pool *pool, struct stall_arg *a, int most, struct pd_pool_stats *before,
                       struct pd_pool_stats *after)
{
    pd_pool_stats(pool, after);
    unsigned long long first = after->stalls + 1;
    for (int i = 0; i < most; i++) {
        *before = *after;
        stall_pair(pool, a);
        pd_pool_stats(pool, after);
        if (after->backoff_runs > before->backoff_runs) {
            cr_assert_gt(before->stalls, first, "%llu stalls: a back-off after the first alone", before->stalls);
            cr_assert_eq(after->dispatches, before->dispatches);
            return 1;
        }
        if (before->stalls == first)
            cr_assert_eq(after->dispatches, before->dispatches + 1, "the run after a stall alone was not handed out");
    }
    return 0;
}

static pd_pool *backed_off_pool(struct stall_arg *a, struct pd_pool_stats *before, struct pd_pool_stats *after)
{
    pd_pool *pool;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(2, &pool, &e), 0, "%s", e.msg);
    *a = (struct stall_arg){.caller = pthread_self()};
    cr_assert(until_alone(pool, a, 400, before, after), "no run went to the caller alone in 400 runs (%llu stalls)",
              after->stalls);
    return pool;
}

Test(kernels, pool_backs_off_after_repeated_stalls, .timeout = 60)
{
    struct stall_arg a;
    struct pd_pool_stats st, st2;
    pd_pool *pool = backed_off_pool(&a, &st, &st2);
    /* after the back-off (20 ms at most), handed out again */
    struct timespec nap = {0, 30 * 1000 * 1000};
    nanosleep(&nap, NULL);
    atomic_int hits[8] = {0};
    pd_pool_run(pool, 8, count_task, &(struct count_arg){hits});
    for (int i = 0; i < 8; i++)
        cr_assert_eq(atomic_load(&hits[i]), 1);
    pd_pool_stats(pool, &st);
    cr_assert_eq(st.dispatches, st2.dispatches + 1);
    cr_assert_eq(st.backoff_runs, st2.backoff_runs);
    /* 100 ms later the stalls start over: the next one alone starts no back-off (until_alone checks the run
     * after it), and repeated ones do again */
    nap.tv_nsec = 100 * 1000 * 1000;
    nanosleep(&nap, NULL);
    cr_assert(until_alone(pool, &a, 400, &st, &st2), "no back-off again in 400 runs (%llu stalls)", st2.stalls);
    pd_pool_destroy(pool);
}

/* A run of few tasks (a decode step's products: 4 to 16 tasks of 64 rows) is claimed in halves of
 * what is left, so each thread takes consecutive tasks and streams its rows in order; with a
 * quarter of 8 tasks the two threads' tasks interleaved (0-1 / 2 / 3 / ...), each thread's rows had
 * gaps, and decode at 2 threads ran 1.29x one thread against 1.375x with halves (medians of 8
 * alternating runs on a Zen 5 EPYC). The caller claims tasks 0-3 as it publishes the run: a
 * polling helper took them first before, while the caller was still publishing. */
struct who_arg {
    pthread_t who[64];       /* the thread that ran each task */
    atomic_int hits[64];
    long work_ns;            /* each task's work: the polling helper claims while the first claimer works */
};

static void who_task(void *arg, int task)
{
    struct who_arg *a = arg;
    a->who[task] = pthread_self();
    atomic_fetch_add(&a->hits[task], 1);
    busy(a->work_ns);
}

Test(kernels, pool_few_tasks_go_in_consecutive_halves, .timeout = 60)
{
    pd_pool *pool;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(2, &pool, &e), 0, "%s", e.msg);
    for (int run = 0; run < 20; run++) {
        struct who_arg a = {.work_ns = 200000};
        pd_pool_run(pool, 8, who_task, &a);
        for (int i = 0; i < 4; i++)
            cr_assert(pthread_equal(a.who[i], pthread_self()), "run %d: task %d ran on a helper", run, i);
    }
    pd_pool_destroy(pool);
}

/* pd_pool_run_even (a matrix's row blocks, tasks of one cost) claims in halves of what is left at
 * any task count: the caller takes tasks 0-31 of 64 (pd_pool_run takes a quarter at a time past 8
 * tasks a thread, for tasks of unequal cost). Every task runs once. */
Test(kernels, pool_even_runs_go_in_consecutive_halves, .timeout = 60)
{
    pd_pool *pool;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(2, &pool, &e), 0, "%s", e.msg);
    for (int run = 0; run < 3; run++) {
        struct who_arg *a = calloc(1, sizeof *a);
        a->work_ns = 200000;
        pd_pool_run_even(pool, 64, who_task, a);
        for (int i = 0; i < 64; i++)
            cr_assert_eq(atomic_load(&a->hits[i]), 1, "run %d: task %d ran %d times", run, i, atomic_load(&a->hits[i]));
        for (int i = 0; i < 32; i++)
            cr_assert(pthread_equal(a->who[i], pthread_self()), "run %d: task %d ran on a helper", run, i);
        free(a);
    }
    pd_pool_run_even(NULL, 3, count_task, &(struct count_arg){(atomic_int[3]){0}});   /* no pool: inline */
    pd_pool_destroy(pool);
}

/* Where the caller's time in runs goes (pd_pool_stats): its own tasks, the rest of the dispatched
 * runs (waiting for a helper's task), and the runs it made alone after a stall. */
Test(kernels, pool_counts_the_callers_time_in_runs, .timeout = 60)
{
    struct stall_arg a;
    struct pd_pool_stats st, st2;
    pd_pool *pool = backed_off_pool(&a, &st, &st2);
    /* before the back-off: the caller's 50 us tasks (a helper's 5 ms nap is never the caller's), and in
     * the stalled runs the rest of the helper's nap */
    cr_assert_geq(st.own_ns, 50000ull, "%llu ns of own tasks in %llu runs", st.own_ns, st.dispatches);
    cr_assert_geq(st.wait_ns, 4000000ull, "%llu ns waiting, with a helper's 5 ms task stalled", st.wait_ns);
    cr_assert_eq(st.alone_ns, 0);
    /* the helper's nap is its task's time, counted before the caller's run ended */
    cr_assert_geq(st.helper_tasks, 1ull);
    cr_assert_geq(st.helper_ns, 5000000ull, "%llu ns in %llu helper tasks, one a 5 ms nap", st.helper_ns,
                  st.helper_tasks);
    cr_assert_geq(st.own_tasks, 1ull);
    /* the run in the back-off is the caller's alone (both tasks its 50 us), and so is its time */
    cr_assert_eq(st2.backoff_runs, 1);
    cr_assert_geq(st2.alone_ns, 100000ull, "%llu ns alone for two 50 us tasks", st2.alone_ns);
    cr_assert_eq(st2.own_ns, st.own_ns);
    cr_assert_eq(st2.own_tasks, st.own_tasks);
    cr_assert_eq(st2.helper_tasks, st.helper_tasks);
    cr_assert_eq(st2.wait_ns, st.wait_ns);
    pd_pool_destroy(pool);
}

struct nested_arg {
    pd_pool *pool;
    atomic_int *hits;   // [8 * 8]
};

static void inner_task(void *arg, int task)
{
    atomic_fetch_add((atomic_int *)arg + task, 1);
}

static void outer_task(void *arg, int task)
{
    struct nested_arg *n = arg;
    pd_pool_run(n->pool, 8, inner_task, n->hits + task * 8);
}

Test(kernels, pool_nested_run_completes_inline)
{
    pd_pool *pool;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(3, &pool, &e), 0, "%s", e.msg);
    atomic_int hits[64] = {0};
    struct nested_arg n = {pool, hits};
    pd_pool_run(pool, 8, outer_task, &n);
    for (int i = 0; i < 64; i++)
        cr_assert_eq(atomic_load(&hits[i]), 1);
    pd_pool_destroy(pool);
}

/* Idle workers must sleep: on a 2-core machine shared by several ranks a spinning pool would eat
 * a core. Three idle workers over 300 ms may use a few ms of CPU, not hundreds. */
/* CPU time of the whole process, in seconds */
static double process_cpu_s(void)
{
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return (double)r.ru_utime.tv_sec + (double)r.ru_utime.tv_usec * 1e-6 + (double)r.ru_stime.tv_sec +
           (double)r.ru_stime.tv_usec * 1e-6;
}

/* Idle workers block: a spinning one would use the 0.3 s window's whole 0.3 s of CPU (3 workers
 * here: 0.9 s). Up to three windows, the first under 0.05 s passing: this test failed twice at
 * 0.099 s in one window, in a fresh chroot at -j3 on a 2-core virtual machine, and passed 80 of 80
 * runs beside 3 busy loops outside it (cause not found); a pool that spins fails every window. */
Test(kernels, pool_idle_workers_do_not_spin)
{
    pd_pool *pool;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(4, &pool, &e), 0, "%s", e.msg);
    atomic_int hits[8] = {0};
    pd_pool_run(pool, 8, inner_task, hits);   /* the workers have run once and gone idle */
    double cpu[3] = {0};
    int w = 0;
    for (; w < 3; w++) {
        const double c0 = process_cpu_s();
        struct timespec nap = {0, 300 * 1000 * 1000};
        nanosleep(&nap, NULL);
        cpu[w] = process_cpu_s() - c0;
        if (cpu[w] < 0.05)
            break;
    }
    cr_assert_lt(w, 3, "idle pool used %.3f / %.3f / %.3f s of CPU in three 0.3 s windows", cpu[0], cpu[1], cpu[2]);
    pd_pool_destroy(pool);
}

Test(kernels, pool_rejects_bad_sizes)
{
    pd_pool *pool = (pd_pool *)&pool;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(0, &pool, &e), PD_EINVAL);
    cr_assert_null(pool);
    cr_assert_eq(pd_pool_create(PD_POOL_MAX_THREADS + 1, &pool, &e), PD_EINVAL);
}

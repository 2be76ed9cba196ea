/* The benchmark's oneDNN anchor computes the same product as pdmoe: on odd shapes (int8 over the
 * whole range, -128 included) oneDNN's exact int32 sums equal pdmoe's, for every kernel this CPU
 * runs, so `pdmoe bench kernels` compares like with like. On a CPU without VNNI (nor AMX) oneDNN's
 * int8 matmul multiplies with vpmaddubsw, whose pairs of products saturate at 16 bits (oneDNN's
 * "Nuances of int8 computations"): its sums are exact only while a pair's products fit, so there
 * the activations are drawn from [-128, -1] (shifted by 128 to unsigned: at most 127, a pair at
 * most 2 x 127 x 128 = 32,512), the weights still over the whole range. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "bench/onednn.h"
#include "kernels/gemm.h"

static uint64_t rng_state = 7;

static int8_t rnd_i8(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (int8_t)(rng_state >> 24);
}

Test(bench_onednn, same_integers_as_pdmoe)
{
    /* |sum| <= in * 128 * 128 < 2^24: pdmoe's fp32 output with unit scales is the exact integer. */
    static const int shapes[][3] = {{5, 37, 77}, {1, 70, 1000}, {13, 129, 515}, {64, 16, 64}};
    const int exact_products = pd_onednn_int8_exact();
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int T = shapes[s][0], out = shapes[s][1], in = shapes[s][2];
        int8_t *w = malloc((size_t)out * in), *a = malloc((size_t)T * in);
        float *ws = malloc((size_t)out * sizeof *ws), *as = malloc((size_t)T * sizeof *as);
        float *y = malloc((size_t)T * out * sizeof *y);
        int32_t *z = malloc((size_t)T * out * sizeof *z);
        cr_assert(w && a && ws && as && y && z);
        for (size_t i = 0; i < (size_t)out * in; i++)
            w[i] = rnd_i8();
        for (size_t i = 0; i < (size_t)T * in; i++)
            a[i] = exact_products ? rnd_i8() : (int8_t)(rnd_i8() | 0x80);
        w[0] = a[0] = -128;
        for (int i = 0; i < out; i++)
            ws[i] = 1.0f;
        for (int i = 0; i < T; i++)
            as[i] = 1.0f;
        pd_err e = {0};
        pd_onednn_mm *mm;
        cr_assert_eq(pd_onednn_mm_create(T, out, in, w, NULL, PD_ONEDNN_S32, &mm, &e), 0, "%s", e.msg);
        cr_assert_eq(pd_onednn_mm_run(mm, a, z, &e), 0, "%s", e.msg);
        pd_onednn_mm_free(mm);
        for (int k = 0; k < PD_KERNEL_COUNT; k++) {
            if (!pd_gemm_kernel_supported((pd_kernel)k))
                continue;
            cr_assert_eq(pd_gemm_kernel_set((pd_kernel)k, &e), 0, "%s", e.msg);
            pd_qmat W = {w, ws, out, in}, A = {a, as, T, in};
            cr_assert_eq(pd_gemm(NULL, &W, &A, y, 0, &e), 0, "%s", e.msg);
            for (int i = 0; i < T * out; i++)
                cr_assert_eq((int32_t)y[i], z[i], "kernel %s, T=%d out=%d in=%d: output %d: pdmoe %d, "
                             "oneDNN %d", pd_gemm_kernel_name((pd_kernel)k), T, out, in, i,
                             (int32_t)y[i], z[i]);
        }
        free(w);
        free(a);
        free(ws);
        free(as);
        free(y);
        free(z);
    }
}

Test(bench_onednn, refuses_bad_shapes)
{
    pd_err e = {0};
    pd_onednn_mm *mm = (pd_onednn_mm *)1;
    int8_t w[4] = {0};
    cr_assert_eq(pd_onednn_mm_create(0, 2, 2, w, NULL, PD_ONEDNN_S32, &mm, &e), PD_EINVAL);
    cr_assert_null(mm);
    cr_assert(strstr(e.msg, "bad shape") != NULL, "%s", e.msg);
    cr_assert_eq(pd_onednn_mm_create(1, 2, 2, w, NULL, PD_ONEDNN_F32, &mm, &e), PD_EINVAL,
                 "F32 without scales must be refused");
}

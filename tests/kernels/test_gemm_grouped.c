/* The grouped (MoE) form of the AVX-512 GEMM against the portable reference, bit for bit, at the
 * group sizes where its few-token path changes shape (gemm_vnni_tw.c): 1-8 tokens in a tail
 * vector alone, 9-15 in one part-empty vector, 16 in one whole vector, 17-20 one vector and a
 * tail of 1-4, 21-31 two vectors, then 3-6 vectors with a tail of up to 8 tokens or one more
 * part-empty vector, 97 and 200 on the packed weights; each with reductions that end inside a
 * 4-byte step and inside a tail vector's 8-64 bytes, and output rows that end inside a tile. Then
 * unequal groups in one call, with different output widths, y += and 1 and 2 threads, and a call
 * large enough (over 512 blocks of 64 rows) that its tasks take several blocks each. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "core/threadpool.h"
#include "kernels/gemm.h"

static uint64_t rng_state = 29;

static uint32_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}

static int8_t *bytes(size_t n)
{
    int8_t *p = malloc(n ? n : 1);
    cr_assert_not_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = (int8_t)(rnd() & 0xff);
    return p;
}

static float *scales(int n)
{
    float *s = malloc((size_t)n * sizeof *s);
    cr_assert_not_null(s);
    for (int i = 0; i < n; i++)
        s[i] = 1e-3f + (float)(rnd() % 1000) * 1e-5f;
    return s;
}

/* One grouped call with kernel k on `pool`; every group's y starts as `base`. */
static void run(pd_kernel k, pd_pool *pool, const pd_qmat *A, pd_gemm_group *g, int n_groups, int flags,
                float *const *ys, const float *const *base)
{
    pd_err e = {0};
    for (int i = 0; i < n_groups; i++)
        memcpy(ys[i], base[i], (size_t)g[i].n * g[i].w.rows * sizeof(float));
    for (int i = 0; i < n_groups; i++)
        g[i].y = ys[i];
    cr_assert_eq(pd_gemm_kernel_set(k, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_gemm_grouped(pool, A, g, n_groups, flags, &e), 0, "%s", e.msg);
}

/* Groups of sizes n[i] and output widths out[i] over T activation rows of `in` bytes, the rows
 * drawn at random (repeats included): AVX-512 on 1 and 2 threads, plain and y +=, against the
 * reference. */
static void check(const int *n, const int *out, int n_groups, int in, int T, pd_pool *pool2)
{
    int8_t *a = bytes((size_t)T * in);
    float *as = scales(T);
    pd_qmat A = {a, as, T, in};
    pd_gemm_group g[48];
    int8_t *w[48];
    float *ws[48], *ref[48], *y[48], *base[48];
    int32_t *rows[48];
    cr_assert(n_groups <= 48);
    for (int i = 0; i < n_groups; i++) {
        w[i] = bytes((size_t)out[i] * in);
        ws[i] = scales(out[i]);
        rows[i] = malloc((size_t)(n[i] ? n[i] : 1) * sizeof *rows[i]);
        for (int j = 0; j < n[i]; j++)
            rows[i][j] = (int32_t)(rnd() % (uint32_t)T);
        size_t ny = (size_t)(n[i] ? n[i] : 1) * out[i];
        ref[i] = malloc(ny * sizeof(float));
        y[i] = malloc(ny * sizeof(float));
        base[i] = malloc(ny * sizeof(float));
        for (size_t q = 0; q < ny; q++)
            base[i][q] = (float)(rnd() % 100) - 50.0f;
        g[i] = (pd_gemm_group){.w = {w[i], ws[i], out[i], in}, .rows = rows[i], .n = n[i]};
    }
    for (int flags = 0; flags <= PD_GEMM_ACCUM; flags += PD_GEMM_ACCUM) {
        run(PD_KERNEL_REF, NULL, &A, g, n_groups, flags, ref, (const float *const *)base);
        for (int p = 0; p < 2; p++) {
            run(PD_KERNEL_AVX512, p ? pool2 : NULL, &A, g, n_groups, flags, y, (const float *const *)base);
            for (int i = 0; i < n_groups; i++)
                for (int j = 0; j < n[i]; j++)
                    cr_assert(memcmp(y[i] + (size_t)j * out[i], ref[i] + (size_t)j * out[i],
                                     (size_t)out[i] * sizeof(float)) == 0,
                              "group %d of %d (%d tokens, out %d, in %d)%s, %d threads: token %d differs "
                              "from the reference", i, n_groups, n[i], out[i], in, flags ? ", y +=" : "", p + 1, j);
        }
    }
    for (int i = 0; i < n_groups; i++) {
        free(w[i]);
        free(ws[i]);
        free(rows[i]);
        free(ref[i]);
        free(y[i]);
        free(base[i]);
    }
    free(a);
    free(as);
}

Test(kernels, grouped_group_sizes_match_reference)
{
    if (!pd_gemm_kernel_supported(PD_KERNEL_AVX512))
        cr_skip_test("no AVX-512 VNNI on this CPU");
    static const int sizes[] = {1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 20, 21, 24, 33, 40, 41,
                                56, 57, 63, 64, 65, 72, 73, 80, 96, 97, 200};
    /* reductions: a 4-byte step's tail, a 64-byte vector's, one tail vector of each width's */
    static const int ins[] = {3, 37, 517, 1024};
    static const int outs[] = {13, 70};
    pd_pool *pool2;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(2, &pool2, &e), 0, "%s", e.msg);
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
        for (size_t i = 0; i < sizeof ins / sizeof ins[0]; i++)
            for (size_t o = 0; o < sizeof outs / sizeof outs[0]; o++)
                check(&sizes[s], &outs[o], 1, ins[i], 211, pool2);
    pd_pool_destroy(pool2);
}

Test(kernels, grouped_unequal_groups_match_reference)
{
    if (!pd_gemm_kernel_supported(PD_KERNEL_AVX512))
        cr_skip_test("no AVX-512 VNNI on this CPU");
    /* a layer's routed experts: sizes 0 to 200 side by side, output widths that differ */
    static const int n[] = {1, 15, 16, 17, 63, 64, 65, 80, 200, 0, 5, 72, 2, 49};
    static const int out[] = {64, 70, 13, 130, 64, 128, 64, 65, 64, 64, 1, 192, 17, 64};
    pd_pool *pool2;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(2, &pool2, &e), 0, "%s", e.msg);
    check(n, out, 14, 1030, 256, pool2);
    check(n, out, 14, 4096, 300, pool2);
    pd_pool_destroy(pool2);
}

Test(kernels, grouped_multi_block_tasks_match_reference)
{
    if (!pd_gemm_kernel_supported(PD_KERNEL_AVX512))
        cr_skip_test("no AVX-512 VNNI on this CPU");
    /* 40 experts of 1000 rows (16 blocks, the last part full): 640 blocks, so tasks of 2 blocks
     * (128 rows; 1000 = 7 x 128 + 104), sizes across the few-token paths and beyond */
    int n[40], out[40];
    for (int i = 0; i < 40; i++) {
        n[i] = (int[]){3, 17, 64, 65, 72, 100, 0, 9}[i % 8];
        out[i] = 1000;
    }
    pd_pool *pool2;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(2, &pool2, &e), 0, "%s", e.msg);
    check(n, out, 40, 67, 128, pool2);
    pd_pool_destroy(pool2);
}

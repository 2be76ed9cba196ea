/* Every GEMM kernel against the portable reference, bit for bit, on long reductions (the AVX-512
 * kernel's blocking is tested on odd shapes in test_gemm_vnni.c): reductions of one, two and
 * three 4 KiB blocks with ragged tails, token counts across super-block boundaries with every tail
 * width, row counts that end mid-tile, the plain and the grouped forms, 1 and 2 threads. The AMX
 * kernel runs here on the tiles where the CPU has them; its C model of the tiles does not (it was
 * two thirds of this test's time, a minute under the sanitizers): its blocking over 1 KiB
 * reduction blocks, several with a partial last one, is test_gemm_amx.c's, on that model. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "core/threadpool.h"
#include "kernels/gemm.h"

static uint64_t rng_state = 5;

static uint32_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}

static void *filled(size_t n)
{
    int8_t *p = malloc(n ? n : 1);
    cr_assert_not_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = (int8_t)(rnd() & 0xff);   /* -128 included */
    return p;
}

static float *scales(int n)
{
    float *s = malloc((size_t)n * sizeof *s);
    for (int i = 0; i < n; i++)
        s[i] = 1e-3f + (float)(rnd() % 1000) * 1e-5f;
    return s;
}

Test(kernels, blocked_gemm_matches_reference)
{
    static const int shapes[][2] = {{37, 4096 + 13}, {70, 8192 + 65}, {9, 4096}, {130, 2 * 4096 + 4096 - 1}};
    static const int tokens[] = {2, 7, 95, 96, 97, 103, 193, 200};
    pd_pool *pool2;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(2, &pool2, &e), 0, "%s", e.msg);
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (size_t ti = 0; ti < sizeof tokens / sizeof tokens[0]; ti++) {
            int out = shapes[s][0], in = shapes[s][1], T = tokens[ti];
            int8_t *w = filled((size_t)out * in), *a = filled((size_t)T * in);
            float *ws = scales(out), *as = scales(T);
            size_t ny = (size_t)T * out;
            float *ref = malloc(ny * sizeof *ref), *y = malloc(ny * sizeof *y);
            pd_qmat W = {w, ws, out, in}, A = {a, as, T, in};
            cr_assert_eq(pd_gemm_kernel_set(PD_KERNEL_REF, &e), 0, "%s", e.msg);
            cr_assert_eq(pd_gemm(NULL, &W, &A, ref, 0, &e), 0, "%s", e.msg);
            /* grouped: every other token, in reverse order, against the reference rows */
            int n = (T + 1) / 2;
            int32_t *rows = malloc((size_t)n * sizeof *rows);
            for (int j = 0; j < n; j++)
                rows[j] = T - 1 - 2 * j;
            float *gy = malloc((size_t)n * out * sizeof *gy);
            for (int k = 0; k < PD_KERNEL_COUNT; k++) {
                if (!pd_gemm_kernel_supported((pd_kernel)k) || k == PD_KERNEL_AMX_EMU)
                    continue;
                cr_assert_eq(pd_gemm_kernel_set((pd_kernel)k, &e), 0, "%s", e.msg);
                for (int p = 0; p < 2; p++) {
                    pd_pool *pool = p ? pool2 : NULL;
                    /* (the reference on 1 thread is ref itself: the same call, not made twice) */
                    if (k != PD_KERNEL_REF || p) {
                        memset(y, 0, ny * sizeof *y);
                        cr_assert_eq(pd_gemm(pool, &W, &A, y, 0, &e), 0, "%s", e.msg);
                        cr_assert(memcmp(y, ref, ny * sizeof *y) == 0, "kernel %s, %d threads, out %d in %d T %d",
                                  pd_gemm_kernel_name((pd_kernel)k), p + 1, out, in, T);
                    }
                    pd_gemm_group g = {.w = W, .rows = rows, .n = n, .y = gy};
                    cr_assert_eq(pd_gemm_grouped(pool, &A, &g, 1, 0, &e), 0, "%s", e.msg);
                    for (int j = 0; j < n; j++)
                        cr_assert(memcmp(gy + (size_t)j * out, ref + (size_t)rows[j] * out, (size_t)out * sizeof *gy) == 0,
                                  "grouped, kernel %s, %d threads, out %d in %d T %d, row %d",
                                  pd_gemm_kernel_name((pd_kernel)k), p + 1, out, in, T, rows[j]);
                }
            }
            free(w);
            free(a);
            free(ws);
            free(as);
            free(ref);
            free(y);
            free(rows);
            free(gy);
        }
    pd_pool_destroy(pool2);
}

/* A bf16 matrix kept in bf16 (struct pd_linear's h, read in place) gives the bits an fp32 copy of
 * it gives (f): rows widened in blocks, then the same pd_dot_rows; for short and long rows, row
 * counts that end inside a widening block and a task, 1 to 17 tokens (1 and 2 widened in
 * registers by pd_dot_rows_bf16), 1 and 2 threads, and the float reference (ref = 1) too. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "core/threadpool.h"
#include "engine/linear.h"
#include "kernels/ops.h"

Test(linear_bf16, same_bits_as_the_fp32_copy)
{
    static const int shapes[][2] = {{1, 7}, {67, 512}, {130, 4096}, {9, PD_LINEAR_WIDE_FLOATS}, {200, 33}};
    static const int tokens[] = {1, 2, 3, 17};
    pd_pool *pool;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(2, &pool, &e), 0, "%s", e.msg);
    uint64_t s = 7;
    for (size_t k = 0; k < sizeof shapes / sizeof *shapes; k++) {
        int out = shapes[k][0], in = shapes[k][1];
        size_t n = (size_t)out * in;
        uint16_t *h = malloc(n * 2);
        float *f = malloc(n * 4);
        for (size_t i = 0; i < n; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            float v = ((float)(s >> 40) / (float)(1 << 24) - 0.5f) * 0.1f;
            h[i] = pd_f32_to_bf16(v);
            f[i] = pd_bf16_to_f32(h[i]);
        }
        struct pd_linear lf = {.f = f, .out = out, .in = in}, lh = {.h = h, .out = out, .in = in};
        for (size_t ti = 0; ti < sizeof tokens / sizeof *tokens; ti++) {
            int T = tokens[ti];
            float *x = malloc((size_t)T * in * 4), *yf = malloc((size_t)T * out * 4), *yh = malloc((size_t)T * out * 4);
            for (int i = 0; i < T * in; i++) {
                s = s * 6364136223846793005ull + 1442695040888963407ull;
                x[i] = (float)(s >> 40) / (float)(1 << 24) - 0.5f;
            }
            for (int ref = 0; ref < 2; ref++)
                for (int p = 0; p < 2; p++) {
                    memset(yh, 0xff, (size_t)T * out * 4);
                    cr_assert_eq(pd_linear_fwd(&lf, p ? pool : NULL, ref, x, T, yf, NULL, NULL, &e), 0, "%s", e.msg);
                    cr_assert_eq(pd_linear_fwd(&lh, p ? pool : NULL, ref, x, T, yh, NULL, NULL, &e), 0, "%s", e.msg);
                    cr_assert(memcmp(yf, yh, (size_t)T * out * 4) == 0, "[%d, %d] x %d tokens, ref %d, %d threads", out,
                              in, T, ref, p + 1);
                }
            free(x), free(yf), free(yh);
        }
        free(h), free(f);
    }
    pd_pool_destroy(pool);
}

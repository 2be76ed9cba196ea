/* A bf16 matrix kept in bf16 (struct pd_linear's h, read in place) gives the bits an fp32 copy of
 * it gives (f), its rows widened in registers on every path: for short and long rows, row counts
 * that end inside a tile's row block and a task, 1 to 17 tokens (row by row, a few tokens per row,
 * and the tiled product from 8 tokens, on both sides of each crossing), 1 and 2 threads, and the
 * float reference (ref = 1) too. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/threadpool.h"
#include "engine/linear.h"
#include "kernels/ops.h"

Test(linear_bf16, same_bits_as_the_fp32_copy)
{
    static const int shapes[][2] = {{1, 7}, {67, 512}, {130, 4096}, {9, PD_LINEAR_WIDE_FLOATS}, {200, 33}};
    static const int tokens[] = {1, 2, 3, 4, 7, 8, 11, 12, 17};
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

/* Several float products in one pool run (pd_linear_fwd_float_many; attention's projections of x
 * and its wo_a groups): each the bits pd_linear_fwd gives alone, with inputs and outputs that are
 * columns of wider rows, bf16 and fp32 matrices mixed, 1 to 17 tokens, 1 and 2 threads; nothing
 * outside the outputs' columns written; an int8 product or more than 16 refused by name. */
Test(linear_bf16, float_many_same_bits_as_one_by_one)
{
    enum { N = 3, LDX = 700, LDY = 300 };
    static const int shapes[N][2] = {{67, 512}, {130, 33}, {5, 640}};
    static const int xoff[N] = {0, 600, 17}, yoff[N] = {0, 67, 200};
    static const int tokens[] = {1, 2, 3, 17};
    pd_pool *pool;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(2, &pool, &e), 0, "%s", e.msg);
    uint64_t s = 11;
    struct pd_linear l[N];
    void *mem[N];
    for (int k = 0; k < N; k++) {
        size_t n = (size_t)shapes[k][0] * shapes[k][1];
        l[k] = (struct pd_linear){.out = shapes[k][0], .in = shapes[k][1]};
        if (k % 2 == 0) {
            uint16_t *h = malloc(n * 2);
            for (size_t i = 0; i < n; i++) {
                s = s * 6364136223846793005ull + 1442695040888963407ull;
                h[i] = pd_f32_to_bf16(((float)(s >> 40) / (float)(1 << 24) - 0.5f) * 0.1f);
            }
            l[k].h = h, mem[k] = h;
        } else {
            float *f = malloc(n * 4);
            for (size_t i = 0; i < n; i++) {
                s = s * 6364136223846793005ull + 1442695040888963407ull;
                f[i] = ((float)(s >> 40) / (float)(1 << 24) - 0.5f) * 0.1f;
            }
            l[k].f = f, mem[k] = f;
        }
    }
    for (size_t ti = 0; ti < sizeof tokens / sizeof *tokens; ti++) {
        int T = tokens[ti];
        float *x = malloc((size_t)T * LDX * 4), *y = malloc((size_t)T * LDY * 4), *one = malloc((size_t)T * LDY * 4);
        float *xk = malloc((size_t)T * LDX * 4);
        for (int i = 0; i < T * LDX; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            x[i] = (float)(s >> 40) / (float)(1 << 24) - 0.5f;
        }
        struct pd_linear_io io[N];
        for (int k = 0; k < N; k++)
            io[k] = (struct pd_linear_io){.l = &l[k], .x = x + xoff[k], .ldx = LDX, .y = y + yoff[k], .ldy = LDY};
        for (int p = 0; p < 2; p++) {
            memset(y, 0xff, (size_t)T * LDY * 4);
            cr_assert_eq(pd_linear_fwd_float_many(io, N, p ? pool : NULL, T, &e), 0, "%s", e.msg);
            for (int k = 0; k < N; k++) {
                const int in = shapes[k][1], out = shapes[k][0];
                for (int t = 0; t < T; t++)
                    memcpy(xk + (size_t)t * in, x + (size_t)t * LDX + xoff[k], (size_t)in * 4);
                cr_assert_eq(pd_linear_fwd(&l[k], NULL, 0, xk, T, one, NULL, NULL, &e), 0, "%s", e.msg);
                for (int t = 0; t < T; t++)
                    cr_assert(memcmp(one + (size_t)t * out, y + (size_t)t * LDY + yoff[k], (size_t)out * 4) == 0,
                              "product %d, token %d of %d, %d threads", k, t, T, p + 1);
            }
            for (int t = 0; t < T; t++)
                for (int c = 205; c < LDY; c++)
                    cr_assert(isnan(y[(size_t)t * LDY + c]), "column %d of token %d written", c, t);
        }
        free(x), free(y), free(one), free(xk);
    }
    int8_t q[4] = {0};
    float sc[2] = {1, 1};
    struct pd_linear l8 = {.q = {.q = q, .scale = sc, .rows = 2, .cols = 2}, .out = 2, .in = 2};
    float x2[2] = {0}, y2[2];
    struct pd_linear_io bad = {.l = &l8, .x = x2, .ldx = 2, .y = y2, .ldy = 2};
    cr_assert_eq(pd_linear_fwd_float_many(&bad, 1, pool, 1, &e), PD_EINVAL);
    cr_assert(strstr(e.msg, "int8"), "%s", e.msg);
    struct pd_linear_io many[17];
    for (int k = 0; k < 17; k++)
        many[k] = (struct pd_linear_io){.l = &l[1], .x = x2, .ldx = 33, .y = y2, .ldy = 130};
    cr_assert_eq(pd_linear_fwd_float_many(many, 17, pool, 1, &e), PD_EINVAL);
    cr_assert(strstr(e.msg, "17"), "%s", e.msg);
    for (int k = 0; k < N; k++)
        free(mem[k]);
    pd_pool_destroy(pool);
}

/* The step profile's float clock: counts every float product (pd_linear_fwd on bf16 or fp32 weights
 * and pd_linear_fwd_float_many) while on, on the calling thread, and nothing while off; not the
 * int8 ones (kernels/gemm.h's clock has those). */
Test(linear_bf16, float_clock_counts_only_float_products_while_on)
{
    enum { OUT = 64, IN = 256, T = 4 };
    pd_err e = {0};
    uint16_t *h = calloc((size_t)OUT * IN, 2);
    int8_t *q = calloc((size_t)OUT * IN, 1);
    float *qs = calloc(OUT, 4), *x = calloc((size_t)T * IN, 4), *y = malloc((size_t)T * OUT * 4);
    int8_t *xq = malloc((size_t)T * IN);
    float *xs = malloc((size_t)T * 4);
    struct pd_linear lh = {.h = h, .out = OUT, .in = IN}, lq = {.q = {q, qs, OUT, IN}, .out = OUT, .in = IN};
    struct pd_call_clock *clock = pd_linear_clock();
    int64_t t0 = clock->ns;
    cr_assert_eq(pd_linear_fwd(&lh, NULL, 0, x, T, y, NULL, NULL, &e), 0, "%s", e.msg);
    cr_assert_eq(clock->ns, t0, "counted while off");
    clock->on = 1;
    cr_assert_eq(pd_linear_fwd(&lh, NULL, 0, x, T, y, NULL, NULL, &e), 0, "%s", e.msg);
    int64_t t1 = clock->ns;
    cr_assert_gt(t1, t0, "a bf16 product not counted");
    cr_assert_eq(pd_linear_fwd(&lq, NULL, 0, x, T, y, xq, xs, &e), 0, "%s", e.msg);
    cr_assert_eq(clock->ns, t1, "an int8 product counted as a float one");
    clock->on = 0;
    cr_assert_eq(pd_linear_fwd(&lh, NULL, 0, x, T, y, NULL, NULL, &e), 0, "%s", e.msg);
    cr_assert_eq(clock->ns, t1, "counted after it was turned off");
    free(h);
    free(q);
    free(qs);
    free(x);
    free(y);
    free(xq);
    free(xs);
}

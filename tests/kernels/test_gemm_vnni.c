/* The AVX-512 GEMMs against the portable reference, bit for bit: beyond 96 tokens packed 64-row
 * weight blocks of KC = 512 reduction bytes offset to unsigned and 6 x 64 micro-tiles; 25 to 96
 * tokens packed (offset) and weights broadcast from the matrix, 2 to 6 vectors of 16 tokens (both
 * gemm_vnni.c; in the grouped form from 2 tokens); 2 to 24 tokens the inner product
 * (gemm_avx512_small.c); with 1-3 byte reduction
 * tails and rows ending mid-vector. Odd shapes: reductions of 1 to 3 bytes, of a
 * few bytes more or less than one or two packed blocks, row counts that end inside a 16-row vector
 * and inside a 64-row tile, every token tail width, y += with PD_GEMM_ACCUM, the grouped form with
 * repeated and reversed rows, and the extremes (-128 everywhere, the int32 bound). */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "core/threadpool.h"
#include "kernels/gemm.h"

static uint64_t rng_state = 17;

static uint32_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}

static int8_t *bytes(size_t n, int extreme)
{
    int8_t *p = malloc(n ? n : 1);
    cr_assert_not_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = extreme ? (int8_t)-128 : (int8_t)(rnd() & 0xff);
    return p;
}

static float *scales(int n)
{
    float *s = malloc((size_t)n * sizeof *s);
    for (int i = 0; i < n; i++)
        s[i] = 1e-3f + (float)(rnd() % 1000) * 1e-5f;
    return s;
}

/* y from the reference and from AVX-512 (1 and 2 threads), plain and accumulated, and grouped. */
static void check(int out, int in, int T, int extreme, pd_pool *pool2)
{
    pd_err e = {0};
    int8_t *w = bytes((size_t)out * in, extreme), *a = bytes((size_t)T * in, extreme);
    float *ws = scales(out), *as = scales(T);
    size_t ny = (size_t)T * out;
    float *ref = malloc(ny * sizeof *ref), *y = malloc(ny * sizeof *y), *base = malloc(ny * sizeof *base);
    for (size_t i = 0; i < ny; i++)
        base[i] = (float)(rnd() % 100) - 50.0f;
    pd_qmat W = {w, ws, out, in}, A = {a, as, T, in};
    /* grouped: rows in reverse, the last one twice */
    int n = T + 1;
    int32_t *rows = malloc((size_t)n * sizeof *rows);
    for (int j = 0; j < T; j++)
        rows[j] = T - 1 - j;
    rows[T] = 0;
    float *gy = malloc((size_t)n * out * sizeof *gy);

    for (int accum = 0; accum < 2; accum++) {
        cr_assert_eq(pd_gemm_kernel_set(PD_KERNEL_REF, &e), 0, "%s", e.msg);
        memcpy(ref, base, ny * sizeof *ref);
        cr_assert_eq(pd_gemm(NULL, &W, &A, ref, accum ? PD_GEMM_ACCUM : 0, &e), 0, "%s", e.msg);
        cr_assert_eq(pd_gemm_kernel_set(PD_KERNEL_AVX512, &e), 0, "%s", e.msg);
        for (int p = 0; p < 2; p++) {
            memcpy(y, base, ny * sizeof *y);
            cr_assert_eq(pd_gemm(p ? pool2 : NULL, &W, &A, y, accum ? PD_GEMM_ACCUM : 0, &e), 0, "%s", e.msg);
            for (size_t i = 0; i < ny; i++)
                cr_assert(memcmp(&y[i], &ref[i], sizeof *y) == 0,
                          "out %d in %d T %d%s%s, %d threads: y[%zu][%zu] = %a, reference %a", out, in, T,
                          accum ? ", accumulated" : "", extreme ? ", all -128" : "", p + 1, i / out, i % out,
                          (double)y[i], (double)ref[i]);
        }
    }
    cr_assert_eq(pd_gemm_kernel_set(PD_KERNEL_REF, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_gemm(NULL, &W, &A, ref, 0, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_gemm_kernel_set(PD_KERNEL_AVX512, &e), 0, "%s", e.msg);
    pd_gemm_group g = {.w = W, .rows = rows, .n = n, .y = gy};
    cr_assert_eq(pd_gemm_grouped(pool2, &A, &g, 1, 0, &e), 0, "%s", e.msg);
    for (int j = 0; j < n; j++)
        cr_assert(memcmp(gy + (size_t)j * out, ref + (size_t)rows[j] * out, (size_t)out * sizeof *gy) == 0,
                  "grouped: out %d in %d T %d, row %d (activation row %d)", out, in, T, j, rows[j]);
    free(w);
    free(a);
    free(ws);
    free(as);
    free(ref);
    free(y);
    free(base);
    free(rows);
    free(gy);
}

Test(kernels, vnni_gemm_odd_shapes_match_reference)
{
    if (!pd_gemm_kernel_supported(PD_KERNEL_AVX512))
        cr_skip_test("no AVX-512 VNNI on this CPU");
    static const int ins[] = {1, 2, 3, 5, 63, 64, 255, 511, 512, 513, 1023, 1027};
    static const int outs[] = {1, 15, 17, 63, 65, 130};
    static const int tokens[] = {2, 3, 4, 5, 6, 7, 13};
    pd_pool *pool2;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(2, &pool2, &e), 0, "%s", e.msg);
    for (size_t i = 0; i < sizeof ins / sizeof ins[0]; i++)
        for (size_t o = 0; o < sizeof outs / sizeof outs[0]; o++)
            for (size_t t = 0; t < sizeof tokens / sizeof tokens[0]; t++)
                check(outs[o], ins[i], tokens[t], 0, pool2);
    pd_pool_destroy(pool2);
}

Test(kernels, vnni_gemm_few_tokens_at_the_row_limit_match_reference)
{
    if (!pd_gemm_kernel_supported(PD_KERNEL_AVX512))
        cr_skip_test("no AVX-512 VNNI on this CPU");
    /* 2 and 3 tokens on rows of at most 2048 bytes take the GEMV's few-token tiles (plain, and
     * grouped: check() runs T + 1 rows), past it and from 4 tokens the other paths; the tail of 0
     * to 63 bytes masked; random bytes and all -128 */
    static const int ins[] = {64, 2047, 2048, 2049};
    static const int outs[] = {1, 9, 70};
    static const int tokens[] = {1, 2, 3, 4};
    pd_pool *pool2;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(2, &pool2, &e), 0, "%s", e.msg);
    for (size_t i = 0; i < sizeof ins / sizeof ins[0]; i++)
        for (size_t o = 0; o < sizeof outs / sizeof outs[0]; o++)
            for (size_t t = 0; t < sizeof tokens / sizeof tokens[0]; t++) {
                check(outs[o], ins[i], tokens[t], 0, pool2);
                check(outs[o], ins[i], tokens[t], 1, pool2);
            }
    pd_pool_destroy(pool2);
}

Test(kernels, vnni_gemm_few_token_widths_match_reference)
{
    if (!pd_gemm_kernel_supported(PD_KERNEL_AVX512))
        cr_skip_test("no AVX-512 VNNI on this CPU");
    /* plain: 2 .. 24 tokens take the inner product (gemm_avx512_small.c), 25 .. 96 the
     * packed-activation path in 2 to 6 vectors of 16 (8, 6, 6, 4 and 4 rows per tile), 97 on the
     * packed weights; grouped (check() runs T + 1 rows): the packed activations from 2 tokens on */
    static const int ins[] = {3, 64, 517};
    static const int outs[] = {7, 13, 64, 70};
    static const int tokens[] = {17, 24, 25, 31, 33, 48, 49, 63, 64, 65, 80, 81, 96, 97};
    pd_pool *pool2;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(2, &pool2, &e), 0, "%s", e.msg);
    for (size_t i = 0; i < sizeof ins / sizeof ins[0]; i++)
        for (size_t o = 0; o < sizeof outs / sizeof outs[0]; o++)
            for (size_t t = 0; t < sizeof tokens / sizeof tokens[0]; t++)
                check(outs[o], ins[i], tokens[t], 0, pool2);
    pd_pool_destroy(pool2);
}

Test(kernels, vnni_gemm_long_token_runs_match_reference)
{
    if (!pd_gemm_kernel_supported(PD_KERNEL_AVX512))
        cr_skip_test("no AVX-512 VNNI on this CPU");
    pd_pool *pool2;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(2, &pool2, &e), 0, "%s", e.msg);
    /* more tokens than one super-block of the kernel (516), across its boundary */
    check(70, 517, 517, 0, pool2);
    check(64, 1030, 523, 0, pool2);
    /* an output of PD_GEMM_STREAM_Y_BYTES or more (1.2 MB) goes past the caches in whole aligned
     * lines: rows of y 4,048 bytes apart, so on any 16-byte aligned buffer one row in four starts
     * its lines aligned and the others do not; the last chunk of rows 52 wide */
    check(1012, 70, 300, 0, pool2);
    pd_pool_destroy(pool2);
}

Test(kernels, vnni_gemm_extremes_exact)
{
    if (!pd_gemm_kernel_supported(PD_KERNEL_AVX512))
        cr_skip_test("no AVX-512 VNNI on this CPU");
    pd_pool *pool2;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(2, &pool2, &e), 0, "%s", e.msg);
    /* -128 x -128 everywhere: every offset sum wraps past 2^31 for in >= 2^17 / 2; the exact
     * result, 16384 * in, is what the reference gives */
    check(17, 65536, 7, 1, pool2);
    check(65, 4099, 6, 1, pool2);
    check(30, 65536, 100, 1, pool2);   /* the packed-weight path */
    pd_pool_destroy(pool2);
}

/* A product of fewer than 262,144 multiply-adds runs on the calling thread (a batch-1 product of
 * v4-flash-mini's wo_b, 512 x 256, ran 3.6 us there and 4.6 us over two threads); from there it is
 * handed to the pool; the same bits either way. */
Test(kernels, gemm_small_products_stay_on_the_caller)
{
    pd_pool *pool2;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(2, &pool2, &e), 0, "%s", e.msg);
    int8_t *w = bytes((size_t)1024 * 256, 0), *a = bytes(256, 0);
    float *ws = scales(1024), *as = scales(1);
    float y1[1024], y2[1024];
    for (int out = 511; out <= 1024; out += 513) {   /* 511 x 256 = 130,816; 1024 x 256 = 262,144 */
        pd_qmat W = {w, ws, out, 256}, A = {a, as, 1, 256};
        struct pd_pool_stats p0, p1;
        pd_pool_stats(pool2, &p0);
        cr_assert_eq(pd_gemm(pool2, &W, &A, y2, 0, &e), 0, "%s", e.msg);
        pd_pool_stats(pool2, &p1);
        const unsigned long long runs = p1.dispatches + p1.backoff_runs - p0.dispatches - p0.backoff_runs;
        cr_assert_eq(runs, out < 1024 ? 0ull : 1ull, "%d x 256: %llu pool runs", out, runs);
        cr_assert_eq(pd_gemm(NULL, &W, &A, y1, 0, &e), 0, "%s", e.msg);
        cr_assert_eq(memcmp(y1, y2, (size_t)out * sizeof *y1), 0, "%d x 256: the pool changed the bits", out);
    }
    free(w);
    free(a);
    free(ws);
    free(as);
    pd_pool_destroy(pool2);
}

/* The profilers' GEMM clock: counts only while on, on the calling thread, and every kernel. */
Test(kernels, gemm_timing_counts_only_when_on)
{
    pd_err e = {0};
    int8_t *w = bytes(64 * 256, 0), *a = bytes(32 * 256, 0);
    float *ws = scales(64), *as = scales(32), *y = malloc(32 * 64 * sizeof *y);
    pd_qmat W = {w, ws, 64, 256}, A = {a, as, 32, 256};
    struct pd_call_clock *clock = pd_gemm_clock();
    int64_t t0 = clock->ns;
    cr_assert_eq(pd_gemm(NULL, &W, &A, y, 0, &e), 0, "%s", e.msg);
    cr_assert_eq(clock->ns, t0, "counted while off");
    clock->on = 1;
    cr_assert_eq(pd_gemm(NULL, &W, &A, y, 0, &e), 0, "%s", e.msg);
    int64_t t1 = clock->ns;
    cr_assert_gt(t1, t0, "pd_gemm not counted");
    int32_t rows[3] = {0, 5, 31};
    pd_gemm_group g = {.w = W, .rows = rows, .n = 3, .y = y};
    cr_assert_eq(pd_gemm_grouped(NULL, &A, &g, 1, 0, &e), 0, "%s", e.msg);
    cr_assert_gt(clock->ns, t1, "pd_gemm_grouped not counted");
    clock->on = 0;
    int64_t t2 = clock->ns;
    cr_assert_eq(pd_gemm(NULL, &W, &A, y, 0, &e), 0, "%s", e.msg);
    cr_assert_eq(clock->ns, t2, "counted after it was turned off");
    free(w);
    free(a);
    free(ws);
    free(as);
    free(y);
}

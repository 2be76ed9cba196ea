/* pd_quant_rows_pool: the rows split over a pool give the bytes and scales of pd_quant_rows, for
 * every thread count, on shapes below and above the serial threshold and with odd row lengths. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "core/threadpool.h"
#include "kernels/quant.h"

static uint64_t rng_state = 11;

static float rnd_float(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((double)(rng_state >> 11) / 4503599627370496.0 * 2.0 - 1.0);
}

Test(kernels, quant_rows_pool_same_bytes_any_threads)
{
    static const int shapes[][2] = {{1, 5}, {3, 100}, {300, 513}, {512, 4096}, {97, 14336}, {2000, 33}};
    pd_pool *pools[3] = {NULL, NULL, NULL};
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(2, &pools[1], &e), 0, "%s", e.msg);
    cr_assert_eq(pd_pool_create(3, &pools[2], &e), 0, "%s", e.msg);
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int rows = shapes[s][0], cols = shapes[s][1];
        size_t n = (size_t)rows * cols;
        float *x = malloc(n * sizeof *x), *s0 = malloc((size_t)rows * sizeof *s0),
              *s1 = malloc((size_t)rows * sizeof *s1);
        int8_t *q0 = malloc(n), *q1 = malloc(n);
        cr_assert(x && s0 && s1 && q0 && q1);
        for (size_t i = 0; i < n; i++)
            x[i] = rnd_float() * (float)(1 + i % 17);
        memset(x, 0, (size_t)cols * sizeof *x);   /* an all-zero row: scale 0 */
        pd_quant_rows(x, rows, cols, q0, s0);
        for (int p = 0; p < 3; p++) {
            memset(q1, 0x55, n);
            memset(s1, 0x55, (size_t)rows * sizeof *s1);
            pd_quant_rows_pool(pools[p], x, rows, cols, q1, s1);
            cr_assert(memcmp(q0, q1, n) == 0, "rows %d cols %d, %d threads: bytes differ", rows, cols,
                      pd_pool_nthreads(pools[p]));
            cr_assert(memcmp(s0, s1, (size_t)rows * sizeof *s0) == 0, "rows %d cols %d, %d threads: "
                      "scales differ", rows, cols, pd_pool_nthreads(pools[p]));
        }
        free(x);
        free(s0);
        free(s1);
        free(q0);
        free(q1);
    }
    pd_quant_rows_pool(pools[1], NULL, 0, 10, NULL, NULL);   /* no rows: nothing read or written */
    pd_pool_destroy(pools[1]);
    pd_pool_destroy(pools[2]);
}

/* pd_dot_gemm gives, for every (w row, x row) pair, the bits pd_dot gives that pair: lengths of
 * 1 to 3 and more 32-value chunks with and without a lone 16-value block (the even/odd chains),
 * lengths off the 16-value grid (the pd_dot_rows fallback), row and token counts around the 4 x 4
 * tile, the ~24 KiB row block and the ~256 KiB one of long rows, leading dimensions larger than
 * the length, and values whose sum depends on the order of the additions (large and small
 * magnitudes of both signs); the same for pd_dot_gemm_bf16 against pd_dot of the widened row;
 * likewise pd_axpy_heads against pd_axpy_rows. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/dot_gemm.h"
#include "kernels/ops.h"
#include "kernels/vec.h"

static float value(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    float v = (float)(*s >> 40) / (float)(1 << 24) - 0.5f;
    /* one value in 8 is large: the lane order then decides which low bits survive */
    return (*s >> 20) % 8 == 0 ? v * 4096.0f : v;
}

/* Every shape above through pd_dot_gemm (bf16 = 0) or pd_dot_gemm_bf16 (bf16 = 1, the weights
 * rounded to bf16 first and pd_dot taken over their fp32 widening). */
static void same_bits(int bf16)
{
    static const int ns[] = {16, 32, 48, 64, 80, 128, 144, 512, 1024, 1040, 1, 15, 33, 100};
    static const int rows_of[] = {1, 3, 4, 5, 8, 13, 17, 49, 131};
    /* from 32 tokens, bf16 rows of up to 1,536 values are widened once per block (dot_gemm.c) */
    static const int T_of[] = {1, 2, 3, 4, 5, 7, 9, 16, 33, 48};
    uint64_t s = 11;
    for (size_t a = 0; a < sizeof ns / sizeof *ns; a++) {
        const int n = ns[a];
        const size_t ldw = (size_t)n + 3, ldx = (size_t)n + 5;
        for (size_t ri = 0; ri < sizeof rows_of / sizeof *rows_of; ri++)
            for (size_t ti = 0; ti < sizeof T_of / sizeof *T_of; ti++) {
                const int rows = rows_of[ri], T = T_of[ti];
                const size_t ldy = (size_t)rows + 2;
                float *w = malloc((size_t)rows * ldw * 4), *x = malloc((size_t)T * ldx * 4);
                float *y = malloc((size_t)T * ldy * 4);
                uint16_t *h = malloc((size_t)rows * ldw * 2);
                for (size_t i = 0; i < (size_t)rows * ldw; i++) {
                    w[i] = value(&s);
                    if (bf16) {
                        h[i] = pd_f32_to_bf16(w[i]);
                        w[i] = pd_bf16_to_f32(h[i]);
                    }
                }
                for (size_t i = 0; i < (size_t)T * ldx; i++)
                    x[i] = value(&s);
                memset(y, 0x7f, (size_t)T * ldy * 4);
                if (bf16)
                    pd_dot_gemm_bf16(h, ldw, rows, x, ldx, T, n, y, ldy);
                else
                    pd_dot_gemm(w, ldw, rows, x, ldx, T, n, y, ldy);
                for (int t = 0; t < T; t++) {
                    for (int r = 0; r < rows; r++) {
                        float d = pd_dot(w + (size_t)r * ldw, x + (size_t)t * ldx, n);
                        cr_assert(memcmp(&d, &y[(size_t)t * ldy + r], 4) == 0,
                                  "bf16 %d, n %d, %d rows x %d tokens: [%d][%d] %a vs pd_dot %a", bf16, n, rows, T,
                                  t, r, y[(size_t)t * ldy + r], d);
                    }
                    /* the gap between rows of y is left alone */
                    uint32_t gap;
                    memcpy(&gap, &y[(size_t)t * ldy + rows], 4);
                    cr_assert_eq(gap, 0x7f7f7f7fu, "bf16 %d, n %d, %d rows x %d tokens: wrote past row %d", bf16, n,
                                 rows, T, t);
                }
                free(w), free(x), free(y), free(h);
            }
    }
}

Test(dot_gemm, same_bits_as_dot)
{
    same_bits(0);
}

Test(dot_gemm, bf16_same_bits_as_dot_of_the_widened_row)
{
    same_bits(1);
}

/* pd_axpy_heads gives each row of y the bits pd_axpy_rows gives it: lengths on and off the
 * 64-value tile and the 16-value grid, head counts around the 4-row tile, 0 to 37 rows of x,
 * leading dimensions larger than the length, y starting non-zero. */
Test(dot_gemm, axpy_heads_same_bits_as_axpy_rows)
{
    static const int ns[] = {16, 64, 80, 128, 192, 33, 7};
    static const int heads[] = {1, 3, 4, 5, 8, 9};
    static const int rows_of[] = {0, 1, 5, 37};
    uint64_t s = 5;
    for (size_t a = 0; a < sizeof ns / sizeof *ns; a++)
        for (size_t hi = 0; hi < sizeof heads / sizeof *heads; hi++)
            for (size_t ri = 0; ri < sizeof rows_of / sizeof *rows_of; ri++) {
                const int n = ns[a], na = heads[hi], rows = rows_of[ri];
                const size_t ldx = (size_t)n + 3, lda = (size_t)rows + 2, ldy = (size_t)n + 1;
                float *x = malloc(((size_t)rows * ldx + 1) * 4), *w = malloc(((size_t)na * lda + 1) * 4);
                float *y = malloc((size_t)na * ldy * 4), *ref = malloc((size_t)na * ldy * 4);
                for (size_t i = 0; i < (size_t)rows * ldx; i++)
                    x[i] = value(&s);
                for (size_t i = 0; i < (size_t)na * lda; i++)
                    w[i] = value(&s) / 64;
                for (size_t i = 0; i < (size_t)na * ldy; i++)
                    y[i] = ref[i] = value(&s);
                pd_axpy_heads(w, lda, na, x, ldx, rows, y, ldy, n);
                for (int h = 0; h < na; h++)
                    pd_axpy_rows(w + (size_t)h * lda, x, ldx, rows, ref + (size_t)h * ldy, n);
                /* the gaps between rows of y too: untouched in both */
                for (size_t i = 0; i < (size_t)na * ldy; i++)
                    cr_assert(memcmp(&y[i], &ref[i], 4) == 0, "n %d, %d heads, %d rows: y[%zu] %a vs pd_axpy_rows %a", n,
                              na, rows, i, y[i], ref[i]);
                free(x), free(w), free(y), free(ref);
            }
}

/* The AVX-512 pd_dot sums its 16 lanes as a tree (lane k plus k + 8, then k plus k + 4, k plus
 * k + 2, 0 plus 1), which pd_dot_gemm's tiles repeat for 16 products at once: on 16 values whose
 * sum depends on the order (the same values summed one after another give another float). */
Test(dot_gemm, avx512_dot_sums_its_lanes_as_a_tree)
{
    if (!__builtin_cpu_supports("avx512f"))
        cr_skip_test("no AVX-512 on this CPU: pd_dot is the AVX2 or portable version");
    /* tree: 2^24 - 2^24 and seven 2s, 14; one after another the first seven 1s vanish into 2^24, 7 */
    const float v[16] = {16777216.0f, 1, 1, 1, 1, 1, 1, 1, -16777216.0f, 1, 1, 1, 1, 1, 1, 1};
    const float ones[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    float a[8], b[4], c[2], seq = 0;
    for (int k = 0; k < 8; k++)
        a[k] = v[k] + v[k + 8];
    for (int k = 0; k < 4; k++)
        b[k] = a[k] + a[k + 4];
    for (int k = 0; k < 2; k++)
        c[k] = b[k] + b[k + 2];
    const float tree = c[0] + c[1];
    for (int k = 0; k < 16; k++)
        seq += v[k];
    cr_assert_neq(tree, seq, "the values must tell the two orders apart");
    cr_assert_eq(pd_dot(v, ones, 16), tree);
    float y[4];
    float x[4][16];
    for (int t = 0; t < 4; t++)
        memcpy(x[t], v, sizeof v);
    pd_dot_gemm(ones, 16, 1, &x[0][0], 16, 4, 16, y, 1);
    for (int t = 0; t < 4; t++)
        cr_assert_eq(y[t], tree);
}

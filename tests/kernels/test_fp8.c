/* fp8 e4m3 and its ue8m0 block scales (kernels/fp8.h): every code round-trips, ties go to the
 * even code, out-of-range values saturate at 448, NaN stays NaN, and the scale is the official
 * code's power of two on values checked by hand. */
#include <criterion/criterion.h>
#include <math.h>

#include "kernels/fp8.h"

static int is_nan_code(int c)
{
    return (c & 0x7F) == 0x7F;
}

Test(fp8, every_code_round_trips)
{
    for (int c = 0; c < 256; c++) {
        float v = pd_e4m3_decode((uint8_t)c);
        if (is_nan_code(c)) {
            cr_assert(isnan(v), "code 0x%02x", c);
            cr_assert_eq(pd_e4m3_encode(v) & 0x7F, 0x7F);
            continue;
        }
        cr_assert(isfinite(v));
        cr_assert_eq(pd_e4m3_encode(v), c, "code 0x%02x (%g) encodes to 0x%02x", c, v, pd_e4m3_encode(v));
        cr_assert_eq(signbit(v) != 0, (c & 0x80) != 0, "code 0x%02x keeps its sign", c);
    }
    /* the format's landmarks */
    cr_assert_eq(pd_e4m3_decode(0x7E), 448.0f);
    cr_assert_eq(pd_e4m3_decode(0x38), 1.0f);
    cr_assert_eq(pd_e4m3_decode(0xB8), -1.0f);
    cr_assert_eq(pd_e4m3_decode(0x08), 0x1p-6f);      /* smallest normal */
    cr_assert_eq(pd_e4m3_decode(0x07), 7 * 0x1p-9f);  /* largest subnormal */
    cr_assert_eq(pd_e4m3_decode(0x01), 0x1p-9f);      /* smallest subnormal */
    cr_assert_eq(pd_e4m3_decode(0x3B), 1.375f);
}

Test(fp8, ties_round_to_the_even_code)
{
    for (int c = 0; c < 0x7E; c++) {
        float a = pd_e4m3_decode((uint8_t)c), b = pd_e4m3_decode((uint8_t)(c + 1));
        float mid = (a + b) / 2;   /* exact in fp32 */
        int even = c % 2 == 0 ? c : c + 1;
        cr_assert_eq(pd_e4m3_encode(mid), even, "midpoint of 0x%02x and 0x%02x", c, c + 1);
        cr_assert_eq(pd_e4m3_encode(-mid), 0x80 | even);
        cr_assert_eq(pd_e4m3_encode(nextafterf(mid, 0)), c);
        cr_assert_eq(pd_e4m3_encode(nextafterf(mid, INFINITY)), c + 1);
    }
    /* by hand: 1.0625 lies between 1.0 (0x38) and 1.125 (0x39): to 0x38; 1.1875 between 1.125
     * and 1.25 (0x3A): to 0x3A; 2^-10 between 0 and 2^-9: to 0 */
    cr_assert_eq(pd_e4m3_encode(1.0625f), 0x38);
    cr_assert_eq(pd_e4m3_encode(1.1875f), 0x3A);
    cr_assert_eq(pd_e4m3_encode(0x1p-10f), 0x00);
    cr_assert_eq(pd_e4m3_encode(3 * 0x1p-10f), 0x02);
}

Test(fp8, saturates_at_448_and_keeps_nan)
{
    cr_assert_eq(pd_e4m3_encode(448.0f), 0x7E);
    cr_assert_eq(pd_e4m3_encode(463.9f), 0x7E);
    cr_assert_eq(pd_e4m3_encode(464.0f), 0x7E);  /* the tie with the NaN code does not reach it */
    cr_assert_eq(pd_e4m3_encode(1e9f), 0x7E);
    cr_assert_eq(pd_e4m3_encode(INFINITY), 0x7E);
    cr_assert_eq(pd_e4m3_encode(-1e9f), 0xFE);
    cr_assert_eq(pd_e4m3_encode(-INFINITY), 0xFE);
    cr_assert_eq(pd_e4m3_encode(NAN), 0x7F);
    cr_assert_eq(pd_e4m3_encode(-NAN), 0xFF);
    cr_assert(isnan(pd_e4m3_decode(0x7F)) && isnan(pd_e4m3_decode(0xFF)));
}

Test(fp8, scale_is_the_power_of_two_above_amax_over_448)
{
    /* byte = 127 + ceil(log2(amax / 448)) */
    cr_assert_eq(pd_ue8m0_scale(448.0f, 448.0f, 1e-4f), 127);   /* exactly 1: scale 1 */
    cr_assert_eq(pd_ue8m0_scale(449.0f, 448.0f, 1e-4f), 128);   /* just above: 2 */
    cr_assert_eq(pd_ue8m0_scale(224.0f, 448.0f, 1e-4f), 126);   /* 1/2 */
    cr_assert_eq(pd_ue8m0_scale(3.5f, 448.0f, 1e-4f), 120);     /* 3.5/448 = 2^-7 */
    cr_assert_eq(pd_ue8m0_scale(3.6f, 448.0f, 1e-4f), 121);     /* 2^-6.96: 2^-6 */
    cr_assert_eq(pd_ue8m0_scale(1.0f, 448.0f, 1e-4f), 119);     /* 2^-8.81: 2^-8 */
    cr_assert_eq(pd_ue8m0_scale(0.0f, 448.0f, 1e-4f), 105);     /* floor 1e-4: 2^-22.1: 2^-22 */
    cr_assert_eq(pd_ue8m0_scale(6.0f, 6.0f, 6 * 0x1p-126f), 127); /* fp4's max: 1 */
    cr_assert_eq(pd_ue8m0_value(127), 1.0f);
    cr_assert_eq(pd_ue8m0_value(120), 0x1p-7f);
}

Test(fp8, blocks_quantize_and_dequantize)
{
    /* two blocks of 4: the first's amax 3.5 gives 2^-7, so 3.5 -> 448 exactly; the second's 1.0
     * gives 2^-8, 1.0 -> 256; 0.3 / 2^-8 = 76.8 -> 80 (codes 72, 80: step 8), back 0.3125 */
    float x[8] = {3.5f, -1.75f, 0.0f, 0.1f, 1.0f, 0.3f, -0.5f, 0.0f}, y[8];
    uint8_t q[8], s[2];
    pd_fp8_quant_blocks(x, 8, 4, q, s);
    cr_assert_eq(s[0], 120);
    cr_assert_eq(s[1], 119);
    cr_assert_eq(q[0], 0x7E);
    cr_assert_eq(pd_e4m3_decode(q[5]), 80.0f);
    pd_fp8_dequant_blocks(q, s, 8, 4, y);
    cr_assert_eq(y[0], 3.5f);
    cr_assert_eq(y[1], -1.75f);
    cr_assert_eq(y[4], 1.0f);
    cr_assert_eq(y[5], 0.3125f);
    cr_assert_eq(y[6], -0.5f);
    /* 0.1 / 2^-7 = 12.8 -> 13 (codes 12, 13: step 1 in [8, 16)), back 13 / 128 */
    cr_assert_eq(y[3], 13.0f / 128);
}

/* The decoders of the release's weight formats, every code of each checked against a value the
 * test computes on its own from the format's definition (sign, exponent field, mantissa field,
 * bias), in double, without the library's tables or bit tricks:
 *   e4m3fn (F8_E4M3): bias 7, 4 exponent and 3 mantissa bits, subnormals at exponent 0, no
 *     infinities, S.1111.111 the only NaN (so 0x7F and 0xFF), largest finite 448;
 *   e2m1 (FP4, two per byte): bias 1, 2 exponent and 1 mantissa bits, subnormal 0.5 at exponent
 *     0, no NaN or infinity, largest 6;
 *   ue8m0 (F8_E8M0 scales): unsigned, 8 exponent bits, bias 127, no mantissa, 0xFF NaN. */
#include <criterion/criterion.h>
#include <math.h>

#include "kernels/fp4.h"
#include "kernels/fp8.h"

/* A minifloat of `ebits` exponent and `mbits` mantissa bits with bias `bias`, from its fields. */
static double minifloat(int sign, int ef, int mf, int mbits, int bias)
{
    double frac = (double)mf / (double)(1 << mbits);
    double v = ef == 0 ? frac * pow(2.0, 1 - bias) : (1.0 + frac) * pow(2.0, ef - bias);
    return sign ? -v : v;
}

Test(decoders, e4m3fn_all_256_codes)
{
    int nans = 0;
    double maxv = 0;
    for (int c = 0; c < 256; c++) {
        int sign = c >> 7, ef = (c >> 3) & 15, mf = c & 7;
        float got = pd_e4m3_decode((uint8_t)c);
        if (ef == 15 && mf == 7) {
            cr_assert(isnan(got), "code 0x%02x is NaN in e4m3fn, decoded %g", c, got);
            nans++;
            continue;
        }
        double want = minifloat(sign, ef, mf, 3, 7);
        cr_assert_eq((double)got, want, "code 0x%02x: decoded %.9g, the format says %.9g", c, got, want);
        cr_assert_eq(signbit(got) != 0, sign, "code 0x%02x keeps its sign (zero included)", c);
        maxv = fabs(want) > maxv ? fabs(want) : maxv;
    }
    cr_assert_eq(nans, 2, "e4m3fn has exactly two NaN codes");
    cr_assert_eq(maxv, 448.0, "no infinities: 0x7E = 448 is the largest value");
}

Test(decoders, e2m1_all_16_codes)
{
    for (int c = 0; c < 16; c++) {
        int sign = c >> 3, ef = (c >> 1) & 3, mf = c & 1;
        double want = minifloat(sign, ef, mf, 1, 1);
        float got = pd_e2m1_decode((uint8_t)c);
        cr_assert_eq((double)got, want, "code %d: decoded %g, the format says %g", c, got, want);
        cr_assert(isfinite(got));
    }
    cr_assert_eq(pd_e2m1_decode(7), 6.0f);
    cr_assert_eq(pd_e2m1_decode(15), -6.0f);
}

Test(decoders, ue8m0_every_exponent)
{
    for (int b = 0; b < 255; b++) {
        double want = 1.0;
        /* 2^(b - 127) by repeated doubling or halving: exact in double over this range */
        for (int k = 0; k < b - 127; k++)
            want *= 2;
        for (int k = 0; k < 127 - b; k++)
            want /= 2;
        float got = pd_ue8m0_value((uint8_t)b);
        cr_assert_eq((double)got, want, "byte %d: decoded %a, 2^%d is %a", b, got, b - 127, want);
    }
    cr_assert(isnan(pd_ue8m0_value(255)), "byte 255 is e8m0's NaN");
}

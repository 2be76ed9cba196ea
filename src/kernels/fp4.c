/* e2m1 rounding, the FP4 simulation of the indexer and the Hadamard rotation (fp4.h). */
#include "kernels/fp4.h"
#include "kernels/fp8.h"

#include <assert.h>
#include <math.h>

/* The 8 magnitudes of e2m1 (1 sign, 2 exponent, 1 mantissa bits; bias 1; code 1 the subnormal
 * 0.5), by code. */
static const float e2m1_mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

float pd_e2m1_decode(uint8_t c)
{
    float v = e2m1_mag[c & 7];
    return c & 8 ? -v : v;
}

uint8_t pd_e2m1_encode(float x)
{
    /* midpoints between consecutive magnitudes: above mid[c] the value rounds past code c */
    static const float mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    uint8_t sign = signbit(x) ? 8 : 0;
    float a = fabsf(x);
    if (isnan(x))
        return 0;
    if (a >= PD_E2M1_MAX)
        return sign | 7;
    int c = 0;
    while (c < 7 && a > mid[c])
        c++;
    /* exactly at a midpoint: the even code of the two (codes ascend with magnitude and
     * adjacent codes differ in parity) */
    if (c < 7 && a == mid[c] && c % 2)
        c++;
    return sign | (uint8_t)c;
}

/* pd_e2m1_decode(pd_e2m1_encode(v)) without branches (the indexer rounds every query and key
 * value through it: 7% of a prefill step as a loop of compares): the code is the number of
 * midpoints below |v| (they ascend), plus one at the three midpoints whose lower code is odd
 * (ties to the even code); beyond 6 every comparison holds (code 7); NaN holds none and gives +0,
 * as the encoder's code 0 does. */
static inline float e2m1_round(float v)
{
    const float a = fabsf(v);
    const int c = (a > 0.25f) + (a > 0.75f) + (a > 1.25f) + (a > 1.75f) + (a > 2.5f) + (a > 3.5f) + (a > 5.0f) +
                  ((a == 0.75f) | (a == 1.75f) | (a == 3.5f));
    return v != v ? 0.0f : copysignf(e2m1_mag[c], v);
}

void pd_fp4_simulate(float *x, int n, int block)
{
    for (int k = 0; k < n; k += block) {
        int len = n - k < block ? n - k : block;
        float amax = 0;
        for (int i = 0; i < len; i++)
            amax = fabsf(x[k + i]) > amax ? fabsf(x[k + i]) : amax;
        float s = pd_ue8m0_value(pd_ue8m0_scale(amax, PD_E2M1_MAX, PD_E2M1_MAX * 0x1p-126f));
        for (int i = 0; i < len; i++)
            x[k + i] = e2m1_round(x[k + i] / s) * s;
    }
}

void pd_hadamard(float *x, int n)
{
    assert(n > 0 && (n & (n - 1)) == 0);
    for (int h = 1; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    float s = 1.0f / sqrtf((float)n);
    for (int i = 0; i < n; i++)
        x[i] *= s;
}

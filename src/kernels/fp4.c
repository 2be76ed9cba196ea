/* e2m1 rounding, the FP4 simulation of the indexer and the Hadamard rotation (fp4.h). */
#include "kernels/fp4.h"
#include "kernels/fp8.h"

#include <assert.h>
#include <math.h>

float pd_e2m1_decode(uint8_t c)
{
    int e = c >> 1 & 3, m = c & 1;
    float v = e == 0 ? 0.5f * m : ldexpf(1.0f + 0.5f * m, e - 1);
    return c & 8 ? -v : v;
}

uint8_t pd_e2m1_encode(float x)
{
    uint8_t sign = signbit(x) ? 8 : 0;
    float a = fabsf(x);
    if (isnan(x))
        return 0;
    if (a >= PD_E2M1_MAX)
        return sign | 7;
    /* the nearest of the 8 magnitudes; on a tie the even code (the lower one when they tie at
     * a midpoint, since codes ascend with magnitude and adjacent codes differ in parity) */
    int best = 0;
    for (int c = 1; c < 8; c++) {
        float d = fabsf(pd_e2m1_decode((uint8_t)c) - a), db = fabsf(pd_e2m1_decode((uint8_t)best) - a);
        if (d < db || (d == db && c % 2 == 0))
            best = c;
    }
    return sign | (uint8_t)best;
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
            x[k + i] = pd_e2m1_decode(pd_e2m1_encode(x[k + i] / s)) * s;
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

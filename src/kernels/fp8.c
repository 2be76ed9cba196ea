/* fp8 e4m3 encode/decode and ue8m0 block scales, portable C (see fp8.h for the semantics and
 * where they come from). */
#include "kernels/fp8.h"

#include <math.h>
#include <string.h>

static float f32_of(uint32_t b)
{
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

uint8_t pd_e4m3_encode(float x)
{
    uint32_t u = f32_bits(x);
    uint8_t sign = (uint8_t)(u >> 24 & 0x80);
    float a = fabsf(x);
    if (isnan(x))
        return sign | 0x7F;
    if (a >= PD_E4M3_MAX)
        return sign | 0x7E;
    if (a < 0x1p-6f) {
        /* subnormal (or zero): a multiple of 2^-9; nearbyintf rounds half to even, and 8 * 2^-9
         * is the smallest normal 0x08, which is what the code 8 means */
        return sign | (uint8_t)nearbyintf(a * 0x1p9f);
    }
    uint32_t b = f32_bits(a);
    int e = (int)(b >> 23) - 127;                 /* -6 .. 8 */
    uint32_t m = b & 0x7FFFFF;
    /* keep 3 of 23 mantissa bits, rounding half to even */
    uint32_t keep = m >> 20, rest = m & 0xFFFFF;
    if (rest > 0x80000 || (rest == 0x80000 && (keep & 1)))
        keep++;
    if (keep == 8) {
        keep = 0;
        e++;
    }
    uint32_t c = (uint32_t)(e + 7) << 3 | keep;
    /* a < 448 rounds at most to 448 = 0x7E */
    return sign | (uint8_t)c;
}

float pd_e4m3_decode(uint8_t c)
{
    int e = c >> 3 & 15, m = c & 7;
    float v;
    if (e == 15 && m == 7)
        v = NAN;
    else if (e == 0)
        v = (float)m * 0x1p-9f;
    else   /* the same exponent and 3 mantissa bits, as fp32 (bias 7 -> 127): no ldexpf per value */
        v = f32_of((uint32_t)(e + 120) << 23 | (uint32_t)m << 20);
    return c & 0x80 ? -v : v;
}

uint8_t pd_ue8m0_scale(float amax, float fmax, float floor)
{
    if (!(amax > floor))
        amax = floor;
    /* the official kernel multiplies by the fp32 reciprocal, then takes the ceiling of log2
     * from the bits (the product is a normal number for the floors used) */
    float r = amax * (1.0f / fmax);
    uint32_t b = f32_bits(r);
    int e = (int)(b >> 23 & 0xFF) - 127 + ((b & 0x7FFFFF) != 0);
    if (e < -127)
        e = -127;
    if (e > 127)
        e = 127;
    return (uint8_t)(e + 127);
}

float pd_ue8m0_value(uint8_t b)
{
    /* e8m0 (torch's float8_e8m0fnu, safetensors F8_E8M0) has no sign, no mantissa and no
     * zero: 0xFF is its NaN, every other byte the power 2^(b - 127), 2^-127 being subnormal in
     * fp32 and still exact */
    if (b == 0xFF)
        return NAN;
    return ldexpf(1.0f, (int)b - 127);
}

void pd_fp8_quant_blocks(const float *x, int n, int block, uint8_t *q, uint8_t *scales)
{
    for (int k = 0, j = 0; k < n; k += block, j++) {
        int len = n - k < block ? n - k : block;
        float amax = 0;
        for (int i = 0; i < len; i++)
            amax = fabsf(x[k + i]) > amax ? fabsf(x[k + i]) : amax;
        scales[j] = pd_ue8m0_scale(amax, PD_E4M3_MAX, 1e-4f);
        float inv = 1.0f / pd_ue8m0_value(scales[j]);   /* exact: a power of two */
        for (int i = 0; i < len; i++)
            q[k + i] = pd_e4m3_encode(x[k + i] * inv);
    }
}

void pd_fp8_dequant_blocks(const uint8_t *q, const uint8_t *scales, int n, int block, float *y)
{
    for (int k = 0, j = 0; k < n; k += block, j++) {
        int len = n - k < block ? n - k : block;
        float s = pd_ue8m0_value(scales[j]);
        for (int i = 0; i < len; i++)
            y[k + i] = pd_e4m3_decode(q[k + i]) * s;
    }
}

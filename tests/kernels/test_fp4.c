/* The indexer's low precision (kernels/fp4.h): e2m1 codes and their rounding, the FP4 block
 * simulation and the Hadamard rotation, on values computed by hand; the simulation's rounding
 * against the encoder and decoder. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/fp4.h"
#include "kernels/fp8.h"
#include "kernels/ops.h"

Test(fp4, e2m1_codes_and_rounding)
{
    const float mag[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
    for (int c = 0; c < 16; c++) {
        float v = pd_e2m1_decode((uint8_t)c);
        cr_assert_eq(fabsf(v), mag[c & 7], "code %d", c);
        cr_assert_eq(pd_e2m1_encode(v), c == 8 ? 8 : c, "code %d round-trips", c);
    }
    /* midpoints go to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
     * 3.5 -> 4, 5 -> 4; off the midpoints to the nearest; beyond 6 saturates */
    const float in[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 0.3f, 2.6f, 5.1f, 7.0f, 1e9f, -2.5f, -5.5f};
    const float out[] = {0, 1, 1, 2, 2, 4, 4, 0.5f, 3, 6, 6, 6, -2, -6};
    for (size_t i = 0; i < sizeof in / sizeof in[0]; i++)
        cr_assert_eq(pd_e2m1_decode(pd_e2m1_encode(in[i])), out[i], "%g -> %g", in[i], pd_e2m1_decode(pd_e2m1_encode(in[i])));
}

Test(fp4, block_simulation)
{
    /* a block of 32 with amax 3: scale 2^ceil(log2(3/6)) = 1/2; x/s = 6, 2.4, 2.5, 3.5, 0.2:
     * rounded 6, 2, 2, 4, 0; back 3, 1, 1, 2, 0 */
    float x[64] = {3.0f, 1.2f, 1.25f, 1.75f, 0.1f};
    /* a second block whose amax 0.7 gives 2^ceil(log2(0.1167)) = 1/8: 0.7 -> 5.6 -> 6 -> 0.75,
     * 0.3 -> 2.4 -> 2 -> 0.25 */
    x[32] = 0.7f;
    x[33] = -0.3f;
    pd_fp4_simulate(x, 64, 32);
    const float want[5] = {3, 1, 1, 2, 0};
    for (int i = 0; i < 5; i++)
        cr_assert_eq(x[i], want[i], "value %d: %g", i, x[i]);
    cr_assert_eq(x[32], 0.75f);
    cr_assert_eq(x[33], -0.25f);
    cr_assert_eq(x[63], 0.0f);
}

/* pd_fp4_simulate rounds each value as pd_e2m1_decode(pd_e2m1_encode(x / s)) * s, bit for bit:
 * every midpoint and its float neighbours, the magnitudes, zeros of both signs, beyond the
 * largest, infinities, NaN and a sweep of float bit patterns from 2^-8 to 2^4, both signs; one
 * block of 1 value, so the scale is that value's own and its neighbours' differ. */
Test(fp4, simulate_same_bits_as_encode_decode)
{
    static const float mids[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f,
                                 4.0f, 6.0f, 0.0f, 7.0f, 1e30f};
    float v[4096];
    int n = 0;
    for (size_t i = 0; i < sizeof mids / sizeof *mids; i++)
        for (int sg = 0; sg < 2; sg++) {
            float m = sg ? -mids[i] : mids[i];
            v[n++] = m;
            v[n++] = nextafterf(m, INFINITY);
            v[n++] = nextafterf(m, -INFINITY);
        }
    v[n++] = INFINITY;
    v[n++] = -INFINITY;
    v[n++] = NAN;
    v[n++] = -NAN;
    for (uint32_t b = 0x3b800000u; b < 0x41800000u && n < 4094; b += 0x2a0b1u) {
        float f;
        memcpy(&f, &b, 4);
        v[n++] = f;
        v[n++] = -f;
    }
    /* blocks of 32 too: values scaled together */
    for (int block = 1; block <= 32; block += 31) {
        float x[4096], ref[4096];
        memcpy(x, v, (size_t)n * 4);
        for (int k = 0; k < n; k += block) {
            int len = n - k < block ? n - k : block;
            float amax = 0;
            for (int i = 0; i < len; i++)
                amax = fabsf(v[k + i]) > amax ? fabsf(v[k + i]) : amax;
            float s = pd_ue8m0_value(pd_ue8m0_scale(amax, PD_E2M1_MAX, PD_E2M1_MAX * 0x1p-126f));
            for (int i = 0; i < len; i++)
                ref[k + i] = pd_e2m1_decode(pd_e2m1_encode(v[k + i] / s)) * s;
        }
        pd_fp4_simulate(x, n, block);
        for (int i = 0; i < n; i++)
            cr_assert(memcmp(&x[i], &ref[i], 4) == 0 || (x[i] != x[i] && ref[i] != ref[i]),
                      "block %d, value %d (%a): %a vs encode/decode %a", block, i, v[i], x[i], ref[i]);
    }
}

Test(fp4, hadamard_rotation)
{
    /* H4 (Sylvester) / 2: rows ++++, +-+-, ++--, +--+ */
    float x[4] = {1, 2, 3, 4};
    pd_hadamard(x, 4);
    cr_assert_float_eq(x[0], 5.0f, 1e-6);
    cr_assert_float_eq(x[1], -1.0f, 1e-6);
    cr_assert_float_eq(x[2], -2.0f, 1e-6);
    cr_assert_float_eq(x[3], 0.0f, 1e-6);
    /* a unit vector spreads evenly; twice is the identity (H/sqrt(n) is symmetric, orthogonal) */
    float e[128] = {0}, y[128];
    e[5] = 1;
    pd_hadamard(e, 128);
    for (int i = 0; i < 128; i++) {
        cr_assert_float_eq(fabsf(e[i]), 1 / sqrtf(128), 1e-7);
        y[i] = e[i];
    }
    cr_assert_float_eq(y[0], 1 / sqrtf(128), 1e-7);
    cr_assert_float_eq(y[1], -1 / sqrtf(128), 1e-7);   /* row 1 is +-+-...: column 5 is odd */
    pd_hadamard(y, 128);
    for (int i = 0; i < 128; i++)
        cr_assert_float_eq(y[i], i == 5 ? 1.0f : 0.0f, 1e-6);
}

/* The encoder (a table of midpoints) against the definition, nearest of the 8 magnitudes and the
 * even code on a tie, on every multiple of 2^-12 in [-8, 8] and every midpoint's neighbours. */
Test(fp4, e2m1_encode_is_the_nearest_magnitude)
{
    const float mag[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
    for (int k = -8 * 4096; k <= 8 * 4096; k++) {
        float x = (float)k / 4096.0f, a = fabsf(x);
        int best = 0;
        for (int c = 1; c < 8; c++) {
            float d = fabsf(mag[c] - a), db = fabsf(mag[best] - a);
            if (d < db || (d == db && c % 2 == 0))
                best = c;
        }
        int want = (signbit(x) ? 8 : 0) | best;
        cr_assert_eq(pd_e2m1_encode(x), want, "%.6f: code %d, want %d", x, pd_e2m1_encode(x), want);
    }
    const float mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    for (int i = 0; i < 7; i++) {
        float below = nextafterf(mid[i], 0), above = nextafterf(mid[i], 10);
        cr_assert_eq(pd_e2m1_decode(pd_e2m1_encode(below)), mag[i], "just below %g", mid[i]);
        cr_assert_eq(pd_e2m1_decode(pd_e2m1_encode(above)), mag[i + 1], "just above %g", mid[i]);
    }
}

/* pd_fp4_simulate (16 values at a time where the CPU has AVX-512) gives the portable loop's bits:
 * random values over many magnitudes, every midpoint and code of e2m1 at the block's scale (the
 * ties), +-0, NaN, +-inf and subnormals, blocks of 32 and of 7, 20 and 64 values with short last
 * blocks. */
Test(fp4, simulate_same_bits_as_the_portable_loop)
{
    enum { N = 997 };
    static float x[N], a[N], b[N];
    uint64_t s = 5;
    const float special[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 0.5f, 1.5f, 3.0f, 6.0f, 7.0f, 0.0f, -0.0f,
                             NAN, -NAN, INFINITY, -INFINITY, 1e-40f, -1e-45f};
    for (int i = 0; i < N; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        float v = ((float)(s >> 40) / (float)(1 << 24) - 0.5f) * ldexpf(1.0f, (int)(s >> 20 & 31) - 16);
        /* one value in four is a special one, times the power of two the first value of its
         * 32-block sets (6 x that scale), so the ties land exactly */
        x[i] = i % 4 == 1 ? special[(s >> 8) % (sizeof special / sizeof *special)] : v;
    }
    for (int i = 0; i < N; i += 32)
        x[i] = 6.0f;   /* the block's scale 1: the specials are the codes and midpoints themselves */
    const int blocks[] = {32, 7, 20, 64};
    for (size_t k = 0; k < sizeof blocks / sizeof *blocks; k++)
        for (int n = 1; n <= N; n += n < 40 ? 1 : 97) {
            memcpy(a, x, sizeof x);
            memcpy(b, x, sizeof x);
            pd_fp4_simulate(a, n, blocks[k]);
            pd_fp4_simulate_ref(b, n, blocks[k]);
            cr_assert(memcmp(a, b, sizeof a) == 0, "block %d, %d values", blocks[k], n);
        }
}

/* The indexer's rotation and its bf16 roundings a vector at a time (16 values with AVX-512, 8 with
 * AVX2 only) give the loops' bits: the Hadamard transform of 8 to 1,024 values against
 * pd_hadamard_ref, and pd_bf16_round against
 * pd_f32_to_bf16 on random bit patterns (every class: NaNs of both signs, infinities, subnormals,
 * exact ties, values that round up to infinity), 1 to 40 values (the tails). */
Test(fp4, hadamard_and_bf16_round_same_bits_as_the_loops)
{
    static float a[1024], b[1024];
    uint64_t s = 9;
    for (int n = 8; n <= 1024; n *= 2) {
        for (int i = 0; i < n; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            a[i] = b[i] = ((float)(s >> 40) / (float)(1 << 24) - 0.5f) * ldexpf(1.0f, (int)(s >> 20 & 15) - 4);
        }
        pd_hadamard(a, n);
        pd_hadamard_ref(b, n);
        cr_assert(memcmp(a, b, (size_t)n * 4) == 0, "hadamard of %d values", n);
    }
    static const uint32_t special[] = {0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7f800000u, 0xff800000u, 0x00000001u,
                                       0x80008000u, 0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0xff7fffffu, 0x00000000u,
                                       0x80000000u};
    for (int n = 1; n <= 40; n++) {
        for (int i = 0; i < n; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            uint32_t u = i % 3 == 0 ? special[(s >> 33) % (sizeof special / sizeof *special)] : (uint32_t)(s >> 32);
            memcpy(&a[i], &u, 4);
            b[i] = pd_bf16_to_f32(pd_f32_to_bf16(a[i]));
        }
        pd_bf16_round(a, n);
        cr_assert(memcmp(a, b, (size_t)n * 4) == 0, "bf16 rounding of %d values", n);
    }
}

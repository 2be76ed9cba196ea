/* The small float operations: Sinkhorn gives a doubly stochastic matrix, rope and its inverse
 * cancel, YaRN keeps high frequencies and divides low ones by the factor, bf16 rounds to
 * nearest even. */
#include <criterion/criterion.h>
#include <math.h>

#include "engine/sampler.h"
#include "kernels/ops.h"

Test(ops, sinkhorn_doubly_stochastic)
{
    float m[16];
    for (int i = 0; i < 16; i++)
        m[i] = (float)((i * 7) % 5) - 2.0f;
    pd_sinkhorn(m, 4, 20, 1e-6f);
    for (int i = 0; i < 4; i++) {
        float r = 0, c = 0;
        for (int j = 0; j < 4; j++) {
            r += m[i * 4 + j];
            c += m[j * 4 + i];
            cr_assert_gt(m[i * 4 + j], 0);
        }
        cr_assert_float_eq(r, 1.0f, 1e-3);
        cr_assert_float_eq(c, 1.0f, 1e-5);
    }
}

Test(ops, rope_inverse_and_yarn)
{
    struct pd_rope r;
    pd_rope_init(&r, 64, 10000, 1, 0, 0, 0);
    float x[64], y[64];
    for (int i = 0; i < 64; i++)
        x[i] = y[i] = sinf((float)i);
    pd_rope_apply(&r, y, 1234, 0);
    pd_rope_apply(&r, y, 1234, 1);
    for (int i = 0; i < 64; i++)
        cr_assert_float_eq(x[i], y[i], 1e-4);
    cr_assert_float_eq(r.freq[0], 1.0f, 1e-7);
    cr_assert_float_eq(r.freq[1], powf(10000, -2.0f / 64), 1e-7);
    struct pd_rope yr;
    pd_rope_init(&yr, 64, 160000, 16, 65536, 32, 1);
    /* the fastest frequencies are kept, the slowest divided by the factor */
    cr_assert_float_eq(yr.freq[0], 1.0f, 1e-7);
    double slow = 1.0 / pow(160000, 62.0 / 64);
    cr_assert_float_eq(yr.freq[31], slow / 16, slow * 1e-4);
}

Test(ops, bf16_round_trip)
{
    cr_assert_eq(pd_f32_to_bf16(1.0f), 0x3f80);
    cr_assert_float_eq(pd_bf16_to_f32(0x3f80), 1.0f, 0);
    /* 1 + 2^-8 is halfway between two bf16 values: ties to even gives 1.0 */
    cr_assert_eq(pd_f32_to_bf16(1.00390625f), 0x3f80);
    cr_assert_eq(pd_f32_to_bf16(1.01171875f), 0x3f82);
    float x[4] = {0}, r;
    pd_rmsnorm((float[]){3, 4, 0, 0}, NULL, 0, 4, x);
    r = sqrtf(x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3]);
    cr_assert_float_eq(r, 2.0f, 1e-5);   /* unit RMS over 4 values */
}

Test(ops, sampler)
{
    float l[6] = {0.5f, 2.0f, 2.0f, -1.0f, 1.9f, 0};
    float scratch[12];
    struct pd_sampler g;
    pd_sampler_init(&g, 0, 1, 0);
    cr_assert_eq(pd_sample(&g, l, 6, scratch), 1);   /* ties go to the lower id */
    struct pd_sampler a, b;
    pd_sampler_init(&a, 1.0f, 1.0f, 42);
    pd_sampler_init(&b, 1.0f, 1.0f, 42);
    int seen[6] = {0};
    for (int i = 0; i < 200; i++) {
        int x = pd_sample(&a, l, 6, scratch);
        cr_assert_eq(x, pd_sample(&b, l, 6, scratch));
        seen[x]++;
    }
    cr_assert_gt(seen[4], 0);   /* temperature 1 samples more than the argmax */
    struct pd_sampler n;
    pd_sampler_init(&n, 1.0f, 0.01f, 3);
    for (int i = 0; i < 50; i++) {
        int x = pd_sample(&n, l, 6, scratch);
        cr_assert(x == 1 || x == 2, "top-p 0.01 keeps only the most likely token, got %d", x);
    }
}

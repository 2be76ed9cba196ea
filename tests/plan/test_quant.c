/* Exact bytes of each weight format, scales included. */
#include <criterion/criterion.h>
#include <string.h>

#include "plan/quant.h"

Test(quant, bytes_per_format)
{
    struct pd_quant q;
    pd_err e = {0};
    cr_assert_eq(pd_quant_init(&q, "w8a8", NULL, 1, &e), 0, "%s", e.msg);
    int64_t gate[2] = {2048, 4096};
    /* int8 values + one fp32 scale per output row */
    cr_assert_eq(pd_fmt_bytes(PD_FMT_W8A8, 2, gate, &q), 2048 * 4096 + 4 * 2048);
    /* e4m3 + one ue8m0 byte per 128x128 block: the released wq_b [32768, 1024] has scale [256, 8] */
    int64_t wq_b[2] = {32768, 1024};
    cr_assert_eq(pd_fmt_bytes(PD_FMT_FP8, 2, wq_b, &q), 32768 * 1024 + 256 * 8);
    /* e2m1 packed two per byte + one ue8m0 per 32: the released expert w2 [4096, 2048] is
     * I8 [4096, 1024] + F8_E8M0 [4096, 64] */
    int64_t w2[2] = {4096, 2048};
    cr_assert_eq(pd_fmt_bytes(PD_FMT_FP4, 2, w2, &q), 4096 * 1024 + 4096 * 64);
    cr_assert_eq(pd_fmt_bytes(PD_FMT_BF16, 2, w2, &q), 2 * 4096 * 2048);
    int64_t v[1] = {4096};
    cr_assert_eq(pd_fmt_bytes(PD_FMT_F32, 1, v, &q), 4 * 4096);
    /* odd shapes round blocks up */
    int64_t odd[2] = {129, 257};
    cr_assert_eq(pd_fmt_bytes(PD_FMT_FP8, 2, odd, &q), 129 * 257 + 2 * 3);
    cr_assert_eq(pd_fmt_bytes(PD_FMT_FP4, 2, odd, &q), 129 * 129 + 129 * 9);
    /* int4 packed two per byte + one fp32 scale per output row (msModelSlim W4A8 per channel) */
    cr_assert_eq(pd_fmt_bytes(PD_FMT_W4A8, 2, w2, &q), 4096 * 1024 + 4 * 4096);
    cr_assert_eq(pd_fmt_bytes(PD_FMT_W4A8, 2, odd, &q), 129 * 129 + 4 * 129);
    /* the scheme: routed experts w4a8, every other matrix w8a8 */
    char buf[64];
    cr_assert_eq(pd_quant_init(&q, "w4a8", NULL, 1, &e), 0, "%s", e.msg);
    cr_assert_eq(q.linear, PD_FMT_W8A8);
    cr_assert_eq(q.group_fmt[PD_G_ROUTED_EXPERTS], PD_FMT_W4A8);
    cr_assert_str_eq(pd_quant_describe(&q, buf, sizeof buf), "w8a8 (routed_experts=w4a8)");
    cr_assert_eq(pd_quant_init(&q, "w4a8", "routed_experts=w8a8", 1, &e), 0, "%s", e.msg);
    cr_assert_eq(q.group_fmt[PD_G_ROUTED_EXPERTS], PD_FMT_W8A8);
    /* fp32 block scales when the checkpoint does not use ue8m0 */
    cr_assert_eq(pd_quant_init(&q, "fp8", NULL, 0, &e), 0);
    cr_assert_eq(pd_fmt_bytes(PD_FMT_FP8, 2, wq_b, &q), 32768 * 1024 + 4 * 256 * 8);
}

Test(quant, overrides_and_errors)
{
    struct pd_quant q;
    pd_err e = {0};
    char buf[128];
    cr_assert_eq(pd_quant_init(&q, "fp8", "routed_experts=fp4,embedding=w8a8", 1, &e), 0, "%s", e.msg);
    cr_assert_eq(q.group_fmt[PD_G_ROUTED_EXPERTS], PD_FMT_FP4);
    cr_assert_eq(q.group_fmt[PD_G_EMBEDDING], PD_FMT_W8A8);
    cr_assert_eq(q.group_fmt[PD_G_ATTENTION], PD_FMT_NONE);
    cr_assert_str_eq(pd_quant_describe(&q, buf, sizeof buf), "fp8 (embedding=w8a8, routed_experts=fp4)");
    cr_assert_neq(pd_quant_init(&q, "int3", NULL, 1, &e), 0);
    cr_assert(strstr(e.msg, "--quant int3: unknown scheme"), "%s", e.msg);
    cr_assert_neq(pd_quant_init(&q, "w8a8", "experts=fp4", 1, &e), 0);
    cr_assert(strstr(e.msg, "unknown group \"experts\""), "%s", e.msg);
    cr_assert_neq(pd_quant_init(&q, "w8a8", "routed_experts=fp5", 1, &e), 0);
    cr_assert(strstr(e.msg, "unknown format \"fp5\""), "%s", e.msg);
    cr_assert_neq(pd_quant_init(&q, "w8a8", "routed_experts", 1, &e), 0);
    cr_assert(strstr(e.msg, "expected GROUP=FORMAT"), "%s", e.msg);
}

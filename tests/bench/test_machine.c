/* The ceilings `pdmoe calibrate` records (bench/kernels.c, pd_bench_machine_measure): the GEMM's
 * efficiency is taken against the peak of the instructions the engine's kernel runs. On an AMX
 * host the tile kernel ran at 1.8x the VNNI peak, and calibrate refused its own measurement
 * ("field efficiency.gemm: 1.78 is out of range [0.001, 1]"), so `.ci/run` could not pass there.
 * The AVX2 kernel's is the VPMADDWD probe's, and there is no VNNI peak without VNNI. The fp32 FMA
 * peak is there wherever AVX2 + FMA or AVX-512 is. */
#include <criterion/criterion.h>
#include <string.h>

#include "bench/bench.h"
#include "kernels/gemm.h"

Test(bench_machine, gemm_efficiency_is_against_the_running_kernels_peak)
{
    struct pd_bench_machine m;
    cr_assert_eq(pd_bench_machine_measure(1, 1, &m), 0);
    /* a VNNI peak only where there is VNNI (an AVX2-only host had one made of its clock) */
    if (pd_gemm_kernel_supported(PD_KERNEL_AVX512))
        cr_assert_gt(m.vnni_peak, 0);
    else
        cr_assert_eq(m.vnni_peak, 0, "a VNNI peak of %g Gops/s without avx512_vnni", m.vnni_peak / 1e9);
    cr_assert_gt(m.gemm_ops, 0);
    pd_kernel k;
    pd_err e = {0};
    cr_assert_eq(pd_gemm_kernel_get(&k, &e), 0, "%s", e.msg);
    if (k == PD_KERNEL_AVX2) {
        /* the AVX2 kernel's products: vpmaddwd, not VPDPBUSD */
        cr_assert_gt(m.int8_peak, 0);
        cr_assert(m.int8_probe && strstr(m.int8_probe, "VPMADDWD"), "%s", m.int8_probe ? m.int8_probe : "(null)");
    } else if (k == PD_KERNEL_AMX) {
        cr_assert_gt(m.amx_peak, m.vnni_peak);
        cr_assert_eq(m.int8_peak, m.amx_peak);
        cr_assert(m.int8_probe && strstr(m.int8_probe, "TDPBSSD"), "%s", m.int8_probe ? m.int8_probe : "(null)");
    } else {
        cr_assert_eq(m.int8_peak, m.vnni_peak);
        cr_assert(m.int8_probe && strstr(m.int8_probe, "VPDPBUSD"), "%s", m.int8_probe ? m.int8_probe : "(null)");
    }
    if (__builtin_cpu_supports("avx512f") || (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")))
        cr_assert(m.fp32_peak > 0 && m.fp32_probe, "no fp32 FMA peak");
    /* the range the hardware file's reader enforces on efficiency.gemm */
    cr_assert(m.gemm_ops / m.int8_peak > 0.001 && m.gemm_ops / m.int8_peak <= 1.0, "GEMM %.3g Gops/s against a peak of %.3g",
              m.gemm_ops / 1e9, m.int8_peak / 1e9);
}

/* `pdmoe bench kernels --json`: one document on stdout with the same-run ceilings and, for every
 * GEMM, MoE, float-product and decode-experts case at 1 and 2 threads, pdmoe's and oneDNN's rates side by side;
 * each fraction of a peak against the peak of its own arithmetic (int8: VNNI, AMX, the AVX2
 * kernel's vpmaddwd; float: the fp32 FMA peak of the FMAs the CPU has), and only where that peak
 * was measured. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "kernels/gemm.h"

/* stdout of `pdmoe args` (malloc'd) and its exit status. */
static char *run_out(const char *args, int *status)
{
    const char *bin = getenv("PDMOE_BIN");
    char cmd[512];
    snprintf(cmd, sizeof cmd, "%s %s", bin ? bin : "build/pdmoe", args);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    size_t k;
    while ((k = fread(buf + n, 1, cap - n - 1, p)) > 0) {
        n += k;
        if (n + 1 == cap)
            buf = realloc(buf, cap *= 2);
    }
    buf[n] = 0;
    int st = pclose(p);
    *status = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
    return buf;
}

static int positive(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    return json_is_number(v) && isfinite(json_number_value(v)) && json_number_value(v) > 0;
}

/* The kernel pdmoe runs in this process's environment (as the pdmoe it spawns picks it). */
static pd_kernel running_kernel(void)
{
    pd_kernel k;
    pd_err e = {0};
    cr_assert_eq(pd_gemm_kernel_get(&k, &e), 0, "%s", e.msg);
    return k;
}

/* Each ceiling is named by the instructions it measures, and is there exactly where the CPU has
 * them: the fp32 FMA peak with 512-bit FMAs where avx512f is, 256-bit ones where only AVX2 + FMA
 * are (an AVX2-only AMD EPYC printed no fp32 peak); the VNNI peak only with AVX-512 VNNI (it read 0
 * there, a number, with no VNNI to measure); the AVX2 int8 peak (vpmaddwd) where the AVX2 kernel
 * runs. */
static void ceiling_matches_the_cpu(json_t *c, int i)
{
    const char *fma = json_string_value(json_object_get(c, "fp32_peak_probe"));
    if (__builtin_cpu_supports("avx512f")) {
        cr_assert(positive(c, "fp32_peak_gflops"), "ceiling %d: AVX-512 here but no fp32 peak", i);
        cr_assert(fma && strstr(fma, "zmm"), "ceiling %d: fp32 probe %s with AVX-512", i, fma ? fma : "(none)");
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        cr_assert(positive(c, "fp32_peak_gflops"), "ceiling %d: AVX2 + FMA here but no fp32 peak", i);
        cr_assert(fma && strstr(fma, "ymm"), "ceiling %d: fp32 probe %s with AVX2 only", i, fma ? fma : "(none)");
    } else {
        cr_assert(json_is_null(json_object_get(c, "fp32_peak_gflops")), "ceiling %d: an fp32 peak without its probe", i);
        cr_assert_null(fma, "ceiling %d: an fp32 probe named without one", i);
    }
    json_t *vnni = json_object_get(c, "vnni_peak_gops");
    cr_assert_not_null(vnni, "ceiling %d has no vnni_peak_gops", i);
    if (pd_gemm_kernel_supported(PD_KERNEL_AVX512))
        cr_assert(positive(c, "vnni_peak_gops"), "ceiling %d: AVX-512 VNNI here but no VNNI peak", i);
    else
        cr_assert(json_is_null(vnni), "ceiling %d: a VNNI peak (%g) on a CPU without avx512_vnni", i,
                  json_number_value(vnni));
    json_t *avx2 = json_object_get(c, "avx2_int8_peak_gops");
    cr_assert_not_null(avx2, "ceiling %d has no avx2_int8_peak_gops", i);
    if (running_kernel() == PD_KERNEL_AVX2)
        cr_assert(positive(c, "avx2_int8_peak_gops"), "ceiling %d: the AVX2 kernel runs but no AVX2 int8 peak", i);
    else
        cr_assert(json_is_null(avx2), "ceiling %d: an AVX2 int8 peak while the %s kernel runs", i,
                  pd_gemm_kernel_name(running_kernel()));
}

/* An int8 case's fraction `key` of the ceiling `ceil_key`: present exactly where that ceiling was
 * measured, and the rate over it. */
static void fraction_of(json_t *c, size_t i, json_t *cl, const char *key, const char *ceil_key)
{
    json_t *of = json_object_get(c, key), *peak = json_object_get(cl, ceil_key);
    if (!json_is_number(peak)) {
        cr_assert_null(of, "case %zu: %s without %s", i, key, ceil_key);
        return;
    }
    const double want = json_number_value(json_object_get(c, "pdmoe_gflops")) / json_number_value(peak);
    cr_assert(json_is_number(of) && fabs(json_number_value(of) - want) <= 1e-3 * want, "case %zu: %s %g, rates give %g",
              i, key, json_number_value(of), want);
}

/* Issue 17's target on an int8 GEMM or MoE case (bench/report.h): which measured member it judges
 * (on the AMX kernel the GEMM against oneDNN and the MoE case against the dense GEMM, elsewhere the
 * fraction of the kernel's int8 peak), its bound, and a verdict that agrees with the number it
 * names, so the README's table (tools/perf-table.py prints these verdicts) says what the rates say. */
static void target_agrees(json_t *c, size_t i, const char *kind)
{
    const pd_kernel k = running_kernel();
    json_t *t = json_object_get(c, "target");
    if (k == PD_KERNEL_REF || k == PD_KERNEL_AMX_EMU) {
        cr_assert_null(t, "case %zu: a target for the %s kernel, which has no peak", i, pd_gemm_kernel_name(k));
        return;
    }
    const int moe = !strcmp(kind, "moe");
    const char *want = k == PD_KERNEL_AMX    ? (moe ? "pdmoe_of_dense_gemm" : "pdmoe_over_onednn")
                       : k == PD_KERNEL_AVX2 ? "pdmoe_of_avx2_int8_peak"
                                             : "pdmoe_of_vnni_peak";
    const double bound = k == PD_KERNEL_AMX ? (moe ? 0.8 : 1.0) : 0.75;
    cr_assert(json_is_object(t), "case %zu (%s): no target", i, kind);
    cr_assert_str_eq(json_string_value(json_object_get(t, "metric")), want, "case %zu", i);
    cr_assert_float_eq(json_number_value(json_object_get(t, "min")), bound, 1e-12, "case %zu", i);
    const double v = json_number_value(json_object_get(c, want));
    cr_assert(json_is_number(json_object_get(c, want)), "case %zu: the target judges %s, which it lacks", i, want);
    cr_assert(json_is_boolean(json_object_get(t, "met")) && json_is_true(json_object_get(t, "met")) == (v >= bound),
              "case %zu: %s %g judged %s against %g", i, want, v, json_is_true(json_object_get(t, "met")) ? "met" : "not met",
              bound);
}

Test(bench_kernels, json_has_both_rates_for_every_case)
{
    int st;
    char *out = run_out("bench kernels --quick --json --threads 2", &st);
    cr_assert_eq(st, 0, "exit %d: %s", st, out);
    json_error_t je;
    json_t *doc = json_loads(out, 0, &je);   /* the whole of stdout is the document */
    cr_assert_not_null(doc, "%s: %s", je.text, out);
    cr_assert_not_null(json_string_value(json_object_get(doc, "onednn")), "no oneDNN version");
    /* oneDNN's int8 sums are exact with VNNI or AMX only (tests/bench/test_onednn.c): said */
    const int vnni = __builtin_cpu_supports("avx512vnni") || __builtin_cpu_supports("avxvnni") ||
                     __builtin_cpu_supports("amx-int8");
    cr_assert(json_is_boolean(json_object_get(doc, "onednn_int8_exact")), "no onednn_int8_exact");
    cr_assert_eq(json_is_true(json_object_get(doc, "onednn_int8_exact")), vnni,
                 "onednn_int8_exact says %d on a CPU %s VNNI", json_is_true(json_object_get(doc, "onednn_int8_exact")),
                 vnni ? "with" : "without");

    json_t *ceil = json_object_get(doc, "ceilings");
    cr_assert_eq(json_array_size(ceil), 2);
    for (int i = 0; i < 2; i++) {
        json_t *c = json_array_get(ceil, (size_t)i);
        cr_assert_eq(json_integer_value(json_object_get(c, "threads")), i + 1);
        cr_assert(positive(c, "read_GBps"), "ceiling %d has no bandwidth", i);
        /* the AMX peak where the CPU has it, else null (never a made-up figure) */
        json_t *amx = json_object_get(c, "amx_peak_gops");
        cr_assert_not_null(amx, "ceiling %d has no amx_peak_gops", i);
        if (pd_gemm_kernel_supported(PD_KERNEL_AMX))
            cr_assert(positive(c, "amx_peak_gops"), "ceiling %d: AMX here but no peak", i);
        else
            cr_assert(json_is_null(amx), "ceiling %d: an AMX peak without AMX", i);
        ceiling_matches_the_cpu(c, i);
    }

    /* expected: gemm 2048x4096 and 4096x14336, moe, float, decode's experts, and gemm 2048x4096 at a
     * quarter of the tokens; each at 1 and 2 threads. The prefill GEMM's tokens are the MoE case's:
     * issue 17's targets are there, the shorter GEMM has none. */
    int seen[6][2] = {{0}};
    json_t *cases = json_object_get(doc, "cases");
    cr_assert(json_is_array(cases));
    json_int_t main_tokens = 0;
    for (size_t i = 0; i < json_array_size(cases); i++)
        if (!strcmp(json_string_value(json_object_get(json_array_get(cases, i), "kind")), "moe"))
            main_tokens = json_integer_value(json_object_get(json_object_get(json_array_get(cases, i), "shape"), "tokens"));
    cr_assert_gt(main_tokens, 0, "no MoE case");
    for (size_t i = 0; i < json_array_size(cases); i++) {
        json_t *c = json_array_get(cases, i);
        const char *kind = json_string_value(json_object_get(c, "kind"));
        json_t *shape = json_object_get(c, "shape");
        cr_assert_not_null(kind);
        cr_assert(json_is_object(shape), "case %zu: no shape", i);
        int t = (int)json_integer_value(json_object_get(c, "threads"));
        cr_assert(t == 1 || t == 2, "case %zu: threads %d", i, t);
        cr_assert(positive(c, "pdmoe_gflops") && positive(c, "onednn_gflops"),
                  "case %zu (%s): missing or non-positive rates", i, kind);
        double ratio = json_number_value(json_object_get(c, "pdmoe_over_onednn"));
        double want = json_number_value(json_object_get(c, "pdmoe_gflops")) /
                      json_number_value(json_object_get(c, "onednn_gflops"));
        cr_assert(fabs(ratio - want) <= 1e-3 * want, "case %zu: ratio %g, rates give %g", i, ratio, want);
        /* the fraction of the AMX peak exactly where there is one, and equal to the rates' ratio */
        json_t *of_amx = json_object_get(c, "pdmoe_of_amx_peak");
        if (!strcmp(kind, "float")) {
            /* float products: against the fp32 FMA peak of the same thread count, never an int8 one */
            cr_assert_null(of_amx, "case %zu: a float product against the AMX peak", i);
            cr_assert_null(json_object_get(c, "pdmoe_of_vnni_peak"), "case %zu: a float product against VNNI", i);
            cr_assert_null(json_object_get(c, "pdmoe_of_avx2_int8_peak"), "case %zu: a float product against int8", i);
            cr_assert(positive(c, "pdmoe_fp32_weights_gflops"), "case %zu: no fp32-weights rate", i);
            cr_assert_str_eq(json_string_value(json_object_get(shape, "weights")), "bf16");
            json_t *peak = json_object_get(json_array_get(ceil, (size_t)t - 1), "fp32_peak_gflops");
            json_t *of = json_object_get(c, "pdmoe_of_fp32_peak");
            if (json_is_number(peak)) {
                double want_of = json_number_value(json_object_get(c, "pdmoe_gflops")) / json_number_value(peak);
                cr_assert(json_is_number(of) && fabs(json_number_value(of) - want_of) <= 1e-3 * want_of,
                          "case %zu: %g of the fp32 peak, rates give %g", i, json_number_value(of), want_of);
            } else {
                cr_assert_null(of, "case %zu: a fraction of an fp32 peak never measured", i);
            }
        } else if (pd_gemm_kernel_supported(PD_KERNEL_AMX)) {
            double peak = json_number_value(json_object_get(json_array_get(ceil, (size_t)t - 1), "amx_peak_gops"));
            double rate = json_number_value(json_object_get(c, "pdmoe_gflops"));
            cr_assert(json_is_number(of_amx), "case %zu: AMX here but no pdmoe_of_amx_peak", i);
            cr_assert(fabs(json_number_value(of_amx) - rate / peak) <= 1e-3 * rate / peak, "case %zu: %g of the AMX peak, "
                      "rates give %g", i, json_number_value(of_amx), rate / peak);
        } else {
            cr_assert_null(of_amx, "case %zu: a fraction of an AMX peak without AMX", i);
        }
        const int short_gemm = !strcmp(kind, "gemm") && json_integer_value(json_object_get(shape, "tokens")) != main_tokens;
        if (short_gemm) {
            cr_assert_eq(json_integer_value(json_object_get(shape, "tokens")), main_tokens / 4, "case %zu: tokens", i);
            cr_assert_null(json_object_get(c, "target"), "case %zu: a target on a GEMM of other tokens than 17.2's", i);
        } else if (!strcmp(kind, "gemm") || !strcmp(kind, "moe"))
            target_agrees(c, i, kind);
        else
            cr_assert_null(json_object_get(c, "target"), "case %zu (%s): issue 17 sets it no target", i, kind);
        if (!strcmp(kind, "moe")) {   /* against the dense GEMM of its matrix shape at its threads */
            double dense = 0;
            for (size_t d = 0; d < json_array_size(cases); d++) {
                json_t *g = json_array_get(cases, d), *gs = json_object_get(g, "shape");
                if (!strcmp(json_string_value(json_object_get(g, "kind")), "gemm") &&
                    json_integer_value(json_object_get(g, "threads")) == t &&
                    json_integer_value(json_object_get(gs, "tokens")) == main_tokens &&
                    json_integer_value(json_object_get(gs, "out")) == json_integer_value(json_object_get(shape, "out")) &&
                    json_integer_value(json_object_get(gs, "in")) == json_integer_value(json_object_get(shape, "in")))
                    dense = json_number_value(json_object_get(g, "pdmoe_gflops"));
            }
            cr_assert_gt(dense, 0, "case %zu: no dense GEMM of the MoE case's shape", i);
            const double want_d = json_number_value(json_object_get(c, "pdmoe_gflops")) / dense;
            cr_assert(fabs(json_number_value(json_object_get(c, "pdmoe_of_dense_gemm")) - want_d) <= 1e-3 * want_d,
                      "case %zu: %g of the dense GEMM, rates give %g", i,
                      json_number_value(json_object_get(c, "pdmoe_of_dense_gemm")), want_d);
            /* its experts' weights, each read once: the fraction of the read bandwidth the rate
             * gives, and the most that bandwidth allows against the dense GEMM */
            const double ops = 2.0 * json_integer_value(json_object_get(shape, "out")) *
                               (double)json_integer_value(json_object_get(shape, "in")) *
                               (double)json_integer_value(json_object_get(shape, "tokens")) *
                               (double)json_integer_value(json_object_get(shape, "per_token"));
            const double wb = json_number_value(json_object_get(c, "weight_bytes"));
            const double all = (double)json_integer_value(json_object_get(shape, "experts")) *
                               (double)json_integer_value(json_object_get(shape, "out")) *
                               (double)json_integer_value(json_object_get(shape, "in"));
            cr_assert(wb > 0 && wb <= all * (1 + 1e-5), "case %zu: %g bytes of experts, of %g", i, wb, all);   /* as printed, 6 digits */
            const double read = json_number_value(json_object_get(json_array_get(ceil, (size_t)t - 1), "read_GBps")) * 1e9;
            const double rate_ops = json_number_value(json_object_get(c, "pdmoe_gflops")) * 1e9;
            const double want_b = wb / (ops / rate_ops) / read, want_bound = ops * read / wb / 1e9 / dense;
            cr_assert(fabs(json_number_value(json_object_get(c, "pdmoe_of_bandwidth")) - want_b) <= 1e-3 * want_b,
                      "case %zu: %g of the bandwidth, rates give %g", i,
                      json_number_value(json_object_get(c, "pdmoe_of_bandwidth")), want_b);
            cr_assert(fabs(json_number_value(json_object_get(c, "bandwidth_bound_of_dense_gemm")) - want_bound) <=
                      1e-3 * want_bound, "case %zu: the bandwidth allows %g of the dense GEMM, rates give %g", i,
                      json_number_value(json_object_get(c, "bandwidth_bound_of_dense_gemm")), want_bound);
        }
        int out_ = (int)json_integer_value(json_object_get(shape, "out"));
        int in = (int)json_integer_value(json_object_get(shape, "in"));
        /* every fraction against the ceiling the document gives (the higher of the readings before
         * and after the cases: recheck_ceilings updates both together) */
        json_t *cl = json_array_get(ceil, (size_t)t - 1), *ov = json_object_get(c, "pdmoe_of_vnni_peak");
        const double rate = json_number_value(json_object_get(c, "pdmoe_gflops"));
        if (json_is_number(ov)) {
            double want_v = rate / json_number_value(json_object_get(cl, "vnni_peak_gops"));
            cr_assert(fabs(json_number_value(ov) - want_v) <= 1e-3 * want_v, "case %zu: %g of the VNNI peak, rates give %g",
                      i, json_number_value(ov), want_v);
        }
        if (strcmp(kind, "float")) {
            fraction_of(c, i, cl, "pdmoe_of_vnni_peak", "vnni_peak_gops");
            fraction_of(c, i, cl, "pdmoe_of_avx2_int8_peak", "avx2_int8_peak_gops");
            if (!pd_gemm_kernel_supported(PD_KERNEL_AVX512))
                cr_assert_null(ov, "case %zu: a fraction of a VNNI peak without avx512_vnni", i);
            if (running_kernel() == PD_KERNEL_AVX2)
                cr_assert(json_is_number(json_object_get(c, "pdmoe_of_avx2_int8_peak")),
                          "case %zu: the AVX2 kernel ran, no fraction of its int8 peak", i);
        }
        json_t *ob = json_object_get(c, "pdmoe_of_bandwidth");
        if (!strcmp(kind, "experts")) {   /* each of per_token experts: gate, up [I, H], down [H, I] */
            out_ = (int)json_integer_value(json_object_get(shape, "inter"));
            in = (int)json_integer_value(json_object_get(shape, "hidden"));
            cr_assert(out_ > 0 && in > 0 && json_integer_value(json_object_get(shape, "per_token")) > 0,
                      "case %zu: experts without their sizes", i);
            /* --quick's one layer can sit in the caches: no fraction of the DRAM bandwidth then (it
             * printed 1.25 and 1.65 of it) */
            json_t *cached = json_object_get(c, "cache_resident");
            cr_assert(json_is_boolean(cached), "case %zu: experts without cache_resident", i);
            if (json_is_true(cached)) {
                cr_assert(json_is_null(ob), "case %zu: a cache-resident case as a fraction of the bandwidth", i);
            } else {
                cr_assert(json_is_number(ob), "case %zu: experts without their fraction of the bandwidth", i);
                double bytes_per_s = (3.0 * out_ * in + 4.0 * (2 * out_ + in)) * rate * 1e9 / (6.0 * out_ * in);
                double want_b = bytes_per_s / (json_number_value(json_object_get(cl, "read_GBps")) * 1e9);
                cr_assert(fabs(json_number_value(ob) - want_b) <= 1e-3 * want_b,
                          "case %zu: %g of the bandwidth, rates give %g", i, json_number_value(ob), want_b);
            }
        } else if (json_is_number(ob) && strcmp(kind, "moe") != 0) {   /* the GEMV: int8 weights and their fp32 scales, 2 ops a weight */
            double bytes_per_s = ((double)out_ * in + 4.0 * out_) * rate * 1e9 / (2.0 * out_ * in);
            double want_b = bytes_per_s / (json_number_value(json_object_get(cl, "read_GBps")) * 1e9);
            cr_assert(fabs(json_number_value(ob) - want_b) <= 1e-3 * want_b, "case %zu: %g of the bandwidth, rates give %g",
                      i, json_number_value(ob), want_b);
        }
        cr_assert_gt(json_integer_value(json_object_get(shape, "tokens")), 0);
        int slot = short_gemm && out_ == 2048 && in == 4096                 ? 5
                   : !strcmp(kind, "gemm") && out_ == 2048 && in == 4096    ? 0
                   : !strcmp(kind, "gemm") && out_ == 4096 && in == 14336 ? 1
                   : !strcmp(kind, "moe")                                 ? 2
                   : !strcmp(kind, "float")                               ? 3
                   : !strcmp(kind, "experts")                             ? 4
                                                                          : -1;
        if (slot == 2)
            cr_assert_gt(json_integer_value(json_object_get(shape, "experts")), 0);
        if (slot >= 0)
            seen[slot][t - 1]++;
        else
            cr_assert_str_eq(kind, "gemv", "case %zu: unexpected kind", i);
    }
    for (int s = 0; s < 6; s++)
        for (int t = 0; t < 2; t++)
            cr_assert_eq(seen[s][t], 1, "case %d at %d threads: %d objects", s, t + 1, seen[s][t]);
    /* where it ran, for a kept document: the flags the kernels choose by, as this process sees them */
    json_t *m = json_object_get(doc, "machine"), *flags = json_object_get(m, "flags");
    cr_assert(json_is_string(json_object_get(m, "cpu")) && json_is_array(flags), "no machine object");
    cr_assert_gt(json_integer_value(json_object_get(m, "cores")), 0);
    static const struct {
        const char *flag;
        int has;
    } fl[] = {{"avx2", 0}, {"avx512f", 1}, {"avx512_vnni", 2}};
    for (size_t f = 0; f < sizeof fl / sizeof *fl; f++) {
        int has = fl[f].has == 0 ? __builtin_cpu_supports("avx2") : fl[f].has == 1 ? __builtin_cpu_supports("avx512f")
                                                                                 : __builtin_cpu_supports("avx512vnni");
        int listed = 0;
        for (size_t j = 0; j < json_array_size(flags); j++)
            listed |= !strcmp(json_string_value(json_array_get(flags, j)), fl[f].flag);
        cr_assert_eq(listed, !!has, "flag %s: listed %d, the CPU has it: %d", fl[f].flag, listed, !!has);
    }
    json_decref(doc);
    free(out);
}

/* --cpu-time times the calling thread only: with more threads it is refused by name. */
Test(bench_kernels, cpu_time_refuses_threads)
{
    int st;
    char *out = run_out("bench kernels --cpu-time --threads 2 2>&1", &st);
    cr_assert_eq(st, 2, "exit %d: %s", st, out);
    cr_assert(strstr(out, "pdmoe bench kernels: --cpu-time times the calling thread only: it needs "
                          "--threads 1, got --threads 2"), "%s", out);
    free(out);
}

/* The published DeepSeek-V4-Flash cases (validation/published.json) and the term their family
 * added: the kernel floor of a layer in a forward pass (hardware files' layer_prefill_s and
 * layer_decode_s), fitted on one cell of SGLang's V4 cookbook and checked on the others. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/config.h"
#include "plan/hardware.h"
#include "plan/perf.h"
#include "plan/validate.h"

/* hardware/h800.json with one string replaced, written to a temporary file; returns its path. */
static const char *h800_with(const char *from, const char *to)
{
    static char path[64];
    const char *text = pd_embedded_find("hardware/h800.json");
    cr_assert(text);
    const char *at = strstr(text, from);
    cr_assert(at, "\"%s\" not in hardware/h800.json", from);
    snprintf(path, sizeof path, "/tmp/pdmoe-hw-XXXXXX");
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    FILE *f = fdopen(fd, "w");
    fprintf(f, "%.*s%s%s", (int)(at - text), text, to, at + strlen(from));
    fclose(f);
    return path;
}

static void tiny(struct pd_plan *p, const char *hw, int mtp, int k)
{
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.model = "v4-tiny";
    o.hardware = hw;
    o.quant = "fp8";
    o.mtp = mtp;
    o.spec_k = k;
    o.max_model_len = 4096;
    o.max_num_batched_tokens = 256;
    o.max_num_seqs = 8;
    o.role[0] = (struct pd_role_opts){.dp = 1, .tp = 1, .instances = 1};
    o.role[1] = (struct pd_role_opts){.dp = 1, .tp = 1, .instances = 1};
    pd_err e = {0};
    cr_assert_eq(pd_plan_build(&o, p, &e), 0, "%s", e.msg);
    unlink(hw);
}

/* The floor is paid once per layer of each pass, whatever its tokens: a decode step without
 * drafts runs every layer once; with k drafts the main model's layers once and the MTP layers
 * k times (the first draft pass and k - 1 more). So with the floor L the step grows by exactly
 * L x (layers of the passes), for one sequence as for eight, and a prefill step by L x layers. */
Test(v4cases, layer_floor_per_layer_pass)
{
    const double L = 1e-3;
    char to[64];
    snprintf(to, sizeof to, "\"layer_decode_s\": %g", L);
    for (int mtp = 0; mtp <= 1; mtp++) {
        const int k = mtp ? 3 : 0;
        struct pd_plan p0, p1;
        tiny(&p0, h800_with("\"layer_decode_s\": 8.5e-05", "\"layer_decode_s\": 0"), mtp, k);
        tiny(&p1, h800_with("\"layer_decode_s\": 8.5e-05", to), mtp, k);
        const int n = p0.kv.n, main = p0.model.n_layers;
        const double passes = mtp ? main + (double)k * (n - main) : n;
        cr_assert_gt(passes, 0);
        for (int64_t seqs = 1; seqs <= 8; seqs *= 8) {
            struct pd_step s0, s1;
            pd_perf_step(&p0, PD_ROLE_DECODE, seqs, 1 + k, 100, &s0);
            pd_perf_step(&p1, PD_ROLE_DECODE, seqs, 1 + k, 100, &s1);
            cr_assert_float_eq(s1.overhead_s - s0.overhead_s, L * passes, 1e-12, "mtp %d, %lld sequences: %g vs %g", mtp,
                               (long long)seqs, s1.overhead_s - s0.overhead_s, L * passes);
            cr_assert_float_eq(s1.total_s - s0.total_s, L * passes, 1e-12);
        }
        /* the prefill role keeps its own figure (h800's 85 us): unchanged between the two */
        struct pd_step q0, q1;
        pd_perf_step(&p0, PD_ROLE_PREFILL, 1, 256, 0, &q0);
        pd_perf_step(&p1, PD_ROLE_PREFILL, 1, 256, 0, &q1);
        cr_assert_float_eq(q1.total_s, q0.total_s, 1e-15);
        cr_assert_float_eq(p0.hw.eff.layer_s[0], 8.5e-5, 1e-15);
        pd_plan_free(&p0);
        pd_plan_free(&p1);
    }
}

/* The factor is optional (0 when absent: the Ascend files have no fit for it) but, when given,
 * sourced and in range like every other one. */
Test(v4cases, layer_floor_in_hardware_files)
{
    struct pd_hardware h;
    pd_err e = {0};
    const char *fitted[] = {"h100", "h200", "h800", "b200"};
    for (size_t i = 0; i < sizeof fitted / sizeof fitted[0]; i++) {
        cr_assert_eq(pd_hardware_load(fitted[i], &h, &e), 0, "%s", e.msg);
        cr_assert_float_eq(h.eff.layer_s[0], 8.5e-5, 1e-15, "%s", fitted[i]);
        cr_assert_float_eq(h.eff.layer_s[1], 8.5e-5, 1e-15, "%s", fitted[i]);
    }
    cr_assert_eq(pd_hardware_load("atlas-800i-a3", &h, &e), 0, "%s", e.msg);
    cr_assert(h.eff.layer_s[0] == 0 && h.eff.layer_s[1] == 0);
    cr_assert_float_eq(h.eff.fp4_memory, 1, 1e-15, "absent: FP4 at the memory factor");
    const char *hopper[] = {"h100", "h200", "h800"};
    for (size_t i = 0; i < sizeof hopper / sizeof hopper[0]; i++) {
        cr_assert_eq(pd_hardware_load(hopper[i], &h, &e), 0, "%s", e.msg);
        cr_assert_float_eq(h.eff.fp4_memory, 0.46, 1e-15, "%s", hopper[i]);
    }
    cr_assert_eq(pd_hardware_load("b200", &h, &e), 0, "%s", e.msg);
    cr_assert_float_eq(h.eff.fp4_memory, 1, 1e-15, "B200 runs FP4 natively");

    const char *text = pd_embedded_find("hardware/h800.json");
    const char *src = "\"layer_decode_s\": \"as layer_prefill_s";
    char *t = strdup(text), *at = strstr(t, src);
    cr_assert(at);
    memcpy(at, "\"layer_decode_x\"", 16);   /* same length: the source's key renamed */
    cr_assert_neq(pd_hardware_parse(t, "hw.json", &h, &e), 0);
    cr_assert(strstr(e.msg, "hw.json") && strstr(e.msg, "\"sources.efficiency.layer_decode_s\""), "%s", e.msg);
    free(t);
    t = strdup(text);
    at = strstr(t, "\"layer_decode_s\": 8.5e-05");
    cr_assert(at);
    memcpy(at, "\"layer_decode_s\": 8.5e+05", 25);
    cr_assert_neq(pd_hardware_parse(t, "hw.json", &h, &e), 0);
    cr_assert(strstr(e.msg, "\"efficiency.layer_decode_s\"") && strstr(e.msg, "out of range"), "%s", e.msg);
    free(t);
}

static const struct pd_valcase *find(const struct pd_valcase *c, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (strstr(c[i].name, name))
            return &c[i];
    cr_assert_fail("no case \"%s\"", name);
    return NULL;
}

/* The Ascend V4-Flash runs, as published: SGLang's A3 CI tests (8K and 32K on one node, 1P1D at
 * 8K on two) and vLLM-Ascend's nightly A3 test, each on the A3 file, pending. */
static void ascend_cases(const struct pd_valcase *c, int n)
{
    static const struct {
        const char *name;
        double published;
        int64_t isl, osl, concurrency, num_prompts;
        int aggregated, dp, tp, k;
    } want[] = {
        {"W8A8 on one Atlas 800I A3 (8 cards, 16 dies), 8K/1K, 160 clients", 1708, 8000, 1000, 160, 160, 1, 16, 1, 2},
        {"W8A8 on one Atlas 800I A3 (8 cards, 16 dies), 32K/1K, 64 clients", 927, 32000, 1000, 64, 64, 1, 16, 1, 2},
        {"W8A8 1P1D on two Atlas 800I A3", 7046, 8000, 1000, 800, 2400, 0, 16, 1, 2},
        {"vLLM-Ascend nightly, DeepSeek-V4-Flash W8A8", 181.8813, 32768, 1024, 16, 64, 1, 4, 4, 1},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const struct pd_valcase *v = find(c, n, want[i].name);
        cr_assert_str_eq(v->family, "Ascend", "%s", v->name);
        cr_assert_eq(v->published, want[i].published, "%s", v->name);
        cr_assert_eq(v->perf.w.isl, want[i].isl, "%s", v->name);
        cr_assert_eq(v->perf.w.osl, want[i].osl, "%s", v->name);
        cr_assert_eq(v->perf.w.concurrency, want[i].concurrency, "%s", v->name);
        cr_assert_eq(v->perf.w.num_prompts, want[i].num_prompts, "%s", v->name);
        cr_assert_eq(v->perf.aggregated != 0, want[i].aggregated, "%s", v->name);
        cr_assert_eq(v->perf.mtp.k, want[i].k, "%s", v->name);
        char layout[64];
        if (want[i].aggregated)
            snprintf(layout, sizeof layout, "DP%d TP%d", want[i].dp, want[i].tp);
        else
            snprintf(layout, sizeof layout, "P 1 x EP%d, D 1 x EP%d", want[i].dp, want[i].dp);
        cr_assert(strstr(v->layout, layout), "%s: %s", v->name, v->layout);
        /* every one the model predicts faster than published: the Ascend day-0 V4 stack */
        cr_assert_gt(v->error, 0.25, "%s: %+.1f%%", v->name, 100 * v->error);
        cr_assert(v->pending[0], "%s", v->name);
    }
}

/* Every V4-Flash case: a lockstep loop (aggregated, but for SGLang's A3 1P1D run) whose prediction is its metric's formula at
 * the loop's figures (user tokens/s = 1 / TPOT; output tokens/s = the requests' output over the
 * run's duration when one DP rank runs all clients); pending exactly when outside 25%, with its
 * reason. The SGLang cookbook family (eight cells): the H200 FP8 single stream is the layer
 * floor's fit and the H100 Marlin cell at 16 clients the FP4-on-Hopper factor's (each within
 * 1%), every other cell a check within 25% (the H200 Marlin cell at 16 clients within 5%);
 * LMSYS's day-0 single stream, costed as SGLang's H200 recipe (3 drafts a step), within 25%. */
Test(v4cases, published_v4_cases)
{
    struct pd_valcase *c;
    int n;
    pd_err e = {0};
    cr_assert_eq(pd_validate_run(pd_embedded_find("validation/published.json"), "validation/published.json", &c, &n, &e),
                 0, "%s", e.msg);
    int v4 = 0, checked = 0, pending = 0, family = 0, family_checked = 0;
    for (int i = 0; i < n; i++) {
        const struct pd_valcase *v = &c[i];
        if (!strstr(v->name, "DeepSeek-V4-Flash"))
            continue;
        v4++;
        cr_assert(v->perf.w.lockstep, "%s", v->name);
        cr_assert(v->perf.aggregated || strstr(v->name, "1P1D"), "%s", v->name);
        const struct pd_closed *cl = &v->perf.closed;
        if (strcmp(v->metric, "user_tokens_per_s") == 0)
            cr_assert_float_eq(v->predicted, 1 / cl->tpot_s, 1e-9 * v->predicted, "%s", v->name);
        else
            cr_assert_float_eq(v->predicted, cl->tok_s, 1e-9 * v->predicted, "%s", v->name);
        if (v->perf.w.num_prompts > 0 && strstr(v->layout, " DP1 "))   /* one rank runs all the clients */
            cr_assert_float_eq(cl->tok_s, (double)v->lock.clients * v->lock.requests * v->perf.w.osl / v->lock.duration_s,
                               1e-9 * cl->tok_s, "%s", v->name);
        cr_assert_float_eq(v->error, v->predicted / v->published - 1, 1e-12);
        if (v->pending[0]) {
            pending++;
            cr_assert_gt(fabs(v->error), 0.25, "%s: within 25%% (%+.1f%%), yet pending", v->name, 100 * v->error);
            cr_assert_gt(strlen(v->pending), 100, "%s", v->name);
        } else {
            checked++;
            cr_assert_leq(fabs(v->error), 0.25, "%s: %+.1f%%", v->name, 100 * v->error);
        }
        if (strstr(v->name, "SGLang cookbook")) {
            family++;
            family_checked += !v->pending[0];
            cr_assert_eq(v->perf.mtp.k, 3, "%s: EAGLE 3 steps, 4 draft tokens", v->name);
        }
    }
    cr_assert_eq(v4, 15);
    cr_assert_eq(family, 8);
    cr_assert_eq(family_checked, 8);
    cr_assert_eq(checked, 9);
    cr_assert_eq(pending, 6, "the four Ascend runs and Lambda's two vLLM runs");
    ascend_cases(c, n);
    const struct pd_valcase *fit = find(c, n, "low-latency on 4 x H200 (FP8 experts), 8K/1K, 1 client");
    cr_assert_leq(fabs(fit->error), 0.01, "the fit: %+.2f%%", 100 * fit->error);
    const struct pd_valcase *marlin = find(c, n, "8 x H100 (FP4 experts), 8K/1K, 16 clients");
    cr_assert_leq(fabs(marlin->error), 0.01, "the FP4-on-Hopper fit: %+.2f%%", 100 * marlin->error);
    cr_assert_leq(fabs(find(c, n, "4 x H200 (FP4 experts, Marlin), 8K/1K, 16 clients")->error), 0.05);
    const struct pd_valcase *lmsys = find(c, n, "LMSYS day 0");
    cr_assert_eq(lmsys->perf.mtp.k, 3);
    cr_assert_not(lmsys->pending[0]);
    /* the kernel floor is in every step of these cases: the LMSYS step's overhead holds the
     * per-step cost plus 85 us for each of the 43 main layers and the 3 draft passes */
    cr_assert_float_eq(lmsys->lock.decode_step.overhead_s, 0.002 + 8.5e-5 * (43 + 3), 1e-9,
                       "%g", lmsys->lock.decode_step.overhead_s);
    free(c);
}

/* validate --json, as a reader sees it: each V4-Flash case's "predicted" is its metric's formula
 * at the case's own closed-loop figures in "perf" (1 / tpot_s, or output_tokens_per_s), its
 * "error" predicted / published - 1, its status "pending" exactly when it has a reason and is
 * outside 25% ("checked" otherwise), and its lockstep run's decode step there with its terms. */
Test(v4cases, validate_json_per_case)
{
    struct pd_valcase *c;
    int n;
    pd_err e = {0};
    cr_assert_eq(pd_validate_run(pd_embedded_find("validation/published.json"), "validation/published.json", &c, &n, &e),
                 0, "%s", e.msg);
    json_t *arr = pd_validate_json(c, n);
    cr_assert(json_is_array(arr) && (int)json_array_size(arr) == n);
    size_t i;
    json_t *o;
    int v4 = 0;
    json_array_foreach(arr, i, o) {
        const char *name = json_string_value(json_object_get(o, "name"));
        if (!strstr(name, "DeepSeek-V4-Flash"))
            continue;
        v4++;
        const char *metric = json_string_value(json_object_get(o, "metric"));
        const char *status = json_string_value(json_object_get(o, "status"));
        const char *reason = json_string_value(json_object_get(o, "reason"));
        double pred = json_number_value(json_object_get(o, "predicted"));
        double pub = json_number_value(json_object_get(o, "published"));
        double err = json_number_value(json_object_get(o, "error"));
        json_t *cl = json_object_get(json_object_get(o, "perf"), "closed_loop");
        cr_assert(json_is_object(cl), "%s: no closed_loop", name);
        double want = strcmp(metric, "user_tokens_per_s") == 0 ? 1 / json_number_value(json_object_get(cl, "tpot_s"))
                                                               : json_number_value(json_object_get(cl, "output_tokens_per_s"));
        cr_assert_float_eq(pred, want, 1e-9 * want, "%s: %g vs %g", name, pred, want);
        cr_assert_float_eq(err, pred / pub - 1, 1e-12, "%s", name);
        if (strcmp(status, "pending") == 0)
            cr_assert(fabs(err) > 0.25 && strlen(reason) > 100, "%s", name);
        else
            cr_assert(strcmp(status, "checked") == 0 && fabs(err) <= 0.25 && !reason[0], "%s: %s", name, status);
        json_t *ds = json_object_get(json_object_get(o, "lockstep"), "decode_step");
        if (strstr(name, "1P1D")) {   /* disaggregated: its steps are the plan's */
            cr_assert(json_is_null(json_object_get(o, "lockstep")) || !json_object_get(o, "lockstep"), "%s", name);
            ds = json_object_get(json_object_get(o, "perf"), "decode_step");
        }
        cr_assert(json_is_object(ds), "%s: the lockstep run's decode step", name);
        double sum = 0;
        const char *terms[] = {"gemm_compute_s", "gemm_memory_s", "attention_s", "a2a_s", "overhead_s"};
        for (size_t t = 0; t < sizeof terms / sizeof terms[0]; t++)
            sum += json_number_value(json_object_get(ds, terms[t]));
        /* no overlap in decode on these files: the step is the sum of its terms */
        cr_assert_float_eq(json_number_value(json_object_get(ds, "total_s")), sum, 1e-12, "%s", name);
    }
    cr_assert_eq(v4, 15);
    json_decref(arr);
    free(c);
}

/* FP4 weights on a card that dequantises them in software stream at fp4_memory of the memory
 * factor: a memory-bound step whose routed experts are FP4 reads them 1 / fp4_memory slower,
 * and a step without FP4 weights is unchanged. */
Test(v4cases, fp4_memory_scales_fp4_reads_only)
{
    for (int fp4 = 0; fp4 <= 1; fp4++) {
        struct pd_plan p[2];
        for (int i = 0; i < 2; i++) {
            struct pd_plan_opts o;
            pd_plan_opts_default(&o);
            o.model = "v4-tiny";
            o.hardware = h800_with("\"fp4_memory\": 0.46", i ? "\"fp4_memory\": 0.25" : "\"fp4_memory\": 1");
            o.quant = "fp8";
            o.quant_override = fp4 ? "routed_experts=fp4" : NULL;
            o.mtp = 0;
            o.max_model_len = 4096;
            o.max_num_batched_tokens = 256;
            o.max_num_seqs = 8;
            o.role[0] = (struct pd_role_opts){.dp = 1, .tp = 1, .instances = 1};
            o.role[1] = (struct pd_role_opts){.dp = 1, .tp = 1, .instances = 1};
            pd_err e = {0};
            cr_assert_eq(pd_plan_build(&o, &p[i], &e), 0, "%s", e.msg);
            unlink(o.hardware);
        }
        struct pd_step s0, s1;
        pd_perf_step(&p[0], PD_ROLE_DECODE, 1, 1, 100, &s0);
        pd_perf_step(&p[1], PD_ROLE_DECODE, 1, 1, 100, &s1);
        cr_assert_float_eq(s1.bytes, s0.bytes, 1e-6);
        if (!fp4) {
            cr_assert_float_eq(s1.gemm_memory_s, s0.gemm_memory_s, 1e-15);
        } else {
            /* the experts' k of E are the step's only FP4 bytes: their time grows by 1/0.25 - 1 */
            double eb = (double)p[0].model.n_experts_per_tok * p[0].inv.class_bytes[PD_CLASS_I] / p[0].inv.n_experts;
            double t = eb / (p[0].hw.mem_bw_Bps * p[0].hw.eff.memory);
            cr_assert_gt(t, 0);
            cr_assert_float_eq(s1.gemm_memory_s - s0.gemm_memory_s, t * (1 / 0.25 - 1), 1e-6 * t, "%g vs %g",
                               s1.gemm_memory_s - s0.gemm_memory_s, t * 3);
        }
        pd_plan_free(&p[0]);
        pd_plan_free(&p[1]);
    }
}

/* Speculative decoding in the performance model (plan/mtp.h, perf.c): the tokens a step yields
 * against the equation, the measured counters turned into per-position acceptance (and refused
 * when malformed, naming the file and field), the decode step's cost (the main model verifying
 * k + 1 tokens, the MTP layer's k draft passes), and one function behind every TPOT. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "plan/mtp.h"
#include "plan/perf.h"
#include "plan/plan.h"
#include "../tmpmodel.h"

Test(mtp, tokens_per_step_is_the_equation)
{
    struct pd_mtp m = {1, {0.85}};
    cr_assert_float_eq(pd_mtp_tokens_per_step(&m), 1.85, 1e-12);   /* k = 1: 1 + a */
    m = (struct pd_mtp){3, {0.9, 0.8, 0.7}};
    cr_assert_float_eq(pd_mtp_tokens_per_step(&m), 1 + 0.9 + 0.9 * 0.8 + 0.9 * 0.8 * 0.7, 1e-12);
    m = (struct pd_mtp){2, {0, 1}};                                  /* a rejection ends the round */
    cr_assert_float_eq(pd_mtp_tokens_per_step(&m), 1, 1e-12);
    m.k = 0;
    cr_assert_float_eq(pd_mtp_tokens_per_step(&m), 1, 1e-12);
}

Test(mtp, parse_list)
{
    struct pd_mtp m;
    pd_err e = {0};
    cr_assert_eq(pd_mtp_parse_list("--mtp-acceptance", "0.9,0.75,0.5", &m, &e), 0, "%s", e.msg);
    cr_assert_eq(m.k, 3);
    cr_assert_float_eq(m.a[1], 0.75, 1e-12);
    const char *bad[] = {"", "0.9,", "1.5", "-0.1", "0.9;0.8", "x", "0.1,0.1,0.1,0.1,0.1,0.1,0.1,0.1,0.1"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_assert_neq(pd_mtp_parse_list("--mtp-acceptance", bad[i], &m, &e), 0, "\"%s\" accepted", bad[i]);
        cr_assert(strstr(e.msg, "--mtp-acceptance"), "%s", e.msg);
    }
}

/* generate --spec-stats' JSON: the unconditional per-position shares (accepted / drafted) become
 * conditional rates whose equation gives back 1 + the sum of the shares. */
Test(mtp, stats_json_to_conditional_rates)
{
    struct pd_mtp m;
    pd_err e = {0};
    const char *j = "{\"method\":\"mtp\",\"num_speculative_tokens\":3,\"num_drafts\":100,\"num_draft_tokens\":300,"
                    "\"num_accepted_tokens\":240,\"num_drafted_tokens_per_pos\":[100,100,80],"
                    "\"num_accepted_tokens_per_pos\":[90,72,48]}";
    cr_assert_eq(pd_mtp_stats_parse(j, "s.json", &m, &e), 0, "%s", e.msg);
    cr_assert_eq(m.k, 3);
    cr_assert_float_eq(m.a[0], 0.9, 1e-12);
    cr_assert_float_eq(m.a[1], 0.8, 1e-12);             /* 0.72 / 0.9 */
    cr_assert_float_eq(m.a[2], (48.0 / 80) / 0.72, 1e-12);
    cr_assert_float_eq(pd_mtp_tokens_per_step(&m), 1 + 0.9 + 0.72 + 0.6, 1e-12);
    /* without the per-position denominators: num_drafts for every position */
    const char *j2 = "{\"num_speculative_tokens\":2,\"num_drafts\":10,\"num_accepted_tokens_per_pos\":[5,2]}";
    cr_assert_eq(pd_mtp_stats_parse(j2, "s.json", &m, &e), 0, "%s", e.msg);
    cr_assert_float_eq(m.a[1], 0.4, 1e-12);
}

/* A /metrics scrape, pdmoe's names or vLLM's (label sets of several engines summed). */
Test(mtp, stats_metrics_scrape)
{
    struct pd_mtp m;
    pd_err e = {0};
    const char *pd = "# TYPE pdmoe_spec_decode_num_drafts_total counter\npdmoe_spec_decode_num_drafts_total 50\n"
                     "pdmoe_spec_decode_num_draft_tokens_total 100\n"
                     "pdmoe_spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"} 40\n"
                     "pdmoe_spec_decode_num_accepted_tokens_per_pos_total{position=\"1\"} 30\n"
                     "pdmoe_requests_total 7\n";
    cr_assert_eq(pd_mtp_stats_parse(pd, "m.txt", &m, &e), 0, "%s", e.msg);
    cr_assert_eq(m.k, 2);
    cr_assert_float_eq(m.a[0], 0.8, 1e-12);
    cr_assert_float_eq(m.a[1], 0.75, 1e-12);
    const char *vl = "vllm:spec_decode_num_drafts_total{engine=\"0\",model_name=\"x\"} 10\n"
                     "vllm:spec_decode_num_drafts_total{engine=\"1\",model_name=\"x\"} 10\n"
                     "vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=\"0\",model_name=\"x\",position=\"0\"} 9\n"
                     "vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=\"1\",model_name=\"x\",position=\"0\"} 7\n";
    cr_assert_eq(pd_mtp_stats_parse(vl, "m.txt", &m, &e), 0, "%s", e.msg);
    cr_assert_eq(m.k, 1);
    cr_assert_float_eq(m.a[0], 0.8, 1e-12);
}

static void refused(const char *text, const char *needle)
{
    struct pd_mtp m;
    pd_err e = {0};
    cr_assert_neq(pd_mtp_stats_parse(text, "bad.json", &m, &e), 0, "accepted: %s", text);
    cr_assert(strstr(e.msg, "bad.json"), "%s", e.msg);
    cr_assert(strstr(e.msg, needle), "\"%s\" lacks \"%s\"", e.msg, needle);
}

Test(mtp, bad_stats_are_refused_naming_the_field)
{
    refused("{\"num_drafts\":1,\"num_accepted_tokens_per_pos\":[1]}", "num_speculative_tokens");
    refused("{\"num_speculative_tokens\":1,\"num_accepted_tokens_per_pos\":[1]}", "num_drafts");
    refused("{\"num_speculative_tokens\":2,\"num_drafts\":5,\"num_accepted_tokens_per_pos\":[1]}",
            "num_accepted_tokens_per_pos");
    refused("{\"num_speculative_tokens\":1,\"num_drafts\":5,\"num_accepted_tokens_per_pos\":[-1]}",
            "num_accepted_tokens_per_pos[0]");
    refused("{\"num_speculative_tokens\":1,\"num_drafts\":5,\"num_accepted_tokens_per_pos\":[6]}",
            "num_accepted_tokens_per_pos[0]");
    refused("{\"num_speculative_tokens\":2,\"num_drafts\":5,\"num_accepted_tokens_per_pos\":[2,3]}",
            "num_accepted_tokens_per_pos[1]");
    refused("{\"num_speculative_tokens\":1,\"num_drafts\":0,\"num_accepted_tokens_per_pos\":[0]}", "no round drafted position 0");
    refused("{\"num_speculative_tokens\":1,\"num_drafts\":5,\"num_drafted_tokens_per_pos\":[\"x\"],"
            "\"num_accepted_tokens_per_pos\":[1]}", "num_drafted_tokens_per_pos[0]");
    refused("{\"num_speculative_tokens\":", "not valid JSON");
    refused("pdmoe_requests_total 3\n", "pdmoe_spec_decode_num_drafts_total");
    refused("pdmoe_spec_decode_num_drafts_total 3\npdmoe_spec_decode_num_accepted_tokens_per_pos_total{position=\"9\"} 1\n",
            "position");
    /* a position past int (it wrapped to 0), non-finite counts and counts that add up past a double
     * (they made acceptances of 0, or 1 labelled measured) */
    refused("pdmoe_spec_decode_num_drafts_total 3\n"
            "pdmoe_spec_decode_num_accepted_tokens_per_pos_total{position=\"4294967296\"} 1\n", "position");
    refused("pdmoe_spec_decode_num_drafts_total +Inf\n"
            "pdmoe_spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"} 1\n", "expected a count");
    refused("pdmoe_spec_decode_num_drafts_total 1e308\npdmoe_spec_decode_num_drafts_total 1e308\n"
            "pdmoe_spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"} 1e308\n"
            "pdmoe_spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"} 1e308\n", "add up past any count");
    struct pd_mtp m;
    pd_err e = {0};
    cr_assert_eq(pd_mtp_stats_load("/nonexistent/spec.json", &m, &e), PD_EIO);
    cr_assert(strstr(e.msg, "/nonexistent/spec.json"), "%s", e.msg);
}

/* v4-tiny on one card, every cost but the weight and KV reads zero (unbounded arithmetic), MTP
 * layer loaded or not, k drafts with the given acceptance. */
static void tiny(struct pd_plan *p, int mtp, int k, const char *acceptance)
{
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.model = "v4-tiny";
    o.hardware = "h100";
    o.quant = "w8a8";
    o.mtp = mtp;
    o.spec_k = k;
    o.mtp_acceptance = acceptance;
    o.nodes = 1;
    o.max_model_len = 4096;
    o.max_num_batched_tokens = 256;
    o.max_num_seqs = 8;
    o.role[0] = o.role[1] = (struct pd_role_opts){.dp = 1, .tp = 1, .instances = 1};
    pd_err e = {0};
    cr_assert_eq(pd_plan_build(&o, p, &e), 0, "%s", e.msg);
    p->hw.eff.step_s[1] = p->hw.eff.token_layer_s[1] = p->hw.eff.a2a_latency_s = 0;
}

/* The decode step with the MTP layer = the main model's verification of k + 1 tokens (what a
 * plan without the layer costs) + the MTP layer's passes: its first runs tokens_per_step
 * tokens per sequence, each later one one token. At acceptance 0 every pass is one token, so the
 * MTP part of k drafts is k times that of one draft; at acceptance 1 the first pass runs k + 1
 * tokens, reaching more experts, and costs more than a later one. */
Test(mtp, decode_step_is_verify_plus_draft_passes)
{
    struct pd_plan off, on1, on3, full3;
    tiny(&off, 0, 0, NULL);
    tiny(&on1, 1, 1, "0");
    tiny(&on3, 1, 3, "0");
    tiny(&full3, 1, 3, "1");
    const int64_t B = 4, ctx = 2000;
    struct pd_step v2, v4, s1, s3, f3;
    pd_perf_step(&off, PD_ROLE_DECODE, B, 2, ctx, &v2);
    pd_perf_step(&off, PD_ROLE_DECODE, B, 4, ctx, &v4);
    cr_assert_eq(pd_perf_decode_tokens(&on3), 4);
    pd_perf_step(&on1, PD_ROLE_DECODE, B, pd_perf_decode_tokens(&on1), ctx, &s1);
    pd_perf_step(&on3, PD_ROLE_DECODE, B, pd_perf_decode_tokens(&on3), ctx, &s3);
    pd_perf_step(&full3, PD_ROLE_DECODE, B, 4, ctx, &f3);
    double d1 = s1.bytes - v2.bytes, d3 = s3.bytes - v4.bytes;
    cr_assert_gt(d1, 0);
    /* one MTP pass reads at least the layer's own weights and the shared LM head */
    double own = (double)on1.inv.group_bytes[PD_G_MTP][PD_CLASS_II] + (double)on1.inv.group_bytes[PD_G_LM_HEAD][PD_CLASS_II];
    cr_assert_geq(d1, own);
    /* the passes' KV reads grow by a position each: within 1% of k x one pass */
    cr_assert(fabs(d3 - 3 * d1) < 0.01 * d3, "3 drafts %g, one %g", d3, d1);
    cr_assert_gt(f3.bytes - v4.bytes, d3);
    /* the main model's part is the plan without the layer: the same tokens counted */
    cr_assert_eq(s3.tokens, B * 4);
    pd_plan_free(&off);
    pd_plan_free(&on1);
    pd_plan_free(&on3);
    pd_plan_free(&full3);
}

/* Every TPOT divides by the same tokens per step: disaggregated, aggregated, the closed loop. */
Test(mtp, every_tpot_uses_the_equation)
{
    struct pd_plan p;
    tiny(&p, 1, 3, "0.9,0.8,0.5");
    const double tps = 1 + 0.9 + 0.72 + 0.36;
    cr_assert_float_eq(pd_perf_tokens_per_step(&p), tps, 1e-12);
    struct pd_workload w;
    pd_workload_default(&w);
    w.isl = 256;
    w.osl = 64;
    w.decode_batch = 2;
    struct pd_perf f;
    pd_err e = {0};
    cr_assert_eq(pd_perf_eval(&p, &w, &f, &e), 0, "%s", e.msg);
    cr_assert_float_eq(f.tokens_per_step, tps, 1e-12);
    cr_assert_float_eq(f.tpot_s, f.decode_step.total_s / tps, 1e-12);
    cr_assert_eq(f.decode_step.tokens, 2 * 4);
    w.concurrency = 1;
    w.decode_batch = 0;
    cr_assert_eq(pd_perf_eval(&p, &w, &f, &e), 0, "%s", e.msg);
    struct pd_step s;
    pd_perf_step(&p, PD_ROLE_DECODE, 1, 4, w.isl + w.osl / 2, &s);
    cr_assert_float_eq(f.closed.tpot_s, s.total_s / tps, 1e-9);
    p.o.aggregated = 1;
    w.concurrency = 0;
    cr_assert_eq(pd_perf_agg(&p, &w, &f, &e), 0, "%s", e.msg);
    cr_assert_float_eq(f.tokens_per_step, tps, 1e-12);
    cr_assert_float_eq(f.tpot_s, f.agg.step_s / tps, 1e-12);
    cr_assert_eq(f.agg.chunk, p.o.max_num_batched_tokens - f.agg.batch * 4);
    pd_plan_free(&p);
}

static void build_refused(int mtp, int k, const char *acc, const char *stats, const char *needle)
{
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.model = "v4-tiny";
    o.hardware = "h100";
    o.nodes = 1;
    o.max_model_len = 4096;
    o.role[0] = o.role[1] = (struct pd_role_opts){.dp = 1, .tp = 1, .instances = 1};
    o.mtp = mtp;
    o.spec_k = k;
    o.mtp_acceptance = acc;
    o.spec_stats = stats;
    struct pd_plan p;
    pd_err e = {0};
    cr_assert_neq(pd_plan_build(&o, &p, &e), 0, "accepted (needle %s)", needle);
    cr_assert(strstr(e.msg, needle), "\"%s\" lacks \"%s\"", e.msg, needle);
}

Test(mtp, plan_refuses_what_it_cannot_run)
{
    build_refused(0, 2, NULL, NULL, "--speculative-config: no MTP layer is loaded (--mtp off)");
    build_refused(0, 0, "0.9", NULL, "--mtp-acceptance: no MTP layer");
    build_refused(1, 3, "0.9,0.8", NULL, "--mtp-acceptance: acceptance for 2 draft positions, but num_speculative_tokens is 3");
    build_refused(1, 1, "0.9,0.8", NULL, "2 rates for num_speculative_tokens 1");
    build_refused(1, 0, "0.9", "x.json", "not both");
    char path[] = "/tmp/pdmoe-spec-XXXXXX";
    tmp_text(path, "{\"num_speculative_tokens\":2,\"num_drafts\":4,\"num_accepted_tokens_per_pos\":[3,2]}");
    build_refused(1, 3, NULL, path, "acceptance for 2 draft positions, but num_speculative_tokens is 3");
    /* fewer drafts than measured: the first positions */
    struct pd_plan p;
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.model = "v4-tiny";
    o.hardware = "h100";
    o.nodes = 1;
    o.max_model_len = 4096;
    o.role[0] = o.role[1] = (struct pd_role_opts){.dp = 1, .tp = 1, .instances = 1};
    o.spec_k = 1;
    o.spec_stats = path;
    pd_err e = {0};
    cr_assert_eq(pd_plan_build(&o, &p, &e), 0, "%s", e.msg);
    cr_assert_eq(p.mtp.k, 1);
    cr_assert_float_eq(pd_perf_tokens_per_step(&p), 1.75, 1e-12);
    pd_plan_free(&p);
    o.spec_k = 0;                    /* as many as measured */
    cr_assert_eq(pd_plan_build(&o, &p, &e), 0, "%s", e.msg);
    cr_assert_eq(p.mtp.k, 2);
    cr_assert_float_eq(pd_perf_tokens_per_step(&p), 1 + 0.75 + 0.5, 1e-12);
    pd_plan_free(&p);
    unlink(path);
    /* the hardware file's one rate for every position */
    o.spec_stats = NULL;
    o.spec_k = 2;
    cr_assert_eq(pd_plan_build(&o, &p, &e), 0, "%s", e.msg);
    double a = p.hw.eff.mtp_acceptance;
    cr_assert_float_eq(pd_perf_tokens_per_step(&p), 1 + a + a * a, 1e-12);
    pd_plan_free(&p);
}

/* Numbers in files that would make the planner print nonsense are refused: a hardware file whose
 * bf16_flops is 0 (predictions were inf), a config.json within every field's range whose products
 * are not (65,536 experts of 2^20 x 2^20 gave a negative inventory), expert stats whose counts
 * sum to inf. Each error names the file and the field or tensor. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/config.h"
#include "model/jsonf.h"
#include "plan/hardware.h"
#include "plan/inventory.h"
#include "plan/perf.h"
#include "plan/plan.h"
#include "../tmpmodel.h"

/* The embedded file `file` with `from` replaced by `to` (malloc'ed). */
static char *edit(const char *file, const char *from, const char *to)
{
    const char *text = pd_embedded_find(file);
    cr_assert(text, "%s not embedded", file);
    const char *at = strstr(text, from);
    cr_assert(at, "\"%s\" not in %s", from, file);
    char *out = malloc(strlen(text) + strlen(to) + 1);
    memcpy(out, text, (size_t)(at - text));
    strcpy(out + (at - text), to);
    strcat(out, at + strlen(from));
    return out;
}

Test(limits, a_card_without_bf16_flops_is_refused)
{
    char *t = edit("hardware/h100.json", "\"bf16_flops\": 9.89e14", "\"bf16_flops\": 0");
    struct pd_hardware h;
    pd_err e = {0};
    cr_assert_neq(pd_hardware_parse(t, "hw.json", &h, &e), 0, "a card of 0 bf16 FLOP/s was accepted");
    cr_assert(strstr(e.msg, "hw.json") && strstr(e.msg, "\"card.bf16_flops\": 0 is out of range"), "%s", e.msg);
    free(t);
    /* the presets' figures are all positive, and a plan on them predicts finite times */
    const char *names[] = {"atlas-800i-a2", "h800", "h100", "h200"};
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(pd_hardware_load(names[i], &h, &e), 0, "%s", e.msg);
        cr_assert_gt(h.bf16_flops, 0);
        cr_assert_gt(h.mem_bw_Bps, 0);
        cr_assert_gt(h.intra.bandwidth_Bps, 0);
        cr_assert_gt(h.rdma.bandwidth_Bps, 0);
    }
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    struct pd_plan p;
    cr_assert_eq(pd_plan_build(&o, &p, &e), 0, "%s", e.msg);
    struct pd_workload w;
    pd_workload_default(&w);
    struct pd_perf f;
    cr_assert_eq(pd_perf_eval(&p, &w, &f, &e), 0, "%s", e.msg);
    cr_assert(isfinite(f.ttft_s) && f.ttft_s > 0 && isfinite(f.tpot_s) && f.tpot_s > 0);
    pd_plan_free(&p);
}

Test(limits, a_model_too_large_overall_is_refused_by_name)
{
    /* three fields at their maximum: 65,536 experts of 2^20 x 2^20 */
    char *t = edit("models/v4-tiny.json", "\"n_routed_experts\": 16", "\"n_routed_experts\": 65536");
    const char *subs[][2] = {{"\"hidden_size\": 64", "\"hidden_size\": 1048576"},
                             {"\"moe_intermediate_size\": 32", "\"moe_intermediate_size\": 1048576"}};
    for (int i = 0; i < 2; i++) {
        char *at = strstr(t, subs[i][0]);
        cr_assert(at);
        char *n = malloc(strlen(t) + strlen(subs[i][1]) + 1);
        memcpy(n, t, (size_t)(at - t));
        strcpy(n + (at - t), subs[i][1]);
        strcat(n, at + strlen(subs[i][0]));
        free(t);
        t = n;
    }
    struct pd_model m;
    pd_err e = {0};
    cr_assert_eq(pd_model_parse(t, "big.json", &m, &e), 0, "each field is in range: %s", e.msg);
    struct pd_quant q;
    cr_assert_eq(pd_quant_init(&q, "bf16", NULL, 0, &e), 0, "%s", e.msg);
    struct pd_inventory inv;
    int rc = pd_inventory_build(&m, &q, 1, &inv, &e);
    cr_assert_eq(rc, PD_ERANGE, "rc %d: %s (routed expert bytes %lld)", rc, e.msg,
                 (long long)inv.class_bytes[PD_CLASS_I]);
    cr_assert(strstr(e.msg, "big.json") && strstr(e.msg, "too large") && strstr(e.msg, "ffn.experts"),
              "%s", e.msg);
    /* and through the planner, from a file */
    char path[] = "/tmp/pdmoe-big-XXXXXX";
    tmp_text(path, t);
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.model = path;
    o.hardware = "h100";
    struct pd_plan p;
    rc = pd_plan_build(&o, &p, &e);
    unlink(path);
    cr_assert_eq(rc, PD_ERANGE, "rc %d: %s", rc, e.msg);
    cr_assert(strstr(e.msg, path), "%s", e.msg);
    free(t);
}

Test(limits, expert_counts_that_sum_to_inf_are_refused)
{
    char stats[] = "/tmp/pdmoe-stats-XXXXXX";
    char row[4096];
    int n = snprintf(row, sizeof row, "[1e308,1e308");
    for (int x = 2; x < 16; x++)
        n += snprintf(row + n, sizeof row - (size_t)n, ",1");
    snprintf(row + n, sizeof row - (size_t)n, "]");
    tmp_stats_layers(stats, row, 4);   /* v4-tiny's 4 layers */
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.model = "v4-tiny";
    o.hardware = "h100";
    o.max_model_len = 1024;
    o.role[0] = (struct pd_role_opts){.dp = 2, .tp = 1, .instances = 1};
    o.role[1] = (struct pd_role_opts){.dp = 4, .tp = 1, .instances = 1};
    o.expert_stats = stats;
    struct pd_plan p;
    pd_err e = {0};
    int rc = pd_plan_build(&o, &p, &e);
    if (rc == 0) {
        double imb = p.role[1].imbalance;
        pd_plan_free(&p);
        unlink(stats);
        cr_assert_fail("accepted counts of 1e308: decode imbalance %g", imb);
    }
    unlink(stats);
    cr_assert(strstr(e.msg, stats) && strstr(e.msg, "tokens_per_expert[0][0]"), "%s", e.msg);
}

/* A file that cannot be parsed is a format error with its line, even when its own text says
 * "unable to open" (it was once taken for an I/O error by that phrase; found by fuzzing). */
Test(limits, a_syntax_error_is_not_an_io_error)
{
    char path[] = "/tmp/pdmoe-stats-XXXXXX";
    tmp_stats_rows(path, "\"unable to open\n");   /* jansson: unexpected newline near '"unable to open' */
    pd_err e = {0};
    cr_assert_null(pd_json_load_file(path, &e));
    cr_assert_eq(e.code, PD_EFORMAT, "%d: %s", e.code, e.msg);
    char want[64];
    snprintf(want, sizeof want, "%s:1:", path);
    cr_assert(strstr(e.msg, want), "%s", e.msg);
    unlink(path);
    cr_assert_null(pd_json_load_file(path, &e));
    cr_assert_eq(e.code, PD_EIO, "%d: %s", e.code, e.msg);
}

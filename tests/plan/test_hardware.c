/* Hardware files: presets load with their figures; a bad file names the field. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/config.h"
#include "plan/hardware.h"

Test(hardware, presets)
{
    const char *names[] = {"atlas-800i-a2", "h800", "h100", "h200"};
    for (size_t i = 0; i < 4; i++) {
        struct pd_hardware h;
        pd_err e = {0};
        cr_assert_eq(pd_hardware_load(names[i], &h, &e), 0, "%s: %s", names[i], e.msg);
        cr_assert_eq(h.cards_per_node, 8);
        cr_assert_gt(h.rdma.bandwidth_Bps, h.tcp.bandwidth_Bps);
    }
    struct pd_hardware h;
    pd_err e = {0};
    cr_assert_eq(pd_hardware_load("hardware/atlas-800i-a2.json", &h, &e), 0, "%s", e.msg);
    cr_assert_eq(h.card_memory_bytes, INT64_C(68719476736));   /* 64 GiB */
    cr_assert_eq(h.runtime_prefill_bytes, 1500000000);
    cr_assert_eq(h.runtime_decode_bytes, 2000000000);
    cr_assert_float_eq(h.rdma.bandwidth_Bps, 18e9, 1);
    cr_assert_eq(pd_hardware_load("h200", &h, &e), 0);
    cr_assert_eq(h.card_memory_bytes, INT64_C(143771) * 1024 * 1024);
}

/* The A3 counts dies as SGLang and vLLM-Ascend do (16 NPUs of 64 GiB on 8 cards of 128 GB, no
 * FP8 units, redundant experts allowed); the B200 is nvidia-smi's 183,359 MiB with the
 * datasheet's dense rates. */
Test(hardware, a3_and_b200)
{
    struct pd_hardware h;
    pd_err e = {0};
    cr_assert_eq(pd_hardware_load("atlas-800i-a3", &h, &e), 0, "%s", e.msg);
    cr_assert_eq(h.cards_per_node, 16);
    cr_assert_eq(h.card_memory_bytes * h.cards_per_node, INT64_C(8) * 128 << 30);
    cr_assert_eq(h.fp8_flops, 0);
    cr_assert(h.redundant_experts);
    cr_assert_float_eq(h.int8_ops, 2 * h.bf16_flops, 1);
    cr_assert_eq(pd_hardware_load("b200", &h, &e), 0, "%s", e.msg);
    cr_assert_eq(h.cards_per_node, 8);
    cr_assert_eq(h.card_memory_bytes, INT64_C(183359) * 1024 * 1024);
    cr_assert_float_eq(h.fp8_flops, 4.5e15, 1);
    cr_assert_float_eq(h.mem_bw_Bps, 7.7e12, 1);
    cr_assert_neq(pd_hardware_load("b300", &h, &e), 0);
    cr_assert(strstr(e.msg, "atlas-800i-a3") && strstr(e.msg, "b200"), "%s", e.msg);
}

static void bad(const char *text, const char *needle)
{
    struct pd_hardware h;
    pd_err e = {0};
    cr_assert_neq(pd_hardware_parse(text, "hw.json", &h, &e), 0, "accepted %s", text);
    cr_assert(strstr(e.msg, "hw.json") && strstr(e.msg, needle), "\"%s\" lacks \"%s\"", e.msg, needle);
}

Test(hardware, bad_files)
{
    bad("{", "hw.json:1:");
    bad("{\"name\":\"x\"}", "missing required field \"cards_per_node\"");
    bad("{\"name\":\"x\",\"cards_per_node\":0}", "\"cards_per_node\": 0 is out of range");
    bad("{\"name\":\"x\",\"cards_per_node\":8}", "missing required field \"card\"");
    bad("{\"name\":\"x\",\"cards_per_node\":8,\"card\":{\"name\":\"c\",\"memory_bytes\":-1}}",
        "\"card.memory_bytes\": -1 is out of range");
    bad("{\"name\":\"x\",\"cards_per_node\":8,\"card\":{\"name\":\"c\",\"memory_bytes\":1e9,"
        "\"memory_bandwidth_Bps\":1e12,\"bf16_flops\":1e14,\"int8_ops\":1e14},\"links\":{}}",
        "missing required field \"links.intra_node\"");
    bad("{\"name\":\"x\",\"cards_per_node\":8,\"card\":{\"name\":\"c\",\"memory_bytes\":1e9,"
        "\"memory_bandwidth_Bps\":1e12,\"bf16_flops\":1e14,\"int8_ops\":1e14},\"links\":{"
        "\"intra_node\":{\"name\":\"a\",\"bandwidth_Bps\":1e9,\"latency_s\":0},"
        "\"inter_node_rdma\":{\"name\":\"a\",\"bandwidth_Bps\":\"fast\",\"latency_s\":0}}}",
        "\"links.inter_node_rdma.bandwidth_Bps\": expected a number");
    /* an int8 rate of 1e-300 ops/s gave an infinite TTFT; 0 (no unit) falls back to bf16 */
    bad("{\"name\":\"x\",\"cards_per_node\":8,\"card\":{\"name\":\"c\",\"memory_bytes\":1e9,"
        "\"memory_bandwidth_Bps\":1e12,\"bf16_flops\":1e14,\"int8_ops\":1e-300}}",
        "\"card.int8_ops\": 1e-300 is neither 0 (no such unit) nor at least 1");
    bad("{\"name\":\"x\",\"cards_per_node\":8,\"card\":{\"name\":\"c\",\"memory_bytes\":1e9,"
        "\"memory_bandwidth_Bps\":1e12,\"bf16_flops\":1e14,\"int8_ops\":0,\"fp8_flops\":0.5}}",
        "\"card.fp8_flops\": 0.5 is neither 0");
}

/* Efficiency factors: required, in range, and each with its source (no hidden constants). */
static char *edit_file(const char *file, const char *from, const char *to)
{
    const char *text = pd_embedded_find(file);
    cr_assert(text);
    const char *at = strstr(text, from);
    cr_assert(at, "\"%s\" not in %s", from, file);
    char *out = malloc(strlen(text) + strlen(to) + 1);
    memcpy(out, text, (size_t)(at - text));
    strcpy(out + (at - text), to);
    strcat(out, at + strlen(from));
    return out;
}

static char *edit(const char *from, const char *to)
{
    return edit_file("hardware/h800.json", from, to);
}

Test(hardware, efficiency_factors)
{
    struct pd_hardware h;
    pd_err e = {0};
    cr_assert_eq(pd_hardware_load("h800", &h, &e), 0, "%s", e.msg);
    cr_assert_float_eq(h.eff.gemm, 0.78, 1e-12);
    cr_assert_float_eq(h.eff.mtp_acceptance, 0.85, 1e-12);
    cr_assert_float_eq(h.eff.request_s, 0.005, 1e-12);
    char *t = edit("\"request_s\": 0.005", "\"request_s_\": 0.005");
    bad(t, "\"efficiency.request_s\"");
    free(t);
    t = edit("\"efficiency\": {\n    \"gemm\"", "\"efficiencies\": {\n    \"gemm\"");
    bad(t, "missing required field \"efficiency\"");
    free(t);
    t = edit("\"gemm\": \"DeepGEMM", "\"gemm_\": \"DeepGEMM");
    bad(t, "\"sources.efficiency.gemm\": every efficiency factor needs its source");
    free(t);
    /* a key nothing reads: a misspelt optional field would be left at its default */
    t = edit("\"fp8_flops\": 1.979e15", "\"fp8_flop\": 1.979e15");
    bad(t, "\"card.fp8_flop\": unknown");
    free(t);
    t = edit("\"memory\": 0.9,", "\"memory\": 1.5,");
    bad(t, "\"efficiency.memory\": 1.5 is out of range");
    free(t);
    /* a stack without redundant experts must say why */
    cr_assert_eq(pd_hardware_load("h800", &h, &e), 0);
    cr_assert(h.redundant_experts);
    cr_assert_eq(pd_hardware_load("atlas-800i-a2", &h, &e), 0);
    cr_assert_not(h.redundant_experts);
    t = edit_file("hardware/atlas-800i-a2.json", "\"redundant_experts\": \"vllm-ascend", "\"redundant\": \"vllm-ascend");
    bad(t, "\"sources.redundant_experts\"");
    free(t);
    t = edit("\"imbalance_eplb_decode\": 1.2,", "");
    bad(t, "missing required field \"efficiency.imbalance_eplb_decode\"");
    free(t);
}

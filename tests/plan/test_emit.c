/* Launch scripts from a plan (src/plan/emit.c, emit_pdmoe.c): the seed's vllm-ascend script
 * pinned byte for byte, SGLang's key lines, instances sharing a node, tp > 1, --hosts and the
 * layouts emit refuses; the scripts run by a real sh against stand-in `vllm` and `python3`
 * programs; pdmoe's script on four CPU hosts, whose words are the argv `pdmoe up --plan --hosts`
 * builds from the plan's JSON. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/config.h"
#include "engine/spec.h"
#include "plan/emit.h"
#include "plan/hardware.h"
#include "plan/launch.h"
#include "plan/nodes.h"
#include "fixture.h"


static char *emit(const struct pd_plan *p, enum pd_emit_target t, const struct pd_emit_opts *o)
{
    pd_err e = {0};
    char *s = pd_emit(p, t, o, &e);
    cr_assert_not_null(s, "%s", e.msg);
    return s;
}

static int count(const char *s, const char *needle)
{
    int n = 0;
    for (const char *q = strstr(s, needle); q; q = strstr(q + 1, needle))
        n++;
    return n;
}

#define HAS(s, needle) cr_assert(strstr((s), (needle)), "missing \"%s\" in:\n%s", (needle), (s))
#define LACKS(s, needle) cr_assert_null(strstr((s), (needle)), "unexpected \"%s\"", (needle))

/* `pdmoe plan --emit vllm-ascend` with no other flag: the seed's 4 x EP8 prefill on node0-3, the
 * EP32 decode over node4-7 (node4 serves HTTP, the others are headless), the proxy on node0. */
static const char seed_vllm_ascend[] =
    "#!/bin/sh\n"
    "# vllm-ascend launch commands from `pdmoe plan --emit vllm-ascend`:\n"
    "# deepseek-v4-flash on 8 nodes of 8 Ascend 910B 64 GB (Atlas 800I A2),\n"
    "# prefill 4 x (dp 8, tp 1), decode 1 x (dp 32, tp 1); model path $MODEL_PATH\n"
    "# (a W8A8 conversion of deepseek-ai/DeepSeek-V4-Flash).\n"
    "# Copy this file to every node and run `sh FILE HOST` there, HOST being the node's name\n"
    "# below: it starts that node's servers in the background and waits. The proxy listens on\n"
    "# node0:8000. What each flag comes from and what is left to fill in: pdmoe's docs/emit.md.\n"
    "set -e\n"
    "host=${1:?usage: sh FILE HOST (node0 ... node7)}\n"
    "case \"$host\" in\n"
    "node0|node1|node2|node3|node4|node5|node6|node7) ;;\n"
    "*) echo \"$0: $host is not a node of this deployment (node0 ... node7)\" >&2; exit 2 ;;\n"
    "esac\n"
    "\n"
    "# Environment of vllm-ascend's multi-node PD tutorials (pd_disaggregation_mooncake_multi_node\n"
    "# and DeepSeek-V4-Flash on Atlas 800 A2), on every node.\n"
    ": \"${NIC_NAME:?set NIC_NAME to the network interface that connects the nodes, e.g. "
        "enp67s0f0np0}\"\n"
    "local_ip=${LOCAL_IP:-$(hostname -I | awk '{print $1}')}\n"
    "export HCCL_IF_IP=\"$local_ip\"\n"
    "export GLOO_SOCKET_IFNAME=\"$NIC_NAME\" TP_SOCKET_IFNAME=\"$NIC_NAME\" "
        "HCCL_SOCKET_IFNAME=\"$NIC_NAME\"\n"
    "export OMP_PROC_BIND=false OMP_NUM_THREADS=10 PYTORCH_NPU_ALLOC_CONF=expandable_segments:True\n"
    "export HCCL_BUFFSIZE=1024 HCCL_OP_EXPANSION_MODE=AIV TASK_QUEUE_ENABLE=1\n"
    "export HCCL_EXEC_TIMEOUT=204 HCCL_CONNECT_TIMEOUT=1200\n"
    "export VLLM_RPC_TIMEOUT=3600000 VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=30000\n"
    "\n"
    "# The plan is W8A8: the servers load an int8 conversion of deepseek-ai/DeepSeek-V4-Flash (msmodelslim's\n"
    "# output; vllm-ascend's DeepSeek-V4-Flash tutorial downloads DeepSeek-V4-Flash-w8a8-mtp), with "
        "--quantization ascend.\n"
    "[ -n \"${MODEL_PATH:-}\" ] || { echo 'set MODEL_PATH to the W8A8 (msmodelslim) checkpoint of "
        "deepseek-ai/DeepSeek-V4-Flash, e.g. DeepSeek-V4-Flash-w8a8-mtp' >&2; exit 2; }\n"
    "\n"
    "# prefill instance 0 on node0 (node 1 of 1): cards 0-7, dp ranks 0-7 of 8\n"
    "# 29 sequences per data-parallel rank, not the plan's --max-num-seqs 30: 29 of max-model-len\n"
    "# 32768 fit this prefill card's KV pool beside its chunks in flight "
        "(pdmoe plan: \"sequences of max-model-len that fit\")\n"
    "if [ \"$host\" = node0 ]; then\n"
    "  ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 vllm serve \"$MODEL_PATH\" \\\n"
    "    --host 0.0.0.0 \\\n"
    "    --port 8100 \\\n"
    "    --data-parallel-size 8 \\\n"
    "    --data-parallel-size-local 8 \\\n"
    "    --data-parallel-address node0 \\\n"
    "    --data-parallel-rpc-port 13345 \\\n"
    "    --tensor-parallel-size 1 \\\n"
    "    --enable-expert-parallel \\\n"
    "    --quantization ascend \\\n"
    "    --gpu-memory-utilization 0.9 \\\n"
    "    --max-num-seqs 29 \\\n"
    "    --max-model-len 32768 \\\n"
    "    --block-size 128 \\\n"
    "    --max-num-batched-tokens 4096 \\\n"
    "    --speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":1,\"enforce_eager\":true}' \\\n"
    "    --enforce-eager \\\n"
    "    --no-disable-hybrid-kv-cache-manager \\\n"
    "    --kv-transfer-config '{\"kv_connector\":\"MooncakeHybridConnector\",\"kv_role\":\"kv_producer\","
        "\"kv_port\":\"30000\",\"engine_id\":\"0\",\"kv_connector_extra_config\":{\"prefill\":{\"dp_size\":8,"
        "\"tp_size\":1},\"decode\":{\"dp_size\":32,\"tp_size\":1}}}' &\n"
    "fi\n"
    "\n"
    "# prefill instance 1 on node1 (node 1 of 1): cards 0-7, dp ranks 0-7 of 8\n"
    "# 29 sequences per data-parallel rank, not the plan's --max-num-seqs 30: 29 of max-model-len\n"
    "# 32768 fit this prefill card's KV pool beside its chunks in flight "
        "(pdmoe plan: \"sequences of max-model-len that fit\")\n"
    "if [ \"$host\" = node1 ]; then\n"
    "  ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 vllm serve \"$MODEL_PATH\" \\\n"
    "    --host 0.0.0.0 \\\n"
    "    --port 8100 \\\n"
    "    --data-parallel-size 8 \\\n"
    "    --data-parallel-size-local 8 \\\n"
    "    --data-parallel-address node1 \\\n"
    "    --data-parallel-rpc-port 13345 \\\n"
    "    --tensor-parallel-size 1 \\\n"
    "    --enable-expert-parallel \\\n"
    "    --quantization ascend \\\n"
    "    --gpu-memory-utilization 0.9 \\\n"
    "    --max-num-seqs 29 \\\n"
    "    --max-model-len 32768 \\\n"
    "    --block-size 128 \\\n"
    "    --max-num-batched-tokens 4096 \\\n"
    "    --speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":1,\"enforce_eager\":true}' \\\n"
    "    --enforce-eager \\\n"
    "    --no-disable-hybrid-kv-cache-manager \\\n"
    "    --kv-transfer-config '{\"kv_connector\":\"MooncakeHybridConnector\",\"kv_role\":\"kv_producer\","
        "\"kv_port\":\"30100\",\"engine_id\":\"1\",\"kv_connector_extra_config\":{\"prefill\":{\"dp_size\":8,"
        "\"tp_size\":1},\"decode\":{\"dp_size\":32,\"tp_size\":1}}}' &\n"
    "fi\n"
    "\n"
    "# prefill instance 2 on node2 (node 1 of 1): cards 0-7, dp ranks 0-7 of 8\n"
    "# 29 sequences per data-parallel rank, not the plan's --max-num-seqs 30: 29 of max-model-len\n"
    "# 32768 fit this prefill card's KV pool beside its chunks in flight "
        "(pdmoe plan: \"sequences of max-model-len that fit\")\n"
    "if [ \"$host\" = node2 ]; then\n"
    "  ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 vllm serve \"$MODEL_PATH\" \\\n"
    "    --host 0.0.0.0 \\\n"
    "    --port 8100 \\\n"
    "    --data-parallel-size 8 \\\n"
    "    --data-parallel-size-local 8 \\\n"
    "    --data-parallel-address node2 \\\n"
    "    --data-parallel-rpc-port 13345 \\\n"
    "    --tensor-parallel-size 1 \\\n"
    "    --enable-expert-parallel \\\n"
    "    --quantization ascend \\\n"
    "    --gpu-memory-utilization 0.9 \\\n"
    "    --max-num-seqs 29 \\\n"
    "    --max-model-len 32768 \\\n"
    "    --block-size 128 \\\n"
    "    --max-num-batched-tokens 4096 \\\n"
    "    --speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":1,\"enforce_eager\":true}' \\\n"
    "    --enforce-eager \\\n"
    "    --no-disable-hybrid-kv-cache-manager \\\n"
    "    --kv-transfer-config '{\"kv_connector\":\"MooncakeHybridConnector\",\"kv_role\":\"kv_producer\","
        "\"kv_port\":\"30200\",\"engine_id\":\"2\",\"kv_connector_extra_config\":{\"prefill\":{\"dp_size\":8,"
        "\"tp_size\":1},\"decode\":{\"dp_size\":32,\"tp_size\":1}}}' &\n"
    "fi\n"
    "\n"
    "# prefill instance 3 on node3 (node 1 of 1): cards 0-7, dp ranks 0-7 of 8\n"
    "# 29 sequences per data-parallel rank, not the plan's --max-num-seqs 30: 29 of max-model-len\n"
    "# 32768 fit this prefill card's KV pool beside its chunks in flight "
        "(pdmoe plan: \"sequences of max-model-len that fit\")\n"
    "if [ \"$host\" = node3 ]; then\n"
    "  ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 vllm serve \"$MODEL_PATH\" \\\n"
    "    --host 0.0.0.0 \\\n"
    "    --port 8100 \\\n"
    "    --data-parallel-size 8 \\\n"
    "    --data-parallel-size-local 8 \\\n"
    "    --data-parallel-address node3 \\\n"
    "    --data-parallel-rpc-port 13345 \\\n"
    "    --tensor-parallel-size 1 \\\n"
    "    --enable-expert-parallel \\\n"
    "    --quantization ascend \\\n"
    "    --gpu-memory-utilization 0.9 \\\n"
    "    --max-num-seqs 29 \\\n"
    "    --max-model-len 32768 \\\n"
    "    --block-size 128 \\\n"
    "    --max-num-batched-tokens 4096 \\\n"
    "    --speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":1,\"enforce_eager\":true}' \\\n"
    "    --enforce-eager \\\n"
    "    --no-disable-hybrid-kv-cache-manager \\\n"
    "    --kv-transfer-config '{\"kv_connector\":\"MooncakeHybridConnector\",\"kv_role\":\"kv_producer\","
        "\"kv_port\":\"30300\",\"engine_id\":\"3\",\"kv_connector_extra_config\":{\"prefill\":{\"dp_size\":8,"
        "\"tp_size\":1},\"decode\":{\"dp_size\":32,\"tp_size\":1}}}' &\n"
    "fi\n"
    "\n"
    "# decode instance 0 on node4 (node 1 of 4): cards 0-7, dp ranks 0-7 of 32\n"
    "if [ \"$host\" = node4 ]; then\n"
    "  ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 vllm serve \"$MODEL_PATH\" \\\n"
    "    --host 0.0.0.0 \\\n"
    "    --port 8100 \\\n"
    "    --data-parallel-size 32 \\\n"
    "    --data-parallel-size-local 8 \\\n"
    "    --data-parallel-address node4 \\\n"
    "    --data-parallel-rpc-port 13345 \\\n"
    "    --tensor-parallel-size 1 \\\n"
    "    --enable-expert-parallel \\\n"
    "    --quantization ascend \\\n"
    "    --gpu-memory-utilization 0.9 \\\n"
    "    --max-num-seqs 30 \\\n"
    "    --max-model-len 32768 \\\n"
    "    --block-size 128 \\\n"
    "    --max-num-batched-tokens 60 \\\n"
    "    --speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":1,\"enforce_eager\":true}' \\\n"
    "    --compilation-config '{\"cudagraph_mode\":\"FULL_DECODE_ONLY\"}' \\\n"
    "    --additional-config '{\"recompute_scheduler_enable\":true}' \\\n"
    "    --no-disable-hybrid-kv-cache-manager \\\n"
    "    --kv-transfer-config '{\"kv_connector\":\"MooncakeHybridConnector\",\"kv_role\":\"kv_consumer\","
        "\"kv_port\":\"30400\",\"engine_id\":\"4\",\"kv_connector_extra_config\":{\"prefill\":{\"dp_size\":8,"
        "\"tp_size\":1},\"decode\":{\"dp_size\":32,\"tp_size\":1}}}' &\n"
    "fi\n"
    "\n"
    "# decode instance 0 on node5 (node 2 of 4, headless): cards 0-7, dp ranks 8-15 of 32\n"
    "if [ \"$host\" = node5 ]; then\n"
    "  ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 vllm serve \"$MODEL_PATH\" \\\n"
    "    --headless \\\n"
    "    --data-parallel-size 32 \\\n"
    "    --data-parallel-size-local 8 \\\n"
    "    --data-parallel-start-rank 8 \\\n"
    "    --data-parallel-address node4 \\\n"
    "    --data-parallel-rpc-port 13345 \\\n"
    "    --tensor-parallel-size 1 \\\n"
    "    --enable-expert-parallel \\\n"
    "    --quantization ascend \\\n"
    "    --gpu-memory-utilization 0.9 \\\n"
    "    --max-num-seqs 30 \\\n"
    "    --max-model-len 32768 \\\n"
    "    --block-size 128 \\\n"
    "    --max-num-batched-tokens 60 \\\n"
    "    --speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":1,\"enforce_eager\":true}' \\\n"
    "    --compilation-config '{\"cudagraph_mode\":\"FULL_DECODE_ONLY\"}' \\\n"
    "    --additional-config '{\"recompute_scheduler_enable\":true}' \\\n"
    "    --no-disable-hybrid-kv-cache-manager \\\n"
    "    --kv-transfer-config '{\"kv_connector\":\"MooncakeHybridConnector\",\"kv_role\":\"kv_consumer\","
        "\"kv_port\":\"30400\",\"engine_id\":\"4\",\"kv_connector_extra_config\":{\"prefill\":{\"dp_size\":8,"
        "\"tp_size\":1},\"decode\":{\"dp_size\":32,\"tp_size\":1}}}' &\n"
    "fi\n"
    "\n"
    "# decode instance 0 on node6 (node 3 of 4, headless): cards 0-7, dp ranks 16-23 of 32\n"
    "if [ \"$host\" = node6 ]; then\n"
    "  ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 vllm serve \"$MODEL_PATH\" \\\n"
    "    --headless \\\n"
    "    --data-parallel-size 32 \\\n"
    "    --data-parallel-size-local 8 \\\n"
    "    --data-parallel-start-rank 16 \\\n"
    "    --data-parallel-address node4 \\\n"
    "    --data-parallel-rpc-port 13345 \\\n"
    "    --tensor-parallel-size 1 \\\n"
    "    --enable-expert-parallel \\\n"
    "    --quantization ascend \\\n"
    "    --gpu-memory-utilization 0.9 \\\n"
    "    --max-num-seqs 30 \\\n"
    "    --max-model-len 32768 \\\n"
    "    --block-size 128 \\\n"
    "    --max-num-batched-tokens 60 \\\n"
    "    --speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":1,\"enforce_eager\":true}' \\\n"
    "    --compilation-config '{\"cudagraph_mode\":\"FULL_DECODE_ONLY\"}' \\\n"
    "    --additional-config '{\"recompute_scheduler_enable\":true}' \\\n"
    "    --no-disable-hybrid-kv-cache-manager \\\n"
    "    --kv-transfer-config '{\"kv_connector\":\"MooncakeHybridConnector\",\"kv_role\":\"kv_consumer\","
        "\"kv_port\":\"30400\",\"engine_id\":\"4\",\"kv_connector_extra_config\":{\"prefill\":{\"dp_size\":8,"
        "\"tp_size\":1},\"decode\":{\"dp_size\":32,\"tp_size\":1}}}' &\n"
    "fi\n"
    "\n"
    "# decode instance 0 on node7 (node 4 of 4, headless): cards 0-7, dp ranks 24-31 of 32\n"
    "if [ \"$host\" = node7 ]; then\n"
    "  ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 vllm serve \"$MODEL_PATH\" \\\n"
    "    --headless \\\n"
    "    --data-parallel-size 32 \\\n"
    "    --data-parallel-size-local 8 \\\n"
    "    --data-parallel-start-rank 24 \\\n"
    "    --data-parallel-address node4 \\\n"
    "    --data-parallel-rpc-port 13345 \\\n"
    "    --tensor-parallel-size 1 \\\n"
    "    --enable-expert-parallel \\\n"
    "    --quantization ascend \\\n"
    "    --gpu-memory-utilization 0.9 \\\n"
    "    --max-num-seqs 30 \\\n"
    "    --max-model-len 32768 \\\n"
    "    --block-size 128 \\\n"
    "    --max-num-batched-tokens 60 \\\n"
    "    --speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":1,\"enforce_eager\":true}' \\\n"
    "    --compilation-config '{\"cudagraph_mode\":\"FULL_DECODE_ONLY\"}' \\\n"
    "    --additional-config '{\"recompute_scheduler_enable\":true}' \\\n"
    "    --no-disable-hybrid-kv-cache-manager \\\n"
    "    --kv-transfer-config '{\"kv_connector\":\"MooncakeHybridConnector\",\"kv_role\":\"kv_consumer\","
        "\"kv_port\":\"30400\",\"engine_id\":\"4\",\"kv_connector_extra_config\":{\"prefill\":{\"dp_size\":8,"
        "\"tp_size\":1},\"decode\":{\"dp_size\":32,\"tp_size\":1}}}' &\n"
    "fi\n"
    "\n"
    "# proxy on node0: vllm-ascend's examples/disaggregated_prefill_v1/"
        "load_balance_proxy_server_example.py\n"
    "if [ \"$host\" = node0 ]; then\n"
    "  python3 load_balance_proxy_server_example.py \\\n"
    "    --host 0.0.0.0 \\\n"
    "    --port 8000 \\\n"
    "    --prefiller-hosts node0 node1 node2 node3 \\\n"
    "    --prefiller-ports 8100 8100 8100 8100 \\\n"
    "    --decoder-hosts node4 \\\n"
    "    --decoder-ports 8100 &\n"
    "fi\n"
    "\n"
    "wait\n";

Test(plan, emit_vllm_ascend_seed_script)
{
    struct pd_plan p;
    seed_plan(&p);
    char *s = emit(&p, PD_EMIT_VLLM_ASCEND, NULL);
    cr_assert_str_eq(s, seed_vllm_ascend);
    int nodes = 0;
    pd_err e = {0};
    cr_assert_eq(pd_emit_nodes(&p, &nodes, &e), 0, "%s", e.msg);
    cr_assert_eq(nodes, 8);
    free(s);
    pd_plan_free(&p);
}

/* Every --kv-transfer-config is JSON with the fields vllm-ascend reads: one engine_id and kv_port
 * per instance (shared by the nodes of a multi-node instance), producer on P, consumer on D. */
Test(plan, emit_vllm_ascend_kv_transfer_config_is_json)
{
    struct pd_plan p;
    seed_plan(&p);
    char *s = emit(&p, PD_EMIT_VLLM_ASCEND, NULL);
    const char *key = "--kv-transfer-config '";
    int n = 0, producers = 0;
    for (const char *q = strstr(s, key); q; q = strstr(q + 1, key), n++) {
        const char *a = q + strlen(key), *b = strchr(a, '\'');
        cr_assert_not_null(b);
        json_error_t je;
        json_t *j = json_loadb(a, (size_t)(b - a), 0, &je);
        cr_assert_not_null(j, "%s", je.text);
        const char *role = json_string_value(json_object_get(j, "kv_role"));
        const char *id = json_string_value(json_object_get(j, "engine_id"));
        const char *port = json_string_value(json_object_get(j, "kv_port"));
        cr_assert_not_null(role);
        cr_assert_not_null(id);
        cr_assert_not_null(port);
        int inst = n < 4 ? n : 4;   /* commands 0-3: prefill 0-3; 4-7: the decode instance's nodes */
        cr_assert_eq(atoi(id), inst);
        cr_assert_eq(atoi(port), 30000 + 100 * inst);
        cr_assert_str_eq(role, n < 4 ? "kv_producer" : "kv_consumer");
        producers += n < 4;
        json_t *x = json_object_get(j, "kv_connector_extra_config");
        cr_assert_eq(json_integer_value(json_object_get(json_object_get(x, "prefill"), "dp_size")), 8);
        cr_assert_eq(json_integer_value(json_object_get(json_object_get(x, "decode"), "dp_size")), 32);
        cr_assert_eq(json_integer_value(json_object_get(json_object_get(x, "decode"), "tp_size")), 1);
        json_decref(j);
    }
    cr_assert_eq(n, 8);
    cr_assert_eq(producers, 4);
    free(s);
    pd_plan_free(&p);
}

Test(plan, emit_sglang_seed_key_lines)
{
    struct pd_plan p;
    seed_plan(&p);
    char *s = emit(&p, PD_EMIT_SGLANG, NULL);
    cr_assert_eq(strncmp(s, "#!/bin/sh\n# sglang launch commands", 34), 0);
    cr_assert_eq(count(s, "python3 -m sglang.launch_server"), 8);
    cr_assert_eq(count(s, "--disaggregation-mode prefill"), 4);
    cr_assert_eq(count(s, "--disaggregation-mode decode"), 4);
    cr_assert_eq(count(s, "--disaggregation-transfer-backend mooncake"), 8);
    cr_assert_eq(count(s, "--disaggregation-bootstrap-port 8998"), 4);
    /* a W8A8 plan on Ascend: msmodelslim's checkpoint, which the script requires by name */
    cr_assert_eq(count(s, "--model-path \"$MODEL_PATH\""), 8);
    cr_assert_eq(count(s, "    --quantization modelslim \\\n"), 8);
    HAS(s, "{ echo 'set MODEL_PATH to the W8A8 (msmodelslim) checkpoint of deepseek-ai/DeepSeek-V4-Flash");
    /* one prefill instance: 8 cards, DP attention over 8, EP over 8, on one node */
    HAS(s, "    --nnodes 1 \\\n    --node-rank 0 \\\n    --tp-size 8 \\\n    --dp-size 8 \\\n"
           "    --enable-dp-attention \\\n    --ep-size 8 \\\n    --moe-a2a-backend deepep \\\n");
    /* the decode instance: 4 nodes, rendezvous on its first node */
    for (int k = 0; k < 4; k++) {
        char want[256];
        snprintf(want, sizeof want, "# decode instance 0 on node%d (node %d of 4): cards 0-7, dp ranks %d-%d of 32\n",
                 4 + k, k + 1, 8 * k, 8 * k + 7);
        HAS(s, want);
        snprintf(want, sizeof want, "    --nnodes 4 \\\n    --node-rank %d \\\n    --dist-init-addr node4:5000 \\\n"
                 "    --tp-size 32 \\\n    --dp-size 32 \\\n    --enable-dp-attention \\\n    --ep-size 32 \\\n", k);
        HAS(s, want);
    }
    /* SGLang's limits are per instance, vLLM's per data-parallel rank */
    /* prefill: the plan's 29 of max-model-len beside its chunks in flight (28 while the fraction was
     * rounded down to a hundredth, whose pool held one fewer) */
    cr_assert_eq(pd_plan_admitted_seqs(&p, PD_ROLE_PREFILL), 29);
    cr_assert_eq(count(s, "--max-running-requests 232"), 4);
    cr_assert_eq(count(s, "--max-running-requests 960"), 4);
    cr_assert_eq(count(s, "--chunked-prefill-size 32768"), 4);
    cr_assert_eq(count(s, "--context-length 32768"), 8);
    /* weights + KV pool of the plan's card budget over the card's memory, rounded down: to a
     * hundredth where that pool holds the role's sequences (decode), else to the fewest decimals
     * that hold them (prefill: 0.855) */
    for (int r = 0; r < 2; r++) {
        const struct pd_budget *b = &p.role[r].b;
        double f = (double)(b->usable - b->activations - b->runtime) / (double)b->capacity;
        char want[64];
        const int digits = r ? 2 : 3;   /* prefill: 0.85's pool holds 28 */
        const double scale = r ? 100 : 1000;
        snprintf(want, sizeof want, "--mem-fraction-static %.*f \\", digits, (double)(long long)(f * scale) / scale);
        cr_assert_eq(count(s, want), 4, "%s", want);
        cr_assert(f > 0.8 && f < 0.9, "%f", f);
    }
    /* Ascend cards: SGLang's NPU device and Mooncake's Ascend transport */
    cr_assert_eq(count(s, "--device npu"), 8);
    HAS(s, "\nexport ENABLE_ASCEND_TRANSFER_WITH_MOONCAKE=true\n");
    LACKS(s, "--base-gpu-id");
    HAS(s, "  python3 -m sglang_router.launch_router \\\n    --pd-disaggregation \\\n"
           "    --prefill http://node0:8100 8998 \\\n    --prefill http://node1:8100 8998 \\\n"
           "    --prefill http://node2:8100 8998 \\\n    --prefill http://node3:8100 8998 \\\n"
           "    --decode http://node4:8100 \\\n    --host 0.0.0.0 \\\n    --port 8000 &\nfi\n\nwait\n");
    free(s);
    pd_plan_free(&p);
}

/* The numbers a script gives a server hold in the pool the script gives it: SGLang's
 * --max-running-requests in the KV pool of its rounded-down --mem-fraction-static (the unrounded
 * pool's count let one sequence too many in: 86 where 85 fit), vLLM's --gpu-memory-utilization
 * the value planned with (%g printed 0.906808 for 0.9068082711657849: one sequence fewer fit). */
Test(plan, emit_limits_fit_the_pools_the_scripts_make)
{
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.max_num_seqs = 400;
    struct pd_plan p;
    build(&o, &p);
    char *s = emit(&p, PD_EMIT_SGLANG, NULL);
    const int64_t seq = pd_kv_seq_bytes(&p.kv, p.o.max_model_len);
    for (int r = 0; r < 2; r++) {
        char key[64];
        snprintf(key, sizeof key, "--disaggregation-mode %s", r ? "decode" : "prefill");
        const char *at = strstr(s, key);
        cr_assert_not_null(at);
        const char *fr = strstr(at, "--mem-fraction-static "), *mr = strstr(at, "--max-running-requests ");
        cr_assert(fr && mr);
        double frac = atof(fr + strlen("--mem-fraction-static "));
        long long reqs = atoll(mr + strlen("--max-running-requests ")) / p.role[r].o.dp;
        const int64_t pool = (int64_t)(frac * (double)p.role[r].b.capacity) - p.role[r].b.weights -
                             p.role[r].b.kv_transient;
        cr_assert_leq(reqs * seq, pool, "%s: %lld sequences of %lld bytes in a pool of %lld at fraction %.2f",
                      pd_role_name((enum pd_role)r), reqs, (long long)seq, (long long)pool, frac);
        cr_assert_gt((reqs + 1) * seq, pool, "%s: %lld sequences where one more fits", pd_role_name((enum pd_role)r),
                     reqs);
    }
    free(s);
    pd_plan_free(&p);
    o.max_num_seqs = 282;
    o.util = 0.9068082711657849;
    build(&o, &p);
    s = emit(&p, PD_EMIT_VLLM_ASCEND, NULL);
    HAS(s, "--gpu-memory-utilization 0.9068082711657849 \\\n");
    free(s);
    pd_plan_free(&p);
}

Test(plan, emit_sglang_on_nvidia_has_no_npu_flags)
{
    struct pd_plan_opts o;
    struct pd_plan p;
    pd_plan_opts_default(&o);
    o.hardware = "h200";
    o.nodes = 4;
    o.role[PD_ROLE_PREFILL] = (struct pd_role_opts){.dp = 8, .tp = 1, .instances = 2};
    o.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 16, .tp = 1, .instances = 1};
    build(&o, &p);
    char *s = emit(&p, PD_EMIT_SGLANG, NULL);
    LACKS(s, "--device npu");
    LACKS(s, "ASCEND");
    HAS(s, "--dist-init-addr node2:5000");
    /* the plan's w8a8 weights are not what SGLang loads on GPUs (the release's FP8 and FP4): said */
    HAS(s, "# The plan sized w8a8 weights; SGLang loads deepseek-ai/DeepSeek-V4-Flash in the formats it was released in\n");
    pd_err e = {0};
    cr_assert_null(pd_emit(&p, PD_EMIT_VLLM_ASCEND, NULL, &e));
    cr_assert_eq(e.code, PD_EINVAL);
    cr_assert(strstr(e.msg, "not Ascend NPUs"), "%s", e.msg);
    free(s);
    pd_plan_free(&p);
}

/* Two prefill instances of 4 cards share node0: card masks, ports 10 apart, their own kv_port. */
Test(plan, emit_instances_smaller_than_a_node_share_it)
{
    struct pd_plan_opts o;
    struct pd_plan p;
    pd_plan_opts_default(&o);
    o.role[PD_ROLE_PREFILL] = (struct pd_role_opts){.dp = 4, .tp = 1, .instances = 2};
    /* dp 4 puts 64 int8 experts on a card: the weights do not fit, and emit refuses to launch it */
    build(&o, &p);
    pd_err e = {0};
    cr_assert_null(pd_emit(&p, PD_EMIT_VLLM_ASCEND, NULL, &e));
    cr_assert(strstr(e.msg, "prefill: the weights do not fit a card (22.95 GB over its usable memory)"), "%s", e.msg);
    pd_plan_free(&p);
    /* v4-flash-mini's do, on the same layout */
    o.model = "v4-flash-mini";
    build(&o, &p);
    int nodes = 0;
    cr_assert_eq(pd_emit_nodes(&p, &nodes, &e), 0, "%s", e.msg);
    cr_assert_eq(nodes, 5);

    char *s = emit(&p, PD_EMIT_VLLM_ASCEND, NULL);
    HAS(s, "# prefill instance 0 on node0 (node 1 of 1): cards 0-3, dp ranks 0-3 of 4\n"
           "if [ \"$host\" = node0 ]; then\n"
           "  ASCEND_RT_VISIBLE_DEVICES=0,1,2,3 vllm serve \"$MODEL_PATH\" \\\n"
           "    --host 0.0.0.0 \\\n    --port 8100 \\\n");
    HAS(s, "# prefill instance 1 on node0 (node 1 of 1): cards 4-7, dp ranks 0-3 of 4\n"
           "if [ \"$host\" = node0 ]; then\n"
           "  ASCEND_RT_VISIBLE_DEVICES=4,5,6,7 vllm serve \"$MODEL_PATH\" \\\n"
           "    --host 0.0.0.0 \\\n    --port 8110 \\\n");
    HAS(s, "--data-parallel-address node0 \\\n    --data-parallel-rpc-port 13355 \\\n");
    HAS(s, "\"kv_port\":\"30100\",\"engine_id\":\"1\"");
    HAS(s, "\"kv_role\":\"kv_consumer\",\"kv_port\":\"30200\",\"engine_id\":\"2\"");
    HAS(s, "# decode instance 0 on node1 (node 1 of 4): cards 0-7, dp ranks 0-7 of 32\n");
    HAS(s, "# decode instance 0 on node4 (node 4 of 4, headless): cards 0-7, dp ranks 24-31 of 32\n");
    HAS(s, "    --prefiller-hosts node0 node0 \\\n    --prefiller-ports 8100 8110 \\\n"
           "    --decoder-hosts node1 \\\n    --decoder-ports 8100 &\n");
    free(s);

    s = emit(&p, PD_EMIT_SGLANG, NULL);
    HAS(s, "    --port 8110 \\\n    --disaggregation-mode prefill \\\n    --disaggregation-transfer-backend mooncake \\\n"
           "    --disaggregation-bootstrap-port 9008 \\\n");
    cr_assert_eq(count(s, "--base-gpu-id 4"), 1);
    HAS(s, "    --prefill http://node0:8100 8998 \\\n    --prefill http://node0:8110 9008 \\\n"
           "    --decode http://node1:8100 \\\n");
    free(s);
    pd_plan_free(&p);
}

/* Each node of a 32-card decode instance of tp 4 runs 2 data-parallel ranks of 4 cards. */
Test(plan, emit_tensor_parallel)
{
    struct pd_plan_opts o;
    struct pd_plan p;
    pd_plan_opts_default(&o);
    o.role[PD_ROLE_PREFILL] = (struct pd_role_opts){.dp = 2, .tp = 4, .instances = 4};
    o.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 8, .tp = 4, .instances = 1};
    build(&o, &p);
    char *s = emit(&p, PD_EMIT_VLLM_ASCEND, NULL);
    cr_assert_eq(count(s, "--tensor-parallel-size 4"), 8);
    cr_assert_eq(count(s, "--data-parallel-size 2 \\\n    --data-parallel-size-local 2 \\\n"), 4);
    HAS(s, "# decode instance 0 on node7 (node 4 of 4, headless): cards 0-7, dp ranks 6-7 of 8 x tp 4\n");
    HAS(s, "    --headless \\\n    --data-parallel-size 8 \\\n    --data-parallel-size-local 2 \\\n"
           "    --data-parallel-start-rank 6 \\\n    --data-parallel-address node4 \\\n");
    cr_assert_eq(count(s, "\"kv_connector_extra_config\":{\"prefill\":{\"dp_size\":2,\"tp_size\":4},"
                          "\"decode\":{\"dp_size\":8,\"tp_size\":4}}"), 8);
    free(s);

    s = emit(&p, PD_EMIT_SGLANG, NULL);
    cr_assert_eq(count(s, "--tp-size 8 \\\n    --dp-size 2 \\\n    --enable-dp-attention \\\n    --ep-size 8 \\\n"), 4);
    cr_assert_eq(count(s, "--tp-size 32 \\\n    --dp-size 8 \\\n    --enable-dp-attention \\\n    --ep-size 32 \\\n"), 4);
    cr_assert_eq(count(s, "--chunked-prefill-size 8192"), 4);
    cr_assert_eq(count(s, "--max-running-requests 60"), 4);
    cr_assert_eq(count(s, "--max-running-requests 240"), 4);
    free(s);
    pd_plan_free(&p);
}

Test(plan, emit_hosts)
{
    struct pd_plan p;
    seed_plan(&p);
    struct pd_emit_opts o;
    pd_emit_opts_default(&o);
    pd_err e = {0};

    const char *three[] = {"10.0.0.1", "10.0.0.2", "10.0.0.3"};
    o.hosts = three;
    o.n_hosts = 3;
    cr_assert_null(pd_emit(&p, PD_EMIT_VLLM_ASCEND, &o, &e));
    cr_assert_eq(e.code, PD_EINVAL);
    cr_assert_str_eq(e.msg, "--hosts: 3 given but the layout needs 8 nodes (prefill on nodes 0-3, decode on nodes 4-7)");

    /* more hosts than nodes: the extra ones are unused */
    const char *nine[] = {"10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5",
                          "10.0.0.6", "10.0.0.7", "10.0.0.8", "spare"};
    o.hosts = nine;
    o.n_hosts = 9;
    char *s = emit(&p, PD_EMIT_VLLM_ASCEND, &o);
    HAS(s, "\n10.0.0.1|10.0.0.2|10.0.0.3|10.0.0.4|10.0.0.5|10.0.0.6|10.0.0.7|10.0.0.8) ;;\n");
    HAS(s, "# decode instance 0 on 10.0.0.6 (node 2 of 4, headless)");
    cr_assert_eq(count(s, "--data-parallel-address 10.0.0.5"), 4);
    HAS(s, "--prefiller-hosts 10.0.0.1 10.0.0.2 10.0.0.3 10.0.0.4 \\\n");
    HAS(s, "--decoder-hosts 10.0.0.5 \\\n");
    LACKS(s, "spare");
    LACKS(s, "node0");
    free(s);
    s = emit(&p, PD_EMIT_SGLANG, &o);
    HAS(s, "--dist-init-addr 10.0.0.5:5000");
    HAS(s, "--prefill http://10.0.0.4:8100 8998");
    free(s);

    const char *twice[] = {"a", "b", "c", "d", "e", "f", "g", "a"};
    o.hosts = twice;
    o.n_hosts = 8;
    cr_assert_null(pd_emit(&p, PD_EMIT_SGLANG, &o, &e));
    cr_assert(strstr(e.msg, "--hosts: a is listed twice"), "%s", e.msg);

    const char *bad[] = {"a", "b;rm", "c", "d", "e", "f", "g", "h"};
    o.hosts = bad;
    cr_assert_null(pd_emit(&p, PD_EMIT_SGLANG, &o, &e));
    cr_assert(strstr(e.msg, "--hosts: host 2 \"b;rm\""), "%s", e.msg);

    const char *empty[] = {"a", "", "c", "d", "e", "f", "g", "h"};
    o.hosts = empty;
    cr_assert_null(pd_emit(&p, PD_EMIT_SGLANG, &o, &e));
    cr_assert(strstr(e.msg, "--hosts: host 2 \"\""), "%s", e.msg);
    pd_plan_free(&p);
}

Test(plan, emit_model_path)
{
    struct pd_plan_opts o;
    struct pd_plan p;
    pd_plan_opts_default(&o);
    o.model = "deepseek-v3";
    o.role[PD_ROLE_PREFILL] = (struct pd_role_opts){.dp = 32, .tp = 1, .instances = 1};   /* fits 910B cards */
    build(&o, &p);
    cr_assert_str_eq(pd_emit_model_path(&p), "deepseek-ai/DeepSeek-V3");
    /* not V4: vllm-ascend's plain Mooncake connector, no hybrid KV cache manager */
    char *s = emit(&p, PD_EMIT_VLLM_ASCEND, NULL);
    cr_assert_eq(count(s, "\"kv_connector\":\"MooncakeConnectorV1\""), 8);
    LACKS(s, "Hybrid");
    LACKS(s, "hybrid");
    free(s);
    pd_plan_free(&p);

    pd_plan_opts_default(&o);
    o.model = "seed-v4-flash";
    build(&o, &p);
    cr_assert_str_eq(pd_emit_model_path(&p), "deepseek-ai/DeepSeek-V4-Flash");
    struct pd_emit_opts eo;
    pd_emit_opts_default(&eo);
    eo.model_path = "/models/DeepSeek V4 Flash w8a8";   /* one shell word, quoted */
    s = emit(&p, PD_EMIT_SGLANG, &eo);
    cr_assert_eq(count(s, "--model-path '/models/DeepSeek V4 Flash w8a8' \\\n"), 8);
    free(s);
    eo.model_path = "/models/it's";
    s = emit(&p, PD_EMIT_VLLM_ASCEND, &eo);
    cr_assert_eq(count(s, " vllm serve '/models/it'\\''s' \\\n"), 8);
    free(s);
    pd_plan_free(&p);

    pd_plan_opts_default(&o);
    o.model = "v4-tiny";
    o.role[PD_ROLE_PREFILL] = (struct pd_role_opts){.dp = 4, .tp = 1, .instances = 1};
    o.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 8, .tp = 1, .instances = 1};
    build(&o, &p);
    cr_assert_str_eq(pd_emit_model_path(&p), "v4-tiny");   /* no published checkpoint: the --model argument */
    pd_plan_free(&p);
}

/* A W4A8 plan asks for the W4A8 checkpoint (int4 routed experts), not the W8A8 one. */
Test(plan, emit_w4a8_names_its_checkpoint)
{
    struct pd_plan_opts o;
    struct pd_plan p;
    pd_plan_opts_default(&o);
    o.quant = "w4a8";
    build(&o, &p);
    for (int t = 0; t < 2; t++) {
        char *s = emit(&p, t ? PD_EMIT_SGLANG : PD_EMIT_VLLM_ASCEND, NULL);
        cr_assert(strstr(s, "# The plan is W4A8:"), "%s", s);
        cr_assert(strstr(s, "set MODEL_PATH to the W4A8 (msmodelslim) checkpoint of deepseek-ai/DeepSeek-V4-Flash, e.g. "
                            "DeepSeek-V4-Flash-w4a8-mtp'"), "%s", s);
        LACKS(s, "w8a8-mtp");
        free(s);
    }
    pd_plan_free(&p);
}

/* 910B has no FP8/FP4 units (hardware file): a plan in the release's formats is not launched there. */
Test(plan, emit_refuses_fp8_on_ascend)
{
    struct pd_plan_opts o;
    struct pd_plan p;
    pd_plan_opts_default(&o);
    o.quant = "fp8";
    build(&o, &p);
    pd_err e = {0};
    for (int t = 0; t < 2; t++) {
        cr_assert_null(pd_emit(&p, t ? PD_EMIT_SGLANG : PD_EMIT_VLLM_ASCEND, NULL, &e));
        cr_assert(strstr(e.msg, "Ascend 910B 64 GB cards have no FP8/FP4 units (hardware file field fp8_flops: 0), so "
                                "they cannot serve fp8 weights; plan with --quant w8a8"), "%s", e.msg);
    }
    pd_plan_free(&p);
}

/* The KV cache's dtype left at auto is what the stacks store: V4 on 910B in bf16 (vllm-ascend keeps
 * it so whatever --kv-cache-dtype says), on cards with FP8 in fp8, V3 in bf16 anywhere. An fp8
 * cache asked for on 910B is not launched there: its pools would promise sequences that do not fit
 * (the default was fp8 everywhere, and the vllm-ascend script sized on it). */
Test(plan, kv_cache_dtype_default_is_the_stacks)
{
    static const struct {
        const char *model, *hw, *quant;
        enum pd_kv_dtype want;
    } c[] = {{"deepseek-v4-flash", "atlas-800i-a2", "w8a8", PD_KV_BF16},
             {"deepseek-v4-flash", "atlas-800i-a3", "w8a8", PD_KV_BF16},
             {"deepseek-v4-flash", "h200", "fp8", PD_KV_FP8},
             {"deepseek-v4-flash", "b200", "fp8", PD_KV_FP8},
             {"deepseek-v3", "h800", "fp8", PD_KV_BF16},
             {"deepseek-v3", "atlas-800i-a2", "w8a8", PD_KV_BF16}};
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        struct pd_plan_opts o;
        struct pd_plan p;
        pd_plan_opts_default(&o);
        o.model = c[i].model;
        o.hardware = c[i].hw;
        o.quant = c[i].quant;
        o.role[PD_ROLE_PREFILL] = o.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 8, .tp = 1, .instances = 1};
        build(&o, &p);
        cr_assert_eq(p.kv.dtype, c[i].want, "%s on %s", c[i].model, c[i].hw);
        pd_plan_free(&p);
    }
    struct pd_plan_opts o;
    struct pd_plan p;
    /* a CPU without FP8 (pdmoe calibrate writes fp8_flops 0) runs pdmoe's own engine: bf16 in the
     * engine's layout, not vllm-ascend's */
    struct pd_hardware hw;
    pd_err he = {0};
    cr_assert_eq(pd_hardware_load("atlas-800i-a2", &hw, &he), 0, "%s", he.msg);
    snprintf(hw.card_name, sizeof hw.card_name, "CPU");
    pd_plan_opts_default(&o);
    o.hw = &hw;
    build(&o, &p);
    cr_assert_eq(p.kv.dtype, PD_KV_BF16);
    cr_assert_eq(p.kv.layout, PD_KV_LAYOUT_PDMOE);
    pd_plan_free(&p);
    pd_plan_opts_default(&o);
    build(&o, &p);
    cr_assert_eq(p.kv.layout, PD_KV_LAYOUT_VLLM_ASCEND);
    pd_plan_free(&p);
    pd_plan_opts_default(&o);
    o.kv_dtype = PD_KV_FP8;
    build(&o, &p);
    cr_assert_eq(p.kv.dtype, PD_KV_FP8);
    pd_err e = {0};
    for (int t = 0; t < 2; t++) {
        cr_assert_null(pd_emit(&p, t ? PD_EMIT_SGLANG : PD_EMIT_VLLM_ASCEND, NULL, &e));
        cr_assert(strstr(e.msg, t ? "--emit sglang: " : "--emit vllm-ascend: "), "%s", e.msg);
        cr_assert(strstr(e.msg, "--kv-cache-dtype fp8 on Ascend 910B 64 GB cards, which have no FP8 type: the KV cache "
                                "is bf16 there"), "%s", e.msg);
    }
    pd_plan_free(&p);
    /* a flat size per token has no dtype to disagree with */
    pd_plan_opts_default(&o);
    o.kv_dtype = PD_KV_FP8;
    o.kv_bytes_per_token = 44000;
    build(&o, &p);
    free(emit(&p, PD_EMIT_VLLM_ASCEND, NULL));
    pd_plan_free(&p);
}

static void refused(struct pd_plan_opts *o, enum pd_emit_target t, const struct pd_emit_opts *eo, int code,
                    const char *needle)
{
    struct pd_plan p;
    build(o, &p);
    pd_err e = {0};
    cr_assert_null(pd_emit(&p, t, eo, &e));
    cr_assert_eq(e.code, code, "%s", e.msg);
    cr_assert(strstr(e.msg, needle), "\"%s\" lacks \"%s\"", e.msg, needle);
    pd_plan_free(&p);
}

Test(plan, emit_layouts_it_refuses)
{
    struct pd_plan_opts o;
    /* 12 cards would split 8 + 4 over two nodes */
    pd_plan_opts_default(&o);
    o.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 12, .tp = 1, .instances = 1, .redundant = 8};
    refused(&o, PD_EMIT_SGLANG, NULL, PD_EINVAL, "decode instances of 12 cards (dp 12 x tp 1) would split unevenly");
    /* a tp-3 rank would straddle two 8-card nodes */
    pd_plan_opts_default(&o);
    o.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 8, .tp = 3, .instances = 1, .redundant = 8};
    refused(&o, PD_EMIT_VLLM_ASCEND, NULL, PD_EINVAL, "decode tp 3 does not divide a node's 8 cards");
    /* vllm-ascend's Mooncake connectors refuse a prefill tp below the decode's at start */
    pd_plan_opts_default(&o);
    o.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 16, .tp = 2, .instances = 1};
    refused(&o, PD_EMIT_VLLM_ASCEND, NULL, PD_EINVAL, "prefill tp=1 is smaller than decode tp=2");
    /* five 6-card prefill instances take a node each: 5 + 4 nodes for 62 cards of 64 */
    pd_plan_opts_default(&o);
    o.role[PD_ROLE_PREFILL] = (struct pd_role_opts){.dp = 6, .tp = 1, .instances = 5, .redundant = 2};
    refused(&o, PD_EMIT_SGLANG, NULL, PD_ENOFIT, "needs 9 nodes but the cluster has 8");
    /* the proxy on an instance's port */
    struct pd_emit_opts eo;
    pd_emit_opts_default(&eo);
    eo.proxy_port = 8100;
    pd_plan_opts_default(&o);
    refused(&o, PD_EMIT_SGLANG, &eo, PD_EINVAL,
            "ports clash on node0: the port 8100 of the proxy and the HTTP port 8100 of prefill instance 0");
    eo.proxy_port = 8000;
    eo.base_port = 65530;   /* the second instance on a node would need 65540 */
    pd_plan_opts_default(&o);
    o.role[PD_ROLE_PREFILL] = (struct pd_role_opts){.dp = 4, .tp = 1, .instances = 2};
    refused(&o, PD_EMIT_VLLM_ASCEND, &eo, PD_EINVAL, "HTTP port 65540 on node0 is outside 1-65535");

    pd_err e = {0};
    enum pd_emit_target t;
    cr_assert_eq(pd_emit_target_parse("sglang", &t, &e), 0);
    cr_assert_eq(t, PD_EMIT_SGLANG);
    cr_assert_eq(pd_emit_target_parse("vllm-ascend", &t, &e), 0);
    cr_assert_eq(t, PD_EMIT_VLLM_ASCEND);
    cr_assert_eq(pd_emit_target_parse("pdmoe", &t, &e), 0);
    cr_assert_eq(t, PD_EMIT_PDMOE);
    cr_assert_eq(pd_emit_target_parse("vllm", &t, &e), PD_EINVAL);
    cr_assert_str_eq(e.msg, "--emit vllm: expected vllm-ascend, sglang or pdmoe");
}

/* The script as a node runs it: sh dispatches on the host name, starts that node's commands with
 * each argument intact (the JSON is one word), and refuses a host that is not in the layout. */
static void write_file(const char *path, const char *text, int mode)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    fputs(text, f);
    fclose(f);
    chmod(path, (mode_t)mode);
}

static void slurp(const char *path, char *buf, size_t n)
{
    FILE *f = fopen(path, "r");
    size_t k = f ? fread(buf, 1, n - 1, f) : 0;
    buf[k] = 0;
    if (f)
        fclose(f);
}

Test(plan, emit_script_runs_under_sh)
{
    char dir[] = "/tmp/pdmoe-emit-XXXXXX", path[256], cmd[1024];
    cr_assert_not_null(mkdtemp(dir));
    /* Stand-ins append the environment the script set, then one argument per line, to a file of
     * their own: the servers of a node run concurrently, so they must not share one. */
    const char *fake = "#!/bin/sh\nexec >>\"$0.out\"\n"
                       "echo \"ASCEND_RT_VISIBLE_DEVICES=$ASCEND_RT_VISIBLE_DEVICES HCCL_IF_IP=$HCCL_IF_IP "
                       "HCCL_SOCKET_IFNAME=$HCCL_SOCKET_IFNAME\"\n"
                       "for a in \"$@\"; do echo \"[$a]\"; done\n";
    snprintf(path, sizeof path, "%s/vllm", dir);
    write_file(path, fake, 0755);
    snprintf(path, sizeof path, "%s/python3", dir);
    write_file(path, fake, 0755);
    snprintf(path, sizeof path, "%s/run.sh", dir);
    write_file(path, seed_vllm_ascend, 0644);

    static char out[1 << 16];
    char vllm_out[256], py_out[256], err[256];
    snprintf(vllm_out, sizeof vllm_out, "%s/vllm.out", dir);
    snprintf(py_out, sizeof py_out, "%s/python3.out", dir);
    snprintf(err, sizeof err, "%s/err", dir);

    snprintf(cmd, sizeof cmd, "cd %s && PATH=%s:$PATH NIC_NAME=eth9 LOCAL_IP=10.9.9.9 MODEL_PATH='/w8a8 ckpt' sh run.sh "
             "node0 2>err", dir, dir);
    cr_assert_eq(system(cmd), 0);
    /* node0 runs prefill instance 0 and the proxy, nothing else */
    slurp(vllm_out, out, sizeof out);
    cr_assert_eq(count(out, "ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 HCCL_IF_IP=10.9.9.9 HCCL_SOCKET_IFNAME=eth9\n"), 1,
                 "%s", out);
    HAS(out, "HCCL_SOCKET_IFNAME=eth9\n[serve]\n[/w8a8 ckpt]\n[--host]\n");   /* one word, however it is spelt */
    HAS(out, "\n[--quantization]\n[ascend]\n");
    HAS(out, "\n[--kv-transfer-config]\n[{\"kv_connector\":\"MooncakeHybridConnector\",\"kv_role\":\"kv_producer\","
             "\"kv_port\":\"30000\",\"engine_id\":\"0\",\"kv_connector_extra_config\":{\"prefill\":{\"dp_size\":8,"
             "\"tp_size\":1},\"decode\":{\"dp_size\":32,\"tp_size\":1}}}]\n");
    slurp(py_out, out, sizeof out);
    cr_assert_eq(count(out, "[load_balance_proxy_server_example.py]"), 1, "%s", out);
    HAS(out, "\n[--prefiller-hosts]\n[node0]\n[node1]\n[node2]\n[node3]\n[--prefiller-ports]\n[8100]\n");
    remove(vllm_out);
    remove(py_out);

    snprintf(cmd, sizeof cmd, "cd %s && PATH=%s:$PATH NIC_NAME=eth9 LOCAL_IP=10.9.9.9 MODEL_PATH=/m sh run.sh node6 2>err",
             dir, dir);
    cr_assert_eq(system(cmd), 0);
    slurp(vllm_out, out, sizeof out);
    cr_assert_eq(count(out, "ASCEND_RT_VISIBLE_DEVICES="), 1, "%s", out);
    HAS(out, "\n[--headless]\n[--data-parallel-size]\n[32]\n[--data-parallel-size-local]\n[8]\n"
             "[--data-parallel-start-rank]\n[16]\n[--data-parallel-address]\n[node4]\n");
    cr_assert_neq(access(py_out, F_OK), 0, "the proxy ran on node6");
    remove(vllm_out);

    snprintf(cmd, sizeof cmd, "cd %s && PATH=%s:$PATH NIC_NAME=eth9 sh run.sh node8 2>err", dir, dir);
    cr_assert_neq(system(cmd), 0);
    slurp(err, out, sizeof out);
    HAS(out, "node8 is not a node of this deployment (node0 ... node7)");
    snprintf(cmd, sizeof cmd, "cd %s && PATH=%s:$PATH sh run.sh node1 2>err", dir, dir);
    cr_assert_neq(system(cmd), 0);
    slurp(err, out, sizeof out);
    HAS(out, "set NIC_NAME to the network interface");
    cr_assert_neq(access(vllm_out, F_OK), 0, "a server started without NIC_NAME");
    snprintf(cmd, sizeof cmd, "cd %s && PATH=%s:$PATH NIC_NAME=eth9 sh run.sh node1 2>err", dir, dir);
    cr_assert_neq(system(cmd), 0);
    slurp(err, out, sizeof out);
    HAS(out, "set MODEL_PATH to the W8A8 (msmodelslim) checkpoint");
    cr_assert_neq(access(vllm_out, F_OK), 0, "a server started without MODEL_PATH");

    snprintf(cmd, sizeof cmd, "rm -f %s/vllm %s/python3 %s/run.sh %s/err && rmdir %s", dir, dir, dir, dir, dir);
    cr_assert_eq(system(cmd), 0);
}

/* Redundant experts (EPLB): refused where the stack has none (A2), SGLang's flags on NVIDIA, and
 * vllm-ascend's dynamic EPLB (env guard + eplb_config merged into the decode's additional config)
 * on an Ascend card whose stack has them. */
Test(plan, emit_redundant_experts)
{
    struct pd_plan_opts o;
    struct pd_plan p;
    pd_plan_opts_default(&o);
    o.role[PD_ROLE_DECODE].redundant = 32;
    build(&o, &p);
    pd_err e = {0};
    cr_assert_null(pd_emit(&p, PD_EMIT_VLLM_ASCEND, NULL, &e));
    cr_assert(strstr(e.msg, "--decode redundant=32") && strstr(e.msg, "redundant_experts"), "%s", e.msg);
    pd_plan_free(&p);

    o.hardware = "h800";
    build(&o, &p);
    char *s = emit(&p, PD_EMIT_SGLANG, NULL);
    cr_assert_eq(count(s, "--ep-num-redundant-experts 32 \\\n    --enable-eplb"), 4);   /* the 4 decode nodes */
    free(s);
    pd_plan_free(&p);

    const char *a2 = pd_embedded_find("hardware/atlas-800i-a2.json");
    const char *at = strstr(a2, "\"redundant_experts\": false");
    cr_assert(at);
    char path[] = "/tmp/pdmoe-a3-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    FILE *f = fdopen(fd, "w");
    fprintf(f, "%.*s\"redundant_experts\": true%s", (int)(at - a2), a2, at + strlen("\"redundant_experts\": false"));
    fclose(f);
    o.hardware = path;
    o.role[PD_ROLE_PREFILL].redundant = 8;
    build(&o, &p);
    remove(path);
    s = emit(&p, PD_EMIT_VLLM_ASCEND, NULL);
    cr_assert_eq(count(s, "DYNAMIC_EPLB=true ASCEND_RT_VISIBLE_DEVICES="), 8);
    cr_assert_eq(count(s, "--additional-config '{\"eplb_config\":{\"dynamic_eplb\":true,\"eplb_policy_type\":2,"
                          "\"num_redundant_experts\":8}}'"), 4);
    cr_assert_eq(count(s, "--additional-config '{\"recompute_scheduler_enable\":true,\"eplb_config\":{\"dynamic_eplb\":"
                          "true,\"eplb_policy_type\":2,\"num_redundant_experts\":32}}'"), 4);
    free(s);
    pd_plan_free(&p);
}

/* --- pdmoe on CPU hosts --- */

/* The seed's shape on four one-card CPU hosts, as tests/cluster/run.sh plans it: v4-flash-mini,
 * prefill 1 x dp 2 and decode 1 x dp 2, each EP group across two hosts. */
/* spec_k > 0: the MTP layer loaded and spec_k drafts per decode step (--speculative-config). */
static void cpu_plan(struct pd_plan *p, struct pd_hardware *hw, int decode_tp, int spec_k)
{
    pd_err e = {0};
    cr_assert_eq(pd_hardware_load("h100", hw, &e), 0, "%s", e.msg);
    snprintf(hw->name, sizeof hw->name, "4 CPU hosts");
    snprintf(hw->card_name, sizeof hw->card_name, "CPU");
    hw->cluster_nodes = 4;
    hw->cards_per_node = decode_tp > 1 ? decode_tp : 1;
    hw->card_memory_bytes = 1600000000;
    hw->runtime_prefill_bytes = hw->runtime_decode_bytes = 200000000;
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.model = "v4-flash-mini";
    o.hw = hw;
    o.max_model_len = 2048;
    o.max_num_seqs = 8;
    o.kv_dtype = PD_KV_BF16;
    o.mtp = spec_k > 0;
    o.spec_k = spec_k;
    o.role[PD_ROLE_PREFILL] = (struct pd_role_opts){.dp = 2, .tp = 1, .instances = 1};
    o.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 2, .tp = decode_tp, .instances = 1};
    build(&o, p);
}

static const char *const four_hosts[] = {"10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"};

static char *emit_pdmoe(const struct pd_plan *p, const char *model_path)
{
    struct pd_emit_opts o;
    pd_emit_opts_default(&o);
    o.hosts = four_hosts;
    o.n_hosts = 4;
    o.model_path = model_path;
    return emit(p, PD_EMIT_PDMOE, &o);
}

/* Each EP group is one mpirun on its first host, one app context per host, every rank on its own
 * host's address (HTTP and KV listener); the other host of a group starts nothing; the proxy on
 * the first prefill host; the plan's pool and limits on every rank. */
Test(plan, emit_pdmoe_four_cpu_hosts)
{
    struct pd_hardware hw;
    struct pd_plan p;
    cpu_plan(&p, &hw, 1, 0);
    char *s = emit_pdmoe(&p, NULL);
    const char *top = "#!/bin/sh\n# pdmoe launch commands from `pdmoe plan --emit pdmoe`:\n"
                      "# v4-flash-mini on 4 nodes of 1 CPU (4 CPU hosts),\n"
                      "# prefill 1 x (dp 2, tp 1), decode 1 x (dp 2, tp 1); model path models/mini.\n";
    cr_assert_eq(strncmp(s, top, strlen(top)), 0, "%s", s);
    HAS(s, "# The command lines of `pdmoe up --model models/mini --plan plan.json --hosts "
           "10.0.0.1,10.0.0.2,10.0.0.3,10.0.0.4\n# --host 10.0.0.1 --port 8000 --threads 1`");
    HAS(s, "\n10.0.0.1|10.0.0.2|10.0.0.3|10.0.0.4) ;;\n");
    HAS(s, "if [ \"$host\" = 10.0.0.1 ]; then\n  mpirun \\\n    --host 10.0.0.1:1,10.0.0.2:1 \\\n"
           "    --bind-to none \\\n    -n 1 pdmoe serve \\\n    --model models/mini \\\n    --host 10.0.0.1 \\\n    --port 8001 \\\n"
           "    --threads 1 \\\n    --max-model-len 2048 \\\n    --served-model-name mini \\\n"
           "    --kv-transfer-config '{\"kv_role\":\"kv_producer\",\"kv_port\":8100,\"engine_id\":\"prefill-0\","
           "\"kv_host\":\"10.0.0.1\"}' \\\n    --enable-expert-parallel \\\n    --data-parallel-size 2 \\\n");
    HAS(s, "    : -n 1 pdmoe serve \\\n    --model models/mini \\\n    --host 10.0.0.2 \\\n    --port 8001 \\\n");
    HAS(s, "--kv-transfer-config '{\"kv_role\":\"kv_producer\",\"kv_port\":8100,\"engine_id\":\"prefill-0\","
           "\"kv_host\":\"10.0.0.2\"}'");
    HAS(s, "if [ \"$host\" = 10.0.0.3 ]; then\n  mpirun \\\n    --host 10.0.0.3:1,10.0.0.4:1 \\\n"
           "    --bind-to none \\\n    -n 1 pdmoe serve \\\n    --model models/mini \\\n    --host 10.0.0.3 \\\n    --port 8002 \\\n");
    HAS(s, "    : -n 1 pdmoe serve \\\n    --model models/mini \\\n    --host 10.0.0.4 \\\n    --port 8002 \\\n");
    /* each decode rank pulls from the prefill ranks' KV listeners and from nowhere else */
    HAS(s, "--kv-transfer-config '{\"kv_role\":\"kv_consumer\",\"engine_id\":\"decode-0\",\"kv_host\":\"10.0.0.3\","
           "\"kv_producers\":[\"10.0.0.1:8100-8100\",\"10.0.0.2:8101-8101\"]}'");
    HAS(s, "--kv-transfer-config '{\"kv_role\":\"kv_consumer\",\"engine_id\":\"decode-0\",\"kv_host\":\"10.0.0.4\","
           "\"kv_producers\":[\"10.0.0.1:8100-8100\",\"10.0.0.2:8101-8101\"]}'");
    HAS(s, "# 10.0.0.2: rank 1 of prefill instance 0, started by its mpirun on 10.0.0.1\n");
    HAS(s, "# 10.0.0.4: rank 1 of decode instance 0, started by its mpirun on 10.0.0.3\n");
    cr_assert_eq(count(s, "  mpirun \\\n"), 2);
    cr_assert_eq(count(s, "if [ \"$host\" = 10.0.0.2 ]; then\n  echo "), 1);
    for (int r = 0; r < 2; r++) {   /* the role's KV pool, per rank, on both ranks */
        char want[64];
        snprintf(want, sizeof want, "    --kv-cache-bytes %lld \\\n", (long long)p.role[r].b.kv_pool);
        cr_assert_eq(count(s, want), 2, "%s", want);
        cr_assert_gt(p.role[r].b.kv_pool, 0);
    }
    cr_assert_eq(count(s, "    --max-num-seqs 8 \\\n"), 4);
    cr_assert_eq(count(s, "    --max-num-batched-tokens 4096"), 4);
    /* the dtype the pools were sized for (this plan's bf16) */
    cr_assert_eq(count(s, "    --kv-cache-dtype bf16"), 4);
    HAS(s, "# proxy on 10.0.0.1, in front of every instance's first host and HTTP port\n"
           "if [ \"$host\" = 10.0.0.1 ]; then\n  pdmoe proxy \\\n    --prefill 10.0.0.1:8001 \\\n"
           "    --decode 10.0.0.3:8002 \\\n    --port 8000 \\\n    --host 10.0.0.1 &\nfi\n\nwait\n");
    /* what only pdmoe up adds: its local mpirun flags, its restart-count file */
    LACKS(s, "--oversubscribe");
    LACKS(s, "--allow-run-as-root");
    LACKS(s, "--metrics-file");
    free(s);
    pd_plan_free(&p);
}

/* --- the script as sh runs it --- */

/* A stand-in program that records its name and arguments, one invocation per file in $OUT. */
static const char recorder[] = "#!/bin/sh\n{ basename \"$0\"; printf '[%s]\\n' \"$@\"; } > \"$OUT/$(basename \"$0\").$$\"\n";

/* The invocations recorded in dir/out, each file's text, moved out of the way (n of them). */
static int recorded(const char *dir, char **got, int cap)
{
    char path[512];
    snprintf(path, sizeof path, "%s/out", dir);
    DIR *d = opendir(path);
    cr_assert_not_null(d, "%s", path);
    int n = 0;
    for (struct dirent *x; (x = readdir(d));) {
        if (x->d_name[0] == '.')
            continue;
        cr_assert_lt(n, cap);
        snprintf(path, sizeof path, "%s/out/%s", dir, x->d_name);
        got[n] = calloc(1, 1 << 16);
        slurp(path, got[n++], 1 << 16);
        remove(path);
    }
    closedir(d);
    return n;
}

/* argv as the recorder writes it. */
static char *as_recorded(char *const *argv)
{
    char *s = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&s, &len);
    fprintf(f, "%s\n", argv[0]);
    for (int i = 1; argv[i]; i++)
        fprintf(f, "[%s]\n", argv[i]);
    fclose(f);
    return s;
}

/* Runs `sh launch.sh host` in dir with the recorders first on PATH; its exit status. */
static int run_on(const char *dir, const char *host)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "cd %s && PATH=%s:$PATH OUT=%s/out sh launch.sh %s 2>err", dir, dir, dir, host);
    return system(cmd);
}

/* The argv `pdmoe up --plan plan.json --hosts 10.0.0.1,...` builds, as src/cli/up.c does: the
 * instances from the plan JSON's node map on the hosts, their ports from the proxy's, the plan's
 * pool and limits from the JSON's roles[].budget and options; run from each instance's first host
 * (one rank: no mpirun). n instances, the proxy last. */
static int up_argv(const struct pd_plan *p, const char *model, char ***argv)
{
    char *text = pd_plan_json(p, NULL);
    json_error_t je;
    json_t *j = json_loads(text, 0, &je), *map = json_object_get(j, "node_map");
    cr_assert(json_is_array(map), "%s", je.text);
    free(text);
    int n = (int)json_array_size(map);
    struct pd_launch_inst *inst = calloc((size_t)n, sizeof *inst);
    size_t i, k;
    json_t *x, *nd;
    json_array_foreach(map, i, x) {
        const char *role = json_string_value(json_object_get(x, "role"));
        inst[i] = (struct pd_launch_inst){.role = strcmp(role, "prefill") != 0,
                                          .inst = (int)json_integer_value(json_object_get(x, "instance"))};
        json_array_foreach(json_object_get(x, "nodes"), k, nd) {
            int ranks = (int)json_integer_value(json_array_get(json_object_get(x, "ranks"), k));
            inst[i].group[inst[i].n_groups++] = (struct pd_launch_group){
                .host = four_hosts[json_integer_value(nd)], .ranks = ranks};
            inst[i].ranks += ranks;
        }
    }
    pd_err e = {0};
    cr_assert_eq(pd_launch_ports(inst, n, 8000, &e), 0, "%s", e.msg);
    json_t *opt = json_object_get(j, "options"), *roles = json_object_get(j, "roles");
    char len[32];
    snprintf(len, sizeof len, "%lld", (long long)json_integer_value(json_object_get(opt, "max_model_len")));
    const char *slash = strrchr(model, '/');
    char *producers = pd_launch_kv_producers(inst, n);   /* as up gives them to each decode instance */
    for (int m = 0; m < n; m++) {
        json_t *budget = json_object_get(json_array_get(roles, (size_t)inst[m].role), "budget");
        struct pd_launch_opts lo = {
            .pdmoe = "pdmoe", .model = model, .served_name = slash ? slash + 1 : model, .threads = "1",
            .max_model_len = len, .kv_producers = producers,
            .plan = {.kv_cache_bytes = json_integer_value(json_object_get(budget, "kv_pool_bytes")),
                     .max_num_seqs = json_integer_value(json_object_get(opt, "max_num_seqs")),
                     .max_num_batched_tokens = json_integer_value(json_object_get(opt, "max_num_batched_tokens")),
                     .kv_cache_dtype = json_string_value(json_object_get(opt, "kv_cache_dtype")),
                     .spec_k = (int)json_integer_value(json_object_get(opt, "num_speculative_tokens"))}};
        argv[m] = pd_launch_argv(&inst[m], &lo);
        cr_assert_not_null(argv[m]);
    }
    /* up's proxy, spelt out rather than built: every instance's first host and port */
    static char *proxy[] = {"pdmoe", "proxy", "--prefill", "10.0.0.1:8001", "--decode", "10.0.0.3:8002",
                            "--port", "8000", "--host", "10.0.0.1", NULL};
    argv[n] = proxy;
    json_decref(j);
    free(inst);
    free(producers);
    return n;
}

/* One layout, two launchers: on each host, sh starts exactly the argv up builds from the plan's
 * JSON for the instances whose first host it is (a model path sh must quote, to prove each word
 * arrives whole), the proxy on the first; the other hosts start nothing; an unknown host is
 * refused; and sh -n accepts the script. */
Test(plan, emit_pdmoe_words_are_the_argv_of_up)
{
    struct pd_hardware hw;
    struct pd_plan p;
    cpu_plan(&p, &hw, 1, 2);   /* with MTP: up reads the drafts from the JSON too */
    const char *model = "/srv/pdmoe models/it's mini";
    char *s = emit_pdmoe(&p, model);
    HAS(s, "    --model '/srv/pdmoe models/it'\\''s mini' \\\n");
    HAS(s, "    --served-model-name 'it'\\''s mini' \\\n");

    char dir[] = "/tmp/pdmoe-emit-pdmoe-XXXXXX", path[256], cmd[512];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/out", dir);
    cr_assert_eq(mkdir(path, 0755), 0);
    snprintf(path, sizeof path, "%s/mpirun", dir);
    write_file(path, recorder, 0755);
    snprintf(path, sizeof path, "%s/pdmoe", dir);
    write_file(path, recorder, 0755);
    snprintf(path, sizeof path, "%s/launch.sh", dir);
    write_file(path, s, 0644);
    snprintf(cmd, sizeof cmd, "sh -n %s", path);
    cr_assert_eq(system(cmd), 0, "sh -n refuses the script");

    char **want[8] = {0};
    int n = up_argv(&p, model, want);
    cr_assert_eq(n, 2);
    /* host -> the commands it starts: prefill + proxy, nothing, decode, nothing */
    const int starts[4][3] = {{0, 2, -1}, {-1}, {1, -1}, {-1}};
    for (int h = 0; h < 4; h++) {
        cr_assert_eq(run_on(dir, four_hosts[h]), 0, "sh launch.sh %s failed", four_hosts[h]);
        char *got[8];
        int ng = recorded(dir, got, 8), nw = 0;
        for (int w = 0; starts[h][w] >= 0; w++, nw++) {
            char *text = as_recorded(want[starts[h][w]]);
            int found = 0;
            for (int g = 0; g < ng && !found; g++)
                found = got[g] && strcmp(got[g], text) == 0;
            cr_assert(found, "%s did not start:\n%s\n(it started %d commands, the first:\n%s)", four_hosts[h], text,
                      ng, ng ? got[0] : "");
            free(text);
        }
        cr_assert_eq(ng, nw, "%s started %d commands, not %d", four_hosts[h], ng, nw);
        for (int g = 0; g < ng; g++)
            free(got[g]);
    }
    char err[4096];
    snprintf(path, sizeof path, "%s/err", dir);
    slurp(path, err, sizeof err);
    HAS(err, "10.0.0.4 runs rank 1 of decode instance 0, which the mpirun on 10.0.0.3 starts: nothing to start here");
    cr_assert_neq(run_on(dir, "10.0.0.9"), 0);
    slurp(path, err, sizeof err);
    HAS(err, "10.0.0.9 is not a node of this deployment (10.0.0.1 ... 10.0.0.4)");

    for (int m = 0; m < n; m++)
        pd_launch_argv_free(want[m]);
    snprintf(cmd, sizeof cmd, "rm -f %s/mpirun %s/pdmoe %s/launch.sh %s/err && rmdir %s/out %s", dir, dir, dir, dir,
             dir, dir);
    cr_assert_eq(system(cmd), 0);
    free(s);
    pd_plan_free(&p);
}

/* What pdmoe cannot launch: tensor parallel (either role), redundant experts, a preset with no
 * checkpoint directory; the model path rules. */
Test(plan, emit_pdmoe_refuses_and_model_paths)
{
    struct pd_hardware hw;
    struct pd_plan p;
    pd_err e = {0};
    cpu_plan(&p, &hw, 2, 0);   /* decode dp 2 x tp 2 on two 2-card hosts */
    struct pd_emit_opts o;
    pd_emit_opts_default(&o);
    cr_assert_null(pd_emit(&p, PD_EMIT_PDMOE, &o, &e));
    cr_assert_eq(e.code, PD_EINVAL);
    cr_assert_str_eq(e.msg, "--emit pdmoe: --decode tp=2: pdmoe runs tensor parallel 1 only (an instance is dp EP "
                            "ranks, each with whole attention and dense layers); plan with --decode tp=1");
    pd_plan_free(&p);

    struct pd_plan_opts po;
    pd_plan_opts_default(&po);
    po.role[PD_ROLE_PREFILL] = (struct pd_role_opts){.dp = 2, .tp = 4, .instances = 4};
    po.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 8, .tp = 4, .instances = 1};
    o.model_path = "/m";
    refused(&po, PD_EMIT_PDMOE, &o, PD_EINVAL, "--emit pdmoe: --prefill tp=4: pdmoe runs tensor parallel 1 only");
    pd_plan_opts_default(&po);
    po.role[PD_ROLE_DECODE].redundant = 32;
    refused(&po, PD_EMIT_PDMOE, &o, PD_EINVAL, "--emit pdmoe: --decode redundant=32: pdmoe serve holds no redundant");
    /* the seed's model is a preset: nothing on disk for pdmoe serve */
    o.model_path = NULL;
    pd_plan_opts_default(&po);
    refused(&po, PD_EMIT_PDMOE, &o, PD_EINVAL, "--emit pdmoe: deepseek-v4-flash is a preset, not a checkpoint "
                                               "directory pdmoe serve can load; name the directory with "
                                               "--served-model-path");

    /* v4-flash-mini: models/mini; --model DIR: DIR; --served-model-path wins */
    cpu_plan(&p, &hw, 1, 0);
    char *s = emit_pdmoe(&p, NULL);
    cr_assert_eq(count(s, "    --model models/mini \\\n"), 4);
    free(s);
    s = emit_pdmoe(&p, "/data/mini");
    cr_assert_eq(count(s, "    --model /data/mini \\\n    --host "), 4);
    cr_assert_eq(count(s, "    --served-model-name mini \\\n"), 4);
    free(s);
    o.model_path = "/data/mini\nrm -rf /";   /* quoted in the commands, but not in the header's comment */
    cr_assert_null(pd_emit(&p, PD_EMIT_PDMOE, &o, &e));
    cr_assert(strstr(e.msg, "--served-model-path: has a control character (0x0A)"), "%s", e.msg);
    pd_plan_free(&p);
    char dir[] = "/tmp/pdmoe-emit-model-XXXXXX", path[256];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/config.json", dir);
    write_file(path, pd_embedded_find("models/v4-flash-mini.json"), 0644);
    pd_plan_opts_default(&po);
    po.model = dir;
    po.role[PD_ROLE_PREFILL] = (struct pd_role_opts){.dp = 8, .tp = 1, .instances = 1};
    po.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 8, .tp = 1, .instances = 1};
    build(&po, &p);
    remove(path);
    rmdir(dir);
    s = emit(&p, PD_EMIT_PDMOE, NULL);
    char want[128];
    snprintf(want, sizeof want, "    --model %s \\\n", dir);
    cr_assert_eq(count(s, want), 2, "%s", want);
    free(s);
    pd_plan_free(&p);
}

/* The drafts the plan's TPOT assumes are the drafts every server it launches runs: vllm-ascend's
 * --speculative-config, SGLang's EAGLE chain of k steps and k + 1 tokens, pdmoe serve's
 * --speculative-config as its own parser reads it; on every server of both roles; none without
 * the MTP layer. */
Test(plan, emit_speculation_as_the_plan_costs_it)
{
    for (int k = 0; k <= 3; k += 3) {
        struct pd_plan_opts o;
        pd_plan_opts_default(&o);
        o.mtp = k > 0;
        o.spec_k = k;
        struct pd_plan p;
        build(&o, &p);
        cr_assert_eq(p.mtp.k, k);
        char want[160];
        char *s = emit(&p, PD_EMIT_VLLM_ASCEND, NULL);
        snprintf(want, sizeof want, "--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":%d,"
                 "\"enforce_eager\":true}'", k);
        cr_assert_eq(count(s, want), k ? count(s, " vllm serve ") : 0, "%s", s);
        cr_assert_eq(count(s, "--speculative-config"), k ? count(s, " vllm serve ") : 0);
        free(s);
        s = emit(&p, PD_EMIT_SGLANG, NULL);
        snprintf(want, sizeof want, "--speculative-algorithm EAGLE \\\n    --speculative-num-steps %d \\\n"
                 "    --speculative-eagle-topk 1 \\\n    --speculative-num-draft-tokens %d ", k, k + 1);
        cr_assert_eq(count(s, want), k ? count(s, "sglang.launch_server") : 0, "%s", s);
        cr_assert_eq(count(s, "--speculative"), k ? 4 * count(s, "sglang.launch_server") : 0);
        free(s);
        pd_plan_free(&p);

        struct pd_hardware hw;
        cpu_plan(&p, &hw, 1, k);
        s = emit_pdmoe(&p, NULL);
        int servers = count(s, "pdmoe serve"), seen = 0;
        cr_assert_gt(servers, 0);
        for (const char *q = strstr(s, "--speculative-config '"); q; q = strstr(q + 1, "--speculative-config '")) {
            const char *v = q + strlen("--speculative-config '"), *end = strchr(v, '\'');
            char cfg[128];
            snprintf(cfg, sizeof cfg, "%.*s", (int)(end - v), v);
            int got = -1;
            pd_err e = {0};
            cr_assert_eq(pd_spec_config_parse(cfg, &got, &e), 0, "%s: %s", cfg, e.msg);   /* what serve checks */
            cr_assert_eq(got, k);
            seen++;
        }
        cr_assert_eq(seen, k ? servers : 0, "%s", s);
        free(s);
        pd_plan_free(&p);
    }
}

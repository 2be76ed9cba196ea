/* config.json -> struct pd_model: presets load with the right values; bad input gets one
 * line naming the file and the field. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "model/config.h"

Test(config, v4_flash_preset_fields)
{
    struct pd_model m;
    pd_err e = {0};
    cr_assert_eq(pd_model_load("deepseek-v4-flash", &m, &e), 0, "%s", e.msg);
    cr_assert_eq(m.arch, PD_ARCH_DEEPSEEK_V4);
    cr_assert_eq(m.n_layers, 43);
    cr_assert_eq(m.n_mtp_layers, 1);
    cr_assert_eq(m.hidden_size, 4096);
    cr_assert_eq(m.head_dim, 512);
    cr_assert_eq(m.o_groups, 8);
    cr_assert_eq(m.o_lora_rank, 1024);
    cr_assert_eq(m.n_routed_experts, 256);
    cr_assert_eq(m.num_hash_layers, 3);
    cr_assert_eq(m.scoring_func, PD_SCORE_SQRTSOFTPLUS);
    cr_assert(m.noaux_tc);
    cr_assert(m.rope_scaling.yarn);
    cr_assert_float_eq(m.rope_scaling.factor, 16.0, 1e-12);
    cr_assert(m.ckpt_fp8 && m.ckpt_scale_ue8m0);
    int window = 0, csa = 0, hca = 0;
    for (int l = 0; l < pd_model_total_layers(&m); l++) {
        window += m.compress_ratio[l] == 0;
        csa += m.compress_ratio[l] == 4;
        hca += m.compress_ratio[l] == 128;
    }
    /* layers 0, 1 and the MTP layer are window-only; 21 CSA, 20 HCA */
    cr_assert_eq(window, 3);
    cr_assert_eq(csa, 21);
    cr_assert_eq(hca, 20);
    cr_assert_eq(m.compress_ratio[43], 0);
}

Test(config, every_preset_loads)
{
    const char *names[] = {"deepseek-v4-flash", "seed-v4-flash", "v4-flash-mini", "v4-tiny", "deepseek-v3"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        struct pd_model m;
        pd_err e = {0};
        cr_assert_eq(pd_model_load(names[i], &m, &e), 0, "%s: %s", names[i], e.msg);
        cr_assert_str_eq(m.name, names[i]);
    }
}

Test(config, preset_by_path_and_from_disk)
{
    struct pd_model a, b;
    pd_err e = {0};
    /* the tests run from the top of the tree: this reads the file on disk */
    cr_assert_eq(pd_model_load("models/v4-tiny.json", &a, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_model_load("v4-tiny", &b, &e), 0, "%s", e.msg);
    cr_assert_eq(a.hidden_size, b.hidden_size);
    cr_assert_eq(a.n_routed_experts, 16);
}

Test(config, v3_fields)
{
    struct pd_model m;
    pd_err e = {0};
    cr_assert_eq(pd_model_load("deepseek-v3", &m, &e), 0, "%s", e.msg);
    cr_assert_eq(m.arch, PD_ARCH_DEEPSEEK_V3);
    cr_assert_eq(m.kv_lora_rank, 512);
    cr_assert_eq(m.first_k_dense_replace, 3);
    cr_assert_eq(m.n_group, 8);
    cr_assert_eq(m.topk_group, 4);
    cr_assert_eq(m.scoring_func, PD_SCORE_SIGMOID);
    cr_assert(!pd_model_is_moe_layer(&m, 2));
    cr_assert(pd_model_is_moe_layer(&m, 3));
    cr_assert(!m.ckpt_scale_ue8m0);
}

static const char *V4 =
    "{\"model_type\":\"deepseek_v4\",\"vocab_size\":512,\"hidden_size\":64,\"num_hidden_layers\":2,"
    "\"num_attention_heads\":4,\"head_dim\":32,\"qk_rope_head_dim\":16,\"q_lora_rank\":32,\"o_lora_rank\":32,"
    "\"o_groups\":2,\"sliding_window\":8,\"compress_ratios\":[0,4],\"index_n_heads\":4,\"index_head_dim\":16,"
    "\"index_topk\":4,\"n_routed_experts\":16,\"num_experts_per_tok\":4,\"moe_intermediate_size\":32,"
    "\"hc_mult\":4%s}";

static void expect_error(const char *extra_or_text, int whole, const char *needle)
{
    char text[2048];
    if (whole)
        snprintf(text, sizeof text, "%s", extra_or_text);
    else
        snprintf(text, sizeof text, V4, extra_or_text);
    struct pd_model m;
    pd_err e = {0};
    int rc = pd_model_parse(text, "cfg.json", &m, &e);
    cr_assert_neq(rc, 0, "accepted: %s", text);
    cr_assert(strstr(e.msg, "cfg.json") != NULL, "message does not name the file: %s", e.msg);
    cr_assert(strstr(e.msg, needle) != NULL, "message \"%s\" lacks \"%s\"", e.msg, needle);
}

Test(config, minimal_v4_parses)
{
    char text[2048];
    snprintf(text, sizeof text, V4, "");
    struct pd_model m;
    pd_err e = {0};
    cr_assert_eq(pd_model_parse(text, "cfg.json", &m, &e), 0, "%s", e.msg);
    cr_assert_eq(m.n_shared_experts, 0);
    cr_assert_eq(m.compress_ratio[1], 4);
}

Test(config, bad_input_names_file_and_field)
{
    expect_error("{\"model_type\":\"llama\"}", 1, "\"model_type\": unknown model type \"llama\"");
    expect_error("{\"hidden_size\":1}", 1, "missing required field \"model_type\"");
    expect_error("{\"model_type\":\"deepseek_v4\",", 1, "cfg.json:1:");
    expect_error("[1,2]", 1, "expected a JSON object");
    expect_error(",\"hidden_size\":\"4096\"", 0, "duplicate");   /* duplicate key */
    expect_error("{\"model_type\":\"deepseek_v4\",\"vocab_size\":512,\"hidden_size\":\"64\"}", 1,
                 "\"hidden_size\": expected an integer, got a string");
    expect_error("{\"model_type\":\"deepseek_v4\",\"vocab_size\":0}", 1, "\"vocab_size\": 0 is out of range");
    expect_error("{\"model_type\":\"deepseek_v4\",\"vocab_size\":-5}", 1, "\"vocab_size\": -5 is out of range");
    expect_error(",\"num_nextn_predict_layers\":-1", 0, "\"num_nextn_predict_layers\": -1 is out of range");
    expect_error(",\"rms_norm_eps\":\"small\"", 0, "\"rms_norm_eps\": expected a number");
    expect_error(",\"scoring_func\":\"relu\"", 0, "\"scoring_func\": unknown value \"relu\"");
    expect_error(",\"rope_scaling\":{\"type\":\"linear\",\"factor\":2}", 0, "\"rope_scaling.type\": unsupported");
    expect_error(",\"rope_scaling\":{\"type\":\"yarn\"}", 0, "missing required field \"rope_scaling.factor\"");
    expect_error(",\"pdmoe\":{\"quantize_groups\":[3]}", 0, "\"pdmoe.quantize_groups[0]\"");
    expect_error(",\"pdmoe\":{\"extra_layer_tensors\":[{\"name\":\"x\",\"group\":\"attention\",\"shape\":[0]}]}", 0,
                 "pdmoe.extra_layer_tensors[0].shape[0]");
}

/* A field pdmoe does not read, or a value of one it does not implement, is refused by name: each
 * of these ran the model at a default or as another model. */
Test(config, unknown_or_unimplemented_fields_refused)
{
    expect_error(",\"compress_rope_thetta\":160000", 0, "field \"compress_rope_thetta\": unknown");
    expect_error(",\"routed_scale_factor\":1.5", 0, "field \"routed_scale_factor\": unknown");
    /* a key with a control character is named on one line (the fuzzer's "bos_tok\n_id") */
    expect_error(",\"bos_tok\\n_id\":0", 0, "field \"bos_tok?_id\": unknown");
    expect_error(",\"rope_scaling\":{\"type\":\"yarn\",\"factor\":4,\"original_max_position_embeddings\":4096,"
                 "\"attention_factor\":2}", 0, "field \"rope_scaling.attention_factor\": unknown");
    expect_error(",\"pdmoe\":{\"descriptoin\":\"x\"}", 0, "field \"pdmoe.descriptoin\": unknown");
    expect_error(",\"first_k_dense_replace\":3", 0, "field \"first_k_dense_replace\": a DeepSeek-V3 field");
    expect_error(",\"n_group\":4", 0, "field \"n_group\": a DeepSeek-V3 field");
    expect_error(",\"attention_bias\":true", 0, "field \"attention_bias\": true");
    expect_error(",\"hidden_act\":\"gelu\"", 0, "field \"hidden_act\": \"gelu\"");
    expect_error(",\"architectures\":[\"LlamaForCausalLM\"]", 0, "does not name DeepseekV4ForCausalLM");
    expect_error(",\"quantization_config\":{\"quant_method\":\"awq\",\"bits\":4}", 0,
                 "field \"quantization_config.bits\": unknown");
    expect_error(",\"quantization_config\":{\"quant_method\":\"awq\"}", 0,
                 "field \"quantization_config.quant_method\": \"awq\" is not supported");
    expect_error(",\"quantization_config\":{\"quant_method\":\"fp8\",\"scale_fmt\":\"bogus\"}", 0,
                 "\"quantization_config.scale_fmt\": \"bogus\"");
    expect_error(",\"quantization_config\":{\"quant_method\":\"fp8\",\"activation_scheme\":\"static\"}", 0,
                 "\"quantization_config.activation_scheme\": \"static\"");
    expect_error(",\"quantization_config\":{\"quant_method\":\"fp8\",\"weight_block_size\":[64,64]}", 0,
                 "\"quantization_config.weight_block_size\": expected [128, 128]");
    expect_error(",\"quantization_config\":{\"quant_method\":\"fp8\",\"weight_block_size\":[4294967296,4294967296]}", 0,
                 "\"quantization_config.weight_block_size\": expected [128, 128]");
    /* what describes the file only, and the values DeepSeek's models have, still parse */
    char text[2048];
    snprintf(text, sizeof text, V4,
             ",\"torch_dtype\":\"bfloat16\",\"transformers_version\":\"4.57.1\",\"use_cache\":true,"
             "\"hidden_act\":\"silu\",\"attention_bias\":false,\"architectures\":[\"DeepseekV4ForCausalLM\"],"
             "\"quantization_config\":{\"quant_method\":\"fp8\",\"fmt\":\"e4m3\",\"activation_scheme\":\"dynamic\","
             "\"scale_fmt\":\"ue8m0\",\"weight_block_size\":[128,128]}");
    struct pd_model m;
    pd_err e = {0};
    cr_assert_eq(pd_model_parse(text, "cfg.json", &m, &e), 0, "%s", e.msg);
    cr_assert(m.ckpt_fp8 && m.ckpt_scale_ue8m0);
}

Test(config, compress_ratios_checked)
{
    const char *t =
        "{\"model_type\":\"deepseek_v4\",\"vocab_size\":512,\"hidden_size\":64,\"num_hidden_layers\":2,"
        "\"num_attention_heads\":4,\"head_dim\":32,\"qk_rope_head_dim\":16,\"q_lora_rank\":32,\"o_lora_rank\":32,"
        "\"o_groups\":2,\"sliding_window\":8,\"compress_ratios\":[0,4,4],\"n_routed_experts\":16,"
        "\"num_experts_per_tok\":4,\"moe_intermediate_size\":32,\"hc_mult\":4}";
    expect_error(t, 1, "\"compress_ratios\": 3 entries, expected 2");
    const char *u =
        "{\"model_type\":\"deepseek_v4\",\"vocab_size\":512,\"hidden_size\":64,\"num_hidden_layers\":2,"
        "\"num_attention_heads\":4,\"head_dim\":32,\"qk_rope_head_dim\":16,\"q_lora_rank\":32,\"o_lora_rank\":32,"
        "\"o_groups\":2,\"sliding_window\":8,\"compress_ratios\":[0,4],\"n_routed_experts\":16,"
        "\"num_experts_per_tok\":4,\"moe_intermediate_size\":32,\"hc_mult\":4}";
    /* a ratio-4 layer needs the indexer's fields */
    expect_error(u, 1, "missing required field \"index_n_heads\"");
    expect_error(",\"num_experts_per_tok\":17", 0, "duplicate");
    const char *v =
        "{\"model_type\":\"deepseek_v4\",\"vocab_size\":512,\"hidden_size\":64,\"num_hidden_layers\":2,"
        "\"num_attention_heads\":4,\"head_dim\":32,\"qk_rope_head_dim\":16,\"q_lora_rank\":32,\"o_lora_rank\":32,"
        "\"o_groups\":3,\"sliding_window\":8,\"compress_ratios\":[0,0],\"n_routed_experts\":16,"
        "\"num_experts_per_tok\":4,\"moe_intermediate_size\":32,\"hc_mult\":4}";
    expect_error(v, 1, "\"o_groups\": 3 does not divide");
    const char *w =
        "{\"model_type\":\"deepseek_v4\",\"vocab_size\":512,\"hidden_size\":64,\"num_hidden_layers\":2,"
        "\"num_attention_heads\":4,\"head_dim\":32,\"qk_rope_head_dim\":16,\"q_lora_rank\":32,\"o_lora_rank\":32,"
        "\"o_groups\":2,\"sliding_window\":8,\"compress_ratios\":[0,1],\"n_routed_experts\":16,"
        "\"num_experts_per_tok\":4,\"moe_intermediate_size\":32,\"hc_mult\":4}";
    expect_error(w, 1, "\"compress_ratios[1]\"");
    const char *x =
        "{\"model_type\":\"deepseek_v4\",\"vocab_size\":512,\"hidden_size\":64,\"num_hidden_layers\":2,"
        "\"num_attention_heads\":4,\"head_dim\":32,\"qk_rope_head_dim\":16,\"q_lora_rank\":32,\"o_lora_rank\":32,"
        "\"o_groups\":2,\"sliding_window\":8,\"compress_ratios\":[0,0],\"n_routed_experts\":16,"
        "\"num_experts_per_tok\":40,\"moe_intermediate_size\":32,\"hc_mult\":4}";
    expect_error(x, 1, "\"num_experts_per_tok\": 40 is out of range [1, 16]");
}

/* DSpark (DeepSeek-V4-Flash-0731): the stages are the compress_ratios entries past the layers,
 * one per target layer, window-only; a partial or different geometry is refused by field. */
Test(config, dspark_checked)
{
    const char *base =
        "{\"model_type\":\"deepseek_v4\",\"vocab_size\":512,\"hidden_size\":64,\"num_hidden_layers\":2,"
        "\"num_attention_heads\":4,\"head_dim\":32,\"qk_rope_head_dim\":16,\"q_lora_rank\":32,\"o_lora_rank\":32,"
        "\"o_groups\":2,\"sliding_window\":8,\"n_routed_experts\":16,\"num_experts_per_tok\":4,"
        "\"moe_intermediate_size\":32,\"hc_mult\":4,\"num_nextn_predict_layers\":1,%s}";
    char text[2048];
    struct pd_model m;
    pd_err e = {0};
    snprintf(text, sizeof text, base,
             "\"compress_ratios\":[0,0,0,0],\"dspark_target_layer_ids\":[0,1],\"dspark_markov_rank\":8,"
             "\"dspark_block_size\":5");
    cr_assert_eq(pd_model_parse(text, "cfg.json", &m, &e), 0, "%s", e.msg);
    cr_assert(m.dspark);
    cr_assert_eq(m.n_mtp_layers, 2);   /* the stages, not the legacy num_nextn_predict_layers */
    cr_assert_eq(m.dspark_target_layer[1], 1);
    snprintf(text, sizeof text, base,
             "\"compress_ratios\":[0,0,0],\"dspark_target_layer_ids\":[0,1],\"dspark_markov_rank\":8,"
             "\"dspark_block_size\":5");
    expect_error(text, 1, "\"compress_ratios\": 1 entries past num_hidden_layers (DSpark stages), expected one per");
    snprintf(text, sizeof text, base,
             "\"compress_ratios\":[0,0,0,4],\"dspark_target_layer_ids\":[0,1],\"dspark_markov_rank\":8,"
             "\"dspark_block_size\":5");
    expect_error(text, 1, "\"compress_ratios[3]\": a DSpark stage is window-only");
    snprintf(text, sizeof text, base, "\"compress_ratios\":[0,0,0,0],\"dspark_target_layer_ids\":[0,1],\"dspark_block_size\":5");
    expect_error(text, 1, "missing required field \"dspark_markov_rank\"");
    snprintf(text, sizeof text, base,
             "\"compress_ratios\":[0,0,0,0],\"dspark_target_layer_ids\":[0,5],\"dspark_markov_rank\":8,"
             "\"dspark_block_size\":5");
    expect_error(text, 1, "\"dspark_target_layer_ids[1]\": expected a layer id in [0, 2)");
    cr_assert_eq(pd_model_load("deepseek-v4-flash-0731", &m, &e), 0, "%s", e.msg);
    cr_assert(m.dspark && m.n_mtp_layers == 3 && m.dspark_target_layer[0] == 40 && m.dspark_target_layer[2] == 42);
    cr_assert_eq(m.compress_ratio[45], 0);
}

Test(config, missing_file_and_unknown_preset)
{
    struct pd_model m;
    pd_err e = {0};
    cr_assert_neq(pd_model_load("no-such-model", &m, &e), 0);
    cr_assert(strstr(e.msg, "no-such-model") && strstr(e.msg, "presets: "), "%s", e.msg);
    cr_assert(strstr(e.msg, "deepseek-v4-flash"), "%s", e.msg);
}

/* A careless or confused user at the planner's command line: a flag given twice, numbers that
 * would overflow what they size, a context past the model's positions, a typo in a hardware or
 * validation file, a layout key given twice, a stray argument, text that would break out of an
 * emitted script's comments; each one a one-line error naming what is wrong, never a crash, a
 * negative size or a silently ignored field. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../run.h"
#include "cli/cli.h"
#include "plan/launch.h"

/* pdmoe args fails with a one-line error (no crash) holding each of the needles (NULL-ended). */
static void refused(const char *args, const char *needle, const char *needle2)
{
    struct run r;
    run(args, &r);
    cr_assert(r.status == 1 || r.status == 2 || r.status == PD_CLI_EXIT_CONFIG, "pdmoe %s: exit %d (%s)", args,
              r.status, r.err);
    cr_assert(strstr(r.err, needle), "pdmoe %s: stderr \"%s\" lacks \"%s\"", args, r.err, needle);
    cr_assert(!needle2 || strstr(r.err, needle2), "pdmoe %s: stderr \"%s\" lacks \"%s\"", args, r.err, needle2);
    cr_assert_eq(strchr(r.err, '\n'), r.err + strlen(r.err) - 1, "more than one line: %s", r.err);
}

/* A file in a fresh temporary directory holding text; its path in path[256]. */
static void write_tmp(const char *name, const char *text, char *path)
{
    char dir[] = "/tmp/pdmoe-careless-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, 256, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

static void remove_tmp(const char *path)
{
    char dir[256];
    snprintf(dir, sizeof dir, "%s", path);
    remove(path);
    *strrchr(dir, '/') = 0;
    rmdir(dir);
}

/* j written to a temporary file `name` (j freed); `pdmoe ARGS`, args_fmt's %s the file's path,
 * refused naming the path and `needle`. */
static void refused_with_file(json_t *j, const char *name, const char *args_fmt, const char *needle)
{
    char path[256], args[512];
    char *txt = json_dumps(j, 0);
    write_tmp(name, txt, path);
    free(txt);
    json_decref(j);
    snprintf(args, sizeof args, args_fmt, path);
    refused(args, path, needle);
    remove_tmp(path);
}

/* --checkpoint twice once crashed (strcmp on the NULL the first one left); the config the plan
 * reads does not hang on the order of --model and --checkpoint. */
Test(careless, checkpoint_twice_and_its_order_with_model)
{
    refused("plan --checkpoint /nonexistent-a --checkpoint /nonexistent-b", "/nonexistent-b", NULL);
    struct run a, b;
    run("plan --model deepseek-v4-flash --checkpoint /nonexistent-c", &a);
    run("plan --checkpoint /nonexistent-c --model deepseek-v4-flash", &b);
    cr_assert_eq(a.status, b.status);
    cr_assert_str_eq(a.err, b.err);
}

/* Sizes whose products would overflow 64 bits are refused by name instead of planned as negative
 * gigabytes; a context longer than the model's positions too (vLLM would not start with it). */
Test(careless, numbers_past_what_they_size_are_refused)
{
    refused("plan --max-num-seqs 70000000000", "--max-num-seqs 70000000000", "at most");
    refused("plan --max-model-len 9223372036854775807", "--max-model-len 9223372036854775807", "max_position_embeddings");
    refused("plan --max-model-len 2000000 --max-num-seqs 1", "--max-model-len 2000000", "max_position_embeddings 1048576");
    refused("plan --max-num-batched-tokens 9000000000000", "--max-num-batched-tokens 9000000000000", "at most");
    refused("plan --kv-bytes-per-token 9000000000000", "--kv-bytes-per-token 9000000000000", "at most");
    refused("plan --handoff-tokens 9000000000000", "--handoff-tokens", "at most");
    struct run r;
    run("plan --max-model-len 1048576 --max-num-seqs 1", &r);
    cr_assert_eq(r.status, 0, "the model's own length: %s", r.err);
    /* a layout's cards wrapped an int (2^42 planned as a layout of 0 prefill cards that fit), and a
     * negative count times K wrapped to 1024 */
    refused("plan --prefill dp=4096,tp=1,instances=1048576", "4294967296 cards", "at most 1048576");
    refused("plan --max-num-seqs -9223372036854775807K", "--max-num-seqs -9223372036854775807K", "expected an integer");
    /* a KV scenario past 2^63 bytes is said not to fit, not printed as 0 GB */
    run("plan --max-model-len 1048576 --max-num-seqs 1048576 --kv-bytes-per-token 16777216", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert_null(strstr(r.out, "1048576   1048576     0.00 GB"), "%s", r.out);
}

/* A search the host cannot hold is refused at once, naming --cards: --cards 4096 (its maximum)
 * costed 73 million layouts for 3 minutes in about 12 GB. */
Test(careless, a_search_too_large_to_hold_is_refused_at_once)
{
    refused("search --cards 4096", "--cards 4096: 67001848 prefill x decode layouts", "search fewer cards");
}

/* search --json at a request rate some layouts cannot sustain: their TTFT is null, as in plan
 * --json (json_pack refused the infinity: the layouts fell out of the front, and past some rate
 * the whole document was reported as out of memory). */
Test(careless, search_json_at_an_unsustainable_rate)
{
    struct run r;
    run("search --request-rate 1000 --json", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    json_t *j = json_loads(r.out, 0, NULL);
    cr_assert_not_null(j, "not JSON: %.300s", r.out);
    json_t *front = json_object_get(j, "front");
    cr_assert_gt(json_array_size(front), 0);
    cr_assert(json_is_null(json_object_get(json_array_get(front, 0), "ttft_s")), "%s",
              json_dumps(json_array_get(front, 0), 0));
    json_decref(j);
}

/* A key of a hardware file or of a validation case that nothing reads is a typo: it would leave
 * the field at its default (fp8_flop for fp8_flops planned FP8 at the bf16 rate) without a word. */
Test(careless, unknown_keys_of_hardware_and_case_files_are_named)
{
    static char text[1 << 16];
    cr_assert_gt(slurp("hardware/h800.json", text, sizeof text), 100);
    json_t *j = json_loads(text, 0, NULL);
    cr_assert_not_null(j);
    json_t *card = json_object_get(j, "card");
    cr_assert(json_is_object(card));
    json_object_set(card, "fp8_flop", json_object_get(card, "fp8_flops"));
    json_object_del(card, "fp8_flops");
    refused_with_file(j, "h800.json", "plan --model deepseek-v3 --hardware %s", "card.fp8_flop");

    cr_assert_gt(slurp("validation/published.json", text, sizeof text), 100);
    j = json_loads(text, 0, NULL);
    cr_assert_not_null(j);
    json_t *c0 = json_array_get(json_is_array(j) ? j : json_object_get(j, "cases"), 0);
    cr_assert(json_is_object(c0), "no first case");
    json_object_set_new(c0, "imbalanse", json_real(1.3));
    refused_with_file(j, "cases.json", "validate --cases %s", "imbalanse");
}

/* A layout with a key twice, or an empty key, is a typo, not the last value. */
Test(careless, a_layout_key_twice_is_refused)
{
    refused("plan --prefill dp=8,dp=16,tp=1,instances=1", "--prefill", "dp given twice");
    refused("plan --prefill dp=8,tp=1,instances=1,", "--prefill", "empty");
    /* lists whose empty or repeated entries were dropped or overwritten without a word */
    refused("plan --handoff-tokens 1,,2", "--handoff-tokens 1,,2", "empty entry");
    refused("plan --quant-override routed_experts=fp4,routed_experts=bf16", "--quant-override",
            "routed_experts is given twice");
}

/* The report's numbers are the ones the rest of pdmoe takes: a longest context past the model's
 * positions is capped there (serve refuses a --max-model-len past them), and a memory fraction
 * two decimals would round is printed as given (0.0402 read "x 0.04 = 3.44 GB"). */
Test(careless, the_reports_context_and_fraction_are_what_serve_takes)
{
    struct run r;
    run("plan --model models/mini --hardware h100 --nodes 2 --prefill dp=1,tp=1,instances=1 "
        "--decode dp=1,tp=1,instances=1 --gpu-memory-utilization 0.0402", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "85.52 GB x 0.0402 = 3.44 GB usable"), "%.300s", r.out);
    const char *l = strstr(r.out, "longest context for 30 sequences");
    cr_assert_not_null(l);
    cr_assert_eq(atoll(l + 36), 65536, "%.120s", l);
    cr_assert(strstr(r.out, "capped at the model's max_position_embeddings 65536"), "%.300s", l);
}

/* Arguments a command does not take are refused, as plan refuses them. */
Test(careless, stray_arguments_are_refused)
{
    refused("gen-model --preset v4-tiny --out /tmp/pdmoe-never-written bogusarg", "unexpected argument \"bogusarg\"", NULL);
    refused("convert --checkpoint /nonexistent --quantization w8a8 --out /tmp/pdmoe-never-written bogusarg",
            "unexpected argument \"bogusarg\"", NULL);
    cr_assert_neq(access("/tmp/pdmoe-never-written", F_OK), 0);
}

/* What goes into an emitted script's comments cannot start a line of its own: a newline in a path
 * once ran the rest of the path as a command. */
Test(careless, an_emitted_script_keeps_paths_in_their_comments)
{
    refused("plan --emit vllm-ascend --served-model-path \"$(printf 'x\\necho INJECTED')\"", "--served-model-path",
            "control character");
    refused("plan --emit sglang --served-model-path \"$(printf 'x\\recho INJECTED')\"", "--served-model-path",
            "control character");
    /* the model's name goes into the script's MODEL_PATH message: a word the shell does not expand */
    struct run r;
    run("plan --emit vllm-ascend --model v4-tiny --prefill dp=2,tp=1,instances=1 --decode dp=2,tp=1,instances=1 "
        "> /tmp/pdmoe-careless.sh", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    char script[1 << 16];
    slurp("/tmp/pdmoe-careless.sh", script, sizeof script);
    remove("/tmp/pdmoe-careless.sh");
    for (char *line = strtok(script, "\n"); line; line = strtok(NULL, "\n"))
        cr_assert_null(strstr(line, "${MODEL_PATH:?"), "a message expanded by the shell: %s", line);
}

/* `--mtp on` for a model without an MTP layer is refused as --speculative-config is. */
Test(careless, mtp_on_without_an_mtp_layer)
{
    char path[256], args[512];
    write_tmp("config.json",
              "{\"model_type\": \"deepseek_v3\", \"vocab_size\": 1000, \"hidden_size\": 256, \"num_hidden_layers\": 2,"
              " \"num_attention_heads\": 4, \"num_key_value_heads\": 4, \"q_lora_rank\": 64, \"kv_lora_rank\": 32,"
              " \"qk_nope_head_dim\": 32, \"qk_rope_head_dim\": 16, \"v_head_dim\": 32, \"intermediate_size\": 512,"
              " \"moe_intermediate_size\": 64, \"n_routed_experts\": 8, \"n_shared_experts\": 1,"
              " \"num_experts_per_tok\": 2, \"first_k_dense_replace\": 1, \"num_nextn_predict_layers\": 0,"
              " \"max_position_embeddings\": 4096}", path);
    snprintf(args, sizeof args, "plan --model %s --mtp on --prefill dp=2,tp=1,instances=1 --decode dp=2,tp=1,instances=1",
             path);
    refused(args, "--mtp on", "no MTP layer");
    remove_tmp(path);
}

/* A preset with one field changed (a number, as JSON text). */
static json_t *changed_preset(const char *preset, const char *key, const char *value)
{
    char file[128], text[1 << 15];
    snprintf(file, sizeof file, "models/%s.json", preset);
    cr_assert_gt(slurp(file, text, sizeof text), 100);
    json_t *j = json_loads(text, 0, NULL);
    cr_assert_not_null(j);
    json_object_set_new(j, key, json_loads(value, JSON_DECODE_ANY, NULL));
    return j;
}

/* Config fields that contradict the architecture the planner builds are refused by name, not
 * planned as if they were not there. */
Test(careless, contradictory_config_fields_are_named)
{
    static const struct { const char *preset, *key, *value, *want; } c[] = {
        {"v4-tiny", "num_key_value_heads", "8", "one KV head"},
        {"deepseek-v3", "moe_layer_freq", "2", "moe_layer_freq"},
        {"deepseek-v3", "intermediate_size", "0", "intermediate_size"},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++)
        refused_with_file(changed_preset(c[i].preset, c[i].key, c[i].value), "config.json", "plan --model %s", c[i].want);
}

/* gen-model builds every tensor in memory before writing: a full-size preset is refused at once
 * with its size (it once grew by 95 MB/s until the kernel killed it), and nothing is created. */
Test(careless, gen_model_refuses_a_checkpoint_past_memory)
{
    refused("gen-model --preset deepseek-v4-flash --out /tmp/pdmoe-never-written", "--preset deepseek-v4-flash",
            "GB (10^9 bytes)");
    cr_assert_neq(access("/tmp/pdmoe-never-written", F_OK), 0);
}

/* search --emit of a layout that misses the targets says so, on stderr and in the script (which may
 * be read alone), rather than handing over a launch script as if it met them. */
Test(careless, search_emit_says_when_the_targets_are_missed)
{
    struct run r;
    run("search --cards 16 --tpot-ms 1 --emit sglang", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.err, "no layout meets the targets"), "%s", r.err);
    cr_assert(strncmp(r.out, "#!/bin/sh\n# NOT MEETING THE TARGETS", 35) == 0, "%.300s", r.out);
    run("search --cards 16 --emit sglang", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert_null(strstr(r.out, "NOT MEETING"), "without targets every fitting layout meets them");
}

/* Smaller things a user acts on: each message names what to do, each number is one the rest agrees
 * with. */
Test(careless, messages_name_what_to_do)
{
    refused("search --cards 16 --max-tp 3", "--max-tp 3", "a power of two");
    refused("plan --decode dp=24,tp=1,instances=1 --prefill dp=8,tp=1,instances=1 --nodes 8", "redundant=R in --prefill/--decode",
            NULL);
    refused("plan --threads 4", "--threads only applies with --emit pdmoe", NULL);
    refused("plan --hardware /tmp", "--hardware /tmp: is a directory", NULL);
    refused("plan --expert-stats /tmp", "/tmp: is a directory", NULL);
    /* a model directory that is not there is named by its flag, not as its tokenizer.json */
    refused("generate --model /nonexistent-pdmoe-model --prompt a", "--model /nonexistent-pdmoe-model: no such directory",
            NULL);
    refused("serve --model /nonexistent-pdmoe-model --port 1", "--model /nonexistent-pdmoe-model: no such directory",
            NULL);
    struct run r;
    run("search --cards 2", &r);
    cr_assert_null(strstr(r.out, " x ? ("), "%.200s", r.out);
    cr_assert(strstr(r.out, "on 2 x Ascend 910B"), "%.200s", r.out);
    /* a rate past what prefill sustains: its TTFT is no number (null), not -1 */
    run("plan --isl 4096 --osl 1024 --request-rate 1000 --json", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    json_t *j = json_loads(r.out, 0, NULL);
    cr_assert_not_null(j);
    json_t *perf = json_object_get(j, "perf");
    cr_assert(json_is_object(perf), "no perf in plan --json");
    json_t *v = json_object_get(perf, "ttft_at_rate_s");
    cr_assert(v && json_is_null(v), "ttft_at_rate_s: %s", v ? json_dumps(v, JSON_ENCODE_ANY) : "absent");
    json_decref(j);
}

/* A flag given twice (a command pasted from two recipes) is refused naming both values, in every
 * subcommand; aliases count as one flag. Before, the last one won and the first was dropped
 * without a word. */
Test(careless, a_flag_given_twice_is_refused_in_every_subcommand)
{
    refused("plan --max-model-len 4096 --max-model-len 1024", "--max-model-len given twice (4096, then 1024)",
            "give it once");
    refused("plan --json --json", "--json given twice", NULL);
    refused("search --cards 8 --cards 16", "--cards given twice (8, then 16)", NULL);
    refused("serve --model models/mini --port 0 --max-num-seqs 4 --max-num-seqs 8", "pdmoe serve: --max-num-seqs given twice",
            NULL);
    refused("serve --model models/mini --max-connections 4 --max-connections 8", "--max-connections given twice", NULL);
    refused("up --kv-cache-memory-bytes 1000 --kv-cache-bytes 2000", "pdmoe up: --kv-cache-bytes given twice (1000, then 2000)",
            NULL);
    refused("generate --model models/mini --prompt a --max-tokens 2 --max-tokens 3",
            "pdmoe generate: --max-tokens given twice (2, then 3)", NULL);
    refused("gen-model --preset mini --preset v4-tiny --out /nonexistent", "pdmoe gen-model: --preset given twice", NULL);
    refused("calibrate --threads 1 --threads 2", "pdmoe calibrate: --threads given twice", NULL);
    /* --out is written after minutes of measuring: a path that cannot be written is said first */
    refused("calibrate --quick --out /nonexistent/dir/hw.json",
            "pdmoe calibrate: --out /nonexistent/dir/hw.json: cannot write: No such file or directory", NULL);
    refused("convert --out /a --out /b", "pdmoe convert: --out given twice", NULL);
    refused("proxy --decode 127.0.0.1:1 --port 1 --port 2", "pdmoe proxy: --port given twice (1, then 2)", NULL);
}

/* A hand-off of a prompt longer than the model's positions is refused by name; the default
 * lengths a small model cannot hold are left out, its full length shown instead. */
Test(careless, a_handoff_past_the_models_positions_is_refused)
{
    refused("plan --model models/mini --handoff-tokens 8000,100000", "--handoff-tokens 100000",
            "max_position_embeddings 65536");
    struct run r;
    run("plan --model models/v4-tiny.json --prefill dp=8,tp=1,instances=1 --decode dp=16,tp=1,instances=1 --json", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    json_t *j = json_loads(r.out, 0, NULL);
    cr_assert_not_null(j, "not JSON: %.200s", r.out);
    json_t *h = json_object_get(j, "handoff");
    cr_assert(json_is_array(h) && json_array_size(h) == 1, "hand-off rows: %s", r.out);
    cr_assert_eq(json_integer_value(json_object_get(json_array_get(h, 0), "tokens")), 4096);
    json_decref(j);
}

/* --prefill and --decode of the proxy may repeat, as sglang-router's do: each adds its instances
 * (the second once overwrote the first's list in place: its first instance was lost and the
 * second's counted twice). */
Test(careless, the_proxys_instance_flags_add_up)
{
    const char *bin = getenv("PDMOE_BIN") ? getenv("PDMOE_BIN") : "build/pdmoe";
    char cmd[512];
    snprintf(cmd, sizeof cmd, "timeout -s INT 1.5 %s proxy --prefill 127.0.0.1:1 --prefill 127.0.0.1:2,127.0.0.1:3 "
             "--decode 127.0.0.1:4 --port 0 --health-interval-ms 100", bin);
    static struct run r;
    run_cmd(cmd, &r);
    cr_assert(strstr(r.err, "(prefill 3, decode 1 instances)"), "%s", r.err);
    for (int p = 1; p <= 3; p++) {
        char want[96];
        snprintf(want, sizeof want, "prefill instance 127.0.0.1:%d is not up yet", p);
        cr_assert(strstr(r.err, want), "%s not in: %s", want, r.err);
    }
}

/* PDMOE_API_KEY (VLLM_API_KEY's counterpart) stands for --api-key, off the command line; set
 * empty it is refused, as an empty --api-key is. */
Test(careless, an_empty_api_key_from_the_environment_is_refused)
{
    const char *bin = getenv("PDMOE_BIN") ? getenv("PDMOE_BIN") : "build/pdmoe";
    static const char *const cmds[] = {"serve --model models/mini --port 0", "proxy --decode 127.0.0.1:1 --port 0",
                                       "up --port 1"};
    for (int k = 0; k < 3; k++) {
        char cmd[256];
        snprintf(cmd, sizeof cmd, "PDMOE_API_KEY= timeout 20 %s %s", bin, cmds[k]);
        static struct run r;
        run_cmd(cmd, &r);
        cr_assert_eq(r.status, 2, "%s: exit %d %s", cmds[k], r.status, r.err);
        cr_assert(strstr(r.err, "PDMOE_API_KEY: empty key"), "%s: %s", cmds[k], r.err);
    }
}

/* A card whose weights fit but whose step's activations do not (max-num-seqs 100000) was said to
 * be one whose "weights do not fit", sending the operator to quantise harder instead of lowering
 * the batch. */
Test(careless, activations_past_the_card_are_named_not_blamed_on_the_weights)
{
    refused("plan --max-num-seqs 100000 --emit vllm-ascend", "decode: the weights and activations do not fit a card",
            "lower --max-num-seqs or --max-num-batched-tokens");
}

/* A checkpoint path holding a quote ran the rest of it as shell commands (bench convert sized the
 * directory with `du '%s'`; bench ep ran mpirun through a shell the same way). */
Test(careless, a_quote_in_a_benchs_path_runs_nothing)
{
    const char *bin = getenv("PDMOE_BIN") ? getenv("PDMOE_BIN") : "build/pdmoe";
    char base[] = "/tmp/pdmoe-quote-XXXXXX";
    cr_assert_not_null(mkdtemp(base));
    char dir[200], mark[64], cmd[1200];
    snprintf(mark, sizeof mark, "%s/ran", base);
    snprintf(dir, sizeof dir, "%s/x'; touch %s; echo '", base, mark);
    snprintf(cmd, sizeof cmd, "mkdir -p \"%s\" && %s gen-model --preset v4-tiny --format release --out \"%s\" > /dev/null && "
             "%s bench convert --checkpoint \"%s\" --quick > /dev/null 2>&1", dir, bin, dir, bin, dir);
    int rc = system(cmd);
    cr_assert_neq(access(mark, F_OK), 0, "a quote in --checkpoint ran a command");
    cr_assert_eq(rc, 0, "bench convert failed on the quoted path");
    snprintf(cmd, sizeof cmd, "rm -rf %s", base);
    cr_assert_eq(system(cmd), 0);
}

/* Bench counts with trailing letters ran as the number before them (atoi: "--steps 10abc" was 10);
 * a refused --ranks with --json left the start of a JSON object on stdout; --quick silently
 * replaced an explicit --steps. */
Test(careless, bench_counts_are_whole_numbers_and_json_is_all_or_nothing)
{
    refused("bench decode --steps 10abc", "--steps 10abc", NULL);
    refused("bench decode --threads 2x", "--threads 2x", NULL);
    refused("bench decode --steps 100 --quick", "--quick runs 4 steps; give it or --steps, not both", NULL);
    refused("bench ep --ranks 1x", "--ranks 1x: each a whole number", NULL);
    refused("bench serve --num-turns 3", "--num-turns belongs to --dataset multi-turn, not this run's random", NULL);
    refused("bench serve --dataset multi-turn --gsp-num-groups 2", "--gsp-num-groups belongs to --dataset "
            "generated-shared-prefix", NULL);
    refused("bench serve --num-prompts 2 --num-prompts 3", "--num-prompts given twice (2, then 3)", NULL);
    struct run r;
    run("bench ep --ranks 2,0 --json", &r);
    cr_assert_eq(r.status, 2, "%s", r.err);
    cr_assert_str_eq(r.out, "", "a refused run printed part of its JSON: %s", r.out);
}

/* --quick shrinks the defaults only: it once replaced an explicit --tokens and --reps (a 64,128
 * request ran 64 tokens once), and bench soak's took the last of --quick and --streams. */
Test(careless, quick_leaves_explicit_values_alone)
{
    struct run r;
    run("bench prefill --quick --tokens 64,128 --reps 2 --threads 1 --json", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    json_t *j = json_loads(r.out, 0, NULL);
    cr_assert_not_null(j, "%s", r.out);
    cr_assert_eq(json_integer_value(json_object_get(j, "reps")), 2, "%s", r.out);
    json_t *runs = json_object_get(j, "runs");
    cr_assert(json_is_array(runs) && json_array_size(runs) == 2, "%s", r.out);
    cr_assert_eq(json_integer_value(json_object_get(json_array_get(runs, 1), "tokens")), 128);
    json_decref(j);
}

/* bench tokenizer --json printed its JSON by hand: a failure half way left '"results": [' on
 * stdout, and a tokenizer path holding a quote made the JSON invalid. */
Test(careless, bench_tokenizer_json_is_whole_and_escaped)
{
    struct run r;
    run("bench tokenizer --quick --json --tokenizer /nonexistent/tokenizer.json", &r);
    cr_assert_neq(r.status, 0);
    cr_assert_str_eq(r.out, "", "a failed run printed part of its JSON: %s", r.out);
    char dir[] = "/tmp/pdmoe-tokq-XXXXXX", cmd[512], args[512];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(cmd, sizeof cmd, "cp models/mini/tokenizer.json '%s/tok\"q.json'", dir);
    cr_assert_eq(system(cmd), 0);
    snprintf(args, sizeof args, "bench tokenizer --quick --json --tokenizer '%s/tok\"q.json'", dir);
    run(args, &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    json_t *j = json_loads(r.out, 0, NULL);
    cr_assert_not_null(j, "not JSON: %s", r.out);
    json_decref(j);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}

/* Names from files and flags drive no terminal and break no output: an ESC sequence in a hardware
 * file's name (or a bidirectional override) is refused naming the field; a model file's name is
 * shown with its control characters as '?', and cut between characters, so --json holds it (a
 * stem cut inside a character failed the whole --json as "out of memory"); a host starting with
 * '-' (an option to every launcher) is refused; a model directory's trailing slash leaves its
 * name as the served name (it served ''); ':' as a model path or served name is refused (it splits
 * mpirun's command line); a '|' in a validation case's name stays in its cell. */
Test(careless, names_from_inputs_drive_no_terminal_and_break_no_output)
{
    static char text[1 << 16];
    cr_assert_gt(slurp("hardware/h800.json", text, sizeof text), 100);
    json_t *j = json_loads(text, 0, NULL);
    cr_assert_not_null(j);
    json_object_set_new(j, "name", json_string("\x1b[31mRED\x1b]0;TITLE\x07"));
    refused_with_file(j, "hw.json", "plan --model deepseek-v3 --hardware %s", "field \"name\": a control character");
    j = json_loads(text, 0, NULL);
    json_object_set_new(json_object_get(j, "card"), "name", json_string("H800 \xe2\x80\xae" "card"));
    refused_with_file(j, "hw.json", "plan --model deepseek-v3 --hardware %s", "bidirectional override");

    char dir[] = "/tmp/pdmoe-names-XXXXXX", path[512], cmd[1200];
    cr_assert_not_null(mkdtemp(dir));
    char stem[200] = "\x1b[2J";
    for (int i = 0; i < 40; i++)
        strcat(stem, "\xc3\xa9");   /* é: a 64-byte cut falls inside one */
    snprintf(path, sizeof path, "%s/%s.json", dir, stem);
    snprintf(cmd, sizeof cmd, "cp models/deepseek-v4-flash.json '%s'", path);
    cr_assert_eq(system(cmd), 0);
    char args[1024];
    snprintf(args, sizeof args, "plan --model '%s' --json", path);
    struct run r;
    run(args, &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    json_t *p = json_loads(r.out, 0, NULL);
    cr_assert_not_null(p, "not JSON");
    const char *name = json_string_value(json_object_get(json_object_get(p, "model"), "name"));
    cr_assert(name && !strchr(name, '\x1b') && name[0] == '?', "model name %s", name ? name : "(none)");
    json_decref(p);
    snprintf(args, sizeof args, "plan --model '%s'", path);
    run(args, &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert_null(strchr(r.out, '\x1b'), "an ESC reached the text output");
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);

    refused("plan --emit vllm-ascend --hosts -h,--help,n2,n3,n4,n5,n6,n7", "--hosts: host 1 \"-h\"", "not starting with '-'");
    refused("up --model :", "the model path ':' would end mpirun's command", NULL);
    refused("up --model models/mini --served-model-name :", "the served model name ':'", NULL);
    char sb[64];
    cr_assert_str_eq(pd_launch_served_name("models/mini/", sb, sizeof sb), "mini");
    cr_assert_str_eq(pd_launch_served_name("mini", sb, sizeof sb), "mini");
    cr_assert_str_eq(pd_launch_served_name("/a/b//", sb, sizeof sb), "b");
}

/* A KV pool past the memory left with the weights loaded is refused at start, naming the flag and
 * where the figure comes from: it was allocated untouched and would have filled under load until
 * the OOM killer ended the server. The pool asked for is this machine's MemTotal, which malloc
 * grants (the kernel's default overcommit refuses only more than RAM and swap) and MemAvailable
 * never reaches; it is checked before it is allocated. */
Test(careless, a_kv_pool_past_the_memory_left_is_refused_at_start)
{
    FILE *f = fopen("/proc/meminfo", "r");
    cr_assert_not_null(f);
    long long kb = 0;
    char line[256];
    while (fgets(line, sizeof line, f) && sscanf(line, "MemTotal: %lld kB", &kb) != 1)
        ;
    fclose(f);
    cr_assert_gt(kb, 0);
    char args[256];
    snprintf(args, sizeof args, "serve --model models/mini --port 0 --kv-cache-memory-bytes %lld", kb * 1024);
    refused(args, "--kv-cache-memory-bytes: the KV pool of", "of memory left with the weights loaded (");
    /* four times the machine (which the kernel, or a sanitizer's allocator, would refuse outright) */
    snprintf(args, sizeof args, "serve --model models/mini --port 0 --kv-cache-memory-bytes %lld", 4 * kb * 1024);
    refused(args, "--kv-cache-memory-bytes: ", "KV pool");
}

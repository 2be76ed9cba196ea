/* A careless operator's checkpoint directory: files that do not belong together or are not what
 * their names say. Each is refused when the model is loaded, naming the file and what is wrong,
 * before a request can meet it. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../run.h"
#include "../tmpmodel.h"

/* Every `pdmoe ARGS` (args_fmt's %s the model directory) fails with exit 1 and a stderr holding
 * each needle. */
static void refused_in(const char *dir, const char *args_fmt, const char *needle, const char *needle2)
{
    char args[1024];
    struct run r;
    snprintf(args, sizeof args, args_fmt, dir);
    /* (through timeout: a file that blocks must fail the test, not hang it) */
    const char *bin = getenv("PDMOE_BIN");
    char line[1200];
    snprintf(line, sizeof line, "timeout 120 %s %s", bin ? bin : "build/pdmoe", args);
    run_cmd(line, &r);
    cr_assert_eq(r.status, 1, "pdmoe %s: exit %d (%s)", args, r.status, r.err);
    cr_assert(strstr(r.err, needle), "pdmoe %s: stderr \"%s\" lacks \"%s\"", args, r.err, needle);
    cr_assert(!needle2 || strstr(r.err, needle2), "pdmoe %s: stderr \"%s\" lacks \"%s\"", args, r.err, needle2);
}

/* A tokenizer with ids past the model's rows (another model's tokenizer.json beside these
 * weights) used to load: its ids reached the engine, whose range check then failed the whole
 * step, every request in it, and under expert parallelism the group. */
Test(model_files, a_tokenizer_larger_than_the_model_is_refused_at_load)
{
    char dir[64], path[128];
    tmp_model("v4-tiny", 1, dir, sizeof dir);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    json_error_t je;
    json_t *t = json_load_file(path, 0, &je);
    cr_assert_not_null(t, "%s", je.text);
    json_t *added = json_object_get(t, "added_tokens");
    cr_assert(json_is_array(added));
    /* v4-tiny's config.json: vocab_size 512; this token is id 700 */
    json_array_append_new(added, json_pack("{s:i, s:s, s:b, s:b, s:b, s:b, s:b}", "id", 700, "content", "<|extra|>",
                                           "single_word", 0, "lstrip", 0, "rstrip", 0, "normalized", 0, "special", 1));
    cr_assert_eq(json_dump_file(t, path, 0), 0);
    json_decref(t);
    refused_in(dir, "generate --model %s --prompt hi --max-tokens 2", "tokenizer.json: token ids go up to 700",
               "vocabulary (config.json vocab_size) has 512 rows");
    refused_in(dir, "serve --model %s --port 18971 --max-model-len 256", "tokenizer.json: token ids go up to 700",
               "has 512 rows");
    rm_model(dir);
}

/* A FIFO where a weight or config file should be (a half-made copy, a mistaken mkfifo) used to
 * block generate, convert and plan --checkpoint forever in open(). */
Test(model_files, a_fifo_in_place_of_a_file_is_named_not_waited_on)
{
    char dir[64], path[128];
    tmp_model("v4-tiny", 1, dir, sizeof dir);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    cr_assert_eq(unlink(path), 0);
    cr_assert_eq(mkfifo(path, 0600), 0);
    refused_in(dir, "generate --model %s --prompt hi --max-tokens 2", "model.safetensors: a FIFO, not a regular file",
               NULL);
    refused_in(dir, "plan --checkpoint %s --prefill dp=2,tp=1,instances=1 --decode dp=2,tp=1,instances=1 --nodes 1",
               "model.safetensors: a FIFO, not a regular file", NULL);
    unlink(path);
    snprintf(path, sizeof path, "%s/config.json", dir);
    cr_assert_eq(unlink(path), 0);
    cr_assert_eq(mkfifo(path, 0600), 0);
    refused_in(dir, "generate --model %s --prompt hi --max-tokens 2", "config.json: a FIFO, not a regular file", NULL);
    /* the planner's files too: they once waited on the FIFO forever (--hardware: "no such file") */
    refused_in(path, "validate --cases %s", "config.json: a FIFO, not a regular file", NULL);
    refused_in(path, "plan --spec-stats %s", "config.json: a FIFO, not a regular file", NULL);
    refused_in(path, "search --cards 16 --spec-stats %s", "config.json: a FIFO, not a regular file", NULL);
    refused_in(path, "plan --hardware %s", "config.json: a FIFO, not a regular file", NULL);
    rm_model(dir);
}

/* --hardware NAME reads hardware/NAME.json on disk, as its help says, before the preset of that
 * name built in: an edited preset (here 1,000 GB cards) was shown as read from the file while the
 * built-in copy's numbers were used. */
Test(model_files, an_edited_preset_on_disk_is_the_one_planned_with)
{
    char dir[64], path[160];
    tmp_model("v4-tiny", 1, dir, sizeof dir);
    snprintf(path, sizeof path, "%s/hardware", dir);
    cr_assert_eq(mkdir(path, 0755), 0);
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "sed 's/\"memory_bytes\": *[0-9][0-9.e+]*/\"memory_bytes\": 1e12/' hardware/h100.json > %s/h100.json",
             path);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    const char *bin = getenv("PDMOE_BIN") ? getenv("PDMOE_BIN") : "build/pdmoe";
    char abs[600];
    cr_assert_not_null(realpath(bin, abs));
    snprintf(cmd, sizeof cmd, "cd %s && %s plan --hardware h100 --json", dir, abs);
    struct run r;
    run_cmd(cmd, &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "\"card_memory_bytes\": 1000000000000"), "%.400s", strstr(r.out, "\"hardware\""));
    snprintf(cmd, sizeof cmd, "rm -rf %s/hardware", dir);
    cr_assert_eq(system(cmd), 0);
    rm_model(dir);
}

/* A context past the model's positions was served (its /v1/models advertised it); vLLM refuses it,
 * as `pdmoe plan` does. v4-tiny's config: max_position_embeddings 4096. */
Test(model_files, a_context_past_the_models_positions_is_refused)
{
    char dir[64];
    tmp_model("v4-tiny", 1, dir, sizeof dir);
    refused_in(dir, "serve --model %s --port 18973 --max-model-len 8192",
               "--max-model-len 8192: more than the model's max_position_embeddings 4096", "config.json");
    rm_model(dir);
}

/* plan --checkpoint took config.json's word for the experts: a config under-stating them (8 of 16)
 * planned half their bytes, with only a note that some tensors were not counted, and one
 * over-stating them (32) placed experts that do not exist. Both are refused by name. */
Test(model_files, a_config_that_miscounts_the_experts_is_refused_by_plan)
{
    char dir[64], path[128];
    tmp_model("v4-tiny", 1, dir, sizeof dir);   /* 16 routed experts */
    snprintf(path, sizeof path, "%s/config.json", dir);
    static const char *const args = "plan --checkpoint %s --prefill dp=2,tp=1,instances=1 --decode dp=2,tp=1,instances=1 "
                                    "--nodes 1";
    for (int k = 0; k < 2; k++) {
        json_error_t je;
        json_t *c = json_load_file(path, 0, &je);
        cr_assert_not_null(c, "%s", je.text);
        json_object_set_new(c, "n_routed_experts", json_integer(k ? 32 : 8));
        cr_assert_eq(json_dump_file(c, path, JSON_INDENT(2)), 0);
        json_decref(c);
        if (k == 0)
            refused_in(dir, args, "but config.json's n_routed_experts is 8: the config does not describe these weights", "routed expert 1");
        else
            refused_in(dir, args, "n_routed_experts is 32, but the tensors hold 16 routed experts (none for expert 16)",
                       NULL);
    }
    rm_model(dir);
}

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
#include "cli/cli.h"

/* Every `pdmoe ARGS` (args_fmt's %s the model directory) fails with exit 1 (serve: or 78) and a
 * stderr holding each needle. */
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
    /* (serve refuses what it was given at start with EX_CONFIG, which pdmoe up does not retry) */
    cr_assert(r.status == 1 || (!strncmp(args, "serve ", 6) && r.status == PD_CLI_EXIT_CONFIG),
              "pdmoe %s: exit %d (%s)", args, r.status, r.err);
    cr_assert(strstr(r.err, needle), "pdmoe %s: stderr \"%s\" lacks \"%s\"", args, r.err, needle);
    cr_assert(!needle2 || strstr(r.err, needle2), "pdmoe %s: stderr \"%s\" lacks \"%s\"", args, r.err, needle2);
}

/* dir's tokenizer.json, parsed; its path in path[128]. */
static json_t *tokenizer_of(const char *dir, char *path)
{
    snprintf(path, 128, "%s/tokenizer.json", dir);
    json_error_t je;
    json_t *t = json_load_file(path, 0, &je);
    cr_assert_not_null(t, "%s", je.text);
    return t;
}

/* A tokenizer with ids past the model's rows (another model's tokenizer.json beside these
 * weights) used to load: its ids reached the engine, whose range check then failed the whole
 * step, every request in it, and under expert parallelism the group. */
Test(model_files, a_tokenizer_larger_than_the_model_is_refused_at_load)
{
    char dir[64], path[128];
    tmp_model("v4-tiny", 1, dir, sizeof dir);
    json_t *t = tokenizer_of(dir, path);
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

/* The header of dir/model.safetensors (its JSON) and the file offset where its data begin. */
static json_t *st_header(const char *dir, long *data_at, size_t *hlen)
{
    char path[256];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f);
    uint64_t n = 0;
    cr_assert_eq(fread(&n, 8, 1, f), 1);
    char *h = malloc(n + 1);
    cr_assert_eq(fread(h, 1, n, f), n);
    h[n] = 0;
    fclose(f);
    json_error_t je;
    json_t *j = json_loads(h, 0, &je);
    cr_assert_not_null(j, "%s", je.text);
    free(h);
    *data_at = (long)(8 + n);
    *hlen = (size_t)n;
    return j;
}

/* Writes n bytes over tensor `name`'s data at byte `at`, the bytes that were there into old. */
static void st_poke(const char *dir, const char *name, long at, const void *bytes, void *old, size_t n)
{
    long data;
    size_t hl;
    json_t *h = st_header(dir, &data, &hl);
    json_t *t = json_object_get(h, name);
    cr_assert_not_null(t, "no tensor %s", name);
    long off = data + (long)json_integer_value(json_array_get(json_object_get(t, "data_offsets"), 0)) + at;
    json_decref(h);
    char path[256];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *f = fopen(path, "r+b");
    cr_assert_not_null(f);
    cr_assert_eq(fseek(f, off, SEEK_SET), 0);
    cr_assert_eq(fread(old, 1, n, f), n);
    cr_assert_eq(fseek(f, off, SEEK_SET), 0);
    cr_assert_eq(fwrite(bytes, 1, n, f), n);
    cr_assert_eq(fclose(f), 0);
}

/* Adds tensor `name` (BF16 [4], zeros) at the end of dir/model.safetensors: the header rewritten
 * (padded to 8 bytes), the data moved after it. */
static void st_add(const char *dir, const char *name)
{
    long data;
    size_t hl;
    json_t *h = st_header(dir, &data, &hl);
    char path[256];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    size_t nd = (size_t)(size - data);
    char *d = malloc(nd + 8);
    fseek(f, data, SEEK_SET);
    cr_assert_eq(fread(d, 1, nd, f), nd);
    fclose(f);
    memset(d + nd, 0, 8);
    json_object_set_new(h, name, json_pack("{s:s,s:[i],s:[I,I]}", "dtype", "BF16", "shape", 4, "data_offsets",
                                           (json_int_t)nd, (json_int_t)nd + 8));
    char *txt = json_dumps(h, JSON_COMPACT);
    json_decref(h);
    size_t n = strlen(txt), padded = (n + 7) & ~(size_t)7;
    uint64_t len = padded;
    f = fopen(path, "wb");
    cr_assert_not_null(f);
    fwrite(&len, 8, 1, f);
    fwrite(txt, 1, n, f);
    for (size_t i = n; i < padded; i++)
        fputc(' ', f);
    fwrite(d, 1, nd + 8, f);
    cr_assert_eq(fclose(f), 0);
    free(txt);
    free(d);
}

/* A tensor the engine does not read (a bias it does not implement, a layer past the config's) was
 * loaded past without a word: the model run was not the file's. Refused, named with its file. */
Test(model_files, a_tensor_the_engine_does_not_read_is_refused)
{
    char dir[64];
    tmp_model("v4-tiny", 1, dir, sizeof dir);
    st_add(dir, "layers.0.attn.wq_a.bias");
    refused_in(dir, "generate --model %s --prompt hi --max-tokens 2 --threads 1",
               "tensor \"layers.0.attn.wq_a.bias\" is not one the engine reads", "model.safetensors");
    rm_model(dir);
}

/* A NaN or an infinity among the weights (a corrupt file, a conversion that overflowed) made every
 * logit NaN: generate exited 0 printing token 0 for ever. Each is refused at load, naming the
 * tensor and the value: a norm (bf16 vector), an int8 matrix's scale (f32), a bf16 matrix read in
 * place. */
Test(model_files, a_weight_that_is_not_finite_is_refused_at_load)
{
    char dir[64];
    tmp_model("v4-tiny", 1, dir, sizeof dir);
    static const struct {
        const char *tensor;
        long at;
        unsigned char bytes[4];
        size_t n;
        const char *want;
    } cases[] = {
        {"norm.weight", 3 * 2, {0xc0, 0x7f}, 2, "tensor \"norm.weight\" value 3 is NaN"},
        {"layers.0.attn.wo_b.weight_scale", 5 * 4, {0, 0, 0x80, 0x7f}, 4,
         "tensor \"layers.0.attn.wo_b.weight_scale\" value 5 is infinite"},
        {"head.weight", (2 * 64 + 1) * 2, {0x80, 0xff}, 2, "tensor \"head.weight\" row 2, column 1 is infinite"},
        /* the embedding, read in place, was the one table never checked: it answered token 0 */
        {"embed.weight", (4 * 64 + 2) * 2, {0xc0, 0x7f}, 2, "tensor \"embed.weight\" row 4, column 2 is NaN"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        unsigned char old[4];
        st_poke(dir, cases[k].tensor, cases[k].at, cases[k].bytes, old, cases[k].n);
        refused_in(dir, "generate --model %s --prompt hi --max-tokens 2 --threads 1", cases[k].want, "model.safetensors");
        unsigned char back[4];
        st_poke(dir, cases[k].tensor, cases[k].at, old, back, cases[k].n);
    }
    struct run r;
    char args[256];
    snprintf(args, sizeof args, "generate --model %s --prompt hi --max-tokens 2 --threads 1", dir);
    run(args, &r);
    cr_assert_eq(r.status, 0, "restored: %s", r.err);
    rm_model(dir);
}

/* A top-level tensor missing (the final norm, the head's mHC mixing) was said without the
 * checkpoint it is missing from: "checkpoint: missing tensor "norm.weight"". */
Test(model_files, a_missing_top_level_tensor_names_the_checkpoint)
{
    char dir[64], path[128];
    tmp_model("v4-tiny", 1, dir, sizeof dir);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *f = fopen(path, "r+b");
    cr_assert(f);
    unsigned char len8[8];
    cr_assert_eq(fread(len8, 1, 8, f), 8);
    size_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | len8[i];
    char *h = malloc(hlen + 1);
    cr_assert_eq(fread(h, 1, hlen, f), hlen);
    h[hlen] = 0;
    char *at = strstr(h, "\"norm.weight\"");   /* renamed in place: the header keeps its length */
    cr_assert(at);
    at[5] = 'W';
    fseek(f, 8, SEEK_SET);
    cr_assert_eq(fwrite(h, 1, hlen, f), hlen);
    fclose(f);
    free(h);
    refused_in(dir, "generate --model %s --prompt hi --max-tokens 2 --threads 1", "missing tensor \"norm.weight\"", dir);
    rm_model(dir);
}

/* A checkpoint truncated (or rewritten in place) under a running server: its next read past the
 * file's end is a SIGBUS, which ended the server as "Caught signal 7 (Bus error)" and a backtrace,
 * nothing naming the file. Now one line names it and says what happened; exit status 1. */
Test(model_files, a_checkpoint_truncated_under_the_server_is_named, .timeout = 120)
{
    char dir[64], line[2048];
    tmp_model("v4-tiny", 1, dir, sizeof dir);
    const char *bin = getenv("PDMOE_BIN") ? getenv("PDMOE_BIN") : "build/pdmoe";
    const char *req = "curl -s -o /dev/null --max-time 20 http://127.0.0.1:$port/v1/completions "
                      "-d '{\"prompt\":\"hello\",\"max_tokens\":3}'";
    snprintf(line, sizeof line,
             "(d=%s; %s serve --model $d --port 0 --threads 1 2> $d/log & p=$!; port=; "
             "for i in $(seq 200); do port=$(sed -n 's/.*http:\\/\\/127.0.0.1:\\([0-9]*\\).*/\\1/p' $d/log); "
             "[ -n \"$port\" ] && break; sleep 0.05; done; %s; truncate -s 300000 $d/model.safetensors; %s; "
             "timeout 20 tail --pid=$p -f /dev/null; kill -9 $p 2>/dev/null; wait $p; echo status=$?; cat $d/log)",
             dir, bin, req, req);
    struct run r;
    run_cmd(line, &r);
    cr_assert(strstr(r.out, "status=1\n"), "%s\n%s", r.out, r.err);
    cr_assert(strstr(r.out, "/model.safetensors: the file changed while this process had it mapped"), "%s", r.out);
    rm_model(dir);
}

/* A float matrix stored transposed ([64, 16] for the router's [16, 64], as many values) ran as if
 * it were the right way round. */
Test(model_files, a_transposed_float_matrix_is_refused)
{
    char dir[64], path[256];
    tmp_model("v4-tiny", 1, dir, sizeof dir);
    long data;
    size_t hl;
    json_t *h = st_header(dir, &data, &hl);
    json_t *t = json_object_get(h, "layers.1.ffn.gate.weight");
    cr_assert_not_null(t);
    json_object_set_new(t, "shape", json_pack("[i, i]", 64, 16));
    char *text = json_dumps(h, JSON_COMPACT);
    json_decref(h);
    size_t n = strlen(text);
    cr_assert_leq(n, hl, "the edited header is longer (%zu > %zu)", n, hl);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *f = fopen(path, "r+b");
    cr_assert_not_null(f);
    cr_assert_eq(fseek(f, 8, SEEK_SET), 0);
    cr_assert_eq(fwrite(text, 1, n, f), n);
    for (size_t i = n; i < hl; i++)
        fputc(' ', f);
    cr_assert_eq(fclose(f), 0);
    free(text);
    refused_in(dir, "generate --model %s --prompt hi --max-tokens 2 --threads 1",
               "tensor \"layers.1.ffn.gate.weight\" has shape [64, 16], the config needs [16, 64]", NULL);
    rm_model(dir);
}

/* Sets config.json's field `key` of dir to v (taken). */
static void config_set(const char *dir, const char *key, json_t *v)
{
    char path[256];
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_error_t je;
    json_t *c = json_load_file(path, 0, &je);
    cr_assert_not_null(c, "%s", je.text);
    json_object_set_new(c, key, v);
    cr_assert_eq(json_dump_file(c, path, JSON_INDENT(2)), 0);
    json_decref(c);
}

/* A router or an MTP depth the engine does not run (scoring_func softmax, topk_method greedy,
 * three MTP layers) was accepted and run as V4's; an unknown topk_method too. */
Test(model_files, a_config_the_engine_does_not_run_is_refused)
{
    char dir[64];
    tmp_model("v4-tiny", 1, dir, sizeof dir);
    static const char *const args = "generate --model %s --prompt hi --max-tokens 2 --threads 1";
    config_set(dir, "scoring_func", json_string("softmax"));
    refused_in(dir, args, "the engine's router is DeepSeek-V4's", "this model's scoring_func is not implemented");
    config_set(dir, "scoring_func", json_string("sqrtsoftplus"));
    config_set(dir, "topk_method", json_string("greedy"));
    refused_in(dir, args, "this model's topk_method is not implemented", NULL);
    config_set(dir, "topk_method", json_string("noaux-tc"));
    refused_in(dir, args, "field \"topk_method\": unknown value \"noaux-tc\"", NULL);
    config_set(dir, "topk_method", json_string("noaux_tc"));
    char path[256];
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_error_t je;
    json_t *c = json_load_file(path, 0, &je);
    cr_assert_not_null(c);
    json_t *cr = json_object_get(c, "compress_ratios");
    cr_assert(json_is_array(cr));
    json_array_append_new(cr, json_integer(0));
    json_array_append_new(cr, json_integer(0));
    json_object_set_new(c, "num_nextn_predict_layers", json_integer(3));
    cr_assert_eq(json_dump_file(c, path, JSON_INDENT(2)), 0);
    json_decref(c);
    refused_in(dir, args, "num_nextn_predict_layers 3: the engine runs one MTP layer", NULL);
    rm_model(dir);
}

/* Sizes past the engine's buffers of one token (a compressed entry, the indexer's head weights,
 * the router's candidates) passed config.json's bounds and crashed the engine with a segmentation
 * fault on the first prompt (gen-model made such checkpoints: head_dim 4096, index_n_heads 512). */
Test(model_files, a_config_past_the_engines_buffers_is_refused)
{
    char dir[64];
    tmp_model("v4-tiny", 1, dir, sizeof dir);
    static const char *const args = "generate --model %s --prompt hi --max-tokens 2 --threads 1";
    static const struct {
        const char *field;
        int v;
        const char *needle;
    } cases[] = {
        {"head_dim", 4096, "field \"head_dim\": 4096; the engine runs at most 2048"},
        {"index_n_heads", 512, "field \"index_n_heads\": 512; the engine runs at most 256"},
        {"index_head_dim", 64, "field \"index_head_dim\": 64; the engine runs at most 32"},
        {"n_routed_experts", 5000, "field \"n_routed_experts\": 5000; the engine runs at most 4096"},
    };
    char path[256];
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_error_t je;
    json_t *orig = json_load_file(path, 0, &je);
    cr_assert_not_null(orig, "%s", je.text);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cr_assert_eq(json_dump_file(orig, path, JSON_INDENT(2)), 0);
        config_set(dir, cases[i].field, json_integer(cases[i].v));
        refused_in(dir, args, cases[i].needle, NULL);
    }
    json_decref(orig);
    rm_model(dir);
}

/* generate ran past the model's positions (serve refused the same length). */
Test(model_files, generate_past_the_models_positions_is_refused)
{
    char dir[64];
    tmp_model("v4-tiny", 1, dir, sizeof dir);
    config_set(dir, "max_position_embeddings", json_integer(8));
    refused_in(dir, "generate --model %s --prompt 'hello world this is long' --max-tokens 20 --threads 1",
               "--max-tokens 20: more than the model's max_position_embeddings 8", NULL);
    rm_model(dir);
}

/* A model directory whose path is long (over 512 bytes, well under PATH_MAX) had its file names
 * cut ("DIR/config.") and failed with an error that named no reason. */
Test(model_files, a_long_model_path_loads)
{
    char dir[64], deep[1024], cmd[2400];
    tmp_model("v4-tiny", 1, dir, sizeof dir);
    int at = snprintf(deep, sizeof deep, "%s", dir);
    for (int k = 0; k < 3; k++) {
        at += snprintf(deep + at, sizeof deep - (size_t)at, "/");
        for (int i = 0; i < 200; i++)
            deep[at++] = (char)('a' + k);
        deep[at] = 0;
    }
    snprintf(cmd, sizeof cmd, "mkdir -p %s && ln -s %s/config.json %s/model.safetensors %s/tokenizer.json %s/", deep, dir,
             dir, dir, deep);
    cr_assert_eq(system(cmd), 0);
    struct run r;
    char args[1400];
    snprintf(args, sizeof args, "generate --model %s --prompt hi --max-tokens 2 --threads 1", deep);
    run(args, &r);
    cr_assert_eq(r.status, 0, "a %zu-byte model path: %s", strlen(deep), r.err);
    snprintf(cmd, sizeof cmd, "rm -rf %s/aaaa*", dir);
    cr_assert_eq(system(cmd), 0);
    rm_model(dir);
}

/* A tokenizer.json whose vocabulary has no byte's token (emptied) loaded: serve then answered
 * every request with an error blaming the client's prompt. It is refused at load. */
Test(model_files, a_vocabulary_without_bytes_is_refused_at_load)
{
    char dir[64], path[128];
    tmp_model("v4-tiny", 1, dir, sizeof dir);
    json_t *t = tokenizer_of(dir, path);
    json_t *model = json_object_get(t, "model");
    json_object_set_new(model, "vocab", json_object());
    json_object_set_new(model, "merges", json_array());
    cr_assert_eq(json_dump_file(t, path, 0), 0);
    json_decref(t);
    refused_in(dir, "generate --model %s --prompt hi --max-tokens 2", "tokenizer.json: field \"model.vocab\"",
               "no byte has a token of its own");
    refused_in(dir, "serve --model %s --port 18975 --max-model-len 256", "tokenizer.json: field \"model.vocab\"",
               "encodes no text");
    rm_model(dir);
}

/* config.json's eos_token_id was never read: one naming another token than the tokenizer's
 * end-of-sentence (config and tokenizer of two models) generated on past the config's stop. */
Test(model_files, a_config_whose_eos_is_not_the_tokenizers_is_refused)
{
    char dir[64];
    tmp_model("v4-tiny", 1, dir, sizeof dir);
    config_set(dir, "eos_token_id", json_integer(183));
    refused_in(dir, "generate --model %s --prompt hi --max-tokens 2 --threads 1",
               "tokenizer.json: the end-of-sentence token is id 1, but config.json's eos_token_id is 183", NULL);
    refused_in(dir, "serve --model %s --port 18977 --max-model-len 256", "config.json's eos_token_id is 183", NULL);
    config_set(dir, "eos_token_id", json_integer(1));
    config_set(dir, "bos_token_id", json_integer(5));
    refused_in(dir, "generate --model %s --prompt hi --max-tokens 2 --threads 1",
               "the begin-of-sentence token is id 0, but config.json's bos_token_id is 5", NULL);
    rm_model(dir);
}

/* tie_word_embeddings true beside a checkpoint's own head.weight ran with the embedding as the
 * head, the stored head unread without a word. */
Test(model_files, a_tied_head_beside_a_stored_head_is_refused)
{
    char dir[64];
    tmp_model("v4-tiny", 1, dir, sizeof dir);
    config_set(dir, "tie_word_embeddings", json_true());
    refused_in(dir, "generate --model %s --prompt hi --max-tokens 2 --threads 1",
               "config.json says tie_word_embeddings true, but the checkpoint has its own head.weight", NULL);
    rm_model(dir);
}

/* A post_processor whose template starts with a token the tokenizer does not hold (a typo in
 * "<｜begin▁of▁sentence｜>") silently fell back to another BOS. */
Test(model_files, a_template_bos_the_tokenizer_lacks_is_refused)
{
    char dir[64], path[128];
    tmp_model("v4-tiny", 1, dir, sizeof dir);
    json_t *t = tokenizer_of(dir, path);
    json_object_set_new(t, "post_processor",
                        json_pack("{s:s, s:[{s:{s:s, s:i}}, {s:{s:s, s:i}}], s:[], s:{}}", "type", "TemplateProcessing",
                                  "single", "SpecialToken", "id", "<nope>", "type_id", 0, "Sequence", "id", "A",
                                  "type_id", 0, "pair", "special_tokens"));
    cr_assert_eq(json_dump_file(t, path, 0), 0);
    json_decref(t);
    refused_in(dir, "generate --model %s --prompt hi --max-tokens 2", "post_processor.single[0].SpecialToken.id",
               "\"<nope>\" is not a token of this tokenizer");
    rm_model(dir);
}

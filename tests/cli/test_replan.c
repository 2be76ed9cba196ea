/* The numbers one command emits pass the checks of another: a launch script from `pdmoe search
 * --emit` (and `pdmoe plan --emit` on a layout whose KV is short) is planned again from the flags
 * it gives each role's servers, and that plan says every sequence those servers admit fits. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

static char *run_out(const char *args)
{
    const char *bin = getenv("PDMOE_BIN");
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s %s 2>&1", bin ? bin : "build/pdmoe", args);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    for (size_t k; (k = fread(buf + n, 1, cap - n - 1, p)) > 0;)
        if ((n += k) == cap - 1)
            buf = realloc(buf, cap *= 2);
    buf[n] = 0;
    int st = pclose(p);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "pdmoe %s failed:\n%s", args, buf);
    return buf;
}

/* The value after `flag ` in the command starting at s (up to the next "&\n"). */
static long long flag_in(const char *s, const char *flag)
{
    const char *end = strstr(s, "&\n"), *q = strstr(s, flag);
    cr_assert(q && (!end || q < end), "no %s in the command:\n%.400s", flag, s);
    return atoll(q + strlen(flag) + 1);
}

struct role_flags {
    int instances, dp, tp, redundant;
    long long max_num_seqs, max_model_len, batched;
    double util;
};

/* Reads each role's flags off a vllm-ascend script: its head servers (one per instance), their
 * --max-num-seqs and the other sizing flags, all equal within a role. */
static void read_script(const char *sh, struct role_flags rf[2])
{
    memset(rf, 0, 2 * sizeof *rf);
    for (const char *c = strstr(sh, "vllm serve "); c; c = strstr(c + 1, "vllm serve ")) {
        const char *end = strstr(c, "&\n");
        cr_assert_not_null(end);
        const char *role = strstr(c, "\"kv_role\":\"kv_");
        cr_assert(role && role < end);
        int r = strncmp(role + 14, "producer", 8) == 0 ? 0 : 1;
        const char *headless = strstr(c, "--headless");
        if (headless && headless < end)
            continue;
        struct role_flags f = {.instances = 1};
        f.dp = (int)flag_in(c, "--data-parallel-size");
        f.tp = (int)flag_in(c, "--tensor-parallel-size");
        f.max_num_seqs = flag_in(c, "--max-num-seqs");
        f.max_model_len = flag_in(c, "--max-model-len");
        f.batched = flag_in(c, "--max-num-batched-tokens");
        const char *u = strstr(c, "--gpu-memory-utilization ");
        f.util = atof(u + strlen("--gpu-memory-utilization "));
        const char *red = strstr(c, "\"num_redundant_experts\":");
        f.redundant = red && red < end ? atoi(red + strlen("\"num_redundant_experts\":")) : 0;
        if (rf[r].instances == 0) {
            rf[r] = f;
        } else {
            cr_assert(rf[r].dp == f.dp && rf[r].max_num_seqs == f.max_num_seqs && rf[r].max_model_len == f.max_model_len,
                      "the %s instances differ", r ? "decode" : "prefill");
            rf[r].instances++;
        }
    }
    cr_assert(rf[0].instances > 0 && rf[1].instances > 0, "no prefill or no decode server in:\n%s", sh);
}

/* Plans the script's layout with role r's --max-num-seqs; returns that role's budget object. */
static void replan_role(const char *model_flags, const struct role_flags rf[2], int r)
{
    char args[1024];
    snprintf(args, sizeof args,
             "plan %s --prefill dp=%d,tp=%d,instances=%d,redundant=%d --decode dp=%d,tp=%d,instances=%d,redundant=%d "
             "--max-num-seqs %lld --max-model-len %lld --max-num-batched-tokens %lld --gpu-memory-utilization %g --json",
             model_flags, rf[0].dp, rf[0].tp, rf[0].instances, rf[0].redundant, rf[1].dp, rf[1].tp, rf[1].instances,
             rf[1].redundant, rf[r].max_num_seqs, rf[r].max_model_len, rf[r].batched, rf[r].util);
    char *out = run_out(args);
    json_error_t je;
    json_t *j = json_loads(out, 0, &je);
    cr_assert_not_null(j, "pdmoe %s: not JSON: %s", args, je.text);
    json_t *b = json_object_get(json_array_get(json_object_get(j, "roles"), (size_t)r), "budget");
    cr_assert_not_null(b, "no roles.%s.budget in the plan", r ? "decode" : "prefill");
    cr_assert(json_is_true(json_object_get(b, "fits")), "%s: one sequence of max-model-len does not fit", args);
    cr_assert(json_is_true(json_object_get(b, "fits_max_num_seqs")),
              "pdmoe %s: the emitted --max-num-seqs %lld of max-model-len %lld do not fit the %s card (%lld fit)", args,
              rf[r].max_num_seqs, rf[r].max_model_len, r ? "decode" : "prefill",
              (long long)json_integer_value(json_object_get(b, "seqs_at_max_model_len")));
    json_decref(j);
    free(out);
}

/* The command: search 64 cards for 4K/1K under TTFT 2 s and TPOT 50 ms, emit vllm-ascend. */
Test(replan, search_emit_then_plan_says_every_admitted_sequence_fits)
{
    char *sh = run_out("search --cards 64 --isl 4096 --osl 1024 --ttft-ms 2000 --tpot-ms 50 --layout disaggregated "
                       "--emit vllm-ascend");
    cr_assert(strstr(sh, "from `pdmoe search --emit vllm-ascend`"), "the header names another command:\n%.300s", sh);
    struct role_flags rf[2];
    read_script(sh, rf);
    /* search and plan share their defaults: pdmoe plan's --max-model-len is 32768 */
    cr_assert_eq(rf[0].max_model_len, 32768);
    cr_assert_eq(rf[1].max_model_len, 32768);
    for (int r = 0; r < 2; r++)
        replan_role("", rf, r);
    free(sh);
}

/* A plan whose decode KV holds 22 of the 30 sequences asked for: the script lowers --max-num-seqs
 * to 22 and says why; prefill likewise; re-planned, both fit. */
Test(replan, plan_emit_lowers_max_num_seqs_to_what_fits)
{
    const char *m = "--model deepseek-v3 --hardware h800 --kv-cache-dtype fp8";
    char args[512];
    snprintf(args, sizeof args, "plan %s --prefill dp=16,instances=2 --decode dp=32,instances=1 --emit sglang", m);
    char *sh = run_out(args);
    cr_assert(strstr(sh, "# 22 sequences per data-parallel rank, not the plan's --max-num-seqs 30"), "%s", sh);
    cr_assert(strstr(sh, "--max-running-requests 704 "), "decode: 22 x dp 32:\n%s", sh);
    free(sh);
    /* the seed's layout with a 512K-token max-model-len: 3.63 GB a sequence (bf16, as vllm-ascend
     * keeps it on 910B), 11 fit a decode card, 1 a prefill card beside its chunks in flight (at 1M
     * tokens, 7.21 GB, none does: the prefill card's pool is 8.37 GB, 4.78 GB of it the chunks') */
    sh = run_out("plan --max-model-len 524288 --emit vllm-ascend");
    cr_assert(strstr(sh, "# 11 sequences per data-parallel rank, not the plan's --max-num-seqs 30"), "%s", sh);
    cr_assert(strstr(sh, "# 1 sequence per data-parallel rank, not the plan's --max-num-seqs 30: 1 of max-model-len\n"
                         "# 524288 fits this prefill card's KV pool beside its chunks in flight"), "%s", sh);
    struct role_flags rf[2];
    read_script(sh, rf);
    for (int r = 0; r < 2; r++)
        replan_role("", rf, r);
    free(sh);
}

/* pdmoe: one program, subcommands. This file only dispatches. */
#include "cli/cli.h"
#include "version.h"   /* build/gen: PDMOE_VERSION and the commit it was built from */

#include <stdio.h>
#include <string.h>

static const struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *help;
} commands[] = {
    {"plan", pd_cli_plan, "per-card weight placement, memory budget, KV capacity and hand-off of a PD deployment"},
    {"gen-model", pd_cli_genmodel, "write a deterministic synthetic checkpoint of a preset (int8 weights, or the release's FP8/FP4)"},
    {"convert", pd_cli_convert, "DeepSeek's released FP8/FP4 checkpoint to the engine's W8A8 layout, shard by shard"},
    {"generate", pd_cli_generate, "run a prompt through the CPU engine and stream the continuation"},
    {"serve", pd_cli_serve, "OpenAI-compatible server on the engine (colocated prefill and decode)"},
    {"up", pd_cli_up, "a local PD cluster in one command: prefill and decode servers and the proxy"},
    {"proxy", pd_cli_proxy, "OpenAI-compatible proxy in front of prefill and decode instances"},
    {"search", pd_cli_search, "layout search: Pareto front of throughput per card vs tokens/s per user, best layout"},
    {"calibrate", pd_cli_calibrate, "measure this machine for a model: a hardware file for plan/search"},
    {"validate", pd_cli_validate, "the performance model against published deployments (Markdown table)"},
    {"tokenize", pd_cli_tokenize, "the ids a tokenizer.json gives a text (to compare with Hugging Face's)"},
    {"bench", pd_cli_bench, "benchmarks, each against a reference measured in the same run (pdmoe bench --help)"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: pdmoe COMMAND [options]   (pdmoe COMMAND --help for its options; pdmoe --version)\n\n"
               "commands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].help);
}

int main(int argc, char **argv)
{
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "-V") == 0) {
        printf("pdmoe %s (commit %s)\n", PDMOE_VERSION, PDMOE_COMMIT);
        return 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (strcmp(argv[1], commands[i].name) == 0)
            return commands[i].run(argc - 1, argv + 1);
    fprintf(stderr, "pdmoe: unknown command \"%s\"\n", argv[1]);
    usage(stderr);
    return 2;
}

/* `pdmoe bench NAME`: dispatch to the benchmarks in bench/. */
#include "cli/cli.h"
#include "bench/bench.h"

#include <stdio.h>
#include <string.h>

static const struct {
    const char *name;
    int (*run)(int, char **);
    const char *flags, *what;
} benches[] = {
    {"plan", pd_bench_plan, "[--quick] [--json]", "planning speed: the seed's plan and its sweep against the 1 ms target"},
    {"kernels", pd_bench_kernels, "[--threads N | --cpu-time] [--quick] [--json]",
     "int8 GEMV/GEMM and the MoE grouped GEMM against oneDNN, this machine's bandwidth and int8 peak"},
    {"decode", pd_bench_decode, "[--model DIR] [--threads N] [--steps N] [--batch 1|16] [--quick] [--json]",
     "decode tokens/s at 1 and N threads (their ratio) against the bandwidth roofline, pool dispatches per step"},
    {"prefill", pd_bench_prefill, "[--model DIR] [--threads 1,2 | --threads 1 --cpu-time] [--tokens 512,1024,2048] [--reps 3] [--quick] [--json]",
     "the engine's prefill tokens/s and each part's share of the step (GEMM, attention, MoE, exchange, other)"},
    {"ep", pd_bench_ep, "[--ranks 1,2,4] [--model DIR] [--quick] [--json | --check]",
     "expert-parallel exchange cost against MPI_Alltoallv of the same volumes, decode across ranks"},
    {"serve", pd_bench_serve, "[--base-url URL] [--max-concurrency C] ... [--json] (see --help)",
     "load against an OpenAI-compatible endpoint, as vllm bench serve"},
    {"soak", pd_bench_soak, "[--quick] [--streams 16] [--seconds 60] [--model DIR] [--port 27500] [--json]",
     "pdmoe up under streaming load with hang-ups and SIGKILLed instances: cut streams and leaks must be 0"},
    {"transfer", pd_bench_transfer,
     "[--quick] [--tls LIST] [--model DIR] [--json]\n"
     "       pdmoe bench transfer --serve HOST:PORT [--timeout S] [--tls LIST] [--json]   (producer, one host)\n"
     "       pdmoe bench transfer --peer HOST:PORT [--tokens N,N,...] [--reps N] [--tls LIST] [--json]   (consumer)",
     "the KV hand-off against one contiguous UCX get of the same bytes, and its share of TTFT; or across hosts"},
    {"convert", pd_bench_convert, "[--checkpoint DIR | --preset P] [--quick] [--json]",
     "pdmoe convert of a release checkpoint against memcpy bandwidth, its peak RSS, FP4->int8 options' errors"},
    {"search", pd_bench_search, "[--quick] [--json]", "layout search speed against the 1 s target"},
    {"tokenizer", pd_bench_tokenizer, "[--quick] [--json] [--tokenizer FILE]",
     "tokenizer encode speed on PCRE2 against the reference backtracking matcher, ids compared"},
};
enum { N_BENCHES = sizeof benches / sizeof benches[0] };

static void bench_usage(FILE *f)
{
    fprintf(f, "usage: pdmoe bench NAME [options]   (pdmoe bench NAME --help for its options)\n\nbenchmarks:\n");
    for (int i = 0; i < N_BENCHES; i++)
        fprintf(f, "  %-9s %s\n", benches[i].name, benches[i].what);
}

int pd_cli_bench(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        bench_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (int i = 0; i < N_BENCHES; i++) {
        if (strcmp(argv[1], benches[i].name))
            continue;
        /* --help anywhere: the benchmark's usage, never a run (bench serve prints its own, longer one) */
        for (int a = 2; a < argc && benches[i].run != pd_bench_serve; a++)
            if (!strcmp(argv[a], "-h") || !strcmp(argv[a], "--help")) {
                printf("usage: pdmoe bench %s %s\n%s\n", benches[i].name, benches[i].flags, benches[i].what);
                return 0;
            }
        return benches[i].run(argc - 1, argv + 1);
    }
    fprintf(stderr, "pdmoe bench: unknown benchmark \"%s\" (see pdmoe bench --help)\n", argv[1]);
    return 2;
}

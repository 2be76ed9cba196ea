/* `pdmoe bench NAME`: dispatch to the benchmarks in bench/. */
#include "cli/cli.h"
#include "bench/bench.h"

#include <stdio.h>
#include <string.h>

int pd_cli_bench(int argc, char **argv)
{
    static const struct { const char *name; int (*run)(int, char **); } benches[] = {
        {"plan", pd_bench_plan},
        {"kernels", pd_bench_kernels},
        {"decode", pd_bench_decode},
        {"ep", pd_bench_ep},
        {"serve", pd_bench_serve},
        {"transfer", pd_bench_transfer},
        {"search", pd_bench_search},
        {"tokenizer", pd_bench_tokenizer},
    };
    if (argc >= 2)
        for (size_t i = 0; i < sizeof benches / sizeof benches[0]; i++)
            if (strcmp(argv[1], benches[i].name) == 0)
                return benches[i].run(argc - 1, argv + 1);
    fprintf(stderr, "usage: pdmoe bench NAME   (names:");
    for (size_t i = 0; i < sizeof benches / sizeof benches[0]; i++)
        fprintf(stderr, " %s", benches[i].name);
    fprintf(stderr, ")\n");
    return 2;
}

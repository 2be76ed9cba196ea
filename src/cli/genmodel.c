/* `pdmoe gen-model`: write a synthetic checkpoint for a preset. */
#include "cli/cli.h"
#include "core/timing.h"
#include "engine/genmodel.h"

#include <getopt.h>
#include <stdio.h>
#include <string.h>

int pd_cli_genmodel(int argc, char **argv)
{
    static const struct option opts[] = {
        {"preset", 1, 0, 'p'}, {"out", 1, 0, 'o'}, {"seed", 1, 0, 's'}, {"mtp-agreement", 1, 0, 'A'},
        {"help", 0, 0, 'h'}, {0, 0, 0, 0},
    };
    const char *preset = "v4-flash-mini", *out = NULL;
    int64_t seed = 1;
    double agree = -1;
    int c;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":h", opts, NULL)) != -1) {
        switch (c) {
        case 'p': preset = optarg; break;
        case 'o': out = optarg; break;
        case 's': if (pd_cli_int("--seed", optarg, 0, &seed)) return 2; break;
        case 'A':
            if (pd_cli_double("--mtp-agreement", optarg, &agree)) return 2;
            if (!(agree >= 0 && agree <= 1)) {
                fprintf(stderr, "pdmoe gen-model: --mtp-agreement %s: a rate in [0, 1]\n", optarg);
                return 2;
            }
            break;
        case 'h':
            printf("usage: pdmoe gen-model [--preset NAME|FILE] --out DIR [--seed N] [--mtp-agreement R]\n"
                   "Writes DIR/config.json, DIR/model.safetensors (W8A8) and DIR/tokenizer.json: a deterministic\n"
                   "synthetic checkpoint of the preset (default v4-flash-mini) for the engine.\n"
                   "--mtp-agreement R: a model whose greedy next token is a fixed function of the current one and\n"
                   "  whose MTP layer predicts it for a fraction R of the tokens, so speculative decoding accepts\n"
                   "  the first draft at about rate R (a synthetic draft otherwise agrees almost never).\n");
            return 0;
        default:
            return pd_cli_bad_flag("gen-model", c, argc, argv);
        }
    }
    if (!out) {
        fprintf(stderr, "pdmoe gen-model: --out DIR is required\n");
        return 2;
    }
    pd_err e = {0};
    double t0 = pd_now_s();
    if (pd_genmodel_agree(preset, out, (uint64_t)seed, agree, &e)) {
        fprintf(stderr, "pdmoe gen-model: %s\n", e.msg);
        return 1;
    }
    fprintf(stderr, "pdmoe gen-model: wrote %s (%s, seed %lld) in %.1f s\n", out, preset, (long long)seed,
            pd_now_s() - t0);
    return 0;
}

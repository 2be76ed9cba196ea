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
        {"preset", 1, 0, 'p'}, {"out", 1, 0, 'o'}, {"seed", 1, 0, 's'}, {"mtp-agreement", 1, 0, 'A'}, {"format", 1, 0, 'f'},
        {"help", 0, 0, 'h'}, {0, 0, 0, 0},
    };
    const char *preset = "v4-flash-mini", *out = NULL;
    int64_t seed = 1;
    double agree = -1;
    enum pd_gen_format fmt = PD_GEN_W8A8;
    int c;
    struct pd_cli_seen seen = {0};
    optind = 1;
    opterr = 0;
    while ((c = pd_cli_getopt("gen-model", argc, argv, opts, NULL, NULL, &seen)) != -1) {
        switch (c) {
        case 'p': preset = optarg; break;
        case 'o': out = optarg; break;
        case 's': if (pd_cli_int("--seed", optarg, 0, &seed)) return 2; break;
        case 'f':
            if (strcmp(optarg, "w8a8") == 0)
                fmt = PD_GEN_W8A8;
            else if (strcmp(optarg, "release") == 0)
                fmt = PD_GEN_RELEASE;
            else if (strcmp(optarg, "release-w8a8") == 0)
                fmt = PD_GEN_RELEASE_W8A8;
            else {
                fprintf(stderr, "pdmoe gen-model: --format \"%s\": expected w8a8, release or release-w8a8\n", optarg);
                return 2;
            }
            break;
        case 'A':
            if (pd_cli_double("--mtp-agreement", optarg, &agree)) return 2;
            if (!(agree >= 0 && agree <= 1)) {
                fprintf(stderr, "pdmoe gen-model: --mtp-agreement %s: a rate in [0, 1]\n", optarg);
                return 2;
            }
            break;
        case 'h':
            printf("usage: pdmoe gen-model [--preset NAME|FILE] --out DIR [--seed N] [--mtp-agreement R]\n"
                   "       [--format w8a8|release|release-w8a8]\n"
                   "Writes DIR/config.json, DIR/model.safetensors (W8A8) and DIR/tokenizer.json: a deterministic\n"
                   "synthetic checkpoint of the preset (default v4-flash-mini) for the engine.\n"
                   "--mtp-agreement R: a model whose greedy next token is a fixed function of the current one and\n"
                   "  whose MTP layer predicts it for a fraction R of the tokens, so speculative decoding accepts\n"
                   "  the first draft at about rate R (a synthetic draft otherwise agrees almost never).\n"
                   "--format release writes the same model in DeepSeek's released format instead: FP8 e4m3\n"
                   "matrices with ue8m0 [128, 128] block scales, FP4 e2m1 routed experts with a ue8m0 scale\n"
                   "per 1 x 32, sharded model-0000K-of-0000N.safetensors with model.safetensors.index.json.\n"
                   "The release holds the draws rounded onto its FP8/FP4 grid; --format release-w8a8 writes\n"
                   "that rounded model in the W8A8 layout (what the engine makes of the release at load).\n");
            return 0;
        default:
            return pd_cli_bad_flag("gen-model", c, argc, argv);
        }
    }
    if (pd_cli_no_args("gen-model", argc, argv))
        return 2;
    if (!out) {
        fprintf(stderr, "pdmoe gen-model: --out DIR is required\n");
        return 2;
    }
    pd_err e = {0};
    double t0 = pd_now_s();
    if (pd_genmodel_opts(preset, out, (uint64_t)seed, fmt, agree, &e)) {
        fprintf(stderr, "pdmoe gen-model: %s\n", e.msg);
        return 1;
    }
    fprintf(stderr, "pdmoe gen-model: wrote %s (%s, seed %lld%s) in %.1f s\n", out, preset, (long long)seed,
            fmt == PD_GEN_RELEASE ? ", release format" : fmt == PD_GEN_RELEASE_W8A8 ? ", release's values, w8a8" : "",
            pd_now_s() - t0);
    return 0;
}

/* `pdmoe generate`: run a prompt through the engine and stream the continuation. */
#include "cli/cli.h"
#include "core/timing.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "model/tokenizer.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int pd_cli_generate(int argc, char **argv)
{
    static const struct option opts[] = {
        {"model", 1, 0, 'm'}, {"prompt", 1, 0, 'p'}, {"max-tokens", 1, 0, 'n'}, {"temperature", 1, 0, 't'},
        {"top-p", 1, 0, 'P'}, {"seed", 1, 0, 's'}, {"threads", 1, 0, 'j'}, {"help", 0, 0, 'h'}, {0, 0, 0, 0},
    };
    const char *dir = NULL, *prompt = NULL;
    int64_t max_tokens = 64, seed = 1, threads = 0;
    double temperature = 0, top_p = 1;
    int c;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm': dir = optarg; break;
        case 'p': prompt = optarg; break;
        case 'n': if (pd_cli_int("--max-tokens", optarg, 1, &max_tokens)) return 2; break;
        case 't': if (pd_cli_double("--temperature", optarg, &temperature)) return 2; break;
        case 'P': if (pd_cli_double("--top-p", optarg, &top_p)) return 2; break;
        case 's': if (pd_cli_int("--seed", optarg, 0, &seed)) return 2; break;
        case 'j': if (pd_cli_int("--threads", optarg, 1, &threads)) return 2; break;
        case 'h':
            printf("usage: pdmoe generate --model DIR --prompt TEXT [--max-tokens 64] [--temperature 0]\n"
                   "                      [--top-p 1] [--seed 1] [--threads N]\n"
                   "Greedy at temperature 0. Prints the text as it is produced, then tokens/s on stderr.\n");
            return 0;
        default:
            fprintf(stderr, "pdmoe generate: unknown option or missing value: %s\n", argv[optind - 1]);
            return 2;
        }
    }
    if (!dir || !prompt) {
        fprintf(stderr, "pdmoe generate: --model DIR and --prompt TEXT are required\n");
        return 2;
    }
    if (temperature < 0 || !(top_p > 0 && top_p <= 1)) {
        fprintf(stderr, "pdmoe generate: --temperature must be >= 0 and --top-p in (0, 1]\n");
        return 2;
    }
    pd_err e = {0};
    char path[600];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    struct pd_tok *tok = NULL;
    if (pd_tok_load(path, &tok, &e)) {
        fprintf(stderr, "pdmoe generate: %s\n", e.msg);
        return 1;
    }
    int32_t *ids = NULL;
    size_t n = 0;
    if (pd_tok_encode(tok, prompt, strlen(prompt), &ids, &n, &e)) {
        fprintf(stderr, "pdmoe generate: --prompt: %s\n", e.msg);
        pd_tok_free(tok);
        return 1;
    }
    int32_t bos = pd_tok_bos(tok), eos = pd_tok_eos(tok);
    int32_t *in = malloc((n + 1) * sizeof *in);
    int np = 0;
    if (bos >= 0)
        in[np++] = bos;
    memcpy(in + np, ids, n * sizeof *ids);
    np += (int)n;
    free(ids);
    struct pd_engine en;
    struct pd_engine_opts o = {.dir = dir, .threads = (int)threads, .max_seqs = 1,
                               .max_model_len = np + max_tokens + 1};
    int rc = 1;
    if (pd_engine_open(&en, &o, &e)) {
        fprintf(stderr, "pdmoe generate: %s\n", e.msg);
        free(in);
        pd_tok_free(tok);
        return 1;
    }
    const int V = (int)en.model.vocab_size;
    /* ids past the tokenizer's last token are padding rows of the embedding: never emit them */
    const int Vs = pd_tok_vocab_size(tok) < V ? pd_tok_vocab_size(tok) : V;
    float *logits = malloc((size_t)V * sizeof *logits), *scratch = malloc((size_t)V * 2 * sizeof *scratch);
    struct pd_sampler smp;
    pd_sampler_init(&smp, (float)temperature, (float)top_p, (uint64_t)seed);
    struct pd_seq seq;
    if (pd_seq_start(&en, &seq, &e))
        goto fail;
    double t0 = pd_now_s();
    struct pd_step_item it = {.seq = &seq, .tokens = in, .n = np, .logits = logits};
    if (pd_engine_step(&en, &it, 1, &e))
        goto fail;
    double t1 = pd_now_s();
    int produced = 0;
    for (; produced < max_tokens; produced++) {
        int32_t next = pd_sample(&smp, logits, Vs, scratch);
        if (next == eos)
            break;
        size_t len;
        const char *bytes = pd_tok_token_bytes(tok, next, &len);
        if (bytes)
            fwrite(bytes, 1, len, stdout);
        fflush(stdout);
        if (produced + 1 == max_tokens)
            break;
        it = (struct pd_step_item){.seq = &seq, .tokens = &next, .n = 1, .logits = logits};
        if (pd_engine_step(&en, &it, 1, &e))
            goto fail;
    }
    double t2 = pd_now_s();
    printf("\n");
    fprintf(stderr, "prompt: %d tokens, %.1f tokens/s; decode: %d tokens, %.1f tokens/s\n", np, np / (t1 - t0),
            produced, produced > 1 ? (produced - 1) / (t2 - t1) : 0.0);
    rc = 0;
fail:
    if (rc)
        fprintf(stderr, "pdmoe generate: %s\n", e.msg);
    pd_seq_end(&en, &seq);
    pd_engine_close(&en);
    free(logits);
    free(scratch);
    free(in);
    pd_tok_free(tok);
    return rc;
}

/* `pdmoe bench decode --model DIR`: decode tokens/s at batch 1 and 16, and at batch 1 the
 * weight bytes a token reads divided by its time, as a fraction of this machine's read
 * bandwidth measured in the same run (the roofline of a memory-bound decode). */
#include "bench.h"
#include "cli/cli.h"
#include "core/timing.h"
#include "engine/engine.h"
#include "engine/sampler.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static double lin_bytes(const struct pd_linear *l)
{
    if (l->q.q)
        return (double)l->out * l->in + 4.0 * l->out;
    return l->f ? 4.0 * l->out * l->in : l->h ? 2.0 * l->out * l->in : 0;
}

static double expert_bytes(const struct pd_expert_w *x)
{
    return lin_bytes(&x->w1) + lin_bytes(&x->w2) + lin_bytes(&x->w3);
}

/* Weight bytes one decode token reads at batch 1: every dense matrix and vector of every layer,
 * top-k routed experts per layer, the head; the embedding only one row. */
static double bytes_per_token(const struct pd_engine *en)
{
    const struct pd_model *m = &en->model;
    const double H = (double)m->hidden_size, hc = m->hc_mult, mix = (2 + hc) * hc;
    double b = lin_bytes(&en->w.head) + 2 * H + 4 * (hc * hc * H + H);
    for (int l = 0; l < m->n_layers; l++) {
        const struct pd_layer_w *L = &en->w.layers[l];
        b += 4 * (2 * mix * hc * H + 2 * H);
        b += lin_bytes(&L->wq_a) + lin_bytes(&L->wq_b) + lin_bytes(&L->wkv) + lin_bytes(&L->wo_a) + lin_bytes(&L->wo_b);
        if (L->ratio) {
            b += lin_bytes(&L->cmp.wkv) + lin_bytes(&L->cmp.wgate);
            if (L->ratio == 4)
                b += lin_bytes(&L->idx_cmp.wkv) + lin_bytes(&L->idx_cmp.wgate) + lin_bytes(&L->idx_wq_b) +
                     lin_bytes(&L->idx_weights);
        }
        b += lin_bytes(&L->gate) + expert_bytes(&L->shared) + m->n_experts_per_tok * expert_bytes(&L->experts[0]);
    }
    return b;
}

static int run(struct pd_engine *en, int batch, int prompt, int steps, double *tok_s)
{
    const int V = (int)en->model.vocab_size;
    struct pd_seq *s = calloc((size_t)batch, sizeof *s);
    float *l = malloc((size_t)batch * V * 4);
    int32_t *ids = malloc((size_t)prompt * 4), *next = malloc((size_t)batch * 4);
    struct pd_step_item *it = calloc((size_t)batch, sizeof *it);
    pd_err e = {0};
    int rc = -1;
    for (int i = 0; i < prompt; i++)
        ids[i] = (i * 131 + 7) % (V > 1000 ? 1000 : V);
    for (int b = 0; b < batch; b++) {
        if (pd_seq_start(en, &s[b], &e))
            goto out;
        it[b] = (struct pd_step_item){.seq = &s[b], .tokens = ids, .n = prompt, .logits = l + (size_t)b * V};
    }
    if (pd_engine_step(en, it, batch, &e))
        goto out;
    struct pd_sampler sm;
    pd_sampler_init(&sm, 0, 1, 0);
    double t0 = 0;
    for (int k = 0; k <= steps; k++) {
        if (k == 1)
            t0 = pd_now_s();   /* the first decode step warms the caches */
        for (int b = 0; b < batch; b++) {
            next[b] = pd_sample(&sm, l + (size_t)b * V, V, NULL);
            it[b] = (struct pd_step_item){.seq = &s[b], .tokens = &next[b], .n = 1, .logits = l + (size_t)b * V};
        }
        if (pd_engine_step(en, it, batch, &e))
            goto out;
    }
    *tok_s = (double)batch * steps / (pd_now_s() - t0);
    rc = 0;
out:
    if (rc)
        fprintf(stderr, "bench decode: %s\n", e.msg);
    for (int b = 0; b < batch; b++)
        if (s[b].kv.blocks)
            pd_seq_end(en, &s[b]);
    free(s);
    free(l);
    free(ids);
    free(next);
    free(it);
    return rc;
}

int pd_bench_decode(int argc, char **argv)
{
    static const struct option opts[] = {
        {"model", 1, 0, 'm'}, {"threads", 1, 0, 'j'}, {"quick", 0, 0, 'q'}, {"steps", 1, 0, 's'}, {"batch", 1, 0, 'b'}, {0, 0, 0, 0},
    };
    const char *dir = "models/mini";
    int threads = (int)sysconf(_SC_NPROCESSORS_ONLN), quick = 0, steps = 32, only = 0, c;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":", opts, NULL)) != -1) {
        if (c == 'm')
            dir = optarg;
        else if (c == 'j')
            threads = atoi(optarg) > 0 ? atoi(optarg) : 1;
        else if (c == 'q')
            quick = 1;
        else if (c == 'b')
            only = atoi(optarg);
        else if (c == 's')
            steps = atoi(optarg) > 0 && atoi(optarg) < 4000 ? atoi(optarg) : 32;
        else
            return pd_cli_bad_flag("bench decode", c, argc, argv);
    }
    const int prompt = 64;
    if (quick)
        steps = 4;
    struct pd_engine en;
    struct pd_engine_opts o = {.dir = dir, .threads = threads, .max_seqs = 16, .max_model_len = prompt + steps + 2};
    pd_err e = {0};
    if (pd_engine_open(&en, &o, &e)) {
        fprintf(stderr, "bench decode: %s\n", e.msg);
        return 1;
    }
    double bw = pd_bench_read_bandwidth(en.pool, threads, (size_t)(quick ? 256 : 512) << 20, quick ? 2 : 5);
    double bpt = bytes_per_token(&en);
    printf("pdmoe bench decode: %s (%s), %d thread%s, %d-token prompts, %d decode steps\n", dir, en.model.name,
           threads, threads > 1 ? "s" : "", prompt, steps);
    printf("  memory read bandwidth, measured now: %.2f GB/s\n", bw / 1e9);
    printf("  weights read per token at batch 1: %.1f MB (dense layers, top-%d experts, head)\n", bpt / 1e6,
           en.model.n_experts_per_tok);
    int rc = 0;
    for (int batch = 1; batch <= 16; batch *= 16) {
        if (only && batch != only)
            continue;
        double ts;
        if (run(&en, batch, prompt, steps, &ts)) {
            rc = 1;
            break;
        }
        printf("  batch %2d: %8.1f tokens/s", batch, ts);
        if (batch == 1)
            printf("   %.2f GB/s of weights = %.2f of the bandwidth roofline (target >= 0.7)", bpt * ts / 1e9,
                   bpt * ts / bw);
        printf("\n");
    }
    pd_engine_close(&en);
    return rc;
}

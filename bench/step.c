/* Timing one engine step on fresh sequences: what pdmoe calibrate fits and bench transfer sets
 * the KV hand-off against. */
#include "bench.h"
#include "core/timing.h"

#include <stdlib.h>

/* Seconds of one engine step of `seqs` sequences adding `tokens` each after `ctx` cached
 * tokens (best of `reps`, each on fresh sequences). */
int pd_bench_step_time(struct pd_engine *en, int seqs, int tokens, int ctx, int reps, double *best, pd_err *e)
{
    const int V = (int)en->model.vocab_size;
    struct pd_seq *s = calloc((size_t)seqs, sizeof *s);
    struct pd_step_item *it = calloc((size_t)seqs, sizeof *it);
    int32_t *ids = malloc((size_t)(ctx + tokens) * 4);
    float *l = malloc((size_t)seqs * V * 4);
    int rc = PD_ENOMEM;
    *best = 1e30;
    if (!s || !it || !ids || !l)
        goto out;
    for (int i = 0; i < ctx + tokens; i++)
        ids[i] = (i * 131 + 7) % (V > 1000 ? 1000 : V);
    for (int r = 0; r <= reps; r++) {   /* the first round warms up */
        for (int b = 0; b < seqs; b++) {
            if ((rc = pd_seq_start(en, &s[b], e)))
                goto out;
            it[b] = (struct pd_step_item){.seq = &s[b], .tokens = ids, .n = ctx, .logits = l + (size_t)b * V};
        }
        if (ctx > 0 && (rc = pd_engine_step(en, it, seqs, e)))
            goto out;
        for (int b = 0; b < seqs; b++)
            it[b] = (struct pd_step_item){.seq = &s[b], .tokens = ids + ctx, .n = tokens, .logits = l + (size_t)b * V};
        double t0 = pd_now_s();
        if ((rc = pd_engine_step(en, it, seqs, e)))
            goto out;
        double t = pd_now_s() - t0;
        if (r > 0 && t < *best)
            *best = t;
        for (int b = 0; b < seqs; b++)
            pd_seq_end(en, &s[b]);
    }
    rc = 0;
out:
    free(s);
    free(it);
    free(ids);
    free(l);
    return rc;
}


/* Timing one engine step on fresh sequences: what pdmoe calibrate fits and bench transfer sets
 * the KV hand-off against. */
#include "bench.h"
#include "core/timing.h"

#include <stdlib.h>

int pd_bench_step_time(struct pd_engine *en, int seqs, int tokens, int ctx, int steps, const int32_t *text,
                       size_t n_text, int reps, double *best, pd_err *e)
{
    const int V = (int)en->model.vocab_size, len = ctx + tokens * steps;
    struct pd_seq *s = calloc((size_t)seqs, sizeof *s);
    struct pd_step_item *it = calloc((size_t)seqs, sizeof *it);
    int32_t *ids = malloc((size_t)seqs * len * 4);
    float *l = malloc((size_t)seqs * V * 4);
    int rc = PD_ENOMEM;
    *best = 1e30;
    if (!s || !it || !ids || !l)
        goto out;
    /* each sequence its own tokens, so the batch's routing is its own too */
    for (int b = 0; b < seqs; b++)
        for (int i = 0; i < len; i++) {
            size_t k = (size_t)b * 211 + (size_t)i;
            ids[(size_t)b * len + i] = text && n_text ? text[k % n_text] : (int32_t)((k * 131 + 7) % (V > 1000 ? 1000 : V));
        }
    for (int r = 0; r <= reps; r++) {   /* the first round warms up */
        for (int b = 0; b < seqs; b++) {
            if ((rc = pd_seq_start(en, &s[b], e)))
                goto out;
            it[b] = (struct pd_step_item){.seq = &s[b], .tokens = ids + (size_t)b * len, .n = ctx,
                                          .logits = l + (size_t)b * V};
        }
        if (ctx > 0 && (rc = pd_engine_step(en, it, seqs, e)))
            goto out;
        double t0 = pd_now_s();
        for (int k = 0; k < steps; k++) {
            for (int b = 0; b < seqs; b++)
                it[b] = (struct pd_step_item){.seq = &s[b], .tokens = ids + (size_t)b * len + ctx + k * tokens,
                                              .n = tokens, .logits = l + (size_t)b * V};
            if ((rc = pd_engine_step(en, it, seqs, e)))
                goto out;
        }
        double t = (pd_now_s() - t0) / steps;
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

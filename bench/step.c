/* Timing one engine step on fresh sequences: what pdmoe calibrate fits and bench transfer sets
 * the KV hand-off against. */
#include "bench.h"
#include "core/timing.h"

#include <stdlib.h>
#include <string.h>

int pd_bench_kv_save(const struct pd_engine *en, const struct pd_seq *s, struct pd_bench_kvcopy *c, pd_err *e)
{
    uint64_t bytes = 0;
    memset(c, 0, sizeof *c);
    c->len = s->pos;
    c->runs = pd_kvseq_runs_alloc(&en->kv, &s->kv, s->pos, &c->n, &bytes);
    c->bytes = c->runs && c->n >= 0 ? malloc(bytes ? bytes : 1) : NULL;
    if (!c->bytes) {
        pd_bench_kv_free(c);
        return pd_err_set(e, PD_ENOMEM, "out of memory for a copy of a sequence's KV");
    }
    uint8_t *p = c->bytes;
    for (int i = 0; i < c->n; p += c->runs[i].len, i++)
        memcpy(p, en->kv.region + c->runs[i].off, c->runs[i].len);
    return 0;
}

/* The runs of the first len tokens stay where they were: a sequence only appends blocks. What
 * the sequence wrote past them (entries and indexer keys of positions >= len) is rewritten by
 * those positions before any query reads it (kvpool.h, the undo log's argument), so the state is
 * the saved one byte for byte wherever it is read. */
void pd_bench_kv_restore(struct pd_engine *en, struct pd_seq *s, const struct pd_bench_kvcopy *c)
{
    const uint8_t *p = c->bytes;
    for (int i = 0; i < c->n; p += c->runs[i].len, i++)
        memcpy(en->kv.region + c->runs[i].off, p, c->runs[i].len);
    s->pos = s->kv.len = c->len;
}

void pd_bench_kv_free(struct pd_bench_kvcopy *c)
{
    free(c->runs);
    free(c->bytes);
    memset(c, 0, sizeof *c);
}

int pd_bench_step_time(struct pd_engine *en, int seqs, int tokens, int ctx, int steps, const int32_t *text,
                       size_t n_text, int reps, double *best, pd_err *e)
{
    const int V = (int)en->model.vocab_size, len = ctx + tokens * steps;
    struct pd_seq *s = calloc((size_t)seqs, sizeof *s);
    struct pd_bench_kvcopy *kv = calloc((size_t)seqs, sizeof *kv);
    struct pd_step_item *it = calloc((size_t)seqs, sizeof *it);
    int32_t *ids = malloc((size_t)seqs * len * 4);
    float *l = malloc((size_t)seqs * V * 4);
    int rc = PD_ENOMEM, live = 0;   /* sequences started and not yet ended */
    *best = 1e30;
    if (!s || !kv || !it || !ids || !l)
        goto out;
    /* each sequence its own tokens, so the batch's routing is its own too */
    for (int b = 0; b < seqs; b++)
        for (int i = 0; i < len; i++) {
            size_t k = (size_t)b * 211 + (size_t)i;
            ids[(size_t)b * len + i] = text && n_text ? text[k % n_text] : (int32_t)((k * 131 + 7) % (V > 1000 ? 1000 : V));
        }
    /* the context is computed once, then every round starts from a copy of its KV: the prefill of
     * ctx tokens a round took before is not what is timed (it was three quarters of calibrate's
     * time), and the steps read the same KV bytes as after it */
    for (int r = 0; r <= reps; r++) {   /* the first round warms up */
        if (r > 0 && ctx > 0) {
            for (int b = 0; b < seqs; b++)
                pd_bench_kv_restore(en, &s[b], &kv[b]);
        } else {
            for (; live < seqs; live++) {
                if ((rc = pd_seq_start(en, &s[live], e)))
                    goto out;
                it[live] = (struct pd_step_item){.seq = &s[live], .tokens = ids + (size_t)live * len, .n = ctx,
                                                 .logits = l + (size_t)live * V};
            }
            if (ctx > 0 && (rc = pd_engine_step(en, it, seqs, e)))
                goto out;
            for (int b = 0; ctx > 0 && b < seqs; b++)
                if ((rc = pd_bench_kv_save(en, &s[b], &kv[b], e)))
                    goto out;
        }
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
        if (ctx == 0)   /* no context to keep: fresh sequences each round, as a prefill has */
            for (; live > 0; live--)
                pd_seq_end(en, &s[live - 1]);
    }
    rc = 0;
out:
    for (; s && live > 0; live--)
        pd_seq_end(en, &s[live - 1]);
    for (int b = 0; kv && b < seqs; b++)
        pd_bench_kv_free(&kv[b]);
    free(s);
    free(kv);
    free(it);
    free(ids);
    free(l);
    return rc;
}

/* Prefill timing driver for tools/prefill-vs-filing.sh: built against one tree's headers and
 * libpdmoe.a (this one's, or the tree at issue 17's filing), so both engines run the same
 * prompts through the same code here. The engine API it uses (pd_engine_open, pd_seq_start,
 * pd_engine_step, pd_seq_end) is the same in both. Prompts are the ids `pdmoe bench prefill`
 * uses, (i * 131 + 7) mod min(vocab, 1000), one step of P tokens on a fresh sequence, after one
 * warm-up prefill of each length.
 * usage: prefill_time MODEL_DIR THREADS REPS CLOCK P [P ...]; prints "P tokens_per_s" per length
 * (median over REPS), CLOCK wall (wall time) or cpu (the calling thread's CPU time, THREADS 1
 * only: the time slices other jobs take on a shared machine left out). */
#include "engine/engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int cpu_clock;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(cpu_clock ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int prefill(struct pd_engine *en, const int32_t *ids, int n, float *logits, double *sec, pd_err *e)
{
    struct pd_seq s;
    int rc = pd_seq_start(en, &s, e);
    if (rc)
        return rc;
    struct pd_step_item it = {.seq = &s, .tokens = ids, .n = n, .logits = logits};
    double t0 = now_s();
    rc = pd_engine_step(en, &it, 1, e);
    *sec = now_s() - t0;
    pd_seq_end(en, &s);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 6) {
        fprintf(stderr, "usage: prefill_time MODEL_DIR THREADS REPS wall|cpu P [P ...]\n");
        return 2;
    }
    int threads = atoi(argv[2]), reps = atoi(argv[3]), max_p = 0;
    if (threads < 1 || reps < 1 || reps > 100) {
        fprintf(stderr, "prefill_time: THREADS '%s' must be >= 1 and REPS '%s' in [1, 100]\n", argv[2], argv[3]);
        return 2;
    }
    if (strcmp(argv[4], "wall") && strcmp(argv[4], "cpu")) {
        fprintf(stderr, "prefill_time: CLOCK '%s': want wall or cpu\n", argv[4]);
        return 2;
    }
    cpu_clock = !strcmp(argv[4], "cpu");
    if (cpu_clock && threads != 1) {
        fprintf(stderr, "prefill_time: CLOCK cpu times the calling thread only: it needs THREADS 1\n");
        return 2;
    }
    for (int i = 5; i < argc; i++) {
        int p = atoi(argv[i]);
        if (p < 1 || p > 65536) {
            fprintf(stderr, "prefill_time: prompt length '%s' must be in [1, 65536]\n", argv[i]);
            return 2;
        }
        max_p = p > max_p ? p : max_p;
    }
    struct pd_engine en;
    struct pd_engine_opts o = {.dir = argv[1], .threads = threads, .max_seqs = 1, .max_model_len = max_p + 8};
    pd_err e = {0};
    if (pd_engine_open(&en, &o, &e)) {
        fprintf(stderr, "prefill_time: %s\n", e.msg);
        return 1;
    }
    const int V = (int)en.model.vocab_size;
    int32_t *ids = malloc((size_t)max_p * sizeof *ids);
    float *logits = malloc((size_t)V * sizeof *logits);
    double *t = malloc((size_t)reps * sizeof *t), warm;
    int rc = 1;
    if (!ids || !logits || !t) {
        fprintf(stderr, "prefill_time: out of memory\n");
        goto out;
    }
    for (int i = 0; i < max_p; i++)
        ids[i] = (int32_t)(((int64_t)i * 131 + 7) % (V > 1000 ? 1000 : V));
    for (int i = 5; i < argc; i++) {
        int p = atoi(argv[i]);
        if (prefill(&en, ids, p, logits, &warm, &e))
            goto fail;
        for (int r = 0; r < reps; r++)
            if (prefill(&en, ids, p, logits, &t[r], &e))
                goto fail;
        qsort(t, (size_t)reps, sizeof *t, cmp_d);
        printf("%d %.1f\n", p, p / t[reps / 2]);
        fflush(stdout);
    }
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "prefill_time: %s\n", e.msg);
out:
    free(ids);
    free(logits);
    free(t);
    pd_engine_close(&en);
    return rc;
}

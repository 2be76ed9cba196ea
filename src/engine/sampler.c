/* Greedy and top-p sampling. */
#include "engine/sampler.h"

#include <math.h>
#include <stdlib.h>

void pd_sampler_init(struct pd_sampler *s, float temperature, float top_p, uint64_t seed)
{
    s->temperature = temperature;
    s->top_p = top_p > 0 && top_p <= 1 ? top_p : 1;
    s->state = seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
}

static double uniform(struct pd_sampler *s)
{
    /* xorshift64*: 53 random bits in [0, 1) */
    uint64_t x = s->state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    s->state = x;
    return (double)((x * 0x2545f4914f6cdd1dull) >> 11) / 9007199254740992.0;
}

struct cand {
    float p;
    int32_t id;
};

static int by_prob(const void *a, const void *b)
{
    const struct cand *x = a, *y = b;
    if (x->p != y->p)
        return x->p > y->p ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

int32_t pd_sample(struct pd_sampler *s, const float *logits, int n, float *scratch)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > logits[best])
            best = i;
    if (s->temperature <= 0)
        return best;
    struct cand *c = (struct cand *)scratch;   /* 2 * n floats hold n candidates */
    double sum = 0;
    for (int i = 0; i < n; i++) {
        c[i].p = (float)exp((logits[i] - logits[best]) / s->temperature);
        c[i].id = i;
        sum += c[i].p;
    }
    qsort(c, (size_t)n, sizeof *c, by_prob);
    double mass = 0;
    int keep = 0;
    while (keep < n && (keep == 0 || mass < s->top_p * sum))
        mass += c[keep++].p;
    double u = uniform(s) * mass, acc = 0;
    for (int k = 0; k < keep; k++) {
        acc += c[k].p;
        if (u < acc)
            return c[k].id;
    }
    return c[keep - 1].id;
}

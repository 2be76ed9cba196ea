/* Greedy and top-p sampling. */
#include "engine/sampler.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

void pd_sampler_init(struct pd_sampler *s, double temperature, double top_p, uint64_t seed)
{
    s->temperature = (float)temperature;
    s->top_p = !(top_p > 0 && top_p <= 1) ? 1 : top_p < FLT_TRUE_MIN ? FLT_TRUE_MIN : (float)top_p;
    s->state = seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull;
}

double pd_sampler_uniform(struct pd_sampler *s)
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

/* The first index of the largest value (NaN never wins, unless at index 0, where nothing beats
 * it): the largest value four lanes at a time, then its first index. The one-pass loop it
 * replaces waited on a load and a compare per element (~30 us per token over a vocabulary of
 * 8192, 2% of a decode step of v4-flash-mini). */
static int argmax(const float *x, int n)
{
    int i = 0;
    float m = x[0];
#ifdef __SSE2__
    if (n >= 8) {
        /* max_ps(v, acc) picks acc when v is NaN, as the scalar "v > m" test does */
        __m128 acc = _mm_set1_ps(x[0]);
        for (; i + 4 <= n; i += 4)
            acc = _mm_max_ps(_mm_loadu_ps(x + i), acc);
        float l[4];
        _mm_storeu_ps(l, acc);
        for (int k = 0; k < 4; k++)
            m = l[k] > m ? l[k] : m;
    }
#endif
    for (; i < n; i++)
        m = x[i] > m ? x[i] : m;
    for (i = 0; i < n; i++)
        if (x[i] == m)
            return i;
    return 0;   /* m is NaN: x[0] was, and nothing beat it */
}

/* The nucleus of the tempered distribution: c[0 .. keep) holds the candidates by descending
 * probability (unnormalised, relative to the best logit's), *mass their sum; returns keep. */
static int nucleus(const struct pd_sampler *s, const float *logits, int n, int best, struct cand *c, double *mass)
{
    double sum = 0;
    for (int i = 0; i < n; i++) {
        c[i].p = (float)exp((logits[i] - logits[best]) / s->temperature);
        c[i].id = i;
        sum += c[i].p;
    }
    qsort(c, (size_t)n, sizeof *c, by_prob);
    double m = 0;
    int keep = 0;
    while (keep < n && (keep == 0 || m < s->top_p * sum))
        m += c[keep++].p;
    *mass = m;
    return keep;
}

int32_t pd_sample(struct pd_sampler *s, const float *logits, int n, float *scratch)
{
    int best = argmax(logits, n);
    if (s->temperature <= 0)
        return best;
    struct cand *c = (struct cand *)scratch;   /* 2 * n floats hold n candidates */
    double mass;
    int keep = nucleus(s, logits, n, best, c, &mass);
    double u = pd_sampler_uniform(s) * mass, acc = 0;
    for (int k = 0; k < keep; k++) {
        acc += c[k].p;
        if (u < acc)
            return c[k].id;
    }
    return c[keep - 1].id;
}

void pd_sampler_probs(const struct pd_sampler *s, const float *logits, int n, float *p, float *scratch)
{
    int best = argmax(logits, n);
    for (int i = 0; i < n; i++)
        p[i] = 0;
    if (s->temperature <= 0) {
        p[best] = 1;
        return;
    }
    /* the same candidates, order and nucleus as pd_sample */
    double mass;
    int keep = nucleus(s, logits, n, best, (struct cand *)scratch, &mass);
    const struct cand *c = (const struct cand *)scratch;
    for (int k = 0; k < keep; k++)
        p[c[k].id] = (float)(c[k].p / mass);
}

int32_t pd_sample_weights(struct pd_sampler *s, const float *w, int n)
{
    double sum = 0;
    int last = 0;
    for (int i = 0; i < n; i++)
        if (w[i] > 0) {
            sum += w[i];
            last = i;
        }
    double u = pd_sampler_uniform(s) * sum, acc = 0;
    for (int i = 0; i < n; i++)
        if (w[i] > 0) {
            acc += w[i];
            if (u < acc)
                return i;
        }
    return last;
}

/* Next-token choice: greedy (temperature 0), or temperature + nucleus (top-p) sampling from a
 * seeded generator, so the same seed gives the same tokens. */
#ifndef PD_ENGINE_SAMPLER_H
#define PD_ENGINE_SAMPLER_H

#include <stdint.h>

struct pd_sampler {
    float temperature;      /* 0: greedy */
    float top_p;            /* (0, 1]; 1: the whole distribution */
    uint64_t state;         /* generator state */
};

/* temperature >= 0 (0 or one below the smallest float: greedy); top_p in (0, 1], where a top_p below
 * the smallest float is the narrowest nucleus (the best token), not 0; outside (0, 1]: 1. Both
 * taken as doubles, as requests and flags give them, so that no caller's cast to float turns a
 * top_p of 1e-320 into the 0 that means 1. */
void pd_sampler_init(struct pd_sampler *s, double temperature, double top_p, uint64_t seed);
/* Picks a token from logits[0 .. n); `scratch` holds 2 * n floats. Greedy ties go to the lower id. */
int32_t pd_sample(struct pd_sampler *s, const float *logits, int n, float *scratch);

/* The distribution pd_sample draws from: p[i] for i < n (temperature and nucleus applied, zero
 * outside the nucleus, summing to 1); at temperature 0 a point mass on the greedy token.
 * `scratch` holds 2 * n floats. */
void pd_sampler_probs(const struct pd_sampler *s, const float *logits, int n, float *p, float *scratch);
/* A uniform draw in [0, 1) from the sampler's generator. */
double pd_sampler_uniform(struct pd_sampler *s);
/* A token drawn from the weights w[0 .. n) (not necessarily normalised, not all zero). */
int32_t pd_sample_weights(struct pd_sampler *s, const float *w, int n);

#endif

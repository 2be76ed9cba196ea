/* The least time an engine step can take on this machine's same-run ceilings, for `bench decode`
 * and `bench prefill`:
 *   bound = sum over the dense matrices and vectors of max(bytes / bandwidth, 2 rows params / peak)
 *           + max(routed experts' bytes / bandwidth, sum over their matrices of 2 pairs params / peak)
 * rows = the step's T tokens for every layer's matrices and vectors, and the tokens that go through
 * the head (decode: all T; prefill: one per sequence) for the head's mHC vectors and lm_head;
 * pairs = the step's (token, expert) pairs, bytes = the distinct routed experts it read; peak = the
 * fp32 FMA peak for float matrices (bf16 ones are widened and multiplied in fp32) and the mHC
 * vectors, the int8 peak for int8 ones, each an instruction probe at the step's thread count of the
 * instructions the engine runs here (pd_bench_peaks). The embedding is read one row per token (not
 * counted). With few rows it is the bandwidth roofline; with many, the arithmetic. */
#include "bench/bound.h"
#include "bench/bench.h"

#include <math.h>
#include <string.h>

static double lin_bytes(const struct pd_linear *l)
{
    if (l->q.q)
        return (double)l->out * l->in + 4.0 * l->out;
    return l->f ? 4.0 * l->out * l->in : l->h ? 2.0 * l->out * l->in : 0;
}

/* A part of the step: its bytes, and the seconds its memory and its arithmetic take at least. */
struct part {
    double bytes, ops_s, int8_ops;
};

/* Adds `bytes` of weights holding `params` values, multiplied for `rows` tokens at `peak`. */
static void add_weights(struct part *p, double bytes, double params, double rows, double peak)
{
    p->bytes += bytes;
    p->ops_s += peak > 0 ? 2 * rows * params / peak : 0;
}

static void add_lin(struct part *p, const struct pd_linear *l, double rows, const struct pd_bench_ceilings *c)
{
    const double params = (double)l->out * l->in;
    add_weights(p, lin_bytes(l), params, rows, l->q.q ? c->int8 : c->fp32);
    if (l->q.q)
        p->int8_ops += 2 * rows * params;
}

static void add_expert(struct part *p, const struct pd_expert_w *x, double rows, const struct pd_bench_ceilings *c)
{
    add_lin(p, &x->w1, rows, c);
    add_lin(p, &x->w2, rows, c);
    add_lin(p, &x->w3, rows, c);
}

/* One dense matrix or vector set is its own max(memory, arithmetic): the next cannot overlap it. */
static void add_dense(struct pd_bench_bound *b, const struct part *p, const struct pd_bench_ceilings *c)
{
    b->dense_bytes += p->bytes;
    b->dense_s += fmax(p->bytes / c->bw, p->ops_s);
    b->int8_ops += p->int8_ops;
}

static void dense_lin(struct pd_bench_bound *b, const struct pd_linear *l, double rows, const struct pd_bench_ceilings *c)
{
    struct part p = {0};
    add_lin(&p, l, rows, c);
    add_dense(b, &p, c);
}

static void dense_vec(struct pd_bench_bound *b, double params, double rows, const struct pd_bench_ceilings *c)
{
    struct part p = {0};
    add_weights(&p, 4 * params, params, rows, c->fp32);   /* fp32 values */
    add_dense(b, &p, c);
}

void pd_bench_step_bound(const struct pd_engine *en, double tokens, double heads, double experts, double pairs,
                         const struct pd_bench_ceilings *c, struct pd_bench_bound *b)
{
    const struct pd_model *m = &en->model;
    const double H = (double)m->hidden_size, hc = m->hc_mult, mix = (2 + hc) * hc, T = tokens;
    memset(b, 0, sizeof *b);
    /* the head: its mHC pre-weights and norm, lm_head */
    dense_lin(b, &en->w.head, heads, c);
    dense_vec(b, hc * hc * H + H, heads, c);
    for (int l = 0; l < m->n_layers; l++) {
        const struct pd_layer_w *L = &en->w.layers[l];
        dense_vec(b, 2 * mix * hc * H + 2 * H, T, c);   /* mHC of both sublayers, their norms */
        dense_lin(b, &L->wq_a, T, c);
        dense_lin(b, &L->wq_b, T, c);
        dense_lin(b, &L->wkv, T, c);
        dense_lin(b, &L->wo_a, T, c);
        dense_lin(b, &L->wo_b, T, c);
        if (L->ratio) {
            dense_lin(b, &L->cmp.wkv, T, c);
            dense_lin(b, &L->cmp.wgate, T, c);
            if (L->ratio == 4) {
                dense_lin(b, &L->idx_cmp.wkv, T, c);
                dense_lin(b, &L->idx_cmp.wgate, T, c);
                dense_lin(b, &L->idx_wq_b, T, c);
                dense_lin(b, &L->idx_weights, T, c);
            }
        }
        dense_lin(b, &L->gate, T, c);
        struct part sh = {0};
        add_expert(&sh, &L->shared, T, c);
        add_dense(b, &sh, c);
    }
    /* the routed experts, all of one shape: the distinct ones read, every pair multiplied */
    if (m->n_routed_experts == 0) {
        b->bytes = b->dense_bytes;
        b->bw_s = b->bytes / c->bw;
        b->bound_s = b->dense_s;
        return;
    }
    struct part one = {0}, run = {0};
    add_expert(&one, &en->w.layers[0].experts[0], 0, c);
    add_expert(&run, &en->w.layers[0].experts[0], pairs, c);
    b->expert_bytes = experts * one.bytes;
    b->expert_s = fmax(b->expert_bytes / c->bw, run.ops_s);
    b->int8_ops += run.int8_ops;
    b->bytes = b->dense_bytes + b->expert_bytes;
    b->bw_s = b->bytes / c->bw;
    b->bound_s = b->dense_s + b->expert_s;
}

void pd_bench_routed_since(const struct pd_engine *en, const int64_t *before, double *experts, double *pairs)
{
    const size_t n = (size_t)en->model.n_layers * en->model.n_routed_experts;
    *experts = *pairs = 0;
    for (size_t i = 0; i < n; i++) {
        *experts += en->expert_tokens[i] != before[i];
        *pairs += (double)(en->expert_tokens[i] - before[i]);
    }
}

void pd_bench_ceilings_raise(pd_pool *pool, int threads, int quick, struct pd_bench_ceilings *c,
                             const char **int8_probe, double *bw_cpu)
{
    const size_t bytes = (size_t)(quick ? 256 : 512) << 20;
    const int reps = quick ? 2 : 5;
    double f, i;
    c->bw = fmax(c->bw, pd_bench_read_bandwidth(pool, threads, bytes, reps));
    if (bw_cpu)
        *bw_cpu = fmax(*bw_cpu, pd_bench_read_bandwidth_cpu_time(bytes, reps));
    pd_bench_peaks(threads > 1 ? pool : NULL, threads, quick, &f, &i, int8_probe);
    c->fp32 = fmax(c->fp32, f);
    c->int8 = fmax(c->int8, i);
}

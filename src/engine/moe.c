/* V4 MoE for every token of a step:
 *   s   = sqrt(softplus(x Wg^T))                        router scores, fp32 [experts]
 *   ids = tid2eid[token] in the first num_hash_layers layers, else top-k of (s + bias)
 *         (the bias only chooses: ties go to the lower id)
 *   w   = s[ids] / sum(s[ids]) * routed_scaling_factor    (without the division if !norm_topk_prob)
 *   y   = sum over ids in increasing id order of w_e * W2_e(silu(min(W1_e x, L)) * clamp(W3_e x, -L, L))
 *         + shared(x)                                    L = swiglu_limit (0: no clamp)
 * The experts run as grouped int8 GEMMs over the tokens gathered for each; the combination runs in
 * a fixed order (by expert id, then the shared expert) so results do not depend on how tokens
 * were grouped, batched or, later, dispatched across ranks. */
#include "engine/internal.h"
#include "kernels/gemm.h"
#include "kernels/quant.h"
#include "kernels/vec.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* g = swiglu(g, u) (kernels/vec.h): silu(min(g, L)) * clamp(u, -L, L), L = swiglu_limit. */
static void swiglu_rows(float *g, const float *u, size_t n, float limit)
{
    pd_swiglu(g, u, n, limit);
}

/* The score of a logit: s = sqrt(softplus(z)). */
static float score_of(float z)
{
    return sqrtf(pd_softplus(z));
}

/* Bounds on score_of without calling it: its values at knots z_i = -16 + i/32 (i < SP_N, up to
 * 20), computed once. score_of is increasing, so z_i <= z < z_i+1 bounds it by the knots' values,
 * widened by SP_SLACK (relative, ~80 float ulps) for the rounding of expf/log1pf/sqrtf, which
 * could make the computed function fall a few ulps short of monotonic. The router needs exact
 * scores only for the experts that can still make the top-k (and for the k chosen): computing
 * all 256 took 17 ns each, 2.4% of a decode step of v4-flash-mini. */
enum { SP_PER = 32, SP_N = 36 * SP_PER + 1 };
#define SP_LO (-16.0f)
#define SP_SLACK 1e-5f
static float sp_val[SP_N];
static pthread_once_t sp_once = PTHREAD_ONCE_INIT;

static float sp_knot(int i)
{
    return SP_LO + (float)i / SP_PER;   /* exact: multiples of 1/32 below 32 in magnitude */
}

static void sp_init(void)
{
    for (int i = 0; i < SP_N; i++)
        sp_val[i] = score_of(sp_knot(i));
}

/* The knots as kernels/vec.h's table: below -16 a score lies in [0, score_of(-16)]. */
static const struct pd_knots sp_knots = {.x0 = SP_LO, .per = SP_PER, .slack = SP_SLACK, .below = 0, .m = SP_N,
                                         .val = sp_val};

/* The top k of the values p[0..n) of experts c[0..n): the largest not yet taken, ties to the
 * lower index, -inf never; id[j] = c[i] of the j-th, -1 when none is left. Overwrites p. */
static void take_topk(float *p, const int *c, int n, int k, int32_t *id)
{
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < n; i++)
            if (p[i] != -INFINITY && (best < 0 || p[i] > p[best]))
                best = i;
        id[j] = best < 0 ? -1 : c[best];
        if (best >= 0)
            p[best] = -INFINITY;
    }
}

/* A token's experts (id [k], k <= E <= 4096) from its logits z [E]; s[x] (which may be z) becomes
 * the exact score of at least every chosen expert. The choice is the top k of s + bias over all
 * experts; only an expert whose upper bound reaches the k-th largest lower bound can be in it, so
 * only those are scored exactly and compared (in index order: ties go to the lower id, as over
 * all of them). */
void pd_moe_choose(const struct pd_layer_w *L, int E, int k, const float *z, float *s, int32_t *id)
{
    /* the knots' values, here and not only in route(): a caller of this alone (the tests) read a
     * table of zeros, bounds that excluded the right experts wherever a bias told them apart */
    pthread_once(&sp_once, sp_init);
    const float *bias = L->gate_bias;
    float lo[4096], up[4096], lo_top[64], p[4096];   /* lo, up: bounds on s + bias */
    int cand[4096], nc = 0, nt = 0, exact = k < 1 || k > 64;
    /* every expert's bounds at once (rounding is monotonic: hi + b >= s + b); where the table
     * says nothing, one by one: a logit above its last knot (20) is scored exactly, a NaN leaves
     * the choice to the comparison over every expert, as it always did */
    if (!exact && pd_knot_bounds(&sp_knots, z, bias, E, lo, up))
        for (int x = 0; x < E && !exact; x++) {
            const float b = bias ? bias[x] : 0;
            if (z[x] > 20 && b == b)
                lo[x] = up[x] = score_of(z[x]) + b;
            else
                exact = pd_knot_bounds_ref(&sp_knots, z + x, bias ? bias + x : NULL, 1, lo + x, up + x);
        }
    /* the k largest lower bounds, decreasing */
    for (int x = 0; x < E && !exact; x++) {
        const float l = lo[x];
        if (nt == k && !(lo_top[k - 1] < l))
            continue;
        int at = nt < k ? nt++ : k;
        for (; at > 0 && lo_top[at - 1] < l; at--)
            if (at < k)
                lo_top[at] = lo_top[at - 1];
        if (at < k)
            lo_top[at] = l;
    }
    if (!exact && !(nt == k && lo_top[k - 1] > -INFINITY))
        exact = 1;
    for (int x = 0; x < E; x++)
        if (exact || up[x] >= lo_top[k - 1]) {
            s[x] = score_of(z[x]);
            p[nc] = s[x] + (bias ? bias[x] : 0);
            cand[nc++] = x;
        }
    take_topk(p, cand, nc, k, id);
}

/* Token t's experts (ids [k], ascending) and weights w [k] from its logits in scores [E] (its
 * scores of at least the chosen experts out), for tokens [t0, t1): each token on its own, so
 * tasks of tokens give the same results as one loop. */
struct choose_job {
    struct pd_step *st;
    const struct pd_layer_w *L;
    int32_t *ids;
    float *w, *scores;
};

static void choose_tokens(const struct choose_job *cj, int t0, int t1)
{
    struct pd_step *st = cj->st;
    const struct pd_layer_w *L = cj->L;
    const struct pd_model *m = &st->en->model;
    const int E = m->n_routed_experts, k = m->n_experts_per_tok;
    float *scores = cj->scores, *w = cj->w;
    int32_t *ids = cj->ids;
    for (int t = t0; t < t1; t++) {
        float *s = scores + (size_t)t * E;
        int32_t *id = ids + (size_t)t * k;
        if (L->tid2eid) {
            memcpy(id, L->tid2eid + (size_t)st->token[t] * k, (size_t)k * sizeof *id);
            /* only the k chosen are scored, each once (an id may repeat) */
            for (int j = 0; j < k; j++) {
                int seen = 0;
                for (int i = 0; i < j; i++)
                    seen |= id[i] == id[j];
                if (!seen)
                    s[id[j]] = score_of(s[id[j]]);
            }
        } else {
            pd_moe_choose(L, E, k, s, s, id);
        }
        /* ascending ids: the combination order */
        for (int a = 1; a < k; a++)
            for (int b = a; b > 0 && id[b] < id[b - 1]; b--) {
                int32_t tmp = id[b];
                id[b] = id[b - 1];
                id[b - 1] = tmp;
            }
        double sum = 0;
        for (int j = 0; j < k; j++)
            sum += s[id[j]];
        for (int j = 0; j < k; j++) {
            float v = s[id[j]];
            if (m->norm_topk_prob)
                v = (float)(v / sum);
            w[(size_t)t * k + j] = v * (float)m->routed_scaling_factor;
        }
    }
}

static void choose_task(void *arg, int task)
{
    const struct choose_job *j = arg;
    int t0 = task * 16, t1 = t0 + 16 < j->st->T ? t0 + 16 : j->st->T;
    choose_tokens(j, t0, t1);
}

/* Chooses each token's experts and weights: ids [T, k] (ascending), w [T, k]; scores [T, E]
 * (logits in, scores of at least the chosen experts out). */
static int route(struct pd_step *st, const struct pd_layer_w *L, int32_t *ids, float *w, float *scores, pd_err *e)
{
    /* router logits z = x Wg^T of every token: the gate ([E, hidden], fp32 or bf16) is a float
     * product like any other (engine/linear.c: row by row, a few tokens per row, or tiled by
     * the token count; the bits of pd_dot whichever) */
    int rc = pd_linear_fwd(&L->gate, st->en->pool, 0, st->x, st->T, scores, NULL, NULL, e);
    if (rc)
        return rc;
    struct choose_job cj = {.st = st, .L = L, .ids = ids, .w = w, .scores = scores};
    /* a prefill's tokens choose over the pool, 16 a task; a few tokens on the caller */
    if (st->T >= 32)
        pd_pool_run(st->en->pool, (st->T + 15) / 16, choose_task, &cj);
    else
        choose_tokens(&cj, 0, st->T);
    return 0;
}

/* The experts' activations between their two products, split over the pool by blocks of rows:
 * g = swiglu(g, u) (swiglu_rows: elementwise, the same bits however the rows are cut), then g
 * quantised per row into (q, s) for w2 (q NULL: not here, pd_linear_fwd quantises it). */
enum { ACT_ROWS = 4, ACT_SERIAL_VALUES = 4096, SHARED_FUSE_T = 64 };
struct act_job {
    float *g;
    const float *u;
    int8_t *q;
    float *s;
    int P, I;
    float limit;
};

static void act_task(void *arg, int task)
{
    const struct act_job *j = arg;
    int r0 = task * ACT_ROWS, n = j->P - r0 < ACT_ROWS ? j->P - r0 : ACT_ROWS;
    size_t at = (size_t)r0 * j->I;
    swiglu_rows(j->g + at, j->u + at, (size_t)n * j->I, j->limit);
    if (j->q)
        pd_quant_rows(j->g + at, n, j->I, j->q + at, j->s + r0);
}

/* One expert FFN on `n` rows of x (float reference path, or a dense expert); xq: x quantised, or
 * NULL to quantise it here. */
static int ffn_rows(struct pd_step *st, const struct pd_expert_w *x_w, const float *x, const pd_qmat *xq, int n,
                    float *y, pd_err *e)
{
    struct pd_engine *en = st->en;
    const struct pd_model *m = &en->model;
    const int I = x_w->w1.out;
    float *g = pd_scratch(en, 28, (size_t)n * I * 4, e), *u = pd_scratch(en, 29, (size_t)n * I * 4, e);
    int rc = PD_ENOMEM;
    if (!g || !u)
        goto out;
    /* xq is NULL only on the float reference path, which does not read it */
    pd_qmat q = {.q = st->qbuf, .scale = st->sbuf, .rows = n, .cols = x_w->w1.in};
    if (!xq)
        xq = &q;
    const struct pd_linear *l13[2] = {&x_w->w1, &x_w->w3};
    float *y13[2] = {g, u};
    if ((rc = pd_linear_fwd_many(l13, y13, 2, en->pool, en->ref, x, xq, n, e)))
        goto out;
    /* a prefill's rows over the pool (the shared expert's 512 x 256 values took 0.13 ms a layer on
     * the caller while the other threads waited) */
    struct act_job aj = {.g = g, .u = u, .P = n, .I = I, .limit = (float)m->swiglu_limit};
    pd_pool_run((int64_t)n * I < ACT_SERIAL_VALUES ? NULL : en->pool, (n + ACT_ROWS - 1) / ACT_ROWS, act_task, &aj);
    rc = pd_linear_fwd(&x_w->w2, en->pool, en->ref, g, n, y, st->qbuf, st->sbuf, e);
out:
    return rc;
}

/* The experts' grouped product, clocked as the step profile's experts piece (engine/prof.h). */
static int experts_gemm(struct pd_engine *en, const pd_qmat *a, const pd_gemm_group *grp, int n, pd_err *e)
{
    struct pd_call_clock *clock = &en->prof.piece[PD_PROF_EXPERTS_GEMM];
    int64_t t0 = pd_call_clock_start(clock);
    int rc = pd_gemm_grouped(en->pool, a, grp, n, 0, e);
    pd_call_clock_stop(clock, t0);
    return rc;
}

/* Routed experts with grouped int8 GEMMs: pair p runs expert[p] on row[p] of the quantised
 * activations a; after a counting sort the pairs of one expert are contiguous (in pair order),
 * and y[p] (dst[p] when dst is given) receives the expert's output; with yp instead, yp[p]
 * points at it where the down projection left it (this engine's scratch, valid until the next
 * layer's experts run), and nothing is copied. With `shared` (int8, of the same intermediate size)
 * the shared expert also runs on rows 0 .. ns - 1 of a, as one more group of each product (one
 * pool run each instead of three more: the same kernels per row, so the bits ffn_rows gives), its
 * outputs into ysh [ns, H]. */
static int run_experts(struct pd_engine *en, int layer, const pd_qmat *a, const int32_t *row, const int32_t *expert,
                       int P, float *y, float *const *dst, const float **yp, const struct pd_expert_w *shared, int ns,
                       float *ysh, pd_err *e)
{
    const struct pd_model *m = &en->model;
    const struct pd_layer_w *L = pd_layer_weights(en, layer);
    const int E = m->n_routed_experts, H = (int)m->hidden_size, I = (int)m->moe_intermediate_size;
    int rc = PD_ENOMEM;
    if (!shared)
        ns = 0;
    if (P + ns == 0)
        return 0;
    const int PS = P + ns;   /* rows of g, u, ys: the routed pairs, then the shared expert's */
    /* slot 30: the groups, then tok [PS], then the counting sort's count [E + 1] and fill [E] */
    char *base = pd_scratch(en, 30, 2 * ((size_t)E + 1) * sizeof(pd_gemm_group) + ((size_t)PS + 2 * (size_t)E + 1) * 4, e);
    pd_gemm_group *grp = (pd_gemm_group *)base;   /* [2 * (E + 1)] */
    int32_t *tok = base ? (int32_t *)(base + 2 * ((size_t)E + 1) * sizeof *grp) : NULL;
    int *count = base ? tok + PS : NULL, *fill = base ? count + E + 1 : NULL;
    int32_t *pair = pd_scratch(en, 31, (size_t)PS * 4, e);
    int32_t *seqrow = pd_scratch(en, 32, (size_t)PS * 4, e);
    float *g = pd_scratch(en, 33, (size_t)PS * I * 4, e), *u = pd_scratch(en, 34, (size_t)PS * I * 4, e);
    float *ys = pd_scratch(en, 35, (size_t)PS * H * 4, e);
    int8_t *qi = pd_scratch(en, 36, (size_t)PS * I, e);
    float *si = pd_scratch(en, 37, (size_t)PS * 4, e);
    if (!base || !pair || !seqrow || !g || !u || !ys || !qi || !si)
        goto out;
    memset(count, 0, (2 * (size_t)E + 1) * sizeof *count);
    for (int p = 0; p < P; p++) {
        if (expert[p] < 0 || expert[p] >= E) {
            rc = pd_err_set(e, PD_EINVAL, "engine: expert %d outside [0, %d)", expert[p], E);
            goto out;
        }
        count[expert[p] + 1]++;
    }
    for (int x = 0; x < E; x++) {
        if (en->expert_tokens)
            en->expert_tokens[(size_t)layer * E + x] += count[x + 1];
        count[x + 1] += count[x];
    }
    for (int p = 0; p < P; p++) {
        int x = expert[p], at = count[x] + fill[x]++;
        tok[at] = row[p];
        pair[at] = p;
        seqrow[at] = at;
    }
    int ng = 0;
    for (int x = 0; x < E; x++) {
        int n = count[x + 1] - count[x];
        if (!n)
            continue;
        if (!L->experts[x].w1.q.q) {
            rc = pd_err_set(e, PD_EINVAL, "engine: layer %d expert %d is routed to but not held by this process", layer, x);
            goto out;
        }
        /* w1 and w3 of each expert one after the other, all in one grouped product: the kernel
         * streams from one matrix into the next */
        grp[2 * ng] = (pd_gemm_group){.w = L->experts[x].w1.q, .rows = tok + count[x], .n = n, .y = g + (size_t)count[x] * I};
        grp[2 * ng + 1] = (pd_gemm_group){.w = L->experts[x].w3.q, .rows = tok + count[x], .n = n, .y = u + (size_t)count[x] * I};
        ng++;
    }
    const int nr = ng;   /* routed groups; the shared expert's follows */
    if (ns) {
        for (int t = 0; t < ns; t++) {
            tok[P + t] = t;            /* the shared expert reads token t's row of a ... */
            seqrow[P + t] = P + t;     /* ... and its own row of the activations for w2 */
        }
        grp[2 * ng] = (pd_gemm_group){.w = shared->w1.q, .rows = tok + P, .n = ns, .y = g + (size_t)P * I};
        grp[2 * ng + 1] = (pd_gemm_group){.w = shared->w3.q, .rows = tok + P, .n = ns, .y = u + (size_t)P * I};
        ng++;
    }
    if ((rc = experts_gemm(en, a, grp, 2 * ng, e)))
        goto out;
    struct act_job aj = {.g = g, .u = u, .q = qi, .s = si, .P = PS, .I = I, .limit = (float)m->swiglu_limit};
    /* a decode step's few rows (7 x 256 values at batch 1) cost less than a hand-off */
    pd_pool_run((int64_t)PS * I < ACT_SERIAL_VALUES ? NULL : en->pool, (PS + ACT_ROWS - 1) / ACT_ROWS, act_task, &aj);
    pd_qmat a2 = {.q = qi, .scale = si, .rows = PS, .cols = I};
    for (int i = 0; i < nr; i++) {
        int at = (int)(grp[2 * i].rows - tok);
        grp[i] = (pd_gemm_group){.w = L->experts[expert[pair[at]]].w2.q, .rows = seqrow + at, .n = grp[2 * i].n,
                                 .y = ys + (size_t)at * H};
    }
    if (ns)
        grp[nr] = (pd_gemm_group){.w = shared->w2.q, .rows = seqrow + P, .n = ns, .y = ys + (size_t)P * H};
    if ((rc = experts_gemm(en, &a2, grp, ng, e)))
        goto out;
    for (int at = 0; at < P; at++)
        if (yp)
            yp[pair[at]] = ys + (size_t)at * H;
        else
            memcpy(dst ? dst[pair[at]] : y + (size_t)pair[at] * H, ys + (size_t)at * H, (size_t)H * 4);
    if (ns)
        memcpy(ysh, ys + (size_t)P * H, (size_t)ns * H * 4);
    rc = 0;
out:
    return rc;
}

int pd_engine_run_experts(struct pd_engine *en, int layer, const pd_qmat *a, const int32_t *row,
                          const int32_t *expert, int P, float *y, float *const *dst, pd_err *e)
{
    return run_experts(en, layer, a, row, expert, P, y, dst, NULL, NULL, 0, NULL, e);
}

/* The routed experts of this process's tokens, here: pair p = (token p / k, slot p % k), its output
 * at yp[p] (run_experts); with `shared`, the shared expert on every token too (into ysh). */
static int experts_local(struct pd_engine *en, int layer, const pd_qmat *a, const int32_t *ids, int T,
                         const float **yp, const struct pd_expert_w *shared, float *ysh, pd_err *e)
{
    const int k = en->model.n_experts_per_tok;
    int32_t *row = pd_scratch(en, 42, (size_t)T * k * 4 + 4, e);
    if (!row)
        return PD_ENOMEM;
    for (int p = 0; p < T * k; p++)
        row[p] = p / k;
    return run_experts(en, layer, a, row, ids, T * k, NULL, NULL, yp, shared, T, ysh, e);
}

/* The layer's output per token: out[t] = sum_j w[t][j] * yp[t][j] (+ the shared expert's sh[t]),
 * each token's sum by pd_weighted_sum_rows whichever task runs it (the same bits). */
struct combine_job {
    const float *w, *const *yp, *sh;
    float *out;
    int k, H, T;
};

enum { COMBINE_TOKENS = 16 };

static void combine_task(void *arg, int task)
{
    const struct combine_job *j = arg;
    const int t1 = (task + 1) * COMBINE_TOKENS < j->T ? (task + 1) * COMBINE_TOKENS : j->T;
    for (int t = task * COMBINE_TOKENS; t < t1; t++)
        pd_weighted_sum_rows(j->w + (size_t)t * j->k, j->yp + (size_t)t * j->k, j->k,
                             j->sh ? j->sh + (size_t)t * j->H : NULL, j->out + (size_t)t * j->H, j->H);
}

int pd_moe_layer(struct pd_step *st, int layer, pd_err *e)
{
    struct pd_engine *en = st->en;
    const struct pd_model *m = &en->model;
    const struct pd_layer_w *L = pd_layer_weights(en, layer);
    const int k = m->n_experts_per_tok, H = (int)m->hidden_size, T = st->T;
    int rc = PD_ENOMEM;
    int32_t *ids = pd_scratch(en, 38, (size_t)T * k * 4, e);
    float *w = pd_scratch(en, 39, (size_t)T * k * 4, e);
    float *y = pd_scratch(en, 40, (size_t)T * k * H * 4, e);   /* [T, k, H] each pair's expert output */
    float *sh = pd_scratch(en, 41, (size_t)T * H * 4, e);
    float *scores = pd_scratch(en, 43, (size_t)T * m->n_routed_experts * 4, e);
    const float **yp = pd_scratch(en, 50, (size_t)T * k * sizeof *yp, e);   /* [T, k] each pair's output */
    if (!ids || !w || !y || !sh || !scores || !yp)
        goto out;
    /* each pair's output is its row of y, unless experts_fn leaves it elsewhere (engine.h) */
    for (int p = 0; p < T * k; p++)
        yp[p] = y + (size_t)p * H;
    if ((rc = route(st, L, ids, w, scores, e)))
        goto out;
    /* a decode step's shared expert joins the routed experts' grouped products when they run
     * here (int8, the same intermediate size): two pool runs fewer a layer, the same bits */
    const int fuse_shared = m->n_shared_experts > 0 && !en->ref && !en->experts_fn && T <= SHARED_FUSE_T &&
                            L->shared.w1.q.q && L->shared.w3.q.q && L->shared.w2.q.q &&
                            L->shared.w1.out == m->moe_intermediate_size;
    if (en->ref) {
        for (int p = 0; p < T * k; p++) {
            if (en->expert_tokens)
                en->expert_tokens[(size_t)layer * m->n_routed_experts + ids[p]]++;
            if ((rc = ffn_rows(st, &L->experts[ids[p]], st->x + (size_t)(p / k) * H, NULL, 1, y + (size_t)p * H, e)))
                goto out;
        }
    } else {
        /* activations quantised once (st->xq), on the rank that owns the token, whoever runs the
         * expert */
        if (en->experts_fn) {
            pd_prof_enter(&en->prof, PD_PROF_EXCHANGE);
            rc = en->experts_fn(en->experts_ctx, en, layer, &st->xq, ids, T, y, yp, e);
            pd_prof_leave(&en->prof);
        } else {
            rc = experts_local(en, layer, &st->xq, ids, T, yp, fuse_shared ? &L->shared : NULL, sh, e);
        }
        if (rc)
            goto out;
    }
    if (m->n_shared_experts > 0 && !fuse_shared && (rc = ffn_rows(st, &L->shared, st->x, &st->xq, T, sh, e)))
        goto out;
    /* a prefill's tokens over the pool, COMBINE_TOKENS a task; a few tokens on the caller */
    struct combine_job cb = {.w = w, .yp = yp, .sh = m->n_shared_experts > 0 ? sh : NULL, .out = st->out, .k = k,
                             .H = H, .T = T};
    pd_pool_run(T < 2 * COMBINE_TOKENS ? NULL : en->pool, (T + COMBINE_TOKENS - 1) / COMBINE_TOKENS, combine_task, &cb);
    rc = 0;
out:
    return rc;
}

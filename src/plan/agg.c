/* The performance model of aggregated instances (perf.h): each instance prefills and decodes on
 * the same cards, vLLM's and SGLang's chunked prefill putting a prompt's tokens into the steps
 * that decode, up to max-num-batched-tokens per step. docs/perf-model.md, "Aggregated". */
#include "plan/lockstep.h"
#include "plan/perf.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One DP rank of an aggregated instance at a decode batch b. M = max-num-batched-tokens,
 * k = 1 + drafts tokens computed per decoding sequence and step, tps = tokens yielded per step
 * (pd_perf_decode_tokens, pd_perf_tokens_per_step),
 * I = a prompt's tokens not served from the prefix cache, c_d = the mean decode context.
 *
 *   chunk     c = M - b x k                    the scheduler puts the decode tokens first and
 *                                              fills the step's budget with prompt tokens
 *   T_mix(b)  = step(b decode sequences at c_d + a chunk)     pd_perf_step_mixed: one pass, the
 *               weights read once for both parts; a chunk is c tokens of one prompt (I >= c) or
 *               floor(c / I) whole prompts (I < c): c_eff tokens
 *   T_dec(b)  = step(b decode sequences)
 *   per step b x tps / osl requests finish decoding, and as many must be prefilled to keep the
 *   batch fed: b x tps x I / osl prompt tokens, so a share
 *   phi       = b x tps x I / (osl x c_eff)    of the steps carries a chunk (fed while phi <= 1)
 *   step      = phi x T_mix + (1 - phi) x T_dec               the mean step (phi capped at 1)
 *   TPOT      = step / tps                     a decoding token waits for each chunk its steps carry
 *   prefill   = sum over the prompt's ceil(I / c) chunks of T_mix(b) with that chunk at its
 *               offset; the last chunk's step samples the first token (no hand-off, no decode step)
 *   TTFT      = request + prefill  (+ the M/D/c wait before prefill at an open-loop rate, the
 *               deployment's DP ranks as servers, prefill as the service)
 *   X_p       = c_eff / (I x T_mix)            prompts/s of a rank whose every step carries a chunk
 *   X_rank    = min(b x tps / (osl x step), X_p)              requests/s of a rank
 *   requests/s = X_rank x ranks, output tokens/s per card = requests/s x osl / cards
 * The memory budget is the plan's (plan.h): activations of a step of M tokens, KV for
 * max-num-seqs sequences of max-model-len, so b <= the KV pool's sequences at isl + osl. */
void pd_perf_agg_at(const struct pd_plan *p, const struct pd_workload *w, int64_t b, struct pd_agg *a)
{
    const struct pd_role_plan *D = &p->role[PD_ROLE_DECODE];
    memset(a, 0, sizeof *a);
    const int64_t M = p->o.max_num_batched_tokens, k = pd_perf_decode_tokens(p);
    const double tps = pd_perf_tokens_per_step(p);
    const int64_t cached = (int64_t)floor((double)w->isl * w->cached), I = w->isl - cached;
    const int64_t ctx = w->decode_ctx > 0 ? w->decode_ctx : w->isl + w->osl / 2;
    int64_t seq = pd_kv_seq_bytes(&p->kv, w->isl + w->osl);
    const int64_t room = pd_budget_seq_room(&D->b);   /* (the chunks' window blocks set aside) */
    a->batch_cap = room > 0 && seq > 0 ? room / seq : 0;
    a->batch = b;
    struct pd_step_part dec = {b, k, ctx}, none = {0, 0, 0};
    pd_perf_step_mixed(p, PD_ROLE_DECODE, &dec, &none, &a->decode_step);
    a->chunk = M - b * k;
    if (a->chunk < 1) {          /* the decode tokens fill the budget: no prompt ever advances */
        a->chunk = 0;
        a->step_s = a->decode_step.total_s;
        a->prefill_s = INFINITY;
        return;
    }
    int64_t c_eff;
    struct pd_step_part pre;
    if (I >= a->chunk) {
        pre = (struct pd_step_part){1, a->chunk, cached + (I - a->chunk) / 2};
        c_eff = a->chunk;
    } else {
        pre = (struct pd_step_part){a->chunk / I, I, cached};
        c_eff = pre.seqs * I;
    }
    pd_perf_step_mixed(p, PD_ROLE_PREFILL, &dec, &pre, &a->mixed_step);
    a->chunks = (I + a->chunk - 1) / a->chunk;
    for (int64_t off = 0; off < I; off += a->chunk) {
        struct pd_step_part part = {1, I - off < a->chunk ? I - off : a->chunk, cached + off};
        struct pd_step s;
        pd_perf_step_mixed(p, PD_ROLE_PREFILL, &dec, &part, &s);
        a->prefill_s += s.total_s;
    }
    a->chunk_share = (double)b * tps * (double)I / ((double)w->osl * (double)c_eff);
    a->fed = a->chunk_share <= 1;
    double phi = a->chunk_share < 1 ? a->chunk_share : 1;
    a->step_s = phi * a->mixed_step.total_s + (1 - phi) * a->decode_step.total_s;
    a->prefill_rank_req_s = (double)c_eff / ((double)I * a->mixed_step.total_s);
    double x = (double)b * tps / ((double)w->osl * a->step_s);
    a->rank_req_s = x < a->prefill_rank_req_s ? x : a->prefill_rank_req_s;
}

int64_t pd_perf_agg_slots(const struct pd_plan *p, const struct pd_workload *w)
{
    struct pd_agg a;
    pd_perf_agg_at(p, w, 1, &a);
    const int64_t admit = pd_plan_admitted_seqs(p, PD_ROLE_DECODE);
    int64_t n = w->decode_batch > 0 ? w->decode_batch : a.batch_cap < admit ? a.batch_cap : admit;
    const int64_t k = pd_perf_decode_tokens(p);
    if (n > (p->o.max_num_batched_tokens - 1) / k)
        n = (p->o.max_num_batched_tokens - 1) / k;
    return n > 1 ? n : 1;
}

int64_t pd_perf_agg_batch(const struct pd_plan *p, const struct pd_workload *w)
{
    int64_t lo = 1, hi = pd_perf_agg_slots(p, w);
    struct pd_agg a;
    while (lo < hi) {            /* phi grows with b: bisect for the largest fed batch */
        int64_t mid = lo + (hi - lo + 1) / 2;
        pd_perf_agg_at(p, w, mid, &a);
        if (a.fed)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

int pd_perf_agg(const struct pd_plan *p, const struct pd_workload *w, struct pd_perf *f, pd_err *e)
{
    const struct pd_role_plan *D = &p->role[PD_ROLE_DECODE];
    struct pd_agg *a = &f->agg;
    f->w = *w;
    f->aggregated = 1;
    const int64_t slots = pd_perf_agg_slots(p, w);
    pd_perf_agg_at(p, w, pd_perf_agg_batch(p, w), a);
    const int ranks = D->o.dp * D->o.instances, cards = D->cards;
    const double tps = pd_perf_tokens_per_step(p);
    f->mtp = p->mtp;
    f->prefill_step = a->mixed_step;
    f->decode_step = a->decode_step;
    f->prefill_s = a->prefill_s;
    f->handoff_s = 0;
    f->request_s = p->hw.eff.request_s;
    f->ttft_s = f->request_s + a->prefill_s;
    f->ttft_rate_s = f->ttft_s + pd_perf_queue_wait(ranks, a->prefill_s, w->rate);   /* (and past req_s: below) */
    f->batch = a->batch;
    f->batch_cap = a->batch_cap;
    f->tokens_per_step = tps;
    f->tpot_s = a->step_s / tps;
    f->user_tok_s = 1 / f->tpot_s;
    f->prefill_req_s = a->prefill_rank_req_s * ranks;
    f->prefill_rank_tok_s = a->prefill_rank_req_s * (double)w->isl;
    f->prefill_tok_s_card = f->prefill_rank_tok_s / D->o.tp;
    f->decode_rank_out_s = (double)a->batch * tps / a->step_s;
    f->decode_tok_s_card = f->decode_rank_out_s / D->o.tp;
    f->decode_req_s = f->decode_rank_out_s * ranks / (double)w->osl;
    f->req_s = a->rank_req_s * ranks;
    if (w->rate > f->req_s)   /* past what the deployment sustains the queue grows without end */
        f->ttft_rate_s = INFINITY;
    f->tok_s_card = cards > 0 ? f->req_s * (double)w->osl / cards : 0;
    f->prefill_bound = a->mixed_step.bound;
    f->decode_bound = !w->decode_batch && a->batch < p->o.max_num_seqs ? PD_BOUND_CAPACITY : a->decode_step.bound;
    f->fits = D->b.fits_weights && a->batch >= 1 && slots <= a->batch_cap && a->chunk >= 1;
    if (w->concurrency > 0 && w->lockstep) {
        return pd_perf_lockstep(p, w, slots, &f->closed, NULL, e);
    } else if (w->concurrency > 0) {
        struct pd_agg_curve c;
        int64_t n = w->concurrency < slots ? w->concurrency : slots;
        if (pd_perf_agg_curve(p, w, n, &c) == 0) {
            pd_perf_agg_closed(&c, w->concurrency, w->osl, f->request_s, ranks, slots, cards, &f->closed);
            pd_perf_agg_curve_free(&c);
        } else {
            f->closed.cycle_s = INFINITY;
        }
    }
    return 0;
}

int pd_perf_agg_curve(const struct pd_plan *p, const struct pd_workload *w, int64_t n, struct pd_agg_curve *c)
{
    memset(c, 0, sizeof *c);
    if (n < 1)
        n = 1;
    c->n = n;
    c->tokens_per_step = pd_perf_tokens_per_step(p);
    c->step_s = malloc((size_t)(n + 1) * sizeof *c->step_s);
    c->prefill_s = malloc((size_t)(n + 1) * sizeof *c->prefill_s);
    c->prefill_req_s = malloc((size_t)(n + 1) * sizeof *c->prefill_req_s);
    if (!c->step_s || !c->prefill_s || !c->prefill_req_s) {
        pd_perf_agg_curve_free(c);
        return PD_ENOMEM;
    }
    c->step_s[0] = c->prefill_s[0] = c->prefill_req_s[0] = 0;
    for (int64_t b = 1; b <= n; b++) {
        struct pd_agg a;
        pd_perf_agg_at(p, w, b, &a);
        c->step_s[b] = a.step_s;
        c->prefill_s[b] = a.prefill_s;
        c->prefill_req_s[b] = a.prefill_rank_req_s;
    }
    return 0;
}

void pd_perf_agg_curve_free(struct pd_agg_curve *c)
{
    free(c->step_s);
    free(c->prefill_s);
    free(c->prefill_req_s);
    c->step_s = c->prefill_s = c->prefill_req_s = NULL;
}

/* A curve's value at a fractional batch: linear between the integer batches around it. */
static double lerp(const double *t, int64_t n, double b)
{
    int64_t lo = (int64_t)floor(b);
    if (lo >= n)
        return t[n];
    if (lo < 1)
        return t[1];
    return t[lo] + (b - (double)lo) * (t[lo + 1] - t[lo]);
}

/* The aggregated closed loop by mean value analysis (Schweitzer's approximation), per DP rank:
 * N = clients / ranks clients cycle through a think time (the request's fixed cost), a FCFS
 * prefill station (one prompt's chunks at a time: service P(b)) and a delay station (decode:
 * D(b) = (osl - 1) x TPOT(b)); an arriving client sees the queue the other N - 1 leave:
 *
 *   R_p = P(b) x (1 + (N - 1) / N x Q_p)       time in prefill, queue included
 *   X   = min( N / (request + R_p + D(b)),  X_p(b),  slots / D(b) )     requests/s of a rank
 *   Q_p = X x R_p                               prompts at the prefill station (Little)
 *   b   = min(slots, 1 + (N - 1) / N x X x D(b))   a decoding request and its share of the others
 *   cycle = N / X,  TTFT = cycle - D(b),  output tokens/s = X x ranks x osl
 *
 * iterated with damping from b = 1, Q_p = 0 to a fixed point. N = 1 gives TTFT = request + P(1)
 * and TPOT(1); at C = 2 or 4 the prompts that arrive together queue behind each other's chunks,
 * the wait the deterministic loop (pd_perf_closed) leaves out below prefill's capacity. */
void pd_perf_agg_closed(const struct pd_agg_curve *c, int64_t clients, int64_t osl, double request_s, int ranks,
                        int64_t slots, int cards, struct pd_closed *out)
{
    memset(out, 0, sizeof *out);
    const double S = ranks > 0 ? ranks : 1, N = (double)clients / S, share = N > 1 ? (N - 1) / N : 0;
    const double bmax = (double)(slots < c->n ? slots : c->n) >= 1 ? (double)(slots < c->n ? slots : c->n) : 1;
    double b = 1, q = 0, x = 0, rp = 0, d = 0, xc = 0, xp = 0, xs = 0;
    for (int it = 0; it < 2000; it++) {
        double tpot = lerp(c->step_s, c->n, b) / c->tokens_per_step;
        d = (double)(osl - 1) * tpot;
        rp = lerp(c->prefill_s, c->n, b) * (1 + share * q);
        xc = N / (request_s + rp + d);
        xp = lerp(c->prefill_req_s, c->n, b);
        xs = d > 0 ? bmax / d : INFINITY;
        x = fmin(fmin(xc, xp), xs);
        double qn = fmin(x * rp, N), bn = fmin(bmax, 1 + share * x * d);
        int done = fabs(bn - b) < 1e-9 && fabs(qn - q) < 1e-9;
        b = 0.5 * (b + bn);
        q = 0.5 * (q + qn);
        if (done)
            break;
    }
    double tpot = lerp(c->step_s, c->n, b) / c->tokens_per_step;
    out->batch = b;
    out->tpot_s = tpot;
    out->cycle_s = N / x;
    out->ttft_s = out->cycle_s - d;
    out->wait_s = fmax(0, out->ttft_s - request_s - lerp(c->prefill_s, c->n, b));
    out->limit = x >= xc ? PD_CLOSED_CLIENTS : xp <= xs ? PD_CLOSED_PREFILL : PD_CLOSED_DECODE_SLOTS;
    out->req_s = x * S;
    out->tok_s = out->req_s * (double)osl;
    out->tok_s_card = cards > 0 ? out->tok_s / cards : 0;
    out->slots = slots > 1 ? slots : 1;
}

void pd_perf_agg_text(const struct pd_plan *p, const struct pd_perf *f, void *file)
{
    FILE *o = file;
    const struct pd_agg *a = &f->agg;
    const struct pd_role_plan *D = &p->role[PD_ROLE_DECODE];
    const int ranks = D->o.dp * D->o.instances;
    fprintf(o, "  aggregated: each of %d DP ranks prefills and decodes, prompt chunks sharing steps with decode\n", ranks);
    fprintf(o, "  chunk           %10lld prompt tokens per mixed step (max-num-batched-tokens %lld - batch %lld x %d); "
               "%lld chunk%s per prompt\n",
            (long long)a->chunk, (long long)p->o.max_num_batched_tokens, (long long)a->batch,
            (int)pd_perf_decode_tokens(p), (long long)a->chunks, a->chunks == 1 ? "" : "s");
    fprintf(o, "  steps           %10.3f ms mixed, %.3f ms decode alone; %.1f%% of steps carry a chunk%s; mean %.3f ms\n",
            a->mixed_step.total_s * 1e3, a->decode_step.total_s * 1e3, 100 * (a->chunk_share < 1 ? a->chunk_share : 1),
            a->fed ? "" : " (the chunks cannot feed this batch: prefill limits)", a->step_s * 1e3);
    fprintf(o, "  TTFT            %10.1f ms  = request %.1f ms + the prompt's %lld mixed step%s %.1f ms (no hand-off)\n",
            f->ttft_s * 1e3, f->request_s * 1e3, (long long)a->chunks, a->chunks == 1 ? "" : "s", f->prefill_s * 1e3);
    if (f->w.rate > 0 && !isfinite(f->ttft_rate_s))
        fprintf(o, "  TTFT at %.2f req/s   unbounded: the rate is above the %.2f requests/s this deployment sustains, "
                   "so the queue grows without end\n", f->w.rate, f->req_s);
    else if (f->w.rate > 0)
        fprintf(o, "  TTFT at %.2f req/s %10.1f ms (queueing for %d DP ranks)\n", f->w.rate, f->ttft_rate_s * 1e3, ranks);
    fprintf(o, "  TPOT            %10.2f ms  (%.1f tokens/s per user; batch %lld per DP rank, KV room for %lld; "
               "%.2f tokens per step)\n",
            f->tpot_s * 1e3, f->user_tok_s, (long long)f->batch, (long long)f->batch_cap, f->tokens_per_step);
    fprintf(o, "  throughput      %10.2f requests/s, %.0f output tokens/s per card over %d cards (%s)%s\n", f->req_s,
            f->tok_s_card, D->cards, a->fed ? "decode batch limits" : "prefill limits", f->fits ? "" : "; DOES NOT FIT");
}

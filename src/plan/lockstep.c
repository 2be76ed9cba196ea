/* The aggregated closed loop in lockstep (lockstep.h): a step-by-step run of one DP rank.
 *
 * One rank, n clients, each sending R requests (I prompt tokens after the prefix cache, osl
 * output tokens). M = max-num-batched-tokens, k = 1 + mtp tokens computed per decoding sequence
 * and step, tps = tokens accepted per step (1 + mtp x acceptance), cap = prefill_max_requests.
 * A request reaches the scheduler `request` seconds after its client sends it. Each step, at
 * time t:
 *   decode    every decoding sequence: b sequences, k tokens each, at their mean context; with
 *             prefill-first (SGLang's schedule) none while a prompt waits that can start
 *   chunks    the prompts that have arrived, first come first served (a prompt begun before
 *             the others), fill the budget M - (decoding in the step) x k, at most cap of them, a prompt entering
 *             only while the decoding and begun sequences are fewer than the slots
 *   T         = step(decode part + chunk part)     pd_perf_step_mixed, one pass for both
 *   t        += T; each decoding sequence gains tps tokens and finishes at osl, its client
 *             sending the next request at once; a prompt whose last chunk was in the step has
 *             its first token at t (and decodes from the next step)
 * A step with neither waits for the next arrival. Per request: TTFT = first token - sent,
 * TPOT = (finished - first token) / (osl - 1) (a benchmark's), wait = its first chunk's step
 * start - arrival. The figures are means over the requests measured; requests/s of a client =
 * its measured requests over the time from the finish before the first of them to the last one
 * (the steady state), or all requests over the run's duration (num_prompts, one wave included). */
#include "plan/lockstep.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { C_WAIT, C_QUEUED, C_DECODE, C_IDLE };

struct client {
    int state;
    int64_t left;                /* requests still to finish, this one included */
    int64_t finished;            /* requests finished */
    double sent, arrive, started, first, last_done, mark;
    int64_t prefilled, take;     /* prompt tokens computed; tokens in the current step */
    double made;                 /* output tokens so far */
};

struct rank_run {
    double ttft, tpot, wait;     /* sums over the measured requests */
    int64_t measured;
    double rate;                 /* requests/s of the rank (steady state) */
    double duration;
    double batch_time, decode_time;   /* sum of b x T over steps with decodes, and of T */
    struct pd_lockstep d;
};

/* A request finishes at t: counted from the client's skip-th on; its client sends the next. */
static void finish(struct rank_run *r, struct client *x, double t, const struct pd_workload *w, int64_t skip,
                   double req, int64_t *active)
{
    if (x->finished >= skip) {
        r->ttft += x->first - x->sent;
        r->tpot += w->osl > 1 ? (t - x->first) / (double)(w->osl - 1) : 0;
        r->wait += x->started - x->arrive;
        r->measured++;
    }
    if (x->finished + 1 == skip)
        x->mark = t;
    x->finished++;
    x->last_done = t;
    if (--x->left > 0) {
        x->state = C_WAIT;
        x->sent = t;
        x->arrive = t + req;
    } else {
        x->state = C_IDLE;
        (*active)--;
    }
}

struct arrival {
    double at;
    int64_t client;
};

static int by_arrival(const void *a, const void *b)
{
    const struct arrival *x = a, *y = b;
    return x->at < y->at ? -1 : x->at > y->at ? 1 : (x->client > y->client) - (x->client < y->client);
}

static void run_rank(const struct pd_plan *p, const struct pd_workload *w, int64_t n, int64_t reqs, int64_t skip,
                     int64_t slots, struct rank_run *r)
{
    memset(r, 0, sizeof *r);
    struct client *c = calloc((size_t)n, sizeof *c);
    int64_t *q = malloc((size_t)n * sizeof *q);
    struct arrival *arr = malloc((size_t)n * sizeof *arr);
    if (!c || !q || !arr) {
        free(c);
        free(q);
        free(arr);
        r->rate = NAN;
        return;
    }
    const int64_t M = p->o.max_num_batched_tokens, k = pd_perf_decode_tokens(p);
    const double tps = pd_perf_tokens_per_step(p), req = p->hw.eff.request_s;
    const int64_t cached = (int64_t)floor((double)w->isl * w->cached), I = w->isl - cached;
    const int64_t cap = w->prefill_max_requests > 0 ? w->prefill_max_requests : n;
    int64_t qh = 0, qt = 0, active = n;  /* the queue of arrived prompts, in arrival order: q[qh..qt) */
    for (int64_t i = 0; i < n; i++)
        c[i] = (struct client){.state = C_WAIT, .left = reqs, .arrive = req};
    r->d.clients = n;
    r->d.requests = reqs;
    double t = 0;
    while (active > 0) {
        /* arrivals up to t join the queue, earliest first (ties by client) */
        int64_t na = 0;
        for (int64_t i = 0; i < n; i++)
            if (c[i].state == C_WAIT && c[i].arrive <= t + 1e-12)
                arr[na++] = (struct arrival){c[i].arrive, i};
        qsort(arr, (size_t)na, sizeof *arr, by_arrival);
        for (int64_t j = 0; j < na; j++) {
            c[arr[j].client].state = C_QUEUED;
            c[arr[j].client].prefilled = 0;
            q[qt++ % n] = arr[j].client;
        }
        int64_t b = 0, begun = 0;
        double ctx = 0;
        for (int64_t i = 0; i < n; i++) {
            if (c[i].state == C_DECODE) {
                b++;
                ctx += (double)w->isl + c[i].made;
            }
            begun += c[i].state == C_QUEUED && c[i].prefilled > 0;
        }
        /* prefill-first: a step that can take a prompt carries prompts only, the decodes waiting */
        int64_t bd = b;
        if (w->prefill_first && qh < qt && (c[q[qh % n]].prefilled > 0 || b + begun < slots))
            bd = 0;
        int64_t budget = M - bd * k, np = 0, ptok = 0;
        double pctx = 0;
        for (int64_t j = qh; j < qt && budget > 0 && np < cap; j++) {
            struct client *x = &c[q[j % n]];
            if (x->prefilled == 0 && b + begun >= slots)   /* the decodes hold their slots, waiting or not */
                break;
            begun += x->prefilled == 0;
            x->take = I - x->prefilled < budget ? I - x->prefilled : budget;
            budget -= x->take;
            ptok += x->take;
            pctx += (double)(cached + x->prefilled);
            np++;
        }
        if (b == 0 && np == 0) {        /* idle until the next request arrives */
            double next = INFINITY;
            for (int64_t i = 0; i < n; i++)
                if (c[i].state == C_WAIT && c[i].arrive < next)
                    next = c[i].arrive;
            if (!isfinite(next))
                break;
            t = next;
            continue;
        }
        struct pd_step_part dec = {bd, k, b > 0 ? (int64_t)(ctx / (double)b) : 0};
        struct pd_step_part pre = {np, np > 0 ? (ptok + np - 1) / np : 0, np > 0 ? (int64_t)(pctx / (double)np) : 0};
        struct pd_step s;
        pd_perf_step_mixed(p, np > 0 ? PD_ROLE_PREFILL : PD_ROLE_DECODE, &dec, &pre, &s);
        if (r->d.steps == 0)
            r->d.first_step = s;
        const double t0 = t;
        t += s.total_s;
        r->d.steps++;
        if (np > 0) {
            r->d.mixed_steps++;
            r->d.mixed_s += s.total_s;
        } else {
            r->d.decode_s += s.total_s;
        }
        if (bd > 0) {
            r->batch_time += (double)bd * s.total_s;
            r->decode_time += s.total_s;
        }
        for (int64_t i = 0; i < n && bd > 0; i++) {
            struct client *x = &c[i];
            if (x->state != C_DECODE)
                continue;
            x->made += tps;
            if (x->made + 1e-9 < (double)w->osl)
                continue;
            finish(r, x, t, w, skip, req, &active);
        }
        for (int64_t j = qh, m = 0; j < qt && m < np; j++, m++) {
            struct client *x = &c[q[j % n]];
            if (x->prefilled == 0)
                x->started = t0;
            x->prefilled += x->take;
            x->take = 0;
        }
        while (qh < qt && c[q[qh % n]].prefilled >= I) {   /* prompts complete in queue order */
            struct client *x = &c[q[qh++ % n]];
            x->first = t;
            x->made = 1;
            x->state = C_DECODE;
            if (w->osl <= 1)             /* the prompt's token was the whole output */
                finish(r, x, t, w, skip, req, &active);
        }
    }
    r->duration = t;
    r->d.duration_s = t;
    for (int64_t i = 0; i < n; i++)
        if (c[i].finished > skip && c[i].last_done > c[i].mark)
            r->rate += (double)(c[i].finished - skip) / (c[i].last_done - c[i].mark);
    struct pd_step_part dec = {n, k, w->isl + w->osl / 2}, none = {0, 0, 0};
    pd_perf_step_mixed(p, PD_ROLE_DECODE, &dec, &none, &r->d.decode_step);
    free(c);
    free(q);
    free(arr);
}

/* Requests per client in the steady state: the first is the ramp, the other 15 are measured. */
#define STEADY_REQUESTS 16

void pd_perf_lockstep(const struct pd_plan *p, const struct pd_workload *w, int64_t slots, struct pd_closed *out,
                      struct pd_lockstep *detail)
{
    memset(out, 0, sizeof *out);
    const struct pd_role_plan *D = &p->role[PD_ROLE_DECODE];
    const int64_t S = D->o.dp * D->o.instances > 0 ? D->o.dp * D->o.instances : 1, C = w->concurrency;
    const int wave = w->num_prompts > 0;
    const int64_t reqs = wave ? w->num_prompts / C : STEADY_REQUESTS, skip = wave ? 0 : 1;
    /* C = qn x S + rem: rem ranks run qn + 1 clients, the other S - rem run qn */
    const int64_t qn = C / S, rem = C % S;
    const int64_t group_n[2] = {qn + 1, qn}, group_ranks[2] = {rem, S - rem};
    double ttft = 0, tpot = 0, wait = 0, rate = 0, duration = 0, bt = 0, dt = 0;
    int64_t measured = 0, done = 0;
    for (int g = 0; g < 2; g++) {
        if (group_n[g] < 1 || group_ranks[g] < 1)
            continue;
        struct rank_run r;
        run_rank(p, w, group_n[g], reqs, skip, slots, &r);
        const double m = (double)group_ranks[g];
        ttft += m * r.ttft;
        tpot += m * r.tpot;
        wait += m * r.wait;
        measured += group_ranks[g] * r.measured;
        rate += m * r.rate;
        bt += m * r.batch_time;
        dt += m * r.decode_time;
        duration = fmax(duration, r.duration);
        done += group_ranks[g] * group_n[g] * reqs;
        if (detail && (g == 0 || rem == 0))   /* the busiest rank */
            *detail = r.d;
    }
    const double mm = measured > 0 ? (double)measured : 1;
    out->ttft_s = ttft / mm;
    out->tpot_s = tpot / mm;
    out->wait_s = wait / mm;
    out->batch = dt > 0 ? bt / dt : 0;
    out->cycle_s = out->ttft_s + (double)(w->osl - 1) * out->tpot_s;
    out->req_s = wave ? (duration > 0 ? (double)done / duration : 0) : rate;
    out->tok_s = out->req_s * (double)w->osl;
    out->tok_s_card = D->cards > 0 ? out->tok_s / D->cards : 0;
    out->limit = PD_CLOSED_CLIENTS;
}

int pd_perf_lockstep_check(const struct pd_plan *p, const struct pd_workload *w, pd_err *e)
{
    const struct pd_role_plan *D = &p->role[PD_ROLE_DECODE];
    const int64_t S = D->o.dp * D->o.instances > 0 ? D->o.dp * D->o.instances : 1;
    const int64_t per_rank = (w->concurrency + S - 1) / S;
    if (per_rank > PD_LOCKSTEP_MAX_CLIENTS)
        return pd_err_set(e, PD_EINVAL, "--phase lockstep: %lld clients per DP rank (--concurrency %lld over %lld ranks); "
                          "the loop is run step by step for at most %d per rank: use --phase random",
                          (long long)per_rank, (long long)w->concurrency, (long long)S, PD_LOCKSTEP_MAX_CLIENTS);
    return 0;
}

/* The disaggregated closed loop in lockstep (pd_perf_lockstep_pd): clients i over prefill DP rank
 * i mod S_p and decode DP rank i mod S_d (a round-robin router), each rank stepping on its own:
 *   sent                 the client's request leaves; it reaches its prefill rank `request` later
 *   prefill rank, idle   the prompts that have arrived, first come first served, fill a step of M
 *                        tokens (at most cap prompts): T_p = step(prefill part), one pass; a prompt
 *                        whose last chunk was in the step is handed off, reaching its decode rank
 *                        `handoff` after the step ends
 *   decode rank, idle    its decoding sequences and those handed off by now (up to B in all, first
 *                        come first served): T_d = step(b sequences, k tokens, their mean context);
 *                        a sequence's first step gives its first token (TTFT = that step's end -
 *                        sent, as the random-phase loop counts it), each later one tps tokens; at
 *                        osl it finishes and its client sends the next request at once
 * The ranks run concurrently: the loop advances to the earliest step end or arrival at an idle
 * rank. TTFT, TPOT (a benchmark's: (finished - first token) / (osl - 1)) and throughput are
 * counted as in run_rank. */
enum { P_WAIT, P_QUEUED, P_XFER, P_READY, P_DECODE, P_IDLE };

struct pclient {
    int state;
    int64_t left, finished, prefilled, take;
    double sent, arrive, started, ready, first, made, last_done, mark;
    int in_step;                 /* in its rank's running step */
};

struct prank {
    double end;                  /* the running step's end; INFINITY: idle */
    int64_t *q, qh, qt;          /* arrived prompts in arrival order: q[qh..qt) (a ring of n) */
};

void pd_perf_lockstep_pd(const struct pd_plan *p, const struct pd_workload *w, const struct pd_perf *f,
                         struct pd_closed *out)
{
    memset(out, 0, sizeof *out);
    const struct pd_role_plan *P = &p->role[PD_ROLE_PREFILL], *D = &p->role[PD_ROLE_DECODE];
    const int64_t Sp = P->o.dp * P->o.instances > 0 ? P->o.dp * P->o.instances : 1;
    const int64_t Sd = D->o.dp * D->o.instances > 0 ? D->o.dp * D->o.instances : 1;
    const int64_t n = w->concurrency, B = f->batch > 0 ? f->batch : 1;
    const int wave = w->num_prompts > 0;
    const int64_t reqs = wave ? w->num_prompts / n : STEADY_REQUESTS, skip = wave ? 0 : 1;
    const int64_t M = p->o.max_num_batched_tokens, k = pd_perf_decode_tokens(p);
    const double tps = pd_perf_tokens_per_step(p), req = f->request_s, hand = f->handoff_s;
    const int64_t cached = (int64_t)floor((double)w->isl * w->cached), I = w->isl - cached;
    const int64_t cap = w->prefill_max_requests > 0 ? w->prefill_max_requests : n;
    struct pclient *c = calloc((size_t)n, sizeof *c);
    struct prank *pr = calloc((size_t)Sp, sizeof *pr);
    double *dend = malloc((size_t)Sd * sizeof *dend);
    /* rank j's ring holds its own clients (i mod Sp == j): at most ceil(n / Sp) of them */
    const int64_t per = (n + Sp - 1) / Sp;
    int64_t *qbuf = malloc((size_t)(Sp * per) * sizeof *qbuf), *order = malloc((size_t)n * sizeof *order);
    struct arrival *arr = malloc((size_t)n * sizeof *arr);
    if (!c || !pr || !dend || !qbuf || !order || !arr) {
        out->ttft_s = out->tpot_s = out->req_s = NAN;
        goto done;
    }
    for (int64_t j = 0; j < Sp; j++)
        pr[j] = (struct prank){INFINITY, qbuf + j * per, 0, 0};
    for (int64_t d = 0; d < Sd; d++)
        dend[d] = INFINITY;
    for (int64_t i = 0; i < n; i++)
        c[i] = (struct pclient){.state = P_WAIT, .left = reqs, .arrive = req};
    int64_t active = n, measured = 0, done_reqs = 0;
    double t = 0, ttft = 0, tpot = 0, wait = 0, bt = 0, dt = 0, rate = 0;
    while (active > 0) {
        /* the next event: a step's end, or an arrival at an idle rank */
        double next = INFINITY;
        for (int64_t j = 0; j < Sp; j++)
            next = fmin(next, pr[j].end);
        for (int64_t d = 0; d < Sd; d++)
            next = fmin(next, dend[d]);
        for (int64_t i = 0; i < n; i++) {
            if (c[i].state == P_WAIT && !isfinite(pr[i % Sp].end))
                next = fmin(next, c[i].arrive);
            if (c[i].state == P_XFER && !isfinite(dend[i % Sd]))
                next = fmin(next, c[i].ready);
        }
        if (!isfinite(next))
            break;
        t = next;
        /* steps ending now: prefill chunks land, decodes make their tokens */
        for (int64_t i = 0; i < n; i++) {
            struct pclient *x = &c[i];
            if (!x->in_step)
                continue;
            if (x->state == P_QUEUED && pr[i % Sp].end <= t + 1e-12) {
                x->in_step = 0;
                x->prefilled += x->take;
                x->take = 0;
            } else if (x->state == P_DECODE && dend[i % Sd] <= t + 1e-12) {
                x->in_step = 0;
                if (x->made == 0) {
                    x->first = t;
                    x->made = 1;
                } else {
                    x->made += tps;
                }
                if (x->made + 1e-9 < (double)w->osl)
                    continue;
                if (x->finished >= skip) {
                    ttft += x->first - x->sent;
                    tpot += w->osl > 1 ? (t - x->first) / (double)(w->osl - 1) : 0;
                    wait += x->started - x->arrive;
                    measured++;
                }
                if (x->finished + 1 == skip)
                    x->mark = t;
                x->finished++;
                done_reqs++;
                x->last_done = t;
                if (--x->left > 0) {
                    x->state = P_WAIT;
                    x->sent = t;
                    x->arrive = t + req;
                    x->made = 0;
                } else {
                    x->state = P_IDLE;
                    active--;
                }
            }
        }
        for (int64_t j = 0; j < Sp; j++)
            if (pr[j].end <= t + 1e-12) {
                pr[j].end = INFINITY;
                /* prompts complete in queue order: handed off */
                while (pr[j].qh < pr[j].qt && c[pr[j].q[pr[j].qh % per]].prefilled >= I) {
                    struct pclient *x = &c[pr[j].q[pr[j].qh++ % per]];
                    x->state = P_XFER;
                    x->ready = t + hand;
                }
            }
        for (int64_t d = 0; d < Sd; d++)
            if (dend[d] <= t + 1e-12)
                dend[d] = INFINITY;
        /* arrivals up to t: prompts join their prefill rank's queue (earliest first, ties by
         * client), hand-offs become ready at their decode rank */
        int64_t na = 0;
        for (int64_t i = 0; i < n; i++) {
            if (c[i].state == P_WAIT && c[i].arrive <= t + 1e-12)
                arr[na++] = (struct arrival){c[i].arrive, i};
            if (c[i].state == P_XFER && c[i].ready <= t + 1e-12)
                c[i].state = P_READY;
        }
        qsort(arr, (size_t)na, sizeof *arr, by_arrival);
        for (int64_t a = 0; a < na; a++) {
            struct pclient *x = &c[arr[a].client];
            struct prank *q = &pr[arr[a].client % Sp];
            x->state = P_QUEUED;
            x->prefilled = 0;
            q->q[q->qt++ % per] = arr[a].client;
        }
        /* idle prefill ranks start a step on what has arrived */
        for (int64_t j = 0; j < Sp; j++) {
            struct prank *q = &pr[j];
            if (isfinite(q->end) || q->qh == q->qt)
                continue;
            int64_t budget = M, np = 0, ptok = 0;
            double pctx = 0;
            for (int64_t m = q->qh; m < q->qt && budget > 0 && np < cap; m++) {
                struct pclient *x = &c[q->q[m % per]];
                x->take = I - x->prefilled < budget ? I - x->prefilled : budget;
                if (x->prefilled == 0)
                    x->started = t;
                x->in_step = 1;
                budget -= x->take;
                ptok += x->take;
                pctx += (double)(cached + x->prefilled);
                np++;
            }
            struct pd_step s;
            pd_perf_step(p, PD_ROLE_PREFILL, np, (ptok + np - 1) / np, (int64_t)(pctx / (double)np), &s);
            q->end = t + s.total_s;
        }
        /* idle decode ranks step their sequences and those ready, up to B, first come first served */
        for (int64_t d = 0; d < Sd; d++) {
            if (isfinite(dend[d]))
                continue;
            int64_t b = 0, nr = 0;
            double ctx = 0;
            for (int64_t i = d; i < n; i += Sd)
                if (c[i].state == P_DECODE)
                    b++;
                else if (c[i].state == P_READY)
                    order[nr++] = i;
            /* the ready ones by hand-off time (ties by client) */
            for (int64_t a = 1; a < nr; a++)
                for (int64_t m = a; m > 0 && (c[order[m]].ready < c[order[m - 1]].ready ||
                                             (c[order[m]].ready == c[order[m - 1]].ready && order[m] < order[m - 1]));
                     m--) {
                    int64_t tmp = order[m];
                    order[m] = order[m - 1];
                    order[m - 1] = tmp;
                }
            for (int64_t a = 0; a < nr && b < B; a++, b++)
                c[order[a]].state = P_DECODE;
            if (b == 0)
                continue;
            for (int64_t i = d; i < n; i += Sd)
                if (c[i].state == P_DECODE) {
                    c[i].in_step = 1;
                    ctx += (double)w->isl + c[i].made;
                }
            struct pd_step s;
            pd_perf_step(p, PD_ROLE_DECODE, b, k, (int64_t)(ctx / (double)b), &s);
            dend[d] = t + s.total_s;
            bt += (double)b * s.total_s;
            dt += s.total_s;
        }
    }
    for (int64_t i = 0; i < n; i++)
        if (c[i].finished > skip && c[i].last_done > c[i].mark)
            rate += (double)(c[i].finished - skip) / (c[i].last_done - c[i].mark);
    const double mm = measured > 0 ? (double)measured : 1;
    out->ttft_s = ttft / mm;
    out->tpot_s = tpot / mm;
    out->wait_s = wait / mm;
    out->batch = dt > 0 ? bt / dt : 0;
    out->cycle_s = out->ttft_s + (double)(w->osl - 1) * out->tpot_s;
    out->req_s = wave ? (t > 0 ? (double)done_reqs / t : 0) : rate;
    out->tok_s = out->req_s * (double)w->osl;
    out->tok_s_card = P->cards + D->cards > 0 ? out->tok_s / (P->cards + D->cards) : 0;
    out->limit = PD_CLOSED_CLIENTS;
done:
    free(c);
    free(pr);
    free(dend);
    free(qbuf);
    free(order);
    free(arr);
}

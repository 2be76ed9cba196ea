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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A client and its current request. Where the request is (on its way, queued for prefill,
 * handed off, decoding) is the list of the loop that holds it. */
struct client {
    int64_t left;                /* requests still to finish, this one included */
    int64_t finished;            /* requests finished */
    double sent, arrive, started, first, last_done, mark;
    int64_t prefilled, take;     /* prompt tokens computed; tokens in the current step */
    double made;                 /* output tokens so far */
};

/* Sums over the measured requests. */
struct tally {
    double ttft, tpot, wait;
    int64_t measured;
};

struct rank_run {
    struct tally sum;
    double rate;                 /* requests/s of the rank (steady state) */
    double duration;
    double batch_time, decode_time;   /* sum of b x T over steps with decodes, and of T */
    struct pd_lockstep d;
};

/* A request finishes at t: counted from the client's skip-th on; 1 if its client sends the next
 * (arriving `req` later). */
static int finish(struct tally *r, struct client *x, double t, const struct pd_workload *w, int64_t skip,
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
        x->sent = t;
        x->arrive = t + req;
        x->made = 0;
        return 1;
    }
    (*active)--;
    return 0;
}

static int by_client(const void *a, const void *b)
{
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* One rank of n clients. Its clients wait in three lists, so that a step costs the sequences in
 * it: `sent`, the requests on their way in the order they arrive (a client sends when its last
 * request finishes, and steps end in time order: appending the finishers of a step, by client,
 * keeps the list sorted by (arrival, client)); `q`, the prompts that have arrived; `dec`, the
 * decoding sequences. 0, or -1 out of memory, or -2 past PD_LOCKSTEP_MAX_STEPS steps. */
static int run_rank(const struct pd_plan *p, const struct pd_workload *w, int64_t n, int64_t reqs, int64_t skip,
                    int64_t slots, struct rank_run *r)
{
    memset(r, 0, sizeof *r);
    struct client *c = calloc((size_t)n, sizeof *c);
    int64_t *q = malloc((size_t)n * sizeof *q), *sent = malloc((size_t)n * sizeof *sent);
    int64_t *dec = malloc((size_t)n * sizeof *dec), *done = malloc((size_t)n * sizeof *done);
    int rc = -1;
    if (!c || !q || !sent || !dec || !done)
        goto out;
    const int64_t M = p->o.max_num_batched_tokens, k = pd_perf_decode_tokens(p);
    const double tps = pd_perf_tokens_per_step(p), req = p->hw.eff.request_s;
    const int64_t cached = (int64_t)floor((double)w->isl * w->cached), I = w->isl - cached;
    const int64_t cap = w->prefill_max_requests > 0 ? w->prefill_max_requests : n;
    int64_t qh = 0, qt = 0;          /* q[qh..qt) (rings of n) */
    int64_t sh = 0, st = 0;          /* sent[sh..st) */
    int64_t b = 0, begun = 0, active = n;   /* dec[0..b); prompts in q with chunks computed */
    for (int64_t i = 0; i < n; i++) {
        c[i] = (struct client){.left = reqs, .arrive = req};
        sent[st++ % n] = i;
    }
    r->d.clients = n;
    r->d.requests = reqs;
    double t = 0;
    while (active > 0) {
        /* arrivals up to t join the queue, earliest first (ties by client) */
        while (sh < st && c[sent[sh % n]].arrive <= t + 1e-12) {
            const int64_t i = sent[sh++ % n];
            c[i].prefilled = 0;
            q[qt++ % n] = i;
        }
        double ctx = 0;
        for (int64_t a = 0; a < b; a++)
            ctx += (double)w->isl + c[dec[a]].made;
        /* prefill-first: a step that can take a prompt carries prompts only, the decodes waiting */
        int64_t bd = b, taking = begun;
        if (w->prefill_first && qh < qt && (c[q[qh % n]].prefilled > 0 || b + begun < slots))
            bd = 0;
        int64_t budget = M - bd * k, np = 0, ptok = 0;
        double pctx = 0;
        for (int64_t j = qh; j < qt && budget > 0 && np < cap; j++) {
            struct client *x = &c[q[j % n]];
            if (x->prefilled == 0 && b + taking >= slots)   /* the decodes hold their slots, waiting or not */
                break;
            taking += x->prefilled == 0;
            x->take = I - x->prefilled < budget ? I - x->prefilled : budget;
            budget -= x->take;
            ptok += x->take;
            pctx += (double)(cached + x->prefilled);
            np++;
        }
        if (b == 0 && np == 0) {        /* idle until the next request arrives */
            if (sh == st)
                break;
            t = c[sent[sh % n]].arrive;
            continue;
        }
        if (r->d.steps >= PD_LOCKSTEP_MAX_STEPS) {
            rc = -2;
            goto out;
        }
        struct pd_step_part dpart = {bd, k, b > 0 ? (int64_t)(ctx / (double)b) : 0};
        struct pd_step_part ppart = {np, np > 0 ? (ptok + np - 1) / np : 0, np > 0 ? (int64_t)(pctx / (double)np) : 0};
        struct pd_step s;
        pd_perf_step_mixed(p, np > 0 ? PD_ROLE_PREFILL : PD_ROLE_DECODE, &dpart, &ppart, &s);
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
        int64_t nd = 0, kept = 0;
        if (bd > 0) {
            r->batch_time += (double)bd * s.total_s;
            r->decode_time += s.total_s;
            for (int64_t a = 0; a < b; a++) {
                struct client *x = &c[dec[a]];
                x->made += tps;
                if (x->made + 1e-9 < (double)w->osl)
                    dec[kept++] = dec[a];
                else if (finish(&r->sum, x, t, w, skip, req, &active))
                    done[nd++] = dec[a];
            }
            b = kept;
        }
        for (int64_t j = qh, m = 0; j < qt && m < np; j++, m++) {
            struct client *x = &c[q[j % n]];
            if (x->prefilled == 0) {
                x->started = t0;
                begun++;
            }
            x->prefilled += x->take;
            x->take = 0;
        }
        while (qh < qt && c[q[qh % n]].prefilled >= I) {   /* prompts complete in queue order */
            const int64_t i = q[qh++ % n];
            struct client *x = &c[i];
            begun--;
            x->first = t;
            x->made = 1;
            if (w->osl > 1)
                dec[b++] = i;
            else if (finish(&r->sum, x, t, w, skip, req, &active))   /* the prompt's token was the whole output */
                done[nd++] = i;
        }
        /* the step's finishers send their next requests, all arriving at t + request */
        qsort(done, (size_t)nd, sizeof *done, by_client);
        for (int64_t a = 0; a < nd; a++)
            sent[st++ % n] = done[a];
    }
    r->duration = t;
    r->d.duration_s = t;
    for (int64_t i = 0; i < n; i++)
        if (c[i].finished > skip && c[i].last_done > c[i].mark)
            r->rate += (double)(c[i].finished - skip) / (c[i].last_done - c[i].mark);
    struct pd_step_part all = {n, k, w->isl + w->osl / 2}, none = {0, 0, 0};
    pd_perf_step_mixed(p, PD_ROLE_DECODE, &all, &none, &r->d.decode_step);
    rc = 0;
out:
    free(c);
    free(q);
    free(sent);
    free(dec);
    free(done);
    return rc;
}

/* Requests per client in the steady state: the first is the ramp, the other 15 are measured. */
#define STEADY_REQUESTS 16

/* The fewest steps n clients sending reqs requests each can take on a group of ranks holding
 * `slots` sequences each: their prompts' chunks, and their decode steps `slots` at a time; on one
 * aggregated rank (shared: the larger), or on prefill and decode ranks (apart: the sum). */
static double fewest_steps(const struct pd_plan *p, const struct pd_workload *w, int64_t n, int64_t reqs, int64_t slots,
                           int apart)
{
    const double cached = floor((double)w->isl * w->cached), M = (double)p->o.max_num_batched_tokens;
    const double r = (double)n * (double)reqs, chunks = r * ceil(((double)w->isl - cached) / M);
    const double decodes = r * ceil((double)(w->osl > 1 ? w->osl - 1 : 0) / pd_perf_tokens_per_step(p)) /
                           (double)(slots > 1 ? slots : 1);
    return apart ? chunks + decodes : fmax(chunks, decodes);
}

/* A run that could not be completed: out of memory, or past PD_LOCKSTEP_MAX_STEPS steps (rc -2) on a
 * group of n clients over sp prefill (0: aggregated) and sd decode DP ranks. */
static int overrun(int rc, const struct pd_workload *w, int64_t n, int64_t sp, int64_t sd, int64_t reqs, pd_err *e)
{
    if (rc != -2)
        return pd_err_set(e, PD_ENOMEM, "--phase lockstep: out of memory for %lld clients", (long long)n);
    char ranks[96];
    if (sp > 0)
        snprintf(ranks, sizeof ranks, "%lld prefill and %lld decode DP ranks", (long long)sp, (long long)sd);
    else
        snprintf(ranks, sizeof ranks, "one DP rank");
    return pd_err_set(e, PD_EINVAL, "--phase lockstep: %lld client%s on %s, %lld request%s each of %lld output "
                      "tokens, take more than %d steps to run: use --phase random, or fewer requests "
                      "(--num-prompts) or clients (--concurrency)", (long long)n, n == 1 ? "" : "s", ranks,
                      (long long)reqs, reqs == 1 ? "" : "s", (long long)w->osl, PD_LOCKSTEP_MAX_STEPS);
}

int pd_perf_lockstep(const struct pd_plan *p, const struct pd_workload *w, int64_t slots, struct pd_closed *out,
                     struct pd_lockstep *detail, pd_err *e)
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
        const int rc = fewest_steps(p, w, group_n[g], reqs, slots, 0) > PD_LOCKSTEP_MAX_STEPS
                           ? -2 : run_rank(p, w, group_n[g], reqs, skip, slots, &r);
        if (rc)
            return overrun(rc, w, group_n[g], 0, 1, reqs, e);
        const double m = (double)group_ranks[g];
        ttft += m * r.sum.ttft;
        tpot += m * r.sum.tpot;
        wait += m * r.sum.wait;
        measured += group_ranks[g] * r.sum.measured;
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
    out->slots = slots;
    return 0;
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
 * The ranks run concurrently: the loop goes from event to event (a step's end, an arrival, a
 * hand-off landing), in time order, ties by kind and client. TTFT, TPOT (a benchmark's: (finished
 * - first token) / (osl - 1)) and throughput are counted as in run_rank.
 *
 * Clients i and i' share a rank only if i = i' mod g, g = gcd(S_p, S_d): the ranks fall into g
 * groups that never meet, group r holding clients r, r + g, ... (its m-th on prefill rank
 * m mod S_p/g, decode rank m mod S_d/g of the group). Groups with as many clients run alike, so
 * one of each size is run and counted as many times as there are such groups, and an event costs
 * the ranks and clients it touches: the run is proportional to the requests' steps. */
enum { EV_PREFILL_END, EV_DECODE_END, EV_ARRIVE, EV_READY };

struct event {
    double at;
    int kind;
    int64_t id;                  /* a rank (the ends) or a client */
};

static int event_before(const struct event *a, const struct event *b)
{
    return a->at < b->at || (a->at == b->at && (a->kind < b->kind || (a->kind == b->kind && a->id < b->id)));
}

static int event_cmp(const void *a, const void *b)
{
    return event_before(a, b) ? -1 : event_before(b, a) ? 1 : 0;
}

/* A binary min-heap of events by (at, kind, id). */
struct events {
    struct event *e;
    int64_t n;
};

static void ev_push(struct events *h, struct event v)
{
    int64_t i = h->n++;
    for (; i > 0 && event_before(&v, &h->e[(i - 1) / 2]); i = (i - 1) / 2)
        h->e[i] = h->e[(i - 1) / 2];
    h->e[i] = v;
}

static struct event ev_pop(struct events *h)
{
    const struct event top = h->e[0], last = h->e[--h->n];
    int64_t i = 0;
    for (;;) {
        int64_t m = 2 * i + 1;
        if (m >= h->n)
            break;
        if (m + 1 < h->n && event_before(&h->e[m + 1], &h->e[m]))
            m++;
        if (!event_before(&h->e[m], &last))
            break;
        h->e[i] = h->e[m];
        i = m;
    }
    if (h->n > 0)
        h->e[i] = last;
    return top;
}

/* A FIFO of client indices: q[head..tail), a ring of cap. */
struct fifo {
    int64_t *q, head, tail, cap;
};

static void fifo_put(struct fifo *f, int64_t i)
{
    f->q[f->tail++ % f->cap] = i;
}

static int64_t fifo_at(const struct fifo *f, int64_t m)
{
    return f->q[m % f->cap];
}

struct prank {
    int busy;
    int64_t in_step;             /* the queue's first in_step prompts are in the running step */
    struct fifo q;               /* arrived prompts in arrival order */
};

struct drank {
    int busy;
    int64_t *dec, b;             /* the decoding sequences (all in the running step, if busy) */
    struct fifo ready;           /* handed off, waiting for a slot, in hand-off order */
};

/* The sums of one group's run. */
struct pd_sums {
    struct tally sum;
    double bt, dt, rate, duration;
    int64_t done;
};

/* One group: n clients over sp prefill and sd decode ranks (see above). 0, or -1 out of memory, or
 * -2 past PD_LOCKSTEP_MAX_STEPS steps (of all its ranks). */
static int run_group(const struct pd_plan *p, const struct pd_workload *w, const struct pd_perf *f, int64_t n,
                     int64_t sp, int64_t sd, int64_t reqs, int64_t skip, struct pd_sums *s)
{
    memset(s, 0, sizeof *s);
    const int64_t B = f->batch > 0 ? f->batch : 1, M = p->o.max_num_batched_tokens, k = pd_perf_decode_tokens(p);
    const double tps = pd_perf_tokens_per_step(p), req = f->request_s, hand = f->handoff_s;
    const int64_t cached = (int64_t)floor((double)w->isl * w->cached), I = w->isl - cached;
    const int64_t cap = w->prefill_max_requests > 0 ? w->prefill_max_requests : n;
    const int64_t per_p = (n + sp - 1) / sp, per_d = (n + sd - 1) / sd, slots = B < per_d ? B : per_d;
    struct client *c = calloc((size_t)n, sizeof *c);
    struct prank *pr = calloc((size_t)sp, sizeof *pr);
    struct drank *dr = calloc((size_t)sd, sizeof *dr);
    int64_t *pbuf = malloc((size_t)(sp * per_p) * sizeof *pbuf);
    int64_t *dbuf = malloc((size_t)(sd * (per_d + slots)) * sizeof *dbuf);
    int64_t *touched = malloc((size_t)(sp + sd) * sizeof *touched);
    char *mark = calloc((size_t)(sp + sd), 1);
    struct events h = {malloc((size_t)(n + sp + sd) * sizeof *h.e), 0};
    struct event *now = malloc((size_t)(n + sp + sd) * sizeof *now);
    int rc = -1;
    if (!c || !pr || !dr || !pbuf || !dbuf || !touched || !mark || !h.e || !now)
        goto out;
    for (int64_t j = 0; j < sp; j++)
        pr[j].q = (struct fifo){pbuf + j * per_p, 0, 0, per_p};
    for (int64_t d = 0; d < sd; d++) {
        dr[d].dec = dbuf + d * (per_d + slots);
        dr[d].ready = (struct fifo){dr[d].dec + slots, 0, 0, per_d};
    }
    for (int64_t i = 0; i < n; i++) {
        c[i] = (struct client){.left = reqs, .arrive = req};
        ev_push(&h, (struct event){req, EV_ARRIVE, i});
    }
    int64_t active = n, steps = 0;
    double t = 0;
    while (active > 0 && h.n > 0) {
        if (steps > PD_LOCKSTEP_MAX_STEPS) {
            rc = -2;
            goto out;
        }
        /* every event at t (ends first: finishing clients may send at t), then the ranks they touch */
        t = h.e[0].at;
        int64_t nn = 0, nt = 0;
        while (h.n > 0 && h.e[0].at <= t + 1e-12) {
            const struct event v = ev_pop(&h);
            if (v.kind == EV_PREFILL_END) {
                struct prank *q = &pr[v.id];
                q->busy = 0;
                for (int64_t m = 0; m < q->in_step; m++) {
                    struct client *x = &c[fifo_at(&q->q, q->q.head + m)];
                    x->prefilled += x->take;
                    x->take = 0;
                }
                q->in_step = 0;
                while (q->q.head < q->q.tail && c[fifo_at(&q->q, q->q.head)].prefilled >= I) {
                    const int64_t i = fifo_at(&q->q, q->q.head++);
                    ev_push(&h, (struct event){t + hand, EV_READY, i});
                }
            } else if (v.kind == EV_DECODE_END) {
                struct drank *r = &dr[v.id];
                int64_t kept = 0;
                r->busy = 0;
                for (int64_t a = 0; a < r->b; a++) {
                    struct client *x = &c[r->dec[a]];
                    if (x->made == 0) {
                        x->first = t;
                        x->made = 1;
                    } else {
                        x->made += tps;
                    }
                    if (x->made + 1e-9 < (double)w->osl) {
                        r->dec[kept++] = r->dec[a];
                        continue;
                    }
                    s->done++;
                    if (finish(&s->sum, x, t, w, skip, req, &active))
                        ev_push(&h, (struct event){x->arrive, EV_ARRIVE, r->dec[a]});
                }
                r->b = kept;
            } else {
                now[nn++] = v;
            }
            const int64_t rank = v.kind == EV_PREFILL_END ? v.id : v.kind == EV_DECODE_END ? sp + v.id
                                 : v.kind == EV_ARRIVE ? v.id % sp : sp + v.id % sd;
            if (!mark[rank]) {
                mark[rank] = 1;
                touched[nt++] = rank;
            }
        }
        /* arrivals and hand-offs at t, earliest first (ties by client), join their rank's queue */
        qsort(now, (size_t)nn, sizeof *now, event_cmp);
        for (int64_t a = 0; a < nn; a++) {
            struct client *x = &c[now[a].id];
            if (now[a].kind == EV_ARRIVE) {
                x->prefilled = 0;
                fifo_put(&pr[now[a].id % sp].q, now[a].id);
            } else {
                fifo_put(&dr[now[a].id % sd].ready, now[a].id);
            }
        }
        /* the touched ranks that are idle start a step on what they hold */
        for (int64_t m = 0; m < nt; m++) {
            const int64_t rank = touched[m];
            mark[rank] = 0;
            if (rank < sp) {
                struct prank *q = &pr[rank];
                if (q->busy || q->q.head == q->q.tail)
                    continue;
                int64_t budget = M, np = 0, ptok = 0;
                double pctx = 0;
                for (int64_t a = q->q.head; a < q->q.tail && budget > 0 && np < cap; a++) {
                    struct client *x = &c[fifo_at(&q->q, a)];
                    x->take = I - x->prefilled < budget ? I - x->prefilled : budget;
                    if (x->prefilled == 0)
                        x->started = t;
                    budget -= x->take;
                    ptok += x->take;
                    pctx += (double)(cached + x->prefilled);
                    np++;
                }
                struct pd_step st;
                pd_perf_step(p, PD_ROLE_PREFILL, np, (ptok + np - 1) / np, (int64_t)(pctx / (double)np), &st);
                q->busy = 1;
                q->in_step = np;
                steps++;
                ev_push(&h, (struct event){t + st.total_s, EV_PREFILL_END, rank});
            } else {
                struct drank *r = &dr[rank - sp];
                if (r->busy)
                    continue;
                while (r->b < B && r->ready.head < r->ready.tail) {
                    const int64_t i = fifo_at(&r->ready, r->ready.head++);
                    r->dec[r->b++] = i;
                }
                if (r->b == 0)
                    continue;
                double ctx = 0;
                for (int64_t a = 0; a < r->b; a++)
                    ctx += (double)w->isl + c[r->dec[a]].made;
                struct pd_step st;
                pd_perf_step(p, PD_ROLE_DECODE, r->b, k, (int64_t)(ctx / (double)r->b), &st);
                r->busy = 1;
                steps++;
                ev_push(&h, (struct event){t + st.total_s, EV_DECODE_END, rank - sp});
                s->bt += (double)r->b * st.total_s;
                s->dt += st.total_s;
            }
        }
    }
    s->duration = t;
    for (int64_t i = 0; i < n; i++)
        if (c[i].finished > skip && c[i].last_done > c[i].mark)
            s->rate += (double)(c[i].finished - skip) / (c[i].last_done - c[i].mark);
    rc = 0;
out:
    free(c);
    free(pr);
    free(dr);
    free(pbuf);
    free(dbuf);
    free(touched);
    free(mark);
    free(h.e);
    free(now);
    return rc;
}

static int64_t gcd64(int64_t a, int64_t b)
{
    while (b) {
        const int64_t r = a % b;
        a = b;
        b = r;
    }
    return a;
}

int pd_perf_lockstep_pd(const struct pd_plan *p, const struct pd_workload *w, const struct pd_perf *f,
                        struct pd_closed *out, pd_err *e)
{
    memset(out, 0, sizeof *out);
    const struct pd_role_plan *P = &p->role[PD_ROLE_PREFILL], *D = &p->role[PD_ROLE_DECODE];
    const int64_t Sp = P->o.dp * P->o.instances > 0 ? P->o.dp * P->o.instances : 1;
    const int64_t Sd = D->o.dp * D->o.instances > 0 ? D->o.dp * D->o.instances : 1;
    const int64_t n = w->concurrency, g = gcd64(Sp, Sd);
    const int wave = w->num_prompts > 0;
    const int64_t reqs = wave ? w->num_prompts / n : STEADY_REQUESTS, skip = wave ? 0 : 1;
    /* n = qn x g + rem: rem groups run qn + 1 clients, the other g - rem run qn */
    const int64_t qn = n / g, rem = n % g;
    const int64_t group_n[2] = {qn + 1, qn}, groups[2] = {rem, g - rem};
    struct pd_sums all = {0};
    for (int a = 0; a < 2; a++) {
        if (group_n[a] < 1 || groups[a] < 1)
            continue;
        struct pd_sums s;
        const int rc = fewest_steps(p, w, group_n[a], reqs, f->batch, 1) > PD_LOCKSTEP_MAX_STEPS
                           ? -2 : run_group(p, w, f, group_n[a], Sp / g, Sd / g, reqs, skip, &s);
        if (rc)
            return overrun(rc, w, group_n[a], Sp / g, Sd / g, reqs, e);
        const double m = (double)groups[a];
        all.sum.ttft += m * s.sum.ttft;
        all.sum.tpot += m * s.sum.tpot;
        all.sum.wait += m * s.sum.wait;
        all.bt += m * s.bt;
        all.dt += m * s.dt;
        all.rate += m * s.rate;
        all.sum.measured += groups[a] * s.sum.measured;
        all.done += groups[a] * s.done;
        all.duration = fmax(all.duration, s.duration);
    }
    const double mm = all.sum.measured > 0 ? (double)all.sum.measured : 1;
    out->ttft_s = all.sum.ttft / mm;
    out->tpot_s = all.sum.tpot / mm;
    out->wait_s = all.sum.wait / mm;
    out->batch = all.dt > 0 ? all.bt / all.dt : 0;
    out->cycle_s = out->ttft_s + (double)(w->osl - 1) * out->tpot_s;
    out->req_s = wave ? (all.duration > 0 ? (double)all.done / all.duration : 0) : all.rate;
    out->tok_s = out->req_s * (double)w->osl;
    out->tok_s_card = P->cards + D->cards > 0 ? out->tok_s / (P->cards + D->cards) : 0;
    out->limit = PD_CLOSED_CLIENTS;
    out->slots = f->batch > 0 ? f->batch : 1;
    return 0;
}

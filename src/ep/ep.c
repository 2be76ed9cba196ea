/* Expert-parallel dispatch and combine with MPI_Alltoallv (see ep.h). */
#include "ep/ep.h"
#include "core/timing.h"

#include <stdlib.h>
#include <sched.h>
#include <sys/prctl.h>
#include <time.h>
#include <stdio.h>
#include <string.h>

static void cancel_all(int n, MPI_Request *req);

int pd_ep_init(struct pd_ep *ep, MPI_Comm comm, const struct pd_model *m, pd_err *e)
{
    memset(ep, 0, sizeof *ep);
    ep->comm = comm;
    MPI_Comm_rank(comm, &ep->rank);
    MPI_Comm_size(comm, &ep->size);
    /* sleeps of a few microseconds should not be stretched by the default 50 us timer slack */
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    ep->n_experts = m->n_routed_experts;
    ep->top_k = m->n_experts_per_tok;
    ep->hidden = (int)m->hidden_size;
    int rc = pd_placement_build(&ep->place, m->n_routed_experts, ep->size, 0, NULL, e);
    if (rc)
        return pd_err_prefix(e, "expert parallelism over %d ranks: ", ep->size);
    int n = ep->size;
    ep->owner = calloc((size_t)ep->n_experts, sizeof *ep->owner);
    ep->has_expert = calloc((size_t)ep->n_experts, 1);
    ep->scnt = calloc((size_t)n * 5, sizeof(int));
    ep->req = calloc((size_t)n * 6, sizeof *ep->req);
    if (!ep->owner || !ep->has_expert || !ep->scnt || !ep->req) {
        pd_ep_free(ep);
        return pd_err_set(e, PD_ENOMEM, "expert parallelism: out of memory");
    }
    ep->rcnt = ep->scnt + n;
    ep->soff = ep->scnt + 2 * n;
    ep->roff = ep->scnt + 3 * n;
    ep->cursor = ep->scnt + 4 * n;
    ep->creq = ep->req + 2 * n;
    ep->pend = ep->req + 3 * n;
    for (int k = 0; k < n; k++)
        for (int s = 0; s < ep->place.slots; s++) {
            int x = ep->place.map[k * ep->place.slots + s];
            ep->owner[x] = k;
            if (k == ep->rank)
                ep->has_expert[x] = 1;
        }
    return 0;
}

void pd_ep_free(struct pd_ep *ep)
{
    /* the last exchange's sends: a live group completes them at once (its ranks received them to
     * finish that exchange); after a failed one, what is still pending is cancelled */
    if (ep->npend) {
        double until = pd_now_s() + 1.0;
        int done = 0;
        while (!done && pd_now_s() < until && MPI_Testall(ep->npend, ep->pend, &done, MPI_STATUSES_IGNORE) == MPI_SUCCESS)
            ;
        if (!done)
            cancel_all(ep->npend, ep->pend);
    }
    pd_placement_free(&ep->place);
    free(ep->owner);
    free(ep->has_expert);
    free(ep->scnt);
    free(ep->req);
    free(ep->sarena);
    free(ep->rarena);
    memset(ep, 0, sizeof *ep);
}

static int grow(char **p, size_t *cap, size_t need, pd_err *e)
{
    if (*cap >= need)
        return 0;
    size_t c = need + need / 2 + 4096;
    free(*p);
    *p = malloc(c);
    *cap = *p ? c : 0;
    if (!*p)
        return pd_err_set(e, PD_ENOMEM, "expert parallelism: out of memory for %zu bytes", need);
    return 0;
}

/* The next `bytes` of an arena, 64-byte aligned (carve with base NULL to size it). */
static void *carve(char *base, size_t *at, size_t bytes)
{
    size_t o = (*at + 63) & ~(size_t)63;
    *at = o + bytes;
    return base ? base + o : NULL;
}

static int mpi_fail(const struct pd_ep *ep, int r, const char *what, pd_err *e)
{
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(r, msg, &len) != MPI_SUCCESS)
        snprintf(msg, sizeof msg, "error %d", r);
    return pd_err_set(e, PD_EIO, "expert parallelism: %s failed on rank %d: %s", what, ep->rank, msg);
}

/* Waits for a non-blocking collective without spinning: 50 us of MPI_Test with sched_yield (a
 * balanced group is done by then), then sleeps, backing off from 10 us to 200 us. A rank that
 * arrives early (fewer tokens, or none) sleeps until the slowest rank joins, instead of burning a
 * core that an oversubscribed peer needs. */
int pd_ep_wait(MPI_Request *req)
{
    double until = pd_now_s() + 50e-6;
    while (pd_now_s() < until) {
        int done = 0;
        int r = MPI_Test(req, &done, MPI_STATUS_IGNORE);
        if (r != MPI_SUCCESS || done)
            return r;
        sched_yield();
    }
    long ns = 10000;
    for (;;) {
        int done = 0;
        int r = MPI_Test(req, &done, MPI_STATUS_IGNORE);
        if (r != MPI_SUCCESS || done)
            return r;
        struct timespec ts = {0, ns};
        nanosleep(&ts, NULL);
        ns = ns < 200000 ? ns * 2 : 200000;
    }
}

/* Inside an exchange the peers are mid-step and about to send, so the wait spins on MPI_Testsome
 * (no sched_yield: on a busy machine a yield can give the core away for a whole time slice,
 * milliseconds, against a few microseconds for a small exchange) and sleeps only after spin_s
 * without a request completing, backing off from 10 us to 200 us: a rank waiting for a peer still
 * running its experts leaves the core to it when ranks outnumber cores, but one whose messages
 * are moving does not sleep between them (each sleep on a busy machine can cost a time slice). */
static int waitall(int n, MPI_Request *req, double spin_s, int64_t *sleeps)
{
    int left = 0, idx[64];
    for (int i = 0; i < n; i++)
        left += req[i] != MPI_REQUEST_NULL;
    double until = pd_now_s() + spin_s;
    long ns = 10000;
    for (int spins = 0; left > 0; spins++) {
        int done = 0, r = n <= 64 ? MPI_Testsome(n, req, &done, idx, MPI_STATUSES_IGNORE)
                                  : MPI_Testall(n, req, &done, MPI_STATUSES_IGNORE);
        if (r != MPI_SUCCESS)
            return r;
        if (n > 64)
            done = done ? left : 0;
        if (done > 0 && done != MPI_UNDEFINED) {
            left -= done;
            until = pd_now_s() + spin_s;
            ns = 10000;
            continue;
        }
        /* the clock read every 16 tests: a test alone is well under a microsecond */
        if ((spins & 15) != 15 || pd_now_s() < until)
            continue;
        if (ns == 10000 && sleeps)
            ++*sleeps;
        struct timespec ts = {0, ns};
        nanosleep(&ts, NULL);
        ns = ns < 200000 ? ns * 2 : 200000;
    }
    return MPI_SUCCESS;
}

int pd_ep_waitall(int n, MPI_Request *req, double spin_s)
{
    return waitall(n, req, spin_s, NULL);
}

/* How long an exchange's waits spin without progress before sleeping. */
#define EP_SPIN_S 100e-6

/* Cancels and completes the requests req[0..n) (an exchange that fails half way must not leave
 * MPI writing into the engine's buffers later). */
static void cancel_all(int n, MPI_Request *req)
{
    for (int i = 0; i < n; i++)
        if (req[i] != MPI_REQUEST_NULL) {
            MPI_Cancel(&req[i]);
            MPI_Wait(&req[i], MPI_STATUS_IGNORE);
        }
}

/* The last exchange's sends, left to complete while the engine went on: done before their
 * buffers are written again. */
static int finish_sends(struct pd_ep *ep, pd_err *e)
{
    int r = waitall(ep->npend, ep->pend, EP_SPIN_S, &ep->sleeps);
    ep->npend = 0;
    return r == MPI_SUCCESS ? 0 : mpi_fail(ep, r, "completing the last exchange's sends", e);
}

static int ep_experts(void *ctx, struct pd_engine *en, int layer, const pd_qmat *a, const int32_t *ids, int T,
                      float *y, pd_err *e)
{
    struct pd_ep *ep = ctx;
    const int n = ep->size, me = ep->rank, k = ep->top_k, H = ep->hidden, P = T * k;
    MPI_Request *req = ep->req;   /* [2 * size] this phase's receives (and the counts' sends) */
    int nreq = 0, r, rc;
    double t0 = pd_now_s();
    if ((rc = finish_sends(ep, e)))
        return rc;
    /* counts: pairs for each rank, in pair order within a rank */
    for (int d = 0; d < n; d++)
        ep->scnt[d] = 0;
    for (int p = 0; p < P; p++)
        ep->scnt[ep->owner[ids[p]]]++;
    const int Pl = ep->scnt[me], Ps = P - Pl;
    if ((size_t)P * 4 * (size_t)H > INT32_MAX)
        return pd_err_set(e, PD_EINVAL, "expert parallelism: %d pairs of %d values exceed an MPI message", P, H);
    /* the counts travel while the send buffer is packed */
    for (int d = 0; d < n; d++)
        if (d != me && ((r = MPI_Irecv(&ep->rcnt[d], 1, MPI_INT, d, PD_EP_TAG_COUNT, ep->comm, &req[nreq++])) ||
                        (r = MPI_Isend(&ep->scnt[d], 1, MPI_INT, d, PD_EP_TAG_COUNT, ep->comm, &req[nreq++]))))
            return mpi_fail(ep, r, "sending the counts", e);
    ep->rcnt[me] = Pl;
    /* dispatch: each pair sent goes straight to its destination's next slot */
    size_t sz = 0;
    carve(NULL, &sz, (size_t)Ps * sizeof *ep->smeta);
    carve(NULL, &sz, (size_t)Ps * H);
    carve(NULL, &sz, (size_t)Ps * sizeof *ep->sdisp);
    carve(NULL, &sz, (size_t)Ps * H * sizeof(float));
    if ((rc = grow(&ep->sarena, &ep->sacap, sz, e))) {
        cancel_all(nreq, req);
        return rc;
    }
    sz = 0;
    ep->smeta = carve(ep->sarena, &sz, (size_t)Ps * sizeof *ep->smeta);
    ep->srow = carve(ep->sarena, &sz, (size_t)Ps * H);
    ep->sdisp = carve(ep->sarena, &sz, (size_t)Ps * sizeof *ep->sdisp);
    float *back = carve(ep->sarena, &sz, (size_t)Ps * H * sizeof(float));
    for (int d = 0, at = 0; d < n; d++) {
        ep->soff[d] = ep->cursor[d] = at;
        at += d != me ? ep->scnt[d] : 0;
    }
    for (int p = 0; p < P; p++) {
        int d = ep->owner[ids[p]], t = p / k;
        if (d == me)
            continue;
        int slot = ep->cursor[d]++;
        ep->smeta[slot] = (struct pd_ep_meta){.expert = ids[p], .scale = a->scale[t]};
        memcpy(ep->srow + (size_t)slot * H, a->q + (size_t)t * H, (size_t)H);
        ep->sdisp[slot] = (MPI_Aint)p * H * (MPI_Aint)sizeof(float);
    }
    if ((r = waitall(nreq, req, EP_SPIN_S, &ep->sleeps)) != MPI_SUCCESS)
        return mpi_fail(ep, r, "exchanging the counts", e);
    nreq = 0;
    int R = 0;
    for (int d = 0; d < n; d++) {
        ep->roff[d] = R;
        R += d != me ? ep->rcnt[d] : 0;
    }
    if ((size_t)R * 4 * (size_t)H > INT32_MAX)
        return pd_err_set(e, PD_EINVAL, "expert parallelism: %d pairs received of %d values exceed an MPI message", R, H);
    sz = 0;
    carve(NULL, &sz, (size_t)R * sizeof *ep->rmeta);
    carve(NULL, &sz, ((size_t)T + R) * H);
    carve(NULL, &sz, ((size_t)T + R) * sizeof *ep->scale);
    carve(NULL, &sz, ((size_t)Pl + R) * sizeof *ep->row);
    carve(NULL, &sz, ((size_t)Pl + R) * sizeof *ep->expert);
    carve(NULL, &sz, ((size_t)Pl + R) * sizeof *ep->dst);
    carve(NULL, &sz, (size_t)R * H * sizeof *ep->out);
    if ((rc = grow(&ep->rarena, &ep->racap, sz, e)))
        return rc;
    sz = 0;
    ep->rmeta = carve(ep->rarena, &sz, (size_t)R * sizeof *ep->rmeta);
    ep->q = carve(ep->rarena, &sz, ((size_t)T + R) * H);
    ep->scale = carve(ep->rarena, &sz, ((size_t)T + R) * sizeof *ep->scale);
    ep->row = carve(ep->rarena, &sz, ((size_t)Pl + R) * sizeof *ep->row);
    ep->expert = carve(ep->rarena, &sz, ((size_t)Pl + R) * sizeof *ep->expert);
    ep->dst = carve(ep->rarena, &sz, ((size_t)Pl + R) * sizeof *ep->dst);
    ep->out = carve(ep->rarena, &sz, (size_t)R * H * sizeof *ep->out);
    /* receives first: the rows land behind this rank's own in the matrix the experts read; the
     * combine's receives are posted now too, so the outputs land as soon as they come (in `back`,
     * by destination, as the send slots) */
    MPI_Request *creq = ep->creq;
    int ncreq = 0;
    for (int d = 0; d < n; d++) {
        if (d == me)
            continue;
        int c = ep->rcnt[d];
        if (c && ((r = MPI_Irecv(ep->rmeta + ep->roff[d], c * (int)sizeof *ep->rmeta, MPI_BYTE, d, PD_EP_TAG_META,
                                 ep->comm, &req[nreq++])) ||
                  (r = MPI_Irecv(ep->q + ((size_t)T + ep->roff[d]) * H, c * H, MPI_INT8_T, d, PD_EP_TAG_ROWS, ep->comm,
                                 &req[nreq++]))))
            goto fail;
        if (!(c = ep->scnt[d]))
            continue;
        if ((r = MPI_Irecv(back + (size_t)ep->soff[d] * H, c * H, MPI_FLOAT, d, PD_EP_TAG_OUT, ep->comm,
                           &creq[ncreq++])))
            goto fail;
    }
    /* the sends complete in the background: only the next exchange writes their buffers again */
    for (int d = 0; d < n; d++) {
        int c = ep->scnt[d];
        if (d != me && c &&
            ((r = MPI_Isend(ep->smeta + ep->soff[d], c * (int)sizeof *ep->smeta, MPI_BYTE, d, PD_EP_TAG_META, ep->comm,
                            &ep->pend[ep->npend++])) ||
             (r = MPI_Isend(ep->srow + (size_t)ep->soff[d] * H, c * H, MPI_INT8_T, d, PD_EP_TAG_ROWS, ep->comm,
                            &ep->pend[ep->npend++]))))
            goto fail;
    }
    /* this rank's own pairs meanwhile: its rows in place (copied once per token, not per pair),
     * outputs straight into y */
    if (Pl) {
        memcpy(ep->q, a->q, (size_t)T * H);
        memcpy(ep->scale, a->scale, (size_t)T * sizeof *ep->scale);
    }
    for (int p = 0, j = 0; p < P; p++)
        if (ep->owner[ids[p]] == me) {
            ep->row[j] = p / k;
            ep->expert[j] = ids[p];
            ep->dst[j++] = y + (size_t)p * H;
        }
    if ((r = waitall(nreq, req, EP_SPIN_S, &ep->sleeps)) != MPI_SUCCESS)
        goto fail;
    nreq = 0;
    ep->bytes_sent += (int64_t)Ps * (int64_t)(sizeof *ep->smeta + (size_t)H);
    for (int i = 0; i < R; i++) {
        int x = ep->rmeta[i].expert;
        if (x < 0 || x >= ep->n_experts || !ep->has_expert[x]) {
            rc = pd_err_set(e, PD_EIO, "expert parallelism: rank %d received a row for expert %d, not held here", me, x);
            cancel_all(ncreq, creq);
            return rc;
        }
        ep->expert[Pl + i] = x;
        ep->row[Pl + i] = T + i;
        ep->scale[T + i] = ep->rmeta[i].scale;
        ep->dst[Pl + i] = ep->out + (size_t)i * H;
    }
    /* the experts held here, on this rank's rows and the rows sent to them, in one grouped pass */
    double t1 = pd_now_s();
    pd_qmat ra = {.q = ep->q, .scale = ep->scale, .rows = T + R, .cols = H};
    if ((rc = pd_engine_run_experts(en, layer, &ra, ep->row, ep->expert, Pl + R, NULL, ep->dst, e))) {
        cancel_all(ncreq, creq);
        return rc;
    }
    if (ep->sync_before_combine)
        MPI_Barrier(ep->comm);
    double t2 = pd_now_s();
    /* combine: each source's outputs back to it, contiguous, in the order its rows came */
    for (int d = 0; d < n; d++) {
        int c = ep->rcnt[d];
        if (d != me && c &&
            (r = MPI_Isend(ep->out + (size_t)ep->roff[d] * H, c * H, MPI_FLOAT, d, PD_EP_TAG_OUT, ep->comm,
                           &ep->pend[ep->npend++])))
            goto fail;
    }
    if ((r = waitall(ncreq, creq, EP_SPIN_S, &ep->sleeps)) != MPI_SUCCESS)
        goto fail;
    /* each output row to its pair's place: an indexed MPI datatype receiving straight there was
     * slower (milliseconds at 256 tokens over shared memory) than this copy */
    for (int i = 0; i < Ps; i++)
        memcpy((char *)y + ep->sdisp[i], back + (size_t)i * H, (size_t)H * sizeof(float));
    ep->bytes_sent += (int64_t)R * H * (int64_t)sizeof(float);
    double t3 = pd_now_s();
    ep->t_exchange += (t1 - t0) + (t3 - t2);
    ep->exchanges++;
    return 0;
fail:
    cancel_all(ncreq, creq);
    return mpi_fail(ep, r, "the dispatch or combine", e);
}

void pd_ep_attach(struct pd_ep *ep, struct pd_engine *en)
{
    en->experts_fn = ep_experts;
    en->experts_ctx = ep;
}

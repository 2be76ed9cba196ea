/* Expert-parallel dispatch and combine with MPI_Alltoallv (see ep.h). */
#include "ep/ep.h"
#include "core/timing.h"

#include <stdlib.h>
#include <sched.h>
#include <sys/prctl.h>
#include <time.h>
#include <string.h>

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
    ep->scnt = calloc((size_t)n * 8, sizeof(int));
    if (!ep->owner || !ep->has_expert || !ep->scnt) {
        pd_ep_free(ep);
        return pd_err_set(e, PD_ENOMEM, "expert parallelism: out of memory");
    }
    ep->rcnt = ep->scnt + n;
    ep->sdsp = ep->scnt + 2 * n;
    ep->rdsp = ep->scnt + 3 * n;
    ep->sb = ep->scnt + 4 * n;
    ep->rb = ep->scnt + 5 * n;
    ep->sbd = ep->scnt + 6 * n;
    ep->rbd = ep->scnt + 7 * n;
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
    pd_placement_free(&ep->place);
    free(ep->owner);
    free(ep->has_expert);
    free(ep->scnt);
    free(ep->sbuf);
    free(ep->rbuf);
    free(ep->out);
    free(ep->back);
    free(ep->order);
    free(ep->rq);
    free(ep->rscale);
    free(ep->rexpert);
    free(ep->rrow);
    memset(ep, 0, sizeof *ep);
}

static int grow(void **p, size_t *cap, size_t need, pd_err *e)
{
    if (*cap >= need)
        return 0;
    size_t c = need + need / 2 + 64;
    void *q = realloc(*p, c);
    if (!q)
        return pd_err_set(e, PD_ENOMEM, "expert parallelism: out of memory for %zu bytes", need);
    *p = q;
    *cap = c;
    return 0;
}

/* One dispatch record: expert id, the row's scale, the row's int8 values (padded to 4 bytes). */
static size_t record_bytes(int hidden)
{
    return 8 + (((size_t)hidden + 3) & ~(size_t)3);
}

static int exchange(struct pd_ep *ep, const void *sbuf, const int *sc, const int *sd, void *rbuf, const int *rc,
                    const int *rd, pd_err *e)
{
    /* non-blocking, waited for asleep: a blocking MPI_Alltoallv polls, and a rank that polls
     * while its peer still runs its experts takes the core that peer needs when ranks outnumber
     * cores (a whole PD cluster on one small machine) */
    MPI_Request req;
    int r = MPI_Ialltoallv(sbuf, sc, sd, MPI_BYTE, rbuf, rc, rd, MPI_BYTE, ep->comm, &req);
    if (r == MPI_SUCCESS)
        r = pd_ep_wait(&req);
    if (r != MPI_SUCCESS) {
        char msg[MPI_MAX_ERROR_STRING];
        int len;
        MPI_Error_string(r, msg, &len);
        return pd_err_set(e, PD_EIO, "expert parallelism: MPI_Alltoallv failed on rank %d: %s", ep->rank, msg);
    }
    for (int k = 0; k < ep->size; k++)
        if (k != ep->rank)
            ep->bytes_sent += sc[k];
    return 0;
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

static int ep_experts(void *ctx, struct pd_engine *en, int layer, const pd_qmat *a, const int32_t *ids, int T,
                      float *y, pd_err *e)
{
    struct pd_ep *ep = ctx;
    const int n = ep->size, k = ep->top_k, H = ep->hidden, P = T * k;
    const size_t rec = record_bytes(H);
    double t0 = pd_now_s();
    int rc;
    /* counts: pairs for each rank, in pair order within a rank */
    for (int r = 0; r < n; r++)
        ep->scnt[r] = 0;
    for (int p = 0; p < P; p++)
        ep->scnt[ep->owner[ids[p]]]++;
    /* the counts exchange is where ranks wait for each other: wait asleep */
    MPI_Request req;
    if (MPI_Ialltoall(ep->scnt, 1, MPI_INT, ep->rcnt, 1, MPI_INT, ep->comm, &req) != MPI_SUCCESS ||
        pd_ep_wait(&req) != MPI_SUCCESS)
        return pd_err_set(e, PD_EIO, "expert parallelism: MPI_Alltoall of counts failed on rank %d", ep->rank);
    double tc = pd_now_s();
    int R = 0;
    for (int r = 0; r < n; r++) {
        ep->sdsp[r] = r ? ep->sdsp[r - 1] + ep->scnt[r - 1] : 0;
        ep->rdsp[r] = R;
        R += ep->rcnt[r];
        ep->sb[r] = ep->scnt[r] * (int)rec;
        ep->rb[r] = ep->rcnt[r] * (int)rec;
        ep->sbd[r] = ep->sdsp[r] * (int)rec;
        ep->rbd[r] = ep->rdsp[r] * (int)rec;
    }
    /* this rank's own pairs never go through MPI: their records are neither packed nor sent to
     * itself; their rows go straight to where the received rows are unpacked */
    const int me = ep->rank;
    ep->sb[me] = ep->rb[me] = 0;
    if ((rc = grow((void **)&ep->sbuf, &ep->scap, (size_t)P * rec + 1, e)) ||
        (rc = grow((void **)&ep->rbuf, &ep->rcap, (size_t)R * rec + 1, e)) ||
        (rc = grow((void **)&ep->order, &ep->ordcap, ((size_t)P + 1) * sizeof(int), e)) ||
        (rc = grow((void **)&ep->out, &ep->ocap, (size_t)R * H * 4 + 4, e)) ||
        (rc = grow((void **)&ep->back, &ep->bcap, (size_t)P * H * 4 + 4, e)) ||
        (rc = grow((void **)&ep->rq, &ep->rqcap, (size_t)R * H + 4, e)) ||
        (rc = grow((void **)&ep->rscale, &ep->rscap, (size_t)R * 4 + 4, e)) ||
        (rc = grow((void **)&ep->rexpert, &ep->recap, (size_t)R * 4 + 4, e)) ||
        (rc = grow((void **)&ep->rrow, &ep->rrcap, (size_t)R * 4 + 4, e)))
        return rc;
    int8_t *q = ep->rq;
    float *scale = ep->rscale;
    int32_t *expert = ep->rexpert, *row = ep->rrow;
    /* dispatch: pack each pair's record at its rank's next slot (its own: unpacked at once) */
    int cursor_stack[64], *cursor = n <= 64 ? cursor_stack : calloc((size_t)n, sizeof(int));
    if (!cursor)
        return pd_err_set(e, PD_ENOMEM, "expert parallelism: out of memory");
    memset(cursor, 0, (size_t)n * sizeof(int));
    for (int p = 0; p < P; p++) {
        int r = ep->owner[ids[p]], j = cursor[r]++, slot = ep->sdsp[r] + j;
        int row_of = p / k;
        ep->order[slot] = p;
        if (r == me) {
            int i = ep->rdsp[me] + j;
            expert[i] = ids[p];
            scale[i] = a->scale[row_of];
            memcpy(q + (size_t)i * H, a->q + (size_t)row_of * H, (size_t)H);
            continue;
        }
        char *d = ep->sbuf + (size_t)slot * rec;
        int32_t x = ids[p];
        memcpy(d, &x, 4);
        memcpy(d + 4, &a->scale[row_of], 4);
        memcpy(d + 8, a->q + (size_t)row_of * H, (size_t)H);
    }
    if (cursor != cursor_stack)
        free(cursor);
    double tp = pd_now_s();
    if ((rc = exchange(ep, ep->sbuf, ep->sb, ep->sbd, ep->rbuf, ep->rb, ep->rbd, e)))
        return rc;
    /* the experts held here, on the rows sent to them */
    double t1 = pd_now_s();
    for (int i = 0; i < R; i++) {
        row[i] = i;
        if (i >= ep->rdsp[me] && i < ep->rdsp[me] + ep->rcnt[me])
            continue;
        const char *src = ep->rbuf + (size_t)i * rec;
        memcpy(&expert[i], src, 4);
        memcpy(&scale[i], src + 4, 4);
        memcpy(q + (size_t)i * H, src + 8, (size_t)H);
    }
    pd_qmat ra = {.q = q, .scale = scale, .rows = R, .cols = H};
    rc = pd_engine_run_experts(en, layer, &ra, row, expert, R, ep->out, e);
    if (rc)
        return rc;
    if (ep->sync_before_combine)
        MPI_Barrier(ep->comm);
    double t2 = pd_now_s();
    /* combine: each output row back to its origin, in the order it came (this rank's own
     * straight from its output: its slot j is its received row rdsp[me] + j) */
    for (int r = 0; r < n; r++) {
        ep->sb[r] = r == me ? 0 : ep->rcnt[r] * H * 4;
        ep->sbd[r] = ep->rdsp[r] * H * 4;
        ep->rb[r] = r == me ? 0 : ep->scnt[r] * H * 4;
        ep->rbd[r] = ep->sdsp[r] * H * 4;
    }
    if ((rc = exchange(ep, ep->out, ep->sb, ep->sbd, ep->back, ep->rb, ep->rbd, e)))
        return rc;
    double t3 = pd_now_s();
    for (int slot = 0; slot < P; slot++) {
        int mine = slot >= ep->sdsp[me] && slot < ep->sdsp[me] + ep->scnt[me];
        const float *src = mine ? ep->out + (size_t)(ep->rdsp[me] + slot - ep->sdsp[me]) * H : ep->back + (size_t)slot * H;
        memcpy(y + (size_t)ep->order[slot] * H, src, (size_t)H * 4);
    }
    double t4 = pd_now_s();
    ep->t_exchange += (t1 - t0) + (t4 - t2);
    ep->t_counts += tc - t0;
    ep->t_pack += tp - tc;
    ep->t_dispatch += t1 - tp;
    ep->t_combine += t3 - t2;
    ep->t_scatter += t4 - t3;
    ep->exchanges++;
    return 0;
}

void pd_ep_attach(struct pd_ep *ep, struct pd_engine *en)
{
    en->experts_fn = ep_experts;
    en->experts_ctx = ep;
}

/* Expert-parallel dispatch and combine with point-to-point messages (see ep.h). */
#define _GNU_SOURCE   /* ppoll, POLLRDHUP */
#include "ep/ep.h"
#include "core/timing.h"

#include <stdlib.h>
#include <poll.h>
#include <sched.h>
#include <sys/prctl.h>
#include <time.h>
#include <stdio.h>
#include <string.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#define PD_LSAN 1
#endif

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
    ep->scnt = calloc((size_t)n * 9, sizeof(int));
    ep->req = calloc((size_t)n * 5, sizeof *ep->req);
    ep->msg = calloc((size_t)n, sizeof *ep->msg);
    if (!ep->owner || !ep->has_expert || !ep->scnt || !ep->req || !ep->msg) {
        pd_ep_free(ep);
        return pd_err_set(e, PD_ENOMEM, "expert parallelism: out of memory");
    }
    ep->rcnt = ep->scnt + n;
    ep->soff = ep->scnt + 2 * n;
    ep->roff = ep->scnt + 3 * n;
    ep->cursor = ep->scnt + 4 * n;
    ep->rbase = ep->scnt + 5 * n;
    ep->mbytes = ep->scnt + 6 * n;
    ep->srows = ep->scnt + 7 * n;
    ep->last = ep->scnt + 8 * n;
    ep->creq = ep->req + n;
    ep->pend = ep->req + 2 * n;
    for (int d = 0; d < n; d++)
        ep->msg[d] = MPI_MESSAGE_NULL;
    for (int k = 0; k < n; k++)
        for (int s = 0; s < ep->place.slots; s++) {
            int x = ep->place.map[k * ep->place.slots + s];
            ep->owner[x] = k;
            if (k == ep->rank)
                ep->has_expert[x] = 1;
        }
    return 0;
}

void pd_ep_mpi_init(int *argc, char ***argv, int required, int *provided)
{
#ifdef PD_LSAN
    __lsan_disable();
#endif
    MPI_Init_thread(argc, argv, required, provided);
#ifdef PD_LSAN
    __lsan_enable();
#endif
}

void pd_ep_finalize(void)
{
#ifdef PD_LSAN
    __lsan_do_leak_check();
#endif
    MPI_Finalize();
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
    free(ep->msg);
    free(ep->sarena);
    free(ep->rarena);
    free(ep->parena);
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

/* The watch of the waits' sleeps (pd_ep_watch): gone and arg are written before fd is published
 * (release), and read after it (acquire); the first sleep that sees the end takes fd back to -1. */
static _Atomic int watch_fd = -1;
static void (*watch_gone)(void *arg);
static void *watch_arg;

void pd_ep_watch(int fd, void (*gone)(void *arg), void *arg)
{
    atomic_store_explicit(&watch_fd, -1, memory_order_release);
    if (fd < 0)
        return;
    watch_gone = gone;
    watch_arg = arg;
    atomic_store_explicit(&watch_fd, fd, memory_order_release);
}

/* A wait's sleep of ns nanoseconds: nanosleep(), or ppoll() on the watched connection for its end
 * (the same sleep when it lives: the timeout's resolution is the same hrtimer). */
static void ep_sleep(long ns)
{
    struct timespec ts = {0, ns};
    int fd = atomic_load_explicit(&watch_fd, memory_order_acquire);
    if (fd < 0) {
        nanosleep(&ts, NULL);
        return;
    }
    struct pollfd pf = {.fd = fd, .events = POLLRDHUP};
    if (ppoll(&pf, 1, &ts, NULL) <= 0 || !(pf.revents & (POLLRDHUP | POLLHUP | POLLERR)))
        return;
    void (*gone)(void *) = watch_gone;
    void *arg = watch_arg;
    if (atomic_compare_exchange_strong(&watch_fd, &fd, -1) && gone)
        gone(arg);
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
        ep_sleep(ns);
        ns = ns < 200000 ? ns * 2 : 200000;
    }
}

/* The spin-then-sleep policy of an exchange's waits. Inside an exchange the peers are mid-step
 * and about to send, so a wait spins (no sched_yield: on a busy machine a yield can give the core
 * away for a whole time slice, milliseconds, against a few microseconds for a small exchange) and
 * sleeps only after spin_s without progress, backing off from 10 us to 200 us: a rank waiting for
 * a peer still running its experts leaves the core to it when ranks outnumber cores, but one whose
 * messages are moving does not sleep between them. */
struct backoff {
    double spin_s, until;
    long ns;
    int polls;
    int64_t *sleeps;   /* counts the waits that slept, or NULL */
};

static void backoff_start(struct backoff *b, double spin_s, int64_t *sleeps)
{
    *b = (struct backoff){.spin_s = spin_s, .until = pd_now_s() + spin_s, .ns = 10000, .sleeps = sleeps};
}

/* A poll completed something: spin again. */
static void backoff_progress(struct backoff *b)
{
    b->until = pd_now_s() + b->spin_s;
    b->ns = 10000;
}

/* A poll completed nothing: go on spinning, or sleep once spin_s has passed without progress
 * (the clock read every 16 polls: a poll alone is well under a microsecond). */
static void backoff_idle(struct backoff *b)
{
    if ((++b->polls & 15) || pd_now_s() < b->until)
        return;
    if (b->ns == 10000 && b->sleeps)
        ++*b->sleeps;
    ep_sleep(b->ns);
    b->ns = b->ns < 200000 ? b->ns * 2 : 200000;
}

static int waitall(int n, MPI_Request *req, double spin_s, int64_t *sleeps)
{
    int left = 0, idx[64];
    for (int i = 0; i < n; i++)
        left += req[i] != MPI_REQUEST_NULL;
    struct backoff b;
    backoff_start(&b, spin_s, sleeps);
    while (left > 0) {
        int done = 0, r = n <= 64 ? MPI_Testsome(n, req, &done, idx, MPI_STATUSES_IGNORE)
                                  : MPI_Testall(n, req, &done, MPI_STATUSES_IGNORE);
        if (r != MPI_SUCCESS)
            return r;
        if (n > 64)
            done = done ? left : 0;
        if (done > 0 && done != MPI_UNDEFINED) {
            left -= done;
            backoff_progress(&b);
        } else {
            backoff_idle(&b);
        }
    }
    return MPI_SUCCESS;
}

int pd_ep_waitall(int n, MPI_Request *req, double spin_s)
{
    return waitall(n, req, spin_s, NULL);
}

/* How long an exchange's waits spin without progress before sleeping. 5 ms was tried: on 2
 * ranks sharing 2 cores with other work it removed the sleeps that made some exchanges take
 * milliseconds at load 6, but at load 8-10 it cut decode tokens/s 2-4x (docs/architecture.md,
 * "The EP exchange"). */
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

/* A dispatch message to one peer, for `pairs` pairs on `rows` distinct tokens (each token's row
 * sent once, however many of its experts the peer holds):
 *   [head {pairs, rows, sender}] [pairs records {expert, row}] [rows scales, fp32]
 *   [zeros to a multiple of H bytes] [rows int8 rows of H bytes]
 * the head alone for no pairs. The receiver takes it whole into the matrix the experts read, so
 * the rows fall on whole rows of that matrix. */
static int64_t head_rows(int64_t pairs, int64_t rows, int H)
{
    return ((int64_t)sizeof(struct pd_ep_head) + pairs * (int64_t)sizeof(struct pd_ep_meta) +
            rows * (int64_t)sizeof(float) + H - 1) / H;
}

static int64_t dispatch_bytes(int64_t pairs, int64_t rows, int H)
{
    return pairs ? (head_rows(pairs, rows, H) + rows) * H : (int64_t)sizeof(struct pd_ep_head);
}

/* Matches every peer's dispatch message of this exchange (MPI_Improbe): its size says how many
 * pairs it carries, so no counts message has to go first. Source by source, never
 * MPI_ANY_SOURCE: a peer that neither sent pairs here nor got any from here can finish this
 * exchange and send its next dispatch before another peer's arrives, and only a message's own
 * source keeps the exchanges in order (MPI does not overtake between one source and tag).
 * msg[d] and bytes[d] for each d != me; the waiting spins, then sleeps, as waitall's. */
static int probe_all(struct pd_ep *ep, MPI_Message *msg, int *bytes, pd_err *e)
{
    const int n = ep->size, me = ep->rank;
    for (int d = 0; d < n; d++)
        msg[d] = MPI_MESSAGE_NULL;
    struct backoff b;
    backoff_start(&b, EP_SPIN_S, &ep->sleeps);
    for (int left = n - 1; left > 0;) {
        int got = 0;
        for (int d = 0; d < n; d++) {
            if (d == me || msg[d] != MPI_MESSAGE_NULL)
                continue;
            int flag = 0, r;
            MPI_Status st;
            if ((r = MPI_Improbe(d, PD_EP_TAG_DISPATCH, ep->comm, &flag, &msg[d], &st)) != MPI_SUCCESS)
                return mpi_fail(ep, r, "probing the dispatch", e);
            if (flag) {
                MPI_Get_count(&st, MPI_BYTE, &bytes[d]);
                got++;
            }
        }
        if (got) {
            left -= got;
            backoff_progress(&b);
        } else {
            backoff_idle(&b);
        }
    }
    return 0;
}

/* Receives the matched messages msg[] (each rank's own: none) after a failure, so none is left
 * queued for the next exchange. */
static void drop_probed(struct pd_ep *ep, MPI_Message *msg, int *bytes)
{
    for (int d = 0; d < ep->size; d++)
        if (msg[d] != MPI_MESSAGE_NULL) {
            char *sink = malloc((size_t)bytes[d] + 1);
            MPI_Mrecv(sink, sink ? bytes[d] : 0, MPI_BYTE, &msg[d], MPI_STATUS_IGNORE);
            free(sink);
        }
}

static int ep_experts(void *ctx, struct pd_engine *en, int layer, const pd_qmat *a, const int32_t *ids, int T,
                      float *y, const float **out, pd_err *e)
{
    struct pd_ep *ep = ctx;
    const int n = ep->size, me = ep->rank, k = ep->top_k, H = ep->hidden, P = T * k;
    MPI_Request *req = ep->req;   /* [size] the dispatch's receives */
    MPI_Request *creq = ep->creq; /* [size] the combine's receives */
    int *last = ep->last;         /* [size] scratch: the last token counted or packed for each rank */
    int nreq = 0, ncreq = 0, r, rc;
    double t0 = pd_now_s();
    if ((rc = finish_sends(ep, e)))
        return rc;
    /* pairs and distinct tokens for each rank, in pair order within a rank */
    for (int d = 0; d < n; d++) {
        ep->scnt[d] = ep->srows[d] = 0;
        last[d] = -1;
    }
    for (int p = 0; p < P; p++) {
        int d = ep->owner[ids[p]], t = p / k;
        ep->scnt[d]++;
        if (last[d] != t) {
            last[d] = t;
            ep->srows[d]++;
        }
    }
    const int Pl = ep->scnt[me], Ps = P - Pl;
    if ((size_t)P * 4 * (size_t)H > INT32_MAX)
        return pd_err_set(e, PD_EINVAL, "expert parallelism: %d pairs of %d values exceed an MPI message", P, H);
    /* each peer's message in the send arena, starting on a row; a head-only message takes one */
    size_t dbytes = 0;
    for (int d = 0; d < n; d++) {
        ep->soff[d] = (int)(dbytes / (size_t)H);
        if (d != me)
            dbytes += (size_t)(ep->scnt[d] ? dispatch_bytes(ep->scnt[d], ep->srows[d], H) : H);
    }
    size_t sz = 0;
    carve(NULL, &sz, dbytes);
    carve(NULL, &sz, (size_t)Ps * sizeof *ep->spair);
    carve(NULL, &sz, (size_t)Ps * H * sizeof(float));
    if ((rc = grow(&ep->sarena, &ep->sacap, sz, e)))
        return rc;
    sz = 0;
    ep->sbuf = carve(ep->sarena, &sz, dbytes);
    ep->spair = carve(ep->sarena, &sz, (size_t)Ps * sizeof *ep->spair);
    float *back = carve(ep->sarena, &sz, (size_t)Ps * H * sizeof(float));
    /* where each destination's outputs will come back in `back`: by destination, in the order the
     * pairs were sent */
    for (int d = 0, at = 0; d < n; d++) {
        ep->cursor[d] = at;
        at += d != me ? ep->scnt[d] : 0;
    }
    /* the heads, then each pair straight to its destination's next record, and each token's row
     * once to each destination holding one of its experts */
    int *pair = ep->roff, *row = ep->rbase;   /* scratch until the receives: next record, next row */
    for (int d = 0; d < n; d++) {
        pair[d] = row[d] = 0;
        last[d] = -1;
        if (d == me)
            continue;
        char *m = ep->sbuf + (size_t)ep->soff[d] * H;
        int c = ep->scnt[d], rows = ep->srows[d];
        *(struct pd_ep_head *)m = (struct pd_ep_head){.pairs = c, .rows = rows, .rank = me};
        if (c) {
            size_t used = sizeof(struct pd_ep_head) + (size_t)c * sizeof(struct pd_ep_meta) + (size_t)rows * sizeof(float);
            memset(m + used, 0, (size_t)head_rows(c, rows, H) * H - used);
        }
    }
    for (int p = 0; p < P; p++) {
        int d = ep->owner[ids[p]], t = p / k;
        if (d == me)
            continue;
        char *m = ep->sbuf + (size_t)ep->soff[d] * H;
        struct pd_ep_meta *rec = (struct pd_ep_meta *)(m + sizeof(struct pd_ep_head));
        float *scale = (float *)(rec + ep->scnt[d]);
        if (last[d] != t) {
            last[d] = t;
            scale[row[d]] = a->scale[t];
            memcpy(m + ((size_t)head_rows(ep->scnt[d], ep->srows[d], H) + row[d]) * H, a->q + (size_t)t * H, (size_t)H);
            row[d]++;
        }
        int i = pair[d]++;
        rec[i] = (struct pd_ep_meta){.expert = ids[p], .row = row[d] - 1};
        ep->spair[ep->cursor[d] + i] = p;
    }
    /* the sends complete in the background: only the next exchange writes their buffers again */
    for (int d = 0; d < n; d++)
        if (d != me && (r = MPI_Isend(ep->sbuf + (size_t)ep->soff[d] * H,
                                      (int)dispatch_bytes(ep->scnt[d], ep->srows[d], H), MPI_BYTE, d,
                                      PD_EP_TAG_DISPATCH, ep->comm, &ep->pend[ep->npend++]))) {
            cancel_all(ncreq, creq);
            return mpi_fail(ep, r, "sending the dispatch", e);
        }
    /* every peer's dispatch, matched before it is received: its size places it */
    MPI_Message *msg = ep->msg;
    int *mbytes = ep->mbytes;
    if ((rc = probe_all(ep, msg, mbytes, e))) {
        drop_probed(ep, msg, mbytes);
        cancel_all(ncreq, creq);
        return rc;
    }
    int rows = 0;   /* rows of q the messages take */
    for (int d = 0; d < n; d++)
        if (d != me) {
            ep->rbase[d] = rows;
            rows += (mbytes[d] + H - 1) / H;
        }
    sz = 0;
    carve(NULL, &sz, ((size_t)T + rows) * H);
    carve(NULL, &sz, ((size_t)T + rows) * sizeof *ep->scale);
    if ((rc = grow(&ep->rarena, &ep->racap, sz, e))) {
        drop_probed(ep, msg, mbytes);
        cancel_all(ncreq, creq);
        return rc;
    }
    sz = 0;
    ep->q = carve(ep->rarena, &sz, ((size_t)T + rows) * H);
    ep->scale = carve(ep->rarena, &sz, ((size_t)T + rows) * sizeof *ep->scale);
    /* each message straight behind this rank's own rows in the matrix the experts read */
    for (int d = 0; d < n; d++)
        if (d != me && (r = MPI_Imrecv(ep->q + ((size_t)T + ep->rbase[d]) * H, mbytes[d], MPI_BYTE, &msg[d],
                                       &req[nreq++])))
            goto fail;
    /* this rank's own rows meanwhile, in place (copied once per token, not per pair) */
    if (Pl) {
        memcpy(ep->q, a->q, (size_t)T * H);
        memcpy(ep->scale, a->scale, (size_t)T * sizeof *ep->scale);
    }
    if ((r = waitall(nreq, req, EP_SPIN_S, &ep->sleeps)) != MPI_SUCCESS)
        goto fail;
    nreq = 0;
    for (int d = 0; d < n; d++)
        ep->bytes_sent += d != me ? dispatch_bytes(ep->scnt[d], ep->srows[d], H) : 0;
    /* what came: each message's head checked against its size */
    int R = 0;
    for (int d = 0; d < n; d++) {
        ep->roff[d] = R;
        if (d == me) {
            ep->rcnt[d] = Pl;
            continue;
        }
        const struct pd_ep_head *h = (const struct pd_ep_head *)(ep->q + ((size_t)T + ep->rbase[d]) * H);
        if (mbytes[d] < (int)sizeof *h || h->rank != d || h->pairs < 0 || h->rows < (h->pairs > 0) ||
            h->rows > h->pairs || dispatch_bytes(h->pairs, h->rows, H) != mbytes[d]) {
            rc = pd_err_set(e, PD_EIO, "expert parallelism: rank %d got a dispatch of %d bytes from rank %d that is no "
                            "whole message (head: %d pairs on %d rows from rank %d)", me, mbytes[d], d,
                            mbytes[d] < (int)sizeof *h ? -1 : h->pairs, mbytes[d] < (int)sizeof *h ? -1 : h->rows,
                            mbytes[d] < (int)sizeof *h ? -1 : h->rank);
            cancel_all(ncreq, creq);
            return rc;
        }
        ep->rcnt[d] = h->pairs;
        R += h->pairs;
    }
    sz = 0;
    carve(NULL, &sz, ((size_t)Pl + R) * sizeof *ep->row);
    carve(NULL, &sz, ((size_t)Pl + R) * sizeof *ep->expert);
    carve(NULL, &sz, ((size_t)Pl + R) * sizeof *ep->dst);
    carve(NULL, &sz, (size_t)R * H * sizeof *ep->out);
    if ((rc = grow(&ep->parena, &ep->pacap, sz, e))) {
        cancel_all(ncreq, creq);
        return rc;
    }
    sz = 0;
    ep->row = carve(ep->parena, &sz, ((size_t)Pl + R) * sizeof *ep->row);
    ep->expert = carve(ep->parena, &sz, ((size_t)Pl + R) * sizeof *ep->expert);
    ep->dst = carve(ep->parena, &sz, ((size_t)Pl + R) * sizeof *ep->dst);
    ep->out = carve(ep->parena, &sz, (size_t)R * H * sizeof *ep->out);
    /* the pairs run here: this rank's own (outputs straight into y), then those received, in
     * the order they came (outputs by source, as the combine sends them back) */
    for (int p = 0, j = 0; p < P; p++)
        if (ep->owner[ids[p]] == me) {
            ep->row[j] = p / k;
            ep->expert[j] = ids[p];
            ep->dst[j++] = y + (size_t)p * H;
        }
    for (int d = 0; d < n; d++) {
        if (d == me)
            continue;
        const char *m = (const char *)ep->q + ((size_t)T + ep->rbase[d]) * H;
        const struct pd_ep_head *h = (const struct pd_ep_head *)m;
        const struct pd_ep_meta *rec = (const struct pd_ep_meta *)(m + sizeof *h);
        const float *scale = (const float *)(rec + h->pairs);
        const int first = T + ep->rbase[d] + (h->pairs ? (int)head_rows(h->pairs, h->rows, H) : 0);
        for (int i = 0; i < h->rows; i++)
            ep->scale[first + i] = scale[i];
        for (int i = 0; i < h->pairs; i++) {
            const int x = rec[i].expert, j = Pl + ep->roff[d] + i;
            if (x < 0 || x >= ep->n_experts || !ep->has_expert[x] || rec[i].row < 0 || rec[i].row >= h->rows) {
                rc = pd_err_set(e, PD_EIO, "expert parallelism: rank %d received a pair for expert %d on row %d of %d "
                                "from rank %d, not one it can run", me, x, rec[i].row, h->rows, d);
                cancel_all(ncreq, creq);
                return rc;
            }
            ep->expert[j] = x;
            ep->row[j] = first + rec[i].row;
            ep->dst[j] = ep->out + (size_t)(ep->roff[d] + i) * H;
        }
    }
    /* the experts held here, on this rank's rows and the rows sent to them, in one grouped pass */
    double t1 = pd_now_s();
    pd_qmat ra = {.q = ep->q, .scale = ep->scale, .rows = T + rows, .cols = H};
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
    /* the combine's receives, posted only once this rank's own outputs are on their way. Open MPI
     * moves a large message over shared memory by a single copy the receiver makes (CMA get)
     * in whatever MPI call progresses it: posted before the dispatch, as they were, a rank in
     * any MPI call before its own combine (bench ep's barrier) copied the peer's outputs there
     * before sending its own, and the peer waited for that copy, then made its own: the two
     * copies ran one after the other (2 ranks, 256 tokens: one rank's combine 600-880 us, the
     * other's 3 us, against about 300 us each side by side; some rank slept in 25-68 of 80
     * repetitions, 6-16 since). Posted now, an early peer's message waits unmatched until this
     * rank has sent, as MPI_Alltoallv's would. */
    for (int d = 0; d < n; d++) {
        int c = d != me ? ep->scnt[d] : 0;
        if (c && (r = MPI_Irecv(back + (size_t)ep->cursor[d] * H, c * H, MPI_FLOAT, d, PD_EP_TAG_OUT, ep->comm,
                                &creq[ncreq++])))
            goto fail;
    }
    if ((r = waitall(ncreq, creq, EP_SPIN_S, &ep->sleeps)) != MPI_SUCCESS)
        goto fail;
    /* each received output row stays where it landed and its pair points there: copying them to
     * their (token, slot) rows of y (cold after the experts) cost about a third of the exchange at
     * 64 and 256 tokens on 2 ranks (165 us of ~530 at 256), and an indexed MPI datatype receiving
     * straight into y was slower still (milliseconds at 256 tokens over shared memory: Open MPI
     * packs a non-contiguous receive through its shared-memory fragments). */
    for (int i = 0; i < Ps; i++)
        out[ep->spair[i]] = back + (size_t)i * H;
    ep->bytes_sent += (int64_t)R * H * (int64_t)sizeof(float);
    double t3 = pd_now_s();
    ep->t_exchange += (t1 - t0) + (t3 - t2);
    ep->exchanges++;
    atomic_store(&ep->exchanged_ns, pd_now_ns());
    return 0;
fail:
    cancel_all(nreq, req);
    drop_probed(ep, ep->msg, ep->mbytes);
    cancel_all(ncreq, creq);
    return mpi_fail(ep, r, "the dispatch or combine", e);
}

void pd_ep_attach(struct pd_ep *ep, struct pd_engine *en)
{
    en->experts_fn = ep_experts;
    en->experts_ctx = ep;
}

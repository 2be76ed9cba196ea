/* The KV hand-off seen from the server (server_int.h): a prefill instance's leases (offered to the
 * transfer engine, released by it, yielded when a request needs their room) and a decode
 * instance's pulls (started by the scheduler, progressed by the transfer thread, taken on when
 * they end: the producer's token, a refusal, or the prompt computed again). */
#include "core/timing.h"
#include "pd/server_int.h"

#include <stdlib.h>

/* Producer: the transfer engine ended a lease (DONE, ABORT, expiry, destroy): the scheduler frees
 * the KV. Runs on the thread that progressed the engine. */
static void on_release(void *arg, uint64_t request, enum pd_kvx_release why)
{
    struct pd_server *s = arg;
    pthread_mutex_lock(&s->mu);
    s->leases_expired += why == PD_KVX_REL_EXPIRED;
    for (struct req **pp = &s->leases; *pp; pp = &(*pp)->lease_next)
        if ((*pp)->id == request) {
            struct req *r = *pp;
            *pp = r->lease_next;
            r->lease_next = s->released;
            s->released = r;
            pthread_cond_signal(&s->cv);
            break;
        }
    pthread_mutex_unlock(&s->mu);
}

/* Producer: puts the KV of q's first `len` tokens under a lease with `key` for request id (given
 * back to `release`); 0 or -1. */
int pd_srv_seq_offer(struct pd_server *s, struct pd_seq *q, const struct pd_kvx_key *key, uint64_t id, int len,
                     pd_kvx_release_fn release)
{
    int n;
    struct pd_kv_run *runs = pd_srv_kv_runs(s, q, len, &n, NULL);
    pd_err e;
    /* struct pd_kv_run and struct pd_kvx_run are the same (offset, length) pairs */
    int rc = !s->kvx || !runs || pd_kvx_offer(s->kvx, key, id, (const struct pd_kvx_run *)runs, n, release, s, &e);
    free(runs);
    return rc ? -1 : 0;
}



/* Consumer: starts pulling the producer's KV of `len` prompt tokens (lease `key` at host:port)
 * into q, whose blocks are reserved: *t the transfer (progressed by the transfer thread), *bytes
 * what it moves; 0 when under way, PULL_NONE when no pull can start. */
int pd_srv_seq_pull_start(struct pd_server *s, struct pd_seq *q, const char *host, int port,
                          const struct pd_kvx_key *key, int len, struct pd_kvx_xfer **t, uint64_t *bytes)
{
    int n;
    struct pd_kv_run *dst = pd_srv_kv_runs(s, q, len, &n, bytes);
    pd_err e = {0};
    int rc = !s->kvx || !dst || pd_kvx_pull(s->kvx, host, port, key, (const struct pd_kvx_run *)dst, n, t, &e);
    free(dst);
    if (rc)
        *t = NULL;
    return rc ? PULL_NONE : 0;
}

/* Consumer: pull *t into q, once it ended (*t then freed and NULL): 0 when q holds the `len`
 * prompt tokens, PULL_REFUSED when the producer refused the key, PULL_FAILED otherwise; 1 while
 * it runs. Why it failed (a dead producer, a KV cache dtype that differs...) is worth a line,
 * unless `quiet` (its client left): the request goes on, recomputed, and only the counters would
 * tell otherwise. */
int pd_srv_seq_pull_end(struct pd_server *s, struct pd_seq *q, struct pd_kvx_xfer **t, int len, int quiet)
{
    enum pd_kvx_state st = pd_kvx_state(s->kvx, *t);
    if (st != PD_KVX_DONE && st != PD_KVX_FAILED)
        return 1;
    pd_err e = {0};
    int refused = pd_kvx_refused(s->kvx, *t);
    if (st != PD_KVX_DONE && !quiet && s->o.http.log && pd_kvx_result(s->kvx, *t, &e))
        s->o.http.log(s->o.http.log_arg, e.msg);
    pd_kvx_xfer_free(s->kvx, *t);
    *t = NULL;
    if (st != PD_KVX_DONE)
        return refused ? PULL_REFUSED : PULL_FAILED;
    q->pos = len;
    q->kv.len = len;
    return 0;
}

/* Producer: the request's KV goes under a lease instead of being freed (s->mu held). */
int pd_srv_lease(struct pd_server *s, struct req *r)
{
    r->leased_at = pd_now_s();
    r->lease_next = s->leases;
    s->leases = r;
    int rc = pd_srv_seq_offer(s, &r->seq, &r->key, r->id, r->n_prompt, on_release);
    if (rc)
        s->leases = r->lease_next;
    return rc;
}

/* Producer: a request waits for room while leases hold their blocks (and sequences), and a lease
 * whose decode request was refused there or cancelled before it pulled is never claimed: sixteen
 * such requests held a 16-sequence prefill for the whole lease (30 s). So when a request finds no
 * room, the oldest lease unclaimed for LEASE_YIELD_S is revoked: its blocks go back at its release
 * (one on its way at a time), and a decode that still comes for it is refused it as expired, its
 * proxy sending the prompt to a prefill again. A pull normally starts milliseconds after the
 * prefill's answer; under a decode backlog a revoked lease costs one prompt computed again, where
 * holding it cost every request behind it. In an EP group the lease is on its owner rank's
 * engine, which revokes it when the next round's message says so. (s->mu held) */
#define LEASE_YIELD_S 1.0

void pd_srv_yield_lease(struct pd_server *s)
{
    if (!s->kvx && !s->g)
        return;
    const double now = pd_now_s();
    for (;;) {
        struct req *oldest = NULL;
        for (struct req *r = s->leases; r; r = r->lease_next) {
            if (r->revoked)
                return;   /* its blocks are on their way back */
            if (r->leased_at >= 0 && now - r->leased_at >= LEASE_YIELD_S && (!oldest || r->leased_at < oldest->leased_at))
                oldest = r;
        }
        if (!oldest)
            return;
        if (pd_srv_revoke_lease(s, oldest))
            return;
        oldest->leased_at = -1;   /* a pull holds it: not a candidate again */
    }
}

int pd_srv_revoke_lease(struct pd_server *s, struct req *r)
{
    struct req *l = s->leases;
    while (l && l != r)
        l = l->lease_next;
    if (!l || r->revoked)
        return 0;
    if (s->g) {   /* its owner rank revokes it in the next round and reports the release (or, if a
                   * pull claimed it meanwhile, its end) */
        pd_srv_ep_revoke(s, r);
        r->revoked = 1;
        return 1;
    }
    if (s->kvx && pd_kvx_revoke(s->kvx, &r->key)) {
        r->revoked = 1;
        s->leases_revoked++;
        return 1;
    }
    return 0;
}

/* Consumer: starts pulling the producer's KV into a fresh sequence of this pool (r->pull), the
 * other sequences stepping meanwhile (a producer that hangs held every stream of this instance
 * for the pull's timeout); 0 when under way, PULL_NONE when no pull can start (the prompt is then
 * recomputed). (s->mu held) */
int pd_srv_pull_start(struct pd_server *s, struct req *r)
{
    pd_err e = {0};
    if (!s->kvx || r->remote_tokens != r->n_prompt || pd_kvseq_reserve(&s->en.kv, &r->seq.kv, r->n_prompt, &e) ||
        pd_srv_seq_pull_start(s, &r->seq, r->remote_host, r->remote_port, &r->remote_key, r->n_prompt, &r->pull,
                              &r->pull_bytes))
        return PULL_NONE;
    r->pull_t0 = pd_now_s();
    return 0;
}

/* Consumer: r's pull, once it ended: 0 when the sequence now holds the prompt, PULL_REFUSED when
 * the producer refused the request's key, PULL_FAILED when the prompt is to be recomputed; 1
 * while it runs. (s->mu held; the transfer thread progresses it) */
static int pull_poll(struct pd_server *s, struct req *r)
{
    int res = pd_srv_seq_pull_end(s, &r->seq, &r->pull, r->n_prompt, r->pull_aborted);
    if (res == 1)
        return 1;
    if (r->pull_aborted)   /* its client left: no transfer failure to count */
        return PULL_FAILED;
    double seconds = pd_now_s() - r->pull_t0;
    s->kv_pulls++;
    pd_srv_count_pull(s, r->remote_host, r->remote_port, 0, res == 0 ? (int64_t)r->pull_bytes : -1, seconds);
    if (res) {
        s->kv_failures++;
        return res;
    }
    s->kv_bytes += r->pull_bytes;
    s->kv_seconds += seconds;
    pd_err e2 = {0};
    if (pd_srv_spec_pulled(s, r, &e2)) {
        /* the draft has no input: the prompt is recomputed, as after a pull that failed midway */
        if (s->o.http.log)
            s->o.http.log(s->o.http.log_arg, e2.msg);
        r->seq.pos = r->seq.kv.len = r->seq.mtp_pos = 0;
        pd_spec_free(&r->spec);
        r->spec.seq = NULL;   /* the prefill starts it afresh */
        s->kv_failures++;
        return PULL_FAILED;
    }
    return 0;
}

/* The pulls under way (s->mu held): each that ended goes on as it should (the producer's token,
 * a refusal, or the prompt recomputed); one whose client left is aborted and its sequence ended
 * only once no get can still write its blocks. */
void pd_srv_pulls_progress(struct pd_server *s)
{
    for (int i = 0; i < s->n_running;) {
        struct req *r = s->running[i];
        if (!r->pull) {
            i++;
            continue;
        }
        if ((r->cancelled || r->stop_wanted) && !r->pull_aborted) {
            pd_kvx_abort(s->kvx, r->pull);
            r->pull_aborted = 1;
        }
        int res = pull_poll(s, r);
        if (res == 1) {
            i++;
            continue;
        }
        if (r->cancelled || r->stop_wanted) {   /* (the drop of cancelled requests ends it next) */
            i++;
            continue;
        }
        if (res == 0) {
            pd_srv_take_producer_token(s, r);
        } else if (res == PULL_REFUSED) {
            pd_srv_refuse(s, r);
            pd_srv_finish_running(s, i);
            continue;
        } else {
            s->kv_recomputes++;
        }
        i++;
    }
}

void *pd_srv_kvx_loop(void *arg)
{
    struct pd_server *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        int stop = s->stop;
        pthread_mutex_unlock(&s->mu);
        if (stop)
            return NULL;
        pd_kvx_wait(s->kvx, NULL, 100);
    }
}

/* The KV transfer engine's progress: UCX's callbacks, which only record what happened (they run
 * inside ucp_worker_progress, under the engine's lock), and the state machine that acts on it
 * after progress returns (see kvxfer.c's header for the rules both keep). */
#include "pd/kvx_internal.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- UCX callbacks */

static ucs_status_t am_recv(struct pd_kvx *x, unsigned id, void *data, size_t length,
                            const ucp_am_recv_param_t *param)
{
    /* Every sender forces the eager protocol; a rendezvous message is not ours. */
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)
        return UCS_ERR_UNSUPPORTED;
    struct msg *m = malloc(sizeof *m + length);
    if (!m)
        return UCS_OK;   /* dropped: the peer's timeout or the lease expiry covers it */
    m->next = NULL;
    m->id = id;
    m->reply_ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : NULL;
    m->len = length;
    memcpy(m->data, data, length);
    *x->inbox_tail = m;
    x->inbox_tail = &m->next;
    x->events++;
    return UCS_OK;
}

#define AM_HANDLER(name, ID)                                                                  \
    static ucs_status_t name(void *arg, const void *header, size_t header_length, void *data, \
                             size_t length, const ucp_am_recv_param_t *param)                 \
    {                                                                                         \
        return am_recv(arg, ID, data, length, param);                                         \
    }
AM_HANDLER(am_get_meta, PD_KVX_AM_GET_META)
AM_HANDLER(am_meta, PD_KVX_AM_META)
AM_HANDLER(am_done, PD_KVX_AM_DONE)
AM_HANDLER(am_abort, PD_KVX_AM_ABORT)
AM_HANDLER(am_ack, PD_KVX_AM_ACK)
AM_HANDLER(am_read, PD_KVX_AM_READ)

/* A piece the producer pushed (DATA), copied into its place here, inside UCX's callback: the
 * only way pushed bytes reach the destination, and only while their transfer is receiving, so
 * nothing lands once it is FAILED (or freed). Anything else is dropped. */
static ucs_status_t am_data(void *arg, const void *header, size_t header_length, void *data, size_t length,
                            const ucp_am_recv_param_t *param)
{
    struct pd_kvx *x = arg;
    const uint8_t *h = header;
    struct pd_kvx_xfer *t = header_length == KVX_DATA_HDR && !(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)
                                ? kvx_find_xfer(x, get64(h)) : NULL;
    uint64_t i = t ? get64(h + 8) : 0;
    if (!t || t->state != PD_KVX_TRANSFERRING || t->fail_code || i >= t->n_pieces || t->pieces[i].landed ||
        t->pieces[i].len != length) {
        x->st.msgs_dropped++;
        return param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV ? UCS_ERR_UNSUPPORTED : UCS_OK;
    }
    memcpy(x->base + t->pieces[i].dst, data, length);
    t->pieces[i].landed = 1;
    t->pieces_left--;
    x->st.pieces_landed++;
    x->st.push_bytes += length;
    x->events++;
    return UCS_OK;
}

/* A message of an id that is not ours: dropped. UCX 1.13 calls through the handler table for any
 * id below the largest registered one without checking the slot: an empty message of id 0 from
 * anyone who had read the KV listener's HELLO crashed the process (SIGSEGV in UCX). */
static ucs_status_t am_drop(void *arg, const void *header, size_t header_length, void *data, size_t length,
                            const ucp_am_recv_param_t *param)
{
    struct pd_kvx *x = arg;
    x->st.msgs_dropped++;
    return UCS_OK;
}

ucs_status_t kvx_set_am_handlers(struct pd_kvx *x)
{
    ucp_am_recv_callback_t cbs[] = {am_drop, am_get_meta, am_meta, am_done, am_abort, am_ack, am_read, am_data};
    unsigned ids[] = {0, PD_KVX_AM_GET_META, PD_KVX_AM_META, PD_KVX_AM_DONE, PD_KVX_AM_ABORT,
                      PD_KVX_AM_ACK, PD_KVX_AM_READ, PD_KVX_AM_DATA};
    _Static_assert(PD_KVX_AM_GET_META == 1 && PD_KVX_AM_DATA == 7, "every id below the largest has a handler");
    for (int i = 0; i < 8; i++) {
        ucp_am_handler_param_t hp = {
            .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                          UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG,
            .id = ids[i],
            .flags = UCP_AM_FLAG_WHOLE_MSG,
            .cb = cbs[i],
            .arg = x,
        };
        ucs_status_t st = ucp_worker_set_am_recv_handler(x->w, &hp);
        if (st != UCS_OK)
            return st;
    }
    return UCS_OK;
}

void kvx_on_sent(struct pd_kvx *x, unsigned id, uint64_t tag, ucs_status_t st)
{
    x->events++;
    if (id != PD_KVX_AM_GET_META)
        return;
    struct pd_kvx_xfer *t = kvx_find_xfer(x, tag);
    if (!t || kvx_is_final(t->state))
        return;
    if (st != UCS_OK && kvx_xfer_may_retry(t))
        t->retry_wanted = 1;   /* (a new endpoint is not made from inside UCX's callback) */
    else if (st != UCS_OK)
        kvx_xfer_fail(t, PD_EIO, 0, "GET_META not delivered: %s", ucs_status_string(st));
    else if (t->state == PD_KVX_BOOTSTRAPPING)
        t->state = PD_KVX_WAITING;
}

void kvx_send_done(void *req, ucs_status_t st, void *user_data)
{
    struct sendop *s = user_data;
    s->x->sends_pending--;
    kvx_on_sent(s->x, s->id, s->tag, st);
    free(s);
    ucp_request_free(req);
}

void kvx_push_done(void *req, ucs_status_t st, void *user_data)
{
    struct push *u = user_data;
    assert(u->left > 0);
    u->left--;
    if (st != UCS_OK)
        u->failed = 1;   /* step() releases the lease */
    ucp_request_free(req);
    u->x->events++;   /* step() frees the push once its last send completed */
}

/* Completion of the flush that follows a transfer's gets: all of them have landed (or failed). */
void kvx_gets_flushed(void *req, ucs_status_t st, void *user_data)
{
    struct pd_kvx_xfer *t = user_data;
    assert(t->outstanding > 0);
    t->outstanding--;
    if (st != UCS_OK && t->get_status == UCS_OK)
        t->get_status = st;
    ucp_request_free(req);
    t->x->events++;
}

void kvx_ep_error(void *arg, ucp_ep_h ep, ucs_status_t st)
{
    struct link *l = arg;
    if (!l->failed) {
        l->failed = 1;
        l->status = st;
    }
    l->x->events++;
}


/* ---------------------------------------------------------------- state machine */

int kvx_link_alive(const struct link *l)
{
    return l && l->ep && !l->failed;
}

/* Messages to a producer go over the data endpoint once there is one: it may be shared memory
 * where the socket-address endpoint is TCP, and the replies come back the same way. */
ucp_ep_h kvx_msg_ep(const struct link *l)
{
    return l->data ? l->data : l->ep;
}

/* Moves a transfer on once nothing of it is in flight. */
void kvx_advance(struct pd_kvx *x, struct pd_kvx_xfer *t)
{
    if (kvx_is_final(t->state))
        return;
    if (t->outstanding) {
        /* In flight on a live endpoint: wait. Once the endpoints are closed nothing can land
         * any more, but UCX 1.13 does not always complete such requests (a flush waiting on a
         * peer that died): the transfer ends and its handle stays until they do, or until
         * destroy. */
        if (!t->fail_code || t->peer->ep || t->peer->data)
            return;
    } else {
        kvx_xfer_rkey_put(t);
    }
    if (!t->fail_code && t->gets_posted && t->pieces_left == 0 && !t->done_sent) {
        if (!kvx_link_alive(t->peer)) {
            kvx_xfer_fail(t, PD_EIO, 0, "connection lost before DONE");
        } else if (t->get_status != UCS_OK) {
            kvx_xfer_fail(t, PD_EIO, 1, "get failed: %s", ucs_status_string(t->get_status));
        } else {
            ucs_status_t st = kvx_send_small(x, kvx_msg_ep(t->peer), PD_KVX_AM_DONE, &t->key, t->tag);
            if (st != UCS_OK)
                kvx_xfer_fail(t, PD_EIO, 0, "cannot send DONE: %s", ucs_status_string(st));
            t->done_sent = 1;
        }
    }
    if (!t->fail_code)
        return;
    /* ABORT even before META: a producer that is merely slow then frees the blocks now; before
     * the link's HELLO has come, once it has (with the GET_META that claims the lease) */
    if (t->send_abort && kvx_link_alive(t->peer))
        kvx_send_small(x, kvx_msg_ep(t->peer), PD_KVX_AM_ABORT, &t->key, t->tag);
    else if (t->send_abort && t->peer && t->peer->bfd >= 0 && !t->peer->failed && !t->meta_sent)
        kvx_boot_defer_abort(t->peer, t);   /* without memory: the lease expires instead */
    t->state = PD_KVX_FAILED;
    x->st.pulls_failed++;
    if (t->peer)
        t->peer->refs--;
}

static void close_one(struct pd_kvx *x, ucp_ep_h *ep)
{
    if (!*ep)
        return;
    /* Force: a failed peer cannot confirm a flush. In-flight requests are meant to complete
     * with UCS_ERR_CANCELED here; UCX 1.13 leaves some (see kvx_advance()). */
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t r = ucp_ep_close_nbx(*ep, &p);
    *ep = NULL;
    if (r && !UCS_PTR_IS_ERR(r)) {
        struct closing *c = malloc(sizeof *c);
        if (c) {
            c->req = r;
            c->next = x->closing;
            x->closing = c;
        } else {
            ucp_request_free(r);
        }
    }
}

/* Closes both endpoints of a link, the data one (where the rkeys were unpacked) first. */
void kvx_close_ep(struct pd_kvx *x, struct link *l)
{
    if (l->data == l->ep)   /* one endpoint for both (data_ep) */
        l->data = NULL;
    close_one(x, &l->data);
    close_one(x, &l->ep);
}

/* Gives back the references of idle transfers on l and the link's own: UCX wants rkeys gone
 * before their endpoint (transfers still flushing give theirs back when the flush completes). */
void kvx_drop_idle_rkeys(struct pd_kvx *x, struct link *l)
{
    for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next)
        if (t->peer == l && t->outstanding == 0)
            kvx_xfer_rkey_put(t);
    if (l->link_rkey_ref) {
        l->link_rkey_ref = 0;
        kvx_rkey_put(l);
    }
}

int64_t kvx_next_deadline(struct pd_kvx *x)
{
    int64_t d = INT64_MAX;
    for (struct lease *l = x->leases; l; l = l->next)
        if (l->deadline < d)
            d = l->deadline;
    for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next) {
        if (!kvx_is_final(t->state) && t->deadline < d)
            d = t->deadline;
        if (!kvx_is_final(t->state) && t->meta_sent && !t->meta_ok && t->meta_by < d)
            d = t->meta_by;
    }
    for (struct link *l = x->links; l; l = l->next)
        if (l->bfd >= 0 && !l->failed && l->hello_by < d)
            d = l->hello_by;
    return d;
}

void kvx_free_xfer(struct pd_kvx_xfer *t)
{
    free(t->pieces);
    free(t->dst);
    free(t);
}

/* Acts on everything the callbacks recorded, then on the clocks. Returns the work done. */
static int step(struct pd_kvx *x)
{
    int n = x->events;
    x->events = 0;
    int64_t now = pd_now_ns();

    /* 0. the KV listener's HELLOs out (producer), theirs in (consumer: GET_METAs then go) */
    if (x->lfd >= 0 && now >= x->accept_at) {
        int k = kvx_boot_serve(x);
        x->accept_at = k ? 0 : now + KVX_ACCEPT_EVERY_NS;
        n += k;
    }
    n += kvx_boot_progress(x);

    /* 1. messages, before any endpoint they came on is closed */
    while (x->inbox) {
        struct msg *m = x->inbox;
        x->inbox = m->next;
        if (!x->inbox)
            x->inbox_tail = &x->inbox;
        kvx_handle_msg(x, m, now);
        free(m);
        n++;
    }

    /* 2. timeouts: a transfer with gets in flight takes its connection down with it, so that
     * nothing still in flight can land in the destination once it is reported FAILED */
    for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next) {
        const int no_meta = t->meta_sent && !t->meta_ok && t->meta_by <= now;   /* (KVX_META_NS) */
        if (kvx_is_final(t->state) || (t->deadline > now && !no_meta))
            continue;
        if (!t->fail_code) {
            if (t->deadline > now)
                kvx_xfer_fail(t, PD_EIO, 1, "no META within %lld ms of its GET_META (the producer died or hangs)",
                              (long long)(KVX_META_NS / 1000000));
            else
                kvx_xfer_fail(t, PD_EIO, 1, "timed out after %lld ms in state %s",
                              (long long)(x->timeout_ns / 1000000), pd_kvx_state_name(t->state));
            n++;
        }
        if (t->outstanding && t->peer && !t->peer->failed) {
            t->peer->failed = 1;
            t->peer->status = UCS_ERR_TIMED_OUT;
        }
        /* a link whose HELLO never came is not kept for the next pull */
        if (t->peer && !t->peer->ep && t->peer->bfd >= 0 && !t->peer->failed) {
            kvx_boot_close(t->peer);
            t->peer->failed = 1;
            t->peer->status = UCS_ERR_TIMED_OUT;
        }
    }

    /* 3. failed endpoints */
    for (struct link *l = x->links; l; l = l->next) {
        if (!l->failed || !l->ep)
            continue;
        if (l->outgoing)
            for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next)
                if (t->peer == l && !kvx_is_final(t->state) && !kvx_xfer_retry(x, t))
                    kvx_xfer_fail(t, PD_EIO, 0, "connection failed: %s",
                              ucs_status_string(l->status));
        kvx_drop_idle_rkeys(x, l);
        kvx_close_ep(x, l);
        n++;
    }

    /* 3b. transfers whose GET_META was not delivered on a kept connection: a new one */
    for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next)
        if (t->retry_wanted) {
            t->retry_wanted = 0;
            if (!kvx_is_final(t->state) && !kvx_xfer_retry(x, t))
                kvx_xfer_fail(t, PD_EIO, 0, "GET_META not delivered");
            n++;
        }

    /* 3c. pushes to a consumer that is gone (a send failed): their lease ends now, its blocks
     * back to the owner, not at its expiry; finished ones are freed (here only) */
    for (struct push **pp = &x->pushes; *pp;) {
        struct push *u = *pp;
        if (u->failed && !x->destroying) {   /* (destroy ends every lease its own way) */
            struct lease *l = kvx_find_lease(x, u->id);
            if (l && l->claimed && l->claim_tag == u->tag)
                kvx_lease_release(x, l, PD_KVX_REL_ABORT);
            u->failed = 0;
            n++;
        }
        if (u->left == 0) {
            *pp = u->next;
            free(u);
        } else {
            pp = &u->next;
        }
    }

    /* 4. leases past their deadline */
    for (struct lease *l = x->leases, *next; l; l = next) {
        next = l->next;
        if (l->deadline <= now) {
            kvx_lease_release(x, l, PD_KVX_REL_EXPIRED);
            n++;
        }
    }

    /* 5. transfers; then handles given up by their owner */
    for (struct pd_kvx_xfer **pp = &x->xfers; *pp;) {
        struct pd_kvx_xfer *t = *pp;
        enum pd_kvx_state before = t->state;
        kvx_advance(x, t);
        if (t->state != before)
            n++;
        if (kvx_is_final(t->state) && t->outstanding == 0)
            kvx_xfer_rkey_put(t);   /* an abandoned flush finally completed */
        if (kvx_is_final(t->state) && t->free_when_final && t->outstanding == 0) {
            *pp = t->next;
            kvx_free_xfer(t);
        } else {
            pp = &t->next;
        }
    }

    /* 6. closed endpoints nobody refers to */
    for (struct link **pp = &x->links; *pp;) {
        struct link *l = *pp;
        if (!l->ep && l->refs == 0 && l->rkey_refs == 0 && !(l->bfd >= 0 && l->n_deferred)) {
            *pp = l->next;
            kvx_link_free(l);
        } else {
            pp = &l->next;
        }
    }

    /* 7. finished endpoint closes */
    for (struct closing **pp = &x->closing; *pp;) {
        struct closing *c = *pp;
        if (ucp_request_check_status(c->req) != UCS_INPROGRESS) {
            ucp_request_free(c->req);
            *pp = c->next;
            free(c);
        } else {
            pp = &c->next;
        }
    }
    return n;
}

/* Progresses UCX once, then acts. Lock held. */
int kvx_progress_locked(struct pd_kvx *x)
{
    int n = (int)ucp_worker_progress(x->w);
    n += step(x);
    /* Another thread asleep on the fd may have been waiting for what we just consumed. */
    if (n && x->sleepers)
        ucp_worker_signal(x->w);
    return n;
}


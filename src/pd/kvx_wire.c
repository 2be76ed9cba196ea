/* The KV transfer engine's messages (see kvxfer.h for the protocol, kvx_internal.h for who does
 * what): sending them, and handling what arrives once the state machine takes it from the inbox. */
#include "pd/kvx_internal.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- sending */

/* Sends one message (copied); returns 0 or the UCX error. Completion reaches kvx_on_sent(). */
static ucs_status_t send_msg(struct pd_kvx *x, ucp_ep_h ep, unsigned id, uint64_t tag,
                             const uint8_t *buf, size_t len)
{
    struct sendop *s = malloc(sizeof *s + len);
    if (!s)
        return UCS_ERR_NO_MEMORY;
    s->x = x;
    s->id = id;
    s->tag = tag;
    memcpy(s->data, buf, len);
    /* Requests ask for the reply endpoint; eager only, so the receiver always gets the bytes
     * in its callback (no rendezvous descriptor to fetch). */
    uint32_t flags = UCP_AM_SEND_FLAG_EAGER;
    if (id == PD_KVX_AM_GET_META || id == PD_KVX_AM_READ || id == PD_KVX_AM_DONE || id == PD_KVX_AM_ABORT)
        flags |= UCP_AM_SEND_FLAG_REPLY;
    ucp_request_param_t p = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS,
        .cb.send = kvx_send_done,
        .user_data = s,
        .flags = flags,
    };
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, NULL, 0, s->data, len, &p);
    if (r == NULL) {
        free(s);
        kvx_on_sent(x, id, tag, UCS_OK);
        return UCS_OK;
    }
    if (UCS_PTR_IS_ERR(r)) {
        free(s);
        return UCS_PTR_STATUS(r);
    }
    x->sends_pending++;
    return UCS_OK;
}

/* Packs the KVX_MSG_SMALL head every keyed message starts with: version, a word (0, or READ's
 * piece count), tag, key id, key hash. */
static void put_small_head(uint8_t *b, uint32_t word, const struct pd_kvx_key *key, uint64_t tag)
{
    put32(b, KVX_VERSION);
    put32(b + 4, word);
    put64(b + 8, tag);
    memcpy(b + 16, key->id, sizeof key->id);
    put64(b + 32, key->hash);
}

ucs_status_t kvx_send_small(struct pd_kvx *x, ucp_ep_h ep, unsigned id,
                               const struct pd_kvx_key *key, uint64_t tag)
{
    uint8_t b[KVX_MSG_SMALL];
    put_small_head(b, 0, key, tag);
    return send_msg(x, ep, id, tag, b, sizeof b);
}

static void send_ack(struct pd_kvx *x, ucp_ep_h ep, int status, uint64_t tag, unsigned acked)
{
    uint8_t b[KVX_MSG_ACK];
    put32(b, KVX_VERSION);
    put32(b + 4, (uint32_t)status);
    put64(b + 8, tag);
    put32(b + 16, acked);
    put32(b + 20, 0);
    /* A lost ACK only costs the consumer its timeout; nothing to undo here. */
    send_msg(x, ep, PD_KVX_AM_ACK, 0, b, sizeof b);
}

static void send_meta(struct pd_kvx *x, ucp_ep_h ep, int status, uint64_t tag,
                      const struct lease *l)
{
    uint32_t n = l ? (uint32_t)l->n : 0;
    uint32_t rk = l ? (uint32_t)x->rkey_len : 0;
    uint32_t ad = l ? (uint32_t)x->addr_len : 0;
    size_t len = KVX_META_FIXED + ad + rk + 16 * (size_t)n;
    uint8_t *b = malloc(len);
    if (!b)
        return;
    put32(b, KVX_VERSION);
    put32(b + 4, (uint32_t)status);
    put64(b + 8, tag);
    put64(b + 16, (uint64_t)(uintptr_t)x->base);
    put32(b + 24, rk);
    put32(b + 28, n);
    put32(b + 32, ad);
    put32(b + 36, (uint32_t)x->kv_dtype);
    if (ad)
        memcpy(b + KVX_META_FIXED, x->addr, ad);
    if (rk)
        memcpy(b + KVX_META_FIXED + ad, x->rkey_buf, rk);
    uint8_t *p = b + KVX_META_FIXED + ad + rk;
    for (uint32_t i = 0; i < n; i++, p += 16) {
        put64(p, l->runs[i].off);
        put64(p + 8, l->runs[i].len);
    }
    if (send_msg(x, ep, PD_KVX_AM_META, 0, b, len) == UCS_OK && l)
        x->st.metas_served++;
    free(b);
}

/* ---------------------------------------------------------------- handling messages */

/* The data endpoint of an outgoing link, made on the first META from the producer's worker
 * address (the same for every later META of that producer). */
static ucs_status_t data_ep(struct pd_kvx *x, struct link *l, const uint8_t *addr, size_t len)
{
    if (l->data)
        return UCS_OK;
    /* the worker the HELLO named (always, but for a producer that restarted in between): its
     * endpoint carries the gets too */
    if (l->ep && l->paddr && len == l->paddr_len && memcmp(addr, l->paddr, len) == 0) {
        l->data = l->ep;
        return UCS_OK;
    }
    /* the address is only read during ucp_ep_create; copy it for alignment */
    ucp_address_t *a = malloc(len);
    if (!a)
        return UCS_ERR_NO_MEMORY;
    memcpy(a, addr, len);
    ucp_ep_params_t p = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .address = a,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = kvx_ep_error, .arg = l},
    };
    ucs_status_t st = ucp_ep_create(x->w, &p, &l->data);
    free(a);
    if (st != UCS_OK)
        l->data = NULL;
    return st;
}

/* The producer's rkey for a transfer on l, unpacked on the first META only: unpacking a
 * shared-memory rkey attaches the producer's segment, which per transfer would cost a new
 * mapping and a page fault for every page read. A producer's region and its key never change,
 * so a META whose key differs from the first is refused. */
static ucp_rkey_h rkey_get(struct link *l, const uint8_t *packed, size_t len, ucs_status_t *st)
{
    if (l->rkey && (len != l->rkey_packed_len || memcmp(packed, l->rkey_packed, len) != 0)) {
        *st = UCS_ERR_INVALID_PARAM;
        return NULL;
    }
    if (!l->rkey) {   /* then no reference is left either */
        uint8_t *copy = malloc(len);
        if (!copy) {
            *st = UCS_ERR_NO_MEMORY;
            return NULL;
        }
        if ((*st = ucp_ep_rkey_unpack(l->data, packed, &l->rkey)) != UCS_OK) {
            l->rkey = NULL;
            free(copy);
            return NULL;
        }
        memcpy(copy, packed, len);
        l->x->st.rkeys_unpacked++;
        l->rkey_packed = copy;
        l->rkey_packed_len = len;
        l->rkey_refs = 1;
        l->link_rkey_ref = 1;
    }
    l->rkey_refs++;
    *st = UCS_OK;
    return l->rkey;
}

void kvx_rkey_put(struct link *l)
{
    assert(l->rkey_refs > 0);
    if (--l->rkey_refs == 0) {
        ucp_rkey_destroy(l->rkey);
        l->rkey = NULL;
        free(l->rkey_packed);
        l->rkey_packed = NULL;
        l->rkey_packed_len = 0;
    }
}

/* A transfer gives its reference back. */
void kvx_xfer_rkey_put(struct pd_kvx_xfer *t)
{
    if (t->rkey) {
        kvx_rkey_put(t->peer);
        t->rkey = NULL;
    }
}

/* The pieces of a transfer: its byte stream cut wherever a run ends on either side, and every
 * `cap` bytes, so that each piece is contiguous in both regions. Calls fn (if any) for each, in
 * order, until it returns nonzero; returns the number of pieces. */
static uint64_t cut_pieces(const struct pd_kvx_run *src, int ns, const struct pd_kvx_run *dst, int nd,
                           uint64_t cap, int (*fn)(void *arg, uint64_t src, uint64_t dst, uint64_t len),
                           void *arg)
{
    int i = 0, j = 0;
    uint64_t a = 0, b = 0, count = 0;
    while (i < ns && j < nd) {
        uint64_t n = src[i].len - a;
        if (dst[j].len - b < n)
            n = dst[j].len - b;
        if (cap < n)
            n = cap;
        count++;
        if (fn && fn(arg, src[i].off + a, dst[j].off + b, n))
            break;
        a += n;
        b += n;
        if (a == src[i].len) {
            i++;
            a = 0;
        }
        if (b == dst[j].len) {
            j++;
            b = 0;
        }
    }
    return count;
}

struct get_ctx {
    struct pd_kvx *x;
    struct pd_kvx_xfer *t;
    uint64_t base;
    ucp_request_param_t p;
};

static int one_get(void *arg, uint64_t src, uint64_t dst, uint64_t n)
{
    struct get_ctx *g = arg;
    ucs_status_ptr_t r = ucp_get_nbx(g->t->peer->data, g->x->base + dst, n, g->base + src, g->t->rkey, &g->p);
    if (UCS_PTR_IS_ERR(r)) {
        kvx_xfer_fail(g->t, PD_EIO, 1, "get of %llu bytes failed: %s", (unsigned long long)n,
                      ucs_status_string(UCS_PTR_STATUS(r)));
        return 1;
    }
    if (r != NULL)
        ucp_request_free(r);
    g->t->gets++;
    g->x->st.gets++;
    g->x->st.get_bytes += n;
    return 0;
}

/* One get per piece, then one flush: the gets carry no callback (their requests are released at
 * once), so a transfer costs one completion whatever its number of runs. */
static void post_gets(struct pd_kvx *x, struct pd_kvx_xfer *t, uint64_t base,
                      const struct pd_kvx_run *src, int ns)
{
    struct get_ctx g = {.x = x, .t = t, .base = base,
                        .p = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH, .memh = x->memh}};
    cut_pieces(src, ns, t->dst, t->n_dst, UINT64_MAX, one_get, &g);
    t->gets_posted = 1;
    /* even after a failed get: the ones already posted must land before the transfer ends */
    ucp_request_param_t fp = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        .cb.send = kvx_gets_flushed,
        .user_data = t,
    };
    ucs_status_ptr_t r = ucp_ep_flush_nbx(t->peer->data, &fp);
    if (UCS_PTR_IS_ERR(r))
        t->get_status = UCS_PTR_STATUS(r);
    else if (r != NULL)
        t->outstanding++;
}

static int one_piece(void *arg, uint64_t src, uint64_t dst, uint64_t n)
{
    struct pd_kvx_xfer *t = arg;
    t->pieces[t->n_pieces++] = (struct kvx_piece){.src = src, .dst = dst, .len = n};
    return 0;
}

/* Asks the producer to push the pieces (READ); they land through the DATA handler
 * (kvx_progress.c). Nothing of the producer's is used here but the runs' offsets. */
static void post_read(struct pd_kvx *x, struct pd_kvx_xfer *t, const struct pd_kvx_run *src, int ns)
{
    uint64_t n = cut_pieces(src, ns, t->dst, t->n_dst, KVX_PIECE_MAX, NULL, NULL);
    if (n > KVX_MAX_RUNS) {
        kvx_xfer_fail(t, PD_EINVAL, 1, "%llu pieces (at most %d a transfer)", (unsigned long long)n, KVX_MAX_RUNS);
        return;
    }
    size_t len = KVX_MSG_SMALL + 16 * (size_t)n;
    uint8_t *b = malloc(len);
    t->pieces = calloc(n, sizeof *t->pieces);
    if (!b || !t->pieces) {
        free(b);
        kvx_xfer_fail(t, PD_ENOMEM, 1, "no memory for %llu pieces", (unsigned long long)n);
        return;
    }
    t->n_pieces = 0;
    cut_pieces(src, ns, t->dst, t->n_dst, KVX_PIECE_MAX, one_piece, t);
    t->pieces_left = n;
    put_small_head(b, (uint32_t)n, &t->key, t->tag);
    for (uint64_t i = 0; i < n; i++) {
        put64(b + KVX_MSG_SMALL + 16 * i, t->pieces[i].src);
        put64(b + KVX_MSG_SMALL + 16 * i + 8, t->pieces[i].len);
    }
    ucs_status_t st = send_msg(x, t->peer->data, PD_KVX_AM_READ, t->tag, b, len);
    free(b);
    t->gets_posted = 1;
    if (st != UCS_OK)
        kvx_xfer_fail(t, PD_EIO, 1, "cannot send READ: %s", ucs_status_string(st));
}

static const char *kv_dtype_name(uint32_t d)
{
    return d == 0 ? "bf16" : d == 1 ? "fp8" : "an unknown format";
}

static void handle_meta(struct pd_kvx *x, const uint8_t *d, size_t len)
{
    if (len < KVX_META_FIXED)
        return;
    struct pd_kvx_xfer *t = kvx_find_xfer(x, get64(d + 8));
    if (!t || kvx_is_final(t->state) || t->fail_code || t->meta_ok)
        return;
    if (t->peer)
        t->peer->heard_ns = pd_now_ns();
    int status = (int)get32(d + 4);
    if (get32(d) != KVX_VERSION) {
        kvx_xfer_fail(t, PD_EFORMAT, 1, "META of protocol version %u (want %d)", get32(d),
                  KVX_VERSION);
        return;
    }
    /* Refusals send no ABORT: the lease, if any, is not ours to end. */
    if (status == PD_KVX_ST_UNKNOWN || status == PD_KVX_ST_REFUSED) {
        t->refused = 1;
        kvx_xfer_fail(t, PD_EINVAL, 0, "%s", status == PD_KVX_ST_UNKNOWN
                  ? "unknown transfer id at the producer (never offered, already pulled, released or expired)"
                  : "the producer refused the transfer: its prompt differs from this request's, or another pull "
                    "claimed it");
        return;
    }
    if (status != PD_KVX_ST_OK) {
        kvx_xfer_fail(t, PD_EFORMAT, 0, "producer rejected GET_META (status %d)", status);
        return;
    }
    uint64_t base = get64(d + 16);
    uint32_t rk = get32(d + 24), n = get32(d + 28), ad = get32(d + 32), dt = get32(d + 36);
    if (dt != (uint32_t)x->kv_dtype) {
        /* the same prompt's KV in another format: nothing to copy; the lease is ours to end */
        t->meta_ok = 1;
        kvx_xfer_fail(t, PD_EINVAL, 1, "KV cache dtype mismatch: the producer stores %s, this instance %s "
                  "(--kv-cache-dtype must be the same on both)", kv_dtype_name(dt), kv_dtype_name((uint32_t)x->kv_dtype));
        return;
    }
    if (n == 0 || n > KVX_MAX_RUNS || ad == 0 ||
        len != KVX_META_FIXED + (uint64_t)ad + rk + 16 * (uint64_t)n) {
        kvx_xfer_fail(t, PD_EFORMAT, 1, "malformed META (%zu bytes, %u runs, %u-byte rkey)", len, n,
                  rk);
        return;
    }
    const uint8_t *addr = d + KVX_META_FIXED, *rkey = addr + ad;
    struct pd_kvx_run *src = malloc(n * sizeof *src);
    if (!src) {
        kvx_xfer_fail(t, PD_ENOMEM, 1, "no memory for %u runs", n);
        return;
    }
    uint64_t total = 0, want = 0;
    const uint8_t *p = rkey + rk;
    int overflow = 0;
    for (uint32_t i = 0; i < n; i++, p += 16) {
        src[i].off = get64(p);
        src[i].len = get64(p + 8);
        overflow |= total + src[i].len < total;
        total += src[i].len;
    }
    for (int j = 0; j < t->n_dst; j++)
        want += t->dst[j].len;
    t->meta_ok = 1;
    if (overflow) {
        kvx_xfer_fail(t, PD_EFORMAT, 1, "malformed META (run lengths overflow)");
        free(src);
        return;
    }
    if (total != want) {
        kvx_xfer_fail(t, PD_EINVAL, 1,
                  "size mismatch: the producer holds %llu bytes, the destination runs %llu "
                  "(different block sizes?)",
                  (unsigned long long)total, (unsigned long long)want);
        free(src);
        return;
    }
    ucs_status_t st = data_ep(x, t->peer, addr, ad);
    if (st != UCS_OK) {
        kvx_xfer_fail(t, PD_EIO, 1, "cannot reach the producer's worker for data: %s",
                  ucs_status_string(st));
        free(src);
        return;
    }
    t->rkey = rkey_get(t->peer, rkey, rk, &st);
    if (!t->rkey) {
        kvx_xfer_fail(t, PD_EIO, 1, "cannot use the producer's rkey: %s", st == UCS_ERR_INVALID_PARAM ?
                  "it differs from the one this connection started with" : ucs_status_string(st));
        free(src);
        return;
    }
    t->state = PD_KVX_TRANSFERRING;
    int ns = kvx_merge_runs(src, (int)n, src);
    void *mapped;
    if (ucp_rkey_ptr(t->rkey, base + src[0].off, &mapped) == UCS_OK) {
        post_gets(x, t, base, src, ns);
    } else {
        kvx_xfer_rkey_put(t);
        post_read(x, t, src, ns);
    }
    free(src);
}

static void handle_ack(struct pd_kvx *x, const uint8_t *d, size_t len)
{
    if (len < KVX_MSG_ACK)
        return;
    struct pd_kvx_xfer *t = kvx_find_xfer(x, get64(d + 8));
    if (!t || kvx_is_final(t->state) || t->fail_code)
        return;
    int status = (int)get32(d + 4);
    if (get32(d + 16) == PD_KVX_AM_READ && t->pieces && !t->done_sent && status != PD_KVX_ST_OK) {
        kvx_xfer_fail(t, PD_EIO, 1, "the producer refused READ (status %d)", status);
        return;
    }
    if (!t->done_sent || get32(d + 16) != PD_KVX_AM_DONE)
        return;
    if (status != PD_KVX_ST_OK) {
        /* The lease ended before DONE: the blocks may have been reused while we read them. */
        kvx_xfer_fail(t, PD_EIO, 0, "the producer no longer held the lease at DONE (expired?)");
        return;
    }
    assert(t->outstanding == 0 && t->rkey == NULL);
    t->state = PD_KVX_DONE;
    x->st.pulls_done++;
    t->peer->refs--;
}

/* Whether READ's n pieces (producer offset, length) tile lease l's runs exactly, in order, each
 * of 1 to KVX_PIECE_MAX bytes. */
static int tiles_lease(const struct lease *l, const uint8_t *p, uint32_t n)
{
    int i = 0;
    uint64_t a = 0;
    for (uint32_t k = 0; k < n; k++, p += 16) {
        uint64_t off = get64(p), len = get64(p + 8);
        if (i >= l->n || len == 0 || len > KVX_PIECE_MAX || off != l->runs[i].off + a ||
            len > l->runs[i].len - a)
            return 0;
        a += len;
        if (a == l->runs[i].len) {
            i++;
            a = 0;
        }
    }
    return i == l->n && a == 0;
}

/* Sends READ's pieces as DATA, on the endpoint the READ came from. A send that cannot start ends
 * the push: the consumer's timeout, or its DONE refused for a lease gone, covers the rest. */
static void push_pieces(struct pd_kvx *x, const struct lease *l, ucp_ep_h ep, uint64_t tag, const uint8_t *p,
                        uint32_t n)
{
    struct push *u = malloc(sizeof *u + (size_t)n * KVX_DATA_HDR);
    if (!u)
        return;
    u->x = x;
    u->left = n;
    memcpy(u->id, l->key.id, sizeof u->id);
    u->tag = tag;
    u->failed = 0;
    u->next = x->pushes;
    x->pushes = u;
    for (uint32_t k = 0; k < n; k++, p += 16) {
        put64(u->hdr[k], tag);
        put64(u->hdr[k] + 8, k);
        ucp_request_param_t rp = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                            UCP_OP_ATTR_FIELD_FLAGS,
            .cb.send = kvx_push_done,
            .user_data = u,
            .flags = UCP_AM_SEND_FLAG_EAGER,
        };
        ucs_status_ptr_t r = ucp_am_send_nbx(ep, PD_KVX_AM_DATA, u->hdr[k], KVX_DATA_HDR,
                                             x->base + get64(p), get64(p + 8), &rp);
        if (UCS_PTR_IS_ERR(r)) {
            u->left -= n - k;
            u->failed = 1;
            break;
        }
        x->st.pieces_pushed++;
        if (r == NULL)
            u->left--;
    }
    /* (a push whose sends all completed here is freed by step()'s part 3c, which runs after the
     * messages' part 1 that called this) */
}

static void handle_read(struct pd_kvx *x, const struct msg *m, int64_t now)
{
    const uint8_t *d = m->data;
    uint64_t tag = m->len >= 16 ? get64(d + 8) : 0;
    uint32_t n = m->len >= KVX_MSG_SMALL ? get32(d + 4) : 0;
    if (m->len < KVX_MSG_SMALL || get32(d) != KVX_VERSION || n == 0 || n > KVX_MAX_RUNS ||
        m->len != KVX_MSG_SMALL + 16 * (uint64_t)n) {
        send_ack(x, m->reply_ep, PD_KVX_ST_MALFORMED, tag, PD_KVX_AM_READ);
        return;
    }
    struct lease *l = kvx_find_lease(x, d + 16);
    /* only the pull that claimed the lease, once */
    int status = !l ? PD_KVX_ST_UNKNOWN
                    : l->key.hash != get64(d + 32) || !l->claimed || l->claim_tag != tag || l->pushed
                    ? PD_KVX_ST_REFUSED
                    : !tiles_lease(l, d + KVX_MSG_SMALL, n) ? PD_KVX_ST_MALFORMED : PD_KVX_ST_OK;
    if (status != PD_KVX_ST_OK) {
        send_ack(x, m->reply_ep, status, tag, PD_KVX_AM_READ);
        return;
    }
    l->pushed = 1;
    l->deadline = now + x->lease_ns;
    push_pieces(x, l, m->reply_ep, tag, d + KVX_MSG_SMALL, n);
}

void kvx_handle_msg(struct pd_kvx *x, struct msg *m, int64_t now)
{
    /* A dying engine answers nothing: its leases end with PD_KVX_REL_DESTROY, so a DONE
     * acknowledged now would vouch for blocks the owner is about to reuse. */
    if (x->destroying)
        return;
    const uint8_t *d = m->data;
    switch (m->id) {
    case PD_KVX_AM_META:
        handle_meta(x, d, m->len);
        return;
    case PD_KVX_AM_ACK:
        handle_ack(x, d, m->len);
        return;
    default:
        break;
    }
    /* Producer side: GET_META, READ, DONE, ABORT; all need somewhere to reply. */
    if (!m->reply_ep)
        return;
    if (m->id == PD_KVX_AM_READ) {
        handle_read(x, m, now);
        return;
    }
    if (m->len != KVX_MSG_SMALL || get32(d) != KVX_VERSION) {
        uint64_t tag = m->len >= 16 ? get64(d + 8) : 0;
        if (m->id == PD_KVX_AM_GET_META)
            send_meta(x, m->reply_ep, PD_KVX_ST_MALFORMED, tag, NULL);
        else
            send_ack(x, m->reply_ep, PD_KVX_ST_MALFORMED, tag, m->id);
        return;
    }
    uint64_t tag = get64(d + 8), hash = get64(d + 32);
    struct lease *l = kvx_find_lease(x, d + 16);
    /* Only the key's holder, with the prompt the lease was made for, and only one pull: anything
     * else is refused and the lease stays as it was (with its claimant, on its clock). */
    int status = !l ? PD_KVX_ST_UNKNOWN : l->key.hash != hash ? PD_KVX_ST_REFUSED : PD_KVX_ST_OK;
    if (m->id == PD_KVX_AM_GET_META) {
        if (status == PD_KVX_ST_OK && l->claimed)
            status = PD_KVX_ST_REFUSED;
        if (status == PD_KVX_ST_OK) {
            /* the claimed lease gets a fresh term so a slow transfer is not cut off mid-way */
            l->claimed = 1;
            l->claim_tag = tag;
            l->deadline = now + x->lease_ns;
        }
        send_meta(x, m->reply_ep, status, tag, status == PD_KVX_ST_OK ? l : NULL);
        return;
    }
    /* DONE needs the claim; ABORT may come before META (a consumer giving up early) */
    if (status == PD_KVX_ST_OK && (l->claimed ? l->claim_tag != tag : m->id == PD_KVX_AM_DONE))
        status = PD_KVX_ST_REFUSED;
    if (status == PD_KVX_ST_OK)
        kvx_lease_release(x, l, m->id == PD_KVX_AM_DONE ? PD_KVX_REL_DONE : PD_KVX_REL_ABORT);
    send_ack(x, m->reply_ep, status, tag, m->id);
}


/* The KV listener: how a consumer learns a producer's UCP worker address (kvxfer.h, "Transports").
 *
 * The producer listens on host:port with a plain TCP socket of its own and, to every connection
 * it accepts, writes one HELLO and closes it:
 *   HELLO  p->c  u8 magic[8] = "PDMOEKV\x03", u32 addr_len (1 .. KVX_HELLO_ADDR_MAX),
 *                addr_len bytes of its UCP worker address                   (12 B + addr)
 * It reads nothing from the connection and keeps no state for it, so whatever a stray client sends
 * (a port scanner, an HTTP probe) is never parsed and cannot hold anything open. (UCX 1.13's own
 * socket-address listener, used before, aborted the whole process on 64 stray bytes: an assertion
 * in its TCP connection manager, tcp_sockcm_ep.c.)
 *
 * The consumer connects without blocking, reads the HELLO as it arrives (from the progress loop,
 * step() in kvx_progress.c), checks it and creates its endpoint from the address; transfers that
 * wait on the link send their GET_META then. A peer that never answers is covered by the
 * transfers' deadline; one that answers something else fails them with the reason. */
#define _GNU_SOURCE   /* accept4 */
#include "pd/kvx_internal.h"

#include <unistd.h>

static const uint8_t hello_magic[8] = {'P', 'D', 'M', 'O', 'E', 'K', 'V', KVX_VERSION};

/* Accepted connections answered per progress round (the rest wait in the backlog). */
#define HELLOS_PER_ROUND 64

int kvx_boot_listen(struct pd_kvx *x, const char *host, int port, pd_err *e)
{
    struct sockaddr_storage ss;
    socklen_t sl;
    int rc = kvx_resolve(host, port, 1, &ss, &sl, e);
    if (rc)
        return rc;
    /* the HELLO, made once: every connection gets the same bytes */
    if (!(x->hello = malloc(12 + x->addr_len)))
        return pd_err_set(e, PD_ENOMEM, "kvxfer: no memory");
    memcpy(x->hello, hello_magic, 8);
    put32(x->hello + 8, (uint32_t)x->addr_len);
    memcpy(x->hello + 12, x->addr, x->addr_len);
    x->hello_len = 12 + x->addr_len;
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0), one = 1;
    /* a port a previous process left in TIME_WAIT binds again, as a server restarted at once does */
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0 ||
        bind(fd, (struct sockaddr *)&ss, sl) < 0 || listen(fd, 128) < 0) {
        int err = errno;
        if (fd >= 0)
            close(fd);
        return pd_err_set(e, PD_EIO, "kvxfer: cannot listen on %s:%d: %s", host, port, strerror(err));
    }
    struct sockaddr_storage la;
    socklen_t ll = sizeof la;
    if (getsockname(fd, (struct sockaddr *)&la, &ll) < 0) {
        int err = errno;
        close(fd);
        return pd_err_set(e, PD_EIO, "kvxfer: getsockname on the KV listener: %s", strerror(err));
    }
    x->port = ntohs(la.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&la)->sin6_port
                                             : ((struct sockaddr_in *)&la)->sin_port);
    x->lfd = fd;
    return 0;
}

int kvx_boot_serve(struct pd_kvx *x)
{
    if (x->lfd < 0)
        return 0;
    int served = 0;
    for (; served < HELLOS_PER_ROUND; served++) {
        int c = accept4(x->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c < 0)
            break;   /* EAGAIN: none left; anything else (EMFILE, a reset): the next round */
        /* a few hundred bytes into an empty socket buffer: whole, or the consumer sees it short */
        ssize_t w = send(c, x->hello, x->hello_len, MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)w;
        close(c);
    }
    return served;
}

void kvx_boot_close(struct link *l)
{
    if (l->bfd >= 0)
        close(l->bfd);
    l->bfd = -1;
    free(l->hello);
    l->hello = NULL;
    free(l->deferred);
    l->deferred = NULL;
    l->n_deferred = 0;
}

void kvx_link_free(struct link *l)
{
    kvx_boot_close(l);
    free(l->paddr);
    free(l);
}

int kvx_boot_defer_abort(struct link *l, const struct pd_kvx_xfer *t)
{
    struct kvx_deferred *d = realloc(l->deferred, (size_t)(l->n_deferred + 1) * sizeof *d);
    if (!d)
        return -1;
    l->deferred = d;
    d[l->n_deferred++] = (struct kvx_deferred){.key = t->key, .tag = t->tag};
    return 0;
}

int kvx_boot_connect(struct link *l, const struct sockaddr *sa, socklen_t len)
{
    int fd = socket(sa->sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    if (connect(fd, sa, len) < 0 && errno != EINPROGRESS) {
        int err = errno;
        close(fd);
        return -err;
    }
    if (!(l->hello = malloc(12 + KVX_HELLO_ADDR_MAX))) {
        close(fd);
        return -ENOMEM;
    }
    l->bfd = fd;
    l->hello_have = 0;
    l->hello_by = pd_now_ns() + KVX_HELLO_NS;
    return 0;
}

/* Fails every unfinished transfer waiting on l's HELLO, and the link. */
static void boot_fail(struct pd_kvx *x, struct link *l, ucs_status_t st, const char *fmt, ...)
{
    char why[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    kvx_boot_close(l);
    l->failed = 1;
    l->status = st;
    if (l->ep)   /* a check of a kept link: its endpoints close and its transfers move (step 3) */
        return;
    for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next)
        if (t->peer == l && !kvx_is_final(t->state))
            kvx_xfer_fail(t, PD_EIO, 0, "%s", why);
}

/* Reads what has arrived of l's HELLO; once whole, makes the endpoint and sends the waiting
 * transfers' GET_META. Returns 1 if anything happened. */
static int boot_read(struct pd_kvx *x, struct link *l)
{
    for (;;) {
        size_t want = l->hello_have < 12 ? 12 : 12 + get32(l->hello + 8);
        ssize_t r = recv(l->bfd, l->hello + l->hello_have, want - l->hello_have, 0);
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
            return 0;
        if (r < 0) {
            boot_fail(x, l, UCS_ERR_UNREACHABLE, "cannot connect: %s", strerror(errno));
            return 1;
        }
        if (r == 0) {
            boot_fail(x, l, UCS_ERR_UNREACHABLE,
                      "the KV port closed the connection after %zu bytes, before a whole HELLO "
                      "(not a pdmoe KV listener, or one of another version?)", l->hello_have);
            return 1;
        }
        l->hello_have += (size_t)r;
        if (l->hello_have == 12) {
            uint32_t n = get32(l->hello + 8);
            if (memcmp(l->hello, hello_magic, 8) != 0) {
                boot_fail(x, l, UCS_ERR_INVALID_PARAM,
                          memcmp(l->hello, hello_magic, 7) == 0
                              ? "the KV port speaks protocol version %d, this engine %d"
                              : "the KV port's first bytes are not a pdmoe KV HELLO (wrong port?)",
                          l->hello[7], KVX_VERSION);
                return 1;
            }
            if (n == 0 || n > KVX_HELLO_ADDR_MAX) {   /* the right magic: a broken or hostile peer */
                boot_fail(x, l, UCS_ERR_INVALID_PARAM, "the KV port's HELLO gives a worker address of %u bytes "
                          "(1 to %d)", n, KVX_HELLO_ADDR_MAX);
                return 1;
            }
            continue;
        }
        if (l->hello_have < 12 || l->hello_have < want)
            continue;
        const size_t alen = l->hello_have - 12;
        /* UCX asserts (aborting the process) on an address of another format: its version, the
         * low four bits of the first byte, must be ours (a producer on another UCX release, or
         * bytes that are no address) */
        if ((l->hello[12] & 0x0f) != (((const uint8_t *)x->addr)[0] & 0x0f)) {
            boot_fail(x, l, UCS_ERR_UNSUPPORTED,
                      "the producer's worker address is of UCX address version %d, this engine's %d "
                      "(another UCX release, or not an address)", l->hello[12] & 0x0f,
                      ((const uint8_t *)x->addr)[0] & 0x0f);
            return 1;
        }
        if (l->ep) {   /* a check of a kept link: the same worker still listens there? */
            if (alen == l->paddr_len && memcmp(l->hello + 12, l->paddr, alen) == 0) {
                kvx_boot_close(l);
                l->heard_ns = pd_now_ns();
            }
            else
                boot_fail(x, l, UCS_ERR_CONNECTION_RESET, "the producer restarted");
            return 1;
        }
        /* whole: the endpoint from the address (read only during ucp_ep_create) */
        ucp_ep_params_t p = {
            .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                          UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
            .address = (const ucp_address_t *)(l->hello + 12),
            .err_mode = UCP_ERR_HANDLING_MODE_PEER,
            .err_handler = {.cb = kvx_ep_error, .arg = l},
        };
        ucs_status_t st = ucp_ep_create(x->w, &p, &l->ep);
        if (st != UCS_OK) {
            l->ep = NULL;
            boot_fail(x, l, st, "cannot connect to the producer's worker: %s", ucs_status_string(st));
            return 1;
        }
        for (int i = 0; i < l->n_deferred; i++) {
            kvx_send_small(x, l->ep, PD_KVX_AM_GET_META, &l->deferred[i].key, l->deferred[i].tag);
            kvx_send_small(x, l->ep, PD_KVX_AM_ABORT, &l->deferred[i].key, l->deferred[i].tag);
        }
        l->heard_ns = pd_now_ns();
        if ((l->paddr = malloc(alen))) {
            memcpy(l->paddr, l->hello + 12, alen);
            l->paddr_len = alen;
        }
        kvx_boot_close(l);
        for (struct pd_kvx_xfer *t = x->xfers; t; t = t->next)
            if (t->peer == l && !kvx_is_final(t->state) && !t->meta_sent)
                kvx_xfer_send_get_meta(x, t);
        return 1;
    }
}

int kvx_boot_progress(struct pd_kvx *x)
{
    int n = 0;
    const int64_t now = pd_now_ns();
    for (struct link *l = x->links; l; l = l->next) {
        if (l->bfd < 0 || l->failed)
            continue;
        n += boot_read(x, l);
        if (l->bfd >= 0 && !l->failed && now >= l->hello_by) {
            boot_fail(x, l, UCS_ERR_TIMED_OUT, "no HELLO from the KV port within %lld s (a host gone dark, or "
                      "not a pdmoe KV listener)", KVX_HELLO_NS / 1000000000LL);
            n++;
        }
    }
    return n;
}

int kvx_boot_fds(struct pd_kvx *x, struct pollfd *fds, int max)
{
    int n = 0;
    if (x->lfd >= 0 && n < max)
        fds[n++] = (struct pollfd){.fd = x->lfd, .events = POLLIN};
    for (struct link *l = x->links; l; l = l->next)
        if (l->bfd >= 0 && !l->failed) {
            if (n == max)
                return -1;
            fds[n++] = (struct pollfd){.fd = l->bfd, .events = POLLIN};
        }
    return n;
}

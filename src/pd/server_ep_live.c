/* An EP group's rank deaths, known to rank 0 at once: every other rank holds a TCP connection to
 * rank 0, made when the group starts, and rank 0's rank watch thread sleeps in poll() on them. A
 * rank that dies (SIGKILL, a crash, the OOM killer, an error that ends it) has its kernel close
 * the connection, on its host, whichever host that is; rank 0 reads the end (EOF, or a reset)
 * without a byte of farewell and holds the group dead from then on: /readiness and /health are
 * 503s naming the rank, a new completion is a 503 naming it, every client waiting is answered
 * (streams: an error event, then [DONE]), and the process exits 70 with a line naming it, so that
 * mpirun ends the group and `pdmoe up` starts it again.
 *
 * Why not MPI: Open MPI 4.1 reports no error for a peer gone from shared memory (the round's
 * waits never return), and mpirun tells rank 0 by its SIGTERM only, 1.0 s after the death
 * (odls_base_sigkill_timeout): a second during which /health said ok and requests were taken for
 * a group that could not finish them. A pidfd would serve one host only.
 *
 * The handshake (pd_srv_ep_live_open, collective, at the group's start): rank 0 listens on an
 * ephemeral port of its --host (127.0.0.1 for a wildcard when the whole group is on its host; the
 * wildcard with its host name advertised when ranks are elsewhere), broadcasts the address, the
 * port and a random 64-bit token over MPI; each rank connects and sends its hello {token, rank,
 * pid, host}; rank 0 accepts one hello per rank (a connection with another token is closed: not
 * the group's), and closes the listener. Nothing listens after that. A rank's normal end (rank 0
 * broadcast the group's end) sends one byte, LIVE_BYE, before its connection closes.
 *
 * The same connections, the other way: idle ranks block, and watch rank 0. A rank other than 0
 * between rounds (pd_srv_ep_live_wait) tests the next round's broadcast and sleeps in ppoll() on
 * its connection, 10 us doubling to 2 ms, while rank 0 is busy (a decode step's next round comes
 * within microseconds: no syscall is added to it); but once rank 0's scheduler is about to wait
 * for work (pd_srv_ep_live_idle: before its untimed wait, one of 20 or 100 ms, or the 1 ms between
 * the rounds that hear of the owner ranks' KV pulls) it writes
 * LIVE_IDLE to every rank, and a rank that reads it sleeps in poll() with no timeout until
 * LIVE_WAKE, which rank 0 writes right after posting the broadcast of its next round
 * (pd_srv_ep_live_wake). Rank 0 writes IDLE and WAKE in turn from its scheduler thread, before
 * and after the broadcast, and a rank sleeps only when the last byte it read is IDLE: a WAKE is
 * then still to come (before it rank 0 posts no broadcast), so no rank sleeps through a round.
 * An idle group's ranks use no CPU (the loop of tests before: 500 wake-ups a second, about 1% of a
 * core each), and the first round after idle is taken at once (it waited up to 2 ms). A rank
 * whose connection to rank 0 ends (EOF, a reset) while it waits knows rank 0 is gone (killed,
 * crashed) and fails at once with a line naming rank 0 (its pid and host), rather than waiting for
 * mpirun's signals; unless rank 0 was not idle and the round's broadcast completes within 50 ms
 * after all: rank 0's normal end is the STOP round, woken like any other, and a rank stopped or
 * slow meanwhile reads its WAKE and its close at once (live_round_posted). A rank in a round (an MPI wait of the MoE exchange or of the
 * round's collectives) watches the same connection once its wait sleeps (pd_ep_watch: ppoll() on
 * the connection's end in place of nanosleep(); the spin of a fast exchange adds no syscall) and,
 * at its end, writes the same line and exits 70 where it is: its MPI requests cannot be finished
 * or cancelled without rank 0, and mpirun's SIGKILL came 2 s later. The watch is set once the
 * handshake is done, and cleared at the STOP round (rank 0's normal end closes the connection
 * then) and before the connection is closed. */
#define _GNU_SOURCE   /* accept4, pipe2 */
#include "pd/server_int.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>

#define LIVE_BYE 'B'             /* rank k to rank 0: this rank's end is the group's */
#define LIVE_IDLE 'I'            /* rank 0 to rank k: rank 0 waits for work; sleep until LIVE_WAKE */
#define LIVE_WAKE 'W'            /* rank 0 to rank k: the next round's broadcast is posted */
#define LIVE_DRAIN_ROUNDS 256    /* a rank reads its connection at least this often (see live_take) */
#define LIVE_CONNECT_MS 10000   /* a rank's connect to rank 0, and rank 0's wait for every hello */
#define LIVE_HELLO_MS 2000      /* an accepted connection's hello */

struct live_hello {              /* a rank to rank 0, once; integers in network order */
    uint32_t token[2];
    uint32_t rank, pid;
    char host[64];
};

struct live_ad {                 /* rank 0 to every rank, over MPI */
    char host[256];
    int32_t port;
    uint32_t token[2];
    int32_t ok;                  /* rank 0 listens (else every rank fails with its error) */
    int32_t pid;                 /* rank 0's, and its host name: a rank names it when it is gone */
    char name[64];
};

/* Rank k's signal handler writes to this pipe (g->wake[1]) to wake its wait between rounds: the
 * signal may be taken by any of the process's threads, and only the waiting one would see EINTR. */
static volatile sig_atomic_t ep_signalled;
static volatile sig_atomic_t live_sig_fd = -1;

void pd_srv_ep_on_signal(int sig)
{
    ep_signalled = 1;
    int saved = errno, fd = live_sig_fd;
    if (fd >= 0 && write(fd, "s", 1) < 0) {
        /* (full: a wake-up is pending already) */
    }
    errno = saved;
}

static int is_wildcard(const char *h)
{
    return !h || !*h || !strcmp(h, "0.0.0.0") || !strcmp(h, "::") || !strcmp(h, "[::]");
}

/* Rank 0: a listener on host, port 0; its fd or a negative error. */
static int live_listen(const char *host, int backlog, int *port, pd_err *e)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV},
                    *res = NULL;
    int gr = getaddrinfo(is_wildcard(host) ? NULL : host, "0", &hints, &res);
    if (gr)
        return pd_err_set(e, PD_EINVAL, "expert parallelism: rank 0's address %s for its ranks' connections: %s",
                          host, gai_strerror(gr));
    int fd = -1, err = 0;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd >= 0 && (bind(fd, a->ai_addr, a->ai_addrlen) || listen(fd, backlog))) {
            err = errno;
            close(fd);
            fd = -1;
        }
        if (fd < 0 && !err)
            err = errno;
    }
    freeaddrinfo(res);
    if (fd < 0)
        return pd_err_set(e, PD_EIO, "expert parallelism: rank 0 cannot listen on %s for its ranks' connections: %s",
                          host, strerror(err));
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(fd, (struct sockaddr *)&ss, &sl);
    *port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                           : ((struct sockaddr_in *)&ss)->sin_port);
    return fd;
}

/* Waits for fd to be ready for `events` until `deadline` (pd_now_ns); 0 when it is. */
static int live_wait(int fd, short events, int64_t deadline)
{
    for (;;) {
        int64_t left = deadline - pd_now_ns();
        if (left <= 0)
            return -1;
        struct pollfd p = {.fd = fd, .events = events};
        int n = poll(&p, 1, (int)(left / 1000000) + 1);
        if (n > 0)
            return 0;
        if (n < 0 && errno != EINTR)
            return -1;
    }
}

/* Rank k: its connection to rank 0, the hello sent; the fd or a negative error. */
static int live_connect(struct pd_server *s, const struct live_ad *ad, pd_err *e)
{
    struct ep_group *g = s->g;
    char port[16];
    snprintf(port, sizeof port, "%d", ad->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV}, *res = NULL;
    int gr = getaddrinfo(ad->host, port, &hints, &res);
    if (gr)
        return pd_err_set(e, PD_EIO, "expert parallelism: rank %d cannot resolve rank 0's address %s: %s", g->rank,
                          ad->host, gai_strerror(gr));
    const int64_t deadline = pd_now_ns() + (int64_t)LIVE_CONNECT_MS * 1000000;
    int fd = -1, err = ETIMEDOUT;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
        if (fd < 0) {
            err = errno;
            continue;
        }
        int rc = connect(fd, a->ai_addr, a->ai_addrlen);
        if (rc && errno == EINPROGRESS) {
            socklen_t el = sizeof err;
            if (live_wait(fd, POLLOUT, deadline))
                err = ETIMEDOUT;
            else if (!getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) && !err)
                rc = 0;
        } else if (rc) {
            err = errno;
        }
        if (rc) {
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd < 0)
        return pd_err_set(e, PD_EIO, "expert parallelism: rank %d cannot connect to rank 0 at %s port %d (the "
                          "connection that tells rank 0 of this rank's death): %s", g->rank, ad->host, ad->port,
                          strerror(err));
    struct live_hello h = {.token = {htonl(ad->token[0]), htonl(ad->token[1])}, .rank = htonl((uint32_t)g->rank),
                           .pid = htonl((uint32_t)getpid())};
    gethostname(h.host, sizeof h.host - 1);
    size_t off = 0;
    while (off < sizeof h) {
        ssize_t n = send(fd, (char *)&h + off, sizeof h - off, MSG_NOSIGNAL);
        if (n > 0)
            off += (size_t)n;
        else if ((n < 0 && errno != EAGAIN && errno != EINTR) || live_wait(fd, POLLOUT, deadline))
            break;
    }
    if (off < sizeof h) {
        close(fd);
        return pd_err_set(e, PD_EIO, "expert parallelism: rank %d cannot send its hello to rank 0 at %s port %d",
                          g->rank, ad->host, ad->port);
    }
    return fd;
}

/* Rank 0: one connection's hello, whole, by the deadline; 0 when it came. */
static int live_read_hello(int fd, struct live_hello *h, int64_t deadline)
{
    size_t off = 0;
    while (off < sizeof *h) {
        if (live_wait(fd, POLLIN, deadline))
            return -1;
        ssize_t n = recv(fd, (char *)h + off, sizeof *h - off, 0);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
            return -1;
        if (n > 0)
            off += (size_t)n;
    }
    h->host[sizeof h->host - 1] = 0;
    return 0;
}

/* Rank 0: every other rank's connection, by their hellos. */
static int live_accept(struct pd_server *s, int lfd, const struct live_ad *ad, pd_err *e)
{
    struct ep_group *g = s->g;
    const int64_t deadline = pd_now_ns() + (int64_t)LIVE_CONNECT_MS * 1000000;
    int have = 0;
    while (have < g->size - 1) {
        if (live_wait(lfd, POLLIN, deadline))
            break;
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0)
            continue;
        /* a rank sends its hello as it connects: a connection silent for LIVE_HELLO_MS (not the
         * group's) is closed, rather than holding the others' accept to the deadline */
        const int64_t hello_by = pd_now_ns() + (int64_t)LIVE_HELLO_MS * 1000000;
        struct live_hello h;
        int k = -1;
        if (!live_read_hello(fd, &h, hello_by < deadline ? hello_by : deadline) && ntohl(h.token[0]) == ad->token[0] &&
            ntohl(h.token[1]) == ad->token[1])
            k = (int)ntohl(h.rank);
        if (k < 1 || k >= g->size || g->peers[k].fd >= 0) {
            close(fd);   /* not one of the group's (or a rank twice) */
            continue;
        }
        g->peers[k].fd = fd;
        g->peers[k].pid = (int)ntohl(h.pid);
        snprintf(g->peers[k].host, sizeof g->peers[k].host, "%s", h.host);
        have++;
    }
    for (int k = 1; k < g->size; k++)
        if (g->peers[k].fd < 0)
            return pd_err_set(e, PD_EIO, "expert parallelism: rank %d did not connect to rank 0 (%s port %d) within "
                              "%d s", k, ad->host, ad->port, LIVE_CONNECT_MS / 1000);
    return 0;
}

/* Rank k, in a round's wait (pd_ep_watch): its connection to rank 0 ended. The line of
 * pd_srv_ep_live_wait's error, then the exit serve makes for it (70): nothing can be ended in
 * order from inside MPI's wait. */
static void rank0_gone_in_round(void *arg)
{
    const struct ep_group *g = arg;
    fprintf(stderr, "pdmoe serve (EP group): expert parallelism: rank %d: rank 0 (pid %d on %s) is gone: its "
            "connection to this rank closed during a round; this rank ends too\n", g->rank, g->rank0_pid,
            g->rank0_host);
    _exit(70);
}

int pd_srv_ep_live_open(struct pd_server *s, pd_err *e)
{
    struct ep_group *g = s->g;
    if (g->size < 2)
        return 0;
    struct live_ad ad = {0};
    int lfd = -1, rc = 0;
    if (g->rank == 0) {
        if (!(g->peers = calloc((size_t)g->size, sizeof *g->peers)))
            return pd_err_set(e, PD_ENOMEM, "out of memory");
        for (int k = 0; k < g->size; k++)
            g->peers[k].fd = -1;
        /* the address the ranks reach: --host; for a wildcard, loopback when every rank is on
         * this host, else this host's name (the listener on the wildcard) */
        const char *host = s->o.host;
        const int alone = g->local == g->size;
        if (is_wildcard(host) && alone)
            host = "127.0.0.1";
        if (is_wildcard(host))
            gethostname(ad.host, sizeof ad.host - 1);
        else
            snprintf(ad.host, sizeof ad.host, "%s", host);
        if (getrandom(ad.token, sizeof ad.token, 0) != (ssize_t)sizeof ad.token) {
            int64_t t = pd_now_ns();
            ad.token[0] = (uint32_t)t ^ (uint32_t)getpid();
            ad.token[1] = (uint32_t)(t >> 32);
        }
        ad.pid = (int32_t)getpid();
        gethostname(ad.name, sizeof ad.name - 1);
        lfd = live_listen(is_wildcard(host) ? NULL : host, g->size, &ad.port, e);
        ad.ok = lfd >= 0;
        if (lfd < 0)
            rc = lfd;
    }
    MPI_Bcast(&ad, (int)sizeof ad, MPI_BYTE, 0, g->ep.comm);
    if (!ad.ok)
        return g->rank ? pd_err_set(e, PD_EIO, "expert parallelism: rank 0 could not listen for its ranks' "
                                    "connections (its error says why)") : rc;
    int fd = -1;
    if (g->rank) {
        g->rank0_pid = ad.pid;
        snprintf(g->rank0_host, sizeof g->rank0_host, "%s", ad.name);
        if (pipe2(g->wake, O_CLOEXEC | O_NONBLOCK))
            fd = pd_err_set(e, PD_EIO, "expert parallelism: rank %d: a pipe for its signals: %s", g->rank, strerror(errno));
        else if ((fd = live_connect(s, &ad, e)) >= 0)
            g->live_fd = fd;
        if (g->wake[1] >= 0)
            live_sig_fd = g->wake[1];
    }
    /* every rank connected (into rank 0's backlog) before rank 0 accepts: a rank that could not
     * fails the whole group at once, rather than rank 0 waiting for it */
    int ok = g->rank == 0 || fd >= 0, all = 0;
    MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, g->ep.comm);
    if (!all) {
        if (lfd >= 0)
            close(lfd);
        return ok ? pd_err_set(e, PD_EIO, "expert parallelism: a rank could not connect to rank 0 at %s port %d "
                               "(its error says why)", ad.host, ad.port) : fd;
    }
    if (g->rank == 0) {
        rc = live_accept(s, lfd, &ad, e);
        close(lfd);
        if (rc)
            return rc;
    }
    if (g->rank && g->live_fd >= 0)
        pd_ep_watch(g->live_fd, rank0_gone_in_round, g);
    return 0;
}

/* The loop's thread, once a rank is dead: every client waiting is answered. */
static void on_rank_dead(evutil_socket_t fd, short what, void *arg)
{
    struct pd_server *s = arg;
    pd_srv_ep_answer_all(s, s->g->dead_why);
}

/* Rank 0: peer k's connection is readable or closed; 1 when it is gone (closed without a bye),
 * -1 when it ended normally, 0 while it is open. */
static int live_read(struct ep_peer *p)
{
    char buf[64];
    for (;;) {
        ssize_t n = recv(p->fd, buf, sizeof buf, 0);
        if (n > 0) {
            if (memchr(buf, LIVE_BYE, (size_t)n))
                p->bye = 1;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        return p->bye ? -1 : 1;   /* EOF, or a reset: the kernel closed it for the process */
    }
}

/* Rank 0's rank watch thread: asleep in poll() on the ranks' connections (and the wake pipe that
 * stops it), no timeout: an idle group costs nothing. */
static void *live_watch(void *arg)
{
    struct pd_server *s = arg;
    struct ep_group *g = s->g;
    struct pollfd *pf = calloc((size_t)g->size + 1, sizeof *pf);
    int *who = calloc((size_t)g->size + 1, sizeof *who);
    if (!pf || !who) {
        fprintf(stderr, "pdmoe serve: out of memory for the EP rank watch thread: a rank's death is known to rank "
                        "0 only from mpirun's signal\n");
        free(pf);
        free(who);
        return NULL;
    }
    for (;;) {
        int n = 0;
        pf[n++] = (struct pollfd){.fd = g->wake[0], .events = POLLIN};
        for (int k = 1; k < g->size; k++)
            if (!g->peers[k].gone) {
                who[n] = k;
                pf[n++] = (struct pollfd){.fd = g->peers[k].fd, .events = POLLIN};
            }
        if (n == 1)
            break;   /* every rank ended normally */
        if (poll(pf, (nfds_t)n, -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (pf[0].revents)
            break;   /* stopped */
        int dead = -1;
        for (int i = 1; i < n && dead < 0; i++) {
            if (!pf[i].revents)
                continue;
            struct ep_peer *p = &g->peers[who[i]];
            int r = live_read(p);
            /* (its fd stays open until pd_srv_ep_live_close: the scheduler may still write a
             * LIVE_WAKE to it, which must not reach whatever file took the number) */
            p->gone |= r != 0;
            if (r > 0)
                dead = who[i];
        }
        if (dead < 0)
            continue;
        const struct ep_peer *p = &g->peers[dead];
        snprintf(g->dead_why, sizeof g->dead_why, "EP rank %d (pid %d on %s) died: the group cannot step and is "
                 "being ended so that it can be restarted", dead, p->pid, p->host);
        atomic_store(&g->dead_rank, dead);
        fprintf(stderr, "pdmoe serve: EP rank %d (pid %d on %s) died (its connection to rank 0 closed): answering "
                        "the clients and ending the group so that it can be restarted\n", dead, p->pid, p->host);
        fflush(stderr);
        /* the clients first (a moment for the loop to write their answers, /readiness a 503
         * meanwhile), then the exit: the scheduler may sit in a round that never returns, so
         * neither MPI_Finalize nor freeing the server can end it (as the watchdog does) */
        event_base_once(s->base, -1, EV_TIMEOUT, on_rank_dead, s, &(struct timeval){0, 0});
        pf[0] = (struct pollfd){.fd = g->wake[0], .events = POLLIN};
        if (poll(pf, 1, PD_EP_DEAD_EXIT_MS) > 0)
            break;   /* rank 0 is ending the group itself, and exits (pd_srv_ep_stop) */
        _exit(70);
    }
    free(pf);
    free(who);
    return NULL;
}

int pd_srv_ep_live_start(struct pd_server *s, pd_err *e)
{
    struct ep_group *g = s->g;
    if (g->rank || g->size < 2)
        return 0;
    if (pipe2(g->wake, O_CLOEXEC))
        return pd_err_set(e, PD_EIO, "expert parallelism: a pipe for the rank watch thread: %s", strerror(errno));
    int rc = pd_thread_start(&g->live_thread, live_watch, s, "EP rank watch thread", e);
    if (!rc)
        g->live_on = 1;
    return rc;
}

void pd_srv_ep_live_stop(struct pd_server *s)
{
    struct ep_group *g = s->g;
    if (!g || !g->live_on)
        return;
    char c = 0;
    if (write(g->wake[1], &c, 1) < 0)
        fprintf(stderr, "pdmoe serve: stopping the EP rank watch thread: %s\n", strerror(errno));
    pthread_join(g->live_thread, NULL);
    g->live_on = 0;
}

void pd_srv_ep_live_bye(struct pd_server *s)
{
    struct ep_group *g = s->g;
    char c = LIVE_BYE;
    if (g && g->live_fd >= 0 && send(g->live_fd, &c, 1, MSG_NOSIGNAL | MSG_DONTWAIT) != 1)
        fprintf(stderr, "pdmoe serve: EP rank %d: telling rank 0 of this rank's normal end: %s\n", g->rank,
                strerror(errno));
}

/* Rank 0's scheduler: one byte to every rank's connection. Never blocks: a rank reads its
 * connection at least every LIVE_DRAIN_ROUNDS rounds and rank 0 writes at most two bytes a round,
 * far below a socket's buffer; a dead rank's connection fails the send, which is no matter. */
static void live_tell(struct ep_group *g, char c)
{
    for (int k = 1; k < g->size; k++)
        if (send(g->peers[k].fd, &c, 1, MSG_NOSIGNAL | MSG_DONTWAIT) != 1 && !g->peers[k].gone && errno != EPIPE &&
            errno != ECONNRESET)
            fprintf(stderr, "pdmoe serve: telling EP rank %d that rank 0 %s: %s\n", k,
                    c == LIVE_IDLE ? "idles" : "has a round", strerror(errno));
}

void pd_srv_ep_live_idle(struct pd_server *s)
{
    struct ep_group *g = s->g;
    if (g->rank || !g->peers || g->told_idle)
        return;
    live_tell(g, LIVE_IDLE);
    g->told_idle = 1;
}

void pd_srv_ep_live_wake(struct pd_server *s)
{
    struct ep_group *g = s->g;
    if (g->rank || !g->told_idle)
        return;
    live_tell(g, LIVE_WAKE);
    g->told_idle = 0;
}

/* Rank k: what rank 0 wrote since the last read, all of it, without blocking: g->rank0_idle
 * follows the last IDLE or WAKE. 0, or -1 once the connection ended (rank 0 is gone). A rank that
 * takes a round's broadcast at its first test reads nothing in that round, so the bytes of rounds
 * taken that way are read every LIVE_DRAIN_ROUNDS rounds at least. */
static int live_take(struct ep_group *g)
{
    char buf[64];
    g->live_unread = 0;
    for (;;) {
        ssize_t n = recv(g->live_fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n > 0) {
            for (ssize_t i = 0; i < n; i++)
                if (buf[i] == LIVE_IDLE || buf[i] == LIVE_WAKE)
                    g->rank0_idle = buf[i] == LIVE_IDLE;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        return -1;   /* EOF, or a reset: rank 0's kernel closed it for the process */
    }
}

/* Rank k, whose connection to rank 0 ended while it waited for round rq's broadcast, rank 0 not
 * idle (a WAKE, or no IDLE, before the close): 1 if that broadcast completes within LIVE_END_MS
 * after all, which is rank 0's normal end (it posts its STOP round's broadcast, writes its WAKE
 * and only then closes; a rank stopped or slow meanwhile reads the WAKE and the close at once, and
 * took it for rank 0's death: exit 70, and its group's stop a failure). 0: rank 0 is gone. */
#define LIVE_END_MS 50
static int live_round_posted(MPI_Request *rq)
{
    const int64_t until = pd_now_ns() + LIVE_END_MS * 1000000LL;
    do {
        int done = 0;
        if (MPI_Test(rq, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS)
            return 0;
        if (done)
            return 1;
        nanosleep(&(struct timespec){0, 100000}, NULL);
    } while (pd_now_ns() < until);
    return 0;
}

/* Rank k: the wait between rounds (what the top of the file says). A signal here waits for rank 0
 * to end the group, since rank 0 normally has it too, but not longer than 10 s (plus the
 * --shutdown-timeout that rank 0 may drain for). */
int pd_srv_ep_live_wait(struct pd_server *s, MPI_Request *rq, pd_err *e)
{
    struct ep_group *g = s->g;
    const int64_t limit_ns = (10 + (s->o.shutdown_timeout_s > 0 ? s->o.shutdown_timeout_s : 0)) * 1000000000LL;
    int64_t signalled_at = 0;
    long ns = 10000;
    if (g->live_fd >= 0 && ++g->live_unread >= LIVE_DRAIN_ROUNDS && live_take(g))
        goto gone;
    for (;;) {
        int done = 0;
        if (MPI_Test(rq, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS)
            return pd_err_set(e, PD_EIO, "expert parallelism: rank %d: the step broadcast failed", g->rank);
        if (done)
            return 0;
        if (ep_signalled && !signalled_at)
            signalled_at = pd_now_ns();
        const int64_t left = signalled_at ? signalled_at + limit_ns - pd_now_ns() : 0;
        if (signalled_at && left <= 0)
            return pd_err_set(e, PD_EIO, "expert parallelism: rank %d was signalled and rank 0 did not end the group "
                              "within %lld s", g->rank, (long long)(limit_ns / 1000000000));
        /* rank 0 busy: a short sleep, longer each time; rank 0 idle: until its WAKE (or the
         * signalled rank's deadline) */
        struct timespec ts = {0, ns}, *to = &ts;
        if (g->rank0_idle) {
            ts = (struct timespec){left / 1000000000, left % 1000000000};
            to = signalled_at ? &ts : NULL;
        }
        struct pollfd pf[2] = {{.fd = g->live_fd, .events = POLLIN}, {.fd = g->wake[0], .events = POLLIN}};
        int n = ppoll(pf, 2, to, NULL);
        if (n < 0 && errno != EINTR)
            return pd_err_set(e, PD_EIO, "expert parallelism: rank %d: waiting for rank 0's round: %s", g->rank,
                              strerror(errno));
        if (n > 0 && pf[1].revents) {
            char buf[16];
            while (read(g->wake[0], buf, sizeof buf) > 0)
                ;
        }
        if (n > 0 && pf[0].revents) {
            if (live_take(g))
                goto gone;
            if (!g->rank0_idle)
                ns = 10000;   /* woken: the round's broadcast is posted */
        } else if (n == 0 && !g->rank0_idle) {
            ns = ns < 2000000 ? ns * 2 : 2000000;
        }
    }
gone:
    /* rank 0's last byte an IDLE: no round was posted before the close, which is its death at once;
     * else its round may have come before the close: STOP, or a round whose waits see the close */
    if (!g->rank0_idle && live_round_posted(rq))
        return 0;
    g->rank0_gone = 1;
    return pd_err_set(e, PD_EIO, "expert parallelism: rank %d: rank 0 (pid %d on %s) is gone: its connection to this "
                      "rank closed without ending the group; this rank ends too", g->rank, g->rank0_pid, g->rank0_host);
}

void pd_srv_ep_live_close(struct pd_server *s)
{
    struct ep_group *g = s->g;
    live_sig_fd = -1;
    if (g->live_fd >= 0)
        pd_ep_watch(-1, NULL, NULL);
    pd_srv_ep_live_stop(s);
    for (int k = 0; g->peers && k < g->size; k++)
        if (g->peers[k].fd >= 0)
            close(g->peers[k].fd);
    free(g->peers);
    g->peers = NULL;
    if (g->live_fd >= 0)
        close(g->live_fd);
    for (int i = 0; i < 2; i++)
        if (g->wake[i] >= 0)
            close(g->wake[i]);
    g->live_fd = g->wake[0] = g->wake[1] = -1;
}

int pd_srv_ep_dead_rank(const struct pd_server *s)
{
    return s->g ? atomic_load(&s->g->dead_rank) : -1;
}

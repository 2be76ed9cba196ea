/* An EP group's life (see server.h, "Expert parallelism"): opening it over MPI_COMM_WORLD, the
 * check that every rank loaded the same model, its buffers, its end; and its liveness: how long
 * rank 0's round has gone without progress, the watchdog that ends a stalled group, and rank 0's
 * stop, which answers the clients when a rank is gone (a rank's death itself is known from its
 * connection, server_ep_live.c). The rounds themselves are server_ep.c's. */
#include "core/threadpool.h"
#include "pd/server_int.h"
#include "core/grow.h"

/* How long rank 0's round in flight has gone without progress, in ns (0 between rounds): since
 * the later of its start and its last MoE exchange. Every layer of a step exchanges with every
 * rank, so a rank stopped (SIGSTOP, a debugger) or hung stops the others at the next layer, while
 * a long round (a long prompt's prefill) goes on exchanging. */
int64_t pd_srv_ep_stalled_ns(const struct pd_server *s)
{
    struct ep_group *g = s->g;
    int64_t t0 = g ? atomic_load(&g->round_t0) : 0;
    if (!t0)
        return 0;
    int64_t x = atomic_load(&g->ep.exchanged_ns);
    int64_t since = x > t0 ? x : t0, now = pd_now_ns();
    return now > since ? now - since : 0;
}

/* The loop's thread, when the group is ended with its scheduler stuck in a round: every client
 * still waiting gets an error event and [DONE], or a 503, saying `why`, instead of a connection
 * cut by the exit (twice is harmless: an answered request has no connection left). */
void pd_srv_ep_answer_all(struct pd_server *s, const char *why)
{
    size_t n = 0, cap = 0;
    struct req **rs = NULL;
    pthread_mutex_lock(&s->mu);
    for (struct req *r = s->live; r; r = r->live_next)
        if (r->http && !PD_GROW(rs, cap, n + 1)) {
            r->refs++;   /* (kept while answered outside the lock) */
            rs[n++] = r;
        }
    pthread_mutex_unlock(&s->mu);
    for (size_t i = 0; i < n; i++)
        if (rs[i]->http)
            pd_srv_answer_ending(s, rs[i], why);
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < n; i++)
        pd_srv_req_unref(s, rs[i]);
    pthread_mutex_unlock(&s->mu);
    free(rs);
}

/* The event loop, when the watchdog ends the group (the scheduler is stuck in the round, the
 * loop is not). */
static void on_stalled(evutil_socket_t fd, short what, void *arg)
{
    pd_srv_ep_answer_all(arg, "the EP group made no progress (a rank stopped or hung) and is being ended so that it "
                       "can be restarted");
}

/* Rank 0's watchdog: a round of the group waits on every rank (each MPI wait and MoE exchange has
 * no deadline), so one rank stopped or hung held every request for ever while /health said ok. A
 * round without progress for watchdog_s ends this process with a line saying so: mpirun then ends
 * the group, `pdmoe up` starts it again, and the proxy fails its requests (its /health is a 503
 * from PD_EP_STALL_HEALTH_S on: the proxy routes around it at once). It once timed the whole
 * round (300 s by default): a stopped rank held 174 requests for 5 minutes, and a long round
 * that progressed would have been ended. */
static void *watchdog(void *arg)
{
    struct pd_server *s = arg;
    struct ep_group *g = s->g;
    const int64_t limit = (int64_t)s->o.watchdog_s * 1000000000;
    while (!atomic_load(&g->watchdog_stop)) {
        nanosleep(&(struct timespec){0, 200000000}, NULL);
        if (pd_srv_ep_stalled_ns(s) > limit) {
            fprintf(stderr, "pdmoe serve: the EP group's round has made no progress for %d s (a rank stopped or "
                            "hung; --watchdog-timeout): ending the group so that it can be restarted\n",
                    s->o.watchdog_s);
            fflush(stderr);
            /* the clients first (a moment for the loop to write their answers), then the exit */
            if (s->base)
                event_base_once(s->base, -1, EV_TIMEOUT, on_stalled, s, &(struct timeval){0, 0});
            nanosleep(&(struct timespec){0, 500000000}, NULL);
            _exit(70);
        }
    }
    return NULL;
}

/* Rank 0 stopping (the loop ended: SIGTERM, SIGINT, a drain that ended): the scheduler ends its
 * round and the group (pd_server_destroy then joins it). A rank that died cannot end it: Open
 * MPI 4.1 reports no error for a peer gone from shared memory, and the round's waits never
 * return. That is how a rank dies under mpirun: measured with a rank SIGKILLed, mpirun sent
 * rank 0 SIGCONT 3 ms later, SIGTERM after 1.0 s and SIGKILL after 2.0 s
 * (odls_base_sigkill_timeout apart); rank 0 waited on the scheduler, which sat in the round, and
 * the SIGKILL cut every client (curl: an empty reply, a stream without its end). So once the round
 * in flight has made no progress for PD_EP_STOP_STALL_MS (already true at that SIGTERM: the round
 * stopped with the rank), the clients get the watchdog's honest ending, the loop a moment to
 * write it, and the process ends here (as the watchdog does: MPI_Abort, MPI_Finalize or freeing
 * the server would race with or wait on the stuck thread), non-zero: the group is to be
 * restarted. */
void pd_srv_ep_stop(struct pd_server *s)
{
    struct ep_group *g = s->g;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    while (s->thread_started && !atomic_load(&g->scheduler_done)) {
        if (pd_srv_ep_dead_rank(s) >= 0) {
            /* the rank watch thread said so and answers them too: this ends the group sooner */
            pd_srv_ep_answer_all(s, g->dead_why);
            event_base_loopexit(s->base, &(struct timeval){0, 200000});
            event_base_dispatch(s->base);
            _exit(70);
        }
        const int64_t stalled = pd_srv_ep_stalled_ns(s);
        if (stalled > (int64_t)PD_EP_STOP_STALL_MS * 1000000) {
            fprintf(stderr, "pdmoe serve: stopping, the EP group's round has made no progress for %.1f s (a rank "
                            "died or stopped): answering the clients and ending the group so that it can be "
                            "restarted\n", (double)stalled * 1e-9);
            fflush(stderr);
            pd_srv_ep_answer_all(s, "the EP group cannot step (a rank died or stopped) and is being ended so that it can "
                             "be restarted");
            /* (the answers are written by the loop, at most 200 ms: mpirun's SIGKILL is near) */
            event_base_loopexit(s->base, &(struct timeval){0, 200000});
            event_base_dispatch(s->base);
            _exit(70);
        }
        nanosleep(&(struct timespec){0, 10000000}, NULL);
    }
}

/* An EP group over MPI_COMM_WORLD: the expert placement, and the engine threads shared between
 * the ranks on one node unless told. */
int pd_srv_ep_open(struct pd_server *s, struct pd_engine_opts *eo, pd_err *e)
{
    int init = 0, level = 0;
    MPI_Initialized(&init);
    if (!init)
        return pd_err_set(e, PD_EINVAL, "expert parallelism needs MPI initialised (run under mpirun)");
    MPI_Query_thread(&level);
    if (level < MPI_THREAD_SERIALIZED)
        return pd_err_set(e, PD_EINVAL, "expert parallelism needs MPI_THREAD_SERIALIZED (the scheduler thread "
                          "makes the MPI calls)");
    struct ep_group *g = s->g = calloc(1, sizeof *g);
    if (!g)
        return pd_err_set(e, PD_ENOMEM, "out of memory");
    g->live_fd = g->wake[0] = g->wake[1] = -1;
    atomic_store(&g->dead_rank, -1);
    struct pd_model m;
    int rc;
    if ((rc = pd_model_load(s->o.model_dir, &m, e)) || (rc = pd_ep_init(&g->ep, MPI_COMM_WORLD, &m, e)))
        return rc;
    g->ep_ready = 1;
    g->rank = g->ep.rank;
    g->size = g->ep.size;
    eo->has_expert = g->ep.has_expert;
    MPI_Comm node;
    g->local = 1;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, g->rank, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
        MPI_Comm_size(node, &g->local);
        MPI_Comm_free(&node);
    }
    if (!eo->threads) {
        int cores = (int)sysconf(_SC_NPROCESSORS_ONLN);
        eo->threads = cores / g->local > 0 ? cores / g->local : 1;
    }
    return 0;
}

/* What every rank of a group must hold alike: the weights (their fingerprint) and the shapes the
 * exchange and the pools are built from. Ranks that each load "the same path" on their own host
 * may load other files there: a group of two seeds gave text of neither model, and of two
 * architectures, died at its first request (a dispatch no rank could read). */
struct rank_model {
    uint64_t fingerprint;
    int64_t vocab, hidden, layers, experts, blocks, slots;
    char host[64];
};

static int same_model_on_every_rank(struct pd_server *s, pd_err *e)
{
    struct ep_group *g = s->g;
    struct rank_model me = {.fingerprint = s->en.w.fingerprint, .vocab = s->en.model.vocab_size,
                            .hidden = s->en.model.hidden_size, .layers = s->en.model.n_layers,
                            .experts = s->en.model.n_routed_experts, .blocks = s->en.kv.n_blocks,
                            .slots = s->en.kv.n_slots};
    int len = 0;
    char name[MPI_MAX_PROCESSOR_NAME];
    MPI_Get_processor_name(name, &len);
    snprintf(me.host, sizeof me.host, "%.63s", name);
    struct rank_model *all = calloc((size_t)g->size, sizeof *all);
    if (!all)
        return pd_err_set(e, PD_ENOMEM, "out of memory");
    MPI_Allgather(&me, (int)sizeof me, MPI_BYTE, all, (int)sizeof me, MPI_BYTE, MPI_COMM_WORLD);
    int rc = 0;
    for (int k = 1; k < g->size && !rc; k++) {
        const struct rank_model *a = &all[0], *b = &all[k];
        const struct {
            const char *what;
            int64_t x, y;
        } f[] = {{"vocab_size", a->vocab, b->vocab},         {"hidden_size", a->hidden, b->hidden},
                 {"num_hidden_layers", a->layers, b->layers}, {"n_routed_experts", a->experts, b->experts},
                 {"KV blocks", a->blocks, b->blocks},         {"KV sequence slots", a->slots, b->slots}};
        for (size_t i = 0; i < sizeof f / sizeof f[0] && !rc; i++)
            if (f[i].x != f[i].y)
                rc = pd_err_set(e, PD_EINVAL, "--model %s: rank %d (on %s) has %s %lld where rank 0 (on %s) has %lld: "
                                "every rank of an EP group must load the same model and pool", s->o.model_dir, k,
                                b->host, f[i].what, (long long)f[i].y, a->host, (long long)f[i].x);
        if (!rc && a->fingerprint != b->fingerprint)
            rc = pd_err_set(e, PD_EINVAL, "--model %s: rank %d (on %s) holds other weights than rank 0 (on %s): "
                            "model fingerprints %016llx and %016llx; every rank of an EP group must load the same "
                            "checkpoint", s->o.model_dir, k, b->host, a->host, (unsigned long long)b->fingerprint,
                            (unsigned long long)a->fingerprint);
    }
    free(all);
    return rc;
}

/* The group's buffers, once the engine is open; rank 0 starts with every rank's pool full. */
int pd_srv_ep_setup(struct pd_server *s, pd_err *e)
{
    struct ep_group *g = s->g;
    const int n = s->o.max_num_seqs;
    int rc = same_model_on_every_rank(s, e);
    if (rc || (rc = pd_srv_ep_live_open(s, e)))
        return rc;
    if (s->o.watchdog_s == 0)
        s->o.watchdog_s = PD_EP_WATCHDOG_DEFAULT_S;
    if (g->rank == 0 && s->o.watchdog_s > 0) {
        if ((rc = pd_thread_start(&g->watchdog, watchdog, s, "EP group's watchdog thread", e)))
            return rc;
        g->watchdog_on = 1;
    }
    pd_ep_attach(&g->ep, &s->en);
    g->seqs = calloc((size_t)n, sizeof *g->seqs);
    g->items = calloc((size_t)n, sizeof *g->items);
    g->item_of = calloc((size_t)n, sizeof *g->item_of);
    g->item_seq = calloc((size_t)n, sizeof *g->item_seq);
    g->scratch = malloc((size_t)s->V * 2 * sizeof(float));
    g->load = calloc((size_t)g->size * 6, sizeof(int));
    g->released = calloc((size_t)n, sizeof *g->released);
    g->kv_hosts = calloc((size_t)g->size, sizeof *g->kv_hosts);
    g->pfx = calloc((size_t)g->size * EP_PFX_N, sizeof *g->pfx);
    pthread_mutex_init(&g->rel_mu, NULL);
    g->frees.width = EP_FREE_W;
    g->leases.width = EP_LEASE_W;
    g->pulls.width = EP_PULL_W;
    if (!g->seqs || !g->items || !g->item_of || !g->item_seq || !g->scratch || !g->load || !g->released ||
        !g->kv_hosts || !g->pfx ||
        PD_GROW(g->msg, g->msg_cap, EP_HDR))
        return pd_err_set(e, PD_ENOMEM, "out of memory");
    for (int i = 0; i < n; i++)
        if (!(g->seqs[i].logits = malloc((size_t)s->V * sizeof(float))))
            return pd_err_set(e, PD_ENOMEM, "out of memory");
    g->acct_blocks = g->load + g->size;
    g->free_blocks = g->load + 2 * g->size;
    g->free_slots = g->load + 3 * g->size;
    g->owned = g->load + 4 * g->size;
    g->kv_ports = g->load + 5 * g->size;
    g->last = g->size - 1;   /* the first sequence goes to rank 0 */
    for (int k = 0; k < g->size; k++) {
        g->acct_blocks[k] = g->free_blocks[k] = s->en.kv.n_blocks;
        g->free_slots[k] = s->en.kv.n_slots;
    }
    return 0;
}

void pd_srv_ep_close(struct pd_server *s)
{
    struct ep_group *g = s->g;
    if (!g)
        return;
    pd_srv_ep_live_close(s);
    if (g->watchdog_on) {
        atomic_store(&g->watchdog_stop, 1);
        pthread_join(g->watchdog, NULL);
        g->watchdog_on = 0;
    }
    for (int i = 0; g->seqs && i < s->o.max_num_seqs; i++) {
        if (g->seqs[i].used)
            pd_srv_ep_seq_end(s, &g->seqs[i]);
        free(g->seqs[i].logits);
    }
    free(g->seqs);
    free(g->items);
    free(g->item_of);
    free(g->item_seq);
    free(g->scratch);
    free(g->load);
    free(g->msg);
    free(g->ans);
    free(g->all);
    free(g->frees.w);
    free(g->leases.w);
    free(g->pulls.w);
    free(g->released);
    free(g->kv_hosts);
    free(g->pfx);
    pd_route_free(g->route);
    if (g->load)
        pthread_mutex_destroy(&g->rel_mu);
    if (g->ep_ready)
        pd_ep_free(&g->ep);
    free(g);
    s->g = NULL;
}
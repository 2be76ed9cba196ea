/* The EP group of an inference server (see server.h, "Expert parallelism"): the round message
 * rank 0 broadcasts, what every rank does with it, and rank 0's accounts of the ranks' sequences,
 * KV and leases. */
#include "pd/server_int.h"
#include "core/grow.h"

static uint64_t ep_id(const int32_t *w)
{
    return (uint64_t)(uint32_t)w[0] | (uint64_t)(uint32_t)w[1] << 32;
}

static void ep_put_id(int32_t *w, uint64_t id)
{
    w[0] = (int32_t)(uint32_t)id;
    w[1] = (int32_t)(uint32_t)(id >> 32);
}

static struct ep_seq *ep_find(struct pd_server *s, uint64_t id)
{
    for (int i = 0; i < s->o.max_num_seqs; i++)
        if (s->g->seqs[i].used && s->g->seqs[i].id == id)
            return &s->g->seqs[i];
    return NULL;
}

static void ep_parse(const int32_t *msg, struct ep_msg *m)
{
    m->n_free = msg[1];
    m->n_lease = msg[2];
    m->n_pull = msg[3];
    m->n_items = msg[4];
    m->n_tokens = msg[5];
    m->fr = msg + EP_HDR;
    m->ls = m->fr + (size_t)m->n_free * EP_FREE_W;
    m->pl = m->ls + (size_t)m->n_lease * EP_LEASE_W;
    m->it = m->pl + (size_t)m->n_pull * EP_PULL_W;
    m->tok = m->it + (size_t)m->n_items * EP_ITEM_W;
}

static size_t ep_msg_words(const int32_t *msg)
{
    struct ep_msg m;
    ep_parse(msg, &m);
    return (size_t)(m.tok - msg) + (size_t)m.n_tokens;
}

/* Where an answer's items start: after its header and the pulls that ended. */
#define EP_ITEMS_AT (EP_ANS_W + EP_PULLED_W * EP_PULLS_ENDED)

/* Words of each rank's answer to a message (the same on every rank: max_num_seqs is). */
static int ep_answer_words(const struct pd_server *s, const struct ep_msg *m)
{
    return EP_ITEMS_AT + m->n_items * pd_srv_ep_item_words(s) + 2 * s->o.max_num_seqs +
           (s->prefix_on ? EP_PREFIX_W : 0) + (s->o.spec_k ? EP_SPEC_W : 0);
}

/* Where the prefix cache's counts sit in an answer of `words` words (server_int.h). */
static size_t ep_prefix_at(const struct pd_server *s, int words)
{
    return (size_t)words - (s->o.spec_k ? EP_SPEC_W : 0) - EP_PREFIX_W;
}

/* A sequence this rank owned is over: its KV and its speculative state go. */
void pd_srv_ep_seq_end(struct pd_server *s, struct ep_seq *q)
{
    assert(!q->pull);   /* (a get could still write the blocks) */
    q->pulling = 0;
    if (q->cached)
        pd_prefix_release(&s->prefix, &q->pcur);
    q->cached = 0;
    pd_seq_end(&s->en, &q->seq);
    pd_spec_free(&q->spec);
    q->used = 0;
}

/* Producer, any rank: the transfer engine ended a lease; the sequence is freed by the next round
 * (the thread that steps the engine owns the pool). */
static void ep_on_release(void *arg, uint64_t request, enum pd_kvx_release why)
{
    struct pd_server *s = arg;
    pthread_mutex_lock(&s->g->rel_mu);
    assert(s->g->n_released < s->o.max_num_seqs);
    s->g->released[s->g->n_released++] = (int64_t)request;
    s->g->n_expired += why == PD_KVX_REL_EXPIRED;
    pthread_mutex_unlock(&s->g->rel_mu);
}

/* Starts seq with the blocks of `total` tokens reserved, its prompt's first (a running request
 * never finds the pool full when it grows, the failure SGLang users report; the prompt's blocks
 * lie in one piece for a hand-off); on failure seq is ended. */
int pd_srv_seq_start_reserved(struct pd_engine *en, struct pd_seq *seq, int64_t prompt, int64_t total, pd_err *e)
{
    int rc = pd_seq_start(en, seq, e);
    if (!rc && (rc = pd_kvseq_reserve_prompt(&en->kv, &seq->kv, prompt, total, e)))
        pd_seq_end(en, seq);
    return rc;
}

/* A sequence slot of this rank for request id, started with the sampler of words w[0..3]
 * (temperature bits, top_p bits, state lo, hi) and `reserve` tokens of KV, its `prompt` first;
 * with the prompt's ids (`tokens`, NULL for a pulled sequence) and the prefix cache on, from the
 * longest prefix this rank's cache holds (seq.pos tokens), where with --speculative-config the
 * draft resumes too (the node's MTP state and input row, as in one process: server_prefix.c). */
static int ep_start(struct pd_server *s, uint64_t id, int prompt, int reserve, const int32_t *w, const int32_t *tokens,
                    struct ep_seq **out, pd_err *e)
{
    struct ep_group *g = s->g;
    struct ep_seq *q = NULL;
    for (int k = 0; k < s->o.max_num_seqs && !q; k++)
        if (!g->seqs[k].used)
            q = &g->seqs[k];
    if (!q)
        return pd_err_set(e, PD_EINVAL, "expert parallelism: rank %d has no free sequence for request %llu", g->rank,
                          (unsigned long long)id);
    /* the blocks of the whole future sequence, as rank 0's admission counted them (all of them,
     * the shared prefix's included: unused cached prefixes can always give theirs back) */
    int rc;
    memset(&q->pcur, 0, sizeof q->pcur);
    if (tokens && s->prefix_on) {
        if ((rc = pd_srv_prefix_seq_start(s, &q->seq, &q->pcur, tokens, prompt, reserve, e)))
            return rc;
        q->cached = 1;
    } else {
        pd_srv_prefix_make_room(s, reserve);
        if ((rc = pd_srv_seq_start_reserved(&s->en, &q->seq, prompt, reserve, e)))
            return rc;
    }
    pd_spec_init(&q->spec, &q->seq, &q->smp);
    if (q->cached && q->pcur.node && s->en.mtp &&
        (rc = pd_spec_resume(&s->en, &q->spec, &q->seq, &q->smp, pd_prefix_node_extra(&s->prefix, q->pcur.node), e))) {
        pd_spec_free(&q->spec);
        pd_prefix_release(&s->prefix, &q->pcur);
        q->cached = 0;
        pd_seq_end(&s->en, &q->seq);
        return rc;
    }
    q->used = 1;
    q->id = id;
    memcpy(&q->smp.temperature, &w[0], sizeof(float));
    memcpy(&q->smp.top_p, &w[1], sizeof(float));
    q->smp.state = ep_id(w + 2);
    *out = q;
    return 0;
}

/* Consumer, the owner rank: starts pulling a request's prompt KV from the producer rank named in
 * the pull entry w into sequence q; the group's rounds go on meanwhile (a pull inside the round
 * held every stream of the group for the pull's timeout when a producer hung), and ep_pulls_ended
 * reports its end. A pull that cannot start is reported failed in this round. */
static void ep_pull_start(struct pd_server *s, struct ep_seq *q, const int32_t *w)
{
    char host[65];
    memcpy(host, w + 12, 64);
    host[64] = 0;
    struct pd_kvx_key key = {.hash = ep_id(w + 6)};
    memcpy(key.id, w + 28, sizeof key.id);
    q->pulling = 1;
    q->pull_aborted = 0;
    q->pull_len = w[4];
    q->pull_first = w[32];
    q->pull_t0 = pd_now_s();
    pd_srv_seq_pull_start(s, &q->seq, host, w[5], &key, q->pull_len, &q->pull, &q->pull_bytes);
}

/* Consumer, the owner rank: the end of q's pull, once it ended: into the answer's entry p {id,
 * 1 pulled / 0 failed (the prompt is recomputed from its token ids) / -1 refused by the producer,
 * bytes, microseconds}; 0, or 1 while it runs. With --speculative-config the pull also brought the
 * MTP layer's KV (a layer of the pool) and the draft's input row, and the sequence's draft resumes
 * from them with the producer's first token, as one process's pull does (server_spec.c). */
static int ep_pull_end(struct pd_server *s, struct ep_seq *q, int32_t *p)
{
    int res = q->pull ? pd_srv_seq_pull_end(s, &q->seq, &q->pull, q->pull_len, q->pull_aborted) : PULL_NONE;
    if (res == 1)
        return 1;
    q->pulling = 0;
    pd_err e = {0};
    if (!res && pd_srv_spec_receive(s, &q->spec, &q->seq, &q->smp, q->pull_first, &e)) {
        /* the draft has no input: the prompt is recomputed, as after a pull that failed midway */
        if (s->o.http.log)
            s->o.http.log(s->o.http.log_arg, e.msg);
        q->seq.pos = q->seq.kv.len = q->seq.mtp_pos = 0;
        pd_spec_free(&q->spec);
        pd_spec_init(&q->spec, &q->seq, &q->smp);
        res = PULL_FAILED;
    }
    const double us = (pd_now_s() - q->pull_t0) * 1e6;
    ep_put_id(p, q->id);
    p[2] = !res ? 1 : res == PULL_REFUSED ? -1 : 0;
    ep_put_id(p + 3, !res ? q->pull_bytes : 0);
    p[5] = us < INT32_MAX ? (int32_t)us : INT32_MAX;
    return 0;
}

/* Consumer, every rank: the pulls of its sequences that ended since the last round, at most
 * EP_PULLS_ENDED of them, into p; how many. */
static int ep_pulls_ended(struct pd_server *s, int32_t *p)
{
    int n = 0;
    memset(p, 0, EP_PULLED_W * EP_PULLS_ENDED * sizeof *p);
    for (int i = 0; i < s->o.max_num_seqs && n < EP_PULLS_ENDED; i++) {
        struct ep_seq *q = &s->g->seqs[i];
        if (q->used && q->pulling && !ep_pull_end(s, q, p + EP_PULLED_W * n))
            n++;
    }
    return n;
}

/* Every rank: applies a round's message to the sequences it owns (frees, leases, pulls, then the
 * step), samples them, and fills its answer (see the message's layout). With no item nobody
 * steps; with items every rank steps, with or without sequences of its own, so all take part in
 * the same expert exchanges. */
static int ep_apply(struct pd_server *s, const int32_t *msg, pd_err *e)
{
    struct ep_group *g = s->g;
    struct ep_msg m;
    ep_parse(msg, &m);
    const int A = ep_answer_words(s, &m);
    if (PD_GROW(g->ans, g->ans_cap, (size_t)A))
        return pd_err_set(e, PD_ENOMEM, "expert parallelism: out of memory");
    const int IW = pd_srv_ep_item_words(s);
    int32_t *out = g->ans + EP_ITEMS_AT, *rel = out + (size_t)m.n_items * IW;
    int n_rel = 0, rc;
    /* leases the transfer engine ended since the last round */
    pthread_mutex_lock(&g->rel_mu);
    for (int i = 0; i < g->n_released; i++) {
        struct ep_seq *q = ep_find(s, (uint64_t)g->released[i]);
        if (q)
            pd_srv_ep_seq_end(s, q);
        ep_put_id(rel + 2 * n_rel++, (uint64_t)g->released[i]);
    }
    g->n_released = 0;
    const int expired = g->n_expired;
    g->n_expired = 0;
    pthread_mutex_unlock(&g->rel_mu);
    for (int i = 0; i < m.n_free; i++) {
        const int32_t *w = m.fr + (size_t)i * EP_FREE_W;
        if (w[2] != g->rank)
            continue;
        struct ep_seq *q = ep_find(s, ep_id(w));
        if (!q)
            return pd_err_set(e, PD_EINVAL, "expert parallelism: rank %d told to free request %llu it does not hold",
                              g->rank, (unsigned long long)ep_id(w));
        if (w[3]) {   /* its client left: the pull ends sooner, and is reported as any other */
            if (q->pull)
                pd_kvx_abort(s->kvx, q->pull);
            q->pull_aborted = 1;
            continue;
        }
        if (q->pulling)
            return pd_err_set(e, PD_EINVAL, "expert parallelism: rank %d told to free request %llu while it pulls",
                              g->rank, (unsigned long long)ep_id(w));
        pd_srv_ep_seq_end(s, q);
    }
    int revoked = 0;
    for (int i = 0; i < m.n_lease; i++) {
        const int32_t *w = m.ls + (size_t)i * EP_LEASE_W;
        if (w[2] != g->rank)
            continue;
        struct pd_kvx_key key = {.hash = ep_id(w + 8)};
        memcpy(key.id, w + 4, sizeof key.id);
        if (w[3] < 0) {   /* revoke it, unless a pull claimed it meanwhile (its release frees it) */
            revoked += s->kvx && pd_kvx_revoke(s->kvx, &key);
            continue;
        }
        struct ep_seq *q = ep_find(s, ep_id(w));
        if (!q)
            return pd_err_set(e, PD_EINVAL, "expert parallelism: rank %d told to lease request %llu it does not hold",
                              g->rank, (unsigned long long)ep_id(w));
        if (pd_srv_seq_offer(s, &q->seq, &key, q->id, w[3], ep_on_release)) {
            /* no lease: the blocks come back now, and rank 0 hears of it as of a release */
            pd_srv_ep_seq_end(s, q);
            ep_put_id(rel + 2 * n_rel++, q->id);
        }
    }
    for (int i = 0; i < m.n_pull; i++) {
        const int32_t *w = m.pl + (size_t)i * EP_PULL_W;
        if (w[2] != g->rank)
            continue;
        struct ep_seq *q;
        if ((rc = ep_start(s, ep_id(w), w[4], w[3], w + 8, NULL, &q, e)))
            return rc;
        ep_pull_start(s, q, w);
    }
    const int n_ended = ep_pulls_ended(s, g->ans + EP_ANS_W);
    int k = 0;
    size_t off = 0;
    for (int i = 0; i < m.n_items; i++) {
        const int32_t *w = m.it + (size_t)i * EP_ITEM_W, *toks = m.tok + off;
        off += (size_t)w[3];
        out[(size_t)i * IW] = -1;
        if (w[2] != g->rank)
            continue;
        uint64_t id = ep_id(w);
        struct ep_seq *q = NULL;
        if (w[4] == EP_NEW_START) {
            if ((rc = ep_start(s, id, w[3], w[5], w + 7, toks, &q, e)))
                return rc;
        } else if (!(q = ep_find(s, id))) {
            return pd_err_set(e, PD_EINVAL, "expert parallelism: rank %d told to step request %llu it does not hold",
                              g->rank, (unsigned long long)id);
        }
        /* a new sequence computes its prompt after the prefix its rank had cached */
        int from = w[4] == EP_NEW_START ? (int)q->seq.pos : 0;
        g->items[k] = (struct pd_step_item){.seq = &q->seq, .tokens = toks + from, .n = w[3] - from, .logits = q->logits};
        if (w[4] == EP_NEW_START && q->cached)
            pd_srv_prefix_seq_plan(s, &q->pcur, toks, w[3], &g->items[k]);
        g->item_seq[k] = q;
        g->item_of[k++] = i;
    }
    if (s->o.spec_k) {
        /* drafts, verify and accept (server_ep_spec.c): the same steps on every rank */
        int32_t *counts = g->ans + A - EP_SPEC_W;   /* the answer's last words, after the cache's */
        memset(counts, 0, EP_SPEC_W * sizeof *counts);
        if (m.n_items > 0 && (rc = pd_srv_ep_spec_step(s, &m, k, out, counts, e)))
            return rc;
    } else {
        rc = m.n_items > 0 ? pd_engine_step(&s->en, g->items, k, e) : 0;
        /* the boundaries the prefills passed enter this rank's cache (dropped if the step failed) */
        for (int j = 0; j < k; j++)
            if (g->item_seq[j]->cached)
                pd_prefix_commit(&s->prefix, &g->item_seq[j]->pcur, &g->item_seq[j]->seq.kv, rc == 0);
        if (rc)
            return rc;
        for (int j = 0; j < k; j++) {
            const int32_t *w = m.it + (size_t)g->item_of[j] * EP_ITEM_W;
            struct ep_seq *q = g->item_seq[j];
            out[g->item_of[j]] = w[6] >= 0 ? w[6] : pd_sample(&q->smp, q->logits, s->Vs, g->scratch);
        }
    }
    for (int i = n_rel; i < s->o.max_num_seqs; i++)
        rel[2 * i] = rel[2 * i + 1] = 0;
    if (s->prefix_on) {
        int32_t *c = g->ans + ep_prefix_at(s, A);
        ep_put_id(c, s->prefix.queries);
        ep_put_id(c + 2, s->prefix.hits);
        ep_put_id(c + 4, s->prefix.evictions);
        c[6] = s->en.kv.held;
        ep_put_id(c + 7, (uint64_t)s->prefix.bytes);
    }
    g->ans[0] = 0;
    g->ans[1] = s->en.kv.n_blocks_free;
    g->ans[2] = s->en.kv.n_slots_free;
    g->ans[3] = n_rel;
    g->ans[4] = revoked;
    g->ans[5] = expired;
    g->ans[6] = n_ended;
    return 0;
}

static int ep_round(struct pd_server *s, pd_err *e);

/* One round of the group: rank 0 broadcasts g->msg (built by the scheduler), the others receive
 * it; every rank applies it and rank 0 gathers the answers into g->all, [size][answer words].
 * Returns 1 when rank 0 ended the group, 0 after a round, or a negative error. Rank 0 times it
 * for the watchdog. */
int pd_srv_ep_round(struct pd_server *s, pd_err *e)
{
    struct ep_group *g = s->g;
    if (g->rank)
        return ep_round(s, e);
    atomic_store(&g->round_t0, pd_now_ns());
    int rc = ep_round(s, e);
    atomic_store(&g->round_t0, 0);
    return rc;
}

static int ep_round(struct pd_server *s, pd_err *e)
{
    struct ep_group *g = s->g;
    MPI_Request rq;
    if (MPI_Ibcast(g->msg, EP_HDR, MPI_INT32_T, 0, g->ep.comm, &rq) != MPI_SUCCESS)
        return pd_err_set(e, PD_EIO, "expert parallelism: rank %d: the step broadcast failed", g->rank);
    /* the other ranks wait between rounds in pd_srv_ep_live_wait: asleep on their connection to
     * rank 0 once it said it idles, until it wakes them, the broadcast posted */
    int rc;
    if (g->rank && (rc = pd_srv_ep_live_wait(s, &rq, e)))
        return rc;
    if (!g->rank)
        pd_srv_ep_live_wake(s);
    if (!g->rank && pd_ep_wait(&rq) != MPI_SUCCESS)
        return pd_err_set(e, PD_EIO, "expert parallelism: rank 0: the step broadcast failed");
    if (g->msg[0] == EP_OP_STOP) {
        if (g->rank)   /* rank 0 ends the group: its connection's close is no death from now on */
            pd_ep_watch(-1, NULL, NULL);
        return 1;
    }
    if (g->msg[0] == EP_OP_STATS) {
        int n = s->en.model.n_layers * s->en.model.n_routed_experts;
        if (MPI_Ireduce(s->en.expert_tokens, g->rank ? NULL : s->stats_sum, n, MPI_INT64_T, MPI_SUM, 0, g->ep.comm,
                        &rq) != MPI_SUCCESS ||
            pd_ep_wait(&rq) != MPI_SUCCESS)
            return pd_err_set(e, PD_EIO, "expert parallelism: rank %d: summing the expert counts failed", g->rank);
        return 0;
    }
    size_t words = ep_msg_words(g->msg);
    if (PD_GROW(g->msg, g->msg_cap, words))
        return pd_err_set(e, PD_ENOMEM, "expert parallelism: out of memory");
    if (words > EP_HDR && (MPI_Ibcast(g->msg + EP_HDR, (int)(words - EP_HDR), MPI_INT32_T, 0, g->ep.comm, &rq) != MPI_SUCCESS ||
                           pd_ep_wait(&rq) != MPI_SUCCESS))
        return pd_err_set(e, PD_EIO, "expert parallelism: rank %d: the step broadcast failed", g->rank);
    if ((rc = ep_apply(s, g->msg, e)))
        return pd_err_prefix(e, "rank %d: ", g->rank);
    struct ep_msg m;
    ep_parse(g->msg, &m);
    int n = ep_answer_words(s, &m);
    if (g->rank == 0 && PD_GROW(g->all, g->all_cap, (size_t)n * g->size))
        return pd_err_set(e, PD_ENOMEM, "expert parallelism: out of memory");
    if (MPI_Igather(g->ans, n, MPI_INT32_T, g->all, n, MPI_INT32_T, 0, g->ep.comm, &rq) != MPI_SUCCESS ||
        pd_ep_wait(&rq) != MPI_SUCCESS)
        return pd_err_set(e, PD_EIO, "expert parallelism: rank %d: gathering the step's tokens failed", g->rank);
    return 0;
}

/* Rank 0 (s->mu held), prefix caching: the rank among those with room (`room`, a bit per rank)
 * whose cache most likely holds r's prompt's prefix, if taking it keeps the group balanced, else
 * `best` (the least loaded). A rank's cache holds the prefixes of the prompts sent to it (until it
 * evicts them), so rank 0 indexes the prompts' token ids it sent to each rank (proxy/route.h's
 * chained chunk hashes over the ids' bytes) and takes the rank matching the longest prefix when
 * that covers at least one cache unit (shorter is never reused) and the rank runs at most
 * 2 x + 1 sequences for the least loaded's x. A wrong guess costs a recomputed prefix, never a
 * wrong token. */
static int ep_affinity(struct pd_server *s, const struct req *r, unsigned room, int best)
{
    struct ep_group *g = s->g;
    if (!s->prefix_on || r->remote_prefill || r->n_prompt < s->prefix.unit || g->size > PD_ROUTE_MAX)
        return best;
    if (!g->route) {
        /* only the index is used (pd_route_match, pd_route_insert); the policy's fields as valid.
         * Per rank it keeps twice the ids a rank's sequences can hold at once (4 bytes each):
         * a rank's cache lives in that pool, so older prompts are gone from it anyway */
        struct pd_route_opts o = {.policy = PD_ROUTE_CACHE_AWARE, .cache_threshold = 0.3, .balance_abs = 64,
                                  .balance_rel = 1.5,
                                  .max_bytes = 2 * sizeof *r->prompt * (size_t)s->o.max_num_seqs *
                                               (size_t)s->o.max_model_len};
        pd_err e;
        if (pd_route_create(g->size, &o, &g->route, &e))
            return best;   /* out of memory for the index: least loaded, as without the cache */
    }
    struct pd_route_key key;
    if (pd_route_key_make(r->prompt, (size_t)r->n_prompt * sizeof *r->prompt, &key))
        return best;
    int pick = best;
    size_t most = 0;
    for (int k = 0; k < g->size; k++) {
        size_t n = (room >> k) & 1 ? pd_route_match(g->route, k, &key) : 0;
        if (n > most) {
            most = n;
            pick = k;
        }
    }
    const size_t unit_chunks = ((size_t)s->prefix.unit * sizeof *r->prompt + PD_ROUTE_CHUNK - 1) / PD_ROUTE_CHUNK;
    if (most < unit_chunks || g->load[pick] > 2 * g->load[best] + 1)
        pick = best;
    pd_route_insert(g->route, pick, &key);
    pd_route_key_free(&key);
    return pick;
}

/* Rank 0 (s->mu held): the rank a new request's sequence goes to: the least-loaded one with a
 * free sequence and the blocks of the request's whole future (prompt + max_tokens), ties going
 * round-robin (so one request at a time still uses every rank), or with prefix caching the one
 * likely to hold its prefix (ep_affinity); -1 if no rank has room now. */
int pd_srv_ep_admit(struct pd_server *s, struct req *r)
{
    struct ep_group *g = s->g;
    int need = pd_kvpool_blocks_for(&s->en.kv, r->n_prompt + r->max_tokens), best = -1;
    unsigned room = 0;
    for (int j = 1; j <= g->size; j++) {
        int k = (g->last + j) % g->size;
        if (g->load[k] < s->en.kv.n_slots && g->acct_blocks[k] >= need) {
            room |= k < 32 ? 1u << k : 0;
            if (best < 0 || g->load[k] < g->load[best])
                best = k;
        }
    }
    if (best < 0)
        return -1;
    best = ep_affinity(s, r, room, best);
    g->acct_blocks[best] -= need;
    g->load[best]++;
    g->owned[best]++;
    g->last = best;
    r->owner = best;
    r->ep_blocks = need;
    r->ep_new = 1;
    r->ep_prefilled = 0;
    return 0;
}

/* Rank 0: room for one more entry of a pending list. */
static int32_t *ep_push(struct ep_list *l)
{
    if (l->n == l->cap) {
        int c = l->cap * 2 + 16;
        int32_t *w = realloc(l->w, (size_t)c * (size_t)l->width * sizeof *w);
        assert(w);   /* a few words per request; nothing sensible is left to do without them */
        l->w = w;
        l->cap = c;
    }
    return l->w + (size_t)l->n++ * (size_t)l->width;
}

/* Rank 0 (s->mu held): a rank's sequence is gone (freed or its lease released): count its room. */
static void ep_forget(struct pd_server *s, struct req *r)
{
    struct ep_group *g = s->g;
    g->acct_blocks[r->owner] += r->ep_blocks;
    g->load[r->owner]--;
    assert(g->load[r->owner] >= 0);
}

/* Rank 0 (s->mu held): the request's sequence is freed on its owner by the next message (if the
 * owner ever started it). */
void pd_srv_ep_release(struct pd_server *s, struct req *r)
{
    if (!r->ep_new) {
        int32_t *w = ep_push(&s->g->frees);
        ep_put_id(w, r->id);
        w[2] = r->owner;
        w[3] = 0;
    }
    ep_forget(s, r);
}

/* Rank 0 (s->mu held): producer: the request's KV goes under a lease on its owner rank with the
 * next message; the owner reports when the transfer engine releases it. */
int pd_srv_ep_lease(struct pd_server *s, struct req *r)
{
    int32_t *w = ep_push(&s->g->leases);
    ep_put_id(w, r->id);
    w[2] = r->owner;
    w[3] = r->n_prompt;
    memcpy(w + 4, r->key.id, sizeof r->key.id);
    ep_put_id(w + 8, r->key.hash);
    r->leased_at = pd_now_s();
    r->lease_next = s->leases;
    s->leases = r;
    return 0;
}

/* Rank 0 (s->mu held): producer: the request's lease is revoked on its owner rank with the next
 * message (yield_lease); the owner reports the release as any other. */
void pd_srv_ep_revoke(struct pd_server *s, const struct req *r)
{
    int32_t *w = ep_push(&s->g->leases);
    ep_put_id(w, r->id);
    w[2] = r->owner;
    w[3] = -1;
    memcpy(w + 4, r->key.id, sizeof r->key.id);
    ep_put_id(w + 8, r->key.hash);
}

/* Rank 0 (s->mu held): consumer: the owner rank starts the sequence and pulls its prompt's KV in
 * the next round. */
void pd_srv_ep_pull_later(struct pd_server *s, struct req *r)
{
    struct ep_group *g = s->g;
    int32_t *w = ep_push(&g->pulls);
    memset(w, 0, EP_PULL_W * sizeof *w);
    ep_put_id(w, r->id);
    w[2] = r->owner;
    w[3] = r->n_prompt + r->max_tokens;
    w[4] = r->n_prompt;
    w[5] = r->remote_port;
    ep_put_id(w + 6, r->remote_key.hash);
    memcpy(&w[8], &r->smp.temperature, sizeof(float));
    memcpy(&w[9], &r->smp.top_p, sizeof(float));
    ep_put_id(w + 10, r->smp.state);
    memcpy(w + 12, r->remote_host, strlen(r->remote_host));
    memcpy(w + 28, r->remote_key.id, sizeof r->remote_key.id);
    w[32] = r->forced_first;
    r->ep_new = 0;   /* the pull starts it */
    r->ep_pulling = 1;
}

void pd_srv_ep_abort_pull(struct pd_server *s, struct req *r)
{
    int32_t *w = ep_push(&s->g->frees);
    ep_put_id(w, r->id);
    w[2] = r->owner;
    w[3] = 1;
    r->pull_aborted = 1;
}

int pd_srv_ep_pulling(const struct pd_server *s)
{
    for (int i = 0; i < s->n_running; i++)
        if (s->running[i]->ep_pulling)
            return 1;
    return 0;
}

void pd_srv_ep_drop_pulls(struct pd_server *s)
{
    for (int i = 0; s->g && s->g->seqs && i < s->o.max_num_seqs; i++) {
        struct ep_seq *q = &s->g->seqs[i];
        if (q->pull) {   /* aborted, freed by the transfer engine once it ends */
            pd_kvx_xfer_free(s->kvx, q->pull);
            q->pull = NULL;
        }
    }
}

/* Rank 0 (s->mu held): starts the next message with the pending frees, leases and pulls. */
static int ep_begin(struct pd_server *s, int n_items, int n_tokens)
{
    struct ep_group *g = s->g;
    size_t words = EP_HDR + (size_t)g->frees.n * EP_FREE_W + (size_t)g->leases.n * EP_LEASE_W +
                   (size_t)g->pulls.n * EP_PULL_W + (size_t)n_items * EP_ITEM_W + (size_t)n_tokens;
    if (PD_GROW(g->msg, g->msg_cap, words))
        return -1;
    int32_t *h = g->msg, *w = h + EP_HDR;
    h[0] = EP_OP_STEP;
    h[1] = g->frees.n;
    h[2] = g->leases.n;
    h[3] = g->pulls.n;
    h[4] = n_items;
    h[5] = n_tokens;
    struct ep_list *l[3] = {&g->frees, &g->leases, &g->pulls};
    for (int i = 0; i < 3; i++) {
        if (l[i]->n)
            memcpy(w, l[i]->w, (size_t)l[i]->n * (size_t)l[i]->width * sizeof *w);
        w += (size_t)l[i]->n * (size_t)l[i]->width;
        l[i]->n = 0;
    }
    return 0;
}

/* Rank 0 (s->mu held): an owner rank's pull ended (its answer's entry p): the request goes on
 * with the producer's token, is refused, or has its prompt recomputed; one whose client left
 * meanwhile just ends (no transfer failure to count). */
static void ep_pull_ended(struct pd_server *s, const int32_t *p)
{
    const uint64_t id = ep_id(p);
    struct req *r = NULL;
    for (int i = 0; i < s->n_running && !r; i++)
        if (s->running[i]->ep_pulling && s->running[i]->id == id)
            r = s->running[i];
    if (!r)
        return;
    r->ep_pulling = 0;
    if (r->pull_aborted)
        return;
    const int64_t bytes = (int64_t)ep_id(p + 3);
    const double seconds = p[5] * 1e-6;
    s->kv_pulls++;
    pd_srv_count_pull(s, r->remote_host, r->remote_port, r->owner, p[2] > 0 ? bytes : -1, seconds);
    if (p[2] < 0) {
        /* not this request's KV: refused, not recomputed; the owner frees the sequence */
        s->kv_failures++;
        pd_srv_refuse(s, r);
        return;
    }
    if (!p[2]) {
        /* recompute: the owner prefills the prompt from its token ids, then the producer's
         * first token follows */
        s->kv_failures++;
        s->kv_recomputes++;
        r->ep_prefilled = 0;
        return;
    }
    s->kv_bytes += (uint64_t)bytes;
    s->kv_seconds += seconds;
    r->ep_prefilled = 1;
    pd_srv_take_producer_token(s, r);
}

/* Rank 0 (s->mu held) after a round: what the ranks reported: their pools, the leases they
 * released, the pulls that ended. */
void pd_srv_ep_account(struct pd_server *s)
{
    struct ep_group *g = s->g;
    struct ep_msg m;
    ep_parse(g->msg, &m);
    int A = ep_answer_words(s, &m);
    for (int k = 0; k < g->size; k++) {
        const int32_t *a = g->all + (size_t)k * A,
                      *rel = a + EP_ITEMS_AT + (size_t)m.n_items * pd_srv_ep_item_words(s);
        g->free_blocks[k] = a[1];
        g->free_slots[k] = a[2];
        s->leases_revoked += (uint64_t)a[4];
        s->leases_expired += (uint64_t)a[5];
        if (s->prefix_on) {
            const int32_t *c = a + ep_prefix_at(s, A);
            int64_t *p = g->pfx + (size_t)k * EP_PFX_N;
            p[EP_PFX_QUERIES] = (int64_t)ep_id(c);
            p[EP_PFX_HITS] = (int64_t)ep_id(c + 2);
            p[EP_PFX_EVICTIONS] = (int64_t)ep_id(c + 4);
            p[EP_PFX_BLOCKS] = c[6];
            p[EP_PFX_BYTES] = (int64_t)ep_id(c + 7);
        }
        for (int j = 0; j < a[3]; j++) {
            uint64_t id = ep_id(rel + 2 * j);
            for (struct req **pp = &s->leases; *pp; pp = &(*pp)->lease_next)
                if ((*pp)->id == id) {
                    struct req *r = *pp;
                    *pp = r->lease_next;
                    r->started = 0;
                    ep_forget(s, r);
                    pd_srv_req_unref(s, r);
                    break;
                }
        }
    }
    for (int k = 0; k < g->size; k++) {
        const int32_t *a = g->all + (size_t)k * A;
        for (int j = 0; j < a[6] && j < EP_PULLS_ENDED; j++)
            ep_pull_ended(s, a + EP_ANS_W + EP_PULLED_W * j);
    }
}

/* Rank 0, the scheduler (s->mu held; released during the round): a round without a step, for
 * the pending frees, leases and pulls, or to hear of released leases. */
int pd_srv_ep_flush(struct pd_server *s, pd_err *e)
{
    if (ep_begin(s, 0, 0))
        return pd_err_set(e, PD_ENOMEM, "expert parallelism: out of memory");
    pthread_mutex_unlock(&s->mu);
    int rc = pd_srv_ep_round(s, e);
    pthread_mutex_lock(&s->mu);
    if (!rc)
        pd_srv_ep_account(s);
    return rc;
}

/* Rank 0 (s->mu held): the group is broken (a rank failed mid-step); nothing can step any more.
 * The loop stops and pd_server_run reports it; the caller ends the group. */
void pd_srv_ep_broken(struct pd_server *s, const pd_err *e)
{
    snprintf(s->fatal, sizeof s->fatal, "%s", e->msg[0] ? e->msg : "expert parallelism: the group failed");
    event_base_loopexit(s->base, NULL);
}

/* Rank 0, after a step's round: the words rank `owner` answered for item i (its token, or
 * {n, tokens}), and with --speculative-config the counts at the end of rank k's answer. */
const int32_t *pd_srv_ep_answer_item(const struct pd_server *s, int owner, int i)
{
    struct ep_msg m;
    ep_parse(s->g->msg, &m);
    return s->g->all + (size_t)owner * ep_answer_words(s, &m) + EP_ITEMS_AT +
           (size_t)i * pd_srv_ep_item_words(s);
}

const int32_t *pd_srv_ep_answer_spec(const struct pd_server *s, int k)
{
    struct ep_msg m;
    ep_parse(s->g->msg, &m);
    return s->g->all + (size_t)(k + 1) * ep_answer_words(s, &m) - EP_SPEC_W;
}

/* Rank 0, after a step's round: the token rank `owner` gave item i. */
int32_t pd_srv_ep_token(const struct pd_server *s, int owner, int i)
{
    return *pd_srv_ep_answer_item(s, owner, i);
}

/* Rank 0 (s->mu held): the message of a step over requests in_step[0 .. m): the pending frees,
 * leases and pulls, then each request's owner and new tokens (the prompt first, then its last
 * token), and for a sequence that starts its reservation and sampler. */
int pd_srv_ep_build_step(struct pd_server *s, struct req **in_step, int m)
{
    int n_tokens = 0;
    for (int i = 0; i < m; i++)
        n_tokens += in_step[i]->ep_prefilled ? 1 : in_step[i]->n_prompt;
    if (ep_begin(s, m, n_tokens))
        return -1;
    struct ep_msg mm;
    ep_parse(s->g->msg, &mm);
    int32_t *it = (int32_t *)mm.it, *tok = (int32_t *)mm.tok;
    for (int i = 0; i < m; i++, it += EP_ITEM_W) {
        struct req *r = in_step[i];
        ep_put_id(it, r->id);
        it[2] = r->owner;
        it[3] = r->ep_prefilled ? 1 : r->n_prompt;
        /* a failed pull's sequence is started already: its prompt is recomputed in it */
        it[4] = r->ep_new ? EP_NEW_START : !r->ep_prefilled ? EP_NEW_PULLED : 0;
        it[5] = r->n_prompt + r->max_tokens;
        it[6] = r->forced_first;
        memcpy(&it[7], &r->smp.temperature, sizeof(float));
        memcpy(&it[8], &r->smp.top_p, sizeof(float));
        ep_put_id(it + 9, r->smp.state);
        /* drafts: none past max_tokens (a round yields at most k + 1 tokens), none in a prefill */
        int left = r->max_tokens - r->n_gen - 1;
        it[11] = !r->ep_prefilled || !s->o.spec_k ? 0 : s->o.spec_k < left ? s->o.spec_k : left > 0 ? left : 0;
        if (r->ep_prefilled)
            *tok++ = r->gen[r->n_gen - 1];
        else {
            memcpy(tok, r->prompt, (size_t)r->n_prompt * sizeof *tok);
            tok += r->n_prompt;
        }
        r->ep_new = 0;
        r->ep_prefilled = 1;
    }
    return 0;
}

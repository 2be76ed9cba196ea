/* The inference server (see server.h): the request lifetime, the scheduler thread with continuous
 * batching over the engine (or an EP group of MPI ranks: server_ep.c), and the server's life; the
 * KV leases and pulls are server_kv.c, the HTTP side server_api.c (its /metrics
 * server_metrics.c), the shared state server_int.h. */
#include "core/threadpool.h"
#include "core/file.h"
#include "pd/server_int.h"

#include <time.h>

#include <limits.h>
/* ---- request lifetime ---------------------------------------------------------------------- */

void pd_srv_req_unref(struct pd_server *s, struct req *r)
{
    /* called with s->mu held */
    if (--r->refs > 0)
        return;
    if (r->live_prev)
        r->live_prev->live_next = r->live_next;
    else
        s->live = r->live_next;
    if (r->live_next)
        r->live_next->live_prev = r->live_prev;
    pd_spec_free(&r->spec);
    free(r->prompt);
    free(r->gen);
    free(r->logits);
    free(r->text);
    for (int i = 0; i < r->n_stop; i++)
        free(r->stop[i]);
    free(r->stop);
    free(r->stop_ids);
    free(r->held);
    free(r);
}

/* ---- the scheduler thread ----------------------------------------------------------------- */

void pd_srv_outbox_push(struct pd_server *s, struct req *r)
{
    if (r->queued)
        return;
    r->queued = 1;
    r->refs++;
    r->next = s->outbox;
    s->outbox = r;
}

/* The producer's first token becomes the request's first generated token once its KV is here
 * (pulled, or recomputed from the token ids), and the client hears of it. */
void pd_srv_take_token(struct pd_server *s, struct req *r, int32_t t)
{
    int stop_id = 0;   /* vLLM's stop_token_ids end the generation whatever ignore_eos says */
    for (int k = 0; k < r->n_stop_ids && !stop_id; k++)
        stop_id = t == r->stop_ids[k];
    if ((t == s->eos && !r->ignore_eos) || stop_id) {
        r->finished = 1;
        r->finish = "stop";
        r->stop_token = 1;
        r->stop_tok = t;
        return;
    }
    r->gen[r->n_gen++] = t;
    s->tokens_out++;
    if (r->n_gen >= r->max_tokens) {
        r->finished = 1;
        r->finish = "length";
    }
}

/* The producer's first token is the request's first generated token once its KV is here (pulled,
 * or recomputed from the token ids), a stop token ending it as one sampled here would, and the
 * client hears of it. */
void pd_srv_take_producer_token(struct pd_server *s, struct req *r)
{
    int32_t t = r->forced_first;
    r->forced_first = -1;
    r->t_first = pd_now_s();
    pd_srv_take_token(s, r, t);
    pd_srv_outbox_push(s, r);
}

/* Consumer: the producer refused the request's transfer parameters: the client gets a 4xx, no
 * token; the caller ends its sequence. */
void pd_srv_refuse(struct pd_server *s, struct req *r)
{
    r->finished = 1;
    r->finish = "refused";
    pd_srv_outbox_push(s, r);
    /* answered now: no step may follow to wake the loop */
    event_active(s->notify, 0, 0);
}

static void seq_release(struct pd_server *s, struct req *r);

/* Running request i ends: its sequence goes back, its place to the last one. (s->mu held) */
void pd_srv_finish_running(struct pd_server *s, int i)
{
    struct req *r = s->running[i];
    seq_release(s, r);
    s->running[i] = s->running[--s->n_running];
    pd_srv_req_unref(s, r);
}


/* The sequence of a request goes back: to this engine's pool, or to its owner rank's. */
static void seq_release(struct pd_server *s, struct req *r)
{
    pd_srv_prefix_release(s, r);
    if (r->started) {
        if (s->g)
            pd_srv_ep_release(s, r);
        else
            pd_seq_end(&s->en, &r->seq);
    }
    r->started = 0;
}

/* The scheduler (s->mu held): the tokens each expert ran, for the waiting GET /expert_stats
 * requests; an EP group's ranks sum theirs in a round of their own. Nonzero if that round failed. */
static int collect_expert_stats(struct pd_server *s, pd_err *e)
{
    int rc = 0;
    if (s->g) {
        memset(s->g->msg, 0, EP_HDR * sizeof *s->g->msg);
        s->g->msg[0] = EP_OP_STATS;
        pthread_mutex_unlock(&s->mu);
        rc = pd_srv_ep_round(s, e);
        pthread_mutex_lock(&s->mu);
    } else {
        memcpy(s->stats_sum, s->en.expert_tokens,
               (size_t)s->en.model.n_layers * s->en.model.n_routed_experts * sizeof *s->stats_sum);
    }
    if (!rc) {
        s->stats_state = STATS_READY;
        event_active(s->notify, 0, 0);
    }
    return rc;
}

/* --speculative-config: the new requests' prompts in one step (their hidden states kept for the
 * MTP layer), then one speculative round (engine/spec.h) for the others together, each verify item
 * k+1 tokens (k lowered so no request drafts past its max_tokens). Request i's tokens go to
 * tp[i][0 .. nt[i]); next[i] holds a prefilled request's first. */
static int spec_step(struct pd_server *s, struct req **in, const struct pd_step_item *items, int m, int32_t *next,
                     const int32_t **tp, int *nt, struct pd_spec_stats *st, float *scratch, pd_err *e)
{
    struct pd_spec_seq **pre = calloc((size_t)m + 1, sizeof *pre), **dec = calloc((size_t)m + 1, sizeof *dec);
    const int32_t **pr = calloc((size_t)m + 1, sizeof *pr);
    int *pn = calloc((size_t)m + 1, sizeof *pn);
    float **lg = calloc((size_t)m + 1, sizeof *lg);
    int rc = 0, np = 0, nd = 0;
    if (!pre || !dec || !pr || !pn || !lg) {
        rc = pd_err_set(e, PD_ENOMEM, "speculative decoding: out of memory for a step");
        goto out;
    }
    for (int i = 0; i < m; i++) {
        struct req *r = in[i];
        if (r->n_gen == 0) {
            /* its prompt, after a cached prefix (where pd_srv_prefix_start resumed the draft) */
            if (!r->spec.seq)
                pd_spec_init(&r->spec, &r->seq, &r->smp);
            r->spec.snaps = items[i].snaps;
            r->spec.n_snaps = items[i].n_snaps;
            pre[np] = &r->spec;
            pr[np] = r->prompt + r->seq.pos;
            pn[np] = r->n_prompt - (int)r->seq.pos;
            lg[np++] = r->logits;
        } else {
            int left = r->max_tokens - r->n_gen - 1;
            r->spec.k = s->o.spec_k < left ? s->o.spec_k : left > 0 ? left : 0;
            dec[nd++] = &r->spec;
        }
    }
    if (np && (rc = pd_spec_prefill(&s->en, pre, pr, pn, lg, np, e)))
        goto out;
    /* the MTP layer's KV and the draft's input, for a hand-off or the prefix cache */
    if (np && (rc = pd_srv_spec_prefilled(s, in, m, e)))
        goto out;
    if (nd && (rc = pd_spec_round(&s->en, dec, nd, s->Vs, st, e)))
        goto out;
    for (int i = 0; i < m; i++) {
        struct req *r = in[i];
        if (r->spec.n_tok < r->spec.n) {
            /* just prefilled: its first token (the producer's, when a failed pull recomputed the
             * prompt), which the next round verifies first */
            next[i] = r->forced_first >= 0 ? r->forced_first : pd_sample(&r->smp, r->logits, s->Vs, scratch);
            if ((rc = pd_spec_push(&r->spec, next[i], e)))
                goto out;
            tp[i] = &next[i];
            nt[i] = 1;
        } else {
            tp[i] = r->spec.out;
            nt[i] = r->spec.n_out;
        }
    }
out:
    free(pre);
    free(dec);
    free(pr);
    free(pn);
    free(lg);
    return rc;
}

/* Waits on s->cv (s->mu held) at most ms milliseconds; pthread_cond_timedwait's result. */
static int cv_wait_ms(struct pd_server *s, int ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);   /* s->cv's clock (pd_server_create) */
    ts.tv_nsec += (long)ms * 1000000;
    ts.tv_sec += ts.tv_nsec / 1000000000;
    ts.tv_nsec %= 1000000000;
    return pthread_cond_timedwait(&s->cv, &s->mu, &ts);
}

static void *scheduler(void *arg)
{
    struct pd_server *s = arg;
    const int max_seqs = s->o.max_num_seqs * (s->g ? s->g->size : 1);
    struct pd_step_item *items = calloc((size_t)max_seqs, sizeof *items);
    int32_t *last = calloc((size_t)max_seqs, sizeof *last), *next = calloc((size_t)max_seqs, sizeof *next);
    struct req **in_step = calloc((size_t)max_seqs, sizeof *in_step);
    float *scratch = malloc((size_t)s->V * 2 * sizeof(float));
    const int32_t **tp = calloc((size_t)max_seqs, sizeof *tp);   /* each request's new tokens */
    int *nt = calloc((size_t)max_seqs, sizeof *nt);
    pd_err e = {0};
    int rc = 0;
    pthread_mutex_lock(&s->mu);
    if (!items || !last || !next || !in_step || !scratch || !tp || !nt) {
        /* nothing can step: the loop stops and pd_server_run reports it */
        snprintf(s->fatal, sizeof s->fatal, "out of memory for the scheduler of %d sequences", max_seqs);
        event_base_loopexit(s->base, NULL);
        s->stop = 1;
    }
    while (!s->stop) {
        if (s->stats_state == STATS_WANTED && (rc = collect_expert_stats(s, &e)))
            break;
        /* leases the transfer engine ended: the KV goes back to the pool */
        while (s->released) {
            struct req *r = s->released;
            s->released = r->lease_next;
            seq_release(s, r);
            pd_srv_req_unref(s, r);
        }
        /* pulls under way: those that ended go on */
        if (s->kvx && !s->g)
            pd_srv_pulls_progress(s);
        /* drop cancelled requests, free their KV (a pull's once no get can write it: an EP
         * group's owner rank is told to abort it, and reports its end) */
        for (int i = 0; i < s->n_running; i++) {
            struct req *r = s->running[i];
            if (!(r->cancelled || r->stop_wanted))
                continue;
            if (r->ep_pulling) {
                if (!r->pull_aborted)
                    pd_srv_ep_abort_pull(s, r);
            } else if (!r->pull) {
                s->n_cancelled += r->cancelled;   /* a stop string ended the other */
                pd_srv_finish_running(s, i--);
            }
        }
        /* admit: a request enters only if the pool can hold its prompt and all its tokens */
        int budget = s->o.max_num_batched_tokens;
        while (s->wait_head && s->n_running < max_seqs) {
            struct req *r = s->wait_head;
            if (r->cancelled) {
                s->wait_head = r->next;
                if (!s->wait_head)
                    s->wait_tail = NULL;
                s->n_cancelled++;
                pd_srv_req_unref(s, r);
                continue;
            }
            if (r->n_prompt > budget && budget < s->o.max_num_batched_tokens)
                break;   /* next step */
            if (s->g) {
                /* a rank with room takes it; the blocks are counted here and reserved there */
                if (pd_srv_ep_admit(s, r)) {
                    pd_srv_yield_lease(s);
                    break;
                }
            } else if (s->prefix_on && !r->remote_prefill) {
                if (pd_srv_prefix_start(s, r, &e)) {
                    pd_srv_yield_lease(s);
                    break;   /* wait until running requests or leases free their blocks */
                }
            } else {
                pd_srv_prefix_make_room(s, r->n_prompt + r->max_tokens);
                if (pd_srv_seq_start_reserved(&s->en, &r->seq, r->n_prompt, r->n_prompt + r->max_tokens, &e)) {
                    pd_srv_yield_lease(s);
                    break;   /* wait until running requests or leases free their blocks */
                }
            }
            s->wait_head = r->next;
            if (!s->wait_head)
                s->wait_tail = NULL;
            r->started = 1;
            s->running[s->n_running++] = r;
            if (r->remote_prefill && s->g && r->remote_tokens == r->n_prompt && s->kvx) {
                /* its owner rank pulls the KV in the next round (or recomputes it) */
                pd_srv_ep_pull_later(s, r);
                continue;
            }
            if (r->remote_prefill && s->g) {
                /* the producer computed another prompt length: recompute it here */
                s->kv_recomputes++;
            } else if (r->remote_prefill) {
                /* the producer computed the prompt: pull it; if that fails, recompute it here
                 * from the token ids and continue with the producer's first token. A refused key
                 * is no failure to make up for: the request is refused. */
                if (pd_srv_pull_start(s, r) == 0)
                    continue;   /* pd_srv_pulls_progress takes it on when the pull ends */
                s->kv_recomputes++;
            }
            budget -= r->n_prompt - (int)r->seq.pos;   /* a cached prefix is not computed */
        }
        if (s->n_running == 0) {
            /* the ranks free what finished before the group goes idle */
            if (s->g && (s->g->frees.n || s->g->leases.n || s->g->pulls.n)) {
                if ((rc = pd_srv_ep_flush(s, &e)))
                    break;
                continue;
            }
            /* the ranks sleep until the next round (server_ep_live.c) */
            if (s->g)
                pd_srv_ep_live_idle(s);
            if (s->g && s->leases) {
                /* leases out on the ranks: every 20 ms a round asks which ended */
                if (cv_wait_ms(s, 20) == ETIMEDOUT && !s->stop && (rc = pd_srv_ep_flush(s, &e)))
                    break;
                continue;
            }
            if (s->wait_head && s->leases) {
                cv_wait_ms(s, 100);   /* a request waits on leases: look again as they age (yield_lease) */
                continue;
            }
            pthread_cond_wait(&s->cv, &s->mu);
            continue;
        }
        /* one step: new requests prefill their prompt, the others decode one token */
        int m = 0;
        for (int i = 0; i < s->n_running; i++) {
            struct req *r = s->running[i];
            if (r->finished || r->ep_pulling || r->pull)
                continue;
            in_step[m] = r;
            if (r->n_gen == 0 && r->seq.pos < r->n_prompt) {
                /* the prompt after its cached prefix (if any) */
                items[m] = (struct pd_step_item){.seq = &r->seq, .tokens = r->prompt + r->seq.pos,
                                                 .n = r->n_prompt - (int)r->seq.pos, .logits = r->logits};
                pd_srv_prefix_plan(s, r, &items[m]);
            } else {
                last[m] = r->gen[r->n_gen - 1];
                items[m] = (struct pd_step_item){.seq = &r->seq, .tokens = &last[m], .n = 1, .logits = r->logits};
            }
            /* a step whose every client left stops at its next layer (one process, no drafts:
             * the EP ranks and the draft rounds run theirs to the end) */
            if (!s->g && !s->o.spec_k)
                items[m].cancel = &r->gone;
            m++;
        }
        if (s->g && m == 0 && !s->g->frees.n && !s->g->leases.n && !s->g->pulls.n && pd_srv_ep_pulling(s)) {
            /* nothing to step but pulls under way on the owner ranks: a round each millisecond
             * hears of those that ended; the ranks sleep in between (their pulls go on in their
             * transfer threads), not in their 10 us - 2 ms backoff between rounds, which woke each
             * rank about 7 times a round: 9% of a core each during a pull from a stalled producer */
            pd_srv_ep_live_idle(s);
            if (cv_wait_ms(s, 1) == ETIMEDOUT && !s->stop && (rc = pd_srv_ep_flush(s, &e)))
                break;
            continue;
        }
        int pulling = 0;   /* (looked for only when nothing else steps) */
        for (int i = 0; m == 0 && i < s->n_running && !s->g; i++)
            pulling += s->running[i]->pull != NULL;
        if (pulling) {
            /* nothing to step but pulls under way: the requests they finished (a consumer's, no
             * lease) end, and the scheduler waits for the transfer thread without spinning */
            for (int i = 0; i < s->n_running;)
                if (s->running[i]->finished && !s->running[i]->pull && !s->running[i]->remote_decode)
                    pd_srv_finish_running(s, i);
                else
                    i++;
            event_active(s->notify, 0, 0);
            cv_wait_ms(s, 1);
            continue;
        }
        if (s->g && pd_srv_ep_build_step(s, in_step, m)) {
            rc = pd_err_set(&e, PD_ENOMEM, "expert parallelism: out of memory for a step");
            break;
        }
        int mixed = 0;
        for (int i = 0; i < m; i++)
            mixed |= in_step[i]->n_gen == 0;
        const double t_step = pd_now_s();
        pthread_mutex_unlock(&s->mu);
        /* the next token of each request: sampled here, or by its owner rank; with
         * --speculative-config one to k+1 tokens */
        struct pd_spec_stats sst = {0};
        for (int i = 0; i < m; i++) {
            tp[i] = &next[i];
            nt[i] = 1;
        }
        if (s->o.spec_k && !s->g) {
            rc = spec_step(s, in_step, items, m, next, tp, nt, &sst, scratch, &e);
        } else if (s->g) {
            /* with --speculative-config each owner rank runs its sequences' rounds */
            rc = pd_srv_ep_round(s, &e);
            if (!rc && s->o.spec_k)
                rc = pd_srv_ep_spec_take(s, in_step, m, tp, nt, &sst, &e);
            for (int i = 0; !rc && !s->o.spec_k && i < m; i++)
                next[i] = pd_srv_ep_token(s, in_step[i]->owner, i);
        } else {
            rc = pd_engine_step(&s->en, items, m, &e);
            for (int i = 0; !rc && i < m; i++)
                next[i] = in_step[i]->forced_first >= 0 ? in_step[i]->forced_first
                                                        : pd_sample(&in_step[i]->smp, in_step[i]->logits, s->Vs, scratch);
        }
        double now = pd_now_s();
        pthread_mutex_lock(&s->mu);
        if (m > 0) {   /* a step of no sequence of this rank's (a request its producer's token ended) is none */
            s->steps[mixed]++;
            s->step_seqs[mixed] += (uint64_t)m;
            s->step_seconds[mixed] += now - t_step;
        }
        if (s->g && !rc)
            pd_srv_ep_account(s);
        if (!rc) {
            struct pd_spec_stats *a = &s->spec_stats;
            a->drafts += sst.drafts;
            a->draft_tokens += sst.draft_tokens;
            a->accepted += sst.accepted;
            a->emitted += sst.emitted;
            a->steps += sst.steps;
            for (int j = 0; j < PD_SPEC_MAX_K; j++) {
                a->drafted_per_pos[j] += sst.drafted_per_pos[j];
                a->accepted_per_pos[j] += sst.accepted_per_pos[j];
            }
        }
        if (rc == PD_ECANCELED) {
            /* every client of the step left (their requests are dropped next round), no token */
            for (int i = 0; i < m; i++)
                pd_srv_prefix_commit(s, in_step[i], 0);
            s->steps_cancelled++;
            m = 0;
            rc = 0;
        }
        for (int i = 0; i < m; i++) {
            struct req *r = in_step[i];
            pd_srv_prefix_commit(s, r, rc == 0);
            if (rc) {
                r->finished = 1;
                r->finish = "error";
            } else for (int j = 0; j < nt[i] && !r->finished; j++) {
                int32_t t = tp[i][j];
                r->forced_first = -1;
                if (r->n_gen == 0) {
                    r->t_first = now;
                    if (r->first_sampled < 0)
                        r->first_sampled = t;   /* (a producer hands it on, a stop token too) */
                }
                pd_srv_take_token(s, r, t);
            }
            pd_srv_outbox_push(s, r);
        }
        for (int i = 0; i < s->n_running;) {
            struct req *r = s->running[i];
            /* (a request whose client left during its prefill has nobody to pull it) */
            if (r->finished && r->remote_decode && s->kvx && strcmp(r->finish, "error") && !r->cancelled &&
                (s->g ? pd_srv_ep_lease(s, r) : pd_srv_lease(s, r)) == 0) {
                /* the KV stays, under the lease; the scheduler's reference goes with it */
                s->running[i] = s->running[--s->n_running];
                continue;
            }
            if (r->finished)
                pd_srv_finish_running(s, i);
            else
                i++;
        }
        /* leases go out before P answers (D pulls right after), and the group's last requests
         * have their blocks back on every rank before they are answered */
        if (s->g && !rc && (s->g->leases.n || (s->n_running == 0 && s->g->frees.n)))
            rc = pd_srv_ep_flush(s, &e);
        event_active(s->notify, 0, 0);
        if (rc && s->g)
            break;
        rc = 0;   /* one process: the step's requests failed, the server goes on */
    }
    for (int i = s->n_running - 1; i >= 0; i--) {
        struct req *r = s->running[i];
        if (r->pull) {   /* aborted, freed by the transfer engine once it ends */
            pd_kvx_xfer_free(s->kvx, r->pull);
            r->pull = NULL;
        }
        if (rc && !r->finished) {
            r->finished = 1;
            r->finish = "error";
            pd_srv_outbox_push(s, r);
        }
        pd_srv_finish_running(s, i);
    }
    if (rc) {
        /* only the EP group fails here: the ranks cannot step together any more */
        pd_srv_ep_broken(s, &e);
        event_active(s->notify, 0, 0);
    }
    pthread_mutex_unlock(&s->mu);
    if (s->g && !rc) {
        /* the end of the group: the other ranks return from pd_server_run */
        MPI_Request rq;
        memset(s->g->msg, 0, EP_HDR * sizeof *s->g->msg);
        s->g->msg[0] = EP_OP_STOP;
        if (MPI_Ibcast(s->g->msg, EP_HDR, MPI_INT32_T, 0, s->g->ep.comm, &rq) == MPI_SUCCESS) {
            pd_srv_ep_live_wake(s);   /* (asleep since rank 0 idled) */
            pd_ep_wait(&rq);
        }
    }
    free(items);
    free(last);
    free(next);
    free(in_step);
    free(scratch);
    free(tp);
    free(nt);
    if (s->g)
        atomic_store(&s->g->scheduler_done, 1);
    return NULL;
}

/* Takes a request that has not started out of the waiting queue (a client that left): it no
 * longer counts as waiting nor holds a place of --max-queued-requests until its turn would have
 * come. The queue's reference is dropped; 1 if it was there. */
int pd_srv_wait_remove(struct pd_server *s, struct req *r)
{
    struct req *prev = NULL;
    for (struct req *q = s->wait_head; q; prev = q, q = q->next) {
        if (q != r)
            continue;
        *(prev ? &prev->next : &s->wait_head) = r->next;
        if (s->wait_tail == r)
            s->wait_tail = prev;
        r->next = NULL;
        pd_srv_req_unref(s, r);
        return 1;
    }
    return 0;
}

int pd_srv_waiting(const struct pd_server *s, int at_most)
{
    int n = 0;
    for (const struct req *r = s->wait_head; r && n < at_most; r = r->next)
        n++;
    return n;
}

/* Draining: the loop ends once no request runs, waits, is being tokenized or (a prefill
 * instance's) holds a lease, or at the deadline. */
static void on_drain_tick(evutil_socket_t fd, short what, void *arg)
{
    struct pd_server *s = arg;
    pthread_mutex_lock(&s->mu);
    int left = s->n_running + (s->leases != NULL) + pd_srv_waiting(s, INT_MAX);
    pthread_mutex_unlock(&s->mu);
    left += s->n_tokenizing;   /* (prompts accepted before the drain, on their way to the queue) */
    /* an EP group whose round cannot progress (a rank died: mpirun's SIGTERM is followed by its
     * SIGKILL a second later) drains nothing: pd_server_run answers its clients at once */
    const int stuck = s->g && (pd_srv_ep_dead_rank(s) >= 0 ||
                               pd_srv_ep_stalled_ns(s) > (int64_t)PD_EP_STOP_STALL_MS * 1000000);
    if (!left || stuck || pd_now_s() >= s->drain_deadline) {
        if (left && !stuck)
            fprintf(stderr, "pdmoe serve: the shutdown timeout (%d s) ended the drain with %d requests left\n",
                    s->o.shutdown_timeout_s, left);
        event_base_loopexit(s->base, NULL);
    }
}

/* SIGINT or SIGTERM: with --shutdown-timeout the first one drains, the next stops at once. */
static void on_signal(evutil_socket_t sig, short what, void *arg)
{
    struct pd_server *s = arg;
    if (s->o.shutdown_timeout_s <= 0 || s->draining || !s->drain_tick) {
        event_base_loopexit(s->base, NULL);
        return;
    }
    s->draining = 1;
    s->drain_deadline = pd_now_s() + s->o.shutdown_timeout_s;
    fprintf(stderr, "pdmoe serve: draining: new requests are refused, those in flight finish (at most %d s; "
                    "another signal stops at once)\n", s->o.shutdown_timeout_s);
    event_add(s->drain_tick, &(struct timeval){0, 100000});
    on_drain_tick(-1, 0, s);
}

int pd_server_create(const struct pd_server_opts *o, struct pd_server **out, pd_err *e)
{
    struct pd_server *s = calloc(1, sizeof *s);
    if (!s)
        return pd_err_set(e, PD_ENOMEM, "out of memory");
    s->o = *o;
    s->created = (long long)time(NULL);
    if (!s->o.host)
        s->o.host = "127.0.0.1";
    if (s->o.max_num_seqs < 1)
        s->o.max_num_seqs = 16;
    if (s->o.max_num_batched_tokens < 1)
        s->o.max_num_batched_tokens = 512;
    if (s->o.max_model_len < 1)
        s->o.max_model_len = 2048;
    const char *base = strrchr(o->model_dir, '/');
    snprintf(s->name, sizeof s->name, "%s", o->served_name ? o->served_name : base && base[1] ? base + 1 : o->model_dir);
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->tok_mu, NULL);
    pthread_cond_init(&s->tok_cv, NULL);
    PD_HIST_INIT(&s->h_ttft, "pdmoe_time_to_first_token_seconds", "Completed requests: arrival to the first token.",
                 pd_hist_le_ttft);
    PD_HIST_INIT(&s->h_tpot, "pdmoe_time_per_output_token_seconds",
                 "Completed requests: time after the first token / (tokens - 1).", pd_hist_le_token);
    PD_HIST_INIT(&s->h_e2e, "pdmoe_e2e_request_latency_seconds", "Completed requests: arrival to the last token.",
                 pd_hist_le_e2e);
    /* the scheduler's timed waits measure durations: on the wall clock a step of it (NTP, date -s)
     * stretched each to its size (an EP group's pull unheard of for an hour) or made them spin */
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cv, &ca);
    pthread_condattr_destroy(&ca);
    int rc;
    char path[PATH_MAX];
    if ((rc = pd_dir_check("--model", o->model_dir, e)) ||
        (rc = pd_path_join(path, sizeof path, o->model_dir, "tokenizer.json", e)) || (rc = pd_tok_load(path, &s->tok, e)))
        goto fail;
    if ((rc = pd_chat_format_of(o->model_dir, &s->chat, e)))
        goto fail;
    if (o->spec_k < 0 || o->spec_k > PD_SPEC_MAX_K) {
        rc = pd_err_set(e, PD_EINVAL, "--speculative-config: num_speculative_tokens %d is outside [1, %d]", o->spec_k,
                        PD_SPEC_MAX_K);
        goto fail;
    }
    struct pd_engine_opts eo = {.dir = o->model_dir, .threads = o->threads, .max_seqs = s->o.max_num_seqs,
                                .max_model_len = s->o.max_model_len + o->spec_k, .kv_bytes = o->kv_cache_bytes,
                                .kv_dtype = o->kv_dtype, .mtp = o->spec_k > 0};
    if (o->expert_parallel && (rc = pd_srv_ep_open(s, &eo, e)))
        goto fail;
    eo.pool_copies = s->g ? s->g->local : 1;
    eo.pool_source = o->kv_cache_bytes ? "--kv-cache-memory-bytes" : "--max-num-seqs x --max-model-len";
    if ((rc = pd_engine_open(&s->en, &eo, e)))
        goto fail;
    if ((rc = pd_tok_check_vocab(s->tok, s->en.model.vocab_size, path, e)) ||
        (rc = pd_tok_check_special(s->tok, s->en.model.bos_token_id, s->en.model.eos_token_id, path, e)))
        goto fail;
    /* positions past the model's are not served (vLLM refuses them too): the rope was never
     * trained there, and /v1/models would advertise a context the model does not have */
    if (s->en.model.max_position_embeddings > 0 && s->o.max_model_len > s->en.model.max_position_embeddings) {
        rc = pd_err_set(e, PD_EINVAL, "--max-model-len %d: more than the model's max_position_embeddings %lld "
                        "(%s/config.json)", s->o.max_model_len, (long long)s->en.model.max_position_embeddings,
                        o->model_dir);
        goto fail;
    }
    s->V = (int)s->en.model.vocab_size;
    snprintf(s->fingerprint, sizeof s->fingerprint, "%016llx", (unsigned long long)s->en.w.fingerprint);
    s->Vs = pd_tok_vocab_size(s->tok) < s->V ? pd_tok_vocab_size(s->tok) : s->V;
    s->bos = pd_tok_bos(s->tok);
    s->eos = pd_tok_eos(s->tok);
    s->think_end = pd_tok_id_of(s->tok, "</think>");
    if (s->g && (rc = pd_srv_ep_setup(s, e)))
        goto fail;
    if ((rc = pd_srv_prefix_open(s, e)))
        goto fail;
    if (s->o.role != PD_ROLE_BOTH) {
        /* each rank of an EP group moves the KV of its own sequences: its own transfer engine
         * over its own pool, a producer rank k listening on kv_port + k */
        int listen = s->o.role != PD_ROLE_PRODUCER ? -1 : s->g && s->o.kv_port ? s->o.kv_port + s->g->rank : s->o.kv_port;
        /* the transfer engine allocates the pool's memory, so a peer on this host reads it
         * directly (kvxfer.h); the pool is still empty. It binds, and keeps UCX, to the
         * configured address: nothing listens elsewhere */
        struct pd_kvx_opts ko = {.listen_host = s->o.kv_host ? s->o.kv_host : s->o.host, .listen_port = listen,
                                 .region_len = s->en.kv.region_bytes + pd_srv_spec_area_bytes(s),
                                 .lease_ms = s->o.kv_lease_ms, .timeout_ms = s->o.kv_timeout_ms,
                                 .kv_dtype = (int)s->o.kv_dtype};
        if ((rc = pd_kvx_create(&ko, &s->kvx, e)))
            goto fail;
        pd_kvpool_move(&s->en.kv, pd_kvx_region(s->kvx));
        if (s->g) {
            /* rank 0 names the owner rank's port in kv_transfer_params */
            int port = pd_kvx_port(s->kvx);
            MPI_Gather(&port, 1, MPI_INT, s->g->kv_ports, 1, MPI_INT, 0, s->g->ep.comm);
            /* and its address: the ranks of a group spanning hosts each advertise their own */
            char host[sizeof *s->g->kv_hosts] = {0};
            snprintf(host, sizeof host, "%s", pd_srv_kv_host(s));
            MPI_Gather(host, (int)sizeof host, MPI_CHAR, s->g->kv_hosts, (int)sizeof host, MPI_CHAR, 0, s->g->ep.comm);
        }
        /* a producer progresses its worker when idle, to answer pulls; a consumer (each rank of
         * an EP group), to move its pulls while the sequences step */
        if ((rc = pd_thread_start(&s->kvx_thread, pd_srv_kvx_loop, s, "KV transfer thread", e)))
            goto fail;
        s->kvx_thread_started = 1;
    }
    if (s->g && s->g->rank != 0) {
        /* the other ranks of the group: no HTTP, no scheduler; pd_server_run takes the steps */
        if (o->handle_signals) {
            struct sigaction sa = {.sa_handler = pd_srv_ep_on_signal};
            sigaction(SIGINT, &sa, NULL);
            sigaction(SIGTERM, &sa, NULL);
        }
        *out = s;
        return 0;
    }
    /* an EP group runs up to max_num_seqs sequences on each rank */
    s->running = calloc((size_t)s->o.max_num_seqs * (s->g ? s->g->size : 1), sizeof *s->running);
    /* one more than the counts: a model without routed experts still gets a buffer */
    s->stats_sum = calloc((size_t)s->en.model.n_layers * s->en.model.n_routed_experts + 1, sizeof *s->stats_sum);
    evthread_use_pthreads();
    /* a client that disconnects must not kill the server with SIGPIPE */
    signal(SIGPIPE, SIG_IGN);
    if (!s->running || !s->stats_sum) {
        rc = pd_err_set(e, PD_ENOMEM, "out of memory");
        goto fail;
    }
    if ((rc = pd_http_base_new(&s->base, e)))
        goto fail;
    if ((rc = pd_http_front_new(s->base, &s->o.http, s->o.host, s->o.port, &s->front, e)))
        goto fail;
    s->port = pd_http_front_port(s->front);
    if (pd_srv_api_install(s)) {
        rc = pd_err_set(e, PD_ENOMEM, "out of memory");
        goto fail;
    }
    if ((rc = pd_srv_tok_start(s, e)))
        goto fail;
    if (s->o.handle_signals) {
        s->sigint = evsignal_new(s->base, SIGINT, on_signal, s);
        s->sigterm = evsignal_new(s->base, SIGTERM, on_signal, s);
        s->drain_tick = event_new(s->base, -1, EV_PERSIST, on_drain_tick, s);
        event_add(s->sigint, NULL);
        event_add(s->sigterm, NULL);
    }
    if ((rc = pd_thread_start(&s->thread, scheduler, s, "scheduler thread", e)))
        goto fail;
    s->thread_started = 1;
    /* a rank's death known at once (its connection to rank 0), now that the loop can answer */
    if (s->g && (rc = pd_srv_ep_live_start(s, e)))
        goto fail;
    *out = s;
    return 0;
fail:
    pd_server_destroy(s);
    return rc;
}

int pd_server_port(const struct pd_server *s)
{
    return s->port;
}

int pd_server_rank(const struct pd_server *s)
{
    return s->g ? s->g->rank : 0;
}

int pd_server_run(struct pd_server *s, pd_err *e)
{
    if (s->g && s->g->rank != 0) {
        int rc;
        while ((rc = pd_srv_ep_round(s, e)) == 0)
            ;
        if (rc > 0)
            pd_srv_ep_live_bye(s);   /* rank 0 ended the group: this rank's end is no death */
        return rc < 0 ? rc : 0;
    }
    if (event_base_dispatch(s->base) < 0)
        return pd_err_set(e, PD_EIO, "event loop failed");
    if (s->g) {
        pd_srv_ep_stop(s);   /* (does not return if a rank is gone) */
        pd_srv_ep_live_stop(s);   /* the ranks are ending: their connections close */
    }
    pthread_mutex_lock(&s->mu);
    int rc = s->fatal[0] ? pd_err_set(e, PD_EIO, "%s", s->fatal) : 0;
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int pd_server_rank0_gone(const struct pd_server *s)
{
    return s->g && s->g->rank0_gone;
}

void pd_server_stop(struct pd_server *s)
{
    if (s->base)
        event_base_loopexit(s->base, NULL);
}

void pd_server_destroy(struct pd_server *s)
{
    if (!s)
        return;
    /* the rank watch thread answers through the loop: it ends before the loop is freed */
    pd_srv_ep_live_stop(s);
    if (s->thread_started) {
        pthread_mutex_lock(&s->mu);
        s->stop = 1;
        pthread_cond_signal(&s->cv);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->thread, NULL);
    }
    if (s->kvx_thread_started) {
        pthread_mutex_lock(&s->mu);
        s->stop = 1;
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->kvx_thread, NULL);
    }
    /* destroying the transfer engine releases every lease (through on_release); an EP rank's
     * pulls are given up first */
    if (s->kvx) {
        pd_srv_ep_drop_pulls(s);
        pd_kvx_destroy(s->kvx);
    }
    while (s->released) {
        struct req *r = s->released;
        s->released = r->lease_next;
        pd_srv_prefix_release(s, r);
        if (r->started)
            pd_seq_end(&s->en, &r->seq);
        pd_srv_req_unref(s, r);
    }
    /* EP rank 0 holds the requests whose KV is under a lease on an owner rank; the owners'
     * engines end those leases as the group shuts down */
    while (s->leases) {
        struct req *r = s->leases;
        s->leases = r->lease_next;
        pd_srv_req_unref(s, r);
    }
    /* clients still waiting get an honest error, not a dropped connection */
    for (struct req *r = s->live, *nx; r; r = nx) {
        nx = r->live_next;
        struct evhttp_request *h = r->http;
        if (!h)
            continue;
        pd_srv_answer_shutdown(s, r);
    }
    for (int i = 0; i < s->n_stats_wait; i++)
        pd_srv_send_error(s, s->stats_wait[i], 503, "server_error", NULL, "the server is shutting down");
    /* and so do those whose prompts were being tokenized */
    int waited = s->n_stats_wait + pd_srv_tok_stop(s);
    s->n_stats_wait = 0;
    /* let the loop write those answers out (at most 200 ms) */
    if ((s->live || waited) && s->base) {
        struct timeval tv = {0, 200000};
        event_base_loopexit(s->base, &tv);
        event_base_dispatch(s->base);
    }
    /* open connections next: their close callbacks drop the HTTP side's references */
    s->destroying = 1;
    pd_http_front_free(s->front);
    /* then the scheduler's references of requests that never started, and the outbox's */
    while (s->wait_head) {
        struct req *r = s->wait_head;
        s->wait_head = r->next;
        pd_srv_req_unref(s, r);
    }
    while (s->outbox) {
        struct req *r = s->outbox;
        s->outbox = r->next;
        pd_srv_req_unref(s, r);
    }
    if (s->notify)
        event_free(s->notify);
    if (s->sigint)
        event_free(s->sigint);
    if (s->sigterm)
        event_free(s->sigterm);
    if (s->drain_tick)
        event_free(s->drain_tick);
    if (s->base)
        event_base_free(s->base);
    pd_srv_ep_close(s);
    pd_srv_prefix_close(s);
    if (s->en.w.layers)
        pd_engine_close(&s->en);
    pd_tok_free(s->tok);
    free(s->running);
    free(s->stats_wait);
    free(s->stats_sum);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->tok_mu);
    pthread_cond_destroy(&s->tok_cv);
    free(s);
}
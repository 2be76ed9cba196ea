/* An EP group with --speculative-config (MTP speculative decoding, engine/spec.h): the owner ranks
 * run each round's speculation for their own sequences, and rank 0 takes the tokens and counts.
 *
 * Every rank of a group must take the same engine steps, since each MoE layer's experts are
 * spread over the ranks and every step exchanges with all of them (ep/ep.h); the MTP layer is
 * one more MoE layer, its experts placed by the same rule. So from the round's message, which
 * every rank sees whole, each rank derives the same schedule:
 *   prefill  one main-model step if any item of the message prefills a prompt (the prompts of
 *            this rank's new sequences, or none);
 *   catch-up after it, on a prefill instance or with the prefix cache: one MTP step over the
 *            prompts' positions but the last (pd_spec_catch_up), which a hand-off or the
 *            cache's snapshots need now, for every prompt of the step (which ones need it
 *            depends on each rank's cache, which the others cannot see; running it for all is
 *            exact, the first round would run those positions anyway);
 *   round    if any item decodes: as many MTP drafting steps as the largest k of the message's
 *            items, then one verify step (pd_spec_round_steps), with this rank's decoding
 *            sequences or none.
 * The rest is the colocated server's: a sequence's MTP state (its pending hidden states, its MTP
 * KV as the pool's last layer, its undo logs) lives on its owner rank with its KV, so the rollback
 * is the colocated one, on the rank that holds what it restores. So does what a PD hand-off moves
 * (server_spec.c): a prefill rank writes the draft's input row of each sequence it prefilled into
 * its own transfer region, after the pool, and its lease's runs end with it; a decode rank pulls
 * into its own pool and row, and its draft resumes there (ep_pull). A cached prefix on a rank
 * holds the same state, and a sequence that rank starts from it resumes the draft (ep_start). */
#include "pd/server_int.h"

/* Words of one item in a rank's answer: its token, or with --speculative-config {n, up to k + 1
 * tokens}. */
int pd_srv_ep_item_words(const struct pd_server *s)
{
    return s->o.spec_k ? s->o.spec_k + 2 : 1;
}

/* Every rank: the speculative step of a round over this rank's n items (g->items, g->item_seq,
 * g->item_of from ep_apply), with the schedule above; item j's tokens go to its message item's
 * words of `out`, this rank's counts to `stats` (EP_SPEC_W words). */
int pd_srv_ep_spec_step(struct pd_server *s, const struct ep_msg *m, int n, int32_t *out, int32_t *stats, pd_err *e)
{
    struct ep_group *g = s->g;
    const int IW = pd_srv_ep_item_words(s);
    int any_new = 0, any_dec = 0, kmax = 0;
    const int catch_up = s->o.role == PD_ROLE_PRODUCER || s->prefix_on;
    for (int i = 0; i < m->n_items; i++) {
        const int32_t *w = m->it + (size_t)i * EP_ITEM_W;
        if (w[4]) {
            any_new = 1;
        } else {
            any_dec = 1;
            kmax = w[11] > kmax ? w[11] : kmax;
        }
    }
    if (kmax > s->o.spec_k)
        return pd_err_set(e, PD_EINVAL, "expert parallelism: a round drafts %d tokens, more than --speculative-config's %d",
                          kmax, s->o.spec_k);
    struct pd_spec_seq **pre = calloc((size_t)n + 1, sizeof *pre), **dec = calloc((size_t)n + 1, sizeof *dec);
    const int32_t **pr = calloc((size_t)n + 1, sizeof *pr);
    int *pn = calloc((size_t)n + 1, sizeof *pn);
    float **lg = calloc((size_t)n + 1, sizeof *lg);
    int rc = 0, np = 0, nd = 0;
    struct pd_spec_stats st = {0};
    if (!pre || !dec || !pr || !pn || !lg) {
        rc = pd_err_set(e, PD_ENOMEM, "expert parallelism: out of memory for a speculative round");
        goto out;
    }
    for (int j = 0; j < n; j++) {
        const int32_t *w = m->it + (size_t)g->item_of[j] * EP_ITEM_W;
        struct ep_seq *q = g->item_seq[j];
        const struct pd_step_item *it = &g->items[j];
        if (w[4]) {
            /* started by ep_start (or resumed there from a cached prefix) */
            q->spec.snaps = it->snaps;
            q->spec.n_snaps = it->n_snaps;
            pre[np] = &q->spec;
            pr[np] = it->tokens;
            pn[np] = it->n;
            lg[np++] = q->logits;
            continue;
        }
        /* a decoding sequence's next token is already in its MTP state: rank 0's copy must agree */
        struct pd_spec_seq *sp = &q->spec;
        if (it->n != 1 || sp->n < 1 || sp->n_tok != sp->n || sp->tok[sp->n - 1] != it->tokens[0]) {
            rc = pd_err_set(e, PD_EINVAL, "expert parallelism: rank %d: request %llu's speculative state does not "
                            "continue from the token rank 0 sent", g->rank, (unsigned long long)q->id);
            goto out;
        }
        sp->k = w[11];
        dec[nd++] = sp;
    }
    if (any_new && (rc = pd_spec_prefill(&s->en, pre, pr, pn, lg, np, e)))
        goto out;
    if (any_new && catch_up) {
        int ran = 0;
        for (int i = 0; i < np; i++) {
            pd_srv_spec_snap_rows(s, pre[i]);
            ran |= pre[i]->n > 1;
        }
        /* pd_spec_catch_up steps only for prompts of 2 tokens or more: an empty step keeps this
         * rank in the group's exchange otherwise */
        if ((rc = pd_spec_catch_up(&s->en, pre, np, e)) || (!ran && (rc = pd_engine_mtp_step(&s->en, NULL, 0, e))))
            goto out;
        for (int i = 0; i < np && s->o.role == PD_ROLE_PRODUCER; i++)
            pd_srv_spec_put_row(s, pre[i]);
    }
    if (any_dec && (rc = pd_spec_round_steps(&s->en, dec, nd, s->Vs, kmax, &st, e)))
        goto out;
    for (int j = 0; j < n; j++) {
        const int32_t *w = m->it + (size_t)g->item_of[j] * EP_ITEM_W;
        struct ep_seq *q = g->item_seq[j];
        int32_t *o = out + (size_t)g->item_of[j] * IW;
        if (w[4]) {
            /* just prefilled: its first token, which the next round verifies first */
            int32_t t = w[6] >= 0 ? w[6] : pd_sample(&q->smp, q->logits, s->Vs, g->scratch);
            if ((rc = pd_spec_push(&q->spec, t, e)))
                goto out;
            o[0] = 1;
            o[1] = t;
        } else {
            o[0] = q->spec.n_out;
            memcpy(o + 1, q->spec.out, (size_t)q->spec.n_out * sizeof *o);
        }
    }
    stats[0] = (int32_t)st.drafts;
    stats[1] = (int32_t)st.draft_tokens;
    stats[2] = (int32_t)st.accepted;
    stats[3] = (int32_t)st.emitted;
    stats[4] = (int32_t)st.steps;
    for (int j = 0; j < PD_SPEC_MAX_K; j++) {
        stats[5 + j] = (int32_t)st.drafted_per_pos[j];
        stats[5 + PD_SPEC_MAX_K + j] = (int32_t)st.accepted_per_pos[j];
    }
out:
    /* the boundaries the prefills passed enter this rank's cache (dropped if the step failed) */
    for (int j = 0; j < n; j++) {
        struct ep_seq *q = g->item_seq[j];
        q->spec.snaps = NULL;   /* the cursor's */
        q->spec.n_snaps = 0;
        if (q->cached)
            pd_prefix_commit(&s->prefix, &q->pcur, &q->seq.kv, rc == 0);
    }
    free(pre);
    free(dec);
    free(pr);
    free(pn);
    free(lg);
    return rc;
}

/* Rank 0 after a step's round: request i's new tokens, tp[i][0 .. nt[i]) (pointing into the
 * gathered answers, valid until the next round), and the group's counts added to st. */
int pd_srv_ep_spec_take(struct pd_server *s, struct req **in_step, int m, const int32_t **tp, int *nt,
                        struct pd_spec_stats *st, pd_err *e)
{
    struct ep_group *g = s->g;
    for (int i = 0; i < m; i++) {
        const int32_t *a = pd_srv_ep_answer_item(s, in_step[i]->owner, i);
        if (a[0] < 1 || a[0] > s->o.spec_k + 1)
            return pd_err_set(e, PD_EIO, "expert parallelism: rank %d answered %d tokens for request %llu",
                              in_step[i]->owner, a[0], (unsigned long long)in_step[i]->id);
        nt[i] = a[0];
        tp[i] = a + 1;
    }
    for (int k = 0; k < g->size; k++) {
        const int32_t *c = pd_srv_ep_answer_spec(s, k);
        st->drafts += c[0];
        st->draft_tokens += c[1];
        st->accepted += c[2];
        st->emitted += c[3];
        st->steps += c[4];
        for (int j = 0; j < PD_SPEC_MAX_K; j++) {
            st->drafted_per_pos[j] += c[5 + j];
            st->accepted_per_pos[j] += c[5 + PD_SPEC_MAX_K + j];
        }
    }
    return 0;
}

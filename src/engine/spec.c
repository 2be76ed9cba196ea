/* Speculative decoding with the MTP layer: draft, verify, accept, roll back (spec.h). */
#include "engine/spec.h"
#include "model/jsonf.h"

#include <stdlib.h>
#include <string.h>

void pd_spec_init(struct pd_spec_seq *ss, struct pd_seq *seq, struct pd_sampler *smp)
{
    memset(ss, 0, sizeof *ss);
    ss->seq = seq;
    ss->smp = smp;
}

void pd_spec_free(struct pd_spec_seq *ss)
{
    free(ss->hid);
    free(ss->tok);
    free(ss->buf);
    ss->hid = NULL;
    ss->tok = NULL;
    ss->buf = NULL;
    ss->n = ss->n_tok = ss->cap = 0;
    ss->buf_cap = 0;
}

static int grow(struct pd_spec_seq *ss, int n, size_t row, pd_err *e)
{
    if (n <= ss->cap)
        return 0;
    int c = n + n / 2 + 4;
    float *h = realloc(ss->hid, (size_t)c * row * sizeof(float));
    if (h)
        ss->hid = h;
    int32_t *t = realloc(ss->tok, (size_t)c * sizeof *t);
    if (t)
        ss->tok = t;
    if (!h || !t)
        return pd_err_set(e, PD_ENOMEM, "speculative decoding: out of memory");
    ss->cap = c;
    return 0;
}

static size_t hrow(const struct pd_engine *en)
{
    return (size_t)en->model.hc_mult * en->model.hidden_size;
}

int pd_spec_prefill(struct pd_engine *en, struct pd_spec_seq **ss, const int32_t *const *prompt, const int *n,
                    float *const *logits, int n_seqs, pd_err *e)
{
    const size_t row = hrow(en);
    struct pd_step_item *items = calloc((size_t)n_seqs + 1, sizeof *items);
    if (!items)
        return pd_err_set(e, PD_ENOMEM, "speculative decoding: out of memory");
    int rc = 0;
    for (int i = 0; i < n_seqs && !rc; i++) {
        struct pd_spec_seq *s = ss[i];
        /* new, or resumed from a cached prefix: its one pending input awaits the prompt's next token */
        int resumed = s->n == 1 && s->n_tok == 0 && s->seq->mtp_pos + 1 == s->seq->pos;
        if (n[i] < 1 || (!resumed && (s->n || s->seq->pos)))
            rc = pd_err_set(e, PD_EINVAL, "speculative prefill: sequence %d is neither new nor resumed", i);
        else if (!(rc = grow(s, s->n + n[i], row, e)))
            items[i] = (struct pd_step_item){.seq = s->seq, .tokens = prompt[i], .n = n[i], .logits = logits[i],
                                             .hidden = s->hid + (size_t)s->n * row, .snaps = s->snaps,
                                             .n_snaps = s->n_snaps};
    }
    if (!rc)
        rc = pd_engine_step(en, items, n_seqs, e);
    for (int i = 0; i < n_seqs && !rc; i++) {
        struct pd_spec_seq *s = ss[i];
        /* the token after each pending position but the last, which is sampled next */
        if (s->n)
            s->tok[s->n_tok++] = prompt[i][0];
        memcpy(s->tok + s->n_tok, prompt[i] + 1, (size_t)(n[i] - 1) * sizeof(int32_t));
        s->n += n[i];
        s->n_tok += n[i] - 1;
    }
    free(items);
    return rc;
}

int pd_spec_push(struct pd_spec_seq *ss, int32_t token, pd_err *e)
{
    if (ss->n_tok != ss->n - 1)
        return pd_err_set(e, PD_EINVAL, "speculative decoding: a token pushed where none is awaited");
    ss->tok[ss->n_tok++] = token;
    return 0;
}

size_t pd_spec_row_bytes(const struct pd_engine *en)
{
    return hrow(en) * sizeof(float);
}

int pd_spec_catch_up(struct pd_engine *en, struct pd_spec_seq **ss, int n_seqs, pd_err *e)
{
    const size_t row = hrow(en);
    struct pd_step_item *items = calloc((size_t)n_seqs + 1, sizeof *items);
    if (!items)
        return pd_err_set(e, PD_ENOMEM, "speculative decoding: out of memory for the hand-off's MTP step");
    int rc = 0, m = 0;
    for (int i = 0; i < n_seqs && !rc; i++) {
        struct pd_spec_seq *s = ss[i];
        if (s->n < 1 || s->n_tok != s->n - 1 || s->seq->mtp_pos + s->n != s->seq->pos)
            rc = pd_err_set(e, PD_EINVAL, "speculative catch-up: sequence %d is not just prefilled", i);
        else if (s->n > 1)
            items[m++] = (struct pd_step_item){.seq = s->seq, .tokens = s->tok, .n = s->n - 1, .hidden_in = s->hid,
                                               .snaps = s->snaps, .n_snaps = s->n_snaps};
    }
    if (!rc && m)
        rc = pd_engine_mtp_step(en, items, m, e);
    for (int i = 0; i < n_seqs && !rc; i++) {
        struct pd_spec_seq *s = ss[i];
        /* the positions run leave the pending inputs: h_{n-1} stays, awaiting the first token */
        memmove(s->hid, s->hid + (size_t)(s->n - 1) * row, row * sizeof(float));
        s->n = 1;
        s->n_tok = 0;
    }
    free(items);
    return rc;
}

int pd_spec_resume(struct pd_engine *en, struct pd_spec_seq *ss, struct pd_seq *seq, struct pd_sampler *smp,
                   const float *row, pd_err *e)
{
    if (seq->pos < 1)
        return pd_err_set(e, PD_EINVAL, "speculative resume: the sequence holds no token");
    pd_spec_init(ss, seq, smp);
    if (grow(ss, 1, hrow(en), e))
        return PD_ENOMEM;
    memcpy(ss->hid, row, pd_spec_row_bytes(en));
    ss->n = 1;
    seq->mtp_pos = seq->pos - 1;
    return 0;
}

int pd_spec_handoff_receive(struct pd_engine *en, struct pd_spec_seq *ss, struct pd_seq *seq, struct pd_sampler *smp,
                            const float *row, int32_t first, pd_err *e)
{
    int rc = pd_spec_resume(en, ss, seq, smp, row, e);
    return rc ? rc : pd_spec_push(ss, first, e);
}

double pd_spec_accept_prob(const float *p, const float *q, int32_t d)
{
    double qd = q ? q[d] : 1.0;
    if (qd <= 0)
        return 1;
    double a = p[d] / qd;
    return a < 1 ? a : 1;
}

void pd_spec_residual(const float *p, const float *q, int n, int32_t d, float *r)
{
    double sum = 0;
    for (int i = 0; i < n; i++) {
        double qi = q ? q[i] : (i == d ? 1.0 : 0.0);
        r[i] = p[i] > qi ? (float)(p[i] - qi) : 0;
        sum += r[i];
    }
    for (int i = 0; i < n; i++)
        r[i] = sum > 0 ? (float)(r[i] / sum) : 0;
}

int32_t pd_spec_verify_token(struct pd_sampler *s, const float *p, const float *q, int n, int32_t d, float *resid,
                             int *accepted)
{
    double a = pd_spec_accept_prob(p, q, d);
    *accepted = pd_sampler_uniform(s) < a;
    if (*accepted)
        return d;
    pd_spec_residual(p, q, n, d, resid);
    return pd_sample_weights(s, resid, n);
}

/* The first index of the largest of x[0 .. n) (ties to the lower id): the greedy draft. */
static int32_t argmax(const float *x, int n)
{
    int32_t b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

/* One sequence's buffers for a round. */
struct rbuf {
    float *dlog;                   /* [vocab] the draft's logits */
    float *g[2];                   /* [max(n, 1), hc, hidden] the MTP layer's output, alternating */
    int32_t draft[PD_SPEC_MAX_K];
    int32_t vtok[PD_SPEC_MAX_K + 1];
    float *vlog;                   /* [k + 1, vocab] the main model's logits at p .. p+k */
    float *vhid;                   /* [k + 1, hc, hidden] its hidden states there */
    int64_t p;                     /* the position of the verified token t_p */
};

static int accept(struct pd_engine *en, struct pd_spec_seq *s, struct rbuf *b, int vocab, float *scr,
                  struct pd_spec_stats *st)
{
    const int V = (int)en->model.vocab_size;
    struct pd_sampler *smp = s->smp;
    int a = 0;
    s->n_out = 0;
    for (; a < s->k; a++) {
        const float *row = b->vlog + (size_t)a * V;
        int32_t d = b->draft[a], t;
        int ok;
        if (smp->temperature <= 0) {
            t = pd_sample(smp, row, vocab, scr);   /* greedy: the main model's token */
            ok = t == d;
        } else {
            float *p = scr + 2 * (size_t)vocab, *r = p + vocab;
            pd_sampler_probs(smp, row, vocab, p, scr);
            t = pd_spec_verify_token(smp, p, NULL, vocab, d, r, &ok);
        }
        st->drafted_per_pos[a]++;
        if (!ok) {
            s->out[s->n_out++] = t;
            break;
        }
        st->accepted_per_pos[a]++;
        s->out[s->n_out++] = d;
    }
    for (int j = a + 1; j < s->k; j++)
        st->drafted_per_pos[j]++;
    if (a == s->k)   /* every draft accepted: one more token from the main logits after the last */
        s->out[s->n_out++] = pd_sample(smp, b->vlog + (size_t)a * V, vocab, scr);
    if (s->k) {
        st->drafts++;
        st->draft_tokens += s->k;
    }
    st->accepted += a;
    st->emitted += s->n_out;
    if (s->out_logits)
        memcpy(s->out_logits, b->vlog, (size_t)s->n_out * V * sizeof(float));
    st->steps++;
    return a;
}

int pd_spec_round(struct pd_engine *en, struct pd_spec_seq **ss, int n_seqs, int vocab, struct pd_spec_stats *st,
                  pd_err *e)
{
    int kmax = 0;
    for (int i = 0; i < n_seqs; i++)
        kmax = ss[i]->k > kmax ? ss[i]->k : kmax;
    return pd_spec_round_steps(en, ss, n_seqs, vocab, kmax, st, e);
}

int pd_spec_round_steps(struct pd_engine *en, struct pd_spec_seq **ss, int n_seqs, int vocab, int draft_steps,
                        struct pd_spec_stats *st, pd_err *e)
{
    const int V = (int)en->model.vocab_size;
    const size_t row = hrow(en);
    int rc = 0, kmax = draft_steps;
    struct rbuf *b = calloc((size_t)n_seqs + 1, sizeof *b);
    struct pd_step_item *items = calloc((size_t)n_seqs + 1, sizeof *items);
    float *scr = malloc((size_t)vocab * 4 * sizeof(float));
    if (!b || !items || !scr) {
        rc = pd_err_set(e, PD_ENOMEM, "speculative decoding: out of memory");
        goto out;
    }
    for (int i = 0; i < n_seqs; i++) {
        struct pd_spec_seq *s = ss[i];
        if (s->k < 0 || s->k > PD_SPEC_MAX_K || (s->k && !en->mtp) || s->n_tok != s->n || s->n < 1) {
            rc = pd_err_set(e, PD_EINVAL, "speculative round: sequence %d is not ready (k %d, %d hidden states, %d tokens)",
                            i, s->k, s->n, s->n_tok);
            goto out;
        }
        if (s->k > draft_steps) {
            rc = pd_err_set(e, PD_EINVAL, "speculative round: sequence %d drafts %d tokens, the round %d", i, s->k,
                            draft_steps);
            goto out;
        }
        b[i].p = s->seq->pos;
        /* the round's buffers, kept in the sequence between rounds (a decode step allocates
         * nothing once they are grown) */
        size_t need = (size_t)V + (size_t)s->n * row + row + (size_t)(s->k + 1) * (V + row);
        if (need > s->buf_cap) {
            float *x = realloc(s->buf, need * sizeof(float));
            if (!x) {
                rc = pd_err_set(e, PD_ENOMEM, "speculative decoding: out of memory");
                goto out;
            }
            s->buf = x;
            s->buf_cap = need;
        }
        b[i].dlog = s->buf;
        b[i].g[0] = b[i].dlog + V;
        b[i].g[1] = b[i].g[0] + (size_t)s->n * row;
        b[i].vlog = b[i].g[1] + row;
        b[i].vhid = b[i].vlog + (size_t)(s->k + 1) * V;
    }
    /* draft: d_j from the MTP layer at position p+j-2 (the first step also runs every position
     * it has not run yet: those are exact and stay; the later ones are recorded for undo) */
    if (draft_steps < 0 || draft_steps > PD_SPEC_MAX_K || (draft_steps && !en->mtp)) {
        rc = pd_err_set(e, PD_EINVAL, "speculative round: %d drafting steps (0 .. %d, and only with the MTP layer)",
                        draft_steps, PD_SPEC_MAX_K);
        goto out;
    }
    for (int j = 1; j <= kmax; j++) {
        int m = 0;
        for (int i = 0; i < n_seqs; i++) {
            struct pd_spec_seq *s = ss[i];
            if (s->k < j)
                continue;
            if (j == 1)
                items[m++] = (struct pd_step_item){.seq = s->seq, .tokens = s->tok, .n = s->n, .hidden_in = s->hid,
                                                   .logits = b[i].dlog, .hidden = b[i].g[0]};
            else
                items[m++] = (struct pd_step_item){
                    .seq = s->seq, .tokens = &b[i].draft[j - 2], .n = 1, .undo = 1, .logits = b[i].dlog,
                    .hidden_in = j == 2 ? b[i].g[0] + (size_t)(s->n - 1) * row : b[i].g[j % 2],
                    .hidden = b[i].g[(j + 1) % 2]};
        }
        if ((rc = pd_engine_mtp_step(en, items, m, e)))
            goto out;
        for (int i = 0; i < n_seqs; i++)
            if (ss[i]->k >= j) {
                ss[i]->draft[j - 1] = b[i].draft[j - 1] = argmax(b[i].dlog, vocab);
                if (ss[i]->draft_logits)
                    memcpy(ss[i]->draft_logits + (size_t)(j - 1) * V, b[i].dlog, (size_t)V * sizeof(float));
            }
    }
    /* verify: [t_p, d_1 .. d_k] through the main model, recorded for undo */
    for (int i = 0; i < n_seqs; i++) {
        struct pd_spec_seq *s = ss[i];
        b[i].vtok[0] = s->tok[s->n - 1];
        memcpy(b[i].vtok + 1, b[i].draft, (size_t)s->k * sizeof(int32_t));
        items[i] = (struct pd_step_item){.seq = s->seq, .tokens = b[i].vtok, .n = s->k + 1, .undo = s->k > 0,
                                         .all_logits = b[i].vlog, .hidden = b[i].vhid};
    }
    if ((rc = pd_engine_step(en, items, n_seqs, e)))
        goto out;
    for (int i = 0; i < n_seqs; i++) {
        struct pd_spec_seq *s = ss[i];
        int a = accept(en, s, &b[i], vocab, scr, st);
        /* keep t_p and the accepted drafts; the MTP layer keeps what it ran before drafting */
        int64_t mtp_keep = s->k ? b[i].p : s->seq->mtp_pos;
        if ((rc = pd_engine_rollback(en, s->seq, b[i].p + a + 1, mtp_keep, e)))
            goto out;
        /* the MTP layer's next inputs: positions p .. p+a with the token after each */
        int keep = s->k ? 0 : s->n;
        if ((rc = grow(s, keep + a + 1, row, e)))
            goto out;
        memcpy(s->hid + (size_t)keep * row, b[i].vhid, (size_t)(a + 1) * row * sizeof(float));
        memcpy(s->tok + keep, s->out, (size_t)(a + 1) * sizeof(int32_t));
        s->n = s->n_tok = keep + a + 1;
    }
out:
    free(b);
    free(items);
    free(scr);
    return rc;
}

int pd_spec_config_parse(const char *json, int *k, pd_err *e)
{
    const char *label = "--speculative-config";
    json_t *o = pd_json_load_str(json, label, e);
    if (!o)
        return PD_EINVAL;
    int rc = 0;
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v) {
        if (strcmp(key, "method") && strcmp(key, "num_speculative_tokens")) {
            rc = pd_err_set(e, PD_EINVAL, "%s: key \"%s\" is not supported (only \"method\": \"mtp\" and "
                            "\"num_speculative_tokens\")", label, key);
            break;
        }
    }
    struct pd_jsrc s = {label, ""};
    char method[32];
    if (!rc && !(rc = pd_json_str(&s, o, "method", 1, "", method, sizeof method, e)) && strcmp(method, "mtp"))
        rc = pd_err_set(e, PD_EINVAL, "%s: method \"%s\" is not supported (only \"mtp\": the checkpoint's MTP layer)",
                        label, method);
    if (!rc)
        rc = pd_json_i32(&s, o, "num_speculative_tokens", 1, 1, 1, PD_SPEC_MAX_K, k, e);
    json_decref(o);
    return rc;
}

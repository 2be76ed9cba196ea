/* Speculative decoding (engine/spec.h) across a PD hand-off and from a cached prefix: what the MTP
 * draft needs on the decode side (or in a sequence started from a cached prefix), and how it gets
 * there.
 *
 * The draft's first round on the decode side runs the MTP layer at the prompt's last position
 * n-1, reading the MTP layer's KV of positions 0 .. n-2 (window ring, compressor state, compressed
 * entries: one more layer of the pool) and the main model's hidden state h_{n-1} after the last
 * block (every hc stream, [hc, hidden] fp32), with the prefill's first token. So:
 *   - the producer runs the MTP layer over positions 0 .. n-2 right after its prefill step (each
 *     needs only the prompt: h_i and token i+1), so its pool holds that layer's KV like any other
 *     layer's and the hand-off's runs carry it unchanged;
 *   - h_{n-1} rides in the same transfer: the transfer engine's region is the pool followed by
 *     one draft-state row per pool slot (hc * hidden fp32), and a sequence's runs end with its
 *     slot's row. The producer writes the row after prefill; the consumer, after the pull, makes
 *     it the MTP layer's pending input (mtp_pos = n-1), exactly the state a colocated sequence has
 *     after its prefill and its first MTP positions.
 * Handed off rather than rebuilt: rebuilding h_{n-1} would mean running the main model at n-1
 * again (its slot state has already moved past it) or sending every prompt position's hidden
 * state; the row is hc * hidden * 4 bytes (1 KiB for v4-tiny, 64 KiB for V4-Flash), one more get.
 * Both sides must run the same --speculative-config: the producer names its k in
 * kv_transfer_params (num_speculative_tokens, 0 without speculation) and the consumer refuses a
 * request whose k differs from its own (server_api.c).
 * A cached prefix of B tokens is the same cut at B: its snapshot holds the MTP layer's state after
 * position B-2 (the pool's MTP layer lags one position: kvpool.h) and, as the cache's extra bytes,
 * h_{B-1}; a request started from it resumes the draft there (server_prefix.c).
 * In an EP group all of this happens on the rank that owns the sequence (server_ep_spec.c calls
 * the pd_srv_spec_* helpers below with that rank's sequences): each rank's transfer engine serves
 * its own pool and rows, and a decode rank pulls into its own. */
#include "pd/server_int.h"

static size_t row_bytes(const struct pd_server *s)
{
    return pd_spec_row_bytes(&s->en);
}

size_t pd_srv_spec_area_bytes(const struct pd_server *s)
{
    return s->en.mtp && s->o.role != PD_ROLE_BOTH ? (size_t)s->en.kv.n_slots * row_bytes(s) : 0;
}

/* The draft-state row of slot `slot`: its offset in the transfer engine's region. */
static uint64_t row_off(const struct pd_server *s, int slot)
{
    return (uint64_t)s->en.kv.region_bytes + (uint64_t)slot * row_bytes(s);
}

struct pd_kv_run *pd_srv_kv_runs(const struct pd_server *s, const struct pd_seq *q, int len, int *n, uint64_t *bytes)
{
    uint64_t b = 0;
    struct pd_kv_run *runs = pd_kvseq_runs_alloc(&s->en.kv, &q->kv, len, n, &b);
    if (runs && pd_srv_spec_area_bytes(s)) {
        struct pd_kv_run *r = realloc(runs, (size_t)(*n + 1) * sizeof *r);
        if (!r) {
            free(runs);
            return NULL;
        }
        runs = r;
        runs[(*n)++] = (struct pd_kv_run){.off = row_off(s, q->kv.slot), .len = row_bytes(s)};
        b += row_bytes(s);
    }
    if (bytes)
        *bytes = b;
    return runs;
}

void pd_srv_spec_snap_rows(struct pd_server *s, struct pd_spec_seq *x)
{
    const size_t row = row_bytes(s), rowf = row / sizeof(float);
    /* a cached boundary B keeps the draft's input there, h_{B-1} (pending row B-1 - mtp_pos) */
    for (int j = 0; j < x->n_snaps; j++)
        memcpy(x->snaps[j].buf + pd_kvsnap_bytes(&s->en.kv, x->snaps[j].pos),
               x->hid + (size_t)(x->snaps[j].pos - 1 - x->seq->mtp_pos) * rowf, row);
}

void pd_srv_spec_put_row(struct pd_server *s, const struct pd_spec_seq *x)
{
    memcpy(s->en.kv.region + row_off(s, x->seq->kv.slot), x->hid, row_bytes(s));
}

int pd_srv_spec_receive(struct pd_server *s, struct pd_spec_seq *x, struct pd_seq *q, struct pd_sampler *smp,
                        int32_t first, pd_err *e)
{
    if (!s->en.mtp)
        return 0;
    return pd_spec_handoff_receive(&s->en, x, q, smp, (const float *)(s->en.kv.region + row_off(s, q->kv.slot)), first,
                                   e);
}

/* Just prefilled (pd_spec_prefill): every position pending, the first token not yet pushed. */
static int just_prefilled(const struct req *r)
{
    return r->n_gen == 0 && r->spec.n >= 1 && r->spec.n_tok == r->spec.n - 1;
}

int pd_srv_spec_prefilled(struct pd_server *s, struct req **in, int m, pd_err *e)
{
    struct pd_spec_seq **ss = calloc((size_t)m + 1, sizeof *ss);
    if (!ss)
        return pd_err_set(e, PD_ENOMEM, "speculative decoding: out of memory after a prefill");
    int n = 0;
    for (int i = 0; i < m; i++) {
        struct req *r = in[i];
        struct pd_spec_seq *x = &r->spec;
        if (!just_prefilled(r))
            continue;
        pd_srv_spec_snap_rows(s, x);
        /* the MTP layer runs now what the snapshots or the hand-off need */
        if (x->n_snaps || (r->remote_decode && s->o.role == PD_ROLE_PRODUCER))
            ss[n++] = x;
    }
    int rc = n ? pd_spec_catch_up(&s->en, ss, n, e) : 0;
    /* a hand-off's row goes where its last run reads it */
    for (int i = 0; i < m && !rc; i++)
        if (in[i]->remote_decode && s->o.role == PD_ROLE_PRODUCER && just_prefilled(in[i]))
            pd_srv_spec_put_row(s, &in[i]->spec);
    for (int i = 0; i < m; i++) {
        in[i]->spec.snaps = NULL;   /* the cursor's: committed after the step */
        in[i]->spec.n_snaps = 0;
    }
    free(ss);
    return rc;
}

int pd_srv_spec_pulled(struct pd_server *s, struct req *r, pd_err *e)
{
    return pd_srv_spec_receive(s, &r->spec, &r->seq, &r->smp, r->forced_first, e);
}

/* The server's prefix cache (engine/prefix.h): a request starts from the longest cached prefix
 * of its prompt and prefills only the rest; its prefill step snapshots every unit boundary it
 * passes, which later requests reuse. In an EP group every rank caches its own sequences' prefixes
 * in its own pool (the pd_srv_prefix_seq_* functions, called from server_ep.c on the owner rank;
 * rank 0 routes a prompt to the rank likely to hold its prefix). With --speculative-config a
 * snapshot also holds the MTP layer's state and the draft's input at its boundary (server_spec.c),
 * and a request started from it resumes the draft there (in an EP group on the owner rank:
 * ep_start in server_ep.c, the snapshots' rows in server_ep_spec.c).
 * Everything here runs on the thread that steps the engine (the scheduler, or a rank's loop). */
#include "pd/server_int.h"

int pd_srv_prefix_open(struct pd_server *s, pd_err *e)
{
    if (s->o.prefix_caching < 0)
        return 0;
    const struct pd_kvpool *kv = &s->en.kv;
    int unit = s->o.prefix_cache_unit > 0 ? s->o.prefix_cache_unit : PD_SRV_PREFIX_UNIT;
    /* snapshots: four times the slots' bytes, and at least one snapshot */
    size_t budget = 4 * (size_t)kv->n_slots * kv->slot_bytes;
    /* with MTP each node also keeps the draft's input at its boundary (server_spec.c) */
    size_t extra = s->en.mtp ? pd_spec_row_bytes(&s->en) : 0, one = pd_kvsnap_bytes(kv, unit) + extra;
    int rc = pd_prefix_init(&s->prefix, &s->en.kv, unit, budget > one ? budget : one, e);
    if (!rc) {
        s->prefix.extra = extra;
        s->prefix_on = 1;
    }
    return rc;
}

void pd_srv_prefix_close(struct pd_server *s)
{
    if (s->prefix_on)
        pd_prefix_free(&s->prefix);
    s->prefix_on = 0;
}

int pd_srv_prefix_start(struct pd_server *s, struct req *r, pd_err *e)
{
    int rc = pd_srv_prefix_seq_start(s, &r->seq, &r->pcur, r->prompt, r->n_prompt, (int64_t)r->n_prompt + r->max_tokens,
                                     e);
    /* the draft resumes at the boundary: the MTP layer one behind, its input from the node */
    if (!rc && r->pcur.node && s->en.mtp &&
        (rc = pd_spec_resume(&s->en, &r->spec, &r->seq, &r->smp, pd_prefix_node_extra(&s->prefix, r->pcur.node), e))) {
        pd_spec_free(&r->spec);
        r->spec.seq = NULL;
        pd_prefix_release(&s->prefix, &r->pcur);
        pd_seq_end(&s->en, &r->seq);
    }
    if (!rc)
        r->cached = 1;
    return rc;
}

int pd_srv_prefix_seq_start(struct pd_server *s, struct pd_seq *seq, struct pd_prefix_cursor *cur,
                            const int32_t *prompt, int n_prompt, int64_t total, pd_err *e)
{
    struct pd_kvpool *kv = &s->en.kv;
    struct pd_prefix_node *x = pd_prefix_lookup(&s->prefix, prompt, n_prompt);
    /* the blocks it takes: all its tokens' but the cached prefix's full ones; unused cached
     * prefixes give theirs back first, so the cache never keeps out a request that fits */
    int need = pd_kvpool_blocks_for(kv, total) - pd_prefix_node_blocks(&s->prefix, x);
    if (kv->n_slots_free == 0)
        return pd_err_set(e, PD_ENOMEM, "KV pool full: all %d sequence slots are in use", kv->n_slots);
    if (pd_prefix_make_room(&s->prefix, need, x))
        return pd_err_set(e, PD_ENOMEM, "KV pool full: %d more blocks needed for %lld tokens, %d free of %d", need,
                          (long long)total, kv->n_blocks_free, kv->n_blocks);
    int rc = pd_seq_start(&s->en, seq, e);
    if (rc)
        return rc;
    if (!(rc = pd_prefix_attach(&s->prefix, x, &seq->kv, cur, n_prompt, e))) {
        seq->pos = pd_prefix_node_len(x);
        rc = pd_kvseq_reserve_prompt(kv, &seq->kv, n_prompt, total, e);
    }
    if (rc) {
        pd_prefix_release(&s->prefix, cur);
        pd_seq_end(&s->en, seq);
        return rc;
    }
    return 0;
}

void pd_srv_prefix_make_room(struct pd_server *s, int64_t tokens)
{
    if (s->prefix_on)
        pd_prefix_make_room(&s->prefix, pd_kvpool_blocks_for(&s->en.kv, tokens), NULL);
}

void pd_srv_prefix_plan(struct pd_server *s, struct req *r, struct pd_step_item *it)
{
    if (r->cached)
        pd_srv_prefix_seq_plan(s, &r->pcur, r->prompt, r->n_prompt, it);
}

void pd_srv_prefix_seq_plan(struct pd_server *s, struct pd_prefix_cursor *cur, const int32_t *prompt, int n_prompt,
                            struct pd_step_item *it)
{
    pd_err e = {0};
    if (pd_prefix_plan(&s->prefix, cur, prompt, it->seq->pos, n_prompt, &it->snaps, &it->n_snaps, &e) && s->o.http.log)
        s->o.http.log(s->o.http.log_arg, e.msg);   /* the request goes on, uncached */
}

void pd_srv_prefix_commit(struct pd_server *s, struct req *r, int ok)
{
    if (r->cached)
        pd_prefix_commit(&s->prefix, &r->pcur, &r->seq.kv, ok);
}

void pd_srv_prefix_release(struct pd_server *s, struct req *r)
{
    if (r->cached)
        pd_prefix_release(&s->prefix, &r->pcur);
    r->cached = 0;
}

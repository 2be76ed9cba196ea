/* The speculative hand-off (spec.h, pd_spec_catch_up, pd_spec_handoff_receive): a sequence
 * prefilled on one side, its MTP layer run over the prompt there, its pool bytes copied run by run
 * into another sequence and its last hidden state passed as the row, drafts on the other side
 * exactly as a colocated sequence does: every round's draft logits, drafts, tokens and verify
 * logits equal, bit for bit, for k = 1..3 and prompts of 1 token, shorter than the window, ending
 * mid-block and past a block; with MTP layers of ratio 0 (V4's), 4 and 16. The same for a sequence
 * started from a cached prefix (engine/prefix.h: the MTP layer's state one position behind, the
 * draft's input as the node's extra bytes, pd_spec_resume) against one computing its prompt. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "../tmpmodel.h"
#include "engine/engine.h"
#include "engine/genmodel.h"
#include "engine/prefix.h"
#include "engine/sampler.h"
#include "engine/spec.h"
#include "model/config.h"
#include <stdio.h>

static char dir[64];

static void make_tiny(void)
{
    /* a random checkpoint: its draft depends on the hidden state and the MTP layer's KV throughout */
    tmp_model("v4-tiny", 7, dir, sizeof dir);
}

static void remove_tiny(void)
{
    rm_model(dir);
}

TestSuite(spec_handoff, .init = make_tiny, .fini = remove_tiny, .timeout = 240);

/* v4-tiny with an MTP layer of compress_ratio `ratio` (V4's own is window-only, ratio 0): its
 * compressor state and compressed entries (and a ratio-4 layer's indexer keys) are handed off
 * too. The model goes to `out`. */
static void tiny_with_mtp_ratio(int ratio, char *out, size_t n)
{
    static char text[1 << 16];
    FILE *f = fopen("models/v4-tiny.json", "rb");
    cr_assert_not_null(f, "run from the repository's root");
    size_t len = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[len] = 0;
    char *at = strstr(text, "\"compress_ratios\": [0, 4, 16, 4, 0]");
    cr_assert_not_null(at);
    char *z = strstr(at, "0]");
    cr_assert_not_null(z);
    char tail[1 << 16];
    snprintf(tail, sizeof tail, "%d%s", ratio, z + 1);
    snprintf(z, sizeof text - (size_t)(z - text), "%s", tail);
    snprintf(out, n, "/tmp/pdmoe-test-XXXXXX");
    cr_assert_not_null(mkdtemp(out));
    char cfg[128];
    snprintf(cfg, sizeof cfg, "%s.json", out);
    f = fopen(cfg, "wb");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
    pd_err e = {0};
    cr_assert_eq(pd_genmodel(cfg, out, 7, &e), 0, "%s", e.msg);
    remove(cfg);
}

static int32_t greedy_of(const float *l, int n)
{
    int32_t b = 0;
    for (int i = 1; i < n; i++)
        if (l[i] > l[b])
            b = i;
    return b;
}

/* Copies src's KV of len tokens into dst (reserved for them) as a KV transfer does: the same runs,
 * in order, as one byte stream. */
static void copy_kv(struct pd_engine *en, const struct pd_seq *src, struct pd_seq *dst, int64_t len)
{
    int ns, nd;
    uint64_t bs, bd;
    struct pd_kv_run *rs = pd_kvseq_runs_alloc(&en->kv, &src->kv, len, &ns, &bs);
    struct pd_kv_run *rd = pd_kvseq_runs_alloc(&en->kv, &dst->kv, len, &nd, &bd);
    cr_assert(rs && rd);
    cr_assert_eq(bs, bd);
    uint8_t *buf = malloc(bs), *p = buf;
    for (int i = 0; i < ns; i++, p += rs[i - 1].len)
        memcpy(p, en->kv.region + rs[i].off, rs[i].len);
    p = buf;
    for (int i = 0; i < nd; i++, p += rd[i - 1].len)
        memcpy(en->kv.region + rd[i].off, p, rd[i].len);
    free(buf);
    free(rs);
    free(rd);
    dst->pos = dst->kv.len = len;
}

#define ROUNDS 14

static void handoff_equals_colocated(struct pd_engine *en, const int32_t *ids, int n, int k)
{
    const int V = (int)en->model.vocab_size;
    pd_err e = {0};
    struct pd_seq c, p, d;
    struct pd_sampler sc, sd;
    pd_sampler_init(&sc, 0, 1, 1);
    pd_sampler_init(&sd, 0, 1, 1);
    cr_assert_eq(pd_seq_start(en, &c, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_seq_start(en, &p, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_seq_start(en, &d, &e), 0, "%s", e.msg);
    struct pd_spec_seq xc, xp, xd;
    float *lc = malloc((size_t)V * sizeof(float)), *lp = malloc((size_t)V * sizeof(float));
    float *dc = malloc((size_t)PD_SPEC_MAX_K * V * sizeof(float)), *dd = malloc((size_t)PD_SPEC_MAX_K * V * sizeof(float));
    float *oc = malloc((size_t)(PD_SPEC_MAX_K + 1) * V * sizeof(float));
    float *od = malloc((size_t)(PD_SPEC_MAX_K + 1) * V * sizeof(float));
    /* colocated: prefill, first token */
    pd_spec_init(&xc, &c, &sc);
    struct pd_spec_seq *one = &xc;
    const int32_t *pr = ids;
    cr_assert_eq(pd_spec_prefill(en, &one, &pr, &n, &lc, 1, &e), 0, "%s", e.msg);
    int32_t first = greedy_of(lc, V);
    cr_assert_eq(pd_spec_push(&xc, first, &e), 0, "%s", e.msg);
    /* the sender: prefill, its MTP layer over the prompt */
    pd_spec_init(&xp, &p, &sc);
    one = &xp;
    cr_assert_eq(pd_spec_prefill(en, &one, &pr, &n, &lp, 1, &e), 0, "%s", e.msg);
    cr_assert_eq(greedy_of(lp, V), first);
    cr_assert_eq(pd_spec_catch_up(en, &one, 1, &e), 0, "%s", e.msg);
    cr_assert_eq(p.mtp_pos, n - 1);
    cr_assert_eq(xp.n, 1);
    /* the receiver: the pool's bytes, then the row and the first token */
    cr_assert_eq(pd_kvseq_reserve(&en->kv, &d.kv, n, &e), 0, "%s", e.msg);
    copy_kv(en, &p, &d, n);
    cr_assert_eq(pd_spec_handoff_receive(en, &xd, &d, &sd, xp.hid, first, &e), 0, "%s", e.msg);
    pd_spec_free(&xp);
    pd_seq_end(en, &p);
    xc.draft_logits = dc;
    xd.draft_logits = dd;
    xc.out_logits = oc;
    xd.out_logits = od;
    for (int r = 0; r < ROUNDS; r++) {
        xc.k = xd.k = k;
        one = &xc;
        struct pd_spec_stats st = {0};
        cr_assert_eq(pd_spec_round(en, &one, 1, V, &st, &e), 0, "%s", e.msg);
        one = &xd;
        cr_assert_eq(pd_spec_round(en, &one, 1, V, &st, &e), 0, "%s", e.msg);
        cr_assert_eq(memcmp(dc, dd, (size_t)k * V * sizeof(float)), 0,
                     "n %d, k %d, round %d: the received draft's logits differ from the colocated draft's", n, k, r);
        cr_assert_eq(memcmp(xc.draft, xd.draft, (size_t)k * sizeof(int32_t)), 0);
        cr_assert_eq(xc.n_out, xd.n_out, "n %d, k %d, round %d", n, k, r);
        cr_assert_eq(memcmp(xc.out, xd.out, (size_t)xc.n_out * sizeof(int32_t)), 0);
        cr_assert_eq(memcmp(oc, od, (size_t)xc.n_out * V * sizeof(float)), 0);
        cr_assert_eq(c.pos, d.pos);
        cr_assert_eq(c.mtp_pos, d.mtp_pos);
    }
    pd_spec_free(&xc);
    pd_spec_free(&xd);
    pd_seq_end(en, &c);
    pd_seq_end(en, &d);
    free(lc);
    free(lp);
    free(dc);
    free(dd);
    free(oc);
    free(od);
}

static void received_drafts_as_colocated(const char *d)
{
    struct pd_engine en;
    struct pd_engine_opts o = {.dir = d, .threads = 1, .max_seqs = 4, .max_model_len = 512, .mtp = 1};
    pd_err e = {0};
    cr_assert_eq(pd_engine_open(&en, &o, &e), 0, "%s", e.msg);
    /* v4-tiny: window 8, compressors of ratio 4 and 16, 16 entries a block */
    static const int lens[] = {1, 5, 30, 75};
    int32_t ids[80];
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        for (int j = 0; j < lens[i]; j++)
            ids[j] = (int32_t)((j * 37 + (int)i * 101 + 11) % 500);
        for (int k = 1; k <= 3; k++)
            handoff_equals_colocated(&en, ids, lens[i], k);
    }
    /* every block came back */
    cr_assert_eq(en.kv.n_blocks_free, en.kv.n_blocks);
    pd_engine_close(&en);
}

Test(spec_handoff, a_received_draft_state_drafts_as_the_colocated_one)
{
    received_drafts_as_colocated(dir);
}

/* MTP layers with a compressor: CSA (ratio 4, with the indexer) and HCA (ratio 16). */
Test(spec_handoff, a_compressing_mtp_layers_state_is_handed_off_exactly)
{
    static const int ratios[] = {4, 16};
    for (int i = 0; i < 2; i++) {
        char d[64];
        tiny_with_mtp_ratio(ratios[i], d, sizeof d);
        struct pd_model m;
        pd_err e = {0};
        char cfg[128];
        snprintf(cfg, sizeof cfg, "%s/config.json", d);
        cr_assert_eq(pd_model_load_as("--model", cfg, &m, &e), 0, "%s", e.msg);
        cr_assert_eq(m.compress_ratio[m.n_layers], ratios[i]);
        received_drafts_as_colocated(d);
        rm_model(d);
    }
}

/* Only a sequence just prefilled can be handed off, and only a sequence holding tokens received. */
Test(spec_handoff, misuse_is_refused)
{
    struct pd_engine en;
    struct pd_engine_opts o = {.dir = dir, .threads = 1, .max_seqs = 2, .max_model_len = 64, .mtp = 1};
    pd_err e = {0};
    cr_assert_eq(pd_engine_open(&en, &o, &e), 0, "%s", e.msg);
    struct pd_seq s;
    struct pd_sampler sm;
    pd_sampler_init(&sm, 0, 1, 1);
    cr_assert_eq(pd_seq_start(&en, &s, &e), 0);
    struct pd_spec_seq x, *one = &x;
    pd_spec_init(&x, &s, &sm);
    cr_assert_neq(pd_spec_catch_up(&en, &one, 1, &e), 0);
    cr_assert(strstr(e.msg, "not just prefilled"), "%s", e.msg);
    float *row = calloc(pd_spec_row_bytes(&en), 1);
    cr_assert_neq(pd_spec_handoff_receive(&en, &x, &s, &sm, row, 3, &e), 0);
    cr_assert(strstr(e.msg, "holds no token"), "%s", e.msg);
    free(row);
    pd_spec_free(&x);
    pd_seq_end(&en, &s);
    pd_engine_close(&en);
}

/* ---- a cached prefix (engine/prefix.h) with the MTP layer ---- */

/* Prefills `prompt` (n tokens) on a fresh sequence q through cache c as the server does: from
 * the longest cached prefix (the draft resumed from its node), snapshots at every new boundary
 * (the draft's input there as the node's extra bytes), the MTP layer caught up, the nodes
 * committed. The last position's logits in `logits`; returns the prefix length used. */
static int64_t prefill_cached(struct pd_engine *en, struct pd_prefix *c, struct pd_seq *q, struct pd_prefix_cursor *cur,
                              struct pd_spec_seq *x, struct pd_sampler *smp, const int32_t *prompt, int n, float *logits)
{
    pd_err e = {0};
    memset(cur, 0, sizeof *cur);
    cr_assert_eq(pd_seq_start(en, q, &e), 0, "%s", e.msg);
    struct pd_prefix_node *node = pd_prefix_lookup(c, prompt, n);
    cr_assert_eq(pd_prefix_attach(c, node, &q->kv, cur, n, &e), 0, "%s", e.msg);
    int64_t b = pd_prefix_node_len(node);
    q->pos = b;
    pd_spec_init(x, q, smp);
    if (node)
        cr_assert_eq(pd_spec_resume(en, x, q, smp, pd_prefix_node_extra(c, node), &e), 0, "%s", e.msg);
    cr_assert_eq(pd_prefix_plan(c, cur, prompt, b, n, &x->snaps, &x->n_snaps, &e), 0, "%s", e.msg);
    const int32_t *pr = prompt + b;
    int pn = n - (int)b;
    struct pd_spec_seq *one = x;
    cr_assert_eq(pd_spec_prefill(en, &one, &pr, &pn, &logits, 1, &e), 0, "%s", e.msg);
    const size_t row = pd_spec_row_bytes(en);
    for (int j = 0; j < x->n_snaps; j++)
        memcpy(x->snaps[j].buf + pd_kvsnap_bytes(&en->kv, x->snaps[j].pos),
               (const uint8_t *)x->hid + (size_t)(x->snaps[j].pos - 1 - q->mtp_pos) * row, row);
    cr_assert_eq(pd_spec_catch_up(en, &one, 1, &e), 0, "%s", e.msg);
    x->snaps = NULL;
    x->n_snaps = 0;
    pd_prefix_commit(c, cur, &q->kv, 1);
    return b;
}

/* Rounds of x (cached) and y (computed from scratch) give the same drafts, draft logits, tokens
 * and verify logits, bit for bit. */
static void rounds_equal(struct pd_engine *en, struct pd_spec_seq *x, struct pd_spec_seq *y, int k, const char *what)
{
    const int V = (int)en->model.vocab_size;
    pd_err e = {0};
    float *dx = malloc((size_t)PD_SPEC_MAX_K * V * sizeof(float)), *dy = malloc((size_t)PD_SPEC_MAX_K * V * sizeof(float));
    float *ox = malloc((size_t)(PD_SPEC_MAX_K + 1) * V * sizeof(float));
    float *oy = malloc((size_t)(PD_SPEC_MAX_K + 1) * V * sizeof(float));
    x->draft_logits = dx;
    y->draft_logits = dy;
    x->out_logits = ox;
    y->out_logits = oy;
    for (int r = 0; r < 8; r++) {
        x->k = y->k = k;
        struct pd_spec_stats st = {0};
        struct pd_spec_seq *one = x;
        cr_assert_eq(pd_spec_round(en, &one, 1, V, &st, &e), 0, "%s", e.msg);
        one = y;
        cr_assert_eq(pd_spec_round(en, &one, 1, V, &st, &e), 0, "%s", e.msg);
        cr_assert_eq(memcmp(dx, dy, (size_t)k * V * sizeof(float)), 0, "%s, round %d: draft logits differ", what, r);
        cr_assert_eq(x->n_out, y->n_out, "%s, round %d", what, r);
        cr_assert_eq(memcmp(x->out, y->out, (size_t)x->n_out * sizeof(int32_t)), 0, "%s, round %d", what, r);
        cr_assert_eq(memcmp(ox, oy, (size_t)x->n_out * V * sizeof(float)), 0, "%s, round %d: logits differ", what, r);
    }
    x->draft_logits = y->draft_logits = x->out_logits = y->out_logits = NULL;
    free(dx);
    free(dy);
    free(ox);
    free(oy);
}

/* A request started from a cached prefix (the MTP layer's state at the boundary and the draft's
 * input restored from the node) gives, bit for bit, the logits and the draft logits of one that
 * computes its whole prompt; so does one started from a node that a resumed request cached. */
static void cached_prefix_drafts_as_recomputed(const char *d)
{
    struct pd_engine en;
    struct pd_engine_opts o = {.dir = d, .threads = 1, .max_seqs = 4, .max_model_len = 512, .mtp = 1};
    pd_err e = {0};
    cr_assert_eq(pd_engine_open(&en, &o, &e), 0, "%s", e.msg);
    const int V = (int)en.model.vocab_size;
    struct pd_prefix c;
    cr_assert_eq(pd_prefix_init(&c, &en.kv, 32, (size_t)1 << 28, &e), 0, "%s", e.msg);
    c.extra = pd_spec_row_bytes(&en);
    /* A: 100 tokens, boundaries 32, 64, 96; B: A's first 96 and 44 more (a hit at 96, a new
     * boundary at 128); D: B's first 128 and 10 more (a hit at 128, B's node) */
    int32_t a[100], b[140], dd[138];
    for (int i = 0; i < 100; i++)
        a[i] = (int32_t)((i * 37 + 11) % 500);
    memcpy(b, a, 96 * sizeof *b);
    for (int i = 96; i < 140; i++)
        b[i] = (int32_t)((i * 53 + 7) % 500);
    memcpy(dd, b, 128 * sizeof *dd);
    for (int i = 128; i < 138; i++)
        dd[i] = (int32_t)((i * 71 + 3) % 500);
    float *l1 = malloc((size_t)V * sizeof(float)), *l2 = malloc((size_t)V * sizeof(float));
    struct pd_sampler s1, s2;
    pd_sampler_init(&s1, 0, 1, 1);
    pd_sampler_init(&s2, 0, 1, 1);
    struct pd_seq qa;
    struct pd_prefix_cursor ca;
    struct pd_spec_seq xa;
    cr_assert_eq(prefill_cached(&en, &c, &qa, &ca, &xa, &s1, a, 100, l1), 0);
    pd_spec_free(&xa);
    pd_prefix_release(&c, &ca);
    pd_seq_end(&en, &qa);
    const int32_t *prompts[] = {b, dd};
    const int lens[] = {140, 138};
    for (int t = 0; t < 2; t++)
        for (int k = 1; k <= 3; k += 2) {
            /* B first from A's node at 96, then from its own at 128; D from B's */
            int hit = t == 0 && k == 1 ? 96 : 128;
            struct pd_seq qx, qy;
            struct pd_prefix_cursor cx;
            struct pd_spec_seq x, y;
            cr_assert_eq(prefill_cached(&en, &c, &qx, &cx, &x, &s1, prompts[t], lens[t], l1), hit);
            /* the same prompt computed whole, the MTP layer run lazily by the first round */
            cr_assert_eq(pd_seq_start(&en, &qy, &e), 0, "%s", e.msg);
            pd_spec_init(&y, &qy, &s2);
            struct pd_spec_seq *one = &y;
            cr_assert_eq(pd_spec_prefill(&en, &one, &prompts[t], &lens[t], &l2, 1, &e), 0, "%s", e.msg);
            cr_assert_eq(memcmp(l1, l2, (size_t)V * sizeof(float)), 0, "prompt %d: the cached prefix's logits differ", t);
            int32_t first = greedy_of(l1, V);
            cr_assert_eq(pd_spec_push(&x, first, &e), 0, "%s", e.msg);
            cr_assert_eq(pd_spec_push(&y, first, &e), 0, "%s", e.msg);
            char what[64];
            snprintf(what, sizeof what, "prompt %d from a prefix of %d, k %d", t, hit, k);
            rounds_equal(&en, &x, &y, k, what);
            pd_spec_free(&x);
            pd_spec_free(&y);
            pd_prefix_release(&c, &cx);
            pd_seq_end(&en, &qx);
            pd_seq_end(&en, &qy);
        }
    cr_assert_gt(c.hits, 0);
    pd_prefix_free(&c);
    cr_assert_eq(en.kv.n_blocks_free, en.kv.n_blocks);
    free(l1);
    free(l2);
    pd_engine_close(&en);
}

Test(spec_handoff, a_cached_prefix_drafts_as_a_recomputed_one)
{
    cached_prefix_drafts_as_recomputed(dir);
    static const int ratios[] = {4, 16};
    for (int i = 0; i < 2; i++) {
        char d[64];
        tiny_with_mtp_ratio(ratios[i], d, sizeof d);
        cached_prefix_drafts_as_recomputed(d);
        rm_model(d);
    }
}

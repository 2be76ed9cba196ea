/* The speculative hand-off (spec.h, pd_spec_handoff_*): a sequence prefilled on one side, its MTP
 * layer run over the prompt there, its pool bytes copied run by run into another sequence and its
 * last hidden state passed as the row, drafts on the other side exactly as a colocated sequence
 * does: every round's draft logits, drafts, tokens and verify logits equal, bit for bit, for
 * k = 1..3 and prompts of 1 token, shorter than the window, ending mid-block and past a block. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "../tmpmodel.h"
#include "engine/engine.h"
#include "engine/genmodel.h"
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
    cr_assert_eq(pd_spec_handoff_send(en, &one, 1, &e), 0, "%s", e.msg);
    cr_assert_eq(p.mtp_pos, n - 1);
    cr_assert_eq(xp.n, 1);
    /* the receiver: the pool's bytes, then the row and the first token */
    cr_assert_eq(pd_kvseq_reserve(&en->kv, &d.kv, n, &e), 0, "%s", e.msg);
    copy_kv(en, &p, &d, n);
    cr_assert_eq(pd_spec_handoff_receive(&xd, &d, &sd, xp.hid, first, pd_spec_row_bytes(en), &e), 0, "%s", e.msg);
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
    cr_assert_neq(pd_spec_handoff_send(&en, &one, 1, &e), 0);
    cr_assert(strstr(e.msg, "not just prefilled"), "%s", e.msg);
    float row[1] = {0};
    cr_assert_neq(pd_spec_handoff_receive(&x, &s, &sm, row, 3, sizeof row, &e), 0);
    cr_assert(strstr(e.msg, "holds no token"), "%s", e.msg);
    pd_spec_free(&x);
    pd_seq_end(&en, &s);
    pd_engine_close(&en);
}

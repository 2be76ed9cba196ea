/* Prefix caching on v4-tiny (window 8, CSA ratio 4 with indexer keys, HCA ratio 16; 16 entries
 * per block, so a CSA block spans 64 tokens and an HCA block 256): a sequence started from a
 * cached prefix gives logits bit-identical (memcmp) to recomputing the prompt, wherever the
 * prefix ends (inside a compression block, at a block boundary, past the window, past a full
 * HCA block), in bf16 and fp8 KV; eviction frees exactly the least recently used unused nodes;
 * every reference goes back. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"
#include "engine/prefix.h"
#include "../tmpmodel.h"

static char dir[64];

static void make_tiny(void)
{
    tmp_model("v4-tiny", 7, dir, sizeof dir);
}

static void remove_tiny(void)
{
    rm_model(dir);
}

TestSuite(prefix, .init = make_tiny, .fini = remove_tiny);

static const char *model_dir;   /* v4-tiny unless a test says otherwise */

static void open_engine(struct pd_engine *en, enum pd_kv_dtype kv, int64_t kv_bytes)
{
    struct pd_engine_opts o = {.dir = model_dir ? model_dir : dir, .threads = 2, .max_seqs = 4, .max_model_len = 512,
                               .kv_dtype = kv, .kv_bytes = kv_bytes};
    pd_err e = {0};
    cr_assert_eq(pd_engine_open(en, &o, &e), 0, "%s", e.msg);
}

static void prompt(int32_t *ids, int n, int salt)
{
    for (int i = 0; i < n; i++)
        ids[i] = (int32_t)((i * 37 + salt * 101 + 11) % 500);
}

/* Prefills ids[0, n) in s, from the longest cached prefix when c is not NULL (its length is
 * returned), caching every unit boundary the step passes; the logits of the computed tokens go
 * to all (rows from the hit on), those of the last to last. */
static int64_t prefill(struct pd_engine *en, struct pd_prefix *c, struct pd_seq *s, struct pd_prefix_cursor *cur,
                       const int32_t *ids, int n, float *all, float *last)
{
    pd_err e = {0};
    cr_assert_eq(pd_seq_start(en, s, &e), 0, "%s", e.msg);
    struct pd_kvsnap *snaps = NULL;
    int n_snaps = 0;
    if (c) {
        /* a slot's old bytes are whatever its last sequence left: here all ones (NaN in fp32 and
         * bf16), so a byte the snapshot should have restored and did not cannot go unseen */
        memset(en->kv.slots + (size_t)s->kv.slot * en->kv.slot_bytes, 0xff, en->kv.slot_bytes);
        struct pd_prefix_node *x = pd_prefix_lookup(c, ids, n);
        cr_assert_eq(pd_prefix_attach(c, x, &s->kv, cur, n, &e), 0, "%s", e.msg);
        s->pos = pd_prefix_node_len(x);
        cr_assert_eq(pd_prefix_plan(c, cur, ids, s->pos, n, &snaps, &n_snaps, &e), 0, "%s", e.msg);
    }
    struct pd_step_item it = {.seq = s, .tokens = ids + s->pos, .n = n - (int)s->pos, .logits = last,
                              .all_logits = all, .snaps = snaps, .n_snaps = n_snaps};
    int64_t hit = s->pos;
    int rc = pd_engine_step(en, &it, 1, &e);
    if (c)
        pd_prefix_commit(c, cur, &s->kv, rc == 0);
    cr_assert_eq(rc, 0, "%s", e.msg);
    return hit;
}

/* A cached prefix of `shared` tokens of a first prompt (first_len tokens), then a second prompt
 * of n tokens that continues it differently: the second, started from the cache, computes the
 * same logits as a fresh sequence for every token after the hit, and the next decode step too. */
static void check_exact(enum pd_kv_dtype kv, int unit, int first_len, int shared, int n, int64_t want_hit)
{
    struct pd_engine en;
    open_engine(&en, kv, 0);
    const int V = (int)en.model.vocab_size;
    pd_err e = {0};
    struct pd_prefix c;
    cr_assert_eq(pd_prefix_init(&c, &en.kv, unit, 64u << 20, &e), 0, "%s", e.msg);
    int32_t *a = malloc((size_t)first_len * 4), *b = malloc((size_t)n * 4);
    prompt(a, first_len, 1);
    prompt(b, n, 2);
    memcpy(b, a, (size_t)shared * 4);
    float *all_c = malloc((size_t)n * V * 4), *all_f = malloc((size_t)n * V * 4);
    float *lc = malloc((size_t)V * 4), *lf = malloc((size_t)V * 4);
    struct pd_seq s1, s2, s3;
    struct pd_prefix_cursor k1 = {0}, k2 = {0};
    cr_assert_eq(prefill(&en, &c, &s1, &k1, a, first_len, NULL, lc), 0, "an empty cache has no hit");
    int64_t hit = prefill(&en, &c, &s2, &k2, b, n, all_c, lc);
    cr_assert_eq(hit, want_hit, "hit %lld tokens, want %lld", (long long)hit, (long long)want_hit);
    cr_assert_eq(c.queries, (uint64_t)(first_len + n));
    cr_assert_eq(c.hits, (uint64_t)want_hit);
    cr_assert_eq(prefill(&en, NULL, &s3, NULL, b, n, all_f, lf), 0);
    /* all_c's rows are the tokens from the hit on; all_f's from 0 */
    cr_assert_eq(memcmp(all_c, all_f + (size_t)hit * V, (size_t)(n - hit) * V * 4), 0,
                 "the logits after a %lld-token cached prefix differ from recomputing it", (long long)hit);
    /* and decoding goes on the same */
    int32_t t = 42;
    struct pd_step_item d2 = {.seq = &s2, .tokens = &t, .n = 1, .logits = lc};
    struct pd_step_item d3 = {.seq = &s3, .tokens = &t, .n = 1, .logits = lf};
    cr_assert_eq(pd_engine_step(&en, &d2, 1, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_engine_step(&en, &d3, 1, &e), 0, "%s", e.msg);
    cr_assert_eq(memcmp(lc, lf, (size_t)V * 4), 0, "a decode step after the cached prefix differs");
    /* refcounts: the sequences go, the cache keeps its blocks; dropped, every block is back */
    pd_prefix_release(&c, &k1);
    pd_prefix_release(&c, &k2);
    pd_seq_end(&en, &s1);
    pd_seq_end(&en, &s2);
    pd_seq_end(&en, &s3);
    cr_assert_eq(en.kv.n_blocks_free + en.kv.held, en.kv.n_blocks);
    for (int i = 0; i < en.kv.n_blocks; i++)
        cr_assert_leq(en.kv.block_ref[i], 1, "block %d has %d references with no sequence live", i, en.kv.block_ref[i]);
    pd_prefix_free(&c);
    cr_assert_eq(en.kv.held, 0);
    cr_assert_eq(en.kv.n_blocks_free, en.kv.n_blocks);
    free(a);
    free(b);
    free(all_c);
    free(all_f);
    free(lc);
    free(lf);
    pd_engine_close(&en);
}

/* 48 tokens: 12 CSA entries (a partial block), 3 HCA entries (partial), past the window */
Test(prefix, hit_inside_a_block_bf16, .timeout = 300) { check_exact(PD_KV_BF16, 16, 100, 60, 90, 48); }
Test(prefix, hit_inside_a_block_fp8, .timeout = 300) { check_exact(PD_KV_FP8, 16, 100, 60, 90, 48); }
/* 64 tokens: the first CSA block exactly full, its keys partial */
Test(prefix, hit_at_a_csa_block_boundary_bf16, .timeout = 300) { check_exact(PD_KV_BF16, 64, 100, 80, 110, 64); }
Test(prefix, hit_at_a_csa_block_boundary_fp8, .timeout = 300) { check_exact(PD_KV_FP8, 64, 100, 80, 110, 64); }
/* 42 tokens: inside a CSA compression group (2 of 4 rows, the overlapping state) and an HCA
 * one (10 of 16 rows) */
Test(prefix, hit_across_compression_boundaries_bf16, .timeout = 300) { check_exact(PD_KV_BF16, 6, 50, 47, 70, 42); }
Test(prefix, hit_across_compression_boundaries_fp8, .timeout = 300) { check_exact(PD_KV_FP8, 6, 50, 47, 70, 42); }
/* 256 tokens: an HCA block exactly full, four CSA blocks; the prompt is the first one whole and
 * one token more (the whole first prompt is reused) */
Test(prefix, hit_at_an_hca_block_boundary_bf16, .timeout = 300) { check_exact(PD_KV_BF16, 128, 256, 256, 257, 256); }
Test(prefix, hit_at_an_hca_block_boundary_fp8, .timeout = 300) { check_exact(PD_KV_FP8, 128, 256, 256, 300, 256); }

/* v4-flash-mini (window 128, HCA ratio 128, CSA ratio 4 with 512-wide keys, 8 layers): a 160-token
 * prefix is past the window and 32 tokens into an HCA compression block. */
static void check_mini(enum pd_kv_dtype kv)
{
    if (access("models/mini/model.safetensors", R_OK) != 0)
        cr_skip_test("models/mini not generated (make models/mini)");
    model_dir = "models/mini";
    check_exact(kv, 160, 200, 180, 230, 160);
    model_dir = NULL;
}
Test(prefix, mini_past_the_window_inside_an_hca_block_bf16, .timeout = 600) { check_mini(PD_KV_BF16); }
Test(prefix, mini_past_the_window_inside_an_hca_block_fp8, .timeout = 600) { check_mini(PD_KV_FP8); }

/* A prompt equal to a cached one leaves its last unit to compute: some token must give logits. */
Test(prefix, a_cached_prompt_leaves_a_token_to_compute, .timeout = 300)
{
    check_exact(PD_KV_BF16, 16, 64, 64, 64, 48);
}

/* Under pressure: three cached prompts, one still used by a live sequence; make_room evicts the
 * least recently used unused leaves first, frees exactly their blocks, never the used chain. */
Test(prefix, eviction_takes_the_lru_unused_nodes, .timeout = 300)
{
    struct pd_engine en;
    open_engine(&en, PD_KV_BF16, 0);
    pd_err e = {0};
    struct pd_prefix c;
    cr_assert_eq(pd_prefix_init(&c, &en.kv, 64, 64u << 20, &e), 0, "%s", e.msg);
    int32_t p[3][200];
    struct pd_seq s[3];
    struct pd_prefix_cursor k[3] = {{0}};
    float *l = malloc((size_t)en.model.vocab_size * 4);
    for (int i = 0; i < 3; i++) {
        prompt(p[i], 200, 10 + i);
        prefill(&en, &c, &s[i], &k[i], p[i], 200, NULL, l);
    }
    /* 3 prompts x 3 boundaries (64, 128, 192) */
    cr_assert_eq(c.n_nodes, 9);
    /* prompts 0 and 1 end, prompt 0 is used again after prompt 1 (a hit), prompt 2 stays live */
    pd_prefix_release(&c, &k[1]);
    pd_seq_end(&en, &s[1]);
    pd_prefix_release(&c, &k[0]);
    pd_seq_end(&en, &s[0]);
    struct pd_seq s3;
    struct pd_prefix_cursor k3 = {0};
    cr_assert_eq(prefill(&en, &c, &s3, &k3, p[0], 200, NULL, l), 192);
    pd_prefix_release(&c, &k3);
    pd_seq_end(&en, &s3);
    int free0 = en.kv.n_blocks_free;
    /* the leaf of prompt 1 (192 tokens) goes first: it holds the blocks that became full in
     * (128, 192]: per CSA layer 16 entries, one block (keys: a block holds 64 in bf16, none) */
    struct pd_prefix_node *leaf1 = pd_prefix_lookup(&c, p[1], 200);
    cr_assert_eq(pd_prefix_node_len(leaf1), 192);
    int want = 0;
    for (int l2 = 0; l2 < en.kv.n_layers; l2++)
        want += en.kv.layer[l2].ratio == 4 ? 1 : 0;
    cr_assert_eq(pd_prefix_make_room(&c, free0 + 1, NULL), 0);
    cr_assert_eq(c.n_nodes, 8, "one node evicted, not %zu", 9 - c.n_nodes);
    cr_assert_eq(en.kv.n_blocks_free, free0 + want, "the evicted node's %d blocks are back", want);
    cr_assert_eq(pd_prefix_node_len(pd_prefix_lookup(&c, p[1], 200)), 128, "prompt 1's leaf went first");
    cr_assert_eq(pd_prefix_node_len(pd_prefix_lookup(&c, p[0], 200)), 192, "prompt 0 was used later");
    cr_assert_eq(pd_prefix_node_len(pd_prefix_lookup(&c, p[2], 200)), 192, "prompt 2 is used");
    /* all the room there is: prompts 0 and 1 go whole, prompt 2's chain stays (its sequence
     * pins it), and its blocks keep their references */
    cr_assert_eq(pd_prefix_make_room(&c, en.kv.n_blocks, NULL), PD_ENOMEM);
    cr_assert_eq(c.n_nodes, 3);
    cr_assert_eq(pd_prefix_node_len(pd_prefix_lookup(&c, p[2], 200)), 192);
    cr_assert_null(pd_prefix_lookup(&c, p[0], 200));
    cr_assert_null(pd_prefix_lookup(&c, p[1], 200));
    for (int l2 = 0; l2 < en.kv.n_layers; l2++)
        for (int b = 0; b < s[2].kv.n_blocks[l2]; b++) {
            int ref = en.kv.block_ref[s[2].kv.blocks[l2][b]];
            cr_assert(ref == 1 || ref == 2, "block of the live sequence with %d references", ref);
        }
    /* a fresh sequence from prompt 2's chain, while its owner is live: it shares the blocks */
    struct pd_seq s4;
    struct pd_prefix_cursor k4 = {0};
    int64_t hit = prefill(&en, &c, &s4, &k4, p[2], 200, NULL, l);
    cr_assert_eq(hit, 192);
    cr_assert_eq(s4.kv.blocks[1][0], s[2].kv.blocks[1][0], "the first CSA block is shared");
    cr_assert_eq(en.kv.block_ref[s4.kv.blocks[1][0]], 3, "two sequences and the cache");
    pd_prefix_release(&c, &k[2]);
    pd_seq_end(&en, &s[2]);
    pd_prefix_release(&c, &k4);
    pd_seq_end(&en, &s4);
    pd_prefix_drop(&c);
    cr_assert_eq(c.n_nodes, 0);
    cr_assert_eq(c.bytes, 0);
    cr_assert_eq(en.kv.held, 0);
    cr_assert_eq(en.kv.n_blocks_free, en.kv.n_blocks, "every block is back");
    pd_prefix_free(&c);
    free(l);
    pd_engine_close(&en);
}

/* The snapshot budget: a cache with room for two snapshots keeps the two most recent boundaries
 * of a prompt's chain only as far as it can (a chain needs its parents), and never exceeds it. */
Test(prefix, the_snapshot_budget_is_kept, .timeout = 300)
{
    struct pd_engine en;
    open_engine(&en, PD_KV_BF16, 0);
    pd_err e = {0};
    struct pd_prefix c;
    size_t snap = pd_kvsnap_bytes(&en.kv, 64);
    cr_assert_eq(pd_prefix_init(&c, &en.kv, 64, 2 * snap + snap / 2, &e), 0, "%s", e.msg);
    int32_t p[200];
    prompt(p, 200, 3);
    struct pd_seq s;
    struct pd_prefix_cursor k = {0};
    float *l = malloc((size_t)en.model.vocab_size * 4);
    prefill(&en, &c, &s, &k, p, 200, NULL, l);
    cr_assert_eq(c.n_nodes, 2);
    cr_assert_leq(c.bytes, c.max_bytes);
    cr_assert_eq(pd_prefix_node_len(pd_prefix_lookup(&c, p, 200)), 128);
    pd_prefix_release(&c, &k);
    pd_seq_end(&en, &s);
    pd_prefix_free(&c);
    cr_assert_eq(en.kv.n_blocks_free, en.kv.n_blocks);
    free(l);
    pd_engine_close(&en);
}

/* The KV pool's block allocator: ownership (no block held twice, every block back), reservations
 * that fail take nothing, and the layout a hand-off depends on: a request's prompt blocks lie in
 * one piece, in the order pd_kvseq_runs lists them, whenever the pool has a free extent that
 * holds them, even after a long history of sequences of mixed lengths coming and going. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "engine/kvpool.h"
#include "model/config.h"

#define SEQS 48

static struct pd_model model;
static struct pd_kvpool pool;

static void open_pool(void)
{
    pd_err e = {0};
    cr_assert_eq(pd_model_load("v4-flash-mini", &model, &e), 0, "%s", e.msg);
    /* room for 48 slots and 3001 blocks: 3001 is not a multiple of the bitmap's 64 */
    struct pd_kvpool probe;
    cr_assert_eq(pd_kvpool_init(&probe, &model, 1, 1 << 20, 16, &e), 0, "%s", e.msg);
    size_t bytes = SEQS * probe.slot_bytes + 3001 * probe.block_bytes;
    pd_kvpool_free(&probe);
    cr_assert_eq(pd_kvpool_init(&pool, &model, SEQS, bytes, 16, &e), 0, "%s", e.msg);
    cr_assert_eq(pool.n_blocks, 3001);
}

static void close_pool(void)
{
    pd_kvpool_free(&pool);
}

/* The pieces a hand-off of `len` tokens copies: runs merged where they continue each other. */
static int pieces(const struct pd_kvseq *s, int64_t len)
{
    int max = pd_kvseq_max_runs(&pool, s);
    struct pd_kv_run *r = malloc((size_t)max * sizeof *r);
    int n = pd_kvseq_runs(&pool, s, len, r, max), m = 0;
    cr_assert_gt(n, 0);
    for (int i = 0; i < n; i++)
        if (!m || r[m - 1].off + r[m - 1].len != r[i].off)
            r[m++] = r[i];
        else
            r[m - 1].len += r[i].len;
    free(r);
    return m;
}

/* Every block of the live sequences, counted: none twice, and the free count is the rest. */
static void check_ownership(struct pd_kvseq *live, int n_live)
{
    unsigned char *seen = calloc((size_t)pool.n_blocks, 1);
    int held = 0;
    for (int i = 0; i < n_live; i++)
        for (int l = 0; l < pool.n_layers; l++) {
            for (int b = 0; b < live[i].n_blocks[l]; b++, held++)
                cr_assert_eq(seen[live[i].blocks[l][b]]++, 0, "block %d held twice", live[i].blocks[l][b]);
            for (int b = 0; b < live[i].n_kblocks[l]; b++, held++)
                cr_assert_eq(seen[live[i].kblocks[l][b]]++, 0, "block %d held twice", live[i].kblocks[l][b]);
        }
    cr_assert_eq(pool.n_blocks_free, pool.n_blocks - held);
    free(seen);
}

TestSuite(kvpool, .init = open_pool, .fini = close_pool);

Test(kvpool, a_prompt_is_one_piece_in_a_fresh_pool)
{
    struct pd_kvseq s;
    pd_err e = {0};
    cr_assert_eq(pd_kvseq_alloc(&pool, &s, &e), 0);
    /* 1000 prompt tokens and 500 to decode: the decode blocks come after the prompt's */
    cr_assert_eq(pd_kvseq_reserve_prompt(&pool, &s, 1000, 1500, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_kvpool_blocks_for(&pool, 1500), pool.n_blocks - pool.n_blocks_free);
    cr_assert_eq(pieces(&s, 1000), 2, "the slot and one extent of blocks");
    /* a plain reservation of the whole future interleaves the decode blocks with the prompt's */
    struct pd_kvseq t;
    cr_assert_eq(pd_kvseq_alloc(&pool, &t, &e), 0);
    cr_assert_eq(pd_kvseq_reserve(&pool, &t, 1500, &e), 0, "%s", e.msg);
    cr_assert_gt(pieces(&t, 1000), 2);
    pd_kvseq_free(&pool, &t);
    pd_kvseq_free(&pool, &s);
    cr_assert_eq(pool.n_blocks_free, pool.n_blocks);
}

Test(kvpool, a_reservation_that_does_not_fit_takes_nothing)
{
    struct pd_kvseq s;
    pd_err e = {0};
    cr_assert_eq(pd_kvseq_alloc(&pool, &s, &e), 0);
    int64_t too_long = 1;
    while (pd_kvpool_blocks_for(&pool, too_long) <= pool.n_blocks)
        too_long *= 2;
    cr_assert_eq(pd_kvseq_reserve_prompt(&pool, &s, 16, too_long, &e), PD_ENOMEM);
    cr_assert(strstr(e.msg, "KV pool full"), "%s", e.msg);
    cr_assert_eq(pool.n_blocks_free, pool.n_blocks);
    cr_assert_eq(pd_kvpool_seq_bytes(&pool, &s), pool.slot_bytes);
    pd_kvseq_free(&pool, &s);
}

Test(kvpool, churn_keeps_ownership_and_prompts_in_one_piece)
{
    struct pd_kvseq live[SEQS];
    int n_live = 0, one_piece = 0, fitted = 0;
    pd_err e = {0};
    srand(7);
    for (int round = 0; round < 3000; round++) {
        if (n_live == SEQS || (n_live > 0 && rand() % 5 < 2)) {
            int k = rand() % n_live;
            pd_kvseq_free(&pool, &live[k]);
            live[k] = live[--n_live];
        } else {
            int64_t prompt = 16 + rand() % 2000, total = prompt + 1 + rand() % 400;
            struct pd_kvseq *s = &live[n_live];
            cr_assert_eq(pd_kvseq_alloc(&pool, s, &e), 0);
            /* did the pool have one free extent for the prompt's blocks? */
            int need = pd_kvpool_blocks_for(&pool, prompt), run = 0, best = 0;
            for (int b = 0; b < pool.n_blocks; b++) {
                run = pool.block_used[b / 64] >> (b % 64) & 1 ? 0 : run + 1;
                best = run > best ? run : best;
            }
            int free_before = pool.n_blocks_free;
            if (pd_kvseq_reserve_prompt(&pool, s, prompt, total, &e)) {
                cr_assert_eq(pool.n_blocks_free, free_before, "a failed reservation took blocks");
                pd_kvseq_free(&pool, s);
                continue;
            }
            n_live++;
            if (best >= need) {
                fitted++;
                one_piece += pieces(s, prompt) == 2;
            }
        }
        check_ownership(live, n_live);
    }
    cr_assert_gt(fitted, 500);
    cr_assert_eq(one_piece, fitted, "%d of %d prompts that had room in one piece got it", one_piece, fitted);
    while (n_live > 0)
        pd_kvseq_free(&pool, &live[--n_live]);
    cr_assert_eq(pool.n_blocks_free, pool.n_blocks);
    cr_assert_eq(pool.n_slots_free, pool.n_slots);
}

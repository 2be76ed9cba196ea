/* The KV pool's block allocator: ownership (no block held twice, every block back), reservations
 * that fail take nothing, and the layout a hand-off depends on: a request's prompt blocks lie in
 * one piece, in the order pd_kvseq_runs lists them, whenever the pool has a free extent that
 * holds them, even after a long history of sequences of mixed lengths coming and going. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/kvpool.h"
#include "kernels/ops.h"
#include "plan/kvsize.h"
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
    cr_assert_eq(pd_kvpool_init(&probe, &model, PD_KV_BF16, 1, 1 << 20, 16, &e), 0, "%s", e.msg);
    size_t bytes = SEQS * probe.slot_bytes + 3001 * probe.block_bytes;
    pd_kvpool_free(&probe);
    cr_assert_eq(pd_kvpool_init(&pool, &model, PD_KV_BF16, SEQS, bytes, 16, &e), 0, "%s", e.msg);
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

/* fp8 entries as V4 is deployed: the planner's bytes, and values back within e4m3's precision. */
static void fp8_pool(const char *model_name, struct pd_model *m, struct pd_kvpool *p, int seqs, size_t blocks)
{
    pd_err e = {0};
    cr_assert_eq(pd_model_load(model_name, m, &e), 0, "%s", e.msg);
    struct pd_kvpool probe;
    cr_assert_eq(pd_kvpool_init(&probe, m, PD_KV_FP8, 1, 1 << 22, 16, &e), 0, "%s", e.msg);
    size_t bytes = (size_t)seqs * probe.slot_bytes + blocks * probe.block_bytes;
    pd_kvpool_free(&probe);
    cr_assert_eq(pd_kvpool_init(p, m, PD_KV_FP8, seqs, bytes, 16, &e), 0, "%s", e.msg);
}

Test(kvpool_fp8, v4_flash_entries_are_the_planners_584_bytes)
{
    struct pd_model m;
    pd_err e = {0};
    cr_assert_eq(pd_model_load("deepseek-v4-flash", &m, &e), 0, "%s", e.msg);
    size_t entry, key;
    pd_kvpool_entry_bytes(&m, PD_KV_FP8, &entry, &key);
    cr_assert_eq(entry, 584);   /* 448 e4m3 + 64 bf16 + 7 scales + 1 pad */
    cr_assert_eq(key, 132);     /* 128 e4m3 + fp32 scale */
    pd_kvpool_entry_bytes(&m, PD_KV_BF16, &entry, &key);
    cr_assert_eq(entry, 1024);
    cr_assert_eq(key, 256);
}

static int64_t lcm(int64_t a, int64_t b)
{
    int64_t g = a, h = b;
    while (h) {
        int64_t t = g % h;
        g = h;
        h = t;
    }
    return a / g * b;
}

Test(kvpool_fp8, a_full_sequence_holds_the_planners_bytes)
{
    /* for either dtype: the fixed slot and the marginal bytes per token are the plan's, and a
     * sequence whose every block is full holds exactly pd_kv_seq_bytes */
    for (int d = 0; d < 2; d++) {
        struct pd_model m;
        struct pd_kvpool p;
        pd_err e = {0};
        cr_assert_eq(pd_model_load("v4-flash-mini", &m, &e), 0, "%s", e.msg);
        struct pd_kv_size k;
        cr_assert_eq(pd_kv_size_init(&k, &m, (enum pd_kv_dtype)d, 0, 0, &e), 0);
        struct pd_kvpool probe;
        cr_assert_eq(pd_kvpool_init(&probe, &m, (enum pd_kv_dtype)d, 1, 1 << 22, 16, &e), 0, "%s", e.msg);
        /* the shortest length at which every entry and key block is full */
        int64_t len = 1;
        for (int l = 0; l < m.n_layers; l++) {
            int r = m.compress_ratio[l];
            int64_t a = r ? (int64_t)r * probe.block_entries : 1, b = r == 4 ? 4 * (int64_t)probe.block_keys : 1;
            len = lcm(lcm(len, a), b);
        }
        size_t bytes = probe.slot_bytes + (size_t)pd_kvpool_blocks_for(&probe, len) * probe.block_bytes;
        pd_kvpool_free(&probe);
        cr_assert_eq(pd_kvpool_init(&p, &m, (enum pd_kv_dtype)d, 1, bytes, 16, &e), 0, "%s", e.msg);
        cr_assert_eq((int64_t)p.entry_bytes, k.entry_bytes);
        cr_assert_eq((int64_t)p.key_bytes, k.index_key_bytes);
        cr_assert_eq((int64_t)pd_kvpool_bytes_per_seq(&p), k.per_seq_fixed);
        cr_assert_float_eq(pd_kvpool_bytes_per_token(&p), k.per_token, 1e-9);
        struct pd_kvseq s;
        cr_assert_eq(pd_kvseq_alloc(&p, &s, &e), 0);
        cr_assert_eq(pd_kvseq_reserve(&p, &s, len, &e), 0, "%s", e.msg);
        cr_assert_eq((int64_t)pd_kvpool_seq_bytes(&p, &s), pd_kv_seq_bytes(&k, len), "%s at %lld tokens",
                     pd_kv_dtype_name((enum pd_kv_dtype)d), (long long)len);
        pd_kvseq_free(&p, &s);
        pd_kvpool_free(&p);
    }
}

Test(kvpool_fp8, an_entry_comes_back_within_e4m3_precision)
{
    struct pd_model m;
    struct pd_kvpool p;
    fp8_pool("v4-flash-mini", &m, &p, 1, 4);
    const int hd = p.head_dim, rope = p.rope_dim, nope = hd - rope, id = p.index_head_dim;
    cr_assert_eq(p.entry_bytes, 168);   /* 96 e4m3 + 32 bf16 + 2 scales, padded to 8 */
    uint8_t buf[1024];
    float x[512], y[512];
    srand(3);
    for (int trial = 0; trial < 200; trial++) {
        /* magnitudes over several binades, some tiny values that fall to e4m3's subnormals */
        for (int i = 0; i < hd; i++)
            x[i] = ((float)rand() / RAND_MAX - 0.5f) * ldexpf(1.0f, rand() % 12 - 6) * (i % 17 == 0 ? 1e-3f : 1);
        memset(buf, 0xAB, sizeof buf);
        pd_kv_put_entry(&p, buf, x);
        pd_kv_get_entry(&p, y, buf);
        for (int b = 0; b * 64 < nope; b++) {
            int n = nope - b * 64 < 64 ? nope - b * 64 : 64;
            float amax = 0;
            for (int i = 0; i < n; i++)
                amax = fmaxf(amax, fabsf(pd_bf16_to_f32(pd_f32_to_bf16(x[b * 64 + i]))));
            float s = ldexpf(1.0f, (int)buf[nope + 2 * rope + b] - 127);
            cr_assert(amax / s <= 448 && amax / s > 224, "block %d: amax %g, scale %g", b, amax, s);
            for (int i = 0; i < n; i++) {
                /* the bf16 value, then e4m3: half an ulp of 3 mantissa bits (2^-4 relative) or
                 * half the subnormal step (2^-10 of the scale) */
                float xb = pd_bf16_to_f32(pd_f32_to_bf16(x[b * 64 + i])), err = fabsf(y[b * 64 + i] - xb);
                cr_assert(err <= fmaxf(fabsf(xb) * 0x1p-4f, s * 0x1p-10f), "value %d: %g back as %g", b * 64 + i,
                          xb, y[b * 64 + i]);
            }
        }
        for (int i = nope; i < hd; i++)
            cr_assert_eq(y[i], pd_bf16_to_f32(pd_f32_to_bf16(x[i])), "rope value %d is bf16", i);
        for (size_t i = (size_t)nope + 2 * rope + 2; i < p.entry_bytes; i++)
            cr_assert_eq(buf[i], 0, "padding byte %zu", i);
        cr_assert_eq(buf[p.entry_bytes], 0xAB, "the entry stays in its %zu bytes", p.entry_bytes);
        /* an indexer key: one scale for all its values */
        memset(buf, 0xAB, sizeof buf);
        pd_kv_put_key(&p, buf, x);
        pd_kv_get_key(&p, y, buf);
        float s;
        memcpy(&s, buf + id, 4);
        for (int i = 0; i < id; i++) {
            float xb = pd_bf16_to_f32(pd_f32_to_bf16(x[i]));
            cr_assert(fabsf(y[i] - xb) <= fmaxf(fabsf(xb) * 0x1p-4f, s * 0x1p-10f), "key value %d", i);
        }
        cr_assert_eq(buf[p.key_bytes], 0xAB);
    }
    pd_kvpool_free(&p);
}

/* The planner's verdict and the engine's pool agree: where a plan says its decode pool holds
 * --max-num-seqs sequences of max-model-len, the engine given that pool (pdmoe up --plan passes it
 * as --kv-cache-bytes) holds them, and where it says it does not, the engine does not either. The
 * plan counted exact bytes and the engine whole pages: 645 "fit" where 639 did. */
#include "plan/plan.h"

Test(kvpool_plan, the_plans_verdict_is_the_pools)
{
    int agree = 0, yes = 0, no = 0;
    for (int n = 600; n <= 700; n += 5) {
        struct pd_plan_opts o;
        pd_plan_opts_default(&o);
        o.model = "models/mini";
        o.hardware = "h100";
        o.nodes = 2;
        o.util = 0.05;
        o.max_model_len = 2048;
        o.max_num_seqs = n;
        o.role[0] = o.role[1] = (struct pd_role_opts){.dp = 1, .tp = 1, .instances = 1};
        struct pd_plan p;
        pd_err e = {0};
        cr_assert_eq(pd_plan_build(&o, &p, &e), 0, "%s", e.msg);
        const struct pd_role_plan *d = &p.role[1];
        struct pd_kvpool kp;
        cr_assert_eq(pd_kvpool_init_layers(&kp, &p.model, p.model.n_layers + (p.include_mtp ? p.model.n_mtp_layers : 0),
                                           p.kv.dtype, n, (size_t)d->b.kv_pool, PD_KV_BLOCK_ENTRIES, &e), 0, "%s",
                     e.msg);
        int holds = kp.n_blocks / pd_kvpool_blocks_for(&kp, 2048) >= n;
        cr_assert_eq(holds, d->fits_max_num_seqs, "--max-num-seqs %d: the plan says %s, the engine's pool holds %d",
                     n, d->fits_max_num_seqs ? "they fit" : "they do not", kp.n_blocks / pd_kvpool_blocks_for(&kp, 2048));
        agree++;
        yes += holds;
        no += !holds;
        pd_kvpool_free(&kp);
        pd_plan_free(&p);
    }
    cr_assert(yes > 0 && no > 0, "the range missed the boundary (%d fit, %d do not)", yes, no);
}

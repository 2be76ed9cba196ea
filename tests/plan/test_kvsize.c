/* KV cache sizes from the architecture, checked against hand-computed figures. */
#include <criterion/criterion.h>

#include "plan/kvsize.h"

static void init(const char *name, enum pd_kv_dtype d, int mtp, int64_t flat, struct pd_kv_size *k)
{
    struct pd_model m;
    pd_err e = {0};
    cr_assert_eq(pd_model_load(name, &m, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_kv_size_init(k, &m, d, mtp, flat, &e), 0, "%s", e.msg);
}

Test(kvsize, v4_flash_fp8)
{
    struct pd_kv_size k;
    init("deepseek-v4-flash", PD_KV_FP8, 1, 0, &k);
    /* 448 fp8 + 64 bf16 + 7 ue8m0 scales, padded to 584; indexer key 128 + 4 */
    cr_assert_eq(k.entry_bytes, 584);
    cr_assert_eq(k.index_key_bytes, 132);
    cr_assert_eq(k.n_layers[PD_KV_WINDOW], 3);
    cr_assert_eq(k.n_layers[PD_KV_CSA], 21);
    cr_assert_eq(k.n_layers[PD_KV_HCA], 20);
    /* 21 x (584 + 132) / 4 + 20 x 584 / 128 */
    cr_assert_float_eq(k.per_token, 21 * 716 / 4.0 + 20 * 584 / 128.0, 1e-9);
    /* windows: 44 layers x 128 x 584; states: CSA 2x8x1024x4 + 2x8x256x4, HCA 2x128x512x4 */
    cr_assert_eq(k.window_bytes, 44 * 128 * 584);
    cr_assert_eq(k.state_bytes, 21 * (65536 + 16384) + 20 * 524288);
    /* a 32768-token sequence in the engine's pages: 16 entries rounded up to 33 (a page of 33 x 584
     * = 19,272 B holds 146 whole keys of 132 B); CSA 8,192 entries in 249 pages and their keys in
     * 57, HCA 256 entries in 8 */
    cr_assert_eq(k.block_entries, 33);
    int64_t page = 33 * 584;
    int64_t want = 44 * 128 * 584 + 21 * (249 + 57) * page + 20 * 8 * page + k.state_bytes;
    cr_assert_eq(pd_kv_seq_bytes(&k, 32768), want);
    cr_assert_eq(want, 142420560);   /* (141,660,160 exact bytes: 0.5% in partly filled pages) */
}

Test(kvsize, v4_short_sequences_count_completed_blocks_in_whole_pages)
{
    struct pd_kv_size k;
    init("v4-tiny", PD_KV_BF16, 0, 0, &k);
    /* v4-tiny: window 8, ratios [0, 4, 16, 4], head 32 (entry 64 B bf16), index head 16 (32 B) */
    cr_assert_eq(k.entry_bytes, 64);
    cr_assert_eq(k.index_key_bytes, 32);
    /* per CSA layer: kv + score, [2x4, 2x32] and [2x4, 2x16] fp32 = 4096 + 2048;
     * HCA (ratio 16): [16, 32] twice = 4096 */
    int64_t states = 2 * (4096 + 2048) + 4096;
    cr_assert_eq(k.state_bytes, states);
    /* 3 tokens: 3 window entries per layer, no completed block */
    cr_assert_eq(pd_kv_seq_bytes(&k, 3), 4 * 3 * 64 + states);
    /* 17 tokens: full windows; CSA 4 entries (+ keys) each, HCA 1 entry, each in a page of 16
     * entries (1,024 B; 32 keys) */
    cr_assert_eq(k.block_entries, 16);
    cr_assert_eq(pd_kv_seq_bytes(&k, 17), 4 * 8 * 64 + 2 * (1024 + 1024) + 1 * 1024 + states);
    cr_assert_eq(pd_kv_seq_bytes(&k, 0), 0);
}

Test(kvsize, v3_mla)
{
    struct pd_kv_size k;
    init("deepseek-v3", PD_KV_BF16, 0, 0, &k);
    /* (512 + 64) x 2 B x 61 layers = 70,272 B per token */
    cr_assert_float_eq(k.per_token, 70272.0, 1e-9);
    cr_assert_eq(k.per_seq_fixed, 0);
    cr_assert_eq(pd_kv_seq_bytes(&k, 1000), 70272000);
    init("deepseek-v3", PD_KV_FP8, 1, 0, &k);
    /* FlashMLA fp8: 512 + 4 x 4 + 64 x 2 = 656 B, 62 layers with the MTP layer */
    cr_assert_eq(k.entry_bytes, 656);
    cr_assert_float_eq(k.per_token, 656.0 * 62, 1e-9);
}

Test(kvsize, flat_override_and_inverse)
{
    struct pd_kv_size k;
    init("seed-v4-flash", PD_KV_FP8, 0, 44000, &k);
    cr_assert_eq(pd_kv_seq_bytes(&k, 8000), 352000000);
    cr_assert_eq(pd_kv_max_context(&k, 43000000000, 30), 43000000000 / 30 / 44000);
    init("deepseek-v4-flash", PD_KV_FP8, 1, 0, &k);
    for (int64_t bytes = 100000000; bytes < 60000000000; bytes *= 3) {
        int64_t c = pd_kv_max_context(&k, bytes, 30);
        cr_assert_leq(30 * pd_kv_seq_bytes(&k, c), bytes);
        cr_assert_gt(30 * pd_kv_seq_bytes(&k, c + 1), bytes);
    }
    pd_err e;
    struct pd_model m;
    cr_assert_eq(pd_model_load("v4-tiny", &m, &e), 0);
    cr_assert_neq(pd_kv_size_init(&k, &m, PD_KV_FP8, 0, -1, &e), 0);
}

/* vllm-ascend's layout of V4-Flash's bf16 cache on A2/A3, --block-size 128 (commit 182b75ea; the
 * facts and their file:line in docs/memory-model.md "KV cache"). Pages: a compressed block holds
 * 128 entries of 2 x 512 = 1,024 B (131,072 B), its indexer keys 128 x (128 int8 + 2 B fp16 scale)
 * = 16,640 B. Groups: CSA entries + keys (blocks of 128 x 4 = 512 tokens), HCA entries (128 x 128 =
 * 16,384), sliding windows (128 tokens, window 128), CSA compressor states (8 tokens, window 8), HCA
 * states (32 tokens, window 128). Layer counts 21, 20, 44 (43 + MTP), 21, 20: the padding-minimising
 * T >= 21 is 22 (pads 1+2+0+1+2), so the 44 windows are 2 tables (22 and 22, the MTP layer in the
 * second), the states 1 each. A block id: (largest table without MTP, 22, + 1 MTP cache) = 23 layer
 * tuples x (131,072 + 16,640) = 3,397,376 B. */
Test(kvsize, v4_flash_vllm_ascend)
{
    struct pd_model m;
    struct pd_kv_size k;
    pd_err e = {0};
    cr_assert_eq(pd_model_load("deepseek-v4-flash", &m, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_kv_size_init(&k, &m, PD_KV_BF16, 1, 0, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_kv_size_vllm_ascend(&k, &m, &e), 0, "%s", e.msg);
    cr_assert_eq(k.layout, PD_KV_LAYOUT_VLLM_ASCEND);
    cr_assert_eq(k.index_key_bytes, 130);
    cr_assert_eq(k.layer_tuples, 23);
    const int64_t B = 3397376;
    cr_assert_eq(k.block_id_bytes, B);
    cr_assert_eq(k.grp[2].n, 2);
    cr_assert_eq(k.grp[3].n, 1);
    cr_assert_eq(k.grp[4].n, 1);
    /* marginal: one block id per 512 tokens and one per 16,384 = 6,635.5 + 207.359375 */
    cr_assert_float_eq(k.per_token, B / 512.0 + B / 16384.0, 1e-9);
    cr_assert_float_eq(k.per_token, 6842.859375, 1e-9);
    /* fixed: at most 2 window blocks per table (2 tables), 2 CSA state blocks, 5 HCA state blocks
     * (the last 127 tokens over blocks of 32) = 11 blocks */
    cr_assert_eq(k.window_bytes, 4 * B);
    cr_assert_eq(k.state_bytes, 7 * B);
    cr_assert_eq(k.per_seq_fixed, 37371136);
    /* 32,768 tokens: 64 CSA + 2 HCA blocks, and at lengths 32,641..32,767 not a multiple of 8 the 11
     * window and state blocks: 77 blocks */
    cr_assert_eq(pd_kv_seq_bytes(&k, 32768), 77 * B);
    cr_assert_eq(pd_kv_seq_bytes(&k, 32768), 261597952);
    /* 129 tokens: 1 + 1 + 2 x 2 windows + 2 + 5 states = 13; 128: the most is at 127 tokens,
     * 1 + 1 + 2 x 1 + 2 (blocks of tokens 112..119 and 120..126) + 4 = 10 (at 128 itself, 9) */
    cr_assert_eq(pd_kv_seq_bytes(&k, 129), 13 * B);
    cr_assert_eq(pd_kv_seq_bytes(&k, 128), 10 * B);
    /* chunks in flight: a table of window w and blocks of b holds cdiv(w - 1 + T, b) + 1 blocks for T
     * unprocessed tokens (vLLM's SlidingWindowSpec.max_admission_blocks_per_request), so beyond the 11
     * above: 4,096 tokens, 2 x 33 + 514 + 133 - 11 = 704 blocks (715 in all, the estimate of
     * docs/memory-model.md before they were counted); 8,192 (two steps), 2 x 66 + 1,026 + 261 - 11 =
     * 1,408; one token, none; a 4,096-token prompt with 8,192 in flight holds all its tokens' window
     * and state blocks, 2 x 32 + 512 + 128 = 704, where decoding it holds 11: 693 more */
    cr_assert_eq(pd_kv_inflight_bytes(&k, 32768, 4096), 704 * B);
    cr_assert_eq(pd_kv_inflight_bytes(&k, 32768, 8192), 1408 * B);
    cr_assert_eq(pd_kv_inflight_bytes(&k, 1 << 20, 8192), 1408 * B);
    cr_assert_eq(pd_kv_inflight_bytes(&k, 32768, 1), 0);
    cr_assert_eq(pd_kv_inflight_bytes(&k, 4096, 8192), (704 - 11) * B);
    /* without the MTP layer: counts 21, 20, 43, 21, 20, T still 22 (pads 1+2+1+1+2), tables 22 and 21,
     * no MTP cache: 22 tuples */
    cr_assert_eq(pd_kv_size_init(&k, &m, PD_KV_BF16, 0, 0, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_kv_size_vllm_ascend(&k, &m, &e), 0, "%s", e.msg);
    cr_assert_eq(k.block_id_bytes, 22 * 147712);
    cr_assert_eq(pd_kv_seq_bytes(&k, 32768), 77 * 22 * 147712);
    /* pdmoe's own layout: fixed window rings and states, nothing more while a chunk is computed */
    cr_assert_eq(pd_kv_size_init(&k, &m, PD_KV_BF16, 1, 0, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_kv_inflight_bytes(&k, 32768, 8192), 0);
    /* an fp8 cache is not vllm-ascend's on A2/A3 */
    cr_assert_eq(pd_kv_size_init(&k, &m, PD_KV_FP8, 1, 0, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_kv_size_vllm_ascend(&k, &m, &e), PD_EINVAL);
}

/* SGLang's NPU pools for V4-Flash (SGLang 0a3cd26b, docs/memory-model.md "KV cache"), the figures
 * worked from its source's formulas apart from pdmoe's code:
 * - its sizing (pool_configurator.py _get_bytes_per_full_token), EAGLE on: 0.1 x 584 x 43 windows
 *   + 584 x 21 / 4 CSA + 584 x 20 / 128 HCA + 132 x 21 / 4 keys + 0.1 x 16 / 128 x (8,192 + 2,048)
 *   x 21 CSA states, times 44 / 43 for the draft: 9,259.90 B per full token;
 * - what the NPU pools allocate per full token (dsv4_memory_pool.py): the window pool's 0.1 token
 *   in 43 + 1 layers of 1,024 B, CSA 1,024 / 4 and keys 132 + 130 / 4 in 21 layers, HCA 1,024 / 128
 *   in 20: 4,505.6 + 5,376 + 1,375.5 + 160 = 11,417.1 B; per request, npu_state_pool_size's pages
 *   of 128 rows: 2 in each CSA layer (rows of 8,192 + 2,048 B), 3 in each HCA layer (4,096 B). */
Test(kvsize, v4_flash_sglang_npu)
{
    struct pd_model m;
    struct pd_kv_size k;
    pd_err e = {0};
    cr_assert_eq(pd_model_load("deepseek-v4-flash", &m, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_kv_size_init(&k, &m, PD_KV_BF16, 1, 0, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_kv_size_sglang_npu(&k, &m, 1, &e), 0, "%s", e.msg);
    cr_assert_eq(k.layout, PD_KV_LAYOUT_SGLANG_NPU);
    cr_assert_eq(k.sgl.acct_entry, 584);
    cr_assert_eq(k.sgl.acct_key, 132);
    cr_assert_float_eq(k.sgl.bytes_per_full_token, 9259.902325581397, 1e-9);
    cr_assert_float_eq(k.per_token, 11417.1, 1e-9);
    cr_assert_eq(k.state_bytes, 21 * 2 * 128 * (8192 + 2048) + 20 * 3 * 128 * 4096);
    cr_assert_eq(k.state_bytes, 86507520);
    /* a 9,000-token sequence: 71 pages of 128 full-pool slots, 9,088 x 11,417.1 B, and its states */
    cr_assert_eq(pd_kv_seq_bytes(&k, 9000), 103758605 + 86507520);
    /* the pools of a 20 GiB budget and 10 requests: the fixed c128 state bytes SGLang takes off first,
     * (11 + 1) x 256 + 1 rows in 128-row pages x 4,096 B x 20 layers; then F and the pools as it
     * derives them, and what they take on the NPU (each pool (size + page + 1) // page pages; the
     * keys twice; state pools one sentinel page more) */
    struct pd_kv_sgl_pools q;
    pd_kv_sgl_pools(&k, INT64_C(20) << 30, 10, 0, &q);
    cr_assert_eq(q.c128_fixed_acct, 262144000);
    cr_assert_eq(q.full, 2290688);
    cr_assert_eq(q.swa, 228992);
    cr_assert_eq(q.c4, 572672);
    cr_assert_eq(q.c128, 17896);
    cr_assert_eq(q.reqs, 10);
    cr_assert_eq(q.c4_state, 2688);
    cr_assert_eq(q.c128_state, 3968);
    cr_assert_eq(q.bytes, INT64_C(27062089088));
    /* the budget whose pools fit a room: the largest, and its pools fit */
    const int64_t room = INT64_C(25) << 30, bud = pd_kv_sgl_budget(&k, room, 10, 0);
    pd_kv_sgl_pools(&k, bud, 10, 0, &q);
    cr_assert_leq(q.bytes, room);
    pd_kv_sgl_pools(&k, bud + 4 * 1024 * 1024, 10, 0, &q);   /* 3 pages of the full pool more */
    cr_assert_gt(q.bytes, room);
    /* a PD decode node's 20 pre-allocated slots: a ring each more in the sizing's fixed c128 bytes,
     * (10 + 20 + 1 + 1) x 256 + 1 rows in 128-row pages, and in the HCA pool (31 x 256 rows past
     * 3 pages x 10 requests, and its sentinel page) */
    pd_kv_sgl_pools(&k, INT64_C(20) << 30, 10, 20, &q);
    cr_assert_eq(q.slots, 31);
    cr_assert_eq(q.c128_fixed_acct, INT64_C(8320) * 4096 * 20);
    cr_assert_eq(q.c128_state, 7936 + 128);
    /* the request tables beside them: six int32 tables a slot, four of the row, c4 and c128 */
    cr_assert_eq(pd_kv_sgl_tables(31, 32899), 31 * 4 * (4 * 32899 + 32899 + 8224 + 257));
    cr_assert_eq(pd_kv_sgl_tables(2, 100), 2 * 4 * (500 + 25 + 1));
    /* not for an fp8 cache */
    cr_assert_eq(pd_kv_size_init(&k, &m, PD_KV_FP8, 1, 0, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_kv_size_sglang_npu(&k, &m, 1, &e), PD_EINVAL);
}

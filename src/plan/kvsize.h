/* KV cache size from the architecture.
 *
 * deepseek_v3 (MLA): per layer and token one latent of kv_lora_rank plus the rope key of
 *   qk_rope_head_dim: bf16 2*(512+64) = 1152 B; fp8 as vLLM stores it (FlashMLA layout)
 *   512 fp8 + 4 fp32 scales + 64 bf16 rope = 656 B. Nothing is fixed per sequence.
 * deepseek_v4: every layer keeps a sliding window of `sliding_window` entries; a ratio-r layer
 *   adds one compressed entry per r completed tokens, and a ratio-4 (CSA) layer also an
 *   indexer key per entry; each compressor keeps a per-sequence fp32 state (kv and score
 *   rows, [coff*r, coff*d] each, coff = 2 for r = 4, else 1) for the block being built.
 *   An entry is head_dim values: bf16 2*512 = 1024 B; fp8 as vLLM and SGLang store it
 *   448 fp8 "nope" values + 64 bf16 rope values + one ue8m0 scale per 64 nope values,
 *   padded to 8 bytes = 584 B. An indexer key: bf16 2*128 = 256 B; fp8 128 + 4 B scale = 132 B.
 * The marginal cost (bytes per token, for long sequences) and the fixed cost (bytes per
 * sequence: full windows + compressor states) are reported separately; pd_kv_seq_bytes()
 * gives the exact bytes of a sequence of L tokens (only completed blocks have entries).
 *
 * Two layouts of these bytes: pdmoe's own (the engine's pool, engine/kvpool.c, and the figures
 * above), and vllm-ascend's on Ascend A2/A3 (pd_kv_size_vllm_ascend, docs/memory-model.md
 * "KV cache", vllm-ascend 182b75ea): bf16 entries, int8 indexer keys with an fp16 scale, and
 * every cache in one pool of block ids, each id a page in every cache tensor, so that a
 * sequence's bytes are the blocks its six block tables hold times the bytes of one id.
 * A third, SGLang's on Ascend NPUs (pd_kv_size_sglang_npu, docs/memory-model.md "KV cache", SGLang
 * 0a3cd26b): separate pools (a sliding-window pool of every layer, CSA entries, HCA entries,
 * indexer keys, compressor states) whose sizes SGLang derives from one "full token" count F, which
 * it solves from its budget with its own per-token coefficient (fp8 entry bytes, whatever the
 * device), while the NPU pools store bf16 entries: what they allocate is not what they budget. */
#ifndef PD_PLAN_KVSIZE_H
#define PD_PLAN_KVSIZE_H

#include <stdint.h>

#include "core/err.h"
#include "model/config.h"

/* PD_KV_AUTO is for plan options only (pd_plan_opts.kv_dtype: the stacks' default, resolved by
 * pd_plan_build); a KV size or a pool has one of the others. */
enum pd_kv_dtype { PD_KV_AUTO = -1, PD_KV_BF16 = 0, PD_KV_FP8 = 1 };

enum pd_kv_kind { PD_KV_MLA, PD_KV_WINDOW, PD_KV_CSA, PD_KV_HCA, PD_KV_KINDS };

enum pd_kv_layout { PD_KV_LAYOUT_PDMOE, PD_KV_LAYOUT_VLLM_ASCEND, PD_KV_LAYOUT_SGLANG_NPU };

/* vllm-ascend: one block table (KV cache group) of a DeepSeek-V4 model; a sequence of L tokens
 * holds, in each of `n` such tables, ceil(L / tokens) blocks (window 0) or those of its last
 * `window` tokens (sliding windows and compressor states). */
struct pd_kv_group {
    const char *what;
    int64_t tokens;                /* tokens per block */
    int64_t window;                /* 0: every token */
    int n;                         /* tables of this kind */
};
#define PD_KV_ASCEND_BLOCK_SIZE 128   /* --block-size: the tutorial's, and vllm-ascend's default */

/* SGLang on an NPU (layout PD_KV_LAYOUT_SGLANG_NPU): the figures of its sizing
 * (python/sglang/srt/model_executor/pool_configurator.py, DSV4PoolConfigurator) and of what its NPU
 * pools allocate (hardware_backend/npu/dsv4/dsv4_memory_pool.py), SGLang 0a3cd26b. */
struct pd_kv_sglang {
    int64_t page;                  /* --page-size, 128 on NPU (overrides.py) */
    double swa_ratio;              /* --swa-full-tokens-ratio, 0.1 for DeepSeek-V4 */
    int spec;                      /* EAGLE (the MTP layer drafts): rings of 16 and 256 rows, the draft's pool */
    int n_all, n4, n128, n_draft;  /* target layers, CSA and HCA among them, the draft's (window-only) layers */
    int64_t window;                /* swa_page_size: the config's window_size */
    int64_t ring4, ring128;        /* compressor state rings the sizing counts */
    int64_t acct_entry, acct_key;  /* the bytes the sizing counts: 448 + 2 x 64 + 8 = 584, 128 + 4 = 132 */
    double bytes_per_full_token;   /* the sizing's coefficient, the draft's (N + 1) / N included */
    int64_t entry, key_base, key_npu;   /* the NPU's: bf16 2 x head_dim; 132 (base buffer) + 130 (int8 + fp16) */
    int64_t state4_row, state128_row;   /* fp32 rows a CSA layer's two state pools and an HCA layer's hold */
    int64_t blocks4, blocks128;    /* npu_state_pool_size's pages per request, 2 and 3 at page 128 */
};

/* The pools SGLang makes of a budget (its available_bytes) and --max-running-requests per DP rank. */
struct pd_kv_sgl_pools {
    int64_t full, swa, c4, c128;   /* tokens (full, swa) and compressed entries (c4, c128) */
    int64_t reqs;                  /* max_running_requests per worker: min(requested, full / 2) */
    int64_t c4_state, c128_state;  /* state rows of one layer's pool, the sentinel page included */
    int64_t slots;                 /* request slots: reqs + extra + a padding row (req_to_token's rows) */
    int64_t c128_fixed_acct;       /* the sizing's fixed c128 state bytes, taken off the budget */
    int64_t bytes;                 /* what the NPU pools allocate, target and draft */
};

struct pd_kv_size {
    enum pd_kv_dtype dtype;
    int64_t flat_per_token;        /* > 0: a flat override (the seed's 44,000 B) */
    int n_layers[PD_KV_KINDS];     /* layers of each kind with a KV cache */
    int64_t entry_bytes;           /* one cached entry of one layer */
    int64_t index_key_bytes;       /* one indexer key */
    int64_t window;                /* sliding window, tokens */
    int64_t block_entries;         /* a page of compressed entries (PD_KV_BLOCK_ENTRIES, rounded as
                                    * pd_kv_block_entries does); a CSA layer's indexer keys take pages
                                    * of the same bytes. 0: exact bytes (MLA, flat) */
    double per_token;              /* marginal bytes per token, whole model */
    double per_token_kind[PD_KV_KINDS];
    int64_t per_seq_fixed;         /* windows (full) + compressor states, whole model */
    int64_t window_bytes, state_bytes; /* the two parts of per_seq_fixed */
    /* per layer, for exact sizes */
    int n;                         /* layers counted */
    int ratio[PD_MAX_LAYERS];      /* 0 = window only; -1 = MLA */
    int64_t state[PD_MAX_LAYERS];  /* compressor state bytes of the layer */
    /* vllm-ascend (layout PD_KV_LAYOUT_VLLM_ASCEND): its groups and the bytes of one block id */
    enum pd_kv_layout layout;
    struct pd_kv_group grp[5];
    int n_grp;
    int layer_tuples;              /* block id bytes = layer_tuples x (sum of the page sizes) */
    int64_t page_bytes[2];         /* the two page sizes: a compressed block, its indexer keys */
    int64_t block_id_bytes;
    struct pd_kv_sglang sgl;       /* layout PD_KV_LAYOUT_SGLANG_NPU */
};

int pd_kv_parse_dtype(const char *s, enum pd_kv_dtype *d);
const char *pd_kv_dtype_name(enum pd_kv_dtype d);
const char *pd_kv_kind_name(enum pd_kv_kind k);

/* include_mtp: the MTP layers keep a KV cache too when they run (speculative decoding). */
int pd_kv_size_init(struct pd_kv_size *k, const struct pd_model *m, enum pd_kv_dtype d,
                    int include_mtp, int64_t flat_per_token, pd_err *e);
/* The paged pool's page: `want` entries rounded up so that a page of entry_bytes entries also
 * holds whole keys of key_bytes (a multiple of key_bytes / gcd(entry_bytes, key_bytes); 1 in bf16,
 * where a key is a quarter entry). The engine's pool (engine/kvpool.c) and the planner both page
 * with it, so that the sequences a plan says fit are the ones the engine holds. */
#define PD_KV_BLOCK_ENTRIES 16
int64_t pd_kv_block_entries(int64_t entry_bytes, int64_t key_bytes, int64_t want);
/* One V4 entry and one indexer key, bytes: bf16 2 x head_dim and 2 x index_head_dim; fp8 as vLLM
 * and SGLang store it (448 fp8 nope values, 64 bf16 rope values, a ue8m0 scale per 64 nope
 * values, padded to 8 bytes; a key of index_head_dim fp8 values and an fp32 scale). */
void pd_kv_v4_entry_bytes(const struct pd_model *m, enum pd_kv_dtype d, int64_t *entry, int64_t *key);

/* Switch a bf16 DeepSeek-V4 size (from pd_kv_size_init) to vllm-ascend's A2/A3 layout with
 * --block-size PD_KV_ASCEND_BLOCK_SIZE. PD_EINVAL for a model it does not fit (no CSA or no HCA
 * layer, not V4, not bf16, flat). */
int pd_kv_size_vllm_ascend(struct pd_kv_size *k, const struct pd_model *m, pd_err *e);
const char *pd_kv_layout_name(const struct pd_kv_size *k);

/* Switch a bf16 DeepSeek-V4 size (from pd_kv_size_init, its MTP layers included when `spec`) to
 * SGLang's NPU pools: --page-size 128, --swa-full-tokens-ratio 0.1, `spec` when the MTP layer
 * drafts (EAGLE). A sequence's bytes are then amortized as SGLang's sizing amortizes them: every
 * token of the full pool brings its share of the window pool (0.1 of a token in every layer), its
 * compressed entries and keys, and each request its compressor-state pages. PD_EINVAL as for
 * pd_kv_size_vllm_ascend. */
int pd_kv_size_sglang_npu(struct pd_kv_size *k, const struct pd_model *m, int spec, pd_err *e);
/* SGLang's pools for `budget` bytes (its available_bytes: --mem-fraction-static x the card less the
 * weights), `reqs` requests per DP rank and `extra` slots pre-allocated for transfers on a PD decode
 * node (--disaggregation-decode-extra-slots; 0 elsewhere), and the bytes they take on the NPU. */
void pd_kv_sgl_pools(const struct pd_kv_size *k, int64_t budget, int64_t reqs, int64_t extra, struct pd_kv_sgl_pools *out);
/* The largest budget whose pools take at most `room` bytes on the NPU (0 if none). */
int64_t pd_kv_sgl_budget(const struct pd_kv_size *k, int64_t room, int64_t reqs, int64_t extra);
/* SGLang's request tables on one DP rank (DSV4NPUReqToTokenPool), outside its pools and its budget:
 * `slots` rows (requests + pre-allocated slots + a padding row) of six int32 tables, four of a
 * row's `row_tokens` tokens (req_to_token, swa, c4_state, c128_state), c4 of a quarter and c128 of
 * 1/128 of them. */
int64_t pd_kv_sgl_tables(int64_t slots, int64_t row_tokens);

/* Bytes one sequence of `tokens` tokens holds: its full window and compressor states, and its
 * compressed entries (and a CSA layer's keys) in whole pages. In vllm-ascend's layout, the most
 * it holds at any length up to `tokens` (its windows' blocks come and go as it grows). */
int64_t pd_kv_seq_bytes(const struct pd_kv_size *k, int64_t tokens);
/* vllm-ascend's layout: the bytes one sequence of up to `tokens` tokens holds, at most, beyond
 * pd_kv_seq_bytes while `inflight` of its tokens are scheduled and not yet processed (a prefill
 * chunk, or the chunks of async scheduling's two steps): its sliding-window and compressor-state
 * tables keep blocks for all of them until the step is done. 0 in pdmoe's layout (fixed rings and
 * states) and for a flat figure, and for inflight <= 1. */
int64_t pd_kv_inflight_bytes(const struct pd_kv_size *k, int64_t tokens, int64_t inflight);
/* Largest context such that `seqs` sequences fit in `bytes` (0 if none). */
int64_t pd_kv_max_context(const struct pd_kv_size *k, int64_t bytes, int64_t seqs);

#endif

/* KV cache bytes per token and per sequence, computed from the architecture. */
#include "plan/kvsize.h"

#include <math.h>
#include <string.h>

int pd_kv_parse_dtype(const char *s, enum pd_kv_dtype *d)
{
    if (strcmp(s, "bf16") == 0 || strcmp(s, "auto") == 0)
        *d = PD_KV_BF16;
    else if (strcmp(s, "fp8") == 0 || strcmp(s, "fp8_e4m3") == 0)
        *d = PD_KV_FP8;
    else
        return PD_EINVAL;
    return 0;
}

const char *pd_kv_dtype_name(enum pd_kv_dtype d)
{
    return d == PD_KV_FP8 ? "fp8" : "bf16";
}

const char *pd_kv_kind_name(enum pd_kv_kind k)
{
    static const char *n[] = {"MLA", "window", "CSA", "HCA"};
    return (unsigned)k < PD_KV_KINDS ? n[k] : "?";
}

static int64_t round_up(int64_t x, int64_t a)
{
    return (x + a - 1) / a * a;
}

int pd_kv_size_init(struct pd_kv_size *k, const struct pd_model *m, enum pd_kv_dtype d,
                    int include_mtp, int64_t flat_per_token, pd_err *e)
{
    memset(k, 0, sizeof *k);
    k->dtype = d;
    if (flat_per_token < 0)
        return pd_err_set(e, PD_EINVAL, "--kv-bytes-per-token: must be positive");
    k->n = m->n_layers + (include_mtp ? m->n_mtp_layers : 0);
    if (flat_per_token > 0) {
        k->flat_per_token = flat_per_token;
        k->per_token = (double)flat_per_token;
        return 0;
    }
    if (m->arch == PD_ARCH_DEEPSEEK_V3) {
        int64_t lat = m->kv_lora_rank, rope = m->qk_rope_head_dim;
        k->entry_bytes = d == PD_KV_FP8 ? lat + 4 * ((lat + 127) / 128) + 2 * rope : 2 * (lat + rope);
        for (int l = 0; l < k->n; l++)
            k->ratio[l] = -1;
        k->n_layers[PD_KV_MLA] = k->n;
        k->per_token_kind[PD_KV_MLA] = (double)k->entry_bytes * k->n;
        k->per_token = k->per_token_kind[PD_KV_MLA];
        return 0;
    }
    int64_t hd = m->head_dim;
    pd_kv_v4_entry_bytes(m, d, &k->entry_bytes, &k->index_key_bytes);
    k->block_entries = pd_kv_block_entries(k->entry_bytes, k->index_key_bytes, PD_KV_BLOCK_ENTRIES);
    k->window = m->sliding_window;
    for (int l = 0; l < k->n; l++) {
        int r = m->compress_ratio[l];
        k->ratio[l] = r;
        k->window_bytes += k->window * k->entry_bytes;
        if (r == 0) {
            k->n_layers[PD_KV_WINDOW]++;
            continue;
        }
        int64_t coff = r == 4 ? 2 : 1;
        /* kv_state and score_state, fp32 [coff*r, coff*d] each */
        int64_t st = 2 * coff * r * coff * hd * 4;
        if (r == 4) {
            st += 2 * coff * r * coff * m->index_head_dim * 4;
            k->n_layers[PD_KV_CSA]++;
            k->per_token_kind[PD_KV_CSA] += (double)(k->entry_bytes + k->index_key_bytes) / r;
        } else {
            k->n_layers[PD_KV_HCA]++;
            k->per_token_kind[PD_KV_HCA] += (double)k->entry_bytes / r;
        }
        k->state[l] = st;
        k->state_bytes += st;
    }
    k->per_token = k->per_token_kind[PD_KV_CSA] + k->per_token_kind[PD_KV_HCA];
    k->per_seq_fixed = k->window_bytes + k->state_bytes;
    return 0;
}

static int64_t gcd64(int64_t a, int64_t b)
{
    while (b) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

int64_t pd_kv_block_entries(int64_t entry_bytes, int64_t key_bytes, int64_t want)
{
    int64_t step = key_bytes / gcd64(entry_bytes, key_bytes);
    return (want + step - 1) / step * step;
}

void pd_kv_v4_entry_bytes(const struct pd_model *m, enum pd_kv_dtype d, int64_t *entry, int64_t *key)
{
    int64_t hd = m->head_dim, rope = m->qk_rope_head_dim, nope = hd - rope;
    int64_t id = m->index_head_dim > 0 ? m->index_head_dim : 1;
    *entry = d == PD_KV_FP8 ? round_up(nope + 2 * rope + (nope + 63) / 64, 8) : 2 * hd;
    *key = d == PD_KV_FP8 ? id + 4 : 2 * id;
}

/* vllm-ascend, a DeepSeek-V4 model on A2/A3 with --block-size 128 (commit 182b75ea; the file:line
 * facts are in docs/memory-model.md "KV cache"):
 * - the caches: a ratio-r layer's compressed entries (head_dim bf16) and a CSA layer's indexer keys
 *   (index_head_dim int8 + an fp16 scale), 128 entries a page, a block of 128 x r tokens; every
 *   layer's sliding window (head_dim bf16, blocks of 128 tokens, window sliding_window); each
 *   compressor's fp32 state rows (kv and score, 2 x coff x d, one row per token), blocks of 8 tokens
 *   for r = 4 (window coff x r = 8) and 32 for r = 128 (window 128), each page padded to the
 *   nearest of the two compressed pages.
 * - the groups: CSA entries + keys one block table, HCA entries one, the windows and the two kinds
 *   of state split into tables of at most T layers, T the padding-minimising count of vLLM's
 *   _approximate_gcd over the five kinds' layer counts (lower bound the CSA count).
 * - the pool: one block id is a page in each of (largest table's layers, MTP excluded, plus one
 *   per MTP cache) x (both compressed page sizes) tensors; num_blocks = memory / that. */
static int64_t gcd64(int64_t a, int64_t b);

static int approx_gcd(const int *v, int n, int lower)
{
    int hi = 0, best = lower;
    int64_t best_pad = -1;
    for (int i = 0; i < n; i++)
        hi = v[i] > hi ? v[i] : hi;
    for (int d = lower; d <= hi; d++) {
        int64_t pad = 0;
        for (int i = 0; i < n; i++)
            pad += (d - v[i] % d) % d;
        if (best_pad < 0 || pad <= best_pad) {   /* ties: the larger */
            best_pad = pad;
            best = d;
        }
    }
    return best;
}

static int64_t cdiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

/* blocks one table of `g` holds when the sequence has slots for `tokens` tokens of which the last
 * `inflight` are scheduled but not yet processed: vLLM's KVCacheManager.allocate_slots frees a
 * window table's blocks wholly before the last `window` - 1 processed tokens (its
 * remove_skipped_blocks, on max(0, computed - num_in_flight_tokens)), then allocates blocks up to
 * `tokens` (docs/memory-model.md "KV cache"). inflight 1: the token being written. */
static int64_t group_blocks_inflight(const struct pd_kv_group *g, int64_t tokens, int64_t inflight)
{
    int64_t b = cdiv(tokens, g->tokens), processed = tokens - inflight;
    if (g->window > 0 && processed - g->window + 1 > 0)
        b -= (processed - g->window + 1) / g->tokens;
    return b;
}

static int64_t group_blocks(const struct pd_kv_group *g, int64_t tokens)
{
    return group_blocks_inflight(g, tokens, 1);
}

static int64_t group_max_blocks(const struct pd_kv_group *g)
{
    int64_t most = 0;
    for (int64_t t = g->window; t < g->window + g->tokens; t++) {
        int64_t b = group_blocks(g, t > 0 ? t : 1);
        most = b > most ? b : most;
    }
    return most;
}

const char *pd_kv_layout_name(const struct pd_kv_size *k)
{
    if (k->flat_per_token)
        return "a flat figure";
    if (k->layout == PD_KV_LAYOUT_SGLANG_NPU)
        return "SGLang NPU pools (--page-size 128, --swa-full-tokens-ratio 0.1)";
    return k->layout == PD_KV_LAYOUT_VLLM_ASCEND ? "vllm-ascend A2/A3 layout (--block-size 128)" : "pdmoe's layout";
}

int pd_kv_size_vllm_ascend(struct pd_kv_size *k, const struct pd_model *m, pd_err *e)
{
    if (m->arch != PD_ARCH_DEEPSEEK_V4 || k->flat_per_token || k->dtype != PD_KV_BF16)
        return pd_err_set(e, PD_EINVAL, "vllm-ascend's KV layout: a DeepSeek-V4 model with a bf16 cache");
    const int64_t S = PD_KV_ASCEND_BLOCK_SIZE, hd = m->head_dim, id = m->index_head_dim;
    int n4 = 0, nh = 0, hca = 0, mtp4 = 0, mtph = 0, mtp_layers = 0, mtp_caches = 0;
    for (int l = 0; l < k->n; l++) {
        int r = k->ratio[l], mtp = l >= m->n_layers;
        if (r == 4)
            n4++, mtp4 += mtp;
        else if (r > 0) {
            if (hca && r != hca)
                return pd_err_set(e, PD_EINVAL, "vllm-ascend's KV layout: compress ratios 4 and one other");
            hca = r;
            nh++, mtph += mtp;
        }
        mtp_layers += mtp;
        if (mtp)   /* its window, its entries and compressor state, a CSA layer's keys and their state */
            mtp_caches += 1 + (r > 0 ? 2 : 0) + (r == 4 ? 2 : 0);
    }
    if (n4 == 0 || nh == 0)
        return pd_err_set(e, PD_EINVAL, "vllm-ascend's KV layout: needs CSA (ratio 4) and HCA layers");
    const int64_t key = id + (id == 128 ? 2 : 0);   /* int8 values + one fp16 scale (head 128) */
    const int64_t page[2] = {S * key, S * 2 * hd}, big = page[0] > page[1] ? page[0] : page[1];
    /* windows (S tokens a block), CSA states (S/16), HCA states (S/4), each page within the largest */
    const int64_t win_page = S * 2 * hd, c4s[2] = {S / 16 * 2 * 2 * hd * 4, S / 16 * 2 * 2 * id * 4},
                  hs = S / 4 * 2 * hd * 4;
    if (page[0] == page[1] || win_page > big || c4s[0] > big || c4s[1] > big || hs > big)
        return pd_err_set(e, PD_EINVAL, "vllm-ascend's KV layout: the model's pages do not fit its buckets");
    const int counts[5] = {n4, nh, k->n, n4, nh};
    const int T = approx_gcd(counts, 5, n4);
    const int gw = (int)cdiv(k->n, T), g4 = (int)cdiv(n4, T), gh = (int)cdiv(nh, T);
    /* the largest bucket of a table, MTP caches set apart (the drafter's layers come last) */
    int most = n4 - mtp4;
    const int sub[4] = {nh - mtph, (int)cdiv(k->n - mtp_layers, gw), (int)cdiv(n4 - mtp4, g4), (int)cdiv(nh - mtph, gh)};
    for (int i = 0; i < 4; i++)
        most = sub[i] > most ? sub[i] : most;
    k->layout = PD_KV_LAYOUT_VLLM_ASCEND;
    k->index_key_bytes = key;
    k->block_entries = S;
    k->layer_tuples = most + mtp_caches;
    k->page_bytes[0] = page[1];
    k->page_bytes[1] = page[0];
    k->block_id_bytes = (page[0] + page[1]) * k->layer_tuples;
    k->n_grp = 5;
    k->grp[0] = (struct pd_kv_group){"CSA entries and indexer keys", S * 4, 0, 1};
    k->grp[1] = (struct pd_kv_group){"HCA entries", S * hca, 0, 1};
    k->grp[2] = (struct pd_kv_group){"sliding windows", S, k->window, gw};
    k->grp[3] = (struct pd_kv_group){"CSA compressor states", S / 16, 2 * 4, g4};
    k->grp[4] = (struct pd_kv_group){"HCA compressor states", S / 4, hca, gh};
    memset(k->per_token_kind, 0, sizeof k->per_token_kind);
    k->per_token_kind[PD_KV_CSA] = (double)k->block_id_bytes / (double)k->grp[0].tokens;
    k->per_token_kind[PD_KV_HCA] = (double)k->block_id_bytes / (double)k->grp[1].tokens;
    k->per_token = k->per_token_kind[PD_KV_CSA] + k->per_token_kind[PD_KV_HCA];
    k->window_bytes = gw * group_max_blocks(&k->grp[2]) * k->block_id_bytes;
    k->state_bytes = (g4 * group_max_blocks(&k->grp[3]) + gh * group_max_blocks(&k->grp[4])) * k->block_id_bytes;
    k->per_seq_fixed = k->window_bytes + k->state_bytes;
    return 0;
}

/* SGLang on Ascend NPUs, a DeepSeek-V4 model with its bf16 cache (SGLang 0a3cd26b; the file:line
 * facts are in docs/memory-model.md "KV cache"):
 * - sizing (pool_configurator.py DSV4PoolConfigurator): F "full tokens" = (budget - the fixed c128
 *   state bytes) / bytes_per_full_token, rounded down to the page; the window pool holds
 *   int(F x 0.1) tokens (a page multiple), the CSA pool F / 4 entries, the HCA pool F / 128, the
 *   indexer (F / 128) x 32 keys. The coefficient counts an entry as fp8 (584 B), a key as 132 B and
 *   the CSA states as rings of the window pool's pages, on every device.
 * - the NPU pools (hardware_backend/npu/dsv4/dsv4_memory_pool.py): entries bf16 (2 x head_dim) in
 *   pages of 128 with two pages more than the size; keys twice (the base 132-B buffer in pages of 32,
 *   and an int8 key + fp16 scale in pages of 128); compressor states in pages of 128 rows, 2 (CSA,
 *   main and indexer) and 3 (HCA) pages a request plus a sentinel page, the HCA pool at least
 *   (requests + 1) x its ring; the MTP draft a window pool of the target's size. */
static int64_t sgl_pages(int64_t size, int64_t page)   /* (size + page + 1) // page: the pools' +1 slot */
{
    return (size + page + 1) / page;
}

int pd_kv_size_sglang_npu(struct pd_kv_size *k, const struct pd_model *m, int spec, pd_err *e)
{
    if (m->arch != PD_ARCH_DEEPSEEK_V4 || k->flat_per_token || k->dtype != PD_KV_BF16)
        return pd_err_set(e, PD_EINVAL, "SGLang's NPU KV pools: a DeepSeek-V4 model with a bf16 cache");
    struct pd_kv_sglang g = {0};
    g.page = 128;
    g.swa_ratio = 0.1;
    g.spec = spec;
    g.n_all = m->n_layers;
    g.n_draft = k->n - m->n_layers;
    for (int l = 0; l < m->n_layers; l++) {
        if (k->ratio[l] == 4)
            g.n4++;
        else if (k->ratio[l] == 128)
            g.n128++;
        else if (k->ratio[l] != 0)
            return pd_err_set(e, PD_EINVAL, "SGLang's NPU KV pools: compress ratios 0, 4 and 128 only");
    }
    if (g.n4 == 0)
        return pd_err_set(e, PD_EINVAL, "SGLang's NPU KV pools: needs CSA (ratio 4) layers");
    const int64_t hd = m->head_dim, rope = m->qk_rope_head_dim, id = m->index_head_dim;
    g.window = m->sliding_window;
    g.ring4 = spec ? 16 : 8;
    g.ring128 = spec ? 256 : 128;
    g.acct_entry = (hd - rope) + 2 * rope + 8;
    g.acct_key = id + id / 128 * 4;
    /* the sizing's sum, term by term in its order (its floats, so that F is SGLang's to the token) */
    const double r = g.swa_ratio, ring4 = (double)g.ring4 / (double)g.window;
    double b = r * (double)g.acct_entry * g.n_all;
    b += 0.25 * (double)g.acct_entry * g.n4;
    b += 1.0 / 128 * (double)g.acct_entry * g.n128;
    b += 0.25 * (double)g.acct_key * g.n4;
    b += r * ring4 * (double)(2 * 2 * hd * 4) * g.n4;
    b += r * ring4 * (double)(2 * 2 * id * 4) * g.n4;
    if (spec)   /* the draft worker, one layer: (N + 1) / N */
        b *= (double)(g.n_all + 1) / (double)g.n_all;
    g.bytes_per_full_token = b;
    g.entry = 2 * hd;
    g.key_base = id + 4;
    g.key_npu = id + 2;
    g.state4_row = 2 * 2 * hd * 4 + 2 * 2 * id * 4;
    g.state128_row = 2 * hd * 4;
    g.blocks4 = cdiv(18 * 4, 10 * g.page) + 1;
    g.blocks4 = g.blocks4 > 2 ? g.blocks4 : 2;
    g.blocks128 = cdiv(18 * 128, 10 * g.page) + 1;
    g.blocks128 = g.blocks128 > 2 ? g.blocks128 : 2;
    k->layout = PD_KV_LAYOUT_SGLANG_NPU;
    k->sgl = g;
    k->index_key_bytes = g.key_npu;   /* what the indexer reads (npu_quant_lightning_indexer) */
    k->block_entries = g.page;
    memset(k->per_token_kind, 0, sizeof k->per_token_kind);
    k->per_token_kind[PD_KV_WINDOW] = r * (double)g.entry * (g.n_all + g.n_draft);
    k->per_token_kind[PD_KV_CSA] = (double)(g.entry + g.key_base + g.key_npu) * g.n4 / 4;
    k->per_token_kind[PD_KV_HCA] = (double)g.entry * g.n128 / 128;
    k->per_token = k->per_token_kind[PD_KV_WINDOW] + k->per_token_kind[PD_KV_CSA] + k->per_token_kind[PD_KV_HCA];
    k->window_bytes = 0;
    k->state_bytes = g.n4 * g.blocks4 * g.page * g.state4_row + g.n128 * g.blocks128 * g.page * g.state128_row;
    k->per_seq_fixed = k->state_bytes;
    return 0;
}

void pd_kv_sgl_pools(const struct pd_kv_size *k, int64_t budget, int64_t reqs, int64_t extra, struct pd_kv_sgl_pools *o)
{
    const struct pd_kv_sglang *g = &k->sgl;
    const int64_t P = g->page;
    memset(o, 0, sizeof *o);
    /* _get_c128_state_fixed_bytes: a ring per request slot (_get_num_req_slots: requests, a decode
     * node's pre-allocated slots, one more) and one more ring and row, in 128-row pages */
    int64_t rows = (reqs + extra + 1) * g->ring128 + g->ring128 + 1;
    o->c128_fixed_acct = g->n128 ? cdiv(rows, 128) * 128 * g->state128_row * g->n128 : 0;
    int64_t avail = budget - o->c128_fixed_acct;
    avail = avail > 0 ? avail : 0;
    o->full = (int64_t)((double)avail / g->bytes_per_full_token) / P * P;
    o->swa = (int64_t)((double)o->full * g->swa_ratio) / P * P;
    o->c4 = o->full / 4;
    o->c128 = o->full / 128;
    o->reqs = reqs < o->full / 2 ? reqs : o->full / 2;   /* resolve_max_num_reqs */
    const int64_t keys = o->c128 * 32, R = o->reqs;
    o->slots = R + extra + 1;
    o->c4_state = (g->blocks4 * R + 1) * P;
    /* the HCA pool: at least a ring per request slot, req_to_token's rows */
    int64_t s128 = g->blocks128 * R * P, ring = o->slots * g->ring128;
    s128 = s128 > ring ? s128 : ring;
    o->c128_state = (cdiv(s128, P) + 1) * P;
    o->bytes = sgl_pages(o->swa, P) * P * g->entry * (g->n_all + g->n_draft)
               + sgl_pages(o->c4, P) * P * g->entry * g->n4
               + sgl_pages(o->c128, P) * P * g->entry * g->n128
               + (sgl_pages(keys, P / 4) * (P / 4) * g->key_base + sgl_pages(keys, P) * P * g->key_npu) * g->n4
               + o->c4_state * g->state4_row * g->n4 + o->c128_state * g->state128_row * g->n128;
}

int64_t pd_kv_sgl_budget(const struct pd_kv_size *k, int64_t room, int64_t reqs, int64_t extra)
{
    struct pd_kv_sgl_pools q;
    int64_t lo = 0, hi = room;   /* the pools grow with the budget */
    while (lo < hi) {
        int64_t mid = lo + (hi - lo + 1) / 2;
        pd_kv_sgl_pools(k, mid, reqs, extra, &q);
        if (q.bytes <= room)
            lo = mid;
        else
            hi = mid - 1;
    }
    pd_kv_sgl_pools(k, lo, reqs, extra, &q);
    return q.bytes <= room ? lo : 0;
}

/* DSV4NPUReqToTokenPool (hardware_backend/npu/dsv4/dsv4_req_to_token_pool.py): ReqToTokenPool's
 * req_to_token and five tables more, each (slots, columns) int32, allocated after the pools are
 * sized from the whole budget (kv_cache_configurator.py _init_pools), so outside it:
 *     bytes = slots x 4 x (5 L + max(1, L / 4) + max(1, L / 128)),  L = row_tokens */
int64_t pd_kv_sgl_tables(int64_t slots, int64_t row_tokens)
{
    const int64_t L = row_tokens, c4 = L / 4 > 1 ? L / 4 : 1, c128 = L / 128 > 1 ? L / 128 : 1;
    return slots > 0 && L > 0 ? slots * 4 * (5 * L + c4 + c128) : 0;
}

/* the most blocks a sequence holds at any length up to `tokens` with `inflight` of them scheduled
 * and not yet processed: the whole-sequence tables only grow, and every window table repeats with
 * a period of its block once its window and the in-flight tokens are filled, and before that
 * holds no more than a period later, so the most is reached within the last lcm(blocks) lengths */
static int64_t ascend_blocks(const struct pd_kv_size *k, int64_t tokens, int64_t inflight)
{
    int64_t period = 1;
    for (int g = 0; g < k->n_grp; g++)
        if (k->grp[g].window > 0)
            period = period / gcd64(period, k->grp[g].tokens) * k->grp[g].tokens;
    int64_t most = 0;
    for (int64_t t = tokens - period + 1 > 1 ? tokens - period + 1 : 1; t <= tokens; t++) {
        int64_t b = 0;
        for (int g = 0; g < k->n_grp; g++)
            b += k->grp[g].n * group_blocks_inflight(&k->grp[g], t, inflight < t ? inflight : t);
        most = b > most ? b : most;
    }
    return most;
}

int64_t pd_kv_seq_bytes(const struct pd_kv_size *k, int64_t tokens)
{
    if (tokens <= 0)
        return 0;
    if (k->flat_per_token)
        return tokens * k->flat_per_token;
    if (k->layout == PD_KV_LAYOUT_VLLM_ASCEND)
        return ascend_blocks(k, tokens, 1) * k->block_id_bytes;
    if (k->layout == PD_KV_LAYOUT_SGLANG_NPU)   /* its full-pool slots, page by page, and its state pages */
        return (int64_t)ceil((double)(cdiv(tokens, k->sgl.page) * k->sgl.page) * k->per_token) + k->per_seq_fixed;
    int64_t b = 0;
    for (int l = 0; l < k->n; l++) {
        int r = k->ratio[l];
        if (r < 0) {
            b += tokens * k->entry_bytes;
            continue;
        }
        b += (tokens < k->window ? tokens : k->window) * k->entry_bytes;
        if (r > 0) {
            int64_t entries = tokens / r, be = k->block_entries, page = be * k->entry_bytes;
            b += (entries + be - 1) / be * page + k->state[l];
            if (r == 4) {   /* the keys: pages of the same bytes, page / key_bytes keys each */
                int64_t per = page / k->index_key_bytes;
                b += (entries + per - 1) / per * page;
            }
        }
    }
    return b;
}

int64_t pd_kv_inflight_bytes(const struct pd_kv_size *k, int64_t tokens, int64_t inflight)
{
    if (k->layout != PD_KV_LAYOUT_VLLM_ASCEND || k->flat_per_token || tokens <= 0 || inflight <= 1)
        return 0;
    return (ascend_blocks(k, tokens, inflight) - ascend_blocks(k, tokens, 1)) * k->block_id_bytes;
}

int64_t pd_kv_max_context(const struct pd_kv_size *k, int64_t bytes, int64_t seqs)
{
    if (seqs <= 0 || bytes <= 0)
        return 0;
    int64_t per = bytes / seqs;
    /* seq bytes grow monotonically with tokens: binary search the largest that fits */
    int64_t lo = 0, hi = 1;
    while (pd_kv_seq_bytes(k, hi) <= per && hi < (INT64_C(1) << 40))
        hi *= 2;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo + 1) / 2;
        if (pd_kv_seq_bytes(k, mid) <= per)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

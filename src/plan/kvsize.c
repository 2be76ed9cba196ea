/* KV cache bytes per token and per sequence, computed from the architecture. */
#include "plan/kvsize.h"

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

int64_t pd_kv_seq_bytes(const struct pd_kv_size *k, int64_t tokens)
{
    if (tokens <= 0)
        return 0;
    if (k->flat_per_token)
        return tokens * k->flat_per_token;
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

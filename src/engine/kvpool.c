/* Paged KV cache: fixed slots for windows and compressor states, shared blocks for the
 * compressed entries and indexer keys. Invariants are asserted where they must hold. */
#include "engine/kvpool.h"
#include "core/grow.h"
#include "core/mem.h"
#include "kernels/fp8.h"
#include "kernels/ops.h"
#include "kernels/vec.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

static size_t state_bytes(int coff, int ratio, int d)
{
    return 2 * (size_t)coff * ratio * (size_t)coff * d * sizeof(float);
}

void pd_kvpool_entry_bytes(const struct pd_model *m, enum pd_kv_dtype dtype, size_t *entry, size_t *key)
{
    int64_t e, k;
    pd_kv_v4_entry_bytes(m, dtype, &e, &k);   /* (plan/kvsize.h: the one statement of the layout) */
    *entry = (size_t)e;
    *key = (size_t)k;
}

int pd_kvpool_init(struct pd_kvpool *p, const struct pd_model *m, enum pd_kv_dtype dtype, int max_seqs,
                   size_t bytes, int block_entries, pd_err *e)
{
    return pd_kvpool_init_layers(p, m, m->n_layers, dtype, max_seqs, bytes, block_entries, e);
}

int pd_kvpool_init_layers(struct pd_kvpool *p, const struct pd_model *m, int n_layers, enum pd_kv_dtype dtype,
                          int max_seqs, size_t bytes, int block_entries, pd_err *e)
{
    memset(p, 0, sizeof *p);
    assert(n_layers >= m->n_layers && n_layers <= pd_model_total_layers(m));
    if (m->arch != PD_ARCH_DEEPSEEK_V4)
        return pd_err_set(e, PD_EINVAL, "KV pool: the engine runs deepseek_v4 models, %s is %s", m->name,
                          pd_model_arch_name(m->arch));
    if (max_seqs < 1 || block_entries < 1)
        return pd_err_set(e, PD_EINVAL, "KV pool: %d sequences, %d entries per block: both must be positive",
                          max_seqs, block_entries);
    p->n_layers = n_layers;
    p->lag_from = m->n_layers;
    p->window = m->sliding_window;
    p->head_dim = m->head_dim;
    p->index_head_dim = m->index_head_dim;
    p->rope_dim = m->qk_rope_head_dim;
    p->dtype = dtype;
    pd_kvpool_entry_bytes(m, dtype, &p->entry_bytes, &p->key_bytes);
    /* a block holds whole keys as well as whole entries (plan/kvsize.h, as the planner pages) */
    block_entries = (int)pd_kv_block_entries((int64_t)p->entry_bytes, (int64_t)p->key_bytes, block_entries);
    p->block_entries = block_entries;
    p->block_bytes = (size_t)block_entries * p->entry_bytes;
    p->block_keys = (int)(p->block_bytes / p->key_bytes);
    assert((size_t)p->block_keys * p->key_bytes == p->block_bytes);
    p->layer = calloc((size_t)p->n_layers, sizeof *p->layer);
    if (!p->layer)
        return pd_err_set(e, PD_ENOMEM, "KV pool: out of memory");
    size_t off = 0;
    for (int l = 0; l < p->n_layers; l++) {
        struct pd_kvlayer *k = &p->layer[l];
        k->ratio = m->compress_ratio[l];
        k->coff = k->ratio == 4 ? 2 : 1;
        k->window_off = off;
        off += (size_t)p->window * p->entry_bytes;
        if (k->ratio) {
            k->state_off = off;
            off += state_bytes(k->coff, k->ratio, p->head_dim);
        }
        if (k->ratio == 4) {
            k->idx_state_off = off;
            off += state_bytes(k->coff, k->ratio, p->index_head_dim);
        }
    }
    p->slot_bytes = off;
    if (bytes < (size_t)max_seqs * p->slot_bytes + p->block_bytes)
        return pd_err_set(e, PD_EINVAL, "KV pool: %zu bytes cannot hold %d sequences of %zu fixed bytes and one block",
                          bytes, max_seqs, p->slot_bytes);
    p->n_slots = max_seqs;
    p->n_blocks = (int)((bytes - (size_t)max_seqs * p->slot_bytes) / p->block_bytes);
    p->region_bytes = (size_t)max_seqs * p->slot_bytes + (size_t)p->n_blocks * p->block_bytes;
    p->region = malloc(p->region_bytes);
    p->slots = p->region;
    p->blocks = p->region ? p->region + (size_t)max_seqs * p->slot_bytes : NULL;
    p->slot_free = malloc((size_t)max_seqs * sizeof(int));
    size_t words = ((size_t)p->n_blocks + 63) / 64;
    p->block_used = calloc(words, sizeof *p->block_used);
    p->block_ref = calloc((size_t)p->n_blocks + 1, sizeof *p->block_ref);
    if (!p->region || !p->slot_free || !p->block_used || !p->block_ref) {
        pd_kvpool_free(p);
        char note[320];
        pd_as_note(note, sizeof note, (int64_t)bytes);
        return pd_err_set(e, *note ? PD_EINVAL : PD_ENOMEM, "KV pool: out of memory for %zu bytes (%.2f GB)%s%s", bytes,
                          (double)bytes / 1e9, *note ? ": " : "", note);
    }
    /* the free stack hands out low slots first; the bits past the last block read as used */
    for (int i = 0; i < max_seqs; i++)
        p->slot_free[i] = max_seqs - 1 - i;
    if (p->n_blocks % 64)
        p->block_used[words - 1] = ~0ull << (p->n_blocks % 64);
    p->n_slots_free = max_seqs;
    p->n_blocks_free = p->n_blocks;
    return 0;
}

void pd_kvpool_free(struct pd_kvpool *p)
{
    free(p->layer);
    if (!p->region_lent)
        free(p->region);
    free(p->slot_free);
    free(p->block_used);
    free(p->block_ref);
    memset(p, 0, sizeof *p);
}

void pd_kvpool_move(struct pd_kvpool *p, void *region)
{
    assert(p->live_seqs == 0);
    if (!p->region_lent)
        free(p->region);
    p->region = region;
    p->region_lent = 1;
    p->slots = p->region;
    p->blocks = p->region + (size_t)p->n_slots * p->slot_bytes;
}

double pd_kvpool_bytes_per_token(const struct pd_kvpool *p)
{
    double b = 0;
    for (int l = 0; l < p->n_layers; l++) {
        const struct pd_kvlayer *k = &p->layer[l];
        if (k->ratio)
            b += (double)(p->entry_bytes + (k->ratio == 4 ? p->key_bytes : 0)) / k->ratio;
    }
    return b;
}

size_t pd_kvpool_bytes_per_seq(const struct pd_kvpool *p)
{
    return p->slot_bytes;
}

size_t pd_kvpool_seq_bytes(const struct pd_kvpool *p, const struct pd_kvseq *s)
{
    if (s->slot < 0)
        return 0;
    size_t b = p->slot_bytes;
    for (int l = 0; l < p->n_layers; l++)
        b += (size_t)(s->n_blocks[l] + s->n_kblocks[l]) * p->block_bytes;
    return b;
}

int pd_kvseq_alloc(struct pd_kvpool *p, struct pd_kvseq *s, pd_err *e)
{
    memset(s, 0, sizeof *s);
    s->slot = -1;
    if (p->n_slots_free == 0)
        return pd_err_set(e, PD_ENOMEM, "KV pool full: all %d sequence slots are in use", p->n_slots);
    int L = p->n_layers;
    s->blocks = calloc((size_t)L, sizeof *s->blocks);
    s->kblocks = calloc((size_t)L, sizeof *s->kblocks);
    s->n_blocks = calloc((size_t)L * 4, sizeof(int));
    if (!s->blocks || !s->kblocks || !s->n_blocks) {
        free(s->blocks);
        free(s->kblocks);
        free(s->n_blocks);
        memset(s, 0, sizeof *s);
        s->slot = -1;
        return pd_err_set(e, PD_ENOMEM, "KV pool: out of memory");
    }
    s->cap_blocks = s->n_blocks + L;
    s->n_kblocks = s->n_blocks + 2 * L;
    s->cap_kblocks = s->n_blocks + 3 * L;
    s->slot = p->slot_free[--p->n_slots_free];
    p->live_seqs++;
    return 0;
}

static int64_t entries_at(const struct pd_kvlayer *k, int64_t len)
{
    return k->ratio ? len / k->ratio : 0;
}

int pd_kvpool_blocks_for(const struct pd_kvpool *p, int64_t len)
{
    int64_t need = 0;
    for (int l = 0; l < p->n_layers; l++) {
        const struct pd_kvlayer *k = &p->layer[l];
        int64_t n = entries_at(k, len);
        need += (n + p->block_entries - 1) / p->block_entries;
        if (k->ratio == 4)
            need += (n + p->block_keys - 1) / p->block_keys;
    }
    return (int)need;
}

int pd_kvseq_blocks_needed(const struct pd_kvpool *p, const struct pd_kvseq *s, int64_t len)
{
    int64_t need = 0;
    for (int l = 0; l < p->n_layers; l++) {
        const struct pd_kvlayer *k = &p->layer[l];
        int64_t n = entries_at(k, len);
        int64_t nb = (n + p->block_entries - 1) / p->block_entries;
        if (nb > s->n_blocks[l])
            need += nb - s->n_blocks[l];
        if (k->ratio == 4) {
            int64_t kb = (n + p->block_keys - 1) / p->block_keys;
            if (kb > s->n_kblocks[l])
                need += kb - s->n_kblocks[l];
        }
    }
    return (int)need;
}

static int block_is_used(const struct pd_kvpool *p, int64_t b)
{
    return (int)(p->block_used[b >> 6] >> (b & 63) & 1);
}

/* The first block at or after b that is used (used = 1) or free (used = 0), else n_blocks. Runs
 * are stepped over a word at a time (count trailing zeros), so a scan costs one step per word or
 * per run, not per block; the bits past the pool's end read as used. */
static int64_t next_block(const struct pd_kvpool *p, int64_t b, int used)
{
    while (b < p->n_blocks) {
        int bit = (int)(b & 63);
        uint64_t w = p->block_used[b >> 6] >> bit;
        uint64_t hits = (used ? w : ~w) & (~0ull >> bit);
        if (hits) {
            b += __builtin_ctzll(hits);
            return b < p->n_blocks ? b : p->n_blocks;
        }
        b += 64 - bit;
    }
    return p->n_blocks;
}

/* The first block of the lowest extent of n free blocks, or -1. */
static int64_t free_extent(const struct pd_kvpool *p, int64_t n)
{
    for (int64_t b = next_block(p, p->block_low, 0); b < p->n_blocks; b = next_block(p, b, 0)) {
        int64_t end = next_block(p, b, 1);
        if (end - b >= n)
            return b;
        b = end;
    }
    return -1;
}

/* The lowest free block at or above *at (there is one: the caller counted them). */
static int take_block(struct pd_kvpool *p, int64_t *at)
{
    int64_t b = next_block(p, *at, 0);
    assert(b < p->n_blocks && !block_is_used(p, b));
    p->block_used[b >> 6] |= 1ull << (b & 63);
    p->block_ref[b] = 1;
    p->n_blocks_free--;
    if (b == p->block_low)
        p->block_low++;
    *at = b + 1;
    return (int)b;
}

/* Room for one more block in a sequence's list of a layer (n in use, *cap allocated). */
static int room(int **list, int n, int *cap)
{
    if (n < *cap)
        return 0;
    int c = *cap ? 2 * *cap : 8;
    int *x = realloc(*list, (size_t)c * sizeof *x);
    if (!x)
        return PD_ENOMEM;
    *list = x;
    *cap = c;
    return 0;
}

static int push_block(struct pd_kvpool *p, int **list, int *n, int *cap, int64_t *at)
{
    if (room(list, *n, cap))   /* before taking the block: a block taken is never lost */
        return PD_ENOMEM;
    (*list)[(*n)++] = take_block(p, at);
    return 0;
}

/* 1, with the error, when `need` more blocks (for `len` tokens) are not free. */
static int no_room(const struct pd_kvpool *p, int need, int64_t len, pd_err *e)
{
    if (need <= p->n_blocks_free)
        return 0;
    pd_err_set(e, PD_ENOMEM, "KV pool full: %d more blocks needed for %lld tokens, %d free of %d", need, (long long)len,
               p->n_blocks_free, p->n_blocks);
    return 1;
}

int pd_kvseq_reserve(struct pd_kvpool *p, struct pd_kvseq *s, int64_t len, pd_err *e)
{
    assert(s->slot >= 0);
    int need = pd_kvseq_blocks_needed(p, s, len);
    if (no_room(p, need, len, e))
        return PD_ENOMEM;
    if (need == 0)
        return 0;
    /* one extent if the pool has one, else the lowest free blocks: ascending either way */
    int64_t at = free_extent(p, need);
    if (at < 0)
        at = p->block_low;
    for (int l = 0; l < p->n_layers; l++) {
        const struct pd_kvlayer *k = &p->layer[l];
        int64_t n = entries_at(k, len);
        while ((int64_t)s->n_blocks[l] * p->block_entries < n)
            if (push_block(p, &s->blocks[l], &s->n_blocks[l], &s->cap_blocks[l], &at))
                return pd_err_set(e, PD_ENOMEM, "KV pool: out of memory");
        while (k->ratio == 4 && (int64_t)s->n_kblocks[l] * p->block_keys < n)
            if (push_block(p, &s->kblocks[l], &s->n_kblocks[l], &s->cap_kblocks[l], &at))
                return pd_err_set(e, PD_ENOMEM, "KV pool: out of memory");
    }
    return 0;
}

int pd_kvseq_reserve_prompt(struct pd_kvpool *p, struct pd_kvseq *s, int64_t prompt, int64_t total, pd_err *e)
{
    if (no_room(p, pd_kvseq_blocks_needed(p, s, total), total, e))
        return PD_ENOMEM;
    int rc = pd_kvseq_reserve(p, s, prompt < total ? prompt : total, e);
    return rc ? rc : pd_kvseq_reserve(p, s, total, e);
}

/* Drops one reference to block b; the last one frees it. */
static void unref_block(struct pd_kvpool *p, int b)
{
    assert(b >= 0 && b < p->n_blocks && block_is_used(p, b) && p->block_ref[b] > 0);
    if (--p->block_ref[b] > 0)
        return;
    p->block_used[b >> 6] &= ~(1ull << (b & 63));
    if (b < p->block_low)
        p->block_low = b;
    p->n_blocks_free++;
}

static void give_back(struct pd_kvpool *p, int *list, int n)
{
    for (int i = 0; i < n; i++)
        unref_block(p, list[i]);
}

void pd_kvpool_hold(struct pd_kvpool *p, int b)
{
    assert(b >= 0 && b < p->n_blocks && block_is_used(p, b) && p->block_ref[b] > 0);
    p->block_ref[b]++;
    p->held++;
}

void pd_kvpool_unhold(struct pd_kvpool *p, int b)
{
    assert(p->held > 0);
    p->held--;
    unref_block(p, b);
}

int pd_kvseq_share(struct pd_kvpool *p, struct pd_kvseq *s, int layer, int key, int b)
{
    assert(s->slot >= 0 && b >= 0 && b < p->n_blocks && p->block_ref[b] > 0);
    int **list = key ? &s->kblocks[layer] : &s->blocks[layer];
    int *n = key ? &s->n_kblocks[layer] : &s->n_blocks[layer], *cap = key ? &s->cap_kblocks[layer] : &s->cap_blocks[layer];
    if (room(list, *n, cap))
        return PD_ENOMEM;
    (*list)[(*n)++] = b;
    p->block_ref[b]++;
    return 0;
}

void pd_kvseq_free(struct pd_kvpool *p, struct pd_kvseq *s)
{
    if (s->slot < 0)
        return;
    for (int l = 0; l < p->n_layers; l++) {
        give_back(p, s->blocks[l], s->n_blocks[l]);
        give_back(p, s->kblocks[l], s->n_kblocks[l]);
        free(s->blocks[l]);
        free(s->kblocks[l]);
    }
    free(s->blocks);
    free(s->kblocks);
    free(s->n_blocks);
    p->slot_free[p->n_slots_free++] = s->slot;
    p->live_seqs--;
    assert(p->n_blocks_free <= p->n_blocks && p->n_slots_free <= p->n_slots);
    /* with no live sequence, every block and slot is back but the blocks held apart (a prefix
     * cache's, one reference each) */
    assert(p->live_seqs > 0 || (p->n_blocks_free + p->held == p->n_blocks && p->n_slots_free == p->n_slots));
    memset(s, 0, sizeof *s);
    s->slot = -1;
}

void *pd_kv_window(const struct pd_kvpool *p, const struct pd_kvseq *s, int layer, int64_t pos)
{
    uint8_t *slot = p->slots + (size_t)s->slot * p->slot_bytes;
    return slot + p->layer[layer].window_off + (size_t)(pos % p->window) * p->entry_bytes;
}

float *pd_kv_state(const struct pd_kvpool *p, const struct pd_kvseq *s, int layer, int indexer)
{
    uint8_t *slot = p->slots + (size_t)s->slot * p->slot_bytes;
    return (float *)(slot + (indexer ? p->layer[layer].idx_state_off : p->layer[layer].state_off));
}

void *pd_kv_entry(const struct pd_kvpool *p, const struct pd_kvseq *s, int layer, int64_t i)
{
    int b = s->blocks[layer][i / p->block_entries];
    return p->blocks + (size_t)b * p->block_bytes + (size_t)(i % p->block_entries) * p->entry_bytes;
}

void *pd_kv_key(const struct pd_kvpool *p, const struct pd_kvseq *s, int layer, int64_t i)
{
    int b = s->kblocks[layer][i / p->block_keys];
    return p->blocks + (size_t)b * p->block_bytes + (size_t)(i % p->block_keys) * p->key_bytes;
}

/* bf16 values through memcpy: an fp8 entry's rope part need not be 2-aligned in general */
static void put_bf16(uint8_t *dst, const float *src, int n)
{
    for (int i = 0; i < n; i++) {
        uint16_t b = pd_f32_to_bf16(src[i]);
        memcpy(dst + 2 * (size_t)i, &b, 2);
    }
}

static void get_bf16(float *dst, const uint8_t *src, int n)
{
    for (int i = 0; i < n; i++) {
        uint16_t b;
        memcpy(&b, src + 2 * (size_t)i, 2);
        dst[i] = pd_bf16_to_f32(b);
    }
}

/* The official code's activations are bf16 when it quantizes them: round first, as it does. */
static void round_bf16(const float *src, float *dst, int n)
{
    for (int i = 0; i < n; i++)
        dst[i] = pd_bf16_to_f32(pd_f32_to_bf16(src[i]));
}

void pd_kv_put_entry(const struct pd_kvpool *p, void *dst, const float *src)
{
    uint8_t *d = dst;
    const int hd = p->head_dim, rope = p->rope_dim, nope = hd - rope;
    if (p->dtype != PD_KV_FP8) {
        put_bf16(d, src, hd);
        return;
    }
    float x[2048];
    assert(nope <= 2048);
    round_bf16(src, x, nope);
    int ns = (nope + 63) / 64;
    pd_fp8_quant_blocks(x, nope, 64, d, d + nope + 2 * (size_t)rope);
    put_bf16(d + nope, src + nope, rope);
    size_t used = (size_t)nope + 2 * (size_t)rope + (size_t)ns;
    memset(d + used, 0, p->entry_bytes - used);
}

void pd_kv_get_entry(const struct pd_kvpool *p, float *dst, const void *src)
{
    const uint8_t *s = src;
    const int hd = p->head_dim, rope = p->rope_dim, nope = hd - rope;
    if (p->dtype != PD_KV_FP8) {
        pd_bf16_to_f32_row(src, dst, hd);
        return;
    }
    pd_fp8_dequant_blocks(s, s + nope + 2 * (size_t)rope, nope, 64, dst);
    get_bf16(dst + nope, s + nope, rope);
}

void pd_kv_put_key(const struct pd_kvpool *p, void *dst, const float *src)
{
    uint8_t *d = dst;
    const int id = p->index_head_dim;
    if (p->dtype != PD_KV_FP8) {
        put_bf16(d, src, id);
        return;
    }
    /* one power-of-two scale for the whole key, kept as fp32 (4 bytes) */
    float x[1024];
    assert(id <= 1024);
    round_bf16(src, x, id);
    uint8_t sb;
    pd_fp8_quant_blocks(x, id, id, d, &sb);
    float s = pd_ue8m0_value(sb);
    memcpy(d + id, &s, 4);
}

void pd_kv_get_key(const struct pd_kvpool *p, float *dst, const void *src)
{
    const uint8_t *s = src;
    const int id = p->index_head_dim;
    if (p->dtype != PD_KV_FP8) {
        pd_bf16_to_f32_row(src, dst, id);
        return;
    }
    float sc;
    memcpy(&sc, s + id, 4);
    for (int i = 0; i < id; i++)
        dst[i] = pd_e4m3_decode(s[i]) * sc;
}

int pd_kvseq_max_runs(const struct pd_kvpool *p, const struct pd_kvseq *s)
{
    int n = 1;
    for (int l = 0; l < p->n_layers; l++)
        n += s->n_blocks[l] + s->n_kblocks[l];
    return n;
}

int pd_kvseq_runs(const struct pd_kvpool *p, const struct pd_kvseq *s, int64_t len, struct pd_kv_run *runs, int max)
{
    assert(s->slot >= 0);
    if (max < pd_kvseq_max_runs(p, s))
        return -1;
    int n = 0;
    runs[n++] = (struct pd_kv_run){(uint64_t)s->slot * p->slot_bytes, p->slot_bytes};
    size_t base = (size_t)(p->blocks - p->region);
    for (int l = 0; l < p->n_layers; l++) {
        const struct pd_kvlayer *k = &p->layer[l];
        int64_t e = entries_at(k, len);
        int64_t nb = (e + p->block_entries - 1) / p->block_entries;
        int64_t nk = k->ratio == 4 ? (e + p->block_keys - 1) / p->block_keys : 0;
        assert(nb <= s->n_blocks[l] && nk <= s->n_kblocks[l]);
        for (int b = 0; b < nb; b++)
            runs[n++] = (struct pd_kv_run){base + (uint64_t)s->blocks[l][b] * p->block_bytes, p->block_bytes};
        for (int b = 0; b < nk; b++)
            runs[n++] = (struct pd_kv_run){base + (uint64_t)s->kblocks[l][b] * p->block_bytes, p->block_bytes};
    }
    return n;
}

struct pd_kv_run *pd_kvseq_runs_alloc(const struct pd_kvpool *p, const struct pd_kvseq *s, int64_t len, int *n,
                                      uint64_t *bytes)
{
    int max = pd_kvseq_max_runs(p, s);
    struct pd_kv_run *runs = malloc((size_t)max * sizeof *runs);
    *n = runs ? pd_kvseq_runs(p, s, len, runs, max) : 0;
    if (bytes)
        *bytes = 0;
    for (int i = 0; bytes && i < *n; i++)
        *bytes += runs[i].len;
    return runs;
}

/* The undo log: records of (position, address, the bytes there before the write), appended in
 * write order; rolled back newest first. */
int pd_kvundo_save(struct pd_kvundo *u, int64_t pos, void *addr, size_t len)
{
    if (u->n == 0 || pos < u->from)
        u->from = pos;
    if (PD_GROW(u->rec, u->cap, (size_t)u->n + 1) || PD_GROW(u->data, u->dcap, u->used + len))
        return PD_ENOMEM;
    memcpy(u->data + u->used, addr, len);
    u->rec[u->n++] = (struct pd_kvundo_rec){.addr = addr, .len = len, .pos = pos, .off = u->used};
    u->used += len;
    return 0;
}

void pd_kvundo_rollback(struct pd_kvundo *u, int64_t pos)
{
    for (int i = u->n - 1; i >= 0; i--)
        if (u->rec[i].pos >= pos)
            memcpy(u->rec[i].addr, u->data + u->rec[i].off, u->rec[i].len);
    pd_kvundo_clear(u);
}

void pd_kvundo_clear(struct pd_kvundo *u)
{
    u->n = 0;
    u->used = 0;
    u->from = 0;
}

void pd_kvundo_free(struct pd_kvundo *u)
{
    free(u->rec);
    free(u->data);
    memset(u, 0, sizeof *u);
}

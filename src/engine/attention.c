/* V4 attention for every token of a step (shared/reference/deepseek-v4-architecture.md):
 *   qr = q_norm(wq_a x);  q = wq_b qr -> [heads, head_dim], each head RMS-scaled, rope on its last
 *   qk_rope_head_dim dims;  kv = kv_norm(wkv x), rope likewise: the single shared K = V latent.
 *   Keys of a query at position p: the window (positions p-W+1 .. p) and, in ratio layers, the
 *   compressed entries of completed blocks (all of them in HCA layers; the indexer's top-k in CSA
 *   layers). Softmax with a per-head sink in the denominator, scale head_dim^-1/2, V = K, inverse
 *   rope on the output's rope dims; output projection in o_groups groups, then wo_b.
 * The indexer (CSA layers) works in the official code's low precision: its queries and keys
 * rotated by a Hadamard matrix and rounded through FP4 (kernels/fp4.h), its head weights scaled
 * by index_head_dim^-1/2 * index_n_heads^-1/2.
 * Projections run on the whole step; the window and compressors run per sequence in position
 * order, each token's window keys copied out as it is reached, so each token sees exactly the
 * cache it would see alone (a prefill prepares its next chunk so while this chunk's heads run);
 * then over the pool, for a prefill chunk: the indexer's scores by blocks of tokens
 * (ixblock_task), then per token its compressed entries (the indexer's top-k in CSA layers)
 * appended to those keys, and all its heads (scores and weighted sums as tiled products,
 * kernels/dot_gemm.h, with pd_dot's and pd_axpy_rows' bits). */
#include "engine/internal.h"
#include "engine/prefix.h"
#include "kernels/dot_gemm.h"
#include "kernels/fp4.h"
#include "kernels/gemm.h"
#include "kernels/ops.h"
#include "kernels/quant.h"
#include "kernels/vec.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

struct attn_bufs {
    float *qr, *q, *kv;            /* [T, q_lora], [T, heads*head_dim], [T, head_dim] */
    float *ckv, *cg;               /* compressor projections [T, coff*head_dim] */
    float *iq, *iw, *ikv, *ig;     /* indexer query, weights, compressor projections */
    float *o, *og, *oa, *ogo;      /* attention output, one group's input, wo_a output, one group's output */
    float *keys;                   /* [chunk, window + entries, head_dim] keys of each token, fp32 */
    float *scores, *iscore;        /* [chunk, heads, keys], [chunk, index heads, entries] */
    float *iscores;                /* [chunk, entries] the indexer's scores */
    int *sel;                      /* [chunk, index_topk] selected entries */
    uint64_t *rank;                /* [chunk, entries] pd_topk's work */
    int ments;                     /* compressed entries a token of the step may see, at most */
    int32_t *orow;                 /* [o_groups * T] group g's rows of o viewed as [T * o_groups, gin] */
    int *xblock;                   /* [2 * chunk] a prefill chunk's indexer blocks: first token, end */
    struct chunk_set {             /* what preparing a chunk writes (prepare_chunk), twice: a prefill
                                      prepares the next chunk while this one's heads run */
        int *nk;                   /* [chunk] keys of each prepared token (window keys where the
                                      token's keys are its own, decode) */
        float *strip;              /* [chunk + items * (window - 1), head_dim] a prefill chunk's window
                                      keys, each item's positions in order, shared by its tokens */
        int *wrow, *nw;            /* [chunk] a token's first row in strip, its window keys there */
    } set[2];
};

/* Token c's scratch in a chunk of attn_bufs (kmax keys, ient indexer floats a token): its keys, the
 * indexer's products (iscore) and scores (iscores), its heads' scores, its selected entries and
 * pd_topk's work. */
struct tok_scratch {
    float *keys, *iscore, *scores, *iscores;
    int *sel;
    uint64_t *rank;
};

static struct tok_scratch tok_scratch(const struct attn_bufs *b, const struct pd_model *m, int c, int kmax, int ient)
{
    return (struct tok_scratch){.keys = b->keys + (size_t)c * kmax * m->head_dim,
                                .iscore = b->iscore + (size_t)c * ient,
                                .scores = b->scores + (size_t)c * m->n_heads * kmax,
                                .iscores = b->iscores + (size_t)c * b->ments,
                                .sel = b->sel + (size_t)c * m->index_topk,
                                .rank = b->rank + (size_t)c * b->ments};
}

/* An indexer query head or key as the official code has it: bf16, Hadamard-rotated, bf16 again,
 * then FP4-simulated in blocks of 32 (of all its values when it has fewer: toy models only). */
void pd_indexer_lowp(float *x, int id)
{
    pd_bf16_round(x, id);
    pd_hadamard(x, id);
    pd_bf16_round(x, id);
    pd_fp4_simulate(x, id, id < PD_FP4_BLOCK ? id : PD_FP4_BLOCK);
}

/* Compressor: a token's projections go into the state rows of its block; when the block is
 * complete, each channel of the entry is a softmax over the block's tokens of (gate + ape)
 * weighting kv. Ratio 4 overlaps: the entry also covers the previous block through the first
 * half of the projections (the current block uses the second half). Then RMSNorm and rope at the
 * block's first position. Returns 1 when an entry was written to `entry`. */
int pd_compress_push(const struct pd_compressor_w *c, float *state, const float *kvp, const float *gate,
                         int64_t pos, const struct pd_rope *rope, float eps, float *entry)
{
    const int r = c->ratio, d = c->d, w = c->coff * d, over = c->coff == 2;
    float *kv = state, *sc = state + (size_t)c->coff * r * w;
    const int i = (int)(pos % r), row = (over ? r : 0) + i;
    memcpy(kv + (size_t)row * w, kvp, (size_t)w * sizeof(float));
    for (int k = 0; k < w; k++)
        sc[(size_t)row * w + k] = gate[k] + c->ape[(size_t)i * w + k];
    if (i != r - 1)
        return 0;
    const int64_t block = pos / r;
    const int prev = over && block > 0;
    /* 16 channels at a time: their maxima, then the block's weights (float exponentials,
     * pd_expf_rows) summed in double, token j of the block, then (overlapping) j of the previous */
    for (int c0 = 0; c0 < d; c0 += 16) {
        const int nc = d - c0 < 16 ? d - c0 : 16;
        const float *cur = sc + (size_t)(over ? r : 0) * w + (over ? d : 0) + c0, *old = sc + c0;
        const float *kcur = kv + (size_t)(over ? r : 0) * w + (over ? d : 0) + c0, *kold = kv + c0;
        float m[16], p[16];
        double num[16] = {0}, den[16] = {0};
        for (int ch = 0; ch < nc; ch++)
            m[ch] = -INFINITY;
        for (int j = 0; j < r; j++)
            for (int ch = 0; ch < nc; ch++) {
                float s = cur[(size_t)j * w + ch];
                m[ch] = s > m[ch] ? s : m[ch];
                if (prev)
                    m[ch] = old[(size_t)j * w + ch] > m[ch] ? old[(size_t)j * w + ch] : m[ch];
            }
        for (int j = 0; j < r; j++)
            for (int half = 0; half <= prev; half++) {
                const float *sj = (half ? old : cur) + (size_t)j * w, *kj = (half ? kold : kcur) + (size_t)j * w;
                for (int ch = 0; ch < nc; ch++)
                    p[ch] = sj[ch] - m[ch];
                pd_expf_rows(p, p, nc);
                for (int ch = 0; ch < nc; ch++) {
                    num[ch] += (double)p[ch] * kj[ch];
                    den[ch] += p[ch];
                }
            }
        for (int ch = 0; ch < nc; ch++)
            entry[c0 + ch] = (float)(num[ch] / den[ch]);
    }
    if (over) {
        /* the current block becomes the previous one */
        memcpy(kv, kv + (size_t)r * w, (size_t)r * w * sizeof(float));
        memcpy(sc, sc + (size_t)r * w, (size_t)r * w * sizeof(float));
    }
    pd_rmsnorm(entry, c->norm, eps, d, entry);
    pd_rope_apply(rope, entry + d - rope->dim, block * r, 0);
    return 1;
}

/* Saves in u the state rows pd_compress_push writes for position pos: its kv and score rows and,
 * when pos ends a block of an overlapping compressor, the previous-block half it shifts into. */
static int compress_save(struct pd_kvundo *u, const struct pd_compressor_w *c, float *state, int64_t pos)
{
    const int r = c->ratio, w = c->coff * c->d, over = c->coff == 2;
    float *kv = state, *sc = state + (size_t)c->coff * r * w;
    const int i = (int)(pos % r), row = (over ? r : 0) + i;
    if (pd_kvundo_save(u, pos, kv + (size_t)row * w, (size_t)w * sizeof(float)) ||
        pd_kvundo_save(u, pos, sc + (size_t)row * w, (size_t)w * sizeof(float)))
        return PD_ENOMEM;
    if (over && i == r - 1 &&
        (pd_kvundo_save(u, pos, kv, (size_t)r * w * sizeof(float)) || pd_kvundo_save(u, pos, sc, (size_t)r * w * sizeof(float))))
        return PD_ENOMEM;
    return 0;
}

/* Indexer: score(entry) = sum_h relu(q_h . k_entry) * w_h * index_head_dim^-1/2 *
 * index_n_heads^-1/2 (the official weight scale: it leaves the order, and so the choice, as it
 * was, but keeps the scores' magnitude); the top-k entries, ties to the lower index, in sel.
 * indexer_reduce gives scores [x0, x1) from the products q_h . k_entry at dot [h * ldd + entry].
 * indexer_scores gives the scores of entries [x0, x1) of n: their keys widened to fp32 into
 * rows x0.. of tmp [n, index_head_dim], every q_h . k_entry one tiled product into columns x0..
 * of dot [index_n_heads, n] (each the bits pd_dot gives it, however the entries are cut), then
 * score [x0, x1). Each entry's score depends on that entry only, so blocks of entries may run
 * on any thread (a decode step's tokens: index_task); and the products of several tokens' heads
 * against the same keys may be one tiled product (a prefill chunk's tokens: ixblock_task). */
static void indexer_reduce(const struct pd_model *m, const float *iw, const float *dot, size_t ldd, int x0, int x1,
                           float *score)
{
    const int ih = m->index_n_heads;
    float w[256];
    const float wscale = pd_indexer_weight_scale(m);
    for (int h = 0; h < ih; h++)
        w[h] = iw[h] * wscale;
    for (int x = x0; x < x1; x++) {
        double sc = 0;
        for (int h = 0; h < ih; h++) {
            float d = dot[(size_t)h * ldd + x];
            sc += (d > 0 ? d : 0) * w[h];
        }
        score[x] = (float)sc;
    }
}

/* dot[j * ldd + x] = index key x . q row j for x in [x0, x1) and j < nq (rows of index_head_dim
 * values), each the bits pd_dot gives the pair: the keys widened into tmp [x1 - x0, index_head_dim],
 * then one tiled product. */
static void indexer_products(const struct pd_kvpool *kvp, const struct pd_kvseq *s, int layer, int x0, int x1,
                             const float *q, int nq, float *tmp, float *dot, size_t ldd)
{
    const int id = kvp->index_head_dim;
    for (int x = x0; x < x1; x++)
        pd_kv_get_key(kvp, tmp + (size_t)(x - x0) * id, pd_kv_key(kvp, s, layer, x));
    pd_dot_gemm(tmp, (size_t)id, x1 - x0, q, (size_t)id, nq, id, dot + x0, ldd);
}

static void indexer_scores(const struct pd_model *m, const struct pd_kvpool *kvp, const struct pd_kvseq *s, int layer,
                           int x0, int x1, int n, const float *iq, const float *iw, float *tmp, float *dot, float *score)
{
    indexer_products(kvp, s, layer, x0, x1, iq, m->index_n_heads, tmp + (size_t)x0 * m->index_head_dim, dot, (size_t)n);
    indexer_reduce(m, iw, dot, (size_t)n, x0, x1, score);
}

static int indexer_select(const struct pd_model *m, const struct pd_kvpool *kvp, const struct pd_kvseq *s, int layer,
                          int n, const float *iq, const float *iw, float *tmp, float *dot, float *score, int *sel,
                          uint64_t *rank)
{
    indexer_scores(m, kvp, s, layer, 0, n, n, iq, iw, tmp, dot, score);
    return pd_topk(score, n, m->index_topk, sel, rank);
}

/* A score's rank as an unsigned key, larger for a better score: the float's bits with the sign
 * bit set for a positive value and all bits flipped for a negative one; -0.0 ranks as +0.0 (they
 * compare equal) and NaN below every number. */
static inline uint32_t rank_key(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u = f == 0 ? 0 : u;
    /* without branches: the scores come in no order */
    const uint32_t key = u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u);
    return f != f ? 0 : key;
}

int pd_topk(const float *score, int n, int k, int *sel, uint64_t *work)
{
    /* each score as a unique 64-bit rank (its key, then the index reversed: ties to the lower
     * index); the k-th largest rank by a quickselect (pivot the median of three, a branch-free
     * partition), then one pass in index order keeping every rank at or above it: the choice
     * already in increasing index order. A heap of the best and a sort took 5.1% of a 3,276-token
     * prefill of v4-flash-mini (1 thread, perf), this 1.7%. */
    if (k >= n) {
        for (int v = 0; v < n; v++)
            sel[v] = v;
        return n > 0 ? n : 0;
    }
    if (k <= 0)
        return 0;
#define RANK(v) ((uint64_t)rank_key(score[v]) << 32 | (uint32_t)~(uint32_t)(v))
    for (int v = 0; v < n; v++)
        work[v] = RANK(v);
    /* work[lo, hi) holds the ranks whose place in descending order is lo .. hi - 1 */
    int lo = 0, hi = n;
    const int want = k - 1;
    uint64_t kth;
    for (;;) {
        if (hi - lo == 1) {
            kth = work[lo];
            break;
        }
        /* the median of the first, middle and last, moved to the end */
        uint64_t *a = &work[lo], *b = &work[lo + (hi - lo) / 2], *c = &work[hi - 1], t;
        if ((*a > *b) != (*a > *c))
            t = *a, *a = *c, *c = t;
        else if ((*b > *a) != (*b > *c))
            t = *b, *b = *c, *c = t;
        const uint64_t p = *c;
        int j = lo;
        for (int i = lo; i < hi - 1; i++) {
            const uint64_t x = work[i];
            work[i] = work[j];
            work[j] = x;
            j += x > p;
        }
        work[hi - 1] = work[j];
        work[j] = p;
        if (want == j) {
            kth = p;
            break;
        }
        if (want < j)
            hi = j;
        else
            lo = j + 1;
    }
    int cnt = 0;
    for (int v = 0; v < n; v++)
        if (RANK(v) >= kth)
            sel[cnt++] = v;
#undef RANK
    return cnt;
}

/* Everything of token t's attention that writes its sequence's cache, in position order: the
 * window entry, the compressors, the undo log and snapshots, then the window's keys the token
 * sees copied as fp32 into `keys` [*nk_out, head_dim] (the ring is overwritten by later tokens):
 * all of them, or with whole_window 0 its own entry only (the caller keeps the rest in a strip
 * the chunk's tokens share).
 * The compressed entries it sees are appended by attend_entries, which only reads the cache
 * (an entry, once written, does not change within the step), so it and the heads (heads_task)
 * can run on any thread after later tokens of the same sequence have been prepared. */
/* Window positions p0 .. p1 of a sequence's layer, as fp32 rows into dst; returns how many. The
 * window is a ring of W entries: they are at most two runs, each read at once in bf16. */
static int copy_window(const struct pd_kvpool *kvp, const struct pd_kvseq *kv, int layer, int W, int hd, int64_t p0,
                       int64_t p1, float *dst)
{
    int n = 0;
    for (int64_t p = p0; p <= p1;) {
        int64_t run = W - p % W < p1 + 1 - p ? W - p % W : p1 + 1 - p;
        if (kvp->dtype == PD_KV_BF16) {
            assert(kvp->entry_bytes == 2 * (size_t)hd);
            pd_bf16_to_f32_row(pd_kv_window(kvp, kv, layer, p), dst + (size_t)n * hd, (int)(run * hd));
        } else {
            for (int64_t k = 0; k < run; k++)
                pd_kv_get_entry(kvp, dst + (size_t)(n + k) * hd, pd_kv_window(kvp, kv, layer, p + k));
        }
        n += (int)run;
        p += run;
    }
    return n;
}

static int attend_prepare(struct pd_step *st, int layer, int t, struct attn_bufs *b, float *keys, int whole_window,
                          int *nk_out, pd_err *e)
{
    struct pd_engine *en = st->en;
    const struct pd_model *m = &en->model;
    const struct pd_layer_w *L = pd_layer_weights(en, layer);
    const struct pd_step_item *it = &st->items[st->item_of[t]];
    struct pd_seq *seq = it->seq;
    const struct pd_kvpool *kvp = &en->kv;
    const int hd = m->head_dim, W = m->sliding_window, r = L->ratio;
    const float eps = (float)m->rms_norm_eps;
    const int64_t pos = st->pos[t];
    /* a speculative token: what it overwrites in the slot goes to the undo log first (kvpool.h) */
    struct pd_kvundo *u = it->undo ? (layer < m->n_layers ? &seq->undo : &seq->mtp_undo) : NULL;
    if (u && (pd_kvundo_save(u, pos, pd_kv_window(kvp, &seq->kv, layer, pos), kvp->entry_bytes) ||
              (r && compress_save(u, &L->cmp, pd_kv_state(kvp, &seq->kv, layer, 0), pos)) ||
              (r == 4 && compress_save(u, &L->idx_cmp, pd_kv_state(kvp, &seq->kv, layer, 1), pos))))
        return pd_err_set(e, PD_ENOMEM, "engine: out of memory for the undo log");
    pd_kv_put_entry(kvp, pd_kv_window(kvp, &seq->kv, layer, pos), b->kv + (size_t)t * hd);
    float entry[2048];
    if (r) {
        int cw = L->cmp.coff * hd;
        if (pd_compress_push(&L->cmp, pd_kv_state(kvp, &seq->kv, layer, 0), b->ckv + (size_t)t * cw,
                          b->cg + (size_t)t * cw, pos, &en->rope_compress, eps, entry))
            pd_kv_put_entry(kvp, pd_kv_entry(kvp, &seq->kv, layer, pos / r), entry);
        if (r == 4) {
            int id = m->index_head_dim, iw = L->idx_cmp.coff * id;
            if (pd_compress_push(&L->idx_cmp, pd_kv_state(kvp, &seq->kv, layer, 1), b->ikv + (size_t)t * iw,
                              b->ig + (size_t)t * iw, pos, &en->rope_index, eps, entry)) {
                pd_indexer_lowp(entry, id);
                pd_kv_put_key(kvp, pd_kv_key(kvp, &seq->kv, layer, pos / r), entry);
            }
        }
    }
    /* this layer's state after the token: what a prefix cache snapshot at pos + 1 holds (the MTP
     * layer, one position behind, at pos + 2: kvpool.h, lag_from) */
    for (int j = 0; j < it->n_snaps; j++)
        if (pd_kvpool_layer_len(kvp, layer, it->snaps[j].pos) == pos + 1)
            pd_kvsnap_take(kvp, &seq->kv, layer, it->snaps[j].pos, it->snaps[j].buf);
    /* keys: the window's (all of it, or only the token's own entry when the chunk shares one
     * strip of window keys), then the compressed entries the layer may see (attend_entries) */
    const int64_t first = pos - W + 1 < 0 ? 0 : pos - W + 1;
    *nk_out = copy_window(kvp, &seq->kv, layer, W, hd, whole_window ? first : pos, pos, keys);
    return 0;
}

/* Appends to token t's keys [nk, head_dim] (its window's, from attend_prepare) the compressed
 * entries the layer lets it see: all completed blocks (HCA), or the indexer's top-k of them
 * (CSA) when there are more than k; returns the new count. Reads the cache only. Scratch: tmp
 * [entries, index_head_dim] (the token's keys after its window serve: kmax - nk >= entries rows
 * of head_dim >= index_head_dim floats), and the token's tok_scratch: iscore [index_n_heads,
 * entries] for the indexer's dot products, iscores [entries] for its scores, sel [index_topk], rank
 * [entries] for pd_topk. With `scored`, iscores holds the indexer's scores already (index_task,
 * ixblock_task). */
static int attend_entries(struct pd_step *st, int layer, int t, const struct attn_bufs *b, float *keys, int nk,
                          const struct tok_scratch *ts, int scored)
{
    struct pd_engine *en = st->en;
    const struct pd_model *m = &en->model;
    const struct pd_layer_w *L = pd_layer_weights(en, layer);
    const struct pd_kvpool *kvp = &en->kv;
    const struct pd_kvseq *kv = &st->items[st->item_of[t]].seq->kv;
    const int hd = m->head_dim, r = L->ratio;
    if (!r)
        return nk;
    const int n = (int)((st->pos[t] + 1) / r);
    if (r == 4 && n > m->index_topk) {
        assert(m->index_head_dim <= hd);
        int ns = scored ? pd_topk(ts->iscores, n, m->index_topk, ts->sel, ts->rank)
                        : indexer_select(m, kvp, kv, layer, n, b->iq + (size_t)t * m->index_n_heads * m->index_head_dim,
                                         b->iw + (size_t)t * m->index_n_heads, keys + (size_t)nk * hd, ts->iscore,
                                         ts->iscores, ts->sel, ts->rank);
        for (int i = 0; i < ns; i++)
            pd_kv_get_entry(kvp, keys + (size_t)nk++ * hd, pd_kv_entry(kvp, kv, layer, ts->sel[i]));
        return nk;
    }
    for (int i = 0; i < n; i++)
        pd_kv_get_entry(kvp, keys + (size_t)nk++ * hd, pd_kv_entry(kvp, kv, layer, i));
    return nk;
}

/* The heads of a chunk of prepared tokens: one task per token when the chunk has enough tokens
 * to keep the pool busy (prefill), the scores of all its heads against its keys in one tiled
 * product; else one task per (token, head) (decode). Each score is the bits pd_dot gives it
 * either way. Then per head the softmax over the token's keys with the head's sink, V = K,
 * inverse rope on the output's rope dims. */
struct heads_job {
    struct pd_step *st;
    const struct pd_layer_w *L;
    const struct attn_bufs *b;
    int t0;             /* the chunk's first token */
    const struct chunk_set *cs;   /* the chunk's prepared keys */
    int kmax;           /* keys a token's scratch holds (tok_scratch) */
    int per_head;       /* tasks are (token, head) pairs (window and entries in keys), else tokens
                           (window keys in cs->strip, entries in keys) */
    int whole;          /* with per_head: tasks are tokens, every head over all the keys in keys */
    int layer;
    int ient;           /* the indexer's scratch per token: index_n_heads * entries floats */
    int scored;         /* the indexer's scores of the chunk's tokens are in their scratch (ixblock_task) */
};

static void heads_task(void *arg, int task)
{
    const struct heads_job *j = arg;
    const struct pd_model *m = &j->st->en->model;
    const int hd = m->head_dim, nh = m->n_heads, rd = m->qk_rope_head_dim;
    const int by_head = j->per_head && !j->whole;
    const int c = by_head ? task / nh : task, h0 = by_head ? task % nh : 0, h1 = by_head ? h0 + 1 : nh;
    const int t = j->t0 + c;
    /* the token's keys in order: nw window rows at win, then ne compressed entries at ent */
    const struct tok_scratch ts = tok_scratch(j->b, m, c, j->kmax, j->ient);
    float *ent = ts.keys;
    const float *win = ent;
    int nw = j->cs->nk[c], ne = 0;
    if (!j->per_head) {
        win = j->cs->strip + (size_t)j->cs->wrow[c] * hd;
        nw = j->cs->nw[c];
        ne = attend_entries(j->st, j->layer, t, j->b, ent, 0, &ts, j->scored);
    }
    const int nk = nw + ne;
    const float *cs = (j->L->ratio ? j->st->cs_compress : j->st->cs_window) + (size_t)t * rd;
    const float scale = 1.0f / sqrtf((float)hd);
    /* scores[h][k] = q_h . key_k */
    const float *q = j->b->q + ((size_t)t * nh + h0) * hd;
    float *sc = ts.scores + (size_t)h0 * j->kmax;
    if (by_head) {
        pd_dot_rows(win, (size_t)hd, q, hd, nw, sc);
    } else {
        pd_dot_gemm(win, (size_t)hd, nw, q, (size_t)hd, nh, hd, sc, (size_t)j->kmax);
        pd_dot_gemm(ent, (size_t)hd, ne, q, (size_t)hd, nh, hd, sc + nw, (size_t)j->kmax);
    }
    /* per head: softmax with the sink over the keys, in place in its scores */
    for (int h = h0; h < h1; h++) {
        float *scores = ts.scores + (size_t)h * j->kmax;
        const float sink = j->L->attn_sink[h];
        float mx = pd_scale_max(scores, nk, scale, sink);
        /* the sink adds exp(sink - max) to the denominator and nothing to the output */
        double den = expf(sink - mx);
        for (int k = 0; k < nk; k++)
            scores[k] -= mx;
        pd_expf_rows(scores, scores, nk);
        for (int k = 0; k < nk; k++)
            den += scores[k];
        pd_div_d(scores, nk, den);
    }
    /* o_h = sum_k p_h[k] key_k (V = K) in k order: every head of the task over one pass of the
     * window's keys, then of the entries */
    float *o = j->b->o + ((size_t)t * nh + h0) * hd;
    for (int i = 0; i < (h1 - h0) * hd; i++)
        o[i] = 0;
    if (by_head) {
        pd_axpy_rows(sc, win, (size_t)hd, nw, o, hd);
    } else {
        pd_axpy_heads(sc, (size_t)j->kmax, nh, win, (size_t)hd, nw, o, (size_t)hd, hd);
        pd_axpy_heads(sc + nw, (size_t)j->kmax, nh, ent, (size_t)hd, ne, o, (size_t)hd, hd);
    }
    for (int h = h0; h < h1; h++)
        pd_rope_apply_cs(cs, rd, o + (size_t)(h - h0) * hd + hd - rd, 1);
}

/* Each query head (RMS-scaled, roped) and, in CSA layers, each indexer query head (roped, then
 * its low precision), one task per (token, head): tasks [t * n, t * n + heads) are token t's query
 * heads, the rest of its n its indexer heads; then task T * n + t is token t's key (kv_norm, rope). */
struct qheads_job {
    struct pd_step *st;
    const struct attn_bufs *b;
    const struct pd_layer_w *L;
    int ratio, T;
};

enum { QHEADS_POOL_T = 4 };

/* RMSNorm of rows [NORM_ROWS task, ...) of x [T, n] in place (q_lora's rows), over the pool from
 * NORM_POOL_T tokens: each row the bits pd_rmsnorm gives it alone. */
enum { NORM_ROWS = 16, NORM_POOL_T = 32 };
struct rows_norm_job {
    float *x;
    const float *w;
    float eps;
    int n, T;
};

static void rows_norm_task(void *arg, int task)
{
    const struct rows_norm_job *j = arg;
    const int t1 = (task + 1) * NORM_ROWS < j->T ? (task + 1) * NORM_ROWS : j->T;
    for (int t = task * NORM_ROWS; t < t1; t++)
        pd_rmsnorm(j->x + (size_t)t * j->n, j->w, j->eps, j->n, j->x + (size_t)t * j->n);
}

/* A decode chunk's heads (a task per token and head) run on the caller when their multiply-adds are
 * fewer than this: v4-flash-mini's 8 heads over 192 keys (393,216) took 9.0 us a run on one thread
 * and 11.1 us over two (Zen 5 EPYC, `pdmoe generate`, 300 tokens): the helper reads the keys the
 * caller just widened from its cache. V4-Flash's 64 heads of 512 over the window alone are 8.4 M. */
enum { HEADS_POOL_MACS = 1 << 19 };

static void qheads_task(void *arg, int task)
{
    const struct qheads_job *j = arg;
    const struct pd_model *m = &j->st->en->model;
    const int hd = m->head_dim, nh = m->n_heads, rd = m->qk_rope_head_dim, ih = m->index_n_heads;
    const int id = m->index_head_dim, n = nh + (j->ratio == 4 ? ih : 0), t = task / n, h = task % n;
    const float eps = (float)m->rms_norm_eps, *cs = j->ratio ? j->st->cs_compress : j->st->cs_window;
    if (task >= j->T * n) {
        const int tk = task - j->T * n;
        float *kv = j->b->kv + (size_t)tk * hd;
        pd_rmsnorm(kv, j->L->kv_norm, eps, hd, kv);
        pd_rope_apply_cs(cs + (size_t)tk * rd, rd, kv + hd - rd, 0);
    } else if (h < nh) {
        float *q = j->b->q + ((size_t)t * nh + h) * hd;
        pd_rmsnorm(q, NULL, eps, hd, q);
        pd_rope_apply_cs(cs + (size_t)t * rd, rd, q + hd - rd, 0);
    } else {
        /* the indexer's rope (en->rope_index) is the compressor's */
        float *iq = j->b->iq + ((size_t)t * ih + h - nh) * id;
        pd_rope_apply_cs(j->st->cs_compress + (size_t)t * rd, rd, iq + id - rd, 0);
        pd_indexer_lowp(iq, id);
    }
}

/* The indexer's scores of a decode step's tokens (a chunk of fewer than 8, whose heads are tasks
 * of their own), over the pool by blocks of entries: a token at a long context scores every
 * compressed entry of each CSA layer (V4-Flash at 64K tokens: 16,384 entries x 64 heads x 128
 * values, 134 M multiply-adds a layer), which ran on the caller alone while the other threads
 * waited. A block holds about INDEX_TASK_MACS multiply-adds, and a token is split only from two
 * blocks; its top-k follows on the caller (attend_entries). The same scores bit for bit
 * (indexer_scores). Tasks [first[c], first[c + 1]) are token c's blocks. */
enum { INDEX_TASK_MACS = 1 << 15 };

struct index_job {
    struct pd_step *st;
    const struct attn_bufs *b;
    const struct chunk_set *cs;
    int layer, t0, kmax, ient;
    int block;            /* entries per task */
    int first[9];         /* [chunk + 1]: a chunk whose heads are tasks has fewer than 8 tokens */
    int n[8];             /* entries of token c (0: not split) */
};

static void index_task(void *arg, int task)
{
    const struct index_job *j = arg;
    const struct pd_model *m = &j->st->en->model;
    int c = 0;
    while (j->first[c + 1] <= task)
        c++;
    const int t = j->t0 + c, n = j->n[c], x0 = (task - j->first[c]) * j->block;
    const int x1 = x0 + j->block < n ? x0 + j->block : n;
    const int ih = m->index_n_heads, id = m->index_head_dim;
    const struct tok_scratch ts = tok_scratch(j->b, m, c, j->kmax, j->ient);
    indexer_scores(m, &j->st->en->kv, &j->st->items[j->st->item_of[t]].seq->kv, j->layer, x0, x1, n,
                   j->b->iq + (size_t)t * ih * id, j->b->iw + (size_t)t * ih,
                   ts.keys + (size_t)j->cs->nk[c] * m->head_dim, ts.iscore, ts.iscores);
}

/* The indexer's scores of a prefill chunk's tokens, by blocks of consecutive tokens of one item
 * (task i: chunk tokens [xblock[2i], xblock[2i + 1])): every head of every token of the block
 * against the keys the block's last token sees, in tiled products (a run of keys contiguous in
 * the pool at a time) into each token's iscore [index_n_heads, ments] (the bits pd_dot gives each
 * pair, as a token alone gets them), then each token's scores over its own entries. A token's
 * entries read once per block instead of once per token, and the keys stay in cache across its
 * tokens' heads. Only tokens with more entries than the top-k are in a block (the others take
 * every entry). */
enum { IXBLOCK_TOKENS = 8 };

struct ixblock_job {
    struct pd_step *st;
    const struct attn_bufs *b;
    int layer, t0, kmax, ient;
};

static void ixblock_task(void *arg, int task)
{
    const struct ixblock_job *j = arg;
    const struct pd_model *m = &j->st->en->model;
    const struct pd_kvpool *kvp = &j->st->en->kv;
    const int c0 = j->b->xblock[2 * task], c1 = j->b->xblock[2 * task + 1], t0 = j->t0 + c0;
    const int ih = m->index_n_heads, id = m->index_head_dim, r = 4;
    const struct pd_kvseq *kv = &j->st->items[j->st->item_of[t0]].seq->kv;
    const int n = (int)((j->st->pos[j->t0 + c1 - 1] + 1) / r);
    const struct tok_scratch first = tok_scratch(j->b, m, c0, j->kmax, j->ient);
    const float *q = j->b->iq + (size_t)t0 * ih * id;
    /* the keys a run at a time (consecutive within a block of the pool): bf16 ones read in place,
     * widened in registers by the product; fp8 ones decoded into tmp, 32 KiB at a time */
    for (int x0 = 0; x0 < n;) {
        int run = kvp->block_keys - x0 % kvp->block_keys;
        run = run < n - x0 ? run : n - x0;
        if (kvp->dtype == PD_KV_BF16) {
            assert(kvp->key_bytes == 2 * (size_t)id);
            pd_dot_gemm_bf16(pd_kv_key(kvp, kv, j->layer, x0), (size_t)id, run, q, (size_t)id, (c1 - c0) * ih, id,
                             first.iscore + x0, (size_t)j->b->ments);
        } else {
            float tmp[8192];   /* index_head_dim <= 1024 (pd_engine_open): 8 keys or more at a time */
            run = run < 8192 / id ? run : 8192 / id;
            indexer_products(kvp, kv, j->layer, x0, x0 + run, q, (c1 - c0) * ih, tmp, first.iscore, (size_t)j->b->ments);
        }
        x0 += run;
    }
    for (int c = c0; c < c1; c++) {
        const int t = j->t0 + c;
        const struct tok_scratch ts = tok_scratch(j->b, m, c, j->kmax, j->ient);
        indexer_reduce(m, j->b->iw + (size_t)t * ih, ts.iscore, (size_t)j->b->ments, 0, (int)((j->st->pos[t] + 1) / r),
                       ts.iscores);
    }
}

/* Cuts chunk tokens [t0, t0 + n) into ixblock_task's blocks: runs of tokens of one item whose
 * entries pass the top-k, at most IXBLOCK_TOKENS each and, to spread them over the pool's
 * threads, at most a thread's share of such tokens. Returns the block count (xblock filled). */
static int ixblock_cut(const struct pd_step *st, const struct pd_model *m, int t0, int n, int threads, int *xblock)
{
    int scored = 0, blocks = 0;
    for (int c = 0; c < n; c++)
        scored += (st->pos[t0 + c] + 1) / 4 > m->index_topk;
    int cap = (scored + threads - 1) / threads;
    cap = cap < 1 ? 1 : cap > IXBLOCK_TOKENS ? IXBLOCK_TOKENS : cap;
    for (int c = 0; c < n; c++) {
        const int t = t0 + c;
        if ((st->pos[t] + 1) / 4 <= m->index_topk)
            continue;
        if (blocks == 0 || xblock[2 * blocks - 1] != c || c - xblock[2 * blocks - 2] == cap ||
            st->item_of[t] != st->item_of[t - 1])
            xblock[2 * blocks++] = c;
        xblock[2 * blocks - 1] = c + 1;
    }
    return blocks;
}

/* A chunk of fewer tokens has a task per (token, head) and its keys in each token's scratch (decode);
 * from this many, a task per token and its window keys in a strip (prefill). */
enum { PER_TOKEN_CHUNK = 8 };

/* Tokens of the chunk from t0: `chunk`, or in a prefill all that are left when fewer than
 * chunk + PER_TOKEN_CHUNK are (so that every chunk of a prefill has a task per token). */
static int chunk_len(int T, int t0, int chunk, int prefill)
{
    return prefill && T - t0 < chunk + PER_TOKEN_CHUNK ? T - t0 : T - t0 < chunk ? T - t0 : chunk;
}

/* Prepares chunk tokens [t0, t0 + n) in position order (attend_prepare) into cs: a prefill
 * chunk's window keys go to one strip per item: the positions before the item's first token in
 * the chunk (read before that token overwrites the ring), then each token's own entry as it is
 * written; a token's window is a run of that strip. A decode chunk's tokens get their whole
 * window in their own keys scratch. Writes the sequence's cache, so chunks are prepared in
 * order; it may run beside the heads of the chunk before, which read only that chunk's strip
 * and the compressed entries its tokens see (written before, never changed). */
static int prepare_chunk(struct pd_step *st, int layer, struct attn_bufs *b, struct chunk_set *cs, int t0, int n,
                         int kmax, pd_err *e)
{
    const struct pd_model *m = &st->en->model;
    const int hd = m->head_dim, W = m->sliding_window, per_head = n < PER_TOKEN_CHUNK;
    int srow = 0, seg_row = 0, rc;
    int64_t seg_pos = 0;
    for (int c = 0; c < n; c++) {
        const int t = t0 + c;
        const int64_t pos = st->pos[t], first = pos - W + 1 < 0 ? 0 : pos - W + 1;
        if (!per_head && (c == 0 || st->item_of[t] != st->item_of[t - 1])) {
            seg_row = srow;
            seg_pos = first;
            srow += copy_window(&st->en->kv, &st->items[st->item_of[t]].seq->kv, layer, W, hd, first, pos - 1,
                                cs->strip + (size_t)srow * hd);
        }
        if ((rc = attend_prepare(st, layer, t, b, per_head ? b->keys + (size_t)c * kmax * hd : cs->strip + (size_t)srow * hd,
                                 per_head, &cs->nk[c], e)))
            return rc;
        if (!per_head) {
            srow += cs->nk[c];
            cs->wrow[c] = seg_row + (int)(first - seg_pos);
            cs->nw[c] = (int)(pos - first + 1);
            assert(cs->wrow[c] + cs->nw[c] == srow);
        }
    }
    return 0;
}

/* A prefill chunk's heads (tasks 1 .. n, heads_task's 0 .. n - 1) and the preparing of the next
 * chunk (task 0) in one pool run: the next chunk's cache writes, one token after another, ran on
 * the caller alone between runs (a tenth of a 2-thread step's attention at 512 tokens) and now
 * overlap this chunk's heads on the other threads. Its error, if any, in rc and err. */
struct overlap_job {
    const struct heads_job *hj;
    struct attn_bufs *b;
    struct chunk_set *next;
    int t0, n, kmax;
    int rc;
    pd_err err;
};

static void heads_or_prepare_task(void *arg, int task)
{
    struct overlap_job *o = arg;
    if (task == 0)
        o->rc = prepare_chunk(o->hj->st, o->hj->layer, o->b, o->next, o->t0, o->n, o->kmax, &o->err);
    else
        heads_task((void *)o->hj, task - 1);
}

#define LIN(l, in, T, out) \
    do { if ((rc = pd_linear_fwd(l, en->pool, en->ref, in, T, out, st->qbuf, st->sbuf, e))) goto done; } while (0)

int pd_attention_layer(struct pd_step *st, int layer, pd_err *e)
{
    struct pd_engine *en = st->en;
    const struct pd_model *m = &en->model;
    const struct pd_layer_w *L = pd_layer_weights(en, layer);
    const int T = st->T, hd = m->head_dim, nh = m->n_heads, ql = m->q_lora_rank, r = L->ratio;
    const int og = m->o_groups, ol = m->o_lora_rank, gin = nh * hd / og;
    const float eps = (float)m->rms_norm_eps;
    struct attn_bufs b = {0};
    int rc = PD_ENOMEM;
    int64_t max_entries = 0;
    for (int t = 0; t < T; t++)
        max_entries = (st->pos[t] + 1) > max_entries ? st->pos[t] + 1 : max_entries;
    max_entries = r ? max_entries / r + 1 : 1;
    /* tokens prepared together before their heads run over the pool: keys of at most ~4 MiB. A
     * step of PER_TOKEN_CHUNK tokens or more (a prefill) runs a task per token in every chunk (the
     * last one takes the fewer than PER_TOKEN_CHUNK left over: at most `cap` tokens): a token's keys
     * scratch then holds the compressed entries it attends to, in CSA layers at most the indexer's
     * top-k. A decode chunk's scratch also holds each token's indexer keys (attend_entries). */
    const int W = m->sliding_window, prefill = T >= PER_TOKEN_CHUNK;
    const int64_t ent_keys = prefill && r == 4 && m->index_topk < max_entries ? m->index_topk : max_entries;
    const int64_t kmax = W + ent_keys;
    const int least = prefill ? PER_TOKEN_CHUNK : 1;
    int chunk = (int)((4 << 20) / (kmax * hd * 4));
    chunk = chunk < least ? least : chunk > T ? T : chunk;
    const int cap = !prefill ? chunk : chunk + PER_TOKEN_CHUNK - 1 < T ? chunk + PER_TOKEN_CHUNK - 1 : T;
    /* a chunk's window strip: its tokens' own entries and, per item, the W - 1 positions before */
    const size_t strip_rows = (size_t)cap + (size_t)(st->n_items < cap ? st->n_items : cap) * (W - 1);
    /* the indexer's dot products of one token: index_n_heads x entries */
    const int ient = (int)((m->index_n_heads > 0 ? m->index_n_heads : 1) * max_entries);
    int cw = r ? L->cmp.coff * hd : 1, ih = m->index_n_heads, id = m->index_head_dim, iwid = r == 4 ? L->idx_cmp.coff * id : 1;
    if (!(b.qr = pd_scratch(en, 11, (size_t)T * ql * 4, e)) || !(b.q = pd_scratch(en, 12, (size_t)T * nh * hd * 4, e)) ||
        !(b.kv = pd_scratch(en, 13, (size_t)T * hd * 4, e)) || !(b.o = pd_scratch(en, 14, (size_t)T * nh * hd * 4, e)) ||
        !(b.og = pd_scratch(en, 15, (size_t)T * gin * 4, e)) || !(b.oa = pd_scratch(en, 16, (size_t)T * og * ol * 4, e)) ||
        !(b.ogo = pd_scratch(en, 17, (size_t)og * T * ol * 4, e)) ||
        !(b.keys = pd_scratch(en, 18, ((size_t)cap * kmax + 2 * strip_rows) * hd * 4, e)) ||
        !(b.scores = pd_scratch(en, 19, (size_t)cap * nh * kmax * 4, e)) ||
        !(b.orow = pd_scratch(en, 71, ((size_t)8 * T + (size_t)og * T) * 4, e)) ||
        !(b.iscore = pd_scratch(en, 20, (size_t)cap * ient * 4, e)) ||
        !(b.iscores = pd_scratch(en, 73, (size_t)cap * max_entries * 4, e)) ||
        !(b.sel = pd_scratch(en, 21, (size_t)cap * (m->index_topk > 0 ? m->index_topk : 1) * 4, e)) ||
        !(b.rank = pd_scratch(en, 72, (size_t)cap * max_entries * 8, e)) ||
        !(b.ckv = pd_scratch(en, 22, (size_t)T * cw * 4, e)) || !(b.cg = pd_scratch(en, 23, (size_t)T * cw * 4, e)) ||
        !(b.ikv = pd_scratch(en, 24, (size_t)T * iwid * 4, e)) || !(b.ig = pd_scratch(en, 25, (size_t)T * iwid * 4, e)) ||
        !(b.iq = pd_scratch(en, 26, (size_t)T * (r == 4 ? ih * id : 1) * 4, e)) ||
        !(b.iw = pd_scratch(en, 27, (size_t)T * (r == 4 ? ih : 1) * 4, e)))
        goto done;
    b.ments = (int)max_entries;
    b.xblock = b.orow + (size_t)og * T;
    for (int i = 0; i < 2; i++)
        b.set[i] = (struct chunk_set){.nk = b.xblock + (size_t)(2 + 3 * i) * T,
                                      .wrow = b.xblock + (size_t)(3 + 3 * i) * T,
                                      .nw = b.xblock + (size_t)(4 + 3 * i) * T,
                                      .strip = b.keys + ((size_t)cap * kmax + i * strip_rows) * hd};
    /* every projection of the sublayer input x in one product (the kernel streams from one
     * matrix into the next), then those of q_lora's qr in another */
    const struct pd_linear *lx[7] = {&L->wq_a, &L->wkv, &L->cmp.wkv, &L->cmp.wgate, &L->idx_weights,
                                     &L->idx_cmp.wkv, &L->idx_cmp.wgate};
    float *yx[7] = {b.qr, b.kv, b.ckv, b.cg, b.iw, b.ikv, b.ig};
    if ((rc = pd_linear_fwd_many(lx, yx, r == 4 ? 7 : r ? 4 : 2, en->pool, en->ref, st->x, &st->xq, T, e)))
        goto done;
    struct rows_norm_job nj = {.x = b.qr, .w = L->q_norm, .eps = eps, .n = ql, .T = T};
    pd_pool_run(T < NORM_POOL_T ? NULL : en->pool, (T + NORM_ROWS - 1) / NORM_ROWS, rows_norm_task, &nj);
    pd_qmat qrq = {.q = st->qbuf, .scale = st->sbuf, .rows = T, .cols = ql};
    if (!en->ref)
        pd_quant_rows_pool(en->pool, b.qr, T, ql, st->qbuf, st->sbuf);
    const struct pd_linear *lq[2] = {&L->wq_b, &L->idx_wq_b};
    float *yq[2] = {b.q, b.iq};
    if ((rc = pd_linear_fwd_many(lq, yq, r == 4 ? 2 : 1, en->pool, en->ref, b.qr, &qrq, T, e)))
        goto done;
    struct qheads_job qj = {.st = st, .b = &b, .L = L, .ratio = r, .T = T};
    /* a few tokens' heads (16 at batch 1, a few microseconds) cost less than a hand-off; the
     * keys in the same run (a prefill's 512 took 0.12 ms a layer on the caller alone) */
    pd_pool_run(T < QHEADS_POOL_T ? NULL : en->pool, T * (nh + (r == 4 ? ih : 0) + 1), qheads_task, &qj);
    /* tokens are in item order and, within an item, in position order: each chunk's tokens are
     * prepared in that order, then all their heads run over the pool; a prefill prepares the next
     * chunk in a task of this chunk's heads run (prepare_chunk) */
    int cur = 0, prepared = 0;
    const int64_t heads_t0 = pd_call_clock_start(&en->prof.piece[PD_PROF_HEADS]);
    for (int t0 = 0, n; t0 < T; t0 += n, cur ^= 1) {
        n = chunk_len(T, t0, chunk, prefill);
        /* a task per token from 8 tokens on (a prefill's chunk: its compressed entries and
         * indexer in the task too), so a decode step's few tokens still spread their heads over
         * the pool (entries chosen here first) */
        const int per_head = n < PER_TOKEN_CHUNK;
        struct chunk_set *prep = &b.set[cur];
        if (!prepared && (rc = prepare_chunk(st, layer, &b, prep, t0, n, (int)kmax, e)))
            goto done;
        prepared = 0;
        struct heads_job hj = {.st = st, .L = L, .b = &b, .t0 = t0, .cs = prep,
                               .kmax = (int)kmax, .per_head = per_head, .layer = layer, .ient = ient,
                               .scored = !per_head && r == 4};
        if (hj.scored) {
            struct ixblock_job xj = {.st = st, .b = &b, .layer = layer, .t0 = t0, .kmax = (int)kmax, .ient = ient};
            pd_pool_run(en->pool, ixblock_cut(st, m, t0, n, pd_pool_nthreads(en->pool), b.xblock), ixblock_task, &xj);
        }
        int64_t macs = 0;   /* a decode chunk's heads: scores and values, each nk x head_dim per head */
        if (hj.per_head) {
            struct index_job ij = {.st = st, .b = &b, .cs = prep, .layer = layer, .t0 = t0, .kmax = (int)kmax, .ient = ient};
            const int per_entry = m->index_n_heads * m->index_head_dim;
            ij.block = per_entry > 0 && INDEX_TASK_MACS / per_entry > 16 ? INDEX_TASK_MACS / per_entry : 16;
            for (int c = 0; c < n; c++) {
                const int ne = r == 4 ? (int)((st->pos[t0 + c] + 1) / r) : 0;
                ij.n[c] = ne > m->index_topk && ne >= 2 * ij.block ? ne : 0;
                ij.first[c + 1] = ij.first[c] + (ij.n[c] + ij.block - 1) / ij.block;
            }
            if (ij.first[n])
                pd_pool_run_even(en->pool, ij.first[n], index_task, &ij);
            for (int c = 0; c < n; c++) {
                const struct tok_scratch ts = tok_scratch(&b, m, c, (int)kmax, ient);
                prep->nk[c] = attend_entries(st, layer, t0 + c, &b, ts.keys, prep->nk[c], &ts, ij.n[c] > 0);
                macs += 2 * (int64_t)prep->nk[c] * hd * nh;
            }
        }
        const int t1 = t0 + n, n1 = t1 < T ? chunk_len(T, t1, chunk, prefill) : 0;
        if (!per_head && n1 > 0 && pd_pool_nthreads(en->pool) > 1) {
            struct overlap_job oj = {.hj = &hj, .b = &b, .next = &b.set[cur ^ 1], .t0 = t1, .n = n1, .kmax = (int)kmax};
            pd_pool_run(en->pool, n + 1, heads_or_prepare_task, &oj);
            if ((rc = oj.rc)) {
                pd_err_set(e, rc, "%s", oj.err.msg);
                goto done;
            }
            prepared = 1;
        } else {
            /* heads that run on the caller alone: a token's heads in one tiled pass over its keys,
             * each key read once for all of them instead of once per head (the same bits) */
            hj.whole = hj.per_head && (macs < HEADS_POOL_MACS || pd_pool_nthreads(en->pool) < 2);
            pd_pool_run(hj.whole ? NULL : en->pool, hj.per_head && !hj.whole ? n * nh : n, heads_task, &hj);
        }
    }
    pd_call_clock_stop(&en->prof.piece[PD_PROF_HEADS], heads_t0);
    /* grouped low-rank output: group g maps heads [g*nh/og, (g+1)*nh/og) to o_lora values. With
     * int8 weights o [T, nh*hd] is quantised as [T*og, gin] (the rows each group reads, as when
     * quantised one group at a time) and every group runs in one grouped product. */
    if (L->wo_a.q.q && !en->ref) {
        pd_gemm_group grp[64];
        if (og > 64) {
            rc = pd_err_set(e, PD_EINVAL, "engine: o_groups %d (at most 64)", og);
            goto done;
        }
        pd_quant_rows_pool(en->pool, b.o, T * og, gin, st->qbuf, st->sbuf);
        pd_qmat oq = {.q = st->qbuf, .scale = st->sbuf, .rows = T * og, .cols = gin};
        for (int g = 0; g < og; g++) {
            for (int t = 0; t < T; t++)
                b.orow[(size_t)g * T + t] = t * og + g;
            pd_qmat w = L->wo_a.q;
            w.q += (size_t)g * ol * gin;
            w.scale += (size_t)g * ol;
            w.rows = ol;
            grp[g] = (pd_gemm_group){.w = w, .rows = b.orow + (size_t)g * T, .n = T, .y = b.ogo + (size_t)g * T * ol};
        }
        if ((rc = pd_gemm_grouped(en->pool, &oq, grp, og, 0, e)))
            goto done;
        for (int g = 0; g < og; g++)
            for (int t = 0; t < T; t++)
                memcpy(b.oa + (size_t)t * og * ol + (size_t)g * ol, b.ogo + ((size_t)g * T + t) * ol, (size_t)ol * 4);
    } else if ((L->wo_a.f || L->wo_a.h) && !en->ref && og <= 16) {
        /* float wo_a: every group in one pool run, group g reading its heads' columns of o and
         * writing its o_lora columns of oa in place */
        struct pd_linear part[16];
        struct pd_linear_io io[16];
        for (int g = 0; g < og; g++) {
            part[g] = L->wo_a;
            part[g].out = ol;
            part[g].in = gin;
            if (part[g].h)
                part[g].h += (size_t)g * ol * gin;
            else
                part[g].f += (size_t)g * ol * gin;
            io[g] = (struct pd_linear_io){.l = &part[g], .x = b.o + (size_t)g * gin, .ldx = (size_t)nh * hd,
                                          .y = b.oa + (size_t)g * ol, .ldy = (size_t)og * ol};
        }
        if ((rc = pd_linear_fwd_float_many(io, og, en->pool, T, e)))
            goto done;
    } else {
        for (int g = 0; g < og; g++) {
            struct pd_linear part = L->wo_a;
            part.out = ol;
            if (part.q.q) {
                part.q.q += (size_t)g * ol * gin;
                part.q.scale += (size_t)g * ol;
                part.q.rows = ol;
            } else if (part.h) {
                part.h += (size_t)g * ol * gin;
            } else {
                part.f += (size_t)g * ol * gin;
            }
            for (int t = 0; t < T; t++)
                memcpy(b.og + (size_t)t * gin, b.o + (size_t)t * nh * hd + (size_t)g * gin, (size_t)gin * 4);
            LIN(&part, b.og, T, b.ogo);
            for (int t = 0; t < T; t++)
                memcpy(b.oa + (size_t)t * og * ol + (size_t)g * ol, b.ogo + (size_t)t * ol, (size_t)ol * 4);
        }
    }
    LIN(&L->wo_b, b.oa, T, st->out);
    rc = 0;
done:
    return rc;
}

/* The parts of the V4 block alone: mHC pre and post, the compressors (overlapping and not), the
 * indexer's top-k, the router's choice. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/internal.h"
#include "kernels/ops.h"
#include "kernels/vec.h"

static struct pd_model small(int hc, int H)
{
    struct pd_model m;
    memset(&m, 0, sizeof m);
    m.hc_mult = hc;
    m.hidden_size = H;
    m.rms_norm_eps = 1e-6;
    m.hc_eps = 1e-6;
    m.hc_sinkhorn_iters = 20;
    return m;
}

Test(parts, mhc_pre_weights_and_sinkhorn)
{
    enum { HC = 4, H = 8, MIX = (2 + HC) * HC };
    struct pd_model m = small(HC, H);
    float h[HC * H], fn[MIX * HC * H] = {0}, base[MIX], scale[3] = {1, 1, 1}, x[H], post[HC], comb[HC * HC];
    for (int i = 0; i < HC * H; i++)
        h[i] = (float)(i % 7) - 3.0f;
    for (int i = 0; i < MIX; i++)
        base[i] = 0.1f * (float)(i % 5) - 0.2f;
    /* with fn = 0 the mixing values are the biases alone */
    pd_mhc_pre(&m, h, fn, base, scale, x, post, comb);
    for (int k = 0; k < HC; k++)
        cr_assert_float_eq(post[k], 2.0f / (1.0f + expf(-base[HC + k])), 1e-6);
    for (int i = 0; i < H; i++) {
        float want = 0;
        for (int j = 0; j < HC; j++)
            want += (1.0f / (1.0f + expf(-base[j])) + 1e-6f) * h[j * H + i];
        cr_assert_float_eq(x[i], want, 1e-5);
    }
    for (int r = 0; r < HC; r++) {
        float rs = 0, cs = 0;
        for (int c = 0; c < HC; c++) {
            rs += comb[r * HC + c];
            cs += comb[c * HC + r];
        }
        cr_assert_float_eq(rs, 1.0f, 1e-3);
        cr_assert_float_eq(cs, 1.0f, 1e-3);
    }
}

Test(parts, mhc_pre_scales_multiply_their_mixing_values)
{
    /* scale[0] multiplies the pre logits, scale[1] the post logits, scale[2] the comb logits,
     * each after the RMS normalisation of the streams: checked against the equations of
     * shared/reference with mixing weights and scales away from 0 and 1 */
    enum { HC = 4, H = 8, MIX = (2 + HC) * HC };
    struct pd_model m = small(HC, H);
    float h[HC * H], fn[MIX * HC * H], base[MIX], scale[3] = {0.6f, 1.7f, 2.5f}, x[H], post[HC], comb[HC * HC];
    for (int i = 0; i < HC * H; i++)
        h[i] = (float)(i % 7) - 2.5f;
    for (int i = 0; i < MIX * HC * H; i++)
        fn[i] = 0.05f * (float)((i * 7) % 11 - 5);
    for (int i = 0; i < MIX; i++)
        base[i] = 0.1f * (float)(i % 5) - 0.2f;
    pd_mhc_pre(&m, h, fn, base, scale, x, post, comb);
    double ss = 0;
    for (int i = 0; i < HC * H; i++)
        ss += (double)h[i] * h[i];
    const double r = 1.0 / sqrt(ss / (HC * H) + m.rms_norm_eps);
    double mix[MIX];
    for (int k = 0; k < MIX; k++) {
        double d = 0;
        for (int i = 0; i < HC * H; i++)
            d += (double)fn[(size_t)k * HC * H + i] * h[i];
        mix[k] = d * r;
    }
    float want_comb[HC * HC];
    for (int k = 0; k < HC * HC; k++)
        want_comb[k] = (float)(mix[2 * HC + k] * scale[2] + base[2 * HC + k]);
    pd_sinkhorn(want_comb, HC, m.hc_sinkhorn_iters, (float)m.hc_eps);
    for (int k = 0; k < HC * HC; k++)
        cr_assert_float_eq(comb[k], want_comb[k], 1e-5, "comb[%d] %g, want %g", k, comb[k], want_comb[k]);
    double pre[HC];
    for (int j = 0; j < HC; j++) {
        pre[j] = 1 / (1 + exp(-(mix[j] * scale[0] + base[j]))) + m.hc_eps;
        double want_post = 2 / (1 + exp(-(mix[HC + j] * scale[1] + base[HC + j])));
        cr_assert_float_eq(post[j], want_post, 1e-5, "post[%d] %g, want %g", j, post[j], want_post);
    }
    for (int i = 0; i < H; i++) {
        double want = 0;
        for (int j = 0; j < HC; j++)
            want += pre[j] * h[j * H + i];
        cr_assert_float_eq(x[i], want, 1e-4, "x[%d] %g, want %g", i, x[i], want);
    }
    /* and the scales act: with all three at 1 every output moves */
    float one[3] = {1, 1, 1}, x1[H], post1[HC], comb1[HC * HC];
    pd_mhc_pre(&m, h, fn, base, one, x1, post1, comb1);
    for (int j = 0; j < HC; j++)
        cr_assert(fabsf(post1[j] - post[j]) > 1e-4, "post[%d] does not see scale[1]", j);
    double dx = 0, dc = 0;
    for (int i = 0; i < H; i++)
        dx += fabs(x1[i] - x[i]);
    for (int k = 0; k < HC * HC; k++)
        dc += fabs(comb1[k] - comb[k]);
    cr_assert(dx > 1e-3 && dc > 1e-3, "x moved %g, comb %g", dx, dc);
}

Test(parts, mhc_post)
{
    enum { HC = 4, H = 8 };
    struct pd_model m = small(HC, H);
    float h[HC * H], h0[HC * H], out[H], post[HC] = {1, 0.5f, 2, 0}, comb[HC * HC];
    for (int i = 0; i < HC * H; i++)
        h[i] = h0[i] = (float)i / 10.0f;
    for (int i = 0; i < H; i++)
        out[i] = (float)(H - i);
    for (int i = 0; i < HC * HC; i++)
        comb[i] = (float)(i + 1) / 40.0f;
    pd_mhc_post(&m, h, out, post, comb);
    for (int k = 0; k < HC; k++)
        for (int i = 0; i < H; i++) {
            float want = post[k] * out[i];
            for (int j = 0; j < HC; j++)
                want += comb[j * HC + k] * h0[j * H + i];
            cr_assert_float_eq(h[k * H + i], want, 1e-5);
        }
}

/* "post" in place by chunks of columns gives each value the bits of the element-wise sum over the
 * whole rows (pd_scale_axpys, each new stream from the old ones): widths under, at and past a
 * chunk and with a partial last one, 4 and 7 streams. */
Test(parts, mhc_post_in_place_equals_whole_rows)
{
    static const int Hs[] = {8, 64, 200, 512, 1000}, HCs[] = {4, 7};
    for (size_t a = 0; a < sizeof Hs / sizeof *Hs; a++)
        for (size_t b = 0; b < sizeof HCs / sizeof *HCs; b++) {
            const int H = Hs[a], HC = HCs[b];
            struct pd_model m = small(HC, H);
            float *h = malloc(sizeof(float) * HC * H), *h0 = malloc(sizeof(float) * HC * H);
            float *want = malloc(sizeof(float) * HC * H), *out = malloc(sizeof(float) * H);
            float post[8], comb[64], c[8];
            for (int i = 0; i < HC * H; i++)
                h[i] = h0[i] = sinf((float)i * 0.37f) * 3.0f;
            for (int i = 0; i < H; i++)
                out[i] = cosf((float)i * 0.11f);
            for (int k = 0; k < HC; k++)
                post[k] = 0.3f + 0.17f * (float)k;
            for (int i = 0; i < HC * HC; i++)
                comb[i] = 0.05f + 0.01f * (float)((i * 7) % 13);
            for (int k = 0; k < HC; k++) {
                for (int j = 0; j < HC; j++)
                    c[j] = comb[j * HC + k];
                pd_scale_axpys(post[k], out, c, h0, (size_t)H, HC, want + (size_t)k * H, H);
            }
            pd_mhc_post(&m, h, out, post, comb);
            cr_assert_eq(memcmp(h, want, sizeof(float) * HC * H), 0, "hidden %d, %d streams", H, HC);
            free(h), free(h0), free(want), free(out);
        }
}

/* A compressor of ratio r over d channels with equal gates: every entry is the plain average
 * of the values it covers (then RMS-normalised; rope of 0 dims does nothing). */
static void compress(int r, int d, const float *kv, int tokens, float *entries, int *emitted_at)
{
    int coff = r == 4 ? 2 : 1;
    float ape[4 * 2 * 16] = {0}, norm[16], gate[32] = {0}, state[2 * 2 * 8 * 2 * 16];
    for (int i = 0; i < d; i++)
        norm[i] = 1;
    struct pd_compressor_w c = {.ratio = r, .coff = coff, .d = d, .ape = ape, .norm = norm};
    struct pd_rope rope;
    memset(&rope, 0, sizeof rope);
    int n = 0;
    for (int p = 0; p < tokens; p++) {
        float e[16];
        if (pd_compress_push(&c, state, kv + (size_t)p * coff * d, gate, p, &rope, 0, e)) {
            memcpy(entries + (size_t)n * d, e, (size_t)d * 4);
            emitted_at[n++] = p;
        }
    }
    emitted_at[n] = -1;
}

static void normalise(float *v, int d)
{
    double ss = 0;
    for (int i = 0; i < d; i++)
        ss += (double)v[i] * v[i];
    for (int i = 0; i < d; i++)
        v[i] = (float)(v[i] / sqrt(ss / d));
}

Test(parts, compressor_entries_only_for_completed_blocks)
{
    /* ratio 2 (no overlap), 2 channels, 5 tokens: entries after tokens 1 and 3 only */
    float kv[5 * 2] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, ent[4 * 2];
    int at[8];
    compress(2, 2, kv, 5, ent, at);
    cr_assert_eq(at[0], 1);
    cr_assert_eq(at[1], 3);
    cr_assert_eq(at[2], -1);
    float want0[2] = {2, 3}, want1[2] = {6, 7};
    normalise(want0, 2);
    normalise(want1, 2);
    for (int i = 0; i < 2; i++) {
        cr_assert_float_eq(ent[i], want0[i], 1e-5);
        cr_assert_float_eq(ent[2 + i], want1[i], 1e-5);
    }
}

Test(parts, compressor_ratio4_overlaps_the_previous_block)
{
    /* ratio 4, 1 channel, coff 2: token p projects (a_p, b_p); block 0's entry averages b_0..b_3;
     * block 1's averages a_0..a_3 (previous block, first half) and b_4..b_7 */
    float kv[8 * 2];
    for (int p = 0; p < 8; p++) {
        kv[2 * p] = 100.0f + p;   /* a */
        kv[2 * p + 1] = (float)p; /* b */
    }
    float ent[4];
    int at[8];
    compress(4, 1, kv, 8, ent, at);
    cr_assert_eq(at[0], 3);
    cr_assert_eq(at[1], 7);
    cr_assert_eq(at[2], -1);
    /* one channel: RMS normalisation keeps only the sign, so compare the raw means' signs and
     * check a 2-channel case for the values */
    cr_assert_float_eq(ent[0], 1.0f, 1e-5);
    float kv2[8 * 4];
    for (int p = 0; p < 8; p++) {
        kv2[4 * p + 0] = 100.0f + p; /* a, channel 0 */
        kv2[4 * p + 1] = -50.0f;     /* a, channel 1 */
        kv2[4 * p + 2] = (float)p;   /* b, channel 0 */
        kv2[4 * p + 3] = 1.0f;       /* b, channel 1 */
    }
    float e2[4];
    compress(4, 2, kv2, 8, e2, at);
    float w0[2] = {1.5f, 1.0f};                                    /* mean of b over block 0 */
    float w1[2] = {(101.5f + 5.5f) / 2, (-50.0f + 1.0f) / 2};      /* a of block 0 and b of block 1 */
    normalise(w0, 2);
    normalise(w1, 2);
    for (int i = 0; i < 2; i++) {
        cr_assert_float_eq(e2[i], w0[i], 1e-5);
        cr_assert_float_eq(e2[2 + i], w1[i], 1e-5);
    }
}

Test(parts, indexer_topk)
{
    float s[10] = {0.5f, 3, -1, 3, 7, 0, 2, 7, 1, 3};
    int sel[10];
    uint64_t work[10];
    int n = pd_topk(s, 10, 4, sel, work);
    cr_assert_eq(n, 4);
    /* the best four: 7 (4), 7 (7), then two of the 3s: the lower indices 1 and 3 */
    int want[4] = {1, 3, 4, 7};
    for (int i = 0; i < 4; i++)
        cr_assert_eq(sel[i], want[i]);
    cr_assert_eq(pd_topk(s, 3, 8, sel, work), 3);
    cr_assert(sel[0] == 0 && sel[1] == 1 && sel[2] == 2);
}

/* pd_topk against the definition: k times the best remaining score (ties to the lower index, -0.0
 * equal to +0.0, NaN below every number), then the chosen indices sorted; on scores drawn from a
 * few values (many ties), signed zeros, infinities and NaN, at sizes that cross the radix passes'
 * buckets, every k. */
static int ranks_above(float a, int ia, float b, int ib)
{
    if (a != a || b != b)
        return a == a || (b != b && ia < ib);
    return a > b || (a == b && ia < ib);
}

Test(parts, indexer_topk_matches_definition)
{
    static const float pool[] = {0.0f, -0.0f, 1.0f, -1.0f, 2.5f, 1e-30f, -1e-30f, 3e38f, INFINITY, -INFINITY, NAN};
    unsigned seed = 7;
    for (int round = 0; round < 300; round++) {
        const int n = 1 + (int)((seed = seed * 1103515245u + 12345u) >> 16) % 700;
        float s[700];
        for (int v = 0; v < n; v++) {
            seed = seed * 1103515245u + 12345u;
            s[v] = round % 3 == 0 ? pool[(seed >> 16) % 11] : (float)((int)((seed >> 16) % 2001) - 1000) / 64.0f;
        }
        const int k = 1 + (int)((seed >> 8) % (unsigned)(n + 2));
        int want[700], got[700], taken[700] = {0}, nw = 0;
        uint64_t work[700];
        for (; nw < k && nw < n; nw++) {
            int best = -1;
            for (int v = 0; v < n; v++)
                if (!taken[v] && (best < 0 || ranks_above(s[v], v, s[best], best)))
                    best = v;
            taken[best] = 1;
        }
        for (int v = 0, c = 0; v < n; v++)
            if (taken[v])
                want[c++] = v;
        cr_assert_eq(pd_topk(s, n, k, got, work), nw, "round %d: n %d k %d", round, n, k);
        for (int i = 0; i < nw; i++)
            cr_assert_eq(got[i], want[i], "round %d: n %d k %d, choice %d", round, n, k, i);
    }
}

/* The router's choice as first written: every score exact, k passes over all experts. */
static void choose_plain(const float *z, const float *bias, int E, int k, float *s, int32_t *id)
{
    float pick[512];
    for (int x = 0; x < E; x++) {
        s[x] = sqrtf(pd_softplus(z[x]));
        pick[x] = s[x] + (bias ? bias[x] : 0);
    }
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int x = 0; x < E; x++)
            if (pick[x] != -INFINITY && (best < 0 || pick[x] > pick[best]))
                best = x;
        id[j] = best;
        pick[best] = -INFINITY;
    }
}

Test(parts, router_choice_same_as_scoring_every_expert)
{
    enum { E = 256, K = 6 };
    static float z[E], z2[E], bias[E], s1[E], s2[E];
    struct pd_layer_w L;
    memset(&L, 0, sizeof L);
    uint64_t r = 12345;
    for (int trial = 0; trial < 3000; trial++) {
        int kind = trial % 6;
        for (int x = 0; x < E; x++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            float u = (float)(r >> 40) / (float)(1 << 24);   /* [0, 1) */
            /* spread logits, a few far out (the table's ends), and crowds of equal or nearly
             * equal values at the top (ties and near-ties at the threshold) */
            z[x] = kind == 0 ? 8 * u - 4 : kind == 1 ? 60 * u - 30 : kind == 2 ? (float)(x % 3) : kind == 3 ? 1.0f + 1e-6f * (float)(x % 7) : kind == 4 ? 20.0f + (float)(x % 2) * 1e-5f : -17 - u;
            bias[x] = kind == 5 ? 0 : (trial / 6) & 1 ? 0.01f * (float)((x * 7) % 5) : 0;
        }
        /* every kind with and without a bias, and a bias of zeros (trial / 6 % 4: 0, 1 / 2, 3) */
        L.gate_bias = (trial / 12) & 1 ? NULL : bias;
        int32_t id1[K], id2[K];
        choose_plain(z, L.gate_bias, E, K, s1, id1);
        memcpy(z2, z, sizeof z);
        pd_moe_choose(&L, E, K, z2, s2, id2);
        for (int j = 0; j < K; j++) {
            cr_assert_eq(id1[j], id2[j], "trial %d (kind %d) choice %d: %d vs %d", trial, kind, j, id2[j], id1[j]);
            cr_assert(memcmp(&s1[id1[j]], &s2[id2[j]], 4) == 0, "trial %d: score of %d", trial, id1[j]);
        }
    }
    /* in place (s = z), as route() calls it */
    for (int x = 0; x < E; x++)
        z[x] = sinf((float)x);
    int32_t a[K], b[K];
    choose_plain(z, NULL, E, K, s1, a);
    L.gate_bias = NULL;
    pd_moe_choose(&L, E, K, z, z, b);
    for (int j = 0; j < K; j++)
        cr_assert(a[j] == b[j] && memcmp(&s1[a[j]], &z[b[j]], 4) == 0);
}

/* The indexer's weight scale, index_head_dim^-1/2 * index_n_heads^-1/2: 1/sqrt(128 * 64) for
 * V4-Flash; and a query or key through the indexer's low precision lies on the FP4 grid of its
 * blocks after the Hadamard rotation (checked on one hand-made vector). */
Test(parts, indexer_weight_scale_and_low_precision)
{
    struct pd_model m;
    pd_err e = {0};
    cr_assert_eq(pd_model_load("deepseek-v4-flash", &m, &e), 0, "%s", e.msg);
    cr_assert_float_eq(pd_indexer_weight_scale(&m), 1 / sqrt(128.0 * 64.0), 1e-9);
    /* x = e_0 * 4: rotated, every value is 4 / sqrt(32) = 0.7071..; bf16 0.70703125; the block's
     * scale 2^ceil(log2(0.707 / 6)) = 1/8: 5.656 -> 6 -> 0.75 */
    float x[32] = {4};
    pd_indexer_lowp(x, 32);
    for (int i = 0; i < 32; i++)
        cr_assert_eq(x[i], 0.75f, "value %d: %g", i, x[i]);
}

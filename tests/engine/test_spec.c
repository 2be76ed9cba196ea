/* Speculative decoding with the MTP layer: the roll back is exact (logits after any accept/reject
 * pattern equal plain decoding's bit for bit), the MTP step agrees with itself however its tokens
 * arrive, greedy speculation gives plain decoding's ids, and rejection sampling keeps the target
 * distribution. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "../tmpmodel.h"
#include "engine/engine.h"
#include "engine/genmodel.h"
#include "engine/sampler.h"
#include "engine/spec.h"

static char dir[64];

static void make_tiny(void)
{
    tmp_model("v4-tiny", 7, dir, sizeof dir);
}

static void remove_tiny(void)
{
    rm_model(dir);
}

TestSuite(spec, .init = make_tiny, .fini = remove_tiny);

static void open_mtp(struct pd_engine *en, const char *d, int mtp)
{
    struct pd_engine_opts o = {.dir = d, .threads = 1, .max_seqs = 4, .max_model_len = 512, .mtp = mtp};
    pd_err e = {0};
    cr_assert_eq(pd_engine_open(en, &o, &e), 0, "%s", e.msg);
}

static void prompt(int32_t *ids, int n, int salt)
{
    for (int i = 0; i < n; i++)
        ids[i] = (int32_t)((i * 37 + salt * 101 + 11) % 500);
}

static int32_t greedy_of(const float *l, int n)
{
    int32_t b = 0;
    for (int i = 1; i < n; i++)
        if (l[i] > l[b])
            b = i;
    return b;
}

#define P 30
#define G 70

/* Plain greedy decoding: the tokens after the prompt and the logits each was chosen from. */
static void plain(struct pd_engine *en, const int32_t *ids, int32_t *tok, float *logits)
{
    const int V = (int)en->model.vocab_size;
    struct pd_seq s;
    pd_err e = {0};
    cr_assert_eq(pd_seq_start(en, &s, &e), 0);
    struct pd_step_item it = {.seq = &s, .tokens = ids, .n = P, .logits = logits};
    cr_assert_eq(pd_engine_step(en, &it, 1, &e), 0, "%s", e.msg);
    for (int g = 0; g < G; g++) {
        tok[g] = greedy_of(logits + (size_t)g * V, V);
        if (g + 1 == G)
            break;
        it = (struct pd_step_item){.seq = &s, .tokens = &tok[g], .n = 1, .logits = logits + (size_t)(g + 1) * V};
        cr_assert_eq(pd_engine_step(en, &it, 1, &e), 0, "%s", e.msg);
    }
    pd_seq_end(en, &s);
}

/* Verify steps of k+1 tokens whose first a drafts are plain decoding's tokens and the rest wrong,
 * for a schedule of (k, a) that crosses the window ring (8) several times, compressor blocks of
 * 4 and 16 and the indexer's top-k: each kept position's logits, in the verify step and after
 * the roll back, equal plain decoding's bit for bit. k reaches 10: one step overwrites the ring
 * more than once. */
Test(spec, rollback_after_any_acceptance_is_exact)
{
    struct pd_engine en;
    open_mtp(&en, dir, 1);
    const int V = (int)en.model.vocab_size;
    int32_t ids[P], tok[G];
    float *ref = malloc((size_t)G * V * sizeof(float)), *vl = malloc((size_t)11 * V * sizeof(float));
    cr_assert(ref && vl);
    prompt(ids, P, 3);
    plain(&en, ids, tok, ref);
    struct pd_seq s;
    pd_err e = {0};
    cr_assert_eq(pd_seq_start(&en, &s, &e), 0);
    struct pd_step_item it = {.seq = &s, .tokens = ids, .n = P, .logits = vl};
    cr_assert_eq(pd_engine_step(&en, &it, 1, &e), 0);
    cr_assert_eq(memcmp(vl, ref, (size_t)V * sizeof(float)), 0);
    static const int ks[] = {3, 1, 10, 2, 5, 4, 1, 7, 3, 6};
    int g = 0, round = 0;   /* tok[g] is the next token to verify */
    while (g + 1 < G) {
        int k = ks[round % 10], a = (round * 7 + 3) % (k + 1);
        if (g + 1 + k > G)
            k = G - g - 1;
        if (a > k)
            a = k;
        int32_t v[11];
        v[0] = tok[g];
        for (int j = 1; j <= k; j++)
            v[j] = j <= a ? tok[g + j] : (tok[g + j] + 1 + j) % 500;
        int64_t p = s.pos;
        it = (struct pd_step_item){.seq = &s, .tokens = v, .n = k + 1, .all_logits = vl, .undo = 1};
        cr_assert_eq(pd_engine_step(&en, &it, 1, &e), 0, "%s", e.msg);
        for (int j = 0; j <= a && g + j + 1 < G; j++)
            cr_assert_eq(memcmp(vl + (size_t)j * V, ref + (size_t)(g + j + 1) * V, (size_t)V * sizeof(float)), 0,
                         "round %d: position %lld differs from plain decoding", round, (long long)(p + j));
        cr_assert_eq(pd_engine_rollback(&en, &s, p + a + 1, s.mtp_pos, &e), 0, "%s", e.msg);
        cr_assert_eq(s.pos, p + a + 1);
        g += a + 1;
        round++;
    }
    /* and a plain step after the last roll back still agrees */
    cr_assert_geq(round, 10);
    pd_seq_end(&en, &s);
    cr_assert_eq(en.kv.n_blocks_free, en.kv.n_blocks);
    free(ref);
    free(vl);
    pd_engine_close(&en);
}

/* A roll back past what was recorded is refused, and so is one that would grow the sequence. */
Test(spec, rollback_of_unrecorded_tokens_is_refused)
{
    struct pd_engine en;
    open_mtp(&en, dir, 1);
    int32_t ids[P];
    prompt(ids, P, 1);
    struct pd_seq s;
    pd_err e = {0};
    cr_assert_eq(pd_seq_start(&en, &s, &e), 0);
    struct pd_step_item it = {.seq = &s, .tokens = ids, .n = P};
    cr_assert_eq(pd_engine_step(&en, &it, 1, &e), 0);
    cr_assert_eq(pd_engine_rollback(&en, &s, P - 1, 0, &e), PD_EINVAL);
    cr_assert(strstr(e.msg, "not run with undo"), "%s", e.msg);
    cr_assert_eq(pd_engine_rollback(&en, &s, P + 1, 0, &e), PD_EINVAL);
    it = (struct pd_step_item){.seq = &s, .tokens = ids, .n = 3, .undo = 1};
    cr_assert_eq(pd_engine_step(&en, &it, 1, &e), 0);
    cr_assert_eq(pd_engine_rollback(&en, &s, P - 1, 0, &e), PD_EINVAL, "position P-1 was not recorded");
    cr_assert_eq(pd_engine_rollback(&en, &s, P + 1, 0, &e), 0, "%s", e.msg);
    pd_seq_end(&en, &s);
    pd_engine_close(&en);
}

/* The MTP layer: positions run in one step or one by one give the same logits and hidden
 * states bit for bit; recursive drafting positions rolled back leave its cache as if they had
 * never run. */
Test(spec, mtp_step_is_exact_across_chunks_and_rollback)
{
    struct pd_engine en;
    open_mtp(&en, dir, 1);
    const int V = (int)en.model.vocab_size;
    const size_t row = (size_t)en.model.hc_mult * en.model.hidden_size;
    int32_t ids[P + 1];
    prompt(ids, P + 1, 5);
    float *h = malloc((size_t)P * row * sizeof(float)), *la = malloc((size_t)P * V * sizeof(float));
    float *lb = malloc((size_t)V * sizeof(float)), *ha = malloc((size_t)P * row * sizeof(float));
    float *hb = malloc(row * sizeof(float));
    cr_assert(h && la && lb && ha && hb);
    struct pd_seq s, t;
    pd_err e = {0};
    cr_assert_eq(pd_seq_start(&en, &s, &e), 0);
    cr_assert_eq(pd_seq_start(&en, &t, &e), 0);
    struct pd_step_item it = {.seq = &s, .tokens = ids, .n = P, .hidden = h};
    cr_assert_eq(pd_engine_step(&en, &it, 1, &e), 0, "%s", e.msg);
    /* s: the MTP layer over all P positions at once */
    it = (struct pd_step_item){.seq = &s, .tokens = ids + 1, .n = P, .hidden_in = h, .all_logits = la, .hidden = ha};
    cr_assert_eq(pd_engine_mtp_step(&en, &it, 1, &e), 0, "%s", e.msg);
    cr_assert_eq(s.mtp_pos, P);
    /* t: the first 20 at once, then drafting positions with undo rolled back, then one by one */
    it = (struct pd_step_item){.seq = &t, .tokens = ids + 1, .n = 20, .hidden_in = h};
    cr_assert_eq(pd_engine_mtp_step(&en, &it, 1, &e), 0, "%s", e.msg);
    t.pos = P;   /* t's main model is not run: only its MTP positions are compared */
    int32_t junk[3] = {7, 8, 9};
    for (int j = 0; j < 3; j++) {
        it = (struct pd_step_item){.seq = &t, .tokens = &junk[j], .n = 1, .hidden_in = h + (size_t)(P - 1 - j) * row,
                                   .undo = 1};
        cr_assert_eq(pd_engine_mtp_step(&en, &it, 1, &e), 0, "%s", e.msg);
    }
    cr_assert_eq(pd_engine_rollback(&en, &t, P, 20, &e), 0, "%s", e.msg);
    for (int j = 20; j < P; j++) {
        it = (struct pd_step_item){.seq = &t, .tokens = ids + 1 + j, .n = 1, .hidden_in = h + (size_t)j * row,
                                   .logits = lb, .hidden = hb};
        cr_assert_eq(pd_engine_mtp_step(&en, &it, 1, &e), 0, "%s", e.msg);
        cr_assert_eq(memcmp(lb, la + (size_t)j * V, (size_t)V * sizeof(float)), 0, "MTP logits at %d", j);
        cr_assert_eq(memcmp(hb, ha + (size_t)j * row, row * sizeof(float)), 0, "MTP hidden state at %d", j);
    }
    pd_seq_end(&en, &s);
    pd_seq_end(&en, &t);
    free(h);
    free(la);
    free(lb);
    free(ha);
    free(hb);
    pd_engine_close(&en);
}

/* Greedy speculation through pd_spec_round, three prompts batched, k = 1, 2, 3: the ids equal
 * plain decoding's, and so do the logits every token was chosen from. */
static void spec_equals_plain_t(const char *d, int min_accept, float temperature, float top_p)
{
    struct pd_engine en;
    open_mtp(&en, d, 1);
    const int V = (int)en.model.vocab_size, Vs = V < 1024 ? V : 1024;
    int32_t ids[3][P], tok[3][G];
    float *ref = malloc((size_t)3 * G * V * sizeof(float));
    float *ol = malloc((size_t)3 * (PD_SPEC_MAX_K + 1) * V * sizeof(float)), *lg[3];
    cr_assert(ref && ol);
    for (int i = 0; i < 3; i++) {
        prompt(ids[i], P, 11 + i);
        plain(&en, ids[i], tok[i], ref + (size_t)i * G * V);
    }
    int64_t accepted = 0;
    for (int k = 1; k <= 3; k++) {
        struct pd_seq s[3];
        struct pd_spec_seq sp[3], *ss[3];
        struct pd_sampler smp;
        pd_sampler_init(&smp, temperature, top_p, 1);
        struct pd_spec_stats st = {0};
        pd_err e = {0};
        const int32_t *pr[3];
        int pn[3], n[3] = {0};
        for (int i = 0; i < 3; i++) {
            cr_assert_eq(pd_seq_start(&en, &s[i], &e), 0);
            pd_spec_init(&sp[i], &s[i], &smp);
            sp[i].out_logits = ol + (size_t)i * (PD_SPEC_MAX_K + 1) * V;
            ss[i] = &sp[i];
            pr[i] = ids[i];
            pn[i] = P;
            lg[i] = sp[i].out_logits;
        }
        cr_assert_eq(pd_spec_prefill(&en, ss, pr, pn, lg, 3, &e), 0, "%s", e.msg);
        for (int i = 0; i < 3; i++) {
            int32_t t = greedy_of(lg[i], Vs);
            cr_assert_eq(t, tok[i][0]);
            cr_assert_eq(pd_spec_push(&sp[i], t, &e), 0);
            n[i] = 1;
        }
        for (;;) {
            int m = 0;
            for (int i = 0; i < 3; i++)
                if (n[i] < G) {
                    sp[i].k = k < G - n[i] - 1 ? k : G - n[i] - 1;
                    ss[m++] = &sp[i];
                }
            if (!m)
                break;
            cr_assert_eq(pd_spec_round(&en, ss, m, Vs, &st, &e), 0, "%s", e.msg);
            for (int i = 0; i < 3; i++)
                for (int j = 0; j < sp[i].n_out && n[i] < G; j++) {
                    cr_assert_eq(sp[i].out[j], tok[i][n[i]], "k %d prompt %d token %d", k, i, n[i]);
                    cr_assert_eq(memcmp(sp[i].out_logits + (size_t)j * V, ref + ((size_t)i * G + n[i]) * V,
                                        (size_t)V * sizeof(float)),
                                 0, "k %d prompt %d: the logits of token %d", k, i, n[i]);
                    n[i]++;
                }
            for (int i = 0; i < 3; i++)
                sp[i].n_out = 0;
        }
        cr_assert_eq(st.emitted, st.steps + st.accepted);
        accepted += st.accepted;
        for (int i = 0; i < 3; i++) {
            pd_spec_free(&sp[i]);
            pd_seq_end(&en, &s[i]);
        }
    }
    cr_assert_geq(accepted, min_accept, "%lld drafts accepted", (long long)accepted);
    free(ref);
    free(ol);
    pd_engine_close(&en);
}

static void spec_equals_plain(const char *d, int min_accept)
{
    spec_equals_plain_t(d, min_accept, 0, 1);
}

Test(spec, greedy_speculation_equals_plain_decoding)
{
    spec_equals_plain(dir, 0);
}

/* The same on a model whose draft agrees often (gen-model --mtp-agreement): drafts are accepted
 * at every position of a round, so the roll back after partial acceptance is exercised. */
Test(spec, greedy_speculation_with_accepted_drafts_equals_plain_decoding)
{
    char d2[64];
    tmp_model_agree("v4-tiny", 3, 0.7, d2, sizeof d2);
    spec_equals_plain(d2, 200);
    rm_model(d2);
}

/* The sampling path (temperature > 0: the sampler's distribution, accept with probability p(d),
 * resample from the residual) with a nucleus so small that it keeps only the top token: p is a
 * point mass, so the output is greedy decoding's, exactly, whatever the draws. */
Test(spec, sampling_path_with_a_point_mass_target_equals_plain_decoding)
{
    char d2[64];
    tmp_model_agree("v4-tiny", 3, 0.7, d2, sizeof d2);
    spec_equals_plain_t(d2, 200, 0.7f, 1e-6f);
    rm_model(d2);
}

/* gen-model --mtp-agreement R: the first draft is accepted at about rate R, the second at
 * about R^2 (unconditionally). */
Test(spec, agreement_model_accepts_at_about_the_rate)
{
    static const double rates[] = {0.3, 0.8};
    for (int ri = 0; ri < 2; ri++) {
        const double R = rates[ri];
        char d2[64];
        tmp_model_agree("v4-tiny", 5, R, d2, sizeof d2);
        struct pd_engine en;
        open_mtp(&en, d2, 1);
        pd_err e = {0};
        const int V = (int)en.model.vocab_size;
        struct pd_sampler smp;
        pd_sampler_init(&smp, 0, 1, 1);
        struct pd_spec_stats st = {0};
        float *lg = malloc((size_t)V * sizeof(float));
        for (int pi = 0; pi < 3; pi++) {
            int32_t ids[P];
            prompt(ids, P, 20 + pi);
            struct pd_seq s;
            struct pd_spec_seq sp, *ss = &sp;
            cr_assert_eq(pd_seq_start(&en, &s, &e), 0);
            pd_spec_init(&sp, &s, &smp);
            const int32_t *pr = ids;
            int pn = P;
            cr_assert_eq(pd_spec_prefill(&en, &ss, &pr, &pn, &lg, 1, &e), 0, "%s", e.msg);
            cr_assert_eq(pd_spec_push(&sp, greedy_of(lg, V), &e), 0);
            for (int n = 1; n < 300; n += sp.n_out) {
                sp.k = 2;
                cr_assert_eq(pd_spec_round(&en, &ss, 1, V, &st, &e), 0, "%s", e.msg);
            }
            pd_spec_free(&sp);
            pd_seq_end(&en, &s);
        }
        double a1 = (double)st.accepted_per_pos[0] / st.drafted_per_pos[0];
        double a2 = (double)st.accepted_per_pos[1] / st.drafted_per_pos[1];
        cr_assert_float_eq(a1, R, 0.1, "rate %g: first drafts accepted at %g", R, a1);
        cr_assert_float_eq(a2, R * R, 0.12, "rate %g: second drafts accepted at %g", R, a2);
        free(lg);
        pd_engine_close(&en);
        rm_model(d2);
    }
}

/* For target p and draft q over 6 tokens, the output of accept-or-resample is distributed as p
 * exactly: sum over d of q(d) [a(d) [x = d] + (1 - a(d)) r_d(x)] = p(x); the same for a greedy
 * (point mass) draft; and draws from pd_spec_verify_token follow p. */
Test(spec, rejection_sampling_keeps_the_target_distribution)
{
    enum { N = 6 };
    const float p[N] = {0.05f, 0.30f, 0.10f, 0.25f, 0.20f, 0.10f};
    const float q[N] = {0.40f, 0.10f, 0.10f, 0.05f, 0.15f, 0.20f};
    float r[N];
    double out[N] = {0};
    for (int d = 0; d < N; d++) {
        double a = pd_spec_accept_prob(p, q, d);
        pd_spec_residual(p, q, N, d, r);
        out[d] += q[d] * a;
        for (int x = 0; x < N; x++)
            out[x] += q[d] * (1 - a) * r[x];
    }
    for (int x = 0; x < N; x++)
        cr_assert_float_eq(out[x], p[x], 1e-6, "token %d: %g, want %g", x, out[x], p[x]);
    for (int d = 0; d < N; d++) {
        /* a greedy draft: q a point mass on d */
        double a = pd_spec_accept_prob(p, NULL, d);
        cr_assert_float_eq(a, p[d], 1e-7);
        pd_spec_residual(p, NULL, N, d, r);
        cr_assert_eq(r[d], 0);
        for (int x = 0; x < N; x++) {
            double o = (x == d ? a : 0) + (1 - a) * r[x];
            cr_assert_float_eq(o, p[x], 1e-6, "draft %d token %d", d, x);
        }
    }
    struct pd_sampler s;
    pd_sampler_init(&s, 1, 1, 42);
    int count[N] = {0}, acc = 0;
    const int draws = 200000;
    for (int i = 0; i < draws; i++) {
        int ok;
        count[pd_spec_verify_token(&s, p, NULL, N, 3, r, &ok)]++;
        acc += ok;
    }
    for (int x = 0; x < N; x++)
        cr_assert_float_eq((double)count[x] / draws, p[x], 0.005, "token %d: %d of %d", x, count[x], draws);
    cr_assert_float_eq((double)acc / draws, p[3], 0.005);
}

/* The sampler's distribution is the one it samples: nucleus and temperature applied. */
Test(spec, sampler_probs_match_its_draws)
{
    const float logits[5] = {2.0f, 1.0f, 0.5f, 3.0f, -1.0f};
    struct pd_sampler s;
    pd_sampler_init(&s, 0.8f, 0.9f, 3);
    float p[5], scratch[10];
    pd_sampler_probs(&s, logits, 5, p, scratch);
    double sum = 0;
    for (int i = 0; i < 5; i++)
        sum += p[i];
    cr_assert_float_eq(sum, 1, 1e-6);
    cr_assert_eq(p[4], 0, "outside the nucleus");
    int count[5] = {0};
    for (int i = 0; i < 100000; i++)
        count[pd_sample(&s, logits, 5, scratch)]++;
    for (int i = 0; i < 5; i++)
        cr_assert_float_eq(count[i] / 100000.0, p[i], 0.006, "token %d", i);
    pd_sampler_init(&s, 0, 1, 3);
    pd_sampler_probs(&s, logits, 5, p, scratch);
    cr_assert(p[3] == 1 && p[0] == 0);
}

/* Asking for MTP of a checkpoint without the layer names what is missing. */
Test(spec, mtp_without_the_layer_is_refused)
{
    char d2[64];
    snprintf(d2, sizeof d2, "/tmp/pdmoe-test-XXXXXX");
    cr_assert_not_null(mkdtemp(d2));
    char src[160], dst[160];
    snprintf(src, sizeof src, "%s/model.safetensors", dir);
    snprintf(dst, sizeof dst, "%s/model.safetensors", d2);
    cr_assert_eq(symlink(src, dst), 0);
    /* the same config without num_nextn_predict_layers */
    snprintf(src, sizeof src, "%s/config.json", dir);
    FILE *f = fopen(src, "rb");
    cr_assert_not_null(f);
    static char text[1 << 16];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    /* no MTP layer, and no compress ratio for it (padded to the same length) */
    char *at = strstr(text, "\"num_nextn_predict_layers\": 1");
    cr_assert_not_null(at);
    at[strlen("\"num_nextn_predict_layers\": ")] = '0';
    at = strstr(text, "[0, 4, 16, 4, 0]");
    cr_assert_not_null(at);
    memcpy(at, "[0, 4, 16, 4]   ", 16);
    snprintf(dst, sizeof dst, "%s/config.json", d2);
    f = fopen(dst, "wb");
    cr_assert_not_null(f);
    fwrite(text, 1, n, f);
    fclose(f);
    struct pd_engine en;
    struct pd_engine_opts o = {.dir = d2, .threads = 1, .max_seqs = 1, .max_model_len = 64, .mtp = 1};
    pd_err e = {0};
    cr_assert_neq(pd_engine_open(&en, &o, &e), 0);
    cr_assert(strstr(e.msg, d2) && strstr(e.msg, "no MTP layer") && strstr(e.msg, "num_nextn_predict_layers"), "%s",
              e.msg);
    rm_model(d2);
}

/* What an EP group's ranks do (pd_spec_round_steps): drafting steps past a sequence's k, and
 * whole rounds with no sequence, change nothing: one sequence at k = 1 in rounds of 3 drafting
 * steps, with an empty round of 3 between each two, gives plain decoding's ids and logits bit for
 * bit; a round shorter than a sequence's k, or longer than PD_SPEC_MAX_K, is refused by name. */
Test(spec, drafting_steps_past_k_and_empty_rounds_change_nothing)
{
    char d2[64];
    tmp_model_agree("v4-tiny", 3, 0.7, d2, sizeof d2);
    struct pd_engine en;
    open_mtp(&en, d2, 1);
    const int V = (int)en.model.vocab_size, Vs = V < 1024 ? V : 1024;
    int32_t ids[P], tok[G];
    float *ref = malloc((size_t)G * V * sizeof(float)), *ol = malloc((size_t)(PD_SPEC_MAX_K + 1) * V * sizeof(float));
    cr_assert(ref && ol);
    prompt(ids, P, 5);
    plain(&en, ids, tok, ref);
    struct pd_seq s;
    struct pd_spec_seq sp, *ss = &sp;
    struct pd_sampler smp;
    pd_sampler_init(&smp, 0, 1, 1);
    struct pd_spec_stats st = {0};
    pd_err e = {0};
    cr_assert_eq(pd_seq_start(&en, &s, &e), 0);
    pd_spec_init(&sp, &s, &smp);
    sp.out_logits = ol;
    const int32_t *pr = ids;
    int pn = P, n = 1;
    cr_assert_eq(pd_spec_prefill(&en, &ss, &pr, &pn, &ol, 1, &e), 0, "%s", e.msg);
    cr_assert_eq(greedy_of(ol, Vs), tok[0]);
    cr_assert_eq(pd_spec_push(&sp, tok[0], &e), 0);
    while (n < G) {
        sp.k = G - n - 1 < 1 ? G - n - 1 : 1;
        cr_assert_eq(pd_spec_round_steps(&en, &ss, 1, Vs, 3, &st, &e), 0, "%s", e.msg);
        for (int j = 0; j < sp.n_out && n < G; j++, n++) {
            cr_assert_eq(sp.out[j], tok[n], "token %d", n);
            cr_assert_eq(memcmp(ol + (size_t)j * V, ref + (size_t)n * V, (size_t)V * sizeof(float)), 0, "logits of %d", n);
        }
        cr_assert_eq(pd_spec_round_steps(&en, NULL, 0, Vs, 3, &st, &e), 0, "%s", e.msg);
    }
    cr_assert_gt(st.accepted, 10, "%lld drafts accepted", (long long)st.accepted);
    /* refused: fewer drafting steps than the sequence drafts, or more than PD_SPEC_MAX_K */
    sp.k = 2;
    cr_assert_eq(pd_spec_round_steps(&en, &ss, 1, Vs, 1, &st, &e), PD_EINVAL);
    cr_assert(strstr(e.msg, "drafts 2 tokens, the round 1"), "%s", e.msg);
    cr_assert_eq(pd_spec_round_steps(&en, NULL, 0, Vs, PD_SPEC_MAX_K + 1, &st, &e), PD_EINVAL);
    cr_assert(strstr(e.msg, "drafting steps"), "%s", e.msg);
    pd_spec_free(&sp);
    pd_seq_end(&en, &s);
    free(ref);
    free(ol);
    pd_engine_close(&en);
    rm_model(d2);
}

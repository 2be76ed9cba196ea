/* v4-flash-mini, the default model: no NaN or Inf and bounded hidden-state RMS through every
 * layer, and stable greedy output. Uses models/mini when it exists (CI generates it once), else
 * generates it in a temporary directory. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/engine.h"
#include "engine/genmodel.h"
#include "../tmpmodel.h"

Test(mini, activations_bounded_through_depth, .timeout = 600)
{
    char dir[64] = "models/mini";
    struct stat st;
    int made = 0;
    pd_err e = {0};
    if (stat("models/mini/model.safetensors", &st) != 0) {
        snprintf(dir, sizeof dir, "/tmp/pdmoe-mini-XXXXXX");
        cr_assert_not_null(mkdtemp(dir));
        cr_assert_eq(pd_genmodel("v4-flash-mini", dir, 1, &e), 0, "%s", e.msg);
        made = 1;
    }
    struct pd_engine en;
    struct pd_engine_opts o = {.dir = dir, .threads = 2, .max_seqs = 2, .max_model_len = 600};
    cr_assert_eq(pd_engine_open(&en, &o, &e), 0, "%s", e.msg);
    en.trace_norms = 1;
    /* 520 tokens: past the window (128), several HCA blocks (128) and more CSA entries (130)
     * than the indexer keeps (64) */
    int32_t ids[520];
    for (int i = 0; i < 520; i++)
        ids[i] = (i * 37 + 11) % 1000;
    float *l = malloc((size_t)en.model.vocab_size * 4);
    struct pd_seq s;
    cr_assert_eq(pd_seq_start(&en, &s, &e), 0);
    struct pd_step_item it = {.seq = &s, .tokens = ids, .n = 520, .logits = l};
    cr_assert_eq(pd_engine_step(&en, &it, 1, &e), 0, "%s", e.msg);
    for (int k = 0; k < en.model.n_layers; k++) {
        cr_assert(isfinite(en.layer_rms[k]), "layer %d", k);
        cr_assert(en.layer_rms[k] > 0.1 && en.layer_rms[k] < 10, "layer %d: hidden-state RMS %f", k, en.layer_rms[k]);
    }
    for (int i = 0; i < en.model.vocab_size; i++)
        cr_assert(isfinite(l[i]));
    pd_seq_end(&en, &s);
    free(l);
    pd_engine_close(&en);
    if (made) {
        const char *f[] = {"model.safetensors", "config.json", "tokenizer.json"};
        char p[128];
        for (int i = 0; i < 3; i++) {
            snprintf(p, sizeof p, "%s/%s", dir, f[i]);
            unlink(p);
        }
        rmdir(dir);
    }
}

/* fp8 KV (as V4 is deployed) against bf16 KV on v4-flash-mini: a 300-token prompt (past the
 * window, two HCA blocks, more CSA entries than the indexer keeps) then 16 greedy decode steps
 * fed the bf16 run's tokens, the logits' cosine at every step at least 0.99 */
Test(mini, fp8_kv_logits_close_to_bf16, .timeout = 600)
{
    if (access("models/mini/model.safetensors", R_OK) != 0)
        cr_skip_test("models/mini not generated (./build/pdmoe gen-model --preset v4-flash-mini --out models/mini)");
    struct pd_engine a, b;
    pd_err e = {0};
    struct pd_engine_opts o = {.dir = "models/mini", .threads = 2, .max_seqs = 1, .max_model_len = 400};
    cr_assert_eq(pd_engine_open(&a, &o, &e), 0, "%s", e.msg);
    o.kv_dtype = PD_KV_FP8;
    cr_assert_eq(pd_engine_open(&b, &o, &e), 0, "%s", e.msg);
    const int N = 300, steps = 16, V = (int)a.model.vocab_size;
    int32_t ids[300];
    for (int i = 0; i < N; i++)
        ids[i] = (i * 37 + 11) % 1000;
    float *la = malloc((size_t)V * 4), *lb = malloc((size_t)V * 4);
    struct pd_seq sa, sb;
    cr_assert_eq(pd_seq_start(&a, &sa, &e), 0);
    cr_assert_eq(pd_seq_start(&b, &sb, &e), 0);
    struct pd_step_item ia = {.seq = &sa, .tokens = ids, .n = N, .logits = la};
    struct pd_step_item ib = {.seq = &sb, .tokens = ids, .n = N, .logits = lb};
    double worst = 1, sum = 0;
    int agree = 0;
    int32_t next = 0;
    for (int k = 0; k <= steps; k++) {
        cr_assert_eq(pd_engine_step(&a, &ia, 1, &e), 0, "%s", e.msg);
        cr_assert_eq(pd_engine_step(&b, &ib, 1, &e), 0, "%s", e.msg);
        double c = cosine(la, lb, V);
        worst = c < worst ? c : worst;
        sum += c;
        int ta = 0, tb = 0;
        for (int v = 1; v < V; v++) {
            ta = la[v] > la[ta] ? v : ta;
            tb = lb[v] > lb[tb] ? v : tb;
        }
        agree += ta == tb;
        next = ta;
        ia = (struct pd_step_item){.seq = &sa, .tokens = &next, .n = 1, .logits = la};
        ib = (struct pd_step_item){.seq = &sb, .tokens = &next, .n = 1, .logits = lb};
    }
    cr_log_info("fp8 vs bf16 KV, v4-flash-mini, prompt %d + %d decode steps: logits cosine min %.5f mean %.5f, "
                "greedy token agrees %d of %d", N, steps, worst, sum / (steps + 1), agree, steps + 1);
    cr_assert_geq(worst, 0.99, "logits cosine %f", worst);
    pd_seq_end(&a, &sa);
    pd_seq_end(&b, &sb);
    free(la);
    free(lb);
    pd_engine_close(&a);
    pd_engine_close(&b);
}

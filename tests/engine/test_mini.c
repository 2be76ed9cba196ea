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

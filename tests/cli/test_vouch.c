/* A prediction and the published runs that speak for it: `pdmoe plan --isl/--osl` closes its
 * performance section with the cases of validation/published.json of the same architecture on
 * cards of the same family, as `pdmoe validate` judges them, so that the seed's Ascend prediction
 * (whose only published V4 run on Ascend, SGLang's A3 CI, ran 4.5x slower than the model) is not
 * read as what vllm-ascend will do. Every figure is checked against pdmoe validate's own. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "../run.h"
#include "plan/hardware.h"

/* pdmoe validate's case of this name */
static json_t *validated(json_t *all, const char *name)
{
    size_t i;
    json_t *c;
    json_array_foreach(all, i, c) if (strcmp(json_string_value(json_object_get(c, "name")), name) == 0) return c;
    cr_assert_fail("pdmoe validate has no case \"%s\"", name);
    return NULL;
}

/* the plan's validation object agrees case by case with pdmoe validate --json and holds exactly
 * the cases of published.json with this model and these hardware files; returns how many */
static int check_vouch(json_t *plan, json_t *all, const char *model, const char *const *hardware, const char *family)
{
    json_t *v = json_object_get(json_object_get(plan, "perf"), "validation");
    cr_assert(json_is_object(v), "plan --json has no perf.validation");
    cr_assert_str_eq(json_string_value(json_object_get(v, "family")), family);
    json_t *file = json_load_file("validation/published.json", 0, NULL);
    cr_assert_not_null(file);
    int want = 0;
    size_t i;
    json_t *c;
    json_array_foreach(json_object_get(file, "cases"), i, c) {
        int hw = 0;
        for (int k = 0; hardware[k]; k++)
            hw |= strcmp(json_string_value(json_object_get(c, "hardware")), hardware[k]) == 0;
        want += hw && strcmp(json_string_value(json_object_get(c, "model")), model) == 0;
    }
    json_decref(file);
    json_t *cases = json_object_get(v, "cases");
    cr_assert_eq((int)json_array_size(cases), want, "%zu cases vouch, published.json has %d of %s on %s",
                 json_array_size(cases), want, model, family);
    int slower = 0;
    json_array_foreach(cases, i, c) {
        json_t *w = validated(all, json_string_value(json_object_get(c, "name")));
        for (const char *const *k = (const char *const[]){"published", "predicted", "error", NULL}; *k; k++)
            cr_assert_float_eq(json_real_value(json_object_get(c, *k)), json_real_value(json_object_get(w, *k)), 1e-9,
                               "%s of \"%s\": plan %g, validate %g", *k, json_string_value(json_object_get(c, "name")),
                               json_real_value(json_object_get(c, *k)), json_real_value(json_object_get(w, *k)));
        cr_assert_str_eq(json_string_value(json_object_get(c, "status")), json_string_value(json_object_get(w, "status")));
        slower += strcmp(json_string_value(json_object_get(w, "status")), "known_miss") != 0 &&
                  json_real_value(json_object_get(w, "error")) > 0.25;
    }
    cr_assert_eq(json_integer_value(json_object_get(v, "slower_than_predicted")), slower);
    return want;
}

/* The seed's deployment on 910B: the four V4 runs on Ascend (SGLang's A3 CI at 8K and 32K and its
 * 1P1D run, vLLM-Ascend's nightly A3 run) are all pending, the first at +350%, and the text says to
 * read the prediction as an upper bound. */
Test(vouch, the_seeds_prediction_names_the_ascend_run_it_has_not_met)
{
    struct run r;
    run("validate --json", &r);
    json_error_t je;
    json_t *all = json_loads(r.out, 0, &je);
    cr_assert_not_null(all, "validate --json: %s", je.text);
    json_t *plan = run_json("plan --isl 8000 --osl 1000 --json");
    cr_assert_eq(check_vouch(plan, all, "deepseek-v4-flash", (const char *const[]){"atlas-800i-a2", "atlas-800i-a3", NULL},
                             "Ascend"),
                 4);
    json_t *c = json_array_get(json_object_get(json_object_get(json_object_get(plan, "perf"), "validation"), "cases"), 0);
    cr_assert_str_eq(json_string_value(json_object_get(c, "status")), "pending");
    cr_assert_gt(json_real_value(json_object_get(c, "error")), 0.25);
    json_decref(plan);
    run("plan --isl 8000 --osl 1000", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "published runs of deepseek_v4 on Ascend cards"), "%s", r.out);
    cr_assert(strstr(r.out, "pending     +350.4%  SGLang CI, DeepSeek-V4-Flash W8A8 on one Atlas 800I A3"), "%s", r.out);
    cr_assert(strstr(r.out, "pending     +499.8%  vLLM-Ascend nightly, DeepSeek-V4-Flash W8A8"), "%s", r.out);
    cr_assert(strstr(r.out, "4 of these runs were over 25% slower than the model predicts: on their stack, read the TTFT, TPOT and throughputs above as upper bounds"), "%s", r.out);
    json_decref(all);
}

/* V3 on H800 and V4 on H100: the NVIDIA cases of each architecture, none of the other's. */
Test(vouch, nvidia_predictions_list_their_architectures_runs)
{
    struct run r;
    run("validate --json", &r);
    json_t *all = json_loads(r.out, 0, NULL);
    cr_assert_not_null(all);
    const char *const nvidia[] = {"h100", "h200", "h800", "b200", NULL};
    json_t *p = run_json("plan --model deepseek-v3 --hardware h800 --isl 4000 --osl 1000 --json");
    cr_assert_eq(check_vouch(p, all, "deepseek-v3", nvidia, "NVIDIA"), 8);
    json_decref(p);
    p = run_json("plan --hardware h100 --isl 8000 --osl 1000 --json");
    cr_assert_eq(check_vouch(p, all, "deepseek-v4-flash", nvidia, "NVIDIA"), 11);
    json_decref(p);
    json_decref(all);
}

/* The families by the cards' names; a word inside another is not one. */
Test(vouch, card_families)
{
    struct pd_hardware h = {0};
    strcpy(h.card_name, "Ascend 910B 64 GB");
    cr_assert_str_eq(pd_hardware_family(&h), "Ascend");
    strcpy(h.card_name, "H100 SXM 80 GB");
    cr_assert_str_eq(pd_hardware_family(&h), "NVIDIA");
    strcpy(h.card_name, "B200 180 GB");
    cr_assert_str_eq(pd_hardware_family(&h), "NVIDIA");
    strcpy(h.card_name, "XH1000 accelerator");
    strcpy(h.name, "some CPU");
    cr_assert_null(pd_hardware_family(&h));
    strcpy(h.card_name, "AMD EPYC 9654 (pdmoe calibrate)");
    cr_assert_null(pd_hardware_family(&h));
}

/* pdmoe search closes with the same runs for the layout it chose: its JSON's "validation" is the
 * plan's of the same model and cards, and its text says the same. */
Test(vouch, search_names_the_same_runs)
{
    json_t *plan = run_json("plan --isl 4096 --osl 1024 --json");
    json_t *search = run_json("search --cards 64 --isl 4096 --osl 1024 --json");
    json_t *a = json_object_get(json_object_get(plan, "perf"), "validation"), *b = json_object_get(search, "validation");
    cr_assert(json_is_object(b), "search --json has no validation");
    cr_assert(json_equal(a, b), "search's validation differs from plan's");
    json_decref(plan);
    json_decref(search);
    struct run r;
    run("search --cards 64 --isl 4096 --osl 1024", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(strstr(r.out, "pending     +350.4%  SGLang CI, DeepSeek-V4-Flash W8A8 on one Atlas 800I A3"), "%s", r.out);
}

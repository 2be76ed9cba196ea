/* Published deployments -> predictions and errors (validate.h). */
#include "plan/validate.h"
#include "plan/lockstep.h"
#include "model/jsonf.h"

#include <jansson.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int role_opts(const char *label, json_t *c, const char *key, struct pd_role_opts *r, pd_err *e)
{
    json_t *o = json_object_get(c, key);
    if (!json_is_object(o))
        return pd_err_set(e, PD_EINVAL, "%s: field \"%s\": expected an object {dp, tp, instances, redundant}", label, key);
    char pfx[32];
    snprintf(pfx, sizeof pfx, "%s.", key);
    struct pd_jsrc s = {label, pfx};
    int rc;
    static const char *const known[] = {"dp", "tp", "instances", "redundant", NULL};
    if ((rc = pd_json_i32(&s, o, "dp", 1, 1, 1, 1 << 20, &r->dp, e)) ||
        (rc = pd_json_i32(&s, o, "tp", 0, 1, 1, 1024, &r->tp, e)) ||
        (rc = pd_json_i32(&s, o, "instances", 0, 1, 1, 1 << 20, &r->instances, e)) ||
        (rc = pd_json_i32(&s, o, "redundant", 0, 0, 0, 1 << 20, &r->redundant, e)) ||
        (rc = pd_json_known(&s, o, known, e)))
        return rc;
    return 0;
}

/* The largest decode batch keeping at least `min_user` tokens/s per user (user speed falls
 * as the batch grows), within the KV pool. */
static int batch_for_speed(const struct pd_plan *p, struct pd_workload *w, double min_user, struct pd_perf *f, pd_err *e)
{
    int rc;
    w->decode_batch = 0;
    if ((rc = pd_perf_eval(p, w, f, e)))
        return rc;
    int64_t lo = 1, hi = f->batch_cap > 0 ? f->batch_cap : 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        w->decode_batch = mid;
        if ((rc = pd_perf_eval(p, w, f, e)))
            return rc;
        if (f->user_tok_s >= min_user)
            lo = mid;
        else
            hi = mid - 1;
    }
    w->decode_batch = lo;
    return pd_perf_eval(p, w, f, e);
}

static int is_metric(const char *m)
{
    static const char *const ok[] = {"prefill_tokens_per_s_node", "decode_tokens_per_s_node", "output_tokens_per_s",
                                     "user_tokens_per_s"};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        if (strcmp(m, ok[i]) == 0)
            return 1;
    return 0;
}

static int run_case(json_t *c, const char *label, struct pd_valcase *v, pd_err *e)
{
    struct pd_jsrc s = {label, ""};
    char model[64], hw[64], quant[16], qovr[128], kvdt[16], phase[16], sched[16], stack[16];
    int rc, mtp;
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    struct pd_workload w;
    pd_workload_default(&w);
    double min_user = 0, imbalance = 0;
    json_t *aggj = json_object_get(c, "aggregated");
    /* a misspelt key would leave its field at the default without a word */
    static const char *const known[] = {
        "name", "source", "assumed", "known_miss", "pending", "metric", "published", "model", "hardware", "quant",
        "quant_override", "kv_cache_dtype", "nodes", "prefill", "decode", "aggregated", "isl", "osl", "cached",
        "concurrency", "decode_ctx", "decode_batch", "min_user_tokens_per_s", "imbalance", "max_num_batched_tokens",
        "max_num_seqs", "max_model_len", "phase", "num_prompts", "prefill_max_requests", "schedule", "mtp",
        "num_speculative_tokens", "stack", NULL};
    if ((rc = pd_json_bool(&s, c, "mtp", 0, -1, &mtp, e)) ||
        (rc = pd_json_str(&s, c, "pending", 0, "", v->pending, sizeof v->pending, e)) ||
        (rc = pd_json_int(&s, c, "concurrency", 0, 0, 0, 1 << 24, &w.concurrency, e)) ||
        (rc = pd_json_str(&s, c, "name", 1, "", v->name, sizeof v->name, e)) ||
        (rc = pd_json_str(&s, c, "source", 1, "", v->source, sizeof v->source, e)) ||
        (rc = pd_json_str(&s, c, "assumed", 0, "", v->assumed, sizeof v->assumed, e)) ||
        (rc = pd_json_str(&s, c, "known_miss", 0, "", v->known_miss, sizeof v->known_miss, e)) ||
        (rc = pd_json_str(&s, c, "metric", 1, "", v->metric, sizeof v->metric, e)) ||
        (rc = pd_json_num(&s, c, "published", 1, 0, 1e-9, 1e15, &v->published, e)) ||
        (rc = pd_json_str(&s, c, "model", 1, "", model, sizeof model, e)) ||
        (rc = pd_json_str(&s, c, "hardware", 1, "", hw, sizeof hw, e)) ||
        (rc = pd_json_str(&s, c, "quant", 0, "w8a8", quant, sizeof quant, e)) ||
        (rc = pd_json_str(&s, c, "quant_override", 0, "", qovr, sizeof qovr, e)) ||
        (rc = pd_json_str(&s, c, "kv_cache_dtype", 0, "fp8", kvdt, sizeof kvdt, e)) ||
        (rc = pd_json_str(&s, c, "stack", 0, "vllm", stack, sizeof stack, e)) ||
        (rc = pd_json_i32(&s, c, "nodes", 1, 1, 1, 1 << 20, &o.nodes, e)) ||
        (rc = pd_json_int(&s, c, "isl", 1, 1, 1, 1 << 30, &w.isl, e)) ||
        (rc = pd_json_int(&s, c, "osl", 1, 1, 1, 1 << 30, &w.osl, e)) ||
        (rc = pd_json_num(&s, c, "cached", 0, 0, 0, 0.999, &w.cached, e)) ||
        (rc = pd_json_int(&s, c, "decode_ctx", 0, 0, 0, 1 << 30, &w.decode_ctx, e)) ||
        (rc = pd_json_int(&s, c, "decode_batch", 0, 0, 0, 1 << 20, &w.decode_batch, e)) ||
        (rc = pd_json_num(&s, c, "min_user_tokens_per_s", 0, 0, 0, 1e6, &min_user, e)) ||
        (rc = pd_json_num(&s, c, "imbalance", 0, 0, 1, 64, &imbalance, e)) ||
        (rc = pd_json_int(&s, c, "max_num_batched_tokens", 0, 4096, 1, PD_PLAN_MAX_BATCHED, &o.max_num_batched_tokens, e)) ||
        (rc = pd_json_int(&s, c, "max_num_seqs", 0, 256, 1, PD_PLAN_MAX_SEQS, &o.max_num_seqs, e)) ||
        (rc = pd_json_int(&s, c, "max_model_len", 0, 8192, 1, PD_PLAN_MAX_LEN, &o.max_model_len, e)) ||
        (rc = pd_json_str(&s, c, "phase", 0, "random", phase, sizeof phase, e)) ||
        (rc = pd_json_int(&s, c, "num_prompts", 0, 0, 0, 1 << 30, &w.num_prompts, e)) ||
        (rc = pd_json_int(&s, c, "prefill_max_requests", 0, 0, 0, 1 << 20, &w.prefill_max_requests, e)) ||
        (rc = pd_json_str(&s, c, "schedule", 0, "decode-first", sched, sizeof sched, e)) ||
        (rc = pd_json_i32(&s, c, "num_speculative_tokens", 0, 0, 0, 16, &o.spec_k, e)) ||
        (rc = pd_json_known(&s, c, known, e)))   /* (after them: a misspelt required field is missing) */
        return rc;
    o.max_model_len_given = json_object_get(c, "max_model_len") != NULL;
    if (o.spec_k && !mtp)
        return pd_err_set(e, PD_EINVAL, "%s: case \"%s\": field \"num_speculative_tokens\" needs \"mtp\": true", label,
                          v->name);
    if (strcmp(sched, "decode-first") != 0 && strcmp(sched, "prefill-first") != 0)
        return pd_err_set(e, PD_EINVAL, "%s: case \"%s\": field \"schedule\": expected decode-first or prefill-first, got "
                          "\"%s\"", label, v->name, sched);
    w.prefill_first = strcmp(sched, "prefill-first") == 0;
    if (strcmp(phase, "random") != 0 && strcmp(phase, "lockstep") != 0)
        return pd_err_set(e, PD_EINVAL, "%s: case \"%s\": field \"phase\": expected random or lockstep, got \"%s\"", label,
                          v->name, phase);
    w.lockstep = strcmp(phase, "lockstep") == 0;
    v->concurrency = w.concurrency;
    if (!is_metric(v->metric))
        return pd_err_set(e, PD_EINVAL, "%s: case \"%s\": field \"metric\": expected prefill_tokens_per_s_node, "
                          "decode_tokens_per_s_node, output_tokens_per_s or user_tokens_per_s, got \"%s\"", label,
                          v->name, v->metric);
    if (strcmp(v->metric, "output_tokens_per_s") == 0 && w.concurrency <= 0)
        return pd_err_set(e, PD_EINVAL, "%s: case \"%s\": metric output_tokens_per_s is the closed loop's: field "
                          "\"concurrency\" (clients) is required", label, v->name);
    if (pd_kv_parse_dtype(kvdt, &o.kv_dtype))
        return pd_err_set(e, PD_EINVAL, "%s: case \"%s\": field \"kv_cache_dtype\": expected fp8 or bf16", label, v->name);
    if (aggj) {
        /* colocated prefill and decode: the aggregated model (agg.c, lockstep.c) */
        if ((rc = role_opts(label, c, "aggregated", &o.role[PD_ROLE_DECODE], e)))
            return rc;
        o.aggregated = 1;
        const struct pd_role_opts *a = &o.role[PD_ROLE_DECODE];
        snprintf(v->layout, sizeof v->layout, "aggregated %d x DP%d TP%d (EP%d)", a->instances, a->dp, a->tp,
                 a->dp * a->tp);
    } else {
        if ((rc = role_opts(label, c, "prefill", &o.role[PD_ROLE_PREFILL], e)) ||
            (rc = role_opts(label, c, "decode", &o.role[PD_ROLE_DECODE], e)))
            return rc;
        snprintf(v->layout, sizeof v->layout, "P %d x EP%d, D %d x EP%d", o.role[0].instances,
                 o.role[0].dp * o.role[0].tp, o.role[1].instances, o.role[1].dp * o.role[1].tp);
    }
    o.model = model;
    o.hardware = hw;
    o.quant = quant;
    o.quant_override = qovr[0] ? qovr : NULL;
    o.mtp = mtp;
    if ((rc = pd_plan_stack_parse(stack, &o.stack, e))) {   /* whose KV layout the case's cards hold */
        pd_err_prefix(e, "%s: case \"%s\": field \"stack\": ", label, v->name);
        return rc;
    }
    struct pd_plan p;
    if ((rc = pd_plan_build(&o, &p, e))) {
        pd_err_prefix(e, "%s: case \"%s\": ", label, v->name);
        return rc;
    }
    v->arch = p.model.arch;
    const char *fam = pd_hardware_family(&p.hw);
    snprintf(v->family, sizeof v->family, "%s", fam ? fam : "");
    /* A publication that states its expert load (a profile with balanced routing) replaces
     * the hardware file's assumed imbalance for both roles. */
    for (int r = 0; r < 2 && imbalance > 0; r++)
        p.hw.eff.imbalance[r] = p.hw.eff.imbalance_eplb[r] = imbalance;
    v->imbalance = imbalance;
    v->cached = w.cached;
    rc = min_user > 0 ? batch_for_speed(&p, &w, min_user, &v->perf, e) : pd_perf_eval(&p, &w, &v->perf, e);
    if (!rc && w.lockstep && o.aggregated) {   /* the busiest rank's run, for the breakdown */
        struct pd_closed again;
        rc = pd_perf_lockstep(&p, &w, pd_perf_agg_slots(&p, &w), &again, &v->lock, e);
    }
    if (rc)
        pd_err_prefix(e, "%s: case \"%s\": ", label, v->name);
    if (!rc)
        snprintf(v->kv_layout, sizeof v->kv_layout, "%s", pd_kv_layout_name(&p.kv));
    if (!rc) {
        int cpn = p.hw.cards_per_node;
        const struct pd_perf *f = &v->perf;
        if (strcmp(v->metric, "prefill_tokens_per_s_node") == 0)
            v->predicted = f->prefill_tok_s_card * cpn;
        else if (strcmp(v->metric, "decode_tokens_per_s_node") == 0)
            v->predicted = f->decode_tok_s_card * cpn;
        else if (strcmp(v->metric, "output_tokens_per_s") == 0)
            v->predicted = f->closed.tok_s;
        else   /* user_tokens_per_s: at the closed loop's batch, else at the case's decode batch */
            v->predicted = w.concurrency > 0 ? 1 / f->closed.tpot_s : f->user_tok_s;
        v->error = v->predicted / v->published - 1;
    }
    pd_plan_free(&p);
    return rc;
}

int pd_validate_run(const char *text, const char *label, struct pd_valcase **out, int *n, pd_err *e)
{
    *out = NULL;
    *n = 0;
    json_t *root = pd_json_load_str(text, label, e);
    if (!root)
        return e ? e->code : PD_EFORMAT;
    json_t *cases = json_object_get(root, "cases");
    int rc = 0;
    if (!json_is_array(cases) || json_array_size(cases) == 0) {
        rc = pd_err_set(e, PD_EINVAL, "%s: field \"cases\": expected a non-empty array", label);
        goto out;
    }
    *out = calloc(json_array_size(cases), sizeof **out);
    if (!*out) {
        rc = pd_err_set(e, PD_ENOMEM, "%s: out of memory", label);
        goto out;
    }
    for (size_t i = 0; i < json_array_size(cases) && !rc; i++) {
        char where[300];
        snprintf(where, sizeof where, "%s: cases[%zu]", label, i);
        rc = run_case(json_array_get(cases, i), where, &(*out)[i], e);
        *n += rc == 0;
    }
    if (rc) {
        free(*out);
        *out = NULL;
        *n = 0;
    }
out:
    json_decref(root);
    return rc;
}

static const char *metric_title(const char *m)
{
    if (strcmp(m, "prefill_tokens_per_s_node") == 0)
        return "input tokens/s per node";
    if (strcmp(m, "decode_tokens_per_s_node") == 0)
        return "output tokens/s per node";
    if (strcmp(m, "output_tokens_per_s") == 0)
        return "output tokens/s, whole deployment";
    return "output tokens/s per user";
}

/* One step's terms, as the breakdown lines print them. */
static void step_terms(FILE *o, const struct pd_step *s)
{
    fprintf(o, "GEMM %.2f ms (arithmetic) + %.2f ms (weight reads), attention %.2f ms, dispatch/combine %.2f ms, "
               "overhead %.2f ms -> %.2f ms",
            s->gemm_compute_s * 1e3, s->gemm_memory_s * 1e3, s->attn_s * 1e3, s->a2a_s * 1e3, s->overhead_s * 1e3,
            s->total_s * 1e3);
}

char *pd_validate_markdown(const struct pd_valcase *c, int n)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *o = open_memstream(&buf, &len);
    if (!o)
        return NULL;
    fprintf(o, "| case | layout | metric | published | pdmoe | error | binding resource |\n");
    fprintf(o, "|---|---|---|---:|---:|---:|---|\n");
    for (int i = 0; i < n; i++) {
        int pre = strcmp(c[i].metric, "prefill_tokens_per_s_node") == 0;
        /* a '|' in a case's name would open a cell of its own */
        char cell[sizeof c[i].name * 2];
        size_t k = 0;
        for (const char *p = c[i].name; *p && k + 2 < sizeof cell; p++) {
            if (*p == '|')
                cell[k++] = '\\';
            cell[k++] = *p;
        }
        cell[k] = 0;
        fprintf(o, "| %s%s | %s | %s | %.0f | %.0f | %+.1f%% | %s |\n", cell,
                c[i].pending[0] ? " (pending)" : c[i].known_miss[0] ? " (known miss)" : "", c[i].layout,
                metric_title(c[i].metric), c[i].published, c[i].predicted, 100 * c[i].error,
                pd_bound_name(c[i].lock.steps > 0 ? c[i].lock.decode_step.bound   /* the loop's decode step */
                              : pre ? c[i].perf.prefill_bound : c[i].perf.decode_bound));
    }
    fprintf(o, "\nPer case: the publication, what pdmoe assumed where it is silent, and the model's terms.\n\n");
    for (int i = 0; i < n; i++) {
        const struct pd_perf *f = &c[i].perf;
        int pre = strcmp(c[i].metric, "prefill_tokens_per_s_node") == 0;
        const struct pd_step *s = pre ? &f->prefill_step : &f->decode_step;
        fprintf(o, "- **%s**. Source: %s.%s%s%s%s\n", c[i].name, c[i].source, c[i].assumed[0] ? " Assumed: " : "",
                c[i].assumed, c[i].known_miss[0] ? " **Known miss:** " : "", c[i].known_miss);
        if (c[i].concurrency > 0) {
            const struct pd_closed *k = &f->closed;
            fprintf(o, "  Closed loop of %lld clients, %s: TTFT %.1f ms, TPOT %.2f ms (%.1f tokens/s per user), "
                       "mean decode batch %.2f per DP rank, %.0f output tokens/s.\n",
                    (long long)c[i].concurrency, f->w.lockstep ? "in lockstep (lockstep.c)" : "at random phases (mean value analysis)",
                    k->ttft_s * 1e3, k->tpot_s * 1e3, 1 / k->tpot_s, k->batch, k->tok_s);
        }
        if (c[i].lock.steps > 0) {
            const struct pd_lockstep *l = &c[i].lock;
            fprintf(o, "  Busiest DP rank: %lld clients x %lld requests in %.2f s, %lld steps, %lld of them with prompt "
                       "tokens (%.2f s), decode-only %.2f s. First step (%lld prompt tokens): ",
                    (long long)l->clients, (long long)l->requests, l->duration_s, (long long)l->steps,
                    (long long)l->mixed_steps, l->mixed_s, l->decode_s, (long long)l->first_step.tokens);
            step_terms(o, &l->first_step);
            fprintf(o, ". Decode step of %lld sequences (%lld tokens): ", (long long)l->clients,
                    (long long)l->decode_step.tokens);
            step_terms(o, &l->decode_step);
            fprintf(o, ".\n");
        } else {
            fprintf(o, "  Step of one DP rank (%lld tokens): ", (long long)s->tokens);
            step_terms(o, s);
            if (!pre)
                fprintf(o, "; batch %lld per GPU, %.1f tokens/s per user", (long long)f->batch, f->user_tok_s);
            if (c[i].imbalance > 0)
                fprintf(o, "; busiest/mean expert load %.2f as published", c[i].imbalance);
            fprintf(o, ".\n");
        }
        if (c[i].pending[0])
            fprintf(o, "  **Pending:** %s\n", c[i].pending);
        if (pre && c[i].cached > 0)
            fprintf(o, "  Computed (uncached) tokens per node: published %.0f x (1 - %.3f) = %.0f, predicted %.0f: "
                       "the publication runs at %.2f of the predicted capacity.\n",
                    c[i].published, c[i].cached, c[i].published * (1 - c[i].cached),
                    c[i].predicted * (1 - c[i].cached), c[i].published / c[i].predicted);
    }
    fclose(o);
    return buf;
}

static json_t *step_obj(const struct pd_step *s)
{
    return json_pack("{s:I,s:f,s:f,s:f,s:f,s:f,s:f}", "tokens", (json_int_t)s->tokens, "gemm_compute_s", s->gemm_compute_s,
                     "gemm_memory_s", s->gemm_memory_s, "attention_s", s->attn_s, "a2a_s", s->a2a_s, "overhead_s",
                     s->overhead_s, "total_s", s->total_s);
}

void *pd_validate_json(const struct pd_valcase *c, int n)
{
    json_t *arr = json_array();
    for (int i = 0; arr && i < n; i++) {
        const char *status = c[i].pending[0] ? "pending" : c[i].known_miss[0] ? "known_miss" : "checked";
        json_t *o = json_pack("{s:s,s:s,s:s,s:s,s:f,s:f,s:f,s:b,s:s}", "name", c[i].name, "metric", c[i].metric,
                              "layout", c[i].layout, "status", status, "published", c[i].published, "predicted",
                              c[i].predicted, "error", c[i].error, "within_target", fabs(c[i].error) <= 0.25,
                              "reason", c[i].pending[0] ? c[i].pending : c[i].known_miss);
        if (!o)
            continue;
        json_object_set_new(o, "perf", pd_perf_json(&c[i].perf));
        json_object_set_new(o, "kv_layout", json_string(c[i].kv_layout));
        if (c[i].lock.steps > 0) {
            const struct pd_lockstep *l = &c[i].lock;
            json_object_set_new(o, "lockstep",
                                json_pack("{s:I,s:I,s:f,s:I,s:I,s:f,s:f,s:o,s:o}", "clients", (json_int_t)l->clients,
                                          "requests", (json_int_t)l->requests, "duration_s", l->duration_s, "steps",
                                          (json_int_t)l->steps, "prompt_steps", (json_int_t)l->mixed_steps,
                                          "prompt_steps_s", l->mixed_s, "decode_steps_s", l->decode_s, "first_step",
                                          step_obj(&l->first_step), "decode_step", step_obj(&l->decode_step)));
        }
        json_array_append_new(arr, o);
    }
    return arr;
}

/* The matching cases of pd_validate_vouch and how they fared. */
struct pd_val_fit {
    int n, idx[64];           /* the matching cases (indices into the run's array), at most 64 */
    int within, outside;      /* checked cases within 25% of their figure, and beyond it */
    int pending, known_miss;
    int slower;               /* pending or checked cases whose run was over 25% slower than predicted */
};

static const char *case_status(const struct pd_valcase *c)
{
    return c->pending[0] ? "pending" : c->known_miss[0] ? "known_miss" : "checked";
}

static void fit_cases(const struct pd_valcase *c, int n, enum pd_arch arch, const char *family, struct pd_val_fit *fit)
{
    *fit = (struct pd_val_fit){0};
    for (int i = 0; i < n && family && fit->n < (int)(sizeof fit->idx / sizeof fit->idx[0]); i++) {
        if (c[i].arch != arch || strcmp(c[i].family, family) != 0)
            continue;
        fit->idx[fit->n++] = i;
        int in = fabs(c[i].error) <= 0.25;
        if (c[i].pending[0])
            fit->pending++;
        else if (c[i].known_miss[0])
            fit->known_miss++;
        else if (in)
            fit->within++;
        else
            fit->outside++;
        /* a prediction above the published figure by more than the target: the run was slower */
        fit->slower += !c[i].known_miss[0] && c[i].error > 0.25;
    }
}

static char *fit_text(const struct pd_valcase *c, const struct pd_val_fit *fit, enum pd_arch arch, const char *family)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *o = open_memstream(&buf, &len);
    if (!o)
        return NULL;
    const char *a = pd_model_arch_name(arch);
    if (!fit->n) {
        fprintf(o, "  published runs: none of %s on %s: nothing checks this prediction on these cards (pdmoe "
                   "validate lists the runs that do exist)\n",
                a, family ? family : "these cards' make");
    } else {
        fprintf(o, "  published runs of %s on %s cards (pdmoe validate, docs/validation.md): %d; within 25%%: %d, "
                   "beyond: %d, pending (not met yet): %d, known misses: %d\n",
                a, family, fit->n, fit->within, fit->outside, fit->pending, fit->known_miss);
        for (int k = 0; k < fit->n; k++) {
            const struct pd_valcase *v = &c[fit->idx[k]];
            const char *st = case_status(v);
            fprintf(o, "    %-10s %+7.1f%%  %s: published %.0f, pdmoe %.0f %s\n",
                    strcmp(st, "known_miss") == 0 ? "known miss" : st, 100 * v->error, v->name, v->published,
                    v->predicted, metric_title(v->metric));
        }
        if (fit->slower)
            fprintf(o, "  %d of these runs %s over 25%% slower than the model predicts: on %s stack, read the TTFT, TPOT "
                       "and throughputs above as upper bounds, not as what it will do\n",
                    fit->slower, fit->slower == 1 ? "was" : "were", fit->slower == 1 ? "its" : "their");
    }
    fclose(o);
    return buf;
}

static json_t *fit_json(const struct pd_valcase *c, const struct pd_val_fit *fit, enum pd_arch arch, const char *family)
{
    json_t *cases = json_array();
    for (int k = 0; cases && k < fit->n; k++) {
        const struct pd_valcase *v = &c[fit->idx[k]];
        json_array_append_new(cases, json_pack("{s:s,s:s,s:s,s:f,s:f,s:f,s:b}", "name", v->name, "metric", v->metric,
                                               "status", case_status(v), "published", v->published, "predicted",
                                               v->predicted, "error", v->error, "within_target",
                                               fabs(v->error) <= 0.25));
    }
    return json_pack("{s:s,s:s?,s:o,s:i,s:i,s:i,s:i,s:i}", "arch", pd_model_arch_name(arch), "family", family,
                     "cases", cases, "within_target", fit->within, "beyond_target", fit->outside, "pending",
                     fit->pending, "known_miss", fit->known_miss, "slower_than_predicted", fit->slower);
}

int pd_validate_vouch(const struct pd_plan *p, char **text, void **json, pd_err *e)
{
    struct pd_valcase *c;
    int n, rc = pd_validate_run(pd_embedded_find("validation/published.json"), "validation/published.json", &c, &n, e);
    if (rc)
        return rc;
    struct pd_val_fit fit;
    const char *family = pd_hardware_family(&p->hw);
    fit_cases(c, n, p->model.arch, family, &fit);
    if (text)
        *text = fit_text(c, &fit, p->model.arch, family);
    if (json)
        *json = fit_json(c, &fit, p->model.arch, family);
    free(c);
    if ((text && !*text) || (json && !*json))
        return pd_err_set(e, PD_ENOMEM, "out of memory for the published runs");
    return 0;
}

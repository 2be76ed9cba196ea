/* The HTML report: self-contained (no external reference), memory bars drawn to scale, one
 * expert-map cell per slot, escaped input, the Pareto chart of a hand-made search, and a real
 * validator (tidy) finding no error or warning in the pages.
 *
 * PDMOE_HTML_OUT=dir keeps the pages this suite renders (seed.html, search.html, over.html) for
 * tests/html/screenshot.sh; PDMOE_REQUIRE_TIDY=1 turns a missing tidy into a failure. */
#define _GNU_SOURCE   /* memmem */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/units.h"
#include "plan/html.h"
#include "fixture.h"


static char *render(const struct pd_plan *p, const struct pd_perf *f, const struct pd_search *s, int u,
                    const char *keep)
{
    pd_err e = {0};
    char *h = pd_report_html(p, f, s, u, &e);
    cr_assert_not_null(h, "%s", e.msg);
    const char *dir = getenv("PDMOE_HTML_OUT");
    if (dir && keep) {
        char path[512];
        snprintf(path, sizeof path, "%s/%s", dir, keep);
        FILE *out = fopen(path, "w");
        cr_assert_not_null(out, "cannot write %s", path);
        fputs(h, out);
        fclose(out);
    }
    return h;
}

/* A copy of the text from `open` to the first `close` after it (NULL if `open` is absent). */
static char *section(const char *h, const char *open, const char *close)
{
    const char *a = strstr(h, open);
    if (!a)
        return NULL;
    const char *b = strstr(a, close);
    cr_assert_not_null(b, "no %s after %s", close, open);
    return strndup(a, (size_t)(b - a) + strlen(close));
}

static int count(const char *h, const char *needle)
{
    int n = 0;
    for (const char *q = strstr(h, needle); q; q = strstr(q + 1, needle))
        n++;
    return n;
}

/* Attribute `name` of the tag starting at `tag` as a number. */
static double attr(const char *tag, const char *name)
{
    const char *end = strchr(tag, '>');
    char key[64];
    snprintf(key, sizeof key, " %s=\"", name);
    const char *a = strstr(tag, key);
    cr_assert(a && a < end, "tag %.60s has no %s", tag, name);
    return strtod(a + strlen(key), NULL);
}

/* The only absolute URL allowed is the SVG namespace; no script, no link, no url() but #ids. */
static void self_contained(const char *h)
{
    cr_assert_eq(strncmp(h, "<!DOCTYPE html>", 15), 0);
    static const char ns[] = "xmlns=\"http://www.w3.org/2000/svg\"";
    for (const char *q = strstr(h, "http"); q; q = strstr(q + 1, "http")) {
        cr_assert(q - h >= 7 && strncmp(q - 7, ns, sizeof ns - 1) == 0, "external reference at: %.60s", q);
    }
    cr_assert_null(strstr(h, "<script"));
    cr_assert_null(strstr(h, "<link"));
    cr_assert_null(strstr(h, "<img"));
    cr_assert_null(strstr(h, "@import"));
    cr_assert_null(strstr(h, " src=\""));
    cr_assert_null(strstr(h, " href=\""));
    for (const char *q = strstr(h, "url("); q; q = strstr(q + 1, "url("))
        cr_assert_eq(q[4], '#', "url() to something other than an id: %.40s", q);
}

/* Parses role r's bar back: every segment's width against its bytes on the frame's scale. */
static void check_bar(const char *h, const struct pd_plan *p, int r)
{
    char open[64];
    snprintf(open, sizeof open, "<g class=\"bar\" id=\"bar-%s\">", pd_role_name((enum pd_role)r));
    char *g = section(h, open, "</g>");
    cr_assert_not_null(g, "no bar for %s", pd_role_name((enum pd_role)r));
    const struct pd_budget *b = &p->role[r].b;
    const char *cap = strstr(g, "<rect class=\"cap\"");
    cr_assert_not_null(cap);
    cr_assert_eq((int64_t)attr(cap, "data-bytes"), b->capacity);
    double scale = attr(cap, "width") / (double)b->capacity;
    struct {
        const char *cls;
        int64_t want;
        int seen;
    } exp[] = {
        {"ci", b->class_i, 0}, {"cii", b->class_ii, 0}, {"kv", b->kv_pool, 0}, {"act", b->activations, 0},
        {"rt", b->runtime, 0}, {"res", b->capacity - b->usable, 0}, {"over", -b->kv_pool, 0},
    };
    int64_t sum = 0;
    for (const char *q = strstr(g, "<rect class=\"seg "); q; q = strstr(q + 1, "<rect class=\"seg ")) {
        const char *c = q + strlen("<rect class=\"seg ");
        size_t n = strcspn(c, "\"");
        int64_t bytes = (int64_t)attr(q, "data-bytes");
        double w = attr(q, "width");
        cr_assert(fabs(w - (double)bytes * scale) <= 1.0, "%s segment %.*s: width %.2f px for %lld bytes, "
                  "want %.2f", pd_role_name((enum pd_role)r), (int)n, c, w, (long long)bytes, (double)bytes * scale);
        int found = 0;
        for (size_t i = 0; i < sizeof exp / sizeof exp[0]; i++)
            if (strlen(exp[i].cls) == n && !strncmp(c, exp[i].cls, n)) {
                cr_assert_eq(bytes, exp[i].want, "segment %s: %lld bytes, want %lld", exp[i].cls, (long long)bytes,
                             (long long)exp[i].want);
                exp[i].seen++;
                found = 1;
            }
        cr_assert(found, "unknown segment %.*s", (int)n, c);
        if (strncmp(c, "over", 4))
            sum += bytes;
    }
    for (size_t i = 0; i < sizeof exp / sizeof exp[0]; i++) {
        int want = !strcmp(exp[i].cls, "kv") ? b->kv_pool >= 0 : !strcmp(exp[i].cls, "over") ? b->kv_pool < 0 : 1;
        cr_assert_eq(exp[i].seen, want, "%s: segment %s drawn %d times", pd_role_name((enum pd_role)r), exp[i].cls,
                     exp[i].seen);
    }
    if (b->kv_pool >= 0) /* the segments tile the card */
        cr_assert_eq(sum, b->capacity);
    free(g);
}

/* Role r's expert map: one cell per slot, `reps` of them redundant copies. */
static void check_map(const char *h, const struct pd_plan *p, int r, int reps)
{
    char open[64];
    snprintf(open, sizeof open, "id=\"map-%s\"", pd_role_name((enum pd_role)r));
    char *m = section(h, open, "</svg>");
    cr_assert_not_null(m, "no map for %s", pd_role_name((enum pd_role)r));
    const struct pd_placement *pl = &p->role[r].place;
    int cells = count(m, "<rect class=\"x\"") + count(m, "<rect class=\"x rep\"");
    cr_assert_eq(cells, pl->ep * pl->slots, "%s map: %d cells, want %d x %d", pd_role_name((enum pd_role)r), cells,
                 pl->ep, pl->slots);
    cr_assert_eq(count(m, "<rect class=\"x rep\""), reps);
    /* the SVG stays a page's size however many cells */
    cr_assert_leq(attr(m, "width"), 900);
    cr_assert_leq(attr(m, "height"), 900);
    free(m);
}

/* Whether tidy can run; a failure when it cannot and PDMOE_REQUIRE_TIDY is set. */
static int have_tidy(void)
{
    if (system("command -v tidy >/dev/null 2>&1") == 0)
        return 1;
    cr_assert_null(getenv("PDMOE_REQUIRE_TIDY"), "tidy is not installed (setup.sh installs it)");
    return 0;
}

/* tidy's verdict on a page: fails on any error or warning. Without tidy the page's other checks
 * still count; only html_tidy_finds_no_error reports itself skipped. */
static void tidy_clean(const char *h, const char *what)
{
    if (!have_tidy()) {
        cr_log_warn("tidy is not installed: the %s page is not validated", what);
        return;
    }
    char path[] = "/tmp/pdmoe-html-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    FILE *out = fdopen(fd, "w");
    fputs(h, out);
    fclose(out);
    char cmd[600], log[8192] = "";
    snprintf(cmd, sizeof cmd, "tidy -errors -quiet %s 2>&1", path);
    FILE *t = popen(cmd, "r");
    cr_assert_not_null(t);
    size_t n = fread(log, 1, sizeof log - 1, t);
    log[n] = 0;
    int st = pclose(t);
    unlink(path);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0 && n == 0, "tidy on the %s page (exit %d):\n%s", what,
              WIFEXITED(st) ? WEXITSTATUS(st) : -1, log);
}

Test(plan, html_seed_plan)
{
    struct pd_plan p;
    seed_plan(&p);
    char *h = render(&p, NULL, NULL, PD_UNITS_GIB, "seed.html");
    self_contained(h);
    cr_assert_eq(count(h, "<g class=\"bar\""), 2);
    for (int r = 0; r < 2; r++) {
        check_bar(h, &p, r);
        check_map(h, &p, r, 0);
    }
    /* the seed's decode group: rank 31 holds experts 248-255 */
    cr_assert_not_null(strstr(h, "rank 31, slot 0: expert 248<"));
    cr_assert_not_null(strstr(h, "deepseek-v4-flash"));
    cr_assert_not_null(strstr(h, "GiB = 2<sup>30</sup> bytes"));
    cr_assert_null(strstr(h, " GB<"), "a figure in GB in a GiB report");
    cr_assert_null(strstr(h, "id=\"pareto\""));
    cr_assert_null(strstr(h, "Predicted performance"));
    cr_assert_null(strstr(h, "OVER CAPACITY"));
    free(h);
    h = render(&p, NULL, NULL, PD_UNITS_GB, NULL);
    cr_assert_not_null(strstr(h, "GB = 10<sup>9</sup> bytes"));
    cr_assert_null(strstr(h, " GiB<"));
    for (int r = 0; r < 2; r++)
        check_bar(h, &p, r);
    free(h);
    pd_plan_free(&p);
}

Test(plan, html_redundant_copies_and_big_maps)
{
    struct pd_plan_opts o;
    struct pd_plan p;
    pd_plan_opts_default(&o);
    o.role[PD_ROLE_DECODE].redundant = 32; /* 288 slots over 32 ranks */
    build(&o, &p);
    char *h = render(&p, NULL, NULL, PD_UNITS_GB, NULL);
    check_map(h, &p, PD_ROLE_DECODE, 32);
    check_map(h, &p, PD_ROLE_PREFILL, 0);
    free(h);
    pd_plan_free(&p);

    /* one rank holding all 256 experts, and 256 ranks of one expert each */
    pd_plan_opts_default(&o);
    o.nodes = 33;
    o.role[PD_ROLE_PREFILL] = (struct pd_role_opts){.dp = 1, .tp = 1, .instances = 8, .redundant = 0};
    o.role[PD_ROLE_DECODE] = (struct pd_role_opts){.dp = 256, .tp = 1, .instances = 1, .redundant = 0};
    build(&o, &p);
    h = render(&p, NULL, NULL, PD_UNITS_GB, NULL);
    check_map(h, &p, PD_ROLE_PREFILL, 0);
    check_map(h, &p, PD_ROLE_DECODE, 0);
    self_contained(h);
    tidy_clean(h, "256-rank");
    free(h);
    pd_plan_free(&p);
}

Test(plan, html_kv_pool_over_capacity)
{
    struct pd_plan_opts o;
    struct pd_plan p;
    pd_plan_opts_default(&o);
    o.runtime[PD_ROLE_DECODE] = 70000000000; /* more than the whole 64 GiB card */
    build(&o, &p);
    cr_assert_lt(p.role[PD_ROLE_DECODE].b.kv_pool, 0);
    char *h = render(&p, NULL, NULL, PD_UNITS_GIB, "over.html");
    self_contained(h);
    for (int r = 0; r < 2; r++)
        check_bar(h, &p, r);
    char *g = section(h, "<g class=\"bar\" id=\"bar-decode\">", "</g>");
    cr_assert_not_null(strstr(g, "OVER CAPACITY"));
    cr_assert_not_null(strstr(g, "class=\"warn\""));
    free(g);
    cr_assert_not_null(strstr(h, "(over capacity)</td>"));
    cr_assert_not_null(strstr(h, "<span class=\"bad\">does not fit</span>"));
    tidy_clean(h, "over-capacity");
    free(h);
    pd_plan_free(&p);
}

Test(plan, html_input_is_escaped)
{
    struct pd_plan p;
    seed_plan(&p);
    snprintf(p.model.name, sizeof p.model.name, "<script>alert(\"x\")</script>&'");
    snprintf(p.hw.name, sizeof p.hw.name, "a<b>c");
    snprintf(p.hw.rdma.name, sizeof p.hw.rdma.name, "<img src=x>");
    char *h = render(&p, NULL, NULL, PD_UNITS_GB, NULL);
    cr_assert_null(strstr(h, "<script"));
    cr_assert_null(strstr(h, "<b>"));
    cr_assert_null(strstr(h, "<img"));
    cr_assert_not_null(strstr(h, "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;&#39;"));
    cr_assert_not_null(strstr(h, "a&lt;b&gt;c"));
    self_contained(h);
    tidy_clean(h, "escaped");
    free(h);
    pd_plan_free(&p);
}

/* Six layouts: four fit, two meet the targets (TTFT 1 s, TPOT 50 ms); the front is 1, 3, 4. */
static struct pd_layout L[6];
static int FRONT[3] = {1, 3, 4};

static void fake_search(struct pd_search *s)
{
    memset(s, 0, sizeof *s);
    s->o.cards = 64;
    s->o.w.isl = 4096;
    s->o.w.osl = 1024;
    s->o.ttft_s = 1.0;
    s->o.tpot_s = 0.050;
    /*          P inst dp  D inst dp  batch ttft  tpot   tok/s/card fits meets */
    static const double row[6][10] = {
        {4, 8, 1, 32, 64, 0.60, 0.080, 300, 1, 0},
        {4, 8, 1, 32, 32, 0.60, 0.060, 420, 1, 0},
        {2, 8, 1, 16, 16, 1.50, 0.045, 150, 1, 0},
        {4, 8, 1, 32, 16, 0.70, 0.040, 380, 1, 1},
        {4, 8, 2, 16, 8, 0.80, 0.025, 260, 1, 1},
        {8, 8, 1, 32, 8, 0.30, 0.020, 900, 0, 0},
    };
    memset(L, 0, sizeof L);
    for (int i = 0; i < 6; i++) {
        struct pd_layout *l = &L[i];
        l->role[0] = (struct pd_role_opts){.dp = (int)row[i][1], .tp = 1, .instances = (int)row[i][0]};
        l->role[1] = (struct pd_role_opts){.dp = (int)row[i][3], .tp = 1, .instances = (int)row[i][2]};
        l->batch = (int64_t)row[i][4];
        l->cards = l->role[0].dp * l->role[0].instances + l->role[1].dp * l->role[1].instances;
        l->ttft_s = row[i][5];
        l->tpot_s = row[i][6];
        l->user_tok_s = 1 / l->tpot_s;
        l->tok_s_card = row[i][7];
        l->fits = (int)row[i][8];
        l->meets = (int)row[i][9];
        l->sustains = 1;   /* no request rate */
        l->prefill_bound = PD_BOUND_COMPUTE;
        l->decode_bound = PD_BOUND_MEMORY;
    }
    for (int j = 0; j < 3; j++)
        L[FRONT[j]].pareto = 1;
    s->l = L;
    s->n = s->cap = 6;
    s->front = FRONT;
    s->n_front = 3;
    s->best = 3;
    s->best_any = 1;
    s->n_fit = 5;
    s->n_meet = 2;
}

static void fake_perf(struct pd_perf *f)
{
    memset(f, 0, sizeof *f);
    pd_workload_default(&f->w);
    f->prefill_s = 0.300;
    f->handoff_s = 0.050;
    f->ttft_s = 0.390;
    f->tpot_s = 0.040;
    f->user_tok_s = 25;
    f->tokens_per_step = 1.8;
    f->batch = 16;
    f->batch_cap = 30;
    f->prefill_tok_s_card = 5000;
    f->decode_tok_s_card = 700;
    f->tok_s_card = 380;
    f->prefill_req_s = 40;
    f->decode_req_s = 12;
    f->req_s = 12;
    f->prefill_bound = PD_BOUND_COMPUTE;
    f->decode_bound = PD_BOUND_MEMORY;
    f->prefill_step = (struct pd_step){.tokens = 8192, .gemm_compute_s = 0.2, .total_s = 0.25, .bound = PD_BOUND_COMPUTE};
    f->decode_step = (struct pd_step){.tokens = 32, .gemm_memory_s = 0.02, .total_s = 0.07, .bound = PD_BOUND_MEMORY};
    f->fits = 1;
}

Test(plan, html_search_and_prediction)
{
    struct pd_plan p;
    struct pd_search s;
    struct pd_perf f;
    seed_plan(&p);
    fake_search(&s);
    fake_perf(&f);
    char *h = render(&p, &f, &s, PD_UNITS_GB, "search.html");
    self_contained(h);
    for (int r = 0; r < 2; r++) {
        check_bar(h, &p, r);
        check_map(h, &p, r, 0);
    }
    char *c = section(h, "id=\"pareto\"", "</svg>");
    cr_assert_not_null(c);
    /* every fitting layout a dot: three grey, two meeting the targets; the unfit one absent */
    cr_assert_eq(count(c, "<circle class=\"pt\""), 3);
    cr_assert_eq(count(c, "<circle class=\"pt meet\""), 2);
    cr_assert_eq(count(c, "<circle class=\"fp\""), 3);
    char *line = section(c, "<polyline class=\"front\" points=\"", "\"/>");
    cr_assert_eq(count(line, ","), 3, "%s", line);
    free(line);
    /* the chosen layout, ringed at its point and labelled */
    const char *ring = strstr(c, "<circle class=\"chosen\"");
    cr_assert_not_null(ring);
    cr_assert_eq(count(c, "<circle class=\"chosen\""), 1);
    double cx = attr(ring, "cx"), cy = attr(ring, "cy");
    int at_point = 0;
    for (const char *q = strstr(c, "<circle class=\"pt meet\""); q; q = strstr(q + 1, "<circle class=\"pt meet\""))
        at_point |= fabs(attr(q, "cx") - cx) < 0.01 && fabs(attr(q, "cy") - cy) < 0.01;
    cr_assert(at_point, "the ring is not on a layout meeting the targets");
    cr_assert_not_null(strstr(c, "chosen: P 4&times;DP8&times;TP1 (EP&nbsp;8), D 1&times;DP32&times;TP1 (EP&nbsp;32), batch 16"));
    /* the TPOT target at 20 tokens/s per user, and axes with units */
    cr_assert_not_null(strstr(c, "TPOT target 50.0 ms: 20.0 tokens/s per user"));
    cr_assert_not_null(strstr(c, "<line class=\"target\""));
    cr_assert_not_null(strstr(c, ">tokens/s per user (1 / TPOT)<"));
    cr_assert_not_null(strstr(c, ">output tokens/s per card<"));
    free(c);
    /* the front's table: a header and three rows, the chosen one marked */
    char *t = section(h, "<table id=\"front\">", "</table>");
    cr_assert_eq(count(t, "<tr"), 4);
    cr_assert_eq(count(t, "<tr class=\"chosen\">"), 1);
    cr_assert_not_null(strstr(t, ">40.0 ms<"));
    cr_assert_not_null(strstr(t, pd_bound_name(PD_BOUND_MEMORY)));
    free(t);
    t = section(h, "<table id=\"best\">", "</table>");
    cr_assert_not_null(strstr(t, "(the search's choice)"));
    /* TPOT <= 30 ms with TTFT <= 1 s: layout 4 (the 20 ms one does not fit) */
    cr_assert_not_null(strstr(t, "TPOT &le; 30.0 ms, TTFT &le; 1000.0 ms</td><td>P 4&times;DP8&times;TP1 (EP&nbsp;8), "
                                 "D 2&times;DP16&times;TP1"));
    cr_assert_not_null(strstr(t, "TPOT &le; 10.0 ms, TTFT &le; 1000.0 ms</td><td colspan=\"8\">no layout"));
    free(t);
    /* the prediction */
    t = section(h, "<table id=\"perf\">", "</table>");
    cr_assert_not_null(t);
    cr_assert_not_null(strstr(t, "TTFT (queue-free)</td><td class=\"n\">390.0 ms<"));
    cr_assert_not_null(strstr(t, "300.0 ms"));
    cr_assert_not_null(strstr(t, "50.0 ms"));
    cr_assert_not_null(strstr(t, "first decode step</td><td class=\"n\">40.0 ms<"));
    cr_assert_not_null(strstr(t, pd_bound_name(PD_BOUND_COMPUTE)));
    free(t);
    /* the published runs of the seed's model on Ascend cards, as plan's text gives them */
    t = section(h, "<pre id=\"published\">", "</pre>");
    cr_assert_not_null(t, "no published runs under the prediction");
    cr_assert_not_null(strstr(t, "published runs of deepseek_v4 on Ascend cards"), "%s", t);
    cr_assert_not_null(strstr(t, "pending     +350.4%  SGLang CI, DeepSeek-V4-Flash W8A8 on one Atlas 800I A3"), "%s", t);
    free(t);
    tidy_clean(h, "search");
    free(h);

    /* nothing meets the targets: the best fitting layout is marked instead */
    s.best = -1;
    h = render(&p, NULL, &s, PD_UNITS_GB, NULL);
    cr_assert_not_null(strstr(h, "best (none meets the targets): P 4&times;DP8&times;TP1 (EP&nbsp;8), D 1&times;DP32&times;TP1 (EP&nbsp;32), batch 32"));
    cr_assert_not_null(strstr(h, "no layout meets the targets"));
    tidy_clean(h, "no-best");
    free(h);
    pd_plan_free(&p);
}

Test(plan, html_tidy_finds_no_error)
{
    struct pd_plan_opts o;
    struct pd_plan p;
    pd_plan_opts_default(&o);
    o.sweep = 1;
    build(&o, &p);
    if (!have_tidy()) {
        pd_plan_free(&p);
        cr_skip_test("tidy is not installed");
    }
    char *h = render(&p, NULL, NULL, PD_UNITS_GIB, NULL);
    tidy_clean(h, "seed");
    free(h);
    pd_plan_free(&p);
}

/* A real search's report agrees with its text: the same TPOT targets with the same layouts (the
 * text once read 10/20/50/100/200 ms, the report 10/20/30/50/100); the "capacity" mark's label
 * fits inside the memory drawing; the KV reads of a decode step are shown even when arithmetic
 * sets the attention time (they read 0.0 ms then). */
Test(plan, html_search_report_agrees_with_the_text)
{
    struct pd_search_opts o;
    struct pd_search s;
    pd_search_opts_default(&o);
    o.ttft_s = 2.0;
    o.tpot_s = 0.05;
    pd_err e = {0};
    cr_assert_eq(pd_search_run(&o, &s, &e), 0, "%s", e.msg);
    char *text = pd_search_text(&s, PD_UNITS_GB);
    char *h = render(&s.plan, &s.perf, &s, PD_UNITS_GB, NULL);
    char *best = section(h, "<table id=\"best\">", "</table>");
    double t[PD_SEARCH_MAX_TPOTS];
    int nt = pd_search_tpot_targets(&s, t);
    cr_assert_eq(nt, 6);   /* 10 20 30 50 100 200 ms, the 50 ms target among them */
    for (int i = 0; i < nt; i++) {
        char want_t[64], want_h[96];
        snprintf(want_t, sizeof want_t, "  TPOT <= %.1f ms:\n", t[i] * 1e3);
        cr_assert(strstr(text, want_t), "the text lacks %s", want_t);
        snprintf(want_h, sizeof want_h, "<td>TPOT &le; %.1f ms, TTFT &le; 2000.0 ms</td>", t[i] * 1e3);
        const char *row = strstr(best, want_h);
        cr_assert(row, "the report lacks %s", want_h);
        int k = pd_search_best_under(&s, t[i]);
        const char *text_row = strstr(text, want_t) + strlen(want_t);
        if (k < 0) {
            cr_assert_eq(strncmp(text_row, "     none\n", 10), 0);
            cr_assert_eq(strncmp(row + strlen(want_h), "<td colspan=\"8\">no layout", 25), 0);
        } else {
            char card[32];   /* the row's output tokens/s per card, as both print it */
            snprintf(card, sizeof card, "%.0f", s.l[k].tok_s_card);
            const char *eol = strchr(text_row, '\n'), *eor = strstr(row, "</tr>");
            cr_assert(memmem(text_row, (size_t)(eol - text_row), card, strlen(card)), "text %.*s lacks %s",
                      (int)(eol - text_row), text_row, card);
            cr_assert(memmem(row, (size_t)(eor - row), card, strlen(card)), "report row lacks %s", card);
        }
    }
    free(best);
    /* the capacity label: about 7 px a character at the drawing's 12 px font, inside the svg */
    char *svg = section(h, "<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"membars\"", ">");
    double width = attr(svg, "width");
    free(svg);
    const char *cap = strstr(h, ">capacity</text>");
    cr_assert_not_null(cap);
    const char *tag = cap;
    while (tag > h && strncmp(tag, "<text", 5))
        tag--;
    cr_assert_geq(width - attr(tag, "x"), 8 * 7, "\"capacity\" at x %.1f of a %.0f px drawing", attr(tag, "x"), width);
    /* KV reads alone in the steps table: nonzero for decode, the perf model's own figure */
    char *steps = section(h, "<table id=\"steps\">", "</table>");
    cr_assert_gt(s.perf.decode_step.attn_kv_read_s, 0);
    char want[64];
    snprintf(want, sizeof want, "<td class=\"n\">%.1f ms</td>", s.perf.decode_step.attn_kv_read_s * 1e3);
    const char *dec = strstr(steps, "decode (mean context)");
    cr_assert(dec && strstr(dec, want), "no %s in %s", want, dec ? dec : steps);
    free(steps);
    free(h);
    free(text);
    pd_search_free(&s);
}

/* The self-contained HTML report: one page of inline CSS and inline SVG drawn from a plan, and
 * optionally a performance prediction and a layout search. Only numbers the plan, perf and
 * search modules computed are drawn; nothing is recomputed here but geometry. Every string that
 * comes from input (model, hardware, link names, paths) goes through esc(). */
#include "plan/html.h"
#include "plan/validate.h"
#include "core/units.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* --- small writers --- */

static void esc(FILE *f, const char *s)
{
    for (; s && *s; s++) {
        switch (*s) {
        case '&': fputs("&amp;", f); break;
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '"': fputs("&quot;", f); break;
        case '\'': fputs("&#39;", f); break;
        default: fputc(*s, f);
        }
    }
}

static const char *G(char *buf, int64_t bytes, int u)
{
    return pd_units_fmt_g(buf, 32, bytes, (enum pd_units)u, 2);
}

static const char *B(char *buf, int64_t bytes, int u)
{
    return pd_units_fmt(buf, 32, bytes, (enum pd_units)u);
}

/* A rate or count for a table: whole numbers from 100 up, one decimal below. */
static const char *num(char *buf, double v)
{
    if (!isfinite(v))
        snprintf(buf, 32, "&infin;");
    else
        snprintf(buf, 32, fabs(v) >= 100 ? "%.0f" : "%.1f", v);
    return buf;
}

static const char *ms(char *buf, double s)
{
    if (!isfinite(s))
        snprintf(buf, 32, "&infin;");
    else
        snprintf(buf, 32, "%.1f ms", s * 1e3);
    return buf;
}

/* "4 &times; DP8 &times; TP1 (EP 8)": instances x data-parallel x tensor-parallel, and the EP group. */
static const char *layout(char *buf, size_t n, const struct pd_role_opts *o)
{
    snprintf(buf, n, "%d&times;DP%d&times;TP%d (EP&nbsp;%d)", o->instances, o->dp, o->tp, o->dp * o->tp);
    return buf;
}

/* Axis steps of 1, 2 or 5 x 10^k giving about `ticks` intervals up to max. */
static double nice_step(double max, int ticks)
{
    if (!(max > 0))
        return 1;
    double raw = max / ticks, mag = pow(10, floor(log10(raw))), r = raw / mag;
    return (r <= 1 ? 1 : r <= 2 ? 2 : r <= 5 ? 5 : 10) * mag;
}

/* Expert colours: hue over 0..300 degrees (red to magenta, so the last expert is not the
 * first's colour again), light enough for black text. */
static void expert_colour(char *buf, int id, int n)
{
    double h = 300.0 * id / (n > 1 ? n - 1 : 1), s = 0.70, l = 0.62;
    double c = (1 - fabs(2 * l - 1)) * s, hp = h / 60, x = c * (1 - fabs(fmod(hp, 2) - 1)), m = l - c / 2;
    double r = 0, g = 0, b = 0;
    if (hp < 1) r = c, g = x;
    else if (hp < 2) r = x, g = c;
    else if (hp < 3) g = c, b = x;
    else if (hp < 4) g = x, b = c;
    else if (hp < 5) r = x, b = c;
    else r = c, b = x;
    snprintf(buf, 8, "#%02x%02x%02x", (int)lround((r + m) * 255), (int)lround((g + m) * 255),
             (int)lround((b + m) * 255));
}

static const char CSS[] =
    "body{font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;color:#222;margin:24px auto;"
    "max-width:1040px;padding:0 16px;line-height:1.4}\n"
    "h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.2em;margin-top:1.8em;border-bottom:1px solid #ccc}\n"
    "h3{font-size:1em;margin-bottom:.3em}\n"
    "table{border-collapse:collapse;margin:.5em 0 1em;font-size:.9em}\n"
    "th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}\n"
    "th{background:#f2f2f2}td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}\n"
    "tr.chosen td{background:#fde8e8;font-weight:600}\n"
    ".bad{color:#c00;font-weight:700}.note{color:#555;font-size:.9em}\n"
    "svg{display:block;margin:.5em 0;max-width:100%;height:auto}\n"
    "svg text{font-family:inherit;font-size:11px;fill:#222}\n"
    ".sw{display:inline-block;width:14px;height:14px;border:1px solid #555;vertical-align:middle}\n"
    ".ci{fill:#4e79a7;background:#4e79a7}.cii{fill:#a0cbe8;background:#a0cbe8}.kv{fill:#59a14f;background:#59a14f}\n"
    ".act{fill:#f28e2b;background:#f28e2b}.rt{fill:#b07aa1;background:#b07aa1}\n"
    ".res{fill:#d9d9d9;background:#d9d9d9}.over{fill:url(#overhatch);stroke:#c00;stroke-width:2}\n"
    "span.over{background:repeating-linear-gradient(45deg,#c00 0 3px,#fff 3px 6px);border-color:#c00}\n"
    ".cap{fill:none;stroke:#222;stroke-width:1}.seg{stroke:#fff;stroke-width:.5}\n"
    ".usable{stroke:#222;stroke-dasharray:4 3}.axis{stroke:#444}.grid{stroke:#e4e4e4}\n"
    "text.in{fill:#fff;font-size:10px}text.dark{fill:#222}text.warn{fill:#c00;font-weight:700}\n"
    ".x{stroke:none}.rep{stroke:#000;stroke-width:2}text.id{font-size:8px}\n"
    ".pt{fill:#b5b5b5}.meet{fill:#1f77b4}.front{fill:none;stroke:#2ca02c;stroke-width:2}.fp{fill:#2ca02c}\n"
    ".chosen{fill:none;stroke:#d62728;stroke-width:2.5}.target{stroke:#ff7f0e;stroke-width:1.5;stroke-dasharray:6 4}\n"
    "text.lab{fill:#d62728;font-weight:700;paint-order:stroke;stroke:#fff;stroke-width:3px}text.tgt{fill:#c25a00}\n";

/* --- 1. summary --- */

static void summary(FILE *f, const struct pd_plan *p, const struct pd_search *s, int u)
{
    char a[64], b[64], q[128];
    fprintf(f, "<h1>pdmoe plan: ");
    esc(f, p->model.name);
    fprintf(f, " on ");
    esc(f, p->hw.name);
    fprintf(f, "</h1>\n<table>\n<tr><th>Model</th><td>");
    esc(f, p->model.name);
    fprintf(f, " (");
    esc(f, pd_model_arch_name(p->model.arch));
    fprintf(f, "), %d routed experts, %d per token; from ", p->model.n_routed_experts, p->model.n_experts_per_tok);
    esc(f, p->model.source);
    fprintf(f, "</td></tr>\n<tr><th>Hardware</th><td>");
    esc(f, p->hw.name);
    fprintf(f, ": %d nodes &times; %d ", p->nodes, p->hw.cards_per_node);
    esc(f, p->hw.card_name);
    fprintf(f, ", %s per card; %d of %d cards used</td></tr>\n", G(a, p->hw.card_memory_bytes, u), p->cards_used,
            p->cards_total);
    for (int r = 0; r < 2; r++) {
        const struct pd_role_plan *rp = &p->role[r];
        fprintf(f, "<tr><th>%s layout</th><td>%d instance%s &times; DP %d &times; TP %d: EP size %d, %d cards, "
                   "%d experts per card (%d redundant per EP group)</td></tr>\n",
                r == PD_ROLE_PREFILL ? "Prefill (P)" : "Decode (D)", rp->o.instances, rp->o.instances == 1 ? "" : "s",
                rp->o.dp, rp->o.tp, rp->ep, rp->cards, rp->place.slots, rp->o.redundant);
    }
    fprintf(f, "<tr><th>Quantisation</th><td>");
    esc(f, p->inv.from_checkpoint ? "as stored in the checkpoint" : pd_quant_describe(&p->quant, q, sizeof q));
    fprintf(f, "</td></tr>\n<tr><th>KV cache</th><td>%s", pd_kv_dtype_name(p->kv.dtype));
    fprintf(f, "; MTP layer %s</td></tr>\n", p->include_mtp ? "loaded" : "not loaded");
    fprintf(f, "<tr><th>Serving options</th><td>gpu-memory-utilization %.2f, max-num-seqs %lld, max-model-len %s "
               "tokens, max-num-batched-tokens %s tokens</td></tr>\n",
            p->o.util, (long long)p->o.max_num_seqs, pd_units_thousands(a, p->o.max_model_len),
            pd_units_thousands(b, p->o.max_num_batched_tokens));
    fprintf(f, "<tr><th>Units</th><td>%s = %s bytes</td></tr>\n", pd_units_g_name((enum pd_units)u),
            u == PD_UNITS_GIB ? "2<sup>30</sup>" : "10<sup>9</sup>");
    for (int r = 0; r < 2; r++) {
        const struct pd_role_plan *rp = &p->role[r];
        fprintf(f, "%s%s card: %s", r ? "; " : "<tr><th>Verdict</th><td>", r ? "decode" : "prefill",
                rp->fits_max_num_seqs ? "max-num-seqs sequences of max-model-len fit"
                : r == PD_ROLE_PREFILL && pd_plan_prefill_lowered(p) ? "one max-model-len sequence fits; launched with "
                                                                       "the sequences that fit"
                : rp->fits ? "<span class=\"bad\">one max-model-len sequence fits, not max-num-seqs of them</span>"
                : "<span class=\"bad\">does not fit</span>");
    }
    fprintf(f, "</td></tr>\n");
    if (s) {
        fprintf(f, "<tr><th>Search</th><td>%d cards; prompts of %lld tokens, %lld output tokens; targets: TTFT ",
                s->o.cards, (long long)s->o.w.isl, (long long)s->o.w.osl);
        if (s->o.ttft_s > 0)
            fprintf(f, "&le; %s", ms(a, s->o.ttft_s));
        else
            fprintf(f, "none");
        fprintf(f, ", TPOT ");
        if (s->o.tpot_s > 0)
            fprintf(f, "&le; %s", ms(a, s->o.tpot_s));
        else
            fprintf(f, "none");
        fprintf(f, "; %d layouts costed, %d fit memory, %d meet the targets</td></tr>\n", s->n, s->n_fit, s->n_meet);
    }
    fprintf(f, "</table>\n");
}

/* --- 2. memory bars --- */

/* bars of BAR_H px, BAR_GAP apart (room for a warning line under each), below a line naming the
 * usable and capacity marks; the axis under the last bar's warning line */
enum { BAR_X = 110, BAR_W = 720, BAR_H = 30, BAR_GAP = 30, BAR_TOP = 20, BAR_AXIS = BAR_TOP + 2 * BAR_H + BAR_GAP + 30,
       BAR_RIGHT = 80 /* room right of the bars for the "capacity" mark's label */ };

struct seg {
    const char *cls, *label;
    int64_t bytes;
};

static void seg_rect(FILE *f, double scale, int64_t at, int y, const struct seg *g, int u)
{
    char a[40];
    double x = BAR_X + (double)at * scale, w = (double)g->bytes * scale;
    fprintf(f, "<rect class=\"seg %s\" x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" data-bytes=\"%lld\">"
               "<title>%s: %s</title></rect>\n",
            g->cls, x, y, w, BAR_H, (long long)g->bytes, g->label, G(a, g->bytes, u));
    if (w >= 64)
        fprintf(f, "<text class=\"%s\" x=\"%.2f\" y=\"%d\" text-anchor=\"middle\">%s</text>\n",
                strcmp(g->cls, "res") && strcmp(g->cls, "cii") ? "in" : "dark", x + w / 2, y + BAR_H / 2 + 4,
                G(a, g->bytes, u));
}

static void memory_bars(FILE *f, const struct pd_plan *p, int u)
{
    char a[40], b[40];
    /* one scale for both bars: the card's capacity, or more when a role's weights, activations
     * and runtime alone overrun it */
    double full = 0;
    for (int r = 0; r < 2; r++) {
        const struct pd_budget *bb = &p->role[r].b;
        double need = (double)(bb->weights + bb->activations + bb->runtime);
        full = fmax(full, fmax((double)bb->capacity, need));
    }
    if (!(full > 0))
        full = 1;
    double scale = BAR_W / full, unit = u == PD_UNITS_GIB ? PD_GIB : PD_GB;
    int height = BAR_AXIS + 24;
    fprintf(f, "<h2>Memory of one card</h2>\n");
    fprintf(f, "<p class=\"note\">The card holding the most routed experts of each role, to scale: %s of "
               "capacity, of which gpu-memory-utilization %.2f makes %s usable; the rest is reserved.</p>\n",
            G(a, p->role[0].b.capacity, u), p->o.util, G(b, p->role[0].b.usable, u));
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"membars\" width=\"%d\" height=\"%d\" "
               "viewBox=\"0 0 %d %d\" role=\"img\" aria-label=\"memory of one prefill and one decode card\">\n",
            BAR_X + BAR_W + BAR_RIGHT, height, BAR_X + BAR_W + BAR_RIGHT, height);
    fprintf(f, "<defs><pattern id=\"overhatch\" width=\"8\" height=\"8\" patternUnits=\"userSpaceOnUse\" "
               "patternTransform=\"rotate(45)\"><rect width=\"4\" height=\"8\" fill=\"#d62728\" "
               "fill-opacity=\"0.75\"/></pattern></defs>\n");
    fprintf(f, "<text x=\"%.2f\" y=\"%d\" text-anchor=\"end\">usable</text>"
               "<text x=\"%.2f\" y=\"%d\">capacity</text>\n",
            BAR_X + (double)p->role[0].b.usable * scale - 3, BAR_TOP - 7,
            BAR_X + (double)p->role[0].b.capacity * scale + 3, BAR_TOP - 7);
    for (int r = 0; r < 2; r++) {
        const struct pd_budget *bb = &p->role[r].b;
        int y = BAR_TOP + r * (BAR_H + BAR_GAP);
        fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">%s card</text>\n", BAR_X - 8, y + BAR_H / 2 + 4,
                pd_role_name((enum pd_role)r));
        fprintf(f, "<g class=\"bar\" id=\"bar-%s\">\n", pd_role_name((enum pd_role)r));
        struct seg seg[] = {
            {"ci", "class I (routed experts)", bb->class_i},
            {"cii", "class II (replicated weights)", bb->class_ii},
            {"kv", "KV pool", bb->kv_pool},
            {"act", "activations", bb->activations},
            {"rt", "runtime", bb->runtime},
        };
        struct seg res = {"res", "reserved (1 &minus; gpu-memory-utilization)", bb->capacity - bb->usable};
        int64_t at = 0;
        if (bb->kv_pool < 0) /* behind the consumers that overrun into it */
            seg_rect(f, scale, bb->usable, y, &res, u);
        for (size_t i = 0; i < sizeof seg / sizeof seg[0]; i++) {
            if (seg[i].bytes < 0)
                continue;
            seg_rect(f, scale, at, y, &seg[i], u);
            at += seg[i].bytes;
        }
        if (bb->kv_pool >= 0) {
            seg_rect(f, scale, at, y, &res, u);
        } else {
            /* the KV pool is negative: what weights, activations and runtime take beyond usable */
            fprintf(f, "<rect class=\"seg over\" x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" data-bytes=\"%lld\">"
                       "<title>over capacity: the KV pool is %s</title></rect>\n",
                    BAR_X + (double)bb->usable * scale, y, (double)-bb->kv_pool * scale, BAR_H,
                    (long long)-bb->kv_pool, G(a, bb->kv_pool, u));
            fprintf(f, "<text class=\"warn\" x=\"%d\" y=\"%d\">OVER CAPACITY: weights, activations and runtime "
                       "exceed the usable memory by %s; the KV pool is %s</text>\n",
                    BAR_X, y + BAR_H + 14, G(a, -bb->kv_pool, u), G(b, bb->kv_pool, u));
        }
        fprintf(f, "<rect class=\"cap\" x=\"%d\" y=\"%d\" width=\"%.2f\" height=\"%d\" data-bytes=\"%lld\">"
                   "<title>capacity %s</title></rect>\n",
                BAR_X, y, (double)bb->capacity * scale, BAR_H, (long long)bb->capacity, G(a, bb->capacity, u));
        double xu = BAR_X + (double)bb->usable * scale;
        fprintf(f, "<line class=\"usable\" x1=\"%.2f\" y1=\"%d\" x2=\"%.2f\" y2=\"%d\"/>\n", xu, y - 4, xu,
                y + BAR_H + 4);
        fprintf(f, "</g>\n");
    }
    /* axis in GB or GiB */
    int ya = BAR_AXIS;
    double top = full / unit, step = nice_step(top, 8);
    fprintf(f, "<line class=\"axis\" x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\"/>\n", BAR_X, ya, BAR_X + BAR_W, ya);
    for (double t = 0; t <= top + 1e-9; t += step) {
        double x = BAR_X + t * unit * scale;
        fprintf(f, "<line class=\"axis\" x1=\"%.2f\" y1=\"%d\" x2=\"%.2f\" y2=\"%d\"/>", x, ya, x, ya + 4);
        fprintf(f, "<text x=\"%.2f\" y=\"%d\" text-anchor=\"middle\">%g</text>\n", x, ya + 16, t);
    }
    fprintf(f, "<text x=\"%d\" y=\"%d\">%s</text>\n", BAR_X + BAR_W + 4, ya + 16, pd_units_g_name((enum pd_units)u));
    fprintf(f, "</svg>\n");

    /* legend with the byte values, and the rest of the budget */
    const struct pd_role_plan *P = &p->role[0], *D = &p->role[1];
    fprintf(f, "<table>\n<tr><th></th><th>per card</th><th>prefill card</th><th>decode card</th></tr>\n");
#define ROW(cls, label, fp, fd)                                                                                      \
    fprintf(f, "<tr><td>%s%s%s</td><td>%s</td><td class=\"n\">%s</td><td class=\"n\">%s</td></tr>\n",         \
            *cls ? "<span class=\"sw " : "", cls, *cls ? "\">&nbsp;</span>" : "", label, G(a, fp, u), G(b, fd, u))
    ROW("ci", "class I: routed experts (the busiest card)", P->b.class_i, D->b.class_i);
    ROW("cii", "class II: replicated weights", P->b.class_ii, D->b.class_ii);
    fprintf(f, "<tr><td><span class=\"sw kv\">&nbsp;</span></td><td>KV pool (what is left)</td>");
    for (int r = 0; r < 2; r++) {
        const struct pd_budget *bb = &p->role[r].b;
        if (bb->kv_pool < 0)
            fprintf(f, "<td class=\"n bad\">%s (over capacity)</td>", G(a, bb->kv_pool, u));
        else
            fprintf(f, "<td class=\"n\">%s</td>", G(a, bb->kv_pool, u));
    }
    fprintf(f, "</tr>\n");
    char t[96];
    snprintf(t, sizeof t, "activations (%lld / %lld tokens a step)", (long long)P->act.tokens, (long long)D->act.tokens);
    ROW("act", t, P->b.activations, D->b.activations);
    ROW("rt", "runtime overhead", P->b.runtime, D->b.runtime);
    ROW("res", "reserved (capacity &minus; usable)", P->b.capacity - P->b.usable, D->b.capacity - D->b.usable);
    if (P->b.kv_pool < 0 || D->b.kv_pool < 0)
        fprintf(f, "<tr><td><span class=\"sw over\">&nbsp;</span></td><td colspan=\"3\">over capacity: weights, "
                   "activations and runtime beyond the usable memory</td></tr>\n");
    ROW("", "usable", P->b.usable, D->b.usable);
    ROW("", "capacity", P->b.capacity, D->b.capacity);
    snprintf(t, sizeof t, "KV needed (1 / %lld &times; %lld tokens)", (long long)p->o.max_num_seqs,
             (long long)p->o.max_model_len);
    ROW("", t, P->kv_need, D->kv_need);
    if (P->b.kv_chunks || D->b.kv_chunks) {
        snprintf(t, sizeof t, "of it, chunks in flight (%lld tokens)", (long long)pd_plan_chunk_inflight_tokens(p, PD_ROLE_PREFILL));
        ROW("", t, P->b.kv_chunks, D->b.kv_chunks);
    }
    if (P->b.kv_decode_seq || D->b.kv_decode_seq) {
        snprintf(t, sizeof t, "of it, decodes in flight (%lld tokens)", (long long)pd_plan_decode_inflight_tokens(p, PD_ROLE_DECODE));
        ROW("", t, P->b.kv_transient - P->b.kv_chunks - P->b.kv_tables, D->b.kv_transient - D->b.kv_chunks - D->b.kv_tables);
    }
    if (P->b.kv_tables || D->b.kv_tables)
        ROW("", "of it, SGLang's request tables", P->b.kv_tables, D->b.kv_tables);
#undef ROW
    fprintf(f, "<tr><td></td><td>sequences of max-model-len that fit</td><td class=\"n\">%lld</td>"
               "<td class=\"n\">%lld</td></tr>\n",
            (long long)P->seqs_at_max_len, (long long)D->seqs_at_max_len);
    fprintf(f, "<tr><td></td><td>longest context for %lld sequences</td><td class=\"n\">%s tokens</td>"
               "<td class=\"n\">%s tokens</td></tr>\n",
            (long long)p->o.max_num_seqs, pd_units_thousands(a, P->ctx_at_max_seqs), pd_units_thousands(b, D->ctx_at_max_seqs));
    /* the three verdicts of plan.h, as the text report names them */
    fprintf(f, "<tr><td></td><td>verdict: weights fit</td><td%s>%s</td><td%s>%s</td></tr>\n",
            P->b.fits_weights ? "" : " class=\"bad\"", P->b.fits_weights ? "yes" : "no",
            D->b.fits_weights ? "" : " class=\"bad\"", D->b.fits_weights ? "yes" : "no");
    fprintf(f, "<tr><td></td><td>verdict: one max-model-len sequence</td><td%s>%s</td><td%s>%s</td></tr>\n",
            P->fits ? "" : " class=\"bad\"", P->fits ? "fits" : "does not fit", D->fits ? "" : " class=\"bad\"",
            D->fits ? "fits" : "does not fit");
    char pv[24];   /* (pd_plan_prefill_lowered: "N launched") */
    snprintf(pv, sizeof pv, "%lld launched", (long long)pd_plan_admitted_seqs(p, PD_ROLE_PREFILL));
    const int lowered = pd_plan_prefill_lowered(p);
    fprintf(f, "<tr><td></td><td>verdict: %lld of them (max-num-seqs)</td><td%s>%s</td><td%s>%s</td></tr>\n</table>\n",
            (long long)p->o.max_num_seqs, P->fits_max_num_seqs || lowered ? "" : " class=\"bad\"",
            lowered ? pv : P->fits_max_num_seqs ? "fit" : "do not fit", D->fits_max_num_seqs ? "" : " class=\"bad\"",
            D->fits_max_num_seqs ? "fit" : "do not fit");
    fprintf(f, "<p class=\"note\">Prefill KV by the seed's rule, max-num-batched-tokens &times; KV per token: %s; "
               "a prompt of max-model-len needs %s while it is prefilled in chunks and until decode has pulled it.</p>\n",
            B(a, p->p_kv_batch, u), B(b, pd_kv_seq_bytes(&p->kv, p->o.max_model_len), u));
}

/* --- 3. expert maps --- */

static int clampi(int v, int lo, int hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}

static void expert_legend(FILE *f, int n)
{
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"420\" height=\"40\" viewBox=\"0 0 420 40\" "
               "role=\"img\" aria-label=\"expert colours\">\n<defs><linearGradient id=\"hues\">");
    for (int i = 0; i <= 10; i++) {
        char c[8];
        expert_colour(c, (int)lround((n - 1) * i / 10.0), n);
        fprintf(f, "<stop offset=\"%d%%\" stop-color=\"%s\"/>", i * 10, c);
    }
    fprintf(f, "</linearGradient></defs>\n<rect x=\"60\" y=\"4\" width=\"300\" height=\"14\" fill=\"url(#hues)\"/>\n");
    fprintf(f, "<text x=\"54\" y=\"15\" text-anchor=\"end\">expert 0</text><text x=\"366\" y=\"15\">%d</text>\n", n - 1);
    fprintf(f, "<rect class=\"rep\" x=\"60\" y=\"24\" width=\"12\" height=\"12\" fill=\"#fff\"/>"
               "<text x=\"78\" y=\"34\">outlined: a redundant copy</text>\n</svg>\n");
}

static void expert_map(FILE *f, const struct pd_plan *p, int r)
{
    const struct pd_role_plan *rp = &p->role[r];
    const struct pd_placement *pl = &rp->place;
    if (!pl->map || pl->ep < 1 || pl->slots < 1)
        return;
    /* cells shrink with the map so 256+ experts stay within about 800 x 700 px */
    int cw = clampi(720 / pl->slots, 3, 22), ch = clampi(640 / pl->ep, 3, 16);
    int gap = cw >= 6 && ch >= 6 ? 1 : 0, lw = 64, top = 18;
    int label_every = ch >= 10 ? 1 : (10 + ch - 1) / ch, head_every = cw >= 20 ? 1 : (20 + cw - 1) / cw;
    int w = lw + pl->slots * cw + 8, h = top + pl->ep * ch + 4;
    const char *name = pd_role_name((enum pd_role)r);
    fprintf(f, "<h3>%s: %d rank%s &times; %d slot%s (every one of its %d instance%s is an EP group of %d)</h3>\n",
            r == PD_ROLE_PREFILL ? "Prefill" : "Decode", pl->ep, pl->ep == 1 ? "" : "s", pl->slots,
            pl->slots == 1 ? "" : "s", rp->o.instances, rp->o.instances == 1 ? "" : "s", rp->ep);
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"map-%s\" width=\"%d\" height=\"%d\" "
               "viewBox=\"0 0 %d %d\" role=\"img\" aria-label=\"%s expert-to-card map\">\n",
            name, w, h, w, h, name);
    for (int s = 0; s < pl->slots; s += head_every)
        fprintf(f, "<text x=\"%.1f\" y=\"12\" text-anchor=\"middle\">%d</text>", lw + s * cw + cw / 2.0, s);
    fprintf(f, "<text x=\"%d\" y=\"12\" text-anchor=\"end\">slot</text>\n", lw - 6);
    for (int k = 0; k < pl->ep; k++) {
        int y = top + k * ch;
        if (k % label_every == 0)
            fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">rank %d</text>\n", lw - 6,
                    y + ch / 2 + 4, k);
        for (int s = 0; s < pl->slots; s++) {
            int id = pl->map[k * pl->slots + s], rep = pd_placement_owner(pl, id) != k;
            char c[8];
            expert_colour(c, id, pl->n_experts);
            fprintf(f, "<rect class=\"x%s\" x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"%s\">"
                       "<title>rank %d, slot %d: expert %d%s</title></rect>",
                    rep ? " rep" : "", lw + s * cw, y, cw - gap, ch - gap, c, k, s, id, rep ? " (redundant copy)" : "");
            if (cw >= 18 && ch >= 12)
                fprintf(f, "<text class=\"id\" x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%d</text>",
                        lw + s * cw + (cw - gap) / 2.0, y + ch / 2 + 3, id);
        }
        fprintf(f, "\n");
    }
    fprintf(f, "</svg>\n");
}

static void expert_maps(FILE *f, const struct pd_plan *p)
{
    fprintf(f, "<h2>Expert-to-card map</h2>\n<p class=\"note\">Each row is one card (rank) of an EP group, each "
               "cell one expert slot, coloured by expert id; hover a cell for its expert.</p>\n");
    expert_legend(f, p->role[0].place.n_experts > 0 ? p->role[0].place.n_experts : p->model.n_routed_experts);
    for (int r = 0; r < 2; r++)
        expert_map(f, p, r);
}

/* --- 4. Pareto chart and the search's tables --- */

enum { PW = 780, PH = 480, PL = 76, PR = 24, PT = 20, PB = 76 };

static const char *layout_pd(char *buf, size_t n, const struct pd_layout *l)
{
    char a[96], b[96];
    snprintf(buf, n, "P %s, D %s", layout(a, sizeof a, &l->role[0]), layout(b, sizeof b, &l->role[1]));
    return buf;
}

static int chosen_layout(const struct pd_search *s)
{
    int c = s->chose_agg ? -1 : s->best >= 0 ? s->best : s->best_any;
    return c >= 0 && c < s->n ? c : -1;
}

/* The front's j-th layout, NULL for an index out of the search's layouts. */
static const struct pd_layout *front_at(const struct pd_search *s, int j)
{
    int i = s->front ? s->front[j] : -1;
    return i >= 0 && i < s->n ? &s->l[i] : NULL;
}

static int plotted(const struct pd_layout *l)
{
    return l->fits && isfinite(l->user_tok_s) && isfinite(l->tok_s_card);
}

static void pareto_chart(FILE *f, const struct pd_search *s)
{
    char a[256];
    double xmax = 0, ymax = 0, xt = s->o.tpot_s > 0 ? 1.0 / s->o.tpot_s : 0;
    for (int i = 0; i < s->n; i++)
        if (plotted(&s->l[i])) {
            xmax = fmax(xmax, s->l[i].user_tok_s);
            ymax = fmax(ymax, s->l[i].tok_s_card);
        }
    xmax = fmax(xmax, xt) * 1.05;
    ymax *= 1.05;
    if (!(xmax > 0))
        xmax = 1;
    if (!(ymax > 0))
        ymax = 1;
    double xs = nice_step(xmax, 8), ys = nice_step(ymax, 6);
    xmax = ceil(xmax / xs) * xs;
    ymax = ceil(ymax / ys) * ys;
    double pw = PW - PL - PR, ph = PH - PT - PB;
#define X(v) (PL + (v) / xmax * pw)
#define Y(v) (PT + ph - (v) / ymax * ph)
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"pareto\" width=\"%d\" height=\"%d\" "
               "viewBox=\"0 0 %d %d\" role=\"img\" aria-label=\"output tokens per second per card against tokens "
               "per second per user\">\n",
            PW, PH, PW, PH);
    for (double t = 0; t <= xmax + xs * 1e-6; t += xs)
        fprintf(f, "<line class=\"grid\" x1=\"%.2f\" y1=\"%d\" x2=\"%.2f\" y2=\"%.2f\"/>"
                   "<text x=\"%.2f\" y=\"%.2f\" text-anchor=\"middle\">%g</text>\n",
                X(t), PT, X(t), PT + ph + 4, X(t), PT + ph + 17, t);
    for (double t = 0; t <= ymax + ys * 1e-6; t += ys)
        fprintf(f, "<line class=\"grid\" x1=\"%d\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\"/>"
                   "<text x=\"%d\" y=\"%.2f\" text-anchor=\"end\">%g</text>\n",
                PL - 4, Y(t), PL + pw, Y(t), PL - 7, Y(t) + 4, t);
    fprintf(f, "<line class=\"axis\" x1=\"%d\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\"/>"
               "<line class=\"axis\" x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%.2f\"/>\n",
            PL, PT + ph, PL + pw, PT + ph, PL, PT, PL, PT + ph);
    fprintf(f, "<text x=\"%.2f\" y=\"%.2f\" text-anchor=\"middle\">tokens/s per user (1 / TPOT)</text>\n", PL + pw / 2,
            PT + ph + 36);
    fprintf(f, "<text transform=\"translate(18 %.2f) rotate(-90)\" text-anchor=\"middle\">output tokens/s per card</text>\n",
            PT + ph / 2);
    if (xt > 0) {
        fprintf(f, "<line class=\"target\" x1=\"%.2f\" y1=\"%d\" x2=\"%.2f\" y2=\"%.2f\"/>", X(xt), PT, X(xt), PT + ph);
        int left = X(xt) > PL + pw * 0.6;
        fprintf(f, "<text class=\"tgt\" x=\"%.2f\" y=\"%d\" text-anchor=\"%s\">TPOT target %s: %.1f tokens/s per "
                   "user</text>\n",
                left ? X(xt) - 4 : X(xt) + 4, PT + 12, left ? "end" : "start", ms(a, s->o.tpot_s), xt);
    }
    for (int i = 0; i < s->n; i++) {
        const struct pd_layout *l = &s->l[i];
        if (plotted(l) && !l->meets)
            fprintf(f, "<circle class=\"pt\" cx=\"%.2f\" cy=\"%.2f\" r=\"2.5\"/>\n", X(l->user_tok_s), Y(l->tok_s_card));
    }
    fprintf(f, "<polyline class=\"front\" points=\"");
    for (int j = 0, k = 0; j < s->n_front; j++) {
        const struct pd_layout *l = front_at(s, j);
        if (l && plotted(l))
            fprintf(f, "%s%.2f,%.2f", k++ ? " " : "", X(l->user_tok_s), Y(l->tok_s_card));
    }
    fprintf(f, "\"/>\n");
    for (int j = 0; j < s->n_front; j++) {
        const struct pd_layout *l = front_at(s, j);
        if (!l || !plotted(l))
            continue;
        char b[32], c[32];
        fprintf(f, "<circle class=\"fp\" cx=\"%.2f\" cy=\"%.2f\" r=\"3.5\"><title>%s, batch %lld: %s tokens/s per "
                   "user, %s tokens/s per card</title></circle>\n",
                X(l->user_tok_s), Y(l->tok_s_card), layout_pd(a, sizeof a, l), (long long)l->batch,
                num(b, l->user_tok_s), num(c, l->tok_s_card));
    }
    /* the layouts meeting the targets over the front's markers, so they stay visible */
    for (int i = 0; i < s->n; i++) {
        const struct pd_layout *l = &s->l[i];
        if (plotted(l) && l->meets)
            fprintf(f, "<circle class=\"pt meet\" cx=\"%.2f\" cy=\"%.2f\" r=\"2.5\"/>\n", X(l->user_tok_s),
                    Y(l->tok_s_card));
    }
    int c = chosen_layout(s);
    if (c >= 0 && plotted(&s->l[c])) {
        const struct pd_layout *l = &s->l[c];
        double cx = X(l->user_tok_s), cy = Y(l->tok_s_card);
        char lab[320];
        int n = snprintf(lab, sizeof lab, "%s: %s, batch %lld", s->best >= 0 ? "chosen" : "best (none meets the targets)",
                         layout_pd(a, sizeof a, l), (long long)l->batch);
        /* to the right of the ring if it fits there, else above it, shifted left as far as it must
         * to stay inside the plot; about 7 px per character at 11 px bold, an entity one */
        double tw = 0, lx = cx + 12, ly = cy + 4;
        for (int i = 0; i < n; i++, tw += 7)
            if (lab[i] == '&')
                while (i + 1 < n && lab[i] != ';')
                    i++;
        if (lx + tw > PW - PR) {
            lx = fmax(PL + 4, PW - PR - tw);
            ly = cy - 14 < PT + 10 ? cy + 24 : cy - 14;
        }
        fprintf(f, "<circle class=\"chosen\" cx=\"%.2f\" cy=\"%.2f\" r=\"8\"/>\n", cx, cy);
        fprintf(f, "<text class=\"lab\" x=\"%.2f\" y=\"%.2f\">%s</text>\n", lx, ly, lab);
    }
    /* legend, one row under the axis title: nothing in the plot area to hide a point or the label */
    double ly = PH - 12;
    fprintf(f, "<circle class=\"pt key\" cx=\"%d\" cy=\"%.2f\" r=\"3\"/><text x=\"%d\" y=\"%.2f\">layout that "
               "fits</text>\n",
            PL + 6, ly - 4, PL + 14, ly);
    fprintf(f, "<circle class=\"pt meet key\" cx=\"%d\" cy=\"%.2f\" r=\"3\"/><text x=\"%d\" y=\"%.2f\">meets the "
               "targets</text>\n",
            PL + 146, ly - 4, PL + 154, ly);
    fprintf(f, "<line class=\"front key\" x1=\"%d\" y1=\"%.2f\" x2=\"%d\" y2=\"%.2f\"/><text x=\"%d\" y=\"%.2f\">"
               "Pareto front</text>\n",
            PL + 280, ly - 4, PL + 296, ly - 4, PL + 302, ly);
    fprintf(f, "<circle class=\"chosen key\" cx=\"%d\" cy=\"%.2f\" r=\"5\"/><text x=\"%d\" y=\"%.2f\">chosen "
               "layout</text>\n",
            PL + 412, ly - 4, PL + 422, ly);
#undef X
#undef Y
    fprintf(f, "</svg>\n");
}

static void layout_row(FILE *f, const struct pd_layout *l, const char *first, int chosen)
{
    char a[256], t1[32], t2[32], u1[32], u2[32];
    fprintf(f, "<tr%s><td>%s</td><td>%s</td><td class=\"n\">%lld</td><td class=\"n\">%d</td><td class=\"n\">%s</td>"
               "<td class=\"n\">%s</td><td class=\"n\">%s</td><td class=\"n\">%s</td><td>%s / %s</td></tr>\n",
            chosen ? " class=\"chosen\"" : "", first, layout_pd(a, sizeof a, l), (long long)l->batch, l->cards,
            ms(t1, l->ttft_s), ms(t2, l->tpot_s), num(u1, l->user_tok_s), num(u2, l->tok_s_card),
            pd_bound_name(l->prefill_bound), pd_bound_name(l->decode_bound));
}

static const char LAYOUT_HEAD[] =
    "<th>layout (instances &times; DP &times; TP)</th><th>batch per D rank</th><th>cards</th><th>TTFT</th>"
    "<th>TPOT</th><th>tokens/s per user</th><th>output tokens/s per card</th><th>bound (P / D)</th></tr>\n";

/* The best aggregated and disaggregated layouts, and which wins (pd_search_compare). */
static void compare_section(FILE *f, const struct pd_search *s)
{
    struct pd_search_verdict v = pd_search_compare(s);
    char a[256], t1[32], t2[32], u1[32], u2[32];
    fprintf(f, "<h2>Aggregated or disaggregated?</h2>\n<p class=\"note\">The best layout of each kind on the same %d "
               "cards, workload and targets (%s); aggregated instances prefill and decode on the same cards, prompt "
               "chunks sharing steps with decode (docs/perf-model.md, &ldquo;Aggregated&rdquo;).</p>\n",
            s->o.cards, v.meets ? "both meet the targets" : "where a kind has none meeting them, its best that fits");
    fprintf(f, "<table id=\"compare\">\n<tr><th>kind</th><th>layout (instances &times; DP &times; TP)</th>"
               "<th>batch per rank</th><th>cards</th><th>TTFT</th><th>TPOT</th><th>tokens/s per user</th>"
               "<th>output tokens/s per card</th></tr>\n");
    if (v.agg >= 0) {
        const struct pd_agg_layout *l = &s->agg[v.agg];
        char x[96];
        snprintf(x, sizeof x, "%dx ", l->o.instances);
        fprintf(f, "<tr%s><td>aggregated</td><td>%s%s</td><td class=\"n\">%lld</td><td class=\"n\">%d</td>"
                   "<td class=\"n\">%s</td><td class=\"n\">%s</td><td class=\"n\">%s</td><td class=\"n\">%s</td></tr>\n",
                s->chose_agg ? " class=\"chosen\"" : "", x, layout(a, sizeof a, &l->o), (long long)l->batch, l->cards,
                ms(t1, l->ttft_s), ms(t2, l->tpot_s), num(u1, l->user_tok_s), num(u2, l->tok_s_card));
    } else {
        fprintf(f, "<tr><td>aggregated</td><td colspan=\"7\" class=\"bad\">none %s</td></tr>\n",
                s->n_agg_fit ? "meets the targets" : "fits");
    }
    if (v.disagg >= 0) {
        const struct pd_layout *l = &s->l[v.disagg];
        fprintf(f, "<tr%s><td>disaggregated</td><td>%s</td><td class=\"n\">%lld</td><td class=\"n\">%d</td>"
                   "<td class=\"n\">%s</td><td class=\"n\">%s</td><td class=\"n\">%s</td><td class=\"n\">%s</td></tr>\n",
                s->chose_agg ? "" : " class=\"chosen\"", layout_pd(a, sizeof a, l), (long long)l->batch, l->cards,
                ms(t1, l->ttft_s), ms(t2, l->tpot_s), num(u1, l->user_tok_s), num(u2, l->tok_s_card));
    } else {
        fprintf(f, "<tr><td>disaggregated</td><td colspan=\"7\" class=\"bad\">none %s</td></tr>\n",
                s->n_fit ? "meets the targets" : "fits");
    }
    fprintf(f, "</table>\n");
    if (v.agg >= 0 && v.disagg >= 0)
        fprintf(f, "<p id=\"verdict\"><b>%s wins</b>: %.2f&times; the output tokens/s per card of the best %s layout.</p>\n",
                v.agg_wins ? "Aggregated" : "Disaggregated", v.ratio, v.agg_wins ? "disaggregated" : "aggregated");
    else if (v.agg >= 0 || v.disagg >= 0)
        fprintf(f, "<p id=\"verdict\"><b>%s wins</b>: the other kind has no layout that %s.</p>\n",
                v.agg_wins ? "Aggregated" : "Disaggregated", (v.agg_wins ? s->n_fit : s->n_agg_fit) ? "meets the targets" : "fits");
}

static void search_section(FILE *f, const struct pd_search *s)
{
    char a[32], b[32];
    int c = chosen_layout(s);
    compare_section(f, s);
    fprintf(f, "<h2>Layouts: throughput against interactivity</h2>\n");
    fprintf(f, "<p class=\"note\">Every layout that fits memory, %d of the %d costed, at its predicted tokens/s "
               "per user and output tokens/s per card; blue ones meet the targets (TTFT ",
            s->n_fit, s->n);
    fprintf(f, s->o.ttft_s > 0 ? "&le; %s" : "any", ms(a, s->o.ttft_s));
    fprintf(f, s->o.tpot_s > 0 ? ", TPOT &le; %s" : ", TPOT any", ms(b, s->o.tpot_s));
    fprintf(f, "). TTFT has no axis here: a point left of the TPOT line never meets the targets, one right of it "
               "may still miss the TTFT target.</p>\n");
    pareto_chart(f, s);

    fprintf(f, "<h3>The Pareto front (%d layout%s)</h3>\n<table id=\"front\">\n<tr><th>#</th>%s", s->n_front,
            s->n_front == 1 ? "" : "s", LAYOUT_HEAD);
    for (int j = 0; j < s->n_front; j++) {
        if (!front_at(s, j))
            continue;
        snprintf(a, sizeof a, "%d", j + 1);
        layout_row(f, &s->l[s->front[j]], a, s->front[j] == c);
    }
    fprintf(f, "</table>\n");

    fprintf(f, "<h3>Best layout per target</h3>\n<table id=\"best\">\n<tr><th>target</th>%s", LAYOUT_HEAD);
    char tgt[160];
    snprintf(tgt, sizeof tgt, "TTFT %s%s, TPOT %s%s (the search's choice)", s->o.ttft_s > 0 ? "&le; " : "",
             s->o.ttft_s > 0 ? ms(a, s->o.ttft_s) : "any", s->o.tpot_s > 0 ? "&le; " : "",
             s->o.tpot_s > 0 ? ms(b, s->o.tpot_s) : "any");
    if (s->best >= 0 && s->best < s->n)
        layout_row(f, &s->l[s->best], tgt, 1);
    else
        fprintf(f, "<tr><td>%s</td><td colspan=\"8\" class=\"bad\">no layout meets the targets</td></tr>\n", tgt);
    if (s->best_any >= 0 && s->best_any < s->n)
        layout_row(f, &s->l[s->best_any], "none (the most output tokens/s per card that fits)", s->best < 0);
    /* the front read at common TPOT targets, the TTFT target held */
    double t[PD_SEARCH_MAX_TPOTS];
    int nt = pd_search_tpot_targets(s, t);
    for (int i = 0; i < nt; i++) {
        int k = pd_search_best_under(s, t[i]);
        snprintf(tgt, sizeof tgt, "TPOT &le; %s%s%s", ms(a, t[i]), s->o.ttft_s > 0 ? ", TTFT &le; " : "",
                 s->o.ttft_s > 0 ? ms(b, s->o.ttft_s) : "");
        if (k >= 0)
            layout_row(f, &s->l[k], tgt, 0);
        else
            fprintf(f, "<tr><td>%s</td><td colspan=\"8\">no layout that fits meets it</td></tr>\n", tgt);
    }
    fprintf(f, "</table>\n");
}

/* Every role layout the search tried, with the memory plan's verdict. */
static void memory_table(FILE *f, const struct pd_search *s, int u)
{
    if (s->n_mem == 0)
        return;
    fprintf(f, "<h3>What fits in memory</h3>\n<p class=\"note\">Per role layout (instances aside), the busiest "
               "card; decode's KV pool at batch 1, and the largest batch per DP rank (sequences of max-model-len, as "
               "--max-num-seqs admits them) whose KV fits; the MoE load is the busiest rank's expert load over the mean (%s).</p>\n<table id=\"memory\">\n"
               "<tr><th>role</th><th>layout (DP &times; TP, redundant)</th><th>experts per card</th><th>weights</th>"
               "<th>KV pool</th><th>MoE load</th><th>verdict</th></tr>\n",
            pd_search_load_source(s));
    for (int i = 0; i < s->n_mem; i++) {
        const struct pd_search_mem *m = &s->mem[i];
        char w[32], kv[32];
        fprintf(f, "<tr><td>%s</td><td>DP%d &times; TP%d", pd_role_name(m->role), m->o.dp, m->o.tp);
        if (m->o.redundant > 0)
            fprintf(f, ", %d redundant", m->o.redundant);
        fprintf(f, "</td><td class=\"n\">%d</td><td class=\"n\">%s</td><td class=\"n\">%s</td><td class=\"n\">%.2f</td>",
                m->experts_per_card, G(w, m->weights, u), G(kv, m->kv_pool, u), m->imbalance);
        if (!m->fits_weights)
            fprintf(f, "<td class=\"bad\">does not fit (weights)</td></tr>\n");
        else if (m->max_batch == 0)
            fprintf(f, "<td class=\"bad\">does not fit (KV)</td></tr>\n");
        else if (m->role == PD_ROLE_DECODE)
            fprintf(f, "<td>fits, batch up to %lld</td></tr>\n", (long long)m->max_batch);
        else
            fprintf(f, "<td>fits</td></tr>\n");
    }
    fprintf(f, "</table>\n");
}

/* --- 5. the prediction --- */

static void step_row(FILE *f, const char *name, const struct pd_step *st, int u)
{
    char a[32], b[32], c[32], d[32], g[32], h[32], k[32], m[32];
    fprintf(f, "<tr><td>%s</td><td class=\"n\">%lld</td><td class=\"n\">%s</td><td class=\"n\">%s</td>"
               "<td class=\"n\">%s</td><td class=\"n\">%s</td><td class=\"n\">%s</td><td class=\"n\">%s</td>"
               "<td class=\"n\">%s</td><td class=\"n\">%.2f TFLOP</td><td class=\"n\">%s</td><td>%s</td></tr>\n",
            name, (long long)st->tokens, ms(a, st->gemm_compute_s), ms(b, st->gemm_memory_s), ms(c, st->attn_s),
            ms(d, st->attn_kv_read_s), ms(g, st->a2a_s), ms(h, st->overhead_s), ms(k, st->total_s), st->flops / 1e12,
            G(m, (int64_t)st->bytes, u), pd_bound_name(st->bound));
}

static void perf_section(FILE *f, const struct pd_plan *p, const struct pd_perf *pf, int u)
{
    char a[32], b[32];
    const struct pd_workload *w = &pf->w;
    fprintf(f, "<h2>Predicted performance</h2>\n");
    fprintf(f, "<p class=\"note\">Workload: prompts of %lld tokens (%.0f%% from a prefix cache), %lld output "
               "tokens, ",
            (long long)w->isl, w->cached * 100, (long long)w->osl);
    if (w->rate > 0)
        fprintf(f, "%.2f requests/s arriving.", w->rate);
    else
        fprintf(f, "no queueing.");
    fprintf(f, "%s</p>\n", pf->fits ? "" : " <span class=\"bad\">The layout does not fit memory.</span>");
    fprintf(f, "<table id=\"perf\">\n<tr><th>quantity</th><th>value</th></tr>\n");
#define R(label, ...)                                                                                                \
    do {                                                                                                             \
        fprintf(f, "<tr><td>%s</td><td class=\"n\">", label);                                                        \
        fprintf(f, __VA_ARGS__);                                                                                     \
        fprintf(f, "</td></tr>\n");                                                                                  \
    } while (0)
    R("TTFT (queue-free)", "%s", ms(a, pf->ttft_s));
    R("&nbsp;&nbsp;the PD path's fixed cost per request", "%s", ms(a, pf->request_s));
    R("&nbsp;&nbsp;prefill of the prompt (chunked, one DP rank)", "%s", ms(a, pf->prefill_s));
    R("&nbsp;&nbsp;KV hand-off (RDMA)", "%s", ms(a, pf->handoff_s));
    R("&nbsp;&nbsp;first decode step", "%s", ms(a, pf->ttft_s - pf->request_s - pf->prefill_s - pf->handoff_s));
    if (w->rate > 0)
        R("TTFT with queueing at the arrival rate", "%s", isfinite(pf->ttft_rate_s) ? ms(a, pf->ttft_rate_s) : "overloaded");
    R("TPOT", "%s", ms(a, pf->tpot_s));
    R("tokens/s per user", "%s tokens/s", num(a, pf->user_tok_s));
    R("tokens per decode step (MTP)", "%.2f", pf->tokens_per_step);
    R("decode batch per DP rank", "%lld sequences (at most %lld)", (long long)pf->batch, (long long)pf->batch_cap);
    R("prefill: input tokens/s per card", "%s tokens/s", num(a, pf->prefill_tok_s_card));
    R("decode: output tokens/s per card", "%s tokens/s", num(a, pf->decode_tok_s_card));
    R("deployment: output tokens/s per card", "%s tokens/s", num(a, pf->tok_s_card));
    char c[32];
    R("requests/s: prefill / decode / deployment", "%s / %s / %s requests/s", num(a, pf->prefill_req_s),
      num(b, pf->decode_req_s), num(c, pf->req_s));
    R("binding resource: prefill / decode", "%s / %s", pd_bound_name(pf->prefill_bound), pd_bound_name(pf->decode_bound));
    R("MoE load, busiest rank / mean: prefill / decode", "%.2f / %.2f (%s)", pf->prefill_step.imbalance,
      pf->decode_step.imbalance, p->role[0].imbalance > 0 || p->role[1].imbalance > 0
                                     ? "measured on the placements from the expert stats" : "the hardware file's");
#undef R
    fprintf(f, "</table>\n");
    fprintf(f, "<h3>One forward step of one DP rank</h3>\n<table id=\"steps\">\n<tr><th>step</th><th>tokens</th>"
               "<th>GEMM compute</th><th>GEMM memory</th><th>attention</th><th>KV reads alone</th>"
               "<th>all-to-all</th><th>overhead</th><th>total</th><th>arithmetic</th><th>memory traffic</th>"
               "<th>bound</th></tr>\n");
    step_row(f, "prefill (one full chunk)", &pf->prefill_step, u);
    step_row(f, "decode (mean context)", &pf->decode_step, u);
    fprintf(f, "</table>\n");
    /* how far the published runs vouch for this prediction, as plan's text says it (validate.h) */
    char *runs = NULL;
    pd_err ve = {0};
    fprintf(f, "<h3>Published runs of this model on these cards</h3>\n<pre id=\"published\">");
    esc(f, pd_validate_vouch(p, &runs, NULL, &ve) ? ve.msg : runs);
    fprintf(f, "</pre>\n");
    free(runs);
}

/* --- 6. the plan's tables --- */

static void plan_tables(FILE *f, const struct pd_plan *p, int u)
{
    char a[40], b[40], c[40], d[40];
    const struct pd_role_plan *P = &p->role[0], *D = &p->role[1];
    fprintf(f, "<h2>The plan's tables</h2>\n");

    fprintf(f, "<h3>Layout (%d of %d cards: %d nodes &times; %d)</h3>\n<table>\n<tr><th>role</th><th>DP</th>"
               "<th>TP</th><th>instances</th><th>EP size</th><th>cards</th><th>experts per card</th>"
               "<th>redundant</th></tr>\n",
            p->cards_used, p->cards_total, p->nodes, p->hw.cards_per_node);
    for (int r = 0; r < 2; r++) {
        const struct pd_role_plan *rp = &p->role[r];
        fprintf(f, "<tr><td>%s</td><td class=\"n\">%d</td><td class=\"n\">%d</td><td class=\"n\">%d</td>"
                   "<td class=\"n\">%d</td><td class=\"n\">%d</td><td class=\"n\">%d</td><td class=\"n\">%d</td></tr>\n",
                pd_role_name(rp->role), rp->o.dp, rp->o.tp, rp->o.instances, rp->ep, rp->cards, rp->place.slots,
                rp->o.redundant);
    }
    fprintf(f, "</table>\n");

    fprintf(f, "<h3>Weights per card</h3>\n<table id=\"weights\">\n<tr><th>group</th><th>class</th>"
               "<th>whole model</th><th>parameters</th><th>prefill card</th><th>decode card</th></tr>\n");
    for (int cl = 0; cl < 2; cl++)
        for (int g = 0; g < PD_G_COUNT; g++) {
            int64_t x = p->inv.group_bytes[g][cl];
            if (!x)
                continue;
            fprintf(f, "<tr><td>%s</td><td>%s</td><td class=\"n\">%s</td><td class=\"n\">%s</td>",
                    pd_group_title((enum pd_group)g), cl == PD_CLASS_I ? "I" : "II", G(a, x, u),
                    pd_units_thousands(b, p->inv.group_params[g][cl]));
            if (cl == PD_CLASS_I) {
                fprintf(f, "<td class=\"n\">%s</td><td class=\"n\">%s</td></tr>\n", G(a, P->b.class_i, u),
                        G(b, D->b.class_i, u));
            } else {
                int split = pd_group_tp_split((enum pd_group)g);
                fprintf(f, "<td class=\"n\">%s</td><td class=\"n\">%s</td></tr>\n",
                        G(a, split ? (x + P->o.tp - 1) / P->o.tp : x, u), G(b, split ? (x + D->o.tp - 1) / D->o.tp : x, u));
            }
        }
    fprintf(f, "<tr><th>class I</th><td></td><td class=\"n\">%s</td><td class=\"n\">%s</td><td class=\"n\">%s</td>"
               "<td class=\"n\">%s</td></tr>\n",
            G(a, p->inv.class_bytes[0], u), pd_units_thousands(b, p->inv.class_params[0]), G(c, P->b.class_i, u),
            G(d, D->b.class_i, u));
    fprintf(f, "<tr><th>class II</th><td></td><td class=\"n\">%s</td><td class=\"n\">%s</td><td class=\"n\">%s</td>"
               "<td class=\"n\">%s</td></tr>\n",
            G(a, p->inv.class_bytes[1], u), pd_units_thousands(b, p->inv.class_params[1]), G(c, P->b.class_ii, u),
            G(d, D->b.class_ii, u));
    fprintf(f, "<tr><th>total</th><td></td><td class=\"n\">%s</td><td class=\"n\">%s</td><td class=\"n\">%s</td>"
               "<td class=\"n\">%s</td></tr>\n</table>\n",
            G(a, p->inv.class_bytes[0] + p->inv.class_bytes[1], u),
            pd_units_thousands(b, p->inv.class_params[0] + p->inv.class_params[1]), G(c, P->b.weights, u),
            G(d, D->b.weights, u));
    fprintf(f, "<p class=\"note\">Weights %s%s. One routed expert over all %d MoE layers: %s; class I is the "
               "card holding the most; tensor parallelism splits some class II groups.</p>\n",
            p->inv.from_checkpoint ? "from the checkpoint's headers" : "from the config",
            p->include_mtp ? ", MTP layer included" : "", p->inv.n_moe_layers,
            G(a, p->inv.n_experts ? p->inv.expert_bytes[0] : 0, u));
    if (p->inv.n_unclassed) {
        fprintf(f, "<p class=\"bad\">%d checkpoint tensor(s) could not be classed and are not counted:",
                p->inv.n_unclassed);
        for (int i = 0; i < p->inv.n_unclassed && i < PD_INV_MAX_UNCLASSED; i++) {
            fprintf(f, "%s ", i ? "," : "");
            esc(f, p->inv.unclassed[i]);
        }
        fprintf(f, "</p>\n");
    }

    const struct pd_kv_size *k = &p->kv;
    fprintf(f, "<h3>KV cache (%s)</h3>\n", pd_kv_dtype_name(k->dtype));
    if (k->flat_per_token) {
        fprintf(f, "<p>A flat %s B per token, given rather than computed from the architecture.</p>\n",
                pd_units_thousands(a, k->flat_per_token));
    } else {
        fprintf(f, "<table id=\"kv\">\n<tr><th>layers</th><th>count</th><th>bytes per token</th></tr>\n");
        for (int i = 0; i < PD_KV_KINDS; i++)
            if (k->n_layers[i])
                fprintf(f, "<tr><td>%s</td><td class=\"n\">%d</td><td class=\"n\">%.1f B</td></tr>\n",
                        pd_kv_kind_name((enum pd_kv_kind)i), k->n_layers[i], k->per_token_kind[i]);
        fprintf(f, "<tr><th>per token (marginal)</th><td></td><td class=\"n\">%.1f B (%.2f KiB)</td></tr>\n",
                k->per_token, k->per_token / 1024.0);
        if (k->per_seq_fixed)
            fprintf(f, "<tr><th>fixed per sequence</th><td></td><td class=\"n\">%s (windows of %lld tokens %s, "
                       "compressor states %s)</td></tr>\n",
                    B(a, k->per_seq_fixed, u), (long long)k->window, B(b, k->window_bytes, u), B(c, k->state_bytes, u));
        fprintf(f, "</table>\n<p class=\"note\">One entry %lld B per layer", (long long)k->entry_bytes);
        if (k->index_key_bytes)
            fprintf(f, ", one indexer key %lld B", (long long)k->index_key_bytes);
        fprintf(f, ".</p>\n");
    }
    fprintf(f, "<p>One sequence of %s tokens: %s.</p>\n", pd_units_thousands(a, p->o.max_model_len),
            B(b, pd_kv_seq_bytes(k, p->o.max_model_len), u));

    const struct pd_budget *db = &D->b;
    fprintf(f, "<h3>Decode card KV scenarios (usable %s)</h3>\n<table id=\"scenarios\">\n<tr><th>sequences</th>"
               "<th>context</th><th>KV</th><th>card total</th><th>of usable</th><th>verdict</th></tr>\n",
            G(a, db->usable, u));
    for (int i = 0; i < p->n_scen; i++) {
        const struct pd_scenario *sc = &p->scen[i];
        fprintf(f, "<tr><td class=\"n\">%lld</td><td class=\"n\">%s tokens</td><td class=\"n\">%s</td>"
                   "<td class=\"n\">%s</td><td class=\"n\">%.0f%%</td><td%s>%s</td></tr>\n",
                (long long)sc->seqs, pd_units_thousands(a, sc->ctx), G(b, sc->kv, u), G(c, sc->total, u),
                db->usable ? 100.0 * (double)sc->total / (double)db->usable : 0, sc->fits ? "" : " class=\"bad\"",
                sc->fits ? "fits" : "does not fit");
    }
    fprintf(f, "</table>\n");

    fprintf(f, "<h3>KV hand-off, one prompt from a prefill card to a decode card</h3>\n<table id=\"handoff\">\n"
               "<tr><th>tokens</th><th>bytes</th><th>RDMA</th><th>TCP</th></tr>\n");
    for (int i = 0; i < p->n_handoff; i++) {
        const struct pd_handoff *h = &p->handoff[i];
        fprintf(f, "<tr><td class=\"n\">%s</td><td class=\"n\">%s</td><td class=\"n\">%s</td><td class=\"n\">%s</td></tr>\n",
                pd_units_thousands(a, h->tokens), B(b, h->bytes, u), ms(c, h->rdma_s), ms(d, h->tcp_s));
    }
    fprintf(f, "</table>\n<p class=\"note\">RDMA: ");
    esc(f, p->hw.rdma.name);
    fprintf(f, ", %.1f GB/s + %.1f ms; TCP: ", p->hw.rdma.bandwidth_Bps / 1e9, p->hw.rdma.latency_s * 1e3);
    esc(f, p->hw.tcp.name);
    fprintf(f, ", %.1f GB/s + %.1f ms.</p>\n", p->hw.tcp.bandwidth_Bps / 1e9, p->hw.tcp.latency_s * 1e3);

    if (p->n_sweep) {
        fprintf(f, "<h3>EP-size decision tree (DP-size sweep over each role's cards)</h3>\n<table id=\"sweep\">\n"
                   "<tr><th>role</th><th>DP</th><th>EP</th><th>instances</th><th>experts per card</th>"
                   "<th>weights</th><th>KV room</th><th>KV target</th><th>verdict</th></tr>\n");
        for (int i = 0; i < p->n_sweep; i++) {
            const struct pd_sweep_row *sw = &p->sweep[i];
            fprintf(f, "<tr%s><td>%s</td><td class=\"n\">%d</td><td class=\"n\">%d</td><td class=\"n\">%d</td>",
                    sw->chosen ? " class=\"chosen\"" : "", pd_role_name(sw->role), sw->dp, sw->ep, sw->instances);
            if (sw->verdict == PD_V_NOT_DIVISIBLE)
                fprintf(f, "<td class=\"n\">-</td><td class=\"n\">-</td><td class=\"n\">-</td><td class=\"n\">-</td>");
            else
                fprintf(f, "<td class=\"n\">%d</td><td class=\"n\">%s</td><td class=\"n\">%s</td><td class=\"n\">%s</td>",
                        sw->experts_per_card, G(a, sw->weights, u), G(b, sw->kv_pool, u), G(c, sw->kv_need, u));
            fprintf(f, "<td>%s%s</td></tr>\n", pd_verdict_text(sw->verdict), sw->chosen ? " (chosen)" : "");
        }
        fprintf(f, "</table>\n<p class=\"note\">Chosen: prefill, the smallest EP group that fits (most "
                   "instances); decode, the smallest whose KV room holds max-num-seqs &times; max-model-len.</p>\n");
    }
}

char *pd_report_html(const struct pd_plan *p, const struct pd_perf *pf, const struct pd_search *s, int u, pd_err *e)
{
    if (!p) {
        pd_err_set(e, PD_EINVAL, "html report: no plan");
        return NULL;
    }
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) {
        pd_err_set(e, PD_ENOMEM, "html report: out of memory");
        return NULL;
    }
    fprintf(f, "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
               "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<title>pdmoe plan: ");
    esc(f, p->model.name);
    fprintf(f, " on ");
    esc(f, p->hw.name);
    fprintf(f, "</title>\n<style>\n%s</style>\n</head>\n<body>\n", CSS);
    summary(f, p, s, u);
    memory_bars(f, p, u);
    expert_maps(f, p);
    if (s) {
        search_section(f, s);
        memory_table(f, s, u);
    }
    if (pf)
        perf_section(f, p, pf, u);
    plan_tables(f, p, u);
    fprintf(f, "<p class=\"note\">Written by pdmoe (plan version %d).</p>\n</body>\n</html>\n", PD_PLAN_VERSION);
    int bad = ferror(f);
    if (fclose(f) || bad) {
        free(buf);
        pd_err_set(e, PD_ENOMEM, "html report: out of memory");
        return NULL;
    }
    return buf;
}

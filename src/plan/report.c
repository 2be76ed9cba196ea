/* Plan reports: aligned text tables for a terminal and the versioned JSON document. */
#include "plan/plan.h"
#include "core/units.h"
#include "plan/nodes.h"
#include "plan/perf.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *G(char *buf, int64_t bytes, int u)
{
    return pd_units_fmt_g(buf, 32, bytes, (enum pd_units)u, 2);
}

static void ranges(FILE *f, const struct pd_placement *pl, int rank)
{
    /* prints the rank's experts as runs: "0-31" or "0-7, 200" */
    const int *s = pl->map + rank * pl->slots;
    for (int i = 0; i < pl->slots;) {
        int j = i;
        while (j + 1 < pl->slots && s[j + 1] == s[j] + 1)
            j++;
        if (j > i)
            fprintf(f, "%s%d-%d", i ? ", " : "", s[i], s[j]);
        else
            fprintf(f, "%s%d", i ? ", " : "", s[i]);
        i = j + 1;
    }
}

static void text_layout(FILE *f, const struct pd_plan *p)
{
    fprintf(f, "Layout (%d of %d cards: %d node%s x %d)\n", p->cards_used, p->cards_total, p->nodes,
            p->nodes == 1 ? "" : "s", p->hw.cards_per_node);
    /* the node map every launcher follows (plan/nodes.h): a layout it cannot place is said here,
     * not discovered at --emit or pdmoe up --hosts */
    struct pd_node_layout L;
    pd_err ne = {0};
    if (pd_nodes_build(p, &L, &ne) == 0)
        pd_nodes_free(&L);
    else
        fprintf(f, "  cannot be placed on the nodes: %s (--emit and pdmoe up --hosts refuse it)\n", ne.msg);
    fprintf(f, "  %-8s %4s %4s %10s %8s %6s %13s %10s\n", "role", "dp", "tp", "instances", "EP size", "cards",
            "experts/card", "redundant");
    for (int r = p->o.aggregated ? PD_ROLE_DECODE : 0; r < 2; r++) {
        const struct pd_role_plan *rp = &p->role[r];
        fprintf(f, "  %-8s %4d %4d %10d %8d %6d %13d %10d\n", p->o.aggregated ? "agg" : pd_role_name(rp->role), rp->o.dp,
                rp->o.tp, rp->o.instances, rp->ep, rp->cards, rp->place.slots, rp->o.redundant);
    }
    if (p->o.aggregated)
        fprintf(f, "  aggregated: every instance prefills and decodes on the same cards (chunked prefill); the prefill\n"
                   "  and decode columns below are the same cards, budgeted for both (a step of max-num-batched-tokens,\n"
                   "  the larger runtime reserve, KV for max-num-seqs sequences)\n");
    fprintf(f, "\n");
}

static void text_inventory(FILE *f, const struct pd_plan *p, int u)
{
    char a[40], b[40];
    fprintf(f, "Weights of the whole model (%s%s)\n", p->inv.from_checkpoint ? "from the checkpoint's headers" : "from the config",
            !p->include_mtp ? "" : p->model.dspark ? ", DSpark draft included" : ", MTP layer included");
    fprintf(f, "  %-22s %5s %18s %12s\n", "group", "class", "parameters", "bytes");
    for (int c = 0; c < 2; c++)
        for (int g = 0; g < PD_G_COUNT; g++) {
            if (!p->inv.group_bytes[g][c])
                continue;
            fprintf(f, "  %-22s %5s %18s %12s\n", pd_group_title((enum pd_group)g), c == PD_CLASS_I ? "I" : "II",
                    pd_units_thousands(a, p->inv.group_params[g][c]), G(b, p->inv.group_bytes[g][c], u));
        }
    for (int c = 0; c < 2; c++)
        fprintf(f, "  %-22s %5s %18s %12s\n", c == PD_CLASS_I ? "total class I" : "total class II", "",
                pd_units_thousands(a, p->inv.class_params[c]), G(b, p->inv.class_bytes[c], u));
    fprintf(f, "  %-22s %5s %18s %12s\n", "total", "", pd_units_thousands(a, p->inv.class_params[0] + p->inv.class_params[1]),
            G(b, p->inv.class_bytes[0] + p->inv.class_bytes[1], u));
    if (p->inv.n_unclassed) {
        fprintf(f, "  %d checkpoint tensor(s) could not be classed and are not counted:", p->inv.n_unclassed);
        for (int i = 0; i < p->inv.n_unclassed && i < PD_INV_MAX_UNCLASSED; i++)
            fprintf(f, "%s %s", i ? "," : "", p->inv.unclassed[i]);
        fprintf(f, "\n");
    }
    fprintf(f, "\n");
}

static void text_per_card(FILE *f, const struct pd_plan *p, int u)
{
    char a[40], b[40];
    const struct pd_role_plan *P = &p->role[0], *D = &p->role[1];
    fprintf(f, "Weights per card\n  %-26s %14s %14s\n", "", "prefill card", "decode card");
    int64_t bpe = p->inv.n_experts ? p->inv.expert_bytes[0] : 0;
    fprintf(f, "  %-26s %14s %14s\n", "Routed experts (I)", G(a, P->b.class_i, u), G(b, D->b.class_i, u));
    for (int g = 0; g < PD_G_COUNT; g++) {
        int64_t x = p->inv.group_bytes[g][PD_CLASS_II];
        if (!x)
            continue;
        int split = pd_group_tp_split((enum pd_group)g);
        char t[48];
        snprintf(t, sizeof t, "%s (II)", pd_group_title((enum pd_group)g));
        fprintf(f, "  %-26s %14s %14s\n", t, G(a, split ? (x + P->o.tp - 1) / P->o.tp : x, u),
                G(b, split ? (x + D->o.tp - 1) / D->o.tp : x, u));
    }
    fprintf(f, "  %-26s %14s %14s\n", "class II", G(a, P->b.class_ii, u), G(b, D->b.class_ii, u));
    fprintf(f, "  %-26s %14s %14s\n", "weights", G(a, P->b.weights, u), G(b, D->b.weights, u));
    fprintf(f, "  one routed expert over all %d MoE layers: %s; class I is the rank holding the most\n\n",
            p->inv.n_moe_layers, G(a, bpe, u));
}

static void text_placement(FILE *f, const struct pd_plan *p)
{
    for (int r = 0; r < 2; r++) {
        const struct pd_role_plan *rp = &p->role[r];
        fprintf(f, "Expert placement, %s (every one of its %d instance(s) is an EP group of %d)\n",
                pd_role_name(rp->role), rp->o.instances, rp->ep);
        for (int k = 0; k < rp->ep; k++) {
            fprintf(f, "  rank %2d: experts ", k);
            ranges(f, &rp->place, k);
            fprintf(f, "\n");
        }
        fprintf(f, "\n");
    }
}

static void text_kv(FILE *f, const struct pd_plan *p, int u)
{
    const struct pd_kv_size *k = &p->kv;
    char a[40], b[40];
    if (k->flat_per_token) {
        fprintf(f, "KV cache: a flat %lld B per token (given, not computed from the architecture)\n\n",
                (long long)k->flat_per_token);
        return;
    }
    fprintf(f, "KV cache per token, %s cache, from the architecture, in %s\n", pd_kv_dtype_name(k->dtype),
            pd_kv_layout_name(k));
    fprintf(f, "  %-8s %7s %14s\n", "layers", "count", "bytes/token");
    for (int i = 0; i < PD_KV_KINDS; i++)
        if (k->n_layers[i])
            fprintf(f, "  %-8s %7d %14.1f\n", pd_kv_kind_name((enum pd_kv_kind)i), k->n_layers[i], k->per_token_kind[i]);
    fprintf(f, "  entry %lld B per layer", (long long)k->entry_bytes);
    if (k->index_key_bytes)
        fprintf(f, ", indexer key %lld B", (long long)k->index_key_bytes);
    fprintf(f, "\n  marginal: %.1f B per token (%.2f KiB)\n", k->per_token, k->per_token / 1024.0);
    if (k->layout == PD_KV_LAYOUT_SGLANG_NPU) {
        /* the window row is every layer's share of the window pool (0.1 of a token each) */
        fprintf(f, "  SGLang sizes its pools at %.2f B per full token (fp8 entries of %lld B, keys of %lld B), they\n"
                   "  allocate %.1f; per request: compressor-state pages %s\n",
                k->sgl.bytes_per_full_token, (long long)k->sgl.acct_entry, (long long)k->sgl.acct_key, k->per_token,
                pd_units_fmt(a, 40, k->state_bytes, (enum pd_units)u));
    } else if (k->per_seq_fixed)
        fprintf(f, "  fixed per sequence: %s (windows of %lld tokens %s, compressor states %s)\n",
                pd_units_fmt(a, 40, k->per_seq_fixed, (enum pd_units)u), (long long)k->window,
                pd_units_fmt(b, 40, k->window_bytes, (enum pd_units)u), pd_units_fmt(b + 20, 20, k->state_bytes, (enum pd_units)u));
    fprintf(f, "  one sequence of %lld tokens: %s\n\n", (long long)p->o.max_model_len,
            pd_units_fmt(a, 40, pd_kv_seq_bytes(k, p->o.max_model_len), (enum pd_units)u));
}

static void text_budget(FILE *f, const struct pd_plan *p, int u)
{
    char a[40], b[40];
    const struct pd_role_plan *P = &p->role[0], *D = &p->role[1];
    /* the fraction as given when two decimals would round it (0.0402 read "x 0.04 = 3.44 GB") */
    fprintf(f, fabs(p->o.util * 100 - round(p->o.util * 100)) < 1e-9 ? "Memory budget per card: %s x %.2f = %s usable\n"
                                                                      : "Memory budget per card: %s x %g = %s usable\n",
            G(a, P->b.capacity, u), p->o.util, G(b, P->b.usable, u));
    fprintf(f, "  %-36s %14s %14s\n", "", "prefill card", "decode card");
#define ROW(label, fp, fd) fprintf(f, "  %-36s %14s %14s\n", label, G(a, fp, u), G(b, fd, u))
    ROW("weights (class I + class II)", P->b.weights, D->b.weights);
    char t[64];
    snprintf(t, sizeof t, "activations (%lld / %lld tokens a step)", (long long)P->act.tokens, (long long)D->act.tokens);
    ROW(t, P->b.activations, D->b.activations);
    ROW("runtime overhead", P->b.runtime, D->b.runtime);
    ROW("left for the KV cache", P->b.kv_pool, D->b.kv_pool);
    /* the chunks' window and state blocks, drawn from that pool (docs/memory-model.md) */
    if (P->b.kv_chunks || D->b.kv_chunks) {
        snprintf(t, sizeof t, "of it, chunks in flight (%lld tokens)", (long long)pd_plan_chunk_inflight_tokens(p, PD_ROLE_PREFILL));
        ROW(t, P->b.kv_chunks, D->b.kv_chunks);
    }
    /* and the admitted sequences' own steps in flight (MTP drafts, lookahead, async scheduling) */
    if (P->b.kv_decode_seq || D->b.kv_decode_seq) {
        snprintf(t, sizeof t, "of it, decodes in flight (%lld tokens)", (long long)pd_plan_decode_inflight_tokens(p, PD_ROLE_DECODE));
        ROW(t, P->b.kv_transient - P->b.kv_chunks - P->b.kv_tables, D->b.kv_transient - D->b.kv_chunks - D->b.kv_tables);
    }
    /* and SGLang's request tables on an NPU, rows of max-model-len and its headroom (plan.h) */
    if (P->b.kv_tables || D->b.kv_tables)
        ROW("of it, SGLang's request tables", P->b.kv_tables, D->b.kv_tables);
    /* a prefill rank holds one prompt; an aggregated instance max-num-seqs sequences on both */
    snprintf(t, sizeof t, "KV needed (%lld / %lld x %lld%s)", p->o.aggregated ? (long long)p->o.max_num_seqs : 1LL,
             (long long)p->o.max_num_seqs, (long long)p->o.max_model_len,
             P->b.kv_transient - P->b.kv_tables || D->b.kv_transient - D->b.kv_tables ? " + steps"
             : P->b.kv_tables || D->b.kv_tables                                     ? " + tables"
                                                                                    : " tokens");
    ROW(t, P->kv_need, D->kv_need);
#undef ROW
    fprintf(f, "  %-36s %14lld %14lld\n", "sequences of max-model-len that fit", (long long)P->seqs_at_max_len,
            (long long)D->seqs_at_max_len);
    /* a context past the model's positions is no context (serve refuses --max-model-len past it) */
    snprintf(t, sizeof t, "longest context for %lld sequences", (long long)p->o.max_num_seqs);
    const int64_t pos = p->model.max_position_embeddings;
    int64_t cp = pos > 0 && P->ctx_at_max_seqs > pos ? pos : P->ctx_at_max_seqs,
            cd = pos > 0 && D->ctx_at_max_seqs > pos ? pos : D->ctx_at_max_seqs;
    fprintf(f, "  %-36s %14lld %14lld\n", t, (long long)cp, (long long)cd);
    if (cp < P->ctx_at_max_seqs || cd < D->ctx_at_max_seqs)
        fprintf(f, "  (capped at the model's max_position_embeddings %lld; the pools hold %lld / %lld tokens)\n",
                (long long)pos, (long long)P->ctx_at_max_seqs, (long long)D->ctx_at_max_seqs);
    /* three verdicts, so none reads as more than it checks (plan.h) */
    fprintf(f, "  %-36s %14s %14s\n", "verdict: weights fit", P->b.fits_weights ? "yes" : "NO",
            D->b.fits_weights ? "yes" : "NO");
    fprintf(f, "  %-36s %14s %14s\n", "verdict: one max-model-len sequence", P->fits ? "fits" : "DOES NOT FIT",
            D->fits ? "fits" : "DOES NOT FIT");
    snprintf(t, sizeof t, "verdict: %lld of them (max-num-seqs)", (long long)p->o.max_num_seqs);
    char pv[24];   /* (pd_plan_prefill_lowered: "N launched") */
    if (pd_plan_prefill_lowered(p))
        snprintf(pv, sizeof pv, "%lld launched", (long long)pd_plan_admitted_seqs(p, PD_ROLE_PREFILL));
    else
        snprintf(pv, sizeof pv, "%s", P->fits_max_num_seqs ? "fit" : "DO NOT FIT");
    fprintf(f, "  %-36s %14s %14s\n", t, pv, D->fits_max_num_seqs ? "fit" : "DO NOT FIT");
    fprintf(f, "  prefill KV by the seed's rule, max-num-batched-tokens x KV/token: %s; a prompt of max-model-len\n"
               "  needs %s while it is prefilled in chunks%s",
            pd_units_fmt(a, 40, p->p_kv_batch, (enum pd_units)u),
            pd_units_fmt(b, 40, pd_kv_seq_bytes(&p->kv, p->o.max_model_len), (enum pd_units)u),
            p->o.aggregated ? "" : " and until decode has pulled it");
    if (P->b.kv_chunks)   /* (the row above: the chunks' window and state blocks) */
        fprintf(f, ",\n  and its chunks' window and state blocks %s more while %lld tokens are in flight (%d step%s of\n"
                   "  max-num-batched-tokens)",
                pd_units_fmt(a, 40, P->b.kv_chunks, (enum pd_units)u),
                (long long)pd_plan_chunk_inflight_tokens(p, PD_ROLE_PREFILL), pd_plan_steps_in_flight(p),
                pd_plan_steps_in_flight(p) == 1 ? "" : "s");
    fprintf(f, ".\n\n");
}

static void text_scenarios(FILE *f, const struct pd_plan *p, int u)
{
    char a[40], b[40];
    const struct pd_budget *db = &p->role[PD_ROLE_DECODE].b;
    fprintf(f, "Decode card KV scenarios (usable %s)\n", G(a, db->usable, u));
    fprintf(f, "  %6s %9s %14s %14s %7s  %s\n", "seqs", "context", "KV", "card total", "used", "verdict");
    for (int i = 0; i < p->n_scen; i++) {
        const struct pd_scenario *s = &p->scen[i];
        char used[16] = "      -";   /* (no usable memory: no share of it) */
        if (db->usable > 0)
            snprintf(used, sizeof used, "%6.0f%%", 100.0 * (double)s->total / (double)db->usable);
        fprintf(f, "  %6lld %9lld %14s %14s %7s  %s\n", (long long)s->seqs, (long long)s->ctx, G(a, s->kv, u),
                G(b, s->total, u), used, s->fits ? "fits" : "does not fit");
    }
    fprintf(f, "\n");
}

static void text_handoff(FILE *f, const struct pd_plan *p, int u)
{
    char a[40];
    fprintf(f, "KV hand-off, one prompt from a prefill card to a decode card\n");
    fprintf(f, "  %9s %14s %16s %16s\n", "tokens", "bytes", "RDMA", "TCP");
    for (int i = 0; i < p->n_handoff; i++) {
        const struct pd_handoff *h = &p->handoff[i];
        fprintf(f, "  %9lld %14s %13.1f ms %13.1f ms\n", (long long)h->tokens,
                pd_units_fmt(a, 40, h->bytes, (enum pd_units)u), h->rdma_s * 1e3, h->tcp_s * 1e3);
    }
    fprintf(f, "  RDMA: %s, %.1f GB/s + %.1f ms; TCP: %s, %.1f GB/s + %.1f ms\n\n", p->hw.rdma.name,
            p->hw.rdma.bandwidth_Bps / 1e9, p->hw.rdma.latency_s * 1e3, p->hw.tcp.name, p->hw.tcp.bandwidth_Bps / 1e9,
            p->hw.tcp.latency_s * 1e3);
}

static void text_sweep(FILE *f, const struct pd_plan *p, int u)
{
    char a[40], b[40], c[40];
    fprintf(f, "EP-size decision tree (dp-size sweep over each role's cards)\n");
    fprintf(f, "  %-8s %5s %5s %10s %13s %12s %12s %12s  %s\n", "role", "dp", "EP", "instances", "experts/card",
            "weights", "KV room", "KV target", "verdict");
    for (int i = 0; i < p->n_sweep; i++) {
        const struct pd_sweep_row *s = &p->sweep[i];
        if (s->verdict == PD_V_NOT_DIVISIBLE) {
            fprintf(f, "  %-8s %5d %5d %10d %13s %12s %12s %12s  %s\n", pd_role_name(s->role), s->dp, s->ep,
                    s->instances, "-", "-", "-", "-", pd_verdict_text(s->verdict));
            continue;
        }
        fprintf(f, "  %-8s %5d %5d %10d %13d %12s %12s %12s  %s%s\n", pd_role_name(s->role), s->dp, s->ep,
                s->instances, s->experts_per_card, G(a, s->weights, u), G(b, s->kv_pool, u), G(c, s->kv_need, u),
                pd_verdict_text(s->verdict), s->chosen ? "  <- sweep's pick" : "");
    }
    /* the picks are the sweep's rule, not the layout the tables above plan: say both */
    fprintf(f, "  sweep's pick: prefill, the smallest EP group that fits (most instances); decode, the smallest whose\n"
               "  KV room holds max-num-seqs x max-model-len. The plan above is the layout given (prefill EP%d x %d,\n"
               "  decode EP%d x %d); plan a pick with --prefill/--decode dp=N,instances=M.\n\n",
            p->role[0].ep, p->role[0].o.instances, p->role[1].ep, p->role[1].o.instances);
}

char *pd_plan_text(const struct pd_plan *p, int u)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f)
        return NULL;
    char q[128];
    fprintf(f, "pdmoe plan: %s (%s) on %s, %d node%s x %d %s\n", p->model.name, pd_model_arch_name(p->model.arch),
            p->hw.name, p->nodes, p->nodes == 1 ? "" : "s", p->hw.cards_per_node, p->hw.card_name);
    fprintf(f, "  weights %s, KV cache %s, %s; %s = %s bytes\n\n",
            p->inv.from_checkpoint ? "as stored in the checkpoint" : pd_quant_describe(&p->quant, q, sizeof q),
            pd_kv_dtype_name(p->kv.dtype),
            !p->include_mtp ? "no MTP layer" : p->model.dspark ? "DSpark draft loaded (its stages count as MTP layers)"
                                                               : "MTP layer loaded",
            pd_units_g_name((enum pd_units)u), u == PD_UNITS_GIB ? "2^30" : "10^9");
    pd_err fe = {0};
    if (pd_plan_formats_servable(p, &fe))   /* (what --emit refuses, said before any figure) */
        fprintf(f, "  NOT SERVABLE: %s\n\n", fe.msg);
    text_layout(f, p);
    text_inventory(f, p, u);
    text_per_card(f, p, u);
    text_budget(f, p, u);
    text_kv(f, p, u);
    text_scenarios(f, p, u);
    if (!p->o.aggregated)   /* (an aggregated instance decodes where it prefilled: no hand-off) */
        text_handoff(f, p, u);
    if (p->n_sweep)
        text_sweep(f, p, u);
    text_placement(f, p);
    fclose(f);
    return buf;
}

int pd_plan_print_inventory(const struct pd_plan *p, void *file, int u)
{
    FILE *f = file;
    char name[128], a[40];
    fprintf(f, "%-60s %-6s %-16s %-6s %-20s %5s %14s\n", "tensor", "class", "group", "format", "shape", "layer", "bytes");
    for (int i = 0; i < p->inv.n; i++) {
        const struct pd_tensor *t = &p->inv.t[i];
        char shape[40];
        if (t->ndim == 2)
            snprintf(shape, sizeof shape, "[%lld, %lld]", (long long)t->shape[0], (long long)t->shape[1]);
        else
            snprintf(shape, sizeof shape, "[%lld]", (long long)t->shape[0]);
        for (int k = 0; k < t->count; k++)
            fprintf(f, "%-60s %-6s %-16s %-6s %-20s %5d %14s\n", pd_inventory_expand_name(t, k, name, sizeof name),
                    t->cls == PD_CLASS_I ? "I" : "II", pd_group_name((enum pd_group)t->group), pd_fmt_name(t->fmt),
                    shape, t->layer, pd_units_thousands(a, t->bytes));
    }
    (void)u;
    return 0;
}

/* --- JSON --- */

static json_t *budget_json(const struct pd_plan *p, const struct pd_role_plan *rp)
{
    const struct pd_budget *b = &rp->b;
    const struct pd_activation *a = &rp->act;
    return json_pack("{s:I,s:I,s:I,s:I,s:I,s:{s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I},s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:b,s:b}",
                     "capacity_bytes", (json_int_t)b->capacity, "usable_bytes", (json_int_t)b->usable,
                     "class_i_bytes", (json_int_t)b->class_i, "class_ii_bytes", (json_int_t)b->class_ii,
                     "weights_bytes", (json_int_t)b->weights,
                     "activations", "tokens", (json_int_t)a->tokens, "residual_bytes", (json_int_t)a->residual,
                     "working_bytes", (json_int_t)a->working, "attention_bytes", (json_int_t)a->attention,
                     "moe_bytes", (json_int_t)a->moe, "indexer_bytes", (json_int_t)a->indexer,
                     "logits_bytes", (json_int_t)a->logits, "total_bytes", (json_int_t)a->total,
                     "runtime_bytes", (json_int_t)b->runtime, "kv_pool_bytes", (json_int_t)b->kv_pool,
                     "kv_transient_bytes", (json_int_t)b->kv_transient,
                     "kv_inflight_tokens", (json_int_t)pd_plan_chunk_inflight_tokens(p, rp->role),
                     "kv_chunks_bytes", (json_int_t)b->kv_chunks,
                     "kv_decode_inflight_tokens", (json_int_t)pd_plan_decode_inflight_tokens(p, rp->role),
                     "kv_decode_inflight_seq_bytes", (json_int_t)b->kv_decode_seq,
                     "kv_request_tables_bytes", (json_int_t)b->kv_tables,
                     "kv_need_bytes", (json_int_t)rp->kv_need, "seqs_at_max_model_len", (json_int_t)rp->seqs_at_max_len,
                     "max_context_at_max_num_seqs", (json_int_t)rp->ctx_at_max_seqs, "fits", rp->fits,
                     "fits_max_num_seqs", rp->fits_max_num_seqs);
}

/* A role's object; launched_max_num_seqs is what --emit and up give its servers (plan.h,
 * pd_plan_admitted_seqs). */
static json_t *role_json(const struct pd_plan *p, const struct pd_role_plan *rp)
{
    json_t *ranks = json_array();
    for (int k = 0; k < rp->ep; k++) {
        json_t *ex = json_array();
        for (int s = 0; s < rp->place.slots; s++)
            json_array_append_new(ex, json_integer(rp->place.map[k * rp->place.slots + s]));
        json_array_append_new(ranks, ex);
    }
    return json_pack("{s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:o,s:o,s:I}", "role", pd_role_name(rp->role),
                     "data_parallel_size", rp->o.dp, "tensor_parallel_size", rp->o.tp, "instances", rp->o.instances,
                     "ep_size", rp->ep, "cards", rp->cards, "redundant_experts", rp->o.redundant,
                     "experts_per_card", rp->place.slots, "expert_placement", ranks, "budget", budget_json(p, rp),
                     "launched_max_num_seqs", (json_int_t)pd_plan_admitted_seqs(p, rp->role));
}

char *pd_plan_json(const struct pd_plan *p, const struct pd_perf *f)
{
    return pd_plan_json_ext(p, f, NULL);
}

char *pd_plan_json_ext(const struct pd_plan *p, const struct pd_perf *f, void *validation)
{
    char q[128];
    json_t *groups = json_array();
    for (int c = 0; c < 2; c++)
        for (int g = 0; g < PD_G_COUNT; g++)
            if (p->inv.group_bytes[g][c])
                json_array_append_new(groups, json_pack("{s:s,s:s,s:I,s:I}", "group", pd_group_name((enum pd_group)g),
                                                        "class", c == PD_CLASS_I ? "I" : "II", "params",
                                                        (json_int_t)p->inv.group_params[g][c], "bytes",
                                                        (json_int_t)p->inv.group_bytes[g][c]));
    json_t *unclassed = json_array();
    for (int i = 0; i < p->inv.n_unclassed && i < PD_INV_MAX_UNCLASSED; i++)
        json_array_append_new(unclassed, json_string(p->inv.unclassed[i]));
    json_t *kinds = json_object();
    for (int i = 0; i < PD_KV_KINDS; i++)
        if (p->kv.n_layers[i])
            json_object_set_new(kinds, pd_kv_kind_name((enum pd_kv_kind)i),
                                json_pack("{s:i,s:f}", "layers", p->kv.n_layers[i], "bytes_per_token", p->kv.per_token_kind[i]));
    json_t *scen = json_array();
    for (int i = 0; i < p->n_scen; i++)
        json_array_append_new(scen, json_pack("{s:I,s:I,s:I,s:I,s:b}", "seqs", (json_int_t)p->scen[i].seqs, "context",
                                              (json_int_t)p->scen[i].ctx, "kv_bytes", (json_int_t)p->scen[i].kv,
                                              "card_total_bytes", (json_int_t)p->scen[i].total, "fits", p->scen[i].fits));
    json_t *hand = json_array();
    for (int i = 0; i < p->n_handoff; i++)
        json_array_append_new(hand, json_pack("{s:I,s:I,s:f,s:f}", "tokens", (json_int_t)p->handoff[i].tokens, "bytes",
                                              (json_int_t)p->handoff[i].bytes, "rdma_seconds", p->handoff[i].rdma_s,
                                              "tcp_seconds", p->handoff[i].tcp_s));
    json_t *sw = json_array();
    for (int i = 0; i < p->n_sweep; i++) {
        const struct pd_sweep_row *s = &p->sweep[i];
        json_array_append_new(sw, json_pack("{s:s,s:i,s:i,s:i,s:i,s:I,s:I,s:I,s:s,s:b}", "role", pd_role_name(s->role),
                                            "data_parallel_size", s->dp, "ep_size", s->ep, "instances", s->instances,
                                            "experts_per_card", s->experts_per_card, "weights_bytes", (json_int_t)s->weights,
                                            "kv_pool_bytes", (json_int_t)s->kv_pool, "kv_need_bytes", (json_int_t)s->kv_need,
                                            "verdict", pd_verdict_text(s->verdict), "chosen", s->chosen));
    }
    json_t *root = json_pack(
        "{s:i,s:{s:s,s:s,s:s,s:I,s:I,s:i,s:i,s:i,s:i},s:{s:s,s:s,s:s,s:i,s:i,s:i,s:I},s:{s:s,s:s,s:f,s:I,s:I,s:I,s:b,s:i},"
        "s:{s:o,s:I,s:I,s:I,s:I,s:I,s:o},s:{s:s,s:s,s:I,s:f,s:I,s:I,s:I,s:I,s:o},s:[o,o],s:I,s:o,s:o,s:o}",
        "plan_version", PD_PLAN_VERSION,
        "model", "name", p->model.name, "model_type", pd_model_arch_name(p->model.arch), "source", p->model.source,
        "hidden_size", (json_int_t)p->model.hidden_size, "vocab_size", (json_int_t)p->model.vocab_size,
        "num_hidden_layers", p->model.n_layers, "mtp_layers", p->include_mtp ? p->model.n_mtp_layers : 0,
        "n_routed_experts", p->model.n_routed_experts, "num_experts_per_tok", p->model.n_experts_per_tok,
        "hardware", "name", p->hw.name, "source", p->hw.source, "card", p->hw.card_name, "nodes", p->nodes,
        "cards_per_node", p->hw.cards_per_node, "cards_used", p->cards_used, "card_memory_bytes",
        (json_int_t)p->hw.card_memory_bytes,
        "options", "quantization", p->inv.from_checkpoint ? "checkpoint" : pd_quant_describe(&p->quant, q, sizeof q),
        "kv_cache_dtype", pd_kv_dtype_name(p->kv.dtype), "gpu_memory_utilization", p->o.util, "max_num_seqs",
        (json_int_t)p->o.max_num_seqs, "max_model_len", (json_int_t)p->o.max_model_len, "max_num_batched_tokens",
        (json_int_t)p->o.max_num_batched_tokens, "mtp", p->include_mtp, "num_speculative_tokens", p->mtp.k,
        "inventory", "groups", groups, "class_i_bytes", (json_int_t)p->inv.class_bytes[0], "class_ii_bytes",
        (json_int_t)p->inv.class_bytes[1], "class_i_params", (json_int_t)p->inv.class_params[0], "class_ii_params",
        (json_int_t)p->inv.class_params[1], "expert_bytes_all_layers",
        (json_int_t)(p->inv.n_experts ? p->inv.expert_bytes[0] : 0), "unclassed_tensors", unclassed,
        "kv_cache", "dtype", pd_kv_dtype_name(p->kv.dtype), "layout", pd_kv_layout_name(&p->kv), "flat_bytes_per_token", (json_int_t)p->kv.flat_per_token,
        "bytes_per_token", p->kv.per_token, "bytes_per_seq_fixed", (json_int_t)p->kv.per_seq_fixed, "entry_bytes",
        (json_int_t)p->kv.entry_bytes, "window_tokens", (json_int_t)p->kv.window, "max_model_len_seq_bytes",
        (json_int_t)pd_kv_seq_bytes(&p->kv, p->o.max_model_len), "layers", kinds,
        "roles", role_json(p, &p->role[0]), role_json(p, &p->role[1]),
        "prefill_kv_batch_rule_bytes", (json_int_t)p->p_kv_batch,
        "decode_scenarios", scen, "handoff", hand, "sweep", sw);
    /* the node map every launcher follows (plan/nodes.h), when the layout splits into nodes */
    if (root)
        json_object_set_new(root, "aggregated", json_boolean(p->o.aggregated));
    if (root)   /* vLLM's scheduling, whose steps in flight the KV budget counts */
        json_object_set_new(json_object_get(root, "options"), "async_scheduling",
                            json_boolean(!p->o.no_async_scheduling));
    pd_err fe = {0};   /* null, or why the cards cannot serve these formats (what --emit refuses) */
    if (root)
        json_object_set_new(root, "not_servable", pd_plan_formats_servable(p, &fe) ? json_string(fe.msg) : json_null());
    pd_err ne = {0};
    json_t *map = root ? pd_nodes_json(p, &ne) : NULL;
    /* none: why, for the reader of the JSON (pdmoe up --hosts says it) */
    if (root && json_object_set_new(root, map ? "node_map" : "node_map_error", map ? map : json_string(ne.msg))) {
        json_decref(root);
        return NULL;
    }
    json_t *pj = root && f ? pd_perf_json(f) : NULL, *val = validation;   /* val: taken, always */
    if (pj && val)
        json_object_set_new(pj, "validation", val);   /* (which frees val if it cannot hold it) */
    else
        json_decref(val);
    if (!root || (f && (!pj || json_object_set_new(root, "perf", pj)))) {
        json_decref(root);
        return NULL;
    }
    char *s = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(root);
    return s;
}

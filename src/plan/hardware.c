/* hardware/ *.json -> struct pd_hardware, every field checked. */
#include "core/text.h"
#include "plan/hardware.h"
#include "core/file.h"
#include "model/config.h"
#include "model/jsonf.h"

#include <stdio.h>
#include <stdlib.h>
#include <ctype.h>
#include <string.h>
#include <sys/stat.h>

static int link_parse(const char *file, json_t *links, const char *key, struct pd_link *l, pd_err *e)
{
    char pfx[64];
    snprintf(pfx, sizeof pfx, "links.%s.", key);
    json_t *o = json_object_get(links, key);
    if (!json_is_object(o))
        return pd_err_set(e, PD_EINVAL, "%s: missing required field \"links.%s\" (an object)", file, key);
    struct pd_jsrc s = {file, pfx};
    int rc;
    static const char *const known[] = {"name", "bandwidth_Bps", "latency_s", NULL};
    if ((rc = pd_json_str(&s, o, "name", 1, "", l->name, sizeof l->name, e)) ||
        (rc = pd_json_num(&s, o, "bandwidth_Bps", 1, 0, 1, 1e15, &l->bandwidth_Bps, e)) ||
        (rc = pd_json_num(&s, o, "latency_s", 1, 0, 0, 10, &l->latency_s, e)) ||
        (rc = pd_json_known(&s, o, known, e)))
        return rc;
    return 0;
}

/* Every factor is required and must have a source string: no hidden constants. */
static int efficiency_parse(const char *file, json_t *root, struct pd_efficiency *f, pd_err *e)
{
    json_t *o = json_object_get(root, "efficiency");
    if (!json_is_object(o))
        return pd_err_set(e, PD_EINVAL, "%s: missing required field \"efficiency\" (an object)", file);
    json_t *src = json_object_get(json_object_get(root, "sources"), "efficiency");
    const struct { const char *key; double *dst, min, max; } f8[] = {
        {"gemm", &f->gemm, 1e-3, 1}, {"memory", &f->memory, 1e-3, 1}, {"attention", &f->attention, 1e-3, 1},
        {"a2a_intra", &f->a2a_intra, 1e-3, 1}, {"a2a_inter", &f->a2a_inter, 1e-3, 1},
        {"a2a_latency_s", &f->a2a_latency_s, 0, 1},
        {"imbalance_prefill", &f->imbalance[0], 1, 64}, {"imbalance_decode", &f->imbalance[1], 1, 64},
        {"imbalance_eplb_prefill", &f->imbalance_eplb[0], 1, 64}, {"imbalance_eplb_decode", &f->imbalance_eplb[1], 1, 64},
        {"overlap_prefill", &f->overlap[0], 0, 1}, {"overlap_decode", &f->overlap[1], 0, 1},
        {"step_prefill_s", &f->step_s[0], 0, 10}, {"step_decode_s", &f->step_s[1], 0, 10},
        {"token_layer_prefill_s", &f->token_layer_s[0], 0, 1},
        {"token_layer_decode_s", &f->token_layer_s[1], 0, 1}, {"mtp_acceptance", &f->mtp_acceptance, 0, 1},
        {"request_s", &f->request_s, 0, 10},
    };
    struct pd_jsrc s = {file, "efficiency."};
    static const char *const known[] = {"gemm", "memory", "attention", "a2a_intra", "a2a_inter", "a2a_latency_s",
                                        "imbalance_prefill", "imbalance_decode", "imbalance_eplb_prefill",
                                        "imbalance_eplb_decode", "overlap_prefill", "overlap_decode", "step_prefill_s",
                                        "step_decode_s", "token_layer_prefill_s", "token_layer_decode_s",
                                        "mtp_acceptance", "request_s", "layer_prefill_s", "layer_decode_s",
                                        "fp4_memory", NULL};
    for (size_t i = 0; i < sizeof f8 / sizeof f8[0]; i++) {
        int rc = pd_json_num(&s, o, f8[i].key, 1, 0, f8[i].min, f8[i].max, f8[i].dst, e);
        if (rc)
            return rc;
        if (!json_is_string(json_object_get(src, f8[i].key)))
            return pd_err_set(e, PD_EINVAL, "%s: field \"sources.efficiency.%s\": every efficiency factor needs its source",
                              file, f8[i].key);
    }
    /* optional (0 when absent: a card without a fit for it, or a CPU whose calibrated per-step
     * cost holds it), sourced when given */
    const struct { const char *key; double *dst, dflt, min; } opt[] = {{"layer_prefill_s", &f->layer_s[0], 0, 0},
                                                                      {"layer_decode_s", &f->layer_s[1], 0, 0},
                                                                      {"fp4_memory", &f->fp4_memory, 1, 1e-3}};
    for (size_t i = 0; i < sizeof opt / sizeof opt[0]; i++) {
        int rc = pd_json_num(&s, o, opt[i].key, 0, opt[i].dflt, opt[i].min, 1, opt[i].dst, e);
        if (rc)
            return rc;
        if (json_object_get(o, opt[i].key) && !json_is_string(json_object_get(src, opt[i].key)))
            return pd_err_set(e, PD_EINVAL, "%s: field \"sources.efficiency.%s\": every efficiency factor needs its source",
                              file, opt[i].key);
    }
    return pd_json_known(&s, o, known, e);   /* (after the fields: a misspelt required one is missing) */
}

int pd_hardware_parse(const char *text, const char *label, struct pd_hardware *h, pd_err *e)
{
    memset(h, 0, sizeof *h);
    pd_text_safe(h->source, sizeof h->source, label);
    json_t *root = pd_json_load_str(text, label, e);
    if (!root)
        return e ? e->code : PD_EFORMAT;
    struct pd_jsrc s = {label, ""};
    int rc;
    /* a misspelt key would leave its field at the default without a word (sources is free text) */
    static const char *const known[] = {"name", "description", "cluster_nodes", "cards_per_node", "card", "links",
                                        "efficiency", "runtime_overhead_bytes", "redundant_experts", "sources", NULL};
    static const char *const card_known[] = {"name", "memory_bytes", "memory_bandwidth_Bps", "bf16_flops", "int8_ops",
                                             "fp8_flops", NULL};
    static const char *const links_known[] = {"intra_node", "inter_node_rdma", "inter_node_tcp", NULL};
    static const char *const ro_known[] = {"prefill", "decode", NULL};
    if ((rc = pd_json_str(&s, root, "name", 1, "", h->name, sizeof h->name, e)) ||
        (rc = pd_json_i32(&s, root, "cluster_nodes", 0, 1, 1, 1 << 20, &h->cluster_nodes, e)) ||
        (rc = pd_json_i32(&s, root, "cards_per_node", 1, 0, 1, 1024, &h->cards_per_node, e)))
        goto out;
    json_t *card = json_object_get(root, "card");
    if (!json_is_object(card)) {
        rc = pd_err_set(e, PD_EINVAL, "%s: missing required field \"card\" (an object)", label);
        goto out;
    }
    struct pd_jsrc cs = {label, "card."}, ls = {label, "links."};
    double mem;
    if ((rc = pd_json_str(&cs, card, "name", 1, "", h->card_name, sizeof h->card_name, e)) ||
        (rc = pd_json_num(&cs, card, "memory_bytes", 1, 0, 1, 1e15, &mem, e)) ||
        (rc = pd_json_num(&cs, card, "memory_bandwidth_Bps", 1, 0, 1, 1e15, &h->mem_bw_Bps, e)) ||
        /* the predictions divide by it (attention runs in bf16 on every card): 0 would give inf */
        (rc = pd_json_num(&cs, card, "bf16_flops", 1, 0, 1, 1e18, &h->bf16_flops, e)) ||
        (rc = pd_json_num(&cs, card, "int8_ops", 1, 0, 0, 1e18, &h->int8_ops, e)) ||
        (rc = pd_json_num(&cs, card, "fp8_flops", 0, 0, 0, 1e18, &h->fp8_flops, e)))
        goto out;
    /* 0 says the card has no such unit (the formats fall back to bf16); a rate below one
     * operation a second is no rate: the predictions would be infinite */
    const struct { const char *name; double rate; } units[] = {{"int8_ops", h->int8_ops}, {"fp8_flops", h->fp8_flops}};
    for (int i = 0; i < 2; i++)
        if (units[i].rate > 0 && units[i].rate < 1) {
            rc = pd_err_set(e, PD_EINVAL, "%s: field \"card.%s\": %g is neither 0 (no such unit) nor at least 1", label,
                            units[i].name, units[i].rate);
            goto out;
        }
    h->card_memory_bytes = (int64_t)mem;
    json_t *links = json_object_get(root, "links");
    if (!json_is_object(links)) {
        rc = pd_err_set(e, PD_EINVAL, "%s: missing required field \"links\" (an object)", label);
        goto out;
    }
    if ((rc = link_parse(label, links, "intra_node", &h->intra, e)) ||
        (rc = link_parse(label, links, "inter_node_rdma", &h->rdma, e)) ||
        (rc = link_parse(label, links, "inter_node_tcp", &h->tcp, e)))
        goto out;
    json_t *ro = json_object_get(root, "runtime_overhead_bytes");
    if (!json_is_object(ro)) {
        rc = pd_err_set(e, PD_EINVAL, "%s: missing required field \"runtime_overhead_bytes\" (an object)", label);
        goto out;
    }
    struct pd_jsrc rs = {label, "runtime_overhead_bytes."};
    double p, d;
    if ((rc = pd_json_num(&rs, ro, "prefill", 1, 0, 0, 1e15, &p, e)) ||
        (rc = pd_json_num(&rs, ro, "decode", 1, 0, 0, 1e15, &d, e)))
        goto out;
    h->runtime_prefill_bytes = (int64_t)p;
    h->runtime_decode_bytes = (int64_t)d;
    if ((rc = pd_json_bool(&s, root, "redundant_experts", 0, 1, &h->redundant_experts, e)))
        goto out;
    if (!h->redundant_experts && !json_is_string(json_object_get(json_object_get(root, "sources"), "redundant_experts"))) {
        rc = pd_err_set(e, PD_EINVAL, "%s: field \"sources.redundant_experts\": say why the stack has no redundant experts",
                        label);
        goto out;
    }
    if ((rc = efficiency_parse(label, root, &h->eff, e)))
        goto out;
    /* after the fields (a misspelt required one is reported missing): a key nothing reads */
    if ((rc = pd_json_known(&s, root, known, e)) || (rc = pd_json_known(&cs, card, card_known, e)) ||
        (rc = pd_json_known(&ls, links, links_known, e)) || (rc = pd_json_known(&rs, ro, ro_known, e)))
        goto out;
out:
    json_decref(root);
    return rc;
}

int pd_hardware_load(const char *spec, struct pd_hardware *h, pd_err *e)
{
    struct stat st;
    char path[512];
    if (!spec || !*spec)
        return pd_err_set(e, PD_EINVAL, "--hardware: empty name");
    /* a path: a regular file (a FIFO or a device is named, never waited on) */
    if (stat(spec, &st) == 0 && !S_ISDIR(st.st_mode)) {
        char *text = pd_file_read(spec, 16 << 20, NULL, e);
        if (!text)
            return e && e->code ? e->code : PD_EIO;
        int rc = pd_hardware_parse(text, spec, h, e);
        free(text);
        return rc;
    }
    /* NAME: hardware/NAME.json on disk (pdmoe calibrate --out writes there; an edited preset is
     * read as edited), else the preset built in */
    snprintf(path, sizeof path, "hardware/%s.json", spec);
    if (!strchr(spec, '/') && stat(path, &st) == 0)
        return pd_hardware_load(path, h, e);
    const char *text = pd_embedded_find(spec);
    snprintf(path, sizeof path, "%s", spec);
    if (!text) {
        snprintf(path, sizeof path, "hardware/%s.json", spec);
        text = pd_embedded_find(path);
    }
    if (!text && stat(spec, &st) == 0 && S_ISDIR(st.st_mode))
        return pd_err_set(e, PD_EIO, "--hardware %s: is a directory; give a hardware .json file or a preset", spec);
    if (!text)
        return pd_err_set(e, PD_EIO, "--hardware %s: no such file or preset (presets: atlas-800i-a2, atlas-800i-a3, h800, h100, h200, b200)", spec);
    return pd_hardware_parse(text, path, h, e);
}

int pd_hardware_is_ascend(const struct pd_hardware *h)
{
    return strstr(h->card_name, "Ascend") != NULL;
}

/* a word of s (not part of a longer one: "H100" in "H100 SXM 80 GB", not in "XH1000") */
static int has_word(const char *s, const char *w)
{
    size_t n = strlen(w);
    for (const char *p = strstr(s, w); p; p = strstr(p + 1, w))
        if ((p == s || !isalnum((unsigned char)p[-1])) && !isalnum((unsigned char)p[n]))
            return 1;
    return 0;
}

const char *pd_hardware_family(const struct pd_hardware *h)
{
    if (pd_hardware_is_ascend(h))
        return "Ascend";
    static const char *const nvidia[] = {"A100", "H20", "H100", "H200", "H800", "B200", "B300", "GB200", "HGX", "DGX", "NVIDIA"};
    for (size_t i = 0; i < sizeof nvidia / sizeof nvidia[0]; i++)
        if (has_word(h->card_name, nvidia[i]) || has_word(h->name, nvidia[i]))
            return "NVIDIA";
    return NULL;
}

/* `pdmoe up`'s reading of a plan (up.h): the instances' counts, EP sizes, KV pools and scheduler
 * limits from pdmoe plan --json, checked against the model up serves; the --hosts list and the
 * plan's node map on it; whether the pools fit this machine. */
#include "cli/up.h"
#include "engine/spec.h"
#include "model/config.h"
#include "model/jsonf.h"

#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int plan_int(const char *path, json_t *o, const char *where, const char *key, int64_t min, int64_t max,
                    int64_t *out)
{
    json_t *v = json_object_get(o, key);
    if (!json_is_integer(v) || json_integer_value(v) < min || json_integer_value(v) > max) {
        fprintf(stderr, "pdmoe up: --plan %s: field \"%s%s\": expected an integer in [%lld, %lld]\n", path, where, key,
                (long long)min, (long long)max);
        return -1;
    }
    *out = json_integer_value(v);
    return 0;
}

/* The plan's model (its "model" object: what it sized) against the one up serves: the shapes that
 * size weights and KV must agree, else the pools it sets are another model's. */
static int same_model(const char *path, json_t *pm, const char *model)
{
    struct pd_model m;
    pd_err e = {0};
    if (pd_model_load_as("--model", model, &m, &e)) {
        fprintf(stderr, "pdmoe up: %s\n", e.msg);
        return -1;
    }
    const struct {
        const char *key;
        int64_t ours;
    } f[] = {{"hidden_size", m.hidden_size}, {"vocab_size", m.vocab_size}, {"num_hidden_layers", m.n_layers},
             {"n_routed_experts", m.n_routed_experts}, {"num_experts_per_tok", m.n_experts_per_tok}};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        json_t *v = json_object_get(pm, f[i].key);
        if (!json_is_integer(v) || json_integer_value(v) != f[i].ours) {
            const char *name = json_string_value(json_object_get(pm, "name"));
            fprintf(stderr, "pdmoe up: --plan %s was made for another model (%s): its model.%s is %lld, --model %s has "
                            "%lld; plan for this one (pdmoe plan --model %s ... --json)\n", path, name ? name : "?",
                    f[i].key, json_is_integer(v) ? (long long)json_integer_value(v) : -1LL, model, (long long)f[i].ours,
                    model);
            return -1;
        }
    }
    return 0;
}

int up_read_plan(const char *path, struct up_plan *u, int on_hosts, const char *model)
{
    pd_err e = {0};
    json_t *j = pd_json_load_file(path, &e);   /* (a regular file; duplicate keys refused) */
    if (!j) {
        fprintf(stderr, "pdmoe up: --plan %s\n", e.msg);
        return -1;
    }
    int rc = -1;
    json_t *roles = json_object_get(j, "roles"), *opt = json_object_get(j, "options");
    if (json_integer_value(json_object_get(j, "plan_version")) != 1 || !json_is_array(roles) ||
        json_array_size(roles) != 2 || !json_is_object(opt)) {
        fprintf(stderr, "pdmoe up: --plan %s: not a plan_version 1 document from pdmoe plan --json\n", path);
        goto out;
    }
    if (plan_int(path, opt, "options.", "max_num_seqs", 1, 4096, &u->max_num_seqs) ||
        plan_int(path, opt, "options.", "max_model_len", 16, 1 << 24, &u->max_model_len) ||
        plan_int(path, opt, "options.", "max_num_batched_tokens", 1, 1 << 24, &u->max_num_batched_tokens) ||
        plan_int(path, opt, "options.", "num_speculative_tokens", 0, PD_SPEC_MAX_K, &u->spec_k))
        goto out;
    u->util = json_number_value(json_object_get(opt, "gpu_memory_utilization"));
    const char *dt = json_string_value(json_object_get(opt, "kv_cache_dtype"));
    if (!dt || (strcmp(dt, "bf16") && strcmp(dt, "fp8"))) {
        fprintf(stderr, "pdmoe up: --plan %s: field \"options.kv_cache_dtype\": expected \"bf16\" or \"fp8\"\n", path);
        goto out;
    }
    snprintf(u->kv_cache_dtype, sizeof u->kv_cache_dtype, "%s", dt);
    json_t *agg = json_object_get(j, "aggregated");
    if (agg && !json_is_boolean(agg)) {
        fprintf(stderr, "pdmoe up: --plan %s: field \"aggregated\": expected true or false\n", path);
        goto out;
    }
    u->aggregated = json_is_true(agg);
    if (same_model(path, json_object_get(j, "model"), model))
        goto out;
    for (int r = 0; r < 2; r++) {
        json_t *x = json_array_get(roles, (size_t)r);
        char where[48];
        int64_t inst, size, kv;
        snprintf(where, sizeof where, "roles[%d].", r);
        json_t *tp = json_object_get(x, "tensor_parallel_size");
        if (plan_int(path, x, where, "instances", 1, 16, &inst))
            goto out;
        if (plan_int(path, x, where, "ep_size", 1, 1 << 20, &size))
            goto out;
        if ((!on_hosts && size > MAX_EP) || (tp && json_integer_value(tp) != 1)) {
            fprintf(stderr, "pdmoe up: --plan %s: roles[%d] has EP size %lld, TP %lld; pdmoe runs tp=1%s\n", path, r,
                    (long long)size, tp ? (long long)json_integer_value(tp) : 1LL,
                    on_hosts ? "" : ", and EP 1 to 8 on one machine (more across hosts: --hosts)");
            goto out;
        }
        /* redundant experts (EPLB's replicas) are a plan the engine cannot run: refused, not dropped */
        json_t *red = json_object_get(x, "redundant_experts");
        if (json_integer_value(red) > 0) {
            fprintf(stderr, "pdmoe up: --plan %s: roles[%d] has %lld redundant experts; pdmoe serve places each expert "
                            "once (plan with redundant=0)\n", path, r, (long long)json_integer_value(red));
            goto out;
        }
        snprintf(where, sizeof where, "roles[%d].budget.", r);
        json_t *budget = json_object_get(x, "budget");
        /* the plan's own verdict: a role whose weights or one max-model-len sequence do not fit
         * would only fail at start, again at each restart */
        json_t *fits = json_object_get(budget, "fits");
        if (!json_is_true(fits)) {
            fprintf(stderr, "pdmoe up: --plan %s: field \"roles[%d].budget.fits\": %s: the plan says its %s role does not "
                            "fit (its weights, or one sequence of max-model-len %lld in its KV pool); plan another "
                            "layout\n", path, r, fits ? "false" : "missing", r ? "decode" : "prefill",
                    (long long)u->max_model_len);
            goto out;
        }
        if (plan_int(path, budget, where, "kv_pool_bytes", 1, INT64_MAX, &kv))
            goto out;
        snprintf(where, sizeof where, "roles[%d].", r);
        u->launched_seqs[r] = u->max_num_seqs;
        if (json_object_get(x, "launched_max_num_seqs") &&
            plan_int(path, x, where, "launched_max_num_seqs", 1, u->max_num_seqs, &u->launched_seqs[r]))
            goto out;
        u->instances[r] = (int)inst;
        u->ep[r] = (int)size;
        u->kv_pool[r] = kv;
    }
    rc = 0;
out:
    json_decref(j);
    return rc;
}

/* --hosts H0,H1,...: the nodes' addresses in node order (the plan's node map numbers them), each
 * where that node's servers bind and are reached. */
int up_parse_hosts(const char *arg, char **hosts, int *n)
{
    static char buf[8192];
    if (strlen(arg) >= sizeof buf) {
        fprintf(stderr, "pdmoe up: --hosts: longer than %zu characters\n", sizeof buf - 1);
        return -1;
    }
    snprintf(buf, sizeof buf, "%s", arg);
    *n = 0;
    for (char *save = NULL, *h = strtok_r(buf, ",", &save); h; h = strtok_r(NULL, ",", &save)) {
        size_t len = strlen(h);
        int ok = len > 0 && len < 64;
        for (const char *q = h; *q; q++)
            ok &= (*q >= 'a' && *q <= 'z') || (*q >= 'A' && *q <= 'Z') || (*q >= '0' && *q <= '9') || *q == '.' ||
                  *q == '-' || *q == ':' || *q == '_';
        if (!ok || *n == MAX_HOSTS) {
            fprintf(stderr, "pdmoe up: --hosts: host %d \"%s\": %s\n", *n + 1, h,
                    *n == MAX_HOSTS ? "more than 256 hosts" : "expected an address or host name (letters, digits, '.', "
                                                            "'-', ':', '_'; under 64 characters)");
            return -1;
        }
        for (int i = 0; i < *n; i++)
            if (!strcmp(hosts[i], h)) {
                fprintf(stderr, "pdmoe up: --hosts: %s is listed twice (hosts %d and %d); each node needs its own\n", h,
                        i + 1, *n + 1);
                return -1;
            }
        hosts[(*n)++] = h;
    }
    if (!*n) {
        fprintf(stderr, "pdmoe up: --hosts: no host given\n");
        return -1;
    }
    return 0;
}

/* The plan's node map ("node_map": which nodes, and how many ranks on each, every instance
 * runs on) on the --hosts: instance i's group g on hosts[nodes[g]]. */
int up_read_node_map(const char *path, char **hosts, int nhosts, int aggregated, struct pd_launch_inst *inst,
                      int *n)
{
    pd_err e = {0};
    json_t *j = pd_json_load_file(path, &e), *map = j ? json_object_get(j, "node_map") : NULL;
    int rc = -1, top = -1;
    if (!j) {
        fprintf(stderr, "pdmoe up: --plan %s\n", e.msg);
        goto out;
    }
    const char *why = json_string_value(json_object_get(j, "node_map_error"));
    if (!map && why) {
        fprintf(stderr, "pdmoe up: --plan %s: its layout cannot be placed on the nodes: %s\n", path, why);
        goto out;
    }
    if (!json_is_array(map) || !json_array_size(map) || json_array_size(map) > MAX_CHILDREN - 1) {
        fprintf(stderr, "pdmoe up: --plan %s: no \"node_map\" of 1 to %d instances (write the plan with this "
                        "pdmoe's plan --json)\n", path, MAX_CHILDREN - 1);
        goto out;
    }
    size_t i;
    json_t *x;
    json_array_foreach(map, i, x) {
        const char *role = json_string_value(json_object_get(x, "role"));
        json_t *nodes = json_object_get(x, "nodes"), *ranks = json_object_get(x, "ranks"),
               *in = json_object_get(x, "instance");
        size_t g = json_array_size(nodes);
        if (!role || (strcmp(role, "prefill") && strcmp(role, "decode")) || !json_is_integer(in) || !g ||
            g > PD_LAUNCH_MAX_HOSTS || json_array_size(ranks) != g) {
            fprintf(stderr, "pdmoe up: --plan %s: node_map[%zu]: expected {\"role\": \"prefill\"|\"decode\", "
                            "\"instance\": N, \"nodes\": [...], \"ranks\": [...]} with 1 to %d nodes\n", path, i,
                    PD_LAUNCH_MAX_HOSTS);
            goto out;
        }
        struct pd_launch_inst *d = &inst[i];
        if (aggregated && strcmp(role, "decode")) {
            fprintf(stderr, "pdmoe up: --plan %s: node_map[%zu]: an aggregated plan's instances are \"decode\" "
                            "(colocated), not \"%s\"\n", path, i, role);
            goto out;
        }
        *d = (struct pd_launch_inst){.role = strcmp(role, "prefill") != 0, .inst = (int)json_integer_value(in),
                                     .n_groups = (int)g, .colocated = aggregated};
        for (size_t k = 0; k < g; k++) {
            json_t *nd = json_array_get(nodes, k), *rk = json_array_get(ranks, k);
            if (!json_is_integer(nd) || json_integer_value(nd) < 0 || json_integer_value(nd) >= 1 << 20 ||
                !json_is_integer(rk) || json_integer_value(rk) < 1 || json_integer_value(rk) > 1024) {
                fprintf(stderr, "pdmoe up: --plan %s: node_map[%zu]: nodes and ranks must be node numbers and rank "
                                "counts (1 to 1024)\n", path, i);
                goto out;
            }
            int node = (int)json_integer_value(nd);
            if (node > top)
                top = node;
            d->group[k] = (struct pd_launch_group){.host = node < nhosts ? hosts[node] : NULL,
                                                   .ranks = (int)json_integer_value(rk)};
            d->ranks += d->group[k].ranks;
        }
    }
    if (top >= nhosts) {
        fprintf(stderr, "pdmoe up: --hosts: %d given but the plan's node map uses %d nodes (--plan %s)\n", nhosts,
                top + 1, path);
        goto out;
    }
    *n = (int)json_array_size(map);
    rc = 0;
out:
    json_decref(j);
    return rc;
}

/* Every rank's KV pool is allocated in full and the weights are mapped once (page cache shared by
 * the ranks): both must fit in this machine's memory, with a tenth left for everything else. */
/* The bytes of the checkpoint's safetensors files in dir (one file or shards). */
static double checkpoint_bytes(const char *dir)
{
    double sum = 0;
    DIR *d = opendir(dir);
    struct dirent *de;
    while (d && (de = readdir(d))) {
        size_t n = strlen(de->d_name);
        char f[1200];
        struct stat st;
        snprintf(f, sizeof f, "%s/%s", dir, de->d_name);
        if (n > 12 && !strcmp(de->d_name + n - 12, ".safetensors") && stat(f, &st) == 0 && S_ISREG(st.st_mode))
            sum += (double)st.st_size;
    }
    if (d)
        closedir(d);
    return sum;
}

int up_plan_fits(const char *path, const struct up_plan *u, const char *model)
{
    double need = checkpoint_bytes(model);   /* (mapped once, its pages shared by the ranks) */
    for (int r = u->aggregated; r < 2; r++)   /* (aggregated: both roles list the same instances) */
        need += (double)u->instances[r] * u->ep[r] * (double)u->kv_pool[r];
    double have = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
    if (need > 0.9 * have) {
        char why[200];
        if (u->util > 0.9)   /* a plan of this machine's own calibration, at a utilization up cannot give */
            snprintf(why, sizeof why, "up keeps a tenth of it for everything else, and the plan's "
                     "--gpu-memory-utilization %g leaves none: plan with 0.9 or less", u->util);
        else
            snprintf(why, sizeof why, "plan for it (pdmoe calibrate --out hardware/local-cpu.json, then pdmoe plan "
                     "--hardware local-cpu ...)");
        fprintf(stderr, "pdmoe up: --plan %s: its KV pools (prefill %d x %d ranks x %.2f GB, decode %d x %d x %.2f GB) "
                        "and the model need %.2f GB; this machine has %.2f GB: %s\n",
                path, u->instances[0], u->ep[0], u->kv_pool[0] / 1e9, u->instances[1], u->ep[1], u->kv_pool[1] / 1e9,
                need / 1e9, have / 1e9, why);
        return -1;
    }
    return 0;
}

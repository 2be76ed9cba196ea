/* pdmoe's instance command lines (launch.h). */
#define _GNU_SOURCE   /* vasprintf, open_memstream */
#include "plan/launch.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int pd_launch_ports(struct pd_launch_inst *x, int n, int base_port, pd_err *e)
{
    if (n > 99)   /* HTTP ports base + 1 ... base + n stay below the KV ports from base + 100 */
        return pd_err_set(e, PD_EINVAL, "%d instances: their HTTP ports (--port %d + 1 ...) would reach the KV "
                          "ports (from --port + 100); at most 99", n, base_port);
    int step = 8;
    for (int i = 0; i < n; i++)
        if (x[i].role == 0 && x[i].ranks > step)
            step = (x[i].ranks + 7) / 8 * 8;
    int prefill = 0, top = base_port;
    for (int i = 0; i < n; i++) {
        x[i].port = base_port + 1 + i;
        x[i].kv_port = x[i].role == 0 ? base_port + 100 + step * prefill++ : 0;
        if (x[i].port > top)
            top = x[i].port;
        if (x[i].kv_port + x[i].ranks - 1 > top)
            top = x[i].kv_port + x[i].ranks - 1;
    }
    if (top > 65535)
        return pd_err_set(e, PD_EINVAL, "--port %d: the instances' ports would reach %d, above 65535", base_port, top);
    return 0;
}

struct argv {
    char **a;
    int n, cap, oom;
};

static void add(struct argv *v, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void add(struct argv *v, const char *fmt, ...)
{
    if (v->oom)
        return;
    if (v->n + 2 > v->cap) {
        int cap = v->cap ? 2 * v->cap : 64;
        char **a = realloc(v->a, (size_t)cap * sizeof *a);
        if (!a) {
            v->oom = 1;
            return;
        }
        v->a = a;
        v->cap = cap;
    }
    va_list ap;
    va_start(ap, fmt);
    if (vasprintf(&v->a[v->n], fmt, ap) < 0)
        v->oom = 1;
    else
        v->a[++v->n] = NULL;
    va_end(ap);
}

char *pd_launch_kv_producers(const struct pd_launch_inst *x, int n)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f)
        return NULL;
    int k = 0;
    fputc('[', f);
    for (int i = 0; i < n; i++) {
        if (x[i].role != 0 || x[i].colocated)
            continue;
        int first = x[i].kv_port;   /* rank r listens on kv_port + r; a group's ranks are consecutive */
        for (int g = 0; g < x[i].n_groups; g++) {
            const struct pd_launch_group *gr = &x[i].group[g];
            fprintf(f, "%s\"%s:%d-%d\"", k++ ? "," : "", gr->host ? gr->host : "127.0.0.1", first, first + gr->ranks - 1);
            first += gr->ranks;
        }
    }
    fputc(']', f);
    if (fclose(f) || !k) {
        free(buf);
        return NULL;
    }
    return buf;
}

/* One app context's `pdmoe serve ...`: the ranks on host h. */
static void serve_args(struct argv *v, const struct pd_launch_inst *x, const struct pd_launch_opts *o, const char *h)
{
    add(v, "%s", o->pdmoe);
    add(v, "serve");
    add(v, "--model");
    add(v, "%s", o->model);
    if (h) {
        add(v, "--host");
        add(v, "%s", h);
    }
    add(v, "--port");
    add(v, "%d", x->port);
    add(v, "--threads");
    add(v, "%s", o->threads);
    add(v, "--max-model-len");
    add(v, "%s", o->max_model_len);
    add(v, "--served-model-name");
    add(v, "%s", o->served_name);
    if (!x->colocated) {   /* colocated: pdmoe serve without a KV role, chunked prefill */
        add(v, "--kv-transfer-config");
        char lease[40] = "", host[300] = "";
        if (o->lease_ms && x->role == 0)
            snprintf(lease, sizeof lease, ",\"kv_lease_ms\":%d", o->lease_ms);
        if (h)
            snprintf(host, sizeof host, ",\"kv_host\":\"%s\"", h);
        if (x->role == 0)
            add(v, "{\"kv_role\":\"kv_producer\",\"kv_port\":%d,\"engine_id\":\"prefill-%d\"%s%s}", x->kv_port,
                x->inst, host, lease);
        else
            add(v, "{\"kv_role\":\"kv_consumer\",\"engine_id\":\"decode-%d\"%s%s%s}", x->inst, host,
                o->kv_producers ? ",\"kv_producers\":" : "", o->kv_producers ? o->kv_producers : "");
    }
    if (x->ranks > 1) {
        add(v, "--enable-expert-parallel");
        add(v, "--data-parallel-size");
        add(v, "%d", x->ranks);
    }
    if (o->plan.kv_cache_bytes) {
        add(v, "--kv-cache-bytes");
        add(v, "%lld", (long long)o->plan.kv_cache_bytes);
    }
    if (o->plan.max_num_seqs) {
        add(v, "--max-num-seqs");
        add(v, "%lld", (long long)o->plan.max_num_seqs);
    }
    if (o->plan.max_num_batched_tokens) {
        add(v, "--max-num-batched-tokens");
        add(v, "%lld", (long long)o->plan.max_num_batched_tokens);
    }
    if (o->plan.kv_cache_dtype) {
        add(v, "--kv-cache-dtype");
        add(v, "%s", o->plan.kv_cache_dtype);
    }
    if (o->plan.spec_k > 0) {   /* both roles: the hand-off carries the draft's state (server_spec.c) */
        add(v, "--speculative-config");
        add(v, "{\"method\":\"mtp\",\"num_speculative_tokens\":%d}", o->plan.spec_k);
    }
    for (int i = 0; i < (int)(sizeof o->extra / sizeof o->extra[0]) && o->extra[i]; i++)
        add(v, "%s", o->extra[i]);
}

char **pd_launch_argv(const struct pd_launch_inst *x, const struct pd_launch_opts *o)
{
    struct argv v = {0};
    if (x->ranks > 1 || o->remote) {
        add(&v, "mpirun");
        if (x->group[0].host) {
            /* each host's slots, so mpirun places the app contexts in order */
            char hosts[PD_LAUNCH_MAX_HOSTS * 72] = "";
            size_t len = 0;
            for (int g = 0; g < x->n_groups; g++)
                len += (size_t)snprintf(hosts + len, sizeof hosts - len, "%s%s:%d", g ? "," : "", x->group[g].host,
                                        x->group[g].ranks);
            add(&v, "--host");
            add(&v, "%s", hosts);
        }
        if (o->oversubscribe)
            add(&v, "--oversubscribe");
        /* Open MPI binds each rank of a job of one or two to one core: a rank's --threads all ran
         * on that core (a remote host's single rank on one of its cores) */
        add(&v, "--bind-to");
        add(&v, "none");
        if (o->allow_run_as_root)
            add(&v, "--allow-run-as-root");
        if (o->api_key) {   /* the key's name, not its value: each rank reads it from its environment */
            add(&v, "-x");
            add(&v, "PDMOE_API_KEY");
        }
        for (int g = 0; g < x->n_groups; g++) {
            if (g)
                add(&v, ":");
            add(&v, "-n");
            add(&v, "%d", x->group[g].ranks);
            serve_args(&v, x, o, x->group[g].host);
        }
    } else {
        serve_args(&v, x, o, x->group[0].host);
    }
    if (v.oom) {
        pd_launch_argv_free(v.a);
        return NULL;
    }
    return v.a;
}

void pd_launch_argv_free(char **argv)
{
    for (int i = 0; argv && argv[i]; i++)
        free(argv[i]);
    free(argv);
}

int pd_launch_check_words(const char *model, const char *served, pd_err *e)
{
    /* mpirun reads a word ':' as the end of one program's arguments and the start of the next */
    if (!strcmp(model, ":"))
        return pd_err_set(e, PD_EINVAL, "the model path ':' would end mpirun's command for its program: write ./:");
    if (served && !strcmp(served, ":"))
        return pd_err_set(e, PD_EINVAL, "the served model name ':' would end mpirun's command for its program: "
                          "give --served-model-name another name");
    return 0;
}

const char *pd_launch_served_name(const char *model, char *buf, size_t cap)
{
    /* the last component, trailing slashes aside ("models/mini/" is "mini", not "") */
    size_t n = strlen(model);
    while (n > 1 && model[n - 1] == '/')
        n--;
    size_t b = n;
    while (b > 0 && model[b - 1] != '/')
        b--;
    snprintf(buf, cap, "%.*s", (int)(n - b), model + b);
    return buf;
}

/* "H:P,H:P,..." of the instances of one role; NULL when out of memory. */
static char *endpoints(const struct pd_launch_inst *x, int n, int role)
{
    char *s = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&s, &len);
    if (!f)
        return NULL;
    int k = 0;
    for (int i = 0; i < n; i++)
        if (x[i].role == role)
            fprintf(f, "%s%s:%d", k++ ? "," : "", x[i].group[0].host ? x[i].group[0].host : "127.0.0.1", x[i].port);
    if (fclose(f)) {
        free(s);
        return NULL;
    }
    return s;
}

char **pd_launch_proxy_argv(const struct pd_launch_inst *x, int n, const struct pd_launch_proxy *o)
{
    struct argv v = {0};
    char *list[2] = {endpoints(x, n, 0), endpoints(x, n, 1)};
    v.oom = !list[0] || !list[1];
    add(&v, "%s", o->pdmoe);
    add(&v, "proxy");
    if (list[0] && list[0][0]) {   /* no prefill instances: the proxy balances colocated servers */
        add(&v, "--prefill");
        add(&v, "%s", list[0]);
    }
    add(&v, "--decode");
    add(&v, "%s", list[1]);
    add(&v, "--port");
    add(&v, "%d", o->port);
    if (o->metrics_file) {
        add(&v, "--metrics-file");
        add(&v, "%s", o->metrics_file);
    }
    add(&v, "--host");
    add(&v, "%s", o->host);
    if (o->policy) {
        add(&v, "--policy");
        add(&v, "%s", o->policy);
    }
    if (o->shutdown_timeout_s > 0) {
        add(&v, "--shutdown-timeout");
        add(&v, "%d", o->shutdown_timeout_s);
    }
    free(list[0]);
    free(list[1]);
    if (v.oom) {
        pd_launch_argv_free(v.a);
        return NULL;
    }
    return v.a;
}

/* `pdmoe plan --emit pdmoe`: the plan's layout started by hand with pdmoe itself on CPU hosts,
 * with the command lines `pdmoe up --plan plan.json --hosts ...` runs. One layout, two launchers:
 * the instances come from the node map (nodes.h) that the plan's JSON carries for up, their ports
 * and argv from plan/launch.h, the builder up calls. Each instance starts on its first host; an EP
 * group spanning hosts is one mpirun there, which starts the other hosts' ranks through Open
 * MPI's launcher (ssh, or OMPI_MCA_plm_rsh_agent). docs/emit.md, "pdmoe (CPU hosts)". */
#include "plan/emit_sh.h"
#include "plan/launch.h"

#include <stdlib.h>
#include <string.h>

/* The --model of every server: a local checkpoint directory, the same path on every host. */
static int model_path(const struct pd_plan *p, const struct pd_emit_opts *o, const char **out, pd_err *e)
{
    const char *m = p->o.model;
    size_t n = m ? strlen(m) : 0;
    if (o->model_path && *o->model_path)
        *out = o->model_path;
    else if (p->o.checkpoint && *p->o.checkpoint)
        *out = p->o.checkpoint;
    else if (n && strncmp(p->model.source, m, n) == 0 && strcmp(p->model.source + n, "/config.json") == 0)
        *out = m;   /* --model DIR: the planner read DIR/config.json */
    else if (strcmp(p->model.name, "v4-flash-mini") == 0)
        *out = "models/mini";   /* where pdmoe up generates the preset */
    else
        return pd_err_set(e, PD_EINVAL, "--emit pdmoe: %s is a preset, not a checkpoint directory pdmoe serve can "
                          "load; name the directory with --served-model-path", p->model.name);
    return 0;
}

/* What pdmoe serve cannot run. */
static int check(const struct pd_plan *p, pd_err *e)
{
    for (int r = 0; r < 2; r++) {
        const struct pd_role_opts *x = &p->role[r].o;
        const char *role = pd_role_name((enum pd_role)r);
        if (x->tp > 1)
            return pd_err_set(e, PD_EINVAL, "--emit pdmoe: --%s tp=%d: pdmoe runs tensor parallel 1 only (an "
                              "instance is dp EP ranks, each with whole attention and dense layers); plan with "
                              "--%s tp=1", role, x->tp, role);
        if (x->redundant > 0)
            return pd_err_set(e, PD_EINVAL, "--emit pdmoe: --%s redundant=%d: pdmoe serve holds no redundant "
                              "experts; plan with redundant=0 (search: a hardware file with \"redundant_experts\": "
                              "false)", role, x->redundant);
    }
    return pd_emit_check_fits(p, e);
}

/* The instances as up builds them from the node map: instance i's group g on the host of its
 * g-th node, with that node's data-parallel ranks (tp 1: one rank per card); then the ports. */
static int instances(const struct pd_emit_ctx *c, struct pd_launch_inst *x, int *n, pd_err *e)
{
    *n = 0;
    for (int i = 0; i < c->L.n_parts; i++) {
        const struct pd_node_part *q = &c->L.parts[i];
        if (q->n > PD_LAUNCH_MAX_HOSTS)
            return pd_err_set(e, PD_EINVAL, "--emit pdmoe: %s instance %d spans %d nodes; pdmoe starts an instance "
                              "on at most %d hosts", pd_role_name(q->role), q->inst, q->n, PD_LAUNCH_MAX_HOSTS);
        if (q->k == 0)
            x[(*n)++] = (struct pd_launch_inst){.role = q->role, .inst = q->inst, .colocated = c->p->o.aggregated};
        struct pd_launch_inst *d = &x[*n - 1];
        d->group[d->n_groups++] = (struct pd_launch_group){.host = c->host[q->node], .ranks = q->dp_local};
        d->ranks += q->dp_local;
    }
    return pd_launch_ports(x, *n, c->o->proxy_port, e);
}

/* One command, its words each quoted for sh: a new line before every flag, and before each app
 * context of an mpirun (`: -n 1 ...`); backgrounded. */
static void command(FILE *f, char *const *argv)
{
    fputs("  ", f);
    for (int i = 0; argv[i]; i++) {
        int colon = strcmp(argv[i], ":") == 0, after_colon = i && strcmp(argv[i - 1], ":") == 0;
        if (i)
            fputs(colon || (argv[i][0] == '-' && !after_colon) ? " \\\n    " : " ", f);
        pd_emit_sh_word(f, argv[i]);
    }
    fputs(" &\nfi\n\n", f);
}

static void ranks_of(FILE *f, int first, int n)
{
    if (n == 1)
        fprintf(f, "rank %d", first);
    else
        fprintf(f, "ranks %d-%d", first, first + n - 1);
}

static void instance(FILE *f, const struct pd_launch_inst *x, char *const *argv)
{
    const char *role = x->colocated ? "aggregated" : pd_role_name((enum pd_role)x->role);
    fprintf(f, "# %s instance %d: ", role, x->inst);
    for (int g = 0, r = 0; g < x->n_groups; r += x->group[g++].ranks) {
        fputs(g ? ", " : "", f);
        ranks_of(f, r, x->group[g].ranks);
        fprintf(f, " on %s", x->group[g].host);
    }
    fprintf(f, "; HTTP on %s:%d", x->group[0].host, x->port);
    if (x->role == PD_ROLE_PREFILL)
        fprintf(f, ",\n# rank k's KV listener on its host's port %d + k", x->kv_port);
    fprintf(f, "\nif [ \"$host\" = %s ]; then\n", x->group[0].host);
    command(f, argv);
    /* the other hosts of an EP group: nothing to start there */
    for (int g = 1, r = x->group[0].ranks; g < x->n_groups; r += x->group[g++].ranks) {
        const char *h = x->group[g].host;
        fprintf(f, "# %s: ", h);
        ranks_of(f, r, x->group[g].ranks);
        fprintf(f, " of %s instance %d, started by its mpirun on %s\n", role, x->inst, x->group[0].host);
        fprintf(f, "if [ \"$host\" = %s ]; then\n  echo \"$0: %s runs ", h, h);
        ranks_of(f, r, x->group[g].ranks);
        fprintf(f, " of %s instance %d, which the mpirun on %s starts: nothing to start here\" >&2\nfi\n\n", role,
                x->inst, x->group[0].host);
    }
}

/* What the script is, after the common header: the up command with the same command lines. */
static void about(FILE *f, const struct pd_emit_ctx *c, const char *threads)
{
    fputs("# The command lines of `pdmoe up --model ", f);
    pd_emit_sh_word(f, c->model);
    fputs(" --plan plan.json --hosts ", f);
    for (int i = 0; i < c->L.nodes; i++)
        fprintf(f, "%s%s", i ? "," : "", c->host[i]);
    fprintf(f, "\n# --host %s --port %d --threads %s` (src/plan/launch.c), to start by hand. Copy this file to\n"
               "# every host and run `sh FILE HOST` there, HOST being the host's name below: it starts the\n"
               "# instances whose first host it is in the background and waits. An EP group spanning hosts is\n"
               "# one mpirun on its first host, which starts the other hosts' ranks through Open MPI's\n"
               "# launcher (ssh, or OMPI_MCA_plm_rsh_agent). The proxy listens on %s:%d. Every host needs\n"
               "# pdmoe on its PATH and the model at this path: pdmoe's docs/emit.md.\n",
            c->host[0], c->o->proxy_port, threads, c->host[0], c->o->proxy_port);
}

char *pd_emit_pdmoe(const struct pd_plan *p, const struct pd_emit_opts *o, pd_err *e)
{
    struct pd_emit_ctx c = {.p = p, .o = o};
    struct pd_launch_inst *x = NULL;
    char *buf = NULL, threads[16], max_len[24];
    size_t len = 0;
    int n = 0;
    if (model_path(p, o, &c.model, e) || pd_emit_check_text(&c, e) || check(p, e) || pd_emit_layout(&c, e))
        goto done;
    if (!(x = calloc((size_t)c.L.n_parts, sizeof *x))) {
        pd_err_set(e, PD_ENOMEM, "out of memory");
        goto done;
    }
    char served[256];
    if (instances(&c, x, &n, e) || pd_launch_check_words(c.model, pd_launch_served_name(c.model, served, sizeof served), e))
        goto done;
    FILE *f = open_memstream(&buf, &len);
    if (!f) {
        pd_err_set(e, PD_ENOMEM, "out of memory");
        goto done;
    }
    snprintf(threads, sizeof threads, "%d", o->threads > 0 ? o->threads : 1);
    snprintf(max_len, sizeof max_len, "%lld", (long long)p->o.max_model_len);
    pd_emit_header(f, &c, PD_EMIT_PDMOE);
    about(f, &c, threads);
    pd_emit_dispatch(f, &c);
    char *producers = pd_launch_kv_producers(x, n);   /* (NULL for an aggregated plan) */
    int oom = 0;
    for (int i = 0; i < n && !oom; i++) {
        /* as up --plan: the role's KV pool and the plan's limits, per rank; every rank on its own
         * host's address; started from the instance's first host (no mpirun for one rank) */
        const struct pd_role_plan *rp = &p->role[x[i].role];
        struct pd_launch_opts lo = {
            .pdmoe = "pdmoe", .model = c.model, .served_name = pd_launch_served_name(c.model, served, sizeof served), .threads = threads,
            .max_model_len = max_len, .kv_producers = producers,
            .plan = {.kv_cache_bytes = rp->b.kv_pool, .max_num_seqs = pd_plan_admitted_seqs(p, x[i].role),
                     .max_num_batched_tokens = p->o.max_num_batched_tokens,
                     .kv_cache_dtype = pd_kv_dtype_name(p->kv.dtype), .spec_k = p->mtp.k}};
        char **argv = pd_launch_argv(&x[i], &lo);
        if (argv) {
            pd_emit_seqs_note(f, p, x[i].role, pd_plan_admitted_seqs(p, x[i].role));
            instance(f, &x[i], argv);
        }
        oom = !argv;
        pd_launch_argv_free(argv);
    }
    struct pd_launch_proxy po = {.pdmoe = "pdmoe", .host = c.host[c.L.first[p->o.aggregated ? PD_ROLE_DECODE : PD_ROLE_PREFILL]],
                                 .port = o->proxy_port};
    char **argv = oom ? NULL : pd_launch_proxy_argv(x, n, &po);
    if (argv) {
        fprintf(f, "# proxy on %s, in front of every instance's first host and HTTP port\n", po.host);
        fprintf(f, "if [ \"$host\" = %s ]; then\n", po.host);
        command(f, argv);
        fputs("wait\n", f);
    }
    pd_launch_argv_free(argv);
    free(producers);
    if (fclose(f) || !argv) {
        free(buf);
        buf = NULL;
        pd_err_set(e, PD_ENOMEM, "out of memory");
    }
done:
    free(x);
    pd_emit_ctx_free(&c);
    return buf;
}

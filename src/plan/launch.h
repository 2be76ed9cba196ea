/* pdmoe's own launch commands: the command line of each prefill and decode instance, from the
 * node map (nodes.h) and the hosts it lands on. One builder for both launchers: `pdmoe up` runs
 * these argv, `pdmoe plan --emit pdmoe` prints them for people who launch by hand.
 *
 * An instance whose ranks all sit on one host and that has one rank is `pdmoe serve` (under
 * `mpirun -n 1 --host H` when `up` starts it on another host). An EP group is one mpirun, one app
 * context per host (`mpirun --host A:n,B:m -n n pdmoe serve --host A ... : -n m pdmoe serve --host
 * B ...`), so that every rank binds and advertises its own host's address: its KV listener on
 * kv_host = that address, port kv_port + its rank.
 *
 * Ports (one scheme for up and emit): the proxy on base_port, instance n (prefill instances
 * first) on base_port + 1 + n, prefill instance i's KV listeners from base_port + 100 + i x
 * kv_step, kv_step = the largest prefill EP size rounded up to a multiple of 8. */
#ifndef PD_PLAN_LAUNCH_H
#define PD_PLAN_LAUNCH_H

#include "core/err.h"

#include <stdint.h>

#define PD_LAUNCH_MAX_HOSTS 64   /* hosts of one instance */

struct pd_launch_group {
    const char *host;   /* NULL: this machine, the servers on their default 127.0.0.1 */
    int ranks;
};

struct pd_launch_inst {
    int role;           /* 0 prefill, 1 decode (enum pd_role) */
    int inst;           /* index within its role */
    int n_groups;
    struct pd_launch_group group[PD_LAUNCH_MAX_HOSTS];
    int ranks;          /* the EP size: the groups' ranks summed */
    int port, kv_port;  /* HTTP on group[0].host; producer rank k's KV listener on kv_port + k */
    int colocated;      /* an aggregated instance (role 1): prefills and decodes, no KV transfer */
};

/* What a plan sets for the ranks of one role (pdmoe plan --json: roles[r].budget.kv_pool_bytes,
 * options.max_num_seqs, options.max_num_batched_tokens), each per rank; 0: not passed. The one
 * list of plan flags both launchers write: `up --plan` reads the numbers from the plan's JSON,
 * `plan --emit pdmoe` from struct pd_plan. */
struct pd_launch_limits {
    int64_t kv_cache_bytes;    /* --kv-cache-bytes: the role's KV pool */
    int64_t max_num_seqs;      /* --max-num-seqs */
    int64_t max_num_batched_tokens;   /* --max-num-batched-tokens */
    const char *kv_cache_dtype;       /* --kv-cache-dtype: the dtype the pool was sized for; NULL: none */
    int spec_k;                       /* --speculative-config's num_speculative_tokens: the drafts per step
                                       * the plan's TPOT assumes (options.num_speculative_tokens); 0: none */
};

struct pd_launch_opts {
    const char *pdmoe;         /* the program: a path, or "pdmoe" */
    const char *model, *served_name;
    const char *api_key;       /* non-NULL: the instances need a key. It reaches them in their
                                * environment, PDMOE_API_KEY (set by the caller), never on their
                                * command line, which every user sees in ps; mpirun forwards it by
                                * name (-x). NULL: none */
    const char *threads, *max_model_len;         /* as given on the command line */
    int lease_ms;              /* 0: the server's default */
    const char *kv_producers;  /* a decode instance's kv_transfer_config "kv_producers" (the JSON
                                * array pd_launch_kv_producers writes); NULL: none given */
    struct pd_launch_limits plan;
    const char *extra[24];      /* more "--flag", "value" pairs for every instance, NULL-terminated */
    int allow_run_as_root;     /* mpirun --allow-run-as-root (pdmoe up as root) */
    int oversubscribe;         /* mpirun --oversubscribe: more ranks than cores */
    int remote;                /* the instance's first host is not where this runs: even one rank
                                * goes through mpirun --host, Open MPI's launcher (ssh, or its
                                * plm_rsh_agent) */
};

/* The KV listeners of the prefill instances among x[0..n) (their ports filled), as a JSON array of
 * "host:first-last", one per group of an instance's ranks on its host (127.0.0.1 for this
 * machine, where the producers advertise it): what each decode instance is told to pull from,
 * and from nowhere else. Malloc'ed; NULL when out of memory or when there is no prefill instance. */
char *pd_launch_kv_producers(const struct pd_launch_inst *x, int n);

/* Fills the ports of n instances (prefill first, in order) from base_port; PD_EINVAL naming
 * --port when one would pass 65535, or for more than 99 instances (HTTP would meet KV). */
int pd_launch_ports(struct pd_launch_inst *x, int n, int base_port, pd_err *e);

/* The argv of instance x (NULL-terminated; the array and its strings malloc'ed:
 * pd_launch_argv_free); NULL when out of memory. */
char **pd_launch_argv(const struct pd_launch_inst *x, const struct pd_launch_opts *o);
void pd_launch_argv_free(char **argv);

/* 0, or PD_EINVAL naming the word: a model path or served name that is exactly ':' would split an
 * mpirun command line into two programs. */
int pd_launch_check_words(const char *model, const char *served, pd_err *e);

/* The name the instances serve when none is given: the model directory's last component, trailing
 * slashes aside, written into buf (cap bytes) and returned. */
const char *pd_launch_served_name(const char *model, char *buf, size_t cap);

struct pd_launch_proxy {
    const char *pdmoe;         /* the program */
    const char *host;          /* --host: the address the proxy binds */
    int port;
    const char *metrics_file;  /* --metrics-file (pdmoe up's restart counts); NULL: none */
    const char *api_key;       /* non-NULL: the proxy needs a key, in PDMOE_API_KEY as above; NULL: none */
    const char *policy;        /* --policy (cache_aware, least_loaded); NULL: the proxy's default */
    int shutdown_timeout_s;    /* --shutdown-timeout; 0: none (the proxy stops at once) */
};

/* The proxy's argv in front of n instances: `pdmoe proxy --prefill H:P,... --decode H:P,...`, each
 * instance by its first host (127.0.0.1 when NULL) and HTTP port. Malloc'ed as pd_launch_argv's;
 * NULL when out of memory. */
char **pd_launch_proxy_argv(const struct pd_launch_inst *x, int n, const struct pd_launch_proxy *o);

#endif

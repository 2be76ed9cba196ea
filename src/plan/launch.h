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
};

struct pd_launch_opts {
    const char *pdmoe;         /* the program: a path, or "pdmoe" */
    const char *model, *served_name, *api_key;   /* api_key NULL: none */
    const char *threads, *max_model_len;         /* as given on the command line */
    int lease_ms;              /* 0: the server's default */
    const char *extra[8];      /* more "--flag", "value" pairs for every instance, NULL-terminated */
    int allow_run_as_root;     /* mpirun --allow-run-as-root (pdmoe up as root) */
    int oversubscribe;         /* mpirun --oversubscribe: more ranks than cores */
    int remote;                /* the instance's first host is not where this runs: even one rank
                                * goes through mpirun --host, Open MPI's launcher (ssh, or its
                                * plm_rsh_agent) */
};

/* Fills the ports of n instances (prefill first, in order) from base_port; PD_EINVAL naming
 * --port when one would pass 65535. */
int pd_launch_ports(struct pd_launch_inst *x, int n, int base_port, pd_err *e);

/* The argv of instance x (NULL-terminated; the array and its strings malloc'ed:
 * pd_launch_argv_free); NULL when out of memory. */
char **pd_launch_argv(const struct pd_launch_inst *x, const struct pd_launch_opts *o);
void pd_launch_argv_free(char **argv);

#endif

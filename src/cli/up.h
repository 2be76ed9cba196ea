/* `pdmoe up`'s parts (up.c supervises; up_plan.c reads what it launches; up_stop.c stops and judges
 * the stop): the children up runs, the plan's settings for the instances, the --hosts list and the
 * plan's node map on them, the memory check. */
#ifndef PD_CLI_UP_H
#define PD_CLI_UP_H

#include "core/mem.h"
#include "plan/launch.h"

#include <signal.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#define MAX_CHILDREN 34
#define MAX_EP 8        /* ranks of one instance on this machine (mpirun --oversubscribe) */
#define MAX_HOSTS 256

/* A process up started and supervises: an instance (serve, or an EP group's mpirun) or the proxy. */
struct child {
    pid_t pid;                 /* 0 while dead */
    char what[128];
    const char *role;          /* "prefill", "decode", "proxy" */
    int instance, port;
    const char *host;          /* where /health is asked: the proxy's --host; NULL: 127.0.0.1 */
    char **argv;               /* owned, NULL-terminated: what a restart runs again */
    int restarts;
    int refused;               /* it last exited with PD_CLI_EXIT_CONFIG: it refused its flags */
    double started, backoff, restart_at, died_at;
    double answered;           /* when its /health last answered 200 since it started; 0: not yet */
    double next_probe;         /* when its /health is asked next (supervising) */
    double term_at;            /* when up sent it SIGTERM for its silence; 0: not sent */
    int port_wait_said;        /* its restart's wait for its ports was logged */
    int kv_port, ranks, local;  /* an instance on this machine: its ranks' KV ports, checked free before a restart */
    time_t started_wall;       /* when it was last started, wall-clock (for its shared memory's age) */
    struct pd_oom_count oom;   /* the kernel's OOM kills when it was last started (core/mem.h) */
    int oom_deaths;            /* its deaths during which the OOM killer killed a process */
    pid_t term_pid;            /* whom its stop signalled (up_stop.c): pid, or an EP group's rank 0 */
};

extern volatile sig_atomic_t up_stopping;   /* the signals to stop up so far (its handler's count) */

/* "exited with status N" or "was killed by signal N (name)", from a wait status. */
void up_describe(int status, char *out, size_t cap);
/* Calls fn(pid, arg) for every process of this machine (its /proc entries). */
void up_each_process(void (*fn)(int pid, void *arg), void *arg);
/* Process pid's parent and session from /proc/PID/stat: 0, or -1 when it is gone. */
int up_proc_stat(int pid, int *ppid, int *session);
/* Stops the n children in c (SIGTERM; SIGKILL after 10 s plus drain_s) and waits for them: how
 * many failed their stop, each said with its pid and how it ended (up_stop.c). */
int up_stop_all(struct child *c, int n, int drain_s);

/* What a plan (pdmoe plan --json) sets for the instances: counts, EP sizes (tp must be 1), the KV
 * pool of each rank (roles[].budget.kv_pool_bytes) and the scheduler limits (options). */
struct up_plan {
    int instances[2], ep[2];
    int64_t kv_pool[2];
    int64_t max_num_seqs, max_model_len, max_num_batched_tokens;
    double util;                    /* options.gpu_memory_utilization (0: not in the plan) */
    int64_t launched_seqs[2];       /* roles[].launched_max_num_seqs: max_num_seqs, lowered to what the
                                     * role's pool holds (options.max_num_seqs in plans without it) */
    char kv_cache_dtype[8];         /* options.kv_cache_dtype: what the pools were sized for */
    int64_t spec_k;                 /* options.num_speculative_tokens: the drafts its TPOT assumes */
    int aggregated;                 /* "aggregated": colocated instances (the roles' entries are the same
                                     * instances), no KV transfer, the proxy balancing them */
};

/* Reads --plan `path` (pdmoe plan --json) into u: 0, or -1 with the file and field at fault said.
 * on_hosts: the instances run on --hosts (no limit of MAX_EP ranks); model: the one up serves,
 * whose shapes the plan's "model" must have. */
int up_read_plan(const char *path, struct up_plan *u, int on_hosts, const char *model);
/* --hosts H0,H1,...: the nodes' addresses in node order, each where that node's servers bind and
 * are reached (pointers into a static copy of arg): 0, or -1 with the host at fault said. */
int up_parse_hosts(const char *arg, char **hosts, int *n);
/* The plan's node map on the --hosts: inst[0..*n) with each group's host; 0 or -1 (said). */
int up_read_node_map(const char *path, char **hosts, int nhosts, int aggregated, struct pd_launch_inst *inst,
                     int *n);
/* The plan's KV pools and the model fit this machine's memory with a tenth left: 0, or -1 (said). */
int up_plan_fits(const char *path, const struct up_plan *u, const char *model);

#endif

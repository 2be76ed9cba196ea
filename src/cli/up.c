/* `pdmoe up`: a local PD cluster in one command. Generates the model if it is missing, starts the
 * prefill instances, the decode instances and the proxy as child processes (this same program;
 * an instance of EP size N > 1 as `mpirun -n N pdmoe serve --enable-expert-parallel`, its rank k
 * moving KV on kv_port + k), waits until every one answers /health, prints the endpoint, and on
 * Ctrl-C (or SIGTERM) stops them all and waits for them: nothing is left behind. The proxy goes
 * first, so it ends the streams in flight with an error event and [DONE] before the instances go.
 *
 * Once the cluster is up, `up` supervises it: a child that dies (an instance, an EP group's
 * mpirun, the proxy) is logged with its exit status or signal and started again on the same
 * ports after a backoff (0.5 s doubling to 30 s; back to 0.5 s once it has lived 30 s), while the
 * proxy routes around it. The restart counts go to a Prometheus text file that the proxy appends
 * to its /metrics (pdmoe_restarts_total{role,instance}): one scrape endpoint for the cluster, kept
 * across a restart of the proxy itself, and no endpoint of its own for `up` to protect. Before the
 * cluster is first ready, a child that dies is started again at once, three times at most, then
 * stops everything (a bad flag would only die again). What a --plan sets is read in up_plan.c. */
#include "cli/cli.h"
#include "cli/up.h"
#include "engine/spec.h"
#include "proxy/route.h"
#include "core/timing.h"
#include "core/mem.h"
#include "core/net.h"
#include "core/units.h"
#include "engine/genmodel.h"
#include "plan/launch.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>


static void on_stop(int sig)
{
    if (up_stopping < 2)
        up_stopping++;
}

#define BACKOFF_MIN_S 0.5
#define BACKOFF_MAX_S 30.0
#define START_TRIES 3     /* starts of a child before the cluster is first ready */


/* Runs c's command (argv[0] a path, or a name looked up in PATH) in a process group of its own,
 * so that a Ctrl-C in the terminal reaches `up` alone and the shutdown goes in order; the child
 * gets SIGTERM if `up` dies. */
static void spawn(struct child *c)
{
    pd_oom_count(&c->oom);   /* before the fork: a child killed at once is still counted after it */
    pid_t parent = getpid(), pid = fork();
    if (pid == 0) {
        setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent)   /* up died before the request took: nobody would stop this one */
            _exit(0);
        execvp(c->argv[0], c->argv);
        _exit(127);
    }
    c->pid = pid;
    c->started = pd_now_s();
    c->started_wall = time(NULL);
    c->answered = 0;
    c->term_at = 0;
}

/* Where up keeps its directory: $TMPDIR when it is an absolute path, else /tmp. */
static const char *tmp_dir(void)
{
    const char *t = getenv("TMPDIR");
    return t && t[0] == '/' && strlen(t) < 256 ? t : "/tmp";
}

/* A run's directory and the files up writes there (its restart counts, their temporary file, its
 * pid), at its end or, for a run that died, a later one's. */
static void remove_run_dir(const char *dir)
{
    static const char *const files[] = {"restarts.prom", "restarts.prom.tmp", "pid"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char file[PATH_MAX];
        snprintf(file, sizeof file, "%s/%s", dir, files[i]);
        unlink(file);
    }
    rmdir(dir);
}

/* The directories of earlier runs of pdmoe up that were killed before they could remove theirs
 * (SIGKILL, a crash): <tmp>/pdmoe-up-* whose "pid" file names a process that no longer exists.
 * A directory without that file, or of a process alive, is left alone. */
static void sweep_stale_dirs(const char *tmp)
{
    DIR *d = opendir(tmp);
    if (!d)
        return;
    struct dirent *ent;
    while ((ent = readdir(d))) {
        if (strncmp(ent->d_name, "pdmoe-up-", 9))
            continue;
        char path[600], file[700];
        snprintf(path, sizeof path, "%s/%s", tmp, ent->d_name);
        snprintf(file, sizeof file, "%s/pid", path);
        FILE *f = fopen(file, "r");
        long pid = 0;
        int got = f && fscanf(f, "%ld", &pid) == 1;
        if (f)
            fclose(f);
        if (!got || pid <= 0 || kill((pid_t)pid, 0) == 0 || errno != ESRCH)
            continue;
        remove_run_dir(path);
    }
    closedir(d);
}

/* The time now as a log line's stamp, UTC: "2026-12-04T17:26:17Z". */
static const char *stamp(char buf[24])
{
    time_t t = time(NULL);
    struct tm tm;
    if (!gmtime_r(&t, &tm) || !strftime(buf, 24, "%Y-%m-%dT%H:%M:%SZ", &tm))
        snprintf(buf, 24, "?");
    return buf;
}


/* The restart counts, in Prometheus' text format, for the proxy's /metrics: written whole to a
 * temporary file and renamed, so the proxy never reads half of it. A write that fails (a full
 * filesystem) leaves no temporary file and is said once, and again when writing works again:
 * until then the proxy's /metrics has no pdmoe_restarts_total, or older counts. */
static void write_metrics(const char *path, const struct child *c, int n)
{
    static int failing;
    char tmp[PATH_MAX + 8];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    int err = f ? 0 : errno;
    if (f) {
        fprintf(f, "# HELP pdmoe_restarts_total Processes pdmoe up started again after they died.\n"
                   "# TYPE pdmoe_restarts_total counter\n");
        for (int i = 0; i < n; i++)
            fprintf(f, "pdmoe_restarts_total{role=\"%s\",instance=\"%d\"} %d\n", c[i].role, c[i].instance,
                    c[i].restarts);
        fprintf(f, "# HELP pdmoe_oom_deaths_total Deaths of those processes during which the kernel's OOM killer "
                   "killed a process (in up's memory cgroup, or on its host).\n"
                   "# TYPE pdmoe_oom_deaths_total counter\n");
        for (int i = 0; i < n; i++)
            fprintf(f, "pdmoe_oom_deaths_total{role=\"%s\",instance=\"%d\"} %d\n", c[i].role, c[i].instance,
                    c[i].oom_deaths);
        if (fflush(f) != 0 || ferror(f))
            err = errno ? errno : EIO;
        if (fclose(f) != 0 && !err)
            err = errno;
        if (!err && rename(tmp, path) != 0)
            err = errno;
        if (err)
            unlink(tmp);
    }
    if (err && !failing)
        fprintf(stderr, "pdmoe up: cannot write the restart counts to %s: %s (the proxy's /metrics lacks them "
                        "until it can)\n", path, strerror(err));
    else if (!err && failing)
        fprintf(stderr, "pdmoe up: the restart counts are written to %s again\n", path);
    failing = err != 0;
}

/* 1 when http://host:port/health answers 200. */
static int healthy(const char *host, int port)
{
    char b[64];
    return pd_cli_http_get(host, port, "/health", b, sizeof b) == 200;
}

/* The proxy serves with every instance: its /readiness, which counts an instance once the proxy
 * itself has seen it answer (its /health says only that it runs), says each role's instances are
 * all up. A 200 alone means one of each: up said it was ready while the proxy still sent every
 * request to the one decode instance it had seen. */
static int proxy_ready(const char *host, int port)
{
    char b[512];
    if (pd_cli_http_get(host, port, "/readiness", b, sizeof b) != 200)
        return 0;
    json_t *r = json_loads(b, 0, NULL);
    int all = r != NULL;
    static const char *const roles[] = {"prefill", "decode"};
    for (int i = 0; i < 2 && all; i++) {
        json_t *role = json_object_get(r, roles[i]);
        all = json_is_object(role) && json_integer_value(json_object_get(role, "up")) ==
                                          json_integer_value(json_object_get(role, "instances"));
    }
    json_decref(r);
    return all;
}

/* The liveness check of a running child c, at most once a second: a child that answered /health
 * once since it started and has not answered it (200 within 2 s) for live_s seconds since is
 * stopped or wedged (SIGSTOP, a deadlock, a host's network gone), which the reaping never sees:
 * it is sent SIGTERM and SIGCONT, its process group SIGKILL after TERM_GRACE_S, and the reaping
 * starts it again as it does a dead one. A child still starting (a model loading) is not asked
 * to answer yet. */
#define TERM_GRACE_S 5.0
static void check_alive(struct child *c, double live_s, double now)
{
    if (c->pid > 0 && c->term_at > 0) {   /* asked to stop: given TERM_GRACE_S, then killed */
        if (now - c->term_at >= TERM_GRACE_S) {
            kill(-c->pid, SIGKILL);
            kill(c->pid, SIGKILL);
        }
        return;
    }
    if (c->pid <= 0 || live_s <= 0 || now < c->next_probe)
        return;
    c->next_probe = now + 1.0;
    char b[64];
    /* any answer is a process alive: a 503 at its --max-connections (a slowloris client), or an
     * EP group's stall, which its own watchdog ends (a full connection table once made up restart
     * a healthy proxy, every stream with it, in a loop) */
    if (pd_cli_http_get_within(c->host, c->port, "/health", b, sizeof b, 2000) > 0) {
        c->answered = pd_now_s();
        return;
    }
    if (c->answered <= 0 || now - c->answered < live_s)
        return;
    char ts[24];
    fprintf(stderr, "pdmoe up: %s the %s has not answered /health for %.0f s (--liveness-timeout %.0f); stopping it\n",
            stamp(ts), c->what, now - c->answered, live_s);
    /* SIGTERM and SIGCONT first, as up_stop_all sends them: an mpirun SIGKILLed left its ranks'
     * shared-memory segments in /dev/shm at every such restart; SIGKILL after TERM_GRACE_S */
    kill(c->pid, SIGTERM);
    kill(-c->pid, SIGCONT);
    c->term_at = now;
    c->answered = 0;
}

/* up_each_process: pid is killed if it belongs to session *(pid_t *)sid. */
static void kill_if_in_session(int pid, void *sid)
{
    int ppid, session;
    if (!up_proc_stat(pid, &ppid, &session) && session == *(pid_t *)sid)
        kill(pid, SIGKILL);
}

/* Every process left in session sid is killed. Open MPI's rsh launcher puts its agent (ssh) in a
 * process group of its own, which outlived the killed mpirun: an ssh to a hung host lived on,
 * and could start an orted for a dead mpirun once the host answered. */
static void kill_session(pid_t sid)
{
    up_each_process(kill_if_in_session, &sid);
}

/* Every host the instances use that is not this one must take a process from Open MPI's
 * launcher (ssh, or the plm_rsh_agent the user set): tried on each, at the same time, within
 * timeout_s (--host-timeout); the hosts that refuse are named. 0 when all answer. */
static int reachable(const struct pd_launch_inst *inst, int n, int timeout_s)
{
    const char *h[MAX_HOSTS];
    pid_t pid[MAX_HOSTS];
    int nh = 0, bad = 0;
    for (int i = 0; i < n; i++)
        for (int g = 0; g < inst[i].n_groups; g++) {
            const char *x = inst[i].group[g].host;
            int seen = !x || pd_net_is_local(x);
            for (int k = 0; k < nh && !seen; k++)
                seen = !strcmp(h[k], x);
            if (!seen && nh < MAX_HOSTS)
                h[nh++] = x;
        }
    for (int k = 0; k < nh; k++) {
        pid[k] = fork();
        if (pid[k] == 0) {
            char hs[80];
            snprintf(hs, sizeof hs, "%s:1", h[k]);
            int null = open("/dev/null", O_WRONLY);
            if (null >= 0) {
                dup2(null, 1);
                dup2(null, 2);
            }
            setsid();   /* a session of its own: the launcher agents it starts are found by it */
            char *a[8] = {"mpirun", "--host", hs, "-n", "1"};
            int na = 5;
            if (geteuid() == 0)   /* Open MPI refuses root without it */
                a[na++] = "--allow-run-as-root";
            a[na++] = "true";
            a[na] = NULL;
            execvp("mpirun", a);
            _exit(127);
        }
    }
    double until = pd_now_s() + timeout_s;
    for (int k = 0; k < nh; k++) {
        int status = 0;
        pid_t w = 0;
        while (pid[k] > 0 && (w = waitpid(pid[k], &status, WNOHANG)) == 0 && pd_now_s() < until)
            nanosleep(&(struct timespec){0, 20000000}, NULL);
        if (pid[k] > 0 && w == 0) {
            kill(-pid[k], SIGKILL);
            waitpid(pid[k], &status, 0);
            kill_session(pid[k]);
            fprintf(stderr, "pdmoe up: --hosts: host %s is unreachable: Open MPI's launcher (mpirun --host %s) did not "
                            "start a process there within %d s (--host-timeout)\n", h[k], h[k], timeout_s);
            bad = 1;
        } else if (pid[k] < 0 || !WIFEXITED(status) || WEXITSTATUS(status)) {
            fprintf(stderr, "pdmoe up: --hosts: host %s is unreachable: Open MPI's launcher (mpirun --host %s -n 1 "
                            "true) failed there (check ssh to it, or OMPI_MCA_plm_rsh_agent)\n", h[k], h[k]);
            bad = 1;
        }
    }
    return bad;
}

/* --kv-cache-memory-bytes is each rank's pool, and every rank of every instance on this host holds
 * one: 4 ranks of 10 GB started on a machine of 24 GB (each serve checks its own group's ranks
 * only) and would have filled under load until the OOM killer came. 1, said, when they are more
 * than the memory left now (before any weights are loaded). */
static int pools_past_memory(const char *flag, const struct pd_launch_inst *inst, int n)
{
    int64_t pool;
    if (pd_units_parse(flag, &pool))
        return 0;   /* (serve names a bad value) */
    int ranks = 0, np = 0, nd = 0;
    for (int i = 0; i < n; i++)
        for (int g = 0; g < inst[i].n_groups; g++)
            if (!inst[i].group[g].host || pd_net_is_local(inst[i].group[g].host)) {
                ranks += inst[i].group[g].ranks;
                *(inst[i].role ? &nd : &np) += inst[i].group[g].ranks;
            }
    struct pd_mem_short m;
    if (ranks < 2 || pd_mem_fits(pool, ranks, &m))
        return 0;
    fprintf(stderr, "pdmoe up: --kv-cache-memory-bytes %s: the %d ranks this host runs (%d prefill, %d decode) each "
            "hold a KV pool of that size, %s in all, more than the %s of memory left (%s, before any weights "
            "are loaded); give at most %s\n", flag, ranks, np, nd, m.all, m.left, m.where, m.each_max);
    return 1;
}

/* 1 if something on this machine listens on `port` (any address): a listener's wildcard bind
 * fails then; SO_REUSEADDR, as the servers set it, lets a port with connections in TIME_WAIT by. */
static int port_taken(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
    if (fd < 0)
        return 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    int taken = bind(fd, (struct sockaddr *)&a, sizeof a) != 0 && errno == EADDRINUSE;
    close(fd);
    return taken;
}

/* Every port this machine's children will listen on is free: a second `up` on the ports of one
 * running took the first one's /health answers for its own children's, said it was ready, and
 * restarted the children (each failing to bind) for ever. Each taken port is named. */
static int ports_free(const struct pd_launch_inst *inst, int n, int proxy_port, int say)
{
    static const char hint[] = "in use on this machine (another pdmoe up? `ss -ltnp 'sport = :%d'` names what holds "
                               "it; choose another --port)\n";
    int bad = 0;
    if (port_taken(proxy_port)) {
        if (say) {
            fprintf(stderr, "pdmoe up: port %d (the proxy's, --port) is ", proxy_port);
            fprintf(stderr, hint, proxy_port);
        }
        bad = 1;
    }
    for (int i = 0; i < n; i++) {
        const struct pd_launch_inst *x = &inst[i];
        int local = 1;
        for (int g = 0; g < x->n_groups; g++)
            local &= !x->group[g].host || pd_net_is_local(x->group[g].host);
        const char *role = x->role ? "decode" : "prefill";
        if ((!x->group[0].host || pd_net_is_local(x->group[0].host)) && port_taken(x->port)) {
            if (say) {
                fprintf(stderr, "pdmoe up: port %d (%s instance %d's HTTP port, --port + %d) is ", x->port, role,
                        x->inst, x->port - proxy_port);
                fprintf(stderr, hint, x->port);
            }
            bad = 1;
        }
        for (int k = 0; local && x->kv_port && k < x->ranks; k++)
            if (port_taken(x->kv_port + k)) {
                if (say) {
                    fprintf(stderr, "pdmoe up: port %d (%s instance %d's KV port for rank %d, --port + %d) is ",
                            x->kv_port + k, role, x->inst, k, x->kv_port + k - proxy_port);
                    fprintf(stderr, hint, x->kv_port + k);
                }
                bad = 1;
            }
    }
    return bad;
}

/* ports_free, waiting up to 5 s for the ports to come free first: the processes of a cluster
 * just killed (up SIGKILLed, its mpiruns and ranks orphaned) take a moment to exit, and an up
 * started at once failed on every port they held. */
static int ports_wait(const struct pd_launch_inst *inst, int n, int proxy_port)
{
    if (!ports_free(inst, n, proxy_port, 0))
        return 0;
    fprintf(stderr, "pdmoe up: waiting up to 5 s for this cluster's ports (in use: a cluster that just stopped?)\n");
    for (int t = 0; t < 25; t++) {
        nanosleep(&(struct timespec){0, 200000000}, NULL);
        if (!ports_free(inst, n, proxy_port, 0))
            return 0;
    }
    return ports_free(inst, n, proxy_port, 1);
}


/* 1 when child c (running) has died, how it ended in how; and, when the kernel's OOM killer
 * killed a process since c started (its counters rose: core/mem.h), that too. The OOM killer
 * ends a process with SIGKILL, status 137 to a shell and "exited on signal 9 (Killed)" to an
 * mpirun whose rank it took: alone, these say nothing of who killed it, and a restart into the
 * same memory dies the same way. A child on another host (--hosts) is not judged by this one's
 * counters. */
static int reaped(struct child *c, char *how, size_t n)
{
    int status;
    if (c->pid <= 0 || waitpid(c->pid, &status, WNOHANG) != c->pid)
        return 0;
    up_describe(status, how, n);
    if (c->ranks > 1 && WIFEXITED(status) && WEXITSTATUS(status) > 128) {
        /* mpirun passes on the status of the first rank that failed: 128 + a signal is some rank's
         * death, not rank 0's, which the line's "rank 0 on" seemed to say */
        const size_t len = strlen(how);
        const int sig = WEXITSTATUS(status) - 128;
        snprintf(how + len, n - len, " (mpirun's status: a rank of the group was killed by signal %d (%s); "
                 "rank 0 names it above, unless it was rank 0)", sig, strsignal(sig));
    }
    c->refused = WIFEXITED(status) && WEXITSTATUS(status) == PD_CLI_EXIT_CONFIG;
    struct pd_oom_count now;
    char note[640];
    pd_oom_count(&now);
    const int proxy = !strcmp(c->role, "proxy");   /* (always on this host) */
    if ((c->local || proxy) && pd_oom_note(note, sizeof note, &c->oom, &now)[0]) {
        const size_t len = strlen(how);
        snprintf(how + len, n - len, "; %s%s", note,
                 !proxy ? " (an instance holds its weights, its KV pool: --kv-cache-memory-bytes "
                 "or the plan's kv_pool_bytes, and its activations; pdmoe plan and up --plan check what fits)" : "");
        c->oom_deaths++;
    }
    return 1;
}

/* The ports dead child c's processes held, some still bound (an EP group's ranks outlive a
 * SIGKILLed mpirun by a moment): its restart would fail to bind them and back off once more. */
#define PORT_GRACE_S 5.0
static int ports_still_bound(const struct child *c)
{
    if (!c->local)
        return 0;
    int busy = port_taken(c->port);
    for (int k = 0; !busy && c->kv_port && k < c->ranks; k++)
        busy = port_taken(c->kv_port + k);
    return busy;
}

/* The vader segments sweep_group_shm may remove, and which of them a process still maps. */
struct shm_sweep {
    char name[16][256];
    int mapped[16], n;
};

/* each_process: marks the segments pid maps. */
static void mark_mapped(int pid, void *arg)
{
    struct shm_sweep *w = arg;
    char path[64], line[512];
    snprintf(path, sizeof path, "/proc/%d/maps", pid);
    FILE *f = fopen(path, "r");
    while (f && fgets(line, sizeof line, f)) {
        const char *at = strstr(line, "/dev/shm/");
        size_t len = at ? strcspn(at + 9, "\n") : 0;
        for (int i = 0; at && i < w->n; i++)
            w->mapped[i] |= strlen(w->name[i]) == len && !strncmp(at + 9, w->name[i], len);
    }
    if (f)
        fclose(f);
}

/* The shared memory of an EP group's dead mpirun: Open MPI's vader segments, which a SIGKILLed
 * mpirun (the OOM killer, an operator, up's own SIGKILL after a SIGTERM that did nothing) leaves
 * in /dev/shm, 4 MiB a rank at every such death. Those made since `since` that no process maps
 * any more are removed (the ranks are gone: its ports are free by then); one pass over the
 * processes for them all. */
static void sweep_group_shm(time_t since)
{
    struct shm_sweep w = {.n = 0};
    DIR *d = opendir("/dev/shm");
    for (struct dirent *de; d && w.n < 16 && (de = readdir(d));) {
        char path[300];
        struct stat st;
        snprintf(path, sizeof path, "/dev/shm/%.255s", de->d_name);
        if (!strncmp(de->d_name, "vader_segment.", 14) && !lstat(path, &st) && S_ISREG(st.st_mode) &&
            st.st_uid == geteuid() && st.st_mtime >= since - 1)
            snprintf(w.name[w.n++], sizeof w.name[0], "%.255s", de->d_name);
    }
    if (d)
        closedir(d);
    if (!w.n)
        return;
    up_each_process(mark_mapped, &w);
    for (int i = 0; i < w.n; i++)
        if (!w.mapped[i]) {
            char path[300];
            snprintf(path, sizeof path, "/dev/shm/%s", w.name[i]);
            unlink(path);
        }
}

/* Starts dead child c again, counted in the restarts file of all n children. */
static void restart(struct child *c, const char *mfile, struct child *all, int n)
{
    if (c->local && c->ranks > 1)
        sweep_group_shm(c->started_wall);
    c->restarts++;
    write_metrics(mfile, all, n);
    spawn(c);
}

int pd_cli_up(int argc, char **argv)
{
    static const struct option opts[] = {
        {"model", 1, 0, 'm'}, {"port", 1, 0, 'p'}, {"prefill-instances", 1, 0, 'P'}, {"decode-instances", 1, 0, 'D'},
        {"threads", 1, 0, 'j'}, {"plan", 1, 0, 'l'}, {"max-model-len", 1, 0, 'L'}, {"prefill-ep", 1, 0, 'e'},
        {"decode-ep", 1, 0, 'f'}, {"api-key", 1, 0, 'k'}, {"kv-lease-ms", 1, 0, 'K'},
        {"host", 1, 0, 'H'}, {"max-num-seqs", 1, 0, 'S'}, {"max-num-batched-tokens", 1, 0, 'T'},
        {"kv-cache-memory-bytes", 1, 0, 'B'}, {"kv-cache-bytes", 1, 0, 'B'}, {"served-model-name", 1, 0, 'N'},
        {"hosts", 1, 0, 'O'}, {"kv-cache-dtype", 1, 0, 'd'}, {"policy", 1, 0, 'y'},
        {"speculative-config", 1, 0, 'X'}, {"max-queued-requests", 1, 0, 'Q'}, {"shutdown-timeout", 1, 0, 'G'},
        {"watchdog-timeout", 1, 0, 'W'}, {"liveness-timeout", 1, 0, 'V'}, {"host-timeout", 1, 0, 'o'},
        {"enable-prefix-caching", 0, 0, 'C'}, {"no-enable-prefix-caching", 0, 0, 'c'}, {"help", 0, 0, 'h'},
        {0, 0, 0, 0},
    };
    const char *model = "models/mini", *plan = NULL, *key = NULL, *policy = NULL;
    char *hosts[MAX_HOSTS];
    int nhosts = 0;
    int64_t port = 8000, np = 1, nd = 1, threads = 1, max_len = 2048, ep_flag[2] = {1, 1}, lease_ms = 0;
    /* engine flags passed on to every instance as given (serve checks them); the plan's own
     * values forbid them with --plan */
    const char *host = "127.0.0.1", *seqs_flag = NULL, *batched_flag = NULL, *kvbytes_flag = NULL, *served = NULL;
    const char *dtype_flag = NULL, *prefix_flag = NULL, *spec_flag = NULL, *queued_flag = NULL, *drain_flag = NULL;
    const char *watchdog_flag = NULL;
    int64_t drain_s = 0, live_s = 30, host_s = 20;
    int host_flag = 0;
    enum pd_kv_dtype dtype;
    int64_t checked;
    int c;
    /* the log's reader going away (a `| tee` killed, an ssh session closed) must not take the
     * supervisor and every instance with it: a write to a closed pipe fails, and that is all
     * (the children inherit this, and serve and proxy set it too) */
    signal(SIGPIPE, SIG_IGN);
    pd_cli_ignore_stray_signals();
    struct pd_cli_seen seen = {0};
    optind = 1;
    opterr = 0;
    while ((c = pd_cli_getopt("up", argc, argv, opts, NULL, NULL, &seen)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'p': if (pd_cli_int_max("--port", optarg, 1, 65000, &port)) return 2; break;
        case 'P': if (pd_cli_int_max("--prefill-instances", optarg, 1, 16, &np)) return 2; break;
        case 'D': if (pd_cli_int_max("--decode-instances", optarg, 1, 16, &nd)) return 2; break;
        case 'j': if (pd_cli_int("--threads", optarg, 1, &threads)) return 2; break;
        case 'L': if (pd_cli_int("--max-model-len", optarg, 16, &max_len)) return 2; break;
        case 'l': plan = optarg; break;
        case 'H': host = optarg; break;
        case 'S': if (pd_cli_int("--max-num-seqs", optarg, 1, &checked)) return 2; seqs_flag = optarg; break;
        case 'T':
            if (pd_cli_int("--max-num-batched-tokens", optarg, 1, &checked))
                return 2;
            batched_flag = optarg;
            break;
        case 'B': kvbytes_flag = optarg; break;
        case 'Q':
            if (pd_cli_int_max("--max-queued-requests", optarg, 1, 1 << 30, &checked))
                return 2;
            queued_flag = optarg;
            break;
        case 'G':
            if (pd_cli_int_max("--shutdown-timeout", optarg, 0, 86400, &drain_s))
                return 2;
            drain_flag = optarg;
            break;
        case 'W':
            if (pd_cli_int_max("--watchdog-timeout", optarg, 0, 86400, &checked))
                return 2;
            watchdog_flag = optarg;
            break;
        case 'V': if (pd_cli_int_max("--liveness-timeout", optarg, 0, 86400, &live_s)) return 2; break;
        case 'o': if (pd_cli_int_max("--host-timeout", optarg, 1, 3600, &host_s)) return 2; host_flag = 1; break;
        case 'd': if (pd_cli_kv_dtype("up", optarg, &dtype)) return 2; dtype_flag = optarg; break;
        case 'C': prefix_flag = "--enable-prefix-caching"; break;
        case 'c': prefix_flag = "--no-enable-prefix-caching"; break;
        case 'N': served = optarg; break;
        case 'y': {
            enum pd_route_policy p;
            if (pd_route_policy_parse(optarg, &p)) {
                fprintf(stderr, "pdmoe up: --policy %s: expected cache_aware or least_loaded\n", optarg);
                return 2;
            }
            policy = optarg;
            break;
        }
        case 'X': {
            /* checked here, passed to every instance: prefill and decode must speculate alike */
            pd_err se = {0};
            int k;
            if (pd_spec_config_parse(optarg, &k, &se)) {
                fprintf(stderr, "pdmoe up: %s\n", se.msg);
                return 2;
            }
            spec_flag = optarg;
            break;
        }
        case 'O':
            if (up_parse_hosts(optarg, hosts, &nhosts))
                return 2;
            break;
        case 'K': if (pd_cli_int_max("--kv-lease-ms", optarg, 100, 3600000, &lease_ms)) return 2; break;
        case 'k': key = optarg; break;
        case 'e':
        case 'f':
            if (pd_cli_int(c == 'e' ? "--prefill-ep" : "--decode-ep", optarg, 1, &ep_flag[c == 'f']))
                return 2;
            if (ep_flag[c == 'f'] > MAX_EP) {
                fprintf(stderr, "pdmoe up: %s %lld: this machine runs EP groups of 1 to %d ranks\n",
                        c == 'e' ? "--prefill-ep" : "--decode-ep", (long long)ep_flag[c == 'f'], MAX_EP);
                return 2;
            }
            break;
        case 'h':
            printf("usage: pdmoe up [--model models/mini] [--port 8000] [--prefill-instances 1] [--decode-instances 1]\n"
                   "       [--prefill-ep 1] [--decode-ep 1] [--plan plan.json] [--threads 1] [--max-model-len 2048]\n"
                   "       [--api-key KEY] [--kv-lease-ms 30000] [--host 127.0.0.1] [--max-num-seqs N]\n"
                   "       [--max-num-batched-tokens N] [--kv-cache-memory-bytes B] [--served-model-name NAME]\n"
                   "       [--kv-cache-dtype bf16|fp8] [--policy cache_aware|least_loaded]\n"
                   "       [--enable-prefix-caching | --no-enable-prefix-caching] [--plan plan.json --hosts H0,H1,...]\n"
                   "       [--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":K}']\n"
                   "       [--max-queued-requests N] [--shutdown-timeout S] [--watchdog-timeout S]\n"
                   "       [--liveness-timeout 30]\n"
                   "--max-queued-requests: each instance's waiting queue (pdmoe serve --help); with --plan too. A\n"
                   "429 from a full instance sends the request to another one; the client gets it when all are full.\n"
                   "--shutdown-timeout: at Ctrl-C or SIGTERM the proxy, then the instances, drain their requests in\n"
                   "flight (new ones get a 503) for at most S seconds each before they stop; a second signal to up\n"
                   "stops them at once.\n"
                   "--watchdog-timeout: each EP group ends when one of its rounds has made no progress for S seconds\n"
                   "(a rank stopped or hung; pdmoe serve's default 60, 0: never), and up starts it again.\n"
                   "--liveness-timeout: an instance or the proxy that has answered /health once since it started\n"
                   "and then not for S seconds (stopped, wedged, its host unreachable) is stopped (SIGTERM, SIGKILL\n"
                   "after 5 s) and started again as a dead one is (asked every second; 0: never).\n"
                   "--speculative-config: MTP speculative decoding on every instance (the prefill side hands the MTP\n"
                   "layer's KV and the draft's input to the decode side, which drafts; in EP groups rank to rank).\n"
                   "--policy: how the proxy picks the instance that prefills (pdmoe proxy --help; cache_aware by default).\n"
                   "--host: the proxy's address (the instances stay on 127.0.0.1, reached by the proxy only). The\n"
                   "engine flags go to every instance, as pdmoe serve reads them (not with --plan, which sets them).\n"
                   "Starts prefill and decode servers and the proxy on this machine (generating models/mini if it is\n"
                   "missing), prints the endpoint, and stops everything on Ctrl-C. A process that dies is started again\n"
                   "(backoff 0.5 s to 30 s; pdmoe_restarts_total in the proxy's /metrics). --api-key: every request to\n"
                   "the proxy and to each instance needs \"Authorization: Bearer KEY\" (or PDMOE_API_KEY in the environment;\n"
                   "the children get it there, never on their command lines). --kv-lease-ms: how long a prefill\n"
                   "instance keeps a prompt's KV for a decode instance that has not pulled it. An instance of EP size\n"
                   "N > 1 is an EP group of N ranks under mpirun (--threads is per rank). With --plan (pdmoe plan\n"
                   "--json), the plan's instances, EP sizes, per-rank KV pool (budget.kv_pool_bytes), max-num-seqs,\n"
                   "max-model-len, max-num-batched-tokens and KV cache dtype, refused if the pools and the model do\n"
                   "not fit this machine's memory. With --hosts (several hosts; the nodes' addresses in node order), the plan's\n"
                   "node map puts each instance and EP rank on its host, every process binding its host's address;\n"
                   "each instance is started on its first host by mpirun (ssh, or OMPI_MCA_plm_rsh_agent), the\n"
                   "proxy here; a host the launcher cannot reach is refused by name: each host must start a process\n"
                   "(mpirun --host H -n 1 true) within --host-timeout S (20; an ssh through a jump host may need more).\n");
            return 0;
        default:
            return pd_cli_bad_flag("up", c, argc, argv);
        }
    }
    if (pd_cli_no_args("up", argc, argv) || pd_cli_api_key("up", key, &key))
        return 2;
    char served_buf[256];
    const char *name = served ? served : pd_launch_served_name(model, served_buf, sizeof served_buf);
    pd_err we = {0};
    if (pd_launch_check_words(model, name, &we)) {
        fprintf(stderr, "pdmoe up: %s\n", we.msg);
        return 2;
    }
    /* the children read the key from their environment: on their command lines every user of the
     * machine would see it in ps (mpirun passes it on by name, -x PDMOE_API_KEY) */
    if (key && setenv("PDMOE_API_KEY", key, 1)) {
        fprintf(stderr, "pdmoe up: cannot set PDMOE_API_KEY: %s\n", strerror(errno));
        return 2;
    }
    if (host_flag && !nhosts) {
        fprintf(stderr, "pdmoe up: --host-timeout is how long each host of --hosts may take to start a process; "
                        "without --hosts every instance runs here\n");
        return 2;
    }
    if (nhosts && !plan) {
        fprintf(stderr, "pdmoe up: --hosts needs --plan plan.json (pdmoe plan --json): its node map places each "
                        "instance and EP rank on a host, as pdmoe plan --emit does\n");
        return 2;
    }
    if (plan && (seqs_flag || batched_flag || kvbytes_flag || dtype_flag || spec_flag)) {
        fprintf(stderr, "pdmoe up: %s: --plan %s sets it; give one or the other\n",
                seqs_flag ? "--max-num-seqs" : batched_flag ? "--max-num-batched-tokens"
                : kvbytes_flag ? "--kv-cache-memory-bytes" : dtype_flag ? "--kv-cache-dtype" : "--speculative-config",
                plan);
        return 2;
    }
    int ep[2] = {(int)ep_flag[0], (int)ep_flag[1]};
    struct up_plan u;
    memset(&u, 0, sizeof u);
    if (plan) {
        if (up_read_plan(plan, &u, nhosts > 0, model) || (!nhosts && up_plan_fits(plan, &u, model)))
            return 2;
        np = u.aggregated ? 0 : u.instances[0];
        nd = u.instances[1];
        ep[0] = u.ep[0];
        ep[1] = u.ep[1];
        max_len = u.max_model_len;
    }
    char self[4096], path[600];
    ssize_t sn = readlink("/proc/self/exe", self, sizeof self - 1);
    if (sn <= 0) {
        fprintf(stderr, "pdmoe up: cannot find this program's path\n");
        return 1;
    }
    self[sn] = 0;
    /* one file, or shards with their index (pdmoe convert writes the release's shards) */
    snprintf(path, sizeof path, "%s/model.safetensors", model);
    char index[640];
    snprintf(index, sizeof index, "%s/model.safetensors.index.json", model);
    struct stat st;
    if (stat(path, &st) != 0 && stat(index, &st) != 0) {
        if (strcmp(model, "models/mini") != 0) {
            fprintf(stderr, "pdmoe up: --model %s: no model.safetensors or model.safetensors.index.json there\n",
                    model);
            return 2;
        }
        fprintf(stderr, "pdmoe up: generating models/mini (v4-flash-mini, about 1 GB)...\n");
        mkdir("models", 0755);
        pd_err e = {0};
        if (pd_genmodel("v4-flash-mini", model, 1, &e)) {
            fprintf(stderr, "pdmoe up: %s\n", e.msg);
            return 1;
        }
    }
    struct sigaction sa = {.sa_handler = on_stop};
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    struct child ch[MAX_CHILDREN];
    memset(ch, 0, sizeof ch);
    int n = 0;
    const char *tmp = tmp_dir();
    sweep_stale_dirs(tmp);
    char mdir[300], mfile[320], pfile[320];
    snprintf(mdir, sizeof mdir, "%s/pdmoe-up-XXXXXX", tmp);
    if (!mkdtemp(mdir)) {
        fprintf(stderr, "pdmoe up: cannot create a directory in %s: %s\n", tmp, strerror(errno));
        return 1;
    }
    snprintf(mfile, sizeof mfile, "%s/restarts.prom", mdir);
    snprintf(pfile, sizeof pfile, "%s/pid", mdir);   /* whose it is, for the sweep of a later run */
    FILE *pf = fopen(pfile, "w");
    int pid_ok = pf && fprintf(pf, "%ld\n", (long)getpid()) > 0 && fflush(pf) == 0;
    if ((pf && fclose(pf) != 0) || !pid_ok)
        fprintf(stderr, "pdmoe up: cannot write %s: %s (if this run is killed, a later one will not know to remove "
                        "%s)\n", pfile, strerror(errno ? errno : EIO), mdir);
    char sth[16], slen[16];
    snprintf(sth, sizeof sth, "%lld", (long long)threads);
    snprintf(slen, sizeof slen, "%lld", (long long)max_len);
    /* the instances: where each one's ranks run (the plan's node map on --hosts, else this
     * machine), their ports, and their command lines (plan/launch.h, which --emit pdmoe prints) */
    int ni = 0;
    struct pd_launch_inst *inst = calloc(MAX_CHILDREN, sizeof *inst);
    if (!inst) {
        fprintf(stderr, "pdmoe up: out of memory\n");
        return 1;
    }
    int failed = 0;
    if (nhosts) {
        if (up_read_node_map(plan, hosts, nhosts, u.aggregated, inst, &ni))
            failed = 2;
    } else {
        for (int r = 0; r < 2; r++)
            for (int i = 0; i < (r ? nd : np); i++)
                inst[ni++] = (struct pd_launch_inst){.role = r, .inst = i, .n_groups = 1, .ranks = ep[r],
                                                     .group = {{.host = NULL, .ranks = ep[r]}},
                                                     .colocated = u.aggregated};
    }
    if (!failed && kvbytes_flag && pools_past_memory(kvbytes_flag, inst, ni))
        failed = 2;
    pd_err pe = {0};
    if (!failed && (pd_launch_ports(inst, ni, (int)port, &pe) || (nhosts && reachable(inst, ni, (int)host_s)) ||
                    ports_wait(inst, ni, (int)port))) {
        if (pe.msg[0])
            fprintf(stderr, "pdmoe up: %s\n", pe.msg);
        failed = 2;
    }
    /* each decode instance pulls from these producers and from nowhere else */
    char *producers = failed ? NULL : pd_launch_kv_producers(inst, ni);
    for (int i = 0; i < ni && !failed; i++) {
        const struct pd_launch_inst *x = &inst[i];
        struct pd_launch_opts lo = {.pdmoe = self, .model = model, .served_name = name, .api_key = key,
                                    .kv_producers = producers,
                                    .threads = sth, .max_model_len = slen, .lease_ms = (int)lease_ms,
                                    .allow_run_as_root = geteuid() == 0, .oversubscribe = 1,
                                    .remote = x->group[0].host && !pd_net_is_local(x->group[0].host)};
        if (plan)   /* the plan's pool and limits, per rank */
            lo.plan = (struct pd_launch_limits){.kv_cache_bytes = u.kv_pool[x->role],
                                                .max_num_seqs = u.launched_seqs[x->role],
                                                .max_num_batched_tokens = u.max_num_batched_tokens,
                                                .kv_cache_dtype = u.kv_cache_dtype, .spec_k = (int)u.spec_k};
        int e = 0;
        const char *pass[][2] = {{"--max-num-seqs", seqs_flag}, {"--max-num-batched-tokens", batched_flag},
                                 {"--kv-cache-memory-bytes", kvbytes_flag}, {"--kv-cache-dtype", dtype_flag},
                                 {"--speculative-config", spec_flag}, {"--max-queued-requests", queued_flag},
                                 {"--shutdown-timeout", drain_flag}};
        for (size_t j = 0; j < sizeof pass / sizeof pass[0]; j++)
            if (pass[j][1]) {
                lo.extra[e++] = pass[j][0];
                lo.extra[e++] = pass[j][1];
            }
        if (prefix_flag)
            lo.extra[e++] = prefix_flag;
        if (watchdog_flag && x->ranks > 1) {   /* (serve takes it for EP groups only) */
            lo.extra[e++] = "--watchdog-timeout";
            lo.extra[e++] = watchdog_flag;
        }
        const char *role = x->colocated ? "aggregated" : x->role ? "decode" : "prefill";
        int local = 1;
        for (int g = 0; g < x->ranks; g++)
            local &= !x->group[g].host || pd_net_is_local(x->group[g].host);
        ch[n] = (struct child){.port = x->port, .role = role, .instance = x->inst,
                               .host = x->group[0].host, .kv_port = x->kv_port, .ranks = x->ranks, .local = local};
        if (!(ch[n].argv = pd_launch_argv(x, &lo))) {
            fprintf(stderr, "pdmoe up: out of memory\n");
            failed = 1;
            break;
        }
        spawn(&ch[n]);
        snprintf(ch[n].what, sizeof ch[n].what, "%s instance %d (%s%s:%d)", role, x->inst,
                 x->ranks > 1 ? "EP group, rank 0 on " : "", x->group[0].host ? x->group[0].host : "127.0.0.1",
                 x->port);
        n++;
    }
    /* the proxy, in front of every instance's first host and port (plan/launch.h) */
    struct pd_launch_proxy po = {.pdmoe = self, .host = host, .port = (int)port, .metrics_file = mfile, .api_key = key,
                                 .policy = policy, .shutdown_timeout_s = (int)drain_s};
    const int proxy = n;
    if (!failed) {
        ch[n] = (struct child){.port = (int)port, .role = "proxy", .host = host};
        if (!(ch[n].argv = pd_launch_proxy_argv(inst, ni, &po))) {
            fprintf(stderr, "pdmoe up: out of memory\n");
            failed = 1;
        }
    }
    free(inst);
    free(producers);
    if (failed) {   /* nothing half-started is left behind */
        up_stop_all(ch, n, 0);   /* (failed already: what went wrong is said above) */
        for (int i = 0; i < n; i++)
            pd_launch_argv_free(ch[i].argv);
        remove_run_dir(mdir);
        return failed;
    }
    snprintf(ch[n].what, sizeof ch[n].what, "proxy");
    write_metrics(mfile, ch, n + 1);
    spawn(&ch[n]);
    n++;
    /* wait until everything is healthy (or something dies) */
    int ready = 0, rc = 0;
    for (int t = 0; t < 1200 && !up_stopping && !ready; t++) {
        ready = 1;
        for (int i = 0; i < n; i++) {
            char how[1024];
            if (reaped(&ch[i], how, sizeof how)) {
                if (ch[i].refused) {
                    /* its configuration, which another start would refuse again: its message above */
                    fprintf(stderr, "pdmoe up: the %s refused its configuration (its message is above; exit "
                            "status %d): not starting it again\n", ch[i].what, PD_CLI_EXIT_CONFIG);
                    ch[i].pid = 0;
                    up_stopping = 1;
                    rc = 1;
                } else if (ch[i].restarts < START_TRIES - 1) {
                    /* a start can fail for a passing reason (two mpiruns starting at the same moment race
                     * for Open MPI's session directory); a bad flag fails every time */
                    fprintf(stderr, "pdmoe up: the %s %s before it was ready; starting it again\n", ch[i].what, how);
                    restart(&ch[i], mfile, ch, n);
                } else {
                    fprintf(stderr, "pdmoe up: the %s %s before it was ready (%d tries)\n", ch[i].what, how,
                            START_TRIES);
                    ch[i].pid = 0;
                    up_stopping = 1;
                    rc = 1;
                }
            }
            /* the proxy last (ch[n - 1]), so its own checks have had the instances' answers */
            ready &= ch[i].pid > 0 && (i == n - 1 ? proxy_ready : healthy)(ch[i].host, ch[i].port);
        }
        if (!ready)
            nanosleep(&(struct timespec){0, 100000000}, NULL);
    }
    if (ready && !up_stopping) {
        char layout[96];
        if (u.aggregated)
            snprintf(layout, sizeof layout, "%lld aggregated (EP %d) instance%s", (long long)nd, ep[1],
                     nd > 1 ? "s" : "");
        else
            snprintf(layout, sizeof layout, "%lld prefill (EP %d) and %lld decode (EP %d) instance%s", (long long)np,
                     ep[0], (long long)nd, ep[1], nd > 1 ? "s" : "");
        printf("pdmoe up: %s of %s behind http://%s:%lld/v1 (model \"%s\"); Ctrl-C stops everything\n", layout, model,
               host, (long long)port, name);
        fflush(stdout);
    } else if (!up_stopping) {
        fprintf(stderr, "pdmoe up: the cluster did not become healthy in 120 s\n");
        rc = 1;
    }
    for (int i = 0; i < n; i++) {
        ch[i].backoff = BACKOFF_MIN_S;
        ch[i].answered = ch[i].pid > 0 ? pd_now_s() : 0;   /* each answered the readiness loop's last round */
    }
    /* supervise: reap the dead, start them again when their backoff is over */
    while (!up_stopping) {
        nanosleep(&(struct timespec){0, 100000000}, NULL);
        double now = pd_now_s();
        for (int i = 0; i < n && !up_stopping; i++) {
            char how[1024];
            if (reaped(&ch[i], how, sizeof how)) {
                if (now - ch[i].started >= BACKOFF_MAX_S)
                    ch[i].backoff = BACKOFF_MIN_S;   /* it had been running well */
                ch[i].pid = 0;
                ch[i].died_at = now;
                ch[i].restart_at = now + ch[i].backoff;
                char ts[24];
                fprintf(stderr, "pdmoe up: %s the %s %s; restarting it in %.1f s\n", stamp(ts), ch[i].what, how,
                        ch[i].backoff);
                ch[i].backoff = ch[i].backoff * 2 < BACKOFF_MAX_S ? ch[i].backoff * 2 : BACKOFF_MAX_S;
            } else if (ch[i].pid > 0) {
                check_alive(&ch[i], (double)live_s, now);
            } else if (ch[i].pid == 0 && now >= ch[i].restart_at) {
                if (now < ch[i].died_at + PORT_GRACE_S && ports_still_bound(&ch[i])) {
                    if (!ch[i].port_wait_said) {   /* the delay the death's line gave is not the one */
                        char ts[24];
                        fprintf(stderr, "pdmoe up: %s the %s's ports are still bound (its old processes, or "
                                "another program); waiting up to %.0f s for them\n", stamp(ts), ch[i].what,
                                PORT_GRACE_S);
                        ch[i].port_wait_said = 1;
                    }
                    ch[i].restart_at = now + 0.1;   /* its old processes are still going */
                    continue;
                }
                ch[i].port_wait_said = 0;
                restart(&ch[i], mfile, ch, n);
                char ts[24];
                fprintf(stderr, "pdmoe up: %s restarted the %s (restart %d, pid %d)\n", stamp(ts), ch[i].what,
                        ch[i].restarts, (int)ch[i].pid);
            }
        }
    }
    /* the proxy first: it answers the streams in flight while the instances still run */
    int bad = up_stop_all(&ch[proxy], 1, (int)drain_s);
    bad += up_stop_all(ch, n, (int)drain_s);
    for (int i = 0; i < n; i++)
        pd_launch_argv_free(ch[i].argv);
    remove_run_dir(mdir);
    if (bad) {   /* each named above: a supervisor (systemd) sees a stop that was not clean */
        fprintf(stderr, "pdmoe up: stopped; %d process%s did not stop cleanly\n", bad, bad > 1 ? "es" : "");
        return rc ? rc : 1;
    }
    fprintf(stderr, "pdmoe up: stopped\n");
    return rc;
}

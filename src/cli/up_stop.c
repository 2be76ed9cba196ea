/* `pdmoe up`'s stop: every child is sent SIGTERM, waited for, killed after its grace, and judged.
 * A stop an operator (or systemd) can trust says when a child did not stop cleanly: a leak report
 * at exit, a crash in a destructor, a drain that never ended. up now exits 1 after naming each
 * such child (its role and index, pid, and how it ended); before, it exited 0 whatever they did.
 *
 * The rule for an EP group (an mpirun of serve's ranks): Open MPI 4.1's mpirun, when it is itself
 * signalled, exits 1 however its ranks end (measured: ranks that all trapped SIGTERM and exited 0
 * gave 1, as did ranks that exited 23), so its status then says nothing. When the ranks end by
 * themselves it passes on theirs (0 when all exited 0, else the first failing rank's: 23 for ranks
 * that exited 23). So up signals rank 0 alone when it runs on this host (the child of the mpirun
 * whose environment says OMPI_COMM_WORLD_RANK=0): rank 0 takes SIGTERM as serve does, broadcasts
 * the group's end, every rank exits, and mpirun's status is the ranks' own, judged like any other
 * child's. A group whose rank 0 is on another host (--hosts) has its mpirun signalled, as before,
 * and mpirun's 1 then is the signal's, not a failure; a death by a signal still is. */
#include "cli/cli.h"
#include "cli/up.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

volatile sig_atomic_t up_stopping;

void up_describe(int status, char *out, size_t cap)
{
    /* PD_CLI_EXIT_CONFIG said for what it is (a bare 78 told the operator nothing: a model
     * directory renamed or a checkpoint replaced under a running cluster makes every restart
     * refuse it until it is put right) */
    if (WIFSIGNALED(status))
        snprintf(out, cap, "was killed by signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
    else if (WEXITSTATUS(status) == PD_CLI_EXIT_CONFIG)
        snprintf(out, cap, "exited with status %d: it refused its configuration (a flag, a file of the model, or "
                 "a pool this host cannot hold; its message is above)", PD_CLI_EXIT_CONFIG);
    else
        snprintf(out, cap, "exited with status %d", WEXITSTATUS(status));
}

void up_each_process(void (*fn)(int pid, void *arg), void *arg)
{
    DIR *d = opendir("/proc");
    for (struct dirent *de; d && (de = readdir(d));)
        if (atoi(de->d_name) > 0)
            fn(atoi(de->d_name), arg);
    if (d)
        closedir(d);
}

int up_proc_stat(int pid, int *ppid, int *session)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f)
        fclose(f);
    buf[n] = 0;
    /* pid (comm) state ppid pgrp session ...: comm may hold spaces, so after its last ')' */
    const char *rp = strrchr(buf, ')');
    int pgrp;
    char state;
    return rp && sscanf(rp + 1, " %c %d %d %d", &state, ppid, &pgrp, session) == 4 ? 0 : -1;
}

/* The ranks an mpirun started on this host: its children, rank 0 among them when it is here. */
struct group_ranks {
    pid_t mpirun, rank0;
    pid_t pid[MAX_EP];
    int n;
};

/* up_each_process: pid is recorded if its parent is w->mpirun (and as rank 0 if its environment
 * says OMPI_COMM_WORLD_RANK=0: Open MPI sets it in every rank it starts). */
static void note_rank(int pid, void *arg)
{
    struct group_ranks *w = arg;
    int ppid, session;
    if (up_proc_stat(pid, &ppid, &session) || ppid != w->mpirun || w->n >= MAX_EP)
        return;
    w->pid[w->n++] = pid;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/environ", pid);
    FILE *f = fopen(path, "r");
    static const char want[] = "OMPI_COMM_WORLD_RANK=0";
    char var[64];
    size_t k = 0;
    for (int ch; f && (ch = fgetc(f)) != EOF;) {   /* NUL-separated NAME=value entries */
        if (ch) {
            if (k < sizeof var - 1)
                var[k++] = (char)ch;
            continue;
        }
        var[k] = 0;
        k = 0;
        if (!strcmp(var, want))
            w->rank0 = pid;
    }
    if (f)
        fclose(f);
}

/* Sends child c its stop: SIGTERM to it (to an EP group's rank 0 when that runs here: see the top),
 * then SIGCONT to its process group and its ranks', as systemd sends them: a child stopped (SIGSTOP,
 * a debugger) never saw the SIGTERM, was SIGKILLed after 10 s, and an mpirun killed so left its
 * ranks' shared-memory segments in /dev/shm. */
static void send_stop(struct child *c)
{
    c->term_pid = c->pid;
    struct group_ranks g = {.mpirun = c->pid};
    if (c->ranks > 1)
        up_each_process(note_rank, &g);
    if (g.rank0 > 0)
        c->term_pid = g.rank0;
    kill(c->term_pid, SIGTERM);
    kill(-c->pid, SIGCONT);
    for (int k = 0; k < g.n; k++) {   /* (Open MPI puts each rank in a process group of its own) */
        kill(-g.pid[k], SIGCONT);
        kill(g.pid[k], SIGCONT);
    }
}

/* 1, said, when child c's wait status st at its stop is a failure: an exit status but 0, or a
 * signal but the SIGTERM up sent; an mpirun that up signalled itself exits 1 for that alone. */
static int stop_failed(const struct child *c, int st)
{
    if (WIFEXITED(st) && (WEXITSTATUS(st) == 0 || (c->ranks > 1 && c->term_pid == c->pid && WEXITSTATUS(st) == 1)))
        return 0;
    if (WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM)
        return 0;
    char how[256];
    up_describe(st, how, sizeof how);
    fprintf(stderr, "pdmoe up: the %s (pid %d) %s at its stop\n", c->what, (int)c->pid, how);
    return 1;
}

int up_stop_all(struct child *c, int n, int drain_s)
{
    int failed = 0;
    for (int i = 0; i < n; i++)
        if (c[i].pid > 0)
            send_stop(&c[i]);
    /* give them 10 s to answer their clients and exit (and --shutdown-timeout to drain), then kill;
     * a second signal to up is passed on, which stops a draining child at once */
    int passed = 0;
    for (int t = 0; t < 20 * (10 + drain_s); t++) {
        if (up_stopping >= 2 && !passed) {
            passed = 1;
            for (int i = 0; i < n; i++)
                if (c[i].pid > 0)
                    kill(c[i].term_pid, SIGTERM);
        }
        int alive = 0;
        for (int i = 0; i < n; i++)
            if (c[i].pid > 0) {
                int st;
                if (waitpid(c[i].pid, &st, WNOHANG) == c[i].pid) {
                    failed += stop_failed(&c[i], st);
                    c[i].pid = 0;
                } else {
                    alive = 1;
                }
            }
        if (!alive)
            return failed;
        nanosleep(&(struct timespec){0, 50000000}, NULL);
    }
    for (int i = 0; i < n; i++)
        if (c[i].pid > 0) {
            fprintf(stderr, "pdmoe up: the %s (pid %d) did not exit within %d s of its SIGTERM: killed (signal %d, "
                    "%s)\n", c[i].what, (int)c[i].pid, 10 + drain_s, SIGKILL, strsignal(SIGKILL));
            if (c[i].term_pid != c[i].pid)
                kill(c[i].term_pid, SIGKILL);
            kill(c[i].pid, SIGKILL);
            waitpid(c[i].pid, NULL, 0);
            c[i].pid = 0;
            failed++;
        }
    return failed;
}

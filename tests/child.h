/* pdmoe processes a test starts (serve, proxy, up, an mpirun of serve's ranks) and their graceful
 * stop checked: a SIGTERM or SIGINT must end them with exit status 0 (an operator's supervisor sees
 * anything else), and, under AddressSanitizer, without a sanitizer report (LeakSanitizer's check at
 * their exit). Before, a test sent SIGTERM and waited, and a leak in the child was an exit status 23
 * and a report on stderr nobody read.
 *
 * fork_pdmoe() forks with ASAN_OPTIONS extended by log_path=/tmp/pdmoe-san.TESTPID in the child, so
 * a report goes to the file /tmp/pdmoe-san.TESTPID.PID of the process that wrote it, the child's or
 * a process it started itself (up's servers and proxy, mpirun's ranks: they inherit it). The
 * environment is built before the fork (the child only swaps environ: no malloc between fork and
 * exec in a test that runs threads). stop_pdmoe() sends the signal, waits, and fails the test with
 * the status and the first lines of the child's report; child_exited_cleanly() is that check for a
 * test that waits itself. A report left by a process the child started (a server of up's, a rank)
 * fails the test after its body (child_reports_none, tests/criterion_wrap.c). Without
 * AddressSanitizer no file is ever written. */
#ifndef PD_TESTS_CHILD_H
#define PD_TESTS_CHILD_H

#include <criterion/criterion.h>
#include <glob.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* "ASAN_OPTIONS=" the test's own, then `extra` (NULL or options, ':'-separated), then
 * print_suppressions=0 (a process whose leaks were all suppressed would write a file of the
 * suppressions used, read as a report) and log_path=/tmp/pdmoe-san.TESTPID: for a child's
 * environment, or mpirun's -x. */
static inline void child_asan_options(char *buf, size_t cap, const char *extra)
{
    const char *asan = getenv("ASAN_OPTIONS");
    int n = snprintf(buf, cap, "ASAN_OPTIONS=%s%s%s%sprint_suppressions=0:log_path=/tmp/pdmoe-san.%d",
                     asan ? asan : "", asan && *asan ? ":" : "", extra ? extra : "", extra ? ":" : "",
                     (int)getpid());
    cr_assert(n > 0 && (size_t)n < cap, "ASAN_OPTIONS too long");
}

/* Whether environment entry `entry` ("NAME=value") has the name of one of vars' ("NAME=value",
 * NULL-ended; vars may be NULL). */
static inline int env_named(const char *entry, const char *const *vars)
{
    const size_t n = strcspn(entry, "=");
    for (size_t i = 0; vars && vars[i]; i++)
        if (strncmp(entry, vars[i], n) == 0 && vars[i][n] == '=')
            return 1;
    return 0;
}

/* environ with ASAN_OPTIONS ending in `asan_extra` (NULL or options) and
 * log_path=/tmp/pdmoe-san.TESTPID, and the variables of vars ("NAME=value", NULL-ended, or NULL)
 * in place of any of those names (malloc'ed; child_env_free) */
static inline char **child_env_with(const char *asan_extra, const char *const *vars)
{
    size_t n = 0, nv = 0;
    while (environ[n])
        n++;
    while (vars && vars[nv])
        nv++;
    char **env = calloc(n + nv + 2, sizeof *env);
    cr_assert_not_null(env);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (strncmp(environ[i], "ASAN_OPTIONS=", 13) && !env_named(environ[i], vars))
            env[k++] = strdup(environ[i]);
    char opt[2048];
    child_asan_options(opt, sizeof opt, asan_extra);
    env[k++] = strdup(opt);
    for (size_t i = 0; i < nv; i++)
        env[k++] = strdup(vars[i]);
    env[k] = NULL;
    return env;
}

static inline char **child_env(void)
{
    return child_env_with(NULL, NULL);
}

static inline void child_env_free(char **env)
{
    for (size_t i = 0; env[i]; i++)
        free(env[i]);
    free(env);
}

/* The pdmoe program the tests run: PDMOE_BIN, else build/pdmoe. */
static inline const char *pdmoe_bin(void)
{
    return getenv("PDMOE_BIN") ? getenv("PDMOE_BIN") : "build/pdmoe";
}

/* The absolute path of the test shim `name` (an LD_PRELOAD library of tests/preload/) beside
 * pdmoe_bin(), into path (PATH_MAX bytes); the test fails when it is not built. */
static inline void test_shim(const char *name, char *path)
{
    char shim[PATH_MAX];
    snprintf(shim, sizeof shim, "%s", pdmoe_bin());
    char *slash = strrchr(shim, '/');
    snprintf(slash ? slash + 1 : shim, sizeof shim - (size_t)(slash ? slash + 1 - shim : 0), "%s", name);
    cr_assert_not_null(realpath(shim, path), "%s: build it (make %s)", shim, shim);
}

/* fork() for a child that will exec pdmoe (directly, through bash -c "exec ...", or mpirun), with
 * environment env (child_env's: built before the fork, so that the child allocates nothing
 * between fork and exec in a test that runs threads; freed here in the parent). */
static inline pid_t fork_pdmoe_env(char **env)
{
    pid_t p = fork();
    if (p == 0) {
        environ = env;   /* (the copy is the child's now: never freed) */
        return 0;
    }
    child_env_free(env);
    cr_assert_geq(p, 0, "fork failed");
    return p;
}

static inline pid_t fork_pdmoe(void)
{
    return fork_pdmoe_env(child_env());
}

/* fork_pdmoe() for a child under the test shim at `shim` (test_shim's path): LD_PRELOAD=shim and
 * the variables of vars ("NAME=value", NULL-ended, at most 8) in its environment, and ASAN_OPTIONS
 * with verify_asan_link_order=0 (the shim comes before ASan's runtime, which then must not insist
 * on being first). This process's environment is left as it was. */
static inline pid_t fork_pdmoe_shimmed(const char *shim, const char *const *vars)
{
    char preload[PATH_MAX + 16];
    snprintf(preload, sizeof preload, "LD_PRELOAD=%s", shim);
    const char *all[10] = {preload};
    size_t n = 1;
    for (; vars && vars[n - 1]; n++) {
        cr_assert_lt(n, 9, "more than 8 variables for a shimmed child");
        all[n] = vars[n - 1];
    }
    all[n] = NULL;
    return fork_pdmoe_env(child_env_with("verify_asan_link_order=0", all));
}

/* Appends to msg (capacity cap) the first lines of the sanitizer report in `path`, removes it. */
static inline void child_report_take(const char *path, char *msg, size_t cap)
{
    FILE *f = fopen(path, "r");
    char line[512];
    int lines = 0;
    size_t len = strlen(msg);
    snprintf(msg + len, cap - len, "\n--- %s:", path);
    /* the summary and the first frames of the first allocations: enough to name the leak */
    while (f && fgets(line, sizeof line, f) && lines < 24) {
        if (line[0] == '\n' || !strncmp(line, "=====", 5))
            continue;
        len = strlen(msg);
        snprintf(msg + len, cap - len, "\n%.*s", (int)strcspn(line, "\n"), line);
        lines++;
    }
    if (f)
        fclose(f);
    remove(path);
}

/* Takes every sanitizer report a process of this test's wrote (msg, capacity cap, as
 * child_report_take): how many. */
static inline size_t child_reports_take_all(char *msg, size_t cap)
{
    char pattern[64];
    snprintf(pattern, sizeof pattern, "/tmp/pdmoe-san.%d.*", (int)getpid());
    glob_t g;
    if (glob(pattern, 0, NULL, &g) != 0)
        return 0;
    for (size_t i = 0; i < g.gl_pathc; i++)
        child_report_take(g.gl_pathv[i], msg, cap);
    size_t n = g.gl_pathc;
    globfree(&g);
    return n;
}

/* Fails the test if any process it started (through fork_pdmoe), or one those started, wrote a
 * sanitizer report that no stop took: run after the test's body (tests/criterion_wrap.c). */
static inline void child_reports_none(void)
{
    static char msg[16384];
    msg[0] = 0;
    size_t n = child_reports_take_all(msg, sizeof msg);
    if (n)
        cr_assert_fail("%zu process(es) this test started (or one of theirs, named by pid) wrote a sanitizer "
                       "report:%s", n, msg);
}

/* Fails the test unless wait status st of child pid, stopped by a signal, is exit status 0 (or
 * also_ok, when not 0) and the child wrote no sanitizer report; `what` names it. */
static inline void child_exited_with(pid_t pid, int st, int also_ok, const char *what)
{
    static char msg[16384];
    char path[64];
    snprintf(path, sizeof path, "/tmp/pdmoe-san.%d.%d", (int)getpid(), (int)pid);
    msg[0] = 0;
    int report = access(path, F_OK) == 0;
    if (report)
        child_report_take(path, msg, sizeof msg);
    if (WIFEXITED(st) && (WEXITSTATUS(st) == 0 || WEXITSTATUS(st) == also_ok) && !report)
        return;
    /* the reports of the processes it started (an mpirun's ranks: a rank's leak is its exit status
     * 23, mpirun's 1), which the check after the body will not see: the test fails here */
    child_reports_take_all(msg, sizeof msg);
    char how[64];
    if (WIFEXITED(st))
        snprintf(how, sizeof how, "exited %d", WEXITSTATUS(st));
    else if (WIFSIGNALED(st))
        snprintf(how, sizeof how, "was killed by signal %d", WTERMSIG(st));
    else
        snprintf(how, sizeof how, "ended with wait status %d", st);
    cr_assert_fail("%s %s at its graceful stop%s", what, how, msg);
}

/* The same for exit status 0 only: a pdmoe process ("pdmoe serve (port 8000)"). */
static inline void child_exited_cleanly(pid_t pid, int st, const char *what)
{
    child_exited_with(pid, st, 0, what);
}

/* The same for the mpirun of an EP group that was signalled itself (SIGTERM or SIGINT to mpirun or
 * to its process group): Open MPI's mpirun then exits 1 however its ranks ended (measured: every
 * rank printed "pdmoe serve: stopped" and exited 0). Its ranks' reports are still read, by the
 * check after the test's body; a group ended by SIGTERM on rank 0 alone must give 0. */
static inline void mpirun_signalled_cleanly(pid_t pid, int st, const char *what)
{
    child_exited_with(pid, st, 1, what);
}

/* Whether process pid has ended: gone, or a zombie its parent has not reaped yet (this
 * container's PID 1 reaps late, and kill(pid, 0) succeeds on a zombie). */
static inline int pid_ended(pid_t pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')');   /* the command name may hold spaces and parentheses */
    return !p || p[1] != ' ' || p[2] == 'Z';
}

/* Waits up to 60 s for child p to end (its wait status in *st), else SIGKILLs it (its process
 * group when group) and reaps it: 1 if it ended by itself. */
static inline int reap_within(pid_t p, int group, int *st)
{
    for (int i = 0; i < 1200; i++) {
        if (waitpid(p, st, WNOHANG) == p)
            return 1;
        usleep(50000);
    }
    kill(group ? -p : p, SIGKILL);
    waitpid(p, st, 0);
    return 0;
}

/* Sends sig (SIGTERM, SIGINT; to its process group when group) to *pid, waits for it, and checks
 * that it exited 0 without a sanitizer report; *pid = 0 (nothing done when it is 0 already). */
static inline void stop_pdmoe(pid_t *pid, int sig, int group, const char *what)
{
    if (*pid <= 0)
        return;
    pid_t p = *pid;
    int st = 0;
    *pid = 0;
    kill(group ? -p : p, sig);
    cr_assert(reap_within(p, group, &st), "%s did not exit within 60 s of signal %d", what, sig);
    child_exited_cleanly(p, st, what);
}

#endif

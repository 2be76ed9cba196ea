/* pdmoe up's own stop, as an operator's supervisor (systemd, a script) sees it: a child that does
 * not stop cleanly (an exit status but 0 at its SIGTERM, as a leak report at exit gives) makes up
 * exit 1, after a line naming it (role, index, pid, status); a clean stop, EP groups' included
 * (whose mpirun exits 1 whenever it is signalled itself), is still 0. The children are made to
 * fail by an LD_PRELOAD shim, build/libexitstatus.so (tests/preload/exitstatus.c). */
#include <criterion/criterion.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../tmpmodel.h"
#include "../pd/util.h"

static char dir[64];
static pid_t up_pid;   /* a cluster still running when a test fails */

static void setup(void)
{
    tmp_model("v4-tiny", 13, dir, sizeof dir);
}

static void teardown(void)
{
    if (up_pid > 0) {   /* up stops its children on SIGINT; its group, and theirs, if it does not */
        kill(up_pid, SIGINT);
        int st;
        if (!exited_within(up_pid, 60, &st)) {
            kill(-up_pid, SIGKILL);
            kill(up_pid, SIGKILL);
            waitpid(up_pid, NULL, 0);
        }
        up_pid = 0;
    }
    rm_model(dir);
}

TestSuite(up_stop, .init = setup, .fini = teardown, .timeout = 240);

/* Starts pdmoe up on port (one prefill instance, one decode instance of EP size decode_ep) under
 * the shim: the process whose command line holds "--port <fail_port>" (its rank `rank` when not
 * NULL) exits `status` at its end. Its stdout and stderr go to dir/up.out and dir/up.err; its pid
 * once it says it is ready. */
static pid_t start_failing_up(int port, int decode_ep, int fail_port, const char *rank, int status)
{
    char abs[PATH_MAX], out[128], err[128];
    test_shim("libexitstatus.so", abs);
    snprintf(out, sizeof out, "%s/up.out", dir);
    snprintf(err, sizeof err, "%s/up.err", dir);
    remove(out);   /* (a run before this one's "Ctrl-C" line is not this one's readiness) */
    remove(err);
    char args[96], st[48], rk[64];
    snprintf(args, sizeof args, "PDMOE_TEST_EXIT_ARGS=--port %d", fail_port);
    snprintf(st, sizeof st, "PDMOE_TEST_EXIT_STATUS=%d", status);
    snprintf(rk, sizeof rk, "PDMOE_TEST_EXIT_RANK=%s", rank ? rank : "");
    mpi_test_env();
    /* (up's children inherit the shim and its variables from up) */
    pid_t up = fork_pdmoe_shimmed(abs, (const char *const[]){args, st, rank ? rk : NULL, NULL});
    if (up == 0) {
        char sp[16], se[16];
        snprintf(sp, sizeof sp, "%d", port);
        snprintf(se, sizeof se, "%d", decode_ep);
        freopen(out, "w", stdout);
        freopen(err, "w", stderr);
        execl(pdmoe_bin(), pdmoe_bin(), "up", "--model", dir, "--port", sp, "--decode-ep", se, "--threads", "1", (char *)NULL);
        _exit(127);
    }
    up_pid = up;
    cr_assert(up_wait_ready(out), "pdmoe up did not become ready");
    return up;
}

/* SIGINT to up, as Ctrl-C: its wait status, its stderr in log. */
static int stop_up(char *log, size_t cap)
{
    pid_t up = up_pid;
    int st = 0;
    kill(up, SIGINT);
    cr_assert(exited_within(up, 60, &st), "pdmoe up did not exit within 60 s of SIGINT");
    up_pid = 0;
    char err[128];
    snprintf(err, sizeof err, "%s/up.err", dir);
    FILE *f = fopen(err, "r");
    size_t n = f ? fread(log, 1, cap - 1, f) : 0;
    log[n] = 0;
    if (f)
        fclose(f);
    return st;
}

/* The decode instance's serve exits 3 at its SIGTERM (as a leak report would make it 23): up's
 * exit status was 0 all the same, and its log said "stopped" only. */
Test(up_stop, an_instance_that_fails_its_stop_fails_up_and_is_named)
{
    const int port = test_ports(), decode = port + 2;   /* (plan/launch.h: prefill first) */
    start_failing_up(port, 1, decode, NULL, 3);
    char log[16384], want[160];
    int st = stop_up(log, sizeof log);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1, "pdmoe up ended with wait status %d, not exit status 1; its "
              "log:\n%s", st, log);
    snprintf(want, sizeof want, "the decode instance 0 (127.0.0.1:%d) (pid ", decode);
    const char *line = strstr(log, want);
    cr_assert(line, "up's log does not name the decode instance (\"%s\"):\n%s", want, log);
    cr_assert(strstr(line, ") exited with status 3 at its stop\n"), "up's log:\n%s", log);
    cr_assert_not_null(strstr(log, "pdmoe up: stopped; 1 process did not stop cleanly\n"), "%s", log);
    cr_assert_null(strstr(log, "prefill instance 0 (127.0.0.1"), "the prefill instance stopped cleanly:\n%s", log);
}

/* An EP group stopped cleanly leaves up's status 0 (its mpirun is not judged by the 1 it exits
 * when signalled); one whose rank 1 exits 3 at the group's end is named with that status (mpirun
 * passes it on now that up signals rank 0 alone). */
Test(up_stop, an_ep_group_is_judged_by_its_ranks)
{
    const int port = test_ports(), decode = port + 2;
    start_failing_up(port, 2, decode, "1", 3);
    char log[16384], want[160];
    int st = stop_up(log, sizeof log);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1, "pdmoe up ended with wait status %d, not exit status 1; its "
              "log:\n%s", st, log);
    snprintf(want, sizeof want, "the decode instance 0 (EP group, rank 0 on 127.0.0.1:%d) (pid ", decode);
    const char *line = strstr(log, want);
    cr_assert(line, "up's log does not name the EP group (\"%s\"):\n%s", want, log);
    cr_assert(strstr(line, ") exited with status 3 at its stop\n"), "up's log:\n%s", log);
    cr_assert_not_null(strstr(log, "pdmoe up: stopped; 1 process did not stop cleanly\n"), "%s", log);
    /* the same group, no rank failing: 0 */
    start_failing_up(port, 2, decode, "7", 3);
    st = stop_up(log, sizeof log);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "pdmoe up ended with wait status %d after a clean stop of its "
              "EP group; its log:\n%s", st, log);
    cr_assert_not_null(strstr(log, "pdmoe up: stopped\n"), "%s", log);
}

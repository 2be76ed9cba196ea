/* An EP group's rank that dies (SIGKILL of rank 1, mpirun -n 2, real processes on loopback) is
 * known to rank 0 at once, from the connection each rank holds to it: within 300 ms /readiness
 * is a 503 naming the rank (mpirun, which tells rank 0 nothing for 1.0 s, is not waited for), a
 * new completion is a 503 naming it, a stream in flight ends with an error event naming it and
 * [DONE], and rank 0 exits non-zero with a line naming it so that `pdmoe up` restarts the group.
 * A group that ends normally (SIGTERM on rank 0) is no death: every rank exits 0. The other way,
 * the same connection: rank 1 of an idle group sleeps on it (no CPU) until rank 0 wakes it for a
 * round, and a SIGKILL of rank 0 ends rank 1 at once, with a line naming rank 0 (mpirun's SIGKILL
 * ended it 2 s later), whether rank 1 waited between rounds or inside one. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <sys/syscall.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/timing.h"
#include "../tmpmodel.h"
#include "util.h"

static char dir[64], log_path[96];
static pid_t group;
static int base_port;

static void setup(void)
{
    tmp_model("v4-tiny", 17, dir, sizeof dir);
    snprintf(log_path, sizeof log_path, "%s/serve.log", dir);
    mpi_test_env();
    base_port = test_ports();
}

static void teardown(void)
{
    int st;
    if (group > 0) {
        kill(-group, SIGTERM);
        if (!exited_within(group, 15, &st)) {
            kill(-group, SIGKILL);
            waitpid(group, &st, 0);
        }
        group = 0;
    }
    rm_model(dir);
}

TestSuite(server_ep_death, .init = setup, .fini = teardown, .timeout = 240);

/* mpirun -n 2 ... serve --enable-expert-parallel on `port`, in its own process group, output to
 * the log; returns once /health answers. */
static pid_t start_group(int port)
{
    char sp[16];
    snprintf(sp, sizeof sp, "%d", port);
    char *argv[] = {"mpirun", "-n", "2", "--oversubscribe", (char *)pdmoe_bin(), "serve", "--model", dir,
                    "--enable-expert-parallel", "--data-parallel-size", "2", "--port", sp, "--threads", "1",
                    "--max-num-seqs", "4", "--max-model-len", "4096", "--served-model-name", "tiny", NULL};
    pid_t pid = fork();
    if (pid == 0) {
        setpgid(0, 0);
        if (!freopen(log_path, "w", stderr) || !freopen("/dev/null", "w", stdout))
            _exit(126);
        execvp(argv[0], argv);
        _exit(127);
    }
    setpgid(pid, pid);
    char out[256];
    for (int i = 0; i < 600; i++) {
        if (curl_port(port, "/health", NULL, NULL, out, sizeof out) == 200)
            return pid;
        int st;
        cr_assert_neq(waitpid(pid, &st, WNOHANG), pid, "the group exited before it was healthy (status %d)", st);
        usleep(100000);
    }
    cr_assert_fail("the group on port %d did not become healthy", port);
    return pid;
}

/* One HTTP/1.0 request on a socket of our own (curl's start alone costs more than the bound
 * measured): its status (0 when the connection failed), the body in out. */
static int http_raw(int port, const char *method, const char *path, const char *body, char *out, size_t cap)
{
    char req[1024];
    int n = snprintf(req, sizeof req, "%s %s HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
                     method, path, body ? strlen(body) : 0, body ? body : "");
    return http_exchange(port, req, (size_t)n, 5, out, cap);
}

static void read_log(char *log, size_t cap)
{
    FILE *f = fopen(log_path, "r");
    size_t n = f ? fread(log, 1, cap - 1, f) : 0;
    log[n] = 0;
    if (f)
        fclose(f);
}

Test(server_ep_death, a_killed_rank_is_known_to_rank_0_at_once)
{
    int pg = base_port;
    group = start_group(pg);
    char out[1 << 14];
    /* a long stream in flight when rank 1 dies */
    char cmd[512];
    snprintf(cmd, sizeof cmd, "curl -s -N --max-time 60 http://127.0.0.1:%d/v1/completions -d '{\"prompt\":\"x\","
             "\"max_tokens\":4000,\"ignore_eos\":true,\"stream\":true}'", pg);
    FILE *stream = popen(cmd, "r");
    int running = 0;
    for (int i = 0; i < 1000 && (running = metric_port(pg, "pdmoe_num_requests_running")) < 1; i++)
        usleep(5000);
    cr_assert_eq(running, 1, "the stream did not start");
    pid_t r[2];
    rank_pids(pg, r);
    const int64_t t0 = pd_now_ns();
    kill(r[1], SIGKILL);
    /* /health: a 503 naming the rank (the proxy routes by it), long before mpirun's SIGTERM to
     * rank 0 (1.0 s) */
    int code = 0;
    int64_t t = t0;
    while ((t = pd_now_ns()) - t0 < 300000000 && (code = http_raw(pg, "GET", "/health", NULL, out, sizeof out)) == 200)
        usleep(2000);
    cr_assert_eq(code, 503, "/health was %d %.0f ms after rank 1 was killed: %s", code, (t - t0) / 1e6, out);
    fprintf(stderr, "server_ep_death: /health 503 %.1f ms after the SIGKILL of rank 1\n", (t - t0) / 1e6);
    cr_assert(strstr(out, "rank 1"), "%s", out);
    /* /readiness: a 503 naming the rank, its number a field of its own */
    code = http_raw(pg, "GET", "/readiness", NULL, out, sizeof out);
    cr_assert_eq(code, 503, "/readiness was %d %.0f ms after rank 1 was killed: %s", code, (pd_now_ns() - t0) / 1e6,
                 out);
    json_t *j = parse(out);
    cr_assert_str_eq(json_string_value(json_object_get(j, "status")), "not ready", "%s", out);
    cr_assert_eq(json_integer_value(json_object_get(j, "dead_rank")), 1, "%s", out);
    const char *reason = json_string_value(json_object_get(j, "reason"));
    cr_assert(reason && strstr(reason, "rank 1"), "%s", out);
    json_decref(j);
    /* a new completion: a 503 naming the rank, not a request routed to the broken group */
    code = http_raw(pg, "POST", "/v1/completions", "{\"prompt\":\"y\",\"max_tokens\":4}", out, sizeof out);
    cr_assert_eq(code, 503, "%s", out);
    j = parse(out);
    const char *msg = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    cr_assert(msg && strstr(msg, "rank 1"), "%s", out);
    json_decref(j);
    /* the stream: its last events an error naming the rank, then [DONE] */
    static char streamed[1 << 20];
    size_t n = fread(streamed, 1, sizeof streamed - 1, stream);
    streamed[n] = 0;
    pclose(stream);
    size_t len = strlen(streamed);
    while (len && streamed[len - 1] == '\n')
        streamed[--len] = 0;
    cr_assert(len > 12 && !strcmp(streamed + len - 12, "data: [DONE]"), "the stream was cut: ...%s",
              streamed + (len > 300 ? len - 300 : 0));
    len -= 12;
    streamed[len] = 0;
    while (len && streamed[len - 1] == '\n')
        streamed[--len] = 0;
    char *last = strrchr(streamed, '\n');
    last = last ? last + 1 : streamed;
    cr_assert(!strncmp(last, "data: {\"error\"", 14) && strstr(last, "rank 1"), "%s", last);
    /* and the group ends non-zero, rank 0 saying which rank died */
    int st;
    cr_assert(exited_within(group, 30, &st), "the group hung after rank 1 died");
    group = 0;
    cr_assert(!(WIFEXITED(st) && WEXITSTATUS(st) == 0), "the group exited 0 although rank 1 died");
    static char log[1 << 16];
    read_log(log, sizeof log);
    cr_assert(strstr(log, "pdmoe serve: EP rank 1 ") && strstr(log, "died"), "no line of rank 0 naming rank 1:\n%s",
              log);
    cr_assert_eq(processes_on(pg), 0);
}

/* A whole group is ready; the ranks close their connections to rank 0 when it ends normally: no
 * death is said. */
Test(server_ep_death, a_group_ending_normally_reports_no_death)
{
    int pg = base_port + 1;
    group = start_group(pg);
    char out[1 << 14];
    cr_assert_eq(http_raw(pg, "GET", "/readiness", NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out);
    cr_assert_str_eq(json_string_value(json_object_get(j, "status")), "ready", "%s", out);
    json_decref(j);
    cr_assert_eq(curl_port(pg, "/v1/completions", "{\"prompt\":\"hi\",\"max_tokens\":4}", NULL, out, sizeof out), 200,
                 "%s", out);
    pid_t r[2];
    rank_pids(pg, r);
    kill(r[0], SIGTERM);
    int st;
    cr_assert(exited_within(group, 30, &st), "the group did not end within 30 s of SIGTERM on rank 0");
    group = 0;
    static char log[1 << 16];
    read_log(log, sizeof log);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "mpirun ended with status %d:\n%s", st, log);
    cr_assert_null(strstr(log, "died"), "%s", log);
}

/* The tokens of a greedy completion of 8 tokens of "hello" (its text), and how long it took. */
static double greedy(int port, char *text, size_t cap)
{
    char out[1 << 14];
    const int64_t t0 = pd_now_ns();
    int code = http_raw(port, "POST", "/v1/completions", "{\"prompt\":\"hello\",\"max_tokens\":8,\"temperature\":0,"
                        "\"ignore_eos\":true}", out, sizeof out);
    const double s = (pd_now_ns() - t0) / 1e9;
    cr_assert_eq(code, 200, "%s", out);
    json_t *j = parse(out);
    const char *t = json_string_value(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "text"));
    cr_assert_not_null(t, "%s", out);
    snprintf(text, cap, "%s", t);
    json_decref(j);
    return s;
}

/* An idle group's rank 1 sleeps in poll() on its connection to rank 0: no CPU over 5 s (before,
 * tests of the broadcast every 2 ms: 9 ticks in 10 s, about 1% of a core); the round after the
 * idle wakes it (a rank asleep through a broadcast would hold the request until the watchdog) and
 * gives the same tokens as before it. */
Test(server_ep_death, an_idle_rank_sleeps_until_rank_0_wakes_it)
{
    int pg = base_port + 2;
    group = start_group(pg);
    char before[1024], after[1024];
    greedy(pg, before, sizeof before);
    pid_t r[2];
    rank_pids(pg, r);
    usleep(200000);
    const double c0 = cpu_seconds(r[1]);
    sleep(5);
    const double used = cpu_seconds(r[1]) - c0;
    fprintf(stderr, "server_ep_death: idle rank 1 used %.2f s of CPU in 5 s\n", used);
    cr_assert_leq(used, 0.01, "idle rank 1 used %.2f s of CPU in 5 s (a clock tick is 0.01 s)", used);
    const double s = greedy(pg, after, sizeof after);
    fprintf(stderr, "server_ep_death: 8 tokens after 5 s idle in %.1f ms\n", s * 1e3);
    cr_assert_lt(s, 5.0, "the first request after idle took %.1f s", s);
    cr_assert_str_eq(after, before);
}

/* Rank 0 killed while the group idles: rank 1 reads its connection's end and ends at once (not at
 * mpirun's SIGKILL, 2 s after), with a line naming rank 0's pid; the group ends non-zero. */
Test(server_ep_death, a_killed_rank_0_ends_rank_1_at_once)
{
    int pg = base_port + 3;
    group = start_group(pg);
    char text[1024];
    greedy(pg, text, sizeof text);
    pid_t r[2];
    rank_pids(pg, r);
    usleep(200000);
    const int64_t t0 = pd_now_ns();
    kill(r[0], SIGKILL);
    while (!pid_ended(r[1]) && pd_now_ns() - t0 < 3000000000LL)
        usleep(2000);
    const double ms = (pd_now_ns() - t0) / 1e6;
    fprintf(stderr, "server_ep_death: rank 1 ended %.1f ms after the SIGKILL of rank 0\n", ms);
    cr_assert(pid_ended(r[1]) && ms < 1000, "rank 1 still ran %.0f ms after rank 0 was killed", ms);
    int st;
    cr_assert(exited_within(group, 30, &st), "the group hung after rank 0 died");
    group = 0;
    cr_assert(!(WIFEXITED(st) && WEXITSTATUS(st) == 0), "the group exited 0 although rank 0 died");
    static char log[1 << 16];
    read_log(log, sizeof log);
    char want[64];
    snprintf(want, sizeof want, "rank 0 (pid %d on ", (int)r[0]);
    cr_assert(strstr(log, "rank 1: ") && strstr(log, want) && strstr(log, "is gone"),
              "no line of rank 1 naming rank 0:\n%s", log);
    cr_assert_eq(processes_on(pg), 0);
}

/* Where rank k's (pid's) threads sleep now, per /proc/PID/task/TID/syscall (its number, then its
 * arguments: fds, nfds, ...): bit 1 when one sleeps in ppoll() on one fd, a round's wait
 * (pd_ep_wait's sleep watching its connection to rank 0); bit 2 when one sleeps in ppoll() on two
 * fds, the wait between rounds (pd_srv_ep_live_wait: its connection and its signal pipe). */
static int rank_sleeps(pid_t pid)
{
    char path[320], line[256];
    snprintf(path, sizeof path, "/proc/%d/task", pid);
    DIR *d = opendir(path);
    int where = 0;
    for (struct dirent *de; d && (de = readdir(d));) {
        if (atoi(de->d_name) <= 0)
            continue;
        snprintf(path, sizeof path, "/proc/%d/task/%s/syscall", pid, de->d_name);
        FILE *f = fopen(path, "r");
        long nr = -1;
        unsigned long fds = 0, nfds = 0;
        if (f && fgets(line, sizeof line, f) && sscanf(line, "%ld %lx %lx", &nr, &fds, &nfds) == 3 && nr == SYS_ppoll &&
            (nfds == 1 || nfds == 2))
            where |= (int)nfds;
        if (f)
            fclose(f);
    }
    if (d)
        closedir(d);
    return where;
}

/* Whether rank k waits inside a round, seen in 40 samples 1 ms apart: in most a thread sleeps in a
 * round's ppoll(), in none in the wait between rounds. Between rounds, while rank 0 is busy, a
 * rank wakes every 2 ms to test the next round's broadcast, and /proc reads "running" then: 1-2%
 * of reads spread out, up to a third of reads back to back. A single read that did was taken for
 * "inside a round", and the test killed rank 0 while rank 1 was between rounds (1 run in 7 to 12
 * on a 2-core host). */
static int waits_inside_a_round(pid_t pid)
{
    int inside = 0, between = 0;
    for (int i = 0; i < 40; i++) {
        const int w = rank_sleeps(pid);
        inside += w & 1;
        between += w >> 1 & 1;
        usleep(1000);
    }
    return between == 0 && inside >= 20;
}

/* Rank 0 killed while rank 1 is inside a round: rank 0 stopped (SIGSTOP) in the middle of a
 * stream's decode steps leaves rank 1 waiting in the round's MPI exchange (asleep after its spin),
 * then its SIGKILL. Rank 1 watches its connection to rank 0 in those sleeps too and ends at once
 * with the line naming rank 0; before, only mpirun's SIGKILL ended it, 2 s after. */
Test(server_ep_death, a_killed_rank_0_ends_rank_1_inside_a_round_at_once)
{
    int pg = base_port + 4;
    group = start_group(pg);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "curl -s -N --max-time 60 http://127.0.0.1:%d/v1/completions -d '{\"prompt\":\"x\","
             "\"max_tokens\":4000,\"ignore_eos\":true,\"stream\":true}' >/dev/null", pg);
    FILE *stream = popen(cmd, "r");
    int running = 0;
    for (int i = 0; i < 1000 && (running = metric_port(pg, "pdmoe_num_requests_running")) < 1; i++)
        usleep(5000);
    pid_t r[2];
    rank_pids(pg, r);
    /* rank 0 stopped until rank 1 waits inside a round for it, long past its spin: not between
     * rounds (ppoll() on its connection and its signal pipe, which the test above covers) */
    int inside = 0;
    for (int tries = 0; tries < 40 && !inside; tries++) {
        kill(r[0], SIGCONT);
        usleep(50000 + 7000 * tries);   /* decode steps under way */
        kill(r[0], SIGSTOP);
        usleep(300000);
        inside = waits_inside_a_round(r[1]);
    }
    cr_assert(inside, "rank 1 never waited inside a round while rank 0 was stopped");
    const int64_t t0 = pd_now_ns();
    kill(r[0], SIGKILL);
    while (!pid_ended(r[1]) && pd_now_ns() - t0 < 3000000000LL)
        usleep(2000);
    const double ms = (pd_now_ns() - t0) / 1e6;
    fprintf(stderr, "server_ep_death: rank 1 (inside a round) ended %.1f ms after the SIGKILL of rank 0\n", ms);
    pclose(stream);
    cr_assert_eq(running, 1, "the stream did not start");
    cr_assert(pid_ended(r[1]) && ms < 500, "rank 1 still ran %.0f ms after rank 0 was killed mid-round", ms);
    int st;
    cr_assert(exited_within(group, 30, &st), "the group hung after rank 0 died");
    group = 0;
    cr_assert(!(WIFEXITED(st) && WEXITSTATUS(st) == 0), "the group exited 0 although rank 0 died");
    static char log[1 << 16];
    read_log(log, sizeof log);
    char want[64];
    snprintf(want, sizeof want, "rank 1: rank 0 (pid %d on ", (int)r[0]);
    const char *line = strstr(log, want);
    cr_assert(line && strstr(line, "is gone: its connection to this rank closed during a round"),
              "no line of rank 1 naming rank 0 (and the round):\n%s", log);
    cr_assert_eq(processes_on(pg), 0);
}

/* A normal end read late: rank 1 stopped (SIGSTOP) while rank 0 takes SIGTERM, broadcasts the
 * group's end, writes its WAKE and closes its connections; rank 1, continued, reads the WAKE and
 * the close at once. That is no death (the STOP round's broadcast was posted before the close):
 * rank 1 ended with "rank 0 ... is gone" and exit 70, mpirun with 70, and `pdmoe up` named the
 * group as failing its stop. Every rank now exits 0. */
Test(server_ep_death, a_normal_end_read_late_is_no_death)
{
    int pg = base_port + 5;
    group = start_group(pg);
    char text[1024];
    greedy(pg, text, sizeof text);
    pid_t r[2];
    rank_pids(pg, r);
    usleep(200000);   /* the group idles */
    kill(r[1], SIGSTOP);
    kill(r[0], SIGTERM);
    usleep(500000);   /* rank 0 ended the group and closed its connections */
    kill(r[1], SIGCONT);
    int st;
    cr_assert(exited_within(group, 30, &st), "the group did not end");
    group = 0;
    static char log[1 << 16];
    read_log(log, sizeof log);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the group ended with wait status %d after rank 0's SIGTERM:\n%s",
              st, log);
    cr_assert_null(strstr(log, "is gone"), "%s", log);
    cr_assert_eq(processes_on(pg), 0);
}

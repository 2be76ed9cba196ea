/* A decode EP group waiting on a KV pull (pdmoe up --decode-ep 2, real processes): its ranks sleep
 * between the rounds that ask whether the pull ended. Rank 0 runs such a round every millisecond
 * while nothing else steps; it did not tell the ranks it idled in between, so each rank went on
 * with its 10 us - 2 ms backoff between rounds, about 6 wake-ups a round: measured during a pull
 * from a stopped producer, rank 1 slept and woke 5,500 times a second (0.19 s of CPU in 2 s),
 * against 960 now (about one a round; 0.07 s of CPU in 2 s). */
#include <criterion/criterion.h>
#include <dirent.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../tmpmodel.h"
#include "util.h"

static char dir[64];
static pid_t up_pid, stopped;   /* a cluster still running, a producer still stopped, when a test fails */

static void setup(void)
{
    tmp_model("v4-tiny", 19, dir, sizeof dir);
}

static void teardown(void)
{
    if (stopped > 0)
        kill(stopped, SIGCONT);
    if (up_pid > 0) {
        kill(up_pid, SIGINT);
        int st;
        if (!exited_within(up_pid, 60, &st)) {
            kill(-up_pid, SIGKILL);
            kill(up_pid, SIGKILL);
            waitpid(up_pid, NULL, 0);
        }
    }
    up_pid = stopped = 0;
    rm_model(dir);
}

TestSuite(ep_pull, .init = setup, .fini = teardown, .timeout = 240);

/* The sleeps of process pid so far: its threads' voluntary context switches. */
static long sleeps_of(pid_t pid)
{
    char path[320], line[256];
    snprintf(path, sizeof path, "/proc/%d/task", pid);
    DIR *d = opendir(path);
    cr_assert_not_null(d, "%s", path);
    long n = 0;
    for (struct dirent *de; (de = readdir(d));) {
        if (atoi(de->d_name) <= 0)
            continue;
        snprintf(path, sizeof path, "/proc/%d/task/%s/status", pid, de->d_name);
        FILE *f = fopen(path, "r");
        while (f && fgets(line, sizeof line, f))
            if (!strncmp(line, "voluntary_ctxt_switches:", 24))
                n += atol(line + 24);
        if (f)
            fclose(f);
    }
    closedir(d);
    return n;
}

/* The pid of the one process serving on port (pgrep). */
static pid_t pid_on(int port)
{
    char cmd[160];
    snprintf(cmd, sizeof cmd, "pgrep -f -- '-[-]port %d( |$)'", port);
    FILE *p = popen(cmd, "r");
    int x = 0, n = 0, got;
    while (fscanf(p, "%d", &got) == 1)
        x = got, n++;
    pclose(p);
    cr_assert_eq(n, 1, "%d processes serve on port %d", n, port);
    return x;
}

Test(ep_pull, ranks_sleep_while_rank_0_waits_for_a_pull)
{
    const char *bin = pdmoe_bin();
    const int port = test_ports(), prefill = port + 1, decode = port + 2;
    char out[256];
    snprintf(out, sizeof out, "%s/up.out", dir);
    mpi_test_env();
    pid_t up = fork_pdmoe();
    if (up == 0) {
        char sp[16];
        snprintf(sp, sizeof sp, "%d", port);
        freopen(out, "w", stdout);
        execl(bin, bin, "up", "--model", dir, "--port", sp, "--decode-ep", "2", "--threads", "1", (char *)NULL);
        _exit(127);
    }
    up_pid = up;
    cr_assert(up_wait_ready(out), "pdmoe up did not become ready");
    /* the producer's KV of a prompt, then the producer stopped: the decode's pull waits */
    char a[8192];
    cr_assert_eq(curl_port(prefill, "/v1/completions", "{\"prompt\":\"hello there\",\"max_tokens\":1,"
                           "\"kv_transfer_params\":{\"do_remote_decode\":true}}", NULL, a, sizeof a), 200, "%s", a);
    json_t *j = parse(a);
    char *kv = json_dumps(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "kv_transfer_params"),
                          JSON_COMPACT);
    json_decref(j);
    cr_assert_not_null(kv, "%s", a);
    pid_t r[2];
    rank_pids(decode, r);
    stopped = pid_on(prefill);
    kill(stopped, SIGSTOP);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "curl -s --max-time 30 http://127.0.0.1:%d/v1/completions -d '{\"prompt\":\"hello "
             "there\",\"max_tokens\":4,\"kv_transfer_params\":%s}'", decode, kv);
    free(kv);
    FILE *client = popen(cmd, "r");
    usleep(500000);   /* the pull under way, waiting on the stopped producer */
    const long s0 = sleeps_of(r[0]), s1 = sleeps_of(r[1]);
    const double c1 = cpu_seconds(r[1]);
    sleep(2);
    const long n0 = sleeps_of(r[0]) - s0, n1 = sleeps_of(r[1]) - s1;
    const double cpu1 = cpu_seconds(r[1]) - c1;
    fprintf(stderr, "ep_pull: in 2 s of a stalled pull rank 0 slept %ld times, rank 1 %ld times (%.2f s of CPU)\n",
            n0, n1, cpu1);
    kill(stopped, SIGCONT);
    stopped = 0;
    static char ans[1 << 14];
    size_t n = fread(ans, 1, sizeof ans - 1, client);
    ans[n] = 0;
    pclose(client);
    j = parse(ans);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")), 4,
                 "the pull did not end in an answer once the producer went on: %s", ans);
    json_decref(j);
    /* about one sleep a round (a round a millisecond at most), and other threads': 1,900 in 2 s
     * measured; 11,000 before */
    cr_assert_lt(n1, 4000, "rank 1 slept and woke %ld times in 2 s of a pull (%.2f s of CPU)", n1, cpu1);
    int st;
    kill(up, SIGINT);
    cr_assert(exited_within(up, 60, &st), "pdmoe up did not stop");
    up_pid = 0;
    child_exited_cleanly(up, st, "pdmoe up");
}

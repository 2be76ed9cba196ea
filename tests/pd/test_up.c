/* pdmoe up as a user runs it: the whole local cluster (prefill, decode, proxy: real processes;
 * with --prefill-ep/--decode-ep 2 each instance an EP group under mpirun) gives the same greedy
 * tokens as one colocated process, every KV pool (every rank's) is full again afterwards, and
 * SIGINT stops every process it started. */
#define _GNU_SOURCE   /* unshare */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <pthread.h>
#include <jansson.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <glob.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/timing.h"
#include "engine/genmodel.h"
#include "../tmpmodel.h"
#include "util.h"

static char dir[64];
static pid_t up_pid;   /* a cluster still running when a test fails */

static void setup(void)
{
    tmp_model("v4-tiny", 13, dir, sizeof dir);
}

static void teardown(void)
{
    if (up_pid > 0) {
        kill(up_pid, SIGINT);
        waitpid(up_pid, NULL, 0);
        up_pid = 0;
    }
    rm_model(dir);
}

TestSuite(up, .init = setup, .fini = teardown, .timeout = 240);

/* Starts pdmoe up on `port` (EP size `ep` on both sides, or the layout of `plan` when not NULL);
 * its pid once it says it is ready. */
static pid_t start_up_plan(const char *bin, int port, int ep, const char *plan)
{
    char out[256];
    snprintf(out, sizeof out, "%s/up.out", dir);
    if (ep > 1 || plan)
        mpi_test_env();
    pid_t up = fork_pdmoe();
    if (up == 0) {
        char sp[16], se[16];
        snprintf(sp, sizeof sp, "%d", port);
        snprintf(se, sizeof se, "%d", ep);
        freopen(out, "w", stdout);
        if (plan)
            execl(bin, bin, "up", "--model", dir, "--port", sp, "--plan", plan, (char *)NULL);
        else
            execl(bin, bin, "up", "--model", dir, "--port", sp, "--prefill-ep", se, "--decode-ep", se,
                  "--watchdog-timeout", "120", (char *)NULL);   /* (for EP groups only: serve refuses it otherwise) */
        _exit(127);
    }
    int ready = up_wait_ready(out);
    up_pid = up;
    cr_assert(ready, "pdmoe up did not become ready");
    return up;
}

static pid_t start_up(const char *bin, int port, int ep)
{
    return start_up_plan(bin, port, ep, NULL);
}

/* The command lines of the processes serving on port (pgrep), in out. */
static void command_of(int port, char *out, size_t cap)
{
    char cmd[160];
    snprintf(cmd, sizeof cmd, "pgrep -af -- '-[-]port %d( |$)'", port);
    FILE *p = popen(cmd, "r");
    size_t n = p ? fread(out, 1, cap - 1, p) : 0;
    out[n] = 0;
    if (p)
        pclose(p);
}

/* The CPUs process pid may run on (its Cpus_allowed_list), into out. */
static void cpus_of(int pid, char *out, size_t cap)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", pid);
    FILE *f = fopen(path, "r");
    out[0] = 0;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "Cpus_allowed_list:", 18))
            snprintf(out, cap, "%s", line + 18 + strspn(line + 18, " \t"));
    if (f)
        fclose(f);
}

/* Every rank of the EP group serving HTTP on `port` may run on every CPU this test may: Open MPI
 * bound each rank of a job of one or two to one core, where its --threads then all ran. */
static void ranks_not_bound(int port)
{
    char cmd[160], mine[256], theirs[256];
    snprintf(cmd, sizeof cmd, "pgrep -f -- '[p]dmoe serve .*--port %d( |$)'", port);
    FILE *p = popen(cmd, "r");
    cpus_of(getpid(), mine, sizeof mine);
    int pid, n = 0;
    while (p && fscanf(p, "%d", &pid) == 1) {
        cpus_of(pid, theirs, sizeof theirs);
        if (!theirs[0])
            continue;   /* (gone meanwhile, or mpirun's own line) */
        cr_assert_str_eq(theirs, mine, "pid %d of the group on port %d may run on CPUs %s only, this test on %s", pid,
                         port, theirs, mine);
        n++;
    }
    if (p)
        pclose(p);
    cr_assert_geq(n, 2, "%d processes of the EP group on port %d", n, port);
}

/* Ctrl-C: everything stops, nothing is left on the cluster's ports. */
static void stop_up(pid_t up, int port)
{
    kill(up, SIGINT);
    int status;
    cr_assert_eq(waitpid(up, &status, 0), up);
    up_pid = 0;
    char what[64];
    snprintf(what, sizeof what, "pdmoe up (port %d)", port);
    child_exited_cleanly(up, status, what);
    for (int p = port; p <= port + 2; p++) {
        int left = processes_on(p);
        cr_assert_eq(left, 0, "%d processes left behind on port %d", left, p);
    }
}

/* The reader of up's log goes away (a `| head` that has its lines, a log collector restarting):
 * the next line up writes (the decode instance's death, here) killed up with SIGPIPE and every
 * instance with it. Now up goes on and restarts the instance. */
Test(up, a_closed_log_pipe_does_not_take_the_cluster_down)
{
    const char *bin = pdmoe_bin();
    const int port = test_ports();
    char out[256];
    snprintf(out, sizeof out, "%s/up.out", dir);
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    pid_t up = fork_pdmoe();
    if (up == 0) {
        char sp[16];
        snprintf(sp, sizeof sp, "%d", port);
        freopen(out, "w", stdout);
        dup2(fds[1], 2);
        close(fds[0]);
        close(fds[1]);
        execl(bin, bin, "up", "--model", dir, "--port", sp, (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    up_pid = up;
    cr_assert(up_wait_ready(out), "pdmoe up did not become ready");
    close(fds[0]);   /* nobody reads up's log any more */
    char cmd[160];
    snprintf(cmd, sizeof cmd, "pkill -KILL -f -- '-[-]port %d( |$)'", port + 2);
    cr_assert_eq(system(cmd), 0);
    /* up writes that the decode instance died and restarts it; it must still be here after */
    int back = 0;
    for (int i = 0; i < 100 && !back; i++) {
        usleep(100000);
        int st;
        cr_assert_neq(waitpid(up, &st, WNOHANG), up, "pdmoe up died (status %d) when its log pipe was closed", st);
        char body[256];
        back = i > 10 && curl_port(port + 2, "/health", NULL, NULL, body, sizeof body) == 200;
    }
    cr_assert(back, "the decode instance did not come back");
    stop_up(up, port);
}

/* An EP group's mpirun SIGKILLed: its ranks outlive it by a moment, and the first restart met
 * their KV ports still bound ("Address already in use"), failed and backed off once more. up now
 * waits for the old processes' ports before it starts the group again: one restart. */
Test(up, a_killed_mpirun_is_started_again_once)
{
    const char *bin = pdmoe_bin();
    const int port = test_ports();
    pid_t up = start_up(bin, port, 2);
    char cmd[200];
    /* the ranks' shared memory, which a SIGKILLed mpirun leaves: removed once the group is back */
    char segs[8][128];
    int ns = 0;
    snprintf(cmd, sizeof cmd, "pgrep -f -- ' serve .*-[-]port %d( |$)'", port + 1);
    FILE *pg = popen(cmd, "r");
    for (int pid; pg && fscanf(pg, "%d", &pid) == 1;)
        shm_segments_of(pid, segs, &ns, 8);
    if (pg)
        pclose(pg);
    snprintf(cmd, sizeof cmd, "pkill -KILL -f -- '^mpirun .*-[-]port %d( |$)'", port + 1);
    cr_assert_eq(system(cmd), 0, "no mpirun for the prefill group on port %d", port + 1);
    char key[96], body[256];
    snprintf(key, sizeof key, "pdmoe_restarts_total{role=\"prefill\",instance=\"0\"}");
    int back = 0;
    for (int i = 0; i < 300 && !back; i++) {
        usleep(100000);
        back = i > 10 && curl_port(port + 1, "/health", NULL, NULL, body, sizeof body) == 200 && metric_key(port, key) >= 1;
    }
    cr_assert(back, "the prefill group did not come back");
    sleep(1);
    cr_assert_eq(metric_key(port, key), 1, "the prefill group took more than one restart");
    /* up removed them before the restart (they stayed, 4 MiB a rank at every such death) */
    int left = 0;
    for (int k = 0; k < ns; k++)
        left += access(segs[k], F_OK) == 0;
    stop_up(up, port);
    for (int k = 0; k < ns; k++)
        unlink(segs[k]);
    cr_assert_gt(ns, 0, "the prefill group's ranks mapped no shared memory");
    cr_assert_eq(left, 0, "%d of the dead group's %d shared-memory segments left in /dev/shm", left, ns);
}

Test(up, cluster_matches_colocated_and_stops_cleanly)
{
    const char *bin = pdmoe_bin();
    const int port = test_ports();
    pid_t up = start_up(bin, port, 1);
    char a[8192];
    const char *name = strrchr(dir, '/') + 1;
    char body[512];
    snprintf(body, sizeof body, "{\"model\":\"%s\",\"prompt\":\"The quick brown fox\",\"max_tokens\":12,\"temperature\":0,"
             "\"return_token_ids\":true}", name);
    cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, a, sizeof a), 200, "%s", a);
    json_t *j = parse(a);
    json_t *ids = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids");
    char want[1024] = "[0] ids", *w = want + strlen(want);
    for (size_t i = 0; i < json_array_size(ids); i++)
        w += sprintf(w, " %lld", (long long)json_integer_value(json_array_get(ids, i)));
    json_decref(j);
    /* one colocated process, the same request */
    char cmd[512], gen[8192];
    snprintf(cmd, sizeof cmd, "%s generate --model %s --prompt 'The quick brown fox' --max-tokens 12 --print-ids "
             "--threads 1", bin, dir);
    FILE *p = popen(cmd, "r");
    size_t n = fread(gen, 1, sizeof gen - 1, p);
    gen[n] = 0;
    pclose(p);
    cr_assert(strstr(gen, want), "through pdmoe up: \"%s\"; colocated:\n%s", want, gen);
    stop_up(up, port);
}

Test(up, ep_groups_on_both_sides_match_colocated_and_free_every_rank)
{
    const char *bin = pdmoe_bin();
    const int port = test_ports();
    pid_t up = start_up(bin, port, 2);
    const char *name = strrchr(dir, '/') + 1;
    const char *prompts[] = {"The quick brown fox", "Once upon a time, in a small town by the sea", "x",
                             "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12"};
    for (int i = 0; i < 4; i++) {
        char a[8192], body[512];
        snprintf(body, sizeof body, "{\"model\":\"%s\",\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0,"
                 "\"return_token_ids\":true}", name, prompts[i], 6 + 3 * i);
        cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, a, sizeof a), 200, "%s", a);
        json_t *j = parse(a);
        json_t *ids = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids");
        cr_assert_gt((int)json_array_size(ids), 0, "%s", a);
        char want[1024] = "ids", *w = want + strlen(want);
        for (size_t k = 0; k < json_array_size(ids); k++)
            w += sprintf(w, " %lld", (long long)json_integer_value(json_array_get(ids, k)));
        json_decref(j);
        /* one colocated process, the same request */
        char cmd[512], gen[8192];
        snprintf(cmd, sizeof cmd, "%s generate --model %s --prompt '%s' --max-tokens %d --print-ids --threads 1", bin,
                 dir, prompts[i], 6 + 3 * i);
        FILE *p = popen(cmd, "r");
        size_t n = fread(gen, 1, sizeof gen - 1, p);
        gen[n] = 0;
        pclose(p);
        char *x = strstr(gen, "[0] ids");
        cr_assert(x && !strncmp(x + 4, want, strlen(want)) && (x[4 + strlen(want)] == '\n'),
                  "prompt %d through pdmoe up (EP 2 + EP 2): \"%s\"; colocated:\n%s", i, want, gen);
    }
    /* every prompt's KV went from a prefill rank to a decode rank (no recompute), and both
     * groups used both ranks */
    const int P = port + 1, D = port + 2;
    char cmdline[4096];
    command_of(D, cmdline, sizeof cmdline);   /* up's --watchdog-timeout reached the groups */
    cr_assert(strstr(cmdline, "--watchdog-timeout 120"), "%s", cmdline);
    ranks_not_bound(P);
    ranks_not_bound(D);
    cr_assert_eq(metric_port(D, "pdmoe_kv_transfers_total"), 4);
    cr_assert_eq(metric_port(D, "pdmoe_kv_recomputes_total"), 0);
    for (int k = 0; k < 2; k++) {
        cr_assert_gt(labelled(P, "pdmoe_rank_requests_total", k), 0, "prefill rank %d", k);
        cr_assert_gt(labelled(D, "pdmoe_rank_requests_total", k), 0, "decode rank %d", k);
    }
    /* the producer's leases end on DONE; then every pool of every rank is full */
    for (int i = 0; i < 100 && metric_port(P, "pdmoe_kv_leases") > 0; i++)
        usleep(20000);
    cr_assert_eq(metric_port(P, "pdmoe_kv_leases"), 0);
    for (int i = 0; i < 50 && metric_port(P, "pdmoe_kv_blocks_free") < metric_port(P, "pdmoe_kv_blocks_capacity"); i++)
        usleep(20000);
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(labelled(P, "pdmoe_rank_kv_blocks_free", k), labelled(P, "pdmoe_rank_kv_blocks_capacity", k),
                     "prefill rank %d", k);
        cr_assert_eq(labelled(D, "pdmoe_rank_kv_blocks_free", k), labelled(D, "pdmoe_rank_kv_blocks_capacity", k),
                     "decode rank %d", k);
    }
    stop_up(up, port);
}

Test(up, ep_sizes_this_machine_cannot_run_are_refused)
{
    const char *bin = pdmoe_bin();
    char cmd[512], err[4096];
    snprintf(cmd, sizeof cmd, "%s up --model %s --decode-ep 9 2>&1 >/dev/null", bin, dir);
    FILE *p = popen(cmd, "r");
    size_t n = fread(err, 1, sizeof err - 1, p);
    err[n] = 0;
    int st = pclose(p);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 2, "status %d: %s", st, err);
    cr_assert(strstr(err, "--decode-ep 9"), "%s", err);
}

/* A second cluster on the ports of one running (here a listener on prefill instance 0's HTTP
 * port and one on its KV port) is refused at once, each port named: it used to take the other's
 * /health answers for its own, say it was ready and restart its children for ever. */
Test(up, ports_in_use_are_refused_by_name_before_anything_starts)
{
    const char *bin = pdmoe_bin();
    const int port = test_ports();
    int l[2];
    for (int i = 0; i < 2; i++) {
        l[i] = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)(port + (i ? 100 : 1)))};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        cr_assert_eq(bind(l[i], (struct sockaddr *)&a, sizeof a), 0, "port %d busy", port + (i ? 100 : 1));
        cr_assert_eq(listen(l[i], 4), 0);
    }
    char cmd[512], err[4096];
    snprintf(cmd, sizeof cmd, "timeout 60 %s up --model %s --port %d 2>&1 >/dev/null", bin, dir, port);
    double t0 = pd_now_s();
    FILE *p = popen(cmd, "r");
    size_t n = fread(err, 1, sizeof err - 1, p);
    err[n] = 0;
    int st = pclose(p);
    close(l[0]);
    close(l[1]);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 2, "status %d after %.1f s: %s", st, pd_now_s() - t0, err);
    char want[128];
    snprintf(want, sizeof want, "port %d (prefill instance 0's HTTP port, --port + 1) is in use", port + 1);
    cr_assert(strstr(err, want), "%s", err);
    snprintf(want, sizeof want, "port %d (prefill instance 0's KV port for rank 0, --port + 100) is in use", port + 100);
    cr_assert(strstr(err, want), "%s", err);
    cr_assert_eq(processes_on(port + 2), 0, "a decode instance was started");
}

static void *close_after(void *arg)
{
    usleep(1500000);
    close(*(int *)arg);
    return NULL;
}

/* The ports of a cluster that has just stopped (its processes exiting, up SIGKILLed and its mpiruns
 * orphaned) free within a moment: up waits up to 5 s for them before refusing (an up started at
 * once failed on every port they still held). */
Test(up, ports_freed_within_seconds_are_waited_for)
{
    const char *bin = pdmoe_bin();
    const int port = test_ports();
    int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)(port + 1))};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(bind(l, (struct sockaddr *)&a, sizeof a), 0, "port %d busy", port + 1);
    cr_assert_eq(listen(l, 4), 0);
    pthread_t t;
    pthread_create(&t, NULL, close_after, &l);
    start_up(bin, port, 1);   /* (asserts it becomes ready) */
    pthread_join(t, NULL);
    kill(up_pid, SIGINT);
    int st;
    pid_t up = up_pid;
    cr_assert_eq(waitpid(up_pid, &st, 0), up_pid);
    up_pid = 0;
    child_exited_cleanly(up, st, "pdmoe up, started while a port of its was still held");
}

/* Files /dev/shm holds whose names start with `prefix`. */
static int shm_files(const char *prefix)
{
    char cmd[160];
    snprintf(cmd, sizeof cmd, "ls /dev/shm 2>/dev/null | grep -c '^%s'", prefix);
    return count_of(cmd);
}

/* A child stopped (SIGSTOP, a debugger) when up is told to stop: it is continued so that it sees
 * the SIGTERM. It used to be SIGKILLed after 10 s, and a decode group's mpirun killed so left its
 * ranks' shared-memory segments in /dev/shm. */
Test(up, a_stopped_child_is_continued_to_stop_and_leaves_no_shared_memory)
{
    const char *bin = pdmoe_bin();
    const int port = test_ports();
    int shm0 = shm_files("vader_segment");
    pid_t up = start_up(bin, port, 2);
    char cmd[160];
    snprintf(cmd, sizeof cmd, "pgrep -f -- '^mpirun .*-[-]port %d( |$)'", port + 2);   /* the decode group's */
    FILE *p = popen(cmd, "r");
    int mp = 0;
    cr_assert(p && fscanf(p, "%d", &mp) == 1 && mp > 0, "no mpirun for port %d", port + 2);
    pclose(p);
    cr_assert_eq(kill(mp, SIGSTOP), 0);
    double t0 = pd_now_s();
    kill(up, SIGTERM);
    int status;
    cr_assert_eq(waitpid(up, &status, 0), up);
    up_pid = 0;
    double took = pd_now_s() - t0;
    cr_assert_lt(took, 9.0, "up took %.1f s to stop (its 10 s escalation to SIGKILL)", took);
    child_exited_cleanly(up, status, "pdmoe up, its decode group's mpirun stopped (SIGSTOP)");
    for (int q = port; q <= port + 2; q++)
        cr_assert_eq(processes_on(q), 0, "processes left behind on port %d", q);
    int shm = shm_files("vader_segment");
    for (int i = 0; i < 50 && shm > shm0; i++) {
        usleep(100000);
        shm = shm_files("vader_segment");
    }
    cr_assert_leq(shm, shm0, "%d shared-memory segments left in /dev/shm (%d before)", shm, shm0);
}

/* The /tmp/pdmoe-up-* directory whose pid file names `pid`, in out (0), or -1. */
static int up_dir_of(pid_t pid, char *out, size_t cap)
{
    char cmd[200];
    snprintf(cmd, sizeof cmd, "grep -lx %d /tmp/pdmoe-up-*/pid 2>/dev/null | head -1", (int)pid);
    FILE *p = popen(cmd, "r");
    int got = p && fgets(out, (int)cap, p) != NULL;
    if (p)
        pclose(p);
    if (!got)
        return -1;
    *strrchr(out, '/') = 0;   /* (the directory, not its pid file) */
    return 0;
}

/* pdmoe up SIGKILLed (no chance to stop anything): its instances and proxy stop too (they asked
 * Linux for a SIGTERM when their parent dies), and the directory it could not remove is removed
 * by the next pdmoe up, which leaves a live run's alone. */
Test(up, a_killed_up_leaves_no_process_and_its_directory_is_swept_next_time)
{
    const char *bin = pdmoe_bin();
    const int port = test_ports();
    pid_t up = start_up(bin, port, 1);
    char stale[256], live[] = "/tmp/pdmoe-up-testXXXXXX", pidfile[300];
    cr_assert_eq(up_dir_of(up, stale, sizeof stale), 0, "pdmoe up %d wrote no /tmp/pdmoe-up-*/pid", (int)up);
    cr_assert_not_null(mkdtemp(live));
    snprintf(pidfile, sizeof pidfile, "%s/pid", live);
    FILE *f = fopen(pidfile, "w");
    fprintf(f, "%d\n", (int)getpid());   /* a run that is alive: this test */
    fclose(f);
    cr_assert_eq(kill(up, SIGKILL), 0);
    cr_assert_eq(waitpid(up, NULL, 0), up);
    up_pid = 0;
    int left = 1;
    for (int i = 0; i < 100 && left; i++) {
        left = 0;
        for (int q = port; q <= port + 2; q++)
            left += processes_on(q);
        if (left)
            usleep(100000);
    }
    cr_assert_eq(left, 0, "%d processes outlived the killed pdmoe up by 10 s", left);
    struct stat st;   /* (its directory is left: this up could not remove it; a cluster starting
                       * in another test may sweep it first) */
    char out[256];
    snprintf(out, sizeof out, "%s/up.out", dir);
    unlink(out);   /* (its ready line is the first run's) */
    up = start_up(bin, port, 1);
    cr_assert_neq(stat(stale, &st), 0, "%s is still there after the next pdmoe up", stale);
    cr_assert_eq(stat(live, &st), 0, "a live run's directory was swept");
    stop_up(up, port);
    unlink(pidfile);
    rmdir(live);
}

/* up keeps its directory under $TMPDIR, and on a full filesystem (here a full 64 KiB tmpfs, in a
 * mount namespace of up's own) says once that it cannot write its restart counts, leaves no
 * temporary file, and serves. It used /tmp whatever TMPDIR said, and the failed write was silent
 * and left restarts.prom.tmp behind, which kept its directory at exit. */
Test(up, a_full_tmpdir_is_said_and_leaves_no_file_behind)
{
    if (geteuid() != 0)
        cr_skip_test("needs root (a mount namespace of its own)");
    const char *bin = pdmoe_bin();
    const int port = test_ports();
    char d[] = "/tmp/pdmoe-test-tmpdirXXXXXX", out[256], err[256];
    cr_assert_not_null(mkdtemp(d));
    snprintf(out, sizeof out, "%s/up.out", dir);
    snprintf(err, sizeof err, "%s/up.err", dir);
    pid_t up = fork_pdmoe();
    if (up == 0) {
        if (unshare(CLONE_NEWNS) || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) ||
            mount("tmpfs", d, "tmpfs", 0, "size=64k"))
            _exit(126);
        char fill[300], block[4096] = {0};
        snprintf(fill, sizeof fill, "%s/fill", d);
        int fd = open(fill, O_CREAT | O_WRONLY, 0600);
        while (fd >= 0 && write(fd, block, sizeof block) > 0)
            ;
        close(fd);
        setenv("TMPDIR", d, 1);
        char sp[16];
        snprintf(sp, sizeof sp, "%d", port);
        freopen(out, "w", stdout);
        freopen(err, "w", stderr);
        execl(bin, bin, "up", "--model", dir, "--port", sp, (char *)NULL);
        _exit(127);
    }
    int ws;
    for (int i = 0; i < 20; i++) {   /* a mount namespace of its own: not where / is no mount point */
        if (waitpid(up, &ws, WNOHANG) == up && WIFEXITED(ws) && WEXITSTATUS(ws) == 126) {
            rmdir(d);
            cr_skip_test("cannot make a private mount namespace here (a chroot?)");
        }
        usleep(10000);
    }
    up_pid = up;
    cr_assert(up_wait_ready(out), "pdmoe up did not become ready");
    char pat[400], log[8192] = "";
    snprintf(pat, sizeof pat, "/proc/%d/root%s/pdmoe-up-*", (int)up, d);
    glob_t g;
    cr_assert_eq(glob(pat, 0, NULL, &g), 0, "no pdmoe-up-* directory under TMPDIR %s", d);
    char tmpf[600];
    snprintf(tmpf, sizeof tmpf, "%s/restarts.prom.tmp", g.gl_pathv[0]);
    struct stat st;
    cr_assert_neq(stat(tmpf, &st), 0, "%s was left behind", tmpf);
    globfree(&g);
    FILE *f = fopen(err, "r");
    size_t n = f ? fread(log, 1, sizeof log - 1, f) : 0;
    log[n] = 0;
    if (f)
        fclose(f);
    char want[300];
    snprintf(want, sizeof want, "pdmoe up: cannot write the restart counts to %s/pdmoe-up-", d);
    cr_assert(strstr(log, want) && strstr(log, "No space left on device"), "%s", log);
    const char *first = strstr(log, "cannot write the restart counts");
    cr_assert_null(strstr(first + 1, "cannot write the restart counts"), "said more than once: %s", log);
    stop_up(up, port);
    rmdir(d);
}

/* Leaves a connection in TIME_WAIT on the server's side of 127.0.0.1:port, as a prefill instance
 * that closed its KV connections first leaves its kv_port to the next cluster. */
static void time_wait_on(int port)
{
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(bind(l, (struct sockaddr *)&a, sizeof a), 0, "port %d busy", port);
    cr_assert_eq(listen(l, 1), 0);
    int c = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_eq(connect(c, (struct sockaddr *)&a, sizeof a), 0);
    int s = accept(l, NULL, NULL);
    cr_assert_geq(s, 0);
    close(s);   /* the server side closes first: its end waits in TIME_WAIT */
    usleep(50000);
    close(c);
    close(l);
}

Test(up, a_new_cluster_binds_the_kv_port_the_last_one_left_in_time_wait)
{
    const char *bin = pdmoe_bin();
    const int port = test_ports();
    time_wait_on(port + 100);   /* prefill instance 0's kv_port */
    pid_t up = start_up(bin, port, 1);
    char a[8192];
    const char *name = strrchr(dir, '/') + 1;
    char body[256];
    snprintf(body, sizeof body, "{\"model\":\"%s\",\"prompt\":\"hi\",\"max_tokens\":3}", name);
    cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, a, sizeof a), 200, "%s", a);
    stop_up(up, port);
}

/* A card of `card_bytes` with no runtime overhead: plans whose KV pools are what the card leaves. */
static void write_hw(const char *path, double card_bytes)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f, "{\"name\":\"test\",\"cluster_nodes\":1,\"cards_per_node\":4,"
               "\"card\":{\"name\":\"t\",\"memory_bytes\":%.0f,\"memory_bandwidth_Bps\":1e10,\"bf16_flops\":1e11,"
               "\"int8_ops\":4e11},\"links\":{\"intra_node\":{\"name\":\"i\",\"bandwidth_Bps\":1e10,\"latency_s\":0},"
               "\"inter_node_rdma\":{\"name\":\"r\",\"bandwidth_Bps\":1e10,\"latency_s\":0},"
               "\"inter_node_tcp\":{\"name\":\"t\",\"bandwidth_Bps\":1e9,\"latency_s\":0}},"
               "\"runtime_overhead_bytes\":{\"prefill\":0,\"decode\":0},"
               "\"efficiency\":{\"gemm\":1,\"memory\":1,\"attention\":1,\"a2a_intra\":1,\"a2a_inter\":1,"
               "\"a2a_latency_s\":0,\"imbalance_prefill\":1,\"imbalance_decode\":1,\"imbalance_eplb_prefill\":1,"
               "\"imbalance_eplb_decode\":1,\"overlap_prefill\":0,\"overlap_decode\":0,\"step_prefill_s\":0,"
               "\"step_decode_s\":0,\"token_layer_prefill_s\":0,\"token_layer_decode_s\":0,\"mtp_acceptance\":0,\"request_s\":0},"
               "\"sources\":{\"efficiency\":{\"gemm\":\"t\",\"memory\":\"t\",\"attention\":\"t\",\"a2a_intra\":\"t\","
               "\"a2a_inter\":\"t\",\"a2a_latency_s\":\"t\",\"imbalance_prefill\":\"t\",\"imbalance_decode\":\"t\","
               "\"imbalance_eplb_prefill\":\"t\",\"imbalance_eplb_decode\":\"t\",\"overlap_prefill\":\"t\","
               "\"overlap_decode\":\"t\",\"step_prefill_s\":\"t\",\"step_decode_s\":\"t\",\"token_layer_prefill_s\":\"t\","
               "\"token_layer_decode_s\":\"t\",\"mtp_acceptance\":\"t\",\"request_s\":\"t\"}}}", card_bytes);
    fclose(f);
}

/* `pdmoe up --model dir --plan plan` refuses the plan before starting anything (exit 2), its
 * stderr holding `needle` (and the plan's path when named_plan). */
static void up_refuses_plan(const char *bin, const char *plan, const char *needle, int named_plan)
{
    char cmd[1024], err[2048];
    snprintf(cmd, sizeof cmd, "%s up --model %s --plan %s 2>&1 >/dev/null", bin, dir, plan);
    FILE *p = popen(cmd, "r");
    size_t n = fread(err, 1, sizeof err - 1, p);
    err[n] = 0;
    int st = pclose(p);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 2, "status %d: %s", st, err);
    cr_assert(strstr(err, needle) && (!named_plan || strstr(err, plan)), "%s", err);
}

/* pdmoe up --plan: the instances get the plan's layout, their KV pools the plan's budget (each
 * rank's pool is the plan's kv_pool_bytes, to a block), its max-num-seqs and the KV cache dtype
 * the pools were sized for (fp8 here); a plan whose pools do
 * not fit this machine's memory is refused, naming the plan. */
Test(up, plan_sizes_the_instances_and_their_kv_pools)
{
    const char *bin = pdmoe_bin();
    char hw[128], plan[128], cmd[1024];
    snprintf(hw, sizeof hw, "%s/hw.json", dir);
    snprintf(plan, sizeof plan, "%s/plan.json", dir);
    write_hw(hw, 4e8);
    snprintf(cmd, sizeof cmd, "%s plan --model %s --hardware %s --nodes 1 --prefill dp=1,tp=1,instances=1 "
             "--decode dp=2,tp=1,instances=1 --mtp off --kv-cache-dtype fp8 --max-num-seqs 3 --max-model-len 256 "
             "--max-num-batched-tokens 64 --json > %s", bin, dir, hw, plan);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    json_error_t je;
    json_t *doc = json_load_file(plan, 0, &je);
    cr_assert(doc, "%s", je.text);
    int64_t pool[2];
    for (int r = 0; r < 2; r++)
        pool[r] = json_integer_value(json_object_get(json_object_get(json_array_get(json_object_get(doc, "roles"),
                                                                                      (size_t)r), "budget"),
                                                     "kv_pool_bytes"));
    json_decref(doc);
    cr_assert(pool[0] > 100000000 && pool[1] > 100000000, "pools %lld %lld", (long long)pool[0], (long long)pool[1]);
    const int port = test_ports();
    pid_t up = start_up_plan(bin, port, 1, plan);
    for (int r = 0; r < 2; r++) {
        int64_t got = metric_key(port + 1 + r, "pdmoe_kv_pool_bytes");
        cr_assert(got <= pool[r] && got > pool[r] - (1 << 20), "%s pool %lld bytes, the plan's %lld",
                  r ? "decode" : "prefill", (long long)got, (long long)pool[r]);
    }
    for (int r = 0; r < 2; r++)   /* the dtype the plan sized the pools for */
        cr_assert_gt(metric_key(port + 1 + r, "pdmoe_kv_entry_bytes{dtype=\"fp8\"}"), 0);
    cr_assert_eq(metric_key(port + 1, "pdmoe_kv_slots_free"), 3);        /* max-num-seqs of the prefill rank */
    cr_assert_eq(metric_key(port + 2, "pdmoe_kv_slots_free"), 2 * 3);    /* both ranks of the decode group */
    char a[4096], body[256];
    snprintf(body, sizeof body, "{\"model\":\"%s\",\"prompt\":\"The sea\",\"max_tokens\":4,\"temperature\":0}",
             strrchr(dir, '/') + 1);
    cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, a, sizeof a), 200, "%s", a);
    stop_up(up, port);
    /* a plan for cards far larger than this machine */
    write_hw(hw, 2e12);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    up_refuses_plan(bin, plan, "this machine has", 1);
}

/* A role whose KV pool holds fewer sequences of max-model-len than --max-num-seqs: its servers get
 * the sequences that fit (the plan's roles[].launched_max_num_seqs, what --emit writes for every
 * target), not the option, which serve refused ("cannot hold 8 sequences of ... fixed bytes"), up
 * restarting it three times and giving up; and a plan whose own verdict is that a role does not
 * fit is refused by name before anything starts. */
Test(up, a_pool_smaller_than_max_num_seqs_launches_what_it_holds)
{
    const char *bin = pdmoe_bin();
    char hw[128], plan[128], cmd[1024];
    snprintf(hw, sizeof hw, "%s/hw.json", dir);
    snprintf(plan, sizeof plan, "%s/plan.json", dir);
    write_hw(hw, 1.6e6);   /* v4-tiny's prefill pool: 3 sequences of 256 tokens */
    snprintf(cmd, sizeof cmd, "%s plan --model %s --hardware %s --nodes 1 --prefill dp=1,tp=1,instances=1 "
             "--decode dp=1,tp=1,instances=1 --mtp off --kv-cache-dtype fp8 --max-num-seqs 8 --max-model-len 256 "
             "--max-num-batched-tokens 64 --json > %s", bin, dir, hw, plan);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    json_error_t je;
    json_t *doc = json_load_file(plan, 0, &je);
    cr_assert(doc, "%s", je.text);
    json_t *pre = json_array_get(json_object_get(doc, "roles"), 0);
    int64_t fit = json_integer_value(json_object_get(json_object_get(pre, "budget"), "seqs_at_max_model_len"));
    int64_t launched = json_integer_value(json_object_get(pre, "launched_max_num_seqs"));
    json_decref(doc);
    cr_assert(fit >= 1 && fit < 8 && launched == fit, "prefill: %lld fit, %lld launched", (long long)fit,
              (long long)launched);
    const int port = test_ports();
    pid_t up = start_up_plan(bin, port, 1, plan);
    cr_assert_eq(metric_key(port + 1, "pdmoe_kv_slots_free"), fit);
    cr_assert_eq(metric_key(port + 2, "pdmoe_kv_slots_free"), 8);
    char a[4096], body[256];
    snprintf(body, sizeof body, "{\"model\":\"%s\",\"prompt\":\"The sea\",\"max_tokens\":4,\"temperature\":0}",
             strrchr(dir, '/') + 1);
    cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, a, sizeof a), 200, "%s", a);
    stop_up(up, port);
    /* cards so small that not one sequence fits the prefill pool: the plan says so, up refuses it */
    write_hw(hw, 1.4e6);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    up_refuses_plan(bin, plan, "field \"roles[0].budget.fits\": false", 0);
    /* cards that are this machine's memory split four ways, at a utilization of 1: the plan fits them,
     * up keeps a tenth of the machine for the rest, and says so (it sent the user to calibrate, which
     * is what such a plan came from) */
    write_hw(hw, (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE) / 4);
    snprintf(cmd, sizeof cmd, "%s plan --model %s --hardware %s --nodes 1 --prefill dp=2,tp=1,instances=1 "
             "--decode dp=2,tp=1,instances=1 --mtp off --kv-cache-dtype fp8 --max-num-seqs 8 --max-model-len 256 "
             "--max-num-batched-tokens 64 --gpu-memory-utilization 1 --json > %s", bin, dir, hw, plan);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    up_refuses_plan(bin, plan, "the plan's --gpu-memory-utilization 1 leaves none: plan with 0.9 or less", 0);
}

/* pdmoe up --plan of an aggregated plan (pdmoe plan --aggregated): colocated servers (no KV role)
 * behind a proxy without prefill instances, each with the plan's pool; a plan made for another
 * model, one with a key twice and a FIFO in place of the file are refused by name (a FIFO once
 * hung up). */
Test(up, an_aggregated_plan_starts_colocated_instances_and_bad_plans_are_named)
{
    const char *bin = pdmoe_bin();
    char hw[128], plan[128], cmd[1024];
    snprintf(hw, sizeof hw, "%s/hw.json", dir);
    snprintf(plan, sizeof plan, "%s/plan.json", dir);
    write_hw(hw, 4e8);
    snprintf(cmd, sizeof cmd, "%s plan --model %s --hardware %s --nodes 1 --aggregated dp=1,tp=1,instances=2 "
             "--mtp off --max-num-seqs 3 --max-model-len 256 --max-num-batched-tokens 64 --json > %s", bin, dir, hw,
             plan);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    json_error_t je;
    json_t *doc = json_load_file(plan, 0, &je);
    cr_assert(doc && json_is_true(json_object_get(doc, "aggregated")), "%s", je.text);
    int64_t pool = json_integer_value(json_object_get(
        json_object_get(json_array_get(json_object_get(doc, "roles"), 1), "budget"), "kv_pool_bytes"));
    json_decref(doc);
    const int port = test_ports();
    pid_t up = start_up_plan(bin, port, 1, plan);
    char a[8192];
    cr_assert_eq(curl_port(port, "/readiness", NULL, NULL, a, sizeof a), 200, "%s", a);
    json_t *r = parse(a);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(r, "prefill"), "instances")), 0, "%s", a);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(r, "decode"), "up")), 2, "%s", a);
    json_decref(r);
    for (int p = port + 1; p <= port + 2; p++) {
        int64_t got = metric_key(p, "pdmoe_kv_pool_bytes");
        cr_assert(got <= pool && got > pool - (1 << 20), "port %d: pool %lld, the plan's %lld", p, (long long)got,
                  (long long)pool);
        command_of(p, a, sizeof a);
        cr_assert(strstr(a, " serve ") && !strstr(a, "kv_role"), "port %d: %s", p, a);
    }
    char body[256];
    snprintf(body, sizeof body, "{\"model\":\"%s\",\"prompt\":\"The sea\",\"max_tokens\":4,\"temperature\":0}",
             strrchr(dir, '/') + 1);
    cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, a, sizeof a), 200, "%s", a);
    stop_up(up, port);
    /* refused: another model's plan, a key twice, a FIFO */
    char other[128], dup[128], fifo[128];
    snprintf(other, sizeof other, "%s/other.json", dir);
    snprintf(cmd, sizeof cmd, "%s plan --model v4-flash-mini --hardware %s --nodes 1 --aggregated dp=1,tp=1,instances=1 "
             "--mtp off --max-num-seqs 3 --max-model-len 256 --json > %s", bin, hw, other);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    snprintf(dup, sizeof dup, "%s/dup.json", dir);
    snprintf(cmd, sizeof cmd, "sed 's/\"plan_version\": 1,/\"plan_version\": 1, \"plan_version\": 1,/' %s > %s", plan,
             dup);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    snprintf(fifo, sizeof fifo, "%s/fifo.json", dir);
    cr_assert_eq(mkfifo(fifo, 0600), 0);
    const struct {
        const char *plan, *want;
    } bad[] = {{other, "was made for another model"}, {dup, "duplicate"}, {fifo, "FIFO"}};
    for (int i = 0; i < 3; i++) {
        snprintf(cmd, sizeof cmd, "timeout 20 %s up --model %s --plan %s --port %d 2>&1 >/dev/null", bin, dir,
                 bad[i].plan, port);
        FILE *p = popen(cmd, "r");
        size_t n = fread(a, 1, sizeof a - 1, p);
        a[n] = 0;
        int st = pclose(p);
        cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 2, "%s: status %d: %s", bad[i].plan, st, a);
        cr_assert(strstr(a, bad[i].plan) && strstr(a, bad[i].want), "%s: %s", bad[i].plan, a);
    }
    unlink(fifo);
}

/* vLLM's engine flags on pdmoe up reach every instance (--max-num-seqs 3: three KV slots each;
 * --kv-cache-memory-bytes: the pool; --served-model-name through the proxy); --host is the
 * proxy's; with --plan, which sets them, they are refused by name. */
Test(up, engine_flags_reach_every_instance)
{
    const char *bin = pdmoe_bin();
    const int port = test_ports();
    char out[256], sp[16];
    snprintf(out, sizeof out, "%s/up.out", dir);
    snprintf(sp, sizeof sp, "%d", port);
    pid_t up = fork_pdmoe();
    if (up == 0) {
        freopen(out, "w", stdout);
        execl(bin, bin, "up", "--model", dir, "--port", sp, "--host", "127.0.0.1", "--max-num-seqs", "3",
              "--kv-cache-memory-bytes", "64MiB", "--served-model-name", "tiny-x", "--kv-cache-dtype", "fp8",
              "--no-enable-prefix-caching", "--max-queued-requests", "5", (char *)NULL);
        _exit(127);
    }
    up_pid = up;
    int ready = up_wait_ready(out);
    cr_assert(ready, "pdmoe up did not become ready");
    for (int p = port + 1; p <= port + 2; p++) {
        cr_assert_eq(metric_port(p, "pdmoe_kv_slots_free"), 3, "port %d", p);
        cr_assert_eq(metric_port(p, "pdmoe_max_queued_requests"), 5, "port %d", p);
        cr_assert_leq(metric_key(p, "pdmoe_kv_pool_bytes"), (int64_t)64 << 20, "port %d", p);
        /* v4-tiny's fp8 entry: round_up(nope + 2 rope + nope/64 scales, 8) bytes */
        cr_assert_gt(metric_key(p, "pdmoe_kv_entry_bytes{dtype=\"fp8\"}"), 0, "port %d", p);
    }
    char a[8192];
    cr_assert_eq(curl_port(port, "/v1/models", NULL, NULL, a, sizeof a), 200, "%s", a);
    cr_assert(strstr(a, "\"tiny-x\""), "%s", a);
    const char *body = "{\"model\":\"tiny-x\",\"prompt\":\"The sea\",\"max_tokens\":3,\"temperature\":0}";
    cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, a, sizeof a), 200, "%s", a);
    /* the prefill instance computed the prompt without looking it up: caching is off there */
    cr_assert_eq(metric_port(port + 1, "pdmoe_prefix_cache_queries_total"), 0);
    /* the decode instance pulls from the prefill's KV port and from nowhere else */
    char want[64];
    command_of(port + 1, a, sizeof a);
    const char *kp = strstr(a, "\"kv_port\":");
    cr_assert_not_null(kp, "%s", a);
    snprintf(want, sizeof want, "\"kv_producers\":[\"127.0.0.1:%d-%d\"]", atoi(kp + 10), atoi(kp + 10));
    command_of(port + 2, a, sizeof a);
    cr_assert(strstr(a, want), "%s lacks %s", a, want);
    stop_up(up, port);

    char cmd[1024], err[512];
    snprintf(cmd, sizeof cmd, "%s up --model %s --plan /nonexistent.json --max-num-seqs 3 2>&1", bin, dir);
    FILE *f = popen(cmd, "r");
    size_t n = fread(err, 1, sizeof err - 1, f);
    err[n] = 0;
    cr_assert_eq(WEXITSTATUS(pclose(f)), 2, "%s", err);
    cr_assert(strstr(err, "--max-num-seqs: --plan /nonexistent.json sets it"), "%s", err);
    snprintf(cmd, sizeof cmd, "%s up --model %s --plan /nonexistent.json --kv-cache-dtype fp8 2>&1", bin, dir);
    f = popen(cmd, "r");
    n = fread(err, 1, sizeof err - 1, f);
    err[n] = 0;
    cr_assert_eq(WEXITSTATUS(pclose(f)), 2, "%s", err);
    cr_assert(strstr(err, "--kv-cache-dtype: --plan /nonexistent.json sets it"), "%s", err);
    /* the plan's drafts (options.num_speculative_tokens) are the ones its TPOT assumes */
    snprintf(cmd, sizeof cmd, "%s up --model %s --plan /nonexistent.json --speculative-config "
             "'{\"method\":\"mtp\",\"num_speculative_tokens\":2}' 2>&1", bin, dir);
    f = popen(cmd, "r");
    n = fread(err, 1, sizeof err - 1, f);
    err[n] = 0;
    cr_assert_eq(WEXITSTATUS(pclose(f)), 2, "%s", err);
    cr_assert(strstr(err, "--speculative-config: --plan /nonexistent.json sets it"), "%s", err);
}

/* --speculative-config reaches both instances (EP groups of `ep` ranks each): the prefill side
 * hands its MTP state over (from its owner rank to the decode side's), the decode side drafts (its
 * /metrics count drafts and no recompute), and the ids through the proxy are plain decoding's, as
 * `generate` without MTP gives them; every rank's pool is full again. */
static void speculative_up(int port, int ep)
{
    const char *bin = pdmoe_bin();
    char out[256], sp[16], se[16];
    snprintf(out, sizeof out, "%s/up.out", dir);
    snprintf(sp, sizeof sp, "%d", port);
    snprintf(se, sizeof se, "%d", ep);
    if (ep > 1)
        mpi_test_env();
    pid_t up = fork_pdmoe();
    if (up == 0) {
        freopen(out, "w", stdout);
        execl(bin, bin, "up", "--model", dir, "--port", sp, "--prefill-ep", se, "--decode-ep", se,
              "--speculative-config", "{\"method\":\"mtp\",\"num_speculative_tokens\":2}", (char *)NULL);
        _exit(127);
    }
    up_pid = up;
    int ready = up_wait_ready(out);
    cr_assert(ready, "pdmoe up did not become ready");
    static const char *prompts[] = {"The quick brown fox",
                                    "Once upon a time, in a kingdom by the sea, there lived a princess who counted "
                                    "the waves every morning and every evening"};
    const char *name = strrchr(dir, '/') + 1;
    for (int i = 0; i < 2; i++) {
        char a[8192], body[1024];
        snprintf(body, sizeof body, "{\"model\":\"%s\",\"prompt\":\"%s\",\"max_tokens\":16,\"temperature\":0,"
                 "\"return_token_ids\":true}", name, prompts[i]);
        cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, a, sizeof a), 200, "%s", a);
        json_t *j = parse(a);
        json_t *ids = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids");
        cr_assert_gt(json_array_size(ids), 1, "%s", a);
        char want[1024] = "[0] ids", *w = want + strlen(want);
        for (size_t k = 0; k < json_array_size(ids); k++)
            w += sprintf(w, " %lld", (long long)json_integer_value(json_array_get(ids, k)));
        json_decref(j);
        char cmd[1024], gen[8192];
        snprintf(cmd, sizeof cmd, "%s generate --model %s --prompt '%s' --max-tokens 16 --print-ids "
                 "--threads 1", bin, dir, prompts[i]);
        FILE *p = popen(cmd, "r");
        size_t n = fread(gen, 1, sizeof gen - 1, p);
        gen[n] = 0;
        pclose(p);
        cr_assert(strstr(gen, want), "prompt %d through pdmoe up with MTP: \"%s\"; generate without MTP:\n%s", i, want,
                  gen);
    }
    /* the prefill instance (port + 1) drafts nothing, the decode instance (port + 2) all of it */
    cr_assert_eq(metric_port(port + 1, "pdmoe_spec_decode_num_drafts_total"), 0);
    cr_assert_gt(metric_port(port + 2, "pdmoe_spec_decode_num_drafts_total"), 0);
    cr_assert_eq(metric_port(port + 2, "pdmoe_kv_transfers_total"), 2);
    cr_assert_eq(metric_port(port + 2, "pdmoe_kv_recomputes_total"), 0);
    for (int i = 0; i < 100 && metric_port(port + 1, "pdmoe_kv_leases") > 0; i++)
        usleep(20000);
    cr_assert_eq(metric_port(port + 1, "pdmoe_kv_leases"), 0);
    for (int k = 0; k < ep && ep > 1; k++)
        for (int p = port + 1; p <= port + 2; p++)
            cr_assert_eq(labelled(p, "pdmoe_rank_kv_blocks_free", k), labelled(p, "pdmoe_rank_kv_blocks_capacity", k),
                         "port %d, rank %d", p, k);
    cr_assert_eq(metric_port(port + 2, "pdmoe_kv_blocks_free"), metric_port(port + 2, "pdmoe_kv_blocks_capacity"));
    stop_up(up, port);
}

Test(up, speculative_config_reaches_every_instance_and_keeps_the_ids)
{
    speculative_up(test_ports(), 1);
}

/* The seed's decode shape: EP groups with MTP (kv ports up to port + 110, clear of the ranges above) */
Test(up, speculative_config_with_ep_groups_keeps_the_ids)
{
    speculative_up(test_ports(), 2);
}

/* A stream of `tokens` tokens through port, its SSE text in `file`: a popen'ed curl (read it with
 * pclose). */
static FILE *long_stream(int port, const char *file, int tokens)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "curl -s -N --max-time 120 -o %s http://127.0.0.1:%d/v1/completions -d '{\"prompt\":\"x\","
             "\"max_tokens\":%d,\"ignore_eos\":true,\"stream\":true}'", file, port, tokens);
    return popen(cmd, "r");
}

static void wait_generating(int port)
{
    for (int i = 0; i < 500 && metric_port(port, "pdmoe_generation_tokens_total") < 20; i++)
        usleep(10000);
    cr_assert_geq(metric_port(port, "pdmoe_generation_tokens_total"), 20, "the stream never started");
}

static char *slurp(const char *file)
{
    FILE *f = fopen(file, "r");
    cr_assert_not_null(f, "%s", file);
    static char buf[4 << 20];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

/* pdmoe up --shutdown-timeout (vLLM's flag): at SIGTERM a stream in flight through the proxy runs to
 * its end (its last chunk says "length", then [DONE], no error event) while a new request gets a
 * 503; then everything stops, up exits 0 and nothing is left on the ports. */
Test(up, a_shutdown_timeout_lets_the_streams_in_flight_finish)
{
    const char *bin = pdmoe_bin();
    tmp_model_positions(dir, 16384);
    const int port = test_ports();
    char out[256], sp[16], sse[256];
    snprintf(out, sizeof out, "%s/up.out", dir);
    snprintf(sse, sizeof sse, "%s/stream.sse", dir);
    snprintf(sp, sizeof sp, "%d", port);
    pid_t up = fork_pdmoe();
    if (up == 0) {
        freopen(out, "w", stdout);
        execl(bin, bin, "up", "--model", dir, "--port", sp, "--max-model-len", "16384", "--shutdown-timeout", "90",
              (char *)NULL);
        _exit(127);
    }
    up_pid = up;
    cr_assert(up_wait_ready(out), "pdmoe up did not become ready");
    /* 8,000 tokens: about 2 s of streaming here (14 s under the sanitizers), still running when the
     * new request and /readiness are refused 0.3 s after the signal (16,000 took 6 s a test, 33 s
     * under the sanitizers); had it ended first, the proxy would be gone and those get no 503 */
    FILE *c = long_stream(port, sse, 8000);
    wait_generating(port + 2);
    double t0 = pd_now_s();
    cr_assert_eq(kill(up, SIGTERM), 0);
    usleep(300000);
    char a[4096];
    int code = curl_port(port, "/v1/completions", "{\"prompt\":\"y\",\"max_tokens\":2}", NULL, a, sizeof a);
    cr_assert_eq(code, 503, "a new request while draining: %d %s", code, a);
    cr_assert(strstr(a, "shutting down"), "%s", a);
    cr_assert_eq(curl_port(port, "/readiness", NULL, NULL, a, sizeof a), 503, "%s", a);
    cr_assert(strstr(a, "\"reason\":\"the proxy is shutting down\""), "%s", a);
    pclose(c);
    int status;
    cr_assert_eq(waitpid(up, &status, 0), up);
    up_pid = 0;
    child_exited_cleanly(up, status, "pdmoe up --shutdown-timeout 90");
    cr_assert_lt(pd_now_s() - t0, 90, "the drain ran to its deadline");
    const char *s = slurp(sse);
    cr_assert_null(strstr(s, "\"error\""), "the stream was cut: ...%s", s + (strlen(s) > 400 ? strlen(s) - 400 : 0));
    const char *fin = strstr(s, "\"finish_reason\":\"length\"");
    cr_assert_not_null(fin, "no last chunk: ...%s", s + (strlen(s) > 400 ? strlen(s) - 400 : 0));
    cr_assert_not_null(strstr(fin, "data: [DONE]"));
    for (int q = port; q <= port + 2; q++)
        cr_assert_eq(processes_on(q), 0, "processes left behind on port %d", q);
}

/* pdmoe serve --shutdown-timeout: the drain ends at its deadline (the stream then gets an error
 * event and [DONE]), and a second signal ends it at once; serve exits 0 either way. */
Test(up, serve_drains_until_its_shutdown_timeout_or_a_second_signal)
{
    const char *bin = pdmoe_bin();
    tmp_model_positions(dir, 16384);
    const int port = test_ports();
    char sp[16], sse[256];
    snprintf(sp, sizeof sp, "%d", port);
    snprintf(sse, sizeof sse, "%s/stream.sse", dir);
    for (int twice = 0; twice < 2; twice++) {
        pid_t s = fork_pdmoe();
        if (s == 0) {
            freopen("/dev/null", "w", stderr);
            execl(bin, bin, "serve", "--model", dir, "--port", sp, "--max-model-len", "16384", "--threads", "1",
                  "--shutdown-timeout", twice ? "90" : "1", (char *)NULL);
            _exit(127);
        }
        up_pid = s;
        char a[256];
        for (int i = 0; i < 300 && curl_port(port, "/health", NULL, NULL, a, sizeof a) != 200; i++)
            usleep(100000);
        FILE *c = long_stream(port, sse, 16000);   /* past the 1 s deadline */
        wait_generating(port);
        double t0 = pd_now_s();
        cr_assert_eq(kill(s, SIGTERM), 0);
        if (twice) {
            usleep(300000);
            cr_assert_eq(kill(s, SIGTERM), 0);
        }
        int status;
        cr_assert_eq(waitpid(s, &status, 0), s);
        up_pid = 0;
        double took = pd_now_s() - t0;
        pclose(c);
        child_exited_cleanly(s, status, twice ? "pdmoe serve --shutdown-timeout 90, signalled twice"
                                              : "pdmoe serve --shutdown-timeout 1");
        cr_assert_lt(took, 8, "%s: serve took %.1f s to stop", twice ? "a second signal" : "a 1 s drain", took);
        if (!twice)
            cr_assert_geq(took, 0.9, "the drain ended before its deadline (%.2f s) with a stream running", took);
        const char *t = slurp(sse);
        const char *err = strstr(t, "shutting down");
        cr_assert_not_null(err, "no error event: ...%s", t + (strlen(t) > 300 ? strlen(t) - 300 : 0));
        cr_assert_not_null(strstr(err, "data: [DONE]"));
    }
}

/* argv (NULL-ended) started with its stdout (and its stderr, with err) in the file out. */
static pid_t run_to(const char *out, int err, const char *const *argv)
{
    pid_t p = fork_pdmoe();
    if (p == 0) {
        freopen(out, "w", stdout);
        if (err)
            freopen(out, "a", stderr);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    return p;
}

/* A checkpoint in shards with their index (what pdmoe convert and the release write) is one up
 * starts: it asked for model.safetensors alone, though serve loads both. */
Test(up, a_sharded_checkpoint_is_started)
{
    const char *bin = pdmoe_bin();
    const int port = test_ports();
    char rel[64], out[256], cmd[512];
    snprintf(rel, sizeof rel, "/tmp/pdmoe-up-shards-XXXXXX");
    cr_assert_not_null(mkdtemp(rel));
    snprintf(cmd, sizeof cmd, "%s gen-model --preset v4-tiny --format release --out %s > /dev/null", bin, rel);
    cr_assert_eq(system(cmd), 0);
    snprintf(out, sizeof out, "%s/up.out", dir);
    char sp[16];
    snprintf(sp, sizeof sp, "%d", port);
    const char *av[] = {bin, "up", "--model", rel, "--port", sp, NULL};
    pid_t up = run_to(out, 0, av);
    up_pid = up;
    int ready = up_wait_ready(out);
    char body[4096];
    int code = ready ? curl_port(port, "/v1/completions", "{\"prompt\":\"hi\",\"max_tokens\":2}", NULL, body,
                                 sizeof body) : 0;
    stop_up(up, port);
    up_pid = 0;
    rm_model(rel);
    cr_assert(ready, "pdmoe up did not start a sharded checkpoint");
    cr_assert_eq(code, 200, "%s", body);
}

/* SIGTERM to bench soak mid-run: the cluster it started stops and its directory goes (they were
 * left running on their ports and in /tmp). */
Test(up, a_terminated_soak_stops_its_cluster)
{
    const char *bin = pdmoe_bin();
    const int port = test_ports();
    char out[256];
    snprintf(out, sizeof out, "%s/soak.out", dir);
    char sp[16];
    snprintf(sp, sizeof sp, "%d", port);
    const char *av[] = {bin, "bench", "soak", "--quick", "--seconds", "120", "--model", dir, "--port", sp, NULL};
    pid_t b = run_to(out, 1, av);
    /* running: its first victim killed (a third of the way would be 40 s: wait for the proxy instead) */
    int up_ok = 0;
    for (int i = 0; i < 600 && !up_ok; i++) {
        char body[64];
        up_ok = curl_port(port, "/health", NULL, NULL, body, sizeof body) == 200;
        if (!up_ok)
            usleep(100000);
    }
    cr_assert(up_ok, "the soak's cluster never answered");
    usleep(2000000);
    kill(b, SIGTERM);
    int st;
    cr_assert_eq(waitpid(b, &st, 0), b);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 128 + SIGTERM, "bench soak ended with status %d", st);
    for (int p = port; p <= port + 3; p++)
        cr_assert_eq(processes_on(p), 0, "a process left on port %d", p);
}

/* pdmoe up's stderr and exit status for `args` (run under timeout 60: the code before kept a
 * cluster it should have refused running). */
static int up_run(const char *bin, const char *args, char *err, size_t cap)
{
    char cmd[1024];
    mpi_test_env();
    snprintf(cmd, sizeof cmd, "timeout 60 %s up --model %s %s 2>&1 >/dev/null", bin, dir, args);
    FILE *p = popen(cmd, "r");
    size_t n = fread(err, 1, cap - 1, p);
    err[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int occurrences(const char *s, const char *needle)
{
    int n = 0;
    for (const char *p = s; (p = strstr(p, needle)); p += strlen(needle))
        n++;
    return n;
}

/* An instance that refuses its configuration (pdmoe serve's exit status 78: a context past the
 * model's positions here) is not started twice more: each start printed the same refusal, with
 * an EP group's Open MPI banners, 78 lines in all. */
Test(up, an_instance_that_refuses_its_configuration_is_not_started_again)
{
    const char *bin = pdmoe_bin();
    char err[16384], args[256];
    const int port = test_ports();
    snprintf(args, sizeof args, "--port %d --max-model-len 100000000 --decode-ep 2", port);
    cr_assert_eq(up_run(bin, args, err, sizeof err), 1, "%s", err);
    cr_assert(strstr(err, "refused its configuration (its message is above; exit status 78): not starting it again"),
              "%s", err);
    cr_assert_null(strstr(err, "before it was ready; starting it again"), "%s", err);
    cr_assert_leq(occurrences(err, "--max-model-len 100000000: more than"), 2, "%s", err);
}

/* --kv-cache-memory-bytes is each rank's pool: up refuses, before starting anything, pools that
 * all its ranks on this host together could not hold (each serve counts its own group's ranks
 * only: four ranks of 40% of the memory left each started). */
Test(up, pools_that_the_host_cannot_hold_together_are_refused)
{
    const char *bin = pdmoe_bin();
    FILE *f = fopen("/proc/meminfo", "r");
    cr_assert_not_null(f);
    long long kb = 0;
    char line[256], err[16384], args[256];
    while (fgets(line, sizeof line, f) && sscanf(line, "MemAvailable: %lld kB", &kb) != 1)
        ;
    fclose(f);
    const int port = test_ports();
    snprintf(args, sizeof args, "--port %d --prefill-ep 2 --decode-ep 2 --kv-cache-memory-bytes %lld", port,
             kb * 1024 * 4 / 10);
    cr_assert_eq(up_run(bin, args, err, sizeof err), 2, "%s", err);
    cr_assert(strstr(err, "the 4 ranks this host runs (2 prefill, 2 decode) each hold a KV pool of that size"), "%s",
              err);
    cr_assert_eq(processes_on(port + 1) + processes_on(port + 2), 0);
}

/* pdmoe up supervises its cluster: a prefill instance SIGKILLed under load costs only the
 * requests it held (every stream ends whole, or with an error event and [DONE]), is started again
 * on its ports and serves, its restart counted in the proxy's /metrics and logged; so is a killed
 * proxy; one the kernel's OOM killer ends is logged as such; --api-key guards the proxy and every
 * instance; and Ctrl-C
 * ends the streams in flight with an error event and [DONE], never a bare cut. */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/timing.h"
#include "../tmpmodel.h"
#include "util.h"

static char dir[64], logs[64];
static pid_t up_pid;
static char cgroup[700];   /* a memory cgroup a test made (cgroup v1), removed by teardown */

static void cgroup_remove(void);

static void setup(void)
{
    tmp_model("v4-tiny", 19, dir, sizeof dir);
    snprintf(logs, sizeof logs, "/tmp/pdmoe-sup-XXXXXX");
    cr_assert_not_null(mkdtemp(logs));
}

/* The cluster a test left running is stopped (Ctrl-C): up must exit 0 without a sanitizer report,
 * whatever its instances went through. */
static void teardown(void)
{
    pid_t up = up_pid;
    int st = 0, ended = 1;
    up_pid = 0;
    if (up > 0) {
        kill(up, SIGINT);
        ended = reap_within(up, 0, &st);
    }
    char err[4096] = "";
    if (up > 0 && logs[0]) {
        char path[128];
        snprintf(path, sizeof path, "%s/up.err", logs);
        FILE *f = fopen(path, "r");
        size_t n = f ? fread(err, 1, sizeof err - 1, f) : 0;
        err[n] = 0;
        if (f)
            fclose(f);
    }
    cgroup_remove();
    rm_flat_dir(logs);
    rm_model(dir);
    if (up > 0) {
        cr_assert(ended, "pdmoe up did not exit within 60 s of SIGINT; its log: %s", err);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
            cr_log_error("pdmoe up's log: %s", err);
        child_exited_cleanly(up, st, "pdmoe up at Ctrl-C after the test");
    }
}

TestSuite(supervise, .init = setup, .fini = teardown, .timeout = 120);

/* pdmoe up on `port` with 1 prefill and 1 decode instance and the flags in `extra` (NULL-ended,
 * or NULL), in the cgroup whose directory is `in` (NULL: this one's); its stderr in logs/up.err. */
static void start_up_in(int port, const char *const *extra, const char *in)
{
    const char *bin = pdmoe_bin();
    char out[128], err[128];
    snprintf(out, sizeof out, "%s/up.out", logs);
    snprintf(err, sizeof err, "%s/up.err", logs);
    pid_t up = fork_pdmoe();
    if (up == 0) {
        char sp[16];
        snprintf(sp, sizeof sp, "%d", port);
        freopen(out, "w", stdout);
        freopen(err, "w", stderr);
        if (in) {
            char procs[800];
            snprintf(procs, sizeof procs, "%s/cgroup.procs", in);
            FILE *f = fopen(procs, "w");
            if (!f || fprintf(f, "%d\n", (int)getpid()) < 0 || fclose(f) != 0)
                _exit(126);
        }
        const char *a[24] = {bin, "up", "--model", dir, "--port", sp, "--max-model-len", "1024"};
        for (int k = 0; extra && extra[k] && k < 15; k++)
            a[8 + k] = extra[k];
        execv(bin, (char *const *)a);
        _exit(127);
    }
    up_pid = up;
    int ready = up_wait_ready(out);
    cr_assert(ready, "pdmoe up did not become ready; see %s", err);
}

static void start_up(int port, const char *const *extra)
{
    start_up_in(port, extra, NULL);
}

/* The pid of `pdmoe serve|proxy ... --port N` (what: "serve" or "proxy"; `up` has --port too), 0
 * if none. */
static pid_t pid_on(const char *what, int port)
{
    char cmd[160];
    snprintf(cmd, sizeof cmd, "pgrep -f -- ' %s .*-[-]port %d( |$)'", what, port);
    FILE *p = popen(cmd, "r");
    int pid = 0;
    if (!p || fscanf(p, "%d", &pid) != 1)
        pid = 0;
    if (p)
        pclose(p);
    return pid;
}

/* n streaming clients through the proxy on `port`, in the background; each writes its body and
 * its status to logs/c<i>.{out,code}. */
static FILE *load(int port, int n, const char *prompt_words, int max_tokens)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "p=$(printf '%s %%.0s' $(seq 30)); "
             "seq %d | xargs -P %d -I{} sh -c \"curl -s -N --max-time 60 -o %s/c{}.out -w '%%{http_code}' "
             "http://127.0.0.1:%d/v1/completions -d '{\\\"prompt\\\":\\\"{} '\\\"\\$p\\\"'\\\",\\\"max_tokens\\\":%d,"
             "\\\"ignore_eos\\\":true,\\\"stream\\\":true,\\\"seed\\\":{}}' > %s/c{}.code\"",
             prompt_words, n, n, logs, port, max_tokens, logs);
    return popen(cmd, "r");
}

static void wait_load(FILE *l)
{
    char sink[64];
    while (fgets(sink, sizeof sink, l))
        ;
    pclose(l);
}

/* Client i's outcome: 1 a whole stream, 0 an error that reached it (a 5xx with a JSON error, or
 * an error event followed by [DONE]); a stream cut without an error, or without [DONE], fails. */
static int outcome(int i)
{
    static char body[1 << 16];
    int status = client_answer(logs, i, body, sizeof body);
    cr_assert(status == 200 || status >= 500, "client %d: HTTP %d: %s", i, status, body);
    if (status >= 500) {
        cr_assert(strstr(body, "\"error\""), "client %d: %d without a JSON error: %s", i, status, body);
        return 0;
    }
    size_t len = strlen(body);
    static const char done[] = "data: [DONE]\n\n";
    cr_assert(len >= sizeof done - 1 && !strcmp(body + len - (sizeof done - 1), done),
              "client %d: a stream cut without [DONE] (%zu bytes): ...%s", i, len, body + (len > 300 ? len - 300 : 0));
    if (strstr(body, "data: {\"error\""))
        return 0;
    cr_assert(strstr(body, "\"finish_reason\":\"length\""), "client %d: [DONE] without an error or a finish: %s", i,
              body);
    return 1;
}

static int file_has(const char *path, const char *what)
{
    char buf[1 << 15];
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    buf[n] = 0;
    if (f)
        fclose(f);
    return strstr(buf, what) != NULL;
}

Test(supervise, a_killed_prefill_instance_is_restarted_and_costs_only_its_requests_and_so_is_the_proxy)
{
    const int port = test_ports(), P = port + 1;
    start_up(port, NULL);
    pid_t victim = pid_on("serve", P);
    cr_assert_gt(victim, 0, "no process with --port %d", P);
    FILE *l = load(port, 12, "the tide comes in and the tide goes out", 16);
    /* kill the prefill instance once it has work: the rest of its share is still in flight */
    int busy = 0;
    for (int i = 0; i < 2000 && !busy; i++) {
        busy = metric_port(P, "pdmoe_requests_total") > 0;
        if (!busy)
            usleep(2000);
    }
    cr_assert(busy, "the prefill instance never got a request");
    const double killed = pd_now_s();
    kill(victim, SIGKILL);
    wait_load(l);
    /* a stream whose KV pull met the dead producer waited for UCX's keepalive, 20 s, or the
     * pull's 30 s timeout, before its prompt was recomputed */
    cr_assert_lt(pd_now_s() - killed, 10, "the clients were answered %.1f s after the prefill instance died",
                 pd_now_s() - killed);
    int whole = 0;
    for (int i = 1; i <= 12; i++)
        whole += outcome(i);
    cr_log_info("%d of 12 streams whole after the prefill instance died", whole);
    /* it comes back on its port, a new process, and the proxy takes it back */
    char key[128];
    snprintf(key, sizeof key, "pdmoe_proxy_instance_up{role=\"prefill\",instance=\"127.0.0.1:%d\"}", P);
    int back = 0;
    for (int i = 0; i < 300 && !back; i++) {
        pid_t now = pid_on("serve", P);
        char h[64];
        back = now > 0 && now != victim && curl_port(P, "/health", NULL, NULL, h, sizeof h) == 200 &&
               metric_key(port, key) == 1;
        if (!back)
            usleep(100000);
    }
    cr_assert(back, "the prefill instance was not restarted and taken back in 30 s");
    char body[256], out[8192];
    snprintf(body, sizeof body, "{\"model\":\"%s\",\"prompt\":\"after\",\"max_tokens\":4}", strrchr(dir, '/') + 1);
    cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    cr_assert_gt(metric_port(P, "pdmoe_requests_total"), 0, "the restarted instance served nothing");
    cr_assert_eq(metric_key(port, "pdmoe_restarts_total{role=\"prefill\",instance=\"0\"}"), 1);
    cr_assert_eq(metric_key(port, "pdmoe_restarts_total{role=\"decode\",instance=\"0\"}"), 0);
    char err[128];
    snprintf(err, sizeof err, "%s/up.err", logs);
    cr_assert(file_has(err, "prefill instance 0 (127.0.0.1:") && file_has(err, "was killed by signal 9"),
              "the death is not in up's log %s", err);
    /* a SIGKILL is not the OOM killer's unless its count rose (the host's may: other tests run) */
    cr_assert(!file_has(err, "in this cgroup meanwhile"), "a kill blamed on the OOM killer in %s", err);
    /* the proxy too comes back, and still reports the restarts before its own */
    pid_t px = pid_on("proxy", port);
    cr_assert_gt(px, 0);
    kill(px, SIGKILL);
    int code = 0;
    for (int i = 0; i < 300 && code != 200; i++) {
        usleep(100000);
        code = pid_on("proxy", port) != px ? curl_port(port, "/v1/completions", body, NULL, out, sizeof out) : 0;
    }
    cr_assert_eq(code, 200, "no answer from a restarted proxy in 30 s: %s", out);
    cr_assert_eq(metric_key(port, "pdmoe_restarts_total{role=\"proxy\",instance=\"0\"}"), 1);
    cr_assert_eq(metric_key(port, "pdmoe_restarts_total{role=\"prefill\",instance=\"0\"}"), 1);
    cr_assert_eq(waitpid(up_pid, NULL, WNOHANG), 0, "pdmoe up exited");
}

Test(supervise, ctrl_c_ends_live_streams_with_an_error_and_done)
{
    const int port = test_ports();
    start_up(port, NULL);
    FILE *l = load(port, 6, "stream", 900);
    /* every stream has begun */
    int begun = 0;
    for (int i = 0; i < 1000 && begun < 6; i++) {
        begun = 0;
        for (int c = 1; c <= 6; c++) {
            char path[128];
            snprintf(path, sizeof path, "%s/c%d.out", logs, c);
            begun += file_has(path, "\"text\"");
        }
        if (begun < 6)
            usleep(10000);
    }
    cr_assert_eq(begun, 6, "only %d of 6 streams began", begun);
    kill(up_pid, SIGINT);
    int status;
    pid_t up = up_pid;
    cr_assert_eq(waitpid(up_pid, &status, 0), up_pid);
    up_pid = 0;
    child_exited_cleanly(up, status, "pdmoe up at Ctrl-C with 6 streams running");
    wait_load(l);
    int whole = 0;
    for (int i = 1; i <= 6; i++)
        whole += outcome(i);
    cr_assert_lt(whole, 6, "every stream finished before Ctrl-C: the test stopped nothing in flight");
    for (int p = port; p <= port + 2; p++)
        cr_assert_eq(processes_on(p), 0, "a process left behind on port %d", p);
}

/* --api-key: the proxy and every instance up started refuse a request without the key;
 * --kv-lease-ms reaches the prefill instance. */
Test(supervise, api_key_protects_the_proxy_and_every_instance_and_the_lease_is_set)
{
    const int port = test_ports();
    const char *flags[] = {"--api-key", "s3cret-key", "--kv-lease-ms", "800", NULL};
    start_up(port, flags);
    char out[8192];
    const char *body = "{\"prompt\":\"hi\",\"max_tokens\":2}";
    for (int p = port; p <= port + 2; p++) {
        cr_assert_eq(curl_port(p, "/v1/completions", body, NULL, out, sizeof out), 401, "port %d: %s", p, out);
        cr_assert(strstr(out, "API key"), "port %d: %s", p, out);
        cr_assert_eq(curl_port(p, "/v1/completions", body, "-H 'Authorization: Bearer s3cret-kez'", out, sizeof out),
                     401, "port %d: %s", p, out);
    }
    for (int p = port + 1; p <= port + 2; p++)
        cr_assert_eq(curl_port(p, "/v1/models", NULL, "-H 'Authorization: Bearer s3cret-key'", out, sizeof out), 200,
                     "port %d: %s", p, out);
    /* the key is on no child's command line (every user of the machine reads those in ps): they
     * have it from their environment */
    for (int p = port; p <= port + 2; p++) {
        pid_t pid = pid_on(p == port ? "proxy" : "serve", p);
        cr_assert_gt(pid, 0, "no process on port %d", p);
        char path[64], cmd[4096];
        snprintf(path, sizeof path, "/proc/%d/cmdline", (int)pid);
        FILE *f = fopen(path, "r");
        cr_assert_not_null(f);
        size_t n = fread(cmd, 1, sizeof cmd - 1, f);
        fclose(f);
        for (size_t i = 0; i < n; i++)
            cmd[i] = cmd[i] ? cmd[i] : ' ';
        cmd[n] = 0;
        cr_assert_null(strstr(cmd, "s3cret"), "the key is on port %d's command line: %s", p, cmd);
    }
    /* the whole key through the proxy, which passes it on to both instances */
    cr_assert_eq(curl_port(port, "/v1/completions", body, "-H 'Authorization: Bearer s3cret-key'", out, sizeof out), 200,
                 "through the proxy: %s", out);
    /* a prefill for a decode instance that never pulls: its lease ends after 0.8 s, not 30 s */
    cr_assert_eq(curl_port(port + 1, "/v1/completions", "{\"prompt\":\"held\",\"max_tokens\":1,"
                           "\"kv_transfer_params\":{\"do_remote_decode\":true}}", "-H 'Authorization: Bearer s3cret-key'",
                           out, sizeof out), 200, "%s", out);
    cr_assert_eq(metric_port(port + 1, "pdmoe_kv_leases"), 1);
    usleep(2000000);
    cr_assert_eq(metric_port(port + 1, "pdmoe_kv_leases"), 0);
}

/* --liveness-timeout: an instance or a proxy that is alive but answers nothing (SIGSTOP: the
 * reaping never sees it) is killed and started again once it has been silent that long, and the
 * cluster serves again; the restarts are counted as deaths are. */
Test(supervise, a_stopped_instance_and_a_stopped_proxy_are_killed_and_started_again)
{
    const int port = test_ports();
    const char *flags[] = {"--liveness-timeout", "2", NULL};
    start_up(port, flags);
    char body[256], out[8192], err[128];
    snprintf(body, sizeof body, "{\"model\":\"%s\",\"prompt\":\"after\",\"max_tokens\":4}", strrchr(dir, '/') + 1);
    snprintf(err, sizeof err, "%s/up.err", logs);
    const int D = port + 2;
    pid_t dec = pid_on("serve", D);
    cr_assert_gt(dec, 0, "no process with --port %d", D);
    kill(dec, SIGSTOP);
    int back = 0;
    for (int i = 0; i < 300 && !back; i++) {
        usleep(100000);
        pid_t now = pid_on("serve", D);
        back = now > 0 && now != dec && curl_port(port, "/v1/completions", body, NULL, out, sizeof out) == 200;
    }
    cr_assert(back, "the stopped decode instance was not replaced in 30 s: %s", out);
    cr_assert(file_has(err, "decode instance 0 (127.0.0.1:") && file_has(err, "has not answered /health for") &&
              file_has(err, "(--liveness-timeout 2); stopping it"), "the kill is not in up's log %s", err);
    cr_assert_eq(metric_key(port, "pdmoe_restarts_total{role=\"decode\",instance=\"0\"}"), 1);
    pid_t px = pid_on("proxy", port);
    cr_assert_gt(px, 0);
    kill(px, SIGSTOP);
    int code = 0;
    for (int i = 0; i < 300 && code != 200; i++) {
        usleep(100000);
        code = pid_on("proxy", port) != px ? curl_port(port, "/v1/completions", body, NULL, out, sizeof out) : 0;
    }
    cr_assert_eq(code, 200, "no answer from a new proxy in 30 s: %s", out);
    cr_assert_eq(metric_key(port, "pdmoe_restarts_total{role=\"proxy\",instance=\"0\"}"), 1);
    cr_assert_eq(metric_key(port, "pdmoe_restarts_total{role=\"prefill\",instance=\"0\"}"), 0);
    cr_assert_eq(waitpid(up_pid, NULL, WNOHANG), 0, "pdmoe up exited");
}

/* The pid of rank 0 of the EP group `pdmoe serve ... --port N` (OMPI_COMM_WORLD_RANK=0 in its
 * environment), 0 if none. */
static pid_t rank0_on(int port)
{
    char cmd[160];
    snprintf(cmd, sizeof cmd, "pgrep -f -- ' serve .*-[-]port %d( |$)'", port);
    FILE *p = popen(cmd, "r");
    int pid, found = 0;
    while (p && !found && fscanf(p, "%d", &pid) == 1) {
        char path[64], env[1 << 14];
        snprintf(path, sizeof path, "/proc/%d/environ", pid);
        FILE *f = fopen(path, "r");
        size_t n = f ? fread(env, 1, sizeof env - 1, f) : 0;
        if (f)
            fclose(f);
        for (size_t i = 0; i < n; i += strlen(env + i) + 1) {
            env[n] = 0;
            if (!strcmp(env + i, "OMPI_COMM_WORLD_RANK=0"))
                found = pid;
        }
    }
    if (p)
        pclose(p);
    return found;
}

/* An EP group whose rank 0 stopped answering is stopped by SIGTERM first (SIGKILL after a grace):
 * the SIGKILLed mpirun left its ranks' shared-memory segments in /dev/shm at every such restart. */
Test(supervise, a_silent_ep_group_is_stopped_without_leaving_its_shared_memory)
{
    const int port = test_ports();
    const char *flags[] = {"--liveness-timeout", "2", "--decode-ep", "2", NULL};
    start_up(port, flags);
    const int D = port + 2;
    pid_t r0 = rank0_on(D);
    cr_assert_gt(r0, 0, "no rank 0 on --port %d", D);
    char segs[4][128];
    int ns = 0;
    shm_segments_of(r0, segs, &ns, 4);
    cr_assert_gt(ns, 0, "rank 0 maps no vader segment: the test checks nothing");
    kill(r0, SIGSTOP);
    char err[128], body[256], out[4096];
    snprintf(err, sizeof err, "%s/up.err", logs);
    snprintf(body, sizeof body, "{\"model\":\"%s\",\"prompt\":\"after\",\"max_tokens\":2}", strrchr(dir, '/') + 1);
    int back = 0;
    for (int i = 0; i < 400 && !back; i++) {
        usleep(100000);
        pid_t now = rank0_on(D);
        back = now > 0 && now != r0 && curl_port(port, "/v1/completions", body, NULL, out, sizeof out) == 200;
    }
    cr_assert(back, "the silent group was not replaced in 40 s: %s", out);
    for (int k = 0; k < ns; k++)
        cr_assert_neq(access(segs[k], F_OK), 0, "%s outlived its group", segs[k]);
    cr_assert(file_has(err, "stopping it"), "the stop is not in up's log %s", err);
}

/* Writes `text` to file `path`: 0, or -1. */
static int put_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f)
        return -1;
    int ok = fputs(text, f) >= 0;
    return fclose(f) == 0 && ok ? 0 : -1;
}

static int64_t file_num(const char *path)
{
    FILE *f = fopen(path, "r");
    long long v = -1;
    if (f && fscanf(f, "%lld", &v) != 1)
        v = -1;
    if (f)
        fclose(f);
    return v;
}

/* A memory cgroup (v1) below this process's, for a test: its directory in `cgroup`; 0, or -1 with
 * why not in `why` (not root, no v1 memory controller, mkdir refused). */
static int cgroup_make(char *why, size_t cap)
{
    if (geteuid() != 0)
        return snprintf(why, cap, "not root: cannot make a memory cgroup"), -1;
    FILE *f = fopen("/proc/self/cgroup", "r");
    char line[600], at[512] = "";
    while (f && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (c2 && !strncmp(c1 + 1, "memory:", 7))
            snprintf(at, sizeof at, "%s", c2 + 1);
    }
    if (f)
        fclose(f);
    if (!at[0])
        return snprintf(why, cap, "no cgroup v1 memory controller in /proc/self/cgroup (cgroup v2 is not covered "
                        "by this test)"), -1;
    snprintf(cgroup, sizeof cgroup, "/sys/fs/cgroup/memory%s/pdmoe-test-%d", strcmp(at, "/") ? at : "",
             (int)getpid());
    if (mkdir(cgroup, 0755) != 0) {
        snprintf(why, cap, "cannot make the memory cgroup %s: %s", cgroup, strerror(errno));
        cgroup[0] = 0;
        return -1;
    }
    return 0;
}

/* The test's cgroup, gone: what still runs in it (nothing, once up has stopped) moved to the one
 * above, then rmdir (the kernel takes a moment to let a cgroup whose last process just exited go). */
static void cgroup_remove(void)
{
    if (!cgroup[0])
        return;
    char procs[800], parent[800], line[32];
    snprintf(procs, sizeof procs, "%s/cgroup.procs", cgroup);
    snprintf(parent, sizeof parent, "%s", cgroup);
    *strrchr(parent, '/') = 0;
    strcat(parent, "/cgroup.procs");
    for (int t = 0; t < 50 && rmdir(cgroup) != 0; t++) {
        FILE *f = fopen(procs, "r");
        while (f && fgets(line, sizeof line, f))
            put_file(parent, line);
        if (f)
            fclose(f);
        usleep(100000);
    }
    if (access(cgroup, F_OK) == 0)
        cr_log_error("could not remove the memory cgroup %s", cgroup);
    cgroup[0] = 0;
}

/* A process of the memory cgroup at `cg` that takes a MiB of memory more every 20 ms (up to 1 GiB)
 * until it is killed (SIGKILL), so that the cgroup meets its limit. The OOM killer takes the decode instance
 * first (oom_score_adj 1000; this one's is 0: lowering it needs CAP_SYS_RESOURCE, which a
 * container's root may lack). Its pid. */
static pid_t memory_hog(const char *cg)
{
    pid_t hog = fork();
    cr_assert_geq(hog, 0, "fork: %s", strerror(errno));
    if (hog == 0) {
        char procs[800], me[32];
        snprintf(procs, sizeof procs, "%s/cgroup.procs", cg);
        snprintf(me, sizeof me, "%d\n", (int)getpid());
        /* it dies with the test, whatever ends it, and stops at 1 GiB */
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() == 1 || put_file(procs, me))
            _exit(126);
        for (int mib = 0;; mib++) {
            char *p = mib < 1024 ? malloc(1 << 20) : NULL;
            if (p)
                memset(p, 1, 1 << 20);
            usleep(20000);
        }
    }
    return hog;
}

/* The kernel's OOM killer ends an instance (SIGKILL): up's log says so, with the cgroup's count and
 * limit, where before it said only "was killed by signal 9", as for any kill; and the proxy's
 * /metrics counts it. The cluster runs in a memory cgroup of its own; once it is up, the cgroup's
 * limit is lowered to what it uses (its page cache reclaimed first) and the decode instance is
 * made the OOM killer's choice (oom_score_adj 1000, whichever process's page fault meets the
 * limit); then requests until the kill, and beside them memory_hog's process. Requests alone met
 * the limit only in some runs (4 of 6 here): once warm, their KV blocks and activations reuse
 * pages, and the kernel keeps evicting the checkpoint's file pages instead. */
Test(supervise, an_instance_the_oom_killer_ends_is_logged_as_such)
{
    char why[1100];
    if (cgroup_make(why, sizeof why))
        cr_skip_test("%s", why);
    const int port = test_ports(), D = port + 2;
    start_up_in(port, NULL, cgroup);
    pid_t dec = pid_on("serve", D);
    cr_assert_gt(dec, 0, "no process with --port %d", D);
    char path[900];
    snprintf(path, sizeof path, "/proc/%d/oom_score_adj", (int)dec);
    cr_assert_eq(put_file(path, "1000"), 0, "%s: %s", path, strerror(errno));
    /* a limit under the cgroup's use: the kernel reclaims what it can, then refuses it (EBUSY) */
    char lim[800], use[800], v[32];
    snprintf(lim, sizeof lim, "%s/memory.limit_in_bytes", cgroup);
    snprintf(use, sizeof use, "%s/memory.usage_in_bytes", cgroup);
    put_file(lim, "1048576");
    snprintf(v, sizeof v, "%lld", (long long)file_num(use) + (1 << 20));
    cr_assert_eq(put_file(lim, v), 0, "%s: %s", lim, strerror(errno));
    char err[128], line[2048] = "";
    snprintf(err, sizeof err, "%s/up.err", logs);
    char died[96];
    snprintf(died, sizeof died, "the decode instance 0 (127.0.0.1:%d) was killed by signal 9", D);
    pid_t hog = memory_hog(cgroup);
    for (int round = 0; round < 30 && !line[0]; round++) {
        wait_load(load(port, 4, "the tide comes in and the tide goes out", 64));
        FILE *f = fopen(err, "r");
        char l[2048];
        while (f && !line[0] && fgets(l, sizeof l, f))
            if (strstr(l, died))
                snprintf(line, sizeof line, "%s", l);
        if (f)
            fclose(f);
    }
    kill(hog, SIGKILL);
    waitpid(hog, NULL, 0);
    put_file(lim, "-1");   /* the restarts live */
    char tail[1501];
    cr_assert(line[0], "the decode instance was not killed (%s) after 30 rounds of requests; %s ends:\n%s", cgroup, err,
              file_tail(err, tail, sizeof tail));
    cr_log_info("%s", line);
    /* the decode instance first, but the OOM killer may take another before up reaps it: N >= 1 */
    static const char said[] = "; the kernel's OOM killer killed ";
    const char *note = strstr(line, said);
    int killed = 0;
    cr_assert(note && sscanf(note + strlen(said), "%d", &killed) == 1 && killed >= 1,
              "up's line does not name the OOM killer: %s", line);
    char where[900], counts[96];
    snprintf(where, sizeof where, "%s%d process%s in this cgroup meanwhile (cgroup %s: limit ", said, killed,
             killed == 1 ? "" : "es", cgroup + strlen("/sys/fs/cgroup/memory"));
    snprintf(counts, sizeof counts, " MiB, oom_kill 0 -> %d; /proc/vmstat oom_kill ", killed);
    cr_assert(strstr(line, where) && strstr(line, counts) &&
              strstr(line, "): its processes need more memory than it gives them (an instance holds its weights, "
                     "its KV pool"), "up's line lacks the cgroup, its limit or its count: %s", line);
    int64_t oom = 0;
    for (int i = 0; i < 100 && oom < 1; i++) {   /* written at its restart */
        usleep(100000);
        oom = metric_key(port, "pdmoe_oom_deaths_total{role=\"decode\",instance=\"0\"}");
    }
    cr_assert_geq(oom, 1, "the proxy's /metrics does not count the OOM death");
}

/* A model directory renamed under a running cluster: the restarted instance names --model and
 * the directory, and up's line says what its exit status 78 means (it said "exited with status
 * 78" after the instance's "DIR/tokenizer.json: cannot open"). */
Test(supervise, an_instance_restarted_without_its_model_directory_is_named)
{
    const int port = test_ports(), D = port + 2;
    start_up(port, NULL);
    char moved[80], err[128];
    snprintf(moved, sizeof moved, "%s.moved", dir);
    snprintf(err, sizeof err, "%s/up.err", logs);
    pid_t dec = pid_on("serve", D);
    cr_assert_gt(dec, 0, "no process with --port %d", D);
    cr_assert_eq(rename(dir, moved), 0, "%s", strerror(errno));
    kill(dec, SIGKILL);
    char want[160];
    snprintf(want, sizeof want, "--model %s: no such directory", dir);
    int said = 0;
    for (int i = 0; i < 100 && !said; i++) {
        usleep(100000);
        said = file_has(err, want) && file_has(err, "exited with status 78: it refused its configuration");
    }
    rename(moved, dir);
    cr_assert(said, "no \"%s\" and no meaning of status 78 in up's log %s", want, err);
    cr_assert(!file_has(err, "tokenizer.json: cannot open"), "the missing directory blamed on a file in %s", err);
    cr_assert_eq(waitpid(up_pid, NULL, WNOHANG), 0, "pdmoe up exited");
}

/* Rank 1 of a decode EP group SIGKILLed: rank 0 names it, and up's line, which names the group by
 * its rank 0, says mpirun's status 137 is some rank's signal (it read as rank 0 killed). */
Test(supervise, a_killed_rank_of_an_ep_group_is_not_read_as_its_rank_0)
{
    const int port = test_ports(), D = port + 2;
    const char *flags[] = {"--decode-ep", "2", NULL};
    start_up(port, flags);
    pid_t r[2];
    rank_pids(D, r);
    kill(r[1], SIGKILL);
    char err[128], want[96];
    snprintf(err, sizeof err, "%s/up.err", logs);
    snprintf(want, sizeof want, "EP rank 1 (pid %d on ", (int)r[1]);
    int said = 0;
    for (int i = 0; i < 150 && !said; i++) {
        usleep(100000);
        said = file_has(err, "a rank of the group was killed by signal 9 (Killed); rank 0 names it above");
    }
    cr_assert(said, "up's line does not say a rank was killed: %s", err);
    cr_assert(file_has(err, want), "rank 0 did not name rank 1 (\"%s\") in %s", want, err);
    cr_assert_eq(waitpid(up_pid, NULL, WNOHANG), 0, "pdmoe up exited");
}

/* Fault injection with real processes on loopback: a prefill instance killed (SIGKILL) while it
 * holds requests, and a decode instance killed while prefill instances hold leases for it.
 * Every client gets either a whole answer or an error (never a hang, never an empty 200); the
 * surviving instances get every KV block back; the proxy keeps serving. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/genmodel.h"
#include "../tmpmodel.h"
#include "proxy/proxy.h"
#include "core/timing.h"
#include "util.h"

static char dir[64], logs[64];
static pid_t pids[5];
static int n_pids;
static struct pd_proxy *X;
static pthread_t tx;

static void setup(void)
{
    tmp_model("v4-tiny", 17, dir, sizeof dir);
    snprintf(logs, sizeof logs, "/tmp/pdmoe-fault-XXXXXX");
    cr_assert_not_null(mkdtemp(logs));
}

static void teardown(void)
{
    proxy_shutdown(&X, tx);
    for (int i = 0; i < n_pids; i++)
        if (pids[i] > 0) {
            kill(pids[i], SIGKILL);
            waitpid(pids[i], NULL, 0);
        }
    rm_flat_dir(logs);
    rm_model(dir);
}

TestSuite(fault, .init = setup, .fini = teardown, .timeout = 180);

/* Starts `pdmoe serve` with the given role and KV config, returns its HTTP port (read from the
 * line it prints once it listens). */
static int spawn_model(const char *model, const char *context, const char *kv_config, pid_t *pid)
{
    const char *bin = pdmoe_bin();
    char log[128];
    snprintf(log, sizeof log, "%s/serve-%d.log", logs, n_pids);
    pid_t p = fork_pdmoe();
    if (p == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);   /* a test killed by its timeout leaves nothing behind */
        freopen(log, "w", stderr);
        execl(bin, bin, "serve", "--model", model, "--port", "0", "--threads", "1", "--max-num-seqs", "8",
              "--max-model-len", context, "--max-num-batched-tokens", context, "--kv-transfer-config", kv_config,
              (char *)NULL);
        _exit(127);
    }
    *pid = p;
    pids[n_pids++] = p;
    for (int i = 0; i < 300; i++) {
        FILE *f = fopen(log, "r");
        char line[512];
        while (f && fgets(line, sizeof line, f)) {
            char *at = strstr(line, "http://127.0.0.1:");
            if (at) {
                fclose(f);
                return atoi(at + strlen("http://127.0.0.1:"));
            }
        }
        if (f)
            fclose(f);
        usleep(50000);
    }
    cr_assert_fail("pdmoe serve (%s) did not start; see %s", kv_config, log);
    return -1;
}

static int spawn(const char *kv_config, pid_t *pid)
{
    return spawn_model(dir, "512", kv_config, pid);
}

static const char *serve_logs(void);

static void start_proxy_n(const int *prefill, int np, const int *decode, int nd)
{
    static char hp[4][32];
    struct pd_proxy_opts o = {.port = 0, .n_prefill = np, .n_decode = nd};
    for (int i = 0; i < np + nd; i++) {
        snprintf(hp[i], sizeof hp[i], "127.0.0.1:%d", i < np ? prefill[i] : decode[i - np]);
        if (i < np)
            o.prefill[i] = hp[i];
        else
            o.decode[i - np] = hp[i];
    }
    pd_err e = {0};
    cr_assert_eq(pd_proxy_create(&o, &X, &e), 0, "%s", e.msg);
    pthread_create(&tx, NULL, run_proxy, X);
    /* until its first /health checks have answered, the proxy sends requests to an instance only
     * while none of its role is up: a test's load would go to whichever answered first */
    for (int i = 0; i < np + nd; i++) {
        const char *role = i < np ? "prefill" : "decode";
        int up = 0;
        for (int k = 0; k < 1000 && !(up = proxy_instance_metric(pd_proxy_port(X), "up", role, hp[i]) == 1); k++)
            usleep(10000);
        cr_assert(up, "the proxy never saw %s up%s", hp[i], serve_logs());
    }
}

static void start_proxy(const int *prefill, int np, int decode)
{
    start_proxy_n(prefill, np, &decode, 1);
}

/* n streaming clients through the proxy, in the background; each writes its body and its status
 * to logs/c<i>.{out,code}. */
static FILE *load(int n, int max_tokens)
{
    char cmd[1024];
    /* ~300-token prompts: the prefill instances hold them long enough to be killed with work */
    snprintf(cmd, sizeof cmd,
             "p=$(printf 'the tide comes in and the tide goes out %%.0s' $(seq 30)); "
             "seq %d | xargs -P %d -I{} sh -c \"curl -s -N --max-time 60 -o %s/c{}.out -w '%%{http_code}' "
             "http://127.0.0.1:%d/v1/completions -d '{\\\"prompt\\\":\\\"{} '\\\"\\$p\\\"'\\\",\\\"max_tokens\\\":%d,"
             "\\\"stream\\\":true,\\\"seed\\\":{}}' > %s/c{}.code\"",
             n, n, logs, pd_proxy_port(X), max_tokens, logs);
    return popen(cmd, "r");
}

/* The first error a client got in this test, for the message of an assertion on the count of
 * whole streams. */
static char first_error[512];

/* Each client's outcome: 1 a whole stream ([DONE], no error event), 0 an error (a 5xx or an
 * error event in the stream); the test fails on anything else (an empty 200, a hang). */
static int outcome(int i)
{
    static char body[1 << 16];
    int status = client_answer(logs, i, body, sizeof body);
    cr_assert(status == 200 || status >= 500, "client %d: HTTP %d: %s", i, status, body);
    if (status >= 500)
        cr_assert(strstr(body, "\"error\""), "client %d: %d without a JSON error: %s", i, status, body);
    if (status >= 500 || strstr(body, "\"error\"")) {
        if (!first_error[0])
            snprintf(first_error, sizeof first_error, "client %d, HTTP %d: %.400s", i, status, body);
        return 0;
    }
    cr_assert(strstr(body, "data: [DONE]") && strstr(body, "\"finish_reason\":\""),
              "client %d: a 200 that is not a whole stream: %s", i, body);
    return 1;
}

/* Kills spawned process `slot` while the load l runs, waits for its n clients, returns how many
 * got a whole stream. */
static int kill_then_finish(int slot, FILE *l, int n)
{
    kill(pids[slot], SIGKILL);
    waitpid(pids[slot], NULL, 0);
    pids[slot] = -1;
    char sink[64];
    while (fgets(sink, sizeof sink, l))
        ;
    pclose(l);
    int whole = 0;
    for (int i = 1; i <= n; i++)
        whole += outcome(i);
    return whole;
}

/* The last lines of each spawned server's log (up to 600 bytes each), for a failure's message, each
 * with how its process stands: one that died by itself (a crash, an exit) says so, as that is the
 * failure's likeliest cause. */
static const char *serve_logs(void)
{
    static char all[4096];
    size_t at = 0;
    all[0] = 0;
    for (int i = 0; i < n_pids && at < sizeof all - 1; i++) {
        char path[128], tail[601], how[64] = ", killed by the test";
        snprintf(path, sizeof path, "%s/serve-%d.log", logs, i);
        file_tail(path, tail, sizeof tail);
        int st;
        if (pids[i] > 0 && waitpid(pids[i], &st, WNOHANG) == pids[i]) {
            if (WIFSIGNALED(st))
                snprintf(how, sizeof how, ", died of signal %d", WTERMSIG(st));
            else
                snprintf(how, sizeof how, ", exited with %d", WEXITSTATUS(st));
            pids[i] = -1;
        } else if (pids[i] > 0) {
            snprintf(how, sizeof how, ", running");
        }
        at += (size_t)snprintf(all + at, sizeof all - at, "\n-- serve-%d.log (%s):\n%s", i, how + 2, tail);
    }
    return all;
}

static int metric(int port, const char *name)
{
    return metric_port(port, name);
}

/* A gauge of the proxy's for its instance of `role` on local `port` (pdmoe_proxy_instance_<name>). */
static int at_proxy(const char *name, const char *role, int port)
{
    char where[32];
    snprintf(where, sizeof where, "127.0.0.1:%d", port);
    return (int)proxy_instance_metric(pd_proxy_port(X), name, role, where);
}

Test(fault, a_prefill_instance_killed_under_load)
{
    pid_t p1, p2, d;
    int ports[2];
    ports[0] = spawn("{\"kv_role\":\"kv_producer\",\"engine_id\":\"p1\"}", &p1);
    ports[1] = spawn("{\"kv_role\":\"kv_producer\",\"engine_id\":\"p2\"}", &p2);
    int dport = spawn("{\"kv_role\":\"kv_consumer\",\"kv_timeout_ms\":2000}", &d);
    start_proxy(ports, 2, dport);
    /* p1 is frozen (SIGSTOP) before the load and killed once the proxy has sent it a request: every
     * request routed to it is lost with it. Killing it as soon as its metrics counted a request let a
     * loaded machine run p1's whole share between two polls, and then nothing was lost (a request
     * p1 answered before dying leaves nothing to retry, and the test saw no retry). Its KV leased to
     * d and lost with it (a recompute on d) is test_pd's. */
    kill(p1, SIGSTOP);
    FILE *l = load(24, 8);
    int held = 0;
    for (int i = 0; i < 1000 && !(held = at_proxy("load", "prefill", ports[0]) > 0); i++)
        usleep(5000);
    cr_assert(held, "the proxy never sent p1 a request%s", serve_logs());
    int whole = kill_then_finish(0, l, 24);
    /* the requests p1 held were retried on p2 */
    cr_assert_eq(whole, 24, "%d of 24 streams whole; the first error: %s%s", whole, first_error, serve_logs());
    cr_assert_gt(metric(pd_proxy_port(X), "pdmoe_proxy_retries_total"), 0);
    /* survivors: every block back, no lease left */
    for (int i = 0; i < 100 && metric(ports[1], "pdmoe_kv_leases") > 0; i++)
        usleep(20000);
    cr_assert_eq(metric(ports[1], "pdmoe_kv_leases"), 0);
    cr_assert_eq(metric(ports[1], "pdmoe_kv_blocks_free"), metric(ports[1], "pdmoe_kv_blocks_capacity"));
    cr_assert_eq(metric(dport, "pdmoe_kv_blocks_free"), metric(dport, "pdmoe_kv_blocks_capacity"));
    /* and the proxy still serves */
    char out[8192];
    cr_assert_eq(curl_port(pd_proxy_port(X), "/v1/completions", "{\"prompt\":\"after\",\"max_tokens\":4}", NULL, out,
                           sizeof out), 200, "%s", out);
}

Test(fault, a_decode_instance_killed_leaves_leases_that_expire)
{
    pid_t p, d;
    int pport = spawn("{\"kv_role\":\"kv_producer\",\"kv_lease_ms\":1000}", &p);
    int dport = spawn("{\"kv_role\":\"kv_consumer\"}", &d);
    start_proxy(&pport, 1, dport);
    /* a prefill asked for a decode instance that will never pull: the lease is held */
    char out[8192];
    cr_assert_eq(curl_port(pport, "/v1/completions",
                           "{\"prompt\":\"held\",\"max_tokens\":4,\"kv_transfer_params\":{\"do_remote_decode\":true}}",
                           NULL, out, sizeof out), 200, "%s", out);
    cr_assert_eq(metric(pport, "pdmoe_kv_leases"), 1);
    cr_assert_lt(metric(pport, "pdmoe_kv_blocks_free"), metric(pport, "pdmoe_kv_blocks_capacity"));
    /* the decode instance dies under load */
    FILE *l = load(8, 200);
    for (int i = 0; i < 500 && metric(dport, "pdmoe_num_requests_running") == 0; i++)
        usleep(2000);
    int whole = kill_then_finish(1, l, 8);
    cr_assert_lt(whole, 8, "the decode instance died, yet every stream was whole");
    /* the prefill instance's leases expire: every block comes back */
    for (int i = 0; i < 200 && metric(pport, "pdmoe_kv_leases") > 0; i++)
        usleep(20000);
    cr_assert_eq(metric(pport, "pdmoe_kv_leases"), 0);
    cr_assert_eq(metric(pport, "pdmoe_kv_blocks_free"), metric(pport, "pdmoe_kv_blocks_capacity"));
    /* with no decode instance left, the proxy answers with an error, not a hang */
    int code = curl_port(pd_proxy_port(X), "/v1/completions", "{\"prompt\":\"after\",\"max_tokens\":4}", "--max-time 30",
                         out, sizeof out);
    cr_assert(code >= 500 && strstr(out, "\"error\""), "HTTP %d: %s", code, out);
}

/* A prefill whose client left during its step (a proxy's client gave up) was leased anyway: nobody
 * learns its key, yet its blocks and sequence were held for kv_lease_ms and then counted as an
 * expired hand-off. Now it is not leased; the prefill of v4-flash-mini's 2,000 tokens in one step
 * takes about a second at one thread, the client leaves after 0.3 s. */
Test(fault, a_prefill_whose_client_left_holds_no_lease)
{
    if (access("models/mini/model.safetensors", R_OK) != 0)
        cr_skip_test("models/mini not generated");
    pid_t p;
    int pport = spawn_model("models/mini", "4096", "{\"kv_role\":\"kv_producer\",\"kv_lease_ms\":60000}", &p);
    static char body[16384];
    int at = snprintf(body, sizeof body, "{\"max_tokens\":4,\"kv_transfer_params\":{\"do_remote_decode\":true},"
                                         "\"prompt\":[");
    for (int i = 0; i < 2000; i++)
        at += snprintf(body + at, sizeof body - (size_t)at, "%s%d", i ? "," : "", 100 + i % 3000);
    snprintf(body + at, sizeof body - (size_t)at, "]}");
    char out[8192];
    int code = curl_port(pport, "/v1/completions", body, "--max-time 0.3", out, sizeof out);
    cr_assert_neq(code, 200, "the prefill answered within 0.3 s: %s", out);
    /* (the step takes about a second here, much longer under the sanitizers) */
    for (int i = 0; i < 1500 && metric(pport, "pdmoe_num_requests_running") > 0; i++)
        usleep(100000);
    cr_assert_eq(metric(pport, "pdmoe_num_requests_running"), 0);
    cr_assert_eq(metric(pport, "pdmoe_requests_cancelled_total"), 1);
    cr_assert_eq(metric(pport, "pdmoe_kv_leases"), 0, "a lease for a request whose client left");
    /* every block back, free or kept by the prefix cache */
    cr_assert_eq(metric(pport, "pdmoe_kv_blocks_free") + metric(pport, "pdmoe_prefix_cache_blocks"),
                 metric(pport, "pdmoe_kv_blocks_capacity"));
}

/* Two decode instances, one dead: the proxy sends the requests that meet it to the other one
 * (nothing had reached their clients yet), then stops sending it any (its /health fails). */
Test(fault, a_dead_decode_instance_is_routed_around)
{
    pid_t p, d1, d2;
    int pport = spawn("{\"kv_role\":\"kv_producer\",\"engine_id\":\"p\"}", &p);
    int dports[2];
    dports[0] = spawn("{\"kv_role\":\"kv_consumer\",\"engine_id\":\"d1\"}", &d1);
    dports[1] = spawn("{\"kv_role\":\"kv_consumer\",\"engine_id\":\"d2\"}", &d2);
    start_proxy_n(&pport, 1, dports, 2);
    kill(d2, SIGKILL);
    waitpid(d2, NULL, 0);
    pids[2] = -1;
    FILE *l = load(24, 8);
    char sink[64];
    while (fgets(sink, sizeof sink, l))
        ;
    pclose(l);
    int whole = 0;
    for (int i = 1; i <= 24; i++)
        whole += outcome(i);
    cr_assert_eq(whole, 24, "%d of 24 streams whole with one of two decode instances dead; the first error: %s%s",
                 whole, first_error, serve_logs());
    /* the prefill's leases were all pulled (by the live decode instance), every block is back */
    for (int i = 0; i < 100 && metric(pport, "pdmoe_kv_leases") > 0; i++)
        usleep(20000);
    cr_assert_eq(metric(pport, "pdmoe_kv_leases"), 0);
    cr_assert_eq(metric(dports[0], "pdmoe_kv_blocks_free"), metric(dports[0], "pdmoe_kv_blocks_capacity"));
    cr_assert_eq(at_proxy("up", "decode", dports[1]), 0);
    cr_assert_eq(at_proxy("up", "decode", dports[0]), 1);
}

/* A prefill instance that stops answering (SIGSTOP: a host that hangs) while a decode instance
 * pulls from it: the pull waits for its timeout and the prompt is then recomputed, but the decode
 * instance's other requests go on meanwhile (the pull held its scheduler, every stream of the
 * instance, for the whole timeout). */
Test(fault, a_hung_producer_stalls_its_pull_not_the_decode_instance)
{
    pid_t pp, dp;
    int p = spawn("{\"kv_role\":\"kv_producer\",\"kv_port\":0,\"engine_id\":\"p0\"}", &pp);
    int d = spawn("{\"kv_role\":\"kv_consumer\",\"engine_id\":\"d0\",\"kv_timeout_ms\":4000}", &dp);
    char out[8192], body[2048];
    cr_assert_eq(curl_port(p, "/v1/completions", "{\"prompt\":\"one two three four\",\"max_tokens\":1,"
                           "\"kv_transfer_params\":{\"do_remote_decode\":true}}", NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out);
    char *kv = json_dumps(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "kv_transfer_params"),
                          JSON_COMPACT);
    json_decref(j);
    cr_assert_eq(kill(pp, SIGSTOP), 0);
    snprintf(body, sizeof body, "curl -s -o /dev/null -w '%%{http_code} %%{time_total}' --max-time 60 "
             "http://127.0.0.1:%d/v1/completions -d '{\"prompt\":\"one two three four\",\"max_tokens\":4,"
             "\"kv_transfer_params\":%s}'", d, kv);
    free(kv);
    FILE *pulling = popen(body, "r");
    usleep(500000);   /* the pull has started and waits on the stopped producer */
    double t0 = pd_now_s();
    cr_assert_eq(curl_port(d, "/v1/completions", "{\"prompt\":\"meanwhile\",\"max_tokens\":8}", "--max-time 30", out,
                           sizeof out), 200, "%s", out);
    double took = pd_now_s() - t0;
    char res[64] = "";
    cr_assert_not_null(fgets(res, sizeof res, pulling));
    pclose(pulling);
    kill(pp, SIGCONT);
    cr_assert_lt(took, 2.0, "a request beside the stalled pull took %.2f s", took);
    cr_assert(!strncmp(res, "200 ", 4), "the decode whose pull timed out: %s", res);
    cr_assert_geq(atof(res + 4), 3.5, "the pull ended before its timeout: %s", res);
    cr_assert_eq(metric(d, "pdmoe_kv_recomputes_total"), 1);
    /* a client that leaves while its pull waits: the pull is aborted, the request counted
     * cancelled, and its blocks come back once no get can write them */
    cr_assert_eq(curl_port(p, "/v1/completions", "{\"prompt\":\"five six seven\",\"max_tokens\":1,"
                           "\"kv_transfer_params\":{\"do_remote_decode\":true}}", NULL, out, sizeof out), 200, "%s", out);
    j = parse(out);
    kv = json_dumps(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "kv_transfer_params"),
                    JSON_COMPACT);
    json_decref(j);
    cr_assert_eq(kill(pp, SIGSTOP), 0);
    snprintf(body, sizeof body, "{\"prompt\":\"five six seven\",\"max_tokens\":4,\"kv_transfer_params\":%s}", kv);
    free(kv);
    curl_port(d, "/v1/completions", body, "--max-time 1", out, sizeof out);
    for (int i = 0; i < 100 && metric(d, "pdmoe_requests_cancelled_total") < 1; i++)
        usleep(50000);
    kill(pp, SIGCONT);
    cr_assert_eq(metric(d, "pdmoe_requests_cancelled_total"), 1);
    cr_assert_eq(metric_key(d, "pdmoe_errors_total{kind=\"kv_transfer\"}"), 1, "the client's leaving counted as a "
                 "transfer failure (the timed-out pull is the one)");
    for (int i = 0; i < 100 && metric(d, "pdmoe_kv_blocks_free") != metric(d, "pdmoe_kv_blocks_capacity"); i++)
        usleep(50000);
    cr_assert_eq(metric(d, "pdmoe_kv_blocks_free"), metric(d, "pdmoe_kv_blocks_capacity"));
    cr_assert_eq(curl_port(d, "/v1/completions", "{\"prompt\":\"after\",\"max_tokens\":4}", NULL, out, sizeof out),
                 200, "%s", out);
}

/* A decode instance stopped for 2.5 s (a pause, a long step) and then resumed: its streams go on
 * to their end. One /health check missing its second once failed every stream in flight on it
 * (an error event and [DONE]) though it came back a moment later; only one silent for 3 s is
 * hung. */
Test(fault, a_decode_instance_paused_a_moment_keeps_its_streams)
{
    pid_t p, d;
    int pport = spawn("{\"kv_role\":\"kv_producer\",\"engine_id\":\"p\"}", &p);
    int dport = spawn("{\"kv_role\":\"kv_consumer\"}", &d);
    start_proxy(&pport, 1, dport);
    /* paused before the requests reach it: their prefill runs, then they wait on it in flight */
    kill(d, SIGSTOP);
    FILE *l = load(3, 8);
    for (int i = 0; i < 2000 && metric(pport, "pdmoe_requests_completed_total") < 3; i++)
        usleep(2000);
    usleep(2500000);   /* past a /health check's 1 s interval and its 1 s timeout */
    kill(d, SIGCONT);
    char sink[64];
    while (fgets(sink, sizeof sink, l))
        ;
    pclose(l);
    for (int i = 1; i <= 3; i++)
        cr_assert_eq(outcome(i), 1, "client %d's stream was failed by a 2.5 s pause", i);
}

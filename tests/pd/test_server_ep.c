/* `pdmoe serve` as an EP group (mpirun -n 2, real processes on loopback): concurrent greedy
 * requests of different lengths give the same tokens as one plain process, the sequences spread
 * over both ranks and every rank's KV pool is full again afterwards; an idle group does not spin;
 * Ctrl-C or SIGTERM on rank 0 ends every rank cleanly; a rank that dies ends the group instead of
 * hanging it or its clients; bad flag combinations are one-line errors naming the flag; between a
 * prefill and a decode EP group the KV goes from the owner rank of one to the owner rank of the
 * other (or is recomputed when that fails) with the tokens of one process and every pool freed;
 * a step of the ranks' wall clock neither stalls nor spins their scheduler. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "engine/genmodel.h"
#include "core/timing.h"
#include "../tmpmodel.h"
#include "sockets.h"
#include "util.h"

static char dir[64], log_path[96], spec_dir[64];   /* spec_dir: a model whose MTP draft agrees, once made */
static pid_t group, single, group2;
static int base_port;
static const char *group_max_len = "512";   /* --max-model-len of the EP groups */

static void setup(void)
{
    tmp_model("v4-tiny", 17, dir, sizeof dir);
    snprintf(log_path, sizeof log_path, "%s/serve.log", dir);
    mpi_test_env();
    /* ports base..base+4 (kv ports base+3 + rank), a block no other test holds (util.h) */
    base_port = test_ports();
}

static void teardown(void)
{
    int st;
    pid_t *ps[3] = {&group, &single, &group2};
    for (int i = 0; i < 3; i++)
        if (*ps[i] > 0) {
            kill(-*ps[i], SIGTERM);
            if (!exited_within(*ps[i], 15, &st)) {
                kill(-*ps[i], SIGKILL);
                waitpid(*ps[i], &st, 0);
            }
            *ps[i] = 0;
        }
    rm_model(dir);
    if (spec_dir[0])
        rm_model(spec_dir);
    spec_dir[0] = 0;
}

TestSuite(server_ep, .init = setup, .fini = teardown, .timeout = 240);

/* Starts argv in its own process group (a terminal's Ctrl-C reaches the whole group), output to
 * the log; with `port`, waits until /health answers. */
static pid_t launch(char *const *argv, int port)
{
    pid_t pid = fork_pdmoe();
    if (pid == 0) {
        setpgid(0, 0);
        if (!freopen(log_path, "w", stderr) || !freopen("/dev/null", "w", stdout))
            _exit(126);
        execvp(argv[0], argv);
        _exit(127);
    }
    setpgid(pid, pid);
    char out[256];
    for (int i = 0; port && i < 600; i++) {
        if (curl_port(port, "/health", NULL, NULL, out, sizeof out) == 200)
            return pid;
        int st;
        cr_assert_neq(waitpid(pid, &st, WNOHANG), pid, "the server exited before it was healthy (status %d)", st);
        usleep(100000);
    }
    cr_assert(!port, "the server on port %d did not become healthy", port);
    return pid;
}

/* An EP group of `ranks` on `port`, `seqs` sequences per rank; kv: a --kv-transfer-config or
 * NULL (colocated). With group_clock_shift (seconds) its ranks run under build/libclockshift.so:
 * their wall clock that far off, as after a step of it (tests/preload/clockshift.c). */
static const char *group_clock_shift;
static pid_t start_group_of(int port, int ranks, int seqs, const char *kv)
{
    char sp[16], sn[16], ss[16], preload[PATH_MAX + 16], shift[64], asan[2048];
    snprintf(sp, sizeof sp, "%d", port);
    snprintf(sn, sizeof sn, "%d", ranks);
    snprintf(ss, sizeof ss, "%d", seqs);
    char *argv[40] = {"mpirun", "-n", sn, "--oversubscribe"};
    int n = 4;
    if (group_clock_shift) {
        /* the shim beside the binary; under ASan it comes before ASan's runtime, which then must
         * not insist on being first */
        char abs[PATH_MAX];
        test_shim("libclockshift.so", abs);
        snprintf(preload, sizeof preload, "LD_PRELOAD=%s", abs);
        snprintf(shift, sizeof shift, "PDMOE_TEST_CLOCK_SHIFT_S=%s", group_clock_shift);
        /* (with the log_path of child_env's: a rank's report reaches the test) */
        child_asan_options(asan, sizeof asan, "verify_asan_link_order=0");
        char *x[] = {"-x", preload, "-x", shift, "-x", asan};
        for (int i = 0; i < 6; i++)
            argv[n++] = x[i];
    }
    char *rest[] = {(char *)pdmoe_bin(), "serve", "--model", dir, "--enable-expert-parallel", "--data-parallel-size", sn,
                    "--port", sp, "--threads", "1", "--max-num-seqs", ss, "--max-model-len", (char *)group_max_len,
                    "--served-model-name", "tiny", kv ? "--kv-transfer-config" : NULL, (char *)kv, NULL};
    for (size_t i = 0; i < sizeof rest / sizeof *rest; i++)
        argv[n++] = rest[i];
    return launch(argv, port);
}

static pid_t start_group_kv(int port, const char *kv)
{
    return start_group_of(port, 2, 4, kv);
}

static pid_t start_group(int port)
{
    return start_group_kv(port, NULL);
}

static pid_t start_single(int port)
{
    char sp[16];
    snprintf(sp, sizeof sp, "%d", port);
    char *argv[] = {(char *)pdmoe_bin(), "serve", "--model", dir, "--port", sp, "--threads", "1", "--max-num-seqs", "8",
                    "--max-model-len", "512", "--served-model-name", "tiny", NULL};
    return launch(argv, port);
}

#define N_REQ 6

struct call {
    int port, code;
    char body[512];
    char out[1 << 14];
};

static void *call_thread(void *arg)
{
    struct call *c = arg;
    c->code = curl_port(c->port, "/v1/completions", c->body, "--max-time 120", c->out, sizeof c->out);
    return NULL;
}

/* The same N_REQ greedy requests, all at once, to the server on `port`: their token ids. */
static void run_requests(int port, char *ids[N_REQ])
{
    static const char *const prompts[N_REQ] = {
        "Hello", "The sea froze over and the children skated until the sun went down", "x",
        "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16", "def add(a, b):", "Once upon a time, in a small town"};
    static const int max_tokens[N_REQ] = {24, 8, 40, 16, 3, 30};
    static struct call c[N_REQ];
    pthread_t t[N_REQ];
    for (int i = 0; i < N_REQ; i++) {
        c[i].port = port;
        snprintf(c[i].body, sizeof c[i].body,
                 "{\"model\":\"tiny\",\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,"
                 "\"return_token_ids\":true}", prompts[i], max_tokens[i]);
        pthread_create(&t[i], NULL, call_thread, &c[i]);
    }
    for (int i = 0; i < N_REQ; i++)
        pthread_join(t[i], NULL);
    for (int i = 0; i < N_REQ; i++) {
        cr_assert_eq(c[i].code, 200, "request %d on port %d: %d %s", i, port, c[i].code, c[i].out);
        json_t *j = parse(c[i].out);
        json_t *a = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids");
        cr_assert_eq((int)json_array_size(a), max_tokens[i], "request %d: %s", i, c[i].out);
        ids[i] = json_dumps(a, JSON_COMPACT);
        json_decref(j);
    }
}

Test(server_ep, two_ranks_give_the_tokens_of_one_process_and_free_every_block)
{
    int pg = base_port, ps = base_port + 1;
    single = start_single(ps);
    group = start_group(pg);
    char *want[N_REQ], *got[N_REQ];
    run_requests(ps, want);
    run_requests(pg, got);
    for (int i = 0; i < N_REQ; i++) {
        cr_assert_str_eq(got[i], want[i], "request %d: EP group %s, one process %s", i, got[i], want[i]);
        free(want[i]);
        free(got[i]);
    }
    /* the tokens each expert ran, summed over the ranks, are the one process's */
    char a[1 << 16], b[1 << 16];
    cr_assert_eq(curl_port(pg, "/expert_stats", NULL, NULL, a, sizeof a), 200, "%s", a);
    cr_assert_eq(curl_port(ps, "/expert_stats", NULL, NULL, b, sizeof b), 200, "%s", b);
    json_t *ja = parse(a), *jb = parse(b);
    cr_assert_eq(json_integer_value(json_object_get(ja, "ranks")), 2);
    char *ra = json_dumps(json_object_get(ja, "tokens_per_expert"), JSON_COMPACT),
         *rb = json_dumps(json_object_get(jb, "tokens_per_expert"), JSON_COMPACT);
    cr_assert_str_eq(ra, rb, "EP group %s, one process %s", ra, rb);
    cr_assert(strstr(ra, "[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0]") == NULL, "a layer without tokens: %s", ra);
    free(ra);
    free(rb);
    json_decref(ja);
    json_decref(jb);
    /* both ranks held sequences; every rank's pool is full again, the sum too */
    cr_assert_gt(labelled(pg, "pdmoe_rank_requests_total", 0), 0);
    cr_assert_gt(labelled(pg, "pdmoe_rank_requests_total", 1), 0);
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(labelled(pg, "pdmoe_rank_kv_blocks_free", k), labelled(pg, "pdmoe_rank_kv_blocks_capacity", k),
                     "rank %d", k);
        cr_assert_eq(labelled(pg, "pdmoe_rank_num_requests_running", k), 0);
    }
    cr_assert_eq(metric_port(pg, "pdmoe_kv_blocks_free"), metric_port(pg, "pdmoe_kv_blocks_capacity"));
    cr_assert_eq(metric_port(pg, "pdmoe_kv_slots_free"), 8);
    cr_assert_eq(metric_port(pg, "pdmoe_requests_completed_total"), N_REQ);
    /* idle: the ranks sleep (each well under 10% of a core over 2 s) */
    pid_t r[2];
    rank_pids(pg, r);
    double c0[2] = {cpu_seconds(r[0]), cpu_seconds(r[1])};
    sleep(2);
    for (int k = 0; k < 2; k++) {
        double used = cpu_seconds(r[k]) - c0[k];
        cr_assert_lt(used, 0.2, "idle rank %d used %.2f s of CPU in 2 s", k, used);
    }
    /* Ctrl-C in a terminal reaches mpirun and every rank: the group ends, nothing is left */
    kill(-group, SIGINT);
    int st;
    cr_assert(exited_within(group, 30, &st), "the group did not end within 30 s of Ctrl-C");
    mpirun_signalled_cleanly(group, st, "mpirun of pdmoe serve's EP group at Ctrl-C");
    group = 0;
    cr_assert_eq(processes_on(pg), 0);
}

Test(server_ep, four_ranks_of_one_sequence_each_queue_the_rest_and_give_the_same_tokens)
{
    /* 6 requests, 4 ranks that each hold one sequence: two wait for a rank to free its slot */
    int pg = base_port, ps = base_port + 1;
    single = start_single(ps);
    group = start_group_of(pg, 4, 1, NULL);
    char *want[N_REQ], *got[N_REQ];
    run_requests(ps, want);
    run_requests(pg, got);
    for (int i = 0; i < N_REQ; i++) {
        cr_assert_str_eq(got[i], want[i], "request %d: EP group of 4 %s, one process %s", i, got[i], want[i]);
        free(want[i]);
        free(got[i]);
    }
    int total = 0;
    for (int k = 0; k < 4; k++) {
        int n = labelled(pg, "pdmoe_rank_requests_total", k);
        cr_assert_gt(n, 0, "rank %d held no sequence", k);
        total += n;
        cr_assert_eq(labelled(pg, "pdmoe_rank_kv_blocks_free", k), labelled(pg, "pdmoe_rank_kv_blocks_capacity", k),
                     "rank %d", k);
    }
    cr_assert_eq(total, N_REQ);
    cr_assert_eq(metric_port(pg, "pdmoe_kv_slots_free"), 4);
}

Test(server_ep, a_client_that_leaves_frees_its_kv_on_the_owner_rank)
{
    int pg = base_port + 2;
    group_max_len = "16384";
    tmp_model_positions(dir, 16384);
    group = start_group(pg);
    char out[8192];
    /* two long generations, one per rank; both clients give up after 0.3 s */
    char cmd[512];
    snprintf(cmd, sizeof cmd, "for i in 1 2; do curl -s -o /dev/null --max-time 0.3 http://127.0.0.1:%d/v1/completions "
             "-d '{\"prompt\":\"x\",\"max_tokens\":16000,\"stream\":true,\"ignore_eos\":true}' & done; wait", pg);
    cr_assert_eq(system(cmd), 0);
    for (int i = 0; i < 200 && metric_port(pg, "pdmoe_requests_cancelled_total") < 2; i++)
        usleep(20000);
    cr_assert_eq(metric_port(pg, "pdmoe_requests_cancelled_total"), 2);
    cr_assert_eq(labelled(pg, "pdmoe_rank_requests_total", 0), 1);
    cr_assert_eq(labelled(pg, "pdmoe_rank_requests_total", 1), 1);
    for (int i = 0; i < 100 && metric_port(pg, "pdmoe_kv_blocks_free") < metric_port(pg, "pdmoe_kv_blocks_capacity"); i++)
        usleep(20000);
    for (int k = 0; k < 2; k++)
        cr_assert_eq(labelled(pg, "pdmoe_rank_kv_blocks_free", k), labelled(pg, "pdmoe_rank_kv_blocks_capacity", k),
                     "rank %d", k);
    /* and the group still serves */
    cr_assert_eq(curl_port(pg, "/v1/completions", "{\"prompt\":\"hi\",\"max_tokens\":4}", NULL, out, sizeof out), 200,
                 "%s", out);
}

/* A producer group stopped while its owner rank still holds a request's KV under a lease: every
 * rank ends its engine and exits 0, nobody waits for the lease's 60 s (rank 0 frees the request it
 * kept for the lease: LeakSanitizer, which the ranks cannot run under Open MPI, showed it
 * leaking when run by hand). */
Test(server_ep, sigterm_on_rank_0_ends_every_rank_cleanly)
{
    int pg = base_port + 2;
    char kvp[160];
    snprintf(kvp, sizeof kvp, "{\"kv_role\":\"kv_producer\",\"kv_port\":%d,\"engine_id\":\"p\",\"kv_lease_ms\":60000}",
             base_port + 3);
    group = start_group_kv(pg, kvp);
    char out[8192];
    cr_assert_eq(curl_port(pg, "/v1/completions", "{\"prompt\":\"hi\",\"max_tokens\":4}", NULL, out, sizeof out), 200,
                 "%s", out);
    cr_assert_eq(curl_port(pg, "/v1/completions", "{\"prompt\":\"hi\",\"max_tokens\":1,"
                           "\"kv_transfer_params\":{\"do_remote_decode\":true}}", NULL, out, sizeof out), 200, "%s", out);
    cr_assert_eq(metric_port(pg, "pdmoe_kv_leases"), 1);
    pid_t r[2];
    rank_pids(pg, r);
    kill(r[0], SIGTERM);
    int st;
    cr_assert(exited_within(group, 30, &st), "the group did not end within 30 s of SIGTERM on rank 0");
    child_exited_cleanly(group, st, "mpirun of pdmoe serve's EP group, SIGTERM on rank 0");
    group = 0;
    cr_assert_eq(processes_on(pg), 0);
}

Test(server_ep, a_dead_rank_ends_the_group_and_its_clients)
{
    int pg = base_port + 3;
    group = start_group(pg);
    /* a long generation in flight when rank 1 dies */
    char cmd[512];
    snprintf(cmd, sizeof cmd, "curl -s -N --max-time 100 -o /dev/null -w '%%{http_code}' http://127.0.0.1:%d/v1/completions "
             "-d '{\"prompt\":\"x\",\"max_tokens\":400,\"ignore_eos\":true,\"stream\":true}'", pg);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    FILE *client = popen(cmd, "r");
    for (int i = 0; i < 200 && metric_port(pg, "pdmoe_num_requests_running") < 1; i++)
        usleep(10000);
    pid_t r[2];
    rank_pids(pg, r);
    kill(r[1], SIGKILL);
    int st;
    cr_assert(exited_within(group, 30, &st), "the group hung after rank 1 died");
    group = 0;
    cr_assert(!(WIFEXITED(st) && WEXITSTATUS(st) == 0), "the group exited 0 although rank 1 died");
    pclose(client);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    cr_assert_lt(t1.tv_sec - t0.tv_sec, 60, "the client waited %ld s", (long)(t1.tv_sec - t0.tv_sec));
    cr_assert_eq(processes_on(pg), 0);
    FILE *f = fopen(log_path, "r");
    char log[1 << 15];
    size_t n = fread(log, 1, sizeof log - 1, f);
    log[n] = 0;
    fclose(f);
    cr_assert(strstr(log, "rank 1") || strstr(log, "signal 9"), "no word of the dead rank:\n%s", log);
}

/* A rank killed (SIGKILL) while rank 0's clients wait: mpirun sends rank 0 SIGCONT at once,
 * SIGTERM 1 s later and SIGKILL 1 s after that (odls_base_sigkill_timeout), and the round in
 * flight never returns (Open MPI 4.1 reports no error for a dead peer over shared memory). The
 * clients were cut by that SIGKILL (curl: an empty reply, a stream without an end); now the
 * stream ends with an error event and [DONE], the other request is a 503 naming the dead rank
 * (known from its connection to rank 0 at once: test_server_ep_death.c), and the group still
 * exits non-zero so that `pdmoe up` restarts it. */
Test(server_ep, a_killed_rank_has_rank_0_answer_its_clients_before_the_group_ends)
{
    int pg = base_port + 3;
    group_max_len = "4096";   /* long generations: still running when the rank dies */
    group = start_group(pg);
    group_max_len = "512";
    char cmd[512];
    snprintf(cmd, sizeof cmd, "curl -s -N --max-time 60 http://127.0.0.1:%d/v1/completions -d '{\"prompt\":\"x\","
             "\"max_tokens\":4000,\"ignore_eos\":true,\"stream\":true}'", pg);
    FILE *stream = popen(cmd, "r");
    snprintf(cmd, sizeof cmd, "curl -s --max-time 60 -w '\\nHTTP %%{http_code}' http://127.0.0.1:%d/v1/completions "
             "-d '{\"prompt\":\"y\",\"max_tokens\":4000,\"ignore_eos\":true}'", pg);
    FILE *plain = popen(cmd, "r");
    int running = 0;
    for (int i = 0; i < 500 && (running = metric_port(pg, "pdmoe_num_requests_running")) < 2; i++)
        usleep(5000);
    cr_assert_eq(running, 2, "the two requests did not run together");
    pid_t r[2];
    rank_pids(pg, r);
    kill(r[1], SIGKILL);
    static char streamed[1 << 20], answer[1 << 16];
    size_t n = fread(streamed, 1, sizeof streamed - 1, stream);
    streamed[n] = 0;
    pclose(stream);
    n = fread(answer, 1, sizeof answer - 1, plain);
    answer[n] = 0;
    pclose(plain);
    int st;
    cr_assert(exited_within(group, 30, &st), "the group hung after rank 1 died");
    group = 0;
    cr_assert(!(WIFEXITED(st) && WEXITSTATUS(st) == 0), "the group exited 0 although rank 1 died");
    /* the request: a 503 with a JSON error naming the failure, not an empty reply (HTTP 000) */
    char *code = strstr(answer, "\nHTTP ");
    cr_assert_not_null(code, "%s", answer);
    cr_assert_eq(atoi(code + 6), 503, "%s", answer);
    *code = 0;
    json_t *j = parse(answer);
    const char *msg = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    cr_assert(msg && strstr(msg, "EP rank 1 ") && strstr(msg, "died"), "%s", answer);
    json_decref(j);
    /* the stream: its last events an error naming the failure, then [DONE] */
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
    cr_assert(!strncmp(last, "data: {\"error\"", 14) && strstr(last, "EP rank 1 ") && strstr(last, "died"), "%s", last);
    cr_assert_eq(processes_on(pg), 0);
}

/* Runs a command line; its exit status and stderr. */
static int run(const char *cmd, char *err, size_t cap)
{
    char full[2048];
    snprintf(full, sizeof full, "%s 2>%s >/dev/null", cmd, log_path);
    int st = system(full);
    FILE *f = fopen(log_path, "r");
    size_t n = f ? fread(err, 1, cap - 1, f) : 0;
    err[n] = 0;
    if (f)
        fclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* The first line of `err` that is pdmoe's (mpirun adds its own banners). */
static void expect_one_line(const char *err, const char *flag)
{
    const char *p = strstr(err, "pdmoe serve: ");
    cr_assert_not_null(p, "no pdmoe error in:\n%s", err);
    cr_assert_null(strstr(p + 1, "pdmoe serve: "), "more than one error line:\n%s", err);
    const char *nl = strchr(p, '\n');
    char line[512];
    snprintf(line, sizeof line, "%.*s", nl ? (int)(nl - p) : (int)strlen(p), p);
    cr_assert(strstr(line, flag), "\"%s\" does not name %s", line, flag);
}

Test(server_ep, bad_flag_combinations_are_one_line_errors)
{
    char cmd[1024], err[1 << 14];
    /* without mpirun */
    snprintf(cmd, sizeof cmd, "env -u OMPI_COMM_WORLD_SIZE -u PMIX_RANK -u PMI_RANK %s serve --model %s "
             "--enable-expert-parallel --port %d", pdmoe_bin(), dir, base_port);
    cr_assert_eq(run(cmd, err, sizeof err), 2, "%s", err);
    expect_one_line(err, "--enable-expert-parallel");
    cr_assert(strstr(err, "mpirun"), "%s", err);
    /* the group's size differs from --data-parallel-size */
    snprintf(cmd, sizeof cmd, "timeout 60 mpirun -n 2 --oversubscribe %s serve --model %s --enable-expert-parallel "
             "--data-parallel-size 3 --port %d", pdmoe_bin(), dir, base_port);
    int rc = run(cmd, err, sizeof err);
    cr_assert(rc != 0 && rc != 124, "exit %d: %s", rc, err);
    expect_one_line(err, "--data-parallel-size 3");
    /* data parallelism without expert parallelism */
    snprintf(cmd, sizeof cmd, "%s serve --model %s --data-parallel-size 2 --port %d", pdmoe_bin(), dir, base_port);
    cr_assert_eq(run(cmd, err, sizeof err), 2, "%s", err);
    expect_one_line(err, "--enable-expert-parallel");
}

/* A rank that stops (SIGSTOP, a debugger) held every request of its group for ever while /health
 * said ok: each round waits on every rank. Once the round has made no progress for 10 s the
 * group's /health is a 503 saying so (the proxy routes around it; it said ok for the 5 minutes of
 * the old 300 s round limit), and rank 0's watchdog ends the group once it has made none for
 * --watchdog-timeout, saying so; the client is answered (here the connection ends). */
Test(server_ep, a_stopped_rank_ends_the_group_after_the_watchdog_timeout)
{
    int pg = base_port + 3;
    char sp[16];
    snprintf(sp, sizeof sp, "%d", pg);
    char *argv[] = {"mpirun", "-n", "2", "--oversubscribe", (char *)pdmoe_bin(), "serve", "--model", dir,
                    "--enable-expert-parallel", "--data-parallel-size", "2", "--port", sp, "--threads", "1",
                    "--max-num-seqs", "4", "--max-model-len", (char *)group_max_len, "--served-model-name", "tiny",
                    "--watchdog-timeout", "14", NULL};
    group = launch(argv, pg);
    pid_t r[2];
    rank_pids(pg, r);
    char health[1024];
    cr_assert_eq(curl_port(pg, "/health", NULL, NULL, health, sizeof health), 200, "%s", health);
    cr_assert_eq(kill(r[1], SIGSTOP), 0);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "curl -s --max-time 60 -w ' HTTP %%{http_code}' http://127.0.0.1:%d/v1/completions "
             "-d '{\"prompt\":\"x\",\"max_tokens\":8}'", pg);
    double t0 = pd_now_s();
    FILE *client = popen(cmd, "r");
    int code503 = 0;
    double at503 = 0;
    while (!code503 && pd_now_s() - t0 < 13.5) {
        usleep(250000);
        code503 = curl_port(pg, "/health", NULL, NULL, health, sizeof health) == 503;
        at503 = pd_now_s() - t0;
    }
    char answer[1024] = {0};
    size_t got = fread(answer, 1, sizeof answer - 1, client);
    answer[got] = 0;
    pclose(client);
    const char *code = strstr(answer, " HTTP ") ? strstr(answer, " HTTP ") + 6 : "";
    double waited = pd_now_s() - t0;
    int st;
    int ended = exited_within(group, 30, &st);
    kill(r[1], SIGCONT);
    if (ended)
        group = 0;
    cr_assert(code503, "/health still said ok %.1f s into the stall", at503);
    cr_assert(at503 >= 9.5, "/health failed after %.1f s: before 10 s without progress", at503);
    cr_assert(strstr(health, "no progress for") && strstr(health, "--watchdog-timeout"), "%s", health);
    cr_assert(ended, "the group still runs with rank 1 stopped");
    cr_assert_lt(waited, 40.0, "the client waited %.1f s (HTTP %s)", waited, code);
    /* the client is answered, not cut: a 503 naming why (it got no answer at all) */
    cr_assert_eq(atoi(code), 503, "%s", answer);
    cr_assert(strstr(answer, "the EP group made no progress (a rank stopped or hung)"), "%s", answer);
    FILE *f = fopen(log_path, "r");
    char log[1 << 15];
    size_t n = fread(log, 1, sizeof log - 1, f);
    log[n] = 0;
    fclose(f);
    cr_assert(strstr(log, "has made no progress for 14 s (a rank stopped or hung; --watchdog-timeout)"), "%s", log);
}

/* Ranks that load other files under one path (each host its own copy): other weights, or another
 * architecture, are refused at start by rank and host, where a group of two seeds served text of
 * neither model and one of two shapes died at its first request. */
Test(server_ep, ranks_that_load_other_models_are_refused_at_start)
{
    char other[64], cmd[1024], err[1 << 14];
    tmp_model("v4-tiny", 18, other, sizeof other);   /* the same shapes, other weights */
    snprintf(cmd, sizeof cmd, "timeout 90 mpirun --oversubscribe -n 1 %s serve --model %s --enable-expert-parallel "
             "--data-parallel-size 2 --port %d --max-model-len 256 : -n 1 %s serve --model %s "
             "--enable-expert-parallel --data-parallel-size 2 --port %d --max-model-len 256",
             pdmoe_bin(), dir, base_port, pdmoe_bin(), other, base_port);
    int rc = run(cmd, err, sizeof err);
    rm_model(other);
    cr_assert(rc != 0 && rc != 124, "exit %d: %s", rc, err);
    cr_assert(strstr(err, "rank 1 (on ") && strstr(err, "holds other weights than rank 0"), "%s", err);
}

/* P then D as the proxy does, each an EP group of 2; `broken` sends D to a dead KV port. D's
 * token ids. */
/* A producer group whose every sequence is held by a lease nobody pulls: the next prefill once
 * waited for the lease's 60 s (only a one-process producer gave back the oldest lease unclaimed
 * for a second). Rank 0 now has the owner rank revoke it. */
Test(server_ep, unclaimed_leases_yield_to_a_waiting_request_in_a_group)
{
    int pg = base_port + 2;
    char kvp[160], out[8192], body[256];
    snprintf(kvp, sizeof kvp, "{\"kv_role\":\"kv_producer\",\"kv_port\":%d,\"engine_id\":\"p\",\"kv_lease_ms\":60000}",
             base_port + 3);
    group = start_group_of(pg, 2, 1, kvp);   /* two ranks of one sequence each */
    /* a first request, so that rank 0 has heard the ranks' free sequences */
    cr_assert_eq(curl_port(pg, "/v1/completions", "{\"prompt\":\"hi\",\"max_tokens\":1}", NULL, out, sizeof out), 200,
                 "%s", out);
    cr_assert_gt(metric_port(pg, "pdmoe_kv_slots_free"), 0);
    double t_first = pd_now_s();
    int n = 0;
    for (; n < 8 && metric_port(pg, "pdmoe_kv_slots_free") > 0; n++) {
        snprintf(body, sizeof body, "{\"prompt\":\"lease %d\",\"max_tokens\":1,"
                 "\"kv_transfer_params\":{\"do_remote_decode\":true}}", n);
        cr_assert_eq(curl_port(pg, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    }
    cr_assert_eq(metric_port(pg, "pdmoe_kv_slots_free"), 0, "the leases hold every sequence of both ranks");
    cr_assert_eq(metric_port(pg, "pdmoe_kv_leases"), n);
    /* a lease is no running request, on the group's gauge or on a rank's */
    cr_assert_eq(metric_port(pg, "pdmoe_num_requests_running"), 0);
    for (int k = 0; k < 2; k++)
        cr_assert_eq(labelled(pg, "pdmoe_rank_num_requests_running", k), 0, "rank %d", k);
    double t0 = pd_now_s();
    cr_assert_eq(curl_port(pg, "/v1/completions", "{\"prompt\":\"the third, which waits\",\"max_tokens\":2}", NULL, out,
                           sizeof out), 200, "%s", out);
    double t1 = pd_now_s();
    cr_assert_lt(t1 - t0, 15.0, "the third request waited %.1f s (the lease is 60 s)", t1 - t0);
    cr_assert_geq(t1 - t_first, 1.0, "answered %.2f s after the first lease began (%d leases): before its second", t1 - t_first, n);
    cr_assert_eq(metric_port(pg, "pdmoe_kv_leases_revoked_total"), 1);
    cr_assert_eq(metric_port(pg, "pdmoe_kv_leases_expired_total"), 0, "a revoked lease counted as expired");
    cr_assert_eq(metric_port(pg, "pdmoe_kv_leases"), n - 1, "the other leases are still held");
}

static char *pd_request(int P, int D, const char *prompt, int max_tokens, int broken)
{
    char body[2048], out[1 << 14];
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":1,\"temperature\":0,"
             "\"kv_transfer_params\":{\"do_remote_decode\":true}}", prompt);
    cr_assert_eq(curl_port(P, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out);
    json_t *kv = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "kv_transfer_params");
    cr_assert(json_is_true(json_object_get(kv, "do_remote_prefill")), "%s", out);
    if (broken)
        json_object_set_new(kv, "remote_port", json_integer(1));
    char *kvs = json_dumps(kv, JSON_COMPACT);
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,"
             "\"return_token_ids\":true,\"kv_transfer_params\":%s}", prompt, max_tokens, kvs);
    free(kvs);
    json_decref(j);
    cr_assert_eq(curl_port(D, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    j = parse(out);
    char *ids = json_dumps(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids"), JSON_COMPACT);
    json_decref(j);
    return ids;
}

/* The samples of a per-peer counter for one peer (host:port), summed over the ranks that pulled. */
static int peer_sum(int port, const char *name, const char *peer)
{
    char out[1 << 15], key[160];
    cr_assert_eq(curl_port(port, "/metrics", NULL, NULL, out, sizeof out), 200);
    cr_assert_lt(strlen(out), sizeof out - 1, "/metrics did not fit");
    prom_conventions(out, "an EP group's /metrics");
    snprintf(key, sizeof key, "\n%s{peer=\"%s\",rank=\"", name, peer);
    int sum = 0;
    for (char *p = strstr(out, key); p; p = strstr(p + 1, key))
        sum += atoi(strchr(p, '}') + 2);
    return sum;
}

static char *colocated_ids(int port, const char *prompt, int max_tokens)
{
    char body[1024], out[1 << 14];
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,"
             "\"return_token_ids\":true}", prompt, max_tokens);
    cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out);
    char *ids = json_dumps(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids"), JSON_COMPACT);
    json_decref(j);
    return ids;
}

Test(server_ep, pd_between_ep_groups_pulls_from_the_owner_rank_or_recomputes)
{
    int P = base_port, D = base_port + 1, C = base_port + 2;
    char kvp[160];
    snprintf(kvp, sizeof kvp, "{\"kv_role\":\"kv_producer\",\"kv_port\":%d,\"engine_id\":\"p\",\"kv_lease_ms\":800}",
             base_port + 3);
    group = start_group_kv(P, kvp);
    group2 = start_group_kv(D, "{\"kv_role\":\"kv_consumer\",\"engine_id\":\"d\",\"kv_timeout_ms\":3000}");
    single = start_single(C);
    const char *prompts[] = {"Hello", "The sea froze over and the children skated until the sun went down", "x"};
    for (int i = 0; i < 3; i++) {
        /* the third goes to a dead port: D's owner rank recomputes the prompt from its ids */
        char *a = pd_request(P, D, prompts[i], 10 + 4 * i, i == 2), *b = colocated_ids(C, prompts[i], 10 + 4 * i);
        cr_assert_str_eq(a, b, "prompt %d: PD between EP groups %s, one process %s", i, a, b);
        free(a);
        free(b);
    }
    cr_assert_eq(metric_port(D, "pdmoe_kv_transfers_total"), 3);
    cr_assert_eq(metric_port(D, "pdmoe_kv_recomputes_total"), 1);
    cr_assert_gt(metric_port(D, "pdmoe_kv_transfer_bytes_total"), 0);
    /* by peer: the two good pulls went to the owner ranks' listeners (kv_port + owner), the third
     * to the dead port, and failed there */
    char peer[64];
    int good = 0;
    for (int k = 0; k < 2; k++) {
        snprintf(peer, sizeof peer, "127.0.0.1:%d", base_port + 3 + k);
        good += peer_sum(D, "pdmoe_kv_peer_transfers_total", peer);
        cr_assert_eq(peer_sum(D, "pdmoe_kv_peer_transfer_failures_total", peer), 0);
    }
    cr_assert_eq(good, 2);
    cr_assert_eq(peer_sum(D, "pdmoe_kv_peer_transfers_total", "127.0.0.1:1"), 1);
    cr_assert_eq(peer_sum(D, "pdmoe_kv_peer_transfer_failures_total", "127.0.0.1:1"), 1);
    for (int k = 0; k < 2; k++) {
        cr_assert_gt(labelled(P, "pdmoe_rank_requests_total", k), 0, "prefill rank %d", k);
        cr_assert_gt(labelled(D, "pdmoe_rank_requests_total", k), 0, "decode rank %d", k);
    }
    /* DONE frees two leases at once; the unclaimed one expires after 800 ms */
    for (int i = 0; i < 200 && metric_port(P, "pdmoe_kv_leases") > 0; i++)
        usleep(20000);
    cr_assert_eq(metric_port(P, "pdmoe_kv_leases"), 0);
    cr_assert_eq(metric_port(P, "pdmoe_kv_leases_expired_total"), 1, "the unclaimed lease, told by its owner rank");
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(labelled(P, "pdmoe_rank_kv_blocks_free", k), labelled(P, "pdmoe_rank_kv_blocks_capacity", k),
                     "prefill rank %d", k);
        cr_assert_eq(labelled(D, "pdmoe_rank_kv_blocks_free", k), labelled(D, "pdmoe_rank_kv_blocks_capacity", k),
                     "decode rank %d", k);
    }
}

/* D's answer (status, body in out) to `prompt` with the transfer parameters kv. */
static int decode_with(int D, const char *prompt, json_t *kv, char *out, size_t cap)
{
    char body[2048];
    char *kvs = json_dumps(kv, JSON_COMPACT);
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":10,\"temperature\":0,\"ignore_eos\":true,"
             "\"return_token_ids\":true,\"kv_transfer_params\":%s}", prompt, kvs);
    free(kvs);
    return curl_port(D, "/v1/completions", body, NULL, out, cap);
}

static int prompt_tokens(int port, const char *prompt)
{
    char body[1024], out[4096];
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":1}", prompt);
    cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out);
    int n = (int)json_integer_value(json_object_get(json_object_get(j, "usage"), "prompt_tokens"));
    json_decref(j);
    return n;
}

/* The attack of issue 12 between EP groups (the lease on the producer's owner rank, the pull by
 * the consumer's owner rank): another client's prompt of the same length with the victim's
 * transfer parameters, or a guessed id, gets a 4xx and moves no KV; the victim's own decode gets
 * the tokens of one process; a second pull of the same id is refused; every rank's pool is full
 * again. */
Test(server_ep, another_clients_transfer_params_are_refused_by_the_owner_rank)
{
    int P = base_port, D = base_port + 1, C = base_port + 2;
    char kvp[160];
    snprintf(kvp, sizeof kvp, "{\"kv_role\":\"kv_producer\",\"kv_port\":%d,\"engine_id\":\"p\"}", base_port + 3);
    group = start_group_kv(P, kvp);
    group2 = start_group_kv(D, "{\"kv_role\":\"kv_consumer\",\"engine_id\":\"d\",\"kv_timeout_ms\":3000}");
    single = start_single(C);
    const char *victim = "one two three four five six seven eight", *thief = NULL;
    const char *others[] = {"eight seven six five four three two one", "one two three four five six seven nine",
                            "one two three four five six seven eighs", "two one three four five six seven eight",
                            "one two three four five six seven eigh", "one two three four five six sevens eight"};
    int n_victim = prompt_tokens(C, victim);
    for (size_t i = 0; i < sizeof others / sizeof *others && !thief; i++)
        if (prompt_tokens(C, others[i]) == n_victim)
            thief = others[i];
    cr_assert(thief, "the test needs another prompt of %d tokens", n_victim);
    char body[1024], out[1 << 14];
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":1,\"temperature\":0,"
             "\"kv_transfer_params\":{\"do_remote_decode\":true}}", victim);
    cr_assert_eq(curl_port(P, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out);
    json_t *kv = json_incref(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "kv_transfer_params"));
    json_decref(j);

    int code = decode_with(D, thief, kv, out, sizeof out);
    cr_assert(code >= 400 && code < 500, "the victim's parameters with another prompt: %d %s", code, out);
    json_t *guess = json_deep_copy(kv), *rid = json_object_get(kv, "remote_request_id");
    if (!json_is_string(rid)) {
        json_object_set_new(guess, "remote_request_id", json_integer(json_integer_value(rid)));
    } else {
        char g[64];
        snprintf(g, sizeof g, "%s", json_string_value(rid));
        g[0] = g[0] == '0' ? '1' : '0';
        json_object_set_new(guess, "remote_request_id", json_string(g));
    }
    code = decode_with(D, victim, guess, out, sizeof out);
    cr_assert(code >= 400 && code < 500, "a guessed id: %d %s", code, out);
    json_decref(guess);
    cr_assert_eq(metric_port(D, "pdmoe_kv_transfer_bytes_total"), 0, "a refused pull moved bytes");
    cr_assert_eq(metric_port(P, "pdmoe_kv_leases"), 1, "the lease must stay with its owner");

    cr_assert_eq(decode_with(D, victim, kv, out, sizeof out), 200, "%s", out);
    j = parse(out);
    char *a = json_dumps(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids"), JSON_COMPACT);
    json_decref(j);
    char *b = colocated_ids(C, victim, 10);
    cr_assert_str_eq(a, b, "the victim after the attack: %s, one process %s", a, b);
    free(a);
    free(b);
    cr_assert_gt(metric_port(D, "pdmoe_kv_transfer_bytes_total"), 0);
    cr_assert_eq(metric_port(D, "pdmoe_kv_recomputes_total"), 0);
    code = decode_with(D, victim, kv, out, sizeof out);
    cr_assert(code >= 400 && code < 500, "a second pull: %d %s", code, out);
    json_decref(kv);
    for (int i = 0; i < 200 && metric_port(P, "pdmoe_kv_leases") > 0; i++)
        usleep(20000);
    cr_assert_eq(metric_port(P, "pdmoe_kv_leases"), 0);
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < 100 && labelled(D, "pdmoe_rank_kv_blocks_free", k) != labelled(D, "pdmoe_rank_kv_blocks_capacity", k); i++)
            usleep(20000);
        cr_assert_eq(labelled(P, "pdmoe_rank_kv_blocks_free", k), labelled(P, "pdmoe_rank_kv_blocks_capacity", k),
                     "prefill rank %d", k);
        cr_assert_eq(labelled(D, "pdmoe_rank_kv_blocks_free", k), labelled(D, "pdmoe_rank_kv_blocks_capacity", k),
                     "decode rank %d", k);
    }
}

/* Item 7 of issue 12: every rank of a prefill and of a decode EP group bound to 127.0.0.1 listens
 * there only (HTTP, its KV listener, UCX's transports, Open MPI's TCP transport), after a pull. */
Test(server_ep, every_rank_listens_on_the_configured_address_only)
{
    int P = base_port, D = base_port + 1;
    char kvp[160];
    snprintf(kvp, sizeof kvp, "{\"kv_role\":\"kv_producer\",\"kv_port\":%d,\"engine_id\":\"p\"}", base_port + 3);
    group = start_group_kv(P, kvp);
    group2 = start_group_kv(D, "{\"kv_role\":\"kv_consumer\",\"engine_id\":\"d\",\"kv_timeout_ms\":3000}");
    free(pd_request(P, D, "Hello", 4, 0));
    cr_assert_eq(metric_port(D, "pdmoe_kv_recomputes_total"), 0);
    int ports[2] = {P, D};
    for (int g = 0; g < 2; g++) {
        pid_t pid[2];
        rank_pids(ports[g], pid);
        for (int k = 0; k < 2; k++) {
            char list[4096];
            int elsewhere, n = sock_listening(pid[k], "127.0.0.1", list, sizeof list, &elsewhere);
            cr_assert_eq(elsewhere, 0, "%s rank %d (pid %d) listens elsewhere than 127.0.0.1:\n%s",
                         g ? "decode" : "prefill", k, pid[k], list);
            cr_assert_gt(n, 0, "rank %d of port %d: no listener found at all", k, ports[g]);
        }
    }
}

/* MTP speculative decoding in an EP group: the MTP layer's experts are spread over the ranks like
 * every layer's, each owner rank drafts, verifies and rolls back its own sequences, and every rank
 * takes the group's drafting and verify steps. Six concurrent greedy requests of different lengths
 * on 2 x 2 sequence slots (so later prompts prefill in rounds where others decode) answer the
 * tokens of one plain process, the acceptance counts reach rank 0's /metrics, every
 * pool is full again, and the idle group sleeps. */
Test(server_ep, mtp_speculation_in_a_group_gives_the_tokens_of_one_plain_process)
{
    tmp_model_agree("v4-tiny", 4, 0.7, spec_dir, sizeof spec_dir);
    int pg = base_port, ps = base_port + 1;
    char sp[16], sq[16];
    snprintf(sp, sizeof sp, "%d", pg);
    snprintf(sq, sizeof sq, "%d", ps);
    char *plain[] = {(char *)pdmoe_bin(), "serve", "--model", spec_dir, "--port", sq, "--threads", "1", "--max-num-seqs", "8",
                     "--max-model-len", "512", "--served-model-name", "tiny", NULL};
    char *spec[] = {"mpirun", "-n", "2", "--oversubscribe", (char *)pdmoe_bin(), "serve", "--model", spec_dir,
                    "--enable-expert-parallel", "--data-parallel-size", "2", "--port", sp, "--threads", "1",
                    "--max-num-seqs", "2", "--max-model-len", "512", "--served-model-name", "tiny",
                    "--speculative-config", "{\"method\":\"mtp\",\"num_speculative_tokens\":3}", NULL};
    single = launch(plain, ps);
    group = launch(spec, pg);
    char *want[N_REQ], *got[N_REQ];
    run_requests(ps, want);
    run_requests(pg, got);
    for (int i = 0; i < N_REQ; i++) {
        cr_assert_str_eq(got[i], want[i], "request %d: EP group with MTP %s, one plain process %s", i, got[i], want[i]);
        free(want[i]);
        free(got[i]);
    }
    int drafts = metric_port(pg, "pdmoe_spec_decode_num_drafts_total");
    int accepted = metric_port(pg, "pdmoe_spec_decode_num_accepted_tokens_total");
    cr_assert_gt(drafts, 0);
    cr_assert_gt(accepted, drafts / 2, "%d accepted of %d drafts at agreement 0.7", accepted, drafts);
    int per_pos = 0;
    for (int j = 0; j < 3; j++) {
        char name[128];
        snprintf(name, sizeof name, "pdmoe_spec_decode_num_accepted_tokens_per_pos_total{position=\"%d\"}", j);
        per_pos += metric_port(pg, name);
    }
    cr_assert_eq(per_pos, accepted);
    /* a round yields its accepted drafts and one token more per sequence */
    cr_assert_eq(metric_port(pg, "pdmoe_generation_tokens_total"), 24 + 8 + 40 + 16 + 3 + 30);
    for (int k = 0; k < 2; k++) {
        cr_assert_gt(labelled(pg, "pdmoe_rank_requests_total", k), 0, "rank %d held no sequence", k);
        cr_assert_eq(labelled(pg, "pdmoe_rank_kv_blocks_free", k), labelled(pg, "pdmoe_rank_kv_blocks_capacity", k),
                     "rank %d", k);
    }
    cr_assert_eq(metric_port(pg, "pdmoe_kv_slots_free"), 4);
    pid_t r[2];
    rank_pids(pg, r);
    double c0[2] = {cpu_seconds(r[0]), cpu_seconds(r[1])};
    sleep(2);
    for (int k = 0; k < 2; k++) {
        double used = cpu_seconds(r[k]) - c0[k];
        cr_assert_lt(used, 0.2, "idle rank %d used %.2f s of CPU in 2 s", k, used);
    }
}

/* A greedy completion of `prompt` on `port`: its token ids (JSON) in ids, its prompt length. */
static int complete_on(int port, const char *prompt, int max_tokens, char *ids, size_t cap)
{
    char *body = malloc(strlen(prompt) + 256), *out = malloc(1 << 16);
    sprintf(body, "{\"model\":\"tiny\",\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,"
            "\"return_token_ids\":true}", prompt, max_tokens);
    cr_assert_eq(curl_port(port, "/v1/completions", body, "--max-time 120", out, 1 << 16), 200, "%s", out);
    json_t *j = parse(out);
    char *a = json_dumps(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids"), JSON_COMPACT);
    snprintf(ids, cap, "%s", a);
    int np = (int)json_integer_value(json_object_get(json_object_get(j, "usage"), "prompt_tokens"));
    free(a);
    json_decref(j);
    free(body);
    free(out);
    return np;
}

/* Prefix caching in an EP group (on by default): each rank caches its own sequences' prefixes in
 * its own pool, rank 0 sends a prompt to the rank holding its prefix, a cached prefix gives the
 * completion of a server without the cache, and rank 0's /metrics counts the group's queries and
 * hits in tokens; idle, every rank's blocks are free or held by its cache alone. */
Test(server_ep, each_rank_caches_its_prefixes_and_completes_as_without_the_cache)
{
    int pg = base_port, ps = base_port + 1;
    char sq[16];
    snprintf(sq, sizeof sq, "%d", ps);
    char *plain[] = {(char *)pdmoe_bin(), "serve", "--model", dir, "--port", sq, "--threads", "1", "--max-num-seqs", "8",
                     "--max-model-len", "1024", "--served-model-name", "tiny", "--no-enable-prefix-caching", NULL};
    single = launch(plain, ps);
    group_max_len = "1024";
    group = start_group(pg);
    char *a = long_prompt(260, 1), *b = long_prompt(260, 2);
    char want_a[4096], want_b[4096], got[4096];
    int na = complete_on(ps, a, 8, want_a, sizeof want_a), nb = complete_on(ps, b, 8, want_b, sizeof want_b);
    cr_assert(na > 2 * 256 && na < 1000 && nb > 2 * 256 && nb < 1000, "prompts of %d and %d tokens", na, nb);
    cr_assert_eq(metric_port(ps, "pdmoe_prefix_cache_queries_total"), 0, "off means no lookups");
    /* a, then b (the other rank: a's rank holds nothing of b), then each again, in the order that
     * round-robin would send to the wrong rank: a hit each only if each goes to its prefix's rank */
    const char *order[4] = {a, b, b, a};
    const char *want[4] = {want_a, want_b, want_b, want_a};
    for (int i = 0; i < 4; i++) {
        complete_on(pg, order[i], 8, got, sizeof got);
        cr_assert_str_eq(got, want[i], "request %d: %s with the group's cache, %s without", i, got, want[i]);
    }
    /* every unit boundary below each prompt's last token was reused the second time */
    int hits = (na - 1) / 256 * 256 + (nb - 1) / 256 * 256;
    cr_assert_eq(metric_port(pg, "pdmoe_prefix_cache_queries_total"), 2 * (na + nb));
    cr_assert_eq(metric_port(pg, "pdmoe_prefix_cache_hits_total"), hits, "%d hits, want %d",
                 metric_port(pg, "pdmoe_prefix_cache_hits_total"), hits);
    for (int k = 0; k < 2; k++)
        cr_assert_eq(labelled(pg, "pdmoe_rank_requests_total", k), 2, "rank %d: each prompt stays on its rank", k);
    cr_assert_gt(metric_port(pg, "pdmoe_prefix_cache_blocks"), 0);
    cr_assert_eq(metric_port(pg, "pdmoe_kv_blocks_free") + metric_port(pg, "pdmoe_prefix_cache_blocks"),
                 metric_port(pg, "pdmoe_kv_blocks_capacity"));
    cr_assert_gt(metric_port(pg, "pdmoe_prefix_cache_snapshot_bytes"), 0);
    free(a);
    free(b);
}

/* A producer that stops answering (SIGSTOP: a prefill host gone dark) while a decode EP group's
 * owner rank pulls from it: the pull ran inside the group's round, so the round held for the
 * pull's timeout; the group's watchdog (3 s here, the pull's timeout 5 s) ended the whole group,
 * the client getting no answer at all, and (once the watchdog allowed for it) every other request
 * of the group waited out the pull. Now the owner rank pulls while the group's rounds go on: a
 * request sent meanwhile is answered at once, the pull fails, the owner rank computes the prompt
 * itself, the client gets its 200. */
Test(server_ep, a_hung_producer_does_not_end_a_decode_group)
{
    int P = base_port, D = base_port + 1;
    char sp[16], sd[16], kvp[160];
    snprintf(sp, sizeof sp, "%d", P);
    snprintf(sd, sizeof sd, "%d", D);
    snprintf(kvp, sizeof kvp, "{\"kv_role\":\"kv_producer\",\"kv_port\":%d,\"engine_id\":\"p\"}", base_port + 3);
    char *pargv[] = {(char *)pdmoe_bin(), "serve", "--model", dir, "--port", sp, "--threads", "1", "--max-num-seqs", "4",
                     "--max-model-len", "512", "--served-model-name", "tiny", "--kv-transfer-config", kvp, NULL};
    single = launch(pargv, P);
    char *dargv[] = {"mpirun", "-n", "2", "--oversubscribe", (char *)pdmoe_bin(), "serve", "--model", dir,
                     "--enable-expert-parallel", "--data-parallel-size", "2", "--port", sd, "--threads", "1",
                     "--max-num-seqs", "4", "--max-model-len", (char *)group_max_len, "--served-model-name", "tiny",
                     "--watchdog-timeout", "3", "--kv-transfer-config",
                     "{\"kv_role\":\"kv_consumer\",\"engine_id\":\"d\",\"kv_timeout_ms\":5000}", NULL};
    group = launch(dargv, D);
    char body[1024], out[1 << 14];
    snprintf(body, sizeof body, "{\"prompt\":\"held\",\"max_tokens\":1,\"temperature\":0,"
             "\"kv_transfer_params\":{\"do_remote_decode\":true}}");
    cr_assert_eq(curl_port(P, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    json_t *j = parse(out);
    char *kvs = json_dumps(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "kv_transfer_params"),
                           JSON_COMPACT);
    json_decref(j);
    cr_assert_eq(kill(single, SIGSTOP), 0);
    snprintf(body, sizeof body, "{\"prompt\":\"held\",\"max_tokens\":4,\"temperature\":0,\"ignore_eos\":true,"
             "\"kv_transfer_params\":%s}", kvs);
    free(kvs);
    static struct call held;
    held.port = D;
    cr_assert(strlen(body) < sizeof held.body, "%s", body);
    memcpy(held.body, body, strlen(body) + 1);
    pthread_t t;
    const double t0 = pd_now_s();
    cr_assert_eq(pthread_create(&t, NULL, call_thread, &held), 0);
    /* the pull under way (the producer holds it), another request, computed by the group itself */
    for (int i = 0; i < 100 && metric_port(D, "pdmoe_num_requests_running") < 1; i++)
        usleep(20000);
    cr_assert_eq(metric_port(D, "pdmoe_num_requests_running"), 1);
    snprintf(body, sizeof body, "{\"prompt\":\"meanwhile\",\"max_tokens\":4,\"temperature\":0,\"ignore_eos\":true}");
    const double t1 = pd_now_s();
    int other = curl_port(D, "/v1/completions", body, "--max-time 60", out, sizeof out);
    const double waited = pd_now_s() - t1;
    cr_assert_eq(other, 200, "HTTP %d: %s", other, out);
    cr_assert(waited < 2.5, "a request sent during the hung pull waited %.1f s (the pull's timeout is 5 s)", waited);
    pthread_join(t, NULL);
    cr_assert_eq(held.code, 200, "HTTP %d: %s", held.code, held.out);
    cr_assert(pd_now_s() - t0 > 4.5, "the held request was answered in %.1f s, before its pull's timeout", pd_now_s() - t0);
    cr_assert_eq(metric_port(D, "pdmoe_kv_recomputes_total"), 1);
    /* a client that leaves during such a pull: the owner rank aborts it, its blocks come back
     * well before the pull's timeout, and no transfer failure is counted for it */
    cr_assert_eq(curl_port(D, "/v1/completions", held.body, "--max-time 1", out, sizeof out), 0);
    const double left = pd_now_s();
    for (int k = 0; k < 2; k++)
        while (pd_now_s() - left < 10 &&
               labelled(D, "pdmoe_rank_kv_blocks_free", k) != labelled(D, "pdmoe_rank_kv_blocks_capacity", k))
            usleep(20000);
    cr_assert(pd_now_s() - left < 3, "the blocks of a pull whose client left came back after %.1f s", pd_now_s() - left);
    cr_assert_eq(metric_port(D, "pdmoe_kv_transfers_total"), 1, "the aborted pull counted as a transfer");
    cr_assert_eq(metric_port(D, "pdmoe_num_requests_running"), 0);
    FILE *f = fopen(log_path, "r");
    char log[1 << 15];
    size_t n = f ? fread(log, 1, sizeof log - 1, f) : 0;
    log[n] = 0;
    if (f)
        fclose(f);
    cr_assert_null(strstr(log, "aborted by the caller"), "a pull its client left was logged as failed:\n%s", log);
    kill(single, SIGCONT);
    int st;
    cr_assert_eq(waitpid(group, &st, WNOHANG), 0, "the decode group ended (status %d) on a producer that hung", st);
}

/* The scheduler's timed waits (an EP group's flush each 20 ms while leases are out, rank 0's
 * round each millisecond while a pull is under way and nothing steps) took their deadlines from
 * the wall clock: after a step of it an hour forward, a decode group with a pull in flight waited
 * that hour to hear the pull had ended (its client got nothing); an hour back, a producer group
 * holding a lease ran its flush rounds without a pause. The prefill group here runs an hour
 * behind, the decode group an hour ahead; the request gets the tokens of one process at once, and
 * the producer's ranks sleep while the lease waits for its pull. */
Test(server_ep, a_step_of_the_wall_clock_neither_stalls_nor_spins_the_scheduler)
{
    int P = base_port, D = base_port + 1, C = base_port + 2;
    char kvp[160];
    snprintf(kvp, sizeof kvp, "{\"kv_role\":\"kv_producer\",\"kv_port\":%d,\"engine_id\":\"p\"}", base_port + 3);
    group_clock_shift = "-3600";
    group = start_group_kv(P, kvp);
    group_clock_shift = "3600";
    group2 = start_group_kv(D, "{\"kv_role\":\"kv_consumer\",\"engine_id\":\"d\",\"kv_timeout_ms\":3000}");
    group_clock_shift = NULL;
    single = start_single(C);
    const char *prompt = "The sea froze over and the children skated until the sun went down";
    char *want = colocated_ids(C, prompt, 12);
    char body[2048], out[1 << 14];
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":1,\"temperature\":0,"
             "\"kv_transfer_params\":{\"do_remote_decode\":true}}", prompt);
    cr_assert_eq(curl_port(P, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    cr_assert_eq(metric_port(P, "pdmoe_kv_leases"), 1);
    /* every rank of both groups runs under the shim */
    int groups[2] = {P, D};
    pid_t r[2];
    for (int g = 0; g < 2; g++) {
        rank_pids(groups[g], r);
        for (int k = 0; k < 2; k++) {
            char maps[64], cmd[160];
            snprintf(maps, sizeof maps, "/proc/%d/maps", r[k]);
            snprintf(cmd, sizeof cmd, "grep -q libclockshift.so %s", maps);
            cr_assert_eq(system(cmd), 0, "rank %d of port %d runs without the shim (%s)", k, groups[g], maps);
        }
    }
    /* the lease out: the producer's ranks flush every 20 ms, under 20% of a core over 1.5 s (2%
     * measured; the wall clock's deadlines had rank 0 at 60-100%) */
    rank_pids(P, r);
    double c0[2] = {cpu_seconds(r[0]), cpu_seconds(r[1])};
    usleep(1500000);
    for (int k = 0; k < 2; k++) {
        double used = cpu_seconds(r[k]) - c0[k];
        cr_assert_lt(used, 0.3, "prefill rank %d, its clock an hour back, used %.2f s of CPU in 1.5 s with a lease out",
                     k, used);
    }
    json_t *j = parse(out);
    char *kvs = json_dumps(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "kv_transfer_params"),
                           JSON_COMPACT);
    json_decref(j);
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":12,\"temperature\":0,\"ignore_eos\":true,"
             "\"return_token_ids\":true,\"kv_transfer_params\":%s}", prompt, kvs);
    free(kvs);
    const double t0 = pd_now_s();
    int code = curl_port(D, "/v1/completions", body, "--max-time 20", out, sizeof out);
    const double took = pd_now_s() - t0;
    cr_assert_eq(code, 200, "the decode group, its clock an hour ahead, answered HTTP %d after %.1f s: %s", code, took,
                 out);
    cr_assert_lt(took, 10.0, "the decode took %.1f s", took);
    j = parse(out);
    char *got = json_dumps(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids"),
                           JSON_COMPACT);
    json_decref(j);
    cr_assert_str_eq(got, want, "PD with stepped clocks %s, one process %s", got, want);
    free(got);
    free(want);
    cr_assert_eq(metric_port(D, "pdmoe_kv_transfers_total"), 1);
    cr_assert_eq(metric_port(D, "pdmoe_kv_recomputes_total"), 0, "the KV was not pulled");
}

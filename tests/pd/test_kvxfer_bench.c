/* `pdmoe bench transfer --serve` and `--peer`: the KV hand-off between two processes (on two
 * hosts in tests/cluster/shaped_link.sh; here on loopback, over UCX_TLS=tcp as between hosts).
 * The consumer's results and the producer's lease counts agree, the producer exits by itself
 * (after bye, or after --timeout with nobody there), and a consumer with no producer fails fast.
 * The single-process run's --json carries the same tables as its text. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "util.h"
#include "core/timing.h"
#include "../tmpmodel.h"

static const char *bin(void)
{
    const char *b = getenv("PDMOE_BIN");
    return b ? b : "build/pdmoe";
}

/* pdmoe ARGS... with stdout and stderr to the given files; its pid. */
static pid_t spawn(const char *out, const char *err, char *const args[])
{
    pid_t p = fork();
    cr_assert(p >= 0);
    if (p == 0) {
        if (!freopen(out, "w", stdout) || !freopen(err, "w", stderr))
            _exit(127);
        execv(bin(), args);
        _exit(127);
    }
    return p;
}

/* Exit status of p, or -1 if it is still running after `seconds` (then it is killed). */
static int wait_exit(pid_t p, double seconds)
{
    double end = pd_now_s() + seconds;
    int st;
    while (pd_now_s() < end) {
        if (waitpid(p, &st, WNOHANG) == p)
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
        usleep(20000);
    }
    kill(p, SIGKILL);
    waitpid(p, &st, 0);
    return -1;
}

static int file_has(const char *path, const char *needle)
{
    char buf[4096] = {0};
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    buf[fread(buf, 1, sizeof buf - 1, f)] = 0;
    fclose(f);
    return strstr(buf, needle) != NULL;
}

static void wait_ready(const char *err, pid_t p)
{
    double end = pd_now_s() + 30;
    while (!file_has(err, " ready: ") && pd_now_s() < end && waitpid(p, NULL, WNOHANG) == 0)
        usleep(20000);
    cr_assert(file_has(err, " ready: "), "the producer printed no ready line");
}

Test(kvxfer, bench_two_processes, .timeout = 120)
{
    setenv("UCX_TLS", "tcp", 1);
    char serve[64], po[] = "/tmp/pdmoe-kvb-po-XXXXXX", pe[] = "/tmp/pdmoe-kvb-pe-XXXXXX";
    char co[] = "/tmp/pdmoe-kvb-co-XXXXXX", ce[] = "/tmp/pdmoe-kvb-ce-XXXXXX";
    close(mkstemp(po));
    close(mkstemp(pe));
    close(mkstemp(co));
    close(mkstemp(ce));
    snprintf(serve, sizeof serve, "127.0.0.1:%d", free_port());
    pid_t p = spawn(po, pe, (char *const[]){"pdmoe", "bench", "transfer", "--serve", serve, "--timeout", "30",
                                           "--json", NULL});
    wait_ready(pe, p);
    pid_t c = spawn(co, ce, (char *const[]){"pdmoe", "bench", "transfer", "--peer", serve, "--tokens", "1024,4096",
                                           "--reps", "2", "--json", NULL});
    cr_assert_eq(wait_exit(c, 60), 0, "the consumer failed");
    cr_assert_eq(wait_exit(p, 10), 0, "the producer did not exit 0 after bye");

    json_error_t je;
    json_t *cj = json_load_file(co, 0, &je), *pj = json_load_file(po, 0, &je);
    cr_assert(cj && pj, "not JSON: %s", je.text);
    cr_assert_str_eq(json_string_value(json_object_get(cj, "mode")), "peer");
    cr_assert_eq(json_integer_value(json_object_get(cj, "reps")), 2);
    cr_assert_gt(json_real_value(json_object_get(cj, "control_rtt_s")), 0);
    json_t *rows = json_object_get(cj, "rows");
    cr_assert_eq(json_array_size(rows), 2);
    static const int64_t tokens[] = {1024, 4096};
    for (size_t i = 0; i < 2; i++) {
        json_t *r = json_array_get(rows, i);
        cr_assert_eq(json_integer_value(json_object_get(r, "tokens")), tokens[i]);
        /* v4-flash-mini's bf16 KV: the slot (windows, compressor states) and whole blocks */
        cr_assert_gt(json_integer_value(json_object_get(r, "bytes")), 1000000);
        cr_assert_geq(json_integer_value(json_object_get(r, "pieces")), 1);
        cr_assert_eq(json_array_size(json_object_get(r, "handoff_s")), 2);
        double med = json_real_value(json_object_get(r, "handoff_s_median"));
        cr_assert(med > 0 && med >= json_real_value(json_object_get(r, "handoff_s_min")));
        cr_assert_gt(json_real_value(json_object_get(r, "tcp_stream_s_median")), 0);
    }
    /* 2 sizes x (warm-up + 2): every lease pulled, none left to expire */
    cr_assert_str_eq(json_string_value(json_object_get(pj, "mode")), "serve");
    cr_assert_eq(json_integer_value(json_object_get(pj, "leases")), 6);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(pj, "released"), "done")), 6);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(pj, "released"), "expired")), 0);
    json_decref(cj);
    json_decref(pj);
    remove(po);
    remove(pe);
    remove(co);
    remove(ce);
}

/* Nobody comes: the producer gives up after --timeout and says why, leaving nothing running. */
Test(kvxfer, bench_serve_times_out, .timeout = 60)
{
    setenv("UCX_TLS", "tcp", 1);
    char serve[64], po[] = "/tmp/pdmoe-kvb-po-XXXXXX", pe[] = "/tmp/pdmoe-kvb-pe-XXXXXX";
    close(mkstemp(po));
    close(mkstemp(pe));
    snprintf(serve, sizeof serve, "127.0.0.1:%d", free_port());
    pid_t p = spawn(po, pe, (char *const[]){"pdmoe", "bench", "transfer", "--serve", serve, "--timeout", "1", NULL});
    wait_ready(pe, p);
    double t0 = pd_now_s();
    cr_assert_eq(wait_exit(p, 20), 1);
    cr_assert_lt(pd_now_s() - t0, 10);
    cr_assert(file_has(pe, "no consumer connected to"), "no reason given");
    remove(po);
    remove(pe);
}

/* No producer: the consumer fails at once, naming the address. */
Test(kvxfer, bench_peer_without_producer, .timeout = 60)
{
    char peer[64], co[] = "/tmp/pdmoe-kvb-co-XXXXXX", ce[] = "/tmp/pdmoe-kvb-ce-XXXXXX";
    close(mkstemp(co));
    close(mkstemp(ce));
    snprintf(peer, sizeof peer, "127.0.0.1:%d", free_port());
    pid_t c = spawn(co, ce, (char *const[]){"pdmoe", "bench", "transfer", "--peer", peer, NULL});
    cr_assert_eq(wait_exit(c, 20), 1);
    char want[128];
    snprintf(want, sizeof want, "--peer %s: cannot connect to", peer);
    cr_assert(file_has(ce, want), "stderr lacks \"%s\"", want);
    remove(co);
    remove(ce);
}

/* The prefill beside the hand-off is v4-tiny's (--model): the hand-off is v4-flash-mini's whatever
 * the model, and models/mini's 1K-token prefill was most of this test's time under the sanitizers. */
Test(kvxfer, bench_single_process_json, .timeout = 120)
{
    char co[] = "/tmp/pdmoe-kvb-co-XXXXXX", ce[] = "/tmp/pdmoe-kvb-ce-XXXXXX", dir[64];
    close(mkstemp(co));
    close(mkstemp(ce));
    tmp_model("v4-tiny", 3, dir, sizeof dir);
    tmp_model_positions(dir, 65536);   /* --quick's longest hand-off, 32K tokens, is its max-model-len */
    pid_t c = spawn(co, ce, (char *const[]){"pdmoe", "bench", "transfer", "--quick", "--tls", "tcp", "--json",
                                            "--model", dir, NULL});
    int rc = wait_exit(c, 100);
    rm_model(dir);
    cr_assert_eq(rc, 0, "bench transfer --quick --json failed");
    json_error_t je;
    json_t *d = json_load_file(co, 0, &je);
    cr_assert(d, "not JSON: %s", je.text);
    cr_assert_str_eq(json_string_value(json_object_get(d, "mode")), "single-process");
    cr_assert_str_eq(json_string_value(json_object_get(d, "prefill_model")), dir);
    json_t *runs = json_object_get(d, "runs");
    cr_assert_eq(json_array_size(runs), 1, "--tls tcp: one table");
    cr_assert_str_eq(json_string_value(json_object_get(json_array_get(runs, 0), "ucx_tls")), "tcp");
    json_t *rows = json_object_get(json_array_get(runs, 0), "rows");
    cr_assert_eq(json_array_size(rows), 3, "--quick: 1K, 8K and 32K tokens");
    for (size_t i = 0; i < 3; i++)
        cr_assert_gt(json_real_value(json_object_get(json_array_get(rows, i), "engine_MBps")), 0);
    /* --quick measures the 1K prompt's prefill only */
    cr_assert_gt(json_real_value(json_object_get(json_array_get(rows, 0), "prefill_s")), 0);
    cr_assert(json_is_null(json_object_get(json_array_get(rows, 1), "prefill_s")));
    cr_assert_eq(json_array_size(json_object_get(json_object_get(d, "seed_predicted"), "rows")), 3);
    json_decref(d);
    remove(co);
    remove(ce);
}

/* MTP speculative decoding (--speculative-config) in EP groups with a PD role and with the prefix
 * cache (pd/server_ep_spec.c, real processes under mpirun -n 2 on loopback, a draft that agrees
 * with the main model's greedy token about 70% of the time):
 *   - an EP2 prefill group hands each sequence's MTP state (the MTP layer's KV in the owner rank's
 *     pool, the draft's input row) to an EP2 decode group's owner rank, for k = 1, 2, 3, with
 *     several concurrent requests (short, ending mid-block, past the window): the ids are a
 *     plain server's bit for bit, every KV is pulled (none recomputed), and the decode group's
 *     drafts are accepted exactly as a colocated speculating server's at every position (a draft
 *     rebuilt or fed a wrong row or MTP KV would keep the ids, verification being exact, but not
 *     these counts); the prefill group drafts nothing; a failed pull recomputes the prompt on
 *     the owner rank and continues from the producer's token; every rank's pool is full again
 *     and the idle ranks sleep;
 *   - the same between an EP2 group and one process, both directions;
 *   - an EP2 group with MTP and the prefix cache (on by default): a repeated prompt hits the
 *     owner rank's cache, gives a plain server's ids, and its drafts are accepted as without the
 *     cache (the draft resumed from the snapshot's MTP state and input row); and the same as an
 *     EP2 prefill group handing off to an EP2 decode group. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/genmodel.h"
#include "../tmpmodel.h"
#include "util.h"

static char dir[64], log_path[96];
enum { N_PIDS = 4 };
static pid_t pids[N_PIDS];   /* every server this test started (0: none) */
static char names[N_PIDS][64];   /* "pdmoe serve (port N, 2 ranks)", for a stop's messages */
static int by_mpirun[N_PIDS];    /* pids[i] is an mpirun (its ranks, the group) */
static int base_port;

static void setup(void)
{
    tmp_model_agree("v4-tiny", 4, 0.7, dir, sizeof dir);
    snprintf(log_path, sizeof log_path, "%s/serve.log", dir);
    mpi_test_env();
    /* ports base..base+7 (a producer's kv ports base+6 + rank): a block no other test holds */
    base_port = test_ports();
}

/* SIGTERM to the server's process group; it must exit 0 without a sanitizer report (tests/child.h). */
static void stop_pid(pid_t *p)
{
    if (*p <= 0)
        return;
    const long i = p - pids;
    pid_t was = *p;
    int st = 0;
    *p = 0;
    kill(-was, SIGTERM);
    cr_assert(reap_within(was, 1, &st), "%s did not exit within 60 s of SIGTERM", names[i]);
    if (by_mpirun[i])
        mpirun_signalled_cleanly(was, st, names[i]);
    else
        child_exited_cleanly(was, st, names[i]);
}

/* Every server still running stopped at once, then each one's stop checked (a failed check leaves
 * none running). */
static void teardown(void)
{
    pid_t left[N_PIDS];
    int st[N_PIDS] = {0}, ended[N_PIDS] = {0};
    for (int i = 0; i < N_PIDS; i++) {
        left[i] = pids[i];
        pids[i] = 0;
        if (left[i] > 0)
            kill(-left[i], SIGTERM);
    }
    for (int i = 0; i < N_PIDS; i++)
        if (left[i] > 0)
            ended[i] = reap_within(left[i], 1, &st[i]);
    rm_model(dir);
    for (int i = 0; i < N_PIDS; i++)
        if (left[i] > 0) {
            cr_assert(ended[i], "%s did not exit within 60 s of SIGTERM", names[i]);
            if (by_mpirun[i])
                mpirun_signalled_cleanly(left[i], st[i], names[i]);
            else
                child_exited_cleanly(left[i], st[i], names[i]);
        }
}

TestSuite(ep_spec_pd, .init = setup, .fini = teardown, .timeout = 400);

/* `pdmoe serve` on `port` in its own process group (stderr to the log), waited for until /health
 * answers, as pids[slot]: an EP group of 2 ranks (2 sequences each) or one process (4), MTP with
 * k drafts (0: none), kv a --kv-transfer-config (NULL: colocated), cache 0 to turn the prefix
 * cache off. */
static void start(int slot, int port, int ranks, int k, const char *kv, int cache)
{
    char sp[16], spec[96];
    snprintf(sp, sizeof sp, "%d", port);
    snprintf(spec, sizeof spec, "{\"method\":\"mtp\",\"num_speculative_tokens\":%d}", k);
    const char *argv[40];
    int n = 0;
    if (ranks > 1) {
        argv[n++] = "mpirun";
        argv[n++] = "-n";
        argv[n++] = "2";
        argv[n++] = "--oversubscribe";
    }
    const char *common[] = {pdmoe_bin(), "serve", "--model", dir, "--port", sp, "--threads", "1", "--max-model-len", "1024",
                            "--served-model-name", "tiny", "--max-num-seqs", ranks > 1 ? "2" : "4"};
    for (size_t i = 0; i < sizeof common / sizeof *common; i++)
        argv[n++] = common[i];
    if (ranks > 1) {
        argv[n++] = "--enable-expert-parallel";
        argv[n++] = "--data-parallel-size";
        argv[n++] = "2";
    }
    if (k) {
        argv[n++] = "--speculative-config";
        argv[n++] = spec;
    }
    if (kv) {
        argv[n++] = "--kv-transfer-config";
        argv[n++] = kv;
    }
    if (!cache)
        argv[n++] = "--no-enable-prefix-caching";
    argv[n] = NULL;
    pid_t pid = fork_pdmoe();
    if (pid == 0) {
        setpgid(0, 0);
        if (!freopen(log_path, "a", stderr) || !freopen("/dev/null", "w", stdout))
            _exit(126);
        execvp(argv[0], (char *const *)argv);
        _exit(127);
    }
    setpgid(pid, pid);
    pids[slot] = pid;
    snprintf(names[slot], sizeof names[slot], "pdmoe serve (port %d, %d rank%s)", port, ranks, ranks > 1 ? "s" : "");
    by_mpirun[slot] = ranks > 1;
    char out[256];
    for (int i = 0; i < 1200; i++) {
        if (curl_port(port, "/health", NULL, NULL, out, sizeof out) == 200)
            return;
        int st;
        cr_assert_neq(waitpid(pid, &st, WNOHANG), pid, "the server on port %d exited before it was healthy (status "
                      "%d; see %s)", port, st, log_path);
        usleep(100000);
    }
    cr_assert_fail("the server on port %d did not become healthy", port);
}

/* v4-tiny: a window of 8, ratio-4 and ratio-16 compressors, 16 entries a block (64 tokens of a
 * ratio-4 layer): a prompt of a few tokens, ones ending mid-block and mid-window, one past a block */
static const char *const prompts[] = {
    "Hi",
    "The quick brown fox jumps over the lazy dog",
    "request 3: the sea froze over the harbour while the gulls kept circling the masts of the boats",
    "Once upon a time, in a kingdom by the sea, there lived a princess who counted the waves every "
    "morning and every evening; the king, her father, kept a ledger of the tides, and the queen kept "
    "the keys of the lighthouse, which nobody had climbed for a hundred years",
};
enum { NP = sizeof prompts / sizeof prompts[0], MAXT = 20 };

struct call {
    int port, P, D, broken, code;   /* P > 0: prefill on P, then decode on D */
    const char *prompt;
    char ids[4096], out[1 << 14];
};

/* A greedy completion (through P then D as the proxy does it, when c->P): its ids in c->ids. */
static void *call_thread(void *arg)
{
    struct call *c = arg;
    char body[8192];
    if (!c->P) {
        snprintf(body, sizeof body, "{\"model\":\"tiny\",\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0,"
                 "\"ignore_eos\":true,\"return_token_ids\":true}", c->prompt, MAXT);
        c->code = curl_port(c->port, "/v1/completions", body, "--max-time 200", c->out, sizeof c->out);
    } else {
        snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":1,\"temperature\":0,"
                 "\"kv_transfer_params\":{\"do_remote_decode\":true}}", c->prompt);
        c->code = curl_port(c->P, "/v1/completions", body, "--max-time 200", c->out, sizeof c->out);
        if (c->code != 200)
            return NULL;
        json_t *j = parse(c->out);
        json_t *kv = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "kv_transfer_params");
        if (c->broken)   /* a dead KV port: the decode side's owner recomputes the prompt */
            json_object_set_new(kv, "remote_port", json_integer(1));
        char *kvs = json_dumps(kv, JSON_COMPACT);
        snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,"
                 "\"return_token_ids\":true,\"kv_transfer_params\":%s}", c->prompt, MAXT, kvs);
        free(kvs);
        json_decref(j);
        c->code = curl_port(c->D, "/v1/completions", body, "--max-time 200", c->out, sizeof c->out);
    }
    if (c->code == 200) {
        json_t *j = parse(c->out);
        char *a = json_dumps(json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids"),
                             JSON_COMPACT);
        snprintf(c->ids, sizeof c->ids, "%s", a);
        free(a);
        json_decref(j);
    }
    return NULL;
}

/* The n prompts at once (colocated on `port`, or P then D): each one's ids in ids[i]. */
static void run_all(int port, int P, int D, const char *const *ps, int n, char ids[][4096])
{
    static struct call c[8];
    pthread_t t[8];
    cr_assert_leq(n, 8);
    for (int i = 0; i < n; i++) {
        memset(&c[i], 0, sizeof c[i]);
        c[i] = (struct call){.port = port, .P = P, .D = D, .prompt = ps[i]};
        pthread_create(&t[i], NULL, call_thread, &c[i]);
    }
    for (int i = 0; i < n; i++)
        pthread_join(t[i], NULL);
    for (int i = 0; i < n; i++) {
        cr_assert_eq(c[i].code, 200, "request %d (port %d, P %d, D %d): %d %s", i, port, P, D, c[i].code, c[i].out);
        snprintf(ids[i], 4096, "%s", c[i].ids);
    }
}

/* A speculating server's acceptance counts: acc[j] accepted at position j < k, and the drafts. */
static int spec_counts(int port, int k, int acc[3])
{
    char name[128];
    for (int j = 0; j < 3; j++) {
        acc[j] = 0;
        if (j < k) {
            snprintf(name, sizeof name, "pdmoe_spec_decode_num_accepted_tokens_per_pos_total{position=\"%d\"}", j);
            acc[j] = metric_port(port, name);
        }
    }
    return metric_port(port, "pdmoe_spec_decode_num_drafts_total");
}

/* The port's pool (every rank's, for a group) is full again: leases ended, sequences freed. */
static void all_free(int port, int ranks, int cache)
{
    for (int i = 0; i < 300 && metric_port(port, "pdmoe_kv_leases") > 0; i++)
        usleep(20000);
    cr_assert_eq(metric_port(port, "pdmoe_kv_leases"), 0, "port %d", port);
    for (int i = 0; i < 100 && metric_port(port, "pdmoe_kv_blocks_free") +
                                   (cache ? metric_port(port, "pdmoe_prefix_cache_blocks") : 0) <
                               metric_port(port, "pdmoe_kv_blocks_capacity"); i++)
        usleep(20000);
    cr_assert_eq(metric_port(port, "pdmoe_kv_blocks_free") + (cache ? metric_port(port, "pdmoe_prefix_cache_blocks") : 0),
                 metric_port(port, "pdmoe_kv_blocks_capacity"), "port %d", port);
    for (int k = 0; ranks > 1 && k < 2; k++)
        cr_assert_gt(labelled(port, "pdmoe_rank_requests_total", k), 0, "port %d: rank %d held no sequence", port, k);
}

/* The plain ids (a server without MTP) and a colocated speculating server's counts, for k. */
static void reference(int k, char want[NP][4096], int acc[3], int *drafts)
{
    int C = base_port + 2;
    start(2, C, 1, 0, NULL, 0);
    run_all(C, 0, 0, prompts, NP, want);
    stop_pid(&pids[2]);
    start(2, C, 1, k, NULL, 0);
    char got[NP][4096];
    run_all(C, 0, 0, prompts, NP, got);
    for (int i = 0; i < NP; i++)
        cr_assert_str_eq(got[i], want[i], "colocated with MTP k %d, prompt %d", k, i);
    *drafts = spec_counts(C, k, acc);
    cr_assert_gt(*drafts, 0);
    stop_pid(&pids[2]);
}

/* P (ranks_p) hands off to D (ranks_d), both speculating with k: the checks of the header. */
static void pd_with_mtp(int k, int ranks_p, int ranks_d, int with_failed_pull, int idle_check)
{
    char want[NP][4096], got[NP][4096];
    int acc[3], drafts;
    reference(k, want, acc, &drafts);
    int P = base_port, D = base_port + 1;
    char kvp[200];
    snprintf(kvp, sizeof kvp, "{\"kv_role\":\"kv_producer\",\"kv_port\":%d,\"engine_id\":\"p\",\"kv_lease_ms\":2000}",
             base_port + 6);
    start(0, P, ranks_p, k, kvp, 1);
    start(1, D, ranks_d, k, "{\"kv_role\":\"kv_consumer\",\"engine_id\":\"d\",\"kv_timeout_ms\":5000}", 1);
    run_all(0, P, D, prompts, NP, got);
    for (int i = 0; i < NP; i++)
        cr_assert_str_eq(got[i], want[i], "k %d, EP %d -> EP %d, prompt %d: PD with MTP %s, plain %s", k, ranks_p,
                         ranks_d, i, got[i], want[i]);
    cr_assert_eq(metric_port(D, "pdmoe_kv_transfers_total"), NP);
    cr_assert_eq(metric_port(D, "pdmoe_kv_recomputes_total"), 0);
    int dacc[3], ddrafts = spec_counts(D, k, dacc);
    for (int j = 0; j < k; j++)
        cr_assert_eq(dacc[j], acc[j], "k %d, position %d: %d accepted after the hand-off, %d colocated", k, j, dacc[j],
                     acc[j]);
    cr_assert_eq(ddrafts, drafts, "k %d: %d drafts after the hand-off, %d colocated", k, ddrafts, drafts);
    /* the prefill side drafts nothing: its MTP layer only fills the KV it hands off */
    int pacc[3];
    cr_assert_eq(spec_counts(P, k, pacc), 0);
    if (with_failed_pull) {
        /* the pull fails: the decode owner recomputes the prompt (with its MTP layer) and goes on
         * from the producer's token */
        static struct call c;
        memset(&c, 0, sizeof c);
        c = (struct call){.P = P, .D = D, .broken = 1, .prompt = prompts[2]};
        call_thread(&c);
        cr_assert_eq(c.code, 200, "%s", c.out);
        cr_assert_str_eq(c.ids, want[2], "k %d, a failed pull recomputed: %s, plain %s", k, c.ids, want[2]);
        cr_assert_eq(metric_port(D, "pdmoe_kv_recomputes_total"), 1);
    }
    all_free(P, ranks_p, 1);
    all_free(D, ranks_d, 1);
    if (idle_check) {
        pid_t r[2][2];
        double c0[2][2];
        for (int g = 0; g < 2; g++) {
            rank_pids(g ? D : P, r[g]);
            for (int x = 0; x < 2; x++)
                c0[g][x] = cpu_seconds(r[g][x]);
        }
        sleep(2);
        for (int g = 0; g < 2; g++)
            for (int x = 0; x < 2; x++) {
                double used = cpu_seconds(r[g][x]) - c0[g][x];
                cr_assert_lt(used, 0.2, "idle %s rank %d used %.2f s of CPU in 2 s", g ? "decode" : "prefill", x, used);
            }
    }
    stop_pid(&pids[0]);
    stop_pid(&pids[1]);
}

/* ... and after the hand-offs, both groups' ranks sleep while idle (block, not spin). */
Test(ep_spec_pd, ep2_prefill_to_ep2_decode_with_mtp_k1)
{
    pd_with_mtp(1, 2, 2, 0, 1);
}

Test(ep_spec_pd, ep2_prefill_to_ep2_decode_with_mtp_k2_and_a_failed_pull)
{
    pd_with_mtp(2, 2, 2, 1, 0);
}

Test(ep_spec_pd, ep2_prefill_to_ep2_decode_with_mtp_k3)
{
    pd_with_mtp(3, 2, 2, 0, 0);
}

Test(ep_spec_pd, ep2_prefill_to_one_process_and_back_with_mtp)
{
    pd_with_mtp(2, 2, 1, 0, 0);
    pd_with_mtp(2, 1, 2, 1, 0);
}

static int prompt_tokens(int port, const char *prompt)
{
    char *body = malloc(strlen(prompt) + 64), out[4096];
    sprintf(body, "{\"prompt\":\"%s\",\"max_tokens\":1}", prompt);
    cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, out, sizeof out), 200, "%s", out);
    free(body);
    json_t *j = parse(out);
    int n = (int)json_integer_value(json_object_get(json_object_get(j, "usage"), "prompt_tokens"));
    json_decref(j);
    return n;
}

/* One at a time (the cache hit needs the first request's commit): ids[i] of order[i], on port or
 * through P then D. */
static void run_each(int port, int P, int D, const char *const *order, int n, char ids[][4096])
{
    for (int i = 0; i < n; i++)
        run_all(port, P, D, order + i, 1, ids + i);
}

Test(ep_spec_pd, ep2_with_mtp_and_the_prefix_cache_resumes_the_draft_on_the_owner_rank)
{
    const int k = 2, G = base_port, C = base_port + 2;
    char *a = long_prompt(150, 1), *b = long_prompt(150, 2);
    /* a, then b, then each again, in the order round-robin would send to the wrong rank: a hit
     * each only if each goes to its prefix's rank */
    const char *order[4] = {a, b, b, a};
    char want[4][4096], got[4][4096];
    start(2, C, 1, 0, NULL, 0);
    run_each(C, 0, 0, order, 4, want);
    int na = prompt_tokens(C, a), nb = prompt_tokens(C, b);
    cr_assert(na > 2 * 256 && na < 900 && nb > 2 * 256 && nb < 900, "prompts of %d and %d tokens", na, nb);
    stop_pid(&pids[2]);
    /* the same group without the cache: its drafts' counts */
    int acc[3], acc_cached[3];
    start(0, G, 2, k, NULL, 0);
    run_each(G, 0, 0, order, 4, got);
    for (int i = 0; i < 4; i++)
        cr_assert_str_eq(got[i], want[i], "request %d: EP2 with MTP, no cache %s, plain %s", i, got[i], want[i]);
    int drafts = spec_counts(G, k, acc);
    cr_assert_gt(drafts, 0);
    stop_pid(&pids[0]);
    start(0, G, 2, k, NULL, 1);
    run_each(G, 0, 0, order, 4, got);
    for (int i = 0; i < 4; i++)
        cr_assert_str_eq(got[i], want[i], "request %d: EP2 with MTP and the cache %s, plain %s", i, got[i], want[i]);
    /* every unit boundary below each prompt's last token was reused the second time */
    int hits = (na - 1) / 256 * 256 + (nb - 1) / 256 * 256;
    cr_assert_eq(metric_port(G, "pdmoe_prefix_cache_queries_total"), 2 * (na + nb));
    cr_assert_eq(metric_port(G, "pdmoe_prefix_cache_hits_total"), hits, "%d hits, want %d",
                 metric_port(G, "pdmoe_prefix_cache_hits_total"), hits);
    for (int r = 0; r < 2; r++)
        cr_assert_eq(labelled(G, "pdmoe_rank_requests_total", r), 2, "rank %d: each prompt stays on its rank", r);
    /* the resumed drafts propose what recomputed ones do */
    int cdrafts = spec_counts(G, k, acc_cached);
    for (int j = 0; j < k; j++)
        cr_assert_eq(acc_cached[j], acc[j], "position %d: %d accepted from cached prefixes, %d recomputed", j,
                     acc_cached[j], acc[j]);
    cr_assert_eq(cdrafts, drafts);
    all_free(G, 2, 1);
    cr_assert_gt(metric_port(G, "pdmoe_prefix_cache_blocks"), 0);
    cr_assert_gt(metric_port(G, "pdmoe_prefix_cache_snapshot_bytes"), 0);
    stop_pid(&pids[0]);
    /* PD: the prefill group's owner ranks start from their cached prefixes and hand the draft's
     * state off; the decode group drafts as the colocated group without the cache did */
    const int P = base_port, D = base_port + 1;
    char kvp[200];
    snprintf(kvp, sizeof kvp, "{\"kv_role\":\"kv_producer\",\"kv_port\":%d,\"engine_id\":\"p\"}", base_port + 6);
    start(0, P, 2, k, kvp, 1);
    start(1, D, 2, k, "{\"kv_role\":\"kv_consumer\",\"engine_id\":\"d\",\"kv_timeout_ms\":5000}", 1);
    run_each(0, P, D, order, 4, got);
    for (int i = 0; i < 4; i++)
        cr_assert_str_eq(got[i], want[i], "request %d: PD between EP2 groups with MTP and the cache %s, plain %s", i,
                         got[i], want[i]);
    cr_assert_eq(metric_port(P, "pdmoe_prefix_cache_hits_total"), hits);
    cr_assert_eq(metric_port(D, "pdmoe_kv_transfers_total"), 4);
    cr_assert_eq(metric_port(D, "pdmoe_kv_recomputes_total"), 0);
    int dacc[3], ddrafts = spec_counts(D, k, dacc);
    for (int j = 0; j < k; j++)
        cr_assert_eq(dacc[j], acc[j], "position %d: %d accepted after hand-offs from cached prefixes, %d colocated", j,
                     dacc[j], acc[j]);
    cr_assert_eq(ddrafts, drafts);
    all_free(P, 2, 1);
    all_free(D, 2, 1);
    free(a);
    free(b);
}

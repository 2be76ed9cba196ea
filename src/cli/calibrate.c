/* `pdmoe calibrate`: measures this machine for a model and writes a hardware file whose card is
 * one pdmoe process of --threads threads: bandwidth, the int8 peak of the kernel it runs (VNNI,
 * AMX, or the AVX2 kernel's vpmaddwd), the kernels' efficiencies, the UCX hand-off, and the CPU
 * overheads fitted to real engine steps (plan/calibrate.h). */
#include "core/file.h"
#include "bench/bench.h"
#include "cli/cli.h"
#include "core/timing.h"
#include "engine/engine.h"
#include "model/config.h"
#include "model/tokenizer.h"
#include "plan/calibrate.h"

#include <limits.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/stat.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *help =
    "usage: pdmoe calibrate [--model DIR] [--threads N] [--out FILE] [--quick] [--port P] [--verbose]\n"
    "Measures this machine for the model in DIR (default models/mini) with N threads per process\n"
    "(default 1, as pdmoe up runs its servers) and writes a hardware file (default stdout) for\n"
    "pdmoe plan/search --hardware FILE: memory read bandwidth, int8 peak, the GEMV's and GEMM's\n"
    "efficiencies, the UCX hand-off, the per-step and per-token CPU costs fitted to engine steps, and\n"
    "the PD path's fixed cost per request, timed through a `pdmoe up` it starts on 127.0.0.1 at the\n"
    "first free ports from P (default 8400: P, P+1, P+2 and P+100).\n"
    "--verbose prints, after each round of steps, their times, the rounds' levels and which were kept\n"
    "(docs/perf-model.md), and the CPU time this process ran per second (below N: other work took the cores).\n";

/* f[0] prefill, f[1] decode; request_s with how it was measured (NULL: not yet) */
static json_t *hardware_json(const char *cpu, int threads, int cards, double mem, const struct pd_bench_machine *m,
                             double ucx_bw, double ucx_lat, const struct pd_calib_fit *f,
                             const struct pd_calib_rounds *fr, const char *model, double request_s,
                             const char *request_src)
{
    char when[32], tag[128];
    time_t now = time(NULL);
    strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", gmtime(&now));
    snprintf(tag, sizeof tag, "pdmoe calibrate, %s, %d thread%s per process", when, threads, threads > 1 ? "s" : "");
    char s_bw[512], s_peak[512], s_gemm[512], s_mem[512], s_fit[1536], s_ucx[512];
    snprintf(s_bw, sizeof s_bw, "%s: the larger of an int64 sum over %d MiB (best of %d) and the int8 GEMV's stream: "
             "%.2f GB/s", tag, m->bw_mib, m->bw_runs, m->bw / 1e9);
    char s_bf16[512];
    snprintf(s_peak, sizeof s_peak, "%s: %s (nominal clock %.2f GHz): %.1f Gops/s", tag, m->int8_probe, m->clock_hz / 1e9,
             m->int8_peak / 1e9);
    /* the float products' peak: a quarter of VNNI's where it is, else the FMA probe itself (an
     * AVX2-only host has no VPDPBUSD to take a quarter of) */
    const double bf16_flops = m->vnni_peak > 0 ? m->vnni_peak / 4 : m->fp32_peak;
    if (m->vnni_peak > 0)
        snprintf(s_bf16, sizeof s_bf16, "%s: independent VPDPBUSD chains (nominal clock %.2f GHz): %.1f Gops/s; fp32 FMA peak taken "
                 "as a quarter (16 lanes x 2 flops vs 16 x 4 x 2 int8 ops per instruction)", tag, m->clock_hz / 1e9,
                 m->vnni_peak / 1e9);
    else
        snprintf(s_bf16, sizeof s_bf16, "%s: fp32 FMA peak of independent %s chains: %.1f GFLOPS", tag,
                 m->fp32_probe ? m->fp32_probe : "(no FMA probe on this CPU)", m->fp32_peak / 1e9);
    snprintf(s_gemm, sizeof s_gemm, "%s: 2048x4096 int8 GEMM over %d tokens: %.1f Gops/s = %.3f of the int8 peak", tag,
             m->gemm_tokens, m->gemm_ops / 1e9, m->gemm_ops / m->int8_peak);
    snprintf(s_mem, sizeof s_mem, "%s: fitted to the decode steps (the small expert matrices' stream); a "
             "4096x14336 int8 GEMV reaches %.2f GB/s = %.3f of the read bandwidth", tag, m->gemv_bw / 1e9,
             m->gemv_bw / m->bw);
    int len = snprintf(s_fit, sizeof s_fit, "%s: fitted to %s's engine steps (prefill of 16-512 tokens: rms error "
                       "%.1f%%; decode of 1-16 sequences at 64 and 512 cached tokens: rms error %.1f%%)", tag, model,
                       100 * f[0].rms_rel, 100 * f[1].rms_rel);
    if (fr)
        snprintf(s_fit + len, sizeof s_fit - (size_t)len, ", each step's fastest over the rounds kept (neither slowed by other work nor one lucky "
                 "fast round: prefill %d, decode %d of %d); with each of those left out in turn the fit ranges over prefill %.3f-%.3f ms per step, %.2f-%.2f us per token and layer, attention %.3f-%.3f; "
                 "decode %.3f-%.3f ms, %.2f-%.2f us, memory %.3f-%.3f", fr[0].kept, fr[1].kept, fr[0].rounds, fr[0].lo.step_s * 1e3,
                 fr[0].hi.step_s * 1e3, fr[0].lo.token_layer_s * 1e6, fr[0].hi.token_layer_s * 1e6, fr[0].lo.attention,
                 fr[0].hi.attention, fr[1].lo.step_s * 1e3, fr[1].hi.step_s * 1e3, fr[1].lo.token_layer_s * 1e6,
                 fr[1].hi.token_layer_s * 1e6, fr[1].lo.memory, fr[1].hi.memory);
    snprintf(s_ucx, sizeof s_ucx, "%s: one UCX get between two workers of one process: %.2f GB/s for 64 MiB; latency = 3 "
             "round trips (GET_META, the get, DONE/ACK) of a 4 KiB get there. Between processes a hand-off costs more "
             "(the control round trip, UCX's connection): that part of pdmoe's fixed cost per request is in "
             "efficiency.request_s, fitted to requests through pdmoe up", tag, ucx_bw / 1e9);
    const char *none = "not used on one CPU process per role (no expert parallelism, no overlap)";
    json_t *eff = json_pack("{s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f}", "request_s",
                            request_s, "gemm",
                            m->gemm_ops / m->int8_peak, "memory", f[1].memory, "attention", f[0].attention,
                            "a2a_intra", 1.0, "a2a_inter", 1.0, "a2a_latency_s", 0.0, "imbalance_prefill", 1.0,
                            "imbalance_decode", 1.0, "imbalance_eplb_prefill", 1.0, "imbalance_eplb_decode", 1.0, "overlap_prefill", 0.0, "overlap_decode", 0.0, "step_prefill_s",
                            f[0].step_s, "step_decode_s", f[1].step_s, "token_layer_prefill_s", f[0].token_layer_s,
                            "token_layer_decode_s", f[1].token_layer_s, "mtp_acceptance", 0.0);
    json_t *src = json_pack("{s:s,s:s,s:s,s:s,s:s,s:s,s:s,s:s,s:s,s:s,s:s,s:s,s:s,s:s,s:s,s:s,s:s,s:s}", "request_s",
                            request_src ? request_src : "not measured yet", "gemm", s_gemm, "memory",
                            s_mem, "attention", s_fit, "a2a_intra", none, "a2a_inter", none, "a2a_latency_s", none,
                            "imbalance_prefill", none, "imbalance_decode", none,
                            "imbalance_eplb_prefill", none, "imbalance_eplb_decode", none, "overlap_prefill", none,
                            "overlap_decode", none, "step_prefill_s", s_fit, "step_decode_s", s_fit, "token_layer_prefill_s",
                            s_fit, "token_layer_decode_s", s_fit, "mtp_acceptance", "not measured by calibrate (it runs no drafts): pdmoe plan --spec-stats FILE takes the "
                            "engine's measured rates (pdmoe generate --speculative-config ... --spec-stats FILE)");
    return json_pack(
        "{s:s,s:s,s:i,s:i,s:{s:s,s:f,s:f,s:f,s:f,s:f},s:{s:{s:s,s:f,s:f},s:{s:s,s:f,s:f},s:{s:s,s:f,s:f}},"
        "s:{s:f,s:f},s:o,s:{s:s,s:s,s:s,s:s,s:s,s:o}}",
        "name", "local CPU", "description", tag, "cluster_nodes", 1, "cards_per_node", cards, "card", "name", cpu,
        "memory_bytes", mem, "memory_bandwidth_Bps", m->bw, "bf16_flops", bf16_flops, "int8_ops", m->int8_peak,
        "fp8_flops", 0.0, "links", "intra_node", "name", "shared memory (UCX)", "bandwidth_Bps", ucx_bw, "latency_s",
        ucx_lat, "inter_node_rdma", "name", "UCX on this machine (the transfer's own round trips)", "bandwidth_Bps",
        ucx_bw, "latency_s", ucx_lat, "inter_node_tcp", "name", "UCX on this machine (the transfer's own round trips)",
        "bandwidth_Bps",
        ucx_bw, "latency_s", ucx_lat, "runtime_overhead_bytes", "prefill", 2e8, "decode", 2e8, "efficiency", eff,
        "sources", "memory_bandwidth_Bps", s_bw, "int8_ops", s_peak, "bf16_flops", s_bf16, "links", s_ucx,
        "runtime_overhead_bytes", "pdmoe's assumption: the process, its thread pool and the HTTP front", "efficiency",
        src);
}

/* ------------------------------------------------------------------ the PD path's cost per request */

static int port_free(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int ok = fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
    if (fd >= 0)
        close(fd);
    return ok;
}

/* The first port p from `from` (steps of 7) with p, p+1, p+2 and p+100 free: pdmoe up's proxy,
 * prefill, decode and KV listener; 0 if none. */
static int free_ports(int from)
{
    for (int p = from; p < from + 7 * 64 && p + 100 < 65536; p += 7)
        if (port_free(p) && port_free(p + 1) && port_free(p + 2) && port_free(p + 100))
            return p;
    return 0;
}

/* Seconds from connecting to the first streamed token of one completion of `prompt` through the
 * proxy at 127.0.0.1:port (what `pdmoe bench serve` calls TTFT); < 0 on failure, with e set. */
static double ttft_once(int port, const char *prompt, pd_err *e)
{
    json_t *b = json_pack("{s:s,s:i,s:b,s:f}", "prompt", prompt, "max_tokens", 2, "stream", 1, "temperature", 0.0);
    char *body = b ? json_dumps(b, JSON_COMPACT) : NULL;
    json_decref(b);
    char head[256];
    int hn = body ? snprintf(head, sizeof head, "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: "
                             "application/json\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n", port, strlen(body)) : 0;
    double t0 = pd_now_s(), first = -1;
    int fd = body ? socket(AF_INET, SOCK_STREAM, 0) : -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {30, 0};
    char buf[65536];
    size_t got = 0;
    if (fd >= 0 && setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) == 0 &&
        connect(fd, (struct sockaddr *)&a, sizeof a) == 0 && write(fd, head, (size_t)hn) == hn &&
        write(fd, body, strlen(body)) == (ssize_t)strlen(body)) {
        ssize_t n;
        while ((n = read(fd, buf + got, sizeof buf - 1 - got)) > 0) {
            got += (size_t)n;
            buf[got] = 0;
            const char *h = strstr(buf, "\r\n\r\n");
            if (first < 0 && h && strstr(h, "\"text\""))
                first = pd_now_s() - t0;
            if (got == sizeof buf - 1)
                got = 0;   /* only the first chunk matters; drain the rest */
        }
        if (first >= 0 && strncmp(buf, "HTTP/1.1 200", 12) != 0 && strstr(buf, "HTTP/1.1 ") == buf)
            first = -1;
    }
    if (first < 0)
        pd_err_set(e, PD_EIO, "a completion through pdmoe up at 127.0.0.1:%d gave no streamed token%s%.200s", port,
                   got ? ": " : "", got ? buf : "");
    if (fd >= 0)
        close(fd);
    free(body);
    return first;
}

/* The last non-empty line written to fd (a log file, read from its start), at most cap - 1 bytes
 * of its end; "" if none. */
static void last_line(int fd, char *out, size_t cap)
{
    out[0] = 0;
    char buf[8192];
    off_t end = fd >= 0 ? lseek(fd, 0, SEEK_END) : -1;
    if (end <= 0)
        return;
    off_t from = end > (off_t)sizeof buf - 1 ? end - (off_t)sizeof buf + 1 : 0;
    ssize_t n = pread(fd, buf, sizeof buf - 1, from);
    if (n <= 0)
        return;
    buf[n] = 0;
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r'))
        buf[--n] = 0;
    const char *nl = strrchr(buf, '\n');
    const char *line = nl ? nl + 1 : buf;
    size_t len = strlen(line);
    if (len >= cap) {
        line += len - (cap - 1);
        len = cap - 1;
    }
    memcpy(out, line, len);
    out[len] = 0;
}

/* Starts `pdmoe up` (this binary) for the model in dir at a free port from `from`, streams `n`
 * completions of `prompt` one at a time (after one to warm up) and stops it: the median TTFT. */
static int measure_ttft(const char *dir, int threads, int from, const char *prompt, int n, double *median_s, pd_err *e)
{
    int port = free_ports(from);
    if (!port)
        return pd_err_set(e, PD_EIO, "no free ports for pdmoe up from %d (--port)", from);
    char self[4096], sport[16], sth[16];
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
    if (k <= 0)
        return pd_err_set(e, PD_EIO, "cannot find this binary (/proc/self/exe)");
    self[k] = 0;
    snprintf(sport, sizeof sport, "%d", port);
    snprintf(sth, sizeof sth, "%d", threads);
    /* up's stderr kept in an unlinked file: its last line says why, should it end before serving
     * (a bare "exited before it served" left the operator nothing to go on) */
    const char *tmpdir = getenv("TMPDIR");
    char logt[PATH_MAX];
    int ln = snprintf(logt, sizeof logt, "%s/pdmoe-calibrate-XXXXXX", tmpdir && *tmpdir ? tmpdir : "/tmp");
    int logfd = ln > 0 && (size_t)ln < sizeof logt ? mkstemp(logt) : -1;
    if (logfd >= 0)
        unlink(logt);
    pid_t pid = fork();
    if (pid < 0) {
        if (logfd >= 0)
            close(logfd);
        return pd_err_set(e, PD_EIO, "cannot start pdmoe up");
    }
    if (pid == 0) {
        int null = open("/dev/null", O_WRONLY);
        if (null >= 0)
            dup2(null, 1);
        dup2(logfd >= 0 ? logfd : null, 2);
        execl(self, self, "up", "--model", dir, "--port", sport, "--threads", sth, (char *)NULL);
        _exit(127);
    }
    double *t = calloc((size_t)n, sizeof *t);
    int rc = t ? 0 : pd_err_set(e, PD_ENOMEM, "out of memory");
    /* healthy once a completion streams: pdmoe up waits for every server before the proxy serves */
    double end = pd_now_s() + 120;
    pd_err quiet = {0};
    while (!rc && ttft_once(port, prompt, &quiet) < 0) {
        if (waitpid(pid, NULL, WNOHANG) == pid) {
            pid = 0;
            char last[512];
            last_line(logfd, last, sizeof last);
            rc = pd_err_set(e, PD_EIO, "pdmoe up --port %d exited before it served (%s)%s%s", port, quiet.msg,
                            last[0] ? "; its last words: " : "", last);
        } else if (pd_now_s() > end) {
            rc = pd_err_set(e, PD_EIO, "pdmoe up --port %d did not serve within 120 s (%s)", port, quiet.msg);
        } else {
            usleep(200000);
        }
    }
    for (int i = 0; !rc && i < n; i++)
        if ((t[i] = ttft_once(port, prompt, e)) < 0)
            rc = e->code ? e->code : PD_EIO;
    if (pid > 0) {
        kill(pid, SIGINT);
        waitpid(pid, NULL, 0);
    }
    if (!rc)
        *median_s = pd_bench_median(t, n);
    free(t);
    if (logfd >= 0)
        close(logfd);
    return rc;
}

static void cpu_name(char *out, size_t n)
{
    snprintf(out, n, "x86-64 CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "model name", 10) == 0) {
            char *c = strchr(line, ':');
            if (c) {
                c += 2;
                c[strcspn(c, "\n")] = 0;
                snprintf(out, n, "%s", c);
            }
            break;
        }
    if (f)
        fclose(f);
}

/* The 1-minute load average, -1 if unknown. */
static double load_average(void)
{
    double load = -1;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &load) != 1)
            load = -1;
        fclose(f);
    }
    return load;
}

/* What to do when the measurements cannot determine the model: the load they were taken under. */
static const char *busy_advice(void)
{
    static char buf[256];
    double load = load_average();
    snprintf(buf, sizeof buf, "the machine was busy (load average %.2f on %ld cores): run pdmoe calibrate when no "
             "other process uses these cores, without --quick for more rounds", load, sysconf(_SC_NPROCESSORS_ONLN));
    return buf;
}

/* Why a role's fit is not written: the factors its rounds could not determine. */
static void undetermined(const struct pd_calib_rounds *r, enum pd_role role, char *buf, size_t n)
{
    static const char *const name[2][3] = {{"per-step cost", "per-token cost", "attention factor"},
                                           {"per-step cost", "per-token cost", "memory factor"}};
    size_t len = (size_t)snprintf(buf, n, "%s: ", pd_role_name(role));
    if (r->fit.rms_rel > PD_CALIB_MAX_RMS) {
        snprintf(buf + len, n - len, "the model misses its steps by %.0f%% (rms) even on their fastest times",
                 100 * r->fit.rms_rel);
        return;
    }
    if (r->fitted < 2) {
        snprintf(buf + len, n - len, "only %d of %d rounds could be used (%d kept: the others ran over %.0f%% slower "
                 "or %.0f%% faster than each step's second-fastest time)", r->fitted, r->rounds, r->kept, 100 * (PD_CALIB_BUSY - 1),
                 100 * (1 - PD_CALIB_FAST));
        return;
    }
    int any = 0;
    for (int k = 0; k < 3; k++)
        any |= (r->undetermined >> k & 1) && r->moved[k] > PD_CALIB_DETERMINED;
    if (!any) {   /* no factor alone moves a step past the bound: the times they predict together do */
        snprintf(buf + len, n - len, "the step times its fits predict move by up to %.0f%% between rounds (no factor "
                 "alone by more than %.0f%%: they trade against each other)", 100 * r->spread,
                 100 * fmax(r->moved[0], fmax(r->moved[1], r->moved[2])));
        return;
    }
    for (int k = 0; k < 3 && len < n; k++)
        if ((r->undetermined >> k & 1) && r->moved[k] > PD_CALIB_DETERMINED)
            len += (size_t)snprintf(buf + len, n - len, "%s%s moves a step by up to %.0f%% between rounds",
                                    buf[len - 2] == ':' ? "" : "; ", name[role][k], 100 * r->moved[k]);
}

/* Both roles' undetermined factors, "; "-joined, into buf. */
static const char *undetermined_both(const struct pd_calib_rounds fr[2], char *buf, size_t n)
{
    char why[2][256] = {"", ""};
    for (int r = 0; r < 2; r++)
        if (fr[r].undetermined)
            undetermined(&fr[r], (enum pd_role)r, why[r], sizeof why[r]);
    snprintf(buf, n, "%s%s%s", why[0], why[0][0] && why[1][0] ? "; " : "", why[1]);
    return buf;
}

/* --verbose, after each round: its wall time, the CPU time this process ran per second of it (below
 * --threads: other processes, or the hypervisor, took the cores), the CPU time the hypervisor
 * stole, RSS and page faults; each step's time; from the third round on, each round's level
 * (plan/calibrate.h) and whether it was kept (k), busy (b) or fast (f). fr NULL: no fit yet.
 * Round 0: before the first, only the clocks are read. */
static void print_round(int n_pre, int n_pts, const double *tp, const double *td, int rounds,
                        const struct pd_calib_rounds *fr)
{
    static double prev_wall, prev_cpu, prev_steal;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double wall = pd_now_s(), steal = 0, cpu = (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 +
                                                (double)ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
    long rss_pages = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f) {
        if (fscanf(f, "%*s %ld", &rss_pages) != 1)
            rss_pages = 0;
        fclose(f);
    }
    unsigned long long v[8] = {0};
    f = fopen("/proc/stat", "r");
    if (f) {
        if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6],
                   &v[7]) == 8)
            steal = (double)v[7] / (double)sysconf(_SC_CLK_TCK);
        fclose(f);
    }
    double dt = wall - prev_wall, dcpu = cpu - prev_cpu, dsteal = steal - prev_steal;
    prev_wall = wall, prev_cpu = cpu, prev_steal = steal;
    if (rounds == 0)
        return;
    fprintf(stderr, "  round %d: %.1f s, this process ran %.2f CPU s per s, the hypervisor stole %.1f CPU s; RSS %.2f GB, "
            "%ld minor and %ld major page faults so far\n", rounds, dt, dcpu / dt, dsteal, (double)rss_pages * (double)sysconf(_SC_PAGESIZE) / 1e9, ru.ru_minflt, ru.ru_majflt);
    for (int r = 0; r < 2; r++) {
        int from = r ? n_pre : 0, to = r ? n_pts : n_pre, n = to - from;
        const double *t = r ? td : tp;
        fprintf(stderr, "    %s ms:", pd_role_name((enum pd_role)r));
        for (int i = 0; i < n; i++)
            fprintf(stderr, " %.2f", t[(rounds - 1) * n + i] * 1e3);
        if (fr) {
            fprintf(stderr, "; levels of rounds 1-%d:", rounds);
            for (int k = 0; k < rounds; k++)
                fprintf(stderr, " %.3f%s", fr[r].level[k],
                        fr[r].keep[k] ? "k" : fr[r].level[k] > PD_CALIB_BUSY ? "b" : "f");
        }
        fputc('\n', stderr);
    }
}

int pd_cli_calibrate(int argc, char **argv)
{
    static const struct option opts[] = {
        {"model", 1, 0, 'm'}, {"threads", 1, 0, 'j'}, {"out", 1, 0, 'o'}, {"quick", 0, 0, 'q'}, {"help", 0, 0, 'h'},
        {"port", 1, 0, 'p'}, {"verbose", 0, 0, 'v'}, {0, 0, 0, 0},
    };
    const char *dir = "models/mini", *out = NULL;
    int64_t threads = 1, port = 8400;
    int quick = 0, verbose = 0, c;
    struct pd_cli_seen seen = {0};
    optind = 1;
    opterr = 0;
    while ((c = pd_cli_getopt("calibrate", argc, argv, opts, NULL, NULL, &seen)) != -1) {
        switch (c) {
        case 'm': dir = optarg; break;
        case 'j': if (pd_cli_int_max("--threads", optarg, 1, 256, &threads)) return 2; break;
        case 'o': out = optarg; break;
        case 'q': quick = 1; break;
        case 'v': verbose = 1; break;
        case 'p': if (pd_cli_int_max("--port", optarg, 1, 65000, &port)) return 2; break;
        case 'h': fputs(help, stdout); return 0;
        default: return pd_cli_bad_flag("calibrate", c, argc, argv);
        }
    }
    if (pd_cli_no_args("calibrate", argc, argv))
        return 2;
    /* --out is written after minutes of measuring: a path that cannot be written is said now */
    if (out) {
        struct stat st;
        int existed = stat(out, &st) == 0;
        int fd = open(out, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
        if (fd < 0) {
            fprintf(stderr, "pdmoe calibrate: --out %s: cannot write: %s\n", out, strerror(errno));
            return 1;
        }
        close(fd);
        if (!existed)
            unlink(out);
    }
    pd_err e = {0};
    struct pd_engine en;
    struct pd_engine_opts eo = {.dir = dir, .threads = (int)threads, .max_seqs = 16, .max_model_len = 1024};
    if (pd_engine_open(&en, &eo, &e)) {
        fprintf(stderr, "pdmoe calibrate: %s\n", e.msg);
        return 1;
    }
    fprintf(stderr, "pdmoe calibrate: measuring this machine with %lld thread%s...\n", (long long)threads,
            threads > 1 ? "s" : "");
    /* the steps read English text (the embedded corpus, through the model's own tokenizer), so
     * their routing is a real prompt's, not one token repeated */
    int32_t *words = NULL;
    size_t n_words = 0;
    struct pd_tok *tok = NULL;
    char tpath[PATH_MAX];
    const char *corpus = pd_embedded_find("models/corpus.txt");
    int long_path = pd_path_join(tpath, sizeof tpath, dir, "tokenizer.json", &e);
    /* the request timed through pdmoe up: the corpus's first sentence or so, cut at a space */
    char prompt[200];
    size_t plen = corpus ? strlen(corpus) : 0;
    plen = plen < sizeof prompt - 1 ? plen : sizeof prompt - 1;
    while (corpus && plen > 1 && corpus[plen] != ' ' && corpus[plen] != 0)
        plen--;
    snprintf(prompt, sizeof prompt, "%.*s", (int)plen, corpus ? corpus : "");
    int32_t *pids = NULL;
    size_t n_pids = 0;
    if (!corpus || long_path || pd_tok_load(tpath, &tok, &e) || pd_tok_encode(tok, corpus, strlen(corpus), &words, &n_words, &e) ||
        pd_tok_encode(tok, prompt, strlen(prompt), &pids, &n_pids, &e)) {
        fprintf(stderr, "pdmoe calibrate: %s\n", corpus ? e.msg : "no embedded corpus");
        pd_tok_free(tok);
        free(words);
        pd_engine_close(&en);
        return 1;
    }
    int64_t prompt_tokens = (int64_t)n_pids + (pd_tok_bos(tok) >= 0);   /* as the server counts it */
    free(pids);
    pd_tok_free(tok);
    /* engine steps: prefill at six lengths, decode at five batches and two contexts */
    struct pd_calib_point pts[] = {
        {PD_ROLE_PREFILL, 1, 16, 0, 0, 0}, {PD_ROLE_PREFILL, 1, 32, 0, 0, 0}, {PD_ROLE_PREFILL, 1, 64, 0, 0, 0},
        {PD_ROLE_PREFILL, 1, 128, 0, 0, 0}, {PD_ROLE_PREFILL, 1, 256, 0, 0, 0}, {PD_ROLE_PREFILL, 1, 512, 0, 0, 0},
        {PD_ROLE_DECODE, 1, 1, 64, 0, 0}, {PD_ROLE_DECODE, 2, 1, 64, 0, 0}, {PD_ROLE_DECODE, 4, 1, 64, 0, 0},
        {PD_ROLE_DECODE, 8, 1, 64, 0, 0}, {PD_ROLE_DECODE, 16, 1, 64, 0, 0}, {PD_ROLE_DECODE, 1, 1, 512, 0, 0},
        {PD_ROLE_DECODE, 8, 1, 512, 0, 0},
    };
    const int n_pts = (int)(sizeof pts / sizeof pts[0]), n_pre = 6;
    /* rounds of every step, until the fits are stable (plan/calibrate.h): at least min_rounds,
     * at most max_rounds */
    const int min_rounds = 3, max_rounds = quick ? 6 : 8, reps = quick ? 1 : 2;
    double tp[8 * 6], td[8 * 7];   /* each role's times, round-major */
    int rounds = 0;
    struct pd_calib_rounds fr[2];
    struct pd_bench_machine m;
    if (pd_bench_machine_measure((int)threads, quick, &m)) {
        pd_engine_close(&en);
        free(words);
        return 1;
    }
    if (m.gemv_bw > m.bw)   /* the GEMV streamed faster than the sum loop: the sum loop undercounted */
        m.bw = m.gemv_bw;
    double t_big = pd_bench_ucx_get_time((size_t)64 << 20, quick ? 2 : 5), t_small = pd_bench_ucx_get_time(4096, 20);
    if (!(t_big > 0) || !(t_small > 0)) {
        fprintf(stderr, "pdmoe calibrate: UCX could not move data between two workers of this process (a get of %s "
                "failed), so the hand-off is not measured; check UCX_TLS and that UCX's shared-memory or TCP transports "
                "load (ucx_info -d)\n", t_big > 0 ? "4 KiB" : "64 MiB");
        pd_engine_close(&en);
        free(words);
        return 1;
    }
    double ucx_bw = (double)(64 << 20) / t_big, ucx_lat = 3 * t_small;
    /* the kernel factors first, then a provisional description to cost the steps and fit the rest */
    char cpu[128];
    cpu_name(cpu, sizeof cpu);
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int cards = cores / threads > 0 ? (int)(cores / threads) : 1;
    double mem = (double)sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE) / cards;
    const double gemv = m.gemv_bw / m.bw;   /* the memory factor until the decode fit replaces it */
    struct pd_calib_fit f[2] = {{.attention = 1, .memory = gemv}, {.attention = 1, .memory = gemv}};
    json_t *j = hardware_json(cpu, (int)threads, cards, mem, &m, ucx_bw, ucx_lat, f, NULL, dir, 0, NULL);
    char *desc = j ? json_dumps(j, 0) : NULL;
    json_decref(j);
    struct pd_hardware hw;
    int rc = desc ? pd_hardware_parse(desc, "calibrate's measurements", &hw, &e)
                  : pd_err_set(&e, PD_ENOMEM, "out of memory");
    free(desc);
    if (rc) {
        fprintf(stderr, "pdmoe calibrate: %s\n", e.msg);
        pd_engine_close(&en);
        free(words);
        return 1;
    }
    struct pd_plan_opts po;
    pd_plan_opts_default(&po);
    po.model = dir;
    po.hw = &hw;
    po.mtp = 0;
    po.kv_dtype = PD_KV_BF16;
    po.max_model_len = 1024;
    po.role[0] = po.role[1] = (struct pd_role_opts){.dp = 1, .tp = 1, .instances = 1};
    po.nodes = 1;
    struct pd_plan p;
    if (pd_plan_build(&po, &p, &e)) {
        fprintf(stderr, "pdmoe calibrate: %s\n", e.msg);
        pd_engine_close(&en);
        free(words);
        return 1;
    }
    /* the steps, round after round, until every fitted factor is determined */
    if (verbose)
        print_round(n_pre, n_pts, tp, td, 0, NULL);
    for (;;) {
        for (int i = 0; i < n_pts; i++)
            if (pd_bench_step_time(&en, (int)pts[i].seqs, (int)pts[i].tokens, (int)pts[i].ctx,
                                   pts[i].role == PD_ROLE_DECODE ? 16 : 1, words, n_words, reps,
                                   i < n_pre ? &tp[rounds * n_pre + i] : &td[rounds * (n_pts - n_pre) + i - n_pre],
                                   &e)) {
                fprintf(stderr, "pdmoe calibrate: %s\n", e.msg);
                pd_plan_free(&p);
                pd_engine_close(&en);
                free(words);
                return 1;
            }
        rounds++;
        if (rounds < min_rounds) {
            if (verbose)
                print_round(n_pre, n_pts, tp, td, rounds, NULL);
            continue;
        }
        rc = pd_calib_fit_rounds(&p, pts, n_pre, tp, rounds, 0, &fr[0], &e) ||
             pd_calib_fit_rounds(&p, pts + n_pre, n_pts - n_pre, td, rounds, fr[0].fit.attention, &fr[1], &e);
        if (verbose)
            print_round(n_pre, n_pts, tp, td, rounds, rc ? NULL : fr);
        if (rounds == max_rounds || (!rc && !fr[0].undetermined && !fr[1].undetermined))
            break;
        char why[520];
        fprintf(stderr, "  round %d: not determined yet (%s), measuring again\n", rounds,
                rc ? e.msg : undetermined_both(fr, why, sizeof why));
    }
    free(words);
    pd_engine_close(&en);
    if (rc) {
        pd_plan_free(&p);
        fprintf(stderr, "pdmoe calibrate: nothing written: after %d rounds %s; %s\n", rounds, e.msg, busy_advice());
        return 1;
    }
    if (fr[0].undetermined || fr[1].undetermined) {
        char why[520];
        fprintf(stderr, "pdmoe calibrate: nothing written: after %d rounds the steps do not determine the model (%s), "
                "so any value written would be noise; %s\n", rounds, undetermined_both(fr, why, sizeof why),
                busy_advice());
        pd_plan_free(&p);
        return 1;
    }
    f[0] = fr[0].fit;
    f[1] = fr[1].fit;
    char amx_note[64] = "", int8_note[80] = "";
    if (m.amx_peak > 0)
        snprintf(amx_note, sizeof amx_note, ", AMX peak %.1f Gops/s", m.amx_peak / 1e9);
    /* the peak the GEMM is against: AMX's or VNNI's, or without VNNI the AVX2 kernel's vpmaddwd */
    const int amx = m.int8_peak == m.amx_peak && m.amx_peak > 0, vnni = m.vnni_peak > 0;
    if (vnni)
        snprintf(int8_note, sizeof int8_note, ", VNNI peak %.1f Gops/s", m.vnni_peak / 1e9);
    else if (!amx)
        snprintf(int8_note, sizeof int8_note, ", int8 peak %.1f Gops/s (no VNNI here)", m.int8_peak / 1e9);
    fprintf(stderr, "  read bandwidth %.2f GB/s%s%s, GEMV %.2f of bandwidth, GEMM %.2f of the %s peak\n",
            m.bw / 1e9, int8_note, amx_note, m.gemv_bw / m.bw, m.gemm_ops / m.int8_peak,
            amx ? "AMX" : vnni ? "VNNI" : "int8");
    if (!amx && !vnni)
        fprintf(stderr, "  int8 peak: %s\n", m.int8_probe);
    fprintf(stderr, "  UCX hand-off %.2f GB/s, %.1f us fixed\n", ucx_bw / 1e9, ucx_lat * 1e6);
    fprintf(stderr, "  steps in %d rounds (prefill %d and decode %d kept: not slowed by other work, nor one lucky fast round); each fit on the fastest "
            "time of every step, in brackets its range with each round left out in turn:\n", rounds, fr[0].kept,
            fr[1].kept);
    for (int r = 0; r < 2; r++) {
        const struct pd_calib_rounds *x = &fr[r];
        double v = r ? f[r].memory : f[r].attention, lo = r ? x->lo.memory : x->lo.attention,
               hi = r ? x->hi.memory : x->hi.attention;
        /* a cost the fit put at its bound reads as such, with what the rounds still allow, not as a
         * measured 0.000 */
        char step[96], per_tok[96];
        if (f[r].step_s > 0)
            snprintf(step, sizeof step, "%.3f ms per step (a round left out: %.3f-%.3f)", f[r].step_s * 1e3,
                     x->lo.step_s * 1e3, x->hi.step_s * 1e3);
        else
            snprintf(step, sizeof step, "no cost per step beyond the model's (at most %.3f ms)", x->hi.step_s * 1e3);
        if (f[r].token_layer_s > 0)
            snprintf(per_tok, sizeof per_tok, "%.2f us per token and layer (a round left out: %.2f-%.2f)",
                     f[r].token_layer_s * 1e6, x->lo.token_layer_s * 1e6, x->hi.token_layer_s * 1e6);
        else
            snprintf(per_tok, sizeof per_tok, "no cost per token and layer beyond the model's (at most %.2f us)",
                     x->hi.token_layer_s * 1e6);
        fprintf(stderr, "  fitted %-7s: %s, %s, %s factor %.3f (a round left out: %.3f-%.3f%s); rms error %.1f%%\n",
                pd_role_name((enum pd_role)r), step, per_tok, r ? "memory" : "attention", v, lo, hi,
                v >= 1 ? ", at its bound: no slower than the roofline" : "", 100 * f[r].rms_rel);
    }
    /* (the fit takes each step's fastest time over every round, the ranges the fits on the other
     * rounds' fastest: leaving out the round that ran a step fastest moves a factor past the
     * fit's own value, and factors that trade against each other swing while the times they
     * predict hold, which is what decides that a fit is determined) */
    fprintf(stderr, "  (the fit is on each step's fastest time over the rounds kept; factors that trade against each other "
                    "may swing between the fits that leave a round out while the step times they predict hold)\n");
    fprintf(stderr, "  %-8s %5s %7s %5s %12s %12s\n", "step", "seqs", "tokens", "ctx", "measured ms", "model ms");
    for (int i = 0; i < n_pts; i++)
        fprintf(stderr, "  %-8s %5lld %7lld %5lld %12.3f %12.3f\n", pd_role_name(pts[i].role), (long long)pts[i].seqs,
                (long long)pts[i].tokens, (long long)pts[i].ctx, pts[i].measured_s * 1e3, pts[i].fitted_s * 1e3);
    /* what the model leaves out of a request's TTFT: a short prompt through the real PD path,
     * minus the model's own terms for it (request_s still 0) */
    double ttft = 0, model_ttft = 0, request_s = 0;
    char s_req[512];
    /* the plan the fit used, with the fitted factors (the ones hardware_json writes from f), and
     * as pdmoe up serves: one sequence at a time in the decode step that follows */
    p.hw.eff.attention = f[0].attention;
    p.hw.eff.memory = f[1].memory;
    for (int r = 0; r < 2; r++) {
        p.hw.eff.step_s[r] = f[r].step_s;
        p.hw.eff.token_layer_s[r] = f[r].token_layer_s;
    }
    p.o.max_num_seqs = 1;
    struct pd_workload w;
    pd_workload_default(&w);
    w.isl = prompt_tokens;
    w.osl = 2;
    struct pd_perf pf;
    rc = pd_perf_eval(&p, &w, &pf, &e);
    model_ttft = pf.ttft_s;
    pd_plan_free(&p);
    if (!rc) {
        fprintf(stderr, "  timing %d requests of %lld tokens through pdmoe up...\n", quick ? 5 : 9, (long long)prompt_tokens);
        rc = measure_ttft(dir, (int)threads, (int)port, prompt, quick ? 5 : 9, &ttft, &e);
    }
    if (rc) {
        fprintf(stderr, "pdmoe calibrate: %s\n", e.msg);
        return 1;
    }
    /* when the model's own terms already reach the measured TTFT, the data show no fixed cost on
     * top of them: 0, and said so (not a bare 0.00) */
    request_s = ttft > model_ttft ? ttft - model_ttft : 0;
    snprintf(s_req, sizeof s_req, "pdmoe calibrate: median TTFT of %d streamed completions of a %lld-token prompt "
             "through pdmoe up (%.2f ms) minus the model's prefill, hand-off and first decode step for it (%.2f ms)%s",
             quick ? 5 : 9, (long long)prompt_tokens, ttft * 1e3, model_ttft * 1e3,
             request_s > 0 ? "" : ": the model's terms reach the measured TTFT, so no fixed cost is added");
    if (request_s > 0)
        fprintf(stderr, "  PD path per request: %.2f ms (TTFT %.2f ms through pdmoe up, %.2f ms of it modelled)\n",
                request_s * 1e3, ttft * 1e3, model_ttft * 1e3);
    else
        fprintf(stderr, "  PD path per request: none beyond the model (TTFT %.2f ms through pdmoe up, the model's terms "
                "%.2f ms: %.0f%% of it)\n", ttft * 1e3, model_ttft * 1e3, 100 * model_ttft / ttft);
    j = hardware_json(cpu, (int)threads, cards, mem, &m, ucx_bw, ucx_lat, f, fr, dir, request_s, s_req);
    char *text = j ? json_dumps(j, JSON_INDENT(2)) : NULL;
    json_decref(j);
    if (!text) {
        fprintf(stderr, "pdmoe calibrate: out of memory\n");
        return 1;
    }
    rc = 0;
    if (out) {
        if (pd_cli_write_file("calibrate", "--out", out, text))
            rc = 1;
        else
            fprintf(stderr, "  wrote %s\n", out);
    } else {
        puts(text);
    }
    free(text);
    return rc;
}

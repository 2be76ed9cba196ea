/* `pdmoe bench soak`: `pdmoe up` under load while its processes die. --streams client threads
 * send streaming completions (random prompt and output lengths) for --seconds; one request in
 * ten hangs up after its first chunk (a client that goes away); a third of the way in the
 * prefill instance 0 is SIGKILLed, two thirds in the decode instance 0. Then it waits for `up`
 * to have restarted both and for the instances to be idle, and reports:
 *   requests ok (whole stream, [DONE]), errored (an error the client was told of: a 5xx with a
 *   JSON error, or an error event then [DONE]), cut (a 200 that ended without [DONE], or no
 *   answer in 60 s: must be 0), disconnected (by the client, on purpose);
 *   leaked KV blocks and leases on every instance once idle (blocks neither free nor held by the
 *   prefix cache, and leases: must be 0; a lease that the dead
 *   decode instance had begun to pull is held until it expires: the cluster runs with
 *   --kv-lease-ms 5000 so that idle comes within the run's time);
 *   RSS growth of the processes that lived through the run (the proxy, the instances not killed),
 *   from a moment after the first requests to the end (MB = 10^6 bytes);
 *   restarts (pdmoe_restarts_total from the proxy's /metrics: must be 2).
 * It exits 1 when cut, leaked or restarts are wrong, or no request succeeded.
 * Options: --quick (4 streams for 8 s: under 30 s in all, what CI runs), --streams N (16),
 * --seconds T (60), --model DIR (default: a v4-tiny model generated in /tmp and removed after),
 * --port P (first of the cluster's ports, 27500), --json. */
#include "bench.h"
#include "cli/cli.h"

#include "core/timing.h"
#include "engine/genmodel.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define N_PREFILL 1
#define N_DECODE 2
#define N_PROC (1 + N_PREFILL + N_DECODE)   /* the proxy, then the instances in port order */

enum outcome { OK, ERRORED, CUT, DISCONNECTED, N_OUTCOMES };

struct soak {
    int port;
    double deadline;
    const char *model_name;
    pthread_mutex_t mu;
    long count[N_OUTCOMES];
    char first_cut[512];         /* what the first cut stream ended with */
};

struct client {
    struct soak *s;
    int id;
    uint64_t rng;
};

static uint64_t next(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* One streaming completion over HTTP/1.0 (the answer ends when the connection closes). */
static enum outcome one_request(struct client *c, char *tail, size_t cap)
{
    int words = 4 + (int)(next(&c->rng) % 120), max_tokens = 8 + (int)(next(&c->rng) % 57);
    int hang_up = next(&c->rng) % 10 == 0;
    char body[2048];
    int n = snprintf(body, sizeof body, "{\"model\":\"%s\",\"prompt\":\"%d", c->s->model_name, c->id);
    for (int w = 0; w < words; w++)
        n += snprintf(body + n, sizeof body - (size_t)n, " tide");
    n += snprintf(body + n, sizeof body - (size_t)n, "\",\"max_tokens\":%d,\"ignore_eos\":true,\"stream\":true}",
                  max_tokens);
    char req[2300];
    int rn = snprintf(req, sizeof req, "POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: "
                      "application/json\r\nContent-Length: %d\r\n\r\n%s", n, body);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)c->s->port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {60, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0 || write(fd, req, (size_t)rn) != rn) {
        /* the proxy itself refused: a client is told that much */
        if (fd >= 0)
            close(fd);
        snprintf(tail, cap, "connect: %s", strerror(errno));
        return ERRORED;
    }
    size_t len = 0, size = 1 << 16;
    char *got = malloc(size);
    ssize_t r;
    int timed_out = 0;
    while (got && (r = read(fd, got + len, size - len - 1)) != 0) {
        if (r < 0) {
            timed_out = errno == EAGAIN || errno == EWOULDBLOCK;
            break;
        }
        len += (size_t)r;
        got[len] = 0;
        if (hang_up && strstr(got, "data: ")) {
            close(fd);
            free(got);
            return DISCONNECTED;
        }
        if (len + 1 == size) {
            char *more = realloc(got, size *= 2);
            if (!more)
                break;
            got = more;
        }
    }
    close(fd);
    if (!got)
        return CUT;
    got[len] = 0;
    enum outcome o;
    static const char done[] = "data: [DONE]\n\n";
    int code = len > 12 && !strncmp(got, "HTTP/1.", 7) ? atoi(got + 9) : 0;
    if (timed_out || code == 0)
        o = CUT;
    else if (code != 200)
        o = code >= 500 && strstr(got, "\"error\"") ? ERRORED : CUT;
    else if (len < sizeof done - 1 || strcmp(got + len - (sizeof done - 1), done))
        o = CUT;
    else
        o = strstr(got, "data: {\"error\"") ? ERRORED : OK;
    snprintf(tail, cap, "HTTP %d, %zu bytes%s, ending: %s", code, len, timed_out ? ", no answer in 60 s" : "",
             got + (len > 200 ? len - 200 : 0));
    free(got);
    return o;
}

static void sleep_s(double s)
{
    nanosleep(&(struct timespec){(time_t)s, (long)((s - (time_t)s) * 1e9)}, NULL);
}

static void *client_loop(void *arg)
{
    struct client *c = arg;
    char tail[512];
    while (pd_now_s() < c->s->deadline) {
        enum outcome o = one_request(c, tail, sizeof tail);
        pthread_mutex_lock(&c->s->mu);
        c->s->count[o]++;
        if (o == CUT && !c->s->first_cut[0])
            snprintf(c->s->first_cut, sizeof c->s->first_cut, "%s", tail);
        pthread_mutex_unlock(&c->s->mu);
        if (o == ERRORED)
            sleep_s(0.1);   /* as a client would before trying again, rather than spin on a 502 */
    }
    return NULL;
}

/* The value of `key` (a metric's name with its labels) in a /metrics text; -1 if absent. */
static double metric(const char *buf, const char *key)
{
    char k[256];
    snprintf(k, sizeof k, "\n%s ", key);
    char *p = strstr(buf, k);
    return p ? atof(p + strlen(k)) : -1;
}

/* The sum of every sample of metric `name` in port's /metrics. */
static double metric_sum(int port, const char *name)
{
    static char buf[1 << 16];
    if (pd_cli_http_get(NULL, port, "/metrics", buf, sizeof buf) != 200)
        return -1;
    double sum = 0;
    size_t n = strlen(name);
    for (char *line = strtok(buf, "\n"); line; line = strtok(NULL, "\n"))
        if (!strncmp(line, name, n) && (line[n] == '{' || line[n] == ' ')) {
            char *v = strrchr(line, ' ');
            sum += atof(v + 1);
        }
    return sum;
}

/* The pid of `pdmoe serve|proxy ... --port N` (the process itself, not an mpirun), 0 if none. */
static pid_t pid_on(int port)
{
    DIR *d = opendir("/proc");
    struct dirent *e;
    pid_t found = 0;
    char want[16];
    snprintf(want, sizeof want, "%d", port);
    while (d && !found && (e = readdir(d))) {
        char path[300], cmd[4096];
        if (e->d_name[0] < '0' || e->d_name[0] > '9')
            continue;
        snprintf(path, sizeof path, "/proc/%s/cmdline", e->d_name);
        FILE *f = fopen(path, "rb");
        size_t n = f ? fread(cmd, 1, sizeof cmd - 1, f) : 0;
        if (f)
            fclose(f);
        cmd[n] = 0;
        int is_pdmoe = 0;
        for (size_t i = 0; i + 1 < n; i += strlen(cmd + i) + 1) {
            if (i > 0 && (!strcmp(cmd + i, "serve") || !strcmp(cmd + i, "proxy")))
                is_pdmoe = 1;
            if (is_pdmoe && !strcmp(cmd + i, "--port") && i + 6 < n && !strcmp(cmd + i + 7, want) &&
                strcmp(cmd, "mpirun"))
                found = atoi(e->d_name);
        }
    }
    if (d)
        closedir(d);
    return found;
}

/* Resident set size of pid in bytes, -1 if it is gone. */
static double rss_bytes(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    double kb = -1;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "VmRSS:", 6))
            kb = atof(line + 6);
    if (f)
        fclose(f);
    return kb < 0 ? -1 : kb * 1024;
}

static void rm_dir(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        char p[600];
        if (e->d_name[0] == '.')
            continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        unlink(p);
    }
    if (d)
        closedir(d);
    rmdir(dir);
}

/* SIGINT or SIGTERM to the bench: the run stops at its next check and goes through its cleanup
 * (up stopped, and with it every instance; its directories removed): a SIGTERM had left the
 * cluster running on its ports and /tmp/pdmoe-soak-* behind. */
static volatile sig_atomic_t interrupted;
static void on_interrupt(int sig)
{
    interrupted = sig;
}

int pd_bench_soak(int argc, char **argv)
{
    static const struct option opts[] = {
        {"quick", 0, 0, 'q'}, {"streams", 1, 0, 'n'}, {"seconds", 1, 0, 't'}, {"model", 1, 0, 'm'},
        {"port", 1, 0, 'p'}, {"json", 0, 0, 'j'}, {0, 0, 0, 0},   /* --help: pdmoe bench's */
    };
    int streams = 16, port = 27500, as_json = 0;
    double seconds = 60;
    const char *model = NULL;
    int c, quick = 0, streams_given = 0, seconds_given = 0;
    struct pd_cli_seen seen = {0};
    optind = 1;
    opterr = 0;
    while ((c = pd_cli_getopt("bench soak", argc, argv, opts, NULL, NULL, &seen)) != -1) {
        char *end = NULL;
        switch (c) {
        case 'q': quick = 1; break;
        case 'n':
            streams = (int)strtol(optarg, &end, 10);
            if (*end || streams < 1 || streams > 256) {
                fprintf(stderr, "pdmoe bench soak: --streams %s: expected 1 to 256\n", optarg);
                return 2;
            }
            streams_given = 1;
            break;
        case 't':
            seconds = strtod(optarg, &end);
            if (*end || !(seconds >= 3 && seconds <= 86400)) {
                fprintf(stderr, "pdmoe bench soak: --seconds %s: expected 3 to 86400\n", optarg);
                return 2;
            }
            seconds_given = 1;
            break;
        case 'm': model = optarg; break;
        case 'p':
            port = (int)strtol(optarg, &end, 10);
            if (*end || port < 1024 || port > 65000) {
                fprintf(stderr, "pdmoe bench soak: --port %s: expected 1024 to 65000\n", optarg);
                return 2;
            }
            break;
        case 'j': as_json = 1; break;
        default:
            return pd_cli_bad_flag("bench soak", c, argc, argv);
        }
    }
    if (quick) {   /* smaller defaults, whatever the order of the flags; what was given stands */
        streams = streams_given ? streams : 4;
        seconds = seconds_given ? seconds : 8;
    }
    struct sigaction sa = {.sa_handler = on_interrupt};
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    char tmp[] = "/tmp/pdmoe-soak-XXXXXX", mdir[64] = "";
    if (!mkdtemp(tmp)) {
        fprintf(stderr, "pdmoe bench soak: cannot create a directory in /tmp: %s\n", strerror(errno));
        return 1;
    }
    if (!model) {
        snprintf(mdir, sizeof mdir, "%s/model", tmp);
        mkdir(mdir, 0755);
        pd_err e = {0};
        if (pd_genmodel("v4-tiny", mdir, 7, &e)) {
            fprintf(stderr, "pdmoe bench soak: %s\n", e.msg);
            rm_dir(mdir);
            rm_dir(tmp);
            return 1;
        }
        model = mdir;
    }
    char self[4096], log[96], sport[16], snp[8], snd[8];
    ssize_t sn = readlink("/proc/self/exe", self, sizeof self - 1);
    if (sn <= 0) {
        fprintf(stderr, "pdmoe bench soak: cannot find this program's path\n");
        return 1;
    }
    self[sn] = 0;
    snprintf(log, sizeof log, "%s/up.log", tmp);
    snprintf(sport, sizeof sport, "%d", port);
    snprintf(snp, sizeof snp, "%d", N_PREFILL);
    snprintf(snd, sizeof snd, "%d", N_DECODE);
    pid_t up = fork();
    if (up == 0) {
        freopen(log, "w", stdout);
        freopen(log, "a", stderr);
        execl(self, self, "up", "--model", model, "--port", sport, "--prefill-instances", snp, "--decode-instances", snd,
              "--max-model-len", "1024", "--kv-lease-ms", "5000", (char *)NULL);
        _exit(127);
    }
    int rc = 1, ready = 0;
    for (int i = 0; i < 1200 && !ready && !interrupted; i++) {
        char buf[4096] = "";
        FILE *f = fopen(log, "r");
        size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
        buf[n] = 0;
        if (f)
            fclose(f);
        ready = strstr(buf, "Ctrl-C") != NULL;
        if (!ready && waitpid(up, NULL, WNOHANG) == up) {
            fprintf(stderr, "pdmoe bench soak: pdmoe up exited:\n%s", buf);
            up = 0;
            break;
        }
        if (!ready)
            sleep_s(0.1);
    }
    struct soak s = {.port = port, .model_name = strrchr(model, '/') ? strrchr(model, '/') + 1 : model};
    pthread_mutex_init(&s.mu, NULL);
    if (!ready) {
        if (interrupted) {
            fprintf(stderr, "pdmoe bench soak: interrupted; stopping the cluster\n");
            rc = 128 + interrupted;
        } else {
            fprintf(stderr, "pdmoe bench soak: the cluster did not start; see %s\n", log);
        }
        goto out;
    }
    /* the proxy and the instances, in port order */
    pid_t pid0[N_PROC];
    double rss0[N_PROC], rss1[N_PROC];
    const char *names[N_PROC] = {"proxy", "prefill-0", "decode-0", "decode-1"};
    const int victim[2] = {1, 1 + N_PREFILL};   /* prefill instance 0, decode instance 0 */
    double t0 = pd_now_s();
    s.deadline = t0 + seconds;
    struct client *cl = calloc((size_t)streams, sizeof *cl);
    pthread_t *th = calloc((size_t)streams, sizeof *th);
    for (int i = 0; i < streams; i++) {
        cl[i] = (struct client){&s, i, 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1) ^ (uint64_t)time(NULL)};
        pthread_create(&th[i], NULL, client_loop, &cl[i]);
    }
    sleep_s(seconds / 6 < 1 ? seconds / 6 : 1);   /* the first requests have run: the baseline */
    for (int k = 0; k < N_PROC; k++) {
        pid0[k] = pid_on(port + k);
        rss0[k] = pid0[k] ? rss_bytes(pid0[k]) : -1;
    }
    for (int v = 0; v < 2 && !interrupted; v++) {
        while (pd_now_s() < t0 + seconds * (v + 1) / 3 && !interrupted)
            sleep_s(0.05);
        if (interrupted)
            break;
        pid_t p = pid_on(port + victim[v]);
        if (p > 0)
            kill(p, SIGKILL);
        if (!as_json)
            printf("%5.1f s: SIGKILL to %s (pid %d)\n", pd_now_s() - t0, names[victim[v]], (int)p);
    }
    if (interrupted) {   /* the clients end their requests in flight and stop */
        pthread_mutex_lock(&s.mu);
        s.deadline = 0;
        pthread_mutex_unlock(&s.mu);
    }
    for (int i = 0; i < streams; i++)
        pthread_join(th[i], NULL);
    free(cl);
    free(th);
    if (interrupted) {
        fprintf(stderr, "pdmoe bench soak: interrupted; stopping the cluster\n");
        rc = 128 + interrupted;
        goto out;
    }
    double t_load = pd_now_s() - t0;
    /* both back (up restarts them), then idle: what is still held is leaked */
    double restarts = -1;
    for (int i = 0; i < 300 && restarts < 2; i++) {
        restarts = metric_sum(port, "pdmoe_restarts_total");
        if (restarts < 2)
            sleep_s(0.1);
    }
    int back = 0;
    for (int i = 0; i < 300 && !back; i++) {
        back = 1;
        for (int k = 1; k < N_PROC; k++) {
            char b[64];
            back &= pd_cli_http_get(NULL, port + k, "/health", b, sizeof b) == 200;
        }
        if (!back)
            sleep_s(0.1);
    }
    double leaked_blocks = 0, leases = 0, t_idle = pd_now_s();
    for (double wait_until = pd_now_s() + 15; pd_now_s() < wait_until; sleep_s(0.2)) {
        leaked_blocks = leases = 0;
        for (int k = 1; k < N_PROC; k++) {
            static char m[1 << 16];   /* one /metrics read per instance for its three figures */
            if (pd_cli_http_get(NULL, port + k, "/metrics", m, sizeof m) != 200) {
                leaked_blocks = leases = -1;
                break;
            }
            /* blocks only the prefix cache holds are not leaked: the cache gives them back when it
             * needs room (and every instance prints the gauge, 0 without a cache) */
            leaked_blocks += metric(m, "pdmoe_kv_blocks_capacity") - metric(m, "pdmoe_kv_blocks_free") -
                             metric(m, "pdmoe_prefix_cache_blocks");
            leases += metric(m, "pdmoe_kv_leases");
        }
        if (leaked_blocks == 0 && leases == 0)
            break;
    }
    t_idle = pd_now_s() - t_idle;
    double growth = 0, base = 0;
    for (int k = 0; k < N_PROC; k++) {
        rss1[k] = pid0[k] && pid_on(port + k) == pid0[k] ? rss_bytes(pid0[k]) : -1;
        if (rss0[k] > 0 && rss1[k] > 0) {
            growth += rss1[k] - rss0[k];
            base += rss0[k];
        }
    }
    long total = s.count[OK] + s.count[ERRORED] + s.count[CUT] + s.count[DISCONNECTED];
    rc = s.count[CUT] || leaked_blocks || leases || restarts != 2 || !s.count[OK] || !back ? 1 : 0;
    if (as_json) {
        json_t *rj = json_object();
        for (int k = 0; k < N_PROC; k++)
            json_object_set_new(rj, names[k], rss0[k] > 0 && rss1[k] > 0
                                                  ? json_pack("{s:f,s:f}", "start_bytes", rss0[k], "end_bytes", rss1[k])
                                                  : json_null());
        json_t *j = json_pack("{s:i,s:f,s:f,s:{s:I,s:I,s:I,s:I,s:I},s:f,s:f,s:f,s:f,s:o,s:f,s:b,s:b}", "streams",
                              streams, "seconds", seconds, "load_seconds", t_load, "requests", "total", (json_int_t)total,
                              "ok", (json_int_t)s.count[OK], "errored", (json_int_t)s.count[ERRORED],
                              "cut_without_error", (json_int_t)s.count[CUT], "disconnected",
                              (json_int_t)s.count[DISCONNECTED], "leaked_kv_blocks", leaked_blocks, "leaked_leases",
                              leases, "rss_growth_bytes", growth, "rss_growth_ratio", base > 0 ? growth / base : 0,
                              "rss", rj, "restarts", restarts, "all_back", back, "pass", rc == 0);
        char *t = json_dumps(j, JSON_INDENT(2));
        printf("%s\n", t);
        free(t);
        json_decref(j);
    } else {
        printf("soak: %d streams for %.0f s against pdmoe up (%d prefill, %d decode instances), prefill-0 and decode-0 "
               "SIGKILLed at 1/3 and 2/3\n", streams, seconds, N_PREFILL, N_DECODE);
        printf("requests          %ld: ok %ld (%.1f%%), errored %ld, cut without error %ld (must be 0), disconnected by "
               "the client %ld\n", total, s.count[OK], total ? 100.0 * s.count[OK] / total : 0, s.count[ERRORED],
               s.count[CUT], s.count[DISCONNECTED]);
        if (s.count[CUT])
            printf("first cut         %s\n", s.first_cut);
        printf("leaked            %.0f KV blocks, %.0f leases (must be 0; idle after %.1f s)\n", leaked_blocks, leases,
               t_idle);
        printf("RSS growth        %+.1f MB over %.1f MB (%+.1f%%) of the processes that lived through it:", growth / 1e6,
               base / 1e6, base > 0 ? 100 * growth / base : 0);
        for (int k = 0; k < N_PROC; k++)
            if (rss0[k] > 0 && rss1[k] > 0)
                printf(" %s %+.1f MB", names[k], (rss1[k] - rss0[k]) / 1e6);
        printf("\nrestarts          %.0f (must be 2), every instance healthy again: %s\n", restarts, back ? "yes" : "no");
        printf("%s\n", rc ? "FAIL" : "PASS");
    }
out:
    if (up > 0) {
        kill(up, SIGINT);
        waitpid(up, NULL, 0);
    }
    pthread_mutex_destroy(&s.mu);
    if (rc && !interrupted) {
        char buf[8192] = "";
        FILE *f = fopen(log, "r");
        size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
        buf[n] = 0;
        if (f)
            fclose(f);
        fprintf(stderr, "pdmoe up's log:\n%s", buf);
    }
    if (mdir[0])
        rm_dir(mdir);
    rm_dir(tmp);
    return rc;
}

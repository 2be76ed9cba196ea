/* `pdmoe proxy`: the OpenAI-compatible front of a PD deployment. */
#include "cli/cli.h"
#include "proxy/proxy.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Appends the comma-separated instances of one --prefill or --decode to out[0..*n): the flag may
 * repeat (sglang-router's --prefill URL --prefill URL). The lists live in one arena for the
 * process's life, as o's pointers do. */
static int split(const char *flag, const char *arg, const char **out, int *n)
{
    static char arena[16384];
    static size_t used;
    size_t len = strlen(arg) + 1;
    if (len > sizeof arena - used) {
        fprintf(stderr, "pdmoe proxy: %s: the instance lists are longer than %zu bytes\n", flag, sizeof arena);
        return -1;
    }
    char *list = memcpy(arena + used, arg, len);
    used += len;
    for (char *save = NULL, *t = strtok_r(list, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (*n == PD_PROXY_MAX_INSTANCES) {
            fprintf(stderr, "pdmoe proxy: %s: at most %d instances\n", flag, PD_PROXY_MAX_INSTANCES);
            return -1;
        }
        out[(*n)++] = t;
    }
    return 0;
}

int pd_cli_proxy(int argc, char **argv)
{
    static const struct option opts[] = {
        {"metrics-file", 1, 0, 'M'}, {"health-interval-ms", 1, 0, 'i'},
        {"health-timeout-ms", 1, 0, 'O'}, {"health-failures", 1, 0, 'F'}, {"upstream-keepalive", 1, 0, 'K'},
        {"prefill", 1, 0, 'p'}, {"decode", 1, 0, 'd'}, {"host", 1, 0, 'H'}, {"port", 1, 0, 'P'},
        {"api-key", 1, 0, 'k'}, {"backend-api-key", 1, 0, 'b'}, {"retries", 1, 0, 'r'}, {"help", 0, 0, 'h'},
        {"policy", 1, 0, 'y'}, {"cache-threshold", 1, 0, 'c'}, {"balance-abs-threshold", 1, 0, 'a'},
        {"balance-rel-threshold", 1, 0, 'l'}, {"max-tree-size", 1, 0, 't'}, {"shutdown-timeout", 1, 0, 'G'},
        PD_CLI_HTTP_OPTIONS, {0, 0, 0, 0},
    };
    struct pd_proxy_opts o = {.port = 8000, .handle_signals = 1, .http = {.log = pd_cli_log, .log_arg = "proxy"},
                              .route = {.policy = PD_ROUTE_CACHE_AWARE, .cache_threshold = 0.3, .balance_abs = 64,
                                        .balance_rel = 1.5}};
    static const char *const repeatable[] = {"prefill", "decode", NULL};
    int64_t v;
    int c;
    pd_cli_ignore_stray_signals();
    struct pd_cli_seen seen = {0};
    optind = 1;
    opterr = 0;
    while ((c = pd_cli_getopt("proxy", argc, argv, opts, NULL, repeatable, &seen)) != -1) {
        switch (c) {
        case 'p':
            if (split("--prefill", optarg, o.prefill, &o.n_prefill))
                return 2;
            break;
        case 'd':
            if (split("--decode", optarg, o.decode, &o.n_decode))
                return 2;
            break;
        case 'M': o.metrics_file = optarg; break;
        case 'y':
            if (pd_route_policy_parse(optarg, &o.route.policy)) {
                fprintf(stderr, "pdmoe proxy: --policy %s: expected cache_aware or least_loaded\n", optarg);
                return 2;
            }
            break;
        case 'c':
            if (pd_cli_double("--cache-threshold", optarg, &o.route.cache_threshold))
                return 2;
            break;
        case 'a':
            if (pd_cli_int_max("--balance-abs-threshold", optarg, 0, 1000000, &v))
                return 2;
            o.route.balance_abs = (int)v;
            break;
        case 'l':
            if (pd_cli_double("--balance-rel-threshold", optarg, &o.route.balance_rel))
                return 2;
            break;
        case 't':
            if (pd_cli_int("--max-tree-size", optarg, PD_ROUTE_CHUNK, &v))
                return 2;
            o.route.max_bytes = (size_t)v;
            break;
        case 'i':
            if (pd_cli_int_max("--health-interval-ms", optarg, 10, 3600000, &v))
                return 2;
            o.health_interval_ms = (int)v;
            break;
        case 'O':
            if (pd_cli_int_max("--health-timeout-ms", optarg, 10, 600000, &v))
                return 2;
            o.health_timeout_ms = (int)v;
            break;
        case 'F':
            if (pd_cli_int_max("--health-failures", optarg, 1, 1000, &v))
                return 2;
            o.health_failures = (int)v;
            break;
        case 'K':
            if (pd_cli_int_max("--upstream-keepalive", optarg, 0, 4096, &v))
                return 2;
            o.upstream_keepalive = v ? (int)v : -1;   /* (0 in the options is the default) */
            break;
        case 'H': o.host = optarg; break;
        case 'P': if (pd_cli_int_max("--port", optarg, 0, 65535, &v)) return 2; o.port = (int)v; break;
        case 'k': o.api_key = optarg; break;
        case 'b': o.backend_api_key = optarg; break;
        case 'G':
            if (pd_cli_int_max("--shutdown-timeout", optarg, 0, 86400, &v))
                return 2;
            o.shutdown_timeout_s = (int)v;
            break;
        case 'r':
            if (pd_cli_int("--retries", optarg, 1, &v))
                return 2;
            if (v > PD_PROXY_MAX_INSTANCES) {   /* each retry goes to another prefill instance */
                fprintf(stderr, "pdmoe proxy: --retries %s: at most %d\n", optarg, PD_PROXY_MAX_INSTANCES);
                return 2;
            }
            o.retries = (int)v;
            break;
        case 'h':
            printf("usage: pdmoe proxy --prefill host:port[,host:port...] --decode host:port[,...] [--port 8000] (each of\n"
                   "       --prefill and --decode may repeat, as sglang-router takes them)\n"
                   "       [--host 127.0.0.1] [--api-key KEY] [--backend-api-key KEY]\n"
                   "       [--retries 3]\n"
                   "%s"
                   "The instances are sent --backend-api-key, or --api-key without it. PDMOE_API_KEY in the environment\n"
                   "stands for --api-key (off the command line, which every user sees in ps).\n"
                   "Without --prefill, the --decode instances are colocated servers and the proxy balances them.\n",
                   pd_cli_http_help);
            printf("--policy cache_aware|least_loaded (cache_aware): which instance prefills a request: the one most\n"
                   "likely to hold its prompt's prefix in its KV cache (the prompt bytes routed to each are indexed),\n"
                   "unless the loads are imbalanced (in flight: max - min > --balance-abs-threshold 64 and max >\n"
                   "--balance-rel-threshold 1.5 x min), and only if that prefix is more than --cache-threshold 0.3 of\n"
                   "the prompt (else the instance with the least indexed); least_loaded: the fewest in flight.\n"
                   "--max-tree-size 16777216: prompt bytes indexed per instance (least recently used out first).\n"
                   "Decode instances are always chosen least-loaded.\n");
            printf("--health-interval-ms 1000: how often each instance's /health is checked. --health-timeout-ms\n"
                   "1000: how long a check may take before it counts as failed. --health-failures 3: checks failed\n"
                   "in a row that take an instance out (a failed request takes it out at once); out, it gets no\n"
                   "requests until a check succeeds, checked again after 0.5 s doubling to --health-interval-ms.\n"
                   "--upstream-keepalive 16: idle connections kept open to each\n"
                   "instance for the next requests (0: a connection per request, each leaving a socket in\n"
                   "TIME_WAIT on this host for 60 s); the client connection cap leaves descriptors for them, a\n"
                   "check to each instance and one /expert_stats fan-out (one runs at a time); a connect or accept\n"
                   "short of descriptors closes the idle ones and tries once more. The default is lowered under a low ulimit -n (to at most half of\n"
                   "what it leaves); a value that leaves no descriptor for a client is refused. --metrics-file FILE: Prometheus text added to /metrics (pdmoe\n"
                   "up's restart counts). --shutdown-timeout S (0): at SIGTERM or Ctrl-C, new requests get a 503\n"
                   "while those in flight finish, for at most S seconds; a second signal stops at once (0: at once).\n");
            return 0;
        default: {
            int r = pd_cli_http_flag(c, optarg, &o.http);
            if (r > 0)
                break;
            if (r == 0)
                return pd_cli_bad_flag("proxy", c, argc, argv);
            return 2;
        }
        }
    }
    if (pd_cli_no_args("proxy", argc, argv) || pd_cli_api_key("proxy", o.api_key, &o.api_key))
        return 2;
    struct pd_proxy *px;
    pd_err e = {0};
    int crc = pd_proxy_create(&o, &px, &e);
    if (crc) {
        fprintf(stderr, "pdmoe proxy: %s\n", e.msg);
        /* a limit it cannot start under: pdmoe up does not start it again as it is */
        return crc == PD_EINVAL ? PD_CLI_EXIT_CONFIG : 2;
    }
    const int keep = pd_proxy_keepalive(px);
    fprintf(stderr, "pdmoe proxy: http://%s:%d (prefill %d, decode %d instances), %d idle connection%s kept to each\n",
            o.host ? o.host : "127.0.0.1", pd_proxy_port(px), o.n_prefill, o.n_decode, keep, keep == 1 ? "" : "s");
    int rc = pd_proxy_run(px, &e);
    if (rc)
        fprintf(stderr, "pdmoe proxy: %s\n", e.msg);
    pd_proxy_destroy(px);
    return rc ? 1 : 0;
}

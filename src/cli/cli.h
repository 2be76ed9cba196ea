/* Subcommands of the pdmoe program and the argument helpers they share. */
#ifndef PD_CLI_CLI_H
#define PD_CLI_CLI_H

#include <getopt.h>
#include <stdint.h>

#include "http/front.h"
#include "plan/perf.h"
#include "plan/plan.h"

int pd_cli_plan(int argc, char **argv);
int pd_cli_bench(int argc, char **argv);
int pd_cli_genmodel(int argc, char **argv);
int pd_cli_convert(int argc, char **argv);
int pd_cli_generate(int argc, char **argv);
int pd_cli_serve(int argc, char **argv);
int pd_cli_proxy(int argc, char **argv);
int pd_cli_up(int argc, char **argv);
int pd_cli_validate(int argc, char **argv);
int pd_cli_search(int argc, char **argv);
int pd_cli_calibrate(int argc, char **argv);
int pd_cli_tokenize(int argc, char **argv);

/* Parses an integer flag value: digits with an optional k (x1000) or K (x1024) suffix, as
 * vLLM reads --max-model-len. Prints "pdmoe: --flag VALUE: ..." and returns -1 on error. */
int pd_cli_int(const char *flag, const char *s, int64_t min, int64_t *out);
int pd_cli_double(const char *flag, const char *s, double *out);
/* pd_cli_int with an upper bound too ("... at most MAX"). */
int pd_cli_int_max(const char *flag, const char *s, int64_t min, int64_t max, int64_t *out);
/* After a getopt_long loop: an argument no flag took is an error ("pdmoe CMD: unexpected argument
 * ..."), -1; else 0. */
int pd_cli_no_args(const char *cmd, int argc, char **argv);
/* --kv-cache-dtype of the engine: bf16 or fp8, nothing else. Prints "pdmoe CMD: ..." and
 * returns -1 on error. */
int pd_cli_kv_dtype(const char *cmd, const char *s, enum pd_kv_dtype *out);

/* What a subcommand's getopt_long loop (optstring starting with ":") does not know: c == ':' is a
 * flag missing its value, anything else an unknown flag. Prints "pdmoe CMD: ..." naming the
 * flag as typed and returns 2, the usage-error exit status. */
int pd_cli_bad_flag(const char *cmd, int c, int argc, char **argv);

/* The API key: --api-key's value (flag), else the environment's PDMOE_API_KEY (as vLLM reads
 * VLLM_API_KEY: a key on the command line is visible to every user in ps), else NULL. An empty one
 * is refused ("pdmoe CMD: ..."), -1; else 0 with *key set. */
int pd_cli_api_key(const char *cmd, const char *flag, const char **key);

/* getopt_long for a subcommand's loop that also refuses a flag given twice, whose first value
 * would otherwise be dropped without a word (a command line pasted together from two recipes):
 * it prints "pdmoe CMD: --flag given twice (A, then B): give it once" and returns PD_CLI_REPEATED,
 * which pd_cli_bad_flag answers with 2 and nothing more. Names in `repeatable` (NULL-ended, or
 * NULL) may repeat. Two names are one flag when they share a value below 256 (the subcommands'
 * aliases: --kv-cache-bytes for --kv-cache-memory-bytes). `seen` starts zeroed, one per loop. */
/* The long-running commands (serve, proxy, up) ignore SIGHUP, SIGUSR1 and SIGUSR2: a log
 * rotation's or an operator's stray signal killed serve and the proxy without a word (USR1, USR2),
 * or put UCX in its debug mode for good (its handler of SIGHUP: a DEBUG line per request after). */
void pd_cli_ignore_stray_signals(void);

/* pdmoe serve's exit status when it refuses what it was given at start (a field, a file, a pool
 * this host cannot hold): sysexits' EX_CONFIG. Starting it again as it is cannot help, so
 * `pdmoe up` does not; a start that failed otherwise (a port still bound, 1) may. */
#define PD_CLI_EXIT_CONFIG 78

#define PD_CLI_MAX_OPTS 96
struct pd_cli_seen {
    const char *value[PD_CLI_MAX_OPTS];   /* the value each option was given first */
    unsigned char given[PD_CLI_MAX_OPTS];
};
enum { PD_CLI_REPEATED = 0x7ffe };
int pd_cli_getopt(const char *cmd, int argc, char **argv, const struct option *opts, int *idx,
                  const char *const *repeatable, struct pd_cli_seen *seen);

/* GET path from host:port (host NULL, a wildcard or not an IPv4 address: 127.0.0.1) over
 * HTTP/1.0, at most 5 s; the body into out (cap bytes, NUL-ended) and the HTTP status, 0 if none:
 * the one small client `up` and the benchmarks use to ask /health and /metrics. */
int pd_cli_http_get(const char *host, int port, const char *path, char *out, size_t cap);
/* The same, the connect and each read bounded by timeout_ms instead of 5 s. */
int pd_cli_http_get_within(const char *host, int port, const char *path, char *out, size_t cap, int timeout_ms);

/* Writes text to path, ending it with a newline if it has none (flag names it in the error:
 * "pdmoe CMD: FLAG PATH: cannot write: why"); 0 or -1. */
int pd_cli_write_file(const char *cmd, const char *flag, const char *path, const char *text);

/* Flags `plan`, `search` and `calibrate` share, by long name without "--": returns 1 when the
 * flag was one of them and is applied, 0 when it is not one of them, -1 after printing an
 * error. Model/memory flags: model, hardware, gpu-memory-utilization, max-model-len,
 * max-num-batched-tokens, max-num-seqs, quant, quant-override, kv-cache-dtype,
 * kv-bytes-per-token, mtp, expert-stats(-prefill|-decode), units. Workload flags: isl, osl, request-rate, prefix-cache-hit. */
int pd_cli_model_flag(const char *name, const char *val, struct pd_plan_opts *o, int *units);
int pd_cli_workload_flag(const char *name, const char *val, struct pd_workload *w);

/* The connection flags of `serve` and `proxy` (--max-connections, --idle-timeout, --header-timeout,
 * --body-timeout, --max-header-bytes, --max-body-bytes): PD_CLI_HTTP_OPTIONS goes in a getopt_long
 * table, pd_cli_http_flag(opt, optarg, limits) applies one (1), says it is not one of them (0) or
 * prints why its value is wrong (-1); pd_cli_http_help is their --help lines. */
enum { PD_CLI_OPT_HTTP = 1000 };
#define PD_CLI_HTTP_OPTIONS \
    {"max-connections", 1, 0, PD_CLI_OPT_HTTP + 0}, {"idle-timeout", 1, 0, PD_CLI_OPT_HTTP + 1}, \
    {"header-timeout", 1, 0, PD_CLI_OPT_HTTP + 2}, {"body-timeout", 1, 0, PD_CLI_OPT_HTTP + 3}, \
    {"max-header-bytes", 1, 0, PD_CLI_OPT_HTTP + 4}, {"max-body-bytes", 1, 0, PD_CLI_OPT_HTTP + 5}
int pd_cli_http_flag(int opt, const char *val, struct pd_http_limits *l);
extern const char pd_cli_http_help[];
/* A pd_http_limits log callback: "pdmoe CMD: line" on stderr, cmd being the subcommand's name. */
void pd_cli_log(void *cmd, const char *line);

#endif

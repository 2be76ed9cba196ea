/* Numeric flag values, with errors that name the flag. */
#include "cli/cli.h"
#include "core/units.h"
#include "engine/spec.h"

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/time.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>

/* "--prefill dp=" is followed by its value directly, "--nodes" by a space */
static const char *sep(const char *flag)
{
    size_t n = strlen(flag);
    return n && flag[n - 1] == '=' ? "" : " ";
}

int pd_cli_bad_flag(const char *cmd, int c, int argc, char **argv)
{
    const char *flag = optind > 0 && optind <= argc ? argv[optind - 1] : "?";
    if (c == PD_CLI_REPEATED)   /* pd_cli_getopt said why */
        return 2;
    if (c == ':')
        fprintf(stderr, "pdmoe %s: %s needs a value\n", cmd, flag);
    else
        fprintf(stderr, "pdmoe %s: unknown option %s (see pdmoe %s --help)\n", cmd, flag, cmd);
    return 2;
}

int pd_cli_api_key(const char *cmd, const char *flag, const char **key)
{
    const char *env = getenv("PDMOE_API_KEY");
    *key = flag ? flag : env;
    if (*key && !**key) {
        fprintf(stderr, "pdmoe %s: %s: empty key\n", cmd, flag ? "--api-key" : "PDMOE_API_KEY");
        return -1;
    }
    return 0;
}

int pd_cli_getopt(const char *cmd, int argc, char **argv, const struct option *opts, int *idx,
                  const char *const *repeatable, struct pd_cli_seen *seen)
{
    int i = -1;
    int c = getopt_long(argc, argv, ":h", opts, &i);
    if (c == -1 || c == ':' || c == '?' || i < 0 || i >= PD_CLI_MAX_OPTS)
        return c;
    if (idx)
        *idx = i;
    for (int r = 0; repeatable && repeatable[r]; r++)
        if (strcmp(repeatable[r], opts[i].name) == 0)
            return c;
    /* the first entry of the table that is this flag: itself, or an alias before it */
    int k = i;
    if (!opts[i].flag && opts[i].val < 256)
        for (k = 0; k < i && !(opts[k].val == opts[i].val && !opts[k].flag); k++)
            ;
    if (seen->given[k]) {
        if (optarg && seen->value[k])
            fprintf(stderr, "pdmoe %s: --%s given twice (%s, then %s): give it once\n", cmd, opts[i].name,
                    seen->value[k], optarg);
        else
            fprintf(stderr, "pdmoe %s: --%s given twice: give it once\n", cmd, opts[i].name);
        return PD_CLI_REPEATED;
    }
    seen->given[k] = 1;
    seen->value[k] = optarg;
    return c;
}

int pd_cli_http_get(const char *host, int port, const char *path, char *out, size_t cap)
{
    return pd_cli_http_get_within(host, port, path, out, cap, 5000);
}

int pd_cli_http_get_within(const char *host, int port, const char *path, char *out, size_t cap, int timeout_ms)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (!host || inet_pton(AF_INET, host, &a.sin_addr) != 1 || a.sin_addr.s_addr == htonl(INADDR_ANY))
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    /* each read and the connect (Linux bounds a blocking connect by SO_SNDTIMEO): a host that is
     * down does not hold the caller for the kernel's two minutes of SYN retries */
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    if (fd >= 0) {
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    }
    char req[256];
    int rn = snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", path);
    size_t len = 0;
    out[0] = 0;
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0 && write(fd, req, (size_t)rn) == rn) {
        ssize_t r;
        while (len + 1 < cap && (r = read(fd, out + len, cap - len - 1)) > 0)
            len += (size_t)r;
        out[len] = 0;
    }
    if (fd >= 0)
        close(fd);
    int code = len > 12 ? atoi(out + 9) : 0;
    char *b = strstr(out, "\r\n\r\n");
    if (b)
        memmove(out, b + 4, strlen(b + 4) + 1);
    return code;
}

int pd_cli_kv_dtype(const char *cmd, const char *s, enum pd_kv_dtype *out)
{
    if (strcmp(s, "bf16") == 0)
        *out = PD_KV_BF16;
    else if (strcmp(s, "fp8") == 0)
        *out = PD_KV_FP8;
    else {
        fprintf(stderr, "pdmoe %s: --kv-cache-dtype %s: expected bf16 or fp8\n", cmd, s);
        return -1;
    }
    return 0;
}

int pd_cli_int(const char *flag, const char *s, int64_t min, int64_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    int64_t mult = 1;
    if (*end == 'k')
        mult = 1000, end++;
    else if (*end == 'K')
        mult = 1024, end++;
    if (end == s || *end || errno || v > INT64_MAX / mult || v < INT64_MIN / mult) {
        fprintf(stderr, "pdmoe: %s%s%s: expected an integer (optionally with k = 1000 or K = 1024)\n", flag, sep(flag), s);
        return -1;
    }
    if (v * mult < min) {
        fprintf(stderr, "pdmoe: %s%s%s: must be at least %lld\n", flag, sep(flag), s, (long long)min);
        return -1;
    }
    *out = v * mult;
    return 0;
}

int pd_cli_int_max(const char *flag, const char *s, int64_t min, int64_t max, int64_t *out)
{
    int64_t v;
    if (pd_cli_int(flag, s, min, &v))
        return -1;
    if (v > max) {
        fprintf(stderr, "pdmoe: %s%s%s: at most %lld\n", flag, sep(flag), s, (long long)max);
        return -1;
    }
    *out = v;
    return 0;
}

int pd_cli_no_args(const char *cmd, int argc, char **argv)
{
    if (optind >= argc)
        return 0;
    fprintf(stderr, "pdmoe %s: unexpected argument \"%s\" (see pdmoe %s --help)\n", cmd, argv[optind], cmd);
    return -1;
}

int pd_cli_double(const char *flag, const char *s, double *out)
{
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end || !isfinite(v)) {
        fprintf(stderr, "pdmoe: %s %s: expected a number\n", flag, s);
        return -1;
    }
    *out = v;
    return 0;
}

int pd_cli_write_file(const char *cmd, const char *flag, const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    size_t n = strlen(text);
    int bad = !f || fputs(text, f) < 0 || ((n == 0 || text[n - 1] != '\n') && fputc('\n', f) < 0);
    if (f && fclose(f))
        bad = 1;
    if (bad)
        fprintf(stderr, "pdmoe %s: %s %s: cannot write: %s\n", cmd, flag, path, strerror(errno));
    return bad ? -1 : 0;
}

int pd_cli_model_flag(const char *name, const char *val, struct pd_plan_opts *o, int *units)
{
    if (strcmp(name, "model") == 0) {
        o->model = val;
    } else if (strcmp(name, "hardware") == 0) {
        o->hardware = val;
    } else if (strcmp(name, "gpu-memory-utilization") == 0) {
        if (pd_cli_double("--gpu-memory-utilization", val, &o->util))
            return -1;
    } else if (strcmp(name, "max-model-len") == 0) {
        if (pd_cli_int("--max-model-len", val, 1, &o->max_model_len))
            return -1;
        o->max_model_len_given = 1;
    } else if (strcmp(name, "max-num-batched-tokens") == 0) {
        if (pd_cli_int("--max-num-batched-tokens", val, 1, &o->max_num_batched_tokens))
            return -1;
    } else if (strcmp(name, "max-num-seqs") == 0) {
        if (pd_cli_int("--max-num-seqs", val, 1, &o->max_num_seqs))
            return -1;
    } else if (strcmp(name, "quant") == 0 || strcmp(name, "quantization") == 0) {   /* vLLM's name, and ours */
        o->quant = val;
    } else if (strcmp(name, "quant-override") == 0) {
        o->quant_override = val;
    } else if (strcmp(name, "stack") == 0) {
        pd_err e = {0};
        if (pd_plan_stack_parse(val, &o->stack, &e)) {
            fprintf(stderr, "pdmoe: %s\n", e.msg);
            return -1;
        }
    } else if (strcmp(name, "kv-cache-dtype") == 0) {
        if (strcmp(val, "auto") == 0) {
            o->kv_dtype = PD_KV_AUTO;
        } else if (pd_kv_parse_dtype(val, &o->kv_dtype)) {
            fprintf(stderr, "pdmoe: --kv-cache-dtype %s: expected fp8, bf16 or auto\n", val);
            return -1;
        }
    } else if (strcmp(name, "expert-stats") == 0) {
        o->expert_stats = val;
    } else if (strcmp(name, "expert-stats-prefill") == 0 || strcmp(name, "expert-stats-decode") == 0) {
        o->expert_stats_role[strcmp(name, "expert-stats-prefill") == 0 ? PD_ROLE_PREFILL : PD_ROLE_DECODE] = val;
    } else if (strcmp(name, "kv-bytes-per-token") == 0) {
        if (pd_cli_int("--kv-bytes-per-token", val, 1, &o->kv_bytes_per_token))
            return -1;
    } else if (strcmp(name, "mtp") == 0) {
        if (strcmp(val, "on") && strcmp(val, "off")) {
            fprintf(stderr, "pdmoe: --mtp %s: expected on or off\n", val);
            return -1;
        }
        o->mtp = strcmp(val, "on") == 0;
    } else if (strcmp(name, "speculative-config") == 0) {   /* vLLM's, parsed as generate and serve do */
        pd_err e = {0};
        if (pd_spec_config_parse(val, &o->spec_k, &e)) {
            fprintf(stderr, "pdmoe: %s\n", e.msg);
            return -1;
        }
    } else if (strcmp(name, "spec-stats") == 0) {
        o->spec_stats = val;
    } else if (strcmp(name, "mtp-acceptance") == 0) {
        o->mtp_acceptance = val;
    } else if (strcmp(name, "units") == 0) {
        if (strcmp(val, "gb") == 0 || strcmp(val, "GB") == 0)
            *units = PD_UNITS_GB;
        else if (strcmp(val, "gib") == 0 || strcmp(val, "GiB") == 0)
            *units = PD_UNITS_GIB;
        else {
            fprintf(stderr, "pdmoe: --units %s: expected gb (10^9 bytes) or gib (2^30 bytes)\n", val);
            return -1;
        }
    } else {
        return 0;
    }
    return 1;
}

int pd_cli_workload_flag(const char *name, const char *val, struct pd_workload *w)
{
    if (strcmp(name, "isl") == 0)
        return pd_cli_int("--isl", val, 1, &w->isl) ? -1 : 1;
    if (strcmp(name, "osl") == 0)
        return pd_cli_int("--osl", val, 1, &w->osl) ? -1 : 1;
    if (strcmp(name, "request-rate") == 0) {
        if (pd_cli_double("--request-rate", val, &w->rate))
            return -1;
        if (w->rate < 0) {
            fprintf(stderr, "pdmoe: --request-rate %s: must not be negative\n", val);
            return -1;
        }
        return 1;
    }
    if (strcmp(name, "concurrency") == 0) {
        if (pd_cli_int("--concurrency", val, 1, &w->concurrency))
            return -1;
        if (w->concurrency > 1000000) {
            fprintf(stderr, "pdmoe: --concurrency %s: at most 1000000 clients\n", val);
            return -1;
        }
        return 1;
    }
    if (strcmp(name, "prefix-cache-hit") == 0) {
        if (pd_cli_double("--prefix-cache-hit", val, &w->cached))
            return -1;
        if (!(w->cached >= 0 && w->cached < 1)) {
            fprintf(stderr, "pdmoe: --prefix-cache-hit %s: must be in [0, 1)\n", val);
            return -1;
        }
        return 1;
    }
    return 0;
}

void pd_cli_ignore_stray_signals(void)
{
    /* (after libucs's constructor has installed its SIGHUP handler: this replaces it) */
    signal(SIGHUP, SIG_IGN);
    signal(SIGUSR1, SIG_IGN);
    signal(SIGUSR2, SIG_IGN);
}

/* The connection flags `serve` and `proxy` share (see cli.h). */
#include "cli/cli.h"
#include "core/units.h"

#include <stdio.h>

const char pd_cli_http_help[] =
    "       [--max-connections 1024] (open client connections; at the limit an idle one is closed\n"
    "         for a new one, else the new one gets a 503; never more than the open-file limit - 32)\n"
    "       [--idle-timeout 60] [--header-timeout 30] [--body-timeout 30] (seconds: a connection with no\n"
    "         request in progress is closed after the first; a request's line and headers must arrive\n"
    "         within the second of its first byte, its body within the third after the headers;\n"
    "         an answer, streamed or not, has no deadline while the client reads it)\n"
    "       [--max-header-bytes 64KiB] [--max-body-bytes 8MiB] (larger: a 400 or a 413, JSON errors)\n";

static int seconds_ms(const char *flag, const char *val, int *ms)
{
    double v;
    if (pd_cli_double(flag, val, &v))
        return -1;
    if (v < 0.001 || v > 86400) {
        fprintf(stderr, "pdmoe: %s %s: expected seconds in [0.001, 86400]\n", flag, val);
        return -1;
    }
    *ms = (int)(v * 1000 + 0.5);
    return 0;
}

static int bytes(const char *flag, const char *val, int64_t *out)
{
    int64_t v;
    if (pd_units_parse(val, &v) || v < 1024 || v > ((int64_t)1 << 40)) {
        fprintf(stderr, "pdmoe: %s %s: expected bytes between 1KiB and 1TiB, e.g. 64KiB or 8MiB\n", flag, val);
        return -1;
    }
    *out = v;
    return 0;
}

int pd_cli_http_flag(int opt, const char *val, struct pd_http_limits *l)
{
    int64_t v;
    switch (opt) {
    case PD_CLI_OPT_HTTP + 0:
        if (pd_cli_int("--max-connections", val, 1, &v))
            return -1;
        if (v > 1 << 20) {
            fprintf(stderr, "pdmoe: --max-connections %s: at most %d\n", val, 1 << 20);
            return -1;
        }
        l->max_connections = (int)v;
        return 1;
    case PD_CLI_OPT_HTTP + 1: return seconds_ms("--idle-timeout", val, &l->idle_timeout_ms) ? -1 : 1;
    case PD_CLI_OPT_HTTP + 2: return seconds_ms("--header-timeout", val, &l->header_timeout_ms) ? -1 : 1;
    case PD_CLI_OPT_HTTP + 3: return seconds_ms("--body-timeout", val, &l->body_timeout_ms) ? -1 : 1;
    case PD_CLI_OPT_HTTP + 4: return bytes("--max-header-bytes", val, &l->max_header_bytes) ? -1 : 1;
    case PD_CLI_OPT_HTTP + 5: return bytes("--max-body-bytes", val, &l->max_body_bytes) ? -1 : 1;
    }
    return 0;
}

void pd_cli_log(void *cmd, const char *line)
{
    fprintf(stderr, "pdmoe %s: %s\n", (const char *)cmd, line);
}

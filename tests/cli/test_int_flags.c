/* Integer flags that go into an int are range-checked, not truncated: --max-model-len 4294967297
 * once became 1 and --max-num-seqs 4294967296 became 0. Each gets exit 2 and a line naming it. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

/* Runs `pdmoe args`; the exit status, and stderr in err. */
static int pdmoe(const char *args, char *err, size_t cap)
{
    const char *bin = getenv("PDMOE_BIN") ? getenv("PDMOE_BIN") : "build/pdmoe";
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s %s 2>&1 >/dev/null", bin, args);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    size_t n = fread(err, 1, cap - 1, p);
    err[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static void refused(const char *args, const char *want)
{
    char err[4096];
    int code = pdmoe(args, err, sizeof err);
    cr_assert_eq(code, 2, "pdmoe %s: exit %d: %s", args, code, err);
    cr_assert(strstr(err, want), "pdmoe %s: \"%s\" lacks \"%s\"", args, err, want);
}

Test(int_flags, values_past_int_are_refused_by_flag)
{
    refused("serve --model /nonexistent --max-model-len 4294967297", "--max-model-len 4294967297: at most 2147483647");
    refused("serve --model /nonexistent --max-num-seqs 4294967296", "--max-num-seqs 4294967296: at most 2147483647");
    refused("serve --model /nonexistent --max-num-batched-tokens 9223372036854775807",
            "--max-num-batched-tokens 9223372036854775807: at most");
    refused("serve --model /nonexistent --threads 4294967297", "--threads 4294967297: at most");
    refused("serve --model /nonexistent --max-queued-requests 4294967297", "--max-queued-requests 4294967297: at most");
    refused("serve --model /nonexistent --max-queued-requests 0", "--max-queued-requests 0: must be at least 1");
    refused("up --max-queued-requests 0", "--max-queued-requests 0: must be at least 1");
    refused("serve --model /nonexistent --shutdown-timeout 86401", "--shutdown-timeout 86401: at most 86400");
    refused("proxy --decode 127.0.0.1:1 --shutdown-timeout -1", "--shutdown-timeout -1");
    refused("up --shutdown-timeout 99999999999", "--shutdown-timeout 99999999999: at most 86400");
    refused("proxy --decode 127.0.0.1:1 --retries 4294967297", "--retries 4294967297: at most 32");
    refused("plan --nodes 4294967297", "--nodes 4294967297: at most 1048576");
    /* past a flag's own bound (once exit 2 without a word) */
    refused("calibrate --port 65001", "--port 65001: at most 65000");
    refused("calibrate --threads 300", "--threads 300: at most 256");
    refused("up --port 65001", "--port 65001: at most 65000");
    refused("up --prefill-instances 17", "--prefill-instances 17: at most 16");
    refused("up --kv-lease-ms 99999999", "--kv-lease-ms 99999999: at most 3600000");
    refused("serve --model /nonexistent --port 70000", "--port 70000: at most 65535");
    refused("proxy --decode 127.0.0.1:1 --port 70000", "--port 70000: at most 65535");
    refused("proxy --decode 127.0.0.1:1 --health-interval-ms 9999999", "--health-interval-ms 9999999: at most 3600000");
}

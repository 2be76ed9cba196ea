/* Issue 17's targets and the machine object of the benchmarks' --json (report.h). */
#include "report.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

static const struct {
    const char *issue;
    double bound;
    int floor;
    const char *text;
} targets[PD_TARGET_N] = {
    [PD_TARGET_INT8_OF_PEAK] = {"17.3", 0.75, 1, ">= 0.75"},
    [PD_TARGET_AMX_OVER_ONEDNN] = {"17.2", 1.0, 1, ">= 1.0x"},
    [PD_TARGET_AMX_MOE_OF_DENSE] = {"17.2", 0.8, 1, ">= 0.8"},
    [PD_TARGET_DECODE_ROOFLINE] = {"17.5", 0.85, 1, ">= 0.85"},
    [PD_TARGET_DECODE_SCALING] = {"17.5", 1.7, 1, ">= 1.7x"},
    [PD_TARGET_EP_OVER_RAW] = {"17.6", 1.5, 0, "<= 1.5x"},
};

double pd_bench_target_bound(enum pd_bench_target t)
{
    return targets[t].bound;
}

int pd_bench_target_is_floor(enum pd_bench_target t)
{
    return targets[t].floor;
}

int pd_bench_target_met(enum pd_bench_target t, double measured)
{
    return targets[t].floor ? measured >= targets[t].bound : measured <= targets[t].bound;
}

const char *pd_bench_target_word(enum pd_bench_target t, double measured)
{
    return pd_bench_target_met(t, measured) ? "met" : "not met";
}

const char *pd_bench_target_text(enum pd_bench_target t)
{
    return targets[t].text;
}

json_t *pd_bench_target_json(enum pd_bench_target t, const char *metric, double measured)
{
    return json_pack("{s:s, s:s, s:f, s:b}", "issue", targets[t].issue, "metric", metric,
                     targets[t].floor ? "min" : "max", targets[t].bound, "met", pd_bench_target_met(t, measured));
}

/* /proc/cpuinfo's first value of `key` into out (empty if none). */
static void cpuinfo_field(const char *key, char *out, size_t cap)
{
    out[0] = 0;
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return;
    char line[8192];
    const size_t n = strlen(key);
    while (fgets(line, sizeof line, f)) {
        /* the key, then only blanks before the colon ("model" is not "model name") */
        if (strncmp(line, key, n) != 0)
            continue;
        const char *v = line + n + strspn(line + n, " \t");
        if (*v != ':')
            continue;
        for (v++; *v == ' '; v++)
            ;
        snprintf(out, cap, "%s", v);
        out[strcspn(out, "\n")] = 0;
        break;
    }
    fclose(f);
}

static json_t *machine_json(void)
{
    /* the flags the kernels and probes choose by (kernels/gemm.c, bench/ceilings.c) */
    static const char *const wanted[] = {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                                         "amx_tile", "amx_int8", "amx_bf16"};
    char model[256], flags[8192], family[32], number[32];
    cpuinfo_field("model name", model, sizeof model);
    cpuinfo_field("cpu family", family, sizeof family);
    cpuinfo_field("model", number, sizeof number);
    cpuinfo_field("flags", flags, sizeof flags);
    json_t *have = json_array();
    for (size_t i = 0; i < sizeof wanted / sizeof *wanted; i++) {
        const size_t n = strlen(wanted[i]);
        for (const char *p = flags; (p = strstr(p, wanted[i])) != NULL; p += n)
            if ((p == flags || p[-1] == ' ') && (p[n] == ' ' || p[n] == 0)) {
                json_array_append_new(have, json_string(wanted[i]));
                break;
            }
    }
    struct utsname u;
    char when[32] = "";
    time_t now = time(NULL);
    struct tm tm;
    if (gmtime_r(&now, &tm))
        strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
    double load[1] = {0};
    const int has_load = getloadavg(load, 1) == 1;
    return json_pack("{s:s, s:o, s:o, s:o, s:i, s:s, s:s, s:o}", "cpu", model, "family",
                     *family ? json_integer(atoi(family)) : json_null(), "model", *number ? json_integer(atoi(number)) : json_null(),
                     "flags", have, "cores", (int)sysconf(_SC_NPROCESSORS_ONLN), "linux", uname(&u) == 0 ? u.release : "",
                     "utc", when, "load_average", has_load ? json_real(load[0]) : json_null());
}

static json_t *command_json(int argc, char **argv)
{
    size_t cap = 16;
    for (int i = 0; i < argc; i++)
        cap += 4 * strlen(argv[i]) + 3;
    char *txt = malloc(cap), *w = txt;
    if (!txt)
        return json_null();
    w += sprintf(w, "pdmoe bench");
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        const int plain = *a && strspn(a, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.,/=:") == strlen(a);
        *w++ = ' ';
        if (plain) {
            w += sprintf(w, "%s", a);
            continue;
        }
        *w++ = '\'';
        for (; *a; a++)
            w += *a == '\'' ? sprintf(w, "'\\''") : sprintf(w, "%c", *a);
        *w++ = '\'';
        *w = 0;
    }
    json_t *j = json_string(txt);
    free(txt);
    return j ? j : json_null();
}

void pd_bench_provenance(json_t *doc, int argc, char **argv)
{
    json_object_set_new(doc, "command", command_json(argc, argv));
    json_object_set_new(doc, "machine", machine_json());
}

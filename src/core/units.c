/* Byte formatting and parsing with explicit decimal (GB) or binary (GiB) units. */
#include "core/units.h"
#include "core/err.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

double pd_units_g(int64_t bytes, enum pd_units u)
{
    return (double)bytes / (u == PD_UNITS_GIB ? PD_GIB : PD_GB);
}

const char *pd_units_g_name(enum pd_units u)
{
    return u == PD_UNITS_GIB ? "GiB" : "GB";
}

const char *pd_units_fmt_g(char *buf, size_t n, int64_t bytes, enum pd_units u, int decimals)
{
    snprintf(buf, n, "%.*f %s", decimals, pd_units_g(bytes, u), pd_units_g_name(u));
    return buf;
}

const char *pd_units_fmt(char *buf, size_t n, int64_t bytes, enum pd_units u)
{
    static const char *dec[] = {"B", "kB", "MB", "GB", "TB"};
    static const char *bin[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double base = u == PD_UNITS_GIB ? 1024.0 : 1000.0;
    double v = (double)bytes;
    int i = 0;
    while (fabs(v) >= base && i < 4) {
        v /= base;
        i++;
    }
    if (i == 0)
        snprintf(buf, n, "%lld B", (long long)bytes);
    else
        snprintf(buf, n, "%.2f %s", v, u == PD_UNITS_GIB ? bin[i] : dec[i]);
    return buf;
}

int pd_units_parse(const char *s, int64_t *bytes)
{
    if (!s || !*s)
        return PD_EINVAL;
    char *end;
    double v = strtod(s, &end);
    if (end == s || !isfinite(v) || v < 0)
        return PD_EINVAL;
    while (isspace((unsigned char)*end))
        end++;
    static const struct { const char *name; double mult; } suffix[] = {
        {"", 1}, {"b", 1}, {"kb", 1e3}, {"k", 1e3}, {"mb", 1e6}, {"gb", 1e9}, {"tb", 1e12},
        {"kib", 1024.0}, {"mib", 1048576.0}, {"gib", PD_GIB}, {"tib", PD_GIB * 1024.0},
    };
    for (size_t i = 0; i < sizeof suffix / sizeof suffix[0]; i++) {
        if (strcasecmp(end, suffix[i].name) == 0) {
            double b = v * suffix[i].mult;
            if (b > 9.0e18)
                return PD_EINVAL;
            *bytes = (int64_t)llround(b);
            return 0;
        }
    }
    return PD_EINVAL;
}

const char *pd_units_thousands(char *buf, int64_t v)
{
    char tmp[32];
    int n = snprintf(tmp, sizeof tmp, "%lld", (long long)(v < 0 ? -v : v)), k = 0;
    if (v < 0)
        buf[k++] = '-';
    for (int i = 0; i < n; i++) {
        buf[k++] = tmp[i];
        if ((n - i - 1) % 3 == 0 && i != n - 1)
            buf[k++] = ',';
    }
    buf[k] = 0;
    return buf;
}

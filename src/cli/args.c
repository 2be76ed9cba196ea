/* Numeric flag values, with errors that name the flag. */
#include "cli/cli.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* "--prefill dp=" is followed by its value directly, "--nodes" by a space */
static const char *sep(const char *flag)
{
    size_t n = strlen(flag);
    return n && flag[n - 1] == '=' ? "" : " ";
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
    if (end == s || *end || errno || v > INT64_MAX / mult) {
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

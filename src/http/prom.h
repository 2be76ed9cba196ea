/* Prometheus' text format, the parts the server (pd/) and the proxy (proxy/) share: a histogram
 * with cumulative buckets, kept as observations arrive and printed as NAME_bucket{le=...},
 * NAME_sum and NAME_count. The caller serialises observations and printing (its own lock or
 * its one thread). */
#ifndef PD_HTTP_PROM_H
#define PD_HTTP_PROM_H

#include <event2/buffer.h>
#include <stddef.h>
#include <stdint.h>

#define PD_HIST_MAX 12
struct pd_hist {
    const char *name, *help;
    const double *le;                 /* the buckets' upper bounds, ascending; +Inf is implied */
    int n;
    uint64_t bucket[PD_HIST_MAX + 1], count;   /* bucket[i]: observations <= le[i]; bucket[n]: all */
    double sum;
};

/* n <= PD_HIST_MAX bounds; name, help and le must outlive h. */
void pd_hist_init(struct pd_hist *h, const char *name, const char *help, const double *le, int n);
void pd_hist_observe(struct pd_hist *h, double v);
/* HELP, TYPE histogram, the buckets, _sum and _count. */
void pd_hist_print(struct evbuffer *b, const struct pd_hist *h);

/* v as a label value in out (cap bytes, cut if need be): backslash, double quote and newline
 * escaped as the text format wants, so that a value (a host a request named) cannot end the
 * label or the line and forge samples. */
void pd_prom_label(char *out, size_t cap, const char *v);

/* The bounds both use, in seconds: time to the first token, per output token, a whole request. */
extern const double pd_hist_le_ttft[9], pd_hist_le_token[10], pd_hist_le_e2e[10];
#define PD_HIST_INIT(h, name, help, le) pd_hist_init(h, name, help, le, (int)(sizeof le / sizeof le[0]))

#endif

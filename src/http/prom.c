/* Prometheus histograms (prom.h). */
#include "http/prom.h"

#include <assert.h>

const double pd_hist_le_ttft[9] = {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
const double pd_hist_le_token[10] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1};
const double pd_hist_le_e2e[10] = {0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};

void pd_prom_label(char *out, size_t cap, const char *v)
{
    size_t n = 0;
    for (; *v && n + 3 < cap; v++) {
        if (*v == '\\' || *v == '"' || *v == '\n') {
            out[n++] = '\\';
            out[n++] = *v == '\n' ? 'n' : *v;
        } else {
            out[n++] = *v;
        }
    }
    out[n] = 0;
}

void pd_hist_init(struct pd_hist *h, const char *name, const char *help, const double *le, int n)
{
    assert(n >= 0 && n <= PD_HIST_MAX);
    *h = (struct pd_hist){.name = name, .help = help, .le = le, .n = n};
}

void pd_hist_observe(struct pd_hist *h, double v)
{
    h->sum += v;
    h->count++;
    for (int i = 0; i < h->n; i++)
        if (v <= h->le[i])
            h->bucket[i]++;
    h->bucket[h->n]++;
}

void pd_hist_print(struct evbuffer *b, const struct pd_hist *h)
{
    evbuffer_add_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", h->name, h->help, h->name);
    for (int i = 0; i < h->n; i++)
        evbuffer_add_printf(b, "%s_bucket{le=\"%g\"} %llu\n", h->name, h->le[i], (unsigned long long)h->bucket[i]);
    evbuffer_add_printf(b, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.6f\n%s_count %llu\n", h->name,
                        (unsigned long long)h->bucket[h->n], h->name, h->sum, h->name, (unsigned long long)h->count);
}

/* The proxy's metrics (internal.h): latency histograms kept as requests pass, and GET /metrics in
 * Prometheus' text format. */
#include "http/prom.h"
#include "proxy/internal.h"

#include <event2/buffer.h>
#include <stdio.h>
#include <string.h>

void px_hists_init(struct pd_proxy *px)
{
    PD_HIST_INIT(&px->ttft, "pdmoe_proxy_time_to_first_token_seconds",
                 "Time from request to the first streamed token (streamed requests only).",
                 pd_hist_le_ttft);
    PD_HIST_INIT(&px->tpot, "pdmoe_proxy_time_per_output_token_seconds",
                 "Per streamed request: (end - first token) / (completion tokens - 1).", pd_hist_le_token);
    PD_HIST_INIT(&px->itl, "pdmoe_proxy_inter_token_latency_seconds",
                 "Gaps between successive streamed events carrying tokens (several each with speculative decoding).",
                 pd_hist_le_token);
    PD_HIST_INIT(&px->e2e, "pdmoe_proxy_e2e_request_latency_seconds", "Time from request to the end of its answer.",
                 pd_hist_le_e2e);
}

void px_on_metrics(struct evhttp_request *h, void *arg)
{
    struct pd_proxy *px = arg;
    struct evbuffer *b = evbuffer_new();
    if (!b) {
        reply_error(h, 503, "server_error", "out of memory for the metrics");
        return;
    }
    evbuffer_add_printf(b,
                        "# HELP pdmoe_proxy_requests_total Completion requests received (authorised), those refused included.\n"
                        "# TYPE pdmoe_proxy_requests_total counter\npdmoe_proxy_requests_total %llu\n"
                        "# TYPE pdmoe_proxy_completed_total counter\npdmoe_proxy_completed_total %llu\n"
                        "# TYPE pdmoe_proxy_retries_total counter\npdmoe_proxy_retries_total %llu\n"
                        "# TYPE pdmoe_proxy_errors_total counter\n"
                        "pdmoe_proxy_errors_total{kind=\"bad_request\"} %llu\n"
                        "pdmoe_proxy_errors_total{kind=\"prefill_failed\"} %llu\n"
                        "pdmoe_proxy_errors_total{kind=\"decode_failed\"} %llu\n"
                        "pdmoe_proxy_errors_total{kind=\"client_cancelled\"} %llu\n"
                        "pdmoe_proxy_errors_total{kind=\"queue_full\"} %llu\n"
                        "pdmoe_proxy_errors_total{kind=\"bodies_in_flight_full\"} %llu\n"
                        "pdmoe_proxy_errors_total{kind=\"shutting_down\"} %llu\n"
                        "pdmoe_proxy_errors_total{kind=\"local_limit\"} %llu\n"
                        "# HELP pdmoe_proxy_upstream_resent_total Requests sent again on a fresh connection: the "
                        "instance had closed the kept-alive one as they went.\n"
                        "# TYPE pdmoe_proxy_upstream_resent_total counter\npdmoe_proxy_upstream_resent_total %llu\n"
                        "# TYPE pdmoe_proxy_body_bytes_in_flight gauge\npdmoe_proxy_body_bytes_in_flight %lld\n",
                        (unsigned long long)px->requests, (unsigned long long)px->completed,
                        (unsigned long long)px->retries, (unsigned long long)px->bad_requests,
                        (unsigned long long)px->prefill_failed, (unsigned long long)px->decode_failed,
                        (unsigned long long)px->cancelled, (unsigned long long)px->queue_full,
                        (unsigned long long)px->body_full, (unsigned long long)px->shutting_down,
                        (unsigned long long)px->local_limit, (unsigned long long)px->stale_retries,
                        (long long)px->body_bytes);
    evbuffer_add_printf(b, "# TYPE pdmoe_proxy_routed_total counter\n");
    for (int w = 0; w < PD_ROUTE_N_WHY; w++)
        evbuffer_add_printf(b, "pdmoe_proxy_routed_total{policy=\"%s\",reason=\"%s\"} %llu\n",
                            pd_route_policy_name(px->o.route.policy), pd_route_why_name((enum pd_route_why)w),
                            (unsigned long long)px->routed[w]);
    evbuffer_add_printf(b,
                        "# HELP pdmoe_proxy_route_prompt_bytes_total Prompt bytes routed, in whole %d-byte chunks.\n"
                        "# TYPE pdmoe_proxy_route_prompt_bytes_total counter\npdmoe_proxy_route_prompt_bytes_total %llu\n"
                        "# HELP pdmoe_proxy_route_matched_bytes_total Of those, the bytes whose prefix the routing "
                        "index expected on the chosen instance.\n"
                        "# TYPE pdmoe_proxy_route_matched_bytes_total counter\npdmoe_proxy_route_matched_bytes_total %llu\n",
                        PD_ROUTE_CHUNK, (unsigned long long)px->route_chunks * PD_ROUTE_CHUNK,
                        (unsigned long long)px->route_matched * PD_ROUTE_CHUNK);
    pd_hist_print(b, &px->ttft);
    pd_hist_print(b, &px->tpot);
    pd_hist_print(b, &px->itl);
    pd_hist_print(b, &px->e2e);
    /* what pdmoe up reports (its restarts): it rewrites the file whole, by rename */
    FILE *f = px->o.metrics_file ? fopen(px->o.metrics_file, "r") : NULL;
    if (f) {
        char line[512];
        while (fgets(line, sizeof line, f))
            evbuffer_add(b, line, strlen(line));
        fclose(f);
    }
    /* per instance: whether it is up, its ejections, its requests in flight, its /health checks failed
     * in a row, its connections (opened; requests sent on one kept alive; idle now) */
    static const char *const names[] = {"up", "ejections_total", "load", "failed_checks", "connections_opened_total",
                                        "connections_reused_total", "connections_idle"};
    static const char *const types[] = {"gauge", "counter", "gauge", "gauge", "counter", "counter", "gauge"};
    for (int m = 0; m < 7; m++) {
        evbuffer_add_printf(b, "# TYPE pdmoe_proxy_instance_%s %s\n", names[m], types[m]);
        for (int k = 0; k < px->np + px->nd; k++) {
            const struct instance *in = nth(px, k);
            const long long v[] = {in->up, (long long)in->ejections, in->load, in->failed_checks,
                                   (long long)in->conns_opened, (long long)in->conns_reused, in->n_idle};
            /* the instance as given on the command line, escaped as a label value ("a\"b" broke
             * the whole scrape) */
            char where[600], label[1300];
            snprintf(where, sizeof where, "%s:%d", in->host, in->port);
            pd_prom_label(label, sizeof label, where);
            evbuffer_add_printf(b, "pdmoe_proxy_instance_%s{role=\"%s\",instance=\"%s\"} %lld\n", names[m], in->role,
                                label, v[m]);
        }
    }
    pd_http_front_metrics(px->front, b);
    pd_http_text(h, "text/plain; version=0.0.4", b);   /* Prometheus' text format */
    evbuffer_free(b);
}


/* An inference server's GET /metrics (see server_int.h): its counters, KV pool, prefix cache,
 * scheduler steps, KV peers, speculative decoding and, for an EP group, each rank's, in Prometheus'
 * text format (vLLM's names where vLLM has one). Runs on the event-loop thread. */
#include "pd/server_int.h"

void pd_srv_on_metrics(struct evhttp_request *h, void *arg)
{
    struct pd_server *s = arg;
    struct evbuffer *b = evbuffer_new();
    if (!b) {
        pd_srv_send_error(s, h, 503, "server_error", NULL, "out of memory for the metrics");
        return;
    }
    pthread_mutex_lock(&s->mu);
    int waiting = pd_srv_waiting(s, INT_MAX), leases = 0;
    for (struct req *r = s->leases; r; r = r->lease_next)
        leases++;
    /* an EP group: the ranks' pools summed, and each rank's (what it reported after the last step) */
    int blocks_free = s->en.kv.n_blocks_free, blocks = s->en.kv.n_blocks, slots_free = s->en.kv.n_slots_free;
    if (s->g) {
        blocks_free = slots_free = 0;
        blocks = s->g->size * s->en.kv.n_blocks;
        for (int k = 0; k < s->g->size; k++) {
            blocks_free += s->g->free_blocks[k];
            slots_free += s->g->free_slots[k];
        }
    }
    evbuffer_add_printf(b,
                        "# HELP pdmoe_requests_total Requests accepted.\n# TYPE pdmoe_requests_total counter\n"
                        "pdmoe_requests_total %llu\n"
                        "# TYPE pdmoe_requests_completed_total counter\npdmoe_requests_completed_total %llu\n"
                        "# TYPE pdmoe_requests_cancelled_total counter\npdmoe_requests_cancelled_total %llu\n"
                        "# HELP pdmoe_steps_cancelled_total Steps stopped between layers because every client in "
                        "them had left (a long prefill is not run to its end).\n"
                        "# TYPE pdmoe_steps_cancelled_total counter\npdmoe_steps_cancelled_total %llu\n"
                        "# HELP pdmoe_requests_failed_total Requests the server ended: a refused KV pull, an engine "
                        "error, out of memory (accepted = completed + cancelled + failed + running + waiting).\n"
                        "# TYPE pdmoe_requests_failed_total counter\npdmoe_requests_failed_total %llu\n"
                        "# TYPE pdmoe_errors_total counter\npdmoe_errors_total{kind=\"4xx\"} %llu\n"
                        "pdmoe_errors_total{kind=\"kv_transfer\"} %llu\n"
                        "# TYPE pdmoe_prompt_tokens_total counter\npdmoe_prompt_tokens_total %llu\n"
                        "# TYPE pdmoe_generation_tokens_total counter\npdmoe_generation_tokens_total %llu\n"
                        "# TYPE pdmoe_num_requests_running gauge\npdmoe_num_requests_running %d\n"
                        "# TYPE pdmoe_num_requests_waiting gauge\npdmoe_num_requests_waiting %d\n"
                        "# HELP pdmoe_num_requests_tokenizing Requests whose body the tokenizer thread has not "
                        "finished reading and tokenizing (then they wait or are refused).\n"
                        "# TYPE pdmoe_num_requests_tokenizing gauge\npdmoe_num_requests_tokenizing %d\n"
                        "# HELP pdmoe_requests_queue_full_total Requests refused (429) with the waiting queue at "
                        "--max-queued-requests.\n# TYPE pdmoe_requests_queue_full_total counter\n"
                        "pdmoe_requests_queue_full_total %llu\n"
                        "# HELP pdmoe_max_queued_requests --max-queued-requests (0: no limit).\n"
                        "# TYPE pdmoe_max_queued_requests gauge\npdmoe_max_queued_requests %d\n"
                        "# HELP pdmoe_kv_blocks_free KV pool blocks free.\n# TYPE pdmoe_kv_blocks_free gauge\n"
                        "pdmoe_kv_blocks_free %d\n# HELP pdmoe_kv_blocks_capacity KV pool blocks in all.\n# TYPE pdmoe_kv_blocks_capacity gauge\npdmoe_kv_blocks_capacity %d\n"
                        "# HELP pdmoe_kv_slots_free KV pool sequence slots free.\n# TYPE pdmoe_kv_slots_free gauge\npdmoe_kv_slots_free %d\n"
                        "# HELP pdmoe_kv_transfer_bytes_total Bytes of KV pulled from prefill instances.\n# TYPE pdmoe_kv_transfer_bytes_total counter\npdmoe_kv_transfer_bytes_total %llu\n"
                        "# HELP pdmoe_kv_transfer_seconds_total Seconds spent in pulls that succeeded.\n# TYPE pdmoe_kv_transfer_seconds_total counter\npdmoe_kv_transfer_seconds_total %.6f\n"
                        "# HELP pdmoe_kv_transfers_total KV pulls attempted, whether they succeeded or not (the failed ones: pdmoe_errors_total{kind=\"kv_transfer\"}; a prompt then recomputed: pdmoe_kv_recomputes_total).\n# TYPE pdmoe_kv_transfers_total counter\npdmoe_kv_transfers_total %llu\n"
                        "# HELP pdmoe_kv_recomputes_total Prompts recomputed here because their KV could not be pulled.\n# TYPE pdmoe_kv_recomputes_total counter\npdmoe_kv_recomputes_total %llu\n"
                        "# HELP pdmoe_kv_leases_revoked_total Leases given up unclaimed for a waiting request.\n"
                        "# TYPE pdmoe_kv_leases_revoked_total counter\npdmoe_kv_leases_revoked_total %llu\n"
                        "# HELP pdmoe_kv_leases_expired_total Leases no decode instance pulled within kv_lease_ms: "
                        "prefills thrown away.\n"
                        "# TYPE pdmoe_kv_leases_expired_total counter\npdmoe_kv_leases_expired_total %llu\n"
                        "# HELP pdmoe_kv_leases Prompts whose KV waits under a lease for a decode instance to pull it.\n# TYPE pdmoe_kv_leases gauge\npdmoe_kv_leases %d\n"
                        "# HELP pdmoe_kv_pool_bytes Bytes of one rank's KV pool (slots and blocks).\n"
                        "# TYPE pdmoe_kv_pool_bytes gauge\npdmoe_kv_pool_bytes %zu\n"
                        "# HELP pdmoe_kv_entry_bytes Bytes of one KV entry (--kv-cache-dtype: bf16 or fp8).\n"
                        "# TYPE pdmoe_kv_entry_bytes gauge\npdmoe_kv_entry_bytes{dtype=\"%s\"} %zu\n",
                        (unsigned long long)s->n_requests, (unsigned long long)s->n_completed,
                        (unsigned long long)s->n_cancelled, (unsigned long long)s->steps_cancelled,
                        (unsigned long long)s->n_failed, (unsigned long long)s->n_errors4xx,
                        (unsigned long long)s->kv_failures,
                        (unsigned long long)s->tokens_in, (unsigned long long)s->tokens_out, s->n_running,
                        waiting, s->n_tokenizing, (unsigned long long)s->n_queue_full, s->o.max_queued_requests, blocks_free, blocks, slots_free,
                        (unsigned long long)s->kv_bytes, s->kv_seconds, (unsigned long long)s->kv_pulls,
                        (unsigned long long)s->kv_recomputes, (unsigned long long)s->leases_revoked,
                        (unsigned long long)s->leases_expired, leases,
                        s->en.kv.region_bytes, pd_kv_dtype_name(s->en.kv.dtype), s->en.kv.entry_bytes);
    /* vLLM's prefix_cache_queries/hits: prompt tokens looked up, and found cached; an EP group's
     * summed over its ranks' caches, as each last reported */
    int64_t pfx[EP_PFX_N] = {(int64_t)s->prefix.queries, (int64_t)s->prefix.hits, (int64_t)s->prefix.evictions,
                             s->en.kv.held, (int64_t)s->prefix.bytes};
    if (s->g && s->prefix_on) {
        memset(pfx, 0, sizeof pfx);
        for (int k = 0; k < s->g->size; k++)
            for (int j = 0; j < EP_PFX_N; j++)
                pfx[j] += s->g->pfx[(size_t)k * EP_PFX_N + j];
    }
    evbuffer_add_printf(b,
                        "# HELP pdmoe_prefix_cache_queries_total Prompt tokens looked up in the prefix cache.\n"
                        "# TYPE pdmoe_prefix_cache_queries_total counter\npdmoe_prefix_cache_queries_total %llu\n"
                        "# HELP pdmoe_prefix_cache_hits_total Prompt tokens found in the prefix cache (not computed).\n"
                        "# TYPE pdmoe_prefix_cache_hits_total counter\npdmoe_prefix_cache_hits_total %llu\n"
                        "# TYPE pdmoe_prefix_cache_evictions_total counter\npdmoe_prefix_cache_evictions_total %llu\n"
                        "# HELP pdmoe_prefix_cache_blocks KV pool blocks only the prefix cache holds (free when evicted).\n"
                        "# TYPE pdmoe_prefix_cache_blocks gauge\npdmoe_prefix_cache_blocks %lld\n"
                        "# HELP pdmoe_prefix_cache_snapshot_bytes Memory of the cached prefixes' snapshots.\n"
                        "# TYPE pdmoe_prefix_cache_snapshot_bytes gauge\npdmoe_prefix_cache_snapshot_bytes %lld\n",
                        (unsigned long long)pfx[EP_PFX_QUERIES], (unsigned long long)pfx[EP_PFX_HITS],
                        (unsigned long long)pfx[EP_PFX_EVICTIONS], (long long)pfx[EP_PFX_BLOCKS],
                        (long long)pfx[EP_PFX_BYTES]);
    /* the scheduler's steps: decode-only, and those with prompt tokens (an aggregated instance's
     * mixed steps, a prefill instance's) */
    evbuffer_add_printf(b,
                        "# HELP pdmoe_engine_steps_total Scheduler steps, by kind: decode tokens only, or with "
                        "prompt tokens.\n# TYPE pdmoe_engine_steps_total counter\n"
                        "pdmoe_engine_steps_total{kind=\"decode\"} %llu\npdmoe_engine_steps_total{kind=\"prompt\"} %llu\n"
                        "# HELP pdmoe_engine_step_seconds_total Wall time of the scheduler's steps.\n"
                        "# TYPE pdmoe_engine_step_seconds_total counter\n"
                        "pdmoe_engine_step_seconds_total{kind=\"decode\"} %.6f\n"
                        "pdmoe_engine_step_seconds_total{kind=\"prompt\"} %.6f\n"
                        "# HELP pdmoe_engine_step_sequences_total Sequences the steps carried (sum of their batches).\n"
                        "# TYPE pdmoe_engine_step_sequences_total counter\n"
                        "pdmoe_engine_step_sequences_total{kind=\"decode\"} %llu\n"
                        "pdmoe_engine_step_sequences_total{kind=\"prompt\"} %llu\n",
                        (unsigned long long)s->steps[0], (unsigned long long)s->steps[1], s->step_seconds[0],
                        s->step_seconds[1], (unsigned long long)s->step_seqs[0], (unsigned long long)s->step_seqs[1]);
    if (s->n_kv_peers) {
        static const char *const peer_metric[4] = {"transfers", "transfer_failures", "transfer_bytes",
                                                   "transfer_seconds"};
        for (int m = 0; m < 4; m++) {
            evbuffer_add_printf(b, "# TYPE pdmoe_kv_peer_%s_total counter\n", peer_metric[m]);
            for (int i = 0; i <= PD_KV_PEERS; i++) {
                if (i == s->n_kv_peers)
                    i = PD_KV_PEERS;   /* the "other" row, when used */
                const struct kv_peer *p = &s->kv_peers[i];
                if (!p->pulls)
                    continue;
                char raw[80], peer[160];
                snprintf(raw, sizeof raw, p->port < 0 ? "%s" : "%s:%d", p->host, p->port);
                pd_prom_label(peer, sizeof peer, raw);
                evbuffer_add_printf(b, "pdmoe_kv_peer_%s_total{peer=\"%s\",rank=\"%d\"} ", peer_metric[m], peer,
                                    p->rank < 0 ? 0 : p->rank);
                if (m == 3)
                    evbuffer_add_printf(b, "%.6f\n", p->seconds);
                else
                    evbuffer_add_printf(b, "%llu\n", (unsigned long long)(m == 0 ? p->pulls : m == 1 ? p->failures
                                                                                                  : p->bytes));
            }
        }
    }
    if (s->o.spec_k) {
        /* vLLM's spec_decode counters: drafts, drafted tokens, accepted tokens (in all and at each
         * position of a round) */
        const struct pd_spec_stats *a = &s->spec_stats;
        evbuffer_add_printf(b,
                            "# HELP pdmoe_spec_decode_num_drafts_total Verify steps that carried MTP drafts.\n"
                            "# TYPE pdmoe_spec_decode_num_drafts_total counter\npdmoe_spec_decode_num_drafts_total %lld\n"
                            "# TYPE pdmoe_spec_decode_num_draft_tokens_total counter\n"
                            "pdmoe_spec_decode_num_draft_tokens_total %lld\n"
                            "# TYPE pdmoe_spec_decode_num_accepted_tokens_total counter\n"
                            "pdmoe_spec_decode_num_accepted_tokens_total %lld\n"
                            "# HELP pdmoe_spec_decode_num_accepted_tokens_per_pos_total Drafts accepted at each "
                            "position of a round.\n# TYPE pdmoe_spec_decode_num_accepted_tokens_per_pos_total counter\n",
                            (long long)a->drafts, (long long)a->draft_tokens, (long long)a->accepted);
        for (int j = 0; j < s->o.spec_k; j++)
            evbuffer_add_printf(b, "pdmoe_spec_decode_num_accepted_tokens_per_pos_total{position=\"%d\"} %lld\n", j,
                                (long long)a->accepted_per_pos[j]);
    }
    if (s->g) {
        evbuffer_add_printf(b, "# TYPE pdmoe_ep_ranks gauge\npdmoe_ep_ranks %d\n"
                               "# HELP pdmoe_rank_kv_blocks_free KV pool blocks free on each rank of the EP group.\n"
                               "# TYPE pdmoe_rank_kv_blocks_free gauge\n", s->g->size);
        for (int k = 0; k < s->g->size; k++)
            evbuffer_add_printf(b, "pdmoe_rank_kv_blocks_free{rank=\"%d\"} %d\n", k, s->g->free_blocks[k]);
        evbuffer_add_printf(b, "# TYPE pdmoe_rank_kv_blocks_capacity gauge\n");
        for (int k = 0; k < s->g->size; k++)
            evbuffer_add_printf(b, "pdmoe_rank_kv_blocks_capacity{rank=\"%d\"} %d\n", k, s->en.kv.n_blocks);
        /* the running requests each rank owns, as pdmoe_num_requests_running counts them (its
         * load also counts the sequences kept under a lease, which run nothing) */
        evbuffer_add_printf(b, "# TYPE pdmoe_rank_num_requests_running gauge\n");
        for (int k = 0; k < s->g->size; k++) {
            int n = 0;
            for (int i = 0; i < s->n_running; i++)
                n += s->running[i]->owner == k;
            evbuffer_add_printf(b, "pdmoe_rank_num_requests_running{rank=\"%d\"} %d\n", k, n);
        }
        evbuffer_add_printf(b, "# TYPE pdmoe_rank_requests_total counter\n");
        for (int k = 0; k < s->g->size; k++)
            evbuffer_add_printf(b, "pdmoe_rank_requests_total{rank=\"%d\"} %d\n", k, s->g->owned[k]);
    }
    pd_hist_print(b, &s->h_ttft);
    pd_hist_print(b, &s->h_tpot);
    pd_hist_print(b, &s->h_e2e);
    pthread_mutex_unlock(&s->mu);
    pd_http_front_metrics(s->front, b);
    pd_http_text(h, "text/plain; version=0.0.4", b);   /* Prometheus' text format */
    evbuffer_free(b);
}


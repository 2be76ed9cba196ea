/* `pdmoe serve`: the OpenAI-compatible server on one engine (colocated prefill and decode), or,
 * under mpirun with --enable-expert-parallel, on an EP group whose rank 0 serves HTTP. */
#include "cli/cli.h"
#include "engine/spec.h"
#include "ep/ep.h"
#include "core/mem.h"
#include "core/net.h"
#include "core/units.h"
#include "model/safetensors.h"
#include "pd/server.h"

#include <jansson.h>
#include <mpi.h>

#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Creates, runs and destroys the server: 0, or 1 after printing why. */
static int serve(const struct pd_server_opts *o, int64_t dp)
{
    pd_cli_ignore_stray_signals();   /* (after MPI_Init: nothing of MPI or UCX reinstalls them) */
    if (!o->expert_parallel && dp > 1) {
        fprintf(stderr, "pdmoe serve: --data-parallel-size %lld needs --enable-expert-parallel (data-parallel "
                        "attention inside one EP group, under mpirun)\n", (long long)dp);
        return 2;
    }
    if (!o->expert_parallel && o->watchdog_s) {
        fprintf(stderr, "pdmoe serve: --watchdog-timeout needs --enable-expert-parallel (it watches an EP group's "
                        "rounds, which wait on every rank)\n");
        return 2;
    }
    struct pd_server *s;
    pd_err e = {0};
    int rc = pd_server_create(o, &s, &e);
    if (rc) {
        fprintf(stderr, "pdmoe serve: %s\n", e.msg);
        return rc == PD_EINVAL || rc == PD_EFORMAT ? PD_CLI_EXIT_CONFIG : 1;
    }
    pd_st_catch_truncation();   /* (after UCX's handlers, installed by pd_server_create) */
    int rank = pd_server_rank(s);
    if (rank == 0)
        fprintf(stderr, "pdmoe serve: %s on http://%s:%d%s\n", o->model_dir, o->host ? o->host : "127.0.0.1",
                pd_server_port(s), o->expert_parallel ? " (rank 0 of the EP group)" : "");
    if (rank == 0 && o->role == PD_ROLE_CONSUMER && !o->n_kv_producers)
        fprintf(stderr, "pdmoe serve: this decode instance pulls KV from whatever producer a request names (no "
                        "kv_producers in --kv-transfer-config), and a hostile producer can crash it (its KV "
                        "metadata directs this process's reads): let only the proxy reach its HTTP port\n");
    rc = pd_server_run(s, &e);
    if (rc) {
        fprintf(stderr, "pdmoe serve%s: %s\n", o->expert_parallel ? " (EP group)" : "", e.msg);
        if (pd_server_rank0_gone(s))
            _exit(70);   /* rank 0 died: nothing to end in order, and MPI_Abort would wait for mpirun */
        if (o->expert_parallel)
            return 1;   /* the group ends with MPI_Abort: no orderly destroy */
    }
    pd_server_destroy(s);
    if (rank == 0)
        fprintf(stderr, "pdmoe serve: stopped\n");
    return rc ? 1 : 0;
}

/* An integer flag that goes into an int: at least min, at most INT_MAX (4294967297 must not
 * become 1). */
static int int_flag(const char *flag, const char *s, int64_t min, int *out)
{
    int64_t v;
    if (pd_cli_int(flag, s, min, &v))
        return -1;
    if (v > INT_MAX) {
        fprintf(stderr, "pdmoe serve: %s %s: at most %d\n", flag, s, INT_MAX);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* kv_transfer_config's "kv_producers": an array of "host:port" or "host:first-last" (the last ':'
 * splits, so an IPv6 address may stand as it is); 0, or -1 after saying which entry is wrong. */
static int parse_producers(json_t *a, struct pd_server_opts *o)
{
    if (!json_is_array(a) || json_array_size(a) < 1 || json_array_size(a) > PD_MAX_KV_PRODUCERS) {
        fprintf(stderr, "pdmoe serve: --kv-transfer-config: kv_producers must be an array of 1 to %d \"host:port\" or "
                        "\"host:first-last\" strings\n", PD_MAX_KV_PRODUCERS);
        return -1;
    }
    size_t i;
    json_t *v;
    json_array_foreach(a, i, v) {
        const char *s = json_string_value(v), *colon = s ? strrchr(s, ':') : NULL;
        struct pd_kv_producer *p = &o->kv_producers[i];
        int lo = 0, hi = 0, used = 0;
        if (!colon || colon == s || (size_t)(colon - s) >= sizeof p->host ||
            (sscanf(colon + 1, "%d-%d%n", &lo, &hi, &used) != 2 && (hi = 0, sscanf(colon + 1, "%d%n", &lo, &used) != 1)) ||
            colon[1 + used] || lo < 1 || lo > 65535 || (hi && (hi < lo || hi > 65535))) {
            fprintf(stderr, "pdmoe serve: --kv-transfer-config: kv_producers[%zu] %s%s%s: expected \"host:port\" or "
                            "\"host:first-last\" (ports 1 to 65535)\n", i, s ? "\"" : "", s ? s : "is not a string",
                    s ? "\"" : "");
            return -1;
        }
        snprintf(p->host, sizeof p->host, "%.*s", (int)(colon - s), s);
        p->port_lo = lo;
        p->port_hi = hi ? hi : lo;
    }
    o->n_kv_producers = (int)json_array_size(a);
    return 0;
}

int pd_cli_serve(int argc, char **argv)
{
    static const struct option opts[] = {
        {"model", 1, 0, 'm'}, {"host", 1, 0, 'H'}, {"port", 1, 0, 'p'}, {"max-num-seqs", 1, 0, 's'},
        {"max-num-batched-tokens", 1, 0, 'b'}, {"max-model-len", 1, 0, 'l'}, {"threads", 1, 0, 'j'},
        {"served-model-name", 1, 0, 'n'}, {"api-key", 1, 0, 'k'}, {"role", 1, 0, 'r'},
        {"kv-transfer-config", 1, 0, 'K'}, {"kv-cache-bytes", 1, 0, 'B'},
        {"kv-cache-memory-bytes", 1, 0, 'B'}, {"enable-expert-parallel", 0, 0, 'E'},
        {"data-parallel-size", 1, 0, 'd'}, {"kv-cache-dtype", 1, 0, 'D'}, {"speculative-config", 1, 0, 'X'},
        {"enable-prefix-caching", 0, 0, 'C'}, {"no-enable-prefix-caching", 0, 0, 'c'},
        {"watchdog-timeout", 1, 0, 'W'}, {"max-queued-requests", 1, 0, 'Q'}, {"shutdown-timeout", 1, 0, 'G'},
        {"help", 0, 0, 'h'}, PD_CLI_HTTP_OPTIONS, {0, 0, 0, 0},
    };
    int64_t dp = 0;
    struct pd_server_opts o = {.port = 8000, .handle_signals = 1, .http = {.log = pd_cli_log, .log_arg = "serve"}};
    int64_t v;
    json_t *kvc = NULL;
    static char engine_id[64], kv_host[64];
    int c;
    struct pd_cli_seen seen = {0};
    optind = 1;
    opterr = 0;
    while ((c = pd_cli_getopt("serve", argc, argv, opts, NULL, NULL, &seen)) != -1) {
        switch (c) {
        case 'm': o.model_dir = optarg; break;
        case 'H': o.host = optarg; break;
        case 'p': if (pd_cli_int_max("--port", optarg, 0, 65535, &v)) return 2; o.port = (int)v; break;
        case 's': if (int_flag("--max-num-seqs", optarg, 1, &o.max_num_seqs)) return 2; break;
        case 'b': if (int_flag("--max-num-batched-tokens", optarg, 1, &o.max_num_batched_tokens)) return 2; break;
        case 'l': if (int_flag("--max-model-len", optarg, 1, &o.max_model_len)) return 2; break;
        case 'j': if (int_flag("--threads", optarg, 1, &o.threads)) return 2; break;
        case 'Q': if (int_flag("--max-queued-requests", optarg, 1, &o.max_queued_requests)) return 2; break;
        case 'G':
            if (pd_cli_int_max("--shutdown-timeout", optarg, 0, 86400, &v))
                return 2;
            o.shutdown_timeout_s = (int)v;
            break;
        case 'n': o.served_name = optarg; break;
        case 'E': o.expert_parallel = 1; break;
        case 'W': if (pd_cli_int_max("--watchdog-timeout", optarg, 0, 86400, &v)) return 2; o.watchdog_s = v ? (int)v : -1; break;
        case 'C': o.prefix_caching = 1; break;
        case 'c': o.prefix_caching = -1; break;
        case 'd': if (pd_cli_int("--data-parallel-size", optarg, 1, &dp)) return 2; break;
        case 'k': o.api_key = optarg; break;
        case 'D': if (pd_cli_kv_dtype("serve", optarg, &o.kv_dtype)) return 2; break;
        case 'X': {
            pd_err se = {0};
            if (pd_spec_config_parse(optarg, &o.spec_k, &se)) {
                fprintf(stderr, "pdmoe serve: %s\n", se.msg);
                return 2;
            }
            break;
        }
        case 'B':
            if (pd_units_parse(optarg, &v) || v < 1) {
                fprintf(stderr, "pdmoe serve: --kv-cache-memory-bytes %s: expected bytes, e.g. 2GB or 512MiB\n", optarg);
                return 2;
            }
            o.kv_cache_bytes = v;
            break;
        case 'r':
            if (!strcmp(optarg, "prefill"))
                o.role = PD_ROLE_PRODUCER;
            else if (!strcmp(optarg, "decode"))
                o.role = PD_ROLE_CONSUMER;
            else if (!strcmp(optarg, "both"))
                o.role = PD_ROLE_BOTH;
            else {
                fprintf(stderr, "pdmoe serve: --role %s: expected prefill, decode or both\n", optarg);
                return 2;
            }
            break;
        case 'K': {
            json_error_t je;
            kvc = json_loads(optarg, JSON_REJECT_DUPLICATES, &je);
            const char *role = kvc ? json_string_value(json_object_get(kvc, "kv_role")) : NULL;
            json_t *port = kvc ? json_object_get(kvc, "kv_port") : NULL;
            const char *id = kvc ? json_string_value(json_object_get(kvc, "engine_id")) : NULL;
            if (!kvc || !json_is_object(kvc) || !role || (port && !json_is_integer(port))) {
                fprintf(stderr, "pdmoe serve: --kv-transfer-config: expected {\"kv_role\": \"kv_producer\"|\"kv_consumer\"|"
                                "\"kv_both\", \"kv_port\": N, \"engine_id\": \"...\"}%s%s\n",
                        kvc ? "" : ": ", kvc ? "" : je.text);
                json_decref(kvc);
                return 2;
            }
            o.role = !strcmp(role, "kv_producer") ? PD_ROLE_PRODUCER : !strcmp(role, "kv_consumer") ? PD_ROLE_CONSUMER
                     : !strcmp(role, "kv_both") ? PD_ROLE_BOTH : -1;
            if (o.role < 0) {
                fprintf(stderr, "pdmoe serve: --kv-transfer-config: kv_role \"%s\" (kv_producer, kv_consumer, kv_both)\n", role);
                json_decref(kvc);
                return 2;
            }
            /* how long a producer keeps an unclaimed KV, how long a pull may take */
            static const char *const ms_keys[2] = {"kv_lease_ms", "kv_timeout_ms"};
            int *ms_vals[2] = {&o.kv_lease_ms, &o.kv_timeout_ms};
            for (int k = 0; k < 2; k++) {
                json_t *ms = json_object_get(kvc, ms_keys[k]);
                if (ms && (!json_is_integer(ms) || json_integer_value(ms) < 1 || json_integer_value(ms) > 3600000)) {
                    fprintf(stderr, "pdmoe serve: --kv-transfer-config: %s must be an integer number of "
                                    "milliseconds in [1, 3600000]\n", ms_keys[k]);
                    json_decref(kvc);
                    return 2;
                }
                if (ms)
                    *ms_vals[k] = (int)json_integer_value(ms);
            }
            /* kv_host: the address this process's KV listener binds and advertises (each rank of
             * a group spanning hosts names its own, mpirun's app contexts giving each its flags) */
            json_t *kh = json_object_get(kvc, "kv_host");
            if (kh && (!json_is_string(kh) || !json_string_length(kh) || json_string_length(kh) >= sizeof kv_host)) {
                fprintf(stderr, "pdmoe serve: --kv-transfer-config: kv_host must be an address or host name of 1 to "
                                "%zu characters\n", sizeof kv_host - 1);
                json_decref(kvc);
                return 2;
            }
            if (kh) {
                snprintf(kv_host, sizeof kv_host, "%s", json_string_value(kh));
                o.kv_host = kv_host;
            }
            /* kv_producers: the only producers a consumer pulls from ("host:port", "host:lo-hi") */
            json_t *kp = json_object_get(kvc, "kv_producers");
            if (kp && parse_producers(kp, &o)) {
                json_decref(kvc);
                return 2;
            }
            /* a key pdmoe does not read is refused, not dropped (vLLM's kv_connector and its
             * extra config configure another engine) */
            const char *key;
            json_t *val;
            json_object_foreach(kvc, key, val) {
                static const char *const known[] = {"kv_role", "kv_port", "kv_host", "engine_id", "kv_lease_ms",
                                                    "kv_timeout_ms", "kv_producers"};
                size_t k = 0;
                while (k < sizeof known / sizeof *known && strcmp(key, known[k]))
                    k++;
                if (k == sizeof known / sizeof *known) {
                    fprintf(stderr, "pdmoe serve: --kv-transfer-config: \"%s\" is not a key pdmoe reads (kv_role, "
                                    "kv_port, kv_host, engine_id, kv_lease_ms, kv_timeout_ms, kv_producers)\n", key);
                    json_decref(kvc);
                    return 2;
                }
            }
            o.kv_port = port ? (int)json_integer_value(port) : 0;
            if (id)
                snprintf(engine_id, sizeof engine_id, "%s", id);
            o.engine_id = id ? engine_id : NULL;
            json_decref(kvc);
            kvc = NULL;
            break;
        }
        case 'h':
            printf("usage: pdmoe serve --model DIR [--host 127.0.0.1] [--port 8000] [--max-num-seqs 16]\n"
                   "       [--max-num-batched-tokens 512] [--max-model-len 2048] [--threads N]\n"
                   "       [--served-model-name NAME] [--api-key KEY (or PDMOE_API_KEY in the environment, off ps)]\n"
                   "       [--role prefill|decode|both]\n"
                   "       [--kv-cache-memory-bytes B (vLLM's name, or --kv-cache-bytes: the KV pool; default:\n"
                   "         max-num-seqs x max-model-len)]\n"
                   "       [--kv-cache-dtype bf16|fp8] (the KV cache's entries, default bf16; fp8 as DeepSeek-V4\n"
                   "         is deployed; a prefill and a decode instance must use the same)\n"
                   "       [--max-queued-requests N] (requests waiting for a place in the batch; past N a new one\n"
                   "         is a 429 with Retry-After, as SGLang's flag; default: no limit but --max-connections)\n"
                   "       [--shutdown-timeout S] (vLLM's: at SIGTERM or Ctrl-C, new requests get a 503 while those in\n"
                   "         flight, waiting and leased finish, for at most S seconds; a second signal stops at\n"
                   "         once; default 0: stop at once, streams ended with an error event)\n"
                   "       [--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":K}'] (MTP\n"
                   "         speculative decoding, K = 1..8; also in an EP group; a prefill and a decode instance\n"
                   "         must use the same; /metrics counts drafts and accepted tokens per position)\n"
                   "       [--enable-expert-parallel [--data-parallel-size N]] (under mpirun -n N: one EP group,\n"
                   "         rank 0 serves HTTP; each rank holds 1/N of the experts, its own sequences and\n"
                   "         KV pool; --max-num-seqs and --kv-cache-bytes are per rank; a kv_producer's\n"
                   "         rank k listens on kv_port + k)\n"
                   "       [--watchdog-timeout S] (an EP group: rank 0 ends the group when one of its rounds has made\n"
                   "         no progress for S seconds, a rank stopped or hung; default 60, 0: never; /health is a 503\n"
                   "         from 10 s without progress)\n"
                   "       [--enable-prefix-caching | --no-enable-prefix-caching] (on by default, as in vLLM: a\n"
                   "         prompt starts from its longest cached prefix; in an EP group each rank caches its own\n"
                   "         sequences')\n"
                   "       [--kv-transfer-config '{\"kv_role\":\"kv_producer\",\"kv_port\":N,\"engine_id\":\"p0\"}']\n"
                   "         (also \"kv_host\": the address the KV listener binds and decode instances pull\n"
                   "          from, default --host; \"kv_lease_ms\": how long a producer holds a KV nobody pulls, default 30000;\n"
                   "          \"kv_timeout_ms\": how long a pull may take before the prompt is recomputed;\n"
                   "          \"kv_producers\": [\"host:port\" or \"host:first-last\", ...], the only producers a\n"
                   "          decode instance pulls from: pdmoe up writes them)\n"
                   "%s"
                   "OpenAI-compatible: /v1/completions, /v1/chat/completions (stream or not), /v1/models,\n"
                   "/health, /metrics. Binds 127.0.0.1 unless --host says otherwise. Ctrl-C stops it.\n",
                   pd_cli_http_help);
            return 0;
        default: {
            int r = pd_cli_http_flag(c, optarg, &o.http);
            if (r > 0)
                break;
            if (r == 0)
                return pd_cli_bad_flag("serve", c, argc, argv);
            return 2;
        }
        }
    }
    if (pd_cli_no_args("serve", argc, argv) || pd_cli_api_key("serve", o.api_key, &o.api_key))
        return 2;
    if (!o.model_dir) {
        fprintf(stderr, "pdmoe serve: --model DIR is required\n");
        return 2;
    }
    if (!o.expert_parallel)
        return serve(&o, dp);
    /* mpirun (Open MPI, or any PMI launcher) says so in the environment; a singleton MPI_Init
     * would silently make a group of one */
    if (!getenv("OMPI_COMM_WORLD_SIZE") && !getenv("PMIX_RANK") && !getenv("PMI_RANK")) {
        fprintf(stderr, "pdmoe serve: --enable-expert-parallel: run under mpirun (mpirun -n N pdmoe serve "
                        "--enable-expert-parallel --data-parallel-size N ...)\n");
        return 2;
    }
    /* Open MPI 4.1's TCP transport listens on every interface whatever btl_tcp_if_include says;
     * a group whose ranks share one machine needs only shared memory between them, so it goes
     * without (the user's OMPI_MCA_btl wins) and no rank listens beyond --host. */
    const char *world = getenv("OMPI_COMM_WORLD_SIZE"), *local = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    if (world && local && !strcmp(world, local) && !getenv("OMPI_MCA_btl"))
        setenv("OMPI_MCA_btl", "self,vader", 1);
    /* A group spanning hosts: each rank keeps Open MPI's TCP transport to the network of the
     * interface carrying its own address (--host, which mpirun's app contexts give each rank), so
     * the ranks meet on the cluster's network and nowhere else (Open MPI matches interfaces by
     * network: a /32 of the address itself matches none). The user's setting wins. */
    int spans = world && local && strcmp(world, local);
    if (spans && (!o.host || !strncmp(o.host, "127.", 4) || !strcmp(o.host, "localhost") || !strcmp(o.host, "::1"))) {
        fprintf(stderr, "pdmoe serve: this EP group spans hosts (%s ranks, %s on this one): --host must be this rank's "
                        "address on the cluster's network, not %s (each rank its own, through mpirun's app contexts: "
                        "mpirun -n 1 --host A pdmoe serve --host A ... : -n 1 --host B pdmoe serve --host B ...)\n",
                world, local, o.host ? o.host : "the default 127.0.0.1");
        return 2;
    }
    if (spans && !getenv("OMPI_MCA_btl_tcp_if_include") && !getenv("OMPI_MCA_btl_tcp_if_exclude")) {
        struct pd_net_iface f;
        pd_err e = {0};
        if (pd_net_iface_of(o.host, "pdmoe serve: --host", &f, &e)) {
            fprintf(stderr, "%s\n", e.msg);
            return 2;
        }
        if (f.cidr[0])
            setenv("OMPI_MCA_btl_tcp_if_include", f.cidr, 1);
    }
    /* Open MPI fails a group whose shared memory does not fit /dev/shm with pages of its own
     * messages, none naming it: the host's first rank names it first (and the group goes on: the
     * figure per rank is an estimate) */
    const char *lrank = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    if (local && lrank && !strcmp(lrank, "0")) {
        char note[400];
        int64_t per_rank = PD_SHM_VADER_RANK_BYTES + (o.role != PD_ROLE_BOTH ? PD_SHM_UCX_WORKER_BYTES : 0);
        if (pd_shm_note(note, sizeof note, atoll(local) * per_rank)[0])
            fprintf(stderr, "pdmoe serve: %s ranks of this group on this host: %s\n", local, note);
    }
    int provided = 0, rank = 0, size = 1;
    pd_ep_mpi_init(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int rc;
    if (dp && dp != size) {
        /* every rank sees the same flags: rank 0 says it once, all leave */
        if (rank == 0)
            fprintf(stderr, "pdmoe serve: --data-parallel-size %lld: this EP group has %d ranks (mpirun -n); they "
                            "must be equal\n", (long long)dp, size);
        rc = 2;
    } else {
        rc = serve(&o, size);
    }
    if (rc == 1 || rc == PD_CLI_EXIT_CONFIG) {
        /* one rank failed: the others cannot step without it (mpirun exits with rc) */
        MPI_Abort(MPI_COMM_WORLD, rc);
    }
    pd_ep_finalize();
    return rc;
}

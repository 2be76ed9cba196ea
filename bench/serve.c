/* `pdmoe bench serve --base-url URL ...`: load against an OpenAI-compatible endpoint, like
 * `vllm bench serve` and with its flag names: Poisson arrivals at --request-rate (inf: all at
 * once), at most --max-concurrency requests in flight (a request arriving beyond it waits for one
 * to finish: with rate inf, the closed loop of C clients), synthetic prompts of --random-input-len
 * words (the prompt tokens they make, from the servers' usage, are printed beside: vLLM's flag
 * counts tokens of random ids, which a text prompt cannot), --random-output-len tokens each
 * (ignore_eos), streamed with the usage event; reports TTFT, TPOT (over the usage's completion
 * tokens) and inter-token latency (between streamed events carrying text) percentiles and
 * throughput (text, or --json). --long-every N
 * --long-input-len L makes every Nth request a long prompt: the mixed workload where
 * disaggregation should protect decode. An endpoint that cannot be reached is an error naming it,
 * before any request is sent.
 * --dataset generated-shared-prefix (SGLang's name): --gsp-num-groups system prompts of
 * --gsp-system-prompt-len words, request i the system prompt of group i % G and its own question
 * of --random-input-len words. --dataset multi-turn: conversations of --num-turns turns, turn t's
 * prompt the system prompt, every earlier user message and (synthetic) answer, and its own message;
 * a conversation's next turn is sent when its last one ends. Both report the TTFT of cold requests
 * (the first of each group or conversation) and warm ones (the rest) and their ratio, and the prefix
 * cache's hit rate: hits / queries of pdmoe_prefix_cache_*_total on the --metrics-url servers
 * (default the endpoint itself), read before and after the run; when those include a decode
 * instance, its KV pulls over the run (pdmoe_kv_transfer*_total), their share of the mean TTFT and
 * the most that pulling only the blocks the decode side lacks could save (issue 15: measured, not
 * built, because that bound is a fraction of a percent of TTFT). A failed request is reported with
 * the server's answer to the first one. */
#include "bench.h"
#include "cli/cli.h"
#include "model/config.h"
#include "core/timing.h"

#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct sreq {
    struct bench_run *run;
    int id, long_prompt;
    int group, turn;             /* --dataset: the system prompt or conversation, the turn in it */
    double t_send, t_first, t_last;
    int chunks, done, ok;
    char body[160];              /* the start of an error answer's body (a failed request's) */
    int n_body;
    double *itl;                 /* gaps between streamed events carrying text */
    int n_itl, cap_itl;
    char *sse;                   /* the stream's bytes not yet a whole event */
    size_t n_sse;
    long prompt_tokens, completion_tokens;   /* the usage event's; -1 until it comes */
    struct evhttp_connection *conn;
};

struct bench_run {
    struct event_base *base;
    char host[64];
    int port;
    const char *model;
    int input_len, output_len, long_every, long_input_len, n;
    double rate, temperature;
    int text;                    /* prompts from the English corpus instead of ten repeated words */
    const char **words;          /* the corpus's words (letters and apostrophes), when text */
    int *word_len, n_words;
    struct sreq *r;
    int finished;
    uint64_t rng;
    int max_concurrency;         /* 0: no limit */
    int in_flight, peak_in_flight;
    char first_error[240];       /* the first failed request's status and the start of its body */
    int *pending, n_pending, next_pending;   /* arrived beyond max_concurrency, in arrival order */
    enum { DS_RANDOM, DS_SHARED, DS_TURNS } dataset;
    int groups, sys_len, turns;  /* shared prefix: groups, system prompt words; multi-turn: turns */
    unsigned run_id;             /* in every system prompt: a run's prompts are no earlier run's (--seed: that) */
};

static void send_now(struct sreq *q);
static void send_one(evutil_socket_t fd, short what, void *arg);

/* `n` words of text `what` number `k` (a system prompt, a user message, an answer): the same
 * words each time it is asked for, different from every other's. */
static int dataset_words(char *p, const char *what, int k, int n)
{
    static const char *v[] = {"alpha", "bravo", "delta", "echo", "forest", "garden", "harbor", "island", "jungle",
                              "kettle", "lantern", "meadow", "north", "orange", "pebble", "quartz"};
    char *s = p;
    s += sprintf(s, " [%s %d]", what, k);
    uint64_t h = (uint64_t)k * 0x9e3779b97f4a7c15ull + (uint64_t)(unsigned char)what[0];
    for (int i = 0; i < n; i++) {
        h = h * 6364136223846793005ull + 1442695040888963407ull;
        s += sprintf(s, " %s%d", v[(h >> 33) % 16], (int)((h >> 40) % 100));
    }
    return (int)(s - p);
}

/* The prompt of a --dataset request into p (JSON-safe text); its length. */
static int dataset_prompt(const struct bench_run *b, const struct sreq *q, char *p)
{
    char *s = p;
    /* the run's own system prompts: an earlier run's left them in the servers' prefix caches, and
     * its "cold" requests hit them (a second run read warm / cold 1.22 for 0.55) */
    s += sprintf(s, " [run %u]", b->run_id);
    s += dataset_words(s, "system", q->group, b->sys_len);
    if (b->dataset == DS_SHARED)
        return (int)(s - p) + dataset_words(s, "question", q->id, b->input_len);
    /* the conversation so far: user k and assistant k for k < turn, then user turn */
    for (int k = 0; k <= q->turn; k++) {
        s += dataset_words(s, "user", q->group * 1000 + k, b->input_len);
        if (k < q->turn)
            s += dataset_words(s, "assistant", q->group * 1000 + k, b->output_len);
    }
    return (int)(s - p);
}

static double urand(struct bench_run *b)
{
    b->rng = b->rng * 6364136223846793005ull + 1442695040888963407ull;
    return ((b->rng >> 11) + 0.5) / 9007199254740992.0;
}

static void free_conn(evutil_socket_t fd, short what, void *arg)
{
    evhttp_connection_free(arg);
}

/* One whole server-sent event of q's stream (len bytes at ev, without its blank line): an event
 * whose choice carries text is a token arrival (several tokens, with speculative decoding: the
 * usage counts them); the usage event (stream_options.include_usage) gives the token counts. The
 * finish event (empty text) and [DONE] are neither. */
static void on_event(struct sreq *q, const char *ev, size_t len)
{
    if (len < 6 || strncmp(ev, "data: ", 6) || (len == 12 && !strncmp(ev, "data: [DONE]", 12)))
        return;
    json_t *j = json_loadb(ev + 6, len - 6, 0, NULL);
    json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
    const char *text = json_string_value(json_object_get(c0, "text"));
    if (!text)
        text = json_string_value(json_object_get(json_object_get(c0, "delta"), "content"));
    json_t *u = json_object_get(j, "usage");
    if (json_is_object(u)) {
        q->prompt_tokens = (long)json_integer_value(json_object_get(u, "prompt_tokens"));
        q->completion_tokens = (long)json_integer_value(json_object_get(u, "completion_tokens"));
    }
    if (text && text[0]) {
        double now = pd_now_s();
        if (!q->chunks)
            q->t_first = now;
        else {
            if (q->n_itl == q->cap_itl) {
                q->cap_itl = q->cap_itl ? 2 * q->cap_itl : 64;
                q->itl = realloc(q->itl, (size_t)q->cap_itl * sizeof *q->itl);
            }
            q->itl[q->n_itl++] = now - q->t_last;
        }
        q->t_last = now;
        q->chunks++;
    }
    json_decref(j);
}

static void on_chunk(struct evhttp_request *h, void *arg)
{
    struct sreq *q = arg;
    struct evbuffer *in = evhttp_request_get_input_buffer(h);
    size_t n = evbuffer_get_length(in);
    if (evhttp_request_get_response_code(h) != 200) {   /* an error's body: kept for the report */
        int room = (int)sizeof q->body - 1 - q->n_body;
        int k = (int)evbuffer_remove(in, q->body + q->n_body, (size_t)((int)n < room ? (int)n : room));
        q->body[q->n_body += k > 0 ? k : 0] = 0;
        evbuffer_drain(in, evbuffer_get_length(in));
        return;
    }
    /* whole events only: a read may end inside one, or hold several */
    q->sse = realloc(q->sse, q->n_sse + n + 1);
    evbuffer_remove(in, q->sse + q->n_sse, n);
    q->n_sse += n;
    q->sse[q->n_sse] = 0;
    size_t at = 0;
    for (char *end; (end = strstr(q->sse + at, "\n\n"));) {
        on_event(q, q->sse + at, (size_t)(end - (q->sse + at)));
        at = (size_t)(end - q->sse) + 2;
    }
    memmove(q->sse, q->sse + at, q->n_sse - at + 1);
    q->n_sse -= at;
}

static void on_done(struct evhttp_request *h, void *arg)
{
    struct sreq *q = arg;
    struct bench_run *b = q->run;
    q->done = 1;
    int code = h ? evhttp_request_get_response_code(h) : 0;
    q->ok = code == 200 && q->chunks > 0;
    if (!q->ok && !b->first_error[0]) {
        /* what the server said: the body on_chunk kept, or what is still in the input buffer */
        struct evbuffer *in = h ? evhttp_request_get_input_buffer(h) : NULL;
        ev_ssize_t got = in && !q->n_body ? evbuffer_copyout(in, q->body, sizeof q->body - 1) : 0;
        if (got > 0)
            q->body[got] = 0;
        if (code)
            snprintf(b->first_error, sizeof b->first_error, "HTTP %d%s%s", code, q->body[0] ? ": " : "", q->body);
        else
            snprintf(b->first_error, sizeof b->first_error, "no response (the connection failed)");
    }
    event_base_once(b->base, -1, EV_TIMEOUT, free_conn, q->conn, &(struct timeval){0, 0});
    b->in_flight--;
    if (b->next_pending < b->n_pending)
        send_now(&b->r[b->pending[b->next_pending++]]);
    /* a conversation's next turn comes once this one is answered */
    if (b->dataset == DS_TURNS && q->turn + 1 < b->turns && q->id + 1 < b->n)
        send_one(-1, 0, &b->r[q->id + 1]);
    if (++b->finished == b->n)
        event_base_loopexit(b->base, NULL);
}

/* A request's arrival: sent now, or queued while max_concurrency are in flight. */
static void send_one(evutil_socket_t fd, short what, void *arg)
{
    struct sreq *q = arg;
    struct bench_run *b = q->run;
    if (b->max_concurrency > 0 && b->in_flight >= b->max_concurrency) {
        b->pending[b->n_pending++] = q->id;
        return;
    }
    send_now(q);
}

static void send_now(struct sreq *q)
{
    struct bench_run *b = q->run;
    if (++b->in_flight > b->peak_in_flight)
        b->peak_in_flight = b->in_flight;
    int len = q->long_prompt ? b->long_input_len : b->input_len;
    static const char *words[] = {"the", "sea", "clock", "bread", "river", "morning", "town", "light", "winter", "gear"};
    size_t cap = (size_t)len * 40 + 512;
    if (b->dataset != DS_RANDOM)
        cap += (size_t)(b->sys_len + (q->turn + 1) * (b->input_len + b->output_len)) * 12 + 64 * (size_t)(q->turn + 1);
    char *body = malloc(cap + 256), *p = body;
    p += sprintf(p, "{\"model\":\"%s\",\"prompt\":\"", b->model);
    if (b->dataset != DS_RANDOM) {
        p += dataset_prompt(b, q, p);
        sprintf(p, "\",\"max_tokens\":%d,\"ignore_eos\":true,\"stream\":true,\"stream_options\":{\"include_usage\":true},"
                "\"temperature\":%g}", b->output_len, b->temperature);
        goto send;
    }
    p += sprintf(p, "request %d:", q->id);
    for (int i = 0; i < len; i++) {
        if (b->text) {   /* request id's own window of the text, wrapping */
            int w = (int)(((size_t)q->id * 53 + (size_t)i) % (size_t)b->n_words);
            p += sprintf(p, " %.*s", b->word_len[w] < 32 ? b->word_len[w] : 32, b->words[w]);
        } else {
            p += sprintf(p, " %s", words[(i * 7 + q->id) % 10]);
        }
    }
    sprintf(p, "\",\"max_tokens\":%d,\"ignore_eos\":true,\"stream\":true,\"stream_options\":{\"include_usage\":true},"
            "\"temperature\":%g}", b->output_len, b->temperature);
send:
    q->conn = evhttp_connection_base_new(b->base, NULL, b->host, (unsigned short)b->port);
    evhttp_connection_set_timeout(q->conn, 600);
    struct evhttp_request *h = evhttp_request_new(on_done, q);
    evhttp_request_set_chunked_cb(h, on_chunk);
    evhttp_add_header(evhttp_request_get_output_headers(h), "Host", b->host);
    evhttp_add_header(evhttp_request_get_output_headers(h), "Content-Type", "application/json");
    evbuffer_add(evhttp_request_get_output_buffer(h), body, strlen(body));
    free(body);
    q->t_send = pd_now_s();
    if (evhttp_make_request(q->conn, h, EVHTTP_REQ_POST, "/v1/completions") != 0)
        on_done(NULL, q);
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, int n, double p)
{
    if (n == 0)
        return NAN;
    int i = (int)ceil(p / 100.0 * n) - 1;
    return v[i < 0 ? 0 : i >= n ? n - 1 : i];
}

/* One metric's line (text) or object (added to doc under key, in ms); none without samples. */
static void report(const char *what, const char *key, double *v, int n, json_t *doc)
{
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    double s = 0;
    for (int i = 0; i < n; i++)
        s += v[i];
    if (doc) {
        json_object_set_new(doc, key, n ? json_pack("{s:f,s:f,s:f,s:f,s:i}", "mean_ms", s / n * 1e3, "p50_ms",
                                                    pct(v, n, 50) * 1e3, "p90_ms", pct(v, n, 90) * 1e3, "p99_ms",
                                                    pct(v, n, 99) * 1e3, "samples", n)
                                        : json_null());
        return;
    }
    if (n == 0) {
        printf("  %-26s no samples\n", what);
        return;
    }
    printf("  %-26s mean %8.2f  p50 %8.2f  p90 %8.2f  p99 %8.2f  (ms, %d samples)\n", what, s / n * 1e3,
           pct(v, n, 50) * 1e3, pct(v, n, 90) * 1e3, pct(v, n, 99) * 1e3, n);
}

static const char serve_usage[] =
    "usage: pdmoe bench serve [--base-url http://127.0.0.1:8000] [--model mini] [--request-rate R|inf]\n"
    "       [--max-concurrency C] [--random-input-len 64] [--random-output-len 32] [--num-prompts 32]\n"
    "       [--seed 0] [--long-every N --long-input-len L] [--prompts words|text] [--temperature 0] [--json]\n"
    "       [--dataset random|generated-shared-prefix|multi-turn] [--gsp-num-groups 4]\n"
    "       [--gsp-system-prompt-len 400] [--num-turns 4] [--metrics-url URL,...]\n"
    "vllm bench serve's names; --url, --input-len and --output-len are accepted for the first three.\n"
    "--random-input-len counts words of the synthetic prompt (vLLM's counts tokens): the prompt tokens they\n"
    "make, from the servers' usage events, are printed beside; throughput and TPOT use the usage's completion\n"
    "tokens, ITL the gaps between streamed events that carry text.\n"
    "--max-concurrency C: at most C requests in flight (with --request-rate inf, C clients each sending its\n"
    "next request when the last one ends). --prompts words (default): ten words repeated; text: each request\n"
    "its own window of an English text (models/corpus.txt), so that expert routing is a real prompt's.\n"
    "--dataset generated-shared-prefix: G system prompts of --gsp-system-prompt-len words, request i group\n"
    "(i mod G)'s and its own question of --random-input-len words; multi-turn: conversations of --num-turns\n"
    "turns, each turn's prompt the whole conversation so far (answers of --random-output-len synthetic words),\n"
    "the next turn sent when the last ends. Both print the TTFT of cold requests (the first of a group or\n"
    "conversation) against warm ones and the prefix cache's hit rate (pdmoe_prefix_cache_hits_total /\n"
    "_queries_total over the run, summed over --metrics-url, default the endpoint; a proxy has none) and, when\n"
    "--metrics-url names a decode instance, its KV pulls: their share of the mean TTFT and the most that\n"
    "pulling only the blocks the decode side lacks could save.\n";

/* Counters summed over the servers of --metrics-url: the prefix cache's (prefill side) and the KV
 * hand-off's (decode side: the pulls, their bytes and their time). */
struct srv_counters {
    double queries, hits;                 /* pdmoe_prefix_cache_{queries,hits}_total, tokens */
    double xfers, xfer_bytes, xfer_s;     /* pdmoe_kv_transfers_total, _transfer_bytes_total, _seconds_total */
    int have_cache, have_xfer;            /* servers that had each */
};

static double counter(const char *text, const char *name, int *found)
{
    char key[96];
    snprintf(key, sizeof key, "\n%s ", name);
    const char *p = strstr(text, key);
    *found = p != NULL;
    return p ? strtod(p + strlen(key), NULL) : 0;
}

/* Reads the counters above from every server of `urls` (comma-separated http://HOST:PORT); -1 if
 * one cannot be read (named on stderr), else 0. */
static int server_counters(const char *urls, struct srv_counters *c)
{
    memset(c, 0, sizeof *c);
    char list[1024];
    snprintf(list, sizeof list, "%s", urls);
    for (char *save = NULL, *u = strtok_r(list, ",", &save); u; u = strtok_r(NULL, ",", &save)) {
        char host[64];
        int port;
        if (sscanf(u, "http://%63[^:/]:%d", host, &port) != 2 || port < 1 || port > 65535) {
            fprintf(stderr, "pdmoe bench serve: --metrics-url %s: expected http://HOST:PORT\n", u);
            return -1;
        }
        char ps[16];
        snprintf(ps, sizeof ps, "%d", port);
        struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
        int fd = -1;
        if (getaddrinfo(host, ps, &hints, &ai) == 0) {
            for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next) {
                fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
                if (fd >= 0 && connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
                    close(fd);
                    fd = -1;
                }
            }
            freeaddrinfo(ai);
        }
        if (fd < 0) {
            fprintf(stderr, "pdmoe bench serve: --metrics-url %s: cannot connect\n", u);
            return -1;
        }
        char req[160];
        int n = snprintf(req, sizeof req, "GET /metrics HTTP/1.0\r\nHost: %s\r\n\r\n", host);
        size_t len = 0, cap = 1 << 16;
        char *text = malloc(cap);
        ssize_t got = text && write(fd, req, (size_t)n) == n ? 1 : -1;
        while (text && got > 0) {
            if (len + 1 == cap) {
                char *t = realloc(text, cap * 2);
                if (!t)
                    break;
                text = t;
                cap *= 2;
            }
            got = read(fd, text + len, cap - 1 - len);
            if (got > 0)
                len += (size_t)got;
        }
        close(fd);
        if (!text) {
            fprintf(stderr, "pdmoe bench serve: out of memory for /metrics of %s\n", u);
            return -1;
        }
        text[len] = 0;
        int fq, fh, fn, fb, fs;
        double q = counter(text, "pdmoe_prefix_cache_queries_total", &fq), h = counter(text, "pdmoe_prefix_cache_hits_total", &fh);
        double np = counter(text, "pdmoe_kv_transfers_total", &fn), by = counter(text, "pdmoe_kv_transfer_bytes_total", &fb);
        double sec = counter(text, "pdmoe_kv_transfer_seconds_total", &fs);
        if (fq && fh) {
            c->queries += q;
            c->hits += h;
            c->have_cache++;
        }
        if (fn && fb && fs && np > 0) {   /* a prefill instance reports zero pulls of its own */
            c->xfers += np;
            c->xfer_bytes += by;
            c->xfer_s += sec;
            c->have_xfer++;
        }
        free(text);
    }
    return 0;
}

/* A whole-number flag in [lo, hi]; 2 (usage error, message printed) otherwise. */
static int serve_int(const char *flag, const char *v, long lo, long hi, int *out)
{
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi) {
        fprintf(stderr, "pdmoe bench serve: %s %s: expected a whole number in [%ld, %ld]\n", flag, v, lo, hi);
        return 2;
    }
    *out = (int)x;
    return 0;
}

/* 0 when a TCP connection to host:port opens; else an error naming the URL and the cause. */
static int reachable(const char *url, const char *host, int port)
{
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    int rc = getaddrinfo(host, ps, &hints, &ai);
    if (rc) {
        fprintf(stderr, "pdmoe bench serve: --base-url %s: %s\n", url, gai_strerror(rc));
        return -1;
    }
    int err = ECONNREFUSED;
    for (struct addrinfo *a = ai; a; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
        if (fd >= 0 && connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
            close(fd);
            freeaddrinfo(ai);
            return 0;
        }
        err = errno;
        if (fd >= 0)
            close(fd);
    }
    freeaddrinfo(ai);
    fprintf(stderr, "pdmoe bench serve: --base-url %s: cannot connect: %s\n", url, strerror(err));
    return -1;
}

int pd_bench_serve(int argc, char **argv)
{
    enum { O_URL = 256, O_MODEL, O_RATE, O_IN, O_OUT, O_N, O_SEED, O_LONG_EVERY, O_LONG_IN, O_PROMPTS, O_TEMP,
           O_CONC, O_JSON, O_HELP, O_DATASET, O_GROUPS, O_SYS, O_TURNS, O_METRICS };
    static const struct option opts[] = {
        {"base-url", 1, 0, O_URL}, {"url", 1, 0, O_URL}, {"model", 1, 0, O_MODEL}, {"request-rate", 1, 0, O_RATE},
        {"random-input-len", 1, 0, O_IN}, {"input-len", 1, 0, O_IN}, {"random-output-len", 1, 0, O_OUT},
        {"output-len", 1, 0, O_OUT}, {"num-prompts", 1, 0, O_N}, {"seed", 1, 0, O_SEED},
        {"long-every", 1, 0, O_LONG_EVERY}, {"long-input-len", 1, 0, O_LONG_IN}, {"prompts", 1, 0, O_PROMPTS},
        {"temperature", 1, 0, O_TEMP}, {"max-concurrency", 1, 0, O_CONC}, {"json", 0, 0, O_JSON},
        {"help", 0, 0, O_HELP}, {"dataset", 1, 0, O_DATASET}, {"dataset-name", 1, 0, O_DATASET},
        {"gsp-num-groups", 1, 0, O_GROUPS}, {"gsp-system-prompt-len", 1, 0, O_SYS}, {"num-turns", 1, 0, O_TURNS},
        {"metrics-url", 1, 0, O_METRICS}, {0, 0, 0, 0},
    };
    struct bench_run b = {.model = "mini", .input_len = 64, .output_len = 32, .n = 32, .rate = INFINITY, .rng = 1,
                          .groups = 4, .sys_len = 400, .turns = 4};
    const char *url = "http://127.0.0.1:8000", *metrics_url = NULL;
    int c, json = 0, seed = 0, idx = 0, seeded = 0;
    const char *groups_flag = NULL, *sys_flag = NULL, *turns_flag = NULL;   /* as given: whose dataset */
    struct pd_cli_seen seen = {0};
    optind = 1;
    opterr = 0;
    while ((c = pd_cli_getopt("bench serve", argc, argv, opts, &idx, NULL, &seen)) != -1) {
        char flag[40];
        snprintf(flag, sizeof flag, "--%s", c >= 256 ? opts[idx].name : "");
        int bad = 0;
        char *end;
        switch (c) {
        case O_URL: url = optarg; break;
        case O_MODEL: b.model = optarg; break;
        case O_RATE:
            b.rate = strcmp(optarg, "inf") ? strtod(optarg, &end) : INFINITY;
            if (strcmp(optarg, "inf") && (*end || end == optarg || !(b.rate > 0) || !isfinite(b.rate))) {
                fprintf(stderr, "pdmoe bench serve: --request-rate %s: expected a positive number or inf\n", optarg);
                return 2;
            }
            break;
        case O_IN: bad = serve_int(flag, optarg, 1, 1 << 20, &b.input_len); break;
        case O_OUT: bad = serve_int(flag, optarg, 1, 1 << 20, &b.output_len); break;
        case O_N: bad = serve_int(flag, optarg, 1, 100000, &b.n); break;
        case O_SEED:
            bad = serve_int(flag, optarg, 0, 1 << 30, &seed);
            b.rng = (uint64_t)seed + 1;
            seeded = 1;
            break;
        case O_LONG_EVERY: bad = serve_int(flag, optarg, 1, 100000, &b.long_every); break;
        case O_LONG_IN: bad = serve_int(flag, optarg, 1, 1 << 20, &b.long_input_len); break;
        case O_CONC: bad = serve_int(flag, optarg, 1, 100000, &b.max_concurrency); break;
        case O_TEMP:
            b.temperature = strtod(optarg, &end);
            if (*end || end == optarg || !(b.temperature >= 0 && b.temperature <= 2)) {
                fprintf(stderr, "pdmoe bench serve: --temperature %s: expected a number in [0, 2]\n", optarg);
                return 2;
            }
            break;
        case O_PROMPTS:
            if (strcmp(optarg, "words") && strcmp(optarg, "text")) {
                fprintf(stderr, "pdmoe bench serve: --prompts %s: expected words or text\n", optarg);
                return 2;
            }
            b.text = strcmp(optarg, "text") == 0;
            break;
        case O_JSON: json = 1; break;
        case O_DATASET:
            if (!strcmp(optarg, "random"))
                b.dataset = DS_RANDOM;
            else if (!strcmp(optarg, "generated-shared-prefix"))
                b.dataset = DS_SHARED;
            else if (!strcmp(optarg, "multi-turn"))
                b.dataset = DS_TURNS;
            else {
                fprintf(stderr, "pdmoe bench serve: --dataset %s: expected random, generated-shared-prefix or multi-turn\n",
                        optarg);
                return 2;
            }
            break;
        case O_GROUPS: bad = serve_int(flag, optarg, 1, 100000, &b.groups); groups_flag = "--gsp-num-groups"; break;
        case O_SYS: bad = serve_int(flag, optarg, 0, 1 << 16, &b.sys_len); sys_flag = "--gsp-system-prompt-len"; break;
        case O_TURNS: bad = serve_int(flag, optarg, 1, 1000, &b.turns); turns_flag = "--num-turns"; break;
        case O_METRICS: metrics_url = optarg; break;
        case 'h':
        case O_HELP: fputs(serve_usage, stdout); return 0;
        default: return pd_cli_bad_flag("bench serve", c, argc, argv);
        }
        if (bad)
            return 2;
    }
    if (optind < argc) {
        fprintf(stderr, "pdmoe bench serve: unexpected argument \"%s\" (see pdmoe bench serve --help)\n", argv[optind]);
        return 2;
    }
    if (sscanf(url, "http://%63[^:/]:%d", b.host, &b.port) != 2 || b.port < 1 || b.port > 65535) {
        fprintf(stderr, "pdmoe bench serve: --base-url %s: expected http://HOST:PORT\n", url);
        return 2;
    }
    /* a dataset's own flags with another dataset would be taken and not used */
    const char *stray = b.dataset != DS_SHARED && groups_flag ? groups_flag : b.dataset == DS_RANDOM && sys_flag ? sys_flag
                        : b.dataset != DS_TURNS && turns_flag ? turns_flag : NULL;
    if (stray) {
        fprintf(stderr, "pdmoe bench serve: %s belongs to --dataset %s, not this run's %s\n", stray,
                stray == turns_flag ? "multi-turn" : stray == sys_flag ? "generated-shared-prefix or multi-turn"
                                                                       : "generated-shared-prefix",
                b.dataset == DS_RANDOM ? "random" : b.dataset == DS_SHARED ? "generated-shared-prefix" : "multi-turn");
        return 2;
    }
    if (b.long_every && !b.long_input_len) {
        fprintf(stderr, "pdmoe bench serve: --long-every %d needs --long-input-len\n", b.long_every);
        return 2;
    }
    if (b.dataset != DS_RANDOM && (b.long_every || b.text)) {
        fprintf(stderr, "pdmoe bench serve: --dataset %s makes its own prompts: no --long-every or --prompts\n",
                b.dataset == DS_SHARED ? "generated-shared-prefix" : "multi-turn");
        return 2;
    }
    if (reachable(url, b.host, b.port))
        return 1;
    /* --seed: that run's prompts again (reproducible); otherwise a run's own */
    b.run_id = seeded ? (unsigned)seed : (unsigned)(pd_now_ns() ^ ((uint64_t)getpid() << 16)) % 1000000000u;
    struct srv_counters c0 = {0};
    if (b.dataset != DS_RANDOM && server_counters(metrics_url ? metrics_url : url, &c0) < 0)
        return 1;
    if (b.text) {
        const char *t = pd_embedded_find("models/corpus.txt");
        size_t n = t ? strlen(t) : 0;
        b.words = malloc((n / 2 + 1) * sizeof *b.words);
        b.word_len = malloc((n / 2 + 1) * sizeof *b.word_len);
        for (size_t i = 0; t && b.words && b.word_len && i < n;) {
            while (i < n && !isalpha((unsigned char)t[i]))
                i++;
            size_t j = i;
            while (j < n && (isalpha((unsigned char)t[j]) || t[j] == '\''))
                j++;
            if (j > i) {
                b.words[b.n_words] = t + i;
                b.word_len[b.n_words++] = (int)(j - i);
            }
            i = j;
        }
        if (b.n_words == 0) {
            fprintf(stderr, "bench serve: --prompts text: no embedded corpus\n");
            return 1;
        }
    }
    b.base = event_base_new();
    b.r = calloc((size_t)b.n, sizeof *b.r);
    b.pending = calloc((size_t)b.n, sizeof *b.pending);
    if (!b.base || !b.r || !b.pending) {
        fprintf(stderr, "pdmoe bench serve: out of memory for %d requests\n", b.n);
        return 1;
    }
    double t = 0;
    for (int i = 0; i < b.n; i++) {
        b.r[i] = (struct sreq){.run = &b, .id = i, .long_prompt = b.long_every > 0 && i % b.long_every == b.long_every - 1,
                               .prompt_tokens = -1, .completion_tokens = -1};
        if (b.dataset == DS_SHARED)
            b.r[i].group = i % b.groups;
        if (b.dataset == DS_TURNS) {
            b.r[i].group = i / b.turns;
            b.r[i].turn = i % b.turns;
            if (b.r[i].turn > 0)
                continue;   /* sent when the turn before it ends */
        }
        struct timeval tv = {(long)t, (long)((t - floor(t)) * 1e6)};
        event_base_once(b.base, -1, EV_TIMEOUT, send_one, &b.r[i], &tv);
        if (isfinite(b.rate))
            t += -log(urand(&b)) / b.rate;
    }
    double t0 = pd_now_s();
    event_base_dispatch(b.base);
    double dur = pd_now_s() - t0;
    double *ttft = calloc((size_t)b.n, sizeof *ttft), *tpot = calloc((size_t)b.n, sizeof *tpot);
    double *ttft_l = calloc((size_t)b.n, sizeof *ttft_l), *tpot_s = calloc((size_t)b.n, sizeof *tpot_s);
    double *ttft_cold = calloc((size_t)b.n, sizeof *ttft_cold), *ttft_warm = calloc((size_t)b.n, sizeof *ttft_warm);
    int nt = 0, nl = 0, ns = 0, ok = 0, n_itl = 0, n_cold = 0, n_warm = 0;
    for (int i = 0; i < b.n; i++)
        n_itl += b.r[i].n_itl;
    double *itl = calloc((size_t)n_itl + 1, sizeof *itl);
    n_itl = 0;
    long tokens = 0, prompt_tokens = 0, no_usage = 0;
    for (int i = 0; i < b.n; i++) {
        struct sreq *q = &b.r[i];
        free(q->sse);
        if (!q->ok)
            continue;
        ok++;
        /* the tokens the server says it generated (a request may end before max_tokens); without
         * a usage event, the events that carried text, each at least one */
        long gen = q->completion_tokens >= 0 ? q->completion_tokens : q->chunks;
        no_usage += q->completion_tokens < 0;
        tokens += gen;
        prompt_tokens += q->prompt_tokens > 0 ? q->prompt_tokens : 0;
        if (q->long_prompt)
            ttft_l[nl++] = q->t_first - q->t_send;
        /* cold: the first request of its group or conversation, which no other could have cached */
        if (b.dataset == DS_SHARED || b.dataset == DS_TURNS) {
            int cold = b.dataset == DS_SHARED ? i < b.groups : q->turn == 0;
            if (cold)
                ttft_cold[n_cold++] = q->t_first - q->t_send;
            else
                ttft_warm[n_warm++] = q->t_first - q->t_send;
        }
        ttft[nt] = q->t_first - q->t_send;
        tpot[nt++] = gen > 1 ? (q->t_last - q->t_first) / (double)(gen - 1) : 0;
        if (!q->long_prompt)
            tpot_s[ns++] = gen > 1 ? (q->t_last - q->t_first) / (double)(gen - 1) : 0;
        if (q->n_itl)   /* (none when the text came in one event) */
            memcpy(itl + n_itl, q->itl, (size_t)q->n_itl * sizeof *itl);
        n_itl += q->n_itl;
        free(q->itl);
    }
    char rate[32];
    snprintf(rate, sizeof rate, isfinite(b.rate) ? "%.2f" : "inf", b.rate);
    json_t *doc = json ? json_object() : NULL;
    if (doc) {
        json_object_set_new(doc, "base_url", json_string(url));
        json_object_set_new(doc, "requests", json_integer(b.n));
        json_object_set_new(doc, "completed", json_integer(ok));
        json_object_set_new(doc, "failed", json_integer(b.n - ok));
        json_object_set_new(doc, "request_rate", isfinite(b.rate) ? json_real(b.rate) : json_string("inf"));
        json_object_set_new(doc, "max_concurrency", b.max_concurrency ? json_integer(b.max_concurrency) : json_null());
        json_object_set_new(doc, "peak_in_flight", json_integer(b.peak_in_flight));
        json_object_set_new(doc, "random_input_len", json_integer(b.input_len));
        json_object_set_new(doc, "random_output_len", json_integer(b.output_len));
        json_object_set_new(doc, "prompt_tokens_mean", ok && ok > no_usage ? json_real((double)prompt_tokens / (ok - no_usage))
                                                                            : json_null());
        json_object_set_new(doc, "completion_tokens", json_integer(tokens));
        json_object_set_new(doc, "duration_s", json_real(dur));
        json_object_set_new(doc, "request_throughput", json_real(ok / dur));
        json_object_set_new(doc, "output_throughput", json_real(tokens / dur));
    } else {
        printf("pdmoe bench serve: %s, %d requests (%d ok, %d failed) %s%s%s", url, b.n, ok, b.n - ok,
               isfinite(b.rate) ? "at " : "all sent at once", isfinite(b.rate) ? rate : "",
               isfinite(b.rate) ? " req/s (Poisson arrivals)" : "");
        if (b.max_concurrency)
            printf(", at most %d in flight (peak %d)", b.max_concurrency, b.peak_in_flight);
        printf(", prompts of %d words", b.input_len);
        if (ok > no_usage)
            printf(" (%.1f prompt tokens on average, the servers' usage)", (double)prompt_tokens / (ok - no_usage));
        printf(", %d output tokens each", b.output_len);
        if (b.long_every)
            printf(", every %dth prompt %d words", b.long_every, b.long_input_len);
        if (no_usage)
            printf("\n  %ld requests had no usage event: their tokens are their text events", no_usage);
        printf("\n  duration %.2f s, request throughput %.2f req/s, output throughput %.1f tokens/s\n", dur, ok / dur,
               tokens / dur);
    }
    report("TTFT", "ttft", ttft, nt, doc);
    report("TPOT", "tpot", tpot, nt, doc);
    report("ITL (between text events)", "itl", itl, n_itl, doc);
    if (b.long_every) {
        report("TTFT, long prompts", "ttft_long", ttft_l, nl, doc);
        report("TPOT, short requests", "tpot_short", tpot_s, ns, doc);
    }
    if (b.dataset != DS_RANDOM) {
        struct srv_counters c1 = {0};
        int have = server_counters(metrics_url ? metrics_url : url, &c1) < 0 ? 0 : c1.have_cache;
        double q0 = c0.queries, h0 = c0.hits, q1 = c1.queries, h1 = c1.hits;
        double mc = 0, mw = 0;
        for (int i = 0; i < n_cold; i++)
            mc += ttft_cold[i] / n_cold;
        for (int i = 0; i < n_warm; i++)
            mw += ttft_warm[i] / n_warm;
        report("TTFT, cold (first of each)", "ttft_cold", ttft_cold, n_cold, doc);
        report("TTFT, warm (shared prefix)", "ttft_warm", ttft_warm, n_warm, doc);
        double rate_hit = have > 0 && q1 > q0 ? (h1 - h0) / (q1 - q0) : NAN;
        /* The decode side pulls every block of a prompt's KV. Pulling only what it lacks (the blocks
         * of a prefix it already held) would skip at most the hit rate's share of the compressed
         * entries (the slot's window and compressor state always travel): at most rate_hit times
         * the pull time. Set against the mean TTFT, that bound says whether it is worth building. */
        double dx = c1.xfers - c0.xfers, db = c1.xfer_bytes - c0.xfer_bytes, dsec = c1.xfer_s - c0.xfer_s;
        double ttft_mean = 0;
        for (int i = 0; i < nt; i++)
            ttft_mean += ttft[i] / nt;
        int pulls = c1.have_xfer > 0 && dx > 0 && ttft_mean > 0;
        double pull_share = pulls ? dsec / dx / ttft_mean : NAN;
        if (doc) {
            json_object_set_new(doc, "dataset", json_string(b.dataset == DS_SHARED ? "generated-shared-prefix" : "multi-turn"));
            json_object_set_new(doc, "run_id", json_integer(b.run_id));
            json_object_set_new(doc, "ttft_warm_over_cold", n_cold && n_warm ? json_real(mw / mc) : json_null());
            json_object_set_new(doc, "prefix_cache_queries", have > 0 ? json_real(q1 - q0) : json_null());
            json_object_set_new(doc, "prefix_cache_hits", have > 0 ? json_real(h1 - h0) : json_null());
            json_object_set_new(doc, "prefix_cache_hit_rate", isfinite(rate_hit) ? json_real(rate_hit) : json_null());
            json_object_set_new(doc, "kv_pulls", pulls ? json_real(dx) : json_null());
            json_object_set_new(doc, "kv_pull_bytes", pulls ? json_real(db) : json_null());
            json_object_set_new(doc, "kv_pull_seconds", pulls ? json_real(dsec) : json_null());
            json_object_set_new(doc, "kv_pull_over_ttft", pulls ? json_real(pull_share) : json_null());
            json_object_set_new(doc, "kv_pull_saving_bound_over_ttft",
                                pulls && isfinite(rate_hit) ? json_real(rate_hit * pull_share) : json_null());
        } else {
            printf("  system prompts of run %u (%s)\n", b.run_id,
                   seeded ? "--seed: a run of the same seed again hits them from the start" : "this run's own");
            if (n_cold && n_warm)
                printf("  TTFT warm / cold (means)     %.3f\n", mw / mc);
            if (have > 0 && isfinite(rate_hit))
                printf("  prefix cache: %.0f of %.0f prompt tokens hit (hit rate %.3f)\n", h1 - h0, q1 - q0, rate_hit);
            else if (have > 0)
                printf("  prefix cache: no prompt token looked up (--no-enable-prefix-caching?)\n");
            else
                printf("  prefix cache: no pdmoe_prefix_cache counters at %s (a proxy has none: --metrics-url "
                       "names the instances)\n", metrics_url ? metrics_url : url);
            if (pulls) {
                printf("  KV hand-off: %.0f pulls, %.2f MB in %.1f ms, %.2f ms per pull = %.4f of the mean TTFT\n", dx,
                       db / 1e6, dsec * 1e3, dsec / dx * 1e3, pull_share);
                if (isfinite(rate_hit))
                    printf("  pulling only what the decode side lacks would save at most hit rate x that = %.4f of the "
                           "mean TTFT: the decode side pulls everything\n", rate_hit * pull_share);
            }
        }
    }
    if (doc) {
        char *out = json_dumps(doc, JSON_INDENT(2));
        puts(out);
        free(out);
        json_decref(doc);
    }
    if (ok < b.n)
        fprintf(stderr, "pdmoe bench serve: %d of %d requests failed (no 200 with streamed tokens); the first: %s\n",
                b.n - ok, b.n, b.first_error[0] ? b.first_error : "a 200 with no token");
    free(ttft);
    free(tpot);
    free(ttft_l);
    free(tpot_s);
    free(ttft_cold);
    free(ttft_warm);
    free(itl);
    free(b.r);
    free(b.pending);
    free(b.words);
    free(b.word_len);
    event_base_free(b.base);
    return ok == b.n ? 0 : 1;
}

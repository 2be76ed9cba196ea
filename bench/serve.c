/* `pdmoe bench serve --url URL ...`: load against an OpenAI-compatible endpoint, like
 * `vllm bench serve`: Poisson arrivals at --request-rate (inf: all at once), synthetic prompts of
 * about --input-len tokens, --output-len tokens each (ignore_eos), streamed; reports TTFT, TPOT
 * and inter-token latency percentiles and throughput. --long-every N --long-input-len L makes every
 * Nth request a long prompt: the mixed workload where disaggregation should protect decode. */
#include "bench.h"
#include "model/config.h"
#include "core/timing.h"

#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <ctype.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct sreq {
    struct bench_run *run;
    int id, long_prompt;
    double t_send, t_first, t_last;
    int chunks, done, ok;
    double *itl;                 /* gaps between chunks */
    int n_itl, cap_itl;
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
};

static double urand(struct bench_run *b)
{
    b->rng = b->rng * 6364136223846793005ull + 1442695040888963407ull;
    return ((b->rng >> 11) + 0.5) / 9007199254740992.0;
}

static void free_conn(evutil_socket_t fd, short what, void *arg)
{
    evhttp_connection_free(arg);
}

static void on_chunk(struct evhttp_request *h, void *arg)
{
    struct sreq *q = arg;
    struct evbuffer *in = evhttp_request_get_input_buffer(h);
    size_t n = evbuffer_get_length(in);
    char *buf = malloc(n + 1);
    evbuffer_remove(in, buf, n);
    buf[n] = 0;
    /* a chunk with generated text counts as a token arrival */
    if (strstr(buf, "\"text\":\"") || strstr(buf, "\"content\":\"")) {
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
    free(buf);
}

static void on_done(struct evhttp_request *h, void *arg)
{
    struct sreq *q = arg;
    q->done = 1;
    q->ok = h && evhttp_request_get_response_code(h) == 200 && q->chunks > 0;
    event_base_once(q->run->base, -1, EV_TIMEOUT, free_conn, q->conn, &(struct timeval){0, 0});
    if (++q->run->finished == q->run->n)
        event_base_loopexit(q->run->base, NULL);
}

static void send_one(evutil_socket_t fd, short what, void *arg)
{
    struct sreq *q = arg;
    struct bench_run *b = q->run;
    int len = q->long_prompt ? b->long_input_len : b->input_len;
    static const char *words[] = {"the", "sea", "clock", "bread", "river", "morning", "town", "light", "winter", "gear"};
    size_t cap = (size_t)len * 40 + 512;
    char *body = malloc(cap + 256), *p = body;
    p += sprintf(p, "{\"model\":\"%s\",\"prompt\":\"request %d:", b->model, q->id);
    for (int i = 0; i < len; i++) {
        if (b->text) {   /* request id's own window of the text, wrapping */
            int w = (int)(((size_t)q->id * 53 + (size_t)i) % (size_t)b->n_words);
            p += sprintf(p, " %.*s", b->word_len[w] < 32 ? b->word_len[w] : 32, b->words[w]);
        } else {
            p += sprintf(p, " %s", words[(i * 7 + q->id) % 10]);
        }
    }
    sprintf(p, "\",\"max_tokens\":%d,\"ignore_eos\":true,\"stream\":true,\"temperature\":%g}", b->output_len,
            b->temperature);
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

static void report(const char *what, double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    double s = 0;
    for (int i = 0; i < n; i++)
        s += v[i];
    printf("  %-26s mean %8.2f  p50 %8.2f  p90 %8.2f  p99 %8.2f  (ms, %d samples)\n", what, n ? s / n * 1e3 : NAN,
           pct(v, n, 50) * 1e3, pct(v, n, 90) * 1e3, pct(v, n, 99) * 1e3, n);
}

int pd_bench_serve(int argc, char **argv)
{
    static const struct option opts[] = {
        {"url", 1, 0, 'u'}, {"model", 1, 0, 'm'}, {"request-rate", 1, 0, 'r'}, {"input-len", 1, 0, 'i'},
        {"output-len", 1, 0, 'o'}, {"num-prompts", 1, 0, 'n'}, {"seed", 1, 0, 's'}, {"long-every", 1, 0, 'e'},
        {"long-input-len", 1, 0, 'L'}, {"prompts", 1, 0, 'p'}, {"temperature", 1, 0, 't'}, {0, 0, 0, 0},
    };
    struct bench_run b = {.model = "mini", .input_len = 64, .output_len = 32, .n = 32, .rate = INFINITY, .rng = 1};
    const char *url = "http://127.0.0.1:8000";
    int c;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'u': url = optarg; break;
        case 'm': b.model = optarg; break;
        case 'r': b.rate = strcmp(optarg, "inf") ? atof(optarg) : INFINITY; break;
        case 'i': b.input_len = atoi(optarg); break;
        case 'o': b.output_len = atoi(optarg); break;
        case 'n': b.n = atoi(optarg); break;
        case 's': b.rng = (uint64_t)atoll(optarg) + 1; break;
        case 'e': b.long_every = atoi(optarg); break;
        case 'L': b.long_input_len = atoi(optarg); break;
        case 't': b.temperature = atof(optarg); break;
        case 'p':
            if (strcmp(optarg, "words") && strcmp(optarg, "text")) {
                fprintf(stderr, "bench serve: --prompts %s: expected words or text\n", optarg);
                return 2;
            }
            b.text = strcmp(optarg, "text") == 0;
            break;
        default:
            fprintf(stderr, "usage: pdmoe bench serve [--url http://127.0.0.1:8000] [--model mini] [--request-rate R|inf]\n"
                            "       [--input-len 64] [--output-len 32] [--num-prompts 32] [--seed 0]\n"
                            "       [--long-every N --long-input-len L] [--prompts words|text] [--temperature 0]\n"
                            "--prompts words (default): ten words repeated; text: each request its own window of an\n"
                            "English text (models/corpus.txt), so that expert routing is a real prompt's\n");
            return 2;
        }
    }
    if (sscanf(url, "http://%63[^:]:%d", b.host, &b.port) != 2 || b.n < 1 || b.n > 100000 || b.input_len < 1 ||
        b.output_len < 1 || !(b.rate > 0)) {
        fprintf(stderr, "bench serve: --url must be http://host:port; sizes and rate positive\n");
        return 2;
    }
    if (!(b.temperature >= 0 && b.temperature <= 2)) {
        fprintf(stderr, "bench serve: --temperature: expected a number in [0, 2]\n");
        return 2;
    }
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
    double t = 0;
    for (int i = 0; i < b.n; i++) {
        b.r[i] = (struct sreq){.run = &b, .id = i, .long_prompt = b.long_every > 0 && i % b.long_every == b.long_every - 1};
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
    int nt = 0, nl = 0, ns = 0, ok = 0, n_itl = 0;
    for (int i = 0; i < b.n; i++)
        n_itl += b.r[i].n_itl;
    double *itl = calloc((size_t)n_itl + 1, sizeof *itl);
    n_itl = 0;
    long tokens = 0;
    for (int i = 0; i < b.n; i++) {
        struct sreq *q = &b.r[i];
        if (!q->ok)
            continue;
        ok++;
        tokens += b.output_len;
        if (q->long_prompt)
            ttft_l[nl++] = q->t_first - q->t_send;
        ttft[nt] = q->t_first - q->t_send;
        tpot[nt++] = b.output_len > 1 ? (q->t_last - q->t_first) / (b.output_len - 1) : 0;
        if (!q->long_prompt)
            tpot_s[ns++] = b.output_len > 1 ? (q->t_last - q->t_first) / (b.output_len - 1) : 0;
        memcpy(itl + n_itl, q->itl, (size_t)q->n_itl * sizeof *itl);
        n_itl += q->n_itl;
        free(q->itl);
    }
    char rate[32];
    snprintf(rate, sizeof rate, isfinite(b.rate) ? "%.2f" : "inf", b.rate);
    printf("pdmoe bench serve: %s, %d requests (%d ok) at %s req/s (Poisson), %d input / %d output tokens", url, b.n,
           ok, rate, b.input_len, b.output_len);
    if (b.long_every)
        printf(", every %dth prompt %d tokens", b.long_every, b.long_input_len);
    printf("\n  duration %.2f s, request throughput %.2f req/s, output throughput %.1f tokens/s\n", dur, ok / dur,
           tokens / dur);
    report("TTFT", ttft, nt);
    report("TPOT", tpot, nt);
    report("ITL (between chunks)", itl, n_itl);
    if (b.long_every) {
        report("TTFT, long prompts", ttft_l, nl);
        report("TPOT, short requests", tpot_s, ns);
    }
    free(ttft);
    free(tpot);
    free(ttft_l);
    free(tpot_s);
    free(itl);
    free(b.r);
    free(b.words);
    free(b.word_len);
    event_base_free(b.base);
    return ok == b.n ? 0 : 1;
}

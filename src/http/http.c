/* HTTP helpers on libevent and jansson (see http.h). */
#include "http/http.h"

#include <arpa/inet.h>
#include <event2/buffer.h>
#include <event2/http_struct.h>
#include <event2/keyvalq_struct.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *pd_http_reason(int code)
{
    switch (code) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 413: return "Payload Too Large";
    case 403: return "Forbidden";
    case 408: return "Request Timeout";
    case 417: return "Expectation Failed";
    case 429: return "Too Many Requests";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 505: return "HTTP Version Not Supported";
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    }
    return code >= 500 ? "Server Error" : "Error";
}

int pd_http_read_json(struct evbuffer *b, size_t flags, json_t **out, json_error_t *je)
{
    size_t n = evbuffer_get_length(b);
    const char *p = n ? (const char *)evbuffer_pullup(b, -1) : "";
    *out = NULL;
    if (!p) {
        if (je)
            snprintf(je->text, sizeof je->text, "out of memory for a body of %zu bytes", n);
        return PD_ENOMEM;
    }
    *out = json_loadb(p, n, flags, je);
    /* jansson names its own flag; the client needs to hear what its body holds, and that it is
     * its body's JSON at fault (jansson's words alone: "unexpected token near end of file") */
    if (!*out && je && strstr(je->text, "JSON_ALLOW_NUL")) {
        snprintf(je->text, sizeof je->text, "the body's JSON holds \\u0000 (a NUL character) at byte %d: no "
                 "string may (prompt, messages, stop)", je->position);
    } else if (!*out && je) {
        char why[sizeof je->text];
        snprintf(why, sizeof why, "%s", je->text);
        snprintf(je->text, sizeof je->text, "the body is not valid JSON: %.120s", why);   /* (160 bytes in all) */
    }
    return *out ? 0 : PD_EFORMAT;
}

void pd_http_json(struct evhttp_request *h, int code, json_t *j)
{
    /* j is NULL when building it ran out of memory: the client still gets an answer */
    static const char oom[] = "{\"error\":{\"message\":\"out of memory building the answer\",\"type\":"
                              "\"server_error\",\"param\":null,\"code\":null}}";
    char *txt = j ? json_dumps(j, JSON_COMPACT) : NULL;
    if (!txt)
        code = 500;
    struct evbuffer *b = evbuffer_new();
    evhttp_add_header(evhttp_request_get_output_headers(h), "Content-Type", "application/json");
    if (b && evbuffer_add(b, txt ? txt : oom, txt ? strlen(txt) : sizeof oom - 1) == 0)
        pd_http_send(h, code, pd_http_reason(code), b);
    else
        evhttp_send_error(h, 500, "out of memory");
    if (b)
        evbuffer_free(b);
    free(txt);
    json_decref(j);
}

/* {"error": {"message", "type", "param", "code"}}, or NULL if memory runs out */
static json_t *error_json(const char *type, const char *param, const char *message)
{
    /* a message quoting the client's bytes (a path, a value) may not be UTF-8, which JSON needs,
     * or may be cut inside a character */
    json_t *m = json_string(message);
    if (!m) {
        char *copy = strdup(message);
        for (char *c = copy; c && *c; c++)
            if ((unsigned char)*c >= 0x80)
                *c = '?';
        m = copy ? json_string(copy) : NULL;
        free(copy);
    }
    return m ? json_pack("{s:{s:o,s:s,s:s?,s:n}}", "error", "message", m, "type", type, "param", param, "code") : NULL;
}

char *pd_http_error_body(const char *type, const char *param, const char *message)
{
    json_t *j = error_json(type, param, message);
    char *txt = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return txt;
}

void pd_http_error(struct evhttp_request *h, int code, const char *type, const char *param, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pd_http_json(h, code, error_json(type, param, msg));
}

void pd_http_send(struct evhttp_request *h, int code, const char *reason, struct evbuffer *b)
{
    if (evhttp_request_get_command(h) == EVHTTP_REQ_HEAD) {
        /* libevent 2.1 would send the body: GET's headers, Content-Length included, without it */
        char len[24];
        snprintf(len, sizeof len, "%zu", b ? evbuffer_get_length(b) : 0);
        evhttp_add_header(evhttp_request_get_output_headers(h), "Content-Length", len);
        if (b)
            evbuffer_drain(b, evbuffer_get_length(b));
        evhttp_send_reply(h, code, reason, NULL);
        return;
    }
    evhttp_send_reply(h, code, reason, b);
}

void pd_http_text(struct evhttp_request *h, const char *content_type, struct evbuffer *b)
{
    evhttp_add_header(evhttp_request_get_output_headers(h), "Content-Type", content_type);
    pd_http_send(h, 200, "OK", b);
}

int pd_http_authorised(struct evhttp_request *h, const char *key)
{
    if (!key)
        return 1;
    const char *a = evhttp_find_header(evhttp_request_get_input_headers(h), "Authorization");
    /* RFC 9110 11.4: the scheme's name is case-insensitive, one or more spaces after it */
    if (!a || evutil_ascii_strncasecmp(a, "Bearer ", 7)) {
        /* RFC 9110 11.6.1: a 401 carries the challenge of the scheme it wants */
        evhttp_add_header(evhttp_request_get_output_headers(h), "WWW-Authenticate", "Bearer");
        return 0;
    }
    a += 7 + strspn(a + 7, " ");
    size_t na = strlen(a), nk = strlen(key);
    /* every byte of the key is compared, whatever the header holds: its length and the first
     * difference leave no trace in the time taken */
    volatile unsigned char diff = na != nk;
    for (size_t i = 0; i < nk; i++)
        diff |= (unsigned char)key[i] ^ (unsigned char)(i < na ? a[i] : 0);
    if (diff)
        evhttp_add_header(evhttp_request_get_output_headers(h), "WWW-Authenticate", "Bearer");
    return diff == 0;
}

int pd_http_add_key(struct evhttp_request *r, const char *key)
{
    if (!key)
        return 0;
    size_t n = strlen(key) + sizeof "Bearer ";
    char *v = malloc(n);
    if (!v)
        return PD_ENOMEM;
    snprintf(v, n, "Bearer %s", key);
    int rc = evhttp_add_header(evhttp_request_get_output_headers(r), "Authorization", v);
    free(v);
    return rc ? PD_ENOMEM : 0;
}

void pd_http_health(struct evhttp_request *h, void *arg)
{
    struct evbuffer *b = evbuffer_new();
    if (!b) {
        evhttp_send_error(h, 503, "out of memory");
        return;
    }
    evbuffer_add_printf(b, "ok\n");
    pd_http_text(h, "text/plain", b);
    evbuffer_free(b);
}

json_t *pd_http_json_counts(const int64_t *v, int rows, int cols)
{
    json_t *t = json_array();
    for (int r = 0; r < rows; r++) {
        json_t *row = json_array();
        for (int c = 0; c < cols; c++)
            json_array_append_new(row, json_integer(v[(size_t)r * cols + c]));
        json_array_append_new(t, row);
    }
    return t;
}

void pd_http_stream_start(struct evhttp_request *h, const char *content_type)
{
    struct evkeyvalq *out = evhttp_request_get_output_headers(h);
    evhttp_add_header(out, "Content-Type", content_type);
    evhttp_add_header(out, "Cache-Control", "no-cache");
    if (h->major == 1 && h->minor == 0) {
        /* libevent reads the client's "Connection: keep-alive" as a promise of a length, and
         * answers one: "Content-Length: 0" before the events. Without it libevent closes the
         * connection once the stream ends, as HTTP/1.0 delimits such an answer (RFC 1945 7.2.2) */
        struct evkeyvalq *in = evhttp_request_get_input_headers(h);
        while (evhttp_remove_header(in, "Connection") == 0)
            ;
        evhttp_add_header(out, "Connection", "close");
    }
    evhttp_send_reply_start(h, 200, "OK");
}

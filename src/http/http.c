/* HTTP helpers on libevent and jansson (see http.h). */
#include "http/http.h"

#include <arpa/inet.h>
#include <event2/buffer.h>
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
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    }
    return code >= 500 ? "Server Error" : "Error";
}

void pd_http_json(struct evhttp_request *h, int code, json_t *j)
{
    char *txt = json_dumps(j, JSON_COMPACT);
    struct evbuffer *b = evbuffer_new();
    evbuffer_add(b, txt, strlen(txt));
    evhttp_add_header(evhttp_request_get_output_headers(h), "Content-Type", "application/json");
    evhttp_send_reply(h, code, pd_http_reason(code), b);
    evbuffer_free(b);
    free(txt);
    json_decref(j);
}

void pd_http_error(struct evhttp_request *h, int code, const char *type, const char *param, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pd_http_json(h, code, json_pack("{s:{s:s,s:s,s:s?,s:n}}", "error", "message", msg, "type", type, "param", param, "code"));
}

void pd_http_text(struct evhttp_request *h, const char *content_type, struct evbuffer *b)
{
    evhttp_add_header(evhttp_request_get_output_headers(h), "Content-Type", content_type);
    evhttp_send_reply(h, 200, "OK", b);
}

void pd_http_health(struct evhttp_request *h, void *arg)
{
    struct evbuffer *b = evbuffer_new();
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

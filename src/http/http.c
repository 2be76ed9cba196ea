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
    char *txt = j ? json_dumps(j, JSON_COMPACT) : NULL;
    if (!txt) {
        code = 500;
        txt = strdup("{\"error\":{\"message\":\"the answer could not be built (out of memory)\",\"type\":\"server_error\","
                     "\"param\":null,\"code\":null}}");
    }
    struct evbuffer *b = evbuffer_new();
    evbuffer_add(b, txt ? txt : "", txt ? strlen(txt) : 0);
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
    /* a message quoting the client's bytes (a path, a value) may not be UTF-8, which JSON needs,
     * or may be cut inside a character */
    json_t *valid = json_string(msg);
    if (!valid)
        for (char *c = msg; *c; c++)
            if ((unsigned char)*c >= 0x80)
                *c = '?';
    json_decref(valid);
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

/* What a request's head may hold (see head.h). */
#include "http/head.h"

#include <event2/http_struct.h>
#include <event2/keyvalq_struct.h>
#include <event2/util.h>
#include <stdio.h>
#include <string.h>

static void field_bad(struct pd_http_field_scan *s, unsigned char b)
{
    if (s->bad)
        return;
    s->bad = b + 1;
    s->bad_line = s->line;
    s->bad_in_name = s->in_name;
    memcpy(s->bad_name, s->name, sizeof s->name);   /* a name goes on to its colon: see field_text */
}

/* One byte of a line's text (a CR not before LF included). */
static void field_text(struct pd_http_field_scan *s, unsigned char b, int line_start)
{
    if (s->line == 0) {   /* the request line: libevent reads its URI, a NUL would cut it */
        if (!b)
            field_bad(s, b);
        return;
    }
    if (line_start) {
        /* a line starting with SP or HTAB continues the previous value (obs-fold) */
        s->in_name = b != ' ' && b != '\t';
        if (s->in_name)
            s->name_len = 0;
    }
    if (s->in_name && b == ':') {
        s->in_name = 0;
        if (s->bad && s->bad_line == s->line && s->bad_in_name)
            memcpy(s->bad_name, s->name, sizeof s->name);
        return;
    }
    if (s->in_name && s->name_len < 40) {
        int room = (int)sizeof s->name - s->name_len;
        s->name_len += snprintf(s->name + s->name_len, (size_t)room, b > 0x20 && b < 0x7f ? "%c" : "\\x%02x", b);
        if (s->name_len >= 40)
            snprintf(s->name + 40, sizeof s->name - 40, "...");
    }
    if ((b < 0x20 && b != '\t') || b == 0x7f)
        field_bad(s, b);
}

void pd_http_field_byte(struct pd_http_field_scan *s, unsigned char b, int line_start)
{
    if (s->cr) {   /* a CR, then not LF: text */
        s->cr = 0;
        field_text(s, '\r', line_start);
        line_start = 0;
    }
    if (b == '\r')
        s->cr = 1;   /* a line end or not, as the next byte says */
    else
        field_text(s, b, line_start);
}

void pd_http_field_line_end(struct pd_http_field_scan *s)
{
    if (s->bad && s->bad_line == s->line && s->bad_in_name && s->in_name)
        memcpy(s->bad_name, s->name, sizeof s->name);   /* a line with no colon: its whole text */
    s->line++;
    s->cr = 0;
}

int pd_http_field_faulted(const struct pd_http_field_scan *s)
{
    return s->bad != 0;
}

const char *pd_http_field_fault(const struct pd_http_field_scan *s, char *msg, size_t cap)
{
    if (!pd_http_field_faulted(s))
        return NULL;
    int b = s->bad - 1;
    char what[64];
    if (!b)
        snprintf(what, sizeof what, "a NUL byte (0x00)");
    else if (b == '\r')
        snprintf(what, sizeof what, "a CR (0x0d) that does not end the line");
    else
        snprintf(what, sizeof what, "the control character 0x%02x", b);
    if (s->bad_line == 0)
        snprintf(msg, cap, "the request line holds %s", what);
    else
        snprintf(msg, cap, "header %s: its %s holds %s (RFC 9110 5.5: a field holds no control character but HTAB)",
                 s->bad_name, s->bad_in_name ? "name" : "value", what);
    return msg;
}

const char *pd_http_bad_framing(struct evhttp_request *h, int *code, char *msg, size_t cap)
{
    const char *cl = NULL;
    int host = 0;
    struct evkeyvalq *in = evhttp_request_get_input_headers(h);
    for (struct evkeyval *kv = in->tqh_first; kv; kv = kv->next.tqe_next) {
        *code = 400;
        /* a name is a token (RFC 9110 5.1): "Content-Length :" is no Content-Length to libevent, so
         * its body was read as the next request, where another hop takes it as this one's body
         * (RFC 9112 5.1: such a request MUST be refused) */
        if (!*kv->key || kv->key[strspn(kv->key, "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"
                                                 "ABCDEFGHIJKLMNOPQRSTUVWXYZ")]) {
            snprintf(msg, cap, "header \"%.40s\": its name holds a character a name cannot (a space before the colon?)",
                     kv->key);
            return msg;
        }
        /* (the connection's field_scan saw these first; a connection it could not track has none) */
        for (const unsigned char *v = (const unsigned char *)kv->value; *v; v++)
            if ((*v < 0x20 && *v != '\t') || *v == 0x7f) {
                snprintf(msg, cap, "header %.40s: its value holds the control character 0x%02x", kv->key, *v);
                return msg;
            }
        if (!evutil_ascii_strcasecmp(kv->key, "Host") && host++)   /* RFC 9112 3.2: MUST be refused */
            return "two Host headers: the request's target is ambiguous";
        if (!evutil_ascii_strcasecmp(kv->key, "Content-Length")) {
            if (cl && strcmp(cl, kv->value))
                return "two Content-Length headers that differ: the request's length is ambiguous";
            if (!*kv->value || kv->value[strspn(kv->value, "0123456789")])
                return "Content-Length: not a number of bytes (digits only)";
            cl = kv->value;
        } else if (!evutil_ascii_strcasecmp(kv->key, "Transfer-Encoding") && h->minor == 0) {
            /* HTTP/1.0 has no transfer codings: a hop of 1.0 reads the chunks as the next request
             * (RFC 9112 6.1: such framing MUST be taken as faulty); libevent decoded them */
            return "Transfer-Encoding in an HTTP/1.0 request (HTTP/1.0 has no chunked coding: send a Content-Length)";
        } else if (!evutil_ascii_strcasecmp(kv->key, "Transfer-Encoding") && evutil_ascii_strcasecmp(kv->value, "chunked")) {
            *code = 501;
            return "Transfer-Encoding: only chunked is understood";
        }
    }
    *code = 400;
    if (!host && h->major == 1 && h->minor == 1)   /* RFC 9112 3.2: MUST be refused */
        return "an HTTP/1.1 request without a Host header";
    return NULL;
}

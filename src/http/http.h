/* HTTP helpers shared by the servers (pd/) and the proxy (proxy/): JSON replies and OpenAI-style
 * error bodies {"error": {"message", "type", "param", "code"}}. Listening is http/front.h. */
#ifndef PD_HTTP_HTTP_H
#define PD_HTTP_HTTP_H

#include <event2/http.h>
#include <jansson.h>
#include <stdint.h>

#include "core/err.h"

const char *pd_http_reason(int code);
/* The JSON document in b (read in place, b unchanged) into *out: 0; PD_EFORMAT if it is not JSON
 * (*out NULL, je->text why, a message for the client that sent b; je may be NULL); PD_ENOMEM if memory for it ran out. */
int pd_http_read_json(struct evbuffer *b, size_t flags, json_t **out, json_error_t *je);
/* Sends j (compact) with the code; takes ownership of j. */
void pd_http_json(struct evhttp_request *h, int code, json_t *j);
/* The body of an OpenAI-style error, {"error": {"message", "type", "param", "code"}}, compact JSON
 * (malloc'ed; NULL if memory runs out); a message that is not UTF-8 has its high bytes as '?'. */
char *pd_http_error_body(const char *type, const char *param, const char *message);
/* OpenAI-style error; param may be NULL. */
void pd_http_error(struct evhttp_request *h, int code, const char *type, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* Whether h carries "Authorization: Bearer <key>" with the whole key (key NULL: every request
 * is); the scheme's name in any case, one or more spaces after it (RFC 9110 11.4). The comparison
 * takes the same time whatever the header holds, so a client cannot find the key a byte at a
 * time. It sends nothing (the caller answers 401 its own way); when it says no, it adds
 * "WWW-Authenticate: Bearer" to h's answer headers, which a 401 must carry (RFC 9110 11.6.1). */
int pd_http_authorised(struct evhttp_request *h, const char *key);
/* Adds "Authorization: Bearer <key>" to an outgoing request's headers (key NULL: nothing);
 * PD_ENOMEM if it cannot. */
int pd_http_add_key(struct evhttp_request *r, const char *key);
/* The /health handler: 200 "ok" while the loop runs. */
void pd_http_health(struct evhttp_request *h, void *arg);
/* A [rows][cols] table of counts as an array of arrays (the tokens_per_expert of /expert_stats). */
json_t *pd_http_json_counts(const int64_t *v, int rows, int cols);
/* evhttp_send_reply, except that the answer to HEAD is the headers alone, with the Content-Length
 * of b (whose bytes it drains). */
void pd_http_send(struct evhttp_request *h, int code, const char *reason, struct evbuffer *b);
/* Starts a streamed 200 (its chunks then go with evhttp_send_reply_chunk) with the content type and
 * Cache-Control: no-cache. To an HTTP/1.0 client, which has no chunked coding, the stream ends with
 * the connection: its answer says "Connection: close" whatever keep-alive the client asked for. */
void pd_http_stream_start(struct evhttp_request *h, const char *content_type);
/* Sends b (whose bytes it drains) as a 200 with the content type. */
void pd_http_text(struct evhttp_request *h, const char *content_type, struct evbuffer *b);

#endif

/* What a request's head may hold, checked beyond libevent's parser (for http/front.c): the bytes
 * no header field may hold, seen as they arrive; and framing a request could be smuggled through. */
#ifndef PD_HTTP_HEAD_H
#define PD_HTTP_HEAD_H

#include <event2/http.h>
#include <stddef.h>

/* The head's first byte no field may hold (RFC 9110 5.5: NUL, CR, LF or another control character
 * but HTAB, in a name or a value; in the request line a NUL). libevent reads each line as a C
 * string, so a NUL cut it short unseen ("Connection: clo\0se" was read as "clo"): the bytes are
 * watched as they arrive, line by line. */
struct pd_http_field_scan {
    int line;                   /* lines ended so far in this head (0: in the request line) */
    int in_name;                /* the line's bytes so far are its name (no colon yet) */
    int cr;                     /* the last byte was a CR (a line end if LF follows) */
    char name[48];              /* the line's header name so far, control bytes as \xNN, cut at 40 */
    int name_len;
    int bad;                    /* 0: none seen; else the byte + 1 */
    int bad_line, bad_in_name;
    char bad_name[48];          /* the header it was in */
};

/* One byte of a head but its line ends (LF, or the CR of CR LF, as evhttp takes them); line_start:
 * the byte before it ended a line. Zero the scan before a head's first byte. */
void pd_http_field_byte(struct pd_http_field_scan *s, unsigned char b, int line_start);
/* A line of the head ended (its LF). */
void pd_http_field_line_end(struct pd_http_field_scan *s);
/* Whether the head holds a byte no field may hold (what pd_http_field_fault would name). */
int pd_http_field_faulted(const struct pd_http_field_scan *s);
/* The 400's message for the head's first bad byte (in msg, naming the header and the byte), or
 * NULL when there is none. */
const char *pd_http_field_fault(const struct pd_http_field_scan *s, char *msg, size_t cap);

/* Framing that another hop could read otherwise than libevent does, which a request could be
 * smuggled through (RFC 9112 6.3): Content-Length headers that differ (libevent reads the first),
 * a transfer coding besides chunked or any in HTTP/1.0; and two Host headers, a target two hops
 * could read apart.
 * NULL when the framing is sound, else the error (in msg, cap bytes, or a constant) and its status
 * in *code. */
const char *pd_http_bad_framing(struct evhttp_request *h, int *code, char *msg, size_t cap);

#endif

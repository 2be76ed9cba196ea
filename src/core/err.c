/* Error codes and the message buffer that carries them to the edge (cli/). */
#include "core/err.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int pd_err_set(pd_err *e, int code, const char *fmt, ...)
{
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->msg, sizeof e->msg, fmt, ap);
        va_end(ap);
        e->code = code;
    }
    return code;
}

int pd_err_prefix(pd_err *e, const char *fmt, ...)
{
    if (!e)
        return PD_EINVAL;
    char head[256], old[sizeof e->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(head, sizeof head, fmt, ap);
    va_end(ap);
    memcpy(old, e->msg, sizeof old);
    size_t n = strlen(head);
    memcpy(e->msg, head, n);
    /* keep the message NUL-terminated when head + old exceed the buffer */
    size_t room = sizeof e->msg - n - 1;
    size_t k = strnlen(old, room);
    memcpy(e->msg + n, old, k);
    e->msg[n + k] = 0;
    return e->code;
}

const char *pd_err_name(int code)
{
    switch (code) {
    case PD_OK: return "ok";
    case PD_EINVAL: return "invalid input";
    case PD_EIO: return "i/o error";
    case PD_EFORMAT: return "malformed file";
    case PD_ENOMEM: return "out of memory";
    case PD_ENOFIT: return "does not fit";
    case PD_ERANGE: return "out of range";
    case PD_ECANCELED: return "cancelled";
    }
    return "unknown error";
}

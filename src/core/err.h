/* Errors: library functions return 0 or a negative PD_E* code and fill a caller-supplied
 * pd_err with one line naming the file, field or request at fault. Only cli/ prints. */
#ifndef PD_CORE_ERR_H
#define PD_CORE_ERR_H

#include <stddef.h>

enum {
    PD_OK = 0,
    PD_EINVAL = -1,   /* bad input: a field, a flag, a value out of range */
    PD_EIO = -2,      /* a file could not be opened, read or mapped */
    PD_EFORMAT = -3,  /* a file is malformed (JSON, safetensors header) */
    PD_ENOMEM = -4,   /* allocation failed */
    PD_ENOFIT = -5,   /* a layout does not fit the hardware */
    PD_ERANGE = -6,   /* a size or count out of what the format allows */
    PD_ECANCELED = -7, /* work stopped because nobody wants its result any more (its client left) */
};

typedef struct pd_err {
    int code;
    char msg[512];
} pd_err;

/* Sets e->code and e->msg (printf-style); returns code so callers can `return pd_err_set(...)`. */
int pd_err_set(pd_err *e, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Prefixes the existing message with more context ("file: " + old message). */
int pd_err_prefix(pd_err *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

const char *pd_err_name(int code);

#endif

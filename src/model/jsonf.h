/* Typed field access on jansson objects with errors that name the file and the field.
 * Every getter returns 0 or PD_EINVAL/PD_EFORMAT with e.g.
 *   "models/x.json: field \"hidden_size\": expected an integer >= 1, got \"4096\"". */
#ifndef PD_MODEL_JSONF_H
#define PD_MODEL_JSONF_H

#include <jansson.h>
#include <stdint.h>

#include "core/err.h"

struct pd_jsrc {
    const char *file;     /* for messages */
    const char *prefix;   /* "" or "rope_scaling." for nested objects */
};

/* Loads a JSON object from a file (a regular file: core/file.h), or from an in-memory string
 * (label names it). */
json_t *pd_json_load_file(const char *path, pd_err *e);
json_t *pd_json_load_str(const char *text, const char *label, pd_err *e);

/* Missing required field -> error; missing optional field -> *out = dflt. */
int pd_json_int(const struct pd_jsrc *s, json_t *o, const char *key, int required,
                int64_t dflt, int64_t min, int64_t max, int64_t *out, pd_err *e);
int pd_json_i32(const struct pd_jsrc *s, json_t *o, const char *key, int required,
                int dflt, int min, int max, int *out, pd_err *e);
int pd_json_num(const struct pd_jsrc *s, json_t *o, const char *key, int required,
                double dflt, double min, double max, double *out, pd_err *e);
int pd_json_bool(const struct pd_jsrc *s, json_t *o, const char *key, int required,
                 int dflt, int *out, pd_err *e);
/* Copies a string field (truncation is an error). */
int pd_json_str(const struct pd_jsrc *s, json_t *o, const char *key, int required,
                const char *dflt, char *out, size_t n, pd_err *e);

/* Every key of object o is one of keys (NULL-ended): else an error naming the first other one. */
int pd_json_known(const struct pd_jsrc *s, json_t *o, const char *const *keys, pd_err *e);

#endif

/* Typed JSON field access with one-line errors naming file and field. */
#include "core/text.h"
#include "model/jsonf.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/file.h"

/* The largest JSON file loaded (a tokenizer.json is about 8 MB, a release's index 2 MB). */
#define JSON_FILE_MAX ((size_t)1 << 30)

/* jansson quotes the text near a syntax error as it is: control characters become spaces so
 * that every loader's message stays one line. */
static void one_line(pd_err *e)
{
    for (char *c = e ? e->msg : NULL; c && *c; c++)
        if ((unsigned char)*c < 0x20 || *c == 0x7F)
            *c = ' ';
}

json_t *pd_json_load_file(const char *path, pd_err *e)
{
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {   /* (jansson would say "invalid argument") */
        pd_err_set(e, PD_EIO, "%s: is a directory, not a JSON file", path);
        return NULL;
    }
    size_t len;
    char *text = pd_file_read(path, JSON_FILE_MAX, &len, e);
    if (!text)
        return NULL;
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    free(text);
    if (!root) {
        pd_err_set(e, PD_EFORMAT, "%s:%d:%d: %s", path, je.line, je.column, je.text);
        one_line(e);
        return NULL;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        pd_err_set(e, PD_EFORMAT, "%s: expected a JSON object at the top level", path);
        return NULL;
    }
    return root;
}

json_t *pd_json_load_str(const char *text, const char *label, pd_err *e)
{
    json_error_t je;
    json_t *root = json_loads(text, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        pd_err_set(e, PD_EFORMAT, "%s:%d:%d: %s", label, je.line, je.column, je.text);
        one_line(e);
        return NULL;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        pd_err_set(e, PD_EFORMAT, "%s: expected a JSON object at the top level", label);
        return NULL;
    }
    return root;
}

static const char *kind(json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE: case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "?";
}

static json_t *field(const struct pd_jsrc *s, json_t *o, const char *key, int required,
                     int *rc, pd_err *e)
{
    json_t *v = json_object_get(o, key);
    *rc = 0;
    if (!v || json_is_null(v)) {
        if (required)
            *rc = pd_err_set(e, PD_EINVAL, "%s: missing required field \"%s%s\"", s->file,
                             s->prefix, key);
        return NULL;
    }
    return v;
}

int pd_json_int(const struct pd_jsrc *s, json_t *o, const char *key, int required,
                int64_t dflt, int64_t min, int64_t max, int64_t *out, pd_err *e)
{
    int rc;
    json_t *v = field(s, o, key, required, &rc, e);
    if (!v) {
        if (rc == 0)
            *out = dflt;
        return rc;
    }
    int64_t x;
    if (json_is_integer(v)) {
        x = json_integer_value(v);
    } else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
               fabs(json_real_value(v)) < 9e15) {
        x = (int64_t)json_real_value(v);
    } else {
        return pd_err_set(e, PD_EINVAL, "%s: field \"%s%s\": expected an integer, got %s",
                          s->file, s->prefix, key, kind(v));
    }
    if (x < min || x > max)
        return pd_err_set(e, PD_EINVAL,
                          "%s: field \"%s%s\": %" PRId64 " is out of range [%" PRId64 ", %" PRId64 "]",
                          s->file, s->prefix, key, x, min, max);
    *out = x;
    return 0;
}

int pd_json_i32(const struct pd_jsrc *s, json_t *o, const char *key, int required,
                int dflt, int min, int max, int *out, pd_err *e)
{
    int64_t x;
    int rc = pd_json_int(s, o, key, required, dflt, min, max, &x, e);
    if (rc == 0)
        *out = (int)x;
    return rc;
}

int pd_json_num(const struct pd_jsrc *s, json_t *o, const char *key, int required,
                double dflt, double min, double max, double *out, pd_err *e)
{
    int rc;
    json_t *v = field(s, o, key, required, &rc, e);
    if (!v) {
        if (rc == 0)
            *out = dflt;
        return rc;
    }
    if (!json_is_number(v))
        return pd_err_set(e, PD_EINVAL, "%s: field \"%s%s\": expected a number, got %s",
                          s->file, s->prefix, key, kind(v));
    double x = json_number_value(v);
    if (!(x >= min && x <= max))
        return pd_err_set(e, PD_EINVAL, "%s: field \"%s%s\": %g is out of range [%g, %g]",
                          s->file, s->prefix, key, x, min, max);
    *out = x;
    return 0;
}

int pd_json_bool(const struct pd_jsrc *s, json_t *o, const char *key, int required,
                 int dflt, int *out, pd_err *e)
{
    int rc;
    json_t *v = field(s, o, key, required, &rc, e);
    if (!v) {
        if (rc == 0)
            *out = dflt;
        return rc;
    }
    if (!json_is_boolean(v))
        return pd_err_set(e, PD_EINVAL, "%s: field \"%s%s\": expected true or false, got %s",
                          s->file, s->prefix, key, kind(v));
    *out = json_is_true(v);
    return 0;
}

int pd_json_str(const struct pd_jsrc *s, json_t *o, const char *key, int required,
                const char *dflt, char *out, size_t n, pd_err *e)
{
    int rc;
    json_t *v = field(s, o, key, required, &rc, e);
    const char *str = dflt;
    if (v) {
        if (!json_is_string(v))
            return pd_err_set(e, PD_EINVAL, "%s: field \"%s%s\": expected a string, got %s",
                              s->file, s->prefix, key, kind(v));
        str = json_string_value(v);
    } else if (rc) {
        return rc;
    }
    if (!str)
        str = "";
    if (strlen(str) >= n)
        return pd_err_set(e, PD_EINVAL, "%s: field \"%s%s\": string longer than %zu bytes",
                          s->file, s->prefix, key, n - 1);
    /* a name goes to terminals, reports and scripts: an ESC sequence in a hardware file's name
     * once drove the terminal of whoever ran plan with it */
    long bad = pd_text_bad_at(str);
    if (bad >= 0)
        return pd_err_set(e, PD_EINVAL, "%s: field \"%s%s\": a control character (or a bidirectional override) "
                          "at byte %ld", s->file, s->prefix, key, bad);
    memcpy(out, str, strlen(str) + 1);
    return 0;
}

int pd_json_known(const struct pd_jsrc *s, json_t *o, const char *const *keys, pd_err *e)
{
    const char *key;
    json_t *v;
    if (!json_is_object(o))
        return 0;
    json_object_foreach(o, key, v) {
        const char *const *k = keys;
        while (*k && strcmp(*k, key))
            k++;
        char safe[128];   /* (a key may hold a newline or an ESC: the message is one line of text) */
        if (!*k)
            return pd_err_set(e, PD_EINVAL, "%s: field \"%s%s\": unknown (a misspelt field would be left at its "
                              "default)", s->file, s->prefix, pd_text_safe(safe, sizeof safe, key));
    }
    return 0;
}

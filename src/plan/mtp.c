/* Speculative decoding's yield and measured acceptance (mtp.h). */
#include "plan/mtp.h"
#include "core/file.h"

#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A round drafts k tokens and verifies them with the main model in one step. Draft j is
 * accepted with probability a_j once drafts 1 .. j-1 were, and the first rejection ends the round;
 * the verify step always yields one token of its own (the correction at the first rejection, or
 * the token after the last draft when all are accepted). So draft j counts with probability
 * prod_{i<=j} a_i and
 *   tokens_per_step = 1 + sum_{j=1..k} prod_{i=1..j} a_i
 * (k = 1: 1 + a_1; k = 0: 1). */
double pd_mtp_tokens_per_step(const struct pd_mtp *m)
{
    double t = 1, run = 1;
    for (int j = 0; j < m->k; j++) {
        run *= m->a[j];
        t += run;
    }
    return t;
}

int pd_mtp_parse_list(const char *flag, const char *list, struct pd_mtp *m, pd_err *e)
{
    memset(m, 0, sizeof *m);
    const char *s = list;
    for (;;) {
        if (m->k == PD_MTP_MAX_K)
            return pd_err_set(e, PD_EINVAL, "%s %s: at most %d rates (one per draft position)", flag, list, PD_MTP_MAX_K);
        char *end;
        errno = 0;
        double v = strtod(s, &end);
        if (end == s || errno || !(v >= 0 && v <= 1) || (*end && *end != ','))
            return pd_err_set(e, PD_EINVAL, "%s %s: expected rates in [0, 1] separated by commas (a1[,a2,...], the "
                              "acceptance of each draft position given the ones before it)", flag, list);
        m->a[m->k++] = v;
        if (!*end)
            return 0;
        s = end + 1;
    }
}

/* Per-position counts: den[j] rounds that drafted position j (or every drafted round), acc[j]
 * of them whose drafts 1 .. j + 1 were all accepted; k positions. Checks and converts. */
static int from_counts(const char *label, int k, const double *den, const double *acc, struct pd_mtp *m, pd_err *e)
{
    memset(m, 0, sizeof *m);
    if (k < 1)
        return pd_err_set(e, PD_EINVAL, "%s: no per-position acceptance counts (num_accepted_tokens_per_pos)", label);
    double prev = 1;
    for (int j = 0; j < k; j++) {
        if (!(den[j] > 0))
            return pd_err_set(e, PD_EINVAL, "%s: no round drafted position %d (num_drafts, or its "
                              "num_drafted_tokens_per_pos, is 0): nothing was measured", label, j);
        if (!(acc[j] >= 0) || acc[j] > den[j])
            return pd_err_set(e, PD_EINVAL, "%s: num_accepted_tokens_per_pos[%d] = %g is not within [0, %g] drafted "
                              "rounds", label, j, acc[j], den[j]);
        if (j > 0 && acc[j] > acc[j - 1])
            return pd_err_set(e, PD_EINVAL, "%s: num_accepted_tokens_per_pos[%d] = %g exceeds position %d's %g (a draft "
                              "counts only when the ones before it were accepted)", label, j, acc[j], j - 1, acc[j - 1]);
        double u = acc[j] / den[j];          /* P(drafts 1 .. j + 1 all accepted) */
        m->a[j] = prev > 0 ? fmin(1, u / prev) : 0;
        prev = u;
    }
    m->k = k;
    return 0;
}

static int count_array(const char *label, json_t *root, const char *key, int k, double *out, pd_err *e)
{
    json_t *a = json_object_get(root, key);
    if (!json_is_array(a) || (int)json_array_size(a) != k)
        return pd_err_set(e, PD_EINVAL, "%s: field \"%s\" must be an array of %d counts (num_speculative_tokens)", label,
                          key, k);
    for (int j = 0; j < k; j++) {
        json_t *v = json_array_get(a, (size_t)j);
        if (!json_is_integer(v) || json_integer_value(v) < 0)
            return pd_err_set(e, PD_EINVAL, "%s: field \"%s[%d]\" must be a count (an integer >= 0)", label, key, j);
        out[j] = (double)json_integer_value(v);
    }
    return 0;
}

static int parse_json(const char *text, const char *label, struct pd_mtp *m, pd_err *e)
{
    json_error_t je;
    json_t *root = json_loads(text, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return pd_err_set(e, PD_EINVAL, "%s: not valid JSON (line %d: %s)", label, je.line, je.text);
    int rc = 0;
    double den[PD_MTP_MAX_K], acc[PD_MTP_MAX_K];
    json_t *kv = json_object_get(root, "num_speculative_tokens"), *nd = json_object_get(root, "num_drafts");
    if (!json_is_object(root)) {
        rc = pd_err_set(e, PD_EINVAL, "%s: expected a JSON object (pdmoe generate --spec-stats FILE)", label);
    } else if (!json_is_integer(kv) || json_integer_value(kv) < 1 || json_integer_value(kv) > PD_MTP_MAX_K) {
        rc = pd_err_set(e, PD_EINVAL, "%s: field \"num_speculative_tokens\" must be an integer in [1, %d]", label,
                        PD_MTP_MAX_K);
    } else if (!json_is_integer(nd) || json_integer_value(nd) < 0) {
        rc = pd_err_set(e, PD_EINVAL, "%s: field \"num_drafts\" must be a count (an integer >= 0)", label);
    } else {
        int k = (int)json_integer_value(kv);
        if (!(rc = count_array(label, root, "num_accepted_tokens_per_pos", k, acc, e))) {
            if (json_object_get(root, "num_drafted_tokens_per_pos"))
                rc = count_array(label, root, "num_drafted_tokens_per_pos", k, den, e);
            else
                for (int j = 0; j < k; j++)
                    den[j] = (double)json_integer_value(nd);
        }
        if (!rc)
            rc = from_counts(label, k, den, acc, m, e);
    }
    json_decref(root);
    return rc;
}

/* The value of a Prometheus sample line "name{labels} value", 0 if it is not one of `name`; the
 * labels' `position` in *pos (-1 when absent). */
static int sample(const char *line, const char *name, int *pos, double *v)
{
    size_t n = strlen(name);
    if (strncmp(line, name, n) || (line[n] != '{' && line[n] != ' '))
        return 0;
    const char *p = line + n;
    *pos = -1;
    if (*p == '{') {
        const char *close = strchr(p, '}');
        if (!close)
            return -1;
        const char *q = strstr(p, "position=\"");
        if (q && q < close) {   /* digits and the closing quote only ("4294967296" wrapped to 0 in atoi) */
            char *qe;
            errno = 0;
            long x = strtol(q + 10, &qe, 10);
            *pos = errno || qe == q + 10 || *qe != '"' || x < 0 || x > INT_MAX ? -1 : (int)x;
        }
        p = close + 1;
    }
    char *end;
    *v = strtod(p, &end);
    /* a count is finite: +Inf, NaN, or a sum past the largest double made an acceptance of 0 or 1 */
    return end == p || !isfinite(*v) ? -1 : 1;
}

static int parse_metrics(const char *text, const char *label, struct pd_mtp *m, pd_err *e)
{
    static const char *const drafts[] = {"pdmoe_spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts_total"};
    static const char *const per_pos[] = {"pdmoe_spec_decode_num_accepted_tokens_per_pos_total",
                                          "vllm:spec_decode_num_accepted_tokens_per_pos_total"};
    double nd = 0, acc[PD_MTP_MAX_K] = {0}, den[PD_MTP_MAX_K];
    int have_drafts = 0, k = 0, line_no = 0;
    for (const char *l = text; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
        line_no++;
        if (*l == '#' || *l == '\n')
            continue;
        for (int s = 0; s < 2; s++) {
            int pos, r;
            double v;
            if ((r = sample(l, drafts[s], &pos, &v))) {
                if (r < 0 || !(v >= 0))
                    return pd_err_set(e, PD_EINVAL, "%s: line %d: %s: expected a count", label, line_no, drafts[s]);
                nd += v;          /* summed over label sets (several engines) */
                if (!isfinite(nd))
                    return pd_err_set(e, PD_EINVAL, "%s: line %d: %s: the counts add up past any count", label,
                                      line_no, drafts[s]);
                have_drafts = 1;
            } else if ((r = sample(l, per_pos[s], &pos, &v))) {
                if (r < 0 || !(v >= 0) || pos < 0 || pos >= PD_MTP_MAX_K)
                    return pd_err_set(e, PD_EINVAL, "%s: line %d: %s: expected a count with a position label in "
                                      "[0, %d)", label, line_no, per_pos[s], PD_MTP_MAX_K);
                acc[pos] += v;
                if (!isfinite(acc[pos]))
                    return pd_err_set(e, PD_EINVAL, "%s: line %d: %s: the counts add up past any count", label,
                                      line_no, per_pos[s]);
                if (pos + 1 > k)
                    k = pos + 1;
            }
        }
    }
    if (!have_drafts)
        return pd_err_set(e, PD_EINVAL, "%s: no %s (or %s) counter: not a /metrics scrape of a server running "
                          "--speculative-config", label, drafts[0], drafts[1]);
    for (int j = 0; j < k; j++)
        den[j] = nd;
    return from_counts(label, k, den, acc, m, e);
}

int pd_mtp_stats_parse(const char *text, const char *label, struct pd_mtp *m, pd_err *e)
{
    const char *p = text;
    while (isspace((unsigned char)*p))
        p++;
    return *p == '{' ? parse_json(text, label, m, e) : parse_metrics(text, label, m, e);
}

int pd_mtp_stats_load(const char *path, struct pd_mtp *m, pd_err *e)
{
    char *buf = pd_file_read(path, 16 << 20, NULL, e);   /* (a FIFO is named, never waited on) */
    if (!buf)
        return e && e->code ? e->code : PD_EIO;
    int rc = pd_mtp_stats_parse(buf, path, m, e);
    free(buf);
    return rc;
}

/* libFuzzer harness for the Split regex matcher: the input is a pattern, a NUL byte, then a
 * subject (any bytes, decoded as the tokenizer decodes text). A pattern is either refused with
 * one line naming the file and field, or compiles; then walking its matches as a Split does
 * gives matches inside the subject, in order, each found at or after where the walk stood, or
 * stops with a limit error naming the file, field and limit. Built by `make fuzz`; seeds in
 * tests/fuzz/seeds/regex/. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/fuzz.h"
#include "model/regex.h"
#include "model/unicode.h"

static const char prefix[] = "fuzz.json: field \"pattern\": ";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nul = memchr(data, 0, size);
    size_t plen = nul ? (size_t)(nul - data) : size;
    const uint8_t *subj = nul ? nul + 1 : data + size;
    size_t slen = nul ? size - plen - 1 : 0;

    pd_err e = {0};
    struct pd_rx *rx = pd_rx_compile((const char *)data, plen, "fuzz.json", "pattern", &e);
    if (!rx) {
        CHECK(e.code == PD_EFORMAT || e.code == PD_ENOMEM || e.code == PD_EIO);
        CHECK(strncmp(e.msg, "fuzz.json", 9) == 0 && !strchr(e.msg, '\n'));
        return 0;
    }
    uint32_t *cp = malloc((slen + 1) * sizeof *cp);
    CHECK(cp);
    size_t n = 0;
    for (size_t i = 0; i < slen; n++)
        i += pd_uc_utf8_dec(subj + i, slen - i, &cp[n]);
    struct pd_rx_scratch *s = NULL;
    size_t from = 0, last_end = 0;
    while (from < n) {
        size_t ms = (size_t)-1, me = (size_t)-1;
        int rc = pd_rx_find(rx, &s, cp, 0, n, from, &ms, &me, &e);
        if (rc < 0) {
            CHECK(rc == PD_EINVAL || rc == PD_ENOMEM);
            CHECK(e.code == rc && strncmp(e.msg, prefix, sizeof prefix - 1) == 0);
            CHECK(rc == PD_ENOMEM || strstr(e.msg, " limit (") != NULL);
            break;
        }
        if (!rc)
            break;
        CHECK(rc == 1 && ms >= from && ms < n && me >= ms && me <= n && ms >= last_end);
        last_end = me;
        from = me > ms ? me : ms + 1;
    }
    /* a window inside the subject: the walk stays inside it */
    if (n >= 2) {
        size_t ms, me;
        int rc = pd_rx_find(rx, &s, cp, 1, n - 1, 1, &ms, &me, &e);
        CHECK(rc <= 0 || (ms >= 1 && ms < n - 1 && me >= ms && me <= n - 1));
    }
    pd_rx_scratch_free(s);
    pd_rx_free(rx);
    free(cp);
    return 0;
}

/* Unicode classes for the tokenizer: general categories and White_Space of code points and
 * simple case mapping, looked up in the generated tables of unicode_tables.h (Unicode 16.0.0),
 * and UTF-8 decoding that maps invalid bytes to code points of their own. The contract is
 * unicode.h. */
#include "model/unicode.h"

#include <string.h>

struct uc_run {
    uint32_t start;
    uint16_t feat;
};

struct uc_gain {
    uint32_t lo, hi;
    uint16_t bits;
};

struct uc_map {
    uint32_t cp, to;
};

#include "model/unicode_tables.h"

#define UC_NRUNS (sizeof uc_runs / sizeof *uc_runs)

int pd_uc_run(size_t i, uint32_t *start, uint16_t *feat)
{
    if (i >= UC_NRUNS)
        return 0;
    *start = uc_runs[i].start;
    *feat = uc_runs[i].feat;
    return 1;
}

int pd_uc_gain(size_t i, uint32_t *lo, uint32_t *hi, uint16_t *bits)
{
    if (i >= sizeof uc_since / sizeof *uc_since)
        return 0;
    *lo = uc_since[i].lo;
    *hi = uc_since[i].hi;
    *bits = uc_since[i].bits;
    return 1;
}

const char *pd_uc_gain_base(void)
{
    return PD_UC_SINCE_VERSION;
}

uint16_t pd_uc_feat(uint32_t cp)
{
    if (cp >= PD_UC_BADCP)
        return 0;
    /* the last run starting at or before cp */
    size_t lo = 0, hi = UC_NRUNS;
    while (hi - lo > 1) {
        size_t mid = (lo + hi) / 2;
        if (uc_runs[mid].start <= cp)
            lo = mid;
        else
            hi = mid;
    }
    return uc_runs[lo].feat;
}

static uint32_t uc_map_find(const struct uc_map *m, size_t n, uint32_t cp)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (m[mid].cp < cp)
            lo = mid + 1;
        else if (m[mid].cp > cp)
            hi = mid;
        else
            return m[mid].to;
    }
    return cp;
}

uint32_t pd_uc_lower(uint32_t cp)
{
    return uc_map_find(uc_lower, sizeof uc_lower / sizeof *uc_lower, cp);
}

uint32_t pd_uc_upper(uint32_t cp)
{
    return uc_map_find(uc_upper, sizeof uc_upper / sizeof *uc_upper, cp);
}

/* Decodes the code point at s[0..n), n >= 1; returns its length in bytes. Overlong forms,
 * surrogates, values above U+10FFFF and truncated sequences decode as one invalid byte. */
size_t pd_uc_utf8_dec(const uint8_t *s, size_t n, uint32_t *cp)
{
    uint8_t b = s[0];
    if (b < 0x80) {
        *cp = b;
        return 1;
    }
    size_t len;
    uint32_t c, min;
    if (b >= 0xC2 && b <= 0xDF) {
        len = 2, c = b & 0x1F, min = 0x80;
    } else if (b >= 0xE0 && b <= 0xEF) {
        len = 3, c = b & 0x0F, min = 0x800;
    } else if (b >= 0xF0 && b <= 0xF4) {
        len = 4, c = b & 0x07, min = 0x10000;
    } else {
        *cp = PD_UC_BADCP + b;
        return 1;
    }
    if (n < len) {
        *cp = PD_UC_BADCP + b;
        return 1;
    }
    for (size_t j = 1; j < len; j++) {
        if ((s[j] & 0xC0) != 0x80) {
            *cp = PD_UC_BADCP + b;
            return 1;
        }
        c = (c << 6) | (s[j] & 0x3F);
    }
    if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) {
        *cp = PD_UC_BADCP + b;
        return 1;
    }
    *cp = c;
    return len;
}

size_t pd_uc_utf8_enc(uint32_t cp, char *out)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

size_t pd_utf8_lossy(const unsigned char *t, size_t len, int final, char *out, size_t *used)
{
    size_t i = 0, o = 0;
    while (i < len) {
        const unsigned c = t[i];
        const size_t need = c < 0x80 ? 1 : c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3
                          : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
        /* the second byte's range (Unicode's table 3-7): no overlong forms, surrogates or code
         * points past U+10FFFF */
        const unsigned lo = c == 0xe0 ? 0xa0 : c == 0xf0 ? 0x90 : 0x80, hi = c == 0xed ? 0x9f : c == 0xf4 ? 0x8f : 0xbf;
        size_t k = 1;   /* the sequence's bytes valid so far */
        while (need > 1 && k < need && i + k < len &&
               (k == 1 ? t[i + 1] >= lo && t[i + 1] <= hi : (t[i + k] & 0xc0) == 0x80))
            k++;
        if (need > 1 && k < need && i + k == len && !final)
            break;   /* incomplete: the next token may complete it */
        const int ok = need > 0 && k == need;
        if (out)
            memcpy(out + o, ok ? (const char *)t + i : "\xef\xbf\xbd", ok ? need : 3);
        o += ok ? need : 3;
        i += k;
    }
    *used = i;
    return o;
}


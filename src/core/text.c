#include "core/text.h"

#include <string.h>

/* The length of the UTF-8 character at s (1-4), or 0 if the bytes there are not one; *cp its
 * code point. */
static size_t utf8_char(const unsigned char *s, unsigned *cp)
{
    unsigned c = s[0];
    size_t n = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (!n)
        return 0;
    unsigned v = n == 1 ? c : c & (0x7F >> n);
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        v = v << 6 | (s[i] & 0x3F);
    }
    /* overlong forms, surrogates and code points past U+10FFFF are not UTF-8 */
    static const unsigned min[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < min[n] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
        return 0;
    *cp = v;
    return n;
}

static int unsafe(unsigned cp)
{
    return cp < 0x20 || cp == 0x7F || (cp >= 0x80 && cp <= 0x9F) || (cp >= 0x202A && cp <= 0x202E) ||
           (cp >= 0x2066 && cp <= 0x2069);
}

char *pd_text_safe(char *dst, size_t cap, const char *src)
{
    if (!cap)
        return dst;
    size_t o = 0;
    const unsigned char *s = (const unsigned char *)src;
    while (*s) {
        unsigned cp = 0;
        size_t n = utf8_char(s, &cp);
        if (!n || unsafe(cp)) {
            if (o + 1 >= cap)
                break;
            dst[o++] = '?';
            s += n ? n : 1;
            continue;
        }
        if (o + n >= cap)
            break;
        memcpy(dst + o, s, n);
        o += n;
        s += n;
    }
    dst[o] = 0;
    return dst;
}

long pd_text_bad_at(const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        unsigned cp = 0;
        size_t n = utf8_char(p, &cp);
        if (!n || unsafe(cp))
            return (long)(p - (const unsigned char *)s);
        p += n;
    }
    return -1;
}

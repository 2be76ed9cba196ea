/* Unicode classes for the tokenizer: the general category, White_Space and word-character bits
 * of a code point, simple case mapping, and UTF-8 decoding in which an invalid byte is a code
 * point of its own. The tokenizer's word tests (added tokens' single_word, lstrip, rstrip) and
 * the reference regex matcher use them; the Split matcher itself uses PCRE2's tables (regex.h
 * says where the two differ).
 *
 * Unicode categories (Unicode 14, as glibc 2.36): exact for U+0000-U+00FF (a table), for \p{N}
 * (a table of the 130 number ranges above U+00FF), for White_Space (\s: 25 code points), for
 * format and private-use characters (category C) and for the 130 circled/squared letters
 * (category S). Above U+00FF the rest comes from glibc's C.UTF-8 wide-character classes through
 * a private locale_t (the global locale is untouched): "combining" -> M (equal to Unicode's M),
 * iswalpha -> L, iswpunct -> S. So above U+00FF, \p{P} and \p{S} are not told apart:
 * punctuation there reports as S. The patterns these tokenizers use only ever name
 * [\p{P}\p{S}] together, which is then exact (checked against Python's `regex` module on random
 * code points from all planes: no difference for the GPT-2, cl100k, Qwen2 and DeepSeek-V3
 * patterns). \p{Lu}/\p{Ll} are iswupper/iswlower; \d is \p{N} (Oniguruma's is Nd only); \w is
 * L, M, N and the Pc characters. Unassigned code points are C.
 * Case-insensitive matching compares towlower and towupper (simple case folding). */
#ifndef PD_MODEL_UNICODE_H
#define PD_MODEL_UNICODE_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"

/* An invalid UTF-8 byte b decodes to PD_UC_BADCP + b: a code point of its own in no category, so
 * the text still splits and round-trips byte for byte. */
#define PD_UC_BADCP 0x110000u

/* What pd_uc_feat reports: general categories, then \s, \w, and the letter cases. */
enum {
    PD_UC_L = 1 << 0, PD_UC_M = 1 << 1, PD_UC_N = 1 << 2, PD_UC_P = 1 << 3, PD_UC_S = 1 << 4,
    PD_UC_Z = 1 << 5, PD_UC_C = 1 << 6, PD_UC_SPACE = 1 << 7, PD_UC_WORD = 1 << 8,
    PD_UC_LU = 1 << 9, PD_UC_LL = 1 << 10,
};

/* Loads the classes once (thread-safe); PD_EIO naming label if the C.UTF-8 locale is missing.
 * The other functions may be called only after it succeeded. */
int pd_uc_init(const char *label, pd_err *e);
/* PD_UC_* bits of cp; 0 for the invalid-byte code points. */
uint16_t pd_uc_feat(uint32_t cp);
/* Simple lower and upper case of cp (cp itself if it has none, or is an invalid byte). */
uint32_t pd_uc_lower(uint32_t cp);
uint32_t pd_uc_upper(uint32_t cp);

/* Decodes the code point at s[0..n), n >= 1; returns its length in bytes. Overlong forms,
 * surrogates, values above U+10FFFF and truncated sequences decode as one invalid byte. */
size_t pd_uc_utf8_dec(const uint8_t *s, size_t n, uint32_t *cp);
/* Encodes cp (<= U+10FFFF) into out[0..4); returns its length in bytes. */
size_t pd_uc_utf8_enc(uint32_t cp, char *out);

#endif

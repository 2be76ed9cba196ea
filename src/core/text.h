/* Text from files and flags on its way to a terminal, a JSON string or a report: whole UTF-8
 * characters only, no control characters. */
#ifndef PD_CORE_TEXT_H
#define PD_CORE_TEXT_H

#include <stddef.h>

/* Copies src into dst (cap bytes, NUL-ended), cut only between characters, with every byte that
 * is not part of valid UTF-8, every control character (C0, DEL, C1) and every bidirectional
 * override (U+202A-U+202E, U+2066-U+2069) written as '?': a name from a hardware file or a
 * checkpoint can neither drive the terminal (ESC sequences) nor make a JSON string invalid (a
 * name cut inside a character failed the whole --json as "out of memory"). Returns dst. */
char *pd_text_safe(char *dst, size_t cap, const char *src);

/* The first control character, bidirectional override or invalid UTF-8 byte of s, as its offset;
 * -1 when there is none: for inputs refused rather than repaired. */
long pd_text_bad_at(const char *s);

#endif

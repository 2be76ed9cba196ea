/* Regex matcher for the tokenizer's Split patterns (model/tokenizer.c): compiles a pattern and
 * finds its leftmost match in an array of code points (model/unicode.h's, invalid bytes included).
 *
 * Split regexes run on a small backtracking matcher (leftmost-first, greedy, as Oniguruma which
 * HF uses): alternation, groups (...) (?:...) (?i:...), lookahead (?=...) (?!...), quantifiers
 * * + ? {m} {m,} {m,n} {,n} (unbounded ones only on a single character or class), classes with
 * ranges and negation, . ^ $ (line anchors, as in Ruby syntax) \A \z \Z, escapes \s \S \d \D
 * \w \W \r \n \t \f \v \e \a \xHH \x{H..} \uHHHH and \p{..} \P{..} for L Lu Ll M N P S Z C (also
 * spelled Letter, Mark, Number, Punctuation, Symbol, Separator, Other). Anything else (\b,
 * backreferences, lookbehind, lazy or possessive quantifiers, nested classes, inline flags) is
 * an error naming the file, the field and the construct, as are patterns whose worst-case
 * recursion would be deep (groups nested over 32 levels, large counted repeats of groups).
 * Invalid UTF-8 bytes are matched as code points of their own that belong to no category
 * (they fall in [^\s\p{L}\p{N}] and never in \p{P}), so any byte string splits and round-trips. */
#ifndef PD_MODEL_REGEX_H
#define PD_MODEL_REGEX_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"

struct pd_rx;

/* Compiles len bytes of pattern (UTF-8); NULL on error, with e naming label (the file), field and
 * the construct at fault. A compiled regex is never modified: any number of threads may match. */
struct pd_rx *pd_rx_compile(const char *pat, size_t len, const char *label, const char *field,
                            pd_err *e);
void pd_rx_free(struct pd_rx *rx);

/* Leftmost match in cp[beg..end) starting at or after `from` (beg <= from): 1 and [*ms, *me) if
 * there is one, else 0. ^ and \A see beg as the start of text, $ and \z see end as its end. */
int pd_rx_find(const struct pd_rx *rx, const uint32_t *cp, size_t beg, size_t end, size_t from,
               size_t *ms, size_t *me);

#endif

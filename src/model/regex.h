/* Regex matcher for the tokenizer's Split patterns (model/tok_pretok.c): compiles a pattern and
 * finds its leftmost match in an array of code points (model/unicode.h's, invalid bytes included).
 *
 * Syntax (this module's own, parsed here): alternation, groups (...) (?:...) (?i:...), lookahead
 * (?=...) (?!...), quantifiers * + ? {m} {m,} {m,n} {,n} (unbounded ones only on a single
 * character or class), classes with ranges and negation, . ^ $ (line anchors, as in Ruby syntax)
 * \A \z \Z, escapes \s \S \d \D \w \W \r \n \t \f \v \e \a \xHH \x{H..} \uHHHH and \p{..} \P{..}
 * for L Lu Ll M N P S Z C (also spelled Letter, Mark, Number, Punctuation, Symbol, Separator,
 * Other). Anything else (\b, backreferences, lookbehind, lazy or possessive quantifiers, nested
 * classes, inline flags) is an error naming the file, the field and the construct, as are
 * patterns whose worst-case recursion would be deep (groups nested over 32 levels, large counted
 * repeats of groups). \s is White_Space, \d is \p{N} (Oniguruma's is Nd only), \w is L, M, N and
 * Pc. Invalid UTF-8 bytes are matched as code points of their own that belong to no category
 * (they fall in [^\s\p{L}\p{N}] and \P{C}, never in \p{P} or \p{C}), so any byte string splits
 * and round-trips.
 *
 * Matching is leftmost-first and greedy, as Oniguruma (which HF uses) does. The parsed tree is
 * written out as an explicit PCRE2 pattern and run by PCRE2's JIT (libpcre2-32, code points as
 * code units) under a match limit of 10^7 backtracking steps per find plus 16 per character
 * searched (so long legitimate texts stay within it): a pattern that backtracks catastrophically
 * on a text, such as (?:a||){40}\z on a run of a's, is an error naming the file, the field and
 * the limit within ~0.1 s instead of running for ever. A text of n characters costs at most n
 * finds, each within its limit.
 * Categories are model/unicode.h's (Unicode 16.0.0, as HF's tokenizers): the classes are written
 * out for PCRE2 from its tables, so PCRE2's own Unicode tables do not decide them. When those are
 * Unicode 14.0.0 (PCRE2 10.42, Debian 12) a class is PCRE2's \p{..} plus the code points that
 * joined it since (fast: a table lookup and a few dozen ranges); with other PCRE2 tables it is
 * every range of unicode.h (exact, slower on non-ASCII text). Either way PCRE2 and the reference
 * matcher agree on every class over every code point (tests/model/test_regex.c). \p{C} holds
 * no invalid-byte code point and \P{C} all of them. Three differences from the reference matcher
 * are known, on patterns no tokenizer uses: case-insensitive matching is PCRE2's Unicode simple
 * case folding, from its own tables (the reference's is unicode.h's, Unicode 16.0.0); an
 * iteration of a counted group that matches empty ends the repetition, as in Perl ((?:|a){0,2}
 * on "aa" matches "", where the reference matched "aa"); and (?i:...) leaves \p{Lu} and \p{Ll}
 * as they are when they are PCRE2's \p{..}. */
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

/* One thread's matching state (PCRE2 match data). Start with a NULL pointer: pd_rx_find creates
 * it on first use; free it with pd_rx_scratch_free (NULL is fine). */
struct pd_rx_scratch;
void pd_rx_scratch_free(struct pd_rx_scratch *s);

/* Leftmost match in cp[beg..end) starting at or after `from` (beg <= from): 1 and [*ms, *me) if
 * there is one, else 0 (an empty match at `end` counts as none). ^ and \A see beg as the start
 * of text, $ and \z see end as its end. A pattern that backtracks past its limits on this text
 * is PD_EINVAL with e naming the file (the label), the field and the limit; out of memory is
 * PD_ENOMEM. The backtracking of one call is bounded by the limits, whatever the pattern and
 * the text. */
int pd_rx_find(const struct pd_rx *rx, struct pd_rx_scratch **scratch, const uint32_t *cp,
               size_t beg, size_t end, size_t from, size_t *ms, size_t *me, pd_err *e);

/* The same by plain backtracking over the parsed tree, without limits: exponential time on
 * some patterns. The reference pd_rx_find is checked against (tests, `pdmoe bench tokenizer`);
 * never run it on untrusted input. */
int pd_rx_find_ref(const struct pd_rx *rx, const uint32_t *cp, size_t beg, size_t end,
                   size_t from, size_t *ms, size_t *me);

/* Tests: on = 1 makes the regexes compiled afterwards write every class out as code point ranges
 * from unicode.h, as when PCRE2's Unicode tables are not unicode.h's base version (regex.c); 0
 * (the default) uses PCRE2's \p{..} plus the code points that joined since, when they are. Not
 * thread-safe: call it before compiling. */
void pd_rx_set_explicit_classes(int on);

#endif

/* Tests of the Split regex matcher: PCRE2 (pd_rx_find) against the backtracking reference
 * (pd_rx_find_ref) on every code point for the classes tokenizers use, and on the real
 * tokenizer patterns over a varied text and random code points from all planes; the limit error;
 * repeats longer than PCRE2 allows in one quantifier; negated \s and \w inside classes. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "bench/tokenizer_corpus.h"
#include "model/regex.h"
#include "model/unicode.h"

static struct pd_rx *compile(const char *re)
{
    pd_err e = {0};
    struct pd_rx *rx = pd_rx_compile(re, strlen(re), "test.json", "pattern", &e);
    cr_assert_not_null(rx, "/%s/: %s", re, e.msg);
    return rx;
}

/* Every match of a Split over cp[0..n) (as the tokenizer walks them) agrees between the two
 * matchers; returns the number of matches. */
static size_t same_splits(const char *re, const uint32_t *cp, size_t n)
{
    struct pd_rx *rx = compile(re);
    struct pd_rx_scratch *s = NULL;
    size_t from = 0, count = 0;
    while (from < n) {
        size_t ms = 0, me = 0, rs = 0, re_ = 0;
        pd_err e = {0};
        int a = pd_rx_find(rx, &s, cp, 0, n, from, &ms, &me, &e);
        int b = pd_rx_find_ref(rx, cp, 0, n, from, &rs, &re_);
        cr_assert_geq(a, 0, "/%s/: %s", re, e.msg);
        cr_assert_eq(a, b, "/%s/ from %zu: PCRE2 %s, the reference %s", re, from,
                     a ? "matches" : "does not", b ? "does" : "does not");
        if (!a)
            break;
        cr_assert(ms == rs && me == re_, "/%s/ from %zu: PCRE2 [%zu,%zu), the reference [%zu,%zu)",
                  re, from, ms, me, rs, re_);
        count++;
        from = me > ms ? me : ms + 1;
    }
    pd_rx_scratch_free(s);
    pd_rx_free(rx);
    return count;
}

static uint32_t *decode(const char *s, size_t len, size_t *n)
{
    uint32_t *cp = malloc((len + 1) * sizeof *cp);
    cr_assert_not_null(cp);
    size_t k = 0;
    for (size_t i = 0; i < len; k++)
        i += pd_uc_utf8_dec((const uint8_t *)s + i, len - i, &cp[k]);
    *n = k;
    return cp;
}

static const char gpt2_re[] = PD_RE_GPT2;
static const char cl100k_re[] = PD_RE_CL100K;
static const char ds_num_re[] = PD_RE_DS_NUM;
static const char ds_cjk_re[] = PD_RE_DS_CJK;
static const char ds_main_re[] = PD_RE_DS_MAIN;
/* Qwen2's, and the constructs of the tokenizer's own tests */
static const char qwen2_re[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char *const patterns[] = {
    gpt2_re, cl100k_re, ds_num_re, ds_cjk_re, ds_main_re, qwen2_re,
    "\\d+|[a-c]{2}", "(?:ab){2}|\\w+", "a(?=b)", "^\\s+|\\s+$", "[^\\S\\n]+", "\\P{L}+",
    "(?i:[a-c]+)", "a{,2}", "x{", "(?:[A-Z][a-z]+){1,3}", "\\s+\\Z|\\A\\S", ".{1,5}",
    "[\\S\\d]{2}", "[\\W\\p{N}]+", "[^\\W\\p{N}]+", "(?:a|)(?:b|){0,3}",
};

Test(regex, pcre2_agrees_with_the_reference_on_the_corpus)
{
    static const char bad[] = " a\xff\xfe" "b c\xe4\xb8 x\xc0\xaf\xed\xa0\x80y\x80 'S\xc5\xbf";
    size_t len = sizeof pd_tok_corpus - 1, n;
    char *text = malloc(len + sizeof bad);
    cr_assert_not_null(text);
    memcpy(text, pd_tok_corpus, len);
    memcpy(text + len, bad, sizeof bad);
    uint32_t *cp = decode(text, len + sizeof bad - 1, &n);
    for (size_t i = 0; i < sizeof patterns / sizeof *patterns; i++)
        same_splits(patterns[i], cp, n);
    free(cp);
    free(text);
}

Test(regex, pcre2_agrees_with_the_reference_on_random_code_points)
{
    /* code points from all planes (weighted to ASCII, which the patterns treat one by one),
     * invalid-byte code points included */
    enum { N = 20000 };
    uint32_t *cp = malloc(N * sizeof *cp);
    cr_assert_not_null(cp);
    uint32_t x = 99;
    for (int round = 0; round < 4; round++) {
        for (size_t i = 0; i < N; i++) {
            x = x * 1664525u + 1013904223u;
            uint32_t r = x >> 8;
            cp[i] = r % 4 == 0 ? r % 128 : r % 4 == 1 ? r % 0x3000 : r % 0x110100;
            if (cp[i] >= 0xD800 && cp[i] <= 0xDFFF)
                cp[i] = ' ';   /* surrogates never come out of the decoder */
        }
        for (size_t i = 0; i < sizeof patterns / sizeof *patterns; i++)
            same_splits(patterns[i], cp, N);
    }
    free(cp);
}

/* PCRE2's classes against unicode.h's (the reference matcher's) for every code point, the 256
 * invalid-byte ones included: explicit = 0 uses PCRE2's \p{..} plus what joined since Unicode 14
 * when its tables are 14.0.0 (Debian 12), explicit = 1 writes every class out as ranges. */
static void classes_agree(int explicit)
{
    static const char *const classes[] = {
        "\\p{L}", "\\p{N}", "\\p{M}", "\\p{Z}", "\\p{P}", "\\p{S}", "\\p{C}", "\\p{Lu}", "\\p{Ll}",
        "[\\p{P}\\p{S}]", "\\s", "\\S", "\\w", "\\W", "\\d", "\\D", "\\P{L}", "\\P{C}",
        "[^\\s\\p{L}\\p{N}]", "[^\\r\\n\\p{L}\\p{N}]", "[^\\r\\n\\p{L}\\p{P}\\p{S}]",
        "[\\p{L}\\p{M}]", "[\\s\\p{C}]", "[\\W\\d]", ".",
    };
    pd_rx_set_explicit_classes(explicit);
    for (size_t k = 0; k < sizeof classes / sizeof *classes; k++) {
        struct pd_rx *rx = compile(classes[k]);
        struct pd_rx_scratch *s = NULL;
        size_t differ = 0;
        uint32_t first = 0;
        for (uint32_t c = 0; c < PD_UC_BADCP + 256; c++) {
            size_t ms, me, rs, re_;
            pd_err e;
            int a = pd_rx_find(rx, &s, &c, 0, 1, 0, &ms, &me, &e);
            int b = pd_rx_find_ref(rx, &c, 0, 1, 0, &rs, &re_);
            if (a != b && !differ++)
                first = c;
        }
        cr_expect_eq(differ, 0, "%s (explicit %d): %zu code points differ, the first U+%04X",
                     classes[k], explicit, differ, first);
        pd_rx_scratch_free(s);
        pd_rx_free(rx);
    }
    pd_rx_set_explicit_classes(0);
}

Test(regex, the_classes_agree_on_every_code_point)
{
    classes_agree(0);
}

Test(regex, the_classes_written_out_agree_on_every_code_point)
{
    classes_agree(1);
}

Test(regex, a_limit_hit_names_the_file_field_and_limit, .timeout = 20)
{
    pd_err e = {0};
    struct pd_rx *rx = pd_rx_compile("(?:a||){40}\\z", 13, "dir/tokenizer.json",
                                     "pre_tokenizer.pattern.Regex", &e);
    cr_assert_not_null(rx, "%s", e.msg);
    uint32_t cp[61];
    for (int i = 0; i < 60; i++)
        cp[i] = 'a';
    cp[60] = '!';
    struct pd_rx_scratch *s = NULL;
    size_t ms, me;
    int rc = pd_rx_find(rx, &s, cp, 0, 61, 0, &ms, &me, &e);
    cr_assert_eq(rc, PD_EINVAL);
    cr_assert_eq(e.code, PD_EINVAL);
    cr_assert_str_eq(e.msg, "dir/tokenizer.json: field \"pre_tokenizer.pattern.Regex\": the "
                     "regex hit its match limit (10000976 backtracking steps) on a 61-character "
                     "piece of the text, backtracking catastrophically on it: /(?:a||){40}\\z/");
    pd_rx_scratch_free(s);
    pd_rx_free(rx);
}

Test(regex, repeats_longer_than_one_pcre2_quantifier)
{
    /* PCRE2 caps a quantifier at 65535: longer runs of a set are written as several */
    enum { N = 150000 };
    uint32_t *cp = malloc((N + 1) * sizeof *cp);
    cr_assert_not_null(cp);
    for (size_t i = 0; i < N; i++)
        cp[i] = 'a';
    cp[N] = 'b';
    static const struct { const char *re; size_t ms, me; int found; } cases[] = {
        {"a{70000,140000}", 0, 140000, 1},
        {"a{140001}", 0, 140001, 1},
        {"a{150001}", 0, 0, 0},
        {"a{70000,}b", 0, N + 1, 1},
        {"a{0,65536}", 0, 65536, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        struct pd_rx *rx = compile(cases[i].re);
        struct pd_rx_scratch *s = NULL;
        size_t ms = 0, me = 0;
        pd_err e = {0};
        int rc = pd_rx_find(rx, &s, cp, 0, N + 1, 0, &ms, &me, &e);
        cr_assert_eq(rc, cases[i].found, "/%s/: %d %s", cases[i].re, rc, e.msg);
        if (rc)
            cr_assert(ms == cases[i].ms && me == cases[i].me, "/%s/: [%zu,%zu)", cases[i].re, ms,
                      me);
        pd_rx_scratch_free(s);
        pd_rx_free(rx);
    }
    free(cp);
}

Test(regex, errors_are_one_line)
{
    /* found by fuzz_regex: a pattern's control characters (DeepSeek-V3's hold CR and LF) were
     * copied into the message as they are */
    pd_err e = {0};
    cr_assert_null(pd_rx_compile("a\r\n(", 4, "t.json", "p", &e));
    cr_assert_str_eq(e.msg, "t.json: field \"p\": unbalanced parenthesis at offset 3 of regex "
                     "/a\\x0D\\x0A(/");
    cr_assert_null(pd_rx_compile("(?\n)", 4, "t.json", "p", &e));
    cr_assert_null(strchr(e.msg, '\n'), "%s", e.msg);
}

Test(regex, a_bracket_ending_a_class_is_read_within_the_pattern)
{
    /* found by fuzz_regex: the error quoted two bytes from a '[' that was the pattern's last */
    char *pat = malloc(2);
    cr_assert_not_null(pat);
    memcpy(pat, "[[", 2);   /* not NUL-terminated: only len bytes are the pattern */
    pd_err e = {0};
    cr_assert_null(pd_rx_compile(pat, 2, "t.json", "p", &e));
    cr_assert_str_eq(e.msg, "t.json: field \"p\": unsupported regex construct \"[\" (nested "
                     "class, POSIX bracket or intersection) at offset 1 of regex /[[/");
    free(pat);
}

Test(regex, a_long_pattern_leaves_the_error_readable, .timeout = 20)
{
    /* found by fuzz_regex: a pattern of control characters, shown escaped, pushed the limit
     * out of the 512-byte message */
    char pat[400] = "(?:a||){40}\\z|";
    size_t n = strlen(pat);
    memset(pat + n, '\r', 300);
    n += 300;
    pd_err e = {0};
    struct pd_rx *rx = pd_rx_compile(pat, n, "t.json", "p", &e);
    cr_assert_not_null(rx, "%s", e.msg);
    uint32_t cp[61];
    for (int i = 0; i < 60; i++)
        cp[i] = 'a';
    cp[60] = '!';
    struct pd_rx_scratch *s = NULL;
    size_t ms, me;
    cr_assert_eq(pd_rx_find(rx, &s, cp, 0, 61, 0, &ms, &me, &e), PD_EINVAL);
    cr_assert_not_null(strstr(e.msg, "match limit ("), "%s", e.msg);
    cr_assert(strlen(e.msg) < sizeof e.msg - 1 && !strcmp(e.msg + strlen(e.msg) - 4, ".../"),
              "%s", e.msg);
    pd_rx_scratch_free(s);
    pd_rx_free(rx);
}

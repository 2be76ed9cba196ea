/* Tests of the byte-level BPE tokenizer: the GPT-2 byte map, exact ids from a hand-written
 * tokenizer.json (worked out by hand in the comments), the Split patterns of GPT-2, cl100k and
 * DeepSeek-V3 on tricky inputs (expected pieces checked against Python's `regex` module), the
 * DeepSeek-V3 pre-tokenizer sequence end to end, added tokens, round trips with a trained
 * tokenizer, the trainer's determinism and size, one test per kind of bad file, the ids of the
 * real pre-tokenizers on a varied text against those of the matcher before PCRE2, and
 * catastrophic patterns and long runs against the regex limits. Files are written into a fresh
 * mkdtemp directory that the fixture removes. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../tmpmodel.h"
#include "bench/tokenizer_corpus.h"
#include "model/tokenizer.h"

static char dir[] = "/tmp/pd_tok_test_XXXXXX";

static void setup(void)
{
    cr_assert_not_null(mkdtemp(dir));
}

/* Every test writes its files directly in dir. */
static void teardown(void)
{
    rm_flat_dir(dir);
}

TestSuite(tokenizer, .init = setup, .fini = teardown);

/* ---- helpers ------------------------------------------------------------------------------ */

static const char *write_file(const char *name, const char *text)
{
    static char path[4][512];
    static int k;
    char *p = path[k++ % 4];
    snprintf(p, 512, "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
    return p;
}

static struct pd_tok *load_json(json_t *root)
{
    char *text = json_dumps(root, JSON_PRESERVE_ORDER);
    cr_assert_not_null(text);
    const char *path = write_file("tokenizer.json", text);
    free(text);
    struct pd_tok *t = NULL;
    pd_err e = {0};
    cr_assert_eq(pd_tok_load(path, &t, &e), 0, "%s", e.msg);
    return t;
}

/* Loads a bad file and checks the error names the file and contains `want`. */
static void expect_bad(json_t *root, const char *want)
{
    char *text = json_dumps(root, JSON_PRESERVE_ORDER);
    const char *path = write_file("bad.json", text);
    free(text);
    json_decref(root);
    struct pd_tok *t = NULL;
    pd_err e = {0};
    int rc = pd_tok_load(path, &t, &e);
    cr_assert_lt(rc, 0, "expected an error mentioning %s", want);
    cr_assert_null(t);
    cr_assert_eq(e.code, rc);
    cr_assert_not_null(strstr(e.msg, path), "message does not name the file: %s", e.msg);
    cr_assert_not_null(strstr(e.msg, want), "message lacks \"%s\": %s", want, e.msg);
}

static void encode_ok(const struct pd_tok *t, const char *s, size_t len, int32_t **ids, size_t *n)
{
    pd_err e = {0};
    cr_assert_eq(pd_tok_encode(t, s, len, ids, n, &e), 0, "%s", e.msg);
}

static void expect_ids(const struct pd_tok *t, const char *s, const int32_t *want, size_t m)
{
    int32_t *ids;
    size_t n;
    encode_ok(t, s, strlen(s), &ids, &n);
    cr_assert_eq(n, m, "\"%s\": %zu ids, expected %zu", s, n, m);
    for (size_t i = 0; i < m; i++)
        cr_assert_eq(ids[i], want[i], "\"%s\": id %zu is %d, expected %d", s, i, ids[i], want[i]);
    char *out;
    size_t ol;
    cr_assert_eq(pd_tok_decode(t, ids, n, &out, &ol), 0);
    cr_assert_eq(ol, strlen(s));
    cr_assert_eq(memcmp(out, s, ol), 0, "decode gave \"%s\" for \"%s\"", out, s);
    free(out);
    free(ids);
}

#define IDS(...) ((const int32_t[]){__VA_ARGS__}), sizeof((const int32_t[]){__VA_ARGS__}) / 4

/* Checks the Isolated pieces of text (NULL-terminated list of expected pieces). */
static void expect_split_n(const char *pattern, const char *text, size_t len, const char **want)
{
    size_t *b, n;
    pd_err e = {0};
    cr_assert_eq(pd_tok_regex_split(pattern, "test", text, len, &b, &n, &e), 0, "%s", e.msg);
    size_t m = 0;
    while (want[m])
        m++;
    cr_assert_eq(n, m, "/%s/ on \"%s\": %zu pieces, expected %zu", pattern, text, n, m);
    for (size_t i = 0; i < m; i++) {
        size_t l = b[i + 1] - b[i];
        cr_assert(l == strlen(want[i]) && !memcmp(text + b[i], want[i], l),
                  "/%s/ on \"%s\": piece %zu is \"%.*s\", expected \"%s\"", pattern, text, i,
                  (int)l, text + b[i], want[i]);
    }
    free(b);
}

#define SPLIT(pat, text, ...) \
    expect_split_n(pat, text, strlen(text), (const char *[]){__VA_ARGS__, NULL})

static const char gpt2_re[] = PD_RE_GPT2;
static const char cl100k_re[] = PD_RE_CL100K;
/* DeepSeek-V3's three Split patterns, as its tokenizer.json has them (CR and LF literal). */
static const char ds_num_re[] = PD_RE_DS_NUM;
static const char ds_cjk_re[] = PD_RE_DS_CJK;
static const char ds_main_re[] = PD_RE_DS_MAIN;

/* A vocab of the 256 byte-level characters, id = byte + 3. */
static json_t *byte_vocab(void)
{
    json_t *vocab = json_object();
    for (int b = 0; b < 256; b++) {
        char s[8] = {0};
        uint32_t cp = pd_tok_byte_to_cp((uint8_t)b);   /* below U+0800: one or two UTF-8 bytes */
        if (cp < 0x80) {
            s[0] = (char)cp;
        } else {
            s[0] = (char)(0xC0 | (cp >> 6));
            s[1] = (char)(0x80 | (cp & 0x3F));
        }
        json_object_set_new(vocab, s, json_integer(b + 3));
    }
    return vocab;
}

/* A tokenizer.json around a vocab, merges and pre_tokenizer (all taken over). */
static json_t *tok_doc(json_t *vocab, json_t *merges, json_t *pre, json_t *added)
{
    return json_pack("{s:s, s:o, s:n, s:o, s:{s:s}, s:{s:s, s:o, s:o}}", "version", "1.0",
                     "added_tokens", added ? added : json_array(), "normalizer",
                     "pre_tokenizer", pre, "decoder", "type", "ByteLevel", "model", "type", "BPE",
                     "vocab", vocab, "merges", merges);
}

/* The hand-written tokenizer of the `handwritten_*` tests. Ids:
 *   h0 e1 l2 o3 Ġ4 w5 r6 d7 he8 hel9 hell10 hello11 Ġw12 or13 ld14 Ġwor15 !16 Ċ17 ll18
 *   <|end|>19 (added, special)
 * Merges by rank: 0 "h e", 1 "he l", 2 "l l", 3 "hel l", 4 "hell o", 5 "Ġ w", 6 "o r",
 * 7 "Ġw or", 8 "l d". */
static json_t *handwritten(void)
{
    static const char *toks[] = {"h", "e", "l", "o", "Ġ", "w", "r", "d", "he", "hel", "hell",
                                 "hello", "Ġw", "or", "ld", "Ġwor", "!", "Ċ", "ll"};
    json_t *vocab = json_object();
    for (int i = 0; i < 19; i++)
        json_object_set_new(vocab, toks[i], json_integer(i));
    json_t *merges = json_pack("[s,s,s,s,s,s,s,s,s]", "h e", "he l", "l l", "hel l", "hell o",
                               "Ġ w", "o r", "Ġw or", "l d");
    json_t *added = json_pack("[{s:i, s:s, s:b}]", "id", 19, "content", "<|end|>", "special", 1);
    return tok_doc(vocab, merges, pd_tok_bytelevel_step(0, 1), added);
}

/* A deterministic pseudo-text with prose, code, digits, newlines and some non-ASCII. */
static char *sample_text(size_t want, size_t *len)
{
    static const char *words[] = {
        "the", "model", "expert", "token", "cache", "prefill", "decode", "layer", "attention",
        "router", "weight", "memory", "card", "plan", "group", "rank", "batch", "stream", "and",
        "of", "to", "in", "is", "for", "with", "that", "it's", "don't", "they're", "we'll",
        "Mixture", "DeepSeek", "int8", "GEMM", "2048", "128", "3.14", "x86-64", "KV", "é",
        "naïve", "中文", "模型", "😀", "(a+b)", "f(x);", "->", "==", "{", "}", "//", "\"quoted\"",
    };
    size_t nw = sizeof words / sizeof *words;
    char *s = malloc(want + 64);
    cr_assert_not_null(s);
    size_t k = 0;
    static const char *syl[] = {"ka", "to", "ri", "men", "sel", "dor", "ap", "qu", "ist", "ba",
                                "ne", "lo", "vix", "ur", "po", "tra"};
    uint32_t x = 12345;
    while (k < want) {
        x = x * 1103515245u + 12345u;
        if ((x >> 4) % 3 == 0) {   /* a made-up word of 2-3 syllables: many distinct pairs */
            for (unsigned i = 0; i < 2 + (x >> 12) % 2; i++) {
                const char *y = syl[(x >> (14 + 4 * i)) % 16];
                memcpy(s + k, y, strlen(y));
                k += strlen(y);
            }
        } else {
            const char *w = words[(x >> 8) % nw];
            size_t l = strlen(w);
            memcpy(s + k, w, l);
            k += l;
        }
        unsigned r = (x >> 20) % 16;
        s[k++] = r == 0 ? '\n' : r == 1 ? ',' : r == 2 ? '.' : ' ';
        if (r == 2)
            s[k++] = ' ';
    }
    s[k] = 0;
    *len = k;
    return s;
}

static const char *const ds_special[] = {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"};

static struct pd_tok *trained(int vocab_size)
{
    size_t len;
    char *text = sample_text(40000, &len);
    char *json;
    pd_err e = {0};
    cr_assert_eq(pd_tok_train(text, len, vocab_size, ds_special, 2, &json, &e), 0, "%s",
                 e.msg);
    free(text);
    struct pd_tok *t;
    cr_assert_eq(pd_tok_parse(json, "trained.json", &t, &e), 0, "%s", e.msg);
    free(json);
    return t;
}

/* ---- the byte map ------------------------------------------------------------------------- */

Test(tokenizer, byte_map_round_trips_all_256_bytes)
{
    int seen[0x200] = {0};
    for (int b = 0; b < 256; b++) {
        uint32_t cp = pd_tok_byte_to_cp((uint8_t)b);
        cr_assert_lt(cp, 0x144u, "byte %d -> U+%04X", b, cp);
        cr_assert_eq(seen[cp]++, 0, "U+%04X used twice", cp);
        cr_assert_eq(pd_tok_cp_to_byte(cp), b);
    }
    cr_assert_eq(pd_tok_byte_to_cp(' '), 0x120u);    /* Ġ */
    cr_assert_eq(pd_tok_byte_to_cp('\n'), 0x10Au);   /* Ċ */
    cr_assert_eq(pd_tok_byte_to_cp('\t'), 0x109u);   /* ĉ */
    cr_assert_eq(pd_tok_byte_to_cp(0), 0x100u);
    cr_assert_eq(pd_tok_byte_to_cp(127), 0x121u);
    cr_assert_eq(pd_tok_byte_to_cp(0xA0), 0x142u);
    cr_assert_eq(pd_tok_byte_to_cp(0xAD), 0x143u);
    cr_assert_eq(pd_tok_byte_to_cp('A'), (uint32_t)'A');
    cr_assert_eq(pd_tok_byte_to_cp(0xE9), 0xE9u);
    cr_assert_eq(pd_tok_cp_to_byte(' '), -1);       /* a space is never its own stand-in */
    cr_assert_eq(pd_tok_cp_to_byte(0x144), -1);
}

/* ---- a hand-written tokenizer: exact ids ---------------------------------------------------- */

Test(tokenizer, handwritten_exact_ids)
{
    json_t *doc = handwritten();
    struct pd_tok *t = load_json(doc);
    json_decref(doc);
    /* "hello": h e l l o -> (h e)0 -> he l l o -> (he l)1 beats (l l)2 -> hel l o -> (hel l)3
     * -> hell o -> (hell o)4 -> hello. " world": Ġ w o r l d -> (Ġ w)5 -> (o r)6 ->
     * (Ġw or)7 -> (l d)8 -> Ġwor ld. "!" alone. */
    expect_ids(t, "hello world!", IDS(11, 15, 14, 16));
    expect_ids(t, "hell", IDS(10));
    expect_ids(t, "ll", IDS(18));
    /* equal ranks: the leftmost pair first, so "lll" is ll|l, not l|ll */
    expect_ids(t, "lll", IDS(18, 2));
    expect_ids(t, "llll", IDS(18, 18));
    expect_ids(t, "hello\n", IDS(11, 17));
    /* "lo" has no merge; " hello" is one GPT-2 piece Ġhello: (h e) then (he l) ... leave Ġ */
    expect_ids(t, "lo", IDS(2, 3));
    expect_ids(t, " hello", IDS(4, 11));
    expect_ids(t, "", IDS());
    cr_assert_eq(pd_tok_vocab_size(t), 20);
    cr_assert_eq(pd_tok_id_of(t, "hello"), 11);
    cr_assert_eq(pd_tok_id_of(t, "Ġwor"), 15);
    cr_assert_eq(pd_tok_id_of(t, "<|end|>"), 19);
    cr_assert_eq(pd_tok_id_of(t, "world"), -1);
    cr_assert(pd_tok_is_special(t, 19));
    cr_assert(!pd_tok_is_special(t, 11));
    pd_tok_free(t);
}

Test(tokenizer, handwritten_add_prefix_space)
{
    /* ByteLevel add_prefix_space: each segment between added tokens gets a leading space (the
     * decoded text keeps it, as HF's does) */
    json_t *doc = handwritten();
    json_object_set_new(doc, "pre_tokenizer", pd_tok_bytelevel_step(1, 1));
    struct pd_tok *t = load_json(doc);
    json_decref(doc);
    int32_t *ids;
    size_t n;
    encode_ok(t, "hello world!", 12, &ids, &n);
    cr_assert_eq(n, 5);
    cr_assert(ids[0] == 4 && ids[1] == 11 && ids[2] == 15 && ids[3] == 14 && ids[4] == 16);
    free(ids);
    encode_ok(t, "hello<|end|> hello", 18, &ids, &n);
    cr_assert_eq(n, 5);
    cr_assert(ids[0] == 4 && ids[1] == 11 && ids[2] == 19 && ids[3] == 4 && ids[4] == 11);
    char *out;
    size_t ol;
    cr_assert_eq(pd_tok_decode(t, ids, n, &out, &ol), 0);
    cr_assert_str_eq(out, " hello<|end|> hello");
    free(out);
    free(ids);
    pd_tok_free(t);
}

Test(tokenizer, handwritten_special_tokens_are_never_split)
{
    json_t *doc = handwritten();
    struct pd_tok *t = load_json(doc);
    json_decref(doc);
    expect_ids(t, "hello<|end|>hell", IDS(11, 19, 10));
    expect_ids(t, "<|end|><|end|>", IDS(19, 19));
    expect_ids(t, " <|end|>!", IDS(4, 19, 16));
    /* a prefix of the special token is ordinary text: "<" is not in this vocab */
    int32_t *ids;
    size_t n;
    pd_err e = {0};
    cr_assert_eq(pd_tok_encode(t, "<|end", 5, &ids, &n, &e), PD_EINVAL);
    cr_assert_not_null(strstr(e.msg, "byte 0x3c"), "%s", e.msg);
    cr_assert_not_null(strstr(e.msg, "tokenizer.json"), "%s", e.msg);
    char buf[16];
    cr_assert_eq(pd_tok_decode_one(t, 19, buf, sizeof buf), 7);
    cr_assert_eq(memcmp(buf, "<|end|>", 7), 0);
    pd_tok_free(t);
}

Test(tokenizer, merges_as_pairs_and_ignore_merges)
{
    /* the same merges written as [["h","e"], ...], plus ignore_merges: a whole piece that is in
     * the vocab is taken as it is, even where merges would not build it */
    json_t *vocab = json_pack("{s:i, s:i, s:i, s:i, s:i}", "a", 0, "b", 1, "c", 2, "ab", 3,
                              "abc", 4);
    json_t *merges = json_pack("[[s,s]]", "a", "b");
    json_t *doc = tok_doc(vocab, merges, pd_tok_bytelevel_step(0, 1), NULL);
    struct pd_tok *t = load_json(doc);
    expect_ids(t, "abc", IDS(3, 2));
    pd_tok_free(t);
    json_object_set_new(json_object_get(doc, "model"), "ignore_merges", json_true());
    t = load_json(doc);
    json_decref(doc);
    expect_ids(t, "abc", IDS(4));
    expect_ids(t, "ab", IDS(3));
    pd_tok_free(t);
}

Test(tokenizer, added_token_lstrip_rstrip_single_word)
{
    json_t *vocab = json_object();
    for (int b = 0; b < 256; b++) {
        char s[8] = {0};
        uint32_t cp = pd_tok_byte_to_cp((uint8_t)b);
        if (cp < 0x80) {
            s[0] = (char)cp;
        } else {
            s[0] = (char)(0xC0 | (cp >> 6));
            s[1] = (char)(0x80 | (cp & 0x3F));
        }
        json_object_set_new(vocab, s, json_integer(b));
    }
    json_t *added = json_pack("[{s:i, s:s, s:b, s:b}, {s:i, s:s, s:b}, {s:i, s:s}, {s:i, s:s}]",
                              "id", 256, "content", "<mask>", "lstrip", 1, "rstrip", 1, "id",
                              257, "content", "cat", "single_word", 1, "id", 258, "content",
                              "<x>", "id", 259, "content", "<x>y");
    json_t *doc = tok_doc(vocab, json_array(), pd_tok_bytelevel_step(0, 1), added);
    struct pd_tok *t = load_json(doc);
    json_decref(doc);
    expect_ids(t, "a", IDS('a'));
    /* the spaces around <mask> belong to it */
    int32_t *ids;
    size_t n;
    encode_ok(t, "a  <mask> b", 11, &ids, &n);
    cr_assert_eq(n, 3);
    cr_assert(ids[0] == 'a' && ids[1] == 256 && ids[2] == 'b');
    free(ids);
    /* "cat" only as a word of its own */
    expect_ids(t, "cat", IDS(257));
    expect_ids(t, "a cat.", IDS('a', ' ', 257, '.'));
    expect_ids(t, "cats", IDS('c', 'a', 't', 's'));
    expect_ids(t, "bobcat", IDS('b', 'o', 'b', 'c', 'a', 't'));
    /* overlapping added tokens: the longest wins where both start */
    expect_ids(t, "<x>y<x>", IDS(259, 258));
    expect_ids(t, "<<x>", IDS('<', 258));
    pd_tok_free(t);
}

/* ---- Split patterns (expected pieces from Python's regex module) ---------------------------- */

Test(tokenizer, split_gpt2_pattern)
{
    SPLIT(gpt2_re, "don't", "don", "'t");
    SPLIT(gpt2_re, "I'LL go", "I", "'", "LL", " go");   /* case-sensitive */
    SPLIT(gpt2_re, "they're here", "they", "'re", " here");
    SPLIT(gpt2_re, "12345", "12345");
    SPLIT(gpt2_re, "3.14159", "3", ".", "14159");
    SPLIT(gpt2_re, "a   b", "a", "  ", " b");
    SPLIT(gpt2_re, "a\n\nb", "a", "\n", "\n", "b");
    SPLIT(gpt2_re, "hi!!!\n\nyo", "hi", "!!!", "\n", "\n", "yo");
    SPLIT(gpt2_re, "x  \n  y", "x", "  \n ", " y");
    SPLIT(gpt2_re, "Hello, 世界! 123", "Hello", ",", " 世界", "!", " 123");
    SPLIT(gpt2_re, "hi😀😀 there", "hi", "😀😀", " there");
    SPLIT(gpt2_re, " ?!x", " ?!", "x");
    /* \s is White_Space: no-break and ideographic spaces included */
    SPLIT(gpt2_re, "a\u00a0\u00a0b", "a", "\u00a0", "\u00a0", "b");
    SPLIT(gpt2_re, "x\u3000\u3000y", "x", "\u3000", "\u3000", "y");
    SPLIT(gpt2_re, "a\u2028b", "a", "\u2028", "b");
}

Test(tokenizer, split_cl100k_pattern)
{
    SPLIT(cl100k_re, "don't", "don", "'t");
    SPLIT(cl100k_re, "I'LL go", "I", "'LL", " go");   /* (?i:...) */
    SPLIT(cl100k_re, "'S", "'S");
    SPLIT(cl100k_re, "12345", "123", "45");
    SPLIT(cl100k_re, "3.14159", "3", ".", "141", "59");
    SPLIT(cl100k_re, "１２３４", "１２３", "４");        /* fullwidth digits are \p{N} */
    SPLIT(cl100k_re, "Ⅻ₂½x", "Ⅻ₂½", "x");               /* Nl, No */
    SPLIT(cl100k_re, "a   b", "a", "  ", " b");
    SPLIT(cl100k_re, "a\n\nb", "a", "\n\n", "b");
    SPLIT(cl100k_re, "hi!!!\n\nyo", "hi", "!!!\n\n", "yo");
    SPLIT(cl100k_re, "x  \n  y", "x", "  \n", " ", " y");
    SPLIT(cl100k_re, "tab\there", "tab", "\there");
    SPLIT(cl100k_re, "don’t", "don", "’t");
    SPLIT(cl100k_re, "Hello, 世界! 123", "Hello", ",", " 世界", "!", " ", "123");
    SPLIT(cl100k_re, "hi😀😀 there", "hi", "😀😀", " there");
    SPLIT(cl100k_re, "a\u00a0\u00a0b", "a", "\u00a0", "\u00a0b");
}

Test(tokenizer, split_deepseek_v3_patterns)
{
    SPLIT(ds_num_re, "x1234567y", "x", "123", "456", "7", "y");
    SPLIT(ds_num_re, "Hello, 世界! 123", "Hello, 世界! ", "123");
    SPLIT(ds_cjk_re, "abc中文テストxyz", "abc", "中文テスト", "xyz");
    SPLIT(ds_cjk_re, "Hello, 世界! 123", "Hello, ", "世界", "! 123");
    SPLIT(ds_main_re, "don't", "don", "'t");
    SPLIT(ds_main_re, "I'LL go", "I", "'LL", " go");
    SPLIT(ds_main_re, "don’t", "don", "’", "t");
    SPLIT(ds_main_re, "a   b", "a", "  ", " b");
    SPLIT(ds_main_re, "a\n\nb", "a", "\n\n", "b");
    SPLIT(ds_main_re, "hi!!!\n\nyo", "hi", "!!!\n\n", "yo");
    SPLIT(ds_main_re, "x  \n  y", "x", "  \n", " ", " y");
    SPLIT(ds_main_re, "tab\there", "tab", "\there");
    SPLIT(ds_main_re, "hi😀😀 there", "hi", "😀😀", " there");
    SPLIT(ds_main_re, "café naïve", "café", " naïve");
    SPLIT(ds_main_re, "e\xcc\x81t\xc3\xa9", "e\xcc\x81t\xc3\xa9");   /* a combining mark: \p{M} */
}

Test(tokenizer, split_code_points_new_in_unicode_15_and_16)
{
    /* HF's tokenizers (Oniguruma, npm tokenizers 0.23.2) has Unicode 16.0 classes: a space
     * joins a letter new in 15.0-16.0 ([^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+) and a symbol
     * ( ?[\p{P}\p{S}]+), but not a code point unassigned in 16.0 (new in 17.0). With glibc's and
     * PCRE2's Unicode 14, the space of all but the last stood alone. */
    SPLIT(ds_main_re, "a \xf0\xae\xaf\xb0", "a", " \xf0\xae\xaf\xb0"); /* U+2EBF0, 15.1 */
    SPLIT(ds_main_re, "a \xf0\xb1\x8d\x90", "a", " \xf0\xb1\x8d\x90"); /* U+31350, 15.0 */
    SPLIT(ds_main_re, "a \xf0\x9f\xab\xa9", "a", " \xf0\x9f\xab\xa9"); /* U+1FAE9, an emoji, 16.0 */
    SPLIT(ds_main_re, "a \xf0\x9f\xa9\xb5", "a", " \xf0\x9f\xa9\xb5"); /* U+1FA75, an emoji, 15.0 */
    SPLIT(ds_main_re, "a \xe2\xbf\xbc", "a", " \xe2\xbf\xbc"); /* U+2FFC, So, 15.1 */
    SPLIT(ds_main_re, "a \xf0\x9f\xab\xaa", "a", " ", "\xf0\x9f\xab\xaa"); /* U+1FAEA, 17.0 */
    SPLIT(ds_num_re, "x\xf0\x90\xb5\x80\xf0\x90\xb5\x81y", "x",
          "\xf0\x90\xb5\x80\xf0\x90\xb5\x81", "y");   /* Garay digits, Nd, 16.0 */
}

Test(tokenizer, split_invalid_utf8_bytes)
{
    /* each invalid byte is a code point of its own in no category: it joins punctuation-like
     * runs, never letters, and the pieces still cover every byte */
    const char s[] = "a\xff\xfe" "b c\xe4\xb8";   /* 0xE4 0xB8 is a truncated 中 */
    expect_split_n(cl100k_re, s, sizeof s - 1,
                   (const char *[]){"a", "\xff\xfe", "b", " c", "\xe4\xb8", NULL});
    expect_split_n(gpt2_re, s, sizeof s - 1,
                   (const char *[]){"a", "\xff\xfe", "b", " c", "\xe4\xb8", NULL});
    /* overlong '/', an encoded surrogate: no alternative matches them, except that the last
     * one may lead a word as any non-letter, non-punctuation character may */
    const char o[] = "x\xc0\xaf\xed\xa0\x80y";
    expect_split_n(ds_main_re, o, sizeof o - 1,
                   (const char *[]){"x", "\xc0\xaf\xed\xa0", "\x80y", NULL});
}

Test(tokenizer, split_regex_constructs)
{
    SPLIT("\\d+|[a-c]{2}", "1234abcx", "1234", "ab", "cx");
    SPLIT("(?:ab){2}|\\w+", "ababab xy", "abab", "ab", " ", "xy");
    SPLIT("a(?=b)", "aab", "a", "a", "b");
    SPLIT("^\\s+|\\s+$", "  mid  ", "  ", "mid", "  ");
    SPLIT("\\x41|\\u00e9|\\x{4E2D}", "A é 中", "A", " ", "é", " ", "中");
    SPLIT("[^\\S\\n]+", "a \t\nb", "a", " \t", "\nb");
    SPLIT("\\P{L}+", "ab12!c", "ab", "12!", "c");
    SPLIT("(?i:[a-c]+)", "xABcay", "x", "ABca", "y");
    SPLIT("a{,2}", "aaa", "aa", "a");
    SPLIT("x{", "ax{b", "a", "x{", "b");   /* a '{' that is no interval is a literal */
}

/* ---- the DeepSeek-V3 pre-tokenizer sequence end to end ------------------------------------- */

Test(tokenizer, deepseek_v3_sequence_end_to_end)
{
    /* Bytes 0..255 plus tokens whose merges would cross the Split boundaries if a step were
     * missing: "1234" must stay 123|4 (\p{N}{1,3}), "a中" must stay a|中 (the CJK split)
     * although the merge "a ä" (a + first byte of 中) has the best rank. */
    json_t *vocab = byte_vocab();
    /* 中 = E4 B8 AD -> byte-level "ä¸Ń" */
    static const char *more[] = {"aä", "12", "123", "1234", "ä¸", "ä¸Ń", "Ġ1"};
    for (int i = 0; i < 7; i++)
        json_object_set_new(vocab, more[i], json_integer(259 + i));
    json_t *merges = json_pack("[s,s,s,s,s,s,s]", "a ä", "1 2", "12 3", "123 4", "ä ¸", "ä¸ Ń",
                               "Ġ 1");
    json_t *pre = json_pack("{s:s, s:[o,o,o,o]}", "type", "Sequence", "pretokenizers",
                            pd_tok_split_step(ds_num_re), pd_tok_split_step(ds_cjk_re),
                            pd_tok_split_step(ds_main_re), pd_tok_bytelevel_step(0, 0));
    json_t *added = json_pack("[{s:i,s:s,s:b},{s:i,s:s,s:b},{s:i,s:s,s:b}]", "id", 0, "content",
                              ds_special[0], "special", 1, "id", 1, "content", ds_special[1],
                              "special", 1, "id", 2, "content", "<｜▁pad▁｜>", "special", 1);
    json_t *doc = tok_doc(vocab, merges, pre, added);
    json_object_set_new(doc, "normalizer", json_pack("{s:s, s:[]}", "type", "Sequence",
                                                     "normalizers"));
    json_object_set_new(doc, "post_processor",
                        json_pack("{s:s, s:[{s:{s:s, s:i}}, {s:{s:s, s:i}}]}", "type",
                                  "TemplateProcessing", "single", "SpecialToken", "id",
                                  ds_special[0], "type_id", 0, "Sequence", "id", "A", "type_id",
                                  0));
    struct pd_tok *t = load_json(doc);
    json_decref(doc);
    expect_ids(t, "1234", IDS(261, '4' + 3));
    expect_ids(t, "12345", IDS(261, '4' + 3, '5' + 3));
    expect_ids(t, "a中", IDS('a' + 3, 264));
    expect_ids(t, "ä", IDS(0xC3 + 3, 0xA4 + 3));   /* U+00E4 is C3 A4, not the byte E4 */
    /* " 1" is a piece of its own only after the digits are split out: ' ' | '1' */
    expect_ids(t, " 1", IDS(' ' + 3, '1' + 3));
    char text[128];
    snprintf(text, sizeof text, "%s1234%s", ds_special[0], ds_special[1]);
    expect_ids(t, text, IDS(0, 261, '4' + 3, 1));
    cr_assert_eq(pd_tok_bos(t), 0);
    cr_assert_eq(pd_tok_eos(t), 1);
    cr_assert_eq(pd_tok_id_of(t, "<｜▁pad▁｜>"), 2);
    pd_tok_free(t);
}

/* ---- a trained tokenizer: round trips ------------------------------------------------------ */

Test(tokenizer, trained_round_trips)
{
    struct pd_tok *t = trained(800);
    static const char *texts[] = {
        "", "a", "Hello, world!", "the expert cache and the decode layer\n\n",
        "naïve café – “quotes” … 中文模型 😀👍🏽 ½ ２０２４", "   leading and trailing   ",
        "tabs\tand\r\nCRLF\r\n", "it's they're WE'LL", "x86-64 int8 GEMM: 3.14159265358979",
    };
    for (size_t i = 0; i < sizeof texts / sizeof *texts; i++) {
        int32_t *ids, *ids2;
        size_t n, n2, ol;
        char *out;
        encode_ok(t, texts[i], strlen(texts[i]), &ids, &n);
        cr_assert_eq(pd_tok_decode(t, ids, n, &out, &ol), 0);
        cr_assert(ol == strlen(texts[i]) && !memcmp(out, texts[i], ol), "\"%s\"", texts[i]);
        encode_ok(t, out, ol, &ids2, &n2);
        cr_assert(n2 == n && !memcmp(ids, ids2, n * sizeof *ids), "\"%s\"", texts[i]);
        free(out);
        free(ids);
        free(ids2);
    }
    /* random bytes, including invalid UTF-8 */
    uint32_t x = 7;
    for (int r = 0; r < 200; r++) {
        char buf[300];
        size_t len = (size_t)(r * 37 % 300);
        for (size_t i = 0; i < len; i++) {
            x = x * 1664525u + 1013904223u;
            buf[i] = (char)(x >> 24);
        }
        int32_t *ids, *ids2;
        size_t n, n2, ol;
        char *out;
        encode_ok(t, buf, len, &ids, &n);
        cr_assert_eq(pd_tok_decode(t, ids, n, &out, &ol), 0);
        cr_assert(ol == len && !memcmp(out, buf, len), "random bytes, round %d", r);
        encode_ok(t, out, ol, &ids2, &n2);
        cr_assert(n2 == n && !memcmp(ids, ids2, n * sizeof *ids), "random bytes, round %d", r);
        free(out);
        free(ids);
        free(ids2);
    }
    pd_tok_free(t);
}

Test(tokenizer, trained_specials_and_streaming)
{
    struct pd_tok *t = trained(700);
    cr_assert_eq(pd_tok_bos(t), 0);
    cr_assert_eq(pd_tok_eos(t), 1);
    cr_assert_eq(pd_tok_id_of(t, "<｜end▁of▁sentence｜>"), 1);
    cr_assert(pd_tok_is_special(t, 0) && pd_tok_is_special(t, 1) && !pd_tok_is_special(t, 2));
    /* specials are matched whole, text around them encodes as it does alone */
    int32_t *a, *b, *all;
    size_t na, nb, nall;
    encode_ok(t, "the model", 9, &a, &na);
    encode_ok(t, " and", 4, &b, &nb);
    char text[128];
    snprintf(text, sizeof text, "%sthe model%s and", ds_special[0], ds_special[1]);
    encode_ok(t, text, strlen(text), &all, &nall);
    cr_assert_eq(nall, 1 + na + 1 + nb);
    cr_assert_eq(all[0], 0);
    cr_assert_eq(memcmp(all + 1, a, na * sizeof *a), 0);
    cr_assert_eq(all[1 + na], 1);
    cr_assert_eq(memcmp(all + 2 + na, b, nb * sizeof *b), 0);
    free(a);
    free(b);
    free(all);
    /* a broken special is ordinary text */
    encode_ok(t, "<｜end▁of▁", strlen("<｜end▁of▁"), &a, &na);
    for (size_t i = 0; i < na; i++)
        cr_assert(a[i] > 1);
    free(a);
    /* streaming: bytes of each token, split UTF-8 sequences included, concatenate to the text */
    const char *s = "é中😀 décodé";
    encode_ok(t, s, strlen(s), &a, &na);
    char out[64];
    size_t k = 0;
    for (size_t i = 0; i < na; i++) {
        int l = pd_tok_decode_one(t, a[i], out + k, sizeof out - k);
        cr_assert_geq(l, 1);
        k += (size_t)l;
    }
    cr_assert(k == strlen(s) && !memcmp(out, s, k));
    char one[1];
    size_t big = 0;
    for (size_t i = 0; i < na; i++) {
        size_t l;
        cr_assert_not_null(pd_tok_token_bytes(t, a[i], &l));
        big = l > big ? l : big;
    }
    cr_assert_leq(big, pd_tok_max_token_bytes(t));
    cr_assert_eq(pd_tok_decode_one(t, 0, one, sizeof one), PD_ERANGE);
    cr_assert_eq(pd_tok_decode_one(t, -1, one, sizeof one), PD_EINVAL);
    cr_assert_eq(pd_tok_decode_one(t, 700, one, sizeof one), PD_EINVAL);
    int32_t bad = 5000;
    char *dec;
    size_t dl;
    cr_assert_eq(pd_tok_decode(t, &bad, 1, &dec, &dl), PD_EINVAL);
    /* the caller-buffer variant */
    int32_t small[2];
    size_t need;
    pd_err e = {0};
    cr_assert_eq(pd_tok_encode_into(t, s, strlen(s), small, 2, &need, &e), PD_ERANGE);
    cr_assert_eq(need, na);
    int32_t *full = malloc(need * sizeof *full);
    cr_assert_eq(pd_tok_encode_into(t, s, strlen(s), full, need, &need, &e), 0, "%s", e.msg);
    cr_assert_eq(memcmp(full, a, na * sizeof *a), 0);
    free(full);
    free(a);
    pd_tok_free(t);
}

/* ---- the trainer --------------------------------------------------------------------------- */

Test(tokenizer, train_deterministic_exact_size_and_compresses)
{
    size_t len;
    char *text = sample_text(40000, &len);
    char *j1, *j2;
    pd_err e = {0};
    cr_assert_eq(pd_tok_train(text, len, 1000, ds_special, 2, &j1, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_tok_train(text, len, 1000, ds_special, 2, &j2, &e), 0, "%s", e.msg);
    cr_assert_str_eq(j1, j2);
    /* Hugging Face's layout */
    json_error_t je;
    json_t *root = json_loads(j1, JSON_REJECT_DUPLICATES, &je);
    cr_assert_not_null(root, "%s", je.text);
    json_t *model = json_object_get(root, "model");
    cr_assert_str_eq(json_string_value(json_object_get(model, "type")), "BPE");
    cr_assert_eq(json_object_size(json_object_get(model, "vocab")), 1000);
    json_t *merges = json_object_get(model, "merges");
    cr_assert_geq(json_array_size(merges), 1000 - 2 - 256);
    for (size_t i = 0; i < json_array_size(merges); i++) {
        const char *m = json_string_value(json_array_get(merges, i));
        cr_assert(m && strchr(m, ' ') && !strchr(strchr(m, ' ') + 1, ' '));
    }
    json_t *pre = json_object_get(root, "pre_tokenizer");
    cr_assert_str_eq(json_string_value(json_object_get(pre, "type")), "Sequence");
    json_t *added = json_object_get(root, "added_tokens");
    cr_assert_eq(json_array_size(added), 2);
    cr_assert(json_is_true(json_object_get(json_array_get(added, 1), "special")));
    cr_assert_str_eq(json_string_value(json_object_get(json_array_get(added, 1), "content")),
                     ds_special[1]);
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(root, "decoder"),
                                                       "type")), "ByteLevel");
    json_decref(root);
    /* it loads back, from a file, and compresses the text it was trained on */
    const char *path = write_file("tokenizer.json", j1);
    struct pd_tok *t;
    cr_assert_eq(pd_tok_load(path, &t, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_tok_vocab_size(t), 1000);
    cr_assert_eq(pd_tok_id_of(t, ds_special[0]), 0);
    cr_assert_eq(pd_tok_id_of(t, "a"), 2 + 'a');   /* byte tokens follow the specials */
    cr_assert_eq(pd_tok_id_of(t, "Ġ"), 2 + ' ');
    int32_t *ids;
    size_t n;
    encode_ok(t, text, len, &ids, &n);
    cr_assert_lt(n * 3, len, "%zu tokens for %zu bytes", n, len);
    free(ids);
    pd_tok_free(t);
    free(j1);
    free(j2);
    /* a different vocab size changes the result; a bigger one compresses better */
    cr_assert_eq(pd_tok_train(text, len, 1200, ds_special, 2, &j1, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_tok_parse(j1, "t1200", &t, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_tok_vocab_size(t), 1200);
    size_t n2;
    encode_ok(t, text, len, &ids, &n2);
    cr_assert_lt(n2, n);
    free(ids);
    pd_tok_free(t);
    free(j1);
    free(text);
}

Test(tokenizer, train_merge_order_and_tie_break)
{
    /* words (cl100k split): "ab", " ab", " cd" x2. Pair counts: (a b) 2, (Ġ c) 2, (c d) 2,
     * (Ġ a) 1. Ties go to the smaller (left id, right id): Ġ is byte 32, so "Ġ c" first. Then
     * (a b) 2 and (Ġc d) 2 tie, and a = 97 < Ġc = 256: "a b", then "Ġc d". Then (Ġ ab) 1. */
    static const char *want[] = {"Ġ c", "a b", "Ġc d", "Ġ ab"};
    char *json;
    pd_err e = {0};
    cr_assert_eq(pd_tok_train("ab ab cd cd", 11, 260, NULL, 0, &json, &e), 0, "%s", e.msg);
    json_t *root = json_loads(json, 0, NULL);
    json_t *merges = json_object_get(json_object_get(root, "model"), "merges");
    cr_assert_eq(json_array_size(merges), 4);
    for (size_t i = 0; i < 4; i++)
        cr_assert_str_eq(json_string_value(json_array_get(merges, i)), want[i]);
    json_t *vocab = json_object_get(json_object_get(root, "model"), "vocab");
    cr_assert_eq(json_integer_value(json_object_get(vocab, "Ġc")), 256);
    cr_assert_eq(json_integer_value(json_object_get(vocab, "Ġab")), 259);
    json_decref(root);
    struct pd_tok *t;
    cr_assert_eq(pd_tok_parse(json, "tiny.json", &t, &e), 0, "%s", e.msg);
    free(json);
    expect_ids(t, "ab ab cd cd", IDS(257, 259, 258, 258));
    pd_tok_free(t);
}

Test(tokenizer, train_rejects_impossible_requests)
{
    char *json = NULL;
    pd_err e = {0};
    cr_assert_eq(pd_tok_train("ab ab ab", 8, 300, ds_special, 2, &json, &e), PD_EINVAL);
    cr_assert_null(json);
    cr_assert_not_null(strstr(e.msg, "vocab_size"), "%s", e.msg);
    cr_assert_eq(pd_tok_train("ab", 2, 200, ds_special, 2, &json, &e), PD_EINVAL);
    const char *dup[] = {"<s>", "<s>"};
    cr_assert_eq(pd_tok_train("ab ab", 5, 300, dup, 2, &json, &e), PD_EINVAL);
    cr_assert_not_null(strstr(e.msg, "twice"), "%s", e.msg);
}

/* ---- bad files ----------------------------------------------------------------------------- */

Test(tokenizer, bad_not_json_and_missing_file)
{
    const char *path = write_file("bad.json", "{\"model\": {\"type\": \"BPE\",");
    struct pd_tok *t = NULL;
    pd_err e = {0};
    cr_assert_eq(pd_tok_load(path, &t, &e), PD_EFORMAT);
    cr_assert_not_null(strstr(e.msg, path), "%s", e.msg);
    cr_assert_null(t);
    char missing[600];
    snprintf(missing, sizeof missing, "%s/none.json", dir);
    cr_assert_eq(pd_tok_load(missing, &t, &e), PD_EIO);
    cr_assert_not_null(strstr(e.msg, "none.json"), "%s", e.msg);
    cr_assert_eq(pd_tok_parse("[1, 2]", "inline.json", &t, &e), PD_EFORMAT);
    cr_assert_not_null(strstr(e.msg, "inline.json"), "%s", e.msg);
}

Test(tokenizer, bad_model_type)
{
    json_t *doc = handwritten();
    json_object_set_new(json_object_get(doc, "model"), "type", json_string("WordPiece"));
    expect_bad(doc, "field \"model.type\": expected \"BPE\", got \"WordPiece\"");
}

Test(tokenizer, bad_merge_token_missing)
{
    json_t *doc = handwritten();
    json_array_set_new(json_object_get(json_object_get(doc, "model"), "merges"), 1,
                       json_string("he x"));
    expect_bad(doc, "field \"model.merges[1]\": token \"x\" is not in model.vocab");
    doc = handwritten();
    json_array_set_new(json_object_get(json_object_get(doc, "model"), "merges"), 2,
                       json_string("w d"));
    expect_bad(doc, "field \"model.merges[2]\": merged token \"wd\" is not in model.vocab");
    doc = handwritten();
    json_array_set_new(json_object_get(json_object_get(doc, "model"), "merges"), 0,
                       json_string("h e l"));
    expect_bad(doc, "field \"model.merges[0]\": expected \"left right\"");
}

/* A token quoted in an error keeps the message on one line: control characters escaped (the
 * fuzzer's find: a merge of a token with a newline in it). */
Test(tokenizer, bad_merge_token_with_control_characters_stays_on_one_line)
{
    json_t *doc = handwritten();
    json_array_set_new(json_object_get(json_object_get(doc, "model"), "merges"), 1,
                       json_pack("[s,s]", "he", "x\ny\tz\x01"));
    expect_bad(doc, "field \"model.merges[1]\": token \"x\\ny\\tz\\x01\" is not in model.vocab");
}

Test(tokenizer, bad_duplicate_vocab_id)
{
    json_t *doc = handwritten();
    json_object_set_new(json_object_get(json_object_get(doc, "model"), "vocab"), "zz",
                        json_integer(3));
    expect_bad(doc, "field \"model.vocab[\"zz\"]\": id 3 is already the id of \"o\"");
    doc = handwritten();
    json_object_set_new(json_object_get(json_object_get(doc, "model"), "vocab"), "neg",
                        json_integer(-1));
    expect_bad(doc, "field \"model.vocab[\"neg\"]\": expected an integer id");
    doc = handwritten();
    json_array_append_new(json_object_get(doc, "added_tokens"),
                          json_pack("{s:i, s:s}", "id", 11, "content", "<x>"));
    expect_bad(doc, "field \"added_tokens[1].id\": id 11 is the vocab token \"hello\"");
}

Test(tokenizer, bad_unsupported_regex)
{
    static const struct { const char *re, *want; } cases[] = {
        {"\\bword\\b", "unsupported regex construct \"\\b\""},
        {"(?<=a)b", "unsupported regex construct \"(?<=a\""},
        {"a+?", "lazy, possessive or stacked quantifier"},
        {"(ab)+", "a group may only be repeated a bounded number of times"},
        {"(ab){2,}", "a group may only be repeated a bounded number of times"},
        {"\\p{Han}+", "unsupported regex construct \"\\p{Han}\""},
        {"[[:alpha:]]", "nested class"},
        {"(a|b", "unbalanced parenthesis"},
        {"[a-", "unterminated character class"},
        {"*a", "nothing to repeat"},
        {"\\1", "unsupported regex construct \"\\1\""},
        {"((ab){100}){100}", "pattern too complex"},
        {"((((((((((((((((((((((((((((((((((a))))))))))))))))))))))))))))))))))",
         "groups nested more than 32 deep"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        json_t *doc = handwritten();
        json_object_set_new(doc, "pre_tokenizer",
                            json_pack("{s:s, s:[o,o]}", "type", "Sequence", "pretokenizers",
                                      pd_tok_split_step(cases[i].re), pd_tok_bytelevel_step(0, 0)));
        expect_bad(doc, "field \"pre_tokenizer.pretokenizers[0].pattern.Regex\"");
        doc = handwritten();
        json_object_set_new(doc, "pre_tokenizer",
                            json_pack("{s:s, s:[o,o]}", "type", "Sequence", "pretokenizers",
                                      pd_tok_split_step(cases[i].re), pd_tok_bytelevel_step(0, 0)));
        expect_bad(doc, cases[i].want);
    }
}

Test(tokenizer, bad_pipeline_pieces)
{
    json_t *doc = handwritten();
    json_object_set_new(doc, "pre_tokenizer", json_pack("{s:s}", "type", "Whitespace"));
    expect_bad(doc, "field \"pre_tokenizer.type\": pre-tokenizer \"Whitespace\" is not supported");
    doc = handwritten();
    json_object_set_new(doc, "pre_tokenizer", pd_tok_split_step("\\s+"));
    expect_bad(doc, "field \"pre_tokenizer\": a ByteLevel step is required");
    doc = handwritten();
    json_object_set_new(doc, "pre_tokenizer",
                        json_pack("{s:s, s:[o,o]}", "type", "Sequence", "pretokenizers",
                                  pd_tok_bytelevel_step(0, 0), pd_tok_split_step("\\s+")));
    expect_bad(doc, "field \"pre_tokenizer.pretokenizers[0]\": ByteLevel must be the last");
    doc = handwritten();
    json_object_set_new(doc, "normalizer", json_pack("{s:s}", "type", "Lowercase"));
    expect_bad(doc, "field \"normalizer.type\": normalizer \"Lowercase\" is not supported");
    doc = handwritten();
    json_object_set_new(doc, "decoder", json_pack("{s:s}", "type", "Metaspace"));
    expect_bad(doc, "field \"decoder\"");
    doc = handwritten();
    json_object_set_new(json_object_get(doc, "model"), "byte_fallback", json_true());
    expect_bad(doc, "field \"model.byte_fallback\"");
    doc = handwritten();
    json_object_del(doc, "model");
    expect_bad(doc, "field \"model\": expected an object");
}

Test(tokenizer, split_behaviors)
{
    /* one pattern ("-") under each Split behavior, then ByteLevel; every byte is a token, so
     * the pieces show in the ids only through the merges "- a" and "- -", which apply only
     * where both sides share a piece */
    static const struct { const char *behavior; int invert; const char *text;
                          int32_t want[8]; size_t n; } cases[] = {
        {"Isolated", 0, "x-a", {'x', '-', 'a'}, 3},
        {"MergedWithNext", 0, "x-a", {'x', 300}, 2},
        {"MergedWithPrevious", 0, "x-a", {'x', '-', 'a'}, 3},
        {"Removed", 0, "x-a-", {'x', 'a'}, 2},
        {"Isolated", 0, "a--a", {'a', '-', '-', 'a'}, 4},
        {"Contiguous", 0, "a--a", {'a', 301, 'a'}, 3},
        {"Removed", 1, "x-a-", {'-', '-'}, 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        json_t *vocab = json_object();
        for (int b = 33; b < 127; b++) {
            char s[2] = {(char)b, 0};
            json_object_set_new(vocab, s, json_integer(b));
        }
        json_object_set_new(vocab, "-a", json_integer(300));
        json_object_set_new(vocab, "--", json_integer(301));
        json_t *step = json_pack("{s:s, s:{s:s}, s:s, s:b}", "type", "Split", "pattern",
                                 "String", "-", "behavior", cases[i].behavior, "invert",
                                 cases[i].invert);
        json_t *pre = json_pack("{s:s, s:[o,o]}", "type", "Sequence", "pretokenizers", step,
                                pd_tok_bytelevel_step(0, 0));
        json_t *doc = tok_doc(vocab, json_pack("[s,s]", "- a", "- -"), pre, NULL);
        struct pd_tok *t = load_json(doc);
        json_decref(doc);
        int32_t *ids;
        size_t n;
        encode_ok(t, cases[i].text, strlen(cases[i].text), &ids, &n);
        cr_assert_eq(n, cases[i].n, "%s: %zu ids", cases[i].behavior, n);
        for (size_t k = 0; k < n; k++)
            cr_assert_eq(ids[k], cases[i].want[k], "%s: id %zu", cases[i].behavior, k);
        free(ids);
        pd_tok_free(t);
    }
}

/* ---- the real pre-tokenizers on a varied text: the ids of the backtracking matcher ---------- */

/* FNV-1a over the ids (as 4 little-endian bytes each). */
static uint64_t ids_hash(const int32_t *ids, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        for (int k = 0; k < 4; k++)
            h = (h ^ (((uint32_t)ids[i] >> (8 * k)) & 0xFF)) * 0x100000001b3ull;
    }
    return h;
}

static uint64_t text_hash(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

Test(tokenizer, real_pretokenizers_keep_their_ids)
{
    /* The trained tokenizer of the corpus under the GPT-2, cl100k and DeepSeek-V3
     * pre-tokenizers, encoding the corpus plus invalid bytes. The hashes and counts were taken
     * from the backtracking matcher that preceded PCRE2 (commit de953bc): the same text gives
     * the same ids, and training (which splits with the cl100k-style pattern) the same file. */
    static const struct { const char *name; uint64_t hash; size_t n; } want[] = {
        {"gpt2", 0x60f92acd6f1216b7ull, 1526},
        {"cl100k", 0x299ef7c5df711855ull, 1426},
        {"deepseek-v3", 0xbf9335582bea353eull, 1448},
    };
    const uint64_t want_json = 0x74cb55077d821df4ull;
    static const char bad[] = " a\xff\xfe" "b c\xe4\xb8 x\xc0\xaf\xed\xa0\x80y\x80";
    char *text = malloc(sizeof pd_tok_corpus + sizeof bad);
    cr_assert_not_null(text);
    size_t len = sizeof pd_tok_corpus - 1;
    memcpy(text, pd_tok_corpus, len);
    memcpy(text + len, bad, sizeof bad - 1);
    len += sizeof bad - 1;
    char *json;
    pd_err e = {0};
    cr_assert_eq(pd_tok_train(pd_tok_corpus, sizeof pd_tok_corpus - 1, 1000, ds_special, 2,
                              &json, &e), 0, "%s", e.msg);
    uint64_t jh = text_hash(json);
    json_error_t je;
    json_t *doc = json_loads(json, 0, &je);
    free(json);
    cr_assert_not_null(doc);
    json_t *pre[3] = {
        pd_tok_bytelevel_step(0, 1),
        json_pack("{s:s, s:[o,o]}", "type", "Sequence", "pretokenizers", pd_tok_split_step(cl100k_re),
                  pd_tok_bytelevel_step(0, 0)),
        json_pack("{s:s, s:[o,o,o,o]}", "type", "Sequence", "pretokenizers",
                  pd_tok_split_step(ds_num_re), pd_tok_split_step(ds_cjk_re), pd_tok_split_step(ds_main_re),
                  pd_tok_bytelevel_step(0, 0)),
    };
    cr_assert_eq(jh, want_json, "the trained tokenizer.json differs: hash 0x%016llx",
                 (unsigned long long)jh);
    for (int i = 0; i < 3; i++) {
        json_object_set_new(doc, "pre_tokenizer", pre[i]);
        struct pd_tok *t = load_json(doc);
        int32_t *ids;
        size_t n, ol;
        char *out;
        encode_ok(t, text, len, &ids, &n);
        uint64_t h = ids_hash(ids, n);
        cr_assert(h == want[i].hash && n == want[i].n, "%s: %zu ids, hash 0x%016llx: the ids "
                  "differ from the backtracking matcher's", want[i].name, n,
                  (unsigned long long)h);
        cr_assert_eq(pd_tok_decode(t, ids, n, &out, &ol), 0);
        cr_assert(ol == len && !memcmp(out, text, len), "%s: decode(encode(text)) != text",
                  want[i].name);
        free(out);
        free(ids);
        pd_tok_free(t);
    }
    json_decref(doc);
    free(text);
}

/* ---- catastrophic backtracking: bounded time, exact pieces or a clear error --------------- */

/* A tokenizer.json whose vocab is the 256 bytes (id = byte + 3) and whose pre_tokenizer is one
 * Split step with `re`, then ByteLevel. */
static json_t *bytes_doc(const char *re)
{
    json_t *vocab = byte_vocab();
    json_t *pre = json_pack("{s:s, s:[o,o]}", "type", "Sequence", "pretokenizers",
                            pd_tok_split_step(re), pd_tok_bytelevel_step(0, 0));
    return tok_doc(vocab, json_array(), pre, NULL);
}

Test(tokenizer, catastrophic_patterns_finish, .timeout = 20)
{
    /* Each takes exponential time to backtrack on a run of 'a's with no match; the old matcher
     * ran for ever on them. Now each gives its exact pieces or an error naming the file, the
     * field and the limit, in well under a second. */
    char text[80];
    memset(text, 'a', 60);
    strcpy(text + 60, "!");
    static const struct { const char *re; size_t cut; } found[] = {
        {"(?:a|aa){0,500}c", 0},               /* no match: one piece */
        {"(?:a|a){1,60}b", 0},
        {"(?:(?:a|b|ab){0,20}){0,20}c", 0},
        {"(?:a?){40}a{40}", 60},               /* a^60 then "!" */
    };
    for (size_t i = 0; i < sizeof found / sizeof *found; i++) {
        size_t *b, n;
        pd_err e = {0};
        cr_assert_eq(pd_tok_regex_split(found[i].re, "test", text, 61, &b, &n, &e), 0, "/%s/: %s",
                     found[i].re, e.msg);
        size_t want = found[i].cut ? 2 : 1;
        cr_assert_eq(n, want, "/%s/: %zu pieces", found[i].re, n);
        if (found[i].cut)
            cr_assert_eq(b[1], found[i].cut, "/%s/: first piece ends at %zu", found[i].re, b[1]);
        free(b);
    }
    static const char *const limited[] = {"(?:a||){40}\\z", "(?:\\p{L}|\\w|a){1,40}\\z"};
    for (size_t i = 0; i < sizeof limited / sizeof *limited; i++) {
        json_t *doc = bytes_doc(limited[i]);
        struct pd_tok *t = load_json(doc);
        json_decref(doc);
        int32_t *ids = NULL;
        size_t n = 0;
        pd_err e = {0};
        int rc = pd_tok_encode(t, text, 61, &ids, &n, &e);
        cr_assert_lt(rc, 0, "/%s/ encoded", limited[i]);
        cr_assert_null(ids);
        cr_assert_not_null(strstr(e.msg, dir), "no file named: %s", e.msg);
        cr_assert_not_null(strstr(e.msg, "field \"pre_tokenizer.pretokenizers[0].pattern.Regex\""),
                           "no field named: %s", e.msg);
        cr_assert_not_null(strstr(e.msg, "limit ("), "no limit named: %s", e.msg);
        pd_tok_free(t);
    }
    /* the unbounded classics are refused when the file is read */
    json_t *doc = bytes_doc("(a+)+$");
    expect_bad(doc, "a group may only be repeated a bounded number of times");
    doc = bytes_doc("(a|aa)*c");
    expect_bad(doc, "a group may only be repeated a bounded number of times");
}

Test(tokenizer, long_runs_stay_within_the_limits, .timeout = 60)
{
    /* 3 MB runs of one kind of character then an 'x', where the real patterns take their
     * longest matches and give back whole runs (cl100k's \s*[\r\n]+ on spaces): no limit is
     * hit and the pieces are what the patterns say. */
    size_t len = 3000000;
    char *s = malloc(len + 2);
    cr_assert_not_null(s);
    static const struct { const char *re; char c; size_t pieces; } cases[] = {
        {gpt2_re, 'a', 1}, {gpt2_re, ' ', 2}, {gpt2_re, '1', 2}, {gpt2_re, '!', 2},
        {cl100k_re, 'a', 1}, {cl100k_re, ' ', 2}, {cl100k_re, '1', 1000001}, {cl100k_re, '\n', 2},
        {ds_main_re, 'a', 1}, {ds_main_re, ' ', 2}, {ds_main_re, '!', 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        memset(s, cases[i].c, len);
        s[len] = 'x';   /* so a space run ends in a lookahead that fails once */
        size_t *b, n;
        pd_err e = {0};
        cr_assert_eq(pd_tok_regex_split(cases[i].re, "test", s, len + 1, &b, &n, &e), 0, "%s",
                     e.msg);
        cr_assert_eq(n, cases[i].pieces, "/%s/ on 3 MB of 0x%02x: %zu pieces", cases[i].re,
                     cases[i].c, n);
        free(b);
    }
    free(s);
}

Test(tokenizer, json_syntax_errors_are_one_line)
{
    /* found by fuzz_tokenizer: jansson quotes the text near the error, a newline included */
    struct pd_tok *t = NULL;
    pd_err e = {0};
    cr_assert_eq(pd_tok_parse("{\"a\": \"\\\n\"}", "t.json", &t, &e), PD_EFORMAT);
    cr_assert_null(t);
    cr_assert(!strncmp(e.msg, "t.json", 6) && !strchr(e.msg, '\n'), "%s", e.msg);
}

Test(tokenizer, a_space_run_longer_than_the_base_limit, .timeout = 60)
{
    /* cl100k's \s*[\r\n]+ takes a whole run of spaces and gives it back one by one: 12 million
     * steps on 12 MB of spaces, past the fixed part of the match limit (10^7); the limit grows
     * with the text searched, so a long legitimate text never hits it */
    size_t len = 12000000;
    char *s = malloc(len + 1);
    cr_assert_not_null(s);
    memset(s, ' ', len);
    s[len] = 'x';
    size_t *b, n;
    pd_err e = {0};
    cr_assert_eq(pd_tok_regex_split(cl100k_re, "test", s, len + 1, &b, &n, &e), 0, "%s", e.msg);
    cr_assert(n == 2 && b[1] == len - 1, "%zu pieces", n);
    free(b);
    free(s);
}

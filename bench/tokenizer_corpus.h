/* A varied text for the tokenizer's checks and benchmark: English prose and contractions,
 * numbers, Chinese, Japanese, Korean and other scripts, combining marks, emoji (ZWJ sequences,
 * flags, keycaps), symbols, code, JSON, HTML, tab and space runs, blank lines, CRLF, no-break and
 * zero-width spaces. UTF-8 throughout (invalid bytes are tested separately). */
#ifndef PD_BENCH_TOKENIZER_CORPUS_H
#define PD_BENCH_TOKENIZER_CORPUS_H

#include <jansson.h>

static const char pd_tok_corpus[] =
    "The quick brown fox jumps over the lazy dog. It's 3:45 p.m.; they're late, aren't they? I'L"
    "L SAY IT'S FINE.\n"
    "Mixture-of-experts models route each token to 8 of 256 experts; DeepSeek-V3 has 671B parame"
    "ters (37B active).\n"
    "Prices rose 12.5% in 2024, from $1,234.56 to $1,388.88 — roughly ¥9,870 or €1 280,00. "
    "Call +1 (555) 010-9999.\n"
    "Pi is 3.14159265358979323846264338327950288419716939937510; e is 2.718281828459045; 1e-9 s "
    "= 1 ns; 0x7fffffff.\n"
    "Ⅻ₂½ ①②③ ١٢٣٤٥ ४५६ 一二三 〇 ０１２３４５６７８９\n"
    "\n"
    "大规模语言模型通过预测下一个词元来生成文本。今天天气很好，我们"
    "去公园散步吧！“你好，世界”——这是第一个程序。\n"
    "日本語のテキストも含まれます：ひらがな、カタカナ、漢字。東京タ"
    "ワーは３３３メートルです。\n"
    "한국어 문장도 있습니다. 안녕하세요, 세계! Русский текст: Съе"
    "шь же ещё этих мягких французских булок.\n"
    "العربية: مرحبا بالعالم. עברית: שלום עולם. हिन्दी"
    ": नमस्ते दुनिया। ภาษาไทย: สวัสดีชาว"
    "โลก Ελληνικά: Γειά σου Κόσμε.\n"
    "Café, naïve, résumé, coöperate, Zürich, façade, São Paulo, Ærøskøbing, Łódź, "
    "İstanbul, straße, ǅemal, ﬁne.\n"
    "Combining: é ä ñ — and Vietnamese: Tiếng Việt có dấu: Hà Nội, Thành phố"
    " Hồ Chí Minh.\n"
    "\n"
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️ ✨🔥💯 "
    "🧑🏻‍💻 ☕️ 1️⃣ #️⃣ 🏳️‍🌈 — symbols © ® ™ ° ± × ÷ →"
    " ⇒ ∀∃∈∑∫√∞ ≠ ≤ ≥ ♠♣♥♦ ★☆ ♪♫.\n"
    "\n"
    "```python\n"
    "def fib(n: int) -> int:\n"
    "    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    "    a, b = 0, 1\n"
    "    for _ in range(n):\n"
    "        a, b = b, a + b\n"
    "    return a\n"
    "\n"
    "print([fib(i) for i in range(10)])  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]\n"
    "```\n"
    "\n"
    "```c\n"
    "static int grow(void **p, size_t *cap, size_t need, size_t elem)\n"
    "{\n"
    "\tif (need <= *cap)\n"
    "\t\treturn 0;\n"
    "\twhile (c < need && c <= SIZE_MAX / 2) c *= 2;   // doubling\n"
    "\treturn x->y[i] != NULL && !(a & 0xFF) ? -EINVAL : a << 3 >> 1;\n"
    "}\n"
    "```\n"
    "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"<|endoftext|>\": 0}}, \"ids\": [1, 22, 333, 4"
    "444], \"ok\": true, \"pi\": 3.14}\n"
    "<html><body class=\"main\"><p>Hello&nbsp;world&amp;more</p><!-- comment --></body></html>\n"
    "SELECT name, COUNT(*) AS n FROM users WHERE age >= 18 GROUP BY name HAVING n > 1 ORDER BY n"
    " DESC;\n"
    "https://example.com/path/to/file.html?query=a+b&x=1#frag  user@example.org  C:\\Program Fil"
    "es\\app.exe\n"
    "\ttab\tseparated\tvalues\t1\t2\t3\n"
    "trailing spaces here     \n"
    "   leading spaces, then     many      inner     spaces.\n"
    "\n"
    "\n"
    "\n"
    "three blank lines above; CRLF line endings next:\n"
    "line one\r\n"
    "line two\r\n"
    "no-break spaces: a  b  c; ideographic　space; thin space; zero-width​joiner‌test; soft"
    "­hyphen.\n"
    "'''quotes''' \"double\" ‘single’ “curly” «guillemets» „low“ ‹›  … ... —"
    "— –– -- ___ *** ### !!! ??? ¿¡\n";

/* The Split patterns of the pre-tokenizers in use, as their tokenizer.json files have them:
 * GPT-2's (ByteLevel's own), cl100k's, and DeepSeek-V3's three (CR and LF literal). */
#define PD_RE_GPT2 \
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
#define PD_RE_CL100K \
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}|" \
    " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define PD_RE_DS_NUM \
    "\\p{N}{1,3}"
#define PD_RE_DS_CJK \
    "[一-龥\u3040-ゟ゠-ヿ]+"
#define PD_RE_DS_MAIN \
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?" \
    "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"

/* The pre_tokenizer steps of a tokenizer.json built around these patterns: a Split that isolates
 * each match, and ByteLevel. */
static inline json_t *pd_tok_split_step(const char *re)
{
    return json_pack("{s:s, s:{s:s}, s:s, s:b}", "type", "Split", "pattern", "Regex", re,
                     "behavior", "Isolated", "invert", 0);
}

static inline json_t *pd_tok_bytelevel_step(int add_prefix_space, int use_regex)
{
    return json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space",
                     add_prefix_space, "trim_offsets", 1, "use_regex", use_regex);
}

#endif

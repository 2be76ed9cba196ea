/* A chat's prompt text (model/chat.h): DeepSeek-V4's encoding in chat mode, exactly as
 * encoding_dsv4.py's rules give it (written out here by hand from those rules), DeepSeek-V3's
 * template (checked against Jinja itself in CI: tests/tokenizer/chat.mjs), and which format a
 * checkpoint directory gets. */
#include <criterion/criterion.h>
#include <sys/stat.h>
#include <unistd.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/chat.h"

#define B "<｜begin▁of▁sentence｜>"
#define E "<｜end▁of▁sentence｜>"
#define U "<｜User｜>"
#define A "<｜Assistant｜>"

static void expect(enum pd_chat_format f, const struct pd_chat_msg *m, size_t n, const char *want)
{
    char *out;
    size_t len;
    pd_err e = {0};
    cr_assert_eq(pd_chat_render(f, m, n, 1, &out, &len, &e), 0, "%s", e.msg);
    cr_expect_str_eq(out, want);
    cr_expect_eq(len, strlen(want));
    free(out);
    /* without BOS: the same text minus its first token's text */
    cr_assert_eq(pd_chat_render(f, m, n, 0, &out, &len, &e), 0, "%s", e.msg);
    cr_expect_str_eq(out, want + strlen(B));
    free(out);
}

/* messages written {role, content}: the reasoning, last, left NULL */
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#define M(...) ((const struct pd_chat_msg[]){__VA_ARGS__})
#define N(...) (sizeof((const struct pd_chat_msg[]){__VA_ARGS__}) / sizeof(struct pd_chat_msg))
#define CHECK(f, want, ...) expect(f, M(__VA_ARGS__), N(__VA_ARGS__), want)

Test(chat, deepseek_v4_chat_mode)
{
    enum pd_chat_format f = PD_CHAT_DSV4;
    /* the encoding's README example, in chat mode: the thinking block closed at once */
    CHECK(f, B "You are a helpful assistant." U "What is 2+2?" A "</think>",
          {"system", "You are a helpful assistant."}, {"user", "What is 2+2?"});
    /* multi-turn: an assistant turn ends with EOS and gets no prefix of its own */
    CHECK(f, B U "hi" A "</think>" "hello!" E U "and then?" A "</think>",
          {"user", "hi"}, {"assistant", "hello!"}, {"user", "and then?"});
    /* consecutive user messages are one user turn, joined by a blank line */
    CHECK(f, B "sys" U "one\n\ntwo" A "</think>", {"system", "sys"}, {"user", "one"}, {"user", "two"});
    /* a user followed by a system message gets no generation prefix; the system text stands bare */
    CHECK(f, B U "q" "be brief" U "q2" A "</think>", {"user", "q"}, {"system", "be brief"}, {"user", "q2"});
    /* a last assistant message is closed: nothing is appended after its EOS */
    CHECK(f, B U "q" A "</think>" "a" E, {"user", "q"}, {"assistant", "a"});
    /* empty contents are empty */
    CHECK(f, B U A "</think>", {"user", ""});
}

static void expect_think(enum pd_chat_format f, const struct pd_chat_think *th, const struct pd_chat_msg *m, size_t n,
                         const char *want)
{
    char *out;
    size_t len;
    pd_err e = {0};
    cr_assert_eq(pd_chat_render_think(f, th, m, n, 1, &out, &len, NULL, NULL, &e), 0, "%s", e.msg);
    cr_expect_str_eq(out, want);
    cr_expect_eq(len, strlen(want));
    free(out);
}

#define THINK(th, want, ...) expect_think(PD_CHAT_DSV4, th, M(__VA_ARGS__), N(__VA_ARGS__), want)

/* DeepSeek-V4's thinking mode: the strings encode_messages(thinking_mode="thinking") gives; the
 * multi-turn one is the release's own encoding/tests/test_output_2.txt (its input
 * test_input_2.json without the reasoning_content fields, which pdmoe does not take: the dropped
 * one changes nothing, the kept one is empty here). */
Test(chat, deepseek_v4_thinking_mode)
{
    const struct pd_chat_think on = {1, 1, 0}, high = {1, 1, 0}, max = {1, 1, 1}, keep = {1, 0, 0},
                               off = {0, 1, 1};
    THINK(&on, B "You are a helpful assistant." U "What is 2+2?" A "<think>",
          {"system", "You are a helpful assistant."}, {"user", "What is 2+2?"});
    /* test_output_2.txt: the earlier turn's reasoning dropped ("</think>" as in chat mode), the
     * last user turn opens the block, the assistant message after it closes it */
    THINK(&on,
          B "You are a helpful assistant." U "Hello" A "</think>" "Hi there! How can I help you?" E U
            "What is the capital of France?" A "<think>" "</think>" "The capital of France is Paris." E,
          {"system", "You are a helpful assistant."}, {"user", "Hello"},
          {"assistant", "Hi there! How can I help you?"}, {"user", "What is the capital of France?"},
          {"assistant", "The capital of France is Paris."});
    THINK(&on, B U "hi" A "</think>" "hello!" E U "and then?" A "<think>", {"user", "hi"}, {"assistant", "hello!"},
          {"user", "and then?"});
    /* consecutive user messages are one turn, the last one */
    THINK(&on, B "sys" U "one\n\ntwo" A "<think>", {"system", "sys"}, {"user", "one"}, {"user", "two"});
    /* "high" renders as no effort at all; "max" puts its three sentences first, after the BOS */
    THINK(&high, B U "q" A "<think>", {"user", "q"});
    THINK(&max,
          B "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
            "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
            "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
            "adversarial scenarios.\n"
            "Explicitly write out your entire deliberation process, documenting every intermediate step, "
            "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
            "unchecked.\n\n" "sys" U "q" A "<think>",
          {"system", "sys"}, {"user", "q"});
    /* drop_thinking false: every turn keeps its (empty) thinking block */
    THINK(&keep, B U "hi" A "<think>" "</think>" "hello!" E U "and then?" A "<think>", {"user", "hi"},
          {"assistant", "hello!"}, {"user", "and then?"});
    /* thinking off (effort and all) and no options at all: chat mode, byte for byte */
    THINK(&off, B U "hi" A "</think>" "hello!" E U "and then?" A "</think>", {"user", "hi"}, {"assistant", "hello!"},
          {"user", "and then?"});
    THINK(NULL, B U "hi" A "</think>" "hello!" E U "and then?" A "</think>", {"user", "hi"}, {"assistant", "hello!"},
          {"user", "and then?"});
    /* V3's template has no thinking mode: refused by name */
    char *out;
    size_t len;
    pd_err e = {0};
    cr_expect_eq(pd_chat_render_think(PD_CHAT_DSV3, &on, M({"user", "q"}), 1, 1, &out, &len, NULL, NULL, &e),
                 PD_EINVAL);
    cr_expect(strstr(e.msg, "thinking mode"), "%s", e.msg);
}

/* The answer's split (vLLM's BaseThinkingReasoningParser.extract_reasoning): reasoning before the
 * first "</think>", content after; no "</think>": all reasoning; a "<think>" the model wrote is
 * skipped. And what a stream holds back: a tail that may begin "</think>". */
Test(chat, a_thinking_answer_splits_at_think_end)
{
    size_t ro, rl, co;
    const char *t = "step 1, step 2</think>The answer is 4.";
    cr_expect_eq(pd_chat_think_split(t, strlen(t), &ro, &rl, &co), 1);
    cr_expect(ro == 0 && rl == 14 && !strcmp(t + co, "The answer is 4."));
    t = "still thinking when max_tokens came";
    cr_expect_eq(pd_chat_think_split(t, strlen(t), &ro, &rl, &co), 0);
    cr_expect(ro == 0 && rl == strlen(t) && co == strlen(t));
    t = "</think>";
    cr_expect_eq(pd_chat_think_split(t, strlen(t), &ro, &rl, &co), 1);
    cr_expect(rl == 0 && co == strlen(t), "nothing after: content null");
    t = "<think>r</think>c</think>d";
    cr_expect_eq(pd_chat_think_split(t, strlen(t), &ro, &rl, &co), 1);
    cr_expect(ro == 7 && rl == 1 && !strcmp(t + co, "c</think>d"));
    cr_expect_eq(pd_chat_think_partial("abc</thi", 8), 5);
    cr_expect_eq(pd_chat_think_partial("abc<", 4), 1);
    cr_expect_eq(pd_chat_think_partial("abc", 3), 0);
    cr_expect_eq(pd_chat_think_partial("a</think>", 9), 0, "a whole one is not held: it is split");
}

Test(chat, deepseek_v3_template)
{
    enum pd_chat_format f = PD_CHAT_DSV3;
    /* system messages go first, wherever they are, joined by a blank line */
    CHECK(f, B "s1\n\ns2" U "q" A "a" E U "q2" A, {"system", "s1"}, {"user", "q"}, {"assistant", "a"},
          {"system", "s2"}, {"user", "q2"});
    CHECK(f, B U "q" A, {"user", "q"});
    /* the generation prompt even after an assistant message (add_generation_prompt) */
    CHECK(f, B U "q" A "a" E A, {"user", "q"}, {"assistant", "a"});
}

Test(chat, other_roles_are_refused_by_message)
{
    char *out;
    size_t len;
    pd_err e = {0};
    struct pd_chat_msg m[2] = {{"user", "q"}, {"tool", "42"}};
    cr_expect_eq(pd_chat_render(PD_CHAT_DSV4, m, 2, 1, &out, &len, &e), PD_EINVAL);
    cr_expect(strstr(e.msg, "messages[1]"), "%s", e.msg);
    m[1] = (struct pd_chat_msg){"assistant", NULL};
    cr_expect_eq(pd_chat_render(PD_CHAT_DSV3, m, 2, 1, &out, &len, &e), PD_EINVAL);
    cr_expect(strstr(e.msg, "messages[1]"), "%s", e.msg);
}

/* The API's messages as JSON -> messages: a content of text parts is their texts joined by "\n"
 * (as vLLM joins them), rendered as that string would be; what pdmoe does not implement (another
 * part type, a field of a part or a message) is refused naming where it is. The messages point
 * into the JSON (*j), which the caller frees after them. */
static int from_json(const char *text, json_t **j, struct pd_chat_msg **m, size_t *n, pd_err *e)
{
    json_error_t je;
    *j = json_loads(text, 0, &je);
    cr_assert_not_null(*j, "%s", je.text);
    return pd_chat_messages(*j, m, n, e);
}

/* OpenAI's "developer" role (its newer name for system instructions, which its API takes as the
 * system message) is the system role: the same prompt bytes and spans, in both formats, where it
 * was refused by name. */
Test(chat, a_developer_message_is_a_system_message)
{
    static const char *const fmt = "[{\"role\":\"%s\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Hi\"},"
                                   "{\"role\":\"assistant\",\"content\":\"Hello.\"},{\"role\":\"%s\",\"content\":\"No.\"},"
                                   "{\"role\":\"user\",\"content\":\"Bye\"}]";
    static const enum pd_chat_format formats[] = {PD_CHAT_DSV4, PD_CHAT_DSV3};
    for (int k = 0; k < 2; k++) {
        char *out[2];
        size_t len[2], n_spans[2];
        struct pd_tok_span *spans[2];
        for (int dev = 0; dev < 2; dev++) {
            char text[512];
            const char *role = dev ? "developer" : "system";
            snprintf(text, sizeof text, fmt, role, role);
            struct pd_chat_msg *m;
            size_t n;
            pd_err e = {0};
            json_t *j;
            cr_assert_eq(from_json(text, &j, &m, &n, &e), 0, "%s: %s", role, e.msg);
            cr_assert_eq(pd_chat_render_spans(formats[k], m, n, 1, &out[dev], &len[dev], &spans[dev], &n_spans[dev], &e), 0,
                         "%s: %s", role, e.msg);
            pd_chat_messages_free(m, n);
            json_decref(j);
        }
        cr_expect_eq(len[1], len[0]);
        cr_expect_str_eq(out[1], out[0], "%s", pd_chat_format_name(formats[k]));
        cr_assert_eq(n_spans[1], n_spans[0]);
        cr_expect_eq(memcmp(spans[1], spans[0], n_spans[0] * sizeof *spans[0]), 0, "the contents' spans differ");
        cr_expect(strstr(out[0], "Be brief."), "%s", out[0]);
        for (int dev = 0; dev < 2; dev++) {
            free(out[dev]);
            free(spans[dev]);
        }
    }
}

/* An answer's message sent back in the next request, as a client appends it (the OpenAI SDK's
 * message dumped whole: refusal, tool_calls, function_call, audio null, annotations empty, and
 * vLLM's "reasoning"): taken, its reasoning rendered only where the encoding keeps it (after the
 * last user turn, or every turn with drop_thinking false), dropped in chat mode and in earlier
 * turns; "reasoning_content" (DeepSeek's name) the same. */
Test(chat, an_answer_sent_back_with_its_reasoning_is_taken)
{
    struct pd_chat_msg *m;
    size_t n;
    pd_err e = {0};
    json_t *j;
    cr_assert_eq(from_json("[{\"role\":\"user\",\"content\":\"hi\"},"
                           "{\"role\":\"assistant\",\"content\":\"hello!\",\"reasoning\":\"greet back\",\"refusal\":null,"
                           "\"tool_calls\":null,\"function_call\":null,\"audio\":null,\"annotations\":[],\"name\":null},"
                           "{\"role\":\"user\",\"content\":\"and then?\"},"
                           "{\"role\":\"assistant\",\"content\":\"then this\",\"reasoning_content\":\"think more\","
                           "\"tool_calls\":[]}]",
                           &j, &m, &n, &e),
                 0, "%s", e.msg);
    cr_assert_eq(n, 4);
    cr_expect_str_eq(m[1].reasoning, "greet back");
    cr_expect_str_eq(m[3].reasoning, "think more");
    cr_expect_null(m[0].reasoning);
    const struct pd_chat_think on = {1, 1, 0}, keep = {1, 0, 0};
    expect_think(PD_CHAT_DSV4, &on, m, n,
                 B U "hi" A "</think>" "hello!" E U "and then?" A "<think>" "think more" "</think>" "then this" E);
    expect_think(PD_CHAT_DSV4, &keep, m, n,
                 B U "hi" A "<think>" "greet back" "</think>" "hello!" E U "and then?" A "<think>" "think more"
                 "</think>" "then this" E);
    expect_think(PD_CHAT_DSV4, NULL, m, n, B U "hi" A "</think>" "hello!" E U "and then?" A "</think>" "then this" E);
    /* the reasoning is a content: a marker's text in it is text (its bytes are a span) */
    char *out;
    size_t len, n_spans;
    struct pd_tok_span *spans;
    cr_assert_eq(pd_chat_render_think(PD_CHAT_DSV4, &keep, m, n, 1, &out, &len, &spans, &n_spans, &e), 0, "%s", e.msg);
    const char *at = strstr(out, "greet back");
    int covered = 0;
    for (size_t i = 0; i < n_spans; i++)
        covered |= spans[i].off <= (size_t)(at - out) && spans[i].off + spans[i].len >= (size_t)(at - out) + 10;
    cr_expect(covered, "the reasoning's bytes are not a content span");
    free(out);
    free(spans);
    pd_chat_messages_free(m, n);
    json_decref(j);
}

Test(chat, text_parts_are_joined_and_the_rest_refused_by_place)
{
    struct pd_chat_msg *m;
    size_t n;
    pd_err e = {0};
    json_t *j;
    cr_assert_eq(from_json("[{\"role\":\"system\",\"content\":[{\"type\":\"text\",\"text\":\"s\"}]},"
                           "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"one\"},"
                           "{\"type\":\"text\",\"text\":\"\"},{\"text\":\"two\",\"type\":\"text\"}]},"
                           "{\"role\":\"assistant\",\"content\":[]}]",
                           &j, &m, &n, &e),
                 0, "%s", e.msg);
    cr_assert_eq(n, 3);
    cr_expect_str_eq(m[0].content, "s");
    cr_expect_str_eq(m[1].content, "one\n\ntwo");
    cr_expect_str_eq(m[2].content, "");
    char *out;
    size_t len;
    cr_assert_eq(pd_chat_render(PD_CHAT_DSV4, m, n, 1, &out, &len, &e), 0, "%s", e.msg);
    cr_expect_str_eq(out, B "s" U "one\n\ntwo" A "</think>" E);
    free(out);
    pd_chat_messages_free(m, n);
    json_decref(j);

    static const struct {
        const char *json, *want;
    } bad[] = {
        {"[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{\"url\":\"x\"}}]}]",
         "\"messages[0].content[0]\": part type \"image_url\" is not supported (text parts only)"},
        {"[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
         "{\"type\":\"text\"}]}]",
         "\"messages[1].content[1]\": a text part needs a string \"text\""},
        {"[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\",\"cache_control\":{}}]}]",
         "\"messages[0].content[0]\": \"cache_control\" is not supported"},
        {"[{\"role\":\"user\",\"content\":[\"a\"]}]", "\"messages[0].content[0]\" must be an object with a \"type\""},
        {"[{\"role\":\"user\",\"content\":\"q\",\"name\":\"bob\"}]",
         "\"messages[0]\": \"name\" is not supported (a message has \"role\" and \"content\", an assistant's its "
         "\"reasoning\")"},
        {"[{\"role\":\"assistant\",\"content\":\"a\",\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\"}]}]",
         "\"messages[0]\": \"tool_calls\" is not supported (a message has \"role\" and \"content\", an assistant's its "
         "\"reasoning\")"},
        {"[{\"role\":\"user\",\"content\":\"q\",\"reasoning\":\"r\"}]",
         "\"messages[0]\": \"reasoning\" is an assistant message's"},
        {"[{\"role\":\"assistant\",\"content\":\"a\",\"reasoning_content\":7}]",
         "\"messages[0].reasoning_content\" must be a string or null"},
        {"[{\"role\":\"assistant\",\"content\":\"a\",\"reasoning\":\"x\",\"reasoning_content\":\"y\"}]",
         "\"messages[0]\": \"reasoning\" and \"reasoning_content\" differ (send one)"},
        {"[\"q\"]", "\"messages[0]\" must be an object with \"role\" and \"content\""},
        {"[]", "\"messages\" must be a non-empty array"},
        {"{}", "\"messages\" must be a non-empty array"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        e = (pd_err){0};
        cr_expect_eq(from_json(bad[i].json, &j, &m, &n, &e), PD_EINVAL, "%s", bad[i].json);
        cr_expect_str_eq(e.msg, bad[i].want);
        cr_expect_null(m);
        json_decref(j);
    }
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert(f);
    fputs(text, f);
    fclose(f);
}

Test(chat, a_checkpoints_format_and_an_unknown_template_refused_by_file_and_field)
{
    char dir[] = "/tmp/pdmoe-chat-XXXXXX", path[128];
    cr_assert(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    enum pd_chat_format f = PD_CHAT_DSV3;
    pd_err e = {0};
    /* no tokenizer_config.json, or one without a chat_template (V4's): V4's encoding */
    cr_expect_eq(pd_chat_format_of(dir, &f, &e), 0, "%s", e.msg);
    cr_expect_eq(f, PD_CHAT_DSV4);
    write_file(path, "{\"add_bos_token\": false, \"tokenizer_class\": \"PreTrainedTokenizerFast\"}");
    f = PD_CHAT_DSV3;
    cr_expect_eq(pd_chat_format_of(dir, &f, &e), 0, "%s", e.msg);
    cr_expect_eq(f, PD_CHAT_DSV4);
    /* a template pdmoe does not know (here ChatML's): refused, never guessed */
    write_file(path, "{\"chat_template\": \"{% for m in messages %}<|im_start|>{{ m.role }}\\n{{ m.content }}"
                     "<|im_end|>\\n{% endfor %}\"}");
    cr_expect_eq(pd_chat_format_of(dir, &f, &e), PD_EFORMAT);
    cr_expect(strstr(e.msg, path) && strstr(e.msg, "\"chat_template\""), "%s", e.msg);
    /* a broken file is named */
    write_file(path, "{\"chat_template\": ");
    cr_expect_eq(pd_chat_format_of(dir, &f, &e), PD_EFORMAT);
    cr_expect(strstr(e.msg, path), "%s", e.msg);
    unlink(path);
    rmdir(dir);
}

/* What a half-downloaded Hugging Face snapshot leaves (a link to a blob that never came), a link
 * loop, a template saved as chat_template.jinja (transformers' place for it since 4.47) and a
 * directory that is not there: each named, never V4's encoding assumed in silence. */
Test(chat, a_template_that_cannot_be_read_is_named_not_guessed)
{
    char dir[] = "/tmp/pdmoe-chat-XXXXXX", path[128], jinja[128];
    cr_assert(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    snprintf(jinja, sizeof jinja, "%s/chat_template.jinja", dir);
    enum pd_chat_format f;
    pd_err e = {0};
    cr_assert_eq(symlink("/nonexistent/blobs/1234", path), 0);
    cr_expect_eq(pd_chat_format_of(dir, &f, &e), PD_EIO);
    cr_expect(strstr(e.msg, path) && strstr(e.msg, "a symbolic link to nothing"), "%s", e.msg);
    unlink(path);
    cr_assert_eq(symlink(path, path), 0);   /* a loop */
    cr_expect_eq(pd_chat_format_of(dir, &f, &e), PD_EIO);
    cr_expect(strstr(e.msg, path), "%s", e.msg);
    unlink(path);
    write_file(jinja, "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}");
    cr_expect_eq(pd_chat_format_of(dir, &f, &e), PD_EFORMAT);
    cr_expect(strstr(e.msg, jinja) && strstr(e.msg, "not a template pdmoe renders"), "%s", e.msg);
    unlink(jinja);
    cr_assert_eq(mkfifo(jinja, 0600), 0);   /* never opened for a blocking read */
    cr_expect_eq(pd_chat_format_of(dir, &f, &e), PD_EIO);
    cr_expect(strstr(e.msg, jinja) && strstr(e.msg, "a FIFO, not a regular file"), "%s", e.msg);
    unlink(jinja);
    write_file(path, "{\"chat_template\": [{\"name\": \"default\", \"template\": \"x\"}]}");
    cr_expect_eq(pd_chat_format_of(dir, &f, &e), PD_EFORMAT);
    cr_expect(strstr(e.msg, path) && strstr(e.msg, "list of named templates"), "%s", e.msg);
    unlink(path);
    rmdir(dir);
    cr_expect_eq(pd_chat_format_of(dir, &f, &e), PD_EIO);
    cr_expect(strstr(e.msg, dir), "%s", e.msg);
}


/* A NUL inside a content (JSON's \u0000) cut the rendered prompt there, silently: refused by place. */
Test(chat, a_nul_in_a_content_is_refused_by_place)
{
    json_error_t je;
    json_t *j = json_loads("[{\"role\":\"user\",\"content\":\"a\\u0000b\"}]", JSON_ALLOW_NUL, &je);
    cr_assert_not_null(j, "%s", je.text);
    struct pd_chat_msg *m;
    size_t n;
    pd_err e = {0};
    cr_expect_eq(pd_chat_messages(j, &m, &n, &e), PD_EINVAL);
    cr_expect(strstr(e.msg, "\"messages[0].content\" holds a NUL character"), "%s", e.msg);
    json_decref(j);
    j = json_loads("[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"x\"},"
                   "{\"type\":\"text\",\"text\":\"a\\u0000b\"}]}]", JSON_ALLOW_NUL, &je);
    cr_assert_not_null(j, "%s", je.text);
    cr_expect_eq(pd_chat_messages(j, &m, &n, &e), PD_EINVAL);
    cr_expect(strstr(e.msg, "\"messages[0].content[1]\": holds a NUL character"), "%s", e.msg);
    json_decref(j);
}

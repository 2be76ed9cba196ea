/* A chat's messages as the prompt text a DeepSeek checkpoint expects (the OpenAI chat API's
 * "messages" -> text the tokenizer encodes), in one of the two formats DeepSeek publishes:
 *
 *   PD_CHAT_DSV4: DeepSeek-V4's encoding (encoding/encoding_dsv4.py beside the release; V4's
 *     tokenizer_config.json has no chat_template), in its "chat" mode (no thinking):
 *       BOS, then each message in order: system -> its content; user -> "<｜User｜>" + content
 *       (consecutive user messages are one, their contents joined by "\n\n"); assistant ->
 *       content + EOS; after a user message that is last or followed by an assistant,
 *       "<｜Assistant｜></think>" (the thinking block closed at once).
 *     Thinking mode (struct pd_chat_think; encode_messages(thinking_mode="thinking"), the release's
 *     encoding/tests/test_output_2.txt): the same, except that the last user turn's marker is
 *     "<｜Assistant｜><think>" (the model writes its reasoning, then "</think>", then the answer), and
 *     an assistant message after it is its reasoning + "</think>" + content + EOS. Earlier turns are rendered as in chat mode (drop_thinking, the
 *     default: their reasoning is dropped, "<｜Assistant｜></think>" before each answer); with
 *     drop_thinking false every user turn ends "<｜Assistant｜><think>" and every assistant message
 *     starts with its reasoning and "</think>". An assistant message's reasoning is rendered only
 *     there: in chat mode, and in the turns drop_thinking drops, it is left out. reasoning_effort "max" puts REASONING_EFFORT_MAX (three sentences, see
 *     chat.c) right after the BOS, before the first message; "high" and none render alike.
 *   PD_CHAT_DSV3: DeepSeek-V3's chat_template (its tokenizer_config.json), as Jinja renders it with
 *     add_generation_prompt: BOS, every system message's content (joined by "\n\n") first, then
 *     user -> "<｜User｜>" + content; assistant -> "<｜Assistant｜>" + content + EOS; and
 *     "<｜Assistant｜>" at the end. Recognised only when the checkpoint's template is that one
 *     byte for byte; CI checks the rendering against @huggingface/jinja on the real template
 *     (tests/tokenizer/chat.mjs).
 * Roles are system, user and assistant (OpenAI's "developer" is system: pd_chat_messages), contents strings (text parts joined first:
 * pd_chat_messages); tool calls and tool results are refused (pdmoe does not implement them),
 * and so is thinking mode with PD_CHAT_DSV3 (its template has none). BOS/EOS are
 * "<｜begin▁of▁sentence｜>" / "<｜end▁of▁sentence｜>". */
#ifndef PD_MODEL_CHAT_H
#define PD_MODEL_CHAT_H

#include <jansson.h>
#include <stddef.h>

#include "core/err.h"
#include "model/tokenizer.h"

enum pd_chat_format { PD_CHAT_DSV4, PD_CHAT_DSV3 };

/* Thinking mode (V4 only): thinking, drop_thinking (1 unless asked otherwise), effort_max. A
 * NULL or thinking 0 is chat mode. */
struct pd_chat_think {
    int thinking, drop_thinking, effort_max;
};

/* A reasoning_effort as vLLM takes it for DeepSeek-V4 (vllm-project/vllm 5dff5445
 * vllm/tokenizers/deepseek_v4.py; 000af8f4 for "none"): "max" sets th->effort_max (the encoding's
 * REASONING_EFFORT_MAX text), "none" is chat mode (th->thinking 0), and OpenAI's minimal, low,
 * medium and high render as none does not: as "high", no text. 0, or -1 for any other value. */
int pd_chat_effort(const char *effort, struct pd_chat_think *th);
/* The values pd_chat_effort takes, as an error message lists them. */
#define PD_CHAT_EFFORTS "\"none\", \"minimal\", \"low\", \"medium\", \"high\" or \"max\""

struct pd_chat_msg {
    const char *role;      /* "system", "user" or "assistant" */
    const char *content;
    const char *reasoning; /* an assistant message's "reasoning" (or "reasoning_content"), NULL if none */
};

const char *pd_chat_format_name(enum pd_chat_format f);

/* The format of the checkpoint in dir: DeepSeek-V3's template when dir/tokenizer_config.json's
 * "chat_template" is it; DeepSeek-V4's encoding when there is no chat_template (or no
 * tokenizer_config.json). Any other template is an error naming the file and the field: pdmoe
 * does not run arbitrary Jinja, and would rather refuse than guess. */
int pd_chat_format_of(const char *dir, enum pd_chat_format *f, pd_err *e);

/* The OpenAI chat API's "messages" (a non-empty JSON array) as n messages into *m (malloc'ed;
 * pd_chat_messages_free), pointing into msgs, which must outlive them. Each message is an object
 * of "role" and "content", and an assistant's may carry its "reasoning" (vLLM's answer field) or
 * "reasoning_content" (DeepSeek's and vLLM's older one; a string or null; both given, they must be
 * equal): a client that appends the answer's message to the next request sends it back. Fields an
 * OpenAI client writes out at the value that asks for nothing (refusal, tool_calls, function_call,
 * audio, name: null; tool_calls, annotations: empty) are taken; another field, or one of those with a
 * value (a tool call, a name), is an error naming it, as pdmoe implements none of them. A content is a string, or an array of text parts
 * {"type": "text", "text": "..."} joined by "\n" (as vLLM joins them for a text-only template);
 * another part type (image_url, input_audio, ...) or a part with other fields is an error naming
 * "messages[i].content[j]". A role "developer" (OpenAI's newer name for the system message, which
 * its API takes as one) is read as "system". Roles and missing contents are checked by pd_chat_render. */
int pd_chat_messages(const json_t *msgs, struct pd_chat_msg **m, size_t *n, pd_err *e);
void pd_chat_messages_free(struct pd_chat_msg *m, size_t n);

/* The prompt text of n messages in format f, with the BOS text first when with_bos (the server
 * adds the BOS id itself). Malloc'ed into *out, its length in *len. A message with another role
 * is an error naming "messages[i]". */
int pd_chat_render(enum pd_chat_format f, const struct pd_chat_msg *m, size_t n, int with_bos, char **out,
                   size_t *len, pd_err *e);
/* pd_chat_render, with the messages' contents as byte spans of the text in *spans (malloc'ed,
 * sorted; NULL when there are none), for pd_tok_encode_plain: the template's markers are the only
 * special tokens of a chat's prompt. */
int pd_chat_render_spans(enum pd_chat_format f, const struct pd_chat_msg *m, size_t n, int with_bos, char **out,
                         size_t *len, struct pd_tok_span **spans, size_t *n_spans, pd_err *e);
/* pd_chat_render_spans in thinking mode th (NULL: chat mode); thinking with PD_CHAT_DSV3 is an
 * error naming it (PD_EINVAL). */
int pd_chat_render_think(enum pd_chat_format f, const struct pd_chat_think *th, const struct pd_chat_msg *m,
                         size_t n, int with_bos, char **out, size_t *len, struct pd_tok_span **spans,
                         size_t *n_spans, pd_err *e);

/* A thinking-mode answer split as vLLM's reasoning parser splits it (BaseThinkingReasoningParser.
 * extract_reasoning, vllm-project/vllm 00e9cc9f vllm/reasoning/basic_parsers.py, which V4's
 * parser runs): the text after a "<think>" if it has one; its reasoning is what comes before the
 * first "</think>" after that (*r_off, *r_len), its content what follows (from *c_off); 1 when
 * "</think>" is there, 0 when it is not (max_tokens reached while thinking: all reasoning, no
 * content). */
int pd_chat_think_split(const char *t, size_t len, size_t *r_off, size_t *r_len, size_t *c_off);
/* The bytes at the end of t (len bytes) that may be the start of a "</think>" still to come: what
 * a stream holds back from a reasoning delta. */
size_t pd_chat_think_partial(const char *t, size_t len);

#endif

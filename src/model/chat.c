/* Chat messages -> prompt text (see chat.h for both formats, stated once), and a thinking-mode
 * answer's split into reasoning and content. */
#define _GNU_SOURCE   /* memmem */
#include "model/chat.h"
#include "core/grow.h"
#include "core/file.h"
#include "core/hash.h"
#include "model/jsonf.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>

#define BOS "<｜begin▁of▁sentence｜>"
#define EOS "<｜end▁of▁sentence｜>"
#define USER "<｜User｜>"
#define ASSISTANT "<｜Assistant｜>"
#define THINK_START "<think>"
#define THINK_END "</think>"
/* What reasoning_effort "max" puts before the first message in thinking mode: DeepSeek's
 * REASONING_EFFORT_MAX (encoding/encoding_dsv4.py beside the release; the same text in
 * sgl-project/sglang 00370f27 python/sglang/srt/entrypoints/openai/encoding_dsv4.py, put at
 * "index == 0 and thinking_mode == 'thinking' and reasoning_effort == 'max'" in render_message). */
#define REASONING_EFFORT_MAX                                                                                      \
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"                                            \
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "    \
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "       \
    "scenarios.\n"                                                                                                 \
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "     \
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"

/* DeepSeek-V3's chat_template as its tokenizer_config.json holds it: 2,301 bytes whose 64-bit
 * FNV-1a is this (the template itself is DeepSeek's; pdmoe keeps only its fingerprint). */
#define DSV3_TEMPLATE_LEN 2301
#define DSV3_TEMPLATE_FNV 0xebe3604156dc466aull

const char *pd_chat_format_name(enum pd_chat_format f)
{
    return f == PD_CHAT_DSV3 ? "DeepSeek-V3 chat_template" : "DeepSeek-V4 encoding (chat mode)";
}

/* Whether `path` is there: 0 if it is not (no such name), 1 if it is, else an error naming it: a
 * symbolic link to nothing (what a half-downloaded Hugging Face snapshot leaves) or a loop. */
static int present(const char *path, pd_err *e)
{
    struct stat st;
    if (lstat(path, &st))
        return errno == ENOENT ? 0 : pd_err_set(e, PD_EIO, "%s: %s", path, strerror(errno));
    if (stat(path, &st))
        return pd_err_set(e, PD_EIO, "%s: a symbolic link to %s (%s)", path,
                          errno == ENOENT ? "nothing" : "what cannot be read", strerror(errno));
    return 1;   /* (what is not a regular file, pd_file_read names) */
}

/* The template text (len bytes) found at `where`: DeepSeek-V3's, recognised byte for byte, or an
 * error naming where. */
static int template_known(const char *text, size_t len, const char *where, pd_err *e)
{
    if (len == DSV3_TEMPLATE_LEN && pd_fnv1a64(PD_FNV64_INIT, text, len) == DSV3_TEMPLATE_FNV)
        return 0;
    return pd_err_set(e, PD_EFORMAT,
                      "%s: not a template pdmoe renders (it renders DeepSeek-V3's chat_template, recognised byte "
                      "for byte, and DeepSeek-V4's encoding, used when there is no chat_template); pdmoe does "
                      "not run arbitrary Jinja",
                      where);
}

int pd_chat_format_of(const char *dir, enum pd_chat_format *f, pd_err *e)
{
    char path[4096], where[4200];
    struct stat st;
    *f = PD_CHAT_DSV4;
    if (stat(dir, &st))
        return pd_err_set(e, PD_EIO, "%s: %s", dir, strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return pd_err_set(e, PD_EIO, "%s: not a directory", dir);
    /* Transformers since 4.47 saves the template beside tokenizer_config.json, in
     * chat_template.jinja, and reads it from there first: a template in either is the model's. */
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    int rc = present(path, e);
    if (rc < 0)
        return rc;
    if (rc) {
        size_t len;
        char *text = pd_file_read(path, (size_t)1 << 20, &len, e);
        if (!text)
            return e->code;
        rc = template_known(text, len, path, e);
        free(text);
        if (rc)
            return rc;
        *f = PD_CHAT_DSV3;
    }
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    if ((rc = present(path, e)) <= 0)
        return rc;   /* none: V4's encoding, as V4 releases ship no template */
    json_t *root = pd_json_load_file(path, e);
    if (!root)
        return e->code;
    json_t *t = json_object_get(root, "chat_template");
    rc = 0;
    if (t && !json_is_null(t)) {
        snprintf(where, sizeof where, "%s: field \"chat_template\"", path);
        if (json_is_string(t))
            rc = template_known(json_string_value(t), json_string_length(t), where, e);
        else
            rc = pd_err_set(e, PD_EFORMAT, "%s: a %s, not a template's text", where,
                            json_is_array(t) ? "list of named templates" : "value other than a string");
        if (!rc)
            *f = PD_CHAT_DSV3;
    }
    json_decref(root);
    return rc;
}

struct buf {
    char *p;
    size_t n, cap;
    int oom;
    struct pd_tok_span *span;   /* the contents' bytes, when asked for */
    size_t n_span, cap_span;
    int spans;
};

static void put(struct buf *b, const char *s)
{
    size_t k = strlen(s);
    if (b->oom || PD_GROW(b->p, b->cap, b->n + k + 1)) {
        b->oom = 1;
        return;
    }
    memcpy(b->p + b->n, s, k + 1);
    b->n += k;
}

/* A message's content: put, and its bytes noted as a span (pd_chat_render_spans). */
static void put_content(struct buf *b, const char *s)
{
    size_t at = b->n;
    put(b, s);
    if (b->oom || !b->spans || b->n == at)
        return;
    if (b->n_span && b->span[b->n_span - 1].off + b->span[b->n_span - 1].len == at) {
        b->span[b->n_span - 1].len += b->n - at;   /* (adjacent contents: one span) */
        return;
    }
    if (PD_GROW(b->span, b->cap_span, b->n_span + 1)) {
        b->oom = 1;
        return;
    }
    b->span[b->n_span++] = (struct pd_tok_span){at, b->n - at};
}

static int role_is(const struct pd_chat_msg *m, const char *r)
{
    return !strcmp(m->role, r);
}

/* DeepSeek-V4, chat or thinking mode (chat.h). As encoding_dsv4.py's render_message: a user turn
 * opens the thinking block ("<think>") when thinking and (not drop_thinking or it is the last user
 * turn), else closes it; an assistant message carries its (empty) reasoning and "</think>" when
 * thinking and (not drop_thinking or it follows the last user turn). */
static void render_v4(struct buf *b, const struct pd_chat_think *th, const struct pd_chat_msg *m, size_t n)
{
    const int thinking = th && th->thinking, drop = !th || th->drop_thinking;
    size_t last_user = SIZE_MAX;
    for (size_t i = 0; i < n; i++)
        if (role_is(&m[i], "user"))
            last_user = i;
    if (thinking && th->effort_max && n > 0)
        put(b, REASONING_EFFORT_MAX);
    for (size_t i = 0; i < n; i++) {
        if (role_is(&m[i], "system")) {
            put_content(b, m[i].content);
        } else if (role_is(&m[i], "assistant")) {
            if (thinking && (!drop || (last_user != SIZE_MAX && i > last_user))) {
                if (m[i].reasoning)
                    put_content(b, m[i].reasoning);
                put(b, THINK_END);
            }
            put_content(b, m[i].content);
            put(b, EOS);
        } else {
            put(b, USER);
            put_content(b, m[i].content);
            while (i + 1 < n && role_is(&m[i + 1], "user")) {   /* one user turn, its parts joined */
                put(b, "\n\n");
                put_content(b, m[++i].content);
            }
            if (i + 1 == n || role_is(&m[i + 1], "assistant")) {
                put(b, ASSISTANT);
                put(b, thinking && (!drop || i >= last_user) ? THINK_START : THINK_END);
            }
        }
    }
}

/* DeepSeek-V3's chat_template with add_generation_prompt (chat.h). */
static void render_v3(struct buf *b, const struct pd_chat_msg *m, size_t n)
{
    int first = 1;
    for (size_t i = 0; i < n; i++)
        if (role_is(&m[i], "system")) {
            if (!first)
                put(b, "\n\n");
            put_content(b, m[i].content);
            first = 0;
        }
    for (size_t i = 0; i < n; i++) {
        if (role_is(&m[i], "user")) {
            put(b, USER);
            put_content(b, m[i].content);
        } else if (role_is(&m[i], "assistant")) {
            put(b, ASSISTANT);
            put_content(b, m[i].content);
            put(b, EOS);
        }
    }
    put(b, ASSISTANT);
}

/* A chat's text is rendered as C strings: a NUL inside one would cut the prompt there. */
#define NUL_REFUSED "holds a NUL character (\\u0000), which a chat prompt cannot carry"

/* A content array's text parts joined by "\n" into *owned, m->content pointing at it (see chat.h). */
static int join_parts(const json_t *parts, size_t i, struct pd_chat_msg *m, char **owned, pd_err *e)
{
    size_t len = 0, np = json_array_size(parts);
    for (size_t j = 0; j < np; j++) {
        const json_t *p = json_array_get(parts, j), *v;
        const char *k, *type = json_string_value(json_object_get(p, "type"));
        if (!json_is_object(p) || !type)
            return pd_err_set(e, PD_EINVAL, "\"messages[%zu].content[%zu]\" must be an object with a \"type\"", i, j);
        if (strcmp(type, "text"))
            return pd_err_set(e, PD_EINVAL,
                              "\"messages[%zu].content[%zu]\": part type \"%s\" is not supported (text parts only)", i,
                              j, type);
        json_object_foreach((json_t *)p, k, v)
            if (strcmp(k, "type") && strcmp(k, "text"))
                return pd_err_set(e, PD_EINVAL, "\"messages[%zu].content[%zu]\": \"%s\" is not supported", i, j, k);
        const json_t *text = json_object_get(p, "text");
        if (!json_is_string(text))
            return pd_err_set(e, PD_EINVAL, "\"messages[%zu].content[%zu]\": a text part needs a string \"text\"", i,
                              j);
        if (strlen(json_string_value(text)) != json_string_length(text))
            return pd_err_set(e, PD_EINVAL, "\"messages[%zu].content[%zu]\": %s", i, j, NUL_REFUSED);
        len += json_string_length(text) + (j > 0);
    }
    char *t = malloc(len + 1);
    if (!t)
        return pd_err_set(e, PD_ENOMEM, "out of memory for the chat's prompt");
    size_t at = 0;
    for (size_t j = 0; j < np; j++) {
        const json_t *text = json_object_get(json_array_get(parts, j), "text");
        if (j > 0)
            t[at++] = '\n';
        memcpy(t + at, json_string_value(text), json_string_length(text));
        at += json_string_length(text);
    }
    t[at] = 0;
    *owned = t;
    m->content = t;
    return 0;
}

/* A message's field an OpenAI client writes out at the value that asks for nothing (the SDK's
 * ChatCompletionMessage dumped whole and sent back): null, or an empty list of tool calls or
 * annotations. */
static int asks_nothing(const char *k, const json_t *v)
{
    static const char *const nullable[] = {"refusal", "tool_calls", "function_call", "audio", "name", "annotations",
                                           NULL};
    for (int j = 0; nullable[j]; j++)
        if (!strcmp(k, nullable[j]))
            return json_is_null(v) ||
                   ((!strcmp(k, "tool_calls") || !strcmp(k, "annotations")) && json_is_array(v) && !json_array_size(v));
    return 0;
}

/* An assistant message's reasoning: "reasoning" or "reasoning_content", a string or null (chat.h). */
static int reasoning_of(const json_t *x, size_t i, struct pd_chat_msg *m, pd_err *e)
{
    const json_t *r = json_object_get(x, "reasoning"), *rc = json_object_get(x, "reasoning_content");
    const char *name = r ? "reasoning" : "reasoning_content";
    if (!r)
        r = rc;
    else if (rc && !json_equal((json_t *)r, (json_t *)rc))
        return pd_err_set(e, PD_EINVAL, "\"messages[%zu]\": \"reasoning\" and \"reasoning_content\" differ (send one)",
                          i);
    if (!r || json_is_null(r))
        return 0;
    if (!m->role || strcmp(m->role, "assistant"))
        return pd_err_set(e, PD_EINVAL, "\"messages[%zu]\": \"%s\" is an assistant message's", i, name);
    if (!json_is_string(r))
        return pd_err_set(e, PD_EINVAL, "\"messages[%zu].%s\" must be a string or null", i, name);
    if (strlen(json_string_value(r)) != json_string_length(r))
        return pd_err_set(e, PD_EINVAL, "\"messages[%zu].%s\" %s", i, name, NUL_REFUSED);
    m->reasoning = json_string_value(r);
    return 0;
}

int pd_chat_messages(const json_t *msgs, struct pd_chat_msg **mp, size_t *np, pd_err *e)
{
    *mp = NULL;
    *np = 0;
    const size_t n = json_array_size(msgs);
    if (!json_is_array(msgs) || n == 0)
        return pd_err_set(e, PD_EINVAL, "\"messages\" must be a non-empty array");
    /* the messages, then as many pointers to the contents joined here (pd_chat_messages_free) */
    struct pd_chat_msg *m = calloc(n, sizeof *m + sizeof(char *));
    if (!m)
        return pd_err_set(e, PD_ENOMEM, "out of memory for the chat's prompt");
    char **owned = (char **)(m + n);
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        const json_t *x = json_array_get(msgs, i), *v, *c;
        const char *k;
        if (!json_is_object(x)) {
            rc = pd_err_set(e, PD_EINVAL, "\"messages[%zu]\" must be an object with \"role\" and \"content\"", i);
            break;
        }
        json_object_foreach((json_t *)x, k, v)
            if (strcmp(k, "role") && strcmp(k, "content") && strcmp(k, "reasoning") && strcmp(k, "reasoning_content") &&
                !asks_nothing(k, v)) {
                rc = pd_err_set(e, PD_EINVAL, "\"messages[%zu]\": \"%s\" is not supported (a message has \"role\" "
                                "and \"content\", an assistant's its \"reasoning\")", i, k);
                break;
            }
        m[i].role = json_string_value(json_object_get(x, "role"));
        /* OpenAI's newer name for the system message (its API takes it as one, for every model) */
        if (m[i].role && !strcmp(m[i].role, "developer"))
            m[i].role = "system";
        if (!rc)
            rc = reasoning_of(x, i, &m[i], e);
        c = json_object_get(x, "content");
        if (!rc && json_is_array(c))
            rc = join_parts(c, i, &m[i], &owned[i], e);
        else
            m[i].content = json_string_value(c);
        if (!rc && json_is_string(c) && strlen(m[i].content) != json_string_length(c))
            rc = pd_err_set(e, PD_EINVAL, "\"messages[%zu].content\" %s", i, NUL_REFUSED);
    }
    if (rc) {
        pd_chat_messages_free(m, n);
        return rc;
    }
    *mp = m;
    *np = n;
    return 0;
}

void pd_chat_messages_free(struct pd_chat_msg *m, size_t n)
{
    if (!m)
        return;
    char **owned = (char **)(m + n);
    for (size_t i = 0; i < n; i++)
        free(owned[i]);
    free(m);
}

int pd_chat_render(enum pd_chat_format f, const struct pd_chat_msg *m, size_t n, int with_bos, char **out,
                   size_t *len, pd_err *e)
{
    return pd_chat_render_spans(f, m, n, with_bos, out, len, NULL, NULL, e);
}

int pd_chat_render_spans(enum pd_chat_format f, const struct pd_chat_msg *m, size_t n, int with_bos, char **out,
                         size_t *len, struct pd_tok_span **spans, size_t *n_spans, pd_err *e)
{
    return pd_chat_render_think(f, NULL, m, n, with_bos, out, len, spans, n_spans, e);
}

int pd_chat_render_think(enum pd_chat_format f, const struct pd_chat_think *th, const struct pd_chat_msg *m,
                         size_t n, int with_bos, char **out, size_t *len, struct pd_tok_span **spans,
                         size_t *n_spans, pd_err *e)
{
    *out = NULL;
    *len = 0;
    if (spans) {
        *spans = NULL;
        *n_spans = 0;
    }
    for (size_t i = 0; i < n; i++)
        if (!m[i].role || !m[i].content ||
            (!role_is(&m[i], "system") && !role_is(&m[i], "user") && !role_is(&m[i], "assistant")))
            return pd_err_set(e, PD_EINVAL,
                              "\"messages[%zu]\" needs \"role\" (system or developer, user or assistant) and a \"content\" "
                              "(a string or text parts)",
                              i);
    if (f == PD_CHAT_DSV3 && th && th->thinking)
        return pd_err_set(e, PD_EINVAL, "thinking mode: DeepSeek-V3's chat_template has none (it is DeepSeek-V4's "
                          "encoding's)");
    struct buf b = {.spans = spans != NULL};
    put(&b, with_bos ? BOS : "");
    if (f == PD_CHAT_DSV3)
        render_v3(&b, m, n);
    else
        render_v4(&b, th, m, n);
    if (b.oom) {
        free(b.p);
        free(b.span);
        return pd_err_set(e, PD_ENOMEM, "out of memory for the chat's prompt");
    }
    *out = b.p;
    *len = b.n;
    if (spans) {
        *spans = b.span;
        *n_spans = b.n_span;
    }
    return 0;
}

int pd_chat_effort(const char *effort, struct pd_chat_think *th)
{
    static const char *const efforts[] = {"none", "minimal", "low", "medium", "high", "max", NULL};
    int k = 0;
    while (efforts[k] && strcmp(effort, efforts[k]))
        k++;
    if (!efforts[k])
        return -1;
    if (!strcmp(effort, "none"))
        th->thinking = 0;
    th->effort_max = !strcmp(effort, "max");
    return 0;
}

int pd_chat_think_split(const char *t, size_t len, size_t *r_off, size_t *r_len, size_t *c_off)
{
    const char *start = memmem(t, len, THINK_START, strlen(THINK_START));
    size_t from = start ? (size_t)(start - t) + strlen(THINK_START) : 0;
    const char *end = memmem(t + from, len - from, THINK_END, strlen(THINK_END));
    *r_off = from;
    *r_len = (end ? (size_t)(end - t) : len) - from;
    *c_off = end ? (size_t)(end - t) + strlen(THINK_END) : len;
    return end != NULL;
}

size_t pd_chat_think_partial(const char *t, size_t len)
{
    const size_t k = strlen(THINK_END);
    for (size_t n = k - 1 < len ? k - 1 : len; n > 0; n--)
        if (!memcmp(t + len - n, THINK_END, n))
            return n;
    return 0;
}

/* `pdmoe tokenize`: the ids a tokenizer.json gives a text, as pdmoe encodes it (no BOS added),
 * to compare with other implementations (tests/tokenizer/compare.mjs runs Hugging Face's). */
#include "cli/cli.h"
#include "model/chat.h"
#include "model/tokenizer.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *help =
    "usage: pdmoe tokenize --tokenizer FILE (--text TEXT | --file FILE | --jsonl FILE) [--json]\n"
    "Prints the ids FILE's tokenizer gives a text (no BOS added): the ids separated by spaces, or\n"
    "a JSON array with --json. --file tokenizes a whole file as one text; --jsonl reads one JSON\n"
    "string per line and prints one JSON array of ids per line (- reads standard input).\n"
    "--chat DIR: each --jsonl line is a chat's \"messages\" array instead; it is rendered as checkpoint\n"
    "DIR's chat format (DeepSeek-V3's chat_template or DeepSeek-V4's encoding: see pdmoe serve), BOS text\n"
    "first, and printed as one JSON object per line: {\"text\": the prompt, \"ids\": its ids}, the ids\n"
    "pdmoe serve gives the model: a special token's text inside a message's content is read as text.\n"
    "With --chat, DeepSeek-V4's thinking mode as a request's fields ask for it (pdmoe serve, README):\n"
    "  --thinking                chat_template_kwargs {\"thinking\": true}\n"
    "  --no-drop-thinking        chat_template_kwargs {\"drop_thinking\": false}: earlier turns keep their\n"
    "                            reasoning\n"
    "  --reasoning-effort E      reasoning_effort: none, minimal, low, medium, high or max\n";

/* The whole of path (- for standard input), NUL-ended, its length in *len; NULL if unreadable. */
static char *read_all(const char *path, size_t *len)
{
    FILE *f = strcmp(path, "-") ? fopen(path, "rb") : stdin;
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n - 1, f);
        if (n < cap - 1)
            break;
        char *nb = realloc(buf, cap * 2);
        if (!nb) {
            free(buf);
            buf = NULL;
        } else {
            buf = nb;
            cap *= 2;
        }
    }
    int bad = ferror(f);
    if (f != stdin)
        fclose(f);
    if (!buf || bad) {
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

static int print_ids(const struct pd_tok *t, const char *text, size_t len, int as_json,
                     const char *what)
{
    int32_t *ids = NULL;
    size_t n = 0;
    pd_err e = {0};
    if (pd_tok_encode(t, text, len, &ids, &n, &e)) {
        fprintf(stderr, "pdmoe tokenize: %s: %s\n", what, e.msg);
        return 1;
    }
    if (as_json)
        putchar('[');
    for (size_t i = 0; i < n; i++)
        printf(i ? (as_json ? ",%d" : " %d") : "%d", ids[i]);
    puts(as_json ? "]" : "");
    free(ids);
    return 0;
}

/* One chat (a "messages" array) rendered in format f: {"text": ..., "ids": [...]}. */
static int print_chat(const struct pd_tok *t, enum pd_chat_format f, const struct pd_chat_think *th, json_t *msgs,
                      const char *what)
{
    struct pd_chat_msg *m;
    size_t n;
    char *text;
    size_t len;
    int32_t *ids = NULL;
    size_t nid = 0;
    pd_err e = {0};
    if (pd_chat_messages(msgs, &m, &n, &e)) {
        fprintf(stderr, "pdmoe tokenize: %s: %s\n", what, e.msg);
        return 1;
    }
    /* the ids pdmoe serve feeds the model: no special token read inside a message's content */
    struct pd_tok_span *spans = NULL;
    size_t n_spans = 0;
    int rc = pd_chat_render_think(f, th, m, n, 1, &text, &len, &spans, &n_spans, &e);
    pd_chat_messages_free(m, n);
    if (rc || pd_tok_encode_plain(t, text, len, spans, n_spans, &ids, &nid, &e)) {
        fprintf(stderr, "pdmoe tokenize: %s: %s\n", what, e.msg);
        if (!rc)
            free(text);
        free(spans);
        return 1;
    }
    free(spans);
    json_t *o = json_pack("{s:s%,s:[]}", "text", text, len, "ids");
    for (size_t i = 0; o && i < nid; i++)
        json_array_append_new(json_object_get(o, "ids"), json_integer(ids[i]));
    char *line = o ? json_dumps(o, JSON_COMPACT | JSON_ENSURE_ASCII) : NULL;
    if (line)
        puts(line);
    free(line);
    json_decref(o);
    free(ids);
    free(text);
    return line ? 0 : 1;
}

int pd_cli_tokenize(int argc, char **argv)
{
    const char *tok = NULL, *text = NULL, *file = NULL, *jsonl = NULL, *chat = NULL, *effort = NULL;
    const char *think_flag = NULL;   /* the first thinking-mode flag given (they need --chat) */
    struct pd_chat_think th = {0, 1, 0};
    int as_json = 0;
    for (int i = 1; i < argc; i++) {
        const char **val = !strcmp(argv[i], "--tokenizer") ? &tok
                           : !strcmp(argv[i], "--text")    ? &text
                           : !strcmp(argv[i], "--file")    ? &file
                           : !strcmp(argv[i], "--jsonl")   ? &jsonl
                           : !strcmp(argv[i], "--chat")    ? &chat
                           : !strcmp(argv[i], "--reasoning-effort") ? &effort
                                                           : NULL;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(help, stdout);
            return 0;
        } else if (!strcmp(argv[i], "--json")) {
            as_json = 1;
        } else if (!strcmp(argv[i], "--thinking")) {
            th.thinking = 1;
            think_flag = think_flag ? think_flag : argv[i];
        } else if (!strcmp(argv[i], "--no-drop-thinking")) {
            th.drop_thinking = 0;
            think_flag = think_flag ? think_flag : argv[i];
        } else if (!val) {
            fprintf(stderr, "pdmoe tokenize: unknown option %s (see pdmoe tokenize --help)\n",
                    argv[i]);
            return 2;
        } else if (i + 1 >= argc) {
            fprintf(stderr, "pdmoe tokenize: %s needs a value\n", argv[i]);
            return 2;
        } else {
            *val = argv[++i];
        }
    }
    if (!tok) {
        fprintf(stderr, "pdmoe tokenize: --tokenizer FILE is required\n");
        return 2;
    }
    if ((text != NULL) + (file != NULL) + (jsonl != NULL) != 1) {
        fprintf(stderr, "pdmoe tokenize: give one of --text, --file and --jsonl\n");
        return 2;
    }
    if (chat && !jsonl) {
        fprintf(stderr, "pdmoe tokenize: --chat reads the chats from --jsonl\n");
        return 2;
    }
    if (effort && !think_flag)
        think_flag = "--reasoning-effort";
    if (think_flag && !chat) {
        fprintf(stderr, "pdmoe tokenize: %s is a chat's thinking mode: it needs --chat\n", think_flag);
        return 2;
    }
    if (effort && pd_chat_effort(effort, &th)) {
        fprintf(stderr, "pdmoe tokenize: --reasoning-effort %s: want one of " PD_CHAT_EFFORTS "\n", effort);
        return 2;
    }
    enum pd_chat_format format = PD_CHAT_DSV4;
    pd_err e = {0};
    if (chat && pd_chat_format_of(chat, &format, &e)) {
        fprintf(stderr, "pdmoe tokenize: --chat %s\n", e.msg);
        return 1;
    }
    struct pd_tok *t;
    if (pd_tok_load(tok, &t, &e)) {
        fprintf(stderr, "pdmoe tokenize: --tokenizer %s\n", e.msg);
        return 1;
    }
    int rc = 0;
    if (text) {
        rc = print_ids(t, text, strlen(text), as_json, "--text");
    } else {
        const char *path = file ? file : jsonl, *flag = file ? "--file" : "--jsonl";
        size_t len;
        char *buf = read_all(path, &len);
        if (!buf) {
            fprintf(stderr, "pdmoe tokenize: %s %s: cannot read\n", flag, path);
            rc = 1;
        } else if (file) {
            rc = print_ids(t, buf, len, as_json, "--file");
        } else {
            size_t line = 0;
            /* bounded by the bytes read, not by a NUL: a raw 0x00 in a line (invalid JSON there) is
             * that line's error, never the end of the file */
            for (char *s = buf, *end = buf + len, *nl; !rc && s < end; s = nl + 1) {
                nl = memchr(s, '\n', (size_t)(end - s));
                if (!nl)
                    nl = end - 1;
                line++;
                json_error_t je;
                json_t *j = json_loadb(s, (size_t)(nl - s + 1), JSON_DECODE_ANY | JSON_ALLOW_NUL,
                                       &je);
                char what[64 + 4096];
                snprintf(what, sizeof what, "--jsonl %s: line %zu", path, line);
                if (!j) {
                    fprintf(stderr, "pdmoe tokenize: %s: not JSON: %s\n", what, je.text);
                    rc = 1;
                } else if (chat) {
                    rc = print_chat(t, format, &th, j, what);
                } else if (!json_is_string(j)) {
                    fprintf(stderr, "pdmoe tokenize: %s: expected a JSON string\n", what);
                    rc = 1;
                } else {
                    rc = print_ids(t, json_string_value(j), json_string_length(j), 1, what);
                }
                json_decref(j);
            }
        }
        free(buf);
    }
    pd_tok_free(t);
    return rc;
}

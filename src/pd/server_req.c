/* A request's body read into a struct req, off the event loop (the tokenizer thread's work, see
 * server_tok.c): the JSON parsed, every field checked, the prompt's token ids read or its text
 * rendered (a chat's) and tokenized, the request sized against the context and the pool. A refusal
 * is written into the job for the loop to send (pd_srv_send_error's arguments: the messages are
 * those clients and tests see). Everything here is proportional to the body, up to the
 * --max-body-bytes limit: a prompt of 4 M token ids in 8 MiB took 0.4-0.6 s to parse, check and
 * free, and on the loop /health, /metrics and every stream waited for it. What is read here of the
 * server (its options, model, tokenizer, chat template, the pool's size) does not change once it
 * runs. */
#include "pd/server_int.h"

#include <math.h>
#include <sys/random.h>

/* The refusal of a request, for the loop to send; -1. */
static int refuse(struct refusal *no, int code, const char *type, const char *param, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(no->msg, sizeof no->msg, fmt, ap);
    va_end(ap);
    no->code = code;
    no->type = type;
    snprintf(no->param, sizeof no->param, "%s", param ? param : "");
    return -1;
}

/* A field of a request, NULL when absent or null (as OpenAI clients send unset options). */
static json_t *present(json_t *j, const char *key)
{
    json_t *v = json_object_get(j, key);
    return json_is_null(v) ? NULL : v;
}

/* Builds the prompt text of a chat in the checkpoint's format (model/chat.h), without the BOS (the
 * prompt's first id is added as for every request), and the spans of its messages' contents, in
 * which no special token is read (the text "<｜User｜>" in a message is that text, not a turn:
 * OpenAI's behaviour; vLLM's tokenizer would read it as the marker). A message's field other than role and
 * content (tool_calls, name, ...) and a content part other than text are refused by name: pdmoe
 * does not implement them. */
static int chat_prompt(struct pd_server *s, struct refusal *no, json_t *msgs, const struct pd_chat_think *th,
                       char **out, struct pd_tok_span **spans, size_t *n_spans)
{
    struct pd_chat_msg *m;
    size_t n, len;
    pd_err e = {0};
    int rc = pd_chat_messages(msgs, &m, &n, &e);
    if (!rc) {
        rc = pd_chat_render_think(s->chat, th, m, n, 0, out, &len, spans, n_spans, &e);
        pd_chat_messages_free(m, n);
    }
    if (rc)
        refuse(no, rc == PD_ENOMEM ? 503 : 400, rc == PD_ENOMEM ? "server_error" : "invalid_request_error",
               "messages", "%s", e.msg);
    return rc ? -1 : 0;
}

/* The first key of object o that is not one of known (NULL-ended), or NULL. */
static const char *unknown_key(json_t *o, const char *const *known)
{
    const char *key;
    json_t *val;
    json_object_foreach(o, key, val) {
        const char *const *k = known;
        while (*k && strcmp(key, *k))
            k++;
        if (!*k)
            return key;
    }
    return NULL;
}

/* Thinking mode, as vLLM takes it for DeepSeek-V4 (vllm-project/vllm 5dff5445
 * vllm/tokenizers/deepseek_v4.py, apply_chat_template; its reasoning parser reads the same keys,
 * d4f465fb vllm/reasoning/deepseek_v3_reasoning_parser.py): chat_template_kwargs "thinking" or
 * "enable_thinking" true switches it on (both false or absent: chat mode, the default there and
 * here), "drop_thinking" (default true) is passed to the encoding, and the request's
 * reasoning_effort "max" or "high" reaches it, any other value rendering as none. pdmoe takes those
 * three keys as booleans, any other key refused by name; reasoning_effort one of OpenAI's values
 * (minimal, low, medium, high: all render as "high" does) or "max", or "none", which vLLM's later
 * deepseek_v4.py (000af8f4) reads as chat mode, and so does pdmoe. Thinking with DeepSeek-V3's
 * template is refused by name (it has no thinking mode). 0, or a refusal (-1). */

static int think_opts(struct pd_server *s, struct refusal *no, json_t *j, int chat, struct pd_chat_think *th)
{
    static const char *const keys[] = {"thinking", "enable_thinking", "drop_thinking", NULL};
    json_t *kw = present(j, "chat_template_kwargs"), *re = present(j, "reasoning_effort");
    char param[96];
    *th = (struct pd_chat_think){0, 1, 0};
    if (!chat && (kw || re)) {
        const char *f = kw ? "chat_template_kwargs" : "reasoning_effort";
        return refuse(no, 400, "invalid_request_error", f, "\"%s\" belongs to /v1/chat/completions", f);
    }
    if (kw && !json_is_object(kw))
        return refuse(no, 400, "invalid_request_error", "chat_template_kwargs",
                      "\"chat_template_kwargs\" must be an object");
    const char *key = kw ? unknown_key(kw, keys) : NULL;
    if (key) {
        snprintf(param, sizeof param, "chat_template_kwargs.%.60s", key);
        return refuse(no, 400, "invalid_request_error", param, "unsupported parameter \"%s\": this server "
                      "implements chat_template_kwargs \"thinking\", \"enable_thinking\" and \"drop_thinking\" "
                      "(it runs no Jinja)", param);
    }
    for (int i = 0; kw && keys[i]; i++) {
        json_t *v = present(kw, keys[i]);
        if (v && !json_is_boolean(v)) {
            snprintf(param, sizeof param, "chat_template_kwargs.%s", keys[i]);
            return refuse(no, 400, "invalid_request_error", param, "\"%s\" must be a boolean", param);
        }
    }
    if (kw) {
        th->thinking = json_is_true(json_object_get(kw, "thinking")) || json_is_true(json_object_get(kw, "enable_thinking"));
        th->drop_thinking = !json_is_false(json_object_get(kw, "drop_thinking"));
    }
    if (re && (!json_is_string(re) || pd_chat_effort(json_string_value(re), th)))
        return refuse(no, 400, "invalid_request_error", "reasoning_effort",
                      "\"reasoning_effort\" must be one of " PD_CHAT_EFFORTS);
    if (s->chat == PD_CHAT_DSV3 && (th->thinking || th->effort_max))
        return refuse(no, 400, "invalid_request_error", th->thinking ? "chat_template_kwargs" : "reasoning_effort",
                      "thinking mode is not in this checkpoint's chat format (%s)", pd_chat_format_name(s->chat));
    return 0;
}

/* The fields pdmoe knows but implements only at their neutral value: any other is a 400 naming it. */
/* OpenAI fields this server does not implement, sent at the value that asks for nothing (as
 * clients that write out every default send them; OpenAI and vLLM accept them): null, or echo
 * false, best_of 1, an empty logit_bias, suffix, tools or functions, store false,
 * parallel_tool_calls without tools, tool_choice "none", response_format {"type": "text"}. They
 * are taken out of the body; any other value of theirs is an unknown parameter, refused by name. */
static void drop_noop_defaults(json_t *j)
{
    static const char *const fields[] = {"echo", "best_of", "logit_bias", "suffix", "tools", "functions",
                                         "tool_choice", "function_call", "parallel_tool_calls", "store",
                                         "metadata", "response_format", "service_tier", NULL};
    const int tools = json_array_size(json_object_get(j, "tools")) > 0 || json_array_size(json_object_get(j, "functions")) > 0;
    for (int i = 0; fields[i]; i++) {
        json_t *v = json_object_get(j, fields[i]);
        const char *f = fields[i];
        int noop = json_is_null(v) ||
                   (!strcmp(f, "echo") && json_is_false(v)) ||
                   (!strcmp(f, "best_of") && json_is_integer(v) && json_integer_value(v) == 1) ||
                   ((!strcmp(f, "logit_bias") || !strcmp(f, "metadata")) && json_is_object(v) && json_object_size(v) == 0) ||
                   (!strcmp(f, "suffix") && json_is_string(v) && !*json_string_value(v)) ||
                   ((!strcmp(f, "tools") || !strcmp(f, "functions")) && json_is_array(v) && json_array_size(v) == 0) ||
                   (!strcmp(f, "store") && json_is_false(v)) ||
                   (!strcmp(f, "parallel_tool_calls") && json_is_boolean(v) && !tools) ||
                   ((!strcmp(f, "tool_choice") || !strcmp(f, "function_call")) && json_is_string(v) &&
                    !strcmp(json_string_value(v), "none")) ||
                   (!strcmp(f, "response_format") && json_is_object(v) && json_object_size(v) == 1 &&
                    json_is_string(json_object_get(v, "type")) &&
                    !strcmp(json_string_value(json_object_get(v, "type")), "text"));
        if (v && noop)
            json_object_del(j, f);
    }
}

/* Integer fields sent as whole-number floats (100.0, 1e2: a client that computes max_tokens):
 * vLLM's pydantic takes them as integers, and so does this server; 100.5 stays a float and is
 * refused as one. */
static void whole_floats_to_ints(json_t *j)
{
    static const char *const ints[] = {"max_tokens", "max_completion_tokens", "seed", "n", "top_logprobs", "top_k",
                                       "best_of", NULL};
    for (int i = 0; ints[i]; i++) {
        json_t *v = json_object_get(j, ints[i]);
        double x = json_is_real(v) ? json_real_value(v) : 0;
        if (json_is_real(v) && x == floor(x) && fabs(x) < 9007199254740992.0)
            json_object_set_new(j, ints[i], json_integer((json_int_t)x));
    }
}

static int unsupported_values(struct pd_server *s, struct refusal *no, json_t *j, int chat)
{
    json_t *n = present(j, "n"), *lp = present(j, "logprobs"), *tlp = present(j, "top_logprobs");
    if (n && (!json_is_integer(n) || json_integer_value(n) != 1)) {
        refuse(no, 400, "invalid_request_error", "n", "\"n\": only 1 choice per request is supported");
        return -1;
    }
    /* chat: a boolean; completions: the number of alternatives, where 0 still asks for the chosen token's */
    if (lp && !json_is_false(lp)) {
        refuse(no, 400, "invalid_request_error", "logprobs", "\"logprobs\" is not supported%s",
               chat ? " (send false or leave it out)" : " (leave it out)");
        return -1;
    }
    if (tlp && !(json_is_integer(tlp) && json_integer_value(tlp) == 0)) {
        refuse(no, 400, "invalid_request_error", "top_logprobs", "\"top_logprobs\" is not supported");
        return -1;
    }
    /* vLLM's sampling extras at the values that turn them off, as `vllm bench serve` sends them
     * (repetition_penalty 1.0 on every completions request; top_k -1 or 0, min_p 0): taken; any
     * other value is refused by name */
    json_t *rp = present(j, "repetition_penalty"), *tk = present(j, "top_k"), *mp = present(j, "min_p");
    const char *sampling = rp && !(json_is_number(rp) && json_number_value(rp) == 1) ? "repetition_penalty"
                           : tk && !(json_is_integer(tk) && (json_integer_value(tk) == -1 || json_integer_value(tk) == 0))
                               ? "top_k"
                           : mp && !(json_is_number(mp) && json_number_value(mp) == 0) ? "min_p" : NULL;
    if (sampling) {
        refuse(no, 400, "invalid_request_error", sampling, "\"%s\": only %s (off) is supported", sampling,
               !strcmp(sampling, "repetition_penalty") ? "1" : !strcmp(sampling, "top_k") ? "-1 or 0" : "0");
        return -1;
    }
    static const char *const penalties[] = {"presence_penalty", "frequency_penalty"};
    for (int i = 0; i < 2; i++) {
        json_t *v = present(j, penalties[i]);
        if (v && !(json_is_number(v) && json_number_value(v) == 0)) {
            refuse(no, 400, "invalid_request_error", penalties[i], "\"%s\": only 0 is supported",
                   penalties[i]);
            return -1;
        }
    }
    json_t *u = present(j, "user");
    if (u && !json_is_string(u)) {
        refuse(no, 400, "invalid_request_error", "user", "\"user\" must be a string");
        return -1;
    }
    return 0;
}

/* stop (a string or up to 16 strings of 1 to 256 bytes), vLLM's stop_token_ids (up to 64 token
 * ids) and stream_options {"include_usage": bool} (with stream only), into r. */
static int stop_params(struct pd_server *s, struct refusal *no, json_t *j, struct req *r, int stream)
{
    json_t *stop = present(j, "stop"), *ids = present(j, "stop_token_ids"), *so = present(j, "stream_options");
    size_t ns = !stop ? 0 : json_is_string(stop) ? 1 : json_is_array(stop) ? json_array_size(stop) : 17;
    for (size_t i = 0; i < ns && ns <= 16; i++) {
        json_t *x = json_is_string(stop) ? stop : json_array_get(stop, i);
        if (!json_is_string(x) || json_string_length(x) < 1 || json_string_length(x) > 256)
            ns = 17;
    }
    if (ns > 16) {
        refuse(no, 400, "invalid_request_error", "stop",
               "\"stop\" must be a string or an array of at most 16 strings of 1 to 256 bytes");
        return -1;
    }
    if (ns) {
        r->stop = calloc(ns, sizeof *r->stop);
        for (size_t i = 0; r->stop && i < ns; i++) {
            json_t *x = json_is_string(stop) ? stop : json_array_get(stop, i);
            size_t len = json_string_length(x);
            if (!(r->stop[r->n_stop] = malloc(len + 1)))
                break;
            memcpy(r->stop[r->n_stop], json_string_value(x), len + 1);
            r->n_stop++;
            r->stop_max = len > r->stop_max ? len : r->stop_max;
        }
        if ((size_t)r->n_stop != ns) {
            refuse(no, 503, "server_error", NULL, "out of memory for the stop strings");
            return -1;
        }
    }
    if (ids) {
        size_t n = json_is_array(ids) ? json_array_size(ids) : 65;
        for (size_t i = 0; i < n && n <= 64; i++) {
            json_t *x = json_array_get(ids, i);
            if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= s->V)
                n = 65;
        }
        if (n > 64) {
            refuse(no, 400, "invalid_request_error", "stop_token_ids",
                   "\"stop_token_ids\" must be an array of at most 64 token ids below %d", s->V);
            return -1;
        }
        if (n && !(r->stop_ids = malloc(n * sizeof *r->stop_ids))) {
            refuse(no, 503, "server_error", NULL, "out of memory for the stop token ids");
            return -1;
        }
        for (size_t i = 0; i < n; i++)
            r->stop_ids[r->n_stop_ids++] = (int32_t)json_integer_value(json_array_get(ids, i));
    }
    if (so) {
        const char *key;
        json_t *v;
        if (!json_is_object(so) || !stream) {
            refuse(no, 400, "invalid_request_error", "stream_options",
                   "\"stream_options\" must be an object, and only with \"stream\": true");
            return -1;
        }
        json_object_foreach(so, key, v) {
            if (strcmp(key, "include_usage") || !json_is_boolean(v)) {
                refuse(no, 400, "invalid_request_error", "stream_options",
                       strcmp(key, "include_usage")
                                      ? "stream_options: only \"include_usage\" (a boolean) is supported, not \"%s\""
                                      : "stream_options: \"%s\" must be a boolean",
                       key);
                return -1;
            }
            r->include_usage = json_is_true(v);
        }
    }
    return 0;
}

/* A completion's "prompt" as token ids (vLLM's and OpenAI's form besides a string): a non-empty
 * array of ids of this model's vocabulary, read into *ids (malloc'ed) and *n. A batch of several
 * prompts (an array of strings or of arrays) is refused by name: one prompt per request (a batch
 * of one is its prompt: the caller unwraps it). 0, or -1 after an error answer. */
static int token_prompt(struct pd_server *s, struct refusal *no, json_t *p, int32_t **ids, size_t *n)
{
    size_t i;
    json_t *v;
    *n = json_array_size(p);
    if (*n == 0) {
        refuse(no, 400, "invalid_request_error", "prompt", "\"prompt\" is an empty array of token ids");
        return -1;
    }
    if (!(*ids = malloc(*n * sizeof **ids))) {
        refuse(no, 503, "server_error", NULL, "out of memory for the prompt's %zu tokens", *n);
        return -1;
    }
    json_array_foreach(p, i, v) {
        if (json_is_string(v) || json_is_array(v)) {
            refuse(no, 400, "invalid_request_error", "prompt",
                   "\"prompt\": a batch of several prompts is not supported (one prompt a request: a "
                   "string or an array of token ids, or a batch of one)");
            break;
        }
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= s->V) {
            refuse(no, 400, "invalid_request_error", "prompt",
                   "\"prompt[%zu]\" is not a token id of this model (integers 0 to %d)", i, s->V - 1);
            break;
        }
        (*ids)[i] = (int32_t)json_integer_value(v);
    }
    if (i == *n)
        return 0;
    free(*ids);
    *ids = NULL;
    return -1;
}

/* The most tokens one sequence can hold here: the context, and what the KV pool could ever give it
 * (pd_kvpool_blocks_for grows with the length). */
static int64_t sequence_room(const struct pd_server *s)
{
    int64_t lo = 0, hi = s->o.max_model_len;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo + 1) / 2;
        if (pd_kvpool_blocks_for(&s->en.kv, mid) <= s->en.kv.n_blocks)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* kv_transfer_params' keys: those a prefill instance answers, which the proxy hands to the decode
 * instance, each known; its two flags booleans. A 400 naming the key at fault, else 0. */
static int kv_params_unknown(struct pd_server *s, struct refusal *no, json_t *kv)
{
    static const char *const flags[] = {"do_remote_decode", "do_remote_prefill"};
    static const char *const known[] = {"do_remote_decode", "do_remote_prefill", "remote_engine_id",
                                        "remote_request_id", "remote_host", "remote_port", "remote_num_tokens",
                                        "last_token_id", "num_speculative_tokens", "model_fingerprint", NULL};
    char param[96];
    if (!json_is_object(kv))
        return 0;   /* (null: absent; another type: refused where it is read) */
    const char *key = unknown_key(kv, known);
    if (key) {
        snprintf(param, sizeof param, "kv_transfer_params.%.60s", key);
        refuse(no, 400, "invalid_request_error", param, "unsupported parameter \"%s\": this server "
               "does not implement it", param);
        return 1;
    }
    for (int i = 0; i < 2; i++) {
        json_t *v = json_object_get(kv, flags[i]);
        if (v && !json_is_boolean(v)) {
            snprintf(param, sizeof param, "kv_transfer_params.%s", flags[i]);
            refuse(no, 400, "invalid_request_error", param, "\"%s\" must be a boolean", param);
            return 1;
        }
    }
    return 0;
}

void pd_srv_req_discard(struct req *r)
{
    if (!r)
        return;
    free(r->prompt);
    for (int i = 0; i < r->n_stop; i++)
        free(r->stop[i]);
    free(r->stop);
    free(r->stop_ids);
    free(r->gen);
    free(r->logits);
    free(r);
}

/* A request whose body j has passed the checks of pd_srv_req_prepare, with its prompt's n ids
 * (taken; after a BOS when add_bos, the prompt being a text): sized against the context and the
 * pool, its transfer parameters read, its sampler seeded. NULL after a refusal in no. */
static struct req *build(struct pd_server *s, struct refusal *no, json_t *j, int chat, int32_t *ids, size_t n,
                         int add_bos)
{
    json_t *mt = present(j, "max_tokens"), *mct = present(j, "max_completion_tokens"), *tp = present(j, "temperature"),
           *pp = present(j, "top_p"), *st = present(j, "stream"), *sd = present(j, "seed");
    const char *mt_name = mt || !mct ? "max_tokens" : "max_completion_tokens";   /* the one errors name */
    if (!mt)
        mt = mct;
    struct req *r = calloc(1, sizeof *r);
    if (!r) {
        free(ids);
        refuse(no, 503, "server_error", NULL, "out of memory for the request");
        return NULL;
    }
    /* (a prompt is at most the 8 MiB body in tokens: it fits an int, checked all the same) */
    r->prompt = n < INT_MAX - 1 ? malloc((n + 1) * sizeof *r->prompt) : NULL;
    if (!r->prompt) {
        free(ids);
        refuse(no, 503, "server_error", NULL, "out of memory for the prompt's %zu tokens", n);
        goto reject;
    }
    if (add_bos && s->bos >= 0)
        r->prompt[r->n_prompt++] = s->bos;
    if (n)
        memcpy(r->prompt + r->n_prompt, ids, n * sizeof *ids);
    r->n_prompt += (int)n;
    free(ids);
    /* unset: 16 for a completion (OpenAI's and vLLM's default), the rest of the room for a chat (vLLM's:
     * the context less the prompt; here also no more than the pool could ever hold) */
    int64_t max_tokens = mt ? json_integer_value(mt) : 16;
    if (!mt && chat) {
        const int64_t room = sequence_room(s);
        max_tokens = room - r->n_prompt;
        if (max_tokens < 1) {
            refuse(no, 400, "invalid_request_error", "messages",
                   "the prompt has %d tokens and leaves no room for an answer: a sequence holds at most "
                   "%lld tokens here (the context of %d and the KV pool)",
                   r->n_prompt, (long long)room, s->o.max_model_len);
            goto reject;
        }
    }
    /* compared as max_model_len - prompt: a max_tokens near INT64_MAX must not wrap the sum */
    if (max_tokens > (int64_t)s->o.max_model_len - r->n_prompt) {
        /* the prompt alone leaves no room: the prompt is at fault, whatever max_tokens says */
        const int prompt_over = r->n_prompt >= s->o.max_model_len;
        refuse(no, 400, "invalid_request_error", prompt_over ? (chat ? "messages" : "prompt") : mt_name,
                   "this model's maximum context length is %d tokens; the prompt has %d and %s asks for %lld%s",
                   s->o.max_model_len, r->n_prompt, mt_name, (long long)max_tokens,
                   mt ? "" : " (its default: the request does not set it)");
        goto reject;
    }
    /* a prefill for a decode instance (the proxy sends the client's body as it came, every field
     * checked here before any compute) generates the first token only */
    json_t *kvp = json_object_get(j, "kv_transfer_params");
    const int for_decode = json_is_object(kvp) && json_is_true(json_object_get(kvp, "do_remote_decode"));
    /* a request the pool could never hold is refused now rather than left waiting */
    int need = pd_kvpool_blocks_for(&s->en.kv, r->n_prompt + (for_decode ? 1 : max_tokens));
    if (need > s->en.kv.n_blocks) {
        refuse(no, 400, "invalid_request_error", mt_name,
                   "the prompt (%d tokens) and %s (%lld) need %d KV blocks; this server's pool has %d",
                   r->n_prompt, mt_name, (long long)max_tokens, need, s->en.kv.n_blocks);
        goto reject;
    }
    r->max_tokens = for_decode ? 1 : (int)max_tokens;
    r->forced_first = -1;
    r->first_sampled = -1;
    if (stop_params(s, no, j, r, st && json_is_true(st)))
        goto reject;
    json_t *kv = json_object_get(j, "kv_transfer_params");
    if (kv && !json_is_null(kv)) {
        if (!json_is_object(kv)) {
            refuse(no, 400, "invalid_request_error", "kv_transfer_params", "\"kv_transfer_params\" must be an object");
            goto reject;
        }
        if (for_decode) {
            if (s->o.role != PD_ROLE_PRODUCER) {
                refuse(no, 400, "invalid_request_error", "kv_transfer_params",
                           "do_remote_decode asks a prefill (kv_producer) instance; this one is not");
                goto reject;
            }
            r->remote_decode = 1;
            /* the lease's key: made here, off the scheduler's lock (getrandom and a pass over the prompt) */
            pd_err ke;
            if (pd_kvx_key_new(&r->key, pd_kvx_hash_tokens(r->prompt, r->n_prompt), &ke)) {
                refuse(no, 503, "server_error", NULL, "%s", ke.msg);
                goto reject;
            }
        }
        if (json_is_true(json_object_get(kv, "do_remote_prefill"))) {
            const char *host = json_string_value(json_object_get(kv, "remote_host"));
            json_t *port = json_object_get(kv, "remote_port"), *rid = json_object_get(kv, "remote_request_id"),
                   *nt = json_object_get(kv, "remote_num_tokens"), *last = json_object_get(kv, "last_token_id");
            /* the first field at fault, named (one message for all of them left the client guessing) */
            const char *fault = s->o.role != PD_ROLE_CONSUMER ? NULL
                              : !host || !*host || strlen(host) >= sizeof r->remote_host
                                  ? "remote_host (the prefill instance's KV host, 1 to 63 bytes)"
                              : !json_is_integer(port) || json_integer_value(port) < 1 || json_integer_value(port) > 65535
                                  ? "remote_port (an integer, 1 to 65535)"
                              : !rid ? "remote_request_id (the string the prefill instance answered)"
                              : !json_is_integer(nt) || json_integer_value(nt) < 0 || json_integer_value(nt) > INT32_MAX
                                  ? "remote_num_tokens (an integer >= 0)"
                              : !json_is_integer(last) || json_integer_value(last) < 0 || json_integer_value(last) >= s->V
                                  ? "last_token_id (a token id of this model)"
                                  : "";
            if (!fault || *fault) {
                if (fault)
                    refuse(no, 400, "invalid_request_error", "kv_transfer_params",
                           "kv_transfer_params.%s: missing or out of range", fault);
                else
                    refuse(no, 400, "invalid_request_error", "kv_transfer_params",
                           "do_remote_prefill asks a decode (kv_consumer) instance; this one is not");
                goto reject;
            }
            /* the producers this instance pulls from, when it was told (kv_producers): never a
             * connection to an address a client chose */
            if (s->o.n_kv_producers && !pd_srv_kv_producer_allowed(s, host, (int)json_integer_value(port))) {
                refuse(no, 403, "invalid_request_error", "kv_transfer_params",
                       "kv_transfer_params names a producer (remote_host, remote_port) that is not one of "
                       "this decode instance's (kv_transfer_config kv_producers)");
                goto reject;
            }
            /* KV computed with other weights would decode into text of neither model (a rolling
             * upgrade half done, another seed under the same name): refused, named */
            json_t *fpj = json_object_get(kv, "model_fingerprint");
            const char *fp = json_string_value(fpj);
            if (fpj && !fp) {
                refuse(no, 400, "invalid_request_error", "kv_transfer_params",
                       "kv_transfer_params.model_fingerprint must be the string the prefill instance answered");
                goto reject;
            }
            if (fp && strcmp(fp, s->fingerprint)) {
                /* its own param: the proxy tells this apart from a wrong role (it is the pair's
                 * mismatch, not this instance's failure) */
                refuse(no, 400, "invalid_request_error", "kv_transfer_params.model_fingerprint",
                       "kv_transfer_params.model_fingerprint %.32s: the prefill instance holds other weights "
                       "than this one (%s): its KV cache cannot be decoded here", fp, s->fingerprint);
                goto reject;
            }
            if (pd_kvx_id_parse(json_string_value(rid), &r->remote_key)) {
                refuse(no, 400, "invalid_request_error", "kv_transfer_params",
                           "kv_transfer_params.remote_request_id must be the 32-hex-digit string the prefill instance "
                           "answered");
                goto reject;
            }
            /* the MTP layer's KV and the draft's input come only from a producer that speculates
             * with the same --speculative-config (absent: a producer without speculation) */
            json_t *k = json_object_get(kv, "num_speculative_tokens");
            if (k && (!json_is_integer(k) || json_integer_value(k) != s->o.spec_k)) {
                char theirs[64];
                if (!json_is_integer(k))
                    snprintf(theirs, sizeof theirs, "is not an integer");
                else if (json_integer_value(k) == 0)
                    snprintf(theirs, sizeof theirs, "is 0: the prefill instance runs without speculation");
                else
                    snprintf(theirs, sizeof theirs, "is %lld", (long long)json_integer_value(k));
                char ours[64];
                if (s->o.spec_k)
                    snprintf(ours, sizeof ours, "num_speculative_tokens %d", s->o.spec_k);
                else
                    snprintf(ours, sizeof ours, "without speculation");
                refuse(no, 400, "invalid_request_error", "kv_transfer_params",
                       "kv_transfer_params.num_speculative_tokens %s, but this decode instance runs %s: "
                       "a prefill and a decode instance must use the same --speculative-config", theirs, ours);
                goto reject;
            }
            if (!k && s->o.spec_k) {
                refuse(no, 400, "invalid_request_error", "kv_transfer_params",
                       "kv_transfer_params has no num_speculative_tokens (a prefill instance without "
                       "speculation), but this decode instance runs num_speculative_tokens %d: a prefill "
                       "and a decode instance must use the same --speculative-config", s->o.spec_k);
                goto reject;
            }
            /* the producer hands its KV over only for the prompt it prefilled */
            r->remote_key.hash = pd_kvx_hash_tokens(r->prompt, r->n_prompt);
            r->remote_prefill = 1;
            snprintf(r->remote_host, sizeof r->remote_host, "%s", host);
            r->remote_port = (int)json_integer_value(port);
            r->remote_tokens = (int)json_integer_value(nt);
            r->forced_first = (int32_t)json_integer_value(last);
        }
    }
    r->gen = malloc((size_t)r->max_tokens * sizeof *r->gen);
    r->logits = s->g ? NULL : malloc((size_t)s->V * sizeof(float));   /* a group's ranks have their own */
    if (!r->gen || (!s->g && !r->logits)) {
        free(r->gen);
        free(r->logits);
        refuse(no, 503, "server_error", NULL, "out of memory for a request of %d tokens", r->max_tokens);
        goto reject;
    }
    r->stream = st && json_is_true(st) && !r->remote_decode;   /* a prefill's answer goes to the proxy whole */
    r->chat = chat;
    r->srv = s;
    r->return_ids = json_is_true(json_object_get(j, "return_token_ids"));
    r->ignore_eos = json_is_true(json_object_get(j, "ignore_eos"));
    r->keep_special = json_is_false(json_object_get(j, "skip_special_tokens"));
    /* unseeded: a sample of its own (vLLM's), from the urandom pool (the clock if that fails) */
    uint64_t seed = (uint64_t)json_integer_value(sd);
    if (!sd && getrandom(&seed, sizeof seed, 0) != (ssize_t)sizeof seed)
        seed = (uint64_t)pd_now_ns();
    pd_sampler_init(&r->smp, tp ? json_number_value(tp) : 1.0, pp ? json_number_value(pp) : 1.0, seed);
    /* the producer drew its first token from this state: the decode side goes on from the next
     * draw, so a seeded request samples what it samples on one instance */
    if (r->forced_first >= 0 && r->smp.temperature > 0)
        pd_sampler_uniform(&r->smp);
    return r;
reject:   /* refused after r was allocated: nothing else holds it yet */
    pd_srv_req_discard(r);
    return NULL;
}

void pd_srv_req_prepare(struct pd_server *s, struct tok_job *jb)
{
    struct refusal *no = &jb->no;
    const int chat = jb->chat;
    json_error_t je;
    json_t *j;
    const int parsed = pd_http_read_json(jb->body, JSON_REJECT_DUPLICATES, &j, &je);
    evbuffer_free(jb->body);   /* (a copy of it is in j now) */
    jb->body = NULL;
    if (!j || !json_is_object(j)) {
        refuse(no, parsed == PD_ENOMEM ? 503 : 400, parsed == PD_ENOMEM ? "server_error" : "invalid_request_error", NULL, "%s",
               j ? "the body is not a JSON object but another JSON type" : je.text);
        json_decref(j);
        return;
    }
    /* (before any field is read: each replaces a value in the body; whole floats first, so that
     * best_of 1.0 is the no-op best_of 1 is) */
    whole_floats_to_ints(j);
    drop_noop_defaults(j);
    const char *model = json_string_value(json_object_get(j, "model"));
    json_t *mt = present(j, "max_tokens"), *mct = present(j, "max_completion_tokens"), *tp = present(j, "temperature"),
           *pp = present(j, "top_p"), *st = present(j, "stream"), *sd = present(j, "seed");
    char *text = NULL;
    struct pd_tok_span *spans = NULL;   /* a chat's contents in text */
    size_t n_spans = 0;
    int32_t *ids = NULL;   /* the prompt's ids: a completion's as sent, or the text's tokens */
    size_t n = 0;
    if (json_object_get(j, "model") && !model) {
        refuse(no, 400, "invalid_request_error", "model", "\"model\" must be a string");
        goto out;
    }
    if (model && strcmp(model, s->name)) {
        refuse(no, 404, "invalid_request_error", "model", "the model \"%s\" does not exist; this server serves \"%s\"",
                   model, s->name);
        goto out;
    }
    /* OpenAI's and vLLM's fields: each one implemented, or refused by name, never accepted and dropped */
    static const char *const known[] = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens",
                                        "temperature", "top_p", "seed", "stream", "stream_options", "stop",
                                        "stop_token_ids", "ignore_eos", "return_token_ids", "kv_transfer_params",
                                        "user", "n", "logprobs", "top_logprobs", "presence_penalty",
                                        "frequency_penalty", "skip_special_tokens", "repetition_penalty", "top_k",
                                        "min_p", "chat_template_kwargs", "reasoning_effort", NULL};
    const char *key = unknown_key(j, known);
    if (key) {
        refuse(no, 400, "invalid_request_error", key, "unsupported parameter \"%s\": this server "
               "does not implement it", key);
        goto out;
    }
    /* the other route's prompt: the client meant the other route, or sent both by mistake */
    const char *other = chat ? "prompt" : "messages";
    if (json_object_get(j, other)) {
        refuse(no, 400, "invalid_request_error", other, "\"%s\" belongs to %s; this is %s", other,
               chat ? "/v1/completions" : "/v1/chat/completions",
               chat ? "/v1/chat/completions" : "/v1/completions");
        goto out;
    }
    if (unsupported_values(s, no, j, chat))
        goto out;
    /* every field that sizes or steers the generation is checked here, before it is used */
    static const char *const flags[] = {"stream", "return_token_ids", "ignore_eos", "skip_special_tokens"};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) {
        json_t *v = present(j, flags[i]);
        if (v && !json_is_boolean(v)) {
            refuse(no, 400, "invalid_request_error", flags[i], "\"%s\" must be a boolean", flags[i]);
            goto out;
        }
    }
    if (st && json_is_true(st) && json_is_true(json_object_get(j, "return_token_ids"))) {
        refuse(no, 400, "invalid_request_error", "return_token_ids",
               "\"return_token_ids\" comes with a whole answer, not with \"stream\"");
        goto out;
    }
    if (kv_params_unknown(s, no, json_object_get(j, "kv_transfer_params")))
        goto out;
    const char *bad = mt && (!json_is_integer(mt) || json_integer_value(mt) < 1) ? "max_tokens"
                      : mct && (!json_is_integer(mct) || json_integer_value(mct) < 1) ? "max_completion_tokens"
                      : tp && (!json_is_number(tp) || json_number_value(tp) < 0 || json_number_value(tp) > 2) ? "temperature"
                      : pp && (!json_is_number(pp) || json_number_value(pp) <= 0 || json_number_value(pp) > 1) ? "top_p"
                      : sd && !json_is_integer(sd) ? "seed" : NULL;
    if (bad) {
        refuse(no, 400, "invalid_request_error", bad,
                   "\"%s\": max_tokens and max_completion_tokens are integers >= 1, temperature a number in [0, 2], "
                   "top_p in (0, 1], seed an integer", bad);
        goto out;
    }
    if (mt && mct && json_integer_value(mt) != json_integer_value(mct)) {
        refuse(no, 400, "invalid_request_error", "max_completion_tokens",
                   "\"max_tokens\" (%lld) and \"max_completion_tokens\" (%lld) differ; send one",
                   (long long)json_integer_value(mt), (long long)json_integer_value(mct));
        goto out;
    }
    struct pd_chat_think th;
    if (think_opts(s, no, j, chat, &th))
        goto out;
    if (chat) {
        if (chat_prompt(s, no, json_object_get(j, "messages"), &th, &text, &spans, &n_spans))
            goto out;
    } else {
        json_t *p = json_object_get(j, "prompt");
        /* a batch of one (["text"] or [[ids]], as lm-eval and vLLM's clients send) is its prompt */
        if (json_array_size(p) == 1 && (json_is_string(json_array_get(p, 0)) || json_is_array(json_array_get(p, 0))))
            p = json_array_get(p, 0);
        if (json_is_array(p)) {
            if (token_prompt(s, no, p, &ids, &n))
                goto out;
        } else if (!json_is_string(p)) {
            refuse(no, 400, "invalid_request_error", "prompt",
                   "\"prompt\" must be a string or an array of token ids");
            goto out;
        } else if (!(text = strdup(json_string_value(p)))) {
            refuse(no, 503, "server_error", NULL, "out of memory for the prompt");
            goto out;
        }
    }
    int add_bos = 0;
    if (text) {
        /* A text that cannot fit the context whatever its tokenization is refused before it is
         * tokenized (an 8 MiB prompt took seconds): each token stands for at most
         * pd_tok_max_token_bytes of text, 4x allowing for normalization. */
        const size_t text_len = strlen(text), per_token = pd_tok_max_token_bytes(s->tok) * 4 + 4;
        if (text_len / per_token >= (size_t)s->o.max_model_len) {
            refuse(no, 400, "invalid_request_error", chat ? "messages" : "prompt",
                   "this model's maximum context length is %d tokens; the prompt's %zu bytes make more than that "
                   "however they are tokenized", s->o.max_model_len, text_len);
            goto out;
        }
        pd_err e = {0};
        int rc = pd_tok_encode_plain(s->tok, text, text_len, spans, n_spans, &ids, &n, &e);
        if (rc) {
            refuse(no, rc == PD_ENOMEM ? 503 : 400, rc == PD_ENOMEM ? "server_error" : "invalid_request_error",
                   chat ? "messages" : "prompt", "%s", e.msg);
            goto out;
        }
        add_bos = 1;
    }
    jb->r = build(s, no, j, chat, ids, n, add_bos);
    ids = NULL;
    if (jb->r)
        jb->r->think = th.thinking;
out:
    free(text);
    free(spans);
    free(ids);
    json_decref(j);
}

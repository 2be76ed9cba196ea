/* Byte-level BPE tokenizers in Hugging Face's tokenizer.json format (GPT-2, DeepSeek-V3/V4,
 * Qwen, Llama-3 style): load, encode, decode, and train a small one for synthetic checkpoints.
 *
 * What a file may contain (anything else is a PD_EFORMAT error naming the file and the field):
 *   model:         {"type": "BPE", "vocab": {token: id}, "merges": ["a b", ...] or [["a", "b"]],
 *                  "ignore_merges", "byte_fallback": false, "dropout": null,
 *                  "continuing_subword_prefix"/"end_of_word_suffix": null or ""}
 *   added_tokens:  [{"id", "content", "special", "lstrip", "rstrip", "single_word", ...}]
 *   normalizer:    null, "NFC", or a "Sequence" of those. NFC is applied as the identity:
 *                  exact for ASCII and for text that is already NFC (what editors, browsers and
 *                  chat front ends send); decomposed input tokenizes differently from HF.
 *   pre_tokenizer: "ByteLevel" {add_prefix_space, use_regex (the GPT-2 pattern)}, "Split"
 *                  {pattern {"Regex"|"String"}, behavior, invert}, "Digits" {individual_digits},
 *                  or a "Sequence" of those ending with ByteLevel (a ByteLevel step is required).
 *   decoder:       "ByteLevel" (or a Sequence holding only ByteLevel).
 *   post_processor is read only to find the BOS token of a TemplateProcessing.
 *
 * Encoding follows HF: added tokens are split out first (exact match, leftmost, longest first,
 * honouring lstrip/rstrip/single_word), every other segment is pre-tokenized (each Split step
 * refines the pieces of the previous one; a regex never sees across a piece's edge), each piece's
 * UTF-8 bytes are BPE-merged (lowest merge rank first, leftmost among equals) and mapped to ids.
 * A byte whose single-byte token is missing from the vocab is an error, not silently dropped.
 * Decoding maps each id to its bytes: vocab tokens through the reverse GPT-2 byte map (a token
 * with a character outside that map decodes to its own UTF-8, as HF's ByteLevel decoder does),
 * added tokens to their content. Bytes are returned as they are: a token may end inside a UTF-8
 * sequence, so streaming callers concatenate bytes rather than validating each token.
 *
 * Split regexes run on model/regex.h (its syntax, errors and limits: a pattern that backtracks
 * catastrophically on a text makes pd_tok_encode fail, PD_EINVAL naming the file, the field and
 * the limit); the word tests of added tokens use model/unicode.h's classes. */
#ifndef PD_MODEL_TOKENIZER_H
#define PD_MODEL_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"

struct pd_tok;

/* Reads and validates a tokenizer.json; on success *t owns everything (free with pd_tok_free). */
int pd_tok_load(const char *path, struct pd_tok **t, pd_err *e);
/* Same from a NUL-terminated JSON text; `label` names it in errors (e.g. "tokenizer.json"). */
int pd_tok_parse(const char *json_text, const char *label, struct pd_tok **t, pd_err *e);
void pd_tok_free(struct pd_tok *t);
/* A loaded tokenizer is never modified: any number of threads may encode and decode with it. */

/* Encodes len bytes of text (any bytes; need not be valid UTF-8 nor NUL-terminated). *ids is
 * malloc'ed (free() it) and holds *n ids; no BOS is added (see pd_tok_bos). */
int pd_tok_encode(const struct pd_tok *t, const char *text, size_t len, int32_t **ids, size_t *n,
                  pd_err *e);
/* A byte range [off, off + len) of a text. */
struct pd_tok_span {
    size_t off, len;
};
/* pd_tok_encode, with no added token recognised where it would overlap one of the n `plain` spans
 * (sorted by offset, disjoint): their bytes are encoded as any other text. A chat's message
 * contents are such spans, so that a user who types "<｜User｜>" or the EOS's text does not forge a
 * turn or end the prompt; with no added token's text in the spans the ids are pd_tok_encode's. */
int pd_tok_encode_plain(const struct pd_tok *t, const char *text, size_t len, const struct pd_tok_span *plain,
                        size_t n_plain, int32_t **ids, size_t *n, pd_err *e);
/* Same into a caller buffer of cap ids: PD_ERANGE with *n = the count needed if it is too small. */
int pd_tok_encode_into(const struct pd_tok *t, const char *text, size_t len, int32_t *ids,
                       size_t cap, size_t *n, pd_err *e);

/* Concatenated bytes of ids; *out is malloc'ed and NUL-terminated (the NUL is not counted in
 * *len). PD_EINVAL if an id has no token. */
int pd_tok_decode(const struct pd_tok *t, const int32_t *ids, size_t n, char **out, size_t *len);
/* Bytes of one token into buf: returns their count, PD_ERANGE if cap is too small (no token is
 * longer than pd_tok_max_token_bytes), PD_EINVAL if id has no token. */
int pd_tok_decode_one(const struct pd_tok *t, int32_t id, char *buf, size_t cap);
/* The same bytes without copying (valid until pd_tok_free); NULL if id has no token. */
const char *pd_tok_token_bytes(const struct pd_tok *t, int32_t id, size_t *len);
size_t pd_tok_max_token_bytes(const struct pd_tok *t);

/* Tests and benchmarks: on = 1 runs the Split regexes of encoding on the backtracking reference
 * matcher (regex.h's pd_rx_find_ref: no limits, exponential time on some patterns), 0 on PCRE2
 * (the default). Call it before the tokenizer is shared between threads. */
void pd_tok_set_reference_matcher(struct pd_tok *t, int on);

/* One more than the largest id in the vocab or the added tokens (ids may have gaps). */
int32_t pd_tok_vocab_size(const struct pd_tok *t);
/* 0 if every id of t has a row in a model of `vocab` (config.json's vocab_size: embedding and
 * output head), else PD_EINVAL naming `path` (the tokenizer's file), its largest id and vocab. A
 * model's vocab may be larger (padding: DeepSeek's 129,280 rows hold 128,815 tokens). */
int pd_tok_check_vocab(const struct pd_tok *t, int64_t vocab, const char *path, pd_err *e);
/* 0 unless config.json's bos_token_id / eos_token_id (bos, eos; -1: not given) name other ids
 * than the tokenizer's own begin / end-of-sentence tokens (the generation would stop at a token the
 * model never ends with): then PD_EINVAL naming path, the token and both ids. */
int pd_tok_check_special(const struct pd_tok *t, int bos, int eos, const char *path, pd_err *e);
/* Id of an added token's content, or of a vocab token as written in the file ("Ġthe");
 * -1 if there is none. */
int32_t pd_tok_id_of(const struct pd_tok *t, const char *token);
/* 1 if id is an added token marked "special" (chat templates, EOS), else 0. */
int pd_tok_is_special(const struct pd_tok *t, int32_t id);
/* BOS: the first special token of post_processor's TemplateProcessing, else the first present of
 * <｜begin▁of▁sentence｜>, <|begin_of_text|>, <s>, <|endoftext|>. EOS: the first present of
 * <｜end▁of▁sentence｜>, <|end_of_text|>, </s>, <|endoftext|>. -1 when there is none. */
int32_t pd_tok_bos(const struct pd_tok *t);
int32_t pd_tok_eos(const struct pd_tok *t);

/* Trains a byte-level BPE on text and writes a tokenizer.json that pd_tok_load (and HF) read.
 * Ids: the specials first (0..n_special-1, in the order given, also listed in added_tokens with
 * special=true), then the 256 byte tokens in byte order, then one token per merge. Merges are
 * learnt within pre-tokenized words (the cl100k-style pattern, written into the file as a Split
 * step) by pair frequency, ties broken by the smaller (left id, right id); a merge whose bytes
 * are already a token is recorded without a new id, as HF's trainer does. Stops at exactly
 * vocab_size ids; PD_EINVAL if the text has too few distinct pairs to get there. Deterministic:
 * the same arguments give the same bytes. *json_out is malloc'ed. */
int pd_tok_train(const char *text, size_t len, int vocab_size, const char *const *special,
                 int n_special, char **json_out, pd_err *e);

/* The GPT-2 byte map: byte -> code point of its printable stand-in, and back (-1 if cp is
 * not one of the 256). Exposed for tests and tools. */
uint32_t pd_tok_byte_to_cp(uint8_t b);
int pd_tok_cp_to_byte(uint32_t cp);

/* Pre-tokenization of text by a Split regex alone (tests and diagnostics): compiles pattern
 * (label names it in errors) and returns the Isolated pieces as byte offsets: piece i is
 * [(*bounds)[i], (*bounds)[i+1]). *bounds is malloc'ed with *n + 1 entries. */
int pd_tok_regex_split(const char *pattern, const char *label, const char *text, size_t len,
                       size_t **bounds, size_t *n, pd_err *e);

#endif

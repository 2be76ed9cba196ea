/* libFuzzer harness for the tokenizer: the input is a tokenizer.json, a NUL byte, then a text.
 * A file is either refused with one line naming it (and nothing allocated), or loads; then the
 * text either encodes or fails with a message naming the file (a missing byte token, a regex
 * limit); encoded ids are all in range with bytes, encode_into agrees with encode, each id's
 * bytes are decode_one's, and decode(encode(text)) == text unless the file changes the text
 * (a Split "Removed", ByteLevel's add_prefix_space, an added token's lstrip/rstrip). Built by
 * `make fuzz`; seeds in tests/fuzz/seeds/tokenizer/. */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/fuzz.h"
#include "model/tokenizer.h"

/* Does any object in x ask for text to be dropped or added? */
static int changes_text(json_t *x)
{
    if (json_is_array(x)) {
        for (size_t i = 0; i < json_array_size(x); i++)
            if (changes_text(json_array_get(x, i)))
                return 1;
        return 0;
    }
    if (!json_is_object(x))
        return 0;
    /* ByteLevel's add_prefix_space defaults to true, as in HF */
    json_t *type = json_object_get(x, "type");
    if (json_is_string(type) && !strcmp(json_string_value(type), "ByteLevel") &&
        !json_is_false(json_object_get(x, "add_prefix_space")))
        return 1;
    const char *k;
    json_t *v;
    json_object_foreach(x, k, v) {
        if ((!strcmp(k, "add_prefix_space") || !strcmp(k, "lstrip") || !strcmp(k, "rstrip")) &&
            json_is_true(v))
            return 1;
        if (!strcmp(k, "behavior") && json_is_string(v) && !strcmp(json_string_value(v), "Removed"))
            return 1;
        if (changes_text(v))
            return 1;
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nul = memchr(data, 0, size);
    size_t jlen = nul ? (size_t)(nul - data) : size;
    const char *text = nul ? (const char *)nul + 1 : "";
    size_t tlen = nul ? size - jlen - 1 : 0;
    char *json = malloc(jlen + 1);
    CHECK(json);
    memcpy(json, data, jlen);
    json[jlen] = 0;

    struct pd_tok *t = (struct pd_tok *)1;
    pd_err e = {0};
    int rc = pd_tok_parse(json, "fuzz.json", &t, &e);
    if (rc) {
        CHECK(rc == PD_EFORMAT || rc == PD_ENOMEM || rc == PD_ERANGE || rc == PD_EINVAL);
        CHECK(e.code == rc && strncmp(e.msg, "fuzz.json", 9) == 0 && !strchr(e.msg, '\n'));
        free(json);
        return 0;
    }
    int32_t vs = pd_tok_vocab_size(t);
    int32_t *ids = NULL;
    size_t n = 0;
    rc = pd_tok_encode(t, text, tlen, &ids, &n, &e);
    if (rc) {
        CHECK(rc == PD_EINVAL || rc == PD_ENOMEM);
        CHECK(e.code == rc && strncmp(e.msg, "fuzz.json", 9) == 0 && !strchr(e.msg, '\n'));
        CHECK(ids == NULL && n == 0);
        pd_tok_free(t);
        free(json);
        return 0;
    }
    size_t total = 0;
    char buf[4096];
    for (size_t i = 0; i < n; i++) {
        CHECK(ids[i] >= 0 && ids[i] < vs);
        size_t bl = 0;
        const char *b = pd_tok_token_bytes(t, ids[i], &bl);
        CHECK(b != NULL && bl <= pd_tok_max_token_bytes(t));
        if (bl <= sizeof buf) {
            int k = pd_tok_decode_one(t, ids[i], buf, sizeof buf);
            CHECK(k == (int)bl && memcmp(buf, b, bl) == 0);
        }
        total += bl;
    }
    /* into a buffer one short, then exactly sized */
    if (n > 0) {
        int32_t *into = malloc(n * sizeof *into);
        CHECK(into);
        size_t m = 0;
        CHECK(pd_tok_encode_into(t, text, tlen, into, n - 1, &m, &e) == PD_ERANGE && m == n);
        CHECK(pd_tok_encode_into(t, text, tlen, into, n, &m, &e) == 0 && m == n);
        CHECK(memcmp(into, ids, n * sizeof *ids) == 0);
        free(into);
    }
    char *out = NULL;
    size_t ol = 0;
    CHECK(pd_tok_decode(t, ids, n, &out, &ol) == 0 && ol == total && out[ol] == 0);
    json_t *root = json_loads(json, 0, NULL);
    CHECK(root);
    if (!changes_text(root))
        CHECK(ol == tlen && memcmp(out, text, tlen) == 0);
    json_decref(root);
    free(out);
    free(ids);
    pd_tok_free(t);
    free(json);
    return 0;
}

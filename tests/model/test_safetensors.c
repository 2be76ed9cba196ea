/* Tests of the safetensors reader and writer: round trips (mapped, header-only, in memory,
 * sharded directories) and one test per validation rule, each checking the error code and that
 * the message names the file and the tensor or field at fault. Every file is written into a
 * fresh mkdtemp directory that the fixture removes. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "../tmpmodel.h"
#include "model/safetensors.h"

static char dir[] = "/tmp/pd_st_test_XXXXXX";

static void setup(void)
{
    cr_assert_not_null(mkdtemp(dir));
}

/* Every test writes its files directly in dir. */
static void teardown(void)
{
    rm_flat_dir(dir);
}

TestSuite(safetensors, .init = setup, .fini = teardown);

static char *path_of(const char *name)
{
    static char buf[4][512];
    static int k;
    char *p = buf[k++ % 4];
    snprintf(p, sizeof buf[0], "%s/%s", dir, name);
    return p;
}

/* Writes a raw file: the 8-byte length (hlen, or strlen(json) when hlen is ~0), the JSON and
 * data_len bytes of data (byte i = i * 7 + 1). */
static const char *write_raw_len(const char *name, uint64_t hlen, const char *json, size_t data_len)
{
    const char *p = path_of(name);
    FILE *fp = fopen(p, "wb");
    cr_assert_not_null(fp);
    if (hlen == ~0ull)
        hlen = strlen(json);
    uint8_t pre[8];
    for (int i = 0; i < 8; i++)
        pre[i] = (uint8_t)(hlen >> (8 * i));
    cr_assert_eq(fwrite(pre, 1, 8, fp), 8);
    cr_assert_eq(fwrite(json, 1, strlen(json), fp), strlen(json));
    for (size_t i = 0; i < data_len; i++)
        fputc((int)(uint8_t)(i * 7 + 1), fp);
    cr_assert_eq(fclose(fp), 0);
    return p;
}

static const char *write_raw(const char *name, const char *json, size_t data_len)
{
    return write_raw_len(name, ~0ull, json, data_len);
}

static void *slurp(const char *p, size_t *len)
{
    FILE *fp = fopen(p, "rb");
    cr_assert_not_null(fp);
    fseek(fp, 0, SEEK_END);
    *len = (size_t)ftell(fp);
    fseek(fp, 0, SEEK_SET);
    void *b = malloc(*len ? *len : 1);
    cr_assert_eq(fread(b, 1, *len, fp), *len);
    fclose(fp);
    return b;
}

static void write_text(const char *name, const char *text)
{
    FILE *fp = fopen(path_of(name), "w");
    cr_assert_not_null(fp);
    fputs(text, fp);
    fclose(fp);
}

static bool is_zeroed(const struct pd_st_file *f)
{
    static const struct pd_st_file z;
    return memcmp(f, &z, sizeof z) == 0;
}

/* The file must be rejected the same way by the mapped open, the header-only open and the
 * in-memory parser: same code, message containing the file name and both substrings. */
static void expect_bad(const char *p, int code, const char *sub1, const char *sub2)
{
    const char *base = strrchr(p, '/') + 1;
    for (int mode = 0; mode < 3; mode++) {
        struct pd_st_file f;
        pd_err e = {0};
        int rc;
        if (mode < 2) {
            rc = pd_st_open(p, mode ? PD_ST_HEADER_ONLY : 0, &f, &e);
        } else {
            size_t len;
            void *b = slurp(p, &len);
            rc = pd_st_parse(b, len, base, &f, &e);
            free(b);
        }
        cr_assert_eq(rc, code, "mode %d: rc %d, want %d (%s)", mode, rc, code, e.msg);
        cr_assert_eq(e.code, code);
        cr_assert(strstr(e.msg, base), "mode %d: file name missing from: %s", mode, e.msg);
        cr_assert(strstr(e.msg, sub1), "mode %d: \"%s\" missing from: %s", mode, sub1, e.msg);
        if (sub2)
            cr_assert(strstr(e.msg, sub2), "mode %d: \"%s\" missing from: %s", mode, sub2, e.msg);
        cr_assert(!strchr(e.msg, '\n'), "message is not one line: %s", e.msg);
        cr_assert(is_zeroed(&f), "failed open left state behind");
        pd_st_close(&f);
    }
}

/* ---- round trips ---- */

static float w_data[6] = {1.5f, -2, 3.25f, 0, 1e-3f, 42};
static uint16_t b_data[5] = {0x3f80, 0x4000, 0xbf80, 0, 0x7f80};
static int64_t s_data[1] = {-123456789012345};
static uint8_t z_data[3] = {0x01, 0x80, 0xff};

static size_t sample(struct pd_st_out *o)
{
    memset(o, 0, 5 * sizeof *o);
    o[0] = (struct pd_st_out){"layers.0.w", PD_ST_F32, 2, {2, 3}, w_data};
    o[1] = (struct pd_st_out){"b", PD_ST_BF16, 1, {5}, b_data};
    o[2] = (struct pd_st_out){"scalar", PD_ST_I64, 0, {0}, s_data};
    o[3] = (struct pd_st_out){"empty", PD_ST_U8, 1, {0}, NULL};
    o[4] = (struct pd_st_out){"z.fp8", PD_ST_F8_E4M3, 1, {3}, z_data};
    return 5;
}

/* Checks f against sample(): names sorted, every field, offsets in write order, data bytes. */
static void check_sample(const struct pd_st_file *f, bool with_data)
{
    struct pd_st_out o[5];
    size_t n = sample(o);
    cr_assert_eq(f->n, n);
    for (size_t i = 1; i < f->n; i++)
        cr_assert_lt(strcmp(f->tensors[i - 1].name, f->tensors[i].name), 0);
    uint64_t off = 0;
    for (size_t i = 0; i < n; i++) {
        const struct pd_st_tensor *t = pd_st_find(f, o[i].name);
        cr_assert_not_null(t, "%s not found", o[i].name);
        cr_assert_str_eq(t->name, o[i].name);
        cr_assert_eq(t->dtype, o[i].dtype);
        cr_assert_eq(t->ndim, o[i].ndim);
        size_t bytes = pd_st_dtype_size(o[i].dtype);
        for (int d = 0; d < t->ndim; d++) {
            cr_assert_eq(t->shape[d], o[i].shape[d]);
            bytes *= (size_t)o[i].shape[d];
        }
        cr_assert_eq(t->begin, off, "%s begin %llu, want %llu", t->name,
                     (unsigned long long)t->begin, (unsigned long long)off);
        cr_assert_eq(t->end, off + bytes);
        off += bytes;
        if (with_data) {
            cr_assert_not_null(t->data);
            if (bytes)
                cr_assert_eq(memcmp(t->data, o[i].data, bytes), 0, "%s data differs", t->name);
        } else {
            cr_assert_null(t->data);
        }
    }
    cr_assert_eq(f->file_size, 8 + f->header_len + off);
    cr_assert_null(pd_st_find(f, "missing"));
    cr_assert_null(pd_st_find(f, ""));
    cr_assert_null(pd_st_find(f, "zz"));
}

Test(safetensors, write_then_read_mapped)
{
    struct pd_st_out o[5];
    size_t n = sample(o);
    pd_err e = {0};
    const char *p = path_of("rt.safetensors");
    cr_assert_eq(pd_st_write(p, o, n, &e), 0, "%s", e.msg);
    cr_assert_neq(access(path_of("rt.safetensors.tmp"), F_OK), 0, "temporary file left behind");

    struct pd_st_file f;
    cr_assert_eq(pd_st_open(p, 0, &f, &e), 0, "%s", e.msg);
    cr_assert_not_null(f.map);
    cr_assert_str_eq(f.path, p);
    cr_assert_eq((8 + f.header_len) % 8, 0, "data section not 8-byte aligned");
    const uint8_t *base = f.map;
    cr_assert_eq(base[8], '{');
    cr_assert_eq(base[8 + f.header_len - 1] == ' ' || base[8 + f.header_len - 1] == '}', 1);
    for (size_t i = 0; i < f.n; i++)
        cr_assert_eq(f.tensors[i].data, base + 8 + f.header_len + f.tensors[i].begin);
    check_sample(&f, true);
    pd_st_close(&f);
    cr_assert(is_zeroed(&f));
    pd_st_close(&f);
}

Test(safetensors, header_only_same_table)
{
    struct pd_st_out o[5];
    size_t n = sample(o);
    pd_err e = {0};
    const char *p = path_of("ho.safetensors");
    cr_assert_eq(pd_st_write(p, o, n, &e), 0, "%s", e.msg);
    struct pd_st_file a, h;
    cr_assert_eq(pd_st_open(p, 0, &a, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_st_open(p, PD_ST_HEADER_ONLY, &h, &e), 0, "%s", e.msg);
    cr_assert_null(h.map);
    cr_assert_eq(h.header_len, a.header_len);
    cr_assert_eq(h.file_size, a.file_size);
    cr_assert_eq(h.n, a.n);
    for (size_t i = 0; i < a.n; i++) {
        cr_assert_str_eq(h.tensors[i].name, a.tensors[i].name);
        cr_assert_eq(h.tensors[i].dtype, a.tensors[i].dtype);
        cr_assert_eq(h.tensors[i].ndim, a.tensors[i].ndim);
        cr_assert_eq(memcmp(h.tensors[i].shape, a.tensors[i].shape, sizeof a.tensors[i].shape), 0);
        cr_assert_eq(h.tensors[i].begin, a.tensors[i].begin);
        cr_assert_eq(h.tensors[i].end, a.tensors[i].end);
    }
    check_sample(&h, false);
    pd_st_close(&a);
    pd_st_close(&h);
}

Test(safetensors, parse_in_memory_points_into_buffer)
{
    struct pd_st_out o[5];
    size_t n = sample(o);
    pd_err e = {0};
    const char *p = path_of("mem.safetensors");
    cr_assert_eq(pd_st_write(p, o, n, &e), 0, "%s", e.msg);
    size_t len;
    uint8_t *b = slurp(p, &len);
    struct pd_st_file f;
    cr_assert_eq(pd_st_parse(b, len, "mem", &f, &e), 0, "%s", e.msg);
    cr_assert_null(f.map);
    cr_assert_str_eq(f.path, "mem");
    for (size_t i = 0; i < f.n; i++)
        cr_assert_eq(f.tensors[i].data, b + 8 + f.header_len + f.tensors[i].begin);
    check_sample(&f, true);
    pd_st_close(&f);
    free(b);
}

Test(safetensors, hand_written_file_with_metadata_and_padding)
{
    /* Keys out of name order, zero-sized tensors sharing an offset with a real one, metadata,
     * trailing spaces in the header: all valid. */
    const char *p = write_raw("hand.safetensors",
                              "{\"__metadata__\":{\"format\":\"pt\"},"
                              "\"z\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[2,6]},"
                              "\"e\":{\"dtype\":\"F32\",\"shape\":[0,5],\"data_offsets\":[2,2]},"
                              "\"a\":{\"dtype\":\"I16\",\"shape\":[1],\"data_offsets\":[0,2]},"
                              "\"e0\":{\"dtype\":\"BOOL\",\"shape\":[0],"
                              "\"data_offsets\":[0,0]}}   ",
                              6);
    struct pd_st_file f;
    pd_err e = {0};
    cr_assert_eq(pd_st_open(p, 0, &f, &e), 0, "%s", e.msg);
    cr_assert_eq(f.n, 4);
    cr_assert_str_eq(f.tensors[0].name, "a");
    cr_assert_str_eq(f.tensors[1].name, "e");
    cr_assert_str_eq(f.tensors[2].name, "e0");
    cr_assert_str_eq(f.tensors[3].name, "z");
    cr_assert_null(pd_st_find(&f, "__metadata__"));
    const struct pd_st_tensor *z = pd_st_find(&f, "z");
    const uint8_t *d = z->data;
    for (int i = 0; i < 4; i++)
        cr_assert_eq(d[i], (uint8_t)((2 + i) * 7 + 1));
    cr_assert_eq(pd_st_find(&f, "e")->ndim, 2);
    cr_assert_eq(pd_st_find(&f, "e")->shape[1], 5);
    pd_st_close(&f);
}

Test(safetensors, empty_file_valid_only_without_data)
{
    struct pd_st_file f;
    pd_err e = {0};
    cr_assert_eq(pd_st_write(path_of("none.safetensors"), NULL, 0, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_st_open(path_of("none.safetensors"), 0, &f, &e), 0, "%s", e.msg);
    cr_assert_eq(f.n, 0);
    pd_st_close(&f);
    expect_bad(write_raw("nonempty.safetensors", "{}", 4), PD_EFORMAT, "no tensors", "4 bytes");
}

Test(safetensors, sharded_directory_with_index)
{
    float a[4] = {1, 2, 3, 4}, c[2] = {5, 6};
    int32_t b[3] = {7, 8, 9};
    struct pd_st_out s1[2] = {{"model.a", PD_ST_F32, 2, {2, 2}, a},
                              {"model.b", PD_ST_I32, 1, {3}, b}};
    struct pd_st_out s2[1] = {{"lm_head", PD_ST_F32, 1, {2}, c}};
    pd_err e = {0};
    cr_assert_eq(pd_st_write(path_of("model-00001-of-00002.safetensors"), s1, 2, &e), 0, "%s",
                 e.msg);
    cr_assert_eq(pd_st_write(path_of("model-00002-of-00002.safetensors"), s2, 1, &e), 0, "%s",
                 e.msg);
    write_text("model.safetensors.index.json",
               "{\"metadata\":{\"total_size\":36},\"weight_map\":{"
               "\"model.a\":\"model-00001-of-00002.safetensors\","
               "\"lm_head\":\"model-00002-of-00002.safetensors\","
               "\"model.b\":\"model-00001-of-00002.safetensors\"}}");
    for (int flags = 0; flags <= PD_ST_HEADER_ONLY; flags++) {
        struct pd_st_set s;
        cr_assert_eq(pd_st_open_dir(dir, flags, &s, &e), 0, "%s", e.msg);
        cr_assert_eq(s.nfiles, 2, "each shard opened once");
        const struct pd_st_tensor *t = pd_st_set_find(&s, "model.a");
        cr_assert_not_null(t);
        cr_assert_eq(t->shape[1], 2);
        cr_assert_not_null(pd_st_set_find(&s, "model.b"));
        t = pd_st_set_find(&s, "lm_head");
        cr_assert_not_null(t);
        if (flags) {
            cr_assert_null(t->data);
        } else {
            cr_assert_eq(memcmp(t->data, c, sizeof c), 0);
            cr_assert_eq(memcmp(pd_st_set_find(&s, "model.b")->data, b, sizeof b), 0);
        }
        cr_assert_null(pd_st_set_find(&s, "model.c"));
        pd_st_close_dir(&s);
        pd_st_close_dir(&s);
    }
}

Test(safetensors, single_file_directory)
{
    float a[2] = {1, 2};
    struct pd_st_out o = {"x", PD_ST_F32, 1, {2}, a};
    pd_err e = {0};
    struct pd_st_set s;
    cr_assert_eq(pd_st_open_dir(dir, 0, &s, &e), PD_EIO);
    cr_assert(strstr(e.msg, "model.safetensors"), "%s", e.msg);
    cr_assert_eq(s.nfiles, 0);
    cr_assert_null(s.files);
    cr_assert_eq(pd_st_write(path_of("model.safetensors"), &o, 1, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_st_open_dir(dir, 0, &s, &e), 0, "%s", e.msg);
    cr_assert_eq(s.nfiles, 1);
    cr_assert_eq(((const float *)pd_st_set_find(&s, "x")->data)[1], 2.0f);
    pd_st_close_dir(&s);
}

Test(safetensors, dtype_names_and_sizes)
{
    static const size_t sizes[PD_ST_DTYPE_COUNT] = {1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 8, 8, 8, 1, 1, 1};
    for (int i = 0; i < PD_ST_DTYPE_COUNT; i++) {
        enum pd_st_dtype d;
        cr_assert_eq(pd_st_dtype_parse(pd_st_dtype_name((enum pd_st_dtype)i), &d), 0);
        cr_assert_eq((int)d, i);
        cr_assert_eq(pd_st_dtype_size((enum pd_st_dtype)i), sizes[i], "dtype %s",
                     pd_st_dtype_name((enum pd_st_dtype)i));
    }
    enum pd_st_dtype d;
    cr_assert_eq(pd_st_dtype_parse("f32", &d), PD_EINVAL);
    cr_assert_eq(pd_st_dtype_parse("F8_E4M3FN", &d), PD_EINVAL);
    cr_assert_str_eq(pd_st_dtype_name(PD_ST_F8_E8M0), "F8_E8M0");
    cr_assert_str_eq(pd_st_dtype_name(PD_ST_BF16), "BF16");
}

Test(safetensors, close_is_safe_on_zeroed_structs)
{
    struct pd_st_file f = {0};
    struct pd_st_set s = {0};
    pd_st_close(&f);
    pd_st_close_dir(&s);
    pd_st_close(NULL);
    pd_st_close_dir(NULL);
}

Test(safetensors, writer_rejects_bad_tensors)
{
    float a[2] = {1, 2};
    pd_err e = {0};
    const char *p = path_of("w.safetensors");
    struct pd_st_out dup[2] = {{"same", PD_ST_F32, 1, {2}, a}, {"same", PD_ST_F32, 1, {2}, a}};
    cr_assert_eq(pd_st_write(p, dup, 2, &e), PD_EINVAL);
    cr_assert(strstr(e.msg, "\"same\""), "%s", e.msg);
    struct pd_st_out neg = {"neg", PD_ST_F32, 1, {-2}, a};
    cr_assert_eq(pd_st_write(p, &neg, 1, &e), PD_EINVAL);
    cr_assert(strstr(e.msg, "\"neg\""), "%s", e.msg);
    struct pd_st_out nod = {"nodata", PD_ST_F32, 1, {2}, NULL};
    cr_assert_eq(pd_st_write(p, &nod, 1, &e), PD_EINVAL);
    struct pd_st_out bad = {"bad", PD_ST_DTYPE_COUNT, 1, {2}, a};
    cr_assert_eq(pd_st_write(p, &bad, 1, &e), PD_EINVAL);
    struct pd_st_out md = {"__metadata__", PD_ST_F32, 1, {2}, a};
    cr_assert_eq(pd_st_write(p, &md, 1, &e), PD_EINVAL);
    cr_assert_neq(access(p, F_OK), 0, "nothing written on error");
    cr_assert_eq(pd_st_write("/nonexistent-dir/x.safetensors", NULL, 0, &e), PD_EIO);
    cr_assert(strstr(e.msg, "/nonexistent-dir/x.safetensors"), "%s", e.msg);
}

/* ---- one test per violation ---- */

/* One F32 header entry: T("w", "[2]", 0, 8). */
#define T(name, shape, b, e) \
    "\"" name "\":{\"dtype\":\"F32\",\"shape\":" shape ",\"data_offsets\":[" #b "," #e "]}"

Test(safetensors, missing_file)
{
    struct pd_st_file f;
    pd_err e = {0};
    cr_assert_eq(pd_st_open(path_of("absent.safetensors"), 0, &f, &e), PD_EIO);
    cr_assert(strstr(e.msg, "absent.safetensors"), "%s", e.msg);
    cr_assert(is_zeroed(&f));
    pd_st_close(&f);
}

Test(safetensors, file_shorter_than_prefix)
{
    const char *p = path_of("short.safetensors");
    FILE *fp = fopen(p, "wb");
    fputs("{}", fp);
    fclose(fp);
    expect_bad(p, PD_EFORMAT, "too short", NULL);
}

Test(safetensors, header_length_larger_than_file)
{
    expect_bad(write_raw_len("hl.safetensors", 1000, "{}", 10), PD_EFORMAT, "header length 1000",
               "only 12 bytes");
}

Test(safetensors, header_length_over_bound)
{
    expect_bad(write_raw_len("big.safetensors", PD_ST_MAX_HEADER + 1, "{}", 0), PD_EFORMAT,
               "header length 100000001", "exceeds the limit");
}

Test(safetensors, header_not_json)
{
    expect_bad(write_raw("nj.safetensors", "{\"w\": nope}", 0), PD_EFORMAT, "not valid JSON",
               "line 1");
}

/* Fuzzer finding: jansson's error text quotes the input near the error, raw control bytes
 * included, which broke the one-line message. expect_bad checks there is no newline. */
Test(safetensors, json_error_message_stays_one_line)
{
    expect_bad(write_raw("nl.safetensors", "{\"lay\\\nrs\":{}}", 0), PD_EFORMAT, "not valid JSON",
               "near '\"lay\\?'");
    write_text("model.safetensors.index.json", "{\"weight_map\":{\"a\\\nb\":1}}");
    struct pd_st_set s;
    pd_err e = {0};
    cr_assert_eq(pd_st_open_dir(dir, 0, &s, &e), PD_EFORMAT);
    cr_assert(strstr(e.msg, "model.safetensors.index.json: not valid JSON"), "%s", e.msg);
    cr_assert(!strchr(e.msg, '\n'), "message is not one line: %s", e.msg);
}

Test(safetensors, header_json_not_object)
{
    expect_bad(write_raw("arr.safetensors", "[1, 2]", 0), PD_EFORMAT, "not an object", NULL);
}

Test(safetensors, header_leading_whitespace)
{
    expect_bad(write_raw("ws.safetensors", " {}", 0), PD_EFORMAT, "start with '{'", NULL);
}

Test(safetensors, duplicate_tensor_name)
{
    expect_bad(write_raw("dup.safetensors",
                         "{" T("dup.w", "[1]", 0, 4) "," T("dup.w", "[1]", 4, 8) "}", 8),
               PD_EFORMAT, "duplicate name \"dup.w\"", NULL);
}

Test(safetensors, unknown_dtype)
{
    expect_bad(write_raw("dt.safetensors",
                         "{\"layers.1.q\":{\"dtype\":\"F33\",\"shape\":[1],"
                         "\"data_offsets\":[0,4]}}",
                         4),
               PD_EFORMAT, "tensor \"layers.1.q\"", "unknown dtype \"F33\"");
}

Test(safetensors, dtype_not_string)
{
    expect_bad(write_raw("dts.safetensors",
                         "{\"w\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", 4),
               PD_EFORMAT, "tensor \"w\"", "\"dtype\"");
}

Test(safetensors, negative_shape_entry)
{
    expect_bad(write_raw("neg.safetensors", "{" T("neg.w", "[2,-1]", 0, 4) "}", 4), PD_EFORMAT,
               "tensor \"neg.w\"", "shape[1] = -1 is negative");
}

Test(safetensors, shape_not_integers)
{
    expect_bad(write_raw("shf.safetensors", "{" T("f.w", "[2.0]", 0, 8) "}", 8), PD_EFORMAT,
               "tensor \"f.w\"", "shape[0] is not an integer");
}

Test(safetensors, too_many_dims)
{
    expect_bad(write_raw("dims.safetensors", "{" T("d.w", "[1,1,1,1,1,1,1,1,1]", 0, 4) "}", 4),
               PD_EFORMAT, "tensor \"d.w\"", "9 dimensions");
}

Test(safetensors, shape_product_overflow)
{
    /* 2^32 * 2^32 overflows before the final 0 is reached, as in the reference. */
    expect_bad(write_raw("ovf.safetensors",
                         "{" T("ovf.w", "[4294967296,4294967296,0]", 0, 0) "}", 0),
               PD_EFORMAT, "tensor \"ovf.w\"", "overflows");
    /* numel fits but numel * 4 bytes does not. */
    expect_bad(write_raw("ovf4.safetensors", "{" T("ovf4.w", "[4611686018427387904]", 0, 0) "}", 0),
               PD_EFORMAT, "tensor \"ovf4.w\"", "overflows");
}

Test(safetensors, size_mismatch_between_shape_and_offsets)
{
    expect_bad(write_raw("sz.safetensors", "{" T("layers.0.w", "[3]", 0, 8) "}", 8), PD_EFORMAT,
               "tensor \"layers.0.w\": data_offsets [0, 8] but shape [3] x F32 needs 12 bytes",
               NULL);
}

Test(safetensors, gap_between_tensors)
{
    expect_bad(write_raw("gap.safetensors",
                         "{" T("gap.a", "[1]", 0, 4) "," T("gap.b", "[1]", 8, 12) "}", 12),
               PD_EFORMAT, "tensor \"gap.b\"", "gap");
    expect_bad(write_raw("gap0.safetensors", "{" T("gap.first", "[1]", 4, 8) "}", 8), PD_EFORMAT,
               "tensor \"gap.first\"", "gap");
}

Test(safetensors, overlapping_tensors)
{
    expect_bad(write_raw("ovl.safetensors",
                         "{" T("ovl.a", "[2]", 0, 8) "," T("ovl.b", "[2]", 4, 12) "}", 12),
               PD_EFORMAT, "tensor \"ovl.b\"", "overlap tensor \"ovl.a\"");
    /* Two tensors on the same bytes. */
    expect_bad(write_raw("same.safetensors",
                         "{" T("s.a", "[1]", 0, 4) "," T("s.b", "[1]", 0, 4) "}", 4),
               PD_EFORMAT, "overlap", "\"s.a\"");
}

Test(safetensors, trailing_bytes_after_last_tensor)
{
    expect_bad(write_raw("trail.safetensors", "{" T("trail.w", "[1]", 0, 4) "}", 8), PD_EFORMAT,
               "4 trailing bytes", "\"trail.w\"");
}

Test(safetensors, offsets_beyond_data_section)
{
    expect_bad(write_raw("beyond.safetensors", "{" T("beyond.w", "[4]", 0, 16) "}", 8), PD_EFORMAT,
               "tensor \"beyond.w\"", "beyond the data section (8 bytes)");
}

Test(safetensors, begin_after_end)
{
    expect_bad(write_raw("order.safetensors", "{" T("order.w", "[1]", 8, 4) "}", 8), PD_EFORMAT,
               "tensor \"order.w\"", "begin > end");
}

Test(safetensors, offsets_malformed)
{
    expect_bad(write_raw("offs.safetensors",
                         "{\"o.w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4),
               PD_EFORMAT, "tensor \"o.w\"", "data_offsets");
    expect_bad(write_raw("offn.safetensors",
                         "{\"o.n\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 4),
               PD_EFORMAT, "tensor \"o.n\"", "data_offsets");
    expect_bad(write_raw("ent.safetensors", "{\"o.e\":[1,2]}", 0), PD_EFORMAT, "tensor \"o.e\"",
               "not a JSON object");
}

Test(safetensors, metadata_with_non_string_value)
{
    expect_bad(write_raw("md.safetensors",
                         "{\"__metadata__\":{\"format\":\"pt\",\"step\":1000},"
                         T("w", "[1]", 0, 4) "}",
                         4),
               PD_EFORMAT, "\"__metadata__\"", "\"step\"");
    expect_bad(write_raw("mdo.safetensors", "{\"__metadata__\":[]}", 0), PD_EFORMAT,
               "\"__metadata__\"", "not an object");
}

static void write_two_shards(void)
{
    float a[2] = {1, 2}, b[1] = {3};
    struct pd_st_out s1 = {"enc.w", PD_ST_F32, 1, {2}, a}, s2 = {"dec.w", PD_ST_F32, 1, {1}, b};
    pd_err e = {0};
    cr_assert_eq(pd_st_write(path_of("model-00001.safetensors"), &s1, 1, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_st_write(path_of("model-00002.safetensors"), &s2, 1, &e), 0, "%s", e.msg);
}

static void expect_dir_bad(int code, const char *sub1, const char *sub2)
{
    struct pd_st_set s;
    pd_err e = {0};
    int rc = pd_st_open_dir(dir, 0, &s, &e);
    cr_assert_eq(rc, code, "rc %d, want %d (%s)", rc, code, e.msg);
    cr_assert(strstr(e.msg, sub1), "\"%s\" missing from: %s", sub1, e.msg);
    if (sub2)
        cr_assert(strstr(e.msg, sub2), "\"%s\" missing from: %s", sub2, e.msg);
    cr_assert_eq(s.nfiles, 0);
    cr_assert_null(s.files);
    pd_st_close_dir(&s);
}

Test(safetensors, index_points_to_missing_shard)
{
    write_two_shards();
    write_text("model.safetensors.index.json",
               "{\"weight_map\":{\"enc.w\":\"model-00001.safetensors\","
               "\"dec.w\":\"model-00003.safetensors\"}}");
    expect_dir_bad(PD_EIO, "model-00003.safetensors", "cannot open");
}

Test(safetensors, index_names_tensor_absent_from_shard)
{
    write_two_shards();
    write_text("model.safetensors.index.json",
               "{\"weight_map\":{\"enc.w\":\"model-00001.safetensors\","
               "\"dec.w\":\"model-00002.safetensors\",\"ghost.w\":\"model-00002.safetensors\"}}");
    expect_dir_bad(PD_EFORMAT, "tensor \"ghost.w\"", "model-00002.safetensors");
}

Test(safetensors, index_tensor_in_two_shards)
{
    float a[2] = {1, 2};
    struct pd_st_out s1[2] = {{"enc.w", PD_ST_F32, 1, {2}, a}, {"dec.w", PD_ST_F32, 1, {2}, a}};
    struct pd_st_out s2 = {"dec.w", PD_ST_F32, 1, {2}, a};
    pd_err e = {0};
    cr_assert_eq(pd_st_write(path_of("model-00001.safetensors"), s1, 2, &e), 0, "%s", e.msg);
    cr_assert_eq(pd_st_write(path_of("model-00002.safetensors"), &s2, 1, &e), 0, "%s", e.msg);
    write_text("model.safetensors.index.json",
               "{\"weight_map\":{\"enc.w\":\"model-00001.safetensors\","
               "\"dec.w\":\"model-00002.safetensors\"}}");
    expect_dir_bad(PD_EFORMAT, "tensor \"dec.w\"", "both");
}

Test(safetensors, index_shard_name_escapes_directory)
{
    write_two_shards();
    write_text("model.safetensors.index.json",
               "{\"weight_map\":{\"enc.w\":\"../model-00001.safetensors\"}}");
    expect_dir_bad(PD_EFORMAT, "model.safetensors.index.json", "\"../model-00001.safetensors\"");
    write_text("model.safetensors.index.json",
               "{\"weight_map\":{\"enc.w\":\"/etc/passwd\"}}");
    expect_dir_bad(PD_EFORMAT, "\"enc.w\"", "\"/etc/passwd\"");
}

Test(safetensors, index_malformed)
{
    write_two_shards();
    write_text("model.safetensors.index.json", "{\"weight_map\":[]}");
    expect_dir_bad(PD_EFORMAT, "model.safetensors.index.json", "weight_map");
    write_text("model.safetensors.index.json", "{\"weight_map\":{\"enc.w\":1}}");
    expect_dir_bad(PD_EFORMAT, "weight_map[\"enc.w\"]", "not a string");
    write_text("model.safetensors.index.json",
               "{\"weight_map\":{\"enc.w\":\"model-00001.safetensors\","
               "\"enc.w\":\"model-00002.safetensors\"}}");
    expect_dir_bad(PD_EFORMAT, "model.safetensors.index.json", "duplicate");
}

Test(safetensors, bad_shard_is_named)
{
    write_two_shards();
    write_raw("model-00003.safetensors", "{" T("bad.w", "[3]", 0, 8) "}", 8);
    write_text("model.safetensors.index.json",
               "{\"weight_map\":{\"enc.w\":\"model-00001.safetensors\","
               "\"bad.w\":\"model-00003.safetensors\"}}");
    expect_dir_bad(PD_EFORMAT, "model-00003.safetensors", "tensor \"bad.w\"");
}

Test(safetensors, header_only_checks_offsets_against_file_size)
{
    /* The header-only open never reads the data but must still see that it is short. */
    const char *p = write_raw("trunc.safetensors", "{" T("t.w", "[4]", 0, 16) "}", 12);
    struct pd_st_file f;
    pd_err e = {0};
    cr_assert_eq(pd_st_open(p, PD_ST_HEADER_ONLY, &f, &e), PD_EFORMAT);
    cr_assert(strstr(e.msg, "beyond the data section (12 bytes)"), "%s", e.msg);
}

/* A tensor name holding a control character (an ESC sequence in a downloaded checkpoint's header)
 * reached the terminal raw through plan --inventory and its warnings: it is refused, shown with
 * '?' in its place. */
Test(safetensors, a_tensor_name_with_a_control_character)
{
    expect_bad(write_raw("esc.safetensors",
                         "{\"a\\u001b]0;pwned\\u0007b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4),
               PD_EFORMAT, "tensor \"a?]0;pwned?b\"", "a control character in its name");
}

/* Bytes of this process's mappings (/proc/self/maps), and whether the mapping holding p is advised
 * MADV_HUGEPAGE ("hg" among its VmFlags in /proc/self/smaps). */
static size_t mapped_bytes(void)
{
    FILE *fp = fopen("/proc/self/maps", "r");
    cr_assert_not_null(fp);
    unsigned long lo, hi;
    size_t total = 0;
    char line[512];
    while (fgets(line, sizeof line, fp))
        if (sscanf(line, "%lx-%lx", &lo, &hi) == 2)
            total += hi - lo;
    fclose(fp);
    return total;
}

static int advised_huge(const void *p)
{
    FILE *fp = fopen("/proc/self/smaps", "r");
    cr_assert_not_null(fp);
    char line[512];
    int in = 0, hg = -1;
    while (fgets(line, sizeof line, fp)) {
        unsigned long lo, hi;
        char sp;
        if (sscanf(line, "%lx-%lx%c", &lo, &hi, &sp) == 3 && sp == ' ')
            in = (uintptr_t)p >= lo && (uintptr_t)p < hi;
        else if (in && strncmp(line, "VmFlags:", 8) == 0)
            hg = strstr(line, " hg") != NULL;
    }
    fclose(fp);
    return hg;
}

/* A file of 2 MiB or more is mapped at a 2 MiB boundary and advised MADV_HUGEPAGE (the kernel can
 * then map its page cache's 2 MiB folios whole); the reservation that alignment takes is given back,
 * at open and at close; the bytes read are the file's. */
Test(safetensors, a_large_file_is_mapped_on_a_2MiB_boundary_for_huge_pages)
{
    const size_t n = (5u << 20) + 123;
    uint8_t *data = malloc(n);
    cr_assert_not_null(data);
    for (size_t i = 0; i < n; i++)
        data[i] = (uint8_t)(i * 7 + 1);
    struct pd_st_out o = {"big", PD_ST_U8, 1, {(int64_t)n}, data};
    pd_err e = {0};
    const char *p = path_of("big.safetensors");
    cr_assert_eq(pd_st_write(p, &o, 1, &e), 0, "%s", e.msg);
    const size_t before = mapped_bytes();
    struct pd_st_file f;
    cr_assert_eq(pd_st_open(p, 0, &f, &e), 0, "%s", e.msg);
    cr_assert_eq((uintptr_t)f.map % (2u << 20), 0, "mapped at %p, not on a 2 MiB boundary", f.map);
    cr_assert_eq(advised_huge(f.map), 1, "the mapping is not advised MADV_HUGEPAGE");
    const size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    cr_assert_eq(mapped_bytes(), before + (f.file_size + pg - 1) / pg * pg,
                 "more mapped than the file: the alignment's reservation was not given back");
    const struct pd_st_tensor *t = pd_st_find(&f, "big");
    cr_assert_not_null(t);
    cr_assert(memcmp(t->data, data, n) == 0);
    struct pd_st_set s = {&f, 1};
    cr_assert_leq(pd_st_pmd_mapped_bytes(&s), f.file_size);
    pd_st_close(&f);
    cr_assert_eq(mapped_bytes(), before, "the mapping outlived its close");
    free(data);
}

/* Pages of the file at path in the page cache (mincore over a mapping nobody touches). */
static size_t cached_pages(const char *path, size_t *total)
{
    int fd = open(path, O_RDONLY);
    cr_assert_geq(fd, 0);
    struct stat st;
    cr_assert_eq(fstat(fd, &st), 0);
    void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    cr_assert_neq(m, MAP_FAILED);
    const size_t pg = (size_t)sysconf(_SC_PAGESIZE), n = ((size_t)st.st_size + pg - 1) / pg;
    unsigned char *v = malloc(n);
    cr_assert_eq(mincore(m, (size_t)st.st_size, v), 0);
    size_t in = 0;
    for (size_t i = 0; i < n; i++)
        in += v[i] & 1;
    free(v);
    munmap(m, (size_t)st.st_size);
    *total = n;
    return in;
}

/* The writer leaves a file of 2 MiB or more out of the page cache once it is on disk (its first
 * reader then reads it cold, in 2 MiB folios where the kernel does); a smaller one stays. */
Test(safetensors, a_written_file_of_2MiB_or_more_leaves_the_page_cache)
{
    struct statfs fs;
    cr_assert_eq(statfs(dir, &fs), 0);
    if (fs.f_type == 0x01021994)   /* TMPFS_MAGIC: its pages are the file, they cannot leave */
        cr_skip_test("%s is on tmpfs", dir);
    const size_t sizes[] = {(5u << 20) + 123, 100000};
    for (int k = 0; k < 2; k++) {
        uint8_t *data = calloc(sizes[k], 1);
        cr_assert_not_null(data);
        struct pd_st_out o = {"big", PD_ST_U8, 1, {(int64_t)sizes[k]}, data};
        pd_err e = {0};
        const char *p = path_of(k ? "small.safetensors" : "big.safetensors");
        cr_assert_eq(pd_st_write(p, &o, 1, &e), 0, "%s", e.msg);
        size_t total, in = cached_pages(p, &total);
        if (k == 0)
            cr_assert_lt(in, total / 8, "%zu of %zu pages still cached after the write", in, total);
        else
            cr_assert_eq(in, total, "a small file left the cache: %zu of %zu pages", in, total);
        free(data);
    }
}

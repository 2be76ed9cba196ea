/* libFuzzer harness for the safetensors parser: any input either fails with a PD_EFORMAT
 * message and leaves nothing allocated, or yields a table whose every invariant holds
 * (offsets inside the buffer and contiguous, sizes matching shapes, names sorted and found).
 * Built by `make fuzz`; seeds in tests/fuzz/seeds/. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/fuzz.h"
#include "model/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct pd_st_file f;
    pd_err e = {0};
    int rc = pd_st_parse(data, size, "fuzz", &f, &e);
    if (rc) {
        static const struct pd_st_file zero;
        CHECK(rc == PD_EFORMAT || rc == PD_ENOMEM);
        CHECK(e.code == rc && strncmp(e.msg, "fuzz: ", 6) == 0 && !strchr(e.msg, '\n'));
        CHECK(memcmp(&f, &zero, sizeof f) == 0);
        pd_st_close(&f);
        return 0;
    }
    CHECK(size >= 8 && f.header_len <= size - 8 && f.file_size == size);
    const uint8_t *base = data + 8 + f.header_len;
    uint64_t data_len = size - 8 - f.header_len, total = 0;
    for (size_t i = 0; i < f.n; i++) {
        const struct pd_st_tensor *t = &f.tensors[i];
        CHECK(t->begin <= t->end && t->end <= data_len);
        CHECK(t->data == base + t->begin);
        CHECK((unsigned)t->dtype < PD_ST_DTYPE_COUNT);
        CHECK(t->ndim >= 0 && t->ndim <= PD_ST_MAX_DIMS);
        /* the element count left to right, then its bytes: the reference's rule, by which
         * [4, 94967296, 296, 429496, 296, 0] of I16 is 0 bytes (the elements' running product stays
         * under 2^64; the bytes' would not) */
        uint64_t elems = 1, bytes;
        for (int d = 0; d < t->ndim; d++) {
            CHECK(t->shape[d] >= 0);
            CHECK(!__builtin_mul_overflow(elems, (uint64_t)t->shape[d], &elems));
        }
        CHECK(!__builtin_mul_overflow(elems, (uint64_t)pd_st_dtype_size(t->dtype), &bytes));
        CHECK(t->end - t->begin == bytes);
        total += bytes;
        if (i > 0)
            CHECK(strcmp(f.tensors[i - 1].name, t->name) < 0);
        CHECK(pd_st_find(&f, t->name) == t);
    }
    /* Contiguous, non-overlapping and covering: the sizes add up to the data section. */
    CHECK(total == data_len);
    pd_st_close(&f);
    return 0;
}

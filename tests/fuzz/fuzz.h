/* What every libFuzzer target shares: its entry point and CHECK, which names the failed condition
 * and its place before it aborts (the crash libFuzzer records with the input). */
#ifndef PD_TESTS_FUZZ_FUZZ_H
#define PD_TESTS_FUZZ_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(c) \
    do { \
        if (!(c)) { \
            fprintf(stderr, "%s:%d: %s failed\n", __FILE__, __LINE__, #c); \
            abort(); \
        } \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif

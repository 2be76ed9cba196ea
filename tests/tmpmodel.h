/* Test helper: a synthetic checkpoint in a fresh temporary directory, and its removal. */
#ifndef PD_TESTS_TMPMODEL_H
#define PD_TESTS_TMPMODEL_H

#include <criterion/criterion.h>
#include <stdio.h>
#include <unistd.h>

#include "engine/genmodel.h"

/* Writes preset `preset` (seed `seed`) into a new /tmp directory whose path goes to dir. */
static inline void tmp_model(const char *preset, int seed, char *dir, size_t n)
{
    snprintf(dir, n, "/tmp/pdmoe-test-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    pd_err e = {0};
    cr_assert_eq(pd_genmodel(preset, dir, (uint64_t)seed, &e), 0, "%s", e.msg);
}

static inline void rm_model(const char *dir)
{
    char p[160];
    const char *f[] = {"model.safetensors", "config.json", "tokenizer.json"};
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, f[i]);
        unlink(p);
    }
    rmdir(dir);
}

#endif

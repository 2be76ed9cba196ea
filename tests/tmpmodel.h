/* Test helpers: a synthetic checkpoint in a fresh temporary directory, and removing such a
 * directory. */
#ifndef PD_TESTS_TMPMODEL_H
#define PD_TESTS_TMPMODEL_H

#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
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

/* Removes dir and the files directly in it (test directories hold no subdirectories). */
static inline void rm_flat_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *de;
    while ((de = readdir(d)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, ".."))
            unlinkat(dirfd(d), de->d_name, 0);
    closedir(d);
    rmdir(dir);
}

static inline void rm_model(const char *dir)
{
    rm_flat_dir(dir);
}

#endif

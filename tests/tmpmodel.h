/* Test helpers: a synthetic checkpoint in a fresh temporary directory, and removing such a
 * directory. */
#ifndef PD_TESTS_TMPMODEL_H
#define PD_TESTS_TMPMODEL_H

#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/genmodel.h"

/* The cosine of two logit vectors of n values (in double). */
static inline double cosine(const float *a, const float *b, int n)
{
    double ab = 0, aa = 0, bb = 0;
    for (int i = 0; i < n; i++) {
        ab += (double)a[i] * b[i];
        aa += (double)a[i] * a[i];
        bb += (double)b[i] * b[i];
    }
    return ab / sqrt(aa * bb);
}

/* Writes preset `preset` (seed `seed`) into a new /tmp directory whose path goes to dir. */
static inline void tmp_model(const char *preset, int seed, char *dir, size_t n)
{
    snprintf(dir, n, "/tmp/pdmoe-test-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    pd_err e = {0};
    cr_assert_eq(pd_genmodel(preset, dir, (uint64_t)seed, &e), 0, "%s", e.msg);
}

/* The same with an MTP draft that agrees with the greedy next token at about `rate`
 * (gen-model --mtp-agreement). */
static inline void tmp_model_agree(const char *preset, int seed, double rate, char *dir, size_t n)
{
    snprintf(dir, n, "/tmp/pdmoe-test-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    pd_err e = {0};
    cr_assert_eq(pd_genmodel_agree(preset, dir, (uint64_t)seed, rate, &e), 0, "%s", e.msg);
}

/* Sets the model's max_position_embeddings in dir/config.json (the engine reads it only as the
 * bound of --max-model-len): for tests that need generations longer than v4-tiny's 4096. */
static inline void tmp_model_positions(const char *dir, long long n)
{
    char path[256];
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_error_t je;
    json_t *c = json_load_file(path, 0, &je);
    cr_assert_not_null(c, "%s: %s", path, je.text);
    json_object_set_new(c, "max_position_embeddings", json_integer(n));
    cr_assert_eq(json_dump_file(c, path, JSON_INDENT(2)), 0);
    json_decref(c);
}

/* A file holding `text`; its path is written over the template `path` ("/tmp/...-XXXXXX"). */
static inline void tmp_text(char *path, const char *text)
{
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0, "%s: %s", path, strerror(errno));
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text), "%s", path);
    close(fd);
}

/* An --expert-stats file whose tokens_per_expert holds `rows` (JSON arrays, comma-separated). */
static inline void tmp_stats_rows(char *path, const char *rows)
{
    size_t cap = strlen(rows) + 32;
    char *text = malloc(cap);
    cr_assert_not_null(text);
    snprintf(text, cap, "{\"tokens_per_expert\": [%s]}\n", rows);
    tmp_text(path, text);
    free(text);
}

/* `layers` rows each `row` (a JSON array), as a model of that many layers reads them. */
static inline void tmp_stats_layers(char *path, const char *row, int layers)
{
    size_t cap = (strlen(row) + 2) * (size_t)layers + 1, n = 0;
    char *rows = malloc(cap);
    cr_assert_not_null(rows);
    rows[0] = 0;
    for (int l = 0; l < layers; l++)
        n += (size_t)snprintf(rows + n, cap - n, "%s%s", l ? ", " : "", row);
    tmp_stats_rows(path, rows);
    free(rows);
}

/* Every one of `layers` layers: `experts` experts, expert 0 with `hot` tokens, the others one each. */
static inline void tmp_expert_stats(char *path, int layers, int experts, int hot)
{
    char row[8192];
    int n = snprintf(row, sizeof row, "[%d", hot);
    for (int x = 1; x < experts && n < (int)sizeof row - 8; x++)
        n += snprintf(row + n, sizeof row - (size_t)n, ",1");
    snprintf(row + n, sizeof row - (size_t)n, "]");
    tmp_stats_layers(path, row, layers);
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

/* Lets the tests start MPI ranks as root. The ranks keep AddressSanitizer's leak check (made before
 * MPI_Finalize, pd_ep_finalize in src/ep/ep.h), and a rank's report reaches the test as any
 * child's does (tests/child.h): mpirun's ranks inherit its environment, ASAN_OPTIONS and its
 * log_path included. */
static inline void mpi_test_env(void)
{
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
}

#endif

/* Runs the pdmoe program as a user does (PDMOE_BIN, else build/pdmoe) and keeps its exit status,
 * stdout and stderr: shared by the command-line tests (tests/cli). */
#ifndef PD_TESTS_RUN_H
#define PD_TESTS_RUN_H

#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

struct run {
    int status;              /* the exit status; 128 when killed by a signal */
    char out[1 << 17];
    char err[4096];
};

/* The first n - 1 bytes of path, NUL-ended (empty when unreadable); how many were read. */
static inline size_t slurp(const char *path, char *buf, size_t n)
{
    FILE *f = fopen(path, "rb");
    size_t k = f ? fread(buf, 1, n - 1, f) : 0;
    buf[k] = 0;
    if (f)
        fclose(f);
    return k;
}

/* A whole command line through the shell (mpirun ... pdmoe ..., say). */
static inline void run_cmd(const char *line, struct run *r)
{
    char cmd[4096], out[] = "/tmp/pdmoe-run-out-XXXXXX", err[] = "/tmp/pdmoe-run-err-XXXXXX";
    int fo = mkstemp(out), fe = mkstemp(err);
    cr_assert(fo >= 0 && fe >= 0);
    close(fo);
    close(fe);
    snprintf(cmd, sizeof cmd, "%s >%s 2>%s", line, out, err);
    int st = system(cmd);
    r->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
    /* generated text may hold NUL bytes: shown as 0x01, string functions see all of stdout */
    size_t k = slurp(out, r->out, sizeof r->out);
    for (size_t i = 0; i < k; i++)
        if (!r->out[i])
            r->out[i] = 1;
    slurp(err, r->err, sizeof r->err);
    remove(out);
    remove(err);
}

/* `pdmoe ARGS` through the shell (args may quote). */
static inline void run(const char *args, struct run *r)
{
    const char *bin = getenv("PDMOE_BIN");
    char line[3072];
    snprintf(line, sizeof line, "%s %s", bin ? bin : "build/pdmoe", args);
    run_cmd(line, r);
}

/* pdmoe ARGS, which must exit 0, its standard output parsed as JSON (the caller's to free). */
static inline json_t *run_json(const char *args)
{
    struct run r;
    run(args, &r);
    cr_assert_eq(r.status, 0, "pdmoe %s: %s", args, r.err);
    json_error_t je;
    json_t *j = json_loads(r.out, 0, &je);
    cr_assert_not_null(j, "pdmoe %s: %s", args, je.text);
    return j;
}

#endif

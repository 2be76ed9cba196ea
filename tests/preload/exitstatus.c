/* LD_PRELOAD shim for the tests (build/libexitstatus.so): a process whose command line holds the
 * words of PDMOE_TEST_EXIT_ARGS in a row (space-separated: "--port 18002") ends with exit status
 * PDMOE_TEST_EXIT_STATUS when it exits normally (return from main, exit()), whatever it returned,
 * as a process whose leak check fails at exit (LeakSanitizer's 23) or whose destructors fail. With
 * PDMOE_TEST_EXIT_RANK set, only the MPI rank of that number (OMPI_COMM_WORLD_RANK) does, not its
 * mpirun (whose command line holds the same words). Every other process, and a process killed, is
 * left alone. Not linked into pdmoe-tests. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int status = -1;   /* decided at load: the environment may change while the process runs */

__attribute__((constructor)) static void exitstatus_init(void)
{
    const char *args = getenv("PDMOE_TEST_EXIT_ARGS"), *st = getenv("PDMOE_TEST_EXIT_STATUS");
    const char *rank = getenv("PDMOE_TEST_EXIT_RANK"), *mine = getenv("OMPI_COMM_WORLD_RANK");
    if (!args || !st || !*args || (rank && (!mine || strcmp(rank, mine))))
        return;
    char cmd[8192];
    FILE *f = fopen("/proc/self/cmdline", "r");
    size_t n = f ? fread(cmd + 1, 1, sizeof cmd - 3, f) : 0;   /* NUL-separated words */
    if (f)
        fclose(f);
    cmd[0] = ' ';
    for (size_t i = 1; i <= n; i++)
        if (!cmd[i])
            cmd[i] = ' ';
    cmd[n + 1] = ' ';   /* (a trailing NUL became one already; a truncated line gets one) */
    cmd[n + 2] = 0;
    char want[1024];
    snprintf(want, sizeof want, " %s ", args);
    if (strstr(cmd, want))
        status = atoi(st);
}

__attribute__((destructor)) static void exitstatus_fini(void)
{
    if (status >= 0)
        _exit(status);
}

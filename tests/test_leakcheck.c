/* tests/criterion_wrap.c shown at work: this binary run again on tests that leak on purpose (only with
 * PDMOE_LEAK_ON_PURPOSE set; without it they do nothing and pass), its TAP report read. Under
 * AddressSanitizer a leak in a test's body or in its suite's .fini makes that test "not ok"; in
 * either build an assertion failing in a .fini does (Criterion alone counted both as passing), and
 * a test that skips runs its .fini. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "run.h"

static int on_purpose(void)
{
    return getenv("PDMOE_LEAK_ON_PURPOSE") != NULL;
}

/* Blocks allocated and then forgotten; noinline so that no pointer to them stays in a live frame. */
static void *volatile forgotten;
__attribute__((noinline)) static void leak_on_purpose_alloc(void)
{
    for (int i = 0; i < 4; i++) {
        forgotten = malloc(4096);
        memset(forgotten, i, 4096);
    }
    forgotten = NULL;
}

static void leaking_fini(void)
{
    if (on_purpose())
        leak_on_purpose_alloc();
}

static void failing_fini(void)
{
    cr_assert(!on_purpose(), "this .fini fails on purpose");
}

TestSuite(leak_on_purpose);

Test(leak_on_purpose, nothing)
{
}

Test(leak_on_purpose, in_the_body)
{
    if (on_purpose())
        leak_on_purpose_alloc();
}

Test(leak_on_purpose, in_the_fini, .fini = leaking_fini)
{
}

Test(leak_on_purpose, an_assertion_in_the_fini, .fini = failing_fini)
{
}

/* its .fini leaves a mark beside PDMOE_LEAK_ON_PURPOSE's value (a path) */
static void marking_fini(void)
{
    char mark[300];
    if (!on_purpose())
        return;
    snprintf(mark, sizeof mark, "%s.fini-ran", getenv("PDMOE_LEAK_ON_PURPOSE"));
    FILE *f = fopen(mark, "w");
    if (f)
        fclose(f);
}

Test(leak_on_purpose, skipped_after_its_set_up, .fini = marking_fini)
{
    if (on_purpose())
        cr_skip_test("skipped on purpose");
}

/* A body that fails after a process it started wrote a sanitizer report (here written as a child's
 * would be, /tmp/pdmoe-san.TESTPID.PID): the test's pid goes beside PDMOE_LEAK_ON_PURPOSE's path. */
Test(leak_on_purpose, a_failing_body_with_a_childs_report)
{
    if (!on_purpose())
        return;
    char path[300];
    snprintf(path, sizeof path, "%s.pid", getenv("PDMOE_LEAK_ON_PURPOSE"));
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f, "%d\n", (int)getpid());
    fclose(f);
    snprintf(path, sizeof path, "/tmp/pdmoe-san.%d.4242", (int)getpid());
    f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("==4242==ERROR: LeakSanitizer: detected memory leaks\na child's report on purpose\n", f);
    fclose(f);
    cr_assert_fail("this body fails on purpose");
}

/* The same run also shows a test that skips still running its .fini: it ended the process before,
 * and a suite's model directory stayed in /tmp. */
static int leakcheck_built(void)
{
#if defined(__SANITIZE_ADDRESS__)
    return 1;
#else
    return 0;
#endif
}

Test(leakcheck, a_leak_or_a_failing_fini_fails_its_test_by_name)
{
    char tap[] = "/tmp/pdmoe-leakcheck-tap-XXXXXX", cmd[512];
    int fd = mkstemp(tap);
    cr_assert_geq(fd, 0);
    close(fd);
    /* (BXFI_MAP would make the run a Criterion worker, this one's context) */
    snprintf(cmd, sizeof cmd, "env -u BXFI_MAP PDMOE_LEAK_ON_PURPOSE=%s ASAN_OPTIONS=detect_leaks=1 "
             "/proc/%d/exe --filter 'leak_on_purpose/*' -j1 --tap=%s", tap, (int)getpid(), tap);
    struct run r;
    run_cmd(cmd, &r);
    static char report[1 << 19];   /* (the tests the filter leaves out are listed too) */
    slurp(tap, report, sizeof report);
    char mark[300];
    snprintf(mark, sizeof mark, "%s.fini-ran", tap);
    int fini_ran = access(mark, F_OK) == 0;
    /* the report the failing body's child left: under AddressSanitizer printed and removed */
    char pidf[300], left[64] = "";
    snprintf(pidf, sizeof pidf, "%s.pid", tap);
    int worker = 0;
    FILE *pf = fopen(pidf, "r");
    if (pf && fscanf(pf, "%d", &worker) == 1)
        snprintf(left, sizeof left, "/tmp/pdmoe-san.%d.4242", worker);
    if (pf)
        fclose(pf);
    const int report_left = *left && access(left, F_OK) == 0;
    if (*left)
        remove(left);
    remove(pidf);
    remove(tap);
    remove(mark);
    cr_assert(worker > 0, "the failing body did not run");
    cr_assert(strstr(report, "\nnot ok - leak_on_purpose::a_failing_body_with_a_childs_report"), "%s", report);
    cr_assert_neq(r.status, 0, "a run with failing tests exited 0: %s", report);
    cr_assert(strstr(report, "\nok - leak_on_purpose::nothing"), "%s", report);
    cr_assert(strstr(report, "\nnot ok - leak_on_purpose::an_assertion_in_the_fini"), "%s", report);
    cr_assert(strstr(report, "this .fini fails on purpose"), "%s", report);
    cr_assert(strstr(report, "\nok - leak_on_purpose::skipped_after_its_set_up  # SKIP skipped on purpose") ||
                  strstr(report, "\nok - leak_on_purpose::skipped_after_its_set_up # SKIP skipped on purpose"),
              "%s", report);
    cr_assert(fini_ran, "a test that skipped did not run its .fini");
    if (!leakcheck_built()) {
        cr_assert(strstr(report, "\nok - leak_on_purpose::in_the_body"), "%s", report);
        cr_assert(strstr(report, "\nok - leak_on_purpose::in_the_fini"), "%s", report);
        return;
    }
    cr_assert(strstr(report, "\nnot ok - leak_on_purpose::in_the_body"), "%s", report);
    cr_assert(strstr(report, "\nnot ok - leak_on_purpose::in_the_fini"), "%s", report);
    cr_assert(!report_left, "%s stayed in /tmp after its test failed", left);
    cr_assert(strstr(r.err, "a child's report on purpose"), "the report was not printed: %s", r.err);
    cr_assert(strstr(report, "LeakSanitizer found memory leaked"), "%s", report);
    cr_assert(strstr(r.err, "leak_on_purpose_alloc"), "LeakSanitizer's report does not name the allocation: %s",
              r.err);
}

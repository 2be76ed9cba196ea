/* Two wrappers around Criterion (linked with -Wl,--wrap, see the Makefile): a test that leaks
 * fails, under AddressSanitizer, and a test that skips still runs its fixtures' .fini.
 *
 * Leaks. Criterion runs each test in a worker process and decides pass or fail when the worker
 * says its body is over (the TEARDOWN message, sent before the .fini fixtures run). The worker then
 * returns from main, so LeakSanitizer's check at exit does run and exits 23, but Criterion has
 * counted the test already and keeps that verdict (even a test's .exit_code is compared at
 * TEARDOWN, before the exit): a leak was a report on stderr under a passing suite. An assertion
 * failing in a .fini was lost the same way. So criterion_internal_test_main, which each Test()'s
 * generated code calls with the test's body, is handed a body of ours that runs the test's body,
 * then the test's and the suite's .fini (what a suite's teardown frees, a server or a proxy
 * destroyed, is checked too), then __lsan_do_recoverable_leak_check(), all still in the test's main
 * phase, where a failed assertion fails the test by name. Criterion's own teardown then finds no
 * .fini left to run. A test whose body fails never comes back here: its .fini runs where Criterion
 * runs it, and it is not leak-checked (it failed already). A sanitizer report that a process the
 * test started wrote (tests/child.h), and that no stop of the test's read, fails the test there
 * too; after a failed body such reports are printed to stderr once Criterion is done with the test,
 * and their files removed (they stayed in /tmp). Without AddressSanitizer the order is the same and
 * there is no check.
 *
 * Skips. cr_skip_test ends the worker with exit(0) there and then, so a test that skipped after its
 * suite's .init (a model written to /tmp, a server started) left all that behind. A skip from a
 * test's body now runs the fixtures' .fini first; a skip from an .init does not (the set-up is
 * half done, and its .fini never ran before either). */
#define _GNU_SOURCE   /* vasprintf */
#include <criterion/criterion.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "child.h"

#if defined(__SANITIZE_ADDRESS__)
#define PD_LEAKCHECK 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PD_LEAKCHECK 1
#endif
#endif
#ifdef PD_LEAKCHECK
#include <sanitizer/lsan_interface.h>
#endif

#ifdef PD_LEAKCHECK
/* Criterion's runner (the process BoxFort's BXFI_MAP is not set in) keeps a few blocks of its own,
 * calloc'd in libcriterion, to its exit (624 bytes in 13 blocks after the whole suite), which would
 * make a passing run exit 23: suppressed there only. In a test's worker every allocation has
 * libcriterion's frames under it, and the line would hide every leak (tests/lsan.supp). */
const char *__lsan_default_suppressions(void);
const char *__lsan_default_suppressions(void)
{
    return getenv("BXFI_MAP") ? "" : "leak:libcriterion.so\n";
}
#endif

void __real_criterion_internal_test_main(void (*fn)(void));
void __wrap_criterion_internal_test_main(void (*fn)(void));
CR_NORETURN void __real_criterion_skip_test(const char *format, ...);
void __wrap_criterion_skip_test(const char *format, ...);

static void (*test_body)(void);
static int in_body;   /* the test's body is running (not its .init) */
/* the current test's and suite's fixtures with .fini taken out, for Criterion's teardown */
static struct criterion_test_extra_data test_fixtures, suite_fixtures;

/* A fixtures' struct as Criterion hands it to the worker (it may sit at any address: copied) */
static struct criterion_test_extra_data fixtures_of(const struct criterion_test_extra_data *d)
{
    struct criterion_test_extra_data x;
    memcpy(&x, d, sizeof x);
    return x;
}

/* Runs the test's .fini, then its suite's, once: Criterion's teardown finds them gone. */
static void run_fini_now(void)
{
    struct criterion_test *t = (struct criterion_test *)criterion_current_test;
    struct criterion_suite *s = (struct criterion_suite *)criterion_current_suite;
    void (*test_fini)(void) = NULL, (*suite_fini)(void) = NULL;
    if (t->data) {
        test_fixtures = fixtures_of(t->data);
        test_fini = test_fixtures.fini;
        test_fixtures.fini = NULL;
        t->data = &test_fixtures;
    }
    if (s->data) {
        suite_fixtures = fixtures_of(s->data);
        suite_fini = suite_fixtures.fini;
        suite_fixtures.fini = NULL;
        s->data = &suite_fixtures;
    }
    if (test_fini)
        test_fini();
    if (suite_fini)
        suite_fini();
}

static void body_fini_leakcheck(void)
{
    in_body = 1;
    test_body();
    in_body = 0;
    run_fini_now();
#ifdef PD_LEAKCHECK
    /* a report a child of the test, or one of its own (up's servers, mpirun's ranks), wrote to a
     * file (tests/child.h) and that no stop of the test's took */
    child_reports_none();
    /* (0 when ASAN_OPTIONS has detect_leaks=0) */
    cr_assert_eq(__lsan_do_recoverable_leak_check(), 0,
                 "LeakSanitizer found memory leaked by the test or its fixtures (its report is on stderr)");
#endif
}

void __wrap_criterion_internal_test_main(void (*fn)(void))
{
    /* a parameterized test's body takes its parameter: left as Criterion runs it */
    if (criterion_current_test->data && fixtures_of(criterion_current_test->data).param_) {
        __real_criterion_internal_test_main(fn);
        return;
    }
    test_body = fn;
    __real_criterion_internal_test_main(body_fini_leakcheck);
#ifdef PD_LEAKCHECK
    /* a body that failed (it never came back to child_reports_none) or a .fini run by Criterion may
     * leave its children's sanitizer reports: to stderr, under the test's failure, and their files
     * out of /tmp */
    static char msg[16384];
    msg[0] = 0;
    if (child_reports_take_all(msg, sizeof msg))
        fprintf(stderr, "sanitizer reports of processes this test started, not read by the test:%s\n", msg);
#endif
}

void __wrap_criterion_skip_test(const char *format, ...)
{
    char *msg = NULL;
    va_list ap;
    va_start(ap, format);
    if (*format && vasprintf(&msg, format, ap) < 0)
        msg = NULL;
    va_end(ap);
    if (in_body) {
        in_body = 0;
        run_fini_now();
    }
    __real_criterion_skip_test(msg ? "%s" : "", msg);   /* ("": Criterion's "test was skipped") */
}

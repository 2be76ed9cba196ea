/* LD_PRELOAD shim for the tests (build/libclockshift.so): CLOCK_REALTIME and CLOCK_REALTIME_COARSE
 * read PDMOE_TEST_CLOCK_SHIFT_S seconds (may be negative) past the real time, as after a step of
 * the wall clock (NTP, `date -s`) before the process started; every other clock is left alone.
 * The kernel's own realtime deadlines (futex, timerfd) are not shifted, so an absolute realtime
 * deadline the process computes lies that far off. Not linked into pdmoe-tests. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int (*real_clock_gettime)(clockid_t, struct timespec *);
static long shift_s;   /* read once, at load: getenv beside another thread's setenv is a race */

__attribute__((constructor)) static void clockshift_init(void)
{
    const char *v = getenv("PDMOE_TEST_CLOCK_SHIFT_S");
    shift_s = v ? strtol(v, NULL, 10) : 0;
}

int clock_gettime(clockid_t id, struct timespec *ts)
{
    if (!real_clock_gettime)   /* (a library's constructor may call before this one's) */
        real_clock_gettime = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real_clock_gettime ? real_clock_gettime(id, ts) : (int)syscall(SYS_clock_gettime, id, ts);
    if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE))
        ts->tv_sec += shift_s;
    return rc;
}

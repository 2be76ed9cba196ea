/* LD_PRELOAD shim for the tests (build/libtimewarp.so): the monotonic clocks (CLOCK_MONOTONIC,
 * _COARSE, _RAW, CLOCK_BOOTTIME) run PDMOE_TEST_TIME_RATE times as fast as real time from the
 * process's start, and the timeouts of epoll_wait, epoll_pwait and poll are that many times
 * shorter (rounded up), so that timers computed from those clocks (libevent's, pd_now_ns's) fire
 * after 1/rate of their time: at rate 10 a 50 s timeout comes after 5 s. The realtime clock,
 * sleeps and condition variables are left alone. Not linked into pdmoe-tests. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int (*real_clock_gettime)(clockid_t, struct timespec *);
static long rate = 1;                /* read once, at load */
static int64_t base_ns[8];          /* each warped clock's real reading at load, by clock id */

static int warped(clockid_t id)
{
    return id == CLOCK_MONOTONIC || id == CLOCK_MONOTONIC_COARSE || id == CLOCK_MONOTONIC_RAW || id == CLOCK_BOOTTIME;
}

static int real_now(clockid_t id, struct timespec *ts)
{
    if (!real_clock_gettime)   /* (a library's constructor may call before this one's) */
        real_clock_gettime = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    return real_clock_gettime ? real_clock_gettime(id, ts) : (int)syscall(SYS_clock_gettime, id, ts);
}

__attribute__((constructor)) static void timewarp_init(void)
{
    const char *v = getenv("PDMOE_TEST_TIME_RATE");
    const long r = v ? strtol(v, NULL, 10) : 1;
    const clockid_t ids[] = {CLOCK_MONOTONIC, CLOCK_MONOTONIC_COARSE, CLOCK_MONOTONIC_RAW, CLOCK_BOOTTIME};
    for (size_t i = 0; i < sizeof ids / sizeof *ids; i++) {
        struct timespec ts;
        if (real_now(ids[i], &ts) == 0)
            base_ns[ids[i]] = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    }
    rate = r > 1 ? r : 1;
}

int clock_gettime(clockid_t id, struct timespec *ts)
{
    int rc = real_now(id, ts);
    if (rc == 0 && rate > 1 && warped(id)) {
        const int64_t now = (int64_t)ts->tv_sec * 1000000000 + ts->tv_nsec;
        const int64_t t = base_ns[id] + (now - base_ns[id]) * rate;
        ts->tv_sec = t / 1000000000;
        ts->tv_nsec = t % 1000000000;
    }
    return rc;
}

static int shorter(int timeout_ms)
{
    return timeout_ms > 0 ? (int)((timeout_ms + rate - 1) / rate) : timeout_ms;
}

int epoll_wait(int epfd, struct epoll_event *ev, int n, int timeout_ms)
{
    static int (*real)(int, struct epoll_event *, int, int);
    if (!real)
        real = (int (*)(int, struct epoll_event *, int, int))dlsym(RTLD_NEXT, "epoll_wait");
    return real(epfd, ev, n, shorter(timeout_ms));
}

int epoll_pwait(int epfd, struct epoll_event *ev, int n, int timeout_ms, const sigset_t *mask)
{
    static int (*real)(int, struct epoll_event *, int, int, const sigset_t *);
    if (!real)
        real = (int (*)(int, struct epoll_event *, int, int, const sigset_t *))dlsym(RTLD_NEXT, "epoll_pwait");
    return real(epfd, ev, n, shorter(timeout_ms), mask);
}

int poll(struct pollfd *fds, nfds_t n, int timeout_ms)
{
    static int (*real)(struct pollfd *, nfds_t, int);
    if (!real)
        real = (int (*)(struct pollfd *, nfds_t, int))dlsym(RTLD_NEXT, "poll");
    return real(fds, n, shorter(timeout_ms));
}

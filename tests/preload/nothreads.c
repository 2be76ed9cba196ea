/* LD_PRELOAD shim for the tests (build/libnothreads.so): pthread_create fails with EAGAIN once
 * the process has started PDMOE_TEST_THREADS_MAX threads, as under a limit on threads (a
 * container's pids.max, systemd's TasksMax, ulimit -u). Not linked into pdmoe-tests. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

static atomic_int started;

int pthread_create(pthread_t *t, const pthread_attr_t *a, void *(*fn)(void *), void *arg)
{
    static int (*real)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);
    if (!real)
        real = (int (*)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *))dlsym(RTLD_NEXT,
                                                                                              "pthread_create");
    const char *v = getenv("PDMOE_TEST_THREADS_MAX");
    if (v && atomic_fetch_add(&started, 1) >= atoi(v))
        return EAGAIN;
    return real ? real(t, a, fn, arg) : EAGAIN;
}

/* Thread pool: a fixed set of pthreads that run numbered tasks together with the calling thread.
 *
 * Work is described as n_tasks independent tasks; the caller decides what task i covers (always
 * the same rows, whatever the thread count), so results never depend on how many threads ran
 * them. A hand-off takes no lock while the workers are polling (they poll for 50 us after each
 * run: a decode step's runs come microseconds apart); idle workers then block on a condition
 * variable: pdmoe runs several processes per core in the expert-parallel tests, and a spinning
 * worker would steal the core from another rank. */
#ifndef PD_CORE_THREADPOOL_H
#define PD_CORE_THREADPOOL_H

#include <pthread.h>
#include <stddef.h>

#include "core/err.h"

typedef struct pd_pool pd_pool;

/* One task: `task` is in [0, n_tasks). Runs on any thread of the pool, concurrently with others. */
typedef void (*pd_pool_fn)(void *arg, int task);

#define PD_POOL_MAX_THREADS 256

/* Why pthread_create returned rc, for an error message: its strerror and, for EAGAIN, where the
 * limit usually is ("... a limit on threads: ulimit -u, the cgroup's pids.max (a container's
 * --pids-limit, systemd's TasksMax), or memory for a stack"), or, when the address-space limit
 * (ulimit -v) left no room for the thread's stack, that limit with its figures (pd_as_note). */
const char *pd_thread_why(int rc, char *buf, size_t cap);
/* The code of that error: PD_EINVAL when it is the address-space limit (a setting the process was
 * started with: starting it again cannot help), else PD_ENOMEM. */
int pd_thread_code(int rc);

/* pthread_create(t, NULL, fn, arg), or pd_thread_code's code with "cannot start the <what>:
 * <pd_thread_why>". */
int pd_thread_start(pthread_t *t, void *(*fn)(void *), void *arg, const char *what, pd_err *e);

/* Creates a pool of `nthreads` threads in total: the caller of pd_pool_run plus nthreads - 1
 * workers (nthreads = 1 makes no worker). Returns 0, PD_EINVAL or PD_ENOMEM. */
int pd_pool_create(int nthreads, pd_pool **out, pd_err *err);

/* Runs fn(arg, i) exactly once for every i in [0, n_tasks) on the workers and the calling thread
 * and returns when all have finished. pool = NULL runs the tasks in order on the caller. Runs are
 * serialised: a second caller waits for the first. A task that calls pd_pool_run again (nested)
 * runs its inner tasks on its own thread. */
void pd_pool_run(pd_pool *pool, int n_tasks, pd_pool_fn fn, void *arg);

/* pd_pool_run for tasks of about the same cost that read memory in task order (blocks of a
 * matrix's rows): each thread's tasks are consecutive stretches of what is left, at any task
 * count (pd_pool_run does so for runs of a few tasks a thread only, since longer runs may hold
 * tasks of unequal cost, as a prefill's attention has). */
void pd_pool_run_even(pd_pool *pool, int n_tasks, pd_pool_fn fn, void *arg);

/* Threads that pd_pool_run uses, the caller included (1 for NULL). */
int pd_pool_nthreads(const pd_pool *pool);

/* Counters since the pool was created: `dispatches` runs were handed to the workers (runs on the
 * calling thread alone, a NULL pool's included, are not counted), `wakeups` of them found a
 * worker asleep and woke it (tens of microseconds, where a polling worker takes a fraction of
 * one), `stalls` of them kept the caller waiting over 0.5 ms plus four of its own tasks' time for a
 * task a helper had claimed (a helper preempted: more runnable threads than cores). A
 * stall within 50 ms of the last one's back-off starts a back-off, 2 ms at first and twice as long at
 * each repeat up to 20 ms, whose runs run on the caller alone (`backoff_runs`, not dispatches): the
 * same tasks, so the same results; a stall alone (a kernel thread's moment on a core) starts none.
 * Where the calling thread's time in runs went, in nanoseconds: `own_ns` running the tasks it claimed
 * in the dispatched runs, `wait_ns` the rest of those runs (publishing them, then waiting for the
 * tasks the helpers claimed: their late start and their last task), `alone_ns` the backoff runs.
 * A caller's time outside all three is its own serial work between runs. `own_tasks` counts the
 * tasks of own_ns; `helper_ns` and `helper_tasks` the helpers' (all of them together) in the
 * dispatched runs: a helper slower per task than the caller shows as the caller's wait. */
struct pd_pool_stats {
    unsigned long long dispatches, wakeups, stalls, backoff_runs;
    unsigned long long own_ns, wait_ns, alone_ns;
    unsigned long long own_tasks, helper_ns, helper_tasks;
};
void pd_pool_stats(pd_pool *pool, struct pd_pool_stats *s);

/* Stops and joins the workers and frees the pool; NULL is a no-op. No run may be in progress. */
void pd_pool_destroy(pd_pool *pool);

#endif

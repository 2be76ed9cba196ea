/* Thread pool: a run publishes (fn, arg) and then one atomic claim word holding a generation, the
 * run's task count and the next unclaimed task (the caller's first share already claimed as it
 * publishes); any thread claims task i by a compare-and-swap of that word, so which thread runs
 * task i varies, but what task i computes does not. A decode step issues about a hundred small runs
 * back to back (a few microseconds of work each), so the hand-off takes no lock while the workers
 * poll, and the caller waits only for tasks that were claimed, never for a worker that has not yet
 * woken (on a loaded machine a descheduled worker simply claims nothing: the caller runs every
 * task). A claim succeeds only while its generation's tasks are not all claimed, and the caller
 * rewrites (fn, arg) only after all are claimed and finished, so a late worker can never run a
 * stale task. Only a thread that has polled for SPIN_NS without news sleeps on a condition variable
 * (an idle pool uses no CPU between steps), and only then do the others take the mutex to wake it.
 * Whether a sleeper exists is decided by a pair of sequentially consistent accesses on each side
 * (the sleeper counts itself, then re-reads the word; the publisher writes the word, then reads the
 * count): at least one of the two sees the other, so no wake-up is lost. */
#define _GNU_SOURCE   /* pthread_getattr_default_np */
#include "core/threadpool.h"
#include "core/mem.h"
#include "core/units.h"

#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* How long a thread polls before it sleeps. */
#define SPIN_NS 50000

/* A run of at most FEW_TASKS per thread (a decode step's products, 4 to 16 tasks of 64 rows) is
 * claimed in shares of what is left divided by the threads (OpenMP's guided), so each thread takes
 * consecutive tasks and streams its rows in order: with half that share, 8 tasks went 0-1 / 2 / 3 /
 * ... alternately, and decode at 2 threads gave 1.29x one thread against 1.375x (medians of 8
 * alternating runs, Zen 5 EPYC). Longer runs keep the half share: a prefill's tasks differ in cost
 * (a later token's attention reads more keys), and claiming half of them at once made `bench
 * prefill` at 2 threads slower in each of 4 alternating runs (2,464-3,366 tokens/s against
 * 3,123-3,853), where this rule left it as it was (medians 3,455 and 3,369 in 6). A run whose
 * caller says its tasks cost alike (pd_pool_run_even: a matrix's row blocks, experts of one token
 * count) is claimed so at any task count: with the products' runs so, 8 alternating runs of bench
 * decode gave 2 threads over 1 at batch 1 a median of 1.39x against 1.33x, at batch 16 1.58x
 * against 1.455x (4 runs), bench prefill at 2 threads within its noise (medians 3,103 and 3,170
 * tokens/s in 6). */
#define FEW_TASKS 8

/* Back-off on a machine with more runnable threads than cores: when the caller, its own tasks
 * done, waits longer than STALL_NS plus four times its own mean task for a task another thread
 * claimed, that thread was most likely preempted (a helper that runs finishes its last task within
 * about one task's time; a time slice is milliseconds). A stall that follows the last one (or the
 * end of its back-off) within REPEAT_NS means the helpers keep losing their cores: every run of the
 * next back-off then runs on the caller alone (the same tasks, so the same results), BACKOFF_MIN_NS
 * at first, twice as long at each repeat, at most BACKOFF_MAX_NS. A stall alone is a kernel
 * thread's or an interrupt's moment on the helper's core and is not backed off: on a 2-vCPU
 * virtual machine (Zen 5 EPYC) kdamond and rcu_preempt took a core for 1.5-5 ms every half second,
 * the helper's CPU clock advanced 0.08-0.2 ms in stalls of 0.5-1.8 ms, and a fixed 20 ms back-off
 * after each such stall ran about a tenth of bench decode's 2-thread steps on one thread. */
#define STALL_NS 500000
#define REPEAT_NS 50000000
#define BACKOFF_MIN_NS 2000000
#define BACKOFF_MAX_NS 20000000

/* The claim word: generation (GEN_BITS, wraps) | task count (N_BITS) | next task (N_BITS). A
 * run of more than MAX_RUN tasks is published as several. */
#define N_BITS 21
#define GEN_BITS (64 - 2 * N_BITS)
#define MAX_RUN ((1 << N_BITS) - 1)
#define W_IDX(w) ((int)((w) & MAX_RUN))
#define W_N(w) ((int)(((w) >> N_BITS) & MAX_RUN))
#define W_GEN(w) ((w) >> (2 * N_BITS))

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void relax(void)
{
    __builtin_ia32_pause();
}

struct worker {
    pd_pool *pool;
    int id;            /* 0 .. nthreads - 2 */
    pthread_t thread;
};

struct pd_pool {
    int nthreads;               /* the caller included */
    int nworkers;               /* threads actually started (nthreads - 1 once created) */
    struct worker *workers;     /* [nthreads - 1] */

    pthread_mutex_t mu;         /* held only to sleep and to wake sleepers */
    pthread_cond_t wake;        /* workers sleep here for a new generation or stop */
    pthread_cond_t done;        /* the caller sleeps here for its run's tasks to finish */

    /* The current run: written by the caller before it publishes the claim word, read by any
     * thread that claims one of its tasks (relaxed: a successful claim orders them). */
    _Atomic(pd_pool_fn) fn;
    _Atomic(void *) arg;
    atomic_int base;            /* task number of the word's task 0 (runs of more than MAX_RUN) */
    atomic_int even;            /* its tasks cost about the same (pd_pool_run_even) */

    /* each hot atomic on its own cache line: the workers poll `claim` while tasks run */
    _Alignas(64) atomic_uint_fast64_t claim;  /* see W_GEN, W_N, W_IDX */
    _Alignas(64) atomic_int finished;         /* tasks of the current run finished */
    _Alignas(64) atomic_int sleeping;         /* workers asleep (or about to be) on `wake` */
    atomic_int caller_waiting;                /* the caller sleeps (or is about to) on `done` */
    atomic_int stop;

    atomic_uint_fast64_t dispatches;          /* runs handed to the workers */
    atomic_uint_fast64_t wakeups;             /* of those, runs that had to wake a sleeper */
    atomic_uint_fast64_t stalls;              /* runs whose caller waited > STALL_NS for a helper */
    atomic_uint_fast64_t backoff_runs;        /* runs made on the caller alone after a stall */
    atomic_uint_fast64_t own_ns, wait_ns, alone_ns;   /* the caller's time: see pd_pool_stats */
    atomic_uint_fast64_t own_tasks, helper_ns, helper_tasks;
    /* under run_mu, CLOCK_MONOTONIC ns: runs before inline_until run on the caller alone; the last
     * stall ended at last_stall; backoff_ns is the back-off it started (0: none) */
    int64_t inline_until, last_stall, backoff_ns;

    pthread_mutex_t run_mu;     /* one run at a time */
};

/* Set while a thread executes tasks, so a nested pd_pool_run runs inline instead of waiting on
 * a pool whose threads are all busy with the outer run. */
static __thread int in_task;

/* The share of what is left that one claim takes (guided: at least one task), so that two threads
 * racing for the claim word pass its cache line back and forth a few times per run, not per task. */
static int share_of(const pd_pool *p, int n, int even)
{
    return even || n <= FEW_TASKS * p->nthreads ? p->nthreads : 2 * p->nthreads;
}

/* Runs tasks [idx, idx + c) of the run (claimed) and marks them finished. A helper counts its tasks'
 * time before it marks them finished (so a caller that reads the counts after its run sees them). */
static void run_claimed(pd_pool *p, pd_pool_fn fn, void *arg, int base, int idx, int c, int n, int helper)
{
    const int64_t h0 = helper ? now_ns() : 0;
    for (int i = 0; i < c; i++)
        fn(arg, base + idx + i);
    if (helper) {
        atomic_fetch_add_explicit(&p->helper_ns, (uint64_t)(now_ns() - h0), memory_order_relaxed);
        atomic_fetch_add_explicit(&p->helper_tasks, (uint64_t)c, memory_order_relaxed);
    }
    if (atomic_fetch_add(&p->finished, c) + c == n && atomic_load(&p->caller_waiting)) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_signal(&p->done);
        pthread_mutex_unlock(&p->mu);
    }
}

/* Claims and runs tasks of generation `gen` until none is left; returns how many it ran. */
static int claim_and_run(pd_pool *p, uint64_t gen, int helper)
{
    int ran = 0;
    pd_pool_fn fn = atomic_load_explicit(&p->fn, memory_order_relaxed);
    void *arg = atomic_load_explicit(&p->arg, memory_order_relaxed);
    int base = atomic_load_explicit(&p->base, memory_order_relaxed);
    const int even = atomic_load_explicit(&p->even, memory_order_relaxed);
    uint64_t w = atomic_load_explicit(&p->claim, memory_order_acquire);
    const int share = share_of(p, W_N(w), even);
    in_task = 1;
    while (W_GEN(w) == gen && W_IDX(w) < W_N(w)) {
        int left = W_N(w) - W_IDX(w), c = left / share;
        c = c < 1 ? 1 : c;
        if (!atomic_compare_exchange_weak_explicit(&p->claim, &w, w + (uint64_t)c, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        run_claimed(p, fn, arg, base, W_IDX(w), c, W_N(w), helper);
        ran += c;
        w = atomic_load_explicit(&p->claim, memory_order_acquire);
    }
    in_task = 0;
    return ran;
}

/* Waits for a generation other than `seen` (or stop): polls, then sleeps. Returns the word. */
static uint64_t await_word(pd_pool *p, uint64_t seen)
{
    int64_t until = now_ns() + SPIN_NS;
    for (;;) {
        uint64_t w = atomic_load_explicit(&p->claim, memory_order_acquire);
        if (W_GEN(w) != seen || atomic_load_explicit(&p->stop, memory_order_relaxed))
            return w;
        if (now_ns() >= until)
            break;
        relax();
    }
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add(&p->sleeping, 1);
    while (W_GEN(atomic_load(&p->claim)) == seen && !atomic_load(&p->stop))
        pthread_cond_wait(&p->wake, &p->mu);
    atomic_fetch_sub(&p->sleeping, 1);
    pthread_mutex_unlock(&p->mu);
    return atomic_load_explicit(&p->claim, memory_order_acquire);
}

static void *worker_main(void *vw)
{
    struct worker *w = vw;
    pd_pool *p = w->pool;
    uint64_t seen = 0;

    for (;;) {
        uint64_t word = await_word(p, seen);
        if (atomic_load(&p->stop))
            break;
        seen = W_GEN(word);
        claim_and_run(p, seen, 1);
    }
    return NULL;
}

static void stop_workers(pd_pool *p)
{
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->nworkers; i++)
        pthread_join(p->workers[i].thread, NULL);
    p->nworkers = 0;
}

static void free_pool(pd_pool *p)
{
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->run_mu);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    free(p->workers);
    free(p);
}

int pd_pool_create(int nthreads, pd_pool **out, pd_err *err)
{
    *out = NULL;
    if (nthreads < 1 || nthreads > PD_POOL_MAX_THREADS)
        return pd_err_set(err, PD_EINVAL, "thread pool: %d threads (want 1..%d)", nthreads,
                          PD_POOL_MAX_THREADS);
    pd_pool *p = NULL;
    if (posix_memalign((void **)&p, 64, sizeof *p))
        return pd_err_set(err, PD_ENOMEM, "thread pool: out of memory");
    *p = (pd_pool){0};
    p->nthreads = nthreads;
    p->workers = calloc((size_t)nthreads, sizeof *p->workers);
    if (!p->workers) {
        free(p);
        return pd_err_set(err, PD_ENOMEM, "thread pool: out of memory");
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_mutex_init(&p->run_mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    atomic_init(&p->fn, NULL);
    atomic_init(&p->arg, NULL);
    atomic_init(&p->base, 0);
    atomic_init(&p->even, 0);
    atomic_init(&p->claim, 0);
    atomic_init(&p->finished, 0);
    atomic_init(&p->sleeping, 0);
    atomic_init(&p->caller_waiting, 0);
    atomic_init(&p->stop, 0);
    atomic_init(&p->dispatches, 0);
    atomic_init(&p->wakeups, 0);
    atomic_init(&p->stalls, 0);
    atomic_init(&p->backoff_runs, 0);
    atomic_init(&p->own_ns, 0);
    atomic_init(&p->wait_ns, 0);
    atomic_init(&p->alone_ns, 0);
    atomic_init(&p->own_tasks, 0);
    atomic_init(&p->helper_ns, 0);
    atomic_init(&p->helper_tasks, 0);

    for (int i = 0; i < nthreads - 1; i++) {
        struct worker *w = &p->workers[i];
        w->pool = p;
        w->id = i;
        int rc = pthread_create(&w->thread, NULL, worker_main, w);
        if (rc != 0) {
            /* (said before the workers' stacks are freed: the address-space limit's note counts them) */
            char why[512];
            const int code = pd_err_set(err, pd_thread_code(rc), "thread pool: cannot start worker %d of %d: %s", i + 1,
                                        nthreads - 1, pd_thread_why(rc, why, sizeof why));
            stop_workers(p);
            free_pool(p);
            return code;
        }
        p->nworkers++;
    }
    *out = p;
    return 0;
}

/* A stall ended at t: the back-off it starts (see REPEAT_NS). */
static void back_off(pd_pool *p, int64_t t)
{
    atomic_fetch_add_explicit(&p->stalls, 1, memory_order_relaxed);
    if (p->last_stall && t - p->inline_until < REPEAT_NS)   /* inline_until: the last back-off's end */
        p->backoff_ns = p->backoff_ns ? 2 * p->backoff_ns : BACKOFF_MIN_NS;
    else
        p->backoff_ns = 0;
    if (p->backoff_ns > BACKOFF_MAX_NS)
        p->backoff_ns = BACKOFF_MAX_NS;
    p->last_stall = t;
    p->inline_until = t + p->backoff_ns;
}

/* One published run of n <= MAX_RUN tasks numbered from base. */
static void run_part(pd_pool *p, int base, int n, pd_pool_fn fn, void *arg, int even)
{
    atomic_store_explicit(&p->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&p->even, even, memory_order_relaxed);
    atomic_store_explicit(&p->arg, arg, memory_order_relaxed);
    atomic_store_explicit(&p->base, base, memory_order_relaxed);
    atomic_store_explicit(&p->finished, 0, memory_order_relaxed);
    uint64_t gen = (W_GEN(atomic_load_explicit(&p->claim, memory_order_relaxed)) + 1) & ((UINT64_C(1) << GEN_BITS) - 1);
    /* the caller's first share is claimed as the run is published: a polling helper claimed first
     * otherwise (the caller still publishing), took half of a run's tasks in one claim and, slower
     * than the caller per task on this host, kept it waiting */
    int first = n / share_of(p, n, even);
    first = first < 1 ? 1 : first;
    atomic_store(&p->claim, gen << (2 * N_BITS) | (uint64_t)n << N_BITS | (uint64_t)first);
    atomic_fetch_add_explicit(&p->dispatches, 1, memory_order_relaxed);
    if (atomic_load(&p->sleeping) > 0) {
        atomic_fetch_add_explicit(&p->wakeups, 1, memory_order_relaxed);
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mu);
    }

    int64_t c0 = now_ns();
    in_task = 1;
    run_claimed(p, fn, arg, base, 0, first, n, 0);
    int ran = first + claim_and_run(p, gen, 0);
    atomic_fetch_add_explicit(&p->own_tasks, (uint64_t)ran, memory_order_relaxed);

    /* every task is claimed; wait for those other threads are still running */
    int64_t t0 = now_ns(), until = t0 + SPIN_NS;
    atomic_fetch_add_explicit(&p->own_ns, (uint64_t)(t0 - c0), memory_order_relaxed);
    if (atomic_load_explicit(&p->finished, memory_order_acquire) == n)
        return;
    /* a stall: longer than STALL_NS plus four of the caller's own tasks (a helper that runs
     * still finishes its last task within about one) */
    int64_t stall = STALL_NS + (ran ? 4 * (t0 - c0) / ran : 0);
    while (atomic_load_explicit(&p->finished, memory_order_acquire) < n && now_ns() < until)
        relax();
    if (atomic_load(&p->finished) < n) {
        pthread_mutex_lock(&p->mu);
        atomic_store(&p->caller_waiting, 1);
        while (atomic_load(&p->finished) < n)
            pthread_cond_wait(&p->done, &p->mu);
        atomic_store(&p->caller_waiting, 0);
        pthread_mutex_unlock(&p->mu);
        int64_t t1 = now_ns();
        if (t1 - t0 > stall)
            back_off(p, t1);
    }
}

static void run(pd_pool *p, int n_tasks, pd_pool_fn fn, void *arg, int even)
{
    assert(fn);
    if (n_tasks <= 0)
        return;
    if (!p || p->nworkers == 0 || n_tasks == 1 || in_task) {
        for (int i = 0; i < n_tasks; i++)
            fn(arg, i);
        return;
    }
    pthread_mutex_lock(&p->run_mu);
    int64_t t0 = now_ns();
    if (p->inline_until && t0 < p->inline_until) {
        atomic_fetch_add_explicit(&p->backoff_runs, 1, memory_order_relaxed);
        pthread_mutex_unlock(&p->run_mu);
        for (int i = 0; i < n_tasks; i++)
            fn(arg, i);
        atomic_fetch_add_explicit(&p->alone_ns, (uint64_t)(now_ns() - t0), memory_order_relaxed);
        return;
    }
    const uint64_t own0 = atomic_load_explicit(&p->own_ns, memory_order_relaxed);
    for (int base = 0; base < n_tasks; base += MAX_RUN)
        run_part(p, base, n_tasks - base < MAX_RUN ? n_tasks - base : MAX_RUN, fn, arg, even);
    /* the rest of the run's time, publishing it and waiting for the helpers' tasks */
    const uint64_t own = atomic_load_explicit(&p->own_ns, memory_order_relaxed) - own0;
    atomic_fetch_add_explicit(&p->wait_ns, (uint64_t)(now_ns() - t0) - own, memory_order_relaxed);
    pthread_mutex_unlock(&p->run_mu);
}

void pd_pool_run(pd_pool *p, int n_tasks, pd_pool_fn fn, void *arg)
{
    run(p, n_tasks, fn, arg, 0);
}

void pd_pool_run_even(pd_pool *p, int n_tasks, pd_pool_fn fn, void *arg)
{
    run(p, n_tasks, fn, arg, 1);
}

int pd_pool_nthreads(const pd_pool *p)
{
    return p ? p->nthreads : 1;
}

void pd_pool_stats(pd_pool *p, struct pd_pool_stats *s)
{
    *s = (struct pd_pool_stats){0};
    if (!p)
        return;
    s->dispatches = atomic_load_explicit(&p->dispatches, memory_order_relaxed);
    s->wakeups = atomic_load_explicit(&p->wakeups, memory_order_relaxed);
    s->stalls = atomic_load_explicit(&p->stalls, memory_order_relaxed);
    s->backoff_runs = atomic_load_explicit(&p->backoff_runs, memory_order_relaxed);
    s->own_ns = atomic_load_explicit(&p->own_ns, memory_order_relaxed);
    s->wait_ns = atomic_load_explicit(&p->wait_ns, memory_order_relaxed);
    s->alone_ns = atomic_load_explicit(&p->alone_ns, memory_order_relaxed);
    s->own_tasks = atomic_load_explicit(&p->own_tasks, memory_order_relaxed);
    s->helper_ns = atomic_load_explicit(&p->helper_ns, memory_order_relaxed);
    s->helper_tasks = atomic_load_explicit(&p->helper_tasks, memory_order_relaxed);
}

void pd_pool_destroy(pd_pool *p)
{
    if (!p)
        return;
    stop_workers(p);
    free_pool(p);
}

/* When pthread_create's EAGAIN was the address-space limit refusing a new thread's stack (its
 * default size: ulimit -s, 8 MiB), the note naming it (pd_as_note), else "". */
static const char *stack_note(int rc, char *buf, size_t cap)
{
    pthread_attr_t a;
    size_t stack = 8u << 20;
    buf[0] = 0;
    if (rc != EAGAIN)
        return buf;
    if (pthread_getattr_default_np(&a) == 0) {
        pthread_attr_getstacksize(&a, &stack);
        pthread_attr_destroy(&a);
    }
    return pd_as_note(buf, cap, (int64_t)stack);
}

const char *pd_thread_why(int rc, char *buf, size_t cap)
{
    char note[320];
    if (*stack_note(rc, note, sizeof note))
        snprintf(buf, cap, "%s (no room for its stack: %s)", strerror(rc), note);
    else
        snprintf(buf, cap, "%s%s", strerror(rc),
                 rc == EAGAIN ? " (a limit on threads: ulimit -u, the cgroup's pids.max as a container's --pids-limit "
                                "or systemd's TasksMax sets it, or memory for a stack)" : "");
    return buf;
}

int pd_thread_code(int rc)
{
    char note[320];
    return *stack_note(rc, note, sizeof note) ? PD_EINVAL : PD_ENOMEM;
}

int pd_thread_start(pthread_t *t, void *(*fn)(void *), void *arg, const char *what, pd_err *e)
{
    int rc = pthread_create(t, NULL, fn, arg);
    if (!rc)
        return 0;
    char why[512];
    return pd_err_set(e, pd_thread_code(rc), "cannot start the %s: %s", what, pd_thread_why(rc, why, sizeof why));
}

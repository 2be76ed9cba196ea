/* Thread pool: a run publishes (fn, arg, n_tasks) under the mutex and bumps a generation counter;
 * tasks are claimed with an atomic counter, so which thread runs task i varies, but what task i
 * computes does not. Between runs a worker first watches the generation for a short while (a
 * decode step issues dozens of small products back to back, and waking a sleeping thread costs
 * more than one of them), then sleeps on a condition variable: an idle pool uses no CPU. The
 * caller likewise watches the count of unfinished helpers briefly before sleeping. */
#include "core/threadpool.h"

#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

/* How long a thread polls before it sleeps. */
#define SPIN_NS 50000

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

    pthread_mutex_t mu;         /* guards everything below except `next` */
    pthread_cond_t wake;        /* workers wait here for a new generation or stop */
    pthread_cond_t done;        /* the caller waits here for pending == 0 */
    uint64_t gen;               /* bumped once per run */
    int stop;

    pd_pool_fn fn;              /* the current run */
    void *arg;
    int n_tasks;
    int n_helpers;              /* workers with id < n_helpers take part in the current run */
    atomic_int pending;         /* helpers that have not yet finished the current run */
    atomic_int next;            /* next unclaimed task */
    atomic_uint_fast64_t agen;  /* gen, published with release order for polling workers */
    int sleeping;               /* workers waiting on `wake` */

    pthread_mutex_t run_mu;     /* one run at a time */
};

/* Set while a thread executes tasks, so a nested pd_pool_run runs inline instead of waiting on
 * a pool whose threads are all busy with the outer run. */
static __thread int in_task;

static void claim_and_run(pd_pool *p, pd_pool_fn fn, void *arg, int n_tasks)
{
    in_task = 1;
    for (;;) {
        int i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
        if (i >= n_tasks)
            break;
        fn(arg, i);
    }
    in_task = 0;
}

static void *worker_main(void *vw)
{
    struct worker *w = vw;
    pd_pool *p = w->pool;
    uint64_t seen = 0;

    pthread_mutex_lock(&p->mu);
    for (;;) {
        if (!p->stop && p->gen == seen) {
            /* poll a little before sleeping: the next run usually comes at once */
            pthread_mutex_unlock(&p->mu);
            int64_t until = now_ns() + SPIN_NS;
            while (atomic_load_explicit(&p->agen, memory_order_acquire) == seen && now_ns() < until)
                relax();
            pthread_mutex_lock(&p->mu);
            p->sleeping++;
            while (!p->stop && p->gen == seen)
                pthread_cond_wait(&p->wake, &p->mu);
            p->sleeping--;
        }
        if (p->stop)
            break;
        seen = p->gen;
        /* A worker not needed for this run goes back to sleep; the caller does not wait for it,
         * so it may even skip whole generations. */
        if (w->id >= p->n_helpers)
            continue;
        pd_pool_fn fn = p->fn;
        void *arg = p->arg;
        int n = p->n_tasks;
        pthread_mutex_unlock(&p->mu);

        claim_and_run(p, fn, arg, n);

        pthread_mutex_lock(&p->mu);
        assert(atomic_load(&p->pending) > 0);
        if (atomic_fetch_sub(&p->pending, 1) == 1)
            pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void stop_workers(pd_pool *p)
{
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
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
    pd_pool *p = calloc(1, sizeof *p);
    if (!p)
        return pd_err_set(err, PD_ENOMEM, "thread pool: out of memory");
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
    atomic_init(&p->next, 0);
    atomic_init(&p->pending, 0);
    atomic_init(&p->agen, 0);

    for (int i = 0; i < nthreads - 1; i++) {
        struct worker *w = &p->workers[i];
        w->pool = p;
        w->id = i;
        int rc = pthread_create(&w->thread, NULL, worker_main, w);
        if (rc != 0) {
            stop_workers(p);
            free_pool(p);
            return pd_err_set(err, PD_ENOMEM, "thread pool: cannot start worker %d of %d", i + 1,
                              nthreads - 1);
        }
        p->nworkers++;
    }
    *out = p;
    return 0;
}

void pd_pool_run(pd_pool *p, int n_tasks, pd_pool_fn fn, void *arg)
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
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    p->n_tasks = n_tasks;
    /* The caller takes tasks too, so n_tasks - 1 helpers are enough. */
    p->n_helpers = n_tasks - 1 < p->nworkers ? n_tasks - 1 : p->nworkers;
    atomic_store(&p->pending, p->n_helpers);
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    p->gen++;
    atomic_store_explicit(&p->agen, p->gen, memory_order_release);
    if (p->sleeping)
        pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);

    claim_and_run(p, fn, arg, n_tasks);

    int64_t until = now_ns() + SPIN_NS;
    while (atomic_load(&p->pending) > 0 && now_ns() < until)
        relax();
    pthread_mutex_lock(&p->mu);
    while (atomic_load(&p->pending) > 0)
        pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
    pthread_mutex_unlock(&p->run_mu);
}

int pd_pool_nthreads(const pd_pool *p)
{
    return p ? p->nthreads : 1;
}

void pd_pool_destroy(pd_pool *p)
{
    if (!p)
        return;
    stop_workers(p);
    free_pool(p);
}

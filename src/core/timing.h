/* Monotonic time for benchmarks and timeouts. */
#ifndef PD_CORE_TIMING_H
#define PD_CORE_TIMING_H

#include <stdint.h>

double pd_now_s(void);      /* seconds, CLOCK_MONOTONIC */
int64_t pd_now_ns(void);
/* CPU seconds the whole process has used (every thread): on a machine shared with other work,
 * what a single-threaded phase would take alone, less the memory bandwidth the others take. */
double pd_cpu_s(void);
/* CPU seconds the calling thread has used. */
double pd_thread_cpu_s(void);

/* A thread's running total of some calls' wall time, for a profile (the engine's step profile): the
 * module that owns the calls keeps one per thread (_Thread_local) and hands it out; a profiler sets
 * `on` and reads `ns`. Off, a call costs one test. */
struct pd_call_clock {
    int on;
    int64_t ns;
};

static inline int64_t pd_call_clock_start(const struct pd_call_clock *c)
{
    return c->on ? pd_now_ns() : 0;
}

static inline void pd_call_clock_stop(struct pd_call_clock *c, int64_t t0)
{
    if (c->on)
        c->ns += pd_now_ns() - t0;
}

#endif

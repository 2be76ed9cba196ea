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

#endif

/* Monotonic time for benchmarks and timeouts. */
#ifndef PD_CORE_TIMING_H
#define PD_CORE_TIMING_H

#include <stdint.h>

double pd_now_s(void);      /* seconds, CLOCK_MONOTONIC */
int64_t pd_now_ns(void);

#endif

/* Byte counts as people read them. pdmoe never prints a bare "GB": every figure says GB
 * (10^9 bytes) or GiB (2^30 bytes), chosen by the caller's unit system. */
#ifndef PD_CORE_UNITS_H
#define PD_CORE_UNITS_H

#include <stddef.h>
#include <stdint.h>

enum pd_units { PD_UNITS_GB = 0, PD_UNITS_GIB = 1 };

#define PD_GB  1000000000.0
#define PD_GIB 1073741824.0

/* Formats bytes as "12.34 GB" / "11.49 GiB" (or MB/MiB, kB/KiB below 1 GB/GiB when auto). */
const char *pd_units_fmt(char *buf, size_t n, int64_t bytes, enum pd_units u);
/* Always in GB or GiB, `decimals` places. */
const char *pd_units_fmt_g(char *buf, size_t n, int64_t bytes, enum pd_units u, int decimals);
double pd_units_g(int64_t bytes, enum pd_units u);
const char *pd_units_g_name(enum pd_units u);

/* An integer with thousands separators, "-1,234,567"; buf holds at least 32 bytes. */
const char *pd_units_thousands(char *buf, int64_t v);

/* Parses "44000", "44KB", "44 KiB", "1.5GB", "2GiB" into bytes; returns 0 or PD_EINVAL. */
int pd_units_parse(const char *s, int64_t *bytes);

#endif

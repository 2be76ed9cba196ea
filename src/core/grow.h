/* Growing an array by doubling, overflow-checked: the one helper the parsers share. */
#ifndef PD_CORE_GROW_H
#define PD_CORE_GROW_H

#include <stdint.h>
#include <stdlib.h>

#include "core/err.h"

/* Makes *p (an array of elem-byte items, *cap of them) hold at least need items, doubling from 16;
 * PD_ENOMEM (and *p unchanged) if that would overflow or memory runs out. */
static inline int pd_grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    size_t c = *cap ? *cap : 16;
    while (c < need) {
        if (c > SIZE_MAX / 2 / elem)
            return PD_ENOMEM;
        c *= 2;
    }
    void *q = realloc(*p, c * elem);
    if (!q)
        return PD_ENOMEM;
    *p = q;
    *cap = c;
    return 0;
}

#define PD_GROW(arr, cap, need) pd_grow((void **)&(arr), &(cap), (need), sizeof *(arr))

#endif

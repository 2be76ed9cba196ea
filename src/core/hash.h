/* The two non-cryptographic hashes pdmoe uses, written once: FNV-1a over bytes (also the
 * fingerprints that must stay stable: logits digests, a recognised chat template) and MurmurHash3's
 * 64-bit finaliser, which spreads every input bit over the output (hash-table slots, chained
 * prefix hashes). Neither resists an adversary; where a collision matters the caller compares the
 * keys themselves. */
#ifndef PD_CORE_HASH_H
#define PD_CORE_HASH_H

#include <stddef.h>
#include <stdint.h>

#define PD_FNV64_INIT 0xcbf29ce484222325ull

/* FNV-1a of n bytes, continuing from h (PD_FNV64_INIT to start). */
static inline uint64_t pd_fnv1a64(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* MurmurHash3's fmix64. */
static inline uint64_t pd_mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

#endif

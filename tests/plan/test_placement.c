/* Expert placement: contiguous ranges, redundancy without duplicates, clear errors. */
#include <criterion/criterion.h>
#include <string.h>

#include "plan/placement.h"

Test(placement, contiguous_ranges)
{
    struct pd_placement p;
    pd_err e = {0};
    cr_assert_eq(pd_placement_build(&p, 256, 8, 0, NULL, &e), 0, "%s", e.msg);
    cr_assert_eq(p.slots, 32);
    for (int k = 0; k < 8; k++)
        for (int s = 0; s < 32; s++)
            cr_assert_eq(p.map[k * 32 + s], k * 32 + s);
    for (int x = 0; x < 256; x++)
        cr_assert_eq(pd_placement_owner(&p, x), x / 32);
    int64_t bytes[256];
    for (int x = 0; x < 256; x++)
        bytes[x] = x;
    /* rank 7 holds 224..255 */
    cr_assert_eq(pd_placement_rank_bytes(&p, 7, bytes), (224 + 255) * 32 / 2);
    pd_placement_free(&p);
}

Test(placement, not_divisible_is_an_error)
{
    struct pd_placement p;
    pd_err e = {0};
    cr_assert_eq(pd_placement_build(&p, 256, 6, 0, NULL, &e), PD_EINVAL);
    cr_assert(strstr(e.msg, "256 routed experts do not divide evenly over an EP group of 6 ranks"), "%s", e.msg);
    cr_assert(strstr(e.msg, "redundant=R in --prefill/--decode"), "%s", e.msg);
    cr_assert_null(p.map);
    cr_assert_eq(pd_placement_build(&p, 256, 6, 3, NULL, &e), PD_EINVAL);
    cr_assert(strstr(e.msg, "259 slots"), "%s", e.msg);
}

Test(placement, redundant_experts)
{
    struct pd_placement p;
    pd_err e = {0};
    /* 256 + 2 = 258 slots over 6 ranks: 43 each; primaries 42 or 43 per rank */
    cr_assert_eq(pd_placement_build(&p, 256, 6, 2, NULL, &e), 0, "%s", e.msg);
    cr_assert_eq(p.slots, 43);
    int copies[256] = {0};
    for (int k = 0; k < 6; k++) {
        for (int s = 0; s < 43; s++) {
            int x = p.map[k * 43 + s];
            copies[x]++;
            for (int t = 0; t < s; t++)
                cr_assert_neq(p.map[k * 43 + t], x, "rank %d holds expert %d twice", k, x);
        }
    }
    int total = 0;
    for (int x = 0; x < 256; x++) {
        cr_assert_geq(copies[x], 1);
        total += copies[x];
    }
    cr_assert_eq(total, 258);
    /* ranks 0 and 3 hold 42 primaries and get one replica each, the first expert by id they
     * lack: rank 3 takes expert 0, then rank 0 (holding 0-41) takes expert 42 */
    cr_assert_eq(copies[0], 2);
    cr_assert_eq(copies[42], 2);
    cr_assert_eq(p.map[3 * 43 + 42], 0);
    cr_assert_eq(p.map[0 * 43 + 42], 42);
    pd_placement_free(&p);
}

Test(placement, replicas_follow_load)
{
    struct pd_placement p;
    pd_err e = {0};
    double load[16] = {0};
    load[9] = 5;
    load[3] = 7;
    cr_assert_eq(pd_placement_build(&p, 16, 2, 2, load, &e), 0, "%s", e.msg);
    int copies[16] = {0};
    for (int i = 0; i < 2 * p.slots; i++)
        copies[p.map[i]]++;
    cr_assert_eq(copies[3], 2);
    cr_assert_eq(copies[9], 2);
    /* expert 3 lives on rank 0, so its replica must be on rank 1 */
    int on1 = 0;
    for (int s = 0; s < p.slots; s++)
        on1 |= p.map[p.slots + s] == 3;
    cr_assert(on1);
    pd_placement_free(&p);
}

/* The measured imbalance: the busiest rank's tokens over the mean, averaged over layers that
 * saw tokens; replicas (placed on the hottest experts by total load) share an expert's load. */
Test(placement, imbalance_from_routed_tokens)
{
    struct pd_placement p;
    pd_err e = {0};
    const double load[3][4] = {{3, 1, 1, 1}, {1, 1, 1, 1}, {0, 0, 0, 0}};
    cr_assert_eq(pd_placement_build(&p, 4, 2, 0, NULL, &e), 0, "%s", e.msg);
    /* layer 0: ranks {0,1} hold 4 and 2 tokens, mean 3; layer 1 even; layer 2 has none */
    cr_assert_float_eq(pd_placement_imbalance(&p, &load[0][0], 3), (4.0 / 3 + 1) / 2, 1e-12);
    cr_assert_eq(pd_placement_imbalance(&p, &load[2][0], 1), 0);
    pd_placement_free(&p);
    /* two replicas by total load {4, 2, 2, 2}: expert 0 onto rank 1, expert 2 onto rank 0;
     * each rank then carries half of 0 and of 2: layer 0 is 3 and 3 */
    const double total[4] = {4, 2, 2, 2};
    cr_assert_eq(pd_placement_build(&p, 4, 2, 2, total, &e), 0, "%s", e.msg);
    const int want[6] = {0, 1, 2, 2, 3, 0};
    for (int i = 0; i < 6; i++)
        cr_assert_eq(p.map[i], want[i], "slot %d", i);
    cr_assert_float_eq(pd_placement_imbalance(&p, &load[0][0], 2), 1.0, 1e-12);
    pd_placement_free(&p);
}

/* With a load the replicas balance it: one expert with 40 of 47 tokens gets a copy on every rank
 * (three replicas), each onto the least-loaded rank that lacks it, and the last replica goes to
 * the next expert that the one rank with room lacks. */
Test(placement, a_hot_expert_gets_several_replicas)
{
    struct pd_placement p;
    pd_err e = {0};
    const double load[8] = {40, 1, 1, 1, 1, 1, 1, 1};
    cr_assert_eq(pd_placement_build(&p, 8, 4, 4, load, &e), 0, "%s", e.msg);
    const int want[12] = {0, 1, 2, 2, 3, 0, 4, 5, 0, 6, 7, 0};
    for (int i = 0; i < 12; i++)
        cr_assert_eq(p.map[i], want[i], "slot %d", i);
    /* ranks carry 11.5, 11.5, 12 and 12 tokens, the mean is 11.75 */
    cr_assert_float_eq(pd_placement_imbalance(&p, load, 1), 12 / 11.75, 1e-12);
    pd_placement_free(&p);
}

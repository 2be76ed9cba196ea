/* Plans the tests of tests/plan build: any options (failing the test with the planner's
 * message), or the seed's deployment. */
#ifndef PD_TESTS_PLAN_FIXTURE_H
#define PD_TESTS_PLAN_FIXTURE_H

#include <criterion/criterion.h>

#include "plan/plan.h"

static inline void build(struct pd_plan_opts *o, struct pd_plan *p)
{
    pd_err e = {0};
    cr_assert_eq(pd_plan_build(o, p, &e), 0, "%s", e.msg);
}

static inline void seed_plan(struct pd_plan *p)
{
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    build(&o, p);
}

#endif

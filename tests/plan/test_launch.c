/* pdmoe's own launch commands (plan/launch.h): the ports of a layout and the argv of an instance,
 * one rank or an EP group spanning hosts, as `pdmoe up --hosts` runs them. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "plan/launch.h"

/* argv joined with single spaces */
static void joined(char **a, char *out, size_t cap)
{
    size_t n = 0;
    out[0] = 0;
    for (int i = 0; a[i]; i++)
        n += (size_t)snprintf(out + n, cap - n, "%s%s", i ? " " : "", a[i]);
}

Test(launch, ports_follow_one_scheme)
{
    struct pd_launch_inst x[3] = {{.role = 0, .ranks = 2}, {.role = 0, .ranks = 12}, {.role = 1, .ranks = 2}};
    pd_err e = {0};
    cr_assert_eq(pd_launch_ports(x, 3, 8000, &e), 0, "%s", e.msg);
    cr_assert_eq(x[0].port, 8001);
    cr_assert_eq(x[1].port, 8002);
    cr_assert_eq(x[2].port, 8003);
    /* prefill KV listeners 16 apart (the largest prefill group, 12 ranks, rounded up to 8s) */
    cr_assert_eq(x[0].kv_port, 8100);
    cr_assert_eq(x[1].kv_port, 8116);
    cr_assert_eq(x[2].kv_port, 0);
    cr_assert_eq(pd_launch_ports(x, 3, 65500, &e), PD_EINVAL);
    cr_assert(strstr(e.msg, "--port 65500: the instances' ports would reach 65627"), "%s", e.msg);
}

Test(launch, an_ep_group_across_hosts_is_one_mpirun_with_a_context_per_host)
{
    struct pd_launch_inst x = {.role = 0, .inst = 0, .n_groups = 2, .ranks = 3, .port = 8001, .kv_port = 8100,
                               .group = {{"10.0.0.1", 2}, {"10.0.0.2", 1}}};
    struct pd_launch_opts o = {.pdmoe = "pdmoe", .model = "/m", .served_name = "m", .threads = "4",
                               .max_model_len = "2048", .lease_ms = 5000, .extra = {"--max-num-seqs", "8"}};
    char **a = pd_launch_argv(&x, &o), s[4096];
    cr_assert_not_null(a);
    joined(a, s, sizeof s);
    const char *ctx = "pdmoe serve --model /m --host %s --port 8001 --threads 4 --max-model-len 2048 "
                      "--served-model-name m --kv-transfer-config {\"kv_role\":\"kv_producer\",\"kv_port\":8100,"
                      "\"engine_id\":\"prefill-0\",\"kv_host\":\"%s\",\"kv_lease_ms\":5000} --enable-expert-parallel "
                      "--data-parallel-size 3 --max-num-seqs 8";
    char c1[600], c2[600], want[1400];
    snprintf(c1, sizeof c1, ctx, "10.0.0.1", "10.0.0.1");
    snprintf(c2, sizeof c2, ctx, "10.0.0.2", "10.0.0.2");
    snprintf(want, sizeof want, "mpirun --host 10.0.0.1:2,10.0.0.2:1 --bind-to none -n 2 %s : -n 1 %s", c1, c2);
    cr_assert_str_eq(s, want);
    pd_launch_argv_free(a);
}

Test(launch, one_rank_runs_bare_here_and_under_mpirun_elsewhere)
{
    struct pd_launch_inst x = {.role = 1, .inst = 2, .n_groups = 1, .ranks = 1, .port = 8004,
                               .group = {{"10.0.0.3", 1}}};
    struct pd_launch_opts o = {.pdmoe = "pdmoe", .model = "/m", .served_name = "m", .threads = "1",
                               .max_model_len = "512", .api_key = "k"};
    char **a = pd_launch_argv(&x, &o), s[2048];
    joined(a, s, sizeof s);
    cr_assert_str_eq(s, "pdmoe serve --model /m --host 10.0.0.3 --port 8004 --threads 1 --max-model-len 512 "
                        "--served-model-name m --kv-transfer-config {\"kv_role\":\"kv_consumer\",\"engine_id\":"
                        "\"decode-2\",\"kv_host\":\"10.0.0.3\"}");   /* the key: in its environment */
    pd_launch_argv_free(a);
    o.remote = 1;
    o.allow_run_as_root = 1;
    a = pd_launch_argv(&x, &o);
    joined(a, s, sizeof s);
    const char *want = "mpirun --host 10.0.0.3:1 --bind-to none --allow-run-as-root -x PDMOE_API_KEY -n 1 pdmoe serve --model /m "
                       "--host 10.0.0.3 ";
    cr_assert(!strncmp(s, want, strlen(want)), "%s", s);
    cr_assert_null(strstr(s, " k "), "the key's value on a command line: %s", s);
    pd_launch_argv_free(a);
}

Test(launch, the_proxy_in_front_of_every_instance_with_its_policy)
{
    struct pd_launch_inst x[3] = {{.role = 0, .port = 8001, .group = {{"10.0.0.1", 1}}},
                                  {.role = 1, .port = 8002, .group = {{"10.0.0.2", 1}}},
                                  {.role = 1, .port = 8003}};
    struct pd_launch_proxy o = {.pdmoe = "pdmoe", .host = "0.0.0.0", .port = 8000, .policy = "least_loaded"};
    char **a = pd_launch_proxy_argv(x, 3, &o), s[1024];
    cr_assert(a);
    joined(a, s, sizeof s);
    cr_expect_str_eq(s, "pdmoe proxy --prefill 10.0.0.1:8001 --decode 10.0.0.2:8002,127.0.0.1:8003 --port 8000 "
                        "--host 0.0.0.0 --policy least_loaded");
    pd_launch_argv_free(a);
    o.policy = NULL;   /* the proxy's default, cache_aware: no flag */
    a = pd_launch_proxy_argv(x, 3, &o);
    joined(a, s, sizeof s);
    cr_expect(!strstr(s, "--policy"), "%s", s);
    pd_launch_argv_free(a);
}

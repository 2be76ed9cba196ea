/* Several hosts from the command line: the plan's node map, `pdmoe up --hosts` and the KV
 * transfer's address, each bad input refused with a one-line error naming the flag or field.
 * (The cluster itself runs in tests/cluster/run.sh, on network-namespace hosts.) */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/timing.h"
#include "../child.h"

static char plan_path[] = "/tmp/pdmoe-hosts-plan-XXXXXX";

/* pdmoe ARGS: its exit status, its stderr in err */
static int pdmoe(const char *args, char *err, size_t cap)
{
    const char *bin = pdmoe_bin();
    char cmd[2048], ef[] = "/tmp/pdmoe-hosts-err-XXXXXX";
    int fd = mkstemp(ef);
    cr_assert(fd >= 0);
    close(fd);
    snprintf(cmd, sizeof cmd, "%s %s >/dev/null 2>%s", bin, args, ef);
    int st = system(cmd);
    FILE *f = fopen(ef, "r");
    size_t n = f ? fread(err, 1, cap - 1, f) : 0;
    err[n] = 0;
    if (f)
        fclose(f);
    remove(ef);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static void refused(const char *args, const char *needle)
{
    char err[4096];
    int st = pdmoe(args, err, sizeof err);
    cr_assert_neq(st, 0, "pdmoe %s exited 0", args);
    cr_assert(strstr(err, needle), "pdmoe %s: stderr \"%s\" lacks \"%s\"", args, err, needle);
    cr_assert_eq(strchr(err, '\n'), err + strlen(err) - 1, "more than one line: %s", err);
}

/* a plan of mini on H100 nodes: prefill EP2 on node 0, decode EP2 on node 1 (its own node) */
static void write_plan(void)
{
    const char *bin = pdmoe_bin();
    int fd = mkstemp(plan_path);
    cr_assert(fd >= 0);
    close(fd);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s plan --model models/mini --hardware h100 --nodes 2 --prefill dp=2,instances=1 "
             "--decode dp=2,instances=1 --mtp off --kv-cache-dtype bf16 --max-model-len 2048 --json > %s", bin,
             plan_path);
    cr_assert_eq(system(cmd), 0);
}

static void drop_plan(void)
{
    remove(plan_path);
}

Test(hosts, the_plans_json_carries_its_node_map)
{
    const char *bin = pdmoe_bin();
    char cmd[256];
    snprintf(cmd, sizeof cmd, "%s plan --json", bin);
    FILE *p = popen(cmd, "r");
    json_error_t je;
    json_t *j = json_loadf(p, 0, &je);
    pclose(p);
    cr_assert_not_null(j, "%s", je.text);
    char *map = json_dumps(json_object_get(j, "node_map"), JSON_COMPACT);
    /* the seed's layout: prefill instance i on node i (EP8 on 8 cards), decode EP32 on nodes 4-7 */
    cr_assert_str_eq(map, "[{\"role\":\"prefill\",\"instance\":0,\"nodes\":[0],\"ranks\":[8]},"
                          "{\"role\":\"prefill\",\"instance\":1,\"nodes\":[1],\"ranks\":[8]},"
                          "{\"role\":\"prefill\",\"instance\":2,\"nodes\":[2],\"ranks\":[8]},"
                          "{\"role\":\"prefill\",\"instance\":3,\"nodes\":[3],\"ranks\":[8]},"
                          "{\"role\":\"decode\",\"instance\":0,\"nodes\":[4,5,6,7],\"ranks\":[8,8,8,8]}]");
    free(map);
    json_decref(j);
}

Test(hosts, up_refuses_bad_hosts, .init = write_plan, .fini = drop_plan)
{
    char args[1024];
    refused("up --hosts 10.0.0.1,10.0.0.2", "--hosts needs --plan plan.json");
    refused("up --hosts 10.0.0.1,10.0.0.1", "--hosts: 10.0.0.1 is listed twice (hosts 1 and 2)");
    refused("up --hosts '10.0.0.1,a b'", "--hosts: host 2 \"a b\": expected an address or host name");
    refused("up --host-timeout 5", "--host-timeout is how long each host of --hosts may take");
    refused("up --hosts 10.0.0.1,10.0.0.2 --host-timeout 0", "--host-timeout");
    snprintf(args, sizeof args, "up --model models/mini --plan %s --hosts 127.0.0.1", plan_path);
    refused(args, "--hosts: 1 given but the plan's node map uses 2 nodes");
    /* a plan with EPLB's redundant experts: pdmoe serve has none, so up refuses it rather than
     * running another layout than the plan's */
    char red[128];
    snprintf(red, sizeof red, "%s.red", plan_path);
    const char *bin = pdmoe_bin();
    snprintf(args, sizeof args, "%s plan --model models/mini --hardware h100 --nodes 2 --prefill dp=2,instances=1 "
             "--decode dp=2,instances=1,redundant=2 --mtp off --max-model-len 2048 --json > %s", bin, red);
    cr_assert_eq(system(args), 0);
    snprintf(args, sizeof args, "up --model models/mini --plan %s", red);
    refused(args, "roles[1] has 2 redundant experts; pdmoe serve places each expert once");
    remove(red);
    /* a plan written before node maps */
    json_error_t je;
    json_t *j = json_load_file(plan_path, 0, &je);
    cr_assert_not_null(j);
    json_object_del(j, "node_map");
    cr_assert_eq(json_dump_file(j, plan_path, 0), 0);
    json_decref(j);
    snprintf(args, sizeof args, "up --model models/mini --plan %s --hosts 127.0.0.1,127.0.0.2", plan_path);
    refused(args, "no \"node_map\"");
}

/* A host whose launcher hangs (an ssh to a blackholed host, here an agent that sleeps) is said
 * unreachable after --host-timeout (3 s here; 20 by default), and the agent does not outlive up:
 * it ran on, in a process group of its own that killing mpirun's missed, able to start an orted
 * for a dead mpirun later. */
Test(hosts, a_hung_launcher_is_not_left_behind, .init = write_plan, .fini = drop_plan, .timeout = 90)
{
    char dir[] = "/tmp/pdmoe-hang-XXXXXX", agent[64], pidf[64], args[1024], err[4096];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(agent, sizeof agent, "%s/agent", dir);
    snprintf(pidf, sizeof pidf, "%s/pid", dir);
    FILE *f = fopen(agent, "w");
    cr_assert_not_null(f);
    fprintf(f, "#!/bin/sh\necho $$ > %s\nexec sleep 300\n", pidf);
    fclose(f);
    chmod(agent, 0700);
    setenv("OMPI_MCA_plm_rsh_agent", agent, 1);
    snprintf(args, sizeof args, "up --model models/mini --plan %s --hosts 127.0.0.1,198.18.250.7 --host-timeout 3",
             plan_path);
    double t0 = pd_now_s();
    int st = pdmoe(args, err, sizeof err);
    double took = pd_now_s() - t0;
    unsetenv("OMPI_MCA_plm_rsh_agent");
    cr_assert_eq(st, 2, "exit %d: %s", st, err);
    cr_assert(strstr(err, "host 198.18.250.7 is unreachable") && strstr(err, "within 3 s (--host-timeout)"), "%s", err);
    cr_assert(took >= 3 && took < 10, "up gave up on the hung host after %.1f s, not its --host-timeout 3", took);
    f = fopen(pidf, "r");
    cr_assert_not_null(f, "the launcher never ran its agent: %s", err);
    int pid = 0;
    cr_assert_eq(fscanf(f, "%d", &pid), 1);
    fclose(f);
    for (int i = 0; i < 100 && !pid_ended(pid); i++)
        usleep(20000);
    int alive = !pid_ended(pid);
    if (alive)
        kill(pid, SIGKILL);
    remove(agent);
    remove(pidf);
    rmdir(dir);
    cr_assert(!alive, "the launcher's agent (pid %d) outlived pdmoe up", pid);
}

Test(hosts, serve_reads_kv_host_and_refuses_keys_it_does_not_read)
{
    refused("serve --model models/mini --kv-transfer-config '{\"kv_role\":\"kv_producer\",\"kv_connector\":"
            "\"MooncakeConnectorV1\"}'", "\"kv_connector\" is not a key pdmoe reads");
    refused("serve --model models/mini --kv-transfer-config '{\"kv_role\":\"kv_producer\",\"kv_host\":\"\"}'",
            "kv_host must be an address or host name");
    refused("serve --model models/mini --kv-transfer-config '{\"kv_role\":\"kv_producer\",\"kv_host\":7}'",
            "kv_host must be an address or host name");
    /* an address of no interface here (TEST-NET-3): the listener cannot bind it, and says so */
    refused("serve --model models/mini --port 0 --kv-transfer-config '{\"kv_role\":\"kv_producer\",\"kv_host\":"
            "\"203.0.113.7\"}'", "listen address 203.0.113.7: no network interface of this host");
}

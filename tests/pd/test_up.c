/* pdmoe up as a user runs it: the whole local cluster (prefill, decode, proxy: real processes)
 * gives the same greedy tokens as one colocated process, the openai-style endpoint works, and
 * SIGINT stops every process it started. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/genmodel.h"
#include "../tmpmodel.h"
#include "util.h"

static char dir[64];

static void setup(void)
{
    tmp_model("v4-tiny", 13, dir, sizeof dir);
}

static void teardown(void)
{
    rm_model(dir);
}

TestSuite(up, .init = setup, .fini = teardown, .timeout = 180);

Test(up, cluster_matches_colocated_and_stops_cleanly)
{
    const char *bin = getenv("PDMOE_BIN") ? getenv("PDMOE_BIN") : "build/pdmoe";
    const int port = 18500 + (getpid() % 300) * 3;
    char out[256];
    snprintf(out, sizeof out, "%s/up.out", dir);
    pid_t up = fork();
    if (up == 0) {
        char sp[16];
        snprintf(sp, sizeof sp, "%d", port);
        freopen(out, "w", stdout);
        execl(bin, bin, "up", "--model", dir, "--port", sp, (char *)NULL);
        _exit(127);
    }
    int ready = 0;
    for (int i = 0; i < 600 && !ready; i++) {
        FILE *f = fopen(out, "r");
        char line[512] = "";
        if (f) {
            ready = fgets(line, sizeof line, f) && strstr(line, "Ctrl-C");
            fclose(f);
        }
        if (!ready)
            usleep(100000);
    }
    cr_assert(ready, "pdmoe up did not become ready");
    char a[8192];
    const char *name = strrchr(dir, '/') + 1;
    char body[512];
    snprintf(body, sizeof body, "{\"model\":\"%s\",\"prompt\":\"The quick brown fox\",\"max_tokens\":12,\"temperature\":0,"
             "\"return_token_ids\":true}", name);
    cr_assert_eq(curl_port(port, "/v1/completions", body, NULL, a, sizeof a), 200, "%s", a);
    json_t *j = parse(a);
    json_t *ids = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids");
    char want[1024] = "[0] ids", *w = want + strlen(want);
    for (size_t i = 0; i < json_array_size(ids); i++)
        w += sprintf(w, " %lld", (long long)json_integer_value(json_array_get(ids, i)));
    json_decref(j);
    /* one colocated process, the same request */
    char cmd[512], gen[8192];
    snprintf(cmd, sizeof cmd, "%s generate --model %s --prompt 'The quick brown fox' --max-tokens 12 --print-ids "
             "--threads 1", bin, dir);
    FILE *p = popen(cmd, "r");
    size_t n = fread(gen, 1, sizeof gen - 1, p);
    gen[n] = 0;
    pclose(p);
    cr_assert(strstr(gen, want), "through pdmoe up: \"%s\"; colocated:\n%s", want, gen);
    /* Ctrl-C: everything stops */
    kill(up, SIGINT);
    int status;
    cr_assert_eq(waitpid(up, &status, 0), up);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "pdmoe up exited with %d", status);
    /* "-[-]port" matches the children's "--port N" but not this pgrep's own command line */
    snprintf(cmd, sizeof cmd, "pgrep -f -- '-[-]port %d( |$)' | wc -l", port);
    p = popen(cmd, "r");
    int left = -1;
    cr_assert_eq(fscanf(p, "%d", &left), 1);
    pclose(p);
    cr_assert_eq(left, 0, "%d processes left behind", left);
}

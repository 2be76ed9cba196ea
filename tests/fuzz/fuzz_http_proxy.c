/* libFuzzer harness for the proxy's HTTP side: each input is the raw bytes of a request sent to
 * a real `pdmoe proxy` front on loopback in this process, relaying to a v4-tiny colocated server
 * (also in this process); the answer must be well-formed HTTP whose errors are JSON
 * (tests/fuzz/http_harness.h). Seeds in tests/fuzz/seeds/http_proxy/. */
#include "tests/fuzz/http_harness.h"
#include "proxy/proxy.h"

static int port;

int LLVMFuzzerInitialize(int *argc, char ***argv);
static void *run_proxy(void *arg)
{
    pd_err e;
    pd_proxy_run(arg, &e);
    return NULL;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    static char decode[32];
    snprintf(decode, sizeof decode, "127.0.0.1:%d", pd_server_port(fuzz_server()));
    struct pd_proxy_opts o = {.decode = {decode}, .n_decode = 1, .http = fuzz_limits};
    struct pd_proxy *px;
    pd_err e = {0};
    if (pd_proxy_create(&o, &px, &e)) {
        fprintf(stderr, "harness: %s\n", e.msg);
        abort();
    }
    pthread_t t;
    CHECK(pthread_create(&t, NULL, run_proxy, px) == 0);
    pthread_detach(t);
    port = pd_proxy_port(px);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_exchange(port, data, size);
    return 0;
}

/* libFuzzer harness for the server's HTTP side: each input is the raw bytes of a request (method
 * line, headers, body) sent to a real `pdmoe serve` front on loopback in this process, with its
 * handlers, scheduler and a v4-tiny engine; the answer must be well-formed HTTP whose errors are
 * JSON (tests/fuzz/http_harness.h). Seeds in tests/fuzz/seeds/http_server/. */
#include "tests/fuzz/http_harness.h"

static int port;

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    port = pd_server_port(fuzz_server());
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_exchange(port, data, size);
    return 0;
}

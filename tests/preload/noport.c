/* LD_PRELOAD shim for the tests (build/libnoport.so): while the file PDMOE_TEST_NOPORT_FILE
 * exists, connect() to TCP port PDMOE_TEST_NOPORT_PORT fails with EADDRNOTAVAIL, as when every
 * ephemeral port of the host towards that destination is in use or in TIME_WAIT. Not linked into
 * pdmoe-tests. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

int connect(int fd, const struct sockaddr *sa, socklen_t len)
{
    static int (*real)(int, const struct sockaddr *, socklen_t);
    if (!real)
        real = (int (*)(int, const struct sockaddr *, socklen_t))dlsym(RTLD_NEXT, "connect");
    const char *file = getenv("PDMOE_TEST_NOPORT_FILE"), *port = getenv("PDMOE_TEST_NOPORT_PORT");
    if (file && port && sa && sa->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in) &&
        ntohs(((const struct sockaddr_in *)sa)->sin_port) == atoi(port) && access(file, F_OK) == 0) {
        errno = EADDRNOTAVAIL;
        return -1;
    }
    if (!real) {
        errno = ENOSYS;
        return -1;
    }
    return real(fd, sa, len);
}

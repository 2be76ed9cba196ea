/* LD_PRELOAD shim for the tests (build/libnoport.so): while the file PDMOE_TEST_NOPORT_FILE
 * exists, connect() to TCP port PDMOE_TEST_NOPORT_PORT (if set), or to any port the file lists
 * (decimal, separated by anything else), fails with EADDRNOTAVAIL, as when every ephemeral port of
 * the host towards that destination is in use or in TIME_WAIT. The file is read at each connect, so
 * a test changes which instances are short while the process runs. Not linked into pdmoe-tests. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
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
    if (file && sa && sa->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in) &&
        access(file, F_OK) == 0) {
        const int to = ntohs(((const struct sockaddr_in *)sa)->sin_port);
        int short_of = port && atoi(port) == to;
        int f = open(file, O_RDONLY | O_CLOEXEC);
        if (f >= 0) {
            char list[512];
            ssize_t n = read(f, list, sizeof list - 1);
            close(f);
            list[n > 0 ? n : 0] = 0;
            for (char *p = list; *p && !short_of;) {
                if (*p < '0' || *p > '9') {
                    p++;
                    continue;
                }
                short_of = strtol(p, &p, 10) == to;
            }
        }
        if (short_of) {
            errno = EADDRNOTAVAIL;
            return -1;
        }
    }
    if (!real) {
        errno = ENOSYS;
        return -1;
    }
    return real(fd, sa, len);
}

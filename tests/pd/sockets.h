/* Test helper: the listening sockets of a process (TCP in LISTEN, every bound UDP socket), from
 * /proc/PID/net/{tcp,tcp6,udp,udp6} matched to the socket inodes of /proc/PID/fd. */
#ifndef PD_TESTS_PD_SOCKETS_H
#define PD_TESTS_PD_SOCKETS_H

#include <arpa/inet.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

/* Whether inode is one of pid's sockets. */
static inline int sock_owned(pid_t pid, unsigned long inode)
{
    char path[64], link[64], want[40];
    snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
    snprintf(want, sizeof want, "socket:[%lu]", inode);
    DIR *d = opendir(path);
    int found = 0;
    for (struct dirent *de; d && !found && (de = readdir(d));) {
        char fd[600];
        snprintf(fd, sizeof fd, "%s/%s", path, de->d_name);
        ssize_t n = readlink(fd, link, sizeof link - 1);
        if (n > 0) {
            link[n] = 0;
            found = strcmp(link, want) == 0;
        }
    }
    if (d)
        closedir(d);
    return found;
}

/* Appends "proto addr:port" of every listening socket of pid to out (one per line); returns
 * their number, and in *elsewhere how many are not on the IPv4 address `only`. */
static inline int sock_listening(pid_t pid, const char *only, char *out, size_t cap, int *elsewhere)
{
    static const char *const files[] = {"tcp", "tcp6", "udp", "udp6"};
    int n = 0;
    *elsewhere = 0;
    out[0] = 0;
    for (int f = 0; f < 4; f++) {
        char path[64], line[512];
        snprintf(path, sizeof path, "/proc/%d/net/%s", (int)pid, files[f]);
        FILE *fp = fopen(path, "r");
        if (!fp)
            continue;
        int v6 = f % 2, udp = f >= 2;
        for (int row = 0; fgets(line, sizeof line, fp); row++) {
            char local[64];
            unsigned port, st;
            unsigned long inode;
            if (row == 0 || sscanf(line, " %*d: %63[0-9A-Fa-f]:%x %*[0-9A-Fa-f]:%*x %x %*x:%*x %*x:%*x %*x %*u %*u %lu",
                                   local, &port, &st, &inode) != 4)
                continue;
            /* TCP: LISTEN (0x0A); UDP: every socket bound to a port */
            if ((!udp && st != 0x0A) || (udp && port == 0) || !sock_owned(pid, inode))
                continue;
            /* the kernel prints the address as 32-bit words in host order */
            unsigned char a[16];
            int words = v6 ? 4 : 1;
            for (int w = 0; w < words; w++) {
                unsigned long x = strtoul((char[9]){local[8 * w], local[8 * w + 1], local[8 * w + 2], local[8 * w + 3],
                                                    local[8 * w + 4], local[8 * w + 5], local[8 * w + 6], local[8 * w + 7], 0},
                                          NULL, 16);
                uint32_t u = (uint32_t)x;
                memcpy(a + 4 * w, &u, 4);
            }
            char txt[INET6_ADDRSTRLEN];
            inet_ntop(v6 ? AF_INET6 : AF_INET, a, txt, sizeof txt);
            size_t len = strlen(out);
            snprintf(out + len, cap - len, "%s %s:%u\n", files[f], txt, port);
            n++;
            if (v6 || strcmp(txt, only) != 0)
                (*elsewhere)++;
        }
        fclose(fp);
    }
    return n;
}

#endif

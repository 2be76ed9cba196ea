/* Interfaces by address, from getifaddrs(3). */
#include "core/net.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* addr's bytes (4 or 16) and family, from a numeric address or a name. */
static int resolve(const char *addr, struct sockaddr_storage *ss)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
    struct addrinfo *ai = NULL;
    int rc = getaddrinfo(addr, NULL, &hints, &ai);
    if (rc != 0 || !ai)
        return rc ? rc : EAI_NONAME;
    memcpy(ss, ai->ai_addr, ai->ai_addrlen);
    freeaddrinfo(ai);
    return 0;
}

static const uint8_t *bytes_of(const struct sockaddr *sa, size_t *n)
{
    if (sa->sa_family == AF_INET6) {
        *n = 16;
        return (const uint8_t *)&((const struct sockaddr_in6 *)sa)->sin6_addr;
    }
    *n = 4;
    return (const uint8_t *)&((const struct sockaddr_in *)sa)->sin_addr;
}

/* "network/prefix" of address a under mask m (n bytes). */
static void cidr(int family, const uint8_t *a, const uint8_t *m, size_t n, char *out, size_t cap)
{
    uint8_t net[16];
    int prefix = 0;
    for (size_t i = 0; i < n; i++) {
        net[i] = a[i] & m[i];
        for (int b = 7; b >= 0; b--)
            prefix += (m[i] >> b) & 1;
    }
    char s[INET6_ADDRSTRLEN];
    inet_ntop(family, net, s, sizeof s);
    snprintf(out, cap, "%s/%d", s, prefix);
}

int pd_net_iface_of(const char *addr, const char *what, struct pd_net_iface *out, pd_err *e)
{
    memset(out, 0, sizeof *out);
    struct sockaddr_storage ss;
    int rc = resolve(addr, &ss);
    if (rc)
        return pd_err_set(e, PD_EINVAL, "%s %s: cannot resolve it: %s", what, addr, gai_strerror(rc));
    size_t n;
    const uint8_t *want = bytes_of((const struct sockaddr *)&ss, &n);
    static const uint8_t zero[16];
    if (memcmp(want, zero, n) == 0)
        return 0;   /* a wildcard names no interface */
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) != 0)
        return pd_err_set(e, PD_EIO, "%s %s: getifaddrs: %s", what, addr, strerror(errno));
    for (struct ifaddrs *i = ifs; i && !out->name[0]; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != ss.ss_family)
            continue;
        size_t hn;
        const uint8_t *have = bytes_of(i->ifa_addr, &hn);
        if (memcmp(want, have, n) != 0)
            continue;
        snprintf(out->name, sizeof out->name, "%s", i->ifa_name);
        if (i->ifa_netmask)
            cidr(ss.ss_family, have, bytes_of(i->ifa_netmask, &hn), n, out->cidr, sizeof out->cidr);
    }
    freeifaddrs(ifs);
    if (!out->name[0]) {
        char host[256] = "";
        gethostname(host, sizeof host - 1);
        return pd_err_set(e, PD_EINVAL, "%s %s: no network interface of this host (%s) carries that address", what,
                          addr, host);
    }
    return 0;
}

int pd_net_is_local(const char *addr)
{
    struct pd_net_iface f;
    pd_err e = {0};
    return pd_net_iface_of(addr, "", &f, &e) == 0 && f.name[0];
}

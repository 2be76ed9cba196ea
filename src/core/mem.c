/* See mem.h. */
#include "core/mem.h"
#include "core/units.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

/* The first integer of file `path` (cgroup v2 writes "max" when there is no limit), or -1. */
static int64_t file_int(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    char b[64] = {0};
    const int ok = fgets(b, sizeof b, f) != NULL;
    fclose(f);
    char *end;
    long long v = ok ? strtoll(b, &end, 10) : -1;
    return ok && end != b && v >= 0 ? (int64_t)v : -1;
}

/* The room a memory cgroup leaves, of the one at `dir` (under its hierarchy's mount `root`) or of
 * one above it, the least of them: limit less use, files `lim` and `use` in each directory.
 * Lowers *avail and says so in `where`. A limit of 2^62 or more is cgroup v1's "none". */
static void cgroup_room(const char *root, const char *dir, const char *lim, const char *use, int64_t *avail,
                        char *where, int where_cap)
{
    char d[600], path[700];
    snprintf(d, sizeof d, "%s%s", root, strcmp(dir, "/") ? dir : "");
    for (;;) {
        snprintf(path, sizeof path, "%s/%s", d, lim);
        const int64_t max = file_int(path);
        snprintf(path, sizeof path, "%s/%s", d, use);
        const int64_t cur = file_int(path);
        if (max >= 0 && max < ((int64_t)1 << 62) && cur >= 0) {
            const int64_t room = max > cur ? max - cur : 0;
            if (*avail < 0 || room < *avail) {
                *avail = room;
                snprintf(where, (size_t)where_cap, "the %s of cgroup %s less its %s", lim,
                         d[strlen(root)] ? d + strlen(root) : "/", use);
            }
        }
        char *slash = strrchr(d, '/');
        if (!slash || (size_t)(slash - d) <= strlen(root))
            break;
        *slash = 0;
    }
}

int64_t pd_mem_available(char *where, int where_cap)
{
    int64_t avail = -1;
    FILE *f = fopen("/proc/meminfo", "r");
    char line[600];
    while (f && fgets(line, sizeof line, f)) {
        long long kb;
        if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1)
            avail = (int64_t)kb * 1024;
    }
    if (f)
        fclose(f);
    if (avail >= 0)
        snprintf(where, (size_t)where_cap, "MemAvailable in /proc/meminfo");
    /* the cgroups this process is in: "0::/path" (v2), "N:memory:/path" (v1's memory controller) */
    if (!(f = fopen("/proc/self/cgroup", "r")))
        return avail;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2)
            continue;
        *c1 = *c2 = 0;   /* line: the hierarchy's number, c1 + 1: its controllers, c2 + 1: the path */
        if (!strcmp(line, "0") && c2 == c1 + 1)
            cgroup_room("/sys/fs/cgroup", c2 + 1, "memory.max", "memory.current", &avail, where, where_cap);
        else if (strstr(c1 + 1, "memory"))
            cgroup_room("/sys/fs/cgroup/memory", c2 + 1, "memory.limit_in_bytes", "memory.usage_in_bytes", &avail,
                        where, where_cap);
    }
    fclose(f);
    return avail;
}

int pd_mem_fits(int64_t each, int copies, struct pd_mem_short *s)
{
    const int64_t avail = pd_mem_available(s->where, sizeof s->where);
    if (avail < 0 || copies < 1 || each * copies <= avail)
        return 1;
    pd_units_fmt_g(s->all, sizeof s->all, each * copies, PD_UNITS_GB, 2);
    pd_units_fmt_g(s->left, sizeof s->left, avail, PD_UNITS_GB, 2);
    pd_units_fmt_g(s->each_max, sizeof s->each_max, avail / copies, PD_UNITS_GB, 2);
    return 0;
}

const char *pd_shm_note(char *buf, size_t cap, int64_t need)
{
    struct statvfs v;
    buf[0] = 0;
    if (statvfs("/dev/shm", &v) != 0)
        return buf;
    int64_t avail = (int64_t)v.f_bavail * (int64_t)v.f_frsize, size = (int64_t)v.f_blocks * (int64_t)v.f_frsize;
    if (avail >= need)
        return buf;
    char a[32], t[32];
    pd_units_fmt(a, sizeof a, avail, PD_UNITS_GB);
    pd_units_fmt(t, sizeof t, size, PD_UNITS_GB);
    snprintf(buf, cap, "/dev/shm has %s free of %s: the shared-memory transports of Open MPI (a 4.19 MB segment "
             "per rank) and UCX (about 12 MB a process, for the KV hand-off) allocate there; free it, or give the "
             "container a larger one (docker run --shm-size 1g, a Kubernetes emptyDir of medium Memory)", a, t);
    return buf;
}

const char *pd_as_note(char *buf, size_t cap, int64_t bytes)
{
    struct rlimit rl;
    buf[0] = 0;
    if (getrlimit(RLIMIT_AS, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY)
        return buf;
    /* the size of the address space the limit counts (VmSize): statm's first figure, in pages */
    FILE *f = fopen("/proc/self/statm", "r");
    long long pages = -1;
    if (f) {
        if (fscanf(f, "%lld", &pages) != 1)
            pages = -1;
        fclose(f);
    }
    const int64_t limit = (int64_t)rl.rlim_cur, mapped = pages < 0 ? 0 : (int64_t)pages * sysconf(_SC_PAGESIZE);
    if (pages >= 0 && mapped + bytes <= limit)
        return buf;
    char l[32], m[32], b[32];
    pd_units_fmt(l, sizeof l, limit, PD_UNITS_GIB);
    pd_units_fmt(m, sizeof m, mapped, PD_UNITS_GIB);
    pd_units_fmt(b, sizeof b, bytes, PD_UNITS_GIB);
    if (pages < 0)
        snprintf(buf, cap, "the address-space limit (ulimit -v %lld, in KiB: %s) may be what refused these %s; raise "
                 "it (ulimit -v unlimited)", (long long)(limit / 1024), l, b);
    else
        snprintf(buf, cap, "the address-space limit (ulimit -v %lld, in KiB: %s) is less than the %s this process "
                 "maps plus these %s; raise it (ulimit -v unlimited)", (long long)(limit / 1024), l, m, b);
    return buf;
}

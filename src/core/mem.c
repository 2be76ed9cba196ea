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

/* The integer after `key` on a line "key N" of file `path` (/proc/vmstat, cgroup v2's
 * memory.events, v1's memory.oom_control), or -1. */
static int64_t file_field(const char *path, const char *key)
{
    FILE *f = fopen(path, "r");
    char line[256];
    int64_t v = -1;
    const size_t kl = strlen(key);
    while (f && v < 0 && fgets(line, sizeof line, f)) {
        char *end = NULL;
        long long x = strncmp(line, key, kl) || line[kl] != ' ' ? -1 : strtoll(line + kl + 1, &end, 10);
        if (x >= 0 && end != line + kl + 1)
            v = (int64_t)x;
    }
    if (f)
        fclose(f);
    return v;
}

/* A memory cgroup's files: v2's names or v1's. */
struct memcg_files {
    const char *lim, *use, *events;   /* its limit, its use, the file with its "oom_kill N" */
};
static const struct memcg_files memcg_v2 = {"memory.max", "memory.current", "memory.events"},
                                memcg_v1 = {"memory.limit_in_bytes", "memory.usage_in_bytes", "memory.oom_control"};

/* The room a memory cgroup leaves, of the one at `dir` (under its hierarchy's mount `root`) or of
 * one above it, the least of them: limit less use. Lowers *avail and says so in `where`; lowers
 * *least_limit (when not NULL; -1: none yet) to the least limit met. A limit of 2^62 or more is
 * cgroup v1's "none". */
static void cgroup_room(const char *root, const char *dir, const struct memcg_files *fs, int64_t *avail,
                        int64_t *least_limit, char *where, int where_cap)
{
    char d[600], path[700];
    snprintf(d, sizeof d, "%s%s", root, strcmp(dir, "/") ? dir : "");
    for (;;) {
        snprintf(path, sizeof path, "%s/%s", d, fs->lim);
        const int64_t max = file_int(path);
        snprintf(path, sizeof path, "%s/%s", d, fs->use);
        const int64_t cur = file_int(path);
        const int limited = max >= 0 && max < ((int64_t)1 << 62);
        if (limited && least_limit && (*least_limit < 0 || max < *least_limit))
            *least_limit = max;
        if (limited && cur >= 0 && avail) {
            const int64_t room = max > cur ? max - cur : 0;
            if (*avail < 0 || room < *avail) {
                *avail = room;
                snprintf(where, (size_t)where_cap, "the %s of cgroup %s less its %s", fs->lim,
                         d[strlen(root)] ? d + strlen(root) : "/", fs->use);
            }
        }
        char *slash = strrchr(d, '/');
        if (!slash || (size_t)(slash - d) <= strlen(root))
            break;
        *slash = 0;
    }
}

/* Calls fn for each memory cgroup of this process, as <proc>/self/cgroup names them ("0::/path":
 * v2, mounted at `sys`; "N:...memory...:/path": v1's memory controller, at <sys>/memory). */
static void each_memcg(const char *proc, const char *sys,
                       void (*fn)(const char *root, const char *dir, const struct memcg_files *fs, void *arg),
                       void *arg)
{
    char path[600], root[600], line[600];
    snprintf(path, sizeof path, "%s/self/cgroup", proc);
    FILE *f = fopen(path, "r");
    while (f && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2)
            continue;
        *c1 = *c2 = 0;   /* line: the hierarchy's number, c1 + 1: its controllers, c2 + 1: the path */
        if (!strcmp(line, "0") && c2 == c1 + 1) {
            fn(sys, c2 + 1, &memcg_v2, arg);
        } else if (strstr(c1 + 1, "memory")) {
            snprintf(root, sizeof root, "%s/memory", sys);
            fn(root, c2 + 1, &memcg_v1, arg);
        }
    }
    if (f)
        fclose(f);
}

struct avail_arg {
    int64_t *avail;
    char *where;
    int where_cap;
};

static void room_of(const char *root, const char *dir, const struct memcg_files *fs, void *arg)
{
    struct avail_arg *a = arg;
    cgroup_room(root, dir, fs, a->avail, NULL, a->where, a->where_cap);
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
    each_memcg("/proc", "/sys/fs/cgroup", room_of, &(struct avail_arg){&avail, where, where_cap});
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

/* each_memcg: the OOM kills and the limit of the first memory cgroup that counts them. The root
 * cgroup ("/") never counts its own: the kernel counts a kill in the victim's cgroup (and, on v2,
 * in those above it up to, not including, the root; v1 counts it in the victim's alone). */
static void oom_of(const char *root, const char *dir, const struct memcg_files *fs, void *arg)
{
    struct pd_oom_count *c = arg;
    if (c->cgroup >= 0 || !strcmp(dir, "/") || strlen(dir) >= sizeof c->cgroup_path)
        return;
    char path[700];
    snprintf(path, sizeof path, "%s%s/%s", root, dir, fs->events);
    if ((c->cgroup = file_field(path, "oom_kill")) < 0)
        return;
    snprintf(c->cgroup_path, sizeof c->cgroup_path, "%s", dir);
    cgroup_room(root, dir, fs, NULL, &c->limit, NULL, 0);
}

void pd_oom_count_at(struct pd_oom_count *c, const char *proc, const char *sys)
{
    char path[600];
    snprintf(path, sizeof path, "%s/vmstat", proc);
    *c = (struct pd_oom_count){.host = file_field(path, "oom_kill"), .cgroup = -1, .limit = -1};
    each_memcg(proc, sys, oom_of, c);
}

void pd_oom_count(struct pd_oom_count *c)
{
    pd_oom_count_at(c, "/proc", "/sys/fs/cgroup");
}

const char *pd_oom_note(char *buf, size_t cap, const struct pd_oom_count *before, const struct pd_oom_count *after)
{
    buf[0] = 0;
    /* the cgroup's count, when there is one to compare, is the whole answer: the kernel counts
     * every OOM kill of a process in it there, the host's and a parent cgroup's included (v2
     * memory.events "any kind of OOM killer"; v1 memory.oom_control alike), so a host's count that
     * rose while it did not is other cgroups' kills: on a shared host, a SIGKILL from elsewhere
     * that coincided with them was blamed on memory and counted in pdmoe_oom_deaths_total */
    const int comparable = before->cgroup >= 0 && after->cgroup >= 0 &&
                           !strcmp(before->cgroup_path, after->cgroup_path);
    const int in_cgroup = comparable && after->cgroup > before->cgroup;
    const int on_host = before->host >= 0 && after->host > before->host && (in_cgroup || !comparable);
    if (!in_cgroup && !on_host)
        return buf;
    const int64_t n = in_cgroup ? after->cgroup - before->cgroup : after->host - before->host;
    char lim[48] = "no memory limit", host[96] = "";
    if (after->limit >= 0) {
        char g[32];
        snprintf(lim, sizeof lim, "limit %s", pd_units_fmt(g, sizeof g, after->limit, PD_UNITS_GIB));
    }
    if (on_host)
        snprintf(host, sizeof host, "%s/proc/vmstat oom_kill %lld -> %lld", in_cgroup ? "; " : "",
                 (long long)before->host, (long long)after->host);
    if (in_cgroup)
        snprintf(buf, cap, "the kernel's OOM killer killed %lld process%s in this cgroup meanwhile (cgroup %s: %s, "
                 "oom_kill %lld -> %lld%s): its processes need more memory than it gives them",
                 (long long)n, n == 1 ? "" : "es", after->cgroup_path, lim, (long long)before->cgroup,
                 (long long)after->cgroup, host);
    else
        snprintf(buf, cap, "the kernel's OOM killer killed %lld process%s on this host meanwhile (%s): its "
                 "processes need more memory than it has", (long long)n, n == 1 ? "" : "es", host);
    return buf;
}

/* The memory this process can still take without swapping or meeting the OOM killer, and the OOM
 * killer's kills so far. */
#ifndef PD_CORE_MEM_H
#define PD_CORE_MEM_H

#include <stddef.h>
#include <stdint.h>

/* Bytes: the smaller of the kernel's MemAvailable (/proc/meminfo: free memory plus what it can
 * reclaim without swapping) and, in a cgroup v2 with a memory limit (a container, a Kubernetes
 * pod, a systemd slice), that limit less what the cgroup uses. -1 when neither can be read.
 * `where` (at least 96 bytes) says which one bounded it. */
int64_t pd_mem_available(char *where, int where_cap);

/* Whether `copies` allocations of `each` bytes fit the memory left (pd_mem_available): 1 when they
 * do, or when it cannot be read; 0 when they do not, with the figures a refusal gives in GB (all
 * of them, the memory left, the most each may have) and where the memory left comes from. */
struct pd_mem_short {
    char all[32], left[32], each_max[32], where[160];
};
int pd_mem_fits(int64_t each, int copies, struct pd_mem_short *s);

/* /dev/shm, where Open MPI's shared-memory transport (vader: a 4,194,312-byte segment per rank)
 * and UCX's (posix mm, for the KV hand-off: about 12 MB a process) allocate. A container gets a
 * small one unless told (Docker: 64 MiB, --shm-size); a full one fails those transports with
 * "Out of memory" or 60 lines of Open MPI's. When it has less than `need` bytes free, a note
 * for such an error, naming it with its figures in MB: "/dev/shm has 0.06 MB free of 0.07 MB:
 * ..."; else (or when it cannot be read) "". */
const char *pd_shm_note(char *buf, size_t cap, int64_t need);
/* What each takes there, as measured on Open MPI 4.1 and UCX 1.13 (Debian 12): vader's segment
 * file per rank, a UCX worker's tmpfs use (its receive FIFOs, 12.6 MB here, rounded up). */
#define PD_SHM_VADER_RANK_BYTES 4194312
#define PD_SHM_UCX_WORKER_BYTES 16000000

/* After an allocation or a mapping of `bytes` failed for want of memory: when it is the process's
 * address-space limit (RLIMIT_AS: ulimit -v, as a batch system or a supervisor may set it) that
 * refused it, i.e. what the process maps already and `bytes` pass it, a note naming the limit with
 * its figures: "the address-space limit (ulimit -v 1000000, in KiB: 976.56 MiB) is less than the
 * 38.30 MiB this process maps plus these 914.02 MiB; raise it (ulimit -v unlimited)"; else (no
 * limit, or room under it: the failure is another's) "". Only the figures make the difference: a
 * failed mmap or malloc says ENOMEM for both. */
const char *pd_as_note(char *buf, size_t cap, int64_t bytes);

/* The kernel's OOM kills so far, as a supervisor reads them when it starts a child and again when
 * the child dies: a counter that rose between the two says the OOM killer ran meanwhile, which a
 * bare SIGKILL (exit status 137) does not. */
struct pd_oom_count {
    int64_t host;            /* /proc/vmstat oom_kill: the host's kills since boot; -1 when it has none
                              * (Linux < 4.13) */
    int64_t cgroup;          /* oom_kill of this process's memory cgroup (v2 memory.events, v1
                              * memory.oom_control): kills of processes in it (v2: and in the cgroups
                              * below it); -1 when there is none (the root cgroup, no cgroupfs) */
    int64_t limit;           /* the least memory limit of that cgroup and those above it (v2
                              * memory.max, v1 memory.limit_in_bytes), bytes; -1: none (the note
                              * gives it in GiB, MiB below one) */
    char cgroup_path[256];   /* that cgroup, "/process_api/5368..." ("" with cgroup -1) */
};
/* Reads them: from /proc and /sys/fs/cgroup, or from the trees at `proc` and `sys` (tests). */
void pd_oom_count(struct pd_oom_count *c);
void pd_oom_count_at(struct pd_oom_count *c, const char *proc, const char *sys);
/* When a counter rose from `before` to `after`, a note saying so with its figures: "the kernel's
 * OOM killer killed 1 process in this cgroup meanwhile (cgroup /a/b: limit 20.00 GiB, oom_kill 0
 * -> 1; /proc/vmstat oom_kill 3 -> 4): its processes need more memory than it gives them", or "...
 * on this host meanwhile (/proc/vmstat oom_kill 3 -> 4): ..." when there is no cgroup count to
 * compare (the root cgroup, no cgroupfs) and the host's rose; else "". A cgroup count that did not
 * rise says "" whatever the host's did: the kernel counts there every OOM kill of a process in the
 * cgroup, a host-wide one's too, so the host's rise is other containers' kills. */
const char *pd_oom_note(char *buf, size_t cap, const struct pd_oom_count *before, const struct pd_oom_count *after);

#endif

/* The OOM killer's counters (core/mem.h) read from fake /proc and /sys/fs/cgroup trees, cgroup v1
 * and v2, and the note a supervisor logs from two readings of them. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/mem.h"

static char root[64];

static void setup(void)
{
    snprintf(root, sizeof root, "/tmp/pdmoe-mem-XXXXXX");
    cr_assert_not_null(mkdtemp(root));
}

static void teardown(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    if (root[0] && system(cmd) != 0)
        cr_log_warn("could not remove %s", root);
}

TestSuite(mem, .init = setup, .fini = teardown);

/* Writes `text` to root/rel, making its directories. */
static void put(const char *rel, const char *text)
{
    char path[512], cmd[600];
    snprintf(path, sizeof path, "%s/%s", root, rel);
    snprintf(cmd, sizeof cmd, "mkdir -p \"$(dirname '%s')\"", path);
    cr_assert_eq(system(cmd), 0);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    fputs(text, f);
    fclose(f);
}

static void read_tree(struct pd_oom_count *c)
{
    char proc[128], sys[128];
    snprintf(proc, sizeof proc, "%s/proc", root);
    snprintf(sys, sizeof sys, "%s/sys", root);
    pd_oom_count_at(c, proc, sys);
}

/* cgroup v1 (this CI machine's kind, with v2's empty "0::/" beside it): the memory controller's
 * cgroup counts its kills in memory.oom_control; the limit is the least of it and those above
 * (2^63 - 4096 is v1's "none"). */
Test(mem, cgroup_v1_counts_and_limit)
{
    put("proc/vmstat", "pgfault 99\noom_kill_x 7\noom_kill 3\npgmajfault 1\n");
    put("proc/self/cgroup", "9:name=systemd:/\n4:memory:/pa/job\n1:cpu:/\n0::/\n");
    put("sys/memory/pa/job/memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n");
    put("sys/memory/pa/job/memory.limit_in_bytes", "9223372036854771712\n");
    put("sys/memory/pa/memory.limit_in_bytes", "21474836480\n");
    put("sys/memory/memory.limit_in_bytes", "9223372036854771712\n");
    struct pd_oom_count c;
    read_tree(&c);
    cr_assert_eq(c.host, 3);
    cr_assert_eq(c.cgroup, 2);
    cr_assert_eq(c.limit, 21474836480LL);
    cr_assert_str_eq(c.cgroup_path, "/pa/job");
}

/* cgroup v2: memory.events' oom_kill (not "oom", nor "oom_group_kill"); memory.max "max" is none. */
Test(mem, cgroup_v2_counts_and_limit)
{
    put("proc/vmstat", "nr_free_pages 5\noom_kill 11\n");
    put("proc/self/cgroup", "0::/k/pod\n");
    put("sys/k/pod/memory.events", "low 0\nhigh 0\nmax 9\noom 4\noom_group_kill 6\noom_kill 5\n");
    put("sys/k/pod/memory.max", "max\n");
    put("sys/k/memory.max", "1073741824\n");
    struct pd_oom_count c;
    read_tree(&c);
    cr_assert_eq(c.host, 11);
    cr_assert_eq(c.cgroup, 5);
    cr_assert_eq(c.limit, 1073741824LL);
    cr_assert_str_eq(c.cgroup_path, "/k/pod");
}

/* No counter where there is none: a kernel before 4.13 (no oom_kill in vmstat), the root cgroup
 * (the kernel never counts a kill there), no limit anywhere. */
Test(mem, missing_counters_are_minus_one)
{
    put("proc/vmstat", "pgfault 99\n");
    put("proc/self/cgroup", "4:memory:/\n0::/\n");
    put("sys/memory/memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n");
    struct pd_oom_count c;
    read_tree(&c);
    cr_assert_eq(c.host, -1);
    cr_assert_eq(c.cgroup, -1);
    cr_assert_eq(c.limit, -1);
    cr_assert_str_eq(c.cgroup_path, "");
}

/* The note: the cgroup's count when it rose, the host's beside it; the host's alone only when there
 * is no cgroup count to compare; nothing when the cgroup's did not rise (a SIGKILL from elsewhere
 * while other containers were OOM-killed) or neither did. */
Test(mem, the_note_names_what_rose_with_its_figures)
{
    struct pd_oom_count a = {.host = 3, .cgroup = 0, .limit = 21474836480LL, .cgroup_path = "/pa/job"}, b = a;
    char note[640];
    cr_assert_str_eq(pd_oom_note(note, sizeof note, &a, &b), "");
    b.host = 4;
    b.cgroup = 1;
    cr_assert_str_eq(pd_oom_note(note, sizeof note, &a, &b),
                     "the kernel's OOM killer killed 1 process in this cgroup meanwhile (cgroup /pa/job: limit "
                     "20.00 GiB, oom_kill 0 -> 1; /proc/vmstat oom_kill 3 -> 4): its processes need more memory "
                     "than it gives them");
    /* the host's count rose, the cgroup's did not: other cgroups' kills (the kernel counts a
     * host-wide OOM kill of this cgroup's process in its count too), not this child's death */
    b.cgroup = 0;
    b.host = 6;
    cr_assert_str_eq(pd_oom_note(note, sizeof note, &a, &b), "",
                     "a SIGKILL from elsewhere is blamed on other cgroups' OOM kills: %s", note);
    /* no cgroup to compare (the root cgroup, no cgroupfs): the host's count is all there is */
    struct pd_oom_count ha = {.host = 3, .cgroup = -1, .limit = -1}, hb = ha;
    hb.host = 6;
    cr_assert_str_eq(pd_oom_note(note, sizeof note, &ha, &hb),
                     "the kernel's OOM killer killed 3 processes on this host meanwhile (/proc/vmstat oom_kill 3 -> "
                     "6): its processes need more memory than it has");
    /* a cgroup moved between the two reads: not comparable, the host's count speaks */
    struct pd_oom_count moved = b;
    snprintf(moved.cgroup_path, sizeof moved.cgroup_path, "/pa/other");
    cr_assert_str_eq(pd_oom_note(note, sizeof note, &a, &moved),
                     "the kernel's OOM killer killed 3 processes on this host meanwhile (/proc/vmstat oom_kill 3 -> "
                     "6): its processes need more memory than it has");
    /* no counters at all, before or after: nothing to say */
    struct pd_oom_count none = {.host = -1, .cgroup = -1, .limit = -1};
    cr_assert_str_eq(pd_oom_note(note, sizeof note, &none, &none), "");
}

/* Cache-aware routing (src/proxy/route.h): which instance a request goes to, given what was routed
 * where before and the instances' loads. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "proxy/route.h"

static struct pd_route *make(int n, enum pd_route_policy p, size_t max_bytes)
{
    struct pd_route_opts o = {.policy = p, .cache_threshold = 0.3, .balance_abs = 64, .balance_rel = 1.5,
                              .max_bytes = max_bytes};
    struct pd_route *r;
    pd_err e = {0};
    cr_assert_eq(pd_route_create(n, &o, &r, &e), 0, "%s", e.msg);
    return r;
}

/* A prompt of `n` bytes: a shared head of `shared` bytes then pseudo-random text seeded by `tag`. */
static struct pd_route_key key(const char *head, size_t shared, int tag, size_t n)
{
    static char buf[1 << 16];
    cr_assert(n <= sizeof buf);
    uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(tag + 1);
    for (size_t i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        buf[i] = i < shared ? head[i % strlen(head)] : (char)('a' + (x >> 33) % 26);
    }
    struct pd_route_key k;
    cr_assert_eq(pd_route_key_make(buf, n, &k), 0);
    return k;
}

static int route(struct pd_route *r, struct pd_route_key *k, const int *load, enum pd_route_why *why)
{
    size_t m;
    int i = pd_route_pick(r, k, load, (1u << 3) - 1, why, &m);
    cr_assert_eq(pd_route_insert(r, i, k), 0);
    return i;
}

TestSuite(route);

Test(route, a_shared_prefix_goes_back_to_the_instance_that_has_it)
{
    struct pd_route *r = make(3, PD_ROUTE_CACHE_AWARE, 0);
    int load[3] = {0, 0, 0};
    enum pd_route_why why;
    /* four different system prompts land on the instances with the most room, spreading out */
    int home[4];
    char sys[4][48];
    for (int s = 0; s < 4; s++) {
        snprintf(sys[s], sizeof sys[s], "system prompt number %d. ", s);
        struct pd_route_key k = key(sys[s], 800, s, 1000);
        home[s] = route(r, &k, load, &why);
        cr_expect_eq(why, PD_ROUTE_BY_ROOM, "prompt %d is new: chosen for room, not %s", s, pd_route_why_name(why));
        load[home[s]]++;
        pd_route_key_free(&k);
    }
    cr_expect_neq(home[0], home[1]);
    cr_expect_neq(home[1], home[2]);
    cr_expect_neq(home[0], home[2]);
    /* later users of each system prompt go where it is, though that instance is busier (within
     * the balance thresholds) */
    for (int rep = 0; rep < 5; rep++)
        for (int s = 0; s < 4; s++) {
            struct pd_route_key k = key(sys[s], 800, 100 + rep * 4 + s, 1200);
            size_t m;
            int i = pd_route_pick(r, &k, load, 7, &why, &m);
            cr_expect_eq(i, home[s], "system prompt %d went to %d, its prefix is on %d", s, i, home[s]);
            cr_expect_eq(why, PD_ROUTE_BY_PREFIX);
            cr_expect_eq(m, 800 / PD_ROUTE_CHUNK, "matched %zu chunks, the shared 800 bytes are %d", m,
                         800 / PD_ROUTE_CHUNK);
            cr_assert_eq(pd_route_insert(r, i, &k), 0);
            load[i]++;
            pd_route_key_free(&k);
        }
    pd_route_free(r);
}

Test(route, a_multi_turn_chat_follows_its_own_history)
{
    struct pd_route *r = make(2, PD_ROUTE_CACHE_AWARE, 0);
    int load[2] = {0, 0};
    enum pd_route_why why;
    /* turn t resends turns 1..t-1 then its own text: serialised messages grow by appending */
    char chat[8192] = "[{\"role\":\"user\",\"content\":\"summarise this: ";
    for (int i = 0; i < 20; i++)
        strcat(chat, "a paragraph of the document, ");
    strcat(chat, "\"}");
    struct pd_route_key k;
    cr_assert_eq(pd_route_key_make(chat, strlen(chat), &k), 0);   /* the client closes the array: "]" */
    size_t m;
    int first = pd_route_pick(r, &k, load, 3, &why, &m);
    cr_assert_eq(pd_route_insert(r, first, &k), 0);
    pd_route_key_free(&k);
    /* an unrelated chat takes the other instance (more room) */
    const char *other = "[{\"role\":\"user\",\"content\":\"an unrelated question about the weather\"}]";
    cr_assert_eq(pd_route_key_make(other, strlen(other), &k), 0);
    cr_expect_eq(route(r, &k, load, &why), 1 - first);
    pd_route_key_free(&k);
    for (int t = 2; t <= 6; t++) {
        size_t n = strlen(chat);
        snprintf(chat + n, sizeof chat - n, ",{\"role\":\"assistant\",\"content\":\"answer %d with some words\"},"
                 "{\"role\":\"user\",\"content\":\"question %d, a little longer than the last\"}", t, t);
        cr_assert_eq(pd_route_key_make(chat, strlen(chat), &k), 0);
        cr_expect_eq(route(r, &k, load, &why), first, "turn %d left its history's instance", t);
        cr_expect_eq(why, PD_ROUTE_BY_PREFIX);
        pd_route_key_free(&k);
    }
    pd_route_free(r);
}

Test(route, imbalanced_loads_go_to_the_least_loaded)
{
    struct pd_route *r = make(2, PD_ROUTE_CACHE_AWARE, 0);
    enum pd_route_why why;
    struct pd_route_key k = key("shared head ", 1000, 0, 1000);
    int load[2] = {0, 0};
    int home = route(r, &k, load, &why);
    /* within the thresholds: the prefix wins */
    load[home] = 64;
    load[1 - home] = 1;
    size_t m;
    cr_expect_eq(pd_route_pick(r, &k, load, 3, &why, &m), home);
    cr_expect_eq(why, PD_ROUTE_BY_PREFIX);
    /* more than 64 apart and more than 1.5 x: balance */
    load[home] = 66;
    cr_expect_eq(pd_route_pick(r, &k, load, 3, &why, &m), 1 - home);
    cr_expect_eq(why, PD_ROUTE_BY_BALANCE);
    cr_expect_eq(m, 0, "the other instance has none of the prefix");
    /* 65 apart but not 1.5 x (300 vs 235): the prefix still wins */
    load[home] = 300;
    load[1 - home] = 235;
    cr_expect_eq(pd_route_pick(r, &k, load, 3, &why, &m), home);
    /* the prefix's instance not eligible (tried already): the other */
    cr_expect_eq(pd_route_pick(r, &k, load, 1u << (1 - home), &why, &m), 1 - home);
    pd_route_key_free(&k);
    pd_route_free(r);
}

Test(route, least_loaded_ignores_the_cache)
{
    struct pd_route *r = make(2, PD_ROUTE_LEAST_LOADED, 0);
    enum pd_route_why why;
    struct pd_route_key k = key("shared head ", 1000, 0, 1000);
    int load[2] = {1, 0};
    cr_expect_eq(route(r, &k, load, &why), 1);
    load[1] = 2;
    cr_expect_eq(route(r, &k, load, &why), 0);
    cr_expect_eq(why, PD_ROUTE_BY_LOAD);
    pd_route_key_free(&k);
    pd_route_free(r);
}

Test(route, an_ejected_instance_is_forgotten)
{
    struct pd_route *r = make(2, PD_ROUTE_CACHE_AWARE, 0);
    enum pd_route_why why;
    struct pd_route_key k = key("shared head ", 1000, 0, 1000);
    int load[2] = {0, 0};
    int home = route(r, &k, load, &why);
    cr_expect_eq(pd_route_match(r, home, &k), k.n);
    pd_route_forget(r, home);
    cr_expect_eq(pd_route_size(r, home), 0);
    cr_expect_eq(pd_route_match(r, home, &k), 0);
    pd_route_key_free(&k);
    pd_route_free(r);
}

Test(route, the_index_keeps_the_most_recent_prompts_within_its_limit)
{
    /* 64 chunks of room per instance: each 512-byte prompt is 32 chunks */
    struct pd_route *r = make(1, PD_ROUTE_CACHE_AWARE, 64 * PD_ROUTE_CHUNK);
    struct pd_route_key k[6];
    for (int i = 0; i < 6; i++) {
        k[i] = key("", 0, i, 512);
        cr_assert_eq(pd_route_insert(r, 0, &k[i]), 0);
        cr_assert_leq(pd_route_size(r, 0), 64, "after prompt %d the index holds %zu chunks", i, pd_route_size(r, 0));
    }
    /* the last prompt is whole; the first ones are gone */
    cr_expect_eq(pd_route_match(r, 0, &k[5]), 32);
    cr_expect_eq(pd_route_match(r, 0, &k[0]), 0);
    cr_expect_eq(pd_route_match(r, 0, &k[1]), 0);
    /* using an old prompt again makes it recent: it outlives a newer one */
    cr_assert_eq(pd_route_insert(r, 0, &k[4]), 0);
    struct pd_route_key extra = key("", 0, 99, 512);
    cr_assert_eq(pd_route_insert(r, 0, &extra), 0);
    cr_expect_eq(pd_route_match(r, 0, &k[4]), 32, "the re-used prompt was evicted");
    cr_expect_eq(pd_route_match(r, 0, &k[5]), 0, "the older prompt stayed");
    for (int i = 0; i < 6; i++)
        pd_route_key_free(&k[i]);
    pd_route_key_free(&extra);
    pd_route_free(r);
}

Test(route, bad_thresholds_are_refused_by_flag)
{
    struct pd_route_opts o = {.cache_threshold = 1.5, .balance_rel = 1.5};
    struct pd_route *r;
    pd_err e = {0};
    cr_expect_neq(pd_route_create(2, &o, &r, &e), 0);
    cr_expect(strstr(e.msg, "--cache-threshold"), "%s", e.msg);
    o.cache_threshold = 0.3;
    o.balance_rel = 0.5;
    cr_expect_neq(pd_route_create(2, &o, &r, &e), 0);
    cr_expect(strstr(e.msg, "--balance-rel-threshold"), "%s", e.msg);
}

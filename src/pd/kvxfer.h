/* KV transfer engine: moves a request's KV blocks from a prefill rank (producer) to a decode rank
 * (consumer) over UCX, decode pulling (DESIGN.md, "PD protocol").
 *
 * One engine per process (per rank of an instance): a UCP context and worker (RMA + active
 * messages + wakeup, so an idle thread sleeps on the worker's event fd instead of spinning), one
 * registered region (the KV pool, base + length) and a KV listener on host:port (127.0.0.1 by
 * default; a plain TCP socket, kvx_boot.c). The same engine can produce and consume.
 *
 * Producer: pd_kvx_offer() puts a request's KV (byte runs of the region, in sequence order) under
 *   a LEASE; the lease is released, through the owner's callback, exactly once: on DONE, on ABORT,
 *   when the lease expires (lease_ms after the offer or after the last GET_META), when its owner
 *   revokes it unclaimed (pd_kvx_revoke), or on destroy.
 * Consumer: pd_kvx_pull() starts a transfer: GET_META -> META (the producer's base address,
 *   packed rkey and the request's runs) -> the data, cut into pieces contiguous on both sides
 *   (adjacent runs merged) -> DONE -> ACK. The data moves one of two ways:
 *   - gets: one ucp_get_nbx per piece, where the producer's region is mapped into this process
 *     (ucp_rkey_ptr succeeds: shared memory on one host, the region allocated by the engine), so
 *     UCX copies it without the producer;
 *   - push: anywhere else, READ -> the producer sends each piece as a DATA message, which the
 *     consumer copies into place. UCX 1.13 emulates a get over TCP with messages the producer's
 *     worker answers, and purging an answer still queued (the consumer died or stopped reading, or
 *     the producer stopped) dereferences an uninitialised field: a prefill instance crashed
 *     (SIGSEGV in ucp_request_memory_dereg) when a decode instance died mid-pull. Pushed
 *     messages are ordinary sends, which UCX completes with an error instead.
 *   A transfer never hangs: a peer error, a refused connection, an unknown request, no META 5 s
 *   after its GET_META, or the timeout (timeout_ms from the pull) ends it FAILED with a reason
 *   naming the peer and request.
 *
 * Transports: a consumer connects to the producer's KV listener (host:port) over TCP and reads a
 *   HELLO, the producer's UCP worker address (format in kvx_boot.c); the listener reads nothing
 *   from any connection and closes each after its HELLO, so stray bytes on the port are never
 *   parsed. Every message and the data then go over an endpoint made from that address, on which
 *   UCX picks shared memory on one host, RDMA or TCP between hosts (a UCX_TLS naming neither tcp
 *   nor all gets tcp added). The consumer keeps the endpoint for later pulls; a pull that reuses
 *   one idle for 100 ms reads a HELLO again meanwhile, and another address (the producer
 *   restarted on its port) or none moves its transfers to a new connection. A HELLO that has not
 *   come within 5 s, or carries an address of another UCX address version (UCX would abort the
 *   process on it), fails its link and transfers. Active messages of an id that is not the
 *   protocol's are dropped (and counted: msgs_dropped). Every endpoint
 *   reports a dead peer (UCP_ERR_HANDLING_MODE_PEER), found by UCX's keepalive, a round every
 *   500 ms (UCX_KEEPALIVE_INTERVAL set by the user wins; UCX's own 20 s left a pull to a killed
 *   producer waiting that long); UCX 1.13 offers its shared-memory
 *   transports to such endpoints only with MM_ERROR_HANDLING=y, which the engine sets in its own
 *   UCX configuration.
 *
 * Keys: a lease is found by a key {id, hash}. The id is 128 bits from getrandom(2), the secret a
 *   puller must present (a server's request numbers are sequential: anyone could guess them). The
 *   hash is the consumer's hash of the prompt's token ids (pd_kvx_hash_tokens): it binds the lease
 *   to its content, so that whoever holds an id cannot attach the KV to another prompt. The hash
 *   is no secret and need not resist a crafted collision: it is never shown to clients, and to
 *   craft one for a prompt you must know that prompt, whose KV you can then compute yourself.
 *   A lease is handed to one pull: the first GET_META that presents its key claims it; any other
 *   (a second pull, a wrong hash) is refused and leaves the lease with its claimant; once DONE
 *   the key is dead.
 *
 * Wire protocol: UCX active messages, ids below, payload in the AM data (no AM header), all
 * integers little-endian:
 *   GET_META  c->p  u32 version=3, u32 0, u64 tag, u8 id[16], u64 hash                  (40 B)
 *   META      p->c  u32 version, i32 status, u64 tag, u64 base,
 *                   u32 rkey_len, u32 n_runs, u32 addr_len, u32 kv_dtype,
 *                   addr_len bytes of the producer's UCP worker address,
 *                   rkey_len bytes of packed rkey,
 *                   n_runs x { u64 offset, u64 length }         (40 B + addr + rkey + 16 n)
 *   READ      c->p  u32 version, u32 n_pieces, u64 tag, u8 id[16], u64 hash,
 *                   n_pieces x { u64 producer offset, u64 length }            (40 B + 16 n)
 *                   push the lease's data, cut so: the pieces, in order, must tile the lease's
 *                   runs exactly, each at most 1 MiB (else ACK of READ with status malformed)
 *   DATA      p->c  AM header u64 tag, u64 piece index; data: the piece's bytes (eager)
 *   DONE      c->p  as GET_META: the data is in place, release the lease
 *   ABORT     c->p  as GET_META: the consumer gives up, release the lease
 *   ACK       p->c  u32 version, i32 status, u64 tag, u32 acked id, u32 0              (24 B)
 * `tag` is the consumer's transfer id, echoed so replies find their transfer. Status:
 * 0 ok, 1 unknown id (never offered, already pulled or released, expired), 2 malformed message,
 * 3 refused (the id is held but the hash differs, or another pull claimed the lease). READ, DONE
 * and ABORT act only for the pull that claimed the lease (same key and tag); a READ is answered
 * once (by DATA; by an ACK of READ only when refused). A DATA that is not for a transfer
 * receiving, names no piece of it, repeats one or has another length is dropped (msgs_dropped).
 * kv_dtype is the producer's KV cache format (opts.kv_dtype: 0 bf16, 1 fp8): a consumer whose
 * own differs fails the pull naming both, before any byte moves (the runs would differ too).
 *
 * Threads: every function may be called from any thread; the engine serialises them with its
 * own lock. Release callbacks run without that lock held, on the thread that progressed the
 * engine (so they may call pd_kvx_offer). */
#ifndef PD_PD_KVXFER_H
#define PD_PD_KVXFER_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"

/* Ordered so that the minimum over the ranks of an instance is the instance's state. */
enum pd_kvx_state {
    PD_KVX_FAILED = 0,
    PD_KVX_BOOTSTRAPPING = 1,  /* connecting; GET_META not yet delivered */
    PD_KVX_WAITING = 2,        /* GET_META sent, waiting for META */
    PD_KVX_TRANSFERRING = 3,   /* gets or pushed pieces in flight, or DONE sent and waiting for ACK */
    PD_KVX_DONE = 4,           /* data in place and the producer acknowledged DONE */
};

enum pd_kvx_am_id {
    PD_KVX_AM_GET_META = 1,
    PD_KVX_AM_META = 2,
    PD_KVX_AM_DONE = 3,
    PD_KVX_AM_ABORT = 4,
    PD_KVX_AM_ACK = 5,
    PD_KVX_AM_READ = 6,
    PD_KVX_AM_DATA = 7,
};

enum pd_kvx_status {
    PD_KVX_ST_OK = 0,
    PD_KVX_ST_UNKNOWN = 1,
    PD_KVX_ST_MALFORMED = 2,
    PD_KVX_ST_REFUSED = 3,
};

/* Why a lease was released (argument of the release callback). */
enum pd_kvx_release {
    PD_KVX_REL_DONE = 0,
    PD_KVX_REL_ABORT = 1,
    PD_KVX_REL_EXPIRED = 2,
    PD_KVX_REL_DESTROY = 3,
    PD_KVX_REL_REVOKED = 4,   /* pd_kvx_revoke: given up by its owner before its time */
    PD_KVX_REL_N
};

/* A byte run of an engine's registered region. */
struct pd_kvx_run {
    uint64_t off, len;
};

struct pd_kvx_opts {
    const char *listen_host;   /* NULL: "127.0.0.1". Also where the process is reachable when it
                                * does not listen: UCX's network transports (whose TCP one opens
                                * a listening socket per interface) are kept to the interface
                                * carrying this address, unless it is a wildcard or the user set
                                * UCX_NET_DEVICES (to add an RDMA device, say) */
    int listen_port;           /* 0: ephemeral (see pd_kvx_port), -1: do not listen */
    void *region;              /* the KV pool; registered with ucp_mem_map. NULL: the engine
                                * allocates region_len bytes itself with UCX (ucp_mem_map
                                * ALLOCATE, as ucx_perftest does): shared memory that a peer on
                                * the same host maps and reads with one copy (gets), where
                                * ordinary memory is pushed by the producer (two copies, the
                                * producer's CPU in the loop); see pd_kvx_region() */
    size_t region_len;
    int lease_ms;              /* producer lease; 0: 30000 */
    int timeout_ms;            /* consumer transfer timeout; 0: 30000 */
    int kv_dtype;              /* the region's KV format (enum pd_kv_dtype: 0 bf16, 1 fp8), sent
                                * in META and checked by the consumer */
};

struct pd_kvx_stats {
    uint64_t gets;             /* ucp_get_nbx calls issued (after merging runs) */
    uint64_t get_bytes;
    uint64_t pieces_pushed;    /* DATA messages sent (producer) */
    uint64_t pieces_landed;    /* DATA messages copied into place (consumer) */
    uint64_t push_bytes;       /* their bytes (consumer) */
    uint64_t metas_served;     /* META replies sent (producer) */
    uint64_t released[PD_KVX_REL_N];      /* leases released, by enum pd_kvx_release */
    uint64_t pulls_done, pulls_failed;
    uint64_t rkeys_unpacked;   /* producers' rkeys unpacked (consumer): once per connection */
    uint64_t msgs_dropped;     /* active messages of an id that is not the protocol's, and DATA
                                * that is not for a transfer receiving it */
    uint64_t resolves;         /* producer addresses resolved (consumer): once per new connection */
};

/* A lease's key (see "Keys" above). */
struct pd_kvx_key {
    uint8_t id[16];            /* 128 random bits */
    uint64_t hash;             /* pd_kvx_hash_tokens of the prompt */
};

#define PD_KVX_ID_HEX 33       /* an id as 32 lowercase hex digits and a NUL */

/* A fresh key for content `hash`: the id from getrandom(2). */
int pd_kvx_key_new(struct pd_kvx_key *k, uint64_t hash, pd_err *e);
/* 64-bit FNV-1a of the ids' little-endian bytes. */
uint64_t pd_kvx_hash_tokens(const int32_t *ids, int n);
void pd_kvx_id_format(const struct pd_kvx_key *k, char out[PD_KVX_ID_HEX]);
/* Sets k's id from exactly 32 hex digits (either case); PD_EINVAL otherwise, k untouched. */
int pd_kvx_id_parse(const char *s, struct pd_kvx_key *k);

/* `owner_id` is the offerer's own number for the lease (a server's request id), given back here;
 * it never goes on the wire. */
typedef void (*pd_kvx_release_fn)(void *arg, uint64_t owner_id, enum pd_kvx_release why);

struct pd_kvx;
struct pd_kvx_xfer;

int pd_kvx_create(const struct pd_kvx_opts *o, struct pd_kvx **out, pd_err *e);
/* Fails unfinished transfers (telling their producers, within a bounded drain), closes every
 * endpoint, releases every lease (PD_KVX_REL_DESTROY: the callbacks run on the caller's thread,
 * so it must not hold a lock they take), frees every transfer handle and unmaps the region. */
void pd_kvx_destroy(struct pd_kvx *x);
/* The registered region (the one the engine allocated when opts.region was NULL); it lives
 * until pd_kvx_destroy. */
void *pd_kvx_region(const struct pd_kvx *x);
/* The port the listener is bound to (the ephemeral one when opts.listen_port was 0); -1 if none. */
int pd_kvx_port(const struct pd_kvx *x);

/* Producer: puts a request's KV (runs of the region, in sequence order) under a lease found by
 * `key` (an id already under a lease is refused); `release` (may be NULL) is called exactly once,
 * with owner_id, when the lease ends. */
int pd_kvx_offer(struct pd_kvx *x, const struct pd_kvx_key *key, uint64_t owner_id,
                 const struct pd_kvx_run *runs, int n_runs, pd_kvx_release_fn release, void *arg,
                 pd_err *e);
/* Producer: ends the lease of `key` before its time if no pull has claimed it (the owner needs its
 * blocks back): released as PD_KVX_REL_REVOKED, its callback run by the next progress, and to a
 * pull that comes later it is as expired. 1 if so, 0 if there is no such lease or a pull holds it. */
int pd_kvx_revoke(struct pd_kvx *x, const struct pd_kvx_key *key);

/* Consumer: starts pulling the lease `key` from the producer at host:port into `dst` (runs of
 * this engine's region, in sequence order; their total must equal the producer's). Failures of
 * the peer are reported by the transfer's state, not here; here only bad arguments. */
int pd_kvx_pull(struct pd_kvx *x, const char *host, int port, const struct pd_kvx_key *key,
                const struct pd_kvx_run *dst, int n_dst, struct pd_kvx_xfer **t, pd_err *e);

enum pd_kvx_state pd_kvx_state(struct pd_kvx *x, const struct pd_kvx_xfer *t);
/* 0 when DONE; when FAILED a negative PD_E* code and the reason in e; PD_EINVAL while running. */
int pd_kvx_result(struct pd_kvx *x, const struct pd_kvx_xfer *t, pd_err *e);
/* 1 when t FAILED because the producer refused its key (status unknown or refused): the pull
 * was not entitled to that KV, which a server reports to its client rather than recomputing. */
int pd_kvx_refused(struct pd_kvx *x, const struct pd_kvx_xfer *t);
/* The pieces this transfer moved (runs merged): its gets, or the DATA the producer pushed; for
 * tests and stats. */
uint64_t pd_kvx_xfer_pieces(struct pd_kvx *x, const struct pd_kvx_xfer *t);

/* Non-blocking: progresses the worker, handles messages, expires leases and timed-out transfers.
 * Returns the number of events handled (0: nothing happened). */
int pd_kvx_progress(struct pd_kvx *x);
/* Blocks (asleep on the worker's event fd) until t is DONE or FAILED or timeout_ms passes
 * (timeout_ms < 0: no limit besides the transfer's own timeout); returns t's state. With t NULL
 * it handles events until at least one happened or timeout_ms passed (a producer's serve loop)
 * and returns PD_KVX_DONE. */
enum pd_kvx_state pd_kvx_wait(struct pd_kvx *x, struct pd_kvx_xfer *t, int timeout_ms);
/* Gives up a transfer: it ends FAILED ("aborted") once no get is in flight and the producer is
 * sent ABORT so it frees the blocks now rather than at lease expiry. */
void pd_kvx_abort(struct pd_kvx *x, struct pd_kvx_xfer *t);
/* Frees a transfer handle; an unfinished transfer is aborted first and freed when it ends. */
void pd_kvx_xfer_free(struct pd_kvx *x, struct pd_kvx_xfer *t);

void pd_kvx_stats(struct pd_kvx *x, struct pd_kvx_stats *s);

/* The overall state of a transfer split over n ranks: the minimum (n = 0: PD_KVX_DONE). */
enum pd_kvx_state pd_kvx_state_min(const enum pd_kvx_state *s, int n);
const char *pd_kvx_state_name(enum pd_kvx_state s);
const char *pd_kvx_release_name(enum pd_kvx_release r);

#endif

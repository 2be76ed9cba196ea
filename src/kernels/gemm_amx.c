/* AMX-INT8 GEMM path (Intel Sapphire Rapids and later): TDPBSSD multiplies a 16 x 64-byte tile of
 * signed bytes by a 16 x 64-byte tile of signed bytes laid out four bytes per column ("VNNI
 * layout") into a 16 x 16 tile of int32 sums, 16,384 multiply-adds per instruction.
 *
 *   C[m][n] += sum_{g < 16} sum_{j < 4} A[m][4g + j] * B[g][4n + j]
 *
 * Here A is 16 weight rows (16 output channels) x 64 bytes of the reduction (a "step"), and B holds
 * 16 tokens: B[g][4n + j] = a[token n][64 kb + 4g + j]. The activations are therefore packed once
 * per product (pd_gemm_amx_pack, run by gemm.c over the pool before the row tasks) into 1 KiB tiles
 * [g][n][j], zero-padded to whole tiles, laid out as pd_gemm_amx_tile_offset says; the weights are
 * copied into tiles per task and block of the reduction, or read in place (gemm_amx_body.h).
 * Integer sums are exact, and every output goes through the operations of gemm.c's one epilogue,
 * so the results equal every other path's bit for bit.
 *
 * Two builds of the same body (gemm_amx_body.h):
 *   amx      the tile instructions, where the CPU has AMX-TILE and AMX-INT8 and Linux grants the
 *            process the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
 *   amx-emu  the same loops on a model of the tiles in C (a few hundred times slower), selectable
 *            explicitly (PDMOE_KERNEL=amx-emu, tests) and never chosen by default: it lets the
 *            blocking, packing and tails be tested on CPUs without AMX.
 * Fewer than PD_GEMM_AMX_MIN_TOKENS tokens (decode) are a memory stream the VNNI kernel already
 * runs at the bandwidth limit, and a tile product would use 1/16 of its rows: those go to the
 * AVX-512 kernel (amx) or the reference (amx-emu), and gemm.c packs nothing for them. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernels/gemm_impl.h"

/* The 64-byte tile configuration of palette 1: every tile used is 16 rows of 64 bytes. */
struct amx_cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
_Static_assert(sizeof(struct amx_cfg) == 64, "the tile configuration is 64 bytes");

static void amx_cfg_full(struct amx_cfg *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg->colsb[t] = 64;
        cfg->rows[t] = 16;
    }
}

/* The one pass over weights read in place (few tokens) requests the next block of 16 rows by
 * software when rows are shorter than this many bytes. Routed experts of 256 experts x 6 tokens
 * per token, 512 tokens, weights from memory (768 MB rotating), 1 thread, on a Xeon with AMX:
 * rows of 256 bytes 6.9 -> 8.4 GB/s, 512 bytes 7.5 -> 8.8, 1,024 bytes 8.7 -> 9.9; at 2,048 bytes
 * 10.0 either way, and at 4,096 (64 experts of 2048 x 4096) 10.6 -> 7.8: there each row is a page
 * that the hardware streams by itself, and the requests only compete with it. */
#define AMX_PREFETCH_ROWS_MAX_IN 2048
/* tmm t = the weight tile of rows [o, o + 16) x reduction step kb, read in place */
#define AMX_WLOAD(t, job, o, o1, kb, pad)                                                  \
    do {                                                                                  \
        int wl_stride_;                                                                   \
        const int8_t *wl_p_ = amx_weight_tile((job), (o), (o1), (kb), (pad), &wl_stride_); \
        AMX_LOAD(t, wl_p_, wl_stride_);                                                   \
    } while (0)

/* The C tiles of a pair of row blocks and a pair of token blocks, stored `ld` int32 apart by row
 * block from p0 (16 x 16 each, the token blocks' side by side): NULL for a block a short pair lacks. */
static inline void amx_c_ptrs(int32_t *p0, int64_t ld, int two_tb, int two_rb, int32_t *p[4])
{
    p[0] = p0;
    p[1] = two_tb ? p0 + 256 : NULL;
    p[2] = two_rb ? p0 + ld : NULL;
    p[3] = two_tb && two_rb ? p0 + ld + 256 : NULL;
}
/* OP (AMX_LOAD or AMX_STORE) on tmm0..3 and the C tiles at p[0..3] that exist */
#define AMX_C_TILES(OP, p)      \
    do {                        \
        OP(0, (p)[0], 64);      \
        if ((p)[1])             \
            OP(1, (p)[1], 64);  \
        if ((p)[2])             \
            OP(2, (p)[2], 64);  \
        if ((p)[3])             \
            OP(3, (p)[3], 64);  \
    } while (0)

/* Each thread's blocks: the task's weight tiles of one reduction block, and its C tiles between
 * blocks. Kept per thread (a pthread key frees them when the thread ends) and grown on demand, so
 * that a product allocates nothing once its threads have run one of its size. */
struct amx_scratch {
    int8_t *w;
    int32_t *c;
    size_t w_bytes, c_bytes;
};

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_key_ok;

static void scratch_free(void *p)
{
    struct amx_scratch *sc = p;
    free(sc->w);
    free(sc->c);
    free(sc);
}

static void scratch_key_init(void)
{
    scratch_key_ok = pthread_key_create(&scratch_key, scratch_free) == 0;
}

/* Whole 64-byte lines: aligned_alloc wants a multiple of the alignment. */
static int scratch_grow(void **p, size_t *have, size_t want)
{
    if (want <= *have)
        return 0;
    void *q = aligned_alloc(64, (want + 63) & ~(size_t)63);
    if (!q)
        return -1;
    free(*p);
    *p = q;
    *have = want;
    return 0;
}

/* This thread's scratch with at least w_bytes of weight tiles and c_bytes of C tiles, or NULL when
 * memory is short (the caller then computes its rows another way). */
static struct amx_scratch *amx_scratch(size_t w_bytes, size_t c_bytes)
{
    pthread_once(&scratch_once, scratch_key_init);
    if (!scratch_key_ok)
        return NULL;
    struct amx_scratch *sc = pthread_getspecific(scratch_key);
    if (!sc) {
        if (!(sc = calloc(1, sizeof *sc)))
            return NULL;
        if (pthread_setspecific(scratch_key, sc) != 0) {
            free(sc);
            return NULL;
        }
    }
    if (scratch_grow((void **)&sc->w, &sc->w_bytes, w_bytes) < 0 ||
        scratch_grow((void **)&sc->c, &sc->c_bytes, c_bytes) < 0)
        return NULL;
    return sc;
}

/* Prefetch lines [l0, l1) of the weight rows from o0 x steps [k0, k0 + nk), line l being row o0 + l / nk,
 * step k0 + l % nk, into L2 (the caller keeps l1 within the matrix). */
static inline void amx_prefetch_w(const pd_gemm_job *job, int o0, int k0, int nk, int64_t l0, int64_t l1)
{
    if (l0 >= l1)
        return;
    int k = (int)(l0 % nk);   /* one division per call (one per line cost 10% of the GEMM's time) */
    const int8_t *p = job->w + (o0 + l0 / nk) * job->in + 64 * k0;
    for (int64_t l = l0; l < l1; l++) {
        __builtin_prefetch(p + 64 * k, 0, 2);
        if (++k == nk) {
            k = 0;
            p += job->in;
        }
    }
}

/* Weight rows [o, o + 16) (fewer at the matrix's end, o1) x bytes [64 kb, 64 kb + 64) of the
 * reduction as a 16 x 64 tile: a pointer into the matrix (rows `in` apart) when all of it lies
 * inside, else a copy in `pad` (rows 64 apart), zero past the matrix's last row or byte (zeros add
 * nothing; the packed activations are zero there too). *stride is set to match. */
static const int8_t *amx_weight_tile(const pd_gemm_job *job, int o, int o1, int kb, int8_t *pad, int *stride)
{
    const int in = job->in, k0 = 64 * kb, nk = in - k0 < 64 ? in - k0 : 64, nr = o1 - o < 16 ? o1 - o : 16;
    const int8_t *w = job->w + (int64_t)o * in + k0;
    if (nr == 16 && nk == 64) {
        *stride = in;
        return w;
    }
    memset(pad, 0, 16 * 64);
    for (int r = 0; r < nr; r++)
        memcpy(pad + 64 * r, w + (int64_t)r * in, (size_t)nk);
    *stride = 64;
    return pad;
}

/* acc[u][r] (32 per token) = the sum of weight row r and token u, from the two C tiles of one token
 * block: lo = rows 0..15, hi = rows 16..31, each [row][token]. */
static void amx_transpose(const int32_t *lo, const int32_t *hi, int nu, int nr0, int nr1, int32_t *acc)
{
    for (int u = 0; u < nu; u++) {
        for (int r = 0; r < nr0; r++)
            acc[32 * u + r] = lo[16 * r + u];
        for (int r = 0; r < nr1; r++)
            acc[32 * u + 16 + r] = hi[16 * r + u];
    }
}

/* Tile (tb, kb) of the packed activations with AVX-512 when it is whole (16 tokens, 64 bytes) and the
 * CPU has it: 1 if done, else 0 (the loops below do it). */
static int pack_tile_fast(const pd_gemm_job *job, int tb, int kb, int8_t *tile);

void pd_gemm_amx_pack(const pd_gemm_job *job, int tb, int8_t *dst)
{
    const int in = job->in, nkb = (in + 63) / 64;
    for (int kb = 0; kb < nkb; kb++) {
        int8_t *t = dst + pd_gemm_amx_tile_offset(job->n, in, tb, kb);
        if (pack_tile_fast(job, tb, kb, t))
            continue;
        memset(t, 0, 1024);
        /* 4-byte groups: group 16 kb + g of token 16 tb + n's row goes to row g, column n */
        const int k0 = 64 * kb;
        for (int n = 0; n < 16 && tb * 16 + n < job->n; n++) {
            const int8_t *a = pd_gemm_job_arow(job, tb * 16 + n);
            for (int g = 0; g < 16 && k0 + 4 * g < in; g++)
                memcpy(t + 64 * g + 4 * n, a + k0 + 4 * g, (size_t)(in - k0 - 4 * g < 4 ? in - k0 - 4 * g : 4));
        }
    }
}

/* ---- the model of the tiles (amx-emu) ---- */

#define AMX_FN static void rows_emu(const pd_gemm_job *job, int o0, int o1)
#define AMX_STATE _Alignas(64) int32_t tmm[8][16 * 16]; /* bytes read through int8_t pointers */
#define AMX_CONFIG(cfg) (void)(cfg)
#define AMX_RELEASE() ((void)0)
#define AMX_ZERO(t) memset(tmm[t], 0, sizeof tmm[t])
#define AMX_LOAD(t, p, stride) emu_load((int8_t *)tmm[t], (const int8_t *)(p), (stride))
#define AMX_FALLBACK(job, o0, o1) pd_gemm_rows_ref((job), (o0), (o1))
#define AMX_PREFETCH_W(job, o0, k0, nk, l0, l1) ((void)(l0), (void)(l1))
#define AMX_PREFETCH_ROWS(p, b0, b1) ((void)(p), (void)(b0), (void)(b1))
#define AMX_EPILOGUE(job, lo, hi, t0, nu, ob, nr0, nr1)                    \
    do {                                                                   \
        int32_t acc_[16 * 32];                                             \
        amx_transpose((lo), (hi), (nu), (nr0), (nr1), acc_);               \
        pd_gemm_store((job), (t0), (nu), (ob), (nr0) + (nr1), acc_, 32);   \
    } while (0)
#define AMX_DP(c, a, b) pd_gemm_amx_emu_dpbssd(tmm[c], (const int8_t *)tmm[a], (const int8_t *)tmm[b])
#define AMX_STORE(t, p, stride) emu_store((int32_t *)(void *)(p), tmm[t], (stride))

static void emu_load(int8_t *t, const int8_t *p, int stride)
{
    for (int r = 0; r < 16; r++)
        memcpy(t + 64 * r, p + (int64_t)r * stride, 64);
}

static void emu_store(int32_t *p, const int32_t *t, int stride)
{
    for (int r = 0; r < 16; r++)
        memcpy((char *)p + (int64_t)r * stride, t + 16 * r, 64);
}

/* TDPBSSD as the architecture manual defines it (the equation at the top of the file). */
void pd_gemm_amx_emu_dpbssd(int32_t *c, const int8_t *a, const int8_t *b)
{
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            int32_t s = c[16 * m + n];
            for (int g = 0; g < 16; g++)
                for (int j = 0; j < 4; j++)
                    s += (int32_t)a[64 * m + 4 * g + j] * (int32_t)b[64 * g + 4 * n + j];
            c[16 * m + n] = s;
        }
}

#include "kernels/gemm_amx_body.h"

#undef AMX_FN
#undef AMX_STATE
#undef AMX_CONFIG
#undef AMX_RELEASE
#undef AMX_ZERO
#undef AMX_LOAD
#undef AMX_DP
#undef AMX_STORE
#undef AMX_FALLBACK
#undef AMX_EPILOGUE
#undef AMX_PREFETCH_W
#undef AMX_PREFETCH_ROWS

void pd_gemm_rows_amx_emu(const pd_gemm_job *job, int o0, int o1)
{
    if (job->n < PD_GEMM_AMX_MIN_TOKENS)
        pd_gemm_rows_ref(job, o0, o1);
    else
        rows_emu(job, o0, o1);
}

/* ---- the hardware ---- */

#if defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>

#include "kernels/gemm_store_avx512.h"

/* A 16 x 16 tile of int32 sums [row][token] as 16 token rows, in three rounds of shuffles (32-bit,
 * 64-bit, 128-bit lanes twice): amx_transpose's loops in about eight times fewer instructions. */
__attribute__((target("avx512f"))) static void transpose16_regs(const __m512i r[16], __m512i out[16])
{
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);       /* per 128-bit lane: a0 b0 a1 b1 */
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);   /* a2 b2 a3 b3 */
    }
    for (int i = 0; i < 4; i++) {   /* rows 4i .. 4i+3: u[4i + j] holds element 4 L + j in lane L */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {   /* token 4 L + j: lane L of u[j], u[4 + j], u[8 + j], u[12 + j] */
        __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
        __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44), v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
        out[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        out[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        out[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        out[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

__attribute__((target("avx512f"))) static void transpose16(const int32_t *c, __m512i out[16])
{
    __m512i r[16];
    for (int i = 0; i < 16; i++)
        r[i] = _mm512_load_si512(c + 16 * i);
    transpose16_regs(r, out);
}

/* A tile of packed activations is the transpose of its 16 tokens' 64 bytes taken as 16 dwords
 * each: row g = dword g of every token. A block of fewer than 16 tokens (a routed expert's few)
 * or the reduction's last, shorter step reads zeros for what it lacks, as the loops do. */
__attribute__((target("avx512f,avx512bw"))) static void pack_tile_avx512(const pd_gemm_job *job, int tb, int kb,
                                                                       int8_t *tile)
{
    const int nu = job->n - 16 * tb < 16 ? job->n - 16 * tb : 16, nb = job->in - 64 * kb < 64 ? job->in - 64 * kb : 64;
    const __mmask64 m = nb == 64 ? ~(__mmask64)0 : ((__mmask64)1 << nb) - 1;
    __m512i r[16], out[16];
    for (int n = 0; n < 16; n++)
        r[n] = n < nu ? _mm512_maskz_loadu_epi8(m, pd_gemm_job_arow(job, 16 * tb + n) + 64 * kb) : _mm512_setzero_si512();
    transpose16_regs(r, out);
    for (int g = 0; g < 16; g++)
        _mm512_storeu_si512(tile + 64 * g, out[g]);
}

static int pack_tile_fast(const pd_gemm_job *job, int tb, int kb, int8_t *tile)
{
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw"))
        return 0;
    pack_tile_avx512(job, tb, kb, tile);
    return 1;
}

/* The hardware path's epilogue: the two C tiles of a token block transposed in registers and
 * scaled into y straight away (the model of the tiles goes through amx_transpose and
 * pd_gemm_store instead). */
__attribute__((target("avx512f"))) static void amx_epilogue_avx512(const pd_gemm_job *job, const int32_t *lo, const int32_t *hi,
                                                                 int t0, int nu, int ob, int nr0, int nr1)
{
    __m512i out[16];
    transpose16(lo, out);
    for (int u = 0; u < nu; u++)
        pd_gemm_store16(job, t0 + u, ob, nr0, out[u]);
    if (nr1) {
        transpose16(hi, out);
        for (int u = 0; u < nu; u++)
            pd_gemm_store16(job, t0 + u, ob + 16, nr1, out[u]);
    }
}

/* The tile instructions as inline assembly that names the memory it touches. GCC 12's intrinsics do
 * not: _tile_loadconfig tells the compiler it reads 8 bytes of the 64-byte configuration, and
 * _tile_loadd / _tile_stored declare no memory at all. At -O2 the compiler then drops the stores
 * that fill the configuration (LDTILECFG read stack garbage in its reserved bytes and faulted with
 * #GP, seen as SIGSEGV on the first Sapphire Rapids host this ran on), may drop or sink the copies
 * into the zero-padded weight tiles before a TILELOADD, and may read the sums before TILESTORED
 * has written them. The "memory" clobber on every instruction that reads or writes memory orders
 * them with the C code around; the tile-only instructions (TILEZERO, TDPBSSD) are volatile, so
 * they keep their order among the others. */
#define AMX_HW_STR(x) #x

#define AMX_FN __attribute__((target("amx-tile,amx-int8"))) static void rows_hw(const pd_gemm_job *job, int o0, int o1)
#define AMX_STATE
#define AMX_FALLBACK(job, o0, o1) pd_gemm_rows_avx512((job), (o0), (o1))
#define AMX_PREFETCH_W amx_prefetch_w
#define AMX_PREFETCH_ROWS(p, b0, b1)                                     \
    do {                                                                 \
        for (int64_t pr_ = (b0) & ~(int64_t)63; pr_ < (b1); pr_ += 64)   \
            __builtin_prefetch((p) + pr_, 0, 2);                         \
    } while (0)
#define AMX_EPILOGUE amx_epilogue_avx512
#define AMX_CONFIG(cfg) __asm__ volatile("ldtilecfg %0" ::"m"(*(const struct amx_cfg *)(cfg)) : "memory")
#define AMX_RELEASE() __asm__ volatile("tilerelease" ::: "memory")
#define AMX_ZERO(t) __asm__ volatile("tilezero %%tmm" AMX_HW_STR(t)::)
#define AMX_LOAD(t, p, stride)                                                                              \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" AMX_HW_STR(t)::"r"((const void *)(p)), "r"((long)(stride)) \
                     : "memory")
#define AMX_DP(c, a, b) __asm__ volatile("tdpbssd %%tmm" AMX_HW_STR(b) ", %%tmm" AMX_HW_STR(a) ", %%tmm" AMX_HW_STR(c)::)
#define AMX_STORE(t, p, stride)                                                                              \
    __asm__ volatile("tilestored %%tmm" AMX_HW_STR(t) ", (%0,%1,1)" ::"r"((void *)(p)), "r"((long)(stride)) \
                     : "memory")

#include "kernels/gemm_amx_body.h"

void pd_gemm_rows_amx(const pd_gemm_job *job, int o0, int o1)
{
    if (job->n < PD_GEMM_AMX_MIN_TOKENS)
        pd_gemm_rows_avx512_two_streams(job, o0, o1);
    else
        rows_hw(job, o0, o1);
}

/* The peak probe: four independent accumulators, each TDPBSSD reading tiles already loaded. */
__attribute__((target("amx-tile,amx-int8"))) static void probe_hw(uint64_t iters)
{
    _Alignas(64) int8_t src[16 * 64] = {1};
    struct amx_cfg cfg;
    amx_cfg_full(&cfg);
    AMX_CONFIG(&cfg);
    AMX_LOAD(4, src, 64);
    AMX_LOAD(5, src, 64);
    AMX_LOAD(6, src, 64);
    AMX_LOAD(7, src, 64);
    AMX_ZERO(0);
    AMX_ZERO(1);
    AMX_ZERO(2);
    AMX_ZERO(3);
    for (uint64_t i = 0; i < iters; i++) {
        AMX_DP(0, 4, 6);
        AMX_DP(1, 4, 7);
        AMX_DP(2, 5, 6);
        AMX_DP(3, 5, 7);
    }
    AMX_RELEASE();
}

int pd_gemm_amx_probe(uint64_t iters)
{
    if (!pd_gemm_amx_available())
        return -1;
    probe_hw(iters);
    return 0;
}

/* Linux keeps the tile data state off until a process asks for it (5.16 and later); without it the
 * first tile instruction faults. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int pd_gemm_amx_available(void)
{
    static atomic_int state = -1;   /* every thread that races here computes the same answer */
    if (atomic_load(&state) < 0) {
        /* CPUID leaf 7: EDX bit 24 AMX-TILE, bit 25 AMX-INT8 (read directly: clang 14's
         * __builtin_cpu_supports does not know the AMX names) */
        unsigned a = 0, b = 0, c = 0, d = 0;
        int amx = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1);
        __builtin_cpu_init();
        int cpu = amx && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
        atomic_store(&state, cpu && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0);
    }
    return atomic_load(&state);
}
#else
static int pack_tile_fast(const pd_gemm_job *job, int tb, int kb, int8_t *tile)
{
    return 0;
}

void pd_gemm_rows_amx(const pd_gemm_job *job, int o0, int o1)
{
    pd_gemm_rows_ref(job, o0, o1);
}

int pd_gemm_amx_available(void)
{
    return 0;
}

int pd_gemm_amx_probe(uint64_t iters)
{
    return -1;
}
#endif

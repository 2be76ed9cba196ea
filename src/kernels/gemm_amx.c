/* AMX-INT8 GEMM path (Intel Sapphire Rapids and later): TDPBSSD multiplies a 16 x 64-byte tile of
 * signed bytes by a 16 x 64-byte tile of signed bytes laid out four bytes per column ("VNNI
 * layout") into a 16 x 16 tile of int32 sums, 16,384 multiply-adds per instruction.
 *
 *   C[m][n] += sum_{g < 16} sum_{j < 4} A[m][4g + j] * B[g][4n + j]
 *
 * Here A is 16 weight rows (16 output channels) x 64 bytes of the reduction, read straight from the
 * row-major weight matrix, and B holds 16 tokens: B[g][4n + j] = a[token n][64 kb + 4g + j]. The
 * activations are therefore packed once per product (pd_gemm_amx_pack, run by gemm.c over the
 * pool before the row tasks) into 1 KiB tiles [token block][K block][g][n][j], zero-padded to
 * whole tiles; the weights are used as they are. Integer sums are exact, and every tile goes
 * through gemm.c's one epilogue, so the results equal every other path's bit for bit.
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
#include <stdatomic.h>
#include <stdint.h>
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

/* Weight rows [o, o + nr) x bytes [64 kb, 64 kb + 64) of the reduction, as a 16 x 64 tile: a pointer
 * into the matrix (rows `in` apart) when all of it lies inside, else a zero-padded copy in `pad`
 * (rows 64 apart), which the caller recognises by the address. */
static const int8_t *amx_weight_tile(const pd_gemm_job *job, int o, int nr, int kb, int8_t *pad)
{
    const int in = job->in, k0 = 64 * kb, nk = in - k0 < 64 ? in - k0 : 64;
    const int8_t *w = job->w + (int64_t)o * in + k0;
    if (nr == 16 && nk == 64)
        return w;
    memset(pad, 0, 16 * 64);
    for (int r = 0; r < nr; r++)
        memcpy(pad + 64 * r, w + (int64_t)r * in, (size_t)nk);
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

size_t pd_gemm_amx_pack_bytes(int n, int in)
{
    return (size_t)((n + 15) / 16) * (size_t)((in + 63) / 64) * 1024;
}

void pd_gemm_amx_pack(const pd_gemm_job *job, int tb, int8_t *dst)
{
    const int in = job->in, nkb = (in + 63) / 64;
    int8_t *blk = dst + (int64_t)tb * nkb * 1024;
    memset(blk, 0, (size_t)nkb * 1024);
    for (int n = 0; n < 16 && tb * 16 + n < job->n; n++) {
        const int8_t *a = pd_gemm_job_arow(job, tb * 16 + n);
        /* 4-byte groups: group q of the row goes to K block q / 16, tile row q % 16, column n */
        int q = 0;
        for (; 4 * q + 4 <= in; q++)
            memcpy(blk + (q / 16) * 1024 + (q % 16) * 64 + 4 * n, a + 4 * q, 4);
        if (4 * q < in)
            memcpy(blk + (q / 16) * 1024 + (q % 16) * 64 + 4 * n, a + 4 * q, (size_t)(in - 4 * q));
    }
}

/* ---- the model of the tiles (amx-emu) ---- */

#define AMX_FN static void rows_emu(const pd_gemm_job *job, int o0, int o1)
#define AMX_STATE _Alignas(64) int32_t tmm[8][16 * 16]; /* bytes read through int8_t pointers */
#define AMX_CONFIG(cfg) (void)(cfg)
#define AMX_RELEASE() ((void)0)
#define AMX_ZERO(t) memset(tmm[t], 0, sizeof tmm[t])
#define AMX_LOAD(t, p, stride) emu_load((int8_t *)tmm[t], (p), (stride))
#define AMX_DP(c, a, b) pd_gemm_amx_emu_dpbssd(tmm[c], (const int8_t *)tmm[a], (const int8_t *)tmm[b])
#define AMX_STORE(t, p, stride) emu_store((p), tmm[t], (stride))

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
        pd_gemm_rows_avx512(job, o0, o1);
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

/* The AMX-INT8 path (kernels/gemm_amx.c). Where the CPU has no AMX (the AMD machines this project
 * runs CI on) the tile instructions cannot run, so what is tested is everything around them, on the
 * amx-emu build of the same loops: the model of TDPBSSD against the architecture manual's definition
 * on hand-worked values, the packed activations against the B-operand layout the instruction
 * reads, the blocking and its tails against the reference bit for bit, and the choice of kernel
 * against /proc/cpuinfo. Where the CPU has AMX, the odd shapes and the peak probe also run on the
 * tiles themselves, and the existing all-kernels tests run the real kernel. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/threadpool.h"
#include "kernels/gemm.h"
#include "kernels/gemm_impl.h"

static uint64_t rng = 11;

static int8_t rnd8(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (int8_t)(rng >> 24);
}

static float rndscale(void)
{
    return 1e-3f + (float)((uint8_t)rnd8()) * 1e-5f;
}

/* SDM: tmm.row[m].dword[n] += sum over k of DPBD(a.row[m].dword[k], b.row[k].dword[n]), each DPBD the
 * sum of four signed byte products. Worked by hand on a few entries. */
Test(amx, tile_model_is_tdpbssd)
{
    _Alignas(64) int32_t c[16 * 16];
    _Alignas(64) int8_t a[16 * 64] = {0}, b[16 * 64] = {0};
    for (int i = 0; i < 256; i++)
        c[i] = 1000;
    /* a row 0, dword 0 = 1 2 3 4; b row 0, dword 0 = 5 6 7 8, dword 1 = 1 1 1 1 */
    memcpy(a, (int8_t[]){1, 2, 3, 4}, 4);
    memcpy(b, (int8_t[]){5, 6, 7, 8, 1, 1, 1, 1}, 8);
    /* a row 2, dword 15 = -128 -128 127 0; b row 15 (k = 15), dword 3 = -128 1 1 9 */
    memcpy(a + 2 * 64 + 60, (int8_t[]){-128, -128, 127, 0}, 4);
    memcpy(b + 15 * 64 + 12, (int8_t[]){-128, 1, 1, 9}, 4);
    pd_gemm_amx_emu_dpbssd(c, a, b);
    cr_assert_eq(c[0 * 16 + 0], 1000 + 1 * 5 + 2 * 6 + 3 * 7 + 4 * 8);   /* 1070 */
    cr_assert_eq(c[0 * 16 + 1], 1000 + 10);
    cr_assert_eq(c[2 * 16 + 3], 1000 + 16384 - 128 + 127);                /* 17383 */
    cr_assert_eq(c[2 * 16 + 0], 1000);   /* a row 2 meets b row 15's dword 0, which is zero */
    cr_assert_eq(c[1 * 16 + 0], 1000);
    for (int i = 0; i < 256; i++)
        if (i != 0 && i != 1 && i != 2 * 16 + 3)
            cr_assert_eq(c[i], 1000, "entry %d", i);
}

/* The packed activations are TDPBSSD's B operand: tile (token block tb, step kb) row g, bytes 4n..4n+3
 * = activation row of token 16 tb + n, bytes 64 kb + 4 g .. + 3; zero past the tokens and the row.
 * The tiles lie panel by panel (PD_GEMM_AMX_KC steps), token block by token block within a panel:
 * 21 tokens x 1,100 bytes is 2 token blocks x 18 steps: two whole panels and one of 2 steps. */
Test(amx, packed_activations_are_the_b_operand_layout)
{
    const int n = 21, in = 1100, nkb = 18;
    cr_assert_eq(PD_GEMM_AMX_KC, 8);
    cr_assert_eq(pd_gemm_amx_tile_offset(n, in, 1, 3), (8 + 3) * 1024);
    cr_assert_eq(pd_gemm_amx_tile_offset(n, in, 1, 12), (16 + 8 + 4) * 1024);
    cr_assert_eq(pd_gemm_amx_tile_offset(n, in, 0, 16), 32 * 1024);
    cr_assert_eq(pd_gemm_amx_tile_offset(n, in, 1, 17), (32 + 2 + 1) * 1024);
    int8_t *a = malloc((size_t)n * in);
    for (int i = 0; i < n * in; i++)
        a[i] = rnd8();
    const int32_t tok[21] = {20, 3, 3, 0, 19, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 1, 2};
    for (int use_tok = 0; use_tok < 2; use_tok++) {
        pd_gemm_job job = {.a = a, .in = in, .n = n, .tok = use_tok ? tok : NULL};
        size_t bytes = pd_gemm_amx_pack_bytes(n, in);
        cr_assert_eq(bytes, (size_t)2 * nkb * 1024);
        int8_t *p = malloc(bytes);
        memset(p, 0x55, bytes);
        for (int tb = 0; tb < 2; tb++)
            pd_gemm_amx_pack(&job, tb, p);
        for (int tb = 0; tb < 2; tb++)
            for (int kb = 0; kb < nkb; kb++)
                for (int g = 0; g < 16; g++)
                    for (int t = 0; t < 16; t++)
                        for (int j = 0; j < 4; j++) {
                            int row = 16 * tb + t, k = 64 * kb + 4 * g + j;
                            int8_t want = row < n && k < in ? a[(size_t)(use_tok ? tok[row] : row) * in + k] : 0;
                            int8_t got = p[pd_gemm_amx_tile_offset(n, in, tb, kb) + 64 * g + 4 * t + j];
                            cr_assert_eq(got, want, "tok %d tb %d kb %d g %d t %d j %d", use_tok, tb, kb, g, t, j);
                        }
        free(p);
    }
    free(a);
}

static void set_kernel(pd_kernel k)
{
    pd_err e = {0};
    cr_assert_eq(pd_gemm_kernel_set(k, &e), 0, "%s", e.msg);
}

/* Every tail the blocking has: rows ending inside the first or second 16-row tile of a pair, and on a
 * task boundary; reductions of 1..3 bytes, inside a K block and just past one; token counts below
 * the tile threshold, inside one token block, ending the second of a pair or a lone one; the plain and
 * the grouped forms (a gathered, repeated, reversed list of rows), with and without accumulation, on 1
 * and 2 threads: bit for bit the reference's outputs. */
/* One shape on `kernel`, plain and grouped, with and without accumulation: bit for bit the
 * reference's outputs. */
static void equal_reference(pd_kernel kernel, int out, int in, int T, pd_pool *p)
{
    pd_err e = {0};
    int8_t *w = malloc((size_t)out * in), *a = malloc((size_t)T * in);
    float *ws = malloc((size_t)out * sizeof *ws), *as = malloc((size_t)T * sizeof *as);
    for (int i = 0; i < out * in; i++)
        w[i] = rnd8();
    for (int i = 0; i < T * in; i++)
        a[i] = rnd8();
    for (int i = 0; i < out; i++)
        ws[i] = rndscale();
    for (int i = 0; i < T; i++)
        as[i] = rndscale();
    pd_qmat W = {w, ws, out, in}, A = {a, as, T, in};
    size_t ny = (size_t)T * out;
    /* outputs on 64-byte boundaries, as the engine's scratch is: rows of whole lines meet the
     * non-temporal stores (other widths put some rows off the boundary, which plain stores write) */
    const size_t ybytes = (ny * sizeof(float) + 63) & ~(size_t)63;
    float *ref = malloc(ny * sizeof *ref), *y = aligned_alloc(64, ybytes);
    int32_t *rows = malloc((size_t)T * sizeof *rows);
    for (int j = 0; j < T; j++)
        rows[j] = j % 3 == 2 ? rows[j - 1] : T - 1 - j;
    float *gref = malloc(ny * sizeof *gref), *gy = aligned_alloc(64, ybytes);
    for (int flags = 0; flags <= PD_GEMM_ACCUM; flags += PD_GEMM_ACCUM) {
        for (size_t i = 0; i < ny; i++)
            ref[i] = gref[i] = (float)(i % 7) - 3.0f;
        memcpy(y, ref, ny * sizeof *y);
        memcpy(gy, gref, ny * sizeof *gy);
        set_kernel(PD_KERNEL_REF);
        cr_assert_eq(pd_gemm(NULL, &W, &A, ref, flags, &e), 0, "%s", e.msg);
        pd_gemm_group g = {.w = W, .rows = rows, .n = T, .y = gref};
        cr_assert_eq(pd_gemm_grouped(NULL, &A, &g, 1, flags, &e), 0, "%s", e.msg);
        set_kernel(kernel);
        cr_assert_eq(pd_gemm(p, &W, &A, y, flags, &e), 0, "%s", e.msg);
        cr_assert(memcmp(ref, y, ny * sizeof *y) == 0, "plain out %d in %d T %d flags %d", out, in, T, flags);
        /* the same group twice over halves of the rows: two packed parts in one allocation */
        pd_gemm_group two[2] = {{.w = W, .rows = rows, .n = T / 2, .y = gy},
                                {.w = W, .rows = rows + T / 2, .n = T - T / 2, .y = gy + (size_t)(T / 2) * out}};
        cr_assert_eq(pd_gemm_grouped(p, &A, two, 2, flags, &e), 0, "%s", e.msg);
        cr_assert(memcmp(gref, gy, ny * sizeof *gy) == 0, "grouped out %d in %d T %d flags %d", out, in, T, flags);
        /* a group reading the same rows as the group before it (an expert's gate and up) shares its
         * packed activations; the group after it has its own again */
        if (flags == 0) {
            float *g2 = malloc(ny * sizeof *g2), *g3 = malloc(ny * sizeof *g3);
            pd_gemm_group three[3] = {{.w = W, .rows = rows, .n = T, .y = gy},
                                      {.w = W, .rows = rows, .n = T, .y = g2},
                                      {.w = W, .rows = rows + T / 2, .n = T - T / 2, .y = g3}};
            cr_assert_eq(pd_gemm_grouped(p, &A, three, 3, 0, &e), 0, "%s", e.msg);
            cr_assert(memcmp(gref, gy, ny * sizeof *gy) == 0, "shared rows, first: out %d in %d T %d", out, in, T);
            cr_assert(memcmp(gref, g2, ny * sizeof *g2) == 0, "shared rows, second: out %d in %d T %d", out, in, T);
            cr_assert(memcmp(gref + (size_t)(T / 2) * out, g3, (size_t)(T - T / 2) * out * sizeof *g3) == 0,
                      "after shared rows: out %d in %d T %d", out, in, T);
            free(g2);
            free(g3);
        }
    }
    free(w), free(a), free(ws), free(as), free(ref), free(y), free(rows), free(gref), free(gy);
    set_kernel(PD_KERNEL_REF);
}

static void equal_reference_on_odd_shapes(pd_kernel kernel)
{
    static const int outs[] = {1, 15, 16, 17, 31, 33, 64, 65, 100};
    static const int ins[] = {1, 3, 63, 64, 65, 130, 1000};
    static const int Ts[] = {3, 4, 15, 16, 17, 32, 33, 47};
    /* The blocked form (gemm_amx_body.h): enough tokens that the weights are copied into tiles
     * (96 or more, with rows under 1 KiB or more than 1 MiB of packed activations:
     * pd_gemm_amx_in_place), reductions of several 512-byte blocks with a
     * partial last block and a partial last step, task heights of 32, 64 and 256 rows with a
     * partial last pair of row blocks, and an odd token block at the end. */
    static const int blocked[][3] = {{17, 700, 200}, {100, 2100, 520}, {600, 1000, 240}, {2064, 1000, 196}};
    /* The weights read in place for more than 5 token blocks (rows of 1 KiB or more, at most 1 MiB
     * of packed activations): each block of 16 rows meets the token blocks in groups of 5, the last
     * group partial (3 blocks, its last one partial) or whole (3 groups of 5), with a partial last
     * step, in 128- and 256-row tasks (the next group's epilogue runs between the steps of the
     * next unit, across blocks and tasks). */
    static const int grouped[][3] = {{17, 1100, 200}, {100, 2100, 193}, {600, 1030, 240}, {2064, 1088, 196}};
    /* One pass over the weights in place with four and five token blocks (C tiles tmm3, tmm4, the
     * last token block partial or whole), and the first token count whose weights are copied; then
     * rows short enough that each next block is requested by software, over several 128-row tasks
     * with a partial last block (the request reaching past a task's rows and the matrix's end).
     * Outputs of PD_GEMM_STREAM_Y_BYTES or more go past the caches in whole lines (the last blocked
     * shape's 1.6 MB and the last one-pass shape's 1.1 MB, rows of y not all 64-byte aligned, a
     * partial last row block: those lines stored as the others are). */
    static const int one_pass[][3] = {{33, 130, 49}, {47, 65, 64}, {17, 200, 65}, {100, 63, 80}, {31, 1000, 81},
                                      {300, 512, 12}, {260, 256, 20}, {4100, 256, 70}};
    pd_pool *pool;
    pd_err e = {0};
    cr_assert_eq(pd_pool_create(2, &pool, &e), 0, "%s", e.msg);
    for (size_t oi = 0; oi < sizeof outs / sizeof *outs; oi++)
        for (size_t ii = 0; ii < sizeof ins / sizeof *ins; ii++)
            for (size_t ti = 0; ti < sizeof Ts / sizeof *Ts; ti++)
                equal_reference(kernel, outs[oi], ins[ii], Ts[ti], (oi + ii + ti) % 2 ? pool : NULL);
    for (size_t i = 0; i < sizeof blocked / sizeof *blocked; i++)
        cr_assert(!pd_gemm_amx_in_place(blocked[i][2], blocked[i][1]), "blocked shape %zu is read in place", i);
    for (size_t i = 0; i < sizeof grouped / sizeof *grouped; i++)
        cr_assert(pd_gemm_amx_in_place(grouped[i][2], grouped[i][1]) && grouped[i][2] > 16 * PD_GEMM_AMX_GROUP_TB,
                  "grouped shape %zu is not read in place in groups", i);
    for (size_t i = 0; i < sizeof blocked / sizeof *blocked; i++)
        equal_reference(kernel, blocked[i][0], blocked[i][1], blocked[i][2], i % 2 ? pool : NULL);
    for (size_t i = 0; i < sizeof grouped / sizeof *grouped; i++)
        equal_reference(kernel, grouped[i][0], grouped[i][1], grouped[i][2], i % 2 ? NULL : pool);
    for (size_t i = 0; i < sizeof one_pass / sizeof *one_pass; i++)
        equal_reference(kernel, one_pass[i][0], one_pass[i][1], one_pass[i][2], i % 2 ? pool : NULL);
    pd_pool_destroy(pool);
}

Test(amx, emulated_tiles_equal_the_reference_on_odd_shapes)
{
    equal_reference_on_odd_shapes(PD_KERNEL_AMX_EMU);
}

/* The same shapes on the tile instructions. GCC 12's AMX intrinsics hid the memory they read and
 * write from the compiler, which dropped the stores filling the tile configuration: the peak probe
 * faulted on the first AMX host (the kernel's own rows happened to survive). */
Test(amx, hardware_tiles_equal_the_reference_on_odd_shapes)
{
    if (!pd_gemm_kernel_supported(PD_KERNEL_AMX))
        cr_skip_test("this CPU has no AMX-INT8 (grep -o amx_int8 /proc/cpuinfo)");
    equal_reference_on_odd_shapes(PD_KERNEL_AMX);
}

Test(amx, peak_probe_runs_where_the_cpu_has_it)
{
    cr_assert_eq(pd_gemm_amx_probe(1000), pd_gemm_kernel_supported(PD_KERNEL_AMX) ? 0 : -1);
}

/* The real kernel is offered exactly where /proc/cpuinfo lists AMX-TILE and AMX-INT8 (and Linux grants
 * the tile state, which every kernel with those flags and 5.16 or later does); elsewhere asking for it
 * is an error naming it; amx-emu is always there but never the default. */
Test(amx, offered_where_the_cpu_has_it)
{
    FILE *f = fopen("/proc/cpuinfo", "r");
    cr_assert_not_null(f);
    char line[8192];
    int tile = 0, int8 = 0;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "flags", 5) == 0) {
            tile = strstr(line, " amx_tile") != NULL;
            int8 = strstr(line, " amx_int8") != NULL;
            break;
        }
    fclose(f);
    cr_assert_eq(pd_gemm_kernel_supported(PD_KERNEL_AMX), tile && int8);
    cr_assert_eq(pd_gemm_kernel_supported(PD_KERNEL_AMX_EMU), 1);
    pd_kernel k;
    pd_err e = {0};
    cr_assert_eq(pd_gemm_kernel_parse("amx-emu", &k, &e), 0);
    cr_assert_eq(k, PD_KERNEL_AMX_EMU);
    cr_assert_str_eq(pd_gemm_kernel_name(PD_KERNEL_AMX), "amx");
    if (!(tile && int8)) {
        cr_assert_lt(pd_gemm_kernel_set(PD_KERNEL_AMX, &e), 0);
        cr_assert(strstr(e.msg, "amx") && strstr(e.msg, "not supported"), "%s", e.msg);
    }
}

/* The decode GEMV's two-stream order (gemm_avx512.c's rows_two_streams, which the AMX kernels give
 * their jobs of 1-3 tokens): row ranges of whole pairs of 64-row chunks (one pair, three pairs, one
 * starting past row 0), short rows with and without a partial last 64 bytes, 1 to 3 tokens gathered
 * out of order, with and without accumulation: bit for bit the reference's outputs, and no row
 * outside the range written. A row of one stream stored in the other's place, or a tile row left
 * out, fails it. */
Test(amx, two_stream_gemv_equals_the_reference)
{
    if (!pd_gemm_kernel_supported(PD_KERNEL_AVX512))
        cr_skip_test("this CPU has no AVX-512 VNNI");
    static const int shapes[][4] = {{128, 512, 0, 128}, {384, 256, 0, 384}, {640, 200, 128, 512}, {256, 2048, 0, 256}};
    static const int32_t tok[3] = {2, 0, 1};
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++)
        for (int T = 1; T <= 3; T++)
            for (int accum = 0; accum <= 1; accum++) {
                const int out = shapes[s][0], in = shapes[s][1], o0 = shapes[s][2], o1 = shapes[s][3];
                int8_t *w = malloc((size_t)out * in), *a = malloc((size_t)3 * in);
                float *ws = malloc((size_t)out * sizeof *ws), as[3];
                for (int i = 0; i < out * in; i++)
                    w[i] = rnd8();
                for (int i = 0; i < 3 * in; i++)
                    a[i] = rnd8();
                for (int i = 0; i < out; i++)
                    ws[i] = rndscale();
                for (int i = 0; i < 3; i++)
                    as[i] = rndscale();
                float *ref = malloc((size_t)T * out * sizeof *ref), *y = malloc((size_t)T * out * sizeof *y);
                for (int i = 0; i < T * out; i++)
                    ref[i] = y[i] = (float)(i % 5) - 2.0f;
                pd_gemm_job j = {.w = w, .w_scale = ws, .out = out, .in = in, .a = a, .a_scale = as, .tok = tok,
                                 .n = T, .y = ref, .accum = accum};
                pd_gemm_rows_ref(&j, o0, o1);
                j.y = y;
                pd_gemm_rows_avx512_two_streams(&j, o0, o1);
                cr_assert(memcmp(ref, y, (size_t)T * out * sizeof *y) == 0, "out %d in %d rows [%d, %d) T %d accum %d",
                          out, in, o0, o1, T, accum);
                free(w), free(a), free(ws), free(ref), free(y);
            }
}

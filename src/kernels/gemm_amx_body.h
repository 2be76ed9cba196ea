/* The AMX-INT8 GEMM body, included twice by gemm_amx.c: once with the hardware's tile instructions
 * and once with a software model of them (amx-emu), so that the blocking, the packing and the
 * tails the hardware runs are the code the tests run on any CPU. No include guard on purpose.
 *
 * Before including, define:
 *   AMX_FN          the function's name and attributes (void NAME(const pd_gemm_job *, int, int))
 *   AMX_STATE       declarations the tile macros need in the function (the model's tiles), or empty
 *   AMX_CONFIG(cfg) load the tile configuration `cfg` (struct amx_cfg *)
 *   AMX_RELEASE()   release the tile state
 *   AMX_ZERO(t)     tmm t = 0
 *   AMX_LOAD(t, p, stride)   tmm t = 16 rows of 64 bytes at p, rows `stride` bytes apart
 *   AMX_DP(c, a, b) tmm c += tmm a . tmm b (TDPBSSD: signed bytes times signed bytes)
 *   AMX_STORE(t, p, stride)  16 rows of 16 int32 of tmm t to p, rows `stride` bytes apart
 *
 * Tiles: C00..C11 = tmm0..3 (int32 sums of 16 weight rows x 16 tokens), A0/A1 = tmm4/5 (two blocks of
 * 16 weight rows x 64 bytes of the reduction, loaded straight from the weight matrix), B0/B1 = tmm6/7
 * (two blocks of 16 tokens from the packed activations, gemm_amx.c). Each step of the reduction
 * loads four tiles and runs four products: 32 rows x 32 tokens, every tile used twice. The weights
 * need no sign trick (TDPBSSD multiplies signed by signed) and no packing: a weight tile is 16
 * consecutive rows read `in` bytes apart, except where a tile would reach past the matrix (the last
 * K block when in % 64 != 0, a last row block of fewer than 16 rows): those are copied into a
 * zero-padded 16 x 64 buffer first (zeros add nothing; the packed activations are zero there too). */
AMX_FN
{
    AMX_STATE
    const int in = job->in, nkb = (in + 63) / 64, ntb = (job->n + 15) / 16;
    const int8_t *pack = job->apack;
    _Alignas(64) int8_t wpad[2][16 * 64];
    _Alignas(64) int32_t c[4][16 * 16];
    int32_t acc[16 * 32];
    struct amx_cfg cfg;
    amx_cfg_full(&cfg);
    AMX_CONFIG(&cfg);
    /* Token blocks outside, row blocks inside: a task's rows (gemm.c keeps them within about 256 KiB)
     * stay in L2 while each pair of token blocks passes over them, and that pair's packed tiles
     * (32 tokens x in bytes) are reread from cache for every pair of row blocks. */
    for (int tb = 0; tb < ntb; tb += 2) {
        const int two_tb = tb + 1 < ntb;
        for (int ob = o0; ob < o1; ob += 32) {
            const int nr0 = o1 - ob < 16 ? o1 - ob : 16;
            const int nr1 = o1 - ob - 16 <= 0 ? 0 : o1 - ob - 16 < 16 ? o1 - ob - 16 : 16;
            AMX_ZERO(0);
            AMX_ZERO(1);
            AMX_ZERO(2);
            AMX_ZERO(3);
            for (int kb = 0; kb < nkb; kb++) {
                const int8_t *a0 = amx_weight_tile(job, ob, nr0, kb, wpad[0]);
                AMX_LOAD(4, a0, a0 == wpad[0] ? 64 : in);
                AMX_LOAD(6, pack + ((int64_t)tb * nkb + kb) * 1024, 64);
                AMX_DP(0, 4, 6);
                if (two_tb) {
                    AMX_LOAD(7, pack + ((int64_t)(tb + 1) * nkb + kb) * 1024, 64);
                    AMX_DP(1, 4, 7);
                }
                if (nr1) {
                    const int8_t *a1 = amx_weight_tile(job, ob + 16, nr1, kb, wpad[1]);
                    AMX_LOAD(5, a1, a1 == wpad[1] ? 64 : in);
                    AMX_DP(2, 5, 6);
                    if (two_tb)
                        AMX_DP(3, 5, 7);
                }
            }
            AMX_STORE(0, c[0], 64);
            AMX_STORE(1, c[1], 64);
            AMX_STORE(2, c[2], 64);
            AMX_STORE(3, c[3], 64);
            for (int h = 0; h <= two_tb; h++) {
                const int t0 = (tb + h) * 16, nu = job->n - t0 < 16 ? job->n - t0 : 16;
                amx_transpose(c[h], c[2 + h], nu, nr0, nr1, acc);
                pd_gemm_store(job, t0, nu, ob, nr0 + nr1, acc, 32);
            }
        }
    }
    AMX_RELEASE();
}

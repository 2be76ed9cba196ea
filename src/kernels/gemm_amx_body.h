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
 *   AMX_EPILOGUE(job, lo, hi, t0, nu, ob, nr0, nr1)  y for tokens t0 .. t0 + nu and rows
 *                   ob .. ob + nr0 + nr1 from the stored C tiles lo (rows ob..) and hi (rows ob + 16..),
 *                   [row][token]
 *   AMX_PREFETCH_W(job, o0, k0, nk, l0, l1)  prefetch lines [l0, l1) of the weight rows from o0 x
 *                   steps [k0, k0 + nk), row by row (or nothing)
 *   AMX_PREFETCH_ROWS(p, b0, b1)  prefetch the lines of bytes [b0, b1) from p (or nothing)
 *   AMX_FALLBACK(job, o0, o1)  the same rows by another kernel, when the scratch cannot be had
 *
 * Tiles: C00..C11 = tmm0..3 (int32 sums of 16 weight rows x 16 tokens), A0/A1 = tmm4/5 (two blocks of
 * 16 weight rows x 64 bytes of the reduction), B0/B1 = tmm6/7 (two blocks of 16 tokens from the
 * packed activations, gemm_amx.c). Each step of the reduction loads four tiles and runs four
 * products: 32 rows x 32 tokens, every tile used twice. TDPBSSD multiplies signed by signed, so the
 * weights need no sign trick.
 *
 * Blocking (a task's rows are up to 256, gemm.c): the reduction is cut into blocks of
 * PD_GEMM_AMX_KC steps (512 bytes of every row). For each block the task's weight rows are copied
 * once into whole tiles, contiguous (a tile inside the matrix by one TILELOADD of its 16 rows and one
 * TILESTORED, the edges zero-padded by amx_weight_tile: the copy in 64-byte moves took 12% of a
 * 2048 x 4096 x 512 product at 2 threads, through the tiles 7%); each pair of
 * row blocks then meets every pair of token blocks, its own tiles of the block (16 KiB) staying in
 * L1 while the activations' come from L2. Between blocks the sums wait in memory (the task's C tiles, AMX_STORE /
 * AMX_LOAD); after the last block AMX_EPILOGUE scales them into y with the operations of gemm.c's
 * one epilogue, so the results equal every other path's bit for bit. The next block's weights are
 * prefetched a slice per pair of row blocks (AMX_PREFETCH_W), so that their copy finds them in L2.
 * A task reads the packed activations once per block: once for its 256 rows, not once per 32.
 * With few token blocks (a routed expert's tokens, or up to 1 MiB of packed activations over rows
 * of 1 KiB or more: pd_gemm_amx_in_place) a copied tile would serve too few products to repay the
 * copy, which besides stalls on weights from memory: the weights are read in place, 16 rows `in`
 * bytes apart (zero-padded copies at the matrix's edges), in one pass over the whole reduction in
 * which each block of 16 rows meets the token blocks PD_GEMM_AMX_GROUP_TB at a time (a C tile
 * each), so that every weight line comes from memory once (the next groups find the block in L1
 * or L2) and the hardware prefetchers see 16 rows streaming in order. Rows shorter than half a page
 * (mini's experts: 512 and 256 bytes) put a tile's 16 lines at strides the prefetchers do not
 * follow: the next block of rows, contiguous, is requested by software while this one computes
 * (gemm_amx.c gives the measurements). (Pairs of row blocks over pairs of token blocks, each row
 * read twice and the next pair prefetched by software, ran the MoE case of bench kernels at 0.52
 * of the dense GEMM's rate; this pass at 0.66; software prefetches added to it only slowed it.) */
AMX_FN
{
    AMX_STATE
    const int in = job->in, nkb = (in + 63) / 64, ntb = (job->n + 15) / 16, nrb = (o1 - o0 + 15) / 16;
    /* few token blocks: the weights are read in place (a copy would be used too few times) */
    const int packw = !pd_gemm_amx_in_place(job->n, in), kc = !packw || nkb < PD_GEMM_AMX_KC ? nkb : PD_GEMM_AMX_KC;
    const int8_t *pack = job->apack;
    struct amx_scratch *sc = amx_scratch(packw ? (size_t)nrb * kc * 1024 : 1024,
                                         nkb > kc ? (size_t)nrb * ntb * 1024 : 0);
    if (!sc) {   /* no memory for the blocks: the same sums by the path below the tiles */
        AMX_FALLBACK(job, o0, o1);
        return;
    }
    struct amx_cfg cfg;
    amx_cfg_full(&cfg);
    AMX_CONFIG(&cfg);
    if (!packw) {
        /* one pass over the weights: each block of 16 rows, read in place, meets the token blocks
         * PD_GEMM_AMX_GROUP_TB at a time (a group, a C tile each: tmm0 .. 4, the weights tmm5, the
         * tokens tmm6 and tmm7 in turn); the first group reads the block from memory, the others
         * find it in the caches. A unit's sums (a block's group) wait in cp[] while the next unit
         * computes, which runs their epilogue a token block at a time between its steps: the
         * scaling and the stores into y (lines not yet in the caches) then overlap the tile unit
         * and the weights' stream instead of stalling between units. */
        _Alignas(64) int32_t cp[2][PD_GEMM_AMX_GROUP_TB][16 * 16];
        const int ngroups = (ntb + PD_GEMM_AMX_GROUP_TB - 1) / PD_GEMM_AMX_GROUP_TB;
        int prev_ob = -1, prev_nr = 0, prev_tb = 0, prev_n = 0, unit = 0;
        for (int rb = 0; rb < nrb; rb++) {
            const int ob = o0 + 16 * rb, nr = o1 - ob < 16 ? o1 - ob : 16;
            /* rows shorter than AMX_PREFETCH_ROWS_MAX_IN: the next block of 16 rows, contiguous
             * in the matrix (past this task's rows too: the next task's, which this thread often
             * runs next), or the next group's first, requested a slice a step over this block's
             * steps (of every token group) */
            const int in_matrix = ob + 16 < job->out;
            const int8_t *wn = in_matrix ? job->w + (int64_t)(ob + 16) * in : job->w_next;
            const int next_rows = in_matrix ? job->out - ob - 16 : job->w_next ? job->next_out : 0;
            const int64_t wn_bytes = in < AMX_PREFETCH_ROWS_MAX_IN ? (int64_t)(next_rows < 16 ? next_rows : 16) * in : 0;
            const int64_t pf_steps = (int64_t)nkb * ngroups, pf_step = wn_bytes / pf_steps;
            int64_t pf_at = 0, step = 0;
            /* whole tiles (16 rows, 64 bytes) read in place at w_at, `in` apart; the rest padded */
            const int whole = nr == 16;
            const int8_t *w_at = job->w + (int64_t)ob * in;
            for (int g0 = 0; g0 < ntb; g0 += PD_GEMM_AMX_GROUP_TB, unit++) {
                const int gn = ntb - g0 < PD_GEMM_AMX_GROUP_TB ? ntb - g0 : PD_GEMM_AMX_GROUP_TB;
                AMX_ZERO(0);
                AMX_ZERO(1);
                AMX_ZERO(2);
                AMX_ZERO(3);
                AMX_ZERO(4);
                int32_t(*done)[16 * 16] = cp[(unit + 1) & 1], (*sums)[16 * 16] = cp[unit & 1];
                for (int k = 0, ep = 0, ep_at = 0; k < nkb; k++, step++) {
                    if (wn_bytes) {   /* a slice a step, the last step to the end */
                        const int64_t pf_end = step + 1 == pf_steps ? wn_bytes : pf_at + pf_step;
                        AMX_PREFETCH_ROWS(wn, pf_at, pf_end);
                        pf_at = pf_end;
                    }
                    /* the previous unit's token blocks, spread over this unit's steps (token
                     * block ep at step ep * nkb / prev_n, rounded down) */
                    for (; prev_ob >= 0 && ep < prev_n && ep_at < (k + 1) * prev_n; ep++, ep_at += nkb) {
                        const int t0 = (prev_tb + ep) * 16, nu = job->n - t0 < 16 ? job->n - t0 : 16;
                        AMX_EPILOGUE(job, done[ep], NULL, t0, nu, prev_ob, prev_nr, 0);
                    }
                    const int8_t *b = pack + pd_gemm_amx_tile_offset(job->n, in, g0, k);
                    const int64_t tstride = pd_gemm_amx_tile_offset(job->n, in, g0 + 1, k) - (b - pack);
                    if (whole && 64 * k + 64 <= in)
                        AMX_LOAD(5, w_at + 64 * k, in);
                    else
                        AMX_WLOAD(5, job, ob, o1, k, sc->w);
                    AMX_LOAD(6, b, 64);
                    AMX_DP(0, 5, 6);
                    if (gn > 1) {
                        AMX_LOAD(7, b + tstride, 64);
                        AMX_DP(1, 5, 7);
                    }
                    if (gn > 2) {
                        AMX_LOAD(6, b + 2 * tstride, 64);
                        AMX_DP(2, 5, 6);
                    }
                    if (gn > 3) {
                        AMX_LOAD(7, b + 3 * tstride, 64);
                        AMX_DP(3, 5, 7);
                    }
                    if (gn > 4) {
                        AMX_LOAD(6, b + 4 * tstride, 64);
                        AMX_DP(4, 5, 6);
                    }
                }
                AMX_STORE(0, sums[0], 64);
                if (gn > 1)
                    AMX_STORE(1, sums[1], 64);
                if (gn > 2)
                    AMX_STORE(2, sums[2], 64);
                if (gn > 3)
                    AMX_STORE(3, sums[3], 64);
                if (gn > 4)
                    AMX_STORE(4, sums[4], 64);
                prev_ob = ob;
                prev_nr = nr;
                prev_tb = g0;
                prev_n = gn;
            }
        }
        for (int tb = 0; prev_ob >= 0 && tb < prev_n; tb++) {   /* the last unit's epilogue, after every step */
            const int t0 = (prev_tb + tb) * 16, nu = job->n - t0 < 16 ? job->n - t0 : 16;
            AMX_EPILOGUE(job, cp[(unit - 1) & 1][tb], NULL, t0, nu, prev_ob, prev_nr, 0);
        }
        AMX_RELEASE();
        return;
    }
    _Alignas(64) int32_t c[4][16 * 16];   /* after the last block, a pair's C tiles for the epilogue */
    for (int k0 = 0; k0 < nkb; k0 += kc) {
        const int nk = nkb - k0 < kc ? nkb - k0 : kc, first = k0 == 0, last = k0 + nk == nkb;
        /* the block's weight tiles, contiguous, tile (rb, k) at sc->w + (rb * kc + k) * 1024: one
         * inside the matrix through tmm4 (one load, rows `in` apart, one store), one at its edges
         * padded straight into place by amx_weight_tile */
        for (int rb = 0; rb < nrb; rb++)
            for (int k = 0; k < nk; k++) {
                int8_t *d = sc->w + ((int64_t)rb * kc + k) * 1024;
                int stride;
                const int8_t *t = amx_weight_tile(job, o0 + 16 * rb, o1, k0 + k, d, &stride);
                if (t != d) {
                    AMX_LOAD(4, t, stride);
                    AMX_STORE(4, d, 64);
                }
            }
        /* the next block's weight lines, a slice per pair of row blocks, on their way to L2
         * while this block computes, so that its copy does not wait for memory */
        const int nk_next = !last ? (nkb - k0 - nk < kc ? nkb - k0 - nk : kc) : 0;
        const int64_t pf_lines = (int64_t)(o1 - o0) * nk_next, pf_pairs = (nrb + 1) / 2;
        for (int rb = 0; rb < nrb; rb += 2) {
            const int two_rb = rb + 1 < nrb;
            /* the copied weight tiles of row blocks rb and rb + 1 */
            const int8_t *a0 = sc->w + (int64_t)rb * kc * 1024, *a1 = a0 + (int64_t)kc * 1024;
            if (pf_lines)
                AMX_PREFETCH_W(job, o0, k0 + nk, nk_next, pf_lines * (rb / 2) / pf_pairs,
                               pf_lines * (rb / 2 + 1) / pf_pairs);
            for (int tb = 0; tb < ntb; tb += 2) {
                const int two_tb = tb + 1 < ntb;
                /* the C tiles of row blocks rb, rb + 1 and token blocks tb, tb + 1: from the task's
                 * tiles in memory (after the first block), to them (before the last) or to c for the
                 * epilogue (after it); a product of one block has none in memory */
                int32_t *from[4], *to[4], *mem = first && last ? NULL : sc->c + ((int64_t)rb * ntb + tb) * 256;
                amx_c_ptrs(last ? c[0] : mem, last ? 512 : (int64_t)ntb * 256, two_tb, two_rb, to);
                if (first) {
                    AMX_ZERO(0);
                    AMX_ZERO(1);
                    AMX_ZERO(2);
                    AMX_ZERO(3);
                } else {
                    amx_c_ptrs(mem, (int64_t)ntb * 256, two_tb, two_rb, from);
                    AMX_C_TILES(AMX_LOAD, from);
                }
                /* the activations' panel of this block (blocks and panels are PD_GEMM_AMX_KC steps) */
                const int8_t *b0 = pack + pd_gemm_amx_tile_offset(job->n, in, tb, k0);
                const int8_t *b1 = pack + pd_gemm_amx_tile_offset(job->n, in, tb + two_tb, k0);
                for (int k = 0; k < nk; k++) {
                    AMX_LOAD(4, a0 + k * 1024, 64);
                    AMX_LOAD(6, b0 + k * 1024, 64);
                    AMX_DP(0, 4, 6);
                    if (two_tb) {
                        AMX_LOAD(7, b1 + k * 1024, 64);
                        AMX_DP(1, 4, 7);
                    }
                    if (two_rb) {
                        AMX_LOAD(5, a1 + k * 1024, 64);
                        AMX_DP(2, 5, 6);
                        if (two_tb)
                            AMX_DP(3, 5, 7);
                    }
                }
                AMX_C_TILES(AMX_STORE, to);
                if (!last)
                    continue;
                const int ob = o0 + 16 * rb, nr0 = o1 - ob < 16 ? o1 - ob : 16;
                const int nr1 = two_rb ? (o1 - ob - 16 < 16 ? o1 - ob - 16 : 16) : 0;
                for (int h = 0; h <= two_tb; h++) {
                    const int t0 = (tb + h) * 16, nu = job->n - t0 < 16 ? job->n - t0 : 16;
                    AMX_EPILOGUE(job, c[h], c[2 + h], t0, nu, ob, nr0, nr1);
                }
            }
        }
    }
    AMX_RELEASE();
}

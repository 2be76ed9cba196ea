/* `pdmoe bench ep --ranks 1,2,4 --model DIR [--quick] [--json]`: expert-parallel dispatch +
 * combine per MoE layer (counts, packing, messages, scattering: everything but the experts) for 1
 * to 256 tokens per rank, against a raw MPI_Alltoallv of the same volumes timed alone in the same
 * run (an MPI_Alltoall of the counts, then every (token, expert) pair's int8 row with its expert
 * id and scale one way and its fp32 output row back, the pairs a rank keeps included, as an
 * Alltoallv exchange moves them), and decode tokens/s of the model for each group size. Ratios
 * are of medians and, for a shared machine, of minimums over the repetitions; "raw peers" leaves
 * out the pairs a rank keeps (only the bytes that cross between ranks). The command launches
 * `mpirun -n N pdmoe bench ep --worker` for each N (oversubscribed on small machines) and prints
 * the workers' rank-0 report; with --json one document: {"bench":"ep","model":...,"groups":[one
 * object per N]}. */
#include "bench.h"
#include "cli/cli.h"
#include "core/timing.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "ep/ep.h"
#include "kernels/quant.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return v[n / 2];
}

/* Random distinct experts per token, ascending (what the router produces). */
static void route(int32_t *ids, int T, int k, int E, uint64_t *s)
{
    for (int t = 0; t < T; t++) {
        int32_t *id = ids + (size_t)t * k;
        for (int j = 0; j < k; j++) {
            int dup;
            do {
                *s = *s * 6364136223846793005ull + 1442695040888963407ull;
                id[j] = (int32_t)((*s >> 33) % (uint64_t)E);
                dup = 0;
                for (int q = 0; q < j; q++)
                    dup |= id[q] == id[j];
            } while (dup);
        }
        for (int a = 1; a < k; a++)
            for (int b = a; b > 0 && id[b] < id[b - 1]; b--) {
                int32_t x = id[b];
                id[b] = id[b - 1];
                id[b - 1] = x;
            }
    }
}

/* The volumes of the last exchange moved by MPI alone: counts, dispatch records, combine rows;
 * median seconds, and the minimum in *best. bf16 = 1: the dispatch records are what a bf16
 * dispatch would send (expert id + 2 bytes per value) instead of int8 rows with their scale.
 * peers = 1: without the pairs a rank keeps. */
static double raw_alltoallv(struct pd_ep *ep, int reps, int bf16, int peers, double *best)
{
    const int n = ep->size, H = ep->hidden;
    const int rec = bf16 ? 4 + 2 * H : 8 + ((H + 3) & ~3);
    int *sc = calloc((size_t)n * 4, sizeof(int)), *sd = sc + n, *rc = sc + 2 * n, *rd = sc + 3 * n;
    size_t pairs = 0;   /* dispatch sends what combine receives and the other way round */
    for (int r = 0; r < n; r++)
        pairs += (size_t)ep->scnt[r] + (size_t)ep->rcnt[r];
    size_t bytes = pairs * (size_t)(rec > 4 * H ? rec : 4 * H) + 64;
    char *sb = malloc(bytes), *rb = malloc(bytes);
    double *t = calloc((size_t)reps, sizeof *t);
    int cnt[256], cnt2[256];
    for (int i = 0; i < reps; i++) {
        MPI_Barrier(ep->comm);
        double t0 = pd_now_s();
        MPI_Alltoall(cnt, 1, MPI_INT, cnt2, 1, MPI_INT, ep->comm);
        for (int phase = 0; phase < 2; phase++) {
            int s = 0, q = 0;
            for (int r = 0; r < n; r++) {
                int keep = !peers || r != ep->rank;
                int a = keep * (phase ? ep->rcnt[r] * 4 * H : ep->scnt[r] * rec);
                int b = keep * (phase ? ep->scnt[r] * 4 * H : ep->rcnt[r] * rec);
                sc[r] = a;
                sd[r] = s;
                s += a;
                rc[r] = b;
                rd[r] = q;
                q += b;
            }
            MPI_Alltoallv(sb, sc, sd, MPI_BYTE, rb, rc, rd, MPI_BYTE, ep->comm);
        }
        t[i] = pd_now_s() - t0;
    }
    double m = median(t, reps);
    *best = t[0];
    free(sc);
    free(sb);
    free(rb);
    free(t);
    return m;
}

static int worker(const char *dir, int quick, int json)
{
    int provided, rank, size;
    MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    pd_err e = {0};
    struct pd_model m;
    struct pd_ep ep;
    struct pd_engine en;
    if (pd_model_load(dir, &m, &e) || pd_ep_init(&ep, MPI_COMM_WORLD, &m, &e)) {
        fprintf(stderr, "bench ep (rank %d): %s\n", rank, e.msg);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    int cores = (int)sysconf(_SC_NPROCESSORS_ONLN), threads = cores / size > 0 ? cores / size : 1;
    struct pd_engine_opts o = {.dir = dir, .threads = threads, .max_seqs = 16, .max_model_len = 256,
                               .has_expert = ep.has_expert};
    if (pd_engine_open(&en, &o, &e)) {
        fprintf(stderr, "bench ep (rank %d): %s\n", rank, e.msg);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    pd_ep_attach(&ep, &en);
    ep.sync_before_combine = 1;
    const int H = (int)m.hidden_size, k = m.n_experts_per_tok, E = m.n_routed_experts;
    const int layer = m.num_hash_layers < m.n_layers ? m.num_hash_layers : 0, reps = quick ? 5 : 30;
    if (rank == 0 && json)
        printf("{\"ranks\": %d, \"threads\": %d, \"layer\": %d, \"top_k\": %d, \"experts\": %d, \"hidden\": %d, "
               "\"reps\": %d, \"cases\": [", size, threads, layer, k, E, H, reps);
    else if (rank == 0) {
        printf("pdmoe bench ep: %s, %d rank%s, %d thread%s each, layer %d (top-%d of %d experts, hidden %d), "
               "median (min) of %d\n", dir, size, size > 1 ? "s" : "", threads, threads > 1 ? "s" : "", layer, k, E, H,
               reps);
        printf("  %6s %10s %22s %22s %10s %10s %16s %10s\n", "tokens", "bytes out", "exchange", "raw Alltoallv",
               "raw peers", "raw bf16", "ratio", "experts");
    }
    uint64_t seed = 42 + (uint64_t)rank;
    for (int T = 1; T <= (quick ? 16 : 256); T *= 4) {
        float *x = malloc((size_t)T * H * 4), *y = malloc((size_t)T * k * H * 4), *s = malloc((size_t)T * 4);
        int8_t *q = malloc((size_t)T * H);
        int32_t *ids = malloc((size_t)T * k * 4);
        for (size_t i = 0; i < (size_t)T * H; i++)
            x[i] = (float)((int)(i * 2654435761u % 2001) - 1000) / 1000.0f;
        pd_quant_rows(x, T, H, q, s);
        pd_qmat a = {.q = q, .scale = s, .rows = T, .cols = H};
        double *tx = calloc((size_t)reps, sizeof *tx), *tt = calloc((size_t)reps, sizeof *tt);
        int64_t sent = 0;
        for (int i = 0; i < reps; i++) {
            route(ids, T, k, E, &seed);
            MPI_Barrier(MPI_COMM_WORLD);
            double x0 = ep.t_exchange, t0 = pd_now_s();
            int64_t b0 = ep.bytes_sent;
            if (en.experts_fn(en.experts_ctx, &en, layer, &a, ids, T, y, &e)) {
                fprintf(stderr, "bench ep (rank %d): %s\n", rank, e.msg);
                MPI_Abort(MPI_COMM_WORLD, 1);
            }
            tt[i] = pd_now_s() - t0;
            tx[i] = ep.t_exchange - x0;
            sent = ep.bytes_sent - b0;
        }
        /* each rank's median and minimum; the group's figure is the slowest rank's */
        double ex = median(tx, reps), total = median(tt, reps), v[8], g[8];
        v[0] = ex;
        v[1] = tx[0];
        v[2] = total - ex;
        v[3] = raw_alltoallv(&ep, reps, 0, 0, &v[4]);
        v[5] = raw_alltoallv(&ep, reps, 0, 1, &v[6]);
        v[7] = raw_alltoallv(&ep, reps, 1, 0, &(double){0});
        MPI_Reduce(v, g, 8, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        double ratio = g[3] > 0 ? g[0] / g[3] : 0, ratio_min = g[4] > 0 ? g[1] / g[4] : 0;
        double ratio_peers = g[5] > 0 ? g[0] / g[5] : 0, ratio_peers_min = g[6] > 0 ? g[1] / g[6] : 0;
        if (rank == 0 && json)
            printf("%s{\"tokens_per_rank\": %d, \"bytes_out_per_rank\": %lld, \"exchange_us\": %.3f, "
                   "\"exchange_min_us\": %.3f, \"raw_alltoallv_us\": %.3f, \"raw_alltoallv_min_us\": %.3f, "
                   "\"raw_peers_us\": %.3f, \"raw_peers_min_us\": %.3f, \"raw_bf16_us\": %.3f, \"experts_us\": %.3f, "
                   "\"ratio\": %.3f, \"ratio_min\": %.3f, \"ratio_peers\": %.3f, \"ratio_peers_min\": %.3f}",
                   T > 1 ? ", " : "", T, (long long)sent, g[0] * 1e6, g[1] * 1e6, g[3] * 1e6, g[4] * 1e6, g[5] * 1e6,
                   g[6] * 1e6, g[7] * 1e6, g[2] * 1e6, ratio, ratio_min, ratio_peers, ratio_peers_min);
        else if (rank == 0)
            printf("  %6d %10lld %9.1f (%6.1f) us %9.1f (%6.1f) us %7.1f us %7.1f us %7.2fx (%5.2fx) %7.0f us\n", T,
                   (long long)sent, g[0] * 1e6, g[1] * 1e6, g[3] * 1e6, g[4] * 1e6, g[5] * 1e6, g[7] * 1e6, ratio,
                   ratio_min, g[2] * 1e6);
        free(x);
        free(y);
        free(s);
        free(q);
        free(ids);
        free(tx);
        free(tt);
    }
    /* decode: 16 sequences in all, spread over the ranks */
    ep.sync_before_combine = 0;
    const int total = 16, steps = quick ? 4 : 24, prompt = 32, V = (int)m.vocab_size;
    int mine = total / size + (rank < total % size);
    struct pd_seq *sq = calloc((size_t)mine + 1, sizeof *sq);
    struct pd_step_item *it = calloc((size_t)mine + 1, sizeof *it);
    float *l = malloc((size_t)(mine + 1) * V * 4);
    int32_t ids[32], *next = calloc((size_t)mine + 1, sizeof *next);
    for (int i = 0; i < prompt; i++)
        ids[i] = (i * 131 + 7) % 1000;
    for (int i = 0; i < mine; i++) {
        pd_seq_start(&en, &sq[i], &e);
        it[i] = (struct pd_step_item){.seq = &sq[i], .tokens = ids, .n = prompt, .logits = l + (size_t)i * V};
    }
    pd_engine_step(&en, it, mine, &e);
    struct pd_sampler sm;
    pd_sampler_init(&sm, 0, 1, 0);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = pd_now_s();
    for (int s = 0; s < steps; s++) {
        for (int i = 0; i < mine; i++) {
            next[i] = pd_sample(&sm, l + (size_t)i * V, V, NULL);
            it[i] = (struct pd_step_item){.seq = &sq[i], .tokens = &next[i], .n = 1, .logits = l + (size_t)i * V};
        }
        if (pd_engine_step(&en, it, mine, &e)) {
            fprintf(stderr, "bench ep (rank %d): %s\n", rank, e.msg);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
    }
    MPI_Barrier(MPI_COMM_WORLD);
    double dt = pd_now_s() - t0;
    if (rank == 0 && json)
        printf("], \"decode_sequences\": %d, \"decode_steps\": %d, \"decode_tokens_per_s\": %.1f}", total, steps,
               total * steps / dt);
    else if (rank == 0)
        printf("  decode, %d sequences over %d rank%s: %.1f tokens/s (%d steps)\n", total, size, size > 1 ? "s" : "",
               total * steps / dt, steps);
    fflush(stdout);
    for (int i = 0; i < mine; i++)
        pd_seq_end(&en, &sq[i]);
    free(sq);
    free(it);
    free(l);
    free(next);
    pd_engine_close(&en);
    pd_ep_free(&ep);
    MPI_Finalize();
    return 0;
}

int pd_bench_ep(int argc, char **argv)
{
    static const struct option opts[] = {
        {"ranks", 1, 0, 'r'}, {"model", 1, 0, 'm'}, {"quick", 0, 0, 'q'}, {"worker", 0, 0, 'w'},
        {"json", 0, 0, 'j'}, {0, 0, 0, 0},
    };
    const char *ranks = "1,2,4", *dir = "models/mini";
    int quick = 0, is_worker = 0, json = 0, c;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":", opts, NULL)) != -1) {
        if (c == 'r')
            ranks = optarg;
        else if (c == 'm')
            dir = optarg;
        else if (c == 'q')
            quick = 1;
        else if (c == 'w')
            is_worker = 1;
        else if (c == 'j')
            json = 1;
        else
            return pd_cli_bad_flag("bench ep", c, argc, argv);
    }
    if (is_worker)
        return worker(dir, quick, json);
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) {
        fprintf(stderr, "bench ep: cannot find this program's path\n");
        return 1;
    }
    self[n] = 0;
    char buf[64];
    snprintf(buf, sizeof buf, "%s", ranks);
    int rc = 0, groups = 0;
    if (json) {
        printf("{\"bench\": \"ep\", \"model\": \"");
        for (const char *ch = dir; *ch; ch++)
            printf((unsigned char)*ch < 0x20 ? "\\u%04x" : *ch == '"' || *ch == '\\' ? "\\%c" : "%c", *ch);
        printf("\", \"groups\": [");
    }
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t && !rc; t = strtok_r(NULL, ",", &save)) {
        int r = atoi(t);
        if (r < 1 || r > 64) {
            fprintf(stderr, "bench ep: --ranks %s: each between 1 and 64\n", ranks);
            return 2;
        }
        char cmd[8192];
        snprintf(cmd, sizeof cmd,
                 "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -n %d --oversubscribe '%s' bench ep "
                 "--worker --model '%s'%s%s", r, self, dir, quick ? " --quick" : "", json ? " --json" : "");
        if (json && groups++)
            printf(", ");
        fflush(stdout);
        rc = system(cmd) != 0;
    }
    if (json)
        printf("]}\n");
    return rc;
}

/* `pdmoe convert`: DeepSeek's released checkpoint (FP8/FP4) to the engine's W8A8 layout. */
#include "cli/cli.h"
#include "core/timing.h"
#include "engine/convert.h"

#include <getopt.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

struct bar {
    int tty;
    int last_shard;
    double t0;
};

/* A bar redrawn in place on a terminal; one line per shard otherwise. */
static void progress(void *ctx, const struct pd_convert_progress *p)
{
    struct bar *b = ctx;
    double frac = p->total ? (double)p->done / (double)p->total : 1;
    double el = pd_now_s() - b->t0;
    if (b->tty) {
        char fill[41];
        int k = (int)(frac * 40);
        for (int i = 0; i < 40; i++)
            fill[i] = i < k ? '#' : '.';
        fill[40] = 0;
        fprintf(stderr, "\r[%s] %5.1f%%  shard %d/%d %s%s  %.2f GB  %.1f s ", fill, 100 * frac, p->shard + 1, p->nshards,
                p->file, p->skipped ? " (done before, verified)" : "", (double)p->done / 1e9, el);
        fflush(stderr);
    } else if (p->shard != b->last_shard || p->skipped) {
        if (p->shard != b->last_shard && b->last_shard >= 0)
            fprintf(stderr, "pdmoe convert: shard %d/%d done\n", b->last_shard + 1, p->nshards);
        if (p->skipped)
            fprintf(stderr, "pdmoe convert: shard %d/%d %s: converted by an earlier run, verified, kept\n", p->shard + 1,
                    p->nshards, p->file);
        else
            fprintf(stderr, "pdmoe convert: shard %d/%d %s ...\n", p->shard + 1, p->nshards, p->file);
    }
    b->last_shard = p->skipped ? -1 : p->shard;
}

int pd_cli_convert(int argc, char **argv)
{
    static const struct option opts[] = {
        {"checkpoint", 1, 0, 'c'}, {"quantization", 1, 0, 'q'}, {"out", 1, 0, 'o'}, {"help", 0, 0, 'h'}, {0, 0, 0, 0},
    };
    const char *in = NULL, *out = NULL, *quant = NULL;
    int c;
    struct pd_cli_seen seen = {0};
    optind = 1;
    opterr = 0;
    while ((c = pd_cli_getopt("convert", argc, argv, opts, NULL, NULL, &seen)) != -1) {
        switch (c) {
        case 'c': in = optarg; break;
        case 'o': out = optarg; break;
        case 'q': quant = optarg; break;
        case 'h':
            printf("usage: pdmoe convert --checkpoint DIR --quantization w8a8 --out DIR2\n"
                   "Converts DeepSeek's released checkpoint (FP8 e4m3 matrices with ue8m0 [128, 128] block scales,\n"
                   "FP4 e2m1 routed experts with a ue8m0 scale per 1 x 32) into the engine's W8A8 layout: the\n"
                   "matrices a W8A8 deployment quantises (wq_b, wo_b, the indexer's wq_b, experts, MTP projections,\n"
                   "as vLLM-Ascend's DeepSeek-V4 W8A8 rules list them) int8 with one fp32 scale per output row, the\n"
                   "other FP8 matrices (wq_a, wkv, wo_a) bf16 with their exact values; other tensors copied. Shard by shard in bounded\n"
                   "memory; every output tensor is read back and checked against its source; run again after an\n"
                   "interruption and completed shards are verified and kept. Prints the peak resident memory.\n");
            return 0;
        default:
            return pd_cli_bad_flag("convert", c, argc, argv);
        }
    }
    if (pd_cli_no_args("convert", argc, argv))
        return 2;
    if (!in || !out || !quant) {
        fprintf(stderr, "pdmoe convert: --checkpoint DIR, --quantization w8a8 and --out DIR2 are required\n");
        return 2;
    }
    if (strcmp(quant, "w8a8") != 0) {
        fprintf(stderr, "pdmoe convert: --quantization \"%s\": only w8a8 (what the engine runs) is implemented\n", quant);
        return 2;
    }
    struct bar b = {.tty = isatty(2), .last_shard = -1, .t0 = pd_now_s()};
    struct pd_convert_opts o = {.in_dir = in, .out_dir = out, .progress = progress, .ctx = &b};
    struct pd_convert_stats st;
    pd_err e = {0};
    int rc = pd_convert(&o, &st, &e);
    if (b.tty)
        fputc('\n', stderr);
    else if (!rc && b.last_shard >= 0)
        fprintf(stderr, "pdmoe convert: shard %d/%d done\n", b.last_shard + 1, b.last_shard + 1);
    if (rc) {
        fprintf(stderr, "pdmoe convert: %s\n", e.msg);
        return 1;
    }
    double el = pd_now_s() - b.t0;
    /* VmHWM: this process's own peak since exec (getrusage's ru_maxrss can carry the peak of
     * the process that started it across exec) */
    double hwm_kib = -1;
    FILE *sf = fopen("/proc/self/status", "r");
    char line[256];
    while (sf && fgets(line, sizeof line, sf))
        if (sscanf(line, "VmHWM: %lf kB", &hwm_kib) == 1)
            break;
    if (sf)
        fclose(sf);
    if (hwm_kib < 0) {
        struct rusage ru;
        getrusage(RUSAGE_SELF, &ru);
        hwm_kib = (double)ru.ru_maxrss;
    }
    fprintf(stderr,
            "pdmoe convert: wrote %s: %d shards (%d converted, %d kept from an earlier run), %lld tensors, %lld matrices "
            "to int8, %lld to bf16, %.3f GB read, %.3f GB written in %.1f s (%.3f GB/s); max row error %.4f of the row's max |w|; "
            "peak RSS %.1f MiB\n",
            out, st.shards, st.converted, st.skipped, (long long)st.tensors, (long long)st.matrices, (long long)st.bf16, st.in_bytes / 1e9,
            st.out_bytes / 1e9, el, el > 0 ? st.in_bytes / 1e9 / el : 0, st.max_rel_err, hwm_kib / 1024.0);
    return 0;
}

/* `pdmoe bench convert [--checkpoint DIR | --preset P] [--quick] [--json]`: `pdmoe convert` of a
 * release-format checkpoint against this machine's copy bandwidth measured in the same run, its
 * peak resident memory, and the measured choice of how FP4 routed-expert blocks become int8.
 *
 * 1. Copy bandwidth: memcpy of a 256 MiB buffer (64 MiB with --quick), best of 3; GB/s counts
 *    the bytes copied (each read once and written once), GB = 10^9.
 * 2. The converter runs as a child process (this binary's `convert`), so its peak RSS (VmHWM,
 *    which it reports) is its own, not the generator's; GB/s = source bytes / wall seconds; the
 *    ratio to the copy bandwidth is the verdict (conversion reads, decodes, quantizes, writes,
 *    then reads back and verifies every tensor: a ratio well below 1 is expected).
 * 3. FP4 -> int8 options on every routed expert's w1/w3/w2 of the checkpoint (up to 48
 *    matrices): int8 with one scale per output row (what the engine's kernels run), and int8
 *    with one scale per 1 x 32 group (the source's own blocks, which would need group-scaled
 *    kernels). Each against the dequantized fp32 weights W (cosine, and max |W' - W| / max |W|
 *    over each row) and against fp32 products y = W x on activations x taken from the
 *    checkpoint itself: rows of its embedding table for w1/w3 (the hidden size), and
 *    silu(w1 x) * (w3 x) of those for w2 (cosine of y, max |y' - y| / max |y|). Not activations
 *    captured inside the engine at that layer; the embedding rows are the model's own vectors. */
#include "bench/bench.h"
#include "core/timing.h"
#include "engine/genmodel.h"
#include "engine/release.h"
#include "kernels/ops.h"
#include "kernels/quant.h"
#include "kernels/vec.h"
#include "model/safetensors.h"

#include <dirent.h>
#include <limits.h>
#include <sys/stat.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

static double copy_bandwidth(size_t bytes)
{
    char *a = malloc(bytes), *b = malloc(bytes);
    if (!a || !b) {
        free(a);
        free(b);
        return 0;
    }
    memset(a, 1, bytes);
    memset(b, 2, bytes);
    double best = 1e30;
    for (int r = 0; r < 3; r++) {
        double t0 = pd_now_s();
        memcpy(b, a, bytes);
        double t = pd_now_s() - t0;
        best = t < best ? t : best;
        a[r] = b[bytes - 1 - r];   /* keep the copies observable */
    }
    free(a);
    free(b);
    return (double)bytes / best;
}

/* Error statistics of an approximation a of b (n values). */
struct errs {
    double cos_min, rel_max;
};

static void acc_rows(struct errs *s, const float *a, const float *b, int rows, int cols)
{
    for (int r = 0; r < rows; r++) {
        double ab = 0, aa = 0, bb = 0, amax = 0, d = 0;
        for (int c = 0; c < cols; c++) {
            double x = a[(size_t)r * cols + c], y = b[(size_t)r * cols + c];
            ab += x * y;
            aa += x * x;
            bb += y * y;
            amax = fmax(amax, fabs(y));
            d = fmax(d, fabs(x - y));
        }
        if (bb > 0) {
            double cs = aa > 0 ? ab / sqrt(aa * bb) : 0;
            s->cos_min = fmin(s->cos_min, cs);
            s->rel_max = fmax(s->rel_max, d / amax);
        }
    }
}

/* W' of option k: 0 = int8 per output row, 1 = int8 per 1 x 32 group */
static void option(int k, const float *w, int out, int in, float *wq)
{
    int8_t *q = malloc((size_t)in);
    for (int r = 0; r < out; r++) {
        const float *row = w + (size_t)r * in;
        float *dst = wq + (size_t)r * in;
        int g = k == 0 ? in : PD_RELEASE_FP4_BLOCK;
        for (int c0 = 0; c0 < in; c0 += g) {
            int len = c0 + g < in ? g : in - c0;
            float s;
            pd_quant_weights(row + c0, 1, len, q, &s);
            for (int c = 0; c < len; c++)
                dst[c0 + c] = (float)q[c] * s;
        }
    }
    free(q);
}

/* y [T, out] = x [T, in] W^T */
static void matmul(const float *w, int out, int in, const float *x, int T, float *y)
{
    for (int t = 0; t < T; t++)
        for (int o = 0; o < out; o++)
            y[(size_t)t * out + o] = pd_dot(w + (size_t)o * in, x + (size_t)t * in, in);
}

static int decode(const struct pd_st_set *st, const char *name, int out, int in, float *w)
{
    struct pd_release_mat m;
    pd_err e = {0};
    if (pd_release_find(st, name, out, in, &m, &e) || m.fmt != PD_RELEASE_FP4)
        return -1;
    for (int r = 0; r < out; r++)
        pd_release_decode_row(m.fmt, m.w->data, m.s->data, out, in, r, w + (size_t)r * in);
    return 0;
}

static int fp4_options(const char *dir, json_t *js, int print)
{
    struct pd_st_set st;
    pd_err e = {0};
    if (pd_st_open_dir(dir, 0, &st, &e)) {
        fprintf(stderr, "pdmoe bench convert: %s\n", e.msg);
        return -1;
    }
    const struct pd_st_tensor *emb = pd_st_set_find(&st, "embed.weight");
    if (!emb || emb->dtype != PD_ST_BF16 || emb->ndim != 2) {
        fprintf(stderr, "pdmoe bench convert: %s: no bf16 embed.weight for activations\n", dir);
        pd_st_close_dir(&st);
        return -1;
    }
    const int H = (int)emb->shape[1], T = 16;
    float *x = malloc((size_t)T * H * 4);
    for (int t = 0; t < T; t++)
        pd_bf16_row((const uint16_t *)emb->data + (size_t)((t * 977 + 31) % emb->shape[0]) * H, x + (size_t)t * H, (size_t)H);
    struct errs we[2] = {{1, 0}, {1, 0}}, ye[2] = {{1, 0}, {1, 0}};
    int nmat = 0;
    char n1[128], n2[128], n3[128];
    for (int l = 0; l < 256 && nmat < 48; l++)
        for (int x_ = 0; x_ < 4 && nmat < 48; x_++) {
            snprintf(n1, sizeof n1, "layers.%d.ffn.experts.%d.w1.weight", l, x_ * 5);
            snprintf(n2, sizeof n2, "layers.%d.ffn.experts.%d.w2.weight", l, x_ * 5);
            snprintf(n3, sizeof n3, "layers.%d.ffn.experts.%d.w3.weight", l, x_ * 5);
            const struct pd_st_tensor *t1 = pd_st_set_find(&st, n1);
            if (!t1 || t1->ndim != 2)
                continue;
            int I = (int)t1->shape[0];
            float *w1 = malloc((size_t)I * H * 4), *w3 = malloc((size_t)I * H * 4), *w2 = malloc((size_t)H * I * 4);
            float *wq = malloc((size_t)I * H * 4), *y = malloc((size_t)T * (I > H ? I : H) * 4);
            float *yq = malloc((size_t)T * (I > H ? I : H) * 4), *h = malloc((size_t)T * I * 4), *g = malloc((size_t)T * I * 4);
            if (decode(&st, n1, I, H, w1) || decode(&st, n3, I, H, w3) || decode(&st, n2, H, I, w2)) {
                free(w1), free(w3), free(w2), free(wq), free(y), free(yq), free(h), free(g);
                continue;
            }
            /* the expert's hidden activations: silu(w1 x) * (w3 x) */
            matmul(w1, I, H, x, T, h);
            matmul(w3, I, H, x, T, g);
            for (size_t i = 0; i < (size_t)T * I; i++)
                h[i] = h[i] / (1 + expf(-h[i])) * g[i];
            const float *ws[3] = {w1, w3, w2};
            const int outs[3] = {I, I, H}, ins[3] = {H, H, I};
            for (int m = 0; m < 3; m++) {
                const float *xin = m < 2 ? x : h;
                matmul(ws[m], outs[m], ins[m], xin, T, y);
                for (int k = 0; k < 2; k++) {
                    option(k, ws[m], outs[m], ins[m], wq);
                    acc_rows(&we[k], wq, ws[m], outs[m], ins[m]);
                    matmul(wq, outs[m], ins[m], xin, T, yq);
                    acc_rows(&ye[k], yq, y, T, outs[m]);
                }
                nmat++;
            }
            free(w1), free(w3), free(w2), free(wq), free(y), free(yq), free(h), free(g);
        }
    free(x);
    pd_st_close_dir(&st);
    static const char *const oname[2] = {"int8 per output row", "int8 per 1x32 group"};
    if (print) {
        printf("FP4 routed-expert blocks -> int8, %d matrices of %s (worst row / token):\n", nmat, dir);
        printf("  %-22s %12s %14s %12s %14s\n", "option", "W cos min", "W max rel err", "Wx cos min", "Wx max rel err");
        for (int k = 0; k < 2; k++)
            printf("  %-22s %12.6f %14.5f %12.6f %14.5f\n", oname[k], we[k].cos_min, we[k].rel_max, ye[k].cos_min,
                   ye[k].rel_max);
    }
    json_t *arr = json_array();
    for (int k = 0; k < 2; k++)
        json_array_append_new(arr, json_pack("{s:s, s:f, s:f, s:f, s:f}", "option", oname[k], "weights_cosine_min",
                                             we[k].cos_min, "weights_max_rel_err", we[k].rel_max, "matmul_cosine_min",
                                             ye[k].cos_min, "matmul_max_rel_err", ye[k].rel_max));
    json_object_set_new(js, "fp4_to_int8", arr);
    json_object_set_new(js, "fp4_matrices", json_integer(nmat));
    return nmat > 0 ? 0 : -1;
}

/* Removes a flat directory this benchmark made (checkpoint files, no subdirectories). */
static void rm_flat(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *de;
    char p[600];
    while ((de = readdir(d)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) {
            snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
            unlink(p);
        }
    closedir(d);
    rmdir(dir);
}

/* The bytes of a checkpoint directory's regular files (links followed: its shards may be links
 * into a cache). Read here, not by a shell: a `du '%s'` once ran whatever a quote in the path
 * closed and opened. */
static long dir_bytes(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    long n = 0;
    char p[PATH_MAX];
    for (struct dirent *de; (de = readdir(d));) {
        struct stat sb;
        if (snprintf(p, sizeof p, "%s/%s", dir, de->d_name) < (int)sizeof p && stat(p, &sb) == 0 &&
            S_ISREG(sb.st_mode))
            n += (long)sb.st_size;
    }
    closedir(d);
    return n;
}

/* SIGINT or SIGTERM to the bench: its converter is stopped and its output removed (they were
 * left running and on disk, gigabytes for the default model). No SA_RESTART: the wait returns. */
static volatile sig_atomic_t interrupted;
static void on_interrupt(int sig)
{
    interrupted = sig;
}

int pd_bench_convert(int argc, char **argv)
{
    const char *ckpt = NULL, *preset = NULL;
    int quick = 0, as_json = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            quick = 1;
        else if (!strcmp(argv[i], "--json"))
            as_json = 1;
        else if (!strcmp(argv[i], "--checkpoint") && i + 1 < argc)
            ckpt = argv[++i];
        else if (!strcmp(argv[i], "--preset") && i + 1 < argc)
            preset = argv[++i];
        else {
            fprintf(stderr, "pdmoe bench convert: unknown or incomplete flag \"%s\"\n", argv[i]);
            return 2;
        }
    }
    if (ckpt && preset) {
        fprintf(stderr, "pdmoe bench convert: --checkpoint and --preset exclude each other\n");
        return 2;
    }
    char gen[64] = "", out[64];
    pd_err e = {0};
    int rc = 1;
    json_t *js = json_object();
    if (!ckpt) {
        if (!preset)
            preset = quick ? "v4-tiny" : "v4-flash-mini";
        snprintf(gen, sizeof gen, "/tmp/pdmoe-bench-release-XXXXXX");
        if (!mkdtemp(gen) || pd_genmodel_fmt(preset, gen, 1, PD_GEN_RELEASE, &e)) {
            fprintf(stderr, "pdmoe bench convert: %s\n", e.msg[0] ? e.msg : strerror(errno));
            return 1;
        }
        ckpt = gen;
    }
    snprintf(out, sizeof out, "/tmp/pdmoe-bench-converted-XXXXXX");
    if (!mkdtemp(out)) {
        out[0] = 0;
        fprintf(stderr, "pdmoe bench convert: mkdtemp: %s\n", strerror(errno));
        goto done;
    }
    double bw = copy_bandwidth((size_t)(quick ? 64 : 256) << 20);
    char self[4096];
    ssize_t sl = readlink("/proc/self/exe", self, sizeof self - 1);
    if (sl <= 0) {
        fprintf(stderr, "pdmoe bench convert: cannot find this program: %s\n", strerror(errno));
        goto done;
    }
    self[sl] = 0;
    char *cargv[] = {self, "convert", "--checkpoint", (char *)ckpt, "--quantization", "w8a8", "--out", out, NULL};
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    char logf[64];
    snprintf(logf, sizeof logf, "/tmp/pdmoe-bench-convert-%d.log", (int)getpid());
    posix_spawn_file_actions_addopen(&fa, 2, logf, O_WRONLY | O_CREAT | O_TRUNC, 0644);   /* its report */
    pid_t pid;
    double t0 = pd_now_s();
    int sp = posix_spawn(&pid, self, &fa, NULL, cargv, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (sp) {
        fprintf(stderr, "pdmoe bench convert: cannot start %s convert: %s\n", self, strerror(sp));
        goto done;
    }
    struct sigaction sa = {.sa_handler = on_interrupt}, old_int, old_term;
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    int status = 0;
    pid_t w;
    while ((w = waitpid(pid, &status, 0)) < 0 && errno == EINTR)
        if (interrupted)
            kill(pid, SIGTERM);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    if (interrupted) {
        unlink(logf);
        fprintf(stderr, "pdmoe bench convert: interrupted; the conversion is stopped and its output removed\n");
        rc = 128 + interrupted;
        goto done;
    }
    if (w != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        /* the converter's own words: they were in a log this message did not name, then left in /tmp */
        char why[1024] = "";
        FILE *lg = fopen(logf, "r");
        for (char ln[1024]; lg && fgets(ln, sizeof ln, lg);)
            if (strstr(ln, "pdmoe convert:"))
                snprintf(why, sizeof why, "%s", ln);
        if (lg)
            fclose(lg);
        unlink(logf);
        fprintf(stderr, "pdmoe bench convert: the conversion of %s failed%s%s", ckpt, why[0] ? ": " : "\n", why);
        goto done;
    }
    double secs = pd_now_s() - t0;
    /* the converter's own peak (VmHWM since its exec), from its report line */
    double rss = -1;
    FILE *lf = fopen(logf, "r");
    char line[1024];
    while (lf && fgets(line, sizeof line, lf)) {
        const char *p = strstr(line, "peak RSS ");
        if (p)
            rss = atof(p + 9);
    }
    if (lf)
        fclose(lf);
    unlink(logf);
    if (rss < 0) {
        fprintf(stderr, "pdmoe bench convert: the converter did not report its peak RSS\n");
        goto done;
    }
    long in_bytes = dir_bytes(ckpt), out_bytes = dir_bytes(out);
    double gbs = in_bytes / secs / 1e9;
    if (!as_json) {
        printf("pdmoe bench convert: %s (%.3f GB) -> W8A8 (%.3f GB)\n", ckpt, in_bytes / 1e9, out_bytes / 1e9);
        printf("  copy bandwidth (memcpy, this run)   %8.2f GB/s\n", bw / 1e9);
        printf("  convert                             %8.3f GB/s  = %.3f of copy bandwidth  (%.2f s)\n", gbs,
               gbs * 1e9 / bw, secs);
        printf("  peak RSS of the converter           %8.1f MiB  = %.4f of the checkpoint's bytes\n", rss,
               rss * 1048576.0 / (double)in_bytes);
    }
    json_object_set_new(js, "checkpoint", json_string(ckpt));
    json_object_set_new(js, "checkpoint_bytes", json_integer(in_bytes));
    json_object_set_new(js, "output_bytes", json_integer(out_bytes));
    json_object_set_new(js, "copy_gb_per_s", json_real(bw / 1e9));
    json_object_set_new(js, "convert_gb_per_s", json_real(gbs));
    json_object_set_new(js, "convert_over_copy", json_real(gbs * 1e9 / bw));
    json_object_set_new(js, "seconds", json_real(secs));
    json_object_set_new(js, "peak_rss_mib", json_real(rss));
    if (fp4_options(ckpt, js, !as_json))
        goto done;
    if (as_json) {
        char *s = json_dumps(js, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        printf("%s\n", s);
        free(s);
    }
    rc = 0;
done:
    json_decref(js);
    if (out[0])
        rm_flat(out);
    if (gen[0])
        rm_flat(gen);
    return rc;
}

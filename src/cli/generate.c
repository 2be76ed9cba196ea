/* `pdmoe generate`: run prompts through the engine. One prompt in one process streams its
 * continuation; several prompts, or --enable-expert-parallel under mpirun, run as a batch in
 * lockstep (prompt i on rank i mod N) and rank 0 prints each result in prompt order. */
#include "core/file.h"
#include "cli/cli.h"
#include "core/hash.h"
#include "core/timing.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "engine/spec.h"
#include "ep/ep.h"
#include "model/tokenizer.h"

#include <limits.h>
#include <getopt.h>
#include <jansson.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_PROMPTS 64

struct gen_opts {
    const char *dir;
    const char *prompt[MAX_PROMPTS];
    int n_prompts;
    int64_t max_tokens, seed, threads;
    double temperature, top_p;
    int ep, print_ids, report_weights;
    const char *expert_stats;
    enum pd_kv_dtype kv_dtype;
    int spec_k;                  /* --speculative-config: MTP drafts per step, 0: off */
    const char *spec_stats;      /* --spec-stats FILE: the acceptance counters as JSON (plan/mtp.h) */
};

/* One sequence of the batch on this rank. */
struct gen_seq {
    int prompt;                  /* index of its prompt */
    int32_t *in;                 /* prompt ids (BOS first) */
    int n_in;
    struct pd_seq seq;
    struct pd_spec_seq spec;     /* with --speculative-config */
    int32_t out[4096];           /* generated ids */
    int n_out;
    int done;
    uint64_t digest;             /* FNV-1a of every logits vector a token was sampled from */
    float *logits;
};

static int parse(int argc, char **argv, struct gen_opts *o)
{
    static const struct option opts[] = {
        {"model", 1, 0, 'm'}, {"prompt", 1, 0, 'p'}, {"max-tokens", 1, 0, 'n'}, {"temperature", 1, 0, 't'},
        {"top-p", 1, 0, 'P'}, {"seed", 1, 0, 's'}, {"threads", 1, 0, 'j'},
        {"enable-expert-parallel", 0, 0, 'E'}, {"print-ids", 0, 0, 'I'}, {"report-weights", 0, 0, 'W'},
        {"expert-stats", 1, 0, 'S'}, {"kv-cache-dtype", 1, 0, 'K'}, {"speculative-config", 1, 0, 'X'},
        {"spec-stats", 1, 0, 'A'}, {"help", 0, 0, 'h'}, {0, 0, 0, 0},
    };
    memset(o, 0, sizeof *o);
    o->max_tokens = 64;
    o->seed = 1;
    o->top_p = 1;
    int c;
    struct pd_cli_seen seen = {0};
    static const char *const prompts[] = {"prompt", NULL};   /* each one a sequence of the batch */
    optind = 1;
    opterr = 0;
    while ((c = pd_cli_getopt("generate", argc, argv, opts, NULL, prompts, &seen)) != -1) {
        switch (c) {
        case 'm': o->dir = optarg; break;
        case 'p':
            if (o->n_prompts == MAX_PROMPTS) {
                fprintf(stderr, "pdmoe generate: at most %d --prompt\n", MAX_PROMPTS);
                return 2;
            }
            o->prompt[o->n_prompts++] = optarg;
            break;
        case 'n': if (pd_cli_int("--max-tokens", optarg, 1, &o->max_tokens)) return 2; break;
        case 't': if (pd_cli_double("--temperature", optarg, &o->temperature)) return 2; break;
        case 'P': if (pd_cli_double("--top-p", optarg, &o->top_p)) return 2; break;
        case 's': if (pd_cli_int("--seed", optarg, 0, &o->seed)) return 2; break;
        case 'j': if (pd_cli_int("--threads", optarg, 1, &o->threads)) return 2; break;
        case 'E': o->ep = 1; break;
        case 'I': o->print_ids = 1; break;
        case 'W': o->report_weights = 1; break;
        case 'S': o->expert_stats = optarg; break;
        case 'K': if (pd_cli_kv_dtype("generate", optarg, &o->kv_dtype)) return 2; break;
        case 'A': o->spec_stats = optarg; break;
        case 'X': {
            pd_err e = {0};
            if (pd_spec_config_parse(optarg, &o->spec_k, &e)) {
                fprintf(stderr, "pdmoe generate: %s\n", e.msg);
                return 2;
            }
            break;
        }
        case 'h':
            printf("usage: pdmoe generate --model DIR --prompt TEXT [--prompt TEXT ...] [--max-tokens 64]\n"
                   "       [--temperature 0] [--top-p 1] [--seed 1] [--threads N]\n"
                   "       [--enable-expert-parallel] [--print-ids] [--report-weights] [--expert-stats FILE]\n"
                   "       [--kv-cache-dtype bf16|fp8] (the KV cache's entries: bf16, the default, or fp8 as\n"
                   "         DeepSeek-V4 is deployed: e4m3 non-rope values with a power-of-two scale per 64)\n"
                   "       [--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":K}'] (speculative\n"
                   "         decoding with the checkpoint's MTP layer, K = 1..%d drafts per step; the output is\n"
                   "         what plain decoding gives: the same ids at temperature 0, the same distribution above)\n"
                   "       [--spec-stats FILE] (with --speculative-config: the acceptance counters and the decode\n"
                   "         time as JSON, vLLM's spec_decode names; pdmoe plan --spec-stats FILE reads them)\n"
                   "Greedy at temperature 0. With one prompt in one process the text streams as it is\n"
                   "produced; otherwise the prompts run as one batch and each result is printed at the end.\n"
                   "Under mpirun with --enable-expert-parallel the ranks form an EP group: rank k holds\n"
                   "experts [k*E/N, (k+1)*E/N) of every MoE layer (the MTP layer's too), prompt i runs on\n"
                   "rank i mod N.\n", PD_SPEC_MAX_K);
            return 1;   /* done: pd_cli_generate exits 0 */
        default:
            return pd_cli_bad_flag("generate", c, argc, argv);
        }
    }
    if (pd_cli_no_args("generate", argc, argv))
        return 2;
    if (!o->dir || !o->n_prompts) {
        fprintf(stderr, "pdmoe generate: --model DIR and --prompt TEXT are required\n");
        return 2;
    }
    if (o->temperature < 0 || !(o->top_p > 0 && o->top_p <= 1)) {
        fprintf(stderr, "pdmoe generate: --temperature must be >= 0 and --top-p in (0, 1]\n");
        return 2;
    }
    if (o->spec_stats && !o->spec_k) {
        fprintf(stderr, "pdmoe generate: --spec-stats %s: needs --speculative-config (no drafts to count)\n",
                o->spec_stats);
        return 2;
    }
    if (o->max_tokens > 4096) {
        fprintf(stderr, "pdmoe generate: --max-tokens %lld: at most 4096\n", (long long)o->max_tokens);
        return 2;
    }
    return 0;
}

/* The batch: sequences of this rank, stepped together until every rank's are finished. */
struct batch {
    struct gen_opts *o;
    struct pd_engine en;
    struct pd_tok *tok;
    struct pd_ep ep;
    int use_mpi, rank, size;
    struct gen_seq *s;
    int n;
    int V, Vs;                  /* model vocabulary, tokenizer vocabulary (sampled ids stay below) */
    int32_t eos;
};

static int step_all(struct batch *b, int prefill, pd_err *e)
{
    struct pd_step_item *items = calloc((size_t)b->n + 1, sizeof *items);
    int32_t *next = calloc((size_t)b->n + 1, sizeof *next);
    int m = 0;
    for (int i = 0; i < b->n; i++) {
        struct gen_seq *g = &b->s[i];
        if (g->done)
            continue;
        if (prefill) {
            items[m++] = (struct pd_step_item){.seq = &g->seq, .tokens = g->in, .n = g->n_in, .logits = g->logits};
        } else {
            next[i] = g->out[g->n_out - 1];
            items[m++] = (struct pd_step_item){.seq = &g->seq, .tokens = &next[i], .n = 1, .logits = g->logits};
        }
    }
    int rc = pd_engine_step(&b->en, items, m, e);
    free(items);
    free(next);
    return rc;
}

/* Fault injection for the tests: PDMOE_FAULT_KILL_RANK=r and PDMOE_FAULT_KILL_STEP=s make rank r
 * die by SIGKILL before decode step s, as a crashed node would. */
static void maybe_die(const struct batch *b, int step)
{
    const char *r = getenv("PDMOE_FAULT_KILL_RANK"), *s = getenv("PDMOE_FAULT_KILL_STEP");
    if (r && s && atoi(r) == b->rank && atoi(s) == step)
        raise(SIGKILL);
}

static int run_batch(struct batch *b, pd_err *e)
{
    struct pd_sampler smp;
    pd_sampler_init(&smp, b->o->temperature, b->o->top_p, (uint64_t)b->o->seed + (uint64_t)b->rank);
    float *scratch = malloc((size_t)b->V * 2 * sizeof(float));
    int rc = step_all(b, 1, e), k = 0;
    double t1 = pd_now_s(), c1 = pd_cpu_s();      /* the prompts done: decode steps from here */
    for (; !rc; k++) {
        int active = 0;
        for (int i = 0; i < b->n; i++) {
            struct gen_seq *g = &b->s[i];
            if (g->done)
                continue;
            g->digest = pd_fnv1a64(g->digest, g->logits, (size_t)b->V * sizeof(float));
            int32_t t = pd_sample(&smp, g->logits, b->Vs, scratch);
            g->out[g->n_out++] = t;
            if (t == b->eos || g->n_out >= b->o->max_tokens)
                g->done = 1;
            else
                active++;
        }
        if (b->use_mpi) {
            MPI_Request req;
            MPI_Iallreduce(MPI_IN_PLACE, &active, 1, MPI_INT, MPI_SUM, b->ep.comm, &req);
            pd_ep_wait(&req);
        }
        if (!active)
            break;
        maybe_die(b, k);
        rc = step_all(b, 0, e);
    }
    if (!rc && b->rank == 0 && k > 0)   /* what tools/validation-mtp.sh reads as plain decoding's TPOT */
        fprintf(stderr, "decode: %d steps of the batch, %.3f ms per step (%.3f ms of CPU time)\n", k,
                (pd_now_s() - t1) * 1e3 / k, (pd_cpu_s() - c1) * 1e3 / k);
    free(scratch);
    return rc;
}

/* Appends a round's tokens to g, stopping at EOS or --max-tokens; streams them when `stream`. */
static void take(struct batch *b, struct gen_seq *g, const int32_t *t, const float *logits, int n, int stream)
{
    for (int j = 0; j < n && !g->done; j++) {
        g->digest = pd_fnv1a64(g->digest, logits + (size_t)j * b->V, (size_t)b->V * sizeof(float));
        g->out[g->n_out++] = t[j];
        if (t[j] == b->eos || g->n_out >= b->o->max_tokens)
            g->done = 1;
        if (stream && t[j] != b->eos) {
            size_t len;
            const char *bytes = pd_tok_token_bytes(b->tok, t[j], &len);
            if (bytes)
                fwrite(bytes, 1, len, stdout);
            fflush(stdout);
        }
    }
}

/* --spec-stats FILE: the counters as vLLM's spec_decode metrics name them (num_drafts,
 * num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos) with the drafts made at
 * each position (the per-position denominators), and the decode phase's time (wall and the
 * process's CPU time) and tokens. */
static int write_spec_stats(const struct batch *b, const struct pd_spec_stats *st, double decode_s, double cpu_s,
                            pd_err *e)
{
    json_t *drafted = json_array(), *accepted = json_array();
    int64_t tokens = 0;
    for (int j = 0; j < b->o->spec_k; j++) {
        json_array_append_new(drafted, json_integer(st->drafted_per_pos[j]));
        json_array_append_new(accepted, json_integer(st->accepted_per_pos[j]));
    }
    for (int i = 0; i < b->n; i++)
        tokens += b->s[i].n_out > 1 ? b->s[i].n_out - 1 : 0;
    json_t *j = json_pack("{s:s,s:i,s:I,s:I,s:I,s:o,s:o,s:I,s:I,s:i,s:f,s:f,s:I}", "method", "mtp",
                          "num_speculative_tokens", b->o->spec_k, "num_drafts", (json_int_t)st->drafts,
                          "num_draft_tokens", (json_int_t)st->draft_tokens, "num_accepted_tokens",
                          (json_int_t)st->accepted, "num_drafted_tokens_per_pos", drafted,
                          "num_accepted_tokens_per_pos", accepted, "steps", (json_int_t)st->steps,
                          "emitted_tokens", (json_int_t)st->emitted, "sequences", b->n, "decode_s", decode_s, "decode_cpu_s", cpu_s,
                          "decode_tokens", (json_int_t)tokens);
    int rc = !j || json_dump_file(j, b->o->spec_stats, JSON_INDENT(2)) ? PD_EIO : 0;
    json_decref(j);
    return rc ? pd_err_set(e, PD_EIO, "--spec-stats %s: cannot write", b->o->spec_stats) : 0;
}

/* Speculative decoding (engine/spec.h): the prompts in one step, then rounds of MTP drafts and
 * one verify step for every live sequence together. Prints the acceptance statistics. */
static int run_spec(struct batch *b, int stream, pd_err *e)
{
    struct pd_sampler smp;
    pd_sampler_init(&smp, b->o->temperature, b->o->top_p, (uint64_t)b->o->seed + (uint64_t)b->rank);
    struct pd_spec_stats st = {0};
    float *scratch = malloc((size_t)b->V * 2 * sizeof(float));
    float *rl = malloc((size_t)b->n * (PD_SPEC_MAX_K + 1) * b->V * sizeof(float));
    struct pd_spec_seq **ss = calloc((size_t)b->n + 1, sizeof *ss);
    const int32_t **pr = calloc((size_t)b->n + 1, sizeof *pr);
    int *pn = calloc((size_t)b->n + 1, sizeof *pn);
    float **lg = calloc((size_t)b->n + 1, sizeof *lg);
    int rc = 0;
    if (!scratch || !rl || !ss || !pr || !pn || !lg) {
        rc = pd_err_set(e, PD_ENOMEM, "out of memory");
        goto out;
    }
    double t0 = pd_now_s();
    for (int i = 0; i < b->n; i++) {
        struct gen_seq *g = &b->s[i];
        pd_spec_init(&g->spec, &g->seq, &smp);
        g->spec.out_logits = rl + (size_t)i * (PD_SPEC_MAX_K + 1) * b->V;
        ss[i] = &g->spec;
        pr[i] = g->in;
        pn[i] = g->n_in;
        lg[i] = g->logits;
    }
    if ((rc = pd_spec_prefill(&b->en, ss, pr, pn, lg, b->n, e)))
        goto out;
    for (int i = 0; i < b->n; i++) {
        struct gen_seq *g = &b->s[i];
        int32_t t = pd_sample(&smp, g->logits, b->Vs, scratch);
        take(b, g, &t, g->logits, 1, stream);
        if ((rc = pd_spec_push(&g->spec, t, e)))
            goto out;
    }
    double t1 = pd_now_s(), c1 = pd_cpu_s();
    for (;;) {
        int m = 0, kmax = 0;
        for (int i = 0; i < b->n; i++) {
            struct gen_seq *g = &b->s[i];
            if (g->done)
                continue;
            /* no drafts past --max-tokens: a round yields at most k + 1 */
            int left = (int)b->o->max_tokens - g->n_out;
            g->spec.k = b->o->spec_k < left - 1 ? b->o->spec_k : left - 1;
            kmax = g->spec.k > kmax ? g->spec.k : kmax;
            ss[m++] = &g->spec;
        }
        /* an EP group drafts as many steps as its longest draft and stops when every rank is done:
         * a rank without sequences still takes part in each step's expert exchanges */
        int group[2] = {m > 0, kmax};
        if (b->use_mpi) {
            MPI_Request req;
            MPI_Iallreduce(MPI_IN_PLACE, group, 2, MPI_INT, MPI_MAX, b->ep.comm, &req);
            pd_ep_wait(&req);
        }
        if (!group[0])
            break;
        if ((rc = pd_spec_round_steps(&b->en, ss, m, b->Vs, group[1], &st, e)))
            goto out;
        for (int i = 0; i < b->n; i++) {
            struct gen_seq *g = &b->s[i];
            if (!g->done)
                take(b, g, g->spec.out, g->spec.out_logits, g->spec.n_out, stream);
        }
    }
    double t2 = pd_now_s(), c2 = pd_cpu_s();
    if (stream) {
        printf("\n");
        const struct gen_seq *g = &b->s[0];
        fprintf(stderr, "prompt: %d tokens, %.1f tokens/s; decode: %d tokens after the prompt's first, %.1f tokens/s\n",
                g->n_in, g->n_in / (t1 - t0), g->n_out > 1 ? g->n_out - 1 : 0,
                g->n_out > 1 ? (g->n_out - 1) / (t2 - t1) : 0.0);
    }
    if (b->use_mpi) {
        /* the group's counts, summed on rank 0, which prints them */
        _Static_assert(sizeof st % sizeof(int64_t) == 0, "pd_spec_stats holds int64_t counts only");
        struct pd_spec_stats sum = {0};
        MPI_Reduce(&st, &sum, (int)(sizeof st / sizeof(int64_t)), MPI_INT64_T, MPI_SUM, 0, b->ep.comm);
        st = sum;
        if (b->rank)
            goto out;
    }
    fprintf(stderr, "speculative decoding (mtp, %d draft%s): acceptance per position", b->o->spec_k,
            b->o->spec_k > 1 ? "s" : "");
    for (int j = 0; j < b->o->spec_k; j++)
        fprintf(stderr, " %.3f", st.drafted_per_pos[j] ? (double)st.accepted_per_pos[j] / st.drafted_per_pos[j] : 0.0);
    fprintf(stderr, "; mean accepted length %.3f drafts; %.3f tokens per step (%lld steps)\n",
            st.drafts ? (double)st.accepted / st.drafts : 0.0, st.steps ? (double)st.emitted / st.steps : 0.0,
            (long long)st.steps);
    if (b->o->spec_stats)
        rc = write_spec_stats(b, &st, t2 - t1, c2 - c1, e);
out:
    for (int i = 0; i < b->n; i++)
        pd_spec_free(&b->s[i].spec);
    free(scratch);
    free(rl);
    free(ss);
    free(pr);
    free(pn);
    free(lg);
    return rc;
}

/* Rank 0 prints every sequence, in prompt order: [i] text, ids and logits digest. */
static void report(struct batch *b)
{
    /* per sequence: prompt, count, digest, ids */
    int64_t *mine = calloc((size_t)b->n * (3 + 4096) + 1, sizeof *mine);
    int len = 0;
    for (int i = 0; i < b->n; i++) {
        const struct gen_seq *g = &b->s[i];
        mine[len++] = g->prompt;
        mine[len++] = g->n_out;
        mine[len++] = (int64_t)g->digest;
        for (int j = 0; j < g->n_out; j++)
            mine[len++] = g->out[j];
    }
    int64_t *all = mine;
    int total = len;
    int *lens = NULL, *dsp = NULL;
    if (b->use_mpi) {
        lens = calloc((size_t)b->size, sizeof *lens);
        dsp = calloc((size_t)b->size, sizeof *dsp);
        MPI_Gather(&len, 1, MPI_INT, lens, 1, MPI_INT, 0, b->ep.comm);
        total = 0;
        for (int r = 0; r < b->size && b->rank == 0; r++) {
            dsp[r] = total;
            total += lens[r];
        }
        all = b->rank == 0 ? calloc((size_t)total + 1, sizeof *all) : NULL;
        MPI_Gatherv(mine, len, MPI_INT64_T, all, lens, dsp, MPI_INT64_T, 0, b->ep.comm);
    }
    if (b->rank == 0) {
        for (int want = 0; want < b->o->n_prompts; want++) {
            for (int at = 0; at < total;) {
                int prompt = (int)all[at], n = (int)all[at + 1];
                if (prompt == want) {
                    int32_t ids[4096];
                    for (int j = 0; j < n; j++)
                        ids[j] = (int32_t)all[at + 3 + j];
                    char *text = NULL;
                    size_t tl = 0;
                    printf("[%d] ", want);
                    if (pd_tok_decode(b->tok, ids, (size_t)n, &text, &tl) == 0) {
                        fwrite(text, 1, tl, stdout);
                        free(text);
                    }
                    printf("\n");
                    if (b->o->print_ids) {
                        printf("[%d] ids", want);
                        for (int j = 0; j < n; j++)
                            printf(" %d", ids[j]);
                        printf("\n[%d] logits-digest %016" PRIx64 "\n", want, (uint64_t)all[at + 2]);
                    }
                }
                at += 3 + n;
            }
        }
        fflush(stdout);
    }
    if (all != mine)
        free(all);
    free(mine);
    free(lens);
    free(dsp);
}

static void report_weights(struct batch *b)
{
    int64_t mine[2] = {b->en.w.loaded_bytes[0], b->en.w.loaded_bytes[1]}, all[2 * 256];
    if (b->use_mpi)
        MPI_Gather(mine, 2, MPI_INT64_T, all, 2, MPI_INT64_T, 0, b->ep.comm);
    else
        memcpy(all, mine, sizeof mine);
    for (int r = 0; r < b->size && b->rank == 0; r++)
        printf("rank %d weights: class I %" PRId64 " bytes, class II %" PRId64 " bytes\n", r, all[2 * r], all[2 * r + 1]);
}

static int write_stats(struct batch *b, pd_err *e)
{
    const struct pd_model *m = &b->en.model;
    size_t n = (size_t)m->n_layers * m->n_routed_experts;
    int64_t *sum = calloc(n, sizeof *sum);
    if (!sum)
        return pd_err_set(e, PD_ENOMEM, "out of memory");
    if (b->use_mpi)
        MPI_Reduce(b->en.expert_tokens, sum, (int)n, MPI_INT64_T, MPI_SUM, 0, b->ep.comm);
    else
        memcpy(sum, b->en.expert_tokens, n * sizeof *sum);
    int rc = 0;
    if (b->rank == 0) {
        FILE *f = fopen(b->o->expert_stats, "w");
        if (!f) {
            free(sum);
            return pd_err_set(e, PD_EIO, "--expert-stats %s: cannot create", b->o->expert_stats);
        }
        fprintf(f, "{\"model\": \"%s\", \"model_type\": \"%s\", \"ranks\": %d, \"experts\": %d, "
                "\"tokens_per_expert\": [\n", m->name, pd_model_arch_name(m->arch), b->size, m->n_routed_experts);
        for (int l = 0; l < m->n_layers; l++) {
            fprintf(f, "  [");
            for (int x = 0; x < m->n_routed_experts; x++)
                fprintf(f, "%s%" PRId64, x ? ", " : "", sum[(size_t)l * m->n_routed_experts + x]);
            fprintf(f, "]%s\n", l + 1 < m->n_layers ? "," : "");
        }
        fprintf(f, "]}\n");
        if (fclose(f))
            rc = pd_err_set(e, PD_EIO, "--expert-stats %s: write failed", b->o->expert_stats);
    }
    free(sum);
    return rc;
}

static int stream_one(struct gen_opts *o, struct batch *b, pd_err *e)
{
    struct gen_seq *g = &b->s[0];
    struct pd_sampler smp;
    pd_sampler_init(&smp, o->temperature, o->top_p, (uint64_t)o->seed);
    float *scratch = malloc((size_t)b->V * 2 * sizeof(float));
    double t0 = pd_now_s();
    struct pd_step_item it = {.seq = &g->seq, .tokens = g->in, .n = g->n_in, .logits = g->logits};
    int rc = pd_engine_step(&b->en, &it, 1, e);
    double t1 = pd_now_s();
    int produced = 0;
    for (; !rc && produced < o->max_tokens; produced++) {
        int32_t next = pd_sample(&smp, g->logits, b->Vs, scratch);
        if (next == b->eos)
            break;
        size_t len;
        const char *bytes = pd_tok_token_bytes(b->tok, next, &len);
        if (bytes)
            fwrite(bytes, 1, len, stdout);
        fflush(stdout);
        if (produced + 1 == o->max_tokens) {
            produced++;
            break;
        }
        it = (struct pd_step_item){.seq = &g->seq, .tokens = &next, .n = 1, .logits = g->logits};
        rc = pd_engine_step(&b->en, &it, 1, e);
    }
    double t2 = pd_now_s();
    printf("\n");
    if (!rc)
        fprintf(stderr, "prompt: %d tokens, %.1f tokens/s; decode: %d tokens after the prompt's first, %.1f tokens/s\n",
                g->n_in, g->n_in / (t1 - t0), produced > 1 ? produced - 1 : 0,
                produced > 1 ? (produced - 1) / (t2 - t1) : 0.0);
    free(scratch);
    return rc;
}

int pd_cli_generate(int argc, char **argv)
{
    struct gen_opts o;
    int rc = parse(argc, argv, &o);
    if (rc)
        return rc == 1 ? 0 : rc;
    struct batch b = {.o = &o, .size = 1};
    pd_err e = {0};
    if (o.ep) {
        int provided;
        pd_ep_mpi_init(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
        b.use_mpi = 1;
        MPI_Comm_rank(MPI_COMM_WORLD, &b.rank);
        MPI_Comm_size(MPI_COMM_WORLD, &b.size);
    }
    char path[PATH_MAX];
    struct pd_model m;
    rc = 1;
    if (pd_dir_check("--model", o.dir, &e) || pd_path_join(path, sizeof path, o.dir, "tokenizer.json", &e) || pd_tok_load(path, &b.tok, &e) || pd_model_load(o.dir, &m, &e) ||
        pd_tok_check_vocab(b.tok, m.vocab_size, path, &e) ||
        pd_tok_check_special(b.tok, m.bos_token_id, m.eos_token_id, path, &e))
        goto out;
    if (o.ep && pd_ep_init(&b.ep, MPI_COMM_WORLD, &m, &e))
        goto out;
    if (o.ep)
        b.ep.comm = MPI_COMM_WORLD;
    /* this rank's prompts: i mod N == rank */
    b.s = calloc(MAX_PROMPTS, sizeof *b.s);
    int64_t longest = 0;
    int32_t bos = pd_tok_bos(b.tok);
    for (int i = 0; i < o.n_prompts; i++) {
        int32_t *ids = NULL;
        size_t n = 0;
        if (pd_tok_encode(b.tok, o.prompt[i], strlen(o.prompt[i]), &ids, &n, &e)) {
            pd_err_prefix(&e, "--prompt %d: ", i + 1);
            goto out;
        }
        longest = (int64_t)n + 1 > longest ? (int64_t)n + 1 : longest;
        if (i % b.size != b.rank) {
            free(ids);
            continue;
        }
        struct gen_seq *g = &b.s[b.n++];
        g->prompt = i;
        g->in = malloc((n + 1) * sizeof *g->in);
        if (bos >= 0)
            g->in[g->n_in++] = bos;
        memcpy(g->in + g->n_in, ids, n * sizeof *ids);
        g->n_in += (int)n;
        g->digest = PD_FNV64_INIT;
        free(ids);
    }
    /* serve refuses a --max-model-len past the model's positions; so does generate its prompt and
     * continuation (rope past them is a model the checkpoint was never trained as) */
    if (longest + o.max_tokens > m.max_position_embeddings) {
        pd_err_set(&e, PD_EINVAL, "--prompt (%lld tokens with BOS) + --max-tokens %lld: more than the model's "
                   "max_position_embeddings %lld", (long long)longest, (long long)o.max_tokens,
                   (long long)m.max_position_embeddings);
        goto out;
    }
    int threads = (int)o.threads;
    if (!threads) {
        /* share the node's cores between the ranks on it */
        int cores = (int)sysconf(_SC_NPROCESSORS_ONLN), local = 1;
        if (o.ep) {
            MPI_Comm node;
            MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, b.rank, MPI_INFO_NULL, &node);
            MPI_Comm_size(node, &local);
            MPI_Comm_free(&node);
        }
        threads = cores / local > 0 ? cores / local : 1;
    }
    struct pd_engine_opts eo = {.dir = o.dir, .threads = threads, .max_seqs = b.n > 0 ? b.n : 1,
                                .max_model_len = longest + o.max_tokens + 1 + o.spec_k, .kv_dtype = o.kv_dtype,
                                .has_expert = o.ep ? b.ep.has_expert : NULL, .mtp = o.spec_k > 0};
    if (pd_engine_open(&b.en, &eo, &e))
        goto out;
    if (o.ep)
        pd_ep_attach(&b.ep, &b.en);
    b.V = (int)b.en.model.vocab_size;
    b.Vs = pd_tok_vocab_size(b.tok) < b.V ? pd_tok_vocab_size(b.tok) : b.V;
    b.eos = pd_tok_eos(b.tok);
    for (int i = 0; i < b.n; i++) {
        b.s[i].logits = malloc((size_t)b.V * sizeof(float));
        if (pd_seq_start(&b.en, &b.s[i].seq, &e))
            goto out;
    }
    if (o.report_weights)
        report_weights(&b);
    if (o.spec_k && !o.ep && o.n_prompts == 1 && !o.print_ids) {
        if (run_spec(&b, 1, &e))
            goto out;
    } else if (!o.ep && o.n_prompts == 1 && !o.print_ids) {
        if (stream_one(&o, &b, &e))
            goto out;
    } else {
        double t0 = pd_now_s();
        if (o.spec_k ? run_spec(&b, 0, &e) : run_batch(&b, &e))
            goto out;
        report(&b);
        if (b.rank == 0)
            fprintf(stderr, "%d sequences on %d rank%s in %.2f s\n", o.n_prompts, b.size, b.size > 1 ? "s" : "",
                    pd_now_s() - t0);
    }
    if (o.expert_stats && write_stats(&b, &e))
        goto out;
    rc = 0;
out:
    if (rc && b.use_mpi)
        fprintf(stderr, "pdmoe generate (rank %d of %d): %s\n", b.rank, b.size, e.msg);
    else if (rc)
        fprintf(stderr, "pdmoe generate: %s\n", e.msg);
    for (int i = 0; b.s && i < b.n; i++) {
        if (b.s[i].seq.kv.blocks)
            pd_seq_end(&b.en, &b.s[i].seq);
        free(b.s[i].in);
        free(b.s[i].logits);
    }
    free(b.s);
    if (b.en.w.layers)
        pd_engine_close(&b.en);
    pd_tok_free(b.tok);
    if (o.ep) {
        pd_ep_free(&b.ep);
        if (rc)
            MPI_Abort(MPI_COMM_WORLD, rc);
        pd_ep_finalize();
    }
    return rc;
}

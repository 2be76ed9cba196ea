/* libFuzzer harness for the planner's input files: the input is a config.json, a 0x00 byte and a
 * hardware file (without the 0x00 byte, the whole input is tried as both). Each file either
 * fails with a one-line message naming it, or parses; when both parse, a small deployment is
 * planned on them (on as many nodes as its 6 cards need) and then either fails with a message
 * or holds its invariants: no negative byte count, no negative or non-finite prediction.
 * Seeds in tests/fuzz/seeds/config/ (the repo's models/ and hardware/ files). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/fuzz/fuzz.h"
#include "model/config.h"
#include "plan/hardware.h"
#include "plan/perf.h"
#include "plan/plan.h"

/* A failure: a known code and one line that starts with the file's label. */
static void failed(int rc, const pd_err *e, const char *label)
{
    CHECK(rc == PD_EINVAL || rc == PD_EFORMAT || rc == PD_ERANGE || rc == PD_ENOMEM || rc == PD_EIO);
    CHECK(e->code == rc && e->msg[0] && !strchr(e->msg, '\n'));
    if (label)
        CHECK(strncmp(e->msg, label, strlen(label)) == 0);
}

static void check_role(const struct pd_role_plan *rp)
{
    CHECK(rp->ep >= 1 && rp->cards >= rp->ep);
    CHECK(rp->class_i_min >= 0 && rp->class_i_max >= rp->class_i_min && rp->class_ii_per_card >= 0);
    CHECK(rp->b.capacity > 0 && rp->b.usable >= 0 && rp->b.usable <= rp->b.capacity);
    CHECK(rp->b.class_i >= 0 && rp->b.class_ii >= 0 && rp->b.weights == rp->b.class_i + rp->b.class_ii);
    CHECK(rp->b.activations >= 0 && rp->b.runtime >= 0 && rp->act.total >= 0);
    CHECK(rp->kv_need >= 0 && rp->seqs_at_max_len >= 0 && rp->ctx_at_max_seqs >= 0);
}

static void check_time(double t)
{
    CHECK(isfinite(t) && t >= 0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nul = memchr(data, 0, size);
    size_t mlen = nul ? (size_t)(nul - data) : size;
    size_t hlen = nul ? size - mlen - 1 : size;
    char *mtext = malloc(mlen + 1), *htext = malloc(hlen + 1);
    CHECK(mtext && htext);
    memcpy(mtext, data, mlen);
    mtext[mlen] = 0;
    memcpy(htext, nul ? nul + 1 : data, hlen);
    htext[hlen] = 0;

    struct pd_model m;
    struct pd_hardware h;
    pd_err e = {0};
    int rm = pd_model_parse(mtext, "config.json", &m, &e);
    if (rm)
        failed(rm, &e, "config.json");
    int rh = pd_hardware_parse(htext, "hardware.json", &h, &e);
    if (rh)
        failed(rh, &e, "hardware.json");
    if (rm || rh)
        goto out;
    CHECK(h.bf16_flops > 0 && h.mem_bw_Bps > 0 && h.card_memory_bytes > 0 && h.cards_per_node > 0);
    CHECK(h.intra.bandwidth_Bps > 0 && h.rdma.bandwidth_Bps > 0 && h.tcp.bandwidth_Bps > 0);

    /* pd_plan_build reads the model from a file */
    char path[64];
    snprintf(path, sizeof path, "/tmp/pdmoe-fuzz-config-%d.json", (int)getpid());
    FILE *f = fopen(path, "w");
    CHECK(f);
    CHECK(fwrite(mtext, 1, mlen, f) == mlen);
    fclose(f);
    struct pd_plan_opts o;
    pd_plan_opts_default(&o);
    o.model = path;
    o.hw = &h;
    /* a small layout (P 1 x EP2, D 1 x EP4), so that each input plans in milliseconds */
    o.role[0] = (struct pd_role_opts){.dp = 2, .tp = 1, .instances = 1};
    o.role[1] = (struct pd_role_opts){.dp = 4, .tp = 1, .instances = 1};
    o.nodes = (6 + h.cards_per_node - 1) / h.cards_per_node;
    struct pd_plan p;
    int rc = pd_plan_build(&o, &p, &e);
    unlink(path);
    if (rc) {
        failed(rc, &e, NULL);
        goto out;
    }
    for (int g = 0; g < PD_G_COUNT; g++)
        for (int c = 0; c < 2; c++)
            CHECK(p.inv.group_bytes[g][c] >= 0 && p.inv.group_params[g][c] >= 0);
    CHECK(p.inv.class_bytes[PD_CLASS_I] >= 0 && p.inv.class_bytes[PD_CLASS_II] > 0);
    for (int x = 0; x < p.inv.n_experts; x++)
        CHECK(p.inv.expert_bytes[x] >= 0);
    check_role(&p.role[0]);
    check_role(&p.role[1]);
    CHECK(p.p_kv_batch >= 0);
    for (int i = 0; i < p.n_scen; i++)
        CHECK(p.scen[i].kv >= 0 && p.scen[i].total >= 0);
    for (int i = 0; i < p.n_handoff; i++) {
        CHECK(p.handoff[i].bytes >= 0);
        check_time(p.handoff[i].rdma_s);
        check_time(p.handoff[i].tcp_s);
    }
    struct pd_workload w;
    pd_workload_default(&w);
    w.isl = 512;   /* within max-model-len and the model's positions, which predictions require */
    w.osl = 128;
    struct pd_perf pf;
    rc = pd_perf_eval(&p, &w, &pf, &e);
    if (rc) {
        failed(rc, &e, NULL);
    } else {
        check_time(pf.prefill_s);
        check_time(pf.ttft_s);
        check_time(pf.handoff_s);
        check_time(pf.prefill_step.total_s);
        check_time(pf.decode_step.total_s);
        CHECK(pf.tpot_s > 0 && isfinite(pf.tpot_s));
        CHECK(isfinite(pf.prefill_tok_s_card) && pf.prefill_tok_s_card >= 0);
        CHECK(isfinite(pf.decode_tok_s_card) && pf.decode_tok_s_card >= 0);
        CHECK(isfinite(pf.req_s) && pf.req_s >= 0);
        CHECK(pf.batch >= 0 && pf.batch_cap >= 0);
    }
    pd_plan_free(&p);
out:
    free(mtext);
    free(htext);
    return 0;
}

/* `pdmoe gen-model`: a deterministic synthetic checkpoint for a preset, in the layout the engine
 * loads and the planner counts: config.json (the preset), model.safetensors with every tensor of
 * the inventory under W8A8 (int8 weight + fp32 weight_scale per output row for linear layers,
 * the released dtypes for the rest), and a byte-level BPE tokenizer.json.
 *
 * Weights are drawn from a seeded generator, one stream per tensor name, and scaled so the
 * hidden state stays bounded through every layer: linear weights ~ N(0, 1/in), output
 * projections further by 1/sqrt(2 * layers); mHC mixing weights small, with biases that make
 * the streams a convex combination (pre weights ~ 1/hc, post ~ 1, comb ~ uniform + noise);
 * norm gains, attention sinks and mHC scales spread around 1, 0 and 1 rather than fixed there, so
 * every term acts (ranges in genmodel.c); the hash-routing table a fixed random choice of
 * distinct experts per token. */
#ifndef PD_ENGINE_GENMODEL_H
#define PD_ENGINE_GENMODEL_H

#include <stdint.h>

#include "core/err.h"

int pd_genmodel(const char *preset, const char *out_dir, uint64_t seed, pd_err *e);
/* The same with an MTP draft that agrees with the main model's greedy next token at about rate
 * mtp_agreement in [0, 1] by construction (genmodel.c says how); < 0: the plain synthetic model. */
int pd_genmodel_agree(const char *preset, const char *out_dir, uint64_t seed, double mtp_agreement, pd_err *e);

#endif

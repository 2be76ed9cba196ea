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

/* The same fp32 draws (per tensor name and seed) in one of three layouts:
 *   PD_GEN_W8A8          the default above: one model.safetensors;
 *   PD_GEN_RELEASE       DeepSeek's released format (engine/release.h): every matrix the default
 *                        stores int8 stored FP8 e4m3 + ue8m0 "X.scale" [ceil(out/128), ceil(in/128)],
 *                        routed experts FP4 e2m1 two per byte (I8) + ue8m0 "X.scale" [out, in/32],
 *                        the rest as the default; sharded into model-0000K-of-0000N.safetensors
 *                        with model.safetensors.index.json, and config.json with the release's
 *                        quantization_config;
 *   PD_GEN_RELEASE_W8A8  the release's model (its FP8/FP4 values) in the default layout: what
 *                        the engine makes of the release at load, so the two give the same tokens.
 * The release cannot hold the draws themselves (FP4 keeps 15 values per block of 32), so its
 * model is PD_GEN_W8A8's with every FP8/FP4 matrix rounded onto the release's grid. */
enum pd_gen_format { PD_GEN_W8A8, PD_GEN_RELEASE, PD_GEN_RELEASE_W8A8 };
int pd_genmodel_fmt(const char *preset, const char *out_dir, uint64_t seed, enum pd_gen_format fmt, pd_err *e);
/* Both options: layout fmt, and an agreeing MTP draft when mtp_agreement >= 0. */
int pd_genmodel_opts(const char *preset, const char *out_dir, uint64_t seed, enum pd_gen_format fmt,
                     double mtp_agreement, pd_err *e);

#endif

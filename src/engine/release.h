/* DeepSeek's released checkpoint formats for weight matrices, and their conversion to the
 * engine's W8A8 int8.
 *
 * Formats (official inference code: model.py Linear, convert.py cast_e2m1fn_to_e4m3fn; the
 * release's safetensors headers):
 *   FP8   "X.weight" F8_E4M3 [out, in] (e4m3fn codes) and "X.scale" F8_E8M0
 *         [ceil(out/128), ceil(in/128)]: value w[o][i] = e4m3(q[o][i]) * 2^(s[o/128][i/128] - 127).
 *   FP4   "X.weight" I8 [out, in/2], two e2m1 codes per byte, the low nibble the even column
 *         (2j) and the high nibble the odd one (2j + 1); "X.scale" F8_E8M0 [out, ceil(in/32)]:
 *         w[o][i] = e2m1(nibble) * 2^(s[o][i/32] - 127). The routed experts.
 * Encoding (gen-model --format release) uses per block the power of two the official quantizer
 * uses: s = 2^ceil(log2(amax / max)) (max 448 for e4m3, 6 for e2m1), values rounded to nearest even.
 *
 * Conversion to W8A8 (the loader and `pdmoe convert`): each output row is decoded to fp32
 * exactly, then quantized as pdmoe's own checkpoints are (kernels/quant.h: one fp32 scale per
 * output row, amax / 127). */
#ifndef PD_ENGINE_RELEASE_H
#define PD_ENGINE_RELEASE_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"
#include "model/safetensors.h"

#define PD_RELEASE_FP8_BLOCK 128
#define PD_RELEASE_FP4_BLOCK 32

enum pd_release_fmt { PD_RELEASE_NONE = 0, PD_RELEASE_FP8, PD_RELEASE_FP4 };

/* "X.weight" -> "X.scale" (the release's scale companion); the name unchanged with ".scale"
 * appended when it does not end in ".weight". */
const char *pd_release_scale_name(const char *weight, char *buf, size_t n);

/* Scale tensor shape of a matrix [out, in] in format f: [rows, cols]. */
void pd_release_scale_shape(enum pd_release_fmt f, int64_t out, int64_t in, int64_t *rows, int64_t *cols);

/* Encoding an fp32 matrix w [out, in]. FP8: q [out, in], s [ceil(out/128), ceil(in/128)].
 * FP4 (in even): q [out, in/2], s [out, ceil(in/32)]. */
void pd_release_fp8_encode(const float *w, int out, int in, uint8_t *q, uint8_t *s);
void pd_release_fp4_encode(const float *w, int out, int in, uint8_t *q, uint8_t *s);

/* w [out, in] <- decode(encode(w)) in format f: the nearest values the release can hold.
 * Encoding these again gives the same values back. PD_EINVAL for FP4 with odd `in`, PD_ENOMEM. */
int pd_release_round(enum pd_release_fmt f, float *w, int out, int in);

/* Decodes row r of a matrix [out, in] stored in format f (q and s as above) into row [in]. */
void pd_release_decode_row(enum pd_release_fmt f, const uint8_t *q, const uint8_t *s, int out, int in, int r,
                           float *row);

/* A release matrix found in a checkpoint: weight and scale tensors checked. */
struct pd_release_mat {
    enum pd_release_fmt fmt;
    const struct pd_st_tensor *w, *s;
    int out, in;
};

/* What format `name` is stored in: PD_RELEASE_FP8 for F8_E4M3; PD_RELEASE_FP4 for I8 with a
 * ".scale" companion (pdmoe's int8 has "X.weight_scale"); PD_RELEASE_NONE otherwise (the caller's own formats).
 * For FP8/FP4 both tensors' dtypes and shapes are checked against [out, in]: a missing scale, a
 * wrong dtype or shape is PD_EFORMAT naming the file and the tensor. */
int pd_release_find(const struct pd_st_set *st, const char *name, int out, int in, struct pd_release_mat *m,
                    pd_err *e);

/* Converts m to int8 [out, in] with one fp32 scale per row (q, scales allocated by the caller).
 * Fails (PD_EFORMAT naming the tensor and the row) on a NaN scale or weight code. */
int pd_release_to_int8(const struct pd_release_mat *m, int8_t *q, float *scales, pd_err *e);

#endif

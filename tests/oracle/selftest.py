#!/usr/bin/env python3
"""The oracle's own pieces against values worked by hand (run by tests/oracle/run.sh before it
trusts the oracle): the official Sinkhorn order and count, the e2m1 / e4m3 / bf16 roundings with
their ties, the ue8m0 scales of act_quant and fp4_act_quant, the Hadamard rotation, rope and its
inverse, YaRN's two ends, top-k ties. Exits 1 naming the first check that fails."""
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "oracle"))
import v4_oracle as o  # noqa: E402

failed = []


def check(name, got, want, tol=0.0):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape or not np.all(np.abs(got - want) <= tol):
        failed.append(f"{name}: got {got.tolist()}, want {want.tolist()}")


# hc_split_sinkhorn on a 2 x 2 whose softmax rows are [1/4 3/4] and [1/2 1/2] (eps 0): one column
# normalisation gives [1/3 3/5; 2/3 2/5]; a row and a column normalisation more [4/11 12/19; 7/11 7/19];
# another round [15/41 45/71; 26/41 26/71]
mixes = np.array([0, 0, 0, 0, 0, math.log(3), 0, 0.0])
for iters, want in ((1, [1 / 3, 3 / 5, 2 / 3, 2 / 5]), (3, [15 / 41, 45 / 71, 26 / 41, 26 / 71]),
                    (2, [4 / 11, 12 / 19, 7 / 11, 7 / 19])):
    pre, post, comb = o.hc_split_sinkhorn(mixes, np.ones(3), np.zeros(8), 2, iters, 0.0)
    check(f"sinkhorn iters {iters}", comb.reshape(-1), want, 1e-12)
check("sinkhorn pre and post", np.concatenate([pre, post]), [0.5, 0.5, 1.0, 1.0], 1e-12)
# e2m1: 0, 0.5, 1, 1.5, 2, 3, 4, 6; ties to the even code; saturating
check("e2m1", o.e2m1(np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.3, -5.5])),
      [0, 1, 1, 2, 2, 4, 4, 6, -0.5, -6])
# e4m3: 3 mantissa bits, normals from 2^-6, subnormals in steps of 2^-9, max 448
check("e4m3", o.e4m3(np.array([1 + 1 / 16, 1 + 3 / 16, 2.0 ** -10, 3 * 2.0 ** -10, 460.0, 300.0, -17.0])),
      [1, 1.25, 0, 2.0 ** -8, 448, 288, -16])
# bf16: 7 mantissa bits, ties to even
check("bf16", o.bf16(np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -9)])), [1, 1 + 2.0 ** -6, -1])
# act_quant: amax 448 -> scale 1 (2^-9 is e4m3's smallest subnormal, kept); amax 460 (in bf16,
# which the official input is) -> scale 2 (2^-9 / 2 is a tie between 0 and 2^-9: to 0, the even code)
x = np.zeros(64)
x[0], x[1], x[2] = 448.0, 2.0 ** -9, 1.1
check("fp8 scale 1", o.fp8_act_quant(x)[:3], [448, 2.0 ** -9, 1.125])
x[0] = 460.0
check("fp8 scale 2", o.fp8_act_quant(x)[:3], [448, 0, 1.125])
# fp4_act_quant: amax 6 -> scale 1; amax 12 -> scale 2 (3 -> 3 / 2 = 1.5 -> 3)
y = np.zeros(32)
y[0], y[1] = 6.0, 2.4
check("fp4 scale 1", o.fp4_act_quant(y)[:2], [6, 2])
y[0], y[1] = 12.0, 3.0
check("fp4 scale 2", o.fp4_act_quant(y)[:2], [12, 3])
# Hadamard: e_0 -> every value d^-1/2; orthogonal (the norm kept)
e0 = np.zeros(16)
e0[0] = 1
check("hadamard e0", o.rotate_activation(e0), np.full(16, 0.25))
v = np.random.default_rng(1).standard_normal(64)
check("hadamard norm", np.linalg.norm(o.rotate_activation(v)), np.linalg.norm(o.bf16(v)), 1e-2)
# rope: pair (x0, x1) rotated by freq * pos; the inverse undoes it
f = np.array([0.5])
check("rope", o.rope(np.array([1.0, 0.0]), f, 2), [math.cos(1.0), math.sin(1.0)], 1e-15)
w = np.random.default_rng(2).standard_normal(8)
fr = o.precompute_freqs(4, 0, 10000.0, 1, 32, 1)
check("rope inverse", o.rope(o.rope(w, fr, 7), fr, 7, inverse=True), w, 1e-12)
# YaRN: the highest frequency kept, the lowest divided by the factor
plain = o.precompute_freqs(64, 0, 160000.0, 4, 32, 1)
yarn = o.precompute_freqs(64, 1024, 160000.0, 4, 32, 1)
check("yarn ends", [yarn[0] / plain[0], yarn[-1] / plain[-1]], [1, 0.25], 1e-12)
# top-k: ties to the lower index; the margin between the k-th and the (k+1)-th
sel, margin = o.topk_lower_first(np.array([1.0, 3.0, 3.0, 2.0, 3.0]), 2)
check("topk ties", list(sel) + [margin], [1, 2, 0.0])
for f_ in failed:
    print(f"oracle selftest: FAIL {f_}")
if failed:
    sys.exit(1)
print("oracle selftest: every check holds")

#!/usr/bin/env python3
"""Sharpens a synthetic checkpoint in place where gen-model's values leave a term idle, for the
oracle's tests.

gen-model draws the comb part of every hc_attn_base / hc_ffn_base (entries 2*hc onwards) with a
standard deviation of 0.5: the Sinkhorn iterations then converge within a few rounds, and an
engine doing half the official number of normalisations gives the same logits to 1e-11. This
multiplies those entries by --factor (8: a standard deviation of 4, where the count matters by
about 1e-2 per entry of comb), so the oracle's comparison sees the Sinkhorn count.

--swiglu-gain G multiplies the expert FFNs' w1 and w3 (routed and shared) by G through their int8
row scales (exact for a power of two): gen-model's gate and up values are about unit-sized, so the
SwiGLU clamp at swiglu_limit (10) never acts; with G = 8 about one value in eight passes it, and the
clamp's semantics (gate clamped above only, up both ways, the shared expert too) show.
The file is rewritten in place (fp32 values, same offsets): engine and oracle read the same
checkpoint."""
import argparse
import json
import os
import struct

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="checkpoint directory (config.json, model.safetensors)")
    ap.add_argument("--factor", type=float, default=8.0)
    ap.add_argument("--swiglu-gain", type=float, default=1.0)
    o = ap.parse_args()
    with open(os.path.join(o.model, "config.json")) as f:
        hc = json.load(f).get("hc_mult", 4)
    path = os.path.join(o.model, "model.safetensors")
    raw = np.memmap(path, dtype=np.uint8, mode="r+")
    (n,) = struct.unpack("<Q", bytes(raw[:8]))
    header = json.loads(bytes(raw[8:8 + n]).decode("utf-8"))
    done = gained = 0
    for name, t in header.items():
        if name.endswith(("hc_attn_base", "hc_ffn_base")):
            if t["dtype"] != "F32":
                raise SystemExit(f"{path}: {name} is {t['dtype']}, not F32")
            a, b = t["data_offsets"]
            v = raw[8 + n + a:8 + n + b].view("<f4")
            v[2 * hc:] *= np.float32(o.factor)
            done += 1
        elif o.swiglu_gain != 1 and ("ffn.experts." in name or "ffn.shared_experts." in name) and \
                name.endswith(("w1.weight_scale", "w3.weight_scale")):
            if t["dtype"] != "F32":
                raise SystemExit(f"{path}: {name} is {t['dtype']}, not F32")
            a, b = t["data_offsets"]
            raw[8 + n + a:8 + n + b].view("<f4")[:] *= np.float32(o.swiglu_gain)
            gained += 1
    raw.flush()
    if not done:
        raise SystemExit(f"{path}: no hc_attn_base or hc_ffn_base tensor")
    if o.swiglu_gain != 1 and not gained:
        raise SystemExit(f"{path}: --swiglu-gain: no int8 expert w1/w3 (with a _scale) to scale")


if __name__ == "__main__":
    main()

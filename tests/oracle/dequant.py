#!/usr/bin/env python3
"""Copies a checkpoint directory with some of its int8 matrices written as F32 (the same values:
int8 times the row's scale), so the engine runs those matrices in fp32 instead of W8A8 with
exactly the weights it had: the difference in its logits is what quantising those matrices'
activations costs (tests/oracle/precision.sh).

  dequant.py SRC DST PATTERN...   every int8 tensor whose name contains a PATTERN"""
import json
import os
import shutil
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "oracle"))
import v4_oracle  # noqa: E402


def main():
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    src, dst, pats = sys.argv[1], sys.argv[2], sys.argv[3:]
    os.makedirs(dst, exist_ok=True)
    for f in ("config.json", "tokenizer.json"):
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)
    path = os.path.join(src, "model.safetensors")
    t = v4_oracle.read_safetensors(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    (n,) = struct.unpack("<Q", bytes(raw[:8]))
    old = json.loads(bytes(raw[8:8 + n]).decode("utf-8"))
    old.pop("__metadata__", None)
    chosen = {name for name, v in t.items() if v.dtype == np.int8 and any(p in name for p in pats)}
    if not chosen:
        raise SystemExit(f"{src}: no int8 tensor matches {pats}")
    header, blobs, at = {}, [], 0
    for name, info in old.items():
        if name.endswith("_scale") and name[:-6] in chosen:
            continue
        if name in chosen:
            v = t[name].astype(np.float32) * np.asarray(t[name + "_scale"], dtype=np.float32).reshape(-1, 1)
            b, dt, shape = v.astype("<f4").tobytes(), "F32", list(v.shape)
        else:   # as it is, bytes and dtype
            a, e = info["data_offsets"]
            b, dt, shape = bytes(raw[8 + n + a:8 + n + e]), info["dtype"], info["shape"]
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    hits = len(chosen)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(dst, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    print(f"{dst}: {hits} int8 matrices written as F32")


if __name__ == "__main__":
    main()

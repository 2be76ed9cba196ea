#!/usr/bin/env python3
"""What each per-tensor precision choice of pdmoe's presets costs, measured against the float64
oracle of DeepSeek-V4's official forward (issue 19, point 4; docs/validation.md).

The dense oracle checkpoint (tests/oracle/dense.json, mHC comb logits sharpened as in run.sh) is
generated in variants that differ only in `pdmoe.quantize_groups`, from the same seeded values:
  B: []                                   head, compressor and indexer projections bf16 (the
                                          release keeps the head, compressor and gate in fp32 and
                                          the indexer's weights_proj in bf16)
  H: ["lm_head"]; C: ["compressor_indexer"]; A: both (today's v4-tiny and v4-flash-mini)
In every variant the attention matrices (wq_a, wq_b, wkv, wo_a, wo_b), the indexer's wq_b and the
experts are int8 (the release: FP8 e4m3 with 128 x 128 block scales, experts FP4, wo_a bf16 in the
code), the router fp32. The reference is the oracle on B (its weights as stored, float64). Each
row is the engine's logits against that reference over every position of a 64-token prompt, for
three seeds: 1 - cosine (median and largest) and how often the argmax agrees. `wo_a fp32` is B with
wo_a's int8 weights written as fp32 (tests/oracle/dequant.py): the same weights, so the row against
B's W8A8 isolates what quantising wo_a's activations costs. The weight rounding of the head and the
compressor alone (no activation quantisation) is the oracle on A against the oracle on B.

  tests/oracle/precision.py [--seeds 1,2,3] [--tokens 64] [--preset FILE]
(build/pdmoe and build/oracle-dump). --preset models/v4-tiny.json measures the same on a sparse
preset (not sharpened), where the indexer chooses and an error can flip a choice."""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tools", "oracle"))
sys.path.insert(0, HERE)
import v4_oracle  # noqa: E402
from compare import read_dump, cosine  # noqa: E402

VARIANTS = {"B": [], "H": ["lm_head"], "C": ["compressor_indexer"], "A": ["lm_head", "compressor_indexer"]}


def run(*cmd):
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--preset", default=os.path.join(HERE, "dense.json"))
    o = ap.parse_args()
    dense = os.path.samefile(o.preset, os.path.join(HERE, "dense.json"))
    with open(o.preset) as f:
        preset = json.load(f)
    rows = {}   # label -> list of (cosines, argmax agreements)

    def add(label, eng, ref):
        c = [cosine(eng[i], ref[i]) for i in range(len(ref))]
        agree = [int(np.argmax(eng[i]) == np.argmax(ref[i])) for i in range(len(ref))]
        rows.setdefault(label, []).append((c, agree))

    with tempfile.TemporaryDirectory(prefix="pdmoe-precision-") as T:
        for name, groups in VARIANTS.items():
            p = dict(preset)
            p["pdmoe"] = dict(preset["pdmoe"], quantize_groups=groups)
            with open(os.path.join(T, f"{name}.json"), "w") as f:
                json.dump(p, f)
        for seed in [int(s) for s in o.seeds.split(",")]:
            r = random.Random(100 + seed)
            ids = ",".join(str(r.randrange(preset["vocab_size"])) for _ in range(o.tokens))
            dirs = {}
            for name in VARIANTS:
                d = dirs[name] = os.path.join(T, f"{name}-{seed}")
                run("./build/pdmoe", "gen-model", "--preset", os.path.join(T, f"{name}.json"), "--out", d,
                    "--seed", str(seed))
                if dense:
                    run(sys.executable, os.path.join(HERE, "sharpen.py"), d)
            dirs["wo_a"] = os.path.join(T, f"woa-{seed}")
            run(sys.executable, os.path.join(HERE, "dequant.py"), dirs["B"], dirs["wo_a"], "attn.wo_a")

            def dump(name, mode):
                out = os.path.join(T, f"{name}-{mode}-{seed}.bin")
                run("./build/oracle-dump", "--model", dirs[name], "--ids", ids, "--mode", mode, "--out", out)
                return read_dump(out)[1]

            ref, _ = v4_oracle.Oracle(dirs["B"], "bf16").run([int(x) for x in ids.split(",")])
            ref_a, _ = v4_oracle.Oracle(dirs["A"], "bf16").run([int(x) for x in ids.split(",")])
            add("engine float reference, B", dump("B", "ref"), ref)
            add("engine W8A8, B (head, compressor, indexer projections fp32)", dump("B", "w8a8"), ref)
            add("engine W8A8, B with wo_a fp32 (same weights, activations unquantised)", dump("wo_a", "w8a8"), ref)
            add("engine W8A8, H (+ lm_head int8)", dump("H", "w8a8"), ref)
            add("engine W8A8, C (+ compressor and indexer projections int8)", dump("C", "w8a8"), ref)
            add("engine W8A8, A (today's presets: both)", dump("A", "w8a8"), ref)
            add("oracle on A (int8 weights of head and compressor, float activations)", ref_a, ref)
    print(f"| {os.path.basename(o.preset)}: against the oracle on B ({o.tokens} positions x seeds {o.seeds}) "
          f"| 1 - cos median | 1 - cos max | "
          f"argmax agrees |")
    print("|---|---|---|---|")
    for label, runs in rows.items():
        c = np.concatenate([np.array(x[0]) for x in runs])
        a = np.concatenate([np.array(x[1]) for x in runs])
        print(f"| {label} | {np.median(1 - c):.2e} | {np.max(1 - c):.2e} | {100 * a.mean():.1f}% |")


if __name__ == "__main__":
    main()

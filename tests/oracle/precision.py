#!/usr/bin/env python3
"""What each per-tensor precision choice of pdmoe's presets costs, measured against the float64
oracle of DeepSeek-V4's official forward (issue 19, point 4; docs/validation.md).

The dense oracle checkpoint (tests/oracle/dense.json, mHC comb logits sharpened as in run.sh) is
generated in variants that differ only in `pdmoe.quantize_groups`, from the same seeded values:
  B: []                      the presets as they are: int8 where a W8A8 deployment quantises (wq_b,
                             wo_b, the indexer's wq_b, experts, MTP projections), bf16 elsewhere (wq_a,
                             wkv, wo_a, head, compressor, the indexer's weights_proj); router fp32
  Q: ["attention"]           + wq_a, wkv, wo_a int8 (what the presets did before)
  H: Q + ["lm_head"]; C: Q + ["compressor_indexer"]; A: Q + both (the presets before issue 19.4)
The reference is the oracle on B (its weights as stored, float64). Each row is the engine's logits
against that reference over every position of a 64-token prompt, for three seeds: 1 - cosine
(median and largest) and how often the argmax agrees. The weight rounding of every former int8
choice alone (no activation quantisation) is the oracle on A against the oracle on B.

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

VARIANTS = {"B": [], "Q": ["attention"], "H": ["attention", "lm_head"], "C": ["attention", "compressor_indexer"],
            "A": ["attention", "lm_head", "compressor_indexer"]}


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

            def dump(name, mode):
                out = os.path.join(T, f"{name}-{mode}-{seed}.bin")
                run("./build/oracle-dump", "--model", dirs[name], "--ids", ids, "--mode", mode, "--out", out)
                return read_dump(out)[1]

            ref, _ = v4_oracle.Oracle(dirs["B"], "bf16").run([int(x) for x in ids.split(",")])
            ref_a, _ = v4_oracle.Oracle(dirs["A"], "bf16").run([int(x) for x in ids.split(",")])
            add("engine float reference, B", dump("B", "ref"), ref)
            add("engine W8A8, B (the presets: int8 where W8A8 deployments quantise)", dump("B", "w8a8"), ref)
            add("engine W8A8, Q (+ wq_a, wkv, wo_a int8)", dump("Q", "w8a8"), ref)
            add("engine W8A8, H (Q + lm_head int8)", dump("H", "w8a8"), ref)
            add("engine W8A8, C (Q + compressor and indexer projections int8)", dump("C", "w8a8"), ref)
            add("engine W8A8, A (the presets before: all of them)", dump("A", "w8a8"), ref)
            add("oracle on A (the int8 weights of all of them, float activations)", ref_a, ref)
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

#!/bin/sh
# The experiment behind hardware/{h100,h200,h800,b200}.json's layer_prefill_s and layer_decode_s:
# a kernel floor per layer of a forward pass (launch, ramp and tail of each of the layer's kernels,
# whatever its tokens), fitted on one measured point of one serving stack and checked on the others
# of the same family. The family: SGLang's DeepSeek-V4 cookbook (sgl-project/sglang,
# docs_new/src/snippets/configs/deepseek-ai/deepseek-v4-benchmarks.jsx at 08587007c815 for the
# figures, deepseek-v4.jsx at 01c5c03f2958 for the launch flags): SGLang 0.5.15, its low-latency
# recipe (EAGLE 3 steps, 4 draft tokens: 3 MTP drafts a step; TP4 on H200 and B200, TP8 on H100),
# bench_serving random 8,192 in / 1,024 out, mean TPOT at 1 and 16 clients. The fit: the floor
# that gives H200's single stream its published TPOT (3.28 ms); the checks: every other cell.
# The H100 cells run FP4 experts through Marlin and take the hardware file's fp4_memory as it is
# (tools/v4-fp4-hopper.sh fits it on the H100 16-client cell, with this floor in place).
# Prints the fit and each cell's TPOT, published and predicted (--json: as JSON).
# Usage: tools/v4-layer-cost.sh [--json]
set -eu
cd "$(dirname "$0")/.."
. tools/validation-lib.sh
v4_setup "$@"
python3 - "$B" "$T" "$JSON" <<'PY'
import json, subprocess, sys
B, T, as_json = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
# (cell, hardware, tp, routed experts override, clients, prompts, published mean TPOT s)
cells = [
    ("H200 FP8, 1 client", "h200", 4, None, 1, 32, 3.28e-3),
    ("H200 FP8, 16 clients", "h200", 4, None, 16, 32, 8.99e-3),
    ("B200 FP4, 1 client", "b200", 4, "routed_experts=fp4", 1, 32, 2.88e-3),
    ("B200 FP4, 16 clients", "b200", 4, "routed_experts=fp4", 16, 32, 5.44e-3),
    ("H100 FP4, 1 client", "h100", 8, "routed_experts=fp4", 1, 32, 3.22e-3),
    ("H100 FP4, 16 clients", "h100", 8, "routed_experts=fp4", 16, 32, 6.76e-3),
]
def tpot(cell, floor):
    name, hw, tp, ovr, c, n, _ = cell
    d = json.load(open(f"hardware/{hw}.json"))
    d["efficiency"]["layer_prefill_s"] = d["efficiency"]["layer_decode_s"] = floor
    d.setdefault("sources", {}).setdefault("efficiency", {}).update(layer_prefill_s="fit", layer_decode_s="fit")
    path = f"{T}/{hw}.json"
    json.dump(d, open(path, "w"))
    cmd = [B, "plan", "--model", "deepseek-v4-flash", "--hardware", path, "--nodes", "1",
           "--aggregated", f"dp=1,tp={tp},instances=1", "--quant", "fp8", "--kv-cache-dtype", "fp8",
           "--speculative-config", '{"method":"mtp","num_speculative_tokens":3}', "--max-num-seqs", str(c),
           "--max-num-batched-tokens", "8192", "--max-model-len", "9216", "--isl", "8192", "--osl", "1024",
           "--concurrency", str(c), "--phase", "lockstep", "--num-prompts", str(n), "--json"]
    if ovr:
        cmd += ["--quant-override", ovr]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(r.stdout)["perf"]["closed_loop"]["tpot_s"]
# bisect the floor in [0, 1 ms]: TPOT grows with it
lo, hi = 0.0, 1e-3
for _ in range(40):
    mid = (lo + hi) / 2
    if tpot(cells[0], mid) < cells[0][6]:
        lo = mid
    else:
        hi = mid
floor = (lo + hi) / 2
rows = [{"cell": c[0], "published_tpot_s": c[6], "tpot_s": tpot(c, floor), "tpot_s_without": tpot(c, 0.0)} for c in cells]
if as_json:
    print(json.dumps({"layer_s": floor, "cells": rows}))
else:
    print(f"kernel floor per layer fitted on SGLang's H200 single stream (TPOT 3.28 ms): {floor * 1e6:.1f} us")
    for r in rows:
        print(f"{r['cell']:22s} TPOT published {r['published_tpot_s'] * 1e3:5.2f} ms, predicted {r['tpot_s'] * 1e3:5.2f} ms "
              f"({r['tpot_s'] / r['published_tpot_s'] - 1:+.0%}; without the floor {r['tpot_s_without'] * 1e3:5.2f} ms)"
              + ("  <- the fit" if r is rows[0] else ""))
PY

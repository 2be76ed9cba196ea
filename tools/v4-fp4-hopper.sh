#!/bin/sh
# The experiment behind hardware/{h100,h200}.json's fp4_memory: FP4 routed experts on Hopper, which
# has no FP4 arithmetic, run through W4A16 kernels (SGLang's --moe-runner-backend marlin) that
# dequantise the weights in software as they stream them. The share of the memory factor they
# reach is fitted on one cell of SGLang's DeepSeek-V4 cookbook (sgl-project/sglang,
# docs_new/src/snippets/configs/deepseek-ai/deepseek-v4-benchmarks.jsx at 08587007c815; flags in
# deepseek-v4.jsx at 01c5c03f2958): 8 x H100, TP8, Marlin, EAGLE 3 drafts, 16 clients, mean TPOT
# 6.76 ms; and checked on the recipe's other Marlin cells: 4 x H200 (TP4) at 16 clients (8.42 ms)
# and both cards' single streams (3.22, 3.37 ms). Prints the fit and the cells (--json: as JSON).
# Usage: tools/v4-fp4-hopper.sh [--json]
set -eu
cd "$(dirname "$0")/.."
. tools/validation-lib.sh
v4_setup "$@"
python3 - "$B" "$T" "$JSON" <<'PY'
import json, subprocess, sys
B, T, as_json = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
# (cell, hardware, tp, clients, published mean TPOT s)
cells = [
    ("H100 Marlin, 16 clients", "h100", 8, 16, 6.76e-3),
    ("H200 Marlin, 16 clients", "h200", 4, 16, 8.42e-3),
    ("H100 Marlin, 1 client", "h100", 8, 1, 3.22e-3),
    ("H200 Marlin, 1 client", "h200", 4, 1, 3.37e-3),
]
def tpot(cell, share):
    name, hw, tp, c, _ = cell
    d = json.load(open(f"hardware/{hw}.json"))
    d["efficiency"]["fp4_memory"] = share
    d.setdefault("sources", {}).setdefault("efficiency", {})["fp4_memory"] = "fit"
    path = f"{T}/{hw}.json"
    json.dump(d, open(path, "w"))
    cmd = [B, "plan", "--model", "deepseek-v4-flash", "--hardware", path, "--nodes", "1",
           "--aggregated", f"dp=1,tp={tp},instances=1", "--quant", "fp8", "--quant-override", "routed_experts=fp4",
           "--kv-cache-dtype", "fp8", "--speculative-config", '{"method":"mtp","num_speculative_tokens":3}',
           "--max-num-seqs", str(c), "--max-num-batched-tokens", "8192", "--max-model-len", "9216",
           "--isl", "8192", "--osl", "1024", "--concurrency", str(c), "--phase", "lockstep", "--num-prompts", "32", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(r.stdout)["perf"]["closed_loop"]["tpot_s"]
# bisect the share in [0.05, 1]: TPOT falls as it grows
lo, hi = 0.05, 1.0
for _ in range(40):
    mid = (lo + hi) / 2
    if tpot(cells[0], mid) > cells[0][4]:
        lo = mid
    else:
        hi = mid
share = (lo + hi) / 2
rows = [{"cell": c[0], "published_tpot_s": c[4], "tpot_s": tpot(c, share), "tpot_s_without": tpot(c, 1.0)} for c in cells]
if as_json:
    print(json.dumps({"fp4_memory": share, "cells": rows}))
else:
    print(f"share of the memory factor FP4 weights reach through Marlin on Hopper, fitted on H100 at 16 clients: {share:.3f}")
    for r in rows:
        print(f"{r['cell']:24s} TPOT published {r['published_tpot_s'] * 1e3:5.2f} ms, predicted {r['tpot_s'] * 1e3:5.2f} ms "
              f"({r['tpot_s'] / r['published_tpot_s'] - 1:+.0%}; at full bandwidth {r['tpot_s_without'] * 1e3:5.2f} ms)"
              + ("  <- the fit" if r is rows[0] else ""))
PY

#!/bin/bash
# The headline experiment of PD disaggregation, on this machine: the same two engine processes
# either as 1 prefill + 1 decode instance (pdmoe up) or as 2 colocated servers behind the same
# proxy, under a mixed workload (long prompts arriving while short requests decode). Prints both
# `pdmoe bench serve` reports; compare the TPOT of the short requests.
# Usage: bench/pd_vs_colocated.sh [rate] [num-prompts]
set -euo pipefail
cd "$(dirname "$0")/.."
rate=${1:-6}
n=${2:-48}
load="--request-rate $rate --num-prompts $n --input-len 64 --output-len 64 --long-every 4 --long-input-len 1536 --seed 1"
[ -f models/mini/model.safetensors ] || ./build/pdmoe gen-model --preset v4-flash-mini --out models/mini
pids=()
cleanup() { for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

echo "== PD: 1 prefill + 1 decode instance (1 thread each) behind the proxy"
out=$(mktemp)
./build/pdmoe up --model models/mini --port 18700 --max-model-len 2048 >"$out" 2>/dev/null &
pids+=($!)
for i in $(seq 300); do grep -q Ctrl-C "$out" && break; sleep 0.1; done
./build/pdmoe bench serve --url http://127.0.0.1:18700 $load
cleanup; pids=()

echo "== colocated: 2 servers (1 thread each) behind the same proxy"
./build/pdmoe serve --model models/mini --port 18711 --threads 1 --max-model-len 2048 --served-model-name mini 2>/dev/null &
pids+=($!)
./build/pdmoe serve --model models/mini --port 18712 --threads 1 --max-model-len 2048 --served-model-name mini 2>/dev/null &
pids+=($!)
./build/pdmoe proxy --decode 127.0.0.1:18711,127.0.0.1:18712 --port 18710 2>/dev/null &
pids+=($!)
for port in 18711 18712 18710; do
  for i in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.1; done
done
./build/pdmoe bench serve --url http://127.0.0.1:18710 $load
rm -f "$out"

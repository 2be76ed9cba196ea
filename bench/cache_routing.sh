#!/bin/bash
# Cache-aware routing against least-loaded through `pdmoe up` (issue 15): 2 prefill instances and 1
# decode instance of models/mini, a multi-turn workload (`pdmoe bench serve --dataset multi-turn`:
# each turn's prompt is the whole conversation so far, the next turn sent when the last ends), the
# same run under the proxy's --policy cache_aware and --policy least_loaded, REPS times each,
# alternating. Prints TTFT (cold: a conversation's first turn; warm: the others), the prefix-cache
# hit rate summed over both prefill instances, and the output tokens/s; --json prints the runs.
# Usage: bash bench/cache_routing.sh [REPS] [--json]     (about 30 s per run on an idle machine)
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=3
JSON=0
for a in "$@"; do
    case $a in
    --json) JSON=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *[!0-9]* | '') echo "cache_routing.sh: unknown argument $a (see --help)" >&2; exit 2 ;;
    *) REPS=$a ;;
    esac
done
B=./build/pdmoe
[ -x "$B" ] || make -j2 build/pdmoe >/dev/null
[ -f models/mini/model.safetensors ] || make models/mini >/dev/null
T=$(mktemp -d)
UP=
trap '[ -n "$UP" ] && kill -INT $UP 2>/dev/null; wait 2>/dev/null; rm -rf "$T"' EXIT
PORT=$((18000 + RANDOM % 2000))
run() {   # run POLICY REP
    "$B" up --model models/mini --port $PORT --prefill-instances 2 --decode-instances 1 --threads 1 \
        --policy "$1" > "$T/up-$1-$2.log" 2>&1 &
    UP=$!
    for ((i = 0; i < 600; i++)); do
        curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
        kill -0 $UP 2>/dev/null || { cat "$T/up-$1-$2.log" >&2; exit 1; }
        sleep 0.5
    done
    "$B" bench serve --base-url "http://127.0.0.1:$PORT" --dataset multi-turn --num-prompts 48 --num-turns 4 \
        --gsp-system-prompt-len 200 --random-input-len 30 --random-output-len 8 --max-concurrency 3 \
        --metrics-url "http://127.0.0.1:$((PORT + 1)),http://127.0.0.1:$((PORT + 2))" --json \
        > "$T/bench-$1-$2.json" 2> "$T/bench-$1-$2.err" || { cat "$T/bench-$1-$2.err" >&2; exit 1; }
    kill -INT $UP
    wait $UP || true
    UP=
}
for ((r = 1; r <= REPS; r++)); do
    run cache_aware $r
    run least_loaded $r
done
python3 - "$T" "$REPS" "$JSON" <<'PY'
import json, sys
t, reps, as_json = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
rows = []
for r in range(1, reps + 1):
    for p in ("cache_aware", "least_loaded"):
        d = json.load(open("%s/bench-%s-%d.json" % (t, p, r)))
        rows.append({"policy": p, "rep": r, "ttft_mean_ms": d["ttft"]["mean_ms"],
                     "ttft_cold_ms": d["ttft_cold"]["mean_ms"], "ttft_warm_ms": d["ttft_warm"]["mean_ms"],
                     "hit_rate": d["prefix_cache_hit_rate"], "output_tokens_per_s": d["output_throughput"],
                     "completed": d["completed"], "failed": d["failed"]})
mean = lambda p, k: sum(x[k] for x in rows if x["policy"] == p) / reps
summary = {k: mean("cache_aware", k) / mean("least_loaded", k)
           for k in ("ttft_mean_ms", "ttft_warm_ms", "hit_rate", "output_tokens_per_s")}
if as_json:
    print(json.dumps({"runs": rows, "cache_aware_over_least_loaded": summary}, indent=2))
else:
    print("pdmoe up: 2 prefill + 1 decode instances of models/mini; bench serve --dataset multi-turn, 12 "
          "conversations of 4 turns, 3 at a time")
    print("%-13s %4s %14s %13s %13s %9s %14s" % ("policy", "rep", "TTFT mean ms", "cold ms", "warm ms", "hit rate",
                                                  "output tok/s"))
    for x in rows:
        print("%-13s %4d %14.0f %13.0f %13.0f %9.3f %14.1f" % (x["policy"], x["rep"], x["ttft_mean_ms"],
              x["ttft_cold_ms"], x["ttft_warm_ms"], x["hit_rate"], x["output_tokens_per_s"]))
    print("cache_aware / least_loaded (means): TTFT %.2f, warm TTFT %.2f, hit rate %.2f, output tokens/s %.2f"
          % (summary["ttft_mean_ms"], summary["ttft_warm_ms"], summary["hit_rate"], summary["output_tokens_per_s"]))
bad = [x for x in rows if x["failed"]]
sys.exit(1 if bad else 0)
PY

#!/bin/sh
# The aggregated model against pdmoe's engine on this machine: calibrate, then one colocated
# `pdmoe serve` (prefill and decode in the same steps, chunked by --max-num-batched-tokens) under
# `pdmoe bench serve --request-rate inf --max-concurrency C`, against `pdmoe plan --aggregated
# dp=1 ... --concurrency C`. Writes (or replaces) the section "Aggregated closed loop on this
# machine" of OUT (the table; a reading of its rows is written by hand after a run).
# Usage: tools/validation-agg.sh [OUT]   (default docs/validation.md; a few minutes on an idle machine)
set -eu
cd "$(dirname "$0")/.."
OUT=${1:-docs/validation.md}
B=./build/pdmoe
PORT=${PDMOE_VALIDATION_PORT:-8350}
[ -x "$B" ] || make -j2 build/pdmoe >/dev/null
[ -f models/mini/model.safetensors ] || "$B" gen-model --preset v4-flash-mini --out models/mini >/dev/null
[ -f "$OUT" ] || { echo "validation-agg: $OUT does not exist; run tools/validation.sh first" >&2; exit 1; }
T=$(mktemp -d)
SRV=
cleanup() {
    [ -n "$SRV" ] && kill -INT "$SRV" 2>/dev/null && wait "$SRV" 2>/dev/null
    rm -rf "$T"
}
trap cleanup EXIT INT TERM

. tools/validation-lib.sh

LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)
# calibrate refuses to write a fit that a busy machine leaves undetermined: up to three tries
n=0
until "$B" calibrate --model models/mini --threads 1 --out "$T/local-cpu.json" 2> "$T/calibrate.log"; do
    n=$((n + 1))
    [ $n -lt 3 ] || { echo "validation-agg: pdmoe calibrate failed three times:" >&2; tail -3 "$T/calibrate.log" >&2; exit 1; }
done

"$B" serve --model models/mini --port "$PORT" --threads 1 --max-num-seqs 16 --max-num-batched-tokens 512 \
    --max-model-len 2048 > "$T/serve.log" 2>&1 &
SRV=$!
i=0
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; do
    i=$((i + 1))
    [ $i -lt 600 ] || { echo "validation-agg: pdmoe serve did not become healthy" >&2; cat "$T/serve.log" >&2; exit 1; }
    sleep 0.1
done

ROWS=
for C in 1 2 4 8; do
    # bench serve's requests are all alike and its clients start together: the lockstep loop, over
    # the same number of requests; the random-phase loop (mean value analysis) beside it
    closed_loop "$C" "$PORT" "$PORT" "$PORT" --aggregated dp=1,tp=1,instances=1 --phase lockstep \
        --num-prompts $((16 * C))
    random_loop "$C" --aggregated dp=1,tp=1,instances=1
    ROWS="$ROWS$(loop_row "$C")
"
done
LOAD1=$(cut -d' ' -f1-3 /proc/loadavg)

{
    echo "## Aggregated closed loop on this machine (one colocated \`pdmoe serve\` against \`plan --aggregated\`)"
    echo
    echo "Measured $(date -u +%Y-%m-%d) (commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown); $(cpu_desc)) by"
    echo "\`tools/validation-agg.sh\`, load average $LOAD0 before and $LOAD1 after (1, 5, 15 minutes; the machine"
    echo "has $(nproc) cores), which calibrates again for this section alone:"
    echo
    echo '```'
    sed 's/^  //' "$T/calibrate.log" | grep -E '^(fitted|PD path)'
    echo '```'
    echo
    echo "One \`pdmoe serve --threads 1 --max-num-seqs 16 --max-num-batched-tokens 512\` without a KV role: its"
    echo "scheduler puts every running request's next token and the prompts admitted in the same step (whole prompts"
    echo "while their tokens fit the budget), as an aggregated instance's chunked prefill does. C clients, each"
    echo "sending its next request when its last one finishes (\`bench serve --request-rate inf --max-concurrency C"
    echo "--input-len 48 --output-len 64 --num-prompts 16C --prompts text\`, straight to the server, no proxy), against"
    echo "\`pdmoe plan --aggregated dp=1,tp=1,instances=1 --max-num-seqs 16 --max-num-batched-tokens 512 --isl N"
    echo "--osl 64 --concurrency C --phase lockstep --num-prompts 16C --json\` (its \`closed_loop\` object: the"
    echo "lockstep loop of lockstep.c, run over as many requests as bench serve sends: its clients send requests"
    echo "all alike and start together), and with \`--phase random\` (the mean value analysis of agg.c, the clients"
    echo "spread over the cycle). Means. The decode batch and step measured are the server's decode-only steps (its"
    echo "\`pdmoe_engine_step*_total{kind=\"decode\"}\` counters over the run), the model's step is at that batch"
    echo "rounded; the phase column names the prediction whose decode batch is nearer the measured one."
    echo
    loop_header
    printf "%s" "$ROWS"
} > "$T/agg.md"

awk -v f="$T/agg.md" '
    function put() { while ((getline l < f) > 0) print l; print ""; done = 1 }
    /^## Aggregated closed loop on this machine/ { put(); skip = 1; next }
    skip && /^## / { skip = 0 }
    !done && /^## The KV hand-off across a shaped link/ { put() }
    !skip { print }
    END { if (!done) { print ""; put() } }' "$OUT" > "$T/out.md"
cp "$T/out.md" "$OUT"
echo "wrote the aggregated closed-loop section of $OUT"

# Sourced by tools/validation.sh and tools/validation-agg.sh: what both measure and read the same way.
# Needs $B (the pdmoe binary) and $T (a scratch directory). Also by the V4 fit scripts (tools/v4-*.sh),
# which start with v4_setup.

# v4_setup [--json]: the V4 fit scripts' start: $B (built if missing), $JSON (1 with --json, else 0)
# and a scratch directory $T, removed when the script exits.
v4_setup() {
    B=./build/pdmoe
    [ -x "$B" ] || make -j2 build/pdmoe >/dev/null
    JSON=0
    [ "${1:-}" = "--json" ] && JSON=1
    T=$(mktemp -d)
    trap 'rm -rf "$T"' EXIT INT TERM
}

# cpu_desc: this machine in a few words, for the sections' headers (the CPU model, its cores, AMX or not).
cpu_desc() {
    printf '%s, %s cores, %s' "$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')" "$(nproc)" \
        "$(grep -qw amx_int8 /proc/cpuinfo && echo "AMX-INT8" || echo "no AMX")"
}

num() { grep -o "\"$1\": [-0-9.e+]*" "$2" | head -1 | sed 's/.*: //'; }
metric() { curl -sf "http://127.0.0.1:$1/metrics" | awk -v k="$2" '$1 == k { print $2 }'; }
mean() { grep "^  $1 " "$2" | head -1 | sed 's/.* mean *\([0-9.]*\).*/\1/'; }
err() { awk -v p="$1" -v m="$2" 'BEGIN { printf "%+.1f%%", (p / m - 1) * 100 }'; }

# decode_steps PORT: the decode-only steps of the server on PORT so far: "count seconds sequences"
# (its pdmoe_engine_step*_total{kind="decode"} counters).
decode_steps() {
    curl -sf "http://127.0.0.1:$1/metrics" | awk '
        $1 == "pdmoe_engine_steps_total{kind=\"decode\"}" { n = $2 }
        $1 == "pdmoe_engine_step_seconds_total{kind=\"decode\"}" { s = $2 }
        $1 == "pdmoe_engine_step_sequences_total{kind=\"decode\"}" { q = $2 }
        END { print n + 0, s + 0, q + 0 }'
}

# closed_loop C URL_PORT METRICS_PORT DECODE_PORT PLAN_LAYOUT_FLAGS...: C clients (`bench serve
# --request-rate inf --max-concurrency C`, 48 words in, 64 tokens out) against the endpoint on
# URL_PORT, the mean prompt tokens per request read from METRICS_PORT's counters, then `pdmoe plan`
# with the layout flags at --concurrency C on $T/local-cpu.json. Sets isl, the prediction (pt TTFT
# ms, pp TPOT ms, po output tokens/s, pb batch, pw prefill wait ms, lim what limits the batch), the
# measurement (mt, mp, mo), and the decode-only steps of the server on DECODE_PORT over the run: ms
# their mean time (ms), mb their mean batch, ps the model's step at that batch rounded (ms).
closed_loop() {
    _c=$1 _url=$2 _mp=$3 _dp=$4
    shift 4
    _before=$(metric "$_mp" pdmoe_prompt_tokens_total)
    _reqs_before=$(metric "$_mp" pdmoe_requests_total)
    _steps_before=$(decode_steps "$_dp")
    "$B" bench serve --url "http://127.0.0.1:$_url" --model mini --request-rate inf --max-concurrency "$_c" \
        --input-len 48 --output-len 64 --num-prompts $((16 * _c)) --prompts text > "$T/closed.txt"
    _after=$(metric "$_mp" pdmoe_prompt_tokens_total)
    _reqs_after=$(metric "$_mp" pdmoe_requests_total)
    _steps_after=$(decode_steps "$_dp")
    isl=$(( (_after - _before) / (_reqs_after - _reqs_before) ))
    "$B" plan --model models/mini --hardware "$T/local-cpu.json" --nodes 1 "$@" --mtp off --kv-cache-dtype bf16 \
        --max-num-batched-tokens 512 --max-num-seqs 16 --max-model-len 2048 --isl "$isl" --osl 64 \
        --concurrency "$_c" --json > "$T/plan.json"
    sed -n '/"closed_loop"/,$p' "$T/plan.json" > "$T/closed.json"
    pt=$(awk -v s="$(num ttft_s "$T/closed.json")" 'BEGIN { printf "%.1f", s * 1000 }')
    pp=$(awk -v s="$(num tpot_s "$T/closed.json")" 'BEGIN { printf "%.2f", s * 1000 }')
    po=$(awk -v s="$(num output_tokens_per_s "$T/closed.json")" 'BEGIN { printf "%.1f", s }')
    pb=$(awk -v s="$(num batch "$T/closed.json")" 'BEGIN { printf "%.2f", s }')
    pw=$(awk -v s="$(num wait_s "$T/closed.json")" 'BEGIN { printf "%.1f", s * 1000 }')
    lim=$(grep -o '"limit": "[^"]*"' "$T/closed.json" | sed 's/.*: "//; s/"//')
    mt=$(mean TTFT "$T/closed.txt")
    mp=$(mean TPOT "$T/closed.txt")
    mo=$(grep -o 'output throughput [0-9.]*' "$T/closed.txt" | sed 's/.* //')
    set -- $_steps_before $_steps_after
    ms=$(awk -v n="$(($4 - $1))" -v s0="$2" -v s1="$5" 'BEGIN { printf "%.2f", (n > 0 ? (s1 - s0) / n * 1000 : 0) }')
    mb=$(awk -v n="$(($4 - $1))" -v q="$(($6 - $3))" 'BEGIN { printf "%.2f", (n > 0 ? q / n : 0) }')
    # the model's decode step at that batch: the open loop's TPOT at max-num-seqs = the batch (no MTP)
    _b=$(awk -v b="$mb" 'BEGIN { r = int(b + 0.5); print r < 1 ? 1 : r }')
    "$B" plan --model models/mini --hardware "$T/local-cpu.json" --nodes 1 --prefill dp=1,tp=1,instances=1 \
        --decode dp=1,tp=1,instances=1 --mtp off --kv-cache-dtype bf16 --max-num-batched-tokens 512 \
        --max-num-seqs "$_b" --max-model-len 2048 --isl "$isl" --osl 64 --json > "$T/step.json"
    ps=$(awk -v s="$(num tpot_s "$T/step.json")" 'BEGIN { printf "%.2f", s * 1000 }')
}

# random_loop C PLAN-ARGS...: the random-phase loop's prediction (--phase random, mean value
# analysis) for the workload closed_loop last measured (its $isl): rt (TTFT ms), rp (TPOT ms), ro
# (output tok/s), rb (batch).
random_loop() {
    _c=$1
    shift
    "$B" plan --model models/mini --hardware "$T/local-cpu.json" --nodes 1 "$@" --mtp off --kv-cache-dtype bf16 \
        --max-num-batched-tokens 512 --max-num-seqs 16 --max-model-len 2048 --isl "$isl" --osl 64 \
        --concurrency "$_c" --phase random --json > "$T/random.json"
    sed -n '/"closed_loop"/,$p' "$T/random.json" > "$T/random-closed.json"
    rt=$(awk -v s="$(num ttft_s "$T/random-closed.json")" 'BEGIN { printf "%.1f", s * 1000 }')
    rp=$(awk -v s="$(num tpot_s "$T/random-closed.json")" 'BEGIN { printf "%.2f", s * 1000 }')
    ro=$(awk -v s="$(num output_tokens_per_s "$T/random-closed.json")" 'BEGIN { printf "%.1f", s }')
    rb=$(awk -v s="$(num batch "$T/random-closed.json")" 'BEGIN { printf "%.2f", s }')
}

# The closed-loop tables' header and one row (after closed_loop and random_loop for C): the run's
# phase is the one whose predicted decode batch is nearer the server's measured mean batch.
loop_header() {
    echo "| C | prompt / output tokens | measured: TTFT ms | TPOT ms | output tok/s | decode batch | phase | lockstep: batch | TTFT ms | TPOT ms | tok/s | random phases: batch | TTFT ms | TPOT ms | tok/s | server's decode step ms | model's step ms |"
    echo "|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
}
loop_row() {
    _phase=$(awk -v m="$mb" -v l="$pb" -v r="$rb" 'BEGIN { d = m - l; e = m - r; print (d * d <= e * e ? "lockstep" : "random") }')
    echo "| $1 | $isl / 64 | $mt | $mp | $mo | $mb | $_phase | $pb | $pt ($(err "$pt" "$mt")) | $pp ($(err "$pp" "$mp")) | $po ($(err "$po" "$mo")) | $rb | $rt ($(err "$rt" "$mt")) | $rp ($(err "$rp" "$mp")) | $ro ($(err "$ro" "$mo")) | $ms | $ps ($(err "$ps" "$ms")) |"
}

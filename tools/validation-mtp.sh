#!/bin/sh
# Regenerates the section "Speculative decoding (MTP) on this machine" of docs/validation.md: the
# performance model's TPOT with MTP against the engine's. It calibrates this machine (pdmoe
# calibrate --quick, one thread), writes two v4-flash-mini checkpoints whose MTP draft agrees with
# the main model at R = 0.9 and 0.6 (gen-model --mtp-agreement), runs `pdmoe generate` at batch 1
# and 4 without MTP and with k = 1 and 3 drafts (--spec-stats FILE: the acceptance counters and the
# decode time), feeds the measured acceptance to `pdmoe plan --spec-stats FILE` and tabulates
# predicted against measured TPOT.
# Usage: tools/validation-mtp.sh [OUT]   (default docs/validation.md; a few minutes on an idle machine)
#   PDMOE_VALIDATION_HW=FILE   use this hardware file instead of calibrating
#   PDMOE_VALIDATION_REPEAT=N  runs of each measurement, the fastest kept (default 3)
set -eu
cd "$(dirname "$0")/.."
OUT=${1:-docs/validation.md}
B=./build/pdmoe
REPEAT=${PDMOE_VALIDATION_REPEAT:-3}
OSL=128
[ -x "$B" ] || make -j2 build/pdmoe >/dev/null
[ -f models/mini/model.safetensors ] || "$B" gen-model --preset v4-flash-mini --out models/mini >/dev/null
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT INT TERM

. tools/validation-lib.sh   # num, err

LOAD_BEFORE=$(cut -d' ' -f1 /proc/loadavg)
HW=${PDMOE_VALIDATION_HW:-}
if [ -z "$HW" ]; then
    if ! "$B" calibrate --model models/mini --threads 1 --quick --out "$T/local-cpu.json" 2> "$T/calibrate.log"; then
        cat "$T/calibrate.log" >&2
        exit 1
    fi
    HW=$T/local-cpu.json
fi

# four prompts of English text, each its own (their routing is alike the calibration's)
P1="The old lighthouse keeper climbed the stairs every evening to light the lamp for the ships"
P2="In the spring the farmers planted wheat and barley in the fields along the river valley"
P3="She opened the letter slowly, afraid of what the news from the city might tell her today"
P4="Scientists measured the temperature of the ocean at many depths during the long voyage"

# min A B: the smaller number (A when B is empty)
min() { awk -v a="$1" -v b="${2:-}" 'BEGIN { print (b == "" || a + 0 < b + 0) ? a : b }'; }
# generate ARGS... REPEAT times, the fastest kept: plain_run sets g_wall and g_cpu (ms per decode step,
# wall and the process's CPU time); spec_run (with --spec-stats) the same per output token of a
# sequence, and keeps the counters of the run with the least CPU time in $T/best.json.
plain_run() {
    g_wall= g_cpu=
    i=0
    while [ $i -lt "$REPEAT" ]; do
        "$B" generate "$@" --max-tokens $OSL --threads 1 --print-ids > /dev/null 2> "$T/gen.err" ||
            { cat "$T/gen.err" >&2; exit 1; }
        l=$(sed -n 's/^decode: .* steps of the batch, \([0-9.]*\) ms per step (\([0-9.]*\) ms of CPU time)$/\1 \2/p' "$T/gen.err")
        [ -n "$l" ] || { echo "validation-mtp: no decode timing from generate" >&2; cat "$T/gen.err" >&2; exit 1; }
        g_wall=$(min "${l% *}" "$g_wall")
        g_cpu=$(min "${l#* }" "$g_cpu")
        i=$((i + 1))
    done
}
spec_run() {
    g_wall= g_cpu=
    i=0
    while [ $i -lt "$REPEAT" ]; do
        "$B" generate "$@" --max-tokens $OSL --threads 1 --print-ids --spec-stats "$T/run.json" > /dev/null \
            2> "$T/gen.err" || { cat "$T/gen.err" >&2; exit 1; }
        per=$(awk -v n="$(num decode_tokens "$T/run.json")" -v q="$(num sequences "$T/run.json")" 'BEGIN { print n / q }')
        w=$(awk -v s="$(num decode_s "$T/run.json")" -v n="$per" 'BEGIN { printf "%.3f", s * 1000 / n }')
        c=$(awk -v s="$(num decode_cpu_s "$T/run.json")" -v n="$per" 'BEGIN { printf "%.3f", s * 1000 / n }')
        g_wall=$(min "$w" "$g_wall")
        [ "$(min "$c" "$g_cpu")" != "$c" ] || cp "$T/run.json" "$T/best.json"
        g_cpu=$(min "$c" "$g_cpu")
        i=$((i + 1))
    done
}
# plan_tpot MODEL BATCH ISL FLAGS...: the model's TPOT in ms (p_tpot) and tokens per step (p_tps)
plan_tpot() {
    _m=$1 _b=$2 _isl=$3
    shift 3
    "$B" plan --model "$_m" --hardware "$HW" --nodes 1 --prefill dp=1,tp=1,instances=1 \
        --decode dp=1,tp=1,instances=1 --kv-cache-dtype bf16 --max-num-batched-tokens 512 --max-num-seqs "$_b" \
        --max-model-len 2048 --isl "$_isl" --osl $OSL "$@" --json > "$T/plan.json"
    p_tpot=$(awk -v s="$(num tpot_s "$T/plan.json")" 'BEGIN { printf "%.3f", s * 1000 }')
    p_tps=$(awk -v s="$(num tokens_per_step "$T/plan.json")" 'BEGIN { printf "%.2f", s }')
}
# the measured acceptance per position (accepted / drafted) of $T/best.json
acceptance() {
    tr -d ' \n' < "$T/best.json" | sed 's/.*"num_drafted_tokens_per_pos":\[\([0-9,]*\)\].*"num_accepted_tokens_per_pos":\[\([0-9,]*\)\].*/\1 \2/' |
        awk '{ n = split($1, d, ","); split($2, a, ","); for (j = 1; j <= n; j++) printf "%s%.3f", (j > 1 ? " " : ""), a[j] / d[j] }'
}

ROWS=
for R in 0.9 0.6; do
    M=$T/mini-$R
    "$B" gen-model --preset v4-flash-mini --mtp-agreement "$R" --out "$M" > /dev/null 2>&1
    for BATCH in 1 4; do
        set -- --prompt "$P1"
        [ "$BATCH" = 1 ] || set -- --prompt "$P1" --prompt "$P2" --prompt "$P3" --prompt "$P4"
        isl=$(( $("$B" tokenize --tokenizer "$M/tokenizer.json" --text "$P1" | wc -w) + 1 ))
        plain_run --model "$M" "$@"
        mw=$g_wall mc=$g_cpu
        plan_tpot "$M" "$BATCH" "$isl" --mtp off
        pp=$p_tpot
        ROWS="$ROWS| $R | $BATCH | 0 | | 1 | $pp | $mw | $(err "$pp" "$mw") | $mc | $(err "$pp" "$mc") | | | |
"
        for K in 1 3; do
            spec_run --model "$M" "$@" --speculative-config "{\"method\":\"mtp\",\"num_speculative_tokens\":$K}"
            cp "$T/best.json" "$T/spec-$R-$BATCH-$K.json"
            plan_tpot "$M" "$BATCH" "$isl" --spec-stats "$T/best.json"
            ms=$(awk -v a="$mc" -v b="$g_cpu" 'BEGIN { printf "%.2f", a / b }')
            ps=$(awk -v a="$pp" -v b="$p_tpot" 'BEGIN { printf "%.2f", a / b }')
            ROWS="$ROWS| | | $K | $(acceptance) | $p_tps | $p_tpot | $g_wall | $(err "$p_tpot" "$g_wall") | $g_cpu | $(err "$p_tpot" "$g_cpu") | $ps | $ms | $(err "$ps" "$ms") |
"
        done
    done
done
LOAD_AFTER=$(cut -d' ' -f1 /proc/loadavg)

{
    echo "## Speculative decoding (MTP) on this machine"
    echo
    echo "Measured $(date -u +%Y-%m-%d) (commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown); $(cpu_desc)) by"
    echo "\`tools/validation-mtp.sh\`; load average $LOAD_BEFORE before, $LOAD_AFTER after (2 cores)."
    if awk -v a="$LOAD_BEFORE" -v b="$LOAD_AFTER" 'BEGIN { exit !(a >= 1.5 || b >= 1.5) }'; then
        echo "**Noisy: other processes shared these cores during the run; rerun on an idle machine.**"
    fi
    echo
    if [ -n "${PDMOE_VALIDATION_HW:-}" ]; then
        echo "Hardware file given, not calibrated in this run ($(sed -n 's/^ *"description": "\(.*\)",*$/\1/p' "$PDMOE_VALIDATION_HW" | head -1)); its figures:"
        echo
        echo '```'
        grep -oE '"(memory_bandwidth_Bps|int8_ops|gemm|memory|attention|step_decode_s|token_layer_decode_s|step_prefill_s|token_layer_prefill_s)": *[-0-9.e+]+' \
            "$PDMOE_VALIDATION_HW" | tr '\n' ' ' | sed 's/ $//; s/"//g'
        echo
        echo '```'
    else
        echo "\`pdmoe calibrate --model models/mini --threads 1 --quick\`:"
        echo
        echo '```'
        sed 's/^  //' "$T/calibrate.log" | grep -E '^(fitted|read bandwidth)'
        echo '```'
    fi
    echo
    echo "Two checkpoints of v4-flash-mini whose MTP draft agrees with the main model at R"
    echo "(\`gen-model --mtp-agreement R\`); \`pdmoe generate --threads 1 --max-tokens $OSL --print-ids\` with one prompt"
    echo "(batch 1) or four (batch 4) of English text, without MTP (k = 0: the decode step's time, printed by generate)"
    echo "and with \`--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":k}' --spec-stats FILE\` (decode"
    echo "time over the tokens each sequence produced after its first); the fastest of $REPEAT runs each, by the wall"
    echo "clock and by the process's CPU time (one thread: on an idle machine the two agree; on a busy one the CPU"
    echo "time leaves out the waits for a core, not the memory bandwidth the other processes take). The"
    echo "prediction: \`pdmoe plan --model DIR --hardware FILE --nodes 1 --prefill dp=1,tp=1,instances=1 --decode"
    echo "dp=1,tp=1,instances=1 --kv-cache-dtype bf16 --max-num-seqs BATCH --isl N --osl $OSL\` with \`--mtp off\`, or"
    echo "with \`--spec-stats FILE\` (the same run's measured acceptance: k and each position's rate). Speed-up = plain"
    echo "TPOT / MTP TPOT, both predicted or both measured (CPU time) in this run. Acceptance per position is vLLM's (accepted / drafted rounds: drafts 1 .. j all accepted)."
    echo
    echo "| R | batch | k | acceptance per position (measured) | tokens per step | TPOT predicted ms | measured ms (wall) | error | measured ms (CPU time) | error | speed-up predicted | measured (CPU time) | error |"
    echo "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    printf "%s" "$ROWS"
    echo
    echo "Reading: a CPU decode step is bound by reading the experts its tokens reach; verifying k + 1 tokens"
    echo "per sequence reads the experts of all of them, and each of the k draft passes reads the MTP layer's"
    echo "weights and the LM head again, so on this CPU speculative decoding costs about as much as it saves"
    echo "(docs/perf-model.md, \"Speculative decoding (MTP)\")."
} > "$T/mtp.md"

# the section replaced in place, else put before the shaped-link section, else at the end
if [ -f "$OUT" ]; then
    awk -v f="$T/mtp.md" '
        function put() { while ((getline l < f) > 0) print l; print ""; done = 1 }
        /^## Speculative decoding \(MTP\) on this machine/ { put(); skip = 1; next }
        skip && /^## / { skip = 0 }
        !done && /^## The KV hand-off across a shaped link/ { put() }
        !skip { print }
        END { if (!done) { print ""; put() } }' "$OUT" > "$T/out.md"
    cp "$T/out.md" "$OUT"
else
    cp "$T/mtp.md" "$OUT"
fi
echo "wrote the MTP section of $OUT"

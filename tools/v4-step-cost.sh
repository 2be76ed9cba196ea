#!/bin/sh
# The experiment behind the Lambda cases' pending reasons (validation/published.json): a fixed cost
# per step, the same for prefill and decode, in place of the hardware file's (2-3 ms; the files'
# kernel floor per layer, tools/v4-layer-cost.sh, stays as it is), fitted so that the H100 run's
# lockstep loop gives its published 1,262 output tokens/s, then the B200 run predicted with the
# same cost (its check). Prints the fit and both predictions (--json: as JSON).
# Usage: tools/v4-step-cost.sh [--json]
set -eu
cd "$(dirname "$0")/.."
. tools/validation-lib.sh
v4_setup "$@"

# predict HW S: the Lambda case on HW with S seconds per step; prints output tokens/s, TTFT s, TPOT s
predict() {
    python3 - "$1" "$2" "$T/$1.json" <<'EOF'
import json, sys
hw, s, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
d = json.load(open(f"hardware/{hw}.json"))
d["efficiency"]["step_prefill_s"] = d["efficiency"]["step_decode_s"] = s
json.dump(d, open(out, "w"))
EOF
    ovr=
    [ "$1" = b200 ] && ovr="--quant-override routed_experts=fp4"
    # shellcheck disable=SC2086
    "$B" plan --model deepseek-v4-flash --hardware "$T/$1.json" --nodes 1 --aggregated dp=8,tp=1,instances=1 \
        --quant fp8 $ovr --kv-cache-dtype fp8 --max-num-seqs 32 --max-num-batched-tokens 8192 --max-model-len 9216 \
        --isl 8192 --osl 1024 --concurrency 32 --phase lockstep --num-prompts 512 --json |
        python3 -c 'import json, sys; c = json.load(sys.stdin)["perf"]["closed_loop"]; print(c["output_tokens_per_s"], c["ttft_s"], c["tpot_s"])'
}

# bisect S in [0.002, 0.2] s: the throughput falls as S grows
lo=0.002 hi=0.2 i=0
while [ $i -lt 30 ]; do
    mid=$(awk -v a="$lo" -v b="$hi" 'BEGIN { printf "%.6f", (a + b) / 2 }')
    tok=$(predict h100 "$mid" | cut -d' ' -f1)
    if awk -v t="$tok" 'BEGIN { exit !(t > 1262) }'; then lo=$mid; else hi=$mid; fi
    i=$((i + 1))
done
S=$lo
set -- $(predict h100 "$S")
h_tok=$1 h_ttft=$2 h_tpot=$3
set -- $(predict b200 "$S")
b_tok=$1 b_ttft=$2 b_tpot=$3
if [ $JSON = 1 ]; then
    printf '{"step_s": %s, "h100": {"published": 1262, "output_tokens_per_s": %s, "ttft_s": %s, "tpot_s": %s},' \
        "$S" "$h_tok" "$h_ttft" "$h_tpot"
    printf ' "b200": {"published": 1222, "output_tokens_per_s": %s, "ttft_s": %s, "tpot_s": %s, "ratio": %s}}\n' \
        "$b_tok" "$b_ttft" "$b_tpot" "$(awk -v p="$b_tok" 'BEGIN { printf "%.4f", p / 1222 }')"
else
    awk -v s="$S" -v ht="$h_tok" -v hf="$h_ttft" -v hp="$h_tpot" -v bt="$b_tok" -v bf="$b_ttft" -v bp="$b_tpot" 'BEGIN {
        printf "per-step cost fitted on Lambda H100 (1,262 output tokens/s): %.1f ms\n", s * 1e3
        printf "H100 (the fit):   %6.0f output tokens/s, TTFT %6.0f ms (published 2,463), TPOT %5.1f ms (published 23.0)\n", ht, hf * 1e3, hp * 1e3
        printf "B200 (the check): %6.0f output tokens/s = %.2f x the published 1,222, TTFT %6.0f ms (published 1,701), TPOT %5.1f ms (published 24.5)\n", bt, bt / 1222, bf * 1e3, bp * 1e3
    }'
fi

#!/bin/bash
# The engine against a float64 oracle of DeepSeek-V4's official forward (tools/oracle/v4_oracle.py;
# docs/validation.md), after the oracle's self-test. Asserts, on dense checkpoints
# (tests/oracle/dense.json: every expert active, the indexer keeps every entry, so no near-tie can
# flip a choice; sharpened by sharpen.py so that the Sinkhorn count and, on seed 4, the SwiGLU
# clamp act), four seeds, both KV cache dtypes: the float reference mode within 1 - cos 1e-8 (bf16
# cache) or 1e-5 (fp8) of the oracle at every position with the same greedy ids for 16 steps; W8A8
# at cosine >= 0.999 on the same tokens (reported on seed 4). Then reports, without asserting, the
# sparse presets v4-tiny and v4-flash-mini (models/mini), with the router and indexer margins
# where a position differs. Needs build/oracle-dump, build/pdmoe and numpy; about a minute.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
"$PY" -c 'import numpy' 2>/dev/null || PY=/usr/bin/python3   # Debian's python3-numpy
"$PY" -c 'import numpy' || { echo "tests/oracle/run.sh: numpy is needed (apt-get install python3-numpy)" >&2; exit 1; }
make -s build/pdmoe build/oracle-dump
# ORACLE_BUILD=build-san runs the engine's side under AddressSanitizer + UBSan (make SAN=1)
D=build/oracle-dump
if [ "${ORACLE_BUILD:-build}" = build-san ]; then
  make -s SAN=1 build-san/oracle-dump
  D=build-san/oracle-dump
  export ASAN_OPTIONS=detect_leaks=1 LSAN_OPTIONS=suppressions=$PWD/tests/lsan.supp
fi
"$PY" tests/oracle/selftest.py   # the oracle's own pieces against values worked by hand
T=$(mktemp -d /tmp/pdmoe-oracle-XXXXXX)
trap 'rm -rf "$T"' EXIT
ids() {   # ids N VOCAB SEED: N token ids drawn with a fixed seed
  "$PY" -c "import random,sys; r=random.Random($3); print(','.join(str(r.randrange($2)) for _ in range($1)))"
}
fail=0
# ORACLE_SEEDS and ORACLE_SPARSE=0 shorten a run by hand (a bisection); CI runs the defaults
for seed in ${ORACLE_SEEDS:-1 2 3 4}; do
  m="$T/dense-$seed"
  ./build/pdmoe gen-model --preset tests/oracle/dense.json --out "$m" --seed "$seed" 2>/dev/null
  # mHC comb logits of std 4, so the Sinkhorn count shows; seed 4 also with expert gate and up
  # values 8x larger, so the SwiGLU clamp acts (on about one value in eight). Its FFN activations
  # then span two decades, which one int8 scale per token resolves worse (W8A8 cosine down to
  # 0.998): there W8A8 is reported, not asserted
  gain=$([ "$seed" = 4 ] && echo 8 || echo 1)
  "$PY" tests/oracle/sharpen.py "$m" --swiglu-gain "$gain"
  # seed 2 runs its prompt in prefill chunks of 5 tokens, the others in one step
  chunk=$([ "$seed" = 2 ] && echo 5 || echo 0)
  checks=()
  for kv in bf16 fp8; do
    "$D" --model "$m" --ids "$(ids 48 512 "$seed")" --steps 16 --chunk "$chunk" --mode ref \
        --kv-cache-dtype "$kv" --out "$T/ref-$kv-$seed.bin"
    all=$(head -1 "$T/ref-$kv-$seed.bin" | "$PY" -c 'import json,sys; print(",".join(map(str, json.load(sys.stdin)["ids"])))')
    "$D" --model "$m" --ids "$all" --mode w8a8 --kv-cache-dtype "$kv" --out "$T/w8a8-$kv-$seed.bin"
    # bf16: the engine stores what the oracle rounds, so only float32 against float64 remains
    # (1 - cos ~1e-10 measured): 1e-8 is asked, tighter than the issue's 1e-5, so that a small
    # equation error shows (half the Sinkhorn rounds: 2e-6); fp8 adds rounding flips of e4m3
    # values near a midpoint (up to 1.5e-7 measured): the issue's 0.99999
    min=$([ "$kv" = bf16 ] && echo 0.99999999 || echo 0.99999)
    checks+=(--check "$T/ref-$kv-$seed.bin=$min")
    if [ "$gain" = 1 ]; then
      checks+=(--check "$T/w8a8-$kv-$seed.bin=0.999:nogreedy")
    else
      checks+=(--report "$T/w8a8-$kv-$seed.bin")
    fi
  done
  echo "-- dense checkpoint, seed $seed$([ "$gain" = 1 ] || echo ", SwiGLU gain $gain")"
  "$PY" tests/oracle/compare.py --model "$m" --flag-cos 0.999 "${checks[@]}" || fail=1
done
# the sparse presets: reported, not asserted (a near-tie may flip a choice either way)
if [ "${ORACLE_SPARSE:-1}" = 0 ]; then
  [ "$fail" = 0 ] && echo "tests/oracle/run.sh: the engine agrees with the oracle on every dense checkpoint"
  exit "$fail"
fi
./build/pdmoe gen-model --preset v4-tiny --out "$T/tiny" --seed 7 2>/dev/null
"$D" --model "$T/tiny" --ids "$(ids 96 512 4)" --steps 16 --mode ref --out "$T/tiny-ref.bin"
all=$(head -1 "$T/tiny-ref.bin" | "$PY" -c 'import json,sys; print(",".join(map(str, json.load(sys.stdin)["ids"])))')
"$D" --model "$T/tiny" --ids "$all" --mode w8a8 --out "$T/tiny-w8a8.bin"
echo "-- v4-tiny (sparse: 16 experts, top-4; index_topk 4), reported"
"$PY" tests/oracle/compare.py --model "$T/tiny" --report "$T/tiny-ref.bin" --report "$T/tiny-w8a8.bin" --flag-cos 0.9999
if [ -f models/mini/model.safetensors ]; then
  "$D" --model models/mini --ids "$(ids 136 8192 5)" --steps 8 --mode ref --out "$T/mini-ref.bin"
  echo "-- v4-flash-mini (models/mini; sparse: 256 experts, top-6), reported"
  "$PY" tests/oracle/compare.py --model models/mini --report "$T/mini-ref.bin" --flag-cos 0.9999
else
  echo "-- v4-flash-mini: models/mini is not generated (make models/mini/model.safetensors); not reported"
fi
if [ "$fail" != 0 ]; then
  echo "tests/oracle/run.sh: FAILED (above)"
  exit 1
fi
echo "tests/oracle/run.sh: the engine agrees with the oracle on every dense checkpoint"

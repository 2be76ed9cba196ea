#!/bin/bash
# The release format end to end on v4-flash-mini (issue 16; v4-tiny's is in `make test`,
# tests/engine/test_release.c): `pdmoe gen-model --format release` writes the model in DeepSeek's
# released layout (FP8 e4m3 + ue8m0 block scales, FP4 e2m1 routed experts, four shards and the
# index), `pdmoe convert` turns it into W8A8, and `pdmoe generate` on the release directly and on
# the conversion must print the same ids and logits digests for fixed prompts (that the planner
# counts what the engine loads, for both, is tested on v4-tiny in `make test`).
# Usage: bash tests/release/roundtrip.sh     (about a minute on an idle machine)
set -euo pipefail
cd "$(dirname "$0")/../.."
B=./build/pdmoe
[ -x "$B" ] || make -j2 build/pdmoe >/dev/null
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
"$B" gen-model --preset v4-flash-mini --format release --out "$T/release" > /dev/null
"$B" convert --checkpoint "$T/release" --quantization w8a8 --out "$T/w8a8" 2> "$T/convert.err" > /dev/null
grep -i "peak" "$T/convert.err" | tail -1
prompts=(--prompt "The history of the sea is long" --prompt "def fibonacci(n):" --prompt "深度求索")
for m in release w8a8; do
    "$B" generate --model "$T/$m" "${prompts[@]}" --max-tokens 24 --print-ids --threads 2 > "$T/$m.out"
done
if ! cmp -s "$T/release.out" "$T/w8a8.out"; then
    echo "roundtrip.sh: generate on the release and on its W8A8 conversion differ:" >&2
    diff "$T/release.out" "$T/w8a8.out" >&2 || true
    exit 1
fi
n=$(grep -c . "$T/release.out")
echo "release -> convert -> generate: the same ids and logits digests as generate on the release ($n lines, 3 prompts x 24 tokens)"

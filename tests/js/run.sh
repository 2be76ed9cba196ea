#!/bin/bash
# Starts pdmoe serve on models/mini, runs the official openai npm client against it, stops it.
set -euo pipefail
cd "$(dirname "$0")"
[ -d node_modules/openai ] || npm install --silent --no-audit --no-fund
top=../..
port=18431
"$top/build/pdmoe" serve --model "$top/models/mini" --served-model-name mini --port $port --threads 2 &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
for i in $(seq 100); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  sleep 0.1
done
node openai_stream.mjs "http://127.0.0.1:$port" mini

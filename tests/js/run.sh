#!/bin/bash
# Starts a local PD cluster (pdmoe up: prefill, decode, proxy) on models/mini, runs the official
# openai npm client against the proxy, and stops the cluster.
set -euo pipefail
cd "$(dirname "$0")"
[ -d node_modules/openai ] || npm install --silent --no-audit --no-fund
top=../..
port=18431
ready=$(mktemp)
(cd "$top" && exec ./build/pdmoe up --model models/mini --port $port >"$ready") &
up=$!
trap 'kill -INT $up 2>/dev/null || true; wait $up 2>/dev/null || true; rm -f "$ready"' EXIT
# up prints its endpoint once every instance answers /health
for i in $(seq 600); do
  grep -q 'Ctrl-C' "$ready" && break
  sleep 0.1
done
grep -q 'Ctrl-C' "$ready" || { echo "pdmoe up did not become ready" >&2; exit 1; }
node openai_stream.mjs "http://127.0.0.1:$port" mini

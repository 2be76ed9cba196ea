#!/bin/bash
# make test-cluster: the seed's cluster shape on four hosts (network namespaces of this machine,
# tests/cluster/hosts.sh), launched by one `pdmoe up --plan plan.json --hosts ...` on host 1:
# prefill = one EP2 group across hosts 1 and 2, decode = one EP2 group across hosts 3 and 4, the
# proxy on host 1. Checks, each failing the run:
#   1. tokens through the cluster equal `pdmoe generate`'s (one colocated process) for each prompt;
#   2. every KV pull crossed hosts: the decode group's per-peer metrics name producer addresses of
#      hosts 1-2, each pulled by a rank on host 3 or 4, no failure, no recompute;
#   3. every pool is full again afterwards (blocks free = total), no lease left on the prefill side;
#   4. a host lost: every process of host 3 is killed mid-stream and the launcher cannot reach it
#      for a while: the stream ends with an error event and [DONE] (never a bare cut), the prefill
#      side keeps answering, the proxy ejects the decode instance, a request meanwhile gets a JSON
#      error; `pdmoe up` reports the loss; once the host is back, the group is restarted and serves
#      the same tokens again;
#   5. Ctrl-C to `pdmoe up` leaves no process in any namespace;
#   6. a host nobody can reach, and a port already taken on a host, stop `pdmoe up` with an error
#      naming that host (and port);
#   7. the same layout started by hand: `pdmoe plan --emit pdmoe`'s script, `sh launch.sh HOST` on
#      each host, serves the same tokens (hosts 2 and 4 start nothing: their group's mpirun does).
# Needs root and iproute2; every namespace and link is removed on exit, pass or fail.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "$(id -u)" = 0 ] || { echo "test-cluster: needs root (network namespaces)" >&2; exit 1; }
source tests/cluster/hosts.sh
B=$PWD/build/pdmoe
M=$PWD/models/mini
T=$(mktemp -d /tmp/pdmoe-cluster-test-XXXXXX)
fail() { echo "test-cluster: FAIL: $*" >&2; exit 1; }
ok() { echo "test-cluster: ok: $*"; }

cluster_up 4
# after cluster_up, whose own trap this replaces: the logs are kept where CI prints them from
trap 'cluster_down; mkdir -p /tmp/pdmoe-cluster-logs; cp "$T"/*.log /tmp/pdmoe-cluster-logs/ 2>/dev/null; rm -rf "$T"' EXIT
A=("" "${HOST_ADDR[1]}" "${HOST_ADDR[2]}" "${HOST_ADDR[3]}" "${HOST_ADDR[4]}")
HOSTS="${A[1]},${A[2]},${A[3]},${A[4]}"
PORT=8000 PREFILL=8001 DECODE=8002

# A hardware file of four one-card nodes (one CPU each), and the plan the cluster runs.
python3 - "$T/hw.json" <<'PY'
import json, sys
h = json.load(open("hardware/h100.json"))
h.update(name="test cluster: 4 namespace hosts", description="tests/cluster: one CPU card per host",
         cluster_nodes=4, cards_per_node=1)
h["card"].update(name="CPU", memory_bytes=1600000000)
h["runtime_overhead_bytes"] = {"prefill": 2e8, "decode": 2e8}
json.dump(h, open(sys.argv[1], "w"), indent=1)
PY
$B plan --model "$M" --hardware "$T/hw.json" --nodes 4 --prefill dp=2,instances=1 --decode dp=2,instances=1 \
    --max-model-len 2048 --max-num-seqs 8 --kv-cache-dtype bf16 --mtp off --json > "$T/plan.json"

start_up() {   # start_up LOG [HOSTS]: pdmoe up on host 1 in the background; UP_PID
    ( on_exec 1 "$B" up --model "$M" --plan "$T/plan.json" --hosts "${2:-$HOSTS}" --host "${A[1]}" --port $PORT \
        --threads 1 ) > "$1" 2>&1 &
    UP_PID=$!
}
wait_ready() {
    for _ in $(seq 600); do
        grep -q "Ctrl-C stops everything" "$1" && return 0
        kill -0 "$UP_PID" 2>/dev/null || return 1
        sleep 0.2
    done
    return 1
}
complete() {   # complete PROMPT: the token ids of a greedy completion through the proxy
    on 1 curl -s -m 120 "http://${A[1]}:$PORT/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"model\":\"mini\",\"prompt\":\"$1\",\"max_tokens\":12,\"temperature\":0,\"return_token_ids\":true}" |
        python3 -c 'import json,sys; d=json.load(sys.stdin); print(" ".join(map(str, d["choices"][0]["token_ids"])))'
}
metrics() {    # metrics HOST PORT
    on 1 curl -s -m 10 "http://$1:$2/metrics"
}
metric() {     # metric NAME < metrics text: the value of the first sample of NAME (labels included)
    awk -v n="$1" '$1 == n { print $2; exit }'
}

PROMPTS=("The quick brown fox" "Once upon a time, in a small town by the sea" "x" "Numbers: 1 2 3 4 5 6 7 8 9")

# ---- 1. tokens equal pdmoe generate's
start_up "$T/up.log"
wait_ready "$T/up.log" || { cat "$T/up.log"; fail "pdmoe up did not become ready"; }
ok "pdmoe up started prefill EP2 on ${A[1]},${A[2]} and decode EP2 on ${A[3]},${A[4]}"
for p in "${PROMPTS[@]}"; do
    want=$($B generate --model "$M" --prompt "$p" --max-tokens 12 --print-ids --threads 1 2>/dev/null |
           sed -n 's/^\[0\] ids //p')
    got=$(complete "$p")
    [ -n "$want" ] && [ "$got" = "$want" ] || fail "\"$p\": cluster $got, pdmoe generate $want"
done
ok "${#PROMPTS[@]} prompts: tokens equal pdmoe generate's"

# ---- 2. every pull crossed hosts
metrics "${A[3]}" $DECODE > "$T/decode.prom"
python3 - "$T/decode.prom" "${A[1]}" "${A[2]}" "${A[3]}" "${A[4]}" "${#PROMPTS[@]}" <<'PY' || fail "KV pulls (above)"
import re, sys
text = open(sys.argv[1]).read()
producers, consumers, want = sys.argv[2:4], sys.argv[4:6], int(sys.argv[6])
rows = re.findall(r'^pdmoe_kv_peer_(transfers|transfer_failures|transfer_bytes)_total\{peer="([^"]+)",rank="(\d+)"\} (\d+)$',
                  text, re.M)
pulls = sum(int(v) for m, _, _, v in rows if m == "transfers")
bad = [r for r in rows if r[0] == "transfer_failures" and int(r[3])]
for m, peer, rank, v in rows:
    host = peer.rsplit(":", 1)[0]
    if host not in producers:
        sys.exit(f"pull from {peer}: not a prefill host {producers}")
    if consumers[int(rank)] == host:
        sys.exit(f"rank {rank} pulled from its own host {host}")
rec = re.search(r"^pdmoe_kv_recomputes_total (\d+)$", text, re.M)
if pulls != want or bad or not rec or int(rec.group(1)):
    sys.exit(f"pulls {pulls} (want {want}), failures {bad}, recomputes {rec and rec.group(1)}\n" + text)
ranks = sorted({r[2] for r in rows})
print(f"test-cluster: ok: {pulls} pulls, all across hosts: " +
      ", ".join(f"{p} -> rank {r} ({consumers[int(r)]})" for m, p, r, v in rows if m == "transfers"))
PY

# ---- 3. every pool full again
for hp in "${A[1]} $PREFILL" "${A[3]} $DECODE"; do
    for _ in $(seq 50); do
        metrics $hp > "$T/m.prom"
        free=$(metric pdmoe_kv_blocks_free < "$T/m.prom")
        total=$(metric pdmoe_kv_blocks_capacity < "$T/m.prom")
        leases=$(metric pdmoe_kv_leases < "$T/m.prom")
        [ "$free" = "$total" ] && [ "$leases" = 0 ] && break
        sleep 0.1
    done
    [ "$free" = "$total" ] && [ "$leases" = 0 ] || fail "$hp: $free of $total blocks free, $leases leases"
done
ok "every pool full again (both ranks of both groups), no lease left"

# ---- 4. host 3 lost mid-stream
on 1 curl -s -N -m 120 "http://${A[1]}:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model":"mini","prompt":"A long story","max_tokens":1500,"temperature":0,"stream":true}' > "$T/stream.txt" &
CURL=$!
for _ in $(seq 100); do [ "$(grep -c '^data: {' "$T/stream.txt")" -ge 3 ] && break; sleep 0.1; done
[ "$(grep -c '^data: {' "$T/stream.txt")" -ge 3 ] || fail "the stream did not start: $(head -c 300 "$T/stream.txt")"
cluster_host_down 3
cluster_kill 3
wait $CURL || true
grep -v '^$' "$T/stream.txt" | tr -d '\r' | tail -n 2 > "$T/end.txt"
head -n 1 "$T/end.txt" | grep -q '^data: {"error":' && [ "$(tail -n 1 "$T/end.txt")" = "data: [DONE]" ] ||
    fail "the cut stream does not end with an error event and [DONE]: $(tail -c 300 "$T/stream.txt")"
ok "host 3 lost mid-stream: the client got an error event and [DONE] after $(grep -c '^data: {' "$T/stream.txt") events"
on 1 curl -sf -m 5 "http://${A[1]}:$PREFILL/health" > /dev/null || fail "the prefill group stopped answering"
code=$(on 1 curl -s -m 60 -o "$T/err.json" -w '%{http_code}' "http://${A[1]}:$PORT/v1/completions" \
    -H 'Content-Type: application/json' -d '{"model":"mini","prompt":"meanwhile","max_tokens":4,"temperature":0}')
[ "${code:0:1}" = 5 ] && python3 -c 'import json,sys; assert json.load(open(sys.argv[1]))["error"]["message"]' "$T/err.json" ||
    fail "a request while the decode group is lost: HTTP $code $(head -c 300 "$T/err.json")"
ok "while host 3 is lost: the prefill group answers, a request gets HTTP $code with a JSON error"
for _ in $(seq 50); do
    metrics "${A[1]}" $PORT > "$T/proxy.prom"
    grep -q "^pdmoe_proxy_instance_up{role=\"decode\",instance=\"${A[3]}:$DECODE\"} 0" "$T/proxy.prom" && break
    sleep 0.1
done
grep -q "^pdmoe_proxy_instance_up{role=\"decode\",instance=\"${A[3]}:$DECODE\"} 0" "$T/proxy.prom" ||
    fail "the proxy did not eject the decode instance: $(grep instance_up "$T/proxy.prom")"
for _ in $(seq 100); do
    grep -q "decode instance 0 (EP group, rank 0 on ${A[3]}:$DECODE) .*restarting it" "$T/up.log" && break
    sleep 0.1
done
grep -q "decode instance 0 (EP group, rank 0 on ${A[3]}:$DECODE) .*restarting it" "$T/up.log" ||
    fail "pdmoe up did not report the lost decode group: $(tail -n 5 "$T/up.log")"
ok "the proxy ejected ${A[3]}:$DECODE; pdmoe up reported it: $(grep -m1 "decode instance 0 .*restarting" "$T/up.log")"
sleep 2
cluster_host_back 3
for _ in $(seq 300); do
    on 1 curl -sf -m 2 "http://${A[3]}:$DECODE/health" > /dev/null 2>&1 && break
    sleep 0.2
done
on 1 curl -sf -m 2 "http://${A[3]}:$DECODE/health" > /dev/null || fail "the decode group did not come back: $(tail -n 5 "$T/up.log")"
want=$($B generate --model "$M" --prompt "${PROMPTS[0]}" --max-tokens 12 --print-ids --threads 1 2>/dev/null |
       sed -n 's/^\[0\] ids //p')
got=""
for _ in $(seq 30); do   # the proxy takes the instance back at its next health check
    got=$(complete "${PROMPTS[0]}" 2>/dev/null) && [ "$got" = "$want" ] && break
    sleep 0.5
done
[ "$got" = "$want" ] || fail "after host 3 came back: $got, want $want"
restarts=$(metrics "${A[1]}" $PORT | metric 'pdmoe_restarts_total{role="decode",instance="0"}')
[ "${restarts:-0}" -ge 1 ] || fail "pdmoe_restarts_total for the decode group: ${restarts:-none}"
ok "host 3 back: the decode group rejoined ($restarts restarts) and serves the same tokens"

# ---- 5. Ctrl-C leaves nothing behind
kill -INT "$UP_PID"
wait "$UP_PID" || true
for _ in $(seq 50); do
    left=""
    for i in 1 2 3 4; do left+=$(ip netns pids "${HOST_NS[$i]}" | tr '\n' ' '); done
    [ -z "$left" ] && break
    sleep 0.2
done
[ -z "$left" ] || { ps -o pid,args -p $(echo $left | tr ' ' ',') || true; fail "processes left after Ctrl-C: $left"; }
ok "pdmoe up stopped: no process left on any host"

# ---- 6. an unreachable host, a port taken
bad="${A[1]},${A[2]},${A[3]},$CLUSTER_NET.99"
if on 1 "$B" up --model "$M" --plan "$T/plan.json" --hosts "$bad" --host "${A[1]}" --port $PORT > "$T/bad.log" 2>&1; then
    fail "pdmoe up started with an unreachable host"
fi
grep -q "host $CLUSTER_NET.99 is unreachable" "$T/bad.log" || fail "unreachable host: $(cat "$T/bad.log")"
ok "unreachable host: $(grep -m1 unreachable "$T/bad.log")"
# (SO_REUSEADDR: the port may still be in TIME_WAIT from the cluster above; listening, it is taken)
( on_exec 3 python3 -c 'import socket,sys,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); print("held", flush=True); time.sleep(120)' "${A[3]}" $DECODE ) \
    > "$T/hold.txt" 2>&1 &
HOLD=$!
for _ in $(seq 50); do grep -q held "$T/hold.txt" && break; sleep 0.1; done
grep -q held "$T/hold.txt" || fail "could not take port $DECODE on ${A[3]}: $(cat "$T/hold.txt")"
if on 1 timeout 120 "$B" up --model "$M" --plan "$T/plan.json" --hosts "$HOSTS" --host "${A[1]}" --port $PORT --threads 1 \
    > "$T/port.log" 2>&1; then
    fail "pdmoe up started with port $DECODE taken on ${A[3]}"
fi
kill $HOLD 2>/dev/null || true
grep -q "cannot listen on ${A[3]}:$DECODE: Address already in use" "$T/port.log" &&
    grep -q "decode instance 0 (EP group, rank 0 on ${A[3]}:$DECODE) .*before it was ready" "$T/port.log" ||
    fail "port taken: $(cat "$T/port.log")"
ok "port taken: $(grep -m1 'cannot listen' "$T/port.log")"

# ---- 7. the same layout from pdmoe plan --emit pdmoe, started by hand on each host
$B plan --model "$M" --hardware "$T/hw.json" --nodes 4 --prefill dp=2,instances=1 --decode dp=2,instances=1 \
    --max-model-len 2048 --max-num-seqs 8 --kv-cache-dtype bf16 --mtp off --emit pdmoe --hosts "$HOSTS" \
    --proxy-port $PORT > "$T/launch.sh"
mkdir -p "$T/bin"
ln -sf "$B" "$T/bin/pdmoe"   # the script runs pdmoe from PATH, on every host
for i in 1 2 3 4; do
    ( export PATH="$T/bin:$PATH"; on_exec $i sh "$T/launch.sh" "${A[$i]}" ) > "$T/launch-h$i.log" 2>&1 &
done
for p in "${PROMPTS[@]}"; do
    want=$($B generate --model "$M" --prompt "$p" --max-tokens 12 --print-ids --threads 1 2>/dev/null |
           sed -n 's/^\[0\] ids //p')
    got=""
    for _ in $(seq 120); do   # the first one waits for the servers to load
        got=$(complete "$p" 2>/dev/null) && [ "$got" = "$want" ] && break
        sleep 0.5
    done
    [ -n "$want" ] && [ "$got" = "$want" ] || fail "emitted script, \"$p\": cluster $got, pdmoe generate $want"
done
for i in 2 4; do
    grep -q "nothing to start here" "$T/launch-h$i.log" || fail "host $i: $(cat "$T/launch-h$i.log")"
done
ok "pdmoe plan --emit pdmoe's script on each host: ${#PROMPTS[@]} prompts, tokens equal pdmoe generate's"
{ for i in 1 2 3 4; do cluster_kill $i; done; wait; } 2>/dev/null   # (not bash's report of each one killed)
echo "test-cluster: passed"

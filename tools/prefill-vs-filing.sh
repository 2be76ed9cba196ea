#!/bin/sh
# Prefill tokens/s of this tree against the tree at issue 17's filing (the commit before ed65511,
# "bench kernels: oneDNN int8 matmul as the same-run anchor"), on the same machine in the same run.
#
#   git worktree add --detach /work/base17 ed65511^
#   (cd /work/base17 && make -j2 build/pdmoe && make models/mini/model.safetensors)
#   make -j2 build/pdmoe && make models/mini/model.safetensors          # in this tree
#   tools/prefill-vs-filing.sh /work/base17 [ROUNDS] [THREADS] [LENGTHS]
#
# The filing tree has no prefill benchmark (its bench decode uses 64-token prompts; generate times
# one cold step), so tools/prefill_time.c is compiled against each tree's headers and libpdmoe.a:
# the same driver, the same prompt ids as `pdmoe bench prefill` ((i * 131 + 7) mod 1000), one
# prefill step of P tokens on a fresh sequence after a warm-up, median of 3 per process. Each tree
# runs on its own models/mini (the checkpoint format differs). The two binaries alternate, ROUNDS
# times (default 3, the order swapped each round), and the median over rounds is compared: by
# wall time at each thread count, and at 1 thread also by the calling thread's CPU time ("1 cpu"
# rows), which leaves out the slices other jobs take on a shared machine.
#
# The models differ: at the filing every matrix of v4-flash-mini was int8; since issue 19 wq_a,
# wkv, wo_a, the LM head, the router, the compressors' projections and the indexer's weights_proj are bf16 (run
# in fp32), as released, so today's model does more work per token. The ratio is printed with
# that said beside it.
set -eu
if [ $# -lt 1 ] || [ ! -d "$1" ]; then
    echo "usage: tools/prefill-vs-filing.sh BASE_DIR [ROUNDS] [THREADS] [LENGTHS]" >&2
    echo "  BASE_DIR: a built worktree of ed65511^ with its own models/mini" >&2
    exit 2
fi
base=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")/.." && pwd)
rounds=${2:-3}
threads=${3:-"1 2"}
lengths=${4:-"512 1024 2048"}
for t in "$base" "$here"; do
    for f in build/libpdmoe.a models/mini/model.safetensors; do
        if [ ! -f "$t/$f" ]; then
            echo "prefill-vs-filing: $t/$f is missing (make -j2 build/pdmoe && make models/mini/model.safetensors in $t)" >&2
            exit 1
        fi
    done
done
pkgs="jansson ompi-c libevent libevent_pthreads ucx libpcre2-32"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for side in base here; do
    eval "t=\$$side"
    ${CC:-cc} -std=gnu11 -O2 -march=x86-64-v2 -pthread -I"$t/src" -I"$t" -I"$t/build/gen" $(pkg-config --cflags $pkgs) \
        "$here/tools/prefill_time.c" "$t/build/libpdmoe.a" $(pkg-config --libs $pkgs) -lm -pthread -o "$tmp/$side"
done
run() {   # side threads round [clock]
    eval "t=\$$1"
    (cd "$t" && "$tmp/$1" models/mini "$2" 3 "${4:-wall}" $lengths) | sed "s/^/$1 $2${4:+-$4} $3 /" >> "$tmp/results"
}
r=1
while [ "$r" -le "$rounds" ]; do
    if [ $((r % 2)) -eq 1 ]; then run base 1 "$r" cpu; run here 1 "$r" cpu; else run here 1 "$r" cpu; run base 1 "$r" cpu; fi
    r=$((r + 1))
done
for th in $threads; do
    r=1
    while [ "$r" -le "$rounds" ]; do
        if [ $((r % 2)) -eq 1 ]; then run base "$th" "$r"; run here "$th" "$r"; else run here "$th" "$r"; run base "$th" "$r"; fi
        r=$((r + 1))
    done
done
echo "prefill of v4-flash-mini, tokens/s (median of $rounds alternating runs, each the median of 3 steps; wall time,"
echo "and for 1-cpu the calling thread's CPU time at 1 thread)"
echo "filing = $(git -C "$base" log -1 --format='%h %s' | cut -c1-60)..."
echo "today  = $(git -C "$here" log -1 --format='%h %s' | cut -c1-60)..."
echo "note: today's model is heavier (issue 19: wq_a, wkv, wo_a, head, router, compressors, indexer weights_proj"
echo "      bf16 run in fp32, int8 at the filing): the ratio compares the engines on their own models."
printf '%8s %7s %12s %12s %8s\n' threads tokens filing today ratio
for th in 1-cpu $threads; do
    for p in $lengths; do
        med() { awk -v s="$1" -v th="$th" -v p="$p" '$1 == s && $2 == th && $4 == p { print $5 }' "$tmp/results" |
                sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
        b=$(med base)
        h=$(med here)
        printf '%8s %7s %12.1f %12.1f %7.2fx\n' "$th" "$p" "$b" "$h" "$(echo "$h $b" | awk '{ print $1 / $2 }')"
    done
done

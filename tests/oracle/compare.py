#!/usr/bin/env python3
"""The engine's logits (files of build/oracle-dump) against the float64 oracle of DeepSeek-V4's
official forward (tools/oracle/v4_oracle.py) on the same tokens.

  compare.py --model DIR [--check FILE=MIN_COS[:nogreedy]]... [--report FILE]...

For each file: the cosine of the engine's and the oracle's logits at every position, and, over
the greedy continuation the engine chose (the positions after its prompt), whether the oracle's
argmax is the engine's token. A --check fails the run (exit 1) when a position's cosine is below
MIN_COS or a greedy id differs (unless :nogreedy); a --report only prints. Where a position's
cosine is below --flag-cos (a check's MIN_COS), the oracle's closest router and indexer choices there are printed
(the gap between the k-th and the (k+1)-th score, smallest over the layers), so a near-tie shows
as one. Files of one KV cache dtype must hold the same tokens: the oracle runs once per dtype."""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "oracle"))
import v4_oracle  # noqa: E402


def read_dump(path):
    with open(path, "rb") as f:
        head = json.loads(f.readline())
        data = np.frombuffer(f.read(), dtype="<f4")
    if data.size != head["n"] * head["vocab"]:
        raise ValueError(f"{path}: {data.size} logits, the header says {head['n']} x {head['vocab']}")
    return head, data.reshape(head["n"], head["vocab"]).astype(np.float64)


def cosine(a, b):
    return float(a @ b / np.sqrt((a @ a) * (b @ b)))


def fmt_margin(ms):
    if not ms:
        return "-"
    l, m = min(ms, key=lambda t: t[1])
    return f"{m:.2e} (layer {l})"


def compare(path, oracles, model, shared_clamp, flag_cos, max_flagged, per_position):
    """Prints the comparison of one file; returns (min cosine, greedy ids that differ)."""
    head, eng = read_dump(path)
    ids, kvd = head["ids"], head["kv_cache_dtype"]
    if kvd not in oracles:
        oracles[kvd] = (ids, v4_oracle.Oracle(model, kvd, shared_clamp).run(ids))
    oids, (ref, traces) = oracles[kvd]
    if oids != ids:
        raise ValueError(f"{path}: its tokens are not those of the first {kvd} file")
    cos = np.array([cosine(eng[i], ref[i]) for i in range(len(ids))])
    P = head["prompt"]
    greedy_bad = [i for i in range(P - 1, len(ids) - 1) if int(np.argmax(ref[i])) != ids[i + 1]]
    worst = int(np.argmin(cos))
    greedy = f"; greedy ids equal {len(ids) - P - len(greedy_bad)}/{len(ids) - P}" if len(ids) > P else ""
    flagged = [i for i in range(len(ids)) if cos[i] < flag_cos]
    print(f"{model} {head['mode']}, KV cache {kvd}: {len(ids)} positions: cosine min {cos[worst]:.9f} "
          f"(1 - cos = {1 - cos[worst]:.1e}, position {worst}), median {np.median(cos):.9f}, "
          f"{len(flagged)} below {flag_cos}{greedy}")
    shown = range(len(ids)) if per_position else sorted(sorted(flagged, key=lambda i: cos[i])[:max_flagged])
    for i in shown:
        tr = traces[i]
        print(f"  pos {i:4d} cos {cos[i]:.9f}  router margin {fmt_margin(tr.get('router'))}  "
              f"indexer margin {fmt_margin(tr.get('indexer'))}{'  <' if cos[i] < flag_cos else ''}")
    if len(flagged) > len(shown) and not per_position:
        print(f"  ({len(flagged) - len(shown)} more below {flag_cos})")
    for i in greedy_bad:
        print(f"  greedy after position {i}: the engine chose {ids[i + 1]}, the oracle's argmax is "
              f"{int(np.argmax(ref[i]))}")
    return float(cos[worst]), greedy_bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--check", action="append", default=[], metavar="FILE=MIN_COS[:nogreedy]")
    ap.add_argument("--report", action="append", default=[], metavar="FILE")
    ap.add_argument("--flag-cos", type=float, default=0.99999, help="print margins where the cosine is below")
    ap.add_argument("--max-flagged", type=int, default=8, help="print at most this many such positions")
    ap.add_argument("--per-position", action="store_true", help="print every position")
    ap.add_argument("--shared-clamp", type=int, default=1, choices=[0, 1],
                    help="1: the shared expert clamps with swiglu_limit (the later official revision)")
    o = ap.parse_args()
    oracles, failed = {}, []
    for spec in o.check:
        path, _, rule = spec.rpartition("=")
        want, _, opt = rule.partition(":")
        if not path or opt not in ("", "nogreedy"):
            ap.error(f"--check {spec}: FILE=MIN_COS or FILE=MIN_COS:nogreedy")
        # a check flags only the positions that fail it
        c, bad = compare(path, oracles, o.model, bool(o.shared_clamp), float(want), o.max_flagged, o.per_position)
        if c < float(want) or (bad and opt != "nogreedy"):
            failed.append(f"{path}: cosine {c:.9f} (at least {want} asked), {len(bad)} greedy ids differ")
    for path in o.report:
        compare(path, oracles, o.model, bool(o.shared_clamp), o.flag_cos, o.max_flagged, o.per_position)
    for f in failed:
        print(f"FAIL {f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Writes the README's performance table of issue 17's benchmarks from their stored documents.

    tools/perf-table.py DIR

DIR holds the --json documents of one run of the benchmarks on one machine, any of

    kernels.json   pdmoe bench kernels --json
    decode.json    pdmoe bench decode --json
    prefill.json   pdmoe bench prefill --json
    ep.json        pdmoe bench ep --json

and the table (markdown, on stdout) is made of them alone: each row's rate, what it is set against
in the same run (the machine's probed ceilings, oneDNN, the raw MPI_Alltoallv, the 1-thread case),
and the verdict the benchmark itself gave against issue 17's target (bench/report.h states the
targets; this script judges nothing). Exits 1 naming the file and member at fault when a document
is missing what it prints, 2 on bad usage.
"""
import json
import os
import sys

FILES = ("kernels", "decode", "prefill", "ep")


class Bad(Exception):
    pass


def get(doc, path, where):
    """doc's member at the dotted path, or Bad naming the file and the path."""
    v = doc
    for k in path.split("."):
        if isinstance(v, list):
            if not k.isdigit() or int(k) >= len(v):
                raise Bad(f"{where}: no member {path}")
            v = v[int(k)]
        elif isinstance(v, dict) and k in v:
            v = v[k]
        else:
            raise Bad(f"{where}: no member {path}")
    return v


def num(doc, path, where):
    v = get(doc, path, where)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise Bad(f"{where}: {path} is not a number")
    return v


def fmt(x, digits):
    """x with `digits` decimals and thousands separators."""
    return f"{x:,.{digits}f}"


def verdict(obj, where):
    """The benchmark's own verdict on obj's target: "17.3: >= 0.75, met", or "" without one."""
    t = obj.get("target")
    if t is None:
        return ""
    issue, metric = get(t, "issue", where), get(t, "metric", where)
    bound = ">= " + fmt(num(t, "min", where), 2) if "min" in t else "<= " + fmt(num(t, "max", where), 2)
    met = get(t, "met", where)
    word = "not measured" if met is None else "**met**" if met else "not met"
    value = num(obj, metric, where)
    return f"{issue}: {fmt(value, 2)} {bound}, {word}"


def machine_line(doc, where):
    m = get(doc, "machine", where)
    fam = f", family {m['family']} model {m['model']}" if m.get("family") is not None else ""
    load = m.get("load_average")
    load_txt = f", load average {load:.2f} as it ended (its own threads in it)" if isinstance(load, (int, float)) else ""
    return (f"`{get(doc, 'command', where)}`: {m['cpu']}{fam} ({' '.join(m['flags']) or 'no AVX2'}), "
            f"{m['cores']} cores, Linux {m['linux']}, {m['utc']}{load_txt}")


def shares_text(obj, where):
    """A step's parts and their shares, those of 0.5% or more: "gemm 55%, attention 21%"."""
    return ", ".join(f"{k} {100 * v:.0f}%" for k, v in get(obj, "shares", where).items() if v >= 0.005)


def shape_text(kind, s):
    if kind == "gemv":
        return f"int8 GEMV {s['out']} x {s['in']}, 1 token"
    if kind == "gemm":
        return f"int8 GEMM {s['out']} x {s['in']}, {s['tokens']} tokens"
    if kind == "moe":
        return (f"MoE grouped GEMM {s['out']} x {s['in']}, {s['experts']} experts, {s['per_token']} per token, "
                f"{s['tokens']} tokens")
    if kind == "float":
        return f"{s['weights']} float product {s['out']} x {s['in']}, {s['tokens']} tokens"
    if kind == "experts":
        return (f"decode's routed experts: {s['per_token']} of {s['experts']} ({s['inter']} x {s['hidden']}) "
                f"per layer, {s['layers']} layers, {s['tokens']} token")
    return kind


PEAKS = (("pdmoe_of_amx_peak", "amx_peak_gops", "the AMX peak", "TDPBSSD"),
         ("pdmoe_of_vnni_peak", "vnni_peak_gops", "the VNNI peak", "VPDPBUSD"),
         ("pdmoe_of_avx2_int8_peak", "avx2_int8_peak_gops", "the AVX2 int8 peak", "VPMADDWD"),
         ("pdmoe_of_fp32_peak", "fp32_peak_gflops", "the fp32 FMA peak", "VFMADD231PS"))


def kernels_rows(doc, where):
    rows = []
    ceilings = {num(c, "threads", where): c for c in get(doc, "ceilings", where)}
    onednn = get(doc, "onednn", where)
    for i, c in enumerate(get(doc, "cases", where)):
        w = f"{where}: cases.{i}"
        kind, t = get(c, "kind", w), num(c, "threads", w)
        cl = ceilings.get(t)
        if cl is None:
            raise Bad(f"{w}: no ceiling for {t} threads")
        against = []
        if c.get("pdmoe_of_bandwidth") is not None:
            against.append(f"{fmt(num(c, 'pdmoe_of_bandwidth', w), 2)} of the read bandwidth "
                           f"({fmt(num(cl, 'read_GBps', w), 1)} GB/s)")
        for key, ceil_key, name, probe in PEAKS:
            if c.get(key) is not None and kind not in ("gemv", "experts"):
                against.append(f"{fmt(num(c, key, w), 2)} of {name} ({fmt(num(cl, ceil_key, w), 1)} "
                               f"{'GFLOPS' if 'fp32' in key else 'Gops/s'} by a {probe} probe)")
        if c.get("pdmoe_of_dense_gemm") is not None:
            dense = f"{fmt(num(c, 'pdmoe_of_dense_gemm', w), 2)} of the dense GEMM"
            if c.get("bandwidth_bound_of_dense_gemm") is not None:
                dense += f" (the read bandwidth allows at most {fmt(num(c, 'bandwidth_bound_of_dense_gemm', w), 2)})"
            against.append(dense)
        ref = "oneDNN " + onednn + (" fp32 matmul" if kind == "float" else "")
        against.append(f"{fmt(num(c, 'pdmoe_over_onednn', w), 2)}x {ref}")
        unit = "GFLOPS" if kind == "float" else "Gops/s"
        rows.append((shape_text(kind, get(c, "shape", w)), f"{t}", f"{fmt(num(c, 'pdmoe_gflops', w), 1)} {unit}",
                     "; ".join(against), verdict(c, w)))
    return rows


def decode_rows(doc, where):
    rows = []
    cases = get(doc, "cases", where)
    for i, c in enumerate(cases):
        w = f"{where}: cases.{i}"
        b, t = num(c, "batch", w), num(c, "threads", w)
        shares = shares_text(c, w)
        against = (f"{fmt(num(c, 'of_bandwidth_roofline', w), 2)} of the bandwidth roofline "
                   f"({fmt(num(c, 'weight_bytes_per_step', w) / 1e6, 1)} MB a step at "
                   f"{fmt(num(c, 'bandwidth_bytes_per_s', w) / 1e9, 1)} GB/s), "
                   f"{fmt(num(c, 'of_bandwidth_and_compute_bound', w), 2)} of the bound with arithmetic; {shares}")
        judged = verdict(c, w)
        if t > 1:
            for j, s in enumerate(get(doc, "scaling", where)):
                if num(s, "batch", f"{where}: scaling.{j}") == b and num(s, "threads", f"{where}: scaling.{j}") == t:
                    ws = f"{where}: scaling.{j}"
                    against = (f"{fmt(num(s, 'tokens_per_s_over_1_thread', ws), 2)}x 1 thread's tokens/s (the read "
                               f"bandwidth {fmt(num(s, 'bandwidth_over_1_thread', ws), 2)}x); " + against)
                    judged = verdict(s, ws)
        rows.append((f"decode v4-flash-mini, batch {b}", f"{t}", f"{fmt(num(c, 'tokens_per_s', w), 1)} tokens/s",
                     against, judged))
    return rows


def prefill_rows(doc, where):
    rows = []
    for i, r in enumerate(get(doc, "runs", where)):
        w = f"{where}: runs.{i}"
        shares = shares_text(r, w)
        against = (f"{fmt(num(r, 'of_bound', w), 2)} of the bound; its GEMM at "
                   f"{fmt(num(r, 'gemm_of_int8_peak', w), 2)} of the int8 peak; {shares}")
        rows.append((f"prefill v4-flash-mini, {num(r, 'tokens', w)}-token prompt", f"{num(r, 'threads', w)}",
                     f"{fmt(num(r, 'tokens_per_s', w), 0)} tokens/s", against,
                     "17.4: against the tree at the filing, `tools/prefill-vs-filing.sh`"))
    return rows


def ep_rows(doc, where):
    rows = []
    for g, grp in enumerate(get(doc, "groups", where)):
        wg = f"{where}: groups.{g}"
        n = num(grp, "ranks", wg)
        for i, c in enumerate(get(grp, "cases", wg)):
            w = f"{wg}.cases.{i}"
            if n < 2:
                continue
            tok = num(c, "tokens_per_rank", w)
            rows.append((f"EP exchange, {n} ranks, {tok} token{'s' if tok != 1 else ''} per rank", f"{n} ranks",
                         f"{fmt(num(c, 'exchange_us', w), 1)} us",
                         f"{fmt(num(c, 'ratio', w), 2)}x the raw MPI_Alltoallv of the same volumes "
                         f"({fmt(num(c, 'raw_alltoallv_us', w), 1)} us; medians)", verdict(c, w)))
        routed = (f"{fmt(num(grp, 'decode_experts_per_layer', wg), 1)} of the {num(grp, 'experts', wg)} routed "
                  f"experts a layer ran per step" if "decode_experts_per_layer" in grp else "")
        rows.append((f"decode v4-flash-mini, 16 sequences over {n} rank{'s' if n > 1 else ''}", f"{n} rank"
                     f"{'s' if n > 1 else ''}", f"{fmt(num(grp, 'decode_tokens_per_s', wg), 0)} tokens/s", routed, ""))
    return rows


def main(argv):
    if len(argv) != 2 or not os.path.isdir(argv[1]):
        print("usage: tools/perf-table.py DIR (a directory of bench --json documents: "
              + ", ".join(f + ".json" for f in FILES) + ")", file=sys.stderr)
        return 2
    rows, machines = [], []
    makers = {"kernels": kernels_rows, "decode": decode_rows, "prefill": prefill_rows, "ep": ep_rows}
    try:
        found = 0
        for name in FILES:
            path = os.path.join(argv[1], name + ".json")
            if not os.path.exists(path):
                continue
            found += 1
            try:
                with open(path) as f:
                    doc = json.load(f)
            except (OSError, ValueError) as e:
                raise Bad(f"{path}: {e}")
            if get(doc, "bench", path) != name:
                raise Bad(f"{path}: a document of bench {doc['bench']}, not {name}")
            machines.append(machine_line(doc, path))
            rows += makers[name](doc, path)
        if not found:
            raise Bad(f"{argv[1]}: none of " + ", ".join(f + ".json" for f in FILES))
    except Bad as e:
        print(f"perf-table: {e}", file=sys.stderr)
        return 1
    print("Each row from one document below, its references measured in the same run; the target "
          "column is the benchmark's own verdict against issue 17 (bench/report.h).\n")
    for m in machines:
        print(f"- {m}")
    print("\n| case | threads | pdmoe | against, in the same run | issue 17 target |")
    print("|---|---:|---:|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

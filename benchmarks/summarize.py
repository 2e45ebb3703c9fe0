#!/usr/bin/env python3
"""Markdown tables from benchmark JSON files (``vllm-dsa-varlen-bench --json``; peers' files
merged by case): one row per case with every path's graph-replay time, its ratio
to the floor, and the eager time.

    python3 benchmarks/summarize.py bench.json [bench-vdg.json ...]

(``.json.xz`` files, as ``docs/results/`` keeps them, are read as they are.)
"""

import json
import lzma
import sys

COLUMNS = [("cuda-sm90", "sm_90 CUDA"), ("triton-portable", "portable Triton"),
           ("deepgemm-flat", "DG 2.8.2 flat"), ("deepgemm-native", "DG 2.8.2 native2"),
           ("vdg281-flat", "vLLM-0.33 DG flat"), ("vdg281-native", "vLLM-0.33 DG native"),
           ("vdg281-split", "vLLM-0.33 split")]


def load(paths):
    rows, floors, order = {}, {}, []
    for path in paths:
        with (lzma.open(path, "rt") if path.endswith(".xz") else open(path)) as f:
            data = json.load(f)
        for r in data["results"]:
            if r["case"] not in order:
                order.append(r["case"])
            # exact names (parameter variants such as "triton-portable rows_per_dot=4"
            # get no column); "vdg281-native" carries next_n as a suffix
            key = next((k for k, _ in COLUMNS if r["path"] == k or (
                k == "vdg281-native" and r["path"].startswith(k))), r["path"])
            rows.setdefault(r["case"], {})[key] = r
            if r.get("floor_us"):
                floors.setdefault(r["case"], (r["floor_us"], r["mem_floor_us"], r["compute_floor_us"]))
    return rows, floors, order


def main(paths):
    rows, floors, order = load(paths)
    head = "| case | floor µs | " + " | ".join(n for _, n in COLUMNS) + " |"
    print(head)
    print("|" + "---|" * (2 + len(COLUMNS)))
    for case in order:
        f = floors.get(case)
        cells = [case, "–" if f is None else f"{f[0]:.1f} {'compute' if f[2] >= f[1] else 'memory'}"]
        for key, _ in COLUMNS:
            r = rows[case].get(key)
            if r is None:
                cells.append("–")
                continue
            tag = f" n={r['path'][len(key):]}" if key.startswith("vdg") and key.endswith("native") else ""
            ratio = f" ({r['us'] / f[0]:.2f}×)" if f else ""
            cells.append(f"{r['us']:.1f}{tag}{ratio}")
        print("| " + " | ".join(cells) + " |")
    print()
    print("| case | " + " | ".join(f"{n} eager" for _, n in COLUMNS[:4]) + " |")
    print("|" + "---|" * (1 + 4))
    for case in order:
        cells = [case]
        for key, _ in COLUMNS[:4]:
            r = rows[case].get(key)
            cells.append("–" if r is None or r.get("eager_us") is None else
                         f"{r['eager_us']:.1f} (graph {r['us']:.1f})")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])

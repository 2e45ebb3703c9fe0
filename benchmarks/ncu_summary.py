#!/usr/bin/env python3
"""Side-by-side table of Nsight Compute details pages (``ncu --page details
--csv``): one column per profiled kernel, one row per metric of the sections
that say where a kernel's time goes.

    python3 benchmarks/ncu_summary.py gluon-details.csv vdg-details.csv
"""

from __future__ import annotations

import csv
import os
import sys

SECTIONS = ("GPU Speed Of Light Throughput", "Compute Workload Analysis", "Memory Workload Analysis",
            "Scheduler Statistics", "Warp State Statistics", "Launch Statistics", "Occupancy")


def read(path):
    """{kernel label: {(section, metric): value}} from one details CSV."""
    out = {}
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    for row in csv.DictReader(lines):
        label = f"{row.get('ID')}:{row.get('Kernel Name', '')[:28]}"
        section = row.get("Section Name", "")
        if section not in SECTIONS:
            continue
        unit = row.get("Metric Unit", "")
        out.setdefault(label, {})[(section, f"{row.get('Metric Name')} [{unit}]")] = row.get(
            "Metric Value", "")
    return out


def main(paths):
    table = {}
    for path in paths:
        for label, metrics in read(path).items():
            stem = os.path.basename(path).removesuffix(".csv").removesuffix("-details")
            table[f"{stem} {label}"] = metrics
    labels = list(table)
    keys = []
    for metrics in table.values():
        keys.extend(k for k in metrics if k not in keys)
    print(" | ".join(["metric"] + labels))
    for key in keys:
        print(" | ".join([f"{key[0][:12]}: {key[1]}"] + [table[lab].get(key, "") for lab in labels]))


if __name__ == "__main__":
    main(sys.argv[1:])

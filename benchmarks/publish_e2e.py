#!/usr/bin/env python3
"""The kept copy of an end-to-end run (``benchmarks/e2e_decode.py --out OUT``)
for ``docs/results/``: what its tables need, small.

    python3 benchmarks/publish_e2e.py OUT docs/results/h200-<commit>/e2e-<name>

* ``e2e.json``, ``log-*.txt`` -> ``*.xz``;
* ``run-*.json`` -> ``run-*.json.xz`` without the identity run's top-2
  logprobs (kept only where the two modes' identity tokens differ, where
  they are the evidence);
* ``trace-*.json.gz`` -> ``trace-*.kernels.json.xz`` (the GPU kernel events
  only, their name, duration and start: what ``summarize_trace`` reads, so
  the summaries in ``e2e.json`` reproduce from them; checked here) and ``trace-host-ops.json`` (the
  profiled steps' host events per mode: ``name -> [count, summed µs]``).

Nothing else is copied (the tiny model's config is rewritten by the harness).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import lzma
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_decode  # noqa: E402
import e2e_trace  # noqa: E402

HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver")


def _xz_bytes(data: bytes, dst: str) -> None:
    with lzma.open(dst, "wb", preset=9) as f:
        f.write(data)


def _tokens_differ(runs: dict[str, dict], name: str) -> bool:
    """Whether run ``name`` (``run-<mode>-k<k>[-rN]``) and the other engine's
    run of the same k and repeat (stock's and the plugin's, or stock's and its
    ``--control`` twin) have different identity tokens or different tokens in
    a case (where the identity run's top-2 can show a tie of stock's at the
    case's difference: ``e2e_compare.tie_at``); also when that run is missing:
    nothing to compare against, the evidence is kept."""
    mode = name.split("-")[1]
    pair = [runs.get(name.replace(f"run-{mode}-", f"run-{other}-", 1))
            for other in e2e_decode.ENGINE_ENV]
    pair = [run for run in pair if run is not None]
    if len(pair) != 2:
        return True
    a, b = ([(run.get("identity") or {}).get("tokens"),
             *(c.get("tokens") for c in run.get("cases", ()))] for run in pair)
    return a != b


def kernel_events(trace: dict) -> list[dict]:
    """A Chrome trace's GPU kernel events, reduced to what the summary reads
    (name, duration and, where the event has one, its start)."""
    return [{"cat": "kernel", "name": e["name"], "dur": e["dur"],
             **({"ts": e["ts"]} if "ts" in e else {})}
            for e in trace["traceEvents"] if e.get("cat") == "kernel" and "dur" in e]


def host_ops(trace: dict) -> dict[str, list]:
    """``"category:name" -> [count, summed µs]`` of a trace's host events."""
    ops: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in trace["traceEvents"]:
        if e.get("cat") in HOST_CATEGORIES:
            got = ops[f"{e['cat']}:{e['name']}"]
            got[0] += 1
            got[1] += e.get("dur", 0.0)
    return {name: [c, round(t, 1)] for name, (c, t) in sorted(ops.items())}


def publish(out: str, dest: str) -> list[str]:
    """Write the kept copy of ``out`` into ``dest``; the files written."""
    os.makedirs(dest, exist_ok=True)
    written = []

    def put(name: str) -> str:
        path = os.path.join(dest, name)
        written.append(path)
        return path

    for src in sorted(glob.glob(os.path.join(out, "e2e.json"))
                      + glob.glob(os.path.join(out, "log-*.txt"))):
        with open(src, "rb") as f:
            _xz_bytes(f.read(), put(os.path.basename(src) + ".xz"))
    runs = {}
    for src in sorted(glob.glob(os.path.join(out, "run-*.json"))):
        with open(src) as f:
            runs[os.path.basename(src)[: -len(".json")]] = json.load(f)
    for name, run in runs.items():
        if not _tokens_differ(runs, name) and "identity" in run:
            run = dict(run, identity={k: v for k, v in run["identity"].items() if k != "top2"})
        _xz_bytes(json.dumps(run, separators=(",", ":")).encode(), put(name + ".json.xz"))
    steps_of = {}  # a trace file -> its profiled steps, from the run that wrote it
    for run in runs.values():
        for t in [run.get("trace"), *run.get("traces", ())]:
            if t and "file" in t:
                steps_of[t["file"]] = t.get("steps", 1)
    hosts = {}
    for src in sorted(glob.glob(os.path.join(out, "trace-*.json.gz"))):
        with gzip.open(src, "rt") as f:
            trace = json.load(f)
        kept = {"traceEvents": kernel_events(trace)}
        name = os.path.basename(src)[: -len(".json.gz")]
        steps = steps_of.get(os.path.basename(src), 1)
        full, reduced = (e2e_trace.summarize_from_events(ev["traceEvents"], steps)
                         for ev in (trace, kept))
        if full != reduced:
            raise RuntimeError(f"{src}: the kernel events do not reproduce the summary")
        _xz_bytes(json.dumps(kept, separators=(",", ":")).encode(),
                  put(name + ".kernels.json.xz"))
        hosts[name] = host_ops(trace)
    if hosts:
        with open(put("trace-host-ops.json"), "w") as f:
            json.dump({"note": "host events of the profiled decode steps: "
                               "name -> [count, summed us]", **hosts}, f, indent=0)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the run's --out folder")
    p.add_argument("dest", help="the kept copy's folder (docs/results/...)")
    args = p.parse_args(argv)
    for path in publish(args.out, args.dest):
        print(f"{os.path.getsize(path):>9}  {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

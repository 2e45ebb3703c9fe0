#!/usr/bin/env python3
"""The end-to-end benchmark's profiled windows, read back: which kernels are
the indexer's, a window's GPU time per step by kernel class and the
indexer's share (:func:`summarize_trace`), the windows of an ``e2e.json``
entry (:func:`trace_windows`, :func:`share_table`), and the windows of a
process stopped before it wrote its run file (:func:`rebuilt_run`).  Shared
by ``e2e_decode.py`` (which takes the windows), ``e2e_cells.py`` and
``publish_e2e.py``; nothing here needs a GPU or vLLM."""

from __future__ import annotations

import glob
import gzip
import json
import os
import re

# Kernel names -> what they are, for the trace summary (first match wins).
KERNEL_CLASSES = (
    ("plan", r"varlen_plan|plan_sm90|sm90_plan"),
    ("logits_varlen", r"varlen_logits_sm90|_varlen_paged_mqa_logits|gluon.*logits"),
    ("deepgemm_metadata", r"paged_mqa_logits_metadata|smxx_paged_mqa_logits_metadata"),
    ("logits_deepgemm", r"paged_mqa_logits"),
    ("prefill_logits", r"mqa_logits"),
    ("topk", r"topk|top_k"),
    ("indexer_cache", r"indexer_k_quant|indexer.*cache|cp_gather_indexer"),
)
INDEXER = ("plan", "logits_varlen", "deepgemm_metadata", "logits_deepgemm", "topk",
           "indexer_cache")


def classify(name: str) -> str:
    for cls, pattern in KERNEL_CLASSES:
        if re.search(pattern, name):
            return cls
    return "other"


def summarize_trace(trace_path: str, steps: int) -> dict:
    """Per-step GPU time by kernel class over a profiled window of ``steps`` steps."""
    with gzip.open(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return summarize_from_events(events, steps)


def summarize_from_events(events: list[dict], steps: int) -> dict:
    """:func:`summarize_trace` of a trace's ``traceEvents``."""
    per_class: dict[str, float] = {}
    names: dict[str, float] = {}
    for e in events:
        if e.get("cat") != "kernel" or "dur" not in e:
            continue
        cls = classify(e["name"])
        per_class[cls] = per_class.get(cls, 0.0) + e["dur"]
        names[e["name"][:120]] = names.get(e["name"][:120], 0.0) + e["dur"]
    total = sum(per_class.values())
    indexer = sum(v for k, v in per_class.items() if k in INDEXER)
    return {**_window(events, steps),
        "steps": steps,
        "gpu_us_per_step": total / steps,
        "indexer_us_per_step": indexer / steps,
        "indexer_share": indexer / total if total else None,
        "plan_us_per_step": per_class.get("plan", 0.0) / steps,
        "by_class_us_per_step": {k: v / steps for k, v in sorted(per_class.items())},
        "top_kernels_us_per_step": {k: v / steps for k, v in
                                    sorted(names.items(), key=lambda kv: -kv[1])[:12]},
    }


def _window(events: list[dict], steps: int) -> dict:
    """The window's wall span per step (first kernel start to last kernel
    end) and the fraction of it some kernel ran (overlapping kernels counted
    once): a step whose GPU idles between kernels waits on the host.  Empty
    where the kernel events carry no timestamps."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "kernel" and "dur" in e and "ts" in e)
    if not spans:
        return {}
    busy, start, end = 0.0, spans[0][0], spans[0][1]
    for a, b in spans[1:]:
        if a > end:
            busy += end - start
            start, end = a, b
        else:
            end = max(end, b)
    busy += end - start
    window = max(b for _, b in spans) - spans[0][0]
    return {"window_us_per_step": window / steps,
            "gpu_busy_fraction": busy / window if window else None}


def case_share(entry: dict, mode: str, batch: int, prompt: int) -> float | None:
    """The indexer's share of the step traced for ``mode`` at this case in a
    k's e2e.json entry (its ``traces`` or its one ``trace``); ``None`` where no
    trace ran at that case."""
    window = (trace_windows(entry).get((batch, prompt)) or {}).get(mode) or {}
    return window.get("indexer_share")


def trace_windows(entry: dict) -> dict:
    """A k's e2e.json entry's profiled windows: ``{(batch, prompt): {mode:
    window}}`` from its ``traces`` and its one ``trace``."""
    out: dict = {}
    for mode, t in (entry.get("trace") or {}).items():
        if t and "batch" in t:
            out.setdefault((t["batch"], t["prompt"]), {})[mode] = t
    for mode, ts in (entry.get("traces") or {}).items():
        for t in ts:
            out.setdefault((t["batch"], t["prompt"]), {})[mode] = t
    return out


def share_table(result: dict) -> str:
    """Every profiled window, per k and case: the indexer's share of the
    step's GPU time and its GPU time per step, per mode; the second mode's
    decode-path counts over the window and the requests decoding at each
    profiled step; the share of the window some kernel ran, per mode (well
    below 100 %: the host sets the step's pace, and GPU time saved does not
    shorten it)."""
    lines = ["| k | B | L | indexer share stock / {0} | indexer us per step stock / {0} | "
             "GPU ms per step stock / {0} | {0} window's paths | "
             "requests decoding per step stock / {0} | GPU busy stock / {0} |",
             "|---|---|---|---|---|---|---|---|---|"]
    second = "plugin"
    for k, entry in sorted(result["per_k"].items(), key=lambda kv: int(kv[0])):
        modes = {m for w in trace_windows(entry).values() for m in w}
        second = entry.get("second") or next(iter(sorted(modes - {"stock"})), "plugin")
        for (b, x), w in sorted(trace_windows(entry).items()):
            def col(key, scale=1.0, fmt="{:.0f}", w=w):
                return " / ".join("-" if (w.get(m) or {}).get(key) is None
                                  else fmt.format(scale * w[m][key]) for m in ("stock", second))
            own = w.get(second) or {}
            paths = ", ".join(f"{p} {n}" for p, n in (own.get("paths") or {}).items() if n)
            if not paths and own.get("paths") is None:  # a rebuilt window: its kernels
                ran = own.get("by_class_us_per_step") or {}
                paths = ("kernels: varlen" if ran.get("logits_varlen") else
                         "kernels: DeepGEMM" if ran.get("logits_deepgemm") else "")
            paths = paths or "-"
            lines.append(f"| {k} | {b} | {x // 1024}K | {col('indexer_share', 100, '{:.0f} %')} | "
                         f"{col('indexer_us_per_step')} | "
                         f"{col('gpu_us_per_step', 1e-3, '{:.2f}')} | {paths} | "
                         + " / ".join(" ".join(map(str, (w.get(m) or {}).get("decoding") or []))
                                      or "-" for m in ("stock", second))
                         + f" | {col('gpu_busy_fraction', 100, '{:.0f} %')} |")
    lines[0] = lines[0].format(second)
    return "\n".join(lines)


def rebuilt_run(out: str, mode: str, k: int, steps: int) -> dict | None:
    """The run file of a process stopped before it wrote one (a command's time
    limit), as far as its files say: its profiled windows rebuilt from its
    per-case trace files (``trace-<mode>-k<k>-b<B>-<L>k.json.gz``, each
    summarised over ``steps`` steps), the vLLM version and graph mode from its
    log; no cases, no path counts (a window's kernels show which path ran).
    ``None`` where no such trace file is in ``out``."""
    pattern = re.compile(rf"trace-{re.escape(mode)}-k{k}-b(\d+)-(\d+)k\.json\.gz$")
    found = [(m, f) for f in glob.glob(os.path.join(out, f"trace-{mode}-k{k}-b*"))
             if (m := pattern.search(os.path.basename(f)))]
    if not found:
        return None
    windows = sorted(({"file": os.path.basename(f), "batch": int(m.group(1)),
                       "prompt": int(m.group(2)) * 1024, **summarize_trace(f, steps)}
                      for m, f in found), key=lambda w: (w["prompt"], w["batch"]))
    run = {"mode": mode, "k": k, "cases": [], "init_s": None, "jit": {},
           "rebuilt_from_traces": True, "traces": windows, "trace": windows[-1]}
    log = os.path.join(out, f"log-{mode}-k{k}.txt")
    if os.path.exists(log):
        with open(log, errors="replace") as f:
            text = f.read()
        if m := re.search(r"LLM engine \(v([^)\s]+)\)", text):
            run["vllm"] = m.group(1)
        if m := re.search(r"cudagraph_mode'?: <CUDAGraphMode\.(\w+)", text):
            run["cudagraph_mode"] = m.group(1)
    return run

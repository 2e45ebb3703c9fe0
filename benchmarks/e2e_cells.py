#!/usr/bin/env python3
"""Every (k, batch, prompt) cell of the end-to-end grid from kept runs: the
latest measurement of each, where it came from, and the cells no run has
measured.

    python3 benchmarks/e2e_cells.py --vllm 0.27.1 DIR [DIR ...]

``DIR``: folders holding an ``e2e.json`` or ``e2e.json.xz`` (``--merge``'s
output, as ``publish_e2e.py`` keeps it) and the ``run-*.json[.xz]`` files
beside it (the vLLM version is read from them, else from ``e2e.json``),
oldest first: a later folder's cell replaces an earlier one's (the earlier
one stays listed).  Runs of another vLLM version than ``--vllm`` are left
out.  Prints a Markdown table: stock -> plugin TPOT and output tokens/s, the gain (bracketed
where the plugin ran stock's path on every verification step, so both modes
did the same GPU work), the fast-steps gain where recorded, in one process
the median of the round pairs' ratios (their range, their number), token
identity, the plugin's path, the indexer's share of the step where a profiled window
was that cell (stock's latest; the plugin's latest on the path of the cell's
latest run; a ``--trace-only`` folder gives windows alone), how it was measured
(a process per mode, or both engines in one) and the graph mode vLLM ran.
"""

from __future__ import annotations

import argparse
import glob
import json
import lzma
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_compare  # noqa: E402
import e2e_trace  # noqa: E402

BATCHES = (1, 8, 32, 64)
PROMPTS = (4096, 16384, 32768)
KS = (1, 2, 3)


def _load(path: str):
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _one(folder: str, pattern: str) -> str | None:
    found = sorted(glob.glob(os.path.join(folder, pattern)))
    return found[0] if found else None


def _round_pairs(stock: dict, plugin: dict) -> dict:
    """(batch, prompt) -> stock ÷ plugin TPOT of each round, from the two run
    files.  In one process the two engines' rounds of a case alternate, so a
    pair met the same host phase."""
    pairs = {}
    for s, p in zip(stock.get("cases", []), plugin.get("cases", [])):
        ratios = [a["tpot_ms"] / b["tpot_ms"]
                  for a, b in zip(s.get("rounds") or [], p.get("rounds") or []) if b.get("tpot_ms")]
        if ratios:
            pairs[(s["batch"], s["prompt"])] = ratios
    return pairs


def folder_cells(folder: str) -> tuple[str | None, list[dict]]:
    """``(vllm version, cells)`` of one kept run folder; a cell per compared
    (k, batch, prompt) row that ran."""
    path = _one(folder, "e2e.json") or _one(folder, "e2e.json.xz")
    if path is None:
        raise SystemExit(f"{folder}: no e2e.json or e2e.json.xz")
    e2e = _load(path)
    if any(e.get("second") == "control" for e in e2e.get("per_k", {}).values()):
        raise SystemExit(f"{folder}: an A/A control run (stock's engine twice, --control), "
                         "not a stock / plugin comparison: no grid cells")
    version, cells = None, []
    for k, entry in e2e.get("per_k", {}).items():
        stock_path = _one(folder, f"run-stock-k{k}.json") or _one(folder, f"run-stock-k{k}.json.xz")
        run_path = stock_path or _one(folder, f"run-*-k{k}.json*")
        run = _load(run_path) if run_path else {}
        # e2e.json names the version itself since ba1c79d's runs; before, only run files did
        named = [v for v in (entry.get("vllm") or {}).values() if v]
        version = version or run.get("vllm") or (named[0] if named else None)
        one_process = bool(run.get("same_process")) or any(
            r.get("mode") == "both" for r in e2e.get("runs", []) if str(r.get("k")) == k)
        ran_mode = (entry.get("cudagraph_mode") or {}).get("stock") or run.get("cudagraph_mode")
        plugin_path = (_one(folder, f"run-plugin-k{k}.json")
                       or _one(folder, f"run-plugin-k{k}.json.xz"))
        pairs = (_round_pairs(run, _load(plugin_path))
                 if one_process and stock_path and plugin_path else {})
        for row in entry.get("comparison", {}).get("rows", []):
            if row.get("skipped"):
                cells.append({"k": int(k), "batch": row["batch"], "prompt": row["prompt"],
                              "skipped": row["skipped"], "one_process": one_process,
                              "source": folder})
                continue
            if row.get("speedup") is None:
                continue
            paths = row.get("plugin_paths") or {}
            fast = row.get("fast_step_ms")
            cells.append({
                "k": int(k), "batch": row["batch"], "prompt": row["prompt"],
                "stock_tpot_ms": row["stock_tpot_ms"], "plugin_tpot_ms": row["plugin_tpot_ms"],
                "stock_tok_s": row.get("stock_tok_s"), "plugin_tok_s": row.get("plugin_tok_s"),
                "gain": row["speedup"],
                "fast_gain": fast[0] / fast[1] if fast and fast[1] else None,
                "pairs": pairs.get((row["batch"], row["prompt"])),
                "tokens": e2e_compare.token_difference(row),
                "varlen": paths.get("varlen", 0) > 0,
                "one_process": one_process,
                "lockstep": bool(run.get("lockstep")),
                "step_pairs": row.get("step_pairs"),
                "async_off": run.get("async_scheduling") is False,
                "graph_mode": str(ran_mode or "?").rpartition(".")[2],
                "source": folder})
        cells += _windows(folder, int(k), entry, cells, ran_mode)
    return version, cells


def _windows(folder: str, k: int, entry: dict, cells: list[dict],
             graph_mode=None) -> list[dict]:
    """A k's profiled windows as grid entries (``window``: the mode traced,
    its indexer share, the graph mode its engine ran (``graph_mode``: the
    run's, where the entry does not name each mode's), and for the plugin
    whether it took varlen: from the window's own path counts where kept, else
    from its kernels, else from its run's row of that case).  A
    ``--trace-only`` run gives windows alone."""
    rows = {(c["batch"], c["prompt"]): c for c in cells
            if c["k"] == k and "skipped" not in c and "window" not in c}
    out = []
    for (batch, prompt), by_mode in sorted(e2e_trace.trace_windows(entry).items()):
        for mode, w in sorted(by_mode.items()):
            if w.get("indexer_share") is None:
                continue
            kernels = w.get("by_class_us_per_step") or {}
            if w.get("paths") is not None:
                varlen = w["paths"].get("varlen", 0) > 0
            elif kernels.get("logits_varlen") or kernels.get("logits_deepgemm"):
                varlen = bool(kernels.get("logits_varlen"))  # the kernels that ran
            else:
                varlen = rows[(batch, prompt)]["varlen"] if (batch, prompt) in rows else None
            ran = (entry.get("cudagraph_mode") or {}).get(mode) or graph_mode
            out.append({"k": k, "batch": batch, "prompt": prompt, "window": mode,
                        "share": w["indexer_share"], "varlen": varlen,
                        "indexer_us": w.get("indexer_us_per_step"),
                        "gpu_us": w.get("gpu_us_per_step"), "kernels": kernels,
                        "graph_mode": str(ran or "?").rpartition(".")[2], "source": folder})
    return out


def grid(folders: list[str], vllm: str) -> dict:
    """(k, batch, prompt) -> the cells measured there, oldest first.  A folder
    written ``DIR@VERSION`` is taken as a run of that vLLM version where its
    files do not name one (a run whose run files did not come back)."""
    got: dict = {}
    for spec in folders:
        folder, _, given = spec.partition("@")
        version, cells = folder_cells(folder)
        if version is None:
            version = given or None
        elif given and given != version:
            raise SystemExit(f"{folder}: its files name vLLM {version}, not {given}")
        if version != vllm:
            continue
        for cell in cells:
            got.setdefault((cell["k"], cell["batch"], cell["prompt"]), []).append(cell)
    return got


def _pick(windows: list[dict], graph_mode: str) -> dict | None:
    """The latest of ``windows`` (oldest first) traced in ``graph_mode``, else
    the latest of any mode; ``None`` where there is none."""
    same = [w for w in windows if w["graph_mode"] == graph_mode]
    return (same or windows or [None])[-1]


def _pair(stock: list[dict], plugin: list[dict], graph_mode: str):
    """Stock's and the plugin's windows of a cell (each oldest first) as one
    pair: the latest of each in ``graph_mode`` where both have one, else in the
    mode of the plugin's latest window that stock also has, else each by
    :func:`_pick`."""
    both = {w["graph_mode"] for w in stock} & {w["graph_mode"] for w in plugin}
    if both:
        mode = graph_mode if graph_mode in both else next(
            w["graph_mode"] for w in reversed(plugin) if w["graph_mode"] in both)
        return _pick(stock, mode), _pick(plugin, mode)
    return _pick(stock, graph_mode), _pick(plugin, graph_mode)


def _prompt(n: int) -> str:
    return f"{n // 1024}K"


def table(got: dict, root: str = "") -> str:
    lines = ["| k | B | L | stock → plugin TPOT ms | output tokens/s | gain | fast steps "
             "| round / step pairs | tokens | plugin path | indexer share stock / plugin | how "
             "| from | earlier gains |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in KS:
        for b in BATCHES:
            for p in PROMPTS:
                ran = got.get((k, b, p), [])
                windows = [x for x in ran if "window" in x]
                ran = [x for x in ran if "window" not in x]
                cells = [x for x in ran if "skipped" not in x]
                if not cells:
                    why = "not run"
                    if ran:
                        where = " in one process (two engines' KV caches)" \
                            if ran[-1]["one_process"] else ""
                        why = f"skipped{where}: {ran[-1]['skipped']}"
                    lines.append(f"| {k} | {b} | {_prompt(p)} | {why} | | | | | | | | | | |")
                    continue
                c = cells[-1]
                same = not c["varlen"]

                def ratio(x):
                    return "–" if x is None else (f"({x:.2f}×)" if same else f"{x:.2f}×")
                # stock's share from the cell's latest window of stock; the plugin's
                # from its latest window on the path the cell's latest run took
                # (both from one graph mode where they can be, the cell's first; else
                # each its own; a window of another mode than the cell's marked ‡:
                # the rest of the step differs there)
                stock, plugin = _pair([x for x in windows if x["window"] == "stock"],
                                      [x for x in windows if x["window"] == "plugin"
                                       and x["varlen"] == c["varlen"]], c["graph_mode"])
                share = ("–" if not (stock or plugin) else " / ".join(
                    "–" if v is None else f"{100 * v['share']:.0f} %"
                    + ("" if v["graph_mode"] == c["graph_mode"] else " ‡")
                    for v in (stock, plugin)))
                how = ("one process" if c["one_process"] else "a process per mode") + \
                      (", steps in lockstep" if c.get("lockstep") else "") + \
                      (", async scheduling off" if c.get("async_off") else "") + \
                      f", {c['graph_mode']}"
                earlier = ", ".join(f"{x['gain']:.2f}×" for x in cells[:-1]) or "–"
                tok_s = ("–" if not (c.get("stock_tok_s") and c.get("plugin_tok_s")) else
                         f"{c['stock_tok_s']:.0f} → {c['plugin_tok_s']:.0f}")
                pairs = "–"
                steps = c.get("step_pairs") if c.get("lockstep") else None
                if steps:  # lockstep: each step against the other engine's same step
                    pairs = (f"steps {ratio(steps['median'])} {steps['p10']:.2f}–"
                             f"{steps['p90']:.2f} (10–90 %), {steps['n']}")
                elif c.get("pairs"):
                    r = sorted(c["pairs"])
                    pairs = f"{ratio(statistics.median(r))} {r[0]:.2f}–{r[-1]:.2f}, {len(r)}"
                lines.append(
                    f"| {k} | {b} | {_prompt(p)} | {c['stock_tpot_ms']:.2f} → "
                    f"{c['plugin_tpot_ms']:.2f} | {tok_s} | {ratio(c['gain'])} | "
                    f"{ratio(c['fast_gain'])} | "
                    f"{pairs} | "
                    f"{_tokens(c)} | "
                    f"{'varlen' if c['varlen'] else 'stock'} | {share} | {how} | "
                    f"{os.path.relpath(c['source'], root) if root else c['source']} | {earlier} |")
    return "\n".join(lines)


def _tokens(cell: dict) -> str:
    """A cell's token verdict in the grid's words (``e2e_compare.token_difference``;
    stock's own rounds are recorded since d0257f0)."""
    return {None: "identical", "rounds": "DIFFER (stock's rounds too)",
            "tie": "DIFFER (stock's tie)", "": "DIFFER"}[cell["tokens"]]


def windows_table(got: dict, graph_mode: str, root: str = "") -> str:
    """The indexer's time per decode step at every cell, from the profiled
    windows traced in ``graph_mode``: stock's latest and the plugin's latest
    (on whichever path it took: the last column names its logits kernel),
    stock's logits and top-k, the step's GPU time and the share; "–" where no
    window of that mode is kept, and the folders the windows came from."""
    lines = ["| k | B | L | indexer µs per step stock / plugin | of which logits, top-k (stock) "
             "| GPU ms per step stock / plugin | share stock / plugin | plugin's logits kernel |",
             "|---|---|---|---|---|---|---|---|"]
    sources: set[str] = set()
    for k in KS:
        for b in BATCHES:
            for p in PROMPTS:
                ran = [x for x in got.get((k, b, p), []) if x.get("window")
                       and x["graph_mode"] == graph_mode and x.get("indexer_us") is not None]
                if not [x for x in got.get((k, b, p), []) if "window" in x or "skipped" not in x]:
                    continue  # a cell no run reached (B64 x 32K)
                stock, plugin = (next((x for x in reversed(ran) if x["window"] == m), None)
                                 for m in ("stock", "plugin"))
                sources |= {w["source"] for w in (stock, plugin) if w}

                def col(key, fmt, scale=1.0):
                    return " / ".join("–" if w is None else fmt.format(scale * w[key])
                                      for w in (stock, plugin))
                kern = (stock or {}).get("kernels") or {}
                parts = ("–" if stock is None else
                         f"{kern.get('logits_deepgemm', 0) + kern.get('logits_varlen', 0):.0f}, "
                         f"{kern.get('topk', 0):.0f}")
                own = (plugin or {}).get("kernels") or {}
                which = ("–" if plugin is None else "varlen" if own.get("logits_varlen")
                         else "DeepGEMM (stock's)")
                lines.append(f"| {k} | {b} | {_prompt(p)} | {col('indexer_us', '{:.0f}')} | "
                             f"{parts} | {col('gpu_us', '{:.2f}', 1e-3)} | "
                             f"{col('share', '{:.0f} %', 100)} | {which} |")
    where = sorted(os.path.relpath(s, root) if root else s for s in sources)
    return "\n".join(lines) + "\n\nwindows from: " + ", ".join(where)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+",
                    help="kept run folders, oldest first; DIR@VERSION names the vLLM version "
                         "of a folder whose files do not")
    ap.add_argument("--vllm", required=True, help="the vLLM version whose runs count")
    ap.add_argument("--root", default="", help="print sources relative to this folder")
    ap.add_argument("--windows", metavar="GRAPH_MODE",
                    help="print the indexer's time per step at every cell from the windows "
                         "traced in this graph mode (e.g. FULL_DECODE_ONLY) instead of the grid")
    args = ap.parse_args(argv)
    got = grid(args.folders, args.vllm)
    print(windows_table(got, args.windows, args.root) if args.windows else table(got, args.root))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

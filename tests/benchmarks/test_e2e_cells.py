"""benchmarks/e2e_cells.py: the end-to-end grid from kept runs (synthetic
folders in the layout publish_e2e.py keeps, random figures)."""

import importlib.util
import json
import lzma
import os
import random
import statistics

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "e2e_cells.py")
_spec = importlib.util.spec_from_file_location("e2e_cells", _PATH)
cells = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cells)


def _row(rng, batch, prompt, varlen):
    stock, plugin = rng.uniform(9, 30), rng.uniform(9, 30)
    return {"batch": batch, "prompt": prompt, "stock_tpot_ms": stock, "plugin_tpot_ms": plugin,
            "stock_tok_s": batch * 1e3 / stock * rng.uniform(0.8, 1.0),
            "plugin_tok_s": batch * 1e3 / plugin * rng.uniform(0.8, 1.0),
            "speedup": stock / plugin, "fast_step_ms": [stock * 0.9, plugin * 0.9],
            "tokens_identical": rng.random() < 0.5,
            "plugin_paths": {"varlen": 254 if varlen else 0,
                             "stock_flattened": 0 if varlen else 254}}


def _folder(tmp_path, name, version, k, rows, same_process=False, trace=None, xz=True,
            run_files=True, e2e_version=None):
    folder = tmp_path / name
    folder.mkdir()
    entry = {"cudagraph_mode": {"stock": "CUDAGraphMode.FULL_AND_PIECEWISE"},
             "comparison": {"rows": rows}, "trace": trace or {}}
    if e2e_version:
        entry["vllm"] = {"stock": e2e_version, "plugin": e2e_version}
    runs = [{"mode": "both" if same_process else "stock", "k": k}]
    run = {"vllm": version, "same_process": same_process, "cudagraph_mode": "x"}
    files = [("e2e.json", {"per_k": {str(k): entry}, "runs": runs})]
    if run_files:
        files.append((f"run-stock-k{k}.json", run))
    for fname, data in files:
        if xz:
            with lzma.open(folder / (fname + ".xz"), "wt") as f:
                json.dump(data, f)
        else:
            (folder / fname).write_text(json.dumps(data))
    return str(folder)


@pytest.mark.parametrize("seed", range(4))
def test_the_latest_run_of_a_cell_wins_and_the_earlier_stay_listed(tmp_path, seed):
    rng = random.Random(seed)
    old = [_row(rng, 64, 16384, True), _row(rng, 1, 4096, False)]
    new = [_row(rng, 64, 16384, True)]
    other = [_row(rng, 8, 4096, True)]
    old.append({"batch": 32, "prompt": 32768, "skipped": "does not fit the KV cache (5 tokens)"})
    new.append({"batch": 64, "prompt": 32768, "skipped": "does not fit the KV cache (9 tokens)"})
    trace = {m: {"batch": 64, "prompt": 16384, "indexer_share": s}
             for m, s in (("stock", 0.35), ("plugin", 0.26))}
    folders = [_folder(tmp_path, "a", "0.27.1", 3, old, trace=trace, xz=bool(seed % 2)),
               _folder(tmp_path, "b", "0.27.1", 3, new, same_process=True),
               _folder(tmp_path, "c", "0.33.0", 3, other)]
    got = cells.grid(folders, "0.27.1")
    assert set(got) == {(3, 64, 16384), (3, 1, 4096), (3, 64, 32768), (3, 32, 32768)}
    assert [c["source"] for c in got[(3, 64, 16384)] if "window" not in c] == folders[:2]
    lines = {tuple(x.strip() for x in line.split("|")[1:4]): line
             for line in cells.table(got).splitlines()[2:]}
    assert len(lines) == len(cells.KS) * len(cells.BATCHES) * len(cells.PROMPTS)
    line = lines[("3", "64", "16K")]
    assert f"{new[0]['speedup']:.2f}×" in line and "one process" in line
    assert line.split("|")[5].strip() == \
        f"{new[0]['stock_tok_s']:.0f} → {new[0]['plugin_tok_s']:.0f}"  # output tokens/s
    assert f"{old[0]['speedup']:.2f}×" in line.split("|")[-2]  # the earlier gain listed
    assert "35 % / 26 %" in line  # the earlier window of the same path
    assert "| skipped: does not fit the KV cache (5 tokens) |" in lines[("3", "32", "32K")]
    stock_only = lines[("3", "1", "4K")]
    assert f"({old[1]['speedup']:.2f}×)" in stock_only and "| stock |" in stock_only
    assert "not run" in lines[("1", "8", "4K")] and "not run" in lines[("3", "8", "4K")]
    assert ("skipped in one process (two engines' KV caches): does not fit the KV cache "
            "(9 tokens)") in lines[("3", "64", "32K")]


@pytest.mark.parametrize("seed", range(4))
def test_a_token_difference_says_where_stocks_own_rounds_differed_or_stock_tied(tmp_path, seed):
    rng = random.Random(seed)
    rows = [_row(rng, b, 16384, True) for b in (1, 8, 32, 64)]
    want = {}
    for r in rows:
        r["tokens_identical"] = rng.random() < 0.5
        stock_rounds = rng.choice([True, False, None])  # None: a run before the field
        if stock_rounds is not None:
            r["rounds_tokens_equal"] = [stock_rounds, rng.random() < 0.5]
        tie = rng.choice([True, False, None])  # None: a run before the field
        if tie is not None:
            r["stock_tie"] = tie
        want[str(r["batch"])] = ("identical" if r["tokens_identical"] else
                                 "DIFFER (stock's rounds too)" if stock_rounds is False
                                 else "DIFFER (stock's tie)" if tie else "DIFFER")
    got = cells.grid([_folder(tmp_path, "a", "0.27.1", 2, rows)], "0.27.1")
    lines = {tuple(x.strip() for x in line.split("|")[1:4]): line
             for line in cells.table(got).splitlines()[2:]}
    for batch, verdict in want.items():
        assert f"| {verdict} |" in lines[("2", batch, "16K")]


def test_a_folder_without_its_comparison_is_refused_naming_it(tmp_path):
    with pytest.raises(SystemExit, match="empty: no e2e.json"):
        cells.grid([str(tmp_path / "empty")], "0.27.1")


@pytest.mark.parametrize("seed", range(3))
def test_the_version_comes_from_the_run_files_else_e2e_json_else_the_folder_argument(
        tmp_path, seed):
    rng = random.Random(seed)
    rows = [_row(rng, 32, 16384, False),
            {"batch": 32, "prompt": 32768, "skipped": "does not fit the KV cache (7 tokens)"}]
    named = _folder(tmp_path, "named", None, 1, rows, same_process=True, run_files=False,
                    e2e_version="0.27.1")
    bare = _folder(tmp_path, "bare", None, 2, [_row(rng, 64, 4096, False)],
                   same_process=True, run_files=False)
    got = cells.grid([named, bare], "0.27.1")
    assert set(got) == {(1, 32, 16384), (1, 32, 32768)}  # the bare folder names no version
    lines = {tuple(x.strip() for x in line.split("|")[1:4]): line
             for line in cells.table(got).splitlines()[2:]}
    assert "one process" in lines[("1", "32", "16K")]  # from e2e.json's runs, no run file
    assert "skipped in one process (two engines' KV caches): does not fit" \
        in lines[("1", "32", "32K")]
    got = cells.grid([named, bare + "@0.27.1"], "0.27.1")
    assert (2, 64, 4096) in got and got[(2, 64, 4096)][0]["one_process"]
    assert (2, 64, 4096) not in cells.grid([named, bare + "@0.33.0"], "0.27.1")
    with pytest.raises(SystemExit, match="named: its files name vLLM 0.27.1, not 0.33.0"):
        cells.grid([named + "@0.33.0"], "0.27.1")


@pytest.mark.parametrize("seed", range(4))
def test_round_pairs_are_shown_for_engines_in_one_process_only(tmp_path, seed):
    """One process: the median of each round pair's stock ÷ plugin TPOT, its
    range and count, from the two run files; a process per mode: none."""
    rng = random.Random(seed)
    n = rng.randint(2, 6)
    stock = [rng.uniform(9, 20) for _ in range(n)]
    plugin = [rng.uniform(9, 20) for _ in range(n)]
    ratios = sorted(a / b for a, b in zip(stock, plugin))
    want = statistics.median(ratios)
    for one in (True, False):
        folder = tmp_path / f"run-{one}"
        folder.mkdir()
        entry = {"comparison": {"rows": [_row(rng, 8, 16384, False)]}}
        (folder / "e2e.json").write_text(json.dumps({"per_k": {"3": entry}}))
        for mode, tpots in (("stock", stock), ("plugin", plugin)):
            run = {"vllm": "0.27.1", "same_process": one,
                   "cases": [{"batch": 8, "prompt": 16384,
                              "rounds": [{"tpot_ms": t} for t in tpots]}]}
            (folder / f"run-{mode}-k3.json").write_text(json.dumps(run))
        got = cells.grid([str(folder)], "0.27.1")
        line = [x for x in cells.table(got).splitlines() if x.startswith("| 3 | 8 | 16K")][0]
        column = line.split("|")[8].strip()
        if one:
            assert column == f"({want:.2f}×) {ratios[0]:.2f}–{ratios[-1]:.2f}, {n}"
        else:
            assert column == "–"


def test_a_lockstep_run_says_so_in_its_how(tmp_path):
    """A one-process run whose engines stepped in lockstep is named so in the
    "how" column; one that alternated rounds is not."""
    rng = random.Random()
    for lockstep in (True, False):
        folder = tmp_path / f"run-{lockstep}"
        folder.mkdir()
        entry = {"comparison": {"rows": [_row(rng, 8, 4096, True)]}}
        (folder / "e2e.json").write_text(json.dumps({"per_k": {"2": entry}}))
        run = {"vllm": "0.27.1", "same_process": True, "lockstep": lockstep,
               "cudagraph_mode": "FULL_DECODE_ONLY", "cases": []}
        (folder / "run-stock-k2.json").write_text(json.dumps(run))
        line = [x for x in cells.table(cells.grid([str(folder)], "0.27.1")).splitlines()
                if x.startswith("| 2 | 8 | 4K")][0]
        how = line.split("|")[12].strip()
        assert how.startswith("one process")
        assert ("lockstep" in how) == lockstep, how


@pytest.mark.parametrize("async_scheduling", [None, True, False])
def test_a_lockstep_cell_shows_its_step_pairs_and_its_async_scheduling(tmp_path, async_scheduling):
    """A lockstep run's pairs column gives the row's step pairs (median, 10-90 %
    range, count), not round pairs; "how" names async scheduling where the run
    turned it off, and only there."""
    rng = random.Random()
    row = _row(rng, 8, 4096, True)
    q = sorted(rng.uniform(0.9, 1.1) for _ in range(3))
    n = rng.randint(10, 400)
    row["step_pairs"] = {"median": q[1], "p10": q[0], "p90": q[2], "n": n}
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "e2e.json").write_text(json.dumps({"per_k": {"2": {"comparison": {"rows": [row]}}}}))
    run = {"vllm": "0.27.1", "same_process": True, "lockstep": True,
           "cudagraph_mode": "FULL_DECODE_ONLY", "cases": []}
    if async_scheduling is not None:
        run["async_scheduling"] = async_scheduling
    (folder / "run-stock-k2.json").write_text(json.dumps(run))
    line = [x for x in cells.table(cells.grid([str(folder)], "0.27.1")).splitlines()
            if x.startswith("| 2 | 8 | 4K")][0]
    column, how = line.split("|")[8].strip(), line.split("|")[12].strip()
    assert column == f"steps {q[1]:.2f}× {q[0]:.2f}–{q[2]:.2f} (10–90 %), {n}"
    assert ("async scheduling off" in how) == (async_scheduling is False), how


@pytest.mark.parametrize("seed", range(4))
def test_stocks_share_comes_from_any_trace_the_plugins_only_from_its_own_path(tmp_path, seed):
    """A cell whose latest run took varlen shows stock's share from its latest
    trace of stock on any path, and the plugin's only from a trace taken on
    the path its latest run took ("–" where none was)."""
    rng = random.Random(seed)
    s_old, p_old, s_new, p_new = (round(rng.uniform(0.05, 0.5), 2) for _ in range(4))

    def trace(s, p):
        return {m: {"batch": 8, "prompt": 16384, "indexer_share": v}
                for m, v in (("stock", s), ("plugin", p))}
    stock_path = _folder(tmp_path, "a", "0.27.1", 2, [_row(rng, 8, 16384, False)],
                         trace=trace(s_old, p_old))
    varlen_untraced = _folder(tmp_path, "b", "0.27.1", 2, [_row(rng, 8, 16384, True)])
    varlen_traced = _folder(tmp_path, "c", "0.27.1", 2, [_row(rng, 8, 16384, True)],
                            trace=trace(s_new, p_new))

    def share(folders):
        got = cells.grid(folders, "0.27.1")
        line = [x for x in cells.table(got).splitlines() if x.startswith("| 2 | 8 | 16K")][0]
        return line.split("|")[11].strip()
    assert share([stock_path]) == f"{100 * s_old:.0f} % / {100 * p_old:.0f} %"
    assert share([stock_path, varlen_untraced]) == f"{100 * s_old:.0f} % / –"
    assert share([stock_path, varlen_untraced, varlen_traced]) == \
        f"{100 * s_new:.0f} % / {100 * p_new:.0f} %"
    assert share([varlen_untraced]) == "–"


@pytest.mark.parametrize("seed", range(4))
def test_a_trace_only_folder_gives_shares_to_cells_measured_elsewhere(tmp_path, seed):
    """A --trace-only run (windows, no measured case) adds no cell of its own;
    its stock window gives a measured cell stock's share, its plugin window
    the plugin's only where the window's own path counts match the path of
    the cell's latest run; a window at a cell no run measured leaves it "not run"."""
    rng = random.Random(seed)
    varlen = rng.random() < 0.5
    measured = _folder(tmp_path, "m", "0.27.1", 3, [_row(rng, 32, 4096, varlen)])
    s, p, q = (round(rng.uniform(0.05, 0.5), 2) for _ in range(3))
    same = {"varlen": 128 if varlen else 0, "stock_native": 64}
    other = {"varlen": 0 if varlen else 128, "stock_native": 64}

    def window(b, share, paths):
        return {"batch": b, "prompt": 4096, "indexer_share": share, "paths": paths}
    for name, paths in (("t-same", same), ("t-other", other)):
        folder = tmp_path / name
        folder.mkdir()
        traces = {"stock": [window(32, s, {"stock_native": 192}), window(1, q, {})],
                  "plugin": [window(32, p, paths), window(1, q, paths)]}
        entry = {"comparison": {"rows": []}, "traces": traces, "trace": {}}
        (folder / "e2e.json").write_text(json.dumps({"per_k": {"3": entry}}))
        (folder / "run-stock-k3.json").write_text(json.dumps(
            {"vllm": "0.27.1", "trace_only": True, "cases": [],
             "cudagraph_mode": "CUDAGraphMode.FULL_AND_PIECEWISE"}))

    def line(folders, b):
        got = cells.grid(folders, "0.27.1")
        return [x for x in cells.table(got).splitlines() if x.startswith(f"| 3 | {b} | 4K")][0]
    assert line([measured], 32).split("|")[11].strip() == "–"
    with_same = line([measured, str(tmp_path / "t-same")], 32)
    assert with_same.split("|")[11].strip() == f"{100 * s:.0f} % / {100 * p:.0f} %"
    assert with_same.split("|")[13].strip() == measured  # the times' run, not the windows'
    assert line([measured, str(tmp_path / "t-other")], 32).split("|")[11].strip() == \
        f"{100 * s:.0f} % / –"
    assert "not run" in line([measured, str(tmp_path / "t-same")], 1)


@pytest.mark.parametrize("seed", range(3))
def test_a_window_of_the_cells_graph_mode_wins_and_another_modes_is_marked(tmp_path, seed):
    """A cell's share comes from a window traced in the graph mode its run ran
    where there is one (even an older one); else from another mode's window,
    marked ‡; a window rebuilt from trace files (no path counts) takes the
    plugin's path from its kernels."""
    rng = random.Random(seed)
    measured = _folder(tmp_path, "m", "0.27.1", 2, [_row(rng, 8, 16384, True)])
    a, b, c = (round(rng.uniform(0.05, 0.5), 2) for _ in range(3))

    def folder(name, mode, stock, plugin, kernels):
        f = tmp_path / name
        f.mkdir()
        w = {"batch": 8, "prompt": 16384}
        traces = {"stock": [dict(w, indexer_share=stock)],
                  "plugin": [dict(w, indexer_share=plugin, by_class_us_per_step=kernels)]}
        entry = {"traces": traces, "cudagraph_mode": {"stock": mode, "plugin": mode}}
        (f / "e2e.json").write_text(json.dumps({"per_k": {"2": entry}}))
        (f / "run-stock-k2.json").write_text(json.dumps({"vllm": "0.27.1", "cases": []}))
        return str(f)
    varlen_k = {"logits_varlen": 400.0, "logits_deepgemm": 10.0}
    same = folder("same", "CUDAGraphMode.FULL_AND_PIECEWISE", a, b, varlen_k)
    other = folder("other", "CUDAGraphMode.FULL_DECODE_ONLY", c, c, varlen_k)
    flat = folder("flat", "CUDAGraphMode.FULL_AND_PIECEWISE", a, b, {"logits_deepgemm": 400.0})

    def share(folders):
        got = cells.grid(folders, "0.27.1")
        line = [x for x in cells.table(got).splitlines() if x.startswith("| 2 | 8 | 16K")][0]
        return line.split("|")[11].strip()
    assert share([measured, other]) == f"{100 * c:.0f} % ‡ / {100 * c:.0f} % ‡"
    assert share([measured, same, other]) == f"{100 * a:.0f} % / {100 * b:.0f} %"
    assert share([measured, flat]) == f"{100 * a:.0f} % / –"  # stock's kernels: not varlen


def test_a_cells_two_shares_come_from_one_graph_mode_where_they_can(tmp_path):
    """Stock traced in the cell's graph mode but the plugin only in another:
    both shares are taken from the other mode (one pair, marked ‡), not
    stock's from one mode beside the plugin's from another."""
    rng = random.Random()
    measured = _folder(tmp_path, "m", "0.27.1", 3, [_row(rng, 8, 16384, True)])
    a, b, c = (round(rng.uniform(0.05, 0.5), 2) for _ in range(3))

    def folder(name, mode, traces):
        f = tmp_path / name
        f.mkdir()
        entry = {"traces": traces, "cudagraph_mode": {"stock": mode, "plugin": mode}}
        (f / "e2e.json").write_text(json.dumps({"per_k": {"3": entry}}))
        (f / "run-stock-k3.json").write_text(json.dumps({"vllm": "0.27.1", "cases": []}))
        return str(f)
    w = {"batch": 8, "prompt": 16384}
    own = folder("own", "CUDAGraphMode.FULL_AND_PIECEWISE",
                 {"stock": [dict(w, indexer_share=a)]})
    other = folder("other", "CUDAGraphMode.FULL_DECODE_ONLY", {
        "stock": [dict(w, indexer_share=b)],
        "plugin": [dict(w, indexer_share=c, by_class_us_per_step={"logits_varlen": 1.0})]})
    got = cells.grid([measured, own, other], "0.27.1")
    line = [x for x in cells.table(got).splitlines() if x.startswith("| 3 | 8 | 16K")][0]
    assert line.split("|")[11].strip() == f"{100 * b:.0f} % ‡ / {100 * c:.0f} % ‡"
    got = cells.grid([measured, other], "0.27.1")  # nothing in the cell's own mode
    line = [x for x in cells.table(got).splitlines() if x.startswith("| 3 | 8 | 16K")][0]
    assert line.split("|")[11].strip() == f"{100 * b:.0f} % ‡ / {100 * c:.0f} % ‡"


@pytest.mark.parametrize("seed", range(3))
def test_the_windows_table_takes_each_modes_latest_window_of_the_named_graph_mode(tmp_path,
                                                                                    seed):
    """--windows: per cell, stock's and the plugin's latest windows traced in
    the named graph mode (a later folder's plugin window fills a cell an
    earlier folder left without one; a window of another mode is never
    used), stock's logits (either kernel) and top-k, the plugin's kernel
    named from what ran; "–" where a mode has no window there."""
    rng = random.Random(seed)

    def window(b, kernels):
        gpu = rng.uniform(9e3, 3e4)
        idx = sum(kernels.values()) + rng.uniform(50, 300)
        return {"batch": b, "prompt": 16384, "indexer_share": idx / gpu,
                "indexer_us_per_step": idx, "gpu_us_per_step": gpu,
                "by_class_us_per_step": kernels}

    def folder(name, mode, traces):
        f = tmp_path / name
        f.mkdir()
        entry = {"traces": traces, "cudagraph_mode": {m: mode for m in traces}}
        (f / "e2e.json").write_text(json.dumps({"per_k": {"2": entry}}))
        (f / "run-stock-k2.json").write_text(json.dumps({"vllm": "0.27.1", "cases": []}))
        return str(f)

    def us():
        return round(rng.uniform(100, 3000), 1)
    s8, s32 = (window(b, {"logits_deepgemm": us(), "topk": us()}) for b in (8, 32))
    p8 = window(8, {"logits_varlen": us(), "topk": us()})
    p32 = window(32, {"logits_deepgemm": us(), "topk": us()})
    compiled = window(32, {"logits_varlen": us(), "topk": us()})
    first = folder("a", "CUDAGraphMode.FULL_DECODE_ONLY", {"stock": [s8, s32], "plugin": [p8]})
    later = folder("b", "CUDAGraphMode.FULL_DECODE_ONLY", {"plugin": [p32]})
    other = folder("c", "CUDAGraphMode.FULL_AND_PIECEWISE", {"plugin": [compiled]})

    def rows(folders):
        text = cells.windows_table(cells.grid(folders, "0.27.1"), "FULL_DECODE_ONLY")
        return {int(x.split("|")[2]): [c.strip() for c in x.split("|")[4:9]]
                for x in text.splitlines() if x.startswith("| 2 |")}
    got = rows([first, other])
    assert got[32][0] == f"{s32['indexer_us_per_step']:.0f} / –" and got[32][4] == "–"
    assert got[8] == [
        f"{s8['indexer_us_per_step']:.0f} / {p8['indexer_us_per_step']:.0f}",
        f"{s8['by_class_us_per_step']['logits_deepgemm']:.0f}, "
        f"{s8['by_class_us_per_step']['topk']:.0f}",
        f"{s8['gpu_us_per_step'] / 1e3:.2f} / {p8['gpu_us_per_step'] / 1e3:.2f}",
        f"{100 * s8['indexer_share']:.0f} % / {100 * p8['indexer_share']:.0f} %", "varlen"]
    got = rows([first, other, later])
    assert got[32][0] == f"{s32['indexer_us_per_step']:.0f} / {p32['indexer_us_per_step']:.0f}"
    assert got[32][4] == "DeepGEMM (stock's)"
    assert set(got) == {8, 32}  # cells no folder reached are left out

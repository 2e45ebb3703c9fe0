"""benchmarks/e2e_cells.py: the end-to-end grid from kept runs (synthetic
folders in the layout publish_e2e.py keeps, random figures)."""

import importlib.util
import json
import lzma
import os
import random

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "e2e_cells.py")
_spec = importlib.util.spec_from_file_location("e2e_cells", _PATH)
cells = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cells)


def _row(rng, batch, prompt, varlen):
    stock, plugin = rng.uniform(9, 30), rng.uniform(9, 30)
    return {"batch": batch, "prompt": prompt, "stock_tpot_ms": stock, "plugin_tpot_ms": plugin,
            "speedup": stock / plugin, "fast_step_ms": [stock * 0.9, plugin * 0.9],
            "tokens_identical": rng.random() < 0.5,
            "plugin_paths": {"varlen": 254 if varlen else 0,
                             "stock_flattened": 0 if varlen else 254}}


def _folder(tmp_path, name, version, k, rows, same_process=False, trace=None, xz=True):
    folder = tmp_path / name
    folder.mkdir()
    entry = {"cudagraph_mode": {"stock": "CUDAGraphMode.FULL_AND_PIECEWISE"},
             "comparison": {"rows": rows}, "trace": trace or {}}
    run = {"vllm": version, "same_process": same_process, "cudagraph_mode": "x"}
    for fname, data in (("e2e.json", {"per_k": {str(k): entry}}),
                        (f"run-stock-k{k}.json", run)):
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
    new.append({"batch": 64, "prompt": 32768, "skipped": "does not fit the KV cache (9 tokens)"})
    trace = {m: {"batch": 64, "prompt": 16384, "indexer_share": s}
             for m, s in (("stock", 0.35), ("plugin", 0.26))}
    folders = [_folder(tmp_path, "a", "0.27.1", 3, old, trace=trace, xz=bool(seed % 2)),
               _folder(tmp_path, "b", "0.27.1", 3, new, same_process=True),
               _folder(tmp_path, "c", "0.33.0", 3, other)]
    got = cells.grid(folders, "0.27.1")
    assert set(got) == {(3, 64, 16384), (3, 1, 4096), (3, 64, 32768)}  # not 0.33.0's
    assert [c["source"] for c in got[(3, 64, 16384)]] == folders[:2]
    lines = {tuple(x.strip() for x in line.split("|")[1:4]): line
             for line in cells.table(got).splitlines()[2:]}
    assert len(lines) == len(cells.KS) * len(cells.BATCHES) * len(cells.PROMPTS)
    line = lines[("3", "64", "16K")]
    assert f"{new[0]['speedup']:.2f}×" in line and "one process" in line
    assert f"{old[0]['speedup']:.2f}×" in line.split("|")[-2]  # the earlier gain listed
    assert "35 % / 26 %" in line  # the earlier window of the same path
    stock_only = lines[("3", "1", "4K")]
    assert f"({old[1]['speedup']:.2f}×)" in stock_only and "| stock |" in stock_only
    assert "not run" in lines[("1", "8", "4K")] and "not run" in lines[("3", "8", "4K")]
    assert "skipped: does not fit the KV cache (9 tokens)" in lines[("3", "64", "32K")]


def test_a_folder_without_its_comparison_is_refused_naming_it(tmp_path):
    with pytest.raises(SystemExit, match="empty: no e2e.json"):
        cells.grid([str(tmp_path / "empty")], "0.27.1")

"""benchmarks/summarize.py: the tables from benchmark JSON files, plain or
``.json.xz`` as docs/results keeps them (random rows)."""

import importlib.util
import json
import lzma
import os
import random

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "summarize.py")
_spec = importlib.util.spec_from_file_location("summarize", _PATH)
summarize = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summarize)


@pytest.mark.parametrize("seed", range(3))
def test_an_xz_file_reads_as_its_plain_twin_and_every_row_lands_in_its_column(tmp_path, seed):
    rng = random.Random(seed)
    results = []
    for case in (f"B{rng.choice([8, 64])} L{rng.randint(1, 64)}K case{c}" for c in range(4)):
        for key, _ in summarize.COLUMNS:
            if rng.random() < 0.7:
                path = key + ("4" if key == "vdg281-native" else "")
                results.append({"case": case, "path": path, "us": rng.uniform(5, 300),
                                "floor_us": 10.0, "mem_floor_us": 8.0,
                                "compute_floor_us": 10.0})
    data = {"results": results}
    plain, packed = tmp_path / "bench.json", tmp_path / "bench.json.xz"
    plain.write_text(json.dumps(data))
    with lzma.open(packed, "wt") as f:
        json.dump(data, f)
    assert summarize.load([str(packed)]) == summarize.load([str(plain)])
    rows, _, order = summarize.load([str(packed)])
    assert len(order) == len({r["case"] for r in results})
    for r in results:
        key = "vdg281-native" if r["path"].startswith("vdg281-native") else r["path"]
        assert rows[r["case"]][key]["us"] == r["us"]

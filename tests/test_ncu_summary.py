"""benchmarks/ncu_summary.py: the side-by-side table of Nsight Compute details
pages, on a details CSV written the way ``ncu --page details --csv`` writes it
(random kernel names, sections and values; rows of other sections dropped)."""

import csv
import importlib.util
import io
import os
import random

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    spec = importlib.util.spec_from_file_location(
        "ncu_summary", os.path.join(ROOT, "benchmarks", "ncu_summary.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _details_csv(rng, kernels, sections):
    buf = io.StringIO()
    buf.write("==PROF== Disconnected from process 1\n")  # ncu's own lines carry no quotes
    writer = csv.writer(buf, quoting=csv.QUOTE_ALL)
    writer.writerow(["ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit",
                     "Metric Value"])
    want = {}
    for kid, name in enumerate(kernels):
        for section in sections:
            for m in range(rng.randint(1, 4)):
                value = f"{rng.uniform(0, 1e6):,.2f}"
                writer.writerow([kid, name, section, f"metric {m}", "cycle", value])
                want[(kid, section, f"metric {m} [cycle]")] = value
    return buf.getvalue(), want


@pytest.mark.parametrize("seed", range(3))
def test_reads_every_kept_section_per_kernel(tmp_path, seed):
    mod = _module()
    rng = random.Random(seed)
    kernels = [f"kern_{rng.randrange(10**6)}_{i}" for i in range(rng.randint(1, 3))]
    kept = rng.sample(mod.SECTIONS, 2)
    text, want = _details_csv(rng, kernels, kept + ["Source Counters"])
    path = tmp_path / "x-details.csv"
    path.write_text(text)
    got = mod.read(str(path))
    assert len(got) == len(kernels)
    for (kid, section, metric), value in want.items():
        label = f"{kid}:{kernels[kid][:28]}"
        if section in kept:
            assert got[label][(section, metric)] == value
        else:
            assert (section, metric) not in got[label]


def test_columns_are_named_by_file(tmp_path, capsys):
    """Two reports whose names share a prefix keep separate columns."""
    mod = _module()
    rng = random.Random(7)
    paths = []
    for name in ("ncu1-v5-details.csv", "ncu1-vdg-details.csv"):
        text, _ = _details_csv(rng, ["kern"], [mod.SECTIONS[0]])
        (tmp_path / name).write_text(text)
        paths.append(str(tmp_path / name))
    mod.main(paths)
    head = capsys.readouterr().out.splitlines()[0]
    assert "ncu1-v5 0:kern" in head and "ncu1-vdg 0:kern" in head

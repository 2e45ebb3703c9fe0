"""scripts/stage-offline-gpu.py's --sm90-only pruning on synthetic ELF files:
a fat binary of two containers with entries for several GPUs keeps its sm_90
entries byte for byte and its layout, every other payload zeroed; files
without a fat binary (or not ELF) are left alone."""

from __future__ import annotations

import importlib.util
import os
import random
import struct

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "stage_offline_gpu", os.path.join(ROOT, "scripts", "stage-offline-gpu.py"))
stage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stage)


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    header = bytearray(64)
    struct.pack_into("<HHIQ", header, 0, kind, 0x101, 64, len(payload))
    struct.pack_into("<I", header, 28, arch)
    return bytes(header) + payload


def _container(entries: list[bytes]) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", stage.FATBIN_MAGIC, 1, 16, len(body)) + body


def _elf(sections: dict[str, bytes]) -> tuple[bytes, dict[str, int]]:
    """A 64-bit little-endian ELF image with these sections (and .shstrtab)."""
    names = [""] + list(sections) + [".shstrtab"]
    strtab = b"\0".join(n.encode() for n in names) + b"\0"
    blobs = [b""] + list(sections.values()) + [strtab]
    data, offsets = bytearray(64), []
    for blob in blobs:
        data += bytes(-len(data) % 8)
        offsets.append(len(data))
        data += blob
    data += bytes(-len(data) % 8)
    shoff = len(data)
    name_at = [strtab.index(n.encode() + b"\0") if n else 0 for n in names]
    for i, blob in enumerate(blobs):
        sh = bytearray(64)
        struct.pack_into("<I", sh, 0, name_at[i])
        struct.pack_into("<QQ", sh, 0x18, offsets[i] if i else 0, len(blob))
        data += sh
    data[:4], data[4], data[5] = b"\x7fELF", 2, 1
    struct.pack_into("<Q", data, 0x28, shoff)
    struct.pack_into("<HHH", data, 0x3A, 64, len(blobs), len(blobs) - 1)
    return bytes(data), dict(zip(names[1:-1], offsets[1:-1]))


@pytest.mark.parametrize("seed", range(3))
def test_prune_keeps_sm90_and_zeroes_the_rest(tmp_path, seed):
    rnd = random.Random(seed)

    def blob():
        return bytes(rnd.randrange(1, 256) for _ in range(rnd.randint(1, 300)))

    entries = [[(kind, arch, blob()) for kind in (1, 2) for arch in rnd.sample(
        [75, 80, 86, 89, 90, 100, 120], 4) + [90]] for _ in range(2)]
    fatbin = _container([_entry(*e) for e in entries[0]]) + bytes(8) + \
        _container([_entry(*e) for e in entries[1]])
    image, offsets = _elf({".text": blob(), ".nv_fatbin": fatbin, ".data": blob()})
    path = tmp_path / "lib.so"
    path.write_bytes(image)
    kept, zeroed = stage.prune_fatbins(str(path))
    got = path.read_bytes()
    assert len(got) == len(image)
    flat = [e for c in entries for e in c]
    assert kept == sum(len(p) for _, a, p in flat if a == 90)
    assert zeroed == sum(len(p) for _, a, p in flat if a != 90)
    start = offsets[".nv_fatbin"]
    assert got[:start] == image[:start]  # other sections untouched
    assert got[start + len(fatbin):] == image[start + len(fatbin):]
    for kind, arch, payload in flat:  # each payload: itself if sm_90, else zeros
        at = image.index(payload, start)
        assert got[at:at + len(payload)] == (payload if arch == 90 else bytes(len(payload)))
    assert stage.prune_fatbins(str(path)) == (kept, zeroed)  # again: the same file
    assert path.read_bytes() == got


def test_prune_leaves_other_files_alone(tmp_path):
    plain, _ = _elf({".text": b"abc" * 50})
    for name, data in (("a.so", plain), ("b.so", b"not an elf file at all")):
        path = tmp_path / name
        path.write_bytes(data)
        assert stage.prune_fatbins(str(path)) == (0, 0)
        assert path.read_bytes() == data


def test_ops_only_stages_the_operator_library_pruned_and_compressed(tmp_path):
    """--ops-only: the wheel's vllm/_C_stable_libtorch.abi3.so alone, its
    non-sm_90 entries zeroed, xz'd (decompressing gives the pruned image)."""
    import lzma
    import zipfile

    rnd = random.Random(7)
    keep, drop = bytes(rnd.randrange(1, 256) for _ in range(200)), bytes([5]) * 300
    fatbin = _container([_entry(2, 90, keep), _entry(2, 100, drop)])
    image, _ = _elf({".text": b"code", ".nv_fatbin": fatbin})
    wheel = tmp_path / "vllm-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(stage.OPS_BINARY, image)
        z.writestr("vllm/other.so", b"not staged")
    out = tmp_path / "out"
    out.mkdir()
    got = stage.stage_ops(str(wheel), str(out))
    assert os.listdir(out) == ["_C_stable_libtorch.abi3.so.xz"]
    lib = lzma.decompress(open(got, "rb").read())
    assert len(lib) == len(image) and keep in lib and drop not in lib
    at = image.index(drop)  # only the sm_100 payload zeroed
    assert lib == image[:at] + bytes(len(drop)) + image[at + len(drop):]


def test_deps_required_without_ops_only(capsys):
    with pytest.raises(SystemExit):
        stage.main(["--out", "/nonexistent/never-made"])
    assert "--deps" in capsys.readouterr().err


def test_every_deps_file_goes_to_one_pip_call(monkeypatch, tmp_path):
    """--deps takes several files (a release's list and the serve extras):
    all reach one pip install, each as a requirements file, with the target
    Python and platforms."""
    calls = []
    monkeypatch.setattr(stage, "_pip", lambda *a: calls.append(a))
    files = [str(tmp_path / f"d{i}.txt") for i in range(3)]
    stage.install_deps(files, str(tmp_path / "site"), "3.12")
    assert len(calls) == 1
    args = list(calls[0])
    assert [args[i + 1] for i, a in enumerate(args) if a == "-r"] == files
    assert args[args.index("--python-version") + 1] == "3.12" and "--no-deps" in args
    assert [args[i + 1] for i, a in enumerate(args) if a == "--platform"] == list(stage.PLATFORMS)


def test_the_serve_extras_agree_with_each_release_list():
    """A package pinned in a release's list and in the serve extras is pinned
    alike (one pip call installs both files), and every line is name==version."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "offline-gpu")

    def pins(name):
        out = {}
        for line in open(os.path.join(root, name)):
            line = line.split("#")[0].strip()
            if line:
                pkg, _, version = line.partition("==")
                assert version and pkg.strip(), line
                out[pkg.strip().lower().replace("_", "-")] = version.strip()
        return out

    extra = pins("serve-extra-deps.txt")
    assert {"uvicorn", "h11", "aiohttp", "prometheus-client", "uvloop",
            "model-hosting-container-standards"} <= set(extra)
    for release in sorted(f for f in os.listdir(root) if f.startswith("vllm-")):
        base = pins(release)
        assert {p: v for p, v in extra.items() if base.get(p, v) != v} == {}, release

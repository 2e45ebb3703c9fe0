#!/usr/bin/env python3
"""Stage a vLLM release and its missing Python packages for a GPU host without a package index.

Run here (a machine with the package index), from the project root:

    python3 scripts/stage-offline-gpu.py --out .device/offline \\
        --deps scripts/offline-gpu/vllm-0.27.1-deps.txt --deep-gemm-from 0.33.0

(add ``scripts/offline-gpu/serve-extra-deps.txt`` to ``--deps`` for ``vllm serve``
and ``vllm bench serve``: ``benchmarks/serve_device.sh``).

It builds one installed tree (``site/``) for the GPU host's Python (default
CPython 3.12, manylinux x86-64): vLLM's wheel unpacked, every package of
``--deps`` (one or more files) installed for that Python (``pip install --target`` with
``--platform``/``--python-version``, binary wheels only, no dependency
resolution: the list is the closure), optionally the DeepGEMM another vLLM
release vendors as a top-level ``deep_gemm`` (it is built on torch's stable
ABI, so it loads on a torch other than that release's), then packs it as one
``tar.xz`` split into parts of at most ``--part-mib`` MiB, grouped into one
folder per transfer (``call-1/``, ``call-2/``, ...; each with ``MANIFEST``).
On the GPU host, ``scripts/offline-gpu-install.sh`` receives the folders one
by one and unpacks the tree once every part is there (sha256-checked).

With ``--ops-only`` it stages only vLLM's own operator library
(``vllm/_C_stable_libtorch.abi3.so``: its decode top-k ops among them),
pruned to sm_90 and xz-compressed into ``OUT/`` (~16 MB for 0.33.0): what
``vllm-dsa-varlen-bench --topk-lib`` loads beside this project's top-k,
without vLLM's Python (the library is built on torch's stable ABI):

    python3 scripts/stage-offline-gpu.py --ops-only --vllm 0.33.0 --out .device/c033
    # GPU host: xz -dc .device/c033/_C_stable_libtorch.abi3.so.xz > /tmp/c033.so

What is left out, and why (``--keep`` puts an entry back):

* ``vllm/vllm-rs`` (a Rust command-line tool), ``vllm/third_party/fmha_sm100``
  and ``vllm/third_party/tml_fa4`` (Blackwell attention kernels): not used by
  the offline ``LLM`` API on Hopper.
* ``vllm/third_party/deep_gemm``: the DeepGEMM vLLM 0.27.1 vendors (2.6.1) is a
  CPython extension built against the release's torch; with
  ``--deep-gemm-from`` a stable-ABI DeepGEMM takes its place.
* with ``--fa-standin``: the FlashAttention extensions
  (``vllm_flash_attn/_vllm_fa{2,3}_C.abi3.so``, 460 MB, not built on torch's
  stable ABI): replaced by an empty module, so ``vllm.vllm_flash_attn``
  imports.  Only for models whose attention never calls FlashAttention (the
  DeepSeek V3.2 architecture with ``attention_backend="FLASHMLA_SPARSE"`` for
  the model and the MTP drafter): a call would fail with AttributeError, never
  compute something wrong.
* with ``--dense-only``: ``vllm/_moe_C_stable_libtorch.abi3.so`` (MoE kernels;
  its import is optional in vLLM), for dense test models.
* with ``--sm90-only``: in every shared library of the tree, the payloads of
  the CUDA fat binary's entries for other GPUs than sm_90 (machine code and
  PTX) are zeroed in place (:func:`prune_fatbins`; the file's layout and the
  sm_90 entries are unchanged, so it loads and runs on Hopper as before and
  compresses to a fraction): for a GPU host that is an H100 / H200.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile

ALWAYS_LEFT_OUT = ("vllm/vllm-rs", "vllm/third_party/fmha_sm100", "vllm/third_party/tml_fa4",
                   "vllm/third_party/deep_gemm")
FA_BINARIES = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so")
MOE_BINARY = "vllm/_moe_C_stable_libtorch.abi3.so"
OPS_BINARY = "vllm/_C_stable_libtorch.abi3.so"
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64")


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def _download_wheel(name: str, version: str, dest: str) -> str:
    _pip("download", "-q", "--no-deps", "--only-binary=:all:", f"{name}=={version}", "-d", dest)
    found = [f for f in os.listdir(dest) if f.startswith(f"{name}-{version}-") and f.endswith(".whl")]
    if not found:
        sys.exit(f"{name}=={version}: no wheel downloaded")
    return os.path.join(dest, found[0])


def _left_out(name: str, drop: tuple[str, ...]) -> bool:
    return any(name == d or name.startswith(d + "/") for d in drop)


def unpack_vllm(wheel: str, site: str, drop: tuple[str, ...]) -> int:
    """Unpack the vLLM wheel into ``site`` without the ``drop`` paths; returns bytes kept."""
    kept = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir() or _left_out(info.filename, drop):
                continue
            z.extract(info, site)
            mode = info.external_attr >> 16
            if mode:
                os.chmod(os.path.join(site, info.filename), mode & 0o777)
            kept += info.file_size
    return kept


def stage_ops(wheel: str, out: str) -> str:
    """vLLM's operator library from ``wheel``, other GPUs' code zeroed
    (:func:`prune_fatbins`), xz-compressed into ``out``; returns its path."""
    name = os.path.basename(OPS_BINARY)
    with zipfile.ZipFile(wheel) as z, tempfile.TemporaryDirectory() as tmp:
        z.extract(OPS_BINARY, tmp)
        lib = os.path.join(tmp, OPS_BINARY)
        prune_fatbins(lib)
        subprocess.run(["xz", "-T0", "-6", "-f", lib], check=True)
        dest = os.path.join(out, name + ".xz")
        shutil.move(lib + ".xz", dest)
    return dest


def add_fa_standin(site: str) -> None:
    for binary in FA_BINARIES:
        name = os.path.basename(binary).split(".")[0]
        with open(os.path.join(site, os.path.dirname(binary), f"{name}.py"), "w") as f:
            f.write('"""Stand-in for a FlashAttention extension not built for this torch:\n'
                    "it makes vllm.vllm_flash_attn importable; no function is defined, so any\n"
                    'call fails loudly (AttributeError)."""\n')


def add_deep_gemm(version: str, site: str, tmp: str) -> None:
    """The DeepGEMM vLLM ``version`` vendors, as a top-level ``deep_gemm`` package
    (its imports are relative, so the package can be renamed)."""
    wheel = _download_wheel("vllm", version, tmp)
    prefix = "vllm/third_party/deep_gemm/"
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith(prefix) and not n.endswith("/")]
        if not names:
            sys.exit(f"vllm {version} vendors no DeepGEMM")
        for n in names:
            dest = os.path.join(site, "deep_gemm", n[len(prefix):])
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with z.open(n) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out)


FATBIN_MAGIC = 0xBA55ED50


def _fatbin_section(data: bytes) -> tuple[int, int] | None:
    """(offset, size) of the ``.nv_fatbin`` section of a 64-bit little-endian
    ELF file's bytes, or None."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if not shoff or shstrndx >= shnum:
        return None
    str_off, = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)
    for i in range(shnum):
        base = shoff + i * shentsize
        name_at, = struct.unpack_from("<I", data, base)
        end = data.index(b"\0", str_off + name_at)
        if data[str_off + name_at:end] == b".nv_fatbin":
            off, size = struct.unpack_from("<QQ", data, base + 0x18)
            return off, size
    return None


def prune_fatbins(path: str, keep_arch: int = 90) -> tuple[int, int]:
    """Zero, in place, the payload of every entry of ``path``'s CUDA fat
    binary whose target is not ``sm_<keep_arch>`` (``.nv_fatbin``: containers
    of a 16-byte header, then entries of a header holding kind, size and
    target, then payload); returns (bytes kept, bytes zeroed)."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    found = _fatbin_section(data)
    if found is None:
        return 0, 0
    pos, end = found[0], found[0] + found[1]
    kept = zeroed = 0
    while pos + 16 <= end:
        magic, _, header, size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # alignment padding between containers
            continue
        entry, last = pos + header, pos + header + size
        while entry < last:
            _, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            arch, = struct.unpack_from("<I", data, entry + 28)
            start = entry + entry_header
            if arch == keep_arch:
                kept += payload
            else:
                data[start:start + payload] = bytes(payload)
                zeroed += payload
            entry = start + payload
        pos = last
    if zeroed:
        with open(path, "wb") as f:
            f.write(data)
    return kept, zeroed


def prune_tree(site: str, keep_arch: int = 90) -> tuple[int, int]:
    """:func:`prune_fatbins` on every ``.so`` under ``site``."""
    kept = zeroed = 0
    for root, _, files in os.walk(site):
        for name in files:
            if name.endswith(".so") or ".so." in name:
                k, z = prune_fatbins(os.path.join(root, name), keep_arch)
                kept, zeroed = kept + k, zeroed + z
    return kept, zeroed


def install_deps(requirements: list[str], site: str, python: str) -> None:
    """Every file of ``requirements`` into ``site`` in one pip call (a
    package pinned in two files must be pinned alike)."""
    args = ["install", "-q", "--no-deps", "--only-binary=:all:", "--target", site,
            "--python-version", python, "--implementation", "cp"]
    for r in requirements:
        args += ["-r", r]
    for p in PLATFORMS:
        args += ["--platform", p]
    _pip(*args)


def pack(site: str, out: str, part_mib: int, per_call_mib: int) -> list[str]:
    """``site`` as one tar.xz in parts, grouped into ``call-N`` folders of at
    most ``per_call_mib``; returns the folders."""
    archive = os.path.join(out, "site.tar.xz")
    with open(archive, "wb") as f:  # xz itself: multi-threaded, unlike Python's lzma
        tar = subprocess.Popen(["tar", "c", "-C", os.path.dirname(site), "site"],
                               stdout=subprocess.PIPE)
        subprocess.run(["xz", "-9", "-T0", "-c"], stdin=tar.stdout, stdout=f, check=True)
        if tar.wait():
            sys.exit("tar failed")
    size = os.path.getsize(archive)
    part_bytes = part_mib << 20
    parts = []
    with open(archive, "rb") as f:
        for i in range(0, size, part_bytes):
            name = f"part-{i // part_bytes:03d}"
            data = f.read(part_bytes)
            parts.append((name, hashlib.sha256(data).hexdigest(), len(data), data))
    os.remove(archive)
    manifest = "".join(f"{h}  {n}\n" for n, h, _, _ in parts)
    calls, current, used = [], None, per_call_mib << 20
    for name, _, n, data in parts:
        if used + n > per_call_mib << 20:
            current = os.path.join(out, f"call-{len(calls) + 1}")
            os.makedirs(current)
            calls.append(current)
            with open(os.path.join(current, "MANIFEST"), "w") as m:
                m.write(manifest)
            used = 0
        with open(os.path.join(current, name), "wb") as p:
            p.write(data)
        used += n
    return calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm", default="0.27.1", help="vLLM release to stage (default 0.27.1)")
    ap.add_argument("--deps", nargs="+", help="requirements files: the packages the GPU host "
                    "lacks, pinned (required but with --ops-only; e.g. a vLLM release's list "
                    "and scripts/offline-gpu/serve-extra-deps.txt for vllm serve)")
    ap.add_argument("--ops-only", action="store_true",
                    help="stage only vLLM's operator library, sm_90's code, xz'd (see above)")
    ap.add_argument("--python", default="3.12", help="the GPU host's CPython (default 3.12)")
    ap.add_argument("--deep-gemm-from", metavar="VLLM_VERSION",
                    help="add the DeepGEMM this vLLM release vendors as top-level deep_gemm")
    ap.add_argument("--fa-standin", action="store_true",
                    help="replace the FlashAttention extensions by an empty module (see above)")
    ap.add_argument("--dense-only", action="store_true", help="leave out the MoE extension")
    ap.add_argument("--sm90-only", action="store_true",
                    help="zero the CUDA fat binaries' entries for other GPUs (see above)")
    ap.add_argument("--keep", action="append", default=[], help="a left-out path to keep")
    ap.add_argument("--out", default=".device/offline", help="output folder (emptied first)")
    ap.add_argument("--part-mib", type=int, default=20, help="part size in MiB (default 20)")
    ap.add_argument("--per-call-mib", type=int, default=60,
                    help="MiB of parts per transfer folder (default 60)")
    args = ap.parse_args(argv)
    if not args.ops_only and not args.deps:
        ap.error("--deps: required (but with --ops-only)")
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    if args.ops_only:
        with tempfile.TemporaryDirectory() as tmp:
            got = stage_ops(_download_wheel("vllm", args.vllm, tmp), args.out)
        print(f"{got}: {os.path.getsize(got) / 2**20:.1f} MiB")
        return 0

    drop = list(ALWAYS_LEFT_OUT)
    if args.fa_standin:
        drop += FA_BINARIES
    if args.dense_only:
        drop.append(MOE_BINARY)
    drop = tuple(d for d in drop if d not in args.keep)
    with tempfile.TemporaryDirectory() as tmp:
        site = os.path.join(tmp, "site")
        os.makedirs(site)
        wheels = os.path.join(tmp, "wheels")
        kept = unpack_vllm(_download_wheel("vllm", args.vllm, wheels), site, drop)
        print(f"vllm {args.vllm}: {kept / 2**20:.0f} MiB kept; left out: {', '.join(drop)}")
        if args.fa_standin:
            add_fa_standin(site)
        if args.deep_gemm_from:
            add_deep_gemm(args.deep_gemm_from, site, os.path.join(tmp, "other"))
            print(f"deep_gemm: vendored by vllm {args.deep_gemm_from}")
        install_deps(args.deps, site, args.python)
        if args.sm90_only:
            kept, zeroed = prune_tree(site)
            print(f"--sm90-only: {zeroed / 2**20:.0f} MiB of other GPUs' code zeroed, "
                  f"{kept / 2**20:.0f} MiB of sm_90's kept")
        pth = sorted(f for f in os.listdir(site) if f.endswith(".pth"))
        if pth:  # PYTHONPATH does not read them: offline-gpu-install.sh must name their folders
            print(f".pth files in the tree (offline-gpu-install.sh names their folders): "
                  f"{', '.join(pth)}")
        calls = pack(site, args.out, args.part_mib, args.per_call_mib)
    for c in calls:
        mib = sum(os.path.getsize(os.path.join(c, f)) for f in os.listdir(c)) / 2**20
        print(f"{c}: {mib:.1f} MiB")
    print(f"on the GPU host, one transfer per folder: bash scripts/offline-gpu-install.sh "
          f"<folder> [target]  ({len(calls)} folders)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

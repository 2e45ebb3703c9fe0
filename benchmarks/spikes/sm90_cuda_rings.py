#!/usr/bin/env python3
"""Spike: the CUDA C++ kernel ``sm90_cuda_rings.cu`` (four independent math
warpgroups, a TMA ring each, one code copy) checked against the torch
reference and timed (CUDA-graph replay, L2 flushed) beside the Gluon sm_90
kernel (v7) on the same steps.  Not a benchmark of the plugin: the spike's
schedule is made on the host (per-CTA segment lists), outside the timed call.

    python3 benchmarks/spikes/sm90_cuda_rings.py [--cases 64,4,32768 ...] [--variants G:STAGES[:flags]]

Needs an sm_90 GPU and ``nvcc`` (sm_90a).  Each variant is compiled to a cubin
(``-Xptxas -v`` printed) and loaded with the driver API through ctypes.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

PAGE, DIM, HEADS, MATH = 64, 128, 64, 4

# ------------------------------------------------------------------ driver API
_cuda = None


def _drv():
    global _cuda
    if _cuda is None:
        _cuda = ctypes.CDLL("libcuda.so.1")
    return _cuda


def _ck(res, what):
    if res != 0:
        name = ctypes.c_char_p()
        _drv().cuGetErrorName(res, ctypes.byref(name))
        raise RuntimeError(f"{what}: CUDA driver error {res} ({name.value})")


def build(gmax: int, stages: int, flags: str = "") -> tuple[str, str]:
    """Compile one variant to a cubin; returns (path, ptxas report)."""
    out = os.path.join(tempfile.mkdtemp(), f"rings_g{gmax}_s{stages}{flags}.cubin")
    defs = [f"-DGMAX={gmax}", f"-DSTAGES={stages}"]
    for f in filter(None, flags.split("+")):
        defs.append(f"-D{f}")
    cmd = ["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-O3", "-Xptxas", "-v",
           *defs, "-o", out, os.path.join(HERE, "sm90_cuda_rings.cu")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(res.stderr)
    rep = " ".join(l.strip() for l in res.stderr.splitlines() if "Used" in l or "spill" in l)
    return out, rep


def smem_bytes(gmax: int, stages: int, split: int = 1) -> int:
    rings = MATH // split
    return (1024 + rings * stages * PAGE * DIM + 2 * gmax * 2 * HEADS * DIM + rings * stages * PAGE * 4
            + 2 * 2 * gmax * HEADS * 4 + MATH * 2 * gmax * 4 * 36 * 4 + (2 * rings * stages + 4) * 8)


class Kernel:
    def __init__(self, cubin: str, gmax: int, stages: int, split: int = 1):
        import torch
        torch.cuda.init()
        torch.empty(1, device="cuda")
        data = open(cubin, "rb").read()
        self.mod = ctypes.c_void_p()
        _ck(_drv().cuModuleLoadData(ctypes.byref(self.mod), data), "cuModuleLoadData")
        self.fn = ctypes.c_void_p()
        _ck(_drv().cuModuleGetFunction(ctypes.byref(self.fn), self.mod, b"varlen_logits_rings"),
            "cuModuleGetFunction")
        self.smem = smem_bytes(gmax, stages, split)
        _ck(_drv().cuFuncSetAttribute(self.fn, 8, self.smem), "cuFuncSetAttribute(smem)")
        self.gmax, self.stages = gmax, stages

    def launch(self, grid: int, args: list, stream: int):
        vals = []
        for kind, v in args:
            vals.append({"p": ctypes.c_uint64, "i": ctypes.c_int32, "l": ctypes.c_int64}[kind](v))
        ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p)
                                              for v in vals])
        _ck(_drv().cuLaunchKernel(self.fn, grid, 1, 1, 128 * (MATH + 1), 1, 1, self.smem,
                                  ctypes.c_void_p(stream), ptrs, None), "cuLaunchKernel")


def tensor_map(base: int, dims, strides, box, device):
    """A 128-byte-swizzled uint8 TMA descriptor, copied to device memory
    (the kernel reads it from global memory)."""
    import torch
    rank = len(dims)
    raw = (ctypes.c_uint8 * (128 + 64))()
    addr = (ctypes.addressof(raw) + 63) & ~63
    d = (ctypes.c_uint64 * rank)(*dims)
    s = (ctypes.c_uint64 * (rank - 1))(*strides)
    b = (ctypes.c_uint32 * rank)(*box)
    e = (ctypes.c_uint32 * rank)(*([1] * rank))
    _ck(_drv().cuTensorMapEncodeTiled(ctypes.c_void_p(addr), 0, rank, ctypes.c_void_p(base), d, s,
                                      b, e, 0, 3, 2, 0), "cuTensorMapEncodeTiled")
    host = torch.frombuffer(bytearray(ctypes.string_at(addr, 128)), dtype=torch.uint8)
    return host.to(device)


# ------------------------------------------------------------------- schedule

def segments(indices, context_lens, max_context_len, bt_width, rows_max, programs):
    """Per-CTA segment lists from the Gluon kernel's host schedule model: int32
    ``[programs, 2]`` (first segment, count) and ``[segments, 8]`` (first row,
    rows, KV length, first page, end page, local item index, block-table row)."""
    import torch
    from vllm_dsa_varlen.ops import gluon_paged_mqa_logits as gk

    ctx = [int(x) for x in context_lens.view(-1)]
    cap = min(max_context_len, bt_width * PAGE)
    model = gk.schedule_model(indices.cpu(), context_lens.view(-1).cpu(), max_context_len,
                              bt_width, rows_max, programs)
    cta, segs = [], []
    for items in model:
        start = len(segs)
        for local, (first, last, chunk, page) in enumerate(items):
            if segs and len(segs) > start and segs[-1][7] == (first, chunk) and segs[-1][4] == page:
                segs[-1][4] = page + 1
                continue
            kv = min(max(ctx[last], 0), cap)
            n = min(rows_max, last - first + 1 - chunk)
            segs.append([first + chunk, n, kv, page, page + 1, local, first, (first, chunk)])
        cta.append([start, len(segs) - start])
    flat = [s[:7] + [0] for s in segs] or [[0] * 8]
    return (torch.tensor(cta, dtype=torch.int32), torch.tensor(flat, dtype=torch.int32))


def make_call(kern: Kernel, step, out, rows_max):
    import torch
    rows = step.rows
    dev = step.q.device
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    cta, segs = segments(rows.indices, rows.context_lens, step.max_context_len,
                         rows.block_table.shape[1], rows_max, programs)
    cta, segs = cta.to(dev), segs.to(dev)
    kv = step.kv_cache
    blocks = kv.shape[0]
    kv_map = tensor_map(kv.data_ptr(), [DIM, PAGE, blocks], [DIM, kv.stride(0)], [DIM, PAGE, 1], dev)
    q = step.q
    q_map = tensor_map(q.data_ptr(), [DIM, HEADS, q.shape[0]], [DIM, q.stride(0)], [DIM, HEADS, 2],
                       dev)
    w = step.weights
    assert w.stride(1) == 1 and w.stride(0) == HEADS == w.shape[1]
    ctx = rows.context_lens.view(-1).contiguous()
    bt = rows.block_table
    keep = (cta, segs, kv_map, q_map, ctx)
    args = [("p", kv_map.data_ptr()), ("p", q_map.data_ptr()), ("p", kv.data_ptr()),
            ("l", kv.stride(0)), ("p", w.data_ptr()), ("i", w.stride(0)), ("p", ctx.data_ptr()),
            ("p", bt.data_ptr()), ("i", bt.stride(0)), ("p", out.data_ptr()), ("l", out.stride(0)),
            ("p", cta.data_ptr()), ("p", segs.data_ptr())]

    def call(keep=keep):
        kern.launch(programs, args, torch.cuda.current_stream().cuda_stream)
    return call


# ---------------------------------------------------------------------- main

def _graph_us(torch, do_bench, fn, rep_ms):
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=rep_ms, return_mode="median") * 1e3


def check(kern, rows_max, step, rel_tol=1e-3, repeats=3):
    """Poisoned output; every valid position against the reference; nothing
    else written; repeats bitwise identical.  Returns the relative error."""
    import torch
    from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, valid_mask
    rows = step.rows
    ctx = rows.context_lens.view(-1, 1)
    ref = paged_mqa_logits_ref(step.q, step.kv_cache, step.weights, ctx, rows.block_table,
                               step.max_context_len, indices=rows.indices)
    mask = valid_mask(ctx, step.max_context_len, rows.indices)
    outs = []
    for _ in range(repeats):
        out = torch.full((rows.num_rows + 2, step.max_context_len + 40), float("nan"), device="cuda")
        make_call(kern, step, out[: rows.num_rows], rows_max)()
        torch.cuda.synchronize()
        outs.append(out)
    got = outs[0][: rows.num_rows, : step.max_context_len]
    problems = []
    if not torch.isfinite(got[mask]).all():
        problems.append(f"{int((~torch.isfinite(got[mask])).sum())} valid positions not written")
    if not torch.isnan(got[~mask]).all():
        problems.append("written past a row's context")
    if not torch.isnan(outs[0][:, step.max_context_len:]).all() or not torch.isnan(
            outs[0][rows.num_rows:]).all():
        problems.append("written outside [R, max_context_len]")
    if any(not torch.equal(o.nan_to_num(7.0), outs[0].nan_to_num(7.0)) for o in outs[1:]):
        problems.append("repeats differ")
    err = float(((got[mask] - ref[mask]).norm() / ref[mask].norm().clamp_min(1e-30))
                if mask.any() else 0.0)
    if err >= rel_tol:
        problems.append(f"relative error {err:.2e}")
    return err, problems


def main(argv=None) -> int:
    import torch
    from triton.testing import do_bench

    from vllm_dsa_varlen.ops import gluon_paged_mqa_logits as gk
    from vllm_dsa_varlen.workloads import make_decode_step, random_decode_step

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="*", default=["64,4,32768", "64,2,32768", "256,2,4096",
                                                   "128,4,8192", "16,4,16384", "1,4,8192",
                                                   "64,3,32768", "64,-4,32768", "64,-4,8192"],
                   help="requests,tokens(-n: variable 1..n),mean context")
    p.add_argument("--variants", nargs="*", default=["2:3", "2:4", "1:4", "1:5", "2:4:NOEPI=1"],
                   help="GMAX:STAGES[:FLAG+FLAG] (FLAG: a -D of the .cu, e.g. NOEPI=1)")
    p.add_argument("--rep-ms", type=int, default=30)
    p.add_argument("--no-check", action="store_true")
    args = p.parse_args(argv)

    kernels = {}
    for v in args.variants:
        g, st, *fl = v.split(":")
        path, rep = build(int(g), int(st), fl[0] if fl else "")
        split = int(fl[0].split("SPLIT=")[1][0]) if fl and "SPLIT=" in fl[0] else 1
        kernels[v] = Kernel(path, int(g), int(st), split)
        print(f"variant {v}: smem {kernels[v].smem} B; ptxas: {rep}", flush=True)

    if not args.no_check:
        small = [([4, 4, 4, 4], [700, 1500, 64, 2000]), ([3, 1, 2, 4, 3], [10, 3, 130, 999, 64]),
                 ([2] * 7, [5000, 1, 2, 63, 64, 65, 128]), ([1, 1, 1], [300, 900, 40]),
                 ([4, 3], [2, 3])]
        for v, kern in kernels.items():
            if any(f in v for f in ("NOEPI", "NOSTORE", "CONSTW")):
                continue  # ablations: wrong logits by design
            rows_max = 2 * kern.gmax
            for lens, seqs in small:
                step = make_decode_step(lens, seqs, seed=len(lens), device="cuda")
                err, problems = check(kern, rows_max, step)
                print(f"check {v} lens {lens} seqs {seqs}: err {err:.1e} "
                      f"{'OK' if not problems else 'FAIL ' + '; '.join(problems)}", flush=True)
            for seed in range(3):
                step = random_decode_step(24, 2 * kern.gmax, 3000, variable=True, seed=seed,
                                          device="cuda")
                err, problems = check(kern, rows_max, step)
                print(f"check {v} random variable seed {seed}: err {err:.1e} "
                      f"{'OK' if not problems else 'FAIL ' + '; '.join(problems)}", flush=True)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for case in args.cases:
        reqs, tokens, ctx = (int(x) for x in case.split(","))
        step = random_decode_step(reqs, abs(tokens), ctx, variable=tokens < 0, seed=0,
                                  device="cuda")
        rows = step.rows
        ends = torch.cat([rows.indices[1:] != rows.indices[:-1],
                          torch.ones(1, dtype=torch.bool, device="cuda")])
        pages = int(((rows.context_lens.view(-1)[ends] + 63) // 64).sum())
        out = torch.empty(rows.num_rows, step.max_context_len, device="cuda")
        rows_max = gk.rows_max_for(HEADS, abs(tokens))
        sched = gk.plan(rows.indices, rows.context_lens.view(-1, 1), step.max_context_len,
                        rows.block_table.shape[1], HEADS, rows_max)

        def v7(sched=sched, rows_max=rows_max):
            gk.launch(step.q, step.kv_cache, step.weights, rows.context_lens.view(-1, 1),
                      rows.block_table, rows.indices, step.max_context_len, out,
                      rows_max=rows_max, schedule=sched)
        res = {"v7": _graph_us(torch, do_bench, v7, args.rep_ms)}
        for v, kern in kernels.items():
            rm = 2 * kern.gmax
            res[v] = _graph_us(torch, do_bench, make_call(kern, step, out, rm), args.rep_ms)
        line = "  ".join(f"{k} {us:7.1f}" for k, us in res.items())
        cyc = "  ".join(f"{k} {us * 1e-6 / (pages / sms) * 1.7e9:5.0f}" for k, us in res.items())
        print(f"B{reqs} L{ctx} {'1..' + str(-tokens) if tokens < 0 else tokens}tok  us: {line}",
              flush=True)
        print(f"    cycles/page@1.7GHz: {cyc}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

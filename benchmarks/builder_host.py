"""Host cost of vLLM's indexer metadata ``build()``: stock against the plugin (CPU).

Drives the REAL ``DeepseekV32IndexerMetadataBuilder`` of the installed vLLM
line (0.27 or 0.33) on the CPU with the fake GPU and DeepGEMM double of the
test suite (``tests/vllm_stubs.py`` or ``tests/vllm033_stubs.py``,
``tests/fake_deep_gemm.py``), configured like an H200 serving DeepSeek V3.2
with MTP (sm_90, DeepGEMM present, next_n = k + 1; on 0.27 the plugin
compares each step with stock's flattened DeepGEMM call, on 0.33 with stock's
native kernel for next_n 1, 2 or 4, else flattened; ``--adaptive``: 0.33's
adaptive verification, which flattens every step).  Per decode batch (B requests x
n tokens, graph-padded as vLLM pads a FULL decode graph: padding requests of
0 tokens up to the captured token count) it reports, per ``build()`` call:

* ``us``: host microseconds (median of ``--calls`` calls, this CPU), the
  median of ``--rounds`` rounds in which stock's and the plugin's builds
  alternate (one process), and the plugin's extra µs over stock's in the
  same round;
* ``dev_ops``: ATen ops on device tensors (everything but the metadata's
  ``*_cpu`` host tensors and what is computed from them) -- on a GPU each is
  a launch or a copy costing host time;  a stand-in for a stock Triton
  kernel or a DeepGEMM call counts as one op;
* ``host_ops``: ATen ops on host tensors; ``syncs``: scalar reads of device
  tensors (must be 0);
* ``py_calls``: Python function calls per ``build()`` (cProfile over
  :data:`PROFILED_BUILDS` builds; C functions count too): the host cost that
  does not depend on the CPU's speed of the moment (not counted with
  ``--by-function``, whose wrappers would add theirs);
* with ``--by-function``: the plugin's functions' inclusive µs and device
  ops per call.

    python3 benchmarks/builder_host.py [--k 3] [--batch 1 8 32 64] [--calls 200] [--rounds 3]
        [--by-function] [--cudagraph-mode FULL_AND_PIECEWISE] [--adaptive]
    (the line is the installed vLLM's: run it with the 0.33 environment's python for 0.33)
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

PROFILED_BUILDS = 20  # builds under cProfile per batch (py_calls)


def python_calls(build, builds: int = PROFILED_BUILDS) -> float:
    """Python (and C) function calls per call of ``build()``, over ``builds`` calls."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        for _ in range(builds):
            build()
    finally:
        prof.disable()
    return sum(entry[1] for entry in pstats.Stats(prof).stats.values()) / builds


# The functions of the plugin's builder modules whose cost is broken down.
PLUGIN_FUNCTIONS = ("_split_outcome", "_record_stock_only", "_decode_splits", "step_facts",
                    "_decode_lens_cpu", "_plan_varlen_rows", "_plain_varlen_rows",
                    "plan_decode_rows", "_clamp_stock_padding", "_final_context_lens",
                    "get_paged_mqa_logits_metadata", "_hand_over_ids", "_kernel_takes_varlen",
                    "attach_varlen_ids", "_record_step", "_stock_only_step",
                    "classify_step", "_left_to_stock")


class OpCounter(TorchDispatchMode):
    """Counts ATen ops, split into ops on host tensors (``host`` storages and
    whatever is computed from them) and ops on device tensors."""

    def __init__(self, host: list[torch.Tensor]):
        super().__init__()
        self.host = {t.untyped_storage().data_ptr() for t in host}
        self.keep: list = []  # outputs stay alive so storage addresses stay unique
        self.dev_ops = self.host_ops = self.syncs = self.views = 0
        self.paused = 0
        self.log: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                   if isinstance(a, torch.Tensor)]
        on_host = any(t.untyped_storage().data_ptr() in self.host for t in tensors)
        if func.is_view and not on_host:
            self.views += 1  # no launch: metadata only
        elif on_host:
            self.host_ops += 1
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.host.add(t.untyped_storage().data_ptr())
                    self.keep.append(t)
        else:
            self.dev_ops += 1
            self.log.append(str(func))
            if func is torch.ops.aten._local_scalar_dense.default:
                self.syncs += 1
        return out

    @contextlib.contextmanager
    def one_op(self):
        """Count what runs inside as one device op (a kernel launch)."""
        if not self.paused:
            self.dev_ops += 1
            self.log.append("[kernel]")
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


_COUNTER: list[OpCounter] = []


def _as_one_op(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ctx = _COUNTER[-1].one_op() if _COUNTER else contextlib.nullcontext()
        with ctx:
            return fn(*args, **kwargs)
    return wrapper


class FunctionCosts:
    """Inclusive µs and device ops per call of the plugin's functions."""

    def __init__(self):
        self.us: dict[str, float] = {}
        self.ops: dict[str, int] = {}

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            counter = _COUNTER[-1] if _COUNTER else None
            ops0 = counter.dev_ops if counter else 0
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.us[name] = self.us.get(name, 0.0) + (time.perf_counter() - t0) * 1e6
                if counter:
                    self.ops[name] = self.ops.get(name, 0) + counter.dev_ops - ops0
        return wrapper


# vLLM's default CUDA-graph capture sizes (0.27.1 and 0.33.0, up to 512 tokens)
VLLM_CAPTURE_SIZES = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))


def decode_batches(k: int, batches: list[int], capture_sizes: list[int], cut: float = 0.0):
    """(label, decode_lens, num_tokens) of the main model's and drafter's builds.
    A verification step pads to a FULL graph's size, and vLLM keys those on a
    whole number of ``k + 1``-token requests (0.27.1 rounds the capture sizes
    up to multiples of ``k + 1``; 0.33's graphs are counted in requests), so
    the padding is whole requests of 0 tokens.  ``cut`` > 0 adds, per batch, a
    verification step whose last ``round(cut * B)`` (at least one) requests
    had their drafts cut to 1..k tokens (what a grammar makes under
    synchronous scheduling): variable, so unpadded (it runs outside FULL graphs)."""
    if not 0.0 <= cut < 1.0:
        raise ValueError(f"cut: expected a share in [0, 1), got {cut!r}")
    n = k + 1
    sizes = sorted({-(-s // n) * n for s in capture_sizes})
    out = []
    for b in batches:
        tokens = b * n
        padded = min((s for s in sizes if s >= tokens), default=tokens)
        pad_reqs = (padded - tokens) // n
        out.append((f"B{b} x{n}", [n] * b + [0] * pad_reqs, padded))
        if cut and k and b > 1:
            short = min(b - 1, max(1, round(cut * b)))
            lens = [n] * (b - short) + [1 + i % k for i in range(short)]
            out.append((f"B{b} x{n} cut {short}", lens, sum(lens)))
        out.append((f"B{b} x1", [1] * b, b))
    return out


def _line_setup(line: str, mp, k: int, width: int, adaptive: bool):
    """The line's builder module, DeepGEMM double (its scheduler counted as one
    launch), stock's Triton flattening stand-in (one launch) and a builder."""
    import vllm.v1.attention.backends.mla.indexer as ix

    if line == "0.33":
        from vllm033_stubs import HopperDeepGemm, fake_gpu, fake_uniform_decode_kernel, make_builder

        from vllm_dsa_varlen.vllm_0_33.v1.attention.backends.mla import indexer as pix
        fake_gpu(mp, (9, 0))
        dg = HopperDeepGemm().install(mp)
        fake_uniform_decode_kernel(mp, wrap=_as_one_op)
        make = functools.partial(make_builder, adaptive=adaptive)
    else:
        if adaptive:
            raise SystemExit("--adaptive: vLLM 0.33 only")
        from fake_deep_gemm import FakeDeepGemm
        from vllm_stubs import (NUM_SMS, UniformDecodeKernel, fake_gpu,
                                fake_uniform_decode_kernel, make_builder)

        from vllm_dsa_varlen.vllm_0_27.v1.attention.backends.mla import indexer as pix

        class _OneLaunch(UniformDecodeKernel):
            def __getitem__(self, grid):
                return _as_one_op(super().__getitem__(grid))

        fake_gpu(mp, (9, 0))
        dg = FakeDeepGemm("2.8", 90, num_sms=NUM_SMS).install(mp)
        fake_uniform_decode_kernel(mp)
        mp.setattr(ix, "_prepare_uniform_decode_kernel", _OneLaunch())
        make = make_builder
    scheduler = dg.get_paged_mqa_logits_metadata
    mp.setattr(scheduler, "_impl", _as_one_op(scheduler._impl))
    return pix, lambda: make(mp, next_n=k + 1, width=width, max_tokens=512, max_seqs=256,
                             max_model_len=width * 64)


def measure(mode: str, k: int, batches, calls: int, context: int, by_function: bool,
            cudagraph_mode: str = "FULL_AND_PIECEWISE", line: str = "0.27",
            adaptive: bool = False, graph_kernel: str | None = None):
    """Per batch: host µs and op counts of one ``build()`` (``mode``: stock | plugin)."""
    import pytest
    from vllm_stubs import decode_batch, random_block_table

    from vllm_dsa_varlen import patches, settings, stats

    results = {}
    costs = FunctionCosts()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(settings.BACKEND_ENV, raising=False)
        mp.setenv(settings.MODE_ENV, "off" if mode == "stock" else "auto")
        patches.undo_all()
        if mode == "plugin":
            patches.apply_all(line=line)
        width = -(-(context + 1024) // 64)
        pix, make = _line_setup(line, mp, k, width, adaptive)
        if graph_kernel:  # the kernel a Hopper host would name (its kernel-gated rules apply)
            from vllm_dsa_varlen.ops import launcher
            mp.setattr(launcher, "graph_kernel", lambda *a, **kw: graph_kernel)
        if by_function and mode == "plugin":
            for name in PLUGIN_FUNCTIONS:
                if hasattr(pix, name):
                    mp.setattr(pix, name, costs.wrap(name, getattr(pix, name)))
        builder = make()
        assert getattr(builder, "use_varlen", False) == (mode == "plugin")
        from types import SimpleNamespace

        from vllm.config import CUDAGraphMode
        builder.vllm_config.compilation_config = SimpleNamespace(
            cudagraph_mode=getattr(CUDAGraphMode, cudagraph_mode))
        try:
            for label, lens, num_tokens in batches:
                real = [n for n in lens if n]
                seqs = [context + n if n else 0 for n in lens]
                bt = random_block_table(len(lens), width, 4 * width, seed=len(lens))
                cm = decode_batch(lens, seqs, bt, num_tokens=num_tokens)
                builder.build(0, cm)  # warm
                costs.us.clear()
                costs.ops.clear()
                stats.reset()
                times = []
                for _ in range(calls):
                    t0 = time.perf_counter()
                    builder.build(0, cm)
                    times.append((time.perf_counter() - t0) * 1e6)
                counter = OpCounter([cm.query_start_loc_cpu, cm.seq_lens_cpu_upper_bound])
                _COUNTER.append(counter)
                try:
                    with counter:
                        builder.build(0, cm)
                finally:
                    _COUNTER.pop()
                steps = stats.snapshot()["steps"]
                calls_per_build = (None if by_function
                                   else python_calls(lambda: builder.build(0, cm)))
                entry = dict(requests=len(real), padded_tokens=num_tokens,
                             us=round(statistics.median(times), 1), dev_ops=counter.dev_ops,
                             py_calls=calls_per_build,
                             host_ops=counter.host_ops, views=counter.views,
                             syncs=counter.syncs, ops=counter.log,
                             path=max(steps, key=steps.get) if any(steps.values()) else None)
                if costs.us:
                    entry["functions"] = {
                        name: dict(us=round(costs.us[name] / (calls + 1), 1),
                                   dev_ops=costs.ops.get(name, 0))
                        for name in sorted(costs.us, key=costs.us.get, reverse=True)}
                results[label] = entry
        finally:
            patches.undo_all()
    return results


def interleaved(rounds: int, run) -> dict:
    """``run(mode)`` for stock and the plugin, ``rounds`` times, alternating
    which goes first: ``{mode: [result per round]}`` (one process, so a drift
    of the host's speed shows as spread, not as a difference)."""
    if rounds < 1:
        raise ValueError(f"--rounds: expected an int >= 1, got {rounds}")
    got: dict = {"stock": [], "plugin": []}
    for r in range(rounds):
        for mode in ("stock", "plugin") if r % 2 == 0 else ("plugin", "stock"):
            got[mode].append(run(mode))
    return got


def combine(per_round: dict) -> dict:
    """The rounds of :func:`interleaved` as one result per mode and batch: the
    last round's counts (the same every round), ``us`` the median over the
    rounds, ``us_rounds`` each round's; per batch the plugin's extra µs over
    stock's in the same round (``extra_us``: median, min, max)."""
    out = {}
    for mode, rounds in per_round.items():
        out[mode] = {}
        for label, entry in rounds[-1].items():
            us = [r[label]["us"] for r in rounds]
            out[mode][label] = {**entry, "us": round(statistics.median(us), 1), "us_rounds": us}
    for label, entry in out["plugin"].items():
        extra = [q[label]["us"] - s[label]["us"]
                 for s, q in zip(per_round["stock"], per_round["plugin"])]
        entry["extra_us"] = [round(statistics.median(extra), 1), round(min(extra), 1),
                             round(max(extra), 1)]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=3, help="MTP depth (next_n = k + 1)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 5, 8, 32, 64])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--capture-sizes", type=int, nargs="+", default=VLLM_CAPTURE_SIZES,
                   help="FULL graph sizes before vLLM rounds them to multiples of k + 1 "
                   "(default: vLLM's own default list up to 512)")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds per mode, stock's and the plugin's alternating (default 3)")
    p.add_argument("--by-function", action="store_true")
    p.add_argument("--cudagraph-mode", default="FULL_AND_PIECEWISE")
    p.add_argument("--adaptive", action="store_true",
                   help="adaptive verification (vLLM 0.33: every step flattened)")
    p.add_argument("--cut", type=float, default=0.0,
                   help="also a variable verification step per batch, this share of its "
                   "requests' drafts cut (default 0: none)")
    p.add_argument("--graph-kernel", choices=["cuda_sm90", "portable"], default=None,
                   help="the varlen kernel the builder names, as on a GPU that runs it "
                   "(default: what this machine's launcher says)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    batches = decode_batches(args.k, args.batch, args.capture_sizes, args.cut)
    from vllm_dsa_varlen import patches

    line = patches.installed_line()
    print(f"vLLM line {line}, k={args.k}, {args.cudagraph_mode}"
          + (", adaptive verification" if args.adaptive else ""))
    res = combine(interleaved(args.rounds, lambda mode: measure(
        mode, args.k, batches, args.calls, args.context, args.by_function,
        args.cudagraph_mode, line, args.adaptive, args.graph_kernel)))
    print(f"µs: medians of {args.rounds} rounds, stock's and the plugin's alternating; "
          f"plugin extra: its µs minus stock's in the same round (median [min, max])")
    print(f"{'batch':>10} {'tokens':>6} | {'stock us':>8} {'ops':>4} {'calls':>5} | "
          f"{'plugin us':>9} {'ops':>4} {'calls':>5} {'host':>4} {'syncs':>5} | "
          f"{'plugin extra':>22} | plugin path")
    def calls(entry):
        return "-" if entry.get("py_calls") is None else f"{entry['py_calls']:.0f}"

    for label, *_ in batches:
        s, q = res["stock"][label], res["plugin"][label]
        extra = "{:>6} [{}, {}]".format(*q["extra_us"])
        print(f"{label:>10} {s['padded_tokens']:>6} | {s['us']:>8} {s['dev_ops']:>4} "
              f"{calls(s):>5} | {q['us']:>9} {q['dev_ops']:>4} {calls(q):>5} "
              f"{q['host_ops']:>4} {q['syncs']:>5} | {extra:>22} | {q['path']}")
        for name, c in q.get("functions", {}).items():
            print(f"{'':>12} {name:<32} {c['us']:>8} us {c['dev_ops']:>3} ops")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

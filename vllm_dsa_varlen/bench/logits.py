"""Decode-indexer benchmark: every paged-MQA-logits path this machine has.

Decode steps are built the way serving produces them (DeepSeek V3.2 shapes:
H 64, D 128, page 64, fp8 cache; optionally V4's compressed cache) through the
project's own plan, and each available path is timed on the same step:

* ``triton-portable`` — this project's portable Triton kernel: one row per
  token + run ids (``triton-varlen`` on a GPU other than sm_90);
* ``cuda-sm90``       — this project's Hopper kernel in CUDA C++ (NVRTC), the
  one the launcher takes on sm_90 for 32 and 64 heads (``--peer sm90``: in a
  process of its own, merged with ``--merge``);
* ``deepgemm-flat``   — DeepGEMM ``next_n = 1`` on the flattened rows (what
  vLLM 0.27.1 does on Hopper with MTP >= 2: every row re-reads its KV);
* ``deepgemm-native`` — DeepGEMM ``[B, next_n]`` padded (SM90: next_n <= 2);
* ``deepgemm-varlen`` — DeepGEMM with ``indices`` (SM100 only);
* ``vdg281-*``        — vLLM 0.33's vendored DeepGEMM 2.8.1 (``--peer vdg``,
  run in a process of its own and merged with ``--merge``): ``flat``
  (``next_n = 1``) and ``native<n>`` (``next_n`` 1, 2 or 4; next_n = 4 is a
  2-CTA cluster; variable steps padded to ``(B, 4)``).

Reported per path: median µs of a CUDA-graph replay of one call (CUDA events
via ``triton.testing.do_bench``, which flushes the L2 before every run by
writing a buffer, leaving it dirty; ``--builds`` flushes it clean by default,
as a decode step leaves it: ``--flush``, :mod:`.graph`; the
graph removes host launch time, which a Python launcher adds to small eager
calls), the same for the eager call (``eager=`` in the note), the floor (max of memory floor and
compute floor, from a copy bandwidth and an fp8 matmul rate measured in the
same run), useful vs padded rows, and the plan's host µs per step.  Without a
GPU it runs tiny shapes through the reference and the Triton interpreter and
says so.

Three other modes time something else: ``--plan-timing`` the sm_90 kernel's
per-step schedule (:mod:`.schedule`), ``--launch-host`` the host time of
eager calls, ``--fake`` without a GPU (:mod:`.launch`), ``--builds``
the CUDA kernel's builds in one process, beside DeepGEMM and vLLM's top-k
(:mod:`.builds`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from .deepgemm import Path, deepgemm_paths, vdg_paths
from .builds import LEADS
from .graph import FLUSHES, capture_graph, graph_replay_us  # noqa: F401  (the benchmarks' helpers)

PROG = "vllm-dsa-varlen-bench"  # the console script; also python -m vllm_dsa_varlen.bench


@dataclass
class Case:
    name: str
    num_reqs: int
    context: int
    max_tokens: int
    variable: bool = False
    heads: int = 64
    compress_ratio: int = 1
    acceptance: float | None = None

    def step(self, seed: int, device: str = "cpu"):
        """This case's decode step (the project's plan inside)."""
        from .workloads import random_decode_step

        return random_decode_step(self.num_reqs, self.max_tokens, self.context,
                                  variable=self.variable, acceptance=self.acceptance,
                                  heads=self.heads, seed=seed, device=device,
                                  compress_ratio=self.compress_ratio)


def custom_cases(args) -> list[Case]:
    """Cases from the command line: every combination of ``--batch``,
    ``--context`` and ``--tokens``, with ``--acceptance`` (accepted draft tokens,
    each with that probability) or ``--variable`` (uniform 1..tokens) or neither
    (uniform batches), and ``--compress-ratio`` (DeepSeek V4's cache)."""
    if not (args.batch or args.context or args.tokens):
        return []
    out = []
    for b in args.batch or [64]:
        for length in args.context or [32768]:
            for t in args.tokens or [4]:
                kind = (f"acc{args.acceptance:g}" if args.acceptance is not None else
                        "1..%d" % t if args.variable else "uniform")
                v4 = f" V4/{args.compress_ratio}" if args.compress_ratio > 1 else ""
                out.append(Case(f"B{b} L{length} {t}tok {kind}{v4}", b, length, t,
                                variable=args.variable, heads=args.heads,
                                compress_ratio=args.compress_ratio,
                                acceptance=args.acceptance))
    return out


GPU_CASES = [
    Case("B64 L32K 4tok uniform", 64, 32768, 4),
    Case("B64 L8K 4tok uniform", 64, 8192, 4),
    Case("B128 L8K 4tok uniform", 128, 8192, 4),
    Case("B256 L8K 4tok uniform", 256, 8192, 4),
    Case("B8 L128K 4tok uniform", 8, 131072, 4),
    Case("B16 L16K 4tok uniform", 16, 16384, 4),
    Case("B1 L8K 4tok uniform", 1, 8192, 4),
    Case("B64 L32K 2tok uniform", 64, 32768, 2),
    Case("B256 L4K 2tok uniform", 256, 4096, 2),
    Case("B64 L32K 3tok uniform", 64, 32768, 3),
    Case("B64 L32K 1..4tok", 64, 32768, 4, variable=True),
    Case("B64 L8K 1..4tok", 64, 8192, 4, variable=True),
    Case("B128 L8K 1..4tok", 128, 8192, 4, variable=True),
    Case("B64 L8K 5tok uniform", 64, 8192, 5),
    Case("B64 L8K 6tok uniform", 64, 8192, 6),
    Case("B64 L8K 7tok uniform", 64, 8192, 7),
    Case("B64 L8K 8tok uniform", 64, 8192, 8),
    Case("B64 L8K 1..8tok", 64, 8192, 8, variable=True),
]
CPU_CASES = [
    Case("tiny B3 L300 1..4tok", 3, 300, 4, variable=True, heads=32),
    Case("tiny B2 L200 2tok", 2, 200, 2, heads=32),
]


@dataclass
class Row:
    case: str
    path: str
    us: float
    floor_us: float
    mem_floor_us: float
    compute_floor_us: float
    useful_rows: int
    padded_rows: int
    kv_reads_per_request: float
    plan_host_us: float
    note: str = ""
    params: dict = field(default_factory=dict)
    eager_us: float = float("nan")


def measure_ceilings(torch, do_bench):
    """(copy bytes/s counting read + write, fp8 dense matmul FLOP/s), measured here."""
    n = 1 << 30
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median") * 1e-3
    bw = 2 * n / t
    m = 8192
    a = torch.randn((m, m), device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn((m, m), device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0, device="cuda")
    t = do_bench(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                 warmup=50, rep=300, return_mode="median") * 1e-3
    return bw, 2 * m ** 3 / t


def floors(step, bw, flops_rate):
    """Memory floor (KV once per request + useful fp32 logits + q + weights) and
    compute floor (2·H·D per useful logit), in seconds."""
    from ..plan import run_ends

    rows = step.rows
    heads, dim = step.q.shape[2], step.q.shape[3]
    ctx = rows.context_lens.long()
    last = run_ends(rows.indices)
    kv_tokens = int(ctx[last].sum())
    useful_logits = int(ctx.sum())
    num_rows = rows.num_rows
    bytes_ = kv_tokens * (dim + 4) + useful_logits * 4 + num_rows * heads * (dim + 4)
    flops = 2 * heads * dim * useful_logits
    return bytes_ / bw, flops / flops_rate, useful_logits, kv_tokens


def plan_host_us(torch, step, reps=200):
    """Host µs of one plan call (the builder's per-step work), no sync inside."""
    from ..plan import DecodeRowBuffers, plan_decode_rows
    lens = step.decode_lens
    uniform = int(lens.min()) == int(lens.max())
    n = int(lens.max())
    num_rows = step.num_rows
    bufs = DecodeRowBuffers.allocate(num_rows, step.block_table.shape[1], step.q.device)
    kwargs = dict(uniform_len=n) if uniform else dict(num_tokens=num_rows)
    for _ in range(10):
        plan_decode_rows(step.seq_lens, step.query_start_loc, step.block_table,
                         num_rows=num_rows, out=bufs, **kwargs)
    sync = torch.cuda.synchronize if step.q.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        plan_decode_rows(step.seq_lens, step.query_start_loc, step.block_table,
                         num_rows=num_rows, out=bufs, **kwargs)
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) / reps * 1e6


def cuda_default_path(step):
    """The CUDA sm_90 kernel as the launcher runs it (``kernel="sm90_cuda"``),
    its schedule planned once for the step outside the timed call."""
    from ..ops import cuda_paged_mqa_logits as ck
    from ..ops.launcher import varlen_paged_mqa_logits

    rows = step.rows
    ctx2d = rows.context_lens.view(-1, 1)
    hint = int(step.decode_lens.max())
    sched = ck.plan(rows.indices, ctx2d, step.max_context_len, rows.block_table.shape[1])
    return Path(lambda: varlen_paged_mqa_logits(
        step.q, step.kv_cache, step.weights, ctx2d, rows.block_table, rows.indices,
        step.max_context_len, max_run_len=hint, kernel="sm90_cuda", schedule=sched),
        rows.num_rows, 0, 1.0, dict(rows_max=ck.ROWS_MAX))


def case_paths(torch, case, args, dg, num_sms):
    """Build ``case``'s decode step and every path to time on it."""
    from ..ops import cuda_paged_mqa_logits as ck
    from ..ops.launcher import varlen_paged_mqa_logits

    step = case.step(args.seed, "cuda")
    rows = step.rows
    ctx2d = rows.context_lens.view(-1, 1)
    hint = int(step.decode_lens.max())
    paths = {}
    if args.peer == "vdg":
        return step, vdg_paths(torch, step, dg, num_sms)
    hopper = torch.cuda.get_device_capability(step.q.device) == (9, 0)
    sm90 = {}
    if args.peer == "sm90" or (hopper and not args.no_sm90):
        why = ck.unsupported_reason(step.q, step.kv_cache, step.weights)
        if why is None:
            sm90["cuda-sm90"] = cuda_default_path(step)
        else:
            print(f"cuda-sm90: not timed ({why})", flush=True)
    if args.peer == "sm90":
        return step, sm90
    for params in triton_variants(args.variants):
        label = ("triton-portable" if hopper else "triton-varlen") + ("" if not params else " " + ",".join(
            f"{k}={v}" for k, v in params.items()))
        paths[label] = Path(lambda p=params: varlen_paged_mqa_logits(
            step.q, step.kv_cache, step.weights, ctx2d, rows.block_table, rows.indices,
            step.max_context_len, max_run_len=hint, kernel="portable", **p), rows.num_rows, 0, 1.0,
            dict(params))
    paths.update(sm90)
    if dg is not None:
        paths.update(deepgemm_paths(torch, step, dg, num_sms))
    return step, paths


def trace_pass(torch, cases, args, dg, num_sms):
    """Three calls of every path under torch.profiler, each in an NVTX range and a
    profiler record named ``case | path`` (the timed runs stay unprofiled; building
    each step shows as ``build step``)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for case in cases:
            with torch.profiler.record_function("build step"):
                step, paths = case_paths(torch, case, args, dg, num_sms)
                for name in list(paths):
                    try:
                        paths[name].fn()  # compile before the traced calls
                    except Exception:  # noqa: BLE001 - refused variants were reported already
                        del paths[name]
            torch.cuda.synchronize()
            for name, path in paths.items():
                label = f"{case.name} | {name}"
                for _ in range(3):
                    torch.cuda.nvtx.range_push(label)
                    with torch.profiler.record_function(label):
                        path.fn()
                    torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            del step, paths
            torch.cuda.empty_cache()
    profiler.export_chrome_trace(args.trace)
    print(f"trace written: {args.trace}")


def profile_pass(torch, cases, args, dg, num_sms):
    """One call of every path per case between ``cudaProfilerStart`` and
    ``cudaProfilerStop``, in an NVTX range ``case | path`` (three untimed calls
    first), for Nsight Compute started with ``--profile-from-start off``::

        ncu --profile-from-start off --set full -o sm90 python3 -m vllm_dsa_varlen.bench \\
            --profile --peer sm90 --cases "B64 L32K 4tok"

    ``--paths``: keep only paths whose name contains one of these substrings."""
    for case in cases:
        step, paths = case_paths(torch, case, args, dg, num_sms)
        for name, path in paths.items():
            if args.paths and not any(s in name for s in args.paths):
                continue
            for _ in range(3):
                path.fn()
            torch.cuda.synchronize()
            print(f"profiling: {case.name} | {name}", flush=True)
            torch.cuda.cudart().cudaProfilerStart()
            torch.cuda.nvtx.range_push(f"{case.name} | {name}")
            path.fn()
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
        del step, paths
        torch.cuda.empty_cache()


def triton_variants(spec: str | None):
    """Kernel parameter sets to time: ``default`` or ``k=v,k=v;k=v,...`` with
    ``k`` one of :data:`KNOBS` and ``v`` an int (``ValueError`` naming
    ``--variants`` otherwise)."""
    if not spec:
        return [{}]
    out = []
    for part in spec.split(";"):
        params = {}
        for kv in filter(None, part.split(",")):
            k, eq, v = kv.partition("=")
            k = k.strip()
            if not eq or k not in KNOBS:
                raise ValueError(f"--variants: expected k=v with k one of {', '.join(KNOBS)}, "
                                 f"got {kv!r}")
            try:
                params[k] = int(v)
            except ValueError:
                raise ValueError(f"--variants: {k} takes an int, got {v!r}") from None
        out.append(params)
    return out


def check_close(torch, got, ref, mask):
    err = float((got[mask] - ref[mask]).norm() / ref[mask].norm().clamp_min(1e-30))
    return err


def run_gpu(args):
    import torch
    from triton.testing import do_bench

    from ..ops import launcher
    from ..ops.reference import paged_mqa_logits_ref, valid_mask

    try:
        if args.peer == "sm90":
            dg, num_sms = None, 0
        elif args.peer == "vdg":
            import vllm_deep_gemm as dg
            num_sms = dg.get_num_sms()
        else:
            import deep_gemm as dg
            num_sms = dg.get_num_sms()
    except Exception as exc:  # noqa: BLE001 - report and go on without the peer
        if args.peer:
            raise SystemExit(f"--peer {args.peer}: DeepGEMM not importable ({exc})")
        print(f"DeepGEMM not available ({exc}); timing the Triton kernels only")
        dg, num_sms = None, 0
    cases = selected_cases(args, gpu=True)
    if args.profile:  # nothing timed: one call per path for a profiler
        profile_pass(torch, cases, args, dg, num_sms)
        return [], {"device": torch.cuda.get_device_name(), "profiled": True}
    bw, flops_rate = measure_ceilings(torch, do_bench)
    print(f"measured: copy {bw / 1e12:.2f} TB/s, fp8 matmul {flops_rate / 1e12:.0f} TFLOP/s")
    results = []
    for case in cases:
        step, paths = case_paths(torch, case, args, dg, num_sms)
        mem_s, comp_s, _, _ = floors(step, bw, flops_rate)
        floor_s = max(mem_s, comp_s)
        host_us = plan_host_us(torch, step)
        rows = step.rows
        ctx2d = rows.context_lens.view(-1, 1)
        ref = paged_mqa_logits_ref(step.q, step.kv_cache, step.weights, ctx2d, rows.block_table,
                                   step.max_context_len, indices=rows.indices)
        mask = valid_mask(ctx2d, step.max_context_len, rows.indices)
        for name, path in paths.items():
            try:
                out = path.fn().float()
            except Exception as exc:  # noqa: BLE001 - a variant this GPU/Triton refuses
                print(f"{case.name} | {name}: failed: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            note = ""
            if name.startswith("triton"):
                compiled = launcher.LAST_COMPILED[0]
                path.params.update(regs=getattr(compiled, "n_regs", None),
                                   spills=getattr(compiled, "n_spills", None))
                note = f" regs={path.params['regs']} spills={path.params['spills']}"
            if path.result is not None:
                out = path.result()
            if path.row_of is not None:
                out = out[path.row_of]
            err = check_close(torch, out[:, : step.max_context_len], ref, mask)
            eager = do_bench(path.fn, warmup=25, rep=args.rep_ms, return_mode="median") * 1e-3
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                path.fn()
            t = do_bench(graph.replay, warmup=25, rep=args.rep_ms, return_mode="median") * 1e-3
            results.append(Row(case.name, name, t * 1e6, floor_s * 1e6, mem_s * 1e6, comp_s * 1e6,
                               rows.num_rows, path.padded_rows, path.kv_reads, host_us,
                               note=f"eager={eager * 1e6:.1f}us rel_err={err:.1e}{note}",
                               params=path.params, eager_us=eager * 1e6))
            del graph
        del step, paths, ref, mask
        torch.cuda.empty_cache()
        if args.json:  # the rows so far survive a crash in a later case
            write_json(args, results, {"device": torch.cuda.get_device_name(), "partial": True},
                       torch)
    if args.trace:
        trace_pass(torch, cases, args, dg, num_sms)
    for path in args.merge or []:  # a peer's rows (same cases, same seeds, its own process)
        with open(path) as f:
            peer = json.load(f)
        by_case = {r.case: r for r in results}
        for row in peer["results"]:
            mine = by_case.get(row["case"])
            if mine is not None:  # floors from this run's ceilings
                row.update(floor_us=mine.floor_us, mem_floor_us=mine.mem_floor_us,
                           compute_floor_us=mine.compute_floor_us)
            results.append(Row(**row))
        results.sort(key=lambda r: [c.name for c in cases].index(r.case)
                     if r.case in [c.name for c in cases] else len(cases))
    return results, {"copy_TBps": bw / 1e12, "fp8_TFLOPs": flops_rate / 1e12,
                     "device": torch.cuda.get_device_name(), "deepgemm": getattr(dg, "__version__", None)}


def run_cpu(args):
    import torch

    from ..ops.reference import paged_mqa_logits_ref, valid_mask
    from ..ops.launcher import varlen_paged_mqa_logits

    print("no CUDA GPU: tiny shapes through the torch reference and the Triton interpreter; "
          "times are not kernel performance")
    results = []
    profiler = None
    if args.trace:  # CPU activity only: no NVTX without CUDA
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.__enter__()
    for case in selected_cases(args, gpu=False):
        step = case.step(args.seed)
        rows = step.rows
        ctx2d = rows.context_lens.view(-1, 1)
        host_us = plan_host_us(torch, step, reps=20)
        timed = {}
        for name, fn in (
                ("reference (cpu)", lambda: paged_mqa_logits_ref(
                    step.q, step.kv_cache, step.weights, ctx2d, rows.block_table,
                    step.max_context_len, indices=rows.indices)),
                ("triton-varlen (interpreter)", lambda: varlen_paged_mqa_logits(
                    step.q, step.kv_cache, step.weights, ctx2d, rows.block_table, rows.indices,
                    step.max_context_len, max_run_len=case.max_tokens))):
            with torch.profiler.record_function(f"{case.name} | {name}"):
                t0 = time.perf_counter()
                timed[name] = (fn(), time.perf_counter() - t0)
        (ref, _), (got, _) = timed.values()
        mask = valid_mask(ctx2d, step.max_context_len, rows.indices)
        err = float((got[mask] - ref[mask]).norm() / ref[mask].norm())
        for name, (_, t) in timed.items():
            results.append(Row(case.name, name, t * 1e6, float("nan"), float("nan"), float("nan"),
                               rows.num_rows, 0, 1.0, host_us, note=f"rel_err={err:.1e}"))
    if profiler is not None:
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(args.trace)
        print(f"trace written: {args.trace} (CPU activity)")
    return results, {"device": "cpu (interpreter)", "copy_TBps": None, "fp8_TFLOPs": None}


def format_table(results):
    head = f"{'case':24} {'path':34} {'µs':>9} {'floor µs':>9} {'x floor':>8} {'rows u/pad':>11} {'KV reads':>8} {'plan µs':>8}  note"
    lines = [head, "-" * len(head)]
    for r in results:
        floor = r.floor_us if r.floor_us is not None else float("nan")
        ratio = r.us / floor if floor == floor and floor > 0 else float("nan")
        lines.append(f"{r.case:24} {r.path:34} {r.us:9.1f} {floor:9.1f} {ratio:8.2f} "
                     f"{r.useful_rows:>5}/{r.padded_rows:<5} {r.kv_reads_per_request:8.2f} "
                     f"{r.plan_host_us:8.1f}  {r.note}")
    return "\n".join(lines)


def strict_json(value):
    """``value`` with every non-finite float replaced by ``None`` (JSON has no
    NaN or Infinity; strict parsers such as jq and JSON.parse reject them)."""
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=os.path.dirname(__file__)).stdout.strip() or None
    except OSError:
        return None


OUT_DIR = "bench-out"  # the output folder (git ignores it), made on first use
DEFAULT_JSON = os.path.join(OUT_DIR, "bench.json")
DEFAULT_TRACE = os.path.join(OUT_DIR, "trace.json")
# The portable kernel's tuning knobs (--variants): keywords of the launcher's call.
KNOBS = ("rows_per_dot", "per_row", "groups", "tile_pages", "tiles_per_split", "num_warps",
         "num_stages")


def _int_at_least(least: int):
    """An argparse type: an int >= ``least`` (argparse names the flag)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {least}, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an int >= {least}, got {value}")
        return value
    parse.__name__ = f"int >= {least}"
    return parse


def _probability(text: str) -> float:
    """An argparse type: a float in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value:g}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (each value's type checked by argparse; what
    depends on several is :func:`check_args`')."""
    positive, natural = _int_at_least(1), _int_at_least(0)
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--json", nargs="?", const=DEFAULT_JSON, metavar="PATH",
                        help=f"write the results here (alone: {DEFAULT_JSON}; the folder must "
                        f"exist, {OUT_DIR}/ is made)")
    parser.add_argument("--trace", nargs="?", const=DEFAULT_TRACE, metavar="PATH",
                        help="write a Chrome trace (torch.profiler, NVTX ranges) here (alone: "
                        f"{DEFAULT_TRACE})")
    parser.add_argument("--cases", nargs="+", help="substrings of the case names to run "
                        "(--plan-timing, --builds: requests,tokens,context each, tokens -n "
                        "for 1..n)")
    parser.add_argument("--variants", help="Triton kernel parameter sets, e.g. "
                        "'rows_per_dot=2,tiles_per_split=8;rows_per_dot=4,num_warps=8' "
                        f"(knobs: {', '.join(KNOBS)}); needs a GPU")
    parser.add_argument("--rep-ms", type=positive, default=None,
                        help="do_bench repetition time (ms; default 200, --plan-timing 20)")
    parser.add_argument("--seed", type=natural, default=0)
    parser.add_argument("--batch", type=positive, nargs="+", help="custom cases: batch sizes")
    parser.add_argument("--context", type=positive, nargs="+",
                        help="custom cases: mean KV lengths")
    parser.add_argument("--tokens", type=positive, nargs="+",
                        help="custom cases: MTP tokens per request")
    parser.add_argument("--acceptance", type=_probability,
                        help="custom cases: draft acceptance rate")
    parser.add_argument("--variable", action="store_true",
                        help="custom cases: tokens per request uniform in 1..tokens")
    parser.add_argument("--compress-ratio", type=positive, default=1,
                        help="custom cases: DeepSeek V4 compressed cache ratio")
    parser.add_argument("--heads", type=int, choices=(32, 64), default=None,
                        help="indexer heads (default 64 on a GPU, 32 on the CPU); "
                        "--plan-timing: 64 or 32 (default both)")
    parser.add_argument("--cpu", action="store_true", help="force the tiny CPU run")
    parser.add_argument("--peer", choices=["vdg", "sm90"], help="time only one peer in this "
                        "process: vdg (vLLM 0.33's DeepGEMM 2.8.1, importable as vllm_deep_gemm) "
                        "or sm90 (this project's sm_90 CUDA kernel); needs a GPU")
    parser.add_argument("--no-sm90", action="store_true",
                        help="leave the sm_90 kernel out (time it with --peer sm90 instead)")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="JSON files of --peer runs to merge into this run; needs a GPU")
    parser.add_argument("--profile", action="store_true", help="time nothing: one call of every "
                        "path per case inside cudaProfilerStart/Stop, for Nsight Compute "
                        "(ncu --profile-from-start off); needs a GPU")
    parser.add_argument("--paths", nargs="+", help="with --profile: substrings of path names "
                        "to keep")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--plan-timing", action="store_true",
                      help="time the sm_90 kernel's schedule instead: the one-launch planner, "
                      "plan_torch and DeepGEMM's metadata (vllm_dsa_varlen.bench.schedule); "
                      "needs a GPU")
    mode.add_argument("--launch-host", action="store_true",
                      help="time the host side of eager calls instead, against graph replay "
                      "(vllm_dsa_varlen.bench.launch); without a GPU, --fake")
    mode.add_argument("--builds", nargs="+", metavar="BUILD",
                      help="time the sm_90 CUDA kernel's shipped builds side by side instead, "
                      "in one process (vllm_dsa_varlen.bench.builds): 'default' or "
                      "'MACRO=v+MACRO=v' as the settings select them, e.g. HEAD_SUM_TC=1, "
                      "NUM_MATH=3+DUAL_ACC=4, PDL=1; needs a GPU")
    parser.add_argument("--rounds", type=positive, default=None,
                        help="--plan-timing, --builds: timed rounds, interleaved (default 5; "
                        "--builds: one whole cycle of the balanced order per case, 1 with "
                        "--fixed-order; median)")
    parser.add_argument("--deepgemm", action="store_true",
                        help="--builds: DeepGEMM beside (deep_gemm, else vllm_deep_gemm): "
                        "flattened, native, stock 0.33's split; its metadata beside the plan")
    parser.add_argument("--fixed-order", action="store_true",
                        help="--builds: time the paths in the given order every round (default: a "
                        "balanced Latin square, each path leading and following every other "
                        "equally often over a cycle of rounds)")
    parser.add_argument("--flush", choices=list(FLUSHES), default=None,
                        help="--builds: the L2 before each timed call: read (default; a 256 MB "
                        "buffer read, clean lines, as a decode step leaves it) or zero (written, "
                        "dirty lines: Triton do_bench's flush)")
    parser.add_argument("--lead", choices=list(LEADS), default=None,
                        help="--builds: each logits call timed right after a kernel that "
                        "writes its queries, captured in the same graph (as a decode step "
                        "writes them just before the logits): 'copy' torch's copy; 'early' a "
                        "Triton kernel launched as a programmatic dependent that lets the next "
                        "kernel launch at its start, as vLLM 0.33's _fused_q_kernel does; so a "
                        "build launched as a programmatic dependent (PDL=1) can start under "
                        "it; DeepGEMM's launched so too, as vLLM 0.33 sets it on Hopper; "
                        "'lead' alone beside")
    parser.add_argument("--pages", choices=["random", "in-order"], default=None,
                        help="--builds: where the requests' KV pages lie in the pool: a "
                        "permutation (default) or each request's consecutive, request by "
                        "request (a fresh engine's prefill)")
    parser.add_argument("--topk-lib", help="--builds: vLLM's _C extension (.so): its decode "
                        "top-k on each path's rows, and per-step figures; --launch-host: "
                        "the host time of its eager top-k call beside the project's")
    parser.add_argument("--layers", type=positive, default=None,
                        help="--builds --topk-lib: indexer layers per decode step (default 61)")
    parser.add_argument("--topk-builds", nargs="+", default=None,
                        help="--builds --topk-lib: builds of this project's top-k kernel "
                        "timed beside vLLM's (default: default, the launch plan's; "
                        "MACRO=v+...: one of ops.cuda_topk.plan_builds(); +bound=N|step)")
    parser.add_argument("--topk-width", type=positive, default=None,
                        help="--builds --topk-lib: the top-k calls read logits of this many "
                        "columns (the step's in the first; the rest -inf) and vLLM's gets it as "
                        "max_seq_len, this project's no bound: a CUDA-graph-captured step's "
                        "call, whose width is max_model_len (e.g. 163840)")
    parser.add_argument("--topk-cooperative-rows", type=natural, default=None,
                        help="--builds --topk-lib: vLLM's call takes cooperative_topk up to this "
                        "many rows (default 32: vLLM 0.27.1's indexer; 64: vLLM 0.33.0's auto "
                        "chain, with its extension as --topk-lib)")
    parser.add_argument("--topk-eager-line", choices=["0.27.1", "0.33.0"], default=None,
                        help="--builds --topk-lib: vLLM's top-k called as that line's eager "
                        "step calls it (max_seq_len the step's longest row, except 0.27.1's "
                        "persistent_topk: the width; cooperative_topk up to 32 / 64 rows); "
                        "default: a captured step's call (max_seq_len the width)")
    parser.add_argument("--calls", type=positive, default=None,
                        help="--launch-host: calls per timed round (default 50)")
    parser.add_argument("--fake", action="store_true", help="--launch-host: the launch on CPU "
                        "tensors, driver calls stubbed (any machine)")
    parser.add_argument("--base", default="",
                        help="--launch-host: also time this git revision's launcher and "
                        "launch (a revision with ops/launcher.py), or those of a folder holding "
                        "vllm_dsa_varlen/ops, beside this one in one process")
    return parser


def check_output(flag: str, path: str) -> str:
    """``path`` checked as a file a run may write: not a folder, in a folder
    that exists (the output folder :data:`OUT_DIR` is made) and is writable;
    the message of what is wrong, naming ``flag``, else ``""``."""
    folder = os.path.dirname(os.path.abspath(path))
    parts = os.path.normpath(path).split(os.sep)
    if not os.path.isdir(folder) and not os.path.isabs(path) and parts[0] == OUT_DIR:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            return f"{flag}: cannot make the folder {folder}: {exc.strerror}"
    if not os.path.isdir(folder):
        return f"{flag}: the folder {folder} does not exist"
    if os.path.isdir(path):
        return f"{flag}: {path} is a folder; name a file"
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{flag}: {path} is not writable"
    return ""


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """What one value's type cannot say: the options each mode takes, the
    output paths (before the run), the case specs, the merged files;
    ``parser.error`` (exit status 2) naming the flag otherwise."""
    default_mode = not (args.plan_timing or args.launch_host or args.builds)
    custom = bool(args.batch or args.context or args.tokens)
    wrong = [f"{flag} only with {mode}" for flag, mode, given, on in (
        ("--rounds", "--plan-timing or --builds", args.rounds is not None,
         args.plan_timing or bool(args.builds)),
        ("--deepgemm", "--builds", args.deepgemm, bool(args.builds)),
        ("--fixed-order", "--builds", args.fixed_order, bool(args.builds)),
        ("--pages", "--builds", args.pages is not None, bool(args.builds)),
        ("--flush", "--builds", args.flush is not None, bool(args.builds)),
        ("--lead", "--builds without --topk-lib (its per-step sums count each call alone)",
         args.lead is not None, bool(args.builds) and not args.topk_lib),
        ("--topk-lib", "--builds or --launch-host (GPU)", bool(args.topk_lib),
         bool(args.builds) or (args.launch_host and not args.fake)),
        ("--layers", "--builds", args.layers is not None, bool(args.builds)),
        ("--topk-builds", "--builds --topk-lib", args.topk_builds is not None,
         bool(args.builds and args.topk_lib)),
        ("--topk-width", "--builds --topk-lib", args.topk_width is not None,
         bool(args.builds and args.topk_lib)),
        ("--topk-cooperative-rows", "--builds --topk-lib",
         args.topk_cooperative_rows is not None, bool(args.builds and args.topk_lib)),
        ("--topk-eager-line", "--builds --topk-lib", args.topk_eager_line is not None,
         bool(args.builds and args.topk_lib)),
        ("--calls", "--launch-host", args.calls is not None, args.launch_host),
        ("--fake", "--launch-host", args.fake, args.launch_host),
        ("--base", "--launch-host", bool(args.base), args.launch_host),
        ("--cpu", "the default mode or --launch-host", args.cpu,
         default_mode or args.launch_host),
        ("--rep-ms", "the default mode, --plan-timing or --builds", args.rep_ms is not None,
         not args.launch_host),
        ("--heads", "the default mode, --plan-timing or --builds", args.heads is not None,
         not args.launch_host),
        ("--trace", "the default mode", args.trace is not None, default_mode),
        ("--variants", "the default mode", args.variants is not None, default_mode),
        ("--peer", "the default mode", args.peer is not None, default_mode),
        ("--no-sm90", "the default mode", args.no_sm90, default_mode),
        ("--merge", "the default mode", args.merge is not None, default_mode),
        ("--profile", "the default mode", args.profile, default_mode),
        ("--paths", "--profile", args.paths is not None, args.profile),
        ("--seed", "the default mode", args.seed != 0, default_mode),
        ("--batch, --context, --tokens", "the default mode", custom, default_mode),
        ("--acceptance", "--batch, --context or --tokens", args.acceptance is not None, custom),
        ("--variable", "--batch, --context or --tokens", args.variable, custom),
        ("--compress-ratio", "--batch, --context or --tokens", args.compress_ratio != 1,
         custom)) if given and not on]
    if args.acceptance is not None and args.variable:
        wrong.append("--acceptance and --variable: one or the other (accepted drafts, or "
                     "uniform 1..tokens)")
    if wrong:
        parser.error("; ".join(wrong))
    for flag, path in (("--json", args.json), ("--trace", args.trace)):
        problem = check_output(flag, path) if path is not None else ""
        if problem:
            parser.error(problem)
    for path in args.merge or []:
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            parser.error(f"--merge: {path} is not a readable file")
    if args.variants is not None:
        try:
            triton_variants(args.variants)
        except ValueError as exc:
            parser.error(str(exc))
    try:
        if args.plan_timing or args.builds:
            from .builds import parse_step_case
            from .schedule import parse_case
            for text in args.cases or []:  # a share of cut requests: --builds' cases alone
                (parse_case if args.plan_timing else parse_step_case)(text)
        if args.builds:
            from .builds import parse_build, topk_build
            for text in args.builds:
                parse_build(text, args.heads or 64)
            for text in args.topk_builds or []:
                topk_build(text)
        if args.launch_host and args.cases:
            from .launch import CASES, _selected
            if not _selected(args.cases):
                raise ValueError(f"--cases: {' '.join(args.cases)!r} matches none of "
                                 f"--launch-host's cases: {', '.join(CASES)}")
    except ValueError as exc:
        parser.error(str(exc))


def selected_cases(args, gpu: bool) -> list[Case]:
    """The default mode's cases: the custom ones (``--batch``, ``--context``,
    ``--tokens``) or this machine's built-in ones (:data:`GPU_CASES`,
    :data:`CPU_CASES`), those whose name holds one of ``--cases`` when given."""
    cases = custom_cases(args) or (GPU_CASES if gpu else CPU_CASES)
    if args.cases:
        cases = [c for c in cases if any(s in c.name for s in args.cases)]
    return cases


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.plan_timing:
        from . import schedule
        return schedule.run(args)
    if args.launch_host:
        from . import launch
        return launch.run(args)
    if args.builds:
        from . import builds
        if args.layers is None:
            args.layers = 61
        return builds.run(args)
    if args.rep_ms is None:
        args.rep_ms = 200
    import torch
    gpu = torch.cuda.is_available() and not args.cpu
    if not gpu:
        needs = [flag for flag, given in (("--profile", args.profile), ("--peer", args.peer),
                                          ("--merge", args.merge), ("--variants", args.variants),
                                          ("--no-sm90", args.no_sm90)) if given]
        if needs:
            parser.error(f"{', '.join(needs)}: needs a CUDA GPU (this run is the CPU's: "
                         "the reference and the Triton interpreter on tiny shapes)")
    if args.heads is None:
        args.heads = 64 if gpu else 32
    if args.cases and not selected_cases(args, gpu):
        names = [c.name for c in custom_cases(args) or (GPU_CASES if gpu else CPU_CASES)]
        parser.error(f"--cases: {' '.join(map(repr, args.cases))} matches none of this run's "
                     f"cases ({'GPU' if gpu else 'CPU'}): {', '.join(names)}")
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    results, env = (run_gpu if gpu else run_cpu)(args)
    table = format_table(results)
    print(table)
    if args.json:
        write_json(args, results, env, torch, argv)
        print(f"json written: {args.json}")
    return 0


def write_json(args, results, env, torch, argv=None):
    """The run as strict JSON (no NaN: unknown floors are null)."""
    import triton

    payload = {"command": " ".join([PROG] + (argv or sys.argv[1:])),
               "commit": git_commit(), "python": platform.python_version(),
               "torch": torch.__version__, "triton": triton.__version__, **env,
               "results": [asdict(r) for r in results]}
    with open(args.json, "w") as f:
        json.dump(strict_json(payload), f, indent=1, allow_nan=False)


if __name__ == "__main__":
    sys.exit(main())

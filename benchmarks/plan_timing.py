#!/usr/bin/env python3
"""The sm_90 CUDA kernel's per-step schedule: the one-launch planner
(``ops/cuda_plan.py``) against the torch-operations plan it replaces
(``cuda_paged_mqa_logits.plan_torch``) and, where importable, DeepGEMM's
metadata (``get_paged_mqa_logits_metadata``; ``deep_gemm``, else vLLM's
``vllm_deep_gemm``), on the same steps, rounds interleaved.

Each path is captured in a CUDA graph and timed two ways: one replay per
timed call (``do_bench``: L2 flushed before each, CUDA events around it: the
step's latency for the op, with the graph launch) and 20 copies in one graph
replayed back to back (µs per copy: the GPU time a step pays when the op sits
among others).  A one-element ``add_`` timed the same way gives the floor of
both methods.  Every planner output is checked bit for bit against
``plan_torch`` first.

    python3 benchmarks/plan_timing.py [--rounds 5] [--cases 64,4,32768 64,-4,8192 ...] [--json f]

Cases: ``requests,tokens,context`` (tokens ``-n``: 1..n per request), KV
lengths uniform in context ± 30 %, 7 graph-padding rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vllm_dsa_varlen.bench import capture_graph  # noqa: E402

CASES = ["64,4,32768", "64,4,8192", "128,4,8192", "256,4,8192", "8,4,131072", "16,4,16384",
         "1,4,8192", "64,2,32768", "256,2,4096", "64,3,32768", "64,-4,32768", "128,-4,8192",
         "64,6,8192", "64,8,8192", "1000,8,4096", "1024,8,4096", "2048,4,2048"]
COPIES = 20


def step_rows(torch, reqs: int, tokens: int, context: int, seed: int = 0):
    """A step's rows on the GPU (:func:`..workloads.random_step_rows`, 7
    graph-padding rows) and the request-level context lengths DeepGEMM's
    native path takes."""
    from vllm_dsa_varlen.workloads import random_step_rows

    n = abs(tokens)
    rows, seqs, lens, width = random_step_rows(reqs, n, context, variable=tokens < 0,
                                               seed=seed)
    native = None
    if tokens > 0:  # [B, next_n] context lengths (DeepGEMM's native layout)
        offs = torch.arange(n, dtype=torch.int32)
        native = (seqs[:, None] - n + 1 + offs[None, :]).clamp_min(0).to(torch.int32).cuda()
    return rows, int(seqs.max()), width, native


def import_deepgemm():
    for name in ("deep_gemm", "vllm_deep_gemm"):
        try:
            mod = __import__(name)
            if hasattr(mod, "get_paged_mqa_logits_metadata"):
                return name, mod
        except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
            print(f"# {name} not importable: {type(exc).__name__}: {exc}")
    return None, None


def graph_of(torch, fn, copies: int):
    graph = capture_graph(torch, fn, copies)
    torch.cuda.synchronize()
    return graph


def main(argv=None) -> int:
    import torch
    from triton.testing import do_bench

    from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
    from vllm_dsa_varlen.ops import cuda_plan as cp
    from vllm_dsa_varlen.ops.common import num_sms as _num_sms

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="*", default=CASES)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rep-ms", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    sms = _num_sms(torch.device("cuda"))
    dg_name, dg = import_deepgemm()
    print(f"# {torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}, "
          f"DeepGEMM: {dg_name or 'not importable'}")
    cp.load("cuda")

    z = torch.zeros(1, device="cuda")
    floor = {"floor": (graph_of(torch, lambda: z.add_(1), 1),
                       graph_of(torch, lambda: z.add_(1), COPIES))}
    cases = [dict(case="floor (add_)", rows=0, same=True, graphs=floor,
                  times={"floor": ([], [])})]
    for text in args.cases:
        reqs, tokens, context = (int(x) for x in text.split(","))
        rows, max_len, width, native = step_rows(torch, reqs, tokens, context)
        ids, ctx = rows.indices, rows.context_lens
        ctx2d = ctx.view(-1, 1)
        want = ck.plan_torch(ids, ctx2d, max_len, width)
        out = cp.allocate(ids.shape[0], sms, "cuda")
        got = cp.plan_device(ids, ctx, max_len, width, out=out)
        same = all(torch.equal(a, b) for a, b in zip(want, got))
        if not same:
            print(f"# MISMATCH on {text}: planner output differs from plan_torch")
        paths = {
            "plan_torch": lambda ids=ids, ctx2d=ctx2d, m=max_len, w=width: ck.plan_torch(
                ids, ctx2d, m, w),
            "planner": lambda ids=ids, ctx=ctx, m=max_len, w=width, out=out: cp.plan_device(
                ids, ctx, m, w, out=out),
        }
        if dg is not None:
            flat = ctx2d.contiguous()
            paths["dg_meta_flat"] = lambda flat=flat: dg.get_paged_mqa_logits_metadata(
                flat, 64, sms)
            if native is not None:
                paths["dg_meta_native"] = lambda c=native: dg.get_paged_mqa_logits_metadata(
                    c, 64, sms)
        graphs = {}
        for name, fn in paths.items():
            try:
                graphs[name] = (graph_of(torch, fn, 1), graph_of(torch, fn, COPIES))
            except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, not fatal
                print(f"# {text} {name}: {type(exc).__name__}: {exc}")
        cases.append(dict(case=text, rows=ids.shape[0], same=same, graphs=graphs,
                          times={name: ([], []) for name in graphs}))

    for _ in range(args.rounds):
        for case in cases:
            for name, (one, many) in case["graphs"].items():
                lat = do_bench(one.replay, warmup=10, rep=args.rep_ms,
                               return_mode="median") * 1e3
                per = do_bench(many.replay, warmup=5, rep=args.rep_ms,
                               return_mode="median") * 1e3 / COPIES
                case["times"][name][0].append(lat)
                case["times"][name][1].append(per)

    results = []
    names = ["plan_torch", "planner", "dg_meta_flat", "dg_meta_native"]
    shown = [n for n in names if any(n in c["times"] and c["times"][n][0] for c in cases)]
    head = f"{'case':16} {'rows':>5} {'same':>4} " + " ".join(
        f"{n + ' replay':>22} {n + ' /copy':>19}" for n in shown)
    lines = []
    flat, fper = cases[0]["times"]["floor"]
    floor_line = (f"floor (one-element add_): replay {statistics.median(flat):.1f} "
                  f"[{min(flat):.1f}-{max(flat):.1f}], /copy {statistics.median(fper):.2f}")
    for case in cases[1:]:
        row = dict(case=case["case"], rows=case["rows"], bitwise_equal=case["same"])
        cells = []
        for n in shown:
            if n not in case["times"] or not case["times"][n][0]:
                cells.append(f"{'-':>22} {'-':>19}")
                continue
            lat, per = case["times"][n]
            row[n] = dict(replay_us=lat, per_copy_us=per)
            cells.append(f"{statistics.median(lat):8.1f} [{min(lat):5.1f}-{max(lat):5.1f}] "
                         f"{statistics.median(per):6.2f} [{min(per):4.1f}-{max(per):4.1f}]")
        results.append(row)
        lines.append(f"{case['case']:16} {case['rows']:5d} {'yes' if case['same'] else 'NO':>4} "
                     + " ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), sms=sms, deepgemm=dg_name,
                           rounds=args.rounds, copies=COPIES, results=results,
                           floor=dict(replay_us=flat, per_copy_us=fper)), f, indent=1)
    print(f"\nµs, median over {args.rounds} rounds [min-max of the rounds]; replay = one graph "
          f"replay, L2 flushed; /copy = {COPIES} copies in one graph, per copy")
    print(floor_line)
    print(head)
    print("\n".join(lines))
    return 0 if all(c["same"] for c in cases) else 1  # the floor row is always "same"


if __name__ == "__main__":
    sys.exit(main())

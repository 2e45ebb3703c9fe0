#!/usr/bin/env python3
"""A/B of the CUDA sm_90 kernel: build variants (``-D`` macros of
``ops/cuda/sm90_varlen_logits.cu``) and schedule cost models, each checked
against the torch reference on small steps, then timed (CUDA-graph replay, L2
flushed, the plan made outside the timed call) side by side.

    python3 benchmarks/cuda_sm90_variants.py --variants "default" "HALF_GROUPS=0" \\
        "default@1,0" [--cases 64,4,32768 64,-4,32768 ...]

A variant is ``MACRO=v+MACRO=v`` (or ``default``), optionally ``@c0,c1`` for
the plan's cost model (:data:`..ops.cuda_paged_mqa_logits.COST` otherwise).
Cases: ``requests,tokens,context`` (tokens ``-n``: 1..n per request).
``--heads 32`` runs every check and case at 32 heads (the kernel's HEADS=32
build, which ``launch`` takes from the queries' shape).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def parse_variant(text: str):
    """``"A=1+B=2@5,2"`` -> (("A=1", "B=2"), (5, 2)); ``"default"`` -> ((), None)."""
    body, _, cost = text.partition("@")
    defines = () if body in ("", "default") else tuple(body.split("+"))
    return defines, (tuple(int(x) for x in cost.split(",")) if cost else None)


def _graph_us(torch, do_bench, fn, rep_ms):
    from vllm_dsa_varlen.bench import graph_replay_us

    return graph_replay_us(torch, do_bench, fn, rep_ms)


def main(argv=None) -> int:
    import torch
    from triton.testing import do_bench

    from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
    from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, valid_mask
    from vllm_dsa_varlen.workloads import make_decode_step, random_decode_step

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=["default"])
    p.add_argument("--cases", nargs="*", default=["64,4,32768", "64,2,32768", "64,3,32768",
                                                   "64,-4,32768", "128,-4,8192", "64,6,8192"])
    p.add_argument("--rep-ms", type=int, default=30)
    p.add_argument("--heads", type=int, default=64, choices=(32, 64))
    p.add_argument("--rounds", type=int, default=1,
                   help="time every path this many times, interleaved; report the median")
    args = p.parse_args(argv)
    variants = {v: parse_variant(v) for v in args.variants}

    small = [([4, 4, 4, 4], [700, 1500, 64, 2000]), ([3, 1, 2, 4, 3], [10, 3, 130, 999, 64]),
             ([1, 1, 1], [300, 900, 40]), ([7, 5, 6], [5000, 70, 129]), ([4, 3], [2, 3])]
    for name, (defines, cost) in variants.items():
        worst = 0.0
        for seed, (lens, seqs) in enumerate(small):
            step = make_decode_step(lens, seqs, seed=seed, device="cuda", heads=args.heads)
            rows = step.rows
            ctx = rows.context_lens.view(-1, 1)
            out = torch.full((rows.num_rows, step.max_context_len), float("nan"), device="cuda")
            sched = ck.plan(rows.indices, ctx, step.max_context_len, rows.block_table.shape[1],
                            args.heads, **({"cost": cost} if cost else {}))
            ck.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
                      step.max_context_len, out, schedule=sched, defines=defines)
            ref = paged_mqa_logits_ref(step.q, step.kv_cache, step.weights, ctx, rows.block_table,
                                       step.max_context_len, indices=rows.indices)
            mask = valid_mask(ctx, step.max_context_len, rows.indices)
            ok = torch.isfinite(out[mask]).all() and torch.isnan(out[~mask]).all()
            err = float((out[mask] - ref[mask]).norm() / ref[mask].norm())
            worst = max(worst, err if ok else float("inf"))
        print(f"check {name}: worst relative error {worst:.1e} "
              f"{'OK' if worst < 1e-3 else 'FAIL'}", flush=True)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for case in args.cases:
        reqs, tokens, context = (int(x) for x in case.split(","))
        step = random_decode_step(reqs, abs(tokens), context, variable=tokens < 0, seed=0,
                                  device="cuda", heads=args.heads)
        rows = step.rows
        ctx = rows.context_lens.view(-1, 1)
        ends = torch.cat([rows.indices[1:] != rows.indices[:-1],
                          torch.ones(1, dtype=torch.bool, device="cuda")])
        pages = int(((rows.context_lens.view(-1)[ends] + 63) // 64).sum())
        out = torch.empty(rows.num_rows, step.max_context_len, device="cuda")
        calls = {}
        for name, (defines, cost) in variants.items():
            sched = ck.plan(rows.indices, ctx, step.max_context_len, rows.block_table.shape[1],
                            args.heads, **({"cost": cost} if cost else {}))
            calls[name] = lambda s=sched, d=defines: ck.launch(
                step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
                step.max_context_len, out, schedule=s, defines=d)
        times = {k: [] for k in calls}
        for _ in range(args.rounds):
            for k, fn in calls.items():
                times[k].append(_graph_us(torch, do_bench, fn, args.rep_ms))
        res = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        spread = max((max(v) - min(v)) / min(v) for v in times.values())
        label = (f"B{reqs} L{context} {'1..' + str(-tokens) if tokens < 0 else tokens}tok"
                 + ("" if args.heads == 64 else f" H{args.heads}"))
        print(f"{label:22s} " + "  ".join(f"{k} {us:7.1f}" for k, us in res.items())
              + (f"  (median of {args.rounds}; widest spread {spread:.1%})" if args.rounds > 1
                 else ""), flush=True)
        print(f"{'':22s} cycles/page at 1.7 GHz: " + "  ".join(
            f"{k} {us * 1e-6 / (pages / sms) * 1.7e9:5.0f}" for k, us in res.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

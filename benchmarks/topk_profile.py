#!/usr/bin/env python3
"""The decode top-k kernel on serving-like logits, for a profiler: per case
(``requests,tokens,context`` as ``vllm-dsa-varlen-bench --cases``) the
step's logits come from the project's sm_90 kernel on random queries and
KV (the value distribution the benchmark times), then each build of
``cuda/decode_topk.cu`` (``default``: the launch plan's for the shape;
``MACRO=v+...``, one of ``cuda_topk.plan_builds()``, e.g. ``SPLIT=2+MINB=1``;
``+bound=N``: a host bound on the lengths) runs ``--reps`` times, in the
order given, after one untimed launch per build (its NVRTC build and load).  Prints each build's
median time from CUDA events (no L2 flush: the profiler's own figures are
the point).  Run under Nsight Compute, e.g.

    ncu --clock-control none -k regex:decode_topk --launch-skip 2 --launch-count 2 \\
        python3 benchmarks/topk_profile.py --builds default SPLIT=2+MINB=1 --cases 64,4,32768

(skips each build's load launch: builds x cases launches in order)."""

from __future__ import annotations

import argparse
import statistics


def main(argv=None) -> int:
    import torch

    from vllm_dsa_varlen.bench.builds import topk_build
    from vllm_dsa_varlen.bench.schedule import parse_case
    from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
    from vllm_dsa_varlen.ops.cuda_topk import decode_topk
    from vllm_dsa_varlen.bench.workloads import random_decode_step

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--builds", nargs="+", default=["default"])
    parser.add_argument("--cases", nargs="+", default=["64,4,32768"])
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--k", type=int, default=2048)
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps: expected >= 1, got {args.reps}")
    try:
        builds = {build: topk_build(build, "--builds") for build in args.builds}
        cases = [parse_case(case) for case in args.cases]
    except ValueError as exc:
        parser.error(str(exc))
    steps = []
    for case, (reqs, tokens, context) in zip(args.cases, cases):
        step = random_decode_step(reqs, abs(tokens), context, variable=tokens < 0, seed=0,
                                  device="cuda")
        rows = step.rows
        ctx = rows.context_lens.view(-1, 1)
        logits = torch.empty(rows.num_rows, step.max_context_len, device="cuda")
        ck.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
                  step.max_context_len, logits)
        steps.append((case, logits, ctx))
    out = {}
    def call(case, logits, ctx, build):  # "default": the launch plan's build
        defines, bound = builds[build]
        bound = int(ctx.max()) if bound == "step" else bound
        decode_topk(logits, ctx, args.k, out=out[case], defines=defines or None, bound=bound)

    for case, logits, ctx in steps:  # one load launch per build, before any timed one
        for build in args.builds:
            out[case] = torch.empty(logits.shape[0], args.k, dtype=torch.int32, device="cuda")
            call(case, logits, ctx, build)
    torch.cuda.synchronize()
    for case, logits, ctx in steps:
        for build in args.builds:
            times = []
            for _ in range(args.reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                call(case, logits, ctx, build)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            print(f"{case:14s} {build:24s} {statistics.median(times):8.1f} us "
                  f"(median of {args.reps}, events, L2 warm)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Run each path of the benchmark's cases once inside a CUDA profiler range, for
Nsight Compute (``ncu --profile-from-start off``): the kernels of one call per
path are what the profiler sees, after warm-up calls outside the range.

    ncu --profile-from-start off --clock-control none --set full -o rep \\
        python3 benchmarks/profile_paths.py --cases "B64 L32K 4tok" [--peer vdg|gluon]

``--peer`` as in the benchmark (``vdg`` needs vLLM 0.33's DeepGEMM importable as
``vllm_deep_gemm``; ``gluon`` the sm_90 kernel only); ``--paths`` keeps paths whose
name contains one of the given substrings; ``--sm90`` passes ``k=v`` launch
parameters to extra sm_90 variants (``;``-separated sets), each profiled too.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None):
    import torch

    from vllm_dsa_varlen import bench

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="*", default=["B64 L32K 4tok"])
    p.add_argument("--peer", choices=["vdg", "gluon"])
    p.add_argument("--paths", nargs="*", help="substrings of path names to keep")
    p.add_argument("--sm90", help="extra sm_90 launch parameter sets, e.g. 'stages=4;consumers=1'")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.variants, args.no_gluon = None, False

    if args.peer == "vdg":
        import vllm_deep_gemm as dg
        num_sms = dg.get_num_sms()
    else:
        dg, num_sms = None, 0
    cases = [c for c in bench.GPU_CASES if any(s in c.name for s in args.cases)]
    for case in cases:
        step, paths = bench.case_paths(torch, case, args, dg, num_sms)
        if args.sm90 and args.peer != "vdg":
            paths.update(bench.sm90_variant_paths(torch, step, args.sm90))
        if args.paths:
            paths = {k: v for k, v in paths.items() if any(s in k for s in args.paths)}
        for name, path in paths.items():
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


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Stress check of the sm_90 kernel: the same decode step run many times per
launch-parameter set, every run compared bitwise with the first and with the
reference; prints, per set, how many runs differed and where.

    python3 benchmarks/sm90_repeat_check.py --sets "consumers=1;stages=3" --repeats 50

A run that differs from the first points at a race (the kernel writes each
output element from exactly one place, so repeated runs must be identical).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CASES = {  # name: (requests, tokens per request, mean context, acceptance, heads)
    "2tok": (32, 2, 16384, None, 64),
    "4tok": (64, 4, 8192, None, 64),
    "1..4": (64, 4, 8192, 0.6, 64),
    "2tok-short": (96, 2, 100, None, 64),
}


def main(argv=None):
    import torch

    from vllm_dsa_varlen.bench import triton_variants
    from vllm_dsa_varlen.ops import gluon_paged_mqa_logits as gk
    from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, valid_mask
    from vllm_dsa_varlen.workloads import random_decode_step

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", default="", help="launch parameter sets, ';'-separated")
    p.add_argument("--cases", nargs="*", default=list(CASES))
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    for name in args.cases:
        reqs, tokens, context, acc, heads = CASES[name]
        step = random_decode_step(reqs, tokens, context, acceptance=acc, heads=heads,
                                  seed=args.seed, device="cuda")
        rows = step.rows
        ctx = rows.context_lens.view(-1, 1)
        ref = paged_mqa_logits_ref(step.q, step.kv_cache, step.weights, ctx, rows.block_table,
                                   step.max_context_len, indices=rows.indices)
        mask = valid_mask(ctx, step.max_context_len, rows.indices)
        hint = int(step.decode_lens.max())
        for params in triton_variants(args.sets) or [{}]:
            kw = {"rows_max": gk.rows_max_for(heads, hint), **params}
            out = torch.empty(rows.num_rows, step.max_context_len, device="cuda")
            runs = []
            for _ in range(args.repeats):
                out.fill_(float("nan"))
                gk.launch(step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
                          step.max_context_len, out, **kw)
                runs.append(out[mask].clone())
            torch.cuda.synchronize()
            first = runs[0]
            bad = [i for i, r in enumerate(runs) if not torch.equal(r, first)]
            errs = [float((r - ref[mask]).norm() / ref[mask].norm()) for r in runs]
            unwritten = sum(int(torch.isnan(r).sum()) for r in runs)
            where = ""
            if bad:
                diff = (runs[bad[0]] != first)
                full = torch.zeros_like(mask)
                full[mask] = diff
                r_idx, c_idx = torch.nonzero(full, as_tuple=True)
                where = (f" first differing run {bad[0]}: {int(diff.sum())} elements, rows "
                         f"{sorted(set(r_idx.tolist()))[:8]}, cols {int(c_idx.min())}..{int(c_idx.max())}"
                         f" (pages {int(c_idx.min()) // 64}..{int(c_idx.max()) // 64})")
            print(f"{name:10s} {str(params):40s} runs {len(runs)} differing {len(bad)} "
                  f"unwritten {unwritten} rel_err max {max(errs):.1e}{where}", flush=True)


if __name__ == "__main__":
    main()

"""Spike on the H200: correctness + timing of the sm_90 Gluon kernel's variants
against the portable kernel (this process) and vLLM 0.33's DeepGEMM 2.8.1
(``--peer vdg``, a process of its own).  Prints one JSON line per timing."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, valid_mask  # noqa: E402
from vllm_dsa_varlen.workloads import make_decode_step, random_decode_step  # noqa: E402

CASES = [
    ("B64 L32K 4tok", 64, 32768, 4, False),
    ("B64 L8K 4tok", 64, 8192, 4, False),
    ("B128 L8K 4tok", 128, 8192, 4, False),
    ("B256 L8K 4tok", 256, 8192, 4, False),
    ("B8 L128K 4tok", 8, 131072, 4, False),
    ("B16 L16K 4tok", 16, 16384, 4, False),
    ("B1 L8K 4tok", 1, 8192, 4, False),
    ("B64 L32K 2tok", 64, 32768, 2, False),
    ("B256 L4K 2tok", 256, 4096, 2, False),
    ("B64 L32K 3tok", 64, 32768, 3, False),
    ("B64 L32K 1..4", 64, 32768, 4, True),
    ("B64 L8K 6tok", 64, 8192, 6, False),
    ("B64 L8K 8tok", 64, 8192, 8, False),
]


def timed(fn, rep=100):
    fn()
    torch.cuda.synchronize()
    eager = do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    graph = do_bench(g.replay, warmup=10, rep=rep, return_mode="median") * 1e3
    return graph, eager


def step_of(case, seed=0):
    name, b, ctx, tok, var = case
    return random_decode_step(b, tok, ctx, variable=var, seed=seed, device="cuda")


def ours(args):
    from vllm_dsa_varlen.ops import gluon_paged_mqa_logits as gk
    from vllm_dsa_varlen.ops.triton_paged_mqa_logits import varlen_paged_mqa_logits

    def gl_fn(step, out, **kw):
        rows = step.rows
        return lambda: gk.launch(step.q, step.kv_cache, step.weights, rows.context_lens,
                                 rows.block_table, rows.indices, step.max_context_len, out, **kw)

    # ---- correctness
    checks = [
        ([1, 2, 3, 4, 5, 6, 7, 8], [65, 130, 3, 64, 200, 129, 70, 191], 0, 32),
        ([1, 2, 3, 4, 5, 6, 7, 8], [65, 130, 3, 64, 200, 129, 70, 191], 0, 64),
        ([1] * 6, [1, 63, 64, 65, 127, 250], 0, 64),
        ([2, 2, 2, 2], [90, 0, 150, 0], 3, 64),
        ([4] * 40, [3000 + 17 * i for i in range(40)], 0, 64),
        ([3, 1, 2, 4] * 30, [5000 + 31 * i for i in range(120)], 5, 32),
        ([9, 12], [700, 3000], 0, 64),
    ]
    fails = 0
    for rm in (2, 4, 8):
        for i, (lens, seqs, pad, heads) in enumerate(checks):
            if rm < 128 // heads or args.mode == "time":
                continue
            if args.only is not None and (i, rm) != tuple(args.only):
                continue
            step = make_decode_step(lens, seqs, heads=heads, padding_rows=pad,
                                    max_context_len=max(seqs) + 11, seed=i, device="cuda")
            rows = step.rows
            ctx = rows.context_lens.view(-1, 1)
            out = torch.full((rows.num_rows + 3, step.max_context_len + 40), float("nan"),
                             device="cuda")
            try:
                gl_fn(step, out[: rows.num_rows], rows_max=rm)()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                print(f"check {i} rm={rm}: launch failed {type(exc).__name__}: {str(exc)[:2000]}")
                fails += 1
                continue
            ref = paged_mqa_logits_ref(step.q, step.kv_cache, step.weights, ctx, rows.block_table,
                                       step.max_context_len, indices=rows.indices)
            mask = valid_mask(ctx, step.max_context_len, rows.indices)
            got = out[: rows.num_rows, : step.max_context_len]
            ok_written = bool(torch.isfinite(got[mask]).all())
            ok_clean = bool(torch.isnan(got[~mask]).all()) and bool(
                torch.isnan(out[rows.num_rows:]).all()) and bool(
                torch.isnan(out[:, step.max_context_len:]).all())
            err = float((got[mask] - ref[mask]).norm() / ref[mask].norm().clamp_min(1e-30)) \
                if mask.any() else 0.0
            first = got.clone()
            same = True
            for _ in range(3):
                gl_fn(step, out[: rows.num_rows], rows_max=rm)()
                same &= bool(torch.equal(torch.nan_to_num(first), torch.nan_to_num(
                    out[: rows.num_rows, : step.max_context_len])))
            good = ok_written and ok_clean and err < 1e-3 and same
            fails += not good
            print(f"check {i} rm={rm} H{heads}: written={ok_written} clean={ok_clean} "
                  f"err={err:.2e} deterministic={same} {'OK' if good else 'FAIL'}", flush=True)
    print(f"correctness failures: {fails}", flush=True)

    # ---- timing
    if args.mode == "check":
        return
    variants = [dict(stages=6), dict(stages=6, direct_store=True), dict(stages=4),
                dict(stages=8)]
    for case in CASES:
        step = step_of(case)
        rows = step.rows
        tok = case[3]
        out = torch.empty((rows.num_rows, step.max_context_len + 128), device="cuda")
        rm = 2 if tok <= 2 else 4 if tok <= 4 else 8
        for v in variants:
            v = dict(v, rows_max=rm)
            if rm == 8 and v.get("stages", 6) > 6 or args.variant is not None and v != dict(
                    variants[args.variant], rows_max=rm):
                continue
            try:
                g, e = timed(gl_fn(step, out, **v))
                print(json.dumps(dict(case=case[0], path="gluon " + ",".join(
                    f"{k}={x}" for k, x in v.items()), graph_us=g, eager_us=e)), flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"{case[0]} {v}: failed {type(exc).__name__}: {str(exc)[:500]}", flush=True)
        ctx = rows.context_lens.view(-1, 1)
        g, e = timed(lambda: varlen_paged_mqa_logits(
            step.q, step.kv_cache, step.weights, ctx, rows.block_table, rows.indices,
            step.max_context_len, max_run_len=tok))
        print(json.dumps(dict(case=case[0], path="triton-portable", graph_us=g, eager_us=e)),
              flush=True)
        del step, out
        torch.cuda.empty_cache()


def peer_vdg(args):
    import vllm_deep_gemm as dg
    sms = dg.get_num_sms()
    for case in CASES:
        step = step_of(case)
        rows = step.rows
        tok = case[3]
        ctx2d = rows.context_lens.view(-1, 1).contiguous()
        meta = dg.get_paged_mqa_logits_metadata(ctx2d, 64, sms)
        g, e = timed(lambda: dg.fp8_fp4_paged_mqa_logits(
            (step.q, None), step.kv_cache, step.weights, ctx2d, rows.block_table, meta,
            step.max_context_len))
        print(json.dumps(dict(case=case[0], path="vdg281-flat", graph_us=g, eager_us=e)), flush=True)
        if tok in (1, 2, 4) or case[4]:
            n = 4 if case[4] else tok
            pad = step.padded(n)
            meta_n = dg.get_paged_mqa_logits_metadata(pad["context_lens"], 64,
                                                      sms // 2 if n == 4 else sms)
            g, e = timed(lambda: dg.fp8_fp4_paged_mqa_logits(
                (pad["q"], None), step.kv_cache, pad["weights"], pad["context_lens"],
                step.block_table, meta_n, step.max_context_len))
            print(json.dumps(dict(case=case[0], path=f"vdg281-native{n}", graph_us=g, eager_us=e)),
                  flush=True)
        del step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--peer", default=None)
    p.add_argument("--mode", default="both", choices=["both", "check", "time"])
    p.add_argument("--only", type=int, nargs=2, default=None)
    p.add_argument("--variant", type=int, default=None)
    a = p.parse_args()
    t0 = time.time()
    (peer_vdg if a.peer == "vdg" else ours)(a)
    print(f"elapsed {time.time() - t0:.1f}s")

"""The step's query preparation: the project's kernels beside vLLM's own, one
process, rounds interleaved, CUDA-graph replay.

``--kernel fused_q`` (default): ops.triton_fused_q beside vLLM 0.33's
``fused_q`` (its Triton kernel on Hopper).  Each case is a step's shapes
(tokens, MLA heads, indexer heads 64, RoPE 64, NoPE 512, the layer's strided
views: tests/query_checks.fused_q_inputs) and a query path (``bf16``:
FlashMLA's bf16 query, what vLLM 0.33's engine took on the H200; ``fp8``: the
fp8 query).  ``--blocks`` are ``index/pe/nope/warps[/pdl]``.

``--kernel indexer_q``: ops.triton_indexer_q beside vLLM's
``fused_indexer_q_rope_quant`` (vLLM 0.27's indexer query; the same kernel
in vLLM 0.33.0's ``sparse_attn_indexer``, so either install serves).  Each
case is tokens and indexer heads (``--heads``; 64 for DeepSeek-V3.2, 32 for
GLM-5), a NeoX RoPE with a float32 table (tests/query_checks.indexer_q_inputs);
``--blocks`` are ``heads/warps``.

A timed call is one graph replay of ``--copies`` calls back to back (as 61
layers call it, with other kernels between), its time divided by the copies;
before any timing every implementation's bytes are compared with vLLM's
(``bit_equal``; per output, the count of bytes that differ:
``bytes_differing``).  The floor: bytes moved / the copy rate (printed).

    python3 benchmarks/fused_q_bench.py --out fused-q.json
    python3 benchmarks/fused_q_bench.py --kernel indexer_q --out indexer-q.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from query_checks import (fused_q_args, fused_q_inputs, indexer_q_args,  # noqa: E402
                          indexer_q_inputs)

from vllm_dsa_varlen.bench.graph import capture_graph, round_order  # noqa: E402
from vllm_dsa_varlen.ops import triton_fused_q as fq  # noqa: E402
from vllm_dsa_varlen.ops import triton_indexer_q as iq  # noqa: E402

OUTPUTS = {"fused_q": ("index_q_fp8", "index_weights_out", "mqa_q"),
           "indexer_q": ("q_fp8", "weights_out")}
DEFAULT_BLOCKS = {"fused_q": ["4/8/2/1", "4/16/2/2", "8/8/1/1", "2/8/1/1", "1/8/1/1"],
                  "indexer_q": ["4/1", "8/1", "16/2", "2/1", "1/1"]}
COPY_RATE = 4.25e12  # B/s, the H200's measured copy rate


def fused_q_bytes(inp, quantize_mqa: bool) -> int:
    t, h, r = inp["q_pe"].shape
    hi, di = inp["index_q"].shape[1:]
    n = inp["ql_nope"].shape[2]
    b = t * hi * di * (2 + 1) + t * hi * (2 + 4) + t * h * r * 2 * 2
    if quantize_mqa:
        b += t * h * n * (2 + 1) - t * h * r * 2 + t * h * r
    return b


def indexer_q_bytes(inp) -> int:
    t, h, d = inp["q"].shape
    return t * h * d * (2 + 1) + t * h * (2 + 4)


def parse_blocks(text: str, pdl: bool) -> tuple[fq.Blocks, bool]:
    """``index/pe/nope/warps[/pdl]`` -> the blocks and whether to launch as a
    programmatic dependent (the fifth field, 0 or 1, overrides ``--pdl``)."""
    fields = [int(x) for x in text.split("/")]
    if len(fields) not in (4, 5):
        raise SystemExit(f"--blocks: expected index/pe/nope/warps[/pdl], got {text!r}")
    return fq.Blocks(*fields[:4]), bool(fields[4]) if len(fields) == 5 else pdl


def parse_indexer_blocks(text: str) -> tuple[int, int]:
    """``heads/warps`` -> the two powers of two."""
    fields = [int(x) for x in text.split("/")]
    if len(fields) != 2:
        raise SystemExit(f"--blocks: expected heads/warps, got {text!r}")
    return fields[0], fields[1]


def fused_q_cases(args, dev):
    """(label, {name: call}, bytes moved) for each fused_q case."""
    from vllm.models.deepseek_v32.common import kernels  # vLLM 0.33's fused_q

    for path in args.paths:
        qm = path == "fp8"
        for heads in args.heads:
            for tokens in args.tokens:
                inp = fused_q_inputs(tokens, heads, 64, device=dev, seed=tokens + heads)
                pos = fused_q_args(inp)
                impls = {"vllm": lambda pos=pos, qm=qm: kernels.fused_q(
                    *pos, has_indexer=True, index_rope_interleave=False, quantize_mqa=qm)}
                for b in args.blocks:
                    blk, pdl = parse_blocks(b, args.pdl)
                    impls[f"ours {b}"] = (lambda inp=inp, qm=qm, blk=blk, pdl=pdl: fq.fused_q(
                        **inp, quantize_mqa=qm, use_pdl=pdl, blocks=blk))
                yield {"path": path, "heads": heads, "tokens": tokens}, impls, \
                    fused_q_bytes(inp, qm)


def indexer_q_cases(args, dev):
    """(label, {name: call}, bytes moved) for each indexer-query case."""
    from vllm.model_executor.layers.sparse_attn_indexer import fused_indexer_q_rope_quant

    for heads in args.heads:
        for tokens in args.tokens:
            inp = indexer_q_inputs(tokens, heads, device=dev, seed=tokens + heads)
            pos = indexer_q_args(inp, True)
            impls = {"vllm": lambda pos=pos: fused_indexer_q_rope_quant(*pos)}
            for b in args.blocks:
                h, w = parse_indexer_blocks(b)
                impls[f"ours {b}"] = lambda pos=pos, h=h, w=w: iq.indexer_q(*pos, heads=h, warps=w)
            yield {"path": "indexer", "heads": heads, "tokens": tokens}, impls, indexer_q_bytes(inp)


def time_case(impls, outputs, args):
    """Bytes against vLLM's, then per implementation the per-call times of
    ``args.rounds`` interleaved rounds (µs)."""
    want = impls["vllm"]()
    equal, differing = {}, {}
    for name, fn in impls.items():
        got = fn()
        differing[name] = {out: int((a.contiguous().view(torch.uint8)
                                     != c.contiguous().view(torch.uint8)).sum())
                           for out, a, c in zip(outputs, got, want)}
        equal[name] = not any(differing[name].values())
    graphs = {name: capture_graph(torch, fn, args.copies) for name, fn in impls.items()}
    times = {name: [] for name in impls}
    for r in range(args.rounds):
        for name in round_order(list(impls), r):
            g = graphs[name]
            g.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.replays):
                g.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / args.replays / args.copies)
    return equal, differing, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=sorted(OUTPUTS), default="fused_q")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4, 16, 64, 256, 1024, 4096])
    ap.add_argument("--heads", type=int, nargs="+", default=None,
                    help="MLA heads (fused_q; default 16 64 128) or indexer heads "
                         "(indexer_q; default 64 32)")
    ap.add_argument("--paths", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"],
                    help="fused_q's query paths")
    ap.add_argument("--blocks", nargs="+", default=None,
                    help="the project's shapes (the first is the default): fused_q "
                         "index/pe/nope/warps[/pdl], indexer_q heads/warps")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--copies", type=int, default=20)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--pdl", action="store_true", help="fused_q: launch both as programmatic dependents")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.heads is None:
        args.heads = [16, 64, 128] if args.kernel == "fused_q" else [64, 32]
    if args.blocks is None:
        args.blocks = DEFAULT_BLOCKS[args.kernel]

    dev = torch.device("cuda")
    cases = fused_q_cases(args, dev) if args.kernel == "fused_q" else indexer_q_cases(args, dev)
    results = []
    for label, impls, moved in cases:
        equal, differing, times = time_case(impls, OUTPUTS[args.kernel], args)
        names = list(impls)
        floor = moved / COPY_RATE * 1e6
        row = {**label, "floor_us": floor, "bit_equal": equal, "bytes_differing": differing,
               "us": {n: statistics.median(v) for n, v in times.items()}, "rounds_us": times,
               "vllm_over": {n: [a / b for a, b in zip(times["vllm"], v)] for n, v in times.items()}}
        results.append(row)
        best = min((n for n in names if n != "vllm"), key=lambda n: row["us"][n])
        ratios = row["vllm_over"][names[1]]
        print(f"{label['path']} H{label['heads']} T{label['tokens']}: vllm {row['us']['vllm']:.2f} us, "
              + ", ".join(f"{n} {row['us'][n]:.2f}" for n in names[1:])
              + f" | vllm/default median {statistics.median(ratios):.2f} "
              f"[{min(ratios):.2f}, {max(ratios):.2f}] best {best} | floor {floor:.2f} us"
              + f" | bit-equal {all(equal.values())}", flush=True)
        for name, diff in differing.items():
            if any(diff.values()):
                print(f"  {name}: bytes differing from vLLM's {diff}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

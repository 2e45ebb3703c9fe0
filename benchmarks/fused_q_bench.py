"""The step's query preparation: the project's kernel (ops.triton_fused_q) beside
vLLM 0.33's own ``fused_q`` (its Triton kernel on Hopper), one process, rounds
interleaved, CUDA-graph replay.

Each case is a step's shapes (tokens, MLA heads, indexer heads 64, RoPE 64,
NoPE 512, the layer's strided views: tests/ops/test_triton_fused_q.make_inputs)
and a query path (``bf16``: FlashMLA's bf16 query, what vLLM 0.33's engine
took on the H200; ``fp8``: the fp8 query).  A timed call is one graph replay
of ``--copies`` calls back to back (as 61 layers call it, with other kernels
between), its time divided by the copies; before any timing every
implementation's bytes are compared with vLLM's (``bit_equal``; per output,
the count of bytes that differ: ``bytes_differing``).  The floor:
bytes moved / the copy rate (printed).

    python3 benchmarks/fused_q_bench.py --out fused-q.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "ops"))
from test_triton_fused_q import as_args, make_inputs  # noqa: E402

from vllm_dsa_varlen.bench_graph import capture_graph, round_order  # noqa: E402
from vllm_dsa_varlen.ops import triton_fused_q as fq  # noqa: E402

OUTPUTS = ("index_q_fp8", "index_weights_out", "mqa_q")
COPY_RATE = 4.25e12  # B/s, the H200's measured copy rate (DEVELOPERS' floor figure)


def moved_bytes(inp, quantize_mqa: bool) -> int:
    t, h, r = inp["q_pe"].shape
    hi, di = inp["index_q"].shape[1:]
    n = inp["ql_nope"].shape[2]
    b = t * hi * di * (2 + 1) + t * hi * (2 + 4) + t * h * r * 2 * 2
    if quantize_mqa:
        b += t * h * n * (2 + 1) - t * h * r * 2 + t * h * r
    return b


def parse_blocks(text: str, pdl: bool) -> tuple[fq.Blocks, bool]:
    """``index/pe/nope/warps[/pdl]`` -> the blocks and whether to launch as a
    programmatic dependent (the fifth field, 0 or 1, overrides ``--pdl``)."""
    fields = [int(x) for x in text.split("/")]
    if len(fields) not in (4, 5):
        raise SystemExit(f"--blocks: expected index/pe/nope/warps[/pdl], got {text!r}")
    return fq.Blocks(*fields[:4]), bool(fields[4]) if len(fields) == 5 else pdl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4, 16, 64, 256, 1024, 4096])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--paths", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--blocks", nargs="+", default=["4/8/2/1", "4/16/2/2", "8/8/1/1", "2/8/1/1", "1/8/1/1"],
                    help="index/pe/nope heads per program / warps (the first is the default)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--copies", type=int, default=20)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--pdl", action="store_true", help="launch both as programmatic dependents")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from vllm.models.deepseek_v32.common import kernels  # vLLM 0.33's fused_q

    dev = torch.device("cuda")
    results = []
    for path in args.paths:
        qm = path == "fp8"
        for heads in args.heads:
            for tokens in args.tokens:
                inp = make_inputs(tokens, heads, 64, device=dev, seed=tokens + heads)
                pos = as_args(inp)
                impls = {"vllm": lambda: kernels.fused_q(*pos, has_indexer=True,
                                                         index_rope_interleave=False,
                                                         quantize_mqa=qm)}
                for b in args.blocks:
                    blk, pdl = parse_blocks(b, args.pdl)
                    impls[f"ours {b}"] = (lambda blk=blk, pdl=pdl: fq.fused_q(
                        **inp, quantize_mqa=qm, use_pdl=pdl, blocks=blk))
                want = impls["vllm"]()
                equal, differing = {}, {}
                for name, fn in impls.items():
                    got = fn()
                    differing[name] = {out: int((a.contiguous().view(torch.uint8)
                                                 != c.contiguous().view(torch.uint8)).sum())
                                       for out, a, c in zip(OUTPUTS, got, want)}
                    equal[name] = not any(differing[name].values())
                graphs = {name: capture_graph(torch, fn, args.copies) for name, fn in impls.items()}
                times = {name: [] for name in impls}
                names = list(impls)
                for r in range(args.rounds):
                    for name in round_order(names, r):
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
                floor = moved_bytes(inp, qm) / COPY_RATE * 1e6
                row = {"path": path, "heads": heads, "tokens": tokens, "floor_us": floor,
                       "bit_equal": equal, "bytes_differing": differing, "us": {n: statistics.median(v) for n, v in times.items()},
                       "rounds_us": times,
                       "vllm_over": {n: [a / b for a, b in zip(times["vllm"], v)] for n, v in times.items()}}
                results.append(row)
                best = min((n for n in names if n != "vllm"), key=lambda n: row["us"][n])
                ratios = row["vllm_over"][names[1]]
                print(f"{path} H{heads} T{tokens}: vllm {row['us']['vllm']:.2f} us, "
                      + ", ".join(f"{n} {row['us'][n]:.2f}" for n in names[1:])
                      + f" | vllm/default median {statistics.median(ratios):.2f} "
                      f"[{min(ratios):.2f}, {max(ratios):.2f}] best {best} | floor {floor:.2f} us"
                      + f" | bit-equal {all(equal.values())}", flush=True)
                for name, diff in differing.items():
                    if any(diff.values()):
                        print(f"  {name}: bytes differing from vLLM's {diff}", flush=True)
                del graphs
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Ablation of the sm_90 kernel: copies of its module with one part of the
work taken out, timed (CUDA-graph replay) beside the real kernel, to see what
sets the time per page.  Not a benchmark: ablated copies compute wrong logits.

    python3 benchmarks/sm90_ablation.py [--cases "64,4,32768" "64,2,32768"]

Copies (:func:`ablated_source`):

* ``real``  — the module as it is;
* ``noepi`` — the epilogue (relu, weights, head sum, scale, store) replaced by
  a store under a branch never taken, so the wgmma and its wait stay;
* ``nomma`` — the wide structure's math partitions only wait for each ring slot
  and release it (no wgmma, no epilogue): the producer / TMA pipeline alone;
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_EPI_START = "    def _epilogue("
_EPI_END = "\n    @gluon.jit\n    def _group("
_NOEPI_BODY = '''
        if row_g < 0:
            offs_t = gl.arange(0, PAGE, layout=gl.SliceLayout(1, acc.type.layout))
            gl.store(out_ptr + offs_t, gl.max(acc, axis=1))
'''
_MMA_START = "            acc = warpgroup_mma(a_tile, b_tile"
_MMA_END = "            # Every read of the slot (wgmma, scale loads) is complete here."
VARIANTS = ("real", "noepi", "nomma")


def ablated_source(name: str, src: str) -> str:
    """The sm_90 module's source ``src`` with the part ``name`` removes taken
    out; raises ``ValueError`` when a marker it cuts at is missing (the kernel
    changed under it)."""
    if name not in VARIANTS:
        raise ValueError(f"name: expected one of {VARIANTS}, got {name!r}")
    for marker in {"noepi": (_EPI_START, _EPI_END), "nomma": (_MMA_START, _MMA_END)}.get(name, ()):
        if src.count(marker) != 1:
            raise ValueError(f"{name}: marker {marker.strip()[:40]!r} found {src.count(marker)} times")
    if name == "noepi":
        i = src.index(_EPI_START)
        doc_end = src.index('"""', src.index('"""', i) + 3) + 3
        src = src[:doc_end] + _NOEPI_BODY + src[src.index(_EPI_END):]
    elif name == "nomma":
        src = src[:src.index(_MMA_START)] + src[src.index(_MMA_END):]
    return src.replace("from .", "from vllm_dsa_varlen.ops.")


def load_variant(name: str):
    """Import the ablated copy ``name`` as a module of its own."""
    from vllm_dsa_varlen.ops import gluon_paged_mqa_logits as gk

    src = ablated_source(name, open(gk.__file__).read())
    path = os.path.join(tempfile.mkdtemp(), f"gk_ablated_{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"gk_ablated_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _graph_us(torch, do_bench, fn, rep_ms):
    from vllm_dsa_varlen.bench import graph_replay_us

    return graph_replay_us(torch, do_bench, fn, rep_ms)


def main(argv=None) -> int:
    import torch
    from triton.testing import do_bench

    from vllm_dsa_varlen.workloads import random_decode_step

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="*", default=["64,4,32768", "64,2,32768"],
                   help="requests,tokens,mean context")
    p.add_argument("--variants", nargs="*", default=None,
                   help="name:wide[:stages], e.g. real:0 noepi:1 nomma:1:12")
    p.add_argument("--rep-ms", type=int, default=40)
    args = p.parse_args(argv)
    mods = {n: load_variant(n) for n in VARIANTS}
    runs = [("real", dict(wide=False)), ("real", dict(wide=True)), ("noepi", dict(wide=False)),
            ("noepi", dict(wide=True)), ("nomma", dict(wide=True))]
    if args.variants:
        runs = []
        for v in args.variants:
            name, wide, *stages = v.split(":")
            runs.append((name, dict(wide=bool(int(wide)), **({"stages": int(stages[0])}
                                                               if stages else {}))))
    for case in args.cases:
        reqs, tokens, ctx = (int(x) for x in case.split(","))
        step = random_decode_step(reqs, tokens, ctx, heads=64, seed=0, device="cuda")
        rows = step.rows
        pages = int(((rows.context_lens.view(-1)[torch.cat([rows.indices[1:] != rows.indices[:-1],
                    torch.ones(1, dtype=torch.bool, device="cuda")])] + 63) // 64).sum())
        out = torch.empty(rows.num_rows, step.max_context_len, device="cuda")
        rows_max = mods["real"].rows_max_for(64, tokens)
        real = mods["real"]
        for wide in (False, True):  # the once-per-step plan on its own
            plan = lambda wide=wide: real.plan(rows.indices, rows.context_lens.view(-1, 1),
                                               step.max_context_len, rows.block_table.shape[1],
                                               64, rows_max, wide=wide)
            print(f"B{reqs} L{ctx} {tokens}tok  plan   {str(dict(wide=wide)):16s} "
                  f"{_graph_us(torch, do_bench, plan, args.rep_ms):8.1f} us", flush=True)
        for name, kw in runs:
            mod = mods[name]
            # planned once per step, as serving does (not timed)
            sched = mod.plan(rows.indices, rows.context_lens.view(-1, 1), step.max_context_len,
                             rows.block_table.shape[1], 64, rows_max, wide=kw.get("wide"))

            def call(mod=mod, kw=kw, sched=sched):
                mod.launch(step.q, step.kv_cache, step.weights, rows.context_lens.view(-1, 1),
                           rows.block_table, rows.indices, step.max_context_len, out,
                           rows_max=rows_max, schedule=sched, **kw)
            us = _graph_us(torch, do_bench, call, args.rep_ms)
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            print(f"B{reqs} L{ctx} {tokens}tok  {name:6s} {str(kw):16s} {us:8.1f} us  "
                  f"{us * 1e-6 / (pages / sms) * 1.7e9:6.0f} cycles per page at 1.7 GHz", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Host cost of the decode metadata plan: the plugin's varlen build() vs stock's flatten path.

Times ``DeepseekV32IndexerMetadataBuilder.build()`` of vLLM 0.27.1 per decode
step on the SAME variable-length decode batches (B in 8, 64, 256 requests,
1..4 tokens each, never all equal):

* ``stock``:   the unpatched 0.27.1 builder on its flatten branch
  (``use_flattening=True``, what stock takes off SM100 for next_n > 2);
* ``varlen``:  the builder with the plugin's patches, Triton backend (the
  plan of :func:`vllm_dsa_varlen.plan.plan_decode_rows` into stock's buffers,
  run ids handed to the metadata and the schedule view);
* ``plan``:    :func:`plan_decode_rows` alone, into preallocated buffers.

Both builders see the same faked sm_90 GPU without DeepGEMM, so neither calls
DeepGEMM's scheduler (on a GPU both would, once per step).  The builders are
real, driven by the stubs of ``tests/vllm_stubs.py``.

CPU TENSORS: everything here runs on the CPU, so the numbers include the CPU
doing the tensor arithmetic a GPU would do asynchronously; they bound the
host cost from above and compare the two paths' Python + dispatch overhead.
Stock's *uniform* flatten path is a Triton kernel that vLLM disables without a
GPU, which is why only variable batches are compared.  One torch thread by
default (``--threads``).

    python benchmarks/plan_host_cost.py [--json out.json] [--seconds 0.4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import pytest  # noqa: E402  (MonkeyPatch drives the stubs, as in the tests)
import torch  # noqa: E402

from tests import vllm_stubs  # noqa: E402  (imports the vLLM modules it fakes)

BATCHES = (8, 64, 256)
MAX_TOKENS = 4
WIDTH = 64        # block-table width: 64 pages of 64 tokens
PAGE = 64


def variable_batch(num_reqs: int, seed: int):
    """Decode lengths 1..4 (never all equal), KV lengths 1000..4000."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        lens = torch.randint(1, MAX_TOKENS + 1, (num_reqs,), generator=gen).tolist()
        if min(lens) != max(lens):
            break
    seqs = torch.randint(1000, 4000, (num_reqs,), generator=gen).tolist()
    bt = vllm_stubs.random_block_table(num_reqs, WIDTH, 4096, seed)
    return lens, seqs, vllm_stubs.decode_batch(lens, seqs, bt)


def time_us(fn, seconds: float, repeats: int = 5) -> dict:
    """Median and min over ``repeats`` of the mean µs per call, each repeat
    running for about ``seconds / repeats``."""
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 0.05:
        fn()
        n += 1
    per = max(1, int(n / 0.05 * seconds / repeats))
    means = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(per):
            fn()
        means.append((time.perf_counter_ns() - t0) / per / 1e3)
    return {"median_us": statistics.median(means), "min_us": min(means), "calls": per * repeats}


_VIEW_OPS = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "alias",
             "as_strided", "expand", "detach", "t", "reshape", "_reshape_alias", "lift_fresh"}


def count_ops(fn) -> int:
    """aten ops one call dispatches, views excluded: on a GPU each one is roughly a
    kernel launch (ops on the CPU copies vLLM keeps, e.g. ``decode_lens_cpu``,
    are counted too, so this is an upper bound)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in _VIEW_OPS:
                _Count.n += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        fn()
    return _Count.n


def make_builders(mp: pytest.MonkeyPatch):
    from vllm_dsa_varlen import config, patches

    mp.delenv(config.MODE_ENV, raising=False)
    mp.setenv(config.BACKEND_ENV, "triton")
    # sm_90, no DeepGEMM: stock flattens for next_n = 4; the plugin picks Triton varlen.
    vllm_stubs.fake_gpu(mp, (9, 0), deepgemm_installed=False)
    kwargs = dict(next_n=MAX_TOKENS, width=WIDTH, block_size=PAGE,
                  max_tokens=max(BATCHES) * MAX_TOKENS, max_seqs=max(BATCHES))
    patches.undo_all()
    stock = vllm_stubs.make_builder(mp, **kwargs)
    patches.apply_all()
    varlen = vllm_stubs.make_builder(mp, **kwargs)
    assert stock.use_flattening and not hasattr(stock, "use_varlen")
    assert varlen.use_varlen and varlen.varlen_backend == "triton", varlen.decode_path
    return stock, varlen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--seconds", type=float, default=0.4, help="timed seconds per cell")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: these tensors are tiny, and "
                         "with more threads a busy core makes OpenMP wait; measured 50x "
                         "slower on a loaded 2-core machine)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from vllm_dsa_varlen import patches
    from vllm_dsa_varlen.plan import DecodeRowBuffers, plan_decode_rows

    results = []
    with pytest.MonkeyPatch.context() as mp:
        try:
            stock, varlen = make_builders(mp)
            bufs = DecodeRowBuffers.allocate(max(BATCHES) * MAX_TOKENS, WIDTH, "cpu")
            for num_reqs in BATCHES:
                lens, seqs, cm = variable_batch(num_reqs, seed=num_reqs)
                rows = sum(lens)
                # Same rows from both builders (the equivalence itself is tested
                # in tests/test_builder_equivalence.py).
                a, b = stock.build(0, cm).decode, varlen.build(0, cm).decode
                assert torch.equal(a.seq_lens, b.seq_lens) and a.seq_lens.shape[0] == rows
                assert torch.equal(a.block_table, b.block_table)
                qsl = cm.query_start_loc
                seq_lens, bt = cm.seq_lens, cm.block_table_tensor
                cells = {
                    "stock": time_us(lambda: stock.build(0, cm), args.seconds),
                    "varlen": time_us(lambda: varlen.build(0, cm), args.seconds),
                    "plan": time_us(lambda: plan_decode_rows(seq_lens, qsl, bt, num_rows=rows,
                                                             num_tokens=rows, out=bufs),
                                    args.seconds),
                }
                for name, fn in (("stock", lambda: stock.build(0, cm)),
                                 ("varlen", lambda: varlen.build(0, cm))):
                    cells[name]["aten_ops"] = count_ops(fn)
                results.append({"num_reqs": num_reqs, "rows": rows, **cells})
        finally:
            patches.undo_all()

    print("Host µs per decode step, vLLM 0.27.1 indexer metadata build() -- CPU TENSORS")
    print("(variable batches, 1..4 tokens/request; stock = unpatched flatten branch,")
    print(" varlen = patched builder, Triton backend; plan = plan_decode_rows alone;")
    print(" stock's uniform path is a Triton kernel vLLM disables without a GPU,")
    print(" so only variable batches are compared; no DeepGEMM scheduler call in either;")
    print(f" torch threads: {torch.get_num_threads()}; median of 5 repeats)")
    print(" ops = aten ops per build() (views excluded), about the kernel launches on a GPU")
    print(f"{'B':>5} {'rows':>5} {'stock µs':>10} {'varlen µs':>10} {'varlen/stock':>13} "
          f"{'plan µs':>9} {'stock ops':>10} {'varlen ops':>11}")
    for r in results:
        s, v, p = r["stock"]["median_us"], r["varlen"]["median_us"], r["plan"]["median_us"]
        print(f"{r['num_reqs']:>5} {r['rows']:>5} {s:>10.1f} {v:>10.1f} {v / s:>13.2f} {p:>9.1f} "
              f"{r['stock']['aten_ops']:>10} {r['varlen']['aten_ops']:>11}")
    if args.json:
        meta = {"what": "host us per decode step of the indexer metadata build(), CPU tensors",
                "vllm": __import__("vllm").__version__, "torch": torch.__version__,
                "threads": torch.get_num_threads(), "cpu": platform.processor() or
                platform.machine(), "python": platform.python_version()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

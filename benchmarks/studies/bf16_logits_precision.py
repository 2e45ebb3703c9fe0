#!/usr/bin/env python3
"""Does storing the indexer logits as bf16 keep each row's top-2048?  A CPU study.

The sm_90 logits kernel could sum over heads in float32 as it does and round
each logit to bf16 at the store (``cvt.rn.bf16.f32``), halving the logits'
write and the top-k's read.  The contract a cheaper arithmetic must meet:
against the float32 logits on the same inputs, every row keeps >= 99.9 % of
its top-2048 set (k = min(2048, the row's length)), and DeepGEMM's own
tolerance check on the logits (``calc_diff`` against its bf16 reference and
its fp8 simulation) passes.

Per row: the float32 logits of the package's torch reference
(:func:`vllm_dsa_varlen.ops.reference.paged_mqa_logits_ref`: float32 head
sum), then a 16-bit key made of them (:data:`KEYS`; ``bf16`` is the proposal,
the others show what an order-preserving 16-bit key could keep), and the
top-k sets of both over the row's valid columns; retention is
``|S_key & S_fp32| / k``.  Every key is a non-decreasing function of the
logit, so no logit outside the float32 set rises above one inside it: what is
lost is lost to ties at the k-th value only, and which of the tied columns a
top-k keeps decides it (:data:`TIE_BREAKS`):

* ``lowest_column``: the lowest columns first, as a threshold / radix top-k
  that takes the tied columns in scan order keeps them;
* ``random``: in a random order, a model of a top-k that places tied columns
  in the order its threads reach an atomic counter;
* ``worst``: against the float32 set (no top-k can lose more);
* ``best``: in favour of the float32 set (by the argument above, always 1).

The float32 set itself takes ties lowest column first.

Inputs are made as serving makes them (:func:`serving_step`): a decode step
from :func:`vllm_dsa_varlen.bench.workloads.random_decode_step` (requests of
``tokens`` MTP rows seeing growing per-token context lengths, pages in random
order, page 64), with its queries, weights and KV replaced by model-like ones:
channels of unequal size (log-normal spread); the query RoPE'd, rounded to
bf16 and quantised to e4m3 per (token, head) with a power-of-two scale, the
weights ``w * q_scale * softmax_scale * heads ** -0.5``, all by
:func:`vllm_dsa_varlen.ops.reference.indexer_q_reference`; the KV quantised
to e4m3 per token with its float32 scale
(:func:`vllm_dsa_varlen.ops.reference.quantize_kv_fp8`).

DeepGEMM's check (:func:`deepgemm_check`) follows its paged MQA logits test
for sm_90 (the ``deepinfer-gemm`` 2.8.2 sdist's ``tests/test_attention.py``):
its generator (bf16 normal q and KV, q cast to e4m3 as is, normal float
weights, ``next_n`` rows of random context lengths, the last the full
length), its reference (unquantised, ``q . k`` in bf16) and its fp8
simulation, ``calc_diff`` over the valid positions, and its tolerances for
the fp8 format with float32 logits (:data:`DEEPGEMM_FP8_TOL`); its sm_100
formats, whose kernels write bf16 logits, have looser ones
(:data:`DEEPGEMM_MX_TOL`), reported beside.

Run (CPU, both cores)::

    python3 benchmarks/studies/bf16_logits_precision.py --out docs/results/bf16-logits-precision
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time

import torch

from vllm_dsa_varlen.ops.reference import round_low_bits

TOPK = 2048
CONTRACT_KEEP = 0.999
KEYS = ("bf16", "fp16_row_scaled", "bf16_minus_kth", "bf16_minus_sibling_kth",
        "bf16_minus_sampled_kth")
# bf16_minus_sampled_kth: the offset is estimated from every SAMPLE_STRIDE-th column
SAMPLE_STRIDE = 16
TIE_BREAKS = ("lowest_column", "random", "worst", "best")
# DeepGEMM's (calc_diff vs its reference, vs its fp8 simulation): fp8 with
# float32 logits (sm_90), and its mxfp4 / mxfp8 formats with bf16 logits (sm_100)
DEEPGEMM_FP8_TOL = (1e-3, 5e-6)
DEEPGEMM_MX_TOL = (0.02, 3e-5)
DEFAULT_ROWS = {4096: 256, 8192: 256, 16384: 512, 32768: 512, 65536: 256}

_BF16_DROP = 16  # bf16 keeps the top 16 bits of the float32 word


# ------------------------------------------------------------------ 16-bit keys

def round_bf16_rn(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest bfloat16, ties to even, as float32 (what PTX
    ``cvt.rn.bf16.f32`` stores): from the bits, not through torch's cast."""
    return round_low_bits(x, _BF16_DROP)


def kth_largest(x: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of ``x [R, N]`` the ``k``-th largest value ``[R]``."""
    return torch.topk(x, k, dim=1).values[:, -1]


def sibling_rows(indices: torch.Tensor) -> torch.Tensor:
    """Per row, another row of the same request (the one before it, else the
    one after; itself for a request of one row): int64 ``[R]``."""
    ids = indices.long()
    r = torch.arange(ids.numel())
    prev = torch.cat([ids[:1] - 1, ids[:-1]])
    nxt = torch.cat([ids[1:], ids[-1:] - 1])
    return torch.where(prev == ids, r - 1, torch.where(nxt == ids, r + 1, r))


def make_key(logits: torch.Tensor, how: str, k: int, siblings: torch.Tensor | None = None
             ) -> torch.Tensor:
    """The 16-bit key ``how`` (:data:`KEYS`) of ``logits [R, N]`` float32
    (``-inf`` off each row's valid columns), as float32 / float16 values in
    float32 (every key keeps ``-inf``):

    * ``bf16``: the logit rounded to bf16 (:func:`round_bf16_rn`);
    * ``fp16_row_scaled``: ``logit * 2**-s`` in fp16, ``s`` a row's power of
      two putting its largest magnitude in ``[2**14, 2**15)`` (any power of
      two keeping the row's values normal in fp16 orders them the same, so a
      bound on the row's magnitude would do);
    * ``bf16_minus_kth``: ``bf16(logit - t)``, ``t`` the row's own float32
      k-th value (an offset no single pass knows: the bound of what offsetting
      can do);
    * ``bf16_minus_sibling_kth``: ``t`` taken from another row of the same
      request (``siblings``, :func:`sibling_rows`), an offset known ahead;
    * ``bf16_minus_sampled_kth``: ``t`` estimated from every
      :data:`SAMPLE_STRIDE`-th column, the ``ceil(k / SAMPLE_STRIDE)``-th
      largest of them (what a pre-pass over that share of the KV could know)."""
    if how == "bf16":
        return round_bf16_rn(logits)
    if how == "fp16_row_scaled":
        finite = torch.where(torch.isfinite(logits), logits.abs(), torch.zeros_like(logits))
        top = finite.amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
        s = torch.floor(torch.log2(top)) - 14
        return (logits * torch.exp2(-s)[:, None]).to(torch.float16).float()
    if how == "bf16_minus_sampled_kth":
        t = kth_largest(logits[:, ::SAMPLE_STRIDE], -(-k // SAMPLE_STRIDE))
        return round_bf16_rn(logits - t[:, None])
    if how in ("bf16_minus_kth", "bf16_minus_sibling_kth"):
        t = kth_largest(logits, k)
        if how == "bf16_minus_sibling_kth":
            if siblings is None:
                raise ValueError("siblings: bf16_minus_sibling_kth needs each row's sibling")
            t = t[siblings]
        return round_bf16_rn(logits - t[:, None])
    raise ValueError(f"how: expected one of {KEYS}, got {how!r}")


# ------------------------------------------------------------------ top-k and retention

def select_lowest_column(x: torch.Tensor, k: int) -> torch.Tensor:
    """Bool ``[R, N]``: each row's top ``k`` of ``x`` with ties at the k-th
    value taken lowest column first (a threshold top-k scanning in order)."""
    t = kth_largest(x, k)[:, None]
    above = x > t
    tied = x == t
    need = k - above.sum(dim=1, keepdim=True)
    return above | (tied & (tied.cumsum(dim=1) <= need))


def select_random(x: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """Bool ``[R, N]``: each row's top ``k`` of ``x`` with the columns tied at
    the k-th value taken in a random order (``gen``)."""
    t = kth_largest(x, k)[:, None]
    above = x > t
    tied = x == t
    need = (k - above.sum(dim=1)).clamp_min(1)
    prio = torch.where(tied, torch.rand(x.shape, generator=gen), torch.full_like(x, 2.0))
    cut = prio.sort(dim=1).values.gather(1, (need - 1)[:, None])
    return above | (tied & (prio <= cut))


def retention(ref_set: torch.Tensor, key: torch.Tensor, k: int,
              gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Per row, the share of ``ref_set`` (bool ``[R, N]``, ``k`` columns a
    row) that the top-``k`` of ``key`` keeps, under each tie-break
    (:data:`TIE_BREAKS`), float64 ``[R]``; and ``tied``: the columns tied at
    the key's k-th value, and ``tied_in_ref``: those of them in ``ref_set``."""
    t = kth_largest(key, k)[:, None]
    above = key > t
    tied = key == t
    need = k - above.sum(dim=1)
    kept_above = (above & ref_set).sum(dim=1)
    tied_in = (tied & ref_set).sum(dim=1)
    tied_out = tied.sum(dim=1) - tied_in
    counts = {
        "lowest_column": (select_lowest_column(key, k) & ref_set).sum(dim=1),
        "random": (select_random(key, k, gen) & ref_set).sum(dim=1),
        "worst": kept_above + (need - tied_out).clamp_min(0),
        "best": kept_above + torch.minimum(need, tied_in),
    }
    out = {rule: c.double() / k for rule, c in counts.items()}
    out["tied"] = tied.sum(dim=1)
    out["tied_in_ref"] = tied_in
    return out


# ------------------------------------------------------------------ inputs

def _cos_sin(positions: torch.Tensor, rope_dim: int, base: float = 10000.0) -> torch.Tensor:
    """``[len(positions), rope_dim]`` rows ``cos | sin`` of each position."""
    inv = base ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    ang = positions.double()[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1).float()


def serving_step(requests: int, context: int, *, tokens: int = 4, heads: int = 64,
                 dim: int = 128, page: int = 64, rope_dim: int = 64,
                 channel_spread: float = 0.5, context_spread: float = 0.1, seed: int = 0):
    """A decode step (:class:`vllm_dsa_varlen.bench.workloads.DecodeStep`) of
    ``requests`` requests of ``tokens`` rows at KV lengths uniform in
    ``context * [1 - context_spread, 1 + context_spread)``, with model-like
    queries, weights and KV (module docstring)."""
    from vllm_dsa_varlen.bench.workloads import random_decode_step
    from vllm_dsa_varlen.ops.reference import indexer_q_reference, quantize_kv_fp8

    if requests < 1 or tokens < 1 or context < TOPK:
        raise ValueError(f"requests, tokens, context: expected >= 1, >= 1, >= {TOPK}, "
                         f"got {requests}, {tokens}, {context}")
    step = random_decode_step(requests, tokens, context, spread=context_spread, seed=seed,
                              heads=heads, dim=dim, page=page)
    gen = torch.Generator().manual_seed(10007 * seed + 1)
    chan = torch.exp(channel_spread * torch.randn(dim, generator=gen))
    blocks = step.kv_cache.shape[0]
    kv_cache = quantize_kv_fp8(torch.randn((blocks, page, dim), generator=gen) * chan)
    rows = step.num_rows
    # the model's projections come out in bf16
    q_raw = (torch.randn((rows, heads, dim), generator=gen) * chan).bfloat16().float()
    w_raw = torch.randn((rows, heads), generator=gen).bfloat16().float()
    positions = step.rows.context_lens.long() - 1
    made = indexer_q_reference(torch.arange(rows), q_raw, _cos_sin(positions, rope_dim), w_raw,
                               dim ** -0.5, heads ** -0.5, is_neox=True)
    return dataclasses.replace(step, q=made["q_fp8"][:, None], weights=made["weights_out"],
                               kv_cache=kv_cache)


def step_logits(step) -> torch.Tensor:
    """The float32 reference logits of ``step``, ``-inf`` off each row's columns."""
    from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref

    rows = step.rows
    return paged_mqa_logits_ref(step.q, step.kv_cache, step.weights,
                                rows.context_lens.view(-1, 1), rows.block_table,
                                step.max_context_len, indices=rows.indices)


def study_step(logits: torch.Tensor, indices: torch.Tensor, keys=KEYS, k: int = TOPK,
               seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Per key (:data:`KEYS`), :func:`retention` of its top-k against the
    float32 set on ``logits [R, N]`` (``-inf`` off each row's columns, every
    row at least ``k`` long)."""
    lens = torch.isfinite(logits).sum(dim=1)
    if int(lens.min()) < k:
        raise ValueError(f"logits: every row needs >= {k} valid columns, got {int(lens.min())}")
    ref_set = select_lowest_column(logits, k)
    siblings = sibling_rows(indices)
    gen = torch.Generator().manual_seed(seed)
    return {how: retention(ref_set, make_key(logits, how, k, siblings), k, gen) for how in keys}


# ------------------------------------------------------------------ DeepGEMM's check

def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity measure ``1 - 2 x.y / (x.x + y.y)`` (float64)."""
    x, y = x.double(), y.double()
    den = (x * x + y * y).sum()
    return 0.0 if float(den) == 0.0 else float(1 - 2 * (x * y).sum() / den)


def _deepgemm_ref(q, k, weights, context_lens, block_table, width):
    """DeepGEMM's paged reference: per sequence ``q . k`` in ``q``'s dtype
    (bf16 products summed and rounded as its matmul does), then float32
    ``relu * w`` summed over heads; 0 off each row's columns."""
    batch, next_n, heads, dim = q.shape
    page = k.shape[1]
    out = torch.zeros((batch * next_n, width))
    for b in range(batch):
        lens = context_lens[b]
        n_pages = -(-int(lens.max()) // page)
        kx = k[block_table[b, :n_pages].long()].reshape(-1, dim)
        s = torch.matmul(q[b].transpose(0, 1), kx.t()).float()  # [heads, next_n, tokens]
        s = (s.relu() * weights[b * next_n:(b + 1) * next_n].t()[..., None]).sum(dim=0)
        cols = torch.arange(s.shape[1])
        s = torch.where(cols[None, :] < lens[:, None], s, torch.zeros_like(s))
        out[b * next_n:(b + 1) * next_n, :s.shape[1]] = s
    return out


def deepgemm_check(sequences: int, avg_kv: int, *, next_n: int = 2, heads: int = 64,
                   dim: int = 128, page: int = 64, seed: int = 0) -> dict:
    """DeepGEMM's sm_90 paged-logits check (module docstring) on the float32
    logits and on them rounded to bf16: ``calc_diff`` of each against its
    reference and its fp8 simulation, and the verdicts under its tolerances."""
    from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, quantize_kv_fp8, split_fused_kv

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((sequences, next_n, heads, dim), generator=gen).bfloat16()
    weights = torch.randn((sequences * next_n, heads), generator=gen)
    ctx = torch.randint(int(0.7 * avg_kv), int(1.3 * avg_kv), (sequences,), generator=gen)
    ctx_n = ((ctx[:, None] + 1) * torch.rand((sequences, next_n), generator=gen)).int()
    ctx_n[:, -1] = ctx
    n_pages = -(-ctx // page)
    width = int(n_pages.max()) * page
    pool = int(n_pages.sum())
    kv = torch.randn((pool, page, dim), generator=gen).bfloat16()
    table = torch.zeros((sequences, int(n_pages.max())), dtype=torch.int32)
    perm = torch.randperm(pool, generator=gen).int()
    off = 0
    for b, n in enumerate(n_pages.tolist()):
        table[b, :n] = perm[off:off + n]
        off += n
    ref = _deepgemm_ref(q, kv, weights, ctx_n, table, width)
    fused = quantize_kv_fp8(kv.float())
    values, scales = split_fused_kv(fused)
    q8 = q.to(torch.float8_e4m3fn)
    simulated = _deepgemm_ref(q8.bfloat16(), (values.float() * scales[..., None]).bfloat16(),
                              weights, ctx_n, table, width)
    fp32 = paged_mqa_logits_ref(q8, fused.view(pool, page, 1, dim + 4), weights, ctx_n, table,
                                width)
    valid = torch.isfinite(fp32)
    fp32 = torch.where(valid, fp32, torch.zeros_like(fp32))
    out = {"sequences": sequences, "next_n": next_n, "avg_kv": avg_kv, "heads": heads}
    for name, got in (("fp32", fp32), ("bf16", round_bf16_rn(fp32))):
        d_ref, d_sim = calc_diff(got, ref), calc_diff(got, simulated)
        out[name] = {"vs_reference": d_ref, "vs_simulation": d_sim,
                     "pass_fp8_tol": d_ref < DEEPGEMM_FP8_TOL[0] and d_sim < DEEPGEMM_FP8_TOL[1],
                     "pass_mx_tol": d_ref < DEEPGEMM_MX_TOL[0] and d_sim < DEEPGEMM_MX_TOL[1]}
    return out


# ------------------------------------------------------------------ the study

def summarise(keeps: torch.Tensor, k: int = TOPK) -> dict:
    """Figures of per-row retentions ``keeps`` (float64 ``[R]``)."""
    misses = ((1 - keeps) * k).round().long()
    return {"min": float(keeps.min()), "mean": float(keeps.mean()),
            "rows_below": int((keeps < CONTRACT_KEEP).sum()),
            "max_misses": int(misses.max()),
            "rows_by_misses": {"0": int((misses == 0).sum()), "1": int((misses == 1).sum()),
                               "2": int((misses == 2).sum()), ">=3": int((misses >= 3).sum())}}


def run_context(context: int, rows: int, *, tokens: int, requests_per_step: int,
                channel_spread: float, context_spread: float, seed: int) -> dict:
    """The study at one context: ``rows`` rows (whole requests of ``tokens``)
    over steps of ``requests_per_step`` requests."""
    requests = -(-rows // tokens)
    merged: dict[str, dict[str, list]] = {how: {} for how in KEYS}
    lens, ratio = [], []
    done, s = 0, 0
    while done < requests:
        n = min(requests_per_step, requests - done)
        step = serving_step(n, context, tokens=tokens, channel_spread=channel_spread,
                            context_spread=context_spread, seed=seed + 1000 * context + s)
        logits = step_logits(step)
        valid = torch.isfinite(logits)
        lens.append(valid.sum(dim=1))
        # the k-th value over the row's spread: ties at it grow with this ratio
        vals = torch.where(valid, logits, torch.zeros_like(logits))
        cnt = valid.sum(dim=1)
        mean = vals.sum(dim=1) / cnt
        std = ((torch.where(valid, logits - mean[:, None], torch.zeros_like(logits)) ** 2)
               .sum(dim=1) / cnt).sqrt()
        ratio.append(kth_largest(logits, TOPK).abs() / std)
        for how, res in study_step(logits, step.rows.indices, seed=seed + s).items():
            for name, v in res.items():
                merged[how].setdefault(name, []).append(v)
        done += n
        s += 1
        del step, logits, vals
    lens = torch.cat(lens)
    ratio = torch.cat(ratio)
    out = {"context": context, "rows": int(lens.numel()), "requests": requests,
           "row_lengths": [int(lens.min()), int(lens.max())],
           "kth_over_std_median": float(ratio.median()), "keys": {}}
    for how in KEYS:
        cat = {name: torch.cat(v) for name, v in merged[how].items()}
        out["keys"][how] = {rule: summarise(cat[rule]) for rule in TIE_BREAKS}
        out["keys"][how]["tied_at_kth"] = {"mean": float(cat["tied"].double().mean()),
                                           "max": int(cat["tied"].max()),
                                           "mean_in_fp32_set": float(cat["tied_in_ref"]
                                                                     .double().mean())}
    return out


def _fmt_context(res: dict) -> list[str]:
    lines = [f"L {res['context']:6d}: {res['rows']} rows ({res['requests']} requests), lengths "
             f"{res['row_lengths'][0]}..{res['row_lengths'][1]}, |k-th| / std median "
             f"{res['kth_over_std_median']:.2f}",
             f"  {'key':24s} {'tie-break':14s} {'min keep':>9s} {'mean keep':>9s} "
             f"{'<99.9%':>6s} {'max lost':>8s}  rows lost 0/1/2/>=3   tied at k-th (mean, max)"]
    for how, figs in res["keys"].items():
        tie = figs["tied_at_kth"]
        for rule in TIE_BREAKS:
            f = figs[rule]
            h = f["rows_by_misses"]
            lines.append(f"  {how:24s} {rule:14s} {f['min']:9.4%} {f['mean']:9.4%} "
                         f"{f['rows_below']:6d} {f['max_misses']:8d}  "
                         f"{h['0']}/{h['1']}/{h['2']}/{h['>=3']}"
                         + (f"   {tie['mean']:.1f}, {tie['max']}" if rule == "lowest_column"
                            else ""))
    return lines


def _fmt_deepgemm(res: dict) -> list[str]:
    lines = []
    for name in ("fp32", "bf16"):
        r = res[name]
        lines.append(f"  L {res['avg_kv']:6d} x {res['sequences']:3d} seqs, next_n {res['next_n']}, "
                     f"{name} logits: vs reference {r['vs_reference']:.3e}, vs simulation "
                     f"{r['vs_simulation']:.3e}  fp8 tol {'pass' if r['pass_fp8_tol'] else 'FAIL'}"
                     f", sm_100 bf16-logits tol {'pass' if r['pass_mx_tol'] else 'FAIL'}")
    return lines


def _parse_pairs(items: list[str], name: str) -> dict[int, int]:
    """``["A:B", ...]`` -> ``{A: B}``, each A >= TOPK and B >= 1."""
    out = {}
    for item in items:
        try:
            a, b = (int(v) for v in item.split(":"))
        except ValueError:
            raise ValueError(f"{name}: expected LENGTH:COUNT, got {item!r}") from None
        if a < TOPK or b < 1:
            raise ValueError(f"{name}: expected a length >= {TOPK} and a count >= 1, "
                             f"got {item!r}")
        out[a] = b
    return out


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", default=[f"{c}:{n}" for c, n in DEFAULT_ROWS.items()],
                   help="CONTEXT:ROWS per context")
    p.add_argument("--tokens", type=int, default=4, help="rows per request (MTP)")
    p.add_argument("--requests-per-step", type=int, default=None,
                   help="requests generated at once (default: about 2**20 KV tokens a step)")
    p.add_argument("--channel-spread", type=float, default=0.5)
    p.add_argument("--context-spread", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deepgemm", nargs="*", default=["8192:64", "65536:8"],
                   help="AVG_KV:SEQUENCES cases of DeepGEMM's check")
    p.add_argument("--out", default=None, help="folder for study.json and study.log")
    args = p.parse_args(argv)
    rows = _parse_pairs(args.rows, "--rows")
    if args.tokens < 1:
        raise ValueError(f"--tokens: expected >= 1, got {args.tokens}")
    dg_cases = _parse_pairs(args.deepgemm, "--deepgemm")
    torch.set_grad_enabled(False)
    lines: list[str] = []

    def log(line: str = "") -> None:
        lines.append(line)
        print(line, flush=True)

    command = "python3 benchmarks/studies/bf16_logits_precision.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    start = time.time()
    meta = {"command": command, "commit": _commit(), "torch": torch.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(),
            "topk": TOPK, "contract_keep": CONTRACT_KEEP, "tokens": args.tokens,
            "channel_spread": args.channel_spread, "context_spread": args.context_spread,
            "seed": args.seed, "heads": 64, "dim": 128, "page": 64}
    log(f"# {command}   (CPU, commit {meta['commit']}, torch {meta['torch']})")
    log(f"top-{TOPK} retention per row, 16-bit keys of the float32 logits against the float32 "
        f"set; {args.tokens} rows a request, channel spread {args.channel_spread}, KV lengths "
        f"L x [1 -+ {args.context_spread}]; contract: every row >= {CONTRACT_KEEP:.1%}")
    contexts = []
    for ctx, n in sorted(rows.items()):
        per_step = args.requests_per_step or max(1, (1 << 20) // ctx)
        res = run_context(ctx, n, tokens=args.tokens, requests_per_step=per_step,
                          channel_spread=args.channel_spread,
                          context_spread=args.context_spread, seed=args.seed)
        contexts.append(res)
        for line in _fmt_context(res):
            log(line)
        log(f"  ({time.time() - start:.0f} s so far)")
    log("DeepGEMM's sm_90 paged-logits check (its generator, H 64, D 128, page 64; tolerances "
        f"fp8 / float32 logits {DEEPGEMM_FP8_TOL}, its sm_100 bf16-logits formats "
        f"{DEEPGEMM_MX_TOL}; calc_diff vs reference, vs fp8 simulation):")
    checks = []
    for avg_kv, seqs in sorted(dg_cases.items()):
        res = deepgemm_check(seqs, avg_kv, seed=args.seed)
        checks.append(res)
        for line in _fmt_deepgemm(res):
            log(line)
    meta["seconds"] = round(time.time() - start)
    log(f"({meta['seconds']} s)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "study.json"), "w") as f:
            json.dump({"meta": meta, "contexts": contexts, "deepgemm": checks}, f, indent=1,
                      allow_nan=False)
            f.write("\n")
        with open(os.path.join(args.out, "study.log"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode steps generated the way serving produces them, for tests and benchmarks.

A step has ``B`` requests with ``n_b`` query tokens each (MTP accepted lengths)
and KV lengths ``seq_lens[b]`` (including the new tokens); pages are scattered
over a shared pool by a random permutation (non-monotonic block tables).  The
varlen rows come from :func:`vllm_dsa_varlen.plan.plan_decode_rows`, the same
function the vLLM builder calls.  Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.reference import quantize_kv_fp8
from ..plan import DecodeRows, plan_decode_rows


@dataclass
class DecodeStep:
    """One decode step in both layouts.

    Varlen: ``q [R, 1, H, D]`` fp8, ``weights [R, H]`` fp32, ``rows`` (ids,
    per-row context lengths, per-row block-table rows).
    Request level: ``seq_lens [B]``, ``decode_lens [B]``, ``query_start_loc
    [B + 1]``, ``block_table [B, W]``.  ``kv_cache`` is the fused fp8 pool.
    """

    q: torch.Tensor
    weights: torch.Tensor
    kv_cache: torch.Tensor
    seq_lens: torch.Tensor
    decode_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_table: torch.Tensor
    rows: DecodeRows
    max_context_len: int
    compress_ratio: int = 1

    @property
    def num_rows(self) -> int:
        return self.rows.num_rows

    def padded(self, next_n: int) -> dict:
        """The same step padded to ``next_n`` rows per request (the layout of
        DeepGEMM's native ``[B, next_n]`` path and of stock vLLM's padded path).

        Padded rows repeat the request's first row's context length and carry
        zero queries; ``row_of`` maps each varlen row to its padded row.
        Tokens are right-aligned: a request with ``n`` tokens fills the last
        ``n`` of its ``next_n`` slots, so the last slot sees the full length.
        """
        num_reqs = self.seq_lens.shape[0]
        device = self.q.device
        heads, dim = self.q.shape[2], self.q.shape[3]
        lens = self.decode_lens.long()
        if int(lens.max()) > next_n:
            raise ValueError(f"next_n: {next_n} < longest request ({int(lens.max())} tokens)")
        req = self.rows.indices[: int(lens.sum())].long()
        pos = torch.arange(req.numel(), device=device) - self.query_start_loc[req].long()
        slot = next_n - lens[req] + pos
        row_of = req * next_n + slot
        q = torch.zeros((num_reqs * next_n, heads, dim), dtype=torch.float32, device=device)
        q[row_of] = self.q[: req.numel(), 0].float()
        w = torch.zeros((num_reqs * next_n, heads), dtype=torch.float32, device=device)
        w[row_of] = self.weights[: req.numel()]
        offs = torch.arange(next_n, device=device)
        ctx = (self.seq_lens.long()[:, None] - next_n + 1 + offs[None, :]).clamp_min(0)
        ctx = ctx // self.compress_ratio
        return {
            "q": q.to(torch.float8_e4m3fn).view(num_reqs, next_n, heads, dim),
            "weights": w,
            "context_lens": ctx.to(torch.int32).contiguous(),
            "block_table": self.block_table,
            "row_of": row_of,
        }

    def stock_split(self) -> dict | None:
        """The step as stock vLLM 0.33 splits it when its decode path needs a
        uniform query length (``split_decodes_and_prefills(require_uniform=
        True)``): the leading requests whose length equals the first's stay
        decodes; every request from the first mismatch on goes to the prefill
        path, which gathers its KV out of the paged cache into contiguous
        buffers and scores each token against its own request's span.

        ``None`` for a uniform step (nothing is split; 0-token padding
        requests count as uniform, as in stock).  Otherwise:
        ``decode_reqs`` / ``decode_rows`` (the uniform prefix and its rows,
        ``next_n`` tokens each; ``q [decode_reqs, next_n, H, D]``,
        ``weights``, ``context_lens [decode_reqs, next_n]``, ``block_table``);
        the tail (its ``T`` tokens; graph-padding rows are left out):
        ``tail_q [T, H, D]``, ``tail_weights [T, H]``,
        ``value_rows`` / ``scale_words`` (indices of each gathered token's 128
        value bytes in the cache viewed as ``[blocks * page * (D + 4) / D, D]``
        bytes and of its scale in the cache viewed as flat fp32), ``ks`` / ``ke``
        (int32 ``[T]``: each token's span in the gathered buffer) and
        ``max_seqlen_k`` (the longest span, the compressed logits' width)."""
        lens = self.decode_lens.tolist()
        first = lens[0]
        # 0-token (graph-padding) requests never break uniformity, as in stock
        split = next((i for i, n in enumerate(lens) if n not in (first, 0)), None)
        if split is None:
            return None
        qsl = self.query_start_loc.tolist()
        rows0, tokens = qsl[split], qsl[-1]  # rows past ``tokens`` are graph padding
        heads, dim = self.q.shape[2], self.q.shape[3]
        page = self.kv_cache.shape[1]
        if self.kv_cache.shape[-1] != dim + 4 or (page * (dim + 4)) % dim:
            raise ValueError("kv_cache: expected the fused fp8 layout (D values + one fp32 scale "
                             "per token, a page a whole number of D-byte rows)")
        rows_per_page = page * (dim + 4) // dim
        rows = self.rows
        ctx = rows.context_lens.long().clamp_min(0)
        kv_lens = (self.seq_lens.long() // self.compress_ratio).tolist()
        tail_reqs = range(split, len(lens))
        value_rows, scale_words, ks, ke = [], [], [], []
        offset = 0
        bt = self.block_table.long().cpu()
        for r in tail_reqs:
            n_kv = kv_lens[r]
            pos = torch.arange(n_kv)
            blocks = bt[r, pos // page] if n_kv else pos
            value_rows.append(blocks * rows_per_page + pos % page)
            scale_words.append(blocks * (page * (dim + 4) // 4) + page * dim // 4 + pos % page)
            for t in range(qsl[r], qsl[r + 1]):
                ks.append(offset)
                ke.append(offset + min(int(ctx[t]), n_kv))
            offset += n_kv
        device = self.q.device
        return {
            "decode_reqs": split,
            "decode_rows": rows0,
            "next_n": first,
            "q": self.q[:rows0, 0].reshape(split, first, heads, dim),
            "weights": self.weights[:rows0],
            "context_lens": ctx[:rows0].to(torch.int32).reshape(split, first).contiguous(),
            "block_table": self.block_table[:split],
            "tail_q": self.q[rows0:tokens, 0],
            "tail_weights": self.weights[rows0:tokens],
            "value_rows": torch.cat(value_rows).to(device),
            "scale_words": torch.cat(scale_words).to(device),
            "ks": torch.tensor(ks, dtype=torch.int32, device=device),
            "ke": torch.tensor(ke, dtype=torch.int32, device=device),
            "max_seqlen_k": max(kv_lens[r] for r in tail_reqs),
        }


def launcher_args(step: DecodeStep) -> tuple:
    """The public launcher's positional arguments on ``step``: queries, cache,
    weights, per-row context lengths ``[R, 1]``, block table, run ids, the
    longest context."""
    rows = step.rows
    return (step.q, step.kv_cache, step.weights, rows.context_lens.view(-1, 1), rows.block_table,
            rows.indices, step.max_context_len)


def accepted_lengths(num_reqs: int, max_tokens: int, acceptance: float | None,
                     generator: torch.Generator) -> torch.Tensor:
    """Tokens per request: ``max_tokens`` each when ``acceptance`` is None, else
    1 + the number of leading draft tokens accepted, each with probability
    ``acceptance`` (geometric, capped at ``max_tokens``)."""
    if acceptance is None:
        return torch.full((num_reqs,), max_tokens, dtype=torch.int32)
    accept = torch.rand((num_reqs, max_tokens - 1), generator=generator) < acceptance
    leading = accept.int().cumprod(dim=1).sum(dim=1)
    return (1 + leading).to(torch.int32)


def short_lengths(num_reqs: int, max_tokens: int, short: float,
                  generator: torch.Generator) -> torch.Tensor:
    """Tokens per request of a served step whose drafts were cut for a few
    requests (a grammar under synchronous scheduling, a request's last
    tokens): ``max_tokens`` each, but ``round(short * num_reqs)`` requests (at
    least one) drawn at random get ``1..max_tokens - 1``."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens: a step with short requests needs >= 2, got {max_tokens}")
    if not 0.0 < short <= 1.0:
        raise ValueError(f"short: expected a share in (0, 1], got {short!r}")
    lens = torch.full((num_reqs,), max_tokens, dtype=torch.int32)
    count = max(1, round(short * num_reqs))
    picked = torch.randperm(num_reqs, generator=generator)[:count]
    lens[picked] = torch.randint(1, max_tokens, (count,), generator=generator, dtype=torch.int32)
    return lens


PAGE_ORDERS = ("random", "in-order")


def make_decode_step(
    decode_lens: list[int] | torch.Tensor,
    seq_lens: list[int] | torch.Tensor,
    *,
    heads: int = 64,
    dim: int = 128,
    page: int = 64,
    extra_blocks: int = 0,
    device: str | torch.device = "cpu",
    seed: int = 0,
    max_context_len: int | None = None,
    padding_rows: int = 0,
    compress_ratio: int = 1,
    pages: str = "random",
) -> DecodeStep:
    """Build a decode step.

    ``seq_lens[b]`` of 0 makes a graph-padding request (its rows get context
    0).  ``padding_rows`` appends rows past the real tokens (own ids, context
    0), as a graph-padded variable batch has.  ``compress_ratio > 1`` models
    DeepSeek V4's compressed indexer cache: the cache holds ``len //
    compress_ratio`` entries per request and every row's context length is
    divided likewise (as vLLM 0.27.1's builder does after planning).
    ``pages``: where the requests' pages lie in the pool, ``"random"`` (a
    permutation: a long-running engine's cache) or ``"in-order"`` (request by
    request, each one's pages consecutive: a fresh engine's prefill).
    Small tensors are drawn on the CPU, large ones on ``device``."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=dev).manual_seed(seed)
    decode_lens = torch.as_tensor(decode_lens, dtype=torch.int32)
    seq_lens = torch.as_tensor(seq_lens, dtype=torch.int32)
    num_reqs = decode_lens.numel()
    kv_lens = seq_lens // compress_ratio
    pages_per_req = (kv_lens + page - 1) // page
    width = max(1, int(pages_per_req.max()) if num_reqs else 1)
    if max_context_len is None:
        max_context_len = max(1, int(kv_lens.max()) if num_reqs else 1)
    width = max(width, (max_context_len + page - 1) // page)
    total_pages = int(pages_per_req.sum()) + extra_blocks + 1
    if pages not in PAGE_ORDERS:
        raise ValueError(f"pages: expected one of {PAGE_ORDERS}, got {pages!r}")
    perm = torch.randperm(total_pages, generator=gen)  # drawn either way: the same values
    if pages == "in-order":
        perm = torch.arange(total_pages)
    perm = perm.to(torch.int32)
    block_table = torch.zeros((num_reqs, width), dtype=torch.int32)
    offset = 0
    for b, n in enumerate(pages_per_req.tolist()):
        block_table[b, :n] = perm[offset:offset + n]
        offset += n
    k = torch.randn((total_pages, page, dim), generator=dev_gen, device=dev)
    kv_cache = quantize_kv_fp8(k)
    del k
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(decode_lens, 0)
    num_tokens = int(query_start_loc[-1])
    num_rows = num_tokens + padding_rows
    q = torch.randn((num_rows, 1, heads, dim), generator=dev_gen, device=dev).to(torch.float8_e4m3fn)
    weights = torch.randn((num_rows, heads), generator=dev_gen, device=dev) / heads ** 0.5
    seq_lens, decode_lens = seq_lens.to(dev), decode_lens.to(dev)
    query_start_loc, block_table = query_start_loc.to(dev), block_table.to(dev)
    rows = plan_decode_rows(seq_lens, query_start_loc, block_table,
                            num_rows=num_rows, num_tokens=num_tokens)
    if compress_ratio > 1:
        rows.context_lens.div_(compress_ratio, rounding_mode="floor")
    return DecodeStep(q=q, weights=weights, kv_cache=kv_cache, seq_lens=seq_lens,
                      decode_lens=decode_lens, query_start_loc=query_start_loc,
                      block_table=block_table, rows=rows, max_context_len=max_context_len,
                      compress_ratio=compress_ratio)


def _random_lens(num_reqs: int, max_tokens: int, context_len: int, acceptance: float | None,
                 variable: bool, spread: float, seed: int, short: float | None = None):
    """Tokens and KV lengths per request (see :func:`random_decode_step`)."""
    gen = torch.Generator().manual_seed(seed + 7919)
    if short is not None:
        lens = short_lengths(num_reqs, max_tokens, short, gen)
    elif variable:
        lens = torch.randint(1, max_tokens + 1, (num_reqs,), generator=gen, dtype=torch.int32)
    else:
        lens = accepted_lengths(num_reqs, max_tokens, acceptance, gen)
    lo = max(int(lens.max()), int(context_len * (1 - spread)))
    hi = max(lo + 1, int(context_len * (1 + spread)))
    seq_lens = torch.randint(lo, hi, (num_reqs,), generator=gen, dtype=torch.int32)
    return lens, seq_lens


def random_decode_step(num_reqs: int, max_tokens: int, context_len: int, *,
                       acceptance: float | None = None, variable: bool = False,
                       short: float | None = None, spread: float = 0.3, seed: int = 0,
                       **kwargs) -> DecodeStep:
    """A step of ``num_reqs`` requests with KV lengths uniform in
    ``context_len * [1 - spread, 1 + spread]``.  Tokens per request: from
    :func:`short_lengths` when ``short`` is given, uniform in ``1..max_tokens``
    when ``variable``, else from :func:`accepted_lengths` (``max_tokens`` each
    when ``acceptance`` is None)."""
    lens, seq_lens = _random_lens(num_reqs, max_tokens, context_len, acceptance, variable,
                                  spread, seed, short)
    return make_decode_step(lens, seq_lens, seed=seed, **kwargs)


def random_step_rows(num_reqs: int, max_tokens: int, context_len: int, *,
                     variable: bool = False, spread: float = 0.3, seed: int = 0,
                     padding_rows: int = 7, page: int = 64, device="cuda"):
    """The rows of a :func:`random_decode_step` alone (no queries, no KV cache:
    what a schedule needs), planned as the builder plans them, with
    ``padding_rows`` graph-padding rows: ``(rows, seq_lens, decode_lens,
    block-table width)``."""
    lens, seq_lens = _random_lens(num_reqs, max_tokens, context_len, None, variable, spread,
                                  seed)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(lens, 0)
    width = -(-int(seq_lens.max()) // page)
    block_table = torch.zeros((num_reqs, width), dtype=torch.int32, device=device)
    tokens = int(qsl[-1])
    rows = plan_decode_rows(seq_lens.to(device), qsl.to(device), block_table,
                            num_rows=tokens + padding_rows, num_tokens=tokens)
    return rows, seq_lens, lens, width

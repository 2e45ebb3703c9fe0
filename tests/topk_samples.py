"""Logits rows of many value distributions and row lengths at every edge,
for the decode top-k tests (``ops/cuda_topk.py``, ``ops/cuda_select.py``)."""

import torch

KINDS = ("normal", "positive", "ties", "equal", "inf", "narrow", "negative", "block")


def random_logits(kind: str, rows: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """float32 ``[rows, width]`` of one value distribution (CPU)."""
    x = torch.randn(rows, width, generator=gen)
    if kind == "positive":   # relu-weighted head sums: non-negative, few octaves
        return x.abs() * 10
    if kind == "ties":
        return torch.randint(0, 40, (rows, width), generator=gen).float()
    if kind == "equal":
        return torch.ones(rows, width)
    if kind == "inf":
        x[torch.rand(rows, width, generator=gen) < 0.3] = float("-inf")
        x[:, ::997] = float("inf")
        return x
    if kind == "narrow":     # one exponent and the top mantissa bits shared
        return 1000 + x * 1e-4
    if kind == "negative":
        return -x.abs() - 1
    if kind == "block":      # 2048 columns in one top bin (all of it taken at k = 2048)
        return block_logits(rows, width, 2048, gen)
    return x * 3


def block_logits(rows: int, width: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """float32 ``[rows, width]``: normal values but ``count`` random columns
    per row at 100 ± 0.001 (one first-digit bin above all others)."""
    x = torch.randn(rows, width, generator=gen)
    cols = torch.rand(rows, width, generator=gen).argsort(dim=1)[:, :min(count, width)]
    x.scatter_(1, cols, 100 + torch.randn(rows, cols.shape[1], generator=gen) * 1e-3)
    return x


def random_lengths(rows: int, width: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """int32 ``[rows]``: every edge (0, 1, k - 1, k, k + 1, the width) then
    random lengths."""
    edges = [0, 1, k - 1, k, k + 1, width]
    rnd = torch.randint(0, width + 1, (rows,), generator=gen)
    out = [min(max(e, 0), width) for e in edges] + rnd.tolist()
    return torch.tensor(out[:rows], dtype=torch.int32)

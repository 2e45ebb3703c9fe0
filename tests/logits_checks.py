"""Shared checks of a varlen logits call against the torch reference (the
sm_90 kernels' GPU tests): poisoned outputs, every valid position written and
close to the reference, nothing written elsewhere."""

import torch

from vllm_dsa_varlen.ops import launcher
from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, valid_mask
from vllm_dsa_varlen.bench.workloads import launcher_args

POISON = float("nan")


def run_poisoned(step, **kw):
    """The launcher's logits in a poisoned buffer 2 rows and 40 columns larger
    than ``[R, max_context_len]`` (what lies outside must stay poisoned)."""
    rows = step.rows
    out = torch.full((rows.num_rows + 2, step.max_context_len + 40), POISON, device="cuda")
    launcher.varlen_paged_mqa_logits(*launcher_args(step), out=out[: rows.num_rows], **kw)
    return out


def check_poisoned(step, out, rel_tol=1e-3, head_sum="fp32"):
    """Assert ``out`` (from :func:`run_poisoned`) against the reference (its
    ``head_sum`` emulation); returns the valid-position mask."""
    rows = step.rows
    ctx = rows.context_lens.view(-1, 1)
    ref = paged_mqa_logits_ref(step.q, step.kv_cache, step.weights, ctx, rows.block_table,
                               step.max_context_len, indices=rows.indices, head_sum=head_sum)
    mask = valid_mask(ctx, step.max_context_len, rows.indices)
    got = out[: rows.num_rows, : step.max_context_len]
    assert torch.isfinite(got[mask]).all(), "a valid position was not written"
    assert torch.isnan(got[~mask]).all(), "a position past the row's context was written"
    assert torch.isnan(out[:, step.max_context_len:]).all(), "written past max_context_len"
    assert torch.isnan(out[rows.num_rows:]).all(), "rows past R were written"
    if mask.any():
        err = rel_err(got[mask], ref[mask])
        assert err < rel_tol, f"relative error {err:.2e}"
    return mask


def rel_err(got, ref) -> float:
    """Normwise relative error of ``got`` against ``ref``."""
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


class StaticStep:
    """Fixed input buffers for ``steps`` (one capacity for all), as a captured
    CUDA graph reads them: :meth:`load` writes a step's rows into them and
    zeroes the rest; rows past the step's own are padding rows with ids of
    their own."""

    def __init__(self, steps, rows_cap: int, heads: int, max_len: int):
        width = max(s.rows.block_table.shape[1] for s in steps)
        blocks = max(s.kv_cache.shape[0] for s in steps)
        self.rows_cap = rows_cap
        self.q = torch.zeros((rows_cap, 1, heads, 128), dtype=torch.float8_e4m3fn, device="cuda")
        self.w = torch.zeros((rows_cap, heads), device="cuda")
        self.ctx = torch.zeros((rows_cap, 1), dtype=torch.int32, device="cuda")
        self.bt = torch.zeros((rows_cap, width), dtype=torch.int32, device="cuda")
        self.ids = torch.zeros(rows_cap, dtype=torch.int32, device="cuda")
        self.kv = torch.zeros((blocks, *steps[0].kv_cache.shape[1:]), dtype=torch.uint8,
                              device="cuda")
        self.out = torch.empty((rows_cap, max_len), device="cuda")

    def load(self, step) -> None:
        n = step.num_rows
        for t in (self.q, self.w, self.ctx, self.bt):
            t.zero_()
        self.q[:n] = step.q
        self.w[:n] = step.weights
        self.ctx[:n, 0] = step.rows.context_lens
        self.bt[:n, : step.rows.block_table.shape[1]] = step.rows.block_table
        self.ids.copy_(torch.arange(self.rows_cap, device="cuda", dtype=torch.int32) + 10**6)
        self.ids[:n] = step.rows.indices
        self.kv[: step.kv_cache.shape[0]].copy_(step.kv_cache)

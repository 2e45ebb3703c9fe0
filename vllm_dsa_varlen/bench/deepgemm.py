"""DeepGEMM's paths on a decode step, as the benchmarks time them: what
stock vLLM runs on Hopper (flattened rows, the native ``[B, next_n]`` kernel,
vLLM 0.33's split of a variable step, emulated) and, on SM100, DeepGEMM's own
varlen call; :class:`Path`, one timed implementation.  Used by
:mod:`.logits` and :mod:`.builds`."""

from __future__ import annotations

from dataclasses import dataclass, field


def import_deepgemm():
    """DeepGEMM 2.8.x as ``(name, module)``: ``deep_gemm``, else vLLM 0.33's
    vendored ``vllm_deep_gemm``; ``(None, None)`` when neither imports (each
    failure printed)."""
    for name in ("deep_gemm", "vllm_deep_gemm"):
        try:
            mod = __import__(name)
            if hasattr(mod, "get_paged_mqa_logits_metadata"):
                return name, mod
        except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
            print(f"# {name} not importable: {type(exc).__name__}: {exc}", flush=True)
    return None, None


@dataclass
class Path:
    """One timed implementation: ``fn()`` returns logits; rows it computes in
    all and how many are padding; how often each request's KV is read;
    ``row_of`` maps varlen rows to the path's rows (padded layouts)."""

    fn: object
    rows: int
    padded_rows: int
    kv_reads: float
    params: dict = field(default_factory=dict)
    row_of: object = None
    result: object = None  # after fn(): the logits in the varlen layout, when fn's own are not


def deepgemm_paths(torch, step, dg, num_sms):
    """The DeepGEMM paths this GPU runs on ``step``."""
    paths = {}
    rows = step.rows
    major = torch.cuda.get_device_capability()[0]
    ctx2d = rows.context_lens.view(-1, 1).contiguous()
    if major == 10:
        meta = dg.get_paged_mqa_logits_metadata(ctx2d, 64, num_sms, indices=rows.indices)
        paths["deepgemm-varlen"] = Path(lambda: dg.fp8_fp4_paged_mqa_logits(
            (step.q, None), step.kv_cache, step.weights, ctx2d, rows.block_table, meta,
            step.max_context_len, indices=rows.indices), rows.num_rows, 0, 1.0)
        return paths
    meta = dg.get_paged_mqa_logits_metadata(ctx2d, 64, num_sms)
    paths["deepgemm-flat"] = Path(lambda: dg.fp8_fp4_paged_mqa_logits(
        (step.q, None), step.kv_cache, step.weights, ctx2d, rows.block_table, meta,
        step.max_context_len), rows.num_rows, 0, rows.num_rows / step.seq_lens.numel())
    next_n = int(step.decode_lens.max())
    if next_n <= 2:
        pad = step.padded(next_n)
        meta_n = dg.get_paged_mqa_logits_metadata(pad["context_lens"], 64, num_sms)
        total = pad["context_lens"].numel()
        paths["deepgemm-native"] = Path(lambda: dg.fp8_fp4_paged_mqa_logits(
            (pad["q"], None), step.kv_cache, pad["weights"], pad["context_lens"],
            step.block_table, meta_n, step.max_context_len), total, total - rows.num_rows, 1.0,
            row_of=pad["row_of"])
    return paths


def vdg_paths(torch, step, dg, num_sms):
    """vLLM 0.33's DeepGEMM 2.8.1 on ``step``: flattened rows, and its native
    ``[B, next_n]`` kernel for next_n 1, 2 or 4 (variable steps padded to 4;
    next_n = 4 runs as a 2-CTA cluster, metadata sized for half the SMs, as
    vLLM 0.33 does)."""
    rows = step.rows
    ctx2d = rows.context_lens.view(-1, 1).contiguous()
    meta = dg.get_paged_mqa_logits_metadata(ctx2d, 64, num_sms)
    paths = {"vdg281-flat": Path(lambda: dg.fp8_fp4_paged_mqa_logits(
        (step.q, None), step.kv_cache, step.weights, ctx2d, rows.block_table, meta,
        step.max_context_len), rows.num_rows, 0, rows.num_rows / step.seq_lens.numel())}
    longest = int(step.decode_lens.max())
    uniform = int(step.decode_lens.min()) == longest
    next_n = longest if uniform and longest in (1, 2, 4) else 4 if longest <= 4 else None
    if next_n is not None:
        pad = step.padded(next_n)
        meta_n = dg.get_paged_mqa_logits_metadata(pad["context_lens"], 64,
                                                  num_sms // 2 if next_n == 4 else num_sms)
        total = pad["context_lens"].numel()
        paths[f"vdg281-native{next_n}"] = Path(lambda: dg.fp8_fp4_paged_mqa_logits(
            (pad["q"], None), step.kv_cache, pad["weights"], pad["context_lens"],
            step.block_table, meta_n, step.max_context_len), total, total - rows.num_rows, 1.0,
            row_of=pad["row_of"])
    if not uniform and longest <= 4:  # next_n = 4 is native: stock splits such steps
        paths["vdg281-split"] = stock_split_path(torch, step, dg, num_sms)
    return paths


def stock_split_path(torch, step, dg, num_sms):
    """Stock vLLM 0.33's path for a variable step when its decode kernel needs
    uniform lengths (``workloads.DecodeStep.stock_split``): the native kernel
    on the uniform leading requests (``next_n`` 1, 2, 4; a 3-token prefix
    flattened, an approximation: how 0.33 runs it was not traced),
    then the prefill path on the rest — their KV gathered out of the paged
    cache (``torch.index_select`` standing in for vLLM's gather kernel), scored
    by DeepGEMM's non-paged ``fp8_fp4_mqa_logits`` into compressed rows.  The
    top-k that follows in vLLM is timed on no path here."""
    split = step.stock_split()
    rows = step.rows
    n, reqs, r0 = split["next_n"], split["decode_reqs"], split["decode_rows"]
    dim = step.q.shape[-1]
    byte_rows = step.kv_cache.view(torch.uint8).reshape(-1, dim)
    words = step.kv_cache.view(torch.uint8).reshape(-1).view(torch.float32)
    k_buf = torch.empty((split["value_rows"].numel(), dim), dtype=torch.uint8, device="cuda")
    s_buf = torch.empty(split["scale_words"].numel(), dtype=torch.float32, device="cuda")
    native = n in (1, 2, 4)
    if native:
        ctx = split["context_lens"]
        meta = dg.get_paged_mqa_logits_metadata(ctx, 64, num_sms // 2 if n == 4 else num_sms)
        q, w, bt = split["q"], split["weights"], split["block_table"]
    else:  # a 3-token prefix: flattened, one row per token
        ctx = split["context_lens"].reshape(-1, 1).contiguous()
        meta = dg.get_paged_mqa_logits_metadata(ctx, 64, num_sms)
        q = split["q"].reshape(-1, 1, *split["q"].shape[2:])
        w, bt = split["weights"], rows.block_table[:r0]
    out = {}

    def call():
        out["decode"] = dg.fp8_fp4_paged_mqa_logits((q, None), step.kv_cache, w, ctx, bt, meta,
                                                    step.max_context_len)
        torch.index_select(byte_rows, 0, split["value_rows"], out=k_buf)
        torch.index_select(words, 0, split["scale_words"], out=s_buf)
        out["tail"] = dg.fp8_fp4_mqa_logits(
            (split["tail_q"], None), (k_buf.view(torch.float8_e4m3fn), s_buf),
            split["tail_weights"], split["ks"], split["ke"], split["max_seqlen_k"])
        return out["tail"]

    def result():
        logits = torch.full((rows.num_rows, step.max_context_len), float("nan"), device="cuda")
        logits[:r0] = out["decode"].reshape(r0, -1)[:, : step.max_context_len].float()
        width = min(split["max_seqlen_k"], step.max_context_len)
        tail = out["tail"].shape[0]  # graph-padding rows past the tail stay unwritten
        logits[r0:r0 + tail, :width] = out["tail"][:, :width].float()
        return logits

    num_reqs = step.seq_lens.numel()
    # KV reads per request: once (native) or once per token (flattened) on the
    # prefix; on the tail, the gather's read and the scoring's.
    kv_reads = (reqs * (1 if native else n) + 2 * (num_reqs - reqs)) / num_reqs
    return Path(call, rows.num_rows, 0, kv_reads, dict(decode_reqs=reqs, next_n=n),
                result=result)

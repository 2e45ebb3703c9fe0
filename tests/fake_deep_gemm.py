"""A DeepGEMM test double for the indexer functions (CPU, pure torch).

Three API generations, told apart the way the real ones are -- by their
argument names, which the double exposes like pybind does
(``inspect.signature`` fails; the first line of ``__doc__`` is the signature):

* ``"2.6"`` (the default): the DeepGEMM 2.6.1 vLLM 0.27.1 vendors
  (``vllm/third_party/deep_gemm``), with its pybind signatures
  ``get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms,
  indices=None)``, ``fp8_fp4_paged_mqa_logits(q, kv_cache, weights,
  context_lens, block_table, schedule_meta, max_context_len,
  clean_logits=False, logits_dtype=torch.float32, indices=None)`` and
  ``fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end,
  clean_logits=True, max_seqlen_k=0, logits_dtype=torch.float32)``
  (``tests/vllm_0_27/utils/test_deep_gemm_vendored.py`` checks these against
  the shipped ``.so``).  Run ids are accepted on both functions and asserted
  to come with ``arch == 100`` and ``next_n == 1``; the FP8 cache is taken on
  SM100; paged weights are float32; logits come back in ``logits_dtype``
  (float32 or bfloat16).  ``max_seqlen_k > 0`` (row-compressed prefill
  logits) is not modelled and raises.
* ``"old"``: a DeepGEMM without run ids -- ``clean_logits`` keyword, float32
  logits, no ``indices`` unless ``accepts_indices=True`` (the fallback when a
  site-packages DeepGEMM without them shadows the vendored one).
* ``"2.8"``: DeepGEMM 2.8.x -- no ``clean_logits``; ``indices`` accepted;
  on ``arch=100`` run ids are *required*, weights must be bf16 and logits come
  back bf16; on ``arch=90`` ``next_n`` must be 1 or 2 and ids are refused;
  the prefill function takes ``max_seqlen_k`` and writes row-compressed logits.
  ``logits_dtype=True``: the 2.8.1 vLLM 0.34 vendors, whose logits functions
  take ``logits_dtype`` (before ``indices`` / ``schedule_meta``): logits come
  back in it, and on ``arch=100`` the weights must be in it too.

The varlen (``indices``) contract is enforced, every violation raises
``AssertionError`` naming what broke: ``next_n == 1``; ids int32, 1-D,
contiguous, one per row, 8-byte aligned start; ``block_kv`` in {32, 64} (+128
for 2.8); the schedule passed to the kernel must be the one the scheduler
produced for the same context lengths and ids.  Logits of the FP8 cache come
from :func:`vllm_dsa_varlen.ops.reference.paged_mqa_logits_ref` (a request is
a maximal run of equal adjacent ids, its KV length is its last row's context
length, its block-table row is its first row's, each row is masked by its own
context length); positions a kernel leaves unwritten hold ``GARBAGE`` unless
cleaning was asked for.  MXFP4 calls are only recorded (zeros returned).
Every call is recorded in :attr:`FakeDeepGemm.calls`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_dsa_varlen.ops.reference import paged_mqa_logits_ref, valid_mask

GARBAGE = 1.0e30  # what a kernel leaves in positions it does not write


@dataclass
class Call:
    name: str
    args: tuple
    kwargs: dict
    bound: dict = field(default_factory=dict)


class _PybindLike:
    """A callable that binds arguments by name like a pybind function."""

    __signature__ = "pybind11: no Python signature"  # makes inspect.signature raise

    def __init__(self, name: str, params: list[tuple[str, Any]], impl, owner: "FakeDeepGemm"):
        self.__name__ = name
        self._params = params  # (name, default or _REQUIRED)
        self._impl = impl
        self._owner = owner
        args = ", ".join(f"{p}: object" if d is _REQUIRED else f"{p}: object = {d!r}"
                         for p, d in params)
        self.__doc__ = f"{name}({args}) -> torch.Tensor\n\nTest double.\n"

    def __call__(self, *args, **kwargs):
        names = [p for p, _ in self._params]
        if len(args) > len(names):
            raise TypeError(f"{self.__name__}: too many positional arguments")
        bound = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in names:
                raise TypeError(f"{self.__name__}(): incompatible function arguments: "
                                f"unexpected keyword {key!r}")
            if key in bound:
                raise TypeError(f"{self.__name__}: {key!r} given twice")
            bound[key] = value
        for p, default in self._params:
            if p not in bound:
                if default is _REQUIRED:
                    raise TypeError(f"{self.__name__}: missing argument {p!r}")
                bound[p] = default
        self._owner.calls.append(Call(self.__name__, args, dict(kwargs), bound))
        return self._impl(**bound)


_REQUIRED = object()


def schedule_fingerprint(context_lens: torch.Tensor, indices: torch.Tensor | None,
                         num_sms: int) -> torch.Tensor:
    """int32 ``[num_sms + 1, 2]``: row starts per SM and a fingerprint of the
    inputs, so the kernel can tell a schedule made for other inputs."""
    ctx = context_lens.reshape(-1).long().cpu()
    rows = ctx.numel()
    weight = torch.arange(1, rows + 1, dtype=torch.int64)
    fp = int((ctx * weight).sum())
    if indices is not None:
        fp += 7 * int((indices.long().cpu() * (weight + 3)).sum()) + 1
    meta = torch.empty((num_sms + 1, 2), dtype=torch.int32)
    meta[:, 0] = torch.arange(num_sms + 1) * rows // num_sms
    meta[:, 1] = fp % (2 ** 31 - 1)
    return meta.to(context_lens.device)


class FakeDeepGemm:
    """The double.  ``flavour``: ``"2.6"`` | ``"old"`` | ``"2.8"``; ``arch``:
    100 | 90; ``num_sms``: the SM count DeepGEMM would report."""

    FLAVOURS = ("2.6", "old", "2.8")

    def __init__(self, flavour: str = "2.6", arch: int = 100, num_sms: int = 8,
                 accepts_indices: bool | None = None, logits_dtype: bool = False):
        if flavour not in self.FLAVOURS:
            raise ValueError(f"flavour: expected one of {self.FLAVOURS}, got {flavour!r}")
        if arch not in (90, 100):
            raise ValueError(f"arch: expected 90 or 100, got {arch}")
        if logits_dtype and flavour != "2.8":
            raise ValueError("logits_dtype: only the 2.8 flavour has a logits_dtype option")
        self.flavour, self.arch, self.num_sms = flavour, arch, num_sms
        self.takes_logits_dtype = logits_dtype
        self.accepts_indices = flavour != "old" if accepts_indices is None else accepts_indices
        self.calls: list[Call] = []
        opt = [("indices", None)] if self.accepts_indices else []
        self.get_paged_mqa_logits_metadata = _PybindLike(
            "get_paged_mqa_logits_metadata",
            [("context_lens", _REQUIRED), ("block_kv", _REQUIRED), ("num_sms", _REQUIRED)] + opt,
            self._metadata, self)
        paged = [("q", _REQUIRED), ("kv_cache", _REQUIRED), ("weights", _REQUIRED),
                 ("context_lens", _REQUIRED), ("block_table", _REQUIRED),
                 ("schedule_meta", _REQUIRED), ("max_context_len", _REQUIRED)]
        if flavour == "old":
            paged.append(("clean_logits", _REQUIRED))
        elif flavour == "2.6" or logits_dtype:
            paged += ([("clean_logits", False)] if flavour == "2.6" else []) + [
                ("logits_dtype", torch.float32)]
        self.fp8_fp4_paged_mqa_logits = _PybindLike(
            "fp8_fp4_paged_mqa_logits", paged + opt, self._paged, self)
        prefill = [("q", _REQUIRED), ("kv", _REQUIRED), ("weights", _REQUIRED),
                   ("cu_seq_len_k_start", _REQUIRED), ("cu_seq_len_k_end", _REQUIRED)]
        if flavour == "old":
            prefill.append(("clean_logits", _REQUIRED))
        elif flavour == "2.6":
            prefill += [("clean_logits", True), ("max_seqlen_k", 0),
                        ("logits_dtype", torch.float32)]
        else:
            prefill += [("max_seqlen_k", _REQUIRED)] + (
                [("logits_dtype", torch.float32)] if logits_dtype else []) + [
                ("schedule_meta", None)]
        self.fp8_fp4_mqa_logits = _PybindLike("fp8_fp4_mqa_logits", prefill, self._prefill, self)

    # ---------------------------------------------------------------- install
    def install(self, monkeypatch) -> "FakeDeepGemm":
        """Substitute the double for DeepGEMM through vLLM's module globals."""
        import vllm.utils.deep_gemm as vdg

        monkeypatch.setattr(vdg, "_fp8_fp4_paged_mqa_logits_impl", self.fp8_fp4_paged_mqa_logits)
        monkeypatch.setattr(vdg, "_get_paged_mqa_logits_metadata_impl",
                            self.get_paged_mqa_logits_metadata)
        monkeypatch.setattr(vdg, "_fp8_fp4_mqa_logits_impl", self.fp8_fp4_mqa_logits)
        return self

    def calls_to(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]

    # ---------------------------------------------------------------- checks
    @property
    def _block_kvs(self) -> tuple[int, ...]:
        if self.arch == 90:
            return (64,)
        return (32, 64, 128) if self.flavour == "2.8" else (32, 64)

    def _check_indices(self, indices, rows: int, next_n: int) -> None:
        if indices is None:
            assert not (self.flavour == "2.8" and self.arch == 100), \
                "indices: required on SM100 (DeepGEMM 2.8.x)"
            return
        assert self.arch == 100, "indices: varlen is SM100 only"
        assert next_n == 1, f"indices: varlen needs next_n == 1, got {next_n}"
        assert isinstance(indices, torch.Tensor), "indices: not a tensor"
        assert indices.dtype == torch.int32, f"indices: dtype {indices.dtype} != int32"
        assert indices.dim() == 1 and indices.shape[0] == rows, \
            f"indices: shape {tuple(indices.shape)} != [{rows}]"
        assert indices.is_contiguous(), "indices: not contiguous"
        assert indices.data_ptr() % 8 == 0, "indices: start not 8-byte aligned"

    def _check_context_lens(self, context_lens) -> tuple[int, int]:
        assert context_lens.dim() == 2, f"context_lens: 2-D expected, got {context_lens.dim()}-D"
        assert context_lens.dtype == torch.int32, f"context_lens: {context_lens.dtype}"
        assert context_lens.is_contiguous(), "context_lens: not contiguous"
        batch, next_n = context_lens.shape
        if self.arch == 90:
            assert next_n in (1, 2), f"context_lens: next_n {next_n} not in (1, 2) on SM90"
        return batch, next_n

    # ---------------------------------------------------------------- kernels
    def _metadata(self, context_lens, block_kv, num_sms, indices=None):
        batch, next_n = self._check_context_lens(context_lens)
        assert num_sms > 0, "num_sms: must be > 0"
        assert block_kv in self._block_kvs, f"block_kv: {block_kv} not in {self._block_kvs}"
        self._check_indices(indices, batch, next_n)
        return schedule_fingerprint(context_lens, indices, num_sms)

    def _out_dtype(self, logits_dtype: torch.dtype) -> torch.dtype:
        """The logits' dtype: ``logits_dtype`` where the API takes it (2.6,
        2.8 with ``logits_dtype=True``), else bf16 on 2.8 SM100, float32."""
        if self.flavour == "2.6" or self.takes_logits_dtype:
            assert logits_dtype in (torch.float32, torch.bfloat16), \
                f"logits_dtype: {logits_dtype} not float32 / bfloat16"
            return logits_dtype
        return torch.bfloat16 if (self.flavour == "2.8" and self.arch == 100) else torch.float32

    def _weights_dtype(self, logits_dtype: torch.dtype) -> torch.dtype:
        """2.8 on SM100 reduces in the logits' dtype, so its weights come in it."""
        if self.flavour == "2.8" and self.arch == 100:
            return self._out_dtype(logits_dtype)
        return torch.float32

    def _paged(self, q, kv_cache, weights, context_lens, block_table, schedule_meta,
               max_context_len, clean_logits=False, indices=None, logits_dtype=torch.float32):
        values, scales = q
        assert values.dim() == 4, f"q: 4-D [B, next_n, H, D] expected, got {tuple(values.shape)}"
        batch, next_n, heads, _ = values.shape
        rows = batch * next_n
        fp4 = scales is not None
        if not fp4:
            assert values.dtype == torch.float8_e4m3fn, f"q: {values.dtype} (FP8 expected)"
        assert kv_cache.dtype == torch.uint8 and kv_cache.dim() == 4 and kv_cache.shape[2] == 1, \
            f"kv_cache: uint8 [blocks, block_kv, 1, width] expected, got {tuple(kv_cache.shape)}"
        assert kv_cache.shape[1] in self._block_kvs, \
            f"kv_cache: block_kv {kv_cache.shape[1]} not in {self._block_kvs}"
        want_w = self._weights_dtype(logits_dtype)
        assert weights.dtype == want_w, f"weights: {weights.dtype} != {want_w}"
        assert tuple(weights.shape) == (rows, heads), f"weights: shape {tuple(weights.shape)}"
        b2, n2 = self._check_context_lens(context_lens)
        assert (b2, n2) == (batch, next_n), "context_lens: shape does not match q"
        assert block_table.dtype == torch.int32 and block_table.dim() == 2 \
            and block_table.shape[0] == batch and block_table.stride(1) == 1, \
            f"block_table: int32 [{batch}, W] expected, got {tuple(block_table.shape)}"
        assert schedule_meta.dtype == torch.int32 and schedule_meta.is_contiguous() and \
            tuple(schedule_meta.shape) == (self.num_sms + 1, 2), "schedule_meta: bad layout"
        self._check_indices(indices, batch, next_n)
        expect = schedule_fingerprint(context_lens, indices, self.num_sms)
        assert torch.equal(schedule_meta.cpu(), expect.cpu()), \
            "schedule_meta: not the scheduler's output for these context lengths / ids"
        assert isinstance(max_context_len, int) and max_context_len > 0, "max_context_len"
        out_dtype = self._out_dtype(logits_dtype)
        if fp4:
            return torch.zeros((rows, max_context_len), dtype=out_dtype, device=values.device)
        logits = paged_mqa_logits_ref(values, kv_cache, weights.float(), context_lens, block_table,
                                      max_context_len, indices)
        if self.flavour == "2.8" or not clean_logits:
            written = valid_mask(context_lens, max_context_len, indices)
            logits = torch.where(written, logits, torch.full_like(logits, GARBAGE))
        return logits.to(out_dtype)

    def _prefill(self, q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=False,
                 max_seqlen_k=None, schedule_meta=None, logits_dtype=torch.float32):
        values, scales = q
        if self.flavour == "2.6":
            assert max_seqlen_k == 0, "max_seqlen_k > 0 (compressed logits): not modelled"
            assert logits_dtype == torch.float32, "logits_dtype: only float32 modelled"
        k_values, k_scales = kv
        assert scales is None, "prefill double: FP8 only"
        want_w = self._weights_dtype(logits_dtype)
        assert weights.dtype == want_w, f"weights: {weights.dtype} != {want_w}"
        ks, ke = cu_seq_len_k_start.long(), cu_seq_len_k_end.long()
        num_kv = k_values.shape[0]
        qk = torch.einsum("mhd,nd->mhn", values.float(), k_values.float())
        scores = (qk.relu() * weights.float()[:, :, None]).sum(1) * k_scales.float()[None, :]
        cols = torch.arange(num_kv)
        inside = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])
        out_dtype = self._out_dtype(logits_dtype) if self.flavour != "2.6" else torch.float32
        if self.flavour in ("old", "2.6"):
            fill = float("-inf") if clean_logits else GARBAGE
            return torch.where(inside, scores, torch.full_like(scores, fill)).to(out_dtype)
        spans = ke - ks
        assert isinstance(max_seqlen_k, int) and max_seqlen_k > 0, "max_seqlen_k: int > 0"
        assert int(spans.max()) <= max_seqlen_k, "max_seqlen_k: smaller than a row's KV span"
        j = torch.arange(max_seqlen_k)
        src = (ks[:, None] + j[None, :]).clamp(max=num_kv - 1)
        comp = scores.gather(1, src)
        comp = torch.where(j[None, :] < spans[:, None], comp, torch.full_like(comp, GARBAGE))
        return comp.to(out_dtype)

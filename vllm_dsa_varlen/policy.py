"""Per-step choice: the varlen kernel, or what stock vLLM runs for this step.

The builder-level decision (:func:`vllm_dsa_varlen.config.choose_decode_path`)
says whether a varlen backend *can* serve a builder.  On GPUs where the varlen
kernel is the project's own (Hopper and other fp8 GPUs without a DeepGEMM
varlen kernel) it is not faster than stock for every step, so each decode step
is also checked here: :func:`varlen_wins` says whether the varlen kernel was
measured at least as fast as the path stock vLLM would take for *this* step.
Nothing here reads global state or tensors: the facts are host-known ints
(``StepFacts``), so the choice never synchronises with the device.

CUDA graphs: a full graph is keyed by the step's token count (and, in vLLM,
whether the batch is a uniform decode), so a decision that also depends on the
batch size or the longest run is made once at capture and replayed for other
batches with the same key.  That is safe as long as the builder prepares the
metadata both kernels need whenever it could go either way (it does); only the
speed of the baked choice is then a property of the captured batch.  A step
with fewer rows than :func:`min_varlen_rows` can never go to varlen; the
builder may leave such steps wholly to stock when the bound is checked against
the graph's own (padded) token count.

What stock runs for a step (``StockKind``):

* ``"native"``   DeepGEMM's ``[B, next_n]`` kernel on a uniform step
  (Hopper: next_n 1 or 2 on vLLM 0.27; 1, 2 or 4 on vLLM 0.33);
* ``"flattened"`` one row per token without ids, every row re-reading its
  request's KV (vLLM 0.27 Hopper with next_n > 2; 0.33 Hopper with next_n not
  native, or with adaptive verification);
* ``"split"``    a non-uniform step under ``require_uniform``: the requests
  after the first length mismatch are computed by the prefill path.

:data:`MEASURED` is the table the decision follows (BENCHMARKS.md holds the
measurements behind it), looked up at call time.  A step matches a rule when
every bound holds; the varlen kernel is used only where a rule says it won.
A rule may name the kernel it was measured with (``kernel``): it then applies
only when the caller says that kernel is the one a captured step runs
(:func:`vllm_dsa_varlen.ops.launcher.graph_kernel`, a fact of
the builder: GPU, index heads, cache geometry, NVRTC).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

StockKind = Literal["native", "flattened", "split"]
STOCK_KINDS: tuple[str, ...] = ("native", "flattened", "split")


@dataclass(frozen=True)
class StepFacts:
    """Host-known facts of one decode step.

    ``rows``: query rows of the decode part (graph-padding rows included);
    ``requests``: decode requests; ``max_run``: the longest request in
    tokens; ``uniform``: every request has ``max_run`` tokens;
    ``max_context``: the longest KV length (host-known in vLLM's common
    metadata; 0 when unknown); ``tokens``: the requests' own tokens (padding
    rows excluded; ``None``: as many as ``rows``)."""

    rows: int
    requests: int
    max_run: int
    uniform: bool
    max_context: int = 0
    tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("rows", "requests", "max_run", "max_context"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
        if self.tokens is not None and (not isinstance(self.tokens, int)
                                        or not 0 <= self.tokens <= self.rows):
            raise ValueError(f"tokens: expected an int in 0..rows ({self.rows}), "
                             f"got {self.tokens!r}")
        if self.requests > self.rows:
            raise ValueError(f"requests: {self.requests} requests cannot fill {self.rows} rows")
        if self.requests and not 1 <= self.max_run <= self.rows:
            raise ValueError(f"max_run: expected 1..{self.rows} for {self.requests} requests, "
                             f"got {self.max_run}")

    @classmethod
    def from_decode_lens(cls, decode_lens: Sequence[int], *, rows: int | None = None,
                         max_context: int = 0) -> "StepFacts":
        """Facts of a step from its per-request token counts (host ints, e.g.
        ``query_start_loc_cpu.diff().tolist()``).  Requests with 0 tokens
        (CUDA-graph padding) are not requests; ``rows`` defaults to the token
        count (pass the padded row count when the step has padding rows)."""
        lens = [int(n) for n in decode_lens]
        if any(n < 0 for n in lens):
            raise ValueError(f"decode_lens: expected counts >= 0, got {lens}")
        real = [n for n in lens if n > 0]
        max_run = max(real, default=0)
        return cls(rows=sum(lens) if rows is None else int(rows), requests=len(real),
                   max_run=max_run, uniform=all(n == max_run for n in real),
                   max_context=int(max_context), tokens=sum(lens))

    @classmethod
    def from_query_starts(cls, query_starts, *, rows: int | None = None,
                          max_context: int = 0) -> "StepFacts":
        """:meth:`from_decode_lens` of the counts between consecutive
        ``query_starts`` (host ints: a list, or anything with ``tolist()``
        such as ``query_start_loc_cpu[:n + 1]``).  Builders call it on every
        step: list counting here, no per-element conversion or generator
        (a third of ``from_decode_lens``'s host time on 8 requests)."""
        starts = query_starts.tolist() if hasattr(query_starts, "tolist") else list(query_starts)
        lens = [b - a for a, b in zip(starts, starts[1:])]
        if lens and min(lens) < 0:
            raise ValueError(f"query_starts: expected non-decreasing offsets, got {starts}")
        max_run = max(lens, default=0)
        requests = len(lens) - lens.count(0)
        tokens = starts[-1] - starts[0] if starts else 0
        return cls(rows=tokens if rows is None else int(rows), requests=requests,
                   max_run=max_run, uniform=max_run == 0 or lens.count(max_run) == requests,
                   max_context=int(max_context), tokens=tokens)

    @property
    def real_tokens(self) -> int:
        """The requests' own tokens (``rows`` when not given)."""
        return self.rows if self.tokens is None else self.tokens


def uniform_unpadded(num_reqs: int, longest: int, num_decodes: int, rows: int,
                     query_starts) -> bool:
    """Whether a step's ``num_decodes`` decode requests are all of its
    ``num_reqs`` requests, each of the step's ``longest`` tokens, and its
    ``rows`` decode rows (graph padding included) exactly their tokens:
    ``rows == num_decodes * longest`` and the requests' own token count (two
    host reads of the offsets ``query_starts``: a list, an array or a host
    tensor) equals ``rows``.  O(1): what
    :meth:`StepFacts.from_query_starts` would call uniform without padding,
    with no per-request list."""
    if num_decodes != num_reqs or longest < 1 or rows != num_decodes * longest:
        return False
    if hasattr(query_starts, "numpy"):  # a host tensor: its numpy view reads faster
        query_starts = query_starts.numpy()
    return int(query_starts[num_decodes]) - int(query_starts[0]) == rows


@dataclass(frozen=True)
class Rule:
    """Varlen measured at least as fast as ``stock`` on steps with
    ``min_run <= max_run <= max_run_le``, ``rows >= min_rows``,
    ``requests >= min_requests``, ``max_context >= min_context``,
    ``tokens >= min_tokens_per_request * requests`` (the mean run, padding
    rows excluded: flattening costs grow with tokens, varlen's with requests)
    and, when ``uniform`` is set, that uniformity (``None``: unbounded /
    either); ``kernel``: the varlen kernel it was measured with, when only
    that one won (``None``: every kernel that serves a captured step)."""

    stock: str
    min_run: int = 1
    max_run_le: int | None = None
    min_rows: int = 0
    min_requests: int = 0
    min_context: int = 0
    min_tokens_per_request: float = 0.0
    uniform: bool | None = None
    kernel: str | None = None
    note: str = ""

    def matches(self, step: StepFacts, kernel: str | None = None) -> bool:
        return ((self.kernel is None or self.kernel == kernel)
                and step.max_run >= self.min_run
                and (self.max_run_le is None or step.max_run <= self.max_run_le)
                and step.rows >= self.min_rows and step.requests >= self.min_requests
                and step.max_context >= self.min_context
                and step.real_tokens >= self.min_tokens_per_request * step.requests
                and (self.uniform is None or step.uniform == self.uniform))


# The rule table (H200, CUDA-graph replay, every path in one run: BENCHMARKS.md,
# "Per step: varlen against what stock runs").  Each "flattened" rule covers only steps
# like the measured rows where varlen was at least as fast as DeepGEMM
# flattened; the "split" rule was timed against an emulation of stock's
# split path (see its note).  No rule replaces stock's native kernel (DeepGEMM
# next_n = 2, and next_n = 4 on vLLM 0.33): two did, for the pipelined build
# (uniform 4 tokens from 256 rows, 2 tokens from 128: 1.04-1.09x native with
# the L2 flushed dirty, h200-9f1a909), until vLLM 0.33.0's engine ran the first
# at k = 3 B64 16K 0.973x stock (GPU 24.90 -> 25.47 ms a step; its kernel 73.7
# us a call against DeepGEMM's 66.1) and the bench with the L2 left clean, as
# the engine leaves it, read native 0.98x the kernel's time at 4 tokens, 1.02x
# at 2 (h200-533ddd0); the four-warpgroup build on the same engine steps read
# 0.997x stock (h200-9220b82): level, not a gain.  Where no rule matches,
# stock is kept.
MEASURED: tuple[Rule, ...] = (
    # A non-uniform step that stock splits to the prefill path: the prefill
    # path gathers the tail requests' KV into a workspace (reading and writing
    # it once more), scores it and runs outside a full CUDA graph; varlen keeps
    # them as decodes.  Timed against an emulation of that path (DeepGEMM's
    # native kernel on the uniform prefix, a torch gather, DeepGEMM's
    # non-paged MQA logits on the tail in one chunk): 8-13x slower than varlen
    # on every variable step measured (BENCHMARKS.md).
    Rule("split", note="variable steps stay decodes: stock's split path, emulated, measured "
                       "8-10x slower (B64/B128, 8K/32K, 1..4 and acceptance 0.7)"),
    # Stock flattening re-reads each request's KV once per token.
    Rule("flattened", min_run=2, max_run_le=2, min_rows=128, uniform=True,
         note="uniform 2 tokens, >= 128 rows: 1.41x (B64 L32K) and 1.49x (B256 L4K) "
              "DeepGEMM flattened"),
    Rule("flattened", min_run=3, max_run_le=4, min_rows=64, uniform=True,
         note="uniform 3-4 tokens, >= 64 rows: 1.16x (B16 L16K) to 1.74x (B256 L8K) "
              "DeepGEMM flattened; B1 (4 rows) measured slower"),
    Rule("flattened", min_run=8, max_run_le=8, min_requests=64, uniform=True,
         note="uniform 8 tokens, B64 L8K: 1.16x DeepGEMM flattened (sm_90 kernel; the "
              "portable one 1.07x)"),
    Rule("flattened", min_run=4, max_run_le=4, min_requests=64, min_context=32768,
         min_tokens_per_request=2.6, uniform=False,
         note="variable steps up to 4 tokens at 32K contexts with >= 2.6 tokens per "
              "request: B64 1..4 (2.67) 1.10x, B128 acceptance 0.7 (2.61) 1.10x DeepGEMM "
              "flattened; B64 acceptance 0.7 (2.28) measured slower (0.87x), as did B64 "
              "at 8K contexts (0.93x)"),
    # Steps only the CUDA sm_90 kernel won (v8: calls 39, 49 and 53, the
    # figures call 53's); the Gluon and portable kernels tied or lost them.
    Rule("flattened", min_run=5, max_run_le=7, min_requests=64, uniform=True, kernel="cuda_sm90",
         note="uniform 5, 6 or 7 tokens, B64 L8K: 1.16x, 1.55x, 1.30x DeepGEMM flattened (CUDA "
              "sm_90 kernel; Gluon 0.73x, 1.00x, 1.00x; portable 0.73x, 1.01x, 0.92x)"),
    Rule("flattened", min_run=4, max_run_le=4, min_requests=64, min_context=8192,
         min_tokens_per_request=2.6, uniform=False, kernel="cuda_sm90",
         note="variable steps up to 4 tokens at >= 8K contexts with >= 2.6 tokens per request: "
              "B64 L8K 1..4 1.22x, B128 L8K 1..4 1.57x, B64 L32K 1..4 1.41x DeepGEMM flattened "
              "(CUDA sm_90 kernel; at 8K the Gluon and portable kernels lost, 0.93x / 0.70x)"),
    # Small uniform steps (h200-744ee8f, h200-320b823: one process beside
    # DeepGEMM 2.8.1, rounds in a balanced order): the CUDA kernel was never
    # slower than DeepGEMM flattened from 32 rows of 4 tokens (1K-32K) or 18
    # rows of 3 tokens (2K-32K); at 16 rows of 4 tokens it lost at 1K.  No
    # context bound: a captured graph's kernel is chosen without contexts.
    # In vLLM 0.27.1's engine (61 layers) these steps gain at 16K-32K (B8: k = 2
    # 1.01-1.02x, k = 3 faster) and at 4K pay the varlen build's host time
    # (+95 us a step at 01f2093) for a kernel gain <= 0.04 ms (BENCHMARKS.md).
    Rule("flattened", min_run=4, max_run_le=4, min_rows=32, uniform=True, kernel="cuda_sm90",
         note="uniform 4 tokens, 32-63 rows: B8 1.02-1.36x DeepGEMM flattened (1K-32K; CUDA "
              "sm_90 kernel); B4 (16 rows) 1.06-1.17x at 4K-32K but 0.94x at 1K"),
    Rule("flattened", min_run=3, max_run_le=3, min_rows=18, uniform=True, kernel="cuda_sm90",
         note="uniform 3 tokens, 18-63 rows: B6 L2K 1.02x, B8 1.01-1.19x (4K-32K) DeepGEMM "
              "flattened (CUDA sm_90 kernel); B4 (12 rows) L2K 0.95x"),
    Rule("flattened", min_run=8, max_run_le=8, min_requests=64, min_context=8192,
         min_tokens_per_request=4.5, uniform=False, kernel="cuda_sm90",
         note="variable steps up to 8 tokens, B64 L8K 1..8 (4.67 tokens per request): 1.19x "
              "DeepGEMM flattened (CUDA sm_90 kernel; Gluon 0.84x, portable 0.71x)"),
)


def min_varlen_rows(stock: str, table: tuple[Rule, ...] | None = None,
                    kernel: str | None = None, max_run: int | None = None) -> int | None:
    """The fewest rows a step must have for any rule of ``table`` (default
    :data:`MEASURED`, looked up at call time) against ``stock`` to match, for
    the varlen kernel ``kernel`` and steps of at most ``max_run`` tokens per
    request (``None``: unbounded); ``None`` when no such rule exists.  A step
    with fewer rows is never sent to varlen (``requests <= rows``, so a
    ``min_requests`` bound is a row bound too)."""
    rules = MEASURED if table is None else table
    key = (id(rules), stock, kernel, max_run)
    known = _BOUNDS.get(key)
    if known is not None and known[0] is rules:
        return known[1]
    bounds = [max(1, rule.min_rows, rule.min_requests, rule.min_run)
              for rule in rules
              if rule.stock == stock and (rule.kernel is None or rule.kernel == kernel)
              and (max_run is None or rule.min_run <= max_run)]
    bound = min(bounds, default=None)
    _BOUNDS[key] = (rules, bound)
    return bound


# min_varlen_rows per (table, stock, kernel, max_run): builders ask on every
# build.  Keyed on the table's identity and holding it, so a table swapped in
# at call time (tests, tuning) is a new key, never a stale answer.
_BOUNDS: dict[tuple, tuple[tuple[Rule, ...], int | None]] = {}


def varlen_wins(step: StepFacts, stock: str, table: tuple[Rule, ...] | None = None,
                kernel: str | None = None) -> bool:
    """Whether the varlen kernel is used for ``step`` instead of ``stock``'s path.

    ``table``: the rules (default :data:`MEASURED`, looked up at call time);
    ``kernel``: the varlen kernel a captured step runs (``graph_kernel``), for
    the rules measured with one kernel only (``None``: those never match)."""
    if stock not in STOCK_KINDS:
        raise ValueError(f"stock: expected one of {STOCK_KINDS}, got {stock!r}")
    if step.rows == 0:
        return False
    rules = MEASURED if table is None else table
    for rule in _rules_for(rules, stock, kernel):
        if rule.matches(step, kernel):
            return True
    return False


_RULES_FOR: dict = {}


def uniform_step_wins(rows: int, max_run: int, stock: str, kernel: str | None = None,
                      table: tuple[Rule, ...] | None = None) -> bool | None:
    """:func:`varlen_wins` for a uniform step without padding (``rows //
    max_run`` requests of ``max_run`` tokens, every row a token) when no rule
    that could match it bounds contexts: the answer then depends on the three
    ints alone and is kept (builders ask on every step).  ``None`` where a
    rule bounds contexts (the caller decides from :class:`StepFacts`)."""
    if max_run < 1 or rows % max_run:
        raise ValueError(f"rows: {rows} rows are not whole requests of {max_run} tokens")
    rules = MEASURED if table is None else table
    key = (id(rules), rows, max_run, stock, kernel)
    known = _UNIFORM.get(key)
    if known is not None and known[0] is rules:
        return known[1]
    if any(r.min_context > 0 and r.uniform is not False for r in _rules_for(rules, stock, kernel)):
        answer = None
    else:
        facts = StepFacts(rows=rows, requests=rows // max_run, max_run=max_run, uniform=True,
                          tokens=rows)
        answer = varlen_wins(facts, stock, table, kernel)
    if len(_UNIFORM) >= 4096:  # step shapes are few (capture sizes); a bound all the same
        _UNIFORM.clear()
    _UNIFORM[key] = (rules, answer)
    return answer


_UNIFORM: dict = {}


def _rules_for(rules: tuple[Rule, ...], stock: str, kernel: str | None) -> tuple[Rule, ...]:
    """The rules of ``rules`` against ``stock`` that ``kernel`` may match, kept per table
    (a step's decision reads a few rules, not the table)."""
    key = (id(rules), stock, kernel)
    known = _RULES_FOR.get(key)
    if known is not None and known[0] is rules:
        return known[1]
    kept = tuple(r for r in rules if r.stock == stock and (r.kernel is None or r.kernel == kernel))
    _RULES_FOR[key] = (rules, kept)
    return kept

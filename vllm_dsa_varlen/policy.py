"""Per-step choice: the project's varlen kernel, or what stock vLLM runs for this step.

Where a builder's decode path is the project's kernels
(:func:`vllm_dsa_varlen.config.choose_decode_path`), :func:`varlen_wins`
decides each step from host-known ints (:class:`StepFacts`; no device sync)
against the rule table :data:`MEASURED`: varlen only where a rule says it
was at least as fast as the path stock would take.  A CUDA graph bakes the
choice made at capture, so the builders prepare the metadata both kernels
read wherever a step could go either way (docs/design.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

# What stock runs for a step: DeepGEMM's native [B, next_n] kernel on a uniform
# step; one row per token without ids, each re-reading its request's KV; or a
# non-uniform step split, its requests after the first length mismatch on the
# prefill path.
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
        step, so it counts on the list, with no per-element conversion."""
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


# The rule table.  Each rule covers only steps like the measured ones where
# varlen was at least as fast as stock's path (BENCHMARKS.md, "Which steps take
# varlen"); where no rule matches, stock is kept.  No rule replaces stock's
# native kernel: varlen measured level with it, not faster.
MEASURED: tuple[Rule, ...] = (
    # The prefill path gathers the split-off requests' KV into a workspace,
    # scores it and runs outside a full CUDA graph; varlen keeps them as
    # decodes (timed against an emulation of that path: BENCHMARKS.md,
    # "Variable steps against an emulation of stock's split path").
    Rule("split", note="variable steps stay decodes, faster than stock's split path (emulated)"),
    # Stock flattening re-reads each request's KV once per token.
    Rule("flattened", min_run=2, max_run_le=2, min_rows=128, uniform=True,
         note="uniform 2 tokens, >= 128 rows"),
    Rule("flattened", min_run=3, max_run_le=4, min_rows=64, uniform=True,
         note="uniform 3-4 tokens, >= 64 rows"),
    Rule("flattened", min_run=8, max_run_le=8, min_requests=64, uniform=True,
         note="uniform 8 tokens, >= 64 requests"),
    # Fewer tokens per request, or shorter contexts, measured slower.
    Rule("flattened", min_run=4, max_run_le=4, min_requests=64, min_context=32768,
         min_tokens_per_request=2.6, uniform=False,
         note="variable steps up to 4 tokens, >= 64 requests, >= 32K contexts, >= 2.6 tokens "
              "per request"),
    # Steps only the CUDA sm_90 kernel won; the portable kernel tied or lost them.
    Rule("flattened", min_run=5, max_run_le=7, min_requests=64, uniform=True, kernel="cuda_sm90",
         note="uniform 5, 6 or 7 tokens, >= 64 requests (CUDA sm_90 kernel)"),
    Rule("flattened", min_run=4, max_run_le=4, min_requests=64, min_context=8192,
         min_tokens_per_request=2.6, uniform=False, kernel="cuda_sm90",
         note="variable steps up to 4 tokens, >= 64 requests, >= 8K contexts, >= 2.6 tokens "
              "per request (CUDA sm_90 kernel)"),
    # Small uniform steps bound no context: a captured graph's kernel is chosen
    # without the contexts it will replay, and these held at every context
    # measured; fewer rows measured slower at short contexts.
    Rule("flattened", min_run=4, max_run_le=4, min_rows=32, uniform=True, kernel="cuda_sm90",
         note="uniform 4 tokens, >= 32 rows (CUDA sm_90 kernel)"),
    Rule("flattened", min_run=3, max_run_le=3, min_rows=18, uniform=True, kernel="cuda_sm90",
         note="uniform 3 tokens, >= 18 rows (CUDA sm_90 kernel)"),
    # Served variable steps: every request's k + 1 tokens but for a share whose
    # drafts were cut (a grammar under synchronous scheduling).  Under vLLM's
    # default graph mode they run eager (piecewise): the contexts are the step's own.
    Rule("flattened", min_run=4, max_run_le=4, min_requests=16, min_context=16384,
         min_tokens_per_request=2.8, uniform=False, kernel="cuda_sm90",
         note="variable steps up to 4 tokens, >= 16 requests, >= 16K contexts, >= 2.8 tokens "
              "per request (CUDA sm_90 kernel)"),
    Rule("flattened", min_run=4, max_run_le=4, min_requests=32, min_context=8192,
         min_tokens_per_request=2.8, uniform=False, kernel="cuda_sm90",
         note="variable steps up to 4 tokens, >= 32 requests, >= 8K contexts, >= 2.8 tokens "
              "per request (CUDA sm_90 kernel)"),
    Rule("flattened", min_run=8, max_run_le=8, min_requests=64, min_context=8192,
         min_tokens_per_request=4.5, uniform=False, kernel="cuda_sm90",
         note="variable steps up to 8 tokens, >= 64 requests, >= 8K contexts, >= 4.5 tokens "
              "per request (CUDA sm_90 kernel)"),
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
    # rows >= real tokens >= min_tokens_per_request * requests
    bounds = [max(1, rule.min_rows, rule.min_requests, rule.min_run,
                  math.ceil(rule.min_tokens_per_request * rule.min_requests))
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

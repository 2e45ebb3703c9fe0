#!/usr/bin/env python3
"""Two end-to-end runs compared (``benchmarks/e2e_decode.py``'s run files):
per case the TPOT ratio, the step-time statistics that tell the host's pace
from the engines' own costs, the token verdict (with where stock disagrees
with itself), and the run's table.  Reads result dicts only: no engine, no
GPU; the grid (``e2e_cells.py``) uses it without the engine harness."""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_trace import case_share  # noqa: E402


FAST_QUANTILE = 0.25


def fast_step_ms(case: dict, q: float = FAST_QUANTILE) -> float | None:
    """The ``q`` quantile of a case's decode-step times pooled over its rounds:
    the steps taken while the host ran fast.  Where the host's speed drifts
    (phases of 2x in a tiny CPU op, seen on the GPU host) and the GPU work is
    the same, the low quantile compares two engines' own per-step costs better
    than their means; ``None`` for runs that did not keep step times."""
    times = sorted(t for r in case.get("rounds", []) for t in r.get("step_ms", ()))
    return _quantile(times, q) if times else None


def _quantile(ordered: list, q: float) -> float:
    """The ``q`` quantile of the sorted, non-empty ``ordered`` (the value at
    ``floor(q * n)``, the last one for ``q = 1``)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def round_tpots(case: dict) -> list[float]:
    """A case's TPOT per round, in the order run (its reported TPOT is the
    median round's): where one engine's rounds spread and the other's do not,
    its steps followed something besides the GPU work."""
    return [r["tpot_ms"] for r in case.get("rounds") or () if "tpot_ms" in r]


def _tpot_cell(tpot: float, rounds: list | None) -> str:
    """A TPOT cell: the reported TPOT, and the rounds' range where there were several."""
    return (f"{tpot:.2f} ({min(rounds):.2f}-{max(rounds):.2f})" if rounds and len(rounds) > 1
            else f"{tpot:.2f}")


def step_pairs(stock_case: dict, plugin_case: dict) -> dict | None:
    """Stock ÷ plugin time of each decode step paired with the other engine's
    step of the same round and index: their median, 10 % and 90 % quantiles
    and count.  With ``--lockstep`` a pair ran back to back, so it met the
    same host phase (the statistic the phases move least); ``None`` where the
    runs kept no step times."""
    ratios = sorted(a / b for rs, rp in zip(stock_case.get("rounds") or [],
                                            plugin_case.get("rounds") or [])
                    for a, b in zip(rs.get("step_ms") or (), rp.get("step_ms") or ()) if b > 0)
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "p10": _quantile(ratios, 0.1),
            "p90": _quantile(ratios, 0.9), "n": len(ratios)}


def first_divergence(a: list[list[int]], b: list[list[int]]):
    for r, (x, y) in enumerate(zip(a, b)):
        for pos, (u, v) in enumerate(zip(x, y)):
            if u != v:
                return {"request": r, "position": pos, "stock": u, "plugin": v}
        if len(x) != len(y):
            return {"request": r, "position": min(len(x), len(y)), "stock": None, "plugin": None}
    return None


def _case_probe(case: dict) -> float | None:
    """The host probe (µs per tiny CPU op) of a case's reported round: the
    mean of the probes before and after it (before only in older files)."""
    probes = [case.get(k) for k in ("host_probe_us", "host_probe_after_us")]
    probes = [x for x in probes if isinstance(x, (int, float))]
    return sum(probes) / len(probes) if probes else None


def _build_by_tokens(stock_case: dict, plugin_case: dict) -> dict:
    """``{token count: [stock µs, plugin µs]}`` per ``build()`` call, for the
    step token counts both runs saw."""
    a, b = ((x.get("indexer_build") or {}).get("by_tokens") or {}
            for x in (stock_case, plugin_case))
    return {t: [a[t]["us_per_call"], b[t]["us_per_call"]] for t in a if t in b}


def compare(stock: dict, plugin: dict) -> dict:
    """Per case: speed ratio and token identity; the identity run's first divergence
    with both runs' top-2 logprobs there."""
    rows = []
    for s, p in zip(stock["cases"], plugin["cases"]):
        assert (s["batch"], s["prompt"]) == (p["batch"], p["prompt"])
        if "skipped" in s or "skipped" in p:
            rows.append({"batch": s["batch"], "prompt": s["prompt"], "k": stock["k"],
                         "skipped": s.get("skipped") or p.get("skipped")})
            continue
        div = first_divergence(s["tokens"], p["tokens"])
        rows.append({"batch": s["batch"], "prompt": s["prompt"], "k": stock["k"],
                     "stock_tok_s": s["tokens_per_s"], "plugin_tok_s": p["tokens_per_s"],
                     "stock_tpot_ms": s["tpot_ms"], "plugin_tpot_ms": p["tpot_ms"],
                     "speedup": (s["tpot_ms"] / p["tpot_ms"]) if p["tpot_ms"] else None,
                     "fast_step_ms": [fast_step_ms(s), fast_step_ms(p)],
                     "round_tpot_ms": [round_tpots(s), round_tpots(p)],
                     "step_pairs": step_pairs(s, p),
                     "gc": [s.get("gc"), p.get("gc")],
                     "tokens_identical": div is None, "first_divergence": div,
                     "rounds_tokens_equal": [s.get("rounds_tokens_equal"),
                                             p.get("rounds_tokens_equal")],
                     "stock_tie": tie_at(div, s, stock.get("identity")),
                     "indexer_build_us": [(x.get("indexer_build") or {}).get("us_per_call")
                                          for x in (s, p)],
                     "indexer_build_us_by_tokens": _build_by_tokens(s, p),
                     "host_probe_us": [_case_probe(x) for x in (s, p)],
                     "plugin_paths": p["paths"]["steps"],
                     "plugin_variable_steps": sum(p["paths"]["variable"].values()),
                     "plugin_mixed_steps": sum(p["paths"]["mixed"].values())})
    ident = None
    if "identity" in stock and "identity" in plugin:
        div = first_divergence(stock["identity"]["tokens"], plugin["identity"]["tokens"])
        ident = {"batch": stock["identity"]["batch"], "prompt": stock["identity"]["prompt"],
                 "requests": len(stock["identity"]["tokens"]),
                 "tokens_each": len(stock["identity"]["tokens"][0]),
                 "identical": div is None, "first_divergence": div}
        if div is not None:
            r, pos = div["request"], div["position"]
            ident["stock_top2"] = stock["identity"]["top2"][r][pos:pos + 1]
            ident["plugin_top2"] = plugin["identity"]["top2"][r][pos:pos + 1]
            ident["stock_tie"] = stock_tie(ident["stock_top2"])
    return {"rows": rows, "identity": ident}


def stock_tie(top2) -> bool | None:
    """Whether stock's two most likely tokens at a divergence have equal
    log-probabilities (``top2``: ``[[[token, logprob], [token, logprob]]]``,
    as the identity run keeps them): greedy decoding then rests on bits that
    stock itself need not repeat.  ``None`` where the run kept no top-2."""
    if not top2 or len(top2[0]) < 2:
        return None
    return top2[0][0][1] == top2[0][1][1]


def tie_at(div: dict | None, stock_case: dict, identity: dict | None) -> bool | None:
    """Whether a case's first divergence falls where stock's identity run
    has its two most likely tokens tied, and tied between the two tokens the
    engines chose there.  The identity run speaks for that position only where
    it had the same prompt (same request, same prompt length) and gave the same
    tokens before it; ``None`` otherwise (or where there is no divergence)."""
    if div is None or not identity or identity.get("prompt") != stock_case["prompt"]:
        return None
    r, pos = div["request"], div["position"]
    tokens, top2 = identity["tokens"], identity.get("top2") or []
    if (r >= len(tokens) or r >= len(top2) or pos >= len(tokens[r]) or pos >= len(top2[r])
            or tokens[r][:pos] != stock_case["tokens"][r][:pos]):
        return None
    here = top2[r][pos:pos + 1]
    return bool(stock_tie(here)) and {div["stock"], div["plugin"]} == {t for t, _ in here[0][:2]}


def token_difference(row: dict) -> str | None:
    """How a comparison row's tokens compare: ``None`` where identical, else
    ``"rounds"`` where stock's own rounds of the case gave different tokens too
    (a difference stock shows against itself says nothing about the plugin),
    ``"tie"`` where the first difference falls on an exact tie of stock's top
    two (:func:`tie_at`), ``""`` otherwise.  Both tables word it from here."""
    if row.get("tokens_identical"):
        return None
    if stock_rounds_differ(row):
        return "rounds"
    return "tie" if row.get("stock_tie") else ""


def tokens_verdict(row: dict) -> str:
    """The "tokens equal" cell of this run's table (:func:`token_difference`)."""
    return {None: "yes", "rounds": "NO (stock's own rounds differ too)",
            "tie": "NO (at an exact tie of stock's top two)", "": "NO"}[token_difference(row)]


def stock_rounds_differ(row: dict) -> bool:
    """Whether stock's own rounds of a comparison row's case gave different
    tokens (a run before the field says nothing: ``False``)."""
    return (row.get("rounds_tokens_equal") or [None])[0] is False


def table(result: dict) -> str:
    seconds = {e.get("second", "plugin") for e in result["per_k"].values()}
    who = seconds.pop() if len(seconds) == 1 else "plugin"
    lines = [f"| k | B | L | stock tok/s | {who} tok/s | stock TPOT ms (rounds) | "
             f"{who} TPOT ms (rounds) | gain | "
             f"tokens equal | {who} decode steps by path | indexer share stock / {who} | "
             f"indexer build() us stock / {who} | host probe us stock / {who} |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, entry in sorted(result["per_k"].items(), key=lambda kv: int(kv[0])):
        spread = {(x["batch"], x["prompt"]): x for x in entry.get("repeats", [])}
        for r in entry["comparison"]["rows"]:
            if "skipped" in r:
                lines.append(f"| {k} | {r['batch']} | {r['prompt'] // 1024}K | "
                             f"skipped: {r['skipped']} |" + " |" * 9)
                continue
            paths = ", ".join(f"{p} {n}" for p, n in r["plugin_paths"].items() if n)
            shares = [case_share(entry, m, r["batch"], r["prompt"])
                      for m in ("stock", entry.get("second", "plugin"))]
            sh = " / ".join("-" if x is None else f"{x:.0%}" for x in shares)
            gain = f"{r['speedup']:.3f}x"
            rep = spread.get((r["batch"], r["prompt"]))
            if rep and len(rep["tpot_ms"]) > 1:
                gain = (f"{rep['gain_median']:.3f}x ({rep['gain_min']:.3f}-{rep['gain_max']:.3f}, "
                        f"{len(rep['tpot_ms'])} pairs)")
            fast = r.get("fast_step_ms") or (None, None)
            if None not in fast:
                gain += f" (fast steps {fast[0] / fast[1]:.3f}x)"
            pairs = r.get("step_pairs")
            if pairs:
                gain += (f" (step pairs {pairs['median']:.3f}x, {pairs['p10']:.3f}-"
                         f"{pairs['p90']:.3f}, {pairs['n']})")
            lines.append(
                f"| {k} | {r['batch']} | {r['prompt'] // 1024}K | {r['stock_tok_s']:.0f} | "
                f"{r['plugin_tok_s']:.0f} | "
                + " | ".join(_tpot_cell(r[f"{m}_tpot_ms"], rounds) for m, rounds in
                             zip(("stock", "plugin"), r.get("round_tpot_ms") or (None, None)))
                + " | "
                f"{gain} | {tokens_verdict(r)} | {paths} | {sh} | "
                + " / ".join("-" if u is None else f"{u:.0f}" for u in r["indexer_build_us"])
                + " | " + " / ".join("-" if u is None else f"{u:.1f}"
                                     for u in r.get("host_probe_us", (None, None)))
                + " |")
    return "\n".join(lines)

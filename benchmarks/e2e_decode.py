#!/usr/bin/env python3
"""End to end: MTP decode in vLLM's engine, stock vs this plugin, same prompts, greedy.

    python3 benchmarks/e2e_decode.py --out e2e-out                    # the default table
    python3 benchmarks/e2e_decode.py --out e2e-out --k 3 --batch 64 --prompt 4096 --layers 4

For each MTP depth ``k`` it runs vLLM's offline engine twice, in separate
processes: ``DSA_VARLEN=stock`` (stock vLLM; only the DeepGEMM API
adapters are applied, so stock runs on a DeepGEMM of another API generation
than the one it was built with -- say so wherever its figures appear) and the
plugin (``DSA_VARLEN=auto``).  ``--same-process``: both engines in one
process instead (half the GPU memory each; each keeps its own CUDA graphs and
workspace: :class:`OwnEngine`), every case's rounds alternating between
them, so both meet the same host phase and GPU state (a machine whose host
speed drifts between processes otherwise decides small-batch rows); the
stock engine then runs stock's path through the plugin's pass-through
wrappers (a few host µs per build: ``benchmarks/builder_host.py``; on vLLM
0.27 its builders also clamp graph-padding requests' context lengths at 0 on
native steps, one device op, as the plugin's do), and both engines keep
vLLM's query kernels unless ``DSA_VARLEN_FUSED_Q`` is set (one choice a
process: :func:`same_process_query_prep`).  By default the model is a
DeepSeek-V3.2 architecture config written here, dummy weights: the real
indexer (64 heads x 128, top-k 2048, fp8 cache, page 64) and MLA sizes,
narrow layers (hidden 1024, dense MLPs), DeepSeek V3.2's 61 layers (``--layers``) plus its MTP
layer, so per-step costs are spread over as many layers as in the real model.
``--model`` takes any checkpoint instead (``--load-format auto`` for real
weights).  Prompts are seeded random token ids (request ``i`` has the same
prompt in every process and case), lengths uniform in ``[0.7 L, 1.3 L]``.

Per (batch B, prompt length L): the prompts are prefilled once (``max_tokens``
1, prefix caching on), then the measured run generates ``--new-tokens`` per
request (greedy, ``ignore_eos``) through ``LLMEngine.step()``, each step timed
on the host (a step returns after its sampled tokens reached the host).  The
decode phase starts once every request has its first token; its tokens per
second and time per output token (per request) are reported, with the plugin's
per-step decode-path counters (:mod:`vllm_dsa_varlen.stats`), JIT compiles
during the measured phase (Triton, DeepGEMM, NVRTC, torch.compile graphs:
counted) and the tokens.  After the table, per k: an identity run (the largest
B at the shortest L, with the top-2 logprobs of every position, so a
divergence shows its margin) and one profiled window of decode steps (a
torch-profiler Chrome trace, gzip'd; the indexer's share of the step's GPU
time and the schedule's per-step cost from the kernels' names; with
``--trace-cases every`` one per case, with ``--trace-only`` those windows
alone, for rows whose times came from other runs).

The gain is stock's TPOT over the plugin's (median rounds); "fast steps" beside
it is the same ratio of the decode-step times' 25 % quantile pooled over the
rounds (``e2e_compare.fast_step_ms``: steps the host ran fast; host speed drifts).

Output: ``OUT/e2e.json`` (strict JSON), ``OUT/run-<mode>-k<k>.json`` per
process, ``OUT/trace-<mode>-k<k>.json.gz``, and a table on stdout.  Needs a
CUDA GPU and vLLM (the 0.27 line; ``scripts/offline-gpu-install.sh`` stages it
for a host without a package index).
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import re
import signal
import subprocess
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_compare import compare, table  # noqa: E402
from e2e_trace import (  # noqa: E402
    rebuilt_run, share_table, summarize_trace, trace_windows)

from vllm_dsa_varlen.settings import FUSED_Q_ENV, MODE_ENV, TOPK_ENV  # noqa: E402

MODES = {"stock": "stock", "plugin": "auto"}
BOTH = "both"  # a child running both modes' engines in one process
# --control: a child running stock's engine twice in one process (the second
# named "control", in the plugin's place): an A/A run, the noise floor of the
# round pairs where both engines do the same work
CONTROL = "control"
# --modes stock --repeats N (N >= 2): stock's processes compared pairwise, the
# second of each pair named this in the plugin's place (an A/A pair across processes)
STOCK_AGAIN = "stock-again"
ENGINE_ENV = {**MODES, CONTROL: MODES["stock"]}
# the cudagraph_mode each --graph-mode asks vLLM for
GRAPH_MODES = {"default": "FULL_AND_PIECEWISE", "full": "FULL", "none": "FULL_DECODE_ONLY"}

TINY_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 2048,
    "moe_intermediate_size": 256, "num_nextn_predict_layers": 1,
    "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 1000,
    "moe_layer_freq": 1, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc",
    "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "kv_lora_rank": 512, "q_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048,
    "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rms_norm_eps": 1e-06, "hidden_act": "silu", "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1, "attention_bias": False,
    "attention_dropout": 0.0, "initializer_range": 0.02, "ep_size": 1,
}

# decode steps before a profiled window starts (past the prefill, JIT compiles
# and the first steps' allocations)
TRACE_SETTLE = 8


def write_tiny_config(path: str, layers: int) -> str:
    os.makedirs(path, exist_ok=True)
    cfg = dict(TINY_CONFIG, num_hidden_layers=layers)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return path


def prompt_ids(i: int, length: int, vocab: int) -> list[int]:
    """Request ``i``'s prompt at nominal length ``length``: the same in every process."""
    import random

    rng = random.Random(1000003 * i + length)
    n = int(length * rng.uniform(0.7, 1.3))
    return [rng.randrange(2, vocab) for _ in range(n)]


# ----------------------------------------------------------------------------- child

def _jit_state(triton_dir: str, dg_dir: str) -> dict:
    def files(d):
        return sum(len(fs) for _, _, fs in os.walk(d)) if os.path.isdir(d) else 0

    state = {"triton_cache_files": files(triton_dir), "deepgemm_cache_files": files(dg_dir)}
    try:
        from torch._dynamo.utils import counters

        state["dynamo_unique_graphs"] = int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a torch without the counter
        state["dynamo_unique_graphs"] = None
    from vllm_dsa_varlen.ops import cuda_paged_mqa_logits as ck
    from vllm_dsa_varlen.ops import cuda_plan as cp

    # the CUDA kernels' builds compiled by NVRTC and loaded so far (one each, per device)
    state["cuda_builds_loaded"] = len(ck._LOADED) + len(cp._LOADED)
    return state


def host_probe_us(n: int = 20000) -> float:
    """Host speed of this process: microseconds per tiny CPU torch op (C++
    dispatch plus the Python call), so a slower host between two processes is
    told apart from slower code in one of them."""
    import torch

    a = torch.ones(4)
    t0 = time.perf_counter()
    for _ in range(n):
        torch.add(a, a)
    return 1e6 * (time.perf_counter() - t0) / n


def gpu_state() -> dict:
    """The GPU's SM clock (MHz), power draw (W) and temperature (C) now, read
    through NVML where torch can reach it (``None`` each where not): a case
    that ran at a lower clock than its counterpart is told apart from slower
    code."""
    import torch

    out = {}
    for name, read, scale in (("sm_clock_mhz", "clock_rate", 1), ("power_w", "power_draw", 1e-3),
                              ("temperature_c", "temperature", 1)):
        try:
            out[name] = getattr(torch.cuda, read)() * scale
        except Exception:  # noqa: BLE001 - no NVML binding, or a torch without the reader
            out[name] = None
    return out


def kv_capacity_tokens(engine) -> int | None:
    """Tokens the engine's KV cache holds (``None`` where the config does not say)."""
    try:
        cc = engine.vllm_config.cache_config
        return int(cc.num_gpu_blocks) * int(cc.block_size)
    except Exception:  # noqa: BLE001
        return None


def case_tokens(batch: int, length: int, new_tokens: int, k: int) -> int:
    """KV tokens ``batch`` requests need at once: each the longest prompt at
    nominal ``length`` (1.3 x) plus its new and draft tokens."""
    return batch * (int(1.3 * length) + new_tokens + k + 1)


def case_fits(batch: int, length: int, new_tokens: int, k: int, capacity: int | None) -> bool:
    """Whether a case's requests fit the KV cache at once (:func:`case_tokens`;
    a case that does not would be measured with requests waiting: skipped)."""
    return capacity is None or case_tokens(batch, length, new_tokens, k) <= capacity


def fitting_batches(args, length: int, capacity: int | None) -> list[int]:
    """``args.batch``'s batches whose requests at ``length`` fit the KV cache at once."""
    return [b for b in args.batch if case_fits(b, length, args.new_tokens, args.k, capacity)]


# nothing_fits' message read back (:func:`unfit`), as a child's run file records it
NOTHING_FITS = re.compile(r"no case fits the engine's KV cache of (\d+) tokens.*"
                          r"the smallest needs (\d+)")


def nothing_fits(args, capacity: int | None, engines: int = 1) -> str | None:
    """Why no case of ``args`` can run on an engine whose KV cache holds
    ``capacity`` tokens (``None``: some case fits, or the capacity is
    unknown).  Asked right after an engine is built, so a run whose cases
    all would be skipped stops before building another engine."""
    if any(fitting_batches(args, length, capacity) for length in args.prompt):
        return None
    share = (f" (each of the {engines} engines in this process gets 1/{engines} of "
             f"--gpu-memory-utilization)" if engines > 1 else "")
    least = case_tokens(min(args.batch), min(args.prompt), args.new_tokens, args.k)
    return (f"--batch / --prompt: no case fits the engine's KV cache of {capacity} tokens"
            f"{share}; the smallest needs {least}")


def median_round(rounds: list[dict]) -> dict:
    """The round of median TPOT (the lower middle one of an even count)."""
    ranked = sorted(rounds, key=lambda r: r["tpot_ms"] if r["tpot_ms"] is not None else 1e30)
    return ranked[(len(ranked) - 1) // 2]


class BuildTimer:
    """Host time in the indexer metadata builder's ``build()`` (whatever is
    installed: stock's, or the plugin's wrapper around it), per call: the
    per-step host cost the plugin adds, measured the same way in both modes.
    Wraps the class attribute, so builders made before are timed too."""

    def __init__(self):
        from vllm.v1.attention.backends.mla import indexer as ix

        self.cls = ix.DeepseekV32IndexerMetadataBuilder
        self.inner = self.cls.build
        self.calls, self.seconds = 0, 0.0
        self.by_tokens: dict[int, list] = {}
        timer = self

        def build(builder, common_prefix_len, common_attn_metadata, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return timer.inner(builder, common_prefix_len, common_attn_metadata,
                                   *args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                timer.seconds += dt
                timer.calls += 1
                bucket = timer.by_tokens.setdefault(
                    int(getattr(common_attn_metadata, "num_actual_tokens", -1)), [0, 0.0])
                bucket[0] += 1
                bucket[1] += dt

        self.cls.build = build

    def take(self) -> dict:
        """Calls and µs per call since the last take, overall and per token
        count of the step (``by_tokens``: the target model's verification
        steps and the drafter's steps have different counts, so stock and
        plugin are compared step kind by step kind)."""
        out = {"calls": self.calls,
               "us_per_call": 1e6 * self.seconds / self.calls if self.calls else None,
               "by_tokens": {str(t): {"calls": c, "us_per_call": 1e6 * s / c}
                             for t, (c, s) in sorted(self.by_tokens.items()) if c}}
        self.calls, self.seconds, self.by_tokens = 0, 0.0, {}
        return out


class GcClock:
    """Python's garbage collector while the cases run (``gc.callbacks``):
    collections and pause milliseconds per generation since the last
    :meth:`take`.  Two engines in one process share one collector; a pause
    counts toward the step (or round) it fell in.  A plugin that allocates
    more per step collects more often: this is where that would show."""

    def __init__(self):
        self._t0 = None
        self._reset()
        gc.callbacks.append(self._callback)

    def _reset(self) -> None:
        self.count, self.seconds = [0, 0, 0], [0.0, 0.0, 0.0]

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            g = min(2, int(info.get("generation", 2)))
            self.count[g] += 1
            self.seconds[g] += time.perf_counter() - self._t0
            self._t0 = None

    def take(self) -> dict:
        out = {"collections": list(self.count), "ms": [round(1e3 * x, 3) for x in self.seconds]}
        self._reset()
        return out

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


def add_gc(a: dict | None, b: dict) -> dict:
    """Two :meth:`GcClock.take` results added."""
    if a is None:
        return {k: list(v) for k, v in b.items()}
    return {k: [round(x + y, 3) for x, y in zip(a[k], b[k])] for k in b}


def _add(engine, tag: str, prompts, new_tokens: int, logprobs=None) -> list[str]:
    """Add greedy requests (``ignore_eos``, token ids only, new tokens per
    step) for ``prompts``; their ids."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                            detokenize=False, logprobs=logprobs,
                            output_kind=RequestOutputKind.DELTA)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    return ids


def _paths_since(before: dict) -> dict:
    """The decode-path counters' growth since ``before`` (a ``stats.snapshot()``)."""
    from vllm_dsa_varlen import stats

    after = stats.snapshot()
    return {kind: {p: after[kind][p] - before[kind][p] for p in after[kind]} for kind in after}


class _Stepper:
    """One engine's requests of a case, stepped one ``engine.step()`` at a time:
    per-step host times and token counts, every request's tokens (and
    logprobs when asked)."""

    def __init__(self, engine, prompts, new_tokens, tag, logprobs=None):
        self.engine, self.logprobs = engine, logprobs
        self.ids = _add(engine, tag, prompts, new_tokens, logprobs)
        self.tokens = {rid: [] for rid in self.ids}
        self.lps = {rid: [] for rid in self.ids}
        self.cached, self.steps = {}, []

    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def step(self) -> None:
        t0 = time.perf_counter()
        outs = self.engine.step()
        dt = time.perf_counter() - t0
        new = 0
        for o in outs:
            c = o.outputs[0]
            self.tokens[o.request_id].extend(c.token_ids)
            new += len(c.token_ids)
            if o.num_cached_tokens is not None:
                self.cached[o.request_id] = o.num_cached_tokens
            if self.logprobs and c.logprobs:
                for pos in c.logprobs:
                    self.lps[o.request_id].append(sorted(
                        ((tok, lp.logprob) for tok, lp in pos.items()), key=lambda t: -t[1]))
        self.steps.append((dt, new, sum(1 for r in self.ids if self.tokens[r])))

    def result(self):
        return self.ids, self.tokens, self.lps, self.cached, self.steps


def _run_case(engine, prompts, new_tokens, tag, logprobs=None):
    """Add ``prompts`` and step the engine to completion; per-step host times and
    token counts, plus every request's tokens (and logprobs when asked)."""
    stepper = _Stepper(engine, prompts, new_tokens, tag, logprobs)
    while not stepper.done():
        stepper.step()
    return stepper.result()


def _run_lockstep(order, prompts, new_tokens, tag, build_timer, gc_clock=None) -> dict:
    """The same requests on every engine of ``order`` (``[(mode, engine)]``),
    their steps alternating: one step of each engine in turn, the first of
    ``order`` first, until all are done; each step timed alone (the others
    idle), so the engines meet the host's phases step by step, not round by
    round.  ``{mode: (_run_case's result, counter growth, build() times, the
    collector's work)}``, the decode-path counters, ``build()`` times and
    garbage collections (``gc_clock``, when given) taken around each engine's
    own steps."""
    from vllm_dsa_varlen import stats

    steppers = [(mode, _Stepper(engine, prompts, new_tokens, tag)) for mode, engine in order]
    paths: dict = {mode: None for mode, _ in steppers}
    builds: dict = {mode: [] for mode, _ in steppers}
    collected: dict = {mode: None for mode, _ in steppers}
    build_timer.take()  # what ran before the round is no engine's step here
    if gc_clock is not None:
        gc_clock.take()
    while not all(s.done() for _, s in steppers):
        for mode, stepper in steppers:
            if stepper.done():
                continue
            before = stats.snapshot()
            stepper.step()
            paths[mode] = add_paths(paths[mode], _paths_since(before))
            builds[mode].append(build_timer.take())
            if gc_clock is not None:
                collected[mode] = add_gc(collected[mode], gc_clock.take())
    return {mode: (s.result(), paths[mode], merge_builds(builds[mode]), collected[mode])
            for mode, s in steppers}


def _decode_figures(steps, batch, tokens):
    """Decode phase: from the step after which every request had its first token."""
    start = next(i for i, s in enumerate(steps) if s[2] == batch)
    t = sum(s[0] for s in steps[start + 1:])
    n = sum(s[1] for s in steps[start + 1:])
    total = sum(len(v) for v in tokens.values())
    return {
        "decode_steps": len(steps) - start - 1, "decode_s": t, "decode_tokens": n,
        "step_ms_median": (1e3 * statistics.median(s[0] for s in steps[start + 1:])
                           if len(steps) > start + 1 else None),
        "output_tokens": total,
        "tokens_per_s": n / t if t else None,
        "tpot_ms": 1e3 * t / (n / batch) if n else None,
        "tokens_per_request_step": n / batch / max(1, len(steps) - start - 1),
        "prefill_steps": start + 1,
        "step_ms": [round(1e3 * s[0], 3) for s in steps[start + 1:]],
    }


def child_modes(mode: str) -> tuple[str, ...]:
    """The engines a child process runs: one mode, ``both`` (stock's and the
    plugin's engines in one process, rounds alternating) or ``control``
    (stock's engine twice, the second named "control")."""
    if mode == CONTROL:
        return ("stock", CONTROL)
    return tuple(MODES) if mode == BOTH else (mode,)


def _stop_on_sigterm(signum, frame) -> None:
    raise SystemExit(f"stopped by signal {signum} (a time limit?): the run file keeps what "
                     "was measured before it")


def child(args) -> None:
    # `timeout` signals the whole process group: turn its SIGTERM into an exit
    # that the `finally` below sees, so a run stopped in a late window (the
    # profiled steps) still leaves its measured cases.
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    results: dict = {m: {} for m in child_modes(args.mode)}
    table = add_rules(args.rule)
    if args.rule:
        print(f"--rule: the plugin's table has {len(table)} rules, the last "
              f"{len(args.rule)} added for this run", flush=True)
        for result in results.values():
            result["extra_rules"] = [r["note"] for r in args.rule]
    try:
        _child(args, results)
    except BaseException:  # keep what was measured; the parent sees rc != 0
        import traceback

        for result in results.values():
            result["error"] = traceback.format_exc()
        raise
    finally:
        for mode, result in results.items():
            path = os.path.join(args.out, f"run-{mode}-k{args.k}{_rep(args.repeat)}.json")
            with open(path, "w") as f:
                json.dump(result, f)


def merge_builds(takes: list[dict]) -> dict:
    """:meth:`BuildTimer.take` results of several windows as one (calls and
    µs per call, overall and per step token count)."""
    calls = sum(t["calls"] for t in takes)
    total = sum(t["calls"] * t["us_per_call"] for t in takes if t["calls"])
    by: dict[str, list] = {}
    for t in takes:
        for tok, v in (t.get("by_tokens") or {}).items():
            got = by.setdefault(tok, [0, 0.0])
            got[0] += v["calls"]
            got[1] += v["calls"] * v["us_per_call"]
    return {"calls": calls, "us_per_call": total / calls if calls else None,
            "by_tokens": {tok: {"calls": c, "us_per_call": u / c}
                          for tok, (c, u) in sorted(by.items(), key=lambda kv: int(kv[0]))
                          if c}}


def add_paths(a: dict | None, b: dict) -> dict:
    """Two decode-path counter growths (``_paths_since``) added."""
    if a is None:
        return {kind: dict(counts) for kind, counts in b.items()}
    return {kind: {p: a[kind].get(p, 0) + n for p, n in counts.items()}
            for kind, counts in b.items()}


def _round_record(steps, batch, ids, tokens, cached, probe, probe_after, gpu0, gpu1,
                  collected=None) -> dict:
    """One engine's round of a case: its decode figures, the host probes and GPU
    states around the round, its cached prompt tokens and requests' tokens, the
    garbage collector's work in it (when clocked)."""
    record = {**_decode_figures(steps, batch, tokens), "host_probe_us": probe,
              "host_probe_after_us": probe_after, "gpu_before": gpu0, "gpu_after": gpu1,
              "cached_tokens": sum(cached.values()), "tokens": [tokens[r] for r in ids]}
    if collected is not None:
        record["gc"] = collected
    return record


def run_cases(engines, args, prompts_of, build_timer, jit_state, gc_clock=None) -> dict:
    """The warm-up pass and the measured cases of each engine of ``engines``
    (``[(mode, engine, result)]``: one, or stock's and the plugin's in one
    process) into its ``result["cases"]``; returns ``jit_state()`` taken after
    the warm-up.  With two engines every case's rounds alternate between them
    (``vllm_dsa_varlen.bench.graph.round_order``: for two engines, as given
    in even rounds and reversed in odd ones), so both meet the same host and
    GPU; with ``args.lockstep`` their steps alternate within each round
    (:func:`_run_lockstep`).  Counters and ``build()`` times are taken per
    round (per step in lockstep), so each engine's are its own.
    ``prompts_of(length, count=...)`` gives the prompts; cases whose requests
    do not fit an engine's KV cache at once are recorded as skipped."""
    from vllm_dsa_varlen import stats
    from vllm_dsa_varlen.bench.graph import round_order

    fits = {}
    for mode, engine, result in engines:
        capacity = kv_capacity_tokens(engine)
        result["kv_capacity_tokens"] = capacity
        fits[mode] = {length: fitting_batches(args, length, capacity) for length in args.prompt}

    # warm-up pass: every case once, unmeasured (prefills the prompts into the
    # prefix cache and compiles whatever a case's shapes need: JIT compiles
    # seen during the measured pass are counted below)
    for mode, engine, _ in engines:
        for length in args.prompt:
            if not fits[mode][length]:
                continue
            prompts = prompts_of(length, count=max(fits[mode][length]))
            _run_case(engine, prompts, 1, f"prefill-L{length}")
            for batch in fits[mode][length]:
                _run_case(engine, prompts[:batch], args.warm_tokens, f"warm-B{batch}-L{length}")
    stats.reset()
    build_timer.take()
    jit0 = jit_state()
    for length in args.prompt:
        for batch in args.batch:
            live = []
            for mode, engine, result in engines:
                if batch in fits[mode][length]:
                    live.append((mode, engine, result))
                    continue
                capacity = result["kv_capacity_tokens"]
                result["cases"].append({
                    "batch": batch, "prompt": length,
                    "skipped": f"does not fit the KV cache ({capacity} tokens)"})
                print(f"[{mode} k={args.k}] B{batch} L{length}: skipped (KV cache "
                      f"{capacity} tokens)", flush=True)
            if not live:
                continue
            prompts = prompts_of(length, count=batch)
            cases = {mode: {"batch": batch, "prompt": length, "rounds": []}
                     for mode, _, _ in live}
            paths: dict = {mode: None for mode, _, _ in live}
            builds: dict = {mode: [] for mode, _, _ in live}
            for rnd in range(args.case_rounds):
                order = round_order(live, rnd)
                tag = f"B{batch}-L{length}-r{rnd}"
                if getattr(args, "lockstep", False) and len(order) > 1:
                    probe, gpu0 = host_probe_us(5000), gpu_state()
                    got = _run_lockstep([(m, e) for m, e, _ in order], prompts,
                                        args.new_tokens, tag, build_timer, gc_clock)
                    probe_after, gpu1 = host_probe_us(5000), gpu_state()
                    for mode, ((ids, tokens, _, cached, steps), grew, took, collected) \
                            in got.items():
                        cases[mode]["rounds"].append(_round_record(
                            steps, batch, ids, tokens, cached, probe, probe_after, gpu0, gpu1,
                            collected))
                        builds[mode].append(took)
                        paths[mode] = add_paths(paths[mode], grew)
                    continue
                for mode, engine, _ in order:
                    before = stats.snapshot()
                    build_timer.take()
                    probe = host_probe_us(5000)
                    gpu0 = gpu_state()
                    if gc_clock is not None:
                        gc_clock.take()
                    ids, tokens, _, cached, steps = _run_case(engine, prompts, args.new_tokens, tag)
                    collected = gc_clock.take() if gc_clock is not None else None
                    cases[mode]["rounds"].append(_round_record(
                        steps, batch, ids, tokens, cached, probe, host_probe_us(5000), gpu0,
                        gpu_state(), collected))
                    builds[mode].append(build_timer.take())
                    paths[mode] = add_paths(paths[mode], _paths_since(before))
            for mode, _, result in live:
                case = cases[mode]
                mid = median_round(case["rounds"])
                case.update({key: v for key, v in mid.items()
                             if key not in ("tokens", "step_ms")})
                collected = None  # the collector's work over every round of the case
                for r in case["rounds"]:
                    if "gc" in r:
                        collected = add_gc(collected, r["gc"])
                if collected is not None:
                    case["gc"] = collected
                case.update({"indexer_build": merge_builds(builds[mode]),
                             "prompt_tokens": sum(len(p) for p in prompts),
                             "paths": paths[mode],
                             "rounds_tokens_equal": all(
                                 r["tokens"] == case["rounds"][0]["tokens"]
                                 for r in case["rounds"]),
                             "tokens": case["rounds"][0]["tokens"]})
                for r in case["rounds"]:
                    del r["tokens"]
                result["cases"].append(case)
                each = ", ".join(f"{r['tpot_ms']:.2f}" for r in case["rounds"])
                print(f"[{mode} k={args.k}] B{batch} L{length}: "
                      f"{case['tokens_per_s']:.0f} tok/s, TPOT {case['tpot_ms']:.2f} ms "
                      f"(rounds: {each}), paths {case['paths']['steps']}, top-k calls "
                      f"{case['paths'].get('topk')}", flush=True)
    return jit0


def capture_sizes(batches, k: int) -> list[int]:
    """CUDA-graph capture sizes (tokens) for the measured cases: every batch's
    decode step, ``batch * (k + 1)``, and the powers of two up to the largest,
    so a step whose batch shrank (requests finishing at different steps) pads
    to a nearby graph instead of running eagerly."""
    steps = {b * (k + 1) for b in batches}
    top = max(steps)
    powers = {1 << i for i in range(top.bit_length()) if 1 << i < top}
    return sorted(steps | powers)


def engine_kwargs(args, engines: int = 1) -> dict:
    """The ``LLM(...)`` arguments of a case set (``engines`` sharing the GPU:
    each takes that share of ``--gpu-memory-utilization``)."""
    lmax = max(args.prompt)
    max_len = int(1.3 * lmax) + args.new_tokens + args.k + 64
    max_batch = max(args.batch)
    spec = {"method": "mtp", "num_speculative_tokens": args.k}
    if args.attention_backend:
        spec["attention_backend"] = args.attention_backend
    compilation = {"max_cudagraph_capture_size": max_batch * (args.k + 1)}
    if args.capture_sizes == "cases":
        compilation["cudagraph_capture_sizes"] = capture_sizes(args.batch, args.k)
    if args.graph_mode == "none":
        compilation.update(mode=0, cudagraph_mode=GRAPH_MODES["none"])
    elif args.graph_mode == "full":
        compilation.update(cudagraph_mode=GRAPH_MODES["full"])
    kwargs = dict(model=args.model, load_format=args.load_format, skip_tokenizer_init=True,
                  max_model_len=max_len, max_num_seqs=max_batch, enable_prefix_caching=True,
                  max_num_batched_tokens=args.max_batched_tokens,
                  gpu_memory_utilization=args.gpu_memory_utilization / engines, seed=0,
                  speculative_config=spec, compilation_config=compilation,
                  kv_cache_dtype=args.kv_cache_dtype)
    if args.attention_backend:
        kwargs["attention_config"] = {"backend": args.attention_backend}
    if args.force_sparse_prefill:
        kwargs.setdefault("attention_config", {})["sparse_mla_force_mqa"] = True
    if args.async_scheduling != "default":
        kwargs["async_scheduling"] = args.async_scheduling == "on"
    return kwargs


class OwnEngine:
    """An engine built and stepped beside another one in the same process.

    vLLM keeps two of an engine's objects in process globals: every CUDA-graph
    wrapper in a class-wide registry, which the CUDA-graph memory profiling at
    engine start empties (``clear_all_graphs``: the other engine's captured
    graphs are dropped, and its next step tries to capture mid-run and fails),
    and the workspace manager, which a new engine replaces (the other engine's
    graphs hold addresses in the replaced workspace).  ``OwnEngine(make)``
    calls ``make()`` (it returns the ``LLM``) with the registries holding only
    the new engine's wrappers (the others' are added back after) and keeps its
    workspace manager; every call on the engine puts that manager back first
    (one attribute store per call), and so its decode top-k choice
    (``own_topk``: ``vllm_dsa_varlen.topk.force``; False keeps vLLM's, None
    the plugin's own decision), which is per process otherwise."""

    REGISTRIES = (("vllm.compilation.cuda_graph", "CUDAGraphWrapper"),
                  ("vllm.compilation.breakable_cudagraph", "BreakableCUDAGraphWrapper"))

    def __init__(self, make, own_topk: bool | None = None):
        import importlib
        import weakref

        from vllm.v1.worker import workspace

        from vllm_dsa_varlen import topk

        self._workspace = workspace
        self._topk, self._own_topk = topk, own_topk
        topk.force(own_topk)
        held = []
        for module, name in self.REGISTRIES:
            try:
                cls = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                continue
            if isinstance(cls.__dict__.get("_all_instances"), weakref.WeakSet):
                held.append((cls, cls._all_instances))
                cls._all_instances = weakref.WeakSet()
        try:
            self.llm = make()
        finally:
            for cls, others in held:
                own, cls._all_instances = cls._all_instances, others
                for wrapper in own:
                    others.add(wrapper)
        self._manager = workspace._manager
        self.engine = self.llm.llm_engine

    def __getattr__(self, name):
        attr = getattr(self.engine, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self._workspace._manager = self._manager
            self._topk.force(self._own_topk)
            return attr(*args, **kwargs)

        return call


def same_process_query_prep(environ) -> str:
    """Both engines in one process share the query preparation's choice: the
    plugin's query wrappers decide once a process, when the patch set is
    applied, and the compiled graphs keep it.  Unless ``DSA_VARLEN_FUSED_Q``
    is set, it is set to ``off`` in ``environ`` (the stock engine keeps vLLM's
    query kernels, so the pair differs in the indexer's logits and top-k path
    alone; the query kernels' gain is measured a process per mode).  Returns
    the line to print."""
    if FUSED_Q_ENV in environ:
        return (f"same process: {FUSED_Q_ENV}={environ[FUSED_Q_ENV]} as set, for both engines "
                f"(the stock engine's query preparation is the plugin's where that takes it)")
    environ[FUSED_Q_ENV] = "off"
    return (f"same process: {FUSED_Q_ENV}=off for both engines (one choice a process; the "
            f"query kernels' gain is measured a process per mode)")


def _child(args, results: dict) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    import tempfile

    triton_dir = os.path.join(tempfile.gettempdir(), f"e2e-cache-{args.mode}-k{args.k}", "triton")
    os.environ["TRITON_CACHE_DIR"] = triton_dir
    import torch
    from vllm import LLM

    modes = child_modes(args.mode)
    kwargs = engine_kwargs(args, len(modes))
    max_batch = max(args.batch)
    if len(modes) > 1:
        # Both engines in one process: the plugin's whole patch set first (the
        # env at its first load decides what it patches); each engine's
        # builders then read DSA_VARLEN as they are made, so the stock
        # engine's builders take stock's path through the pass-through wrappers
        # (--control: both engines are such stock engines).
        import vllm_dsa_varlen

        print(same_process_query_prep(os.environ), flush=True)
        os.environ[MODE_ENV] = MODES["plugin"]
        vllm_dsa_varlen.register()
    engines, llms = [], []  # the LLM objects kept alive beside their engines
    for mode in modes:
        os.environ[MODE_ENV] = ENGINE_ENV[mode]
        t0 = time.perf_counter()
        if len(modes) > 1:
            own = OwnEngine(lambda: LLM(**kwargs),
                            own_topk=None if ENGINE_ENV[mode] == MODES["plugin"] else False)
            llm, engine = own.llm, own
        else:
            llm = LLM(**kwargs)
            engine = llm.llm_engine
        init_s = time.perf_counter() - t0
        why = nothing_fits(args, kv_capacity_tokens(engine), len(modes))
        if why is not None and not getattr(args, "trace_only", False):
            raise SystemExit(f"[{mode} k={args.k}] {why}")
        llms.append(llm)
        engines.append((mode, engine, results[mode]))
        results[mode].update(_run_header(args, mode, engine, kwargs, init_s, torch))
    os.environ[MODE_ENV] = ENGINE_ENV[modes[-1]]
    vocab = engines[0][1].model_config.get_vocab_size()
    dg_dir = os.path.join(os.environ.get("VLLM_CACHE_ROOT", os.path.expanduser("~/.cache/vllm")),
                          "deep_gemm")
    build_timer = BuildTimer()

    def prompts_of(length: int, first: int = 0, count: int = max_batch):
        return [prompt_ids(i, length, vocab) for i in range(first, first + count)]

    gc_clock = GcClock()
    try:
        if getattr(args, "trace_only", False):  # no measured case: the windows alone
            for _, engine, result in engines:
                result["kv_capacity_tokens"] = kv_capacity_tokens(engine)
            jit0 = _jit_state(triton_dir, dg_dir)
        else:
            jit0 = run_cases(engines, args, prompts_of, build_timer,
                             lambda: _jit_state(triton_dir, dg_dir), gc_clock)
    finally:
        gc_clock.close()
    jit1 = _jit_state(triton_dir, dg_dir)
    for mode, engine, result in engines:
        result["jit"] = {"before": jit0, "after": jit1}
        result["host_probe_us"]["after_cases"] = host_probe_us()
        _after_cases(args, mode, engine, result, prompts_of, torch)


def _run_header(args, mode: str, engine, kwargs: dict, init_s: float, torch) -> dict:
    """A run file's facts about its engine (before any case)."""
    head = {"mode": mode, "k": args.k, "init_s": init_s, "graph_mode": args.graph_mode,
            "same_process": args.mode in (BOTH, CONTROL), "control": args.mode == CONTROL,
            "lockstep": bool(getattr(args, "lockstep", False)),
            "trace_only": bool(getattr(args, "trace_only", False)),
            "engine_args": {k: v for k, v in kwargs.items() if k != "model"},
            "topk_env": os.environ.get(TOPK_ENV, ""),
            "fused_q_env": os.environ.get(FUSED_Q_ENV, ""),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
            "cases": [], "jit": {}}
    try:
        import vllm

        head["vllm"] = vllm.__version__
        cc = engine.vllm_config.compilation_config
        head["cudagraph_mode"] = str(cc.cudagraph_mode)
        head["cudagraph_capture_sizes"] = list(cc.cudagraph_capture_sizes or [])
        head["async_scheduling"] = engine.vllm_config.scheduler_config.async_scheduling
    except Exception as e:  # noqa: BLE001
        head["config_error"] = repr(e)
    head["host_probe_us"] = {"start": host_probe_us()}
    head["cpus"] = sorted(os.sched_getaffinity(0))
    return head


def _after_cases(args, mode: str, engine, result: dict, prompts_of, torch) -> None:
    """An engine's mixed window, identity run and profiled steps (after the
    cases); with ``--trace-only`` the profiled steps alone."""
    from vllm_dsa_varlen import stats

    if getattr(args, "trace_only", False):
        _traces(args, mode, engine, result, prompts_of, torch)
        return
    max_batch = max(args.batch)
    if not getattr(args, "no_mixed_window", False):
        # a mixed window: half the requests decode while the other half prefill
        # (chunked prefill), the steps where vLLM runs the indexer op outside the
        # piecewise CUDA graphs
        length = min(args.prompt)
        half = max(1, max_batch // 2)
        before = stats.snapshot()
        _add(engine, "mixed-a", prompts_of(length, count=half), 32)
        for _ in range(4):
            engine.step()
        _add(engine, "mixed-b", prompts_of(length, first=10**5, count=half), 32)  # not cached
        while engine.has_unfinished_requests():
            engine.step()
        result["mixed_window"] = {"requests": 2 * half, "prompt": length,
                                  "paths": _paths_since(before)}

    # identity run: top-2 logprobs at every position
    length = min(args.prompt)
    ids, tokens, lps, _, _ = _run_case(engine, prompts_of(length), args.new_tokens, "identity",
                                       logprobs=2)
    result["identity"] = {"batch": max_batch, "prompt": length,
                          "tokens": [tokens[r] for r in ids], "top2": [lps[r] for r in ids]}

    _traces(args, mode, engine, result, prompts_of, torch)


def _traces(args, mode: str, engine, result: dict, prompts_of, torch) -> None:
    """Profiled windows of decode steps (first repeat only): the largest case,
    or with --trace-cases every (or --trace-only), each case that fits."""
    if args.trace_steps and args.repeat == 0:
        capacity = result.get("kv_capacity_tokens")
        traces = [_trace_window(args, mode, engine, prompts_of, torch, batch, length, name)
                  for batch, length, name in trace_cases(args, capacity)]
        result["trace"] = traces[-1]
        if len(traces) > 1:
            result["traces"] = traces


def trace_cases(args, capacity: int | None) -> list[tuple[int, int, str]]:
    """The profiled windows' ``(batch, prompt, file suffix)``: with
    ``--trace-cases largest`` one, the longest prompt that fits at
    ``--trace-batch`` or its largest fitting batch (suffix ""); with ``every``
    each fitting (batch, prompt) case, the largest last (suffix
    ``-b<B>-<L>k``; where none fits, the one window as with ``largest``)."""
    fits = {x: fitting_batches(args, x, capacity) for x in args.prompt}
    skip = set(getattr(args, "trace_skip", None) or ())
    every = [(b, x, f"-b{b}-{x // 1024}k") for x in sorted(fits) for b in sorted(fits[x])
             if (b, x) not in skip]
    if (getattr(args, "trace_cases", "largest") == "every"
            or getattr(args, "trace_only", False)) and every:
        return every
    length = max((x for x in args.prompt if fits[x]), default=min(args.prompt))
    return [(args.trace_batch or max(fits[length], default=1), length, "")]


def _trace_window(args, mode: str, engine, prompts_of, torch, batch: int, length: int,
                  suffix: str) -> dict:
    """``args.trace_steps`` decode steps of ``batch`` requests at ``length``
    under the torch profiler, the trace kept gzip'd and summarised
    (:func:`summarize_trace`).  The prompts are prefilled first (one token
    each, into the prefix cache), so the window's requests start decoding
    together rather than one prefill chunk apart; the profiler starts once
    every request has its first token and at least :data:`TRACE_SETTLE`
    steps ran.  Kept with the summary: the decode-path counters' growth over
    the profiled steps (``paths``: the path the window took) and the requests
    still decoding at each profiled step (``decoding``: ``batch`` each where
    the window was the whole case)."""
    from torch.profiler import ProfilerActivity, profile

    from vllm_dsa_varlen import stats

    prompts = prompts_of(length, count=batch)
    _run_case(engine, prompts, 1, "trace-prefill")
    stepper = _Stepper(engine, prompts, args.new_tokens, "trace")
    while not stepper.done() and (len(stepper.steps) < TRACE_SETTLE
                                  or not all(stepper.tokens[r] for r in stepper.ids)):
        stepper.step()
    path = os.path.join(args.out, f"trace-{mode}-k{args.k}{suffix}{_rep(args.repeat)}.json")
    decoding = []
    before = stats.snapshot()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.trace_steps):
            decoding.append(sum(1 for r in stepper.ids
                                if 0 < len(stepper.tokens[r]) < args.new_tokens))
            stepper.step()
        torch.cuda.synchronize()
    paths = _paths_since(before)
    prof.export_chrome_trace(path)
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
        dst.write(src.read())
    os.remove(path)
    while not stepper.done():
        stepper.step()
    return {"file": os.path.basename(path) + ".gz", "batch": batch, "prompt": length,
            "decoding": decoding, "paths": paths["steps"],
            **summarize_trace(path + ".gz", args.trace_steps)}


# ---------------------------------------------------------------------------- parent

def _rep(i: int) -> str:
    return f"-r{i}" if i else ""


def log_facts(path: str) -> dict:
    """From a run's log: the CUDA-graph capture lines (kind and count) and the
    plugin's decode-path lines (not its step counts' lines)."""
    with open(path, errors="replace") as f:
        text = f.read().replace("\r", "\n")
    captures = {}
    for m in re.finditer(r"Capturing CUDA graphs \(([^)]*)\)[^\n]*?(\d+)/(\d+)", text):
        captures[m.group(1)] = int(m.group(3))
    finished = re.findall(r"Graph capturing finished[^\n]*", text)
    # the counts' periodic lines (vllm_dsa_varlen.stats.LINE) are read from the counters here
    plugin = sorted({x for x in re.findall(r"vllm-dsa-varlen: [^\n]*", text)
                     if not x.startswith("vllm-dsa-varlen: decode steps ")})
    lines = [line for line in text.splitlines() if line.strip()]
    return {"cuda_graphs_captured": captures, "capture_log": finished[-2:],
            "plugin_log": plugin[:20], "last_line": lines[-1] if lines else ""}


def run_child(args, mode: str, k: int, rep: int, result: dict) -> dict:
    """One process (``mode``: one engine's, :data:`BOTH` or :data:`CONTROL`);
    ``{mode: its result or None if it wrote none}`` for each engine it ran."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--mode", mode,
           "--k", str(k), "--model", args.model, "--out", args.out, "--repeat", str(rep)]
    for name in ("batch", "prompt"):
        cmd += [f"--{name}", *map(str, getattr(args, name))]
    if args.cpus:
        cmd += ["--cpus", args.cpus]
    for flag in ("lockstep", "trace_only", "no_mixed_window"):
        if getattr(args, flag, False):
            cmd += [f"--{flag.replace('_', '-')}"]
    for name in ("new_tokens", "warm_tokens", "case_rounds", "layers", "graph_mode", "load_format",
                 "kv_cache_dtype", "force_sparse_prefill", "max_batched_tokens",
                 "gpu_memory_utilization", "trace_steps", "attention_backend", "capture_sizes",
                 "trace_batch", "async_scheduling", "trace_cases"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if getattr(args, "trace_skip", None):
        cmd += ["--trace-skip", *(f"{b}x{x}" for b, x in args.trace_skip)]
    for rule in getattr(args, "rule", None) or []:
        cmd += ["--rule", rule["note"]]
    env = dict(os.environ, **{MODE_ENV: MODES.get(mode, MODES["plugin"])})
    if args.topk:
        env[TOPK_ENV] = args.topk
    t0 = time.perf_counter()
    log = os.path.join(args.out, f"log-{mode}-k{k}{_rep(rep)}.txt")
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    result["runs"].append({"mode": mode, "k": k, "repeat": rep, "rc": rc,
                           "wall_s": time.perf_counter() - t0, "log": log, **log_facts(log)})
    print(f"{mode} k={k} repeat {rep}: rc {rc}, {time.perf_counter() - t0:.0f} s", flush=True)
    out = {}
    for m in child_modes(mode):
        path = os.path.join(args.out, f"run-{m}-k{k}{_rep(rep)}.json")
        out[m] = None
        if os.path.exists(path):
            with open(path) as f:
                out[m] = json.load(f)
    if rc:  # why: the exception's last line where the child recorded one, else its log's
        errors = [r["error"].strip().splitlines()[-1] for r in out.values()
                  if r and r.get("error", "").strip()]
        print(f"  {errors[0] if errors else result['runs'][-1]['last_line']}  ({log})",
              flush=True)
    return out


def unfit(out: dict) -> str | None:
    """The refusal of a child (``out``: :func:`run_child`'s) whose smallest case
    needs over 1.1x the KV cache its engine got: no other mode's engine on
    the same card gets 10 % more (the plugin's buffers are small), so the
    processes left for that k would be refused the same way."""
    for run in out.values():
        m = NOTHING_FITS.search((run or {}).get("error") or "")
        if m and int(m.group(2)) > 1.1 * int(m.group(1)):
            return m.group(0)
    return None


def repeat_spread(repeats: list[dict], second: str = "plugin") -> list[dict]:
    """Per case: each repeat's TPOT for both modes and the plugin's gain
    (stock / plugin TPOT; ``second``: the mode in the plugin's place) per
    repeat, with its median and range."""
    out = []
    pairs = [(r["stock"], r[second]) for r in repeats
             if r.get("stock") and r.get(second) and "cases" in r["stock"]
             and "cases" in r[second]]
    if not pairs:
        return out
    for i, case in enumerate(pairs[0][0]["cases"]):
        gains, tpots = [], []
        for s, p in pairs:
            if (i < len(s["cases"]) and i < len(p["cases"]) and p["cases"][i].get("tpot_ms")
                    and s["cases"][i].get("tpot_ms")):
                tpots.append((s["cases"][i]["tpot_ms"], p["cases"][i]["tpot_ms"]))
                gains.append(s["cases"][i]["tpot_ms"] / p["cases"][i]["tpot_ms"])
        out.append({"batch": case["batch"], "prompt": case["prompt"], "tpot_ms": tpots,
                    "gain_median": statistics.median(gains) if gains else None,
                    "gain_min": min(gains, default=None), "gain_max": max(gains, default=None)})
    return out


def parent(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    if args.model is None:
        args.model = write_tiny_config(os.path.join(args.out, "model"), args.layers)
    result = {"model": args.model, "layers": args.layers, "per_k": {}, "runs": [],
              "control": bool(args.control), "lockstep": bool(args.lockstep),
              "trace_only": bool(args.trace_only)}
    for k in args.k:
        runs, repeats = {}, []
        refused = None  # a process's KV cache far too small for every case: skip the rest
        for rep in range(args.repeats):
            if args.same_process:
                order = [CONTROL if args.control else BOTH]
            else:
                # alternate the order (stock, plugin / plugin, stock, ...) so a
                # drift between processes shows as spread, not as a gain
                order = list(args.modes) if rep % 2 == 0 else list(reversed(args.modes))
            this = {}
            for mode in order:
                if refused:
                    result["runs"].append({"mode": mode, "k": k, "repeat": rep, "rc": "skipped",
                                           "skipped": refused})
                    print(f"{mode} k={k} repeat {rep}: not started ({refused})", flush=True)
                    continue
                got = run_child(args, mode, k, rep, result)
                this.update(got)
                refused = unfit(got)
            repeats.append(this)
            if rep == 0:
                runs = this
        result["per_k"][str(k)] = k_entry(runs, repeats)
    return finish(args, result)


def graph_mode_notes(runs: dict) -> list[str]:
    """A line per run (``runs``: mode -> run file) whose engine ran another
    CUDA-graph mode than its ``--graph-mode`` asked for (vLLM lowers a mode
    the attention backend cannot capture, e.g. FULL with FLASHMLA_SPARSE,
    which captures uniform batches only, to FULL_AND_PIECEWISE)."""
    notes = []
    for mode, run in runs.items():
        asked = GRAPH_MODES.get(run.get("graph_mode"))
        ran = str(run.get("cudagraph_mode") or "").rpartition(".")[2]
        if asked and ran and ran != asked:
            notes.append(f"{mode}: --graph-mode {run['graph_mode']} asked for {asked}; "
                         f"vLLM ran {ran}")
    return notes


def k_entry(runs: dict, repeats: list[dict]) -> dict:
    """One k's part of e2e.json from its processes' results (``runs``: the
    first repeat's, by mode; ``repeats``: every repeat's)."""
    runs = {m: r for m, r in runs.items() if r and "cases" in r}
    entry = {"vllm": {m: r.get("vllm") for m, r in runs.items()},
             "init_s": {m: r["init_s"] for m, r in runs.items()},
             "cudagraph_mode": {m: r.get("cudagraph_mode") for m, r in runs.items()},
             "graph_mode_notes": graph_mode_notes(runs),
             "cudagraph_capture_sizes": {m: r.get("cudagraph_capture_sizes")
                                         for m, r in runs.items()},
             "jit": {m: r["jit"] for m, r in runs.items()},
             "trace": {m: {x: y for x, y in r["trace"].items()}
                       for m, r in runs.items() if "trace" in r}}
    traces = {m: r["traces"] for m, r in runs.items() if r.get("traces")}
    if traces:
        entry["traces"] = traces
    second = CONTROL if CONTROL in runs else "plugin"
    stocks = [r["stock"] for r in repeats if r.get("stock") and "cases" in r["stock"]]
    if "stock" in runs and second in runs:
        entry["second"] = second  # the "plugin" columns' engine (control: stock again)
        entry["comparison"] = compare(runs["stock"], runs[second])
        entry["repeats"] = repeat_spread(repeats, second)
    elif set(runs) == {"stock"} and len(stocks) >= 2:
        # --modes stock --repeats N: an A/A pair of processes, repeat 2i against 2i + 1
        entry["second"] = STOCK_AGAIN
        entry["comparison"] = compare(stocks[0], stocks[1])
        entry["repeats"] = repeat_spread([{"stock": a, STOCK_AGAIN: b}
                                          for a, b in zip(stocks[::2], stocks[1::2])],
                                         STOCK_AGAIN)
    entry["host_probe_us"] = {m: r.get("host_probe_us") for m, r in runs.items()}
    entry["mixed_window"] = {m: r.get("mixed_window") for m, r in runs.items()}
    return entry


def merge(args) -> int:
    """e2e.json and the table from ``run-{mode}-k{k}[-rN].json`` files already
    in ``--out`` (processes run by separate invocations, e.g. one mode per call
    on a machine that limits a command's time); a process stopped before its
    run file gives the windows its trace files hold (:func:`rebuilt_run`)."""
    result = {"model": None, "layers": args.layers, "per_k": {}, "runs": [], "merged": True}
    for k in args.k:
        repeats = []
        for rep in range(args.repeats):
            this = {}
            for mode in args.modes:
                path = os.path.join(args.out, f"run-{mode}-k{k}{_rep(rep)}.json")
                if os.path.exists(path):
                    with open(path) as f:
                        this[mode] = json.load(f)
                    result["runs"].append({"mode": mode, "k": k, "repeat": rep, "rc": 0,
                                           "file": os.path.basename(path)})
                elif rep == 0 and (run := rebuilt_run(args.out, mode, k, args.trace_steps)):
                    this[mode] = run  # its rc unknown: the merge exits non-zero
                    result["runs"].append({"mode": mode, "k": k, "repeat": rep, "rc": None,
                                           "rebuilt_from": [t["file"] for t in run["traces"]]})
            repeats.append(this)
        if repeats and repeats[0]:
            result["per_k"][str(k)] = k_entry(repeats[0], repeats)
    if not result["per_k"]:
        raise SystemExit(f"--merge: no run-*-k*.json for k in {args.k} in {args.out}")
    return finish(args, result)


def finish(args, result: dict) -> int:
    with open(os.path.join(args.out, "e2e.json"), "w") as f:
        json.dump(result, f, indent=1, allow_nan=False)
    if all("comparison" in e for e in result["per_k"].values()) and result["per_k"] \
            and any(e["comparison"]["rows"] for e in result["per_k"].values()):
        print(table(result))
    if any(trace_windows(e) for e in result["per_k"].values()):
        print(share_table(result))
    for k, e in result["per_k"].items():
        for note in e.get("graph_mode_notes", ()):
            print(f"k={k} {note}")
        ident = e.get("comparison", {}).get("identity")
        if ident:
            print(f"k={k} identity ({ident['requests']} requests x {ident['tokens_each']} tokens): "
                  + ("identical" if ident["identical"] else
                     f"{ident['first_divergence']}"
                     + (" (stock's top two tie there: greedy rests on bits stock need not "
                        "repeat)" if ident.get("stock_tie") else "")))
    return 0 if all(r["rc"] == 0 for r in result["runs"]) else 1


def parse_case(text: str) -> tuple[int, int]:
    """``BxL`` (batch x prompt length, e.g. ``32x32768``) as ``(B, L)``."""
    b, sep, x = text.partition("x")
    if not sep or not b.isdigit() or not x.isdigit() or int(b) < 1 or int(x) < 1:
        raise argparse.ArgumentTypeError(f"expected BxL (e.g. 32x32768), got {text!r}")
    return int(b), int(x)


def parse_rule(text: str) -> dict:
    """``STOCK:field=value,...`` (e.g. ``native:min_run=4,max_run_le=4,
    min_rows=256,uniform=1,kernel=cuda_sm90``) as the keyword arguments of a
    :class:`vllm_dsa_varlen.policy.Rule` (checked: its fields, ints, a float
    ``min_tokens_per_request``, ``uniform`` 0 / 1, ``kernel`` a name; its
    ``note`` the text, which is what the child is handed); a clear error
    otherwise."""
    from dataclasses import fields

    from vllm_dsa_varlen.policy import STOCK_KINDS, Rule

    stock, _, rest = text.partition(":")
    if stock not in STOCK_KINDS:
        raise argparse.ArgumentTypeError(
            f"expected STOCK:field=value,... with STOCK one of {', '.join(STOCK_KINDS)}; "
            f"got {text!r}")
    names = {f.name for f in fields(Rule)}
    rule: dict = {"stock": stock, "note": text}  # the note: the text itself
    for item in filter(None, rest.split(",")):
        name, sep, value = item.partition("=")
        if not sep or name not in names or name in ("stock", "note"):
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r}: not a Rule field=value "
                                             f"(fields: {', '.join(sorted(names))})")
        try:
            if name == "uniform":
                if value not in ("0", "1"):
                    raise ValueError(value)
                rule[name] = value == "1"
            elif name == "kernel":
                rule[name] = value
            elif name == "min_tokens_per_request":
                rule[name] = float(value)
            else:
                rule[name] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r}: bad value for {name}")
    return rule


def add_rules(rules: list[dict]) -> tuple:
    """``--rule``: the rules appended to the plugin's table in this process
    (:data:`vllm_dsa_varlen.policy.MEASURED`, read at call time), before any
    engine starts; the table as it then stands."""
    from vllm_dsa_varlen import policy

    if rules:
        policy.MEASURED = policy.MEASURED + tuple(policy.Rule(**r) for r in rules)
    return policy.MEASURED


def parse_cpus(text: str) -> set[int]:
    """``"0-3,8,10-11"`` -> ``{0, 1, 2, 3, 8, 10, 11}`` (a clear error otherwise)."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"expected CPU numbers and ranges such as 0-7,9; got {text!r}")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"empty range {part.strip()!r} in {text!r}")
        cpus.update(range(first, last + 1))
    return cpus


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="MTP decode end to end: stock vs vllm-dsa-varlen")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="a model path (default: the tiny config)")
    ap.add_argument("--layers", type=int, default=61, help="tiny config's layers (default 61)")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3], help="MTP draft tokens")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--warm-tokens", type=int, default=16,
                    help="tokens per request in the unmeasured warm-up pass of every case")
    ap.add_argument("--case-rounds", type=int, default=1,
                    help="measured rounds of each case in its process, back to back (the "
                         "prompts prefilled once); the round of median TPOT is reported, "
                         "every round kept")
    ap.add_argument("--repeats", type=int, default=1,
                    help="engine processes per mode and k, in alternating order; with "
                         "--modes stock, an A/A pair: stock's processes compared pairwise")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--graph-mode", default="default", choices=["default", "full", "none"],
                    help="default: vLLM's (FULL_AND_PIECEWISE, torch.compile); full: FULL "
                         "graphs (vLLM 0.27.1 lowers it to FULL_AND_PIECEWISE with "
                         "FLASHMLA_SPARSE, which captures uniform batches only: the table "
                         "says so); none: no torch.compile, full decode graphs only")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--attention-backend", default="FLASHMLA_SPARSE")
    ap.add_argument("--force-sparse-prefill", type=int, default=1,
                    help="1: every prefill through the sparse MLA (MQA) path, as decode; 0: "
                         "vLLM's default, short prefills through FlashAttention (needs its "
                         "extension to load)")
    ap.add_argument("--max-batched-tokens", type=int, default=16384)
    ap.add_argument("--async-scheduling", default="default", choices=["default", "on", "off"],
                    help="vLLM's async scheduling (a step's host work overlapping the previous "
                         "step's GPU work): default: vLLM's choice (on for MTP), off under "
                         "--lockstep, where two engines' pipelined steps would hold each other's "
                         "GPU work; off: every step its host then its GPU work")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--trace-steps", type=int, default=3, help="profiled decode steps (0: none)")
    ap.add_argument("--trace-cases", default="largest", choices=["largest", "every"],
                    help="largest: one profiled window (the longest prompt that fits, at "
                         "--trace-batch or its largest batch); every: one per case that fits "
                         "(trace-<mode>-k<k>-b<B>-<L>k.json.gz), so every row has its indexer "
                         "share")
    ap.add_argument("--trace-only", action="store_true",
                    help="no measured case, mixed window or identity run: only a profiled "
                         "window per fitting case (as --trace-cases every), each case's "
                         "prompts prefilled first; the indexer's share for rows whose times "
                         "came from other runs (benchmarks/e2e_cells.py joins them)")
    ap.add_argument("--no-mixed-window", action="store_true",
                    help="no mixed window after the cases (its half-batch of uncached "
                         "prompts costs each engine a prefill: ~20 s at B16 32K)")
    ap.add_argument("--trace-skip", type=parse_case, nargs="+", default=[], metavar="BxL",
                    help="cases given no window of their own under --trace-cases every or "
                         "--trace-only (e.g. 32x32768: one traced before; its prefill costs "
                         "the most)")
    ap.add_argument("--trace-batch", type=int, default=0,
                    help="requests in the profiled window (default: the largest batch); a "
                         "small batch shows the host's share of a host-bound step")
    ap.add_argument("--capture-sizes", default="cases", choices=["cases", "vllm"],
                    help="CUDA-graph sizes: cases: each batch's decode step (batch x (k + 1) "
                         "tokens) and the powers of two below the largest (for batches that "
                         "shrink as requests finish); vllm: vLLM's own list (~35 sizes, "
                         "longer start-up)")
    ap.add_argument("--merge", action="store_true",
                    help="run nothing: assemble e2e.json and the table from the "
                         "run-{mode}-k{k}.json files in --out (modes run by separate invocations)")
    ap.add_argument("--same-process", action="store_true",
                    help="stock's and the plugin's engines in ONE process (each with half of "
                         "--gpu-memory-utilization), every case's rounds alternating between "
                         "them, so both meet the same host and GPU; the stock engine runs "
                         "stock's path through the plugin's pass-through wrappers (with "
                         "torch.compile both engines compile: ~400 s at 61 layers on the "
                         "H200; --graph-mode none starts both in ~20 s)")
    ap.add_argument("--topk", choices=["auto", "own", "vllm"], default=None,
                    help="the plugin engine's DSA_VARLEN_TOPK (default: as the "
                         "environment has it, else auto); stock's engine keeps vLLM's")
    ap.add_argument("--control", action="store_true",
                    help="with --same-process: an A/A control, stock's engine twice (the "
                         "second named 'control', in the plugin's columns): the round pairs' "
                         "spread where both engines do the same work")
    ap.add_argument("--lockstep", action="store_true",
                    help="with --same-process: within each round the two engines' steps "
                         "alternate (one step of each in turn, each timed alone), so a pair "
                         "meets the host's phases step by step rather than round by round; "
                         "turns vLLM's async scheduling off unless --async-scheduling on")
    ap.add_argument("--cpus", default=None,
                    help="pin each engine process to these CPUs (e.g. 0-7 or 0,2,4): a host "
                         "whose speed changes between processes (see the host probe per "
                         "round) varies less on a fixed set")
    ap.add_argument("--rule", type=parse_rule, action="append", default=[],
                    metavar="STOCK:field=value,...",
                    help="append a rule to the plugin's per-step table in the engine processes "
                         "(an experiment: e.g. native:min_run=4,max_run_le=4,min_rows=256,"
                         "uniform=1,kernel=cuda_sm90 sends uniform 4-token steps of >= 256 "
                         "rows to varlen); repeatable; stock's engine ignores it")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=[*MODES, BOTH, CONTROL], help=argparse.SUPPRESS)
    ap.add_argument("--repeat", type=int, default=0, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.case_rounds < 1:
        parser.error(f"--case-rounds: expected >= 1, got {args.case_rounds}")
    if args.same_process and sorted(args.modes) != sorted(MODES):
        parser.error(f"--same-process: runs both modes ({', '.join(MODES)}); "
                     f"got --modes {' '.join(args.modes)}")
    if args.control and not args.same_process:
        parser.error("--control: only with --same-process (stock's engine twice in one process)")
    # a one-process child (mode both / control) was started by a --same-process parent
    one_process = args.same_process or (args.child and args.mode in (BOTH, CONTROL))
    if args.lockstep and not one_process:
        parser.error("--lockstep: only with --same-process (two engines in one process)")
    if args.trace_only and args.trace_steps < 1:
        parser.error(f"--trace-only: needs --trace-steps >= 1, got {args.trace_steps}")
    if args.trace_only and args.lockstep:
        parser.error("--trace-only: runs no measured case, so no steps in --lockstep")
    if args.lockstep and args.async_scheduling == "default":
        # each step timed alone needs each step to end with its own GPU work
        args.async_scheduling = "off"
    if args.cpus is not None:
        try:
            args.cpu_set = parse_cpus(args.cpus)
        except ValueError as e:
            parser.error(f"--cpus: {e}")
    if args.child:
        args.k = args.k[0]
        if args.cpus:
            os.sched_setaffinity(0, args.cpu_set)
        child(args)
        return 0
    if args.merge:
        return merge(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())

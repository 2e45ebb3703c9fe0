#!/usr/bin/env python3
"""``vllm serve`` under vLLM's own client: stock against the plugin, under load.

    python3 benchmarks/serve.py --out serve-out --config proxy --k 3            # the full sweep
    python3 benchmarks/serve.py --out serve-out --config proxy --k 3 --quick    # one GPU call
    python3 benchmarks/serve.py --out serve-out --quick --aa                    # + stock twice
    python3 benchmarks/serve.py --out serve-out --dry-run                       # the commands

For each mode -- ``stock`` (the plugin's mode variable ``stock``), ``plugin``
(``auto``), each ``--variant`` (the plugin with some settings changed) and
with ``--aa`` ``control`` (stock again: the A/A spread) -- it
starts ``vllm serve`` as a process of its own (vLLM's default multiprocess
engine core; loopback, a free port), waits for ``/v1/models``, and runs:

1. a warm-up (unmeasured) with vLLM's client;
2. the greedy identity requests (``/v1/completions``, temperature 0,
   ``ignore_eos``, mixed prompt lengths, a quarter one at a time, the rest in
   concurrent groups), texts compared with stock's;
3. the sweep: per input length (``--input-len``, random dataset, fixed seeds,
   the same prompts in every mode), ``vllm bench serve`` at each
   ``--max-concurrency`` (``--concurrency``) and each Poisson
   ``--request-rate`` (``--rates``; ``auto``: fractions of the first mode's
   request throughput at the highest concurrency, so every mode gets the same
   rates), each point after an idle spell of ``--gap`` seconds; with
   ``--structured N``, N clients of regex-constrained completions beside
   vLLM's client in each point (the variable steps described in 4);
4. with ``--soak-minutes``, a soak: Poisson load at ``--soak-rate`` with
   variable output lengths and long prompts (chunked prefill mixed with
   decode), a few streams closed by the client mid-way, GPU memory sampled
   with ``nvidia-smi``, and ``--soak-structured`` clients sending
   regex-constrained completions one after another: under synchronous
   scheduling (``--async-scheduling off``) the grammar trims a request's MTP
   drafts to their valid prefix, so its decode runs vary between 1 and k + 1
   tokens (variable steps, which vLLM's scheduler does not make otherwise: it
   schedules a running request's k drafts whole, cutting them only at the
   token budget; under async scheduling, its default with MTP, it keeps the
   k slots and pads the drafts the grammar refuses);

then stops the server (SIGTERM to the API server, which lets its engine core
drain for ``--server-shutdown-timeout`` and exit; SIGKILL to the process group
only past ``--stop-timeout``).  Every ``vllm bench serve`` run goes through
one worker process that imports vLLM's command line once
(``benchmarks/bench_client.py``; ``--client fresh``: a process a run).
With ``--time-limit`` the servers share the time; where it is short, the
variants and the control are dropped before stock and the plugin.
``--rounds N`` runs the servers side by side instead (each with an equal part
of the GPU's memory), the points measured in N rounds in which they take
turns: where a step is the host's time, what drifts on the machine between
one server's minutes and the next's is larger than the difference measured,
and only same-round ratios compare (the table: their median and range).
With ``--start-together`` (and ``--kv-cache-gib``: a fixed KV cache, so vLLM
skips the free-memory profiling a server starting beside another would
misread) they also come up at once, one start's wait instead of one each.

Per point it keeps the client's result file without its per-request arrays
(``client-<mode>-<point>.json``), the growth of vLLM's ``/metrics`` counters
over the point (speculative decoding: drafts, draft tokens, accepted tokens,
per position; engine steps; preemptions; finished requests), and the
plugin's per-path decode-step counts from the engine core's log lines
(``vllm_dsa_varlen.stats.LINE``: a line is written at the first step after an
idle spell of ``stats.LOG_EVERY_S``, so with ``--gap`` longer than that each
point's counts are exact; they include the client's one-prompt test request
that starts each run).  Per server: the plugin's decode-path lines and
the process that wrote them, error and traceback lines before and after the
stop was asked.

Output: ``OUT/serve.json`` (strict JSON, rewritten after every point so a
stopped run keeps what it measured), the client and identity files, each
server's log, and a table on stdout: TTFT, TPOT, ITL (mean / p50 / p99) and
output tokens/s per point and mode, each mode's speed against stock's
(``x``: stock's time over the mode's, the mode's tokens/s over stock's).

Diagnostics (``benchmarks/serve_diag.py``), for finding where a served step
loses: ``--env VLLM_GPU_SYNC_CHECK=warn`` makes vLLM warn at every line that
synchronises with the GPU inside its step, kept per server as
``sync_sites``; ``--py-spy PATH`` records each engine core's stacks over
every measured point (``stacks``: per thread, functions by inclusive and self
share, the share inside the plugin's package, the share waiting);
``--profile-steps N`` takes a window of N engine steps under vLLM's torch
profiler after the points (``profile``: GPU time per step by kernel class,
the share of the window some kernel ran, the host's CUDA synchronisations per
step).  At the stop each engine core's stand towards SIGTERM is kept
(``/proc``: blocked, pending, handled).

The model: ``--config tiny|proxy`` writes a model folder
(``benchmarks/serve_model.py``: DeepSeek-V3.2's architecture, dummy weights,
a word-level tokenizer); ``--model`` takes any checkpoint instead
(``--load-format auto`` for its weights).
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import math
import os
import re
import select
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

_HERE = os.path.dirname(os.path.abspath(__file__))
# this checkout's plugin package (its log-line format), then the benchmarks beside this file
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]
import serve_diag  # noqa: E402
import serve_model  # noqa: E402

from vllm_dsa_varlen import settings, stats  # noqa: E402
from vllm_dsa_varlen.settings import MODE_ENV  # noqa: E402

# The one place the plugin's settings are named: each mode's value of its mode variable.
MODE_VALUES = {"stock": "stock", "plugin": "auto", "control": "stock"}
# The comparison every run is for; the other servers (the control, variants) a
# short --time-limit drops first.
COMPARED = ("stock", "plugin")
# Taken out of the servers' environment: the offline benchmark's in-process
# engine core (a server runs vLLM's default, its own process).
DROPPED_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING",)
SERVED_NAME = "dsa-serve"
PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
# The identity prompts' lengths in words, cycled (clipped to the model's length).
IDENTITY_LENGTHS = (16, 200, 1000, 3000, 8000, 15000)
LEVEL = re.compile(r"\b(ERROR|CRITICAL)\b")
PROCESS_TAG = re.compile(r"\((\w+)(?: pid=(\d+))?\)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


# ----------------------------------------------------------------------------- commands

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(mode: str, base: dict, extra: dict, variants: dict | None = None) -> dict:
    """The server's environment in ``mode``: ``base`` without
    :data:`DROPPED_ENV`, uncoloured unbuffered logs, every thread's stack on a
    fatal signal (:meth:`Server.stop`), no hub look-ups,
    ``extra`` (``--env``), then the mode's value of the plugin's mode variable;
    a variant (``variants``: name -> its settings, ``--variant``) is the
    plugin with its settings over ``extra``."""
    variants = variants or {}
    if mode not in MODE_VALUES and mode not in variants:
        raise ValueError(f"mode: expected one of {', '.join([*MODE_VALUES, *variants])}, "
                         f"got {mode!r}")
    env = {k: v for k, v in base.items() if k not in DROPPED_ENV}
    env.update(PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", VLLM_LOGGING_COLOR="0",
               NO_COLOR="1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.update(extra)
    env.update(variants.get(mode, {}))
    env[MODE_ENV] = MODE_VALUES.get(mode, MODE_VALUES["plugin"])
    return env


def parse_variant(text: str) -> tuple[str, dict]:
    """``NAME:SETTING=VALUE[,SETTING=VALUE...]`` (``--variant``): a plugin
    server named NAME with those of the plugin's settings (its mode variable
    excepted), each checked as the plugin reads it; a clear error otherwise."""
    name, sep, rest = text.partition(":")
    if not sep or not re.fullmatch(r"[A-Za-z][\w.-]*", name) or name in MODE_VALUES:
        raise argparse.ArgumentTypeError(
            f"expected NAME:SETTING=VALUE,... with NAME a new mode name (not "
            f"{', '.join(MODE_VALUES)}), got {text!r}")
    env = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq or key not in settings.SETTINGS or key == MODE_ENV:
            known = ", ".join(k for k in settings.SETTINGS if k != MODE_ENV)
            raise argparse.ArgumentTypeError(
                f"{text!r}: {item!r} is not SETTING=VALUE with SETTING one of {known}")
        try:
            settings.get(key, {key: value})
        except Exception as exc:  # noqa: BLE001 - the plugin's own message
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
        env[key] = value
    return name, env


def max_model_len(args) -> int:
    """Room for the longest prompt the dataset can draw (``--input-len`` x
    (1 + range ratio), the soak's too), its output and the draft tokens."""
    ratio = max(args.range_ratio, args.soak_range_ratio if args.soak_minutes else 0.0)
    longest = max(list(args.input_len) + ([args.soak_input_len] if args.soak_minutes else []))
    out = max(args.output_len, args.soak_output_len if args.soak_minutes else 0,
              args.identity_tokens)
    return int(longest * (1 + ratio)) + int(out * (1 + ratio)) + args.k + 64


def serve_command(args, model: str, port: int, trace_dir: str | None = None,
                  memory: float | None = None) -> list[str]:
    """``vllm serve``'s command line; with ``--profile-steps`` vLLM's torch
    profiler set up to write a window's trace under ``trace_dir``; ``memory``:
    its ``--gpu-memory-utilization`` instead of the option's."""
    spec = {"method": "mtp", "num_speculative_tokens": args.k}
    attention = {}
    if args.attention_backend:
        spec["attention_backend"] = args.attention_backend
        attention["backend"] = args.attention_backend
    if args.force_sparse_prefill:
        attention["sparse_mla_force_mqa"] = True
    cmd = [args.python, "-m", "vllm.entrypoints.cli.main", "serve", model,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
           "--load-format", args.load_format, "--seed", "0",
           "--max-model-len", str(args.max_model_len or max_model_len(args)),
           "--max-num-seqs", str(args.max_num_seqs
                                  or max(args.concurrency + [args.identity_concurrency])),
           "--gpu-memory-utilization", f"{memory or args.gpu_memory_utilization:.4g}",
           "--kv-cache-dtype", args.kv_cache_dtype,
           "--speculative-config", json.dumps(spec), "--disable-uvicorn-access-log",
           # a drain, not vLLM's default abort: with 0 s its process manager kills the
           # engine core right after SIGTERM, racing the core's own exit (the plugin's
           # final count line lost, EngineDeadError lines in the API server's log)
           "--shutdown-timeout", str(args.server_shutdown_timeout)]
    if attention:
        cmd += ["--attention-config", json.dumps(attention)]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.kv_cache_gib:
        cmd += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))]
    if args.async_scheduling != "default":
        cmd += ["--async-scheduling" if args.async_scheduling == "on" else "--no-async-scheduling"]
    if args.profile_steps:
        cmd += ["--profiler-config", json.dumps(serve_diag.profiler_config(
            trace_dir or os.path.join(args.out, "trace"), args.profile_steps, args.profile_delay))]
    return cmd + list(args.serve_arg)


def sweep_points(args) -> list[dict]:
    """The measured points: per input length the concurrency sweep, then the
    Poisson rates (``None`` values: ``--rates auto``, filled from the first
    mode's results); each with its own seed (fresh prompts, the same in every
    mode) and prompt count."""
    points = []
    for length in ([] if args.no_sweep else args.input_len):
        for c in args.concurrency:
            points.append({"id": f"L{length}-c{c}", "input_len": length, "kind": "concurrency",
                           "value": c, "num_prompts": max(args.min_prompts, args.waves * c)})
        autos = 0
        for i, r in enumerate(args.rates or []):
            rate = None if r == "auto" else float(r)
            fraction = None
            if rate is None:
                fraction, autos = args.rate_fractions[autos], autos + 1
            points.append({"id": f"L{length}-r{i}", "input_len": length, "kind": "rate",
                           "value": rate, "fraction": fraction,
                           "num_prompts": (max(args.min_prompts, math.ceil(rate * args.rate_seconds))
                                           if rate is not None else None)})
    for i, p in enumerate(points):
        p["seed"] = args.seed + i
    return points


def bench_command(args, point: dict, port: int, tokenizer: str, result_dir: str,
                  filename: str, label: str) -> list[str]:
    """``vllm bench serve`` for one point (``point`` as :func:`sweep_points`
    makes it, with ``value`` and ``num_prompts`` set)."""
    if point["value"] is None or point["num_prompts"] is None:
        raise ValueError(f"point: {point['id']} has no rate yet (--rates auto)")
    cmd = [args.python, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
           "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
           "--model", SERVED_NAME, "--tokenizer", tokenizer, "--dataset-name", "random",
           "--random-input-len", str(point["input_len"]),
           "--random-output-len", str(point.get("output_len", args.output_len)),
           "--random-range-ratio", str(point.get("range_ratio", args.range_ratio)),
           "--num-prompts", str(point["num_prompts"]), "--seed", str(point["seed"]),
           "--temperature", "0", "--ignore-eos",
           "--percentile-metrics", ",".join(METRICS),
           "--metric-percentiles", ",".join(map(str, PERCENTILES)),
           "--save-result", "--save-detailed", "--result-dir", result_dir,
           "--result-filename", filename, "--label", label, "--disable-tqdm"]
    if point["kind"] == "concurrency":
        cmd += ["--max-concurrency", str(point["value"])]
    else:
        cmd += ["--request-rate", str(point["value"]), "--burstiness", "1"]
    return cmd


# ----------------------------------------------------------------------------- parsing

def parse_prometheus(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text exposition: ``{sample name: [(labels, value)]}``."""
    out: dict[str, list] = {}
    sample = re.compile(r'^([A-Za-z_:][\w:]*)(\{(.*)\})?\s+(\S+)')
    label = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = sample.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = dict(label.findall(m.group(3) or ""))
        out.setdefault(m.group(1), []).append((labels, value))
    return out


def _total(samples: dict, name: str) -> float | None:
    got = samples.get(name)
    return sum(v for _, v in got) if got else None


def engine_counters(samples: dict) -> dict:
    """The counters a point is judged by, summed over engines (and finish
    reasons): speculative decoding's (drafts, draft tokens, accepted tokens,
    accepted per draft position), engine steps (``iteration_tokens``
    observations), preemptions, finished requests, prompt / generated tokens."""
    per_pos: dict[str, float] = {}
    for labels, v in samples.get("vllm:spec_decode_num_accepted_tokens_per_pos_total", []):
        key = labels.get("position", "?")
        per_pos[key] = per_pos.get(key, 0.0) + v
    return {
        "spec_drafts": _total(samples, "vllm:spec_decode_num_drafts_total"),
        "spec_draft_tokens": _total(samples, "vllm:spec_decode_num_draft_tokens_total"),
        "spec_accepted_tokens": _total(samples, "vllm:spec_decode_num_accepted_tokens_total"),
        "spec_accepted_per_pos": dict(sorted(per_pos.items())),
        "engine_steps": _total(samples, "vllm:iteration_tokens_total_count"),
        "preemptions": _total(samples, "vllm:num_preemptions_total"),
        "requests_finished": _total(samples, "vllm:request_success_total"),
        "prompt_tokens": _total(samples, "vllm:prompt_tokens_total"),
        "generation_tokens": _total(samples, "vllm:generation_tokens_total"),
    }


def counters_growth(before: dict, after: dict) -> dict:
    """:func:`engine_counters` after minus before, with the acceptance rate
    (accepted / draft tokens) and length (1 + accepted / drafts)."""
    out = {}
    for k, a in after.items():
        b = before.get(k)
        if isinstance(a, dict):
            b = b or {}
            out[k] = {p: v - b.get(p, 0.0) for p, v in a.items()}
        else:
            out[k] = None if a is None or b is None else a - b
    drafts, tokens, accepted = out["spec_drafts"], out["spec_draft_tokens"], out["spec_accepted_tokens"]
    out["acceptance_rate"] = accepted / tokens if tokens else None
    out["acceptance_length"] = 1 + accepted / drafts if drafts else None
    return out


def shrink_client(result: dict) -> dict:
    """A client result without its per-request arrays; the errors kept as a
    count and the distinct messages (at most 5)."""
    small = {k: v for k, v in result.items() if not isinstance(v, list)}
    errors = [e for e in result.get("errors") or [] if e]
    small["error_count"] = len(errors)
    small["error_examples"] = sorted(set(errors))[:5]
    if "output_lens" in result:
        lens = result["output_lens"]
        small["output_len_min_max"] = [min(lens), max(lens)] if lens else None
    return small


def path_lines(text: str) -> list[dict]:
    """The plugin's step-count lines of a log (:func:`stats.parse_line`), each
    with the process tag vLLM put before it (``EngineCore_DP0`` ...)."""
    out = []
    for line in ANSI.sub("", text).splitlines():
        got = stats.parse_line(line)
        if got is None:
            continue
        tag = PROCESS_TAG.search(line[:line.find(stats.LINE)])
        got["process"] = tag.group(1) if tag else None
        out.append(got)
    return out


def counts_at(lines: list[dict], t: float) -> tuple[dict | None, bool]:
    """The counts of one process's lines (:func:`path_lines`) as they stood
    at wall time ``t``, and whether exactly: exact when a line counts every
    step up to ``t`` (its last step at or before ``t``, written after ``t``,
    or the final line), else the last line written by ``t``."""
    for line in lines:
        if line.get("as_of") is not None and line["as_of"] <= t and (line["t"] > t or line["final"]):
            return line, True
    written = [x for x in lines if x["t"] <= t]
    if written:
        return max(written, key=lambda x: x["t"]), False
    return None, not any(x.get("as_of") is not None and x["as_of"] <= t for x in lines)


def _counts_only(line: dict | None) -> dict:
    kinds = ("steps", "variable", "mixed", "topk")
    return {k: dict(line[k]) if line else {} for k in kinds}


def path_growth(lines: list[dict], t0: float, t1: float) -> dict | None:
    """Each process's per-path step counts between wall times ``t0`` and
    ``t1`` (``None`` without lines: a stock server), with whether both ends
    are exact (:func:`counts_at`); the first process's as the figures."""
    if not lines:
        return None
    by_pid: dict[int, list] = {}
    for line in lines:
        by_pid.setdefault(line["pid"], []).append(line)
    per = {}
    for pid, own in sorted(by_pid.items()):
        a, exact_a = counts_at(own, t0)
        b, exact_b = counts_at(own, t1)
        ca, cb = _counts_only(a), _counts_only(b)
        per[str(pid)] = {
            "process": own[0]["process"], "exact": exact_a and exact_b,
            **{k: {p: v - ca[k].get(p, 0) for p, v in cb[k].items()} for k in cb}}
    first = next(iter(per.values()))
    return {**first, "processes": len(per), "by_pid": per if len(per) > 1 else None}


def log_health(text: str, stop_at: int | None = None) -> dict:
    """Error-level and traceback lines of a server log, by process tag, before
    the stop was asked (character offset ``stop_at`` into ``text``) and
    during the shutdown."""
    def count(part: str) -> dict:
        by: dict[str, dict] = {}
        examples = []
        for line in ANSI.sub("", part).splitlines():
            bad = "Traceback (most recent call last)" in line or LEVEL.search(line)
            if not bad:
                continue
            tag = PROCESS_TAG.match(line.strip())
            key = tag.group(1) if tag else "main"
            kind = "traceback" if "Traceback" in line else "error"
            by.setdefault(key, {"error": 0, "traceback": 0})[kind] += 1
            if len(examples) < 5:
                examples.append(line.strip()[:300])
        total = sum(v["error"] + v["traceback"] for v in by.values())
        return {"lines": total, "by_process": by, "examples": examples}

    cut = len(text) if stop_at is None else stop_at
    return {"serving": count(text[:cut]), "shutdown": count(text[cut:])}


def plugin_path_log(text: str) -> list[str]:
    """The plugin's own lines other than the step counts (its decode-path
    choice among them), with their process tags, distinct, in order."""
    seen, out = set(), []
    for line in ANSI.sub("", text).splitlines():
        at = line.find("vllm-dsa-varlen: ")
        if at < 0 or stats.LINE in line:
            continue
        tag = PROCESS_TAG.search(line[:at])
        item = f"[{tag.group(1) if tag else 'main'}] {line[at:].strip()}"
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out[:40]


# ----------------------------------------------------------------------------- identity

def model_vocab(cfg: dict) -> int:
    """The vocabulary the served model's prompts draw words from (its config's)."""
    return cfg.get("vocab_size", 4096)


def identity_prompts(n: int, vocab_size: int, longest: int, seed: int) -> list[str]:
    """``n`` fixed prompts (words of the tokenizer, :func:`serve_model.word`),
    their lengths cycling through :data:`IDENTITY_LENGTHS` up to ``longest``."""
    import random

    lengths = [min(x, longest) for x in IDENTITY_LENGTHS]
    out = []
    for i in range(n):
        rng = random.Random(seed * 1000003 + i)
        out.append(" ".join(serve_model.word(rng.randrange(3, vocab_size))
                            for _ in range(lengths[i % len(lengths)])))
    return out


def identity_groups(n: int, concurrency: int) -> list[list[int]]:
    """Which requests go together: the first quarter one at a time, the rest
    in concurrent groups of ``concurrency``."""
    alone = n // 4
    groups = [[i] for i in range(alone)]
    rest = list(range(alone, n))
    groups += [rest[i:i + concurrency] for i in range(0, len(rest), concurrency)]
    return groups


def _post(port: int, path: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def completion_record(response: dict) -> dict:
    """Text, tokens and top logprobs of a /v1/completions response's choice."""
    choice = response["choices"][0]
    lp = choice.get("logprobs") or {}
    return {"text": choice["text"], "tokens": lp.get("tokens"),
            "top_logprobs": lp.get("top_logprobs"), "finish_reason": choice.get("finish_reason")}


def run_identity(port: int, prompts: list[str], groups: list[list[int]], max_tokens: int,
                 timeout: float) -> list[dict]:
    def one(i):
        body = {"model": SERVED_NAME, "prompt": prompts[i], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "logprobs": 2}
        try:
            return completion_record(_post(port, "/v1/completions", body, timeout))
        except Exception as exc:  # noqa: BLE001 - a failed request is a finding
            return {"error": f"{type(exc).__name__}: {exc}"}

    out: list = [None] * len(prompts)
    with ThreadPoolExecutor(max_workers=max(len(g) for g in groups)) as pool:
        for g in groups:
            for i, rec in zip(g, pool.map(one, g)):
                out[i] = rec
    return out


def _top2(rec: dict, pos: int):
    tops = rec.get("top_logprobs") or []
    if pos < len(tops) and tops[pos]:
        return sorted(tops[pos].items(), key=lambda kv: -kv[1])[:2]
    return None


def logprob_gap(a: dict, b: dict) -> dict | None:
    """Where two completions' top logprobs first differ (a token whose
    entries differ in value or in which tokens they name) and the largest
    difference of a value both name; ``None`` when equal throughout."""
    ta, tb = a.get("top_logprobs") or [], b.get("top_logprobs") or []
    first, most = None, 0.0
    for j in range(max(len(ta), len(tb))):
        x = ta[j] if j < len(ta) else None
        y = tb[j] if j < len(tb) else None
        if x == y:
            continue
        first = j if first is None else first
        for k in set(x or {}) & set(y or {}):
            most = max(most, abs(x[k] - y[k]))
    return None if first is None else {"token": first, "most": most}


def compare_identity(ref: list[dict], other: list[dict]) -> dict:
    """Request by request: identical texts, or where they part (the first
    differing token, from the logprobs' tokens or else the words) with both
    sides' top-2 logprobs there and whether ``ref``'s two tie exactly (then
    any rounding picks either); failed requests counted apart; how many
    completed requests carry bitwise-equal top logprobs throughout, and for
    each other one where its logprobs part and by how much at most
    (:func:`logprob_gap`: which prompts, by length, move it)."""
    if len(ref) != len(other):
        raise ValueError(f"other: {len(other)} results against {len(ref)}")
    same, failed, diverged, apart = 0, 0, [], []
    for i, (a, b) in enumerate(zip(ref, other)):
        if "error" in a or "error" in b:
            failed += 1
            continue
        gap = logprob_gap(a, b)
        if gap is not None:
            apart.append({"request": i, **gap})
        if a["text"] == b["text"]:
            same += 1
            continue
        ta, tb = a.get("tokens") or a["text"].split(), b.get("tokens") or b["text"].split()
        pos = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        top = _top2(a, pos)
        diverged.append({"request": i, "position": pos, "ref_top2": top,
                         "other_top2": _top2(b, pos),
                         "at_ref_tie": bool(top) and len(top) == 2 and top[0][1] == top[1][1]})
    return {"requests": len(ref), "identical": same, "failed": failed, "diverged": diverged,
            "logprobs_equal": len(ref) - failed - len(apart), "logprobs_apart": apart,
            "all_identical": same == len(ref)}


# ----------------------------------------------------------------------------- the server

class Server:
    """One ``vllm serve`` process: started, waited for, stopped."""

    def __init__(self, cmd: list[str], env: dict, log: str):
        self.cmd, self.env, self.log = cmd, env, log
        self.proc = None
        self.stop_offset = None

    def start(self) -> None:
        self._logf = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._logf,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, port: int, timeout: float) -> str | None:
        """``None`` once ``/v1/models`` answers, else why not."""
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                return f"exited with {self.proc.returncode} before it was ready"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return None
            except (urllib.error.URLError, OSError, http.client.HTTPException):
                pass
            time.sleep(2)
        return f"not ready after {timeout:.0f} s"

    def stop(self, timeout: float, drain: float = 0.0) -> dict:
        """SIGTERM to the API server (it stops its engine core), SIGKILL to
        the process group past ``timeout``.  ``drain``: the server's
        ``--shutdown-timeout``; an engine core that has not logged the signal
        2 s before vLLM would kill it gets SIGABRT instead, so that its
        fault handler (``PYTHONFAULTHANDLER``, :func:`server_env`) writes
        every thread's stack to the log: where its main thread was stuck."""
        if self.proc is None:
            return {"how": "never started"}
        self._logf.flush()
        self.stop_offset = os.path.getsize(self.log)
        t0 = time.time()
        how, info = "exited by itself", {}
        if self.proc.poll() is None:
            states = {str(pid): serve_diag.signal_state(pid) for pid in self.core_pids()}
            if states:
                info["cores_before_stop"] = states
            self.proc.send_signal(signal.SIGTERM)
            how = "SIGTERM"
            try:
                if drain > 0:
                    try:
                        self.proc.wait(max(0.5, drain - 2.0))
                    except subprocess.TimeoutExpired:
                        stuck, states = self._abort_deaf_cores()
                        if stuck:
                            info["cores_aborted"] = stuck
                            info["cores_at_abort"] = states
                self.proc.wait(max(0.1, timeout - (time.time() - t0)))
            except subprocess.TimeoutExpired:
                how = "SIGKILL (process group) after SIGTERM timed out"
        try:  # whatever of the group is left (an engine core its parent did not reap)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self._logf.close()
        return {"how": how, "rc": self.proc.returncode, "at": t0,
                "seconds": round(time.time() - t0, 1), **info}

    def _log_text(self) -> str:
        self._logf.flush()
        return "".join(log_parts(self.log))

    def core_pids(self, text: str | None = None) -> list[int]:
        """The engine cores this server's log (or ``text`` read from it) names."""
        text = self._log_text() if text is None else text
        return sorted({int(p) for p in CORE_PID_RE.findall(text)})

    def _abort_deaf_cores(self) -> tuple[list[int], dict]:
        """SIGABRT to each engine core of this server's log still alive when
        none has logged the stop signal since :meth:`stop` began; the pids,
        and how each stood towards SIGTERM just before
        (:func:`serve_diag.signal_state`: pending for the process means no
        thread took it)."""
        self._logf.flush()
        before, after = log_parts(self.log, self.stop_offset)
        if CORE_HEARD_RE.search(after):
            return [], {}
        aborted, states = [], {}
        for pid in self.core_pids(before + after):
            state = states[str(pid)] = serve_diag.signal_state(pid)
            if state is None or state["main_state"].startswith("Z"):
                continue  # exited: nothing left to hear the signal or write stacks
            try:
                os.kill(pid, signal.SIGABRT)
                aborted.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        return aborted, states


def log_parts(path: str, at: int | None = None) -> tuple[str, str]:
    """A server log's text before and after byte offset ``at`` (``None``:
    all of it before).  The offset is a file size: vLLM's banner has
    multi-byte characters, so it is applied to the bytes, not the text."""
    with open(path, "rb") as f:
        raw = f.read()
    cut = len(raw) if at is None else at
    return (raw[:cut].decode("utf-8", errors="replace"),
            raw[cut:].decode("utf-8", errors="replace"))


# An engine core's log tag (vLLM: "(EngineCore pid=N)", "(EngineCore_DP0 pid=N)") and
# its line on receiving a stop signal (vLLM 0.27.1 and 0.34: "[shutdown] EngineCore: trigger
# received signal=SIGTERM").
CORE_PID_RE = re.compile(r"\(EngineCore\w* pid=(\d+)\)")
CORE_HEARD_RE = re.compile(r"EngineCore\w*: trigger received signal")


def _get(port: int, path: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return r.read().decode(errors="replace")


def scrape(port: int) -> dict:
    try:
        return engine_counters(parse_prometheus(_get(port, "/metrics")))
    except Exception as exc:  # noqa: BLE001 - a missing scrape is recorded, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}


# ----------------------------------------------------------------------------- soak

def gpu_memory_mib(index: int) -> float | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-i", str(index), "--query-gpu=memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10).stdout
        return float(out.strip().splitlines()[0])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None


def memory_flatness(samples: list[tuple[float, float | None]], warmup_fraction: float,
                    tolerance_mib: float) -> dict:
    """GPU memory after the first ``warmup_fraction`` of the samples: its
    range, and flat when that range is at most ``tolerance_mib``."""
    vals = [v for _, v in samples if v is not None]
    if not vals:
        return {"samples": len(samples), "flat": None, "range_mib": None}
    after = vals[int(len(vals) * warmup_fraction):] or vals[-1:]
    spread = max(after) - min(after)
    return {"samples": len(vals), "first_mib": vals[0], "last_mib": vals[-1],
            "after_warmup_min_mib": min(after), "after_warmup_max_mib": max(after),
            "range_mib": spread, "flat": spread <= tolerance_mib}


# What the structured-output requests are held to: words of the serving
# tokenizer (:func:`serve_model.word`) spelled from the first half of the
# alphabet, so about half the vocabulary is allowed at every position and
# most drafts of a dummy-weight drafter break off early.
STRUCTURED_REGEX = "[a-m]+"


def structured_completion(port: int, prompt: str, max_tokens: int, timeout: float) -> dict:
    """One greedy completion constrained to :data:`STRUCTURED_REGEX`: its word
    count, finish reason and whether every word of the text keeps to the regex
    (an error instead where the request failed)."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "structured_outputs": {"regex": STRUCTURED_REGEX}}
    try:
        rec = completion_record(_post(port, "/v1/completions", body, timeout))
    except Exception as exc:  # noqa: BLE001 - a failed request is a finding
        return {"error": f"{type(exc).__name__}: {exc}"}
    words = rec["text"].split()
    return {"words": len(words), "finish_reason": rec["finish_reason"],
            "kept_to_regex": bool(words) and all(re.fullmatch(STRUCTURED_REGEX, w) for w in words)}


def structured_summary(records: list[dict]) -> dict:
    """The structured-output requests of a soak: sent, failed, and those whose
    text broke the regex."""
    failed = [r for r in records if "error" in r]
    return {"sent": len(records), "failed": len(failed),
            "broke_regex": sum(1 for r in records if "error" not in r and not r["kept_to_regex"]),
            "words": sum(r.get("words", 0) for r in records),
            "errors": [r["error"] for r in failed][:3]}


def structured_clients(port: int, clients: int, vocab: int, seed: int, stop: threading.Event,
                       records: list, start_at: float = 0.0,
                       until: float = math.inf) -> list[threading.Thread]:
    """``clients`` threads, each sending regex-constrained completions
    (:func:`structured_completion`) one after another from ``start_at`` until
    ``until`` or ``stop``, their records appended to ``records``; started."""
    def client(prompts: list[str]):
        if stop.wait(max(0.0, start_at - time.time())):
            return
        i = 0
        while not stop.is_set() and time.time() < until:
            records.append(structured_completion(port, prompts[i % len(prompts)], 128, 300))
            i += 1

    threads = [threading.Thread(target=client, daemon=True,
                                args=(identity_prompts(64, vocab, 512, seed + 101 + c),))
               for c in range(clients)]
    for t in threads:
        t.start()
    return threads


def disconnect_mid_stream(port: int, prompt: str, chunks: int, timeout: float) -> dict:
    """A streaming completion the client closes after ``chunks`` chunks."""
    body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": 4096,
                       "temperature": 0, "ignore_eos": True, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    got = 0
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        while got < chunks:
            line = resp.fp.readline()
            if not line:
                break
            if line.startswith(b"data:"):
                got += 1
        return {"status": resp.status, "chunks_read": got}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}", "chunks_read": got}
    finally:
        conn.close()


# ----------------------------------------------------------------------------- output

def finite(obj):
    """``obj`` with every non-finite float made ``None`` (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(finite(obj), f, indent=1, allow_nan=False)
    os.replace(tmp, path)


def _ratio(a, b):
    return a / b if a and b else None


# Each mode against stock: the client's figure, and whether it is a time (then
# stock's over the mode's, so that > 1 is faster) or a rate (the mode's over stock's).
RATIOS = {"x_tpot": ("mean_tpot_ms", True), "x_itl_p99": ("p99_itl_ms", True),
          "x_tok_s": ("output_throughput", False)}


def against_stock(stock: dict, other: dict, name: str) -> float | None:
    """:data:`RATIOS`' ``name`` of client results ``other`` against ``stock``'s."""
    key, time_like = RATIOS[name]
    a, b = stock.get(key), other.get(key)
    return _ratio(a, b) if time_like else _ratio(b, a)


# The step paths the project's kernel runs (stats.PATHS): its varlen steps, and the
# variable steps stock would split to the prefill path, run as one varlen decode.
OWN_PATHS = ("varlen", "split_avoided")


def _own(counts: dict | None) -> int:
    return sum((counts or {}).get(p, 0) for p in OWN_PATHS)


def table_rows(result: dict) -> list[dict]:
    """One row per point and mode: the client's figures, the acceptance
    length, the plugin's step counts (the steps its own kernel ran:
    :data:`OWN_PATHS`; of the variable steps, its own and all), and against
    stock: TPOT and p99 ITL as stock's over the mode's, tokens/s the other way."""
    rows = []
    for point in result["points"]:
        runs = point.get("runs", {})
        base = (runs.get("stock") or {}).get("client") or {}
        for mode, run in runs.items():
            c = run.get("client") or {}
            paths = run.get("paths") or {}
            row = {"point": point["id"], "mode": mode, "failed": c.get("failed"),
                   "output_tok_s": c.get("output_throughput"),
                   "acceptance_length": (run.get("engine") or {}).get("acceptance_length"),
                   "own_steps": _own(paths.get("steps")) if paths else None,
                   "variable_own": _own(paths.get("variable")) if paths else None,
                   "variable_steps": sum((paths.get("variable") or {}).values()) if paths else None,
                   "skipped": run.get("skipped")}
            for m in ("ttft", "tpot", "itl"):
                for stat in ("mean", "p50", "p99"):
                    key = f"{'median' if stat == 'p50' else stat}_{m}_ms"
                    row[f"{m}_{stat}"] = c.get(key, c.get(f"{stat}_{m}_ms"))
            per_round = (point.get("x_rounds") or {}).get(mode)
            if per_round:  # --rounds: the median of the same-round ratios, and their range
                row["rounds"] = len(point["rounds"])
                for name, got in per_round.items():
                    row[name] = got["median"]
                    row[name + "_range"] = [got["min"], got["max"]]
            elif mode != "stock" and base:
                row.update((name, against_stock(base, c, name)) for name in RATIOS)
            rows.append(row)
    return rows


def render_table(rows: list[dict]) -> str:
    def f(v, nd=2):
        return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))

    def x(r, name):
        got = f(r.get(name), 3)
        lo_hi = r.get(name + "_range")
        return got if not lo_hi else f"{got} [{f(lo_hi[0], 3)}, {f(lo_hi[1], 3)}]"

    head = ("| point | mode | TTFT mean/p50/p99 | TPOT mean/p50/p99 | ITL mean/p50/p99 | tok/s "
            "| acc. len | own-kernel steps (variable: own / all) | x TPOT | x p99 ITL | x tok/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['point']} | {r['mode']} | skipped: {r['skipped']} |")
            continue
        trio = [" / ".join(f(r[f"{m}_{s}"]) for s in ("mean", "p50", "p99")) for m in ("ttft", "tpot", "itl")]
        lines.append(f"| {r['point']} | {r['mode']} | {trio[0]} | {trio[1]} | {trio[2]} | "
                     f"{f(r['output_tok_s'], 1)} | {f(r['acceptance_length'])} | "
                     f"{f(r['own_steps'])} ({f(r['variable_own'])} / {f(r['variable_steps'])}) | "
                     f"{x(r, 'x_tpot')} | "
                     f"{x(r, 'x_itl_p99')} | {x(r, 'x_tok_s')} |")
    if any(r.get("rounds") for r in rows):
        lines.append("(--rounds: each mode's figures from its round of median TPOT; x: the median "
                     "of the same-round ratios [least, greatest])")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the run

class Budget:
    """``--time-limit``: a deadline for the whole run, shared out per server.

    The first server starts cold (every lazily compiled kernel built on the
    way up), a later one with the caches it filled, so a start may take what
    the later servers' warm starts (``--start-reserve`` each) leave, and the
    measurements share what is left once it is up."""

    def __init__(self, limit: float | None, start_reserve: float = 0.0):
        self.t0 = time.time()
        self.end = None if limit is None else self.t0 + limit
        self.start_reserve = start_reserve

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.time()

    def start_by(self, servers_left: int) -> float:
        """The latest the next server may come up."""
        if self.end is None:
            return float("inf")
        return self.end - (servers_left - 1) * self.start_reserve

    def share(self, servers_left: int, reserve: float, optional: int = 0,
              least: float = 0.0) -> float:
        """The deadline of a server's measurements once it is up: an equal
        share of what is left after the later servers' starts; where that is
        under ``least`` seconds, shared without the last ``optional`` servers
        (the A/A control, the variants: the comparison comes first)."""
        if self.end is None:
            return float("inf")

        def per(n: int) -> float:
            spare = self.left() - reserve * n - self.start_reserve * (n - 1)
            return max(0.0, spare / n)

        got = per(servers_left)
        if got < least and 0 < optional < servers_left:
            got = per(servers_left - optional)
        return time.time() + got

    def fits(self, reserve: float, least: float) -> bool:
        """Whether a server started now can come up (``start_reserve``),
        measure ``least`` seconds and stop (``reserve``) in the time left."""
        return self.left() >= self.start_reserve + least + reserve


# What a stop takes past the server's own drain (--server-shutdown-timeout): the
# API server's exit after its engine core's.
STOP_SLACK_S = 5.0


def stop_reserve(args) -> float:
    """The seconds a budget keeps for stopping one server: its drain and
    :data:`STOP_SLACK_S`, at most ``--stop-timeout`` (when a server is
    killed): a reserve of half the kill timeout crowded out the first
    server's point."""
    return min(float(args.stop_timeout), args.server_shutdown_timeout + STOP_SLACK_S)


def _model_folder(args) -> tuple[str, dict]:
    if args.model:
        cfg_path = os.path.join(args.model, "config.json")
        cfg = json.load(open(cfg_path)) if os.path.exists(cfg_path) else {}
        return args.model, cfg
    cfg = serve_model.model_config(args.config, layers=args.layers, mlp=args.mlp,
                                   weights=args.weights)
    path = serve_model.write_model(os.path.join(args.out, f"model-{args.config}"), cfg)
    return path, cfg


class BenchClient:
    """``vllm bench serve`` in one worker process for the whole run
    (``benchmarks/bench_client.py``): vLLM imported once, while the first
    server starts, instead of before every run; restarted after a run
    that overran its time or a worker that died."""

    WORKER = os.path.join(_HERE, "bench_client.py")

    def __init__(self, python: str, log: str):
        self.python, self.log = python, log
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self._logf = None

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.stop()
        self._logf = open(self.log, "a")
        self.proc = subprocess.Popen([self.python, "-u", self.WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._logf, text=True,
                                     start_new_session=True)
        self.ready = False

    def _reply(self, deadline: float) -> dict | None:
        """The worker's next line, ``None`` past ``deadline``."""
        while True:
            left = deadline - time.time()
            if left <= 0:
                return None
            if select.select([self.proc.stdout], [], [], min(left, 3600.0))[0]:
                break
        line = self.proc.stdout.readline()
        return json.loads(line) if line.strip() else {"error": "the worker exited"}

    def run(self, cmd: list[str], log: str, timeout: float) -> int | str:
        """``cmd`` (:func:`bench_command`: ``python -m vllm.entrypoints.cli.main
        bench serve ...``) run by the worker, its output in ``log``; its exit
        code, ``"timeout"``, or why the worker could not run it."""
        deadline = time.time() + max(1.0, timeout)
        self.start()
        if not self.ready:
            got = self._reply(deadline)
            if got is None or "error" in got:
                self.stop()
                why = "timeout" if got is None else f"client worker: {got['error']}"
                with open(log, "w") as f:
                    f.write(f"{why} (worker log: {os.path.basename(self.log)})\n")
                return why
            self.ready = True
        self.proc.stdin.write(json.dumps({"argv": cmd[3:], "log": log}) + "\n")
        self.proc.stdin.flush()
        got = self._reply(deadline)
        if got is None or "rc" not in got:
            self.stop()
            return "timeout" if got is None else f"client worker: {got.get('error')}"
        return got["rc"]

    def stop(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass
            self.proc = None
        if self._logf is not None:
            self._logf.close()
            self._logf = None


# The run's shared client (--client shared), set by main().
_bench_client: BenchClient | None = None


def run_client(args, point: dict, port: int, tokenizer: str, mode: str, timeout: float) -> dict:
    """One ``vllm bench serve`` run; its result file shrunk (:func:`shrink_client`)."""
    raw_dir = os.path.join(args.out, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    name = f"client-{mode}-{point['id']}.json"
    cmd = bench_command(args, point, port, tokenizer, raw_dir, name, mode)
    log = os.path.join(args.out, f"client-{mode}-{point['id']}.log")
    t0 = time.time()
    if _bench_client is not None:
        rc = _bench_client.run(cmd, log, timeout)
    else:
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=max(1.0, timeout)).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
    out = {"rc": rc, "t0": t0, "t1": time.time(), "wall_s": round(time.time() - t0, 1),
           "log": os.path.basename(log)}
    raw = os.path.join(raw_dir, name)
    if os.path.exists(raw):
        with open(raw) as f:
            client = shrink_client(json.load(f))
        write_json(os.path.join(args.out, name), client)
        out["client"] = client
        if not args.keep_detailed:
            os.remove(raw)
    return out


def measure_point(args, point: dict, port: int, tokenizer: str, mode: str,
                  timeout: float, vocab: int, core_pids: list[int] | None = None) -> dict:
    """A measured point: the client's run, /metrics growth over it and, with
    ``--py-spy``, each engine core's (``core_pids``) stacks over it; with
    ``--structured``, that many clients of regex-constrained completions
    (prompts of the model's ``vocab``) beside the client's for as long as it
    runs (not the soak's point: it runs its own)."""
    before = scrape(port)
    sampler = None
    if args.py_spy and core_pids:
        sampler = serve_diag.StackSampler(args.py_spy, args.out, args.py_spy_rate)
        sampler.start(core_pids, f"{mode}-{point['id']}")
    stop, records, threads = threading.Event(), [], []
    if args.structured and point["id"] != "soak":
        threads = structured_clients(port, args.structured, vocab, point["seed"], stop, records)
    try:
        run = run_client(args, point, port, tokenizer, mode, timeout)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=310)
        if sampler is not None:
            stacks = sampler.finish()
    if sampler is not None:
        run["stacks"] = stacks
    if threads:
        run["structured"] = dict(structured_summary(records), clients=len(threads))
    after = scrape(port)
    run["engine"] = (counters_growth(before, after)
                     if "error" not in before and "error" not in after else
                     {"error": before.get("error") or after.get("error")})
    run["window"] = [run["t0"], run["t1"]]
    return run


def fill_rates(points: list[dict], args) -> None:
    """``--rates auto``: each rate point's rate from the first mode's request
    throughput at the highest concurrency of its input length."""
    by_id = {p["id"]: p for p in points}
    for p in points:
        if p["kind"] != "rate" or p["value"] is not None:
            continue
        top = by_id.get(f"L{p['input_len']}-c{max(args.concurrency)}") or {}
        client = ((top.get("runs") or {}).get(args.modes[0]) or {}).get("client") or {}
        knee = client.get("request_throughput")
        if knee:
            p["value"] = round(knee * p["fraction"], 3)
            p["num_prompts"] = max(args.min_prompts, math.ceil(p["value"] * args.rate_seconds))


def first_gpu() -> int:
    """The index nvidia-smi gives the GPU the server sees first."""
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def run_soak(args, port: int, tokenizer: str, mode: str, vocab: int) -> dict:
    """Poisson load for ``--soak-minutes`` (variable output lengths, long
    prompts), ``--soak-disconnects`` streams closed mid-way spread over it,
    ``--soak-structured`` clients of regex-constrained completions through
    its middle (10 to 80 % of the span),
    GPU memory sampled every ``--soak-sample-s``."""
    n = math.ceil(args.soak_rate * 60 * args.soak_minutes)
    point = {"id": "soak", "input_len": args.soak_input_len, "output_len": args.soak_output_len,
             "range_ratio": args.soak_range_ratio, "kind": "rate", "value": args.soak_rate,
             "num_prompts": n, "seed": args.seed + 7919}
    gpu, span, start = first_gpu(), 60 * args.soak_minutes, time.time()
    samples: list = [(start, gpu_memory_mib(gpu))]
    disconnects: list = []
    stop = threading.Event()

    def sample():
        while not stop.wait(args.soak_sample_s):
            samples.append((time.time(), gpu_memory_mib(gpu)))

    def disconnect():
        prompts = identity_prompts(args.soak_disconnects, vocab, args.soak_input_len,
                                   args.seed + 31)
        for i, prompt in enumerate(prompts):
            at = start + span * (i + 1) / (args.soak_disconnects + 1)
            if stop.wait(max(0.0, at - time.time())):
                return
            disconnects.append(disconnect_mid_stream(port, prompt, 3, 120))

    structured: list = []
    threads = [threading.Thread(target=sample, daemon=True),
               threading.Thread(target=disconnect, daemon=True)]
    for t in threads:
        t.start()
    # Through the middle of the arrivals only: the soak's window opens and
    # closes on its own traffic, so the path counts stay exact at both ends.
    threads += structured_clients(port, args.soak_structured, vocab, args.seed, stop, structured,
                                  start + 0.1 * span, start + 0.8 * span)
    try:
        run = measure_point(args, point, port, tokenizer, mode, 3 * span + 300, vocab)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    samples.append((time.time(), gpu_memory_mib(gpu)))
    run["gpu_memory"] = memory_flatness(samples, 0.2, args.soak_memory_tolerance_mib)
    run["gpu_memory_samples"] = samples
    run["disconnects"] = disconnects
    run["structured"] = structured_summary(structured)
    run["point"] = point
    return run


def identity_longest(args) -> int:
    """The identity prompts' longest length in words: what the model's
    length leaves after the new tokens (a quarter of it for a checkpoint of
    one's own, whose tokenizer may split a word)."""
    room = max(16, (args.max_model_len or max_model_len(args)) - args.identity_tokens - 64)
    return room if not args.model else max(16, room // 4)


class Live:
    """One mode's server, up: what measuring it needs."""

    def __init__(self, mode: str, server: "Server", info: dict, port: int, trace_dir: str):
        self.mode, self.server, self.info, self.port, self.trace_dir = \
            mode, server, info, port, trace_dir
        self.per_point_s = 0.0  # the longest run so far: what the next one may take
        self.seconds_at: dict[int, float] = {}  # prompts -> seconds of the latest such run
        self.started_at = time.time()  # when its process was launched


def start_server(args, mode: str, model: str, result: dict, ready_by: float,
                 memory: float | None = None) -> Live:
    """``vllm serve`` for ``mode`` started and waited for until ``ready_by``
    (``memory``: its ``--gpu-memory-utilization`` instead of the option's);
    its facts in ``result["servers"][mode]`` (``failed``: why it is not up)."""
    return await_ready(args, launch_server(args, mode, model, result, memory), ready_by)


def launch_server(args, mode: str, model: str, result: dict,
                  memory: float | None = None) -> Live:
    """``vllm serve`` for ``mode`` started, not waited for (:func:`await_ready`)."""
    port = free_port()
    trace_dir = os.path.join(args.out, f"trace-{mode}")
    cmd = serve_command(args, model, port, trace_dir, memory)
    env_extra = dict(kv.split("=", 1) for kv in args.env)
    env = server_env(mode, dict(os.environ), env_extra, args.variants)
    log = os.path.join(args.out, f"server-{mode}.log")
    info = {"cmd": cmd, "env": {k: env[k] for k in sorted(set(env_extra) | {MODE_ENV}
                                                         | set(args.variants.get(mode, {})))},
            "dropped_env": [k for k in DROPPED_ENV if k in os.environ], "port": port,
            "log": os.path.basename(log)}
    result["servers"][mode] = info
    server = Server(cmd, env, log)
    live = Live(mode, server, info, port, trace_dir)
    server.start()
    return live


def await_ready(args, live: Live, ready_by: float) -> Live:
    """``live``'s server waited for until ``ready_by``: ``startup_s`` and
    vLLM's version, or ``failed`` and why; a wait interrupted stops it."""
    info, server, port = live.info, live.server, live.port
    try:
        why = server.wait_ready(port, min(args.server_timeout, max(1.0, ready_by - time.time())))
    except BaseException:  # interrupted while it comes up: not left running
        info["stop"] = server.stop(args.stop_timeout)
        raise
    info["startup_s"] = round(time.time() - live.started_at, 1)
    if why:
        info["failed"] = why
        print(f"[{live.mode}] server {why} (log {server.log})", flush=True)
    else:
        try:
            info["vllm_version"] = json.loads(_get(port, "/version")).get("version")
        except Exception:  # noqa: BLE001
            info["vllm_version"] = None
        info["ready_at"] = time.time()
        print(f"[{live.mode}] ready in {info['startup_s']} s on port {port}", flush=True)
    return live


def warm_up(args, live: Live, model: str, cfg: dict, identity: dict, deadline: float) -> None:
    """The unmeasured warm-up, then the greedy identity requests (short, and
    what the sweep must not crowd out), each mode's records into ``identity``."""
    info, mode = live.info, live.mode
    warm = {"id": "warmup", "input_len": args.input_len[0], "kind": "concurrency",
            "value": max(args.concurrency), "num_prompts": args.warmup_prompts,
            "seed": args.seed + 104729}
    if args.warmup_prompts:
        w = run_client(args, warm, live.port, model, mode, max(1.0, deadline - time.time()))
        info["warmup"] = {k: w[k] for k in ("rc", "wall_s")}
        live.per_point_s = w["wall_s"]
        live.seconds_at[warm["num_prompts"]] = w["wall_s"]
    # no warm-up: a minute for the identity pass (a warm-up's time, however short, is known)
    guess = live.per_point_s if args.warmup_prompts else 60.0
    if args.identity and time.time() + args.gap + guess < deadline:
        time.sleep(args.gap)
        prompts = identity_prompts(args.identity, model_vocab(cfg),
                                   identity_longest(args), args.seed)
        groups = identity_groups(args.identity, args.identity_concurrency)
        t1 = time.time()
        recs = run_identity(live.port, prompts, groups, args.identity_tokens,
                            min(1800.0, max(30.0, deadline - time.time())))
        write_json(os.path.join(args.out, f"identity-{mode}.json"), recs)
        info["identity"] = {"requests": len(recs), "failed": sum("error" in r for r in recs),
                            "window": [t1, time.time()]}
        identity[mode] = recs
    elif args.identity:
        info["identity"] = {"skipped": "time limit"}


def measure_on(args, live: Live, point: dict, model: str, deadline: float,
               vocab: int) -> dict:
    """One point on ``live``'s server: with cached prompts a run of the same
    prompts before (unmeasured), an idle spell of ``--gap`` (the point's start
    in the log), the measured run; skipped where it would pass ``deadline``."""
    if point["value"] is None:
        return {"skipped": "no rate (the first mode measured no throughput)"}
    if time.time() + run_cost(args, live, point) > deadline:
        return {"skipped": "time limit"}
    if args.prompts == "cached":
        time.sleep(args.gap)
        run_client(args, dict(point, id=point["id"] + "-prime"), live.port, model, live.mode,
                   deadline - time.time())
    time.sleep(args.gap)
    run = measure_point(args, point, live.port, model, live.mode, deadline - time.time(), vocab,
                        live.server.core_pids())
    live.per_point_s = max(live.per_point_s, run["wall_s"])
    if point.get("num_prompts"):
        live.seconds_at[point["num_prompts"]] = run["wall_s"]
    c, st = run.get("client") or {}, run.get("structured")
    print(f"[{live.mode}] {point['id']}: rc {run['rc']}, {run['wall_s']} s, TPOT "
          f"{c.get('mean_tpot_ms')} ms, failed {c.get('failed')}"
          + (f"; structured {st['sent']} sent, {st['failed']} failed, {st['broke_regex']} broke "
             "the regex" if st else ""), flush=True)
    return run


def expected_s(live: Live, point: dict) -> float:
    """Seconds a run of ``point`` may take on ``live``'s server: the latest
    run with the most prompts up to this point's (else the fewest) scaled by
    the prompt count, since a sweep's later points carry more prompts at a
    similar rate a prompt (c64 twice c32's); never less than the longest run
    so far."""
    n = point.get("num_prompts") or 0
    if not n or not live.seconds_at:
        return live.per_point_s
    below = [k for k in live.seconds_at if k <= n]
    k = max(below) if below else min(live.seconds_at)
    return max(live.per_point_s, live.seconds_at[k] * n / k)


def run_cost(args, live: Live, point: dict) -> float:
    """What measuring ``point`` on ``live`` takes: the idle spell and the run,
    twice with cached prompts (the unmeasured run before)."""
    return (expected_s(live, point) + args.gap) * (2 if args.prompts == "cached" else 1)


def measure_side_by_side(args, order: list[Live], point: dict, model: str, deadline: float,
                         vocab: int) -> dict:
    """One round's runs of ``point``, a server after another in ``order``;
    none where the time left does not hold every server's run (a lone run
    has no ratio, and its minutes are the later points' loss)."""
    if time.time() + sum(run_cost(args, live, point) for live in order) > deadline:
        return {live.mode: {"skipped": "time limit"} for live in order}
    return {live.mode: measure_on(args, live, point, model, deadline, vocab) for live in order}


def finish_server(args, live: Live, points: list[dict], save) -> None:
    """Stop ``live``'s server; from its log: health, sync sites, the plugin's
    lines, and each of its runs' per-path step counts (every round's)."""
    info, mode, server = live.info, live.mode, live.server
    info["stop"] = server.stop(args.stop_timeout, args.server_shutdown_timeout)
    serving, shutdown = log_parts(server.log, server.stop_offset)
    text = serving + shutdown
    info["health"] = log_health(text, len(serving))
    info["sync_sites"] = serve_diag.sync_sites(serving)
    info["plugin_log"] = plugin_path_log(text)
    lines = path_lines(text)
    info["path_lines"] = len(lines)
    info["final_path_line"] = any(x["final"] for x in lines)
    for point in points:
        runs = [(point.get("runs") or {}).get(mode)]
        runs += [r.get(mode) for r in point.get("rounds", [])]
        for run in runs:
            if run and "window" in run:
                run["paths"] = path_growth(lines, *run["window"])
    soak = info.get("soak") or {}
    if "window" in soak:
        soak["paths"] = path_growth(lines, *soak["window"])
        soak["consistency"] = soak_consistency(soak, args.k)
        print(f"[{mode}] soak: {soak_line(soak, args.async_scheduling)}", flush=True)
    save()


def soak_line(soak: dict, async_scheduling: str) -> str:
    """A soak's facts in one line: requests, structured-output requests,
    variable decode steps beside the server's ``--async-scheduling`` (only
    synchronous scheduling lets a grammar trim drafts), memory, counters."""
    client = soak.get("client") or {}
    st = soak.get("structured") or {}
    variable = sum(((soak.get("paths") or {}).get("variable") or {}).values())
    return (f"{client.get('completed')} completed, {client.get('failed')} failed; "
            f"structured {st.get('sent')} sent, {st.get('failed')} failed, "
            f"{st.get('broke_regex')} broke the regex; {variable} variable steps "
            f"(async scheduling: {async_scheduling}); "
            f"memory flat {(soak.get('gpu_memory') or {}).get('flat')}; "
            f"builds a step {(soak.get('consistency') or {}).get('builds_per_step')}")


def run_server(args, mode: str, model: str, cfg: dict, points: list[dict], result: dict,
               identity: dict, budget: Budget, servers_left: int, save,
               optional: int = 0) -> dict:
    """One mode's server: started, measured (warm-up, identity, the points,
    soak) within its share of ``budget``, stopped; its facts into
    ``result["servers"]``, its runs into each point's ``runs``, its identity
    records into ``identity``.  ``optional``: how many of the
    ``servers_left`` (this one included) are the A/A control or a
    ``--variant``, which a short budget drops first."""
    live = start_server(args, mode, model, result, budget.start_by(servers_left))
    try:
        if "failed" in live.info:
            return live.info
        deadline = budget.share(servers_left, stop_reserve(args), optional, args.min_share)
        warm_up(args, live, model, cfg, identity, deadline)
        for point in points:
            fill_rates(points, args)
            point.setdefault("runs", {})[mode] = measure_on(args, live, point, model, deadline,
                                                            model_vocab(cfg))
            save()
        if args.profile_steps and points:
            live.info["profile"] = profile_window(args, points[0], live.port, model, mode,
                                                  live.trace_dir, deadline, live.per_point_s)
            save()
        if args.soak_minutes:
            if time.time() + args.gap + 60 * args.soak_minutes + 60 < deadline:
                time.sleep(args.gap)
                live.info["soak"] = run_soak(args, live.port, model, mode, model_vocab(cfg))
            else:
                live.info["soak"] = {"skipped": "time limit"}
    finally:
        finish_server(args, live, points, save)
    return live.info


def run_interleaved(args, model: str, cfg: dict, points: list[dict], result: dict,
                    identity: dict, budget: Budget, save) -> None:
    """``--rounds``: every mode's server up at once (each with an equal part of
    ``--gpu-memory-utilization``), warmed up, then rounds in which the servers
    take turns at each point, the order rotated a round, so that what drifts
    on the machine over the minutes (clocks, the host's other load) falls on
    every mode alike.  With fresh prompts each round has its own seed, the
    same for every mode (:func:`round_point`).  Each point keeps every round's runs (``rounds``);
    :func:`pick_rounds` then sets its ``runs`` and the per-round ratios.  With
    ``--profile-steps``, after the rounds each server's profiled window in turn."""
    n = len(args.modes)
    stops = stop_reserve(args) * n
    lives: list[Live] = []
    try:
        if args.start_together:  # all launched, then each waited for: one start's wait
            for mode in args.modes:
                lives.append(launch_server(args, mode, model, result,
                                           args.gpu_memory_utilization / n))
            for live in lives:
                await_ready(args, live, budget.start_by(1) - args.min_share - stops)
            down = [live.mode for live in lives if "failed" in live.info]
            if down:
                for live in lives:
                    if "failed" not in live.info:
                        live.info["skipped"] = f"{down[0]}'s server is not up"
                return
        else:
            for i, mode in enumerate(args.modes):
                ready_by = budget.start_by(n - i) - args.min_share - stops
                live = start_server(args, mode, model, result, ready_by,
                                    args.gpu_memory_utilization / n)
                lives.append(live)
                if "failed" in live.info:
                    for m in args.modes[i + 1:]:
                        result["servers"][m] = {"skipped": f"{mode}'s server is not up"}
                    return
        deadline = time.time() + max(0.0, budget.left() - stops)
        for live in lives:
            warm_up(args, live, model, cfg, identity, deadline)
        round_s = 0.0
        for r in range(args.rounds):
            if r and time.time() + round_s > deadline:
                result["rounds_left_out"] = {"rounds": args.rounds - r, "why": "time limit"}
                break
            t0 = time.time()
            order = lives[r % n:] + lives[:r % n]
            for point in points:
                fill_rates(points, args)
                this = round_point(point, r, args.prompts)
                got = measure_side_by_side(args, order, this, model, deadline, model_vocab(cfg))
                point.setdefault("runs", {}).update(got)
                point.setdefault("rounds", []).append({m: got[m] for m in args.modes})
                save()
            round_s = max(round_s, time.time() - t0)
        if args.profile_steps and points:  # one window a server, the others idle
            for live in lives:
                live.info["profile"] = profile_window(args, points[0], live.port, model, live.mode,
                                                      live.trace_dir, deadline, live.per_point_s)
                save()
    finally:
        for live in lives:
            finish_server(args, live, points, save)
        for point in points:
            pick_rounds(point)


# A round's seed offset for fresh prompts: far from the points' own seeds (seed + i).
ROUND_SEED_STEP = 100003


def round_point(point: dict, r: int, prompts: str) -> dict:
    """``point`` as round ``r`` runs it: its own files (``-round<r>``) and,
    with fresh prompts, its own seed (the same for every mode in the round)."""
    seed = point["seed"] + (r * ROUND_SEED_STEP if prompts == "fresh" else 0)
    return dict(point, id=f"{point['id']}-round{r}", seed=seed)


def pick_rounds(point: dict) -> None:
    """A point measured in rounds: per mode, ``runs`` is its run of median
    mean TPOT (the lower middle of an even count; ``round``: which), and
    ``x_rounds`` holds per mode against stock each round's ratios, both runs
    of the same round, with their median, least and greatest (rounds where
    either has no result are left out)."""
    rounds = point.get("rounds")
    if not rounds:
        return
    modes = list(rounds[0])
    for mode in modes:
        done = [(i, r[mode]) for i, r in enumerate(rounds)
                if ((r.get(mode) or {}).get("client") or {}).get("mean_tpot_ms") is not None]
        if done:
            done.sort(key=lambda ir: ir[1]["client"]["mean_tpot_ms"])
            i, run = done[(len(done) - 1) // 2]
            point.setdefault("runs", {})[mode] = dict(run, round=i)
    x = {}
    for mode in modes:
        if mode == "stock":
            continue
        per = {}
        for name in RATIOS:
            vals = sorted(v for r in rounds
                          if (v := against_stock((r.get("stock") or {}).get("client") or {},
                                                 (r.get(mode) or {}).get("client") or {},
                                                 name)) is not None)
            if vals:
                per[name] = {"median": statistics.median(vals), "min": vals[0], "max": vals[-1],
                             "rounds": len(vals), "each": vals}
        if per:
            x[mode] = per
    if x:
        point["x_rounds"] = x


def profile_window(args, point: dict, port: int, tokenizer: str, mode: str, trace_dir: str,
                   deadline: float, per_point_s: float) -> dict:
    """``--profile-steps``: one wave of ``point``'s load (unmeasured) under
    vLLM's torch profiler (``/start_profile``; the worker stops by itself
    after the window, :func:`serve_diag.profiler_config`), its trace
    summarised (:func:`serve_diag.summarize_profile`) and deleted."""
    if time.time() + args.gap + per_point_s + 90 > deadline:
        return {"skipped": "time limit"}
    time.sleep(args.gap)
    try:
        _post_empty(port, "/start_profile", 60)
        wave = dict(point, id=point["id"] + "-profile", num_prompts=point["value"]) \
            if point["kind"] == "concurrency" else dict(point, id=point["id"] + "-profile")
        run = run_client(args, wave, port, tokenizer, mode, max(1.0, deadline - time.time()))
        _post_empty(port, "/stop_profile", 120)
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    path = serve_diag.wait_for_trace(trace_dir, max(5.0, min(120.0, deadline - time.time())))
    if path is None:
        return {"error": f"no trace under {trace_dir}", "client_rc": run["rc"]}
    try:
        summary = serve_diag.summarize_profile(serve_diag.read_trace(path))
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    return {"client_rc": run["rc"], "window": [run["t0"], run["t1"]], **summary}


def _post_empty(port: int, path: str, timeout: float) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()


def soak_consistency(soak: dict, k: int, tolerance: float = 0.01) -> dict:
    """The plugin's counted decode builds against vLLM's engine steps over the
    soak.  A step with decodes builds k + 1 times: the target model once and
    the MTP drafter ``k`` times.  vLLM's step count (its iteration-tokens
    histogram) leaves out steps that return no output, and a step without
    decodes builds nothing of ours; both are rare under load, so the builds
    per counted step sit within ``tolerance`` (relative) of k + 1.  Counts
    that drift past it (a lost counter, a step built twice) do not."""
    paths = soak.get("paths")
    steps = (soak.get("engine") or {}).get("engine_steps")
    if not paths or not steps:
        return {"builds": None, "engine_steps": steps, "within_bounds": None}
    builds = sum(paths["steps"].values())
    per_step = builds / steps
    return {"builds": builds, "engine_steps": steps, "builds_per_step": per_step,
            "expected_per_step": k + 1, "tolerance": tolerance,
            "within_bounds": abs(per_step - (k + 1)) <= tolerance * (k + 1),
            "exact": paths.get("exact")}


def summarize(result: dict, ident: dict) -> None:
    """The identity comparisons (``ident``: each mode's records) and the
    table, into ``result``."""
    if "stock" in ident:
        result["identity_vs_stock"] = {m: compare_identity(ident["stock"], recs)
                                       for m, recs in ident.items() if m != "stock"}
    result["table"] = table_rows(result)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="a model folder (default: --config's)")
    ap.add_argument("--config", default="proxy", choices=list(serve_model.CONFIGS))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 61)")
    ap.add_argument("--mlp", default="dense", choices=["dense", "moe"])
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--k", type=int, default=3, help="MTP draft tokens")
    ap.add_argument("--modes", nargs="+", default=["stock", "plugin"], choices=list(MODE_VALUES),
                    help="servers in this order; stock first where it is one of them")
    ap.add_argument("--aa", action="store_true", help="add a second stock server, 'control'")
    ap.add_argument("--rounds", type=int, default=0,
                    help="every server up at once, the points measured in this many rounds "
                    "in which the servers take turns (the order rotated a round): the "
                    "comparison under the machine's drift; 0: one server after another")
    ap.add_argument("--start-together", action="store_true",
                    help="with --rounds and --kv-cache-gib: every server launched at once, "
                    "then each waited for")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="each server's KV cache in GiB (vLLM's --kv-cache-memory-bytes: the "
                    "same for every mode, vLLM's memory profiling skipped)")
    ap.add_argument("--variant", action="append", default=[], type=parse_variant,
                    metavar="NAME:SETTING=VALUE[,...]",
                    help="one more plugin server with some of the plugin's settings changed "
                    f"(e.g. notopk:{settings.TOPK_ENV}=vllm), after the plugin's, before the "
                    "control; like the control, dropped first by a short --time-limit")
    ap.add_argument("--input-len", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="random dataset's length spread (0: every prompt the same length)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--rates", nargs="*", default=["auto", "auto"],
                    help="Poisson request rates (req/s), or 'auto' (--rate-fractions)")
    ap.add_argument("--rate-fractions", type=float, nargs="+", default=[0.6, 0.9],
                    help="auto rates as fractions of the highest concurrency's request rate")
    ap.add_argument("--waves", type=int, default=4, help="prompts per concurrency point / C")
    ap.add_argument("--min-prompts", type=int, default=16)
    ap.add_argument("--rate-seconds", type=float, default=60.0,
                    help="a rate point's prompts: rate x this")
    ap.add_argument("--prompts", default="fresh", choices=["fresh", "cached"],
                    help="fresh: a seed per point; cached: one seed, each point run twice, "
                    "the second measured")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-prompts", type=int, default=32)
    ap.add_argument("--gap", type=float, default=stats.LOG_EVERY_S + 1.5,
                    help="idle seconds before each point (> the plugin's log interval)")
    ap.add_argument("--identity", type=int, default=32, help="greedy identity requests (0: none)")
    ap.add_argument("--identity-tokens", type=int, default=64)
    ap.add_argument("--identity-concurrency", type=int, default=8)
    ap.add_argument("--no-sweep", action="store_true",
                    help="no measured points (e.g. a soak alone)")
    ap.add_argument("--soak-minutes", type=float, default=0.0)
    ap.add_argument("--soak-rate", type=float, default=1.0)
    ap.add_argument("--soak-input-len", type=int, default=16384)
    ap.add_argument("--soak-output-len", type=int, default=256)
    ap.add_argument("--soak-range-ratio", type=float, default=0.5)
    ap.add_argument("--soak-disconnects", type=int, default=4)
    ap.add_argument("--soak-structured", type=int, default=2,
                    help="clients sending regex-constrained completions through the soak, "
                    "one at a time each (variable decode runs with --async-scheduling off); "
                    "0: none")
    ap.add_argument("--structured", type=int, default=0,
                    help="clients sending regex-constrained completions, one at a time each, "
                    "beside vLLM's client in every measured point: with --async-scheduling off "
                    "their trimmed drafts make the step variable (what stock 0.33 / 0.34 "
                    "splits, 0.27.1 flattens); 0: none")
    ap.add_argument("--soak-sample-s", type=float, default=5.0)
    ap.add_argument("--soak-memory-tolerance-mib", type=float, default=64.0)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--attention-backend", default="FLASHMLA_SPARSE")
    ap.add_argument("--force-sparse-prefill", type=int, default=1,
                    help="1: sparse MLA's MQA path for prefills too, as the engine benchmark")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="default: the largest concurrency (an A/A run at one point sets the "
                    "sweep's, so that both servers are configured as the sweep's were)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="default: vLLM's for a server")
    ap.add_argument("--async-scheduling", default="default", choices=["default", "on", "off"])
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for every server")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="one more argument for vllm serve (repeat)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--server-timeout", type=float, default=900.0)
    ap.add_argument("--stop-timeout", type=float, default=60.0)
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds for the whole run: each server gets a share")
    ap.add_argument("--start-reserve", type=float, default=90.0,
                    help="with --time-limit: seconds kept for each later server's start")
    ap.add_argument("--min-share", type=float, default=120.0,
                    help="with --time-limit: the least a server's measurements should get "
                    "(warm-up, identity, a point); where the servers' shares fall under it, "
                    "the A/A control (--aa) and the variants are dropped first")
    ap.add_argument("--server-shutdown-timeout", type=int, default=None,
                    help="vllm serve --shutdown-timeout: seconds the engine core may drain "
                    "at the stop (vLLM's 0 kills it right after SIGTERM); default: 10, at "
                    "most half of --stop-timeout")
    ap.add_argument("--client", choices=["shared", "fresh"], default="shared",
                    help="shared: every vllm bench serve run in one worker process, vLLM "
                    "imported once (benchmarks/bench_client.py); fresh: a process a run")
    ap.add_argument("--keep-detailed", action="store_true",
                    help="keep the client's per-request result files (raw/)")
    ap.add_argument("--quick", action="store_true",
                    help="one GPU call: 4K prompts, concurrency 8 and 32, no rate points, "
                    "16 identity requests")
    ap.add_argument("--py-spy", default=None, metavar="PATH",
                    help="py-spy executable: each engine core's stacks recorded over every "
                    "measured point (benchmarks/serve_diag.py)")
    ap.add_argument("--py-spy-rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after the points, a window of this many engine steps under vLLM's "
                    "torch profiler, summarised (GPU time by kernel class, host syncs)")
    ap.add_argument("--profile-delay", type=int, default=20,
                    help="engine steps between /start_profile and the window")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and stop")
    return ap


QUICK = {"input_len": [4096], "concurrency": [8, 32], "rates": [], "waves": 2,
         "warmup_prompts": 16, "identity": 16, "identity_tokens": 32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        for key, value in QUICK.items():
            if f"--{key.replace('_', '-')}" not in given:
                setattr(args, key, value)
    args.variants = dict(args.variant)
    if len(args.variants) != len(args.variant):
        ap.error(f"--variant: each name once, got {[n for n, _ in args.variant]}")
    if args.variants and "plugin" not in args.modes:
        ap.error("--variant: compared with the plugin's server, which --modes leaves out")
    args.modes = list(args.modes) + list(args.variants)
    if args.aa and "control" not in args.modes:
        args.modes = list(args.modes) + ["control"]
    if len(set(args.modes)) != len(args.modes):
        ap.error(f"--modes: each mode once, got {args.modes}")
    if "stock" in args.modes and args.modes[0] != "stock":
        ap.error("--modes: stock first (every other mode is compared with it)")
    for r in args.rates:
        if r != "auto":
            try:
                if float(r) <= 0:
                    raise ValueError
            except ValueError:
                ap.error(f"--rates: a positive number or 'auto', got {r!r}")
    if sum(r == "auto" for r in args.rates) > len(args.rate_fractions):
        ap.error("--rate-fractions: one per 'auto' rate")
    for name in ("k", "output_len", "waves", "min_prompts"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected >= 1")
    if min(args.concurrency) < 1 or min(args.input_len) < 1:
        ap.error("--concurrency / --input-len: expected >= 1")
    if not 0 <= args.range_ratio < 1 or not 0 <= args.soak_range_ratio < 1:
        ap.error("--range-ratio / --soak-range-ratio: expected in [0, 1)")
    if args.soak_structured < 0:
        ap.error(f"--soak-structured: expected >= 0, got {args.soak_structured}")
    if args.structured < 0:
        ap.error(f"--structured: expected >= 0, got {args.structured}")
    if args.gap < 0:
        ap.error("--gap: expected >= 0")
    if args.start_reserve < 0:
        ap.error("--start-reserve: expected >= 0")
    if args.min_share < 0:
        ap.error("--min-share: expected >= 0")
    if args.server_shutdown_timeout is None:
        args.server_shutdown_timeout = max(1, min(10, int(args.stop_timeout / 2)))
    if not 0 <= args.server_shutdown_timeout < args.stop_timeout:
        ap.error("--server-shutdown-timeout: expected >= 0 and under --stop-timeout "
                 f"({args.stop_timeout:g} s), got {args.server_shutdown_timeout}")
    for kv in args.env:
        if "=" not in kv:
            ap.error(f"--env: expected KEY=VALUE, got {kv!r}")
    if args.rounds < 0:
        ap.error("--rounds: expected >= 0")
    if args.kv_cache_gib is not None and not args.kv_cache_gib > 0:
        ap.error(f"--kv-cache-gib: expected a size > 0, got {args.kv_cache_gib}")
    if args.start_together and not (args.rounds and args.kv_cache_gib):
        ap.error("--start-together: needs --rounds (servers side by side) and --kv-cache-gib "
                 "(vLLM sizes the KV cache from the free memory it profiles, which a server "
                 "starting beside another would misread)")
    if args.rounds and args.soak_minutes:
        ap.error("--rounds: a soak runs on one server at a time; leave it out of an "
                 "interleaved run")
    if args.profile_steps < 0 or args.profile_delay < 0 or args.py_spy_rate < 1:
        ap.error("--profile-steps / --profile-delay: expected >= 0; --py-spy-rate: >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    model, cfg = _model_folder(args)
    points = sweep_points(args)
    if args.dry_run:
        port = 8000
        memory = args.gpu_memory_utilization / len(args.modes) if args.rounds else None
        print(shlex.join(serve_command(args, model, port, memory=memory)))
        for p in points:
            if p["value"] is None:
                p = dict(p, value=1.0, num_prompts=args.min_prompts)
            print(shlex.join(bench_command(args, p, port, model, "raw", f"client-{p['id']}.json",
                                         "MODE")))
        return 0
    result = {"schema": "serve-bench/1", "started": datetime.datetime.now().isoformat(),
              "args": vars(args), "model": model, "config": cfg,
              "memory_estimate": (serve_model.memory_estimate(cfg, kv_cache_dtype=args.kv_cache_dtype)
                                  if not args.model else None),
              "stats_log_every_s": stats.LOG_EVERY_S, "points": points, "servers": {}}
    out_json = os.path.join(args.out, "serve.json")

    identity: dict = {}

    def save():
        summarize(result, identity)
        write_json(out_json, result)

    global _bench_client
    if args.client == "shared":  # its import overlaps the first server's start
        _bench_client = BenchClient(args.python, os.path.join(args.out, "bench-client.log"))
        _bench_client.start()
    budget = Budget(args.time_limit, args.start_reserve)
    try:
        if args.rounds:
            run_interleaved(args, model, cfg, points, result, identity, budget, save)
        for i, mode in enumerate([] if args.rounds else args.modes):
            optional = sum(m not in COMPARED for m in args.modes[i:])
            if mode not in COMPARED and i \
                    and not budget.fits(stop_reserve(args), args.min_share):
                why = (f"time limit: {budget.left():.0f} s left, under a start "
                       f"({args.start_reserve:.0f} s) and --min-share ({args.min_share:.0f} s): "
                       f"the comparison came first")
                result["servers"][mode] = {"skipped": why}
                for point in points:
                    point.setdefault("runs", {})[mode] = {"skipped": "time limit"}
                print(f"[{mode}] not started: {why}", flush=True)
                continue
            run_server(args, mode, model, cfg, points, result, identity, budget,
                       len(args.modes) - i, save, optional)
    finally:
        if _bench_client is not None:
            _bench_client.stop()
            _bench_client = None
    result["finished"] = datetime.datetime.now().isoformat()
    save()
    print(render_table(result["table"]))
    for mode, cmp in (result.get("identity_vs_stock") or {}).items():
        ties = sum(d["at_ref_tie"] for d in cmp["diverged"])
        print(f"identity {mode} vs stock: {cmp['identical']}/{cmp['requests']} identical, "
              f"{cmp['failed']} failed, {len(cmp['diverged'])} diverged ({ties} at stock's exact "
              f"tie); top logprobs bitwise equal in {cmp['logprobs_equal']}")
        for gap in cmp.get("logprobs_apart", []):
            print(f"  request {gap['request']}: logprobs apart from token {gap['token']}, "
                  f"by {gap['most']:.3g} at most")
    for mode, info in result["servers"].items():
        h = info.get("health", {}).get("serving", {})
        print(f"[{mode}] error/traceback lines while serving: {h.get('lines')}; "
              f"plugin lines: {len(info.get('plugin_log') or [])}; step-count lines: "
              f"{info.get('path_lines')} (final: {info.get('final_path_line')})")
    for line in serve_diag.summary_lines(result):
        print(line)
    print(f"wrote {out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a served step's time goes: the diagnostics ``benchmarks/serve.py`` can add.

* :func:`sync_sites`: the places that synchronised with the GPU inside vLLM's
  step, from the server log under ``VLLM_GPU_SYNC_CHECK=warn`` (vLLM sets
  torch's sync-debug mode around ``execute_model`` and ``sample_tokens``
  after warm-up; torch warns once per calling line).
* :func:`signal_state`: how a process's threads stand towards SIGTERM
  (``/proc``): a stop signal no thread takes, or one taken by a thread other
  than a main thread blocked in a wait, is never handled.
* :class:`StackSampler` and :func:`collapsed_summary`: ``py-spy record`` on
  each engine core during a measured point (``--py-spy``), summarised per
  thread: where the engine's busy loop spends its samples.
* :func:`profiler_config` and :func:`summarize_profile`: a window of vLLM's
  own torch profiler (``--profile-steps``), taken after the measured points:
  GPU time per step by kernel class (``e2e_trace``), how much of the window
  some kernel ran, and the host's CUDA synchronisations per step.

Nothing here imports vLLM or needs a GPU.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import signal
import subprocess
import time

import e2e_trace

# torch's sync-debug warning as Python's warnings module prints it: the file:line of
# the Python line that called the synchronising op (alone on its line, or inside a
# logging record where warnings are captured into logging), after a process tag.
SYNC_WARNING = re.compile(r"(?P<file>[^\s:()\[\]]+\.py):(?P<line>\d+): UserWarning: "
                          r"called a synchronizing CUDA operation")
TAG = re.compile(r"^\s*\((?P<tag>\w+)(?: pid=\d+)?\)")
PACKAGE_PART = "vllm_dsa_varlen"


def sync_sites(text: str) -> list[dict]:
    """Each distinct synchronising line a log reports: its process tag, file
    (from ``site-packages/`` or the package on), line, how many times it was
    reported, and whether it is the plugin's."""
    counts: collections.Counter = collections.Counter()
    for row in text.splitlines():
        m = SYNC_WARNING.search(row)
        if m is None:
            continue
        tag = TAG.match(row)
        counts[(tag.group("tag") if tag else "main", _short_path(m.group("file")),
                int(m.group("line")))] += 1
    return [{"process": tag, "file": path, "line": line, "reports": n,
             "plugin": PACKAGE_PART in path}
            for (tag, path, line), n in sorted(counts.items())]


def _short_path(path: str) -> str:
    for mark in ("site-packages/", "site/"):
        at = path.rfind(mark)
        if at >= 0:
            return path[at + len(mark):]
    at = path.rfind(PACKAGE_PART + "/")
    return path[at:] if at >= 0 else path


# ----------------------------------------------------------------------------- signals

def _status(path: str) -> dict[str, str]:
    with open(path) as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _has(mask_hex: str | None, signum: int) -> bool:
    return bool(mask_hex) and bool(int(mask_hex, 16) >> (signum - 1) & 1)


def signal_state(pid: int, signum: int = signal.SIGTERM, proc: str = "/proc") -> dict | None:
    """How process ``pid`` stands towards ``signum``: whether its main thread
    blocks it, whether it is pending for the process (no thread has taken it)
    or for the main thread, whether a handler is installed or it is ignored,
    and which threads do not block it (a process-directed signal goes to one
    of those).  ``None`` when the process is gone."""
    try:
        main = _status(f"{proc}/{pid}/status")
        threads = []
        for task in sorted(glob.glob(f"{proc}/{pid}/task/*/status")):
            try:
                st = _status(task)
            except OSError:
                continue
            threads.append((st.get("Name", "?"), st.get("SigBlk"), st.get("State", "?")))
    except OSError:
        return None
    takers = [f"{name} ({state.split(' ')[0]})" for name, blk, state in threads
              if not _has(blk, signum)]
    return {"signal": signal.Signals(signum).name,
            "main_blocks": _has(main.get("SigBlk"), signum),
            "pending_process": _has(main.get("ShdPnd"), signum),
            "pending_main": _has(main.get("SigPnd"), signum),
            "handled": _has(main.get("SigCgt"), signum),
            "ignored": _has(main.get("SigIgn"), signum),
            "main_state": main.get("State"),
            "threads": len(threads), "threads_not_blocking": takers[:12]}


# ----------------------------------------------------------------------------- py-spy

FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
# py-spy's own frames: ``--threads``'s "thread (<tid>): <name>", ``--subprocesses``'
# "process <pid>:..."
LABEL = re.compile(r"^(thread \(|process \d+)")
# A leaf frame of a thread waiting rather than working: in these modules (locks,
# queues, selectors, zmq's poll, sockets), or these functions.
IDLE_FILES = ("threading.py", "queue.py", "selectors.py", "poll.py", "socket.py")
IDLE_FUNCS = ("sleep", "select", "poll", "epoll", "recv", "accept")


def _code_frame(frame: str) -> re.Match | None:
    """A frame of Python code (a function and its file), or ``None`` for py-spy's own."""
    m = None if LABEL.match(frame) else FRAME.match(frame)
    return m if m and m.group("file") else None


def collapsed_summary(text: str, top: int = 25) -> dict:
    """A ``py-spy record --format raw --threads`` profile (one ``frames
    count`` line a stack, frames outermost first, ``;``-separated, each
    ``function (file:line)`` after the thread's own, ``thread (tid): name``), per
    thread: its samples, the share whose leaf is a wait, the share with a
    frame of the plugin's package, and its functions by inclusive and by
    self share (``function (file)``, lines dropped).  The engine's thread
    (``run_busy_loop`` on its stack) is named in ``engine_thread``."""
    threads: dict[str, dict] = {}
    for raw in text.splitlines():
        stack, _, count = raw.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        parsed = [(f, _code_frame(f)) for f in frames]
        labels = [f for f, m in parsed if m is None]
        label = next((f for f in labels if f.startswith("thread (")), labels[0] if labels else "all")
        matches = [m for _, m in parsed if m is not None]
        code = [f"{m.group('func')} ({_short_path(m.group('file'))})" for m in matches]
        t = threads.setdefault(label, {"samples": 0, "idle": 0, "plugin": 0, "engine": 0,
                                       "inclusive": collections.Counter(),
                                       "self": collections.Counter()})
        t["samples"] += n
        if code:
            leaf = code[-1]
            t["self"][leaf] += n
            if (os.path.basename(matches[-1].group("file")) in IDLE_FILES
                    or matches[-1].group("func") in IDLE_FUNCS):
                t["idle"] += n
            for name in set(code):
                t["inclusive"][name] += n
            if any(PACKAGE_PART in f for f in code):
                t["plugin"] += n
            if any(f.startswith("run_busy_loop ") for f in code):
                t["engine"] += n
    out = {}
    for label, t in threads.items():
        s = max(1, t["samples"])
        out[label] = {"samples": t["samples"], "idle_share": round(t["idle"] / s, 4),
                      "plugin_share": round(t["plugin"] / s, 4),
                      "inclusive": [[k, round(v / s, 4)] for k, v in t["inclusive"].most_common(top)],
                      "self": [[k, round(v / s, 4)] for k, v in t["self"].most_common(top)]}
    engine = max(threads, key=lambda k: threads[k]["engine"], default=None)
    return {"threads": out,
            "engine_thread": engine if engine and threads[engine]["engine"] else None}


class StackSampler:
    """``py-spy record`` on processes over a window (``--py-spy PATH``): raw
    collapsed stacks per thread, sampled without pausing the target, from
    :meth:`start` until :meth:`finish` interrupts it (py-spy then writes its
    file)."""

    MIN_SECONDS = 1.0  # a recording runs at least this long (started, attached, sampled)

    def __init__(self, exe: str, out_dir: str, rate: int = 200):
        self.exe, self.out_dir, self.rate = exe, out_dir, rate
        self._runs: list[tuple[int, str, subprocess.Popen, str]] = []
        self._t0 = 0.0

    def command(self, pid: int, output: str) -> list[str]:
        return [self.exe, "record", "--pid", str(pid), "--rate", str(self.rate), "--format",
                "raw", "--threads", "--idle", "--nonblocking", "--output", output]

    def start(self, pids: list[int], name: str) -> None:
        self._t0 = time.time()
        for pid in pids:
            out = os.path.join(self.out_dir, f"pyspy-{name}-{pid}.txt")
            with open(out + ".log", "w") as log:
                proc = subprocess.Popen(self.command(pid, out), stdout=log,
                                        stderr=subprocess.STDOUT)
            self._runs.append((pid, out, proc, out + ".log"))

    def finish(self, timeout: float = 30.0) -> dict:
        """Interrupt every recording and wait for its file; per pid its
        summary (:func:`collapsed_summary`) or why there is none."""
        got = {}
        time.sleep(max(0.0, self._t0 + self.MIN_SECONDS - time.time()))
        for pid, out, proc, log in self._runs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if os.path.exists(out) and os.path.getsize(out):
                with open(out) as f:
                    got[str(pid)] = {"rc": proc.returncode, "file": os.path.basename(out),
                                     **collapsed_summary(f.read())}
            else:
                with open(log, errors="replace") as f:
                    got[str(pid)] = {"rc": proc.returncode, "error": f.read()[-600:]}
        self._runs = []
        return got


# ----------------------------------------------------------------------------- torch profiler

def profiler_config(trace_dir: str, steps: int, delay: int) -> dict:
    """vLLM's ``--profiler-config`` for a window of ``steps`` engine steps
    ``delay`` steps after ``/start_profile``: the worker's torch profiler
    without stacks, shapes or the summary table (a small, quick trace), the
    API server's own profiler off."""
    return {"profiler": "torch", "torch_profiler_dir": os.path.abspath(trace_dir),
            "torch_profiler_with_stack": False, "torch_profiler_record_shapes": False,
            "torch_profiler_dump_cuda_time_total": False, "ignore_frontend": True,
            "delay_iterations": delay, "max_iterations": steps}


STEP_ANNOTATION = "execute_context_"
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy")


def wait_for_trace(trace_dir: str, timeout: float, settle: float = 3.0) -> str | None:
    """The newest ``*.json.gz`` trace under ``trace_dir`` once its size has
    stopped changing for ``settle`` seconds; ``None`` at ``timeout``."""
    end, last = time.time() + timeout, None
    while time.time() < end:
        files = glob.glob(os.path.join(trace_dir, "**", "*.json.gz"), recursive=True)
        if files:
            newest = max(files, key=os.path.getmtime)
            size = os.path.getsize(newest)
            if last == (newest, size):
                return newest
            last = (newest, size)
        time.sleep(settle)
    return None


def summarize_profile(events: list[dict]) -> dict:
    """A profiled window: its engine steps (vLLM's per-step annotations and
    what they carried), GPU time per step by kernel class and the share of
    the window some kernel ran (:func:`e2e_trace.summarize_from_events`),
    and the host's synchronising CUDA calls per step, by name, with the host
    op each ran under."""
    steps = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
             and str(e.get("name", "")).startswith(STEP_ANNOTATION)]
    n = max(1, len(steps))
    out = {"steps": len(steps), "step_kinds": dict(collections.Counter(
        re.sub(r"\(\d+\)", "", e["name"]) for e in steps).most_common(8))}
    out.update(e2e_trace.summarize_from_events(events, n))
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    by_thread: dict = collections.defaultdict(list)
    for e in host:
        by_thread[e.get("tid")].append(e)
    for ops in by_thread.values():
        ops.sort(key=lambda e: e["ts"])
    syncs: dict = collections.defaultdict(lambda: [0, 0.0])
    under: collections.Counter = collections.Counter()
    for e in events:
        if e.get("cat") != "cuda_runtime" or e.get("name") not in SYNC_CALLS:
            continue
        got = syncs[e["name"]]
        got[0] += 1
        got[1] += e.get("dur", 0.0)
        under[_enclosing(by_thread.get(e.get("tid"), ()), e["ts"])] += 1
    out["syncs_per_step"] = {k: {"calls": round(c / n, 3), "us": round(t / n, 1)}
                             for k, (c, t) in sorted(syncs.items())}
    out["syncs_under"] = dict(under.most_common(12))
    host_us = collections.Counter()
    for e in host:
        host_us[e["name"]] += e.get("dur", 0.0)
    out["host_ops_us_per_step"] = {k: round(v / n, 1) for k, v in host_us.most_common(15)}
    return out


def _enclosing(ops, ts: float) -> str:
    """The innermost host op (sorted by start) whose span holds ``ts``."""
    best = None
    for op in ops:
        if op["ts"] > ts:
            break
        if op["ts"] + op.get("dur", 0.0) >= ts:
            best = op["name"]
    return best or "(no host op)"


def read_trace(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def summary_lines(result: dict, top: int = 5) -> list[str]:
    """A few lines per server of what its diagnostics found (for a run's
    stdout): its sync sites (the plugin's first), its engine thread's
    busiest functions over the first measured point, its profiled window."""
    out = []
    for mode, info in (result.get("servers") or {}).items():
        sites = sorted(info.get("sync_sites") or [], key=lambda s: (not s["plugin"], s["file"]))
        if sites:
            out.append(f"[{mode}] sync sites: " + "; ".join(
                f"{s['file']}:{s['line']}" for s in sites[:top])
                + (f" (+{len(sites) - top})" if len(sites) > top else ""))
        for point in result.get("points") or []:
            stacks = ((point.get("runs") or {}).get(mode) or {}).get("stacks") or {}
            for pid, got in stacks.items():
                if "error" in got:
                    out.append(f"[{mode}] py-spy on {pid}: {got['error'].strip()[-160:]}")
                    continue
                thread = (got.get("threads") or {}).get(got.get("engine_thread") or "") or {}
                if thread:
                    # below the frames every sample shares (the thread's roots)
                    busiest = ", ".join(f"{name} {share:.0%}" for name, share in
                                        [x for x in thread["inclusive"] if x[1] < 0.99][:top])
                    out.append(f"[{mode}] {point['id']} engine thread: plugin "
                               f"{thread['plugin_share']:.0%}, waiting {thread['idle_share']:.0%}; "
                               f"{busiest}")
            if stacks:
                break
        prof = info.get("profile") or {}
        if "gpu_us_per_step" in prof:
            classes = sorted((prof.get("by_class_us_per_step") or {}).items(), key=lambda kv: -kv[1])
            syncs = sum(v["calls"] for v in (prof.get("syncs_per_step") or {}).values())
            busy = prof.get("gpu_busy_fraction")
            out.append(f"[{mode}] profile: {prof['steps']} steps, GPU {prof['gpu_us_per_step']:.0f} us "
                       f"a step ({', '.join(f'{k} {v:.0f}' for k, v in classes[:top])}), busy "
                       f"{'-' if busy is None else f'{busy:.0%}'}, {syncs:.1f} host syncs a step")
        elif prof:
            out.append(f"[{mode}] profile: {prof.get('skipped') or prof.get('error')}")
    return out

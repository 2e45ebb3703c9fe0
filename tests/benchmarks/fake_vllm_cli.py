"""A stand-in for ``python -m vllm.entrypoints.cli.main`` in the serve
benchmark's tests (copied to ``vllm/entrypoints/cli/main.py`` of a folder put
first on PYTHONPATH), so the harness runs its processes, waits, stops and
parses for real without a GPU.

``serve``: loopback HTTP with ``/v1/models``, ``/version``, ``/metrics``
(vLLM's metric names and labels) and ``/v1/completions`` (plain and streamed;
the text a fixed function of the prompt, with top logprobs; a
``structured_outputs`` regex keeps the words it allows), logging as
vLLM's engine core does; with the plugin's mode variable at ``auto`` it logs
a decode-path line and records ``STEPS_PER_REQUEST`` engine steps per
completion through the plugin's own counters (a step: the target model's
varlen build and the drafter's ``k`` native ones), its log interval shortened by
``FAKE_LOG_EVERY_S``.  ``FAKE_FAIL_MODE``: a server in that mode exits at once;
``FAKE_START_S`` (``mode=seconds,...``): a server in that mode takes that long to come up.
It starts with a banner of block characters (vLLM's has them: the log's byte
count runs ahead of its character count) and logs vLLM's line on hearing
SIGTERM; ``FAKE_SLOW_STOP`` (``mode=seconds``): a server in that mode then
takes that long to tear down.  ``FAKE_TOKEN_S``: a completion takes that long a word.
``--profiler-config``: ``/start_profile`` and ``/stop_profile``, the latter
writing a gzipped trace of the completions since the start (per step an
annotation, two kernels, a synchronising CUDA call under a host op);
``FAKE_SYNC_WARN``: the server prints a sync-debug warning per completion
from that ``file:line``, as Python's warnings module prints torch's.
``bench serve``: sends the point's requests (concurrency or Poisson arrivals)
and writes a result file with vLLM's keys, per-request arrays included.
"""

import argparse
import json
import logging
import math
import os
import random
import re
import signal
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STEPS_PER_REQUEST = 2
MODE_VAR = "DSA_VARLEN"


def words_out(prompt: str, n: int) -> list[str]:
    words = prompt.split() or ["a"]
    return [words[(7 * i + len(words)) % len(words)] for i in range(n)]


def _seconds_for(mode: str, name: str) -> float:
    """The seconds environment variable ``name`` (``mode=seconds,...``) gives ``mode`` (0)."""
    given = dict(kv.split("=") for kv in os.environ.get(name, "").split(",") if kv)
    return float(given.get(mode, 0))


def serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--served-model-name", default="m")
    ap.add_argument("--profiler-config", default=None)
    ap.add_argument("--speculative-config", default='{"num_speculative_tokens": 1}')
    args, _ = ap.parse_known_args(argv)
    k = json.loads(args.speculative_config)["num_speculative_tokens"]
    profiler = json.loads(args.profiler_config) if args.profiler_config else None
    profiled: list[int] = []  # steps recorded since /start_profile (None: not profiling)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO,
                        format="(EngineCore_DP0 pid=%(process)d) %(levelname)s 12-06 00:00:00 "
                               "[%(filename)s:%(lineno)d] %(message)s")
    mode = os.environ.get(MODE_VAR, "auto")
    logging.getLogger("vllm").info("engine core starting")  # its tag names its pid, as vLLM's
    for row in ("\u2588\u2584  \u2584\u2588 " * 8, "\u2580\u2584\u2580 \u2588 " * 8):
        logging.getLogger("vllm").info(row)
    if os.environ.get("FAKE_FAIL_MODE") == mode:
        print("(APIServer pid=1) ERROR 12-06 00:00:00 [fake.py:1] cannot start", flush=True)
        return 1
    time.sleep(_seconds_for(mode, "FAKE_START_S"))
    from vllm_dsa_varlen import stats

    stats.LOG_EVERY_S = float(os.environ.get("FAKE_LOG_EVERY_S", "0.3"))
    log = logging.getLogger("vllm.dsa_varlen")
    if mode == "auto":
        log.info("vllm-dsa-varlen: DSA indexer decode path: varlen (fake)")
    lock = threading.Lock()
    counts = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "steps": 0, "ok": 0}

    def complete(body: dict) -> list[str]:
        out = words_out(body["prompt"], int(body["max_tokens"]))
        regex = (body.get("structured_outputs") or {}).get("regex")
        if regex:  # a grammar: only the words the regex allows, in a generation's time
            out = [w for w in out if re.fullmatch(regex, w)] or ["a"]
            time.sleep(0.05)
        time.sleep(float(os.environ.get("FAKE_TOKEN_S", "0")) * len(out))
        if mode == "auto":
            for i in range(STEPS_PER_REQUEST):
                stats.record("varlen", variable=i % 2 == 0, mixed=False)
                for _ in range(k):
                    stats.record("stock_native", variable=False, mixed=False)
        if os.environ.get("FAKE_SYNC_WARN"):
            import warnings

            path, line = os.environ["FAKE_SYNC_WARN"].rsplit(":", 1)
            sys.stdout.write("(EngineCore_DP0 pid=%d) " % os.getpid() + warnings.formatwarning(
                "called a synchronizing CUDA operation (Triggered internally at sync.cpp:1.)",
                UserWarning, path, int(line)))
            sys.stdout.flush()
        with lock:
            if profiled:
                profiled[0] += STEPS_PER_REQUEST
            counts["drafts"] += STEPS_PER_REQUEST
            counts["draft_tokens"] += 3 * STEPS_PER_REQUEST
            counts["accepted"] += 1
            counts["steps"] += STEPS_PER_REQUEST
            counts["ok"] += 1
        return out

    def metrics() -> str:
        lab = f'engine="0",model_name="{args.served_model_name}"'
        with lock:
            c = dict(counts)
        return "\n".join([
            "# TYPE vllm:spec_decode_num_drafts counter",
            f"vllm:spec_decode_num_drafts_total{{{lab}}} {float(c['drafts'])}",
            f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {float(c['draft_tokens'])}",
            f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {float(c['accepted'])}",
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="0"}} '
            f"{float(c['accepted'])}",
            f"vllm:iteration_tokens_total_count{{{lab}}} {float(c['steps'])}",
            f'vllm:request_success_total{{{lab},finished_reason="length"}} {float(c["ok"])}',
            f"vllm:num_preemptions_total{{{lab}}} 0.0", ""])

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, code: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/v1/models":
                self._send(200, json.dumps({"data": [{"id": args.served_model_name}]}).encode())
            elif self.path == "/version":
                self._send(200, b'{"version": "0.0.fake"}')
            elif self.path == "/metrics":
                self._send(200, metrics().encode(), "text/plain")
            else:
                self._send(404, b"{}")

        def do_POST(self):
            if self.path in ("/start_profile", "/stop_profile") and profiler:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    if self.path == "/start_profile":
                        profiled[:] = [0]
                    elif profiled:
                        write_trace(profiler["torch_profiler_dir"], profiled.pop())
                self._send(200, b"")
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            out = complete(body)
            if body.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    for w in out:
                        chunk = {"choices": [{"index": 0, "text": " " + w}]}
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.flush()
                        time.sleep(0.01)
                    self.wfile.write(b"data: [DONE]\n\n")
                except (BrokenPipeError, ConnectionResetError):
                    log.info("aborted request")
                self.close_connection = True
                return
            toks = [" " + w for w in out]
            resp = {"choices": [{"index": 0, "text": "".join(toks), "finish_reason": "length",
                                 "logprobs": {"tokens": toks,
                                              "top_logprobs": [{t: -0.5, " zz": -1.5}
                                                               for t in toks]}}]}
            self._send(200, json.dumps(resp).encode())

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    if os.environ.get("FAKE_DEAF_MODE") == mode:  # an engine core that never hears SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        def heard(*_):
            logging.getLogger("vllm").info(
                "[shutdown] EngineCore: trigger received signal=SIGTERM")

            def teardown():
                time.sleep(_seconds_for(mode, "FAKE_SLOW_STOP"))
                server.shutdown()
            threading.Thread(target=teardown).start()
        signal.signal(signal.SIGTERM, heard)
    server.serve_forever()
    logging.getLogger("vllm").info("shutting down")
    return 0


def write_trace(folder: str, steps: int) -> None:
    """A gzipped Chrome trace of ``steps`` engine steps, as vLLM's worker
    profiler writes one: per step its annotation on the host, a host op with
    a cudaStreamSynchronize inside, and two kernels (an indexer top-k of 30
    us, a GEMM of 70 us) of a 200 us step."""
    import gzip

    events = []
    for i in range(steps):
        t = 1000.0 + 200.0 * i
        events += [
            {"ph": "X", "cat": "user_annotation", "name": f"execute_context_0(0)_generation_4({16})",
             "ts": t, "dur": 150.0, "pid": 1, "tid": 7},
            {"ph": "X", "cat": "cpu_op", "name": "aten::item", "ts": t + 10, "dur": 20.0,
             "pid": 1, "tid": 7},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": t + 12,
             "dur": 15.0, "pid": 1, "tid": 7},
            {"ph": "X", "cat": "kernel", "name": "persistent_topk_kernel", "ts": t + 40,
             "dur": 30.0, "pid": 0, "tid": 7},
            {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm", "ts": t + 80, "dur": 70.0,
             "pid": 0, "tid": 7}]
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"fake-worker.{int(time.time() * 1000)}.pt.trace.json.gz")
    with gzip.open(path + ".tmp", "wt") as f:
        json.dump({"traceEvents": events}, f)
    os.rename(path + ".tmp", path)


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(math.ceil(p / 100 * len(s))) - 1)] if s else 0.0


def bench(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    for name in ("--base-url", "--model", "--result-dir", "--result-filename", "--label"):
        ap.add_argument(name)
    for name in ("--num-prompts", "--random-input-len", "--random-output-len", "--seed",
                 "--max-concurrency"):
        ap.add_argument(name, type=int)
    ap.add_argument("--request-rate", type=float, default=math.inf)
    args, _ = ap.parse_known_args(argv)
    rng = random.Random(args.seed)
    prompts = [" ".join(f"w{rng.randrange(999)}" for _ in range(args.random_input_len))
               for _ in range(args.num_prompts)]

    def one(prompt: str) -> tuple[float, int]:
        t0 = time.perf_counter()
        body = json.dumps({"model": args.model, "prompt": prompt,
                           "max_tokens": args.random_output_len}).encode()
        req = urllib.request.Request(f"{args.base_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            n = len(json.loads(r.read())["choices"][0]["logprobs"]["tokens"])
        return time.perf_counter() - t0, n

    t0 = time.perf_counter()
    workers = args.max_concurrency or args.num_prompts
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = []
        for p in prompts:
            if args.max_concurrency is None and math.isfinite(args.request_rate):
                time.sleep(rng.expovariate(args.request_rate))
            futures.append(pool.submit(one, p))
        done = [f.result() for f in futures]
    dur = time.perf_counter() - t0
    lat = [d for d, _ in done]
    result = {"backend": "vllm", "label": args.label, "num_prompts": args.num_prompts,
              "fake_seed": args.seed,  # the stand-in's own key: the seed it was given
              "duration": dur, "completed": len(done), "failed": 0,
              "request_throughput": len(done) / dur,
              "output_throughput": sum(n for _, n in done) / dur,
              "output_lens": [n for _, n in done], "ttfts": lat, "itls": [[x] for x in lat],
              "errors": [""] * len(done), "generated_texts": [""] * len(done)}
    for m in ("ttft", "tpot", "itl", "e2el"):
        ms = [1e3 * x / (1 if m in ("ttft", "e2el") else args.random_output_len) for x in lat]
        result[f"mean_{m}_ms"] = sum(ms) / len(ms)
        result[f"median_{m}_ms"] = _pct(ms, 50)
        for p in (50, 90, 99):
            result[f"p{p}_{m}_ms"] = _pct(ms, p)
    with open(os.path.join(args.result_dir, args.result_filename), "w") as f:
        json.dump(result, f)
    return 0


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    if argv[:2] == ["bench", "serve"]:
        return bench(argv[2:])
    print(f"fake vllm: unknown command {argv[:2]}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

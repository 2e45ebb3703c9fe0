"""A stand-in for ``py-spy record`` in the serve benchmark's tests: takes its
arguments, waits for SIGINT (as py-spy records until interrupted), then
writes a raw collapsed-stack file as py-spy does with ``--threads``: the
target's main thread mostly in the engine's busy loop (a fifth of it inside
the plugin's package, a tenth waiting on a queue) and an idle helper thread."""

import argparse
import signal
import sys
import threading


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("command")
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--rate", type=int)
    ap.add_argument("--format")
    ap.add_argument("--output", required=True)
    for flag in ("--threads", "--idle", "--nonblocking"):
        ap.add_argument(flag, action="store_true")
    args = ap.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait(60)
    main_thread = "thread (10260): MainThread"
    loop = ["<module> (<string>:1)", "run_engine_core (vllm/v1/engine/core.py:1743)",
            "run_busy_loop (vllm/v1/engine/core.py:1798)"]
    lines = [
        (main_thread, loop + ["step (vllm/v1/engine/core.py:400)",
                              "execute_model (vllm/v1/worker/gpu_worker.py:1011)"], 50),
        (main_thread, loop + ["step (vllm/v1/engine/core.py:400)",
                              "build (vllm_dsa_varlen/vllm_0_27/v1/attention/backends/mla/"
                              "indexer.py:650)",
                              "plan_decode_rows (vllm_dsa_varlen/plan.py:150)"], 20),
        (main_thread, loop + ["_process_input_queue (vllm/v1/engine/core.py:1840)",
                              "get (queue.py:171)", "wait (threading.py:355)"], 10),
        (main_thread, loop + ["step (vllm/v1/engine/core.py:400)"], 20),
        ("thread (10302): Thread-1 (run)", ["_bootstrap (threading.py:1030)",
                                          "run (vllm/v1/engine/core.py:2305)",
                                          "get (queue.py:171)", "wait (threading.py:355)"], 100),
    ]
    with open(args.output, "w") as f:
        for thread, frames, n in lines:
            f.write(";".join([thread, *frames]) + f" {n}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

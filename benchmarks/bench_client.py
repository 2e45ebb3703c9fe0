"""``vllm bench serve`` runs one after another in one process: serve.py's client.

Each ``vllm bench serve`` process spends its first seconds importing vLLM,
often more than a short point serves.  This worker imports vLLM's command line once and
hands every run to the same entry point a fresh ``vllm bench serve`` would
reach (``vllm.entrypoints.cli.main.main`` with the run's arguments), its
output (file descriptors 1 and 2) into the run's own log.  The client's code,
arguments and result files are vLLM's; what a run shares with the one before
is the imported modules (each run seeds its own dataset from ``--seed``).

Protocol, one JSON object a line: stdin ``{"argv": [...], "log": path}``
(``argv`` without the leading ``vllm``); stdout ``{"ready": true}`` once the
import is done (or ``{"error": ...}`` and exit), then ``{"rc": int}`` a run.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def run_one(main, argv: list[str], log: str) -> int:
    """``main()`` with ``sys.argv`` set to ``vllm`` + ``argv``, descriptors 1
    and 2 into ``log``; its exit code (an exception's traceback goes to the log, 1)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(log, "w") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            sys.argv = ["vllm", *argv]
            try:
                got = main()
                rc = 0 if got is None else int(got)
            except SystemExit as exc:
                rc = _exit_code(exc)
            except BaseException:  # noqa: BLE001 - the run failed; the worker goes on
                traceback.print_exc()
                rc = 1
            sys.stdout.flush()
            sys.stderr.flush()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    return rc


def serve_forever(stdin, reply) -> int:
    try:
        from vllm.entrypoints.cli.main import main
    except Exception as exc:  # noqa: BLE001 - said once, then the parent runs nothing here
        reply.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        reply.flush()
        return 1
    reply.write(json.dumps({"ready": True}) + "\n")
    reply.flush()
    for line in stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        rc = run_one(main, list(req["argv"]), req["log"])
        reply.write(json.dumps({"rc": rc}) + "\n")
        reply.flush()
    return 0


def main() -> int:
    # replies on a copy of the original stdout; descriptor 1 itself goes to
    # stderr between runs, so nothing else a run's code prints reaches the channel
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return serve_forever(sys.stdin, reply)


if __name__ == "__main__":
    sys.exit(main())

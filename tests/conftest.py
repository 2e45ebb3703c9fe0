"""Shared test set-up.

Without a CUDA GPU the Triton kernels run in Triton's interpreter: the variable
must be set before ``triton`` is first imported, so it is set here.

Test modules written against one vLLM line (``LINE_TESTS``) are skipped, with
the reason, before they are imported when another line (or no vLLM) is
installed, so ``python -m pytest tests`` passes in either environment.
"""

import contextlib
import functools
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from vllm_dsa_varlen.patches import installed_line

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_FP8_GPU = HAS_CUDA and torch.cuda.get_device_capability() >= (8, 9)


TESTS_DIR = pathlib.Path(__file__).resolve().parent
VLLM_LINE = installed_line()  # "0.27" | "0.33" | "0.34" | other | None

# The test modules / folders (first path part under tests/) written against
# one patch set -> the vLLM lines it serves (vllm_0_33/ serves 0.33 and 0.34).
LINE_TESTS = {
    "vllm_0_27": ("0.27",),
    "test_builder_equivalence.py": ("0.27",),
    "test_robustness.py": ("0.27",),
    "vllm_0_33": ("0.33", "0.34"),
}


def needed_lines(path: pathlib.Path) -> tuple[str, ...] | None:
    """The vLLM lines the test module at ``path`` is written against, if any."""
    try:
        first = pathlib.Path(path).resolve().relative_to(TESTS_DIR).parts[0]
    except (ValueError, IndexError):
        return None
    return LINE_TESTS.get(first)


class _OtherLineModule(pytest.Module):
    """A test module of another vLLM line: collected as one skip, never imported."""

    skip_reason = ""

    def collect(self):
        pytest.skip(self.skip_reason, allow_module_level=True)


def pytest_pycollect_makemodule(module_path, parent):
    lines = needed_lines(module_path)
    if lines is None or VLLM_LINE in lines:
        return None
    node = _OtherLineModule.from_parent(parent, path=module_path)
    node.skip_reason = (f"{pathlib.Path(module_path).name} is written against vLLM "
                        f"{' / '.join(line + '.x' for line in lines)}; "
                        f"installed: "
                        f"{'vLLM ' + VLLM_LINE + '.x' if VLLM_LINE else 'no vLLM'}")
    return node


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with fp8 support")
    skip_interpreter = pytest.mark.skip(
        reason="runs Triton kernels on CPU tensors in the interpreter, which a CUDA GPU turns off")
    for item in items:
        if "gpu" in item.keywords and not HAS_FP8_GPU:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and HAS_CUDA:
            item.add_marker(skip_interpreter)


@pytest.fixture
def device():
    """The device kernel tests run on: CUDA when present, else the CPU (interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def no_host_sync():
    """A context manager under which a CUDA call that waits on the device
    raises (torch's sync debug mode ``error``), the mode set back however the
    block ends."""

    @contextlib.contextmanager
    def guard():
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return guard


def c_signal_action(signum: int) -> tuple | None:
    """The process's C-level action for ``signum`` as (handler address,
    flags), ``None`` off Linux (:func:`vllm_dsa_varlen.ops.cuda_binding.signal_action`:
    what Python's ``signal.getsignal`` does not see)."""
    from vllm_dsa_varlen.ops.cuda_binding import signal_action

    got = signal_action(signum)
    return None if got is None else (got.handler, got.flags)


def native_signal(signum: int, handler: int) -> int | None:
    """glibc's own ``signal(signum, handler)`` (an address; 1: SIG_IGN), as a
    native library calls it, behind Python's table (BSD semantics: the action
    gets ``SA_RESTART``); the previous handler's address."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    return libc.signal(signum, handler)


def sigterm_to_idle_child(script: str, timeout: float, **popen) -> tuple[str, int | None]:
    """Run ``script`` in a child (it installs its SIGTERM handler, does the
    work, prints a line and idles in ``queue.get``, as an engine core waits
    for input); SIGTERM once the line came and the child is in its wait.
    Returns the line and the exit code, ``None`` where the child did not
    exit within ``timeout`` (it is killed then)."""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             **popen)
    try:
        said = child.stdout.readline().strip()
        time.sleep(0.3)  # into the wait
        child.send_signal(signal.SIGTERM)
        try:
            code = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
    finally:
        child.kill()
        child.wait()
    return said, code


class _StopHeard(Exception):
    """Raised in the main thread by :func:`sigterm_kept`'s handler when armed."""


@pytest.fixture
def sigterm_kept():
    """A context manager for work a served engine core does in its main
    thread: vLLM stops that core by SIGTERM through a Python handler (vLLM
    0.34 installs it before the engine is built, so before the plugin's
    kernels compile and load), so the block may neither leave SIGTERM blocked
    there nor replace the handler in Python's table (a sentinel while the
    block runs), nor leave an action under which that handler no longer runs
    when the core sleeps in its input queue's lock wait.  It yields
    ``heard()``: SIGTERM sent to the main thread while it waits so runs the
    handler at once (a C-level action with ``SA_RESTART`` restarts the wait
    instead, and the stop goes unheard).  ``exact=True`` also asks for the
    C-level action (:func:`c_signal_action`) as it was.  Mask and handler are
    set back either way."""

    @contextlib.contextmanager
    def guard(exact: bool = True):
        armed = []

        def sentinel(signum, frame):
            if armed:
                armed.clear()
                raise _StopHeard

        def heard(wait: float = 3.0) -> bool:
            # An untimed wait, as the idle core's queue.get(): the kernel restarts
            # that one under SA_RESTART (a timed one returns EINTR either way).
            inbox, done, main = queue.Queue(), threading.Event(), threading.get_ident()

            def send():
                time.sleep(0.2)  # the main thread is in the wait by then
                signal.pthread_kill(main, signal.SIGTERM)
                if not done.wait(wait):
                    inbox.put(None)  # wakes a wait that did not hear it

            sender = threading.Thread(target=send)
            took = None
            armed.append(True)
            start = time.monotonic()
            sender.start()
            try:
                try:
                    inbox.get()
                except _StopHeard:
                    took = time.monotonic() - start
                else:
                    time.sleep(0.05)  # the held-back handler runs now
            except _StopHeard:
                pass
            finally:
                done.set()
                sender.join()
                armed.clear()
            return took is not None and took < wait

        old = signal.signal(signal.SIGTERM, sentinel)
        c_action = c_signal_action(signal.SIGTERM)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        try:
            assert signal.SIGTERM not in mask
            yield heard
            assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask, "the signal mask changed"
            assert signal.getsignal(signal.SIGTERM) is sentinel, "SIGTERM's handler was replaced"
            if exact:
                assert c_signal_action(signal.SIGTERM) == c_action, \
                    "SIGTERM's C-level handler was replaced (Python's handler would not run)"
            assert heard(), "SIGTERM sent to the main thread asleep in a lock wait went unheard"
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            signal.signal(signal.SIGTERM, old)  # sets the C-level handler back too

    return guard


# Without a GPU, each test's Triton launches are watched: one that runs a
# kernel in the interpreter must say how it would run on a GPU machine, by
# taking the ``device`` fixture (its tensors then live on the GPU) or carrying
# the ``interpreter`` mark (skipped there).  Otherwise it hands CPU tensors to
# a compiled kernel where a GPU is, and fails only there.
_LAUNCHED = []


def _watch_interpreter_launches() -> bool:
    """Count interpreted kernel launches in :data:`_LAUNCHED` (True where
    Triton's interpreter has the launch method this wraps)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    run = getattr(interpreter.InterpretedFunction, "run", None)
    if run is None:
        return False

    @functools.wraps(run)
    def counted(self, *args, **kwargs):
        _LAUNCHED.append(getattr(self, "__name__", "?"))
        return run(self, *args, **kwargs)

    interpreter.InterpretedFunction.run = counted
    return True


WATCHING = not HAS_CUDA and _watch_interpreter_launches()


def undeclared_launches(item, launched: list) -> str | None:
    """Why ``item`` may not launch ``launched`` (kernel names) in the
    interpreter, or ``None``."""
    if not launched or "interpreter" in item.keywords or "device" in item.fixturenames:
        return None
    return (f"ran {sorted(set(launched))} in Triton's interpreter on CPU tensors without the "
            f"`device` fixture or the `interpreter` mark: on a GPU machine it would hand CPU "
            f"tensors to a compiled kernel")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _LAUNCHED.clear()
    yield
    why = undeclared_launches(item, _LAUNCHED) if WATCHING else None
    _LAUNCHED.clear()
    if why:
        pytest.fail(why, pytrace=False)


@functools.cache
def import_patch_targets() -> tuple[str, ...]:
    """The modules the installed line's patches change, imported once a session
    as vLLM imports them: on the real platform.  Some read the platform at
    import (0.27.1's ``deepseek_v2`` asks vLLM's ``_C`` whether CUTLASS fp8
    runs); a test that fakes a GPU and then applies the registry would
    otherwise import them under the fake, and pass or fail by test order.
    Returns the modules imported."""
    import importlib

    from vllm_dsa_varlen import patches

    imported = []
    for module in dict.fromkeys(p.module for p in patches.for_line(VLLM_LINE)):
        try:
            importlib.import_module(module)
        except ImportError:  # a module this install lacks: the registry says so itself
            continue
        imported.append(module)
    return tuple(imported)


@pytest.fixture
def clean_plugin(monkeypatch):
    """The plugin's settings unset (their deprecated names too) and its patch
    registry undone, before and after (the patch targets imported first:
    :func:`import_patch_targets`)."""
    from vllm_dsa_varlen import patches, settings, topk

    import_patch_targets()
    for setting in settings.SETTINGS.values():
        monkeypatch.delenv(setting.name, raising=False)
        monkeypatch.delenv(setting.old_name, raising=False)
    patches.undo_all()
    topk.reset()
    yield
    patches.undo_all()
    topk.reset()


@pytest.fixture(scope="session", autouse=True)
def _no_final_counts_line():
    """The test process's own decode-step counts are no run's: no final line
    at its exit (pytest has closed the streams vLLM's log handler writes to)."""
    yield
    from vllm_dsa_varlen import stats

    stats._final_written_pid = os.getpid()


@pytest.fixture
def plugin_log(monkeypatch):
    """Records of the plugin's logger from DEBUG up (vLLM's 'vllm' logger does not
    propagate), with the builders' log-once memory reset for the test."""
    import logging

    from vllm_dsa_varlen import config

    monkeypatch.setattr(config, "_logged_paths", set())
    records = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    log = logging.getLogger("vllm.dsa_varlen")
    handler, level = _Keep(level=logging.DEBUG), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    yield records
    log.removeHandler(handler)
    log.setLevel(level)


@pytest.fixture
def process_setting(monkeypatch):
    """``set(name, reader, value)``: environment variable ``name`` set (``None``:
    unset) as a new process would read it: ``reader``'s once-per-process cache
    and the launcher's routes, whose builds follow such settings, cleared;
    every variable set is unset and its cache cleared again after the test."""
    from vllm_dsa_varlen.ops import launcher

    touched = {}

    def set_to(name, reader, value):
        touched[name] = reader
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        reader.cache_clear()
        launcher._ROUTES.clear()
    yield set_to
    for name, reader in touched.items():
        set_to(name, reader, None)

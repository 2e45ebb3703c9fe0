"""vllm_dsa_varlen/ops/cuda_binding.py: what runs without a GPU."""

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading

import pytest
import torch
from conftest import c_signal_action, native_signal, sigterm_to_idle_child

from vllm_dsa_varlen.ops import cuda_binding as cb


def test_load_once_makes_each_device_and_build_once_across_threads():
    """Every thread asking for one (device, build) gets the one object made
    for it; another device or build gets its own; the maker is handed the
    device with its index and the build."""
    made = []
    start = threading.Barrier(8)

    def make(device, build):
        made.append((device, build))
        return object()

    cache, lock, got = {}, threading.Lock(), [None] * 8

    def ask(i):
        start.wait()
        got[i] = cb.load_once(cache, lock, torch.device("cuda", 1), ("SPLIT=2",), make)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == [(torch.device("cuda", 1), ("SPLIT=2",))]
    assert all(g is got[0] for g in got)
    other = cb.load_once(cache, lock, "cuda:2", ("SPLIT=2",), make)
    again = cb.load_once(cache, lock, "cuda:1", ("SPLIT=4",), make)
    assert other is not got[0] and again is not got[0] and other is not again
    assert set(cache) == {(1, ("SPLIT=2",)), (2, ("SPLIT=2",)), (1, ("SPLIT=4",))}
    assert cb.load_once(cache, lock, torch.device("cuda", 2), ("SPLIT=2",), make) is other
    assert len(made) == 3


# ----------------------------------------------------------------------------- stop signals

LINUX = sys.platform.startswith("linux")


def _native_ignore(signum):
    """SIG_IGN through libc, as a native library's own ``signal`` call would:
    Python's table does not see it."""
    native_signal(signum, 1)


@contextlib.contextmanager
def _python_handler(signum):
    """A Python handler for ``signum`` that records each delivery; set back after."""
    heard = []
    old = signal.signal(signum, lambda s, f: heard.append(s))
    try:
        yield heard
    finally:
        signal.signal(signum, old)


@pytest.mark.skipif(not LINUX, reason="reads the C-level action through libc's sigaction")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=str)
def test_a_native_replacement_of_a_python_stop_handler_is_set_back(signum, plugin_log,
                                                                  monkeypatch):
    """A block that replaces the C-level action of a Python-handled stop
    signal behind Python's back leaves it restored, logged naming the
    signal and the work (at info once; the same again at debug); the Python
    handler then hears the signal."""
    monkeypatch.setattr(cb, "_told", set())
    with _python_handler(signum) as heard:
        before = c_signal_action(signum)
        with cb.keep_stop_signals("a test's native call"):
            _native_ignore(signum)
            assert c_signal_action(signum)[0] == 1  # SIG_IGN now, behind Python
        assert c_signal_action(signum) == before
        warned = [r.getMessage() for r in plugin_log if r.levelno == logging.INFO]
        assert len(warned) == 1 and signal.Signals(signum).name in warned[0]
        assert "a test's native call" in warned[0]
        with cb.keep_stop_signals("a test's native call"):
            _native_ignore(signum)
        assert c_signal_action(signum) == before
        assert [r.levelno for r in plugin_log] == [logging.INFO, logging.DEBUG]
        signal.raise_signal(signum)
        assert heard == [signum]


@pytest.mark.skipif(not LINUX, reason="reads the C-level action through libc's sigaction")
def test_the_action_flags_read_as_the_kernels_bits():
    """``SA_RESETHAND`` is the flags' top bit (LLVM's handlers, which Triton
    installs, carry it): read unsigned, as the log prints it, not negative."""
    reset_hand = 0x80000000
    with _python_handler(signal.SIGTERM):
        action = cb.signal_action(signal.SIGTERM)
        action.flags |= reset_hand
        assert cb._libc().sigaction(signal.SIGTERM, ctypes.byref(action), None) == 0
        flags = c_signal_action(signal.SIGTERM)[1]
        assert flags & reset_hand and flags > 0


@pytest.mark.skipif(not LINUX, reason="reads the C-level action through libc's sigaction")
def test_what_the_stop_signal_guard_leaves_alone(plugin_log):
    """Nothing logged and nothing set where the block left the action alone,
    where Python itself installed another handler (that handler stays), and
    where the signal had no Python handler (a native one installed then is
    the library's business)."""
    with _python_handler(signal.SIGTERM):
        before = c_signal_action(signal.SIGTERM)
        with cb.keep_stop_signals("nothing"):
            torch.randn(8).sum()
        assert c_signal_action(signal.SIGTERM) == before
        with _python_handler(signal.SIGTERM) as heard:
            with cb.keep_stop_signals("Python's own install"):
                signal.signal(signal.SIGTERM, lambda s, f: heard.append("new"))
            signal.raise_signal(signal.SIGTERM)
            assert heard == ["new"]
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with cb.keep_stop_signals("a native install over the default"):
            _native_ignore(signal.SIGTERM)
        assert c_signal_action(signal.SIGTERM)[0] == 1
    finally:
        signal.signal(signal.SIGTERM, old)
    assert [r for r in plugin_log if r.levelno >= logging.DEBUG] == []


@pytest.mark.skipif(not LINUX, reason="reads the C-level action through libc's sigaction")
def test_an_nvrtc_compile_that_sets_the_handler_back_with_sa_restart_is_undone(plugin_log,
                                                                            monkeypatch):
    """A kernel's compile whose NVRTC call sets SIGTERM's handler back through
    glibc's ``signal()`` (the same handler, ``SA_RESTART``: NVRTC 13.0) leaves
    the action as it was once ``compile_source`` returns, said once."""
    monkeypatch.setattr(cb, "_told", set())
    monkeypatch.setattr(cb, "nvrtc", lambda: None)

    def compile_(nv, path, arch, extra, ptx):
        native_signal(signal.SIGTERM, native_signal(signal.SIGTERM, 1))
        assert c_signal_action(signal.SIGTERM) != before  # the flags now differ
        return b"cubin", ""

    monkeypatch.setattr(cb, "_compile", compile_)
    with _python_handler(signal.SIGTERM) as heard:
        before = c_signal_action(signal.SIGTERM)
        assert cb.compile_source("kernel.cu") == (b"cubin", "")
        warned = [r for r in plugin_log if r.levelno == logging.INFO]
        assert c_signal_action(signal.SIGTERM) == before and len(warned) == 1
        signal.raise_signal(signal.SIGTERM)
        assert heard == [signal.SIGTERM]


_WAITER = """
import ctypes, queue, signal, sys, time
sys.path.insert(0, {root!r})
from vllm_dsa_varlen.ops import cuda_binding as cb
signal.signal(signal.SIGTERM, lambda s, f: sys.exit(7))  # as vLLM's engine core: before the work
libc = ctypes.CDLL(None)
libc.signal.restype = ctypes.c_void_p
libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
guard = cb.keep_stop_signals("the work") if {guarded} else __import__("contextlib").nullcontext()
with guard:  # glibc's signal(): the same handler back, with SA_RESTART (BSD semantics)
    libc.signal(signal.SIGTERM, libc.signal(signal.SIGTERM, 1))
print("waiting", flush=True)
queue.Queue().get()  # idle, as the engine core's busy loop waits for input
"""


@pytest.mark.skipif(not LINUX, reason="glibc's signal() and sigaction")
@pytest.mark.parametrize("guarded", [False, True], ids=["bare", "guarded"])
def test_a_handler_set_back_with_sa_restart_leaves_an_idle_main_thread_deaf(guarded):
    """Why the guard compares the flags too: the same Python handler set
    back by glibc's ``signal()`` (as NVRTC 13.0's compile does) carries
    ``SA_RESTART``, so the main thread's lock wait restarts after the C
    handler and never returns to run the Python one: SIGTERM goes unheard.
    Under the guard the process exits through its handler at once."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    said, code = sigterm_to_idle_child(_WAITER.format(root=root, guarded=guarded),
                                       timeout=5 if guarded else 2)
    assert said == "waiting"
    assert code == (7 if guarded else None)

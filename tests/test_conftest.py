"""The suite's own guard (conftest): without a GPU, a test that runs a Triton
kernel in the interpreter must take the ``device`` fixture or carry the
``interpreter`` mark, so the whole suite also runs where a GPU is."""

import signal
import sys
from types import SimpleNamespace

import pytest
import torch

import conftest


def _item(marks=(), fixtures=()):
    return SimpleNamespace(keywords={m: True for m in marks}, fixturenames=list(fixtures))


def test_an_undeclared_launch_is_refused_by_name():
    why = conftest.undeclared_launches(_item(fixtures=("tmp_path",)), ["_k", "_k", "_j"])
    assert why is not None and "['_j', '_k']" in why and "interpreter" in why
    assert conftest.undeclared_launches(_item(marks=("interpreter",)), ["_k"]) is None
    assert conftest.undeclared_launches(_item(fixtures=("device",)), ["_k"]) is None
    assert conftest.undeclared_launches(_item(), []) is None


@pytest.mark.interpreter
def test_interpreted_launches_are_counted():
    """The wrap of the interpreter's launch is in place and counts a real
    launch (a kernel that doubles a random vector, checked)."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    assert conftest.WATCHING

    @triton.jit
    def _double(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2, mask=mask)

    x = torch.randn(7)
    want = x * 2
    before = len(conftest._LAUNCHED)
    _double[(1,)](x, 7, BLOCK=8)
    assert conftest._LAUNCHED[before:] == ["_double"]
    torch.testing.assert_close(x, want)


def test_the_no_host_sync_guard_sets_the_mode_and_sets_it_back_on_error(monkeypatch):
    """``no_host_sync`` turns torch's sync debug mode to ``error`` for its block
    and back to ``default`` after it, also when the block raises."""
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    guard = conftest.no_host_sync.__wrapped__()
    with guard():
        assert modes == ["error"]
    assert modes == ["error", "default"]
    with pytest.raises(RuntimeError), guard():
        raise RuntimeError("a call waited on the device")
    assert modes == ["error", "default", "error", "default"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads glibc's sigaction")
def test_the_sigterm_guard_catches_each_way_a_core_could_miss_its_stop():
    """``sigterm_kept`` passes a block that leaves SIGTERM alone and fails one
    that blocks it, one that replaces Python's handler, one that replaces the
    C-level handler behind Python's back (a native ``signal`` call, which
    ``signal.getsignal`` does not see) and, without ``exact``, one that sets
    the same handler back with ``SA_RESTART`` (glibc's ``signal()``), under
    which a main thread asleep in a lock wait no longer hears the signal;
    the handler is set back each time."""
    guard = conftest.sigterm_kept.__wrapped__()
    before = signal.getsignal(signal.SIGTERM)

    def native_ignore():
        assert conftest.native_signal(signal.SIGTERM, 1) is not None  # SIG_IGN, through libc

    def native_restart():
        conftest.native_signal(signal.SIGTERM, conftest.native_signal(signal.SIGTERM, 1))

    with guard() as heard:
        x = torch.randn(64)
        torch.testing.assert_close(x + 0, x)
        assert heard()
    with guard(exact=False) as heard:
        assert heard()
    blocks = (lambda: signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM]),
              lambda: signal.signal(signal.SIGTERM, lambda s, f: None),
              native_ignore, native_restart)
    whys = ("signal mask", "handler was replaced", "C-level handler", "went unheard")
    for block, why in zip(blocks, whys):
        with pytest.raises(AssertionError, match=why), guard(exact=why == "C-level handler"):
            block()
        assert signal.getsignal(signal.SIGTERM) is before
        assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    # The C-level reading follows a Python handler's install and its removal.
    default = conftest.c_signal_action(signal.SIGTERM) if before is signal.SIG_DFL else None
    old = signal.signal(signal.SIGTERM, lambda s, f: None)
    try:
        handled = conftest.c_signal_action(signal.SIGTERM)
        assert handled[0] not in (None, 0, 1)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        assert conftest.c_signal_action(signal.SIGTERM)[0] == 1
    finally:
        signal.signal(signal.SIGTERM, old)
    if default is not None:
        assert conftest.c_signal_action(signal.SIGTERM) == default

"""Specification of mage_jax.training.signals: the first SIGTERM or Ctrl-C is a stop request, a Ctrl-C after
an earlier stop signal exits at once (130) even when both reach Python's handler as one, a second SIGTERM
is only the same request again, and a command's process stays quiet and prompt through its exit."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from mage_jax.training import signals

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def exits(monkeypatch):
    """The exit statuses ``os._exit`` was called with (it returns instead of exiting)."""
    calls: list[int] = []
    monkeypatch.setattr(signals.os, "_exit", calls.append)
    return calls


def _wait_for(condition, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_second_sigterm_is_the_same_request_not_an_exit(exits):
    stop = threading.Event()
    restore = signals.install_stop_signals(stop)
    try:
        signal.raise_signal(signal.SIGTERM)
        assert stop.is_set()
        signal.raise_signal(signal.SIGTERM)
        time.sleep(0.2)  # the counting thread has seen both
    finally:
        restore()
    assert exits == []


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM])
def test_a_ctrl_c_after_an_earlier_stop_signal_exits_at_once_with_130(exits, capsys, first):
    stop = threading.Event()
    restore = signals.install_stop_signals(stop)
    try:
        signal.raise_signal(first)
        assert stop.is_set() and exits == []
        signal.raise_signal(signal.SIGINT)
        assert exits == [signals.EXIT_SECOND_INTERRUPT] == [130]
    finally:
        restore()
    assert exits == [130]  # once, though the handler and the counting thread both saw it
    assert capsys.readouterr().err.strip() == "interrupted again: exiting now without saving"


def test_two_ctrl_cs_while_the_main_thread_is_in_native_code_are_two(exits):
    """Both arrive while the main thread sleeps inside a C call (as in an XLA compile): CPython would run
    the Python handler once, afterwards, and the run would save and exit 75. The count of delivered
    signals exits at once, during the call. (SIGINT is blocked in the main thread for the call, so it
    is delivered to another thread and cannot end the sleep early: the main thread stays in C.)"""
    stop = threading.Event()
    restore = signals.install_stop_signals(stop)

    def press_twice():
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)

    presser = threading.Thread(target=press_twice)
    presser.start()
    exited_during_call = False
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            ctypes.CDLL(None).sleep(2)  # native code, the GIL released
            exited_during_call = exits == [130]
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        presser.join()
    finally:
        restore()
    assert exited_during_call


def test_an_inner_install_sees_a_stop_signal_that_reached_an_outer_one(exits):
    """The trainer's handlers inside the run's: a signal that came before the inner install (say while
    the evaluator was built) is a stop request for the inner work too, and a Ctrl-C after it inside is
    the second one."""
    outer, inner = threading.Event(), threading.Event()
    restore_outer = signals.install_stop_signals(outer)
    try:
        signal.raise_signal(signal.SIGTERM)
        restore_inner = signals.install_stop_signals(inner)
        try:
            assert inner.is_set()
            signal.raise_signal(signal.SIGINT)
            assert exits == [130]
        finally:
            restore_inner()
    finally:
        restore_outer()
    assert signals.stop_signalled()  # kept after the install ended, for the command's exit


def test_interrupting_work_is_abandoned_at_once_by_the_first_signal(exits):
    stop = threading.Event()
    restore = signals.install_stop_signals(stop, interrupt=True)
    started = time.monotonic()
    try:
        with pytest.raises(signals.StopRequested):
            os.kill(os.getpid(), signal.SIGTERM)
            while time.monotonic() - started < 30:  # pure Python work without safe points
                sum(range(1000))
    finally:
        restore()
    assert stop.is_set() and time.monotonic() - started < 10 and exits == []


def test_handlers_and_the_wakeup_fd_are_put_back():
    before = {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS}
    restore = signals.install_stop_signals(threading.Event())
    assert signal.getsignal(signal.SIGINT) is not before[signal.SIGINT]
    restore()
    restore()  # twice is harmless
    assert {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS} == before
    assert signal.set_wakeup_fd(-1) == -1
    assert not any(t.name == "stop-signal-counter" for t in threading.enumerate())
    signals.hold_until_exit(0)  # not a command's process (a test, a notebook): nothing changes
    assert {sig: signal.getsignal(sig) for sig in signals.STOP_SIGNALS} == before


EXITING = """
    import atexit, os, signal, sys, threading, time
    from mage_jax.training import signals

    stop = threading.Event()
    restore = signals.install_stop_signals(stop)
    if {first!r}:
        os.kill(os.getpid(), getattr(signal, {first!r}))
        time.sleep(0.1)
    restore()  # the run has ended: it saved, printed its line and returns its status

    def slow_exit():  # whatever the interpreter's exit runs (orbax, JAX, worker shutdown) takes a while
        os.kill(os.getpid(), signal.{then})
        time.sleep(5)
        print("exit finished", flush=True)

    atexit.register(slow_exit)
    signals.command_process()  # what ``python -m experiments.<name>`` marks
    signals.hold_until_exit({code})
    sys.exit({code})
"""


@pytest.mark.parametrize("first, then, code, expected, line", [
    ("SIGINT", "SIGINT", 75, 130, "interrupted again: exiting now without saving"),  # a second Ctrl-C
    ("SIGTERM", "SIGTERM", 75, 75, ""),  # a second SIGTERM: the exit it was going to make, at once
    ("", "SIGINT", 0, 0, ""),  # a finished run's exit, cut short
])
def test_a_signal_while_a_command_exits_ends_it_at_once_without_a_traceback(first, then, code, expected,
                                                                            line):
    script = textwrap.dedent(EXITING.format(first=first, then=then, code=code))
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == expected, out.stderr
    assert out.stderr.strip() == line and out.stdout == ""  # no atexit traceback, exit not waited for
    assert time.monotonic() - started < 30


STARTUP_HOOK = """
import os, signal, sys

class InterruptAtImport:
    def find_spec(self, name, path=None, target=None):
        if name == "jax" and not getattr(self, "done", False):
            self.done = True
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the command imports JAX
        return None

sys.meta_path.insert(0, InterruptAtImport())
"""


@pytest.mark.parametrize("module", ["experiments.kuhn_poker", "experiments.evaluate"])
def test_ctrl_c_while_a_command_starts_is_one_line(tmp_path, module):
    """The command is still importing (JAX, seconds on a cold start) when Ctrl-C comes: one line, and the
    process ends by SIGINT (the shell's 130) with nothing written."""
    (tmp_path / "sitecustomize.py").write_text(STARTUP_HOOK)
    out = subprocess.run([sys.executable, "-m", module, "--run-dir", str(tmp_path / "run")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])})
    assert out.returncode == -signal.SIGINT
    assert out.stderr.strip() == "interrupted while starting: nothing was written", out.stderr
    assert not (tmp_path / "run").exists()


def test_a_wakeup_fd_owned_by_someone_else_is_left_alone(exits):
    """In a notebook an event loop may own the wakeup fd: the Python handler alone counts then."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd)
    try:
        stop = threading.Event()
        restore = signals.install_stop_signals(stop)
        try:
            assert signal.set_wakeup_fd(write_fd) == write_fd  # not replaced
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            assert exits == [130]
        finally:
            restore()
        assert signal.set_wakeup_fd(write_fd) == write_fd
    finally:
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)

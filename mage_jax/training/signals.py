"""SIGTERM and Ctrl-C as stop requests: a flag the work honours at its next safe point.

Training and evaluation-only runs share this (docs/preemption.md, docs/reliability.md): the first
SIGTERM or SIGINT sets the flag (the rollout raises ``rollout.stopping.Interrupted`` at its next turn); a
SIGINT after an earlier stop signal (a second Ctrl-C) exits at once with 130, saving nothing. A second
SIGTERM is the same request again (a scheduler may repeat it within its grace period), never an
immediate exit.

Counted, not just handled: CPython runs a Python handler once per *pending* signal, so two Ctrl-Cs that
arrive while the main thread is inside one long native call (an XLA compile, a wait on the device) reach
the handler as one, and the run would save and exit 75 instead of exiting at once. ``signal.set_wakeup_fd``
writes one byte per delivered signal; a thread reads them and exits on the second Ctrl-C even while the
main thread is busy in native code. (Where another component owns the wakeup fd, e.g. an asyncio loop in a
notebook, the Python handler alone decides.)

Installs nest (an evaluation inside a training run, the report after it): the outermost one starts the
count, and whether a stop signal arrived is kept after it ends (``stop_signalled``), so that a command
can treat a Ctrl-C during its exit as the second one (``hold_until_exit``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

EXIT_SECOND_INTERRUPT = 130
"""Exit status of a second Ctrl-C (the shell's 128 + SIGINT): nothing is saved."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(BaseException):
    """Raised in the main thread by a stop signal while work without safe points of its own runs
    (``install_stop_signals(..., interrupt=True)``: drawing the plots after the results are written)."""


class _Count:
    """What the outermost install has seen: stop signals by the Python handler and by the fd reader."""

    def __init__(self) -> None:
        self.depth = 0
        self.by_handler = False
        self.by_reader = False
        self.exiting = threading.Lock()
        self.reader: _Reader | None = None


_count = _Count()


def stop_signalled() -> bool:
    """Whether a SIGTERM or SIGINT reached the handlers of the latest (outermost) install."""
    return _count.by_handler or _count.by_reader


def _exit_now(message: str = "interrupted again: exiting now without saving",
              code: int = EXIT_SECOND_INTERRUPT) -> None:
    if not _count.exiting.acquire(blocking=False):
        return  # the other observer of the same signal is exiting already
    if message:
        print(f"\n{message}", file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(code)


class _Reader:
    """Reads the wakeup fd: one byte per delivered signal, counted even while the main thread is busy."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.previous = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        self.thread = threading.Thread(target=self._run, name="stop-signal-counter", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self.read_fd, 64)
            except OSError:
                return
            for signum in data:
                if signum == 0:  # ``close``: the install ended
                    return
                if signum not in STOP_SIGNALS:
                    continue
                if signum == signal.SIGINT and _count.by_reader:
                    _exit_now()
                _count.by_reader = True

    def close(self) -> None:
        signal.set_wakeup_fd(self.previous)
        with contextlib.suppress(OSError):
            os.write(self.write_fd, b"\0")
        self.thread.join(timeout=5)
        os.close(self.write_fd)
        os.close(self.read_fd)


def _start_reader() -> _Reader | None:
    """The fd reader, unless another component already owns the wakeup fd."""
    try:
        previous = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(previous)
    except ValueError:  # not the main thread of the main interpreter
        return None
    return _Reader() if previous == -1 else None


def install_stop_signals(stop: threading.Event, *, interrupt: bool = False) -> Callable[[], None]:
    """SIGTERM and SIGINT set ``stop``; a SIGINT after an earlier stop signal exits at once (130).
    ``interrupt``: the first one also raises ``StopRequested`` in the main thread. Returns the function
    that puts the previous handlers back (a no-op outside the main thread, where handlers cannot be set).
    A stop signal already seen by an enclosing install sets ``stop`` at once."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    if _count.depth == 0:
        _count.by_handler = _count.by_reader = False
        _count.exiting = threading.Lock()
        _count.reader = _start_reader()
    elif stop_signalled():
        stop.set()
    _count.depth += 1
    restored: list[bool] = []

    def handler(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and _count.by_handler:
            _exit_now()
        _count.by_handler = True
        stop.set()
        if interrupt and not restored:  # never from inside ``restore`` (the caller's handling is over)
            raise StopRequested

    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        if restored:
            return
        restored.append(True)
        for sig, old in previous.items():
            signal.signal(sig, old)
        _count.depth -= 1
        if _count.depth == 0 and _count.reader is not None:
            _count.reader.close()
            _count.reader = None

    return restore


def hold_until_exit(code: int) -> None:
    """For a command whose work has ended with exit status ``code``: from now until the process exits,
    SIGTERM and SIGINT end it at once with ``code`` (nothing is left to save; no traceback from whatever
    the interpreter's exit was running), except a Ctrl-C after a stop signal of the run, which is the
    second one (130). The handlers stay, so this acts only in a command's own process
    (``command_process``); elsewhere (tests, notebooks calling ``main``) it does nothing."""
    if not _command[0] or threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and stop_signalled():
            _exit_now()
        _exit_now("", code)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


_command = [False]


def command_process() -> None:
    """Mark this process as a command (``python -m experiments.<name>``; called by the ``experiments``
    package before the command's imports): an uncaught ``KeyboardInterrupt`` (a Ctrl-C while the command
    starts, before it handles signals itself) prints one line instead of a traceback, and the interpreter
    then ends the process by SIGINT as usual (the shell's 130); ``hold_until_exit`` acts."""
    _command[0] = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        if issubclass(kind, KeyboardInterrupt):
            print("\ninterrupted while starting: nothing was written", file=sys.stderr, flush=True)
            return
        previous(kind, value, traceback)

    sys.excepthook = hook

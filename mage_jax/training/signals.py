"""SIGTERM and Ctrl-C as stop requests: a flag the work honours at its next safe point.

Training and evaluation-only runs share this: the first SIGTERM or SIGINT sets the flag (the
rollout raises ``rollout.stopping.Interrupted`` at its next turn), a second SIGINT exits at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

EXIT_SECOND_INTERRUPT = 130
"""Exit status of a second Ctrl-C (the shell's 128 + SIGINT): nothing is saved."""


def install_stop_signals(stop: threading.Event) -> Callable[[], None]:
    """SIGTERM and SIGINT set ``stop``; a second SIGINT exits at once. Returns the function that puts
    the previous handlers back (a no-op outside the main thread, where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and stop.is_set():
            print("\ninterrupted again: exiting now without saving", file=sys.stderr, flush=True)
            os._exit(EXIT_SECOND_INTERRUPT)
        stop.set()

    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore

"""Progress of the trainer and the evaluator: a tqdm bar in a terminal, plain lines in a log.

A bar redraws itself with carriage returns, which a redirected log keeps as hundreds of updates on one
line. When stderr is not a terminal (a file, a pipe, a batch job), `progress_bar` returns a `LineProgress`
instead: one ordinary line whenever the count crosses another tenth of its total, and at most every
``MAGE_PROGRESS_SECONDS`` seconds (default 30) while only the numbers beside it move (tokens generated,
turns played), so a log shows both how far a run is and that it is still alive. Both have the interface
the trainer and the evaluator use; `NoBar` is the silent one (``logging.progress false``).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from tqdm.auto import tqdm

INTERVAL_VAR = "MAGE_PROGRESS_SECONDS"
DEFAULT_INTERVAL = 30.0


class NoBar:
    """The progress-bar interface the trainer and the evaluator use, doing nothing."""

    def update(self, n: int = 1) -> None: ...
    def set_postfix(self, *args: Any, **kwargs: Any) -> None: ...
    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None: ...
    def set_description(self, *args: Any, **kwargs: Any) -> None: ...
    def close(self) -> None: ...


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else f"{rest // 60}m{rest % 60:02d}s"


class LineProgress:
    """A progress bar written as plain lines (for logs), e.g.
    ``train: 12/30 iterations (40%), 6m02s elapsed, ~9m03s left | rollout_succ=0.55, ...``.

    A line is written at the start, then when the count has crossed another tenth of the total or
    `interval` seconds have passed since the last line, checked whenever the count or the text beside it
    changes; `close` writes
    the last state once more if it was not written yet. Count changes wait for the next text change, so
    a line shows the numbers that belong to its count (the trainer updates, then sets the iteration's).
    """

    def __init__(self, *, total: int, desc: str, initial: int = 0, unit: str = "it",
                 stream: TextIO | None = None, interval: float = DEFAULT_INTERVAL):
        self.total, self.desc, self.n, self.unit = total, desc, initial, unit
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.postfix = ""
        self._started = time.monotonic()
        self._last_time = -math.inf
        self._last_tenth = self._tenth(initial)
        self._last_text: str | None = None
        self._closed = False
        self._write()  # where it starts

    def _tenth(self, n: int) -> int:
        return 10 * n // max(self.total, 1)

    def update(self, n: int = 1) -> None:
        self._maybe_write()
        self.n += n

    def set_postfix(self, ordered_dict: Mapping[str, Any] | None = None, refresh: bool = True,
                    **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{key}={value}" for key, value in items.items())
        self._maybe_write()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = str(s)
        self._maybe_write()

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""
        self._maybe_write()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.text() != self._last_text:
                self._write()

    def text(self) -> str:
        """The line for the current state (elapsed time and the estimate aside)."""
        count = f"{self.n}/{self.total} {self.unit}"
        if self.total:
            count += f" ({100 * self.n // self.total}%)"
        return f"{self.desc}: {count}" + (f" | {self.postfix}" if self.postfix else "")

    def _maybe_write(self) -> None:
        if self._closed:
            return
        now = time.monotonic()
        if self._tenth(self.n) != self._last_tenth or now - self._last_time >= self.interval:
            self._write()

    def _write(self) -> None:
        now = time.monotonic()
        elapsed = now - self._started
        timing = f"{_duration(elapsed)} elapsed"
        if 0 < self.n < self.total:
            timing += f", ~{_duration(elapsed / self.n * (self.total - self.n))} left"
        text = self.text()
        head, _, tail = text.partition(" | ")
        print(f"{head}, {timing}" + (f" | {tail}" if tail else ""), file=self.stream, flush=True)
        self._last_time, self._last_tenth, self._last_text = now, self._tenth(self.n), text


def _interval() -> float:
    value = os.environ.get(INTERVAL_VAR, "")
    try:
        return max(float(value), 0.0) if value else DEFAULT_INTERVAL
    except ValueError:
        return DEFAULT_INTERVAL


def progress_bar(*, total: int, desc: str, enabled: bool, initial: int = 0, leave: bool = True,
                 unit: str = "it") -> Any:
    """A tqdm bar on stderr when it is a terminal, `LineProgress` lines otherwise, `NoBar` when off."""
    if not enabled:
        return NoBar()
    stream = sys.stderr
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return LineProgress(total=total, desc=desc, initial=initial, unit=unit, stream=stream,
                            interval=_interval())
    return tqdm(total=total, desc=desc, initial=initial, leave=leave, dynamic_ncols=True, file=stream,
                unit=f" {unit}")

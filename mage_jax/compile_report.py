"""How many XLA programs a process compiled, in how many seconds, and how many came from the persistent
compilation cache (``mage_jax.compilation_cache``): the compile report of a run's metrics and summary,
so that a change which compiles more (or caches less) shows in every run.

Counted with JAX's monitoring events: one ``/jax/core/compile/backend_compile_duration`` per program
handed to the backend (a cache hit included: its duration is then the load), one
``/jax/compilation_cache/cache_hits`` per program loaded from disk. JAX's listeners cannot be removed in
every version, so one counter is installed per process (``counter()``) and runs read differences of its
snapshots. An event a JAX version does not record stays at 0; a JAX without the monitoring hooks gives
None throughout.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
METRIC_PREFIX = "compile/"


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """Programs handed to XLA's backend (compiled or loaded from the cache), their seconds, cache hits.
    None: this JAX records no such events."""

    programs: int | None
    seconds: float | None
    cache_hits: int | None

    def __sub__(self, earlier: CompileReport) -> CompileReport:
        """What happened between ``earlier`` and this snapshot."""
        return CompileReport(*(None if a is None or b is None else a - b
                               for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(earlier),
                                               strict=True)))

    def metrics(self) -> dict[str, float]:
        """``compile/programs``, ``compile/seconds``, ``compile/cache_hits`` as floats (missing: left out)."""
        return {METRIC_PREFIX + k: float(v) for k, v in dataclasses.asdict(self).items() if v is not None}

    def describe(self) -> str:
        """One line for a person: ``compiled 42 XLA programs in 61 s (30 from the persistent cache)``."""
        if self.programs is None:
            return "compile report unavailable (this JAX records no compile events)"
        hits = "unknown" if self.cache_hits is None else str(self.cache_hits)
        return (f"compiled {self.programs} XLA programs in {self.seconds or 0.0:.0f} s "
                f"({hits} from the persistent cache)")


class CompileCounter:
    """Totals of this process's compile events since ``install`` (thread-safe: XLA may compile on
    several threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._programs = 0
        self._seconds = 0.0
        self._hits = 0
        self._installed = False

    def install(self) -> CompileCounter:
        """Register the listeners with JAX (once; a second call does nothing)."""
        monitoring = getattr(jax, "monitoring", None)
        if self._installed or monitoring is None:
            return self
        if not hasattr(monitoring, "register_event_duration_secs_listener"):
            return self
        monitoring.register_event_duration_secs_listener(self._on_duration)
        if hasattr(monitoring, "register_event_listener"):
            monitoring.register_event_listener(self._on_event)
        self._installed = True
        return self

    def _on_duration(self, event: str, duration: float, *args: Any, **kwargs: Any) -> None:
        if event == COMPILE_EVENT:
            with self._lock:
                self._programs += 1
                self._seconds += float(duration)

    def _on_event(self, event: str, *args: Any, **kwargs: Any) -> None:
        if event == CACHE_HIT_EVENT:
            with self._lock:
                self._hits += 1

    def snapshot(self) -> CompileReport:
        """The totals so far (None throughout when JAX has no monitoring hooks)."""
        if not self._installed:
            return CompileReport(None, None, None)
        with self._lock:
            return CompileReport(self._programs, self._seconds, self._hits)


_COUNTER = CompileCounter()


def counter() -> CompileCounter:
    """This process's counter, installed on first use."""
    return _COUNTER.install()

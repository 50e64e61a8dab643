"""What the suite does when one of its xdist workers dies: run the test it died in once more, on a
fresh worker, and carry on with everyone else's files.

A worker can die without a Python error: a native crash (a segmentation fault inside XLA's CPU
compiler ended one CI run this way) or the suite's hang guard (``faulthandler_timeout`` with
``faulthandler_exit_on_timeout`` in ``pyproject.toml``, which dumps every thread's stack first).
pytest-xdist 3.8's file scheduler (``--dist loadfile``) then can stall for good: it puts the dead
worker's files back with the fatal test still pending and may hand the replacement a single test,
which a worker never starts until it holds a second one or is told to stop. CI then runs into its
time limit and prints no summary.

``CrashTolerantFileScheduling`` (chosen through xdist's ``pytest_xdist_make_scheduler`` hook whenever
``--dist loadfile`` is on) keeps the same file-at-a-time scheduling and differs only there:

* the test a worker died in runs again at the front of the queue, ``CRASH_RERUNS`` times at most;
  its crash report is then a *rerun* (``R``, listed after the run with xdist's message) and not a
  failure. A test that kills its worker every time fails, as before;
* the dead worker's unfinished files go back to the front of the queue, finished ones do not;
* a worker is never left holding fewer than two tests while files are queued, and is told to stop
  when none are.

A crash that a rerun survives is still printed in full (faulthandler's stack, the summary's
"worker crashes" section), so a flaky native crash stays visible without failing the run.
"""

from __future__ import annotations

from collections import Counter

import pytest
from xdist.scheduler import LoadFileScheduling

CRASH_RERUNS = 1
"""How many times a test its worker died in is run again before its crash counts as a failure."""

RERUN = "rerun"
"""The outcome of a crash report whose test runs again (pytest's summary counts it as "N rerun")."""


class CrashTolerantFileScheduling(LoadFileScheduling):
    """xdist's file scheduling, except after a worker dies (see the module docstring)."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        self.crashes: Counter[str] = Counter()
        """How many workers each test has taken down."""

    def will_rerun(self, nodeid: str) -> bool:
        """Whether the test a worker just died in goes back to the queue."""
        return 0 < self.crashes[nodeid] <= CRASH_RERUNS

    def remove_node(self, node) -> str | None:
        """Forget ``node``; if it died mid-file, requeue its unfinished files and name the test it died
        in (the first unfinished one: a worker runs its tests in the order they were sent)."""
        workload = self.assigned_work.pop(node)
        unfinished = [nodeid for unit in workload.values() for nodeid, done in unit.items() if not done]
        if not unfinished:
            return None
        crashed = unfinished[0]
        self.crashes[crashed] += 1
        for unit in workload.values():
            if crashed in unit:
                unit[crashed] = not self.will_rerun(crashed)
        for scope, unit in reversed(list(workload.items())):  # in their order, ahead of the rest
            if not all(unit.values()):
                self.workqueue[scope] = unit
                self.workqueue.move_to_end(scope, last=False)
        for other in self.nodes:
            self._reschedule(other)
        return crashed

    def _reschedule(self, node) -> None:
        super()._reschedule(node)
        # A worker starts a test only once it holds the next one or has been told to stop.
        while not node.shutting_down and self._pending_of(self.assigned_work[node]) < 2:
            if self.workqueue:
                self._assign_work_unit(node)
            else:
                node.shutdown()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log) -> LoadFileScheduling | None:
    if config.getvalue("dist") == "loadfile":
        return CrashTolerantFileScheduling(config, log)
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched) -> None:
    if isinstance(sched, CrashTolerantFileScheduling) and sched.will_rerun(crashitem):
        report.outcome = RERUN  # type: ignore[assignment]
        report.longrepr = f"{report.longrepr}; run again on a fresh worker"


def pytest_report_teststatus(report: pytest.TestReport) -> tuple[str, str, tuple[str, dict]] | None:
    if report.outcome == RERUN:
        return RERUN, "R", ("RERUN", {"yellow": True})
    return None


def pytest_terminal_summary(terminalreporter) -> None:
    reruns = terminalreporter.stats.get(RERUN, [])
    if reruns:
        terminalreporter.write_sep("=", "worker crashes (each test was run again)", yellow=True)
        for report in reruns:
            terminalreporter.write_line(str(report.longrepr))

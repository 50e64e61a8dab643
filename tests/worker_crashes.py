"""What the suite does when one of its xdist workers dies: run the test it died in once more, on
another worker, and carry on with everyone else's files.

A worker can die without a Python error: a native crash (a segmentation fault inside XLA's CPU
compiler ended one CI run this way) or the suite's hang guard (``faulthandler_timeout`` with
``faulthandler_exit_on_timeout`` in ``pyproject.toml``, which dumps every thread's stack first).
pytest-xdist 3.8's file scheduler (``--dist loadfile``) then can stall for good: it puts the dead
worker's files back with the fatal test still pending and may hand the replacement a single test,
which a worker never starts until it holds a second one or is told to stop. CI then runs into its
time limit and prints no summary.

``CrashTolerantFileScheduling`` (chosen through xdist's ``pytest_xdist_make_scheduler`` hook whenever
``--dist loadfile`` is on) keeps the same file-at-a-time scheduling and differs only there:

* the test a worker died in runs again at the front of the queue (on the next worker with room for
  its file: a replacement, or one that was already running), ``CRASH_RERUNS`` times at most; its
  crash report is then a *rerun* (``R``, listed after the run with xdist's message) and not a
  failure. A test that kills its worker every time fails, as before;
* the dead worker's unfinished files go back to the front of the queue, finished ones do not;
* a worker is never left holding fewer than two tests while files are queued, and is told to stop
  when none are; a replacement gets work only once it has collected the tests.

A crash that a rerun survives is still printed in full (faulthandler's stack, the summary's
"worker crashes" section), so a flaky native crash stays visible without failing the run. If the run
ends with a test still owed its rerun, or with files never run (xdist stops replacing workers after
``--max-worker-restart`` crashes), it fails, naming them. A run stopped by Ctrl-C says it was
interrupted and how many tests did not finish, and blames no worker. (A crash in a test's teardown, after its
call passed, reports the test as passed twice.)
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
from xdist.scheduler import LoadFileScheduling

SCHEDULER = pytest.StashKey["CrashTolerantFileScheduling"]()
LOST = pytest.StashKey[list]()  # the tests a run ended without finishing, for its summary
NOT_RUN = pytest.StashKey[int]()  # how many tests an interrupted run (Ctrl-C) left unfinished

CRASH_RERUNS = 1
"""How many times a test its worker died in is run again before its crash counts as a failure."""

XDIST_INTERNALS = ("assigned_work", "workqueue", "registered_collections", "nodes", "_assign_work_unit",
                   "_reschedule", "_pending_of", "remove_node", "mark_test_complete")
"""What ``CrashTolerantFileScheduling`` reads or overrides of xdist's scheduler besides its documented
hooks: internals of pytest-xdist 3.8, which ``pyproject.toml`` bounds the test extra to (a test checks the
bound, the installed version and these names)."""

RERUN = "rerun"
"""The outcome of a crash report whose test runs again (pytest's summary counts it as "N rerun")."""


class CrashTolerantFileScheduling(LoadFileScheduling):
    """xdist's file scheduling, except after a worker dies (see the module docstring)."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        self.crashes: Counter[str] = Counter()
        """How many workers each test has taken down."""
        self.owed: set[str] = set()
        """Tests put back in the queue after a crash and not run again yet."""

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
        if self.will_rerun(crashed):
            self.owed.add(crashed)
        else:
            self.owed.discard(crashed)  # reported failed by xdist
        for scope, unit in reversed(list(workload.items())):  # in their order, ahead of the rest
            if not all(unit.values()):
                self.workqueue[scope] = unit
                self.workqueue.move_to_end(scope, last=False)
        for other in self.nodes:
            self._reschedule(other)
        return crashed

    def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
        self.owed.discard(self.registered_collections[node][item_index])
        super().mark_test_complete(node, item_index, duration)

    def unfinished(self) -> list[str]:
        """Tests that never ran to the end: queued, held by a worker, or owed a rerun."""
        held = [nodeid for units in (self.workqueue, *self.assigned_work.values()) for unit in units.values()
                for nodeid, done in unit.items() if not done]
        return sorted(set(held) | self.owed)

    def _assign_work_unit(self, node) -> None:
        # A worker that died a moment ago refuses the message; its "down" event requeues what it was given.
        with contextlib.suppress(OSError):
            super()._assign_work_unit(node)

    def _reschedule(self, node) -> None:
        if node not in self.registered_collections:
            return  # a replacement still collecting: ``schedule`` gives it work once it has collected
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
        config.stash[SCHEDULER] = CrashTolerantFileScheduling(config, log)
        return config.stash[SCHEDULER]
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched) -> None:
    if isinstance(sched, CrashTolerantFileScheduling) and sched.will_rerun(crashitem):
        report.outcome = RERUN  # type: ignore[assignment]
        report.longrepr = f"{report.longrepr}; to be run again"


def pytest_report_teststatus(report: pytest.TestReport) -> tuple[str, str, tuple[str, dict]] | None:
    if report.outcome == RERUN:
        return RERUN, "R", ("RERUN", {"yellow": True})
    return None


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    scheduler = session.config.stash.get(SCHEDULER, None)
    lost = scheduler.unfinished() if scheduler is not None else []
    if lost and session.exitstatus == pytest.ExitCode.INTERRUPTED:  # Ctrl-C: not the workers' doing
        session.config.stash[NOT_RUN] = len(lost)
    elif lost:
        session.config.stash[LOST] = lost
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    reruns = terminalreporter.stats.get(RERUN, [])
    if reruns:
        terminalreporter.write_sep("=", "worker crashes (each test went back to the queue)", yellow=True)
        for report in reruns:
            terminalreporter.write_line(str(report.longrepr))
    not_run = terminalreporter.config.stash.get(NOT_RUN, 0)
    if not_run:
        terminalreporter.write_sep("=", f"interrupted: {not_run} tests did not run to the end", yellow=True)
    lost = terminalreporter.config.stash.get(LOST, [])
    if lost:
        terminalreporter.write_sep("=", f"{len(lost)} tests never finished after worker crashes", red=True)
        for nodeid in lost:
            terminalreporter.write_line(nodeid)

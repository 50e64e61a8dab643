"""A worker that dies (a native crash, or the hang guard) costs the suite one rerun of the test it died
in, never a stalled run: every other test still runs, a crash the rerun survives is a "rerun" and not
a failure, a test that kills its worker every time fails, and a run that could not finish every test
fails. Each case is a small pytest run on two workers, scheduled as the suite is
(``tests/worker_crashes.py``, ``--dist loadfile``)."""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from xdist.scheduler.loadscope import LoadScopeScheduling

from tests.worker_crashes import XDIST_INTERNALS

ROOT = Path(__file__).resolve().parents[1]
INI = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]

PASSING = """
    import time

    def test_one(): time.sleep(0.2)
    def test_two(): time.sleep(0.2)
    def test_three(): time.sleep(0.2)
"""

SEGFAULTING = """
    import os, signal

    def test_before(): pass
    def test_segfaults(): os.kill(os.getpid(), signal.SIGSEGV)
    def test_after(): pass
"""


def run_suite(folder: Path, files: dict[str, str], *options: str) -> subprocess.CompletedProcess:
    for name, text in files.items():
        (folder / name).write_text(textwrap.dedent(text))
    command = [sys.executable, "-m", "pytest", "-p", "tests.worker_crashes", "-p", "no:cacheprovider", "-rA",
               "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder", *options]
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def passed(out: subprocess.CompletedProcess) -> set[str]:
    return {line.split()[1] for line in out.stdout.splitlines() if line.startswith("PASSED ")}


def test_a_test_that_crashes_its_worker_once_runs_again_and_the_run_passes(tmp_path):
    marker = tmp_path / "crashed-once"
    out = run_suite(tmp_path, {
        "test_a.py": PASSING,
        "test_b.py": f"""
            import os, pathlib, signal

            def test_before(): pass
            def test_segfaults_once():
                marker = pathlib.Path({str(marker)!r})
                if not marker.exists():
                    marker.touch()
                    os.kill(os.getpid(), signal.SIGSEGV)
            def test_after(): pass
        """,
        "test_c.py": PASSING,
    })
    assert out.returncode == 0, out.stdout[-3000:]
    assert passed(out) == {f"test_{f}.py::test_{t}" for f in "ac" for t in ("one", "two", "three")} | {
        "test_b.py::test_before", "test_b.py::test_segfaults_once", "test_b.py::test_after"}
    assert "crashed while running 'test_b.py::test_segfaults_once'; to be run again" in out.stdout
    assert "Segmentation fault" in out.stderr + out.stdout  # faulthandler's stack of the crash is kept
    assert " 9 passed, 1 rerun in " in out.stdout.splitlines()[-1]


def test_a_test_that_always_kills_its_worker_fails_after_one_rerun_and_everything_else_runs(tmp_path):
    exit_on_timeout = INI["faulthandler_exit_on_timeout"]  # the suite's own setting; its timeout is 3 s here
    out = run_suite(tmp_path, {
        "test_a.py": PASSING,
        "test_b.py": SEGFAULTING,
        "test_c.py": PASSING,
        "test_d.py": """
            import time

            def test_hangs(): time.sleep(300)
        """,
        "test_e.py": PASSING,
    }, "-o", "faulthandler_timeout=3", "-o", f"faulthandler_exit_on_timeout={exit_on_timeout}")
    assert out.returncode == 1
    assert passed(out) == {f"test_{f}.py::test_{t}" for f in "ace" for t in ("one", "two", "three")} | {
        "test_b.py::test_before", "test_b.py::test_after"}
    summary = out.stdout.splitlines()[-1]
    assert " 2 failed, 11 passed, 2 rerun in " in summary, summary
    for test in ("test_b.py::test_segfaults", "test_d.py::test_hangs"):
        assert f"FAILED {test} - worker" in out.stdout
    assert "Timeout (0:00:03)!" in out.stderr + out.stdout  # the hang guard dumped the stuck stack


def test_a_crash_while_a_replacement_worker_is_still_collecting_waits_for_it(tmp_path):
    """gw0 dies; its replacement takes seconds to collect (a slow import); gw1 dies meanwhile. The
    replacement gets its share of the work once it has collected, not before (xdist would index its
    collection and stop the run with an internal error)."""
    first, second = tmp_path / "first", tmp_path / "second"
    out = run_suite(tmp_path, {
        "test_a.py": f"""
            import os, pathlib, signal, time

            def test_segfaults_first():
                time.sleep(0.2)
                if not pathlib.Path({str(first)!r}).exists():
                    pathlib.Path({str(first)!r}).touch()
                    os.kill(os.getpid(), signal.SIGSEGV)
            def test_after(): pass
        """,
        "test_b.py": f"""
            import os, pathlib, signal, time

            def test_segfaults_while_the_replacement_collects():
                while not pathlib.Path({str(first)!r}).exists():
                    time.sleep(0.01)
                time.sleep(1.0)
                if not pathlib.Path({str(second)!r}).exists():
                    pathlib.Path({str(second)!r}).touch()
                    os.kill(os.getpid(), signal.SIGSEGV)
            def test_after(): pass
        """,
        "test_c.py": f"""
            import pathlib, time

            if pathlib.Path({str(first)!r}).exists():
                time.sleep(4)  # a replacement worker collects slowly
            def test_one(): pass
        """,
    })
    assert out.returncode == 0, out.stdout[-3000:]
    assert len(passed(out)) == 5 and " 5 passed, 2 rerun in " in out.stdout.splitlines()[-1]


def test_a_run_that_cannot_replace_a_dead_worker_fails_and_names_the_tests_it_never_finished(tmp_path):
    """With no worker restarts left (here none at all) the crashed test's rerun and the rest of its file
    never run: the run fails and lists them, although every test that ran passed."""
    out = run_suite(tmp_path, {
        "test_a.py": PASSING,
        "test_b.py": SEGFAULTING,
    }, "--max-worker-restart", "0")
    assert out.returncode == 1 and "failed" not in out.stdout.splitlines()[-1]
    tail = out.stdout[out.stdout.index("tests never finished after worker crashes"):].splitlines()[1:]
    listed = set(tail[:next(i for i, line in enumerate(tail) if line.startswith("="))])
    assert {"test_b.py::test_segfaults", "test_b.py::test_after"} <= listed and not listed & passed(out)


def test_the_suite_guards_against_hangs_with_a_timeout_that_ends_the_worker():
    assert INI["faulthandler_exit_on_timeout"] is True and 600 <= INI["faulthandler_timeout"] <= 1200


def test_the_test_extra_bounds_pytest_xdist_to_the_minor_release_the_scheduler_was_written_against():
    """The crash scheduler overrides xdist internals (``XDIST_INTERNALS``) that a new minor release may
    rename: the extra admits one minor release, the installed one lies inside it, and every internal the
    scheduler touches is still there."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (spec,) = [Requirement(r).specifier for r in extras["test"] if Requirement(r).name == "pytest-xdist"]
    lower = [s.version for s in spec if s.operator == ">="]
    upper = [s.version for s in spec if s.operator == "<"]
    assert lower and upper, f"pytest-xdist{spec} must have a lower and an upper bound"
    major, minor = (int(x) for x in lower[0].split(".")[:2])
    assert f"{major}.{minor + 1}" not in spec, f"pytest-xdist{spec} admits more than one minor release"
    assert importlib.metadata.version("pytest-xdist") in spec
    source = inspect.getsource(LoadScopeScheduling)
    missing = [n for n in XDIST_INTERNALS
               if not (hasattr(LoadScopeScheduling, n) or re.search(rf"self\.{n}\b", source))]
    assert not missing, f"pytest-xdist no longer has {missing}: update tests/worker_crashes.py and the bound"


def test_a_run_stopped_by_ctrl_c_says_it_was_interrupted_and_blames_no_worker(tmp_path):
    """Ctrl-C at the terminal (SIGINT to the process group: pytest and its workers) while tests run: the
    summary says the run was interrupted and how many tests did not finish, not that workers crashed."""
    started = tmp_path / "started"
    files = {
        "test_a.py": f"""
            import pathlib, time

            def test_waits():
                pathlib.Path({str(started)!r}).touch()
                time.sleep(60)
            def test_after(): pass
        """,
        "test_b.py": PASSING,
        "test_c.py": PASSING,
    }
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    command = [sys.executable, "-m", "pytest", "-p", "tests.worker_crashes", "-p", "no:cacheprovider", "-rA",
               "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder"]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the waiting test never started"
            time.sleep(0.05)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 2, stdout[-3000:]  # pytest's "interrupted"
    assert "worker crashes" not in stdout, stdout[-3000:]
    assert re.search(r"interrupted: [1-9][0-9]* tests did not run to the end", stdout), stdout[-3000:]

"""``tests/_multiprocess.py``: the processes it starts never outlive the test that started them, whether that
test is interrupted (Ctrl-C) or its worker is killed (the suite's per-test timeout), so no process is left
waiting forever for a peer that is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests._multiprocess import ROOT

# A parent that starts one child through run_processes, prints the child's pid, and waits for it; the child
# makes the file READY once it runs its program.
PARENT = """
import sys
from tests import _multiprocess
real = _multiprocess.subprocess.Popen
class Announcing(real):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        print("CHILD", self.pid, flush=True)
_multiprocess.subprocess.Popen = Announcing
_multiprocess.run_processes("import os, time; open(os.environ['READY'], 'w').close(); time.sleep(600)",
                            n=1, devices_per_process=1, timeout=600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the death signal is Linux's")
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "killed"])
def test_a_child_process_does_not_outlive_its_interrupted_or_killed_parent(how, tmp_path):
    ready = tmp_path / "ready"
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": ROOT, "READY": str(ready)})
    try:
        line = parent.stdout.readline()
        assert line.startswith("CHILD "), line
        child = int(line.split()[1])
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists() and _alive(child)  # the child runs its program: it would sleep 600 s
        parent.send_signal(how)
        parent.wait(timeout=60)
        assert _gone_within(child, 30), f"the child {child} outlived its parent ({how.name})"
    finally:
        if parent.poll() is None:
            parent.kill()

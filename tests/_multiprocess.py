"""Start several JAX processes on this machine, as a multi-host run would: one coordinator, CPU devices.

``run_processes(code_or_script, n=2, devices_per_process=4, timeout=...)`` runs ``n`` Python processes
of the same program (a path to a script, or the code itself) with ``devices_per_process`` fake CPU
devices each, and waits for all of them. Every process finds in its environment what
``mage_jax.models.sharding.initialize_from_environment`` reads (``MAGE_DISTRIBUTED=1``,
``JAX_COORDINATOR_ADDRESS`` on a free local port, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``); with
``n=1`` there is no coordinator and the single process sees all its devices alone. The program prints
what it wants to compare; the result is each process's ``CompletedProcess`` (stdout, stderr, return
code), in process order; ``check`` (default) raises ``ProcessesFailed`` with every process's output
when one failed or the group ran past its timeout (a deadlock fails, never hangs). CPU collectives
across the processes go through gloo. ``run_groups`` starts several such groups at once, each its own
run (a single-process reference beside the multi-process run it is compared with).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from tests.xla_env import with_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class ProcessesFailed(AssertionError):
    """A process exited non-zero or the group ran past its timeout; the message holds each one's output."""


def _die_with_parent() -> None:
    """In the child before it runs: the kernel kills it when the process that started it dies (a pytest
    worker killed by its timeout), so no process waits forever for a peer that is gone."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port() -> int:
    """A TCP port nobody listens on right now (the coordinator binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass(frozen=True)
class Group:
    """``n`` processes of one program (a ``.py`` path, else Python source) with ``args``, each seeing
    ``devices_per_process`` fake CPU devices; with ``n > 1`` they form one run through a coordinator."""

    code_or_script: str
    n: int = 2
    devices_per_process: int = 4
    args: tuple[str, ...] = ()


def run_processes(code_or_script: str, n: int = 2, devices_per_process: int = 4, timeout: float = 600,
                  args: tuple[str, ...] = (), *, check: bool = True) -> list[subprocess.CompletedProcess]:
    """Run ``n`` processes of ``code_or_script`` (a ``.py`` path, else Python source) with ``args``;
    kill them all when one fails or ``timeout`` seconds pass."""
    return run_groups([Group(code_or_script, n, devices_per_process, tuple(args))], timeout, check=check)[0]


def run_groups(groups: Sequence[Group], timeout: float = 600, *, check: bool = True
               ) -> list[list[subprocess.CompletedProcess]]:
    """Start every group at once (each its own run, with its own coordinator) and wait for all: a
    reference run and the multi-process run it is compared with overlap instead of queueing. Kills every
    process when one fails or ``timeout`` seconds pass; the result is each group's processes in order."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for g, group in enumerate(groups):
            script = group.code_or_script
            if not (script.endswith(".py") and os.path.isfile(script)):
                script = os.path.join(tmp, f"program{g}.py")
                with open(script, "w") as f:
                    f.write(group.code_or_script)
            port = free_port()
            for i in range(group.n):
                env = dict(os.environ)
                env.update(
                    PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
                    JAX_PLATFORMS="cpu",
                    JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
                    XLA_FLAGS=with_flags(f"--xla_force_host_platform_device_count={group.devices_per_process}"),
                )
                if group.n > 1:
                    env.update(MAGE_DISTRIBUTED="1", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                               JAX_NUM_PROCESSES=str(group.n), JAX_PROCESS_ID=str(i))
                out = open(os.path.join(tmp, f"{g}.{i}.out"), "w+")  # noqa: SIM115 (closed below)
                err = open(os.path.join(tmp, f"{g}.{i}.err"), "w+")  # noqa: SIM115
                procs.append((g, subprocess.Popen([sys.executable, script, *group.args], env=env, cwd=ROOT,
                                                  stdout=out, stderr=err, preexec_fn=_die_with_parent),
                               out, err))
        deadline = time.monotonic() + timeout
        timed_out = False
        try:
            while True:
                codes = [p.poll() for _, p, _, _ in procs]  # all polled: a failure anywhere shows now
                if None not in codes or any(code not in (None, 0) for code in codes):
                    break
                timed_out = time.monotonic() > deadline
                if timed_out:
                    break
                time.sleep(0.2)
        finally:  # a failure, the timeout, or the test interrupted (Ctrl-C): no process outlives the call
            for _, p, _, _ in procs:
                if p.poll() is None:
                    p.kill()
        results: list[list[subprocess.CompletedProcess]] = [[] for _ in groups]
        for g, p, out, err in procs:
            p.wait()
            out.seek(0)
            err.seek(0)
            results[g].append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
            out.close()
            err.close()
    flat = [(g, i, r) for g, group in enumerate(results) for i, r in enumerate(group)]
    if check and (timed_out or any(r.returncode != 0 for _, _, r in flat)):
        report = "\n".join(f"--- group {g} process {i} (exit {r.returncode}) ---\n"
                           f"stdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-4000:]}" for g, i, r in flat)
        reason = f"timed out after {timeout} s; " if timed_out else ""
        raise ProcessesFailed(f"{reason}processes failed:\n{report}")
    return results

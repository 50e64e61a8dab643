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
across the processes go through gloo.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ProcessesFailed(AssertionError):
    """A process exited non-zero or the group ran past its timeout; the message holds each one's output."""


def free_port() -> int:
    """A TCP port nobody listens on right now (the coordinator binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_processes(code_or_script: str, n: int = 2, devices_per_process: int = 4, timeout: float = 600,
                  args: tuple[str, ...] = (), *, check: bool = True) -> list[subprocess.CompletedProcess]:
    """Run ``n`` processes of ``code_or_script`` (a ``.py`` path, else Python source) with ``args``;
    kill them all when one fails or ``timeout`` seconds pass."""
    with tempfile.TemporaryDirectory() as tmp:
        script = code_or_script
        if not (code_or_script.endswith(".py") and os.path.isfile(code_or_script)):
            script = os.path.join(tmp, "program.py")
            with open(script, "w") as f:
                f.write(code_or_script)
        port = free_port()
        procs = []
        for i in range(n):
            env = dict(os.environ)
            env.update(
                PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
                JAX_PLATFORMS="cpu",
                JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
                XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}",
            )
            if n > 1:
                env.update(MAGE_DISTRIBUTED="1", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                           JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i))
            out = open(os.path.join(tmp, f"{i}.out"), "w+")  # noqa: SIM115 (closed below)
            err = open(os.path.join(tmp, f"{i}.err"), "w+")  # noqa: SIM115
            procs.append((subprocess.Popen([sys.executable, script, *args], env=env, cwd=ROOT, stdout=out,
                                           stderr=err), out, err))
        deadline = time.monotonic() + timeout
        timed_out = False
        while any(p.poll() is None for p, _, _ in procs):
            failed = any(p.returncode not in (None, 0) for p, _, _ in procs)
            timed_out = time.monotonic() > deadline
            if failed or timed_out:
                for p, _, _ in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.2)
        results = []
        for p, out, err in procs:
            p.wait()
            out.seek(0)
            err.seek(0)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
            out.close()
            err.close()
    if check and (timed_out or any(r.returncode != 0 for r in results)):
        report = "\n".join(f"--- process {i} (exit {r.returncode}) ---\nstdout:\n{r.stdout[-2000:]}\n"
                           f"stderr:\n{r.stderr[-4000:]}" for i, r in enumerate(results))
        reason = f"timed out after {timeout} s; " if timed_out else ""
        raise ProcessesFailed(f"{reason}processes failed:\n{report}")
    return results

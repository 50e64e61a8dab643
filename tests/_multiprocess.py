"""Run one piece of code as ``n`` JAX processes on this machine (``jax.distributed`` on CPU, each
process with ``devices_per_process`` fake devices): multi-host behaviour, tested without a pod.

Each process starts a fresh interpreter that sets the CPU device count, joins the coordinator
(process 0 hosts it on a free local port) with gloo CPU collectives, and then runs the code: a Python
source string, or the path of a script (run as ``__main__``). The code sees an initialized
``jax.distributed``: ``jax.process_index()``, ``jax.process_count()`` and ``jax.devices()`` (all
``n * devices_per_process`` of them) are the multi-host ones.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

BOOTSTRAP = textwrap.dedent("""
    import os, runpy, sys
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=os.environ["MAGE_TEST_COORDINATOR"],
                               num_processes=int(os.environ["MAGE_TEST_NUM_PROCESSES"]),
                               process_id=int(os.environ["MAGE_TEST_PROCESS_ID"]))
    target = sys.argv[1]
    if os.path.isfile(target):
        sys.argv = sys.argv[1:]
        runpy.run_path(target, run_name="__main__")
    else:
        exec(compile(target, "<process code>", "exec"), {"__name__": "__main__"})
""")


class ProcessesFailed(AssertionError):
    """A process exited non-zero or the group ran past its timeout; the message holds each one's output."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(code_or_script: str, n: int = 2, devices_per_process: int = 4, timeout: float = 120.0,
                  *, check: bool = True) -> list[subprocess.CompletedProcess]:
    """Run ``code_or_script`` as ``n`` processes of one JAX cluster; their results in process order.

    All processes are killed once ``timeout`` seconds have passed (a deadlock fails, never hangs);
    ``check`` raises ``ProcessesFailed`` (with every process's stdout and stderr) when any exits
    non-zero or the timeout was hit.
    """
    env = dict(os.environ)
    count_flag = "--xla_force_host_platform_device_count"
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(count_flag)]
    env.update(
        XLA_FLAGS=" ".join([*flags, f"{count_flag}={devices_per_process}"]),
        JAX_PLATFORMS="cpu",
        MAGE_TEST_COORDINATOR=f"127.0.0.1:{_free_port()}",
        MAGE_TEST_NUM_PROCESSES=str(n),
        PYTHONUNBUFFERED="1",
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", BOOTSTRAP, code_or_script],
                         env={**env, "MAGE_TEST_PROCESS_ID": str(i)}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for i in range(n)
    ]
    deadline = time.monotonic() + timeout
    results, timed_out = [], False
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=None if timed_out else max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            for p in procs:
                p.kill()
            out, err = proc.communicate()
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    if check and (timed_out or any(r.returncode != 0 for r in results)):
        report = "\n".join(f"--- process {i} (exit {r.returncode}) ---\nstdout:\n{r.stdout}\n"
                           f"stderr:\n{r.stderr[-4000:]}" for i, r in enumerate(results))
        raise ProcessesFailed(f"{'timed out after ' + str(timeout) + ' s; ' if timed_out else ''}"
                              f"processes failed:\n{report}")
    return results

"""The compile report counts the XLA programs a process compiles, their seconds, and those loaded from
the persistent compilation cache; a program already compiled in the process counts nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mage_jax import compilation_cache
from mage_jax.compile_report import CompileReport, counter

ROOT = Path(__file__).resolve().parents[1]

# A process with the persistent cache in argv[1] that compiles one program and prints its report.
CHILD = """
import dataclasses, json, sys
import jax, jax.numpy as jnp, numpy as np
from mage_jax import compilation_cache
from mage_jax.compile_report import counter

compilation_cache.enable(sys.argv[1])
before = counter().snapshot()
jax.jit(lambda x: jnp.tanh(x @ x.T).sum() * 3.0)(np.ones((8, 8), np.float32)).block_until_ready()
print(json.dumps(dataclasses.asdict(counter().snapshot() - before)))
"""


def test_a_new_program_counts_once_with_its_seconds_and_a_repeated_call_counts_nothing():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    f = jax.jit(lambda a: jnp.sin(a) @ a.T + 17.0)
    before = counter().snapshot()
    f(x).block_until_ready()
    counter().install()  # installing again adds no second listener: the program still counts once
    after = counter().snapshot()
    f(x).block_until_ready()
    again = counter().snapshot()
    compiled = after - before
    assert compiled.programs == 1 and compiled.seconds is not None and compiled.seconds > 0.0
    assert (again - after).programs == 0 and (again - after).seconds == 0.0


def test_the_second_process_with_the_same_cache_reports_its_program_as_a_cache_hit(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k != compilation_cache.ENV_VAR and not k.startswith("JAX_")}  # not the suite's cache

    def run() -> CompileReport:
        done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "cache")], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return CompileReport(**json.loads(done.stdout.strip().splitlines()[-1]))

    cold, warm = run(), run()
    assert cold.programs >= 1 and cold.cache_hits == 0
    assert warm.programs == cold.programs and warm.cache_hits == warm.programs


def test_the_report_subtracts_and_reads_as_metrics_and_one_line():
    report = CompileReport(programs=7, seconds=12.5, cache_hits=4) - CompileReport(2, 2.5, 1)
    assert report == CompileReport(programs=5, seconds=10.0, cache_hits=3)
    assert report.metrics() == {"compile/programs": 5.0, "compile/seconds": 10.0, "compile/cache_hits": 3.0}
    assert report.describe() == "compiled 5 XLA programs in 10 s (3 from the persistent cache)"
    unknown = CompileReport(None, None, None)
    assert unknown.metrics() == {} and "unavailable" in unknown.describe()
    assert (CompileReport(3, 1.0, None) - CompileReport(1, 0.5, None)).cache_hits is None

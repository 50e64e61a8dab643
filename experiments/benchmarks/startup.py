"""How fast the main job starts: ``python -m experiments.kuhn_poker`` run twice in fresh processes, cold
(an empty persistent compilation cache) and warm (the same cache again), with the wall seconds, the XLA
programs compiled, their seconds and the cache hits of each (the compile report of the run's
``summary.json``), the 1-minute load average around each run, and issue 28's targets, met or not.

    python -m experiments.benchmarks.startup                 # the default (tiny) preset: minutes each
    python -m experiments.benchmarks.startup --smoke         # the test suite's smoke sizes
    python -m experiments.benchmarks.startup --smoke --set train.iterations=2   # more main-job settings

Arguments it does not know go to the main job. ``--smoke`` takes its sizes from ``mage_jax.testing.SMOKE``
(the test suite's and the quickstart notebook's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.benchmarks.common import load_average, load_span, machine, write_report
from mage_jax import compilation_cache
from mage_jax.evaluation.report import SUMMARY_FILE
from mage_jax.logging import read_jsonl
from mage_jax.testing import smoke_args

ROOT = Path(__file__).resolve().parents[2]
MAIN_JOB = (sys.executable, "-m", "experiments.kuhn_poker")
TARGETS = {"cold_wall_s": 180.0, "warm_wall_s": 120.0, "programs": 25}
"""Issue 28: the main job in at most 3 minutes cold and 2 warm on 2 quiet cores, compiling at most 25
programs."""


def run_main_job(args: list[str], run_dir: Path, cache_dir: Path) -> dict[str, Any]:
    """One main job in its own process with the persistent cache in ``cache_dir``: its wall seconds
    (process start to exit), its summary's compile report, the programs of its training iterations
    (the rest: setup, validation, evaluation) and the load average before and after."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env[compilation_cache.ENV_VAR] = str(cache_dir)
    load_before = load_average()
    start = time.perf_counter()
    done = subprocess.run([*MAIN_JOB, *args, "--run-dir", str(run_dir)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"error: the main job exited with {done.returncode}: {done.stderr.strip()[-2000:]}")
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    compiled = summary.get("compile") or {}
    train = [r for r in read_jsonl(str(run_dir)) if r["split"] == "train"]
    return {
        "wall_s": round(wall, 2),
        "run_wall_s": round(summary["wall_seconds"], 2),
        "programs": compiled.get("programs"),
        "compile_s": None if compiled.get("seconds") is None else round(compiled["seconds"], 2),
        "cache_hits": compiled.get("cache_hits"),
        "training_programs": int(sum(r.get("compile/programs", 0) for r in train)),
        "load_average": load_span(load_before),
    }


def target(value: float | None, limit: float) -> dict[str, Any]:
    return {"value": value, "target": limit, "met": value is not None and value <= limit}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the test suite's smoke sizes")
    parser.add_argument("--out", default="runs/benchmarks/startup.json")
    args, main_job_args = parser.parse_known_args(argv)
    job_args = [*(smoke_args() if args.smoke else []), *main_job_args]
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="mage-startup-") as work:
        cache = Path(work) / "cache"
        cold = run_main_job(job_args, Path(work) / "cold", cache)
        warm = run_main_job(job_args, Path(work) / "warm", cache)
    report = {
        "benchmark": "startup",
        "command": " ".join(["python -m experiments.benchmarks.startup", *(argv or sys.argv[1:])]),
        "main_job": " ".join(["python -m experiments.kuhn_poker", *job_args]),
        "cold": cold,
        "warm": warm,
        "targets_apply": not job_args,  # the targets are the default main job's; other sizes: for reference
        "targets": {
            "cold_wall_s": target(cold["wall_s"], TARGETS["cold_wall_s"]),
            "warm_wall_s": target(warm["wall_s"], TARGETS["warm_wall_s"]),
            "programs": target(cold["programs"], TARGETS["programs"]),
        },
        "load_average": load_span(load_before),
        "cpus": os.cpu_count(),
        "machine": machine(),
    }
    return write_report(report, args.out)


if __name__ == "__main__":
    main()

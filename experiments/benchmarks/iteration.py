"""Where one training iteration of a preset spends its time, phase by phase, on a real model folder.

    python -m experiments.benchmarks.iteration --preset smollm2-cpu --model-path DIR [--iterations 3]
        [--env kuhn_poker] [--set KEY=VALUE ...] [--out runs/benchmarks/iteration.json]

Trains ``--iterations`` iterations of the preset (no evaluation, no checkpoint) in a scratch run
directory and reports, per iteration: the rollout, the log-prob passes (old and reference), the
updates and the whole iteration, each as wall seconds, the process's CPU seconds and the seconds XLA
spent compiling in it; the rows and their tokens (real, and as padded into their length buckets). The
first iteration compiles; later ones show the steady state. On a shared machine the wall time depends
on the load, so the report also gives the process's CPU seconds (what the work costs; on 2 idle
cores the wall time is about half of it when both are busy) and the load average, and measures the
float32 matmul peak of ``jnp.dot`` under the same load as a peer (``matmul_peak``), so runs at
different loads compare through ``gflop_per_cpu_second``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from experiments.benchmarks.common import load_average, matmul_peak, write_timed_report
from experiments.common import split_dotted
from experiments.environments import environment
from mage_jax import compile_report
from mage_jax import config as C
from mage_jax.rollout.meta_episode import MetaEpisodeRunner
from mage_jax.training import run as run_module
from mage_jax.training.train_step import TrainStep

PHASES = ("rollout", "old_logprobs", "reference_logprobs", "updates")


class PhaseClock:
    """Wall, process-CPU and compile seconds of named phases, accumulated until ``take``."""

    def __init__(self) -> None:
        self.totals: dict[str, dict[str, float]] = {}
        self.rows: list[dict[str, int]] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        compiled = compile_report.counter().snapshot()
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            t = self.totals.setdefault(name, {"wall_s": 0.0, "cpu_s": 0.0, "compile_s": 0.0, "calls": 0})
            t["wall_s"] += time.perf_counter() - wall
            t["cpu_s"] += time.process_time() - cpu
            t["compile_s"] += (compile_report.counter().snapshot() - compiled).seconds or 0.0
            t["calls"] += 1

    def take(self) -> dict[str, Any]:
        out = {name: {k: round(v, 2) for k, v in t.items()} for name, t in self.totals.items()}
        self.totals = {}
        return out


def instrument(clock: PhaseClock) -> None:
    """Time the rollout, the log-prob passes and the updates of every trainer in this process."""
    rollout, logprobs, update = MetaEpisodeRunner.run, TrainStep.compute_logprobs, TrainStep.update

    def timed_rollout(self, tasks, policy, *args, training: bool = False, **kwargs):
        if not training:
            return rollout(self, tasks, policy, *args, training=training, **kwargs)
        with clock.phase("rollout"):
            result = rollout(self, tasks, policy, *args, training=training, **kwargs)
        lengths = [(r.prompt_length, r.response_length) for r in result.rows]
        clock.rows.append({"rows": len(lengths), "prompt_tokens": sum(p for p, _ in lengths),
                           "response_tokens": sum(n for _, n in lengths)})
        return result

    def timed_logprobs(self, params, batch, *, adapters: bool = True):
        with clock.phase("old_logprobs" if adapters else "reference_logprobs"):
            return jax.block_until_ready(logprobs(self, params, batch, adapters=adapters))

    def timed_update(self, state, batch, *args, **kwargs):
        with clock.phase("updates"):
            return jax.block_until_ready(update(self, state, batch, *args, **kwargs))

    MetaEpisodeRunner.run = timed_rollout
    TrainStep.compute_logprobs = timed_logprobs
    TrainStep.update = timed_update


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.benchmarks.iteration",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="smollm2-cpu")
    p.add_argument("--env", default="kuhn_poker")
    p.add_argument("--model-path", required=True)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default="runs/benchmarks/iteration.json")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    dotted, rest = split_dotted(argv)
    args = _parser().parse_args(rest)
    started, load_before = time.perf_counter(), load_average()
    peak = matmul_peak(1024)["jax_gflops"]
    clock = PhaseClock()
    instrument(clock)
    iterations: list[dict[str, Any]] = []
    original = run_module.Trainer.train_iteration

    def train_iteration(trainer, iteration):
        t0, c0 = time.perf_counter(), time.process_time()
        compiled = compile_report.counter().snapshot()
        metrics = original(trainer, iteration)
        compile_s = (compile_report.counter().snapshot() - compiled).seconds or 0.0
        iterations.append({"iteration": iteration, "wall_s": round(time.perf_counter() - t0, 2),
                           "cpu_s": round(time.process_time() - c0, 2), "compile_s": round(compile_s, 2),
                           "load_average": load_average(), "phases": clock.take(),
                           **(clock.rows.pop() if clock.rows else {}),
                           "updates": int(metrics.get("updates", 0))})
        print(iterations[-1], flush=True)
        return metrics

    run_module.Trainer.train_iteration = train_iteration
    with tempfile.TemporaryDirectory(prefix="iteration-bench-") as scratch:
        overrides = {**dict([C.parse_assignment(s) for s in args.sets] + dotted),
                     "model.path": args.model_path, "logging.run_dir": os.path.join(scratch, "run"),
                     "train.iterations": args.iterations, "train.eval_every": 0, "checkpoint.every": 0,
                     "logging.progress": False, "logging.plots": False}
        spec = environment(args.env)
        cfg = spec.config(args.preset, overrides)
        # The evaluation at the end is not measured: two meta-episodes of it.
        cfg = C.apply_overrides(cfg, {"train.eval_meta_episodes": 2, "train.eval_heldout_meta_episodes": 0})
        spec.run(cfg)
    # The steady state: iterations after the first that compiled (almost) nothing; their CPU seconds hold
    # no compiling (XLA compiles on other threads, so its seconds cannot be taken out of a CPU total).
    later = iterations[1:] or iterations
    steady = [it for it in later if it["compile_s"] <= 0.05 * it["wall_s"]] or later
    cpu = np.mean([it["cpu_s"] for it in steady])
    write_timed_report({
        "benchmark": "iteration", "preset": args.preset, "env": args.env, "model_path": args.model_path,
        "overrides": {k: str(v) for k, v in overrides.items() if k not in ("logging.run_dir",)},
        "iterations": iterations,
        "steady_state": {"iterations": [it["iteration"] for it in steady],
                         "wall_s": round(float(np.mean([it["wall_s"] for it in steady])), 2),
                         "cpu_s": round(float(cpu), 2),
                         "quiet_2core_estimate_s": round(float(cpu) / 2, 2)},
        "matmul_peak_gflops": peak,
    }, args.out, load_before=load_before, started=started)
    return 0


if __name__ == "__main__":
    sys.exit(main())

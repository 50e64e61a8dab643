"""What the benchmarks share: the command line of a lockstep batch of meta-episodes, its restart and
step phases, rounded means, the machine description, and the JSON report printed and written to ``--out``.

The model benchmarks (ours against PyTorch) also share the random Qwen3 shapes, the thread pinning that
gives both runtimes the same CPUs, min/median/max summaries, the load average and a measured f32 matmul
peak, so that a ratio states the conditions it was measured under."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from mage_jax.envs.base import TextEnv
from mage_jax.envs.prompts import Move
from mage_jax.testing import random_causal_lm


def batch_parser(
    doc: str, *, out: str, tasks: int, budget_s: float, budget_help: str
) -> argparse.ArgumentParser:
    """A parser with the options every step benchmark takes (``tasks x group`` meta-episodes in lockstep,
    ``--episodes`` each, ``--budget-s`` measured seconds); the caller adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=out)
    parser.add_argument("--tasks", type=int, default=tasks, help="task instances (groups)")
    parser.add_argument("--group", type=int, default=8, help="meta-episodes per task instance")
    parser.add_argument("--episodes", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=budget_s, help=budget_help)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def parse_batch_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, refusing non-positive sizes or budgets with one usage error."""
    args = parser.parse_args(argv)
    if args.tasks < 1 or args.group < 1 or args.episodes < 1 or args.budget_s <= 0:
        parser.error("--tasks, --group, --episodes and --budget-s must be positive")
    return args


def restart_all(envs: Sequence[TextEnv], indices: Sequence[int], initial: list[str]) -> float:
    """Restart the meta-episodes ``indices`` (their first observations go to ``initial``); returns ms."""
    start = time.perf_counter()
    for i in indices:
        initial[i] = envs[i].restart()
    return (time.perf_counter() - start) * 1e3


def step_all(
    envs: Sequence[TextEnv],
    playing: Sequence[int],
    choose: Callable[[TextEnv], str],
    moves: dict[int, list[Move]],
    won: dict[int, bool],
) -> list[int]:
    """One lockstep turn: step every playing environment with the action ``choose(env)`` inside
    ``<action>`` tags (so parsing counts), record the move and the win flag; returns those still playing."""
    still = []
    for i in playing:
        result = envs[i].step(f"<think>trying</think><action>{choose(envs[i])}</action>")
        moves[i].append(Move(result.action, result.observation, result.reward, result.info.valid))
        won[i] = result.info.won
        if not result.done:
            still.append(i)
    return still


def mean(values: list[float]) -> float | None:
    """The mean rounded to 3 digits (milliseconds to the microsecond); None when nothing was measured."""
    return round(statistics.fmean(values), 3) if values else None


def machine() -> dict[str, str]:
    return {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()}


def write_batch_report(
    name: str,
    args: argparse.Namespace,
    *,
    started: float,
    results: list[dict[str, Any]],
    skipped: list[dict[str, Any]],
    **fields: Any,
) -> dict[str, Any]:
    """The report of a step benchmark (``fields`` go between the batch description and the machine)."""
    report = {
        "benchmark": name,
        "command": f"python -m experiments.benchmarks.{name}",
        "batch": args.tasks * args.group,
        "episodes": args.episodes,
        **fields,
        "machine": machine(),
        "results": results,
        "skipped": skipped,
        "total_s": round(time.perf_counter() - started, 2),
    }
    return write_report(report, args.out)


def write_timed_report(fields: dict[str, Any], out: str | Path, *, load_before: float,
                       started: float) -> dict[str, Any]:
    """``fields``, then the 1-minute load average before (``load_before``) and now, the machine and the
    seconds since ``started``; printed and written to ``out``."""
    return write_report({
        **fields,
        "load_average": load_span(load_before),
        "machine": machine(),
        "total_s": round(time.perf_counter() - started, 2),
    }, out)


def write_report(report: dict[str, Any], out: str | Path) -> dict[str, Any]:
    """Print the report as JSON and write it to ``out`` (parents created); returns it."""
    text = json.dumps(report, indent=2)
    print(text)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")
    return report


# ---------------------------------------------------------------------------- model benchmarks
QWEN3_SHAPES = {
    # The 27.3M-parameter Qwen3 both model benchmarks compare on (tied embeddings).
    "27m": dict(
        vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    # A few-thousand-parameter stand-in for the entry-point smoke tests.
    "tiny": dict(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
        tie_word_embeddings=True,
    ),
}


def model_parser(doc: str, *, out: str) -> argparse.ArgumentParser:
    """A parser with the options every model benchmark takes (``--shape``, ``--threads``, ``--seed``,
    ``--out``; the description is the first paragraph of ``doc``); the caller adds its sizes."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--shape", default="27m", choices=sorted(QWEN3_SHAPES))
    parser.add_argument("--threads", type=int, default=1, help="CPUs for each side (0: leave as is)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=out)
    return parser


def write_model_report(name: str, fields: dict[str, Any], out: str | Path, *, load_before: float
                       ) -> dict[str, Any]:
    """The report of a model benchmark: its name and command, ``fields``, then the 1-minute load average
    before (``load_before``) and now, and the machine; printed and written to ``out``."""
    report = {
        "benchmark": name,
        "command": f"python -m experiments.benchmarks.{name}",
        **fields,
        "load_average": load_span(load_before),
        "machine": machine(),
    }
    return write_report(report, out)


def build_hf_checkpoint(folder: str, shape: dict[str, Any], seed: int) -> Any:
    """A random Qwen3 model of ``shape`` saved to ``folder`` as safetensors (our loader reads it back, so
    both sides run identical weights); returns the torch model."""
    return random_causal_lm({"model_type": "qwen3", **shape}, folder, seed=seed)


CHECK_SHAPES = {
    # The small random decoders the correctness checks compare with Hugging Face (grouped-query
    # attention, untied head); weights are redrawn large (``build_random_hf_model``) so that a mistake in
    # norms or RoPE moves the logits far beyond rounding and greedy choices are not near-ties.
    "qwen3": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                  tie_word_embeddings=False),
    "llama": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                  tie_word_embeddings=False),
}


def build_random_hf_model(architecture: str, folder: str, *, seed: int = 0, weight_std: float = 0.15) -> Any:
    """A random ``transformers`` causal LM of ``CHECK_SHAPES[architecture]`` with matrices drawn from
    N(0, weight_std²) and norm weights from U(0.5, 1.5), saved to ``folder`` as safetensors; returns the
    torch model (float32, eval mode, on the CPU)."""
    return random_causal_lm({"model_type": architecture, **CHECK_SHAPES[architecture]}, folder, seed=seed,
                            weight_std=weight_std, norm_range=(0.5, 1.5))


@contextlib.contextmanager
def pinned_threads(threads: int) -> Iterator[dict[str, Any]]:
    """Run both runtimes on the same ``threads`` CPUs (0: leave the process as it is).

    The process is pinned to the first ``threads`` CPUs (as ``taskset`` would); XLA sizes its thread
    pool from that affinity when its backend starts, so the pin only binds XLA if no JAX computation ran
    before (a fresh ``python -m`` process). With one thread XLA's Eigen pool is switched off outright.
    PyTorch gets ``torch.set_num_threads(threads)``. Affinity, flags and torch threads are restored on
    exit. Yields what was
    applied, for the report."""
    import torch

    before = os.sched_getaffinity(0)
    flags_before = os.environ.get("XLA_FLAGS")
    torch_before = torch.get_num_threads()
    info: dict[str, Any] = {"threads": threads, "cpus": sorted(before)}
    if threads > 0:
        cpus = sorted(before)[:threads]
        if len(cpus) < threads:
            raise SystemExit(f"--threads {threads}: only {len(before)} CPUs are available to this process")
        os.sched_setaffinity(0, cpus)
        if threads == 1 and "--xla_cpu_multi_thread_eigen" not in (flags_before or ""):
            flags = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
            os.environ["XLA_FLAGS"] = f"{flags_before or ''} {flags}".strip()
        torch.set_num_threads(threads)
        info["cpus"] = cpus
    info["xla_backend_started_before_pin"] = _jax_backend_started()
    info["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    info["torch_threads"] = torch.get_num_threads()
    try:
        yield info
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(torch_before)
        if flags_before is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = flags_before


def _jax_backend_started() -> bool:
    import sys

    xb = sys.modules.get("jax._src.xla_bridge")
    return bool(xb is not None and getattr(xb, "_backends", None))


def spread(times: Sequence[float]) -> dict[str, float]:
    """min / median / max of a list of measurements (seconds or rates), rounded to 4 digits."""
    return {
        "min": round(min(times), 4),
        "median": round(statistics.median(times), 4),
        "max": round(max(times), 4),
    }


def load_span(before: float) -> dict[str, float]:
    """A report's ``load_average`` entry: the 1-minute load average ``before`` the measurement and now."""
    return {"before": before, "after": load_average()}


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def matmul_peak(size: int = 2048, repeats: int = 5) -> dict[str, float]:
    """Best-of-``repeats`` f32 ``size x size`` matmul GFLOP/s of ``jnp.dot`` and ``torch.mm`` on the
    threads the benchmark runs with: the peak that achieved GFLOP/s are a fraction of."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    host = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    a = jnp.asarray(host)
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    t = torch.from_numpy(host)
    torch.mm(t, t)
    flops = 2.0 * size**3
    best_jax = best_torch = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dot(a, a).block_until_ready()
        best_jax = min(best_jax, time.perf_counter() - start)
        start = time.perf_counter()
        torch.mm(t, t)
        best_torch = min(best_torch, time.perf_counter() - start)
    return {"size": size, "jax_gflops": round(flops / best_jax / 1e9, 3),
            "torch_gflops": round(flops / best_torch / 1e9, 3)}

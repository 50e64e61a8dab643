"""What the benchmarks share: the command line of a lockstep batch of meta-episodes, its restart and
step phases, rounded means, the machine description, and the JSON report printed and written to ``--out``."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mage_jax.envs import TextEnv
from mage_jax.envs.prompts import Move


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


def write_report(report: dict[str, Any], out: str | Path) -> dict[str, Any]:
    """Print the report as JSON and write it to ``out`` (parents created); returns it."""
    text = json.dumps(report, indent=2)
    print(text)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")
    return report

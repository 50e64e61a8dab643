"""What the benchmarks share: the command line of a lockstep batch of meta-episodes, rounded means, the
machine description, and the JSON report printed and written to ``--out``."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path
from typing import Any


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


def mean(values: list[float]) -> float | None:
    """The mean rounded to 3 digits (milliseconds to the microsecond); None when nothing was measured."""
    return round(statistics.fmean(values), 3) if values else None


def machine() -> dict[str, str]:
    return {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()}


def write_report(report: dict[str, Any], out: str | Path) -> dict[str, Any]:
    """Print the report as JSON and write it to ``out`` (parents created); returns it."""
    text = json.dumps(report, indent=2)
    print(text)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")
    return report

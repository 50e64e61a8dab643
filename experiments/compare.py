"""Compare evaluations side by side: the adaptation table and figure of an experiment with several arms.

    python -m experiments.compare --eval "zero-shot Reflexion=runs/reflexion" --eval "MAGE=runs/mage_eval" \\
        --run "MAGE=runs/mage" --run "single-episode reward=runs/single" --figure adaptation.png

Each ``--eval LABEL=DIR`` names a folder with an evaluation's ``summary.json`` (``experiments.evaluate``, or a
training run's final evaluation). The table gives for each: the meta-episodes, success@1 / @K, payoff@1 and
payoff@K with their standard errors, and the paired payoff@K - payoff@1 (each meta-episode against itself,
the adaptation MAGE trains for) with its standard error and z = mean / SE; a second table gives the paired
gain per opponent. Each ``--run LABEL=RUN`` names a training run whose ``metrics.jsonl`` the figure draws
(``--figure PNG``): the paired gain of its training rollouts and its decisions' entropy in episodes 1 and K
(moving means over ``--window`` iterations), and the paired gain of its periodic evaluations with error bars,
beside the ``--eval`` rows (a trained one at its iteration, an untrained one as a band). ``--json FILE``
writes the table's numbers. A folder without what it needs is one ``error:`` line (exit 2).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from experiments.common import ConfigErrorParser, run_command
from mage_jax import config as C
from mage_jax.evaluation.plots import _pyplot, _save  # the package's one matplotlib set-up
from mage_jax.evaluation.report import load_summary
from mage_jax.logging import read_jsonl

Estimate = tuple[float, float | None]
"""A mean and its standard error (None: fewer than two meta-episodes)."""


@dataclasses.dataclass(frozen=True)
class EvalRow:
    """One evaluation, as the table shows it."""

    label: str
    directory: str
    iterations: int
    """Training iterations behind the evaluated parameters (0: the untrained model)."""
    num_meta_episodes: int
    num_episodes: int
    success: list[Estimate]
    payoff: list[Estimate]
    gain: Estimate
    """Paired payoff@K - payoff@1 over the meta-episodes."""
    gain_by_opponent: dict[str, Estimate]


def labelled(text: str, flag: str) -> tuple[str, str]:
    """``LABEL=PATH`` as (label, path); anything else is a ConfigError."""
    label, sep, path = text.partition("=")
    if not sep or not label.strip() or not path:
        raise C.ConfigError(f"{flag} {text!r}: write it as LABEL=PATH, e.g. {flag} \"MAGE=runs/mage_eval\"")
    return label.strip(), path


def _estimates(means: Sequence[float], errors: Sequence[float | None] | None) -> list[Estimate]:
    errors = errors or [None] * len(means)
    return [(float(m), None if e is None else float(e)) for m, e in zip(means, errors, strict=True)]


def _gain(block: Mapping[str, Any]) -> Estimate:
    gain = block["payoff_gain"]
    return float(gain["mean"]), gain["standard_error"]


def read_row(label: str, directory: str, split: str = "eval") -> EvalRow:
    """The evaluation ``split`` of ``directory``'s ``summary.json`` as a table row."""
    summary = load_summary(directory)
    if summary is None:
        raise C.ConfigError(f"--eval {label}={directory}: no summary.json there (run "
                            "experiments.evaluate, or let the training run finish)")
    block = summary.get("evaluation", {}).get(split)
    if block is None:
        raise C.ConfigError(f"--eval {label}={directory}: summary.json has no {split!r} evaluation (it has "
                            f"{', '.join(summary.get('evaluation', {})) or 'none'}; choose one with --split)")
    metrics = block["metrics"]
    if "payoff_gain" not in metrics:
        raise C.ConfigError(f"--eval {label}={directory}: the {split!r} evaluation has no paired payoff gain")
    curves, errors = metrics["curves"], metrics.get("standard_errors") or {}
    return EvalRow(
        label=label, directory=directory, iterations=int(summary.get("iterations") or 0),
        num_meta_episodes=int(metrics["num_meta_episodes"]), num_episodes=int(metrics["num_episodes"]),
        success=_estimates(curves["success"], errors.get("success")),
        payoff=_estimates(curves["payoff"], errors.get("payoff")),
        gain=_gain(metrics),
        gain_by_opponent={name: _gain(sub) for name, sub in sorted(metrics.get("by_opponent", {}).items())})


def _pm(estimate: Estimate) -> str:
    mean, se = estimate
    return f"{mean:+.3f}" if se is None else f"{mean:+.3f} ± {se:.3f}"


def _z(estimate: Estimate) -> str:
    mean, se = estimate
    return "" if not se else f" ({mean / se:+.1f} SE)"


def adaptation_table(rows: Sequence[EvalRow]) -> str:
    """Markdown: each evaluation's first and last episode and the paired gain between them."""
    k = max(r.num_episodes for r in rows)
    lines = [f"| model | iterations | meta-episodes | success@1 / @{k} | payoff@1 | payoff@{k} | "
             f"payoff@{k} − payoff@1 (paired) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.label} | {r.iterations} | {r.num_meta_episodes} | {r.success[0][0]:.3f} / "
                     f"{r.success[-1][0]:.3f} | {_pm(r.payoff[0])} | {_pm(r.payoff[-1])} | "
                     f"**{_pm(r.gain)}**{_z(r.gain)} |")
    return "\n".join(lines)


def opponent_table(rows: Sequence[EvalRow]) -> str:
    """Markdown: the paired gain of each evaluation against each opponent ('' without opponents)."""
    names = sorted({name for r in rows for name in r.gain_by_opponent})
    if len(names) < 2:
        return ""
    lines = ["| model | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in rows:
        cells = [_pm(r.gain_by_opponent[n]) if n in r.gain_by_opponent else "-" for n in names]
        lines.append(f"| {r.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _moving_mean(x: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to ``window`` values, skipping missing ones (NaN)."""
    out = np.full(len(x), np.nan)
    for i in range(len(x)):
        part = x[max(0, i + 1 - window): i + 1]
        part = part[~np.isnan(part)]
        if part.size:
            out[i] = part.mean()
    return out


def _series(records: Sequence[Mapping[str, Any]], key: str) -> np.ndarray:
    return np.array([float(r[key]) if isinstance(r.get(key), (int, float)) else np.nan for r in records])


def read_run(label: str, run_dir: str) -> list[dict[str, Any]]:
    """A training run's metric records; a run without them is a ConfigError."""
    path = os.path.join(run_dir, "metrics.jsonl")
    records = read_jsonl(path) if os.path.isfile(path) else []
    if not any(r.get("split") == "train" for r in records):
        raise C.ConfigError(f"--run {label}={run_dir}: no training records in {path}")
    return records


def plot_comparison(runs: Mapping[str, Sequence[Mapping[str, Any]]], rows: Sequence[EvalRow], path: str,
                    *, num_episodes: int, window: int = 10) -> str:
    """Three panels: training rollouts' paired gain, decision entropy in episodes 1 and K, evaluations."""
    plt = _pyplot()
    k = num_episodes
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    labels = [*runs, *(r.label for r in rows if r.label not in runs)]
    colors = {label: f"C{i}" for i, label in enumerate(labels)}
    for label, records in runs.items():
        train = [r for r in records if r.get("split") == "train"]
        it = np.array([r["iteration"] for r in train])
        gain = _series(train, f"payoff@{k}") - _series(train, "payoff@1")
        axes[0].plot(it, _moving_mean(gain, window), color=colors[label], label=label)
        for episode, style in ((1, "-"), (k, "--")):
            entropy = _series(train, f"entropy_play@{episode}")
            if not np.all(np.isnan(entropy)):
                axes[1].plot(it, _moving_mean(entropy, window), style, color=colors[label],
                             label=f"{label}, episode {episode}")
        evals = [r for r in records if r.get("split") == "eval" and f"payoff@{k}-payoff@1" in r]
        if evals:
            axes[2].errorbar([r["iteration"] for r in evals], [r[f"payoff@{k}-payoff@1"] for r in evals],
                             yerr=[r.get(f"payoff@{k}-payoff@1_se") or 0.0 for r in evals], marker="o",
                             capsize=3, linestyle="--", linewidth=0.8, color=colors[label],
                             label=f"{label} (in-run evaluations)")
    for r in rows:
        mean, se = r.gain
        if r.iterations == 0:  # an untrained model: a band across the panel
            axes[2].axhline(mean, color=colors[r.label], linewidth=1.2,
                            label=f"{r.label} ({r.num_meta_episodes})")
            if se:
                axes[2].axhspan(mean - se, mean + se, color=colors[r.label], alpha=0.15)
        else:
            axes[2].errorbar([r.iterations], [mean], yerr=[se or 0.0], marker="s", markersize=7, capsize=4,
                             markerfacecolor="none", color=colors[r.label],
                             label=f"{r.label} ({r.num_meta_episodes})")
    axes[0].set_title(f"training rollouts: payoff@{k} − payoff@1 ({window}-iteration mean)", fontsize=9)
    axes[1].set_title(f"entropy of the decisions, episode 1 and {k} ({window}-iteration mean)", fontsize=9)
    axes[2].set_title(f"evaluation: payoff@{k} − payoff@1 ± SE (meta-episodes)", fontsize=9)
    for ax, unit in zip(axes, ("chips", "nats", "chips")):
        ax.axhline(0, color="gray", linewidth=0.8)
        ax.set_xlabel("iteration")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # below the panel: a legend inside covered the bands
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    fig.tight_layout()
    return str(_save(fig, path))


def _parser() -> ConfigErrorParser:
    p = ConfigErrorParser(prog="python -m experiments.compare", description=__doc__.split("\n\n")[0],
                          allow_abbrev=False)
    p.add_argument("--eval", dest="evals", action="append", default=[], metavar="LABEL=DIR",
                   help="an evaluation folder (summary.json) and its label in the table (repeatable)")
    p.add_argument("--run", dest="runs", action="append", default=[], metavar="LABEL=RUN",
                   help="a training run whose metrics.jsonl the figure draws (repeatable)")
    p.add_argument("--split", default="eval", help="the evaluation split of each summary.json (default eval)")
    p.add_argument("--figure", default=None, help="write the figure to this PNG")
    p.add_argument("--json", dest="json_path", default=None, help="write the table's numbers to this file")
    p.add_argument("--window", type=int, default=10, help="iterations in the figure's moving means")
    return p


def compare(argv: Sequence[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit:  # --help
        return 0
    if not args.evals:
        raise C.ConfigError("give at least one --eval LABEL=DIR")
    if args.window < 1:
        raise C.ConfigError(f"--window {args.window}: must be at least 1")
    rows = [read_row(*labelled(text, "--eval"), split=args.split) for text in args.evals]
    runs: dict[str, list[dict[str, Any]]] = {}
    for text in args.runs:
        label, run_dir = labelled(text, "--run")
        runs[label] = read_run(label, run_dir)
    print(adaptation_table(rows))
    by_opponent = opponent_table(rows)
    if by_opponent:
        print(f"\npaired payoff@{rows[0].num_episodes} − payoff@1 per opponent:\n{by_opponent}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    if args.figure:
        out = plot_comparison(runs, rows, args.figure, num_episodes=max(r.num_episodes for r in rows),
                              window=args.window)
        print(f"figure: {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(lambda: compare(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())

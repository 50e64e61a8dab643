"""PNG figures of evaluation curves and training logs (matplotlib, headless Agg backend).

``plot_episode_curves``: one metric (success@k, payoff@k, ...) against the episode, one line per
opponent plus the overall mean, with optional reference lines: a number is drawn as a horizontal
line (e.g. the winnable ceiling), a sequence as a dashed curve over the episodes (e.g. the random
policy's success@k from the Kuhn oracle). ``plot_training_curves`` reads a metrics JSONL file (one
record per iteration and split) and draws the chosen keys against the iteration.

The x axis of episode curves counts episodes from 1 (the first attempt), so the point at x = 3 is
``success@2``, the paper's Pass@3.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_TRAINING_KEYS = ("success@0", "payoff@0", "reward_mean", "policy_loss", "entropy", "kl")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def plot_episode_curves(
    metrics: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    metric: str = "success",
    reference_lines: Mapping[str, float | Sequence[float]] | None = None,
    title: str | None = None,
    by: str = "by_opponent",
) -> Path:
    """Draw ``metric``@k against the episode for the overall mean and each entry of ``metrics[by]``."""
    if "curves" not in metrics or metric not in metrics["curves"]:
        known = ", ".join(sorted(metrics.get("curves", {})))
        raise ValueError(f"metrics have no curve {metric!r}; known: {known or 'none'}")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    overall = np.asarray(metrics["curves"][metric], dtype=float)
    x = np.arange(1, len(overall) + 1)
    ax.plot(
        x, overall, marker="o", linewidth=2.5, color="black", label=f"all ({metrics['num_meta_episodes']})"
    )
    for name, block in (metrics.get(by) or {}).items():
        values = np.asarray(block["curves"][metric], dtype=float)
        ax.plot(x[: len(values)], values, marker="o", label=f"{name} ({block['num_meta_episodes']})")
    for label, ref in (reference_lines or {}).items():
        if np.ndim(ref) == 0:
            ax.axhline(float(ref), linestyle=":", color="gray")
            ax.annotate(label, (x[-1], float(ref)), textcoords="offset points", xytext=(4, 2), fontsize=8)
        else:
            values = np.asarray(ref, dtype=float)[: len(x)]
            ax.plot(x[: len(values)], values, linestyle="--", label=label)
    ax.set_xticks(x)
    ax.set_xlabel("episode (1 = first attempt)")
    ax.set_ylabel(f"{metric}@k")
    ax.set_title(title or f"{metric}@k by {by.removeprefix('by_')}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_success_and_payoff(
    metrics: Mapping[str, Any],
    out_dir: str | os.PathLike,
    *,
    reference: Mapping[str, Mapping[str, float | Sequence[float]]] | None = None,
    prefix: str = "",
) -> list[Path]:
    """``<prefix>success.png`` and ``<prefix>payoff.png`` per opponent; ``reference`` maps the metric
    name to its reference lines (e.g. ``{"success": {"winnable": 0.58}, "payoff": {"random": [...]}}``)."""
    reference = reference or {}
    return [
        plot_episode_curves(
            metrics,
            Path(out_dir) / f"{prefix}{metric}.png",
            metric=metric,
            reference_lines=reference.get(metric),
        )
        for metric in ("success", "payoff")
    ]


def plot_training_curves(
    jsonl_path: str | os.PathLike,
    path: str | os.PathLike,
    *,
    keys: Sequence[str] | None = None,
    x_key: str = "iteration",
) -> Path:
    """One panel per key against ``x_key``, one line per ``split`` of the records (train / eval / ...).

    ``keys`` default to those of ``DEFAULT_TRAINING_KEYS`` present in the file; keys that never occur
    are skipped. A file with no usable record is a clear error.
    """
    from mage_jax.logging import read_jsonl

    records = [r for r in read_jsonl(str(jsonl_path)) if isinstance(r, Mapping) and x_key in r]
    if not records:
        raise ValueError(f"no records with {x_key!r} in {str(jsonl_path)!r}")

    def numeric(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    present = {k for r in records for k, v in r.items() if numeric(v) and k != x_key}
    wanted = [k for k in (keys if keys is not None else DEFAULT_TRAINING_KEYS) if k in present]
    if not wanted:
        raise ValueError(
            f"none of the keys {list(keys or DEFAULT_TRAINING_KEYS)} occur in {str(jsonl_path)!r}; "
            f"available: {', '.join(sorted(present)[:20])}"
        )
    plt = _pyplot()
    cols = min(3, len(wanted))
    rows = -(-len(wanted) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    splits = sorted({str(r.get("split", "train")) for r in records})
    for ax, key in zip(axes.flat, wanted):
        for split in splits:
            points = sorted(
                (float(r[x_key]), float(r[key]))
                for r in records
                if str(r.get("split", "train")) == split and numeric(r.get(key))
            )
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="." if len(points) < 50 else None, label=split)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel(x_key)
        ax.grid(alpha=0.3)
        if len(splits) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(wanted) :]:
        ax.axis("off")
    fig.tight_layout()
    return _save(fig, path)

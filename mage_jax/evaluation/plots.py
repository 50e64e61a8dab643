"""PNG figures of evaluation curves and training logs (matplotlib, headless Agg backend).

``plot_episode_curves``: one metric (success@k, payoff@k, ...) against the episode, one line per
opponent plus the overall mean, with optional reference lines: a number is drawn as a horizontal
line (e.g. the winnable ceiling), a sequence as a dashed curve over the episodes (e.g. the random
policy's success@k from the Kuhn oracle). Reference lines are gray (per-opponent ones in the
opponent's colour) and named in the legend, which sits beside the axes, so no label covers a curve;
reference lines of equal values are one line with both names. The title names the evaluation split;
a split of one opponent (and one seat) names them and draws one line, not an overall mean hidden
under an identical per-opponent line.
``plot_training_curves`` reads a metrics JSONL file (one record per iteration and split) and draws
the chosen keys against the iteration (integer ticks): training as a line, evaluations as points; a
``<metric>@last`` key takes an evaluation record's last episode (its highest ``<metric>@k``). With a
``Selection`` the final evaluation's points sit at the iteration whose state they measured (the best
validated one), marked by a vertical line, not at the last iteration where they are logged.

Episodes count from 1 (the first attempt) on the x axis of episode curves as in the log keys, so the
point at x = 3 is ``success@3``, the paper's Pass@3.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_TRAINING_KEYS = ("success@1", "payoff@1", "reward_mean", "policy_loss", "entropy", "kl")

SPLIT_TITLES = {
    "eval": "eval split: held-out instances, training opponents",
    "heldout": "heldout split: held-out opponent",
    "train": "train split",
}
"""How plot titles name the splits the trainer evaluates (others are named as they are)."""

_REFERENCE_STYLES = (":", "--", "-.", (0, (1, 3)))
_EVALUATION_MARKERS = ("o", "s", "^", "D", "v")
"""Markers of the evaluation splits in training plots: points of two splits at one place stay visible."""

Y_LABELS = {
    "success": "share of meta-episodes won",
    "payoff": "payoff (game units; Kuhn: chips)",
    "reward_mean": "reward per episode",
    "reward_min": "reward per episode",
    "reward_max": "reward per episode",
    "policy_loss": "loss",
    "loss": "loss",
    "kl_loss": "loss",
    "entropy": "nats per token",
    "entropy_play": "nats per response (-log pi)",
    "approx_kl": "nats per token",
    "grad_norm": "global L2 norm",
    "clip_fraction": "share of tokens",
    "iteration_seconds": "seconds",
    "rollout_seconds": "seconds",
    "update_seconds": "seconds",
    "private_dependence": "total-variation distance",
    "dependent_share": "share of first-episode decisions",
    "valid_action_ratio": "share of actions",
}
"""The y-axis label of a training-plot key, by its name before ``@`` (the key itself is the title)."""


@dataclasses.dataclass(frozen=True)
class Selection:
    """The final evaluation measured the state of iteration ``state_of`` (the best validated state);
    its records are logged at the run's last iteration ``logged_at``."""

    logged_at: int
    state_of: int

    @property
    def label(self) -> str:
        return f"selected state, iteration {self.state_of} (the final evaluation's)"


def y_label(key: str) -> str:
    """What a training-plot key's values are (``Y_LABELS``); unknown keys are labelled by their name."""
    return Y_LABELS.get(key, Y_LABELS.get(key.split("@")[0], key))


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
    split: str | None = None,
    group_reference_lines: Mapping[str, Mapping[str, float | Sequence[float]]] | None = None,
) -> Path:
    """Draw ``metric``@k against the episode for the overall mean and each entry of ``metrics[by]``.

    ``split`` (e.g. ``"eval"``) is named in the default title. ``group_reference_lines`` maps an entry
    of ``metrics[by]`` to its own reference lines (e.g. each opponent's ceiling), drawn in its colour.
    """
    if "curves" not in metrics or metric not in metrics["curves"]:
        known = ", ".join(sorted(metrics.get("curves", {})))
        raise ValueError(f"metrics have no curve {metric!r}; known: {known or 'none'}")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    overall = np.asarray(metrics["curves"][metric], dtype=float)
    x = np.arange(1, len(overall) + 1)
    groups = dict(metrics.get(by) or {})
    only = next(iter(groups)) if len(groups) == 1 else None
    if only is None:
        ax.plot(x, overall, marker="o", linewidth=2.5, color="black",
                label=f"all ({metrics['num_meta_episodes']})")
    colors = {}
    for name, block in groups.items():
        values = np.asarray(block["curves"][metric], dtype=float)
        style = dict(linewidth=2.5, color="black") if only is not None else {}
        [line] = ax.plot(x[: len(values)], values, marker="o", label=f"{name} ({block['num_meta_episodes']})",
                         **style)
        colors[name] = line.get_color()
    for i, (label, ref) in enumerate(_merge_equal(reference_lines or {}).items()):
        style = dict(color="0.45", linewidth=1.2, linestyle=_REFERENCE_STYLES[i % len(_REFERENCE_STYLES)])
        _reference_line(ax, x, label, ref, style)
    for name, lines in (group_reference_lines or {}).items():
        for label, ref in _merge_equal(lines).items():
            style = dict(color=colors.get(name, "0.45"), linewidth=1.0, linestyle=(0, (2, 2)), alpha=0.8)
            _reference_line(ax, x, f"{name} {label}", ref, style)
    ax.set_xticks(x)
    ax.set_xlabel("episode (1 = first attempt)")
    ax.set_ylabel(f"{metric}@k")
    who = by.removeprefix("by_")
    default = f"{metric}@k by {who}" if only is None else f"{metric}@k, {who} {only}"
    if only is not None and by == "by_opponent":
        default = f"{metric}@k against opponent {only}" + _seat_note(metrics)
    if split is not None:
        default += f"\n{SPLIT_TITLES.get(split, f'{split} split')}"
    ax.set_title(title or default, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    return _save(fig, path)


_ORDINALS = ("first", "second", "third")


def _seat_note(metrics: Mapping[str, Any]) -> str:
    """``", agent in seat 1 (second to act)"`` when every meta-episode had the agent in one seat."""
    seats = [str(s) for s in metrics.get("by_seat") or {}]
    if len(seats) != 1:
        return ""
    [seat] = seats
    order = f" ({_ORDINALS[int(seat)]} to act)" if seat.isdigit() and int(seat) < len(_ORDINALS) else ""
    return f", agent in seat {seat}{order}"


def _merge_equal(lines: Mapping[str, float | Sequence[float]]) -> dict[str, float | Sequence[float]]:
    """Reference lines with equal values become one line named ``a = b``: none hides under another."""
    merged: dict[str, float | Sequence[float]] = {}
    for label, ref in lines.items():
        same = next((k for k, v in merged.items() if _equal(v, ref)), None)
        if same is None:
            merged[label] = ref
        else:
            merged[f"{same} = {label}"] = merged.pop(same)
    return merged


def _equal(a: float | Sequence[float], b: float | Sequence[float]) -> bool:
    return np.shape(a) == np.shape(b) and bool(np.allclose(np.asarray(a, float), np.asarray(b, float)))


def _reference_line(ax: Any, x: np.ndarray, label: str, ref: float | Sequence[float], style: dict) -> None:
    if np.ndim(ref) == 0:
        ax.axhline(float(ref), label=f"{label} = {float(ref):.3g}", **style)
    else:
        values = np.asarray(ref, dtype=float)[: len(x)]
        ax.plot(x[: len(values)], values, label=label, **style)


def plot_success_and_payoff(
    metrics: Mapping[str, Any],
    out_dir: str | os.PathLike,
    *,
    reference: Mapping[str, Mapping[str, float | Sequence[float]]] | None = None,
    prefix: str = "",
    split: str | None = None,
    group_reference: Mapping[str, Mapping[str, Mapping[str, float | Sequence[float]]]] | None = None,
) -> list[Path]:
    """``<prefix>success.png`` and ``<prefix>payoff.png`` per opponent; ``reference`` maps the metric
    name to its reference lines (e.g. ``{"success": {"winnable": 0.58}, "payoff": {"random": [...]}}``),
    ``group_reference`` the metric name to per-opponent lines (``{"success": {"cfr": {"ceiling": 0.5}}}``).

    The titles name ``split``; by default the split is the prefix without its trailing ``_``
    (``prefix="eval_"`` -> ``"eval"``), which is how the trainer names the files.
    """
    reference = reference or {}
    if split is None and prefix.strip("_"):
        split = prefix.strip("_")
    return [
        plot_episode_curves(
            metrics,
            Path(out_dir) / f"{prefix}{metric}.png",
            metric=metric,
            reference_lines=reference.get(metric),
            split=split,
            group_reference_lines=(group_reference or {}).get(metric),
        )
        for metric in ("success", "payoff")
    ]


def plot_training_curves(
    jsonl_path: str | os.PathLike,
    path: str | os.PathLike,
    *,
    keys: Sequence[str] | None = None,
    x_key: str = "iteration",
    selection: Selection | None = None,
) -> Path:
    """One panel per key against ``x_key``, one line per ``split`` of the records (train / eval / ...).

    ``keys`` default to those of ``DEFAULT_TRAINING_KEYS`` present in the file; keys that never occur
    are skipped. A file with no usable record is a clear error. With ``selection``, the evaluation
    records (every split but ``train`` and ``validation``) logged at ``selection.logged_at`` are drawn
    at ``selection.state_of``, which a vertical line marks on every panel.
    """
    from mage_jax.logging import read_jsonl

    records = [r for r in read_jsonl(str(jsonl_path)) if isinstance(r, Mapping) and x_key in r]
    if not records:
        raise ValueError(f"no records with {x_key!r} in {str(jsonl_path)!r}")

    present = {k for r in records for k, v in r.items() if _numeric(v) and k != x_key}
    present |= {k for k in (keys or ()) if any(_value(r, k) is not None for r in records)}
    wanted = [k for k in (keys if keys is not None else DEFAULT_TRAINING_KEYS) if k in present]
    if not wanted:
        raise ValueError(
            f"none of the keys {list(keys or DEFAULT_TRAINING_KEYS)} occur in {str(jsonl_path)!r}; "
            f"available: {', '.join(sorted(present)[:20])}"
        )
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    cols = min(3, len(wanted))
    rows = -(-len(wanted) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    splits = sorted({str(r.get("split", "train")) for r in records}, key=lambda s: (s != "train", s))
    colors = {split: f"C{i}" for i, split in enumerate(splits)}
    markers = {split: _EVALUATION_MARKERS[i % len(_EVALUATION_MARKERS)]
               for i, split in enumerate(s for s in splits if s != "train")}
    handles: dict[str, Any] = {}

    def x_of(record: Mapping[str, Any], split: str) -> float:
        x = float(record[x_key])
        if selection is not None and split not in ("train", "validation") and x == selection.logged_at:
            return float(selection.state_of)
        return x

    for ax, key in zip(axes.flat, wanted):
        for split in splits:
            points = sorted(
                (x_of(r, split), value)
                for r in records
                if str(r.get("split", "train")) == split and (value := _value(r, key)) is not None
            )
            if not points:
                continue
            xs, ys = zip(*points)
            if split == "train":
                style = dict(marker="." if len(points) < 50 else None, linewidth=1.5)
            else:  # evaluations are a few points: markers joined by a thin dashed line
                style = dict(marker=markers[split], markersize=5, linestyle="--", linewidth=0.8)
                if markers[split] != _EVALUATION_MARKERS[0]:  # hollow and larger: a point it covers shows
                    style.update(markersize=8, markerfacecolor="none")
            [line] = ax.plot(xs, ys, label=split, color=colors[split], **style)
            handles.setdefault(split, line)
        if selection is not None:
            mark = ax.axvline(selection.state_of, color="0.3", linestyle=":", linewidth=1.2,
                              label=selection.label)
            handles.setdefault(selection.label, mark)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel(x_key)
        ax.set_ylabel(y_label(key), fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(wanted) :]:
        ax.axis("off")
    fig.tight_layout()
    if len(handles) > 1:  # one legend for all panels, above them: it never covers a curve
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles),
                   bbox_to_anchor=(0.5, 1.0), fontsize=8, frameon=False)
    return _save(fig, path)


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _value(record: Mapping[str, Any], key: str) -> float | None:
    """``record[key]``, or for ``<metric>@last`` the record's ``<metric>@k`` of the highest ``k``."""
    if _numeric(record.get(key)):
        return float(record[key])
    if key.endswith("@last"):
        stem = key[: -len("last")]
        ks = [int(k[len(stem):]) for k, v in record.items()
              if k.startswith(stem) and k[len(stem):].isdigit() and _numeric(v)]
        if ks:
            return float(record[f"{stem}{max(ks)}"])
    return None

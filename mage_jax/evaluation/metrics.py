"""Evaluation metrics of meta-episodes (docs/method.md §9), as plain JSON-serialisable dicts.

Episodes are numbered from 1 wherever a person reads them (log keys, tables, plots, samples):
``success@k`` is the share of meta-episodes won in at least one of episodes 1..k, so ``success@3`` is
the paper's Pass@3. In code, the curves are lists indexed from 0 (``curves["success"][2]`` is
``success@3``) and ``episode_key`` names index ``k`` in logs. A meta-episode that stopped early (it
won) keeps its last episode's values for every later k.

Per meta-episode and k, with ``j = min(k, episodes_run)`` the last episode played up to k:

- ``success``: won in one of episodes 1..j; ``draw``: drew in one of 1..j;
  ``success_or_draw``: won or drew in one of 1..j;
- ``score``: the best ``StepInfo.score`` among episodes 1..j (games: the best payoff so far);
- ``payoff``: the payoff of episode j (reward in the game's unit, Kuhn chips): what MAGE optimises;
- ``reward``: the environment reward of episode j.

Each curve is the mean over meta-episodes, overall and split by opponent, seat and task type
(``task_info["task_type"]``, e.g. ALFWorld). Every block also carries the standard error of each
curve point (``standard_errors``: sample standard deviation over the meta-episodes / sqrt(n); None for
a single meta-episode) and ``payoff_gain``: payoff@K − payoff@1 paired over the meta-episodes (the
mean of each meta-episode's own difference, and its standard error), the adaptation a report tests.

``reflections`` (when any meta-episode wrote one): what the agent wrote, per opponent and seat: the
number of reflections and the most frequent texts with their counts (what a constrained reflection
vocabulary learned to say; free-text reflections are rarely equal, so the list is capped).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

CURVES = ("success", "draw", "success_or_draw", "score", "payoff", "reward")
TOP_REFLECTIONS = 10
"""Most frequent reflection texts kept per opponent and seat."""
MAX_REFLECTION_CHARS = 200


def episode_key(name: str, k: int) -> str:
    """The log key of curve ``name`` at list index ``k``: the episode counted from 1 (``success@1`` is
    the first attempt)."""
    return f"{name}@{k + 1}"


def _field(outcome: Any, name: str, default: Any = None) -> Any:
    if isinstance(outcome, Mapping):
        return outcome.get(name, default)
    return getattr(outcome, name, default)


def _per_episode(outcome: Any, name: str, n: int, fill: Any) -> list:
    values = list(_field(outcome, name, None) or [])
    if len(values) < n:
        values += [fill] * (n - len(values))
    return values[:n]


def meta_episode_curves(outcome: Any, num_episodes: int) -> dict[str, np.ndarray]:
    """The curves of one meta-episode (a ``MetaEpisodeOutcome`` or its ``to_dict()``), k = 0..K-1."""
    rewards = list(_field(outcome, "rewards", None) or [])
    run = len(rewards)
    if run == 0:
        raise ValueError(
            f"meta-episode {_field(outcome, 'meta_episode')!r} ran no episode; nothing to measure"
        )
    won = [bool(x) for x in _per_episode(outcome, "won", run, False)]
    draw = [bool(x) for x in _per_episode(outcome, "draw", run, False)]
    score = [float(x) for x in _per_episode(outcome, "score", run, 0.0)]
    payoff_values = _field(outcome, "payoff", None)
    payoff = [float(x) for x in (payoff_values if payoff_values else rewards)][:run]
    out = {name: np.zeros(num_episodes, dtype=np.float64) for name in CURVES}
    for k in range(num_episodes):
        j = min(k, run - 1)
        out["success"][k] = any(won[: j + 1])
        out["draw"][k] = any(draw[: j + 1])
        out["success_or_draw"][k] = any(w or d for w, d in zip(won[: j + 1], draw[: j + 1]))
        out["score"][k] = max(score[: j + 1])
        out["payoff"][k] = payoff[j]
        out["reward"][k] = float(rewards[j])
    return out


def standard_error(values: Any) -> float | None:
    """Standard error of the mean of ``values`` along axis 0 (sample std with n − 1 / sqrt(n)); None
    when fewer than two values (elementwise for 2-D input: a list)."""
    x = np.asarray(values, dtype=np.float64)
    if x.shape[0] < 2:
        return None if x.ndim == 1 else [None] * x.shape[1]
    se = x.std(axis=0, ddof=1) / math.sqrt(x.shape[0])
    return float(se) if x.ndim == 1 else [float(v) for v in se]


def _curves(outcomes: Sequence[Any], num_episodes: int) -> dict[str, Any]:
    stacked = [meta_episode_curves(o, num_episodes) for o in outcomes]
    curves = {name: [float(v) for v in np.mean([c[name] for c in stacked], axis=0)] for name in CURVES}
    errors = {name: standard_error([c[name] for c in stacked]) for name in CURVES}
    gain = [c["payoff"][-1] - c["payoff"][0] for c in stacked]  # paired: each meta-episode's own change
    return {"num_meta_episodes": len(outcomes), "curves": curves, "standard_errors": errors,
            "payoff_gain": {"first": 1, "last": num_episodes, "mean": float(np.mean(gain)),
                            "standard_error": standard_error(gain)}}


def gain_key(block: Mapping[str, Any]) -> str:
    """The log key of a block's paired payoff gain, e.g. ``payoff@3-payoff@1``."""
    gain = block["payoff_gain"]
    return f"payoff@{gain['last']}-payoff@{gain['first']}"


def _split(outcomes: Sequence[Any], key) -> dict[str, list[Any]]:
    groups: dict[str, list[Any]] = {}
    for o in outcomes:
        value = key(o)
        if value is None:
            continue
        groups.setdefault(str(value), []).append(o)
    return dict(sorted(groups.items()))


def _task_type(outcome: Any) -> Any:
    info = _field(outcome, "task_info", None) or {}
    return info.get("task_type") if isinstance(info, Mapping) else None


def compute_metrics(
    outcomes: Iterable[Any] | Any,
    *,
    num_episodes: int | None = None,
    rows: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """All evaluation metrics of a rollout.

    ``outcomes``: a ``RolloutResult`` (its rows are used for response lengths) or a sequence of
    ``MetaEpisodeOutcome`` / outcome dicts. ``num_episodes``: K, the length of every curve (default:
    the most episodes any meta-episode ran; pass the runner's N so that curves always span N).
    """
    if hasattr(outcomes, "outcomes") and hasattr(outcomes, "rows"):
        rows = outcomes.rows if rows is None else rows
        outcomes = outcomes.outcomes
    outcomes = list(outcomes)
    if not outcomes:
        raise ValueError("no meta-episode outcomes to compute metrics from")
    for o in outcomes:
        if not _field(o, "rewards", None):
            raise ValueError(f"meta-episode {_field(o, 'meta_episode')!r} ran no episode; nothing to measure")
    K = max(len(_field(o, "rewards")) for o in outcomes) if num_episodes is None else int(num_episodes)
    if K < 1:
        raise ValueError(f"num_episodes must be at least 1, got {num_episodes!r}")

    metrics: dict[str, Any] = _curves(outcomes, K)
    metrics["num_episodes"] = K
    metrics["by_opponent"] = {
        name: _curves(group, K) for name, group in _split(outcomes, lambda o: _field(o, "opponent")).items()
    }
    metrics["by_seat"] = {
        seat: _curves(group, K) for seat, group in _split(outcomes, lambda o: _field(o, "seat")).items()
    }
    metrics["by_task_type"] = {
        kind: _curves(group, K) for kind, group in _split(outcomes, _task_type).items()
    }

    reflections = reflection_counts(outcomes)
    if reflections:
        metrics["reflections"] = reflections
    valid = sum(int(_field(o, "valid_actions", 0) or 0) for o in outcomes)
    invalid = sum(int(_field(o, "invalid_actions", 0) or 0) for o in outcomes)
    metrics["valid_action_ratio"] = valid / (valid + invalid) if valid + invalid else None
    metrics["rows_per_meta_episode"] = float(np.mean([float(_field(o, "rows", 0) or 0) for o in outcomes]))
    metrics["episodes_run_mean"] = float(np.mean([len(_field(o, "rewards", None) or []) for o in outcomes]))
    if rows:
        lengths = np.asarray([r.response_length for r in rows], dtype=np.float64)
        play = np.asarray([r.phase == "play" for r in rows])
        metrics["response_length"] = {
            "mean": float(lengths.mean()),
            "max": float(lengths.max()),
            "min": float(lengths.min()),
            "play_mean": float(lengths[play].mean()) if play.any() else None,
            "reflect_mean": float(lengths[~play].mean()) if (~play).any() else None,
        }
    return metrics


def reflection_counts(outcomes: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """{"<opponent>/seat<seat>": {"count": n, "top": [[text, count], ...]}} of the reflections written
    (the ``TOP_REFLECTIONS`` most frequent, ties in first-written order); {} when none was written."""
    groups: dict[str, Counter] = {}
    for o in outcomes:
        texts = list(_field(o, "reflections", None) or [])
        if not texts:
            continue
        key = f"{_field(o, 'opponent')}/seat{_field(o, 'seat')}"
        groups.setdefault(key, Counter()).update(str(t)[:MAX_REFLECTION_CHARS] for t in texts)
    return {key: {"count": sum(c.values()), "top": [[t, n] for t, n in c.most_common(TOP_REFLECTIONS)]}
            for key, c in sorted(groups.items())}


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Flat ``{"success@1": ..., "success@1_se": ..., "opponent/aggressive/payoff@3": ...,
    "seat/1/success@2": ..., "payoff@3-payoff@1": ..., "payoff@3-payoff@1_se": ...}`` for logs (episodes
    counted from 1; ``_se``: the standard error)."""
    flat: dict[str, float] = {}

    def add_curves(block: Mapping[str, Any], head: str) -> None:
        errors = block.get("standard_errors") or {}
        for name, values in block["curves"].items():
            for k, v in enumerate(values):
                flat[prefix + head + episode_key(name, k)] = float(v)
                se = (errors.get(name) or [None] * len(values))[k]
                if se is not None:
                    flat[prefix + head + episode_key(name, k) + "_se"] = float(se)
        if "payoff_gain" in block:
            key, gain = prefix + head + gain_key(block), block["payoff_gain"]
            flat[key] = float(gain["mean"])
            if gain["standard_error"] is not None:
                flat[key + "_se"] = float(gain["standard_error"])
        flat[f"{prefix}{head}num_meta_episodes"] = float(block["num_meta_episodes"])

    add_curves(metrics, "")
    for split, label in (("by_opponent", "opponent"), ("by_seat", "seat"), ("by_task_type", "task_type")):
        for key, block in metrics.get(split, {}).items():
            add_curves(block, f"{label}/{key}/")
    for name in ("valid_action_ratio", "rows_per_meta_episode", "episodes_run_mean"):
        value = metrics.get(name)
        if value is not None and math.isfinite(float(value)):
            flat[f"{prefix}{name}"] = float(value)
    for stat, value in (metrics.get("response_length") or {}).items():
        if value is not None:
            flat[f"{prefix}response_length_{stat}"] = float(value)
    return flat

"""The metrics record of one training iteration: the flat ``{name: float}`` the trainer logs as a
``train`` record of ``metrics.jsonl`` (and shows on its progress bar).

One pure function of what the iteration produced — the rollout (rows, outcomes, counters), the
optimizer steps' metrics, the advantages and row lengths, the timings — so that what a record holds is
specified and tested apart from the loop that runs the iteration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mage_jax.compile_report import CompileReport
from mage_jax.evaluation.decisions import decision_stats
from mage_jax.evaluation.metrics import compute_metrics, episode_key

SUMMED_STEP_METRICS = ("skipped", "response_tokens")
MAX_STEP_METRICS = ("update_ratio",)
"""Reported as the largest value of the iteration's updates (the others: their mean)."""
ROLLOUT_STATS = ("rows", "invalid_ratio", "response_length_mean", "response_length_max", "episodes_run_mean",
                 "truncated_responses", "overflow_invalid")


@dataclasses.dataclass(frozen=True)
class IterationTimings:
    """Wall-clock seconds of one iteration: its rollout, its log-prob recompute and updates, all of it."""

    rollout_seconds: float
    update_seconds: float
    iteration_seconds: float


def step_summary(step_metrics: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The optimizer steps of one iteration in one record: counts summed (``skipped``, tokens), the
    update ratio's largest value, every other metric's mean; ``updates`` is the number of steps."""
    out: dict[str, float] = {}
    for name in step_metrics[0]:
        values = [m[name] for m in step_metrics]
        if name in SUMMED_STEP_METRICS:
            out[name] = float(np.sum(values))
        else:
            out[name] = float(np.max(values)) if name in MAX_STEP_METRICS else float(np.mean(values))
    out["updates"] = float(len(step_metrics))
    return out


def iteration_metrics(
    result: Any,
    step_metrics: Sequence[Mapping[str, float]],
    *,
    num_episodes: int,
    advantages: np.ndarray,
    row_lengths: np.ndarray,
    consecutive_skips_max: int,
    timings: IterationTimings,
    compiled: CompileReport,
    split_private: Callable[[str], tuple[str, str] | None] | None = None,
) -> dict[str, float]:
    """The ``train`` record of one iteration.

    ``result``: the training rollout (``rollout.meta_episode.RolloutResult``: rows, outcomes, stats);
    ``step_metrics``: one dict of floats per optimizer step; ``advantages`` and ``row_lengths``: one per
    real row (prompt + response tokens); ``compiled``: the XLA programs of this iteration's rollout and
    updates alone, not cumulative (``compile/programs``, ``compile/seconds``, ``compile/cache_hits``);
    ``consecutive_skips_max``: the longest run of skipped updates up to and inside this iteration;
    ``split_private``: the environment's split of an observation into
    its private part (``decision_stats``).
    """
    out = step_summary(step_metrics)
    out["consecutive_skips_max"] = float(consecutive_skips_max)
    train_metrics = compute_metrics(result, num_episodes=num_episodes)
    curves = train_metrics["curves"]
    for k in range(num_episodes):
        out[episode_key("success", k)] = curves["success"][k]
        out[episode_key("payoff", k)] = curves["payoff"][k]
    for opponent, split in train_metrics["by_opponent"].items():
        out[f"payoff@last/{opponent}"] = split["curves"]["payoff"][-1]
    out.update(decision_stats(result.rows, num_episodes, split_private).metrics())
    out["valid_action_ratio"] = train_metrics["valid_action_ratio"] or 0.0
    out["rows_per_meta_episode"] = train_metrics["rows_per_meta_episode"]
    episode_rewards = [r for o in result.outcomes for r in o.rewards]
    out["reward_mean"] = float(np.mean(episode_rewards))
    out["reward_min"] = float(np.min(episode_rewards))
    out["reward_max"] = float(np.max(episode_rewards))
    n = len(row_lengths)
    out["advantage_abs_mean"] = float(np.abs(advantages[:n]).mean()) if n else 0.0
    for name in ROLLOUT_STATS:
        if name in result.stats:
            out[name] = float(result.stats[name])
    out["row_tokens_max"] = float(row_lengths.max()) if n else 0.0
    out["row_tokens_mean"] = float(row_lengths.mean()) if n else 0.0
    out["rollout_seconds"] = timings.rollout_seconds
    out["update_seconds"] = timings.update_seconds
    out["iteration_seconds"] = timings.iteration_seconds
    out["rows_per_second"] = n / max(timings.iteration_seconds, 1e-9)
    out.update(compiled.metrics())
    out["success@last"] = curves["success"][-1]
    out["payoff@last"] = curves["payoff"][-1]
    return out

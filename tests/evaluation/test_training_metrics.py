"""The ``train`` record of one iteration (``evaluation.training_metrics``): what each field is, computed
from hand-made rollout results and optimizer-step metrics."""

from __future__ import annotations

import numpy as np
import pytest

from mage_jax.compile_report import CompileReport
from mage_jax.envs.base import env_class
from mage_jax.evaluation.training_metrics import IterationTimings, iteration_metrics, step_summary
from mage_jax.rollout.meta_episode import RolloutResult
from mage_jax.rollout.rows import Row
from tests.evaluation.test_metrics import outcome

STEPS = [
    {"loss": 1.0, "skipped": 0.0, "response_tokens": 10.0, "update_ratio": 0.01, "entropy": 0.5},
    {"loss": 3.0, "skipped": 1.0, "response_tokens": 12.0, "update_ratio": 0.05, "entropy": 0.7},
]
TIMINGS = IterationTimings(rollout_seconds=2.0, update_seconds=1.0, iteration_seconds=4.0)
COMPILED = CompileReport(programs=5, seconds=1.5, cache_hits=2)


def play_row(episode: int, logprob: float) -> Row:
    return Row(prompt_ids=np.arange(3), response_ids=np.array([7, 8]), logprobs=np.array([0.0, logprob]),
               group=0, meta_episode=0, episode=episode, turn=0, step=0, phase="play",
               anchor="Your Card: King | Actions: No actions yet || opponent: a", opponent="a",
               env_reward=0.0, valid=True)


def test_step_metrics_are_summed_maxed_or_averaged_by_kind():
    assert step_summary(STEPS) == {"loss": 2.0, "skipped": 1.0, "response_tokens": 22.0, "update_ratio": 0.05,
                                   "entropy": pytest.approx(0.6), "updates": 2.0}


def test_the_record_holds_the_curves_rewards_advantages_rollout_counters_and_timings():
    outcomes = [outcome(0, [10.0], [True], opponent="a", valid_actions=1, rows=1),
                outcome(1, [-5.0, 5.0], [False, True], opponent="b", valid_actions=2, rows=2)]
    rows = [play_row(0, -0.2), play_row(0, -0.4), play_row(1, -1.0)]
    result = RolloutResult(rows=rows, outcomes=outcomes, stats={"rows": 3.0, "invalid_ratio": 0.0,
                                                                 "not_a_rollout_stat": 9.0})
    record = iteration_metrics(result, STEPS, num_episodes=2, advantages=np.array([1.0, -3.0, 2.0, 99.0]),
                               row_lengths=np.array([10, 20, 30]), consecutive_skips_max=3, timings=TIMINGS,
                               compiled=COMPILED,
                               split_private=env_class("kuhn_poker").split_private)
    assert record["loss"] == 2.0 and record["updates"] == 2.0 and record["consecutive_skips_max"] == 3.0
    assert (record["success@1"], record["success@2"]) == (0.5, 1.0)
    assert (record["payoff@1"], record["payoff@2"]) == (pytest.approx(0.5), pytest.approx(1.5))
    assert record["payoff@last/a"] == 2.0 and record["payoff@last/b"] == 1.0
    assert (record["success@last"], record["payoff@last"]) == (1.0, pytest.approx(1.5))
    assert record["entropy_play@1"] == pytest.approx(0.3) and record["entropy_play@2"] == pytest.approx(1.0)
    rewards = (record["reward_mean"], record["reward_min"], record["reward_max"])
    assert rewards == (pytest.approx(10 / 3), -5, 10)
    assert record["advantage_abs_mean"] == 2.0  # the real rows' advantages only (one per row length)
    assert (record["rows"], record["invalid_ratio"]) == (3.0, 0.0) and "not_a_rollout_stat" not in record
    assert (record["row_tokens_max"], record["row_tokens_mean"]) == (30.0, 20.0)
    seconds = (record["rollout_seconds"], record["update_seconds"], record["iteration_seconds"])
    assert seconds == (2.0, 1.0, 4.0)
    assert record["rows_per_second"] == 3 / 4.0
    compiled = (record["compile/programs"], record["compile/seconds"], record["compile/cache_hits"])
    assert compiled == (5.0, 1.5, 2.0)
    assert all(isinstance(v, float) for v in record.values())

"""Independent attempts: N one-episode attempts of a task, scored as one meta-episode (docs/method.md §8)."""

from __future__ import annotations

import pytest

from mage_jax.evaluation.metrics import compute_metrics
from mage_jax.rollout.attempts import IndependentAttemptsRunner
from mage_jax.rollout.meta_episode import MetaEpisodeOutcome, MetaEpisodeRunner, RolloutResult
from mage_jax.rollout.policy import ScriptedPolicy
from mage_jax.rollout.tasks import Task, TaskSampler, TaskSamplerConfig
from mage_jax.testing import runner_config


class _FakeRunner:
    """One-episode runner whose outcome for copy ``m`` is won iff ``m`` is in ``wins``."""

    def __init__(self, wins):
        self.config = runner_config(num_episodes=1)
        self.wins = set(wins)
        self.seen = []

    def run(self, tasks, policy, *, training, progress=None, stop=None):
        self.seen = list(tasks)
        outcomes = []
        for t in tasks:
            won = t.meta_episode in self.wins
            o = MetaEpisodeOutcome(
                meta_episode=t.meta_episode,
                group=t.group,
                seed=t.seed,
                opponent=t.opponent,
                seat=t.seat,
                rewards=[10.0 if won else -5.0],
                won=[won],
                draw=[False],
                score=[1.0 if won else -1.0],
                payoff=[2.0 if won else -1.0],
                turns=[1],
                valid_actions=1,
                rows=1,
            )
            outcomes.append(o)
        return RolloutResult(rows=[], outcomes=outcomes, stats={"rows": float(len(tasks))})


def _tasks(n):
    return [Task(seed=2 * i + 1, opponent="aggressive", seat=0, group=i, meta_episode=i) for i in range(n)]


def test_independent_attempts_play_every_attempt_of_every_task_in_one_lockstep_call():
    base = _FakeRunner(wins=())
    runner = IndependentAttemptsRunner(base, 3)
    runner.run(_tasks(2), policy=None)
    assert [t.meta_episode for t in base.seen] == [0, 1, 2, 3, 4, 5]
    assert [t.seed for t in base.seen] == [1, 3, 1, 3, 1, 3]
    assert runner.config.num_episodes == 3


def test_independent_attempts_are_joined_like_a_meta_episode_and_stop_at_the_first_win():
    # task 0: lose, win (attempt 1 = copy 2), the third attempt is not counted; task 1: never wins.
    runner = IndependentAttemptsRunner(_FakeRunner(wins={2, 4}), 3)
    result = runner.run(_tasks(2), policy=None)
    first, second = result.outcomes
    assert first.won == [False, True] and first.payoff == [-1.0, 2.0] and first.meta_episode == 0
    assert second.won == [False, False, False] and second.rows == 3
    curves = compute_metrics(result.outcomes, num_episodes=3)["curves"]
    assert curves["success"] == [0.0, 0.5, 0.5]
    assert curves["payoff"] == [-1.0, 0.5, 0.5]


def test_independent_attempts_need_a_one_episode_base_runner():
    with pytest.raises(ValueError, match="one episode"):
        IndependentAttemptsRunner(MetaEpisodeRunner("kuhn_poker", {}, runner_config(num_episodes=3)), 3)


def test_independent_attempts_with_a_real_runner_repeat_a_deterministic_game():
    base = MetaEpisodeRunner(
        "kuhn_poker",
        {},
        runner_config(num_episodes=1, memory_mode="history_only", reflect=False, prompt_style="compact"),
    )
    tasks = TaskSampler(TaskSamplerConfig(opponents={"conservative": 1.0}, seats="mixed")).sample_eval(6)
    result = IndependentAttemptsRunner(base, 3).run(tasks, ScriptedPolicy(lambda p: "<action>PASS</action>"))
    for o in result.outcomes:  # the same line against a deterministic opponent: same result every attempt
        assert len(set(o.payoff)) == 1 and (o.won == [True] or len(o.won) == 3)
    assert {r.meta_episode for r in result.rows} <= set(range(18))

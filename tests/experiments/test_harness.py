"""Evaluation protocols of the experiments: independent attempts, the random legal-action reference,
options and the results table."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from experiments.harness import (
    EvalSplit,
    ExperimentOptions,
    IndependentAttemptsRunner,
    RandomLegalPolicy,
    random_reference,
    results_table,
)
from mage_jax import config as C
from mage_jax.evaluation.metrics import compute_metrics
from mage_jax.evaluation.oracle import KuhnMetaEpisode, kuhn_oracle
from mage_jax.rollout.meta_episode import MetaEpisodeOutcome, MetaEpisodeRunner, RolloutResult, RunnerConfig
from mage_jax.rollout.policy import ScriptedPolicy
from mage_jax.rollout.tasks import Task, TaskSampler, TaskSamplerConfig


class _FakeRunner:
    """One-episode runner whose outcome for copy ``m`` is won iff ``m`` is in ``wins``."""

    def __init__(self, wins):
        self.config = RunnerConfig(num_episodes=1)
        self.wins = set(wins)
        self.seen = []

    def run(self, tasks, policy, *, training):
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
        IndependentAttemptsRunner(MetaEpisodeRunner("kuhn_poker", {}, RunnerConfig(num_episodes=3)), 3)


def test_independent_attempts_with_a_real_runner_repeat_a_deterministic_game():
    base = MetaEpisodeRunner(
        "kuhn_poker",
        {},
        RunnerConfig(num_episodes=1, memory_mode="history_only", reflect=False, prompt_style="compact"),
    )
    tasks = TaskSampler(TaskSamplerConfig(opponents={"conservative": 1.0}, seats="mixed")).sample_eval(6)
    result = IndependentAttemptsRunner(base, 3).run(tasks, ScriptedPolicy(lambda p: "<action>PASS</action>"))
    for o in result.outcomes:  # the same line against a deterministic opponent: same result every attempt
        assert len(set(o.payoff)) == 1 and (o.won == [True] or len(o.won) == 3)
    assert {r.meta_episode for r in result.rows} <= set(range(18))


def test_random_reference_matches_the_exact_random_policy_of_the_kuhn_oracle():
    sampler = TaskSampler(
        TaskSamplerConfig(
            opponents={"conservative": 0.3, "aggressive": 0.3, "intermediate": 0.4}, seats="mixed"
        )
    )
    tasks = sampler.sample_eval(600)
    ref = random_reference("kuhn_poker", {}, tasks, 3, seed=1)
    exact = kuhn_oracle([KuhnMetaEpisode(t.seed, t.seat, t.opponent) for t in tasks], 3).random
    np.testing.assert_allclose(ref["random_success"], exact.success, atol=0.05)
    np.testing.assert_allclose(ref["random_payoff"], exact.payoff, atol=0.15)
    assert set(ref["by_opponent"]) == {"conservative", "aggressive", "intermediate"}


def test_random_reference_is_reproducible_and_counts_draws():
    tasks = TaskSampler(TaskSamplerConfig(opponents={"preferred-1": 1.0}, seats="first")).sample_eval(12)
    a = random_reference("tic_tac_toe", {}, tasks, 3, seed=4)
    assert a == random_reference("tic_tac_toe", {}, tasks, 3, seed=4)
    for key in ("random_success", "random_draw", "random_payoff"):
        assert len(a[key]) == 3
    assert all(0.0 <= x <= 1.0 for x in a["random_success"] + a["random_draw"])
    assert a["random_success"] == sorted(a["random_success"])  # success@k is cumulative


def test_random_legal_policy_only_plays_allowed_completions():
    from mage_jax.rollout.policy import GenerationRequest

    policy = RandomLegalPolicy(0)
    out = policy.generate(
        [GenerationRequest("p", ("<action>A</action>", "<action>B</action>"))] * 20
        + [GenerationRequest("reflect")]
    )
    assert {g.text for g in out[:20]} == {"<action>A</action>", "<action>B</action>"}
    assert out[-1].text == "<remark></remark>"


def test_experiment_options_reject_bad_modes_and_clashing_split_names():
    with pytest.raises(C.ConfigError, match="eval_mode"):
        ExperimentOptions(eval_mode="sometimes")
    with pytest.raises(C.ConfigError, match="distinct"):
        ExperimentOptions(extra_splits=(EvalSplit("heldout"),))
    with pytest.raises(C.ConfigError, match="distinct"):
        ExperimentOptions(extra_splits=(EvalSplit("a"), EvalSplit("a")))


def test_experiment_options_round_trip_through_json_dicts():
    opts = ExperimentOptions(
        eval_mode="independent",
        eval_pool={"x": 1.0},
        extra_splits=(EvalSplit("boxes_1", env_options={"num_boxes": 1}, meta_episodes=8),),
        headline_split="boxes_1",
    )
    assert ExperimentOptions.from_dict(opts.to_dict()) == dataclasses.replace(opts)


def test_results_table_lists_every_split_opponent_and_episode_with_references():
    metrics = compute_metrics(
        IndependentAttemptsRunner(_FakeRunner(wins={1}), 2).run(_tasks(2), None).outcomes, num_episodes=2
    )
    summary = {
        "evaluation": {
            "eval": {
                "metrics": metrics,
                "reference": {"random_success": [0.1, 0.2], "random_payoff": [-1.0, -0.5]},
            }
        },
        "wall_seconds": 3.0,
        "iterations": 1,
        "run_dir": "r",
    }
    text = results_table(summary, {"eval": "the pool"})
    assert "== the pool: 2 meta-episodes ==" in text
    assert "0.200" in text and "-0.500" in text and "wall time 3 s" in text
    assert len([line for line in text.splitlines() if line.startswith("all")]) == 2


def _fake_parts(env_name: str, **overrides):
    """What the evaluator reads from the trainer's run parts, without a model."""
    import types

    from experiments.presets import environment
    from mage_jax.training.trainer import make_task_sampler

    cfg = environment(env_name).config("tiny", overrides)
    runner = MetaEpisodeRunner(
        cfg.env.name,
        cfg.env.options,
        RunnerConfig(
            num_episodes=cfg.train.eval_num_episodes,
            memory_mode="history_only",
            reflect=False,
            prompt_style="compact",
            constrained_actions=True,
        ),
    )
    return types.SimpleNamespace(cfg=cfg, task_sampler=make_task_sampler(cfg), eval_runner=runner)


def test_extra_splits_play_with_their_own_environment_options(monkeypatch):
    import mage_jax.training.trainer as trainer
    from experiments.harness import make_evaluator

    monkeypatch.setattr(trainer, "make_policy", lambda parts, params, key, evaluation: RandomLegalPolicy(0))
    parts = _fake_parts("sokoban", **{"train.eval_meta_episodes": 3})
    evaluator = make_evaluator(
        parts,
        ExperimentOptions(
            extra_splits=(EvalSplit("boxes_1", env_options={"num_boxes": 1}, meta_episodes=4),)
        ),
        progress=False,
    )
    block = evaluator.evaluate_split(None, __import__("jax").random.key(0), evaluator.options.extra_splits[0])
    assert block["metrics"]["num_meta_episodes"] == 4
    assert evaluator.split_runner(evaluator.options.extra_splits[0]).env_options == {"num_boxes": 1}
    assert "random_success" in block["reference"]  # no oracle for Sokoban: the random reference


def test_evaluation_pool_replaces_the_training_pool_of_the_eval_split():
    from experiments.harness import make_evaluator

    parts = _fake_parts(
        "kuhn_poker",
        **{"env.opponents": ["intermediate"], "env.opponent_ratios": [1.0], "train.eval_meta_episodes": 10},
    )
    pool = {"conservative": 0.5, "aggressive": 0.5}
    evaluator = make_evaluator(parts, ExperimentOptions(eval_pool=pool), progress=False)
    tasks = evaluator.task_sets(heldout=False)["eval"]
    assert sorted({t.opponent for t in tasks}) == ["aggressive", "conservative"] and len(tasks) == 10


def test_independent_evaluation_mode_swaps_in_one_episode_attempts():
    from experiments.harness import make_evaluator

    parts = _fake_parts("kuhn_poker")
    make_evaluator(parts, ExperimentOptions(eval_mode="independent"), progress=False)
    assert isinstance(parts.eval_runner, IndependentAttemptsRunner)
    assert parts.eval_runner.base.config.num_episodes == 1 and parts.eval_runner.config.num_episodes == 3

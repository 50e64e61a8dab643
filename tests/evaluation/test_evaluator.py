"""The evaluator: named splits, their task sets and runners, and the reference policies."""

from __future__ import annotations

import dataclasses
import re
import types

import jax
import numpy as np
import pytest

from experiments.environments import environment
from mage_jax import config as C
from mage_jax.evaluation import evaluator as evaluator_module
from mage_jax.evaluation.evaluator import (
    EvalProtocol,
    EvalSplit,
    Evaluator,
    random_reference,
)
from mage_jax.evaluation.oracle import KuhnMetaEpisode, kuhn_oracle
from mage_jax.rollout.attempts import IndependentAttemptsRunner
from mage_jax.rollout.meta_episode import MetaEpisodeRunner
from mage_jax.rollout.policy import RandomLegalPolicy
from mage_jax.rollout.tasks import TaskSampler, TaskSamplerConfig
from mage_jax.training.assemble import make_eval_runner, make_task_sampler


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


def test_eval_protocols_reject_bad_modes_and_clashing_split_names():
    with pytest.raises(C.ConfigError, match="eval_mode"):
        EvalProtocol(eval_mode="sometimes")
    with pytest.raises(C.ConfigError, match="distinct"):
        EvalProtocol(extra_splits=(EvalSplit("heldout"),))
    with pytest.raises(C.ConfigError, match="distinct"):
        EvalProtocol(extra_splits=(EvalSplit("a"), EvalSplit("a")))


def test_eval_protocols_round_trip_through_json_dicts():
    opts = EvalProtocol(
        eval_mode="independent",
        eval_pool={"x": 1.0},
        extra_splits=(EvalSplit("boxes_1", env_options={"num_boxes": 1}, meta_episodes=8),),
        headline_split="boxes_1",
    )
    assert EvalProtocol.from_dict(C.to_dict(opts)) == dataclasses.replace(opts)


def _fake_parts(env_name: str, eval_mode: str = "meta", **overrides):
    """What the evaluator reads from the run parts, with a random legal-action policy instead of a model."""
    cfg = environment(env_name).config("tiny", overrides)
    return types.SimpleNamespace(cfg=cfg, task_sampler=make_task_sampler(cfg),
                                 eval_runner=make_eval_runner(cfg, eval_mode),
                                 policy=lambda params, key, evaluation: RandomLegalPolicy(0))


def test_extra_splits_play_with_their_own_environment_options():
    parts = _fake_parts("sokoban", **{"train.eval_meta_episodes": 3})
    split = EvalSplit("boxes_1", env_options={"num_boxes": 1}, meta_episodes=4)
    evaluator = Evaluator(parts, EvalProtocol(extra_splits=(split,)))
    assert [name for name, _, _ in evaluator.splits(heldout=False)] == ["eval"]  # final only
    (_, _, runner), = [s for s in evaluator.splits(heldout=True) if s[0] == "boxes_1"]
    assert runner.env_options["num_boxes"] == 1
    results = evaluator.evaluate(None, jax.random.key(0), heldout=True)
    assert list(results) == ["eval", "boxes_1"]
    assert results["boxes_1"].metrics["num_meta_episodes"] == 4
    assert "random_success" in results["boxes_1"].reference  # no oracle for Sokoban: the random reference


def test_evaluation_pool_replaces_the_training_pool_of_the_eval_split():
    parts = _fake_parts(
        "kuhn_poker",
        **{"env.opponents": ["intermediate"], "env.opponent_ratios": [1.0], "train.eval_meta_episodes": 10},
    )
    pool = {"conservative": 0.5, "aggressive": 0.5}
    evaluator = Evaluator(parts, EvalProtocol(eval_pool=pool))
    (name, tasks, _), = evaluator.splits(heldout=False)
    assert name == "eval" and len(tasks) == 10
    assert sorted({t.opponent for t in tasks}) == ["aggressive", "conservative"]


def test_independent_evaluation_mode_plays_one_episode_attempts():
    runner = _fake_parts("kuhn_poker", "independent").eval_runner
    assert isinstance(runner, IndependentAttemptsRunner)
    assert runner.base.config.num_episodes == 1 and runner.config.num_episodes == 3


def test_evaluation_may_play_more_episodes_than_training():
    """docs/method.md §2: evaluation runs N_eval >= N episodes (the paper: ALFWorld 10, WebShop 5)."""
    sizes = {"rollout.num_episodes": 2, "train.eval_num_episodes": 5, "train.eval_meta_episodes": 6,
             "train.eval_heldout_meta_episodes": 4}
    parts = _fake_parts("kuhn_poker", **sizes)
    evaluator = Evaluator(parts, EvalProtocol(random_reference=False))
    results = evaluator.evaluate(None, jax.random.key(0), heldout=True)
    assert set(results) == {"eval", "heldout"}
    for block in results.values():
        assert block.metrics["num_episodes"] == 5 and len(block.metrics["curves"]["success"]) == 5
        assert len(block.reference["random_success"]) == 5  # the oracle on the same five episodes
    assert isinstance(parts.eval_runner, MetaEpisodeRunner) and parts.eval_runner.config.num_episodes == 5


def test_kuhn_poker_gets_the_oracle_and_other_games_the_random_reference_only_when_asked():
    kuhn_parts = _fake_parts("kuhn_poker", **{"train.eval_meta_episodes": 4})
    kuhn = Evaluator(kuhn_parts, EvalProtocol(random_reference=False))
    (name, tasks, runner), = kuhn.splits(heldout=False)
    assert "winnable" in kuhn.reference(name, tasks, runner)
    ttt = _fake_parts("tic_tac_toe", **{"train.eval_meta_episodes": 4})
    (name, tasks, runner), = Evaluator(ttt, EvalProtocol(random_reference=False)).splits(heldout=False)
    assert Evaluator(ttt, EvalProtocol(random_reference=False)).reference(name, tasks, runner) is None
    assert "random_success" in Evaluator(ttt, EvalProtocol()).reference(name, tasks, runner)


class _RecordingBar:
    def __init__(self, **kwargs):
        self.total, self.unit, self.updates, self.postfix = kwargs["total"], kwargs["unit"], [], []

    def update(self, n=1):
        self.updates.append(n)

    def set_postfix_str(self, text):
        self.postfix.append(text)

    def close(self):
        pass


def test_the_progress_bar_moves_per_finished_meta_episode_and_shows_turns_and_tokens(monkeypatch):
    """All meta-episodes of a split (up to 128) are played as one batched rollout; the bar still moves
    as each finishes, not once at the end of the batch, and beside it the turns and tokens generated so
    far move with every round of generations."""
    bars = []

    def progress_bar(**kwargs):
        bars.append(_RecordingBar(**kwargs))
        return bars[-1]

    monkeypatch.setattr(evaluator_module, "progress_bar", progress_bar)
    parts = _fake_parts("kuhn_poker", **{"train.eval_meta_episodes": 12})
    Evaluator(parts, EvalProtocol(random_reference=False), progress=True).evaluate(None, jax.random.key(0),
                                                                                    heldout=False)
    (bar,) = bars
    assert bar.total == 12 and sum(bar.updates) == 12 and len(bar.updates) > 1
    assert all(text.endswith(" tok/s") for text in bar.postfix) and "success=" in bar.postfix[-1]
    turns = [int(re.search(r"([\d,]+) turns", text)[1].replace(",", "")) for text in bar.postfix]
    tokens = [int(re.search(r"([\d,]+) tokens", text)[1].replace(",", "")) for text in bar.postfix]
    assert turns == sorted(turns) and tokens == sorted(tokens) and len(set(turns)) > 1 and turns[-1] >= 12
    assert bar.unit == "meta-episodes"

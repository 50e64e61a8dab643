"""success@k, draw@k, score@k and payoff@k on hand-made outcomes (docs/method.md §9)."""

import json

import numpy as np
import pytest

from mage_jax.evaluation.metrics import compute_metrics, flatten_metrics, meta_episode_curves
from mage_jax.rollout.meta_episode import MetaEpisodeOutcome
from mage_jax.testing import runner_config


def outcome(i, rewards, won, draw=None, opponent="a", seat=0, payoff=None, score=None, **kw):
    return MetaEpisodeOutcome(
        meta_episode=i,
        group=i,
        seed=i,
        opponent=opponent,
        seat=seat,
        rewards=list(rewards),
        won=list(won),
        draw=list(draw or [False] * len(rewards)),
        score=list(score if score is not None else [r / 5 for r in rewards]),
        payoff=list(payoff if payoff is not None else [r / 5 for r in rewards]),
        **kw,
    )


OUTCOMES = [
    outcome(0, [10.0], [True], opponent="a", seat=0, valid_actions=1, rows=1),  # won at once: stops
    outcome(1, [-5.0, 5.0], [False, True], opponent="a", seat=1, valid_actions=3, invalid_actions=1, rows=4),
    outcome(2, [-5.0, -10.0, -5.0], [False] * 3, opponent="b", seat=0, valid_actions=4, rows=5),
    outcome(3, [0.0, 0.0, 0.0], [False] * 3, draw=[False, True, True], opponent="b", seat=1, rows=5),
]


def test_curves_of_one_meta_episode_carry_the_last_played_episode_forward():
    curves = meta_episode_curves(OUTCOMES[1], 4)
    assert curves["success"].tolist() == [0, 1, 1, 1]
    assert curves["payoff"].tolist() == [-1, 1, 1, 1]
    assert curves["reward"].tolist() == [-5, 5, 5, 5]
    assert curves["score"].tolist() == [-1, 1, 1, 1]
    best = meta_episode_curves(OUTCOMES[2], 3)
    assert best["score"].tolist() == [-1, -1, -1]  # best so far, not the last
    assert best["payoff"].tolist() == [-1, -2, -1]  # the last episode played


def test_success_draw_and_payoff_at_every_k_overall():
    m = compute_metrics(OUTCOMES, num_episodes=3)
    assert m["num_meta_episodes"] == 4 and m["num_episodes"] == 3
    c = m["curves"]
    assert c["success"] == [0.25, 0.5, 0.5]
    assert c["draw"] == [0.0, 0.25, 0.25]
    assert c["success_or_draw"] == [0.25, 0.75, 0.75]
    np.testing.assert_allclose(
        c["payoff"], [np.mean([2, -1, -1, 0]), np.mean([2, 1, -2, 0]), np.mean([2, 1, -1, 0])]
    )
    np.testing.assert_allclose(
        c["score"], [np.mean([2, -1, -1, 0]), np.mean([2, 1, -1, 0]), np.mean([2, 1, -1, 0])]
    )


def test_metrics_split_by_opponent_seat_and_task_type():
    typed = [outcome(9, [10.0], [True], task_info={"task_type": "cool"}), *OUTCOMES]
    m = compute_metrics(typed, num_episodes=3)
    assert m["by_opponent"]["a"]["curves"]["success"] == [2 / 3, 1.0, 1.0]
    assert m["by_opponent"]["b"]["curves"]["success_or_draw"] == [0.0, 0.5, 0.5]
    assert m["by_seat"]["1"]["num_meta_episodes"] == 2
    assert m["by_seat"]["1"]["curves"]["payoff"] == [-0.5, 0.5, 0.5]
    assert list(m["by_task_type"]) == ["cool"] and m["by_task_type"]["cool"]["num_meta_episodes"] == 1


def test_valid_action_ratio_rows_and_episodes_per_meta_episode():
    m = compute_metrics(OUTCOMES)
    assert m["num_episodes"] == 3  # the longest meta-episode by default
    assert m["valid_action_ratio"] == 8 / 9
    assert m["rows_per_meta_episode"] == 15 / 4
    assert m["episodes_run_mean"] == 9 / 4


def test_metrics_are_plain_json_and_flatten_for_logs():
    m = compute_metrics([o.to_dict() for o in OUTCOMES], num_episodes=3)  # dicts work as well
    assert json.loads(json.dumps(m)) == m
    flat = flatten_metrics(m, prefix="eval/")
    # Keys count episodes from 1: ``success@2`` is the curve's second entry, episodes 1..3 give @1..@3.
    assert flat["eval/success@2"] == m["curves"]["success"][1] == 0.5
    assert flat["eval/opponent/b/draw@3"] == 0.5
    assert flat["eval/seat/0/success@1"] == 0.5 and flat["eval/valid_action_ratio"] == 8 / 9
    assert {k for k in flat if k.startswith("eval/payoff@")} == {
        *(f"eval/payoff@{k}" for k in (1, 2, 3)), *(f"eval/payoff@{k}_se" for k in (1, 2, 3)),
        "eval/payoff@3-payoff@1", "eval/payoff@3-payoff@1_se"}
    assert all(isinstance(v, float) for v in flat.values())


def test_every_curve_point_carries_its_standard_error_over_the_meta_episodes():
    m = compute_metrics(OUTCOMES, num_episodes=3)
    payoff_at_1 = [2, -1, -1, 0]  # each meta-episode's payoff@1
    assert m["standard_errors"]["payoff"][0] == pytest.approx(np.std(payoff_at_1, ddof=1) / 2)
    assert m["standard_errors"]["success"][1] == pytest.approx(np.std([1, 1, 0, 0], ddof=1) / 2)
    a = m["by_opponent"]["a"]  # two meta-episodes: success@2 is 1 in both, so its error is 0
    assert a["standard_errors"]["success"] == [pytest.approx(np.std([1, 0], ddof=1) / np.sqrt(2)), 0.0, 0.0]
    assert compute_metrics(OUTCOMES[:1], num_episodes=3)["standard_errors"]["payoff"] == [None] * 3
    flat = flatten_metrics(m)
    assert flat["payoff@1_se"] == m["standard_errors"]["payoff"][0]
    assert flat["opponent/b/success@3_se"] == 0.0


def test_the_payoff_gain_is_paired_over_meta_episodes():
    # Per meta-episode payoff@3 - payoff@1: 2 - 2, 1 - (-1), -1 - (-1), 0 - 0 = 0, 2, 0, 0.
    m = compute_metrics(OUTCOMES, num_episodes=3)
    gain = m["payoff_gain"]
    assert (gain["first"], gain["last"], gain["mean"]) == (1, 3, 0.5)
    assert gain["standard_error"] == pytest.approx(np.std([0, 2, 0, 0], ddof=1) / 2)  # 0.5, not unpaired
    unpaired = np.hypot(m["standard_errors"]["payoff"][0], m["standard_errors"]["payoff"][2])
    assert gain["standard_error"] < unpaired  # pairing removes the deal-to-deal spread
    assert m["by_opponent"]["a"]["payoff_gain"]["mean"] == 1.0
    flat = flatten_metrics(m, prefix="eval/")
    assert flat["eval/payoff@3-payoff@1"] == 0.5
    assert flat["eval/payoff@3-payoff@1_se"] == gain["standard_error"]


def test_metrics_from_a_rollout_include_response_lengths():
    from mage_jax.rollout.meta_episode import MetaEpisodeRunner
    from mage_jax.rollout.policy import ScriptedPolicy
    from mage_jax.rollout.tasks import TaskSampler, TaskSamplerConfig

    tasks = TaskSampler(
        TaskSamplerConfig(num_tasks=2, group_size=1, opponents={"aggressive": 1})
    ).sample_eval(4)
    policy = ScriptedPolicy(lambda p: "<remark>x</remark>" if "<remark>" in p else "<action>BET</action>")
    result = MetaEpisodeRunner("kuhn_poker", {}, runner_config(num_episodes=3)).run(
        tasks, policy, training=False
    )
    m = compute_metrics(result, num_episodes=3)
    assert m["response_length"]["play_mean"] == len("<action>BET</action>")
    assert m["curves"]["success"][0] == np.mean([o.won[0] for o in result.outcomes])


def test_empty_or_broken_outcomes_get_a_clear_error():
    with pytest.raises(ValueError, match="no meta-episode"):
        compute_metrics([])
    with pytest.raises(ValueError, match="ran no episode"):
        compute_metrics([outcome(0, [], [])])


def test_reflections_are_counted_per_opponent_and_seat_most_frequent_first():
    outs = [
        outcome(0, [-5.0, -5.0, 5.0], [False, False, True], opponent="a", seat=0,
                reflections=["bets", "King"]),
        outcome(1, [-5.0, 5.0], [False, True], opponent="a", seat=0, reflections=["King"]),
        outcome(2, [-5.0, 5.0], [False, True], opponent="b", seat=1, reflections=["x" * 500]),
        outcome(3, [5.0], [True], opponent="b", seat=0),
    ]
    got = json.loads(json.dumps(compute_metrics(outs, num_episodes=3)))["reflections"]
    assert got == {"a/seat0": {"count": 3, "top": [["King", 2], ["bets", 1]]},
                   "b/seat1": {"count": 1, "top": [["x" * 200, 1]]}}
    assert "reflections" not in compute_metrics(outs[3:], num_episodes=3)

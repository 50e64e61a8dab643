"""What a run reports: the results table."""

from __future__ import annotations

from mage_jax.evaluation.metrics import compute_metrics
from mage_jax.evaluation.report import results_table
from mage_jax.rollout.attempts import IndependentAttemptsRunner
from tests.rollout.test_attempts import _FakeRunner, _tasks


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
    rows = [line.split() for line in text.splitlines() if line.startswith("all")]
    assert [row[1] for row in rows] == ["1", "2"]  # episodes count from 1, as in success@k and the plots


def test_results_table_gives_every_mean_its_standard_error_and_the_paired_payoff_gain():
    from tests.evaluation.test_metrics import OUTCOMES

    metrics = compute_metrics(OUTCOMES, num_episodes=3)
    text = results_table({"evaluation": {"eval": {"metrics": metrics, "reference": None}}})
    rows = {line.split()[1]: line.split() for line in text.splitlines() if line.startswith("all")}
    se = metrics["standard_errors"]
    assert rows["1"][2] == f"{metrics['curves']['success'][0]:.3f}±{se['success'][0]:.3f}"
    assert rows["3"][4] == f"{metrics['curves']['payoff'][2]:+.3f}±{se['payoff'][2]:.3f}"
    gain = metrics["payoff_gain"]
    assert (f"gain, all: payoff@3 - payoff@1 = +0.500 ± {gain['standard_error']:.3f} (+1.0 SE), paired "
            "over 4 meta-episodes") in text
    assert "gain, a: payoff@3 - payoff@1 = +1.000" in text  # and per opponent

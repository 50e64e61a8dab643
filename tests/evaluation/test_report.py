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

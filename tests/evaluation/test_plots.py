"""Plots write PNG files (headless) and refuse inputs they cannot draw with one clear error."""

import json

import pytest

from mage_jax.evaluation.metrics import compute_metrics
from mage_jax.evaluation.plots import plot_episode_curves, plot_success_and_payoff, plot_training_curves
from mage_jax.rollout.meta_episode import MetaEpisodeOutcome

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def metrics():
    outcomes = [
        MetaEpisodeOutcome(
            0, 0, 0, "aggressive", 0, rewards=[-5.0, 5.0], won=[False, True], payoff=[-1.0, 1.0]
        ),
        MetaEpisodeOutcome(1, 1, 1, "conservative", 1, rewards=[5.0], won=[True], payoff=[1.0]),
    ]
    return compute_metrics(outcomes, num_episodes=3)


def is_png(path):
    return path.exists() and path.read_bytes()[:8] == PNG_MAGIC


def test_success_and_payoff_curves_per_opponent_with_reference_lines(tmp_path):
    reference = {"success": {"winnable": 0.58, "random": [0.3, 0.45, 0.56]}, "payoff": {"best fixed": 0.13}}
    paths = plot_success_and_payoff(metrics(), tmp_path / "eval", reference=reference, prefix="it10_")
    assert [p.name for p in paths] == ["it10_success.png", "it10_payoff.png"]
    assert all(is_png(p) for p in paths)


def test_an_unknown_metric_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no curve 'elo'"):
        plot_episode_curves(metrics(), tmp_path / "x.png", metric="elo")


def test_training_curves_from_a_metrics_jsonl_file(tmp_path):
    log = tmp_path / "metrics.jsonl"
    records = [
        {"iteration": i, "split": "train", "reward_mean": i / 10, "policy_loss": 1 / (i + 1)}
        for i in range(5)
    ]
    records += [{"iteration": i, "split": "eval", "success@0": 0.1 * i} for i in (0, 4)]
    log.write_text("\n".join(json.dumps(r) for r in records) + "\n{torn")
    out = plot_training_curves(log, tmp_path / "train.png")
    assert is_png(out)
    with pytest.raises(ValueError, match="none of the keys"):
        plot_training_curves(log, tmp_path / "none.png", keys=["grad_norm"])
    with pytest.raises(ValueError, match="no records"):
        plot_training_curves(tmp_path / "missing.jsonl", tmp_path / "y.png")

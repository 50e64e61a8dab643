"""Evaluation: success@k / payoff@k metrics, the Kuhn Poker oracle (``evaluation.oracle``), plots."""

from mage_jax.evaluation.metrics import CURVES, compute_metrics, flatten_metrics, meta_episode_curves
from mage_jax.evaluation.plots import plot_episode_curves, plot_success_and_payoff, plot_training_curves

__all__ = [
    "CURVES",
    "compute_metrics",
    "flatten_metrics",
    "meta_episode_curves",
    "plot_episode_curves",
    "plot_success_and_payoff",
    "plot_training_curves",
]

"""The training diagnostics of ``mage_jax.evaluation.decisions``: decision entropy per episode and the
dependence of first-episode decisions on the private information."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mage_jax.envs.base import env_class
from mage_jax.evaluation.decisions import DecisionStats, decision_stats, total_variation
from mage_jax.rollout.rows import Row

SPLIT = env_class("kuhn_poker").split_private
BET, PASS = np.array([7, 8]), np.array([7, 9])


def row(card: str, actions: str, response, *, episode: int = 0, logprob: float = -0.5,
        phase: str = "play") -> Row:
    return Row(prompt_ids=np.arange(3), response_ids=response, logprobs=np.array([0.0, logprob]), group=0,
               meta_episode=0, episode=episode, turn=0, step=0, phase=phase,
               anchor=f"Your Card: {card} | Actions: {actions} || opponent: cfr", opponent="cfr",
               env_reward=0.0, valid=True)


def test_entropy_is_the_mean_negative_log_probability_of_each_episodes_play_rows():
    rows = [row("King", "No actions yet", BET, logprob=-0.2),
            row("Jack", "No actions yet", PASS, logprob=-0.4),
            row("King", "No actions yet", BET, episode=2, logprob=-1.0),
            row("King", "", BET, episode=1, logprob=-3.0, phase="reflect")]
    stats = decision_stats(rows, 3, SPLIT)
    assert stats.entropy[0] == pytest.approx(0.3) and stats.entropy[2] == pytest.approx(1.0)
    assert math.isnan(stats.entropy[1])  # no play row in episode 1
    assert stats.reflect_entropy == pytest.approx(3.0)


def test_card_independent_decisions_have_no_dependence_and_card_decided_ones_full_dependence():
    ignore = [row(card, "No actions yet", BET if i % 2 else PASS) for card in ("Jack", "Queen", "King")
              for i in range(4)]
    stats = decision_stats(ignore, 3, SPLIT)
    assert stats.private_dependence == 0.0 and stats.dependent_share == 0.0
    decided = [row("King", "No actions yet", BET)] * 3 + [row("Jack", "No actions yet", PASS)] * 3
    stats = decision_stats(decided + ignore, 3, SPLIT)
    # one situation; Jack (3 PASS + 2 PASS + 2 BET) vs King (3 BET + 2 BET + 2 PASS): TV = 5/7 - 2/7
    assert stats.private_dependence == pytest.approx(3 / 7)
    assert stats.dependent_share == 0.0
    assert decision_stats(decided, 3, SPLIT).dependent_share == 1.0


def test_dependence_is_weighted_over_public_situations_and_ignores_later_episodes():
    first = [row("King", "No actions yet", BET), row("Jack", "No actions yet", PASS)]  # TV 1, weight 2
    second = [row(c, "Player 0: Bet", PASS) for c in ("King", "Jack", "Queen", "King")]  # TV 0, weight 4
    later = [row("King", "Player 0: Bet", BET, episode=1)]
    stats = decision_stats(first + second + later, 2, SPLIT)
    assert stats.private_dependence == pytest.approx(2 / 6)
    assert stats.dependent_share == pytest.approx(2 / 6)


def test_without_a_split_only_the_entropies_are_reported():
    stats = decision_stats([row("King", "No actions yet", BET)], 1, None)
    assert stats.private_dependence is None
    assert set(stats.metrics()) == {"entropy_play@1"}  # the first episode, counted from 1
    assert isinstance(stats, DecisionStats)


def test_total_variation_of_counters():
    from collections import Counter

    assert total_variation(Counter(a=1), Counter(b=2)) == 1.0
    assert total_variation(Counter(a=1, b=1), Counter(a=2, b=2)) == 0.0

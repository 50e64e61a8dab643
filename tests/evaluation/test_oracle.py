"""Kuhn Poker oracle (docs/method.md §7.1 and §9): winnable share, random and best fixed references."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mage_jax.envs.kuhn_poker import KuhnPokerEnv, kuhn_deal
from mage_jax.envs.opponents.kuhn import KUHN_TRAINING_POOL
from mage_jax.evaluation.oracle import (
    INFORMATION_STATES,
    KuhnMetaEpisode,
    best_fixed_strategy,
    fixed_strategy_payoffs,
    is_winnable,
    kuhn_oracle,
    kuhn_population,
)

N = 3


@pytest.fixture(scope="module")
def evaluation_set() -> list[KuhnMetaEpisode]:
    """A fixed, balanced set: each deal x seat against 3 conservative, 3 aggressive, 4 intermediate."""
    deals, seed = {}, 0
    while len(deals) < 6:
        deals.setdefault(kuhn_deal(seed), seed)
        seed += 1
    slots = [name for name, ratio in KUHN_TRAINING_POOL.items() for _ in range(round(10 * ratio))]
    return [
        KuhnMetaEpisode(seed=s, seat=seat, opponent=name)
        for s in sorted(deals.values())
        for seat in (0, 1)
        for name in slots
    ]


@pytest.fixture(scope="module")
def report(evaluation_set):
    return kuhn_oracle(evaluation_set, num_episodes=N)


def test_reference_values_of_the_spec_on_the_training_pool_with_mixed_seats(report):
    assert report.winnable == pytest.approx(0.58, abs=0.01)
    assert report.random.success[2] == pytest.approx(0.56, abs=0.01)  # by the third episode
    assert report.random.payoff[2] == pytest.approx(0.0, abs=0.02)
    assert report.best_fixed.payoff[0] == pytest.approx(0.13, abs=0.01)
    assert report.best_fixed_by_success.success[0] == pytest.approx(report.winnable)  # ceiling in episode 1
    assert report.random.success[-1] < report.winnable


def test_balanced_set_equals_the_weighted_population(report):
    population = kuhn_oracle(kuhn_population(), num_episodes=N)
    assert population.winnable == pytest.approx(7 / 12)
    np.testing.assert_allclose(population.random.success, report.random.success)
    np.testing.assert_allclose(population.random.payoff, report.random.payoff, atol=1e-12)
    np.testing.assert_allclose(population.best_fixed.payoff, report.best_fixed.payoff)


def test_held_out_cfr_opponent_with_the_agent_second():
    cfr = kuhn_oracle(kuhn_population({"cfr": 1.0}, seats=(1,)), num_episodes=N)
    assert cfr.winnable == pytest.approx(0.5)


def _play_random(env: KuhnPokerEnv, rng: np.random.Generator) -> tuple[list[bool], list[float]]:
    """One meta-episode of the uniformly random agent, with early stop after a win."""
    success, payoff, won, last = [], [], False, 0.0
    for episode in range(N):
        if not won:
            if episode:
                env.restart()
            while not env.done:
                result = env.step(f"<action>{rng.choice(env.legal_actions())}</action>")
            won, last = result.info.won, result.info.score
        success.append(won)
        payoff.append(last)
    return success, payoff


def test_random_policy_numbers_agree_with_monte_carlo_play_through_the_environment(evaluation_set, report):
    rng = np.random.default_rng(0)
    env = KuhnPokerEnv()
    success, payoff = [], []
    for _ in range(60):
        for meta in evaluation_set:
            env.reset(meta.seed, opponent=meta.opponent, seat=meta.seat)
            s, p = _play_random(env, rng)
            success.append(s)
            payoff.append(p)
    success, payoff = np.array(success, dtype=float), np.array(payoff)
    n = len(success)
    assert np.all(np.abs(success.mean(0) - report.random.success) < 4 * np.sqrt(0.25 / n))
    assert np.all(np.abs(payoff.mean(0) - report.random.payoff) < 4 * payoff.std(0) / np.sqrt(n))


def test_best_fixed_strategies_beat_every_one_of_the_4096_pure_strategies(evaluation_set, report):
    payoffs = np.stack(
        [
            fixed_strategy_payoffs(evaluation_set, dict(zip(INFORMATION_STATES, bits)))
            for bits in itertools.product((0, 1), repeat=len(INFORMATION_STATES))
        ]
    )
    mean_payoff, success = payoffs.mean(1), (payoffs > 0).mean(1)
    assert report.best_fixed.payoff[0] == pytest.approx(mean_payoff.max())
    assert report.best_fixed.success[0] == pytest.approx(
        success[np.isclose(mean_payoff, mean_payoff.max())].max()
    )
    assert report.best_fixed_by_success.success[0] == pytest.approx(success.max())
    assert report.best_fixed_by_success.payoff[0] == pytest.approx(
        mean_payoff[success == success.max()].max()
    )


def test_best_fixed_strategy_played_through_the_environment_earns_the_oracle_payoff(evaluation_set, report):
    strategy = report.best_fixed_strategy
    env, payoffs = KuhnPokerEnv(), []
    for meta in evaluation_set:
        env.reset(meta.seed, opponent=meta.opponent, seat=meta.seat)
        while not env.done:
            state = f"{env.task_info['agent_card']}{env.history}"
            result = env.step(f"<action>{strategy[state]}</action>")
        payoffs.append(result.info.score)
    assert np.mean(payoffs) == pytest.approx(report.best_fixed.payoff[0])


def test_winnable_means_some_line_through_the_environment_wins(evaluation_set):
    env = KuhnPokerEnv()
    for meta in evaluation_set:
        wins = []
        for line in itertools.product(("PASS", "BET"), repeat=2):
            env.reset(meta.seed, opponent=meta.opponent, seat=meta.seat)
            for action in line:
                if not env.done:
                    result = env.step_action(action)
            wins.append(result.info.won)
        assert is_winnable(meta) == any(wins)


def test_adaptive_bound_starts_at_the_best_fixed_payoff_and_never_exceeds_the_omniscient_agent(report):
    bound = report.adaptive_payoff_bound
    assert bound[0] == pytest.approx(report.best_fixed.payoff[0])
    assert np.all(np.diff(bound) >= -1e-12)
    assert np.all(bound <= report.omniscient_payoff + 1e-12)
    assert np.all(bound >= report.random.payoff - 1e-12)


def test_weights_and_unbalanced_sets():
    heavy = [KuhnMetaEpisode(seed=0, seat=0, opponent="aggressive", weight=3.0)]
    light = [KuhnMetaEpisode(seed=1, seat=1, opponent="conservative", weight=1.0)]
    mixed = kuhn_oracle(heavy + light, num_episodes=2)
    alone = [kuhn_oracle(s, num_episodes=2) for s in (heavy, light)]
    expected = 0.75 * alone[0].random.payoff + 0.25 * alone[1].random.payoff
    np.testing.assert_allclose(mixed.random.payoff, expected)
    assert best_fixed_strategy(heavy)  # a full map over all information states
    assert set(best_fixed_strategy(heavy)) == set(INFORMATION_STATES)


def test_bad_input_gets_one_clear_error():
    with pytest.raises(ValueError, match="at least one"):
        kuhn_oracle([])
    with pytest.raises(ValueError, match="unknown Kuhn Poker opponent"):
        kuhn_oracle([KuhnMetaEpisode(seed=0, seat=0, opponent="random")])
    with pytest.raises(ValueError, match="criterion"):
        best_fixed_strategy([KuhnMetaEpisode(seed=0, seat=0, opponent="cfr")], criterion="regret")

"""Advantage estimators: GiGPO (MAGE), GRPO, RLOO (docs/method.md §5)."""

import itertools
import statistics

import jax
import numpy as np
import pytest

from mage_jax.algorithms.advantages import (
    AdvantageConfig,
    advantage_fn,
    available_advantages,
    compute_advantages,
    credit,
    register_advantage,
)
from mage_jax.algorithms.returns import RowBatch
from tests.algorithms import reference_credit as ref

HAND = 16
EPS = 1e-6


def close(actual, expected, atol=1e-5):
    actual = np.asarray(actual)
    np.testing.assert_allclose(actual[: len(expected)], expected, atol=atol, rtol=0)
    assert np.all(actual[len(expected):] == 0)


def kuhn_group() -> RowBatch:
    """Group 0: meta-episode 0 is the Kuhn example of docs/method.md §4, meta-episode 1 wins episode 0 (+10).
    Group 1 holds a single row (a pool of one). Anchor 1 = the initial state, 9 = reflection."""
    return RowBatch.create(
        group=[0, 0, 0, 0, 0, 1], meta_episode=[0, 0, 0, 0, 1, 0], episode=[0, 0, 1, 1, 0, 0],
        step=[0, 1, 2, 3, 0, 0], is_reflect=[0, 1, 0, 0, 0, 0], anchor=[1, 9, 1, 2, 1, 1],
        env_reward=[-5, 0, 0, 10, 10, 3],
    ).pad(HAND)


E = [-5.0, 0.0, 15.0, 15.0, 10.0]  # row scores of group 0
G = [3.55, 14.25, 14.25, 15.0, 10.0]  # step returns of group 0


def test_credit_reports_row_scores_and_step_returns():
    c = credit(kuhn_group())
    close(c.score, E + [3.0])
    close(c.step_return, G + [3.0])
    close(c.meta_reward, E + [3.0])
    close(c.penalty, [0.0] * 6)


def test_gigpo_global_anchor_mean_norm_by_hand():
    mean_e = sum(E) / 5
    cluster = (G[0] + G[2] + G[4]) / 3  # anchor 1 pooled over episodes 0 and 1 and both meta-episodes
    a_step = [G[0] - cluster, 0.0, G[2] - cluster, 0.0, G[4] - cluster]  # anchors 9 and 2: singletons
    expected = [e - mean_e + s for e, s in zip(E, a_step)] + [0.0]  # group 1: pool of one
    close(compute_advantages("gigpo", kuhn_group()), expected)


def test_gigpo_local_anchor_pools_only_the_same_episode():
    mean_e = sum(E) / 5
    cluster = (G[0] + G[4]) / 2  # (anchor 1, episode 0); (anchor 1, episode 1) is a singleton
    a_step = [G[0] - cluster, 0.0, 0.0, 0.0, G[4] - cluster]
    expected = [e - mean_e + s for e, s in zip(E, a_step)] + [0.0]
    close(compute_advantages("gigpo", kuhn_group(), AdvantageConfig(anchor="local")), expected)


def test_gigpo_mean_std_norm_divides_each_term_by_its_pool_std():
    mean_e, std_e = sum(E) / 5, statistics.stdev(E)
    pool = [G[0], G[2], G[4]]
    mean_g, std_g = sum(pool) / 3, statistics.stdev(pool)
    a_step = [(G[0] - mean_g) / (std_g + EPS), 0.0, (G[2] - mean_g) / (std_g + EPS), 0.0,
              (G[4] - mean_g) / (std_g + EPS)]
    expected = [(e - mean_e) / (std_e + EPS) + 0.5 * s for e, s in zip(E, a_step)] + [0.0]
    adv = compute_advantages("gigpo", kuhn_group(), AdvantageConfig(norm="mean_std_norm", omega=0.5))
    close(adv, expected)
    assert np.all(np.isfinite(adv))


def test_gigpo_penalties_enter_the_episode_term_only():
    rows = kuhn_group()
    rows = rows.replace(invalid=rows.invalid.at[1].set(True))  # the reflection lacks <remark>
    e = list(E)
    e[1] -= 2.0
    mean_e = sum(e) / 5
    cluster = (G[0] + G[2] + G[4]) / 3
    a_step = [G[0] - cluster, 0.0, G[2] - cluster, 0.0, G[4] - cluster]
    expected = [x - mean_e + s for x, s in zip(e, a_step)] + [0.0]
    close(compute_advantages("gigpo", rows, AdvantageConfig(invalid_penalty=2.0)), expected)


def test_gigpo_in_single_episode_mode_is_plain_gigpo():
    # One episode per meta-episode (the RL baselines): the designs agree, and γ_traj plays no part.
    rows = RowBatch.create(
        group=[0] * 4, meta_episode=[0, 0, 1, 1], episode=[0] * 4, step=[0, 1, 0, 1], is_reflect=[0] * 4,
        anchor=[1, 2, 1, 3], env_reward=[0, 1, 0, -1],
    ).pad(HAND)
    single = AdvantageConfig(reward_design="single_episode")
    # e = [1, 1, -1, -1] (group mean 0); G = [0.95, 1, -0.95, -1]; anchor 1 pools rows 0 and 2 (mean 0)
    close(compute_advantages("gigpo", rows, single), [1 + 0.95, 1, -1 - 0.95, -1])
    close(compute_advantages("gigpo", rows, single), compute_advantages("gigpo", rows)[:4])
    # Over several episodes the single-episode design keeps returns inside their episode.
    c = credit(kuhn_group(), AdvantageConfig(reward_design="single_episode"))
    close(c.step_return, [-5.0, 0.95 * 10, 0.95 * 10, 10.0, 10.0, 3.0])


def grpo_group() -> RowBatch:
    """One group, three meta-episodes: the Kuhn example (Σd = 10), a win at episode 0 (10), and two
    lost episodes (-5, -5: Σd = -5 differential, -10 cumulative). Group 1: one meta-episode."""
    return RowBatch.create(
        group=[0, 0, 0, 0, 0, 0, 0, 0, 4, 4],
        meta_episode=[0, 0, 0, 0, 1, 2, 2, 2, 0, 0],
        episode=[0, 0, 1, 1, 0, 0, 0, 1, 0, 0],
        step=[0, 1, 2, 3, 0, 0, 1, 2, 0, 1],
        is_reflect=[0, 1, 0, 0, 0, 0, 1, 0, 0, 0],
        anchor=[1, 9, 1, 2, 1, 1, 9, 1, 5, 6],
        env_reward=[-5, 0, 0, 10, 10, -5, 0, -5, 1, 1],
    ).pad(HAND)


def broadcast(per_meta):
    a, b, c, d = per_meta
    return [a] * 4 + [b] + [c] * 3 + [d] * 2


def test_grpo_divides_by_the_group_mean_and_std_under_either_norm_setting():
    """GRPO is (score - group mean) / (group std + eps) by definition (docs/method.md §5)."""
    rows = grpo_group()
    std = statistics.stdev([10.0, 10.0, -5.0])
    expected = broadcast([5 / (std + EPS), 5 / (std + EPS), -10 / (std + EPS), 0.0])
    close(compute_advantages("grpo", rows), expected)
    close(compute_advantages("grpo", rows, AdvantageConfig(norm="mean_std_norm")), expected)
    scores = [5.0, 10.0, -10.0]  # cumulative: Σ R_n
    mean, std = sum(scores) / 3, statistics.stdev(scores)
    close(compute_advantages("grpo", rows, AdvantageConfig(reward_design="cumulative")),
          broadcast([(v - mean) / (std + EPS) for v in scores] + [0.0]))


def test_grpo_and_rloo_subtract_penalties_from_the_meta_episode_score():
    rows = grpo_group()
    rows = rows.replace(invalid=rows.invalid.at[7].set(True))  # meta-episode 2 scores -5 - 0.5
    scores = [10.0, 10.0, -5.5]
    mean, std = sum(scores) / 3, statistics.stdev(scores)
    cfg = AdvantageConfig(invalid_penalty=0.5)
    expected = [(v - mean) / (std + EPS) for v in scores] + [0.0]
    close(compute_advantages("grpo", rows, cfg), broadcast(expected))
    close(compute_advantages("rloo", rows, cfg), broadcast([10 - 2.25, 10 - 2.25, -5.5 - 10, 0.0]))
    assert compute_advantages("rloo", rows)[7] == compute_advantages("rloo", grpo_group())[7], \
        "the estimators apply no penalty unless given one"


def test_rloo_uses_the_mean_of_the_other_meta_episodes():
    close(compute_advantages("rloo", grpo_group()), broadcast([10 - 2.5, 10 - 2.5, -5 - 10, 0.0]))


CONFIGS = [
    dict(reward_design=design, norm=norm, anchor=anchor)
    for design, norm, anchor in itertools.product(
        ("differential", "cumulative", "single_episode"), ("mean_norm", "mean_std_norm"), ("global", "local"))
]


def _reference(name, rows, cfg: AdvantageConfig):
    kwargs = dict(design=cfg.reward_design, gamma_step=cfg.gamma_step, gamma_traj=cfg.gamma_traj,
                  invalid_penalty=cfg.invalid_penalty, length_penalty=cfg.length_penalty,
                  max_len=cfg.max_response_length, max_reflection_len=cfg.max_reflection_length)
    if name == "gigpo":
        return ref.gigpo(rows, norm=cfg.norm, anchor=cfg.anchor, omega=cfg.omega, **kwargs)
    if name == "grpo":
        return ref.grpo(rows, **kwargs)
    return ref.rloo(rows, **kwargs)


@pytest.mark.parametrize("name", ["gigpo", "grpo", "rloo"])
def test_estimators_agree_with_the_literal_spec_reading_on_random_batches(name):
    for i, options in enumerate(CONFIGS):
        cfg = AdvantageConfig(**options, omega=0.7, invalid_penalty=0.5, length_penalty=1.0,
                              max_response_length=100, max_reflection_length=60 if i % 2 else None)
        rows = ref.random_rows(100 + i)
        got = np.asarray(compute_advantages(name, ref.to_batch(rows, pad_to=ref.BUCKET), cfg))
        np.testing.assert_allclose(got[: len(rows)], _reference(name, rows, cfg), atol=2e-4, rtol=1e-4,
                                   err_msg=str(options))
        assert np.all(got[len(rows):] == 0)


@pytest.mark.parametrize("name", ["gigpo", "grpo", "rloo"])
def test_padding_rows_and_row_order_change_nothing(name):
    cfg = AdvantageConfig(norm="mean_std_norm", invalid_penalty=1.0, length_penalty=1.0,
                          max_response_length=100)
    rows = ref.random_rows(7)
    n = len(rows)
    junk = ref.random_rows(8)[:25]
    for r in junk:
        r.update(env_reward=-50.0)  # ids collide with real groups and meta-episodes
    order = np.random.default_rng(2).permutation(n + len(junk))
    mixed = ref.to_batch([(rows + junk)[i] for i in order], pad_to=ref.BUCKET)
    real = np.zeros(ref.BUCKET, bool)
    real[: n + len(junk)] = order < n
    mixed = mixed.replace(mask=jax.numpy.asarray(real))
    plain = np.asarray(compute_advantages(name, ref.to_batch(rows, pad_to=ref.BUCKET), cfg))
    got = np.asarray(compute_advantages(name, mixed, cfg))
    np.testing.assert_allclose(got[real], plain[order[order < n]], atol=1e-5)
    assert np.all(got[~real] == 0)


def test_a_pool_of_one_gives_zero_and_no_nan():
    rows = RowBatch.create(group=[3], meta_episode=[0], episode=[0], step=[0], is_reflect=[0], anchor=[0],
                           env_reward=[7.0]).pad(HAND)
    for name in ("gigpo", "grpo", "rloo"):
        for norm in ("mean_norm", "mean_std_norm"):
            close(compute_advantages(name, rows, AdvantageConfig(norm=norm)), [0.0])


def test_a_pool_of_identical_values_gives_exactly_zero():
    """Seven rows of one group and one anchor, reward 3.55 each: the float32 mean lands one ulp off
    3.55 and the std near 1e-7, which divided by std + 1e-6 used to give +0.38, not 0."""
    rows = RowBatch.create(group=[0] * 7, meta_episode=list(range(7)), episode=[0] * 7, step=[0] * 7,
                           is_reflect=[0] * 7, anchor=[1] * 7, env_reward=[3.55] * 7).pad(HAND)
    for name in ("gigpo", "grpo", "rloo"):
        for norm in ("mean_norm", "mean_std_norm"):
            got = np.asarray(compute_advantages(name, rows, AdvantageConfig(norm=norm)))
            assert np.all(got == 0.0), (name, norm, got)


def test_each_estimator_compiles_once_per_batch_size_whatever_the_settings():
    fn = advantage_fn("gigpo")
    before = fn._cache_size()
    for seed, options in zip(range(4), CONFIGS[::3]):
        cfg = AdvantageConfig(**options, omega=0.1 * seed, gamma_traj=0.9)
        rows = ref.to_batch(ref.random_rows(seed), pad_to=ref.BUCKET + 32)
        compute_advantages("gigpo", rows, cfg).block_until_ready()
    assert fn._cache_size() == before + 1


def test_registry_lists_estimators_and_rejects_unknown_or_duplicate_names():
    assert {"gigpo", "grpo", "rloo"} <= set(available_advantages())
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*gigpo"):
        compute_advantages("ppo", kuhn_group())
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("gigpo")(lambda rows, p: rows.env_reward)


def test_a_registered_estimator_is_jitted_and_callable_by_name():
    @register_advantage("score_only_for_test")
    def score_only(rows, p):
        return jax.numpy.where(rows.mask, rows.env_reward * p.omega, 0.0)

    close(compute_advantages("score_only_for_test", kuhn_group(), AdvantageConfig(omega=2.0)),
          [-10, 0, 0, 20, 20, 6])


@pytest.mark.parametrize("bad, message", [
    (dict(norm="z_score"), "norm must be one of"),
    (dict(anchor="episode"), "anchor must be one of"),
    (dict(reward_design="final"), "reward_design must be one of"),
    (dict(gamma_traj=1.5), "gamma_traj must lie in"),
    (dict(invalid_penalty=-1.0), "invalid_penalty must be non-negative"),
    (dict(length_penalty=1.0), "needs a positive max_response_length"),
])
def test_bad_settings_are_one_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        AdvantageConfig(**bad)


def test_an_empty_batch_gives_no_advantages():
    columns = ("group", "meta_episode", "episode", "step", "is_reflect", "anchor", "env_reward")
    rows = RowBatch.create(**dict.fromkeys(columns, []))
    for name in ("gigpo", "rloo"):
        assert compute_advantages(name, rows).shape == (0,)


@pytest.mark.parametrize("estimator", ["gigpo", "grpo", "rloo"])
def test_more_padding_rows_change_no_advantage_of_a_real_row(estimator):
    """The trainer pads the row batch to a power of two (one compile per size, not per rollout)."""
    from mage_jax.algorithms.advantages import AdvantageConfig, compute_advantages
    from mage_jax.rollout.rows import pack_rows
    from tests.rollout.test_rows import sample_rows

    packed = pack_rows(sample_rows(), row_bucket=4, length_buckets=(8,), pad_id=0)
    plain = np.asarray(compute_advantages(estimator, packed.row_batch(), AdvantageConfig()))
    padded = np.asarray(compute_advantages(estimator, packed.row_batch(32), AdvantageConfig()))
    assert padded.shape == (32,) and np.any(plain[:5] != 0)
    np.testing.assert_array_equal(padded[:8], plain)
    assert np.all(padded[8:] == 0)
    with pytest.raises(ValueError, match="below"):
        packed.row_batch(4)

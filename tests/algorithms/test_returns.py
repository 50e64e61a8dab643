"""Meta-rewards d_n, row scores e and step returns G (docs/method.md §4)."""

import jax
import numpy as np
import pytest

from mage_jax.algorithms.returns import (
    RowBatch,
    dense_ids,
    episode_rewards,
    meta_episode_returns,
    meta_rewards,
    row_penalties,
    row_scores,
    step_returns,
)
from tests.algorithms import reference_credit as ref

GS, GT = 0.95, 0.6
HAND = 16  # hand-written cases are padded to one bucket so each kernel compiles once for them


def make(**columns) -> RowBatch:
    return RowBatch.create(**columns).pad(HAND)




def kuhn_example() -> RowBatch:
    """docs/method.md §4: episode 0 loses in one turn (-5), reflect, episode 1 wins in two turns (+10)."""
    return make(
        group=[0, 0, 0, 0], meta_episode=[0, 0, 0, 0], episode=[0, 0, 1, 1], step=[0, 1, 2, 3],
        is_reflect=[False, True, False, False], anchor=[1, 9, 1, 2], env_reward=[-5.0, 0.0, 0.0, 10.0],
    )


def three_episodes() -> RowBatch:
    """R = [-1, 0, 1]: ep0 two turns, reflect, ep1 one turn, reflect, ep2 two turns."""
    return make(
        group=[0] * 7, meta_episode=[0] * 7, episode=[0, 0, 0, 1, 1, 2, 2], step=list(range(7)),
        is_reflect=[False, False, True, False, True, False, False], anchor=[0] * 7,
        env_reward=[0.0, -1.0, 0.0, 0.0, 0.0, 0.0, 1.0],
    )


def close(actual, expected, atol=1e-5):
    """Compare the first rows with hand numbers; the padding rows after them must be 0."""
    actual = np.asarray(actual)
    np.testing.assert_allclose(actual[: len(expected)], expected, atol=atol, rtol=0)
    assert np.all(actual[len(expected):] == 0)


def test_kuhn_worked_example_gives_the_spec_numbers():
    rows = kuhn_example()
    d = meta_rewards(rows)
    close(d, [-5, 0, 15, 15])  # d = [-5, 15]; reflect rows carry none
    close(step_returns(rows, d, gamma_step=GS, gamma_traj=GT), [3.55, 14.25, 14.25, 15])
    close(row_scores(rows), [-5, 0, 15, 15])
    close(episode_rewards(rows), [-5, 0, 10, 10])


def test_differential_design_telescopes_to_the_final_episode():
    rows = three_episodes()
    close(meta_rewards(rows, "differential"), [-1, -1, 0, 1, 0, 1, 1])
    close(meta_episode_returns(rows, "differential"), [1.0] * 7)
    g = step_returns(rows, meta_rewards(rows), gamma_step=GS, gamma_traj=GT)
    ep2_first = GS * 1.0
    ep1 = 1.0 + GT * ep2_first
    ep0_last = -1.0 + GT * ep1
    close(g, [GS * ep0_last, ep0_last, ep1, ep1, ep2_first, ep2_first, 1.0])


def test_cumulative_design_rewards_every_episode_on_its_own():
    rows = three_episodes()
    d = meta_rewards(rows, "cumulative")
    close(d, [-1, -1, 0, 0, 0, 1, 1])
    close(meta_episode_returns(rows, "cumulative"), [0.0] * 7)
    g = step_returns(rows, d, gamma_step=GS, gamma_traj=GT)
    ep1 = 0.0 + GT * GS * 1.0
    ep0_last = -1.0 + GT * ep1
    close(g, [GS * ep0_last, ep0_last, ep1, ep1, GS, GS, 1.0])


def test_single_episode_design_stops_returns_at_episode_boundaries():
    rows = three_episodes()
    d = meta_rewards(rows, "single_episode")
    close(d, [-1, -1, 0, 0, 0, 1, 1])
    close(step_returns(rows, d, gamma_step=GS, gamma_traj=0.0), [-GS, -1, 0, 0, GS, GS, 1])


def test_unknown_reward_design_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown reward design"):
        meta_rewards(kuhn_example(), "final_only")


def test_only_the_last_play_row_of_an_episode_carries_the_reward():
    rows = make(group=[0, 0], meta_episode=[0, 0], episode=[0, 0], step=[0, 1], is_reflect=[0, 0],
                anchor=[0, 1], env_reward=[2.0, 3.0])
    d = meta_rewards(rows)
    close(d, [5, 5])
    close(step_returns(rows, d, gamma_step=GS, gamma_traj=GT), [GS * 5, 5])


def test_penalties_lower_the_score_but_never_the_return():
    # M = 100: lengths 50 (at M/2: no penalty), 75 (half way), 150 (capped at 1).
    columns = dict(
        group=[0] * 4, meta_episode=[0] * 4, episode=[0, 0, 0, 1], step=[0, 1, 2, 3],
        is_reflect=[False, False, True, False], anchor=[0, 1, 2, 0], env_reward=[0.0, 1.0, 0.0, 2.0],
    )
    rows = make(**columns, invalid=[True, False, True, False], response_length=[50, 75, 150, 10])
    clean = make(**columns)
    kwargs = dict(invalid_penalty=0.5, length_penalty=2.0, max_response_length=100)
    close(row_penalties(rows, **kwargs), [0.5, 2.0 * 0.5, 0.5 + 2.0 * 1.0, 0.0])
    close(row_scores(rows, **kwargs), [1 - 0.5, 1 - 1.0, 0 - 2.5, 1.0])
    close(row_penalties(rows, invalid_penalty=0.5), [0.5, 0, 0.5, 0])  # no M: no length term
    g = step_returns(rows, meta_rewards(rows), gamma_step=GS, gamma_traj=GT)
    np.testing.assert_array_equal(g, step_returns(clean, meta_rewards(clean), gamma_step=GS, gamma_traj=GT))
    close(g, [GS * (1 + GT * 1), 1 + GT * 1, 1, 1])


def test_a_reflect_row_is_measured_against_the_reflection_limit_and_a_play_row_against_the_play_limit():
    # Play limit 24, reflection limit 48 (the small-cpu shape): a 40-token reflection is 16 / 24 of the
    # way past M/2 = 24; a 20-token play row is 8 / 12 past its M/2 = 12. A well-formed 24-token
    # reflection pays nothing.
    rows = make(group=[0] * 3, meta_episode=[0] * 3, episode=[0, 0, 1], step=[0, 1, 2],
                is_reflect=[False, True, True], anchor=[0, 1, 1], env_reward=[-5.0, 0.0, 0.0],
                response_length=[20, 40, 24])
    kwargs = dict(length_penalty=2.0, max_response_length=24)
    close(row_penalties(rows, **kwargs, max_reflection_length=48), [2.0 * 8 / 12, 2.0 * 16 / 24, 0.0])
    close(row_penalties(rows, **kwargs), [2.0 * 8 / 12, 2.0, 2.0])  # one limit: every reflection capped
    close(row_scores(rows, **kwargs, max_reflection_length=48), [-5 - 4 / 3, -4 / 3, 0.0])


def test_meta_episode_won_at_episode_zero_has_one_episode_only():
    # Meta-episode 7 won in one turn (episodes 1, 2 never ran); meta-episode 3 is the Kuhn example.
    rows = make(
        group=[5] * 5, meta_episode=[3, 3, 3, 3, 7], episode=[0, 0, 1, 1, 0], step=[0, 1, 2, 3, 0],
        is_reflect=[0, 1, 0, 0, 0], anchor=[1, 9, 1, 2, 1], env_reward=[-5, 0, 0, 10, 10],
    )
    d = meta_rewards(rows)
    close(d, [-5, 0, 15, 15, 10])
    close(step_returns(rows, d, gamma_step=GS, gamma_traj=GT), [3.55, 14.25, 14.25, 15, 10])
    close(meta_episode_returns(rows), [10, 10, 10, 10, 10])


@pytest.mark.parametrize("design", ["differential", "cumulative", "single_episode"])
def test_kernels_agree_with_the_literal_spec_reading_on_random_batches(design):
    for seed in range(6):
        rows = ref.random_rows(seed)
        batch = ref.to_batch(rows, pad_to=ref.BUCKET)
        expect = ref.credit(rows, design=design, invalid_penalty=0.5, length_penalty=1.5, max_len=100,
                            max_reflection_len=60)
        n = len(rows)
        d = np.asarray(meta_rewards(batch, design))
        gamma_traj = 0.0 if design == "single_episode" else GT
        np.testing.assert_allclose(d[:n], expect["d"], atol=1e-5)
        g = np.asarray(step_returns(batch, d, gamma_step=GS, gamma_traj=gamma_traj))
        np.testing.assert_allclose(g[:n], expect["G"], atol=1e-5)
        e = row_scores(batch, design, invalid_penalty=0.5, length_penalty=1.5, max_response_length=100,
                       max_reflection_length=60)
        e = np.asarray(e)
        np.testing.assert_allclose(e[:n], expect["e"], atol=1e-5)
        totals = [expect["meta_total"][(r["group"], r["meta_episode"])] for r in rows]
        np.testing.assert_allclose(np.asarray(meta_episode_returns(batch, design))[:n], totals, atol=1e-5)


def _all_outputs(batch):
    d = meta_rewards(batch)
    return np.stack([
        d, episode_rewards(batch), meta_episode_returns(batch), step_returns(batch, d),
        row_scores(batch, invalid_penalty=0.5, length_penalty=1.0, max_response_length=100),
    ])


def test_padding_rows_with_arbitrary_contents_change_nothing():
    rows = ref.random_rows(11)
    n = len(rows)
    junk = ref.random_rows(12)[:20]  # real-looking rows that collide with real ids, then masked out
    for r in junk:
        r.update(group=1000, meta_episode=50, env_reward=99.0)
    order = np.random.default_rng(1).permutation(n + len(junk))  # padding interleaved with real rows
    mixed = ref.to_batch([(rows + junk)[i] for i in order], pad_to=ref.BUCKET)
    real = np.zeros(ref.BUCKET, bool)
    real[: n + len(junk)] = order < n
    mixed = mixed.replace(mask=jax.numpy.asarray(real))
    out_mixed = _all_outputs(mixed)
    out = _all_outputs(ref.to_batch(rows, pad_to=ref.BUCKET))
    np.testing.assert_allclose(out_mixed[:, real], out[:, order[order < n]], atol=1e-6)
    assert np.all(out_mixed[:, ~real] == 0)


def test_permuting_rows_only_permutes_the_results():
    batch = ref.to_batch(ref.random_rows(21), pad_to=ref.BUCKET)
    perm = np.random.default_rng(0).permutation(batch.num_rows)
    permuted = jax.tree.map(lambda a: jax.numpy.asarray(np.asarray(a)[perm]), batch)
    np.testing.assert_allclose(_all_outputs(permuted), _all_outputs(batch)[:, perm], atol=1e-6)


def test_dense_ids_number_distinct_key_tuples_among_valid_rows():
    group = np.array([9, 9, -4, 9, 7, 3])
    anchor = np.array([5, 1, 5, 5, 0, 2])
    mask = np.array([True, True, True, True, True, False])
    ids = np.asarray(jax.jit(lambda g, a, m: dense_ids(g, a, mask=m))(group, anchor, mask))
    # sorted key tuples: (-4,5) (7,0) (9,1) (9,5); the padding row gets R
    np.testing.assert_array_equal(ids, [3, 2, 0, 3, 1, 6])


def test_row_batch_rejects_malformed_columns_with_one_message():
    with pytest.raises(ValueError, match="equal length"):
        RowBatch.create(group=[0, 0], meta_episode=[0], episode=[0, 0], step=[0, 1], is_reflect=[0, 0],
                        anchor=[0, 0], env_reward=[0, 0])
    with pytest.raises(ValueError, match="integers"):
        RowBatch.create(group=[0.5], meta_episode=[0], episode=[0], step=[0], is_reflect=[0], anchor=[0],
                        env_reward=[0])
    with pytest.raises(ValueError, match="mask"):
        RowBatch.create(group=[0], meta_episode=[0], episode=[0], step=[0], is_reflect=[0], anchor=[0],
                        env_reward=[0], mask=[True, False])
    with pytest.raises(ValueError, match="cannot pad"):
        kuhn_example().pad(2)


def test_step_returns_compile_once_per_batch_size():
    traces = []

    @jax.jit
    def kernel(rows):
        traces.append(1)
        return step_returns(rows, meta_rewards(rows))

    for seed in (1, 2, 3):
        kernel(ref.to_batch(ref.random_rows(seed), pad_to=ref.BUCKET)).block_until_ready()
    assert len(traces) == 1
    assert kernel._cache_size() == 1

"""Packing rows into fixed-shape arrays: layout, masks, ids, mini-batches (no duplicated rows)."""

import numpy as np
import pytest

from mage_jax.generate.constraints import TokenAutomaton
from mage_jax.rollout.rows import Row, length_grouped_minibatches, minibatch_indices, pack_rows

PAD = 0


def make_row(
    prompt,
    response,
    *,
    group=0,
    meta_episode=0,
    episode=0,
    step=0,
    phase="play",
    anchor="s",
    reward=0.0,
    valid=True,
    constraint=None,
):
    return Row(
        prompt_ids=np.asarray(prompt, np.int32),
        response_ids=np.asarray(response, np.int32),
        logprobs=-np.arange(1, len(response) + 1, dtype=np.float32) / 10,
        group=group,
        meta_episode=meta_episode,
        episode=episode,
        turn=0,
        step=step,
        phase=phase,
        anchor=anchor,
        opponent=None,
        env_reward=reward,
        valid=valid,
        constraint=constraint,
    )


def sample_rows():
    return [
        make_row([5, 6, 7], [8, 9], group=3, meta_episode=30, anchor="a", reward=1.0),
        make_row([5, 6], [10, 11, 12], group=3, meta_episode=31, anchor="a", step=0),
        make_row([5], [13], group=3, meta_episode=31, anchor="b", step=1, phase="reflect", valid=False),
        make_row([7, 7, 7, 7], [14], group=9, meta_episode=90, anchor="a"),
        make_row([], [], group=9, meta_episode=90, step=1, anchor="c", valid=False),  # an overflow row
    ]


def test_shapes_come_from_the_buckets_and_padding_rows_are_masked_not_copied():
    batch = pack_rows(sample_rows(), row_bucket=4, length_buckets=(4, 8, 16), pad_id=PAD)
    assert batch.shape == (8, 8) and batch.num_rows == 5
    assert batch.mask.tolist() == [True] * 5 + [False] * 3
    assert not batch.token_mask[5:].any() and not batch.response_mask[5:].any()
    assert (batch.tokens[5:] == PAD).all() and (batch.response_length[5:] == 0).all()
    assert (batch.sampling_logprobs[5:] == 0).all()


def test_tokens_are_right_padded_and_targets_responses_and_logprobs_are_shifted_by_one():
    rows = sample_rows()
    batch = pack_rows(rows, row_bucket=4, length_buckets=(8,), pad_id=PAD)
    for r, row in enumerate(rows):
        p, n = row.prompt_length, row.response_length
        seq = list(row.prompt_ids) + list(row.response_ids)
        assert batch.tokens[r, : p + n].tolist() == seq and (batch.tokens[r, p + n :] == PAD).all()
        assert batch.token_mask[r].sum() == p + n
        assert batch.positions[r, : p + n].tolist() == list(range(p + n))
        assert batch.response_mask[r].sum() == n
        # target t is token t + 1; the response mask selects exactly the response tokens as targets
        assert batch.targets[r, : max(p + n - 1, 0)].tolist() == seq[1:]
        assert batch.targets[r][batch.response_mask[r]].tolist() == list(row.response_ids)
        np.testing.assert_allclose(batch.sampling_logprobs[r][batch.response_mask[r]], row.logprobs)
    assert batch.prompt_lengths[:5].tolist() == [3, 2, 1, 4, 0]


def test_groups_meta_episodes_and_anchors_get_dense_batch_ids():
    batch = pack_rows(sample_rows(), row_bucket=4, length_buckets=(8,), pad_id=PAD)
    assert batch.group[:5].tolist() == [0, 0, 0, 1, 1] and batch.group_keys == [3, 9]
    assert batch.meta_episode[:5].tolist() == [0, 1, 1, 2, 2] and batch.meta_episode_keys == [30, 31, 90]
    # equal anchor strings share an id inside a group, never across groups
    assert batch.anchor[:5].tolist() == [0, 0, 1, 2, 3]
    assert batch.anchor_names == ["a", "b", "a", "c"]
    assert batch.is_reflect[:5].tolist() == [False, False, True, False, False]
    assert batch.invalid[:5].tolist() == [False, False, True, False, True]
    assert batch.env_reward[:5].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    # padding rows live in their own (masked) group, meta-episode and anchor
    assert set(batch.group[5:]) == {2} and set(batch.anchor[5:]) == {4}


def test_the_row_batch_feeds_the_algorithms():
    from mage_jax.algorithms.advantages import AdvantageConfig, compute_advantages

    batch = pack_rows(sample_rows(), row_bucket=4, length_buckets=(8,), pad_id=PAD)
    rows = batch.row_batch()
    assert rows.num_rows == 8 and np.asarray(rows.mask).sum() == 5
    advantages = np.asarray(compute_advantages("gigpo", rows, AdvantageConfig()))
    assert advantages.shape == (8,) and np.all(advantages[5:] == 0)


def test_a_row_longer_than_every_bucket_is_one_clear_error():
    with pytest.raises(ValueError, match="length bucket"):
        pack_rows(sample_rows(), row_bucket=4, length_buckets=(4,), pad_id=PAD)
    bad = make_row([1], [2, 3])
    bad = Row(**{**bad.__dict__, "logprobs": np.zeros(1, np.float32)})
    with pytest.raises(ValueError, match="log-probs"):
        pack_rows([bad], row_bucket=1, length_buckets=(8,), pad_id=PAD)


def test_minibatch_indices_cover_every_row_once_and_pad_the_last_block():
    indices = minibatch_indices(10, 4, permutation=np.random.default_rng(0).permutation(10))
    assert [len(i) for i in indices] == [4, 4, 4]
    flat = np.concatenate(indices)
    assert sorted(flat[flat >= 0].tolist()) == list(range(10)) and indices[-1][2:].tolist() == [-1, -1]
    assert [i.tolist() for i in minibatch_indices(10, 4)][-1] == [8, 9, -1, -1]
    with pytest.raises(ValueError, match="permutation"):
        minibatch_indices(3, 2, permutation=np.array([0, 0, 1]))


def test_length_grouped_minibatches_cover_every_row_once_with_similar_lengths():
    lengths = np.array([100, 300, 120, 310, 90, 305, 110, 295, 330])
    blocks = length_grouped_minibatches(lengths, 4, np.random.default_rng(0), buckets=(128, 320, 512))
    flat = np.concatenate(blocks)
    assert sorted(flat[flat >= 0].tolist()) == list(range(len(lengths)))
    assert all(len(b) == 4 for b in blocks)
    assert sorted(set((lengths[b[b >= 0]] > 128).tolist()) == {False, True} for b in blocks).count(True) <= 1


def test_constraints_are_stored_once_per_automaton_and_replayed_per_row():
    automaton = TokenAutomaton(np.array([[1, -1, -1, -1], [-1, 2, -1, -1], [-1, -1, -1, -1]], np.int32))
    rows = [
        make_row([3], [0, 1], constraint=automaton),
        make_row([3], [2]),
        make_row([3], [0, 1], constraint=automaton),
    ]
    batch = pack_rows(rows, row_bucket=4, length_buckets=(4,), pad_id=PAD)
    assert batch.constraint_table.shape == (1, 3, 4)
    assert batch.constraint_id.tolist() == [0, -1, 0, -1]
    transitions = batch.row_transitions()
    assert transitions.shape == (4, 3, 4)
    np.testing.assert_array_equal(transitions[0], automaton.transitions)
    assert (transitions[1] >= 0).all()  # a free row allows every token
    assert pack_rows(rows[1:2], row_bucket=4, length_buckets=(4,), pad_id=PAD).row_transitions() is None

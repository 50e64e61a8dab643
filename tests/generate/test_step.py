"""Specification of mage_jax.generate.step: how a token is chosen (greedy, temperature, top-k / top-p,
the inverse-CDF draw), which log-prob comes back, and the per-token step every generation program runs
(mask, choose, automaton, end of sequence, done rows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mage_jax.generate.constraints import automaton_from_completions, stack_automata
from mage_jax.generate.step import (
    GREEDY,
    KEY_PATH_LEN,
    PLAIN,
    SORTED,
    TOP_K,
    TOP_K_CAP,
    Sampling,
    SamplingParams,
    choose_tokens,
    row_keys,
    sample_categorical,
    token_step,
)

VOCAB, EOS, PAD = 16, 3, 0


def test_sampling_params_are_validated():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    assert SamplingParams(temperature=0.0).is_greedy


# --------------------------------------------------------------------------------- token choice
CHOOSE = jax.jit(choose_tokens)  # one program: every setting below is a runtime value


def sampling(vocab=VOCAB, **kw) -> Sampling:
    return Sampling.of(SamplingParams(**kw), vocab)


def test_top_k_and_top_p_draw_only_from_the_kept_tokens():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 512))
    keys = jax.random.key(0)

    def draw(top_k, top_p):
        tokens, logp = CHOOSE(logits, None, keys, sampling(4, top_k=top_k, top_p=top_p))
        return set(np.asarray(tokens).tolist()), np.asarray(logp)

    drawn, logp = draw(2, 1.0)
    assert drawn == {0, 1}
    np.testing.assert_allclose(np.exp(logp), np.where(logp > -1.0, 0.5, 0.3), rtol=1e-5)  # untruncated p
    assert draw(0, 0.75)[0] == {0, 1}  # 0.5 + 0.3 reaches 0.75
    assert draw(0, 0.5)[0] == {0}
    assert draw(3, 0.9)[0] == {0, 1, 2}
    assert draw(3, 0.7)[0] == {0, 1}  # top-p over the top-k set
    assert draw(1, 1.0)[0] == {0}
    assert draw(0, 1.0)[0] == {0, 1, 2, 3}


def test_every_setting_is_a_runtime_value_of_one_program_and_changes_the_draw():
    """Temperature, top-k, top-p and greedy are arguments: one compile serves them all, and each changes
    the distribution (a program that ignored one would fail here)."""
    rng = np.random.default_rng(0)
    vocab = 3 * TOP_K_CAP  # top-k above the cap takes the sorted path
    row = rng.normal(size=vocab).astype(np.float32)
    logits = jnp.asarray(np.tile(row, (4000, 1)))
    order = np.argsort(-row, kind="stable")
    choose = jax.jit(lambda *args: choose_tokens(*args))  # its own cache of compiled programs

    def freq(**kw):
        tokens = np.asarray(choose(logits, None, jax.random.key(1), sampling(vocab, **kw))[0])
        return np.bincount(tokens, minlength=vocab) / len(tokens)

    def softmax(x):
        e = np.exp(x - x.max())
        return e / e.sum()

    np.testing.assert_allclose(freq(), softmax(row), atol=0.02)
    np.testing.assert_allclose(freq(temperature=0.5), softmax(row / 0.5), atol=0.02)
    for k in (5, TOP_K_CAP + 10):  # below the cap (lax.top_k) and above it (a sort)
        f = freq(top_k=k)
        assert set(np.flatnonzero(f)) <= set(order[:k].tolist())
        expected = np.zeros(vocab)
        expected[order[:k]] = softmax(row[order[:k]])
        np.testing.assert_allclose(f, expected, atol=0.02)
    p = softmax(row)[order]
    nucleus = int(np.searchsorted(np.cumsum(p), 0.6) + 1)  # the smallest prefix holding 0.6
    assert set(np.flatnonzero(freq(top_p=0.6))) <= set(order[:nucleus].tolist())
    assert freq(greedy=True)[order[0]] == 1.0 and freq(temperature=0.0)[order[0]] == 1.0
    assert choose._cache_size() == 1


def test_the_sampling_mode_is_chosen_on_the_host():
    assert int(sampling(temperature=0.0, top_k=50).mode) == GREEDY
    assert int(sampling(greedy=True).mode) == GREEDY and float(sampling(greedy=True).temperature) == 1.0
    assert int(sampling(temperature=0.7).mode) == PLAIN
    assert int(sampling(top_k=5, top_p=0.8).mode) == TOP_K
    assert int(sampling(top_p=0.8).mode) == SORTED
    assert int(sampling(vocab=1000, top_k=TOP_K_CAP + 1).mode) == SORTED
    assert int(sampling(vocab=8, top_k=50).top_k) == 8  # capped at the vocabulary: all tokens
    assert int(sampling(vocab=8, top_k=50).mode) == TOP_K


def test_inverse_cdf_sampling_draws_from_the_softmax_and_never_a_masked_token():
    probs = np.asarray([0.1, 0.0, 0.25, 0.05, 0.0, 0.6, 0.0])  # blocks of 3: the middle block is partly empty
    logits = jnp.log(jnp.asarray(np.tile(probs, (40000, 1)), jnp.float32))
    tokens = np.asarray(
        jax.jit(sample_categorical, static_argnames="block")(jax.random.key(3), logits, block=3)
    )
    freq = np.bincount(tokens, minlength=len(probs)) / len(tokens)
    assert set(np.flatnonzero(freq)) == set(np.flatnonzero(probs))
    np.testing.assert_allclose(freq, probs, atol=0.01)


def test_greedy_is_the_argmax_of_the_allowed_tokens():
    logits = jnp.asarray([[0.0, 5.0, 1.0, 2.0]])
    allowed = jnp.asarray([[True, False, True, True]])
    token, logp = choose_tokens(logits, allowed, jax.random.key(0), sampling(4, greedy=True))
    assert int(token[0]) == 3
    np.testing.assert_allclose(
        float(logp[0]), float(jax.nn.log_softmax(jnp.asarray([0.0, 1.0, 2.0]))[2]), rtol=1e-6
    )


# ------------------------------------------------------------------------------------ the token step
GREEDY_PARAMS = SamplingParams(greedy=True)


def step(logits, table, auto, key, done, *, params=GREEDY_PARAMS):
    return token_step(jnp.asarray(logits, jnp.float32), table, jnp.asarray(auto, jnp.int32), key,
                      jnp.asarray(done), Sampling.of(params, VOCAB), eos_ids=jnp.asarray([EOS], jnp.int32),
                      pad_id=PAD)


def test_the_step_masks_with_the_automaton_state_and_advances_it():
    auto = automaton_from_completions([[5, 6], [7]], VOCAB, EOS)
    table = jnp.asarray(stack_automata([auto, auto, None], VOCAB))
    logits = np.zeros((3, VOCAB), np.float32)
    logits[:, 9] = 10.0  # the favourite is illegal for the constrained rows
    logits[:, 7] = 5.0
    drawn = step(logits, table, [0, 0, 0], jax.random.key(0), [False, False, False])
    assert drawn.token.tolist() == [7, 7, 9]  # constrained: the best legal token; free: the argmax
    after_7 = int(auto.transitions[0, 7])
    assert drawn.auto.tolist()[:2] == [after_7, after_7]
    legal = jax.nn.log_softmax(jnp.asarray(logits[0, [5, 7]]))  # the log-prob among the legal tokens
    np.testing.assert_allclose(drawn.logp[0], legal[1], rtol=1e-6)
    # From the state after 7 only EOS is legal: the step detects the end of the sequence.
    drawn = step(logits, table, [after_7, after_7, 0], jax.random.key(0), [False, False, False])
    assert drawn.token.tolist()[:2] == [EOS, EOS] and drawn.eos.tolist() == [True, True, False]


def test_done_rows_draw_padding_with_log_prob_zero_and_keep_their_state():
    auto = automaton_from_completions([[5, 6]], VOCAB, EOS)
    table = jnp.asarray(stack_automata([auto, auto], VOCAB))
    logits = np.zeros((2, VOCAB), np.float32)
    logits[:, EOS] = 100.0  # EOS is illegal in state 0; a done row must not report it either
    drawn = step(logits, table, [0, 2], jax.random.key(0), [False, True])
    assert drawn.token.tolist() == [5, PAD] and float(drawn.logp[1]) == 0.0
    assert drawn.auto.tolist() == [int(auto.transitions[0, 5]), 2] and not drawn.eos.any()
    free = step(np.eye(2, VOCAB, EOS) * 9, None, [0, 0], jax.random.key(0), [False, True])
    assert free.token.tolist() == [EOS, PAD] and free.eos.tolist() == [True, False]


def test_one_key_per_row_draws_each_row_as_if_it_were_alone():
    """The engine's rows: row i drawn with key i equals the row drawn alone with that key, whatever the
    other rows are (a response does not depend on its company)."""
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, VOCAB)), jnp.float32)
    keys = row_keys(jax.random.key(7), jnp.asarray([[1, 2, 3], [4, 5, 6], [1, 2, 3], [9, 9, 9]]),
                    jnp.asarray([0, 0, 1, 0]))
    sampled = SamplingParams(top_k=6, top_p=0.9)
    together = step(logits, None, [0] * 4, keys, [False] * 4, params=sampled)
    for i in range(4):
        alone = step(logits[i:i + 1], None, [0], keys[i:i + 1], [False], params=sampled)
        assert int(alone.token[0]) == int(together.token[i])
    # Same key path, other token index: another key.
    assert not np.array_equal(jax.random.key_data(keys[0]), jax.random.key_data(keys[2]))
    draws = {int(step(logits[:1], None, [0], keys[j:j + 1], [False], params=sampled).token[0])
             for j in range(4)}
    assert len(draws) > 1  # the keys differ, and so do the draws


def test_row_keys_differ_when_key_paths_differ_in_any_one_component_or_the_token_index():
    """A row's key is its key path folded into the run's key, component by component, then its token index:
    changing any single component (meta-episode, episode, phase/turn) or the index gives another key, so
    the turns of one episode never share random draws; the same path and index give the same key."""
    key = jax.random.key(3)
    base = np.asarray([5, 1, 2], np.int32)
    assert len(base) == KEY_PATH_LEN
    paths = [base]
    for position in range(KEY_PATH_LEN):
        changed = base.copy()
        changed[position] += 1
        paths.append(changed)
    keys = row_keys(key, jnp.asarray(np.stack([*paths, base])), jnp.asarray([4] * (len(paths) + 1)))
    data = [tuple(np.asarray(jax.random.key_data(k)).tolist()) for k in keys]
    assert len(set(data[:-1])) == len(paths), data  # each one-component change: another key
    assert data[-1] == data[0]  # the same path and index: the same key
    later = row_keys(key, jnp.asarray(base[None]), jnp.asarray([5]))
    assert tuple(np.asarray(jax.random.key_data(later[0])).tolist()) != data[0]

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
    Choice,
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
def test_top_k_and_top_p_draw_only_from_the_kept_tokens():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 512))
    keys = jax.random.key(0)
    one = jnp.float32(1.0)

    choose = jax.jit(choose_tokens, static_argnames=("greedy", "top_k", "use_top_p"))

    def draw(top_k, top_p, use_top_p):
        tokens, logp = choose(
            logits, None, keys, one, jnp.float32(top_p), greedy=False, top_k=top_k, use_top_p=use_top_p
        )
        return set(np.asarray(tokens).tolist()), np.asarray(logp)

    drawn, logp = draw(2, 1.0, False)
    assert drawn == {0, 1}
    np.testing.assert_allclose(np.exp(logp), np.where(logp > -1.0, 0.5, 0.3), rtol=1e-5)  # untruncated p
    assert draw(0, 0.75, True)[0] == {0, 1}  # 0.5 + 0.3 reaches 0.75
    assert draw(0, 0.5, True)[0] == {0}
    assert draw(3, 0.9, True)[0] == {0, 1, 2}
    assert draw(0, 1.0, False)[0] == {0, 1, 2, 3}


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
    token, logp = choose_tokens(
        logits,
        allowed,
        jax.random.key(0),
        jnp.float32(1),
        jnp.float32(1),
        greedy=True,
        top_k=0,
        use_top_p=False,
    )
    assert int(token[0]) == 3
    np.testing.assert_allclose(
        float(logp[0]), float(jax.nn.log_softmax(jnp.asarray([0.0, 1.0, 2.0]))[2]), rtol=1e-6
    )


# ------------------------------------------------------------------------------------ the token step
GREEDY = Choice(True, 0, False)


def step(logits, table, auto, key, done, *, choice=GREEDY, temperature=1.0):
    return token_step(jnp.asarray(logits, jnp.float32), table, jnp.asarray(auto, jnp.int32), key,
                      jnp.asarray(done), jnp.float32(temperature), jnp.float32(1.0), choice=choice,
                      eos_ids=jnp.asarray([EOS], jnp.int32), pad_id=PAD)


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
    sampled = Choice(False, 0, False)
    together = step(logits, None, [0] * 4, keys, [False] * 4, choice=sampled)
    for i in range(4):
        alone = step(logits[i:i + 1], None, [0], keys[i:i + 1], [False], choice=sampled)
        assert int(alone.token[0]) == int(together.token[i])
    # Same key path, other token index: another key.
    assert not np.array_equal(jax.random.key_data(keys[0]), jax.random.key_data(keys[2]))
    draws = {int(step(logits[:1], None, [0], keys[j:j + 1], [False], choice=sampled).token[0])
             for j in range(4)}
    assert len(draws) > 1  # the keys differ, and so do the draws


def test_the_compile_time_choice_of_sampling_params():
    assert Choice.of(SamplingParams(temperature=0.0, top_k=50), vocab_size=16) == Choice(True, 16, False)
    assert Choice.of(SamplingParams(temperature=0.7, top_p=0.8), vocab_size=16) == Choice(False, 0, True)

"""Specification of mage_jax.constraints: the trie automaton of legal completions and its replay."""

from __future__ import annotations

import numpy as np
import pytest

from mage_jax.constraints import automaton_from_completions, constraint_masks, stack_automata

EOS, PAD = 3, 0


def test_trie_automaton_accepts_exactly_the_completions_followed_by_eos():
    a = automaton_from_completions([[10, 11], [12], [10, 11, 13]], vocab_size=16, eos_id=EOS)
    t = a.transitions

    def run(seq):
        state = 0
        for tok in seq:
            state = t[state, tok]
            if state < 0:
                return False
        return True

    for ok in ([10, 11, EOS], [12, EOS], [10, 11, 13, EOS]):
        assert run(ok)
    for bad in ([10, EOS], [11], [12, 12], [EOS], [10, 11, 13, 13]):
        assert not run(bad)
    assert a.accepting([EOS]).sum() == 3 and t.shape == (6, 16)
    assert (t[-1] == -1).all()  # nothing may follow EOS


def test_trie_automaton_rejects_bad_completions():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        automaton_from_completions([[99]], vocab_size=16, eos_id=EOS)
    with pytest.raises(ValueError, match="contains the EOS"):
        automaton_from_completions([[EOS, 5]], vocab_size=16, eos_id=EOS)
    with pytest.raises(ValueError, match="at least one"):
        automaton_from_completions([], vocab_size=16, eos_id=EOS)


def test_constraint_masks_replay_the_automaton_by_hand():
    a = automaton_from_completions([[4, 5], [6]], vocab_size=8, eos_id=EOS)
    transitions = stack_automata([a, None], vocab_size=8, num_states=8)
    tokens = np.asarray([[4, 5, EOS, PAD], [1, 2, 7, 7]], np.int32)
    masks = np.asarray(constraint_masks(transitions, tokens))
    assert masks.shape == (2, 4, 8)
    assert np.flatnonzero(masks[0, 0]).tolist() == [4, 6]
    assert np.flatnonzero(masks[0, 1]).tolist() == [5]
    assert np.flatnonzero(masks[0, 2]).tolist() == [EOS]
    assert masks[0, 3].all()  # after EOS: unconstrained (masked out by the response mask)
    assert masks[1].all()  # an unconstrained row

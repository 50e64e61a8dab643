"""Specification of mage_jax.generate.constraints: the trie automaton of legal completions and its replay."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mage_jax.generate.constraints import (
    WordSequence,
    automaton_from_completions,
    automaton_from_word_sequence,
    constraint_masks,
    stack_automata,
)

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


def _accepts(automaton, seq):
    state = 0
    for tok in seq:
        state = automaton.transitions[state, tok]
        if state < 0:
            return False
    return True


@pytest.mark.parametrize("open_ids, close_ids", [([4], [5]), ([4, 6], [5, 7])])
def test_word_sequence_automaton_accepts_what_the_trie_of_every_sequence_accepts(open_ids, close_ids):
    """Oracle: the trie of all open + 1..2 words + close completions, on every token string over a
    vocabulary of 10 (words 8, 9, 1; EOS 3). A string on which they differ has a shortest such prefix,
    and both accept every prefix before it: the search extends exactly the prefixes both accept."""
    words, vocab = [8, 9, 1], 10
    compact = automaton_from_word_sequence(open_ids, words, close_ids, 2, vocab, EOS)
    completions = [[*open_ids, *body, *close_ids]
                   for m in (1, 2) for body in itertools.product(words, repeat=m)]
    trie = automaton_from_completions(completions, vocab, EOS)
    assert compact.num_states < trie.num_states
    frontier, accepted = [()], 0
    while frontier:
        prefix = frontier.pop()
        for tok in range(vocab):
            seq = (*prefix, tok)
            ok = _accepts(compact, seq)
            assert ok == _accepts(trie, seq), seq
            if ok:
                frontier.append(seq)
                accepted += tok == EOS
    assert accepted == len(completions) == 12
    # The replay gives the same masks along every accepted response.
    stacked = stack_automata([compact, trie], vocab)
    for body in ([8], [9, 1]):
        tokens = np.asarray([[*open_ids, *body, *close_ids, EOS]] * 2, np.int32)
        masks = np.asarray(constraint_masks(stacked, tokens))
        np.testing.assert_array_equal(masks[0], masks[1])


def test_word_sequence_automaton_rejects_bad_tokens():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        automaton_from_word_sequence([4], [8, 99], [5], 2, 10, EOS)
    with pytest.raises(ValueError, match="EOS"):
        automaton_from_word_sequence([4], [8, EOS], [5], 2, 10, EOS)
    with pytest.raises(ValueError, match="also a word"):
        automaton_from_word_sequence([4], [8, 5], [5], 2, 10, EOS)
    with pytest.raises(ValueError, match="at least one word"):
        automaton_from_word_sequence([4], [], [5], 2, 10, EOS)


def test_word_sequence_texts_accept_sample_and_first():
    ws = WordSequence(("bets", "King", "weak"), max_words=2)
    assert ws.first() == "<remark>bets</remark>"
    assert ws.accepts("<remark>King weak</remark>") and ws.accepts("<remark>bets</remark>")
    for bad in ("<remark></remark>", "<remark>bets bets bets</remark>", "<remark>Queen</remark>",
                "<remark>bets  King</remark>", "bets King", "<action>bets</action>"):
        assert not ws.accepts(bad), bad
    rng = np.random.default_rng(0)
    drawn = {ws.sample(rng) for _ in range(300)}
    assert all(ws.accepts(t) for t in drawn) and len(drawn) == 3 + 9  # every sequence of 1 or 2 words
    with pytest.raises(ValueError, match="distinct"):
        WordSequence(("a", "a"))
    with pytest.raises(ValueError, match="non-empty"):
        WordSequence(())
    with pytest.raises(ValueError, match="max_words"):
        WordSequence(("a",), max_words=0)

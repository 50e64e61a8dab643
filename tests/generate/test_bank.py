"""Specification of mage_jax.generate.bank: the factorised automata on the device give the dense tables'
masks and transitions, and an insert's constraint bytes do not grow with the vocabulary."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from mage_jax.generate.bank import ConstraintBank, bank_rows, factorise
from mage_jax.generate.constraints import (
    TokenAutomaton,
    allowed_tokens,
    automaton_from_completions,
    automaton_from_word_sequence,
    constraint_masks,
    stack_automata,
)

VOCAB, EOS = 40, 3


def random_automaton(rng: np.random.Generator, states: int, vocab: int = VOCAB) -> TokenAutomaton:
    """Random transitions: most tokens share a column (a default), some have their own, some states
    allow nothing, and the default itself is sometimes allowed."""
    default = rng.integers(-1, states, size=states)
    table = np.repeat(default[:, None], vocab, axis=1)
    special = rng.choice(vocab, size=int(rng.integers(0, vocab)), replace=False)
    table[:, special] = rng.integers(-1, states, size=(states, special.size))
    return TokenAutomaton(table)


def test_factorising_keeps_every_transition():
    rng = np.random.default_rng(0)
    for automaton in [random_automaton(rng, int(rng.integers(1, 9))) for _ in range(20)] + [
        TokenAutomaton.accept_all(VOCAB), automaton_from_completions([[5, 6], [7]], VOCAB, EOS)
    ]:
        f = factorise(automaton)
        rebuilt = np.repeat(f.default[:, None], VOCAB, axis=1)
        rebuilt[:, f.tokens] = f.table
        np.testing.assert_array_equal(rebuilt, automaton.transitions)
    trie = factorise(automaton_from_completions([[5, 6], [7]], VOCAB, EOS))
    assert sorted(trie.tokens.tolist()) == [EOS, 5, 6, 7] and (trie.default == -1).all()


def test_bank_rows_equal_the_dense_tables_in_every_state():
    """The masks and next states of every automaton in every state, read from the bank, equal the dense
    ``allowed_tokens``; so the train step's ``constraint_masks`` replay (dense, from the rows) describes
    the distribution the engine drew from."""
    rng = np.random.default_rng(1)
    automata = [random_automaton(rng, int(rng.integers(1, 12))) for _ in range(12)]
    automata += [None, automaton_from_word_sequence([10], list(range(20, 30)), [11], 3, VOCAB, [EOS])]
    bank = ConstraintBank(VOCAB)
    rules = np.asarray([bank.index(a) for a in automata], np.int32)
    device = bank.device()
    states = max(a.num_states for a in automata if a is not None)
    dense = jnp.asarray(stack_automata(automata, VOCAB, num_states=device.num_states))
    for q in range(-1, states):
        state = jnp.full(len(automata), q, jnp.int32)
        want_allowed, want_next = allowed_tokens(dense, state)
        got_allowed, got_next = bank_rows(device, jnp.asarray(rules), state)
        np.testing.assert_array_equal(got_allowed, want_allowed)
        np.testing.assert_array_equal(got_next, want_next)
    # The same automaton again, as the same object or a new one of equal content (a policy is built per
    # rollout): the same index, nothing uploaded again, the bank does not grow.
    sent, count = bank.uploaded_bytes, bank.num_automata
    assert bank.index(automata[0]) == rules[0]
    assert bank.index(TokenAutomaton(automata[0].transitions.copy())) == rules[0]
    assert bank.index(TokenAutomaton.accept_all(VOCAB)) == 0
    assert bank.device() is device and bank.uploaded_bytes == sent and bank.num_automata == count


def test_replaying_tokens_through_the_bank_gives_the_train_steps_masks():
    rng = np.random.default_rng(2)
    automata = [random_automaton(rng, 6) for _ in range(5)] + [None]
    bank = ConstraintBank(VOCAB)
    rules = jnp.asarray([bank.index(a) for a in automata], jnp.int32)
    device = bank.device()
    tokens = jnp.asarray(rng.integers(0, VOCAB, size=(len(automata), 7)), jnp.int32)
    state = jnp.zeros(len(automata), jnp.int32)
    masks = []
    for t in range(tokens.shape[1]):
        allowed, nxt = bank_rows(device, rules, state)
        masks.append(allowed)
        state = jnp.where(state >= 0, jnp.take_along_axis(nxt, tokens[:, t:t + 1], axis=1)[:, 0], -1)
    dense = stack_automata(automata, VOCAB)
    np.testing.assert_array_equal(jnp.stack(masks, axis=1), constraint_masks(dense, tokens))


def test_legal_action_automata_at_qwens_vocabulary_take_kilobytes_on_the_device_not_megabytes():
    vocab = 151_936
    bank = ConstraintBank(vocab)
    actions = [[1000 + i, 2000 + i, 3000] for i in range(8)]
    automata = [automaton_from_completions(actions[:n], vocab, 151_643) for n in range(1, 9)]
    for a in automata:
        bank.index(a)
    columns, tables = bank.host_arrays()
    dense = sum(a.transitions.nbytes for a in automata)
    assert dense > 70e6 and tables.nbytes <= 256 * 1024  # every automaton of the run, sent once
    assert columns.nbytes == vocab * 4  # the token -> column map, sent once per run (and when it grows)
    device = bank.device()
    assert device.columns.shape == (vocab,) and bank.uploaded_bytes == columns.nbytes + tables.nbytes


def test_a_new_automaton_is_uploaded_with_the_columns_it_adds_and_an_old_one_uploads_nothing():
    """The device bank follows the host's: after an automaton with tokens no earlier one treats specially
    arrives, the next ``device()`` holds its table row and the grown token -> column map (read directly,
    not through an environment's rollout); a known automaton sends nothing again."""
    bank = ConstraintBank(VOCAB)
    first = automaton_from_completions([[5, 6], [7]], VOCAB, EOS)
    bank.index(first)
    before = bank.device()
    sent = bank.uploaded_bytes
    second = automaton_from_completions([[20, 21, 22]], VOCAB, EOS)  # new tokens: new columns
    rule = bank.index(second)
    after = bank.device()
    columns, tables = bank.host_arrays()
    np.testing.assert_array_equal(np.asarray(after.columns), columns)
    np.testing.assert_array_equal(np.asarray(after.tables), tables)
    assert not np.array_equal(np.asarray(before.columns), columns)  # the map grew, and was sent again
    assert bank.uploaded_bytes == sent + columns.nbytes + tables.nbytes
    allowed, _ = bank_rows(after, jnp.asarray([rule]), jnp.zeros(1, jnp.int32))
    assert np.flatnonzero(np.asarray(allowed[0])).tolist() == [20]  # the new automaton's first token
    bank.index(automaton_from_completions([[5, 6], [7]], VOCAB, EOS))  # known content
    assert bank.device() is after and bank.uploaded_bytes == sent + columns.nbytes + tables.nbytes

"""Token automata: the legal-action constraint shared by the sampler and the train step.

A ``TokenAutomaton`` is a table ``transitions[S, V]`` (next state, or -1 when the token is disallowed)
with start state 0; EOS is allowed exactly in accepting states. ``automaton_from_completions`` builds
the trie that accepts exactly a list of token sequences followed by EOS ("the response is one of these
legal action strings", docs/method.md §3's constrained actions).

The token step of the sampler and the slot programs (``generate.step.token_step``) masks each draw with
``allowed_tokens`` of the row's current state;
the train step replays the automaton over the sampled tokens with ``constraint_masks``, so the
recomputed log-probs describe the same constrained distribution the tokens were drawn from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class TokenAutomaton:
    """A deterministic automaton over token ids: ``transitions[s, v]`` is the next state or -1 (disallowed).

    The start state is 0. A state is accepting when an EOS id is allowed from it.
    """

    transitions: np.ndarray  # int32[S, V]

    def __post_init__(self) -> None:
        t = np.asarray(self.transitions)
        if t.ndim != 2 or t.shape[0] < 1:
            raise ValueError(f"transitions must be int32[S, V] with S >= 1, got shape {t.shape}")
        if t.min(initial=-1) < -1 or t.max(initial=-1) >= t.shape[0]:
            raise ValueError("transitions must hold -1 or a state index in [0, S)")
        object.__setattr__(self, "transitions", t.astype(np.int32))

    @property
    def num_states(self) -> int:
        return self.transitions.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.transitions.shape[1]

    def accepting(self, eos_ids: Sequence[int]) -> np.ndarray:
        """bool[S]: states where generation may end (some EOS id is allowed)."""
        return (self.transitions[:, list(eos_ids)] >= 0).any(axis=1)

    @classmethod
    def accept_all(cls, vocab_size: int) -> TokenAutomaton:
        """One state that allows every token: an unconstrained row inside a constrained batch."""
        return cls(np.zeros((1, vocab_size), np.int32))


def automaton_from_completions(
    token_sequences: Sequence[Sequence[int]], vocab_size: int, eos_id: int | Sequence[int]
) -> TokenAutomaton:
    """The trie automaton that accepts exactly ``token_sequences`` each followed by one EOS id.

    State 0 is the root; the last state is the absorbing "after EOS" state, from which nothing is
    allowed. A sequence that is a prefix of another makes its end state both accepting and continuing.
    """
    eos = [eos_id] if isinstance(eos_id, (int, np.integer)) else list(eos_id)
    if not token_sequences:
        raise ValueError("automaton_from_completions needs at least one allowed completion")
    for tid in [*eos, *(t for seq in token_sequences for t in seq)]:
        if not 0 <= int(tid) < vocab_size:
            raise ValueError(f"token id {int(tid)} is outside the vocabulary [0, {vocab_size})")
    children: list[dict[int, int]] = [{}]
    accepting = [False]
    for seq in token_sequences:
        state = 0
        for tid in seq:
            tid = int(tid)
            if tid in eos:
                raise ValueError(f"completion {list(seq)} contains the EOS id {tid} before its end")
            nxt = children[state].get(tid)
            if nxt is None:
                nxt = len(children)
                children[state][tid] = nxt
                children.append({})
                accepting.append(False)
            state = nxt
        accepting[state] = True
    done = len(children)
    table = np.full((done + 1, vocab_size), -1, np.int32)
    for state, kids in enumerate(children):
        for tid, nxt in kids.items():
            table[state, tid] = nxt
        if accepting[state]:
            table[state, eos] = done
    return TokenAutomaton(table)


@dataclasses.dataclass(frozen=True)
class WordSequence:
    """Responses ``open_tag w_1 ... w_m close_tag`` with 1 <= m <= ``max_words`` and every w_i in ``words``.

    Words are joined by single spaces (``"<remark>bets King</remark>"``); ``sample`` draws the length
    and each word uniformly (a random policy's reflection, the tokenizer corpus).
    """

    words: tuple[str, ...]
    max_words: int = 3
    open_tag: str = "<remark>"
    close_tag: str = "</remark>"

    def __post_init__(self) -> None:
        if not self.words or len(set(self.words)) != len(self.words):
            raise ValueError(f"words must be a non-empty list of distinct words, got {list(self.words)}")
        if not isinstance(self.max_words, int) or self.max_words < 1:
            raise ValueError(f"max_words must be a positive integer, got {self.max_words!r}")

    def text(self, words: Sequence[str]) -> str:
        return f"{self.open_tag}{' '.join(words)}{self.close_tag}"

    def accepts(self, text: str) -> bool:
        """Whether ``text`` is exactly one allowed response (single spaces between the words)."""
        if not (text.startswith(self.open_tag) and text.endswith(self.close_tag)):
            return False
        body = text[len(self.open_tag): len(text) - len(self.close_tag)]
        parts = body.split(" ")
        return 1 <= len(parts) <= self.max_words and all(p in self.words for p in parts)

    def first(self) -> str:
        """The response of one word, the first of the list."""
        return self.text(self.words[:1])

    def sample(self, rng: np.random.Generator) -> str:
        count = int(rng.integers(1, self.max_words + 1))
        return self.text([self.words[int(i)] for i in rng.integers(len(self.words), size=count)])


def automaton_from_word_sequence(
    open_ids: Sequence[int], word_ids: Sequence[int], close_ids: Sequence[int], max_words: int,
    vocab_size: int, eos_id: int | Sequence[int],
) -> TokenAutomaton:
    """The automaton of ``open_ids``, 1..``max_words`` single tokens of ``word_ids``, ``close_ids``, EOS.

    States: the open tag's tokens, then "k words read" for k = 0..max_words (any word id leads from k to
    k + 1 below the limit; the close tag may start from k >= 1), the close tag's tokens, an accepting
    state and the absorbing "after EOS" state. It accepts exactly the token sequences of the trie
    ``automaton_from_completions`` would build from every word sequence.
    """
    eos = [eos_id] if isinstance(eos_id, (int, np.integer)) else list(eos_id)
    if not word_ids or not open_ids or not close_ids:
        raise ValueError("a word sequence needs an open tag, a close tag and at least one word")
    if max_words < 1:
        raise ValueError(f"max_words must be >= 1, got {max_words}")
    ids = [int(t) for t in (*open_ids, *word_ids, *close_ids)]
    for tid in [*eos, *ids]:
        if not 0 <= int(tid) < vocab_size:
            raise ValueError(f"token id {int(tid)} is outside the vocabulary [0, {vocab_size})")
    if set(ids) & set(int(e) for e in eos):
        raise ValueError("a word sequence's tokens must not contain an EOS id")
    words = sorted({int(w) for w in word_ids})
    if int(close_ids[0]) in words:
        raise ValueError(f"the close tag's first token {int(close_ids[0])} is also a word")
    n_open, n_close = len(open_ids), len(close_ids)
    counted = n_open  # state of "0 words read"; counted + k: k words read
    closing = counted + max_words + 1  # state after the close tag's first token
    accept = closing + n_close - 1
    done = accept + 1
    table = np.full((done + 1, vocab_size), -1, np.int32)
    for i, tid in enumerate(open_ids):
        table[i, int(tid)] = i + 1
    for k in range(max_words + 1):
        if k < max_words:
            table[counted + k, words] = counted + k + 1
        if k >= 1:
            table[counted + k, int(close_ids[0])] = closing
    for i, tid in enumerate(close_ids[1:]):
        table[closing + i, int(tid)] = closing + i + 1
    table[accept, eos] = done
    return TokenAutomaton(table)


def stack_automata(
    automata: Sequence[TokenAutomaton | None], vocab_size: int, num_states: int | None = None
) -> np.ndarray:
    """Per-row automata -> int32[B, S, V], states padded with disallow-all rows; None = unconstrained."""
    filled = [TokenAutomaton.accept_all(vocab_size) if a is None else a for a in automata]
    for a in filled:
        if a.vocab_size != vocab_size:
            raise ValueError(f"automaton vocabulary {a.vocab_size} != model vocabulary {vocab_size}")
    states = max(a.num_states for a in filled) if num_states is None else num_states
    out = np.full((len(filled), states, vocab_size), -1, np.int32)
    for row, a in enumerate(filled):
        if a.num_states > states:
            raise ValueError(f"automaton with {a.num_states} states does not fit {states} states")
        out[row, : a.num_states] = a.transitions
    return out


def allowed_tokens(transitions: jax.Array, state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(allowed bool[B,V], next-state table int32[B,V]) of each row's current state.

    A row in no state (-1: it left the automaton, e.g. padding after EOS) or in a state that allows
    nothing gets an all-True mask, so log-softmax stays finite; those positions are never sampled.
    """
    rows = jnp.arange(transitions.shape[0])
    nxt = transitions[rows, jnp.maximum(state, 0)]
    allowed = (nxt >= 0) & (state >= 0)[:, None]
    allowed = jnp.where(allowed.any(axis=-1, keepdims=True), allowed, True)
    return allowed, nxt


@jax.jit
def constraint_masks(transitions: jax.Array, tokens: jax.Array) -> jax.Array:
    """Replay each row's automaton over its tokens: allowed[b, t] is the mask used to draw tokens[b, t].

    transitions int32[B,S,V], tokens int32[B,T] -> bool[B,T,V]. Positions after the end of a response
    (after EOS, padding) get all-True masks; the trainer masks them out with the response mask.
    """
    transitions = jnp.asarray(transitions, jnp.int32)
    tokens = jnp.asarray(tokens, jnp.int32)
    vocab = transitions.shape[-1]

    def step(state, token):
        allowed, nxt = allowed_tokens(transitions, state)
        in_vocab = (token >= 0) & (token < vocab)
        new_state = jnp.take_along_axis(nxt, jnp.clip(token, 0, vocab - 1)[:, None], axis=1)[:, 0]
        return jnp.where(in_vocab & (state >= 0), new_state, -1), allowed

    start = jnp.zeros(tokens.shape[:1], jnp.int32)
    _, masks = jax.lax.scan(step, start, tokens.T)
    return masks.transpose(1, 0, 2)

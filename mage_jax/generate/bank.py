"""The engine's token automata on the device, factorised over a compact *action vocabulary*.

A ``constraints.TokenAutomaton`` is a table ``transitions[Q, V]`` at full vocabulary width (39 MB per state
at Qwen's 151,936 tokens). Almost every column of it is the same: a legal-action trie disallows every token
outside its actions in every state, the accept-all automaton allows every token. So the engine keeps

* one token -> column map ``columns int32[V]`` for the whole run: column 0 stands for "every token no
  automaton treats specially", column c >= 1 for one token that some automaton does;
* one table ``tables int32[A, Q, C]`` (automaton, state, column) for every automaton the run has used,
  row 0 being the accept-all automaton of unconstrained requests;

both uploaded once and again only when a new automaton arrives (``ConstraintBank.device``); an insert then
sends one automaton index per request. The transition of token v in state q of automaton a is
``tables[a, q, columns[v]]``: exactly the dense table's (``factorise`` keeps, per automaton, its most
common column as the default of column 0 and every token that differs from it as a column of its own).

Shapes grow in powers of two from small minimums, so the engine programs compile again only when a run's
automata outgrow them.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mage_jax.generate.constraints import TokenAutomaton
from mage_jax.generate.shapes import pow2

MIN_AUTOMATA, MIN_STATES, MIN_COLUMNS = 8, 8, 64


@dataclasses.dataclass(frozen=True)
class Factored:
    """A ``TokenAutomaton`` as ``default[Q]`` (the transition of every token not in ``tokens``) and
    ``table[Q, K]`` (the transitions of the K ``tokens`` that differ from it)."""

    default: np.ndarray
    tokens: np.ndarray
    table: np.ndarray

    @property
    def num_states(self) -> int:
        return self.default.shape[0]


def factorise(automaton: TokenAutomaton) -> Factored:
    """The automaton's most common column as the default, and the tokens whose column differs from it.

    One pass over the table: columns are hashed (a random projection), the most frequent hash names a
    candidate default, and the exact comparison with it decides which tokens are special, so a hash
    collision costs columns, never correctness."""
    t = automaton.transitions
    weights = np.random.default_rng(0).integers(1, 2**31, size=t.shape[0], dtype=np.int64)
    hashes = weights @ (t.astype(np.int64) + 1)
    values, first, counts = np.unique(hashes, return_index=True, return_counts=True)
    default = t[:, first[np.argmax(counts)]].copy()
    tokens = np.flatnonzero((t != default[:, None]).any(axis=0)).astype(np.int32)
    return Factored(default, tokens, t[:, tokens].copy())


def _content(f: Factored) -> bytes:
    """A key equal for automata with equal transitions (their factorisations are equal)."""
    return b"|".join(np.ascontiguousarray(a).astype(np.int32).tobytes() + str(a.shape).encode()
                     for a in (f.default, f.tokens, f.table))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Bank:
    """The device arrays: ``columns int32[V]`` (token -> column) and ``tables int32[A, Q, C]``."""

    columns: Any
    tables: Any

    @property
    def num_states(self) -> int:
        return self.tables.shape[1]


def bank_rows(bank: Bank, rule: jax.Array, state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(allowed bool[B,V], next-state int32[B,V]) of each row's automaton ``rule`` [B] in ``state`` [B]:
    ``constraints.allowed_tokens`` of the dense tables, from the factorised ones."""
    row = bank.tables[rule, jnp.maximum(state, 0)]  # [B, C]
    nxt = jnp.take(row, bank.columns, axis=1)  # [B, V]
    allowed = (nxt >= 0) & (state >= 0)[:, None]
    allowed = jnp.where(allowed.any(axis=-1, keepdims=True), allowed, True)
    return allowed, nxt


class ConstraintBank:
    """The automata of a run, by index, and their device copy (see the module docstring). Index 0 is the
    accept-all automaton (``index(None)``)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self._token_column: dict[int, int] = {}
        self._factored: list[Factored] = [factorise(TokenAutomaton.accept_all(self.vocab_size))]
        self._by_content: dict[bytes, int] = {_content(self._factored[0]): 0}
        # Automata seen, by id while they live (a policy is built per rollout with new automaton objects
        # of the same content: the content key maps them to the same index).
        self._by_id: dict[int, tuple[weakref.ref, int]] = {}
        self._device: Bank | None = None
        self._device_columns: Any = None
        self._columns_sent = -1  # the column count of the uploaded map
        self.uploaded_bytes = 0
        """Bytes sent to the device for the map and the tables so far (their uploads)."""

    def index(self, automaton: TokenAutomaton | None) -> int:
        """The bank index of ``automaton`` (added when new; None: the accept-all automaton, 0)."""
        if automaton is None:
            return 0
        seen = self._by_id.get(id(automaton))
        if seen is not None and seen[0]() is automaton:
            return seen[1]
        if automaton.vocab_size != self.vocab_size:
            raise ValueError(f"automaton vocabulary {automaton.vocab_size} != model vocabulary "
                             f"{self.vocab_size}")
        factored = factorise(automaton)
        key = _content(factored)
        index = self._by_content.get(key)
        if index is None:
            for token in factored.tokens.tolist():
                self._token_column.setdefault(token, len(self._token_column) + 1)
            self._factored.append(factored)
            index = self._by_content[key] = len(self._factored) - 1
            self._device = None
        ident = id(automaton)
        self._by_id[ident] = (weakref.ref(automaton, lambda _: self._by_id.pop(ident, None)), index)
        return index

    @property
    def num_automata(self) -> int:
        """Distinct automata in the bank (the accept-all one included)."""
        return len(self._factored)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(A, Q, C) of the tables: counts rounded up to powers of two from the minimums."""
        states = max(f.num_states for f in self._factored)
        return (max(MIN_AUTOMATA, pow2(len(self._factored))), max(MIN_STATES, pow2(states)),
                max(MIN_COLUMNS, pow2(len(self._token_column) + 1)))

    def host_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(columns int32[V], tables int32[A, Q, C]) on the host; unused rows and states disallow all."""
        a, q, c = self.shape
        columns = np.zeros(self.vocab_size, np.int32)
        if self._token_column:
            tokens = np.fromiter(self._token_column, np.int64)
            columns[tokens] = np.fromiter(self._token_column.values(), np.int32)
        tables = np.full((a, q, c), -1, np.int32)
        for table, f in zip(tables, self._factored):
            table[: f.num_states, :] = f.default[:, None]
            table[: f.num_states, columns[f.tokens]] = f.table
        return columns, tables

    def device(self, sharding: Any = None) -> Bank:
        """The bank on the device (``sharding``: replicated over a mesh), uploaded again only after it grew;
        the map only when its columns changed."""
        if self._device is None:
            columns, tables = self.host_arrays()
            put = (lambda x: jax.device_put(x, sharding)) if sharding is not None else jnp.asarray
            if self._columns_sent != len(self._token_column):
                self._device_columns = put(columns)
                self._columns_sent = len(self._token_column)
                self.uploaded_bytes += columns.nbytes
            self.uploaded_bytes += tables.nbytes
            self._device = Bank(self._device_columns, put(tables))
        return self._device

"""Row records and their packing into fixed-shape arrays for the jitted train step.

A *row* is one LLM call (a play turn or a reflection, docs/method.md §1). The runner emits one ``Row``
per call; ``pack_rows`` turns a list of rows into

* token arrays ``[R, T]`` in a small set of shapes (R a multiple of ``row_bucket``, T the smallest
  length bucket that fits), and
* the per-row ``RowBatch`` the pure-JAX algorithms compute returns and advantages from.

Padding rows exist only to reach the bucketed shape: they have ``mask = False``, no tokens in any
mask, and are never copies of real rows (copies would bias the group means; docs/method.md §11).

Token layout (right padding): row ``r`` holds ``prompt + response`` from position 0, then ``pad_id``.
Per-target arrays are shifted by one: index ``t`` describes the prediction of token ``t + 1`` from the
prefix ``0..t`` — ``targets[r, t] = tokens[r, t + 1]``, ``response_mask[r, t]`` is True when that
target is a response token, and ``sampling_logprobs[r, t]`` is the sampler's log-probability of it.
So ``logits(model(tokens))[r, t]`` scores ``targets[r, t]`` directly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from mage_jax.algorithms.returns import RowBatch

PHASES = ("play", "reflect")


@dataclasses.dataclass(frozen=True, eq=False)
class Row:
    """One LLM call as the trainer and the evaluation see it (docs/method.md §2, item 5).

    ``turn`` is the play turn inside the episode (0-based; reflect rows: 0); ``step`` is the time
    order of the row inside its meta-episode (0, 1, 2, ... over play and reflect rows). ``valid`` is
    False for an invalid / illegal action, a missing ``<remark>``, or a prompt that could not be
    shortened below the token limit (``overflow``). ``constraint`` is the decoding automaton of a
    constrained row (None when free). ``prompt_text`` / ``response_text`` are kept only when the
    runner is asked to (debugging, notebooks).
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    group: int
    meta_episode: int
    episode: int
    turn: int
    step: int
    phase: str
    anchor: str
    opponent: str | None
    env_reward: float
    valid: bool
    truncated: bool = False
    overflow: bool = False
    seat: int | None = None
    constraint: Any | None = None
    prompt_text: str | None = None
    response_text: str | None = None

    @property
    def response_length(self) -> int:
        return int(len(self.response_ids))

    @property
    def prompt_length(self) -> int:
        return int(len(self.prompt_ids))

    @property
    def is_reflect(self) -> bool:
        return self.phase == "reflect"



def _dense_ids(values: Sequence[Any]) -> tuple[np.ndarray, list[Any]]:
    """Map values to 0..n-1 in order of first appearance; returns (ids, the distinct values)."""
    table: dict[Any, int] = {}
    ids = np.empty(len(values), dtype=np.int32)
    for i, v in enumerate(values):
        ids[i] = table.setdefault(v, len(table))
    return ids, list(table)


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


@dataclasses.dataclass
class PackedBatch:
    """Fixed-shape arrays of R rows (real rows first, then masked padding rows).

    Token arrays are ``[R, T]``; per-row arrays ``[R]``. ``anchor_names[i]`` / ``group_keys[i]`` /
    ``meta_episode_keys[i]`` give the original anchor string / group / meta-episode of id ``i``.
    Constraints are stored once per distinct automaton: ``constraint_table[K, S, V]`` (int32, -1 = token
    not allowed, padded states all -1) and ``constraint_id[R]`` (-1 = free row); None when no row of
    the batch is constrained.
    """

    tokens: np.ndarray
    positions: np.ndarray
    token_mask: np.ndarray
    targets: np.ndarray
    response_mask: np.ndarray
    sampling_logprobs: np.ndarray
    prompt_lengths: np.ndarray
    response_lengths: np.ndarray
    # per-row fields of the algorithms' RowBatch (contract names)
    group: np.ndarray
    meta_episode: np.ndarray
    episode: np.ndarray
    step: np.ndarray
    is_reflect: np.ndarray
    anchor: np.ndarray
    env_reward: np.ndarray
    invalid: np.ndarray
    response_length: np.ndarray
    mask: np.ndarray
    # bookkeeping
    num_rows: int
    anchor_names: list[str]
    group_keys: list[Any]
    meta_episode_keys: list[Any]
    pad_id: int = 0
    constraint_id: np.ndarray | None = None
    constraint_table: np.ndarray | None = None

    TOKEN_FIELDS = ("tokens", "positions", "token_mask", "targets", "response_mask", "sampling_logprobs")
    ROW_BATCH_FIELDS = (
        "group",
        "meta_episode",
        "episode",
        "step",
        "is_reflect",
        "anchor",
        "env_reward",
        "invalid",
        "response_length",
        "mask",
    )
    ROW_FIELDS = ("prompt_lengths", "response_lengths", *ROW_BATCH_FIELDS)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)  # type: ignore[return-value]

    def row_batch_arrays(self) -> dict[str, np.ndarray]:
        """The per-row arrays under the algorithms' ``RowBatch`` field names."""
        return {name: getattr(self, name) for name in self.ROW_BATCH_FIELDS}

    def row_batch(self, num_rows: int | None = None) -> RowBatch:
        """The algorithms' ``RowBatch`` (a pytree of [R] arrays) for returns and advantages.

        ``num_rows`` >= R pads it with more masked rows: a few sizes (powers of two) instead of one per
        rollout keep the jitted estimators from compiling again for every new row count."""
        arrays = self.row_batch_arrays()
        extra = 0 if num_rows is None else num_rows - len(self.mask)
        if extra < 0:
            raise ValueError(f"num_rows={num_rows} is below the batch's {len(self.mask)} rows")
        if extra:
            arrays = {k: np.concatenate([v, np.zeros(extra, v.dtype)]) for k, v in arrays.items()}
        return RowBatch.create(**arrays)

    def row_transitions(self, rows: slice | np.ndarray | None = None) -> np.ndarray | None:
        """Per-row transitions ``[r, S, V]`` for ``constraint_masks`` (free rows get an accept-all
        single-state automaton: every token leads back to state 0). None when nothing is constrained."""
        if self.constraint_table is None or self.constraint_id is None:
            return None
        ids = self.constraint_id if rows is None else self.constraint_id[rows]
        free = np.zeros(self.constraint_table.shape[1:], dtype=np.int32)
        table = np.concatenate([self.constraint_table, free[None]], axis=0)
        return table[np.where(ids < 0, len(table) - 1, ids)]


def minibatch_indices(num_rows: int, size: int, *, permutation: np.ndarray | None = None) -> list[np.ndarray]:
    """Row indices of each mini-batch of ``size`` rows; ``-1`` marks padding in the last one."""
    if not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"mini-batch size must be a positive integer, got {size!r}")
    order = np.arange(num_rows) if permutation is None else np.asarray(permutation, dtype=np.int64)
    if sorted(order.tolist()) != list(range(num_rows)):
        raise ValueError("permutation must be a permutation of range(num_rows)")
    count = max(1, -(-num_rows // size))
    padded = np.full(count * size, -1, dtype=np.int64)
    padded[:num_rows] = order
    return [padded[i * size : (i + 1) * size] for i in range(count)]


def length_grouped_minibatches(
    lengths: np.ndarray, size: int, rng: np.random.Generator, buckets: Sequence[int]
) -> list[np.ndarray]:
    """Mini-batches of ``size`` rows from the same length bucket, in random order (``-1`` pads the last).

    Rows are shuffled, stably sorted by their length *bucket* (not by exact length: rows of equal
    length are often copies of one situation, and mini-batches of near-identical rows make the
    updates oscillate) and cut into consecutive blocks, so most mini-batches need only their own
    bucket. The order of the blocks is random; every row is used exactly once per epoch.
    """
    lengths = np.asarray(lengths)
    n = len(lengths)
    bucket_of = np.searchsorted(np.asarray(sorted(buckets)), lengths, side="left")
    order = rng.permutation(n)
    order = order[np.argsort(bucket_of[order], kind="stable")]
    count = max(1, -(-n // size))
    padded = np.full(count * size, -1, dtype=np.int64)
    padded[:n] = order
    blocks = [padded[i * size:(i + 1) * size] for i in range(count)]
    return [blocks[i] for i in rng.permutation(count)]


def pick_bucket(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``length``; a clear error when none does."""
    fitting = [b for b in sorted(buckets) if b >= length]
    if not fitting:
        raise ValueError(
            f"a row of {length} tokens (prompt + response) does not fit the largest length bucket "
            f"{max(buckets)}; raise the length buckets or lower max prompt / response tokens"
        )
    return fitting[0]


def pack_rows(
    rows: Sequence[Row],
    *,
    row_bucket: int,
    length_buckets: Sequence[int],
    pad_id: int,
) -> PackedBatch:
    """Pack rows into right-padded ``[R, T]`` arrays; see the module docstring for the layout.

    ``R`` is ``len(rows)`` rounded up to a multiple of ``row_bucket`` (at least one bucket), ``T`` the
    smallest of ``length_buckets`` that holds the longest row. Anchors, groups and meta-episodes are
    given dense integer ids (0..n-1, in order of first appearance) for this batch.
    """
    if not isinstance(row_bucket, (int, np.integer)) or row_bucket < 1:
        raise ValueError(f"row_bucket must be a positive integer, got {row_bucket!r}")
    if not length_buckets or any(int(b) < 1 for b in length_buckets):
        raise ValueError(f"length_buckets must be positive integers, got {list(length_buckets)!r}")
    n = len(rows)
    for row in rows:
        if row.phase not in PHASES:
            raise ValueError(f"row phase must be one of {PHASES}, got {row.phase!r}")
        if len(row.logprobs) != len(row.response_ids):
            raise ValueError(
                f"row of meta-episode {row.meta_episode} has {len(row.response_ids)} response tokens "
                f"but {len(row.logprobs)} log-probs"
            )
    longest = max((r.prompt_length + r.response_length for r in rows), default=1)
    T = pick_bucket(max(longest, 1), [int(b) for b in length_buckets])
    R = _round_up(n, int(row_bucket))

    tokens = np.full((R, T), pad_id, dtype=np.int32)
    positions = np.zeros((R, T), dtype=np.int32)
    token_mask = np.zeros((R, T), dtype=bool)
    targets = np.full((R, T), pad_id, dtype=np.int32)
    response_mask = np.zeros((R, T), dtype=bool)
    sampling_logprobs = np.zeros((R, T), dtype=np.float32)
    prompt_lengths = np.zeros(R, dtype=np.int32)
    response_lengths = np.zeros(R, dtype=np.int32)

    for r, row in enumerate(rows):
        p, length = row.prompt_length, row.response_length
        total = p + length
        seq = np.concatenate(
            [np.asarray(row.prompt_ids, dtype=np.int32), np.asarray(row.response_ids, dtype=np.int32)]
        )
        tokens[r, :total] = seq
        positions[r, :total] = np.arange(total, dtype=np.int32)
        token_mask[r, :total] = True
        if total > 1:
            targets[r, : total - 1] = seq[1:]
        # Target t is response token (t + 1 - p); the first response token is predicted at t = p - 1.
        first = max(p - 1, 0)
        skipped = first - (p - 1)  # 1 when there is no prompt token to predict the first response token
        if length - skipped > 0:
            response_mask[r, first : p - 1 + length] = True
            sampling_logprobs[r, first : p - 1 + length] = np.asarray(row.logprobs, dtype=np.float32)[
                skipped:
            ]
        prompt_lengths[r] = p
        response_lengths[r] = length

    def per_row(values: list, dtype, fill) -> np.ndarray:
        out = np.full(R, fill, dtype=dtype)
        out[:n] = np.asarray(values, dtype=dtype) if n else out[:0]
        return out

    anchor_ids, anchor_names = _dense_ids([(row.group, row.anchor) for row in rows])
    # Anchor ids are unique per (group, anchor string): equal strings in different groups never pool.
    group_ids, group_keys = _dense_ids([row.group for row in rows])
    me_ids, me_keys = _dense_ids([row.meta_episode for row in rows])

    constraint_id = None
    constraint_table = None
    automata = [row.constraint for row in rows]
    if any(a is not None for a in automata):
        table_ids: dict[int, int] = {}
        tables: list[np.ndarray] = []
        cid = np.full(R, -1, dtype=np.int32)
        for r, a in enumerate(automata):
            if a is None:
                continue
            if id(a) not in table_ids:
                table_ids[id(a)] = len(tables)
                tables.append(np.asarray(getattr(a, "transitions", a), dtype=np.int32))
            cid[r] = table_ids[id(a)]
        S = max(t.shape[0] for t in tables)
        V = tables[0].shape[1]
        if any(t.shape[1] != V for t in tables):
            raise ValueError("constraint automata of one batch must share the vocabulary size")
        constraint_table = np.full((len(tables), S, V), -1, dtype=np.int32)
        for k, t in enumerate(tables):
            constraint_table[k, : t.shape[0]] = t
        constraint_id = cid

    return PackedBatch(
        tokens=tokens,
        positions=positions,
        token_mask=token_mask,
        targets=targets,
        response_mask=response_mask,
        sampling_logprobs=sampling_logprobs,
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
        group=per_row(group_ids, np.int32, len(group_keys)),
        meta_episode=per_row(me_ids, np.int32, len(me_keys)),
        episode=per_row([row.episode for row in rows], np.int32, 0),
        step=per_row([row.step for row in rows], np.int32, 0),
        is_reflect=per_row([row.is_reflect for row in rows], bool, False),
        anchor=per_row(anchor_ids, np.int32, len(anchor_names)),
        env_reward=per_row([row.env_reward for row in rows], np.float32, 0.0),
        invalid=per_row([not row.valid for row in rows], bool, False),
        response_length=per_row(response_lengths[:n], np.int32, 0),
        mask=per_row([True] * n, bool, False),
        num_rows=n,
        anchor_names=[a for _, a in anchor_names],
        group_keys=group_keys,
        meta_episode_keys=me_keys,
        pad_id=int(pad_id),
        constraint_id=constraint_id,
        constraint_table=constraint_table,
    )

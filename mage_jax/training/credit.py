"""The credit phase of an iteration: the rollout's rows packed, one advantage per row, and the train
step's mini-batches cut from them (docs/method.md §4-5).

Pure in the rows and the config: the trainer's later phases (log-prob recompute, update epochs) read
the ``Credited`` rows through ``Credited.batch``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from mage_jax import config as C
from mage_jax.algorithms.advantages import compute_advantages
from mage_jax.rollout.rows import PackedBatch, Row, pack_rows, pick_bucket
from mage_jax.training.assemble import advantage_config
from mage_jax.training.train_step import TOKEN_FIELDS, TrainBatch

ADVANTAGE_ROWS = 512
"""The smallest row count the advantage estimator runs at (padding rows are masked): one compile per
power of two from there, and a run whose row count wanders (the main job: 256 to 512) compiles it once."""


@dataclasses.dataclass(frozen=True)
class Credited:
    """An iteration's rows packed, their advantages, every real row's tokens (prompt + response) and the
    token length buckets of the train step."""

    packed: PackedBatch
    advantages: np.ndarray
    row_lengths: np.ndarray
    length_buckets: tuple[int, ...]

    def batch(self, idx: np.ndarray, *, with_advantages: bool, merged: Merged | None = None) -> TrainBatch:
        """Rows ``idx`` (-1: padding) cut to the token length bucket the longest of them needs; with
        ``merged`` (``merge_identical``) each row carries its merged advantage and weight."""
        real = idx[idx >= 0]
        longest = max(int(self.row_lengths[real].max()) if len(real) else 1, 1)
        advantages = self.advantages if merged is None else merged.advantages
        batch = TrainBatch.from_packed(self.packed, idx, length=pick_bucket(longest, self.length_buckets),
                                       advantages=advantages if with_advantages else None,
                                       constrained=self.packed.constraint_table is not None)
        if merged is None:
            return batch
        return batch.replace(row_weights=np.where(idx >= 0, merged.weights[np.maximum(idx, 0)], 0.0)
                             .astype(np.float32))

    def identical_rows(self) -> np.ndarray:
        """int[n]: for each real row the first row whose model input and scored tokens are the same (its
        own index when none comes before it). Log-probs are a function of those alone, so the recompute
        scores one row of each set and copies: copies of a group that played alike produce identical rows
        (the same deal, history and decision), many of them once the policy is confident."""
        packed, n = self.packed, self.packed.num_rows
        ids = None if packed.constraint_id is None else packed.constraint_id[:n]
        first: dict[bytes, int] = {}
        out = np.empty(n, np.int64)
        for i in range(n):
            cut = int(self.row_lengths[i])
            key = b"".join(np.ascontiguousarray(getattr(packed, name)[i, :cut]).tobytes()
                           for name in TOKEN_FIELDS)
            key += np.int64(packed.prompt_lengths[i]).tobytes() + np.int64(cut).tobytes()
            if ids is not None:
                key += np.int64(ids[i]).tobytes()
            out[i] = first.setdefault(key, i)
        return out


@dataclasses.dataclass(frozen=True)
class Merged:
    """A mini-batch with its identical rows merged (``merge_identical``)."""

    index: np.ndarray
    """int[R]: the rows the update runs (one of each merged set, its first), then ``-1`` padding."""
    advantages: np.ndarray
    """float32[N], by row: the mean advantage of the set a kept row stands for."""
    weights: np.ndarray
    """float32[N], by row: how many rows a kept row stands for."""


def merge_identical(index: np.ndarray, same: np.ndarray, advantages: np.ndarray) -> Merged:
    """The rows ``index`` of one mini-batch (``-1``: padding) with each set of identical rows (``same``:
    ``Credited.identical_rows``) whose advantages have one sign (positive, negative or zero) run as one
    row of their mean advantage weighted by their count. Exact: identical rows have one log-prob, the
    PPO term is positively homogeneous in the advantage (``losses.ppo_loss``) and every term and
    denominator counts a row by its weight, so the update is the unmerged one's while the model runs
    over fewer rows (copies of a group that played alike, many once the policy is confident)."""
    index = np.asarray(index, np.int64)
    n = len(advantages)
    sums, counts = np.zeros(n, np.float64), np.zeros(n, np.float64)
    kept: dict[tuple[int, int], int] = {}
    for row in index[index >= 0]:
        first = kept.setdefault((int(same[row]), int(np.sign(advantages[row]))), int(row))
        sums[first] += advantages[row]
        counts[first] += 1
    rows = np.fromiter(kept.values(), np.int64, len(kept))  # each set's first row, in mini-batch order
    out = np.full(len(index), -1, np.int64)
    out[:len(rows)] = rows
    mean = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)
    return Merged(out, mean.astype(np.float32), counts.astype(np.float32))


def credit(cfg: C.ExperimentConfig, rows: Sequence[Row], *, length_buckets: tuple[int, ...],
           pad_id: int) -> Credited:
    """``rows`` packed in mini-batch blocks with one advantage each (``algorithm.estimator``)."""
    packed = pack_rows(rows, row_bucket=cfg.optim.mini_batch_rows, length_buckets=length_buckets,
                       pad_id=pad_id)
    n = packed.num_rows
    if n and int(packed.response_lengths[:n].max()) > cfg.rollout.max_new_tokens:  # the head span
        raise ValueError("a response is longer than rollout.max_new_tokens")
    rows_bucket = max(ADVANTAGE_ROWS, 1 << max(len(packed.mask) - 1, 0).bit_length())
    advantages = np.asarray(compute_advantages(cfg.algorithm.estimator, packed.row_batch(rows_bucket),
                                               advantage_config(cfg)))[:len(packed.mask)]
    lengths = (packed.prompt_lengths + packed.response_lengths)[:n]
    return Credited(packed, advantages, lengths, length_buckets)

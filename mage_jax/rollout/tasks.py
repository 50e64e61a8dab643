"""Task sampling: which task instances, opponents and seats the meta-episodes of an iteration get.

docs/method.md §2 and §6. One training iteration plays ``B`` task instances, each replicated ``G`` times
into a *group* of meta-episodes that share the seed (same deal / board / puzzle / goal), the opponent
and the seat, so that the group mean is a baseline for exactly one situation.

Opponent assignment:

- ``stationary`` (MAGE default): group ``b`` meets the same opponent in every iteration of the run.
  Groups are assigned to opponents in contiguous blocks whose sizes follow the pool ratios
  (largest-remainder rounding), e.g. B = 16 with ratios 0.3 / 0.3 / 0.4 gives blocks 5 / 5 / 6.
- ``mixed`` (the non-stationary grouping ablation): the ``B·G`` meta-episodes of an iteration get
  opponents in the pool ratio (largest-remainder rounding over ``B·G``) in a random order, so the
  copies of one group meet different opponents.

Coverage: when one iteration has too few slots (groups, or meta-episodes in ``mixed`` mode) for the
rounding to give every pool member at least one, the assignment is laid out over a cycle of
``rotation_period`` iterations instead (the fewest whose slots give every member one or more, in the
same contiguous blocks) and iteration ``i`` takes the ``i mod period``-th slice: every opponent is
trained against, in the pool ratio over each cycle (e.g. B = 2 with 0.3 / 0.3 / 0.4: conservative
and aggressive in even iterations, intermediate in both groups of odd ones). A group still meets one
opponent per iteration. A pool whose rarest member would need more than ``MAX_ROTATION_PERIOD``
iterations is refused.

Seats (two-player games): ``first`` (seat 0), ``second`` (seat 1) or ``mixed``. A seat is part of
the task instance, so the ``G`` copies of a group always share it, in both grouping modes. In
``mixed`` mode, half of the groups of every opponent block (stationary) or of the iteration (mixed)
sit second, in an order drawn afresh each iteration; the extra groups of odd blocks are split evenly
too, so the batch as a whole is balanced to within one group. Single-agent tasks
(``opponents=None``) get seat ``None``.

Seeds: training task seeds are even, evaluation seeds odd, so the two streams never overlap for any
configuration. Everything is a pure function of ``(seed, iteration)`` (training) or of
``(eval_seed, n)`` (evaluation), which makes checkpoint/resume exact and lets every evaluation in
a run, and runs with different training seeds, use the same held-out instances.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

GROUPINGS = ("stationary", "mixed")
SEAT_MODES = ("first", "second", "mixed")
VALIDATION_STREAM = 0x5A11D
"""Random stream of the validation seeds (the evaluation's is 0xE7A1)."""
MAX_ROTATION_PERIOD = 1000
"""Longest cycle of iterations over which the opponent pool may be covered (see the module docstring)."""
_SEED_SPACE = 2**30  # task seeds are 2k (train) or 2k + 1 (eval) with 0 <= k < 2**30


@dataclasses.dataclass(frozen=True)
class Task:
    """One meta-episode to play: a task instance (seed), its opponent and seat, and its place in the batch.

    ``group`` is the index of the group (0..B-1) and ``meta_episode`` the index of the meta-episode
    (0..B·G-1) inside one ``sample_train`` / ``sample_eval`` result.
    """

    seed: int
    opponent: str | None
    seat: int | None
    group: int
    meta_episode: int
    copy: int = 0
    """Index of the meta-episode inside its group (0..G-1): seeds the opponent's own randomness, so
    the copies of a group meet independent opponent noise from one identical initial state."""


@dataclasses.dataclass(frozen=True)
class TaskSamplerConfig:
    """Shape of the task batch of one iteration (docs/method.md §2) and the opponent pool (§6).

    ``opponents`` maps opponent names to pool ratios (normalised here; need not sum to one), or is
    None for single-agent tasks. ``eval_seed`` fixes the held-out instances independently of the
    training ``seed``.
    """

    num_tasks: int = 16
    group_size: int = 8
    opponents: Mapping[str, float] | None = None
    grouping: str = "stationary"
    seats: str = "first"
    seed: int = 0
    eval_seed: int = 1_000_003

    def __post_init__(self) -> None:
        if not isinstance(self.num_tasks, int) or self.num_tasks < 1:
            raise ValueError(f"num_tasks must be a positive integer, got {self.num_tasks!r}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {self.group_size!r}")
        if self.grouping not in GROUPINGS:
            raise ValueError(f"grouping must be one of {GROUPINGS}, got {self.grouping!r}")
        if self.seats not in SEAT_MODES:
            raise ValueError(f"seats must be one of {SEAT_MODES}, got {self.seats!r}")
        if self.opponents is not None:
            if len(self.opponents) == 0:
                raise ValueError(
                    "opponents must name at least one opponent (or be None for single-agent tasks)"
                )
            for name, ratio in self.opponents.items():
                if not isinstance(name, str) or not name:
                    raise ValueError(f"opponent names must be non-empty strings, got {name!r}")
                if not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or ratio <= 0:
                    raise ValueError(f"opponent {name!r} needs a positive pool ratio, got {ratio!r}")
            # Freeze the mapping so the config stays hashable-in-spirit and immune to caller edits.
            object.__setattr__(self, "opponents", dict(self.opponents))
            slots = self.num_tasks if self.grouping == "stationary" else self.batch_size
            total = sum(self.opponents.values())
            if min(largest_remainder_counts(list(self.opponents.values()), slots * MAX_ROTATION_PERIOD)) == 0:
                rarest = min(self.opponents, key=self.opponents.get)
                raise ValueError(
                    f"opponent {rarest!r} (ratio {self.opponents[rarest] / total:.2g} of the pool) would not "
                    f"be met once in {MAX_ROTATION_PERIOD} iterations of {slots} "
                    f"{'groups' if self.grouping == 'stationary' else 'meta-episodes'}; raise its ratio")
        elif self.seats != "first":
            raise ValueError("seats other than 'first' need an opponent pool (two-player games)")

    @property
    def batch_size(self) -> int:
        """B·G: meta-episodes per training iteration."""
        return self.num_tasks * self.group_size


def largest_remainder_counts(ratios: Sequence[float], total: int) -> list[int]:
    """Integer counts summing to ``total`` that follow ``ratios`` as closely as possible.

    Ties in the remainders go to the earlier entry, so the result is deterministic.
    """
    weights = np.asarray(ratios, dtype=np.float64)
    if weights.ndim != 1 or weights.size == 0 or np.any(weights <= 0):
        raise ValueError(f"ratios must be a non-empty list of positive numbers, got {list(ratios)!r}")
    exact = weights / weights.sum() * total
    counts = np.floor(exact).astype(int)
    order = sorted(range(len(counts)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - int(counts.sum())]:
        counts[i] += 1
    return counts.tolist()


def _balanced_seats(count: int, rng: np.random.Generator, extra: int | None = None) -> list[int]:
    """``count`` seats, half 0 and half 1 in random order; an odd count's extra seat is ``extra``
    (drawn at random when None)."""
    seats = [0] * (count // 2) + [1] * (count // 2)
    if count % 2:
        seats.append(int(rng.integers(2)) if extra is None else int(extra))
    return [int(s) for s in rng.permutation(seats)]


class TaskSampler:
    """Deterministic task batches for training iterations and held-out evaluation.

    ``sample_train(i)`` depends only on the config and ``i``; calling it twice gives the same tasks.
    """

    def __init__(self, config: TaskSamplerConfig):
        self.config = config

    # -- opponents -----------------------------------------------------------------------------
    @property
    def opponent_names(self) -> list[str]:
        return list(self.config.opponents) if self.config.opponents else []

    def _slots(self) -> int:
        """Opponent slots of one iteration: the B groups (stationary) or the B·G meta-episodes (mixed)."""
        cfg = self.config
        return cfg.num_tasks if cfg.grouping == "stationary" else cfg.batch_size

    @property
    def rotation_period(self) -> int:
        """Iterations over which every pool member gets a slot: 1 when one iteration's rounding gives
        each at least one (the assignment is then the same every iteration), else the fewest that do."""
        cfg = self.config
        if not cfg.opponents:
            return 1
        ratios, slots = list(cfg.opponents.values()), self._slots()
        for period in range(1, MAX_ROTATION_PERIOD + 1):
            if min(largest_remainder_counts(ratios, slots * period)) > 0:
                return period
        raise ValueError(  # unreachable for pools TaskSamplerConfig accepts (checked there)
            "the opponent pool cannot be covered")

    def _opponent_slots(self, iteration: int) -> list[str]:
        """The opponents of the slots of iteration ``iteration``, in contiguous blocks (module docstring)."""
        cfg = self.config
        slots, period = self._slots(), self.rotation_period
        counts = largest_remainder_counts(list(cfg.opponents.values()), slots * period)
        cycle = [name for name, count in zip(cfg.opponents, counts) for _ in range(count)]
        start = (int(iteration) % period) * slots
        return cycle[start:start + slots]

    def group_opponents(self, iteration: int = 0) -> list[str | None]:
        """The stationary opponent of each of the B groups in iteration ``iteration`` (the same in every
        iteration unless the pool is covered over a ``rotation_period`` of several)."""
        cfg = self.config
        if not cfg.opponents:
            return [None] * cfg.num_tasks
        if cfg.grouping != "stationary":
            raise ValueError("group_opponents is the stationary grouping's assignment")
        return list(self._opponent_slots(iteration))

    def _seat_fixed(self) -> int | None:
        cfg = self.config
        if not cfg.opponents:
            return None
        return 0 if cfg.seats == "first" else 1 if cfg.seats == "second" else None

    # -- training ------------------------------------------------------------------------------
    def sample_train(self, iteration: int) -> list[Task]:
        """The B·G tasks of training iteration ``iteration`` (meta-episodes of a group are consecutive)."""
        if not isinstance(iteration, (int, np.integer)) or iteration < 0:
            raise ValueError(f"iteration must be a non-negative integer, got {iteration!r}")
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, int(iteration), 0x7A5C])
        ks = rng.choice(_SEED_SPACE, size=cfg.num_tasks, replace=False)
        seeds = [2 * int(k) for k in ks]  # training seeds are even

        B, G = cfg.num_tasks, cfg.group_size
        fixed_seat = self._seat_fixed()
        # Per-meta-episode opponent and per-group seat.
        if cfg.grouping == "stationary":
            group_opp = self.group_opponents(iteration)
            opponents: list[str | None] = [group_opp[b] for b in range(B) for _ in range(G)]
            if fixed_seat is not None or not cfg.opponents:
                group_seats = [fixed_seat] * B
            else:
                # Balance seats inside each opponent block so every opponent is met from both seats;
                # the extra groups of odd blocks come from one balanced draw, so the batch is too.
                blocks = [[b for b in range(B) if group_opp[b] == name] for name in cfg.opponents]
                extras = iter(_balanced_seats(sum(len(m) % 2 for m in blocks), rng))
                group_seats: list[int | None] = [None] * B
                for members in blocks:
                    extra = next(extras) if len(members) % 2 else None
                    for b, seat in zip(members, _balanced_seats(len(members), rng, extra)):
                        group_seats[b] = seat
        else:  # mixed opponents inside a group
            if cfg.opponents:
                pool = self._opponent_slots(iteration)
                opponents = [pool[i] for i in rng.permutation(len(pool))]
            else:
                opponents = [None] * (B * G)
            group_seats = (
                [fixed_seat] * B if fixed_seat is not None or not cfg.opponents else _balanced_seats(B, rng)
            )

        return [
            Task(
                seed=seeds[b],
                opponent=opponents[b * G + g],
                seat=group_seats[b],
                group=b,
                meta_episode=b * G + g,
                copy=g,
            )
            for b in range(B)
            for g in range(G)
        ]

    # -- evaluation ----------------------------------------------------------------------------
    def eval_seeds(self, n: int, *, stream: int = 0xE7A1) -> list[int]:
        """The ``n`` held-out task seeds (odd; disjoint from every training seed)."""
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"the number of evaluation tasks must be a positive integer, got {n!r}")
        rng = np.random.default_rng([self.config.eval_seed, stream])
        ks = rng.choice(_SEED_SPACE, size=int(n), replace=False)
        return [2 * int(k) + 1 for k in ks]

    def sample_validation(self, n: int) -> list[Task]:
        """``n`` held-out tasks for checkpoint selection: like ``sample_eval(n)`` (training pool, training
        seats) on seeds of their own stream, so selection never sees an evaluation instance."""
        return self.sample_eval(n, stream=VALIDATION_STREAM)

    def sample_eval(self, n: int, opponent: str | None = None, seat: int | str | None = None, *,
                    stream: int = 0xE7A1) -> list[Task]:
        """``n`` held-out tasks with group size 1 (each meta-episode is its own group).

        ``opponent``: a name (may be outside the training pool, e.g. a held-out CFR opponent), or None
        to spread the tasks over the training pool by its ratios (None for single-agent tasks).
        ``seat``: 0, 1, ``"first"``, ``"second"``, ``"mixed"`` (alternating), or None for the
        training seat mode. The same ``n`` gives the same seeds whatever the opponent and seat, so
        results against different opponents are measured on the same deals.
        """
        cfg = self.config
        seeds = self.eval_seeds(n, stream=stream)
        if opponent is not None:
            opponents: list[str | None] = [opponent] * n
        elif cfg.opponents:
            counts = largest_remainder_counts(list(cfg.opponents.values()), n)
            opponents = [name for name, c in zip(cfg.opponents, counts) for _ in range(c)]
        else:
            opponents = [None] * n
        two_player = opponent is not None or bool(cfg.opponents)
        mode = cfg.seats if seat is None else seat
        if not two_player:
            seats: list[int | None] = [None] * n
        elif mode in (0, "first"):
            seats = [0] * n
        elif mode in (1, "second"):
            seats = [1] * n
        elif mode == "mixed":
            seats = [i % 2 for i in range(n)]
        else:
            raise ValueError(f"seat must be 0, 1, 'first', 'second', 'mixed' or None, got {seat!r}")
        return [
            Task(seed=seeds[i], opponent=opponents[i], seat=seats[i], group=i, meta_episode=i)
            for i in range(n)
        ]

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Sampling is a pure function of the config and the iteration; the state records the config."""
        cfg = self.config
        return {
            "seed": cfg.seed,
            "eval_seed": cfg.eval_seed,
            "num_tasks": cfg.num_tasks,
            "group_size": cfg.group_size,
            "grouping": cfg.grouping,
            "seats": cfg.seats,
            "opponents": dict(cfg.opponents) if cfg.opponents else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check that a checkpoint was written with the same task stream (resuming another is an error)."""
        mine = self.state_dict()
        diffs = [k for k in mine if k in state and state[k] != mine[k]]
        if diffs:
            detail = ", ".join(f"{k}: checkpoint {state[k]!r} vs config {mine[k]!r}" for k in diffs)
            raise ValueError(f"the checkpoint's task sampler differs from this config ({detail})")
